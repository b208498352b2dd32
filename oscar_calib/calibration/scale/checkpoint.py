"""Capture checkpoints: the fp64 sums after a whole number of batches, the exact sample position and the identity.

A checkpoint is a directory of its own kind (default `<out>.checkpoint/` beside the output directory):

    <dir>/OSCAR_CHECKPOINT                 marker: says the directory belongs to a calibration run
    <dir>/oscar.checkpoint.safetensors     the sums, the sample position and the identity

`--checkpoint PATH` refuses a path that exists and is not such a directory (a file, an artifact directory, any
non-empty directory without the marker), so a checkpoint never overwrites or deletes what is there
(`prepare_checkpoint_dir`, before the model loads). `save_checkpoint` writes a temporary file in the directory
and renames it over the old checkpoint (`os.replace`), so a checkpoint on disk is always whole: a run killed at
any point leaves either the previous checkpoint or the new one. `load_checkpoint` refuses a checkpoint made with
another model, data, seed, capture setting or tool version, naming the field, and one whose sums or sample
position are not those of a real capture (`oscar_calib.calibration.stats_checks`). `remove_checkpoint` removes only the
files a run writes there, and the directory only when a run of this tool made it.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from oscar_calib.calibration.stats import LayerStats
from oscar_calib.calibration.stats_checks import (
    check_counts_match_samples,
    check_magnitudes,
    check_psd,
    check_sums,
)
from oscar_calib.calibration.stats_file import (
    atomic_save_safetensors,
    atomic_write_bytes,
    first_difference,
    read_safetensors,
    sums_from_tensors,
    sums_to_tensors,
)
from oscar_calib.errors import InputError

CHECKPOINT_FORMAT = "oscar-checkpoint"
MARKER_FILENAME = "OSCAR_CHECKPOINT"
CHECKPOINT_FILENAME = "oscar.checkpoint.safetensors"
MARKER_TEXT = ("oscar-checkpoint directory v1\n"
               "Written by `oscar-calib run --checkpoint-every`; continue with --resume. Removed when the run ends.\n")


@dataclass
class Checkpoint:
    """Sums of the samples `[sample_range[0], next_sample)` of the data set."""

    totals: dict[int, LayerStats]
    next_sample: int
    identity: dict


def is_checkpoint_dir(path: Path) -> bool:
    """A directory holding this tool's marker file (whatever else is in it is a run's checkpoint)."""
    marker = Path(path) / MARKER_FILENAME
    try:
        return marker.is_file() and marker.read_text(encoding="utf-8", errors="replace").startswith(
            MARKER_TEXT.splitlines()[0])
    except OSError:
        return False


def prepare_checkpoint_dir(path: Path, flag: str = "--checkpoint", forbidden: Path | None = None) -> bool:
    """Refuse a checkpoint location that is not ours or cannot be written, before any work. Creates nothing.

    Accepted: a path that does not exist (under writable directories), an empty directory, or a checkpoint
    directory (with the marker). Refused, naming the path: a file or symlink, a non-empty directory without the
    marker (an artifact directory, say), a parent that is a file, a location where this process cannot create
    files, and a path inside (or holding) `forbidden` (the output directory, which the run replaces).
    Returns whether `path` is a directory the user made (empty, no marker): the run's clean-up then leaves it.
    """
    path = Path(os.path.abspath(path))
    if forbidden is not None:
        out = Path(os.path.abspath(forbidden))
        if path == out or out in path.parents or path in out.parents:
            raise InputError(f"{flag} {path}: overlaps the output directory {out}, which the run replaces; "
                             "choose a checkpoint directory beside it")
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise InputError(f"{flag} {path}: exists and is not a checkpoint directory (it is a file or a symlink); "
                         "nothing was changed. Choose a new path (a checkpoint is a directory of its own)")
    ours = path.is_dir() and is_checkpoint_dir(path)
    if path.is_dir() and not ours and any(path.iterdir()):
        raise InputError(f"{flag} {path}: exists and is not a checkpoint directory (no {MARKER_FILENAME} marker; "
                         "it holds other files); nothing was changed. Choose a new path (a checkpoint is a directory "
                         "of its own)")
    ancestor = path if path.is_dir() else path.parent
    while not ancestor.exists() and not ancestor.is_symlink():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"{flag} {path}: {ancestor} is not a directory")
    try:  # the real test (os.access is wrong for root, ACLs and read-only mounts)
        os.rmdir(tempfile.mkdtemp(prefix=".oscar-probe-", dir=ancestor))
    except OSError as exc:
        raise InputError(f"{flag} {path}: cannot create files in {ancestor} ({exc.strerror}); choose a writable "
                         "location") from None
    return path.is_dir() and not ours


def _checkpoint_file(path: Path) -> Path:
    return Path(path) / CHECKPOINT_FILENAME


def save_checkpoint(path: Path, totals: dict[int, LayerStats], next_sample: int, identity: dict) -> None:
    """Atomically replace the checkpoint in directory `path` with the sums `totals` (on any device) at sample
    position `next_sample`. The directory and its marker are made first if missing."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if not (path / MARKER_FILENAME).is_file():
        atomic_write_bytes(MARKER_TEXT.encode(), path / MARKER_FILENAME, "--checkpoint")
    meta = {"format": CHECKPOINT_FORMAT, "next_sample": str(next_sample),
            "identity": json.dumps(identity, sort_keys=True)}
    atomic_save_safetensors(sums_to_tensors(totals), meta, _checkpoint_file(path), "--checkpoint")


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Delete temporary files a killed run left in the checkpoint directory `path` (never the checkpoint)."""
    path = Path(path)
    stale = sorted(path.glob(".*.tmp-*")) if is_checkpoint_dir(path) else []
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    return stale


def remove_checkpoint(path: Path, keep_dir: bool = False) -> None:
    """Remove what runs write in the checkpoint directory `path`: the checkpoint, its temporaries, the marker,
    then the directory if that leaves it empty and it is not the user's (`keep_dir`). Anything else stays."""
    path = Path(path)
    if not is_checkpoint_dir(path):
        return
    remove_stale_temporaries(path)
    _checkpoint_file(path).unlink(missing_ok=True)
    (path / MARKER_FILENAME).unlink(missing_ok=True)
    if keep_dir:
        return
    try:
        path.rmdir()
    except OSError:
        pass  # something the user put there: left alone


def checkpoint_exists(path: Path) -> bool:
    return is_checkpoint_dir(path) and _checkpoint_file(path).is_file()


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def load_checkpoint(path: Path, identity: dict) -> Checkpoint:
    """Read the checkpoint in directory `path` and check it was made by a run with this `identity`.

    Raises InputError naming the file and, on a mismatch, the first differing field with both values; a sum
    that is not finite, a count that does not match the sample position, or a position outside the identity's
    sample range is refused naming the field.
    """
    path = Path(path)
    where = f"--resume: checkpoint '{path}'"
    if not is_checkpoint_dir(path):
        raise InputError(f"{where}: not a checkpoint directory (no {MARKER_FILENAME} marker); start without --resume, "
                         "or pass --checkpoint PATH")
    file = _checkpoint_file(path)
    if not file.is_file():
        raise InputError(f"{where}: no {CHECKPOINT_FILENAME} in it (start without --resume)")
    where = f"--resume: checkpoint '{file}'"
    tensors, meta = read_safetensors(file, "checkpoint")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise InputError(f"{where}: metadata field 'format' is {meta.get('format')!r}, expected '{CHECKPOINT_FORMAT}'")
    try:
        saved = json.loads(meta["identity"])
        next_sample = int(meta["next_sample"])
    except (KeyError, ValueError, RecursionError) as exc:
        field = exc if isinstance(exc, KeyError) else ("'identity'" if "identity" in meta and not _is_json(
            meta["identity"]) else "'next_sample'")
        raise InputError(f"{where}: metadata field {field} is missing or malformed") from None
    if not isinstance(saved, dict):
        raise InputError(f"{where}: metadata field 'identity' is not a JSON object")
    diff = first_difference(saved, identity)
    if diff:
        name, was, now = diff
        raise InputError(f"{where}: was made with {name}={was!r}, this run has {name}={now!r}; "
                         "resume with the same settings, or start again without --resume")
    totals = sums_from_tensors(tensors, where)
    check_sums(totals, where)
    check_psd(totals, where)  # the run solves from these sums directly: the statistics file's checks, here too
    check_magnitudes(totals, {}, None, where)
    check_counts_match_samples(totals, identity, [[identity["sample_range"][0], next_sample]], where,
                               field="next_sample")
    return Checkpoint(totals, next_sample, saved)
