"""Triton split-K decode attention over a paged INT2 history (codes + fp16 scale/zero), dequantized in registers.

Grid `(B, H_kv, num_splits)`. Program `(b, h, s)` takes a contiguous, tile-aligned chunk of sequence b's
history, loads each packed tile of KV head h once, and scores it against all `GROUP = H_q / H_kv` query heads
of the group with `tl.dot` (`G_PAD >= 16` rows, padding rows are zero queries). It writes the chunk's
normalised partial output and log-sum-exp to `o_part[b, h*GROUP + i, split_offset + s]`; a reduce kernel
(`merge.py`) combines the splits. Nothing is ever written back as a BF16 copy of the history.

Unpacking without shuffles: byte j of a row holds channels j, j+Q, j+2Q, j+3Q (Q = d/4) in bits 1:0, 3:2,
5:4, 7:6, so `(byte >> 2k) & 3` is the code tile of channel quarter k. The query is loaded as four quarters
too, and q.k is the sum of four partial dots over Q channels each.

With one scale/zero group per row (group size = d, the default) dequantization folds out of the dots:
    q . k_t   = s_t * (q . c_t - z_t * sum(q))
    sum_t p_t v_t = dot(p * s, c) - sum_t p_t s_t z_t          (per output channel)
so the dots run on the raw codes (exact in fp16/bf16) and only `[BLOCK_N]` vectors are scaled. With several
groups per row the tile is dequantized elementwise (`(c - z) * s`) before the dots.

Turning codes into MMA operands (impl 3/4, the CUDA default): an int -> float conversion (I2F) issues at a
quarter of the ALU rate on Hopper and would be needed 256 times per token and KV head. Instead the 2-bit code is
OR-ed into the mantissa of a float whose mantissa spacing is 1 and the bits are reinterpreted: bf16 bits
`0x4300 | c` are 128 + c, fp16 `0x6400 | c` are 1024 + c, both exact; the offset is then subtracted exactly
(V side, whose accumulator runs over the whole chunk) or folded into the zero term (K side with bf16 queries,
`q.(c + 128) - (z + 128) sum q`: the score dot restarts from zero on every tile, so the extra rounding is fp32
rounding of a sum about 128 sum|q| large, far below the bf16 rounding of q itself). Impl 4 does this in inline
PTX, four codes per `shr, and, prmt, prmt` block (about one instruction per code).

The default whole-page loop (impl 6, `_tile_pieces`) takes V codes as exact fp16 subnormals (`and` alone gives the
bits of M * code * 2^-24) and, at head_dim 128 or 256, scores K codes with int8 MMAs (`K_INT8_SCORES`): quarter k
of a row's bytes is an int8 tile by itself, against the query as int8 hi/lo pairs (`_score16_i8`).
"""

from __future__ import annotations

import os
import warnings

import triton
import triton.language as tl

from runtime_kernels.launch_util import next_pow2

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, FP32: tl.constexpr, INTERP: tl.constexpr):
    """`a [M, K] @ b [K, N]` with fp32 accumulation; exact fp32 products when the inputs are fp32.

    INTERP: the Triton CPU interpreter (3.9) multiplies bfloat16 tiles as their raw uint16 bits, so there
    the (exactly representable) operands are widened to fp32 first; same products, same accumulation type.
    """
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _codes(b, SHIFT: tl.constexpr, dt: tl.constexpr, INTERP: tl.constexpr):
    """Codes `(b >> SHIFT) & 3` of a uint8 tile as `dt` (via fp32 in the interpreter, which casts int -> bf16
    bitwise)."""
    c = (b >> SHIFT) & 3
    if INTERP:
        return c.to(tl.float32).to(dt)
    else:
        return c.to(dt)


@triton.jit
def _magic_codes(b, SHIFT: tl.constexpr, dt: tl.constexpr, SUB: tl.constexpr, INTERP: tl.constexpr):
    """Codes `(b >> SHIFT) & 3` of a uint8 tile as `dt` without any int -> float conversion instruction.

    The code is OR-ed into the low mantissa bits of a float whose exponent makes the mantissa spacing 1
    (bf16 128.0 = 0x4300, fp16 1024.0 = 0x6400, fp32 2^23 = 0x4B000000) and the bits are reinterpreted
    (same-width bitcast): the value is exactly OFFSET + code. SUB: subtract OFFSET (exact) and return the
    code; else return OFFSET + code (the caller folds OFFSET out). The interpreter does bf16 arithmetic on
    raw bits, so there the subtraction runs in fp32.
    """
    c = (b >> SHIFT) & 3
    if dt == tl.float32:
        x = (c.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
        off: tl.constexpr = 8388608.0
    elif dt == tl.bfloat16:
        x = (c.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
        off: tl.constexpr = 128.0
    else:
        x = (c.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
        off: tl.constexpr = 1024.0
    if SUB:
        if INTERP:
            x = (x.to(tl.float32) - off).to(dt)
        else:
            x = x - off
    return x


# Inline PTX pieces of `_asm_codes` (module-level constexpr strings: jit code may only read constexpr globals).
_ASM_HEAD = tl.constexpr("{ .reg .b32 t, m, one, off; ")
_ASM_SHR0 = tl.constexpr("mov.b32 t, $2; ")
_ASM_SHR2 = tl.constexpr("shr.b32 t, $2, 2; ")
_ASM_SHR4 = tl.constexpr("shr.b32 t, $2, 4; ")
_ASM_SHR6 = tl.constexpr("shr.b32 t, $2, 6; ")
# Mask the four code bytes, then put byte i of t under the magic exponent byte in m (prmt selectors 0x4140, 0x4342:
# result bytes = t.b0, m.b0, t.b1, m.b0 and t.b2, m.b0, t.b3, m.b0).
_ASM_BF16 = tl.constexpr("and.b32 t, t, 0x03030303; mov.b32 m, 0x43434343; "
                         "prmt.b32 $0, t, m, 0x4140; prmt.b32 $1, t, m, 0x4342; ")
_ASM_FP16 = tl.constexpr("and.b32 t, t, 0x03030303; mov.b32 m, 0x64646464; "
                         "prmt.b32 $0, t, m, 0x4140; prmt.b32 $1, t, m, 0x4342; ")
# Exact removal of the offset: bf16 x * 1 + (-128) (fma.rn.bf16x2 exists from sm_80), fp16 x - 1024.
_ASM_SUB_BF16 = tl.constexpr("mov.b32 one, 0x3F803F80; mov.b32 off, 0xC300C300; "
                             "fma.rn.bf16x2 $0, $0, one, off; fma.rn.bf16x2 $1, $1, one, off; ")
_ASM_SUB_FP16 = tl.constexpr("mov.b32 off, 0x64006400; sub.f16x2 $0, $0, off; sub.f16x2 $1, $1, off; ")
_ASM_TAIL = tl.constexpr("}")


@triton.jit
def _asm_half2(b, TEXT: tl.constexpr, BF16: tl.constexpr):
    """Run the inline-PTX TEXT once per four packed bytes of `b` (`$2`), two half2 outputs (`$0`, `$1`)."""
    if BF16:
        y = tl.inline_asm_elementwise(TEXT, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        y = tl.inline_asm_elementwise(TEXT, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    return y


@triton.jit
def _asm_block(b, SHIFT: tl.constexpr, BODY: tl.constexpr, BF16: tl.constexpr):
    """`t = b >> SHIFT`, then BODY, as one inline-PTX block per four packed code bytes."""
    if SHIFT == 0:
        y = _asm_half2(b, _ASM_HEAD + _ASM_SHR0 + BODY + _ASM_TAIL, BF16)
    elif SHIFT == 2:
        y = _asm_half2(b, _ASM_HEAD + _ASM_SHR2 + BODY + _ASM_TAIL, BF16)
    elif SHIFT == 4:
        y = _asm_half2(b, _ASM_HEAD + _ASM_SHR4 + BODY + _ASM_TAIL, BF16)
    else:
        y = _asm_half2(b, _ASM_HEAD + _ASM_SHR6 + BODY + _ASM_TAIL, BF16)
    return y


@triton.jit
def _asm_codes(b, SHIFT: tl.constexpr, dt: tl.constexpr, SUB: tl.constexpr):
    """CUDA-only version of `_magic_codes` for bf16/fp16 (same values), four codes per inline-PTX block: one 32-bit
    register of four packed code bytes -> shift, mask, and two `prmt` that put each code byte under the exponent
    byte of the magic float, giving two packed half2 registers (OFFSET + code); with SUB a packed exact subtraction
    of OFFSET follows. About one instruction per code, no conversion instruction."""
    if dt == tl.bfloat16:
        if SUB:
            y = _asm_block(b, SHIFT, _ASM_BF16 + _ASM_SUB_BF16, True)
        else:
            y = _asm_block(b, SHIFT, _ASM_BF16, True)
    else:
        if SUB:
            y = _asm_block(b, SHIFT, _ASM_FP16 + _ASM_SUB_FP16, False)
        else:
            y = _asm_block(b, SHIFT, _ASM_FP16, False)
    return y


@triton.jit
def _codes_nc(b, SHIFT: tl.constexpr, dt: tl.constexpr, SUB: tl.constexpr, INTERP: tl.constexpr,
              ASM: tl.constexpr):
    """Codes without conversion instructions: inline PTX when ASM (CUDA, bf16/fp16), else plain Triton bitcasts."""
    if ASM and dt != tl.float32:
        return _asm_codes(b, SHIFT, dt, SUB)
    else:
        return _magic_codes(b, SHIFT, dt, SUB, INTERP)


@triton.jit
def _load_tile(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, page, t0, end, h,
               stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
               stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr,
               offs_n, offs_j, j_ok, P: tl.constexpr):
    """Codes `[BLOCK_N, Q_PAD]` uint8 (K, V) and fp32 scale/zero `[BLOCK_N]` (K, V) of tokens `t0 + offs_n` in
    `page` (one group per row; tokens >= end masked to 0)."""
    t = t0 + offs_n
    t_ok = t < end
    r = (t % P).to(tl.int64)
    cm = t_ok[:, None] & j_ok[None, :]
    kc_row = page * stride_kcp + h * stride_kch + r * stride_kcr
    vc_row = page * stride_vcp + h * stride_vch + r * stride_vcr
    ks_row = page * stride_ksp + h * stride_ksh + r * stride_ksr
    vs_row = page * stride_vsp + h * stride_vsh + r * stride_vsr
    kb = tl.load(kc_ptr + kc_row[:, None] + offs_j[None, :], mask=cm, other=0)
    vb = tl.load(vc_ptr + vc_row[:, None] + offs_j[None, :], mask=cm, other=0)
    ks = tl.load(ks_ptr + ks_row, mask=t_ok, other=0.0).to(tl.float32)
    kz = tl.load(kz_ptr + ks_row, mask=t_ok, other=0.0).to(tl.float32)
    vs = tl.load(vs_ptr + vs_row, mask=t_ok, other=0.0).to(tl.float32)
    vz = tl.load(vz_ptr + vs_row, mask=t_ok, other=0.0).to(tl.float32)
    return kb, vb, ks, kz, vs, vz


@triton.jit
def _softmax_finish(m_i, l_i):
    """End of an online softmax over a chunk, log2-scaled running max m_i and sum l_i -> (1 / l, natural-log lse).
    An empty chunk (l = 0) gives 1 / l = 0 (so o = 0) and lse = -inf (the reduce gives it zero weight). Shared by
    every decode kernel."""
    has = l_i > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return inv, lse


@triton.jit
def _chunk_bounds(len_ptr, b, sp, n_split, BLOCK_N: tl.constexpr, RANGE: tl.constexpr = 0):
    """Tokens `[start, end)` of split sp of n_split of sequence b (length L at `len_ptr + b`): tile-aligned chunks, so
    tiles never straddle pages when BLOCK_N divides the page size. Shared by every decode kernel.
    RANGE 1: the chunks cover only the whole tiles, `[0, L // BLOCK_N * BLOCK_N)`; RANGE 2 (sp, n_split ignored):
    the tail that RANGE 1 leaves with tiles of 2 BLOCK_N, `[L // (2 BLOCK_N) * 2 BLOCK_N, L)`."""
    L = tl.load(len_ptr + b).to(tl.int32)
    if RANGE == 2:
        return L // (2 * BLOCK_N) * (2 * BLOCK_N), L
    if RANGE == 1:
        L = L // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(L, n_split), BLOCK_N) * BLOCK_N
    start = sp * chunk
    return start, tl.minimum(start + chunk, L)


@triton.jit(do_not_specialize=["split_offset"])
def _int2_decode_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr,
    qk_scale, split_offset,
    stride_qb, stride_qh,
    stride_kcp, stride_kch, stride_kcr,
    stride_ksp, stride_ksh, stride_ksr,
    stride_vcp, stride_vch, stride_vcr,
    stride_vsp, stride_vsh, stride_vsr,
    stride_btb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, Q: tl.constexpr, Q_PAD: tl.constexpr,
    GS: tl.constexpr, NG: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr,
    INTERP: tl.constexpr, IMPL: tl.constexpr, PREFETCH: tl.constexpr, KFOLD: tl.constexpr,
):
    # IMPL 0: K code tile loaded [BLOCK_N, Q] and transposed in registers for the dot; 1: K code tile loaded
    # already transposed [Q, BLOCK_N]; 2: no tensor cores (broadcast multiply + sum, fp32), G_PAD = pow2(GROUP);
    # 3: as 0, but codes become MMA operands through magic-number bitcasts (no int -> float conversion
    # instruction, see `_magic_codes`); 4: as 3 with the bitcasts done four codes at a time in inline PTX on CUDA
    # (`_asm_codes`; plain 3 under the interpreter). KFOLD (bf16 queries, IMPL >= 3): the K codes keep their
    # +128 offset and it is folded into the zero term, s * (q.(c + 128) - (z + 128) * sum(q)); the V codes are
    # always exact.
    ASM: tl.constexpr = IMPL == 4 and not INTERP
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    n_split = tl.num_programs(2)
    start, end = _chunk_bounds(len_ptr, b, sp, n_split, BLOCK_N)

    offs_g = tl.arange(0, G_PAD)
    g_ok = offs_g < GROUP
    offs_j = tl.arange(0, Q_PAD)
    j_ok = offs_j < Q
    offs_n = tl.arange(0, BLOCK_N)
    qm = g_ok[:, None] & j_ok[None, :]
    q_row = q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh + offs_j[None, :]
    q0 = tl.load(q_row, mask=qm, other=0.0)
    q1 = tl.load(q_row + Q, mask=qm, other=0.0)
    q2 = tl.load(q_row + 2 * Q, mask=qm, other=0.0)
    q3 = tl.load(q_row + 3 * Q, mask=qm, other=0.0)
    if FP32:
        cdt = tl.float32
        pdt = tl.float32
    else:
        cdt = q0.dtype
        pdt = tl.float16  # p * scale <= 65504 because the scale itself is stored in fp16
    q0 = q0.to(cdt)
    q1 = q1.to(cdt)
    q2 = q2.to(cdt)
    q3 = q3.to(cdt)
    qsum = tl.sum(q0.to(tl.float32) + q1.to(tl.float32) + q2.to(tl.float32) + q3.to(tl.float32), axis=1)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc0 = tl.zeros([G_PAD, Q_PAD], tl.float32)
    acc1 = tl.zeros([G_PAD, Q_PAD], tl.float32)
    acc2 = tl.zeros([G_PAD, Q_PAD], tl.float32)
    acc3 = tl.zeros([G_PAD, Q_PAD], tl.float32)
    acc_z = tl.zeros([G_PAD], tl.float32)

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    if PREFETCH:
        # Software prefetch, independent of the compiler's pipeliner: the tile i+1 loads are in flight while
        # tile i is computed, and the page id is read two tiles ahead so no load waits on another.
        page_c = tl.load(bt_row + start // P, mask=start < end, other=0).to(tl.int64)
        page_n = tl.load(bt_row + (start + BLOCK_N) // P, mask=start + BLOCK_N < end, other=0).to(tl.int64)
        kb_n, vb_n, ks_n, kz_n, vs_n, vz_n = _load_tile(
            kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, page_c, start, end, h,
            stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
            stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, offs_n, offs_j, j_ok, P)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + offs_n
        t_ok = t < end
        if PREFETCH:
            kb = kb_n
            vb = vb_n
            ks = ks_n
            kz = kz_n
            vs = vs_n
            vz = vz_n
            kb_n, vb_n, ks_n, kz_n, vs_n, vz_n = _load_tile(
                kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, page_n, t0 + BLOCK_N, end, h,
                stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
                stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, offs_n, offs_j, j_ok, P)
            page_n = tl.load(bt_row + (t0 + 2 * BLOCK_N) // P, mask=t0 + 2 * BLOCK_N < end, other=0).to(tl.int64)
        else:
            if P % BLOCK_N == 0:
                page = tl.load(bt_row + t0 // P).to(tl.int64)
            else:
                page = tl.load(bt_row + t // P, mask=t_ok, other=0).to(tl.int64)
            r = (t % P).to(tl.int64)
            kc_row = page * stride_kcp + h * stride_kch + r * stride_kcr  # [BLOCK_N]
            vc_row = page * stride_vcp + h * stride_vch + r * stride_vcr
            ks_row = page * stride_ksp + h * stride_ksh + r * stride_ksr
            vs_row = page * stride_vsp + h * stride_vsh + r * stride_vsr
            cm = t_ok[:, None] & j_ok[None, :]
            kb = tl.load(kc_ptr + kc_row[:, None] + offs_j[None, :], mask=cm, other=0)
            vb = tl.load(vc_ptr + vc_row[:, None] + offs_j[None, :], mask=cm, other=0)
            if NG == 1:
                ks = tl.load(ks_ptr + ks_row, mask=t_ok, other=0.0).to(tl.float32)
                kz = tl.load(kz_ptr + ks_row, mask=t_ok, other=0.0).to(tl.float32)
                vs = tl.load(vs_ptr + vs_row, mask=t_ok, other=0.0).to(tl.float32)
                vz = tl.load(vz_ptr + vs_row, mask=t_ok, other=0.0).to(tl.float32)

        if NG == 1:
            if IMPL == 0:
                qc = _dot(q0, tl.trans(_codes(kb, 0, cdt, INTERP)), FP32, INTERP)
                qc += _dot(q1, tl.trans(_codes(kb, 2, cdt, INTERP)), FP32, INTERP)
                qc += _dot(q2, tl.trans(_codes(kb, 4, cdt, INTERP)), FP32, INTERP)
                qc += _dot(q3, tl.trans(_codes(kb, 6, cdt, INTERP)), FP32, INTERP)
            elif IMPL >= 3:
                qc = _dot(q0, tl.trans(_codes_nc(kb, 0, cdt, not KFOLD, INTERP, ASM)), FP32, INTERP)
                qc += _dot(q1, tl.trans(_codes_nc(kb, 2, cdt, not KFOLD, INTERP, ASM)), FP32, INTERP)
                qc += _dot(q2, tl.trans(_codes_nc(kb, 4, cdt, not KFOLD, INTERP, ASM)), FP32, INTERP)
                qc += _dot(q3, tl.trans(_codes_nc(kb, 6, cdt, not KFOLD, INTERP, ASM)), FP32, INTERP)
                if KFOLD:
                    kz = kz + 128.0  # the bf16 magic offset of every code, folded into the zero term
            elif IMPL == 1:
                kbt = tl.load(kc_ptr + kc_row[None, :] + offs_j[:, None], mask=t_ok[None, :] & j_ok[:, None], other=0)
                qc = _dot(q0, _codes(kbt, 0, cdt, INTERP), FP32, INTERP)
                qc += _dot(q1, _codes(kbt, 2, cdt, INTERP), FP32, INTERP)
                qc += _dot(q2, _codes(kbt, 4, cdt, INTERP), FP32, INTERP)
                qc += _dot(q3, _codes(kbt, 6, cdt, INTERP), FP32, INTERP)
            else:
                qc = tl.sum(q0.to(tl.float32)[:, None, :] * ((kb & 3).to(tl.float32))[None, :, :], axis=2)
                qc += tl.sum(q1.to(tl.float32)[:, None, :] * (((kb >> 2) & 3).to(tl.float32))[None, :, :], axis=2)
                qc += tl.sum(q2.to(tl.float32)[:, None, :] * (((kb >> 4) & 3).to(tl.float32))[None, :, :], axis=2)
                qc += tl.sum(q3.to(tl.float32)[:, None, :] * (((kb >> 6) & 3).to(tl.float32))[None, :, :], axis=2)
            s = (qc - qsum[:, None] * kz[None, :]) * (ks * qk_scale)[None, :]
        else:
            # Several groups per row: per-channel scale/zero tiles, dequantize, then dot.
            gi0 = (offs_j // GS)[None, :]
            gi1 = ((offs_j + Q) // GS)[None, :]
            gi2 = ((offs_j + 2 * Q) // GS)[None, :]
            gi3 = ((offs_j + 3 * Q) // GS)[None, :]
            kss = ks_ptr + ks_row[:, None]
            kzs = kz_ptr + ks_row[:, None]
            k0 = (((kb & 3).to(tl.float32) - tl.load(kzs + gi0, mask=cm, other=0.0).to(tl.float32))
                  * tl.load(kss + gi0, mask=cm, other=0.0).to(tl.float32))
            k1 = ((((kb >> 2) & 3).to(tl.float32) - tl.load(kzs + gi1, mask=cm, other=0.0).to(tl.float32))
                  * tl.load(kss + gi1, mask=cm, other=0.0).to(tl.float32))
            k2 = ((((kb >> 4) & 3).to(tl.float32) - tl.load(kzs + gi2, mask=cm, other=0.0).to(tl.float32))
                  * tl.load(kss + gi2, mask=cm, other=0.0).to(tl.float32))
            k3 = ((((kb >> 6) & 3).to(tl.float32) - tl.load(kzs + gi3, mask=cm, other=0.0).to(tl.float32))
                  * tl.load(kss + gi3, mask=cm, other=0.0).to(tl.float32))
            qc = _dot(q0, tl.trans(k0.to(cdt)), FP32, INTERP)
            qc += _dot(q1, tl.trans(k1.to(cdt)), FP32, INTERP)
            qc += _dot(q2, tl.trans(k2.to(cdt)), FP32, INTERP)
            qc += _dot(q3, tl.trans(k3.to(cdt)), FP32, INTERP)
            s = qc * qk_scale

        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: tile holds at least one valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc0 = acc0 * alpha[:, None]
        acc1 = acc1 * alpha[:, None]
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
        if NG == 1:
            if IMPL == 2:
                pw = p * vs[None, :]
                acc_z = acc_z * alpha + tl.sum(pw * vz[None, :], axis=1)
                acc0 += tl.sum(pw[:, :, None] * ((vb & 3).to(tl.float32))[None, :, :], axis=1)
                acc1 += tl.sum(pw[:, :, None] * (((vb >> 2) & 3).to(tl.float32))[None, :, :], axis=1)
                acc2 += tl.sum(pw[:, :, None] * (((vb >> 4) & 3).to(tl.float32))[None, :, :], axis=1)
                acc3 += tl.sum(pw[:, :, None] * (((vb >> 6) & 3).to(tl.float32))[None, :, :], axis=1)
            elif IMPL >= 3:
                pv = (p * vs[None, :]).to(pdt)
                acc_z = acc_z * alpha + tl.sum(pv.to(tl.float32) * vz[None, :], axis=1)
                acc0 += _dot(pv, _codes_nc(vb, 0, pdt, True, INTERP, ASM), FP32, INTERP)
                acc1 += _dot(pv, _codes_nc(vb, 2, pdt, True, INTERP, ASM), FP32, INTERP)
                acc2 += _dot(pv, _codes_nc(vb, 4, pdt, True, INTERP, ASM), FP32, INTERP)
                acc3 += _dot(pv, _codes_nc(vb, 6, pdt, True, INTERP, ASM), FP32, INTERP)
            else:
                pv = (p * vs[None, :]).to(pdt)
                acc_z = acc_z * alpha + tl.sum(pv.to(tl.float32) * vz[None, :], axis=1)
                acc0 += _dot(pv, _codes(vb, 0, pdt, INTERP), FP32, INTERP)
                acc1 += _dot(pv, _codes(vb, 2, pdt, INTERP), FP32, INTERP)
                acc2 += _dot(pv, _codes(vb, 4, pdt, INTERP), FP32, INTERP)
                acc3 += _dot(pv, _codes(vb, 6, pdt, INTERP), FP32, INTERP)
        else:
            vss = vs_ptr + vs_row[:, None]
            vzs = vz_ptr + vs_row[:, None]
            pc = p.to(cdt)
            v0 = (((vb & 3).to(tl.float32) - tl.load(vzs + gi0, mask=cm, other=0.0).to(tl.float32))
                  * tl.load(vss + gi0, mask=cm, other=0.0).to(tl.float32))
            v1 = ((((vb >> 2) & 3).to(tl.float32) - tl.load(vzs + gi1, mask=cm, other=0.0).to(tl.float32))
                  * tl.load(vss + gi1, mask=cm, other=0.0).to(tl.float32))
            v2 = ((((vb >> 4) & 3).to(tl.float32) - tl.load(vzs + gi2, mask=cm, other=0.0).to(tl.float32))
                  * tl.load(vss + gi2, mask=cm, other=0.0).to(tl.float32))
            v3 = ((((vb >> 6) & 3).to(tl.float32) - tl.load(vzs + gi3, mask=cm, other=0.0).to(tl.float32))
                  * tl.load(vss + gi3, mask=cm, other=0.0).to(tl.float32))
            acc0 += _dot(pc, v0.to(cdt), FP32, INTERP)
            acc1 += _dot(pc, v1.to(cdt), FP32, INTERP)
            acc2 += _dot(pc, v2.to(cdt), FP32, INTERP)
            acc3 += _dot(pc, v3.to(cdt), FP32, INTERP)
        m_i = m_new

    inv, lse = _softmax_finish(m_i, l_i)
    o_row = (o_ptr + b.to(tl.int64) * stride_ob + (h * GROUP + offs_g)[:, None] * stride_oh
             + (split_offset + sp) * stride_os + offs_j[None, :])
    tl.store(o_row, (acc0 - acc_z[:, None]) * inv[:, None], mask=qm)
    tl.store(o_row + Q, (acc1 - acc_z[:, None]) * inv[:, None], mask=qm)
    tl.store(o_row + 2 * Q, (acc2 - acc_z[:, None]) * inv[:, None], mask=qm)
    tl.store(o_row + 3 * Q, (acc3 - acc_z[:, None]) * inv[:, None], mask=qm)
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + (h * GROUP + offs_g) * stride_lh + split_offset + sp,
             lse, mask=g_ok)


# ------------------------------------------------------------------------------------------------------------
# impl 5: tokens on the MMA M dimension, 16 codes per packed word without byte moves.
#
# impl 0-4 put the GQA group (4 query heads, padded to 16) on the MMA rows, so 3/4 of every dot, every softmax
# step and every accumulator rescale works on padding. impl 5 transposes both dots:
#     S^T [BLOCK_N tokens, NQ] = sum_p X_p [BLOCK_N, U] @ QB_p [U, NQ]       (M = tokens: no padding)
#     O^T_p [U, NQ]           += Y_p [U, BLOCK_N] @ PB [BLOCK_N, NQ]          (M = channel groups)
# with NQ = 2 * GP columns (GP = query heads padded to >= 4): the score columns are (head, channel half) pairs,
# so summing column pairs (a register-local add) leaves a [BLOCK_N, GP] score tile with no padding at GROUP = 4;
# the V columns are (head, copy) pairs, which puts head i on the same lanes in both dots.
#
# Codes: the tile is read as int16 elements u (bytes 2u, 2u+1 of a row = 8 codes). For code position p (0-3: bits
# 2p of byte 2u = channel 2u + pQ; 4-7: byte 2u+1, code p-4 = channel 2u+1 + (p-4)Q) one `lop3` per 32-bit register
# gives two fp16 values 1024 + M_p * code, M_p = 4^(bit position / 2) with the code left where it is (the fp16
# mantissa holds bits 0-9, so positions 0-4 need no shift, 5-7 share one `shr`): 9 instructions per 16 codes,
# element-wise in the int16 elements (pack=2), so correct in any register layout. The per-position factor M_p
# is folded into the query (QB_p = q * 16 / M_p, a power of two: exact) and into the output (acc_p / M_p).
# K side: the 1024 offset of positions 0 and 1 (offset / code ratio 1024 and 256) is subtracted exactly in fp16, that
# of the others folded out of the fresh per-tile score, s = ks * (S - 1024 sum_{p >= 2} q' - 16 z sum q) / 16.
# V side (VFOLD False): the offset is subtracted exactly in fp16 (`sub.f16x2`, 8 more per 16 codes), because the
# accumulator spans the whole chunk; VFOLD True: the tile's dot starts from zero and 1024 * sum_t pv is subtracted
# from it in fp32 before it is added to the accumulator (same precision, the subtraction moves to the accumulator).
# ------------------------------------------------------------------------------------------------------------
_M5 = (1, 4, 16, 64, 256, 16, 64, 256)  # M_p: the multiplier of code position p in its fp16 value
_ASM5_HEAD = tl.constexpr("{ .reg .b32 t, m; mov.b32 m, 0x64006400; ")
# One lop3 per output ((a & b) | c, LUT 0xEA): code position p of both int16 halves of $8, under the fp16 exponent
# of 1024 (the magic register m), into output $p; positions 5-7 (bits 10-15) come from one shift by 6.
_ASM5_BODY = tl.constexpr(
    "lop3.b32 $0, $8, 0x00030003, m, 0xEA; "
    "lop3.b32 $1, $8, 0x000C000C, m, 0xEA; "
    "lop3.b32 $2, $8, 0x00300030, m, 0xEA; "
    "lop3.b32 $3, $8, 0x00C000C0, m, 0xEA; "
    "lop3.b32 $4, $8, 0x03000300, m, 0xEA; "
    "shr.b32 t, $8, 6; "
    "lop3.b32 $5, t, 0x00300030, m, 0xEA; "
    "lop3.b32 $6, t, 0x00C000C0, m, 0xEA; "
    "lop3.b32 $7, t, 0x03000300, m, 0xEA; ")
_ASM5_SUB = tl.constexpr(
    "sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; sub.f16x2 $2, $2, m; sub.f16x2 $3, $3, m; "
    "sub.f16x2 $4, $4, m; sub.f16x2 $5, $5, m; sub.f16x2 $6, $6, m; sub.f16x2 $7, $7, m; ")
_ASM5_SUB01 = tl.constexpr("sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; ")
_ASM5_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r")
# impl 6: the code bits alone, without an exponent, ARE an fp16 subnormal: bits `M_p * code` read as fp16 equal
# M_p * code * 2^-24 exactly. So one `and` per output gives the operand with no offset to subtract or fold (the V side
# of impl 5 spent 8 `sub.f16x2` per 16 codes on it); the 2^24 goes into the fp32 scale after the dot. Needs tensor
# cores that keep fp16 subnormal operands (Hopper does; the bench and GPU tests check against float64).
_ASM6_BODY = tl.constexpr(
    "{ .reg .b32 t; "
    "and.b32 $0, $8, 0x00030003; "
    "and.b32 $1, $8, 0x000C000C; "
    "and.b32 $2, $8, 0x00300030; "
    "and.b32 $3, $8, 0x00C000C0; "
    "and.b32 $4, $8, 0x03000300; "
    "shr.b32 t, $8, 6; "
    "and.b32 $5, t, 0x00300030; "
    "and.b32 $6, t, 0x00C000C0; "
    "and.b32 $7, t, 0x03000300; }")


@triton.jit
def _pos_codes(w, SH: tl.constexpr, MASK: tl.constexpr, SUB: tl.constexpr):
    """Plain-Triton code position of an int16 tile (interpreter): fp16 bits `((w >> SH) & MASK) | 0x6400`, i.e.
    1024 + M_p * code (SUB: minus 1024, exact)."""
    x = (((w.to(tl.int32) >> SH) & MASK) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    if SUB:
        x = (x.to(tl.float32) - 1024.0).to(tl.float16)
    return x


@triton.jit
def _pos_codes_subn(w, SH: tl.constexpr, MASK: tl.constexpr):
    """Plain-Triton code position as an fp16 subnormal (interpreter): bits `(w >> SH) & MASK` = M_p * code * 2^-24."""
    return ((w.to(tl.int32) >> SH) & MASK).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _codes8_subn(w, ASM: tl.constexpr):
    """int16 code tile `w [R, C]` -> 8 fp16 tiles `[R, C]`, tile p = M_p * (code p of each element) * 2^-24 (impl 6:
    fp16 subnormals, exact, no offset)."""
    if ASM:
        x0, x1, x2, x3, x4, x5, x6, x7 = tl.inline_asm_elementwise(
            _ASM6_BODY, _ASM5_CONSTRAINTS, [w], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    else:
        x0 = _pos_codes_subn(w, 0, 0x0003)
        x1 = _pos_codes_subn(w, 0, 0x000C)
        x2 = _pos_codes_subn(w, 0, 0x0030)
        x3 = _pos_codes_subn(w, 0, 0x00C0)
        x4 = _pos_codes_subn(w, 0, 0x0300)
        x5 = _pos_codes_subn(w, 6, 0x0030)
        x6 = _pos_codes_subn(w, 6, 0x00C0)
        x7 = _pos_codes_subn(w, 6, 0x0300)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _codes8(w, SUB: tl.constexpr, ASM: tl.constexpr):
    """int16 code tile `w [R, C]` -> 8 fp16 tiles `[R, C]`, tile p = 1024 + M_p * (code p of each element) (SUB 2:
    all without the 1024; SUB 1: positions 0 and 1 only, the two with the largest offset-to-code ratio). Element-wise,
    so the register layout Triton picks does not matter."""
    if ASM:
        if SUB == 2:
            x0, x1, x2, x3, x4, x5, x6, x7 = tl.inline_asm_elementwise(
                _ASM5_HEAD + _ASM5_BODY + _ASM5_SUB + _ASM_TAIL, _ASM5_CONSTRAINTS, [w],
                dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        elif SUB == 1:
            x0, x1, x2, x3, x4, x5, x6, x7 = tl.inline_asm_elementwise(
                _ASM5_HEAD + _ASM5_BODY + _ASM5_SUB01 + _ASM_TAIL, _ASM5_CONSTRAINTS, [w],
                dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = tl.inline_asm_elementwise(
                _ASM5_HEAD + _ASM5_BODY + _ASM_TAIL, _ASM5_CONSTRAINTS, [w],
                dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    else:
        x0 = _pos_codes(w, 0, 0x0003, SUB >= 1)
        x1 = _pos_codes(w, 0, 0x000C, SUB >= 1)
        x2 = _pos_codes(w, 0, 0x0030, SUB == 2)
        x3 = _pos_codes(w, 0, 0x00C0, SUB == 2)
        x4 = _pos_codes(w, 0, 0x0300, SUB == 2)
        x5 = _pos_codes(w, 6, 0x0030, SUB == 2)
        x6 = _pos_codes(w, 6, 0x00C0, SUB == 2)
        x7 = _pos_codes(w, 6, 0x0300, SUB == 2)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _dot_acc(a, b, acc, INTERP: tl.constexpr, F16: tl.constexpr = False):
    """`acc + a @ b` (fp16 operands, fp32 accumulator; widened to fp32 under the interpreter). F16: an fp16
    accumulator (`HMMA.F16`; the interpreter rounds to fp16 after the dot)."""
    if INTERP and F16:
        return (acc.to(tl.float32) + tl.dot(a.to(tl.float32), b.to(tl.float32))).to(tl.float16)
    elif INTERP:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif F16:
        return tl.dot(a, b, acc, out_dtype=tl.float16)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _qb(q_cols, offs_u, u_ok, c_half, c_ok, POS: tl.constexpr, Q: tl.constexpr, FAC: tl.constexpr):
    """Query operand of code position POS: `[U_PAD, NQ]` fp16, row u = channel 2u + POS // 4 + (POS % 4) * Q,
    column (i, e) = query head i times FAC = 16 / M_POS where e == POS // 4 (the channel half), else 0."""
    ch = 2 * offs_u + POS // 4 + (POS % 4) * Q
    m = u_ok[:, None] & c_ok[None, :] & (c_half == POS // 4)[None, :]
    return (tl.load(q_cols + ch[:, None], mask=m, other=0.0).to(tl.float32) * FAC).to(tl.float16)


@triton.jit
def _store_pos(o_cols, acc, z2, inv2, offs_u, omask, POS: tl.constexpr, Q: tl.constexpr, INV_M: tl.constexpr):
    """Store code position POS of the output: channels 2u + POS // 4 + (POS % 4) * Q, `(acc / M - z) / l`."""
    ch = 2 * offs_u + POS // 4 + (POS % 4) * Q
    tl.store(o_cols + ch[:, None], (acc * INV_M - z2[None, :]) * inv2[None, :], mask=omask)


@triton.jit
def _dot_chain8(x0, x1, x2, x3, x4, x5, x6, x7, b0, b1, b2, b3, b4, b5, b6, b7, acc, INTERP: tl.constexpr,
                F16: tl.constexpr = False):
    """`acc + sum_p x_p @ b_p` over the 8 code positions, as one chain of MMAs into one accumulator (`_dot_acc`)."""
    acc = _dot_acc(x0, b0, acc, INTERP, F16)
    acc = _dot_acc(x1, b1, acc, INTERP, F16)
    acc = _dot_acc(x2, b2, acc, INTERP, F16)
    acc = _dot_acc(x3, b3, acc, INTERP, F16)
    acc = _dot_acc(x4, b4, acc, INTERP, F16)
    acc = _dot_acc(x5, b5, acc, INTERP, F16)
    acc = _dot_acc(x6, b6, acc, INTERP, F16)
    return _dot_acc(x7, b7, acc, INTERP, F16)


@triton.jit
def _position_scores(x0, x1, x2, x3, x4, x5, x6, x7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, ROWS: tl.constexpr,
                     GP: tl.constexpr, NQ: tl.constexpr, INTERP: tl.constexpr):
    """Raw scores `[ROWS, GP]` of ROWS tokens: the 8 code positions' operands `[ROWS, U_PAD]` against their query
    operands `[U_PAD, NQ]`, one MMA chain, then the two channel halves of each head summed."""
    st = _dot_chain8(x0, x1, x2, x3, x4, x5, x6, x7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7,
                     tl.zeros([ROWS, NQ], tl.float32), INTERP)
    return tl.sum(tl.reshape(st, [ROWS, GP, 2]), axis=2)


@triton.jit
def _v_operand(pv, ROWS: tl.constexpr, NQ: tl.constexpr, SPARE_ZERO: tl.constexpr):
    """The V dot's operand `[ROWS, NQ]` from p * scale `[ROWS, NQ / 2]`: column (i, 0) = head i; column (i, 1) a copy
    (it puts head i on the same lanes in both dots; its results are never stored) or, with SPARE_ZERO
    (`V_SPARE_ZERO`), zeros, which leave the stored columns bit for bit the same."""
    if SPARE_ZERO:
        spare = tl.zeros_like(pv)
    else:
        spare = pv
    return tl.reshape(tl.join(pv, spare), [ROWS, NQ])


@triton.jit
def _tile_t(kw, vw, ks, kz, vs, vz, t_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, qoff, qsum, qsum_s, ksc, ksc_s,
            m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
            GP: tl.constexpr, NQ: tl.constexpr, U_PAD: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr,
            ASM: tl.constexpr, VFOLD: tl.constexpr, TILE_ACC: tl.constexpr, SUBN: tl.constexpr,
            MASKED: tl.constexpr = True, SPARE_ZERO: tl.constexpr = False):
    """One tile of `_int2_decode_kernel_t`: int16 code tiles kw `[BLOCK_N, U_PAD]`, vw `[U_PAD, BLOCK_N]`, fp32
    scale/zero vectors `[BLOCK_N]` (vs, vz zero where not t_ok) -> the updated online-softmax state. MASKED: scores
    of tokens outside t_ok become -inf (False: every token of the tile is valid, t_ok is ignored)."""
    if SUBN:
        x0, x1, x2, x3, x4, x5, x6, x7 = _codes8_subn(kw, ASM)
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = _codes8(kw, 1, ASM)
    sc = _position_scores(x0, x1, x2, x3, x4, x5, x6, x7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, BLOCK_N, GP, NQ,
                          INTERP)  # [BLOCK_N, GP]
    if SUBN:
        s = (sc - kz[:, None] * qsum_s[None, :]) * (ks * ksc_s)[:, None]
    else:
        s = (sc - qoff[None, :] - kz[:, None] * qsum[None, :]) * (ks * ksc)[:, None]
    if MASKED:
        s = tl.where(t_ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: the tile holds at least one valid token
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    pv = (p * vs[:, None]).to(tl.float16)  # p * scale <= 65504: the scale is stored in fp16
    pvf = pv.to(tl.float32)
    acc_z = acc_z * alpha + tl.sum(pvf * vz[:, None], axis=0)
    pb = _v_operand(pv, BLOCK_N, NQ, SPARE_ZERO)
    a2 = tl.reshape(tl.join(alpha, alpha), [NQ])

    if SUBN:
        y0, y1, y2, y3, y4, y5, y6, y7 = _codes8_subn(vw, ASM)
    else:
        y0, y1, y2, y3, y4, y5, y6, y7 = _codes8(vw, 0 if VFOLD else 2, ASM)
    if VFOLD and not SUBN:
        ps = tl.sum(pvf, axis=0) * 1024.0
        poff = tl.reshape(tl.join(ps, ps), [NQ])[None, :]
        zero = tl.zeros([U_PAD, NQ], tl.float32)
        acc0 = acc0 * a2[None, :] + (_dot_acc(y0, pb, zero, INTERP) - poff)
        acc1 = acc1 * a2[None, :] + (_dot_acc(y1, pb, zero, INTERP) - poff)
        acc2 = acc2 * a2[None, :] + (_dot_acc(y2, pb, zero, INTERP) - poff)
        acc3 = acc3 * a2[None, :] + (_dot_acc(y3, pb, zero, INTERP) - poff)
        acc4 = acc4 * a2[None, :] + (_dot_acc(y4, pb, zero, INTERP) - poff)
        acc5 = acc5 * a2[None, :] + (_dot_acc(y5, pb, zero, INTERP) - poff)
        acc6 = acc6 * a2[None, :] + (_dot_acc(y6, pb, zero, INTERP) - poff)
        acc7 = acc7 * a2[None, :] + (_dot_acc(y7, pb, zero, INTERP) - poff)
    elif TILE_ACC:
        # Fresh per-tile dot, added to the chunk accumulator by an fp32 FFMA (round to nearest). tl.fma, not
        # `+`: Triton would fuse `acc + dot(a, b, 0)` back into the MMA's accumulator (the chained form below).
        zero = tl.zeros([U_PAD, NQ], tl.float32)
        acc0 = tl.fma(acc0, a2[None, :], _dot_acc(y0, pb, zero, INTERP))
        acc1 = tl.fma(acc1, a2[None, :], _dot_acc(y1, pb, zero, INTERP))
        acc2 = tl.fma(acc2, a2[None, :], _dot_acc(y2, pb, zero, INTERP))
        acc3 = tl.fma(acc3, a2[None, :], _dot_acc(y3, pb, zero, INTERP))
        acc4 = tl.fma(acc4, a2[None, :], _dot_acc(y4, pb, zero, INTERP))
        acc5 = tl.fma(acc5, a2[None, :], _dot_acc(y5, pb, zero, INTERP))
        acc6 = tl.fma(acc6, a2[None, :], _dot_acc(y6, pb, zero, INTERP))
        acc7 = tl.fma(acc7, a2[None, :], _dot_acc(y7, pb, zero, INTERP))
    else:
        # Chained: the MMA accumulates onto the chunk accumulator. Tensor cores add in fp32 with truncation, so
        # this sum of positive terms drifts low by ~(tokens / 16) ulp over a chunk (see TILE_ACC).
        acc0 = _dot_acc(y0, pb, acc0 * a2[None, :], INTERP)
        acc1 = _dot_acc(y1, pb, acc1 * a2[None, :], INTERP)
        acc2 = _dot_acc(y2, pb, acc2 * a2[None, :], INTERP)
        acc3 = _dot_acc(y3, pb, acc3 * a2[None, :], INTERP)
        acc4 = _dot_acc(y4, pb, acc4 * a2[None, :], INTERP)
        acc5 = _dot_acc(y5, pb, acc5 * a2[None, :], INTERP)
        acc6 = _dot_acc(y6, pb, acc6 * a2[None, :], INTERP)
        acc7 = _dot_acc(y7, pb, acc7 * a2[None, :], INTERP)
    return m_new, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


# ---------------------------------------------------------------------------------------------------------------
# Whole-page tiles in four 16-token pieces (impl 6, FULL_TILES, BLOCK_N = 64). Every dot has K = 16 tokens at most,
# so Triton loads each V-side B operand (p * scale, [16, NQ]) with one `ldmatrix.x2.trans` into a consecutive
# register pair. With one [64, NQ] operand it used `ldmatrix.x4.trans`, whose registers come out in the order
# (k 0-7, 16-23, 8-15, 24-31): the MMA pairs were not consecutive and ptxas copied them before almost every MMA
# (about 36 moves per tile). Pieces: 650 instead of 674 instructions per tile and 126 instead of 156 registers
# (16 programs per SM instead of 12; Triton 3.6, sm_90). Kernel at 128K / batch 8 on an H200: 0.1757 vs 0.1888 ms
# (bench/results/profile_tile_pieces_NVIDIA_H200.txt, bench/NOTES_decode.md v9).
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _split4(x):
    """`[64]` -> its four consecutive `[16]` pieces, split in registers (the loads stay whole-vector cp.async)."""
    y = tl.reshape(tl.permute(tl.reshape(x, [4, 16]), (1, 0)), [16, 2, 2])
    a, b = tl.split(y)
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _score16(kw, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, kz, ks, qsum_s, ksc_s, GP: tl.constexpr, NQ: tl.constexpr,
             ASM: tl.constexpr, INTERP: tl.constexpr):
    """Scaled logits `[16, GP]` of a 16-token piece: codes kw `[16, U_PAD]` int16, zero/scale kz, ks `[16]` fp32."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _codes8_subn(kw, ASM)
    sc = _position_scores(x0, x1, x2, x3, x4, x5, x6, x7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, 16, GP, NQ, INTERP)
    return (sc - kz[:, None] * qsum_s[None, :]) * (ks * ksc_s)[:, None]


@triton.jit
def _codes_i8(kb, J: tl.constexpr, ASM: tl.constexpr):
    """Code position J of each byte of an int8 or uint8 code tile (channel quarter J, see the module docstring) as
    int8 0..3: one `shr` and one `and` per four codes (J = 0: the `and` alone), as inline PTX on 32-bit registers
    (Triton alone spends byte permutes on it)."""
    if not ASM:
        return ((kb >> (2 * J)) & 3).to(tl.int8)
    elif J == 0:
        return tl.inline_asm_elementwise("and.b32 $0, $1, 0x03030303;", "=r,r", [kb], dtype=tl.int8,
                                         is_pure=True, pack=4)
    elif J == 1:
        return tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 2; and.b32 $0, t, 0x03030303; }", "=r,r",
                                         [kb], dtype=tl.int8, is_pure=True, pack=4)
    elif J == 2:
        return tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x03030303; }", "=r,r",
                                         [kb], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 6; and.b32 $0, t, 0x03030303; }", "=r,r",
                                         [kb], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _qi8_quarter(qj, c_half, sq):
    """The int8 query operand of a channel quarter (`KI8`) from its fp32 query tile qj `[Q, NQ]` (row j = channel
    j + k Q, both columns of head i holding head i's query): column (i, 0) = hi = round(q / sq) and column (i, 1) =
    lo = round(254 (q / sq - hi)), both in [-127, 127], so that q = sq (hi + lo / 254) to within sq / 508 (sq
    `[NQ]`: the head's max |q| / 127)."""
    qs = qj / sq[None, :]
    hi = tl.floor(qs + 0.5)
    lo = tl.floor((qs - hi) * 254.0 + 0.5)
    return tl.where((c_half == 0)[None, :], hi, lo).to(tl.int8)


@triton.jit
def _score16_i8(kb, qi0, qi1, qi2, qi3, kz, ks, qz8, csc8, GP: tl.constexpr, NQ: tl.constexpr, ASM: tl.constexpr):
    """Scaled logits `[16, GP]` of a 16-token piece from its code bytes kb `[16, Q]` int8 (`KI8`): one m16n8k32
    integer MMA per channel quarter (half the MMAs of the fp16 path), exact int32 sums; the hi and lo columns of
    each head recombine as 254 hi + lo (exact in fp32: at most 128 * 3 * 127 * 255 < 2^24 for d <= 128).
    qz8 `[GP]`: the same combination of the query operands' sums (the zero term); csc8 `[GP]`: the log2 softmax
    scale times sq / 254."""
    acc = tl.zeros([16, NQ], tl.int32)
    acc = tl.dot(_codes_i8(kb, 0, ASM), qi0, acc, out_dtype=tl.int32)
    acc = tl.dot(_codes_i8(kb, 1, ASM), qi1, acc, out_dtype=tl.int32)
    acc = tl.dot(_codes_i8(kb, 2, ASM), qi2, acc, out_dtype=tl.int32)
    acc = tl.dot(_codes_i8(kb, 3, ASM), qi3, acc, out_dtype=tl.int32)
    hi, lo = tl.split(tl.reshape(acc, [16, GP, 2]))
    sc = (hi * 254 + lo).to(tl.float32)
    return (sc - kz[:, None] * qz8[None, :]) * (ks[:, None] * csc8[None, :])


@triton.jit
def _pv16(p, vs, NQ: tl.constexpr, SPARE_ZERO: tl.constexpr = False):
    """p * V scale in fp16 (`[16, GP]`, for the zero term) and as the V dot's operand `[16, NQ]` (`_v_operand`)."""
    pv = (p * vs[:, None]).to(tl.float16)
    return pv, _v_operand(pv, 16, NQ, SPARE_ZERO)


@triton.jit
def _vdot16(vw, pb, t0, t1, t2, t3, t4, t5, t6, t7, ASM: tl.constexpr, INTERP: tl.constexpr):
    """Add a 16-token piece's V dot (codes vw `[U_PAD, 16]`, operand pb `[16, NQ]`) to the tile's 8 position dots."""
    y0, y1, y2, y3, y4, y5, y6, y7 = _codes8_subn(vw, ASM)
    return (_dot_acc(y0, pb, t0, INTERP), _dot_acc(y1, pb, t1, INTERP), _dot_acc(y2, pb, t2, INTERP),
            _dot_acc(y3, pb, t3, INTERP), _dot_acc(y4, pb, t4, INTERP), _dot_acc(y5, pb, t5, INTERP),
            _dot_acc(y6, pb, t6, INTERP), _dot_acc(y7, pb, t7, INTERP))


@triton.jit
def _load_piece(base, offs, u_ok, U: tl.constexpr, U_PAD: tl.constexpr, ROWS_U: tl.constexpr):
    """A 16-token piece of codes (unmasked inside the page; only the padded words past U are masked)."""
    if U == U_PAD:
        return tl.load(base + offs)
    elif ROWS_U:
        return tl.load(base + offs, mask=u_ok[:, None], other=0)
    else:
        return tl.load(base + offs, mask=u_ok[None, :], other=0)


@triton.jit
def _page_scores(kc_ptr, ks_ptr, kz_ptr, page, r0, h, stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh,
                 stride_ksr, offs_n, offs_u, u_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, qsum_s, ksc_s,
                 GP: tl.constexpr, NQ: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr, ASM: tl.constexpr,
                 INTERP: tl.constexpr, KI8: tl.constexpr = False):
    """Scaled logits of the 64 tokens at row r0 of page `page`, KV head h, as four `[16, GP]` pieces. KI8: the
    code rows are read as bytes and scored by integer MMAs (`_score16_i8`); qb0-qb3 are then the int8 quarter
    operands, qsum_s and ksc_s the `[GP]` zero-term sums and column scales (qb4-qb7 unused)."""
    o16 = tl.arange(0, 16)
    srow = page * stride_ksp + h * stride_ksh + (r0 + offs_n) * stride_ksr
    # Scale vectors as whole [64] loads (16 B per lane: cp.async), split in registers.
    ks0, ks1, ks2, ks3 = _split4(tl.load(ks_ptr + srow).to(tl.float32))
    kz0, kz1, kz2, kz3 = _split4(tl.load(kz_ptr + srow).to(tl.float32))
    if KI8:
        # The int16 pool viewed as bytes (offsets doubled): row r of a page is 2 U bytes, byte j holding channels
        # j + k Q of quarters k = 0..3.
        kb8 = kc_ptr.to(tl.pointer_type(tl.int8), bitcast=True) + 2 * (page * stride_kcp + h * stride_kch
                                                                        + r0 * stride_kcr)
        b_offs = o16[:, None] * (2 * stride_kcr) + tl.arange(0, 2 * U)[None, :]  # [16, Q]
        s0 = _score16_i8(tl.load(kb8 + b_offs), qb0, qb1, qb2, qb3, kz0, ks0, qsum_s, ksc_s, GP, NQ, ASM)
        s1 = _score16_i8(tl.load(kb8 + 16 * (2 * stride_kcr) + b_offs), qb0, qb1, qb2, qb3, kz1, ks1, qsum_s, ksc_s,
                         GP, NQ, ASM)
        s2 = _score16_i8(tl.load(kb8 + 32 * (2 * stride_kcr) + b_offs), qb0, qb1, qb2, qb3, kz2, ks2, qsum_s, ksc_s,
                         GP, NQ, ASM)
        s3 = _score16_i8(tl.load(kb8 + 48 * (2 * stride_kcr) + b_offs), qb0, qb1, qb2, qb3, kz3, ks3, qsum_s, ksc_s,
                         GP, NQ, ASM)
    else:
        kb = kc_ptr + page * stride_kcp + h * stride_kch + r0 * stride_kcr
        k_offs = o16[:, None] * stride_kcr + offs_u[None, :]  # [16, U_PAD]
        s0 = _score16(_load_piece(kb, k_offs, u_ok, U, U_PAD, False), qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7,
                      kz0, ks0, qsum_s, ksc_s, GP, NQ, ASM, INTERP)
        s1 = _score16(_load_piece(kb + 16 * stride_kcr, k_offs, u_ok, U, U_PAD, False), qb0, qb1, qb2, qb3, qb4, qb5,
                      qb6, qb7, kz1, ks1, qsum_s, ksc_s, GP, NQ, ASM, INTERP)
        s2 = _score16(_load_piece(kb + 32 * stride_kcr, k_offs, u_ok, U, U_PAD, False), qb0, qb1, qb2, qb3, qb4, qb5,
                      qb6, qb7, kz2, ks2, qsum_s, ksc_s, GP, NQ, ASM, INTERP)
        s3 = _score16(_load_piece(kb + 48 * stride_kcr, k_offs, u_ok, U, U_PAD, False), qb0, qb1, qb2, qb3, qb4, qb5,
                      qb6, qb7, kz3, ks3, qsum_s, ksc_s, GP, NQ, ASM, INTERP)
    return s0, s1, s2, s3


@triton.jit
def _page_values(vc_ptr, vs_ptr, page, r0, h, vz64, s0, s1, s2, s3, m_new, t0, t1, t2, t3, t4, t5, t6, t7,
                 stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, offs_n, offs_u, u_ok,
                 NQ: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr, ASM: tl.constexpr, INTERP: tl.constexpr,
                 SPARE_ZERO: tl.constexpr = False, VPAIR: tl.constexpr = False):
    """The probabilities of four logit pieces (`_page_scores`) against the running max m_new: their V dots chained
    onto the 8 position dots t0..t7, and per-lane partial sums `[16, GP]` of p and of p * scale * zero (reduced
    across lanes once per tile by the caller). vz64: the page rows' V zeros `[64]`."""
    o16 = tl.arange(0, 16)
    vb = vc_ptr + page * stride_vcp + h * stride_vch + r0 * stride_vcr
    v_offs = o16[None, :] * stride_vcr + offs_u[:, None]  # [U_PAD, 16]
    if VPAIR:
        # (scale, zero) pairs side by side (`V_PAIRED_POOLS`): one `[64, 2]` load, which the pipeliner makes
        # asynchronous because the scales feed the V dots, brings the zeros along (vz64 is unused).
        sz = tl.load(vs_ptr + page * stride_vsp + h * stride_vsh + (r0 + offs_n)[:, None] * stride_vsr
                     + tl.arange(0, 2)[None, :])
        vs64, vz64 = tl.split(sz)
    else:
        vs64 = tl.load(vs_ptr + page * stride_vsp + h * stride_vsh + (r0 + offs_n) * stride_vsr)
    vs0, vs1, vs2, vs3 = _split4(vs64.to(tl.float32))
    vz0, vz1, vz2, vz3 = _split4(vz64.to(tl.float32))
    p0 = tl.exp2(s0 - m_new[None, :])
    p1 = tl.exp2(s1 - m_new[None, :])
    p2 = tl.exp2(s2 - m_new[None, :])
    p3 = tl.exp2(s3 - m_new[None, :])
    pv0, pb0 = _pv16(p0, vs0, NQ, SPARE_ZERO)
    pv1, pb1 = _pv16(p1, vs1, NQ, SPARE_ZERO)
    pv2, pb2 = _pv16(p2, vs2, NQ, SPARE_ZERO)
    pv3, pb3 = _pv16(p3, vs3, NQ, SPARE_ZERO)
    t0, t1, t2, t3, t4, t5, t6, t7 = _vdot16(_load_piece(vb, v_offs, u_ok, U, U_PAD, True), pb0,
                                             t0, t1, t2, t3, t4, t5, t6, t7, ASM, INTERP)
    t0, t1, t2, t3, t4, t5, t6, t7 = _vdot16(_load_piece(vb + 16 * stride_vcr, v_offs, u_ok, U, U_PAD, True), pb1,
                                             t0, t1, t2, t3, t4, t5, t6, t7, ASM, INTERP)
    t0, t1, t2, t3, t4, t5, t6, t7 = _vdot16(_load_piece(vb + 32 * stride_vcr, v_offs, u_ok, U, U_PAD, True), pb2,
                                             t0, t1, t2, t3, t4, t5, t6, t7, ASM, INTERP)
    t0, t1, t2, t3, t4, t5, t6, t7 = _vdot16(_load_piece(vb + 48 * stride_vcr, v_offs, u_ok, U, U_PAD, True), pb3,
                                             t0, t1, t2, t3, t4, t5, t6, t7, ASM, INTERP)
    z_sum = (pv0.to(tl.float32) * vz0[:, None] + pv1.to(tl.float32) * vz1[:, None]
             + pv2.to(tl.float32) * vz2[:, None] + pv3.to(tl.float32) * vz3[:, None])
    return t0, t1, t2, t3, t4, t5, t6, t7, p0 + p1 + p2 + p3, z_sum


@triton.jit
def _max4(s0, s1, s2, s3):
    return tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3))


@triton.jit
def _tile_pieces(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, page, r0, h, vz_cur, page_b, vz_b,
                 stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
                 stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr,
                 offs_n, offs_u, u_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, qsum_s, ksc_s,
                 m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                 GP: tl.constexpr, NQ: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr,
                 ASM: tl.constexpr, INTERP: tl.constexpr, TWO: tl.constexpr = False,
                 SPARE_ZERO: tl.constexpr = False, VPAIR: tl.constexpr = False, TILE_ACC: tl.constexpr = True,
                 KI8: tl.constexpr = False):
    """One whole tile in 16-token pieces -> the updated online-softmax state (same arithmetic as `_tile_t` without
    masks): the 64 tokens at row r0 of page `page` (vz_cur: their V zeros `[64]`, prefetched by the caller), and with
    TWO the 64 rows of page_b after them (V zeros vz_b), so one softmax step and one accumulator update serve 128
    tokens. TILE_ACC False: the V dots chain onto the rescaled chunk accumulators (`IMPL5_TILE_ACC`)."""
    sa0, sa1, sa2, sa3 = _page_scores(kc_ptr, ks_ptr, kz_ptr, page, r0, h, stride_kcp, stride_kch, stride_kcr,
                                      stride_ksp, stride_ksh, stride_ksr, offs_n, offs_u, u_ok, qb0, qb1, qb2, qb3,
                                      qb4, qb5, qb6, qb7, qsum_s, ksc_s, GP, NQ, U, U_PAD, ASM, INTERP, KI8)
    mx = _max4(sa0, sa1, sa2, sa3)
    if TWO:
        sb0, sb1, sb2, sb3 = _page_scores(kc_ptr, ks_ptr, kz_ptr, page_b, 0, h, stride_kcp, stride_kch, stride_kcr,
                                          stride_ksp, stride_ksh, stride_ksr, offs_n, offs_u, u_ok, qb0, qb1, qb2,
                                          qb3, qb4, qb5, qb6, qb7, qsum_s, ksc_s, GP, NQ, U, U_PAD, ASM, INTERP,
                                          KI8)
        mx = tl.maximum(mx, _max4(sb0, sb1, sb2, sb3))
    m_new = tl.maximum(m_i, tl.max(mx, axis=0))
    alpha = tl.exp2(m_i - m_new)
    a2 = tl.reshape(tl.join(alpha, alpha), [NQ])[None, :]
    if TILE_ACC:
        # Fresh per-tile V dots (the pieces chained in the MMA accumulator, as the one [64]-token dot was), added to
        # the chunk accumulators by an fp32 FFMA below.
        z = tl.zeros([U_PAD, NQ], tl.float32)
        i0, i1, i2, i3, i4, i5, i6, i7 = z, z, z, z, z, z, z, z
    else:
        # Chained: the MMAs accumulate onto the rescaled chunk accumulators (no fresh dots live: 32 fewer registers;
        # tensor cores truncate, so the sum drifts low over a long chunk, see `_tile_t`).
        i0, i1, i2, i3 = acc0 * a2, acc1 * a2, acc2 * a2, acc3 * a2
        i4, i5, i6, i7 = acc4 * a2, acc5 * a2, acc6 * a2, acc7 * a2
    t0, t1, t2, t3, t4, t5, t6, t7, p_sum, z_sum = _page_values(
        vc_ptr, vs_ptr, page, r0, h, vz_cur, sa0, sa1, sa2, sa3, m_new, i0, i1, i2, i3, i4, i5, i6, i7,
        stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, offs_n, offs_u, u_ok,
        NQ, U, U_PAD, ASM, INTERP, SPARE_ZERO, VPAIR)
    if TWO:
        t0, t1, t2, t3, t4, t5, t6, t7, p_b, z_b = _page_values(
            vc_ptr, vs_ptr, page_b, 0, h, vz_b, sb0, sb1, sb2, sb3, m_new, t0, t1, t2, t3, t4, t5, t6, t7,
            stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, offs_n, offs_u, u_ok,
            NQ, U, U_PAD, ASM, INTERP, SPARE_ZERO, VPAIR)
        p_sum += p_b
        z_sum += z_b
    l_i = l_i * alpha + tl.sum(p_sum, axis=0)
    acc_z = acc_z * alpha + tl.sum(z_sum, axis=0)
    if TILE_ACC:
        return (m_new, l_i, acc_z, tl.fma(acc0, a2, t0), tl.fma(acc1, a2, t1), tl.fma(acc2, a2, t2),
                tl.fma(acc3, a2, t3), tl.fma(acc4, a2, t4), tl.fma(acc5, a2, t5), tl.fma(acc6, a2, t6),
                tl.fma(acc7, a2, t7))
    else:
        return m_new, l_i, acc_z, t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _page_tile_loads(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, page, r0, h, stride_kcp, stride_kch, stride_kcr,
                     stride_ksp, stride_ksh, stride_ksr, stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh,
                     stride_vsr, k_off, v_off, offs_n, u_ok, U: tl.constexpr, U_PAD: tl.constexpr):
    """Codes and scales of the tile at row r0 of page `page`, KV head h, read unmasked (the tile lies inside the
    allocated page, so the loads vectorize and go through cp.async): kw `[BLOCK_N, U_PAD]`, vw `[U_PAD, BLOCK_N]`
    int16, ks, kz, vs fp32 `[BLOCK_N]` (V zeros are loaded by the caller)."""
    kbase = page * stride_kcp + h * stride_kch + r0 * stride_kcr
    vbase = page * stride_vcp + h * stride_vch + r0 * stride_vcr
    if U == U_PAD:
        kw = tl.load(kc_ptr + kbase + k_off)
        vw = tl.load(vc_ptr + vbase + v_off)
    else:
        kw = tl.load(kc_ptr + kbase + k_off, mask=u_ok[None, :], other=0)
        vw = tl.load(vc_ptr + vbase + v_off, mask=u_ok[:, None], other=0)
    ks_rows = page * stride_ksp + h * stride_ksh + r0 * stride_ksr + offs_n * stride_ksr
    ks = tl.load(ks_ptr + ks_rows).to(tl.float32)
    kz = tl.load(kz_ptr + ks_rows).to(tl.float32)
    vs = tl.load(vs_ptr + page * stride_vsp + h * stride_vsh + r0 * stride_vsr + offs_n * stride_vsr).to(tl.float32)
    return kw, vw, ks, kz, vs


@triton.jit
def _tile_zeros(vz_ptr, page, h, t0, offs_n, stride_vsp, stride_vsh, stride_vsr, P: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The V zeros `[BLOCK_N]` (fp16) of the tile at token t0 (tile-aligned) in page `page`, KV head h."""
    return tl.load(vz_ptr + page * stride_vsp + h * stride_vsh + tl.multiple_of(t0 % P, BLOCK_N) * stride_vsr
                   + offs_n * stride_vsr)


@triton.jit
def _pick_page(pages, offs_pv, j):
    """Entry j of a register vector of page ids (a masked sum: no memory round trip), as an int64 for addressing."""
    return tl.sum(tl.where(offs_pv == j, pages, 0), axis=0).to(tl.int64)


@triton.jit(do_not_specialize=["split_offset"])
def _int2_decode_kernel_t(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr,
    qk_scale, split_offset,
    stride_qb, stride_qh,
    # Pool strides are compile-time constants: the cache's pools are contiguous, so they follow from the geometry
    # (one compile per model). The per-lane copy offsets then fold into immediates: 28 fewer instructions per tile
    # and no 64-bit offset registers live across the loop, which lets a 128-register cap hold without spills.
    stride_kcp: tl.constexpr, stride_kch: tl.constexpr, stride_kcr: tl.constexpr,
    stride_ksp: tl.constexpr, stride_ksh: tl.constexpr, stride_ksr: tl.constexpr,
    stride_vcp: tl.constexpr, stride_vch: tl.constexpr, stride_vcr: tl.constexpr,
    stride_vsp: tl.constexpr, stride_vsh: tl.constexpr, stride_vsr: tl.constexpr,
    stride_btb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, GP: tl.constexpr, Q: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr,
    P: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, VFOLD: tl.constexpr,
    TILE_ACC: tl.constexpr, SUBN: tl.constexpr = False, PAGE_VEC: tl.constexpr = False, NPV: tl.constexpr = 64,
    FULL_TILES: tl.constexpr = False, PAIR: tl.constexpr = False, SPARE_ZERO: tl.constexpr = False,
    VPAIR: tl.constexpr = False, KI8: tl.constexpr = False,
):
    # SUBN (impl 6): codes as exact fp16 subnormals (`_codes8_subn`), no code offset anywhere; else impl 5.
    # kc_ptr / vc_ptr: the code pools viewed as int16 `[pages, H, P, U]` (U = Q / 2), code strides in int16 units.
    # q: fp16 or bf16 `[B, H_q, d]`; one scale/zero group per row. Same outputs as `_int2_decode_kernel`.
    _int2_chunk_t(
        q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, qk_scale, split_offset,
        stride_qb, stride_qh, stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
        stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, stride_btb,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(2),
        GROUP, GP, Q, U, U_PAD, P, BLOCK_N, INTERP, VFOLD, TILE_ACC, SUBN, PAGE_VEC, NPV, FULL_TILES, PAIR,
        SPARE_ZERO=SPARE_ZERO, VPAIR=VPAIR, KI8=KI8)


@triton.jit
def _int2_chunk_t(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr,
    qk_scale, split_offset,
    stride_qb, stride_qh,
    stride_kcp, stride_kch, stride_kcr,
    stride_ksp, stride_ksh, stride_ksr,
    stride_vcp, stride_vch, stride_vcr,
    stride_vsp, stride_vsh, stride_vsr,
    stride_btb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    b, h, sp, n_split,
    GROUP: tl.constexpr, GP: tl.constexpr, Q: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr,
    P: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, VFOLD: tl.constexpr,
    TILE_ACC: tl.constexpr, SUBN: tl.constexpr, PAGE_VEC: tl.constexpr, NPV: tl.constexpr,
    FULL_TILES: tl.constexpr, PAIR: tl.constexpr = False, RANGE: tl.constexpr = 0,
    SPARE_ZERO: tl.constexpr = False, VPAIR: tl.constexpr = False, KI8: tl.constexpr = False,
):
    """Program (b, h, split sp of n_split) of `_int2_decode_kernel_t`: one chunk of sequence b's history, KV head h
    -> the partial output and log-sum-exp at split index `split_offset + sp` (also run by the fused decode kernel).
    PAIR: whole tiles of two pages (BLOCK_N = 2 P, chunks over the whole tiles only: RANGE 1); RANGE 2: the one-page
    tail that PAIR programs leave (see `_chunk_bounds`). VPAIR (whole-page tiles only): the V zero of a row is the
    fp16 right after its scale (`V_PAIRED_POOLS`), read with it. KI8 (whole-page tiles only, `K_INT8_SCORES`): the
    scores come from int8 MMAs on the code bytes against a hi/lo int8 split of the query (`_score16_i8`)."""
    ASM: tl.constexpr = not INTERP
    NQ: tl.constexpr = 2 * GP
    start, end = _chunk_bounds(len_ptr, b, sp, n_split, BLOCK_N, RANGE)

    offs_n = tl.arange(0, BLOCK_N)
    offs_u = tl.arange(0, U_PAD)
    u_ok = offs_u < U
    offs_c = tl.arange(0, NQ)
    c_head = offs_c // 2
    c_half = offs_c % 2
    c_ok = c_head < GROUP
    q_cols = q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + c_head)[None, :] * stride_qh  # [1, NQ]
    qb0 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 0, Q, 16.0)
    qb1 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 1, Q, 4.0)
    qb2 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 2, Q, 1.0)
    qb3 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 3, Q, 0.25)
    qb4 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 4, Q, 0.0625)
    qb5 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 5, Q, 1.0)
    qb6 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 6, Q, 0.25)
    qb7 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 7, Q, 0.0625)
    # 1024 * sum q' over positions 2-7 (the folded K offset; 0 and 1 are exact) and 16 * sum q (the zero term), per
    # head, from the operands themselves.
    qoff_c = tl.sum(qb2.to(tl.float32) + qb3.to(tl.float32) + qb4.to(tl.float32) + qb5.to(tl.float32) + qb6.to(tl.float32) + qb7.to(tl.float32), axis=0)
    qsum_c = tl.sum(qb0.to(tl.float32) + 4.0 * qb1.to(tl.float32) + 16.0 * qb2.to(tl.float32)
                    + 64.0 * qb3.to(tl.float32) + 256.0 * qb4.to(tl.float32) + 16.0 * qb5.to(tl.float32)
                    + 64.0 * qb6.to(tl.float32) + 256.0 * qb7.to(tl.float32), axis=0)
    qoff = 1024.0 * tl.sum(tl.reshape(qoff_c, [GP, 2]), axis=1)  # [GP]
    qsum = tl.sum(tl.reshape(qsum_c, [GP, 2]), axis=1)  # [GP], = 16 * sum_j q_j
    # SUBN: the score dot gives 2^-24 * (16 q . code); both the zero term and the scale move by 2^24.
    qsum_s = qsum * 5.9604644775390625e-08  # 2^-24: fp16 subnormal bits n = n * 2^-24
    ksc = qk_scale * 0.0625
    ksc_s = ksc * 16777216.0
    if KI8:
        # The query as int8 hi/lo pairs per head (`_qi8_quarter`): the hi/lo operands replace qb0-qb3, and the zero
        # term's query sum and the logits' column scale become per-head vectors (`_score16_i8`).
        q_rows = q_cols + tl.arange(0, Q)[:, None]  # [Q, NQ]: channel j of each column's head
        q0 = tl.load(q_rows, mask=c_ok[None, :], other=0.0).to(tl.float32)
        q1 = tl.load(q_rows + Q, mask=c_ok[None, :], other=0.0).to(tl.float32)
        q2 = tl.load(q_rows + 2 * Q, mask=c_ok[None, :], other=0.0).to(tl.float32)
        q3 = tl.load(q_rows + 3 * Q, mask=c_ok[None, :], other=0.0).to(tl.float32)
        amax = tl.max(tl.maximum(tl.maximum(tl.abs(q0), tl.abs(q1)), tl.maximum(tl.abs(q2), tl.abs(q3))), axis=0)
        sq = tl.where(amax > 0.0, amax / 127.0, 1.0)  # [NQ], the same for a head's two columns
        qb0 = _qi8_quarter(q0, c_half, sq)
        qb1 = _qi8_quarter(q1, c_half, sq)
        qb2 = _qi8_quarter(q2, c_half, sq)
        qb3 = _qi8_quarter(q3, c_half, sq)
        wcol = tl.where(c_half == 0, 254.0, 1.0)
        colsum = (tl.sum(qb0.to(tl.float32), axis=0) + tl.sum(qb1.to(tl.float32), axis=0)
                  + tl.sum(qb2.to(tl.float32), axis=0) + tl.sum(qb3.to(tl.float32), axis=0))
        qsum_s = tl.sum(tl.reshape(colsum * wcol, [GP, 2]), axis=1)  # [GP]: sum of (254 hi + lo) per head
        ksc_s = tl.max(tl.reshape(qk_scale * sq / 254.0, [GP, 2]), axis=1)  # [GP]
        # Convert the operands to the MMA's register layout here, once: used as loop invariants, Triton converted
        # them at each dot inside the tile loop (8 SHFL + 8 SEL per tile; shuffles cannot be hoisted). These dots
        # of zeros need the same conversions, which CSE then shares with the loop; the sum * 0.0 keeps them alive
        # (offline: 610 instead of 630 instructions per tile, bench/NOTES_decode.md v14).
        z8 = tl.zeros([16, Q], tl.int8)
        warm = (tl.dot(z8, qb0, out_dtype=tl.int32) + tl.dot(z8, qb1, out_dtype=tl.int32)
                + tl.dot(z8, qb2, out_dtype=tl.int32) + tl.dot(z8, qb3, out_dtype=tl.int32))
        ksc_s = ksc_s + tl.sum(tl.sum(warm, axis=0), axis=0).to(tl.float32) * 0.0

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc_z = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([U_PAD, NQ], tl.float32)
    acc1 = tl.zeros([U_PAD, NQ], tl.float32)
    acc2 = tl.zeros([U_PAD, NQ], tl.float32)
    acc3 = tl.zeros([U_PAD, NQ], tl.float32)
    acc4 = tl.zeros([U_PAD, NQ], tl.float32)
    acc5 = tl.zeros([U_PAD, NQ], tl.float32)
    acc6 = tl.zeros([U_PAD, NQ], tl.float32)
    acc7 = tl.zeros([U_PAD, NQ], tl.float32)

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    if PAGE_VEC:
        # Tiles never straddle pages (P % BLOCK_N == 0). Page ids come NPV at a time into registers, and each tile's
        # id is picked out of them, so every load address of a tile is a function of the loop index alone: Triton's
        # pipeliner then keeps num_stages - 1 tiles of codes AND scales in flight (cp.async). Loading the id per tile
        # from global memory made it wait on all copies every tile (ncu: 53 % of stalls on long scoreboard).
        offs_pv = tl.arange(0, NPV)
        k_off = offs_n[:, None] * stride_kcr + offs_u[None, :]  # [BLOCK_N, U_PAD]
        v_off = offs_n[None, :] * stride_vcr + offs_u[:, None]  # [U_PAD, BLOCK_N]
        # FULL_TILES: the caller promises whole pages of history (PagedKVCache's invariant), so every tile is full
        # and the loop needs no mask at all (56 fewer instructions per tile). Otherwise only the last tile of a
        # sequence is partial; rows past `end` may hold anything (they are read unmasked inside the allocated
        # page), so their V scale/zero are zeroed (p is 0 there, and 0 * NaN would not be) and their scores -inf.
        n_tiles = tl.cdiv(end - start, BLOCK_N)
        for jb in range(0, n_tiles, NPV):
            ti = jb + offs_pv
            pg = tl.load(bt_row + (start + ti * BLOCK_N) // P, mask=ti < n_tiles, other=0)
            n_in = tl.minimum(NPV, n_tiles - jb)
            # V zeros feed no dot, so the pipeliner leaves their load synchronous (ncu: the largest stall left);
            # they are prefetched by hand one tile ahead instead, as a loop-carried register.
            pg0 = _pick_page(pg, offs_pv, 0)
            if not VPAIR:
                vz_next = _tile_zeros(vz_ptr, pg0, h, start + jb * BLOCK_N, offs_n, stride_vsp, stride_vsh,
                                      stride_vsr, P, BLOCK_N)
            # The page id picked for the V-zero prefetch is the next tile's page: one pick per tile, not two (18
            # fewer instructions per tile, 4 fewer registers; Triton's pipeliner keeps all copies asynchronous).
            page_n = pg0
            for jj in range(0, n_in):
                t0 = start + (jb + jj) * BLOCK_N
                page = page_n
                r0 = tl.multiple_of(t0 % P, BLOCK_N)
                jn = tl.minimum(jj + 1, n_in - 1)  # the last tile of the block reloads its own (harmless)
                pgn = _pick_page(pg, offs_pv, jn)
                if VPAIR:
                    vz_cur = offs_n  # unused: the zeros come with the scales
                else:
                    vz_cur = vz_next
                    vz_next = _tile_zeros(vz_ptr, pgn, h, start + (jb + jn) * BLOCK_N, offs_n, stride_vsp,
                                          stride_vsh, stride_vsr, P, BLOCK_N)
                page_n = pgn
                if FULL_TILES and SUBN and BLOCK_N == 64:
                    m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tile_pieces(
                        kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, page, r0, h, vz_cur, page, vz_cur,
                        stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
                        stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr,
                        offs_n, offs_u, u_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, qsum_s, ksc_s,
                        m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, GP, NQ, U, U_PAD, ASM, INTERP,
                        SPARE_ZERO=SPARE_ZERO, VPAIR=VPAIR, TILE_ACC=TILE_ACC, KI8=KI8)
                else:
                    kw, vw, ks, kz, vs = _page_tile_loads(
                        kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, page, r0, h, stride_kcp, stride_kch, stride_kcr,
                        stride_ksp, stride_ksh, stride_ksr, stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh,
                        stride_vsr, k_off, v_off, offs_n, u_ok, U, U_PAD)
                    vz = vz_cur.to(tl.float32)
                    t_ok = t0 + offs_n < end
                    if not FULL_TILES:
                        vs = tl.where(t_ok, vs, 0.0)
                        vz = tl.where(t_ok, vz, 0.0)
                    m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tile_t(
                        kw, vw, ks, kz, vs, vz, t_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, qoff, qsum, qsum_s, ksc,
                        ksc_s, m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, GP, NQ, U_PAD, BLOCK_N,
                        INTERP, ASM, VFOLD, TILE_ACC, SUBN, not FULL_TILES, SPARE_ZERO)
    elif PAIR:
        # BLOCK_N = 2 P, whole tiles only: tile j is pages 2j and 2j + 1 of the chunk, computed as eight 16-token
        # pieces with one softmax step (`_tile_pieces` TWO). Page ids and V zeros as in the PAGE_VEC loop, two each.
        offs_pv = tl.arange(0, NPV)
        offs_r = tl.arange(0, P)
        n_tiles = tl.cdiv(end - start, BLOCK_N)
        for jb in range(0, n_tiles, NPV):
            ti = jb + offs_pv
            first = (start + ti * BLOCK_N) // P
            pa = tl.load(bt_row + first, mask=ti < n_tiles, other=0)
            pz = tl.load(bt_row + first + 1, mask=ti < n_tiles, other=0)
            n_in = tl.minimum(NPV, n_tiles - jb)
            na = _pick_page(pa, offs_pv, 0)
            nz = _pick_page(pz, offs_pv, 0)
            vza_next = tl.load(vz_ptr + na * stride_vsp + h * stride_vsh + offs_r * stride_vsr)
            vzb_next = tl.load(vz_ptr + nz * stride_vsp + h * stride_vsh + offs_r * stride_vsr)
            page_a = na
            page_b = nz
            for jj in range(0, n_in):
                cur_a = page_a
                cur_b = page_b
                vza = vza_next
                vzb = vzb_next
                jn = tl.minimum(jj + 1, n_in - 1)
                page_a = _pick_page(pa, offs_pv, jn)
                page_b = _pick_page(pz, offs_pv, jn)
                vza_next = tl.load(vz_ptr + page_a * stride_vsp + h * stride_vsh + offs_r * stride_vsr)
                vzb_next = tl.load(vz_ptr + page_b * stride_vsp + h * stride_vsh + offs_r * stride_vsr)
                m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tile_pieces(
                    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, cur_a, 0, h, vza, cur_b, vzb,
                    stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
                    stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr,
                    offs_r, offs_u, u_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, qsum_s, ksc_s,
                    m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, GP, NQ, U, U_PAD, ASM, INTERP,
                    True, SPARE_ZERO, TILE_ACC=TILE_ACC)
    else:
        for t0 in range(start, end, BLOCK_N):
            t = t0 + offs_n
            t_ok = t < end
            if P % BLOCK_N == 0:
                page = tl.load(bt_row + t0 // P).to(tl.int64)
            else:
                page = tl.load(bt_row + t // P, mask=t_ok, other=0).to(tl.int64)
            r = (t % P).to(tl.int64)
            kc_row = page * stride_kcp + h * stride_kch + r * stride_kcr  # [BLOCK_N]
            vc_row = page * stride_vcp + h * stride_vch + r * stride_vcr
            ks_row = page * stride_ksp + h * stride_ksh + r * stride_ksr
            vs_row = page * stride_vsp + h * stride_vsh + r * stride_vsr
            # Code rows past `end` are read unmasked when the tile lies in one page (in bounds, the page is
            # allocated): any code is a finite operand, and those tokens get s = -inf, p = 0 (their scale/zero
            # loads stay masked).
            if P % BLOCK_N == 0 and U == U_PAD:
                kw = tl.load(kc_ptr + kc_row[:, None] + offs_u[None, :])
                vw = tl.load(vc_ptr + vc_row[None, :] + offs_u[:, None])
            else:
                kw = tl.load(kc_ptr + kc_row[:, None] + offs_u[None, :], mask=t_ok[:, None] & u_ok[None, :],
                             other=0)
                vw = tl.load(vc_ptr + vc_row[None, :] + offs_u[:, None], mask=u_ok[:, None] & t_ok[None, :],
                             other=0)
            ks = tl.load(ks_ptr + ks_row, mask=t_ok, other=0.0).to(tl.float32)
            kz = tl.load(kz_ptr + ks_row, mask=t_ok, other=0.0).to(tl.float32)
            vs = tl.load(vs_ptr + vs_row, mask=t_ok, other=0.0).to(tl.float32)
            vz = tl.load(vz_ptr + vs_row, mask=t_ok, other=0.0).to(tl.float32)
            m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tile_t(
                kw, vw, ks, kz, vs, vz, t_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, qoff, qsum, qsum_s, ksc, ksc_s,
                m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                GP, NQ, U_PAD, BLOCK_N, INTERP, ASM, VFOLD, TILE_ACC, SUBN, True, SPARE_ZERO)

    inv, lse = _softmax_finish(m_i, l_i)
    inv2 = tl.reshape(tl.join(inv, inv), [NQ])
    z2 = tl.reshape(tl.join(acc_z, acc_z), [NQ])
    o_cols = (o_ptr + b.to(tl.int64) * stride_ob + (h * GROUP + c_head)[None, :] * stride_oh
              + (split_offset + sp) * stride_os)
    omask = u_ok[:, None] & (c_ok & (c_half == 0))[None, :]
    US: tl.constexpr = 16777216.0 if SUBN else 1.0  # SUBN: the V operands carried a factor 2^-24
    _store_pos(o_cols, acc0, z2, inv2, offs_u, omask, 0, Q, US * 1.0)
    _store_pos(o_cols, acc1, z2, inv2, offs_u, omask, 1, Q, US * 0.25)
    _store_pos(o_cols, acc2, z2, inv2, offs_u, omask, 2, Q, US * 0.0625)
    _store_pos(o_cols, acc3, z2, inv2, offs_u, omask, 3, Q, US * 0.015625)
    _store_pos(o_cols, acc4, z2, inv2, offs_u, omask, 4, Q, US * 0.00390625)
    _store_pos(o_cols, acc5, z2, inv2, offs_u, omask, 5, Q, US * 0.0625)
    _store_pos(o_cols, acc6, z2, inv2, offs_u, omask, 6, Q, US * 0.015625)
    _store_pos(o_cols, acc7, z2, inv2, offs_u, omask, 7, Q, US * 0.00390625)
    offs_g = tl.arange(0, GP)
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + (h * GROUP + offs_g) * stride_lh + split_offset + sp,
             lse, mask=offs_g < GROUP)


# Fold the bf16 +128 code offset of the K side into the zero term (False: subtract it exactly, ~3-7 % more
# instructions in the loop; the fold's extra logit error is about 1e-4, far below the bf16 rounding of q).
FOLD_K_OFFSET = True
_ASM_BROKEN: list[str] = []  # first error of the inline-PTX variant on this process (then impl 3 is used)


def pool_strides(q, kc, k_scale, vc, v_scale, block_table) -> tuple:
    """Strides of q, the code pools (in units of the view passed: uint8 or int16), the scale pools (zeros share them)
    and the block table, in the order of the INT2 kernels' arguments."""
    return (q.stride(0), q.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2),
            k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
            vc.stride(0), vc.stride(1), vc.stride(2),
            v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
            block_table.stride(0))


def partial_strides(o_part, lse_part) -> tuple:
    """Strides of the split buffers `o_part [B, H_q, S, d]`, `lse_part [B, H_q, S]` (the last dims contiguous)."""
    return (o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1))


def _kernel_args(q, kc, k_scale, k_zero, vc, v_scale, v_zero, block_table, hist_len, o_part, lse_part,
                 sm_scale: float, split_offset: int) -> tuple:
    """Runtime arguments shared by both INT2 kernels: tensors, log2-scaled softmax scale, split offset, strides."""
    return (q, kc, k_scale, k_zero, vc, v_scale, v_zero, block_table, hist_len, o_part, lse_part,
            sm_scale * 1.4426950408889634, split_offset,
            *pool_strides(q, kc, k_scale, vc, v_scale, block_table), *partial_strides(o_part, lse_part))


def launch_int2_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                       o_part, lse_part, sm_scale: float, num_splits: int, split_offset: int = 0,
                       block_n: int = 64, num_warps: int = 4, num_stages: int = 2, impl: int = 0,
                       prefetch: bool = False, whole_pages: bool = False):
    """Write the INT2 partials into `o_part [B, H_q, S, d]` fp32 and `lse_part [B, H_q, S]` fp32, splits
    `[split_offset, split_offset + num_splits)`. Shapes as in `paged_ref.int2_decode_attention_ref`; the
    functional API validates them. Last dims of codes/scale/zero and q must be contiguous. Returns Triton's
    compiled-kernel handle (registers, spills and shared memory are in it, for the benchmark).

    whole_pages: the caller promises that every hist_len is a multiple of the page size (PagedKVCache's invariant);
    impl 6 then runs its tile loop without masks (a partial last page would be ignored).

    impl 4 (inline PTX) falls back to impl 3 (same arithmetic in plain Triton) if it fails to compile, once
    per process (the error is kept in `_ASM_BROKEN`); `strict_impl()` turns the fallback off for tests."""
    b, h_q, d = q.shape
    h_kv = k_codes.shape[1]
    group = h_q // h_kv
    page = k_codes.shape[2]
    ng = k_scale.shape[3]
    q_quarter = d // 4
    if ng > 1:
        impl = min(impl, 1)  # the no-tensor-core and bitcast variants exist for one group per row only
    if impl == 4 and _ASM_BROKEN and not _STRICT:
        impl = 3
    if impl in (5, 6):
        if _impl5_ok(q, k_codes, v_codes, ng, page, block_n):
            return _launch_kernel_t(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                                 o_part, lse_part, sm_scale, num_splits, split_offset, block_n, num_warps,
                                 num_stages, subnormal=impl == 6, full_tiles=whole_pages)
        impl = 3  # fp32 queries, several groups per row, odd code rows: the same bitcast math in plain Triton
    # Prefetch: one group per row, tiles inside one page, and the K tile loaded once (not impl 1).
    prefetch = bool(prefetch) and ng == 1 and page % block_n == 0 and impl != 1
    grid = (b, h_kv, num_splits)
    args = _kernel_args(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len, o_part,
                        lse_part, sm_scale, split_offset)

    def go(impl_: int):
        return _int2_decode_kernel[grid](
            *args,
            GROUP=group,
            G_PAD=next_pow2(group) if impl_ == 2 else max(16, next_pow2(group)),
            Q=q_quarter, Q_PAD=max(16, next_pow2(q_quarter)),
            GS=d // ng, NG=ng, P=page, BLOCK_N=block_n, FP32=q.dtype.itemsize == 4, INTERP=INTERPRET, IMPL=impl_,
            PREFETCH=prefetch, KFOLD=impl_ >= 3 and FOLD_K_OFFSET and q.dtype == _torch_bf16(),
            num_warps=num_warps, num_stages=num_stages,
        )

    if impl != 4 or _STRICT:
        return go(impl)
    try:
        return go(4)
    except Exception as e:  # noqa: BLE001 - any compile failure of the inline PTX: same math without it
        _ASM_BROKEN.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        warnings.warn(f"INT2 decode: inline-PTX variant (impl 4) failed, using impl 3: {_ASM_BROKEN[0]}",
                      RuntimeWarning, stacklevel=2)
        return go(3)


_STRICT = False
IMPL5_VFOLD = False  # impl 5: True = subtract the V code offset in fp32 after a fresh per-tile dot (see above)
# impl 5, exact V offset: True = each tile's V dot starts from zero and is added to the chunk accumulator by an fp32
# FFMA; False = the MMA accumulates onto it (chained). Hopper tensor cores add in fp32 with truncation, so the chained
# sum of positive terms p * s * code drifts low by about (chunk tokens / 16) ulp; after `acc - acc_z` (the zero term)
# cancels most of it, that was up to 1e-2 relative error of o on near-zero-mean random V at 26K-token chunks
# (bench 131072 x 32; emulated in bench/NOTES_decode.md). Per tile the error stays at the fp16 rounding of p * s.
IMPL5_TILE_ACC = True
IMPL5_MAXNREG: int | None = None  # impl 5/6: register cap per thread passed to ptxas (None: ptxas decides)
# Opt-in, off: with whole 64-token pages, the fused kernel's grid (one launch, or the two-launch default) runs history
# tiles of two pages as eight 16-token pieces with one softmax step, plus one program per (sequence, KV head) for an
# odd trailing page, with PAIR_STAGES pipeline stages. Offline (Triton 3.6, sm_90), the two-launch kernel: 1195
# instructions per 128-token tile (597 per 64 tokens, against 650), 128 registers, 12 KiB of shared memory. Measured
# on the H200 (bench/NOTES_decode.md v10): no faster, at the first replays (128K / batch 8 0.1944 vs 0.1935 ms) or
# under the power cap (0.2018-0.2025 vs 0.2006-0.2011 ms), so it stays off.
PAIR_TILES = False
PAIR_STAGES = 2
# Opt-in, off: the V dot's spare columns (i, copy), computed and never stored, get zeros instead of a copy of
# p * scale (`_v_operand`). Same instructions, same stored results bit for bit; the idea was fewer switching bits in
# the tensor cores, because the call runs at the H200's 700 W board limit under sustained load. Measured in session 7
# (bench/NOTES_decode.md v11): no faster, sustained (0.2024 / 0.2015 vs 0.2011 / 0.1987 ms at 128K / batch 8) or at
# the first replays (0.1961 vs 0.1878 ms), so it stays off.
V_SPARE_ZERO = False
# With V scale and zero pools that are two views of one `[pages, H, P, 2]` buffer (`paired_v_pools`), the whole-page
# loop reads a row's zero with its scale in one pipelined load, instead of the hand-made synchronous prefetch of the
# zeros one tile ahead, whose first use was the largest single stall in Nsight Compute (bench/NOTES_decode.md v11).
# Measured in session 8 (v12, bench key `layout=vpair`): equal at 128K / batch 8 (0.1895 vs 0.1894 ms), 1-3 % faster
# at 128K/B32, 32K/B8 and 128K/B1; in session 9 (v13) 1-6 % faster at all nine points of the table. `PagedKVCache`
# allocates its V scale and zero this way at one group per row (session 9), so the library uses it.
V_PAIRED_POOLS = True
# Whole-page tiles: score the K codes with m16n8k32 int8 MMAs on the code bytes (4 codes per `and`, one MMA per
# channel quarter and 16 tokens: half the score MMAs) against the query split into int8 hi/lo pairs, carried in the
# score MMA's otherwise unused columns (`_score16_i8`; the query as the MMAs see it: `paged_ref.hilo_query_ref`,
# within max|q| / 64516 of q, far below q's own bf16 rounding). Needs 32 or 64 code bytes per row (head_dim 128 or
# 256); other geometries keep the fp16 score MMAs. Offline (Triton 3.6, sm_90): 610 instead of 655 instructions per
# tile, 126 registers either way. Measured on the H200 (session 10, bench/NOTES_decode.md v14): 128K / batch 8
# 0.1608 vs 0.1807 ms per graph call (5.77x vs 5.14x over cuDNN), sustained 0.172 vs 0.187 ms.
K_INT8_SCORES = True


def _impl5_ok(q, k_codes, v_codes, ng: int, page: int, block_n: int) -> bool:
    """impl 5 needs half queries, one scale/zero group per row, int16-viewable code rows (d % 8 == 0, even
    strides) and tiles that do not straddle pages unless the page id is looked up per token (any block_n works)."""
    import torch

    return (q.dtype in (torch.float16, torch.bfloat16) and ng == 1 and k_codes.shape[3] % 2 == 0
            and all(t.stride(3) == 1 and all(st % 2 == 0 for st in t.stride()[:3]) and t.storage_offset() % 2 == 0
                    for t in (k_codes, v_codes)) and block_n >= 16)


def alloc_paired_v_pools(pages: int, heads: int, page_size: int, device, zeros: bool = True):
    """V scale and zero pools `[pages, heads, page_size, 1]` fp16 as the two halves of one `[..., 2]` buffer (each row's
    scale and zero side by side), the layout `paired_v_pools` recognizes -> (v_scale, v_zero)."""
    import torch

    make = torch.zeros if zeros else torch.empty
    pair = make(pages, heads, page_size, 2, dtype=torch.float16, device=device)
    return pair[..., 0:1], pair[..., 1:2]


def paired_v_pools(v_scale, v_zero) -> bool:
    """True when each V zero is the fp16 right after its scale (one `[pages, H, P, 2]` buffer viewed as the two
    pools), so the whole-page loop can read both with one load (`_int2_chunk_t` VPAIR)."""
    return (v_scale is not None and v_zero is not None and V_PAIRED_POOLS and v_scale.dim() == 4
            and v_scale.stride(2) == 2 and v_scale.stride() == v_zero.stride()
            and v_zero.data_ptr() == v_scale.data_ptr() + v_scale.element_size())


def chunk_constexprs(q, k_codes, block_n: int, subnormal: bool, full_tiles: bool, v_scale=None,
                     v_zero=None) -> dict:
    """Compile-time arguments of `_int2_chunk_t` (shared by `_int2_decode_kernel_t` and the fused decode kernel)."""
    group = q.shape[1] // k_codes.shape[1]
    u = k_codes.shape[3] // 2  # int16 words per row
    page_vec = subnormal and k_codes.shape[2] % block_n == 0
    full = bool(full_tiles) and page_vec
    u_pad = max(16, next_pow2(u))
    pieces = full and block_n == 64
    return dict(GROUP=group, GP=max(4, next_pow2(group)), Q=q.shape[2] // 4, U=u,
                U_PAD=u_pad, P=k_codes.shape[2], BLOCK_N=block_n, INTERP=INTERPRET,
                VFOLD=IMPL5_VFOLD, TILE_ACC=IMPL5_TILE_ACC, SUBN=subnormal, PAGE_VEC=page_vec, NPV=64,
                FULL_TILES=full, SPARE_ZERO=bool(V_SPARE_ZERO),
                VPAIR=pieces and paired_v_pools(v_scale, v_zero),
                KI8=bool(K_INT8_SCORES) and pieces and u == u_pad and (2 * u) % 32 == 0 and 2 * u <= 64)


def pair_tiles_apply(k_codes, block_n: int, impl: int, whole_pages: bool) -> bool:
    """Two-page tiles (`_int2_chunk_t` PAIR) in the fused kernel's grid: PAIR_TILES on, impl 6, whole pages promised,
    and one 64-token page per block_n tile (the pieces are 16 tokens, four to a page)."""
    return PAIR_TILES and impl == 6 and bool(whole_pages) and k_codes.shape[2] == block_n == 64


def pair_constexprs(q, k_codes, block_n: int) -> dict:
    """`chunk_constexprs` of the two-page-tile history programs (BLOCK_N = 2 P, whole tiles only)."""
    return dict(chunk_constexprs(q, k_codes, 2 * block_n, True, True), PAGE_VEC=False, FULL_TILES=True)


def int16_views(k_codes, v_codes) -> tuple:
    """The code pools as `_int2_chunk_t` reads them: int16 words (8 codes each), strides in int16 units."""
    import torch

    return k_codes.view(torch.int16), v_codes.view(torch.int16)


def maxnreg_option() -> dict:
    """Launch option of the kernels that run `_int2_chunk_t`: the register cap IMPL5_MAXNREG, if set."""
    return {"maxnreg": IMPL5_MAXNREG} if IMPL5_MAXNREG and not INTERPRET else {}


def _launch_kernel_t(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len, o_part, lse_part,
                  sm_scale: float, num_splits: int, split_offset: int, block_n: int, num_warps: int,
                  num_stages: int, subnormal: bool = False, warmup: bool = False, full_tiles: bool = False):
    """Launch `_int2_decode_kernel_t` (impl 5, or impl 6 with `subnormal`) on int16 views of the code pools
    (`warmup`: compile only, return the compiled kernel without running it)."""
    kc, vc = int16_views(k_codes, v_codes)
    grid = (q.shape[0], k_codes.shape[1], num_splits)
    args = _kernel_args(q, kc, k_scale, k_zero, vc, v_scale, v_zero, block_table, hist_len, o_part, lse_part,
                        sm_scale, split_offset)
    kw = dict(**chunk_constexprs(q, k_codes, block_n, subnormal, full_tiles, v_scale, v_zero), num_warps=num_warps,
              num_stages=num_stages, **maxnreg_option())
    if warmup:
        return _int2_decode_kernel_t.warmup(*args, grid=grid, **kw)
    return _int2_decode_kernel_t[grid](*args, **kw)


_SLOTS: dict[tuple, int] = {}  # compiled-kernel key -> programs resident per SM (see `resident_programs_per_sm`)


def programs_per_sm_limit(n_regs: int, shared_bytes: int, num_warps: int, regs_per_sm: int = 65536,
                          smem_per_sm: int = 233472, threads_per_sm: int = 2048, max_blocks: int = 32) -> int:
    """Programs of a compiled kernel that one SM holds at once: the tightest of registers, shared memory (1 KiB
    reserved per block), threads and the block limit. Defaults: Hopper. Registers follow CUDA's occupancy rules:
    allocated per warp in units of 256, and a warp's registers come from one of the SM's 4 sub-partitions, so
    warps per SM = 4 * floor(regs_per_sm / 4 / regs_per_warp) (136 registers: 12 warps, not 15)."""
    regs_per_warp = -(-max(1, n_regs) * 32 // 256) * 256
    by_regs = 4 * (regs_per_sm // 4 // regs_per_warp) // num_warps
    by_smem = smem_per_sm // (shared_bytes + 1024)
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(max_blocks, by_regs, by_smem, by_threads))


def _slots_of(kernel, num_warps: int, device) -> int:
    import torch

    props = torch.cuda.get_device_properties(device)
    if getattr(kernel, "n_regs", None) is None:  # a kernel compiled by `warmup` loads (and counts) lazily
        kernel._init_handles()
    return programs_per_sm_limit(int(kernel.n_regs), int(kernel.metadata.shared), num_warps,
                                 int(getattr(props, "regs_per_multiprocessor", 65536)),
                                 int(getattr(props, "shared_memory_per_multiprocessor", 233472)),
                                 int(getattr(props, "max_threads_per_multi_processor", 2048)))


def resident_programs_per_sm(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                             block_n: int, num_warps: int, num_stages: int, impl: int,
                             whole_pages: bool = False) -> int | None:
    """How many programs of the INT2 kernel that this call would launch fit on one SM at once, from its compiled
    registers and shared memory (compiled once per configuration, then cached; no launch, no sync). None where it
    does not apply: the interpreter, or a variant other than impl 5/6 (those keep the fixed programs-per-SM rule)."""
    if INTERPRET or q.device.type != "cuda" or impl not in (5, 6):
        return None
    ng = k_scale.shape[3]
    if not _impl5_ok(q, k_codes, v_codes, ng, k_codes.shape[2], block_n):
        return None

    def compile_only():
        import torch

        o_part = torch.empty(q.shape[0], q.shape[1], 3, q.shape[2], dtype=torch.float32, device=q.device)
        lse_part = torch.empty(q.shape[0], q.shape[1], 3, dtype=torch.float32, device=q.device)
        return _launch_kernel_t(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                                o_part, lse_part, 1.0, 3, 0, block_n, num_warps, num_stages, subnormal=impl == 6,
                                warmup=True, full_tiles=whole_pages)

    return cached_slots(("int2",) + chunk_key(q, k_codes, k_scale, v_codes, v_scale, block_table, hist_len, block_n,
                                              num_warps, num_stages, impl, whole_pages, v_zero),
                        compile_only, num_warps, q.device)


def chunk_key(q, k_codes, k_scale, v_codes, v_scale, block_table, hist_len, block_n: int, num_warps: int,
              num_stages: int, impl: int, whole_pages: bool, v_zero=None) -> tuple:
    """Everything that selects a different compiled `_int2_chunk_t`: its constexprs (`chunk_constexprs`, so a new
    switch there needs no edit here) and pool strides, launch options, dtypes, and Triton's specialisation of the
    block-table stride (the split buffers' strides barely move registers). The code pools' strides are taken in
    bytes: they determine the int16 ones the kernels see."""
    constexprs = chunk_constexprs(q, k_codes, block_n, impl == 6, whole_pages, v_scale, v_zero)
    return (q.device.index, impl, q.dtype, num_warps, num_stages, IMPL5_MAXNREG, block_table.dtype, hist_len.dtype,
            block_table.stride(0) % 16 == 0, pool_strides(q, k_codes, k_scale, v_codes, v_scale, block_table)[2:14],
            tuple(constexprs.values()))


def cached_slots(key: tuple, compile_only, num_warps: int, device) -> int:
    """Programs per SM of the kernel that `compile_only()` compiles (without launching), once per `key`."""
    if key not in _SLOTS:
        _SLOTS[key] = _slots_of(compile_only(), num_warps, device)
    return _SLOTS[key]


def strict_impl(on: bool = True) -> None:
    """Tests and benchmarks: never replace impl 4 by impl 3 (a failure raises instead)."""
    global _STRICT
    _STRICT = bool(on)


def _torch_bf16():
    """torch.bfloat16, imported lazily (the kernels themselves need only triton)."""
    import torch

    return torch.bfloat16
