"""ue5m3 (uint8) scale pools on every path of the production decode kernel, under TRITON_INTERPRET=1 on CPU.

The independent check is a transcription: every ue5m3 scale code and 1/64 zero point is exactly an fp16 number
(3 mantissa bits inside fp16's 10, exponents inside fp16's normal range; z / 64 with z <= 255), so an fp16 pool
holding the decoded values encodes the same dequantized history. On one path the kernel then has to give the same
bits for both pools (the scale format only changes how a scale is read), and the fp16 path itself is checked
against the dense reference elsewhere (test_attention_kernels.py). The whole-page path (int8 scores at head_dim
128, 16-token pieces, paired V pools) and the masked-tile path are not bit-identical to each other (other MMA
shapes and summation orders): they agree within PATH_BOUND, and each within HALF_BOUND of the dense reference.
"""

from __future__ import annotations

import pytest
import torch

from runtime_kernels import attention as A
from runtime_kernels.attention.int2_decode import launch as L
from runtime_kernels.attention.int2_decode import naive as paged_ref
from runtime_kernels.attention.int2_decode.pools import alloc_paired_v_pools, paired_v_pools
from runtime_kernels.quant import naive as qnaive
from tests.kernel_helpers import assert_lse_close, dense_reference, make_pool, make_q, make_window, rel_rmse

pytestmark = pytest.mark.interpreter

HALF_BOUND, HALF_LSE = 8e-4, 2e-3  # as test_attention_kernels (measured <= 1.0e-4 / 2.5e-4)
PATH_BOUND = 5e-4  # whole-page vs masked-tile path, same pools (measured <= 1.1e-4: the int8 hi/lo query)


def as_fp16_pool(pool):
    """The same pools with ue5m3 scale codes and 1/64 zero points written as fp16 numbers (exact). Paired V pools
    stay paired."""
    out = list(pool)
    for i in (1, 4):
        scale, zero = qnaive.scale_zero_fp32(pool[i], pool[i + 1])
        s16, z16 = scale.half(), zero.half()
        assert torch.equal(s16.float(), scale) and torch.equal(z16.float(), zero)  # the transcription is exact
        if paired_v_pools(pool[i], pool[i + 1]):
            ps, pz = alloc_paired_v_pools(*pool[i].shape[:3], pool[i].device)
            ps.copy_(s16)
            pz.copy_(z16)
            s16, z16 = ps, pz
        out[i], out[i + 1] = s16, z16
    return out


def centered_means(h_kv, d, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(h_kv, d, generator=gen) * 0.5, torch.randn(h_kv, d, generator=gen) * 0.5


def run_history(q, pool, whole, means):
    km, vm = means if means is not None else (None, None)
    return A.int2_decode_attention(q, *pool, backend="triton", num_splits=2, whole_pages=whole, k_mean=km,
                                   v_mean=vm)


def reference(q, pool, lens, means):
    """The torch reference of the paged layout (dense attention over the dequantized history, + mu_k . q in the
    logits and + mu_v in the output when centered)."""
    km, vm = means if means is not None else (None, None)
    return paged_ref.int2_decode_attention_ref(q, *pool, k_mean=km, v_mean=vm)


@pytest.mark.parametrize("d,paired,centered", [(128, True, True), (128, False, False), (64, True, False)])
def test_ue5m3_pools_take_the_whole_page_path_and_equal_their_fp16_transcription(d, paired, centered):
    lens = [128, 0, 64]
    pool = make_pool(lens, 2, d, 64, seed=d + paired, scale_format="ue5m3", paired_v=paired)
    q = make_q(3, 8, d, torch.bfloat16, seed=2)
    means = centered_means(2, d) if centered else None
    plan = L.plan_decode(q, pool[0], pool[1], pool[3], pool[4], pool[5], None, True, L.DEFAULT_OPTIONS, centered)
    assert (plan.kernel, plan.whole_pages, plan.int8_scores, plan.paired_v) == ("production", True, d == 128, paired)
    assert plan.scale_format == "ue5m3"
    o, lse = run_history(q, pool, True, means)
    o16, lse16 = run_history(q, as_fp16_pool(pool), True, means)
    assert torch.equal(o, o16) and torch.equal(lse, lse16)
    want_o, want_lse = reference(q, pool, lens, means)
    assert rel_rmse(o, want_o) < HALF_BOUND
    assert_lse_close(lse, want_lse, HALF_LSE)
    # The masked-tile path on the same pools: same answer within PATH_BOUND, and the same bits as its fp16 twin.
    om, lsem = run_history(q, pool, False, means)
    assert rel_rmse(o, om) < PATH_BOUND
    assert_lse_close(lse, lsem, HALF_LSE)
    om16, lsem16 = run_history(q, as_fp16_pool(pool), False, means)
    assert torch.equal(om, om16) and torch.equal(lsem, lsem16)


def test_a_plain_cast_of_the_ue5m3_codes_would_fail_the_bound():
    """The check above can fail: reading the codes as numbers (the whole-page path's old plain cast) moves the
    output far outside HALF_BOUND."""
    lens = [128, 64]
    pool = make_pool(lens, 2, 128, 64, seed=3, scale_format="ue5m3")
    q = make_q(2, 8, 128, torch.bfloat16, seed=2)
    o, _ = run_history(q, pool, True, None)
    raw = list(pool)
    for i in (1, 2, 4, 5):
        raw[i] = pool[i].half()  # the codes as fp16 numbers
    assert rel_rmse(o, dense_reference(q, raw, lens)[0]) > 100 * HALF_BOUND


@pytest.mark.parametrize("fused", [False, True])
def test_ue5m3_grid_decode_with_windows_equals_its_fp16_transcription(fused):
    """The production grid (history + window programs; one launch with the in-kernel reduce, or two) at the
    default recipe's layout: ue5m3, centered, paired V pools, whole pages, bf16 queries and windows."""
    lens = [128, 0, 64]
    pool = make_pool(lens, 2, 128, 64, seed=40, scale_format="ue5m3", paired_v=True)
    k_win, v_win = make_window(4, 2, 24, 128, torch.bfloat16, seed=7)
    slot_ids = torch.tensor([3, 0, 1], dtype=torch.int32)
    win_len = torch.tensor([24, 9, 0], dtype=torch.int32)
    q = make_q(3, 8, 128, torch.bfloat16, seed=8)
    km, vm = centered_means(2, 128, seed=9)

    def run(p):
        return A.decode_attention(q, *p, k_win, v_win, slot_ids, win_len, backend="triton", num_splits=2,
                                  whole_pages=True, fused=fused, k_mean=km, v_mean=vm)

    o, lse = run(pool)
    o16, lse16 = run(as_fp16_pool(pool))
    assert torch.equal(o, o16) and torch.equal(lse, lse16)
    o_ref, lse_ref = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="torch", k_mean=km,
                                        v_mean=vm)
    assert rel_rmse(o, o_ref) < 2e-2  # bf16 window operands and probabilities (test_attention_kernels)
    assert_lse_close(lse, lse_ref, HALF_LSE)


# -------------------------------------------------------------------------------------- the plan
def test_the_default_recipe_takes_the_fastest_path_at_the_bench_shapes():
    """PagedKVCache with the shipped layout (ue5m3 scales, centered, 128/1024 windows, page 64, head_dim 128, bf16
    windows) and Qwen3-8B heads: every decode call of the bench's batches takes the production grid with whole
    pages, int8 scores and paired V pools, and nothing declined."""
    from runtime_kernels.cache import PagedKVCache
    from runtime_kernels.format import DEFAULT_FORMAT

    h, d = 8, 128
    rot = torch.eye(d).expand(1, h, d, d)
    cache = PagedKVCache(rot, rot, torch.ones(1, h), torch.ones(1, h), fmt=DEFAULT_FORMAT, max_pages=4, max_seqs=2,
                         k_mean=torch.zeros(1, h, d), v_mean=torch.zeros(1, h, d))
    pool = cache.pools[0]
    assert (cache.page_size, cache.sink, cache.recent) == (64, 128, 1024)
    for batch in (1, 8, 32):
        q = torch.zeros(batch, 32, d, dtype=torch.bfloat16)
        for fused in (False, True):
            plan = A.decode_plan(q, pool.k_codes, pool.k_scale, pool.v_codes, pool.v_scale, pool.v_zero, pool.k_win,
                                 whole_pages=True, fused=fused, centered=pool.k_mean is not None)
            assert plan == L.DecodePlan(kernel="grid", launches=1 if fused else 2, whole_pages=True,
                                        int8_scores=True, paired_v=True, scale_format="ue5m3", centered=True,
                                        reason="")


def test_the_plan_says_why_a_fast_path_is_not_taken():
    pool = make_pool([64], 2, 64, 64, group_size=32, seed=1)
    q = make_q(1, 4, 64, torch.bfloat16)
    plan = A.decode_plan(q, pool[0], pool[1], pool[3], pool[4], pool[5], whole_pages=True)
    assert (plan.kernel, plan.whole_pages) == ("fallback", False) and "2 scale groups per row" in plan.reason
    pool = make_pool([64], 2, 64, 64, seed=1)
    plan = A.decode_plan(q, pool[0], pool[1], pool[3], pool[4], pool[5], whole_pages=False)
    assert plan.kernel == "production" and not plan.whole_pages and "whole_pages not promised" in plan.reason
    plan = A.decode_plan(q, pool[0], pool[1], pool[3], pool[4], pool[5], whole_pages=True)
    assert (plan.whole_pages, plan.int8_scores, plan.paired_v) == (True, False, False)
    assert "head_dim 64: fp16 scores" in plan.reason and "not paired" in plan.reason
    k_win = torch.zeros(1, 2, 8, 64)
    plan = A.decode_plan(q, pool[0], pool[1], pool[3], pool[4], pool[5], k_win, whole_pages=True)
    assert (plan.kernel, plan.launches) == ("production", 3) and "torch.float32 windows" in plan.reason
    assert not L.production_ok(q.float(), pool[0], pool[1], pool[3], L.DEFAULT_OPTIONS)
    assert "torch.float32 queries" in L.production_declines(q.float(), pool[0], pool[1], pool[3], L.DEFAULT_OPTIONS)


def test_every_call_logs_its_plan_at_debug(caplog):
    pool = make_pool([64, 0], 2, 128, 64, seed=2, scale_format="ue5m3", paired_v=True)
    q = make_q(2, 8, 128, torch.bfloat16)
    with caplog.at_level("DEBUG", logger="runtime_kernels.attention.int2_decode.launch"):
        A.int2_decode_attention(q, *pool, backend="triton", num_splits=1, whole_pages=True)
    [rec] = [r for r in caplog.records if r.name == "runtime_kernels.attention.int2_decode.launch"]
    assert "kernel='production'" in rec.getMessage() and "int8_scores=True" in rec.getMessage()
    assert "scale_format='ue5m3'" in rec.getMessage()
