"""Offline instruction counts of the production decode kernel's tile loop (no GPU needed).

    python3 bench/sass_loop_stats.py                              # the shipped format (ue5m3, centered, quad pools)
    python3 bench/sass_loop_stats.py --scale-format float16 --uncentered
    python3 bench/sass_loop_stats.py --maxnreg 128
    python3 bench/sass_loop_stats.py --whole                     # also what each program pays once
    python3 bench/sass_loop_stats.py --prefetch-tiles 2          # with the L2 prefetch of the first tiles
    PYTHONPATH=/opt/tr36:. python3 bench/sass_loop_stats.py      # with the H200 image's Triton (pip install
                                                                 # --target /opt/tr36 --no-deps triton==3.6.0)

Builds decode inputs of the Qwen3-8B geometry on the CPU (`common.decode_inputs`), asks the product's own planner for
the compiled plan (`plan_decode(..., compiled=True)`: the constexprs a GPU launch would use), compiles the history
kernel `kernel._int2_decode_kernel` for sm_90 with the installed Triton, disassembles it with Triton's bundled
nvdisasm, and counts the SASS instructions per thread between the tile loop's label and its backward branch: one
64-token tile of one program (one warp). Prints the count by opcode family, grouped by what they do, and the
registers per thread. The installed Triton may differ from the GPU machine's (counts then differ a little).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from offline_compile import compile_launch, disassemble, resources  # noqa: E402

from runtime_kernels.attention.int2_decode import kernel, launch  # noqa: E402

OP = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)")
# What each opcode family mostly does in this loop (docs/kernels.md, "Where the instructions go").
GROUPS = {
    "code unpack (LOP3, SHF, PRMT)": ("LOP3", "SHF", "PRMT"),
    "tensor-core MMAs (HMMA, IMMA)": ("HMMA", "IMMA"),
    "float math (FFMA, FMUL, FADD, FMNMX, MUFU, HADD2)": ("FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "HADD2"),
    "conversions (I2F, I2FP, F2FP, F2F)": ("I2F", "I2FP", "F2FP", "F2F"),
    "addressing (IMAD, IADD3, LEA, VIADD, UIADD3, MOV)": ("IMAD", "IADD3", "LEA", "VIADD", "UIADD3", "MOV"),
    "loads and copies (LDGSTS, LDSM, LDS, STS, LDG, LDGDEPBAR, DEPBAR)": ("LDGSTS", "LDSM", "LDS", "STS", "LDG",
                                                                          "LDGDEPBAR", "DEPBAR"),
    "lane exchange (SHFL, REDUX)": ("SHFL", "REDUX"),
}

# Opcode families Hopper issues to its integer ALU pipe (half a warp instruction per cycle and scheduler: 16 lanes),
# the pipe Nsight Compute found busiest in this loop (docs/kernels.md, "Integer ALU work per tile"). IMAD and the
# float multiply-adds go to the FMA pipes instead, I2F and MUFU to XU.
ALU_PIPE = ("LOP3", "SHF", "PRMT", "IADD3", "VIADD", "LEA", "FMNMX", "ISETP", "FSETP", "SEL", "FSEL", "I2FP", "F2FP")

def compile_history_kernel(scale_format: str, centered: bool, maxnreg: int | None, num_stages: int,
                           prefetch_tiles: int = launch.DEFAULT_OPTIONS.prefetch_tiles):
    """-> (compiled kernel, plan) of the history kernel for the recipe's pools at Qwen3-8B geometry (batch 8),
    compiled offline from the arguments `launch.launch_history` passes."""
    args = common.decode_inputs(8, 8192, seed=0, device="cpu", scale_format=scale_format)
    q, pages, batch, _ = common.decode_records(args, common.decode_means(0, "cpu") if centered else None,
                                                   scale_format=scale_format)
    opts = launch.DecodeOptions(num_stages=num_stages, maxnreg=maxnreg, prefetch_tiles=prefetch_tiles)
    plan = launch.plan_decode(q, pages, None, batch.whole_pages, opts, compiled=True)
    o_part = torch.empty(q.shape[0], q.shape[1], 3, q.shape[2])  # three splits' partials, as a launch passes them
    lse_part = torch.empty(q.shape[0], q.shape[1], 3)
    compiled = compile_launch(kernel, "_int2_decode_kernel", lambda: launch.launch_history(
        q, pages, batch, plan, o_part, lse_part, 1.0, 3, 0, opts, warmup=True))
    return compiled, plan


def _opcodes(lines: list[str]) -> collections.Counter:
    """Opcode family -> count over SASS lines."""
    return collections.Counter(m.group(2).split(".")[0] for m in map(OP.match, lines) if m)


def loop_stats(compiled) -> dict:
    """SASS opcode counts of the innermost backward-branch loop that holds the MMAs, registers per thread, and the
    static opcode counts of the parts around it: the prologue (before the outermost loop with MMAs), the rest of that
    outer loop (the per-block page-id work around the tile loop) and the epilogue (after it)."""
    lines = disassemble(compiled).splitlines()
    labels = {ln.strip().rstrip(":"): i for i, ln in enumerate(lines) if re.match(r"^\.L_x_\d+:", ln)}
    loops = []  # (first line, backward branch line) of every loop with MMAs
    for i, ln in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i and any("MMA" in x for x in lines[labels[m.group(1)]:i]):
            loops.append((labels[m.group(1)], i))
    if not loops:
        raise SystemExit("sass_loop_stats: no loop with MMAs found in the disassembly")
    inner = min(loops, key=lambda span: span[1] - span[0])
    outer = (min(a for a, _ in loops), max(b for _, b in loops))
    ops = _opcodes(lines[inner[0]:inner[1] + 1])
    regs = resources(compiled)["regs"]
    parts = {"prologue": _opcodes(lines[:outer[0]]),
             "outer loop, outside the tile loop": _opcodes(lines[outer[0]:inner[0]] + lines[inner[1] + 1:outer[1] + 1]),
             "epilogue": _opcodes(lines[outer[1] + 1:])}
    prologue = [m.group(2).split(".")[0] for m in map(OP.match, lines[:outer[0]]) if m]
    prefetch = [i for i, op in enumerate(prologue) if op == "CCTL"]  # L2 prefetches (`prefetch_tiles`)
    order = {"prefetches": len(prefetch), "last prefetch": max(prefetch, default=None),
             "first FRND": prologue.index("FRND") if "FRND" in prologue else None, "prologue": len(prologue)}
    return {"loop": sum(ops.values()), "ops": ops, "regs": regs, "parts": parts, "order": order}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale-format", default="ue5m3", choices=["ue5m3", "float16"])
    ap.add_argument("--uncentered", action="store_true")
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--num-stages", type=int, default=launch.DEFAULT_OPTIONS.num_stages)
    ap.add_argument("--prefetch-tiles", type=int, default=launch.DEFAULT_OPTIONS.prefetch_tiles,
                    help="DecodeOptions.prefetch_tiles: the first tiles each program asks L2 for before its prologue")
    ap.add_argument("--whole", action="store_true",
                    help="also the static instruction counts of the prologue, the outer page-id loop and the epilogue "
                         "(what every program pays once, whatever its chunk's length)")
    args = ap.parse_args()
    compiled, plan = compile_history_kernel(args.scale_format, not args.uncentered, args.maxnreg, args.num_stages,
                                            args.prefetch_tiles)
    st = loop_stats(compiled)
    print(f"triton {triton.__version__}, sm_90, Qwen3-8B geometry, {args.scale_format}, "
          f"{'uncentered' if args.uncentered else 'centered'}, whole pages {plan.whole_pages}, int8 scores "
          f"{plan.int8_scores}, scale layout {plan.scale_layout}, maxnreg {args.maxnreg}, prefetch tiles "
          f"{args.prefetch_tiles}")
    print(f"tile loop: {st['loop']} instructions per thread per 64-token tile, {st['regs']} registers per thread")
    seen = set()
    for name, fams in GROUPS.items():
        n = sum(st["ops"].get(f, 0) for f in fams)
        seen.update(fams)
        print(f"  {name}: {n} ({100 * n / st['loop']:.0f} %)")
    rest = {k: v for k, v in st["ops"].items() if k not in seen}
    print(f"  other: {sum(rest.values())} ({', '.join(f'{k} {v}' for k, v in sorted(rest.items(), key=lambda kv: -kv[1]))})")
    alu = sum(st["ops"].get(f, 0) for f in ALU_PIPE)
    print(f"integer ALU pipe: {alu} ({100 * alu / st['loop']:.0f} %), at least {2 * alu} issue cycles per tile "
          f"against {st['loop']} for the whole loop")
    print("by opcode:", ", ".join(f"{k} {v}" for k, v in st["ops"].most_common()))
    if args.prefetch_tiles:
        o = st["order"]
        print(f"L2 prefetches in the prologue: {o['prefetches']}, the last at instruction {o['last prefetch']} of "
              f"{o['prologue']}; the query's int8 conversion starts at {o['first FRND']}")
    if args.whole:
        for name, ops in st["parts"].items():
            print(f"{name}: {sum(ops.values())} static instructions;",
                  ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
