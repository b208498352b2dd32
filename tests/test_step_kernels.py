"""The decode-step kernels (runtime_kernels.step_kernels) against their torch references, and PagedKVCache using them.

- `append_rows`: bitwise equal to `rotate_rows` + cast + index write (the window rows a token gets must not depend on
  the path it took), nothing else in the windows changes; the hand-made bf16 rounding equals torch's `.to`.
- `rotate_heads`: fp32 products and accumulation in another order than torch's GEMM, so it is compared with the
  fp64 product under the a-priori bound of an fp32 dot product, `|err| <= d * u * (|x| @ |R|)` (u = 2^-24, d = 64
  or 128). Measured under the interpreter: worst err / (u * (|x| @ |R|)) = 5.8 over these cases, the same as torch's
  GEMM (numpy's fp32 matmul gave torch's bits there); a GPU sums in another order, within the same bound. TF32
  products (err ~ 2^-11 relative) or bf16 inputs would exceed it by orders of magnitude.
- `PagedKVCache` on the Triton backend (interpreter on CPU): the same pools as the torch backend, step by step, over
  decode steps that take the one-launch path and one demotion step that must not; the same outputs within fp32
  rounding.
"""

from __future__ import annotations

import pytest
import torch
from format_helpers import PAPER, served
from kernel_helpers import rel_rmse

from runtime_kernels import attention as attn_api
from runtime_kernels import step_kernels as sk
from runtime_kernels.artifact import identity_artifact
from runtime_kernels.attention.int2_decode import merge
from runtime_kernels.cache import PagedKVCache, rotate_rows

pytestmark = pytest.mark.interpreter
DEV = "cpu"
U32 = 2.0 ** -24  # unit roundoff of fp32


def orthogonal(h, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))
    return q.float().contiguous()


def random_windows(slots, h, w, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, h, w, d, generator=gen).to(dtype), torch.randn(slots, h, w, d, generator=gen).to(dtype))


def reference_append(keys, values, rk, rv, src, slots, rows, k_win, v_win, rotate=True):
    """The torch path of `PagedKVCache.write_layer` for an append-only plan, on copies of the windows."""
    k_ref, v_ref = k_win.clone(), v_win.clone()
    k_rot = rotate_rows(keys, rk) if rotate else keys
    v_rot = rotate_rows(values, rv) if rotate else values
    k_ref[slots, :, rows] = k_rot.to(k_ref.dtype)[src]
    v_ref[slots, :, rows] = v_rot.to(v_ref.dtype)[src]
    return k_ref, v_ref


# ------------------------------------------------------------------------------------------------ append_rows
@pytest.mark.parametrize("n,h,d", [(1, 8, 128), (5, 2, 64), (3, 4, 128), (2, 3, 80)])  # 80: a partial column block
@pytest.mark.parametrize("win_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_append_rows_is_rotate_rows_cast_and_index_write_bit_for_bit(n, h, d, win_dtype, in_dtype):
    gen = torch.Generator().manual_seed(n * 100 + d)
    slots_n, w = 6, 9
    # keys as a strided view of a fused [N, 3, H, d] projection (the way a model hands them over)
    fused = (torch.randn(n, 3, h, d, generator=gen) * 4).to(in_dtype)
    keys, values = fused[:, 1], fused[:, 2]
    rk, rv = orthogonal(h, d, 1), orthogonal(h, d, 2)
    perm = torch.randperm(slots_n * w, generator=gen)[:n]
    slots, rows = perm // w, perm % w  # distinct (slot, row) pairs, in random order
    src = torch.randperm(n, generator=gen)
    k_win, v_win = random_windows(slots_n, h, w, d, win_dtype, seed=n)
    k_ref, v_ref = reference_append(keys, values, rk, rv, src, slots, rows, k_win, v_win)
    sk.append_rows(keys, values, rk, rv, src, slots, rows, k_win, v_win)
    assert torch.equal(k_win.view(torch.int16), k_ref.view(torch.int16))  # bits, and every other row untouched
    assert torch.equal(v_win.view(torch.int16), v_ref.view(torch.int16))
    assert not torch.equal(k_win, random_windows(slots_n, h, w, d, win_dtype, seed=n)[0])  # it did write


@pytest.mark.parametrize("win_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy cast to fp16 -> inf
def test_append_rows_without_rotation_casts_like_torch_including_ties_and_specials(win_dtype):
    """rotate=False stores given fp32 rows: ties to even, carries into the exponent, overflow to inf, subnormals,
    signed zeros as torch's `.to(dtype)` (the bf16 path rounds by hand), NaN as a NaN."""
    d, h = 64, 2
    one = 1.0
    special = torch.tensor([one + 2 ** -8, one + 3 * 2 ** -8, one + 2 ** -9, 1.9999999, -(one + 2 ** -8),
                            3.3961e38, -3.39e38, 65519.0, 65520.0, 1e-40, -1e-40, 6e-8, 0.0, -0.0,
                            float("inf"), float("-inf"), float("nan"), 2 ** -133, 255.99998, -255.99998],
                           dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    rows_ = torch.randn(3, h, d, generator=gen) * torch.logspace(-30, 30, d)
    rows_[0, 0, :special.numel()] = special
    rows_[2, 1, -special.numel():] = special
    slots, rows, src = torch.tensor([0, 2, 1]), torch.tensor([4, 0, 7]), torch.tensor([1, 2, 0])
    k_win, v_win = random_windows(3, h, 8, d, win_dtype, seed=5)
    k_ref, v_ref = reference_append(rows_, -rows_, None, None, src, slots, rows, k_win, v_win, rotate=False)
    sk.append_rows(rows_, -rows_, orthogonal(h, d, 0), orthogonal(h, d, 0), src, slots, rows, k_win, v_win,
                   rotate=False)
    for got, want in ((k_win, k_ref), (v_win, v_ref)):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)  # a NaN stays a NaN; its payload bits differ between torch's own paths
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_append_rows_with_no_rows_writes_nothing():
    k_win, v_win = random_windows(2, 2, 4, 64, torch.bfloat16, seed=0)
    before = k_win.clone()
    e = torch.empty(0, dtype=torch.int64)
    x = torch.empty(0, 2, 64)
    sk.append_rows(x, x, orthogonal(2, 64, 0), orthogonal(2, 64, 1), e, e, e, k_win, v_win)
    assert torch.equal(k_win, before)


def test_append_rows_refuses_bad_inputs_naming_them():
    h, d = 2, 64
    k_win, v_win = random_windows(2, h, 4, d, torch.bfloat16, seed=0)
    r = orthogonal(h, d, 0)
    x = torch.randn(2, h, d)
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"keys: expected shape \[N, H=2, d=64\]"):
        sk.append_rows(torch.randn(2, 3, d), x, r, r, idx, idx, idx, k_win, v_win)
    with pytest.raises(ValueError, match=r"v_rotation: expected shape \[H, d, d\]"):
        sk.append_rows(x, x, r, r[:1], idx, idx, idx, k_win, v_win)
    with pytest.raises(ValueError, match="win_rows: expected 2 entries"):
        sk.append_rows(x, x, r, r, idx, idx, idx[:1], k_win, v_win)
    with pytest.raises(TypeError, match="values: dtype must be float32"):
        sk.append_rows(x, x.bfloat16(), r, r, idx, idx, idx, k_win, v_win, rotate=False)
    with pytest.raises(ValueError, match="v_win: shape"):
        sk.append_rows(x, x, r, r, idx, idx, idx, k_win, v_win[:1])


# ------------------------------------------------------------------------------------------------ rotate_heads
def bound(x, rot_t):
    """d * u * (|x| @ |M|) per output element: the a-priori error bound of an fp32 dot product of length d."""
    d = x.shape[-1]
    return d * U32 * torch.einsum("bhd,bhde->bhe", x.double().abs(), rot_t.double().abs())


def per_head(rotation, h_q, transpose):
    """`[H_kv, d, d]` -> the matrix each query head multiplies by, `[H_q, d, d]`."""
    m = rotation.transpose(-1, -2) if transpose else rotation
    return m.repeat_interleave(h_q // rotation.shape[0], dim=0)


@pytest.mark.parametrize("b,h_q,h_kv,d", [(1, 8, 8, 128), (3, 6, 2, 64), (5, 8, 2, 128), (2, 8, 1, 64),
                                          (7, 32, 8, 64)])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotate_heads_is_the_fp32_product_within_the_dot_product_bound(b, h_q, h_kv, d, transpose, x_dtype):
    gen = torch.Generator().manual_seed(b * 10 + h_q)
    x = (torch.randn(b, h_q + 2, d, generator=gen) * 3).to(x_dtype)[:, 1:-1]  # strided rows of a wider tensor
    rot = orthogonal(h_kv, d, h_q)
    got = sk.rotate_heads(x, rot, transpose=transpose)
    assert got.dtype == torch.float32 and got.shape == (b, h_q, d) and got.is_contiguous()
    m = per_head(rot, h_q, transpose)[None].expand(b, -1, -1, -1)
    exact = torch.einsum("bhd,bhde->bhe", x.double(), m.double())
    lim = bound(x, m)
    assert ((got.double() - exact).abs() <= lim).all()
    # and the torch path it replaces, within the two bounds together
    torch_path = (attn_api.unrotate_output(x.float(), rot) if transpose else
                  attn_api.rotate_queries(x.float(), rot))
    assert ((got.double() - torch_path.double()).abs() <= 2 * lim).all()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_rotate_heads_rounds_its_fp32_result_once_to_the_output_dtype(out_dtype):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 12, 128, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    rot = orthogonal(4, 128, 9)
    f32 = sk.rotate_heads(x, rot)
    got = sk.rotate_heads(x, rot, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    assert torch.equal(got.view(torch.int16), f32.to(out_dtype).view(torch.int16))


@pytest.mark.parametrize("b,h_q,h_kv,d,s", [(1, 8, 2, 128, 37), (2, 6, 3, 80, 5), (3, 4, 4, 64, 70),
                                             (24, 8, 2, 80, 9)])  # 192 rows: one program per row
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_split_reduce_with_the_value_rotation_is_reduce_then_unrotate(b, h_q, h_kv, d, s, out_dtype):
    """`reduce_splits_triton(..., v_rotation, out_dtype)` (the un-rotation inside the reduce, no launch of its own)
    against the fp64 merge and product: the merged row (the plain reduce's fp32 row exactly) times R_V^T within the
    fp32 dot-product bound, rounded once to out_dtype; lse as the plain reduce's. Some partials are empty (-inf) and
    one row has none at all (o = 0, lse = -inf)."""
    gen = torch.Generator().manual_seed(b * 100 + d)
    o_part = torch.randn(b, h_q, s, d, generator=gen) * 2
    lse_part = torch.randn(b, h_q, s, generator=gen) * 3
    lse_part[torch.rand(b, h_q, s, generator=gen) < 0.2] = float("-inf")
    lse_part[0, 1] = float("-inf")
    rot = orthogonal(h_kv, d, s)
    got, got_lse = merge.reduce_splits_triton(o_part, lse_part, rot, out_dtype)
    plain, plain_lse = merge.reduce_splits_triton(o_part, lse_part)
    assert got.dtype == out_dtype and got.shape == (b, h_q, d) and got_lse.dtype == torch.float32
    assert torch.equal(got_lse, plain_lse) and torch.isneginf(got_lse[0, 1])
    m = per_head(rot, h_q, True)[None].expand(b, -1, -1, -1)
    exact = torch.einsum("bhd,bhde->bhe", plain.double(), m.double())
    f32 = got.double() if out_dtype == torch.float32 else exact
    assert ((f32 - exact).abs() <= bound(plain, m)).all()
    if out_dtype != torch.float32:  # one rounding of a value within the bound: at most one unit of out_dtype apart
        ulp = (exact.abs().to(out_dtype).double() * 2.0 ** -7).clamp_min(2.0 ** -133)
        assert ((got.double() - exact).abs() <= ulp).all()
    assert (got[0, 1] == 0).all()


def test_rotate_heads_refuses_bad_inputs_naming_them():
    x = torch.randn(2, 6, 64)
    with pytest.raises(ValueError, match="x: 6 query heads is not a multiple of the 4 KV heads"):
        sk.rotate_heads(x, orthogonal(4, 64, 0))
    with pytest.raises(ValueError, match=r"rotation: expected shape \[H_kv, d, d\] with d=64"):
        sk.rotate_heads(x, orthogonal(2, 32, 0))
    with pytest.raises(TypeError, match="rotation: dtype must be float32"):
        sk.rotate_heads(x, orthogonal(2, 64, 0).double())
    with pytest.raises(TypeError, match="out_dtype: expected float16, bfloat16 or float32"):
        sk.rotate_heads(x, orthogonal(2, 64, 0), out_dtype=torch.int8)


# ------------------------------------------------------------------------------------------------ PagedKVCache
S, R, P = 4, 8, 4
H, HQ, D = 2, 8, 64


def artifact():
    art = identity_artifact(1, H, HQ, D, group_size=16, fmt=PAPER)
    art.k_rotation, art.v_rotation = orthogonal(H, D, 21)[None], orthogonal(H, D, 22)[None]
    art.k_clip_ratio = torch.full((1, H), 0.9)
    art.v_clip_ratio = torch.full((1, H), 0.95)
    return art.validate()


POOLS = ("k_win", "v_win", "k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero")


def rotations_as_before(m, real_reduce) -> None:
    """Patch (on monkeypatch `m`) the code the rotation kernels replaced: torch's q rotation, the split reduce
    without R_V, then torch's un-rotation."""
    def reduce(o_part, lse_part, v_rotation=None, out_dtype=torch.float32):
        o, lse = real_reduce(o_part, lse_part)
        return (o if v_rotation is None else attn_api.unrotate_output(o, v_rotation, out_dtype=out_dtype)), lse

    m.setattr(attn_api, "_rotation_kernels", lambda backend, device: None)
    m.setattr(merge, "reduce_splits_triton", reduce)


@pytest.mark.parametrize("check_finite", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cache_decode_steps_on_triton_match_the_torch_backend(monkeypatch, check_finite, dtype):
    """Prompts (old path), two append-only steps (one launch), a step in which sequence 1 demotes a page (old path),
    one more append-only step: the pools equal the torch backend's bit for bit after every step, the outputs agree
    within fp32 rounding, and the one-launch append ran exactly on the append-only steps (rotating itself unless
    the non-finite check had already rotated the rows)."""
    art = artifact()
    caches = {b: PagedKVCache.from_artifact(art, max_pages=8, max_seqs=3, fmt=served(art, P, S, R), dtype=dtype,
                                            backend=b, check_finite=check_finite) for b in ("torch", "triton")}
    launches, rotations, reduces = [], [], []
    real_append, real_rotate, real_reduce = sk.append_rows, sk.rotate_heads, merge.reduce_splits_triton
    monkeypatch.setattr(sk, "append_rows",
                        lambda *a, **kw: (launches.append(kw.get("rotate", True)), real_append(*a, **kw))[1])
    monkeypatch.setattr(sk, "rotate_heads",
                        lambda *a, **kw: (rotations.append(kw.get("transpose", False)), real_rotate(*a, **kw))[1])
    monkeypatch.setattr(merge, "reduce_splits_triton",
                        lambda o, lse, v_rotation=None, out_dtype=torch.float32: (
                            reduces.append(v_rotation is not None), real_reduce(o, lse, v_rotation, out_dtype))[1])
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randn(n, H, D, generator=gen).to(dtype) for n in (9, 13)]
    steps = [torch.randn(2, H, D, generator=gen).to(dtype) for _ in range(4)]
    queries = [torch.randn(2, HQ, D, generator=gen).to(dtype) for _ in range(4)]
    ids = {b: [c.add_sequence(), c.add_sequence()] for b, c in caches.items()}
    for b, c in caches.items():
        c.append(ids[b], [prompts], [prompts])
    assert launches == []  # prompts keep the batched torch rotation
    for i, (x, q) in enumerate(zip(steps, queries)):
        plans = {}
        for b, c in caches.items():
            plans[b] = c.plan_append(ids[b], [1, 1])
            c.write_layer(0, plans[b], x, x * 0.5)
        demoting = plans["triton"].demote_src.numel() > 0
        assert demoting == (i == 2) and plans["triton"].append_only == (not demoting)
        assert launches == ([not check_finite] if not demoting else [])
        launches.clear()
        for name in POOLS:
            got, want = getattr(caches["triton"].pools[0], name), getattr(caches["torch"].pools[0], name)
            assert torch.equal(got, want), (i, name)
        o = {b: c.decode_attention(0, q, ids[b]) for b, c in caches.items()}
        # q rotated by its kernel and o un-rotated inside the split reduce, on the Triton cache only
        assert rotations == [False] and reduces == [True]
        rotations.clear(), reduces.clear()
        with monkeypatch.context() as m:  # the code this replaced: torch rotations around the same Triton attention
            rotations_as_before(m, real_reduce)
            o["before"] = caches["triton"].decode_attention(0, q, ids["triton"])
        assert rotations == []
        torch.testing.assert_close(o["triton"], o["before"], atol=2e-3, rtol=0)
        # the torch backend's attention keeps p in fp32 where the Triton kernel rounds it to the window dtype
        assert rel_rmse(o["triton"], o["torch"]) < 1e-2
    assert caches["triton"].hist_len(ids["triton"][1]) == P


def one_sequence_cache(seed: int):
    """A bf16 Triton cache holding one sequence of 21 random tokens -> (cache, its id, a bf16 query `[1, HQ, D]`)."""
    art = artifact()
    cache = PagedKVCache.from_artifact(art, max_pages=8, max_seqs=2, fmt=served(art, P, S, R),
                                       dtype=torch.bfloat16, backend="triton")
    gen = torch.Generator().manual_seed(seed)
    sid = cache.add_sequence()
    x = [torch.randn(21, H, D, generator=gen)]
    cache.append([sid], [x], [x])
    return cache, sid, torch.randn(1, HQ, D, generator=gen, dtype=torch.bfloat16)


def test_cache_decode_attention_on_triton_matches_the_previous_rotations(monkeypatch):
    """decode_attention with the rotation kernels against the code it replaced (torch rotations around the same
    Triton attention): equal up to the fp32 rounding of q @ R_K, which can move a bf16 query by one unit."""
    cache, sid, q = one_sequence_cache(seed=8)
    got, lse = cache.decode_attention(0, q, [sid], return_lse=True)
    rotations_as_before(monkeypatch, merge.reduce_splits_triton)  # the rotations as before, attention unchanged
    old, old_lse = cache.decode_attention(0, q, [sid], return_lse=True)
    torch.testing.assert_close(got, old, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, old_lse, atol=2e-2, rtol=2e-2)
    assert got.dtype == torch.float32 and got.shape == (1, HQ, D)


def test_cache_decode_attention_out_dtype_and_the_one_launch_form_unrotate_the_same_output():
    """out_dtype=bf16 is the fp32 output rounded once (the reduce stores it so); the one-launch form (no separate
    reduce: un-rotated by `rotate_heads` after) gives the two-launch output within fp32 rounding."""
    cache, sid, q = one_sequence_cache(seed=9)
    f32 = cache.decode_attention(0, q, [sid])
    bf16 = cache.decode_attention(0, q, [sid], out_dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16.view(torch.int16), f32.bfloat16().view(torch.int16))
    one = cache.decode_attention(0, q, [sid], fused=True)
    torch.testing.assert_close(one, f32, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="out_dtype: expected float16, bfloat16 or float32"):
        cache.decode_attention(0, q, [sid], out_dtype=torch.int8)


@pytest.mark.parametrize("n,h,d,b,h_q", [(1, 8, 128, 1, 32), (3, 2, 64, 3, 6), (2, 3, 80, 5, 3)])
def test_append_and_query_rotation_in_one_launch_are_the_two_launches_bit_for_bit(n, h, d, b, h_q):
    """`append_rows_rotate_queries` runs the programs of `append_rows` and `rotate_heads` in one grid: the windows
    and the rotated queries are the same bits as the two calls' (and nothing else of the windows is written)."""
    gen = torch.Generator().manual_seed(n * 7 + d)
    fused = (torch.randn(n, 3, h, d, generator=gen) * 4).to(torch.bfloat16)
    keys, values = fused[:, 1], fused[:, 2]
    rk, rv = orthogonal(h, d, 3), orthogonal(h, d, 4)
    perm = torch.randperm(5 * 7, generator=gen)[:n]
    slots, rows, src = perm // 7, perm % 7, torch.randperm(n, generator=gen)
    q = (torch.randn(b, h_q + 1, d, generator=gen) * 2).to(torch.bfloat16)[:, 1:]  # strided
    one = random_windows(5, h, 7, d, torch.bfloat16, seed=n)
    two = tuple(w.clone() for w in one)
    q_one = sk.append_rows_rotate_queries(keys, values, rk, rv, src, slots, rows, *one, q)
    sk.append_rows(keys, values, rk, rv, src, slots, rows, *two)
    q_two = sk.rotate_heads(q, rk, out_dtype=torch.bfloat16)
    assert q_one.dtype == torch.bfloat16 and q_one.shape == (b, h_q, d)
    assert torch.equal(q_one.view(torch.int16), q_two.view(torch.int16))
    for got, want in zip(one, two):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("check_finite", [False, True])
def test_cache_decode_step_is_write_layer_then_decode_attention(monkeypatch, check_finite):
    """`PagedKVCache.decode_step` against `write_layer` + `decode_attention` on twin Triton caches, over
    append-only steps and one that demotes a page: pools and outputs the same bits; the one-launch append + query
    rotation ran exactly on the append-only steps with the non-finite check off; bad q is refused before anything
    is written."""
    art = artifact()
    caches = [PagedKVCache.from_artifact(art, max_pages=8, max_seqs=3, fmt=served(art, P, S, R), dtype=torch.bfloat16,
                                         backend="triton", check_finite=check_finite) for _ in range(2)]
    launches = []
    real = sk.append_rows_rotate_queries
    monkeypatch.setattr(sk, "append_rows_rotate_queries", lambda *a, **kw: (launches.append(1), real(*a, **kw))[1])
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randn(n, H, D, generator=gen).bfloat16() for n in (9, 13)]
    ids = [[c.add_sequence(), c.add_sequence()] for c in caches]
    for c, i in zip(caches, ids):
        c.append(i, [prompts], [prompts])
    for step in range(4):
        x = torch.randn(2, H, D, generator=gen).bfloat16()
        q = torch.randn(2, HQ, D, generator=gen).bfloat16()
        plans = [c.plan_append(i, [1, 1]) for c, i in zip(caches, ids)]
        caches[0].write_layer(0, plans[0], x, x * 0.5)
        want = caches[0].decode_attention(0, q, ids[0], out_dtype=torch.bfloat16)
        got = caches[1].decode_step(0, plans[1], q, x, x * 0.5, ids[1], out_dtype=torch.bfloat16)
        assert launches == ([1] if plans[1].append_only and not check_finite else [])
        launches.clear()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), step
        for name in POOLS:
            assert torch.equal(getattr(caches[1].pools[0], name), getattr(caches[0].pools[0], name)), (step, name)
    before = caches[1].pools[0].k_win.clone()
    plan = caches[1].plan_append(ids[1], [1, 1])
    with pytest.raises(ValueError, match=r"q: expected shape \[B=2, H_q"):
        caches[1].decode_step(0, plan, torch.zeros(2, HQ, D + 1), x, x, ids[1])
    assert torch.equal(caches[1].pools[0].k_win, before)
