"""A cross-check of bench_decode_graph.py's timings: one decode call (two launches, whole pages) of whichever
runtime_kernels is on PYTHONPATH, timed in the plainest harness (16 distinct layers in one CUDA graph, 50 replays,
CUDA events), so trees with either decode API are timed on the same inputs.

    cd /tmp && BENCH_DIR=REPO/bench PYTHONPATH=REPO python3 REPO/bench/decode_plain_graph.py CONTEXT BATCH \
        float16|ue5m3 WINDOW

(run from outside the repo so the script's own directory does not shadow PYTHONPATH's tree). ue5m3 runs centered,
as the recipe ships.
"""
import os, sys, torch
sys.path.insert(0, os.environ["BENCH_DIR"])
import common
import runtime_kernels
from runtime_kernels import attention as A
ctx, batch, fmt, window = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
layers = [common.decode_inputs(batch, ctx, seed=ctx + batch + i, scale_format=fmt, window=window) for i in range(16)]
if hasattr(A, "PagePools"):
    means = common.decode_means(ctx + batch) if fmt == "ue5m3" else None
    recs = [common.decode_records(a, means) for a in layers]
    call = lambda r: A.decode_attention(*r, fused=False, validate=False)
else:
    recs = layers
    call = lambda a: A.decode_attention(*a, whole_pages=True, fused=False)
for r in recs:
    call(r)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for r in recs:
        call(r)
for _ in range(5):
    g.replay()
torch.cuda.synchronize()
ts = []
for _ in range(50):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); g.replay(); e.record(); torch.cuda.synchronize()
    ts.append(s.elapsed_time(e) / len(recs))
ts.sort()
print(f"{os.path.dirname(os.path.dirname(runtime_kernels.__file__))} {fmt} {window} {ctx}x{batch} median {ts[len(ts)//2]:.4f} ms/call p20 {ts[10]:.4f}")
