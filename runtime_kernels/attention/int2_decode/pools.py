"""Torch-only helpers for the pool layouts the decode kernel recognizes (no Triton import: the cache and the
artifact reader use them on machines without Triton).

With one scale/zero group per row, a row's four stored vectors (K scale, K zero, V scale, V zero) are one entry
each. Two interleaved layouts let the whole-page decode loop read them in fewer loads:
- quad: the four side by side, `[pages, H, P, 4]` (one 32-bit word per row for ue5m3, 8 bytes for fp16): one load
  per row brings all four (`PagedKVCache` allocates this; vLLM's packed cell has the same order);
- paired V: V scale and zero side by side, `[pages, H, P, 2]`, K scale and zero apart: two more loads per row.
"""

from __future__ import annotations

import torch


def alloc_quad_pools(pages: int, heads: int, page_size: int, device, zeros: bool = True,
                     dtype: torch.dtype = torch.uint8):
    """K scale, K zero, V scale, V zero pools `[pages, heads, page_size, 1]` (uint8 for ue5m3 scales, or fp16) as
    the four quarters of one `[..., 4]` buffer, the layout `quad_pools` recognizes -> (k_scale, k_zero, v_scale,
    v_zero)."""
    make = torch.zeros if zeros else torch.empty
    quad = make(pages, heads, page_size, 4, dtype=dtype, device=device)
    return quad[..., 0:1], quad[..., 1:2], quad[..., 2:3], quad[..., 3:4]


def quad_pools(k_scale, k_zero, v_scale, v_zero) -> bool:
    """True when the four pools are one row's four consecutive entries (K scale, K zero, V scale, V zero) of one
    buffer, with every row starting on a 4-entry boundary: `[pages, H, P, 1]` views with equal strides, each a
    multiple of 4, and an aligned start (the kernel reads a row's four entries as one 4- or 8-byte load)."""
    pools = (k_scale, k_zero, v_scale, v_zero)
    if any(p is None or p.dim() != 4 or p.shape[3] != 1 for p in pools):
        return False
    e = k_scale.element_size()
    return (all(p.dtype == k_scale.dtype and p.stride() == k_scale.stride() for p in pools)
            and all(s % 4 == 0 for s in k_scale.stride()[:3]) and k_scale.data_ptr() % (4 * e) == 0
            and all(p.data_ptr() == k_scale.data_ptr() + i * e for i, p in enumerate(pools)))


def alloc_paired_v_pools(pages: int, heads: int, page_size: int, device, zeros: bool = True,
                         dtype: torch.dtype = torch.float16):
    """V scale and zero pools `[pages, heads, page_size, 1]` (fp16, or uint8 for ue5m3 scales) as the two halves of
    one `[..., 2]` buffer (each row's scale and zero side by side), the layout `paired_v_pools` recognizes
    -> (v_scale, v_zero)."""
    make = torch.zeros if zeros else torch.empty
    pair = make(pages, heads, page_size, 2, dtype=dtype, device=device)
    return pair[..., 0:1], pair[..., 1:2]


def paired_v_pools(v_scale, v_zero) -> bool:
    """True when each V zero is the element right after its scale (one `[pages, H, P, 2]` buffer viewed as the two
    pools), so the whole-page loop reads both with one load."""
    return (v_scale is not None and v_zero is not None and v_scale.dim() == 4
            and v_scale.stride(2) == 2 and v_scale.stride() == v_zero.stride()
            and v_zero.data_ptr() == v_scale.data_ptr() + v_scale.element_size())
