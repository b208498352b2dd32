"""`oscar-calib audit`: statistics against direct formulas, flags on deliberately broken artifacts, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from cli_helpers import run_cli
from format_helpers import PAPER, qfmt, restamp
from safetensors.torch import save_file
from tiny_models import tiny_model

from oscar_calib.analysis import audit as au
from oscar_calib.demo import byte_tokenizer
from runtime_kernels.artifact import identity_artifact, write_artifact
from runtime_kernels.quant import naive


def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _calibrated_like(d=64, layers=2, grid=(0.8, 0.9, 1.0)):
    """An identity-based artifact with a proper descending spectrum and a recorded clip grid."""
    art = identity_artifact(layers, 2, 4, d, fmt=PAPER)
    spec = torch.linspace(2.0, 0.1, d)
    art.k_eigenvalues[:] = spec
    art.v_eigenvalues[:] = spec
    art.k_clip_ratio[:] = 0.9
    art.v_clip_ratio[:] = 1.0
    art.metadata["calibration"] = json.dumps({"solver": {"clip_grid": list(grid)}})
    return art


def _save_raw(art, path):
    """Write the tensors as they are (no validation), to build broken artifacts."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in art.tensors().items()}, str(path / "oscar_kv.safetensors"),
              metadata=art.metadata)
    return path




# ------------------------------------------------------------------------------------------------ statistics
def test_spectrum_stats_direct():
    s = au.spectrum_stats(torch.tensor([4.0, 3.0, 2.0, 1.0]))
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    assert s["top1_share"] == pytest.approx(0.4)
    assert s["top8_share"] == pytest.approx(1.0)
    assert s["effective_rank"] == pytest.approx(math.exp(float(-(p * p.log()).sum())))


def test_degenerate_spectra():
    assert au.degenerate(torch.ones(8))  # all equal: eigenbasis arbitrary
    assert au.degenerate(torch.zeros(8))
    assert au.degenerate(torch.tensor([1.0, 0.5, -0.2]))
    assert au.degenerate(torch.tensor([1.0, float("nan")]))
    assert not au.degenerate(torch.tensor([3.0, 1.0, 0.0]))


def test_outlier_measures():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, 16, generator=g)
    assert au.kurtosis(x) == pytest.approx(3.0, abs=0.1)
    x[:, 5] *= 10
    assert au.channel_ratio(x) == pytest.approx(10.0, rel=0.05)
    c = x.double() - x.double().mean()
    assert au.kurtosis(x) == pytest.approx(float((c ** 4).mean() / (c ** 2).mean() ** 2), rel=1e-9)


def test_key_logit_error_direct():
    g = torch.Generator().manual_seed(1)
    k, q = torch.randn(7, 8, generator=g), torch.randn(3, 8, generator=g)
    e = 0.1 * torch.randn(7, 8, generator=g)
    num = sum(float(q[i] @ e[j]) ** 2 for i in range(3) for j in range(7)) / 21
    den = sum(float(q[i] @ k[j]) ** 2 for i in range(3) for j in range(7)) / 21
    assert au.key_logit_error(k, k + e, q) == pytest.approx(num / den, rel=1e-6)


# ------------------------------------------------------------------------------------------------ flags
def test_grid_edge_of_an_extending_fit_is_its_floor(tmp_path):
    """A fit that extends its grid may go below the configured grid: only the floor is an edge then."""
    art = _calibrated_like()
    calib = json.loads(art.metadata["calibration"])
    calib["clip_fit"] = {"grid_extends": True, "min_ratio": 0.5}
    art.metadata["calibration"] = json.dumps(calib, sort_keys=True)
    art.k_clip_ratio[0, 0] = 0.8  # below the configured grid, above the floor: an interior minimum
    art.v_clip_ratio[1, 1] = 0.5  # the floor: the error still fell there
    write_artifact(art, tmp_path / "a")
    report = au.audit_artifact(au.load_raw(tmp_path / "a"))
    by = {(r["layer"], r["head"]): r["flags"] for r in report["heads"]}
    assert by[(0, 0)] == [] and by[(1, 1)] == ["clip-at-grid-edge-v"]
    assert report["clip_search_floor"] == {"k": 0.5, "v": 0.5} and "clip-at-grid-edge" in report["advice"]


def test_clean_artifact_has_no_flags(tmp_path):
    write_artifact(_calibrated_like(), tmp_path / "a")
    report = au.audit_artifact(au.load_raw(tmp_path / "a"))
    assert report["contract_error"] is None and report["flags_total"] == 0
    assert len(report["heads"]) == 4


def test_broken_artifacts_are_flagged_not_refused(tmp_path):
    art = _calibrated_like()
    art.k_rotation[1, 0] = art.k_rotation[1, 0] * 1.1  # not orthogonal
    art.v_rotation[0, 1, 3, 3] = float("nan")
    art.k_eigenvalues[1, 1] = 1.0  # flat spectrum
    art.k_clip_ratio[0, 0] = 0.8  # lowest ratio of the grid
    raw = au.load_raw(_save_raw(art, tmp_path / "broken"))
    assert raw.contract_error is not None
    report = au.audit_artifact(raw)
    by = {(r["layer"], r["head"]): r["flags"] for r in report["heads"]}
    assert "non-orthogonal-k" in by[(1, 0)]
    assert "nan" in by[(0, 1)] and "non-orthogonal-v" in by[(0, 1)]
    assert "degenerate-spectrum-k" in by[(1, 1)]
    assert "clip-at-grid-edge-k" in by[(0, 0)]
    assert "recalibrate with a lower --k-clip-grid" in report["advice"]["clip-at-grid-edge"]
    # worst first: the severe heads come before the merely clipped one
    order = [(r["layer"], r["head"]) for r in report["heads"]]
    assert order.index((0, 0)) == 3


# ------------------------------------------------------------------------------------------------ activations
@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", head_dim=64, num_layers=2, vocab_size=256)


def test_capture_and_error_measures(model, tmp_path):
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    acts = au.capture_activations(model, ids)
    assert model.config._attn_implementation == "sdpa"
    assert acts.k[0].shape == (2, 2, 40, 64) and acts.q[1].shape == (2, 4, 40, 64)

    ident = _calibrated_like()
    ident.k_clip_ratio[:] = 1.0
    rows = au.audit_artifact(au.load_raw(write_artifact(ident, tmp_path / "i")), acts)["heads"]
    for r in rows:  # identity rotation, no clip: OSCAR is exactly naive INT2
        assert r["history_mass"] is None  # 40 tokens: every one of them in a window
        assert r["k_err_oscar"] == pytest.approx(r["k_err_naive"], rel=1e-9)
        assert r["v_err_oscar"] == pytest.approx(r["v_err_naive"], rel=1e-9)
        assert r["k_kurtosis_after"] == pytest.approx(r["k_kurtosis_before"], rel=1e-9)
        assert r["k_err_naive"] > 0

    unb = _calibrated_like()  # an unbiased artifact's errors are measured with its own quantizer
    restamp(unb, quantizer="uniform_unbiased")
    u_rows = au.audit_artifact(au.load_raw(write_artifact(unb, tmp_path / "u")), acts)["heads"]
    u0 = next(r for r in u_rows if r["layer"] == 0 and r["head"] == 0)
    k0 = acts.k[0][:, 0].reshape(-1, 64)
    q0 = acts.q[0][:, 0:2].transpose(1, 2).reshape(-1, 64)
    q0 = q0[torch.linspace(0, q0.shape[0] - 1, min(256, q0.shape[0])).long()]
    for quantizer, agrees in (("uniform_unbiased", True), ("uniform_minmax", False)):
        k_hat = naive.fake_quantize(k0[:, None], None, 0.9, qfmt(quantizer=quantizer))[:, 0]
        assert (u0["k_err_oscar"] == pytest.approx(au.key_logit_error(k0, k_hat, q0), rel=1e-9)) == agrees

    had = _calibrated_like()
    had.k_rotation[:] = _hadamard(64)
    had.v_rotation[:] = _hadamard(64)
    had.k_clip_ratio[:] = 1.0
    rows = au.audit_artifact(au.load_raw(write_artifact(had, tmp_path / "h")), acts)["heads"]
    for r in rows:
        assert r["k_err_oscar"] == pytest.approx(r["k_err_hadamard"], rel=1e-5)
        # independent recomputation of one head's key error
    r = next(r for r in rows if r["layer"] == 1 and r["head"] == 0)
    k = acts.k[1][:, 0].reshape(-1, 64)
    q = acts.q[1][:, 0:2].transpose(1, 2).reshape(-1, 64)
    q = q[torch.linspace(0, q.shape[0] - 1, min(256, q.shape[0])).long()]
    h = _hadamard(64)
    kr = k @ h
    lo, hi = kr.amin(-1, keepdim=True), kr.amax(-1, keepdim=True)
    scale = ((hi - lo).clamp_min(1e-8) / 3).half().float()
    zero = (-lo / scale).half().float()
    k_hat = ((torch.clamp(torch.floor(kr / scale + zero + 0.5), 0, 3) - zero) * scale) @ h.T
    ref = float(((q @ (k_hat - k).T) ** 2).mean() / ((q @ k.T) ** 2).mean())
    assert r["k_err_hadamard"] == pytest.approx(ref, rel=1e-3)


def test_history_mass_against_a_per_query_loop_and_constructed_attention():
    """`history_mass` against an explicit loop over the chosen queries (causal softmax, the tokens outside sink and
    recent); a query that attends to one token only gives 1 when that token is history and 0 when a window holds
    it; no position with a history gives None."""
    gen = torch.Generator().manual_seed(4)
    n, g, t, d, sink, recent = 2, 3, 40, 16, 4, 8
    q, k = torch.randn(n, g, t, d, generator=gen) * 2, torch.randn(n, t, d, generator=gen)
    got = au.history_mass(q, k, sink, recent, max_queries=20)
    pos = torch.arange(sink + recent, t)
    picks = torch.linspace(0, n * g * pos.numel() - 1, 20).long()
    want = []
    for i in picks.tolist():
        b, rest = divmod(i, g * pos.numel())
        h, j = divmod(rest, pos.numel())
        p = int(pos[j])
        w = torch.softmax((k[b, :p + 1].double() @ q[b, h, p].double()) / d ** 0.5, 0)
        want.append(float(w[sink:p + 1 - recent].sum()))
    assert got == pytest.approx(sum(want) / len(want), rel=1e-12)
    one = torch.zeros(1, 1, t, d)
    one[0, 0, :, 0] = 1000.0  # every query reads key 4 alone
    keys = torch.zeros(1, t, d)
    keys[0, 4, 0] = 1.0
    assert au.history_mass(one, keys, 4, recent, 64) == pytest.approx(1.0)  # first history token from p = 12 on
    assert au.history_mass(one, keys, 6, recent, 64) == pytest.approx(0.0, abs=1e-12)  # key 4: inside the sink
    assert au.history_mass(one, keys, 3, recent, 64) == pytest.approx(28 / 29)  # p = 11: history is key 3 alone
    assert au.history_mass(q, k, sink, t - sink, 10) is None


# ------------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("qwen3", head_dim=64, num_layers=2, vocab_size=260).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_cli_audit_json_and_plots(tmp_path, monkeypatch, capsys, model_dir):
    pytest.importorskip("matplotlib")
    art = _calibrated_like()
    art.metadata["model_id"] = str(model_dir)  # the identity rule: the artifact must name the audited model
    write_artifact(art, tmp_path / "a")
    data = tmp_path / "t.txt"
    data.write_text("the quick brown fox jumps over the lazy dog " * 40)
    code, out, err = run_cli(["audit", str(tmp_path / "a"), "--model", str(model_dir), "--data", str(data),
                              "--samples", "1", "--seq-len", "64", "--json", "--plots", str(tmp_path / "p")],
                             monkeypatch, capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["with_activations"] and len(report["heads"]) == 4
    assert {"k_err_naive", "k_err_hadamard", "k_err_oscar", "v_kurtosis_after"} <= set(report["heads"][0])
    assert {p.name for p in (tmp_path / "p").iterdir()} >= {"quant_error.png", "clip_ratios.png", "kurtosis.png"}


def test_cli_audit_table_without_model(tmp_path, monkeypatch, capsys):
    write_artifact(_calibrated_like(), tmp_path / "a")
    code, out, err = run_cli(["audit", str(tmp_path / "a")], monkeypatch, capsys)
    assert code == 0, err
    assert "worst first" in out and "0 flag(s)" in out


def test_cli_audit_missing_artifact_is_a_clear_error(tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(["audit", str(tmp_path / "nope")], monkeypatch, capsys)
    assert code == 2
    assert "oscar_kv.safetensors" in err and "Traceback" not in err


def test_cli_audit_refuses_an_artifact_for_another_model(tmp_path, monkeypatch, capsys, model_dir):
    write_artifact(identity_artifact(2, 2, 4, 32, fmt=PAPER), tmp_path / "a")  # head_dim 32, the model has 64
    code, out, err = run_cli(["audit", str(tmp_path / "a"), "--model", str(model_dir)], monkeypatch, capsys)
    assert code != 0 and "head_dim" in err
