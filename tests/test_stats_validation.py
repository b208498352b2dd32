"""Issue 33 class 4: statistics files and merges are validated like artifacts.

Real shard files come from `oscar-calib run --shard`; each hostile file is one of them with one field edited the
way a careless script or a forger would (tensors and metadata rewritten with safetensors). `refit` and
`stats merge` must refuse every one with exit 2, one line naming the field, and write nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from test_scale import EPOCH, SAMPLES, args, model_dir, text_file  # noqa: F401  (module-scoped fixtures)

from oscar_calib.calibration.stats_file import (
    load_statistics,
    merge_statistics,
    read_safetensors,
    save_statistics,
)
from oscar_calib.cli import main
from oscar_calib.errors import InputError


@pytest.fixture(scope="module")
def shards(model_dir, text_file, tmp_path_factory):  # noqa: F811
    """Statistics files of shards 0/2 (samples [0, 2)) and 1/2 ([2, 5)) of one run."""
    root = tmp_path_factory.mktemp("shards")
    for i in range(2):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
            mp.setattr(sys, "argv", ["oscar-calib", *args(model_dir, text_file, root / f"s{i}", "--shard", f"{i}/2")])
            with pytest.raises(SystemExit) as exc:
                main()
        assert exc.value.code == 0
    return [root / f"s{i}" / "oscar_stats.safetensors" for i in range(2)]


def edited(src: Path, dst: Path, tensors=None, meta=None) -> Path:
    """`src` with some tensors (name -> function of the old tensor, or None to drop it) and metadata replaced."""
    old, old_meta = read_safetensors(src, "statistics")
    new = dict(old)
    for name, fn in (tensors or {}).items():
        if fn is None:
            new.pop(name)
        else:
            new[name] = fn(old[name].clone()).contiguous()
    save_file(new, str(dst), metadata={**old_meta, **(meta or {})})
    return dst


def _set(index, value):
    def fn(t):
        t[index] = value
        return t
    return fn


CASES = {
    "NaN scaling": ({}, {"scaling": "nan"}, "scaling"),
    "negative scaling": ({}, {"scaling": "-0.125"}, "scaling"),
    "infinite scaling": ({}, {"scaling": "inf"}, "scaling"),
    "NaN key sum": ({"key_sum": _set((0, 0, 1, 1), float("nan"))}, {}, "key_sum"),
    "Inf value mean sum": ({"value_vec_sum": _set((1, 0, 0), float("inf"))}, {}, "value_vec_sum"),
    "negative second moment": ({"attn_out_sum": _set((0, 1, 3, 3), -5.0)}, {}, "attn_out_sum"),
    "negative logit weight": ({"logit_w_sum": _set((0, 0), -1.0)}, {}, "logit_w_sum"),
    "zero counts": ({"token_count": lambda t: t * 0, "query_count": lambda t: t * 0}, {}, "token_count"),
    "queries not tokens x group": ({"query_count": lambda t: t + 1}, {}, "query_count"),
    "counts of another sample count": ({"token_count": lambda t: t * 2, "query_count": lambda t: t * 2}, {},
                                       "sample_ranges"),
    "relabelled range (count)": ({}, {"sample_ranges": "[[0, 3]]"}, "sample_ranges"),
    "range past the data": ({}, {"sample_ranges": "[[4, 6]]"}, "sample_ranges"),
    "range malformed": ({}, {"sample_ranges": "[[2]]"}, "sample_ranges"),
    "ranges overlapping": ({}, {"sample_ranges": "[[0, 2], [1, 2]]"}, "sample_ranges"),
    "NaN held-out key": ({"holdout_keys": _set((0, 0, 0, 3, 5), float("nan"))}, {}, "holdout_keys"),
    "held-out position outside": ({"holdout_positions": lambda t: t + 10**6}, {}, "holdout_positions"),
    "truncated o_proj": ({"o_proj.0": lambda t: t[:, :-8]}, {}, "o_proj.0"),
    "o_proj of another hidden size": ({"o_proj.1": lambda t: t[:-4]}, {}, "o_proj.1"),
    "NaN o_proj": ({"o_proj.0": _set((0, 0), float("nan"))}, {}, "o_proj.0"),
    # issue 54: values no capture produces, and metadata of the wrong kind
    "indefinite second moment (positive diagonal)": ({"key_sum": lambda t: _indefinite(t)}, {}, "key_sum"),
    "o_proj x 1e30": ({"o_proj.0": lambda t: t * 1e30}, {}, "o_proj.0"),
    "held-out keys x 1e30": ({"holdout_keys": lambda t: t * 1e30}, {}, "holdout_keys"),
    "held-out queries x 1000": ({"holdout_queries": lambda t: t * 1000}, {}, "holdout_queries"),
    "key mean x 1e30": ({"key_vec_sum": lambda t: t * 1e30}, {}, "key_vec_sum"),
    "scaling 1e-300": ({}, {"scaling": "1e-300"}, "scaling"),
    "scaling 1e6": ({}, {"scaling": "1e6"}, "scaling"),
    "parts: []": ({}, {"parts": "[]"}, "parts"),
    "parts of one input": ({}, {"parts": json.dumps([{"sample_ranges": [[0, 2]], "sums_sha256": "a" * 64}])},
                           "parts"),
    "geometry a list": ({}, {"geometry": "[2, 4, 2, 64]"}, "geometry"),
    "geometry heads a string": ({}, {"geometry": json.dumps({"num_hidden_layers": 2, "num_attention_heads": "4",
                                                             "num_key_value_heads": 2, "head_dim": 64})},
                                "geometry.num_attention_heads"),
    "data a string": ({}, {"data": '"x"'}, "data"),
    "sample ranges an object": ({}, {"sample_ranges": '{"a": 1}'}, "sample_ranges"),
    "skipped layers of text": ({}, {"skipped_layers": '["0"]'}, "skipped_layers"),
    "model id with ..": ({}, {"model_id": "../../etc/zoo"}, "model_id"),
    "model id with a quote": ({}, {"model_id": "org/x'); import os #"}, "model_id"),
    "sample digests of another count": ({}, {"sample_digests": json.dumps(["0" * 16])}, "sample_digests"),
    "sample digests not hex": ({}, {"sample_digests": json.dumps(["zz" * 8, "0" * 16])}, "sample_digests"),
}


def _indefinite(t):
    """Add +-c off-diagonal pairs so that one (layer, head) has a negative eigenvalue and a positive diagonal."""
    diag = t[0, 0].diagonal()
    c = 4 * float((diag[0] * diag[1]).sqrt())
    t[0, 0, 0, 1] += c
    t[0, 0, 1, 0] += c
    return t


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_statistics_are_refused_naming_the_field(case, shards, tmp_path, monkeypatch, capsys):
    tensors, meta, field = CASES[case]
    bad = edited(shards[0], tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(InputError, match=f"field '{field}'|tensor '{field}'"):
        load_statistics(bad)
    code, out, err = run_cli(["refit", str(bad), "--out", str(tmp_path / "o"), "--sink", "4", "--recent", "8"],
                             monkeypatch, capsys)
    assert code == 2 and field in err and "Traceback" not in err and out == "", err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
    code, _, err = run_cli(["stats", "merge", str(bad), str(shards[1]), "--out", str(tmp_path / "m.safetensors")],
                           monkeypatch, capsys)
    assert code == 2 and field in err and not (tmp_path / "m.safetensors").exists(), err


def test_the_real_shards_load_and_merge(shards, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(["stats", "merge", *map(str, shards), "--out", str(tmp_path / "m.safetensors")],
                           monkeypatch, capsys)
    assert code == 0, err
    merged = load_statistics(tmp_path / "m.safetensors")
    assert merged.provenance.sample_ranges == [[0, SAMPLES]]
    # The merge records its inputs: each capture's sample ranges and the digest of its sums.
    assert [p["sample_ranges"] for p in merged.provenance.parts] == [[[0, 2]], [[2, 5]]]


def test_a_shard_relabelled_with_another_range_is_not_counted_twice(shards, tmp_path, monkeypatch, capsys):
    # The regression: shard 0's sums, relabelled [3, 5) (same length, so the counts agree), merged with shard 0.
    relabelled = edited(shards[0], tmp_path / "relabelled.safetensors", meta={"sample_ranges": "[[3, 5]]"})
    assert load_statistics(relabelled).provenance.sample_ranges == [[3, 5]]  # alone it is consistent
    code, _, err = run_cli(["stats", "merge", str(shards[0]), str(relabelled), "--out", str(tmp_path / "m.safetensors")],
                           monkeypatch, capsys)
    assert code == 2 and "bit-identical sums" in err and "counted twice" in err, err
    assert not (tmp_path / "m.safetensors").exists()
    # Nor through an earlier merge: the merged file records the digests of its parts.
    merged = merge_statistics([(str(p), load_statistics(p)) for p in shards], "2023-11-14T22:13:20Z")
    save_statistics(merged, tmp_path / "m01.safetensors")
    twice = edited(shards[1], tmp_path / "s1-as-5-8.safetensors", meta={"sample_ranges": "[[5, 8]]",
                                                                         "data": _data_with_samples(shards[1], 8)})
    with pytest.raises(InputError):  # another 'samples' in the data identity is refused first
        merge_statistics([("m01", load_statistics(tmp_path / "m01.safetensors")), ("s1", load_statistics(twice))], "")


def test_a_relabelled_shard_with_perturbed_sums_is_not_counted_twice(shards, tmp_path, monkeypatch, capsys):
    """The issue's case: shard 0 relabelled [3, 5) with its sums moved by one ulp (or scaled) is caught by its samples'
    digests, which no edit of the sums changes."""
    for label, fn in (("one ulp", lambda t: torch.nextafter(t, torch.full_like(t, float("inf")))),
                      ("x 1.01", lambda t: t * 1.01)):
        forged = edited(shards[0], tmp_path / f"forged-{label}.safetensors",
                        {name: fn for name in ("key_sum", "attn_out_sum", "logit_v_sum", "key_vec_sum")},
                        {"sample_ranges": "[[3, 5]]"})
        load_statistics(forged)  # alone it is consistent
        out = tmp_path / "m.safetensors"
        code, _, err = run_cli(["stats", "merge", str(shards[0]), str(forged), "--out", str(out)], monkeypatch, capsys)
        assert code == 2 and "field 'sample_digests': sample 3 of" in err and "counted twice" in err, (label, err)
        assert not out.exists()
    # Dropping the digests does not get it through either: a merge needs them.
    tensors, meta = read_safetensors(forged, "statistics")
    stripped = tmp_path / "stripped.safetensors"
    save_file(tensors, str(stripped), metadata={k: v for k, v in meta.items() if k != "sample_digests"})
    with pytest.raises(InputError, match="field 'sample_digests' is missing"):
        merge_statistics([("s0", load_statistics(shards[0])), ("stripped", load_statistics(stripped))], "")


def test_sample_digests_are_those_of_the_samples_and_merge_in_sample_order(shards):
    """An independent reference: the digests a shard records are the sha256 of its samples' token ids, and the
    merged file's are the shards' in sample order."""
    import hashlib

    from oscar_calib.calibration.stats_checks import sample_digests

    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert sample_digests(ids) == [hashlib.sha256(ids[i].numpy().astype("<i8").tobytes()).hexdigest()[:16]
                                   for i in range(2)]
    a, b = (load_statistics(p) for p in shards)
    assert len(a.provenance.sample_digests) == 2 and len(b.provenance.sample_digests) == 3
    merged = merge_statistics([("b", b), ("a", a)], "")
    assert merged.provenance.sample_digests == a.provenance.sample_digests + b.provenance.sample_digests


def test_a_clip_fit_that_overflows_is_refused_not_fit_to_one():
    """Defence behind the bounds: errors that are not finite stop the fit instead of choosing ratio 1.0."""
    from oscar_calib.calibration import calibrate
    from oscar_calib.calibration.clipfit import ClipFit

    class Session:
        scaling = 0.125
        holdout = {0: type("R", (), {"stacked": lambda self: (torch.zeros(1, 1, 4, 4),) * 3 +
                                     (torch.zeros(1, 1, dtype=torch.int64),)})()}

    nan = torch.tensor([[float("inf")]])
    real_fit = calibrate.fit_layer
    try:
        calibrate.fit_layer = lambda *a, **k: ClipFit(torch.ones(1), torch.ones(1), nan, nan, (1.0,), (1.0,),
                                                       torch.zeros(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool))
        from oscar_calib.config import SolverSettings

        with pytest.raises(InputError, match="clip fit of layer 0: the held-out errors are not finite"):
            calibrate._fit_all(Session(), [0], torch.eye(4)[None, None], torch.eye(4)[None, None], SolverSettings())
    finally:
        calibrate.fit_layer = real_fit


def test_two_merges_to_one_new_file_one_writer(shards, tmp_path, monkeypatch, capsys):
    """`stats merge` holds the output's lock while it runs: a second merge to the same file is refused, with or
    without --overwrite; a file that appeared meanwhile is not replaced without --overwrite."""
    from runtime_kernels.atomic import output_lock

    out = tmp_path / "m.safetensors"
    with output_lock(out, "--out"):  # what a first merge in another process holds while it runs
        import runtime_kernels.atomic as atomic

        held = dict(atomic._HELD)
        atomic._HELD.clear()  # seen from another process: this process does not hold it
        try:
            for extra in ([], ["--overwrite"]):
                code, _, err = run_cli(["stats", "merge", *map(str, shards), "--out", str(out), *extra],
                                       monkeypatch, capsys)
                assert code == 2 and "another writer holds it" in " ".join(err.split()), err
                assert not out.exists()
        finally:
            atomic._HELD.update(held)

    real = merge_statistics

    def slow_merge(items, created):  # the first writer finishes while this one merges
        out.write_bytes(b"the other merge's file")
        return real(items, created)

    monkeypatch.setattr("oscar_calib.calibration.stats_file.merge_statistics", slow_merge)
    code, _, err = run_cli(["stats", "merge", *map(str, shards), "--out", str(out)], monkeypatch, capsys)
    assert code == 2 and "written while this merge ran" in " ".join(err.split()), err
    assert out.read_bytes() == b"the other merge's file"


@pytest.mark.parametrize("where", ["/proc/no-such/m.safetensors", "FILE/m.safetensors"])
def test_merge_into_an_unwritable_place_is_one_line(where, shards, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "FILE"
    blocker.write_text("x")
    out = where.replace("FILE", str(blocker))
    code, _, err = run_cli(["stats", "merge", *map(str, shards), "--out", out], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert ("cannot create files in" in err) or ("is not a directory" in err), err


def _data_with_samples(path: Path, samples: int) -> str:
    _, meta = read_safetensors(path, "statistics")
    data = json.loads(meta["data"])
    data["samples"] = samples
    return json.dumps(data, sort_keys=True)


def test_tampered_merge_record_is_refused(shards, tmp_path):
    merged = merge_statistics([(str(p), load_statistics(p)) for p in shards], "2023-11-14T22:13:20Z")
    path = save_statistics(merged, tmp_path / "m.safetensors")
    _, meta = read_safetensors(path, "statistics")
    parts = json.loads(meta["parts"])[:1]
    bad = edited(path, tmp_path / "bad.safetensors", meta={"parts": json.dumps(parts)})
    with pytest.raises(InputError, match="field 'parts'"):
        load_statistics(bad)


_TENSORS = ["key_sum", "attn_out_sum", "logit_v_sum", "logit_w_sum", "key_vec_sum", "value_vec_sum", "holdout_keys",
            "holdout_values", "holdout_queries"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(_TENSORS), position=st.integers(0, 10**9),
       value=st.sampled_from([float("nan"), float("inf"), float("-inf"), -3e38, -1.0, 0.0, 3e38]))
def test_fuzz_one_element_of_any_tensor(name, position, value, shards, tmp_path_factory):
    """Any element set to anything: refused naming the tensor, or accepted with every invariant the solver needs."""
    path = tmp_path_factory.mktemp("fuzz") / "f.safetensors"

    def poke(t):
        flat = t.reshape(-1)
        flat[position % flat.numel()] = value
        return flat.reshape(t.shape)

    edited(shards[0], path, {name: poke})
    try:
        stats = load_statistics(path)
    except InputError as exc:
        assert name in str(exc) and "\n" not in str(exc)
        return
    for s in stats.stats.values():
        for t in (s.key_sum, s.attn_out_sum, s.logit_v_sum, s.logit_w_sum, s.key_vec_sum, s.value_vec_sum):
            assert torch.isfinite(t).all()
        assert (s.key_sum.diagonal(dim1=-2, dim2=-1) >= 0).all() and (s.logit_w_sum >= 0).all()
    for rows in stats.holdout.values():
        assert all(torch.isfinite(t).all() for t in rows.stacked()[:3])


def test_run_records_a_local_path_with_dotdot_absolute(tmp_path, monkeypatch):
    """What `run --model ../m` records is what refit accepts: the path made absolute, never with '..'."""
    import os

    from oscar_calib.calibration.job import recorded_model_id
    from oscar_calib.calibration.stats_checks import check_recorded_model_id

    (tmp_path / "m").mkdir()
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    recorded = recorded_model_id("../m")
    assert recorded == os.path.abspath("../m") and ".." not in recorded.split("/")
    check_recorded_model_id(recorded, "x")
    assert recorded_model_id("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B" and recorded_model_id("./m") == "./m"
    with pytest.raises(InputError, match="expected no '..' component"):
        check_recorded_model_id("org/../../etc", "x")
