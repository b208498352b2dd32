"""Bytes of one vLLM KV block for the INT2 cache, and their views as the kernels' page pools.

A vLLM layer cache for this backend is `[num_blocks, H, P, C]` (vLLM's `LBHNC` layout: block, KV head, token,
content) with `C = PackedLayout.bytes_per_token_head` bytes per (token, KV head):

    [ K codes d/4 | V codes d/4 | K scale | K zero | V scale | V zero ]   (scale/zero d/G each)

Scale and zero are fp16 (the `float16` scale format) or one byte each (`ue5m3`): 72 or 68 bytes at d = 128 and
one group per row (`KVFormat.bytes_per_token`), against `2 * d * 2 = 512` for BF16 K+V. The views keep the last dim
contiguous, as `runtime_kernels.quant.write_pages` and `runtime_kernels.attention.decode_attention` need. With one
group per row the cell's last four entries are a quad (`attention.int2_decode.pools.quad_pools`: 68- and 72-byte
cells keep them 4-entry aligned), which the whole-page decode loop reads with one load per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime_kernels.attention.int2_decode.records import PagePools
from runtime_kernels.format import KVFormat
from runtime_kernels.quant.naive import SCALE_STORAGE


@dataclass(frozen=True)
class PackedLayout:
    """Geometry of the packed cell of one (token, KV head) of a cache in format `fmt` at head_dim d: its group size
    (divides d) and scale format (`float16`: 2 bytes each for scale and zero; `ue5m3`: 1 byte each)."""

    fmt: KVFormat
    head_dim: int

    def __post_init__(self) -> None:
        d = self.head_dim
        if not isinstance(self.fmt, KVFormat):
            raise TypeError(f"fmt: expected a KVFormat, got {type(self.fmt).__name__}")
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0 or d % 4:
            raise ValueError(f"head_dim: expected a positive multiple of 4 for 2-bit packing, got {d}")
        self.fmt.group(d)  # KVFormatError naming group_size when it does not divide head_dim

    @property
    def group_size(self) -> int:
        return self.fmt.group(self.head_dim)

    @property
    def scale_dtype(self) -> torch.dtype:
        """dtype of the scale and zero views: fp16, or uint8 for ue5m3."""
        return SCALE_STORAGE[self.fmt.scale_format]

    @property
    def code_bytes(self) -> int:
        """Packed bytes of one row of codes (K or V): 4 codes per byte."""
        return self.head_dim // 4

    @property
    def groups(self) -> int:
        return self.head_dim // self.group_size

    @property
    def bytes_per_token_head(self) -> int:
        """K and V codes plus four vectors (K scale/zero, V scale/zero) of d/G entries of the scale dtype."""
        return self.fmt.bytes_per_token(self.head_dim)

    @staticmethod
    def bf16_bytes_per_token_head(head_dim: int) -> int:
        """What vLLM's own BF16 cache stores per (token, KV head): K and V, 2 bytes each."""
        return 2 * head_dim * 2


def page_pools(kv_cache: torch.Tensor, layout: PackedLayout) -> PagePools:
    """Views of a vLLM layer cache `[num_blocks, H, P, C]` (any dtype, C * itemsize = bytes_per_token_head) as the
    decode kernels' `PagePools` in the layout's format (no copy; no means: the engine adds a centered layer's with
    `dataclasses.replace`).

    Raises ValueError naming `kv_cache` when its shape or strides do not match the layout.
    """
    if kv_cache.dim() != 4:
        raise ValueError(f"kv_cache: expected [num_blocks, kv_heads, block_size, content], got {list(kv_cache.shape)}")
    raw = kv_cache.view(torch.uint8)  # the cells as bytes, whatever dtype vLLM allocated them in
    want = layout.bytes_per_token_head
    if raw.shape[-1] != want:
        raise ValueError(f"kv_cache: expected {want} bytes per (token, KV head) for head_dim={layout.head_dim}, "
                         f"group_size={layout.group_size}, got {raw.shape[-1]}")
    if raw.stride(-1) != 1 or raw.stride(-2) != want:
        raise ValueError(f"kv_cache: tokens of a block must be contiguous cells of {want} bytes, "
                         f"got strides {raw.stride()}")
    c, g = layout.code_bytes, layout.groups
    sd = layout.scale_dtype
    sc = raw.view(sd)  # [B, H, P, want // itemsize]; the scales start at byte 2c = index 2c // itemsize
    o = 2 * c // sd.itemsize
    return PagePools(
        k_codes=raw[..., :c], v_codes=raw[..., c:2 * c],
        k_scale=sc[..., o:o + g], k_zero=sc[..., o + g:o + 2 * g],
        v_scale=sc[..., o + 2 * g:o + 3 * g], v_zero=sc[..., o + 3 * g:o + 4 * g], fmt=layout.fmt)


__all__ = ["PackedLayout", "PagePools", "page_pools"]
