"""Whether a cache's pools fit on their device, checked before any allocation.

The contract allows windows of up to 2^20 tokens (`format.MAX_WINDOW_TOKENS`), but the BF16 window of every sequence
slot and layer is allocated up front: `layers x slots x 2 (K, V) x H_kv x (sink + recent + page - 1) x d` elements.
At the contract's maximum that is hundreds of GiB for a real model, and the allocator's own error came at the first
cache update. `check_cache_fits` computes the bytes from the shapes and refuses, naming the windows and the size
they would need, when the device has less memory available.
"""

from __future__ import annotations

import torch

from runtime_kernels.format import KVFormat
from runtime_kernels.units import format_bytes


class CacheTooLargeError(ValueError):
    """The cache's pools (BF16 windows and INT2 pages) need more memory than the device has available."""


def available_bytes(device: torch.device) -> int | None:
    """Free memory on `device`: CUDA's free bytes, or the host's MemAvailable; None when unknown."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cache_bytes(fmt: KVFormat, *, num_layers: int, num_kv_heads: int, head_dim: int, max_pages: int, max_seqs: int,
                window_dtype: torch.dtype) -> tuple[int, int]:
    """(total bytes, window bytes) of a PagedKVCache's pools in format `fmt`: per layer, `max_seqs` BF16 window
    slots of `sink + recent + page_size - 1` rows (K and V) and `max_pages` INT2 pages of `page_size` tokens at
    `fmt.bytes_per_token(head_dim)` per (token, KV head)."""
    elem = torch.empty((), dtype=window_dtype).element_size()
    window_tokens = fmt.window_tokens + fmt.page_size - 1
    window = num_layers * 2 * max_seqs * num_kv_heads * window_tokens * head_dim * elem
    per_page = num_kv_heads * fmt.page_size * fmt.bytes_per_token(head_dim)
    return window + num_layers * max_pages * per_page, window


def check_fits(device: torch.device, need: int, describe) -> None:
    """Raise CacheTooLargeError(`describe(free)`) when `need` bytes exceed what `device` has available (unknown:
    nothing is refused)."""
    free = available_bytes(device)
    if free is not None and need > free:
        raise CacheTooLargeError(describe(free))


def check_cache_fits(device: torch.device, fmt: KVFormat, **shape) -> None:
    """Raise CacheTooLargeError when the pools of a cache in `fmt` of `shape` (see `cache_bytes`) exceed what `device`
    has."""
    total, window = cache_bytes(fmt, **shape)
    check_fits(device, total, lambda free: (
        f"field 'sink_tokens'/'recent_tokens': windows of {fmt.sink_tokens} + {fmt.recent_tokens} tokens need {window} "
        f"bytes ({format_bytes(window)}) of {str(shape['window_dtype']).replace('torch.', '')} windows for "
        f"{shape['max_seqs']} sequence slot(s) x {shape['num_layers']} layers, {total} bytes with the INT2 pages, but "
        f"{device} has {free} bytes ({format_bytes(free)}) available; serve with smaller sink_tokens/recent_tokens "
        "or fewer sequences"))


__all__ = ["CacheTooLargeError", "available_bytes", "cache_bytes", "check_cache_fits", "check_fits"]
