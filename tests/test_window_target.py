"""The window-aware key target against an explicit per-query loop (oscar_calib.calibration.window_target)."""

from __future__ import annotations

import math

import pytest
import torch

from oscar_calib.calibration.window_target import (
    blend_targets,
    far_attention_weights,
    window_aware_key_target,
)
from oscar_calib.errors import InputError
from runtime_kernels.format import DEFAULT_FORMAT

S, H_KV, G, T, D, N_Q = 2, 2, 3, 24, 8, 7
SINK, RECENT = 2, 5
FMT = DEFAULT_FORMAT.with_(sink_tokens=SINK, recent_tokens=RECENT)


def data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(S, H_KV, T, D, generator=gen, dtype=torch.float64) * 1.5
    queries = torch.randn(S, H_KV * G, N_Q, D, generator=gen, dtype=torch.float64) * 1.5
    # Positions from 0 (no INT2 key: weight 0) to T - 1, different per sequence.
    positions = torch.stack([torch.tensor([0, 3, 7, 8, 13, 19, 23]), torch.tensor([1, 6, 9, 12, 16, 20, 22])])
    return keys, queries, positions, D ** -0.5


def loop_reference(keys, queries, positions, scaling, power: int) -> torch.Tensor:
    """M_far per KV head by plain Python loops: softmax over j <= t, INT2 iff sink <= j < t + 1 - recent."""
    out = torch.zeros(H_KV, D, D, dtype=torch.float64)
    total = [0.0] * H_KV
    for s in range(S):
        for i in range(H_KV * G):
            h = i // G
            for n in range(N_Q):
                t = int(positions[s, n])
                q = queries[s, i, n]
                logits = [float(q @ keys[s, h, j]) * scaling for j in range(t + 1)]
                m = max(logits)
                z = sum(math.exp(x - m) for x in logits)
                w = sum((math.exp(logits[j] - m) / z) ** power for j in range(t + 1) if SINK <= j < t + 1 - RECENT)
                out[h] += w * torch.outer(q, q)
                total[h] += w
    return out / torch.tensor(total, dtype=torch.float64)[:, None, None]


@pytest.mark.parametrize(("weighting", "power"), [("mass", 1), ("mass2", 2)])
def test_weighted_target_matches_a_per_query_loop(weighting, power):
    keys, queries, positions, scaling = data()
    got = window_aware_key_target(keys, queries, positions, scaling, FMT, weighting)
    want = loop_reference(keys, queries, positions, scaling, power)
    assert got.shape == (H_KV, D, D) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_queries_that_read_no_int2_key_weigh_nothing():
    keys, queries, positions, scaling = data(1)
    w = far_attention_weights(keys, queries, positions, scaling, FMT, "mass")  # [S, H_kv, g, n_q]
    reads_history = (positions + 1 - RECENT > SINK)[:, None, None, :].expand_as(w)  # some sink <= j < t + 1 - recent
    assert 0 < int(reads_history.sum()) < reads_history.numel()  # the data has both kinds of query
    assert bool((w[~reads_history] == 0).all())
    assert bool((w[reads_history] > 0).all()) and bool((w <= 1 + 1e-12).all())


def test_uniform_weights_give_the_plain_query_second_moment():
    keys, queries, positions, scaling = data(2)
    got = window_aware_key_target(keys, queries, positions, scaling, FMT, "uniform")
    q = queries.reshape(S, H_KV, G * N_Q, D).transpose(0, 1).reshape(H_KV, -1, D)  # group h's queries, all rows
    torch.testing.assert_close(got, q.transpose(1, 2) @ q / q.shape[1], rtol=1e-12, atol=1e-12)


def test_weighting_changes_the_target():
    keys, queries, positions, scaling = data(3)
    plain = window_aware_key_target(keys, queries, positions, scaling, FMT, "uniform")
    far = window_aware_key_target(keys, queries, positions, scaling, FMT, "mass")
    assert float((far - plain).abs().max()) > 1e-3 * float(plain.abs().max())


def test_windows_covering_every_query_raise_a_clear_error():
    keys, queries, positions, scaling = data()
    wide = DEFAULT_FORMAT.with_(sink_tokens=16, recent_tokens=16)  # 32 >= T: no INT2 pair at all
    with pytest.raises(InputError, match="no held-out query reads an INT2 key"):
        window_aware_key_target(keys, queries, positions, scaling, wide, "mass")


def test_bad_inputs_are_refused():
    keys, queries, positions, scaling = data()
    with pytest.raises(InputError, match="weighting 'softmax'"):
        window_aware_key_target(keys, queries, positions, scaling, FMT, "softmax")
    with pytest.raises(InputError, match="queries"):
        window_aware_key_target(keys, queries[:, :-1], positions, scaling, FMT)
    with pytest.raises(InputError, match="positions"):
        window_aware_key_target(keys, queries, positions[:, :-1], scaling, FMT)


def test_blend_mixes_trace_normalised_targets():
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(2, H_KV, 20, D, generator=gen, dtype=torch.float64)
    a, b = x.transpose(-1, -2) @ x, 50 * y.transpose(-1, -2) @ y  # different scales
    got = blend_targets(a, b, 0.25)
    for h in range(H_KV):
        want = 0.25 * a[h] / torch.trace(a[h]) + 0.75 * b[h] / torch.trace(b[h])
        torch.testing.assert_close(got[h], want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(blend_targets(a, b, 1.0), blend_targets(a, 3 * a, 0.5))  # scale-free
    with pytest.raises(InputError, match="alpha"):
        blend_targets(a, b, 1.5)
