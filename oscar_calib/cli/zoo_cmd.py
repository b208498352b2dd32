"""`oscar-calib zoo validate|build|publish|schema`: the rotation zoo driven by `zoo_manifest.yaml`.

- validate: parse the manifest strictly; online (unless HF_HUB_OFFLINE=1 or --offline), check every
  release exists as recorded: its tag names the recorded commit and every file has the recorded sha256.
- build: run the calibration of every recipe that has no release (into `--out-root/<model_id>/<calibration>`).
- publish: push every built recipe without a release and record the release in the manifest.
- schema: print (or `--write`) the JSON Schema generated from the pydantic models.

Exit codes: 2 bad manifest or option, 4 a recorded hash does not match, 5 a release is missing on the Hub.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from oscar_calib.cli._common import check_flags, endpoint, push_plan, translate_errors
from oscar_calib.cli.app import CONTEXT, app
from oscar_calib.cli.help_layout import UserOrderGroup
from oscar_calib.cli.options import DeviceOpt, JsonOpt, RepoType, TokenOpt, ZooRepoTypeOpt
from oscar_calib.cli.output import Output
from oscar_calib.errors import HubError, InputError, IntegrityError

zoo_app = typer.Typer(help="Validate, build, publish and list the rotation zoo described by zoo_manifest.yaml.",
                      no_args_is_help=True, context_settings=CONTEXT, cls=UserOrderGroup)
app.add_typer(zoo_app, name="zoo")

ManifestOpt = Annotated[Path, typer.Option("--manifest", help="Path of zoo_manifest.yaml.")]
OutRootOpt = Annotated[Path, typer.Option("--out-root", help="Where built artifact directories go.")]
LocalModelOpt = Annotated[
    list[str] | None,
    typer.Option("--local-model", help="MODEL_ID=DIR: read MODEL_ID's weights from a local mirror of its pinned "
                                       "revision (repeatable)."),
]


def _local_models(pairs: list[str] | None) -> dict[str, Path]:
    out = {}
    for pair in pairs or []:
        model_id, sep, directory = pair.partition("=")
        if not sep or not model_id or not directory:
            raise InputError(f"--local-model {pair!r}: expected MODEL_ID=DIR")
        if not Path(directory).is_dir():
            raise InputError(f"--local-model {pair!r}: '{directory}' is not a directory")
        out[model_id] = Path(directory)
    return out


def build_dir(out_root: Path, model_id: str, calibration: str) -> Path:
    return out_root / model_id / calibration


# --- validate ------------------------------------------------------------------------------------
def check_release_online(release, token: str | None) -> None:
    """The release exists as recorded: tag -> recorded commit, every recorded file with its sha256/size."""
    from huggingface_hub import HfApi

    from runtime_kernels.loader import pull_release

    where = f"release {release.repo} {release.version} ({release.path_in_repo})"
    try:
        refs = HfApi(endpoint=endpoint(), token=token).list_repo_refs(release.repo, repo_type=release.repo_type)
    except Exception as exc:
        raise_wrong_repo_type(exc, release.repo, release.repo_type, token, recorded_in=where)
        raise
    tags = {t.name: t.target_commit for t in refs.tags}
    if release.version not in tags:
        raise HubError(f"{where}: field 'version': tag '{release.version}' does not exist on the Hub")
    if tags[release.version] != release.commit:
        raise HubError(f"{where}: field 'commit': tag points to {tags[release.version]}, manifest records {release.commit}")
    with tempfile.TemporaryDirectory(prefix="oscar-zoo-validate-") as cache:
        pulled = pull_release(release.model_id, release.repo, release.commit, calibration=release.calibration,
                              expected_sha256=release.sha256s(), token=token, cache_dir=cache, endpoint=endpoint(),
                              repo_type=release.repo_type)
        recorded = {f.name for f in release.files}
        listed = set(pulled.record["files"]) | {"release.json"}
        if recorded != listed:
            raise IntegrityError(f"{where}: field 'files': manifest lists {sorted(recorded)}, the release has "
                                 f"{sorted(listed)}")
        for f in release.files:
            size = pulled.files[f.name].stat().st_size
            if size != f.size:
                raise IntegrityError(f"{where}: field 'files.{f.name}.size': recorded {f.size}, got {size}")


@zoo_app.command("validate")
def validate_cmd(
    manifest: ManifestOpt = Path("zoo_manifest.yaml"),
    offline: Annotated[bool, typer.Option("--offline", help="Only check the file, not the Hub.")] = False,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check the manifest against its schema and (online) that every release exists as recorded."""
    from oscar_calib.zoo.manifest import load_manifest
    from runtime_kernels.loader import is_offline

    output = Output(as_json)
    zoo = load_manifest(manifest)
    output.note(f"{manifest}: {len(zoo.recipes)} recipe(s), {len(zoo.releases)} release(s), schema ok")
    hub_checked = not (offline or is_offline())
    if not hub_checked:
        if zoo.releases:
            output.note("offline: releases were not checked against the Hub")
    else:
        with translate_errors():
            for release in zoo.releases:
                check_release_online(release, token)
                output.note(f"ok {release.repo} {release.version} {release.path_in_repo} {release.commit}")
    if as_json:
        output.json({"valid": True, "recipes": len(zoo.recipes), "releases": len(zoo.releases),
                     "pending": [f"{r.model_id}/{r.calibration}" for r in zoo.pending()],
                     "hub_checked": hub_checked}, indent=2)
    else:
        output.result("valid")


# --- build ---------------------------------------------------------------------------------------
def relabel_artifact(directory: Path, model_id: str, model_revision: str) -> None:
    """A recipe calibrated from a local mirror: record the Hub model id and pinned revision it mirrors."""
    from runtime_kernels.artifact import read_artifact, write_artifact

    artifact = read_artifact(directory)
    artifact.metadata["model_id"] = model_id
    artifact.metadata["model_revision"] = model_revision
    write_artifact(artifact, directory)


@zoo_app.command("build")
def build_cmd(
    manifest: ManifestOpt = Path("zoo_manifest.yaml"),
    out_root: OutRootOpt = Path("zoo/build"),
    local_model: LocalModelOpt = None,
    device: DeviceOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Rebuild directories that exist.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run the calibration of every recipe that has no release yet."""
    from oscar_calib.calibration.job import run_calibration
    from oscar_calib.zoo.manifest import load_manifest

    output = Output(as_json)
    zoo = load_manifest(manifest)
    mirrors = _local_models(local_model)
    pending = zoo.pending()
    if not pending:
        output.note("every recipe has a release; nothing to build")
    built = []
    for recipe in pending:
        out = build_dir(out_root, recipe.model_id, recipe.calibration)
        row = {"model_id": recipe.model_id, "calibration": recipe.calibration, "out": str(out)}
        if (out / "oscar_kv.safetensors").is_file() and not overwrite:
            output.note(f"{out}: already built (pass --overwrite to rebuild)")
            built.append(row | {"built": False})
            if not as_json:
                output.result(out)
            continue
        mirror = mirrors.get(recipe.model_id)
        config = recipe.to_config(model=str(mirror) if mirror else None, device=device, base_dir=manifest.parent)
        run_calibration(config, out, overwrite=overwrite, console=output.console)
        if mirror is not None:
            relabel_artifact(out, recipe.model_id, recipe.model_revision)
        built.append(row | {"built": True})
        if not as_json:
            output.result(out)
    if as_json:
        output.json({"recipes": built}, indent=2, sort_keys=True)


# --- publish -------------------------------------------------------------------------------------
def _metrics(directory: Path) -> dict[str, float]:
    """Headline numbers of the run log (flattened, finite floats only) for the manifest."""
    log = directory / "calibration_log.json"
    if not log.is_file():
        return {}
    try:
        summary = json.loads(log.read_text()).get("summary", {})
    except (OSError, json.JSONDecodeError):
        return {}
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[prefix] = float(value)

    walk("", summary if isinstance(summary, dict) else {})
    return out


@zoo_app.command("publish")
def publish_cmd(
    manifest: ManifestOpt = Path("zoo_manifest.yaml"),
    out_root: OutRootOpt = Path("zoo/build"),
    repo: Annotated[str | None, typer.Option("--repo", help="Zoo repo (default: the manifest's).")] = None,
    repo_type: ZooRepoTypeOpt = None,
    private: Annotated[bool, typer.Option("--private", help="Create the repo private (if it does not exist).")] = False,
    commit_message: Annotated[str | None, typer.Option("--commit-message", help="Commit message of each release "
                                                       "(default: '<model_id>/<calibration>: release vN').")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check and list what would be published; push "
                                                            "nothing and leave the manifest as it is.")] = False,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Push every built recipe without a release, and record each release in the manifest.

    The manifest is edited in place (comments, order and spelling of everything else kept); each release is
    recorded right after its push, so a later failure never loses an earlier release.
    """
    from oscar_calib.zoo.hub import push
    from oscar_calib.zoo.manifest import Release, ReleaseFile, append_release, load_manifest
    from runtime_kernels.artifact import read_artifact
    from runtime_kernels.loader import file_record, pull_release

    output = Output(as_json)
    check_flags(repo=("--repo", repo))
    zoo = load_manifest(manifest)
    target = repo or zoo.repo
    kind = repo_type.value if repo_type is not None else zoo.repo_type
    published = []
    for recipe in zoo.pending():
        directory = build_dir(out_root, recipe.model_id, recipe.calibration)
        if not (directory / "oscar_kv.safetensors").is_file():
            raise InputError(f"recipe {recipe.model_id}/{recipe.calibration}: not built ({directory} has no artifact); "
                             "run `oscar-calib zoo build` first")
        with translate_errors():
            meta = read_artifact(directory).metadata
        for key in ("model_id", "model_revision"):
            if meta[key] != getattr(recipe, key):
                raise InputError(f"{directory}: field '{key}': artifact has '{meta[key]}', the recipe pins "
                                 f"'{getattr(recipe, key)}'; nothing was published")
        if dry_run:
            plan = push_plan(directory, target, recipe.calibration) | {"repo_type": kind}
            published.append(plan)
            if not as_json:
                output.result(f"would publish {directory} -> {kind} repo {target} {plan['path_in_repo']} (next free "
                              f"version): {len(plan['files'])} file(s), {sum(f['size'] for f in plan['files'].values())} bytes")
            continue
        with translate_errors():
            result = push(directory, target, calibration=recipe.calibration, private=private, token=token,
                          endpoint=endpoint(), recipe=json.loads(recipe.model_dump_json()),
                          commit_message=commit_message, repo_type=kind)
            with tempfile.TemporaryDirectory(prefix="oscar-zoo-publish-") as cache:
                # Read back what the Hub now serves (verified), to record exactly those bytes.
                pulled = pull_release(recipe.model_id, target, result.commit, calibration=recipe.calibration,
                                      token=token, cache_dir=cache, endpoint=endpoint(), repo_type=kind)
                files = [ReleaseFile(name=n, sha256=e["sha256"], size=e["size"]) for n, e in pulled.record["files"].items()]
                rec = file_record(pulled.files["release.json"])
                files.append(ReleaseFile(name="release.json", **rec))
        release = Release(model_id=recipe.model_id, calibration=recipe.calibration,
                          model_revision=recipe.model_revision, repo=target, repo_type=kind, version=result.version,
                          commit=result.commit, files=files, metrics=_metrics(directory))
        append_release(manifest, release)  # after every push: a later failure never loses an earlier release
        published.append(result.as_dict())
        if not as_json:
            output.result(f"{target} {result.version} {result.commit} {result.path_in_repo}")
        output.note(result.message)
    if not published:
        output.note("every recipe has a release; nothing to publish")
    if as_json:
        output.json({"dry_run": dry_run, "releases": published}, indent=2, sort_keys=True)


# --- list ----------------------------------------------------------------------------------------
@zoo_app.command("list")
def list_cmd(
    repo: Annotated[str | None, typer.Option("--repo", help="Zoo repo id ORG/NAME (default: the manifest's).")] = None,
    manifest: ManifestOpt = Path("zoo_manifest.yaml"),
    repo_type: ZooRepoTypeOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List the releases a zoo repo holds: one row per version tag (model, calibration, commit, files)."""
    from oscar_calib.zoo.manifest import load_manifest

    output = Output(as_json)
    kind = repo_type.value if repo_type is not None else RepoType.model.value
    if repo is None:
        if not manifest.is_file():
            raise InputError(f"--repo: required (no manifest at {manifest} to take the default repo from)")
        zoo = load_manifest(manifest)
        repo, kind = zoo.repo, kind if repo_type is not None else zoo.repo_type
    check_flags(repo=("--repo", repo))
    with translate_errors():
        rows = list_releases(repo, kind, token)
    if as_json:
        output.json({"repo": repo, "repo_type": kind, "releases": rows}, indent=2, sort_keys=True)
        return
    from rich.table import Table

    table = Table(title=f"{repo} ({kind} repo): {len(rows)} release(s)")
    for col in ("version", "model", "calibration", "model revision", "commit", "files", "bytes"):
        table.add_column(col, justify="right" if col in ("files", "bytes") else "left")
    for r in rows:
        table.add_row(r["version"], r["model_id"], r["calibration"], r["model_revision"][:12], r["commit"][:12],
                      str(len(r["files"])), str(sum(f["size"] for f in r["files"].values())))
    output.rich(table)


def list_releases(repo: str, repo_type: str, token: str | None) -> list[dict]:
    """Every version tag of `repo` with the release it made: the `release.json` at that tag whose `version`
    is the tag (a tag's commit also holds the earlier releases of other models). Oldest first."""
    from huggingface_hub import HfApi, hf_hub_download

    from runtime_kernels.loader import parse_release_record

    api = HfApi(endpoint=endpoint(), token=token)
    try:
        refs = api.list_repo_refs(repo, repo_type=repo_type)
    except Exception as exc:
        raise_wrong_repo_type(exc, repo, repo_type, token)
        raise
    tags = {t.name: t.target_commit for t in refs.tags}
    rows = []
    with tempfile.TemporaryDirectory(prefix="oscar-zoo-list-") as cache:
        for tag in sorted(tags, key=lambda t: (len(t), t)):
            info = api.repo_info(repo, revision=tags[tag], repo_type=repo_type, files_metadata=False)
            for name in sorted(s.rfilename for s in info.siblings or [] if s.rfilename.endswith("/release.json")):
                path = hf_hub_download(repo, name, revision=tags[tag], repo_type=repo_type, token=token,
                                       endpoint=endpoint(), cache_dir=cache)
                record = parse_release_record(Path(path).read_bytes(), f"{repo}@{tag}:{name}")
                if record["version"] == tag:
                    rows.append({"version": tag, "commit": tags[tag], "path_in_repo": name.rsplit("/", 1)[0],
                                 **{k: record[k] for k in ("model_id", "calibration", "model_revision", "files")}})
    return rows


def raise_wrong_repo_type(exc: Exception, repo: str, repo_type: str, token: str | None,
                          recorded_in: str | None = None) -> None:
    """After a 'repository not found' from the Hub: a clear error when the repo is the other kind, naming
    --repo-type, or the manifest field when the type came from `recorded_in` (else return: the caller re-raises)."""
    from huggingface_hub.utils import RepositoryNotFoundError

    from runtime_kernels.loader import other_repo_type

    if isinstance(exc, RepositoryNotFoundError):
        wrong = other_repo_type(repo, repo_type, token=token, endpoint=endpoint())
        if wrong is None:
            return
        if recorded_in is None:
            raise InputError(wrong.flag_message()) from None
        raise InputError(f"{recorded_in}: field 'repo_type': recorded '{repo_type}', but '{repo}' is a "
                         f"{wrong.actual} repo on the Hub; record `repo_type: {wrong.actual}`") from None


# --- schema --------------------------------------------------------------------------------------
@zoo_app.command("schema")
def schema_cmd(
    write: Annotated[Path | None, typer.Option("--write", help="Write the schema to this file instead of stdout.")] = None,
) -> None:
    """Print the manifest's JSON Schema (generated from the pydantic models)."""
    from oscar_calib.zoo.manifest import json_schema

    output = Output()
    text = json_schema()
    if write is None:
        output.result(text, end="")
    else:
        write.write_text(text, encoding="utf-8")
        output.result(write)
