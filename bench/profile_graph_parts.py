"""Where the time of one decode attention call goes under CUDA graphs: the INT2 kernel alone, the window kernel
alone, the split reduce alone, the whole three-launch call, the two-launch call (`DECODE_SHARED_GRID`) and the fused
call, each as its own graph of 48+ calls over distinct per-layer caches (as in `bench_decode_graph.py`), for
several INT2 kernel variants, repeated in interleaved rounds so that run-to-run drift shows. Run on the GPU machine:

    python3 bench/profile_graph_parts.py --impls 5,6 --point 131072x8 --rounds 3 > OUT/graph_parts.txt

Prints one line per (round, impl, part): ms per call. The parts do not add up exactly: consecutive kernels of a
graph overlap their launch with the previous kernel's tail.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import DEV, H_KV, H_Q, D  # noqa: E402
from bench_decode_graph import (  # noqa: E402
    MIN_CALLS,
    point_inputs,
    repeat_to,
    time_graph,
    variant_layers,
)

from runtime_kernels import attention as A  # noqa: E402
from runtime_kernels.attention import merge, triton_int2, triton_window  # noqa: E402

PARTS = ("int2", "window", "reduce", "call", "shared", "fused")


def parts(impl: int, batch: int, context: int, layers: int, pools, tables, hist_len, k_win, v_win, slots, win_len,
          q) -> dict:
    """ms per call of each part for one INT2 variant."""
    scale = 1.0 / D ** 0.5
    s_h = A.int2_num_splits(q, *pools, tables[0], hist_len, 64, A.INT2_NUM_WARPS, 3, impl, True)
    s_w = A.default_num_splits(batch, H_KV, k_win.shape[2], q.device, block_n=64, min_tokens=64)
    bufs = [(torch.empty(batch, H_Q, s_h + s_w, D, device=DEV), torch.empty(batch, H_Q, s_h + s_w, device=DEV))
            for _ in range(layers)]

    def int2(i):
        triton_int2.launch_int2_decode(q, *pools, tables[i], hist_len, *bufs[i], scale, s_h, 0, 64,
                                       A.INT2_NUM_WARPS, 3, impl, whole_pages=True)

    def window(i):
        triton_window.launch_window_decode(q, k_win, v_win, slots[i], win_len, *bufs[i], scale, s_w, s_h, 64)

    def reduce(i):
        merge.reduce_splits_triton(*bufs[i])

    for i in range(layers):  # real partials in every buffer before the reduce is timed alone
        int2(i)
        window(i)
    out = {"splits": (s_h, s_w)}
    for name, fn in (("int2", int2), ("window", window), ("reduce", reduce)):
        out[name] = time_graph(repeat_to([lambda i=i, fn=fn: fn(i) for i in range(layers)], MIN_CALLS))
    shared_default = A.DECODE_SHARED_GRID
    for name, fused, shared in (("call", False, False), ("shared", False, True), ("fused", True, False)):
        A.DECODE_SHARED_GRID = shared  # "call": three launches, "shared": two (history + window grid, reduce)
        out[name] = time_graph(repeat_to([lambda i=i, fused=fused: A.decode_attention(
            q, *pools, tables[i], hist_len, k_win, v_win, slots[i], win_len, impl=impl, whole_pages=True,
            fused=fused) for i in range(layers)], MIN_CALLS))
    A.DECODE_SHARED_GRID = shared_default
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="6")
    ap.add_argument("--point", default="131072x8", help="CONTEXTxBATCH, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; ms per call under CUDA graphs")
    for point in args.point.split(","):
        context, batch, gen, q = point_inputs(point)
        layers, pools, tables, hist_len, k_win, v_win, slots, win_len = variant_layers(batch, context, gen)
        rows: dict[str, list] = {}
        for r in range(args.rounds):
            for impl in (int(x) for x in args.impls.split(",")):
                res = parts(impl, batch, context, layers, pools, tables, hist_len, k_win, v_win, slots, win_len, q)
                rows.setdefault(str(impl), []).append(res)
                print(f"{point} round {r} impl {impl} splits {res['splits']}: " + ", ".join(
                    f"{k} {res[k]:.4f}" for k in PARTS), flush=True)
        for impl, rs in rows.items():
            print(f"{point} impl {impl} median: " + ", ".join(
                f"{k} {statistics.median(x[k] for x in rs):.4f}" for k in PARTS))


if __name__ == "__main__":
    main()
