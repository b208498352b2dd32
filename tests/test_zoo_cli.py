"""Zoo workflow: strict manifest scalars and dataset paths, `zoo publish` editing a commented manifest
round-trip, `zoo list`, and `push --version` / `--dry-run` / `--commit-message` against the local hub server."""

from __future__ import annotations

import json

import pytest
from test_hub import MODEL, REPO, REV, TOKEN, make_artifact, run_cli

from oscar_calib.cli import exit_codes
from oscar_calib.zoo.manifest import ManifestError, load_manifest, parse_manifest, safe_load_yaml

SHA = "c" * 40



# ------------------------------------------------------------------------------------------------ parser
@pytest.mark.parametrize("value, read_as", [("0755", "493"), ("1:30", "90"), ("0x1f", "31"), ("1_000", "1000"),
                                             ("0o17", None), (".inf", "inf"), ("-.nan", None), ("yes", "True"),
                                             ("off", "False"), ("True", "True"), ("NULL", "None"), ("1:30.5", None)])
def test_yaml_implicit_conversions_are_refused(value, read_as):
    try:
        parsed = safe_load_yaml(f"a: {value}", "m.yaml")
    except ManifestError as exc:
        assert "m.yaml: line 1" in str(exc) and repr(value) in str(exc) and "quote it" in str(exc)
        if read_as is not None:
            assert read_as in str(exc)  # says what YAML would have made of it
        return
    assert parsed == {"a": value}, "an unrefused value must stay the text that was written"


@pytest.mark.parametrize("value, expected", [("12", 12), ("-3", -3), ("0", 0), ("1.5", 1.5), ("1.0e-3", 1e-3),
                                              ("true", True), ("false", False), ("null", None), ("~", None),
                                              ('"0755"', "0755"), ("'1:30'", "1:30"), ("v1", "v1")])
def test_plain_scalars_still_parse(value, expected):
    assert safe_load_yaml(f"a: {value}") == {"a": expected}


GOOD = f"""schema_version: 1
repo: org/zoo
recipes:
  - model_id: Qwen/Qwen3-8B
    model_revision: "{SHA}"
    data:
      dataset: DATASET
      samples: 4
      chat_template: false
releases: []
"""


def test_booleans_only_in_boolean_fields():
    assert parse_manifest(GOOD.replace("DATASET", "calib.txt")).recipes[0].data.chat_template is False
    with pytest.raises(ManifestError, match="field 'schema_version': expected a number or text, got the YAML boolean true"):
        parse_manifest(GOOD.replace("DATASET", "calib.txt").replace("schema_version: 1", "schema_version: true"))
    with pytest.raises(ManifestError, match=r"field 'recipes\.0\.data\.samples'"):
        parse_manifest(GOOD.replace("DATASET", "calib.txt").replace("samples: 4", "samples: false"))


@pytest.mark.parametrize("dataset, match", [("/etc/passwd.txt", "absolute"), ("~/calib.txt", "absolute"),
                                             ("C:\\\\data\\\\calib.txt", "absolute"), ("../calib.txt", r"'\.\.'"),
                                             ("data/../../x.jsonl", r"'\.\.'"), ("data\\\\..\\\\x.txt", r"'\.\.'")])
def test_dataset_paths_absolute_or_dotdot_are_refused(dataset, match):
    with pytest.raises(ManifestError, match=rf"data\.dataset.*{match}"):
        parse_manifest(GOOD.replace("DATASET", f'"{dataset}"'))


def test_relative_dataset_is_read_from_the_manifest_folder(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "calib.txt").write_text("x")
    (tmp_path / "zoo_manifest.yaml").write_text(GOOD.replace("DATASET", "data/calib.txt"))
    recipe = load_manifest(tmp_path / "zoo_manifest.yaml").recipes[0]
    assert recipe.to_config(base_dir=tmp_path).data.dataset == str(tmp_path / "data" / "calib.txt")
    assert parse_manifest(GOOD.replace("DATASET", "HuggingFaceFW/fineweb-edu").replace(
        "      samples: 4", f'      dataset_revision: "{SHA}"\n      samples: 4')).recipes[0].to_config(
        base_dir=tmp_path).data.dataset == "HuggingFaceFW/fineweb-edu"  # a Hub id is not a path


# ------------------------------------------------------------------------------------------------ publish
COMMENTED = f"""# My zoo. Keep this comment.
schema_version: 1
repo: {REPO}   # where releases go

recipes:
  # the only recipe; defaults stay unexpanded
  - model_id: {MODEL}
    model_revision: "{REV}"
    data:
      dataset: calib.txt   # relative to this file
      samples: 2
releases: []   # zoo publish fills this
"""


def test_publish_edits_a_commented_manifest_round_trip(hub, tmp_path, monkeypatch, capsys):
    manifest = tmp_path / "zoo_manifest.yaml"
    manifest.write_text(COMMENTED)
    make_artifact(tmp_path / "build" / MODEL / "default")
    args = ["zoo", "publish", "--manifest", str(manifest), "--out-root", str(tmp_path / "build"), "--token", TOKEN]
    code, out, err = run_cli([*args, "--dry-run", "--json"], monkeypatch, capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["dry_run"] and plan["releases"][0]["path_in_repo"] == f"{MODEL}/default"
    assert manifest.read_text() == COMMENTED and not hub.store.exists(REPO)  # nothing pushed or written
    code, out, err = run_cli([*args, "--commit-message", "first zoo release", "--json"], monkeypatch, capsys)
    assert code == 0, err
    text = manifest.read_text()
    head, _, tail = text.partition("releases:")
    assert head == COMMENTED.partition("releases:")[0]  # header, recipes and every comment byte for byte
    assert "# zoo publish fills this" in tail and "samples: 2" in head and "holdout_queries" not in text
    (release,) = load_manifest(manifest).releases
    tags = hub.store.refs(REPO)["tags"]
    assert release.version == "v1" and tags["v1"] == release.commit == json.loads(out)["releases"][0]["commit"]
    assert hub.store.commit_data(REPO, release.commit)["message"] == "first zoo release"
    code, out, err = run_cli(args, monkeypatch, capsys)  # nothing pending: the file is left alone
    assert code == 0 and "nothing to publish" in err and manifest.read_text() == text


def test_zoo_list_shows_every_release(hub, tmp_path, monkeypatch, capsys):
    for i, calibration in enumerate(("default", "chat")):
        code, _, err = run_cli(["push", str(make_artifact(tmp_path / calibration, seed=i)), "--repo", REPO,
                                "--calibration", calibration, "--token", TOKEN], monkeypatch, capsys)
        assert code == 0, err
    code, out, err = run_cli(["zoo", "list", "--repo", REPO, "--token", TOKEN, "--json"], monkeypatch, capsys)
    assert code == 0, err
    rows = json.loads(out)["releases"]
    tags = hub.store.refs(REPO)["tags"]
    assert [(r["version"], r["calibration"], r["commit"]) for r in rows] == [
        ("v1", "default", tags["v1"]), ("v2", "chat", tags["v2"])]
    assert all(r["model_id"] == MODEL and "oscar_kv.safetensors" in r["files"] for r in rows)
    code, out, err = run_cli(["zoo", "list", "--repo", REPO, "--token", TOKEN], monkeypatch, capsys)
    assert code == 0 and "2 release(s)" in out and "chat" in out
    code, _, err = run_cli(["zoo", "list", "--repo", "../evil", "--token", TOKEN], monkeypatch, capsys)
    assert code == exit_codes.BAD_INPUT and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ push
def test_push_version_with_unchanged_content_says_so_and_fails(hub, tmp_path, monkeypatch, capsys):
    art = make_artifact(tmp_path / "a")
    push = ["push", str(art), "--repo", REPO, "--token", TOKEN]
    assert run_cli([*push, "--version", "v1"], monkeypatch, capsys)[0] == 0
    code, out, err = run_cli([*push, "--version", "v2"], monkeypatch, capsys)
    assert code == exit_codes.UNCHANGED and "already released as v1" in err and "--allow-unchanged" in err
    assert set(hub.store.refs(REPO)["tags"]) == {"v1"}
    code, out, err = run_cli([*push, "--version", "v2", "--allow-unchanged"], monkeypatch, capsys)
    assert code == 0 and out.split()[1] == "v1"
    code, out, err = run_cli([*push, "--version", "v1"], monkeypatch, capsys)  # the same release: idempotent
    assert code == 0 and out.split()[1] == "v1"


def test_push_dry_run_contacts_no_hub(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: any request would fail
    art = make_artifact(tmp_path / "a", extra={"eval_results.json": "{}"})
    code, out, err = run_cli(["push", str(art), "--repo", REPO, "--dry-run", "--json"], monkeypatch, capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["version"] == "next free vN" and set(plan["files"]) == {"oscar_kv.safetensors", "eval_results.json"}
    import hashlib

    assert plan["files"]["oscar_kv.safetensors"]["sha256"] == hashlib.sha256(
        (art / "oscar_kv.safetensors").read_bytes()).hexdigest()
    code, _, err = run_cli(["push", str(tmp_path / "missing"), "--repo", REPO, "--dry-run"], monkeypatch, capsys)
    assert code == exit_codes.BAD_INPUT and "no such directory" in err


def test_validate_json(tmp_path, monkeypatch, capsys):
    manifest = tmp_path / "zoo_manifest.yaml"
    manifest.write_text(GOOD.replace("DATASET", "calib.txt"))
    code, out, err = run_cli(["zoo", "validate", "--manifest", str(manifest), "--offline", "--json"], monkeypatch,
                             capsys)
    assert code == 0, err
    assert json.loads(out) == {"valid": True, "recipes": 1, "releases": 0, "pending": ["Qwen/Qwen3-8B/default"],
                               "hub_checked": False}
    manifest.write_text(GOOD.replace("DATASET", "calib.txt").replace("samples: 4", "samples: 0x10"))
    code, out, err = run_cli(["zoo", "validate", "--manifest", str(manifest), "--offline"], monkeypatch, capsys)
    assert code == exit_codes.BAD_INPUT and "'0x10' is ambiguous YAML" in err and out == ""
