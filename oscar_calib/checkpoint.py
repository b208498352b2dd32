"""Capture checkpoints: the fp64 sums after a whole number of batches, the exact sample position and the identity.

`save_checkpoint` writes a temporary file in the same directory and renames it over the old checkpoint
(`os.replace`), so a checkpoint on disk is always whole: a run killed at any point leaves either the previous
checkpoint or the new one. `load_checkpoint` refuses a checkpoint made with another model, data, seed,
capture setting or tool version, naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from oscar_calib.errors import InputError
from oscar_calib.stats import LayerStats
from oscar_calib.stats_file import (
    atomic_save_safetensors,
    first_difference,
    read_safetensors,
    sums_from_tensors,
    sums_to_tensors,
)

CHECKPOINT_FORMAT = "oscar-checkpoint"


@dataclass
class Checkpoint:
    """Sums of the samples `[sample_range[0], next_sample)` of the data set."""

    totals: dict[int, LayerStats]
    next_sample: int
    identity: dict


def save_checkpoint(path: Path, totals: dict[int, LayerStats], next_sample: int, identity: dict) -> None:
    """Atomically replace `path` with the sums `totals` (on any device) at sample position `next_sample`."""
    meta = {"format": CHECKPOINT_FORMAT, "next_sample": str(next_sample),
            "identity": json.dumps(identity, sort_keys=True)}
    atomic_save_safetensors(sums_to_tensors(totals), meta, Path(path))


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Delete temporary files a killed run left beside the checkpoint `path` (never the checkpoint itself)."""
    path = Path(path)
    stale = sorted(path.parent.glob(f".{path.name}.tmp-*")) if path.parent.is_dir() else []
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    return stale


def load_checkpoint(path: Path, identity: dict) -> Checkpoint:
    """Read the checkpoint at `path` and check it was made by a run with this `identity`.

    Raises InputError naming the file and, on a mismatch, the first differing field with both values.
    """
    path = Path(path)
    where = f"--resume: checkpoint '{path}'"
    if not path.is_file():
        raise InputError(f"{where}: file not found (start without --resume, or pass --checkpoint PATH)")
    tensors, meta = read_safetensors(path, "checkpoint")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise InputError(f"{where}: metadata field 'format' is {meta.get('format')!r}, expected '{CHECKPOINT_FORMAT}'")
    try:
        saved = json.loads(meta["identity"])
        next_sample = int(meta["next_sample"])
    except (KeyError, ValueError) as exc:
        raise InputError(f"{where}: metadata field {exc} is missing or malformed") from exc
    diff = first_difference(saved, identity)
    if diff:
        name, was, now = diff
        raise InputError(f"{where}: was made with {name}={was!r}, this run has {name}={now!r}; "
                         "resume with the same settings, or start again without --resume")
    return Checkpoint(sums_from_tensors(tensors, where), next_sample, saved)
