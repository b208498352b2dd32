"""Property-based fuzzing on a fixed budget: the artifact loader, the release record, the reference
importer and the manifest parser raise only their documented errors, whatever the input.

Documented errors: ArtifactError (artifact, release record), ReferenceFormatError (reference files),
ManifestError (manifest). Anything else escaping (KeyError, TypeError, RecursionError, ...) is a bug.
"""

from __future__ import annotations

import io
import json
import struct
import tempfile
from pathlib import Path

import torch
from format_helpers import PAPER, restamp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from oscar_calib.zoo.manifest import ManifestError, parse_manifest
from oscar_calib.zoo.reference_format import ReferenceFormatError, load_reference, validate_reference
from runtime_kernels.artifact import (
    ARTIFACT_FILENAME,
    ArtifactError,
    identity_artifact,
    read_artifact,
    write_artifact,
)
from runtime_kernels.loader import load_artifact, parse_release_record

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_TMP = tempfile.TemporaryDirectory(prefix="oscar-fuzz-")
_VALID_DIR = Path(_TMP.name) / "valid"
write_artifact(identity_artifact(2, 2, 4, 16, model_id="tiny/m", fmt=PAPER), _VALID_DIR)
VALID_BYTES = (_VALID_DIR / ARTIFACT_FILENAME).read_bytes()


def _mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    buf = bytearray(data)
    for pos, value in edits:
        buf[pos % len(buf)] = value
    return bytes(buf[:cut]) if cut is not None else bytes(buf)


def _read_file(data: bytes) -> None:
    with tempfile.TemporaryDirectory(dir=_TMP.name) as d:
        path = Path(d) / ARTIFACT_FILENAME
        path.write_bytes(data)
        try:
            read_artifact(path)
            load_artifact(d)
        except ArtifactError:
            pass


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6),
       cut=st.one_of(st.none(), st.integers(0, len(VALID_BYTES))))
def test_artifact_loader_on_mutated_files(edits, cut):
    _read_file(_mutate(VALID_BYTES, edits, cut))


_META_KEYS = ["format", "schema_version", "model_id", "num_attention_heads", "num_key_value_heads", "head_dim",
              "bits", "group_size", "granularity", "calibration", "sink_tokens", "kv_format"]


@FUZZ
@given(meta=st.dictionaries(st.sampled_from(_META_KEYS), st.text(max_size=12), max_size=6),
       drop=st.lists(st.sampled_from(["layer_ids", "k_rotation", "v_clip_ratio"]), max_size=2),
       shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.int64, torch.int8]),
       scale=st.sampled_from([1.0, -1.0, 0.0, float("nan"), float("inf"), 1e30]))
def test_artifact_loader_on_wrong_contents(meta, drop, shape, dtype, scale):
    art = identity_artifact(2, 2, 4, 16, model_id="tiny/m", fmt=PAPER)
    tensors = {k: v.clone() for k, v in art.tensors().items()}
    for name in drop:
        tensors.pop(name, None)
    tensors["k_clip_ratio"] = (torch.ones(shape) * scale).to(dtype) if shape else tensors["k_clip_ratio"] * scale
    metadata = {**art.metadata, **meta}
    buf = Path(_TMP.name) / "contents.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(buf), metadata=metadata)
    _read_file(buf.read_bytes())


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=12)


@FUZZ
@given(patch=st.dictionaries(st.sampled_from(["format", "schema_version", "model_id", "calibration", "version", "files",
                                              "model_revision", "other"]), _JSON, max_size=3),
       raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_release_record_parser(patch, raw):
    good = {"format": "oscar-kv-release", "schema_version": 1, "model_id": "a/b", "model_revision": "r",
            "calibration": "default", "version": "v1", "files": {ARTIFACT_FILENAME: {"sha256": "a" * 64, "size": 1}}}
    data = raw if raw is not None else json.dumps({**good, **patch}).encode()
    try:
        parse_release_record(data, "release.json")
    except ArtifactError:
        pass


_TENSORS = st.builds(lambda shape, dtype: torch.zeros(shape, dtype=dtype),
                     st.lists(st.integers(0, 4), max_size=3), st.sampled_from([torch.float32, torch.int64, torch.bool]))
_PLAIN = st.recursive(st.none() | st.integers() | st.floats() | st.text(max_size=6) | _TENSORS,
                      lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                      | st.dictionaries(st.one_of(st.integers(-2, 40), st.text(max_size=6)), inner, max_size=3),
                      max_leaves=10)


@FUZZ
@given(obj=_PLAIN, layers=st.dictionaries(st.integers(-1, 3), _PLAIN, max_size=3))
def test_reference_validator_on_arbitrary_structures(obj, layers):
    for candidate in (obj, {"format_version": 1, "objective": "x", "layers": layers}):
        try:
            validate_reference(candidate, "ref.pt")
        except ReferenceFormatError:
            pass


def _reference_bytes() -> bytes:
    buf = io.BytesIO()
    rot = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64))[0].float()
    torch.save({"format_version": 1, "objective": "q", "layers": {0: {"rotation": rot, "eigenvalues": torch.ones(8)}}},
               buf)
    return buf.getvalue()


REFERENCE_BYTES = _reference_bytes()


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6),
       cut=st.one_of(st.none(), st.integers(0, len(REFERENCE_BYTES))))
def test_reference_importer_on_mutated_files(edits, cut):
    path = Path(_TMP.name) / "ref.pt"
    path.write_bytes(_mutate(REFERENCE_BYTES, edits, cut))
    try:
        load_reference(path)
    except ReferenceFormatError:
        pass


MANIFEST = f"""schema_version: 1
repo: org/zoo
recipes:
  - model_id: Qwen/Qwen3-8B
    model_revision: "{'c' * 40}"
    data: {{dataset: calib.txt, samples: 4}}
releases:
  - model_id: Qwen/Qwen3-8B
    model_revision: "{'c' * 40}"
    repo: org/zoo
    version: v1
    commit: "{'d' * 40}"
    files:
      - {{name: oscar_kv.safetensors, sha256: "{'e' * 64}", size: 10}}
      - {{name: release.json, sha256: "{'f' * 64}", size: 5}}
"""


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 2000), st.sampled_from(list(":-[]{}!&*?|>'\"#%@`\n\t ,0aZ\x00\x85\u2028"))),
                      max_size=5))
def test_manifest_parser_on_mutated_text(edits):
    text = list(MANIFEST)
    for pos, ch in edits:
        text[pos % len(text)] = ch
    try:
        parse_manifest("".join(text))
    except ManifestError:
        pass


@FUZZ
@given(text=st.text(max_size=300))
def test_manifest_parser_on_arbitrary_text(text):
    try:
        parse_manifest(text)
    except ManifestError:
        pass


def test_manifest_parser_on_deep_nesting():
    for text in ("[" * 5000 + "]" * 5000, "a:\n" + "".join(" " * i + "b:\n" for i in range(1, 400))):
        try:
            parse_manifest(text)
        except ManifestError:
            pass


# --- the bounded container reader and the strict JSON parser (runtime_kernels.container / .contract) ---
_ENTRY = st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "I64", "F16", "Q4", 3]),
                                "shape": st.one_of(st.lists(st.integers(-2, 6), max_size=4), _JSON),
                                "data_offsets": st.one_of(st.lists(st.integers(-4, 200), min_size=2, max_size=2),
                                                          _JSON)})
_HEADER = st.dictionaries(st.one_of(st.sampled_from(["layer_ids", "k_mean", "__metadata__"]), st.text(max_size=6)),
                          st.one_of(_ENTRY, _JSON), max_size=5)


@FUZZ
@given(header=_HEADER, data_len=st.integers(0, 256))
def test_container_header_parser_on_arbitrary_headers(header, data_len):
    from runtime_kernels.container import parse_header

    raw = json.dumps(header).encode()
    try:
        parsed = parse_header(raw, 8 + len(raw) + data_len, "x.safetensors")
    except ArtifactError:
        return
    position = 0  # whatever is accepted tiles the data section exactly
    for entry in sorted(parsed.tensors.values(), key=lambda e: e.begin):
        assert entry.begin == position
        position = entry.end
    assert position == data_len


@FUZZ
@given(pairs=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), _JSON), min_size=1, max_size=5),
       junk=st.binary(max_size=32))
def test_strict_json_refuses_every_duplicate_key_and_only_raises_artifact_error(pairs, junk):
    from runtime_kernels.contract import strict_json_loads

    text = "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs) + "}"
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        try:
            strict_json_loads(text, "f", "calibration")
            raise AssertionError(f"duplicate keys accepted: {text}")
        except ArtifactError as exc:
            assert "field 'calibration'" in str(exc)
    else:
        assert strict_json_loads(text, "f", "calibration") == dict(pairs)
    try:
        strict_json_loads(junk, "f", "calibration")
    except ArtifactError:
        pass


_V2_BYTES = None


def _v2_bytes() -> bytes:
    global _V2_BYTES
    if _V2_BYTES is None:
        art = identity_artifact(2, 2, 4, 16, model_id="tiny/m", fmt=PAPER)
        restamp(art, quantizer="lloyd_max")  # a codebook artifact: no kv_format record
        art.k_codebook = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(2, 2, 4).contiguous()
        _V2_BYTES = write_artifact(art, Path(_TMP.name) / "v2").read_bytes()
    return _V2_BYTES


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)), min_size=1, max_size=4))
def test_artifact_loader_on_mutated_headers(edits):
    data = _v2_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    buf = bytearray(data)
    for pos, value in edits:  # mutate inside the JSON header only, where the container checks live
        buf[8 + pos % n] = value
    _read_file(bytes(buf))


# --- GGUF headers (oscar_calib.gguf_check): a damaged or forged header is an InputError, never anything else ---
_GGUF_BYTES = None


def _gguf_bytes() -> bytes:
    global _GGUF_BYTES
    if _GGUF_BYTES is None:
        from gguf_helpers import write_tiny_gguf

        _GGUF_BYTES = write_tiny_gguf(Path(_TMP.name) / "tiny.gguf").read_bytes()
    return _GGUF_BYTES


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 6000), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 8000)))
def test_gguf_check_on_mutated_headers(edits, cut):
    import pytest

    pytest.importorskip("gguf")
    from oscar_calib.errors import InputError
    from oscar_calib.gguf_check import check_gguf

    path = Path(_TMP.name) / "mutated.gguf"
    path.write_bytes(_mutate(_gguf_bytes(), edits, cut))  # the metadata and tensor infos fill the first ~6 KB
    try:
        check_gguf(path)
    except InputError as exc:
        assert "\n" not in str(exc)


# --- issue 54: JSON of the wrong type in every metadata field of statistics, checkpoints and artifacts --------------
def _synthetic_statistics():
    """A small valid statistics object (2 layers, H_q 4, H_kv 2, d 8; 2 samples of 4 tokens) without a model."""
    from oscar_calib.calibration.capture import HoldoutRows
    from oscar_calib.calibration.stats import LayerStats
    from oscar_calib.calibration.stats_checks import sample_digests
    from oscar_calib.calibration.stats_file import CalibrationStatistics, StatsProvenance

    gen = torch.Generator().manual_seed(0)
    h_q, h_kv, d, tokens = 4, 2, 8, 8

    def moment(n):
        x = torch.randn(h_kv, n, d, generator=gen, dtype=torch.float64)
        return x.transpose(1, 2) @ x

    stats = {layer: LayerStats(moment(16), moment(16), moment(8), torch.ones(h_kv, dtype=torch.float64) * 8,
                               torch.randn(h_kv, d, generator=gen, dtype=torch.float64),
                               torch.randn(h_kv, d, generator=gen, dtype=torch.float64),
                               query_count=tokens * h_q // h_kv, token_count=tokens) for layer in (0, 1)}
    holdout = {layer: HoldoutRows([torch.randn(1, h_kv, 8, d, generator=gen)], [torch.randn(1, h_kv, 8, d, generator=gen)],
                                  [torch.randn(1, h_q, 2, d, generator=gen) * 1.4], [torch.tensor([[5, 7]])])
               for layer in (0, 1)}
    prov = StatsProvenance(model_id="org/m", model_revision="r", model_config_hash="c" * 64,
                           geometry={"num_hidden_layers": 2, "num_attention_heads": h_q, "num_key_value_heads": h_kv,
                                     "head_dim": d},
                           data={"samples": 2, "seq_len": 4}, capture={"dtype": "float32"}, sample_ranges=[[0, 2]],
                           sample_digests=sample_digests(torch.arange(8).reshape(2, 4)))
    return CalibrationStatistics(stats, holdout, d ** -0.5, prov)


_STATS_FIELDS = ["format", "schema_version", "model_id", "model_revision", "model_config_hash", "geometry", "data",
                 "capture", "sample_ranges", "skipped_layers", "created_at", "tool_version", "config_hash", "parts",
                 "sample_digests", "scaling"]
_STATS_BYTES = None


def _stats_bytes() -> bytes:
    global _STATS_BYTES
    if _STATS_BYTES is None:
        from oscar_calib.calibration.stats_file import load_statistics, save_statistics

        path = save_statistics(_synthetic_statistics(), Path(_TMP.name) / "stats.safetensors")
        load_statistics(path)  # the base is valid: every refusal below comes from the edit
        _STATS_BYTES = path.read_bytes()
    return _STATS_BYTES


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


_WRONG_JSON = st.one_of(_JSON.map(json.dumps), st.sampled_from([_deep(100_000), "NaN", "1e999", "9" * 5000, "",
                                                                 '{"a": 1, "a": 2}', "\udcff"]))


@FUZZ
@given(edits=st.dictionaries(st.sampled_from(_STATS_FIELDS), _WRONG_JSON, min_size=1, max_size=3))
def test_statistics_metadata_of_any_json_type(edits):
    """Every metadata field of a statistics file set to JSON of any type: InputError (exit 2), one line."""
    from safetensors import safe_open
    from safetensors.torch import save_file as save

    from oscar_calib.calibration.stats_file import load_statistics
    from oscar_calib.cli.exit_codes import exit_code_for
    from oscar_calib.errors import InputError

    base = Path(_TMP.name) / "stats-base.safetensors"
    base.write_bytes(_stats_bytes())
    with safe_open(str(base), "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        meta = dict(handle.metadata())
    meta.update({k: v.encode("utf-8", "replace").decode() for k, v in edits.items()})
    path = Path(_TMP.name) / "stats-edited.safetensors"
    save(tensors, str(path), metadata=meta)
    try:
        load_statistics(path)
    except InputError as exc:
        assert "\n" not in str(exc) and exit_code_for(exc) == 2


@FUZZ
@given(field=st.sampled_from(["identity", "next_sample", "format"]), value=_WRONG_JSON)
def test_checkpoint_metadata_of_any_json_type(field, value):
    from safetensors.torch import save_file as save

    from oscar_calib.calibration.scale.checkpoint import CHECKPOINT_FILENAME, load_checkpoint, save_checkpoint
    from oscar_calib.errors import InputError

    statistics = _synthetic_statistics()
    identity = {**statistics.provenance.identity(), "sample_range": [0, 2]}
    directory = Path(tempfile.mkdtemp(dir=_TMP.name))
    save_checkpoint(directory, statistics.stats, 2, identity)
    load_checkpoint(directory, identity)  # valid before the edit
    from oscar_calib.calibration.stats_file import read_safetensors

    tensors, meta = read_safetensors(directory / CHECKPOINT_FILENAME, "checkpoint")
    meta[field] = value.encode("utf-8", "replace").decode()
    save(tensors, str(directory / CHECKPOINT_FILENAME), metadata=meta)
    try:
        load_checkpoint(directory, identity)
    except InputError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(field=st.sampled_from(["calibration", "kv_format", "schema_version", "sink_tokens", "head_dim", "model_id",
                              "granularity", "quantizer", "num_key_value_heads"]), value=_WRONG_JSON)
def test_artifact_metadata_of_any_json_type(field, value):
    art = identity_artifact(2, 2, 4, 16, model_id="tiny/m", fmt=PAPER)
    metadata = {**art.metadata, field: value.encode("utf-8", "replace").decode()}
    buf = Path(_TMP.name) / "json-field.safetensors"
    save_file({k: v.contiguous() for k, v in art.tensors().items()}, str(buf), metadata=metadata)
    _read_file(buf.read_bytes())


# --- out-of-range runtime arguments: the cache's decode calls and the serve config -----------------------------------
_ARG = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.integers(-(2**70), 2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3), st.just([0]))


@FUZZ
@given(layer=_ARG, sm_scale=_ARG, seq_ids=st.lists(st.one_of(st.integers(-1, 3), st.booleans()), max_size=3),
       use_plan=st.sampled_from(["own", "stale", "foreign", "none"]))
def test_decode_arguments_raise_only_documented_errors(layer, sm_scale, seq_ids, use_plan):
    from format_helpers import served

    from runtime_kernels.cache import PagedKVCache

    art = identity_artifact(2, 2, 4, 16, model_id="tiny/m", fmt=PAPER)
    cache = PagedKVCache.from_artifact(art, max_pages=8, max_seqs=4, fmt=served(art, 4, 4, 8), dtype=torch.float32,
                                       backend="torch")
    ids = [cache.add_sequence(), cache.add_sequence()]
    prompt = [[torch.ones(6, 2, 16), torch.ones(3, 2, 16)]] * 2
    cache.append(ids, prompt, prompt)
    stale = cache.plan_append(ids, [1, 1])
    for i in range(2):
        cache.write_layer(i, stale, torch.ones(2, 2, 16), torch.ones(2, 2, 16))
    plan = {"own": cache.plan_append(ids, [1, 1]), "stale": stale, "foreign": None, "none": "plan"}[use_plan]
    n = len(seq_ids)
    q, x = torch.ones(n, 4, 16), torch.ones(2, 2, 16)
    try:
        out = cache.decode_step(layer, plan, q, x, x, seq_ids, sm_scale=sm_scale)
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        assert "\n" not in str(exc)
        return
    assert torch.isfinite(out).all()


@FUZZ
@given(raw=st.dictionaries(st.sampled_from(["path", "repo", "revision", "commit", "expected_sha256", "allow_unpinned",
                                            "repo_type", "model_id", "calibration", "allow_other_model",
                                            "kernel_backend", "window_reserve", "layers", "other"]), _JSON,
                           max_size=4),
       reserve=st.one_of(st.none(), st.floats(), st.integers(-(2**70), 2**70)))
def test_serve_config_raises_only_value_error(raw, reserve):
    from runtime_kernels.vllm.config import MAX_WINDOW_RESERVE, parse_oscar_config

    entry = {"path": "zoo/demo", **raw}
    if reserve is not None:
        entry["window_reserve"] = reserve
    try:
        cfg = parse_oscar_config({"oscar": entry})
    except ValueError as exc:
        assert "\n" not in str(exc)
        return
    assert 1 <= cfg.window_reserve <= MAX_WINDOW_RESERVE
    assert cfg.layers is None or all(0 <= i <= 4095 for i in cfg.layers)
