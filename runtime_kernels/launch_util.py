"""Host-side helpers of the kernel launchers."""

from __future__ import annotations

import functools
import os


@functools.cache
def interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1, read once: Triton itself reads it at import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0, as Triton's): `triton.next_power_of_2` without its call overhead.
    That one is a ConstexprFunction and costs about 2.6 us per call from Python (Triton 3.6 and 3.9), and a decode
    call's launchers ask for a dozen block sizes."""
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0
