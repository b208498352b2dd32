"""Host-side helpers of the kernel launchers."""

from __future__ import annotations

import functools


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0, as Triton's): `triton.next_power_of_2` without its call overhead.
    That one is a ConstexprFunction and costs about 2.6 us per call from Python (Triton 3.6 and 3.9), and a decode
    call's launchers ask for a dozen block sizes."""
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


@functools.cache
def _pdl_capable(device_type: str, index: int | None) -> bool:
    import os

    import torch

    if device_type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(on: bool, device) -> dict:
    """Launch options for a programmatic dependent launch (PDL, sm_90+): the kernel's `PDL` constexpr (its
    `gdc_wait` / `gdc_launch_dependents` calls) and Triton's `launch_pdl` flag, or nothing when `on` is false or the
    launch cannot use it (CPU, the interpreter, GPUs before Hopper), so the kernel launches as usual."""
    if on and _pdl_capable(device.type, device.index):
        return {"PDL": True, "launch_pdl": True}
    return {}
