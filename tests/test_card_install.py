"""The model card's "How to use", as a user who has only the zoo meets it: a release pushed with `--with-wheels`, then,
in a fresh virtual environment and a folder of its own, the card's install lines and its Python snippet run verbatim
against the stand-in Hub (tests/hub_server.py), which also serves the model the artifact names.

The venv is made with `--system-site-packages` so that it reuses this environment's torch and transformers (the test
machine has no index to fetch a second torch from), and the card's pip lines run with `--no-deps` added: every
dependency is already there, but pip re-checks torch's own requirements and this environment's setuptools is older
than the `setuptools>=77` torch 2.13 declares, which it cannot fetch offline. `--force-reinstall` on the release's
wheel because the venv sees this environment's oscar-kv-runtime: where that is a copy of the same version (CI's `pip
install -e .` builds the runtime from runtime/ as a copy), pip would call the release's wheel "already satisfied" and
install nothing. The wheel lands in the venv, where it shadows the development checkout (the test asserts
`runtime_kernels` is imported from the venv). About 60 s on 2 cores: marked slow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli
from format_helpers import PAPER

pytestmark = pytest.mark.slow

TOKEN = None  # the conftest `hub` fixture's server: no token required
ROOT = Path(__file__).resolve().parents[1]
MODEL = "oscar-calib/tiny-qwen3"
FIXTURE = ROOT / "oscar_calib" / "fixtures" / "tiny-qwen3"


def _blocks(card: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", card, flags=re.S)


def test_card_install_line_and_snippet_work_in_a_fresh_venv(hub, tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi, hf_hub_download

    from runtime_kernels.artifact import identity_artifact, write_artifact

    api = HfApi(endpoint=hub.endpoint)
    api.create_repo(MODEL)  # the model the artifact names, served by the same stand-in Hub
    api.upload_folder(repo_id=MODEL, folder_path=str(FIXTURE), allow_patterns=["*.json", "*.safetensors"])
    art = tmp_path / "zoo" / "demo"
    art.mkdir(parents=True)
    write_artifact(identity_artifact(4, 2, 4, 128, model_id=MODEL, fmt=PAPER), art)
    code, out, err = run_cli(["push", str(art), "--repo", "me/zoo", "--version", "v1", "--with-wheels"], monkeypatch,
                             capsys)
    assert code == 0, err
    card = Path(hf_hub_download("me/zoo", f"{MODEL}/default/README.md", revision="v1", endpoint=hub.endpoint,
                                cache_dir=tmp_path / "read-card")).read_text()
    assert card.count("## How to use") == 1 and "## Use" not in card  # one section, the run report's dropped
    assert "pip install oscar-calib" not in card and '"path": "."' not in card and "from_pretrained('.'" not in card
    (install,) = [b for b in _blocks(card, "bash") if "pip install" in b]
    (snippet,) = _blocks(card, "python")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    user = tmp_path / "elsewhere"  # not the clone, not the pulled folder: the card must work from any folder
    user.mkdir()
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest's: a user has none
    env = {**clean, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "HF_ENDPOINT": hub.endpoint,
           "HF_HOME": str(tmp_path / "user-hf"), "HF_HUB_OFFLINE": "0", "PIP_NO_INDEX": "1",
           "PYTHONPATH": "", "VIRTUAL_ENV": str(venv)}
    install = install.replace("pip install ", "pip install --no-deps ")  # why: the module docstring
    install = install.replace('pip install --no-deps "oscar-release/', 'pip install --no-deps --force-reinstall "oscar-release/')
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", install], cwd=user, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    check = snippet + "\nimport runtime_kernels; print('RUNTIME', runtime_kernels.__file__)\n"
    done = subprocess.run([str(venv / "bin" / "python"), "-c", check], cwd=user, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runtime = done.stdout.split("RUNTIME ", 1)[1].strip()
    assert runtime.startswith(str(venv)), runtime  # the wheel from the release, not the development checkout
    assert done.stdout.split("RUNTIME ", 1)[0].strip(), "the snippet printed no completion"
