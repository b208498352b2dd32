#!/usr/bin/env python3
"""Which held-out clip objective predicts perplexity? And what do centering and windows buy?

For one model (a trained fixture), calibrate once (statistics + held-out rows of `calib.txt`), then build many
KV-cache configurations (rotations x clip ratios x centering) and measure each two ways:
- the candidate clip objectives of `oscar_calib.calibration.clipfit` on the calibration held-out sequences (summed over
  layers and KV heads), plus the teacher-forced NLL of those sequences (`calib_nll`);
- held-out perplexity on `heldout.txt` windows (per-window mean NLL kept, for bootstrap intervals).
Then it ranks: the Spearman correlation of every objective with held-out perplexity over the configurations.

    python3 tools/clip_objective_study.py --model oscar_calib/fixtures/tiny-qwen3 --context 4096 --out OUT

Writes `clip_study_<model>_<context>.json`. docs/quality.md ("Which defaults, and why") quotes it.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
from study_common import fixture_parser, load_fixture


def log(msg: str) -> None:
    print(f"[clip_study {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (sx * sy) if sx and sy else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = fixture_parser(__doc__.split("\n\n")[0])
    p.add_argument("--holdout-samples", type=int, default=2)
    p.add_argument("--holdout-queries", type=int, default=512)
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="few configurations (a smoke test of the script)")
    args = p.parse_args(argv)

    from oscar_calib.analysis.evaluate import make_windows, method_nll, read_documents
    from oscar_calib.analysis.methods import Kivi2, KVMethod, LayerTables, RowwiseInt2, TableInt2, hadamard
    from oscar_calib.calibration.calibrate import (
        _holdout_positions,
        _run_capture,
        _solve_all,
        o_proj_weights,
        session_means,
    )
    from oscar_calib.calibration.capture import CaptureSession, sliding_window_layers
    from oscar_calib.calibration.clipfit import clip_errors, fit_layer
    from oscar_calib.config import SolverSettings

    t_start = time.perf_counter()
    tok, model, device, dtype = load_fixture(args.model)
    sink, recent = args.sink, args.recent
    from runtime_kernels.format import KVFormat

    # This study's cache (as when it was run): fp16 scales, min-max INT2, one group per row, a per-token history.
    fmt = KVFormat(sink_tokens=sink, recent_tokens=recent, page_size=1, group_size=None, scale_format="float16",
                   quantizer="uniform_minmax", centered=False)

    cal = make_windows(tok, read_documents(args.model / "calib.txt"), args.context)
    cal_ids = torch.cat([cal.long, cal.packed])
    n_stat = min(args.calib_samples, cal_ids.shape[0] - args.holdout_samples)
    stat_ids = cal_ids[:n_stat].to(device)
    hold_ids = cal_ids[n_stat:n_stat + args.holdout_samples].to(device)
    windows = make_windows(tok, read_documents(args.model / "heldout.txt"), args.context, args.max_windows)
    eval_ids = torch.cat([windows.long, windows.packed])
    log(f"{args.model.name}: {n_stat} x {args.context} calibration, {hold_ids.shape[0]} held out, "
        f"{eval_ids.shape[0]} eval windows; device {device}")

    session = CaptureSession(skip_layers=sliding_window_layers(model.config))
    with torch.no_grad():
        _run_capture(model, session, stat_ids, args.batch_size, None)
        session.mode = "holdout"
        session.query_positions = _holdout_positions(args.context, args.holdout_queries, 0)
        _run_capture(model, session, hold_ids, 1, None)
    layer_ids = sorted(session.stats)
    n_layers = len(layer_ids)
    h_kv, d = session.stats[layer_ids[0]].key_sum.shape[:2]
    base = SolverSettings(kv_format={"sink_tokens": sink, "recent_tokens": recent, "scale_format": "float16"})
    k_rot, _, v_rot, _ = _solve_all(session, layer_ids, base, "attn_output", "head")
    k_mean, v_mean = session_means(session, layer_ids)
    had = hadamard(d).float().expand(n_layers, h_kv, d, d).contiguous()
    o_w = o_proj_weights(model, layer_ids)
    log(f"captured and solved in {time.perf_counter() - t_start:.1f}s")

    holdout = {i: session.holdout[i].stacked() for i in layer_ids}

    def objectives(rk, rv, kc, vc, km, vm) -> dict[str, float]:
        """Held-out objectives (sums over layers, means over KV heads) of one configuration."""
        out = {"k_attn_kl": 0.0, "k_logit_mse": 0.0, "k_out_err": 0.0, "k_block_out": 0.0,
               "v_out_err": 0.0, "v_block_out": 0.0}
        for a, layer in enumerate(layer_ids):
            keys, values, queries, positions = holdout[layer]
            dev = keys.device
            common = dict(scaling=session.scaling, fmt=fmt,
                          k_mean=None if km is None else km[a].to(dev), v_mean=None if vm is None else vm[a].to(dev))
            kr, vr = (kc[a].cpu(),), (vc[a].cpu(),)
            for obj in ("attn_kl", "logit_mse", "out_err", "block_out"):
                ke, ve = clip_errors(keys, values, queries, positions, rk[a].to(dev), rv[a].to(dev), kr,
                                     key_objective=obj, v_grid=vr, o_weight=o_w[layer].to(dev), **common)
                out[f"k_{obj}"] += float(ke.mean())
                if obj == "out_err":
                    out["v_out_err"] += float(ve.mean())
                if obj == "block_out":
                    out["v_block_out"] += float(ve.mean())
        out["kv_out_err"] = out["k_out_err"] + out["v_out_err"]
        out["kv_block_out"] = out["k_block_out"] + out["v_block_out"]
        out["kl_plus_vout"] = out["k_attn_kl"] + out["v_out_err"]
        return out

    def table_method(name, rk, rv, kc, vc, km=None, vm=None) -> TableInt2:
        tables = {layer: LayerTables(rk[a], rv[a], kc[a], vc[a], None if km is None else km[a],
                                     None if vm is None else vm[a]) for a, layer in enumerate(layer_ids)}
        return TableInt2(name, name, fmt=fmt, tables=tables)

    def full(x: float) -> torch.Tensor:
        return torch.full((n_layers, h_kv), float(x))

    rows: list[dict] = []
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / f"clip_study_{args.model.name}_{args.context}.json"  # rewritten by the final result

    def measure(method: KVMethod, spec: dict | None) -> dict:
        t0 = time.perf_counter()
        nll, _ = method_nll(model, method, eval_ids, fmt, args.batch_size, collect_stats=False)
        win = nll.double().mean(dim=1)
        cnll, _ = method_nll(model, method, hold_ids, fmt, 1, collect_stats=False)
        row = {"name": method.name, "ppl": math.exp(float(nll.double().mean())),
               "window_nll": win.tolist(), "calib_nll": float(cnll.double().mean())}
        if spec is not None:
            row.update(objectives(*spec["tables"]))
            row["k_clip_mean"] = float(spec["tables"][2].mean())
            row["v_clip_mean"] = float(spec["tables"][3].mean())
            row["k_clip"] = spec["tables"][2].tolist()
            row["v_clip"] = spec["tables"][3].tolist()
            row["centered"] = spec["tables"][4] is not None
        rows.append(row)
        partial.write_text(json.dumps({"model": str(args.model), "context": args.context, "rows": rows}))
        log(f"{method.name:40s} ppl {row['ppl']:.4f} calib_nll {row['calib_nll']:.5f} ({time.perf_counter() - t0:.1f}s)")
        return row

    measure(KVMethod(), None)
    measure(RowwiseInt2("int2", "int2", fmt=fmt), None)
    measure(Kivi2("kivi2-g128", "kivi", token_group=128), None)

    def config(name, rk, rv, kc, vc, centered_k=False, centered_v=False):
        km = k_mean if centered_k else None
        vm = v_mean if centered_v else None
        return measure(table_method(name, rk, rv, kc, vc, km, vm), {"tables": (rk, rv, kc, vc, km, vm)})

    k_grid_u = (0.90, 0.94, 0.96, 0.98, 1.0) if not args.quick else (0.94, 1.0)
    v_grid_u = (0.88, 0.92, 0.96, 1.0) if not args.quick else (0.92, 1.0)
    for ck in (False, True):
        c = "+ck" if ck else ""
        config(f"quarot{c}", had, had, full(1), full(1), ck)
        config(f"hadamard-clip{c}", had, had, full(0.96), full(0.92), ck)
        config(f"hadamard-clip{c}+cv", had, had, full(0.96), full(0.92), ck, True) if ck else None
        for kc in k_grid_u:
            for vc in v_grid_u:
                config(f"oscar{c} K{kc:.2f} V{vc:.2f}", k_rot, v_rot, full(kc), full(vc), ck)
    config("oscar+ck+cv K0.96 V0.92", k_rot, v_rot, full(0.96), full(0.92), True, True)
    config("oscar+ck+cv K1.00 V1.00", k_rot, v_rot, full(1.0), full(1.0), True, True)

    # Per-head fits by each objective (grids extended until the error turns up).
    k_grid, v_grid = base.k_clip_grid, base.v_clip_grid
    fits_out = {}
    for ck in (False, True):
        for obj in ("attn_kl", "logit_mse", "out_err", "block_out"):
            kcs, vcs = [], []
            for a, layer in enumerate(layer_ids):
                keys, values, queries, positions = holdout[layer]
                dev = keys.device
                f = fit_layer(keys, values, queries, positions, k_rot[a].to(dev), v_rot[a].to(dev), k_grid,
                              session.scaling, fmt, key_objective=obj, v_grid=v_grid,
                              k_mean=k_mean[a].to(dev) if ck else None, o_weight=o_w[layer].to(dev))
                kcs.append(f.k_ratio)
                vcs.append(f.v_ratio)
            kc, vc = torch.stack(kcs), torch.stack(vcs)
            name = f"oscar{'+ck' if ck else ''} fit:{obj}"
            fits_out[name] = {"k": kc.tolist(), "v": vc.tolist()}
            config(name, k_rot, v_rot, kc, vc, ck)

    # Per-layer coordinate search by the calibration held-out NLL (centered keys).
    kc, vc = full(1.0), full(1.0)
    search_k = (0.90, 0.92, 0.94, 0.96, 0.98, 1.0) if not args.quick else (0.96, 1.0)
    search_v = (0.84, 0.88, 0.92, 0.96, 1.0) if not args.quick else (0.92, 1.0)
    t0 = time.perf_counter()
    forwards = 0
    for a in range(n_layers):
        for side, grid in (("k", search_k), ("v", search_v)):
            best = None
            for r in grid:
                trial_k, trial_v = kc.clone(), vc.clone()
                (trial_k if side == "k" else trial_v)[a] = r
                m = table_method("search", k_rot, v_rot, trial_k, trial_v, k_mean, None)
                nll, _ = method_nll(model, m, hold_ids, fmt, 1, collect_stats=False)
                forwards += 1
                val = float(nll.double().mean())
                if best is None or val < best[0] - 1e-7:
                    best = (val, r)
            (kc if side == "k" else vc)[a] = best[1]
    search_s = time.perf_counter() - t0
    log(f"NLL search: {forwards} forwards in {search_s:.1f}s")
    config("oscar+ck fit:calib_nll(layer)", k_rot, v_rot, kc, vc, True)

    # Windows: bits and loss of the best centered config at other window sizes.
    window_rows = []
    for s_, r_ in ((64, 256), (64, 512), (128, 1024), (128, 2048)):
        if s_ + r_ >= args.context:
            continue
        for name, m in (("hadamard-clip", table_method("hc", had, had, full(0.96), full(0.92))),
                        ("oscar+ck K0.96 V0.92", table_method("o", k_rot, v_rot, full(0.96), full(0.92), k_mean))):
            nll, _ = method_nll(model, m, eval_ids, fmt.with_(sink_tokens=s_, recent_tokens=r_), args.batch_size,
                                collect_stats=False)
            window_rows.append({"sink": s_, "recent": r_, "name": name, "ppl": math.exp(float(nll.double().mean())),
                                "window_nll": nll.double().mean(dim=1).tolist()})
            log(f"windows {s_}/{r_} {name}: ppl {window_rows[-1]['ppl']:.4f}")

    bf = rows[0]
    for r in rows:
        r["ppl_delta_pct"] = 100 * (r["ppl"] / bf["ppl"] - 1)
    keys = ["calib_nll", "k_attn_kl", "k_logit_mse", "k_out_err", "k_block_out", "v_out_err", "v_block_out",
            "kv_out_err", "kv_block_out", "kl_plus_vout"]
    scored = [r for r in rows if "k_attn_kl" in r]
    ranking = {k: spearman([r[k] for r in scored], [r["ppl"] for r in scored]) for k in keys}
    log("Spearman with held-out ppl: " + ", ".join(f"{k} {v:+.3f}" for k, v in ranking.items()))
    result = {"model": str(args.model), "context": args.context, "sink": sink, "recent": recent,
              "eval_windows": int(eval_ids.shape[0]), "calib_samples": n_stat, "holdout_samples": int(hold_ids.shape[0]),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": __import__("transformers").__version__, "rows": rows, "ranking_spearman": ranking,
              "fits": fits_out, "nll_search": {"forwards": forwards, "seconds": search_s},
              "windows": window_rows, "seconds": time.perf_counter() - t_start}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"clip_study_{args.model.name}_{args.context}.json"
    out.write_text(json.dumps(result, indent=1))
    log(f"wrote {out} in {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
