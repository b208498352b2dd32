"""Contract v2: the writer, v1 compatibility, every bound the loader checks (naming the field), the container
checks made before any tensor is read, the one metadata clock, and the model-identity rule."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
import torch
from format_helpers import PAPER, restamp
from safetensors.torch import save_file
from tiny_models import tiny_config

from runtime_kernels.artifact import (
    ARTIFACT_FILENAME,
    ArtifactError,
    ModelMismatchError,
    OscarArtifact,
    canonical_safetensors_bytes,
    check_against_model,
    identity_artifact,
    read_artifact,
    read_raw,
    write_artifact,
)
from runtime_kernels.container import MAX_HEADER_BYTES
from runtime_kernels.contract import V1_TENSOR_NAMES, build_metadata, created_at
from runtime_kernels.format import DEFAULT_FORMAT, KVFormat
from runtime_kernels.loader import load_artifact

D, H, A = 16, 2, 2


def orthogonal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, D, D, generator=g, dtype=torch.float64))[0].float()


def v2_artifact(**meta) -> OscarArtifact:
    """A per-head artifact with random rotations, centring means and a Lloyd-Max key codebook."""
    art = identity_artifact(A, H, 4, D, model_id="tiny/m", fmt=PAPER)
    art.k_rotation = orthogonal(A * H, 1).view(A, H, D, D).contiguous()
    art.v_rotation = orthogonal(A * H, 2).view(A, H, D, D).contiguous()
    g = torch.Generator().manual_seed(3)
    art.k_mean = torch.randn(A, H, D, generator=g)
    art.v_mean = torch.randn(A, H, D, generator=g)
    art.k_codebook = torch.tensor([0.0, 0.9, 2.1, 3.0]).expand(A, H, 4).contiguous()
    return restamp(art, **{"quantizer": "lloyd_max", "scale_dtype": "bfloat16", **meta})  # lloyd_max: no record


def write_raw(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write a file without our writer's checks (the way a hostile or older tool would)."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / ARTIFACT_FILENAME), metadata=metadata)
    return path


def v1_file(path: Path) -> Path:
    """A contract-v1 file exactly as the v1 writer produced it: 7 tensors, no v2 metadata."""
    art = identity_artifact(A, H, 4, D, model_id="tiny/m", fmt=PAPER)
    meta = {k: v for k, v in art.metadata.items() if k not in ("mean_basis", "quantizer", "scale_dtype", "kv_format")}
    meta["schema_version"] = "1"
    return write_raw(path, {n: getattr(art, n) for n in V1_TENSOR_NAMES}, meta)


# --- v2 round trip and v1 compatibility ----------------------------------------------------------
def test_v2_round_trip_keeps_means_codebook_windows_and_dtypes(tmp_path):
    art = v2_artifact(sink_tokens="128", recent_tokens="2048")
    back = read_artifact(write_artifact(art, tmp_path))
    for name in ("k_mean", "v_mean", "k_codebook", "k_rotation"):
        assert torch.equal(getattr(back, name), getattr(art, name))
    assert back.v_codebook is None and torch.equal(back.codebook("v")[0, 0], torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert (back.metadata["sink_tokens"], back.metadata["recent_tokens"], back.group_size) == ("128", "2048", D)
    assert (back.quantizer, back.scale_dtype, back.scale_bits, back.schema_version) == (
        "lloyd_max", torch.bfloat16, 16, 2)
    with pytest.raises(ArtifactError, match="field 'quantizer'.*no KV format this runtime serves"):
        _ = back.kv_format  # read by the contract, not served


def test_v1_artifact_loads_with_v1_defaults_and_is_rewritten_as_v2(tmp_path):
    art = read_artifact(v1_file(tmp_path / "v1"))
    assert art.schema_version == 1 and art.k_mean is None
    assert not art.key_mean("rotated").any() and art.value_mean("original").shape == (A, H, D)
    # v1's own explicit format: the windows its metadata names, fp16 scales, min-max, uncentered, 64-token pages
    assert art.kv_format == KVFormat(sink_tokens=64, recent_tokens=256, page_size=64, group_size=D,
                                     scale_format="float16", quantizer="uniform_minmax", centered=False)
    assert (art.quantizer, art.scale_dtype, art.mean_basis) == ("uniform_minmax", torch.float16, "original")
    again = read_artifact(write_artifact(art, tmp_path / "v2"))
    assert again.schema_version == 2 and torch.equal(again.k_mean, torch.zeros(A, H, D))
    assert again.metadata["quantizer"] == "uniform_minmax" and again.metadata["scale_dtype"] == "float16"
    assert again.kv_format == art.kv_format and "kv_format" in again.metadata  # written out as the record


def test_mean_basis_conversion_uses_the_rotation_both_ways():
    art = v2_artifact()
    rotated = art.key_mean("rotated")
    for a in range(A):
        for h in range(H):  # row vectors: mu_rot = mu @ R
            want = art.k_mean[a, h].double() @ art.k_rotation[a, h].double()
            torch.testing.assert_close(rotated[a, h], want.float(), atol=1e-6, rtol=0)
    stored_rotated = v2_artifact(mean_basis="rotated")
    stored_rotated.k_mean = rotated
    torch.testing.assert_close(stored_rotated.key_mean("original"), art.k_mean, atol=1e-5, rtol=0)
    assert stored_rotated.k_mean_rotated() is stored_rotated.k_mean
    with pytest.raises(ValueError, match="basis"):
        art.key_mean("eigen")


# --- refusals naming the field --------------------------------------------------------------------
def _refused(tmp_path: Path, tensors: dict, meta: dict, field: str, *expected: str) -> None:
    write_raw(tmp_path, tensors, meta)
    with pytest.raises(ArtifactError, match=f"field '{field}'") as info:
        read_artifact(tmp_path)
    for text in expected:
        assert text in str(info.value)


@pytest.mark.parametrize("key, value, expected", [
    ("schema_version", "3", "expected one of [1, 2]"),
    ("schema_version", "02", "got '02'"),
    ("schema_version", "2.0", "expected one of [1, 2]"),
    ("sink_tokens", "-1", "[0, 1048576]"),
    ("recent_tokens", str(10 ** 14), "got '100000000000000'"),  # too many digits: refused before int()
    ("recent_tokens", "2000000", "[0, 1048576], got 2000000"),
    ("recent_tokens", "1_000", "decimal integer"),
    ("head_dim", "9" * 5000, "decimal integer"),
    ("quantizer", "kmeans", "['uniform_minmax', 'uniform_unbiased', 'lloyd_max']"),
    ("scale_dtype", "float8", "['float16', 'bfloat16', 'float32', 'ue5m3']"),
    ("mean_basis", "eigen", "['original', 'rotated']"),
    ("calibration", '{"seed": 1, "seed": 2}', "duplicate key"),
    ("calibration", '{"x": NaN}', "NaN"),
    ("bits", "4", "expected '2'"),
    ("model_id", "", "1 to 1024 characters, got 0"),
    ("model_id", "org/model\x1b[2J", "control characters"),  # a terminal escape never reaches a message raw
    ("model_id", "a" * 1025, "got 1025 characters"),
    ("model_revision", "main\nrevision: forged", "control characters"),
])
def test_metadata_out_of_contract_is_refused(tmp_path, key, value, expected):
    art = v2_artifact()
    _refused(tmp_path, art.tensors(), {**art.metadata, key: value}, key, expected)


def test_v1_file_with_a_v2_field_and_missing_v2_fields_are_refused(tmp_path):
    art = v2_artifact()
    _refused(tmp_path / "a", art.tensors(), {k: v for k, v in art.metadata.items() if k != "scale_dtype"},
             "scale_dtype", "missing", "contract v2")
    meta = {**identity_artifact(A, H, 4, D, fmt=PAPER).metadata, "schema_version": "1"}
    v1 = {n: getattr(art, n) for n in V1_TENSOR_NAMES}
    _refused(tmp_path / "b", v1, meta, "mean_basis", "v2 field")


@pytest.mark.parametrize("name, value, expected", [
    ("k_clip_ratio", torch.full((A, H), 1e-30), "[0.5, 1.0]"),
    ("v_clip_ratio", torch.full((A, H), 0.4), "got 0.4"),
    ("k_clip_ratio", torch.full((A, H), 1.01), "[0.5, 1.0]"),
    ("k_mean", torch.full((A, H, D), float("nan")), "NaN"),
    ("v_mean", torch.full((A, H, D), 1e30), "|mean|"),
    ("k_codebook", torch.tensor([0.0, 2.0, 1.0, 3.0]).expand(A, H, 4), "strictly increasing"),
    ("k_codebook", torch.tensor([0.0, 1.0, 1.0, 3.0]).expand(A, H, 4), "strictly increasing"),
    ("k_codebook", torch.tensor([-0.5, 1.0, 2.0, 3.0]).expand(A, H, 4), "[0, 3]"),
    ("k_codebook", torch.tensor([0.0, 1.0, 2.0, float("inf")]).expand(A, H, 4), "NaN or Inf"),
    ("k_mean", torch.zeros(A, H, D, dtype=torch.float64), "expected float32"),
    ("v_mean", torch.zeros(A, H, D + 1), f"expected shape [{A}, {H}, {D}]"),
    ("k_codebook", torch.zeros(A, H, 5), f"expected shape [{A}, {H}, 4]"),
    ("layer_ids", torch.tensor([1, 0]), "strictly increasing"),
])
def test_tensor_values_out_of_contract_are_refused(tmp_path, name, value, expected):
    art = v2_artifact()
    _refused(tmp_path, {**art.tensors(), name: value}, art.metadata, name, expected)


def test_codebook_and_quantizer_must_agree(tmp_path):
    art = v2_artifact(quantizer="uniform_minmax")
    _refused(tmp_path / "a", art.tensors(), art.metadata, "k_codebook", "needs quantizer 'lloyd_max'")
    art = v2_artifact()
    tensors = {k: v for k, v in art.tensors().items() if k != "k_codebook"}
    _refused(tmp_path / "b", tensors, art.metadata, "quantizer", "needs at least one")
    _refused(tmp_path / "c", {**art.tensors(), "junk": torch.zeros(1)}, art.metadata, "junk", "unexpected tensor")
    _refused(tmp_path / "d", {k: v for k, v in art.tensors().items() if k != "v_mean"}, art.metadata, "v_mean",
             "missing tensor")


def test_shapes_are_checked_from_the_header_before_any_data_is_read(tmp_path, monkeypatch):
    art = v2_artifact()
    write_raw(tmp_path, {**art.tensors(), "k_rotation": torch.zeros(A, H, D, D + 1)}, art.metadata)
    import runtime_kernels.artifact as artifact_module

    def no_read(file):
        raise AssertionError("tensor data was read before the header was checked")

    monkeypatch.setattr(artifact_module, "_load_tensors", no_read)
    with pytest.raises(ArtifactError, match=r"field 'k_rotation': expected shape \[2, 2, 16, 16\]"):
        read_artifact(tmp_path)


# --- the container ---------------------------------------------------------------------------------
def _good_bytes(tmp_path: Path) -> bytes:
    return (write_artifact(v2_artifact(), tmp_path / "good")).read_bytes()


def _file_with_header(tmp_path: Path, header: bytes, data: bytes = b"") -> Path:
    path = tmp_path / "bad"
    path.mkdir(exist_ok=True)
    (path / ARTIFACT_FILENAME).write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_huge_header_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "huge"
    path.mkdir()
    with open(path / ARTIFACT_FILENAME, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(MAX_HEADER_BYTES + 64)  # sparse: the header is never read, so nothing is allocated
    with pytest.raises(ArtifactError, match=f"expected at most {MAX_HEADER_BYTES}"):
        read_artifact(path)
    short = tmp_path / "short"
    short.mkdir()
    (short / ARTIFACT_FILENAME).write_bytes(struct.pack("<Q", 500) + b"{}")
    with pytest.raises(ArtifactError, match="runs past the end"):
        read_artifact(short)
    (short / ARTIFACT_FILENAME).write_bytes(b"\x01\x00")
    with pytest.raises(ArtifactError, match="too short"):
        read_artifact(short)


def test_tens_of_thousands_of_junk_tensors_are_refused_in_milliseconds(tmp_path):
    entries = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(20000)}
    header = json.dumps(entries).encode()[:MAX_HEADER_BYTES - 1]
    path = _file_with_header(tmp_path, header)
    start = time.perf_counter()
    with pytest.raises(ArtifactError, match="more than 16 tensors"):
        read_artifact(path)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.05, f"refusal took {elapsed * 1e3:.1f} ms"  # measured ~1 ms on the shared CPU
    escaped = {f"t{i}": {"dtype": "F32", "shape": [0], "data\\u005foffsets": [0, 0]} for i in range(40)}
    with pytest.raises(ArtifactError, match="<header>"):  # the raw count is only the fast path
        read_artifact(_file_with_header(tmp_path, json.dumps(escaped).encode().replace(b"\\\\", b"\\")))


def test_duplicate_keys_in_header_and_metadata_are_refused(tmp_path):
    good = _good_bytes(tmp_path)
    n = struct.unpack("<Q", good[:8])[0]
    header = good[8:8 + n].rstrip()
    dup_meta = header.replace(b'"bits":"2"', b'"bits":"2","bits":"2"')
    assert dup_meta != header
    with pytest.raises(ArtifactError, match="duplicate key 'bits'"):
        read_artifact(_file_with_header(tmp_path, dup_meta, good[8 + n:]))
    name = b'"layer_ids":'
    start = header.index(name)
    entry = header[start:header.index(b"}", start) + 1]
    dup_tensor = header.replace(entry, entry + b"," + entry)
    with pytest.raises(ArtifactError, match="duplicate key 'layer_ids'"):
        read_artifact(_file_with_header(tmp_path, dup_tensor, good[8 + n:]))


@pytest.mark.parametrize("mutate, expected", [
    (lambda h: h.update(x={"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}), "do not hold"),
    (lambda h: h.update(x={"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}), "unknown dtype"),
    (lambda h: h.update(x={"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}), "non-negative"),
    (lambda h: h.update(x={"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}), "non-negative"),
    (lambda h: h.update(x={"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}), "exactly"),
    (lambda h: h.update(x={"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 4]}), "elements"),
    (lambda h: h.update(__metadata__={"a": 1}), "string values"),
    (lambda h: h.update(x={"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}), "expected 0"),
])
def test_malformed_header_entries_are_refused(tmp_path, mutate, expected):
    header: dict = {}
    mutate(header)
    with pytest.raises(ArtifactError, match=expected):
        read_raw(_file_with_header(tmp_path, json.dumps(header).encode(), b"\0" * 8))


def test_trailing_bytes_after_the_tensors_are_refused(tmp_path):
    good = _good_bytes(tmp_path)
    (tmp_path / "good" / ARTIFACT_FILENAME).write_bytes(good + b"\0" * 8)
    with pytest.raises(ArtifactError, match="field '<data>'"):
        read_artifact(tmp_path / "good")


# --- one clock, one builder ------------------------------------------------------------------------
def test_metadata_clock_honours_source_date_epoch_and_refuses_garbage(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert created_at() == "2023-11-14T22:13:20Z"
    first = write_artifact(identity_artifact(A, H, 4, D, fmt=PAPER), tmp_path / "a").read_bytes()
    assert write_artifact(identity_artifact(A, H, 4, D, fmt=PAPER), tmp_path / "b").read_bytes() == first
    meta = build_metadata(model_id="m", model_revision="r", num_attention_heads=4, num_key_value_heads=2, head_dim=D,
                          granularity="head", key_target="k", value_target="v", calibration={"b": 1, "a": 2},
                          tool_version="t", fmt=DEFAULT_FORMAT.with_(centered=False))
    assert (meta["created_at"], meta["sink_tokens"], meta["group_size"]) == ("2023-11-14T22:13:20Z", "128", str(D))
    assert meta["calibration"] == '{"a": 2, "b": 1}'
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(ValueError, match="SOURCE_DATE_EPOCH"):
        created_at()


def test_canonical_bytes_do_not_depend_on_metadata_order():
    art = v2_artifact()
    reordered = dict(reversed(list(art.metadata.items())))
    assert canonical_safetensors_bytes(art.tensors(), art.metadata) == canonical_safetensors_bytes(art.tensors(),
                                                                                                  reordered)


# --- model identity ----------------------------------------------------------------------------------
def _config(name: str = ""):
    cfg = tiny_config("qwen3", num_heads=4, num_kv_heads=H, head_dim=D, num_layers=A)
    cfg._name_or_path = name
    return cfg


def test_identity_rule_in_check_against_model(tmp_path):
    art = identity_artifact(A, H, 4, D, model_id="org/model-a", fmt=PAPER)
    check_against_model(art, _config("org/model-a"))
    check_against_model(art, _config(""))  # a config built in memory has no identity: shapes only
    with pytest.raises(ModelMismatchError, match="calibrated for 'org/model-a', the model is 'org/model-b'.*"
                                                 "allow_other_model"):
        check_against_model(art, _config("org/model-b"))
    check_against_model(art, _config("org/model-b"), allow_other_model=True)
    with pytest.raises(ModelMismatchError, match="model_id"):
        check_against_model(art, _config(""), model_id="org/model-b")
    with pytest.raises(ModelMismatchError, match="num_key_value_heads"):  # the override never waives shapes
        check_against_model(art, tiny_config("qwen3", num_heads=4, num_kv_heads=1, head_dim=D, num_layers=A),
                            allow_other_model=True)
    snapshot = tmp_path / "hub" / "models--org--model-a" / "snapshots" / ("a" * 40)
    check_against_model(art, _config(str(snapshot)))  # the Hub cache's copy of that id
    local = tmp_path / "model-dir"
    local.mkdir()
    by_path = identity_artifact(A, H, 4, D, model_id=str(local), fmt=PAPER)
    check_against_model(by_path, _config(str(tmp_path / "." / "model-dir")))  # the same directory, spelled otherwise


def test_identity_rule_in_load_artifact_and_oscar_cache(tmp_path):
    from runtime_kernels.hf import OscarCache

    write_artifact(identity_artifact(A, H, 4, D, model_id="org/model-a", fmt=PAPER), tmp_path)
    other = _config("org/model-b")
    with pytest.raises(ModelMismatchError, match="model_id"):
        load_artifact(tmp_path, model_config=other)
    art = load_artifact(tmp_path, model_config=other, allow_other_model=True)
    with pytest.raises(ModelMismatchError, match="model_id"):
        OscarCache.from_artifact(tmp_path, other)
    assert OscarCache.from_artifact(art, other, allow_other_model=True).artifact is art


def test_eval_cli_refuses_an_artifact_for_another_model(tmp_path, monkeypatch, capsys):
    import sys

    from oscar_calib.cli import main
    from oscar_calib.demo import FIXTURE_DIR

    write_artifact(identity_artifact(4, 2, 4, 128, model_id="org/other", fmt=PAPER), tmp_path / "art")  # the fixture's shapes
    monkeypatch.setattr(sys, "argv", ["oscar-calib", "eval", "--model", str(FIXTURE_DIR), "--artifact",
                                      str(tmp_path / "art"), "--context", "64", "--device", "cpu"])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    assert info.value.code == 2 and "field 'model_id'" in err and "--allow-other-model" in err


def test_v2_artifact_built_in_memory_without_means_gets_zero_means(tmp_path):
    art = identity_artifact(A, H, 4, D, fmt=PAPER)
    art.k_mean = art.v_mean = None  # code written before v2 builds artifacts without them
    back = read_artifact(write_artifact(art.validate(), tmp_path))
    assert torch.equal(back.k_mean, torch.zeros(A, H, D)) and not back.is_centered


def test_calibration_writes_contract_v2_through_the_one_builder(monkeypatch):
    from tiny_models import tiny_model

    from oscar_calib.calibration.calibrate import calibrate_model
    from oscar_calib.config import SolverSettings
    from runtime_kernels.contract import V2_METADATA

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    model = tiny_model("qwen3", head_dim=D, num_layers=2, vocab_size=64)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    art = calibrate_model(model, ids, SolverSettings(kv_format={"sink_tokens": 4, "recent_tokens": 8}, k_clip_grid=(1.0,),
                                                     v_clip_grid=(1.0,)), compare_alternatives=False,
                          holdout_queries=8)
    assert art.schema_version == 2
    assert set(art.metadata) == set(V2_METADATA) | {"kv_format"}
    assert art.kv_format == DEFAULT_FORMAT.with_(sink_tokens=4, recent_tokens=8, group_size=D)
    assert art.metadata["created_at"] == "2023-11-14T22:13:20Z"
    assert art.is_centered and art.mean_basis == "original"  # the default recipe centers keys and values


def test_release_record_with_a_duplicate_key_is_refused():
    from runtime_kernels.loader import parse_release_record

    good = ('{"format": "oscar-kv-release", "schema_version": 1, "model_id": "a/b", "model_revision": "r", '
            '"calibration": "default", "version": "v1", "files": {"oscar_kv.safetensors": '
            '{"sha256": "' + "a" * 64 + '", "size": 1}}')
    assert parse_release_record((good + "}").encode(), "release.json")["version"] == "v1"
    with pytest.raises(ArtifactError, match="duplicate key 'version'"):
        parse_release_record((good + ', "version": "v9"}').encode(), "release.json")
    with pytest.raises(ArtifactError, match="release.json"):
        parse_release_record(b'{"schema_version": ' + b"9" * 5000 + b"}", "release.json")


def test_calibrate_does_not_import_the_job_and_the_loaders_have_a_public_home():
    import ast

    import oscar_calib.calibration.calibrate as calibrate
    import oscar_calib.calibration.job as job
    import oscar_calib.loading as loading

    tree = ast.parse(Path(calibrate.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "oscar_calib.calibration.job" not in imported and not hasattr(calibrate, "run_calibration")  # no import circle
    assert job._load_model is loading.load_model and job._load_tokenizer is loading.load_tokenizer


def test_in_memory_artifact_with_a_bad_schema_version_is_refused_by_name():
    art = identity_artifact(A, H, 4, D, fmt=PAPER)
    art.metadata["schema_version"] = "two"
    with pytest.raises(ArtifactError, match="field 'schema_version'.*got 'two'"):
        art.validate()
