"""Issue 21 classes 1 and 4 (Hub side): a pull gets the release it asked for, or refuses; a Hub that cannot be
reached ends in exit 5 and one line; release.json is parsed strictly (fuzzed with hypothesis).

The fake Hub (tests/hub_server.py) is driven through the real huggingface_hub client; tags are moved and records
forged by editing the server's on-disk store, the way a compromised or careless publisher would.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hub import MODEL, REPO, TOKEN, do_load, do_push, go_offline, make_artifact, run_cli, sha

from oscar_calib.errors import HubError
from runtime_kernels.artifact import ARTIFACT_FILENAME, ArtifactError, read_artifact
from runtime_kernels.loader import (
    MAX_RELEASE_FILE_BYTES,
    HubUnreachableError,
    load_artifact,
    parse_release_record,
    pull_release,
    release_record,
)

GOOD = release_record(MODEL, "a" * 40, "default", "v1", {ARTIFACT_FILENAME: {"sha256": "a" * 64, "size": 3}})


def move_tag(hub, tag: str, commit: str) -> None:
    """Point `tag` at `commit` on the server (what the real Hub lets an owner do with `--force`)."""
    refs = hub.store.refs(REPO)
    refs["tags"][tag] = commit
    (hub.store.repo_dir(REPO) / "refs.json").write_text(json.dumps(refs))


def forge_release(hub, version: str, seed: int, tmp_path) -> str:
    """Commit other artifact bytes under MODEL/default with a consistent record naming `version`."""
    other = make_artifact(tmp_path / f"forged{seed}", seed=seed)
    blob = (other / ARTIFACT_FILENAME).read_bytes()
    record = release_record(MODEL, "a" * 40, "default", version,
                            {ARTIFACT_FILENAME: {"sha256": sha(other / ARTIFACT_FILENAME), "size": len(blob)}})
    return hub.store.commit(REPO, "main", {f"{MODEL}/default/{ARTIFACT_FILENAME}": blob,
                                           f"{MODEL}/default/release.json": json.dumps(record).encode()},
                            [f"{MODEL}/default/README.md"], "forged", None)


def put_record(hub, raw: bytes) -> None:
    hub.store.commit(REPO, "main", {f"{MODEL}/default/release.json": raw}, [], "edit record", None)


# --- the release asked for ------------------------------------------------------------------------------
def test_tag_moved_to_another_release_is_refused(hub, tmp_path, monkeypatch, capsys):
    r1 = do_push(hub, make_artifact(tmp_path / "a", seed=0))
    r2 = do_push(hub, make_artifact(tmp_path / "b", seed=1))
    move_tag(hub, "v1", r2.commit)  # v1 now names the commit whose record says v2
    with pytest.raises(ArtifactError, match=r"field 'version': asked for release 'v1'.*is release 'v2'"):
        do_load(hub, tmp_path)
    dest = tmp_path / "dest"
    code, out, err = run_cli(["pull", MODEL, "--repo", REPO, "--revision", "v1", "--local-dir", str(dest),
                              "--cache-dir", str(tmp_path / "c2"), "--token", TOKEN], monkeypatch, capsys)
    assert code == 4 and "'v1'" in err and "v2" in err and "Traceback" not in err and out == ""
    assert not dest.exists() and len(err.strip().splitlines()) == 1
    # Pinning the commit (the honest way to take the other content) still works and names that commit.
    pulled = pull_release(MODEL, REPO, r2.commit, token=TOKEN, cache_dir=tmp_path / "c3", endpoint=hub.endpoint)
    assert pulled.commit == r2.commit and pulled.record["version"] == "v2"
    assert r1.commit != r2.commit


def test_tag_moved_to_forged_content_with_the_same_version_is_refused_by_a_warm_cache(hub, tmp_path):
    r1 = do_push(hub, make_artifact(tmp_path / "a", seed=0))
    first = pull_release(MODEL, REPO, "v1", token=TOKEN, cache_dir=tmp_path / "cache", endpoint=hub.endpoint)
    assert first.commit == r1.commit == hub.store.refs(REPO)["tags"]["v1"]
    forged = forge_release(hub, "v1", seed=7, tmp_path=tmp_path)
    move_tag(hub, "v1", forged)
    with pytest.raises(ArtifactError, match=rf"release tag 'v1' now names commit {forged}.*at commit {r1.commit}"):
        do_load(hub, tmp_path)
    with pytest.raises(ArtifactError, match="never move"):  # and it keeps refusing: the cached ref is not updated
        do_load(hub, tmp_path)
    # A cold cache cannot know the tag moved: hashes pinned from the manifest are what catches it there.
    pinned = {ARTIFACT_FILENAME: sha(tmp_path / "a" / ARTIFACT_FILENAME)}
    with pytest.raises(ArtifactError, match="sha256"):
        load_artifact(MODEL, repo=REPO, revision="v1", token=TOKEN, cache_dir=tmp_path / "cold",
                      endpoint=hub.endpoint, expected_sha256=pinned)


def test_the_resolved_commit_is_recorded(hub, tmp_path, monkeypatch, capsys, caplog):
    local = make_artifact(tmp_path / "a")
    r1 = do_push(hub, local)
    caplog.set_level(logging.INFO, logger="runtime_kernels.loader")
    pulled = pull_release(MODEL, REPO, "v1", token=TOKEN, cache_dir=tmp_path / "c", endpoint=hub.endpoint)
    assert pulled.commit == r1.commit and pulled.revision == "v1"
    assert f"verified at commit {r1.commit}" in caplog.text
    code, out, err = run_cli(["pull", MODEL, "--repo", REPO, "--revision", "v1", "--cache-dir", str(tmp_path / "c"),
                              "--token", TOKEN, "--json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out)["commit"] == r1.commit


@pytest.mark.parametrize("revision, kind", [("v1", "tag"), ("main", "branch or tag")])
def test_offline_moving_name_warns_with_the_cached_commit(hub, tmp_path, caplog, revision, kind):
    r1 = do_push(hub, make_artifact(tmp_path / "a"))
    do_load(hub, tmp_path, revision=revision)
    do_push(hub, make_artifact(tmp_path / "b", seed=1))  # main moves on; the cache does not know
    hub.stop()
    go_offline_env = pytest.MonkeyPatch()
    try:
        go_offline(go_offline_env)
        caplog.set_level(logging.WARNING, logger="runtime_kernels.loader")
        art = load_artifact(MODEL, repo=REPO, revision=revision, cache_dir=tmp_path / "cache", endpoint=hub.endpoint)
        assert torch.equal(art.k_rotation, read_artifact(tmp_path / "a").k_rotation)
        warning = [r for r in caplog.records if r.levelno == logging.WARNING and "offline" in r.getMessage()]
        assert len(warning) == 1 and r1.commit in warning[0].getMessage()
        assert f"{kind} '{revision}'" in warning[0].getMessage()
        caplog.clear()
        load_artifact(MODEL, repo=REPO, revision=r1.commit, cache_dir=tmp_path / "cache", endpoint=hub.endpoint)
        assert not [r for r in caplog.records if "offline" in r.getMessage()]  # a sha cannot move: no warning
    finally:
        go_offline_env.undo()


@pytest.mark.parametrize("raw, field", [
    (b'{"format": "oscar-kv-release", "format": "oscar-kv-release"}', "duplicate key"),
    (json.dumps(GOOD).replace('"size": 3', '"size": ' + "9" * 5000).encode(), "5000 digits"),
    (json.dumps(GOOD).replace('"size": 3', '"size": 3, "size": 4').encode(), "duplicate"),
    (json.dumps(GOOD).replace('"size": 3', '"size": NaN').encode(), "NaN"),
])
def test_bad_records_served_by_the_hub_end_in_exit_4(hub, tmp_path, monkeypatch, capsys, raw, field):
    do_push(hub, make_artifact(tmp_path / "a"))
    put_record(hub, raw)
    with pytest.raises(ArtifactError, match=field):
        do_load(hub, tmp_path, revision="main")
    code, out, err = run_cli(["pull", MODEL, "--repo", REPO, "--revision", "main", "--cache-dir", str(tmp_path / "k"),
                              "--token", TOKEN], monkeypatch, capsys)
    assert code == 4 and field in err and "Traceback" not in err and len(err) < 2000


# --- the Hub cannot be reached ----------------------------------------------------------------------------
def _closed_port_endpoint() -> str:
    """An endpoint nobody listens on: connection refused, like a Hub that is down (a stopped HubServer would
    still answer on the client's pooled keep-alive connection)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_hub_unreachable_on_push_and_pull(hub, tmp_path, monkeypatch, capsys):
    from oscar_calib.zoo.hub import push

    local = make_artifact(tmp_path / "a")
    do_push(hub, local)
    dead = _closed_port_endpoint()
    monkeypatch.setenv("HF_ENDPOINT", dead)
    t0 = time.perf_counter()
    with pytest.raises(HubError, match=f"cannot reach the Hub at {dead}"):
        push(make_artifact(tmp_path / "b", seed=1), REPO, token=TOKEN, endpoint=dead)
    with pytest.raises(HubUnreachableError, match="HF_HUB_OFFLINE=1"):
        load_artifact(MODEL, repo=REPO, revision="v1", token=TOKEN, cache_dir=tmp_path / "c", endpoint=dead)
    for args in (["push", str(local), "--repo", REPO, "--token", TOKEN],
                 ["pull", MODEL, "--repo", REPO, "--revision", "v1", "--cache-dir", str(tmp_path / "c"),
                  "--local-dir", str(tmp_path / "d"), "--token", TOKEN]):
        code, out, err = run_cli(args, monkeypatch, capsys)
        assert code == 5 and "cannot reach the Hub" in err and "Traceback" not in err and out == ""
        assert len(err.strip().splitlines()) == 1 and TOKEN not in err
    assert not (tmp_path / "d").exists()
    assert time.perf_counter() - t0 < 20  # refused at the first request, not after the client's retries


# --- release.json parser ------------------------------------------------------------------------------------
def _mutated(**changes) -> bytes:
    data = json.loads(json.dumps(GOOD))
    data.update(changes)
    return json.dumps(data).encode()


def _with_entry(**entry) -> bytes:
    data = json.loads(json.dumps(GOOD))
    data["files"][ARTIFACT_FILENAME] = {"sha256": "a" * 64, "size": 3, **entry}
    return json.dumps(data).encode()


BAD_RECORDS = [
    (b'{"a": 1, "a": 2}', "duplicate key"),
    (json.dumps(GOOD)[:-1].encode() + b', "version": "v2"}', "duplicate key"),
    (json.dumps(GOOD).replace('"sha256"', '"sha256": "' + "b" * 64 + '", "sha256"', 1).encode(), "duplicate key"),
    (json.dumps(GOOD).replace('"size": 3', '"size": 1' + "0" * 30).encode(), "31 digits"),
    (json.dumps(GOOD).replace('"size": 3', '"size": -' + "1" * 4400).encode(), "4400 digits"),
    (json.dumps(GOOD).replace('"schema_version": 1', '"schema_version": ' + "1" * 21).encode(), "21 digits"),
    (_with_entry(size=MAX_RELEASE_FILE_BYTES + 1), "files.oscar_kv.safetensors.size"),
    (_with_entry(size=3.0), "files.oscar_kv.safetensors.size"),
    (_with_entry(size=True), "files.oscar_kv.safetensors.size"),
    (_with_entry(size="3"), "files.oscar_kv.safetensors.size"),
    (json.dumps(GOOD).replace('"size": 3', '"size": Infinity').encode(), "Infinity"),
    (json.dumps(GOOD).replace('"size": 3', '"size": -Infinity').encode(), "Infinity"),
    (_mutated(schema_version=True), "schema_version"),
    (_mutated(schema_version=1.0), "schema_version"),
    (_mutated(version="1"), "version"),
    (_mutated(version="v01"), "version"),
    (_mutated(version="v1/../v2"), "version"),
    (_mutated(version=["v1"]), "version"),
    (_mutated(model_revision="a\nb"), "model_revision"),
    (_mutated(model_revision=""), "model_revision"),
    (_mutated(model_revision="x" * 300), "model_revision"),
    (_mutated(model_id="a/b/c"), "model_id"),
    (_mutated(files={f"f{i}": {"sha256": "a" * 64, "size": 1} for i in range(300)}
              | {ARTIFACT_FILENAME: {"sha256": "a" * 64, "size": 1}}), "at most 256"),
    (b"[" * 100000 + b"]" * 100000, "JSON"),
    (b"\xff\xfe{}", "JSON"),
    (b"\xef\xbb\xbf" + json.dumps(GOOD).encode(), "JSON"),
    (b"", "JSON"),
    (b"null", "<root>"),
    (b" " * ((1 << 20) + 1), "larger than"),
]


@pytest.mark.parametrize("raw, match", BAD_RECORDS, ids=[f"bad{i}" for i in range(len(BAD_RECORDS))])
def test_release_record_refusals(raw, match):
    with pytest.raises(ArtifactError, match=match) as info:
        parse_release_record(raw, "r.json")
    assert str(info.value).startswith("r.json") and len(str(info.value)) < 1000


def test_release_record_accepts_the_bounds():
    big = parse_release_record(_with_entry(size=MAX_RELEASE_FILE_BYTES), "r")
    assert big["files"][ARTIFACT_FILENAME]["size"] == MAX_RELEASE_FILE_BYTES
    assert parse_release_record(_mutated(version="v999999"), "r")["version"] == "v999999"
    assert parse_release_record(json.dumps(GOOD, indent=2).encode(), "r") == GOOD


_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3), max_leaves=12)


def _check_invariants(record: dict) -> None:
    """What a caller relies on once a record is accepted."""
    assert record["format"] == "oscar-kv-release" and record["schema_version"] == 1
    assert ARTIFACT_FILENAME in record["files"] and len(record["files"]) <= 256
    for name, entry in record["files"].items():
        assert ".." not in name and not name.startswith("/")
        assert type(entry["size"]) is int and 0 <= entry["size"] <= MAX_RELEASE_FILE_BYTES
        assert len(entry["sha256"]) == 64


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_release_record_bytes(raw):
    try:
        _check_invariants(parse_release_record(raw, "fuzz"))
    except ArtifactError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(GOOD) + ["files.entry", "files.entry.size", "files.entry.sha256", "extra"]),
       value=_json_values, duplicate=st.booleans())
def test_fuzz_release_record_fields(key, value, duplicate):
    data = json.loads(json.dumps(GOOD))
    if key.startswith("files.entry"):
        entry = data["files"][ARTIFACT_FILENAME]
        if key == "files.entry":
            data["files"][ARTIFACT_FILENAME] = value
        else:
            entry[key.rsplit(".", 1)[1]] = value
    else:
        data[key] = value
    raw = json.dumps(data, allow_nan=True)
    if duplicate:  # repeat the first key with the fuzzed value: must be refused, never "last wins"
        raw = "{" + json.dumps("format") + ": " + json.dumps(value, allow_nan=True) + ", " + raw[1:]
    try:
        record = parse_release_record(raw.encode(), "fuzz")
    except ArtifactError as exc:
        assert str(exc).startswith("fuzz")
        return
    assert not duplicate
    _check_invariants(record)


@settings(max_examples=100, deadline=None)
@given(files=st.dictionaries(st.from_regex(r"[a-z][a-z0-9_.-]{0,12}", fullmatch=True).filter(lambda n: ".." not in n),
                             st.tuples(st.from_regex(r"[0-9a-f]{64}", fullmatch=True),
                                       st.integers(0, MAX_RELEASE_FILE_BYTES)), max_size=5),
       version=st.integers(1, 999999))
def test_fuzz_release_record_roundtrip(files, version):
    entries = {n: {"sha256": h, "size": s} for n, (h, s) in files.items() if n != "release.json"}
    entries[ARTIFACT_FILENAME] = {"sha256": "0" * 64, "size": 1}
    record = release_record(MODEL, "a" * 40, "default", f"v{version}", entries)
    assert parse_release_record(json.dumps(record, sort_keys=True).encode(), "r") == record
