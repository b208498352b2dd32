"""Decode attention over the three-segment INT2 KV cache: the kernels, their reference and their launcher.

- `naive.py`: readable torch references of the paged layout (the definitions the kernels are tested against).
- `kernel.py`: the production INT2 history kernel; `fallback.py`: the plain one for inputs it does not take.
- `window.py`: attention over the BF16 windows; `fused.py`: history and window programs in one grid (with the
  split reduce in the same launch when asked); `merge.py`: the split reduce.
- `launch.py`: `DecodeOptions` and the host side (the launch plan `DecodePlan`, split counts, launches).
- `records.py`: a call's inputs as records, `PagePools`, `BatchMetadata`, `Windows` (no Triton import).
- `pools.py`: torch-only helpers for the interleaved scale/zero layouts, quad and paired V (no Triton import).
The bit tricks are explained in README.md. Importing this package does not import Triton; `launch` does.
"""

from runtime_kernels.attention.int2_decode.pools import (
    alloc_paired_v_pools,
    alloc_quad_pools,
    paired_v_pools,
    quad_pools,
)
from runtime_kernels.attention.int2_decode.records import BatchMetadata, PagePools, Windows

__all__ = ["BatchMetadata", "PagePools", "Windows", "alloc_paired_v_pools", "alloc_quad_pools", "paired_v_pools",
           "quad_pools"]
