"""Offline instruction counts of the INT2 decode kernel's main loop (no GPU needed): compile for sm_90 with the
installed Triton, disassemble with its bundled nvdisasm/cuobjdump, and count SASS instructions per thread between
the loop's label and its backward branch (one tile of BLOCK_N tokens), plus registers per thread.

    python3 bench/sass_loop_stats.py --impl 0 4 --warps 1 4        # Qwen3-8B geometry, bf16 queries
    python3 bench/sass_loop_stats.py --probe                        # bench/energy_probe.py's variants
Prints one line per config: loop instructions per thread, per tile for the whole program (x warps), I2F count,
registers. Needs triton and the package's own dependencies (torch, no GPU); loads the kernel file directly.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import itertools
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = os.path.join(HERE, "..", "runtime_kernels", "attention", "triton_int2.py")
sys.path.insert(0, os.path.join(HERE, ".."))  # the kernel file imports runtime_kernels.launch_util
PTR = {"q_ptr": None, "kc_ptr": "*u8", "vc_ptr": "*u8", "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vs_ptr": "*fp16",
       "vz_ptr": "*fp16", "bt_ptr": "*i32", "len_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32"}
OP = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def compile_kernel(impl: int, warps: int, block_n: int, stages: int, qdtype: str, fold: bool, vfold: bool = False,
                   maxnreg: int | None = None, full_tiles: bool = False, spare_zero: bool = False,
                   vpair: bool = False, tile_acc: bool = True, ki8: bool = False):
    spec = importlib.util.spec_from_file_location("triton_int2_offline", KERNEL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if impl in (5, 6):  # tokens on the MMA rows (`_int2_decode_kernel_t`), code pools viewed as int16
        fn = mod._int2_decode_kernel_t
        const = dict(GROUP=4, GP=4, Q=32, U=16, U_PAD=16, P=64, BLOCK_N=block_n, INTERP=False, VFOLD=vfold,
                     TILE_ACC=tile_acc, SUBN=impl == 6, PAGE_VEC=impl == 6, NPV=64, FULL_TILES=full_tiles,
                     SPARE_ZERO=spare_zero, VPAIR=vpair, KI8=ki8,
                     # The pool strides are constexprs of this kernel: contiguous pools of 8 KV heads, 64-row pages,
                     # 16 int16 words per code row (Qwen3-8B geometry), scales one fp16 per row.
                     stride_kcp=8 * 64 * 16, stride_kch=64 * 16, stride_kcr=16, stride_ksp=8 * 64, stride_ksh=64,
                     stride_ksr=1, stride_vcp=8 * 64 * 16, stride_vch=64 * 16, stride_vcr=16,
                     # vpair: V scale and zero interleaved, (scale, zero) per row.
                     stride_vsp=8 * 64 * (2 if vpair else 1), stride_vsh=64 * (2 if vpair else 1),
                     stride_vsr=2 if vpair else 1)
        ptr = dict(PTR, kc_ptr="*i16", vc_ptr="*i16")
    else:
        fn = mod._int2_decode_kernel
        const = dict(GROUP=4, G_PAD=16, Q=32, Q_PAD=32, GS=128, NG=1, P=64, BLOCK_N=block_n, FP32=False,
                     INTERP=False, IMPL=impl, PREFETCH=False, KFOLD=fold and impl >= 3 and qdtype == "bf16")
        ptr = PTR
    return compile_sm90(fn, const, {k: v or f"*{qdtype}" for k, v in ptr.items()}, warps, stages, maxnreg,
                        unaligned=("stride_ksr", "stride_vsr", "stride_lh"))


def compile_sm90(fn, const: dict, ptr: dict, warps: int, stages: int, maxnreg: int | None = None,
                 unaligned: tuple = ()):
    """Compile jit function `fn` for sm_90 offline: `const` its constexprs (others of its names are dropped), `ptr`
    the pointer arguments' types (16-byte aligned), `qk_scale` fp32, every other argument i32, the strides not in
    `unaligned` divisible by 16 (as a launch specializes them)."""
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in const:
            sig[n] = "constexpr"
        elif n in ptr:
            sig[n] = ptr[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n == "qk_scale":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride") and n not in unaligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages,
                                   **({"maxnreg": maxnreg} if maxnreg else {})})


def _energy_probe():
    sys.path.insert(0, HERE)
    import energy_probe

    return energy_probe


def compile_probe(variant: str):
    """`energy_probe._probe_kernel` for one of its variants at Qwen3-8B geometry (64-token pages, contiguous pools:
    the code row and scale strides as the launch specializes them), with its clock reads, as it is measured."""
    energy_probe = _energy_probe()
    extract, mma, int8, f16acc = energy_probe.VARIANTS[variant]
    const = dict(P=64, U=16, EXTRACT=extract, MMA=mma, CLOCK=True, INTERP=False, INT8=int8, F16ACC=f16acc,
                 CHAIN=energy_probe.RAW_CHAIN.get(variant, 8), stride_ksr=1, stride_vsr=1)
    ptr = {"kc_ptr": "*i16", "vc_ptr": "*i16", "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vs_ptr": "*fp16",
           "vz_ptr": "*fp16", "bt_ptr": "*i32", "len_ptr": "*i32", "out_ptr": "*i32", "f_ptr": "*fp32",
           "clk_ptr": "*i64", "kb_ptr": "*u8", "vb_ptr": "*u8"}
    return compile_sm90(energy_probe._probe_kernel, const, ptr, 1, 3)


def loop_stats(kernel, need: str | None = "HMMA") -> dict:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", path], capture_output=True, text=True).stdout
        res = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                             text=True).stdout
    lines = sass.splitlines()
    labels = {ln.strip().rstrip(":"): i for i, ln in enumerate(lines) if re.match(r"^\.L_x_\d+:", ln)}
    span = None  # the tile loop: the innermost backward branch whose body holds the MMAs (need=None: the longest)
    for i, ln in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            lo = labels[m.group(1)]
            if need is None:
                if span is None or i - lo > span[1] - span[0]:
                    span = (lo, i)
            elif any(need in x for x in lines[lo:i]) and (span is None or i - lo < span[1] - span[0]):
                span = (lo, i)
    ops = collections.Counter()
    for ln in lines[span[0]:span[1] + 1] if span else []:
        m = OP.match(ln)
        if m:
            ops[m.group(2).split(".")[0]] += 1
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    return {"loop": sum(ops.values()), "ops": ops, "regs": int(regs.group(1)) if regs else None,
            "stack": int(stack.group(1)) if stack else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", type=int, nargs="+", default=[0, 3, 4])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--block-n", type=int, nargs="+", default=[64])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--exact-k", action="store_true", help="do not fold the K code offset")
    ap.add_argument("--vfold", action="store_true", help="impl 5: V code offset subtracted after a fresh dot")
    ap.add_argument("--top", type=int, default=8, help="most frequent opcodes to print")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap per thread (ptxas spills above it)")
    ap.add_argument("--full-tiles", action="store_true", help="impl 6: whole pages promised (no mask in the loop)")
    ap.add_argument("--spare-zero", action="store_true", help="zeros in the V dot's spare columns (V_SPARE_ZERO)")
    ap.add_argument("--vpair", action="store_true", help="impl 6 whole pages: V scale and zero read as pairs (VPAIR)")
    ap.add_argument("--ki8", action="store_true", help="impl 6 whole pages: int8 score MMAs on the K code bytes (KI8)")
    ap.add_argument("--chain", action="store_true", help="V dots chained onto the chunk accumulators (TILE_ACC off)")
    ap.add_argument("--probe", nargs="*", default=None, metavar="VARIANT",
                    help="count bench/energy_probe.py's loop instead (its variants; none given: all)")
    args = ap.parse_args()
    if args.probe is not None:
        energy_probe = _energy_probe()
        print(f"triton {triton.__version__}, sm_90, energy probe, Qwen3-8B geometry")
        for variant in args.probe or list(energy_probe.VARIANTS):
            st = loop_stats(compile_probe(variant), need=None)
            top = ", ".join(f"{k} {v}" for k, v in st["ops"].most_common(args.top))
            print(f"{variant}: {st['loop']} instr/tile, regs {st['regs']} | {top}")
        return
    print(f"triton {triton.__version__}, sm_90, Qwen3-8B geometry, {args.dtype} queries")
    for impl, warps, bn in itertools.product(args.impl, args.warps, args.block_n):
        st = loop_stats(compile_kernel(impl, warps, bn, args.stages, args.dtype, not args.exact_k, args.vfold,
                                         args.maxnreg, args.full_tiles, args.spare_zero, args.vpair,
                                         not args.chain, args.ki8))
        per64 = st["loop"] * warps * 64 / bn
        top = ", ".join(f"{k} {v}" for k, v in st["ops"].most_common(args.top))
        print(f"impl {impl} warps {warps} block_n {bn}: {st['loop']} instr/thread/tile, {per64:.0f} warp-instr per "
              f"64 tokens, I2F {st['ops'].get('I2F', 0)}, regs {st['regs']}, stack {st['stack']} | {top}")


if __name__ == "__main__":
    main()
