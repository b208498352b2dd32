"""`--repo-type model|dataset` on every Hub-facing command, against the local fake Hub (which keeps model and
dataset repos in separate namespaces, as the Hub does).

Expectations are checked independently of the code under test: the server's on-disk store for what was
published where, hashlib on local bytes for what was pulled.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_hub import MODEL, REPO, REV, TOKEN, go_offline, make_artifact, run_cli, sha
from test_zoo_cli import COMMENTED
from tiny_models import tiny_config

from oscar_calib.cli import exit_codes
from runtime_kernels.artifact import ARTIFACT_FILENAME, read_artifact
from runtime_kernels.loader import WrongRepoTypeError, load_artifact


def _push(tmp_path, monkeypatch, capsys, *extra, seed=0, name="a"):
    art = make_artifact(tmp_path / name, seed=seed)
    code, out, err = run_cli(["push", str(art), "--repo", REPO, "--token", TOKEN, "--json", *extra], monkeypatch,
                             capsys)
    return art, code, out, err


def test_push_and_pull_a_dataset_repo_round_trip(hub, tmp_path, monkeypatch, capsys):
    art, code, out, err = _push(tmp_path, monkeypatch, capsys, "--repo-type", "dataset", "--commit-message",
                                "calibration zoo, first release")
    assert code == 0, err
    result = json.loads(out)
    assert result["repo_type"] == "dataset" and result["version"] == "v1" and result["created"]
    assert hub.store.commit_data(REPO, result["commit"], "dataset")["message"] == "calibration zoo, first release"
    # Published to the dataset namespace only, tagged there.
    assert hub.store.exists(REPO, "dataset") and not hub.store.exists(REPO, "model")
    assert hub.store.refs(REPO, "dataset")["tags"] == {"v1": result["commit"]}
    _, files = hub.store.tree(REPO, "v1", "dataset")
    assert hub.store.blob(REPO, files[f"{MODEL}/default/{ARTIFACT_FILENAME}"], "dataset") == \
        (art / ARTIFACT_FILENAME).read_bytes()
    card = hub.store.blob(REPO, files[f"{MODEL}/default/README.md"], "dataset").decode()
    assert "--repo-type dataset" in card and "repo_type='dataset'" in card  # the card says how to load it

    dest = tmp_path / "dest"
    code, out, err = run_cli(["pull", MODEL, "--repo", REPO, "--repo-type", "dataset", "--revision", "v1",
                              "--local-dir", str(dest), "--cache-dir", str(tmp_path / "c"), "--token", TOKEN,
                              "--json"], monkeypatch, capsys)
    assert code == 0, err
    pulled = json.loads(out)
    assert pulled["repo_type"] == "dataset" and pulled["commit"] == result["commit"]
    assert sha(dest / ARTIFACT_FILENAME) == sha(art / ARTIFACT_FILENAME)
    assert (tmp_path / "c" / "datasets--org--zoo").is_dir()  # the Hub cache's dataset layout
    # The runtime's one-call path takes the same repo type.
    loaded = load_artifact(MODEL, repo=REPO, revision="v1", repo_type="dataset", token=TOKEN,
                           cache_dir=tmp_path / "c2", endpoint=hub.endpoint)
    assert torch.equal(loaded.k_rotation, read_artifact(art).k_rotation)
    from runtime_kernels.hf import OscarCache

    config = tiny_config("qwen3", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2)
    cache = OscarCache.from_pretrained(MODEL, config, repo=REPO, revision="v1", repo_type="dataset", token=TOKEN,
                                       cache_dir=tmp_path / "c3", endpoint=hub.endpoint)
    assert torch.equal(cache.artifact.v_rotation, read_artifact(art).v_rotation)
    # Offline, from the warm cache, still by repo type.
    go_offline(monkeypatch)
    code, out, err = run_cli(["pull", MODEL, "--repo", REPO, "--repo-type", "dataset", "--revision", "v1",
                              "--cache-dir", str(tmp_path / "c")], monkeypatch, capsys)
    assert code == 0, err


def test_same_name_model_and_dataset_repos_stay_separate(hub, tmp_path, monkeypatch, capsys):
    _, code, out, err = _push(tmp_path, monkeypatch, capsys, "--repo-type", "dataset", seed=1, name="d")
    assert code == 0, err
    # Pushing as a model repo to a name that is a dataset repo is refused (no twin model repo is created).
    art, code, out, err = _push(tmp_path, monkeypatch, capsys, seed=2, name="m")
    assert code == exit_codes.BAD_INPUT and out == ""
    assert "--repo-type dataset" in err and "is a dataset repo" in err and "nothing was pushed" in err
    assert not hub.store.exists(REPO, "model")
    # A model repo that really exists under the same name is a separate zoo.
    hub.store.create(REPO, private=False, repo_type="model")
    art, code, out, err = _push(tmp_path, monkeypatch, capsys, seed=2, name="m")
    assert code == 0, err
    assert hub.store.refs(REPO, "model")["tags"] == {"v1": json.loads(out)["commit"]}
    assert len(hub.store.refs(REPO, "dataset")["tags"]) == 1


def test_pull_with_the_wrong_repo_type_names_the_flag(hub, tmp_path, monkeypatch, capsys):
    _, code, _, err = _push(tmp_path, monkeypatch, capsys, "--repo-type", "dataset")
    assert code == 0, err
    dest = tmp_path / "dest"
    pull = ["pull", MODEL, "--repo", REPO, "--revision", "v1", "--local-dir", str(dest), "--token", TOKEN]
    code, out, err = run_cli([*pull, "--cache-dir", str(tmp_path / "c")], monkeypatch, capsys)
    assert code == exit_codes.BAD_INPUT and out == "" and not dest.exists()
    assert "--repo-type dataset" in err and "is a dataset repo" in err and "Traceback" not in err
    with pytest.raises(WrongRepoTypeError, match="repo_type='dataset'"):
        load_artifact(MODEL, repo=REPO, revision="v1", token=TOKEN, cache_dir=tmp_path / "c", endpoint=hub.endpoint)
    # Offline: the cache holds it only as a dataset repo, and says so.
    code, _, err = run_cli([*pull, "--repo-type", "dataset", "--cache-dir", str(tmp_path / "warm")], monkeypatch,
                           capsys)
    assert code == 0, err
    go_offline(monkeypatch)
    code, out, err = run_cli(["pull", MODEL, "--repo", REPO, "--revision", "v1", "--cache-dir", str(tmp_path / "warm")],
                             monkeypatch, capsys)
    assert code == exit_codes.BAD_INPUT and "--repo-type dataset" in err and "is a dataset repo" in err


def test_a_repo_of_neither_kind_is_not_found_without_a_hint(hub, tmp_path, monkeypatch, capsys):
    for kind in ("model", "dataset"):
        code, out, err = run_cli(["pull", MODEL, "--repo", "org/nothing", "--repo-type", kind, "--revision", "v1",
                                  "--cache-dir", str(tmp_path / "c"), "--token", TOKEN], monkeypatch, capsys)
        assert code == exit_codes.HUB_REFUSED and f"{kind} repository 'org/nothing' not found" in err
        assert "--repo-type" not in err


def test_repo_type_choices_are_checked_and_listed(monkeypatch, capsys):
    code, _, err = run_cli(["pull", MODEL, "--repo", REPO, "--revision", "v1", "--repo-type", "space"], monkeypatch,
                           capsys)
    assert code == exit_codes.BAD_INPUT and "--repo-type" in err and "space" in err
    for argv in (["push"], ["pull"], ["zoo", "publish"], ["zoo", "list"]):
        code, out, _ = run_cli([*argv, "--help"], monkeypatch, capsys)
        assert code == 0 and "--repo-type" in out and "model|dataset" in out, argv


def test_push_dry_run_names_the_repo_type(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: any request would fail
    art = make_artifact(tmp_path / "a")
    code, out, err = run_cli(["push", str(art), "--repo", REPO, "--repo-type", "dataset", "--dry-run", "--json"],
                             monkeypatch, capsys)
    assert code == 0, err
    assert json.loads(out)["repo_type"] == "dataset"


def test_zoo_publish_list_validate_in_a_dataset_repo(hub, tmp_path, monkeypatch, capsys):
    from oscar_calib.zoo.manifest import load_manifest

    manifest = tmp_path / "zoo_manifest.yaml"
    text = COMMENTED.replace(f"repo: {REPO}   # where releases go", f"repo: {REPO}   # where releases go\nrepo_type: dataset")
    manifest.write_text(text)
    make_artifact(tmp_path / "build" / MODEL / "default")
    code, out, err = run_cli(["zoo", "publish", "--manifest", str(manifest), "--out-root", str(tmp_path / "build"),
                              "--token", TOKEN, "--json"], monkeypatch, capsys)
    assert code == 0, err
    (release,) = load_manifest(manifest).releases
    assert release.repo_type == "dataset" and not hub.store.exists(REPO, "model")
    assert hub.store.refs(REPO, "dataset")["tags"]["v1"] == release.commit
    assert manifest.read_text().startswith(text.partition("releases:")[0])  # comments kept, as for a model repo
    # zoo list and validate take the manifest's repo type; --repo-type overrides it.
    code, out, err = run_cli(["zoo", "list", "--manifest", str(manifest), "--token", TOKEN, "--json"], monkeypatch,
                             capsys)
    assert code == 0, err
    listed = json.loads(out)
    assert listed["repo_type"] == "dataset" and [r["commit"] for r in listed["releases"]] == [release.commit]
    code, out, err = run_cli(["zoo", "list", "--manifest", str(manifest), "--repo-type", "model", "--token", TOKEN],
                             monkeypatch, capsys)
    assert code == exit_codes.BAD_INPUT and "--repo-type dataset" in err
    code, out, err = run_cli(["zoo", "validate", "--manifest", str(manifest), "--token", TOKEN], monkeypatch, capsys)
    assert code == 0 and out.strip() == "valid", err
    # A release recorded with the wrong repo type fails validation naming the flag.
    manifest.write_text(manifest.read_text().replace("repo_type: dataset\n    version", "repo_type: model\n    version"))
    code, out, err = run_cli(["zoo", "validate", "--manifest", str(manifest), "--token", TOKEN], monkeypatch, capsys)
    assert code == exit_codes.BAD_INPUT and "field 'repo_type': recorded 'model'" in err, err
    assert "repo_type: dataset" in err and "Traceback" not in err


def test_model_repo_releases_do_not_record_the_default_repo_type(hub, tmp_path, monkeypatch, capsys):
    manifest = tmp_path / "zoo_manifest.yaml"
    manifest.write_text(COMMENTED)
    make_artifact(tmp_path / "build" / MODEL / "default")
    code, _, err = run_cli(["zoo", "publish", "--manifest", str(manifest), "--out-root", str(tmp_path / "build"),
                            "--token", TOKEN], monkeypatch, capsys)
    assert code == 0, err
    assert "repo_type" not in manifest.read_text()  # manifests of model-repo zoos read as before
    assert REV in manifest.read_text()
