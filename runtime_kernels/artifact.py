"""The OSCAR KV artifact: read, validate and write `oscar_kv.safetensors` (contract version 2; v1 still reads).

This module is the only thing that crosses from calibration to the runtime. It imports nothing
from `oscar_calib`. Row-vector convention: `x_rot = x @ R`, `x = x_rot @ R^T`. The rules themselves
(names, bounds, the metadata builder) live in `runtime_kernels.contract`; the bounded container reader
in `runtime_kernels.container`.

Tensors (A = calibrated attention layers, H = KV heads, d = head_dim):

    layer_ids      int64   [A]
    k_rotation     float32 [A, H, d, d]
    v_rotation     float32 [A, H, d, d]
    k_clip_ratio   float32 [A, H]       in [0.5, 1]; 1 = no clipping
    v_clip_ratio   float32 [A, H]
    k_eigenvalues  float32 [A, H, d]    descending
    v_eigenvalues  float32 [A, H, d]
    k_mean         float32 [A, H, d]    v2: centering mean (basis in metadata `mean_basis`); zeros = none
    v_mean         float32 [A, H, d]    v2
    k_codebook     float32 [A, H, 4]    v2, optional (quantizer = lloyd_max)
    v_codebook     float32 [A, H, 4]    v2, optional (quantizer = lloyd_max)
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from runtime_kernels.container import read_header
from runtime_kernels.contract import (
    CODEBOOK_TENSOR_NAMES,
    FORMAT_NAME,
    MEAN_TENSOR_NAMES,
    ORTHOGONALITY_TOL,
    SCALE_DTYPES,
    SCHEMA_VERSION,
    V1_DEFAULTS,
    V1_METADATA,
    V1_TENSOR_NAMES,
    ArtifactError,
    ContractMetadata,
    build_metadata,
    fail,
    format_record_json,
    has_means,
    kv_format_of,
    orthogonality_error,
    parse_metadata,
    tensor_specs,
)
from runtime_kernels.contract import validate_tensors as _validate_contract
from runtime_kernels.format import KVFormat

ARTIFACT_FILENAME = "oscar_kv.safetensors"
TENSOR_NAMES = V1_TENSOR_NAMES  # present in every version (audit reads these)
REQUIRED_METADATA = V1_METADATA
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
UNIFORM_LEVELS = (0.0, 1.0, 2.0, 3.0)  # the uniform quantizer's codes, in units of the group scale


class ModelMismatchError(ArtifactError):
    """The artifact was made for another model (shapes or model identity disagree with the model)."""


@dataclass(frozen=True)
class _Check:
    """A passed validation: what it saw (`OscarArtifact._fingerprint`) and the typed metadata it returned (with the
    KV format, `ContractMetadata.served`)."""

    fingerprint: tuple
    contract: ContractMetadata


@dataclass
class OscarArtifact:
    """In-memory form of one artifact. Tensors live on the CPU in their contract dtypes.

    `k_mean`/`v_mean` are None for a v1 artifact (the accessors then return zeros); the codebooks are
    None unless the quantizer is lloyd_max.
    """

    layer_ids: torch.Tensor
    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_clip_ratio: torch.Tensor
    v_clip_ratio: torch.Tensor
    k_eigenvalues: torch.Tensor
    v_eigenvalues: torch.Tensor
    metadata: dict[str, str] = field(default_factory=dict)
    source: str = "<memory>"
    k_mean: torch.Tensor | None = None
    v_mean: torch.Tensor | None = None
    k_codebook: torch.Tensor | None = None
    v_codebook: torch.Tensor | None = None

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
    def schema_version(self) -> int:
        """1 or 2 (a malformed value reads as the writer's version here; `validate` refuses it by name)."""
        raw = self.metadata.get("schema_version", str(SCHEMA_VERSION))
        return int(raw) if raw in ("1", "2") else SCHEMA_VERSION

    def typed_metadata(self) -> ContractMetadata:
        """The typed metadata (`contract.parse_metadata`: v1's values filled in by the contract): that of the last
        validation while the artifact is unchanged, else parsed now. Raises ArtifactError naming the field for
        metadata that breaks the contract."""
        checked = self._checked()
        return checked.contract if checked is not None else parse_metadata(self.metadata, self.source)

    @property
    def group_size(self) -> int:
        """Channels per scale group (the metadata's `group_size`)."""
        return self.typed_metadata().group_size

    @property
    def kv_format(self) -> KVFormat:
        """The encoding of the INT2 history the artifact was calibrated for (`runtime_kernels.format.KVFormat`):
        its `kv_format` record, or for an artifact written before the record (v1 included) its separate keys
        (`contract.kv_format_of`). Centering is whether its means are non-zero. Raises ArtifactError naming the
        field for metadata that breaks the contract or a quantizer this runtime does not serve (lloyd_max).

        A validated artifact (`validate`, `read_artifact`) parsed its format then: that value is returned while
        the artifact is unchanged, so the loaders, the caches and the vLLM plugin read one parse."""
        checked = self._checked()
        if checked is not None and checked.contract.served is not None:
            return checked.contract.served
        meta = parse_metadata(self.metadata, self.source)
        return kv_format_of(meta, has_means(self.tensors()), self.source)

    @property
    def quantizer(self) -> str:
        """The metadata's quantizer (`uniform_minmax` for v1), `lloyd_max` included."""
        return self.typed_metadata().quantizer

    @property
    def scale_dtype(self) -> torch.dtype:
        """dtype of the per-group scale and zero the metadata names (float16 for v1; uint8 for ue5m3)."""
        return SCALE_DTYPES[self.scale_format]

    @property
    def scale_format(self) -> str:
        """The contract's `scale_dtype` name (`float16`, `ue5m3`, ...; float16 for v1)."""
        return self.typed_metadata().scale_dtype

    @property
    def scale_bits(self) -> int:
        """Bits of each of the scale and the zero point (16 for float16, 8 for ue5m3)."""
        return 8 if self.scale_format == "ue5m3" else torch.finfo(self.scale_dtype).bits

    @property
    def mean_basis(self) -> str:
        """`original` (means of x; v1) or `rotated` (means of x @ R)."""
        return self.typed_metadata().mean_basis

    @property
    def is_centered(self) -> bool:
        """Whether the artifact centers its cache: a non-zero `k_mean` or `v_mean`."""
        return has_means({"k_mean": self.k_mean, "v_mean": self.v_mean})

    def _mean(self, kind: str, basis: str) -> torch.Tensor:
        if basis not in ("original", "rotated"):
            raise ValueError(f"basis: expected 'original' or 'rotated', got {basis!r}")
        stored = getattr(self, f"{kind}_mean")
        rot = getattr(self, f"{kind}_rotation")
        if stored is None:
            return torch.zeros(rot.shape[:-1], dtype=torch.float32)
        if basis == self.mean_basis:
            return stored
        # Row vectors: mu_rot = mu @ R, mu = mu_rot @ R^T (R orthogonal).
        eq = "ahd,ahde->ahe" if basis == "rotated" else "ahe,ahde->ahd"
        return torch.einsum(eq, stored.double(), rot.double()).float()

    def key_mean(self, basis: str) -> torch.Tensor:
        """Key centering mean `[A, H, d]` float32 in `basis` ('original' or 'rotated'); zeros for v1."""
        return self._mean("k", basis)

    def value_mean(self, basis: str) -> torch.Tensor:
        """Value centering mean `[A, H, d]` float32 in `basis` ('original' or 'rotated'); zeros for v1."""
        return self._mean("v", basis)

    def k_mean_rotated(self) -> torch.Tensor:
        """`key_mean("rotated")`: the mean the runtime subtracts before quantizing `x @ R_K`."""
        return self.key_mean("rotated")

    def v_mean_rotated(self) -> torch.Tensor:
        return self.value_mean("rotated")

    def codebook(self, kind: str) -> torch.Tensor:
        """`[A, H, 4]` float32 levels for 'k' or 'v' (units of the group scale); uniform (0, 1, 2, 3) without one."""
        if kind not in ("k", "v"):
            raise ValueError(f"kind: expected 'k' or 'v', got {kind!r}")
        stored = getattr(self, f"{kind}_codebook")
        if stored is not None:
            return stored
        return torch.tensor(UNIFORM_LEVELS).expand(self.num_layers, self.num_kv_heads, 4).contiguous()

    @property
    def calibration(self) -> dict[str, Any]:
        return json.loads(self.metadata.get("calibration", "{}"))

    @property
    def fitted_context(self) -> int | None:
        """Tokens of the held-out sequence the clips were fitted on (`calibration.holdout_len`; before it was
        recorded, the held-out sequence was `seq_len` long), or None when the artifact does not say (an import)."""
        calib = self.calibration
        n = calib.get("holdout_len", calib.get("seq_len"))
        return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    def index_of_layer(self, layer_idx: int) -> int | None:
        """Position of global decoder layer `layer_idx` in the artifact, or None if it was skipped."""
        hits = (self.layer_ids == layer_idx).nonzero()
        return int(hits[0, 0]) if hits.numel() else None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the artifact holds (the codebooks only when set). A v2 artifact built in memory
        without means gets zero means (no centering), so code written before v2 keeps producing valid ones."""
        out = {name: getattr(self, name) for name in V1_TENSOR_NAMES}
        for name in MEAN_TENSOR_NAMES:
            value = getattr(self, name)
            if value is None and self.schema_version >= 2:
                value = torch.zeros(self.k_rotation.shape[:-1], dtype=torch.float32)
            if value is not None:
                out[name] = value
        out.update({n: getattr(self, n) for n in CODEBOOK_TENSOR_NAMES if getattr(self, n) is not None})
        return out

    def validate(self) -> OscarArtifact:
        """Check every rule of the contract (ArtifactError naming the field) and remember that this object, as it
        is now, passed (`ensure_valid`, `kv_format`). Returns self."""
        self._record_check(validate_tensors(self.tensors(), self.metadata, self.source))
        return self

    def ensure_valid(self) -> OscarArtifact:
        """`validate`, unless this object already passed it and is unchanged since (the same tensor objects, not
        modified in place, and equal metadata): what a consumer handed a loaded artifact calls, so one load
        validates once. Returns self."""
        return self if self._checked() is not None else self.validate()

    # -- the record of a passed validation ----------------------------------------------------------------
    def _fingerprint(self) -> tuple:
        """What validation saw: every tensor's identity and in-place version counter (torch bumps `_version` on
        every in-place write), and the metadata."""
        return (tuple((name, id(t), t._version) for name, t in sorted(self._stored_tensors().items())),
                tuple(sorted(self.metadata.items())), self.source)

    def _stored_tensors(self) -> dict[str, torch.Tensor]:
        names = V1_TENSOR_NAMES + MEAN_TENSOR_NAMES + CODEBOOK_TENSOR_NAMES
        return {n: getattr(self, n) for n in names if isinstance(getattr(self, n), torch.Tensor)}

    def _record_check(self, contract: ContractMetadata) -> None:
        # Not a dataclass field: `dataclasses.replace` and `fields()` copies start unchecked, equality ignores it.
        self.__dict__["_check"] = _Check(self._fingerprint(), contract)

    def _checked(self) -> _Check | None:
        """The record of the last validation, if this object is unchanged since (else None)."""
        check = self.__dict__.get("_check")
        return check if check is not None and check.fingerprint == self._fingerprint() else None

    def as_v2(self) -> OscarArtifact:
        """This artifact in contract v2 (a v1 one gains zero means and v1's defaults, written out)."""
        if self.schema_version == SCHEMA_VERSION:
            return self
        zeros = torch.zeros(self.k_rotation.shape[:-1], dtype=torch.float32)
        meta = {**V1_DEFAULTS, **self.metadata, "schema_version": str(SCHEMA_VERSION)}
        meta["kv_format"] = format_record_json(self.kv_format)  # v1's own format, written out as the record
        return OscarArtifact(*(getattr(self, n) for n in V1_TENSOR_NAMES), metadata=meta, source=self.source,
                             k_mean=zeros, v_mean=zeros.clone())


def validate_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str], source: str,
                     meta: ContractMetadata | None = None) -> ContractMetadata:
    """Check every rule of contract v1/v2 (see runtime_kernels.contract). Raises ArtifactError naming the field."""
    return _validate_contract(tensors, metadata, source, meta)


def artifacts_below(directory: str | os.PathLike, limit: int = 8) -> list[str]:
    """The sub-directories of `directory`, one level down, that hold an artifact file (sorted, at most `limit`):
    what a user who passed the parent (`zoo` for `zoo/demo`) meant."""
    try:
        found = sorted(str(d) for d in Path(directory).iterdir()
                       if d.is_dir() and not d.name.startswith(".") and (d / ARTIFACT_FILENAME).is_file())
    except OSError:
        return []
    return found[:limit]


def no_artifact_hint(directory: str | os.PathLike) -> str:
    """'; it holds artifacts one level down: pass one of zoo/demo, zoo/qwen' when there are any, else ''."""
    below = artifacts_below(directory)
    return f"; it holds artifacts one level down: pass one of {', '.join(below)}" if below else ""


def _artifact_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    file = path / ARTIFACT_FILENAME if path.is_dir() else path
    if not file.is_file():
        raise ArtifactError(f"{file}: no artifact file (expected '{ARTIFACT_FILENAME}' in the directory)"
                            f"{no_artifact_hint(path) if path.is_dir() else ''}")
    return file


def _load_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as exc:  # safetensors raises several types for a corrupt file
        raise ArtifactError(f"{file}: not a readable safetensors file: {exc}") from exc


def read_raw(path: str | os.PathLike) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of an artifact file or directory, not checked against the contract.

    The container is checked first (runtime_kernels.container: header size, tensor count, strict JSON,
    offsets), so a hostile file is refused before any tensor is read. Raises ArtifactError.
    """
    file = _artifact_file(path)
    header = read_header(file)
    return file, _load_tensors(file), header.metadata


def read_artifact(path: str | os.PathLike) -> OscarArtifact:
    """Load and validate an artifact (contract v1 or v2) from a directory or a `.safetensors` file.

    Order: container bounds, then the metadata, then every tensor's dtype and shape in the header
    against what the metadata implies, and only then the tensor data (values: finite, ranges, orthogonality).
    """
    file = _artifact_file(path)
    source = str(file)
    header = read_header(file)
    meta = parse_metadata(header.metadata, source)
    ids = header.tensors.get("layer_ids")
    if ids is None:
        fail(source, "layer_ids", "missing tensor")
    if len(ids.shape) != 1:
        fail(source, "layer_ids", f"expected int64 [A], got {ids.torch_dtype_name} {list(ids.shape)}")
    for name, (dtype, shape) in tensor_specs(meta, ids.shape[0], set(header.tensors), source).items():
        entry = header.tensors[name]
        want = str(dtype).replace("torch.", "")
        if entry.torch_dtype_name != want:
            fail(source, name, f"expected {want}, got {entry.torch_dtype_name}")
        if entry.shape != shape:
            fail(source, name, f"expected shape {list(shape)}, got {list(entry.shape)}")
    tensors = _load_tensors(file)
    contract = validate_tensors(tensors, header.metadata, source, meta)
    artifact = OscarArtifact(**tensors, metadata=dict(header.metadata), source=source)
    artifact._record_check(contract)  # the one validation of this load: consumers call `ensure_valid`
    return artifact


def write_artifact(artifact: OscarArtifact, directory: str | os.PathLike) -> Path:
    """Validate, then write `oscar_kv.safetensors` in contract v2 atomically (temporary file, fsync, rename).

    A v1 artifact is written as v2 (zero means, v1's quantizer and scale dtype recorded).
    """
    artifact = artifact.as_v2()
    artifact.validate()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / ARTIFACT_FILENAME
    tensors = {n: t.detach().cpu().contiguous().clone() for n, t in artifact.tensors().items()}
    payload = canonical_safetensors_bytes(tensors, artifact.metadata)
    from runtime_kernels.atomic import write_file_atomically

    return write_file_atomically(target, payload, "directory")


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


def model_identity(config: Any, model_id: str | None = None) -> str | None:
    """Who the model is: the given `model_id`, else the config's `_name_or_path` (None when neither is known)."""
    if model_id:
        return str(model_id)
    for cfg in (config, text_config(config)):
        name = getattr(cfg, "_name_or_path", None)
        if name:
            return str(name)
    return None


def _hub_id_of_cache_path(path: str) -> str | None:
    """'ORG/NAME' for a path inside the Hugging Face cache (`.../models--ORG--NAME/snapshots/<sha>`)."""
    parts = Path(path).parts
    for i, part in enumerate(parts[:-1]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return part[len("models--"):].replace("--", "/")
    return None


def same_model(artifact_model_id: str, identity: str) -> bool:
    """The identity rule: equal ids; or two paths of the same local directory; or a Hub-cache snapshot of the id."""
    if artifact_model_id == identity:
        return True
    if _hub_id_of_cache_path(identity) == artifact_model_id or _hub_id_of_cache_path(artifact_model_id) == identity:
        return True
    if os.path.exists(identity) and os.path.exists(artifact_model_id):
        return os.path.realpath(identity) == os.path.realpath(artifact_model_id)
    return False


# How each caller is told to fix an identity refusal, in its own words (flag, keyword or config key): the rule is
# one (`check_against_model`), the advice names the option the caller really has.
IDENTITY_ADVICE = {
    "python": ("model_id='{id}'", "allow_other_model=True"),
    "cli": ("--model-id {id}", "--allow-other-model"),
    "vllm": ('"model_id": "{id}" in additional_config.oscar', '"allow_other_model": true in additional_config.oscar'),
}


def check_against_model(artifact: OscarArtifact, config: Any, model_id: str | None = None,
                        model_revision: str | None = None, *, allow_other_model: bool = False,
                        advice: str = "python") -> None:
    """Refuse an artifact that does not fit the model (`config`: a transformers PretrainedConfig or its text config).

    The one identity rule of the project: `load_artifact`, `OscarCache`, `eval`, `audit`, `export` and the vLLM
    plugin all call it. Shapes (heads, head_dim, layer count) must always match. The artifact's `model_id` must
    name the model (`model_id` if given: the Hub id a local copy stands for; else `config._name_or_path`; see
    `same_model`) unless `allow_other_model=True`; a model whose identity is unknown (a config built in memory)
    is checked on shapes only. Raises ModelMismatchError naming the field, the artifact's value and the model's,
    with advice in the words of `advice` ("python", "cli" or "vllm": `IDENTITY_ADVICE`).
    """
    n_layers, h_q, h_kv, d = model_geometry(config)
    meta = artifact.metadata
    src = artifact.source
    for name, model_value in (("num_attention_heads", h_q), ("num_key_value_heads", h_kv), ("head_dim", d)):
        if int(meta[name]) != model_value:
            raise ModelMismatchError(f"{src}: field '{name}': artifact has {meta[name]}, the model has {model_value}")
    if int(artifact.layer_ids.max()) >= n_layers:
        raise ModelMismatchError(
            f"{src}: field 'layer_ids': artifact names layer {int(artifact.layer_ids.max())}, "
            f"the model has {n_layers} layers")
    identity = model_identity(config, model_id)
    if identity is not None and not allow_other_model and not same_model(meta["model_id"], identity):
        name_it, waive = IDENTITY_ADVICE[advice]
        raise ModelMismatchError(
            f"{src}: field 'model_id': artifact was calibrated for '{meta['model_id']}', the model is '{identity}'; "
            f"if that is a local copy of '{meta['model_id']}' pass {name_it.format(id=meta['model_id'])}, "
            f"or {waive} to use it with another model (shapes still must match)")
    if model_revision is not None and meta["model_revision"] != model_revision:
        raise ModelMismatchError(
            f"{src}: field 'model_revision': artifact has '{meta['model_revision']}', expected '{model_revision}'")


def identity_artifact(num_layers: int, num_kv_heads: int, num_heads: int, head_dim: int,
                      model_id: str = "identity", layer_ids: list[int] | None = None, *,
                      fmt: KVFormat, group_size: int | None = None) -> OscarArtifact:
    """An artifact with identity rotations, no clipping and no centering: the runtime then equals plain INT2.

    `fmt` is the format it is made for (its windows, scales and quantizer; `centered` is recorded as False, since
    the means are zero); `group_size`, when given, replaces the format's."""
    ids = torch.tensor(layer_ids if layer_ids is not None else list(range(num_layers)), dtype=torch.int64)
    a = ids.numel()
    eye = torch.eye(head_dim).expand(a, num_kv_heads, head_dim, head_dim).contiguous()
    ones = torch.ones(a, num_kv_heads)
    eig = torch.ones(a, num_kv_heads, head_dim)
    zeros = torch.zeros(a, num_kv_heads, head_dim)
    meta = build_metadata(model_id=model_id, model_revision="unknown", num_attention_heads=num_heads,
                          num_key_value_heads=num_kv_heads, head_dim=head_dim, granularity="head",
                          key_target="identity", value_target="identity", calibration={}, tool_version="identity",
                          fmt=fmt.with_(group_size=group_size, centered=False))
    return OscarArtifact(ids, eye.clone(), eye.clone(), ones.clone(), ones.clone(), eig.clone(), eig.clone(),
                         metadata=meta, source="<identity>", k_mean=zeros, v_mean=zeros.clone())


__all__ = [
    "ARTIFACT_FILENAME",
    "FORMAT_NAME",
    "ORTHOGONALITY_TOL",
    "SCHEMA_VERSION",
    "ArtifactError",
    "IDENTITY_ADVICE",
    "ModelMismatchError",
    "OscarArtifact",
    "build_metadata",
    "check_against_model",
    "identity_artifact",
    "model_geometry",
    "model_identity",
    "same_model",
    "orthogonality_error",
    "read_artifact",
    "text_config",
    "validate_tensors",
    "write_artifact",
]
