"""Shared fixtures of the vLLM plugin tests: the trained fixture model and an artifact calibrated for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[2] / "oscar_calib" / "fixtures" / "tiny-qwen3"


@pytest.fixture(scope="session")
def artifact_dir(tmp_path_factory) -> Path:
    """OSCAR_VLLM_ARTIFACT (the engine lane calibrates once), else `oscar-calib run` for the fixture (~80 s)."""
    given = os.environ.get("OSCAR_VLLM_ARTIFACT")
    if given:
        return Path(given)
    if not FIXTURE.is_dir():
        pytest.skip("trained fixture oscar_calib/fixtures/tiny-qwen3 missing")
    out = tmp_path_factory.mktemp("art") / "tiny"
    cli = Path(sys.executable).with_name("oscar-calib")
    subprocess.run([str(cli), "run", "--out", str(out)], check=True, capture_output=True)
    return out
