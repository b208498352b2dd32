"""Programmatic dependent launch (PDL, Hopper and later) for the three-launch decode path.

A kernel launched with PDL may start while the kernel before it in the stream is still running: it must call
`gdc_wait()` before it reads what that kernel wrote (and before it writes memory that kernel may still use); the
earlier kernel lets it start early with `gdc_launch_dependents()`. Both are no-ops in a kernel launched without
PDL; the kernels here call them only behind a `PDL` compile-time flag, never under the Triton interpreter.
"""

from __future__ import annotations

import os

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_SUPPORTED: dict[int, bool] = {}


def pdl_supported(device) -> bool:
    """PDL needs a CUDA device of compute capability 9.0 or later (and not the interpreter)."""
    import torch

    if INTERPRET or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SUPPORTED:
        _SUPPORTED[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return _SUPPORTED[idx]


def pdl_launch(on: bool) -> dict:
    """Launch keyword arguments of a kernel with a `PDL` flag: launched as a programmatic dependent when `on` (the
    caller checked `pdl_supported`), else nothing."""
    return {"launch_pdl": True, "PDL": True} if on else {}
