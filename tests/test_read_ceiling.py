"""The read-only ceiling kernel of `bench/read_ceiling.py` reads every byte the INT2 history programs read: the XOR of
its splits equals a host XOR over the same pages, for any split count (also more splits than pages), with plain
loads and with TMA box copies. Runs under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.test_attention_kernels import make_pool

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import read_ceiling  # noqa: E402

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("loads", ["ldg", "ldg_cg", "tma"])
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_read_only_kernel_reads_every_history_byte(splits, loads):
    lens = [4 * 16, 0, 2 * 16, 5 * 16]  # whole pages of 16 tokens; one empty history
    pool = make_pool(lens, h_kv=2, d=64, page=16, seed=5)
    pools, table, hist_len = pool[:6], pool[6], pool[7]
    got = read_ceiling.read_tiles(pools, table, hist_len, splits, loads)
    xor = got[..., 0].clone()
    for s in range(1, splits):
        xor ^= got[..., s]
    want = read_ceiling.reference_xor(pools, table, hist_len)
    assert torch.equal(xor, want)
    assert (want[1] == 0).all() and (want[0] != 0).any()


@pytest.mark.parametrize("loads", ["ldg", "tma"])
def test_read_only_kernel_misses_a_changed_byte(loads):
    """The checksum depends on every scale vector too: flipping one V-zero bit of a page in use changes it."""
    lens = [3 * 16]
    pool = make_pool(lens, h_kv=1, d=64, page=16, seed=6)
    pools, table, hist_len = list(pool[:6]), pool[6], pool[7]
    before = read_ceiling.read_tiles(pools, table, hist_len, 2, loads)
    page = int(table[0, 1])
    vz = pools[5].clone()
    vz.view(torch.int16)[page, 0, 3, 0] ^= 1
    pools[5] = vz
    after = read_ceiling.read_tiles(pools, table, hist_len, 2, loads)
    assert not torch.equal(before[..., 0] ^ before[..., 1], after[..., 0] ^ after[..., 1])
