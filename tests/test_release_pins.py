"""Issue 33 class 2: a release is pinned by content. A moved tag with a consistently forged `release.json` (version,
hashes and files all agree) is refused on a cold cache when the caller has the manifest's pins (`commit`,
`expected_sha256`): in `pull`, `load_artifact`, `OscarCache.from_pretrained` and the vLLM serve config. With only
a tag on a cold cache, the served commit is logged, and the zoo's own manifest at that commit is checked.

The stand-in Hub is tests/hub_server.py; tags are moved and records forged by editing its store, as in
tests/test_release_pinning.py.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hub import MODEL, REPO, TOKEN, do_push, make_artifact, run_cli, sha
from test_release_pinning import forge_release, move_tag
from transformers import Qwen3Config

from runtime_kernels.artifact import ARTIFACT_FILENAME, ArtifactError, read_artifact
from runtime_kernels.loader import RELEASE_FILENAME, UnsafeNameError, load_artifact, pull_release
from runtime_kernels.vllm.config import load_checked_artifact, parse_oscar_config


def _hf_config():
    config = Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
                         num_hidden_layers=2, vocab_size=32, intermediate_size=32)
    config._name_or_path = MODEL
    return config


@pytest.fixture
def forged(hub, tmp_path):
    """v1 published honestly, then moved to a commit with other bytes and a consistent record naming v1.
    Returns (the honest release, its pins as zoo_manifest.yaml records them, the forged commit)."""
    honest = do_push(hub, make_artifact(tmp_path / "a", seed=0))
    pins = release_pins(hub, honest.commit)
    forged_commit = forge_release(hub, "v1", seed=7, tmp_path=tmp_path)
    move_tag(hub, "v1", forged_commit)
    return honest, pins, forged_commit


def release_pins(hub, commit: str) -> dict[str, str]:
    """name -> sha256 of every file of the release directory at `commit` (what zoo_manifest.yaml records)."""
    prefix = f"{MODEL}/default/"
    return {path[len(prefix):]: sha_bytes(hub.store.blob(REPO, digest))
            for path, digest in hub.store.tree(REPO, commit)[1].items() if path.startswith(prefix)}


def sha_bytes(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_pins_refuse_a_moved_tag_with_a_forged_record_on_a_cold_cache(hub, forged, tmp_path):
    honest, pins, forged_commit = forged
    kw = dict(token=TOKEN, endpoint=hub.endpoint)
    with pytest.raises(ArtifactError, match=rf"field 'commit': 'v1' names commit {forged_commit} on the Hub, but "
                                            rf"the pinned commit .* is {honest.commit}"):
        pull_release(MODEL, REPO, "v1", commit=honest.commit, cache_dir=tmp_path / "cold1", **kw)
    with pytest.raises(ArtifactError, match="sha256"):
        load_artifact(MODEL, repo=REPO, revision="v1", expected_sha256={ARTIFACT_FILENAME: pins[ARTIFACT_FILENAME]},
                      cache_dir=tmp_path / "cold2", **kw)
    from runtime_kernels.hf import OscarCache

    with pytest.raises(ArtifactError, match="field 'commit'"):
        OscarCache.from_pretrained(MODEL, _hf_config(), repo=REPO, revision="v1", commit=honest.commit,
                                   cache_dir=tmp_path / "cold3", **kw)
    # The honest commit, pinned, is still served by commit alone, and verified against the pinned hashes.
    pulled = pull_release(MODEL, REPO, None, commit=honest.commit, expected_sha256=pins, cache_dir=tmp_path / "c4", **kw)
    assert pulled.commit == honest.commit and pulled.record["version"] == "v1"


def test_pull_cli_with_the_manifest_refuses_the_forgery(hub, forged, tmp_path, monkeypatch, capsys):
    honest, pins, forged_commit = forged
    manifest = tmp_path / "zoo_manifest.yaml"
    manifest.write_text(_manifest_text(honest.commit, pins))
    base = ["pull", MODEL, "--repo", REPO, "--token", TOKEN, "--local-dir", str(tmp_path / "dest")]
    for extra in (["--revision", "v1", "--manifest", str(manifest)], ["--revision", "v1", "--commit", honest.commit],
                  ["--revision", "v1", "--expected-sha256", f"{ARTIFACT_FILENAME}={pins[ARTIFACT_FILENAME]}"]):
        code, out, err = run_cli([*base, *extra, "--cache-dir", str(tmp_path / f"cold{len(extra)}{extra[-2]}")],
                                 monkeypatch, capsys)
        assert code == 4 and out == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert "field 'commit'" in err or "sha256" in err
    assert not (tmp_path / "dest").exists()
    code, out, err = run_cli([*base[:-2], "--manifest", str(manifest), "--cache-dir", str(tmp_path / "ok")],
                             monkeypatch, capsys)
    assert code == 0 and f"(commit {honest.commit})" in err, err
    code, _, err = run_cli([*base, "--revision", "v1", "--expected-sha256", "oscar_kv.safetensors=abc"], monkeypatch,
                           capsys)
    assert code == 2 and "--expected-sha256" in err


def _manifest_text(commit: str, pins: dict[str, str]) -> str:
    files = [{"name": n, "sha256": d, "size": 1} for n, d in sorted(pins.items())]
    data = {"schema_version": 1, "repo": REPO,
            "recipes": [{"model_id": MODEL, "model_revision": "a" * 40, "data": {"dataset": "d.txt"}}],
            "releases": [{"model_id": MODEL, "model_revision": "a" * 40, "repo": REPO, "version": "v1",
                          "commit": commit, "files": files}]}
    return yaml.safe_dump(data, sort_keys=False)


def test_serve_config_pins_refuse_the_forgery_on_a_cold_cache(hub, forged, tmp_path, monkeypatch):
    honest, pins, _ = forged
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "serve-cold"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "serve-cold"))
    hf = _hf_config()
    for pin in ({"commit": honest.commit}, {"expected_sha256": {ARTIFACT_FILENAME: pins[ARTIFACT_FILENAME]}}):
        cfg = parse_oscar_config({"oscar": {"repo": REPO, "revision": "v1", "model_id": MODEL, **pin}})
        with pytest.raises(ArtifactError, match="field 'commit'|sha256"):
            load_checked_artifact(cfg, hf)
    cfg = parse_oscar_config({"oscar": {"repo": REPO, "commit": honest.commit, "expected_sha256": pins,
                                        "model_id": MODEL}})
    art = load_checked_artifact(cfg, hf)
    assert art.metadata["model_id"] == MODEL


def test_tag_only_on_a_cold_cache_checks_the_zoo_manifest_at_that_commit(hub, tmp_path, caplog):
    honest = do_push(hub, make_artifact(tmp_path / "a", seed=0))
    pins = release_pins(hub, honest.commit)
    # The publisher commits the manifest with its record of v1 (what `zoo publish` writes) to the zoo repo.
    hub.store.commit(REPO, "main", {"zoo_manifest.yaml": _manifest_text(honest.commit, pins).encode()}, [],
                     "manifest", None)
    caplog.set_level(logging.WARNING, logger="runtime_kernels.loader")
    ok = pull_release(MODEL, REPO, "v1", token=TOKEN, cache_dir=tmp_path / "c0", endpoint=hub.endpoint)
    assert ok.commit == honest.commit
    assert f"resolved to commit {honest.commit} on a cold cache" in caplog.text  # the served commit is said
    forged_commit = forge_release(hub, "v1", seed=7, tmp_path=tmp_path)  # its tree keeps the manifest
    move_tag(hub, "v1", forged_commit)
    with pytest.raises(ArtifactError, match=rf"zoo manifest at commit {forged_commit[:12]} records release 'v1' at "
                                            rf"commit {honest.commit}"):
        pull_release(MODEL, REPO, "v1", token=TOKEN, cache_dir=tmp_path / "c1", endpoint=hub.endpoint)
    # A forger who also rewrites the manifest's commit still disagrees with its recorded hashes.
    hub.store.commit(REPO, "main", {"zoo_manifest.yaml": _manifest_text(forged_commit, pins).encode()}, [],
                     "forged manifest", None)
    head = hub.store.refs(REPO)["branches"]["main"]
    move_tag(hub, "v1", head)
    record = json.loads(hub.store.blob(REPO, hub.store.tree(REPO, head)[1][f"{MODEL}/default/{RELEASE_FILENAME}"]))
    assert record["version"] == "v1"
    with pytest.raises(ArtifactError, match="zoo manifest|sha256"):
        pull_release(MODEL, REPO, "v1", token=TOKEN, cache_dir=tmp_path / "c2", endpoint=hub.endpoint)


@pytest.mark.parametrize("raw, field", [
    ({"repo": REPO, "revision": "main"}, "branch"),
    ({"repo": REPO, "revision": "release-candidate"}, "branch"),
    ({"repo": REPO, "revision": "v1", "commit": "abc"}, "commit"),
    ({"repo": REPO, "revision": "v1", "expected_sha256": {ARTIFACT_FILENAME: "XYZ"}}, "expected_sha256"),
    ({"path": "zoo/x", "allow_other_model": "yes"}, "allow_other_model"),
    ({"path": "zoo/x", "allow_unpinned": 1}, "allow_unpinned"),
    ({"path": "zoo/x", "window_reserve": float("nan")}, "window_reserve"),
    ({"path": "zoo/x", "window_reserve": float("inf")}, "window_reserve"),
    ({"path": "zoo/x", "window_reserve": "2.0"}, "window_reserve"),
    ({"path": "zoo/x", "layers": [1, True]}, "layers"),
    ({"path": "zoo/x", "layers": ["1"]}, "layers"),
    ({"path": "zoo/x", "commit": "a" * 40}, "commit"),
])
def test_serve_config_is_parsed_strictly(raw, field):
    with pytest.raises(ValueError, match=field) as info:
        parse_oscar_config({"oscar": raw})
    assert str(info.value).startswith("additional_config.oscar") and "\n" not in str(info.value)


def test_serve_config_accepts_pins_and_an_explicit_unpinned_branch():
    cfg = parse_oscar_config({"oscar": {"repo": REPO, "revision": "main", "allow_unpinned": True}})
    assert cfg.revision == "main"
    cfg = parse_oscar_config({"oscar": {"repo": REPO, "revision": "v3", "commit": "b" * 40,
                                        "expected_sha256": {ARTIFACT_FILENAME: "c" * 64}, "window_reserve": 3}})
    assert cfg.commit == "b" * 40 and cfg.window_reserve == 3


def test_a_malformed_commit_pin_is_refused_before_any_request(tmp_path):
    with pytest.raises(UnsafeNameError, match="field 'commit'"):
        pull_release(MODEL, REPO, "v1", commit="v1", cache_dir=tmp_path)


def test_local_artifact_pins_in_the_serve_config(tmp_path):
    art = make_artifact(tmp_path / "a")
    cfg = parse_oscar_config({"oscar": {"path": str(art), "expected_sha256": {ARTIFACT_FILENAME: "0" * 64}}})
    with pytest.raises(ArtifactError, match="sha256"):
        load_checked_artifact(cfg, _hf_config())
    cfg = parse_oscar_config({"oscar": {"path": str(art), "expected_sha256": {ARTIFACT_FILENAME: sha(art / ARTIFACT_FILENAME)}}})
    assert load_checked_artifact(cfg, _hf_config()).layer_ids.tolist() == read_artifact(art).layer_ids.tolist()


_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12), st.sampled_from(["yes", "no", "1", "true", "main", "v1", "a" * 40, "NaN"]),
                    st.lists(st.integers(-2, 5), max_size=3), st.dictionaries(st.text(max_size=4), st.text(max_size=4),
                                                                              max_size=2))


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["path", "repo", "revision", "commit", "expected_sha256", "allow_unpinned", "repo_type",
                              "model_id", "calibration", "allow_other_model", "kernel_backend", "window_reserve",
                              "layers", "unknown"]), value=_values, base=st.sampled_from(["path", "tag", "commit"]))
def test_fuzz_serve_config_is_strict(field, value, base):
    """Any value in any field: one line naming `additional_config.oscar.<field>`, or a config whose every field has
    its exact type, finite numbers and a pinned source."""
    raw = {"path": {"path": "zoo/x"}, "tag": {"repo": REPO, "revision": "v1"},
           "commit": {"repo": REPO, "commit": "a" * 40}}[base]
    raw = {**raw, field: value}
    try:
        cfg = parse_oscar_config({"oscar": raw})
    except ValueError as exc:
        assert str(exc).startswith("additional_config.oscar.") and "\n" not in str(exc)
        return
    assert type(cfg.allow_unpinned) is bool and type(cfg.allow_other_model) is bool
    assert type(cfg.window_reserve) in (int, float) and cfg.window_reserve >= 1 and cfg.window_reserve < float("inf")
    assert cfg.layers is None or all(type(i) is int for i in cfg.layers)
    if cfg.repo is not None and cfg.revision is not None and not cfg.allow_unpinned:
        assert re.fullmatch(r"v[1-9][0-9]*|[0-9a-f]{40}", cfg.revision)
    assert cfg.commit is None or re.fullmatch(r"[0-9a-f]{40}", cfg.commit)


@settings(max_examples=200, deadline=None)
@given(commit=st.text(max_size=50))
def test_fuzz_commit_pins_are_checked_before_any_request(commit, tmp_path_factory):
    if re.fullmatch(r"[0-9a-f]{40}", commit):
        return
    with pytest.raises(UnsafeNameError, match="field 'commit'"):
        pull_release(MODEL, REPO, "v1", commit=commit, cache_dir=tmp_path_factory.mktemp("c"))
