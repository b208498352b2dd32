"""Cost of demotion (quantize + pack + write the oldest recent tokens into the INT2 pools) per decode step, against the
decode attention call of the same point, both as a serving engine runs them (CUDA graphs).

Demotion per step, for a batch of B sequences, K and V (`quant.write_pages`):
- page batched, cache path: what `PagedKVCache` runs: one page (64 tokens) per sequence every 64 steps, rows that
  were rotated when they entered the BF16 window, so clip + quantize + pack + write only -> time of one call / 64;
- page batched: the same with the rotation included (an upper bound);
- one token: one token per sequence every step, rotation included.
Each is timed under a CUDA graph (16 calls per replay, each to its own scattered pages) and eagerly (`do_bench`,
launch overhead included). The attention time per point is read from the graph benchmark's results file.

    python3 bench/bench_demotion.py --out bench/results --attention bench/results/decode_graph_NVIDIA_H200.json \
        [--scale-format ue5m3] [--quantizer uniform_unbiased]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode_graph import graph_times  # noqa: E402
from common import H_KV, PAGE, D, commit  # noqa: E402

from runtime_kernels import quant  # noqa: E402
from runtime_kernels.attention.int2_decode.pools import alloc_quad_pools  # noqa: E402
from runtime_kernels.format import DEFAULT_FORMAT, KVFormat  # noqa: E402

DEV = "cuda"


def demote_calls(tokens: int, n_calls: int, pools, gen: torch.Generator, rotate: bool, fmt: KVFormat):
    """`n_calls` write_pages calls (K and V) of `tokens` tokens each, to distinct random pages and rows; `rotate`
    False: rows already rotated (bf16), as the cache demotes them."""
    rot = torch.linalg.qr(torch.randn(H_KV, D, D, device=DEV, generator=gen))[0] if rotate else None
    ratio = torch.full((H_KV,), 0.96, device=DEV)
    calls = []
    for _ in range(n_calls):
        x = torch.randn(tokens, H_KV, D, device=DEV, generator=gen).to(torch.bfloat16)
        ids = torch.randint(0, pools[0].shape[0], (tokens,), device=DEV, generator=gen, dtype=torch.int32)
        rows = torch.randint(0, PAGE, (tokens,), device=DEV, generator=gen, dtype=torch.int32)

        def call(x=x, ids=ids, rows=rows):
            quant.write_pages(x, rot, ratio, pools[0], pools[1], pools[2], ids, rows, fmt)
            quant.write_pages(x, rot, ratio, pools[3], pools[4], pools[5], ids, rows, fmt)
        calls.append(call)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--attention", help="decode_graph_<gpu>.json of the graph benchmark (bench/common.py schema); "
                                        "without it, demotion times alone at batch 1, 8 and 32")
    ap.add_argument("--scale-format", default="float16", choices=quant.naive.SCALE_FORMATS)
    ap.add_argument("--quantizer", default="uniform_minmax", choices=quant.naive.QUANTIZERS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_demotion: needs a CUDA GPU")
    import triton.testing

    att = None
    if args.attention:
        with open(args.attention) as fh:
            att = json.load(fh)
    # The attention rows to compare with: the shipped recipe's two-launch form (older files: the one fp16 layout).
    variants = {r["variant"] for r in att["rows"]} if att else set()
    impl_key = "oscar_recipe_two_launch" if "oscar_recipe_two_launch" in variants else "oscar_two_launch"
    gen = torch.Generator(device=DEV).manual_seed(0)
    n_pages = 8192
    # The pools as `PagedKVCache` allocates them at one group per row: a row's four scale/zero entries side by side.
    fmt = DEFAULT_FORMAT.with_(scale_format=args.scale_format, quantizer=args.quantizer)
    sdt = quant.scale_storage_dtype(fmt)
    ks, kz, vs, vz = alloc_quad_pools(n_pages, H_KV, PAGE, DEV, dtype=sdt)
    pools = (torch.zeros(n_pages, H_KV, PAGE, D // 4, dtype=torch.uint8, device=DEV), ks, kz,
             torch.zeros(n_pages, H_KV, PAGE, D // 4, dtype=torch.uint8, device=DEV), vs, vz)
    per_batch = {}
    for batch in sorted({r["shape"]["batch"] for r in att["rows"]}) if att else (1, 8, 32):
        res = {}
        for name, tokens, steps, rotate in (("page_batched_cache", batch * PAGE, PAGE, False),
                                            ("page_batched", batch * PAGE, PAGE, True), ("one_token", batch, 1, True)):
            calls = demote_calls(tokens, 16, pools, gen, rotate, fmt)
            res[f"{name}_graph_ms_per_step"] = graph_times(calls)[0] / steps
            res[f"{name}_eager_ms_per_step"] = triton.testing.do_bench(calls[0], warmup=10, rep=50) / steps
        per_batch[batch] = res
        print(batch, res, flush=True)
    rows = [] if att else [{"batch": b, **d} for b, d in per_batch.items()]
    for r in att["rows"] if att else []:
        if r["variant"] != impl_key or "p50_ms" not in r:
            continue
        d = per_batch[r["shape"]["batch"]]
        rows.append({"context": r["shape"]["context"], "batch": r["shape"]["batch"], "attention_graph_ms": r["p50_ms"],
                     **d, **{f"{k.replace('_ms_per_step', '')}_pct_of_attention": 100 * v / r["p50_ms"]
                             for k, v in d.items()}})
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "attention_file": os.path.basename(args.attention) if att else None, "attention_impl": impl_key,
            "scale_format": args.scale_format, "quantizer": args.quantizer, "commit": commit()}
    suffix = "" if (args.scale_format, args.quantizer) == ("float16", "uniform_minmax") else \
        f"_{args.scale_format}_{args.quantizer}"
    stem = os.path.join(args.out, "decode_demotion_" + meta["gpu"].replace(" ", "_") + suffix)
    with open(stem + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    lines = [f"# Demotion cost per decode step vs decode attention ({meta['gpu']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}; scale format "
             f"{meta['scale_format']}, quantizer {meta['quantizer']}; `quant.write_pages` of K and V, Qwen3-8B geometry; "
             f"cache path = rows already rotated (what `PagedKVCache` demotes), the other columns include the "
             f"rotation; attention = {impl_key} under CUDA graphs from `{meta['attention_file']}`. "
             "`python3 bench/bench_demotion.py --out DIR --attention FILE`", "",
             "| context | batch | attention (ms) | page batched, cache path, graph (ms/step) | % "
             "| page batched, graph (ms/step) | % | page batched, eager (ms/step) | % "
             "| one token, graph (ms/step) | % | one token, eager (ms/step) | % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [str(r.get("context", "")), str(r["batch"]), f"{r['attention_graph_ms']:.4f}" if att else "n/a"]
        for k in ("page_batched_cache_graph", "page_batched_graph", "page_batched_eager", "one_token_graph",
                  "one_token_eager"):
            cells += [f"{r[k + '_ms_per_step']:.5f}", f"{r[k + '_pct_of_attention']:.1f}%" if att else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    with open(stem + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
