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
