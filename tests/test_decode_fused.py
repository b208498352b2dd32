"""The fused decode launch (`triton_fused`: INT2 splits + window splits + in-kernel split reduce) against an
independent reference (one softmax over the dequantized history concatenated with the window) and against the
three-launch path. Runs under TRITON_INTERPRET=1 on CPU (programs run one after another there, so the last
program of each KV head is the one that reduces)."""

from __future__ import annotations

import pytest
import torch

from runtime_kernels import attention as A
from runtime_kernels.attention import naive as attn_naive
from runtime_kernels.attention import paged_ref, triton_fused, triton_int2, triton_window
from tests.test_attention_kernels import make_pool, make_q, make_window, rel_rmse

pytestmark = pytest.mark.interpreter


def dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len):
    """Per sequence: softmax over [dequantized history ++ valid window rows] -> (o `[B, H_q, d]`, lse `[B, H_q]`)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        k_h = paged_ref.gather_history(pool[0], pool[1], pool[2], pool[6][b], lens[b])
        v_h = paged_ref.gather_history(pool[3], pool[4], pool[5], pool[6][b], lens[b])
        n_w = int(win_len[b])
        k = torch.cat([k_h, k_win[slot_ids[b], :, :n_w].float()], dim=1)
        v = torch.cat([v_h, v_win[slot_ids[b], :, :n_w].float()], dim=1)
        if k.shape[1] == 0:
            outs.append(torch.zeros(1, q.shape[1], q.shape[2]))
            lses.append(torch.full((1, q.shape[1]), float("-inf")))
            continue
        o, lse = attn_naive.segment_attention(q[b:b + 1], k[None], v[None])
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def no_separate_launches(monkeypatch):
    """Make the three-launch path's launchers fail, so a passing call proves the fused kernel ran."""
    def boom(*a, **k):
        raise AssertionError("the three-launch path ran")

    monkeypatch.setattr(triton_int2, "launch_int2_decode", boom)
    monkeypatch.setattr(triton_window, "launch_window_decode", boom)


@pytest.mark.parametrize("group,d,page", [(4, 128, 64), (8, 64, 64), (1, 256, 32), (4, 64, 16)])
def test_fused_decode_matches_the_concatenated_softmax(monkeypatch, group, d, page):
    lens = [0, 130, 64, 7, 0]
    h_kv = 2
    pool = make_pool(lens, h_kv=h_kv, d=d, page=page, seed=60 + group)
    k_win, v_win = make_window(6, h_kv, 80, d, torch.bfloat16, seed=7)
    slot_ids = torch.tensor([5, 0, 3, 1, 2], dtype=torch.int32)
    win_len = torch.tensor([80, 33, 0, 1, 0], dtype=torch.int32)  # the last sequence is empty: o = 0, lse = -inf
    q = make_q(len(lens), h_kv * group, d, torch.bfloat16)
    want_o, want_lse = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
    fused_launch = pytest.MonkeyPatch.context()
    with fused_launch as m:
        no_separate_launches(m)
        o, lse = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="triton", num_splits=3,
                                    fused=True)
    assert rel_rmse(o, want_o) < 2e-2  # bf16 window operands and probabilities
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert torch.allclose(lse[fin], want_lse[fin], atol=2e-3)
    assert (o[4] == 0).all()
    o3, lse3 = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="triton", num_splits=3)
    assert rel_rmse(o, o3) < 1e-2
    assert torch.allclose(lse[fin], lse3[fin], atol=1e-3)


def test_fused_decode_leaves_counters_zero_and_reuses_them(monkeypatch):
    """The last program resets its counter, so one buffer serves call after call (as under CUDA graph replay); a
    stale count would make no program reduce and leave the output unwritten."""
    lens = [256, 512]
    pool = make_pool(lens, h_kv=2, d=64, page=64, seed=70)
    k_win, v_win = make_window(2, 2, 40, 64, torch.bfloat16, seed=8)
    slot_ids = torch.tensor([1, 0], dtype=torch.int32)
    win_len = torch.tensor([40, 17], dtype=torch.int32)
    counters = torch.zeros(16, dtype=torch.int32)
    want_o, _ = dense_reference(make_q(2, 8, 64, torch.bfloat16), pool, lens, k_win, v_win, slot_ids, win_len)
    no_separate_launches(monkeypatch)
    for seed, whole in ((1, False), (2, True), (1, True)):
        q = make_q(2, 8, 64, torch.bfloat16, seed=seed)
        o, _ = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="triton", num_splits=2,
                                  counters=counters, whole_pages=whole, fused=True)
        assert (counters == 0).all()
        want_o, _ = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
        assert rel_rmse(o, want_o) < 2e-2


def one_sequence_args(history: int, h_q: int, seed: int) -> tuple:
    """decode_attention's inputs for one sequence: `history` INT2 tokens (2 KV heads, d = 64, 64-token pages) and a
    full 8-token BF16 window, bf16 queries of h_q heads."""
    pool = make_pool([history], h_kv=2, d=64, page=64, seed=seed)
    k_win, v_win = make_window(1, 2, 8, 64, torch.bfloat16)
    return (make_q(1, h_q, 64, torch.bfloat16), *pool, k_win, v_win, torch.tensor([0], dtype=torch.int32),
            torch.tensor([8], dtype=torch.int32))


def test_fused_decode_rejects_a_bad_counters_buffer():
    args = one_sequence_args(64, 4, seed=71)
    with pytest.raises(ValueError, match=r"counters: .*at least B \* H_kv = 2"):
        A.decode_attention(*args, backend="triton", counters=torch.zeros(1, dtype=torch.int32), fused=True)
    with pytest.raises(TypeError, match="counters"):
        A.decode_attention(*args, backend="triton", counters=torch.zeros(2, dtype=torch.int64), fused=True)


@pytest.mark.parametrize("windows_first", [False, True])
@pytest.mark.parametrize("group,d,page", [(4, 128, 64), (1, 256, 32)])
def test_shared_grid_decode_matches_the_concatenated_softmax(monkeypatch, group, d, page, windows_first):
    """Two-launch mode (`DECODE_SHARED_GRID`): history and window programs in one grid (no in-kernel reduce, the
    counters are never touched), then the split reduce. Same answer as the reference; the separate INT2 and window
    launchers must not run."""
    lens = [0, 130, 64, 7, 0]
    h_kv = 2
    pool = make_pool(lens, h_kv=h_kv, d=d, page=page, seed=80 + group)
    k_win, v_win = make_window(6, h_kv, 80, d, torch.bfloat16, seed=9)
    slot_ids = torch.tensor([5, 0, 3, 1, 2], dtype=torch.int32)
    win_len = torch.tensor([80, 33, 0, 1, 0], dtype=torch.int32)
    q = make_q(len(lens), h_kv * group, d, torch.bfloat16)
    want_o, want_lse = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
    monkeypatch.setattr(A, "DECODE_SHARED_GRID", True)
    monkeypatch.setattr(triton_fused, "WINDOWS_FIRST", windows_first)  # program order only, same partial slots
    with pytest.MonkeyPatch.context() as m:
        no_separate_launches(m)
        o, lse = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="triton", num_splits=3)
        o_auto, _ = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="triton")
    assert rel_rmse(o, want_o) < 2e-2
    assert rel_rmse(o_auto, want_o) < 2e-2
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert torch.allclose(lse[fin], want_lse[fin], atol=2e-3)
    assert (o[4] == 0).all()
    # An explicit window split count selects the three-launch path (its window kernel), also in this mode.
    launched = []
    real = triton_window.launch_window_decode
    monkeypatch.setattr(triton_window, "launch_window_decode", lambda *a, **k: launched.append(1) or real(*a, **k))
    o3, _ = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="triton", num_splits=3,
                               window_splits=2)
    assert launched == [1]
    assert rel_rmse(o, o3) < 1e-2


@pytest.mark.parametrize("merge_in_kernel", [True, False])
@pytest.mark.parametrize("d,lens,splits", [
    (64, [64 * 9, 0, 64, 64 * 4], 2),    # odd page counts leave a one-page tail; an empty and a one-page history
    (128, [64 * 7, 64 * 8, 64 * 3], 3),
    (64, [64 * 5, 64 * 2], 1),
])
def test_two_page_tiles_match_the_concatenated_softmax(monkeypatch, merge_in_kernel, d, lens, splits):
    """`PAIR_TILES` (whole 64-token pages, impl 6): the history programs run tiles of two pages as eight 16-token
    pieces and a last program per (sequence, KV head) takes the odd page, in the one-launch and the two-launch form.
    Against the reference, and against the same call with one-page tiles."""
    h_kv, group = 2, 4
    pool = make_pool(lens, h_kv=h_kv, d=d, page=64, seed=d + splits)
    k_win, v_win = make_window(len(lens) + 1, h_kv, 48, d, torch.bfloat16, seed=11)
    slot_ids = torch.arange(len(lens), dtype=torch.int32)
    win_len = torch.tensor([48, 5, 0, 20][:len(lens)], dtype=torch.int32)
    q = make_q(len(lens), h_kv * group, d, torch.bfloat16)
    want_o, want_lse = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
    monkeypatch.setattr(A, "DECODE_SHARED_GRID", not merge_in_kernel)
    monkeypatch.setattr(triton_int2, "K_INT8_SCORES", False)  # two-page tiles score in fp16: compare like with like
    kw = dict(backend="triton", num_splits=splits, whole_pages=True, fused=merge_in_kernel)
    pair_builds = []
    real_pair = triton_int2.pair_constexprs
    with pytest.MonkeyPatch.context() as m:
        no_separate_launches(m)
        m.setattr(triton_int2, "pair_constexprs", lambda *a: pair_builds.append(1) or real_pair(*a))
        m.setattr(triton_int2, "PAIR_TILES", True)
        o, lse = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, **kw)
        assert pair_builds == [1]  # the two-page-tile programs ran
        m.setattr(triton_int2, "PAIR_TILES", False)
        o1, lse1 = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, **kw)
        assert pair_builds == [1]
    assert rel_rmse(o, want_o) < 2e-2
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert torch.allclose(lse[fin], want_lse[fin], atol=2e-3)
    assert rel_rmse(o, o1) < 1e-3
    assert torch.allclose(lse[fin], lse1[fin], atol=1e-4)


def test_pools_with_other_strides_give_the_same_answer():
    """The pool strides are compile-time constants taken from the tensors, not assumed: the same pools as views of
    one block per (page, KV head) (codes and scale/zero side by side, as `bench_decode.make_int2_cache(layout="tile")`
    lays them out) give exactly the contiguous pools' result, and both match the reference."""
    lens = [64 * 5, 0, 64 * 2]
    h_kv, group, d, page = 2, 4, 128, 64
    pool = make_pool(lens, h_kv=h_kv, d=d, page=page, seed=21)
    kc, ks, kz, vc, vs, vz, table, hist_len = pool
    n_pages, cb = kc.shape[0], page * d // 4
    blk = torch.zeros(n_pages, h_kv, 2 * cb + 8 * page, dtype=torch.uint8)
    views = (blk[:, :, :cb].view(n_pages, h_kv, page, d // 4), blk[:, :, cb:2 * cb].view(n_pages, h_kv, page, d // 4),
             *(blk[:, :, 2 * cb:].view(torch.float16).view(n_pages, h_kv, 4, page)[:, :, i, :, None] for i in range(4)))
    for dst, src in zip(views, (kc, vc, ks, kz, vs, vz)):
        dst.copy_(src)
    strided = (views[0], views[2], views[3], views[1], views[4], views[5], table, hist_len)
    assert strided[0].stride() != kc.stride() and strided[1].stride() != ks.stride()
    k_win, v_win = make_window(3, h_kv, 40, d, torch.bfloat16, seed=13)
    slot_ids = torch.tensor([2, 0, 1], dtype=torch.int32)
    win_len = torch.tensor([40, 7, 0], dtype=torch.int32)
    q = make_q(len(lens), h_kv * group, d, torch.bfloat16)
    want_o, _ = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
    o, lse = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="triton", whole_pages=True)
    o_s, lse_s = A.decode_attention(q, *strided, k_win, v_win, slot_ids, win_len, backend="triton", whole_pages=True)
    assert torch.equal(o, o_s) and torch.equal(lse, lse_s)
    assert rel_rmse(o, want_o) < 2e-2


@pytest.mark.parametrize("whole_pages,pair", [(True, False), (False, False), (True, True)])
def test_zeros_in_the_v_dots_spare_columns_change_no_stored_bit(monkeypatch, whole_pages, pair):
    """`V_SPARE_ZERO`: the V dot's spare columns (a copy of each head's p * scale, computed and never stored) hold
    zeros instead. Every stored output is bit for bit the same as with the copies (16-token pieces, the masked
    one-piece loop, two-page tiles), and matches the reference."""
    lens = [64 * 5, 0, 64 * 3] if whole_pages else [64 * 5 - 9, 0, 70]
    h_kv, group, d = 2, 4, 64
    pool = make_pool(lens, h_kv=h_kv, d=d, page=64, seed=31)
    k_win, v_win = make_window(3, h_kv, 40, d, torch.bfloat16, seed=14)
    slot_ids = torch.tensor([2, 0, 1], dtype=torch.int32)
    win_len = torch.tensor([40, 7, 0], dtype=torch.int32)
    q = make_q(len(lens), h_kv * group, d, torch.bfloat16)
    want_o, _ = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
    monkeypatch.setattr(triton_int2, "PAIR_TILES", pair)
    kw = dict(backend="triton", num_splits=2, whole_pages=whole_pages)
    o, lse = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, **kw)
    monkeypatch.setattr(triton_int2, "V_SPARE_ZERO", True)
    assert triton_int2.chunk_constexprs(q, pool[0], 64, True, whole_pages)["SPARE_ZERO"] is True  # reaches kernels
    o_z, lse_z = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, **kw)
    assert torch.equal(o, o_z) and torch.equal(lse, lse_z)
    assert rel_rmse(o_z, want_o) < 2e-2


def test_chained_v_accumulation_in_the_whole_page_loop(monkeypatch):
    """`IMPL5_TILE_ACC = False` reaches the whole-page (16-token pieces) loops too, one- and two-page tiles: their V
    dots chain onto the rescaled chunk accumulators instead of fresh per-tile dots added by an FFMA. Under the
    interpreter the dots round to nearest, so both forms agree to fp32 rounding and match the reference, in both
    launch forms."""
    lens = [64 * 5, 0, 64 * 3]
    pool = make_pool(lens, h_kv=2, d=64, page=64, seed=32)
    k_win, v_win = make_window(3, 2, 40, 64, torch.bfloat16, seed=15)
    slot_ids = torch.tensor([2, 0, 1], dtype=torch.int32)
    win_len = torch.tensor([40, 7, 0], dtype=torch.int32)
    q = make_q(len(lens), 8, 64, torch.bfloat16)
    want_o, _ = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
    for fused, pair in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(triton_int2, "PAIR_TILES", pair)
        kw = dict(backend="triton", num_splits=2, whole_pages=True, fused=fused)
        monkeypatch.setattr(triton_int2, "IMPL5_TILE_ACC", True)
        o, lse = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, **kw)
        monkeypatch.setattr(triton_int2, "IMPL5_TILE_ACC", False)
        assert triton_int2.chunk_constexprs(q, pool[0], 64, True, True)["TILE_ACC"] is False
        o_c, lse_c = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, **kw)
        assert rel_rmse(o_c, o) < 1e-5 and torch.allclose(lse_c, lse, atol=1e-6)
        assert rel_rmse(o_c, want_o) < 2e-2


def test_program_timeline_is_gpu_only():
    """The bench's per-program timeline reads the GPU's global timer: asking for it elsewhere is a clear error."""
    args = one_sequence_args(128, 8, seed=73)
    with pytest.raises(ValueError, match="timeline needs a CUDA device"):
        triton_fused.launch_decode_fused(*args, torch.zeros(6, dtype=torch.int32), 0.125, 2, 1, merge=False,
                                         timeline=torch.zeros(1, 2, 3, 4, dtype=torch.int64))


@pytest.mark.parametrize("fused", [False, True])
def test_pages_of_two_tiles_in_the_fused_grid(monkeypatch, fused):
    """128-token pages under 64-token tiles (`PagedKVCache(page_size=128)`): every tile starts at row 0 or 64 of its
    page. Whole pages (the unmasked loop) and a partial last page, against the reference, in both launch forms."""
    h_kv = 2
    no_separate_launches(monkeypatch)
    for lens, whole in (([384, 128, 0], True), ([300, 129, 64], False)):
        pool = make_pool(lens, h_kv=h_kv, d=64, page=128, seed=len(lens) + sum(lens))
        k_win, v_win = make_window(3, h_kv, 16, 64, torch.bfloat16, seed=13)
        slot_ids = torch.tensor([2, 0, 1], dtype=torch.int32)
        win_len = torch.tensor([16, 3, 0], dtype=torch.int32)
        q = make_q(3, h_kv * 4, 64, torch.bfloat16, seed=sum(lens))
        want_o, want_lse = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
        o, lse = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="triton", num_splits=3,
                                    whole_pages=whole, fused=fused)
        assert rel_rmse(o, want_o) < 2e-2
        fin = torch.isfinite(want_lse)
        assert torch.allclose(lse[fin], want_lse[fin], atol=2e-3)


def paired_v(pool):
    """The same pool with its V scale and zero as two views of one `[pages, H, P, 2]` buffer (scale, zero per row)."""
    kc, ks, kz, vc, vs, vz, table, hist = pool
    vs2, vz2 = triton_int2.alloc_paired_v_pools(*vs.shape[:3], vs.device)
    vs2.copy_(vs)
    vz2.copy_(vz)
    return kc, ks, kz, vc, vs2, vz2, table, hist


@pytest.mark.parametrize("fused", [False, True])
def test_paired_v_scale_and_zero_pools(monkeypatch, fused):
    """V scale and zero interleaved in one buffer (`triton_int2.V_PAIRED_POOLS`): the whole-page loop reads each
    zero with its scale (`VPAIR`); the masked loop reads the same views with their strides. Same answer as the
    separate pools and the reference, in both launch forms; with the switch off the paired views still work."""
    lens = [640, 0, 192, 64]
    h_kv = 2
    pool = make_pool(lens, h_kv=h_kv, d=128, page=64, seed=77)
    paired = paired_v(pool)
    assert triton_int2.paired_v_pools(paired[4], paired[5]) and not triton_int2.paired_v_pools(pool[4], pool[5])
    k_win, v_win = make_window(4, h_kv, 24, 128, torch.bfloat16, seed=14)
    slot_ids = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
    win_len = torch.tensor([24, 5, 0, 9], dtype=torch.int32)
    q = make_q(4, h_kv * 4, 128, torch.bfloat16, seed=15)
    want_o, want_lse = dense_reference(q, pool, lens, k_win, v_win, slot_ids, win_len)
    no_separate_launches(monkeypatch)
    kw = dict(backend="triton", num_splits=3, fused=fused)
    o_sep, _ = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, whole_pages=True, **kw)
    fin = torch.isfinite(want_lse)
    for on in (True, False):
        monkeypatch.setattr(triton_int2, "V_PAIRED_POOLS", on)
        for whole in (True, False):
            o, lse = A.decode_attention(q, *paired, k_win, v_win, slot_ids, win_len, whole_pages=whole, **kw)
            assert rel_rmse(o, want_o) < 2e-2
            assert torch.allclose(lse[fin], want_lse[fin], atol=2e-3)
            if whole:
                assert torch.equal(o, o_sep)  # the same values, read another way
