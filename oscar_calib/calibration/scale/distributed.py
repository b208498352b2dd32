"""Data parallel through torch.distributed: the process group `torchrun` or `accelerate launch` describe.

Each rank captures whole batches; partial sums travel to rank 0 as one fp64 vector per rank and round
(`gather_partials`), where they are added in batch order, so the result does not depend on the number of ranks.
A collective that fails (a rank died, was killed, or timed out) ends the job with `CaptureError`.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass

import torch

from oscar_calib.calibration.stats import LayerStats
from oscar_calib.errors import CaptureError

TIMEOUT_ENV = "OSCAR_CALIB_DIST_TIMEOUT"  # seconds a collective may wait for the other ranks
DEFAULT_TIMEOUT_S = 1800


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_environment() -> DistContext | None:
    """The launcher's rank description (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`), or None for a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    rank = int(os.environ.get("RANK", "0"))
    return DistContext(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", rank)))


def initialise(ctx: DistContext, device: str) -> str:
    """Join the process group (NCCL for CUDA devices, gloo otherwise); returns the backend name."""
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = _dt.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend=backend, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - rendezvous raises RuntimeError, ValueError, DistNetworkError
            raise CaptureError(f"data parallel: rank {ctx.rank} of {ctx.world_size} could not join the process "
                               f"group ({backend}): {type(exc).__name__}: {exc}") from exc
    return backend


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pack_partial(partial: dict[int, LayerStats] | None, layers: list[int], h_kv: int, d: int,
                 device: torch.device | str) -> torch.Tensor:
    """One fp64 vector: a present flag, then per layer key/attn_out/logit_v sums, logit_w sum and the two counts.

    An idle rank (no batch left this round) sends `partial=None`: a zero vector with the flag 0.
    """
    size = 1 + len(layers) * (3 * h_kv * d * d + h_kv + 2 * h_kv * d + 2)
    if partial is None:
        return torch.zeros(size, dtype=torch.float64, device=device)
    if sorted(partial) != layers:
        raise CaptureError(f"data parallel: this rank captured layers {sorted(partial)}, expected {layers}")
    parts = [torch.ones(1, dtype=torch.float64, device=device)]
    for layer in layers:
        s = partial[layer]
        parts += [t.reshape(-1).to(device) for t in (s.key_sum, s.attn_out_sum, s.logit_v_sum, s.logit_w_sum,
                                                      s.key_vec_sum, s.value_vec_sum)]
        parts.append(torch.tensor([s.query_count, s.token_count], dtype=torch.float64, device=device))
    return torch.cat(parts)


def unpack_partial(flat: torch.Tensor, layers: list[int], h_kv: int, d: int) -> dict[int, LayerStats] | None:
    """Inverse of `pack_partial` (None for an idle rank's vector)."""
    if float(flat[0]) == 0.0:
        return None
    out, pos = {}, 1
    for layer in layers:
        tensors = []
        for shape in ((h_kv, d, d), (h_kv, d, d), (h_kv, d, d), (h_kv,), (h_kv, d), (h_kv, d)):
            n = 1
            for s in shape:
                n *= s
            tensors.append(flat[pos:pos + n].reshape(shape).clone())
            pos += n
        counts = flat[pos:pos + 2].tolist()
        pos += 2
        out[layer] = LayerStats(*tensors, query_count=int(counts[0]), token_count=int(counts[1]))
    return out


def gather_partials(ctx: DistContext, flat: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's vector on rank 0, in rank order (None on the other ranks)."""
    import torch.distributed as dist

    bucket = [torch.empty_like(flat) for _ in range(ctx.world_size)] if ctx.is_main else None
    try:
        dist.gather(flat, gather_list=bucket, dst=0)
    except Exception as exc:  # noqa: BLE001 - DistBackendError / RuntimeError from the backend
        raise CaptureError(f"data parallel: rank {ctx.rank} of {ctx.world_size}: exchanging statistics with the "
                           f"other ranks failed (a rank died, was stopped or timed out); no artifact is written. "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    return bucket
