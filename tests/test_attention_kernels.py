"""Triton decode attention kernels (INT2 history, BF16 window, split reduce) vs the torch references in
`paged_ref` / `naive`, compared by relative RMSE with an absolute floor. Runs under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from runtime_kernels import attention as A
from runtime_kernels.attention import merge as M
from runtime_kernels.attention import naive as attn_naive
from runtime_kernels.attention import paged_ref, triton_int2
from runtime_kernels.quant import naive as qnaive

pytestmark = pytest.mark.interpreter  # Triton kernels on CPU tensors (see conftest)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def rel_rmse(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-3) -> float:
    """RMSE of the difference over max(RMS of the reference, floor)."""
    err = (got.float() - want.float()).pow(2).mean().sqrt()
    return (err / want.float().pow(2).mean().sqrt().clamp_min(floor)).item()


def assert_lse_close(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], rtol=0, atol=atol)


def make_pool(lens, h_kv, d, page, group_size=None, seed=0, extra_pages=3):
    """Random INT2 pool + a shuffled block table for sequences of the given history lengths.

    Returns codes/scale/zero for K and V (`[num_pages, H, P, *]`), block_table int32 `[B, max_pages]`,
    hist_len int32 `[B]`.
    """
    gen = torch.Generator().manual_seed(seed)
    g = group_size or d
    max_pages = max(1, max(-(-n // page) for n in lens))
    n_pages = len(lens) * max_pages + extra_pages

    def pool():
        x = torch.randn(n_pages * page, h_kv, d, generator=gen) * torch.exp(0.5 * torch.randn(n_pages * page, h_kv, 1,
                                                                                                  generator=gen))
        c, s, z = qnaive.quantize_pack(x, None, None, g)
        return [t.reshape(n_pages, page, h_kv, -1).transpose(1, 2).contiguous() for t in (c, s, z)]

    kc, ks, kz = pool()
    vc, vs, vz = pool()
    table = torch.randperm(n_pages, generator=gen)[: len(lens) * max_pages].reshape(len(lens), max_pages)
    return kc, ks, kz, vc, vs, vz, table.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def make_q(b, h_q, d, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h_q, d, generator=gen) * 1.5).to(dtype)


# -------------------------------------------------------------------------------------- INT2 history
@pytest.mark.parametrize("hist", [0, 1, 7, 8, 63, 257, 4099])
def test_int2_history_lengths(hist):
    pool = make_pool([hist], h_kv=1, d=64, page=64, seed=hist)
    q = make_q(1, 4, 64, torch.float32)
    o, lse = A.int2_decode_attention(q, *pool, backend="triton")
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < TOL[torch.float32]
    assert_lse_close(lse, lse_ref, 1e-4)
    if hist == 0:
        assert (o == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_int2_gqa_and_head_dims_mixed_batch(group, d):
    lens = [0, 9, 130, 65]
    pool = make_pool(lens, h_kv=2, d=d, page=64, seed=group * d)
    q = make_q(len(lens), 2 * group, d, torch.float32)
    o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=3)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < TOL[torch.float32]
    assert_lse_close(lse, lse_ref, 1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int2_half_queries(dtype):
    pool = make_pool([200, 31], h_kv=2, d=128, page=64, seed=3)
    q = make_q(2, 8, 128, dtype)
    o, lse = A.int2_decode_attention(q, *pool, backend="triton")
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < TOL[dtype]
    assert_lse_close(lse, lse_ref, 1e-3)


@pytest.mark.parametrize("page,block_n", [(16, 64), (32, 16)])
def test_int2_page_sizes(page, block_n):
    """Tiles spanning several pages (BLOCK_N > P: per-token page lookup) and several tiles per page."""
    pool = make_pool([100, 47], h_kv=2, d=64, page=page, seed=page)
    q = make_q(2, 8, 64, torch.float32)
    o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=2, block_n=block_n)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < TOL[torch.float32]
    assert_lse_close(lse, lse_ref, 1e-4)


@pytest.mark.parametrize("group_size", [16, 32])
def test_int2_group_sizes(group_size):
    pool = make_pool([77, 5], h_kv=2, d=64, page=16, group_size=group_size, seed=group_size)
    for dtype in (torch.float32, torch.bfloat16):
        q = make_q(2, 8, 64, dtype)
        o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=2)
        o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
        assert rel_rmse(o, o_ref) < TOL[dtype]
        # Grouped scales dequantize the keys to q's dtype before the dot: bf16 rounding of k (as in any BF16 kernel).
        assert_lse_close(lse, lse_ref, 1e-4 if dtype == torch.float32 else 5e-2)


@pytest.mark.parametrize("impl,prefetch", [(0, False), (1, False), (2, False), (0, True), (2, True), (3, False),
                                           (4, False), (4, True), (5, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int2_kernel_variants(impl, prefetch, dtype):
    """The INT2 kernel's code paths (dot on transposed tile, dot on pre-transposed load, no dot; with or without
    the software prefetch)."""
    pool = make_pool([0, 70, 129, 300], h_kv=2, d=64, page=64, seed=impl)
    q = make_q(4, 8, 64, dtype)
    o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=2, impl=impl, prefetch=prefetch)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < TOL[dtype]
    assert_lse_close(lse, lse_ref, 1e-3)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int2_bitcast_codes_half_queries(group, d, dtype):
    """The bitcast-code variant (impl 4 = the default; plain Triton under the interpreter) with half queries: bf16
    folds the +128 code offset into the zero term, fp16 subtracts 1024 exactly. Odd lengths, GQA 1/4/8."""
    lens = [0, 1, 7, 63, 257]
    pool = make_pool(lens, h_kv=2, d=d, page=64, seed=group * d + 1)
    q = make_q(len(lens), 2 * group, d, dtype, seed=group)
    o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=2, impl=4)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < TOL[dtype]
    assert_lse_close(lse, lse_ref, 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int2_bitcast_codes_long_history(dtype):
    """4099 tokens over several tiles and splits (the V accumulator carries the exact codes across tiles)."""
    pool = make_pool([4099, 1], h_kv=1, d=128, page=64, seed=41)
    q = make_q(2, 4, 128, dtype)
    o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=3, impl=3)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < TOL[dtype]
    assert_lse_close(lse, lse_ref, 1e-3)


@pytest.mark.parametrize("impl", [5, 6])
@pytest.mark.parametrize("dtype,vfold,group,d", [(torch.bfloat16, False, 4, 128), (torch.float16, True, 4, 128),
                                                 (torch.bfloat16, True, 7, 64), (torch.float16, False, 1, 256)])
def test_int2_impl5_tokens_on_mma_rows(dtype, vfold, group, d, impl):
    """impl 5 (tokens on the MMA rows, 16 codes per word with the code left in place, scale 4^k folded into q and
    the output): odd lengths, GQA 1/4/7 (padded heads), d 64/128/256, V offset exact or subtracted after a fresh
    per-tile dot. The partly folded K offset must keep the lse within 2e-4 (the bf16/fp16 query is exact in fp16).
    impl 6 (codes as fp16 subnormals, no offset; VFOLD does not apply) must meet the same bounds."""
    from runtime_kernels.attention import triton_int2

    lens = [0, 1, 7, 63, 257]
    pool = make_pool(lens, h_kv=2, d=d, page=64, seed=group * d + 5)
    q = make_q(len(lens), 2 * group, d, dtype, seed=group + 1)
    triton_int2.IMPL5_VFOLD = vfold
    try:
        o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=2, impl=impl)
    finally:
        triton_int2.IMPL5_VFOLD = False
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < 1e-3
    assert_lse_close(lse, lse_ref, 2e-4)


@pytest.mark.parametrize("impl", [5, 6])
def test_int2_impl5_long_history_and_page_straddling_tiles(impl):
    """impl 5 over 4099 tokens and 3 splits (the accumulators carry the exact V codes across tiles), and with
    32-token pages under 64-token tiles (per-token page lookup, masked code loads)."""
    pool = make_pool([4099, 1], h_kv=1, d=128, page=64, seed=43)
    q = make_q(2, 4, 128, torch.bfloat16)
    o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=3, impl=impl)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < 1e-3
    assert_lse_close(lse, lse_ref, 2e-4)
    pool = make_pool([200, 33], h_kv=2, d=64, page=32, seed=44)
    q = make_q(2, 8, 64, torch.float16)
    o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=2, impl=impl, block_n=64)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < 1e-3
    assert_lse_close(lse, lse_ref, 2e-4)


def test_int2_impl6_ignores_garbage_past_the_end_of_a_page():
    """impl 6 loads whole pages unmasked (so the loads vectorize and pipeline): rows past a sequence's end that hold
    NaN/inf scales and zeros and arbitrary codes, as a recycled page does, must not reach the output."""
    lens = [1, 63, 100, 257]
    kc, ks, kz, vc, vs, vz, table, hist = make_pool(lens, h_kv=2, d=128, page=64, seed=45)
    for i, n in enumerate(lens):
        for j in range(table.shape[1]):
            rows = slice(max(0, n - j * 64), 64)  # rows of page j past the end of sequence i
            for t in (ks, vs):
                t[table[i, j].long(), :, rows] = float("nan")
            for t in (kz, vz):
                t[table[i, j].long(), :, rows] = float("inf")
    q = make_q(len(lens), 8, 128, torch.bfloat16)
    o, lse = A.int2_decode_attention(q, kc, ks, kz, vc, vs, vz, table, hist, backend="triton", num_splits=2,
                                     impl=6)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, kc, ks, kz, vc, vs, vz, table, hist)
    assert torch.isfinite(o).all() and torch.isfinite(o_ref).all()
    assert rel_rmse(o, o_ref) < 1e-3
    assert_lse_close(lse, lse_ref, 2e-4)


def test_impl6_reads_more_than_one_block_of_page_ids():
    """impl 6 loads page ids 64 tiles at a time: one split of 70 tiles (4480 tokens) crosses into the second block,
    with pages in shuffled order, and must still match the reference."""
    pool = make_pool([4480, 4200], h_kv=1, d=64, page=64, seed=46)
    q = make_q(2, 4, 64, torch.float16)
    o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=1, impl=6)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < 1e-3
    assert_lse_close(lse, lse_ref, 2e-4)


def _int8_scores_used(q, pool) -> bool:
    """Whether the whole-page INT2 kernel would score these pools with int8 MMAs (`_int2_chunk_t` KI8)."""
    return triton_int2.chunk_constexprs(q, pool[0], 64, True, True, pool[4], pool[5])["KI8"]


@pytest.mark.parametrize("splits,d,group", [(1, 64, 4), (3, 64, 4), (2, 128, 8), (2, 128, 1)])
def test_int2_whole_pages_loop_matches_the_reference(splits, d, group, monkeypatch):
    """`whole_pages=True` (PagedKVCache's promise: every history is whole pages) runs impl 6's tile loop without any
    mask, each 64-token tile in four 16-token pieces (`_tile_pieces`); over whole-page histories of mixed lengths,
    with NaN scales in unused pages of the pool and the second block of page ids reached, it must equal the
    reference and the masked loop (one [64]-token tile at a time). d = 64 pads the code words (U = 8 < 16).
    With the fp16 score MMAs (K_INT8_SCORES off) the two loops are the same arithmetic in another order; the int8
    scores (the default at d = 128) have a test of their own below. One split over 4480 tokens (70 pages) reaches
    the second block of 64 page ids in one program; the split runs take a shorter history (under the interpreter
    every token costs)."""
    lens = [64, 4480 if splits == 1 else 1280, 0, 640]
    kc, ks, kz, vc, vs, vz, table, hist = make_pool(lens, h_kv=2, d=d, page=64, seed=47, extra_pages=4)
    used = set(table[i, j].item() for i, n in enumerate(lens) for j in range(n // 64))
    for p in set(range(kc.shape[0])) - used:
        for t in (ks, vs, kz, vz):
            t[p] = float("nan")
    q = make_q(len(lens), 2 * group, d, torch.bfloat16)
    pool = (kc, ks, kz, vc, vs, vz, table, hist)
    monkeypatch.setattr(triton_int2, "K_INT8_SCORES", False)  # int8 scores: test_int8_scores_equal_the_reference...
    o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=splits, impl=6, whole_pages=True)
    o_m, lse_m = A.int2_decode_attention(q, *pool, backend="triton", num_splits=splits, impl=6)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert torch.isfinite(o).all()
    assert rel_rmse(o, o_ref) < 1e-3
    assert_lse_close(lse, lse_ref, 2e-4)
    # Same arithmetic in another summation order (pieces of 16 tokens): equal to fp32 rounding.
    torch.testing.assert_close(o, o_m, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse, lse_m, rtol=0, atol=2e-6)


@pytest.mark.parametrize("d,group,splits", [(128, 4, 2), (128, 8, 1), (128, 1, 3), (256, 4, 2)])
def test_int8_scores_equal_the_reference_of_their_query(d, group, splits):
    """K_INT8_SCORES (the whole-page default at head_dim 128 and 256): codes as int8 against the query's int8 hi/lo
    pair per channel. Against the float reference on the query those pairs encode (`paged_ref.hilo_query_ref`) the
    kernel must agree to fp32 rounding, like the fp16 path does on q itself; and against q itself within the hi/lo
    error (far below q's bf16 rounding). One head's query is all zeros (its scale falls back to 1), one sequence is
    empty, and the pool's unused pages hold NaN scales and zeros."""
    lens = [64, 576, 0, 192]
    pool = make_pool(lens, h_kv=2, d=d, page=64, seed=51, extra_pages=2)
    used = set(pool[6][i, j].item() for i, n in enumerate(lens) for j in range(n // 64))
    for p in set(range(pool[0].shape[0])) - used:
        for t in (pool[1], pool[2], pool[4], pool[5]):
            t[p] = float("nan")
    q = make_q(len(lens), 2 * group, d, torch.bfloat16, seed=7)
    q[1, 0] = 0.0
    assert triton_int2.K_INT8_SCORES and _int8_scores_used(q, pool)
    o, lse = A.int2_decode_attention(q, *pool, backend="triton", num_splits=splits, impl=6, whole_pages=True)
    o8_ref, lse8_ref = paged_ref.int2_decode_attention_ref(paged_ref.hilo_query_ref(q), *pool)
    assert torch.isfinite(o).all()
    assert rel_rmse(o, o8_ref) < 2e-4
    assert_lse_close(lse, lse8_ref, 2e-5)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < 2e-3
    assert_lse_close(lse, lse_ref, 2e-3)


def test_int8_scores_apply_only_where_the_code_rows_fit():
    """The int8 score MMAs take 32 code bytes per quarter-channel block (m16n8k32): head_dim 128 and 256 use them,
    head_dim 64 (16 bytes) keeps the fp16 MMAs, and so do the masked loop and two-page tiles (not whole 64-token
    pieces)."""
    for d, want in ((64, False), (128, True), (256, True)):
        pool = make_pool([128], h_kv=1, d=d, page=64, seed=3)
        assert _int8_scores_used(make_q(1, 4, d, torch.bfloat16), pool) is want
    pool = make_pool([128], h_kv=1, d=128, page=64, seed=3)
    q = make_q(1, 4, 128, torch.bfloat16)
    assert not triton_int2.chunk_constexprs(q, pool[0], 64, True, False, pool[4], pool[5])["KI8"]  # masked
    assert not triton_int2.pair_constexprs(q, pool[0], 64)["KI8"]


def test_hilo_query_ref_is_within_its_bound():
    """`hilo_query_ref`: q~ is within max|q| / (127 * 508) of q per head
    (plus fp32 rounding); an all-zero head stays zero."""
    q = make_q(3, 5, 128, torch.float32, seed=9) * torch.tensor([1e-3, 1.0, 40.0])[:, None, None]
    q[2, 4] = 0.0
    q8 = paged_ref.hilo_query_ref(q)
    amax = q.abs().amax(-1, keepdim=True)
    bound = amax / (127 * 508) * (1 + 1e-5) + amax * 2e-7
    assert ((q8 - q).abs() <= bound).all()
    assert (q8[2, 4] == 0).all()
    assert ((q8 - q).abs() > amax / (127 * 508) / 8).any()  # a real quantization, not the identity


def _run_ptx5(text: str, word: int) -> list[int]:
    """Emulator for impl 5's and impl 6's inline-PTX blocks (mov/shr/and/lop3/sub.f16x2 on b32): `$8` = input,
    returns `$0 .. $7`."""
    import numpy as np

    regs = {"$8": word}

    def val(x):
        return regs[x] if x in regs else int(x, 0)

    def f16x2(x):
        return np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)

    for ins in [i.strip() for i in text.strip("{} ").split(";") if i.strip()]:
        if ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> val(a[2])
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "lop3.b32":
            lut = val(a[4])
            x, y, z = val(a[1]), val(a[2]), val(a[3])
            regs[a[0]] = sum(((lut >> (((x >> i) & 1) << 2 | ((y >> i) & 1) << 1 | ((z >> i) & 1))) & 1) << i
                             for i in range(32))
        elif op == "sub.f16x2":
            h = (f16x2(val(a[1])) - f16x2(val(a[2]))).astype(np.float16).view(np.uint16).astype(np.int64)
            regs[a[0]] = int(h[0]) | (int(h[1]) << 16)
        else:
            raise AssertionError(f"unexpected PTX instruction {op!r}")
    return [regs[f"${i}"] for i in range(8)]


@pytest.mark.parametrize("sub", [0, 1, 2])
def test_inline_ptx_impl5_block_gives_scaled_codes(sub):
    """impl 5's inline-PTX block, run by the emulator above on random words (two int16 elements each): output p holds,
    in each half, 1024 + M_p * (code p of that element) with code p = bits 2(p % 4) of byte p // 4 and
    M = 1, 4, 16, 64, 256, 16, 64, 256 (minus 1024 at the subtracted positions: all, or 0 and 1)."""
    import numpy as np

    from runtime_kernels.attention import triton_int2 as T

    text = T._ASM5_HEAD.value + T._ASM5_BODY.value + {0: "", 1: T._ASM5_SUB01.value, 2: T._ASM5_SUB.value}[sub]
    text += T._ASM_TAIL.value
    gen = torch.Generator().manual_seed(6)
    words = torch.randint(0, 2**32, (64,), generator=gen, dtype=torch.int64).tolist() + [0, 0xFFFFFFFF]
    for w in words:
        outs = _run_ptx5(text, w)
        for pos, r in enumerate(outs):
            got = [float(np.array([hb], dtype=np.uint16).view(np.float16)[0]) for hb in (r & 0xFFFF, r >> 16)]
            offset = 0.0 if sub == 2 or (sub == 1 and pos < 2) else 1024.0
            want = [offset + T._M5[pos] * ((((w >> (16 * e)) & 0xFFFF) >> (8 * (pos // 4) + 2 * (pos % 4))) & 3)
                    for e in range(2)]
            assert got == want, (hex(w), pos, got, want)


def test_inline_ptx_impl6_block_gives_subnormal_codes():
    """impl 6's inline-PTX block on random words: output p holds, in each half, the fp16 subnormal
    M_p * (code p of that element) * 2^-24, exactly (read back as float64)."""
    import numpy as np

    from runtime_kernels.attention import triton_int2 as T

    gen = torch.Generator().manual_seed(7)
    words = torch.randint(0, 2**32, (64,), generator=gen, dtype=torch.int64).tolist() + [0, 0xFFFFFFFF]
    for w in words:
        for pos, r in enumerate(_run_ptx5(T._ASM6_BODY.value, w)):
            got = [float(np.array([hb], dtype=np.uint16).view(np.float16)[0]) for hb in (r & 0xFFFF, r >> 16)]
            want = [T._M5[pos] * ((((w >> (16 * e)) & 0xFFFF) >> (8 * (pos // 4) + 2 * (pos % 4))) & 3) * 2.0**-24
                    for e in range(2)]
            assert got == want, (hex(w), pos, got, want)


def _run_ptx(text: str, word: int) -> tuple[int, int]:
    """Tiny emulator for the few PTX instructions of the INT2 kernel's inline-asm blocks (mov/shr/and/prmt on b32,
    fma.rn.bf16x2, sub.f16x2), so the block text itself is checked without a GPU. `$2` = input, returns `$0, $1`."""
    import re

    import numpy as np

    regs = {"$2": word}

    def val(x):
        return regs[x] if x in regs else int(x, 0)

    def halves(x, dt):
        return np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(dt).astype(np.float64) if dt == np.float16 \
            else np.array([(x & 0xFFFF) << 16, (x >> 16) << 16], dtype=np.uint32).view(np.float32).astype(np.float64)

    def pack(v, dt):
        if dt == np.float16:
            h = v.astype(np.float16).view(np.uint16).astype(np.int64)
        else:  # round to nearest even bf16 (the values here are exact)
            f = v.astype(np.float32).view(np.uint32).astype(np.int64)
            h = (f + 0x7FFF + ((f >> 16) & 1)) >> 16
        return int(h[0]) | (int(h[1]) << 16)

    for ins in [i.strip() for i in text.strip("{} ").split(";") if i.strip()]:
        if ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> val(a[2])
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "prmt.b32":
            src = val(a[1]) | (val(a[2]) << 32)
            sel = val(a[3])
            regs[a[0]] = sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "fma.rn.bf16x2":
            regs[a[0]] = pack(halves(val(a[1]), "bf16") * halves(val(a[2]), "bf16") + halves(val(a[3]), "bf16"),
                              "bf16")
        elif op == "sub.f16x2":
            regs[a[0]] = pack(halves(val(a[1]), np.float16) - halves(val(a[2]), np.float16), np.float16)
        else:
            raise AssertionError(f"unexpected PTX instruction {op!r}")
        assert re.fullmatch(r"\$[01]|t|m|one|off", a[0])
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("sub", [False, True])
def test_inline_ptx_blocks_give_offset_plus_code(half, sub):
    """Every inline-PTX block of impl 4 (4 shifts x bf16/fp16 x folded/exact), run by the emulator above on random
    packed words, equals the reference codes (b >> shift) & 3 (+ the magic offset when not subtracted), element i
    from byte i, as two half2 registers (elements 0, 1 and 2, 3, low half first)."""
    import numpy as np

    from runtime_kernels.attention import triton_int2 as T

    body = {"bf16": T._ASM_BF16, "fp16": T._ASM_FP16}[half].value
    if sub:
        body += {"bf16": T._ASM_SUB_BF16, "fp16": T._ASM_SUB_FP16}[half].value
    offset = 0.0 if sub else {"bf16": 128.0, "fp16": 1024.0}[half]
    gen = torch.Generator().manual_seed(5)
    words = torch.randint(0, 2**32, (64,), generator=gen, dtype=torch.int64).tolist() + [0, 0xFFFFFFFF]
    for shift, shr in zip((0, 2, 4, 6), (T._ASM_SHR0, T._ASM_SHR2, T._ASM_SHR4, T._ASM_SHR6)):
        text = T._ASM_HEAD.value + shr.value + body + T._ASM_TAIL.value
        for w in words:
            r0, r1 = _run_ptx(text, w)
            got = []
            for r in (r0, r1):
                for hbits in (r & 0xFFFF, r >> 16):
                    if half == "fp16":
                        got.append(float(np.array([hbits], dtype=np.uint16).view(np.float16)[0]))
                    else:
                        got.append(float(np.array([hbits << 16], dtype=np.uint32).view(np.float32)[0]))
            want = [offset + ((w >> (8 * i + shift)) & 3) for i in range(4)]
            assert got == want, (hex(w), shift, got, want)


def test_int2_split_count_does_not_change_the_result():
    pool = make_pool([300], h_kv=1, d=64, page=16, seed=9)
    q = make_q(1, 4, 64, torch.float32)
    outs = [A.int2_decode_attention(q, *pool, backend="triton", num_splits=s) for s in (1, 5, 40)]
    for o, lse in outs[1:]:
        assert rel_rmse(o, outs[0][0]) < 1e-5
        assert torch.allclose(lse, outs[0][1], atol=1e-4)


def test_int2_reference_matches_dense_attention_on_dequantized_history():
    """paged_ref against a direct computation: dequantize every page in order, then plain softmax attention."""
    pool = make_pool([70], h_kv=1, d=64, page=16, seed=12)
    kc, ks, kz, vc, vs, vz, table, lens = pool
    q = make_q(1, 2, 64, torch.float32)
    ids = table[0, :5].long()
    k = qnaive.unpack_dequantize(kc[ids], ks[ids], kz[ids]).transpose(0, 1).reshape(1, -1, 64)[:, :70]
    v = qnaive.unpack_dequantize(vc[ids], vs[ids], vz[ids]).transpose(0, 1).reshape(1, -1, 64)[:, :70]
    scores = q[0] @ k[0].T / math.sqrt(64)
    want = torch.softmax(scores, dim=-1) @ v[0]
    o, lse = paged_ref.int2_decode_attention_ref(q, *pool)
    assert torch.allclose(o[0], want, atol=1e-5)
    assert torch.allclose(lse[0], torch.logsumexp(scores, dim=-1), atol=1e-5)


# -------------------------------------------------------------------------------------------- window
def make_window(n_slots, h_kv, w, d, dtype, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n_slots, h_kv, w, d, generator=gen).to(dtype),
            torch.randn(n_slots, h_kv, w, d, generator=gen).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_window_attention(dtype, group):
    k_win, v_win = make_window(5, 2, 80, 64, dtype)
    slot_ids = torch.tensor([3, 0, 4, 1], dtype=torch.int32)
    win_len = torch.tensor([80, 0, 1, 63], dtype=torch.int32)
    q = make_q(4, 2 * group, 64, dtype)
    o, lse = A.window_attention(q, k_win, v_win, slot_ids, win_len, backend="triton", num_splits=2)
    o_ref, lse_ref = paged_ref.window_attention_ref(q, k_win, v_win, slot_ids, win_len)
    assert rel_rmse(o, o_ref) < TOL[dtype]
    assert_lse_close(lse, lse_ref, 1e-3)


@pytest.mark.parametrize("d", [128, 256])
def test_window_head_dims(d):
    k_win, v_win = make_window(2, 1, 20, d, torch.float32)
    q = make_q(2, 4, d, torch.float32)
    args = (q, k_win, v_win, torch.tensor([1, 0]), torch.tensor([20, 7]))
    o, lse = A.window_attention(*args, backend="triton")
    o_ref, lse_ref = paged_ref.window_attention_ref(*args)
    assert rel_rmse(o, o_ref) < 1e-5
    assert_lse_close(lse, lse_ref, 1e-4)


# --------------------------------------------------------------------------------------------- merge
def test_merge_equals_one_softmax_over_the_concatenation():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 8, 32, generator=gen)
    k = torch.randn(3, 2, 50, 32, generator=gen) * 2
    v = torch.randn(3, 2, 50, 32, generator=gen)
    o_all, lse_all = attn_naive.segment_attention(q, k, v)
    cuts = [0, 1, 17, 40, 50]  # four disjoint segments, one of them a single key
    parts = [attn_naive.segment_attention(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
    o, lse = parts[0]
    for o_s, lse_s in parts[1:]:
        o, lse = A.merge_attention(o, lse, o_s, lse_s)
    assert torch.allclose(o, o_all, atol=1e-6) and torch.allclose(lse, lse_all, atol=1e-5)
    # The Triton split reduce gives the same union in one pass.
    o_part = torch.stack([p[0] for p in parts], dim=2).contiguous()
    lse_part = torch.stack([p[1] for p in parts], dim=2).contiguous()
    o_t, lse_t = M.reduce_splits_triton(o_part, lse_part)
    assert torch.allclose(o_t, o_all, atol=1e-6) and torch.allclose(lse_t, lse_all, atol=1e-5)
    o_r, lse_r = M.reduce_splits_torch(o_part, lse_part)
    assert torch.allclose(o_r, o_all, atol=1e-6) and torch.allclose(lse_r, lse_all, atol=1e-5)


def test_merge_with_empty_segments():
    o = torch.randn(2, 4, 16)
    lse = torch.randn(2, 4)
    empty_o, empty_lse = torch.zeros(2, 4, 16), torch.full((2, 4), float("-inf"))
    m_o, m_lse = A.merge_attention(o, lse, empty_o, empty_lse)
    assert torch.allclose(m_o, o) and torch.allclose(m_lse, lse)
    m_o, m_lse = A.merge_attention(empty_o, empty_lse, empty_o, empty_lse)
    assert (m_o == 0).all() and torch.isneginf(m_lse).all()
    parts = torch.stack([empty_o, empty_o], dim=2).contiguous(), torch.stack([empty_lse, empty_lse], dim=2).contiguous()
    t_o, t_lse = M.reduce_splits_triton(*parts)
    assert (t_o == 0).all() and torch.isneginf(t_lse).all()


@pytest.mark.parametrize("splits,d", [(1, 64), (43, 128), (70, 128), (203, 256), (5, 48)])
def test_split_reduce_in_channel_blocks_matches_the_torch_merge(splits, d):
    """The Triton reduce runs one program per (row, 32-channel block): many splits (more than one 64-split round,
    as at 128K / batch 1), head dims that are 1, 4, 8 and a partial block of channel blocks, and rows whose
    partials are all empty or partly empty, against the torch merge."""
    gen = torch.Generator().manual_seed(splits + d)
    o_part = torch.randn(2, 3, splits, d, generator=gen)
    lse_part = torch.randn(2, 3, splits, generator=gen) * 4
    lse_part[0, 1] = float("-inf")  # an empty row: o = 0, lse = -inf
    lse_part[1, 2, ::2] = float("-inf")  # every other partial of a row empty
    o_t, lse_t = M.reduce_splits_triton(o_part, lse_part)
    o_r, lse_r = M.reduce_splits_torch(o_part, lse_part)
    assert torch.equal(torch.isneginf(lse_t), torch.isneginf(lse_r)) and torch.isneginf(lse_t[0, 1])
    fin = torch.isfinite(lse_r)
    assert torch.allclose(lse_t[fin], lse_r[fin], atol=1e-5)
    assert torch.allclose(o_t, o_r, atol=1e-5) and (o_t[0, 1] == 0).all()


# ----------------------------------------------------------------------------------- full decode call
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_history_plus_window(dtype):
    lens = [0, 70, 5]
    pool = make_pool(lens, h_kv=2, d=64, page=16, seed=21)
    k_win, v_win = make_window(4, 2, 40, 64, dtype, seed=5)
    slot_ids = torch.tensor([2, 0, 3], dtype=torch.int32)
    win_len = torch.tensor([12, 40, 0], dtype=torch.int32)
    q = make_q(3, 8, 64, dtype)
    o, lse = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="triton",
                                num_splits=3, window_splits=2)
    # Independent reference: one softmax over [dequantized history ++ window] for each sequence.
    for b in range(3):
        k_h = paged_ref.gather_history(pool[0], pool[1], pool[2], pool[6][b], lens[b])
        v_h = paged_ref.gather_history(pool[3], pool[4], pool[5], pool[6][b], lens[b])
        n_w = int(win_len[b])
        k = torch.cat([k_h, k_win[slot_ids[b], :, :n_w].float()], dim=1)
        v = torch.cat([v_h, v_win[slot_ids[b], :, :n_w].float()], dim=1)
        o_ref, lse_ref = attn_naive.segment_attention(q[b:b + 1], k[None], v[None])
        assert rel_rmse(o[b:b + 1], o_ref) < TOL[dtype]
        assert torch.allclose(lse[b], lse_ref[0], atol=1e-3)
    o_t, lse_t = A.decode_attention(q, *pool, k_win, v_win, slot_ids, win_len, backend="torch")
    assert rel_rmse(o, o_t) < TOL[dtype]


def test_rotate_queries_and_unrotate_output():
    gen = torch.Generator().manual_seed(2)
    rk = torch.linalg.qr(torch.randn(2, 32, 32, generator=gen))[0]
    q = torch.randn(3, 8, 32, generator=gen)
    want = torch.stack([q[:, i] @ rk[i // 4] for i in range(8)], dim=1)
    assert torch.allclose(A.rotate_queries(q, rk), want, atol=1e-5)
    assert torch.allclose(A.unrotate_output(want, rk), q, atol=1e-5)
    # q . k is unchanged when both sides use R_K.
    k = torch.randn(32, generator=gen)
    assert torch.allclose(A.rotate_queries(q, rk)[:, :4] @ (k @ rk[0]), q[:, :4] @ k, atol=1e-4)


def test_programs_per_sm_limit_matches_the_occupancy_ncu_reported():
    """Nsight Compute on the H200: impl 6 (167 registers, 12032 B shared, 1 warp) -> 12 blocks per SM (registers and
    shared memory both bind); impl 5 (127 registers, 7172 B) -> 16. Registers per warp come from one of 4
    sub-partitions (CUDA's occupancy calculator): 136-168 registers all give 12 one-warp blocks, 200 give 8. The
    32-block limit and the thread limit bind for tiny kernels."""
    from runtime_kernels.attention import triton_int2

    assert triton_int2.programs_per_sm_limit(167, 12032, 1) == 12
    assert triton_int2.programs_per_sm_limit(127, 7172, 1) == 16
    for regs, blocks in ((128, 16), (136, 12), (144, 12), (152, 12), (168, 12), (170, 8), (200, 8), (255, 8)):
        assert triton_int2.programs_per_sm_limit(regs, 0, 1) == blocks, regs
    assert triton_int2.programs_per_sm_limit(144, 0, 4) == 3  # 12 warps of 144 registers, 4 per block
    assert triton_int2.programs_per_sm_limit(32, 0, 1) == 32
    assert triton_int2.programs_per_sm_limit(32, 0, 8) == 8  # 2048 threads / 256
    assert triton_int2.programs_per_sm_limit(64, 100_000, 1) == 2  # shared memory binds


def test_int2_splits_fill_whole_waves(monkeypatch):
    """With the occupancy known, the split count is the largest that keeps every program in one wave:
    floor(waves * slots * SMs / (B * H_kv)), capped by MIN_SPLIT_TOKENS chunks; without it, the fixed rule."""
    from runtime_kernels.attention import triton_int2

    pool = make_pool([4000, 100], h_kv=2, d=64, page=64, seed=3)
    q = make_q(2, 4, 64, torch.bfloat16)
    fixed = A.int2_num_splits(q, *pool, A.BLOCK_N, 1, 3, 6)
    assert fixed == A.default_num_splits(2, 2, pool[6].shape[1] * 64, q.device,
                                         programs_per_sm=A.INT2_PROGRAMS_PER_SM)
    monkeypatch.setattr(triton_int2, "resident_programs_per_sm", lambda *a, **k: 3)
    monkeypatch.setattr(A, "_sm_count", lambda device: 5)
    assert A.int2_num_splits(q, *pool, A.BLOCK_N, 1, 3, 6) == (3 * 5) // (2 * 2)  # 3 (<= 16 chunks of 256)
    monkeypatch.setattr(A, "INT2_WAVES", 2)
    assert A.int2_num_splits(q, *pool, A.BLOCK_N, 1, 3, 6) == (2 * 3 * 5) // (2 * 2)
    monkeypatch.setattr(A, "_sm_count", lambda device: 1000)
    assert A.int2_num_splits(q, *pool, A.BLOCK_N, 1, 3, 6) == -(-pool[6].shape[1] * 64 // A.MIN_SPLIT_TOKENS)
    launched = []
    real_launch = triton_int2.launch_int2_decode
    monkeypatch.setattr(triton_int2, "launch_int2_decode",
                        lambda *a, **k: launched.append(a[12]) or real_launch(*a, **k))
    o, lse = A.int2_decode_attention(q, *pool, backend="triton", impl=6)  # the launch uses that split count
    assert launched == [-(-pool[6].shape[1] * 64 // A.MIN_SPLIT_TOKENS)]
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool)
    assert rel_rmse(o, o_ref) < 1e-3


def test_occupancy_is_compiled_once_per_kernel_configuration(monkeypatch):
    """The split rules of the INT2 and the fused kernels share one cache of resident programs per SM: a configuration
    is compiled once, and whatever selects another compiled kernel (here the whole-pages promise) gets its own
    entry."""
    from runtime_kernels.attention import triton_int2

    monkeypatch.setattr(triton_int2, "_SLOTS", {})
    monkeypatch.setattr(triton_int2, "_slots_of", lambda kernel, num_warps, device: kernel)
    compiled = []

    def compile_only(slots):
        return lambda: compiled.append(slots) or slots

    pool = make_pool([300, 64], h_kv=2, d=64, page=64)
    q = make_q(2, 8, 64, torch.bfloat16)
    kc, ks, kz, vc, vs, vz, table, lens = pool
    masked = triton_int2.chunk_key(q, kc, ks, vc, vs, table, lens, 64, 1, 3, 6, False)
    whole = triton_int2.chunk_key(q, kc, ks, vc, vs, table, lens, 64, 1, 3, 6, True)
    assert masked != whole
    # The pool strides are compile-time constants: pools of another layout (here 2 more pages' worth of slack per
    # KV head, as a strided view) compile their own kernel; pools that differ only in page count do not.
    wide = torch.zeros(kc.shape[0], kc.shape[1], kc.shape[2] + 2, kc.shape[3], dtype=kc.dtype)[:, :, :kc.shape[2]]
    assert triton_int2.chunk_key(q, wide, ks, vc, vs, table, lens, 64, 1, 3, 6, False) != masked
    more_pages = torch.zeros(kc.shape[0] + 5, *kc.shape[1:], dtype=kc.dtype)
    more_scales = torch.zeros(ks.shape[0] + 5, *ks.shape[1:], dtype=ks.dtype)
    assert triton_int2.chunk_key(q, more_pages, more_scales, torch.zeros_like(more_pages), more_scales, table, lens,
                                 64, 1, 3, 6, False) == masked
    assert triton_int2.cached_slots(masked, compile_only(12), 1, q.device) == 12
    assert triton_int2.cached_slots(masked, compile_only(99), 1, q.device) == 12  # cached, not compiled again
    assert triton_int2.cached_slots(whole, compile_only(13), 1, q.device) == 13
    assert compiled == [12, 13]


def test_default_num_splits_is_bounded():
    assert A.default_num_splits(1, 8, 64, torch.device("cpu")) == 1  # one tile: one split
    assert 1 <= A.default_num_splits(32, 8, 131072, torch.device("cpu")) <= 2048


# ------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_name_the_tensor():
    pool = list(make_pool([10], h_kv=2, d=64, page=16))
    q = make_q(1, 8, 64, torch.float32)
    kc, ks, kz, vc, vs, vz, table, lens = pool
    with pytest.raises(TypeError, match="q: dtype"):
        A.int2_decode_attention(q.to(torch.int32), *pool)
    with pytest.raises(ValueError, match="q: head_dim must be a multiple of 4"):
        A.int2_decode_attention(torch.randn(1, 8, 66), *pool)
    with pytest.raises(TypeError, match="k_codes: dtype must be uint8"):
        A.int2_decode_attention(q, kc.to(torch.int16), *pool[1:])
    with pytest.raises(ValueError, match="v_codes: .*head_dim // 4"):
        A.int2_decode_attention(q, kc, ks, kz, vc[..., :8], vs, vz, table, lens)
    with pytest.raises(TypeError, match="k_scale: dtype must be float16"):
        A.int2_decode_attention(q, kc, ks.float(), kz, vc, vs, vz, table, lens)
    with pytest.raises(ValueError, match="q: 5 query heads is not a multiple"):
        A.int2_decode_attention(make_q(1, 5, 64, torch.float32), *pool)
    with pytest.raises(ValueError, match="block_table: .*batch size of q"):
        A.int2_decode_attention(q, kc, ks, kz, vc, vs, vz, table.expand(2, -1), lens)
    with pytest.raises(ValueError, match="hist_len: expected device"):
        A.int2_decode_attention(q, kc, ks, kz, vc, vs, vz, table, lens.to("meta"))
    k_win, v_win = make_window(2, 2, 8, 64, torch.float32)
    with pytest.raises(ValueError, match="k_win: .*head_dim of q"):
        A.window_attention(q, k_win[..., :32], v_win, torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(TypeError, match="win_len: dtype"):
        A.window_attention(q, k_win, v_win, torch.tensor([0]), torch.tensor([3.0]))
    with pytest.raises(ValueError, match="lse_b: expected shape"):
        A.merge_attention(torch.zeros(2, 4), torch.zeros(2), torch.zeros(2, 4), torch.zeros(3))
