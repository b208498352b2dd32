"""Decode attention the way a serving engine runs it: one CUDA graph per decode step, one attention call per layer,
each layer reading its own cache. INT2 history + BF16 window (this library) vs BF16 SDPA (flash and cuDNN).

Why a second benchmark: `bench_decode.py` times one call at a time with `do_bench` (eager, L2 flushed). At small
shapes an eager call is bound by Python and launch overhead (three launches, argument checks), which a serving
engine removes by capturing the whole decode step in a CUDA graph. Here both sides are captured the same way:
a graph of `calls` attention calls over `layers` distinct caches (enough layers that their bytes are at least 3x the
L2, so no call finds its data in L2), replayed; time per call = replay time / calls. Eager time of the same call
sequence is reported next to it.

    python3 bench/bench_decode_graph.py --out bench/results                 # 9 points, ~1-2 minutes on an H200
    python3 bench/bench_decode_graph.py --out OUT --impls 5,6 --points 131072x8,8192x1

Writes `decode_graph_<gpu>.{json,md}`: per point, BF16 best backend and INT2 (each impl) ms per call under the graph
and eager, achieved bandwidth (bytes of codes + scales + BF16 windows per second) against a device-to-device copy
measured in the same run, and the relative RMSE of the INT2 output against a float64 reference (first sequence).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import DEV, H_KV, H_Q, PAGE, WIN, D, exact_decode, int2_history_bytes, make_int2_cache  # noqa: E402

from runtime_kernels import attention as A  # noqa: E402
from runtime_kernels.attention import triton_fused as _fused  # noqa: E402
from runtime_kernels.attention import triton_int2 as _int2  # noqa: E402

MIN_CALLS = 48  # calls per graph replay: the replay's own launch cost is spread over this many calls


def point_inputs(point: str) -> tuple[int, int, torch.Generator, torch.Tensor]:
    """`CONTEXTxBATCH` -> (context, batch, a generator seeded by the point, bf16 queries `[B, H_q, d]` drawn from it)."""
    context, batch = (int(x) for x in point.lower().split("x"))
    gen = torch.Generator(device=DEV).manual_seed(context + batch)
    return context, batch, gen, torch.randn(batch, H_Q, D, device=DEV, generator=gen).to(torch.bfloat16)


def l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))


def layers_for(bytes_per_call: int) -> int:
    """Distinct caches so that one pass over them reads at least 3x the L2 (at least 2)."""
    return max(2, math.ceil(3 * l2_bytes() / bytes_per_call))


def time_graph(calls, replays: int = 15) -> float:
    """Median ms per call of a CUDA graph made of `calls` (a list of no-argument functions), replayed."""
    g = capture_graph(calls)
    times = [replay_ms(g) / len(calls) for _ in range(replays)]
    del g
    return statistics.median(times)


def capture_graph(calls) -> torch.cuda.CUDAGraph:
    """`calls` warmed up on a side stream (compiles, autotunes, allocator), then captured in one CUDA graph and
    replayed once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in calls[:3]:  # warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def replay_ms(g: torch.cuda.CUDAGraph) -> float:
    """ms of one replay of g (CUDA events; waits for it)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def time_eager(calls, reps: int = 5) -> float:
    """Median ms per call of the same call sequence issued eagerly from Python (launch overhead included)."""
    for fn in calls[:3]:
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for fn in calls:
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / len(calls))
    return statistics.median(times)


def repeat_to(calls: list, n: int) -> list:
    return [calls[i % len(calls)] for i in range(max(n, len(calls)))]


def copy_gbps() -> float:
    """Device-to-device copy of 1 GiB launched eagerly (a captured copy becomes a graph memcpy node that runs on the
    copy engines, about 35 % slower than the SM copy kernel an eager copy uses): read + write bytes per second."""
    import triton.testing

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200)
    return 2 * n / ms / 1e6


# ----------------------------------------------------------------------------------------------------- BF16 side
def bf16_layers(batch: int, context: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Distinct BF16 K/V caches `[B, H_kv, context, d]`, one per layer (`layers_for` of a call's bytes)."""
    layers = layers_for(2 * batch * H_KV * context * D * 2)
    return [tuple(torch.empty(batch, H_KV, context, D, device=DEV, dtype=torch.bfloat16).normal_(generator=gen)
                  for _ in range(2)) for _ in range(layers)]


def bf16_point(batch: int, context: int, q: torch.Tensor, gen: torch.Generator) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv = bf16_layers(batch, context, gen)
    qg = q.reshape(batch, H_Q, 1, D)
    out = {"layers": len(kv), "bytes_per_call": 2 * batch * H_KV * context * D * 2}
    import warnings

    warnings.filterwarnings("ignore", message=".*kernel not used.*|.*same num_heads.*|.*runtime disabled.*")
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                calls = [lambda k=k, v=v: torch.nn.functional.scaled_dot_product_attention(qg, k, v, enable_gqa=True)
                         for k, v in kv]
                calls = repeat_to(calls, MIN_CALLS)
                out[name] = {"graph_ms": time_graph(calls), "eager_ms": time_eager(calls)}
        except Exception as e:  # a backend that refuses the shape is recorded, not fatal
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    del kv
    ok = {k: v["graph_ms"] for k, v in out.items() if isinstance(v, dict) and "graph_ms" in v}
    out["best"] = min(ok, key=ok.get) if ok else None
    out["best_graph_ms"] = ok[out["best"]] if ok else float("nan")
    out["best_eager_ms"] = min(v["eager_ms"] for v in out.values() if isinstance(v, dict) and "eager_ms" in v) \
        if ok else float("nan")
    return out


# ----------------------------------------------------------------------------------------------------- INT2 side
def int2_layers(batch: int, context: int, layers: int, gen: torch.Generator, layout: str = "separate",
                order: str = "scattered", page: int = PAGE):
    """`layers` distinct INT2 caches in one pool: `bench_decode.make_int2_cache` for layers * batch sequences of
    `page`-token pages, its block table and window slots split per layer (each layer its own scattered pages and its
    own windows)."""
    pools, table, hist_len, k_win, v_win, slot_ids, win_len, _, _ = make_int2_cache(layers * batch, context, gen,
                                                                                   page, layout=layout, order=order)
    return (pools, table.view(layers, batch, -1), hist_len[:batch], k_win, v_win, slot_ids.view(layers, batch),
            win_len[:batch])


DEFAULT_SHARED_GRID = A.DECODE_SHARED_GRID  # the library defaults, restored for each variant
DEFAULT_WINDOWS_FIRST = _fused.WINDOWS_FIRST
DEFAULT_PAIR_TILES = _int2.PAIR_TILES
DEFAULT_WINDOW_TOKENS = _fused.WINDOW_SPLIT_TOKENS
DEFAULT_SPARE_ZERO = _int2.V_SPARE_ZERO
DEFAULT_TILE_ACC = _int2.IMPL5_TILE_ACC
DEFAULT_K_INT8 = _int2.K_INT8_SCORES


def apply_variant(variant: str) -> int:
    """`IMPL[:key=value...]` (keys: maxnreg, waves, stages, whole, fused, shared, wfirst, pair) -> set the
    library switches, return the
    impl. `whole=0` runs the masked kernel (the functional API's default) instead of the whole-pages one that
    PagedKVCache uses (its history is always whole pages, and so is this benchmark's); `fused=1` runs the
    single fused launch (history + window + reduce) instead of the default three launches; `shared=1` the two
    launches of `DECODE_SHARED_GRID` (history and window in one grid, then the reduce), `shared=0` three;
    `wfirst=1` the window programs first in that grid (`triton_fused.WINDOWS_FIRST`); `pair=1` two-page history
    tiles in that grid (`triton_int2.PAIR_TILES`); `wtok=N` window tokens per program of that grid
    (`triton_fused.WINDOW_SPLIT_TOKENS`); `vzero=1` zeros in the V dot's spare columns
    (`triton_int2.V_SPARE_ZERO`); `tileacc=0` V dots chained onto the chunk accumulators (`triton_int2.IMPL5_TILE_ACC`);
    `ki8=1|0` int8 score MMAs on the K code bytes (`triton_int2.K_INT8_SCORES`); `layout=`, `order=`, `page=` the pools' layout, page order and page size (`variant_cache`)."""
    from runtime_kernels.attention import triton_int2

    impl, *opts = variant.split(":")
    triton_int2.IMPL5_MAXNREG = None
    A.INT2_WAVES = 1
    A.DECODE_FUSED = False
    A.DECODE_SHARED_GRID = DEFAULT_SHARED_GRID
    _fused.WINDOWS_FIRST = DEFAULT_WINDOWS_FIRST
    _int2.PAIR_TILES = DEFAULT_PAIR_TILES
    _fused.WINDOW_SPLIT_TOKENS = DEFAULT_WINDOW_TOKENS
    _int2.V_SPARE_ZERO = DEFAULT_SPARE_ZERO
    _int2.IMPL5_TILE_ACC = DEFAULT_TILE_ACC
    _int2.K_INT8_SCORES = DEFAULT_K_INT8
    for o in opts:
        k, v = o.split("=")
        if k == "maxnreg":
            triton_int2.IMPL5_MAXNREG = int(v)
        elif k == "waves":
            A.INT2_WAVES = float(v)
        elif k == "fused":
            A.DECODE_FUSED = v != "0"
        elif k == "shared":
            A.DECODE_SHARED_GRID = v != "0"
        elif k == "wfirst":
            _fused.WINDOWS_FIRST = v != "0"
        elif k == "pair":
            _int2.PAIR_TILES = v != "0"
        elif k == "wtok":
            _fused.WINDOW_SPLIT_TOKENS = int(v)
        elif k == "vzero":
            _int2.V_SPARE_ZERO = v != "0"
        elif k == "tileacc":
            _int2.IMPL5_TILE_ACC = v != "0"
        elif k == "ki8":
            _int2.K_INT8_SCORES = v != "0"
        elif k not in ("stages", "whole", "layout", "order", "page"):
            raise SystemExit(f"--variants: unknown option {k!r} in {variant!r} (maxnreg, waves, stages, whole, "
                             f"fused, shared, wfirst, pair, wtok, vzero, tileacc, ki8, layout, order, page)")
    return int(impl)


def variant_stages(variant: str) -> int:
    return next((int(o.split("=")[1]) for o in variant.split(":")[1:] if o.startswith("stages=")), 3)


# The pools `PagedKVCache` allocates at one group per row: V scale and zero interleaved (since session 9).
LIBRARY_LAYOUT = "vpair"


def variant_cache(variant: str, default_layout: str = LIBRARY_LAYOUT) -> tuple[str, str, int]:
    """(layout, order, page) of the pools a variant runs on (`bench_decode.make_int2_cache`):
    `layout=separate|scales|tile|vpair` (default: the library's, `LIBRARY_LAYOUT`), `order=scattered|ordered`,
    `page=N` tokens per page (default PAGE; the kernel's tiles stay 64 tokens, so a 128-token page holds two)."""
    opts = dict(o.split("=") for o in variant.split(":")[1:])
    return opts.get("layout", default_layout), opts.get("order", "scattered"), int(opts.get("page", PAGE))


def variant_whole(variant: str) -> bool:
    return next((o.split("=")[1] != "0" for o in variant.split(":")[1:] if o.startswith("whole=")), True)


def int2_bytes_per_call(batch: int, context: int) -> int:
    """Bytes one INT2 call reads: the history (`int2_history_bytes`) and the BF16 windows."""
    return int2_history_bytes(batch * (context - WIN)) + batch * WIN * H_KV * D * 2 * 2


def variant_layers(batch: int, context: int, gen: torch.Generator, variant: str = "") -> tuple:
    """Distinct per-layer INT2 caches in the pools of `variant` (`variant_cache`), as many as a pass needs to read 3x
    the L2 -> (layers, pools, tables, hist_len, k_win, v_win, slots, win_len)."""
    layers = layers_for(int2_bytes_per_call(batch, context))
    return (layers, *int2_layers(batch, context, layers, gen, *variant_cache(variant)))


def int2_point(batch: int, context: int, q: torch.Tensor, gen: torch.Generator, impls: list[str],
               copy: float) -> dict:
    read = int2_bytes_per_call(batch, context)
    layers = layers_for(read)
    caches = {}  # (layout, order) -> (pools, tables, hist_len, k_win, v_win, slots, win_len, exact)
    out = {"layers": layers, "bytes_per_call": read, "floor_ms_at_copy_bw": read / copy / 1e6}
    for variant in impls:
        key = f"impl{variant}"
        try:
            if variant_cache(variant) not in caches:
                c = int2_layers(batch, context, layers, gen, *variant_cache(variant))
                caches[variant_cache(variant)] = c + (exact_decode(q, c[0], c[1][0], c[2], c[3], c[4], c[5][0], c[6],
                                                                   rows=1)[0][0],)
            pools, tables, hist_len, k_win, v_win, slots, win_len, exact = caches[variant_cache(variant)]
            impl, stages, whole = apply_variant(variant), variant_stages(variant), variant_whole(variant)
            calls = [lambda t=tables[i], s=slots[i], impl=impl, stages=stages, whole=whole: A.decode_attention(
                q, *pools, t, hist_len, k_win, v_win, s, win_len, impl=impl, num_stages=stages, whole_pages=whole)
                for i in range(layers)]
            o, _ = calls[0]()
            err = ((o[0].double() - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
            calls = repeat_to(calls, MIN_CALLS)
            g = time_graph(calls)
            out[key] = {"graph_ms": g, "eager_ms": time_eager(calls), "rel_rmse_vs_float64": err,
                        "splits": A.decode_num_splits(q, *pools, tables[0], hist_len, k_win, v_win, slots[0],
                                                      win_len, num_stages=stages, impl=impl, whole_pages=whole),
                        "whole_pages": whole, "fused": A.DECODE_FUSED, "shared_grid": A.DECODE_SHARED_GRID,
                        "windows_first": _fused.WINDOWS_FIRST, "pair_tiles": _int2.PAIR_TILES,
                        "window_split_tokens": _fused.WINDOW_SPLIT_TOKENS, "v_spare_zero": _int2.V_SPARE_ZERO,
                        "tile_acc": _int2.IMPL5_TILE_ACC, "maxnreg": _int2.IMPL5_MAXNREG,
                        "k_int8_scores": _int2.K_INT8_SCORES,
                        "layout": "/".join(map(str, variant_cache(variant))),
                        "correct": bool(err < 1e-2), "gbps": read / g / 1e6, "pct_copy": 100 * read / g / 1e6 / copy}
        except Exception as e:  # noqa: BLE001 - one failing variant is recorded, the others still run
            out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            traceback.print_exc()
    apply_variant(str(A.INT2_IMPL))
    out["demotion"] = demotion_cost(batch, next(iter(caches.values()))[0], gen) if caches else {}
    return out


def demotion_cost(batch: int, pools, gen: torch.Generator) -> dict:
    """Quantize + pack + write into the pools (K and V, rotation and clip included, `quant.write_pages`), eager
    (`do_bench`, so launch overhead counts: an upper bound): one page per sequence every PAGE steps, and one token
    per sequence every step; ms per decode step."""
    import triton.testing

    from runtime_kernels import quant

    rot = torch.linalg.qr(torch.randn(H_KV, D, D, device=DEV, generator=gen))[0]
    ratio = torch.full((H_KV,), 0.96, device=DEV)
    out = {}
    for name, t, per in (("page_batched", batch * PAGE, PAGE), ("one_token", batch, 1)):
        x = torch.randn(t, H_KV, D, device=DEV, generator=gen).to(torch.bfloat16)
        ids = torch.randint(0, pools[0].shape[0], (t,), device=DEV, generator=gen, dtype=torch.int32)
        rows = torch.randint(0, PAGE, (t,), device=DEV, generator=gen, dtype=torch.int32)

        def demote():
            quant.write_pages(x, rot, ratio, pools[0], pools[1], pools[2], ids, rows)
            quant.write_pages(x, rot, ratio, pools[3], pools[4], pools[5], ids, rows)
        try:
            out[f"{name}_ms_per_step"] = triton.testing.do_bench(demote, warmup=10, rep=50) / per
        except Exception as e:  # noqa: BLE001 - recorded, the benchmark goes on
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return out


# ------------------------------------------------------------------------------------------------------- report
def markdown(meta: dict, rows: list[dict], impls: list[str]) -> str:
    f = lambda x, n=4: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{n}f}"  # noqa: E731
    lines = [f"# Decode attention under CUDA graphs ({meta['gpu']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; Qwen3-8B geometry (H_q={H_Q}, "
             f"H_kv={H_KV}, d={D}), page {PAGE}, window {WIN} BF16 tokens. One graph = {MIN_CALLS}+ calls over "
             f"distinct per-layer caches (>= 3x L2 of bytes per pass); ms per call = replay time / calls. "
             f"Copy bandwidth (same run, eager 1 GiB device-to-device copy): **{meta['copy_gbps']:.0f} GB/s**. "
             f"`python3 bench/bench_decode_graph.py --out DIR`. Demotion: `quant.write_pages` of K and V (rotation "
             f"and clip included), eager `do_bench` (launch overhead counted), per decode step: one page per sequence "
             f"every {PAGE} steps (page batched) or one token per sequence every step.", "",
             "| context | batch | BF16 best (graph ms) | backend | " + " | ".join(
                 f"impl {i} graph ms | impl {i} vs BF16 | impl {i} GB/s (% copy) | impl {i} err" for i in impls)
             + " | BF16 eager ms | " + " | ".join(f"impl {i} eager ms" for i in impls)
             + " | floor ms | demotion ms/step (page batched) | % of default impl | demotion ms/step (1 token) |",
             "|---|---|---|---|" + "---|---|---|---|" * len(impls) + "---|" + "---|" * len(impls) + "---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['batch']} | ERROR {r['error'][:100]} |")
            continue
        b = r["bf16"]
        cells = [str(r["context"]), str(r["batch"]), f(b["best_graph_ms"]), str(b["best"])]
        eager = []
        for i in impls:
            v = r["int2"].get(f"impl{i}", {})
            if "graph_ms" in v:
                cells += [f(v["graph_ms"]), f"{b['best_graph_ms'] / v['graph_ms']:.2f}x",
                          f"{v['gbps']:.0f} ({v['pct_copy']:.0f}%)",
                          f"{v['rel_rmse_vs_float64']:.1e}" + ("" if v["correct"] else " WRONG")]
                eager.append(f(v["eager_ms"]))
            else:
                cells += ["error", "-", "-", v.get("error", "")[:60]]
                eager.append("-")
        dem = r["int2"].get("demotion", {})
        dflt = r["int2"].get(f"impl{impls[0]}", {}) if len(impls) == 1 else r["int2"].get(
            f"impl{meta['default_impl']}", {})
        pct = (100 * dem["page_batched_ms_per_step"] / dflt["graph_ms"]
               if "page_batched_ms_per_step" in dem and "graph_ms" in dflt else float("nan"))
        cells += [f(b["best_eager_ms"])] + eager + [f(r["int2"]["floor_ms_at_copy_bw"]),
                                                     f(dem.get("page_batched_ms_per_step"), 5), f(pct, 1) + "%",
                                                     f(dem.get("one_token_ms_per_step"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--impls", default=str(A.INT2_IMPL),
                    help="comma-separated INT2 variants IMPL[:maxnreg=N][:waves=W][:stages=S] (default: library)")
    ap.add_argument("--points", default="131072x8,131072x32,131072x1,32768x1,32768x8,32768x32,8192x1,8192x8,8192x32",
                    help="CONTEXTxBATCH, comma-separated")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_graph: needs a CUDA GPU")
    import triton

    from runtime_kernels.attention import triton_int2

    triton_int2.strict_impl(True)
    impls = args.impls.split(",")
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "l2_bytes": l2_bytes(),
            "calls_per_graph_min": MIN_CALLS, "default_impl": A.INT2_IMPL}
    meta["copy_gbps"] = copy_gbps()
    print(f"copy {meta['copy_gbps']:.0f} GB/s", flush=True)
    rows = []
    t0 = time.time()
    for p in args.points.split(","):
        context, batch, gen, q = point_inputs(p)
        row = {"context": context, "batch": batch}
        try:
            row["bf16"] = bf16_point(batch, context, q, gen)
            torch.cuda.empty_cache()
            row["int2"] = int2_point(batch, context, q, gen, impls, meta["copy_gbps"])
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            traceback.print_exc()
        torch.cuda.empty_cache()
        rows.append(row)
        msg = f"{context}x{batch}: bf16 {row.get('bf16', {}).get('best_graph_ms', float('nan')):.4f}"
        for i in impls:
            v = row.get("int2", {}).get(f"impl{i}", {})
            msg += f" | impl{i} {v.get('graph_ms', float('nan')):.4f} (eager {v.get('eager_ms', float('nan')):.4f})"
        print(msg, flush=True)
    meta["wall_s"] = time.time() - t0
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "decode_graph_" + meta["gpu"].replace(" ", "_"))
    with open(stem + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    md = markdown(meta, rows, impls)
    with open(stem + ".md", "w") as fh:
        fh.write(md)
    print(md)


if __name__ == "__main__":
    main()
