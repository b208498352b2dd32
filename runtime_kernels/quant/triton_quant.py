"""Triton kernel: clip -> INT2 min-max quantize -> quarter-split pack, scattered into a paged pool.

Input rows are already rotated (fp32, done with `naive.rotate` so the bytes match the reference exactly).
One program handles `ROWS` tokens of one KV head. The row is read as four channel quarters
(`k * Q + j`, `Q = d / 4`), because quarter `k` of channel `j` lands in bits `2k+1:2k` of byte `j`: the
packed byte is then an OR of four shifted tiles, with no shuffle.

The arithmetic mirrors `naive.quantize` operation by operation (IEEE division via `div_rn`, the fp16
rounding of scale and zero before use), so codes, scales and zeros are bit-identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime_kernels.format import KVFormat
from runtime_kernels.launch_util import next_pow2
from runtime_kernels.quant import naive


@triton.jit
def _group_bounds(x0, x1, x2, x3, in0, in1, in2, in3):
    """Min and max over the channels selected by the masks `in_k [Q_PAD]` of the four quarters `x_k [ROWS, Q_PAD]`."""
    big = float("inf")
    lo = tl.minimum(tl.minimum(tl.min(tl.where(in0[None, :], x0, big), axis=1),
                               tl.min(tl.where(in1[None, :], x1, big), axis=1)),
                    tl.minimum(tl.min(tl.where(in2[None, :], x2, big), axis=1),
                               tl.min(tl.where(in3[None, :], x3, big), axis=1)))
    hi = tl.maximum(tl.maximum(tl.max(tl.where(in0[None, :], x0, -big), axis=1),
                               tl.max(tl.where(in1[None, :], x1, -big), axis=1)),
                    tl.maximum(tl.max(tl.where(in2[None, :], x2, -big), axis=1),
                               tl.max(tl.where(in3[None, :], x3, -big), axis=1)))
    return lo, hi


@triton.jit
def _encode(x, s, z):
    """`clamp(floor(x / s + z + 0.5), 0, 3)` as uint8, evaluated in the same order as the torch reference."""
    c = tl.floor(tl.math.div_rn(x, s) + z + 0.5)
    return tl.minimum(tl.maximum(c, 0.0), 3.0).to(tl.uint8)


@triton.jit
def _scale_fp16(lo, hi, RECIP: tl.constexpr):
    """The fp16 scale of `naive.quantize`: `max(max(hi - lo, 3 * 2^-14) / 3, max(|lo|, |hi|) * 2^-15)`."""
    s = _range_over_3(tl.maximum(hi - lo, 0.00018310546875), RECIP)  # 3 * 2^-14
    s = tl.maximum(s, tl.maximum(tl.abs(lo), tl.abs(hi)) * 3.0517578125e-05)  # 2^-15
    return s.to(tl.float16)


@triton.jit
def _scale_zero(lo, hi, RECIP: tl.constexpr, UE5M3: tl.constexpr):
    """(stored scale, stored zero, fp32 scale, fp32 zero) of a group with bounds `lo, hi [ROWS]`, as
    `naive.quantize` computes them: fp16 both, or (UE5M3) a ue5m3 scale code and a zero point in 1/64 code."""
    if UE5M3:
        lo = tl.minimum(lo, 0.0)  # the range always contains 0, so the zero point lies in [0, 3] codes
        hi = tl.maximum(hi, 0.0)
        r = _range_over_3(tl.maximum(hi - lo, 0.00018310546875), RECIP)  # 3 * 2^-14
        r = tl.minimum(tl.maximum(r, 6.103515625e-05), 61440.0)  # [2^-14, 1.875 * 2^15]: naive.UE5M3_MIN/MAX
        bits = r.to(tl.int32, bitcast=True)
        code = tl.minimum(tl.maximum(((bits + (1 << 19)) >> 20) - 896, 0), 255)  # 896 = (127 - 15) << 3
        s = ((code + 896) << 20).to(tl.float32, bitcast=True)
        zq = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(-lo, s) * 64.0 + 0.5), 0.0), 255.0)
        return code.to(tl.uint8), zq.to(tl.uint8), s, zq * 0.015625
    else:
        s16 = _scale_fp16(lo, hi, RECIP)
        s = s16.to(tl.float32)
        z16 = tl.math.div_rn(-lo, s).to(tl.float16)
        return s16, z16, s, z16.to(tl.float32)


@triton.jit
def _range_over_3(r, RECIP: tl.constexpr):
    """`r / 3` exactly as torch computes `tensor / 3` on the same device: torch's CUDA kernel multiplies by the
    fp32 reciprocal of a scalar divisor (RECIP), its CPU kernel divides (IEEE)."""
    if RECIP:
        return r * 0.3333333432674408  # fp32(1/3)
    else:
        return tl.math.div_rn(r, 3.0)


@triton.jit
def _scale_zero_tiles(x0, x1, x2, x3, offs_j, j_ok, t_ok, s_dst, z_dst, G: tl.constexpr, NG: tl.constexpr,
                      Q: tl.constexpr, ROWS: tl.constexpr, Q_PAD: tl.constexpr, RECIP: tl.constexpr,
                      UE5M3: tl.constexpr, STORE: tl.constexpr):
    """fp32 scale and zero tiles `[ROWS, Q_PAD]` of the four quarters `x_k` (min-max per group of G channels), as
    (s0, s1, s2, s3, z0, z1, z2, z3); with STORE, every group's stored scale and zero go to `s_dst`/`z_dst` + group.
    One group per row (NG == 1) gives `[ROWS, 1]` columns instead, which broadcast."""
    # One return statement: the compiler type-checks every return, even in a branch a constexpr rules out.
    if NG == 1:
        lo, hi = _group_bounds(x0, x1, x2, x3, j_ok, j_ok, j_ok, j_ok)
        lo = tl.where(t_ok, lo, 0.0)  # padding rows: keep the arithmetic finite
        hi = tl.where(t_ok, hi, 1.0)
        s_st, z_st, s, z = _scale_zero(lo, hi, RECIP, UE5M3)
        if STORE:
            tl.store(s_dst, s_st, mask=t_ok)
            tl.store(z_dst, z_st, mask=t_ok)
        s0 = s[:, None]
        s1 = s0
        s2 = s0
        s3 = s0
        z0 = z[:, None]
        z1 = z0
        z2 = z0
        z3 = z0
    else:
        s0 = tl.full([ROWS, Q_PAD], 1.0, tl.float32)
        s1 = s0
        s2 = s0
        s3 = s0
        z0 = tl.zeros([ROWS, Q_PAD], tl.float32)
        z1 = z0
        z2 = z0
        z3 = z0
        for g in tl.static_range(NG):  # NG is small and known at compile time
            in0 = ((offs_j // G) == g) & j_ok
            in1 = (((offs_j + Q) // G) == g) & j_ok
            in2 = (((offs_j + 2 * Q) // G) == g) & j_ok
            in3 = (((offs_j + 3 * Q) // G) == g) & j_ok
            lo, hi = _group_bounds(x0, x1, x2, x3, in0, in1, in2, in3)
            lo = tl.where(t_ok, lo, 0.0)
            hi = tl.where(t_ok, hi, 1.0)
            s_st, z_st, s, z = _scale_zero(lo, hi, RECIP, UE5M3)
            if STORE:
                tl.store(s_dst + g, s_st, mask=t_ok)
                tl.store(z_dst + g, z_st, mask=t_ok)
            s0 = tl.where(in0[None, :], s[:, None], s0)
            s1 = tl.where(in1[None, :], s[:, None], s1)
            s2 = tl.where(in2[None, :], s[:, None], s2)
            s3 = tl.where(in3[None, :], s[:, None], s3)
            z0 = tl.where(in0[None, :], z[:, None], z0)
            z1 = tl.where(in1[None, :], z[:, None], z1)
            z2 = tl.where(in2[None, :], z[:, None], z2)
            z3 = tl.where(in3[None, :], z[:, None], z3)
    return s0, s1, s2, s3, z0, z1, z2, z3


@triton.jit
def _dot64(u, x, s, z):
    """fp64 tiles `u * u` and `u * x_hat`, `x_hat = (code - z) * s` the dequantized `x` (fp32, as naive.dequantize)."""
    xh = (_encode(x, s, z).to(tl.float32) - z) * s
    u64 = u.to(tl.float64)
    return u64 * u64, u64 * xh.to(tl.float64)


@triton.jit
def _gain_tiles(u0, u1, u2, u3, x0, x1, x2, x3, s0, s1, s2, s3, z0, z1, z2, z3, offs_j, j_ok, t_ok,
                G: tl.constexpr, NG: tl.constexpr, Q: tl.constexpr, ROWS: tl.constexpr, Q_PAD: tl.constexpr):
    """Gain tiles `[ROWS, Q_PAD]` of `naive.unbiased_gain`: `|u|^2 / <u, x_hat>` per group (u unclipped, x_hat the
    first dequantization of the clipped x), in fp64, kept in [0.5, 2], rounded to 1/2^16; 1 if `<u, x_hat>` <= 0."""
    n0, d0 = _dot64(u0, x0, s0, z0)
    n1, d1 = _dot64(u1, x1, s1, z1)
    n2, d2 = _dot64(u2, x2, s2, z2)
    n3, d3 = _dot64(u3, x3, s3, z3)
    g0 = tl.full([ROWS, Q_PAD], 1.0, tl.float32)
    g1 = g0
    g2 = g0
    g3 = g0
    for g in tl.static_range(NG):
        in0 = (((offs_j // G) == g) & j_ok)[None, :]
        in1 = ((((offs_j + Q) // G) == g) & j_ok)[None, :]
        in2 = ((((offs_j + 2 * Q) // G) == g) & j_ok)[None, :]
        in3 = ((((offs_j + 3 * Q) // G) == g) & j_ok)[None, :]
        num = (tl.sum(tl.where(in0, n0, 0.0), axis=1) + tl.sum(tl.where(in1, n1, 0.0), axis=1)
               + tl.sum(tl.where(in2, n2, 0.0), axis=1) + tl.sum(tl.where(in3, n3, 0.0), axis=1))
        den = (tl.sum(tl.where(in0, d0, 0.0), axis=1) + tl.sum(tl.where(in1, d1, 0.0), axis=1)
               + tl.sum(tl.where(in2, d2, 0.0), axis=1) + tl.sum(tl.where(in3, d3, 0.0), axis=1))
        gain = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 1.0)
        gain = tl.minimum(tl.maximum(gain, 0.5), 2.0)
        gain = (tl.floor(gain * 65536.0 + 0.5) * (1.0 / 65536.0)).to(tl.float32)  # naive.GAIN_STEPS
        gain = tl.where(t_ok, gain, 1.0)
        g0 = tl.where(in0, gain[:, None], g0)
        g1 = tl.where(in1, gain[:, None], g1)
        g2 = tl.where(in2, gain[:, None], g2)
        g3 = tl.where(in3, gain[:, None], g3)
    return g0, g1, g2, g3


@triton.jit(do_not_specialize=["T"])
def _quantize_pack_kernel(
    x_ptr, clip_ptr, tau_ptr, codes_ptr, scale_ptr, zero_ptr, page_ptr, row_ptr, mean_ptr,
    T, stride_xt, stride_xh,
    stride_cp, stride_ch, stride_cr,
    stride_sp, stride_sh, stride_sr,
    D: tl.constexpr, Q: tl.constexpr, G: tl.constexpr, NG: tl.constexpr,
    D_PAD: tl.constexpr, Q_PAD: tl.constexpr, ROWS: tl.constexpr, CLIP: tl.constexpr, RECIP: tl.constexpr,
    MEAN: tl.constexpr = False, UE5M3: tl.constexpr = False, UNBIASED: tl.constexpr = False,
):
    # UNBIASED: the "uniform_unbiased" quantizer (naive.QUANTIZERS): a second pass after the gain.
    # UE5M3: scale and zero pools are uint8 (ue5m3 scale code, zero point in 1/64 code); fp16 otherwise.
    # MEAN: centered cache, mean_ptr fp32 `[H, D]`: the head's mean is subtracted from every row before clipping.
    # CLIP: 0 = no clipping, 1 = order statistic by an in-kernel sort, 2 = threshold precomputed in tau [T, H].
    # clip_ptr: the fp32 clip ratio per head; CLIP 1 derives the order-statistic index from it exactly as
    # `naive.clip_index` does (float64 product, floor, at most D - 1).
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * ROWS + tl.arange(0, ROWS)
    t_ok = offs_t < T
    offs_j = tl.arange(0, Q_PAD)
    j_ok = offs_j < Q
    m2 = t_ok[:, None] & j_ok[None, :]
    x_row = x_ptr + offs_t.to(tl.int64) * stride_xt + h * stride_xh  # [ROWS] row starts

    # x may be fp32, bf16 or fp16: everything below is fp32 (the half inputs are exact in it)
    x0 = tl.load(x_row[:, None] + offs_j[None, :], mask=m2, other=0.0).to(tl.float32)
    x1 = tl.load(x_row[:, None] + (offs_j + Q)[None, :], mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(x_row[:, None] + (offs_j + 2 * Q)[None, :], mask=m2, other=0.0).to(tl.float32)
    x3 = tl.load(x_row[:, None] + (offs_j + 3 * Q)[None, :], mask=m2, other=0.0).to(tl.float32)
    if MEAN:
        mu = mean_ptr + h * D + offs_j
        x0 = x0 - tl.load(mu, mask=j_ok, other=0.0)[None, :]
        x1 = x1 - tl.load(mu + Q, mask=j_ok, other=0.0)[None, :]
        x2 = x2 - tl.load(mu + 2 * Q, mask=j_ok, other=0.0)[None, :]
        x3 = x3 - tl.load(mu + 3 * Q, mask=j_ok, other=0.0)[None, :]

    u0, u1, u2, u3 = x0, x1, x2, x3  # the unclipped rows (the unbiased quantizer's gain reads them)
    if CLIP == 1:
        # tau = c-th smallest |x| of the row (ascending order statistic); padding sorts last as +inf.
        c = tl.minimum(tl.floor(tl.load(clip_ptr + h).to(tl.float64) * D), D - 1).to(tl.int32)
        offs_d = tl.arange(0, D_PAD)
        xd = tl.load(x_row[:, None] + offs_d[None, :], mask=t_ok[:, None] & (offs_d < D)[None, :],
                     other=float("inf")).to(tl.float32)
        if MEAN:
            xd = xd - tl.load(mean_ptr + h * D + offs_d, mask=offs_d < D, other=0.0)[None, :]
        xa = tl.abs(xd)
        srt = tl.sort(xa, dim=1)
        tau = tl.sum(tl.where(offs_d[None, :] == c, srt, 0.0), axis=1)[:, None]
    if CLIP == 2:
        tau = tl.load(tau_ptr + offs_t * tl.num_programs(1) + h, mask=t_ok, other=0.0)[:, None]
    if CLIP != 0:
        x0 = tl.minimum(tl.maximum(x0, -tau), tau)
        x1 = tl.minimum(tl.maximum(x1, -tau), tau)
        x2 = tl.minimum(tl.maximum(x2, -tau), tau)
        x3 = tl.minimum(tl.maximum(x3, -tau), tau)

    page = tl.load(page_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
    row = tl.load(row_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
    s_dst = scale_ptr + page * stride_sp + h * stride_sh + row * stride_sr
    z_dst = zero_ptr + page * stride_sp + h * stride_sh + row * stride_sr

    s0, s1, s2, s3, z0, z1, z2, z3 = _scale_zero_tiles(x0, x1, x2, x3, offs_j, j_ok, t_ok, s_dst, z_dst, G, NG,
                                                       Q, ROWS, Q_PAD, RECIP, UE5M3, not UNBIASED)
    if UNBIASED:
        # Second pass of naive.quantize_rows: scale the clipped group by its gain, then quantize it again.
        g0, g1, g2, g3 = _gain_tiles(u0, u1, u2, u3, x0, x1, x2, x3, s0, s1, s2, s3, z0, z1, z2, z3,
                                     offs_j, j_ok, t_ok, G, NG, Q, ROWS, Q_PAD)
        x0 = x0 * g0
        x1 = x1 * g1
        x2 = x2 * g2
        x3 = x3 * g3
        s0, s1, s2, s3, z0, z1, z2, z3 = _scale_zero_tiles(x0, x1, x2, x3, offs_j, j_ok, t_ok, s_dst, z_dst, G, NG,
                                                           Q, ROWS, Q_PAD, RECIP, UE5M3, True)

    packed = (_encode(x0, s0, z0) | (_encode(x1, s1, z1) << 2)
              | (_encode(x2, s2, z2) << 4) | (_encode(x3, s3, z3) << 6))
    c_dst = codes_ptr + page * stride_cp + h * stride_ch + row * stride_cr
    tl.store(c_dst[:, None] + offs_j[None, :], packed, mask=m2)


def _clip_threshold(x_rot: torch.Tensor, clip_idx: torch.Tensor) -> torch.Tensor:
    """tau `[T, H]` fp32: the `clip_idx[h]`-th smallest `|x|` of each row of `x_rot [T, H, d]` (0-based), by torch."""
    t, h, _ = x_rot.shape
    idx = clip_idx.long().view(1, h, 1).expand(t, h, 1)
    return x_rot.abs().sort(dim=-1).values.gather(-1, idx)[..., 0].contiguous()


def quantize_pack_into(x_rot: torch.Tensor, clip_ratio: torch.Tensor | None, codes: torch.Tensor,
                       scale: torch.Tensor, zero: torch.Tensor, page_ids: torch.Tensor, rows: torch.Tensor,
                       fmt: KVFormat, rows_per_program: int | None = None, clip_mode: str | None = None,
                       mean: torch.Tensor | None = None) -> None:
    """Launch the kernel (no input checks: the functional API in `runtime_kernels.quant` does them). The group,
    scale format and quantizer are `fmt`'s: the pools' dtypes are not read to guess them.

    Args:
        x_rot: fp32, bf16 or fp16 `[T, H, d]`, already rotated, last dim contiguous.
        clip_ratio: fp32 `[H]` contiguous clip ratio per head, or None for no clipping. The order-statistic index
            (`naive.clip_index`) is derived from it in the kernel ("kernel" mode: no small torch ops per call) or
            on the host ("torch" mode).
        codes: uint8 `[num_pages, H, P, d // 4]`; scale, zero: `[num_pages, H, P, d // G]`, fp16 both or uint8
            both (`fmt.scale_format` ue5m3), any strides for the first three dims, last dim contiguous.
        page_ids, rows: int `[T]` destination of each token.
        clip_mode: "kernel" (order statistic by `tl.sort` inside the kernel; default on CUDA) or "torch"
            (a torch sort before the kernel; default off-GPU, where the interpreter's `tl.sort` is very slow).
            Both give the same threshold.
        mean: fp32 `[H, d]` contiguous per-head mean subtracted before clipping (centered caches), or None.
    """
    t, h, d = x_rot.shape
    if t == 0:
        return
    q = d // 4
    group_size = fmt.group(d)
    ng = d // group_size
    rows_pp = rows_per_program or (16 if x_rot.is_cuda else 64)
    rows_pp = min(rows_pp, next_pow2(t))
    clip_mode = clip_mode or ("kernel" if x_rot.is_cuda else "torch")
    if clip_mode not in ("kernel", "torch"):
        raise ValueError(f"clip_mode: expected 'kernel' or 'torch', got {clip_mode!r}")
    mode, tau = 0, x_rot  # tau is an unused pointer unless mode == 2
    if clip_ratio is not None:
        mode = 1 if clip_mode == "kernel" else 2
        if mode == 2:
            xc = x_rot.float() if mean is None else x_rot.float() - mean
            tau = _clip_threshold(xc, naive.clip_index(clip_ratio.detach(), d))
    clip_arg = clip_ratio if clip_ratio is not None else page_ids  # an unused pointer when not clipping
    grid = (triton.cdiv(t, rows_pp), h)
    _quantize_pack_kernel[grid](
        x_rot, clip_arg, tau, codes, scale, zero, page_ids, rows, x_rot if mean is None else mean,
        t, x_rot.stride(0), x_rot.stride(1),
        codes.stride(0), codes.stride(1), codes.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        D=d, Q=q, G=group_size, NG=ng,
        D_PAD=next_pow2(d), Q_PAD=next_pow2(q), ROWS=rows_pp,
        CLIP=mode, RECIP=x_rot.is_cuda, MEAN=mean is not None, UE5M3=fmt.scale_format == "ue5m3",
        UNBIASED=fmt.quantizer == "uniform_unbiased", num_warps=4,
    )
