"""Readable torch reference for rotate -> clip -> INT2 quantize -> pack (OSCAR_METHOD sections 4-5).

Every Triton kernel in this package is tested against these functions; the evaluation in
`oscar_calib` simulates quantization with them too, so there is one definition of the quantizer.

Shapes: `x` is `[..., d]` (any leading dims, e.g. `[T, H_kv, d]`), rotations `[H_kv, d, d]` or `[d, d]`.
"""

from __future__ import annotations

import torch

LEVELS = 4  # 2 bits
# Floors of the fp16 scale, so that degenerate rows stay finite (all powers of two times small integers,
# so the torch reference and the Triton kernel compute them bit-identically):
# - SCALE_EPS: the smallest range; /3 gives 2^-14, the smallest normal fp16 (an all-zero row would otherwise
#   get scale 0 and NaN codes);
# - ZERO_LIMIT: the scale is at least max|x| / 2^15, so the zero point `-lo / scale` fits in fp16 (65504)
#   even for a nearly constant row far from 0.
SCALE_EPS = 3 * 2.0**-14
ZERO_LIMIT = 2.0**15


def clip_index(ratio: float | torch.Tensor, d: int) -> torch.Tensor:
    """Order-statistic index `c = min(floor(ratio * d), d - 1)` used for the clip threshold."""
    r = torch.as_tensor(ratio, dtype=torch.float64)
    return torch.clamp(torch.floor(r * d), max=d - 1).to(torch.int64)


def clip_rows(x: torch.Tensor, ratio: float | torch.Tensor) -> torch.Tensor:
    """Clamp each row of `x [..., d]` to `[-tau, tau]`, `tau` = the c-th smallest `|x|` of the row.

    `ratio` is a scalar or broadcastable to `x.shape[:-1]` (e.g. `[H_kv]` for `x [T, H_kv, d]`).
    A ratio of 1 keeps the row unchanged (tau is then the row maximum).
    """
    d = x.shape[-1]
    idx = clip_index(ratio, d).to(x.device)
    sorted_abs = x.abs().sort(dim=-1).values
    idx = idx.expand(x.shape[:-1]).unsqueeze(-1)
    tau = sorted_abs.gather(-1, idx)
    return torch.minimum(torch.maximum(x, -tau), tau)


def quantize(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max INT2 per group of `group_size` channels.

    Args:
        x: `[..., d]` float tensor.
    Returns:
        codes `[..., d]` uint8 in {0..3}; scale, zero `[..., d // group_size]` float16.
    The arithmetic is done in fp32 with the fp16-rounded scale and zero, so dequantization with the
    stored values reproduces exactly what was encoded.
    """
    d = x.shape[-1]
    g = group_size or d
    if d % g:
        raise ValueError(f"group_size={g} must divide head_dim={d}")
    xg = x.float().reshape(*x.shape[:-1], d // g, g)
    lo = xg.amin(dim=-1)
    hi = xg.amax(dim=-1)
    scale = torch.clamp(hi - lo, min=SCALE_EPS) / (LEVELS - 1)
    scale = torch.maximum(scale, torch.maximum(lo.abs(), hi.abs()) * (1.0 / ZERO_LIMIT)).to(torch.float16)
    zero = (-lo / scale.float()).to(torch.float16)
    codes = torch.floor(xg / scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1) + 0.5)
    codes = codes.clamp(0, LEVELS - 1).to(torch.uint8).reshape(x.shape)
    return codes, scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of `quantize`: `(code - zero) * scale`, per group. Shapes as returned by `quantize`."""
    d = codes.shape[-1]
    n_groups = scale.shape[-1]
    g = d // n_groups
    c = codes.float().reshape(*codes.shape[:-1], n_groups, g)
    x = (c - zero.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)
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


def quantize_pack(x: torch.Tensor, rotation: torch.Tensor | None, clip_ratio: torch.Tensor | float | None,
                  group_size: int | None = None, mean: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full write path for one layer: rotate, (center,) clip, quantize, pack.

    Args:
        x: `[T, H_kv, d]` keys (post-RoPE) or values.
        rotation: `[H_kv, d, d]` (None = identity).
        clip_ratio: `[H_kv]` or scalar (None or 1 = no clipping).
        mean: `[H_kv, d]` per-head mean in the rotated basis, subtracted before clipping (a centered cache);
            None = uncentered.
    Returns:
        packed `[T, H_kv, d // 4]` uint8, scale and zero `[T, H_kv, d // group_size]` fp16.
    """
    xr = rotate(x, rotation) if rotation is not None else x.float()
    if mean is not None:
        xr = xr - mean.float()
    if clip_ratio is not None:
        xr = clip_rows(xr, clip_ratio)
    codes, scale, zero = quantize(xr, group_size)
    return pack(codes), scale, zero


def unpack_dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      dtype=torch.float32) -> torch.Tensor:
    """`[..., d // 4]` packed + per-group scale/zero -> rotated-space values `[..., d]`."""
    return dequantize(unpack(packed), scale, zero, dtype)


def fake_quantize(x: torch.Tensor, rotation: torch.Tensor | None, clip_ratio, group_size: int | None = None,
                  unrotate: bool = True, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize `x [T, H_kv, d]` (centered by `mean [H_kv, d]` if given: dequant + mean); with
    `unrotate`, map back to the original basis."""
    packed, scale, zero = quantize_pack(x, rotation, clip_ratio, group_size, mean=mean)
    xr = unpack_dequantize(packed, scale, zero)
    if mean is not None:
        xr = xr + mean.float()
    if unrotate and rotation is not None:
        r = rotation.float()
        xr = xr @ r.transpose(-1, -2) if r.dim() == 2 else torch.einsum("the,hde->thd", xr, r)
    return xr.to(x.dtype)
