"""`eval`'s table: each OSCAR row against its best peer of no more bits, with a paired bootstrap interval and a
verdict; the centered Hadamard + clip peer; no FutureWarning from our own forward calls."""

from __future__ import annotations

import warnings

import pytest
import torch
from format_helpers import PAPER, restamp
from tiny_models import tiny_model

from oscar_calib.analysis.eval_job import compare_to_best_peer
from oscar_calib.analysis.evaluate import greedy_continuation
from oscar_calib.analysis.methods import hadamard
from oscar_calib.analysis.peers import centered_hadamard_clip, centered_peer
from oscar_calib.cli.eval_cmd import _table
from runtime_kernels.artifact import identity_artifact


def _row(name, bits, window_nll):
    nll = torch.tensor(window_nll, dtype=torch.float64)
    return {"name": name, "effective_bits_128k": bits, "ppl": float(torch.exp(nll.mean())),
            "window_nll": window_nll, "ppl_delta_pct": 0.0, "ppl_delta_ci95": None, "mean_attn_kl": 0.0,
            "mean_out_rel_err": 0.0}


def test_best_peer_has_no_more_bits_and_the_verdict_follows_the_interval():
    base = [2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02, 1.98]
    result = {"context": 2048, "sink": 128, "recent": 1024, "windows": {"long": 4, "packed": 4}, "methods": [
        _row("bf16", 16.0, [x - 0.05 for x in base]),
        _row("kivi2-g32", 2.74, [x - 0.04 for x in base]),  # better, but more bits: not a peer
        _row("hadamard-clip-centered", 2.25, base),
        _row("oscar-head", 2.25, [x - 0.01 for x in base]),  # lower on every window: better, interval below 0
        _row("oscar-layer", 2.25, [x + (0.01 if i % 2 else -0.01) for i, x in enumerate(base)]),  # a tie
    ]}
    vs = compare_to_best_peer(result, ["oscar-head", "oscar-layer"])
    assert vs["oscar-head"]["peer"] == "hadamard-clip-centered"
    assert vs["oscar-head"]["verdict"] == "better" and vs["oscar-head"]["ci95"][1] < 0
    assert abs(vs["oscar-head"]["delta_pct"] - 100 * (torch.exp(torch.tensor(-0.01)).item() - 1)) < 1e-6
    assert vs["oscar-layer"]["verdict"] == "tie" and vs["oscar-layer"]["ci95"][0] < 0 < vs["oscar-layer"]["ci95"][1]
    result["vs_best_peer"] = vs
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(_table(result))
    text = console.export_text()
    assert "vs hadamard-clip-centered: better" in text and "paired bootstrap" in text and "{" not in text


def test_centered_peer_keeps_the_means_and_swaps_rotation_and_clips():
    art = identity_artifact(2, 2, 4, 16, model_id="org/m", fmt=PAPER)
    art.k_mean = torch.randn(2, 2, 16)
    art.v_mean = torch.randn(2, 2, 16)
    restamp(art, mean_basis="original")
    peer = centered_hadamard_clip(art.validate())
    assert torch.equal(peer.k_rotation[1, 1], hadamard(16).float())
    assert torch.allclose(peer.key_mean("original"), art.k_mean) and torch.allclose(peer.value_mean("original"),
                                                                                     art.v_mean)
    assert peer.k_clip_ratio.unique().tolist() == [pytest.approx(0.96)]
    assert peer.v_clip_ratio.unique().tolist() == [pytest.approx(0.92)]
    assert peer.quantizer == art.quantizer and peer.kv_format == art.kv_format
    assert [m.name for m in centered_peer({"oscar-head": art})] == ["hadamard-clip-centered"]
    assert centered_peer({"x": identity_artifact(2, 2, 4, 16, fmt=PAPER)}) == []  # nothing centered: no centered peer


def test_our_forward_calls_raise_no_future_warning():
    model = tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = greedy_continuation(model, torch.randint(0, 100, (1, 8)), 3)
    assert out.shape == (1, 3)


def test_model_card_explains_when_an_alternative_scores_lower():
    from oscar_calib.zoo.model_card import _why_the_default

    alts = {"head/attn_output": {"key": 1.2e-4, "value": 9.7e-5}, "layer/attn_output": {"key": 1.0e-4, "value": 9.8e-5},
            "hadamard_only": {"key": 1.4e-4, "value": 7.8e-5}}
    text = _why_the_default(alts, "head", "attn_output")
    assert "`layer/attn_output` has the lower key error" in text and "`hadamard_only` has the lower value error" in text
    assert "Why the default anyway" in text
    best = {"head/attn_output": {"key": 1e-4, "value": 7e-5}, "hadamard_only": {"key": 2e-4, "value": 8e-5}}
    assert not _why_the_default(best, "head", "attn_output").startswith("Here")
