"""Pull a published OSCAR artifact from a Hub "rotation zoo" repo, verify it, check it against the model.

Zoo layout (one git repo on the Hub, many models):

    <model_id>/<calibration>/oscar_kv.safetensors   the artifact (contract v2, see artifact.py)
    <model_id>/<calibration>/README.md              the model card
    <model_id>/<calibration>/release.json           the release record: sha256 and size of every file above
    ...                                             plus any stats or evaluation files of the release

A release is one commit that writes that directory, and a git tag `vN` on that commit. Tags can move,
so a pull resolves the revision to a commit sha first and downloads every file *at that sha* through
the Hugging Face cache. The Hub client checks sizes only; here each file's sha256 is checked against
the release record (and against `expected_sha256` when the caller pins hashes, e.g. from
`zoo_manifest.yaml`). A file that fails is never handed out. With `HF_HUB_OFFLINE=1` everything is
served from a warm cache (the tag -> commit mapping is cached by the client when the record is
downloaded by tag).

Errors: `ArtifactError` (a ValueError) for integrity and contract failures, `ReleaseNotFoundError` for
a repo, revision or file that does not exist, `ModelMismatchError` for an artifact made for another
model, and `UnsafeNameError` (a ValueError) for a malformed name; the CLI maps each to its exit code.
This module imports only torch, safetensors, huggingface_hub and stdlib.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from runtime_kernels.artifact import (
    ARTIFACT_FILENAME,
    ArtifactError,
    ModelMismatchError,
    OscarArtifact,
    check_against_model,
    read_artifact,
)
from runtime_kernels.contract import reject_duplicate_keys

logger = logging.getLogger(__name__)

RELEASE_FILENAME = "release.json"
RELEASE_FORMAT = "oscar-kv-release"
RELEASE_SCHEMA_VERSION = 1
MAX_RELEASE_RECORD_BYTES = 1 << 20

COMMIT_RE = re.compile(r"[0-9a-f]{40}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
# One path component: starts with a letter or digit, then letters, digits, '.', '_' or '-'.
_COMPONENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
# A git revision: branch, tag or sha (no '..', no control characters, no leading '/').
_REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


class UnsafeNameError(ValueError):
    """A repo id, model id, calibration name, revision or file name that is not safe to use."""


class ReleaseNotFoundError(LookupError):
    """The repo, revision, release directory or one of its files does not exist (or is not cached offline)."""


# --- names -------------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    return ascii(value)  # control characters become visible escapes in error messages


def check_component(value: Any, field_name: str) -> str:
    """Return `value` if it is one safe path component (no '/', '..', control characters or leading dot)."""
    if not isinstance(value, str) or not value:
        raise UnsafeNameError(f"field '{field_name}': expected a non-empty string, got {_describe(value)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise UnsafeNameError(f"field '{field_name}': control characters are not allowed, got {_describe(value)}")
    if ".." in value or not _COMPONENT_RE.fullmatch(value):
        raise UnsafeNameError(
            f"field '{field_name}': expected letters, digits, '.', '_' or '-' (starting with a letter or digit, "
            f"no '..', at most 96 characters), got {_describe(value)}")
    return value


def check_repo_id(value: Any, field_name: str = "repo") -> str:
    """A Hub repo id `ORG/NAME` (exactly two safe components)."""
    if not isinstance(value, str) or value.count("/") != 1:
        raise UnsafeNameError(f"field '{field_name}': expected 'ORG/NAME', got {_describe(value)}")
    org, name = value.split("/")
    check_component(org, field_name)
    check_component(name, field_name)
    return value


def check_model_id(value: Any, field_name: str = "model_id") -> str:
    """A Hub model id: `NAME` or `ORG/NAME` (each part a safe component)."""
    if not isinstance(value, str) or value.count("/") > 1:
        raise UnsafeNameError(f"field '{field_name}': expected 'NAME' or 'ORG/NAME', got {_describe(value)}")
    for part in value.split("/"):
        check_component(part, field_name)
    return value


def check_relative_file(value: Any, field_name: str = "file") -> str:
    """A relative POSIX file path inside a release directory; every component must be safe."""
    if not isinstance(value, str) or not value or value.startswith("/") or "\\" in value:
        raise UnsafeNameError(f"field '{field_name}': expected a relative path, got {_describe(value)}")
    for part in value.split("/"):
        try:
            check_component(part, field_name)
        except UnsafeNameError:
            raise UnsafeNameError(f"field '{field_name}': expected a relative path of safe components (letters, "
                                  f"digits, '.', '_', '-'; no '..'), got {_describe(value)}") from None
    return value


def check_revision(value: Any, field_name: str = "revision") -> str:
    """A git revision (branch, tag or 40-hex commit sha)."""
    if not isinstance(value, str) or any(ord(c) < 32 or ord(c) == 127 for c in value) \
            or ".." in value or not _REVISION_RE.fullmatch(value) or value.endswith("/"):
        raise UnsafeNameError(f"field '{field_name}': expected a branch, tag or commit sha, got {_describe(value)}")
    return value


def release_dir(model_id: str, calibration: str) -> str:
    """Path of a release directory inside the zoo repo: `<model_id>/<calibration>`."""
    return f"{check_model_id(model_id)}/{check_component(calibration, 'calibration')}"


# --- hashing and the release record ------------------------------------------------------------
def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_record(path: str | os.PathLike) -> dict[str, Any]:
    """`{"sha256": hex, "size": bytes}` of one file."""
    return {"sha256": sha256_file(path), "size": os.path.getsize(path)}


def parse_release_record(raw: bytes, source: str) -> dict[str, Any]:
    """Parse and validate a `release.json`. Raises ArtifactError naming the field."""
    def fail(field_name: str, message: str) -> None:
        raise ArtifactError(f"{source}: field '{field_name}': {message}")

    if len(raw) > MAX_RELEASE_RECORD_BYTES:
        fail("<file>", f"release record larger than {MAX_RELEASE_RECORD_BYTES} bytes")
    try:  # duplicate keys are refused (json keeps the last one silently); ValueError covers JSONDecodeError
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ArtifactError(f"{source}: not a JSON release record: {exc}") from None
    if not isinstance(data, dict):
        fail("<root>", "expected a JSON object")
    allowed = {"format", "schema_version", "model_id", "model_revision", "calibration", "version", "files"}
    extra = sorted(set(data) - allowed)
    if extra:
        fail(str(extra[0]), f"unknown key (allowed: {sorted(allowed)})")
    for key in sorted(allowed):
        if key not in data:
            fail(key, "missing")
    if data["format"] != RELEASE_FORMAT:
        fail("format", f"expected '{RELEASE_FORMAT}', got {_describe(data['format'])}")
    if data["schema_version"] != RELEASE_SCHEMA_VERSION:
        fail("schema_version", f"expected {RELEASE_SCHEMA_VERSION}, got {_describe(data['schema_version'])}")
    for key in ("model_id", "model_revision", "calibration", "version"):
        if not isinstance(data[key], str):
            fail(key, f"expected a string, got {_describe(data[key])}")
    try:
        check_model_id(data["model_id"])
        check_component(data["calibration"], "calibration")
        check_component(data["version"], "version")
    except UnsafeNameError as exc:
        raise ArtifactError(f"{source}: {exc}") from None
    files = data["files"]
    if not isinstance(files, dict) or ARTIFACT_FILENAME not in files:
        fail("files", f"expected an object naming at least '{ARTIFACT_FILENAME}'")
    for name, entry in files.items():
        try:
            check_relative_file(name, "files")
        except UnsafeNameError as exc:
            raise ArtifactError(f"{source}: {exc}") from None
        if name == RELEASE_FILENAME:
            fail(f"files.{name}", "the release record cannot list itself")
        if not isinstance(entry, dict) or set(entry) != {"sha256", "size"}:
            fail(f"files.{name}", "expected exactly {'sha256': hex, 'size': int}")
        if not isinstance(entry["sha256"], str) or not SHA256_RE.fullmatch(entry["sha256"]):
            fail(f"files.{name}.sha256", f"expected 64 lowercase hex digits, got {_describe(entry['sha256'])}")
        if type(entry["size"]) is not int or entry["size"] < 0:
            fail(f"files.{name}.size", f"expected a non-negative integer, got {_describe(entry['size'])}")
    return data


def release_record(model_id: str, model_revision: str, calibration: str, version: str,
                   files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Build a release record (the inverse of parse_release_record)."""
    return {
        "format": RELEASE_FORMAT,
        "schema_version": RELEASE_SCHEMA_VERSION,
        "model_id": model_id,
        "model_revision": model_revision,
        "calibration": calibration,
        "version": version,
        "files": {name: dict(files[name]) for name in sorted(files)},
    }


def verify_files(paths: dict[str, Path], expected: dict[str, dict[str, Any]], source: str) -> None:
    """Check each `paths[name]` against `expected[name]` ({'sha256', optional 'size'}). Raises ArtifactError."""
    for name, want in expected.items():
        if name not in paths:
            raise ArtifactError(f"{source}: field 'files.{name}': recorded in the release but not downloaded")
        got_size = os.path.getsize(paths[name])
        if "size" in want and got_size != want["size"]:
            raise ArtifactError(
                f"{source}: field 'files.{name}.size': expected {want['size']} bytes, got {got_size}")
        got = sha256_file(paths[name])
        if got != want["sha256"]:
            raise ArtifactError(
                f"{source}: field 'files.{name}.sha256': expected {want['sha256']}, got {got} "
                "(corrupted or tampered download; nothing was used)")


# --- pulling ------------------------------------------------------------------------------------
@dataclass
class PulledRelease:
    """A verified release: where its files are, which commit they came from, and the record."""

    repo: str
    revision: str
    commit: str
    path_in_repo: str
    record: dict[str, Any]
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def artifact_path(self) -> Path:
        return self.files[ARTIFACT_FILENAME]


def is_offline() -> bool:
    """HF_HUB_OFFLINE read now (the client reads it once at import), or the client's own setting."""
    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().upper() in {"1", "ON", "YES", "TRUE"}
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _commit_of_cached_path(path: str, filename: str) -> str:
    """The commit sha of a file in the HF cache layout `.../snapshots/<sha>/<filename>`."""
    parts = Path(path).parts
    depth = len(PurePosixPath(filename).parts)
    sha = parts[-depth - 1] if len(parts) > depth else ""
    if not COMMIT_RE.fullmatch(sha) or parts[-depth - 2] != "snapshots":
        raise ArtifactError(f"{path}: not in the Hugging Face cache layout; cannot tell its commit")
    return sha


def _hub_errors():
    from huggingface_hub.utils import (  # re-exported here by every client version we support
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    return EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError


def _download(repo: str, filename: str, revision: str, *, token, cache_dir, endpoint, offline: bool,
              force: bool = False) -> str:
    """hf_hub_download through the cache; Hub 'not found' errors become ReleaseNotFoundError."""
    from huggingface_hub import hf_hub_download

    entry_nf, local_nf, repo_nf, rev_nf = _hub_errors()
    try:
        return hf_hub_download(repo, filename, revision=revision, token=token, cache_dir=cache_dir,
                               endpoint=endpoint, local_files_only=offline, force_download=force)
    except local_nf:  # before entry_nf: newer clients derive it from EntryNotFoundError
        raise ReleaseNotFoundError(
            f"field 'revision': '{filename}' at '{revision}' of '{repo}' is not in the local cache and the Hub "
            "is not reachable (HF_HUB_OFFLINE is set or the network is down); pull it once online") from None
    except repo_nf:
        raise ReleaseNotFoundError(f"field 'repo': repository '{repo}' not found (or not visible with this token)") from None
    except rev_nf:
        raise ReleaseNotFoundError(f"field 'revision': revision '{revision}' not found in '{repo}'") from None
    except entry_nf:
        raise ReleaseNotFoundError(f"field 'path': '{filename}' not found in '{repo}' at '{revision}'") from None


def resolve_commit(repo: str, revision: str, *, token=None, endpoint=None) -> str:
    """Resolve a branch, tag or sha to the commit sha it names now (online only)."""
    from huggingface_hub import HfApi

    _, _, repo_nf, rev_nf = _hub_errors()
    try:
        info = HfApi(endpoint=endpoint).model_info(repo, revision=revision, token=token)
    except repo_nf:
        raise ReleaseNotFoundError(f"field 'repo': repository '{repo}' not found (or not visible with this token)") from None
    except rev_nf:
        raise ReleaseNotFoundError(f"field 'revision': revision '{revision}' not found in '{repo}'") from None
    sha = getattr(info, "sha", None) or ""
    if not COMMIT_RE.fullmatch(sha):
        raise ArtifactError(f"{repo}@{revision}: the Hub did not return a commit sha (got {_describe(sha)})")
    return sha


def pull_release(model_id: str, repo: str, revision: str | None = None, *, calibration: str = "default",
                 expected_sha256: dict[str, str] | None = None, token: str | None = None,
                 cache_dir: str | os.PathLike | None = None, endpoint: str | None = None,
                 local_dir: str | os.PathLike | None = None) -> PulledRelease:
    """Resolve, download and verify one release directory. Returns where the verified files are.

    `expected_sha256` maps file names inside the release directory (e.g. 'oscar_kv.safetensors',
    'release.json') to hex sha256 digests the caller trusts (e.g. from zoo_manifest.yaml); they are
    checked in addition to the release record. With `local_dir`, the verified files are also copied
    there (atomically: a temporary directory renamed into place).
    """
    check_model_id(model_id)
    check_repo_id(repo)
    check_component(calibration, "calibration")
    if revision is None:
        logger.warning("revision not given: using 'main', which can change; pin a version tag or commit sha")
        revision = "main"
    check_revision(revision)
    pins = dict(expected_sha256 or {})
    for name, digest in pins.items():
        check_relative_file(name, "expected_sha256")
        if not isinstance(digest, str) or not SHA256_RE.fullmatch(digest):
            raise UnsafeNameError(f"field 'expected_sha256.{name}': expected 64 lowercase hex digits, got {_describe(digest)}")
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    offline = is_offline()
    base = release_dir(model_id, calibration)
    source = f"{repo}@{revision}:{base}"
    kw = dict(token=token, cache_dir=None if cache_dir is None else str(cache_dir), endpoint=endpoint,
              offline=offline)

    commit = None if offline else resolve_commit(repo, revision, token=token, endpoint=endpoint)
    # Download the record by the *revision* so the client caches revision -> commit for offline use.
    record_path = _download(repo, f"{base}/{RELEASE_FILENAME}", revision, **kw)
    cached_commit = _commit_of_cached_path(record_path, f"{base}/{RELEASE_FILENAME}")
    if commit is not None and cached_commit != commit:
        raise ArtifactError(f"{source}: field 'revision': moved from {commit} to {cached_commit} during the pull; retry")
    commit = cached_commit
    source = f"{repo}@{commit[:12]}:{base}"
    record = parse_release_record(Path(record_path).read_bytes(), f"{source}/{RELEASE_FILENAME}")
    if record["model_id"] != model_id:
        raise ArtifactError(f"{source}/{RELEASE_FILENAME}: field 'model_id': record has '{record['model_id']}', expected '{model_id}'")
    if record["calibration"] != calibration:
        raise ArtifactError(
            f"{source}/{RELEASE_FILENAME}: field 'calibration': record has '{record['calibration']}', expected '{calibration}'")
    unknown_pins = sorted(set(pins) - set(record["files"]) - {RELEASE_FILENAME})
    if unknown_pins:
        raise ArtifactError(f"{source}: field 'expected_sha256.{unknown_pins[0]}': not a file of this release")

    files: dict[str, Path] = {RELEASE_FILENAME: Path(record_path)}
    for name in record["files"]:
        files[name] = Path(_download(repo, f"{base}/{name}", commit, **kw))
    expected = {name: dict(entry) for name, entry in record["files"].items()}
    pinned = {name: {"sha256": digest} for name, digest in pins.items()}
    try:
        verify_files(files, expected, source)
        verify_files(files, pinned, source)
    except ArtifactError:
        if offline:
            raise
        # A corrupt blob may sit in the cache from an earlier broken transfer: fetch once more, then give up.
        logger.warning("%s: verification failed; downloading the release files again", source)
        for name in list(files):
            rev = revision if name == RELEASE_FILENAME else commit
            files[name] = Path(_download(repo, f"{base}/{name}", rev, force=True, **kw))
        record = parse_release_record(files[RELEASE_FILENAME].read_bytes(), f"{source}/{RELEASE_FILENAME}")
        verify_files(files, expected, source)
        verify_files(files, pinned, source)
    pulled = PulledRelease(repo=repo, revision=revision, commit=commit, path_in_repo=base, record=record, files=files)
    if local_dir is not None:
        pulled.files = copy_release_files(files, Path(local_dir))
    return pulled


def copy_release_files(files: dict[str, Path], local_dir: Path) -> dict[str, Path]:
    """Copy verified files into `local_dir` via a temporary sibling directory (no half-written directory)."""
    local_dir = local_dir.resolve()
    if local_dir.exists() and any(local_dir.iterdir()):
        raise UnsafeNameError(f"field 'local_dir': '{local_dir}' exists and is not empty; choose an empty or new directory")
    local_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{local_dir.name}.", dir=local_dir.parent))
    try:
        out = {}
        for name, src in files.items():
            dst = tmp / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            out[name] = local_dir / name
        if local_dir.exists():
            local_dir.rmdir()
        os.replace(tmp, local_dir)
        return out
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _check_model(artifact: OscarArtifact, model_config: Any, model_id: str | None,
                 allow_other_model: bool = False) -> None:
    """check_against_model with its ArtifactError turned into ModelMismatchError (another model)."""
    try:
        check_against_model(artifact, model_config, model_id=model_id, allow_other_model=allow_other_model)
    except ArtifactError as exc:
        raise ModelMismatchError(str(exc)) from None


def load_artifact(path_or_model_id: str | os.PathLike, repo: str | None = None, revision: str | None = None,
                  model_config: Any = None, expected_sha256: dict[str, str] | None = None,
                  token: str | None = None, cache_dir: str | os.PathLike | None = None, *,
                  calibration: str = "default", endpoint: str | None = None,
                  allow_other_model: bool = False) -> OscarArtifact:
    """Load a validated artifact from a local path or from a zoo repo on the Hub.

    - `repo` is None: `path_or_model_id` is a local directory or `.safetensors` file (read_artifact);
      `expected_sha256` (name -> hex) is then checked against the files in that directory.
    - otherwise `path_or_model_id` is the model id, `repo` the zoo repo and `revision` a version tag,
      branch or commit sha: see `pull_release` (resolve to a commit, download through the cache,
      verify sha256 against the release record and `expected_sha256`; offline from a warm cache).

    With `model_config` (a transformers config), the artifact is checked against it (heads, head_dim,
    layer count, and the model identity: the requested model id, else the config's `_name_or_path`)
    and a mismatch raises ModelMismatchError; `allow_other_model=True` waives the identity check only.
    """
    if repo is None:
        path = Path(path_or_model_id)
        if not path.exists():
            raise ReleaseNotFoundError(
                f"field 'path_or_model_id': no local artifact at '{path}'; to pull from the Hub pass repo= and revision=")
        if expected_sha256:
            folder = path if path.is_dir() else path.parent
            paths = {name: folder / check_relative_file(name, "expected_sha256") for name in expected_sha256}
            missing = [n for n, p in paths.items() if not p.is_file()]
            if missing:
                raise ArtifactError(f"{folder}: field 'expected_sha256.{missing[0]}': file not found")
            verify_files(paths, {n: {"sha256": d} for n, d in expected_sha256.items()}, str(folder))
        artifact = read_artifact(path)
        if model_config is not None:
            _check_model(artifact, model_config, None, allow_other_model)
        return artifact
    model_id = str(path_or_model_id)
    pulled = pull_release(model_id, repo, revision, calibration=calibration, expected_sha256=expected_sha256,
                          token=token, cache_dir=cache_dir, endpoint=endpoint)
    artifact = read_artifact(pulled.artifact_path)
    if artifact.metadata.get("model_id") != model_id:
        raise ModelMismatchError(
            f"{artifact.source}: field 'model_id': artifact has '{artifact.metadata.get('model_id')}', expected '{model_id}'")
    if pulled.record["model_revision"] != artifact.metadata.get("model_revision"):
        raise ArtifactError(
            f"{artifact.source}: field 'model_revision': artifact has '{artifact.metadata.get('model_revision')}', "
            f"release record has '{pulled.record['model_revision']}'")
    if model_config is not None:
        _check_model(artifact, model_config, model_id)
    return artifact


__all__ = [
    "COMMIT_RE",
    "ModelMismatchError",
    "UnsafeNameError",
    "PulledRelease",
    "RELEASE_FILENAME",
    "ReleaseNotFoundError",
    "check_component",
    "copy_release_files",
    "check_model_id",
    "check_relative_file",
    "check_repo_id",
    "check_revision",
    "file_record",
    "load_artifact",
    "parse_release_record",
    "pull_release",
    "release_dir",
    "release_record",
    "resolve_commit",
    "sha256_file",
    "verify_files",
]
