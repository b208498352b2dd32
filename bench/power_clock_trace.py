"""Sustained decode under CUDA graphs with the SM clock and board power sampled: why the INT2 side's time moves from
run to run (machine to machine) while BF16's barely does.

One point (default 128K / batch 8), phases of `--seconds` each: the BF16 cuDNN graph, then the INT2 graph of each
`--impls` variant (`bench_decode_graph`'s calls and variant keys), replayed back to back while `nvidia-smi` samples the SM clock and the power draw
every 100 ms. Reports per phase the ms per call over the first 15 replays (what `bench_decode_graph` times) and over
the last second, with the median SM clock and power in that phase.

    python3 bench/power_clock_trace.py --out OUT [--point 131072x8] [--seconds 4]

Writes `power_clock_<gpu>.json` and prints a short table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import H_Q, D  # noqa: E402
from bench_decode_graph import (  # noqa: E402
    MIN_CALLS,
    apply_variant,
    bf16_layers,
    capture_graph,
    point_inputs,
    repeat_to,
    replay_ms,
    variant_layers,
    variant_stages,
)

from runtime_kernels import attention as A  # noqa: E402

SMI = ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"]


def bf16_calls(batch: int, context: int, q: torch.Tensor, gen: torch.Generator) -> list:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv = bf16_layers(batch, context, gen)
    qg = q.reshape(batch, H_Q, 1, D)

    def call(k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qg, k, v, enable_gqa=True)
    return repeat_to([lambda k=k, v=v: call(k, v) for k, v in kv], MIN_CALLS)


def int2_calls(batch: int, context: int, q: torch.Tensor, gen: torch.Generator, variant: str) -> list:
    """The INT2 calls of `variant` (`bench_decode_graph.apply_variant` keys, and `layout=` / `order=` for the pools;
    its switches stay set until the next variant is applied)."""
    layers, pools, tables, hist_len, k_win, v_win, slots, win_len = variant_layers(batch, context, gen, variant)
    impl, stages = apply_variant(variant), variant_stages(variant)
    return repeat_to([lambda t=tables[i], s=slots[i]: A.decode_attention(
        q, *pools, t, hist_len, k_win, v_win, s, win_len, impl=impl, num_stages=stages, whole_pages=True,
        validate=False)
        for i in range(layers)], MIN_CALLS)


def sustained(calls: list, seconds: float) -> dict:
    """Capture `calls` in one graph, replay it back to back for `seconds` -> ms per call of every replay with its end
    time (wall clock, for matching the clock samples)."""
    g = capture_graph(calls)
    per_call, ends = [], []
    t_start = time.time()
    while time.time() - t_start < seconds:
        per_call.append(replay_ms(g) / len(calls))
        ends.append(time.time())
    del g
    return {"start": t_start, "end": time.time(), "per_call_ms": per_call, "replay_end": ends}


def samples_between(rows: list[tuple[float, float, float]], t0: float, t1: float) -> dict:
    sel = [r for r in rows if t0 <= r[0] <= t1]
    if not sel:
        return {"samples": 0}
    return {"samples": len(sel), "sm_mhz_median": statistics.median(r[1] for r in sel),
            "sm_mhz_min": min(r[1] for r in sel), "power_w_median": statistics.median(r[2] for r in sel)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--point", default="131072x8", help="CONTEXTxBATCH")
    ap.add_argument("--seconds", type=float, default=4.0, help="sustained replay per phase")
    ap.add_argument("--impls", default=str(A.INT2_IMPL),
                    help="INT2 variants (bench_decode_graph keys), one phase each in this order, e.g. 6,6:pair=1,6")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("power_clock_trace: needs a CUDA GPU")
    context, batch, gen, q = point_inputs(args.point)
    smi = subprocess.Popen(SMI, stdout=subprocess.PIPE, text=True)
    phases = {}
    try:
        builds = [("bf16_cudnn", bf16_calls)] + [
            (f"int2 {v} #{i}", lambda b, c, q, g, v=v: int2_calls(b, c, q, g, v))
            for i, v in enumerate(args.impls.split(","))]
        for name, build in builds:
            calls = build(batch, context, q, gen)
            phases[name] = sustained(calls, args.seconds)
            del calls
            torch.cuda.empty_cache()
            time.sleep(1.0)  # a gap between the phases in the trace
    finally:
        smi.terminate()
        out_text = smi.communicate()[0]
    rows = []
    for ln in out_text.splitlines():
        try:
            ts, mhz, watts = (x.strip() for x in ln.split(","))
            rows.append((datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(mhz), float(watts)))
        except ValueError:
            continue
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "point": args.point,
              "seconds": args.seconds, "phases": {}}
    print(f"{report['gpu']}, {args.point}, {args.seconds:.0f} s sustained graph replay per phase")
    for name, ph in phases.items():
        pc, ends = ph["per_call_ms"], ph["replay_end"]
        last = [p for p, e in zip(pc, ends) if e >= ph["end"] - 1.0]
        r = {"replays": len(pc), "first15_median_ms": statistics.median(pc[:15]),
             "last_second_median_ms": statistics.median(last) if last else float("nan"),
             "whole": samples_between(rows, ph["start"], ph["end"]),
             "last_second": samples_between(rows, ph["end"] - 1.0, ph["end"])}
        report["phases"][name] = r
        w = r["whole"]
        print(f"{name}: first 15 replays {r['first15_median_ms']:.4f} ms/call, last second "
              f"{r['last_second_median_ms']:.4f} ms/call; SM clock median {w.get('sm_mhz_median', float('nan')):.0f} "
              f"MHz (min {w.get('sm_mhz_min', float('nan')):.0f}), power median "
              f"{w.get('power_w_median', float('nan')):.0f} W over {w['samples']} samples")
    report["samples"] = rows
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "power_clock_" + report["gpu"].replace(" ", "_") + ".json"), "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
