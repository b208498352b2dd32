"""Readable torch reference for rotate -> clip -> INT2 quantize -> pack (OSCAR_METHOD sections 4-5).

Every Triton kernel in this package is tested against these functions; the evaluation in
`oscar_calib` simulates quantization with them too, so there is one definition of the quantizer.

Shapes: `x` is `[..., d]` (any leading dims, e.g. `[T, H_kv, d]`), rotations `[H_kv, d, d]` or `[d, d]`.
"""

from __future__ import annotations

import torch

from runtime_kernels.format import QUANTIZERS, SCALE_FORMATS, KVFormat  # noqa: F401 (QUANTIZERS: the contract reads it here)

LEVELS = 4  # 2 bits
# Floors of the fp16 scale, so that degenerate rows stay finite (all powers of two times small integers,
# so the torch reference and the Triton kernel compute them bit-identically):
# - SCALE_EPS: the smallest range; /3 gives 2^-14, the smallest normal fp16 (an all-zero row would otherwise
#   get scale 0 and NaN codes);
# - ZERO_LIMIT: the scale is at least max|x| / 2^15, so the zero point `-lo / scale` fits in fp16 (65504)
#   even for a nearly constant row far from 0.
SCALE_EPS = 3 * 2.0**-14
ZERO_LIMIT = 2.0**15

# Scale formats (`KVFormat.scale_format`, runtime_kernels.format.SCALE_FORMATS):
# - "float16": scale and zero point (in codes) in fp16, 32 bits per group;
# - "ue5m3": 16 bits per group, 2.125 bits per element at d = 128. The scale is an unsigned 8-bit float
#   (5 exponent bits, bias 15, 3 mantissa bits, no subnormals; within 6.25 % of the fp32 scale), the zero point a
#   uint8 in 1/64 of a code. Scales are kept in fp16's normal range [2^-14, 61440] (the decode kernel forms
#   p * scale in fp16). The range is widened to include 0 so the zero point
#   always lies in [0, 3] codes; a row crossing 0 (every centered rotated row in practice) is unchanged.
#   Codes are computed against the rounded scale and zero, so dequantization reproduces what was encoded.
SCALE_STORAGE = {"float16": torch.float16, "ue5m3": torch.uint8}  # format -> dtype of the scale and zero tensors
assert tuple(SCALE_STORAGE) == SCALE_FORMATS
UE5M3_MIN = 2.0**-14
UE5M3_MAX = 1.875 * 2.0**15
UE5M3_BIAS = (127 - 15) << 3  # fp32 exponent bias minus ue5m3's, in units of the 3-bit mantissa
ZERO_STEPS = 64  # ue5m3 zero points are stored in 1/64 of a code

# Quantizers (`KVFormat.quantizer`, runtime_kernels.format.QUANTIZERS; levels are uniform in both):
# - "uniform_minmax": each group's scale and zero span its (clipped) min and max;
# - "uniform_unbiased": the same, then each group is quantized again after multiplying the clipped group by the
#   gain `c = |x|^2 / <x, x_hat>` (x the unclipped group, x_hat its first dequantization), so that the stored
#   group keeps its projection on the original one: `<x, x_hat'> ~ |x|^2`. Clipping shrinks every group toward 0
#   along its own direction; for a query that matches a key (a retrieval), the logit `q . k_hat` then falls short
#   of `q . k` by that shrinkage, and far tokens lose attention to near ones. The gain undoes it at no bits.
#   It is computed in float64 and rounded to GAIN_STEPS, so the Triton kernel reproduces it bit for bit, and
#   kept in [GAIN_MIN, GAIN_MAX] (a group whose first pass is orthogonal to it keeps gain 1).
GAIN_STEPS = 2.0**16
GAIN_MIN, GAIN_MAX = 0.5, 2.0


def encode_ue5m3(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scale -> uint8 ue5m3 code, rounded to the nearest representable value (integer ops on the fp32 bits,
    so the Triton kernel reproduces it exactly)."""
    bits = scale.float().clamp(UE5M3_MIN, UE5M3_MAX).view(torch.int32)
    return (((bits + (1 << 19)) >> 20) - UE5M3_BIAS).clamp(0, 255).to(torch.uint8)


def decode_ue5m3(code: torch.Tensor) -> torch.Tensor:
    """uint8 ue5m3 code -> fp32 scale (exact)."""
    return ((code.to(torch.int32) + UE5M3_BIAS) << 20).view(torch.float32)


def clip_index(ratio: float | torch.Tensor, d: int) -> torch.Tensor:
    """Order-statistic index `c = min(floor(ratio * d), d - 1)` used for the clip threshold."""
    r = torch.as_tensor(ratio, dtype=torch.float64)
    return torch.clamp(torch.floor(r * d), max=d - 1).to(torch.int64)


def clip_rows(x: torch.Tensor, ratio: float | torch.Tensor, sorted_abs: torch.Tensor | None = None) -> torch.Tensor:
    """Clamp each row of `x [..., d]` to `[-tau, tau]`, `tau` = the c-th smallest `|x|` of the row.

    `ratio` is a scalar or broadcastable to `x.shape[:-1]` (e.g. `[H_kv]` for `x [T, H_kv, d]`).
    A ratio of 1 keeps the row unchanged (tau is then the row maximum).
    `sorted_abs`: `x.abs().sort(dim=-1).values`, when the caller clips the same rows at several ratios (the sort
    is most of the cost).
    """
    d = x.shape[-1]
    idx = clip_index(ratio, d).to(x.device)
    if sorted_abs is None:
        sorted_abs = x.abs().sort(dim=-1).values
    idx = idx.expand(x.shape[:-1]).unsqueeze(-1)
    tau = sorted_abs.gather(-1, idx)
    return torch.minimum(torch.maximum(x, -tau), tau)


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max INT2 per group of `fmt.group(d)` channels, scales in `fmt.scale_format`.

    Args:
        x: `[..., d]` float tensor.
    Returns:
        codes `[..., d]` uint8 in {0..3}; scale, zero `[..., d // G]`: float16 both, or uint8 both
        (ue5m3 scale code, zero point in 1/64 code).
    The arithmetic is done in fp32 with the rounded scale and zero, so dequantization with the
    stored values reproduces exactly what was encoded.
    """
    d = x.shape[-1]
    g = fmt.group(d)
    codes, scale, zero = quantize_groups(x.float().reshape(*x.shape[:-1], d // g, g), fmt)
    return codes.reshape(x.shape), scale, zero


def quantize_groups(xg: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize` of rows already split into groups, `xg [..., n, g]` fp32 (any g: a baseline that groups along
    tokens, not packed channels, uses it directly) -> codes `[..., n, g]` uint8, scale and zero `[..., n]` in
    `fmt.scale_format` (fmt's group is not read)."""
    lo = xg.amin(dim=-1)
    hi = xg.amax(dim=-1)
    if fmt.scale_format == "ue5m3":
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        scale = encode_ue5m3(torch.clamp(hi - lo, min=SCALE_EPS) / (LEVELS - 1))
        zero = torch.floor(-lo / decode_ue5m3(scale) * ZERO_STEPS + 0.5).clamp(0, 255).to(torch.uint8)
    else:
        scale = torch.clamp(hi - lo, min=SCALE_EPS) / (LEVELS - 1)
        scale = torch.maximum(scale, torch.maximum(lo.abs(), hi.abs()) * (1.0 / ZERO_LIMIT)).to(torch.float16)
        zero = (-lo / scale.float()).to(torch.float16)
    s, z = scale_zero_fp32(scale, zero, fmt)
    codes = torch.floor(xg / s.unsqueeze(-1) + z.unsqueeze(-1) + 0.5)
    return codes.clamp(0, LEVELS - 1).to(torch.uint8), scale, zero


def scale_zero_fp32(scale: torch.Tensor, zero: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored scale and zero in `fmt.scale_format` (fp16, or uint8 ue5m3 and 1/64 codes) -> fp32 scale and zero
    point in codes."""
    if fmt.scale_format == "ue5m3":
        return decode_ue5m3(scale), zero.float() * (1.0 / ZERO_STEPS)
    return scale.float(), zero.float()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: KVFormat,
               dtype=torch.float32) -> torch.Tensor:
    """Inverse of `quantize`: `(code - zero) * scale`, per group. Shapes as returned by `quantize`, scales in
    `fmt.scale_format` (the groups follow from the shapes)."""
    d = codes.shape[-1]
    n_groups = scale.shape[-1]
    g = d // n_groups
    s, z = scale_zero_fp32(scale, zero, fmt)
    c = codes.float().reshape(*codes.shape[:-1], n_groups, g)
    x = (c - z.unsqueeze(-1)) * s.unsqueeze(-1)
    return x.reshape(codes.shape).to(dtype)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Quarter-split packing: byte j of a row holds codes j, j+Q, j+2Q, j+3Q in bits 1:0, 3:2, 5:4, 7:6.

    codes `[..., d]` uint8 in {0..3}  ->  packed `[..., d // 4]` uint8.
    """
    d = codes.shape[-1]
    if d % 4:
        raise ValueError(f"pack: last dim must be a multiple of 4, got {d}")
    q = d // 4
    c = codes.to(torch.uint8)
    return c[..., :q] | (c[..., q:2 * q] << 2) | (c[..., 2 * q:3 * q] << 4) | (c[..., 3 * q:] << 6)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: `[..., d // 4]` uint8 -> `[..., d]` uint8 codes."""
    parts = [(packed >> shift) & 3 for shift in (0, 2, 4, 6)]
    return torch.cat(parts, dim=-1)


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """`x [T, H, d] @ R [H, d, d]` per head (or a shared `[d, d]`), in fp32."""
    r = rotation.float()
    if r.dim() == 2:
        return x.float() @ r
    return torch.einsum("thd,hde->the", x.float(), r)


def unbiased_gain(x: torch.Tensor, x_hat: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Gain `[..., d]` (one value per group, repeated over its channels) of the "uniform_unbiased" quantizer:
    `|x|^2 / <x, x_hat>` per group (`fmt.group(d)`) of `x, x_hat [..., d]`, in float64, rounded to 1/GAIN_STEPS, kept in
    [GAIN_MIN, GAIN_MAX]; 1 where `<x, x_hat>` is not positive."""
    d = x.shape[-1]
    g = fmt.group(d)
    xg = x.double().reshape(*x.shape[:-1], d // g, g)
    hg = x_hat.double().reshape(*x.shape[:-1], d // g, g)
    num = (xg * xg).sum(dim=-1)
    den = (xg * hg).sum(dim=-1)
    gain = torch.where(den > 0, num / den.clamp_min(1e-300), torch.ones_like(num))
    gain = (torch.floor(gain.clamp(GAIN_MIN, GAIN_MAX) * GAIN_STEPS + 0.5) / GAIN_STEPS).float()
    return gain.repeat_interleave(g, dim=-1)


def quantize_rows(xr: torch.Tensor, clip_ratio: torch.Tensor | float | None, fmt: KVFormat, *,
                  sorted_abs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clip and quantize rows already rotated (and centered) `xr [..., d]` with `fmt.quantizer` (QUANTIZERS).

    Returns codes `[..., d]`, scale and zero `[..., d // G]` as `quantize` does. `sorted_abs`: as in
    `clip_rows` (the same rows quantized at several clip ratios).
    """
    xc = clip_rows(xr, clip_ratio, sorted_abs) if clip_ratio is not None else xr.float()
    codes, scale, zero = quantize(xc, fmt)
    if fmt.quantizer == "uniform_minmax":
        return codes, scale, zero
    gain = unbiased_gain(xr, dequantize(codes, scale, zero, fmt), fmt)
    return quantize(xc * gain, fmt)


def quantize_pack(x: torch.Tensor, rotation: torch.Tensor | None, clip_ratio: torch.Tensor | float | None,
                  fmt: KVFormat, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full write path for one layer: rotate, (center,) clip, quantize, pack, as `fmt` encodes the history (its
    group, scale format and quantizer; the windows and pages are the cache's business).

    Args:
        x: `[T, H_kv, d]` keys (post-RoPE) or values.
        rotation: `[H_kv, d, d]` (None = identity).
        clip_ratio: `[H_kv]` or scalar (None or 1 = no clipping).
        mean: `[H_kv, d]` per-head mean in the rotated basis, subtracted before clipping (a centered cache);
            None = uncentered.
    Returns:
        packed `[T, H_kv, d // 4]` uint8, scale and zero `[T, H_kv, d // G]` (fp16, or uint8 for ue5m3).
    """
    xr = rotate(x, rotation) if rotation is not None else x.float()
    if mean is not None:
        xr = xr - mean.float()
    codes, scale, zero = quantize_rows(xr, clip_ratio, fmt)
    return pack(codes), scale, zero


def unpack_dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: KVFormat,
                      dtype=torch.float32) -> torch.Tensor:
    """`[..., d // 4]` packed + per-group scale/zero in `fmt.scale_format` -> rotated-space values `[..., d]`."""
    return dequantize(unpack(packed), scale, zero, fmt, dtype)


def fake_quantize(x: torch.Tensor, rotation: torch.Tensor | None, clip_ratio, fmt: KVFormat, unrotate: bool = True,
                  mean: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize `x [T, H_kv, d]` as `fmt` encodes it (centered by `mean [H_kv, d]` if given:
    dequant + mean); with `unrotate`, map back to the original basis."""
    packed, scale, zero = quantize_pack(x, rotation, clip_ratio, fmt, mean=mean)
    xr = unpack_dequantize(packed, scale, zero, fmt)
    if mean is not None:
        xr = xr + mean.float()
    if unrotate and rotation is not None:
        r = rotation.float()
        xr = xr @ r.transpose(-1, -2) if r.dim() == 2 else torch.einsum("the,hde->thd", xr, r)
    return xr.to(x.dtype)
