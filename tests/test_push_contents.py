"""What `push` uploads: the artifact, its receipts, the model card and release.json; statistics only on request.

`oscar_stats.safetensors` holds statistics of the user's calibration data and the model's o_proj weights, and
`calibration_log.json` local paths and the environment: neither may leave the machine by default. Checked on the
stand-in Hub's stored tree (what a reader of the repo would see), through the CLI a user runs.
"""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_cli
from test_hub import MODEL, REPO, TOKEN, make_artifact, tree  # noqa: F401  (TOKEN: the hub fixture's token)

from runtime_kernels.artifact import ARTIFACT_FILENAME

BASE = f"{MODEL}/default"


@pytest.fixture
def art_dir(tmp_path):
    """An artifact directory as `run` writes it: artifact, statistics, log, model card, plus a receipt."""
    d = make_artifact(tmp_path / "art", extra={"calibration_log.json": json.dumps({"dataset": "/home/me/private.jsonl"}),
                                               "README.md": "# run report\n", "eval_demo.json": "{}"})
    (d / "oscar_stats.safetensors").write_bytes(b"\0" * 4096)  # content is never read without --include-stats
    return d


def _released(hub) -> set[str]:
    return {p.removeprefix(BASE + "/") for p in tree(hub, "v1") if p.startswith(BASE + "/")}


def test_push_without_flags_uploads_no_statistics(hub, art_dir, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    code, out, err = run_cli(["push", str(art_dir), "--repo", REPO], monkeypatch, capsys)
    assert code == 0, err
    assert _released(hub) == {ARTIFACT_FILENAME, "eval_demo.json", "README.md", "release.json"}
    record = json.loads(hub.store.blob(REPO, tree(hub, "v1")[f"{BASE}/release.json"]))
    assert set(record["files"]) == {ARTIFACT_FILENAME, "eval_demo.json", "README.md"}
    assert "oscar_stats" not in err  # no warning when nothing sensitive goes up


def test_include_stats_uploads_them_with_a_warning(hub, art_dir, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    code, out, err = run_cli(["push", str(art_dir), "--repo", REPO, "--include-stats"], monkeypatch, capsys)
    assert code == 0, err
    assert _released(hub) == {ARTIFACT_FILENAME, "eval_demo.json", "README.md", "release.json",
                              "oscar_stats.safetensors"}
    assert "--include-stats" in err and "calibration data" in err and "o_proj" in err


def test_dry_run_lists_what_stays_local(art_dir, monkeypatch, capsys):
    code, out, err = run_cli(["push", str(art_dir), "--repo", REPO, "--dry-run", "--json"], monkeypatch, capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert set(plan["files"]) == {ARTIFACT_FILENAME, "eval_demo.json"}
    assert plan["local_only"] == ["calibration_log.json", "oscar_stats.safetensors"]


def test_uploads_stream_from_disk(hub, art_dir, monkeypatch):
    """Every uploaded file is handed to huggingface_hub as a path (it streams and hashes in chunks), not as bytes
    read here; the release record's hashes are the client's own."""
    import hashlib

    import huggingface_hub

    from oscar_calib.zoo.hub import push

    seen = []
    real = huggingface_hub.CommitOperationAdd

    class Recording(real):
        def __post_init__(self):
            seen.append((self.path_in_repo, type(self.path_or_fileobj).__name__))
            super().__post_init__()

    monkeypatch.setattr(huggingface_hub, "CommitOperationAdd", Recording)
    result = push(art_dir, REPO, token=TOKEN, endpoint=hub.endpoint, include_stats=True)
    files = dict(seen)
    assert files[f"{BASE}/{ARTIFACT_FILENAME}"] == "str" and files[f"{BASE}/oscar_stats.safetensors"] == "str"
    want = hashlib.sha256((art_dir / ARTIFACT_FILENAME).read_bytes()).hexdigest()
    assert result.files[ARTIFACT_FILENAME]["sha256"] == want
