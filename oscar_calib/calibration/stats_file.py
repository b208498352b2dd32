"""Calibration statistics as an artifact of their own: `oscar_stats.safetensors`.

A `CalibrationStatistics` holds everything the solver and the clip fit need, so that an artifact can be
rebuilt without the model (`oscar-calib refit`): the fp64 sums and counts per (layer, KV head)
(`oscar_calib.calibration.stats.LayerStats`), the held-out capture (keys, values, queries and query positions of the
held-out sequences, per layer) and the provenance (model, data, capture settings, which samples were summed).

File layout (`A` calibrated layers, `S` held-out sequences, `T` their length, `n` held-out query positions):

| tensor | dtype | shape |
|---|---|---|
| `layer_ids` | int64 | `[A]` |
| `key_sum`, `attn_out_sum`, `logit_v_sum` | float64 | `[A, H_kv, d, d]` |
| `logit_w_sum` | float64 | `[A, H_kv]` |
| `query_count`, `token_count` | int64 | `[A]` |
| `holdout_keys`, `holdout_values` | capture dtype | `[A, S, H_kv, T, d]` |
| `holdout_queries` | capture dtype | `[A, S, H_q, n, d]` |
| `holdout_positions` | int64 | `[A, S, n]` |

Metadata (strings; JSON for the structured ones): `format=oscar-stats`, `schema_version`, the identity fields
(`IDENTITY_FIELDS`: tool version, model id / revision / config hash, geometry, data provenance, capture
settings), `config_hash` (sha256 of the identity), `sample_ranges`, `skipped_layers`, `created_at`.
Files merge by addition when their identities are equal (`merge_statistics`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from oscar_calib import __version__
from oscar_calib.calibration.capture import HoldoutRows
from oscar_calib.calibration.stats import LayerStats
from oscar_calib.errors import InputError

STATS_FILENAME = "oscar_stats.safetensors"
STATS_FORMAT = "oscar-stats"
STATS_SCHEMA_VERSION = 1
# What must agree for two statistics to be summed, or for a checkpoint to be resumed.
IDENTITY_FIELDS = ("tool_version", "model_id", "model_revision", "model_config_hash", "geometry", "data", "capture")
_SUM_TENSORS = ("key_sum", "attn_out_sum", "logit_v_sum", "logit_w_sum", "key_vec_sum", "value_vec_sum")
_O_PROJ_PREFIX = "o_proj."  # o_proj weights per layer, for the block_out clip objective
_HOLDOUT_TENSORS = ("holdout_keys", "holdout_values", "holdout_queries", "holdout_positions")
# Config entries that say where or by whom a config was saved, not what the model computes.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "dtype", "torch_dtype",
                         "_attn_implementation", "_attn_implementation_internal", "use_cache")


def tool_version() -> str:
    return f"oscar-calib {__version__}"


def model_config_hash(config) -> str:
    """sha256 of the model config's JSON, without the entries that say where it was saved or loaded from."""
    items = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(items, sort_keys=True, default=str).encode()).hexdigest()


def normalise_ranges(ranges) -> list[list[int]]:
    """Sorted `[start, end)` sample ranges with touching ones joined; raises ValueError on overlap."""
    out: list[list[int]] = []
    for start, end in sorted((int(a), int(b)) for a, b in ranges):
        if out and start < out[-1][1]:
            raise ValueError(f"sample ranges overlap: [{out[-1][0]}, {out[-1][1]}) and [{start}, {end})")
        if out and start == out[-1][1]:
            out[-1][1] = end
        else:
            out.append([start, end])
    return out


@dataclass
class StatsProvenance:
    """Where the statistics come from. `identity()` is what merge and resume compare, field by field."""

    model_id: str
    model_revision: str
    model_config_hash: str
    geometry: dict  # num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, scaling
    data: dict  # dataset, revision, split, seed, samples, seq_len, ... (the artifact's `calibration` recipe)
    capture: dict  # dtype, batch_size, holdout_queries, seed: settings that change the sums' bits
    sample_ranges: list[list[int]] = field(default_factory=list)
    skipped_layers: list[int] = field(default_factory=list)
    created_at: str = ""
    tool_version: str = field(default_factory=tool_version)
    # A merge records its inputs: [{"sample_ranges": [[a, b]], "sums_sha256": hex}] (empty for one capture).
    parts: list[dict] = field(default_factory=list)

    def identity(self) -> dict:
        return {name: getattr(self, name) for name in IDENTITY_FIELDS}

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()

    def to_metadata(self) -> dict[str, str]:
        meta = {name: (v if isinstance(v, str) else json.dumps(v, sort_keys=True))
                for name, v in self.identity().items()}
        meta.update(sample_ranges=json.dumps(self.sample_ranges), skipped_layers=json.dumps(self.skipped_layers),
                    created_at=self.created_at, config_hash=self.config_hash())
        if self.parts:
            meta["parts"] = json.dumps(self.parts, sort_keys=True)
        return meta

    @classmethod
    def from_metadata(cls, meta: dict[str, str], where: str) -> StatsProvenance:
        def get(name: str, as_json: bool):
            if name not in meta:
                raise InputError(f"{where}: metadata field '{name}' is missing (expected an oscar-stats file)")
            if not as_json:
                return meta[name]
            try:
                return json.loads(meta[name])
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: metadata field '{name}' is not valid JSON ({exc.msg})") from exc

        return cls(model_id=get("model_id", False), model_revision=get("model_revision", False),
                   model_config_hash=get("model_config_hash", False), geometry=get("geometry", True),
                   data=get("data", True), capture=get("capture", True), sample_ranges=get("sample_ranges", True),
                   skipped_layers=get("skipped_layers", True), created_at=get("created_at", False),
                   tool_version=get("tool_version", False), parts=get("parts", True) if "parts" in meta else [])


def make_provenance(config, dtype: torch.dtype, *, model_id: str | None = None, model_revision: str | None = None,
                    calibration_meta: dict | None = None, batch_size: int = 1, holdout_queries: int = 256,
                    seed: int = 0, sample_ranges: list[list[int]] | None = None,
                    skipped_layers: list[int] | None = None, created: str = "") -> StatsProvenance:
    """The provenance of statistics captured from a model with `config` in `dtype` (run and checkpoint agree)."""
    from runtime_kernels.artifact import model_geometry

    n_layers, h_q, h_kv, d = model_geometry(config)
    return StatsProvenance(
        model_id=model_id or str(getattr(config, "_name_or_path", "") or "unknown"),
        model_revision=model_revision or str(getattr(config, "_commit_hash", None) or "unknown"),
        model_config_hash=model_config_hash(config),
        geometry={"num_hidden_layers": n_layers, "num_attention_heads": h_q, "num_key_value_heads": h_kv,
                  "head_dim": d},
        data=dict(calibration_meta or {}),
        capture={"dtype": str(dtype).removeprefix("torch."), "batch_size": batch_size,
                 "holdout_queries": holdout_queries, "seed": seed},
        sample_ranges=sample_ranges or [], skipped_layers=sorted(skipped_layers or ()), created_at=created)


def first_difference(expected: dict, got: dict, prefix: str = "") -> tuple[str, object, object] | None:
    """The first (dotted field, expected value, got value) where two nested dicts differ, or None.

    Fields are visited in `got`'s order (data before capture settings), so the message names the cause.
    """
    for key in [*got, *(k for k in expected if k not in got)]:
        a, b = expected.get(key), got.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            diff = first_difference(a, b, name + ".")
            if diff:
                return diff
        elif a != b:
            return name, a, b
    return None


@dataclass
class CalibrationStatistics:
    """Sums per layer (`stats`), held-out capture per layer (`holdout`), attention scaling and provenance.

    Quacks like a `CaptureSession` for the solver and clip fit: `.stats[layer]`, `.holdout[layer].stacked()`,
    `.scaling`, `.geometry`.
    """

    stats: dict[int, LayerStats]
    holdout: dict[int, HoldoutRows]
    scaling: float
    provenance: StatsProvenance
    timings: dict[str, float] = field(default_factory=dict)  # of the capture that made them (not saved)
    o_weights: dict[int, torch.Tensor] | None = None  # layer -> o_proj weight [hidden, H_q * d] (block_out fit)

    @property
    def geometry(self) -> tuple[int, int, int]:
        g = self.provenance.geometry
        return (g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"])

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.stats)

    @property
    def tokens(self) -> int:
        return self.stats[self.layer_ids[0]].token_count if self.stats else 0

    def holdout_on(self, device: torch.device | str) -> CalibrationStatistics:
        """A view whose held-out tensors live on `device` (where the clip fit runs); sums stay where they are."""
        moved = {layer: HoldoutRows(*([t.to(device)] for t in rows.stacked())) for layer, rows in self.holdout.items()}
        return replace(self, holdout=moved)

    def accumulator_bytes(self) -> int:
        """Bytes held by the fp64 sums: O(layers x KV heads x d^2)."""
        return sum(t.numel() * t.element_size() for s in self.stats.values()
                   for t in (getattr(s, n) for n in _SUM_TENSORS))


# -- tensors <-> LayerStats --------------------------------------------------------------------------------------
def sums_to_tensors(stats: dict[int, LayerStats]) -> dict[str, torch.Tensor]:
    """Stack per-layer sums into the file's tensors (on CPU, contiguous)."""
    layers = sorted(stats)
    out = {"layer_ids": torch.tensor(layers, dtype=torch.int64)}
    for name in _SUM_TENSORS:
        out[name] = torch.stack([getattr(stats[i], name).detach().cpu() for i in layers]).contiguous()
    out["query_count"] = torch.tensor([stats[i].query_count for i in layers], dtype=torch.int64)
    out["token_count"] = torch.tensor([stats[i].token_count for i in layers], dtype=torch.int64)
    return out


def sums_from_tensors(tensors: dict[str, torch.Tensor], where: str) -> dict[int, LayerStats]:
    """Inverse of `sums_to_tensors`; checks names, dtypes and shapes, naming the tensor."""
    for name in ("layer_ids", *_SUM_TENSORS, "query_count", "token_count"):
        if name not in tensors:
            raise InputError(f"{where}: tensor '{name}' is missing")
    layers = tensors["layer_ids"].tolist()
    a = len(layers)
    key = tensors["key_sum"]
    if key.dim() != 4 or key.shape[0] != a or key.shape[2] != key.shape[3]:
        raise InputError(f"{where}: tensor 'key_sum' has shape {list(key.shape)}, expected [{a}, H_kv, d, d]")
    expected = {"key_sum": key.shape, "attn_out_sum": key.shape, "logit_v_sum": key.shape,
                "logit_w_sum": key.shape[:2], "key_vec_sum": key.shape[:3], "value_vec_sum": key.shape[:3],
                "query_count": (a,), "token_count": (a,)}
    for name, shape in expected.items():
        t = tensors[name]
        want = torch.int64 if name.endswith("_count") else torch.float64
        if tuple(t.shape) != tuple(shape) or t.dtype != want:
            raise InputError(f"{where}: tensor '{name}' is {t.dtype} {list(t.shape)}, expected {want} {list(shape)}")
    return {layer: LayerStats(*(tensors[n][i].clone() for n in _SUM_TENSORS),
                              query_count=int(tensors["query_count"][i]), token_count=int(tensors["token_count"][i]))
            for i, layer in enumerate(layers)}


def _holdout_to_tensors(holdout: dict[int, HoldoutRows], layers: list[int]) -> dict[str, torch.Tensor]:
    if not holdout:
        return {}
    stacked = [holdout[i].stacked() for i in layers]
    return {name: torch.stack([s[j].detach().cpu() for s in stacked]).contiguous()
            for j, name in enumerate(_HOLDOUT_TENSORS)}


def _holdout_from_tensors(tensors: dict[str, torch.Tensor], layers: list[int], where: str) -> dict[int, HoldoutRows]:
    present = [n for n in _HOLDOUT_TENSORS if n in tensors]
    if not present:
        return {}
    if len(present) != len(_HOLDOUT_TENSORS):
        missing = sorted(set(_HOLDOUT_TENSORS) - set(present))
        raise InputError(f"{where}: held-out tensors {missing} are missing (the file has {present})")
    for name in _HOLDOUT_TENSORS:
        if tensors[name].shape[0] != len(layers):
            raise InputError(f"{where}: tensor '{name}' has {tensors[name].shape[0]} layers, expected {len(layers)}")
    return {layer: HoldoutRows(*([tensors[n][i].clone()] for n in _HOLDOUT_TENSORS)) for i, layer in enumerate(layers)}


# -- file I/O ------------------------------------------------------------------------------------------------------
def atomic_save_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path,
                            field: str = "--out") -> None:
    """Write a safetensors file through a temporary file in the same directory and `os.replace`.

    A reader (or a run killed at any point) sees the old file or the new one, never part of one. The header's
    keys are sorted (`canonical_safetensors_bytes`), so equal content gives equal bytes.
    """
    from runtime_kernels.artifact import canonical_safetensors_bytes

    payload = canonical_safetensors_bytes({n: t.contiguous() for n, t in tensors.items()}, metadata)
    atomic_write_bytes(payload, path, field)


def atomic_write_bytes(payload: bytes, path: Path, field: str = "--out") -> None:
    """Write `payload` to `path` atomically (`runtime_kernels.atomic.write_file_atomically`).

    A full disk (ENOSPC / EDQUOT) becomes `DiskFullError` naming the path and the bytes needed; the temporary
    file is removed and the old file stays, whatever fails. A symlink, directory or special file at `path` is
    refused (OutputDirError, exit 2), never written through. An interrupt after the replace says that `path`
    holds the new content.
    """
    from runtime_kernels.atomic import write_file_atomically

    write_file_atomically(path, payload, field)


def save_statistics(statistics: CalibrationStatistics, path: str | os.PathLike) -> Path:
    """Write `statistics` atomically to `path` (a file, or a directory that gets `oscar_stats.safetensors`).

    The header is written with sorted keys and fixed metadata, so the same statistics give the same bytes.
    """
    path = Path(path)
    if path.is_dir():
        path = path / STATS_FILENAME
    tensors = sums_to_tensors(statistics.stats)
    tensors.update(_holdout_to_tensors(statistics.holdout, statistics.layer_ids))
    for layer, w in sorted((statistics.o_weights or {}).items()):
        tensors[f"{_O_PROJ_PREFIX}{layer}"] = w.detach().cpu().contiguous()
    meta = {"format": STATS_FORMAT, "schema_version": str(STATS_SCHEMA_VERSION),
            "scaling": repr(float(statistics.scaling)), **statistics.provenance.to_metadata()}
    atomic_save_safetensors(tensors, meta, path)
    return path


def read_safetensors(path: Path, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors and the metadata of a safetensors file, or InputError naming the file."""
    from safetensors import safe_open

    if not path.is_file():
        raise InputError(f"{what} '{path}': file not found")
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises SafetensorError / OSError / ValueError
        raise InputError(f"{what} '{path}': not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
    return tensors, meta


def load_statistics(path: str | os.PathLike) -> CalibrationStatistics:
    """Read an `oscar_stats.safetensors` (or the directory holding it), validating format and shapes."""
    path = Path(path)
    if path.is_dir():
        path = path / STATS_FILENAME
    where = f"statistics '{path}'"
    tensors, meta = read_safetensors(path, "statistics")
    if meta.get("format") != STATS_FORMAT:
        raise InputError(f"{where}: metadata field 'format' is {meta.get('format')!r}, expected '{STATS_FORMAT}'")
    if meta.get("schema_version") != str(STATS_SCHEMA_VERSION):
        raise InputError(f"{where}: metadata field 'schema_version' is {meta.get('schema_version')!r}, "
                         f"expected '{STATS_SCHEMA_VERSION}'")
    provenance = StatsProvenance.from_metadata(meta, where)
    try:
        scaling = float(meta.get("scaling", ""))
    except ValueError as exc:
        raise InputError(f"{where}: metadata field 'scaling' is {meta.get('scaling')!r}, expected a number") from exc
    stats = sums_from_tensors(tensors, where)
    geometry = provenance.geometry
    h_kv, d = tuple(tensors["key_sum"].shape[1:3])
    if (geometry.get("num_key_value_heads"), geometry.get("head_dim")) != (h_kv, d):
        raise InputError(f"{where}: metadata field 'geometry' says {geometry}, but 'key_sum' holds {h_kv} KV heads "
                         f"of head_dim {d}")
    holdout = _holdout_from_tensors(tensors, sorted(stats), where)
    o_weights = {}
    for name, t in tensors.items():
        if name.startswith(_O_PROJ_PREFIX):
            suffix = name[len(_O_PROJ_PREFIX):]
            if not suffix.isdigit():
                raise InputError(f"{where}: tensor '{name}': expected 'o_proj.<layer index>'")
            o_weights[int(suffix)] = t
    if o_weights and sorted(o_weights) != sorted(stats):
        raise InputError(f"{where}: o_proj weights for layers {sorted(o_weights)}, expected {sorted(stats)}")
    check_values(stats, holdout, scaling, provenance, o_weights, where)
    return CalibrationStatistics(stats, holdout, scaling, provenance, o_weights=o_weights or None)


def check_values(stats: dict[int, LayerStats], holdout: dict, scaling: float, provenance: StatsProvenance,
                 o_weights: dict, where: str) -> None:
    """Values a real capture can produce (oscar_calib.calibration.stats_checks): finite, non-negative sums of squares, counts
    consistent with the recorded sample ranges, a finite held-out capture, complete o_proj weights."""
    from oscar_calib.calibration.stats_checks import (
        check_counts_match_samples,
        check_holdout,
        check_o_weights,
        check_ranges,
        check_scaling,
    )

    check_scaling(scaling, where)
    samples = provenance.data.get("samples") if isinstance(provenance.data, dict) else None
    total = samples if type(samples) is int and samples > 0 else None
    ranges = check_ranges(provenance.sample_ranges, where, total)
    try:
        normalise_ranges(ranges)
    except ValueError as exc:
        raise InputError(f"{where}: field 'sample_ranges': {exc}") from None
    check_counts_match_samples(stats, provenance.identity(), ranges, where)
    if provenance.parts:  # a merge: its recorded inputs must cover exactly its sample ranges
        try:
            covered = normalise_ranges([r for p in provenance.parts for r in p["sample_ranges"]])
        except (TypeError, KeyError, ValueError):
            covered = None
        if covered != normalise_ranges(ranges):
            raise InputError(f"{where}: field 'parts': the merged inputs cover {covered}, but 'sample_ranges' says "
                             f"{ranges}")
    if not isinstance(provenance.geometry, dict):
        raise InputError(f"{where}: field 'geometry': expected a JSON object")
    check_holdout(holdout, provenance.geometry, where)
    if o_weights:
        check_o_weights(o_weights, provenance.geometry, where)


# -- merge -----------------------------------------------------------------------------------------------------------
def check_same_identity(expected: StatsProvenance, got: StatsProvenance, expected_name: str, got_name: str,
                        action: str) -> None:
    """Raise InputError naming the first identity field where `got` differs from `expected`."""
    diff = first_difference(expected.identity(), got.identity())
    if diff:
        name, a, b = diff
        raise InputError(f"cannot {action}: field '{name}' differs ({expected_name}: {a!r}; {got_name}: {b!r})")


def _merge_parts(items: list[tuple[str, CalibrationStatistics]]) -> list[dict]:
    """The inputs of a merge, as the merged file records them: each capture's sample ranges and sums digest.

    Two inputs (or parts of earlier merges) with bit-identical sums hold the same samples: a shard copied and
    relabelled with another sample range would be counted twice, so that is refused naming both.
    """
    from oscar_calib.calibration.stats_checks import sums_digest

    parts: list[dict] = []
    seen: dict[str, str] = {}
    for name, s in items:
        own = s.provenance.parts or [{"sample_ranges": s.provenance.sample_ranges, "sums_sha256": sums_digest(s.stats)}]
        for part in own:
            digest = part.get("sums_sha256") if isinstance(part, dict) else None
            if not isinstance(digest, str):
                raise InputError(f"cannot merge statistics: {name}: field 'parts': expected objects with "
                                 "'sample_ranges' and 'sums_sha256'")
            if digest in seen:
                raise InputError(f"cannot merge statistics: field 'sample_ranges': {seen[digest]} and {name} hold "
                                 f"bit-identical sums (samples {part.get('sample_ranges')}), so the same samples "
                                 "would be counted twice (a shard copied or relabelled with another sample range)")
            seen[digest] = name
            parts.append({"sample_ranges": part.get("sample_ranges"), "sums_sha256": digest})
    return parts


def merge_statistics(items: list[tuple[str, CalibrationStatistics]], created: str) -> CalibrationStatistics:
    """Sum statistics of disjoint sample ranges (in the given order). items: (name for messages, statistics).

    Refuses different models, configs, data or tool versions, overlapping samples, and different held-out
    captures, naming the field. The result keeps the held-out capture (identical in every input that has one).
    """
    if len(items) < 2:
        raise InputError("stats merge: expected at least two statistics files")
    first_name, first = items[0]
    for name, other in items[1:]:
        check_same_identity(first.provenance, other.provenance, first_name, name, "merge statistics")
        if sorted(other.stats) != sorted(first.stats):
            raise InputError(f"cannot merge statistics: field 'layer_ids' differs ({first_name}: {sorted(first.stats)}; "
                             f"{name}: {sorted(other.stats)})")
    try:
        ranges = normalise_ranges([r for _, s in items for r in s.provenance.sample_ranges])
    except ValueError as exc:
        raise InputError(f"cannot merge statistics: field 'sample_ranges': {exc} (each sample may be summed once)") from exc
    parts = _merge_parts(items)
    holdout, holdout_name = {}, None
    for name, s in items:
        if not s.holdout:
            continue
        if not holdout:
            holdout, holdout_name = s.holdout, name
            continue
        for layer, rows in s.holdout.items():
            if not all(torch.equal(a, b) for a, b in zip(rows.stacked(), holdout[layer].stacked())):
                raise InputError(f"cannot merge statistics: the held-out capture of layer {layer} differs "
                                 f"({holdout_name} vs {name})")
    stats = {layer: LayerStats(*(getattr(first.stats[layer], n).clone() for n in _SUM_TENSORS),
                               query_count=first.stats[layer].query_count, token_count=first.stats[layer].token_count)
             for layer in first.stats}
    for _, other in items[1:]:
        for layer in stats:
            stats[layer].merge_(other.stats[layer])
    provenance = replace(first.provenance, sample_ranges=ranges, created_at=created, parts=parts)
    o_weights = next((s.o_weights for _, s in items if s.o_weights), None)
    return CalibrationStatistics(stats, holdout, first.scaling, provenance, o_weights=o_weights)
