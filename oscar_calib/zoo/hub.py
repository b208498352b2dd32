"""Publish an artifact directory as a versioned release of a zoo repo on the Hugging Face Hub.

One release = one commit that writes `<model_id>/<calibration>/` (artifact, eval receipts, model card,
`release.json` with every file's sha256 and size) + one git tag `vN` on that commit's sha.

Guarantees:
- atomic: all files go in one `create_commit`; if the upload breaks, nothing changes and no tag is made;
- no silent overwrite: the commit names `parent_commit` = the head we inspected, so a publisher who
  committed in between makes ours fail (HubError, exit 5) instead of being overwritten;
- tags never move: an existing tag with other content is refused (HubError, exit 5);
- idempotent: pushing content that a version already holds creates nothing and names that version.

Tokens are passed to huggingface_hub and never printed or logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from oscar_calib.errors import HubError, InputError, IntegrityError, OscarError
from runtime_kernels.artifact import (
    ARTIFACT_FILENAME,
    ArtifactError,
    artifacts_below,
    no_artifact_hint,
    read_artifact,
)
from runtime_kernels.loader import (
    COMMIT_RE,
    RELEASE_FILENAME,
    VERSION_RE,
    UnsafeNameError,
    check_component,
    check_model_id,
    check_repo_id,
    check_repo_type,
    is_connection_error,
    is_offline,
    other_repo_type,
    parse_release_record,
    release_dir,
    release_record,
    unreachable,
)

logger = logging.getLogger(__name__)

CARD_FILENAME = "README.md"
GENERATED = {CARD_FILENAME, RELEASE_FILENAME}
MAX_FILES = 64


@dataclass
class PushResult:
    """What a push did. `created` is False when the content was already released (nothing committed)."""

    repo: str
    version: str
    commit: str
    path_in_repo: str
    created: bool
    tagged: bool
    message: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    repo_type: str = "model"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_version(version: str) -> str:
    if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
        raise InputError(f"field 'version': expected 'vN' with N a positive integer (v1, v2, ...), got {version!r}")
    return version


def next_version(tags: list[str]) -> str:
    """One past the highest `vN` tag (v1 for a repo without version tags)."""
    numbers = [int(t[1:]) for t in tags if VERSION_RE.fullmatch(t)]
    return f"v{max(numbers, default=0) + 1}"


STATS_FILENAME = "oscar_stats.safetensors"  # oscar_calib.calibration.stats_file's name (not imported: that brings torch)
STATS_WARNING = ("{name} ({size}) holds statistics computed from your calibration data (second moments of "
                 "its keys, values and queries, the held-out sequence's captured keys, values and queries) and every "
                 "layer's o_proj weight of the model: publish it only if both may be public")


def is_receipt(name: str) -> bool:
    """Evaluation receipts (`eval*.json`): measured results the model card cites, published with the artifact."""
    return name.startswith("eval") and name.endswith(".json")


def collect_files(directory: Path, include_stats: bool = False) -> dict[str, Path]:
    """The files of an artifact directory to publish: the artifact and its evaluation receipts, plus the
    statistics file only with `include_stats` (it carries calibration data and model weights). Everything else
    (`calibration_log.json`: local paths, timings, environment) stays local: `local_only` lists it.

    Refuses symlinks, sub-directories and unsafe names, so nothing outside the directory is uploaded.
    """
    if not directory.is_dir():
        raise InputError(f"DIR {directory}: no such directory (expected an artifact directory)")
    if not (directory / ARTIFACT_FILENAME).is_file() and artifacts_below(directory):
        raise InputError(f"DIR {directory}: has no '{ARTIFACT_FILENAME}'{no_artifact_hint(directory)}")
    files: dict[str, Path] = {}
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(".") or entry.name in GENERATED:
            continue
        if entry.is_symlink() or not entry.is_file():
            raise InputError(f"DIR {directory}: '{entry.name}' is not a regular file (symlinks and sub-directories "
                             "are not published)")
        try:
            check_component(entry.name, "file name")
        except UnsafeNameError as exc:
            raise InputError(f"{directory}: {exc}") from None
        if entry.name == ARTIFACT_FILENAME or is_receipt(entry.name) or (include_stats and entry.name == STATS_FILENAME):
            files[entry.name] = entry
    if ARTIFACT_FILENAME not in files:
        raise InputError(f"DIR {directory}: has no '{ARTIFACT_FILENAME}' (expected an artifact directory, as "
                         "`oscar-calib run --out DIR` writes it)")
    if len(files) > MAX_FILES:
        raise InputError(f"DIR {directory}: {len(files)} files, at most {MAX_FILES} are published")
    return files


def local_only(directory: Path, files: dict[str, Path]) -> list[str]:
    """The regular files of `directory` that a push leaves out (generated ones aside)."""
    return sorted(e.name for e in directory.iterdir() if e.is_file() and not e.name.startswith(".")
                  and e.name not in files and e.name not in GENERATED)


def _receipts(files: dict[str, Path]) -> dict[str, Any]:
    """Evaluation receipts: JSON files named `eval*.json` in the artifact directory."""
    out = {}
    for name, path in files.items():
        if name.startswith("eval") and name.endswith(".json"):
            try:
                out[name] = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise InputError(f"field '{name}': evaluation receipt is not valid JSON: {exc}") from None
    return out


def _strip_front_matter(text: str) -> str:
    if text.startswith("---\n"):
        end = text.find("\n---", 4)
        if end != -1:
            return text[end + 4:].lstrip("\n")
    return text


def _without_section(markdown: str, heading: str) -> str:
    """`markdown` without the section that starts at the line `heading` (up to the next heading of its level)."""
    out, skipping = [], False
    level = heading.split(" ", 1)[0] + " "
    for line in markdown.splitlines():
        if line.strip() == heading:
            skipping = True
            continue
        if skipping and line.startswith(level):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out)


def how_to_use(model_id: str, repo: str, version: str, calibration: str, repo_type: str,
               files: list[str]) -> list[str]:
    """The card's one "How to use" section: install the runtime from what exists (the wheel published with the
    release, else the project's source tree: neither distribution is on a package index), then load the release
    by repo and version, which works from any folder (downloaded through the Hub cache, every sha256 verified)."""
    from oscar_calib.zoo.model_card import transformers_snippet
    from oscar_calib.zoo.wheels import is_runtime_wheel

    base = release_dir(model_id, calibration)
    wheel = next((n for n in files if is_runtime_wheel(n)), None)
    type_kw = f", repo_type={repo_type!r}" if repo_type != "model" else ""
    type_flag = f" --repo-type {repo_type}" if repo_type != "model" else ""
    cal_kw = f", calibration={calibration!r}" if calibration != "default" else ""
    cal_json = f', "calibration": "{calibration}"' if calibration != "default" else ""
    type_json = f', "repo_type": "{repo_type}"' if repo_type != "model" else ""
    lines = ["## How to use", ""]
    if wheel:
        lines += [
            "Install the serving runtime (`oscar-kv-runtime`) from the wheel published with this release; its sha256 "
            "is in `release.json`. Neither `oscar-kv-runtime` nor `oscar-calib` is on PyPI.",
            "",
            "```bash",
            "pip install huggingface_hub",
            f"hf download {repo} {base}/{wheel} --revision {version}{type_flag} --local-dir oscar-release",
            f'pip install "oscar-release/{base}/{wheel}[hf]"   # [hf]: transformers; add [gpu] for Triton on a GPU',
            "```",
        ]
    else:
        lines += [
            "Install the serving runtime (`oscar-kv-runtime`) from the oscar-calib source tree that made this release "
            "(neither `oscar-kv-runtime` nor `oscar-calib` is on PyPI; `oscar-calib push --with-wheels` publishes the "
            "runtime wheel with a release):",
            "",
            "```bash",
            'pip install "./runtime[hf]"      # in a clone of oscar-calib; [hf]: transformers; add [gpu] on a GPU',
            "```",
        ]
    lines += [
        "",
        "Then, from any folder (the release is downloaded through the Hub cache, every sha256 verified, and checked "
        "against the model):",
        "",
        *transformers_snippet(model_id, f"cache = OscarCache.from_pretrained({model_id!r}, model.config, "
                                        f"repo={repo!r}, revision={version!r}{cal_kw}{type_kw})", show_output=True),
        "",
        "In vLLM (the runtime's `[vllm]` extra; its plugin loads the release the same way):",
        "",
        "```bash",
        f"vllm serve {model_id} --block-size 64 --additional-config "
        f"'{{\"oscar\": {{\"repo\": \"{repo}\", \"revision\": \"{version}\"{cal_json}{type_json}}}}}'",
        "```",
        "",
        f"With the calibrator: `oscar-calib pull {model_id} --repo {repo} --revision {version} --calibration "
        f"{calibration}{type_flag} --local-dir DIR` verifies and copies the files.",
    ]
    return lines


def model_card(metadata: dict[str, str], repo: str, version: str, calibration: str,
               files: dict[str, dict[str, Any]], receipts: dict[str, Any], recipe: dict[str, Any] | None,
               run_report: str | None = None, repo_type: str = "model") -> str:
    """The release's README.md: base model, calibration recipe, evaluation receipts, how to load it."""
    model_id = metadata["model_id"]
    base = f"{model_id}/{calibration}"
    try:
        calib = json.loads(metadata.get("calibration", "{}"))
    except json.JSONDecodeError:
        calib = metadata.get("calibration")
    lines = [
        f"# OSCAR 2-bit KV-cache rotations for {model_id} ({calibration}, {version})",
        "",
        "## Base model",
        f"- model: `{model_id}`",
        f"- revision: `{metadata.get('model_revision')}`",
        f"- heads: {metadata.get('num_attention_heads')} query / {metadata.get('num_key_value_heads')} KV, "
        f"head_dim {metadata.get('head_dim')}",
        "",
        "## Calibration recipe",
        f"- key target: `{metadata.get('key_target')}`, value target: `{metadata.get('value_target')}`, "
        f"granularity: `{metadata.get('granularity')}`",
        f"- bits: {metadata.get('bits')}, group size: {metadata.get('group_size')}, "
        f"BF16 sink/recent tokens: {metadata.get('sink_tokens')}/{metadata.get('recent_tokens')}",
        f"- tool: `{metadata.get('tool_version')}`, created {metadata.get('created_at')}",
        "",
        "```json",
        json.dumps({"calibration": calib, **({"recipe": recipe} if recipe else {})}, indent=2, sort_keys=True),
        "```",
        "",
        "## Evaluation receipts",
    ]
    if receipts:
        for name, data in receipts.items():
            lines += [f"### {name}", "```json", json.dumps(data, indent=2, sort_keys=True), "```"]
    else:
        lines.append("None published with this release.")
    lines += ["", *how_to_use(model_id, repo, version, calibration, repo_type, sorted(files)), ""]
    lines += [
        "## Files",
        "| file | bytes | sha256 |",
        "|---|---|---|",
    ]
    lines += [f"| `{base}/{n}` | {e['size']} | `{e['sha256']}` |" for n, e in sorted(files.items())]
    if run_report:
        # The calibration run's own report (the README written by `oscar-calib run`), headings demoted.
        body = _strip_front_matter(run_report)
        body = _without_section(body, "## Use")  # one "how to use" section per card: the release's, above
        lines += ["", "## Calibration run report", ""]
        lines += [("#" + line) if line.startswith("#") else line for line in body.splitlines()]
    lines.append("")
    from oscar_calib.zoo.model_card import card_metadata, with_metadata

    dataset = calib.get("dataset") if isinstance(calib, dict) else None
    return with_metadata(card_metadata(model_id, dataset), "\n".join(lines))


def _hub_error(exc: Exception, doing: str) -> HubError:
    """Turn a huggingface_hub HTTP error into one clear HubError (status + server message, never headers)."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if status == 412:
        return HubError(f"{doing}: another publisher committed to the repo since we read it (parent commit "
                        "changed); nothing was released; run the command again to publish on top of it")
    if status in (401, 403):
        return HubError(f"{doing}: the Hub refused the credentials (HTTP {status}); check --token or HF_TOKEN")
    server_message = ""
    if response is not None:
        server_message = response.headers.get("X-Error-Message", "") or ""
    detail = f"HTTP {status}" if status else type(exc).__name__
    return HubError(f"{doing}: {detail} {server_message}".rstrip())


def _same_content(record: dict[str, Any], files: dict[str, dict[str, Any]], model_revision: str) -> bool:
    """Equal artifact content: the same non-generated files with the same hashes, same model revision."""
    remote = {n: e for n, e in record["files"].items() if n not in GENERATED}
    return remote == files and record["model_revision"] == model_revision


class _Remote:
    """The zoo repo as the Hub sees it now, through one HfApi client."""

    def __init__(self, repo: str, token: str | None, endpoint: str | None, repo_type: str = "model"):
        from huggingface_hub import HfApi

        self.repo, self.token, self.endpoint, self.repo_type = repo, token, endpoint, repo_type
        self.api = HfApi(endpoint=endpoint, token=token)
        self._cache = tempfile.TemporaryDirectory(prefix="oscar-push-")

    def close(self) -> None:
        self._cache.cleanup()

    def refs(self) -> tuple[str, dict[str, str]]:
        refs = self.api.list_repo_refs(self.repo, repo_type=self.repo_type)
        branches = {b.name: b.target_commit for b in refs.branches}
        if "main" not in branches:
            raise HubError(f"field 'repo': '{self.repo}' has no 'main' branch")
        return branches["main"], {t.name: t.target_commit for t in refs.tags}

    def refs_or_create(self, private: bool) -> tuple[str, dict[str, str]]:
        """Refs of the repo, creating it first (exist_ok: a concurrent creator is fine) when it does not exist.

        A repo of that name but the other kind is refused, not shadowed: the Hub would make a second repo
        of the same name, and pulls with the other `--repo-type` would never see this release."""
        from huggingface_hub.utils import RepositoryNotFoundError

        try:
            return self.refs()
        except RepositoryNotFoundError:
            wrong = other_repo_type(self.repo, self.repo_type, token=self.token, endpoint=self.endpoint)
            if wrong is not None:
                raise InputError(f"{wrong.flag_message()}; nothing was pushed (a new {self.repo_type} repo of the "
                                 "same name would be a second, separate zoo)") from None
            self.api.create_repo(self.repo, private=private, exist_ok=True, repo_type=self.repo_type)
            return self.refs()

    def record(self, base: str, commit: str) -> dict[str, Any] | None:
        """The release record of `base` at `commit`, or None when there is none."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import EntryNotFoundError

        try:
            path = hf_hub_download(self.repo, f"{base}/{RELEASE_FILENAME}", revision=commit, token=self.token,
                                   endpoint=self.endpoint, cache_dir=self._cache.name, repo_type=self.repo_type)
        except EntryNotFoundError:
            return None
        try:
            return parse_release_record(Path(path).read_bytes(), f"{self.repo}@{commit[:12]}:{base}/{RELEASE_FILENAME}")
        except ArtifactError as exc:
            raise IntegrityError(str(exc)) from None

    def files_under(self, base: str, commit: str) -> list[str]:
        info = self.api.repo_info(self.repo, revision=commit, repo_type=self.repo_type)
        return [s.rfilename for s in (info.siblings or []) if s.rfilename.startswith(base + "/")]


def push(directory: str | Path, repo: str, *, version: str | None = None, calibration: str = "default",
         private: bool = False, token: str | None = None, endpoint: str | None = None,
         recipe: dict[str, Any] | None = None, commit_message: str | None = None,
         repo_type: str = "model", include_stats: bool = False, wheels: list[Path] | None = None) -> PushResult:
    """Publish `directory` (an artifact directory) to `repo` as release `version` (default: next vN).
    `commit_message` replaces the default '<model_id>/<calibration>: release vN'. `repo_type` is the kind
    of Hub repo the zoo is ("model" or "dataset"); a repo of that name and the other kind is refused.
    Uploaded: the artifact, its `eval*.json` receipts, the model card and `release.json`; the statistics
    (`oscar_stats.safetensors`: calibration data and o_proj weights) only with `include_stats=True`; `wheels`
    (the runtime wheel, `oscar_calib.zoo.wheels.build_runtime_wheel`) go up beside them, and the model card's install
    line installs that wheel. Files are
    streamed from disk by huggingface_hub (a path per `CommitOperationAdd`, never read whole here)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.utils import HfHubHTTPError

    directory = Path(directory)
    try:
        check_repo_id(repo, "repo")
        check_component(calibration, "calibration")
        check_repo_type(repo_type)
    except UnsafeNameError as exc:
        raise InputError(str(exc)) from None
    if version is not None:
        check_version(version)
    files = collect_files(directory, include_stats)
    for wheel in wheels or []:
        wheel = Path(wheel)
        if not wheel.name.endswith(".whl") or not wheel.is_file() or wheel.name in files:
            raise InputError(f"wheel {wheel}: expected a .whl file whose name is not already in the release")
        check_component(wheel.name, "wheel file name")
        files[wheel.name] = wheel
    artifact = read_artifact(files[ARTIFACT_FILENAME])  # the contract is checked before anything is sent
    meta = artifact.metadata
    try:
        check_model_id(meta["model_id"], "model_id (artifact metadata)")
    except UnsafeNameError as exc:
        raise InputError(f"{artifact.source}: {exc}") from None
    base = release_dir(meta["model_id"], calibration)
    # huggingface_hub hashes each file in chunks when the operation is built and uploads from the path: the
    # record's sha256 is the client's own, so a file changed after this point fails the pull's verification.
    uploads = {name: CommitOperationAdd(f"{base}/{name}", str(path)) for name, path in files.items()}
    hashes = {name: {"sha256": op.upload_info.sha256.hex(), "size": op.upload_info.size}
              for name, op in uploads.items()}
    receipts = _receipts(files)
    local_card = directory / CARD_FILENAME
    run_report = local_card.read_text(encoding="utf-8", errors="replace") if local_card.is_file() else None
    if is_offline():
        raise HubError("push needs the Hub but HF_HUB_OFFLINE is set; unset it to publish")

    remote = _Remote(repo, token, endpoint, repo_type)
    doing = f"push to {repo}"
    try:
        try:
            head, tags = remote.refs_or_create(private)
            # 1. An explicit version that exists already: same content -> nothing to do; else refuse.
            if version is not None and version in tags:
                rec = remote.record(base, tags[version])
                if rec is not None and _same_content(rec, hashes, meta["model_revision"]):
                    return PushResult(repo, version, tags[version], base, False, False,
                                      f"identical content is already released as {version}; nothing pushed", hashes, repo_type)
                raise HubError(f"field 'version': tag '{version}' already exists on commit {tags[version]} with "
                               "different content for this model; tags are never moved; choose a new version")
            # 2. Identical content already at the head or under any version tag: create nothing.
            rec = remote.record(base, head)
            if rec is not None and _same_content(rec, hashes, meta["model_revision"]):
                if rec["version"] in tags:
                    return PushResult(repo, rec["version"], tags[rec["version"]], base, False, False,
                                      f"identical content is already released as {rec['version']}; nothing pushed",
                                      hashes, repo_type)
                # An earlier push committed but died before tagging: finish that release.
                remote.api.create_tag(repo, tag=rec["version"], revision=head, repo_type=repo_type)
                return PushResult(repo, rec["version"], head, base, False, True,
                                  f"content was committed but untagged; tagged it {rec['version']}", hashes, repo_type)
            for tag in sorted(tags, key=lambda t: int(t[1:]) if VERSION_RE.fullmatch(t) else -1, reverse=True):
                old = remote.record(base, tags[tag])
                if old is not None and _same_content(old, hashes, meta["model_revision"]):
                    return PushResult(repo, tag, tags[tag], base, False, False,
                                      f"identical content is already released as {tag}; nothing pushed", hashes, repo_type)
            # 3. A new release: one commit on top of `head`, then the tag on that commit's sha.
            version = version or next_version(list(tags))
            card = model_card(meta, repo, version, calibration, hashes, receipts, recipe, run_report,
                              repo_type).encode()
            listed = {**hashes, CARD_FILENAME: {"sha256": _sha256(card), "size": len(card)}}
            record = release_record(meta["model_id"], meta["model_revision"], calibration, version, listed)
            record_bytes = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()
            ops: list[Any] = list(uploads.values())
            ops += [CommitOperationAdd(f"{base}/{CARD_FILENAME}", card),
                    CommitOperationAdd(f"{base}/{RELEASE_FILENAME}", record_bytes)]
            keep = {f"{base}/{n}" for n in [*files, CARD_FILENAME, RELEASE_FILENAME]}
            ops += [CommitOperationDelete(p) for p in remote.files_under(base, head) if p not in keep]
            logger.info("committing %d file(s) to %s on top of %s", len(ops), repo, head[:12])
            info = remote.api.create_commit(repo, ops, commit_message=commit_message or f"{base}: release {version}",
                                            commit_description=f"OSCAR KV rotations for {meta['model_id']}",
                                            parent_commit=head, revision="main", repo_type=repo_type)
            commit = info.oid
            if not COMMIT_RE.fullmatch(commit or ""):
                raise HubError(f"{doing}: the Hub did not return a commit sha")
            try:
                remote.api.create_tag(repo, tag=version, revision=commit, repo_type=repo_type)
            except HfHubHTTPError as exc:
                if getattr(exc.response, "status_code", None) == 409:
                    raise HubError(f"{doing}: tag '{version}' was created by someone else meanwhile; commit {commit} "
                                   "is on main but untagged; run push again (it will tag or re-release)") from None
                raise
            return PushResult(repo, version, commit, base, True, True, f"released {version} at {commit}", hashes, repo_type)
        except HfHubHTTPError as exc:
            raise _hub_error(exc, doing) from None
        except Exception as exc:
            if is_connection_error(exc):
                raise HubError(str(unreachable(endpoint, f"push to {repo}", exc, reads=False))) from None
            raise
    finally:
        remote.close()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Runtime and client errors -> OscarErrors with documented exit codes (message only, never headers)."""
    from huggingface_hub.utils import HfHubHTTPError

    from runtime_kernels.artifact import ArtifactError
    from runtime_kernels.loader import (
        HubUnreachableError,
        ModelMismatchError,
        ReleaseNotFoundError,
        UnsafeNameError,
        WrongRepoTypeError,
    )

    try:
        yield
    except OscarError:
        raise
    except WrongRepoTypeError as exc:  # before ReleaseNotFoundError, its base: a wrong option, not a missing repo
        raise InputError(exc.flag_message()) from None
    except HubUnreachableError as exc:
        raise HubError(str(exc)) from None
    except UnsafeNameError as exc:
        raise InputError(str(exc)) from None
    except ModelMismatchError as exc:
        raise InputError(str(exc)) from None
    except ArtifactError as exc:
        raise IntegrityError(str(exc)) from None
    except ReleaseNotFoundError as exc:
        raise HubError(str(exc)) from None
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        raise HubError(f"the Hub answered HTTP {status}: {str(exc).splitlines()[0]}") from None
    except Exception as exc:
        if is_connection_error(exc):
            raise HubError(str(unreachable(None, "reach it", exc))) from None
        raise


def what_the_zoo_holds(message: str, repo: str, revision: str | None, *, token: str | None = None,
                       endpoint: str | None = None, repo_type: str = "model") -> str:
    """What to add to a 'not found' of `pull`: the releases the zoo holds at that revision when the model or
    calibration is missing, its version tags when the revision is, and `vN` for a bare number. '' when nothing
    helps or the Hub cannot be asked (offline, unreachable)."""
    hint = ""
    if revision is not None and revision.isdigit() and len(revision) < 7:
        hint = f"; release tags are written 'v{int(revision)}' (--revision v{int(revision)})"
    if is_offline() or "not in the local cache" in message:
        return hint
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    try:
        if "field 'revision'" in message:
            tags = [t.name for t in api.list_repo_refs(repo, repo_type=repo_type).tags if VERSION_RE.fullmatch(t.name)]
            tags.sort(key=lambda t: int(t[1:]))
            return hint + (f"; its release tags are {', '.join(tags)}" if tags else "; it has no release tags (vN)")
        if "field 'path'" in message:
            info = api.repo_info(repo, revision=revision or "main", repo_type=repo_type)
            held = sorted({name.rsplit("/", 1)[0] for name in (s.rfilename for s in info.siblings or [])
                           if name.endswith("/" + RELEASE_FILENAME) and name.count("/") == 3})
            shown = [f"{d.rsplit('/', 1)[0]} (--calibration {d.rsplit('/', 1)[1]})" for d in held[:20]]
            more = f" and {len(held) - 20} more" if len(held) > 20 else ""
            return hint + (f"; at '{revision}' the zoo holds {', '.join(shown)}{more}" if held else
                           f"; the zoo holds no release at '{revision}'")
    except Exception:  # noqa: BLE001 - a hint is best effort: the refusal itself is already worded
        return hint
    return hint


def pull(model_id: str, repo: str, revision: str | None, *, calibration: str = "default",
         local_dir: str | Path | None = None, token: str | None = None, cache_dir: str | Path | None = None,
         endpoint: str | None = None, expected_sha256: dict[str, str] | None = None, model_config: Any = None,
         repo_type: str = "model", commit: str | None = None):
    """Download and verify a release (runtime_kernels.loader.pull_release), read the artifact, check it
    against `model_config`, and only then copy the files to `local_dir`. Errors become OscarErrors."""
    from runtime_kernels.artifact import check_against_model
    from runtime_kernels.loader import (
        ModelMismatchError,
        ReleaseNotFoundError,
        WrongRepoTypeError,
        copy_release_files,
        pull_release,
    )

    with translate_errors():
        try:
            pulled = pull_release(model_id, repo, revision, calibration=calibration, token=token,
                                  cache_dir=cache_dir, endpoint=endpoint, expected_sha256=expected_sha256,
                                  repo_type=repo_type, commit=commit)
        except ReleaseNotFoundError as exc:
            if isinstance(exc, WrongRepoTypeError):
                raise
            message = str(exc)
            if message.startswith("field 'path'"):  # the release directory is missing: say it of the model
                message = (f"MODEL {model_id}: no release of it (calibration '{calibration}') in '{repo}' at "
                           f"'{revision or commit or 'main'}'")
            raise HubError(message + what_the_zoo_holds(str(exc), repo, revision, token=token, endpoint=endpoint,
                                                        repo_type=repo_type)) from None
        artifact = read_artifact(pulled.artifact_path)
        if artifact.metadata["model_id"] != model_id:
            raise ModelMismatchError(f"{artifact.source}: field 'model_id': artifact has "
                                     f"'{artifact.metadata['model_id']}', expected '{model_id}'")
        if model_config is not None:
            try:
                check_against_model(artifact, model_config, model_id=model_id)
            except ArtifactError as exc:
                raise ModelMismatchError(str(exc)) from None
        if local_dir is not None:
            pulled.files = copy_release_files(pulled.files, Path(local_dir))
    return pulled
