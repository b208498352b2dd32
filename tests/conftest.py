"""Test setup: Triton runs in its CPU interpreter when there is no GPU (must be set before triton is imported)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Tests never touch the real Hub: offline mode unless a test points the client at its own server."""
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "1"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    yield


@pytest.fixture
def hub(tmp_path, monkeypatch, request):
    """The local fake Hub (tests/hub_server.py), online, as `HF_ENDPOINT`; it accepts the test module's TOKEN."""
    import huggingface_hub.constants as constants
    from hub_server import HubServer

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with HubServer(tmp_path / "hub", token=request.module.TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need a CUDA device and compiled kernels; `interpreter` tests launch Triton kernels on CPU tensors,
    which only the interpreter can do. One process runs Triton one way or the other (TRITON_INTERPRET is read when
    the kernels are defined), so on a GPU machine `make test` runs the GPU tests and skips the interpreter ones, and
    `CUDA_VISIBLE_DEVICES= make test` runs the CPU suite there."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA device")
    elif interpret:
        skips["gpu"] = pytest.mark.skip(reason="TRITON_INTERPRET=1: the GPU tests check the compiled kernels")
    if not interpret:
        skips["interpreter"] = pytest.mark.skip(
            reason="launches Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 (set automatically without a "
                   "GPU; on a GPU machine run `CUDA_VISIBLE_DEVICES= make test`)")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)
