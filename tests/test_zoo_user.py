"""The user who only has the zoo: `hf download` of a release, the errors that point the way, sizes printed alike.

Expectations are independent of the code under test: file bytes against the pushed ones with hashlib, the models and
versions a hint must list from what the test pushed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from test_hub import MODEL, REPO, TOKEN, do_push, make_artifact

HF_CLI = "import sys; from huggingface_hub.cli.hf import main; sys.argv[0] = 'hf'; sys.exit(main())"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_hf_download_of_a_whole_release_repo(hub, tmp_path):
    """`hf download ORG/ZOO --revision v1` (snapshot_download: the tree listing, then every file) gets every file
    of the release, byte for byte what was pushed."""
    art = make_artifact(tmp_path / "art", extra={"eval_demo.json": '{"ppl": 1.0}'})
    do_push(hub, art, version="v1")
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0",
           "HF_HOME": str(tmp_path / "hf")}
    out = tmp_path / "dl"
    done = subprocess.run([sys.executable, "-c", HF_CLI, "download", REPO, "--revision", "v1", "--local-dir",
                           str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    base = out / MODEL / "default"
    got = sorted(p.name for p in base.iterdir())
    assert got == ["README.md", "eval_demo.json", "oscar_kv.safetensors", "release.json"], got
    for name in ("oscar_kv.safetensors", "eval_demo.json"):
        assert _sha(base / name) == _sha(art / name), name


# ------------------------------------------------------------------------------------------------ sizes
def test_format_bytes_against_hand_values():
    from runtime_kernels.units import format_bytes

    cases = {0: "0 B", 1023: "1023 B", 1024: "1.0 KiB", 1536: "1.5 KiB", 40_894_464: "39.0 MiB",
             300 * 2**20: "300 MiB", 2**30 - 1: "1.0 GiB", int(1023.6 * 2**20): "1.0 GiB", 3 * 2**40: "3.0 TiB"}
    for n, text in cases.items():
        assert format_bytes(n) == text, n


def test_one_size_for_one_file_in_the_summary_and_in_push(tmp_path, monkeypatch, capsys):
    """The run summary and push's --include-stats warning print the same text for the same file (they used to
    say 39.0 MB and 40.9 MB: two formatters, binary and decimal)."""
    from cli_helpers import run_cli

    from oscar_calib.cli.run_cmd import written_summary

    art = make_artifact(tmp_path / "art")
    (art / "oscar_stats.safetensors").write_bytes(b"\0" * 40_894_464)
    summary = written_summary(art, None)
    code, _, err = run_cli(["push", str(art), "--repo", REPO, "--include-stats", "--dry-run"], monkeypatch, capsys)
    assert code == 0, err
    assert "39.0 MiB" in summary and "(39.0 MiB)" in " ".join(err.split()), (summary, err)
