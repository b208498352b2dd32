"""Slim INT2 KV-cache runtime for OSCAR artifacts.

Imports only torch, triton, safetensors, huggingface_hub and numpy. Nothing here imports `oscar_calib`.
`runtime_kernels.hf` (the transformers integration) is the one module that also needs transformers, and is
imported explicitly: `from runtime_kernels.hf import OscarCache, enable_oscar_attention`.
"""

from runtime_kernels.artifact import (
    ArtifactError,
    OscarArtifact,
    check_against_model,
    effective_bits,
    identity_artifact,
    read_artifact,
    write_artifact,
)
from runtime_kernels.cache import PagedKVCache
from runtime_kernels.loader import load_artifact

__all__ = [
    "ArtifactError",
    "OscarArtifact",
    "PagedKVCache",
    "check_against_model",
    "effective_bits",
    "identity_artifact",
    "load_artifact",
    "read_artifact",
    "write_artifact",
]
__version__ = "0.1.0"
