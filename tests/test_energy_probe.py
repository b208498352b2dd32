"""The energy probe of `bench/energy_probe.py` reads the read-only ceiling's bytes (its XOR checksum equals the host
XOR of `read_ceiling.reference_xor`) and does the arithmetic each variant names (its fp32 sum equals a float64 host
computation of the same extraction and dots). Runs under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.test_attention_kernels import make_pool

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import energy_probe  # noqa: E402
import read_ceiling  # noqa: E402

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("variant", sorted(energy_probe.VARIANTS))
def test_probe_reads_every_byte_and_does_its_arithmetic(variant):
    lens = [3 * 16, 0, 2 * 16]  # whole pages of 16 tokens; one empty history
    pool = make_pool(lens, h_kv=2, d=128, page=16, seed=11)
    pools, table, hist_len = pool[:6], pool[6], pool[7]
    xor, sums, clk = energy_probe.probe(pools, table, hist_len, 2, variant)
    assert clk is None
    assert torch.equal(xor[..., 0] ^ xor[..., 1], read_ceiling.reference_xor(pools, table, hist_len))
    want = energy_probe.reference_sums(pools, table, hist_len, variant)
    got = sums.sum(-1).double()
    if variant == "read":
        assert torch.equal(got, want)  # no arithmetic: zeros
    else:
        assert (want[0] > 0).all() and (want[1] == 0).all()
        # fp16 running sums (extract, extract+mma_h) round; fp32 and integer accumulation of exact products do not
        tol = 1e-5 if variant in ("mma", "mma1", "extract+mma", "extract8+mma8") else 5e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=0)


def test_probe_variants_differ_and_bad_input_is_named():
    """Each arithmetic variant sums something else (so a variant that silently skipped its work would fail above),
    and an unknown variant or a clock reading without a GPU is refused by name."""
    pool = make_pool([2 * 16], h_kv=1, d=128, page=16, seed=12)
    pools, table, hist_len = pool[:6], pool[6], pool[7]
    sums = {v: float(energy_probe.reference_sums(pools, table, hist_len, v).sum())
            for v in ("extract", "mma", "mma1", "extract+mma", "extract8+mma8")}
    assert len(set(sums.values())) == 5
    with pytest.raises(ValueError, match="variant 'lop3'"):
        energy_probe.probe(pools, table, hist_len, 1, "lop3")
    with pytest.raises(ValueError, match="clock=True needs a CUDA device"):
        energy_probe.probe(pools, table, hist_len, 1, "read", clock=True)
