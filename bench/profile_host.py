"""Where the host time of an eager decode call goes (no CUDA graph): the full call (three launches by default) with
and without argument checks, the single fused launch (and as the transformers integration calls it), each of the
three launches alone, and a cProfile of the fused call. Small shape (8K, batch 1), where the call is host-bound.

    python3 bench/profile_host.py > bench/results/host_overhead_<gpu>.txt
"""

from __future__ import annotations

import cProfile
import io
import math
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import H_KV, H_Q, D, host_ms, make_int2_cache  # noqa: E402

from runtime_kernels import attention as A  # noqa: E402
from runtime_kernels.attention import merge, triton_int2, triton_window  # noqa: E402


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    pools, table, hist_len, k_win, v_win, slot_ids, win_len, _, _ = make_int2_cache(1, 8192, gen)
    q = torch.randn(1, H_Q, D, device="cuda", generator=gen).to(torch.bfloat16)
    args = (q, *pools, table, hist_len, k_win, v_win, slot_ids, win_len)
    s_h = A.int2_num_splits(q, *pools, table, hist_len, A.BLOCK_N, A.INT2_NUM_WARPS, 3, A.INT2_IMPL)
    s_w = A.default_num_splits(1, H_KV, k_win.shape[2], q.device, block_n=A.BLOCK_N, min_tokens=A.BLOCK_N)
    o_part = torch.empty(1, H_Q, s_h + s_w, D, device="cuda")
    lse_part = torch.empty(1, H_Q, s_h + s_w, device="cuda")
    sc = 1 / math.sqrt(D)
    counters = torch.zeros(H_KV, dtype=torch.int32, device="cuda")

    rows = {
        "decode_attention (checks on)": lambda: A.decode_attention(*args),
        "decode_attention(validate=False)": lambda: A.decode_attention(*args, validate=False),
        "fused (validate=False)": lambda: A.decode_attention(*args, validate=False, fused=True),
        "fused, as OscarCache calls it": lambda: A.decode_attention(*args, validate=False, whole_pages=True,
                                                                     counters=counters, fused=True),
        "INT2 kernel launch alone": lambda: triton_int2.launch_int2_decode(
            q, *pools, table, hist_len, o_part, lse_part, sc, s_h, 0, A.BLOCK_N, A.INT2_NUM_WARPS, 3, A.INT2_IMPL),
        "window kernel launch alone": lambda: triton_window.launch_window_decode(
            q, k_win, v_win, slot_ids, win_len, o_part, lse_part, sc, s_w, s_h, A.BLOCK_N),
        "split reduce alone": lambda: merge.reduce_splits_triton(o_part, lse_part),
        "empty torch op (baseline)": lambda: o_part.zero_(),
    }
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, 8K / batch 1, impl {A.INT2_IMPL}, "
          f"splits {s_h}+{s_w}")
    for name, fn in rows.items():
        print(f"{name:<36} {host_ms(fn, n=2000) * 1e3:8.1f} us per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        A.decode_attention(*args, validate=False, whole_pages=True, counters=counters, fused=True)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    print(buf.getvalue())


if __name__ == "__main__":
    main()
