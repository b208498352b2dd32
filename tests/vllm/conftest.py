"""Shared fixtures of the vLLM plugin tests: the trained fixture model and an artifact calibrated for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


PARTIAL_LAYERS = (1, 3)  # layers 0 and 2 (the first layer among them) keep vLLM's / transformers' own cache


def restrict_layers(artifact, keep):
    """The artifact for the decoder layers `keep` only: every `[A, ...]` tensor sliced to those layers (the
    contract's own per-layer rows, untouched), metadata unchanged; validated."""
    from dataclasses import fields

    from runtime_kernels.artifact import OscarArtifact

    rows = [artifact.index_of_layer(i) for i in keep]
    if None in rows:
        raise ValueError(f"keep: layers {list(keep)} not all in the artifact's layer_ids {artifact.layer_ids.tolist()}")
    idx = torch.tensor(rows)
    kw = {f.name: getattr(artifact, f.name) for f in fields(OscarArtifact)}
    kw.update({k: v[idx].clone() for k, v in kw.items() if isinstance(v, torch.Tensor)})
    return OscarArtifact(**kw).validate()


@pytest.fixture(scope="session")
def partial_artifact_dir(artifact_dir, tmp_path_factory) -> Path:
    """The fixture's artifact restricted to PARTIAL_LAYERS (written through the artifact API)."""
    from runtime_kernels.artifact import read_artifact, write_artifact

    out = tmp_path_factory.mktemp("partial") / "tiny-partial"
    write_artifact(restrict_layers(read_artifact(artifact_dir), PARTIAL_LAYERS), out)
    return out
