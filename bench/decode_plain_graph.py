"""A cross-check of bench_decode_graph.py's timings: one decode call (two launches, whole pages) of whichever
runtime_kernels is on PYTHONPATH, timed in the plainest harness (16 distinct layers in one CUDA graph, 50 replays,
CUDA events), so trees with either decode API are timed on the same inputs.

    cd /tmp && BENCH_DIR=REPO/bench PYTHONPATH=REPO python3 REPO/bench/decode_plain_graph.py CONTEXT BATCH \
        float16|ue5m3 WINDOW

(run from outside the repo so the script's own directory does not shadow PYTHONPATH's tree). ue5m3 runs centered,
as the recipe ships.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.environ["BENCH_DIR"])
import common  # noqa: E402

import runtime_kernels  # noqa: E402
from runtime_kernels import attention as A  # noqa: E402


def main() -> None:
    ctx, batch, fmt, window = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    layers = [common.decode_inputs(batch, ctx, seed=ctx + batch + i, scale_format=fmt, window=window)
              for i in range(16)]
    if hasattr(A, "PagePools"):  # the record API
        means = common.decode_means(ctx + batch) if fmt == "ue5m3" else None
        recs = [common.decode_records(a, means, scale_format=fmt) for a in layers]

        def call(r):
            return A.decode_attention(*r, fused=False, validate=False)
    else:  # a tree from before the records: 13 loose tensors
        recs = layers

        def call(a):
            return A.decode_attention(*a, whole_pages=True, fused=False)
    for r in recs:  # compile outside the graph
        call(r)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in recs:
            call(r)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / len(recs))
    times.sort()
    tree = os.path.dirname(os.path.dirname(runtime_kernels.__file__))
    print(f"{tree} {fmt} {window} {ctx}x{batch} median {times[len(times) // 2]:.4f} ms/call p20 {times[10]:.4f}")


if __name__ == "__main__":
    main()
