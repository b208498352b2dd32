"""Decode attention benchmark: INT2 history + BF16 window (Triton) vs BF16 SDPA (flash, cuDNN), on one GPU.

Geometry of Qwen3-8B (32 query heads, 8 KV heads, head_dim 128); contexts 8K/32K/128K; batch 1/8/32.
Per point: median time per decode attention call (`triton.testing.do_bench`, quantiles [0.5, 0.2, 0.8], L2
flushed before each call), achieved bandwidth (bytes of packed codes + scales + BF16 windows read / time),
the best BF16 SDPA backend in the same run, a device-to-device copy bandwidth measured in the same run, the
quantize/demotion cost per step, the query rotation / output un-rotation cost, and allocated bits per element.

    python3 bench/bench_decode.py --out bench/results            # full run (GPU)
    python3 bench/bench_decode.py --quick                         # two points, for a smoke test
Writes `decode_<gpu>.json` (all rows) and `decode_<gpu>.md` (tables) under --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import time
import traceback

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from runtime_kernels import attention as A  # noqa: E402
from runtime_kernels import quant  # noqa: E402

H_Q, H_KV, D, PAGE, SINK, RECENT = 32, 8, 128, 64, 64, 256
WIN = SINK + RECENT
QUANTILES = [0.5, 0.2, 0.8]


def bench(fn, rep=60) -> tuple[float, float, float]:
    """(median, p20, p80) in ms, L2 flushed before each call."""
    return tuple(triton.testing.do_bench(fn, warmup=20, rep=rep, quantiles=QUANTILES))


def host_ms(fn, n=50) -> float:
    """Wall time per call issued back to back from Python (launch overhead included), ms."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def copy_bandwidth() -> dict:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    med, lo, hi = bench(lambda: dst.copy_(src), rep=200)
    return {"bytes": 2 * n, "ms": med, "gbps": 2 * n / med / 1e6, "note": "read + write bytes of a 1 GiB copy"}


def make_int2_cache(batch: int, context: int, gen: torch.Generator):
    """Paged INT2 pools (random bytes, plausible fp16 scales) + BF16 windows for `batch` sequences of `context`."""
    hist = context - WIN
    pages_per_seq = -(-hist // PAGE)
    n_pages = batch * pages_per_seq
    dev = "cuda"
    kc = torch.randint(0, 256, (n_pages, H_KV, PAGE, D // 4), dtype=torch.uint8, device=dev, generator=gen)
    vc = torch.randint(0, 256, (n_pages, H_KV, PAGE, D // 4), dtype=torch.uint8, device=dev, generator=gen)
    ks = (torch.rand(n_pages, H_KV, PAGE, 1, device=dev, generator=gen) * 0.5 + 0.1).half()
    vs = (torch.rand(n_pages, H_KV, PAGE, 1, device=dev, generator=gen) * 0.5 + 0.1).half()
    kz = (torch.rand(n_pages, H_KV, PAGE, 1, device=dev, generator=gen) * 3).half()
    vz = (torch.rand(n_pages, H_KV, PAGE, 1, device=dev, generator=gen) * 3).half()
    # Pages of a sequence scattered over the pool, as a paged allocator would leave them.
    table = torch.randperm(n_pages, device=dev, generator=gen).reshape(batch, pages_per_seq).to(torch.int32)
    hist_len = torch.full((batch,), hist, dtype=torch.int32, device=dev)
    k_win = torch.randn(batch, H_KV, WIN, D, device=dev, generator=gen).to(torch.bfloat16)
    v_win = torch.randn(batch, H_KV, WIN, D, device=dev, generator=gen).to(torch.bfloat16)
    slot_ids = torch.randperm(batch, device=dev, generator=gen).to(torch.int32)
    win_len = torch.full((batch,), WIN, dtype=torch.int32, device=dev)
    pools = (kc, ks, kz, vc, vs, vz)
    allocated = sum(t.numel() * t.element_size() for t in pools + (k_win, v_win))
    read = batch * hist * H_KV * 2 * (D // 4 + 2 * 2) + batch * WIN * H_KV * D * 2 * 2
    return pools, table, hist_len, k_win, v_win, slot_ids, win_len, allocated, read


def sdpa_baselines(batch: int, context: int, q: torch.Tensor, gen: torch.Generator) -> dict:
    """BF16 SDPA over the full context, each backend that runs; GQA by folding the group into the query length
    (exact for one decode query: all g heads see all keys) and by enable_gqa."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = torch.randn(batch, H_KV, context, D, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(batch, H_KV, context, D, device="cuda", generator=gen).to(torch.bfloat16)
    g = H_Q // H_KV
    q_fold = q.reshape(batch, H_KV, g, D)  # [B, H_kv, g, d]
    q_gqa = q.reshape(batch, H_Q, 1, D)
    out = {}
    import warnings

    warnings.filterwarnings("ignore", message=".*kernel not used.*|.*same num_heads.*|.*runtime disabled.*")
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for gqa in ("fold", "enable_gqa"):
            key = f"{name}/{gqa}"
            try:
                if gqa == "fold":
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q_fold, k, v)  # noqa: E731
                else:
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q_gqa, k, v,  # noqa: E731
                                                                                  enable_gqa=True)
                with sdpa_kernel([backend]):
                    fn()
                    torch.cuda.synchronize()
                    med, lo, hi = bench(fn)
                out[key] = {"ms": med, "p20": lo, "p80": hi}
            except Exception as e:  # a backend that refuses the shape is recorded, not fatal
                out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    return out


def kernel_info(q, pools, table, hist_len, splits, block_n, warps, stages, impl, prefetch) -> dict:
    """Registers per thread, spills and shared memory of the compiled INT2 kernel for this config."""
    from runtime_kernels.attention.triton_int2 import launch_int2_decode

    o_part = torch.empty(q.shape[0], H_Q, splits, D, device="cuda")
    lse_part = torch.empty(q.shape[0], H_Q, splits, device="cuda")
    k = launch_int2_decode(q, *pools, table, hist_len, o_part, lse_part, 1 / math.sqrt(D), splits, 0, block_n,
                           warps, stages, impl, prefetch)
    try:
        return {"n_regs": k.n_regs, "n_spills": k.n_spills, "shared_bytes": k.metadata.shared}
    except Exception as e:  # attribute names differ across Triton versions
        return {"kernel_info_error": repr(e)}


def breakdown(q, pools, table, hist_len, k_win, v_win, slot_ids, win_len, cfg) -> dict:
    """Time of each launch of the best config alone: INT2 kernel, window kernel, split reduce (ms)."""
    from runtime_kernels.attention import merge
    from runtime_kernels.attention.triton_int2 import launch_int2_decode
    from runtime_kernels.attention.triton_window import launch_window_decode

    s_h, s_w = cfg["splits"], cfg["window_splits"]
    o_part = torch.zeros(q.shape[0], H_Q, s_h + s_w, D, device="cuda")
    lse_part = torch.zeros(q.shape[0], H_Q, s_h + s_w, device="cuda")
    sc = 1 / math.sqrt(D)
    return {
        "int2": bench(lambda: launch_int2_decode(q, *pools, table, hist_len, o_part, lse_part, sc, s_h, 0,
                                                 cfg["block_n"], cfg["num_warps"], cfg["num_stages"], cfg["impl"],
                                                 cfg["prefetch"]))[0],
        "window": bench(lambda: launch_window_decode(q, k_win, v_win, slot_ids, win_len, o_part, lse_part, sc, s_w,
                                                     s_h, cfg["block_n"]))[0],
        "reduce": bench(lambda: merge.reduce_splits_triton(o_part, lse_part))[0],
    }


def run_point(batch: int, context: int, configs, copy_gbps: float, log) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    q = torch.randn(batch, H_Q, D, device="cuda", generator=gen).to(torch.bfloat16)
    row = {"batch": batch, "context": context, "history": context - WIN, "window": WIN,
           "h_q": H_Q, "h_kv": H_KV, "head_dim": D, "page": PAGE}
    row["bf16"] = sdpa_baselines(batch, context, q, gen)
    ok = [v["ms"] for v in row["bf16"].values() if "ms" in v]
    best_bf16 = min(ok) if ok else float("nan")
    row["bf16_best_ms"] = best_bf16
    row["bf16_bytes"] = batch * context * H_KV * D * 2 * 2
    pools, table, hist_len, k_win, v_win, slot_ids, win_len, allocated, read = make_int2_cache(batch, context, gen)
    row["int2_bytes_read"] = read
    row["bits_per_element_allocated"] = allocated * 8 / (batch * context * H_KV * D * 2)
    variants = []
    for impl, prefetch, block_n, stages, warps, pps in configs:
        splits = A.default_num_splits(batch, H_KV, table.shape[1] * PAGE, q.device, programs_per_sm=pps,
                                      block_n=block_n)
        wsplits = A.default_num_splits(batch, H_KV, WIN, q.device, programs_per_sm=pps, block_n=block_n)

        def fn():
            return A.decode_attention(q, *pools, table, hist_len, k_win, v_win, slot_ids, win_len,
                                      num_splits=splits, window_splits=wsplits, block_n=block_n,
                                      num_warps=warps, num_stages=stages, impl=impl, prefetch=prefetch)
        cfg = {"impl": impl, "prefetch": prefetch, "block_n": block_n, "num_stages": stages, "num_warps": warps, "programs_per_sm": pps,
               "splits": splits, "window_splits": wsplits}
        try:
            fn()
            torch.cuda.synchronize()
            med, lo, hi = bench(fn)
            cfg.update(ms=med, p20=lo, p80=hi, gbps=read / med / 1e6)
            cfg.update(kernel_info(q, pools, table, hist_len, splits, block_n, warps, stages, impl, prefetch))
        except Exception as e:
            cfg["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log(traceback.format_exc())
        variants.append(cfg)
    row["int2_variants"] = variants
    good = [v for v in variants if "ms" in v]
    best = min(good, key=lambda v: v["ms"]) if good else None
    default = good[0] if good else None
    row["int2_default"] = default
    row["int2_best"] = best
    if best:
        row["speedup_vs_bf16_best"] = best_bf16 / best["ms"]
        row["speedup_vs_bf16_default_cfg"] = best_bf16 / default["ms"]
        row["pct_of_copy_bw"] = 100 * best["gbps"] / copy_gbps
        cfg = best

        def best_fn():
            return A.decode_attention(q, *pools, table, hist_len, k_win, v_win, slot_ids, win_len,
                                      num_splits=cfg["splits"], window_splits=cfg["window_splits"],
                                      block_n=cfg["block_n"], num_warps=cfg["num_warps"],
                                      num_stages=cfg["num_stages"], impl=cfg["impl"], prefetch=cfg["prefetch"])
        row["int2_host_ms_per_call"] = host_ms(best_fn)
        row["breakdown_ms"] = breakdown(q, pools, table, hist_len, k_win, v_win, slot_ids, win_len, cfg)
    # Demotion / quantize cost: one token per sequence per step (K and V), or a page of tokens per 64 steps.
    rot = torch.linalg.qr(torch.randn(H_KV, D, D, device="cuda", generator=gen))[0]
    ratio = torch.full((H_KV,), 0.96, device="cuda")
    kc, ks, kz = pools[0], pools[1], pools[2]
    for name, t in (("per_step_1tok", batch), ("per_page_64tok", batch * PAGE)):
        x = torch.randn(t, H_KV, D, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.randint(0, kc.shape[0], (t,), device="cuda", generator=gen, dtype=torch.int32)
        rows = torch.randint(0, PAGE, (t,), device="cuda", generator=gen, dtype=torch.int32)

        def demote():
            quant.write_pages(x, rot, ratio, kc, ks, kz, ids, rows)
            quant.write_pages(x, rot, ratio, pools[3], pools[4], pools[5], ids, rows)
        try:
            med, _, _ = bench(demote)
            per_step = med if name == "per_step_1tok" else med / PAGE
            row[f"demote_{name}_ms"] = med
            row[f"demote_{name}_pct_of_attn"] = 100 * per_step / best["ms"] if best else None
        except Exception as e:
            row[f"demote_{name}_error"] = f"{type(e).__name__}: {e}"
            log(traceback.format_exc())
    for clip_mode in ("kernel", "torch"):
        from runtime_kernels.quant.triton_quant import quantize_pack_into
        from runtime_kernels.quant import naive

        x = torch.randn(batch * PAGE, H_KV, D, device="cuda", generator=gen)
        idx = naive.clip_index(ratio, D).to(torch.int32)
        ar = torch.arange(x.shape[0], device="cuda", dtype=torch.int32)
        c = torch.empty(x.shape[0], H_KV, 1, D // 4, dtype=torch.uint8, device="cuda")
        s = torch.empty(x.shape[0], H_KV, 1, 1, dtype=torch.float16, device="cuda")
        z = torch.empty_like(s)
        try:
            med, _, _ = bench(lambda: quantize_pack_into(x, idx, c, s, z, ar, ar * 0, D, clip_mode=clip_mode))
            row[f"quant_page_clip_{clip_mode}_ms"] = med
        except Exception as e:
            row[f"quant_page_clip_{clip_mode}_error"] = f"{type(e).__name__}: {e}"
    o = torch.randn(batch, H_Q, D, device="cuda", generator=gen)
    row["rotate_q_ms"] = bench(lambda: A.rotate_queries(q, rot))[0]
    row["unrotate_o_ms"] = bench(lambda: A.unrotate_output(o, rot))[0]
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Decode attention benchmark ({meta['gpu']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; Qwen3-8B geometry "
             f"(H_q={H_Q}, H_kv={H_KV}, d={D}), page {PAGE}, window {WIN} BF16 tokens (sink {SINK} + recent "
             f"{RECENT}). Times: median of `triton.testing.do_bench` (L2 flushed), ms; p20-p80 in the JSON.",
             f"Copy bandwidth in the same run: **{meta['copy']['gbps']:.0f} GB/s** (read+write of 1 GiB).", "",
             "| context | batch | BF16 best (ms) | BF16 backend | INT2 best (ms) | speedup | INT2 GB/s | % copy BW "
             "| default cfg (ms) | best cfg (impl/prefetch/block_n/stages/warps/pps/splits) | host ms/call | bits/elem |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bf = {k: v["ms"] for k, v in r["bf16"].items() if "ms" in v}
        name = min(bf, key=bf.get) if bf else "-"
        b, dft = r.get("int2_best"), r.get("int2_default")
        if not b:
            lines.append(f"| {r['context']} | {r['batch']} | {r['bf16_best_ms']:.4f} | {name} | error | | | | | | | |")
            continue
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['bf16_best_ms']:.4f} | {name} | {b['ms']:.4f} | "
            f"{r['speedup_vs_bf16_best']:.2f}x | {b['gbps']:.0f} | {r['pct_of_copy_bw']:.0f}% | {dft['ms']:.4f} | "
            f"{b['impl']}/{int(b['prefetch'])}/{b['block_n']}/{b['num_stages']}/{b['num_warps']}/{b['programs_per_sm']}/{b['splits']} | "
            f"{r.get('int2_host_ms_per_call', float('nan')):.4f} | {r['bits_per_element_allocated']:.3f} |")
    lines += ["", "Demotion (write_pages of K and V, rotation included) and rotation costs, vs the INT2 call:", "",
              "| context | batch | 1 token/seq per step (ms) | % of attn | 64 tokens/seq per 64 steps (ms, per step %) "
              "| quantize page, in-kernel sort (ms) | quantize page, torch sort (ms) | rotate q (ms) | unrotate o (ms) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda k: (f"{r[k]:.4f}" if isinstance(r.get(k), float) else "-")  # noqa: E731
        p = lambda k: (f"{r[k]:.1f}%" if isinstance(r.get(k), float) else "-")  # noqa: E731
        lines.append(f"| {r['context']} | {r['batch']} | {f('demote_per_step_1tok_ms')} | "
                     f"{p('demote_per_step_1tok_pct_of_attn')} | {f('demote_per_page_64tok_ms')} "
                     f"({p('demote_per_page_64tok_pct_of_attn')}) | {f('quant_page_clip_kernel_ms')} | "
                     f"{f('quant_page_clip_torch_ms')} | {f('rotate_q_ms')} | {f('unrotate_o_ms')} |")
    lines += ["", "BF16 SDPA backends (ms; `fold` = GQA group folded into the query length):", ""]
    keys = sorted({k for r in rows for k in r["bf16"]})
    lines += ["| context | batch | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r['bf16'][k]['ms']:.4f}" if "ms" in r["bf16"].get(k, {}) else "n/a" for k in keys]
        lines.append(f"| {r['context']} | {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true", help="two points and two configs (smoke test)")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode: needs a CUDA device")
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "decode_errors.log")
    log = lambda s: open(log_path, "a").write(s + "\n")  # noqa: E731
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quantiles": QUANTILES}
    meta["copy"] = copy_bandwidth()
    print(f"{gpu}: copy {meta['copy']['gbps']:.0f} GB/s", flush=True)
    # First config = the library default; the rest are the sweep.
    # (impl, prefetch, block_n, num_stages, num_warps, programs_per_sm); the first is the library default.
    configs = [(0, False, 64, 2, 4, 4), (0, False, 64, 3, 4, 8), (1, False, 64, 3, 4, 8)]
    configs += list(itertools.product((0, 2), (True,), (64,), (1, 2), (4,), (4, 8)))
    configs += [(0, True, 32, 1, 4, 8), (0, True, 32, 1, 4, 16), (2, True, 32, 1, 4, 16), (0, True, 64, 1, 8, 8),
                (2, True, 64, 1, 8, 8), (0, True, 128, 1, 4, 8)]
    # Largest context first (the 128K / batch 8 target point leads), so a cut-short run still has it.
    contexts = sorted(map(int, args.contexts.split(",")), reverse=True)
    batches = [int(b) for b in args.batches.split(",")]
    batches = sorted(batches, key=lambda b: (b != 8, b))
    points = [(b, c) for c in contexts for b in batches]
    if args.quick:
        configs = configs[:2]
        points = [(1, 8192), (8, 32768)]
    rows = []
    for batch, context in points:
        t0 = time.time()
        r = run_point(batch, context, configs, meta["copy"]["gbps"], log)
        rows.append(r)
        torch.cuda.empty_cache()
        b = r.get("int2_best") or {}
        print(f"ctx {context:>6} B {batch:>2}: bf16 {r['bf16_best_ms']:.4f} ms  int2 {b.get('ms', float('nan')):.4f} ms "
              f"({r.get('speedup_vs_bf16_best', float('nan')):.2f}x, {b.get('gbps', float('nan')):.0f} GB/s, "
              f"{r.get('pct_of_copy_bw', float('nan')):.0f}% copy)  [{time.time() - t0:.0f}s]", flush=True)
        write_results(args.out, meta, rows)  # after every point: a cut-short run keeps what it measured
    print(markdown(meta, rows))


def write_results(out: str, meta: dict, rows: list[dict]) -> None:
    tag = meta["gpu"].replace(" ", "_").replace("/", "_")
    with open(os.path.join(out, f"decode_{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out, f"decode_{tag}.md"), "w") as f:
        f.write(markdown(meta, rows))


if __name__ == "__main__":
    main()
