"""Decode attention benchmark: INT2 history + BF16 window (Triton) vs BF16 SDPA (flash, cuDNN), on one GPU.

Geometry of Qwen3-8B (32 query heads, 8 KV heads, head_dim 128); contexts 8K/32K/128K; batch 1/8/32.
Per point: median time per decode attention call (`triton.testing.do_bench`, quantiles [0.5, 0.2, 0.8], L2
flushed before each call), achieved bandwidth (bytes of packed codes + scales + BF16 windows read / time),
the best BF16 SDPA backend in the same run, a device-to-device copy bandwidth measured in the same run, the
quantize/demotion cost per step, the query rotation / output un-rotation cost, and allocated bits per element.

    python3 bench/bench_decode.py --out bench/results --quick    # compare mode (default), ~2-3 minutes
    python3 bench/bench_decode.py --out bench/results --full     # the v3 sweep + demotion/rotation costs (slow)
    python3 bench/bench_decode.py --full --smoke                  # two points, for a smoke test
Compare mode (default) writes `decode_cmp_<gpu>.{json,md}`: the v3 kernel's best configs vs the bitcast-code
kernel (impl 3/4) configs at every point, each checked against v3's output and, on a small batch, against the torch
reference. `--full` writes `decode_<gpu>.{json,md}`. Errors (tracebacks) go to `decode_errors.log`.
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
from runtime_kernels.attention.triton_int2 import alloc_paired_v_pools  # noqa: E402

H_Q, H_KV, D, PAGE, SINK, RECENT = 32, 8, 128, 64, 64, 256
WIN = SINK + RECENT
QUANTILES = [0.5, 0.2, 0.8]
DEV = "cuda"


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
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    med, lo, hi = bench(lambda: dst.copy_(src), rep=200)
    return {"bytes": 2 * n, "ms": med, "gbps": 2 * n / med / 1e6, "note": "read + write bytes of a 1 GiB copy"}


def int2_history_bytes(tokens: int) -> int:
    """Bytes of `tokens` INT2 history tokens (all sequences together): codes + fp16 scale and zero, K and V."""
    return tokens * H_KV * 2 * (D // 4 + 2 * 2)


def make_int2_cache(batch: int, context: int, gen: torch.Generator, page: int = PAGE, layout: str = "separate",
                    order: str = "scattered"):
    """Paged INT2 pools (random bytes, plausible fp16 scales) + BF16 windows for `batch` sequences of `context`:
    `context - WIN` history tokens rounded down to whole pages of `page` tokens (PagedKVCache only demotes whole
    pages).

    layout: "separate" (six contiguous pools, as `PagedKVCache` allocates them at several groups per row),
    "scales" (the four scale/zero vectors of a (page, KV head) side by side in one `[pages, H, 4, P]` fp16 buffer),
    "tile" (codes and scales of a (page, KV head) in one contiguous block of `P * (2 * d/4 + 8)` bytes) or "vpair"
    (V scale and zero of each row side by side, one `[pages, H, P, 2]` buffer, which the whole-page loop reads in one
    load: `triton_int2.V_PAIRED_POOLS`; what `PagedKVCache` allocates at one group per row); all but the first are
    views with other strides. order: "scattered" (pages of a sequence at random pool slots, as a paged allocator
    leaves them) or "ordered" (consecutive slots)."""
    hist = (context - WIN) // page * page
    pages_per_seq = -(-hist // page)
    n_pages = batch * pages_per_seq
    dev = DEV
    cb = page * (D // 4)  # code bytes of one (page, KV head)

    if layout not in ("separate", "scales", "tile", "vpair"):
        raise ValueError(f"make_int2_cache: layout {layout!r}: expected 'separate', 'scales', 'tile' or 'vpair'")
    if layout == "tile":
        blk = torch.randint(0, 256, (n_pages, H_KV, 2 * cb + 8 * page), dtype=torch.uint8, device=dev, generator=gen)
        kc = blk[:, :, :cb].view(n_pages, H_KV, page, D // 4)
        vc = blk[:, :, cb:2 * cb].view(n_pages, H_KV, page, D // 4)
        sc = blk[:, :, 2 * cb:].view(torch.float16).view(n_pages, H_KV, 4, page)
    else:
        kc, vc = (torch.randint(0, 256, (n_pages, H_KV, page, D // 4), dtype=torch.uint8, device=dev, generator=gen)
                  for _ in range(2))
        sc = torch.empty(n_pages, H_KV, 4, page, dtype=torch.float16, device=dev) if layout == "scales" else None
    if layout == "vpair":  # V scale and zero of a row side by side (`triton_int2.V_PAIRED_POOLS`)
        ks, kz = (torch.empty(n_pages, H_KV, page, 1, dtype=torch.float16, device=dev) for _ in range(2))
        vs, vz = alloc_paired_v_pools(n_pages, H_KV, page, dev, zeros=False)
    elif sc is None:
        ks, kz, vs, vz = (torch.empty(n_pages, H_KV, page, 1, dtype=torch.float16, device=dev) for _ in range(4))
    else:
        ks, kz, vs, vz = (sc[:, :, i, :, None] for i in range(4))
    ks.copy_(torch.rand(ks.shape, device=dev, generator=gen) * 0.5 + 0.1)
    vs.copy_(torch.rand(vs.shape, device=dev, generator=gen) * 0.5 + 0.1)
    kz.copy_(torch.rand(kz.shape, device=dev, generator=gen) * 3)
    vz.copy_(torch.rand(vz.shape, device=dev, generator=gen) * 3)
    if order == "scattered":  # pages of a sequence scattered over the pool, as a paged allocator would leave them
        table = torch.randperm(n_pages, device=dev, generator=gen)
    elif order == "ordered":
        table = torch.arange(n_pages, device=dev)
    else:
        raise ValueError(f"make_int2_cache: order {order!r}: expected 'scattered' or 'ordered'")
    table = table.reshape(batch, pages_per_seq).to(torch.int32)
    hist_len = torch.full((batch,), hist, dtype=torch.int32, device=dev)
    k_win = torch.randn(batch, H_KV, WIN, D, device=dev, generator=gen).to(torch.bfloat16)
    v_win = torch.randn(batch, H_KV, WIN, D, device=dev, generator=gen).to(torch.bfloat16)
    slot_ids = torch.randperm(batch, device=dev, generator=gen).to(torch.int32)
    win_len = torch.full((batch,), WIN, dtype=torch.int32, device=dev)
    pools = (kc, ks, kz, vc, vs, vz)
    allocated = sum(t.numel() * t.element_size() for t in pools + (k_win, v_win))  # the same in every layout
    read = int2_history_bytes(batch * hist) + batch * WIN * H_KV * D * 2 * 2
    return pools, table, hist_len, k_win, v_win, slot_ids, win_len, allocated, read


def sdpa_baselines(batch: int, context: int, q: torch.Tensor, gen: torch.Generator,
                   names=("flash", "cudnn", "efficient"), gqa_modes=("fold", "enable_gqa")) -> dict:
    """BF16 SDPA over the full context, each backend that runs; GQA by folding the group into the query length
    (exact for one decode query: all g heads see all keys) and by enable_gqa."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = torch.randn(batch, H_KV, context, D, device=DEV, generator=gen).to(torch.bfloat16)
    v = torch.randn(batch, H_KV, context, D, device=DEV, generator=gen).to(torch.bfloat16)
    g = H_Q // H_KV
    q_fold = q.reshape(batch, H_KV, g, D)  # [B, H_kv, g, d]
    q_gqa = q.reshape(batch, H_Q, 1, D)
    out = {}
    import warnings

    warnings.filterwarnings("ignore", message=".*kernel not used.*|.*same num_heads.*|.*runtime disabled.*")
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        if name not in names:
            continue
        for gqa in gqa_modes:
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

    o_part = torch.empty(q.shape[0], H_Q, splits, D, device=DEV)
    lse_part = torch.empty(q.shape[0], H_Q, splits, device=DEV)
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
    o_part = torch.zeros(q.shape[0], H_Q, s_h + s_w, D, device=DEV)
    lse_part = torch.zeros(q.shape[0], H_Q, s_h + s_w, device=DEV)
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
    gen = torch.Generator(device=DEV).manual_seed(batch * 7 + context)
    q = torch.randn(batch, H_Q, D, device=DEV, generator=gen).to(torch.bfloat16)
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
                                      block_n=block_n, min_tokens=block_n)  # v3 split rule
        wsplits = A.default_num_splits(batch, H_KV, WIN, q.device, programs_per_sm=pps, block_n=block_n,
                                       min_tokens=block_n)

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
    rot = torch.linalg.qr(torch.randn(H_KV, D, D, device=DEV, generator=gen))[0]
    ratio = torch.full((H_KV,), 0.96, device=DEV)
    kc, ks, kz = pools[0], pools[1], pools[2]
    for name, t in (("per_step_1tok", batch), ("per_page_64tok", batch * PAGE)):
        x = torch.randn(t, H_KV, D, device=DEV, generator=gen).to(torch.bfloat16)
        ids = torch.randint(0, kc.shape[0], (t,), device=DEV, generator=gen, dtype=torch.int32)
        rows = torch.randint(0, PAGE, (t,), device=DEV, generator=gen, dtype=torch.int32)

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

        x = torch.randn(batch * PAGE, H_KV, D, device=DEV, generator=gen)
        ar = torch.arange(x.shape[0], device=DEV, dtype=torch.int32)
        c = torch.empty(x.shape[0], H_KV, 1, D // 4, dtype=torch.uint8, device=DEV)
        s = torch.empty(x.shape[0], H_KV, 1, 1, dtype=torch.float16, device=DEV)
        z = torch.empty_like(s)
        try:
            med, _, _ = bench(lambda: quantize_pack_into(x, ratio, c, s, z, ar, ar * 0, D, clip_mode=clip_mode))
            row[f"quant_page_clip_{clip_mode}_ms"] = med
        except Exception as e:
            row[f"quant_page_clip_{clip_mode}_error"] = f"{type(e).__name__}: {e}"
    o = torch.randn(batch, H_Q, D, device=DEV, generator=gen)
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


# ------------------------------------------------------------------------------------------ compare mode
# Named INT2 configurations: impl, num_warps, block_n, num_stages, programs_per_sm, min_tokens (chunk floor of the
# split rule; 64 = the v3 rule). "v3_*" are the best of the v3 sweep (bench/results/decode_NVIDIA_H200.md);
# "new_default" is the library default (attention.INT2_IMPL, INT2_NUM_WARPS, 64, 3 stages, INT2_PROGRAMS_PER_SM,
# floor MIN_SPLIT_TOKENS), read from the library so that the bench always times what users get.
COMPARE_CONFIGS = [
    ("v3_impl0", 0, 4, 64, 3, 8, 64),
    ("v3_impl1", 1, 4, 64, 3, 8, 64),
    ("new_default", A.INT2_IMPL, A.INT2_NUM_WARPS, A.BLOCK_N, 3, 0, A.MIN_SPLIT_TOKENS),  # 0: the library's rule
    ("impl4_w4_floor64", 4, 4, 64, 3, 8, 64),
    ("impl4_w2", 4, 2, 64, 3, 8, 256),
    ("impl4_w2_n32", 4, 2, 32, 3, 8, 256),
    ("impl4_w1", 4, 1, 64, 3, 16, 256),
    ("impl4_w1_n32", 4, 1, 32, 3, 16, 256),
    ("impl4_w4_exactK", 4, 4, 64, 3, 8, 256),  # K offset subtracted exactly instead of folded (FOLD_K_OFFSET)
    ("impl3_w4", 3, 4, 64, 3, 8, 256),
    ("impl3_w1", 3, 1, 64, 3, 16, 256),
    # impl 5: tokens on the MMA rows, lop3 codes (`_int2_decode_kernel_t`); 127 registers at 1 warp, so 16 programs
    # per SM are all resident (impl4_w1 had 252: 8 resident). "_vfold": V offset subtracted after a fresh dot.
    ("impl5_w1", 5, 1, 64, 3, 16, 256),
    ("impl5_w1_p32", 5, 1, 64, 3, 32, 256),
    ("impl5_w1_vfold", 5, 1, 64, 3, 16, 256),
    # "_chain": the V dot accumulates onto the chunk accumulator inside the MMA (before IMPL5_TILE_ACC).
    ("impl5_w1_chain", 5, 1, 64, 3, 16, 256),
    ("impl5_w1_p32_chain", 5, 1, 64, 3, 32, 256),
    ("impl5_w1_s2", 5, 1, 64, 2, 16, 256),
    ("impl5_w2", 5, 2, 64, 3, 8, 256),
    ("impl5_w4", 5, 4, 64, 3, 8, 256),
    # impl 6: impl 5 with the codes as exact fp16 subnormals (no code offset to subtract or fold).
    ("impl6_w1", 6, 1, 64, 3, 16, 256),
    ("impl6_w1_p32", 6, 1, 64, 3, 32, 256),
    ("impl6_w1_p24", 6, 1, 64, 3, 24, 256),
    ("impl6_w1_s2", 6, 1, 64, 2, 32, 256),
    ("impl6_w1_s4", 6, 1, 64, 4, 32, 256),
]
OLD = {"v3_impl0", "v3_impl1"}


def _cfg_dict(c) -> dict:
    name, impl, warps, block_n, stages, pps, floor = c
    return {"name": name, "impl": impl, "num_warps": warps, "block_n": block_n, "num_stages": stages,
            "programs_per_sm": pps, "min_tokens": floor, "prefetch": False, "fold_k": not name.endswith("exactK"),
            "vfold": name.endswith("_vfold"), "tile_acc": not name.endswith("_chain")}


def _set_fold(cfg: dict) -> None:
    """The K-offset fold (impl 3/4) and the V-offset fold (impl 5) are module switches of the kernel launcher (read at
    every launch)."""
    from runtime_kernels.attention import triton_int2

    triton_int2.FOLD_K_OFFSET = cfg.get("fold_k", True)
    triton_int2.IMPL5_VFOLD = cfg.get("vfold", False)
    triton_int2.IMPL5_TILE_ACC = cfg.get("tile_acc", True)


def _err(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {(lines[-1] if lines else '')[:300]}"


EXACT_ROWS = 2  # sequences checked against float64 at every point
EXACT_TOL = 1e-2


def exact_decode(q, pools, table, hist_len, k_win, v_win, slot_ids, win_len, rows: int):
    """float64 decode attention (INT2 history dequantized + window) of the first `rows` sequences:
    o `[rows, H_q, d]`, lse `[rows, H_q]` (float64)."""
    from runtime_kernels.attention import paged_ref

    kc, ks, kz, vc, vs, vz = pools
    g = q.shape[1] // kc.shape[1]
    outs, lses = [], []
    for i in range(min(rows, q.shape[0])):
        n = int(hist_len[i])
        slot, w = int(slot_ids[i]), int(win_len[i])
        k = torch.cat([paged_ref.gather_history(kc, ks, kz, table[i], n).double(),
                       k_win[slot, :, :w].double()], dim=1)  # [H_kv, n + w, d]
        v = torch.cat([paged_ref.gather_history(vc, vs, vz, table[i], n).double(),
                       v_win[slot, :, :w].double()], dim=1)
        qi = q[i].double().reshape(kc.shape[1], g, -1)  # [H_kv, g, d]
        s = torch.einsum("hgd,hnd->hgn", qi, k) / math.sqrt(q.shape[2])
        lse = torch.logsumexp(s, dim=2)
        outs.append(torch.einsum("hgn,hnd->hgd", torch.exp(s - lse[..., None]), v).reshape(q.shape[1], -1))
        lses.append(lse.reshape(-1))
        del k, v, s
    return torch.stack(outs), torch.stack(lses)


def reference_check(log) -> dict:
    """Each compare impl vs the torch reference (`paged_ref`) on a small mixed batch in Qwen3-8B geometry (bf16 q):
    relative RMSE of o, max |lse| error. Catches a wrong kernel before its time is reported."""
    from runtime_kernels.attention import paged_ref
    from runtime_kernels.quant import naive

    gen = torch.Generator(device=DEV).manual_seed(11)
    lens = [0, 1, 63, 257, 4099, 20000]
    n_pages = len(lens) * (-(-max(lens) // PAGE)) + 1
    pools = []
    for _ in range(2):
        x = torch.randn(n_pages * PAGE, H_KV, D, device=DEV, generator=gen)
        c, sc, z = naive.quantize_pack(x, None, None, D)
        pools += [t.reshape(n_pages, PAGE, H_KV, -1).transpose(1, 2).contiguous() for t in (c, sc, z)]
    pools = pools[0:3] + pools[3:6]
    table = torch.randperm(n_pages, device=DEV, generator=gen)[: len(lens) * (n_pages // len(lens))]
    table = table.reshape(len(lens), -1).to(torch.int32)
    hist = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(len(lens), H_Q, D, device=DEV, generator=gen).to(dtype)
        o_ref, lse_ref = paged_ref.int2_decode_attention_ref(q, *pools, table, hist)
        fin = torch.isfinite(lse_ref)
        for impl, fold, vfold in ((0, True, False), (3, True, False), (4, True, False), (4, False, False),
                                  (5, True, False), (5, True, True), (6, True, False)):
            key = f"impl{impl}{'' if fold else '_exactK'}{'_vfold' if vfold else ''}_{str(dtype).replace('torch.', '')}"
            if not fold and dtype != torch.bfloat16:
                continue  # the fold exists for bf16 queries only
            try:
                _set_fold({"fold_k": fold, "vfold": vfold})
                o, lse = A.int2_decode_attention(q, *pools, table, hist, impl=impl)
                torch.cuda.synchronize()
                err = ((o - o_ref).pow(2).mean().sqrt() / o_ref.pow(2).mean().sqrt()).item()
                lse_err = (lse[fin] - lse_ref[fin]).abs().max().item()
                same_inf = bool(torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)))
                out[key] = {"rel_rmse": err, "lse_max_abs_err": lse_err, "empty_rows_ok": same_inf,
                            "ok": err < 2e-2 and lse_err < 2e-2 and same_inf}
            except Exception as e:  # a variant that does not compile is recorded, the others still run
                out[key] = {"error": _err(e), "ok": False}
                log(traceback.format_exc())
    _set_fold({})
    return out


def run_point_compare(batch: int, context: int, configs: list[dict], copy_gbps: float, log) -> dict:
    """One (context, batch) point: BF16 SDPA (cuDNN and flash, enable_gqa), then every INT2 config through the full
    `decode_attention` call (INT2 kernel + window kernel + split reduce), each checked against v3_impl0's output;
    the per-launch breakdown and host time of the old and the new best."""
    gen = torch.Generator(device=DEV).manual_seed(batch * 7 + context)
    q = torch.randn(batch, H_Q, D, device=DEV, generator=gen).to(torch.bfloat16)
    row = {"batch": batch, "context": context, "history": context - WIN, "window": WIN,
           "h_q": H_Q, "h_kv": H_KV, "head_dim": D, "page": PAGE}
    row["bf16"] = sdpa_baselines(batch, context, q, gen, names=("flash", "cudnn"), gqa_modes=("enable_gqa",))
    ok = {k: v["ms"] for k, v in row["bf16"].items() if "ms" in v}
    row["bf16_best_ms"] = min(ok.values()) if ok else float("nan")
    row["bf16_best_backend"] = min(ok, key=ok.get) if ok else None
    row["bf16_bytes"] = batch * context * H_KV * D * 2 * 2
    torch.cuda.empty_cache()
    pools, table, hist_len, k_win, v_win, slot_ids, win_len, allocated, read = make_int2_cache(batch, context, gen)
    row["int2_bytes_read"] = read
    row["int2_floor_ms_at_copy_bw"] = read / copy_gbps / 1e6
    row["bits_per_element_allocated"] = allocated * 8 / (batch * context * H_KV * D * 2)
    ref_o = None
    exact_o, exact_lse = exact_decode(q, pools, table, hist_len, k_win, v_win, slot_ids, win_len, EXACT_ROWS)
    variants = []
    for c in configs:
        cfg = dict(c)
        if cfg["programs_per_sm"]:
            cfg["splits"] = A.default_num_splits(batch, H_KV, table.shape[1] * PAGE, q.device,
                                                 programs_per_sm=cfg["programs_per_sm"], block_n=cfg["block_n"],
                                                 min_tokens=cfg["min_tokens"])
        else:  # the library's split rule (whole waves for impl 5/6)
            _set_fold(cfg)
            cfg["splits"] = A.int2_num_splits(q, *pools, table, hist_len, cfg["block_n"], cfg["num_warps"],
                                              cfg["num_stages"], cfg["impl"])
        cfg["window_splits"] = A.default_num_splits(batch, H_KV, WIN, q.device,
                                                    programs_per_sm=cfg["programs_per_sm"] or 8,
                                                    block_n=cfg["block_n"], min_tokens=cfg["block_n"])

        def fn(cfg=cfg):
            _set_fold(cfg)
            return A.decode_attention(q, *pools, table, hist_len, k_win, v_win, slot_ids, win_len,
                                      num_splits=cfg["splits"], window_splits=cfg["window_splits"],
                                      block_n=cfg["block_n"], num_warps=cfg["num_warps"],
                                      num_stages=cfg["num_stages"], impl=cfg["impl"], prefetch=False)
        try:
            o, lse = fn()
            torch.cuda.synchronize()
            if ref_o is None and cfg["name"] == "v3_impl0":
                ref_o, ref_lse = o, lse
            if ref_o is not None:
                cfg["rel_rmse_vs_v3_impl0"] = ((o - ref_o).pow(2).mean().sqrt()
                                               / ref_o.pow(2).mean().sqrt()).item()
                cfg["lse_max_diff_vs_v3_impl0"] = (lse - ref_lse).abs().max().item()
            # Correct = close to the float64 answer (not to v3, whose chained tensor-core accumulator is itself off
            # by up to ~1e-2 on this cancelling data at 26K-token chunks).
            n = exact_o.shape[0]
            cfg["rel_rmse_vs_exact"] = ((o[:n].double() - exact_o).pow(2).mean().sqrt()
                                        / exact_o.pow(2).mean().sqrt()).item()
            cfg["lse_max_diff_vs_exact"] = (lse[:n].double() - exact_lse).abs().max().item()
            cfg["correct"] = (bool(torch.isfinite(o).all()) and cfg["rel_rmse_vs_exact"] < EXACT_TOL
                              and cfg["lse_max_diff_vs_exact"] < 1e-2)
            med, lo, hi = bench(fn)
            cfg.update(ms=med, p20=lo, p80=hi, gbps=read / med / 1e6, pct_copy_bw=100 * read / med / 1e6 / copy_gbps,
                       speedup_vs_bf16=row["bf16_best_ms"] / med)
            _set_fold(cfg)
            cfg.update(kernel_info(q, pools, table, hist_len, cfg["splits"], cfg["block_n"], cfg["num_warps"],
                                   cfg["num_stages"], cfg["impl"], False))
        except Exception as e:  # compile or launch failure: recorded, the other configs still run
            cfg["error"] = _err(e)
            log(f"--- {context}/{batch} {cfg['name']}\n" + traceback.format_exc())
        variants.append(cfg)
        print(f"    {cfg['name']:<18} " + (f"{cfg['ms']:.4f} ms {cfg['gbps']:.0f} GB/s"
                                           f" err {cfg.get('rel_rmse_vs_exact', float('nan')):.1e}"
                                           f"{'' if cfg.get('correct') else '  WRONG'}" if "ms" in cfg
                                           else f"ERROR {cfg.get('error', '')[:120]}"), flush=True)
    row["int2_variants"] = variants
    good = [v for v in variants if "ms" in v and v.get("correct")]
    old = [v for v in good if v["name"] in OLD]
    new = [v for v in good if v["name"] not in OLD]
    row["old_best"] = min(old, key=lambda v: v["ms"]) if old else None
    row["new_best"] = min(new, key=lambda v: v["ms"]) if new else None
    row["new_default"] = next((v for v in good if v["name"] == "new_default"), None)
    for key in ("old_best", "new_best"):
        b = row[key]
        if not b:
            continue
        try:
            def best_fn(b=b):
                _set_fold(b)
                return A.decode_attention(q, *pools, table, hist_len, k_win, v_win, slot_ids, win_len,
                                          num_splits=b["splits"], window_splits=b["window_splits"],
                                          block_n=b["block_n"], num_warps=b["num_warps"],
                                          num_stages=b["num_stages"], impl=b["impl"], prefetch=False)
            row[f"{key}_host_ms_per_call"] = host_ms(best_fn, n=20)
            _set_fold(b)
            row[f"{key}_breakdown_ms"] = breakdown(q, pools, table, hist_len, k_win, v_win, slot_ids, win_len, b)
        except Exception as e:
            row[f"{key}_breakdown_error"] = _err(e)
    if row["old_best"] and row["new_best"]:
        row["new_vs_old_speedup"] = row["old_best"]["ms"] / row["new_best"]["ms"]
    _set_fold({})
    return row


def markdown_compare(meta: dict, rows: list[dict]) -> str:
    f = lambda x, n=4: "-" if x is None else f"{x:.{n}f}"  # noqa: E731
    lines = [f"# INT2 decode attention: v3 kernel vs bitcast-code kernel ({meta['gpu']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; Qwen3-8B geometry (H_q={H_Q}, "
             f"H_kv={H_KV}, d={D}), page {PAGE}, window {WIN} BF16 tokens. Full decode call (INT2 kernel + window "
             f"kernel + split reduce); `do_bench` medians, L2 flushed, ms. Copy bandwidth in the same run: "
             f"**{meta['copy']['gbps']:.0f} GB/s**. Bench wall time {meta.get('wall_s', 0):.0f} s.", "",
             "Reference check (small mixed batch vs torch `paged_ref`): " + ", ".join(
                 f"{k}: " + (f"rmse {v['rel_rmse']:.1e} lse {v['lse_max_abs_err']:.1e}" if "rel_rmse" in v
                             else "ERROR") + ("" if v.get("ok") else " (FAIL)")
                 for k, v in meta.get("reference_check", {}).items()), "",
             "| context | batch | BF16 best (ms) | old best (ms) | old cfg | new best (ms) | new cfg | new GB/s "
             "| new % copy | new vs BF16 | new vs old | new default (ms) | floor (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['context']} | {r['batch']} | {r.get('skipped') or r.get('error')} |" + " |" * 11)
            continue
        o, n, dft = r.get("old_best"), r.get("new_best"), r.get("new_default")
        lines.append(
            f"| {r['context']} | {r['batch']} | {f(r['bf16_best_ms'])} | {f(o and o['ms'])} | {o and o['name'] or '-'} "
            f"| {f(n and n['ms'])} | {n and n['name'] or '-'} | {f(n and n['gbps'], 0)} | "
            f"{f(n and n['pct_copy_bw'], 0)}% | {f(n and n['speedup_vs_bf16'], 2)}x | "
            f"{f(r.get('new_vs_old_speedup'), 2)}x | {f(dft and dft['ms'])} | {f(r['int2_floor_ms_at_copy_bw'])} |")
    ran = {v["name"] for r in rows for v in r.get("int2_variants", [])}
    names = [c[0] for c in COMPARE_CONFIGS if c[0] in ran]
    lines += ["", "Every config (ms; e = relative RMSE of o vs float64 on the first sequences; `WRONG` = e > 1e-2 or lse off by > 1e-2; r = registers per thread):",
              "", "| context | batch | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in rows:
        by = {v["name"]: v for v in r.get("int2_variants", [])}
        cells = []
        for nm in names:
            v = by.get(nm)
            if v is None:
                cells.append("-")
            elif "ms" in v:
                cells.append(f"{v['ms']:.4f}" + ("" if v.get("correct") else " WRONG")
                             + (f" ({v['n_regs']}r" if "n_regs" in v else " (")
                             + (f", e {v['rel_rmse_vs_exact']:.1e})" if "rel_rmse_vs_exact" in v else ")"))
            else:
                cells.append("error")
        lines.append(f"| {r['context']} | {r['batch']} | " + " | ".join(cells) + " |")
    lines += ["", "Per-launch breakdown (ms, each launch alone) and host time per call:", "",
              "| context | batch | which | int2 kernel | window | reduce | splits | host ms/call |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for key in ("old_best", "new_best"):
            b, br = r.get(key), r.get(f"{key}_breakdown_ms")
            if b and br:
                lines.append(f"| {r['context']} | {r['batch']} | {key} ({b['name']}) | {br['int2']:.4f} | "
                             f"{br['window']:.4f} | {br['reduce']:.4f} | {b['splits']}+{b['window_splits']} | "
                             f"{f(r.get(key + '_host_ms_per_call'))} |")
    errs = {(r["context"], r["batch"], v["name"]): v["error"] for r in rows for v in r.get("int2_variants", [])
            if "error" in v}
    if errs:
        lines += ["", "Errors:", ""] + [f"- {k}: `{e}`" for k, e in list(errs.items())[:12]]
    return "\n".join(lines) + "\n"


def main_compare(args, meta, log) -> None:
    """Default mode: old (v3) vs new INT2 configs at every point, BF16 baselines, copy bandwidth; stops adding
    points once `--budget-s` is spent (the 128K / batch 8 target point runs first)."""
    from runtime_kernels.attention import triton_int2

    triton_int2.strict_impl(True)  # impl 4 must not silently become impl 3 here
    t_start = time.time()
    meta["reference_check"] = reference_check(log)
    print("reference check:", {k: (round(v["rel_rmse"], 5) if "rel_rmse" in v else v.get("error"))
                               for k, v in meta["reference_check"].items()}, flush=True)
    configs = [_cfg_dict(c) for c in COMPARE_CONFIGS]
    if args.configs:
        keep = set(args.configs.split(","))
        configs = [c for c in configs if c["name"] in keep or c["name"] in ("v3_impl0", "new_default")]
    contexts = sorted(map(int, args.contexts.split(",")), reverse=True)
    batches = sorted((int(b) for b in args.batches.split(",")), key=lambda b: (b != 8, b))
    points = [(b, c) for c in contexts for b in batches]
    points = [(8, 131072)] + [p for p in points if p != (8, 131072)] if (8, 131072) in points else points
    if args.only_points:
        want = [tuple(int(x) for x in p.lower().split("x")) for p in args.only_points.split(",")]  # CONTEXTxBATCH
        points = [(b, c) for c, b in want]
    rows = []
    for batch, context in points:
        t0 = time.time()
        if t0 - t_start > args.budget_s:
            rows.append({"batch": batch, "context": context, "skipped": "time budget spent"})
            continue
        print(f"ctx {context} B {batch}:", flush=True)
        try:
            r = run_point_compare(batch, context, configs, meta["copy"]["gbps"], log)
        except Exception as e:  # e.g. out of memory at one point: record it, keep going
            r = {"batch": batch, "context": context, "error": _err(e)}
            log(traceback.format_exc())
        rows.append(r)
        torch.cuda.empty_cache()
        o, n = r.get("old_best") or {}, r.get("new_best") or {}
        print(f"  => bf16 {r.get('bf16_best_ms', float('nan')):.4f}  old {o.get('ms', float('nan')):.4f} "
              f"({o.get('name')})  new {n.get('ms', float('nan')):.4f} ({n.get('name')}, "
              f"{n.get('pct_copy_bw', float('nan')):.0f}% copy, {n.get('speedup_vs_bf16', float('nan')):.2f}x bf16)  "
              f"[{time.time() - t0:.0f}s]", flush=True)
        meta["wall_s"] = time.time() - t_start
        write_results(args.out, meta, rows, prefix="decode_cmp", md=markdown_compare)
    print(markdown_compare(meta, rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true",
                    help="compare mode (also the default): v3 vs new INT2 configs, BF16, copy BW; ~2-3 minutes")
    ap.add_argument("--full", action="store_true",
                    help="the v3 sweep with demotion/rotation costs and every SDPA backend (slow)")
    ap.add_argument("--smoke", action="store_true", help="with --full: two points and two configs")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--configs", default="", help="compare mode: comma-separated config names to keep")
    ap.add_argument("--only-points", default="",
                    help="compare mode: comma-separated CONTEXTxBATCH points, run in this order (overrides "
                         "--contexts/--batches), e.g. 131072x8,131072x32,32768x8")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="compare mode: start no new point after this many seconds")
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
    if not args.full:
        main_compare(args, meta, log)
        return
    # --full: the v3 sweep. (impl, prefetch, block_n, num_stages, num_warps, programs_per_sm); first = v3 default.
    configs = [(0, False, 64, 2, 4, 4), (0, False, 64, 3, 4, 8), (1, False, 64, 3, 4, 8)]
    configs += list(itertools.product((0, 2), (True,), (64,), (1, 2), (4,), (4, 8)))
    configs += [(0, True, 32, 1, 4, 8), (0, True, 32, 1, 4, 16), (2, True, 32, 1, 4, 16), (0, True, 64, 1, 8, 8),
                (2, True, 64, 1, 8, 8), (0, True, 128, 1, 4, 8), (4, False, 64, 3, 4, 8), (4, False, 64, 3, 1, 16)]
    # Largest context first (the 128K / batch 8 target point leads), so a cut-short run still has it.
    contexts = sorted(map(int, args.contexts.split(",")), reverse=True)
    batches = [int(b) for b in args.batches.split(",")]
    batches = sorted(batches, key=lambda b: (b != 8, b))
    points = [(b, c) for c in contexts for b in batches]
    if args.smoke:
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


def write_results(out: str, meta: dict, rows: list[dict], prefix: str = "decode", md=None) -> None:
    tag = meta["gpu"].replace(" ", "_").replace("/", "_")
    with open(os.path.join(out, f"{prefix}_{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out, f"{prefix}_{tag}.md"), "w") as f:
        f.write((md or markdown)(meta, rows))


if __name__ == "__main__":
    main()
