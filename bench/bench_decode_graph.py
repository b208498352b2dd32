"""Decode attention under CUDA graphs: OSCAR (INT2 history + BF16 windows) in each cache format vs BF16 SDPA.

    python bench/bench_decode_graph.py --out DIR [--points 131072x8,32768x1] [--formats recipe,fp16_64_256]

Formats (`FORMATS`): `recipe` is what `oscar-calib run` ships (ue5m3 scales, centered K/V, 128/1024 BF16 windows) and
gives the headline rows; `fp16_64_256` is the layout of docs/kernels.md's decode table (fp16 scales, uncentered,
64/256); `ue5m3_64_256` (in the default run: ue5m3 against fp16 scales at equal windows) and `fp16_128_1024` separate
the scale format from the windows. Every OSCAR row records the
`DecodePlan` its calls took (kernel, whole pages, int8 scores, scale/zero layout, and why a faster choice was declined).

Why graphs: at small shapes an eager call is bound by host launch time; a serving engine replays graphs. One graph
holds calls over distinct per-layer caches (at least 3x the L2 of bytes per pass, and MIN_CALLS calls), so every
call reads its history from HBM as a real decode step does; ms per call = replay time / calls. Rows follow the
`bench/common.py` schema (op, variant, shape, p50/p20/p80 ms) with the speed-up over the best BF16 backend, the
bytes one call reads and the bandwidth that makes, and the relative RMSE of OSCAR's first call against a float64
reference of the same pools. Also writes `decode_graph_<GPU>.md`, docs/kernels.md's table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from runtime_kernels import attention as A  # noqa: E402
from runtime_kernels.attention.int2_decode import naive as paged_ref  # noqa: E402

MIN_CALLS = 16
# name -> (scale format, centered, sink tokens, recent tokens)
FORMATS = {
    "recipe": ("ue5m3", True, 128, 1024),
    "fp16_64_256": ("float16", False, 64, 256),
    "ue5m3_64_256": ("ue5m3", False, 64, 256),
    "fp16_128_1024": ("float16", True, 128, 1024),
}
DEFAULT_FORMATS = ("recipe", "fp16_64_256", "ue5m3_64_256")  # the last two: ue5m3 against fp16 at equal windows
# 8K/32K/128K (docs/kernels.md's points) and 64K (the issue's), batches 1, 8, 32
DEFAULT_POINTS = [(c, b) for c in (131072, 65536, 32768, 8192) for b in (1, 8, 32)]


def layers_for(bytes_per_call: int) -> int:
    """Distinct caches per graph so that one pass reads >= 3x the L2 (no call finds its bytes cached)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, -(-3 * l2 // max(1, bytes_per_call)))


def graph_times(calls: list) -> tuple[float, float, float]:
    """(p50, p20, p80) ms per call of one CUDA graph made of `calls` (repeated to MIN_CALLS)."""
    graph, n = capture(calls)
    p50, p20, p80 = common.time_ms(graph.replay, rep=300)
    return p50 / n, p20 / n, p80 / n


def capture(calls: list) -> tuple[torch.cuda.CUDAGraph, int]:
    """`calls` (repeated to MIN_CALLS), warmed up on a side stream, captured in one CUDA graph -> (graph, calls)."""
    calls = [calls[i % len(calls)] for i in range(max(MIN_CALLS, len(calls)))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls[:3]:  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return graph, len(calls)


def exact_rel_rmse(args, o, means=None) -> float:
    """Relative RMSE of o[0] against float64 attention over sequence 0's dequantized history (+ the means when
    centered) ++ window."""
    q, kc, ks, kz, vc, vs, vz, table, hist_len, k_win, v_win, slot_ids, win_len = args
    n = int(hist_len[0])
    hk = paged_ref.gather_history(kc, ks, kz, table[0], n)
    hv = paged_ref.gather_history(vc, vs, vz, table[0], n)
    if means is not None:
        hk, hv = hk + means[0][:, None], hv + means[1][:, None]
    k = torch.cat([hk, k_win[int(slot_ids[0]), :, :int(win_len[0])].float()], dim=1).double()
    v = torch.cat([hv, v_win[int(slot_ids[0]), :, :int(win_len[0])].float()], dim=1).double()
    qg = q[0].double().reshape(common.H_KV, -1, common.D)
    p = torch.softmax(torch.einsum("hgd,hnd->hgn", qg, k) / common.D ** 0.5, dim=-1)
    want = torch.einsum("hgn,hnd->hgd", p, v).reshape(-1, common.D)
    return ((o[0].double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


def call_bytes(args) -> int:
    """Bytes one decode call reads: the history rows it covers (codes, scales, zeros) and the valid window rows."""
    q, kc, ks, kz, vc, vs, vz, table, hist_len, k_win, v_win, slot_ids, win_len = args
    per_row = sum(t.shape[3] * t.element_size() for t in (kc, ks, kz, vc, vs, vz))  # per token and KV head
    tokens = int(hist_len.sum())
    return tokens * kc.shape[1] * per_row + int(win_len.sum()) * k_win.shape[1] * k_win.shape[3] * 2 * 2


def bf16_calls(context: int, batch: int, backend) -> list:
    """BF16 SDPA decode calls over distinct per-layer K/V caches `[B, H_kv, context, d]` under `backend`."""
    from torch.nn.attention import sdpa_kernel

    bf16_bytes = 2 * batch * common.H_KV * context * common.D * 2
    kv = [tuple(torch.randn(batch, common.H_KV, context, common.D, device="cuda", dtype=torch.bfloat16)
                for _ in range(2)) for _ in range(layers_for(bf16_bytes))]
    q4 = torch.randn(batch, common.H_Q, 1, common.D, device="cuda", dtype=torch.bfloat16)

    def call(k, v):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    return [lambda k=k, v=v: call(k, v) for k, v in kv]


def oscar_calls(context: int, batch: int, fused: bool, fmt: str, options=None) -> tuple[list, list, tuple]:
    """OSCAR decode calls in format `fmt` over distinct per-layer caches (whole pages, as PagedKVCache calls them)
    under `options` (a DecodeOptions; None: the default) -> (calls, per-layer inputs, means or None)."""
    scale_format, centered, sink, recent = FORMATS[fmt]
    window = sink + recent
    one = common.decode_inputs(batch, context, seed=context + batch, scale_format=scale_format, window=window)
    int2_bytes = call_bytes(one)
    del one
    layers = [common.decode_inputs(batch, context, seed=context + batch + i, scale_format=scale_format,
                                   window=window) for i in range(layers_for(int2_bytes))]
    means = common.decode_means(context + batch) if centered else None
    records = [common.decode_records(a, means, scale_format=scale_format) for a in layers]
    counters = [torch.zeros(batch * common.H_KV, dtype=torch.int32, device=a[0].device) for a in layers]
    return [lambda r=r, c=c: A.decode_attention(*r, validate=False, fused=fused, counters=c, options=options)
            for r, c in zip(records, counters)], layers, means


def plan_fields(plan) -> dict:
    """The plan's fields for a result row (its constexprs are the kernel's business, not the row's)."""
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.repr}


def point(context: int, batch: int, formats, sweeps=()) -> list[dict]:
    """Rows of one point: BF16 SDPA (cuDNN, flash), each format in both launch forms, and the first format's
    two-launch form under each of `sweeps` ((name, DecodeOptions) pairs; rows with shape["options"] = name)."""
    shape = {"context": context, "batch": batch, "h_q": common.H_Q, "h_kv": common.H_KV, "d": common.D,
             "page": common.PAGE}
    rows = []
    # BF16 SDPA over the full context (the baseline), best of cuDNN and flash.
    from torch.nn.attention import SDPBackend

    warnings.filterwarnings("ignore", message=".*kernel not used.*|.*same num_heads.*|.*runtime disabled.*")
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            calls = bf16_calls(context, batch, backend)
            rows.append(common.row("decode_attention", f"bf16_sdpa_{name}", shape, graph_times(calls),
                                   layers=len(calls), bytes_per_call=2 * batch * common.H_KV * context * common.D * 2,
                                   **common.gpu_state()))
        except RuntimeError as e:  # a backend that refuses the shape is recorded, not fatal
            rows.append({"op": "decode_attention", "variant": f"bf16_sdpa_{name}", "shape": shape,
                         "error": str(e).splitlines()[0][:160]})
        calls = None
        torch.cuda.empty_cache()
    best = min((r["p50_ms"] for r in rows if "p50_ms" in r), default=float("nan"))
    # OSCAR: distinct per-layer caches, the two launch forms as PagedKVCache calls them (whole pages).
    runs = [(fmt, form, fused, None, None) for fmt in formats
            for form, fused in (("two_launch", False), ("one_launch", True))]
    runs += [(formats[0], f"two_launch_{name}", False, name, opts) for name, opts in sweeps]
    for fmt, form, fused, opt_name, opts in runs:
        scale_format, centered, sink, recent = FORMATS[fmt]
        fshape = dict(shape, format=fmt, scale_format=scale_format, centered=centered, sink=sink, recent=recent)
        if opt_name:
            fshape["options"] = opt_name
        calls, layers, means = oscar_calls(context, batch, fused, fmt, opts)
        t = graph_times(calls)
        state = common.gpu_state()
        o, _ = calls[0]()
        a = layers[0]
        q, pages, meta, windows = common.decode_records(a, means, scale_format=scale_format)
        plan = A.decode_plan(q, pages, windows, whole_pages=meta.whole_pages, fused=fused, options=opts)
        nbytes = call_bytes(a)
        rows.append(common.row("decode_attention", f"oscar_{fmt}_{form}", fshape, t, layers=len(layers),
                               speedup_vs_best_bf16=best / t[0], bytes_per_call=nbytes,
                               gbps=nbytes / t[0] / 1e6, plan=plan_fields(plan),
                               rel_rmse_vs_float64=exact_rel_rmse(a, o, means),
                               splits=list(A.decode_num_splits(q, pages, meta, windows, fused=fused,
                                                               options=opts)), **state))
        del calls, layers
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], formats) -> str:
    """docs/kernels.md's table: per point, the best BF16 time and each format's best launch form (ms, speed-up)."""
    head = ["context", "batch", "BF16 best (ms)"] + [c for f in formats for c in (f"{f} ms", f"{f} vs BF16",
                                                                                    f"{f} GB/s")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    points = sorted({(r["shape"]["context"], r["shape"]["batch"]) for r in rows}, reverse=True)
    for c, b in points:
        here = [r for r in rows if r["shape"]["context"] == c and r["shape"]["batch"] == b and "p50_ms" in r
                and "options" not in r["shape"]]
        bf16 = min((r["p50_ms"] for r in here if r["variant"].startswith("bf16")), default=float("nan"))
        cells = [str(c), str(b), f"{bf16:.4f}"]
        for f in formats:
            mine = [r for r in here if r["shape"].get("format") == f]
            if not mine:
                cells += ["-"] * 3
                continue
            r = min(mine, key=lambda r: r["p50_ms"])
            cells += [f"{r['p50_ms']:.4f}", f"{bf16 / r['p50_ms']:.2f}x", f"{r['gbps']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for decode_graph_<GPU>.json and .md")
    ap.add_argument("--points", help="comma-separated CONTEXTxBATCH (default: 8K/32K/64K/128K x 1/8/32)")
    ap.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                    help=f"comma-separated cache formats, first = headline (of {', '.join(FORMATS)})")
    ap.add_argument("--options", action="append", default=[], metavar="FIELD=INT,...",
                    help="also time the headline format's two-launch form under these DecodeOptions fields "
                         "(repeatable; e.g. waves=2 or min_split_tokens=128,num_stages=4); not in the table")
    args = ap.parse_args()
    sweeps = []
    for spec in args.options:
        try:
            fields = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
            sweeps.append((spec.replace("=", "").replace(",", "_"), A.DecodeOptions(**fields)))
        except (ValueError, TypeError) as e:
            sys.exit(f"bench_decode_graph: --options {spec!r}: {e}")
    formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        sys.exit(f"bench_decode_graph: --formats: unknown {bad}, expected some of {list(FORMATS)}")
    if not torch.cuda.is_available():
        sys.exit("bench_decode_graph: needs a CUDA GPU")
    points = DEFAULT_POINTS if not args.points else [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    rows = []
    for context, batch in points:
        t0 = time.perf_counter()
        new = point(context, batch, formats, sweeps)
        rows += new
        for r in new:
            print(r["variant"], context, batch, f"{r.get('p50_ms', float('nan')):.4f} ms",
                  f"x{r['speedup_vs_best_bf16']:.2f}" if "speedup_vs_best_bf16" in r else "",
                  "" if "plan" not in r else f"plan={r['plan']['kernel']}/whole={r['plan']['whole_pages']}"
                  f"/ki8={r['plan']['int8_scores']}/sz={r['plan']['scale_layout']} {r['plan']['reason']}", flush=True)
        print(f"# {context}x{batch}: {time.perf_counter() - t0:.1f} s", flush=True)
        path = common.write_rows(args.out, "decode_graph", rows)  # after every point: a timeout keeps what ran
    path.with_suffix(".md").write_text(table(rows, formats))
    print("wrote", path, path.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
