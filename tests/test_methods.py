"""KV methods of the evaluation: each checked against a direct computation written here."""

from __future__ import annotations

import math

import pytest
import torch
from format_helpers import PAPER

from oscar_calib.analysis.methods import (
    ArtifactInt2,
    Kivi2,
    KVMethod,
    RowwiseInt2,
    kivi_keys,
    standard_methods,
)
from runtime_kernels.artifact import identity_artifact


def _minmax_int2(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Direct asymmetric 2-bit min-max fake quantization along `dim` (scale and zero rounded to fp16)."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo).clamp_min(1e-8) / 3).half().float()
    zero = (-lo / scale).half().float()
    code = torch.clamp(torch.floor(x / scale + zero + 0.5), 0, 3)
    return (code - zero) * scale


def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _kv(b=2, h=2, t=70, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=g)
    k[..., 3] *= 8  # an outlier channel, as real keys have
    v = torch.randn(b, h, t, d, generator=g)
    return k, v


def test_int2_is_per_token_minmax():
    k, v = _kv()
    kh, vh = RowwiseInt2("int2", fmt=PAPER).fake_quantize(0, k, v, PAPER)
    torch.testing.assert_close(kh, _minmax_int2(k, -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(vh, _minmax_int2(v, -1), rtol=0, atol=1e-5)


def test_int2_group_size_quantizes_channel_groups():
    k, v = _kv(d=32)
    kh, _ = RowwiseInt2("int2-g8", fmt=PAPER.with_(group_size=8)).fake_quantize(0, k, v, PAPER)
    ref = _minmax_int2(k.reshape(*k.shape[:-1], 4, 8), -1).reshape(k.shape)
    torch.testing.assert_close(kh, ref, rtol=0, atol=1e-5)


def test_quarot_rotates_quantizes_and_rotates_back():
    k, v = _kv(d=32)
    h = _hadamard(32).float()
    kh, vh = RowwiseInt2("quarot", k_rotation=h, v_rotation=h, fmt=PAPER).fake_quantize(0, k, v, PAPER)
    torch.testing.assert_close(kh, _minmax_int2(k @ h, -1) @ h.T, rtol=0, atol=1e-4)
    torch.testing.assert_close(vh, _minmax_int2(v @ h, -1) @ h.T, rtol=0, atol=1e-4)


def test_hadamard_clip_clamps_each_rotated_row_at_its_order_statistic():
    k, v = _kv(d=32)
    h = _hadamard(32).float()
    kh, _ = RowwiseInt2("hc", k_rotation=h, v_rotation=h, k_clip=0.75, v_clip=1.0,
                        fmt=PAPER).fake_quantize(0, k, v, PAPER)
    xr = k @ h
    tau = xr.abs().sort(dim=-1).values[..., 24:25]  # index floor(0.75 * 32) = 24
    ref = _minmax_int2(torch.maximum(torch.minimum(xr, tau), -tau), -1) @ h.T
    torch.testing.assert_close(kh, ref, rtol=0, atol=1e-4)


def test_kivi_keys_per_channel_blocks_match_a_direct_loop():
    k, _ = _kv(t=75)
    start, g = 5, 32
    out = kivi_keys(k, g, start)
    ref = k.clone()
    for s in range(start, 75, g):
        e = min(s + g, 75)
        for c in range(k.shape[-1]):
            ref[:, :, s:e, c] = _minmax_int2(k[:, :, s:e, c], -1)
    torch.testing.assert_close(out[:, :, :start], k[:, :, :start])  # the sink is untouched
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_kivi_values_are_per_token():
    k, v = _kv()
    kh, vh = Kivi2("kivi", token_group=32).fake_quantize(0, k, v, PAPER.with_(sink_tokens=4))
    torch.testing.assert_close(vh, _minmax_int2(v, -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(kh, kivi_keys(k, 32, 4))


def test_identity_artifact_equals_plain_int2_and_skips_unlisted_layers():
    k, v = _kv(d=32)
    art = identity_artifact(1, 2, 4, 32, layer_ids=[1], fmt=PAPER)
    m = ArtifactInt2("oscar", artifact=art)
    assert m.quantizes(1) and not m.quantizes(0)
    kh, vh = m.fake_quantize(1, k, v, PAPER)
    k2, v2 = RowwiseInt2("int2", fmt=PAPER).fake_quantize(1, k, v, PAPER)
    torch.testing.assert_close(kh, k2, rtol=0, atol=1e-5)
    torch.testing.assert_close(vh, v2, rtol=0, atol=1e-5)
    k0, v0 = m.fake_quantize(0, k, v, PAPER)
    torch.testing.assert_close(k0, k)  # an uncalibrated layer stays BF16


def test_artifact_per_head_rotations_apply_to_their_head():
    k, v = _kv(d=32)
    art = identity_artifact(1, 2, 4, 32, fmt=PAPER)
    h = _hadamard(32).float()
    art.k_rotation[0, 1] = h
    kh, _ = ArtifactInt2("oscar", artifact=art).fake_quantize(0, k, v, PAPER)
    torch.testing.assert_close(kh[:, 0], _minmax_int2(k[:, 0], -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(kh[:, 1], _minmax_int2(k[:, 1] @ h, -1) @ h.T, rtol=0, atol=1e-4)


@pytest.mark.parametrize("length", [100, 320, 4096, 131072])
def test_effective_bits_formulas(length):
    d = 128
    bf16 = min(length, 320)  # the 64 + 256 windows of PAPER
    hist = length - bf16
    expect_int2 = (hist * (2 + 32 / 128) + bf16 * 16) / length
    expect_k32 = (hist * ((2 + 32 / 32) + (2 + 32 / 128)) / 2 + bf16 * 16) / length
    methods = {m.name: m for m in standard_methods(d, PAPER)}
    assert methods["bf16"].effective_bits(length, d, PAPER) == 16
    for name in ("int2", "quarot-int2", "hadamard-clip", "kivi2-g128"):
        assert methods[name].effective_bits(length, d, PAPER) == pytest.approx(expect_int2, rel=1e-12)
    assert methods["kivi2-g32"].effective_bits(length, d, PAPER) == pytest.approx(expect_k32, rel=1e-12)
    art = ArtifactInt2("oscar", artifact=identity_artifact(1, 2, 4, d, fmt=PAPER))
    assert art.effective_bits(length, d, PAPER) == pytest.approx(expect_int2, rel=1e-12)


def test_published_bit_counts():
    # OSCAR_METHOD section 5: 2.28 at 128K, 2.38 at 32K for G = d = 128 (fp16 scales, 64/256 windows).
    int2 = RowwiseInt2("int2", fmt=PAPER)
    assert round(int2.effective_bits(131072, 128, PAPER), 2) == 2.28
    assert round(int2.effective_bits(32768, 128, PAPER), 2) == 2.38
    assert KVMethod().effective_bits(1000, 128, PAPER) == 16.0


def test_a_rowwise_method_needs_its_format():
    with pytest.raises(TypeError, match="fmt: expected the KVFormat"):
        RowwiseInt2("int2")


def test_bf16_method_is_identity():
    k, v = _kv()
    m = KVMethod()
    assert not m.quantizes(0)
    kh, vh = m.fake_quantize(0, k, v, PAPER)
    assert torch.equal(kh, k) and torch.equal(vh, v)


def test_standard_methods_names_and_order():
    names = [m.name for m in standard_methods(64, PAPER, {"oscar-head": identity_artifact(1, 2, 4, 64, fmt=PAPER)})]
    assert names == ["bf16", "int2", "kivi2-g128", "kivi2-g32", "quarot-int2", "hadamard-clip", "oscar-head"]
