"""The real-model tool (`tools/real_model.py`) loaded as a module, for the tests that use its fixtures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def real_model_tool():
    """`tools/real_model.py` as the module `real_model` (one instance per process)."""
    if "real_model" in sys.modules:
        return sys.modules["real_model"]
    spec = importlib.util.spec_from_file_location("real_model", ROOT / "tools" / "real_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_model"] = module
    spec.loader.exec_module(module)
    return module


def fetched_slice(spec_name: str, layers: int):
    """(tool module, full model dir, sliced model dir) of the real model `spec_name` ("SMOLLM2" or "GEMMA3"):
    fetched and converted once, cached across runs; the test is skipped where it cannot be fetched."""
    import pytest

    rm = real_model_tool()
    spec = getattr(rm, spec_name)
    try:
        full = rm.ensure_model(rm.default_dir(spec), spec)
        sliced = rm.write_slice(full, layers, spec=spec)
    except (rm.FetchError, rm.MissingDependencyError) as exc:
        pytest.skip(f"{spec.name} is not available here: {exc}")
    return rm, full, sliced
