"""Decode attention kernels (production INT2 kernel, fallback, window, grid, split reduce) against the torch
references, under TRITON_INTERPRET=1 on CPU.

Bounds: about 10x the error measured against the fp32 reference of the dequantized pools (rel. RMSE, seeds as
below, `/tmp` script in the kernels report): production kernel <= 1.0e-4 with fp16/bf16 queries (fp16 rounding of
p * scale, the int8 hi/lo query), fallback with fp32 queries 6.5e-7, fallback with bf16 queries and 32-channel
groups 5.2e-3 (bf16 dequantized operands), window/grid with bf16 windows <= 2.2e-3 (bf16 probabilities).
A history that drops its last token moves the output by >= 1.2e-3 at these shapes, so it fails HALF_BOUND.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from format_helpers import PAPER, qfmt
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_kernels import attention as A
from runtime_kernels.attention import BatchMetadata, PagePools, Windows
from runtime_kernels.attention import naive as attn_naive
from runtime_kernels.attention.int2_decode import launch as L
from runtime_kernels.attention.int2_decode import merge as M
from runtime_kernels.attention.int2_decode import naive as paged_ref
from runtime_kernels.attention.int2_decode import splits
from runtime_kernels.quant import naive as qnaive
from tests.kernel_helpers import (
    assert_lse_close,
    batch_of,
    decode_inputs,
    dense_reference,
    make_pool,
    make_q,
    make_window,
    pages_of,
    pool_format,
    rel_rmse,
)

pytestmark = pytest.mark.interpreter  # Triton kernels on CPU tensors (see conftest)

HALF_BOUND = 8e-4  # production kernel, fp16/bf16 queries (measured <= 1.0e-4)
HALF_LSE = 2e-3  # int8 hi/lo query at head_dim 128/256 (measured <= 2.5e-4)
FP32_BOUND = 1e-5  # fallback with fp32 queries (measured 6.5e-7)
WINDOW_BOUND = 2e-2  # bf16 window operands and probabilities (measured <= 2.2e-3)


# -------------------------------------------------------------------------------------- INT2 history
@pytest.mark.parametrize("d,group", [(64, 8), (128, 4), (256, 1), (128, 1)])
@pytest.mark.parametrize("whole", [True, False])
def test_production_history_kernel_matches_the_reference(d, group, whole):
    lens = [256, 0, 128] if whole else [130, 0, 71]
    pool = make_pool(lens, 2, d, 64, seed=d + group)
    q = make_q(3, 2 * group, d, torch.bfloat16)
    assert A.decode_plan(q, pages_of(pool), whole_pages=whole).kernel == "production"
    o, lse = A.int2_decode_attention(q, pages_of(pool), batch_of(pool, whole_pages=whole), backend="triton",
                                     num_splits=2)
    want_o, want_lse = dense_reference(q, pool, lens)
    assert rel_rmse(o, want_o) < HALF_BOUND
    assert_lse_close(lse, want_lse, HALF_LSE)
    assert (o[1] == 0).all() and torch.isneginf(lse[1]).all()  # the empty history
    # A history that lost its last token is outside the bound: the bound would catch an off-by-one.
    dropped, _ = dense_reference(q, pool, [max(0, n - 1) for n in lens])
    assert rel_rmse(o, dropped) > HALF_BOUND


def test_production_kernel_with_fp16_queries_and_one_split():
    lens = [192, 64]
    pool = make_pool(lens, 2, 128, 64, seed=5)
    q = make_q(2, 8, 128, torch.float16)
    o, lse = A.int2_decode_attention(q, pages_of(pool), batch_of(pool, whole_pages=True), backend="triton",
                                     num_splits=1)
    want_o, want_lse = dense_reference(q, pool, lens)
    assert rel_rmse(o, want_o) < HALF_BOUND
    assert_lse_close(lse, want_lse, HALF_LSE)


def test_int8_scores_equal_the_reference_of_their_query():
    """At head_dim 128 with whole pages the scores come from int8 MMAs against the hi/lo split of the query:
    the kernel is then closer to the attention of `hilo_query_ref(q)` than the bound, and that query is within
    max|q| / 64516 of q."""
    lens = [256, 128]
    pool = make_pool(lens, 2, 128, 64, seed=9)
    q = make_q(2, 8, 128, torch.bfloat16, seed=3)
    assert A.decode_plan(q, pages_of(pool), whole_pages=True).int8_scores
    o, _ = A.int2_decode_attention(q, pages_of(pool), batch_of(pool, whole_pages=True), backend="triton",
                                   num_splits=2)
    want, _ = dense_reference(paged_ref.hilo_query_ref(q), pool, lens)
    assert rel_rmse(o, want) < HALF_BOUND


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 2 ** 31 - 1), st.sampled_from([64, 128, 256]), st.floats(1e-3, 1e3))
def test_hilo_query_is_within_its_bound(seed, d, scale):
    q = torch.randn(3, 4, d, generator=torch.Generator().manual_seed(seed)) * scale
    err = (paged_ref.hilo_query_ref(q) - q).abs().amax(dim=-1)
    assert (err <= q.abs().amax(dim=-1) / 64516 * 1.01 + 1e-30).all()


@pytest.mark.parametrize("case", ["fp32_queries", "group32", "page16"])
def test_fallback_kernel_matches_the_reference(case):
    lens = [130, 0, 71]
    # group32: the tile is dequantized into bf16 operands (measured: o 5.2e-3, lse 3.8e-2)
    group_size, page, dtype, bound, lse_bound = {"fp32_queries": (None, 64, torch.float32, FP32_BOUND, 1e-4),
                                                 "group32": (32, 64, torch.bfloat16, 4e-2, 0.3),
                                                 "page16": (None, 16, torch.bfloat16, HALF_BOUND, HALF_LSE)}[case]
    pool = make_pool(lens, 2, 128, page, group_size=group_size, seed=3)
    q = make_q(3, 8, 128, dtype)
    assert A.decode_plan(q, pages_of(pool)).kernel == "fallback"
    o, lse = A.int2_decode_attention(q, pages_of(pool), batch_of(pool), backend="triton", num_splits=2)
    want_o, want_lse = dense_reference(q, pool, lens)
    assert rel_rmse(o, want_o) < bound
    assert_lse_close(lse, want_lse, lse_bound)


def test_production_kernel_ignores_garbage_past_the_end_of_a_page():
    """The masked tile reads whole pages unmasked: rows past the history (NaN scales, random codes) must not leak."""
    lens = [70]
    pool = list(make_pool(lens, 1, 64, 64, seed=4))
    want_o, want_lse = dense_reference(make_q(1, 4, 64, torch.bfloat16), pool, lens)
    last = int(pool[6][0, 1])
    for i in (1, 2, 4, 5):
        pool[i] = pool[i].clone()
        pool[i][last, :, 6:] = float("nan")
    o, lse = A.int2_decode_attention(make_q(1, 4, 64, torch.bfloat16), pages_of(pool), batch_of(pool),
                                     backend="triton")
    assert torch.isfinite(o).all()
    assert rel_rmse(o, want_o) < HALF_BOUND


def test_production_kernel_reads_more_than_one_block_of_page_ids():
    """Page ids are read 64 at a time: a 65-page chunk takes a second block (masked tiles: the same page-id loop,
    faster under the interpreter than the whole-page pieces)."""
    lens = [65 * 64]
    pool = make_pool(lens, 1, 32, 64, seed=8, extra_pages=0)
    q = make_q(1, 4, 32, torch.bfloat16)
    o, lse = A.int2_decode_attention(q, pages_of(pool), batch_of(pool), backend="triton", num_splits=1)
    want_o, want_lse = dense_reference(q, pool, lens)
    assert rel_rmse(o, want_o) < HALF_BOUND


def test_reference_matches_dense_attention_on_dequantized_history():
    """paged_ref against a direct computation: dequantize every page in order, then plain softmax attention."""
    pool = make_pool([70], h_kv=1, d=64, page=16, seed=12)
    kc, ks, kz, vc, vs, vz, table, lens = pool
    q = make_q(1, 2, 64, torch.float32)
    ids = table[0, :5].long()
    k = qnaive.unpack_dequantize(kc[ids], ks[ids], kz[ids], qfmt()).transpose(0, 1).reshape(1, -1, 64)[:, :70]
    v = qnaive.unpack_dequantize(vc[ids], vs[ids], vz[ids], qfmt()).transpose(0, 1).reshape(1, -1, 64)[:, :70]
    scores = q[0] @ k[0].T / math.sqrt(64)
    want = torch.softmax(scores, dim=-1) @ v[0]
    o, lse = paged_ref.int2_decode_attention_ref(q, *pool, fmt=pool_format(pool))
    assert torch.allclose(o[0], want, atol=1e-5)
    assert torch.allclose(lse[0], torch.logsumexp(scores, dim=-1), atol=1e-5)


# -------------------------------------------------------------------------------------- window
@pytest.mark.parametrize("dtype,group,d", [(torch.float32, 4, 64), (torch.bfloat16, 8, 128), (torch.bfloat16, 1, 256)])
def test_window_attention(dtype, group, d):
    k_win, v_win = make_window(5, 2, 80, d, dtype)
    slot_ids = torch.tensor([3, 0, 4, 1], dtype=torch.int32)
    win_len = torch.tensor([80, 0, 1, 63], dtype=torch.int32)
    q = make_q(4, 2 * group, d, dtype)
    o, lse = A.window_attention(q, Windows(k_win, v_win), BatchMetadata(slot_ids=slot_ids, win_len=win_len),
                                backend="triton", num_splits=2)
    o_ref, lse_ref = paged_ref.window_attention_ref(q, k_win, v_win, slot_ids, win_len)
    assert rel_rmse(o, o_ref) < (FP32_BOUND if dtype == torch.float32 else WINDOW_BOUND)
    assert_lse_close(lse, lse_ref, 1e-3)


# -------------------------------------------------------------------------------------- full decode call
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("d,group,whole", [(128, 4, True), (64, 8, False), (256, 1, True)])
def test_decode_grid_matches_the_concatenated_softmax(fused, d, group, whole):
    """The production grid (one launch with the in-kernel reduce, or two) against one softmax over the dequantized
    history ++ window. Neither the separate history nor the window launcher may run."""
    lens = [128, 0, 64, 0] if whole else [130, 0, 71, 0]
    pool = make_pool(lens, 2, d, 64, seed=60 + group)
    k_win, v_win = make_window(5, 2, 40, d, torch.bfloat16, seed=7)
    slot_ids = torch.tensor([4, 0, 3, 1], dtype=torch.int32)
    win_len = torch.tensor([40, 33, 0, 0], dtype=torch.int32)  # the last sequence is empty: o = 0, lse = -inf
    q = make_q(4, 2 * group, d, torch.bfloat16)
    counters = torch.zeros(8, dtype=torch.int32)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(L, "launch_history", None)
        m.setattr(L.window, "launch_window_decode", None)
        o, lse = A.decode_attention(q, *decode_inputs(pool, k_win, v_win, slot_ids, win_len, whole),
                                    backend="triton", num_splits=2, fused=fused, counters=counters)
    want_o, want_lse = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
    assert rel_rmse(o, want_o) < WINDOW_BOUND
    assert_lse_close(lse, want_lse, HALF_LSE)
    assert (o[3] == 0).all() and (counters == 0).all()


def test_register_cap_reaches_the_launch_and_keeps_the_bits():
    """DecodeOptions.maxnreg is passed to Triton's launch (a wrong option name would raise) and changes no output
    bit (the interpreter ignores it; on a GPU the cap changes register allocation, not arithmetic)."""
    lens = [128, 64]
    pool = make_pool(lens, 2, 128, 64, seed=71)
    k_win, v_win = make_window(2, 2, 40, 128, torch.bfloat16, seed=8)
    args = decode_inputs(pool, k_win, v_win, torch.tensor([1, 0], dtype=torch.int32),
                         torch.tensor([40, 12], dtype=torch.int32), True)
    q = make_q(2, 8, 128, torch.bfloat16)
    o0, lse0 = A.decode_attention(q, *args, backend="triton", num_splits=2)
    o1, lse1 = A.decode_attention(q, *args, backend="triton", num_splits=2, options=L.DecodeOptions(maxnreg=128))
    assert torch.equal(o0, o1) and torch.equal(lse0, lse1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_launch_decode_matches_the_concatenated_softmax(dtype):
    """fp32 windows (or an explicit window split count) take the history kernel, the window kernel and the reduce."""
    lens = [0, 70, 5]
    pool = make_pool(lens, h_kv=2, d=64, page=16, seed=21)
    k_win, v_win = make_window(4, 2, 40, 64, dtype, seed=5)
    slot_ids = torch.tensor([2, 0, 3], dtype=torch.int32)
    win_len = torch.tensor([12, 40, 0], dtype=torch.int32)
    q = make_q(3, 8, 64, dtype)
    o, lse = A.decode_attention(q, *decode_inputs(pool, k_win, v_win, slot_ids, win_len), backend="triton",
                                num_splits=3, window_splits=2)
    want_o, want_lse = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
    assert rel_rmse(o, want_o) < (FP32_BOUND if dtype == torch.float32 else WINDOW_BOUND)
    assert_lse_close(lse, want_lse, 1e-3)


def test_decode_rejects_a_bad_counters_buffer():
    pool = make_pool([64], h_kv=2, d=64, page=64, seed=71)
    k_win, v_win = make_window(1, 2, 8, 64, torch.bfloat16)
    args = (make_q(1, 4, 64, torch.bfloat16), *decode_inputs(pool, k_win, v_win, torch.tensor([0], dtype=torch.int32),
                                                              torch.tensor([8], dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"counters: .*at least B \* H_kv = 2"):
        A.decode_attention(*args, backend="triton", counters=torch.zeros(1, dtype=torch.int32), fused=True)
    with pytest.raises(TypeError, match="counters"):
        A.decode_attention(*args, backend="triton", counters=torch.zeros(2, dtype=torch.int64), fused=True)


@pytest.mark.parametrize("backend,form", [("triton", {}), ("triton", {"window_splits": 2}), ("triton", {"fused": True}),
                                          ("torch", {})])
def test_decode_with_the_value_rotation_returns_the_model_basis(backend, form):
    """`decode_attention(v_rotation=R_V, out_dtype=bf16)` on every path (two launches, three, one, torch) is the
    rotated output times R_V^T (`unrotate_output` in fp32) rounded once to bf16, with the same lse. The fp32 sums
    differ in order from torch's GEMM: within one bf16 unit."""
    pool = make_pool([100, 64], h_kv=2, d=64, page=64, seed=73)
    k_win, v_win = make_window(2, 2, 16, 64, torch.bfloat16)
    args = (make_q(2, 4, 64, torch.bfloat16), *decode_inputs(pool, k_win, v_win, torch.tensor([1, 0], dtype=torch.int32),
                                                              torch.tensor([8, 16], dtype=torch.int32)))
    rot = torch.linalg.qr(torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(5)))[0].contiguous()
    o, lse = A.decode_attention(*args, backend=backend, **form)
    got, got_lse = A.decode_attention(*args, backend=backend, v_rotation=rot, out_dtype=torch.bfloat16, **form)
    want = A.unrotate_output(o, rot)
    assert got.dtype == torch.bfloat16 and torch.equal(got_lse, lse)
    assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6).all()
    with pytest.raises(ValueError, match=r"v_rotation: expected shape \[H_kv, d, d\] = \[2, 64, 64\]"):
        A.decode_attention(*args, backend=backend, v_rotation=rot[:1], **form)
    with pytest.raises(TypeError, match="out_dtype: expected float16, bfloat16 or float32"):
        A.decode_attention(*args, backend=backend, v_rotation=rot, out_dtype=torch.int32, **form)
    with pytest.raises(ValueError, match="out_dtype: only with v_rotation"):
        A.decode_attention(*args, backend=backend, out_dtype=torch.bfloat16, **form)


# -------------------------------------------------------------------------------------- merge
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 2 ** 31 - 1), st.lists(st.integers(0, 9), min_size=1, max_size=6), st.sampled_from([16, 48]))
def test_split_merges_equal_one_softmax_over_the_concatenation(seed, sizes, d):
    """Property: for any partition of the keys into segments (empty ones too), the torch pairwise merge, the torch
    split reduce and the Triton split reduce all give the attention over the union."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    q = torch.randn(2, 4, d, generator=gen)
    k = torch.randn(2, 2, n, d, generator=gen) * 2
    v = torch.randn(2, 2, n, d, generator=gen)
    cuts = [0]
    for s in sizes:
        cuts.append(cuts[-1] + s)
    parts = [attn_naive.segment_attention(q, k[:, :, a:b], v[:, :, a:b]) if b > a else
             (torch.zeros(2, 4, d), torch.full((2, 4), float("-inf"))) for a, b in zip(cuts, cuts[1:])]
    o_part = torch.stack([p[0] for p in parts], dim=2).contiguous()
    lse_part = torch.stack([p[1] for p in parts], dim=2).contiguous()
    o, lse = parts[0]
    for o_s, lse_s in parts[1:]:
        o, lse = A.merge_attention(o, lse, o_s, lse_s)
    results = [(o, lse), paged_ref.reduce_splits_torch(o_part, lse_part), M.reduce_splits_triton(o_part, lse_part)]
    if n == 0:
        for o_r, lse_r in results:
            assert (o_r == 0).all() and torch.isneginf(lse_r).all()
        return
    o_all, lse_all = attn_naive.segment_attention(q, k, v)
    for o_r, lse_r in results:
        assert torch.allclose(o_r, o_all, atol=1e-5) and torch.allclose(lse_r, lse_all, atol=1e-5)


@pytest.mark.parametrize("splits,d", [(70, 128), (203, 256), (5, 48)])
def test_split_reduce_in_channel_blocks_matches_the_torch_merge(splits, d):
    """More than one 64-split round, partial channel blocks, rows whose partials are all or partly empty."""
    gen = torch.Generator().manual_seed(splits + d)
    o_part = torch.randn(2, 3, splits, d, generator=gen)
    lse_part = torch.randn(2, 3, splits, generator=gen) * 4
    lse_part[0, 1] = float("-inf")
    lse_part[1, 2, ::2] = float("-inf")
    o_t, lse_t = M.reduce_splits_triton(o_part, lse_part)
    o_r, lse_r = paged_ref.reduce_splits_torch(o_part, lse_part)
    assert_lse_close(lse_t, lse_r, 1e-5)
    assert torch.allclose(o_t, o_r, atol=1e-5) and (o_t[0, 1] == 0).all()


@pytest.mark.parametrize("channels,rows", [(32, 512), (8, 512), (16, 128), (128, 16)])
def test_split_reduce_program_shapes_match_the_torch_merge(channels, rows):
    """The split reduce merges the same partials to the reference whatever its program shape (`channels`, `rows`):
    one round or several, channel blocks narrower than d, empty rows."""
    gen = torch.Generator().manual_seed(channels + rows)
    o_part = torch.randn(1, 4, 264, 128, generator=gen)
    lse_part = torch.randn(1, 4, 264, generator=gen) * 4
    lse_part[0, 2] = float("-inf")
    o_t, lse_t = M.reduce_splits_triton(o_part, lse_part, channels=channels, rows=rows)
    o_r, lse_r = paged_ref.reduce_splits_torch(o_part, lse_part)
    assert_lse_close(lse_t, lse_r, 1e-5)
    assert torch.allclose(o_t, o_r, atol=1e-5) and (o_t[0, 2] == 0).all()


# -------------------------------------------------------------------------------------- host side
def test_rotate_queries_and_unrotate_output():
    gen = torch.Generator().manual_seed(2)
    rk = torch.linalg.qr(torch.randn(2, 32, 32, generator=gen))[0]
    q = torch.randn(3, 8, 32, generator=gen)
    want = torch.stack([q[:, i] @ rk[i // 4] for i in range(8)], dim=1)
    assert torch.allclose(A.rotate_queries(q, rk), want, atol=1e-5)
    assert torch.allclose(A.unrotate_output(want, rk), q, atol=1e-5)


def test_programs_per_sm_limit_matches_the_occupancy_ncu_reported():
    """Nsight Compute on the H200: 167 registers, 12032 B shared, 1 warp -> 12 blocks per SM; 127 registers, 7172 B
    -> 16. Registers per warp come from one of 4 sub-partitions: 136-168 registers all give 12 one-warp blocks."""
    assert L.programs_per_sm_limit(167, 12032, 1) == 12
    assert L.programs_per_sm_limit(127, 7172, 1) == 16
    for regs, blocks in ((128, 16), (136, 12), (168, 12), (170, 8), (255, 8)):
        assert L.programs_per_sm_limit(regs, 0, 1) == blocks, regs
    assert L.programs_per_sm_limit(144, 0, 4) == 3
    assert L.programs_per_sm_limit(32, 0, 8) == 8
    assert L.programs_per_sm_limit(64, 100_000, 1) == 2


def shape_only_inputs(b, h_kv, max_pages, page=64, d=64, group=2):
    """Empty pools and tables of the given shapes (split counts read shapes only)."""
    k_codes, v_codes = (torch.empty(1, h_kv, page, d // 4, dtype=torch.uint8) for _ in range(2))
    k_scale, k_zero, v_scale, v_zero = (torch.empty(1, h_kv, page, 1, dtype=torch.float16) for _ in range(4))
    pages = PagePools(k_codes=k_codes, v_codes=v_codes, k_scale=k_scale, k_zero=k_zero, v_scale=v_scale,
                      v_zero=v_zero, fmt=PAPER.with_(page_size=page))
    batch = BatchMetadata(block_table=torch.zeros(b, max_pages, dtype=torch.int32),
                          hist_len=torch.zeros(b, dtype=torch.int32))
    return torch.empty(b, group * h_kv, d, dtype=torch.bfloat16), pages, batch


@settings(max_examples=200, deadline=None)
@given(b=st.integers(1, 64), h_kv=st.integers(1, 8), max_pages=st.integers(1, 2048), slots=st.integers(1, 32),
       sms=st.integers(1, 200), waves=st.integers(1, 3))
def test_splits_fill_whole_waves(b, h_kv, max_pages, slots, sms, waves):
    """With the occupancy known (`slots` programs per SM), the history splits are the most whose programs fit in
    `waves` whole waves, never more chunks than a `min_split_tokens` cut of the longest history makes, and never
    fewer than one. (Properties of the count, not its formula.)"""
    q, pages, batch = shape_only_inputs(b, h_kv, max_pages)
    opts = L.DecodeOptions(waves=waves)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(splits, "sm_count", lambda device: sms)
        n = L.splits_for_slots(q, pages, batch, slots, opts)
    programs, capacity = b * h_kv, waves * slots * sms
    tokens = max_pages * 64
    # the chunks a min_split_tokens cut makes: every one but the last at least min_split_tokens long
    cut = next(c for c in range(1, tokens + 1) if c * opts.min_split_tokens >= tokens)
    assert 1 <= n <= cut
    if n > 1:
        assert n * programs <= capacity  # the splits fit in the waves
    assert n == cut or (n + 1) * programs > capacity  # and one more would not (unless the cut stops it)


@settings(max_examples=100, deadline=None)
@given(b=st.integers(1, 64), h_kv=st.integers(1, 8), max_pages=st.integers(1, 2048))
def test_splits_without_the_occupancy_aim_at_programs_per_sm(b, h_kv, max_pages):
    """Where the compiled kernel's occupancy is unknown (interpreter, fallback), the fewest splits that reach
    `programs_per_sm` programs per SM (sm_count is 4 off a GPU), again within the min_split_tokens cut."""
    q, pages, batch = shape_only_inputs(b, h_kv, max_pages)
    opts = L.DEFAULT_OPTIONS
    n = L.splits_for_slots(q, pages, batch, None, opts)
    want = opts.programs_per_sm * L.sm_count(q.device)
    tokens = max_pages * 64
    cut = next(c for c in range(1, tokens + 1) if c * opts.min_split_tokens >= tokens)
    assert 1 <= n <= cut
    assert n == cut or n * b * h_kv >= want
    assert n == 1 or (n - 1) * b * h_kv < want


def test_occupancy_cache_key_follows_what_selects_a_kernel():
    pool = make_pool([300, 64], h_kv=2, d=64, page=64)
    q = make_q(2, 8, 64, torch.bfloat16)
    pages, batch = pages_of(pool), batch_of(pool)

    def key(pages, whole=False, opts=L.DEFAULT_OPTIONS):
        return L.chunk_key(q, pages, batch, L.plan_decode(q, pages, None, whole, opts), opts)

    masked = key(pages)
    assert masked != key(pages, whole=True)
    assert masked != key(pages, opts=L.DecodeOptions(num_stages=2))
    assert masked != key(pages, opts=L.DecodeOptions(maxnreg=128))  # a register cap compiles another kernel
    kc, ks = pool[0], pool[1]
    more_pages = torch.zeros(kc.shape[0] + 5, *kc.shape[1:], dtype=kc.dtype)
    more_scales = torch.zeros(ks.shape[0] + 5, *ks.shape[1:], dtype=ks.dtype)
    assert key(PagePools(k_codes=more_pages, v_codes=more_pages, k_scale=more_scales, k_zero=more_scales,
                         v_scale=more_scales, v_zero=more_scales, fmt=pages.fmt)) == masked


def test_decode_options_reject_bad_values():
    with pytest.raises(ValueError, match="DecodeOptions.block_n: expected a power of two"):
        L.DecodeOptions(block_n=48)
    with pytest.raises(ValueError, match="DecodeOptions.num_warps: expected a positive integer"):
        L.DecodeOptions(num_warps=0)
    with pytest.raises(ValueError, match=r"DecodeOptions.maxnreg: expected None or an integer in \[24, 255\], got 300"):
        L.DecodeOptions(maxnreg=300)
    assert L.DecodeOptions(maxnreg=96).launch_kwargs() == {"num_warps": 1, "num_stages": 3, "maxnreg": 96}
    assert "maxnreg" not in L.DEFAULT_OPTIONS.launch_kwargs()  # the compiler's choice unless asked
    with pytest.raises(ValueError, match="DecodeOptions.pdl: expected a bool"):
        L.DecodeOptions(pdl=2)
    with pytest.raises(ValueError, match="DecodeOptions.prefetch_tiles: expected 0, 1 or 2, got 3"):
        L.DecodeOptions(prefetch_tiles=3)
    pool = make_pool([10], h_kv=2, d=64, page=16)
    with pytest.raises(TypeError, match="options: expected a DecodeOptions"):
        A.int2_decode_attention(make_q(1, 8, 64, torch.float32), pages_of(pool), batch_of(pool), backend="triton",
                                options={"fused": True})


def test_bad_inputs_name_the_record_and_the_tensor():
    pool = make_pool([10], h_kv=2, d=64, page=16)
    q = make_q(1, 8, 64, torch.float32)
    pages, batch = pages_of(pool), batch_of(pool)
    kc, ks, kz, vc, vs, vz, table, lens = pool
    replace = dataclasses.replace
    with pytest.raises(TypeError, match="q: dtype"):
        A.int2_decode_attention(q.to(torch.int32), pages, batch)
    with pytest.raises(ValueError, match="q: head_dim must be a multiple of 4"):
        A.int2_decode_attention(torch.randn(1, 8, 66), pages, batch)
    with pytest.raises(TypeError, match="pages: expected a PagePools .*got tuple"):
        A.int2_decode_attention(q, tuple(pool[:6]), batch)
    with pytest.raises(TypeError, match="batch: expected a BatchMetadata"):
        A.int2_decode_attention(q, pages, (table, lens))
    with pytest.raises(TypeError, match="pages.k_codes: dtype must be uint8"):
        A.int2_decode_attention(q, replace(pages, k_codes=kc.to(torch.int16)), batch)
    with pytest.raises(ValueError, match="pages.v_codes: .*head_dim // 4"):
        A.int2_decode_attention(q, replace(pages, v_codes=vc[..., :8]), batch)
    with pytest.raises(TypeError, match="pages.k_scale: dtype must be float16"):
        A.int2_decode_attention(q, replace(pages, k_scale=ks.float()), batch)
    with pytest.raises(ValueError, match="pages.v_zero: must have the same shape and strides as pages.v_scale"):
        A.int2_decode_attention(q, replace(pages, v_zero=torch.zeros(*vz.shape[:3], 2, dtype=vz.dtype)[..., :1]),
                                batch)
    with pytest.raises(ValueError, match="pages.k_mean: given, but pages.fmt is not centered"):
        A.int2_decode_attention(q, replace(pages, k_mean=torch.zeros(2, 64)), batch)
    with pytest.raises(ValueError, match="pages.v_mean: a centered cache needs both"):
        A.int2_decode_attention(q, replace(pages, k_mean=torch.zeros(2, 64), fmt=pages.fmt.with_(centered=True)),
                                batch)
    with pytest.raises(TypeError, match="pages.fmt: expected the KVFormat of the pages"):
        A.int2_decode_attention(q, replace(pages, fmt="float16"), batch)
    with pytest.raises(ValueError, match="pages.fmt: page_size is 32, but pages.k_codes holds pages of 16 tokens"):
        A.int2_decode_attention(q, replace(pages, fmt=pages.fmt.with_(page_size=32)), batch)
    with pytest.raises(TypeError, match=r"pages.k_scale: dtype must be uint8 \(pages.fmt.scale_format is 'ue5m3'\)"):
        A.int2_decode_attention(q, replace(pages, fmt=pages.fmt.with_(scale_format="ue5m3")), batch)
    with pytest.raises(ValueError, match=r"pages.k_scale: expected shape .* \(pages, KV heads, page size"):
        A.int2_decode_attention(q, replace(pages, fmt=pages.fmt.with_(group_size=16)), batch)
    with pytest.raises(ValueError, match="q: 5 query heads is not a multiple"):
        A.int2_decode_attention(make_q(1, 5, 64, torch.float32), pages, batch)
    with pytest.raises(ValueError, match="batch.block_table: .*batch size of q"):
        A.int2_decode_attention(q, pages, replace(batch, block_table=table.expand(2, -1)))
    with pytest.raises(ValueError, match="batch.hist_len: expected device"):
        A.int2_decode_attention(q, pages, replace(batch, hist_len=lens.to("meta")))
    k_win, v_win = make_window(2, 2, 8, 64, torch.float32)
    slots = BatchMetadata(slot_ids=torch.tensor([0]), win_len=torch.tensor([3]))
    with pytest.raises(ValueError, match="windows.k_win: .*head_dim of q"):
        A.window_attention(q, Windows(k_win[..., :32], v_win), slots)
    with pytest.raises(TypeError, match="batch.win_len: dtype"):
        A.window_attention(q, Windows(k_win, v_win), replace(slots, win_len=torch.tensor([3.0])))
    with pytest.raises(ValueError, match="batch.slot_ids: decode_attention needs it, got None"):
        A.decode_attention(q, pages, batch, Windows(k_win, v_win))
    with pytest.raises(ValueError, match="windows.k_win: 1 KV heads, but pages.k_codes has 2"):
        A.decode_attention(q, pages, replace(batch, slot_ids=slots.slot_ids, win_len=slots.win_len),
                           Windows(k_win[:, :1], v_win[:, :1]))
    with pytest.raises(ValueError, match="lse_b: expected shape"):
        A.merge_attention(torch.zeros(2, 4), torch.zeros(2), torch.zeros(2, 4), torch.zeros(3))
