"""The decode kernels reproduce, bit for bit, the outputs that the pre-refactor default kernel gave.

`tests/data/decode_reference.safetensors` holds inputs and outputs recorded under TRITON_INTERPRET=1 by a throw-away
script (`git show b5e2c6b:tests/data/make_decode_reference.py`), run at commit b5e2c6b, whose kernels are those of
main at 90430f9, i.e. before the kernel folder was rebuilt; re-recorded there on 2026-12-04 with numpy's OpenBLAS
pinned to its Haswell kernel, as tests/conftest.py pins it (the interpreter's dots go through OpenBLAS, whose
AVX2 and AVX-512 kernels round differently, so bits recorded on one kind of CPU did not hold on the other). The
whole-page cases were re-recorded on 2026-12-05 by `tests/data/rerecord_whole_page_reference.py`, after a deliberate
change of the whole-page loop's arithmetic (the column scale inside the softmax exponent's FMA, per-lane softmax
sums): their outputs moved by at most 1.0e-4 (1.4e-5 of the case's largest output; 3.0e-7 to 6.4e-6 in the other
cases), and their error against the torch reference did not change in its first three digits. The masked-tile,
tail and fallback cases keep the 90430f9 bits. The cases cover head_dim 64/128/256, GQA 1/4/8, whole pages (int8
and fp16 scores, paired and separate V pools; the paired cases are also run on quad pools, which must give the same
bits) and a masked tail, one and several splits, the one- and two-launch grid, history-only calls, empty histories
and the fallback kernel (fp32 queries, 32-channel scale groups). On the GPU the same claim is checked by
`bench/compare_decode_bitwise.py` at docs/kernels.md's decode points.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from runtime_kernels import attention as A
from runtime_kernels.attention.int2_decode.pools import alloc_paired_v_pools, paired_v_pools
from tests.kernel_helpers import batch_of, decode_inputs, pages_of, relayout

pytestmark = pytest.mark.interpreter

DATA = Path(__file__).parent / "data" / "decode_reference.safetensors"
POOL = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "block_table", "hist_len")


def _cases() -> dict:
    with safe_open(DATA, "pt") as f:
        return json.loads(f.metadata()["cases"])


CASES = _cases()
TENSORS = load_file(DATA)


def run_case(name: str, meta: dict, quad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The recorded case's call on its recorded pools (quad: with the four scale/zero pools copied into one quad
    buffer instead, the layout the cache allocates)."""
    t = {k.split(".", 1)[1]: v for k, v in TENSORS.items() if k.startswith(name + ".")}
    if meta["paired_v"]:
        vs, vz = alloc_paired_v_pools(*t["v_scale"].shape[:3], t["v_scale"].device)
        vs.copy_(t["v_scale"])
        vz.copy_(t["v_zero"])
        assert paired_v_pools(vs, vz)
        t["v_scale"], t["v_zero"] = vs, vz
    pool = [t[k] for k in POOL]
    if quad:
        pool = list(relayout(pool, "quad"))
    if meta["mode"] == "history":
        return A.int2_decode_attention(t["q"], pages_of(pool), batch_of(pool, whole_pages=meta["whole_pages"]),
                                       backend="triton", num_splits=meta["splits"])
    return A.decode_attention(t["q"], *decode_inputs(pool, t["k_win"], t["v_win"], t["slot_ids"], t["win_len"],
                                                     meta["whole_pages"]),
                              backend="triton", num_splits=meta["splits"], fused=meta["mode"] == "fused")


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_outputs_are_bit_identical_to_the_recorded_kernel(name):
    o, lse = run_case(name, CASES[name])
    assert torch.equal(o, TENSORS[f"{name}.o"]), f"{name}: o differs, max |diff| " \
        f"{(o - TENSORS[f'{name}.o']).abs().max().item():.3e}"
    assert torch.equal(lse, TENSORS[f"{name}.lse"])


@pytest.mark.parametrize("name", sorted(n for n, m in CASES.items() if m["paired_v"]))
def test_quad_scale_pools_give_the_recorded_bits(name):
    """The whole-page cases with one group per row, on quad pools (a row's four scale/zero entries read with one
    load and decoded together): the recorded bits, unchanged."""
    o, lse = run_case(name, CASES[name], quad=True)
    assert torch.equal(o, TENSORS[f"{name}.o"]), f"{name}: o differs, max |diff| " \
        f"{(o - TENSORS[f'{name}.o']).abs().max().item():.3e}"
    assert torch.equal(lse, TENSORS[f"{name}.lse"])
