"""Shared fixtures of the vLLM plugin tests: the trained fixture model and an artifact calibrated for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[2] / "oscar_calib" / "fixtures" / "tiny-qwen3"


# 64/256 windows, so that the end-to-end prompts (9, 200 and 700 tokens) reach several INT2 pages (the recipe's
# 128/1024 would hold the longest prompt entirely in BF16), and fp16 scales: the engine equals transformers only up
# to the model's own GEMM rounding (different kernels in the two), and an 8-bit ue5m3 scale can turn such a last-bit
# difference of a row's range into the next scale code, i.e. different codes for the whole row. ue5m3 pages are
# checked bit for bit at the engine level (tests/vllm/test_engine.py) and served below (`ue5m3_artifact_dir`).
RUN_ARGS = ["--sink", "64", "--recent", "256", "--seq-len", "1024", "--samples", "8", "--scale-dtype", "float16"]


@pytest.fixture(scope="session")
def artifact_dir(tmp_path_factory) -> Path:
    """OSCAR_VLLM_ARTIFACT if set, else `oscar-calib run` for the fixture with RUN_ARGS (~80 s), once a session."""
    given = os.environ.get("OSCAR_VLLM_ARTIFACT")
    if given:
        return Path(given)
    if not FIXTURE.is_dir():
        pytest.skip("trained fixture oscar_calib/fixtures/tiny-qwen3 missing")
    out = tmp_path_factory.mktemp("art") / "tiny"
    cli = Path(sys.executable).with_name("oscar-calib")
    subprocess.run([str(cli), "run", "--out", str(out), *RUN_ARGS], check=True, capture_output=True)
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


@pytest.fixture(scope="session")
def ue5m3_artifact_dir(artifact_dir, tmp_path_factory) -> Path:
    """The fixture's artifact stored with ue5m3 scales (8-bit scale and zero point per row): same tables."""
    from format_helpers import restamp

    from runtime_kernels.artifact import read_artifact, write_artifact

    art = restamp(read_artifact(artifact_dir), scale_dtype="ue5m3")
    out = tmp_path_factory.mktemp("ue5m3") / "tiny-ue5m3"
    write_artifact(art.validate(), out)
    return out
