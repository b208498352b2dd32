"""ue5m3 (uint8) scale pools on every path of the production decode kernel, under TRITON_INTERPRET=1 on CPU.

The independent check is a transcription: every ue5m3 scale code and 1/64 zero point is exactly an fp16 number
(3 mantissa bits inside fp16's 10, exponents inside fp16's normal range; z / 64 with z <= 255), so an fp16 pool
holding the decoded values encodes the same dequantized history. On one path the kernel then has to give the same
bits for both pools (the scale format only changes how a scale is read), and the fp16 path itself is checked
against the dense reference elsewhere (test_attention_kernels.py). The whole-page path (int8 scores at head_dim
128, 16-token pieces, quad or paired scale/zero pools) and the masked-tile path are not bit-identical to each other
(other MMA shapes and summation orders): they agree within PATH_BOUND, and each within HALF_BOUND of the dense reference.
"""

from __future__ import annotations

import pytest
import torch
from format_helpers import qfmt

from runtime_kernels import attention as A
from runtime_kernels.attention.int2_decode import naive as paged_ref
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
    pool_layout,
    rel_rmse,
    relayout,
)

pytestmark = pytest.mark.interpreter

HALF_BOUND, HALF_LSE = 8e-4, 2e-3  # as test_attention_kernels (measured <= 1.0e-4 / 2.5e-4)
PATH_BOUND = 5e-4  # whole-page vs masked-tile path, same pools (measured <= 1.1e-4: the int8 hi/lo query)


def as_fp16_pool(pool):
    """The same pools with ue5m3 scale codes and 1/64 zero points written as fp16 numbers (exact), in the same
    scale/zero layout."""
    out = list(pool)
    for i in (1, 4):
        scale, zero = qnaive.scale_zero_fp32(pool[i], pool[i + 1], qfmt(scale_format="ue5m3"))
        s16, z16 = scale.half(), zero.half()
        assert torch.equal(s16.float(), scale) and torch.equal(z16.float(), zero)  # the transcription is exact
        out[i], out[i + 1] = s16, z16
    layout = pool_layout(pool)
    return out if layout == "separate" else relayout(out, layout)


def centered_means(h_kv, d, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(h_kv, d, generator=gen) * 0.5, torch.randn(h_kv, d, generator=gen) * 0.5


def run_history(q, pool, whole, means):
    return A.int2_decode_attention(q, pages_of(pool, means), batch_of(pool, whole_pages=whole), backend="triton",
                                   num_splits=2)


def reference(q, pool, lens, means):
    """The torch reference of the paged layout (dense attention over the dequantized history, + mu_k . q in the
    logits and + mu_v in the output when centered)."""
    km, vm = means if means is not None else (None, None)
    return paged_ref.int2_decode_attention_ref(q, *pool, k_mean=km, v_mean=vm, fmt=pool_format(pool))


@pytest.mark.parametrize("d,layout,centered", [(128, "quad", True), (128, "separate", False), (64, "quad", False),
                                               (128, "paired_v", True)])
def test_ue5m3_pools_take_the_whole_page_path_and_equal_their_fp16_transcription(d, layout, centered):
    lens = [128, 0, 64]
    pool = make_pool(lens, 2, d, 64, seed=d + len(layout), scale_format="ue5m3", layout=layout)
    q = make_q(3, 8, d, torch.bfloat16, seed=2)
    means = centered_means(2, d) if centered else None
    plan = A.decode_plan(q, pages_of(pool, means), whole_pages=True)
    assert (plan.kernel, plan.whole_pages, plan.int8_scores, plan.scale_layout) == \
        ("production", True, d == 128, layout)
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
    default recipe's layout: ue5m3, centered, quad scale/zero pools, whole pages, bf16 queries and windows."""
    lens = [128, 0, 64]
    pool = make_pool(lens, 2, 128, 64, seed=40, scale_format="ue5m3", layout="quad")
    k_win, v_win = make_window(4, 2, 24, 128, torch.bfloat16, seed=7)
    slot_ids = torch.tensor([3, 0, 1], dtype=torch.int32)
    win_len = torch.tensor([24, 9, 0], dtype=torch.int32)
    q = make_q(3, 8, 128, torch.bfloat16, seed=8)
    km, vm = centered_means(2, 128, seed=9)

    def run(p):
        return A.decode_attention(q, *decode_inputs(p, k_win, v_win, slot_ids, win_len, True, (km, vm)),
                                  backend="triton", num_splits=2, fused=fused)

    o, lse = run(pool)
    o16, lse16 = run(as_fp16_pool(pool))
    assert torch.equal(o, o16) and torch.equal(lse, lse16)
    o_ref, lse_ref = A.decode_attention(q, *decode_inputs(pool, k_win, v_win, slot_ids, win_len, means=(km, vm)),
                                        backend="torch")
    assert rel_rmse(o, o_ref) < 2e-2  # bf16 window operands and probabilities (test_attention_kernels)
    assert_lse_close(lse, lse_ref, HALF_LSE)


def test_unaligned_ue5m3_pools_take_the_masked_tiles_and_say_why():
    """The whole-page loop reads uint8 pools as 32-bit words, so a pool view that does not start 4-byte aligned is
    sent to the masked tiles (with the reason in the plan), and gives the bits the aligned pool gives there."""
    lens = [128, 64]
    pool = make_pool(lens, 2, 128, 64, seed=4, scale_format="ue5m3", layout="paired_v")
    q = make_q(2, 8, 128, torch.bfloat16, seed=3)
    shifted = list(pool)
    buf = torch.zeros(pool[1].numel() + 4, dtype=torch.uint8)
    shifted[1] = buf[1:1 + pool[1].numel()].view(pool[1].shape)
    shifted[1].copy_(pool[1])
    assert shifted[1].data_ptr() % 4
    for compiled in (False, True):
        plan = A.decode_plan(q, pages_of(shifted), whole_pages=True, compiled=compiled)
        assert not plan.whole_pages and "not 4-byte aligned" in plan.reason
    o, lse = run_history(q, shifted, True, None)
    om, lsem = run_history(q, pool, False, None)
    assert torch.equal(o, om) and torch.equal(lse, lsem)
