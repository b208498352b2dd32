"""Peak memory of the run: host (resident set, `getrusage`) and every visible CUDA device (allocator peak)."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory() -> dict:
    """`{"host_peak_bytes": int, "device_peak_bytes": {"cuda:0": int, ...}}` since the process started."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    host = rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes
    devices = {}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            devices[f"cuda:{i}"] = int(torch.cuda.max_memory_allocated(i))
    return {"host_peak_bytes": int(host), "device_peak_bytes": devices}
