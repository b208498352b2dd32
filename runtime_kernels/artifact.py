"""The OSCAR KV artifact: read, validate and write `oscar_kv.safetensors` (contract version 1).

This module is the only thing that crosses from calibration to the runtime. It imports nothing
from `oscar_calib`. Row-vector convention: `x_rot = x @ R`, `x = x_rot @ R^T`.

Tensors (A = calibrated attention layers, H = KV heads, d = head_dim):

    layer_ids      int64   [A]
    k_rotation     float32 [A, H, d, d]
    v_rotation     float32 [A, H, d, d]
    k_clip_ratio   float32 [A, H]       in (0, 1]; 1 = no clipping
    v_clip_ratio   float32 [A, H]
    k_eigenvalues  float32 [A, H, d]    descending
    v_eigenvalues  float32 [A, H, d]
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

ARTIFACT_FILENAME = "oscar_kv.safetensors"
FORMAT_NAME = "oscar-kv"
SCHEMA_VERSION = 1
ORTHOGONALITY_TOL = 1e-5

TENSOR_NAMES = (
    "layer_ids",
    "k_rotation",
    "v_rotation",
    "k_clip_ratio",
    "v_clip_ratio",
    "k_eigenvalues",
    "v_eigenvalues",
)
REQUIRED_METADATA = (
    "format",
    "schema_version",
    "model_id",
    "model_revision",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "bits",
    "group_size",
    "sink_tokens",
    "recent_tokens",
    "granularity",
    "key_target",
    "value_target",
    "calibration",
    "tool_version",
    "created_at",
)
INT_METADATA = (
    "schema_version",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "bits",
    "group_size",
    "sink_tokens",
    "recent_tokens",
)


class ArtifactError(ValueError):
    """An artifact that breaks the contract. The message names the file, the field and what was expected."""


@dataclass
class OscarArtifact:
    """In-memory form of one artifact. Tensors live on the CPU in their contract dtypes."""

    layer_ids: torch.Tensor
    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_clip_ratio: torch.Tensor
    v_clip_ratio: torch.Tensor
    k_eigenvalues: torch.Tensor
    v_eigenvalues: torch.Tensor
    metadata: dict[str, str] = field(default_factory=dict)
    source: str = "<memory>"

    # -- convenience accessors -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.layer_ids.numel())

    @property
    def num_kv_heads(self) -> int:
        return int(self.k_rotation.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.k_rotation.shape[-1])

    @property
    def group_size(self) -> int:
        return int(self.metadata.get("group_size", self.head_dim))

    @property
    def sink_tokens(self) -> int:
        return int(self.metadata.get("sink_tokens", 64))

    @property
    def recent_tokens(self) -> int:
        return int(self.metadata.get("recent_tokens", 256))

    @property
    def calibration(self) -> dict[str, Any]:
        return json.loads(self.metadata.get("calibration", "{}"))

    def index_of_layer(self, layer_idx: int) -> int | None:
        """Position of global decoder layer `layer_idx` in the artifact, or None if it was skipped."""
        hits = (self.layer_ids == layer_idx).nonzero()
        return int(hits[0, 0]) if hits.numel() else None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in TENSOR_NAMES}

    def validate(self) -> OscarArtifact:
        validate_tensors(self.tensors(), self.metadata, self.source)
        return self


def _fail(source: str, field_name: str, message: str) -> None:
    raise ArtifactError(f"{source}: field '{field_name}': {message}")


def validate_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str], source: str) -> None:
    """Check every rule of contract version 1. Raises ArtifactError naming the first broken field."""
    for name in TENSOR_NAMES:
        if name not in tensors:
            _fail(source, name, "missing tensor")
    extra = sorted(set(tensors) - set(TENSOR_NAMES))
    if extra:
        _fail(source, extra[0], f"unexpected tensor (contract v{SCHEMA_VERSION} has {list(TENSOR_NAMES)})")
    for key in REQUIRED_METADATA:
        if key not in metadata:
            _fail(source, key, "missing from __metadata__")
    if metadata["format"] != FORMAT_NAME:
        _fail(source, "format", f"expected '{FORMAT_NAME}', got '{metadata['format']}'")
    for key in INT_METADATA:
        try:
            int(metadata[key])
        except ValueError:
            _fail(source, key, f"expected an integer string, got '{metadata[key]}'")
    if int(metadata["schema_version"]) != SCHEMA_VERSION:
        _fail(source, "schema_version", f"expected {SCHEMA_VERSION}, got {metadata['schema_version']}")
    if int(metadata["bits"]) != 2:
        _fail(source, "bits", f"expected 2, got {metadata['bits']}")
    if metadata["granularity"] not in ("head", "layer"):
        _fail(source, "granularity", f"expected 'head' or 'layer', got '{metadata['granularity']}'")
    try:
        json.loads(metadata["calibration"])
    except json.JSONDecodeError as exc:
        _fail(source, "calibration", f"expected JSON: {exc}")

    layer_ids = tensors["layer_ids"]
    if layer_ids.dtype != torch.int64 or layer_ids.dim() != 1:
        _fail(source, "layer_ids", f"expected int64 [A], got {layer_ids.dtype} {list(layer_ids.shape)}")
    if layer_ids.numel() == 0:
        _fail(source, "layer_ids", "expected at least one calibrated layer")
    if (layer_ids < 0).any() or (layer_ids[1:] <= layer_ids[:-1]).any():
        _fail(source, "layer_ids", "expected strictly increasing non-negative layer indices")
    num_layers = layer_ids.numel()
    h_kv = int(metadata["num_key_value_heads"])
    h_q = int(metadata["num_attention_heads"])
    d = int(metadata["head_dim"])
    if h_kv <= 0 or h_q % h_kv:
        _fail(source, "num_key_value_heads", f"expected a divisor of num_attention_heads={h_q}, got {h_kv}")
    if d <= 0 or d & (d - 1):
        _fail(source, "head_dim", f"expected a power of two, got {d}")
    g = int(metadata["group_size"])
    if g <= 0 or d % g or g % 4:
        _fail(source, "group_size", f"expected a multiple of 4 dividing head_dim={d}, got {g}")

    expected = {
        "k_rotation": (num_layers, h_kv, d, d),
        "v_rotation": (num_layers, h_kv, d, d),
        "k_clip_ratio": (num_layers, h_kv),
        "v_clip_ratio": (num_layers, h_kv),
        "k_eigenvalues": (num_layers, h_kv, d),
        "v_eigenvalues": (num_layers, h_kv, d),
    }
    for name, shape in expected.items():
        t = tensors[name]
        if t.dtype != torch.float32:
            _fail(source, name, f"expected float32, got {t.dtype}")
        if tuple(t.shape) != shape:
            _fail(source, name, f"expected shape {list(shape)}, got {list(t.shape)}")
        if not torch.isfinite(t).all():
            _fail(source, name, "contains NaN or Inf")
    for name in ("k_clip_ratio", "v_clip_ratio"):
        t = tensors[name]
        if (t <= 0).any() or (t > 1).any():
            _fail(source, name, "expected every ratio in (0, 1]")
    for name in ("k_rotation", "v_rotation"):
        err = orthogonality_error(tensors[name])
        if err > ORTHOGONALITY_TOL:
            _fail(source, name, f"not orthogonal: max |R R^T - I| = {err:.2e} > {ORTHOGONALITY_TOL:.0e}")
    for name in ("k_eigenvalues", "v_eigenvalues"):
        t = tensors[name]
        if (t[..., 1:] > t[..., :-1] + 1e-6 * t.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)).any():
            _fail(source, name, "expected descending eigenvalues")


def orthogonality_error(rotations: torch.Tensor) -> float:
    """max |R R^T - I| over a stack of square matrices `[..., d, d]`, computed in fp32."""
    r = rotations.float()
    eye = torch.eye(r.shape[-1], dtype=torch.float32)
    return float((r @ r.transpose(-1, -2) - eye).abs().amax()) if r.numel() else 0.0


def read_raw(path: str | os.PathLike) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of an artifact file or directory, not validated: (file, tensors, metadata).

    Raises ArtifactError if there is no artifact file or it is not readable safetensors.
    """
    path = Path(path)
    file = path / ARTIFACT_FILENAME if path.is_dir() else path
    if not file.is_file():
        raise ArtifactError(f"{file}: no artifact file (expected '{ARTIFACT_FILENAME}' in the directory)")
    try:
        with safe_open(str(file), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as exc:  # safetensors raises several types for a corrupt header
        raise ArtifactError(f"{file}: not a readable safetensors file: {exc}") from exc
    return file, tensors, metadata


def read_artifact(path: str | os.PathLike) -> OscarArtifact:
    """Load and validate an artifact from a directory or a `.safetensors` file."""
    file, tensors, metadata = read_raw(path)
    validate_tensors(tensors, metadata, str(file))
    return OscarArtifact(**{n: tensors[n] for n in TENSOR_NAMES}, metadata=metadata, source=str(file))


def write_artifact(artifact: OscarArtifact, directory: str | os.PathLike) -> Path:
    """Validate, then write `oscar_kv.safetensors` atomically (temporary file, fsync, rename)."""
    artifact.validate()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / ARTIFACT_FILENAME
    tensors = {n: t.detach().cpu().contiguous().clone() for n, t in artifact.tensors().items()}
    payload = canonical_safetensors_bytes(tensors, artifact.metadata)
    fd, tmp = tempfile.mkstemp(prefix=".oscar_kv.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp creates 0600; give the usual file mode
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def canonical_safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes with the JSON header's keys sorted, so equal content gives equal bytes.

    (The library writes metadata from a hash map, whose order varies between runs.) Data offsets are
    relative to the end of the header, so re-serialising the header leaves them valid.
    """
    raw = save(tensors, metadata=dict(metadata))
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned, as the library does
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


def current_umask() -> int:
    """The process umask (reading it means setting it, so it is set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def effective_bits(context_len: int, group_size: int, sink: int = 64, recent: int = 256, scale_bits: int = 16) -> float:
    """Bits per KV element at `context_len` (OSCAR_METHOD section 5): 2-bit codes + scale/zero per group, BF16 windows."""
    bf16 = min(context_len, sink + recent)
    history = context_len - bf16
    per_group = 2 * scale_bits / group_size
    return (history * (2 + per_group) + bf16 * 16) / max(context_len, 1)


def text_config(config: Any) -> Any:
    """The decoder's config (the text config of a multimodal model; the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_geometry(config: Any) -> tuple[int, int, int, int]:
    """(num_hidden_layers, H_q, H_kv, head_dim) of a causal-LM config; head_dim defaults to hidden / H_q."""
    cfg = text_config(config)
    h_q = int(cfg.num_attention_heads)
    h_kv = int(getattr(cfg, "num_key_value_heads", None) or h_q)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // h_q)
    return int(cfg.num_hidden_layers), h_q, h_kv, d


def check_against_model(artifact: OscarArtifact, config: Any, model_id: str | None = None,
                        model_revision: str | None = None) -> None:
    """Refuse an artifact that does not fit `config` (a transformers PretrainedConfig or its text config).

    Each mismatch names the field, the artifact's value and the model's value.
    """
    n_layers, h_q, h_kv, d = model_geometry(config)
    meta = artifact.metadata
    src = artifact.source
    for name, model_value in (("num_attention_heads", h_q), ("num_key_value_heads", h_kv), ("head_dim", d)):
        if int(meta[name]) != model_value:
            raise ArtifactError(f"{src}: field '{name}': artifact has {meta[name]}, the model has {model_value}")
    if int(artifact.layer_ids.max()) >= n_layers:
        raise ArtifactError(
            f"{src}: field 'layer_ids': artifact names layer {int(artifact.layer_ids.max())}, "
            f"the model has {n_layers} layers")
    if model_id is not None and meta["model_id"] != model_id:
        raise ArtifactError(f"{src}: field 'model_id': artifact has '{meta['model_id']}', expected '{model_id}'")
    if model_revision is not None and meta["model_revision"] != model_revision:
        raise ArtifactError(
            f"{src}: field 'model_revision': artifact has '{meta['model_revision']}', expected '{model_revision}'")


def identity_artifact(num_layers: int, num_kv_heads: int, num_heads: int, head_dim: int,
                      model_id: str = "identity", layer_ids: list[int] | None = None,
                      group_size: int | None = None) -> OscarArtifact:
    """An artifact with identity rotations and no clipping: the runtime then equals plain INT2."""
    ids = torch.tensor(layer_ids if layer_ids is not None else list(range(num_layers)), dtype=torch.int64)
    a = ids.numel()
    eye = torch.eye(head_dim).expand(a, num_kv_heads, head_dim, head_dim).contiguous()
    ones = torch.ones(a, num_kv_heads)
    eig = torch.ones(a, num_kv_heads, head_dim)
    meta = {
        "format": FORMAT_NAME,
        "schema_version": str(SCHEMA_VERSION),
        "model_id": model_id,
        "model_revision": "unknown",
        "num_attention_heads": str(num_heads),
        "num_key_value_heads": str(num_kv_heads),
        "head_dim": str(head_dim),
        "bits": "2",
        "group_size": str(group_size or head_dim),
        "sink_tokens": "64",
        "recent_tokens": "256",
        "granularity": "head",
        "key_target": "identity",
        "value_target": "identity",
        "calibration": "{}",
        "tool_version": "identity",
        "created_at": "1970-01-01T00:00:00Z",
    }
    return OscarArtifact(ids, eye.clone(), eye.clone(), ones.clone(), ones.clone(), eig.clone(), eig.clone(),
                         metadata=meta, source="<identity>")


__all__ = [
    "ARTIFACT_FILENAME",
    "ArtifactError",
    "OscarArtifact",
    "check_against_model",
    "effective_bits",
    "identity_artifact",
    "model_geometry",
    "orthogonality_error",
    "read_artifact",
    "text_config",
    "validate_tensors",
    "write_artifact",
]
