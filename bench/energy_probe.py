"""Which part of the INT2 decode kernel's work pulls the H200's SM clock down, and what does it cost? (v12: the kernel
runs at ~1.71 GHz from its first launch, kernels that only read its bytes at ~1.95 GHz.)

A probe kernel reads exactly the read-only ceiling's bytes (`read_ceiling._read_tiles_kernel`: per 64-token tile of a
(sequence, KV head) the K and V code blocks and four scale / zero vectors, same split grid, one warp per program) and
adds the INT2 kernel's arithmetic in parts, without its softmax:

- `extract`: the code extraction of `triton_int2._codes8_subn` on K and V (one `and` per two codes, 256 per tile),
  summed in fp16 so that it is not dead code;
- `mma`: the tensor-core work, 32 m16n8k16 MMAs per side as in the INT2 kernel (K side `[64, 16] @ [16, 8]`, V side
  `[16, 64] @ [64, 8]`, eight chained dots each), on the raw code words masked to fp16 subnormals (one `and` per
  register, not per position);
- `mma1`: the same with one MMA where `mma` chains eight (8 per tile): does the clock follow the amount of
  tensor-core work, or the use of the tensor cores at all?
- `extract+mma`: both, the extracted positions as the MMA operands (the INT2 kernel without softmax and scales);
- `extract+mma_h`: the same with fp16 accumulators (`HMMA.F16`);
- `extract8+mma8`: the same multiply-adds on 8-bit integers: codes `(byte >> 2j) & 3` as int8 (four codes per
  register) against int8 operands, m16n8k32 integer MMAs (16 per side instead of 32), int32 accumulators. It reads
  each code block twice: int16 words for the checksum and bytes for the MMAs (the second read mostly from L1), so its
  time overstates int8's cost. A version that read the bytes only (commit 107f3f9, reverted) ran slower still on the
  H200: 0.318 vs 0.197 ms for extract+mma in the same run, compiled to 140 registers where offline Triton 3.6 gave
  168 (`energy_probe_i8once_s9_*`); not diagnosed.

Each program reads `%clock64` and `%globaltimer` at its start and end, so a launch reports its SM clock (median over
programs of cycles / ns) with no profiler; the run reports that clock for the first launch and for the last launch
of `--seconds` of back-to-back launches (the board's 700 W limit acts over seconds), the median ms per launch
(`triton.testing.do_bench`), and the INT2 kernel's ms on the same cache.

    python3 bench/energy_probe.py --out OUT [--point 131072x8] [--seconds 2]

Loop instructions per tile (`python3 bench/sass_loop_stats.py --probe`: Triton 3.6, sm_90, offline; registers):
read 225 (126), extract 782 (155: 324 LOP3, and 256 HADD2/HFMA2 of the fp16 sums), mma 397 (168: 64 HMMA, 100 LOP3),
mma1 325 (168: 8 HMMA), extract+mma 656 (168: 64 HMMA, 326 LOP3), extract+mma_h 666 (161), extract8+mma8 679 (167:
32 IMMA); the INT2 kernel 649 (126). Each variant runs one full wave: splits from its own registers per thread.
Findings on the H200: `bench/NOTES_decode.md` v13.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from read_ceiling import _split_tiles, _xor  # noqa: E402 - the read-only kernel's pieces

from runtime_kernels.attention.triton_int2 import INTERPRET, _codes8_subn, _codes_i8, _dot_acc, _dot_chain8  # noqa: E402

# name -> (EXTRACT, MMA, INT8, F16ACC)
VARIANTS = {"read": (False, False, False, False), "extract": (True, False, False, False),
            "mma": (False, True, False, False), "mma1": (False, True, False, False),
            "extract+mma": (True, True, False, False),
            "extract+mma_h": (True, True, False, True), "extract8+mma8": (True, True, True, False)}


@triton.jit
def _clock(x):
    """(global timer ns, SM cycle counter) here (GPU only; x anchors the asm)."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)
    c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)
    return t, c


@triton.jit
def _subnormal(w):
    """The low 10 bits of each int16 word as an fp16 subnormal (one `and` per register): a finite MMA operand."""
    return (w & 0x03FF).to(tl.float16, bitcast=True)


# Chained MMAs per side and tile of the raw-word variants (`mma`: 8, like the INT2 kernel's 8 code positions).
RAW_CHAIN = {"mma": 8, "mma1": 1}


@triton.jit
def _chain(a, b, acc, N: tl.constexpr, INTERP: tl.constexpr):
    """acc + N a @ b as N chained MMAs (a chain: the compiler cannot merge them)."""
    for _ in tl.static_range(N):
        acc = _dot_acc(a, b, acc, INTERP)
    return acc


@triton.jit
def _sum8(x0, x1, x2, x3, x4, x5, x6, x7):
    return ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))


@triton.jit
def _probe_kernel(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, out_ptr, f_ptr, clk_ptr,
                  kb_ptr, vb_ptr,
                  stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
                  stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, stride_btb,
                  P: tl.constexpr, U: tl.constexpr, EXTRACT: tl.constexpr, MMA: tl.constexpr,
                  CLOCK: tl.constexpr, INTERP: tl.constexpr, INT8: tl.constexpr = False,
                  F16ACC: tl.constexpr = False, CHAIN: tl.constexpr = 8):
    """Program (b, h, s): `read_ceiling._read_tiles_kernel`'s tiles and XOR checksum (into out[b, h, s]) plus the
    variant's arithmetic, whose fp32 sum goes to f[b, h, s]; with CLOCK, (ns, cycles) of the program to clk[., 0:2].
    K codes are read as `[P, U]` int16 words, V codes as `[U, P]` (words on the rows: the INT2 kernel's V operand);
    INT8: as bytes (kb_ptr / vb_ptr, uint8 views of the same pools, `[P, 2U]` and `[2U, P]`), checksum unchanged."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    pid = (b * tl.num_programs(1) + h) * tl.num_programs(2) + s
    if CLOCK:
        t0, c0 = _clock(b)
    t_lo, t_hi = _split_tiles(len_ptr, b, s, tl.num_programs(2), P)
    rows = tl.arange(0, P)
    words = tl.arange(0, U)
    cols = tl.arange(0, 8)
    k_off = rows[:, None] * stride_kcr + words[None, :]  # [P, U]
    v_off = words[:, None] + rows[None, :] * stride_vcr  # [U, P]
    # Loop-invariant MMA operands: small exact fp16 values (the query and the probabilities' stand-ins).
    qb = ((words[:, None] * 8 + cols[None, :]) % 7 + 1).to(tl.float16) * 0.125  # [U, 8]
    pb = ((rows[:, None] * 8 + cols[None, :]) % 5 + 1).to(tl.float16) * 0.25  # [P, 8]
    acc_c = tl.zeros([P, U], tl.int32)
    acc_w = tl.zeros([U, P], tl.int32)
    acc_s = tl.zeros([P], tl.int32)
    acc_k = tl.zeros([P, 8], tl.float32)
    acc_v = tl.zeros([U, 8], tl.float32)
    acc_h = tl.zeros([P, U], tl.float16)
    acc_g = tl.zeros([U, P], tl.float16)
    bytes_ = tl.arange(0, 2 * U)
    kb_off = rows[:, None] * (2 * stride_kcr) + bytes_[None, :]  # [P, 2U] byte offsets
    vb_off = bytes_[:, None] + rows[None, :] * (2 * stride_vcr)  # [2U, P]
    qb8 = ((bytes_[:, None] * 8 + cols[None, :]) % 7 + 1).to(tl.int8)  # [2U, 8]
    pb8 = ((rows[:, None] * 8 + cols[None, :]) % 5 + 1).to(tl.int8)  # [P, 8]
    acc_kh = tl.zeros([P, 8], tl.float16)
    acc_vh = tl.zeros([U, 8], tl.float16)
    acc_k8 = tl.zeros([P, 8], tl.int32)
    acc_v8 = tl.zeros([2 * U, 8], tl.int32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    page_next = tl.load(bt_row + tl.minimum(t_lo, tl.maximum(t_hi - 1, 0)))
    for t in range(t_lo, t_hi):
        page = page_next.to(tl.int64)
        page_next = tl.load(bt_row + tl.minimum(t + 1, t_hi - 1))
        kw = tl.load(kc_ptr + page * stride_kcp + h * stride_kch + k_off)
        vw = tl.load(vc_ptr + page * stride_vcp + h * stride_vch + v_off)
        srow = page * stride_ksp + h * stride_ksh + rows * stride_ksr
        vrow = page * stride_vsp + h * stride_vsh + rows * stride_vsr
        ks = tl.load(ks_ptr + srow)
        kz = tl.load(kz_ptr + srow)
        vs = tl.load(vs_ptr + vrow)
        vz = tl.load(vz_ptr + vrow)
        # The read-only kernel's checksum (`read_ceiling._fold`), V words in their own `[U, P]` layout.
        acc_c = acc_c ^ kw.to(tl.int32)
        acc_w = acc_w ^ vw.to(tl.int32)
        acc_s = acc_s ^ (ks.to(tl.int16, bitcast=True).to(tl.int32) ^ kz.to(tl.int16, bitcast=True).to(tl.int32)
                         ^ vs.to(tl.int16, bitcast=True).to(tl.int32) ^ vz.to(tl.int16, bitcast=True).to(tl.int32))
        if INT8:
            kb = tl.load(kb_ptr + 2 * (page * stride_kcp + h * stride_kch) + kb_off)
            vb = tl.load(vb_ptr + 2 * (page * stride_vcp + h * stride_vch) + vb_off)
            for j in tl.static_range(4):
                acc_k8 = tl.dot(_codes_i8(kb, j, not INTERP), qb8, acc_k8, out_dtype=tl.int32)
                acc_v8 = tl.dot(_codes_i8(vb, j, not INTERP), pb8, acc_v8, out_dtype=tl.int32)
        elif EXTRACT:
            x0, x1, x2, x3, x4, x5, x6, x7 = _codes8_subn(kw, not INTERP)
            y0, y1, y2, y3, y4, y5, y6, y7 = _codes8_subn(vw, not INTERP)
            if MMA and F16ACC:
                acc_kh = _dot_chain8(x0, x1, x2, x3, x4, x5, x6, x7, qb, qb, qb, qb, qb, qb, qb, qb, acc_kh, INTERP,
                                     True)
                acc_vh = _dot_chain8(y0, y1, y2, y3, y4, y5, y6, y7, pb, pb, pb, pb, pb, pb, pb, pb, acc_vh, INTERP,
                                     True)
            elif MMA:
                acc_k = _dot_chain8(x0, x1, x2, x3, x4, x5, x6, x7, qb, qb, qb, qb, qb, qb, qb, qb, acc_k, INTERP)
                acc_v = _dot_chain8(y0, y1, y2, y3, y4, y5, y6, y7, pb, pb, pb, pb, pb, pb, pb, pb, acc_v, INTERP)
            else:
                acc_h += _sum8(x0, x1, x2, x3, x4, x5, x6, x7)
                acc_g += _sum8(y0, y1, y2, y3, y4, y5, y6, y7)
        elif MMA:
            acc_k = _chain(_subnormal(kw), qb, acc_k, CHAIN, INTERP)
            acc_v = _chain(_subnormal(vw), pb, acc_v, CHAIN, INTERP)
    x = (tl.reduce(tl.reduce(acc_c, 0, _xor), 0, _xor) ^ tl.reduce(tl.reduce(acc_w, 0, _xor), 0, _xor)
         ^ tl.reduce(acc_s, 0, _xor))
    tl.store(out_ptr + pid, x)
    f = (tl.sum(tl.sum(acc_k, 1), 0) + tl.sum(tl.sum(acc_v, 1), 0) + tl.sum(tl.sum(acc_h.to(tl.float32), 1), 0)
         + tl.sum(tl.sum(acc_g.to(tl.float32), 1), 0)
         + tl.sum(tl.sum(acc_kh.to(tl.float32), 1), 0) + tl.sum(tl.sum(acc_vh.to(tl.float32), 1), 0)
         + (tl.sum(tl.sum(acc_k8, 1), 0) + tl.sum(tl.sum(acc_v8, 1), 0)).to(tl.float32))
    tl.store(f_ptr + pid, f)
    if CLOCK:
        t1, c1 = _clock(x)
        tl.store(clk_ptr + 2 * pid, t1 - t0)
        tl.store(clk_ptr + 2 * pid + 1, c1 - c0)


def probe(pools, table: torch.Tensor, hist_len: torch.Tensor, splits: int, variant: str, clock: bool = False):
    """Launch the probe -> (xor int32 `[B, H, splits]`, sums fp32 `[B, H, splits]`, clk int64 `[B, H, splits, 2]` of
    (ns, cycles) or None). pools as `read_ceiling.read_tiles` takes them; variant one of VARIANTS."""
    if variant not in VARIANTS:
        raise ValueError(f"probe: variant {variant!r}, expected one of {sorted(VARIANTS)}")
    if clock and (INTERPRET or not pools[0].is_cuda):
        raise ValueError("probe: clock=True needs a CUDA device (it reads %clock64 and %globaltimer)")
    kc, ks, kz, vc, vs, vz = pools
    b, h, page = table.shape[0], kc.shape[1], kc.shape[2]
    kw, vw = kc.view(torch.int16), vc.view(torch.int16)
    out = torch.empty(b, h, splits, dtype=torch.int32, device=kc.device)
    sums = torch.empty(b, h, splits, dtype=torch.float32, device=kc.device)
    clk = torch.empty(b, h, splits, 2, dtype=torch.int64, device=kc.device) if clock else out
    extract, mma, int8, f16acc = VARIANTS[variant]
    compiled = _probe_kernel[(b, h, splits)](
        kw, ks, kz, vw, vs, vz, table, hist_len, out, sums, clk, kc, vc,
        kw.stride(0), kw.stride(1), kw.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        vw.stride(0), vw.stride(1), vw.stride(2), vs.stride(0), vs.stride(1), vs.stride(2), table.stride(0),
        P=page, U=kw.shape[3], EXTRACT=extract, MMA=mma, CLOCK=clock, INTERP=INTERPRET, INT8=int8, F16ACC=f16acc,
        CHAIN=RAW_CHAIN.get(variant, 8), num_warps=1)
    probe.last_regs = getattr(compiled, "n_regs", None)  # registers per thread of the launched kernel (GPU)
    return out, sums, (clk if clock else None)


def reference_sums(pools, table: torch.Tensor, hist_len: torch.Tensor, variant: str) -> torch.Tensor:
    """What the probe's arithmetic adds up per (sequence, KV head) over its whole history, in float64 from the pools
    -> `[B, H]` (the split does not matter: the sum is linear)."""
    kc, vc = pools[0], pools[3]
    b, h, page, u = table.shape[0], kc.shape[1], kc.shape[2], kc.shape[3] // 2
    extract, mma, int8, _ = VARIANTS[variant]  # the fp16-accumulator variant sums the same products
    words, rows, cols = torch.arange(u), torch.arange(page), torch.arange(8)
    bytes_ = torch.arange(2 * u)
    qb8 = ((bytes_[:, None] * 8 + cols[None, :]) % 7 + 1).double()
    pb8 = ((rows[:, None] * 8 + cols[None, :]) % 5 + 1).double()
    qb = (((words[:, None] * 8 + cols[None, :]) % 7 + 1) * 0.125).double()
    pb = (((rows[:, None] * 8 + cols[None, :]) % 5 + 1) * 0.25).double()
    out = torch.zeros(b, h, dtype=torch.float64)
    if not (extract or mma):
        return out

    def subnormal(w):  # int64 bits of an fp16 subnormal -> its value
        return w.double() * 2.0 ** -24

    for i in range(b):
        pages = table[i, : int(hist_len[i]) // page].cpu().long()
        for j in range(h):
            for codes, opnd, k_side in ((kc, qb, True), (vc, pb, False)):
                if int8:  # bytes, four code positions each, against the int8 operands
                    by = codes[pages, j].cpu().long()  # [n, P, 2U]
                    by = by if k_side else by.transpose(1, 2)
                    out[i, j] += sum((((by >> (2 * p)) & 3).double() @ (qb8 if k_side else pb8)).sum()
                                     for p in range(4))
                    continue
                w = codes[pages, j].cpu().contiguous().view(torch.int16).long() & 0xFFFF  # [n, P, U]
                if not k_side:
                    w = w.transpose(1, 2)  # [n, U, P]: words on the rows
                if extract:  # positions 0-4: bits 2p..2p+1 in place; 5-7: bits 10-15 shifted right by 6
                    parts = [w & (3 << (2 * p)) for p in range(5)] + [(w >> 6) & (3 << (2 * p)) for p in (2, 3, 4)]
                    if mma:
                        out[i, j] += sum((subnormal(x) @ opnd).sum() for x in parts)
                    else:
                        out[i, j] += sum(subnormal(x).sum() for x in parts)
                else:
                    out[i, j] += RAW_CHAIN[variant] * (subnormal(w & 0x03FF) @ opnd).sum()
    return out


def clock_mhz(clk: torch.Tensor) -> float:
    """Median over programs of cycles / ns (x 1000): the SM clock the launch ran at."""
    c = clk.reshape(-1, 2).double()
    return float(((c[:, 1] / c[:, 0].clamp_min(1)) * 1e3).median())


def main() -> None:
    from bench_decode import DEV, H_KV, H_Q, D, make_int2_cache
    from bench_decode_graph import int2_history_bytes, point_inputs

    from runtime_kernels import attention as A
    from runtime_kernels.attention import triton_int2

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--point", default="131072x8", help="CONTEXTxBATCH")
    ap.add_argument("--seconds", type=float, default=2.0, help="back-to-back launches per variant before the "
                    "sustained clock reading")
    ap.add_argument("--variants", default="read,extract,mma,extract+mma", help="comma-separated, of " +
                    ",".join(VARIANTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("energy_probe: needs a CUDA GPU")
    context, batch, gen, q = point_inputs(args.point)
    pools, table, hist_len, *_ = make_int2_cache(batch, context, gen, layout="separate")
    splits = A.int2_num_splits(q, *pools, table, hist_len, 64, 1, 3, 6, True)  # the INT2 kernel's grid
    hist_bytes = int2_history_bytes(int(hist_len.sum()))
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "point": args.point, "splits": splits, "bytes": hist_bytes, "rows": []}
    o = torch.empty(batch, H_Q, splits, D, device=DEV)
    lse = torch.empty(batch, H_Q, splits, device=DEV)

    def run_int2():
        triton_int2.launch_int2_decode(q, *pools, table, hist_len, o, lse, D ** -0.5, splits, 0, 64, 1, 3, 6,
                                       whole_pages=True)

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    for name in ["int2"] + args.variants.split(","):
        row = {"variant": name, "splits": splits}
        if name != "int2":
            # One full wave, as the INT2 kernel's grid is: splits from the probe's own occupancy (registers).
            probe(pools, table, hist_len, splits, name)
            row["regs"] = probe.last_regs
            row["programs_per_sm"] = min(32, 65536 // (32 * (probe.last_regs or 255)))
            row["splits"] = max(1, row["programs_per_sm"] * n_sm // (batch * H_KV))
        fn = run_int2 if name == "int2" else (lambda v=name, n=row["splits"]: probe(pools, table, hist_len, n, v))
        fn()
        torch.cuda.synchronize()
        if name != "int2":
            row["first_clock_mhz"] = clock_mhz(probe(pools, table, hist_len, row["splits"], name, clock=True)[2])
        row["ms"] = triton.testing.do_bench(fn)
        t_end = time.time() + args.seconds
        while time.time() < t_end:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        if name != "int2":
            row["sustained_clock_mhz"] = clock_mhz(probe(pools, table, hist_len, row["splits"], name,
                                                         clock=True)[2])
        row["ms_after_sustained"] = statistics.median(
            triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="all"))
        row["gbps"] = hist_bytes / row["ms"] / 1e6
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "energy_probe_" + report["gpu"].replace(" ", "_") + ".json"), "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
