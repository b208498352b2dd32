"""Sustained decode under CUDA graphs with the SM clock and board power sampled: why OSCAR's time moves from run to
run (machine to machine) while BF16's barely does (the INT2 kernel's MMAs lower the SM clock at the board limit).

    python bench/power_clock_trace.py --out OUT [--point 131072x8] [--seconds 3]

Phases of `--seconds` each: the BF16 cuDNN graph, then OSCAR's two-launch and one-launch graphs
(`bench_decode_graph`'s calls), replayed back to back while `nvidia-smi` samples the SM clock and the power draw
every 100 ms. Rows (`bench/common.py` schema): p50/p20/p80 ms per call over the first 15 replays and over the last
second of each phase, with the median SM clock and power in that phase. Writes power_clock_<GPU>.json.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_decode_graph import bf16_calls, capture, oscar_calls  # noqa: E402

SMI = ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"]


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def sustained(calls: list, seconds: float) -> dict:
    """Replay one graph of `calls` back to back for `seconds` -> ms per call of every replay with its end time."""
    graph, n = capture(calls)
    per_call, ends = [], []
    start = time.time()
    while time.time() - start < seconds:
        per_call.append(replay_ms(graph) / n)
        ends.append(time.time())
    return {"start": start, "end": time.time(), "per_call_ms": per_call, "replay_end": ends}


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    if not xs:
        return (float("nan"),) * 3
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return statistics.median(xs), q[1], q[7]


def samples_between(rows, t0: float, t1: float) -> dict:
    sel = [r for r in rows if t0 <= r[0] <= t1]
    if not sel:
        return {"samples": 0}
    return {"samples": len(sel), "sm_mhz_median": statistics.median(r[1] for r in sel),
            "sm_mhz_min": min(r[1] for r in sel), "power_w_median": statistics.median(r[2] for r in sel)}


def main() -> int:
    from torch.nn.attention import SDPBackend

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--point", default="131072x8", help="CONTEXTxBATCH")
    ap.add_argument("--seconds", type=float, default=3.0, help="sustained replay per phase")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("power_clock_trace: needs a CUDA GPU")
    context, batch = (int(x) for x in args.point.split("x"))
    builds = [("bf16_sdpa_cudnn", lambda: bf16_calls(context, batch, SDPBackend.CUDNN_ATTENTION)),
              ("oscar_two_launch", lambda: oscar_calls(context, batch, False)[0]),
              ("oscar_one_launch", lambda: oscar_calls(context, batch, True)[0])]
    smi = subprocess.Popen(SMI, stdout=subprocess.PIPE, text=True)
    phases = {}
    try:
        for name, build in builds:
            phases[name] = sustained(build(), args.seconds)
            torch.cuda.empty_cache()
            time.sleep(1.0)  # a gap between the phases in the trace
    finally:
        smi.terminate()
        text = smi.communicate()[0]
    samples = []
    for ln in text.splitlines():
        try:
            ts, mhz, watts = (x.strip() for x in ln.split(","))
            samples.append((datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(mhz),
                            float(watts)))
        except ValueError:
            continue
    shape = {"context": context, "batch": batch, "h_q": common.H_Q, "h_kv": common.H_KV, "d": common.D}
    rows = []
    for name, ph in phases.items():
        pc, ends = ph["per_call_ms"], ph["replay_end"]
        last = [p for p, e in zip(pc, ends) if e >= ph["end"] - 1.0]
        rows.append(common.row("decode_attention", f"{name}/first15", shape, quantiles(pc[:15]),
                               **samples_between(samples, ph["start"], ph["end"])))
        rows.append(common.row("decode_attention", f"{name}/last_second", shape, quantiles(last),
                               replays=len(pc), **samples_between(samples, ph["end"] - 1.0, ph["end"])))
        print(rows[-2]["variant"], f"{rows[-2]['p50_ms']:.4f}", rows[-1]["variant"], f"{rows[-1]['p50_ms']:.4f} ms",
              rows[-2].get("sm_mhz_median"), "MHz", rows[-2].get("power_w_median"), "W", flush=True)
    print("wrote", common.write_rows(args.out, "power_clock", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
