"""The production INT2 decode kernel: split-K attention over the paged INT2 history, tokens on the MMA rows.

Program `(b, h, split)` takes a tile-aligned chunk of sequence b's history and KV head h, scores every tile against
the GROUP query heads of h and writes the chunk's normalised partial output and log-sum-exp to split
`split_offset + split` of the partial buffers (`merge.py` reduces them). The bit tricks are explained in README.md.

Both dots are transposed so the tokens sit on the MMA's M dimension (no padding rows at GQA 4):
    S^T [tokens, NQ] = sum_p X_p [tokens, U] @ QB_p [U, NQ]      O^T_p [U, NQ] += Y_p [U, tokens] @ PB [tokens, NQ]
with NQ = 2 GP columns (GP = query heads padded to >= 4; the V dots' copy columns are dropped before the chunk
accumulators, which hold `[U, GP]`). The code pools are read as int16 words (8 codes each, U
words per row); code position p of a word, masked in place, is an exact fp16 subnormal `M_p * code * 2^-24`
(M_p = 4^(bit position / 2)); M_p is folded into the query operand and the output, 2^24 into the fp32 scales.

Loops: page ids are read a vector at a time into registers so every load address depends on the loop index alone
(Triton's pipeliner then keeps codes and scales in flight). With whole pages promised (`whole_pages`, the cache's
invariant) a 64-token tile is four 16-token pieces with no masks, scored by int8 MMAs at head_dim 128/256 (query as
int8 hi/lo pairs) and fp16 MMAs otherwise; without the promise the tile is one masked 64-token step.
Needs: fp16/bf16 queries, one scale/zero group per row, int16-viewable code rows, page size a multiple of the tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime_kernels.attention.int2_decode.common import (
    _chunk_bounds,
    _prefetch_l2,
    _quad_at,
    _scale_f32,
    _scales_at,
    _softmax_finish,
    _u8_word,
    _u8_words,
    _ue5m3_in_word,
    _zero_f32,
    _zero_in_word,
    _zeros_at,
    quad_zero_scale,
)

# One `and` per output: code position p of both int16 halves of $8, left in place, is an fp16 subnormal.
_ASM_SUBN = tl.constexpr(
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
_ASM_SUBN_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r")


@triton.jit
def _pos_codes_subn(w, SH: tl.constexpr, MASK: tl.constexpr):
    """Plain-Triton code position as an fp16 subnormal (interpreter): bits `(w >> SH) & MASK` = M_p * code * 2^-24."""
    return ((w.to(tl.int32) >> SH) & MASK).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _codes8_subn(w, ASM: tl.constexpr):
    """int16 code tile `w [R, C]` -> 8 fp16 tiles `[R, C]`, tile p = M_p * (code p of each element) * 2^-24.
    Element-wise, so the register layout Triton picks does not matter."""
    if ASM:
        x0, x1, x2, x3, x4, x5, x6, x7 = tl.inline_asm_elementwise(
            _ASM_SUBN, _ASM_SUBN_CONSTRAINTS, [w], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
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
def _dot_acc(a, b, acc, INTERP: tl.constexpr):
    """`acc + a @ b` (fp16 operands, fp32 accumulator; widened to fp32 under the interpreter)."""
    if INTERP:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32))
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
def _store_pos(o_cols, acc, z, inv, offs_u, omask, POS: tl.constexpr, Q: tl.constexpr, INV_M: tl.constexpr):
    """Store code position POS of the output: channels 2u + POS // 4 + (POS % 4) * Q, `(acc / M - z) / l` (acc
    `[U_PAD, GP]`, z and inv = 1 / l `[GP]`)."""
    ch = 2 * offs_u + POS // 4 + (POS % 4) * Q
    tl.store(o_cols + ch[:, None], (acc * INV_M - z[None, :]) * inv[None, :], mask=omask)


@triton.jit
def _store_pos_centered(o_cols, acc, z, inv, offs_u, omask, vm_h, vm_ok, POS: tl.constexpr, Q: tl.constexpr,
                        INV_M: tl.constexpr):
    """`_store_pos` of a centered cache: the history's V mean `vm_h [d]` (this KV head) added to the normalised
    output of every head with tokens (vm_ok `[GP]`; an empty chunk stays 0)."""
    ch = 2 * offs_u + POS // 4 + (POS % 4) * Q
    mv = tl.load(vm_h + ch, mask=ch < 4 * Q, other=0.0)
    tl.store(o_cols + ch[:, None], (acc * INV_M - z[None, :]) * inv[None, :]
             + tl.where(vm_ok[None, :], mv[:, None], 0.0), mask=omask)


@triton.jit
def _position_scores(x0, x1, x2, x3, x4, x5, x6, x7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, ROWS: tl.constexpr,
                     GP: tl.constexpr, NQ: tl.constexpr, INTERP: tl.constexpr):
    """Raw scores `[ROWS, GP]` of ROWS tokens: the 8 code positions' operands `[ROWS, U_PAD]` against their query
    operands `[U_PAD, NQ]`, one MMA chain, then the two channel halves of each head summed."""
    st = tl.zeros([ROWS, NQ], tl.float32)
    st = _dot_acc(x0, qb0, st, INTERP)
    st = _dot_acc(x1, qb1, st, INTERP)
    st = _dot_acc(x2, qb2, st, INTERP)
    st = _dot_acc(x3, qb3, st, INTERP)
    st = _dot_acc(x4, qb4, st, INTERP)
    st = _dot_acc(x5, qb5, st, INTERP)
    st = _dot_acc(x6, qb6, st, INTERP)
    st = _dot_acc(x7, qb7, st, INTERP)
    return tl.sum(tl.reshape(st, [ROWS, GP, 2]), axis=2)


@triton.jit
def _v_operand(pv, ROWS: tl.constexpr, NQ: tl.constexpr):
    """The V dot's operand `[ROWS, NQ]` from p * scale `[ROWS, NQ / 2]`: column (i, 0) = head i, column (i, 1) a
    copy (it puts head i on the same lanes in both dots; its results are never stored)."""
    return tl.reshape(tl.join(pv, pv), [ROWS, NQ])


@triton.jit
def _heads(t, ROWS: tl.constexpr, GP: tl.constexpr):
    """The query heads' own columns `[ROWS, GP]` of a V dot's `[ROWS, 2 GP]` result (column (i, 0) of head i; the
    copy column (i, 1) is dropped: `_v_operand`). An MMA lane holds both columns of a head, so this moves no data;
    the chunk accumulators then carry 4 registers per code position instead of 8."""
    real, _ = tl.split(tl.reshape(t, [ROWS, GP, 2]))
    return real


@triton.jit
def _tile_masked(kw, vw, ks, kz, vs, vz, t_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, nqsum_s, ksc_s,
                 m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                 GP: tl.constexpr, NQ: tl.constexpr, U_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 INTERP: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr):
    """One tile as a single step: int16 code tiles kw `[BLOCK_N, U_PAD]`, vw `[U_PAD, BLOCK_N]`, fp32 scale/zero
    `[BLOCK_N]` (vs, vz zero where not t_ok) -> the updated online-softmax state. MASKED: scores of tokens outside
    t_ok become -inf (False: every token is valid)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _codes8_subn(kw, ASM)
    sc = _position_scores(x0, x1, x2, x3, x4, x5, x6, x7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, BLOCK_N, GP, NQ,
                          INTERP)  # [BLOCK_N, GP]
    s = (sc + kz[:, None] * nqsum_s[None, :]) * (ks * ksc_s)[:, None]
    if MASKED:
        s = tl.where(t_ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: the tile holds at least one valid token
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    pv = (p * vs[:, None]).to(tl.float16)  # p * scale <= 65504: the scale is stored in fp16
    pvf = pv.to(tl.float32)
    acc_z = acc_z * alpha + tl.sum(pvf * vz[:, None], axis=0)
    pb = _v_operand(pv, BLOCK_N, NQ)
    y0, y1, y2, y3, y4, y5, y6, y7 = _codes8_subn(vw, ASM)
    # Fresh per-tile dot added by an fp32 FFMA (round to nearest): tensor cores truncate, so chaining the MMA onto
    # the chunk accumulator drifts low over a long chunk. tl.fma, not `+`: Triton would fuse `acc + dot(a, b, 0)`
    # back into the MMA's accumulator.
    zero = tl.zeros([U_PAD, NQ], tl.float32)
    acc0 = tl.fma(acc0, alpha[None, :], _heads(_dot_acc(y0, pb, zero, INTERP), U_PAD, GP))
    acc1 = tl.fma(acc1, alpha[None, :], _heads(_dot_acc(y1, pb, zero, INTERP), U_PAD, GP))
    acc2 = tl.fma(acc2, alpha[None, :], _heads(_dot_acc(y2, pb, zero, INTERP), U_PAD, GP))
    acc3 = tl.fma(acc3, alpha[None, :], _heads(_dot_acc(y3, pb, zero, INTERP), U_PAD, GP))
    acc4 = tl.fma(acc4, alpha[None, :], _heads(_dot_acc(y4, pb, zero, INTERP), U_PAD, GP))
    acc5 = tl.fma(acc5, alpha[None, :], _heads(_dot_acc(y5, pb, zero, INTERP), U_PAD, GP))
    acc6 = tl.fma(acc6, alpha[None, :], _heads(_dot_acc(y6, pb, zero, INTERP), U_PAD, GP))
    acc7 = tl.fma(acc7, alpha[None, :], _heads(_dot_acc(y7, pb, zero, INTERP), U_PAD, GP))
    return m_new, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


# Whole-page tiles in four 16-token pieces: every dot has K = 16 tokens at most, so Triton loads each V-side B operand
# with one `ldmatrix.x2.trans` into a consecutive register pair (one [64, NQ] operand made ptxas copy registers before
# almost every MMA); fewer instructions and registers per tile (docs/kernels.md).
@triton.jit
def _split4(x):
    """`[64]` -> its four consecutive `[16]` pieces, split in registers (the loads stay whole-vector cp.async)."""
    y = tl.reshape(tl.permute(tl.reshape(x, [4, 16]), (1, 0)), [16, 2, 2])
    a, b = tl.split(y)
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _score16(kw, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, kz, ks, nqsum_s, GP: tl.constexpr, NQ: tl.constexpr,
             ASM: tl.constexpr, INTERP: tl.constexpr):
    """Row-scaled logits `[16, GP]` of a 16-token piece (its column scale is applied by `_tile_pieces`): codes kw
    `[16, U_PAD]` int16, zero/scale kz, ks `[16]` fp32."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _codes8_subn(kw, ASM)
    sc = _position_scores(x0, x1, x2, x3, x4, x5, x6, x7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, 16, GP, NQ, INTERP)
    return (sc + kz[:, None] * nqsum_s[None, :]) * ks[:, None]


# The four channel quarters of four code bytes with one shift: quarters 0 and 2 masked in place (codes times 1 and
# 16), quarters 1 and 3 masked in place after one shift right by 2 (times 1 and 16); all at most 48, valid int8.
_ASM_QUARTERS = tl.constexpr(
    "{ .reg .b32 t; "
    "and.b32 $0, $4, 0x03030303; "
    "and.b32 $2, $4, 0x30303030; "
    "shr.b32 t, $4, 2; "
    "and.b32 $1, t, 0x03030303; "
    "and.b32 $3, t, 0x30303030; }")


@triton.jit
def _quarters_i8(kb, ASM: tl.constexpr):
    """Code bytes kb (int8) -> the int8 operands of channel quarters 0..3: `(code, code, 16 code, 16 code)` of
    positions 0, 1, 2, 3 (`(byte >> 2k) & 3` is quarter k). Quarters 2 and 3 stay 16x their codes, so the four come
    out of one shift and four `and`s per four bytes (the shift per quarter cost three) and the caller sums the two
    pairs' MMAs as `16 (Q0 + Q1) + (Q2 + Q3)`, an exact 16x. Inline PTX on 32-bit registers (Triton alone spends
    byte permutes on it)."""
    if ASM:
        return tl.inline_asm_elementwise(_ASM_QUARTERS, "=r,=r,=r,=r,r", [kb], dtype=(tl.int8,) * 4,
                                         is_pure=True, pack=4)
    else:
        t = kb >> 2
        return kb & 3, t & 3, kb & 0x30, t & 0x30


@triton.jit
def _qi8_quarter(qj, c_half, sq):
    """The int8 query operand of a channel quarter from its fp32 query tile qj `[Q, NQ]` (row j = channel j + k Q,
    both columns of head i holding head i's query): column (i, 0) = hi = round(q / sq), column (i, 1) =
    lo = round(254 (q / sq - hi)), both in [-127, 127], so q = sq (hi + lo / 254) to within sq / 508 (sq `[NQ]`:
    the head's max |q| / 127). Reference: `naive.hilo_query_ref`."""
    qs = qj / sq[None, :]
    hi = tl.floor(qs + 0.5)
    lo = tl.floor((qs - hi) * 254.0 + 0.5)
    return tl.where((c_half == 0)[None, :], hi, lo).to(tl.int8)


@triton.jit
def _score16_i8(kb, qi0, qi1, qi2, qi3, kz, ks, nqz8, GP: tl.constexpr, NQ: tl.constexpr, ASM: tl.constexpr):
    """Row-scaled logits `[16, GP]` of a 16-token piece from its code bytes kb `[16, Q]` int8: one m16n8k32 integer MMA
    per channel quarter, exact int32 sums of 16x the scores (`_quarters_i8`); the hi and lo columns of each head
    recombine as 254 hi + lo, a multiple of 16 below 2^28, so its fp32 value is 16x the unscaled sum's, rounding
    included. nqz8 `[GP]`: -16x the same combination of the query operands' sums (the zero term). The column scale
    (the log2 softmax scale times sq / (254 * 16)) is applied by the caller inside the softmax's exponent."""
    c0, c1, c2, c3 = _quarters_i8(kb, ASM)
    z = tl.zeros([16, NQ], tl.int32)
    a1 = tl.dot(c1, qi1, tl.dot(c0, qi0, z, out_dtype=tl.int32), out_dtype=tl.int32)
    a16 = tl.dot(c3, qi3, tl.dot(c2, qi2, z, out_dtype=tl.int32), out_dtype=tl.int32)
    hi, lo = tl.split(tl.reshape(a1 * 16 + a16, [16, GP, 2]))
    sc = (hi * 254 + lo).to(tl.float32)
    return (sc + kz[:, None] * nqz8[None, :]) * ks[:, None]


@triton.jit
def _pv16(p, vs, NQ: tl.constexpr):
    """p * V scale in fp16 (`[16, GP]`, for the zero term) and as the V dot's operand `[16, NQ]` (`_v_operand`)."""
    pv = (p * vs[:, None]).to(tl.float16)
    return pv, _v_operand(pv, 16, NQ)


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
                 stride_ksr, offs_n, offs_u, u_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, nqsum_s,
                 ks64, kz64, GP: tl.constexpr, NQ: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr,
                 ASM: tl.constexpr, INTERP: tl.constexpr, KI8: tl.constexpr, SZ: tl.constexpr):
    """Row-scaled logits of the 64 tokens at row r0 of page `page`, KV head h, as four `[16, GP]` pieces (their
    column scale is applied by `_tile_pieces`). KI8: the code rows are read as bytes and scored by integer MMAs
    (`_score16_i8`); qb0-qb3 are then the int8 quarter operands, nqsum_s the `[GP]` zero-term sums (qb4-qb7
    unused). SZ "quad": the rows' K scales and zeros come decoded, ks64 / kz64 fp32 `[64]` (`_quad_at`);
    otherwise they are read here."""
    o16 = tl.arange(0, 16)
    srow = page * stride_ksp + h * stride_ksh + (r0 + offs_n) * stride_ksr
    # Scale vectors as whole [64] loads, decoded (fp16 or ue5m3) and split in registers. fp16 pools: 4 B per lane,
    # cp.async; uint8 pools: their 32-bit words (`_u8_word`: no 8-bit vector to move).
    if SZ != "quad":
        ks64 = _scales_at(ks_ptr, srow, ASM)
        kz64 = _zeros_at(kz_ptr, srow, ASM)
    ks0, ks1, ks2, ks3 = _split4(ks64)
    kz0, kz1, kz2, kz3 = _split4(kz64)
    if KI8:
        # The int16 pool viewed as bytes (offsets doubled): row r of a page is 2 U bytes, byte j holding channels
        # j + k Q of quarters k = 0..3.
        kb8 = kc_ptr.to(tl.pointer_type(tl.int8), bitcast=True) + 2 * (page * stride_kcp + h * stride_kch
                                                                        + r0 * stride_kcr)
        b_offs = o16[:, None] * (2 * stride_kcr) + tl.arange(0, 2 * U)[None, :]  # [16, Q]
        s0 = _score16_i8(tl.load(kb8 + b_offs), qb0, qb1, qb2, qb3, kz0, ks0, nqsum_s, GP, NQ, ASM)
        s1 = _score16_i8(tl.load(kb8 + 16 * (2 * stride_kcr) + b_offs), qb0, qb1, qb2, qb3, kz1, ks1, nqsum_s,
                         GP, NQ, ASM)
        s2 = _score16_i8(tl.load(kb8 + 32 * (2 * stride_kcr) + b_offs), qb0, qb1, qb2, qb3, kz2, ks2, nqsum_s,
                         GP, NQ, ASM)
        s3 = _score16_i8(tl.load(kb8 + 48 * (2 * stride_kcr) + b_offs), qb0, qb1, qb2, qb3, kz3, ks3, nqsum_s,
                         GP, NQ, ASM)
    else:
        kb = kc_ptr + page * stride_kcp + h * stride_kch + r0 * stride_kcr
        k_offs = o16[:, None] * stride_kcr + offs_u[None, :]  # [16, U_PAD]
        s0 = _score16(_load_piece(kb, k_offs, u_ok, U, U_PAD, False), qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7,
                      kz0, ks0, nqsum_s, GP, NQ, ASM, INTERP)
        s1 = _score16(_load_piece(kb + 16 * stride_kcr, k_offs, u_ok, U, U_PAD, False), qb0, qb1, qb2, qb3, qb4, qb5,
                      qb6, qb7, kz1, ks1, nqsum_s, GP, NQ, ASM, INTERP)
        s2 = _score16(_load_piece(kb + 32 * stride_kcr, k_offs, u_ok, U, U_PAD, False), qb0, qb1, qb2, qb3, qb4, qb5,
                      qb6, qb7, kz2, ks2, nqsum_s, GP, NQ, ASM, INTERP)
        s3 = _score16(_load_piece(kb + 48 * stride_kcr, k_offs, u_ok, U, U_PAD, False), qb0, qb1, qb2, qb3, qb4, qb5,
                      qb6, qb7, kz3, ks3, nqsum_s, GP, NQ, ASM, INTERP)
    return s0, s1, s2, s3


@triton.jit
def _page_values(vc_ptr, vs_ptr, page, r0, h, vs64, vz64, s0, s1, s2, s3, cs, m_new, t0, t1, t2, t3, t4, t5, t6, t7,
                 stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, offs_n, offs_u, u_ok,
                 NQ: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr, ASM: tl.constexpr, INTERP: tl.constexpr,
                 SZ: tl.constexpr):
    """The probabilities `exp2(s * cs - m_new)` of four row-scaled logit pieces (`_page_scores`; cs `[GP]` their
    column scale) against the running max m_new: their V dots chained onto the 8 position dots t0..t7, and this
    tile's per-lane sums `[16, GP]` of p and of p * scale * zero (the caller keeps them per lane across tiles).
    SZ "quad": vs64 / vz64 are the rows' V scales and zeros, decoded fp32 `[64]`; otherwise vz64 holds the rows'
    stored V zeros (prefetched; unused when "paired_v") and vs64 is unused."""
    o16 = tl.arange(0, 16)
    vb = vc_ptr + page * stride_vcp + h * stride_vch + r0 * stride_vcr
    v_offs = o16[None, :] * stride_vcr + offs_u[:, None]  # [U_PAD, 16]
    if SZ == "quad":
        pass  # decoded by the caller with the K scales and zeros (one load per row)
    elif SZ == "paired_v" and vs_ptr.dtype.element_ty == tl.uint8:
        # Paired uint8 pools: a row's scale and zero are adjacent bytes at an even offset, so one 32-bit word holds
        # both (bytes k and k + 1, `_u8_word`).
        w, k = _u8_word(vs_ptr, page * stride_vsp + h * stride_vsh + (r0 + offs_n) * stride_vsr)
        vs64 = _ue5m3_in_word(w, k, ASM)
        vz64 = _zero_in_word(w, k + 1, ASM)
    elif SZ == "paired_v":
        # Paired pools: one `[64, 2]` load, which the pipeliner makes asynchronous because the scales feed the V
        # dots, brings the zeros along.
        sz = tl.load(vs_ptr + page * stride_vsp + h * stride_vsh + (r0 + offs_n)[:, None] * stride_vsr
                     + tl.arange(0, 2)[None, :])
        vs_raw, vz_raw = tl.split(sz)
        vs64 = _scale_f32(vs_raw)
        vz64 = _zero_f32(vz_raw)
    else:
        vs64 = _scales_at(vs_ptr, page * stride_vsp + h * stride_vsh + (r0 + offs_n) * stride_vsr, ASM)
        vz64 = _zero_f32(vz64)
    vs0, vs1, vs2, vs3 = _split4(vs64)
    vz0, vz1, vz2, vz3 = _split4(vz64)
    c1 = cs[None, :]
    nm = -m_new[None, :]
    p0 = tl.exp2(tl.fma(s0, c1, nm))
    p1 = tl.exp2(tl.fma(s1, c1, nm))
    p2 = tl.exp2(tl.fma(s2, c1, nm))
    p3 = tl.exp2(tl.fma(s3, c1, nm))
    pv0, pb0 = _pv16(p0, vs0, NQ)
    pv1, pb1 = _pv16(p1, vs1, NQ)
    pv2, pb2 = _pv16(p2, vs2, NQ)
    pv3, pb3 = _pv16(p3, vs3, NQ)
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
def _tile_pieces(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, page, r0, h, vz_cur,
                 stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
                 stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr,
                 offs_n, offs_u, u_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, nqsum_s, ksc_s,
                 m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                 GP: tl.constexpr, NQ: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr,
                 ASM: tl.constexpr, INTERP: tl.constexpr, SZ: tl.constexpr, KI8: tl.constexpr):
    """One whole 64-token tile in 16-token pieces -> the updated online-softmax state (`_tile_masked`'s math without
    masks, except that the column scale goes into the exponent's FMA and the softmax sum l_i and zero term acc_z
    stay per lane, `[16, GP]`, for `_int2_chunk` to reduce after the loop): the tokens at row r0 of page `page`
    (vz_cur: their stored V zeros `[64]`, prefetched; unused unless SZ is "separate"). SZ "quad": the rows' four
    scale/zero entries are read with one load per row and decoded once here."""
    if SZ == "quad":
        ks64, kz64, vs64, vz64 = _quad_at(ks_ptr, page * stride_ksp + h * stride_ksh + (r0 + offs_n) * stride_ksr,
                                          ASM)
    else:  # placeholders: `_page_scores` and `_page_values` read their own
        ks64 = vz_cur
        kz64 = vz_cur
        vs64 = vz_cur
        vz64 = vz_cur
    sa0, sa1, sa2, sa3 = _page_scores(kc_ptr, ks_ptr, kz_ptr, page, r0, h, stride_kcp, stride_kch, stride_kcr,
                                      stride_ksp, stride_ksh, stride_ksr, offs_n, offs_u, u_ok, qb0, qb1, qb2, qb3,
                                      qb4, qb5, qb6, qb7, nqsum_s, ks64, kz64, GP, NQ, U, U_PAD, ASM, INTERP,
                                      KI8, SZ)
    # The pieces are logits before their column scale ksc_s (`[GP]`, > 0): the tile's max logit is ksc_s times their
    # max (rounding is monotone), and each exponent is one FMA, `s * ksc_s - m`, instead of a multiply per logit.
    mx = _max4(sa0, sa1, sa2, sa3)
    m_new = tl.maximum(m_i, tl.max(mx, axis=0) * ksc_s)
    alpha = tl.exp2(m_i - m_new)
    a1 = alpha[None, :]
    # Fresh per-tile V dots (the pieces chained in the MMA accumulator), added to the chunk accumulators by an FFMA.
    z = tl.zeros([U_PAD, NQ], tl.float32)
    t0, t1, t2, t3, t4, t5, t6, t7, p_sum, z_sum = _page_values(
        vc_ptr, vs_ptr, page, r0, h, vs64, vz64, sa0, sa1, sa2, sa3, ksc_s, m_new, z, z, z, z, z, z, z, z,
        stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, offs_n, offs_u, u_ok,
        NQ, U, U_PAD, ASM, INTERP, SZ)
    l_i = l_i * a1 + p_sum
    acc_z = acc_z * a1 + z_sum
    return (m_new, l_i, acc_z, tl.fma(acc0, a1, _heads(t0, U_PAD, GP)), tl.fma(acc1, a1, _heads(t1, U_PAD, GP)),
            tl.fma(acc2, a1, _heads(t2, U_PAD, GP)), tl.fma(acc3, a1, _heads(t3, U_PAD, GP)),
            tl.fma(acc4, a1, _heads(t4, U_PAD, GP)), tl.fma(acc5, a1, _heads(t5, U_PAD, GP)),
            tl.fma(acc6, a1, _heads(t6, U_PAD, GP)), tl.fma(acc7, a1, _heads(t7, U_PAD, GP)))


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
    ks = _scale_f32(tl.load(ks_ptr + ks_rows))
    kz = _zero_f32(tl.load(kz_ptr + ks_rows))
    vs = _scale_f32(tl.load(vs_ptr + page * stride_vsp + h * stride_vsh + r0 * stride_vsr + offs_n * stride_vsr))
    return kw, vw, ks, kz, vs


@triton.jit
def _tile_zeros(vz_ptr, page, h, t0, offs_n, stride_vsp, stride_vsh, stride_vsr, P: tl.constexpr,
                BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """The V zeros `[BLOCK_N]` (as stored: fp16 or uint8; int32 codes for uint8 with WORDS, the whole-page loop's
    `_u8_words` reads) of the tile at token t0 (tile-aligned) in page `page`, KV head h."""
    offs = page * stride_vsp + h * stride_vsh + tl.multiple_of(t0 % P, BLOCK_N) * stride_vsr + offs_n * stride_vsr
    if WORDS and vz_ptr.dtype.element_ty == tl.uint8:
        return _u8_words(vz_ptr, offs)
    else:
        return tl.load(vz_ptr + offs)


@triton.jit
def _pick_page(pages, offs_pv, j):
    """Entry j of a register vector of page ids (a masked sum: no memory round trip), as an int64 for addressing."""
    return tl.sum(tl.where(offs_pv == j, pages, 0), axis=0).to(tl.int64)


@triton.jit
def _prefetch_span(ptr, n_bytes):
    """L2 prefetch of the n_bytes (<= 4 KiB) from ptr: one 128-byte line per lane of a warp (lanes past the span
    repeat its last line)."""
    offs = tl.minimum(tl.arange(0, 32) * 128, n_bytes - 1)
    _prefetch_l2(ptr.to(tl.pointer_type(tl.int8), bitcast=True) + offs)


@triton.jit
def _prefetch_tile(kc_ptr, ks_ptr, vc_ptr, page, r0, h, stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh,
                   stride_ksr, stride_vcp, stride_vch, stride_vcr, BLOCK_N: tl.constexpr, SZ: tl.constexpr):
    """L2 prefetch of the tile at row r0 of page `page` (int64), KV head h: its K and V codes (int16 views) and, SZ
    "quad", its scale/zero rows."""
    _prefetch_span(kc_ptr + page * stride_kcp + h * stride_kch + r0 * stride_kcr, BLOCK_N * stride_kcr * 2)
    _prefetch_span(vc_ptr + page * stride_vcp + h * stride_vch + r0 * stride_vcr, BLOCK_N * stride_vcr * 2)
    if SZ == "quad":
        _prefetch_span(ks_ptr + page * stride_ksp + h * stride_ksh + r0 * stride_ksr,
                       BLOCK_N * stride_ksr * (ks_ptr.dtype.element_ty.primitive_bitwidth // 8))


@triton.jit
def _prefetch_first_tiles(bt_row, start, end, kc_ptr, ks_ptr, vc_ptr, h, stride_kcp, stride_kch, stride_kcr,
                          stride_ksp, stride_ksh, stride_ksr, stride_vcp, stride_vch, stride_vcr,
                          P: tl.constexpr, BLOCK_N: tl.constexpr, PF: tl.constexpr, SZ: tl.constexpr):
    """Ask L2 for the codes (and, SZ "quad", the scale/zero rows) of the chunk's first PF (1 or 2) tiles, from their
    page ids (`bt_row`: the sequence's block-table row). Issued before the query prologue, so their HBM latency
    overlaps it: in a wave of programs that all start together (batch 1 runs one wave) the first tile otherwise
    waits for the prologue, then the page-id load, then HBM. Values are untouched: the loop still reads every tile
    itself."""
    # The branch is what keeps the prefetches here: in one basic block with the prologue the compiler sinks them to
    # its end, next to the loop's own first loads. Both page ids are loaded before either prefetch; a second tile
    # past the chunk's end is page 0's (a harmless extra fetch).
    if start < end:
        t1 = start + BLOCK_N
        page0 = tl.load(bt_row + start // P).to(tl.int64)
        if PF > 1:
            page1 = tl.load(bt_row + t1 // P, mask=t1 < end, other=0).to(tl.int64)
        _prefetch_tile(kc_ptr, ks_ptr, vc_ptr, page0, start % P, h, stride_kcp, stride_kch, stride_kcr, stride_ksp,
                       stride_ksh, stride_ksr, stride_vcp, stride_vch, stride_vcr, BLOCK_N, SZ)
        if PF > 1:
            _prefetch_tile(kc_ptr, ks_ptr, vc_ptr, page1, t1 % P, h, stride_kcp, stride_kch, stride_kcr,
                           stride_ksp, stride_ksh, stride_ksr, stride_vcp, stride_vch, stride_vcr, BLOCK_N, SZ)


@triton.jit
def _int2_chunk(
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
    b, h, sp, n_split, km_ptr, vm_ptr,
    GROUP: tl.constexpr, GP: tl.constexpr, Q: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr,
    P: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, NPV: tl.constexpr,
    FULL_TILES: tl.constexpr, SZ: tl.constexpr, KI8: tl.constexpr, CENTER: tl.constexpr, PF: tl.constexpr,
):
    """Program (b, h, split sp of n_split): one chunk of sequence b's history, KV head h -> the partial output and
    log-sum-exp at split index `split_offset + sp` (also run by the fused decode kernel). kc_ptr / vc_ptr: the code
    pools viewed as int16 `[pages, H, P, U]` (U = Q / 2), code strides in int16 units. FULL_TILES: whole pages
    promised (four unmasked 16-token pieces per tile when BLOCK_N = 64). SZ (whole-page pieces; `launch.tile_path`): how
    the scale/zero pools are laid out, "quad" (a row's K scale, K zero, V scale and V zero are four consecutive
    entries, `pools.quad_pools`, read with one load per row), "paired_v" (a row's V zero right after its V scale,
    `pools.paired_v_pools`) or "separate". KI8: scores by int8
    MMAs against the query's hi/lo int8 split.
    CENTER: the pools hold x - mu (per KV head, rotated basis; km_ptr / vm_ptr fp32 `[H_kv, d]`): every history logit
    gets + q.mu_k * sm_scale, i.e. the chunk's lse does, and its normalised output gets + mu_v. Both are exact
    (the chunk's softmax weights do not change), so the merge with the BF16 window stays exact.
    PF: tiles whose codes and scales are prefetched into L2 before the query prologue (`_prefetch_first_tiles`;
    0: none; compiled launches only)."""
    ASM: tl.constexpr = not INTERP
    NQ: tl.constexpr = 2 * GP
    start, end = _chunk_bounds(len_ptr, b, sp, n_split, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    offs_n = tl.arange(0, BLOCK_N)
    offs_u = tl.arange(0, U_PAD)
    u_ok = offs_u < U
    offs_c = tl.arange(0, NQ)
    c_head = offs_c // 2
    c_half = offs_c % 2
    c_ok = c_head < GROUP
    q_cols = q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + c_head)[None, :] * stride_qh  # [1, NQ]
    if KI8:  # the query's loads first: the prefetch below must not delay them
        q_rows = q_cols + tl.arange(0, Q)[:, None]  # [Q, NQ]: channel j of each column's head
        q0 = tl.load(q_rows, mask=c_ok[None, :], other=0.0).to(tl.float32)
        q1 = tl.load(q_rows + Q, mask=c_ok[None, :], other=0.0).to(tl.float32)
        q2 = tl.load(q_rows + 2 * Q, mask=c_ok[None, :], other=0.0).to(tl.float32)
        q3 = tl.load(q_rows + 3 * Q, mask=c_ok[None, :], other=0.0).to(tl.float32)
    if PF > 0:
        _prefetch_first_tiles(bt_row, start, end, kc_ptr, ks_ptr, vc_ptr, h, stride_kcp, stride_kch, stride_kcr,
                              stride_ksp, stride_ksh, stride_ksr, stride_vcp, stride_vch, stride_vcr,
                              P, BLOCK_N, PF, SZ)
    qb0 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 0, Q, 16.0)
    qb1 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 1, Q, 4.0)
    qb2 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 2, Q, 1.0)
    qb3 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 3, Q, 0.25)
    qb4 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 4, Q, 0.0625)
    qb5 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 5, Q, 1.0)
    qb6 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 6, Q, 0.25)
    qb7 = _qb(q_cols, offs_u, u_ok, c_half, c_ok, 7, Q, 0.0625)
    # 16 * sum q per head (the zero term), from the operands themselves.
    qsum_c = tl.sum(qb0.to(tl.float32) + 4.0 * qb1.to(tl.float32) + 16.0 * qb2.to(tl.float32)
                    + 64.0 * qb3.to(tl.float32) + 256.0 * qb4.to(tl.float32) + 16.0 * qb5.to(tl.float32)
                    + 64.0 * qb6.to(tl.float32) + 256.0 * qb7.to(tl.float32), axis=0)
    qsum = tl.sum(tl.reshape(qsum_c, [GP, 2]), axis=1)  # [GP], = 16 * sum_j q_j
    # The score dot gives 2^-24 * (16 q . code): the zero term and the scale move by 2^24.
    # The zero term's sum enters negated (-2^-24: fp16 subnormal bits n = n * 2^-24), so a logit is one FMA
    # `sc + kz * nqsum_s`: from `sc - kz * qsum` the compiler negated each row's zero point in the loop (an integer
    # `xor` per value once the zero comes out of a byte permute) instead of this loop-invariant sum.
    nqsum_s = qsum * -5.9604644775390625e-08
    ksc_s = qk_scale * 0.0625 * 16777216.0
    if KI8:
        # The query as int8 hi/lo pairs per head (`_qi8_quarter`): the hi/lo operands replace qb0-qb3, and the zero
        # term's query sum and the logits' column scale become per-head vectors (`_score16_i8`).
        amax = tl.max(tl.maximum(tl.maximum(tl.abs(q0), tl.abs(q1)), tl.maximum(tl.abs(q2), tl.abs(q3))), axis=0)
        sq = tl.where(amax > 0.0, amax / 127.0, 1.0)  # [NQ], the same for a head's two columns
        qb0 = _qi8_quarter(q0, c_half, sq)
        qb1 = _qi8_quarter(q1, c_half, sq)
        qb2 = _qi8_quarter(q2, c_half, sq)
        qb3 = _qi8_quarter(q3, c_half, sq)
        wcol = tl.where(c_half == 0, 254.0, 1.0)
        colsum = (tl.sum(qb0.to(tl.float32), axis=0) + tl.sum(qb1.to(tl.float32), axis=0)
                  + tl.sum(qb2.to(tl.float32), axis=0) + tl.sum(qb3.to(tl.float32), axis=0))
        # [GP]: -16x the sum of (254 hi + lo) per head, and the column scale over 16: `_score16_i8` sums 16x the
        # scores (powers of two, so the same logits bit for bit).
        nqsum_s = tl.sum(tl.reshape(colsum * wcol, [GP, 2]), axis=1) * -16.0
        ksc_s = tl.max(tl.reshape(qk_scale * sq / 254.0, [GP, 2]), axis=1) * 0.0625
        # Convert the operands to the MMA's register layout once, outside the loop: as loop invariants Triton
        # converted them at each dot (8 SHFL + 8 SEL per tile). These dots of zeros need the same conversions, which
        # CSE then shares with the loop; the sum * 0.0 keeps them alive.
        z8 = tl.zeros([16, Q], tl.int8)
        warm = (tl.dot(z8, qb0, out_dtype=tl.int32) + tl.dot(z8, qb1, out_dtype=tl.int32)
                + tl.dot(z8, qb2, out_dtype=tl.int32) + tl.dot(z8, qb3, out_dtype=tl.int32))
        ksc_s = ksc_s + tl.sum(tl.sum(warm, axis=0), axis=0).to(tl.float32) * 0.0

    PIECES: tl.constexpr = FULL_TILES and BLOCK_N == 64
    if PIECES:
        ksc_s = tl.zeros([GP], tl.float32) + ksc_s  # per head in both score modes (a scalar for fp16 scores)
    if PIECES and SZ == "quad":
        # Quad zero points come scaled by zs (`quad_zero_scale`, a power of two): the K zero term's other factor
        # takes 1 / zs here, the V zero term's sum after the loop, so both terms are the same numbers.
        zs = quad_zero_scale(ks_ptr)
        nqsum_s = nqsum_s / zs
    m_i = tl.full([GP], float("-inf"), tl.float32)
    if PIECES:
        # The softmax sum and the V zero term per lane, `[16, GP]` in the pieces' layout: reduced across lanes once
        # after the loop (`_tile_pieces`), not once per tile.
        l_i = tl.zeros([16, GP], tl.float32)
        acc_z = tl.zeros([16, GP], tl.float32)
    else:
        l_i = tl.zeros([GP], tl.float32)
        acc_z = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([U_PAD, GP], tl.float32)
    acc1 = tl.zeros([U_PAD, GP], tl.float32)
    acc2 = tl.zeros([U_PAD, GP], tl.float32)
    acc3 = tl.zeros([U_PAD, GP], tl.float32)
    acc4 = tl.zeros([U_PAD, GP], tl.float32)
    acc5 = tl.zeros([U_PAD, GP], tl.float32)
    acc6 = tl.zeros([U_PAD, GP], tl.float32)
    acc7 = tl.zeros([U_PAD, GP], tl.float32)

    # Page ids come NPV at a time into registers and each tile's id is picked out of them, so every load address of
    # a tile is a function of the loop index alone: the pipeliner keeps num_stages - 1 tiles of codes AND scales in
    # flight (cp.async). Without FULL_TILES only the last tile of a sequence is partial; rows past `end` may hold
    # anything (read unmasked inside the allocated page), so their V scale/zero are zeroed (0 * NaN would not be)
    # and their scores -inf.
    offs_pv = tl.arange(0, NPV)
    k_off = offs_n[:, None] * stride_kcr + offs_u[None, :]  # [BLOCK_N, U_PAD]
    v_off = offs_n[None, :] * stride_vcr + offs_u[:, None]  # [U_PAD, BLOCK_N]
    n_tiles = tl.cdiv(end - start, BLOCK_N)
    for jb in range(0, n_tiles, NPV):
        ti = jb + offs_pv
        pg = tl.load(bt_row + (start + ti * BLOCK_N) // P, mask=ti < n_tiles, other=0)
        n_in = tl.minimum(NPV, n_tiles - jb)
        # V zeros feed no dot, so the pipeliner leaves their load synchronous; they are prefetched by hand one tile
        # ahead instead, as a loop-carried register (paired and quad pools bring them with the scales).
        pg0 = _pick_page(pg, offs_pv, 0)
        if SZ == "separate":
            vz_next = _tile_zeros(vz_ptr, pg0, h, start + jb * BLOCK_N, offs_n, stride_vsp, stride_vsh,
                                  stride_vsr, P, BLOCK_N, FULL_TILES and BLOCK_N == 64)
        # The page id picked for the V-zero prefetch is the next tile's page: one pick per tile, not two.
        page_n = pg0
        for jj in range(0, n_in):
            t0 = start + (jb + jj) * BLOCK_N
            page = page_n
            r0 = tl.multiple_of(t0 % P, BLOCK_N)
            jn = tl.minimum(jj + 1, n_in - 1)  # the last tile of the block reloads its own (harmless)
            pgn = _pick_page(pg, offs_pv, jn)
            if SZ != "separate":
                vz_cur = offs_n  # unused: the zeros come with the scales
            else:
                vz_cur = vz_next
                vz_next = _tile_zeros(vz_ptr, pgn, h, start + (jb + jn) * BLOCK_N, offs_n, stride_vsp,
                                      stride_vsh, stride_vsr, P, BLOCK_N, FULL_TILES and BLOCK_N == 64)
            page_n = pgn
            if PIECES:
                m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tile_pieces(
                    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, page, r0, h, vz_cur,
                    stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
                    stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr,
                    offs_n, offs_u, u_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, nqsum_s, ksc_s,
                    m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, GP, NQ, U, U_PAD, ASM, INTERP,
                    SZ, KI8)
            else:
                kw, vw, ks, kz, vs = _page_tile_loads(
                    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, page, r0, h, stride_kcp, stride_kch, stride_kcr,
                    stride_ksp, stride_ksh, stride_ksr, stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh,
                    stride_vsr, k_off, v_off, offs_n, u_ok, U, U_PAD)
                vz = _zero_f32(vz_cur)
                t_ok = t0 + offs_n < end
                if not FULL_TILES:
                    vs = tl.where(t_ok, vs, 0.0)
                    vz = tl.where(t_ok, vz, 0.0)
                m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tile_masked(
                    kw, vw, ks, kz, vs, vz, t_ok, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, nqsum_s, ksc_s,
                    m_i, l_i, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, GP, NQ, U_PAD, BLOCK_N,
                    INTERP, ASM, not FULL_TILES)

    if PIECES:
        l_i = tl.sum(l_i, axis=0)
        acc_z = tl.sum(acc_z, axis=0)
        if SZ == "quad":
            acc_z = acc_z / zs
    inv, lse = _softmax_finish(m_i, l_i)
    offs_g = tl.arange(0, GP)
    o_cols = (o_ptr + b.to(tl.int64) * stride_ob + (h * GROUP + offs_g)[None, :] * stride_oh
              + (split_offset + sp) * stride_os)
    omask = u_ok[:, None] & (offs_g < GROUP)[None, :]
    US: tl.constexpr = 16777216.0  # the V operands carried a factor 2^-24
    if CENTER:
        D_PAD: tl.constexpr = 8 * U_PAD
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < 4 * Q
        q_rows = (q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh
                  + offs_d[None, :])
        qf = tl.load(q_rows, mask=(offs_g < GROUP)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        mk = tl.load(km_ptr + h * (4 * Q) + offs_d, mask=d_ok, other=0.0)
        lse = lse + tl.sum(qf * mk[None, :], axis=1) * (qk_scale * 0.6931471805599453)  # -inf stays -inf
        vm_h = vm_ptr + h * (4 * Q)
        vm_ok = l_i > 0.0
        _store_pos_centered(o_cols, acc0, acc_z, inv, offs_u, omask, vm_h, vm_ok, 0, Q, US * 1.0)
        _store_pos_centered(o_cols, acc1, acc_z, inv, offs_u, omask, vm_h, vm_ok, 1, Q, US * 0.25)
        _store_pos_centered(o_cols, acc2, acc_z, inv, offs_u, omask, vm_h, vm_ok, 2, Q, US * 0.0625)
        _store_pos_centered(o_cols, acc3, acc_z, inv, offs_u, omask, vm_h, vm_ok, 3, Q, US * 0.015625)
        _store_pos_centered(o_cols, acc4, acc_z, inv, offs_u, omask, vm_h, vm_ok, 4, Q, US * 0.00390625)
        _store_pos_centered(o_cols, acc5, acc_z, inv, offs_u, omask, vm_h, vm_ok, 5, Q, US * 0.0625)
        _store_pos_centered(o_cols, acc6, acc_z, inv, offs_u, omask, vm_h, vm_ok, 6, Q, US * 0.015625)
        _store_pos_centered(o_cols, acc7, acc_z, inv, offs_u, omask, vm_h, vm_ok, 7, Q, US * 0.00390625)
    else:
        _store_pos(o_cols, acc0, acc_z, inv, offs_u, omask, 0, Q, US * 1.0)
        _store_pos(o_cols, acc1, acc_z, inv, offs_u, omask, 1, Q, US * 0.25)
        _store_pos(o_cols, acc2, acc_z, inv, offs_u, omask, 2, Q, US * 0.0625)
        _store_pos(o_cols, acc3, acc_z, inv, offs_u, omask, 3, Q, US * 0.015625)
        _store_pos(o_cols, acc4, acc_z, inv, offs_u, omask, 4, Q, US * 0.00390625)
        _store_pos(o_cols, acc5, acc_z, inv, offs_u, omask, 5, Q, US * 0.0625)
        _store_pos(o_cols, acc6, acc_z, inv, offs_u, omask, 6, Q, US * 0.015625)
        _store_pos(o_cols, acc7, acc_z, inv, offs_u, omask, 7, Q, US * 0.00390625)
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + (h * GROUP + offs_g) * stride_lh + split_offset + sp,
             lse, mask=offs_g < GROUP)


@triton.jit(do_not_specialize=["split_offset"])
def _int2_decode_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, km_ptr, vm_ptr,
    qk_scale, split_offset,
    stride_qb, stride_qh,
    # Pool strides are compile-time constants: the cache's pools are contiguous, so they follow from the geometry
    # (one compile per model). The per-lane copy offsets then fold into immediates (fewer instructions per tile, no
    # 64-bit offset registers live across the loop).
    stride_kcp: tl.constexpr, stride_kch: tl.constexpr, stride_kcr: tl.constexpr,
    stride_ksp: tl.constexpr, stride_ksh: tl.constexpr, stride_ksr: tl.constexpr,
    stride_vcp: tl.constexpr, stride_vch: tl.constexpr, stride_vcr: tl.constexpr,
    stride_vsp: tl.constexpr, stride_vsh: tl.constexpr, stride_vsr: tl.constexpr,
    stride_btb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, GP: tl.constexpr, Q: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr,
    P: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, NPV: tl.constexpr,
    FULL_TILES: tl.constexpr, SZ: tl.constexpr, KI8: tl.constexpr, CENTER: tl.constexpr, PF: tl.constexpr,
):
    # Grid (B, H_kv, num_splits); q: fp16 or bf16 `[B, H_q, d]`; one scale/zero group per row.
    _int2_chunk(
        q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, qk_scale, split_offset,
        stride_qb, stride_qh, stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
        stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, stride_btb,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(2), km_ptr, vm_ptr,
        GROUP, GP, Q, U, U_PAD, P, BLOCK_N, INTERP, NPV, FULL_TILES, SZ, KI8, CENTER, PF)
