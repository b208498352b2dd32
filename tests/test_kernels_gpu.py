"""GPU versions of the kernel tests at serving shapes (Qwen3-8B geometry, long histories). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from format_helpers import PAPER, qfmt

from runtime_kernels import attention as A
from runtime_kernels import quant
from runtime_kernels.attention.int2_decode import launch as L
from runtime_kernels.attention.int2_decode import naive as paged_ref
from runtime_kernels.attention.int2_decode.pools import quad_pools
from runtime_kernels.quant import naive
from tests.kernel_helpers import (
    batch_of,
    decode_inputs,
    decode_records,
    pages_of,
    pool_format,
    pool_layout,
    relayout,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rel_rmse(got, want, floor=1e-3):
    err = (got.float() - want.float()).pow(2).mean().sqrt()
    return (err / want.float().pow(2).mean().sqrt().clamp_min(floor)).item()


def make_pool(lens, h_kv, d, page=64, group_size=None, seed=0, scale_format="float16"):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    g = group_size or d
    max_pages = max(1, max(-(-n // page) for n in lens))
    n_pages = len(lens) * max_pages + 2
    out = []
    for _ in range(2):
        x = torch.randn(n_pages * page, h_kv, d, generator=gen, device=DEV)
        c, s, z = naive.quantize_pack(x, None, None, qfmt(g, scale_format))
        out += [t.reshape(n_pages, page, h_kv, -1).transpose(1, 2).contiguous() for t in (c, s, z)]
    table = torch.randperm(n_pages, generator=gen, device=DEV)[: len(lens) * max_pages].reshape(len(lens), max_pages)
    return out + [table.to(torch.int32), torch.tensor(lens, dtype=torch.int32, device=DEV)]


@pytest.mark.parametrize("t,d,group_size", [(1, 128, None), (4099, 128, None), (257, 64, 32), (63, 256, None),
                                            (1000, 96, 24)])
@pytest.mark.parametrize("clip_mode", ["kernel", "torch"])
def test_quantize_bit_exact_on_gpu(t, d, group_size, clip_mode):
    from runtime_kernels.quant.triton_quant import quantize_pack_into

    gen = torch.Generator(device=DEV).manual_seed(t)
    h = 8
    x = torch.randn(t, h, d, generator=gen, device=DEV) * torch.exp(torch.randn(t, h, 1, generator=gen, device=DEV))
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=gen, device=DEV))[0]
    ratio = torch.linspace(0.85, 1.0, h, device=DEV)
    g = group_size or d
    want = naive.quantize_pack(x, rot, ratio, qfmt(g))
    xr = naive.rotate(x, rot).contiguous()
    codes = torch.empty(t, h, 1, d // 4, dtype=torch.uint8, device=DEV)
    scale = torch.empty(t, h, 1, d // g, dtype=torch.float16, device=DEV)
    zero = torch.empty_like(scale)
    idx = torch.arange(t, device=DEV, dtype=torch.int32)
    quantize_pack_into(xr, ratio, codes, scale, zero, idx, idx * 0, qfmt(g), clip_mode=clip_mode)
    for a, b in zip((codes[:, :, 0], scale[:, :, 0], zero[:, :, 0]), want):
        assert torch.equal(a, b)
    got = quant.quantize_pack(x.to(torch.bfloat16), rot, ratio, qfmt(group_size))
    for a, b in zip(got, naive.quantize_pack(x.to(torch.bfloat16), rot, ratio, qfmt(g))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_int2_decode_on_gpu(group, d):
    lens = [0, 1, 7, 8, 63, 257, 4099, 20000]
    pool = make_pool(lens, 2, d, seed=d + group)
    q = torch.randn(len(lens), 2 * group, d, device=DEV, dtype=torch.bfloat16)
    o, lse = A.int2_decode_attention(q, pages_of(pool), batch_of(pool))
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool, fmt=pool_format(pool))
    assert rel_rmse(o, o_ref) < 2e-2
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    assert torch.allclose(lse[fin], lse_ref[fin], atol=2e-2)
    o32, _ = A.int2_decode_attention(q.float(), pages_of(pool), batch_of(pool))  # fp32 queries: ieee dots
    assert rel_rmse(o32, o_ref) < 1e-4


def test_int2_group_scales_on_gpu():
    pool = make_pool([3000, 70], 8, 128, group_size=32, seed=5)
    q = torch.randn(2, 32, 128, device=DEV, dtype=torch.bfloat16)
    o, _ = A.int2_decode_attention(q, pages_of(pool), batch_of(pool))
    o_ref, _ = paged_ref.int2_decode_attention_ref(q, *pool, fmt=pool_format(pool))
    assert rel_rmse(o, o_ref) < 2e-2


def test_full_decode_on_gpu_qwen3_8b_geometry():
    lens = [0, 5000, 32768 - 320, 77]
    pool = make_pool(lens, 8, 128, seed=1)
    gen = torch.Generator(device=DEV).manual_seed(3)
    k_win = torch.randn(6, 8, 320, 128, generator=gen, device=DEV).to(torch.bfloat16)
    v_win = torch.randn(6, 8, 320, 128, generator=gen, device=DEV).to(torch.bfloat16)
    slot_ids = torch.tensor([5, 0, 2, 3], dtype=torch.int32, device=DEV)
    win_len = torch.tensor([40, 320, 320, 0], dtype=torch.int32, device=DEV)
    q = torch.randn(4, 32, 128, device=DEV, dtype=torch.bfloat16)
    rec = decode_inputs(pool, k_win, v_win, slot_ids, win_len)
    o, lse = A.decode_attention(q, *rec, fused=True)
    o_ref, lse_ref = A.decode_attention(q, *rec, backend="torch")
    assert rel_rmse(o, o_ref) < 2e-2
    assert torch.allclose(lse, lse_ref, atol=2e-2)
    # The fused launch (window programs shaped for one warp, reduce by the last program) vs the separate kernels.
    o_w, lse_w = A.window_attention(q, rec[2], rec[1])
    o_h, lse_h = A.int2_decode_attention(q, rec[0], rec[1])
    o_m, lse_m = A.merge_attention(o_h, lse_h, o_w, lse_w)
    assert rel_rmse(o_m, o) < 1e-3
    fin = torch.isfinite(lse_m)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.allclose(lse[fin], lse_m[fin], atol=1e-4)


def graph_replays(call, times: int):
    """Capture `call()` (a decode returning (o, lse)) in a CUDA graph once, then for each of `times` replays zero o,
    replay and sync, and yield (o, lse): a stale or skipped replay would leave zeros behind."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = call()
    for _ in range(times):
        o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        yield o, lse


def mixed_decode_batch(lens, pool_seed: int, seed: int, min_window: int) -> tuple:
    """decode_attention's inputs at Qwen3-8B geometry: whole-page histories `lens`, BF16 windows of random lengths
    in [min_window, 320] in shuffled slots, bf16 queries."""
    n = len(lens)
    pool = make_pool(lens, 8, 128, seed=pool_seed)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    k_win = torch.randn(n, 8, 320, 128, generator=gen, device=DEV).to(torch.bfloat16)
    v_win = torch.randn(n, 8, 320, 128, generator=gen, device=DEV).to(torch.bfloat16)
    slot_ids = torch.randperm(n, generator=gen, device=DEV).to(torch.int32)
    win_len = torch.randint(min_window, 321, (n,), generator=gen, device=DEV).to(torch.int32)
    q = torch.randn(n, 32, 128, device=DEV, dtype=torch.bfloat16)
    return (q, *pool, k_win, v_win, slot_ids, win_len)


def test_shared_grid_decode_on_gpu_under_graph_replay():
    """Two-launch form (history and window programs in one grid, then the split reduce) at
    Qwen3-8B geometry with mixed lengths, eager and replayed from a CUDA graph, against the three-launch path and the
    torch reference."""
    args = mixed_decode_batch([64 * (37 + 11 * i) for i in range(8)] + [0], pool_seed=12, seed=5, min_window=0)
    rec, whole = decode_records(args), decode_records(args, whole_pages=True)
    o3, lse3 = A.decode_attention(*rec, window_splits=10)  # an explicit window split count: three launches
    o_ref, lse_ref = A.decode_attention(*rec, backend="torch")
    # The same split counts for both forms: their kernels compile separately, and their register counts (so the
    # splits that fill the SMs) may differ.
    # (An explicit window_splits would select the three-launch path: the grid derives its own.)
    s_h, _ = A.decode_num_splits(*whole)
    o2, lse2 = A.decode_attention(*whole, num_splits=s_h)
    o1, lse1 = A.decode_attention(*whole, fused=True, num_splits=s_h)  # same code, in-kernel reduce
    assert rel_rmse(o2, o_ref) < 2e-2
    assert rel_rmse(o2, o1) < 1e-5
    # The three-launch window kernel rounds its bf16 probabilities differently (1.4e-3 here on 0-320-token windows).
    assert rel_rmse(o2, o3) < 5e-3
    fin = torch.isfinite(lse3)
    assert torch.equal(fin, torch.isfinite(lse2)) and torch.allclose(lse2[fin], lse3[fin], atol=1e-3)
    assert torch.allclose(lse2[fin], lse1[fin], atol=1e-5)
    for o, _ in graph_replays(lambda: A.decode_attention(*whole, validate=False, num_splits=s_h), 3):
        assert torch.equal(o, o2)


def test_fused_decode_under_graph_replay_on_gpu():
    """The one-launch form at batch 32 (2048 programs racing on 256 arrival counters), captured once in a CUDA graph
    with a shared counters buffer and replayed: every replay must reduce (counters back to zero) and match the
    three-launch path; whole_pages as PagedKVCache passes it."""
    args = mixed_decode_batch([64 * (37 + 11 * i) for i in range(32)], pool_seed=9, seed=4, min_window=1)
    counters = torch.zeros(32 * 8, dtype=torch.int32, device=DEV)
    whole = decode_records(args, whole_pages=True)
    o3, lse3 = A.decode_attention(*whole, window_splits=10)  # three launches, same history kernel
    A.decode_attention(*whole, counters=counters, fused=True)  # compile outside the capture
    for o, lse in graph_replays(lambda: A.decode_attention(*whole, counters=counters, validate=False, fused=True), 5):
        assert (counters == 0).all()
        assert rel_rmse(o, o3) < 1e-3
        assert torch.allclose(lse, lse3, atol=1e-4)


@pytest.mark.parametrize("layout", ["quad", "paired_v"])
def test_interleaved_scale_and_zero_pools_on_gpu(layout):
    """Interleaved scale/zero pools (quad: a row's four entries in one `[pages, H, P, 4]` buffer, what
    `PagedKVCache` allocates at one group per row; paired_v: V scale and zero in one `[.., 2]` buffer) give the same
    bits as separate pools, in both launch forms and under graph replay."""
    args = mixed_decode_batch([64 * (37 + 11 * i) for i in range(8)], pool_seed=20, seed=13, min_window=1)
    paired = (args[0], *relayout(args[1:9], layout), *args[9:])
    assert L.tile_path(decode_records(paired, True)[1], True, L.DEFAULT_OPTIONS)[2] == layout
    for fused in (True, False):  # the two-launch result (the last) is what the graph replays
        # The same split counts for both layouts: each compiles its own kernel, whose registers set the splits.
        # (An explicit window_splits would select the three-launch path: the grid derives its own.)
        s_h, _ = A.decode_num_splits(*decode_records(paired, True), options=L.DecodeOptions(fused=fused))
        o1, lse1 = A.decode_attention(*decode_records(args, True), fused=fused, num_splits=s_h)
        o2, lse2 = A.decode_attention(*decode_records(paired, True), fused=fused, num_splits=s_h)
        assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    for o, _ in graph_replays(lambda: A.decode_attention(*decode_records(paired, True), validate=False,
                                                         num_splits=s_h), 2):
        assert torch.equal(o, o1)


def int8_scores_match_their_reference(q, pool) -> tuple:
    """Assert that the whole-page INT2 kernel scores these pools with int8 MMAs and agrees with the float reference
    on the hi/lo query they encode (`paged_ref.hilo_query_ref`) to fp32 rounding -> (o, lse, finite-lse mask)."""
    assert A.decode_plan(q, pages_of(pool), whole_pages=True).int8_scores
    o, lse = A.int2_decode_attention(q, pages_of(pool), batch_of(pool, whole_pages=True))
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(paged_ref.hilo_query_ref(q), *pool, fmt=pool_format(pool))
    assert rel_rmse(o, o_ref) < 3e-4
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.allclose(lse[fin], lse_ref[fin], atol=5e-5)
    return o, lse, fin


def test_int8_scores_on_gpu():
    """The whole-page int8 score MMAs at Qwen3-8B geometry agree with the float reference on the query they encode
    (`paged_ref.hilo_query_ref`) to fp32 rounding, and the masked (fp16-score) tile within the hi/lo error."""
    args = mixed_decode_batch([64 * (37 + 11 * i) for i in range(8)] + [0, 64], pool_seed=22, seed=15, min_window=1)
    q, pool = args[0], args[1:9]
    o, lse, fin = int8_scores_match_their_reference(q, pool)
    o16, lse16 = A.int2_decode_attention(q, pages_of(pool), batch_of(pool))
    assert rel_rmse(o, o16) < 2e-3
    assert torch.allclose(lse[fin], lse16[fin], atol=2e-3)


@pytest.mark.parametrize("group,d", [(1, 128), (8, 128), (4, 256), (8, 256)])
def test_int8_scores_other_geometries_on_gpu(group, d):
    """int8 scores beyond Qwen3-8B's geometry: GQA 1 and 8 (8 and 16 score columns), head_dim 256 (64 code bytes,
    two m16n8k32 steps per quarter), whole-page histories of mixed lengths, against the reference on the hi/lo query."""
    lens = [64 * 70, 0, 64, 64 * 9]
    pool = make_pool(lens, 2, d, seed=d + group + 100)
    q = torch.randn(len(lens), 2 * group, d, device=DEV, dtype=torch.bfloat16)
    int8_scores_match_their_reference(q, pool)


def test_write_pages_on_gpu():
    h, d, p = 8, 128, 64
    x = torch.randn(200, h, d, device=DEV, dtype=torch.bfloat16)
    rot = torch.linalg.qr(torch.randn(h, d, d, device=DEV))[0]
    ratio = torch.full((h,), 0.96, device=DEV)
    slots = torch.randperm(10 * p, device=DEV)[:200]
    pools = []
    for backend in ("triton", "torch"):
        c = torch.zeros(10, h, p, d // 4, dtype=torch.uint8, device=DEV)
        s = torch.zeros(10, h, p, 1, dtype=torch.float16, device=DEV)
        z = torch.zeros_like(s)
        quant.write_pages(x, rot, ratio, c, s, z, slots // p, slots % p, qfmt(), backend=backend)
        pools.append((c, s, z))
    for a, b in zip(*pools):
        assert torch.equal(a, b)


def test_paged_cache_serving_shapes_on_gpu():
    """The engine-facing cache at serving settings (page 64, sink 64, recent 256, bf16, Qwen3-8B heads) on the GPU
    with the default kernel, against the same workload through the torch path on the CPU: ragged prompts, decode
    steps that demote a page, rotations and clipping from a random artifact."""
    from runtime_kernels.artifact import identity_artifact
    from runtime_kernels.cache import PagedKVCache

    h, hq, d = 8, 32, 128
    art = identity_artifact(1, h, hq, d, fmt=PAPER)
    gen = torch.Generator().manual_seed(5)
    for name in ("k_rotation", "v_rotation"):
        setattr(art, name, torch.linalg.qr(torch.randn(1, h, d, d, generator=gen, dtype=torch.float64))[0]
                .float().contiguous())
    art.k_clip_ratio = torch.full((1, h), 0.96)
    art.v_clip_ratio = torch.full((1, h), 0.92)
    art.validate()
    prompts = [torch.randn(n, h, d, generator=gen) for n in (330, 1000, 4500)]
    steps = [torch.randn(3, h, d, generator=gen) for _ in range(70)]  # every sequence demotes a page
    q = torch.randn(3, hq, d, generator=gen)
    out = {}
    for dev, backend in (("cuda", "auto"), ("cpu", "torch")):
        cache = PagedKVCache.from_artifact(art, max_pages=128, max_seqs=3, device=dev, dtype=torch.bfloat16,
                                           backend=backend)
        pool0 = cache.pools[0]
        assert quad_pools(pool0.k_scale, pool0.k_zero, pool0.v_scale, pool0.v_zero)  # the quad loop runs (SZ="quad")
        ids = [cache.add_sequence() for _ in prompts]
        cache.append(ids, [[p.to(dev) for p in prompts]], [[p.to(dev) for p in prompts]])
        for x in steps:
            cache.append(ids, [x.to(dev)], [x.to(dev)])
        out[dev] = cache.decode_attention(0, q.to(dev).to(torch.bfloat16), ids).cpu()
        assert [cache.hist_len(i) for i in ids] == [64 * ((n + 70 - 64 - 256) // 64) for n in (330, 1000, 4500)]
    assert rel_rmse(out["cuda"], out["cpu"]) < 1e-2


def test_centered_decode_on_gpu():
    """Centered pools at Qwen3-8B geometry, both launch forms: the kernels against the torch definition (history
    dequantized + mean), and zero means bit-identical to the uncentered call."""
    args = mixed_decode_batch([64 * (37 + 11 * i) for i in range(8)] + [0], pool_seed=30, seed=21, min_window=1)
    gen = torch.Generator(device=DEV).manual_seed(5)
    k_mean, v_mean = (torch.randn(8, 128, generator=gen, device=DEV) * 3 for _ in range(2))
    o_ref, lse_ref = A.decode_attention(*decode_records(args, means=(k_mean, v_mean)), backend="torch")
    zeros = torch.zeros(8, 128, device=DEV)
    for fused in (False, True):
        o, lse = A.decode_attention(*decode_records(args, True, (k_mean, v_mean)), fused=fused)
        assert rel_rmse(o, o_ref) < 2e-2
        assert torch.allclose(lse, lse_ref, atol=2e-2)
        s_h, _ = A.decode_num_splits(*decode_records(args, True), fused=fused)
        o0, l0 = A.decode_attention(*decode_records(args, True), fused=fused, num_splits=s_h)
        oz, lz = A.decode_attention(*decode_records(args, True, (zeros, zeros)), fused=fused, num_splits=s_h)
        assert torch.equal(o0, oz) and torch.equal(l0, lz)



@pytest.mark.parametrize("clip_mode", ["kernel", "torch"])
def test_ue5m3_quantize_bit_exact_on_gpu(clip_mode):
    """The ue5m3 scale format (uint8 scale code and zero point) on the compiled kernel: the reciprocal-multiply
    division torch uses on CUDA, the fp32 bit tricks of the encoding, centering and clipping, bit for bit."""
    from runtime_kernels.quant.triton_quant import quantize_pack_into

    gen = torch.Generator(device=DEV).manual_seed(7)
    t, h, d = 4099, 8, 128
    x = torch.randn(t, h, d, generator=gen, device=DEV) * torch.exp(torch.randn(t, h, 1, generator=gen, device=DEV))
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=gen, device=DEV))[0]
    ratio = torch.linspace(0.85, 1.0, h, device=DEV)
    mean = torch.randn(h, d, generator=gen, device=DEV) * 0.3
    want = naive.quantize_pack(x, rot, ratio, qfmt(d, "ue5m3"), mean=mean)
    codes = torch.empty(t, h, 1, d // 4, dtype=torch.uint8, device=DEV)
    scale = torch.empty(t, h, 1, 1, dtype=torch.uint8, device=DEV)
    zero = torch.empty_like(scale)
    idx = torch.arange(t, device=DEV, dtype=torch.int32)
    quantize_pack_into(naive.rotate(x, rot).contiguous(), ratio, codes, scale, zero, idx, idx * 0,
                       qfmt(d, "ue5m3"), clip_mode=clip_mode, mean=mean)
    for a, b in zip((codes[:, :, 0], scale[:, :, 0], zero[:, :, 0]), want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clip_mode", ["kernel", "torch"])
@pytest.mark.parametrize("scale_format,group_size", [("ue5m3", None), ("float16", None), ("ue5m3", 32),
                                                     ("float16", 64)])
def test_unbiased_quantize_bit_exact_on_gpu(clip_mode, scale_format, group_size):
    """The uniform_unbiased quantizer's second pass on the compiled kernel: the float64 gain (summed in another
    order than torch's, then rounded to 1/2^16), both scale formats, groups, centering and clipping, bit for bit."""
    from runtime_kernels.quant.triton_quant import quantize_pack_into

    gen = torch.Generator(device=DEV).manual_seed(8)
    t, h, d = 4099, 8, 128
    g = group_size or d
    x = torch.randn(t, h, d, generator=gen, device=DEV) * torch.exp(torch.randn(t, h, 1, generator=gen, device=DEV))
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=gen, device=DEV))[0]
    ratio = torch.linspace(0.85, 1.0, h, device=DEV)
    mean = torch.randn(h, d, generator=gen, device=DEV) * 0.3
    want = naive.quantize_pack(x, rot, ratio, qfmt(g, scale_format, quantizer="uniform_unbiased"), mean=mean)
    sdt = naive.SCALE_STORAGE[scale_format]
    codes = torch.empty(t, h, 1, d // 4, dtype=torch.uint8, device=DEV)
    scale = torch.empty(t, h, 1, d // g, dtype=sdt, device=DEV)
    zero = torch.empty_like(scale)
    idx = torch.arange(t, device=DEV, dtype=torch.int32)
    quantize_pack_into(naive.rotate(x, rot).contiguous(), ratio, codes, scale, zero, idx, idx * 0,
                       qfmt(g, scale_format, quantizer="uniform_unbiased"), clip_mode=clip_mode, mean=mean)
    for a, b in zip((codes[:, :, 0], scale[:, :, 0], zero[:, :, 0]), want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d,group_size,layout", [(128, None, "quad"), (128, None, "paired_v"),
                                                 (128, None, "separate"), (64, None, "quad"),
                                                 (64, None, "separate"), (128, 32, "separate")])
@pytest.mark.parametrize("whole", [True, False])
def test_ue5m3_decode_on_gpu(d, group_size, layout, whole):
    """uint8 scale pools through the production kernel (quad, paired V or separate scale/zero pools; int8 scores at
    whole pages and head_dim 128, float scores at 64) and the fallback (several groups per row)."""
    lens = [0, 64, 4096, 20032] if whole else [0, 7, 63, 257, 4099, 20000]
    pool = make_pool(lens, 2, d, group_size=group_size, seed=31, scale_format="ue5m3")
    if layout != "separate":
        pool = list(relayout(pool, layout))
    q = torch.randn(len(lens), 8, d, device=DEV, dtype=torch.bfloat16)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool, fmt=qfmt(group_size, scale_format="ue5m3"))
    o, lse = A.int2_decode_attention(q, pages_of(pool), batch_of(pool, whole_pages=whole))
    assert rel_rmse(o, o_ref) < 2e-2
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    assert torch.allclose(lse[fin], lse_ref[fin], atol=2e-2)


def fp16_twin(pool):
    """The pools with the ue5m3 scale codes and 1/64 zero points written as fp16 numbers (exact, see
    tests/test_decode_ue5m3_paths.py), in the same scale/zero layout."""
    out = list(pool)
    for i in (1, 4):
        scale, zero = naive.scale_zero_fp32(pool[i], pool[i + 1], qfmt(scale_format="ue5m3"))
        s16, z16 = scale.half(), zero.half()
        assert torch.equal(s16.float(), scale) and torch.equal(z16.float(), zero)
        out[i], out[i + 1] = s16, z16
    layout = pool_layout(pool)
    return out if layout == "separate" else list(relayout(out, layout))


def shipped_layout_inputs(context: int, batch: int) -> tuple:
    """The shipped layout at a bench shape (ue5m3 quad pools, centered, 128/1024 windows, page 64, Qwen3-8B heads)
    -> (q, pool, K mean, V mean, (k_win, v_win, slot_ids, win_len)), seeded by the shape."""
    win, rows = 128 + 1024, 128 + 1024 + 63
    hist = (context - win) // 64 * 64
    pool = list(relayout(make_pool([hist] * batch, 8, 128, seed=context + batch, scale_format="ue5m3"), "quad"))
    gen = torch.Generator(device=DEV).manual_seed(batch)
    km, vm = (torch.randn(8, 128, generator=gen, device=DEV) * 0.3 for _ in range(2))
    k_win, v_win = (torch.randn(batch, 8, rows, 128, generator=gen, device=DEV).to(torch.bfloat16) for _ in range(2))
    slot_ids = torch.randperm(batch, generator=gen, device=DEV).to(torch.int32)
    win_len = torch.full((batch,), win, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, 32, 128, generator=gen, device=DEV).to(torch.bfloat16)
    return q, pool, km, vm, (k_win, v_win, slot_ids, win_len)


@pytest.mark.parametrize("context,batch", [(32768, 8), (131072, 1), (8192, 32)])
def test_ue5m3_whole_page_path_is_bit_identical_to_its_fp16_twin_on_gpu(context, batch):
    """The shipped layout at the bench's shapes (ue5m3 scales, centered, quad scale/zero pools, 128/1024 windows,
    page 64, Qwen3-8B heads): the production grid with whole pages and int8 scores, in both launch forms, gives the
    same bits as the same history written with fp16 scales (what the H200 got wrong before the piece loop decoded ue5m3);
    the masked-tile path likewise; whole-page and masked-tile paths agree, and both match the torch reference."""
    q, pool, km, vm, windows = shipped_layout_inputs(context, batch)
    twin = fp16_twin(pool)
    rec = decode_inputs(pool, *windows, True, (km, vm))
    rec16 = decode_inputs(twin, *windows, True, (km, vm))
    plan = A.decode_plan(q, rec[0], rec[2], whole_pages=True)
    assert (plan.kernel, plan.whole_pages, plan.int8_scores, plan.scale_layout, plan.reason) == \
        ("grid", True, True, "quad", "")
    s_h, _ = A.decode_num_splits(q, *rec)  # the same splits for both pools
    for fused in (False, True):
        o, lse = A.decode_attention(q, *rec, fused=fused, num_splits=s_h)
        o16, lse16 = A.decode_attention(q, *rec16, fused=fused, num_splits=s_h)
        assert torch.equal(o, o16) and torch.equal(lse, lse16), (fused, rel_rmse(o, o16))
        o_ref, lse_ref = A.decode_attention(q, *rec, backend="torch")
        assert rel_rmse(o, o_ref) < 2e-2 and torch.allclose(lse, lse_ref, atol=2e-2)
    # History only: the whole-page loop against the masked-tile loop on the same ue5m3 pools.
    pages, pages16 = pages_of(pool, (km, vm)), pages_of(twin, (km, vm))
    oh, lh = A.int2_decode_attention(q, pages, batch_of(pool, whole_pages=True), num_splits=s_h)
    om, lm = A.int2_decode_attention(q, pages, batch_of(pool), num_splits=s_h)
    om16, lm16 = A.int2_decode_attention(q, pages16, batch_of(twin), num_splits=s_h)
    # The masked loop decodes the bytes as loaded (not `_u8_words`); compiled, it differs from its fp16 twin in the
    # last bits (relative RMSE <= 6.5e-7 on an H200: bench/results/decode_ue5m3_masked_vs_fp16_NVIDIA_H200.log).
    assert rel_rmse(om, om16) < 5e-6 and torch.equal(lm, lm16), rel_rmse(om, om16)
    assert rel_rmse(oh, om) < 1e-3 and torch.allclose(lh, lm, atol=2e-3), rel_rmse(oh, om)
    o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pool, k_mean=km, v_mean=vm, fmt=pool_format(pool))
    assert rel_rmse(oh, o_ref) < 2e-2 and torch.allclose(lh, lse_ref, atol=2e-2)


@pytest.mark.parametrize("context,batch", [(131072, 1), (32768, 8)])
def test_launch_options_keep_the_output_bits_on_gpu(context, batch):
    """The shipped layout at the bench's shapes: the split reduce as a programmatic dependent launch and the L2
    prefetch of each program's first tiles (none, one: the default, two) change how the grid runs, not what it
    computes: the same bits as the default call. (The reduce's shape changes the summation order: checked apart,
    `test_split_reduce_rounds_compiled_match_the_torch_merge`.)"""
    q, pool, km, vm, windows = shipped_layout_inputs(context, batch)
    rec = decode_inputs(pool, *windows, True, (km, vm))
    s_h, _ = A.decode_num_splits(q, *rec)
    o, lse = A.decode_attention(q, *rec, num_splits=s_h)
    for options in (A.DecodeOptions(pdl=True), A.DecodeOptions(prefetch_tiles=0), A.DecodeOptions(prefetch_tiles=2)):
        o2, lse2 = A.decode_attention(q, *rec, num_splits=s_h, options=options)
        assert torch.equal(o, o2) and torch.equal(lse, lse2), options


@pytest.mark.parametrize("rows", [512, 64])
def test_split_reduce_rounds_compiled_match_the_torch_merge(rows):
    """The split reduce compiled at 128K x 1's shape (32 query heads, 300 partials): one round of up to 512 partials
    (the default) or 64-partial rounds both merge to the torch reference (`reduce_splits_torch`) within fp32
    rounding."""
    from runtime_kernels.attention.int2_decode import merge

    gen = torch.Generator(device=DEV).manual_seed(rows)
    o_part = torch.randn(1, 32, 300, 128, generator=gen, device=DEV)
    lse_part = torch.randn(1, 32, 300, generator=gen, device=DEV) * 4
    o_t, lse_t = merge.reduce_splits_triton(o_part, lse_part, rows=rows)
    o_r, lse_r = paged_ref.reduce_splits_torch(o_part, lse_part)
    assert torch.allclose(lse_t, lse_r, atol=1e-5) and torch.allclose(o_t, o_r, atol=1e-5)


def test_step_kernels_compiled_match_the_torch_path():
    """`step_kernels` compiled at the Qwen3-8B step shape: the appended window rows are `rotate_rows` + cast + index
    write bit for bit (fp64 sums on the GPU), also when one launch appends and rotates q; the q rotation, and the
    un-rotation inside the split reduce, stay within the fp32 dot-product bound."""
    from runtime_kernels import step_kernels as sk
    from runtime_kernels.cache import rotate_rows

    gen = torch.Generator(device=DEV).manual_seed(0)
    b, h, h_q, d, w = 32, 8, 32, 128, 1151
    rk, rv = (torch.linalg.qr(torch.randn(h, d, d, generator=gen, device=DEV, dtype=torch.float64))[0].float()
              for _ in range(2))
    qkv = torch.randn(b, h_q + 2 * h, d, generator=gen, device=DEV).bfloat16()
    keys, values = qkv[:, h_q:h_q + h], qkv[:, h_q + h:]
    k_win, v_win = (torch.randn(b, h, w, d, generator=gen, device=DEV).bfloat16() for _ in range(2))
    src, slots = torch.arange(b, device=DEV), torch.randperm(b, generator=gen, device=DEV)
    rows = torch.randint(0, w, (b,), generator=gen, device=DEV)
    k_ref, v_ref = k_win.clone(), v_win.clone()
    before = (k_win.clone(), v_win.clone())
    k_ref[slots, :, rows] = rotate_rows(keys, rk).bfloat16()
    v_ref[slots, :, rows] = rotate_rows(values, rv).bfloat16()
    sk.append_rows(keys, values, rk, rv, src, slots, rows, k_win, v_win)
    assert torch.equal(k_win.view(torch.int16), k_ref.view(torch.int16))
    assert torch.equal(v_win.view(torch.int16), v_ref.view(torch.int16))
    q = qkv[:, :h_q]
    # the append and the query rotation in one launch: the two launches' bits
    k_win.copy_(before[0]), v_win.copy_(before[1])
    q_one = sk.append_rows_rotate_queries(keys, values, rk, rv, src, slots, rows, k_win, v_win, q)
    assert torch.equal(q_one.view(torch.int16), sk.rotate_heads(q, rk, out_dtype=torch.bfloat16).view(torch.int16))
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip((k_win, v_win), (k_ref, v_ref)))
    # the split reduce with R_V^T inside: the plain reduce then the product, within the fp32 dot-product bound
    from runtime_kernels.attention.int2_decode import merge

    for rows, splits in ((1, 236), (8, 62)):  # few rows (column blocks apart) and many (one program per row)
        o_part = torch.randn(rows, h_q, splits, d, generator=gen, device=DEV)
        lse_part = torch.randn(rows, h_q, splits, generator=gen, device=DEV)
        plain, _ = merge.reduce_splits_triton(o_part, lse_part)
        un, _ = merge.reduce_splits_triton(o_part, lse_part, rv, torch.float32)
        mv = rv.transpose(-1, -2).repeat_interleave(h_q // h, dim=0).double()
        exact = torch.einsum("bhd,hde->bhe", plain.double(), mv)
        assert ((un.double() - exact).abs() <= d * 2.0 ** -24 * torch.einsum("bhd,hde->bhe", plain.double().abs(),
                                                                           mv.abs())).all()
    got = sk.rotate_heads(q, rk)
    m = rk.repeat_interleave(h_q // h, dim=0).double()
    exact = torch.einsum("bhd,hde->bhe", q.double(), m)
    assert ((got.double() - exact).abs() <= d * 2.0 ** -24 * torch.einsum("bhd,hde->bhe", q.double().abs(),
                                                                        m.abs())).all()
