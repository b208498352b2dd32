"""Calibration end to end on tiny models: contract round trip, reproducibility, clip fit, unsupported models."""

import json

import pytest
import torch
from format_helpers import PAPER, qfmt
from tiny_models import tiny_model

from oscar_calib.calibration.calibrate import calibrate_model_with_report
from oscar_calib.calibration.clipfit import clip_errors, pick_ratios, quantized_pair_mask
from oscar_calib.config import SolverSettings
from oscar_calib.errors import InputError
from runtime_kernels.artifact import orthogonality_error, read_artifact, write_artifact
from runtime_kernels.quant import naive

SMALL = SolverSettings(kv_format={"sink_tokens": 4, "recent_tokens": 8})
W48 = PAPER.with_(sink_tokens=4, recent_tokens=8)  # the slow reference: fp16 scales, min-max


def _ids(n, t, seed=0):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch,heads,kv,d", [("qwen3", 8, 2, 64), ("llama", 4, 4, 128), ("mistral", 8, 1, 64)])
def test_artifact_contract_round_trip(tmp_path, arch, heads, kv, d):
    model = tiny_model(arch, num_heads=heads, num_kv_heads=kv, head_dim=d, num_layers=2)
    art, report = calibrate_model_with_report(model, _ids(3, 32), SMALL, holdout_queries=16, compare_alternatives=False)
    assert art.k_rotation.shape == (2, kv, d, d) and art.k_clip_ratio.shape == (2, kv)
    assert art.layer_ids.tolist() == [0, 1]
    assert orthogonality_error(art.k_rotation) < 1e-5 and orthogonality_error(art.v_rotation) < 1e-5
    path = write_artifact(art, tmp_path)
    back = read_artifact(tmp_path)
    for name, t in art.tensors().items():
        assert torch.equal(t, getattr(back, name)), name
    assert back.metadata == art.metadata
    meta = back.metadata
    assert meta["num_attention_heads"] == str(heads) and meta["num_key_value_heads"] == str(kv)
    assert meta["head_dim"] == str(d) and meta["granularity"] == "head" and meta["bits"] == "2"
    assert json.loads(meta["calibration"])["solver"]["granularity"] == "head"
    assert path.name == "oscar_kv.safetensors"
    # every ratio is on the grid the fit searched (the configured grid, extended downward where needed)
    searched = sum((f.k_grid + f.v_grid for f in report.fits.values()), ())
    for r in torch.cat([back.k_clip_ratio.flatten(), back.v_clip_ratio.flatten()]).tolist():
        assert any(abs(r - g) < 1e-6 for g in searched), r


def test_two_runs_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    files = []
    for i in range(2):
        model = tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=64, num_layers=2, seed=3)
        art, _ = calibrate_model_with_report(model, _ids(3, 32, seed=5), SMALL, holdout_queries=16)
        files.append(write_artifact(art, tmp_path / str(i)).read_bytes())
    assert files[0] == files[1]


def test_layer_granularity_shares_rotation_across_heads():
    model = tiny_model("qwen3", num_heads=8, num_kv_heads=4, head_dim=64, num_layers=1)
    art, _ = calibrate_model_with_report(model, _ids(3, 32), SMALL.model_copy(update={"granularity": "layer"}),
                                         holdout_queries=16)
    for h in range(1, 4):
        assert torch.equal(art.k_rotation[0, 0], art.k_rotation[0, h])
    assert art.metadata["granularity"] == "layer"


def _slow_clip_errors(keys, values, queries, positions, k_rot, v_rot, ratio, scaling, sink, recent):
    """Per (sequence, head, query) loop with the runtime quantizer: independent of the vectorised version."""
    s, h_kv, t, d = keys.shape
    g = queries.shape[1] // h_kv
    k_err = torch.zeros(h_kv, dtype=torch.float64)
    k_kl = torch.zeros(h_kv, dtype=torch.float64)
    v_num = torch.zeros(h_kv, dtype=torch.float64)
    v_den = torch.zeros(h_kv, dtype=torch.float64)
    pairs = torch.zeros(h_kv, dtype=torch.float64)
    for h in range(h_kv):
        khat = naive.fake_quantize(keys[:, h].reshape(-1, 1, d), k_rot[h][None], torch.tensor([ratio]), qfmt()).reshape(s, t, d)
        vhat = naive.fake_quantize(values[:, h].reshape(-1, 1, d), v_rot[h][None], torch.tensor([ratio]), qfmt()).reshape(s, t, d)
        for si in range(s):
            for qi in range(h * g, (h + 1) * g):
                for n, pos in enumerate(positions[si].tolist()):
                    q = queries[si, qi, n].double()
                    kk = keys[si, h, : pos + 1].double()
                    p = torch.softmax(kk @ q * scaling, 0)
                    quant = [(j >= sink and j <= pos - recent) for j in range(pos + 1)]
                    mask = torch.tensor(quant, dtype=torch.float64)
                    dk = khat[si, : pos + 1].double() - kk
                    k_err[h] += ((dk @ q * scaling) ** 2 * mask).sum()
                    kmix = kk + dk * mask[:, None]  # quantized keys only on quantized pairs
                    p_hat = torch.softmax(kmix @ q * scaling, 0)
                    k_kl[h] += (p * (p.log() - p_hat.log())).sum()
                    pairs[h] += mask.sum()
                    dv = vhat[si, : pos + 1].double() - values[si, h, : pos + 1].double()
                    v_num[h] += ((p * mask) @ dv).pow(2).sum()
                    v_den[h] += (p @ values[si, h, : pos + 1].double()).pow(2).sum()
    return k_err / pairs, k_kl / (s * g * positions.shape[1]), v_num / v_den


def test_clip_errors_match_slow_loop():
    gen = torch.Generator().manual_seed(0)
    s, h_kv, g, t, d, n_q = 1, 2, 2, 40, 16, 6
    keys = torch.randn(s, h_kv, t, d, generator=gen) * torch.linspace(0.2, 3, d)
    values = torch.randn(s, h_kv, t, d, generator=gen)
    queries = torch.randn(s, h_kv * g, n_q, d, generator=gen)
    positions = torch.tensor([[12, 20, 25, 31, 36, 39]])
    rot = torch.linalg.qr(torch.randn(h_kv, d, d, generator=gen, dtype=torch.float64))[0].float()
    grid = (0.75, 0.9, 1.0)
    k_mse, v_err = clip_errors(keys, values, queries, positions, rot, rot, grid, 0.25, W48,
                               key_objective="logit_mse")
    k_kl, v_err2 = clip_errors(keys, values, queries, positions, rot, rot, grid, 0.25, W48,
                               key_objective="attn_kl", v_grid=grid[::-1])
    for gi, ratio in enumerate(grid):
        mse_ref, kl_ref, v_ref = _slow_clip_errors(keys, values, queries, positions, rot, rot, ratio, 0.25, 4, 8)
        assert torch.allclose(k_mse[gi], mse_ref, rtol=1e-4), (ratio, k_mse[gi], mse_ref)
        assert torch.allclose(k_kl[gi], kl_ref, rtol=1e-3, atol=1e-9), (ratio, k_kl[gi], kl_ref)
        assert torch.allclose(v_err[gi], v_ref, rtol=1e-4), (ratio, v_err[gi], v_ref)
        assert torch.allclose(v_err2[len(grid) - 1 - gi], v_ref, rtol=1e-4)


def test_pick_ratios_prefers_less_clipping_on_ties():
    errs = torch.tensor([[1.0, 0.5], [1.0, 0.7], [2.0, 0.5]], dtype=torch.float64)
    assert pick_ratios(errs, (0.9, 0.95, 1.0)).tolist() == pytest.approx([0.95, 1.0])


def test_quantized_pair_mask_windows():
    m = quantized_pair_mask(torch.tensor([[10, 30]]), 32, PAPER.with_(sink_tokens=2, recent_tokens=5))
    assert m[0, 0].nonzero().flatten().tolist() == [2, 3, 4, 5]
    assert m[0, 1].nonzero().flatten().tolist() == list(range(2, 26))


def test_fitted_clip_beats_global_ratios_on_heldout():
    """Per head, the fitted ratios' held-out error, recomputed independently, is at most that of the global ratios."""
    model = tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=64, num_layers=2)
    art, report = calibrate_model_with_report(model, _ids(3, 48), SMALL, holdout_queries=24)
    assert set(report.summary()["alternatives"]) >= {"head/attn_output", "layer/logit_weighted", "hadamard_only"}

    def at(grid, r):
        return min(range(len(grid)), key=lambda i: abs(grid[i] - r))

    for a, layer in enumerate(art.layer_ids.tolist()):
        fit = report.fits[layer]
        for h in range(art.num_kv_heads):
            k_fit = fit.k_errors[at(fit.k_grid, float(art.k_clip_ratio[a, h])), h]
            v_fit = fit.v_errors[at(fit.v_grid, float(art.v_clip_ratio[a, h])), h]
            # the artifact holds the per-head minimum of what was searched, which includes the global ratios
            assert k_fit == fit.k_errors[:, h].min() and v_fit == fit.v_errors[:, h].min()
            assert k_fit <= fit.k_errors[at(fit.k_grid, 0.96), h] and v_fit <= fit.v_errors[at(fit.v_grid, 0.92), h]


def test_unsupported_models_are_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    with pytest.raises(InputError, match="head_dim=48 is not a power of two"):
        calibrate_model_with_report(tiny_model("llama", num_heads=4, num_kv_heads=2, head_dim=48, num_layers=1),
                                    _ids(2, 16), SMALL)
    cfg = AutoConfig.for_model("deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=64,
                               moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                               qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=2, num_experts_per_tok=1)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(InputError, match="multi-head latent attention"):
        calibrate_model_with_report(model, _ids(2, 16), SMALL)
