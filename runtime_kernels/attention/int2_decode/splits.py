"""How many programs a decode call launches: history and window split counts, from shapes and (on a GPU) the compiled
kernel's occupancy (`programs_per_sm_limit`). Never syncs the GPU. `launch.py` compiles the kernels whose occupancy
`cached_slots` asks for.
"""

from __future__ import annotations

import torch

from runtime_kernels.attention.int2_decode.options import DecodeOptions
from runtime_kernels.attention.int2_decode.records import BatchMetadata, PagePools, Windows

_SM_COUNT: dict[int, int] = {}  # device index -> SM count (a cache, not a switch)
_SLOTS: dict[tuple, int] = {}  # compiled-kernel key -> programs resident per SM


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 4 under the interpreter (a few splits, enough to exercise the reduce)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def max_chunks(max_tokens: int, block_n: int, min_tokens: int) -> int:
    """The most splits a sequence of `max_tokens` takes: no chunk shorter than max(min_tokens, block_n)."""
    return max(1, -(-max_tokens // max(min_tokens, block_n)))


def default_num_splits(batch: int, kv_heads: int, max_tokens: int, device: torch.device, programs_per_sm: int,
                       block_n: int, min_tokens: int) -> int:
    """Splits per (sequence, KV head) so that about `programs_per_sm` programs run per SM, never a chunk shorter
    than `max(min_tokens, block_n)` tokens. From shapes only (capacity of the block table): never syncs the GPU."""
    want = -(-programs_per_sm * sm_count(device) // max(1, batch * kv_heads))
    return max(1, min(max_chunks(max_tokens, block_n, min_tokens), want))


def splits_for_slots(q, pages: PagePools, batch: BatchMetadata, slots: int | None, opts: DecodeOptions) -> int:
    """History splits: `opts.waves` whole waves of `slots` programs per SM, or the fixed rule where slots is None."""
    b, h_kv, max_tokens = q.shape[0], pages.kv_heads, batch.block_table.shape[1] * pages.page_size
    if slots is None:
        return default_num_splits(b, h_kv, max_tokens, q.device, opts.programs_per_sm, opts.block_n,
                                  opts.min_split_tokens)
    waves = int(opts.waves * slots * sm_count(q.device)) // max(1, b * h_kv)
    return max(1, min(max_chunks(max_tokens, opts.block_n, opts.min_split_tokens), waves))


def window_num_splits(q, windows: Windows, opts: DecodeOptions) -> int:
    """Window splits of the three-launch path (tiles of block_n rows)."""
    k_win = windows.k_win
    return default_num_splits(q.shape[0], k_win.shape[1], k_win.shape[2], q.device, 8, opts.block_n, opts.block_n)


def grid_window_splits(win_capacity: int, opts: DecodeOptions) -> int:
    """Window programs per (sequence, KV head) in the production grid: `window_split_tokens` rows each."""
    return max(1, -(-win_capacity // opts.window_split_tokens))


def programs_per_sm_limit(n_regs: int, shared_bytes: int, num_warps: int, regs_per_sm: int = 65536,
                          smem_per_sm: int = 233472, threads_per_sm: int = 2048, max_blocks: int = 32) -> int:
    """Programs of a compiled kernel that one SM holds at once: the tightest of registers, shared memory (1 KiB
    reserved per block), threads and the block limit. Defaults: Hopper. Registers follow CUDA's occupancy rules:
    allocated per warp in units of 256, and a warp's registers come from one of the SM's 4 sub-partitions, so
    warps per SM = 4 * floor(regs_per_sm / 4 / regs_per_warp) (136 registers: 12 warps, not 15)."""
    regs_per_warp = -(-max(1, n_regs) * 32 // 256) * 256
    by_regs = 4 * (regs_per_sm // 4 // regs_per_warp) // num_warps
    by_smem = smem_per_sm // (shared_bytes + 1024)
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(max_blocks, by_regs, by_smem, by_threads))


def _slots_of(compiled, num_warps: int, device) -> int:
    """Programs per SM of a compiled kernel on `device`."""
    props = torch.cuda.get_device_properties(device)
    if getattr(compiled, "n_regs", None) is None:  # a kernel compiled by `warmup` loads (and counts) lazily
        compiled._init_handles()
    return programs_per_sm_limit(int(compiled.n_regs), int(compiled.metadata.shared), num_warps,
                                 int(getattr(props, "regs_per_multiprocessor", 65536)),
                                 int(getattr(props, "shared_memory_per_multiprocessor", 233472)),
                                 int(getattr(props, "max_threads_per_multi_processor", 2048)))


def cached_slots(key: tuple, compile_only, num_warps: int, device) -> int:
    """Programs per SM of the kernel that `compile_only()` compiles (without launching), once per `key`."""
    if key not in _SLOTS:
        _SLOTS[key] = _slots_of(compile_only(), num_warps, device)
    return _SLOTS[key]



__all__ = ["cached_slots", "default_num_splits", "grid_window_splits", "max_chunks", "programs_per_sm_limit",
           "sm_count", "splits_for_slots", "window_num_splits"]
