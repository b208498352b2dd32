"""`launch_util.next_pow2` against Triton's own `next_power_of_2`, which the launchers used before."""

from __future__ import annotations

import triton

from runtime_kernels.launch_util import next_pow2


def test_next_pow2_equals_tritons():
    for n in range(0, 5000):
        assert next_pow2(n) == triton.next_power_of_2(n), n
    assert next_pow2(1 << 20) == 1 << 20 and next_pow2((1 << 20) + 1) == 1 << 21
