"""The ue5m3 scale format (8-bit float scale + 8-bit zero point per group, 2.125 bits per element at d = 128):
the encoding against a brute-force nearest search, the quantizer's error against fp16 scales, the Triton quantizer
bit for bit against the torch reference, the decode kernels on uint8 pools against the dense reference, and the cache
built from a ue5m3 artifact against the evaluation's fake quantization (one quantizer for eval and serving).
"""

from __future__ import annotations

import pytest
import torch
from format_helpers import qfmt

from runtime_kernels import attention as A
from runtime_kernels import quant as Q
from runtime_kernels.quant import naive
from tests.kernel_helpers import (
    assert_lse_close,
    batch_of,
    dense_reference,
    make_pool,
    make_q,
    pages_of,
    rel_rmse,
)

ALL_CODES = torch.arange(256, dtype=torch.uint8)


def test_every_code_decodes_to_a_distinct_increasing_scale_that_encodes_back():
    vals = naive.decode_ue5m3(ALL_CODES)
    assert (vals[1:] > vals[:-1]).all()
    assert vals[0] == 2.0**-15 and vals[-1] == 1.875 * 2.0**16
    inside = (vals >= naive.UE5M3_MIN) & (vals <= naive.UE5M3_MAX)
    assert torch.equal(naive.encode_ue5m3(vals[inside]), ALL_CODES[inside])


def test_encoding_rounds_to_the_nearest_representable_scale():
    gen = torch.Generator().manual_seed(0)
    s = torch.exp(torch.empty(20000).uniform_(-9.5, 10.5, generator=gen))  # 2^-14 .. 61440, and past both ends
    got = naive.decode_ue5m3(naive.encode_ue5m3(s))
    table = naive.decode_ue5m3(ALL_CODES)
    table = table[(table >= naive.UE5M3_MIN) & (table <= naive.UE5M3_MAX)]
    want = table[(s.clamp(naive.UE5M3_MIN, naive.UE5M3_MAX)[:, None] - table[None, :]).abs().argmin(dim=1)]
    assert torch.equal(got, want)
    inside = (s >= naive.UE5M3_MIN) & (s <= naive.UE5M3_MAX)
    assert ((got[inside] - s[inside]).abs() / s[inside]).max() <= 1 / 16 + 1e-7  # half a mantissa step


@pytest.mark.parametrize("group_size", [None, 32])
def test_ue5m3_error_is_within_a_percent_of_fp16_scales(group_size):
    """Measured on Gaussian rows with log-normal row scales: MSE ratio 1.003 (one group per row)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4000, 2, 128, generator=gen) * torch.exp(torch.randn(4000, 2, 1, generator=gen))
    err = {}
    for fmt in naive.SCALE_FORMATS:
        codes, scale, zero = naive.quantize(x, qfmt(group_size, fmt))
        assert scale.dtype == (torch.uint8 if fmt == "ue5m3" else torch.float16) and zero.dtype == scale.dtype
        err[fmt] = (naive.dequantize(codes, scale, zero, qfmt(group_size, fmt)) - x).pow(2).mean().item()
    assert err["ue5m3"] / err["float16"] < 1.01


def test_ue5m3_levels_cover_the_row_and_zero_points_stay_in_range():
    """Every element is within half a step of its level, except for the top of a row whose scale was rounded down
    (at most 3 * 1/16 of a step past it); rows that do not cross 0 are quantized over a range including 0."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3000, 128, generator=gen) * 3
    x[:500] = x[:500].abs() + 5  # all positive
    x[500:1000] = -x[500:1000].abs() - 5  # all negative
    ue5m3 = qfmt(scale_format="ue5m3")
    codes, scale, zero = naive.quantize(x, ue5m3)
    s, z = naive.scale_zero_fp32(scale, zero, ue5m3)
    assert (z >= 0).all() and (z <= 3.3).all()
    err = (naive.dequantize(codes, scale, zero, ue5m3) - x).abs()
    assert (err <= s * (0.5 + 3 / 16 + 1 / 128) + 1e-6).all()
    assert torch.isfinite(naive.dequantize(*naive.quantize(torch.zeros(4, 128), ue5m3), ue5m3)).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("group_size,clip,centered", [(None, True, True), (None, False, False), (32, True, False)])
def test_triton_quantizer_equals_the_reference_bit_for_bit(group_size, clip, centered):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70, 2, 128, generator=gen) * 4
    rot = torch.linalg.qr(torch.randn(2, 128, 128, generator=gen))[0]
    ratio = torch.tensor([0.9, 0.95]) if clip else None
    mean = torch.randn(2, 128, generator=gen) if centered else None
    got = Q.quantize_pack(x, rot, ratio, qfmt(group_size, "ue5m3"), backend="triton", mean=mean)
    want = naive.quantize_pack(x, rot, ratio, qfmt(group_size, "ue5m3"), mean=mean)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.interpreter
def test_write_pages_into_uint8_pools_equals_the_reference():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(20, 2, 64, generator=gen)
    outs = {}
    for backend in ("torch", "triton"):
        codes = torch.zeros(6, 2, 8, 16, dtype=torch.uint8)
        scale, zero = torch.zeros(6, 2, 8, 1, dtype=torch.uint8), torch.zeros(6, 2, 8, 1, dtype=torch.uint8)
        page_ids = torch.tensor([5, 2, 0, 3] * 5, dtype=torch.int32)
        rows = torch.arange(20, dtype=torch.int32) % 8
        Q.write_pages(x, None, torch.tensor([0.9, 1.0]), codes, scale, zero, page_ids, rows,
                      qfmt(scale_format="ue5m3"), backend=backend)
        outs[backend] = (codes, scale, zero)
    for a, b in zip(outs["torch"], outs["triton"]):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="zero_pool"):
        Q.write_pages(x, None, None, codes, scale, zero.half(), page_ids, rows, qfmt(scale_format="ue5m3"),
                      backend="torch")


# Bounds as in test_attention_kernels (the dequantized pools are the reference, whatever their scale format).
HALF_BOUND, HALF_LSE, FP32_BOUND = 8e-4, 2e-3, 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("whole,layout", [(True, "quad"), (True, "separate"), (False, "quad")])
def test_production_kernel_on_ue5m3_pools_matches_the_reference(whole, layout):
    lens = [128, 0, 64] if whole else [130, 0, 71]
    pool = make_pool(lens, 2, 128, 64, seed=11, scale_format="ue5m3", layout=layout)
    assert pool[1].dtype == torch.uint8
    q = make_q(3, 8, 128, torch.bfloat16)
    # uint8 pools take the whole-page loop (int8 scores, quad pools) like fp16 ones (under the interpreter)
    plan = A.decode_plan(q, pages_of(pool), whole_pages=whole)
    assert (plan.kernel, plan.whole_pages, plan.int8_scores, plan.scale_layout) == \
        ("production", whole, whole, layout if whole else "separate")
    o, lse = A.int2_decode_attention(q, pages_of(pool), batch_of(pool, whole_pages=whole), backend="triton",
                                     num_splits=2)
    want_o, want_lse = dense_reference(q, pool, lens)
    assert rel_rmse(o, want_o) < HALF_BOUND
    assert_lse_close(lse, want_lse, HALF_LSE)
    # fp16 pools of the same data give a different answer: the bound tells the formats apart.
    other = make_pool(lens, 2, 128, 64, seed=11)
    assert rel_rmse(o, dense_reference(q, other, lens)[0]) > HALF_BOUND


@pytest.mark.interpreter
@pytest.mark.parametrize("group_size,dtype,bound", [(None, torch.float32, FP32_BOUND), (32, torch.bfloat16, 4e-2)])
def test_fallback_kernel_on_ue5m3_pools_matches_the_reference(group_size, dtype, bound):
    lens = [130, 0, 71]
    pool = make_pool(lens, 2, 128, 64, group_size=group_size, seed=12, scale_format="ue5m3")
    q = make_q(3, 8, 128, dtype)
    assert A.decode_plan(q, pages_of(pool)).kernel == "fallback"
    o, lse = A.int2_decode_attention(q, pages_of(pool), batch_of(pool), backend="triton", num_splits=2)
    want_o, _ = dense_reference(q, pool, lens)
    assert rel_rmse(o, want_o) < bound


def test_mixed_scale_formats_are_refused_naming_the_pool():
    pool = list(make_pool([64], 1, 64, 64, scale_format="ue5m3"))
    pool[5] = pool[5].half()
    with pytest.raises(TypeError, match="pages.v_zero: dtype must be uint8"):
        A.int2_decode_attention(make_q(1, 2, 64, torch.float32), pages_of(pool), batch_of(pool), backend="torch")
