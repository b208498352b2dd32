"""Torch-only helpers for the pool layouts the decode kernel recognizes (no Triton import: the cache and the
artifact reader use them on machines without Triton)."""

from __future__ import annotations

import torch


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
