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



@pytest.fixture(scope="session")
def partial_artifact_dir(artifact_dir, tmp_path_factory) -> Path:
    """The fixture's artifact restricted to layers 1 and 3 (0 and 2, the first among them, keep vLLM's / transformers'
    own cache), written through the artifact API."""
    from runtime_kernels.artifact import read_artifact, write_artifact
    from runtime_kernels.vllm.config import restrict_layers

    out = tmp_path_factory.mktemp("partial") / "tiny-partial"
    write_artifact(restrict_layers(read_artifact(artifact_dir), [1, 3]), out)
    return out
