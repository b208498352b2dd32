"""One INT2 decode kernel launch per variant at a chosen point, for Nsight Compute (stall reasons, occupancy,
bandwidth). Run on the GPU machine:

    ncu --clock-control none -k regex:_int2_decode --section WarpStateStats --section SchedulerStats \\
        --section Occupancy --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        python3 bench/profile_decode.py --impls 5,6 --point 131072x8

Each variant is launched twice (the first compiles); time the same launches with `--time` (no ncu)."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import H_KV, H_Q, PAGE, D, make_int2_cache  # noqa: E402

from runtime_kernels import attention as A  # noqa: E402
from runtime_kernels.attention import triton_int2  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="5,6")
    ap.add_argument("--point", default="131072x8", help="CONTEXTxBATCH")
    ap.add_argument("--pps", default=str(A.INT2_PROGRAMS_PER_SM), help="programs per SM (split rule; 0 = the library's wave rule), comma-separated")
    ap.add_argument("--stages", default="3", help="comma-separated")
    ap.add_argument("--maxnreg", default="0", help="register caps, comma-separated (0: none)")
    ap.add_argument("--block-n", default="64", help="tile sizes, comma-separated")
    ap.add_argument("--whole", default="0", help="whole_pages promise (0 masked, 1 unmasked loop), comma-separated")
    ap.add_argument("--time", action="store_true", help="also time each launch with do_bench")
    ap.add_argument("--page", type=int, default=PAGE, help="page size of the pools (tokens)")
    args = ap.parse_args()
    triton_int2.strict_impl(True)
    context, batch = (int(x) for x in args.point.lower().split("x"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    pools, table, hist_len, *_ = make_int2_cache(batch, context, gen, args.page)
    q = torch.randn(batch, H_Q, D, device="cuda", generator=gen).to(torch.bfloat16)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    for impl, pps, stages, maxnreg, block_n, whole in itertools.product(
            ints(args.impls), ints(args.pps), ints(args.stages), ints(args.maxnreg), ints(args.block_n),
            ints(args.whole)):
        triton_int2.IMPL5_MAXNREG = maxnreg or None
        if pps:
            splits = A.default_num_splits(batch, H_KV, table.shape[1] * args.page, q.device, programs_per_sm=pps,
                                          block_n=block_n)
        else:  # the library rule: whole waves of resident programs
            splits = A.int2_num_splits(q, *pools, table, hist_len, block_n, 1, stages, impl, bool(whole))
        o = torch.empty(batch, H_Q, splits, D, device="cuda")
        lse = torch.empty(batch, H_Q, splits, device="cuda")
        triton_int2.IMPL5_MAXNREG = maxnreg or None
        fn = lambda: triton_int2.launch_int2_decode(q, *pools, table, hist_len, o, lse, 1 / math.sqrt(D),  # noqa: E731
                                                    splits, 0, block_n, 1, stages, impl,
                                                    whole_pages=bool(whole))
        try:
            k = fn()
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, the others still run
            print(f"impl {impl} pps {pps} stages {stages} maxnreg {maxnreg} block_n {block_n} "
                  f"whole {whole}: ERROR {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
            continue
        line = (f"impl {impl} pps {pps} stages {stages} maxnreg {maxnreg} block_n {block_n} "
                f"whole {whole}: {splits} splits, {k.n_regs} regs, "
                f"{k.n_spills} spills, {k.metadata.shared} B smem")
        if args.time:
            line += f", {triton.testing.do_bench(fn, warmup=20, rep=100):.4f} ms"
        print(line, flush=True)
    triton_int2.IMPL5_MAXNREG = None


if __name__ == "__main__":
    main()
