"""When each program of the decode grid runs: start, end and SM of every history and window program of the two-launch
call (`triton_fused.launch_decode_fused(..., timeline=...)`, the GPU's global timer), to see how much of the grid's
slot-time the history wave leaves idle at its end and how long the window programs add after it.

    python3 bench/program_timeline.py --out OUT [--point 131072x8] [--impls 6,6:maxnreg=96:stages=2]

Runs each variant's call over distinct per-layer caches several times (eager; the kernel boundary before it is the
same as in a graph) and keeps the last pass. Prints, per variant: the history wave's span, its programs' mean /
min / max duration, the spread of their end times, the share of the wave's slot-time (SMs x resident programs x
span) that is idle, and the window programs' tail after the last history program. Writes
`program_timeline_<gpu>.json` (the summary and the raw records of the last call).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import DEV  # noqa: E402
from bench_decode_graph import (  # noqa: E402
    apply_variant,
    point_inputs,
    variant_layers,
    variant_stages,
    variant_whole,
)

from runtime_kernels import attention as A  # noqa: E402
from runtime_kernels.attention import triton_fused, triton_int2  # noqa: E402


def summarize(rec: torch.Tensor, slots_per_sm: int, n_sm: int) -> dict:
    """rec int64 `[programs, 4]` (start ns, end ns, SM, kind) -> the wave's numbers (times in us from the first start)."""
    r = rec.reshape(-1, 4).tolist()
    t0 = min(x[0] for x in r)
    hist = [(x[0] - t0, x[1] - t0, x[2]) for x in r if x[3] != 1]
    win = [(x[0] - t0, x[1] - t0, x[2]) for x in r if x[3] == 1]
    h_end = max(e for _, e, _ in hist)
    dur = [e - s for s, e, _ in hist]
    ends = sorted(e for _, e, _ in hist)
    busy = sum(dur)
    out = {
        "history_programs": len(hist), "window_programs": len(win),
        "history_span_us": h_end / 1e3,
        "history_start_last_us": max(s for s, _, _ in hist) / 1e3,
        "history_duration_us": {"mean": statistics.mean(dur) / 1e3, "min": min(dur) / 1e3, "max": max(dur) / 1e3},
        "history_end_us": {"first": ends[0] / 1e3, "p10": ends[len(ends) // 10] / 1e3,
                           "median": ends[len(ends) // 2] / 1e3, "p90": ends[9 * len(ends) // 10] / 1e3,
                           "last": ends[-1] / 1e3},
        # Slot-time of the wave that runs no history program (the window programs use part of it).
        "history_idle_share": 1.0 - busy / (slots_per_sm * n_sm * h_end),
    }
    if win:
        w_end = max(e for _, e, _ in win)
        out["window"] = {"first_start_us": min(s for s, _, _ in win) / 1e3,
                         "end_us": w_end / 1e3, "tail_after_history_us": max(0, w_end - h_end) / 1e3,
                         "mean_duration_us": statistics.mean(e - s for s, e, _ in win) / 1e3}
    per_sm = {}
    for _, e, sm in hist:
        per_sm.setdefault(sm, []).append(e)
    last_per_sm = sorted(max(v) for v in per_sm.values())
    out["sm_last_end_us"] = {"min": last_per_sm[0] / 1e3, "median": last_per_sm[len(last_per_sm) // 2] / 1e3,
                             "max": last_per_sm[-1] / 1e3}
    return out


def run_variant(batch: int, context: int, variant: str, q: torch.Tensor, gen: torch.Generator,
                passes: int) -> tuple[dict, list]:
    """One variant's timeline -> (its `summarize` numbers with the grid's shape, the raw records of the last call)."""
    layers, pools, tables, hist_len, k_win, v_win, slots, win_len = variant_layers(batch, context, gen, variant)
    impl, stages, whole = apply_variant(variant), variant_stages(variant), variant_whole(variant)
    s_h, s_w = A.decode_num_splits(q, *pools, tables[0], hist_len, k_win, v_win, slots[0], win_len,
                                   num_stages=stages, impl=impl, whole_pages=whole, fused=False)
    h_kv = pools[0].shape[1]
    kernel = triton_fused.launch_decode_fused(q, *pools, tables[0], hist_len, k_win, v_win, slots[0], win_len,
                                              None, 0.088, s_h, s_w, num_stages=stages, impl=impl, whole_pages=whole,
                                              warmup=True, merge=False)
    slots_per_sm = triton_int2._slots_of(kernel, 1, q.device)  # also loads the kernel, which counts its registers
    n_regs, shared = int(kernel.n_regs), int(kernel.metadata.shared)
    timeline = torch.zeros(batch, h_kv, s_h + s_w, 4, dtype=torch.int64, device=DEV)
    for _ in range(passes):
        for i in range(layers):
            triton_fused.launch_decode_fused(q, *pools, tables[i], hist_len, k_win, v_win, slots[i], win_len,
                                             None, 0.088, s_h, s_w, num_stages=stages, impl=impl, whole_pages=whole,
                                             merge=False, timeline=timeline)
    torch.cuda.synchronize()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    res = summarize(timeline.cpu(), slots_per_sm, n_sm)
    res.update(variant=variant, splits=[s_h, s_w], regs=n_regs, shared=shared, slots_per_sm=slots_per_sm)
    return res, timeline.cpu().tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--point", default="131072x8", help="CONTEXTxBATCH")
    ap.add_argument("--impls", default=str(A.INT2_IMPL), help="variants (bench_decode_graph keys), comma-separated")
    ap.add_argument("--passes", type=int, default=3, help="passes over the layers; the last call is kept")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("program_timeline: needs a CUDA GPU")
    context, batch, gen, q = point_inputs(args.point)
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "point": args.point, "variants": []}
    for variant in args.impls.split(","):
        res, raw = run_variant(batch, context, variant, q, gen, args.passes)
        report["variants"].append(dict(res, raw=raw))
        h = res["history_end_us"]
        w = res.get("window", {})
        print(f"{variant}: {res['splits'][0]}+{res['splits'][1]} splits, {res['regs']} regs, {res['slots_per_sm']}/SM | "
              f"history span {res['history_span_us']:.1f} us, last start {res['history_start_last_us']:.1f}, "
              f"duration mean {res['history_duration_us']['mean']:.1f} (min {res['history_duration_us']['min']:.1f}, "
              f"max {res['history_duration_us']['max']:.1f}), ends first/p10/median/p90/last {h['first']:.1f}/"
              f"{h['p10']:.1f}/{h['median']:.1f}/{h['p90']:.1f}/{h['last']:.1f}, idle share "
              f"{res['history_idle_share'] * 100:.1f} % | windows start {w.get('first_start_us', float('nan')):.1f}, "
              f"end {w.get('end_us', float('nan')):.1f}, tail {w.get('tail_after_history_us', float('nan')):.1f} us",
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "program_timeline_" + report["gpu"].replace(" ", "_") + ".json"), "w") as fh:
        json.dump(report, fh)


if __name__ == "__main__":
    main()
