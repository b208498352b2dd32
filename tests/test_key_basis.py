"""Hadamard keys in the layers that read the INT2 history: the held-out history mass and the per-layer choice."""

import json

import pytest
import torch
from cli_helpers import run_cli
from tiny_models import tiny_model

from oscar_calib.analysis.audit import history_mass
from oscar_calib.calibration.calibrate import calibrate_model_with_report
from oscar_calib.calibration.key_basis import hadamard_key_heads, holdout_history_mass
from oscar_calib.calibration.solve import hadamard
from oscar_calib.config import DEFAULT_HADAMARD_KEY_MASS, SolverSettings
from oscar_calib.zoo.model_card import head_list

SMALL = SolverSettings(kv_format={"sink_tokens": 4, "recent_tokens": 8})
OFF = SMALL.model_copy(update={"hadamard_key_mass": 1.0})  # the attention-aware key basis in every head


def test_history_mass_against_a_per_query_loop():
    """Each KV head's mass against an explicit loop over its group's held-out queries (causal softmax in fp64,
    summed over the keys neither window keeps), with queries before sink + recent left out."""
    gen = torch.Generator().manual_seed(0)
    s, h_kv, g, t, d, sink, recent = 2, 2, 3, 40, 16, 4, 8
    keys = torch.randn(s, h_kv, t, d, generator=gen) * 2
    positions = torch.tensor([[3, 11, 12, 20, 39], [0, 12, 25, 30, 38]])  # 3, 11, 0: no history
    queries = torch.randn(s, h_kv * g, positions.shape[1], d, generator=gen) * 2
    got = holdout_history_mass(keys, queries, positions, d ** -0.5, sink, recent)
    for h in range(h_kv):
        want = []
        for i in range(s):
            for j, p in enumerate(positions[i].tolist()):
                if p < sink + recent:
                    continue
                for qh in range(h * g, (h + 1) * g):
                    w = torch.softmax(keys[i, h, :p + 1].double() @ queries[i, qh, j].double() / d ** 0.5, 0)
                    want.append(float(w[sink:p + 1 - recent].sum()))
        assert got[h].item() == pytest.approx(sum(want) / len(want), rel=1e-5)


def test_the_audit_reports_the_same_mass():
    """`oscar-calib audit`'s per-head mass (every query of a full capture) and calibration's (given held-out
    positions) are one statistic: with every position held out they agree."""
    gen = torch.Generator().manual_seed(1)
    s, h_kv, g, t, d, sink, recent = 2, 2, 3, 40, 16, 4, 8
    keys = torch.randn(s, h_kv, t, d, generator=gen) * 2
    queries = torch.randn(s, h_kv * g, t, d, generator=gen) * 2
    got = holdout_history_mass(keys, queries, torch.arange(t).expand(s, t), d ** -0.5, sink, recent)
    for h in range(h_kv):
        want = history_mass(queries[:, h * g:(h + 1) * g], keys[:, h], sink, recent, max_queries=10**6)
        assert got[h].item() == pytest.approx(want, rel=1e-5)


def test_history_mass_of_constructed_attention():
    """One query that attends only to a history token has mass 1; one that attends only to its own (recent)
    token has mass 0; queries before sink + recent have no history and do not count."""
    t, d, sink, recent = 16, 4, 2, 4
    keys = torch.zeros(1, 1, t, d)
    keys[0, 0, 5, 0] = 1.0  # token 5 is history for a query at p >= 5 + recent
    keys[0, 0, 12, 1] = 1.0
    big = 1e4
    q_hist = torch.tensor([big, 0.0, 0.0, 0.0])  # reads token 5
    q_self = torch.tensor([0.0, big, 0.0, 0.0])  # reads token 12, in its own recent window
    queries = torch.stack([q_hist, q_self, q_hist]).reshape(1, 1, 3, d)
    positions = torch.tensor([[12, 12, 3]])  # the last one has no history: left out
    mass = holdout_history_mass(keys, queries, positions, 1.0, sink, recent)
    assert mass.tolist() == [pytest.approx(0.5)]
    assert holdout_history_mass(keys, queries, torch.tensor([[1, 2, 3]]), 1.0, sink, recent) is None


def test_heads_above_the_threshold():
    masses = {0: torch.tensor([0.32, 0.2]), 1: torch.tensor([0.1, 0.1]), 2: None, 3: torch.tensor([0.25, 0.26])}
    assert hadamard_key_heads(masses, 0.25) == {0: [0], 3: [1]}  # above, not at: head 3:0 sits on it
    assert hadamard_key_heads(masses, 0.0) == {0: [0, 1], 1: [0, 1], 3: [0, 1]}
    assert hadamard_key_heads(masses, 1.0) == {}
    # one rotation per layer: a layer swaps all its heads or none, by their mean (layer 0: 0.26, layer 3: 0.255)
    assert hadamard_key_heads(masses, 0.255, "layer") == {0: [0, 1]}
    assert hadamard_key_heads(masses, 0.25, "layer") == {0: [0, 1], 3: [0, 1]}


def test_head_list_names_layers_and_head_ranges():
    assert head_list({0: [0], 5: [1, 2], 7: [0, 2, 3]}) == "0:0, 5:1-2, 7:0,2-3"


def _calibrate(settings):
    model = tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=64, num_layers=3, seed=1)
    ids = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(2))
    return calibrate_model_with_report(model, ids, settings, holdout_queries=32, compare_alternatives=False)


def test_threshold_zero_rotates_every_key_by_hadamard_and_keeps_values():
    base, _ = _calibrate(OFF)
    art, report = _calibrate(SMALL.model_copy(update={"hadamard_key_mass": 0.0}))
    every = {0: [0, 1], 1: [0, 1], 2: [0, 1]}
    assert report.hadamard_key_heads == every
    h = hadamard(64).float()
    assert torch.equal(art.k_rotation, h.expand_as(art.k_rotation))
    assert torch.equal(art.v_rotation, base.v_rotation) and torch.equal(art.v_clip_ratio, base.v_clip_ratio)
    assert torch.equal(art.k_mean, base.k_mean)
    basis = json.loads(art.metadata["calibration"])["key_basis"]
    assert basis["hadamard_heads"] == {str(k): v for k, v in every.items()} and basis["hadamard_key_mass"] == 0.0
    assert all(len(m) == 2 and all(0.0 < x < 1.0 for x in m) for m in basis["history_mass"].values())
    assert report.summary()["hadamard_key_heads"] == {str(k): v for k, v in every.items()}


def test_threshold_between_heads_swaps_exactly_the_heads_above_it():
    """The recorded per-head masses decide: a threshold between them rotates exactly the KV heads above it, and every
    other head keeps the default's key rotation and key clip (a head's clip fit reads its own rotation only)."""
    art0, _ = _calibrate(SMALL.model_copy(update={"hadamard_key_mass": 0.0}))
    masses = {int(k): v for k, v in json.loads(art0.metadata["calibration"])["key_basis"]["history_mass"].items()}
    flat = sorted(x for m in masses.values() for x in m)
    assert flat[-1] - flat[0] > 1e-3, masses
    tau = (flat[len(flat) // 2 - 1] + flat[len(flat) // 2]) / 2  # half the heads above it
    base, _ = _calibrate(OFF)
    art, report = _calibrate(SMALL.model_copy(update={"hadamard_key_mass": tau}))
    want_heads = {i: [j for j, x in enumerate(m) if x > tau] for i, m in masses.items()}
    assert report.hadamard_key_heads == {i: hs for i, hs in want_heads.items() if hs}
    assert sum(map(len, report.hadamard_key_heads.values())) == len(flat) // 2
    h = hadamard(64).float()
    for a in range(3):
        for j in range(2):
            swapped = j in want_heads[a]
            assert torch.equal(art.k_rotation[a, j], h if swapped else base.k_rotation[a, j]), (a, j)
            if not swapped:
                assert torch.equal(art.k_clip_ratio[a, j], base.k_clip_ratio[a, j]), (a, j)


def test_threshold_one_keeps_the_attention_aware_keys():
    art, report = _calibrate(OFF)
    assert report.hadamard_key_heads == {}
    basis = json.loads(art.metadata["calibration"])["key_basis"]
    assert basis["hadamard_heads"] == {} and basis["history_mass"] == {}  # not even measured
    assert not torch.allclose(art.k_rotation[0, 0], hadamard(64).float(), atol=1e-3)


def test_default_threshold_swaps_the_heads_above_it():
    """The default settings apply the default threshold: exactly the heads above it, from the recorded masses."""
    assert SolverSettings().hadamard_key_mass == DEFAULT_HADAMARD_KEY_MASS < 1.0
    art, report = _calibrate(SMALL)
    basis = json.loads(art.metadata["calibration"])["key_basis"]
    assert basis["hadamard_key_mass"] == DEFAULT_HADAMARD_KEY_MASS
    want = {int(k): [j for j, x in enumerate(m) if x > DEFAULT_HADAMARD_KEY_MASS]
            for k, m in basis["history_mass"].items()}
    assert report.hadamard_key_heads == {k: v for k, v in want.items() if v}


def test_threshold_out_of_range_is_refused_by_name(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="hadamard_key_mass"):
        SolverSettings(hadamard_key_mass=1.5)
    monkeypatch.setenv("COLUMNS", "200")  # one line per message in the error box
    code, _, err = run_cli(["run", "--hadamard-key-mass", "1.5", "--out", str(tmp_path / "a")], monkeypatch, capsys)
    assert code == 2 and "--hadamard-key-mass" in err and "less than or equal to 1" in err and "1.5" in err, err
    assert not (tmp_path / "a").exists()


def test_model_card_names_the_swapped_heads():
    """The card's key-basis cell, from the artifact's `calibration.key_basis`, in all three cases."""
    from oscar_calib.zoo.model_card import key_basis_summary

    swapped = {"hadamard_heads": {"0": [0, 1], "3": [2]}, "hadamard_key_mass": 0.3}
    assert key_basis_summary(swapped, 12) == ("Hadamard keys in 3 of 12 KV heads (layer:heads 0:0-1, 3:2; held-out "
                                       "INT2-history attention above 0.3), the attention-aware rotation in the others")
    assert "no head's held-out queries put more than 0.3" in key_basis_summary({"hadamard_heads": {},
                                                                         "hadamard_key_mass": 0.3}, 12)
    assert key_basis_summary({"hadamard_heads": {}, "hadamard_key_mass": 1.0}, 12).endswith("(`--hadamard-key-mass 1`)")
    assert key_basis_summary(None, 12) == "the attention-aware rotation in every KV head"


def test_alternatives_follow_the_same_key_basis():
    """The card's table of alternatives compares value targets and granularities, not key bases: at threshold 0
    every key is Hadamard in the chosen rotations and in each alternative alike, so the per-head alternative with the
    other value target has exactly the chosen row's key error, and so does Hadamard-only."""
    model = tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=64, num_layers=3, seed=1)
    ids = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(2))
    _, report = calibrate_model_with_report(model, ids, SMALL.model_copy(update={"hadamard_key_mass": 0.0}),
                                            holdout_queries=32)
    alt = report.comparison
    assert alt["head/logit_weighted"]["key"] == alt["head/attn_output"]["key"] == alt["hadamard_only"]["key"]
    assert alt["layer/attn_output"]["key"] == alt["head/attn_output"]["key"]
