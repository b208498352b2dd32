"""The inputs of a decode call as three records (torch only, no Triton: the cache and the vLLM layout build them on
machines without Triton).

- `PagePools`: one layer's paged INT2 history (codes, scales, zero points, and the means of a centered cache).
- `Windows`: one layer's full-precision sink + recent windows.
- `BatchMetadata`: where each of the B sequences of a call reads (block table, history length, window slot and
  length) and whether every history is whole pages.

Shapes (H = KV heads, d = head_dim, G = group size, P = page size, W = window rows): see each record. The records hold
references, not copies; `runtime_kernels.attention` checks them (`validate=True`) and the Triton launcher reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime_kernels.format import KVFormat


@dataclass(frozen=True, kw_only=True)
class PagePools:
    """One layer's INT2 history pools, and the format they hold (views are fine: `runtime_kernels.vllm.layout.page_pools`
    slices one buffer). Built once per layer by their owner (`PagedKVCache` when it allocates or grows its pools, the
    vLLM engine per layer cache) and passed as is to every decode call.

    - k_codes, v_codes: uint8 `[num_pages, H, P, d // 4]` (quarter-split packing).
    - k_scale, k_zero, v_scale, v_zero: `[num_pages, H, P, d // G]`, stored as `fmt.scale_format` says: fp16 all four,
      or uint8 all four for ue5m3 (scale codes and zero points in 1/64 code). With one group per row, the four may be
      the quarters of one `[num_pages, H, P, 4]` buffer (`pools.alloc_quad_pools`, what the cache allocates), or V
      scale and zero the two halves of one `[num_pages, H, P, 2]` buffer (`pools.alloc_paired_v_pools`).
    - k_mean, v_mean: `[H, d]` means of a centered cache in the rotated basis (the pages hold quant(x - mean)), or
      None for both (uncentered).
    - fmt: the `KVFormat` of the pages: its scale format and centering are the decode mode the launcher plans with
      (`plan_decode` reads them here, never from tensor dtypes); `attention.decode_attention` checks that the pools
      are what it says (page size, groups, scale storage, means).
    """

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    fmt: KVFormat
    k_mean: torch.Tensor | None = None
    v_mean: torch.Tensor | None = None

    @property
    def centered(self) -> bool:
        """The pages hold x - mean (decode adds the means back): the format's centering."""
        return self.fmt.centered

    @property
    def scale_format(self) -> str:
        """The format's scale format ("float16" or "ue5m3")."""
        return self.fmt.scale_format

    @property
    def kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_codes.shape[2]


@dataclass(frozen=True)
class Windows:
    """One layer's full-precision windows, `k_win` and `v_win` `[num_slots, H, W, d]` (same dtype; rows
    `[0, win_len)` of a sequence's slot are valid)."""

    k_win: torch.Tensor
    v_win: torch.Tensor


@dataclass(frozen=True)
class BatchMetadata:
    """Where each of B sequences reads (int tensors on the pools' device).

    - block_table `[B, max_pages]`: token t of sequence b's history is row `t % P` of page `block_table[b, t // P]`.
    - hist_len `[B]`: history tokens.
    - slot_ids, win_len `[B]`: the window slot of each sequence and its valid rows.
    A history-only call (`int2_decode_attention`) needs no slot_ids / win_len, a window-only one no block_table /
    hist_len (None).
    - whole_pages: a promise that every hist_len is a multiple of the page size (PagedKVCache keeps it), which lets the
      production kernel skip all masking (the tokens of a partial last page would be ignored).
    """

    block_table: torch.Tensor | None = None
    hist_len: torch.Tensor | None = None
    slot_ids: torch.Tensor | None = None
    win_len: torch.Tensor | None = None
    whole_pages: bool = False

    @property
    def size(self) -> int:
        """B, the sequences of the batch."""
        t = self.hist_len if self.hist_len is not None else self.win_len
        return int(t.shape[0])


__all__ = ["BatchMetadata", "PagePools", "Windows"]
