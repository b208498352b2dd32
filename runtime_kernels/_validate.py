"""Input checks shared by the functional kernel APIs: every error names the tensor, the field and what was expected.

Only metadata is inspected (dtype, shape, device); nothing here reads tensor values, so the checks never
force a GPU synchronisation on the decode path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)


def normalize_device(device: torch.device | str) -> torch.device:
    """`"cuda"` -> `cuda:<current>`: tensors always carry an index, so a device kept for comparisons must too
    (`torch.device("cuda") != torch.device("cuda:0")`)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_tensor(name: str, t, *, dtypes: Sequence[torch.dtype] | None = None, ndim: int | None = None,
                 device: torch.device | None = None) -> None:
    """Raise TypeError/ValueError naming `name` when `t` is not a tensor of the expected dtype, rank or device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: dtype must be {want}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device} (all inputs must be on one device)")


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Raise ValueError when `t.shape[dim] != expected`; `what` says which quantity the size must match."""
    if t.shape[dim] != expected:
        raise ValueError(f"{name}: shape {tuple(t.shape)} has size {t.shape[dim]} at dim {dim}, "
                         f"expected {expected} ({what})")


def check_head_dim(name: str, d: int) -> None:
    """The quarter-split packing needs head_dim divisible by 4."""
    if d % 4:
        raise ValueError(f"{name}: head_dim must be a multiple of 4 for 2-bit packing, got {d}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto` -> `triton` on CUDA or when TRITON_INTERPRET=1 is set, else `torch`."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    if backend != "auto":
        if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' needs CUDA tensors or TRITON_INTERPRET=1; tensors are on {device}")
        return backend
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "torch"
