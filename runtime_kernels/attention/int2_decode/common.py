"""Triton helpers shared by every decode kernel of this folder: chunk bounds, the softmax epilogue, a portable dot,
the stored scale/zero formats."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, FP32: tl.constexpr, INTERP: tl.constexpr):
    """`a [M, K] @ b [K, N]` with fp32 accumulation; exact fp32 products when the inputs are fp32.

    INTERP: the Triton CPU interpreter multiplies bfloat16 tiles as their raw uint16 bits, so there the (exactly
    representable) operands are widened to fp32 first; same products, same accumulation type.
    """
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _softmax_finish(m_i, l_i):
    """End of an online softmax over a chunk, log2-scaled running max m_i and sum l_i -> (1 / l, natural-log lse).
    An empty chunk (l = 0) gives 1 / l = 0 (so o = 0) and lse = -inf (the reduce gives it zero weight)."""
    has = l_i > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return inv, lse


@triton.jit
def _chunk_bounds(len_ptr, b, sp, n_split, BLOCK_N: tl.constexpr):
    """Tokens `[start, end)` of split sp of n_split of sequence b (length at `len_ptr + b`): tile-aligned chunks, so
    tiles never straddle pages when BLOCK_N divides the page size."""
    L = tl.load(len_ptr + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(L, n_split), BLOCK_N) * BLOCK_N
    start = sp * chunk
    return start, tl.minimum(start + chunk, L)


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 to fetch the lines at `ptrs` (any shape; `prefetch.global.L2`, compiled launches only): nothing is
    read into registers, so a program can start its first tiles' HBM traffic before it has the work that consumes
    them. Returns a dummy int32 of ptrs' shape (the asm is impure, so it stays without a user)."""
    return tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _u8_word(ptr, offs):
    """The 32-bit words that hold the uint8 elements at element offsets `offs` of a 4-byte-aligned uint8 buffer, and
    each element's byte index in its word -> (int32 words, int32 byte indices 0-3); lanes sharing a word load the
    same address. The whole-page loop reads ue5m3 pools this way: compiled 8-bit vectors that the register split
    moved between layouts gave wrong outputs on an H200 (Triton 3.6) while the interpreter matched (docs/kernels.md,
    "ue5m3 scale pools")."""
    return tl.load(ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (offs >> 2)), (offs & 3).to(tl.int32)


@triton.jit
def _byte_in_word(w, k):
    """Byte k (0-3) of int32 words w -> int32 0-255."""
    return (w >> (k * 8)) & 255


@triton.jit
def _u8_words(ptr, offs):
    """The uint8 elements at element offsets `offs` of a 4-byte-aligned uint8 buffer -> int32 codes (0-255), read
    through their words (`_u8_word`)."""
    w, k = _u8_word(ptr, offs)
    return _byte_in_word(w, k)


@triton.jit
def _ue5m3_in_word(w, k, ASM: tl.constexpr):
    """The ue5m3 scale in byte k of word w -> fp32 (`_scale_f32`'s value, bit for bit). ASM: a byte permute puts the
    code at bits 16-23 and one shift-add (ptxas emits a LEA) makes `(code << 20) + (896 << 20)`: two integer-ALU
    instructions where the shift, mask, add and shift of the plain form took four, on the pipe that bounds the tile
    loop (docs/kernels.md, "Integer ALU work per tile")."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; prmt.b32 t, $1, 0, $2; mad.lo.u32 $0, t, 16, 939524096; }", "=r,r,r",
            [w, 0x4044 | (k << 8)], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return _scale_f32(_byte_in_word(w, k))


@triton.jit
def _zero_in_word(w, k, ASM: tl.constexpr):
    """The uint8 zero point in byte k of word w -> fp32 codes z / 64 (`_zero_f32`'s value, bit for bit). ASM: a byte
    permute writes the float `2^23 + z` and one FMA gives `(2^23 + z) / 64 - 2^17`, exactly z / 64, instead of a
    shift and an integer-to-float conversion."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, c; mov.b32 c, 0x4B000000; prmt.b32 t, $1, c, $2; "
            "fma.rn.f32 $0, t, 0f3C800000, 0fC8000000; }", "=r,r,r",
            [w, 0x7540 | k], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return _zero_f32(_byte_in_word(w, k))


@triton.jit
def _scales_at(ptr, offs, ASM: tl.constexpr):
    """The stored scales at element offsets `offs` of a scale pool -> fp32: a uint8 (ue5m3) pool through its words
    (`_u8_word`, `_ue5m3_in_word`), an fp16 one loaded as is."""
    if ptr.dtype.element_ty == tl.uint8:
        w, k = _u8_word(ptr, offs)
        return _ue5m3_in_word(w, k, ASM)
    else:
        return _scale_f32(tl.load(ptr + offs))


@triton.jit
def _zeros_at(ptr, offs, ASM: tl.constexpr):
    """The stored zero points at element offsets `offs` of a zero pool -> fp32 codes (`_scales_at`'s reads)."""
    if ptr.dtype.element_ty == tl.uint8:
        w, k = _u8_word(ptr, offs)
        return _zero_in_word(w, k, ASM)
    else:
        return _zero_f32(tl.load(ptr + offs))


# A quad row's four ue5m3-pool bytes (K scale, K zero, V scale, V zero) -> four fp32 values, two at a time in fp16
# pairs: a byte permute puts the two scale codes at bits 0-7 of each half and a shift by 7 makes each half the fp16
# `code << 7`, which is the ue5m3 value itself (both have 5 exponent bits with bias 15; the encoder keeps scales in
# fp16's normal range, exponents 1-30); a second permute puts the two zero bytes at the bottom of each half, an fp16
# subnormal worth z * 2^-24, i.e. the zero point z / 64 times 2^-18 (`quad_zero_scale`: the kernel folds 2^18 into
# the zero terms' other factors, powers of two, so the products are the same numbers). Two integer-ALU instructions
# per row where decoding the four bytes one at a time took six (docs/kernels.md, "Integer ALU work per tile").
_ASM_QUAD_UE5M3 = tl.constexpr(
    "{ .reg .b32 t, u; .reg .b16 lo, hi; "
    "prmt.b32 t, $4, 0, 0x4240; "
    "shl.b32 t, t, 7; "
    "mov.b32 {lo, hi}, t; "
    "cvt.f32.f16 $0, lo; "
    "cvt.f32.f16 $2, hi; "
    "prmt.b32 u, $4, 0, 0x4341; "
    "mov.b32 {lo, hi}, u; "
    "cvt.f32.f16 $1, lo; "
    "cvt.f32.f16 $3, hi; }")


@triton.jit
def quad_zero_scale(ptr):
    """What `_quad_at`'s zero points are multiplied by for a quad pool at ptr: 2^-18 for uint8 (ue5m3) pools, whose
    zero bytes it reads as fp16 subnormals, 1 for fp16 pools."""
    if ptr.dtype.element_ty == tl.uint8:
        return 3.814697265625e-06  # 2^-18
    else:
        return 1.0


@triton.jit
def _quad_at(ptr, offs, ASM: tl.constexpr):
    """The four stored entries of the rows whose K scale is at element offsets `offs` `[N]` (multiples of 4) of a
    quad pool (`pools.quad_pools`: K scale, K zero, V scale, V zero side by side) -> (K scale, K zero, V scale,
    V zero) fp32 `[N]`: the values `_scales_at` / `_zeros_at` give, the zeros times `quad_zero_scale(ptr)`. uint8
    pools: one 32-bit word per row; fp16 pools: one 8-byte vector per row."""
    if ptr.dtype.element_ty == tl.uint8:
        w, _ = _u8_word(ptr, offs)  # a quad row is one whole word (byte index 0)
        if ASM:
            return tl.inline_asm_elementwise(_ASM_QUAD_UE5M3, "=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 4,
                                             is_pure=True, pack=1)
        else:  # (z / 64) * 2^-18, exactly the fp16 subnormal's z * 2^-24
            zs = quad_zero_scale(ptr)
            return (_scale_f32(_byte_in_word(w, 0)), _zero_f32(_byte_in_word(w, 1)) * zs,
                    _scale_f32(_byte_in_word(w, 2)), _zero_f32(_byte_in_word(w, 3)) * zs)
    else:
        x = tl.load(ptr + offs[:, None] + tl.arange(0, 4)[None, :])  # [N, 4]
        even, odd = tl.split(tl.reshape(x, [offs.shape[0], 2, 2]))  # entries (0, 2) and (1, 3)
        ks, vs = tl.split(even)
        kz, vz = tl.split(odd)
        return _scale_f32(ks), _zero_f32(kz), _scale_f32(vs), _zero_f32(vz)


@triton.jit
def _scale_f32(raw):
    """A stored scale -> fp32. Its dtype is the format (`runtime_kernels.quant.naive.SCALE_FORMATS`): fp16 as is,
    uint8 (or int32 from `_u8_words`) a ue5m3 code (5 exponent bits with bias 15, 3 mantissa bits), decoded exactly through the fp32 bits."""
    if raw.dtype == tl.uint8:
        return ((raw.to(tl.int32) + 896) << 20).to(tl.float32, bitcast=True)  # 896 = (127 - 15) << 3
    elif raw.dtype == tl.int32:  # a ue5m3 code already widened (`_u8_words`)
        return ((raw + 896) << 20).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def _zero_f32(raw):
    """A stored zero point -> fp32 codes: fp16 as is, uint8 (or its int32 widening) in 1/64 of a code."""
    if raw.dtype == tl.uint8 or raw.dtype == tl.int32:
        return raw.to(tl.float32) * 0.015625
    else:
        return raw.to(tl.float32)
