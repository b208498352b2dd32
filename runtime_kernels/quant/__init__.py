"""INT2 KV quantization: functional API over the torch reference (`naive`) and the Triton kernel.

`backend="auto"` picks Triton for CUDA tensors or when TRITON_INTERPRET=1 is set, otherwise torch.
The rotation is always done by `naive.rotate` in fp32 (a torch matmul), so both backends see identical
rotated input and produce bit-identical codes, scales and zeros.
"""

from __future__ import annotations

import torch

from runtime_kernels._validate import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_dim,
    check_head_dim,
    check_tensor,
    resolve_backend,
)
from runtime_kernels.quant import naive

__all__ = ["naive", "quantize_pack", "scale_storage_dtype", "write_pages"]


def scale_storage_dtype(scale_format: str) -> torch.dtype:
    """dtype of the scale and zero pools for a scale format: fp16, or uint8 for ue5m3."""
    naive.scale_bits(scale_format)  # validates the name
    return naive.SCALE_STORAGE[scale_format]


def _check_common(x, rotation, clip_ratio, group_size) -> int:
    """Validate `x [T, H, d]`, `rotation [H, d, d]`, `clip_ratio [H]`; return the group size."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=3)
    t, h, d = x.shape
    check_head_dim("x", d)
    if rotation is not None:
        check_tensor("rotation", rotation, dtypes=FLOAT_DTYPES, ndim=3, device=x.device)
        if tuple(rotation.shape) != (h, d, d):
            raise ValueError(f"rotation: expected shape {(h, d, d)} (KV heads, head_dim, head_dim), "
                             f"got {tuple(rotation.shape)}")
    if clip_ratio is not None:
        check_tensor("clip_ratio", clip_ratio, dtypes=FLOAT_DTYPES, ndim=1, device=x.device)
        check_dim("clip_ratio", clip_ratio, 0, h, "number of KV heads of x")
    g = group_size or d
    if g <= 0 or d % g:
        raise ValueError(f"group_size: must divide head_dim={d}, got {group_size}")
    return g


def _rotated(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """`[T, H, d]` in the rotated basis with its last dim contiguous, as the kernel reads it: fp32 after a rotation;
    without one, x itself where it can (the kernel widens bf16/fp16 itself: no cast launch per demoted page)."""
    if rotation is not None:
        return naive.rotate(x, rotation).contiguous()
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_mean(mean, x) -> torch.Tensor | None:
    """A centered cache's mean `[H, d]` (rotated basis) as the kernel reads it: fp32, contiguous; None passes."""
    if mean is None:
        return None
    t, h, d = x.shape
    check_tensor("mean", mean, dtypes=FLOAT_DTYPES, ndim=2, device=x.device)
    if tuple(mean.shape) != (h, d):
        raise ValueError(f"mean: expected shape {(h, d)} (KV heads, head_dim), got {tuple(mean.shape)}")
    return mean if mean.dtype == torch.float32 and mean.is_contiguous() else mean.float().contiguous()


def _ratio(clip_ratio: torch.Tensor | None) -> torch.Tensor | None:
    """The clip ratio per head as the kernel reads it: fp32, contiguous (no copy when it already is)."""
    if clip_ratio is None:
        return None
    r = clip_ratio.detach()
    return r if r.dtype == torch.float32 and r.is_contiguous() else r.float().contiguous()


def quantize_pack(x: torch.Tensor, rotation: torch.Tensor | None, clip_ratio: torch.Tensor | None,
                  group_size: int | None = None, backend: str = "auto", mean: torch.Tensor | None = None, *,
                  scale_format: str, quantizer: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate, (center,) clip, quantize to 2 bits and pack.

    Args:
        x: `[T, H, d]` keys (post-RoPE) or values, fp16/bf16/fp32; d a multiple of 4.
        rotation: `[H, d, d]` or None (identity); clip_ratio: `[H]` or None (no clipping).
        group_size: channels per scale/zero group (default d).
        mean: `[H, d]` per-head mean in the rotated basis, subtracted before clipping (centered caches), or None.
        scale_format: "float16" or "ue5m3" (`naive.SCALE_FORMATS`).
        quantizer: "uniform_minmax" or "uniform_unbiased" (`naive.QUANTIZERS`).
    Returns:
        packed uint8 `[T, H, d // 4]`, scale and zero `[T, H, d // G]` (fp16, or uint8 for ue5m3).
    """
    g = _check_common(x, rotation, clip_ratio, group_size)
    mean = _check_mean(mean, x)
    naive.check_quantizer(quantizer)
    if resolve_backend(backend, x.device) == "torch":
        return naive.quantize_pack(x, rotation, clip_ratio, g, mean=mean, scale_format=scale_format,
                                   quantizer=quantizer)
    t, h, d = x.shape
    xr = _rotated(x, rotation)
    codes = torch.empty(t, h, 1, d // 4, dtype=torch.uint8, device=x.device)
    scale = torch.empty(t, h, 1, d // g, dtype=scale_storage_dtype(scale_format), device=x.device)
    zero = torch.empty_like(scale)
    idx = torch.arange(t, dtype=torch.int32, device=x.device)
    from runtime_kernels.quant.triton_quant import quantize_pack_into

    quantize_pack_into(xr, _ratio(clip_ratio), codes, scale, zero, idx, torch.zeros_like(idx), g, mean=mean,
                       quantizer=quantizer)
    return codes[:, :, 0], scale[:, :, 0], zero[:, :, 0]


def write_pages(x: torch.Tensor, rotation: torch.Tensor | None, clip_ratio: torch.Tensor | None,
                codes_pool: torch.Tensor, scale_pool: torch.Tensor, zero_pool: torch.Tensor,
                page_ids: torch.Tensor, rows: torch.Tensor, group_size: int | None = None,
                backend: str = "auto", mean: torch.Tensor | None = None, *, quantizer: str) -> None:
    """Quantize `x [T, H, d]` and scatter token t into `pool[page_ids[t], :, rows[t]]`, in place.

    Args:
        codes_pool: uint8 `[num_pages, H, P, d // 4]`; scale_pool, zero_pool: `[num_pages, H, P, d // G]`, fp16
            both, or uint8 both for the ue5m3 scale format (the pools' dtype selects it).
        page_ids, rows: int32/int64 `[T]` (values are not range-checked here: that would sync the GPU).
        mean: `[H, d]` per-head mean in the rotated basis, subtracted before clipping (centered caches), or None.
        quantizer: one of `naive.QUANTIZERS`.
    """
    g = _check_common(x, rotation, clip_ratio, group_size)
    mean = _check_mean(mean, x)
    naive.check_quantizer(quantizer)
    t, h, d = x.shape
    check_tensor("codes_pool", codes_pool, dtypes=(torch.uint8,), ndim=4, device=x.device)
    check_tensor("scale_pool", scale_pool, dtypes=tuple(naive.SCALE_STORAGE.values()), ndim=4, device=x.device)
    check_tensor("zero_pool", zero_pool, dtypes=(scale_pool.dtype,), ndim=4, device=x.device)
    check_dim("codes_pool", codes_pool, 1, h, "KV heads of x")
    check_dim("codes_pool", codes_pool, 3, d // 4, "head_dim // 4 packed bytes")
    for name, pool in (("scale_pool", scale_pool), ("zero_pool", zero_pool)):
        if tuple(pool.shape) != tuple(codes_pool.shape[:3]) + (d // g,):
            raise ValueError(f"{name}: expected shape {tuple(codes_pool.shape[:3]) + (d // g,)} "
                             f"(pages, KV heads, page size, head_dim // group_size), got {tuple(pool.shape)}")
        if pool.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous")
    if codes_pool.stride(-1) != 1:
        raise ValueError("codes_pool: last dim must be contiguous")
    for name, ix in (("page_ids", page_ids), ("rows", rows)):
        check_tensor(name, ix, dtypes=INT_DTYPES, ndim=1, device=x.device)
        check_dim(name, ix, 0, t, "one entry per token of x")
    if resolve_backend(backend, x.device) == "torch":
        from runtime_kernels.attention.int2_decode.naive import write_pages_ref

        write_pages_ref(x, rotation, clip_ratio, codes_pool, scale_pool, zero_pool, page_ids, rows, g, mean,
                        scale_format=naive.scale_format_of(scale_pool.dtype), quantizer=quantizer)
        return
    from runtime_kernels.quant.triton_quant import quantize_pack_into

    quantize_pack_into(_rotated(x, rotation), _ratio(clip_ratio), codes_pool, scale_pool, zero_pool,
                       page_ids.contiguous(), rows.contiguous(), g, mean=mean, quantizer=quantizer)
