"""Issue 21 class 6: a NaN, Inf or out-of-range key/value is refused at the write, naming layer, KV head,
sequence and position, in the torch path and the Triton path (interpreter on CPU) of runtime_kernels.cache.

The independent reference is the cache itself with the check turned off: there one NaN element makes every
later output of that KV head's query group NaN (what the policy prevents), while the other heads stay finite.
"""

from __future__ import annotations

import pytest
import torch
from format_helpers import PAPER, served
from test_cache import HQ, D, H, P, R, S, random_artifact

from runtime_kernels.artifact import identity_artifact
from runtime_kernels.cache import MAX_KV_MAGNITUDE, NonFiniteKVError, PagedKVCache

BACKENDS = [pytest.param("torch"), pytest.param("triton", marks=pytest.mark.interpreter)]


def make(art, backend, **kw):
    return PagedKVCache.from_artifact(art, max_pages=32, max_seqs=4, fmt=served(art, P, S, R), dtype=torch.float32,
                                      backend=backend, **kw)


def pool_state(cache):
    """Every stored tensor (clones), to prove a refused write changed nothing."""
    return [t.clone() for pool in cache.pools for t in (pool.k_codes, pool.v_codes, pool.k_scale, pool.k_zero,
                                                         pool.v_scale, pool.v_zero, pool.k_win, pool.v_win)]


def assert_same(before, cache):
    for a, b in zip(before, pool_state(cache)):
        assert torch.equal(a, b)


def tokens(n, gen):
    return torch.randn(n, H, D, generator=gen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad, what", [(float("nan"), "NaN"), (float("inf"), "infinite"), (-float("inf"), "infinite")])
@pytest.mark.parametrize("tensor", ["keys", "values"])
def test_prefill_with_a_bad_element_is_refused_and_changes_nothing(backend, bad, what, tensor):
    art = random_artifact(num_layers=2)
    cache = make(art, backend)
    gen = torch.Generator().manual_seed(0)
    ids = [cache.add_sequence(), cache.add_sequence()]
    prompts = {name: [[tokens(n, gen) for n in (9, 23)] for _ in range(2)] for name in ("keys", "values")}
    prompts[tensor][1][1][5, 1, 3] = bad  # layer 1, sequence ids[1], position 5, KV head 1
    before, free = pool_state(cache), cache.allocator.num_free
    with pytest.raises(NonFiniteKVError) as info:
        cache.append(ids, prompts["keys"], prompts["values"])
    message = str(info.value)
    assert f"{tensor}:" in message and what in message
    assert f"layer 1, KV head 1, sequence {ids[1]}, position 5" in message and "unchanged" in message
    assert [cache.seq_len(s) for s in ids] == [0, 0] and cache.allocator.num_free == free
    assert_same(before, cache)
    prompts[tensor][1][1][5, 1, 3] = 0.5  # the same step with finite data goes through
    cache.append(ids, prompts["keys"], prompts["values"])
    assert [cache.seq_len(s) for s in ids] == [9, 23] and cache.hist_len(ids[1]) > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_write_with_nan_names_the_position_and_fences_the_step(backend):
    """The transformers path books one plan, then writes layer after layer: a refusal at layer 1 leaves layer 0
    written, so the step's sequences refuse further use until freed; other sequences carry on."""
    art = random_artifact(num_layers=2)
    cache, clean = make(art, backend), make(art, backend)
    gen = torch.Generator().manual_seed(1)
    prompts = [tokens(n, gen) for n in (7, 19, 11)]
    for c in (cache, clean):
        ids = [c.add_sequence() for _ in prompts]
        c.append(ids, [prompts, prompts], [prompts, prompts])
    step = [tokens(2, gen) for _ in range(2)]
    plan = cache.plan_append(ids[:2], [1, 1])
    cache.write_layer(0, plan, step[0], step[0])
    poisoned = step[1].clone()
    poisoned[1, 0, 7] = float("nan")
    before = pool_state(cache)
    with pytest.raises(NonFiniteKVError, match=rf"layer 1, KV head 0, sequence {ids[1]}, position 19 .*free_sequence"):
        cache.write_layer(1, plan, poisoned, step[1])
    assert_same(before, cache)
    q = torch.randn(1, HQ, D, generator=gen)
    for seq in ids[:2]:
        with pytest.raises(NonFiniteKVError, match=f"sequence {seq} had a write refused"):
            cache.decode_attention(0, q, [seq])
        with pytest.raises(NonFiniteKVError, match="free it"):
            cache.plan_append([seq], [1])
    # The sequence outside the step is unaffected and still equals a cache that never saw the NaN.
    for layer in range(2):
        torch.testing.assert_close(cache.decode_attention(layer, q, [ids[2]]), clean.decode_attention(layer, q, [ids[2]]),
                                   atol=0, rtol=0)
    for seq in ids[:2]:
        cache.free_sequence(seq)
    fresh = cache.add_sequence()
    cache.append([fresh], [[prompts[0]], [prompts[0]]], [[prompts[0]], [prompts[0]]])
    assert bool(torch.isfinite(cache.decode_attention(1, q, [fresh])).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_step_that_demotes_a_page_is_refused_before_the_page_is_written(backend):
    art = random_artifact(num_layers=1)
    cache = make(art, backend)
    gen = torch.Generator().manual_seed(2)
    seq = cache.add_sequence()
    n = S + R + P - 1  # the next token makes the recent window overflow: one page is demoted
    cache.append([seq], [[tokens(n, gen)]], [[tokens(n, gen)]])
    assert cache.hist_len(seq) == 0
    bad = tokens(1, gen)
    bad[0, 1, 0] = float("nan")
    before, free = pool_state(cache), cache.allocator.num_free
    with pytest.raises(NonFiniteKVError, match=f"layer 0, KV head 1, sequence {seq}, position {n} "):
        cache.append([seq], [bad], [tokens(1, gen)])
    assert_same(before, cache)
    assert cache.seq_len(seq) == n and cache.allocator.num_free == free
    cache.append([seq], [tokens(1, gen)], [tokens(1, gen)])
    assert cache.hist_len(seq) == P


@pytest.mark.parametrize("backend", BACKENDS)
def test_magnitude_bound_is_the_fp16_scale_range(backend):
    art = identity_artifact(1, H, HQ, D, fmt=PAPER)  # identity rotation: the stored element is the input element
    cache = make(art, backend)
    seq = cache.add_sequence()
    ok = torch.zeros(3, H, D)
    ok[1, 0, 0] = MAX_KV_MAGNITUDE
    cache.append([seq], [[ok]], [[ok]])
    too_big = torch.zeros(1, H, D)
    too_big[0, 1, 2] = 70000.0
    with pytest.raises(NonFiniteKVError, match=r"7e\+04, beyond the fp16 range .* KV head 1, .* position 3 "):
        cache.append([seq], [too_big], [torch.zeros(1, H, D)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_the_check_one_nan_poisons_exactly_its_query_group(backend):
    """Why the policy exists (and that the check changes nothing for finite data)."""
    art = random_artifact(num_layers=1)
    checked, unchecked = make(art, backend), make(art, backend, check_finite=False)
    gen = torch.Generator().manual_seed(3)
    prompt = tokens(S + R + 2 * P, gen)
    q = torch.randn(1, HQ, D, generator=gen)
    outs = []
    for cache in (checked, unchecked):
        seq = cache.add_sequence()
        cache.append([seq], [[prompt]], [[prompt]])
        outs.append(cache.decode_attention(0, q, [seq]))
    assert torch.equal(outs[0], outs[1])
    bad = tokens(1, gen)
    bad[0, 1, 4] = float("nan")
    unchecked.append([0], [bad], [bad])
    for _ in range(2 * P):  # the NaN token stays attended while it moves from the window into the INT2 history
        unchecked.append([0], [tokens(1, gen)], [tokens(1, gen)])
    out = unchecked.decode_attention(0, q, [0])[0]  # [HQ, d]; query heads 2, 3 read KV head 1
    group = HQ // H
    assert bool(torch.isnan(out[group:]).all()) and bool(torch.isfinite(out[:group]).all())
