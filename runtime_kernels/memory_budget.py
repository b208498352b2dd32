"""Whether a cache's pools fit on their device, checked before any allocation.

The contract allows windows of up to 2^20 tokens (`format.MAX_WINDOW_TOKENS`), but the BF16 window of every sequence
slot and layer is allocated up front: `layers x slots x 2 (K, V) x H_kv x (sink + recent + page - 1) x d` elements.
At the contract's maximum that is hundreds of GiB for a real model, and the allocator's own error came at the first
cache update. `check_cache_fits` computes the bytes from the shapes and refuses, naming the windows and the size
they would need, when the device has less memory available.

On the CPU, "available" is the smallest of the host's MemAvailable and this process's own limits: the soft
RLIMIT_AS (`ulimit -v`) and RLIMIT_DATA (`ulimit -d`) less what the process already maps, and its cgroup's
`memory.max` less `memory.current`. Under `ulimit -v` the allocator's raw error came out instead of this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime_kernels.format import KVFormat
from runtime_kernels.units import format_bytes


class CacheTooLargeError(ValueError):
    """The cache's pools (BF16 windows and INT2 pages) need more memory than the device has available."""


def _kib_field(path: str, name: str) -> int | None:
    """`name:   N kB` of a /proc file, in bytes (None when absent or unreadable)."""
    try:
        with open(path, encoding="ascii") as handle:
            for line in handle:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rlimit_room() -> list[tuple[int, str]]:
    """(bytes left, which limit) under the soft RLIMIT_AS and RLIMIT_DATA that are set."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return []
    out = []
    for which, used_field, label in ((resource.RLIMIT_AS, "VmSize", "RLIMIT_AS (ulimit -v)"),
                                     (resource.RLIMIT_DATA, "VmData", "RLIMIT_DATA (ulimit -d)")):
        try:
            soft, _ = resource.getrlimit(which)
        except (OSError, ValueError):
            continue
        if soft == resource.RLIM_INFINITY or soft < 0:
            continue
        used = _kib_field("/proc/self/status", used_field) or 0
        out.append((max(0, soft - used), label))
    return out


def _cgroup_room() -> list[tuple[int, str]]:
    """(bytes left, which file) for a cgroup memory limit on this process, v2 (`memory.max` less `memory.current`)
    or v1 (`memory.limit_in_bytes` less `memory.usage_in_bytes`), looked up at the process's cgroup path and at the
    mount's root (a container sees its own cgroup there)."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as handle:
            lines = [line.rstrip("\n").split(":", 2) for line in handle]
    except OSError:
        return []
    places = []
    for parts in lines:
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":
            places += [("/sys/fs/cgroup" + rel.rstrip("/"), "memory.max", "memory.current")]
        elif "memory" in controllers.split(","):
            for base in ("/sys/fs/cgroup/memory" + rel.rstrip("/"), "/sys/fs/cgroup/memory"):
                places.append((base, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    for base, limit_file, usage_file in places:
        try:
            with open(f"{base}/{limit_file}", encoding="ascii") as handle:
                limit = handle.read().strip()
            with open(f"{base}/{usage_file}", encoding="ascii") as handle:
                current = int(handle.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # v1 writes "no limit" as ~2^63
            return [(max(0, int(limit) - current), f"cgroup {limit_file} ({base})")]
    return []


def available_with_source(device: torch.device) -> tuple[int, str] | None:
    """(free bytes on `device`, what sets them): CUDA's free bytes, or on the CPU the smallest of MemAvailable
    and this process's limits (rlimits, cgroup); None when unknown."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0]), "CUDA free memory"
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    candidates = _rlimit_room() + _cgroup_room()
    host = _kib_field("/proc/meminfo", "MemAvailable")
    if host is not None:
        candidates.append((host, "the host's MemAvailable"))
    return min(candidates) if candidates else None


def available_bytes(device: torch.device) -> int | None:
    """Free memory on `device` (`available_with_source`); None when unknown."""
    found = available_with_source(device)
    return None if found is None else found[0]


def cache_bytes(fmt: KVFormat, *, num_layers: int, num_kv_heads: int, head_dim: int, max_pages: int, max_seqs: int,
                window_dtype: torch.dtype) -> tuple[int, int]:
    """(total bytes, window bytes) of a PagedKVCache's pools in format `fmt`: per layer, `max_seqs` BF16 window
    slots of `sink + recent + page_size - 1` rows (K and V) and `max_pages` INT2 pages of `page_size` tokens at
    `fmt.bytes_per_token(head_dim)` per (token, KV head)."""
    elem = torch.empty((), dtype=window_dtype).element_size()
    window_tokens = fmt.window_rows
    window = num_layers * 2 * max_seqs * num_kv_heads * window_tokens * head_dim * elem
    per_page = num_kv_heads * fmt.page_size * fmt.bytes_per_token(head_dim)
    return window + num_layers * max_pages * per_page, window


def check_fits(device: torch.device, need: int, describe) -> None:
    """Raise CacheTooLargeError(`describe(free)`) when `need` bytes exceed what `device` has available (unknown:
    nothing is refused)."""
    found = available_with_source(device)
    if found is not None and need > found[0]:
        raise CacheTooLargeError(f"{describe(found[0])} (the limit: {found[1]})")


@dataclass(frozen=True)
class CheckedFit:
    """A passed `check_cache_fits`: room was found on `device` for `nbytes`. A cache allocated later within it
    (`covers`) is not checked again: `OscarCache` checks at construction and hands this to the pools it allocates
    at the first update."""

    device: torch.device
    nbytes: int

    def covers(self, device: torch.device, nbytes: int) -> bool:
        return device == self.device and nbytes <= self.nbytes


def check_cache_fits(device: torch.device, fmt: KVFormat, **shape) -> CheckedFit:
    """Raise CacheTooLargeError when the pools of a cache in `fmt` of `shape` (see `cache_bytes`) exceed what `device`
    has; else return the `CheckedFit` (the device and the bytes checked)."""
    total, window = cache_bytes(fmt, **shape)
    check_fits(device, total, lambda free: (
        f"field 'sink_tokens'/'recent_tokens': windows of {fmt.sink_tokens} + {fmt.recent_tokens} tokens need {window} "
        f"bytes ({format_bytes(window)}) of {str(shape['window_dtype']).replace('torch.', '')} windows for "
        f"{shape['max_seqs']} sequence slot(s) x {shape['num_layers']} layers, {total} bytes with the INT2 pages, but "
        f"{device} has {free} bytes ({format_bytes(free)}) available; serve with smaller sink_tokens/recent_tokens "
        "or fewer sequences"))
    return CheckedFit(device, total)


__all__ = ["CacheTooLargeError", "CheckedFit", "available_bytes", "available_with_source", "cache_bytes", "check_cache_fits", "check_fits"]
