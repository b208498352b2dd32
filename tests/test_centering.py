"""Centered caches (OSCAR issue 19, kernel side): per (layer, KV head) means mu_k, mu_v in the rotated basis; the
pages hold quant(x_rot - mu) and decode adds the means back exactly (history lse + q.mu_k * sm_scale, history
output + mu_v). Checked against full-precision attention over the de-quantized history plus the mean, on the
production kernel, the fallback, both launch forms, the torch path, the quantizer and `PagedKVCache`."""

from __future__ import annotations

import pytest
import torch
from format_helpers import PAPER, qfmt

from runtime_kernels import PagedKVCache, identity_artifact, quant
from runtime_kernels import attention as A
from runtime_kernels.attention import naive as attn_naive
from runtime_kernels.attention.int2_decode import naive as paged_ref
from runtime_kernels.quant import naive as qnaive
from tests.kernel_helpers import (
    assert_lse_close,
    batch_of,
    decode_inputs,
    make_pool,
    make_q,
    make_window,
    pages_of,
    pool_format,
    rel_rmse,
)

pytestmark = pytest.mark.interpreter

HALF_BOUND = 8e-4  # as the uncentered kernel (tests/test_attention_kernels.py)
FP32_BOUND = 1e-5


def means(h_kv, d, seed=11, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(h_kv, d, generator=gen) * scale, torch.randn(h_kv, d, generator=gen) * scale)


def centered_reference(q, pool, lens, k_mean, v_mean, win=None):
    """Full-precision attention over (dequantized history + mean) ++ window, by shifting the pools' meaning: the
    dense reference is computed on a copy of the history with the mean added in fp32."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(lens[b])
        k = paged_ref.gather_history(pool[0], pool[1], pool[2], pool[6][b], n, pool_format(pool)) + k_mean[:, None]
        v = paged_ref.gather_history(pool[3], pool[4], pool[5], pool[6][b], n, pool_format(pool)) + v_mean[:, None]
        if win is not None:
            k_win, v_win, slot_ids, win_len = win
            k = torch.cat([k, k_win[int(slot_ids[b]), :, :int(win_len[b])].float()], dim=1)
            v = torch.cat([v, v_win[int(slot_ids[b]), :, :int(win_len[b])].float()], dim=1)
        if k.shape[1] == 0:
            outs.append(torch.zeros(1, q.shape[1], q.shape[2]))
            lses.append(torch.full((1, q.shape[1]), float("-inf")))
            continue
        o, lse = attn_naive.segment_attention(q[b:b + 1].float(), k[None], v[None])
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("case", ["production_whole", "production_tail", "fallback_fp32"])
def test_centered_history_kernel_matches_attention_over_dequantized_plus_mean(case):
    whole = case == "production_whole"
    lens = [256, 0, 128] if whole else [130, 0, 71]
    d = 128
    pool = make_pool(lens, 2, d, 64, seed=31)
    dtype = torch.float32 if case == "fallback_fp32" else torch.bfloat16
    q = make_q(3, 8, d, dtype)
    k_mean, v_mean = means(2, d)
    pages = pages_of(pool, (k_mean, v_mean))
    o, lse = A.int2_decode_attention(q, pages, batch_of(pool, whole_pages=whole), backend="triton", num_splits=2)
    want_o, want_lse = centered_reference(q, pool, lens, k_mean, v_mean)
    assert rel_rmse(o, want_o) < (FP32_BOUND if dtype == torch.float32 else HALF_BOUND)
    assert_lse_close(lse, want_lse, 2e-3)
    assert (o[1] == 0).all() and torch.isneginf(lse[1]).all()  # an empty history stays empty
    # The torch path is the same definition.
    o_t, lse_t = A.int2_decode_attention(q, pages, batch_of(pool), backend="torch")
    assert rel_rmse(o_t, want_o) < FP32_BOUND


@pytest.mark.parametrize("fused", [False, True])
def test_centered_decode_grid_keeps_the_merge_with_the_window_exact(fused):
    lens = [128, 0, 64]
    pool = make_pool(lens, 2, 64, 64, seed=32)
    k_win, v_win = make_window(4, 2, 40, 64, torch.bfloat16, seed=3)
    slot_ids = torch.tensor([3, 0, 1], dtype=torch.int32)
    win_len = torch.tensor([40, 17, 0], dtype=torch.int32)
    q = make_q(3, 8, 64, torch.bfloat16)
    k_mean, v_mean = means(2, 64)
    o, lse = A.decode_attention(q, *decode_inputs(pool, k_win, v_win, slot_ids, win_len, True, (k_mean, v_mean)),
                                backend="triton", num_splits=2, fused=fused)
    want_o, want_lse = centered_reference(q, pool, lens, k_mean, v_mean, (k_win, v_win, slot_ids, win_len))
    assert rel_rmse(o, want_o) < 2e-2  # bf16 window operands, as uncentered
    assert_lse_close(lse, want_lse, 2e-3)
    # The means matter: the uncentered call is far from this reference.
    o_u, _ = A.decode_attention(q, *decode_inputs(pool, k_win, v_win, slot_ids, win_len, True), backend="triton",
                                num_splits=2, fused=fused)
    assert rel_rmse(o_u, want_o) > 0.1


@pytest.mark.parametrize("whole,dtype", [(True, torch.bfloat16), (False, torch.float32)])
def test_zero_means_are_bit_identical_to_the_uncentered_path(whole, dtype):
    lens = [192, 0, 64] if whole else [130, 0, 71]
    pool = make_pool(lens, 2, 128, 64, seed=33)
    k_win, v_win = make_window(4, 2, 40, 128, dtype, seed=5)
    q = make_q(3, 8, 128, dtype)
    slots, win_len = torch.tensor([1, 0, 2], dtype=torch.int32), torch.tensor([40, 3, 0], dtype=torch.int32)
    zeros = torch.zeros(2, 128)
    o, lse = A.decode_attention(q, *decode_inputs(pool, k_win, v_win, slots, win_len, whole), backend="triton",
                                num_splits=2)
    oc, lsec = A.decode_attention(q, *decode_inputs(pool, k_win, v_win, slots, win_len, whole, (zeros, zeros)),
                                  backend="triton", num_splits=2)
    assert torch.equal(o, oc) and torch.equal(lse, lsec)


def test_centered_quantizer_subtracts_the_mean_before_clipping():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(70, 2, 64, generator=gen) + 5.0  # a large common offset, as real keys have
    rot = torch.linalg.qr(torch.randn(2, 64, 64, generator=gen, dtype=torch.float64))[0].float()
    ratio = torch.tensor([0.95, 0.9])
    mean = qnaive.rotate(x, rot).mean(dim=0)  # [H, d]
    got = quant.quantize_pack(x, rot, ratio, qfmt(), backend="triton", mean=mean)
    want = qnaive.quantize_pack(x, rot, ratio, qfmt(), mean=mean)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # Centering pays off for offset data: less reconstruction error than uncentered at the same bits.
    xr = qnaive.rotate(x, rot)
    err_c = (qnaive.unpack_dequantize(*want, qfmt()) + mean - xr).pow(2).mean()
    err_u = (qnaive.unpack_dequantize(*qnaive.quantize_pack(x, rot, ratio, qfmt()), qfmt()) - xr).pow(2).mean()
    assert err_c < err_u
    # And the cache path (rows already rotated, bf16) writes the same pages through the kernel and the reference.
    pools = []
    for backend in ("triton", "torch"):
        c = torch.zeros(3, 2, 64, 16, dtype=torch.uint8)
        s, z = torch.zeros(3, 2, 64, 1, dtype=torch.float16), torch.zeros(3, 2, 64, 1, dtype=torch.float16)
        ids = torch.arange(70, dtype=torch.int32)
        quant.write_pages(xr.to(torch.bfloat16), None, ratio, c, s, z, ids // 64, ids % 64, qfmt(),
                          backend=backend, mean=mean)
        pools.append((c, s, z))
    for a, b in zip(*pools):
        assert torch.equal(a, b)


def test_centered_cache_decodes_the_centered_history():
    """PagedKVCache with means: demotion stores quant(x_rot - mu), decode (Triton and torch paths) equals attention
    over the cache's own dense view (history dequantized + mean), and the means matter."""
    h, hq, d = 2, 8, 64
    art = identity_artifact(1, h, hq, d, fmt=PAPER)
    gen = torch.Generator().manual_seed(6)
    k_mean, v_mean = (torch.randn(1, h, d, generator=gen) * 4 for _ in range(2))
    x = [torch.randn(200, h, d, generator=gen) + k_mean[0], torch.randn(200, h, d, generator=gen) + v_mean[0]]
    q = torch.randn(1, hq, d, generator=gen).to(torch.bfloat16)
    outs = {}
    for backend in ("triton", "torch"):
        cache = PagedKVCache(art.k_rotation, art.v_rotation, art.k_clip_ratio, art.v_clip_ratio, max_pages=8,
                             max_seqs=1, fmt=PAPER.with_(sink_tokens=4, recent_tokens=8, centered=True),
                             backend=backend, k_mean=k_mean, v_mean=v_mean)
        sid = cache.add_sequence()
        cache.append([sid], [[x[0]]], [[x[1]]])
        assert cache.hist_len(sid) == 128
        outs[backend] = cache.decode_attention(0, q, [sid])
        k, v = cache.dense_kv(0, sid)
        want, _ = attn_naive.segment_attention(q.float(), k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        assert rel_rmse(outs[backend], want) < 2e-2  # bf16 windows and query
    assert rel_rmse(outs["triton"], outs["torch"]) < 2e-2
    plain = PagedKVCache(art.k_rotation, art.v_rotation, art.k_clip_ratio, art.v_clip_ratio, max_pages=8,
                         max_seqs=1, fmt=PAPER.with_(sink_tokens=4, recent_tokens=8), backend="torch")
    sid = plain.add_sequence()
    plain.append([sid], [[x[0]]], [[x[1]]])
    exact, _ = attn_naive.segment_attention(q.float(), x[0].transpose(0, 1)[None], x[1].transpose(0, 1)[None])
    centered_err = rel_rmse(outs["torch"], exact)
    plain_err = rel_rmse(plain.decode_attention(0, q, [sid]), exact)
    assert centered_err < plain_err  # on offset data the centered history is the better approximation


def test_bad_means_name_the_input():
    pool = make_pool([64], 2, 64, 64)
    q = make_q(1, 8, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="pages.v_mean: a centered cache needs both"):
        A.int2_decode_attention(q, pages_of(pool, (torch.zeros(2, 64), None)), batch_of(pool), backend="torch")
    with pytest.raises(ValueError, match=r"pages.k_mean: expected shape \(2, 64\)"):
        A.int2_decode_attention(q, pages_of(pool, (torch.zeros(2, 32), torch.zeros(2, 32))), batch_of(pool),
                                backend="torch")
    art = identity_artifact(1, 2, 8, 64, fmt=PAPER)
    with pytest.raises(ValueError, match=r"k_mean: expected a float tensor of shape \[1, 2, 64\]"):
        PagedKVCache(art.k_rotation, art.v_rotation, art.k_clip_ratio, art.v_clip_ratio, max_pages=2, max_seqs=1,
                     fmt=PAPER.with_(centered=True), k_mean=torch.zeros(2, 64), v_mean=torch.zeros(1, 2, 64))
    with pytest.raises(ValueError, match=r"mean: expected shape \(2, 64\)"):
        quant.quantize_pack(torch.zeros(3, 2, 64), None, None, qfmt(), mean=torch.zeros(64, 2))
