"""Degenerate rows (all zero, constant, nearly constant far from 0) quantize to finite values, the same on both paths."""

import pytest
import torch
from format_helpers import qfmt

from runtime_kernels.quant import naive, quantize_pack


def _rows(d=64):
    g = torch.Generator().manual_seed(0)
    return torch.stack([
        torch.zeros(d),                                  # all zero: scale would round to 0 in fp16
        torch.full((d,), 5.0),                           # constant
        -300.0 + 1e-3 * torch.randn(d, generator=g),     # nearly constant, far from 0: zero point overflow
        torch.randn(d, generator=g),                     # ordinary row (unchanged by the floors)
    ])[:, None, :]  # [T=4, H=1, d]


@pytest.mark.parametrize("group_size", [None, 16])
def test_degenerate_rows_stay_finite_and_close(group_size):
    x = _rows()
    packed, scale, zero = naive.quantize_pack(x, None, None, qfmt(group_size))
    assert torch.isfinite(scale.float()).all() and (scale.float() > 0).all() and torch.isfinite(zero.float()).all()
    xq = naive.unpack_dequantize(packed, scale, zero, qfmt())
    assert torch.isfinite(xq).all()
    err = (xq - x).abs().amax(dim=-1).flatten()
    assert err[0] == 0 and err[1] < 5.0 * 2**-10 and err[2] < 300.0 * 2**-10
    # The ordinary row gets exactly the textbook min-max scale.
    lo, hi = x[3].amin(), x[3].amax()
    if group_size is None:
        assert scale[3, 0, 0] == ((hi - lo) / 3).half()


@pytest.mark.parametrize("group_size", [None, 16])
def test_triton_matches_reference_on_degenerate_rows(group_size):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU runs the Triton interpreter
    x = _rows().to(device)
    ref = naive.quantize_pack(x, None, None, qfmt(group_size))
    got = quantize_pack(x, None, None, qfmt(group_size), backend="triton")
    for r, g in zip(ref, got):
        assert torch.equal(r, g)
