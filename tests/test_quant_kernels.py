"""Triton quantize/pack kernel vs the torch reference `naive.quantize_pack` (bit-exact), golden packing vectors,
paged scatter (`write_pages`), and input validation. Runs under TRITON_INTERPRET=1 on CPU (conftest)."""

from __future__ import annotations

import pytest
import torch

from runtime_kernels import quant
from runtime_kernels.attention.int2_decode import naive as paged_ref
from runtime_kernels.quant import naive

pytestmark = pytest.mark.interpreter  # Triton kernels on CPU tensors (see conftest)


def _rotations(h: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]


def _data(t: int, h: int, d: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Per-row magnitudes vary over two orders so scales differ across rows; a few outliers exercise clipping.
    x = torch.randn(t, h, d, generator=g) * torch.exp(torch.randn(t, h, 1, generator=g))
    x[..., 3] *= 8
    return x.to(dtype)


# ------------------------------------------------------------------------------------- golden vectors
def test_pack_golden_bytes():
    """Quarter-split layout written out by hand: byte j = c[j] | c[j+Q] << 2 | c[j+2Q] << 4 | c[j+3Q] << 6."""
    codes = torch.tensor([[0, 1, 2, 3, 3, 2, 1, 0]], dtype=torch.uint8)  # d = 8, Q = 2
    # byte 0: c0=0, c2=2, c4=3, c6=1 -> 0 + 2*4 + 3*16 + 1*64 = 120; byte 1: c1=1, c3=3, c5=2, c7=0 -> 1+12+32 = 45
    assert naive.pack(codes).tolist() == [[120, 45]]
    assert torch.equal(naive.unpack(torch.tensor([[120, 45]], dtype=torch.uint8)), codes)


def test_kernel_golden_bytes():
    """A row whose min-max quantization is the identity (lo = 0, hi = 3 -> scale 1, zero 0) packs to known bytes."""
    x = torch.tensor([[[0.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0]]])  # [T=1, H=1, d=8]
    packed, scale, zero = quant.quantize_pack(x, None, None, backend="triton", scale_format="float16",
                                              quantizer="uniform_minmax")
    assert packed.tolist() == [[[120, 45]]]
    assert scale.tolist() == [[[1.0]]] and zero.tolist() == [[[0.0]]]
    # One more: all bits set in byte 0 (channels 0, 2, 4, 6 = 3) and byte 1 = 0 except the top pair (channel 7 = 1).
    x = torch.tensor([[[3.0, 0.0, 3.0, 0.0, 3.0, 0.0, 3.0, 1.0]]])
    packed, _, _ = quant.quantize_pack(x, None, None, backend="triton", scale_format="float16",
                                       quantizer="uniform_minmax")
    assert packed.tolist() == [[[255, 64]]]


# ------------------------------------------------------------------------------------------ bit-exact
@pytest.mark.parametrize("t", [1, 7, 63, 257])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_quantize_pack_bit_exact(t, d):
    h = 2
    x = _data(t, h, d, seed=t * 1000 + d)
    rot = _rotations(h, d, seed=d)
    ratio = torch.tensor([0.9, 0.97])
    got = quant.quantize_pack(x, rot, ratio, backend="triton", scale_format="float16",
                              quantizer="uniform_minmax")
    want = naive.quantize_pack(x, rot, ratio, scale_format="float16", quantizer="uniform_minmax")
    for name, a, b in zip(("packed", "scale", "zero"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs at t={t} d={d}"


@pytest.mark.parametrize("group_size,clip", [(32, True), (16, False), (24, True), (None, False)])
def test_quantize_pack_groups_and_no_clip(group_size, clip):
    d = 96 if group_size == 24 else 64  # 96: head_dim not a power of two
    x = _data(19, 3, d, seed=5)
    ratio = torch.tensor([0.5, 0.9, 1.0]) if clip else None
    got = quant.quantize_pack(x, None, ratio, group_size, backend="triton", scale_format="float16",
                              quantizer="uniform_minmax")
    want = naive.quantize_pack(x, None, ratio, group_size, scale_format="float16", quantizer="uniform_minmax")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_pack_half_inputs(dtype):
    x = _data(9, 2, 64, seed=11, dtype=dtype)
    rot = _rotations(2, 64, seed=3)
    ratio = torch.tensor([0.95, 0.92])
    got = quant.quantize_pack(x, rot, ratio, backend="triton", scale_format="float16",
                              quantizer="uniform_minmax")
    want = naive.quantize_pack(x, rot, ratio, scale_format="float16", quantizer="uniform_minmax")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_in_kernel_sort_matches_torch_threshold():
    """The on-GPU default takes the order statistic with tl.sort inside the kernel; same bytes as the torch path."""
    from runtime_kernels.quant.triton_quant import quantize_pack_into

    x = _data(3, 2, 64, seed=2)
    ratio = torch.tensor([0.8, 0.96])
    outs = []
    for mode in ("kernel", "torch"):
        codes = torch.zeros(3, 2, 1, 16, dtype=torch.uint8)
        scale = torch.zeros(3, 2, 1, 1, dtype=torch.float16)
        zero = torch.zeros_like(scale)
        rows = torch.arange(3)
        quantize_pack_into(x, ratio, codes, scale, zero, rows, rows * 0, 64, clip_mode=mode,
                           quantizer="uniform_minmax")
        outs.append((codes[:, :, 0], scale[:, :, 0], zero[:, :, 0]))
    want = naive.quantize_pack(x, None, ratio, scale_format="float16", quantizer="uniform_minmax")
    for got in outs:
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_kernel_clip_index_from_the_ratio_matches_the_reference(dtype):
    """In the kernel's clip mode (the CUDA default of `write_pages`) the kernel derives the order-statistic index
    from the ratio itself: same bytes as the reference for ratios whose `ratio * d` lands exactly on an integer (0.5 * 64, 1.0,
    clamped to d - 1), just below one, and in between; bf16 rows are read as they are (widened in the kernel)."""
    from runtime_kernels.quant.triton_quant import quantize_pack_into

    x = _data(5, 4, 64, seed=3).to(dtype)
    ratio = torch.tensor([0.5, 1.0, 0.96, 0.984375 - 1e-7])  # 32, 64 -> 63, 61.44, 62.99999
    codes = torch.zeros(5, 4, 1, 16, dtype=torch.uint8)
    scale = torch.zeros(5, 4, 1, 1, dtype=torch.float16)
    zero = torch.zeros_like(scale)
    rows = torch.arange(5)
    quantize_pack_into(x, ratio, codes, scale, zero, rows, rows * 0, 64, clip_mode="kernel",
                       quantizer="uniform_minmax")
    want = naive.quantize_pack(x, None, ratio, scale_format="float16", quantizer="uniform_minmax")
    for a, b in zip((codes[:, :, 0], scale[:, :, 0], zero[:, :, 0]), want):
        assert torch.equal(a, b)


def test_rotation_matches_reference_by_tolerance():
    """Dequantized rotated values equal naive.fake_quantize (the rotation itself is a torch fp32 matmul)."""
    x = _data(33, 2, 64, seed=8)
    rot = _rotations(2, 64, seed=9)
    packed, scale, zero = quant.quantize_pack(x, rot, None, backend="triton", scale_format="float16",
                                              quantizer="uniform_minmax")
    got = naive.unpack_dequantize(packed, scale, zero)
    want = naive.fake_quantize(x, rot, None, unrotate=False, scale_format="float16",
                               quantizer="uniform_minmax")
    assert torch.allclose(got, want, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ write_pages
@pytest.mark.parametrize("group_size", [None, 32])
def test_write_pages_scatter_matches_reference(group_size):
    h, d, p, n_pages = 2, 64, 16, 6
    g = group_size or d
    x = _data(37, h, d, seed=4)
    rot = _rotations(h, d, seed=1)
    ratio = torch.tensor([0.9, 0.95])
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(n_pages * p, generator=gen)[:37]  # distinct (page, row) targets, scattered
    page_ids, rows = (slots // p).to(torch.int32), (slots % p).to(torch.int64)
    pools = []
    for backend in ("triton", "torch"):
        codes = torch.full((n_pages, h, p, d // 4), 7, dtype=torch.uint8)
        scale = torch.full((n_pages, h, p, d // g), -1.0, dtype=torch.float16)
        zero = scale.clone()
        quant.write_pages(x, rot, ratio, codes, scale, zero, page_ids, rows, group_size, backend=backend,
                          quantizer="uniform_minmax")
        pools.append((codes, scale, zero))
    for a, b in zip(*pools):
        assert torch.equal(a, b)
    # Untouched rows keep their fill value; written rows hold the reference bytes.
    packed, _, _ = naive.quantize_pack(x, rot, ratio, group_size, scale_format="float16",
                                       quantizer="uniform_minmax")
    assert torch.equal(pools[0][0][page_ids.long(), :, rows], packed)
    untouched = torch.ones(n_pages * p, dtype=torch.bool)
    untouched[slots] = False
    flat = pools[0][0].permute(0, 2, 1, 3).reshape(n_pages * p, h, d // 4)
    assert (flat[untouched] == 7).all()


def test_write_pages_ref_is_quantize_pack_ref():
    x = _data(5, 1, 64, seed=6)
    codes = torch.zeros(2, 1, 8, 16, dtype=torch.uint8)
    scale = torch.zeros(2, 1, 8, 1, dtype=torch.float16)
    zero = torch.zeros_like(scale)
    ids = torch.tensor([1, 1, 0, 0, 1])
    rows = torch.tensor([0, 7, 3, 4, 2])
    paged_ref.write_pages_ref(x, None, None, codes, scale, zero, ids, rows, scale_format="float16",
                              quantizer="uniform_minmax")
    packed, s, z = paged_ref.quantize_pack_ref(x, None, None, scale_format="float16",
                                               quantizer="uniform_minmax")
    assert torch.equal(codes[ids, :, rows], packed) and torch.equal(scale[ids, :, rows], s)


def test_empty_input_is_a_no_op():
    x = torch.zeros(0, 2, 64)
    packed, scale, zero = quant.quantize_pack(x, None, None, backend="triton", scale_format="float16",
                                              quantizer="uniform_minmax")
    assert packed.shape == (0, 2, 16) and scale.shape == (0, 2, 1)


# ------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_name_the_tensor():
    x = torch.randn(4, 2, 64)
    with pytest.raises(TypeError, match="x: dtype"):
        quant.quantize_pack(x.to(torch.int32), None, None, scale_format="float16", quantizer="uniform_minmax")
    with pytest.raises(ValueError, match="x: head_dim must be a multiple of 4"):
        quant.quantize_pack(torch.randn(4, 2, 66), None, None, scale_format="float16",
                            quantizer="uniform_minmax")
    with pytest.raises(ValueError, match="x: expected 3 dimensions"):
        quant.quantize_pack(torch.randn(4, 64), None, None, scale_format="float16",
                            quantizer="uniform_minmax")
    with pytest.raises(ValueError, match="rotation: expected shape"):
        quant.quantize_pack(x, torch.eye(64).expand(3, 64, 64), None, scale_format="float16",
                            quantizer="uniform_minmax")
    with pytest.raises(ValueError, match="clip_ratio: .*device"):
        quant.quantize_pack(x, None, torch.ones(2, device="meta"), scale_format="float16",
                            quantizer="uniform_minmax")
    with pytest.raises(ValueError, match="clip_ratio: .*size 3"):
        quant.quantize_pack(x, None, torch.ones(3), scale_format="float16", quantizer="uniform_minmax")
    with pytest.raises(ValueError, match="group_size"):
        quant.quantize_pack(x, None, None, group_size=48, scale_format="float16", quantizer="uniform_minmax")
    with pytest.raises(ValueError, match="backend"):
        quant.quantize_pack(x, None, None, backend="cuda", scale_format="float16", quantizer="uniform_minmax")
    codes = torch.zeros(2, 2, 8, 16, dtype=torch.uint8)
    scale = torch.zeros(2, 2, 8, 1, dtype=torch.float16)
    ids = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(TypeError, match="scale_pool: dtype must be float16"):
        quant.write_pages(x, None, None, codes, scale.float(), scale, ids, ids, quantizer="uniform_minmax")
    with pytest.raises(ValueError, match="codes_pool: .*head_dim // 4"):
        quant.write_pages(x, None, None, codes[..., :8], scale, scale, ids, ids, quantizer="uniform_minmax")
    with pytest.raises(ValueError, match="rows: .*one entry per token"):
        quant.write_pages(x, None, None, codes, scale, scale, ids, ids[:3], quantizer="uniform_minmax")
    with pytest.raises(TypeError, match="page_ids: dtype"):
        quant.write_pages(x, None, None, codes, scale, scale, ids.float(), ids, quantizer="uniform_minmax")
