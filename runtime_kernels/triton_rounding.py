"""Rounding stores shared by the Triton kernels that write the model's dtype (`step_kernels`, the split reduce)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["store_rounded"]


@triton.jit
def store_rounded(ptr, y, mask):
    """Store fp32 `y` at `ptr`, rounded to nearest even into the pointer's dtype (fp16, bf16 or fp32), bit for bit as
    torch's `.to(dtype)` but for a NaN's payload (torch's own CPU and CUDA casts disagree there). bf16 is rounded by
    hand on the fp32 bits (c10's `round_to_nearest_even`, NaN -> 0x7FC0):
    the Triton interpreter truncates fp32 -> bf16, so an explicit rounding is the one way the CPU tests check the
    same bits a GPU stores."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        r = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        r = tl.where(y != y, 0x7FC0, r)
        tl.store(ptr.to(tl.pointer_type(tl.uint16), bitcast=True), r.to(tl.uint16), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)
