"""Interop with the authors' reference "RotationZoo" files (served by their SGLang fork).

A reference file is a `torch.save`d dict holding one rotation per layer for ONE target (keys or values):

    {
      "format_version": int,              # 1
      "objective": str,                   # which target the rotations were fitted to
      "layers": {layer_idx: {             # int -> dict, global decoder-layer index
          "rotation": Tensor [d, d],      # orthogonal, row-vector convention x_rot = x @ R
          "eigenvalues": Tensor [d],      # spectrum of the target
      }},
    }

An OSCAR artifact needs both targets, so one import reads a key file and a value file; one export
writes `keys.pt` and `values.pt`. The reference has no clip ratios (its server uses two global
ratios, K 0.96 / V 0.92): import stores those ratios (or the ones given) for every head; export drops ours.

Safety: the importer executes nothing. `torch.load(weights_only=True)` restricts unpickling to
tensors and plain containers, and the result is then checked to be exactly the structure above made
of plain dense CPU tensors, str, int, float and dicts; anything else is refused (ReferenceFormatError,
the CLI exits 2).

Heads: our artifacts can hold one rotation per KV head. Export writes one per layer, so it refuses a
per-head artifact whose heads differ, unless `head_reduce="first"` is chosen: then KV head 0's
rotation and eigenvalues stand for the layer (the only choice that keeps an exact calibrated
rotation; averaging rotations would not be orthogonal). The choice is recorded in the objective
string (`<target>;head_reduce=first`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from oscar_calib.errors import InputError
from runtime_kernels.artifact import (
    FORMAT_NAME,
    ORTHOGONALITY_TOL,
    SCHEMA_VERSION,
    ArtifactError,
    OscarArtifact,
    model_geometry,
    orthogonality_error,
)

REFERENCE_FORMAT_VERSION = 1
REFERENCE_KEYS = {"format_version", "objective", "layers"}
LAYER_KEYS = {"rotation", "eigenvalues"}
MAX_REFERENCE_BYTES = 1 << 30
MAX_LAYERS = 4096
MAX_HEAD_DIM = 1024
HEAD_REDUCE_CHOICES = ("none", "first")
DEFAULT_K_CLIP = 0.96  # the reference's global ratios (OSCAR_METHOD.md section 4)
DEFAULT_V_CLIP = 0.92
KEYS_FILENAME = "keys.pt"
VALUES_FILENAME = "values.pt"


class ReferenceFormatError(InputError):
    """A reference RotationZoo file that is unreadable or not exactly the expected structure (exit 2)."""


def _fail(source: str, field: str, message: str) -> None:
    raise ReferenceFormatError(f"{source}: field '{field}': {message}")


def _plain_tensor(value: Any, source: str, field: str) -> torch.Tensor:
    if type(value) is not torch.Tensor:  # no subclasses (Parameter, tensor-likes): plain data only
        _fail(source, field, f"expected a plain torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.is_sparse or value.is_quantized or value.device.type != "cpu":
        _fail(source, field, "expected a dense CPU tensor")
    if value.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        _fail(source, field, f"expected a floating-point tensor, got {value.dtype}")
    return value


def validate_reference(obj: Any, source: str) -> dict[str, Any]:
    """Check the loaded object is exactly a reference file. Returns {format_version, objective, layers:
    {int: (rotation float32 [d, d], eigenvalues float32 [d])}} with eigenvalues sorted descending."""
    if type(obj) is not dict:
        _fail(source, "<root>", f"expected a dict, got {type(obj).__name__}")
    keys = set(obj)
    if keys != REFERENCE_KEYS:
        extra = sorted(map(str, keys - REFERENCE_KEYS))
        missing = sorted(REFERENCE_KEYS - keys)
        _fail(source, (extra or missing)[0], f"{'unknown key' if extra else 'missing'} (expected exactly "
                                             f"{sorted(REFERENCE_KEYS)})")
    version = obj["format_version"]
    if type(version) is not int or version != REFERENCE_FORMAT_VERSION:
        _fail(source, "format_version", f"expected {REFERENCE_FORMAT_VERSION}, got {version!r}")
    objective = obj["objective"]
    if type(objective) is not str or not objective or len(objective) > 200 or not objective.isprintable():
        _fail(source, "objective", "expected a short printable string")
    layers = obj["layers"]
    if type(layers) is not dict or not layers:
        _fail(source, "layers", "expected a non-empty dict {layer index: {rotation, eigenvalues}}")
    if len(layers) > MAX_LAYERS:
        _fail(source, "layers", f"more than {MAX_LAYERS} layers")
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    head_dim = None
    for idx, entry in layers.items():
        if type(idx) is not int or idx < 0:
            _fail(source, "layers", f"expected non-negative int layer indices, got {idx!r}")
        where = f"layers.{idx}"
        if type(entry) is not dict or set(entry) != LAYER_KEYS:
            _fail(source, where, f"expected a dict with exactly {sorted(LAYER_KEYS)}")
        rot = _plain_tensor(entry["rotation"], source, f"{where}.rotation")
        eig = _plain_tensor(entry["eigenvalues"], source, f"{where}.eigenvalues")
        if rot.dim() != 2 or rot.shape[0] != rot.shape[1] or not 0 < rot.shape[0] <= MAX_HEAD_DIM:
            _fail(source, f"{where}.rotation", f"expected a square [d, d] matrix, got {list(rot.shape)}")
        d = int(rot.shape[0])
        if head_dim is None:
            head_dim = d
        if d != head_dim:
            _fail(source, f"{where}.rotation", f"head_dim {d} differs from the first layer's {head_dim}")
        if list(eig.shape) != [d]:
            _fail(source, f"{where}.eigenvalues", f"expected shape [{d}], got {list(eig.shape)}")
        rot32, eig32 = rot.to(torch.float32).contiguous(), eig.to(torch.float32).contiguous()
        if not torch.isfinite(rot32).all() or not torch.isfinite(eig32).all():
            _fail(source, where, "contains NaN or Inf (or overflows float32)")
        err = orthogonality_error(rot32)
        if not err <= ORTHOGONALITY_TOL:
            _fail(source, f"{where}.rotation", f"not orthogonal: max |R R^T - I| = {err:.2e} > {ORTHOGONALITY_TOL:.0e}")
        out[idx] = (rot32.clone(), torch.sort(eig32, descending=True).values)
    return {"format_version": version, "objective": objective, "layers": dict(sorted(out.items()))}


def load_reference(path: str | os.PathLike) -> dict[str, Any]:
    """Read one reference file without executing anything; see validate_reference for the result."""
    path = Path(path)
    if not path.is_file():
        raise ReferenceFormatError(f"{path}: not a file")
    if path.stat().st_size > MAX_REFERENCE_BYTES:
        raise ReferenceFormatError(f"{path}: larger than {MAX_REFERENCE_BYTES} bytes")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling raises many types; none may escape
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise ReferenceFormatError(f"{path}: not a loadable reference file (weights_only): {type(exc).__name__}: "
                                   f"{first}") from None
    return validate_reference(obj, str(path))


def reference_to_artifact(keys: dict[str, Any], values: dict[str, Any], model_config: Any, model_id: str,
                          model_revision: str = "unknown", k_clip: float = DEFAULT_K_CLIP,
                          v_clip: float = DEFAULT_V_CLIP, tool_version: str = "oscar-calib") -> OscarArtifact:
    """Build a validated layer-granularity artifact from a key file and a value file (validated dicts)."""
    n_layers, h_q, h_kv, d = model_geometry(model_config)
    if set(keys["layers"]) != set(values["layers"]):
        raise ReferenceFormatError("field 'layers': the key and value files name different layers "
                                   f"({sorted(keys['layers'])} vs {sorted(values['layers'])})")
    for name, ratio in (("k_clip", k_clip), ("v_clip", v_clip)):
        if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and 0 < ratio <= 1):
            raise InputError(f"field '{name}': expected a ratio in (0, 1], got {ratio!r}")
    ids = sorted(keys["layers"])
    first_d = int(keys["layers"][ids[0]][0].shape[0])
    if first_d != d or int(values["layers"][ids[0]][0].shape[0]) != d:
        raise InputError(f"field 'head_dim': reference rotations are {first_d}x{first_d}, the model has head_dim {d}")
    if ids[-1] >= n_layers:
        raise InputError(f"field 'layers': reference names layer {ids[-1]}, the model has {n_layers} layers")

    def stack(ref: dict[str, Any], which: int) -> torch.Tensor:
        per_layer = torch.stack([ref["layers"][i][which] for i in ids])  # [A, d, d] or [A, d]
        return per_layer.unsqueeze(1).expand(-1, h_kv, *per_layer.shape[1:]).contiguous().clone()

    metadata = {
        "format": FORMAT_NAME, "schema_version": str(SCHEMA_VERSION), "model_id": model_id,
        "model_revision": model_revision, "num_attention_heads": str(h_q), "num_key_value_heads": str(h_kv),
        "head_dim": str(d), "bits": "2", "group_size": str(d), "sink_tokens": "64", "recent_tokens": "256",
        "granularity": "layer", "key_target": keys["objective"], "value_target": values["objective"],
        "calibration": json.dumps({"source": "reference RotationZoo import",
                                   "format_version": keys["format_version"],
                                   "clip": "reference global ratios", "k_clip": k_clip, "v_clip": v_clip},
                                  sort_keys=True),
        "tool_version": tool_version,
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    a = len(ids)
    artifact = OscarArtifact(
        layer_ids=torch.tensor(ids, dtype=torch.int64), k_rotation=stack(keys, 0), v_rotation=stack(values, 0),
        k_clip_ratio=torch.full((a, h_kv), float(k_clip)), v_clip_ratio=torch.full((a, h_kv), float(v_clip)),
        k_eigenvalues=stack(keys, 1), v_eigenvalues=stack(values, 1), metadata=metadata, source="<reference import>")
    try:
        return artifact.validate()
    except ArtifactError as exc:
        raise ReferenceFormatError(str(exc)) from None


def _per_layer(artifact: OscarArtifact, rotation: torch.Tensor, eigenvalues: torch.Tensor, name: str,
               head_reduce: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[A, H, d, d], [A, H, d] -> [A, d, d], [A, d] following `head_reduce` (see module docstring)."""
    if head_reduce not in HEAD_REDUCE_CHOICES:
        raise InputError(f"field 'head_reduce': expected one of {list(HEAD_REDUCE_CHOICES)}, got {head_reduce!r}")
    same = bool((rotation == rotation[:, :1]).all()) and bool((eigenvalues == eigenvalues[:, :1]).all())
    if not same and head_reduce == "none":
        raise InputError(f"{artifact.source}: field '{name}': the reference format has one rotation per layer but this "
                         f"artifact has {rotation.shape[1]} different per-KV-head rotations; pass --head-reduce first "
                         "to export KV head 0's rotation for every layer")
    return rotation[:, 0].contiguous().clone(), eigenvalues[:, 0].contiguous().clone()


def artifact_to_reference(artifact: OscarArtifact, head_reduce: str = "none") -> tuple[dict, dict]:
    """The (keys, values) reference dicts of an artifact (one rotation per layer each)."""
    artifact.validate()
    out = []
    for kind, target in (("k", artifact.metadata["key_target"]), ("v", artifact.metadata["value_target"])):
        rot, eig = _per_layer(artifact, getattr(artifact, f"{kind}_rotation"), getattr(artifact, f"{kind}_eigenvalues"),
                              f"{kind}_rotation", head_reduce)
        objective = target if head_reduce == "none" else f"{target};head_reduce={head_reduce}"
        layers = {int(i): {"rotation": rot[n], "eigenvalues": eig[n]}
                  for n, i in enumerate(artifact.layer_ids.tolist())}
        out.append({"format_version": REFERENCE_FORMAT_VERSION, "objective": objective, "layers": layers})
    return out[0], out[1]


def export_reference(artifact: OscarArtifact, out_dir: str | os.PathLike, head_reduce: str = "none",
                     overwrite: bool = False) -> dict[str, Path]:
    """Write `keys.pt` and `values.pt` into `out_dir` (atomically: a temporary directory renamed into place)."""
    keys, values = artifact_to_reference(artifact, head_reduce)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not overwrite)):
        raise InputError(f"field '--out': '{out_dir}' exists and is not an empty directory; pass --overwrite")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        torch.save(keys, tmp / KEYS_FILENAME)
        torch.save(values, tmp / VALUES_FILENAME)
        for name in (KEYS_FILENAME, VALUES_FILENAME):  # what we write must read back through our own importer
            load_reference(tmp / name)
        if out_dir.exists():
            for name in (KEYS_FILENAME, VALUES_FILENAME):
                os.replace(tmp / name, out_dir / name)
        else:
            os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return {"keys": out_dir / KEYS_FILENAME, "values": out_dir / VALUES_FILENAME}
