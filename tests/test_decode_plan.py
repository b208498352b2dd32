"""The launch plan (`DecodePlan`): which kernel a decode call runs and why, computed once per call from its records
and logged at DEBUG; computable for a compiled GPU launch on a CPU (`compiled=True`), so the shipped format's plan at
the bench's shapes is pinned here without a GPU."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from oscar_calib.config import SolverSettings
from runtime_kernels import attention as A
from runtime_kernels.attention import BatchMetadata, Windows
from runtime_kernels.attention.int2_decode import launch as L
from runtime_kernels.attention.int2_decode import plan as P
from runtime_kernels.cache import PagedKVCache
from runtime_kernels.format import DEFAULT_FORMAT
from tests.kernel_helpers import batch_of, decode_inputs, make_pool, make_q, make_window, pages_of, relayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_decode_graph as bench  # noqa: E402
import common as bench_common  # noqa: E402

LOGGER = "runtime_kernels.attention.int2_decode.launch"
BENCH_BATCHES = sorted({b for _, b in bench.DEFAULT_POINTS})


def test_the_bench_times_the_shipped_recipe():
    """The bench's headline format is what `oscar-calib run` ships (so the plan pinned below is the served one)."""
    f = SolverSettings().kv_format
    assert bench.FORMATS["recipe"] == (f.scale_format, f.centered, f.sink_tokens, f.recent_tokens)
    assert bench.DEFAULT_FORMATS[0] == "recipe"


def cache_call(batch: int, monkeypatch) -> tuple:
    """What `PagedKVCache.decode_attention` passes to `attention.decode_attention` for `batch` sequences, with the
    recipe's layout and the bench's heads -> (q, pages, batch metadata, windows, keyword arguments)."""
    scale_format, centered, sink, recent = bench.FORMATS["recipe"]
    h, h_q, d = bench_common.H_KV, bench_common.H_Q, bench_common.D
    rot = torch.eye(d).expand(1, h, d, d)
    means = dict(k_mean=torch.zeros(1, h, d), v_mean=torch.zeros(1, h, d)) if centered else {}
    fmt = DEFAULT_FORMAT.with_(page_size=bench_common.PAGE, sink_tokens=sink, recent_tokens=recent,
                               scale_format=scale_format, centered=centered)
    cache = PagedKVCache(rot, rot, torch.ones(1, h), torch.ones(1, h), fmt=fmt, max_pages=1, max_seqs=batch,
                         dtype=torch.bfloat16, **means)
    ids = [cache.add_sequence() for _ in range(batch)]
    x = torch.zeros(batch, h, d, dtype=torch.bfloat16)
    cache.append(ids, [x], [x])
    seen = {}

    def record(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return torch.zeros(batch, h_q, d), torch.zeros(batch, h_q)

    monkeypatch.setattr(A, "decode_attention", record)
    cache.decode_attention(0, torch.zeros(batch, h_q, d, dtype=torch.bfloat16), ids)
    monkeypatch.undo()
    return (*seen["args"], seen["kwargs"])


def bench_call(batch: int) -> tuple:
    """What `bench_decode_graph.oscar_calls` passes for the recipe format (the smallest history: the plan reads
    shapes, dtypes and strides, not lengths) -> (q, pages, batch metadata, windows, keyword arguments)."""
    scale_format, centered, sink, recent = bench.FORMATS["recipe"]
    window = sink + recent
    args = bench_common.decode_inputs(batch, window + bench_common.PAGE, seed=0, device="cpu",
                                      scale_format=scale_format, window=window)
    means = bench_common.decode_means(0, device="cpu") if centered else None
    return (*bench_common.decode_records(args, means, scale_format=scale_format), {})


def recipe_plans(monkeypatch, compiled: bool):
    """The plan of every decode call the cache and the bench make at the bench's batches, in both launch forms."""
    for batch in BENCH_BATCHES:
        for source in ("cache", "bench"):
            q, pages, meta, windows, kwargs = cache_call(batch, monkeypatch) if source == "cache" else bench_call(batch)
            assert meta.whole_pages and kwargs.get("validate", True) in (True, False)
            for fused in (False, True):
                yield (source, batch, fused), A.decode_plan(q, pages, windows, whole_pages=meta.whole_pages,
                                                            fused=fused, compiled=compiled)


@pytest.mark.parametrize("compiled", [False, True], ids=["interpreter", "compiled"])
def test_the_shipped_format_takes_the_production_grid_at_the_bench_shapes(monkeypatch, compiled):
    """ue5m3 pools, centered, recipe windows, page 64, Qwen3-8B heads: the production grid in one or two launches,
    for the interpreter and for a compiled GPU launch. Under the interpreter (where the ue5m3 whole-page loop is
    tested bit for bit) also the whole-page loop, int8 scores and quad scale/zero pools, and nothing declined."""
    for where, plan in recipe_plans(monkeypatch, compiled):
        fused = where[2]
        assert (plan.kernel, plan.launches, plan.scale_format, plan.centered, plan.compiled) == \
            ("grid", 1 if fused else 2, "ue5m3", True, compiled), (where, plan)
        if not compiled:
            assert (plan.whole_pages, plan.int8_scores, plan.scale_layout, plan.reason) == \
                (True, True, "quad", ""), where


def test_the_shipped_format_takes_the_whole_page_loop_in_a_compiled_launch(monkeypatch):
    """The plan a GPU launch takes: whole pages, int8 scores, quad scale/zero pools, nothing declined (the H200
    checks the loop's bits: tests/test_kernels_gpu.py::test_ue5m3_whole_page_path_is_bit_identical_to_its_fp16_twin_on_gpu)."""
    for where, plan in recipe_plans(monkeypatch, compiled=True):
        assert (plan.whole_pages, plan.int8_scores, plan.scale_layout, plan.reason) == (True, True, "quad", ""), where


def test_the_compiled_plan_differs_from_the_interpreted_one_only_where_the_target_matters():
    """fp16 pools have no guard: a compiled launch's plan is the interpreter's, except the target itself (and what
    follows it: the INTERP constexpr, and PF, the L2 prefetch that only a compiled launch issues)."""
    pool = make_pool([128], 2, 128, 64, seed=1, layout="quad")
    q = make_q(1, 8, 128, torch.bfloat16)
    k_win, _ = make_window(1, 2, 8, 128, torch.bfloat16)
    windows = Windows(k_win, k_win)
    interp = A.decode_plan(q, pages_of(pool), windows, whole_pages=True, compiled=False)
    gpu = A.decode_plan(q, pages_of(pool), windows, whole_pages=True, compiled=True)
    assert (interp.compiled, gpu.compiled) == (False, True)
    assert (interp.constexprs["INTERP"], gpu.constexprs["INTERP"]) == (True, False)
    assert (interp.constexprs["PF"], gpu.constexprs["PF"]) == (0, 1)
    assert {k: v for k, v in interp.constexprs.items() if k not in ("INTERP", "PF")} == \
        {k: v for k, v in gpu.constexprs.items() if k not in ("INTERP", "PF")}
    fields = ("kernel", "launches", "whole_pages", "int8_scores", "scale_layout", "scale_format", "centered", "reason")
    assert [getattr(interp, f) for f in fields] == [getattr(gpu, f) for f in fields]
    assert A.decode_plan(q, pages_of(pool), windows, whole_pages=True).compiled is False  # this process: interpreter


def test_the_l2_prefetch_reaches_only_compiled_whole_page_launches():
    """`DecodeOptions.prefetch_tiles` is inline PTX in the whole-page loop's prologue: a compiled launch of that loop
    gets it as the PF constexpr; the interpreter and the masked-tile loop compile without it (PF 0)."""
    pool = make_pool([128], 2, 128, 64, seed=1, layout="quad")
    q = make_q(1, 8, 128, torch.bfloat16)
    k_win, _ = make_window(1, 2, 8, 128, torch.bfloat16)
    opts = L.DecodeOptions(prefetch_tiles=2)

    def pf(whole_pages, compiled, options=opts):
        return A.decode_plan(q, pages_of(pool), Windows(k_win, k_win), whole_pages=whole_pages, options=options,
                             compiled=compiled).constexprs["PF"]

    assert pf(True, True) == 2
    assert pf(True, True, L.DEFAULT_OPTIONS) == 1  # the default: one tile
    assert (pf(True, False), pf(False, True), pf(True, True, L.DecodeOptions(prefetch_tiles=0))) == (0, 0, 0)
    assert pf(True, True, L.DecodeOptions(prefetch_tiles=2, block_n=32)) == 0  # not the 64-token pieces loop


def test_the_plan_says_why_a_fast_path_is_not_taken():
    pool = make_pool([64], 2, 64, 64, group_size=32, seed=1)
    q = make_q(1, 4, 64, torch.bfloat16)
    plan = A.decode_plan(q, pages_of(pool), whole_pages=True)
    assert (plan.kernel, plan.whole_pages) == ("fallback", False) and "2 scale groups per row" in plan.reason
    pool = make_pool([64], 2, 64, 64, seed=1)
    plan = A.decode_plan(q, pages_of(pool), whole_pages=False)
    assert plan.kernel == "production" and not plan.whole_pages and "whole_pages not promised" in plan.reason
    plan = A.decode_plan(q, pages_of(pool), whole_pages=True)
    assert (plan.whole_pages, plan.int8_scores, plan.scale_layout) == (True, False, "separate")
    assert "head_dim 64: fp16 scores" in plan.reason and "four loads per row" in plan.reason
    plan = A.decode_plan(q, pages_of(relayout(pool, "paired_v")), whole_pages=True)
    assert plan.scale_layout == "paired_v" and "a second load per row for the K scale and zero" in plan.reason
    plan = A.decode_plan(q, pages_of(relayout(pool, "quad")), whole_pages=True)
    assert plan.scale_layout == "quad"
    assert plan.reason == "head_dim 64: fp16 scores (int8 scores need head_dim 128 or 256)"
    k_win = torch.zeros(1, 2, 8, 64)
    plan = A.decode_plan(q, pages_of(pool), Windows(k_win, k_win), whole_pages=True)
    assert (plan.kernel, plan.launches) == ("production", 3) and "torch.float32 windows" in plan.reason
    plan = A.decode_plan(q, pages_of(pool), Windows(k_win.bfloat16(), k_win.bfloat16()), whole_pages=True,
                         window_splits=2)
    assert (plan.kernel, plan.launches) == ("production", 3) and "window_splits given without fused" in plan.reason
    plan = A.decode_plan(q.float(), pages_of(pool), whole_pages=True)
    assert plan.kernel == "fallback" and "torch.float32 queries" in plan.reason
    assert L.production_declines(q, pages_of(pool), L.DEFAULT_OPTIONS) == ""


@pytest.mark.interpreter
def test_every_call_logs_its_plan_and_reason_at_debug(caplog):
    """One DEBUG line per decode call, with the kernel and the reason: history-only, the grid, three launches."""
    pool = make_pool([64, 0], 2, 128, 64, seed=2, scale_format="ue5m3", layout="quad")
    q = make_q(2, 8, 128, torch.bfloat16)
    slots, win_len = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([3, 8], dtype=torch.int32)
    calls = [
        (lambda: A.int2_decode_attention(q, pages_of(pool), batch_of(pool, whole_pages=True), backend="triton",
                                         num_splits=1),
         ["kernel='production'", "int8_scores=True", "scale_format='ue5m3'", "reason=''"]),
        (lambda: A.decode_attention(q, *decode_inputs(pool, *make_window(2, 2, 8, 128, torch.bfloat16), slots,
                                                      win_len), backend="triton", num_splits=1),
         ["kernel='grid'", "launches=2", "reason='whole_pages not promised: masked tiles'"]),
        (lambda: A.decode_attention(q, *decode_inputs(pool, *make_window(2, 2, 8, 128, torch.float32), slots,
                                                      win_len, True), backend="triton", num_splits=1),
         ["kernel='production'", "launches=3", "reason='torch.float32 windows (the grid takes fp16/bf16)'"]),
    ]
    for call, want in calls:
        caplog.clear()
        with caplog.at_level("DEBUG", logger=LOGGER):
            call()
        [rec] = [r for r in caplog.records if r.name == LOGGER]
        for w in want:
            assert w in rec.getMessage(), (w, rec.getMessage())


@pytest.mark.interpreter
def test_a_decode_call_chooses_its_kernel_once(monkeypatch):
    """The plan is built once per call and everything after reads it: the production kernel's input checks run
    once, whichever path the call takes."""
    pool = make_pool([128, 64], 2, 64, 64, seed=3)
    q = make_q(2, 4, 64, torch.bfloat16)
    slots, win_len = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5, 2], dtype=torch.int32)
    count = []
    real = P.production_declines
    monkeypatch.setattr(P, "production_declines", lambda *a: count.append(1) or real(*a))
    for dtype, fused in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)):
        count.clear()
        k_win, v_win = make_window(2, 2, 8, 64, dtype)
        A.decode_attention(q, *decode_inputs(pool, k_win, v_win, slots, win_len, True), backend="triton",
                           fused=fused)
        assert len(count) == 1, (dtype, fused, len(count))
    count.clear()
    A.int2_decode_attention(q, pages_of(pool), BatchMetadata(pool[6], pool[7]), backend="triton")
    assert len(count) == 1


def _small_cache(backend: str, window_dtype: torch.dtype) -> tuple[PagedKVCache, list[int]]:
    """A one-layer fp16-scale cache (d = 64, 2 KV heads, 16-token pages) with one sequence past its windows."""
    h, d = 2, 64
    fmt = DEFAULT_FORMAT.with_(sink_tokens=16, recent_tokens=16, page_size=16, scale_format="float16",
                               centered=False)
    rot = torch.eye(d).expand(1, h, d, d)
    cache = PagedKVCache(rot, rot, torch.ones(1, h), torch.ones(1, h), fmt=fmt, max_pages=4, max_seqs=1,
                         dtype=window_dtype, backend=backend)
    sid = cache.add_sequence()
    x = torch.randn(48, h, d, generator=torch.Generator().manual_seed(0))
    cache.append([sid], [[x]], [[x]])
    return cache, [sid]


@pytest.mark.interpreter
def test_the_plan_and_its_reason_are_said_at_the_first_decode_and_in_the_repr(caplog):
    """What decode runs and why reaches a user once, at INFO, not only per call at DEBUG: fp32 windows keep the
    production grid away, and the line says so; the repr carries it from then on."""
    cache, ids = _small_cache("triton", torch.float32)
    assert "not planned yet" in repr(cache)
    q = torch.randn(1, 4, 64, dtype=torch.float32)
    with caplog.at_level("INFO", logger="runtime_kernels.cache"):
        cache.decode_attention(0, q, ids)
        cache.decode_attention(0, q, ids)
    lines = [r.getMessage() for r in caplog.records if r.name == "runtime_kernels.cache" and r.levelname == "INFO"]
    assert len(lines) == 1, lines  # once per cache, not per call
    assert "decode runs Triton fallback kernel, 3 launch(es)" in lines[0]
    assert "slower choices because: torch.float32 windows (the grid takes fp16/bf16)" in lines[0]
    assert "float16 scales" in lines[0] and "(Triton interpreter)" in lines[0]
    assert lines[0].split("decode runs ", 1)[1] in repr(cache)


def test_a_torch_backend_cache_says_it_runs_the_reference(caplog):
    cache, ids = _small_cache("torch", torch.bfloat16)
    with caplog.at_level("INFO", logger="runtime_kernels.cache"):
        cache.decode_attention(0, torch.randn(1, 4, 64, dtype=torch.bfloat16), ids)
    [line] = [r.getMessage() for r in caplog.records if r.name == "runtime_kernels.cache"]
    assert "decode runs the torch reference (backend 'torch' on cpu" in line
    assert "decode: the torch reference" in repr(cache)


def test_the_plan_reads_the_decode_mode_from_the_pages_format():
    """The scale format and centering of a plan are the pages' format's, and the pools must be what it says."""
    pool = make_pool([128, 64], 2, 64, 64, seed=3, scale_format="ue5m3", layout="quad")
    q = make_q(2, 8, 64, torch.bfloat16)
    pages = pages_of(pool)
    plan = A.decode_plan(q, pages, whole_pages=True)
    assert (plan.scale_format, plan.centered) == ("ue5m3", False)
    means = (torch.zeros(2, 64), torch.zeros(2, 64))
    assert A.decode_plan(q, pages_of(pool, means), whole_pages=True).centered
    wrong = dataclasses.replace(pages, fmt=pages.fmt.with_(scale_format="float16"))
    with pytest.raises(TypeError, match=r"pages.k_scale: dtype must be float16 \(pages.fmt.scale_format"):
        A.int2_decode_attention(q, wrong, batch_of(pool), backend="torch")
