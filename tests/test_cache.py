"""Paged three-segment INT2 KV cache (runtime_kernels.cache) against independent dense references.

The reference for a sequence of n tokens follows the documented split: sink = first S tokens, history =
the next h = P * floor(max(0, n - S - R) / P) tokens (2-bit, via naive.fake_quantize in the original
basis), recent = the rest; attention is naive.segment_attention over the concatenation.
"""

from __future__ import annotations

import pytest
import torch
from format_helpers import PAPER, qfmt, served

from runtime_kernels.artifact import identity_artifact
from runtime_kernels.attention import naive as attn_naive
from runtime_kernels.attention.int2_decode.pools import quad_pools
from runtime_kernels.cache import PagedKVCache
from runtime_kernels.quant import naive as quant_naive

S, R, P = 4, 8, 4  # small sink / recent / page so short sequences use all three segments
H, HQ, D, G = 2, 4, 16, 8


def random_artifact(num_layers=2, clip=(0.9, 0.95), seed=0, group=G, quantizer="uniform_minmax"):
    """An artifact with random orthogonal per-head rotations and clip ratios below 1."""
    art = identity_artifact(num_layers, H, HQ, D, group_size=group, fmt=PAPER.with_(quantizer=quantizer))
    gen = torch.Generator().manual_seed(seed)
    for name in ("k_rotation", "v_rotation"):
        q, _ = torch.linalg.qr(torch.randn(num_layers, H, D, D, generator=gen, dtype=torch.float64))
        setattr(art, name, q.float().contiguous())
    art.k_clip_ratio = torch.full((num_layers, H), clip[0])
    art.v_clip_ratio = torch.full((num_layers, H), clip[1])
    return art.validate()


def make_cache(art, max_pages=64, max_seqs=8, **kw):
    return PagedKVCache.from_artifact(art, max_pages=max_pages, max_seqs=max_seqs, fmt=served(art, P, S, R),
                                      dtype=torch.float32, backend="torch", **kw)


def exact_rotate(x, rotation):
    """x [T, H, d] @ R [H, d, d] rounded once from fp64 (the rotated rows the cache stores)."""
    return (x.double().unsqueeze(-2) @ rotation.double()).squeeze(-2).float()


def expected_history(n):
    return P * (max(0, n - S - R) // P)


def reference_attention(art, layer, q, k, v):
    """q [H_q, d]; k, v [n, H, d] original-basis tokens of one sequence -> o [H_q, d] (fp32)."""
    n = k.shape[0]
    h = expected_history(n)
    segs_k, segs_v = [k[:S]], [v[:S]]
    if h:
        q_ = art.quantizer
        segs_k.append(quant_naive.fake_quantize(k[S:S + h], art.k_rotation[layer], art.k_clip_ratio[layer], qfmt(G, quantizer=q_)))
        segs_v.append(quant_naive.fake_quantize(v[S:S + h], art.v_rotation[layer], art.v_clip_ratio[layer], qfmt(G, quantizer=q_)))
    segs_k.append(k[S + h:])
    segs_v.append(v[S + h:])
    kk = torch.cat(segs_k).transpose(0, 1)[None]  # [1, H, n, d]
    vv = torch.cat(segs_v).transpose(0, 1)[None]
    o, _ = attn_naive.segment_attention(q[None], kk, vv)
    return o[0]


class Workload:
    """Random tokens per (layer, sequence), kept in full so the reference can be rebuilt at any step."""

    def __init__(self, cache, num_layers, seed=1):
        self.cache, self.num_layers = cache, num_layers
        self.gen = torch.Generator().manual_seed(seed)
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}

    def tokens(self, n):
        return [torch.randn(n, H, D, generator=self.gen) for _ in range(self.num_layers)]

    def prefill(self, lengths):
        ids = [self.cache.add_sequence() for _ in lengths]
        ks = [self.tokens(n) for n in lengths]  # [seq][layer]
        vs = [self.tokens(n) for n in lengths]
        self.cache.append(ids, [[ks[b][i] for b in range(len(ids))] for i in range(self.num_layers)],
                          [[vs[b][i] for b in range(len(ids))] for i in range(self.num_layers)])
        for b, s in enumerate(ids):
            self.k[s], self.v[s] = ks[b], vs[b]
        return ids

    def decode_step(self, ids):
        kn, vn = self.tokens(len(ids)), self.tokens(len(ids))  # [layer] of [B, H, d]
        self.cache.append(ids, kn, vn)
        for b, s in enumerate(ids):
            for i in range(self.num_layers):
                self.k[s][i] = torch.cat([self.k[s][i], kn[i][b:b + 1]])
                self.v[s][i] = torch.cat([self.v[s][i], vn[i][b:b + 1]])

    def check(self, art, ids, atol=2e-5):
        q = torch.randn(len(ids), HQ, D, generator=self.gen)
        for i in range(self.num_layers):
            got = self.cache.decode_attention(i, q, ids)
            for b, s in enumerate(ids):
                want = reference_attention(art, i, q[b], self.k[s][i], self.v[s][i])
                torch.testing.assert_close(got[b], want, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("quantizer", ["uniform_minmax", "uniform_unbiased"])
def test_decode_matches_dense_fake_quantized_reference(quantizer):
    art = random_artifact(quantizer=quantizer)
    cache = make_cache(art)
    work = Workload(cache, art.num_layers)
    ids = work.prefill([3, 14, 37])  # sink only / sink+recent / all three segments
    work.check(art, ids)
    for _ in range(9):  # crosses the sink boundary and several demotions
        work.decode_step(ids)
        work.check(art, ids)
    assert [cache.hist_len(s) for s in ids] == [expected_history(cache.seq_len(s)) for s in ids]
    assert cache.hist_len(ids[2]) > expected_history(37)  # decoding demoted at least one more page


@pytest.mark.parametrize("group", [G, D])  # D: one group per row, V scale and zero in one interleaved buffer
def test_demotion_keeps_segment_sizes_and_int2_codes_equal_quantize_pack(group):
    art = random_artifact(num_layers=1, group=group)
    cache = make_cache(art)
    work = Workload(cache, 1)
    (s,) = work.prefill([S + R + P - 2])  # one token short of the first demotion
    for _ in range(3 * P + 1):
        work.decode_step([s])
        n = cache.seq_len(s)
        h = cache.hist_len(s)
        assert h == expected_history(n) and h % P == 0
        recent = n - S - h
        assert R <= recent < R + P or h == 0
        meta = cache.batch_metadata([s])
        assert int(meta.win_len[0]) == S + recent and int(meta.hist_len[0]) == h
        pool = cache.pools[0]
        # the window holds exactly sink + recent, in token order, rotated (exactly rounded) but not quantized
        window_tokens = torch.cat([work.k[s][0][:S], work.k[s][0][S + h:]])
        torch.testing.assert_close(pool.k_win[cache.slot(s), :, :S + recent].transpose(0, 1),
                                   exact_rotate(window_tokens, art.k_rotation[0]), atol=0, rtol=0)
        if h:
            pages = torch.tensor(cache.pages(s))
            for name, x, rot, clip in (("k", work.k[s][0], art.k_rotation[0], art.k_clip_ratio[0]),
                                       ("v", work.v[s][0], art.v_rotation[0], art.v_clip_ratio[0])):
                # the quantizer given the same rotated rows; naive's own fp32 rotation agrees almost everywhere
                packed, scale, zero = quant_naive.quantize_pack(exact_rotate(x[S:S + h], rot), None, clip, qfmt(group))
                fp32_packed = quant_naive.quantize_pack(x[S:S + h], rot, clip, qfmt(group))[0]
                assert (fp32_packed == packed).float().mean() > 0.99
                codes = getattr(pool, f"{name}_codes")[pages].permute(0, 2, 1, 3).reshape(h, H, D // 4)
                sc = getattr(pool, f"{name}_scale")[pages].permute(0, 2, 1, 3).reshape(h, H, D // group)
                ze = getattr(pool, f"{name}_zero")[pages].permute(0, 2, 1, 3).reshape(h, H, D // group)
                assert torch.equal(codes, packed)
                assert torch.equal(sc, scale) and torch.equal(ze, zero)


def test_quantization_runs_a_page_at_a_time():
    art = random_artifact(num_layers=1)
    cache = make_cache(art)
    (s,) = Workload(cache, 1).prefill([S + R])
    demoted = []
    for _ in range(2 * P):
        plan = cache.plan_append([s], [1])
        cache.write_layer(0, plan, torch.randn(1, H, D), torch.randn(1, H, D))
        demoted.append(plan.demote_src.numel())
        assert plan.gather_rows.numel() in (0, R + P - 1)  # rows only move on a demotion step
    assert sorted(demoted) == [0] * (2 * P - 2) + [P, P]  # P tokens quantized once every P steps


def test_ragged_batched_prefill_equals_separate_prefills():
    art = random_artifact()
    batched, single = make_cache(art), make_cache(art)
    wb = Workload(batched, art.num_layers, seed=3)
    ids = wb.prefill([5, 30, 21])
    ref_ids = []
    for s in ids:  # same tokens, one sequence at a time, into another cache
        sid = single.add_sequence()
        single.append([sid], [[wb.k[s][i]] for i in range(art.num_layers)],
                      [[wb.v[s][i]] for i in range(art.num_layers)])
        ref_ids.append(sid)
    q = torch.randn(3, HQ, D)
    for i in range(art.num_layers):
        torch.testing.assert_close(batched.decode_attention(i, q, ids), single.decode_attention(i, q, ref_ids),
                                   atol=1e-6, rtol=1e-6)


def test_chunked_appends_equal_one_prefill():
    art = random_artifact()
    a, b = make_cache(art), make_cache(art)
    work = Workload(a, art.num_layers, seed=4)
    (s,) = work.prefill([43])
    t = b.add_sequence()
    for lo, hi in ((0, 3), (3, 19), (19, 20), (20, 43)):
        b.append([t], [[work.k[s][i][lo:hi]] for i in range(art.num_layers)],
                 [[work.v[s][i][lo:hi]] for i in range(art.num_layers)])
    q = torch.randn(1, HQ, D)
    for i in range(art.num_layers):
        torch.testing.assert_close(a.decode_attention(i, q, [s]), b.decode_attention(i, q, [t]), atol=1e-6,
                                   rtol=1e-6)
        k, v = b.dense_kv(i, t)  # dense view: sink | dequantized history | recent, original basis
        h = expected_history(43)
        want = quant_naive.fake_quantize(work.k[s][i][S:S + h], art.k_rotation[i], art.k_clip_ratio[i], qfmt(G))
        torch.testing.assert_close(k[S:S + h], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[:S], work.v[s][i][:S])


def test_free_sequence_returns_pages_and_slot():
    art = random_artifact(num_layers=1)
    cache = make_cache(art, max_pages=16, max_seqs=2)
    work = Workload(cache, 1)
    ids = work.prefill([40, 33])
    used = 16 - cache.allocator.num_free
    assert used == sum(expected_history(n) // P for n in (40, 33)) > 0
    cache.free_sequence(ids[0])
    assert cache.allocator.num_free == 16 - expected_history(33) // P
    cache.free_sequence(ids[1])
    assert cache.allocator.num_free == 16 and cache.live_sequences == []
    again = work.prefill([40, 33])  # slots and pages are reusable
    work.check(art, again)
    with pytest.raises(KeyError, match="seq_id"):
        cache.free_sequence(ids[0])


def test_prefix_sharing_reuses_pages_and_matches_unshared():
    art = random_artifact()
    cache = make_cache(art)
    work = Workload(cache, art.num_layers, seed=5)
    (a,) = work.prefill([41])
    b = cache.fork_sequence(a)
    assert cache.pages(b) == cache.pages(a) and len(cache.pages(a)) == expected_history(41) // P
    assert all(cache.allocator.refcount[p] == 2 for p in cache.pages(a))
    # the same prompt prefilled without sharing
    (c,) = work.prefill([0])
    cache.append([c], [[work.k[a][i]] for i in range(art.num_layers)], [[work.v[a][i]] for i in range(art.num_layers)])
    assert set(cache.pages(c)).isdisjoint(cache.pages(a))
    work.k[b] = [x.clone() for x in work.k[a]]
    work.v[b] = [x.clone() for x in work.v[a]]
    work.k[c], work.v[c] = [x.clone() for x in work.k[a]], [x.clone() for x in work.v[a]]
    q = torch.randn(1, HQ, D)
    for i in range(art.num_layers):
        torch.testing.assert_close(cache.decode_attention(i, q, [b]), cache.decode_attention(i, q, [c]),
                                   atol=0, rtol=0)
    shared = cache.pages(a)
    for _ in range(2 * P + 1):  # the branches diverge; each demotes into its own pages
        work.decode_step([a, b, c])
        work.check(art, [a, b, c])
    assert cache.pages(a)[:len(shared)] == shared == cache.pages(b)[:len(shared)]
    assert set(cache.pages(a)[len(shared):]).isdisjoint(cache.pages(b)[len(shared):])
    free_before = cache.allocator.num_free
    cache.free_sequence(a)
    assert all(cache.allocator.refcount[p] == 1 for p in shared)  # b still holds the prefix
    assert cache.allocator.num_free == free_before + len(cache.pages(b)) - len(shared)
    work.check(art, [b])


def test_out_of_pages_raises_and_changes_nothing():
    art = random_artifact(num_layers=1)
    cache = make_cache(art, max_pages=2)
    s = cache.add_sequence()
    k = torch.randn(S + R + 3 * P, H, D)
    with pytest.raises(RuntimeError, match="out of INT2 pages"):
        cache.append([s], [[k]], [[k]])
    assert cache.seq_len(s) == 0 and cache.allocator.num_free == 2
    with pytest.raises(RuntimeError, match="out of window slots"):
        small = make_cache(art, max_seqs=1)
        small.add_sequence()
        small.add_sequence()


def test_bad_inputs_name_the_tensor():
    art = random_artifact(num_layers=1)
    cache = make_cache(art)
    s = cache.add_sequence()
    good = torch.randn(1, H, D)
    with pytest.raises(TypeError, match=r"keys\[0\].*dtype"):
        cache.append([s], [good.to(torch.int32)], [good])
    with pytest.raises(ValueError, match=r"values\[0\].*shape"):
        cache.append([s], [good], [torch.randn(1, H + 1, D)])
    with pytest.raises(ValueError, match="keys.*device"):
        cache.write_layer(0, cache.plan_append([s], [0]), good[:0].to("meta"), good[:0])
    assert cache.seq_len(s) == 0  # nothing was booked by the failed appends
    cache.append([s], [good], [good])
    with pytest.raises(ValueError, match="q: expected shape"):
        cache.decode_attention(0, torch.randn(1, HQ, D + 4), [s])
    with pytest.raises(TypeError, match="q: dtype"):
        cache.decode_attention(0, torch.zeros(1, HQ, D, dtype=torch.int64), [s])
    with pytest.raises(KeyError, match="seq_id"):
        cache.decode_attention(0, torch.randn(1, HQ, D), [99])
    with pytest.raises(IndexError, match="layer"):
        cache.decode_attention(3, torch.randn(1, HQ, D), [s])
    empty = cache.add_sequence()
    with pytest.raises(ValueError, match="seq_ids.*no tokens"):
        cache.decode_attention(0, torch.randn(1, HQ, D), [empty])
    with pytest.raises(TypeError, match="artifact"):
        PagedKVCache.from_artifact({"k_rotation": 1}, max_pages=1, max_seqs=1)
    with pytest.raises(ValueError, match="k_clip_ratio"):
        PagedKVCache(art.k_rotation, art.v_rotation, art.k_clip_ratio[:, :1], art.v_clip_ratio, fmt=PAPER,
                     max_pages=1, max_seqs=1)
    with pytest.raises(ValueError, match="group_size"):  # 12 is a multiple of 4 that does not divide D = 16
        PagedKVCache(art.k_rotation, art.v_rotation, art.k_clip_ratio, art.v_clip_ratio,
                     fmt=PAPER.with_(group_size=12), max_pages=1, max_seqs=1)
    with pytest.raises(ValueError, match="k_mean: the format is centered"):
        PagedKVCache(art.k_rotation, art.v_rotation, art.k_clip_ratio, art.v_clip_ratio,
                     fmt=PAPER.with_(centered=True), max_pages=1, max_seqs=1)
    with pytest.raises(ValueError, match="scale_format='ue5m3' disagrees with the artifact's scale_format='float16'"):
        PagedKVCache.from_artifact(art, max_pages=1, max_seqs=1, fmt=served(art).with_(scale_format="ue5m3"))


def test_pool_layout_matches_the_contract():
    art = random_artifact(num_layers=1)
    cache = make_cache(art, max_pages=10, max_seqs=3)
    pool = cache.pools[0]
    w = S + R + P - 1
    assert pool.k_codes.shape == (10, H, P, D // 4) and pool.k_codes.dtype == torch.uint8
    assert pool.v_scale.shape == (10, H, P, D // G) and pool.v_scale.dtype == torch.float16
    assert pool.k_win.shape == (3, H, w, D)
    # 2 bits per element plus an fp16 scale and zero per group, for K and V, plus the windows
    assert cache.memory_bytes() == 2 * 10 * H * P * (D // 4 + 2 * 2 * (D // G)) + 2 * 3 * H * w * D * 4
    assert all(t.is_contiguous() for t in (pool.k_codes, pool.v_codes, pool.k_scale, pool.k_zero, pool.v_scale,
                                           pool.v_zero, pool.k_win, pool.v_win))


def test_one_group_per_row_interleaves_the_four_scale_and_zero_pools():
    """With one group per row the K scale, K zero, V scale and V zero pools are the four quarters of one
    `[pages, H, P, 4]` buffer (what the whole-page decode loop reads with one load per row,
    `int2_decode.pools.quad_pools`); same shapes and bytes."""
    art = random_artifact(num_layers=2, group=D)
    cache = make_cache(art, max_pages=10, max_seqs=3)
    for pool in cache.pools:
        sz = (pool.k_scale, pool.k_zero, pool.v_scale, pool.v_zero)
        assert all(t.shape == (10, H, P, 1) for t in sz)
        assert quad_pools(*sz)
        assert pool.k_scale.untyped_storage().nbytes() == 10 * H * P * 4 * 2  # one buffer, nothing else
        for t, v in zip(sz, (5.0, -7.0, 3.0, 0.5)):
            t[3, 1, 2, 0] = v
        quad = pool.k_scale.as_strided((10, H, P, 4), (H * P * 4, P * 4, 4, 1))
        assert quad[3, 1, 2].tolist() == [5.0, -7.0, 3.0, 0.5]
    assert cache.pools[0].k_scale.data_ptr() != cache.pools[1].k_scale.data_ptr()  # one buffer per layer
    w = S + R + P - 1
    assert cache.memory_bytes() == 2 * (2 * 10 * H * P * (D // 4 + 2 * 2) + 2 * 3 * H * w * D * 4)


@pytest.mark.interpreter
@pytest.mark.parametrize("group", [G, D])  # D: V scale and zero interleaved (the Triton demotion writes strided rows)
def test_triton_backend_matches_torch_backend(group):
    """The same workload through the Triton kernels (interpreter on CPU) and the torch references."""
    art = random_artifact(num_layers=1, group=group)
    caches = {b: PagedKVCache.from_artifact(art, max_pages=16, max_seqs=2, fmt=served(art, P, S, R),
                                            dtype=torch.float32, backend=b)
              for b in ("torch", "triton")}
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randn(n, H, D, generator=gen) for n in (9, 27)]
    steps = [torch.randn(2, H, D, generator=gen) for _ in range(P)]
    q = torch.randn(2, HQ, D, generator=gen)
    out = {}
    for b, cache in caches.items():
        ids = [cache.add_sequence(), cache.add_sequence()]
        cache.append(ids, [prompts], [prompts])
        for x in steps:  # includes one demotion of the longer sequence
            cache.append(ids, [x], [x])
        out[b] = cache.decode_attention(0, q, ids)
        assert cache.hist_len(ids[1]) == expected_history(27 + P) > 0
    torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)
    for name in ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero"):
        assert torch.equal(getattr(caches["triton"].pools[0], name), getattr(caches["torch"].pools[0], name)), name


def test_cuda_device_without_index_is_normalized(monkeypatch):
    """`device="cuda"` must compare equal to tensors on `cuda:0` (found on the H200: every append was refused)."""
    from runtime_kernels._validate import normalize_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert normalize_device("cuda") == torch.device("cuda", 0)
    assert normalize_device("cuda:1") == torch.device("cuda", 1)
    assert normalize_device("cpu") == torch.device("cpu")
