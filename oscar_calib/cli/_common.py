"""What the CLI commands share: the hub commands' error wording (flags, not argument names), the endpoint, a
model config read for a flag, and what `push` would upload. One module, so no command imports another's helpers."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from oscar_calib.errors import InputError

# The runtime names its Python arguments (`field 'revision'`); on the command line the same input is a flag.
_FLAG_OF_ARGUMENT = {"repo": "--repo", "revision": "--revision", "repo_type": "--repo-type",
                     "calibration": "--calibration", "version": "--version", "local_dir": "--local-dir"}


def flag_words(message: str) -> str:
    """`field 'revision': ...` -> `--revision: ...` for the arguments that are flags of the hub commands."""
    for name, flag in _FLAG_OF_ARGUMENT.items():
        message = message.replace(f"field '{name}':", f"{flag}:")
    return message


@contextlib.contextmanager
def translate_errors(flags: bool = False):
    """oscar_calib.zoo.hub.translate_errors, imported when a command runs (it brings torch); with `flags` (push, pull)
    the runtime's argument names are turned into the flags the user typed (`zoo` reads them from the manifest)."""
    from oscar_calib.errors import OscarError
    from oscar_calib.zoo.hub import translate_errors as translate

    try:
        with translate():
            yield
    except OscarError as exc:
        if flags:
            exc.args = (flag_words(str(exc)),)
        raise


def check_flags(**values: tuple[str, object]) -> None:
    """Check names the user typed, naming the flag: `check_flags(repo=("--repo", "org/x"))`.

    The runtime's checks name their argument (`field 'repo'`), which is right in Python; on the command line
    the error should say `--repo`. Kinds: repo, model (MODEL argument), calibration, revision, version."""
    from runtime_kernels.loader import (
        UnsafeNameError,
        check_component,
        check_model_id,
        check_repo_id,
        check_revision,
    )

    checks = {"repo": check_repo_id, "model": check_model_id, "calibration": check_component,
              "revision": check_revision}
    for kind, (flag, value) in values.items():
        if value is None:
            continue
        try:
            if kind == "version":
                from oscar_calib.zoo.hub import check_version

                check_version(value)
            else:
                checks[kind](value, flag)
        except (UnsafeNameError, InputError) as exc:
            text = str(exc).replace(f"field '{flag}'", flag, 1).replace("field 'version'", flag, 1)
            raise InputError(text) from None


def endpoint() -> str | None:
    """HF_ENDPOINT read now (the client reads it once at import)."""
    return os.environ.get("HF_ENDPOINT") or None


def load_config(path: Path | None):
    if path is None:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types
        raise InputError(f"--model-config {path}: cannot load a config (expected a local directory with config.json "
                         f"or a config.json file): {type(exc).__name__}") from None


def push_plan(directory: Path, repo: str, calibration: str, include_stats: bool = False) -> dict:
    """What `push` would upload from `directory` (checked locally: names, contract), without the Hub."""
    from oscar_calib.zoo.hub import collect_files, local_only
    from runtime_kernels.artifact import ARTIFACT_FILENAME, read_artifact
    from runtime_kernels.loader import file_record, release_dir

    with translate_errors():
        files = collect_files(directory, include_stats)
        meta = read_artifact(files[ARTIFACT_FILENAME]).metadata
        base = release_dir(meta["model_id"], calibration)
    return {"repo": repo, "path_in_repo": base, "model_id": meta["model_id"],
            "model_revision": meta["model_revision"], "files": {n: file_record(p) for n, p in files.items()},
            "local_only": local_only(directory, files)}


def run_result(out: Path) -> dict:
    """What `run --json` prints: the files written and the headline numbers of the calibration log."""
    import hashlib

    from oscar_calib.calibration.job import LOG_FILENAME
    from runtime_kernels.artifact import ARTIFACT_FILENAME

    artifact = out / ARTIFACT_FILENAME
    log = json.loads((out / LOG_FILENAME).read_text(encoding="utf-8"))
    return {"out": str(out), "artifact": str(artifact),
            "artifact_sha256": hashlib.sha256(artifact.read_bytes()).hexdigest(),
            "model_id": log.get("metadata", {}).get("model_id"), "layer_ids": log.get("layer_ids"),
            "summary": log.get("summary"), "timings": log.get("timings")}
