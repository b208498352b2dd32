"""Decode attention under CUDA graphs at the README's nine points: OSCAR (INT2 history + BF16 windows) vs BF16 SDPA.

    python bench/bench_decode_graph.py --out DIR [--points 131072x8,32768x1]

Why graphs: at small shapes an eager call is bound by host launch time; a serving engine replays graphs. One graph
holds calls over distinct per-layer caches (at least 3x the L2 of bytes per pass, and MIN_CALLS calls), so every
call reads its history from HBM as a real decode step does; ms per call = replay time / calls. Rows follow the
`bench/common.py` schema (op, variant, shape, p50/p20/p80 ms) with the speed-up over the best BF16 backend and the
relative RMSE of OSCAR's first call against a float64 reference of the same pools.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from runtime_kernels import attention as A  # noqa: E402
from runtime_kernels.attention.int2_decode import naive as paged_ref  # noqa: E402

MIN_CALLS = 16


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


def exact_rel_rmse(args, o) -> float:
    """Relative RMSE of o[0] against float64 attention over sequence 0's dequantized history ++ window."""
    q, kc, ks, kz, vc, vs, vz, table, hist_len, k_win, v_win, slot_ids, win_len = args
    n = int(hist_len[0])
    k = torch.cat([paged_ref.gather_history(kc, ks, kz, table[0], n),
                   k_win[int(slot_ids[0]), :, :int(win_len[0])].float()], dim=1).double()
    v = torch.cat([paged_ref.gather_history(vc, vs, vz, table[0], n),
                   v_win[int(slot_ids[0]), :, :int(win_len[0])].float()], dim=1).double()
    qg = q[0].double().reshape(common.H_KV, -1, common.D)
    p = torch.softmax(torch.einsum("hgd,hnd->hgn", qg, k) / common.D ** 0.5, dim=-1)
    want = torch.einsum("hgn,hnd->hgd", p, v).reshape(-1, common.D)
    return ((o[0].double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


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


def oscar_calls(context: int, batch: int, fused: bool) -> tuple[list, list]:
    """OSCAR decode calls over distinct per-layer caches (whole pages, as PagedKVCache calls them) -> (calls,
    per-layer inputs)."""
    one = common.decode_inputs(batch, context, seed=context + batch)
    int2_bytes = sum(t.numel() * t.element_size() for t in one[1:7]) + 2 * one[9].numel() * 2
    del one
    layers = [common.decode_inputs(batch, context, seed=context + batch + i) for i in range(layers_for(int2_bytes))]
    counters = [torch.zeros(batch * common.H_KV, dtype=torch.int32, device="cuda") for _ in layers]
    return [lambda a=a, c=c: A.decode_attention(*a, whole_pages=True, validate=False, fused=fused, counters=c)
            for a, c in zip(layers, counters)], layers


def point(context: int, batch: int) -> list[dict]:
    shape = {"context": context, "batch": batch, "h_q": common.H_Q, "h_kv": common.H_KV, "d": common.D,
             "page": common.PAGE, "window": common.WIN}
    rows = []
    # BF16 SDPA over the full context (the baseline), best of cuDNN and flash.
    from torch.nn.attention import SDPBackend

    warnings.filterwarnings("ignore", message=".*kernel not used.*|.*same num_heads.*|.*runtime disabled.*")
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            calls = bf16_calls(context, batch, backend)
            rows.append(common.row("decode_attention", f"bf16_sdpa_{name}", shape, graph_times(calls),
                                   layers=len(calls)))
        except RuntimeError as e:  # a backend that refuses the shape is recorded, not fatal
            rows.append({"op": "decode_attention", "variant": f"bf16_sdpa_{name}", "shape": shape,
                         "error": str(e).splitlines()[0][:160]})
        calls = None
        torch.cuda.empty_cache()
    best = min((r["p50_ms"] for r in rows if "p50_ms" in r), default=float("nan"))
    # OSCAR: distinct per-layer caches, the two launch forms as PagedKVCache calls them (whole pages).
    for variant, fused in (("oscar_two_launch", False), ("oscar_one_launch", True)):
        calls, layers = oscar_calls(context, batch, fused)
        t = graph_times(calls)
        o, _ = calls[0]()
        rows.append(common.row("decode_attention", variant, shape, t, layers=len(layers),
                               speedup_vs_best_bf16=best / t[0],
                               rel_rmse_vs_float64=exact_rel_rmse(layers[0], o),
                               splits=list(A.decode_num_splits(*layers[0], whole_pages=True, fused=fused))))
        del calls, layers
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for decode_graph_<GPU>.json")
    ap.add_argument("--points", help="comma-separated CONTEXTxBATCH (default: the README's nine)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_graph: needs a CUDA GPU")
    points = common.DECODE_POINTS if not args.points else [
        tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    rows = []
    for context, batch in points:
        rows += point(context, batch)
        for r in rows[-4:]:
            print(r["variant"], context, batch, f"{r.get('p50_ms', float('nan')):.4f} ms",
                  f"x{r['speedup_vs_best_bf16']:.2f}" if "speedup_vs_best_bf16" in r else "", flush=True)
    print("wrote", common.write_rows(args.out, "decode_graph", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
