"""The stream-K decode launch (`triton_streamk`: equal runs of history tiles per program across all (sequence, KV
head) segments, window programs in the same grid, then a reduce that finds each segment's pieces from the lengths)
against an independent reference: one softmax over the dequantized history concatenated with the window. Runs
under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import pytest
import torch

from runtime_kernels import attention as A
from runtime_kernels.attention import triton_fused, triton_streamk, triton_window
from tests.test_attention_kernels import make_pool, make_q, make_window, rel_rmse
from tests.test_decode_fused import dense_reference, no_separate_launches

pytestmark = pytest.mark.interpreter


def run_case(lens, group, d, page, n_prog, whole_pages=False, win=80, seed=0):
    h_kv = 2
    pool = make_pool(lens, h_kv=h_kv, d=d, page=page, seed=seed)
    n = len(lens)
    k_win, v_win = make_window(n + 1, h_kv, win, d, torch.bfloat16, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed)
    slot_ids = torch.randperm(n + 1, generator=gen)[:n].to(torch.int32)
    win_len = torch.randint(0, win + 1, (n,), generator=gen).to(torch.int32)
    q = make_q(n, h_kv * group, d, torch.bfloat16)
    want_o, want_lse = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
    with pytest.MonkeyPatch.context() as m:
        no_separate_launches(m)
        m.setattr(A, "DECODE_STREAMK", True)
        o, lse = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="triton", num_splits=n_prog,
                                    whole_pages=whole_pages)
    assert rel_rmse(o, want_o) < 2e-2  # bf16 window operands and probabilities
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert torch.allclose(lse[fin], want_lse[fin], atol=2e-3)
    empty = [i for i in range(n) if lens[i] == 0 and int(win_len[i]) == 0]
    assert all((o[i] == 0).all() for i in empty)
    return o, lse


@pytest.mark.parametrize("lens,n_prog", [
    ([0, 130, 64, 7, 0], 1),         # one program walks every segment
    ([0, 130, 64, 7, 0], 3),         # programs end inside segments
    ([257, 1, 63, 4099], 7),
    ([257, 1, 63, 4099], 40),
    ([8, 8], 50),                    # more programs than tiles: most own nothing
    ([0, 0, 0], 5),                  # no history at all: window partials only
])
def test_streamk_matches_the_concatenated_softmax(lens, n_prog):
    run_case(lens, 4, 64, 16, n_prog, seed=len(lens) + n_prog)


@pytest.mark.parametrize("group,d,page", [(1, 256, 32), (8, 128, 64)])
def test_streamk_gqa_and_head_dims(group, d, page):
    run_case([300, 64, 0, 129], group, d, page, 5, seed=group)


def test_streamk_whole_pages_path():
    """PagedKVCache's promise (whole pages): the unmasked tile loop, programs still cutting pages between them."""
    run_case([256, 64, 512, 0], 4, 128, 64, 7, whole_pages=True, seed=3)


def test_streamk_program_count_rule(monkeypatch):
    """Without num_splits: the fixed programs-per-SM rule on CPU, capped at one program per MIN_SPLIT_TOKENS of the
    block tables' capacity; decode_num_splits reports the same count and the window split rule."""
    monkeypatch.setattr(A, "DECODE_STREAMK", True)
    pool = make_pool([300, 5], h_kv=2, d=64, page=16, seed=4)
    k_win, v_win = make_window(2, 2, 80, 64, torch.bfloat16, seed=5)
    args = (make_q(2, 8, 64, torch.bfloat16), *pool, k_win, v_win, torch.tensor([1, 0], dtype=torch.int32),
            torch.tensor([80, 3], dtype=torch.int32))
    capacity = 2 * 2 * pool[6].shape[1] * 16
    want = min(A.INT2_PROGRAMS_PER_SM * A._sm_count(torch.device("cpu")), -(-capacity // A.MIN_SPLIT_TOKENS))
    assert A.streamk_programs(*args) == want
    assert A.decode_num_splits(*args) == (want, triton_fused.window_splits(80))
    launched = []
    real = triton_streamk.launch_decode_streamk
    monkeypatch.setattr(triton_streamk, "launch_decode_streamk", lambda *a, **k: launched.append(a[14]) or real(*a, **k))
    A.decode_attention(*args, backend="triton")
    assert launched == [want]


def test_streamk_is_not_used_where_it_does_not_apply(monkeypatch):
    """fp32 windows (not served by the fused kernels' window chunk) and explicit window splits keep three launches."""
    monkeypatch.setattr(A, "DECODE_STREAMK", True)
    pool = make_pool([100], h_kv=2, d=64, page=16, seed=6)
    k_win, v_win = make_window(1, 2, 40, 64, torch.float32, seed=7)
    calls = []
    monkeypatch.setattr(triton_streamk, "launch_decode_streamk", lambda *a, **k: calls.append(1))
    real = triton_window.launch_window_decode
    monkeypatch.setattr(triton_window, "launch_window_decode", lambda *a, **k: calls.append(3) or real(*a, **k))
    q = make_q(1, 8, 64, torch.bfloat16)
    slots, wl = torch.tensor([0], dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    A.decode_attention(q, *pool, k_win, v_win, slots, wl, backend="triton")
    A.decode_attention(q, *pool, k_win.bfloat16(), v_win.bfloat16(), slots, wl, backend="triton", window_splits=2)
    assert calls == [3, 3]
