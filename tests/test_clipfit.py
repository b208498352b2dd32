"""Clip fit: the attention-output objectives, centering, grid extension and the short held-out refusal."""

import pytest
import torch
from format_helpers import PAPER, qfmt, restamp, served

from oscar_calib.analysis.methods import centered_fake_quantize
from oscar_calib.calibration.clipfit import MIN_RATIO, clip_errors, extended_grid, fit_layer
from oscar_calib.calibration.stats import LayerStats
from oscar_calib.errors import InputError
from runtime_kernels.quant import naive

W48 = PAPER.with_(sink_tokens=4, recent_tokens=8)  # the slow references: fp16 scales, min-max, per-token windows


def _data(seed=0, s=1, h_kv=2, g=2, t=48, d=16, n_q=6, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(s, h_kv, t, d, generator=gen) * torch.linspace(0.2, 3, d) + offset
    values = torch.randn(s, h_kv, t, d, generator=gen) + offset / 2
    queries = torch.randn(s, h_kv * g, n_q, d, generator=gen)
    positions = torch.tensor([[14, 22, 29, 35, 41, 47]])[:, :n_q].expand(s, n_q)
    rot = torch.linalg.qr(torch.randn(h_kv, d, d, generator=gen, dtype=torch.float64))[0].float()
    return keys, values, queries, positions, rot


def _slow_out_errors(keys, values, queries, positions, rot, ratio, scaling, sink, recent, k_mean, v_mean, w_o):
    """Per (head, query) loop in float64: key and value attention-output errors, optionally through o_proj."""
    s, h_kv, t, d = keys.shape
    g = queries.shape[1] // h_kv
    k_num = torch.zeros(h_kv, dtype=torch.float64)
    v_num = torch.zeros(h_kv, dtype=torch.float64)
    den = torch.zeros(h_kv, dtype=torch.float64)
    for h in range(h_kv):
        def fq(x, mean):
            rows = (x[0, h] - mean[h]).reshape(-1, 1, d)
            return naive.fake_quantize(rows, rot[h][None], torch.tensor([ratio]), qfmt()).reshape(t, d).double() + mean[h]
        khat, vhat = fq(keys, k_mean), fq(values, v_mean)
        for n, pos in enumerate(positions[0].tolist()):
            mask = torch.tensor([(sink <= j <= pos - recent) for j in range(pos + 1)], dtype=torch.float64)
            kk, vv = keys[0, h, :pos + 1].double(), values[0, h, :pos + 1].double()
            kmix = kk + (khat[:pos + 1] - kk) * mask[:, None]
            dk_out, dv_out, ref = [], [], []
            for i in range(h * g, (h + 1) * g):
                q = queries[0, i, n].double()
                p = torch.softmax(kk @ q * scaling, 0)
                p_hat = torch.softmax(kmix @ q * scaling, 0)
                cols = w_o[:, i * d:(i + 1) * d].double()
                dk_out.append(cols @ ((p_hat - p) @ vv))
                dv_out.append(cols @ ((p * mask) @ (vhat[:pos + 1] - vv)))
                ref.append(cols @ (p @ vv))
            k_num[h] += sum(dk_out).pow(2).sum()
            v_num[h] += sum(dv_out).pow(2).sum()
            den[h] += sum(ref).pow(2).sum()
    return k_num / den, v_num / den


@pytest.mark.parametrize("centered", [False, True])
def test_block_out_errors_match_slow_loop(centered):
    keys, values, queries, positions, rot = _data(offset=1.5)
    h_kv, d = keys.shape[1], keys.shape[-1]
    k_mean = keys.mean(dim=(0, 2)) if centered else torch.zeros(h_kv, d)
    v_mean = values.mean(dim=(0, 2)) if centered else torch.zeros(h_kv, d)
    w_o = torch.randn(24, queries.shape[1] * d, generator=torch.Generator().manual_seed(3))
    grid = (0.75, 1.0)
    k_err, v_err = clip_errors(keys, values, queries, positions, rot, rot, grid, 0.25, W48,
                               key_objective="block_out", k_mean=k_mean, v_mean=v_mean, o_weight=w_o)
    for gi, ratio in enumerate(grid):
        k_ref, v_ref = _slow_out_errors(keys, values, queries, positions, rot, ratio, 0.25, 4, 8, k_mean.double(),
                                        v_mean.double(), w_o)
        assert torch.allclose(k_err[gi], k_ref, rtol=2e-3), (ratio, k_err[gi], k_ref)
        assert torch.allclose(v_err[gi], v_ref, rtol=2e-3), (ratio, v_err[gi], v_ref)


def test_out_err_is_block_out_with_identity_projection():
    keys, values, queries, positions, rot = _data(seed=1)
    d, h_q = keys.shape[-1], queries.shape[1]
    eye = torch.eye(h_q * d)  # o_proj = identity: the summed group output error is not the per-head one...
    k1, v1 = clip_errors(keys, values, queries, positions, rot, rot, (0.9,), 0.25, W48,
                         key_objective="out_err")
    k2, v2 = clip_errors(keys, values, queries, positions, rot, rot, (0.9,), 0.25, W48,
                         key_objective="block_out", o_weight=eye)
    # ...but with an identity W_o the query heads land in disjoint coordinates, so the two agree.
    assert torch.allclose(k1, k2, rtol=1e-5) and torch.allclose(v1, v2, rtol=1e-5)


def test_centering_lowers_the_error_of_offset_keys():
    """Keys with a large common offset: subtracting the calibrated mean shrinks every row's range."""
    keys, values, queries, positions, rot = _data(seed=2, offset=4.0)
    mean = keys.mean(dim=(0, 2))
    plain, _ = clip_errors(keys, values, queries, positions, rot, rot, (1.0,), 0.25, W48,
                           key_objective="out_err")
    centered, _ = clip_errors(keys, values, queries, positions, rot, rot, (1.0,), 0.25, W48,
                              key_objective="out_err", k_mean=mean)
    assert (centered < 0.5 * plain).all(), (centered, plain)


def test_zero_mean_centering_is_bit_identical():
    keys, _, _, _, rot = _data(seed=4)
    x = keys  # [1, H, T, d]
    a = centered_fake_quantize(x, rot, torch.tensor([0.9, 0.95]), None, PAPER)
    b = centered_fake_quantize(x, rot, torch.tensor([0.9, 0.95]), torch.zeros(2, x.shape[-1]), PAPER)
    assert torch.equal(a, b)


def test_search_extends_the_grid_to_an_interior_minimum():
    """Error curves whose minima lie at and below the grid's low end: the search goes on until they turn up."""
    from oscar_calib.calibration.clipfit import _fit_one_side

    calls = []

    def errors_of(grid):
        calls.append(grid)
        r = torch.tensor(grid, dtype=torch.float64)[:, None]
        return torch.cat([(r - 0.87) ** 2, (r - 0.95) ** 2], dim=1)

    ratio, errors, grid, edge = _fit_one_side(errors_of, (0.94, 0.97, 1.0))
    assert ratio.tolist() == pytest.approx([0.88, 0.94])
    assert grid == pytest.approx((0.86, 0.88, 0.90, 0.92, 0.94, 0.97, 1.0))
    assert errors.shape == (7, 2) and not bool(edge.any())
    assert all(len(c) == 1 for c in calls[1:]), "each extension scores only the new candidate"


def test_fit_layer_ratios_are_the_minima_of_what_it_searched():
    keys, values, queries, positions, rot = _data(seed=5, d=32)
    fit = fit_layer(keys, values, queries, positions, rot, rot, (0.94, 0.97, 1.0), 0.25, W48, key_objective="out_err",
                    v_grid=(0.94, 0.97, 1.0))
    for grid, ratios, errors in ((fit.k_grid, fit.k_ratio, fit.k_errors), (fit.v_grid, fit.v_ratio, fit.v_errors)):
        assert errors.shape == (len(grid), 2)
        for h in range(2):
            i = list(grid).index(round(float(ratios[h]), 6))
            assert errors[i, h] == errors[:, h].min()
            assert i > 0 or grid[0] <= MIN_RATIO, "a fitted ratio at the low end means the search stopped early"


def test_a_fit_scores_each_candidate_as_a_fresh_call_would():
    """fit_layer shares the held-out attention and each side's rotated, sorted rows across its candidates and grid
    extensions: every error it reports equals a one-off `clip_errors` of that candidate alone (centered, both
    sides), so nothing cached leaks from one candidate, side or extension into another."""
    keys, values, queries, positions, rot = _data(seed=1, d=32, offset=1.0)
    k_mean, v_mean = keys.mean(dim=(0, 2)), values.mean(dim=(0, 2)) * 0.5
    w_o = torch.randn(24, queries.shape[1] * 32, generator=torch.Generator().manual_seed(3))
    v_rot = rot.flip(0)  # a different rotation per side
    fit = fit_layer(keys, values, queries, positions, rot, v_rot, (0.94, 0.97, 1.0), 0.25, W48, key_objective="block_out",
                    k_mean=k_mean, v_mean=v_mean, o_weight=w_o)
    assert len(fit.k_grid) > 3 and len(fit.v_grid) > 3, "the data must make both searches extend their grids"
    for i, r in enumerate(fit.k_grid):
        k1, _ = clip_errors(keys, values, queries, positions, rot, v_rot, (r,), 0.25, W48, key_objective="block_out",
                            v_grid=(), k_mean=k_mean, v_mean=v_mean, o_weight=w_o)
        assert torch.equal(fit.k_errors[i], k1[0])
    for i, r in enumerate(fit.v_grid):
        _, v1 = clip_errors(keys, values, queries, positions, rot, v_rot, (), 0.25, W48, key_objective="block_out",
                            v_grid=(r,), k_mean=k_mean, v_mean=v_mean, o_weight=w_o)
        assert torch.equal(fit.v_errors[i], v1[0])


def test_clip_rows_with_presorted_magnitudes_is_clip_rows():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    ratio = torch.tensor([0.8, 0.9, 1.0, 0.95, 0.5])
    assert torch.equal(naive.clip_rows(x, ratio), naive.clip_rows(x, ratio, x.abs().sort(dim=-1).values))


def test_extended_grid_stops_at_the_floor():
    assert extended_grid((0.94, 1.0)) == (0.92, 0.94, 1.0)
    assert extended_grid((MIN_RATIO, 1.0)) == (MIN_RATIO, 1.0)


def test_short_heldout_is_refused_naming_the_windows():
    keys, values, queries, _, rot = _data(t=16)
    with pytest.raises(InputError, match=r"16 tokens.*sink 4 \+ recent 12"):
        clip_errors(keys, values, queries, torch.tensor([[3, 7, 9, 11, 13, 15]]), rot, rot, (1.0,), 0.25,
                    PAPER.with_(sink_tokens=4, recent_tokens=12))


def test_unknown_objective_is_refused():
    keys, values, queries, positions, rot = _data()
    with pytest.raises(InputError, match="expected one of attn_kl"):
        clip_errors(keys, values, queries, positions, rot, rot, (1.0,), 0.25, W48, key_objective="mse")
    with pytest.raises(InputError, match="o_proj"):
        clip_errors(keys, values, queries, positions, rot, rot, (1.0,), 0.25, W48,
                    key_objective="block_out")


def test_stats_means_are_the_token_means_and_merge_by_addition():
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, h, 5, 8, generator=gen) for h in (4, 2, 2))
    a, b = LayerStats.zeros(2, 8), LayerStats.zeros(2, 8)
    a.update(q[:1], k[:1], v[:1], q[:1])
    b.update(q[1:], k[1:], v[1:], q[1:])
    a.merge_(b)
    assert torch.allclose(a.key_mean(), k.double().mean(dim=(0, 2)), atol=1e-6)  # fp32 batch sums
    assert torch.allclose(a.value_mean(), v.double().mean(dim=(0, 2)), atol=1e-6)


def test_cache_refuses_windows_or_a_quantizer_the_artifact_does_not_have():
    """A calibrated artifact's clips hold for its windows; the runtime serves uniform INT2 only."""
    from runtime_kernels.artifact import identity_artifact
    from runtime_kernels.cache import PagedKVCache

    art = identity_artifact(1, 2, 4, 64, fmt=PAPER)
    art.metadata["key_target"] = "query_moment"  # as calibration writes it
    with pytest.raises(ValueError, match="sink_tokens=4 disagrees with the artifact's sink_tokens=64"):
        PagedKVCache.from_artifact(art, max_pages=2, max_seqs=1, fmt=served(art, sink=4))
    with pytest.raises(ValueError, match="recent_tokens=8 disagrees"):
        PagedKVCache.from_artifact(art, max_pages=2, max_seqs=1, fmt=served(art, recent=8))
    PagedKVCache.from_artifact(art, max_pages=2, max_seqs=1, fmt=served(art, page=8))  # another page size: fine
    fits_nothing = identity_artifact(1, 2, 4, 64, fmt=PAPER)
    PagedKVCache.from_artifact(fits_nothing, max_pages=2, max_seqs=1, fmt=served(fits_nothing, sink=4))
    restamp(art, quantizer="lloyd_max")  # a valid v2 artifact with codebooks: the contract allows it
    art.k_codebook = torch.tensor([0.0, 0.9, 2.1, 3.0]).expand(1, 2, 4).contiguous()
    with pytest.raises(ValueError, match="field 'quantizer' is 'lloyd_max'"):
        PagedKVCache.from_artifact(art, max_pages=2, max_seqs=1)
