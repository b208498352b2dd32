#!/usr/bin/env python3
"""Time the teacher-forced evaluator's two ways through an INT2 layer on one window: the scores path (explicit
`[T, S]` fp32 scores in slices of query rows; what the per-layer statistics need) and the union SDPA (one fp32 SDPA
over `[K; Khat]` with the mask `[exact, ~exact]`; every study row without statistics), with the BF16 row beside them.
Each row also records its NLL, so the two paths are seen to agree on the model measured.

    python3 bench/bench_eval_paths.py --model ~/.cache/oscar-calib/smollm2-135m --text T/heldout.txt \
        --context 8192 --out bench/results

Writes `eval_paths_<GPU or cpu>.json` (bench/common.py's schema: meta with versions and commit, rows with medians).
KIVI-2 stands for the INT2 row: both paths fake-quantize alike, so the row's method does not move the comparison.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from common import row, write_rows  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a Hugging Face model directory")
    p.add_argument("--text", type=Path, required=True, help="held-out text; the window is its first --context tokens")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    from recipe_study import chunks, token_stream
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oscar_calib.analysis.evaluate import method_nll
    from oscar_calib.analysis.methods import Kivi2, KVMethod
    from runtime_kernels.format import DEFAULT_FORMAT

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # as the studies run: fp32 attention stays fp32
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    window = chunks(token_stream(tok, args.text), args.context, 1)
    kivi = Kivi2("kivi2-g128", "KIVI-2", token_group=128)
    cases = [("bf16", KVMethod(), False), ("int2, scores path", kivi, True), ("int2, union sdpa", kivi, False)]
    rows = []
    for name, method, stats in cases:
        times, nll = [], None
        for _ in range(args.repeats + 1):  # the first run warms up (allocator, kernels)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            nll, _ = method_nll(model, method, window, DEFAULT_FORMAT, collect_stats=stats)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(1000 * (time.perf_counter() - t))
        ts = sorted(times[1:])
        pick = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
        rows.append(row("eval_window", name, {"model": args.model.name, "context": args.context, "dtype": str(dtype)},
                        (pick(0.5), pick(0.2), pick(0.8)), nll_mean=float(nll.double().mean()),
                        peak_mem_gib=(torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None)))
        print(f"{name}: {rows[-1]['p50_ms']:.0f} ms per window, NLL {rows[-1]['nll_mean']:.5f}", flush=True)
    path = write_rows(str(args.out), "eval_paths", rows)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
