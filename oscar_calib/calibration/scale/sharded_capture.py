"""The statistics pass at scale: whole batches in a fixed order, spread over ranks, checkpointed, resumable.

Batch `b` holds samples `[b * batch_size, (b + 1) * batch_size)` of this run's sample range. In round `r`
rank `i` captures batch `r * world_size + i` into fresh sums; rank 0 receives every rank's sums and adds them
to the running totals in batch order. So the totals are the same bits for any number of ranks, and the same
as a run resumed from a checkpoint (a checkpoint holds the totals after a whole number of batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from oscar_calib.calibration.capture import CaptureSession, capturing, forward_batch
from oscar_calib.calibration.scale.checkpoint import (
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
)
from oscar_calib.calibration.scale.distributed import (
    DistContext,
    gather_partials,
    pack_partial,
    unpack_partial,
)
from oscar_calib.calibration.stats import LayerStats
from oscar_calib.errors import InputError
from oscar_calib.placement import input_device


@dataclass
class CapturePlan:
    """How the statistics pass runs. `sample_range` is `[start, end)` of the data set's samples."""

    batch_size: int
    sample_range: tuple[int, int]
    dist: DistContext | None = None
    checkpoint_path: Path | None = None
    checkpoint_every: int | None = None  # samples between checkpoints; None = no checkpoints
    resume: bool = False
    identity: dict | None = None  # what a checkpoint must match (see `checkpoint_identity`)
    layers: list[int] | None = None  # layers that report statistics (needed by the ranks' exchange)
    geometry: tuple[int, int] | None = None  # (H_kv, d)
    resumed_from: int | None = None  # set by the pass: the checkpoint's sample position


def checkpoint_identity(provenance_identity: dict, sample_range: tuple[int, int]) -> dict:
    """A checkpoint belongs to one statistics identity and one sample range."""
    return {**provenance_identity, "sample_range": list(sample_range)}


def fold(totals: dict[int, LayerStats], partial: dict[int, LayerStats]) -> None:
    """Add one batch's sums into the running totals (on the batch's device)."""
    for layer, s in partial.items():
        if layer not in totals:
            totals[layer] = s
        else:
            totals[layer] = totals[layer].to(s.key_sum.device).merge_(s)


def make_accumulator(plan: CapturePlan):
    """An `accumulate(model, session, input_ids, progress)` for `capture_statistics` that follows `plan`.

    input_ids `[end - start, T]` are the samples of `plan.sample_range`. Returns the totals on rank 0 and
    None on the other ranks.
    """
    def accumulate(model, session: CaptureSession, input_ids: torch.Tensor, progress):
        start, end = plan.sample_range
        if input_ids.shape[0] != end - start:
            raise ValueError(f"input_ids has {input_ids.shape[0]} rows for sample range [{start}, {end})")
        bs = plan.batch_size
        batches = [(a, min(a + bs, end - start)) for a in range(0, end - start, bs)]
        world = plan.dist.world_size if plan.dist else 1
        rank = plan.dist.rank if plan.dist else 0
        totals: dict[int, LayerStats] = {}
        first = 0
        if plan.checkpoint_path is not None and rank == 0:
            remove_stale_temporaries(plan.checkpoint_path)
        if plan.resume:
            ckpt = load_checkpoint(plan.checkpoint_path, plan.identity)
            offset = ckpt.next_sample - start
            if offset < 0 or offset > end - start or (offset % bs and ckpt.next_sample != end):
                raise InputError(f"--resume: checkpoint '{plan.checkpoint_path}': sample position "
                                 f"{ckpt.next_sample} is not a batch boundary of [{start}, {end})")
            totals = ckpt.totals if rank == 0 else {}
            first = len(batches) if ckpt.next_sample == end else offset // bs
            plan.resumed_from = ckpt.next_sample
        device = input_device(model)
        last_saved = start + (batches[first][0] if first < len(batches) else end - start)
        with capturing(model, session):
            for round_start in range(first, len(batches), world):
                mine = round_start + rank
                partial = None
                if mine < len(batches):
                    a, b = batches[mine]
                    session.stats = {}
                    forward_batch(model, input_ids[a:b].to(device), session)
                    partial = session.stats
                round_batches = range(round_start, min(round_start + world, len(batches)))
                if world > 1:
                    h_kv, d = plan.geometry
                    flat = pack_partial(partial, plan.layers, h_kv, d, device if device.type == "cuda" else "cpu")
                    gathered = gather_partials(plan.dist, flat)
                    partials = [unpack_partial(f, plan.layers, h_kv, d) for f in gathered] if gathered else []
                else:
                    partials = [partial]
                for p in partials:
                    if p is not None:
                        fold(totals, p)
                next_sample = start + batches[round_batches[-1]][1]
                if progress is not None and rank == 0:
                    tokens = sum(batches[i][1] - batches[i][0] for i in round_batches) * input_ids.shape[1]
                    progress(tokens, input_ids.numel())
                due = plan.checkpoint_every is not None and (
                    next_sample - last_saved >= plan.checkpoint_every or next_sample == end)
                if due and rank == 0:
                    save_checkpoint(plan.checkpoint_path, totals, next_sample, plan.identity)
                    last_saved = next_sample
        session.stats = {}
        return totals if rank == 0 else None

    return accumulate

