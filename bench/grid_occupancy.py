"""Offline occupancy of the production decode grid (no GPU needed): registers, shared memory, spills and programs
per SM of `fused._decode_grid_kernel`, compiled for sm_90, at several model geometries, uncapped and under the first
register caps (`DecodeOptions.maxnreg`) at which one more warp fits an SM sub-partition. (A rule that took the
spill-free cap with the most programs, `occupancy_cap`, lost at every point timed on an H100 and was removed:
docs/kernels.md.)

    python3 bench/grid_occupancy.py                                   # the geometries below, the recipe's pools
    python3 bench/grid_occupancy.py --geometry 8,32,128 --scale-format float16 --uncentered
    PYTHONPATH=/opt/tr36:. python3 bench/grid_occupancy.py           # with the H200 image's Triton (3.6)

Builds decode inputs of each geometry on the CPU (`common.decode_inputs(..., geometry=...)`), asks the
product's planner for the compiled plan, and compiles the grid through `launch.launch_grid(..., warmup=True)` with
Triton's offline compiler in place of a GPU warmup (`offline_compile.py`): the arguments and constexprs a launch
would pass. Spills are
the kernel's local-memory stack (`cuobjdump --dump-resource-usage`); on a GPU the product reads the driver's
`n_spills`, the same count. Counts can differ a little with another Triton than the GPU machine's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from offline_compile import compile_launch, resources  # noqa: E402

from runtime_kernels.attention.int2_decode import fused, launch  # noqa: E402

# (KV heads, query heads, head_dim): Qwen3-8B, SmolLM2-135M, Llama-3-70B-like GQA 8, Qwen2.5-7B (GQA 7), head_dim 256
GEOMETRIES = [(8, 32, 128), (3, 9, 64), (8, 64, 128), (4, 28, 128), (8, 32, 256)]


def occupancy_caps(n_regs: int, regs_per_sm: int = 65536) -> list[int]:
    """Register caps below n_regs, highest first, each the most registers per thread at which one more warp fits
    an SM sub-partition than at the cap before it (Hopper: 128, 96, 80, 72, 64), as `launch.programs_per_sm_limit`
    allocates registers."""
    per_sub = regs_per_sm // 4
    warps = per_sub // (-(-max(1, n_regs) * 32 // 256) * 256)
    caps = [per_sub // w // 32 // 8 * 8 for w in range(warps + 1, 9)]
    return [c for c in caps if 24 <= c < n_regs]


def grid_resources(geometry: tuple[int, int, int], scale_format: str, centered: bool,
                   maxnreg: int | None, prefetch_tiles: int = launch.DEFAULT_OPTIONS.prefetch_tiles) -> dict:
    """`resources` of the production grid at a (KV heads, query heads, head_dim) geometry, batch 1, 4K context."""
    args = common.decode_inputs(1, 4096, seed=0, device="cpu", scale_format=scale_format, geometry=geometry)
    means = common.decode_means(0, "cpu", geometry) if centered else None
    q, pages, batch, windows = common.decode_records(args, means, scale_format=scale_format)
    opts = launch.DecodeOptions(maxnreg=maxnreg, prefetch_tiles=prefetch_tiles)
    plan = launch.plan_decode(q, pages, windows, True, opts, compiled=True)
    counters = torch.zeros(geometry[0], dtype=torch.int32)
    compiled = compile_launch(fused, "_decode_grid_kernel", lambda: launch.launch_grid(
        q, pages, batch, windows, plan, counters, 1.0, 3, 1, opts, warmup=True))
    r = resources(compiled)
    return dict(r, programs=launch.programs_per_sm_limit(r["regs"], r["shared"], 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", action="append", default=[], metavar="H_KV,H_Q,D",
                    help="repeatable; default: " + " ".join(",".join(map(str, g)) for g in GEOMETRIES))
    ap.add_argument("--scale-format", default="ue5m3", choices=["ue5m3", "float16"])
    ap.add_argument("--uncentered", action="store_true")
    ap.add_argument("--prefetch-tiles", type=int, default=launch.DEFAULT_OPTIONS.prefetch_tiles,
                    help="DecodeOptions.prefetch_tiles of the grid")
    ap.add_argument("--caps", type=int, default=2, help="how many occupancy caps below the uncapped count to compile")
    args = ap.parse_args()
    try:
        geometries = [tuple(int(x) for x in g.split(",")) for g in args.geometry] or GEOMETRIES
        if any(len(g) != 3 or g[1] % g[0] for g in geometries):
            raise ValueError
    except ValueError:
        sys.exit(f"grid_occupancy: --geometry: expected H_KV,H_Q,D with H_Q a multiple of H_KV, got {args.geometry}")
    centered = not args.uncentered
    print(f"triton {triton.__version__}, sm_90, {args.scale_format}, {'centered' if centered else 'uncentered'}, "
          f"prefetch tiles {args.prefetch_tiles}; "
          "programs per SM from registers and shared memory (one warp each)")
    print("| H_kv / H_q / d | cap | registers | shared (B) | spill stack (B) | programs per SM |")
    print("|---|---|---|---|---|---|")
    for g in geometries:
        base = grid_resources(g, args.scale_format, centered, None, args.prefetch_tiles)
        rows = [(None, base)] + [(cap, grid_resources(g, args.scale_format, centered, cap, args.prefetch_tiles))
                                 for cap in occupancy_caps(base["regs"])[:args.caps]]
        for cap, r in rows:
            print(f"| {'/'.join(map(str, g))} | {cap or 'none'} | {r['regs']} | {r['shared']} | {r['stack']} | "
                  f"{r['programs']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
