"""How many bytes a run will write, from the model config alone, so that a full disk is refused before the work.

The sizes are upper bounds of the files `oscar-calib run` writes (every decoder layer counted, the o_proj weights
included as the block_out clip fit saves them), plus 1 MiB for the model card, log and headers:

- statistics (`oscar_stats.safetensors`): fp64 sums `A x H_kv x (3 d^2 + 2 d + 1)`, the held-out capture
  `A x S x (2 H_kv T d + H_q n d)` in the capture dtype plus int64 positions, and o_proj `A x hidden x H_q d`;
- artifact (`oscar_kv.safetensors`): fp32 rotations, eigenvalues, means and clip ratios, `A x H_kv x (2 d^2 + 6 d + 8)`;
- a checkpoint: the fp64 sums, twice (the new one is written beside the old before the rename).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from runtime_kernels.artifact import model_geometry, text_config
from runtime_kernels.atomic import DiskFullError, free_bytes
from runtime_kernels.units import format_bytes

SLACK_BYTES = 1 << 20  # model card, calibration log, safetensors headers


def sums_bytes(model_config) -> int:
    layers, _, h_kv, d = model_geometry(model_config)
    return layers * (h_kv * (3 * d * d + 2 * d + 1) * 8 + 16)


def output_bytes(model_config, dtype: torch.dtype, holdout_len: int, holdout_samples: int, holdout_queries: int) -> int:
    """Bytes of the output directory of a run (statistics + artifact + card and log), an upper bound."""
    layers, h_q, h_kv, d = model_geometry(model_config)
    hidden = int(getattr(text_config(model_config), "hidden_size", h_q * d) or h_q * d)
    elem = torch.empty((), dtype=dtype).element_size()
    n = min(holdout_queries, holdout_len)
    holdout = layers * holdout_samples * ((2 * h_kv * holdout_len * d + h_q * n * d) * elem + n * 8)
    o_proj = layers * hidden * h_q * d * elem
    artifact = layers * h_kv * (2 * d * d + 6 * d + 8) * 4
    return sums_bytes(model_config) + holdout + o_proj + artifact + SLACK_BYTES


def _device(path: Path) -> int | None:
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return probe.stat().st_dev
    except OSError:
        return None


def check_run_space(out_dir: Path, out_bytes: int, checkpoint_dir: Path | None, checkpoint_bytes: int) -> None:
    """Refuse (DiskFullError, exit 1) when the filesystem of the output (and of the checkpoint) has too little
    free space for what the run will write there. Both on one filesystem: their sum must fit."""
    needs: dict[int | None, tuple[Path, int, list[str]]] = {}
    for path, size, what in ((out_dir, out_bytes, "the output directory"),
                             (checkpoint_dir, checkpoint_bytes, "the checkpoint")):
        if path is None or size <= 0:
            continue
        key = _device(path)
        first, total, whats = needs.get(key, (path, 0, []))
        needs[key] = (first, total + size, [*whats, what])
    for path, total, whats in needs.values():
        free = free_bytes(path)
        if free is not None and free < total:
            raise DiskFullError(f"{path}: ENOSPC: {' and '.join(whats)} need about {total} bytes "
                                f"({format_bytes(total)}), only {free} are free there; free space or choose another "
                                "location (checked before the calibration; nothing was written)")
