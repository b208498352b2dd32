"""`oscar-calib push` and `oscar-calib pull`: publish to and fetch from a zoo repo on the Hub.

Exit codes (oscar_calib.cli.exit_codes): 0 ok (also when the content was already released, unless
`--version` asked for a new version: then 6), 2 bad input (names with '..', control characters or
absolute paths; artifact for another model; a repo of the other --repo-type), 4 integrity (sha256 mismatch, broken artifact), 5 Hub
refused (tag exists with other content, concurrent publisher, unknown repo/revision/release).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from oscar_calib.cli._common import check_flags, endpoint, load_config, push_plan, translate_errors
from oscar_calib.cli.app import app
from oscar_calib.cli.options import JsonOpt, RepoType, RepoTypeOpt, RevisionOpt, TokenOpt
from oscar_calib.cli.output import Output
from oscar_calib.errors import InputError

CalibrationOpt = Annotated[
    str, typer.Option("--calibration", help="Calibration name: the release lives in '<model_id>/<calibration>/'.")]
RepoOpt = Annotated[str, typer.Option("--repo", help="Zoo repo id ORG/NAME on the Hub.")]


_PUSH_EXAMPLES = """
Examples:

  oscar-calib push zoo/qwen3-8b --repo my-org/oscar-zoo                 # next version vN
  oscar-calib push zoo/qwen3-8b --repo my-org/oscar-zoo --with-wheels   # with the runtime wheel the card installs
  oscar-calib push zoo/qwen3-8b --repo my-org/oscar-zoo --version v3 --calibration chat
  oscar-calib push zoo/qwen3-8b --repo my-org/oscar-zoo --repo-type dataset        # in a dataset repo
"""


@app.command("push", epilog=_PUSH_EXAMPLES)
def push_cmd(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Artifact directory, as `run --out` writes it (statistics stay local unless --include-stats).")],
    repo: RepoOpt,
    repo_type: RepoTypeOpt = RepoType.model,
    version: Annotated[str | None, typer.Option("--version", help="Version tag vN (default: next free vN).")] = None,
    calibration: CalibrationOpt = "default",
    private: Annotated[bool, typer.Option("--private", help="Create the repo private (if it does not exist).")] = False,
    commit_message: Annotated[str | None, typer.Option("--commit-message", help="Commit message (default: "
                                                       "'<model_id>/<calibration>: release vN').")] = None,
    allow_unchanged: Annotated[bool, typer.Option("--allow-unchanged", help="With --version: accept that the "
                                                  "content is already released as another version (exit 0).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the directory and list what would be "
                                                            "uploaded; contact no Hub.")] = False,
    include_stats: Annotated[bool, typer.Option("--include-stats", help="Also upload oscar_stats.safetensors: "
                                                "statistics of your calibration data and the model's o_proj "
                                                "weights (off by default).")] = False,
    with_wheels: Annotated[bool, typer.Option("--with-wheels", help="Also build the serving runtime's wheel "
                                              "(oscar-kv-runtime) from this source tree and publish it with the "
                                              "release; the model card's install line installs it.")] = False,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Publish an artifact directory as one atomic, tagged release of a zoo repo.

    Uploads the artifact, its eval*.json receipts, a model card and release.json. The statistics file goes up
    only with --include-stats (a warning says what it holds); calibration_log.json stays local.

    Content that is already released creates nothing and names that version. With `--version vN`, that is
    an error (exit 6) unless the release is vN itself or `--allow-unchanged` is given.
    """
    from oscar_calib.cli.exit_codes import UnchangedRelease
    from oscar_calib.zoo.hub import push

    output = Output(as_json)
    check_flags(repo=("--repo", repo), calibration=("--calibration", calibration), version=("--version", version))
    if not directory.is_dir():
        what = "not a directory" if directory.exists() else "no such directory"
        raise InputError(f"DIR {directory}: {what} (expected an artifact directory)")
    from oscar_calib.zoo.hub import STATS_FILENAME, STATS_WARNING
    from runtime_kernels.units import format_bytes

    stats = directory / STATS_FILENAME
    if include_stats and stats.is_file():
        output.warn(f"--include-stats: {STATS_WARNING.format(name=stats, size=format_bytes(stats.stat().st_size))}")
    if dry_run:

        plan = push_plan(directory, repo, calibration, include_stats) | {"version": version or "next free vN",
                                                                           "repo_type": repo_type.value,
                                                                           "with_wheels": with_wheels}
        if as_json:
            output.json(plan, indent=2, sort_keys=True)
        else:
            output.result(f"would publish {directory} -> {repo_type.value} repo {repo} {plan['path_in_repo']} as "
                          f"{plan['version']}:")
            for name, rec in plan["files"].items():
                output.result(f"  {name}  {rec['size']} bytes  sha256 {rec['sha256']}")
            output.result("  + README.md (model card) and release.json, generated")
            if with_wheels:
                output.result("  + the oscar-kv-runtime wheel, built from this source tree when pushing")
            if plan["local_only"]:
                output.result(f"kept local: {', '.join(plan['local_only'])}")
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="oscar-wheels-") as built:
        wheels = []
        if with_wheels:
            from oscar_calib.zoo.wheels import build_runtime_wheel

            wheels = [build_runtime_wheel(Path(built))]
        with translate_errors(flags=True):
            result = push(directory, repo, version=version, calibration=calibration, private=private, token=token,
                          endpoint=endpoint(), commit_message=commit_message, repo_type=repo_type.value,
                          include_stats=include_stats, wheels=wheels)
    if version is not None and result.version != version and not result.created and not allow_unchanged:
        raise UnchangedRelease(f"--version {version}: the content of {directory} is already released as "
                               f"{result.version} (commit {result.commit}); nothing was pushed. Pass "
                               "--allow-unchanged to accept that, or change the artifact")
    if as_json:
        output.json(result.as_dict(), indent=2, sort_keys=True)
    else:
        output.result(f"{result.repo} {result.version} {result.commit} {result.path_in_repo}")
        output.note(result.message)


_PULL_EXAMPLES = """
Examples:

  oscar-calib pull Qwen/Qwen3-8B --repo my-org/oscar-zoo --revision v3
  oscar-calib pull Qwen/Qwen3-8B --repo my-org/oscar-zoo --revision v3 --local-dir ./qwen3-8b-kv
  HF_HUB_OFFLINE=1 oscar-calib pull Qwen/Qwen3-8B --repo my-org/oscar-zoo --revision v3   # from the cache
  oscar-calib pull Qwen/Qwen3-8B --repo my-org/oscar-zoo --repo-type dataset --revision v1
"""


@app.command("pull", epilog=_PULL_EXAMPLES)
def pull_cmd(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="Model id, e.g. Qwen/Qwen3-8B.")],
    repo: RepoOpt,
    repo_type: RepoTypeOpt = RepoType.model,
    revision: RevisionOpt = None,
    calibration: CalibrationOpt = "default",
    local_dir: Annotated[Path | None, typer.Option("--local-dir", help="Also copy the verified files here.")] = None,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", help="Hub cache (default: HF_HOME's).")] = None,
    model_config: Annotated[Path | None, typer.Option("--model-config", help="Local model dir or config.json to check the artifact against.")] = None,
    commit: Annotated[str | None, typer.Option("--commit", help="The commit this release must be at (the manifest's record); anything else is refused.")] = None,
    expected_sha256: Annotated[list[str] | None, typer.Option("--expected-sha256", help="NAME=HEX, repeatable: a file of the release must have this sha256.")] = None,
    manifest: Annotated[Path | None, typer.Option("--manifest", help="zoo_manifest.yaml: take --commit and every file's sha256 from its record of this release.")] = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Download a release through the Hub cache, verify every sha256, and check it against the model."""
    from oscar_calib.zoo.hub import pull

    output = Output(as_json)
    check_flags(model=("MODEL", model), repo=("--repo", repo), calibration=("--calibration", calibration),
                revision=("--revision", revision))
    config = load_config(model_config)
    if revision is None and commit is None and manifest is None:
        raise InputError("--revision: required (a version tag such as v3, or a commit sha) so the pull is pinned")
    pins = _parse_pins(expected_sha256)
    if manifest is not None:
        commit, pins = _manifest_pins(manifest, model, repo, calibration, revision, commit, pins)
    with translate_errors(flags=True):
        pulled = pull(model, repo, revision, calibration=calibration, local_dir=local_dir, token=token,
                      cache_dir=cache_dir, endpoint=endpoint(), model_config=config, repo_type=repo_type.value,
                      commit=commit, expected_sha256=pins or None)
    folder = pulled.artifact_path.parent
    if as_json:
        output.json({"repo": repo, "repo_type": repo_type.value, "revision": revision, "commit": pulled.commit, "path_in_repo": pulled.path_in_repo,
                     "directory": str(folder), "files": pulled.record["files"]}, indent=2, sort_keys=True)
    else:
        output.result(folder)
        output.note(f"verified {len(pulled.record['files'])} file(s) of {repo}@{revision or commit} (commit {pulled.commit})")


def _parse_pins(items: list[str] | None) -> dict[str, str]:
    """`--expected-sha256 NAME=HEX` items as a dict (checked by the loader, named by the flag here)."""
    import re

    pins: dict[str, str] = {}
    for item in items or []:
        name, sep, digest = item.partition("=")
        if not sep or not name or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise InputError(f"--expected-sha256 {item!r}: expected NAME=HEX (a file name of the release, '=', 64 "
                             "lowercase hex digits)")
        if name in pins and pins[name] != digest:
            raise InputError(f"--expected-sha256: two different digests for '{name}'")
        pins[name] = digest
    return pins


def _manifest_pins(path: Path, model: str, repo: str, calibration: str, revision: str | None, commit: str | None,
                   pins: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The manifest's commit and hashes of the release asked for; flags given as well must agree with them."""
    from oscar_calib.zoo.manifest import load_manifest

    zoo = load_manifest(path)
    hits = [r for r in zoo.releases if (r.model_id, r.calibration, r.repo) == (model, calibration, repo)
            and (revision is None or revision in (r.version, r.commit)) and (commit is None or r.commit == commit)]
    if not hits:
        raise InputError(f"--manifest {path}: no release of {model} ({calibration}) in {repo} matching "
                         f"--revision {revision} / --commit {commit}")
    release = max(hits, key=lambda r: int(r.version[1:]))
    recorded = release.sha256s()
    clash = next((n for n, d in pins.items() if recorded.get(n, d) != d), None)
    if clash:
        raise InputError(f"--expected-sha256 {clash}: differs from the manifest's {recorded[clash]}")
    return release.commit, {**recorded, **pins}
