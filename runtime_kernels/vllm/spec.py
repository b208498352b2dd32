"""The KV cache spec of an INT2 layer on vLLM releases without `customize_spec` (0.26 on CUDA; docs/vllm.md).

vLLM sizes its KV cache, admits requests and reports its capacity from each layer's spec (`page_size_bytes`). Its
`FullAttentionSpec` counts `2 * head_size * dtype size` bytes per token and KV head; an INT2 layer stores a packed
cell of `PackedLayout.bytes_per_token_head` bytes instead (68 B at head_dim 128 with ue5m3 scales, 36 B at 64).
`OscarAttentionSpec` is a `FullAttentionSpec` whose page is `block_size * num_kv_heads * cell_bytes` bytes of
uint8, as vLLM's own `TQFullAttentionSpec` does for its packed slots: vLLM's spec registry groups it with full
attention (it walks the class's MRO), so the block manager, the scheduler and the capacity report treat it as
full attention with smaller pages.

Only vLLM's `kv_cache_interface` is imported: the engine-core process unpickles these specs without building
any attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec


@dataclass(frozen=True, kw_only=True)
class OscarAttentionSpec(FullAttentionSpec):
    """Full attention with one packed INT2 cell of `cell_bytes` per (token, KV head); `dtype` is uint8."""

    cell_bytes: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        if self.cell_bytes <= 0:
            raise ValueError(f"cell_bytes: expected the packed INT2 cell size (> 0), got {self.cell_bytes}")
        return self.block_size * self.num_kv_heads * self.cell_bytes

    @classmethod
    def merge(cls, specs):
        """vLLM's merge of one group's specs, keeping the cell size (FullAttentionSpec.merge rebuilds the
        dataclass from its own fields and would drop it)."""
        merged = super().merge(specs)
        cells = {s.cell_bytes for s in specs}
        if len(cells) != 1:
            raise AssertionError(f"OSCAR layers of one KV cache group must share one cell size, got {sorted(cells)}")
        return replace(merged, cell_bytes=cells.pop())


def int2_spec(dense: FullAttentionSpec, cell_bytes: int) -> OscarAttentionSpec:
    """The INT2 spec of a layer whose vLLM spec is `dense` (same block size, heads, head size and windows)."""
    return OscarAttentionSpec(block_size=dense.block_size, num_kv_heads=dense.num_kv_heads,
                              head_size=dense.head_size, head_size_v=dense.head_size_v, dtype=torch.uint8,
                              sliding_window=dense.sliding_window, attention_chunk_size=dense.attention_chunk_size,
                              cell_bytes=int(cell_bytes))


__all__ = ["OscarAttentionSpec", "int2_spec"]
