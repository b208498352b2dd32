"""The two small launches of a decode step around attention, at Qwen3-8B decode shapes (8 KV heads, 32 query heads,
d 128), against the launches they replaced, each timed as 50 back-to-back calls in one CUDA graph (median of 30):

- the split reduce with R_V^T inside (`merge.reduce_splits_triton(..., v_rotation, bf16)`) against the plain reduce
  then `step_kernels.rotate_heads(transpose=True)`, at the split counts of 128K x 1, 8 and 32;
- `step_kernels.append_rows_rotate_queries` against `append_rows` then `rotate_heads`, at 1, 8 and 32 rows.

    python bench/bench_step_launches.py > bench/results/step_launches_<GPU>.log
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from runtime_kernels import step_kernels as sk  # noqa: E402
from runtime_kernels.attention.int2_decode import merge  # noqa: E402


def graph_us(fn, n: int = 50, reps: int = 30) -> float:
    """Median microseconds per call of `fn`, n calls captured in one CUDA graph (`common.events_ms`)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    return common.events_ms(graph, n, reps) * 1e3


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("bench_step_launches: needs a CUDA GPU")
    rot = torch.linalg.qr(torch.randn(8, 128, 128, device="cuda"))[0].contiguous()
    for b, s in ((1, 236), (8, 62), (32, 40)):  # the decode grid's splits at 128K (history + window)
        o = torch.randn(b, 32, s, 128, device="cuda")
        lse = torch.randn(b, 32, s, device="cuda")

        def two():
            x, _ = merge.reduce_splits_triton(o, lse)
            sk.rotate_heads(x, rot, transpose=True, out_dtype=torch.bfloat16, validate=False)

        one = graph_us(lambda: merge.reduce_splits_triton(o, lse, rot, torch.bfloat16))
        print(f"b={b} S={s}: reduce + rotate_heads {graph_us(two):.2f} us, reduce with R_V^T {one:.2f} us",
              flush=True)
    for b in (1, 8, 32):
        kv = torch.randn(b, 48, 128, device="cuda").bfloat16()
        keys, values, q = kv[:, 32:40], kv[:, 40:], kv[:, :32]
        k_win, v_win = (torch.randn(b, 8, 1215, 128, device="cuda").bfloat16() for _ in range(2))
        idx, rows = torch.arange(b, device="cuda"), torch.full((b,), 700, device="cuda")

        def two():
            sk.append_rows(keys, values, rot, rot, idx, idx, rows, k_win, v_win, validate=False)
            sk.rotate_heads(q, rot, out_dtype=torch.bfloat16, validate=False)

        one = graph_us(lambda: sk.append_rows_rotate_queries(keys, values, rot, rot, idx, idx, rows, k_win, v_win, q,
                                                             validate=False))
        print(f"b={b}: append_rows + rotate_heads {graph_us(two):.2f} us, one launch {one:.2f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
