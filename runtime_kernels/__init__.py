"""Slim INT2 KV-cache runtime for OSCAR artifacts.

Imports only torch, safetensors, huggingface_hub (for releases from the Hub) and triton (for the GPU kernels),
so it installs on its own: `oscar-kv-runtime`, built from runtime/ (docs/runtime.md). Nothing here imports
`oscar_calib`.
`runtime_kernels.hf` (the transformers integration) is the one module that also needs transformers, and is
imported explicitly: `from runtime_kernels.hf import OscarCache, enable_oscar_attention`.

The names below load on first use, so that a torch-free module of the package (`runtime_kernels.format`, whose
`DEFAULT_FORMAT` the CLI's option defaults read) does not pull torch in with the package.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ArtifactError": "runtime_kernels.artifact",
    "OscarArtifact": "runtime_kernels.artifact",
    "check_against_model": "runtime_kernels.artifact",
    "DEFAULT_FORMAT": "runtime_kernels.format",
    "KVFormat": "runtime_kernels.format",
    "identity_artifact": "runtime_kernels.artifact",
    "read_artifact": "runtime_kernels.artifact",
    "write_artifact": "runtime_kernels.artifact",
    "PagedKVCache": "runtime_kernels.cache",
    "load_artifact": "runtime_kernels.loader",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'runtime_kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
