"""Where a model-level decode step's time goes: the kernels of one step, OSCAR (PagedKVCache) against BF16, by name.

    python bench/profile_model_step.py --out DIR [--points 32768x1,131072x1]

Builds `bench_model_decode`'s Qwen3-8B-shaped decoder and caches, captures one decode step in a CUDA graph as that
bench does, and records several replays under torch.profiler (CUPTI sees the kernels inside a graph). Per cache it
reports every kernel name with its calls per step and its summed GPU time per step, and the step's wall time; the
difference between the GPU time of its kernels and the step's time is the gaps between kernels. Writes
`profile_model_step_<GPU>.txt` (the tables) and `.json` (bench/common.py schema).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model_decode as bmd  # noqa: E402
import common  # noqa: E402

REPLAYS = 20


def profile_step(model, attention, batch: int, position: int) -> tuple[dict, float]:
    """-> ({kernel name: (calls per step, GPU us per step)}, step wall ms) for one graph-captured step."""
    from torch.profiler import ProfilerActivity, profile

    graph = bmd.capture_step(model, attention, batch, position)
    step_ms = common.time_ms(graph.replay, rep=100)[0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.device_time_total > 0:
            per[ev.name][0] += 1
            per[ev.name][1] += ev.device_time_total
    del graph
    return {k: (n / REPLAYS, us / REPLAYS) for k, (n, us) in per.items()}, step_ms


def table(name: str, kernels: dict, step_ms: float, layers: int) -> str:
    total_us = sum(us for _, us in kernels.values())
    calls = sum(n for n, _ in kernels.values())
    lines = [f"## {name}: step {step_ms:.3f} ms, {calls:.0f} kernels, {total_us / 1e3:.3f} ms of kernel time, "
             f"{step_ms - total_us / 1e3:.3f} ms of gaps ({calls / layers:.1f} kernels per layer)", "",
             "| kernel | calls/step | us/step | us/call |", "|---|---|---|---|"]
    for k, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {k[:90]} | {n:.0f} | {us:.1f} | {us / max(n, 1):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default="32768x1,131072x1")
    ap.add_argument("--compiled", action="store_true", help="the decoder's work around attention through "
                    "torch.compile (bench_model_decode --compiled); writes profile_model_step_compiled_<GPU>")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_model_step: needs a CUDA GPU")
    model = bmd.Decoder(bmd.QWEN3_8B, "cuda", compiled=args.compiled)
    results = "profile_model_step_compiled" if args.compiled else "profile_model_step"
    text, rows = [], []
    for spec in args.points.split(","):
        context, batch = (int(x) for x in spec.split("x"))
        for kind in ("bf16", "oscar"):
            t0 = time.perf_counter()
            if kind == "oscar":
                attn = bmd.OscarAttention(model.shape, batch, context, "cuda")
            else:
                from torch.nn.attention import SDPBackend

                attn = bmd.Bf16Attention(model.shape, batch, context, "cuda", backend=SDPBackend.CUDNN_ATTENTION)
            kernels, step_ms = profile_step(model, attn, batch, attn.position)
            name = f"{kind} {context} x {batch}"
            text.append(table(name, kernels, step_ms, model.shape.layers))
            print(text[-1], f"({time.perf_counter() - t0:.1f} s)", flush=True)
            rows.append({"op": "model_decode_profile", "variant": kind, "shape": {"context": context, "batch": batch},
                         "step_ms": step_ms, "kernels": {k: {"calls_per_step": n, "us_per_step": us}
                                                         for k, (n, us) in kernels.items()}})
            del attn
            torch.cuda.empty_cache()
    path = common.write_rows(args.out, results, rows)
    path.with_suffix(".txt").write_text("\n".join(text))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
