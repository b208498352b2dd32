"""The artifact contract in one place: names, bounds, the metadata builder and every validation rule.

Contract version 2 (the writer's version) adds to version 1:

    k_mean, v_mean     float32 [A, H_kv, d]   per-(layer, KV head) centering means (zeros = no centering)
    k_codebook         float32 [A, H_kv, 4]   optional, only with quantizer = lloyd_max
    v_codebook         float32 [A, H_kv, 4]   optional, only with quantizer = lloyd_max

and the metadata `mean_basis` (original | rotated), `quantizer` (uniform_minmax | uniform_unbiased | lloyd_max;
`runtime_kernels.quant.naive.QUANTIZERS` says what the uniform ones do) and
`scale_dtype` (float16 | bfloat16 | float32 | ue5m3, the last an 8-bit scale and 8-bit zero point). Version 1 artifacts still load: their means are zero,
their quantizer uniform_minmax and their scale dtype float16. Any other schema version is refused.

The encoding of the INT2 history as one value (`runtime_kernels.format.KVFormat`: windows, page, group, scale
format, quantizer, centering) is recorded under the optional v2 key `kv_format` (JSON of `KVFormat.to_record()`),
which every writer adds. The separate keys stay, for readers that predate the record, and must agree with it;
`kv_format_of` is the one function that turns metadata into a KVFormat: the record when present, else the separate
keys (v1 with v1's defaults), with LEGACY_PAGE_SIZE and centering read from the means (docs/kv_format.md).

Codebook levels are in units of the group's scale above its zero (`x = zero + level * scale`), so the
uniform quantizer's levels are (0, 1, 2, 3); Lloyd-Max centroids lie inside the clipped range, i.e. in
[0, 3], strictly increasing. A side (K or V) without a codebook uses uniform levels.

Every check names the field, the value and what was expected (ArtifactError). This module imports only
torch, the standard library and the torch quantizer reference (for the quantizer names), so the slim runtime can read
an artifact without Triton.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from runtime_kernels.format import (
    LEGACY_PAGE_SIZE,
    LEGACY_QUANTIZER,
    LEGACY_SCALE_FORMAT,
    MAX_CLIP_RATIO,
    MAX_WINDOW_TOKENS,
    MIN_CLIP_RATIO,
    RECORD_KEY,
    SCALE_FORMATS,
    KVFormat,
    KVFormatError,
)
from runtime_kernels.format import QUANTIZERS as SERVED_QUANTIZERS
from runtime_kernels.quant import naive

FORMAT_NAME = "oscar-kv"
SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
ORTHOGONALITY_TOL = 1e-5

V1_TENSOR_NAMES = ("layer_ids", "k_rotation", "v_rotation", "k_clip_ratio", "v_clip_ratio",
                   "k_eigenvalues", "v_eigenvalues")
MEAN_TENSOR_NAMES = ("k_mean", "v_mean")
CODEBOOK_TENSOR_NAMES = ("k_codebook", "v_codebook")
V2_TENSOR_NAMES = V1_TENSOR_NAMES + MEAN_TENSOR_NAMES
ALL_TENSOR_NAMES = V2_TENSOR_NAMES + CODEBOOK_TENSOR_NAMES

V1_METADATA = ("format", "schema_version", "model_id", "model_revision", "num_attention_heads",
               "num_key_value_heads", "head_dim", "bits", "group_size", "sink_tokens", "recent_tokens",
               "granularity", "key_target", "value_target", "calibration", "tool_version", "created_at")
V2_METADATA = V1_METADATA + ("mean_basis", "quantizer", "scale_dtype")
INT_METADATA = ("schema_version", "num_attention_heads", "num_key_value_heads", "head_dim", "bits", "group_size",
                "sink_tokens", "recent_tokens")

GRANULARITIES = ("head", "layer")
MEAN_BASES = ("original", "rotated")
QUANTIZERS = naive.QUANTIZERS + ("lloyd_max",)  # the uniform ones are the runtime's; lloyd_max is read, not served
# The contract's scale dtype names: float scales (a reference import's bfloat16/float32 are served as fp16), then the
# served formats' storage (`quant.naive.SCALE_STORAGE`; ue5m3: 8-bit scale + 8-bit zero point).
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                **{name: dtype for name, dtype in naive.SCALE_STORAGE.items() if name != "float16"}}
CODEBOOK_LEVELS = 4
V1_DEFAULTS = {"mean_basis": "original", "quantizer": LEGACY_QUANTIZER, "scale_dtype": LEGACY_SCALE_FORMAT}
OPTIONAL_V2_METADATA = (RECORD_KEY,)
# Artifacts written before the `kv_format` record did not name a page size: LEGACY_PAGE_SIZE (format.py), the pages
# the runtime served them with, is their format's page (a cache may still be built with another: pages are not fitted).

# Bounds, checked before anything is allocated from them.
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_HEAD_DIM = 1024
MAX_IDENTITY_CHARS = 1024  # model_id / model_revision: a Hub id, a local path or a commit; never a document
MAX_METADATA_VALUE_CHARS = 1 << 18  # the calibration recipe JSON is a few KB
# Centering means, bounded by what serving decodes (checked per (layer, KV head), as the L2 norm of the mean, which is
# the same in every basis):
# - MAX_MEAN_ABS: the INT2 pages quantize `x_rot - mean_rot` with scale and zero in fp16 (or an 8-bit scale of fp16's
#   range) and the write path refuses rotated elements beyond fp16's 65504 (`cache.MAX_KV_MAGNITUDE`); a mean of rows
#   that serving stores cannot exceed it, and a larger one gives infinite page scales. (It was 1e6: a mean of 9.9e5
#   passed and greedy decoding repeated one token.)
# - MEAN_SPREAD_RATIO: relative to the data. The eigenvalues recorded with each side are those of an uncentered second
#   moment of the calibration data (queries for K, attention outputs or logit-weighted values for V), so their sum is
#   E|x|^2 of that data, and by Jensen |E[x]| <= sqrt(E|x|^2) for the same data. The mean is of the keys / values
#   themselves, so the ratio can exceed 1: measured max |mean| / sqrt(sum eigenvalues) = 0.43 (K) and 0.36 (V) on the
#   tiny-qwen3 fixture, 1.8 (K) and 2.1 (V) on SmolLM2-135M. 256 leaves two orders of magnitude for models whose
#   keys and queries differ in scale (k_proj biases), and refuses a mean so far from the data that the pages' INT2
#   step (about |x - mean| / 3 under ue5m3, where a group's range includes 0) would be set by the mean, not the
#   data: the "finite garbage" of a forged mean. tests/test_serving_bounds.py checks that an honest mean at the
#   bound decodes as precisely as no mean.
MAX_MEAN_ABS = float(torch.finfo(torch.float16).max)
MEAN_SPREAD_RATIO = 256.0
# - OWN_RMS_RATIO: relative to the side's own data, where the calibration recipe records it (`calibration.kv_rms`:
#   per layer row and KV head, the root mean square norm of the held-out keys / values, written by every calibration
#   since issue 54). A mean of the data is at most that (Jensen: |E x| <= sqrt(E |x|^2)); 4x leaves room for the
#   held-out text differing from the calibration samples. The recorded eigenvalues are not used for this bound, so
#   scaling them does not lift it; an artifact without the record (a reference import, an older calibration) keeps
#   the spread bound above, and the serving cache checks its means against the first prefill's rows.
OWN_RMS_RATIO = 4.0
OWN_RMS_KEY = "kv_rms"


class ArtifactError(ValueError):
    """An artifact that breaks the contract. The message names the file, the field and what was expected."""


def fail(source: str, field_name: str, message: str) -> None:
    raise ArtifactError(f"{source}: field '{field_name}': {message}")


def _short(value: Any, limit: int = 60) -> str:
    text = ascii(value)
    return text if len(text) <= limit else text[:limit] + "...'"


# --- strict JSON ----------------------------------------------------------------------------------
class DuplicateKeyError(ValueError):
    """A JSON object names the same key twice (json's default keeps the last one silently)."""


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`object_pairs_hook` for json.loads: a dict, or DuplicateKeyError naming the repeated key."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"duplicate key {_short(key)}")
        out[key] = value
    return out


def _refuse_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def strict_json_loads(text: str | bytes, source: str, field_name: str) -> Any:
    """json.loads that refuses duplicate keys, NaN/Infinity and deep nesting. Raises ArtifactError naming the field."""
    try:
        return json.loads(text, object_pairs_hook=reject_duplicate_keys, parse_constant=_refuse_constant)
    except (DuplicateKeyError, ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        fail(source, field_name, f"expected strict JSON (no duplicate keys): {type(exc).__name__}: {exc}")


# --- the one clock and the one metadata builder ----------------------------------------------------
def created_at() -> str:
    """UTC timestamp `YYYY-MM-DDTHH:MM:SSZ`; honours SOURCE_DATE_EPOCH so two identical runs give identical bytes."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch:
        try:
            now = _dt.datetime.fromtimestamp(int(epoch), _dt.timezone.utc)
        except (ValueError, OverflowError, OSError):
            raise ValueError(f"SOURCE_DATE_EPOCH: expected an integer number of seconds, got {_short(epoch)}") from None
    else:
        now = _dt.datetime.now(_dt.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def served_scale_format(scale_dtype: str) -> str:
    """The scale format the runtime's pages store for a contract `scale_dtype`: `ue5m3` as is, `float16` otherwise
    (a reference import's bfloat16/float32 scales are served as fp16)."""
    return scale_dtype if scale_dtype in SCALE_FORMATS else "float16"


def build_metadata(*, model_id: str, model_revision: str, num_attention_heads: int, num_key_value_heads: int,
                   head_dim: int, granularity: str, key_target: str, value_target: str,
                   calibration: dict[str, Any], tool_version: str, fmt: KVFormat,
                   mean_basis: str = "original", scale_dtype: str | None = None) -> dict[str, str]:
    """The `__metadata__` of a contract-v2 artifact (strings only), with `created_at` from the one clock.

    `fmt` is the artifact's KV format (its group size resolved at `head_dim`; `centered` must say whether the
    artifact's means are non-zero): written as the `kv_format` record and as the separate keys older readers need.
    `scale_dtype` is the contract's name of the scales the artifact was made for, when that is not what the runtime
    stores (a reference import's float32); default `fmt.scale_format`. Every artifact writer (calibration, the
    reference importer, identity_artifact) builds its metadata here.
    """
    fmt = fmt.resolved(int(head_dim))
    scale_dtype = fmt.scale_format if scale_dtype is None else scale_dtype
    if scale_dtype not in SCALE_DTYPES or served_scale_format(scale_dtype) != fmt.scale_format:
        raise ValueError(f"scale_dtype: '{scale_dtype}' is not stored as the format's scale_format "
                         f"'{fmt.scale_format}' (expected one of {list(SCALE_DTYPES)} that the runtime serves so)")
    return {
        "format": FORMAT_NAME,
        "schema_version": str(SCHEMA_VERSION),
        "model_id": str(model_id),
        "model_revision": str(model_revision),
        "num_attention_heads": str(int(num_attention_heads)),
        "num_key_value_heads": str(int(num_key_value_heads)),
        "head_dim": str(int(head_dim)),
        "bits": "2",
        "group_size": str(fmt.group_size),
        "sink_tokens": str(fmt.sink_tokens),
        "recent_tokens": str(fmt.recent_tokens),
        "granularity": granularity,
        "key_target": key_target,
        "value_target": value_target,
        "calibration": json.dumps(calibration, sort_keys=True),
        "tool_version": tool_version,
        "created_at": created_at(),
        "mean_basis": mean_basis,
        "quantizer": fmt.quantizer,
        "scale_dtype": scale_dtype,
        RECORD_KEY: format_record_json(fmt),
    }


def format_record_json(fmt: KVFormat) -> str:
    """The `kv_format` metadata value of `fmt`: its record as compact JSON with sorted keys (deterministic bytes)."""
    return json.dumps(fmt.to_record(), sort_keys=True, separators=(",", ":"))


# --- metadata -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContractMetadata:
    """The typed, validated view of an artifact's `__metadata__` (v1 values filled with v1's defaults)."""

    schema_version: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    group_size: int
    sink_tokens: int
    recent_tokens: int
    granularity: str
    mean_basis: str
    quantizer: str
    scale_dtype: str
    record: KVFormat | None = None  # the `kv_format` record (None: an artifact written before it)
    # The artifact's KV format, set by `validate_tensors` (which sees the means): None before, and for a quantizer
    # the runtime reads but does not serve (lloyd_max).
    served: KVFormat | None = None


def _bounded_int(metadata: dict[str, str], key: str, source: str, low: int, high: int) -> int:
    raw = metadata[key]
    # int() accepts '+1', ' 1', '1_000' and thousands of digits; the contract writes plain decimal digits.
    if not (isinstance(raw, str) and 0 < len(raw) <= 12 and (raw.isdigit() or (raw[0] == "-" and raw[1:].isdigit()))
            and raw.isascii()):
        fail(source, key, f"expected a decimal integer string, got {_short(raw)}")
    value = int(raw)
    if not low <= value <= high:
        fail(source, key, f"expected an integer in [{low}, {high}], got {value}")
    return value


def _choice(metadata: dict[str, str], key: str, source: str, choices) -> str:
    value = metadata[key]
    if value not in choices:
        fail(source, key, f"expected one of {list(choices)}, got {_short(value)}")
    return value


def _identity_text(value: str, key: str, source: str) -> None:
    """The model an artifact names is printed in messages and compared with the served model's id or path: it must be
    one printable line (a Hub id, a local path or a revision), not empty and not a document. Raises ArtifactError."""
    if not value or len(value) > MAX_IDENTITY_CHARS:
        fail(source, key, f"expected a Hub id, path or revision of 1 to {MAX_IDENTITY_CHARS} characters, got "
                          f"{len(value)} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        fail(source, key, f"control characters are not allowed (an id, path or revision is one printable line), got "
                          f"{_short(value)}")


def parse_metadata(metadata: dict[str, str], source: str) -> ContractMetadata:
    """Validate `__metadata__` against contract v1 or v2 and return its typed view. Raises ArtifactError."""
    if not isinstance(metadata, dict):
        fail(source, "__metadata__", f"expected a string->string map, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            fail(source, str(key), f"expected a string of at most {MAX_METADATA_VALUE_CHARS} characters")
    for key in ("format", "schema_version"):
        if key not in metadata:
            fail(source, key, "missing from __metadata__" + (": a safetensors file of another kind, not an OSCAR "
                                                             "artifact" if key == "format" else ""))
    if metadata["format"] != FORMAT_NAME:
        fail(source, "format", f"expected '{FORMAT_NAME}', got {_short(metadata['format'])}: a safetensors file "
                               "of another kind, not an OSCAR artifact")
    raw_version = metadata["schema_version"]
    if raw_version not in tuple(str(v) for v in SUPPORTED_SCHEMA_VERSIONS):
        fail(source, "schema_version", f"expected one of {list(SUPPORTED_SCHEMA_VERSIONS)} (this reader knows "
                                       f"contract v1 and v2), got {_short(raw_version)}")
    version = int(raw_version)
    required = V1_METADATA if version == 1 else V2_METADATA
    for key in required:
        if key not in metadata:
            fail(source, key, f"missing from __metadata__ (required by contract v{version})")
    if version == 1:
        extra_v2 = [k for k in (*V1_DEFAULTS, *OPTIONAL_V2_METADATA) if k in metadata]
        if extra_v2:
            fail(source, extra_v2[0], "is a contract v2 field but schema_version is 1")
        metadata = {**metadata, **V1_DEFAULTS}
    for key in ("model_id", "model_revision"):
        _identity_text(metadata[key], key, source)
    if metadata["bits"] != "2":
        fail(source, "bits", f"expected '2', got {_short(metadata['bits'])}")
    h_q = _bounded_int(metadata, "num_attention_heads", source, 1, MAX_HEADS)
    h_kv = _bounded_int(metadata, "num_key_value_heads", source, 1, MAX_HEADS)
    if h_q % h_kv:
        fail(source, "num_key_value_heads", f"expected a divisor of num_attention_heads={h_q}, got {h_kv}")
    d = _bounded_int(metadata, "head_dim", source, 4, MAX_HEAD_DIM)
    if d & (d - 1):
        fail(source, "head_dim", f"expected a power of two, got {d}")
    g = _bounded_int(metadata, "group_size", source, 4, MAX_HEAD_DIM)
    if d % g or g % 4:
        fail(source, "group_size", f"expected a multiple of 4 dividing head_dim={d}, got {g}")
    sink = _bounded_int(metadata, "sink_tokens", source, 0, MAX_WINDOW_TOKENS)
    recent = _bounded_int(metadata, "recent_tokens", source, 0, MAX_WINDOW_TOKENS)
    granularity = _choice(metadata, "granularity", source, GRANULARITIES)
    mean_basis = _choice(metadata, "mean_basis", source, MEAN_BASES)
    quantizer = _choice(metadata, "quantizer", source, QUANTIZERS)
    scale_dtype = _choice(metadata, "scale_dtype", source, SCALE_DTYPES)
    strict_json_loads(metadata["calibration"], source, "calibration")
    meta = ContractMetadata(version, h_q, h_kv, d, g, sink, recent, granularity, mean_basis, quantizer, scale_dtype)
    if RECORD_KEY in metadata:
        meta = replace(meta, record=_parse_record(metadata[RECORD_KEY], meta, source))
    return meta


def _parse_record(text: str, meta: ContractMetadata, source: str) -> KVFormat:
    """The `kv_format` record, checked against the separate keys it repeats. Raises ArtifactError naming the entry."""
    try:
        fmt = KVFormat.from_record(strict_json_loads(text, source, RECORD_KEY))
    except KVFormatError as exc:
        fail(source, RECORD_KEY, f"entry '{exc.field}': {str(exc).split(': ', 1)[1]}")
    for entry, recorded, key, value in (
            ("sink_tokens", fmt.sink_tokens, "sink_tokens", meta.sink_tokens),
            ("recent_tokens", fmt.recent_tokens, "recent_tokens", meta.recent_tokens),
            ("group_size", fmt.group_size, "group_size", meta.group_size),
            ("quantizer", fmt.quantizer, "quantizer", meta.quantizer),
            ("scale_format", fmt.scale_format, "scale_dtype", served_scale_format(meta.scale_dtype))):
        if recorded != value:
            fail(source, RECORD_KEY, f"entry '{entry}' is {recorded!r} but field '{key}' says {value!r} (the record "
                                     "and the separate keys must describe one format)")
    return fmt


def kv_format_of(meta: ContractMetadata, centered: bool, source: str) -> KVFormat:
    """The artifact's KV format: its `kv_format` record, or (an artifact written before the record, v1 included)
    the separate keys with LEGACY_PAGE_SIZE. `centered` says whether the artifact's means are non-zero; a record
    that says otherwise is refused (serving would add or drop means the clips were not fitted with).

    Raises ArtifactError naming the field: the record's disagreement, or a quantizer this runtime does not serve
    (`lloyd_max` codebooks are read by the contract but have no KV format).
    """
    if meta.record is not None:
        if meta.record.centered != centered:
            fail(source, RECORD_KEY, f"entry 'centered' is {meta.record.centered} but the artifact's k_mean/v_mean "
                                     f"are {'non-zero' if centered else 'all zero'}")
        return meta.record
    try:
        return KVFormat(sink_tokens=meta.sink_tokens, recent_tokens=meta.recent_tokens, page_size=LEGACY_PAGE_SIZE,
                        group_size=meta.group_size, scale_format=served_scale_format(meta.scale_dtype),
                        quantizer=meta.quantizer, centered=centered)
    except KVFormatError as exc:
        key = {"scale_format": "scale_dtype"}.get(exc.field, exc.field)
        fail(source, key, f"has no KV format this runtime serves: {exc}")


# --- tensors --------------------------------------------------------------------------------------
def tensor_specs(meta: ContractMetadata, num_layers: int, names: set[str] | frozenset[str],
                 source: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The exact (dtype, shape) of every tensor the file must hold, given its metadata and `[A]` layer count.

    `names` are the tensors present; a missing required one, an unknown one, or a codebook that the
    quantizer does not allow raises ArtifactError.
    """
    if not 1 <= num_layers <= MAX_LAYERS:
        fail(source, "layer_ids", f"expected between 1 and {MAX_LAYERS} calibrated layers, got {num_layers}")
    required = V1_TENSOR_NAMES if meta.schema_version == 1 else V2_TENSOR_NAMES
    allowed = set(required) | (set(CODEBOOK_TENSOR_NAMES) if meta.schema_version == 2 else set())
    for name in required:
        if name not in names:
            fail(source, name, f"missing tensor (required by contract v{meta.schema_version})")
    extra = sorted(set(names) - allowed)
    if extra:
        fail(source, extra[0], f"unexpected tensor (contract v{meta.schema_version} has {sorted(allowed)})")
    codebooks = [n for n in CODEBOOK_TENSOR_NAMES if n in names]
    if codebooks and meta.quantizer != "lloyd_max":
        fail(source, codebooks[0], f"a codebook needs quantizer 'lloyd_max', metadata says '{meta.quantizer}'")
    if meta.quantizer == "lloyd_max" and not codebooks:
        fail(source, "quantizer", f"'lloyd_max' needs at least one of {list(CODEBOOK_TENSOR_NAMES)}")
    a, h, d = num_layers, meta.num_key_value_heads, meta.head_dim
    shapes = {"layer_ids": (torch.int64, (a,)), "k_rotation": (torch.float32, (a, h, d, d)),
              "v_rotation": (torch.float32, (a, h, d, d)), "k_clip_ratio": (torch.float32, (a, h)),
              "v_clip_ratio": (torch.float32, (a, h)), "k_eigenvalues": (torch.float32, (a, h, d)),
              "v_eigenvalues": (torch.float32, (a, h, d)), "k_mean": (torch.float32, (a, h, d)),
              "v_mean": (torch.float32, (a, h, d)), "k_codebook": (torch.float32, (a, h, CODEBOOK_LEVELS)),
              "v_codebook": (torch.float32, (a, h, CODEBOOK_LEVELS))}
    return {name: shapes[name] for name in sorted(names)}


def orthogonality_error(rotations: torch.Tensor) -> float:
    """max |R R^T - I| over a stack of square matrices `[..., d, d]`, computed in fp32."""
    r = rotations.float()
    eye = torch.eye(r.shape[-1], dtype=torch.float32)
    return float((r @ r.transpose(-1, -2) - eye).abs().amax()) if r.numel() else 0.0


def _check_values(tensors: dict[str, torch.Tensor], source: str, metadata: dict[str, str]) -> None:
    layer_ids = tensors["layer_ids"]
    if (layer_ids < 0).any() or (layer_ids[1:] <= layer_ids[:-1]).any():
        fail(source, "layer_ids", f"expected strictly increasing non-negative layer indices, got "
                                  f"{_short(layer_ids.tolist())}")
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            fail(source, name, "contains NaN or Inf")
    for name in ("k_clip_ratio", "v_clip_ratio"):
        t = tensors[name]
        bad = (t < MIN_CLIP_RATIO) | (t > MAX_CLIP_RATIO)
        if bad.any():
            fail(source, name, f"expected every ratio in [{MIN_CLIP_RATIO}, {MAX_CLIP_RATIO}], got {float(t[bad][0])!r}")
    for name in ("k_rotation", "v_rotation"):
        err = orthogonality_error(tensors[name])
        if err > ORTHOGONALITY_TOL:
            fail(source, name, f"not orthogonal: max |R R^T - I| = {err:.2e} > {ORTHOGONALITY_TOL:.0e}")
    for name in ("k_eigenvalues", "v_eigenvalues"):
        t = tensors[name]
        if (t[..., 1:] > t[..., :-1] + 1e-6 * t.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)).any():
            fail(source, name, "expected descending eigenvalues")
    own = _own_rms(metadata, source, tuple(tensors["k_rotation"].shape[:2])) if any(
        n in tensors for n in MEAN_TENSOR_NAMES) else None
    for name in MEAN_TENSOR_NAMES:
        if name in tensors:
            _check_mean(tensors[name], tensors[f"{name[0]}_eigenvalues"], name, source)
            if own is not None:
                _check_mean_own(tensors[name], own[name[0]], name, source)
    for name in CODEBOOK_TENSOR_NAMES:
        if name not in tensors:
            continue
        t = tensors[name]
        if (t[..., 1:] <= t[..., :-1]).any():
            fail(source, name, "expected 4 strictly increasing levels per (layer, KV head)")
        if (t < 0).any() or (t > CODEBOOK_LEVELS - 1).any():
            fail(source, name, f"expected levels in [0, {CODEBOOK_LEVELS - 1}] (units of the group scale above "
                               f"its zero), got min {float(t.min())!r}, max {float(t.max())!r}")


def _check_mean(mean: torch.Tensor, eigenvalues: torch.Tensor, name: str, source: str) -> None:
    """`mean` `[A, H, d]` within MAX_MEAN_ABS and MEAN_SPREAD_RATIO x sqrt(sum of that side's eigenvalues) per head."""
    norm = mean.double().norm(dim=-1)  # [A, H]
    if (norm > MAX_MEAN_ABS).any():
        fail(source, name, f"expected |mean| <= {MAX_MEAN_ABS:g} (the fp16 range of the INT2 pages), got "
                           f"{float(norm.max())!r}")
    spread = eigenvalues.double().clamp_min(0).sum(dim=-1).sqrt()  # [A, H]
    bad = norm > MEAN_SPREAD_RATIO * spread
    if bad.any():
        a, h = (int(i) for i in bad.nonzero()[0])
        fail(source, name, f"|mean| = {float(norm[a, h]):.4g} at layer row {a}, KV head {h} is more than "
                           f"{MEAN_SPREAD_RATIO:g} x the data's spread sqrt(sum {name[0]}_eigenvalues) = "
                           f"{float(spread[a, h]):.4g}; serving would quantize the mean, not the data")


def _own_rms(metadata: dict[str, str], source: str, shape: tuple[int, int]) -> dict[str, torch.Tensor] | None:
    """`calibration.kv_rms` as {"k": [A, H], "v": [A, H]} float64, or None where the recipe has no such record."""
    calib = strict_json_loads(metadata["calibration"], source, "calibration")
    record = calib.get(OWN_RMS_KEY) if isinstance(calib, dict) else None
    if record is None:
        return None
    field = f"calibration.{OWN_RMS_KEY}"
    if not (isinstance(record, dict) and set(record) == {"k", "v"}):
        fail(source, field, "expected an object with exactly 'k' and 'v'")
    out = {}
    for side in ("k", "v"):
        rows = record[side]
        ok = (isinstance(rows, list) and len(rows) == shape[0]
              and all(isinstance(r, list) and len(r) == shape[1] and all(
                  isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0 < x <= MAX_MEAN_ABS
                  for x in r) for r in rows))
        if not ok:
            fail(source, f"{field}.{side}", f"expected {shape[0]} rows of {shape[1]} positive numbers at most "
                                            f"{MAX_MEAN_ABS:g} (the RMS norm per layer row and KV head)")
        out[side] = torch.tensor(rows, dtype=torch.float64)
    return out


def _check_mean_own(mean: torch.Tensor, rms: torch.Tensor, name: str, source: str) -> None:
    """`mean` `[A, H, d]` within OWN_RMS_RATIO x the side's own recorded RMS norm `[A, H]`."""
    norm = mean.double().norm(dim=-1)
    bad = norm > OWN_RMS_RATIO * rms
    if bad.any():
        a, h = (int(i) for i in bad.nonzero()[0])
        fail(source, name, f"|mean| = {float(norm[a, h]):.4g} at layer row {a}, KV head {h} is more than "
                           f"{OWN_RMS_RATIO:g} x the RMS norm {float(rms[a, h]):.4g} of that side's own data "
                           f"(calibration.{OWN_RMS_KEY}; a mean of the data is at most 1x): serving would quantize the "
                           "mean, not the data")


def validate_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str], source: str,
                     meta: ContractMetadata | None = None) -> ContractMetadata:
    """Check every rule of contract v1/v2 on in-memory tensors. Raises ArtifactError naming the first broken field.

    `meta`: `parse_metadata(metadata, source)` when the caller already has it (`read_artifact` parses the metadata
    before it reads a tensor), so one read parses it once. Returns the typed metadata with `served`, the artifact's
    KV format (`kv_format_of`; None for lloyd_max, which is read but not served)."""
    meta = parse_metadata(metadata, source) if meta is None else meta
    layer_ids = tensors.get("layer_ids")
    if not isinstance(layer_ids, torch.Tensor) or layer_ids.dim() != 1:
        fail(source, "layer_ids", "expected an int64 [A] tensor" if layer_ids is not None else "missing tensor")
    specs = tensor_specs(meta, int(layer_ids.numel()), set(tensors), source)
    for name, (dtype, shape) in specs.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            fail(source, name, f"expected {str(dtype).replace('torch.', '')}, got "
                               f"{getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) != shape:
            fail(source, name, f"expected shape {list(shape)}, got {list(t.shape)}")
    _check_values(tensors, source, metadata)
    if meta.record is None and meta.quantizer not in SERVED_QUANTIZERS:
        return meta  # lloyd_max codebooks: read, not served (`kv_format_of` names the field when a cache asks)
    # kv_format_of also refuses a record whose centering the means contradict
    return replace(meta, served=kv_format_of(meta, has_means(tensors), source))


def has_means(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the artifact centers its cache: a `k_mean` or `v_mean` with a non-zero entry (v1: none)."""
    return any(tensors.get(n) is not None and bool(tensors[n].any()) for n in MEAN_TENSOR_NAMES)


def clip_ratio_is_sane(value: float) -> bool:
    """True for a finite clip ratio inside the contract's range."""
    return isinstance(value, (int, float)) and math.isfinite(value) and MIN_CLIP_RATIO <= value <= MAX_CLIP_RATIO
