"""Interop with the authors' reference "RotationZoo" files (served by their SGLang fork).

A reference file is a `torch.save`d dict for ONE target (keys or values); three versions exist
(`../shared/DESIGN.md` section 5b):

    {
      "format_version": 1 | 2 | 3,
      "objective": str,                     # which target the rotations were fitted to
      "source_grouping": str,               # how the statistics were grouped (optional here: our own
                                            #   exports before contract v2 did not write it)
      "layers": {layer_idx: {               # int -> dict, global decoder-layer index
          "layer_id": int,                  # optional; equal to the key when present
          "rotation": Tensor,               # v1 [d, d] (one per layer); v2/v3 [H_kv, d, d] (per KV head)
          "eigenvalues": Tensor,            # v1 [d]; v2/v3 [H_kv, d]: spectrum of the target
          "q_rotation": Tensor,             # v3, optional, shaped like rotation: the transform of the queries
          "o_rotation": Tensor,             # v3, optional, shaped like rotation: the transform of the output
          "k_mean": Tensor,                 # v3, optional, [H_kv, d] or [d]: key centering mean
      }},
    }

Row-vector convention `x_rot = x @ R` throughout. An OSCAR artifact needs both targets, so one import
reads a key file and a value file; one export writes `keys.pt` and `values.pt`.

Mapping into contract v2:
- `k_mean` becomes the artifact's `k_mean` with `mean_basis = original`. Assumption (stated because the
  files do not say): the reference subtracts the mean from the raw post-RoPE key *before* rotating it,
  `(k - mu) @ R`, so its mean is in the original basis. `v_mean` is zero (the reference centres keys only).
- `q_rotation`: our runtime rotates queries with the key rotation itself (q @ R_K), which preserves q . k
  only for an orthogonal R_K. A `q_rotation` must therefore be orthogonal and equal to the file's key
  `rotation`; a non-orthogonal one is refused with the reason: non-orthogonal key transforms collapse under
  a scalar INT2 quantizer and q . k is no longer preserved.
- `o_rotation` must be orthogonal and equal to the value `rotation` or its transpose (either way the
  runtime undoes R_V with R_V^T; it keeps no separate output transform).
- Clip ratios, windows and scale dtype are not in the files: import stores the reference's global ratios
  (K 0.96 / V 0.92, or the ones given) for every head, the default windows and float32 scales (what the
  reference serves with); export drops our per-head ratios.

Safety: the importer executes nothing. `torch.load(weights_only=True)` restricts unpickling to
tensors and plain containers, and the result is then checked to be exactly the structure above made
of plain dense CPU tensors, str, int, float and dicts; anything else is refused (ReferenceFormatError,
the CLI exits 2).

Export writes format v2 (per KV head, no reduction needed), or v3 when the artifact centres keys; values
can't be centred in the reference format, so an artifact with a non-zero `v_mean` is refused. Format v1
(one rotation per layer) is written on request: it refuses a per-head artifact whose heads differ unless
`head_reduce="first"` (KV head 0's rotation stands for the layer: averaging rotations would not be
orthogonal), recorded in the objective string (`<target>;head_reduce=first`).

Safety: the importer executes nothing. `torch.load(weights_only=True)` restricts unpickling to tensors and
plain containers; the result is then checked to be exactly the structure above made of plain dense CPU
tensors, str, int and dicts; anything else is refused (ReferenceFormatError, exit code 2).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from oscar_calib.errors import InputError
from runtime_kernels.artifact import ArtifactError, OscarArtifact, build_metadata, model_geometry
from runtime_kernels.contract import (
    MAX_CLIP_RATIO,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_MEAN_ABS,
    MIN_CLIP_RATIO,
    ORTHOGONALITY_TOL,
    orthogonality_error,
)
from runtime_kernels.format import KVFormat

REFERENCE_FORMAT_VERSIONS = (1, 2, 3)
EXPORT_FORMAT_VERSION = 2  # v3 when keys are centred
REQUIRED_KEYS = {"format_version", "objective", "layers"}
OPTIONAL_KEYS = {"source_grouping"}
LAYER_KEYS = {"rotation", "eigenvalues"}
OPTIONAL_LAYER_KEYS = {1: {"layer_id"}, 2: {"layer_id"}, 3: {"layer_id", "q_rotation", "o_rotation", "k_mean"}}
MAX_REFERENCE_BYTES = 1 << 30
HEAD_REDUCE_CHOICES = ("none", "first")
DEFAULT_K_CLIP = 0.96  # the reference's global ratios (OSCAR_METHOD.md section 4)
DEFAULT_V_CLIP = 0.92
REFERENCE_SCALE_DTYPE = "float32"  # the reference serves with fp32 scale/zero (OSCAR_METHOD.md section 8)
KEYS_FILENAME = "keys.pt"
VALUES_FILENAME = "values.pt"
NON_ORTHOGONAL_REASON = ("non-orthogonal key transforms collapse under a scalar INT2 quantizer and q.k is no longer "
                         "preserved; only orthogonal rotations can be imported")


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


def _float32(value: Any, source: str, field: str, shape: list[int]) -> torch.Tensor:
    t = _plain_tensor(value, source, field)
    if list(t.shape) != shape:
        _fail(source, field, f"expected shape {shape}, got {list(t.shape)}")
    t32 = t.to(torch.float32).contiguous().clone()
    if not torch.isfinite(t32).all():
        _fail(source, field, "contains NaN or Inf (or overflows float32)")
    return t32


def _orthogonal(t: torch.Tensor, source: str, field: str, why: str = "") -> None:
    err = orthogonality_error(t)
    if not err <= ORTHOGONALITY_TOL:
        _fail(source, field, f"not orthogonal: max |R R^T - I| = {err:.2e} > {ORTHOGONALITY_TOL:.0e}{why}")


def _validate_layer(entry: Any, idx: int, version: int, source: str, head_dim: int | None,
                    heads: int | None) -> dict[str, torch.Tensor]:
    """One `layers` entry -> {rotation [h, d, d], eigenvalues [h, d] descending, k_mean [h, d] (v3, if any)}."""
    where = f"layers.{idx}"
    allowed = LAYER_KEYS | OPTIONAL_LAYER_KEYS[version]
    if type(entry) is not dict or not LAYER_KEYS <= set(entry) or not set(entry) <= allowed:
        _fail(source, where, f"expected a dict with {sorted(LAYER_KEYS)} and optionally "
                             f"{sorted(OPTIONAL_LAYER_KEYS[version])} (format v{version})")
    if "layer_id" in entry and (type(entry["layer_id"]) is not int or entry["layer_id"] != idx):
        _fail(source, f"{where}.layer_id", f"expected {idx} (the layer's key), got {entry['layer_id']!r:.40}")
    rot = _plain_tensor(entry["rotation"], source, f"{where}.rotation")
    if version == 1:
        if rot.dim() != 2:
            _fail(source, f"{where}.rotation", f"expected a square [d, d] matrix (format v1), got {list(rot.shape)}")
        rot = rot.unsqueeze(0)
    elif rot.dim() != 3 or not 0 < rot.shape[0] <= MAX_HEADS:
        _fail(source, f"{where}.rotation", f"expected [H_kv, d, d] (format v{version}), got {list(rot.shape)}")
    if rot.shape[-1] != rot.shape[-2] or not 0 < rot.shape[-1] <= MAX_HEAD_DIM:
        _fail(source, f"{where}.rotation", f"expected square [d, d] matrices, got {list(rot.shape)}")
    h, d = int(rot.shape[0]), int(rot.shape[-1])
    if head_dim is not None and d != head_dim:
        _fail(source, f"{where}.rotation", f"head_dim {d} differs from the first layer's {head_dim}")
    if heads is not None and h != heads:
        _fail(source, f"{where}.rotation", f"{h} KV heads differ from the first layer's {heads}")
    rot32 = _float32(rot, source, f"{where}.rotation", [h, d, d])
    _orthogonal(rot32, source, f"{where}.rotation")
    eig_shape = [d] if version == 1 else [h, d]
    eig32 = _float32(entry["eigenvalues"], source, f"{where}.eigenvalues", eig_shape).view(h, d)
    out = {"rotation": rot32, "eigenvalues": torch.sort(eig32, dim=-1, descending=True).values}
    if "q_rotation" in entry:
        q = _float32(entry["q_rotation"], source, f"{where}.q_rotation", [h, d, d])
        _orthogonal(q, source, f"{where}.q_rotation", f": {NON_ORTHOGONAL_REASON}")
        if not torch.allclose(q, rot32, atol=ORTHOGONALITY_TOL * 10):
            _fail(source, f"{where}.q_rotation", "differs from the key rotation: the runtime rotates queries with the "
                                                 "key rotation itself (q @ R_K), the only transform that preserves q.k")
    if "o_rotation" in entry:
        o = _float32(entry["o_rotation"], source, f"{where}.o_rotation", [h, d, d])
        _orthogonal(o, source, f"{where}.o_rotation")
        tol = ORTHOGONALITY_TOL * 10
        if not (torch.allclose(o, rot32, atol=tol) or torch.allclose(o, rot32.transpose(-1, -2), atol=tol)):
            _fail(source, f"{where}.o_rotation", "expected the value rotation or its transpose (the runtime undoes "
                                                 "R_V with R_V^T and keeps no separate output transform)")
    if "k_mean" in entry:
        raw = _plain_tensor(entry["k_mean"], source, f"{where}.k_mean")
        mean = _float32(raw, source, f"{where}.k_mean", [d] if raw.dim() == 1 else [h, d]).expand(h, d).clone()
        if (mean.abs() > MAX_MEAN_ABS).any():
            _fail(source, f"{where}.k_mean", f"expected |mean| <= {MAX_MEAN_ABS:g}")
        out["k_mean"] = mean
    return out


def validate_reference(obj: Any, source: str) -> dict[str, Any]:
    """Check the loaded object is exactly a reference file of format v1, v2 or v3.

    Returns {format_version, objective, source_grouping (str or None), heads (1 for v1), layers:
    {int: {rotation float32 [h, d, d], eigenvalues float32 [h, d] descending, k_mean float32 [h, d] (v3, optional)}}}.
    """
    if type(obj) is not dict:
        _fail(source, "<root>", f"expected a dict, got {type(obj).__name__}")
    keys = set(obj)
    if not REQUIRED_KEYS <= keys or not keys <= REQUIRED_KEYS | OPTIONAL_KEYS:
        extra = sorted(map(str, keys - REQUIRED_KEYS - OPTIONAL_KEYS))
        missing = sorted(REQUIRED_KEYS - keys)
        _fail(source, (extra or missing)[0], f"{'unknown key' if extra else 'missing'} (expected "
                                             f"{sorted(REQUIRED_KEYS)} and optionally {sorted(OPTIONAL_KEYS)})")
    version = obj["format_version"]
    if type(version) is not int or version not in REFERENCE_FORMAT_VERSIONS:
        _fail(source, "format_version", f"expected one of {list(REFERENCE_FORMAT_VERSIONS)}, got {version!r:.40}")
    for name in ("objective", "source_grouping"):
        text = obj.get(name, "x")
        if type(text) is not str or not text or len(text) > 200 or not text.isprintable():
            _fail(source, name, "expected a short printable string")
    layers = obj["layers"]
    if type(layers) is not dict or not layers:
        _fail(source, "layers", "expected a non-empty dict {layer index: {rotation, eigenvalues, ...}}")
    if len(layers) > MAX_LAYERS:
        _fail(source, "layers", f"more than {MAX_LAYERS} layers")
    out: dict[int, dict[str, torch.Tensor]] = {}
    head_dim = heads = None
    for idx, entry in layers.items():
        if type(idx) is not int or idx < 0:
            _fail(source, "layers", f"expected non-negative int layer indices, got {idx!r:.40}")
        out[idx] = _validate_layer(entry, idx, version, source, head_dim, heads)
        heads, head_dim = out[idx]["rotation"].shape[:2]
        heads, head_dim = int(heads), int(head_dim)
    return {"format_version": version, "objective": obj["objective"], "source_grouping": obj.get("source_grouping"),
            "heads": heads, "layers": dict(sorted(out.items()))}


def load_reference(path: str | os.PathLike) -> dict[str, Any]:
    """Read one reference file without executing anything; see validate_reference for the result."""
    path = Path(path)
    if not path.is_file():
        raise ReferenceFormatError(f"{path}: not a file")
    if path.stat().st_size > MAX_REFERENCE_BYTES:
        raise ReferenceFormatError(f"{path}: larger than {MAX_REFERENCE_BYTES} bytes")
    if not zipfile.is_zipfile(path):  # the legacy format reads storages of any declared size into memory
        raise ReferenceFormatError(f"{path}: not a loadable reference file (weights_only): expected the zip format "
                                   "of torch.save (torch >= 1.6); re-save it with torch.save")
    try:  # mmap: storages stay in the file until a tensor is materialized, after the bounds below
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - unpickling raises many types; none may escape
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise ReferenceFormatError(f"{path}: not a loadable reference file (weights_only): {type(exc).__name__}: "
                                   f"{first}") from None
    check_storage_bounds(obj, str(path), path.stat().st_size)
    return validate_reference(obj, str(path))


def check_storage_bounds(obj: Any, source: str, file_bytes: int, field: str = "<root>", depth: int = 0,
                         total: list[int] | None = None) -> None:
    """Refuse tensors that would allocate more than the file holds, before anything is materialized.

    A tensor's elements must be backed by its own storage bytes (`numel x element size <= storage bytes`): a view
    with stride 0 or overlapping strides (4.6 MB of storage presented as a 16 GiB tensor) is refused, and all
    tensors together may not exceed the file's size (many views of one storage). Walks dicts, lists and tuples.
    """
    total = [0] if total is None else total
    if depth > 16:
        _fail(source, field, "nested more than 16 levels deep")
    if isinstance(obj, torch.Tensor):
        need = obj.numel() * obj.element_size()
        try:
            have = obj.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            have = 0
        if need > have:
            _fail(source, field, f"a tensor of shape {list(obj.shape)} and strides {list(obj.stride())} would "
                                 f"allocate {need} bytes from a storage of {have} (stride 0 or overlapping views); "
                                 "expected a dense tensor backed by its own bytes")
        total[0] += need
        if total[0] > file_bytes:
            _fail(source, field, f"the tensors would allocate more than the file's {file_bytes} bytes "
                                 "(views sharing one storage); expected each tensor stored once")
        return
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        check_storage_bounds(value, source, file_bytes, f"{key}" if field == "<root>" else f"{field}.{key}",
                             depth + 1, total)


def reference_to_artifact(keys: dict[str, Any], values: dict[str, Any], model_config: Any, model_id: str,
                          model_revision: str = "unknown", k_clip: float = DEFAULT_K_CLIP,
                          v_clip: float = DEFAULT_V_CLIP, tool_version: str = "oscar-calib", *,
                          windows: KVFormat) -> OscarArtifact:
    """Build a validated contract-v2 artifact from a key file and a value file (validate_reference results).

    Per-layer (v1) files give `granularity=layer` (the rotation repeated over KV heads); per-head files
    `granularity=head`. The key file's `k_mean` becomes `k_mean` in the original basis (module docstring).
    The artifact's KV format is the reference's own (`reference_format(windows)`): the sink and recent windows it
    served with are `windows`' (the files do not record them).
    """
    n_layers, h_q, h_kv, d = model_geometry(model_config)
    if set(keys["layers"]) != set(values["layers"]):
        raise ReferenceFormatError("field 'layers': the key and value files name different layers "
                                   f"({sorted(keys['layers'])} vs {sorted(values['layers'])})")
    for name, ratio in (("k_clip", k_clip), ("v_clip", v_clip)):
        if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and MIN_CLIP_RATIO <= ratio <= MAX_CLIP_RATIO):
            raise InputError(f"field '{name}': expected a ratio in [{MIN_CLIP_RATIO}, {MAX_CLIP_RATIO}], got {ratio!r}")
    ids = sorted(keys["layers"])
    for ref, which in ((keys, "key"), (values, "value")):
        rot = ref["layers"][ids[0]]["rotation"]
        if int(rot.shape[-1]) != d:
            raise InputError(f"field 'head_dim': the {which} file's rotations are {rot.shape[-1]}x{rot.shape[-1]}, "
                             f"the model has head_dim {d}")
        if ref["heads"] not in (1, h_kv):
            raise InputError(f"field 'num_key_value_heads': the {which} file has {ref['heads']} rotations per layer, "
                             f"the model has {h_kv} KV heads")
    if ids[-1] >= n_layers:
        raise InputError(f"field 'layers': reference names layer {ids[-1]}, the model has {n_layers} layers")
    if any("k_mean" in values["layers"][i] for i in ids):
        raise ReferenceFormatError("field 'k_mean': found in the value file; a key mean belongs in the key file")

    def stack(ref: dict[str, Any], name: str) -> torch.Tensor:
        per_layer = torch.stack([ref["layers"][i][name] for i in ids])  # [A, h, ...] with h = 1 or H_kv
        return per_layer.expand(-1, h_kv, *per_layer.shape[2:]).contiguous().clone()

    k_mean = torch.zeros(len(ids), h_kv, d)
    for n, i in enumerate(ids):
        if "k_mean" in keys["layers"][i]:
            k_mean[n] = keys["layers"][i]["k_mean"].expand(h_kv, d)
    per_layer = keys["heads"] == 1 and values["heads"] == 1
    calibration = {"source": "reference RotationZoo import", "format_version": keys["format_version"],
                   "value_format_version": values["format_version"], "source_grouping": keys["source_grouping"],
                   "clip": "reference global ratios", "k_clip": k_clip, "v_clip": v_clip,
                   "mean_basis_assumption": "reference subtracts k_mean before rotating (original basis)"}
    metadata = build_metadata(
        model_id=model_id, model_revision=model_revision, num_attention_heads=h_q, num_key_value_heads=h_kv,
        head_dim=d, granularity="layer" if per_layer else "head", key_target=keys["objective"],
        value_target=values["objective"], calibration=calibration, tool_version=tool_version,
        fmt=reference_format(windows, d, centered=bool(k_mean.any())), mean_basis="original",
        scale_dtype=REFERENCE_SCALE_DTYPE)
    a = len(ids)
    artifact = OscarArtifact(
        layer_ids=torch.tensor(ids, dtype=torch.int64), k_rotation=stack(keys, "rotation"),
        v_rotation=stack(values, "rotation"), k_clip_ratio=torch.full((a, h_kv), float(k_clip)),
        v_clip_ratio=torch.full((a, h_kv), float(v_clip)), k_eigenvalues=stack(keys, "eigenvalues"),
        v_eigenvalues=stack(values, "eigenvalues"), metadata=metadata, source="<reference import>",
        k_mean=k_mean, v_mean=torch.zeros(a, h_kv, d))
    try:
        return artifact.validate()
    except ArtifactError as exc:
        raise ReferenceFormatError(str(exc)) from None


def reference_format(windows: KVFormat, head_dim: int, centered: bool) -> KVFormat:
    """How this runtime serves a reference import: `windows`' sink, recent and page, one group per row, min-max
    INT2, fp16 scale and zero (the reference's fp32 scales, `REFERENCE_SCALE_DTYPE`, are stored as fp16), centered
    when the key file has a mean."""
    return KVFormat(sink_tokens=windows.sink_tokens, recent_tokens=windows.recent_tokens, page_size=windows.page_size,
                    group_size=head_dim, scale_format="float16", quantizer="uniform_minmax", centered=centered)


def _per_layer(artifact: OscarArtifact, rotation: torch.Tensor, eigenvalues: torch.Tensor, name: str,
               head_reduce: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[A, H, d, d], [A, H, d] -> [A, d, d], [A, d] following `head_reduce` (see module docstring)."""
    same = bool((rotation == rotation[:, :1]).all()) and bool((eigenvalues == eigenvalues[:, :1]).all())
    if not same and head_reduce == "none":
        raise InputError(f"{artifact.source}: field '{name}': reference format v1 has one rotation per layer but this "
                         f"artifact has {rotation.shape[1]} different per-KV-head rotations; pass --head-reduce first "
                         "to export KV head 0's rotation for every layer, or export format v2")
    return rotation[:, 0].contiguous().clone(), eigenvalues[:, 0].contiguous().clone()


def artifact_to_reference(artifact: OscarArtifact, head_reduce: str = "none",
                          version: int = EXPORT_FORMAT_VERSION) -> tuple[dict, dict]:
    """The (keys, values) reference dicts of an artifact: format v2 (v3 with a key mean) or, on request, v1."""
    artifact.validate()
    if head_reduce not in HEAD_REDUCE_CHOICES:
        raise InputError(f"field 'head_reduce': expected one of {list(HEAD_REDUCE_CHOICES)}, got {head_reduce!r}")
    if version not in (1, 2):
        raise InputError(f"field 'reference_version': expected 1 or 2 (v3 is written automatically for a "
                         f"centred artifact), got {version!r}")
    if artifact.value_mean("original").any():
        raise InputError(f"{artifact.source}: field 'v_mean': the reference format has no value mean; this artifact "
                         "centres values and cannot be exported without changing its outputs")
    if artifact.quantizer != "uniform_minmax":
        raise InputError(f"{artifact.source}: field 'quantizer' is '{artifact.quantizer}'; the reference quantizes "
                         "min-max (uniform_minmax), so its outputs would change; recalibrate with --quantizer "
                         "uniform_minmax to export")
    k_mean = artifact.key_mean("original")
    centred = bool(k_mean.any())
    if centred and version == 1:
        raise InputError(f"{artifact.source}: field 'k_mean': reference format v1 has no key mean; export format v2 "
                         "(written as v3 with k_mean)")
    ids = [int(i) for i in artifact.layer_ids.tolist()]
    out = []
    for kind, target in (("k", artifact.metadata["key_target"]), ("v", artifact.metadata["value_target"])):
        rot, eig = getattr(artifact, f"{kind}_rotation"), getattr(artifact, f"{kind}_eigenvalues")
        if version == 1:
            rot, eig = _per_layer(artifact, rot, eig, f"{kind}_rotation", head_reduce)
            objective = target if head_reduce == "none" else f"{target};head_reduce={head_reduce}"
            grouping, file_version = "layer", 1
        else:
            objective, grouping = target, "kv_head"
            file_version = 3 if centred and kind == "k" else 2
        layers = {}
        for n, i in enumerate(ids):
            layers[i] = {"layer_id": i, "rotation": rot[n].contiguous().clone(), "eigenvalues": eig[n].contiguous().clone()}
            if file_version == 3:
                layers[i]["k_mean"] = k_mean[n].contiguous().clone()
        out.append({"format_version": file_version, "objective": objective, "source_grouping": grouping,
                    "layers": layers})
    return out[0], out[1]


def _save(obj: dict, path: Path) -> None:
    """`torch.save` into memory, then one ordinary write: a full disk is a `DiskFullError` naming the file and the
    bytes (torch's own file writer reports it as `RuntimeError ... unexpected pos`)."""
    import io

    from runtime_kernels.atomic import disk_space_for

    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getvalue()
    with disk_space_for(path, len(payload)), open(path, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())


def export_reference(artifact: OscarArtifact, out_dir: str | os.PathLike, head_reduce: str = "none",
                     overwrite: bool = False, version: int = EXPORT_FORMAT_VERSION) -> dict[str, Path]:
    """Write `keys.pt` and `values.pt` into `out_dir` (atomically: a temporary directory renamed into place)."""
    keys, values = artifact_to_reference(artifact, head_reduce, version)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not overwrite)):
        raise InputError(f"field '--out': '{out_dir}' exists and is not an empty directory; pass --overwrite")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _save(keys, tmp / KEYS_FILENAME)
        _save(values, tmp / VALUES_FILENAME)
        for name in (KEYS_FILENAME, VALUES_FILENAME):  # what we write must read back through our own importer
            load_reference(tmp / name)
        if out_dir.exists():
            for name in (KEYS_FILENAME, VALUES_FILENAME):
                os.replace(tmp / name, out_dir / name)
        else:
            os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {"keys": out_dir / KEYS_FILENAME, "values": out_dir / VALUES_FILENAME}
