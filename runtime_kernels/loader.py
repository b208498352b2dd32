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
model, `WrongRepoTypeError` for a zoo that is a repo of the other kind (`repo_type`, model or dataset), and
`UnsafeNameError` (a ValueError) for a malformed name; the CLI maps each to its exit code.
This module imports only torch, safetensors, huggingface_hub and stdlib.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
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
from runtime_kernels.contract import DuplicateKeyError, reject_duplicate_keys

logger = logging.getLogger(__name__)

RELEASE_FILENAME = "release.json"
RELEASE_FORMAT = "oscar-kv-release"
RELEASE_SCHEMA_VERSION = 1
MAX_RELEASE_RECORD_BYTES = 1 << 20
MAX_RELEASE_FILES = 256
MAX_RELEASE_FILE_BYTES = 1 << 40  # 1 TiB: far above any artifact, far below what int() of a long digit run gives
MAX_JSON_INT_DIGITS = 20  # bounds int() before it runs (CPython's own limit, 4300 digits, raises a bare ValueError)
MAX_RECORD_STRING = 256

COMMIT_RE = re.compile(r"[0-9a-f]{40}")
VERSION_RE = re.compile(r"v[1-9][0-9]{0,5}")  # a release tag: v1, v2, ...
SHA256_RE = re.compile(r"[0-9a-f]{64}")
# One path component: starts with a letter or digit, then letters, digits, '.', '_' or '-'.
_COMPONENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
# A git revision: branch, tag or sha (no '..', no control characters, no leading '/').
_REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


class UnsafeNameError(ValueError):
    """A repo id, model id, calibration name, revision or file name that is not safe to use."""


class ReleaseNotFoundError(LookupError):
    """The repo, revision, release directory or one of its files does not exist (or is not cached offline)."""


class HubUnreachableError(ConnectionError):
    """The Hub could not be reached (connection refused, DNS, timeout) while online."""


class WrongRepoTypeError(ReleaseNotFoundError):
    """The zoo repo exists on the Hub (or in the cache), but as the other kind (a dataset repo asked for as a
    model repo). `repo`, `repo_type` (asked for) and `actual` (what it is) let a CLI name its own flag."""

    def __init__(self, repo: str, repo_type: str, actual: str, where: str = "on the Hub"):
        self.repo, self.repo_type, self.actual = repo, repo_type, actual
        super().__init__(f"field 'repo_type': '{repo}' is a {actual} repo {where}, not a {repo_type} repo; pass "
                         f"repo_type='{actual}' (on the command line: --repo-type {actual})")

    def flag_message(self) -> str:
        """The same, in the words of the command line."""
        return (f"--repo-type {self.repo_type}: '{self.repo}' is a {self.actual} repo, not a {self.repo_type} repo; "
                f"pass --repo-type {self.actual}")


# The kinds of Hub repo a zoo can live in. The Hub keeps a separate namespace per kind, so `org/zoo` the
# dataset and `org/zoo` the model are two repos, and a client asking for the wrong kind gets "not found".
REPO_TYPES = ("model", "dataset")


def check_repo_type(value: Any, field_name: str = "repo_type") -> str:
    if value not in REPO_TYPES:
        raise UnsafeNameError(f"field '{field_name}': expected one of {list(REPO_TYPES)}, got {_describe(value)}")
    return value


def other_repo_type(repo: str, repo_type: str, *, token=None, endpoint=None) -> WrongRepoTypeError | None:
    """When `repo` is not found as a `repo_type` repo: the error to raise if it exists as the other kind, else None.

    One extra request, made only after a 'not found'; a failure of that request is not an answer (None)."""
    from huggingface_hub import HfApi

    other = next(t for t in REPO_TYPES if t != repo_type)
    try:
        exists = HfApi(endpoint=endpoint, token=token).repo_exists(repo, repo_type=other)
    except Exception:  # noqa: BLE001 - only a hint: the original 'not found' stands
        return None
    if not exists:
        return None
    return WrongRepoTypeError(repo, repo_type, other)


def is_connection_error(exc: BaseException) -> bool:
    """A network failure from the Hub client (httpx, httpx2 or requests transport errors, OS socket errors)."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"TransportError", "ConnectError", "NetworkError", "TimeoutException", "ConnectTimeout",
                         "ProxyError"}) or (
        "ConnectionError" in names and type(exc).__module__.split(".")[0] in {"requests", "urllib3"})


def unreachable(endpoint: str | None, doing: str, exc: BaseException, reads: bool = True) -> HubUnreachableError:
    """One clear error for a Hub that cannot be reached (the cause's class and first line, never headers).
    `reads=False` for a write (a push): the local cache cannot stand in for it, so HF_HUB_OFFLINE is not offered."""
    where = endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    first = (str(exc).splitlines() or [""])[0][:200]
    fallback = (", or set HF_HUB_OFFLINE=1 to use what is already in the local cache" if reads
                else "; nothing was published, run the command again once the Hub answers")
    return HubUnreachableError(
        f"cannot reach the Hub at {where} while trying to {doing} ({type(exc).__name__}: {first}); check the network "
        f"and HF_ENDPOINT{fallback}")


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


class _RecordSyntaxError(ValueError):
    """Raised by the JSON hooks below; becomes an ArtifactError naming the record."""


def _bounded_int(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > MAX_JSON_INT_DIGITS:
        raise _RecordSyntaxError(f"an integer of {len(digits)} digits (at most {MAX_JSON_INT_DIGITS} are allowed)")
    return int(text)


def _no_constant(text: str) -> Any:
    raise _RecordSyntaxError(f"{text} is not JSON (NaN and Infinity are refused)")


def strict_json(raw: bytes) -> Any:
    """json.loads that refuses duplicate keys, NaN/Infinity and integers of more than 20 digits.

    Raises `_RecordSyntaxError` for those, `UnicodeDecodeError` / `json.JSONDecodeError` / `RecursionError`
    for the rest (the caller names the file).
    """
    return json.loads(raw.decode("utf-8"), object_pairs_hook=reject_duplicate_keys, parse_int=_bounded_int,
                      parse_constant=_no_constant)


def parse_release_record(raw: bytes, source: str) -> dict[str, Any]:
    """Parse and validate a `release.json`. Raises ArtifactError naming the field.

    Bounded before anything is converted: the record's size, integer lengths, the number of files, each size
    (at most 1 TiB) and string lengths; duplicate keys, NaN/Infinity and unknown keys are refused.
    """
    def fail(field_name: str, message: str) -> None:
        raise ArtifactError(f"{source}: field '{field_name}': {message}")

    if not isinstance(raw, (bytes, bytearray)):
        fail("<file>", f"expected bytes, got {type(raw).__name__}")
    if len(raw) > MAX_RELEASE_RECORD_BYTES:
        fail("<file>", f"release record larger than {MAX_RELEASE_RECORD_BYTES} bytes")
    try:
        data = strict_json(bytes(raw))
    except (_RecordSyntaxError, DuplicateKeyError) as exc:
        raise ArtifactError(f"{source}: not a valid release record: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise ArtifactError(f"{source}: not a JSON release record: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}") from None
    if not isinstance(data, dict):
        fail("<root>", "expected a JSON object")
    allowed = {"format", "schema_version", "model_id", "model_revision", "calibration", "version", "files"}
    extra = sorted(set(data) - allowed)
    if extra:
        fail(str(extra[0])[:64], f"unknown key (allowed: {sorted(allowed)})")
    for key in sorted(allowed):
        if key not in data:
            fail(key, "missing")
    if data["format"] != RELEASE_FORMAT:
        fail("format", f"expected '{RELEASE_FORMAT}', got {_describe(data['format'])[:80]}")
    if type(data["schema_version"]) is not int or data["schema_version"] != RELEASE_SCHEMA_VERSION:
        fail("schema_version", f"expected {RELEASE_SCHEMA_VERSION}, got {_describe(data['schema_version'])[:80]}")
    for key in ("model_id", "model_revision", "calibration", "version"):
        if not isinstance(data[key], str):
            fail(key, f"expected a string, got {_describe(data[key])[:80]}")
        if len(data[key]) > MAX_RECORD_STRING:
            fail(key, f"longer than {MAX_RECORD_STRING} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in data["model_revision"]) or not data["model_revision"]:
        fail("model_revision", f"expected a non-empty string without control characters, got "
                               f"{_describe(data['model_revision'])}")
    try:
        check_model_id(data["model_id"])
        check_component(data["calibration"], "calibration")
    except UnsafeNameError as exc:
        raise ArtifactError(f"{source}: {exc}") from None
    if not VERSION_RE.fullmatch(data["version"]):
        fail("version", f"expected 'vN' (v1, v2, ...), got {_describe(data['version'])}")
    files = data["files"]
    if not isinstance(files, dict) or ARTIFACT_FILENAME not in files:
        fail("files", f"expected an object naming at least '{ARTIFACT_FILENAME}'")
    if len(files) > MAX_RELEASE_FILES:
        fail("files", f"{len(files)} entries, at most {MAX_RELEASE_FILES} are allowed")
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
            fail(f"files.{name}.sha256", f"expected 64 lowercase hex digits, got {_describe(entry['sha256'])[:80]}")
        if type(entry["size"]) is not int or not 0 <= entry["size"] <= MAX_RELEASE_FILE_BYTES:
            fail(f"files.{name}.size", f"expected an integer in [0, {MAX_RELEASE_FILE_BYTES}], "
                                       f"got {_describe(entry['size'])[:80]}")
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
              force: bool = False, repo_type: str = "model") -> str:
    """hf_hub_download through the cache; Hub 'not found' errors become ReleaseNotFoundError."""
    from huggingface_hub import hf_hub_download

    entry_nf, local_nf, repo_nf, rev_nf = _hub_errors()
    try:
        try:
            return hf_hub_download(repo, filename, revision=revision, token=token, cache_dir=cache_dir,
                                   endpoint=endpoint, local_files_only=offline, force_download=force,
                                   repo_type=repo_type)
        except Exception as exc:
            if is_connection_error(exc):
                raise unreachable(endpoint, f"download '{filename}' of '{repo}'", exc) from None
            raise
    except local_nf:  # before entry_nf: newer clients derive it from EntryNotFoundError
        other = _cached_as_other_type(repo, repo_type, cache_dir)
        if other is not None:
            raise WrongRepoTypeError(repo, repo_type, other, where="in the local cache (offline)") from None
        raise ReleaseNotFoundError(
            f"field 'revision': '{filename}' at '{revision}' of '{repo}' is not in the local cache and the Hub "
            "is not reachable (HF_HUB_OFFLINE is set or the network is down); pull it once online") from None
    except repo_nf:
        raise other_repo_type(repo, repo_type, token=token, endpoint=endpoint) or ReleaseNotFoundError(
            f"field 'repo': {repo_type} repository '{repo}' not found (or not visible with this token)") from None
    except rev_nf:
        raise ReleaseNotFoundError(f"field 'revision': revision '{revision}' not found in '{repo}'") from None
    except entry_nf:
        raise ReleaseNotFoundError(f"field 'path': '{filename}' not found in '{repo}' at '{revision}'") from None


def _cached_as_other_type(repo: str, repo_type: str, cache_dir) -> str | None:
    """The other repo type when the local cache holds `repo` only as that kind (for the offline error), else None."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    root = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE)
    other = next(t for t in REPO_TYPES if t != repo_type)
    here, there = (root / repo_folder_name(repo_id=repo, repo_type=t) for t in (repo_type, other))
    return other if there.is_dir() and not here.is_dir() else None


def resolve_commit(repo: str, revision: str, *, token=None, endpoint=None, repo_type: str = "model") -> str:
    """Resolve a branch, tag or sha to the commit sha it names now (online only)."""
    from huggingface_hub import HfApi

    _, _, repo_nf, rev_nf = _hub_errors()
    try:
        info = HfApi(endpoint=endpoint).repo_info(repo, revision=revision, token=token, repo_type=repo_type)
    except repo_nf:
        raise other_repo_type(repo, repo_type, token=token, endpoint=endpoint) or ReleaseNotFoundError(
            f"field 'repo': {repo_type} repository '{repo}' not found (or not visible with this token)") from None
    except rev_nf:
        raise ReleaseNotFoundError(f"field 'revision': revision '{revision}' not found in '{repo}'") from None
    except Exception as exc:
        if is_connection_error(exc):
            raise unreachable(endpoint, f"resolve revision '{revision}' of '{repo}'", exc) from None
        raise
    sha = getattr(info, "sha", None) or ""
    if not COMMIT_RE.fullmatch(sha):
        raise ArtifactError(f"{repo}@{revision}: the Hub did not return a commit sha (got {_describe(sha)})")
    return sha


def cached_ref(repo: str, revision: str, cache_dir: str | os.PathLike | None,
               repo_type: str = "model") -> str | None:
    """The commit the local Hub cache recorded for `revision` of `repo` (its `refs/<revision>` file), or None."""
    from huggingface_hub import constants

    try:
        from huggingface_hub.file_download import repo_folder_name

        folder = repo_folder_name(repo_id=repo, repo_type=repo_type)
    except ImportError:  # pragma: no cover - the layout name is stable across client versions
        folder = f"{repo_type}s--" + repo.replace("/", "--")
    ref = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE) / folder / "refs" / revision
    try:
        text = ref.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    return text if COMMIT_RE.fullmatch(text) else None


def pull_release(model_id: str, repo: str, revision: str | None = None, *, calibration: str = "default",
                 expected_sha256: dict[str, str] | None = None, token: str | None = None,
                 cache_dir: str | os.PathLike | None = None, endpoint: str | None = None,
                 local_dir: str | os.PathLike | None = None, repo_type: str = "model",
                 commit: str | None = None) -> PulledRelease:
    """Resolve, download and verify one release directory. Returns where the verified files are.

    `expected_sha256` maps file names inside the release directory (e.g. 'oscar_kv.safetensors',
    'release.json') to hex sha256 digests the caller trusts (e.g. from zoo_manifest.yaml); they are
    checked in addition to the release record. With `local_dir`, the verified files are also copied
    there (atomically: a temporary directory renamed into place). `repo_type` is the kind of Hub repo
    that holds the zoo ("model" or "dataset"); a repo of the other kind raises WrongRepoTypeError.

    `commit` is the commit the caller trusts for this release (zoo_manifest.yaml's `releases[].commit`): the
    revision must name it (online: resolved now; offline: as the cache recorded it), else nothing is used.
    Given only a tag on a cold cache (no `commit`, no `expected_sha256`), the commit the tag names is logged
    (WARNING) and, when the zoo repo holds a `zoo_manifest.yaml` at that commit that records this release, the
    release record must agree with it (commit and every hash): a tag moved to a forged commit is refused there.
    """
    check_model_id(model_id)
    check_repo_id(repo)
    check_repo_type(repo_type)
    check_component(calibration, "calibration")
    if commit is not None and (not isinstance(commit, str) or not COMMIT_RE.fullmatch(commit)):
        raise UnsafeNameError(f"field 'commit': expected a 40-hex commit sha, got {_describe(commit)}")
    if revision is None and commit is not None:
        revision = commit
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
              offline=offline, repo_type=repo_type)

    is_tag = bool(VERSION_RE.fullmatch(revision))
    pinned_commit = commit
    commit = None if offline else resolve_commit(repo, revision, token=token, endpoint=endpoint, repo_type=repo_type)
    # What this cache recorded for a tag or branch name (None: a cold cache for it, or a commit sha).
    earlier = None if COMMIT_RE.fullmatch(revision) else cached_ref(repo, revision, cache_dir, repo_type)
    if pinned_commit is not None and commit is not None and commit != pinned_commit:
        raise ArtifactError(
            f"{source}: field 'commit': '{revision}' names commit {commit} on the Hub, but the pinned commit (the "
            f"manifest's record of this release) is {pinned_commit}; the tag was moved or the pin is stale; nothing "
            "was used")
    if commit is not None and is_tag:
        if earlier is not None and earlier != commit:
            raise ArtifactError(
                f"{source}: field 'revision': release tag '{revision}' now names commit {commit}, but this cache "
                f"pulled it at commit {earlier}; release tags never move, so the Hub copy was changed; nothing was "
                "used. Pull by commit sha if you trust the new commit, or use another --cache-dir")
    # Download the record by the *revision* so the client caches revision -> commit for offline use.
    record_path = _download(repo, f"{base}/{RELEASE_FILENAME}", revision, **kw)
    cached_commit = _commit_of_cached_path(record_path, f"{base}/{RELEASE_FILENAME}")
    if commit is not None and cached_commit != commit:
        raise ArtifactError(f"{source}: field 'revision': moved from {commit} to {cached_commit} during the pull; retry")
    commit = cached_commit
    if pinned_commit is not None and commit != pinned_commit:
        raise ArtifactError(
            f"{source}: field 'commit': the local cache has '{revision}' at commit {commit}, but the pinned commit "
            f"is {pinned_commit}; nothing was used")
    if offline and not COMMIT_RE.fullmatch(revision) and pinned_commit is None:
        kind = "tag" if is_tag else "branch or tag"
        logger.warning("offline (HF_HUB_OFFLINE): serving commit %s, which the local cache recorded for %s '%s' of "
                       "%s; a %s can move on the Hub, so this may not be what it names now; pin a commit sha for a "
                       "fixed result", commit, kind, revision, repo, kind)
    source = f"{repo}@{commit[:12]}:{base}"
    record = parse_release_record(Path(record_path).read_bytes(), f"{source}/{RELEASE_FILENAME}")
    if is_tag and record["version"] != revision:
        raise ArtifactError(
            f"{source}/{RELEASE_FILENAME}: field 'version': asked for release '{revision}', but the record at commit "
            f"{commit} is release '{record['version']}' (the tag was moved or the record edited); nothing was used")
    if record["model_id"] != model_id:
        raise ArtifactError(f"{source}/{RELEASE_FILENAME}: field 'model_id': record has '{record['model_id']}', expected '{model_id}'")
    if record["calibration"] != calibration:
        raise ArtifactError(
            f"{source}/{RELEASE_FILENAME}: field 'calibration': record has '{record['calibration']}', expected '{calibration}'")
    unknown_pins = sorted(set(pins) - set(record["files"]) - {RELEASE_FILENAME})
    if unknown_pins:
        raise ArtifactError(f"{source}: field 'expected_sha256.{unknown_pins[0]}': not a file of this release")
    if not offline and not COMMIT_RE.fullmatch(revision) and pinned_commit is None and not pins and earlier is None:
        # Nothing pins this release and the cache has never seen the tag: say which commit is served, and
        # check the record against the zoo's own manifest at that commit when there is one.
        logger.warning("%s: '%s' resolved to commit %s on a cold cache; nothing pins it (pin the manifest's commit "
                       "and sha256: `oscar-calib pull --manifest zoo_manifest.yaml`, or `--commit SHA "
                       "--expected-sha256 NAME=HEX`; in Python commit=..., expected_sha256=...)", base, revision, commit)
        check_against_repo_manifest(record, repo, commit, model_id, calibration, revision, source,
                                    lambda name: _download(repo, name, commit, **kw), sha256_file(record_path))

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
        for name in list(files):  # at the resolved commit: a tag moved meanwhile cannot swap the record
            files[name] = Path(_download(repo, f"{base}/{name}", commit, force=True, **kw))
        if parse_release_record(files[RELEASE_FILENAME].read_bytes(), f"{source}/{RELEASE_FILENAME}") != record:
            raise ArtifactError(f"{source}/{RELEASE_FILENAME}: changed between two downloads of one commit; nothing was used") from None
        verify_files(files, expected, source)
        verify_files(files, pinned, source)
    pulled = PulledRelease(repo=repo, revision=revision, commit=commit, path_in_repo=base, record=record, files=files)
    logger.info("%s: release %s (asked for '%s') verified at commit %s", base, record["version"], revision, commit)
    if local_dir is not None:
        pulled.files = copy_release_files(files, Path(local_dir))
    return pulled


MANIFEST_FILENAME = "zoo_manifest.yaml"
MAX_MANIFEST_BYTES = 1 << 20


def manifest_release(manifest: Any, repo: str, model_id: str, calibration: str, version: str) -> dict | None:
    """The `releases[]` entry of a parsed zoo manifest for this release (repo, model, calibration, version)."""
    releases = manifest.get("releases") if isinstance(manifest, dict) else None
    for entry in releases if isinstance(releases, list) else []:
        if isinstance(entry, dict) and entry.get("repo", manifest.get("repo")) == repo \
                and entry.get("model_id") == model_id and entry.get("calibration", "default") == calibration \
                and entry.get("version") == version:
            return entry
    return None


def check_against_repo_manifest(record: dict, repo: str, commit: str, model_id: str, calibration: str,
                                revision: str, source: str, download, record_sha256: str | None = None) -> None:
    """Refuse a release record that disagrees with the `zoo_manifest.yaml` committed in the zoo repo at `commit`
    (when there is one and it records this version): the recorded commit and every recorded sha256 must match.
    `download(name)` returns the local path of a repo file at `commit` or raises ReleaseNotFoundError."""
    try:
        path = Path(download(MANIFEST_FILENAME))
    except ReleaseNotFoundError:
        return  # a zoo without a committed manifest: nothing to compare
    where = f"{repo}@{commit[:12]}:{MANIFEST_FILENAME}"
    try:  # the one YAML file the runtime reads; PyYAML comes with huggingface_hub, which fetched it
        import yaml
    except ImportError:
        raise ArtifactError(f"{where}: checking release '{revision}' against the zoo manifest needs PyYAML, which "
                            "is not installed (huggingface_hub normally brings it): `pip install pyyaml`; nothing "
                            "was used") from None
    raw = path.read_bytes()
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{where}: larger than {MAX_MANIFEST_BYTES} bytes; cannot check the release against it")
    try:
        manifest = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:
        raise ArtifactError(f"{where}: not a readable manifest ({type(exc).__name__}); cannot check release "
                            f"'{revision}' against it; nothing was used") from None
    entry = manifest_release(manifest, repo, model_id, calibration, record["version"])
    if entry is None:
        return
    if entry.get("commit") != commit:
        raise ArtifactError(
            f"{source}: field 'commit': the zoo manifest at commit {commit[:12]} records release "
            f"'{record['version']}' at commit {entry.get('commit')!s:.40}, but '{revision}' names {commit} (a moved "
            "tag); nothing was used")
    files = entry.get("files") if isinstance(entry.get("files"), list) else []
    recorded = {f.get("name"): f.get("sha256") for f in files if isinstance(f, dict)}
    for name, want in sorted(recorded.items()):
        got = record_sha256 if name == RELEASE_FILENAME else record["files"].get(name, {}).get("sha256")
        if got != want and (name != RELEASE_FILENAME or record_sha256 is not None):
            raise ArtifactError(f"{source}: field 'files.{name}.sha256': the release record has {got}, the zoo "
                                f"manifest at commit {commit[:12]} records {want}; nothing was used")


def copy_release_files(files: dict[str, Path], local_dir: Path, overwrite: bool = False) -> dict[str, Path]:
    """Copy verified files into `local_dir` atomically (runtime_kernels.atomic: a temporary sibling directory
    renamed into place; an interrupt leaves nothing half-written). A non-empty `local_dir` needs `overwrite`."""
    from runtime_kernels.atomic import OutputDirError, atomic_output_dir

    local_dir = Path(local_dir)
    try:
        with atomic_output_dir(local_dir, overwrite=overwrite, field="local_dir") as tmp:
            for name, src in files.items():
                dst = tmp / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
    except OutputDirError as exc:
        raise UnsafeNameError(str(exc)) from None
    return {name: Path(os.path.abspath(local_dir)) / name for name in files}


def _check_model(artifact: OscarArtifact, model_config: Any, model_id: str | None,
                 allow_other_model: bool = False) -> None:
    """check_against_model (the one identity rule) with any ArtifactError turned into ModelMismatchError."""
    try:
        check_against_model(artifact, model_config, model_id=model_id, allow_other_model=allow_other_model)
    except ArtifactError as exc:
        raise ModelMismatchError(str(exc)) from None


def load_artifact(path_or_model_id: str | os.PathLike, repo: str | None = None, revision: str | None = None,
                  model_config: Any = None, expected_sha256: dict[str, str] | None = None,
                  token: str | None = None, cache_dir: str | os.PathLike | None = None, *,
                  calibration: str = "default", endpoint: str | None = None,
                  allow_other_model: bool = False, repo_type: str = "model", commit: str | None = None,
                  model_id: str | None = None) -> OscarArtifact:
    """Load a validated artifact from a local path or from a zoo repo on the Hub.

    - `repo` is None: `path_or_model_id` is a local directory or `.safetensors` file (read_artifact);
      `expected_sha256` (name -> hex) is then checked against the files in that directory.
    - otherwise `path_or_model_id` is the model id, `repo` the zoo repo and `revision` a version tag,
      branch or commit sha: see `pull_release` (resolve to a commit, download through the cache,
      verify sha256 against the release record and `expected_sha256`; offline from a warm cache).
      `repo_type` says which kind of Hub repo `repo` is ("model", the default, or "dataset").
      `commit` (the manifest's recorded commit) pins the release: a revision naming another commit is refused.

    With `model_config` (a transformers config), the artifact is checked against it (heads, head_dim,
    layer count, and the model identity) and a mismatch raises ModelMismatchError. The model's identity is
    `model_id` when given (the Hub id a local copy of a model stands for: `model_id="Qwen/Qwen3-8B"` for a
    model loaded from `./qwen3-8b`), else the requested Hub id with `repo`, else the config's `_name_or_path`.
    `allow_other_model=True` waives the identity check only (shapes must still match).
    """
    if repo is None:
        path = Path(path_or_model_id)
        if not path.exists():
            raise ReleaseNotFoundError(
                f"{path}: no such file or directory (expected a local artifact directory or .safetensors file); "
                f"to pull a release from the Hub pass repo= and revision=")
        if expected_sha256:
            folder = path if path.is_dir() else path.parent
            paths = {name: folder / check_relative_file(name, "expected_sha256") for name in expected_sha256}
            missing = [n for n, p in paths.items() if not p.is_file()]
            if missing:
                raise ArtifactError(f"{folder}: field 'expected_sha256.{missing[0]}': file not found")
            verify_files(paths, {n: {"sha256": d} for n, d in expected_sha256.items()}, str(folder))
        artifact = read_artifact(path)
        if model_config is not None:
            _check_model(artifact, model_config, model_id, allow_other_model)
        return artifact
    hub_id = str(path_or_model_id)
    pulled = pull_release(hub_id, repo, revision, calibration=calibration, expected_sha256=expected_sha256,
                          token=token, cache_dir=cache_dir, endpoint=endpoint, repo_type=repo_type, commit=commit)
    artifact = read_artifact(pulled.artifact_path)
    if artifact.metadata.get("model_id") != hub_id:  # the release holds what it was asked for (not the model check)
        raise ModelMismatchError(
            f"{artifact.source}: field 'model_id': artifact has '{artifact.metadata.get('model_id')}', expected '{hub_id}'")
    if pulled.record["model_revision"] != artifact.metadata.get("model_revision"):
        raise ArtifactError(
            f"{artifact.source}: field 'model_revision': artifact has '{artifact.metadata.get('model_revision')}', "
            f"release record has '{pulled.record['model_revision']}'")
    if model_config is not None:
        _check_model(artifact, model_config, model_id or hub_id, allow_other_model)
    return artifact


__all__ = [
    "COMMIT_RE",
    "HubUnreachableError",
    "VERSION_RE",
    "ModelMismatchError",
    "UnsafeNameError",
    "PulledRelease",
    "RELEASE_FILENAME",
    "REPO_TYPES",
    "ReleaseNotFoundError",
    "WrongRepoTypeError",
    "cached_ref",
    "check_repo_type",
    "check_component",
    "copy_release_files",
    "check_model_id",
    "check_relative_file",
    "check_repo_id",
    "check_revision",
    "file_record",
    "is_connection_error",
    "load_artifact",
    "other_repo_type",
    "parse_release_record",
    "pull_release",
    "release_dir",
    "release_record",
    "resolve_commit",
    "sha256_file",
    "strict_json",
    "verify_files",
]
