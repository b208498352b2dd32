"""Re-record the whole-page cases of `decode_reference.safetensors` with the current kernels, after a deliberate
change of the whole-page loop's arithmetic (docs/kernels.md says which). The masked-tile, tail and fallback cases
keep the bits of the kernel they were first recorded from. Same interpreter and BLAS pin as the tests:

    python3 tests/data/rerecord_whole_page_reference.py

Prints each re-recorded case's largest change, so the commit that carries the new file can quote it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tests.conftest  # noqa: E402,F401,I001  (first: pins OpenBLAS, sets TRITON_INTERPRET before numpy/triton load)

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.test_decode_bitwise import CASES, DATA, TENSORS, run_case  # noqa: E402


def main() -> int:
    with safe_open(DATA, "pt") as f:
        metadata = f.metadata()
    tensors = dict(TENSORS)
    for name, meta in sorted(CASES.items()):
        if not meta["whole_pages"]:
            continue
        o, lse = run_case(name, meta)
        old_o, old_lse = tensors[f"{name}.o"], tensors[f"{name}.lse"]
        print(f"{name}: max |o - recorded| {(o - old_o).abs().max().item():.3e} "
              f"(max |recorded| {old_o.abs().max().item():.3e}), max |lse - recorded| "
              f"{(lse - old_lse).abs().max().item():.3e}")
        tensors[f"{name}.o"], tensors[f"{name}.lse"] = o.contiguous(), lse.contiguous()
    save_file(tensors, str(DATA), metadata=metadata)
    return 0


if __name__ == "__main__":
    sys.exit(main())
