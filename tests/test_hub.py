"""Push / pull / zoo against a local fake Hub driven through the real huggingface_hub client.

Every expectation is checked independently of the code under test: hashes with hashlib on the local
bytes, refs and trees by reading the server's on-disk store, tensors against the locally written artifact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from format_helpers import PAPER
from tiny_models import tiny_config

from oscar_calib.errors import HubError, InputError
from runtime_kernels.artifact import (
    ARTIFACT_FILENAME,
    ArtifactError,
    identity_artifact,
    read_artifact,
    write_artifact,
)
from runtime_kernels.loader import (
    ModelMismatchError,
    ReleaseNotFoundError,
    UnsafeNameError,
    load_artifact,
    parse_release_record,
)

TOKEN = "hf_canary_TOKEN_5f1c0ffee_do_not_print"
REPO = "org/zoo"
MODEL = "tiny/qwen3"
REV = "a" * 40


def make_artifact(directory: Path, seed: int = 0, model_id: str = MODEL, revision: str = REV, extra: dict | None = None,
                  layers: int = 2, h_kv: int = 2, d: int = 16) -> Path:
    """A random-orthogonal-rotation artifact for a model with 4 query / `h_kv` KV heads, head_dim `d`."""
    art = identity_artifact(layers, h_kv, 4, d, model_id=model_id, fmt=PAPER)
    g = torch.Generator().manual_seed(seed)
    for name in ("k_rotation", "v_rotation"):
        q, _ = torch.linalg.qr(torch.randn(layers, h_kv, d, d, generator=g, dtype=torch.float64))
        setattr(art, name, q.float().contiguous())
    art.metadata["model_revision"] = revision
    write_artifact(art, directory)
    for name, text in (extra or {}).items():
        (directory / name).write_text(text)
    return directory


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def go_offline(monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def do_push(hub, directory, **kw):
    from oscar_calib.zoo.hub import push

    return push(directory, REPO, token=TOKEN, endpoint=hub.endpoint, **kw)


def do_load(hub, tmp_path, revision="v1", **kw):
    return load_artifact(MODEL, repo=REPO, revision=revision, token=TOKEN, cache_dir=tmp_path / "cache",
                         endpoint=hub.endpoint, **kw)


def tree(hub, revision="main") -> dict[str, str]:
    return hub.store.tree(REPO, revision)[1]




# --- push -------------------------------------------------------------------------------------
def test_push_creates_one_tagged_commit_and_load_verifies(hub, tmp_path):
    local = make_artifact(tmp_path / "a", extra={"eval_results.json": json.dumps({"ppl_delta": 0.0123}),
                                                 "README.md": "---\nx: 1\n---\n# Run report\nheld-out MSE 0.5\n"})
    result = do_push(hub, local)
    assert result.created and result.version == "v1"
    refs = hub.store.refs(REPO)
    assert refs["tags"] == {"v1": result.commit} and refs["branches"]["main"] == result.commit
    assert hub.commits_applied == 1  # one commit (plus the repo's initial one, made by create)
    files = tree(hub, "v1")
    base = f"{MODEL}/default"
    assert {p for p in files if p.startswith(base)} == {f"{base}/{n}" for n in
                                                        (ARTIFACT_FILENAME, "README.md", "release.json", "eval_results.json")}
    # The release record lists every file with the sha256 of the exact bytes we had locally.
    record = json.loads(hub.store.blob(REPO, files[f"{base}/release.json"]))
    assert record["files"][ARTIFACT_FILENAME] == {"sha256": sha(local / ARTIFACT_FILENAME),
                                                 "size": (local / ARTIFACT_FILENAME).stat().st_size}
    card = hub.store.blob(REPO, files[f"{base}/README.md"]).decode()
    assert record["files"]["README.md"]["sha256"] == hashlib.sha256(card.encode()).hexdigest()
    from huggingface_hub import ModelCard

    assert ModelCard(card).data.base_model == "tiny/qwen3" and "oscar-kv" in ModelCard(card).data.tags
    assert REV in card and "ppl_delta" in card and f"OscarCache.from_pretrained('tiny/qwen3', model.config, repo='{REPO}', revision='v1')" in card
    assert "## Run report" in card and "held-out MSE 0.5" in card and "x: 1" not in card
    cfg = tiny_config("qwen3", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2)
    loaded = do_load(hub, tmp_path, model_config=cfg)
    expected = read_artifact(local)
    for name, tensor in expected.tensors().items():
        assert torch.equal(getattr(loaded, name), tensor), name


def test_repush_identical_is_a_noop_and_names_the_version(hub, tmp_path):
    local = make_artifact(tmp_path / "a")
    first = do_push(hub, local)
    again = do_push(hub, local)
    assert not again.created and again.version == "v1" and again.commit == first.commit
    assert "already released as v1" in again.message
    assert hub.commits_applied == 1 and hub.store.refs(REPO)["tags"] == {"v1": first.commit}
    same_explicit = do_push(hub, local, version="v1")
    assert not same_explicit.created and hub.commits_applied == 1


def test_new_content_is_next_version_old_tag_keeps_old_content(hub, tmp_path):
    a = make_artifact(tmp_path / "a", seed=0, extra={"eval_old.json": "{}"})
    b = make_artifact(tmp_path / "b", seed=1)
    r1, r2 = do_push(hub, a), do_push(hub, b)
    assert (r1.version, r2.version) == ("v1", "v2") and r1.commit != r2.commit
    assert f"{MODEL}/default/eval_old.json" in tree(hub, "v1")
    assert f"{MODEL}/default/eval_old.json" not in tree(hub, "v2")  # stale files of the release dir are removed
    assert torch.equal(do_load(hub, tmp_path, "v1").k_rotation, read_artifact(a).k_rotation)
    assert torch.equal(do_load(hub, tmp_path, "v2").k_rotation, read_artifact(b).k_rotation)
    # Pushing the v1 content again: nothing new, and it says v1 has it.
    again = do_push(hub, a)
    assert not again.created and again.version == "v1" and hub.commits_applied == 2


def test_refuses_to_move_an_existing_tag(hub, tmp_path, monkeypatch, capsys):
    r1 = do_push(hub, make_artifact(tmp_path / "a", seed=0))
    b = make_artifact(tmp_path / "b", seed=1)
    with pytest.raises(HubError, match="tags are never moved"):
        do_push(hub, b, version="v1")
    assert hub.store.refs(REPO)["tags"] == {"v1": r1.commit} and hub.commits_applied == 1
    code, out, err = run_cli(["push", str(b), "--repo", REPO, "--version", "v1", "--token", TOKEN], monkeypatch, capsys)
    assert code == 5 and "version" in err and out == ""


def test_server_error_mid_upload_leaves_no_release(hub, tmp_path):
    local = make_artifact(tmp_path / "a")
    do_push(hub, make_artifact(tmp_path / "first", seed=3, model_id="tiny/other"))
    head_before = hub.store.refs(REPO)["branches"]["main"]
    hub.faults["commit_errors"] = 1
    with pytest.raises(HubError, match="HTTP 500"):
        do_push(hub, local)
    refs = hub.store.refs(REPO)
    assert refs["branches"]["main"] == head_before and set(refs["tags"]) == {"v1"}
    assert not any(p.startswith(f"{MODEL}/") for p in tree(hub))
    retry = do_push(hub, local)  # the fault is gone: the same push now releases v2
    assert retry.created and retry.version == "v2"


def test_racing_publisher_is_detected_not_overwritten(hub, tmp_path):
    do_push(hub, make_artifact(tmp_path / "a", seed=0))
    other = {}

    def someone_else_commits():
        other["sha"] = hub.store.commit(REPO, "main", {f"{MODEL}/default/release.json": b"{}",
                                                       "theirs.txt": b"theirs"}, [], "racer", None)

    hub.set_before_commit(someone_else_commits)
    with pytest.raises(HubError, match="another publisher"):
        do_push(hub, make_artifact(tmp_path / "b", seed=1))
    refs = hub.store.refs(REPO)
    assert refs["branches"]["main"] == other["sha"] and set(refs["tags"]) == {"v1"}
    assert hub.store.blob(REPO, tree(hub)[f"{MODEL}/default/release.json"]) == b"{}"  # theirs is intact


def test_concurrent_publishers_never_lose_a_release(hub, tmp_path):
    dirs = [make_artifact(tmp_path / f"m{i}", seed=i, model_id=f"tiny/m{i}") for i in range(3)]
    outcomes: list = [None] * 3

    def worker(i):
        try:
            outcomes[i] = do_push(hub, dirs[i])
        except HubError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [o for o in outcomes if not isinstance(o, Exception)]
    assert ok and all(isinstance(o, HubError) for o in outcomes if o not in ok)
    tags = hub.store.refs(REPO)["tags"]
    assert len({o.version for o in ok}) == len(ok) and all(tags[o.version] == o.commit for o in ok)
    head_tree = tree(hub)
    for o in ok:  # every successful release is still at the head: nobody overwrote anybody
        assert f"{o.path_in_repo}/{ARTIFACT_FILENAME}" in head_tree


# --- pull -------------------------------------------------------------------------------------
def test_corrupted_download_of_the_right_size_is_never_used(hub, tmp_path, monkeypatch, capsys):
    do_push(hub, make_artifact(tmp_path / "a"))
    hub.faults["corrupt"] = {f"{MODEL}/default/{ARTIFACT_FILENAME}"}
    with pytest.raises(ArtifactError, match="sha256"):
        do_load(hub, tmp_path)
    out_dir = tmp_path / "pulled"
    code, out, err = run_cli(["pull", MODEL, "--repo", REPO, "--revision", "v1", "--local-dir", str(out_dir),
                              "--cache-dir", str(tmp_path / "cache2"), "--token", TOKEN], monkeypatch, capsys)
    assert code == 4 and "sha256" in err and not out_dir.exists()
    hub.faults["corrupt"] = set()  # the transfer is fine again: the bad cached blob is replaced, then verified
    assert torch.equal(do_load(hub, tmp_path).k_rotation, read_artifact(tmp_path / "a").k_rotation)


def test_offline_start_from_a_warm_cache(hub, tmp_path, monkeypatch):
    do_push(hub, make_artifact(tmp_path / "a"))
    warm = do_load(hub, tmp_path)
    downloads = len(hub.downloads)
    hub.stop()
    go_offline(monkeypatch)
    cold = tmp_path / "cold"
    offline = load_artifact(MODEL, repo=REPO, revision="v1", cache_dir=tmp_path / "cache", endpoint=hub.endpoint)
    assert torch.equal(offline.v_rotation, warm.v_rotation) and len(hub.downloads) == downloads
    with pytest.raises(ReleaseNotFoundError, match="not in the local cache"):
        load_artifact(MODEL, repo=REPO, revision="v1", cache_dir=cold, endpoint=hub.endpoint)


def test_two_concurrent_pulls_share_the_cache(hub, tmp_path):
    do_push(hub, make_artifact(tmp_path / "a"))
    results: list = [None, None]

    def worker(i):
        try:
            results[i] = do_load(hub, tmp_path)
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = read_artifact(tmp_path / "a")
    for r in results:
        assert not isinstance(r, Exception), r
        assert torch.equal(r.k_rotation, expected.k_rotation)


def test_pull_by_commit_sha_and_pinned_hashes(hub, tmp_path):
    local = make_artifact(tmp_path / "a")
    r = do_push(hub, local)
    art = do_load(hub, tmp_path, revision=r.commit, expected_sha256={ARTIFACT_FILENAME: sha(local / ARTIFACT_FILENAME)})
    assert torch.equal(art.k_rotation, read_artifact(local).k_rotation)
    with pytest.raises(ArtifactError, match="expected_sha256|sha256"):
        do_load(hub, tmp_path, revision=r.commit, expected_sha256={ARTIFACT_FILENAME: "0" * 64})


def test_artifact_for_another_model_is_refused(hub, tmp_path, monkeypatch, capsys):
    do_push(hub, make_artifact(tmp_path / "a"))
    wrong = tiny_config("qwen3", num_heads=4, num_kv_heads=2, head_dim=32, num_layers=2)
    with pytest.raises(ModelMismatchError, match="head_dim"):
        do_load(hub, tmp_path, model_config=wrong)
    too_few_layers = tiny_config("qwen3", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=1)
    with pytest.raises(ModelMismatchError, match="layer"):
        do_load(hub, tmp_path, model_config=too_few_layers)
    cfg_dir = tmp_path / "cfg"
    wrong.save_pretrained(cfg_dir)
    out_dir = tmp_path / "pulled"
    code, out, err = run_cli(["pull", MODEL, "--repo", REPO, "--revision", "v1", "--model-config", str(cfg_dir),
                              "--local-dir", str(out_dir), "--cache-dir", str(tmp_path / "c"), "--token", TOKEN],
                             monkeypatch, capsys)
    assert code == 2 and "head_dim" in err and not out_dir.exists()
    # A release dir whose artifact names another model (metadata disagrees with the requested id).
    other = make_artifact(tmp_path / "b", model_id="tiny/other")
    from oscar_calib.zoo.hub import push

    push(other, REPO, token=TOKEN, endpoint=hub.endpoint, calibration="x")
    files = tree(hub)
    blob = hub.store.blob(REPO, files["tiny/other/x/oscar_kv.safetensors"])
    rec = json.loads(hub.store.blob(REPO, files["tiny/other/x/release.json"]))
    rec["model_id"] = MODEL
    rec["calibration"] = "x"
    rec["files"].pop("README.md")
    hub.store.commit(REPO, "main", {f"{MODEL}/x/oscar_kv.safetensors": blob,
                                    f"{MODEL}/x/release.json": json.dumps(rec).encode()}, [], "forged", None)
    with pytest.raises(ModelMismatchError, match="model_id"):
        do_load(hub, tmp_path, revision="main", calibration="x")


def test_cli_push_and_pull_roundtrip(hub, tmp_path, monkeypatch, capsys):
    local = make_artifact(tmp_path / "a")
    code, out, err = run_cli(["push", str(local), "--repo", REPO, "--token", TOKEN, "--json"], monkeypatch, capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["version"] == "v1" and result["created"] is True
    dest = tmp_path / "dest"
    code, out, err = run_cli(["pull", MODEL, "--repo", REPO, "--revision", "v1", "--local-dir", str(dest),
                              "--cache-dir", str(tmp_path / "c"), "--token", TOKEN], monkeypatch, capsys)
    assert code == 0, err
    assert sha(dest / ARTIFACT_FILENAME) == sha(local / ARTIFACT_FILENAME)
    code, out, err = run_cli(["pull", MODEL, "--repo", REPO, "--revision", "v9", "--cache-dir", str(tmp_path / "c"),
                              "--token", TOKEN], monkeypatch, capsys)
    assert code == 5 and "v9" in err


def test_token_canary_never_printed_or_logged(hub, tmp_path, monkeypatch, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    for name in ("huggingface_hub", "runtime_kernels", "oscar_calib", "httpx2", "httpcore2"):
        caplog.set_level(logging.DEBUG, logger=name)  # restored by caplog after the test
    local = make_artifact(tmp_path / "a")
    other = make_artifact(tmp_path / "b", seed=1)
    outputs = []
    for args in (["push", str(local), "--repo", REPO, "--token", TOKEN, "--json"],
                 ["push", str(local), "--repo", REPO, "--token", TOKEN],
                 ["pull", MODEL, "--repo", REPO, "--revision", "v1", "--cache-dir", str(tmp_path / "c"), "--token", TOKEN],
                 ["pull", MODEL, "--repo", REPO, "--revision", "nope", "--token", TOKEN],
                 ["push", str(other), "--repo", REPO, "--token", TOKEN + "x"]):  # refused credentials: error path
        outputs.append(run_cli(args, monkeypatch, capsys))
    assert [o[0] for o in outputs] == [0, 0, 0, 5, 5]
    assert f"Bearer {TOKEN}" in hub.auth_headers_seen  # the token was really used...
    text = "\n".join(o[1] + o[2] for o in outputs) + caplog.text + "\n".join(str(r.args) for r in caplog.records)
    assert TOKEN not in text and "5f1c0ffee" not in text  # ...and never shown, not even in part


# --- names and records ------------------------------------------------------------------------
@pytest.mark.parametrize("repo", ["org/../zoo", "../zoo", "/abs/zoo", "org/zo\no", "org/zoo/extra", "org/z\x00", "org/.."])
def test_bad_repo_ids_are_refused_before_any_request(hub, tmp_path, repo, monkeypatch, capsys):
    local = make_artifact(tmp_path / "a")
    with pytest.raises(InputError, match="repo"):
        do_push_repo(hub, local, repo)
    code, out, err = run_cli(["push", str(local), "--repo", repo, "--token", TOKEN], monkeypatch, capsys)
    assert code == 2
    with pytest.raises(UnsafeNameError):
        load_artifact(MODEL, repo=repo, revision="v1", endpoint=hub.endpoint, cache_dir=tmp_path / "c")
    assert hub.commits_applied == 0 and not any((tmp_path / "hub").iterdir())


def do_push_repo(hub, directory, repo):
    from oscar_calib.zoo.hub import push

    return push(directory, repo, token=TOKEN, endpoint=hub.endpoint)


@pytest.mark.parametrize("kw", [{"calibration": "../x"}, {"calibration": "/etc"}, {"calibration": "a\tb"},
                                {"revision": "../main"}, {"revision": "v1\n"}])
def test_bad_calibration_or_revision_names(hub, tmp_path, kw):
    args = {"revision": "v1", **kw}
    with pytest.raises(UnsafeNameError):
        load_artifact(MODEL, repo=REPO, endpoint=hub.endpoint, cache_dir=tmp_path / "c", **args)


def test_unsafe_file_names_in_a_release_record_or_directory(hub, tmp_path):
    do_push(hub, make_artifact(tmp_path / "a"))
    files = tree(hub)
    rec = json.loads(hub.store.blob(REPO, files[f"{MODEL}/default/release.json"]))
    rec["files"]["../../escape"] = {"sha256": "0" * 64, "size": 1}
    hub.store.commit(REPO, "main", {f"{MODEL}/default/release.json": json.dumps(rec).encode()}, [], "evil", None)
    with pytest.raises(ArtifactError, match="escape"):
        do_load(hub, tmp_path, revision="main")
    bad_dir = make_artifact(tmp_path / "b")
    (bad_dir / "x\x01y").write_text("x")
    with pytest.raises(InputError, match="control"):
        do_push(hub, bad_dir)


def test_release_record_parser_rules():
    good = {"format": "oscar-kv-release", "schema_version": 1, "model_id": MODEL, "model_revision": REV,
            "calibration": "default", "version": "v1",
            "files": {ARTIFACT_FILENAME: {"sha256": "a" * 64, "size": 3}}}
    assert parse_release_record(json.dumps(good).encode(), "r")["version"] == "v1"
    for mutate, field in ((lambda d: d.update(extra=1), "extra"),
                          (lambda d: d["files"].update({"/abs": {"sha256": "a" * 64, "size": 1}}), "files"),
                          (lambda d: d["files"][ARTIFACT_FILENAME].update(size=-1), "size"),
                          (lambda d: d["files"][ARTIFACT_FILENAME].update(sha256="A" * 64), "sha256"),
                          (lambda d: d.update(schema_version=2), "schema_version")):
        data = json.loads(json.dumps(good))
        mutate(data)
        with pytest.raises(ArtifactError, match=field):
            parse_release_record(json.dumps(data).encode(), "r")


def test_local_load_checks_pins_and_model(tmp_path):
    local = make_artifact(tmp_path / "a")
    assert load_artifact(local, expected_sha256={ARTIFACT_FILENAME: sha(local / ARTIFACT_FILENAME)}).num_layers == 2
    with pytest.raises(ArtifactError, match="sha256"):
        load_artifact(local, expected_sha256={ARTIFACT_FILENAME: "1" * 64})
    with pytest.raises(ModelMismatchError, match="num_key_value_heads"):
        load_artifact(local, model_config=tiny_config("qwen3", num_heads=4, num_kv_heads=4, head_dim=16))
    with pytest.raises(ReleaseNotFoundError):
        load_artifact(tmp_path / "missing")


# --- zoo ----------------------------------------------------------------------------------------
def _manifest_text(repo: str, revision: str, dataset: Path, releases: str = "[]") -> str:
    return f"""schema_version: 1
repo: {repo}
recipes:
  - model_id: {MODEL}
    model_revision: "{revision}"
    calibration: default
    data:
      dataset: {dataset}
      samples: 2
      seq_len: 64
      holdout_samples: 1
      holdout_queries: 8
    solver:
      granularity: head
      kv_format: {{sink_tokens: 4, recent_tokens: 8}}
    dtype: float32
releases: {releases}
"""


def test_zoo_build_publish_validate(hub, tmp_path, monkeypatch, capsys):
    from oscar_calib.demo import random_demo_model
    from oscar_calib.zoo.manifest import load_manifest

    model, tokenizer = random_demo_model()
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    text = tmp_path / "calib.txt"
    text.write_text("\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i * 7}." for i in range(200)))
    manifest = tmp_path / "zoo_manifest.yaml"
    manifest.write_text(_manifest_text(REPO, REV, text.name))  # relative to the manifest's folder
    out_root = tmp_path / "build"
    code, out, err = run_cli(["zoo", "build", "--manifest", str(manifest), "--out-root", str(out_root),
                              "--local-model", f"{MODEL}={model_dir}", "--device", "cpu"], monkeypatch, capsys)
    assert code == 0, err
    built = read_artifact(out_root / MODEL / "default")
    assert built.metadata["model_id"] == MODEL and built.metadata["model_revision"] == REV
    code, out, err = run_cli(["zoo", "publish", "--manifest", str(manifest), "--out-root", str(out_root),
                              "--token", TOKEN], monkeypatch, capsys)
    assert code == 0, err
    zoo = load_manifest(manifest)
    (release,) = zoo.releases
    assert release.version == "v1" and hub.store.refs(REPO)["tags"]["v1"] == release.commit
    assert release.sha256s()[ARTIFACT_FILENAME] == sha(out_root / MODEL / "default" / ARTIFACT_FILENAME)
    assert release.metrics  # headline numbers of the run log
    assert not zoo.pending()
    code, out, err = run_cli(["zoo", "validate", "--manifest", str(manifest), "--token", TOKEN], monkeypatch, capsys)
    assert code == 0 and out.strip() == "valid", err
    # Recorded hash that does not match what the Hub serves -> exit 4; a commit the tag does not name -> exit 5.
    text_ok = manifest.read_text()
    manifest.write_text(text_ok.replace(release.sha256s()[ARTIFACT_FILENAME], "f" * 64))
    code, _, err = run_cli(["zoo", "validate", "--manifest", str(manifest), "--token", TOKEN], monkeypatch, capsys)
    assert code == 4 and "sha256" in err, err
    manifest.write_text(text_ok.replace(release.commit, "b" * 40))
    code, _, err = run_cli(["zoo", "validate", "--manifest", str(manifest), "--token", TOKEN], monkeypatch, capsys)
    assert code == 5 and "commit" in err
    # Pinned hashes from the manifest are accepted by the serving loader.
    art = load_artifact(MODEL, repo=REPO, revision=release.version, expected_sha256=release.sha256s(), token=TOKEN,
                        cache_dir=tmp_path / "c", endpoint=hub.endpoint, model_config=model.config)
    assert torch.equal(art.k_rotation, built.k_rotation)
