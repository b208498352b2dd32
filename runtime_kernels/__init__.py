"""Slim INT2 KV-cache runtime for OSCAR artifacts.

Imports only torch, triton, safetensors, huggingface_hub and numpy. Nothing here imports `oscar_calib`.
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
from runtime_kernels.loader import load_artifact

__all__ = [
    "ArtifactError",
    "OscarArtifact",
    "check_against_model",
    "effective_bits",
    "identity_artifact",
    "load_artifact",
    "read_artifact",
    "write_artifact",
]
__version__ = "0.1.0"
