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
