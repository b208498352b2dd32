#!/usr/bin/env python3
"""Long-context study: calibration variants and equal-bits peers at several contexts, on the same held-out windows.

For one model directory, a calibration text and a held-out text: calibrate every entry of VARIANTS (SolverSettings
overrides + the calibration sequence length), build the PEERS (Hadamard or a calibrated per-head rotation with global
clip ratios, centered or not, each quantizer), then evaluate all of them at each `--contexts` length on the SAME
held-out windows in one layout (ue5m3 scales, `--sink`/`--recent`, default the recipe's 128/1024). Reported per
context and cache: perplexity; its change against BF16, against BASELINE and against HADAMARD_BASELINE, each with a
paired 95 % bootstrap interval over windows; passkey accuracy with every needle at the deepest position of the INT2
history (with a paired interval over needles against BASELINE); bits per element at 128K for the model's head_dim.

    python3 tools/long_context_study.py --model ~/.cache/oscar-calib/smollm2-135m --calib T/calib.txt \\
        --heldout T/heldout.txt --contexts 2048,4096,8192 --out OUT
    python3 tools/long_context_study.py --model oscar_calib/fixtures/tiny-qwen3 --quick --out /tmp/lcs   # CPU smoke

Writes `long_context_<model>_<contexts>.json` (every per-window NLL and per-needle score, the fits, versions, device, commit,
command line; rewritten after each context so a cut-short run keeps what it finished) and the same `.md`.
Texts: `python3 tools/real_model.py text --out T` (docutils docs to calibrate, three Austen novels held out).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

# ---------------------------------------------------------------------------------------------------------------
# What is compared. Edit here.
# ---------------------------------------------------------------------------------------------------------------
# Calibrated variants: name -> (SolverSettings overrides, calibration sequence length). A length of None calibrates
# at each evaluated context; "run" is what `oscar-calib run` uses by default (DataConfig().seq_len). The layout
# (sink/recent) is set from the command line for every variant.
VARIANTS: dict[str, tuple[dict, int | str | None]] = {
    "default": ({}, "run"),
    "default, calibrated at context": ({}, None),
    "minmax": ({"quantizer": "uniform_minmax"}, "run"),
    "minmax, calibrated at context": ({"quantizer": "uniform_minmax"}, None),
    "no clip": ({"clip": False}, "run"),
    "per layer": ({"granularity": "layer"}, "run"),
}
# Equal-bits peers with global clips: name -> (rotation "hadamard" | "oscar", centered, quantizer). An "oscar"
# rotation (and every centered peer's means) comes from an unclipped calibration with the same centering, at
# PEER_CALIB_LEN.
PEERS: dict[str, tuple[str, bool, str]] = {
    "hadamard + clip, centered, minmax": ("hadamard", True, "uniform_minmax"),
    "hadamard + clip, uncentered, minmax": ("hadamard", False, "uniform_minmax"),
    "per-head rotation + clip, centered, minmax": ("oscar", True, "uniform_minmax"),
    "per-head rotation + clip, centered, unbiased": ("oscar", True, "uniform_unbiased"),
    "per-head rotation + clip, uncentered, minmax": ("oscar", False, "uniform_minmax"),
    "per-head rotation + clip, uncentered, unbiased": ("oscar", False, "uniform_unbiased"),
}
PEER_CLIPS = (0.96, 0.92)  # the reference's global K / V clip ratios
PEER_CALIB_LEN: int | str | None = "run"
BASELINE = "per-head rotation + clip, centered, minmax"
HADAMARD_BASELINE = "hadamard + clip, centered, minmax"
SCALE_FORMAT = "ue5m3"


def log(msg: str) -> None:
    print(f"[long_context {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def paired_ci(a: list[float], b: list[float], n_boot: int = 2000, seed: int = 0) -> list[float]:
    """95 % percentile bootstrap interval of mean(a) - mean(b), items resampled together (nan for < 2 items)."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    if x.numel() < 2:
        return [float("nan"), float("nan")]
    idx = torch.randint(0, x.numel(), (n_boot, x.numel()), generator=torch.Generator().manual_seed(seed))
    d = x[idx].mean(dim=1) - y[idx].mean(dim=1)
    return [float(d.quantile(0.025)), float(d.quantile(0.975))]


def ppl_delta(a: list[float], b: list[float]) -> tuple[float, list[float]]:
    """Perplexity change (%) of per-window mean NLLs `a` against `b`, and its paired 95 % interval."""
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    pct = lambda x: 100.0 * float(torch.expm1(torch.tensor(x, dtype=torch.float64)))  # noqa: E731
    return pct(mean(a) - mean(b)), [pct(x) for x in paired_ci(a, b)]


def compare(rows: dict[str, dict]) -> None:
    """Add to every row its ppl and its deltas against BF16, BASELINE and HADAMARD_BASELINE (where present), with
    paired intervals over the same windows, and its passkey change against BASELINE over the same needles."""
    for name, row in rows.items():
        mean_nll = sum(row["window_nll"]) / len(row["window_nll"])
        row["ppl"] = float(torch.exp(torch.tensor(mean_nll, dtype=torch.float64)))
        for ref, key in (("bf16", "vs_bf16"), (BASELINE, "vs_baseline"), (HADAMARD_BASELINE, "vs_hadamard")):
            if ref in rows and ref != name:
                delta, ci = ppl_delta(row["window_nll"], rows[ref]["window_nll"])
                row[key] = {"ppl_delta_pct": delta, "ci95": ci}
        if "needle_accuracy" in row and BASELINE in rows and name != BASELINE:
            acc, base = row["needle_accuracy"], rows[BASELINE]["needle_accuracy"]
            row["passkey_vs_baseline"] = {"delta": (sum(acc) - sum(base)) / len(acc), "ci95": paired_ci(acc, base)}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from runtime_kernels.layout import RECIPE_LAYOUT

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a model directory (bf16 or fp32 safetensors)")
    p.add_argument("--calib", type=Path, default=None, help="calibration text (default: <model>/calib.txt)")
    p.add_argument("--heldout", type=Path, default=None, help="held-out text (default: <model>/heldout.txt)")
    p.add_argument("--contexts", default=None,
                   help="comma-separated window lengths, evaluated in order (default 2048,4096,8192; --quick 512)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-windows", type=int, default=16, help="held-out windows per context (the same for all)")
    p.add_argument("--needles", type=int, default=16, help="passkey needles per context (0 = skip the probe)")
    p.add_argument("--calib-samples", type=int, default=None,
                   help="calibration sequences for the statistics (default: what `oscar-calib run` uses), "
                        "plus one held out for the clip fit")
    p.add_argument("--batch-size", type=int, default=None, help="windows per forward pass (default 1 at >= 8K)")
    p.add_argument("--sink", type=int, default=RECIPE_LAYOUT.sink_tokens)
    p.add_argument("--recent", type=int, default=RECIPE_LAYOUT.recent_tokens)
    p.add_argument("--only", default=None, help="comma-separated names: evaluate only these variants/peers "
                                                 "(BF16 and the two baselines are always kept)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no new row after this many seconds (the rows done are written; the rest listed as "
                        "skipped): keeps a run inside a device call's time limit")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: context 512, 2 windows, 2 needles, 4 calibration sequences, sink 32 / "
                        "recent 128, every calibration at the context")
    args = p.parse_args(argv)
    if args.quick:
        args.max_windows, args.needles, args.calib_samples = min(args.max_windows, 2), min(args.needles, 2), 4
        args.sink, args.recent = 32, 128
    args.contexts = [int(c) for c in (args.contexts or ("512" if args.quick else "2048,4096,8192")).split(",")
                     if c.strip()]
    args.calib = args.calib or args.model / "calib.txt"
    args.heldout = args.heldout or args.model / "heldout.txt"
    for flag, path in (("--calib", args.calib), ("--heldout", args.heldout)):
        if not path.is_file():
            p.error(f"{flag} {path}: no such file (make the texts with `python3 tools/real_model.py text --out T`)")
    if min(args.contexts) <= args.sink + args.recent + 64:
        p.error(f"--contexts {min(args.contexts)}: must exceed sink {args.sink} + recent {args.recent} + 64 so the "
                "INT2 history holds the needles")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from study_common import load_fixture

    from oscar_calib.calibrate import artifact_from_statistics, capture_statistics
    from oscar_calib.config import DataConfig, SolverSettings
    from oscar_calib.evaluate import make_windows, method_nll, read_documents
    from oscar_calib.methods import ArtifactInt2, KVMethod, LayerTables, RowwiseInt2, TableInt2, hadamard
    from oscar_calib.probes import passkey_batch, passkey_scores
    from runtime_kernels.artifact import model_geometry

    t_start = time.perf_counter()
    tok, model, device, dtype = load_fixture(args.model)
    n_layers, h_q, h_kv, d = model_geometry(model.config)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max(args.contexts) > limit:
        log(f"warning: context {max(args.contexts)} exceeds the model's max_position_embeddings {limit}")
    run_len, samples = DataConfig().seq_len, args.calib_samples or DataConfig().samples
    sink, recent = args.sink, args.recent
    layout = {"sink_tokens": sink, "recent_tokens": recent}
    only = None if args.only is None else {n.strip() for n in args.only.split(",")} | {BASELINE, HADAMARD_BASELINE}
    variants = {n: v for n, v in VARIANTS.items() if only is None or n in only}
    peers = {n: v for n, v in PEERS.items() if only is None or n in only}
    unknown = (only or set()) - set(VARIANTS) - set(PEERS)
    if unknown:
        raise SystemExit(f"--only: unknown names {sorted(unknown)}; expected from {sorted(VARIANTS) + sorted(PEERS)}")

    def calib_len(spec, context: int) -> int:
        length = context if spec is None else run_len if spec == "run" else int(spec)
        return min(length, context) if args.quick else length

    calib_docs = read_documents(args.calib)
    statistics: dict[int, object] = {}

    def stats_at(length: int):
        """Calibration statistics of `samples` + 1 sequences of `length` tokens (captured once per length)."""
        if length not in statistics:
            cal = make_windows(tok, calib_docs, length)
            ids = torch.cat([cal.long, cal.packed])[:samples + 1]
            if ids.shape[0] < 2:
                raise SystemExit(f"--calib {args.calib}: {ids.shape[0]} sequence(s) of {length} tokens; need 2+")
            t0 = time.perf_counter()
            statistics[length] = capture_statistics(model, ids.to(device), batch_size=1, model_id=str(args.model))
            log(f"captured {ids.shape[0] - 1} + 1 x {length} calibration tokens in {time.perf_counter() - t0:.1f}s")
        return statistics[length]

    artifacts: dict[tuple, object] = {}
    fits: dict[str, dict] = {}

    def calibrate(key: str, overrides: dict, length: int):
        """The artifact of `overrides` fitted on statistics of `length`-token sequences (memoised)."""
        settings = SolverSettings(**{**overrides, **layout})
        memo = (json.dumps(overrides, sort_keys=True), length)
        if memo not in artifacts:
            t0 = time.perf_counter()
            art, report = artifact_from_statistics(stats_at(length), settings, compare_alternatives=False)
            artifacts[memo] = art
            fits[f"{key} @ {length}"] = {"settings": json.loads(settings.model_dump_json()), "calib_len": length,
                                         "samples": samples, "seconds": round(time.perf_counter() - t0, 2),
                                         **report.summary()}
            log(f"calibrated {key} on {length}-token sequences in {time.perf_counter() - t0:.1f}s: K clips "
                f"{float(art.k_clip_ratio.mean()):.3f}, V {float(art.v_clip_ratio.mean()):.3f}")
        return artifacts[memo]

    had = hadamard(d).float()

    def peer_method(name: str, rotation: str, centered: bool, quantizer: str, context: int) -> KVMethod:
        if rotation == "hadamard" and not centered:
            return RowwiseInt2(name, name, k_rotation=had, v_rotation=had, k_clip=PEER_CLIPS[0], v_clip=PEER_CLIPS[1],
                               scale_format=SCALE_FORMAT, quantizer=quantizer)
        src = calibrate(f"unclipped, {'centered' if centered else 'uncentered'}",
                        {"clip": False, "center_keys": centered, "center_values": centered},
                        calib_len(PEER_CALIB_LEN, context))
        k_mean, v_mean = (src.key_mean("original"), src.value_mean("original")) if centered else (None, None)
        tables = {}
        for a, layer in enumerate(src.layer_ids.tolist()):
            k_rot = had.expand(h_kv, d, d) if rotation == "hadamard" else src.k_rotation[a]
            v_rot = had.expand(h_kv, d, d) if rotation == "hadamard" else src.v_rotation[a]
            tables[int(layer)] = LayerTables(k_rot, v_rot, torch.full((h_kv,), PEER_CLIPS[0]),
                                             torch.full((h_kv,), PEER_CLIPS[1]),
                                             None if k_mean is None else k_mean[a], None if v_mean is None else v_mean[a])
        return TableInt2(name, name, scale_format=SCALE_FORMAT, quantizer=quantizer, tables=tables)

    heldout_docs = read_documents(args.heldout)
    result = {"model": str(args.model), "geometry": {"layers": n_layers, "heads": h_q, "kv_heads": h_kv, "head_dim": d},
              "calib": str(args.calib), "heldout": str(args.heldout),
              "text_sha256": {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in (args.calib, args.heldout)},
              "sink": sink, "recent": recent,
              "scale_format": SCALE_FORMAT, "peer_clips": list(PEER_CLIPS), "baseline": BASELINE,
              "hadamard_baseline": HADAMARD_BASELINE, "variants": {n: [o, s] for n, (o, s) in variants.items()},
              "peers": {n: list(v) for n, v in peers.items()}, "run_calib_len": run_len, "calib_samples": samples,
              "contexts": {}, "fits": fits,
              "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dtype),
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "commit": git_commit(), "command": [sys.executable, *sys.argv] if argv is None else argv}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"long_context_{args.model.name}_{'-'.join(str(c) for c in args.contexts)}"  # one file per split run

    def save() -> None:
        result["seconds"] = round(time.perf_counter() - t_start, 1)
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (args.out / f"{stem}.md").write_text(markdown(result))
    for context in args.contexts:
        t_ctx = time.perf_counter()
        windows = make_windows(tok, heldout_docs, context, args.max_windows)
        eval_ids = torch.cat([windows.long, windows.packed])
        if eval_ids.shape[0] == 0:
            raise SystemExit(f"--heldout {args.heldout}: no full window of {context} tokens")
        # Built when their turn comes, so a run stopped by --max-seconds has spent nothing on what it skipped.
        builders = [("bf16", KVMethod)]
        builders += [(n, lambda n=n, spec=spec: peer_method(n, *spec, context)) for n, spec in peers.items()]
        builders += [(n, lambda n=n, o=o, spec=spec: ArtifactInt2(n, f"OSCAR artifact: {n}",
                                                                  artifact=calibrate(n, o, calib_len(spec, context))))
                     for n, (o, spec) in variants.items()]
        needles = None
        if args.needles:
            filler = eval_ids[torch.arange(args.needles) % eval_ids.shape[0]]
            deepest = (sink + 16) / context  # just past the sink: the oldest INT2 token a query reads
            needles = passkey_batch(tok, filler, [deepest], seed=context)
        bs = args.batch_size or (1 if context >= 8192 else 2 if context >= 4096 else 4)
        rows: dict[str, dict] = {}
        entry = result["contexts"][str(context)] = {
            "windows": int(eval_ids.shape[0]), "long_windows": int(windows.long.shape[0]),
            "needles": args.needles, "needle_position": None if needles is None else needles.needle_positions[0],
            "batch_size": bs, "rows": rows, "skipped": []}
        for name, build in builders:
            if args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds:
                entry["skipped"].append(name)
                continue
            t0 = time.perf_counter()
            m = build()
            nll, _ = method_nll(model, m, eval_ids, bs, sink, recent, collect_stats=False)
            row = {"bits_128k": m.effective_bits(131072, d, sink, recent),
                   "bits_at_context": m.effective_bits(context, d, sink, recent),
                   "window_nll": nll.double().mean(dim=1).tolist()}
            if needles is not None:
                pk = passkey_scores(model, m, needles, sink, recent)
                acc = pk["per_needle"]["accuracy"]  # mean over needles: the unit of its interval
                row.update(passkey_accuracy=sum(acc) / len(acc), passkey_key_token_accuracy=pk["key_token_accuracy"],
                           passkey_keys_exact=pk["keys_exact"],
                           passkey_key_nll=pk["key_nll"], needle_accuracy=pk["per_needle"]["accuracy"],
                           needle_nll=pk["per_needle"]["nll"])
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows[name] = row
            compare(rows)
            save()  # after every row: a cut run keeps it
            log(f"{context}: {name}: {row['seconds']}s")
        entry["seconds"] = round(time.perf_counter() - t_ctx, 1)
        save()
        if entry["skipped"]:
            log(f"{context}: --max-seconds {args.max_seconds} reached; skipped {entry['skipped']}")
        log(f"context {context} done in {time.perf_counter() - t_ctx:.1f}s; wrote {args.out / stem}.json/.md")
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    """One table per context: ppl, deltas with intervals, passkey at the deepest INT2 position, bits at 128K."""
    g = result["geometry"]
    lines = [f"{result['model']} ({g['layers']} layers, {g['heads']}/{g['kv_heads']} heads, head_dim {g['head_dim']}); "
             f"{result['scale_format']} scales, sink {result['sink']} / recent {result['recent']}; calibration "
             f"{result['calib_samples']} sequences of `{Path(result['calib']).name}`, held out `{Path(result['heldout']).name}`; "
             f"{result['device_name']}, commit {result['commit']}.", "",
             f"Intervals: paired 95 % bootstrap over windows (ppl) or needles (passkey). Baseline: {result['baseline']}.",
             ""]
    for context, c in result["contexts"].items():
        lines += [f"### {context} tokens: {c['windows']} windows ({c['long_windows']} single-document), "
                  f"{c['needles']} needles at position {c['needle_position']}", "",
                  "| cache | bits@128K | ppl | vs BF16 | vs baseline | vs Hadamard + clip centered | passkey acc | "
                  "vs baseline (points) |", "|---|---|---|---|---|---|---|---|"]

        def cell(r: dict, key: str) -> str:
            v = r.get(key)
            return "" if v is None else f"{v['ppl_delta_pct']:+.2f} % [{v['ci95'][0]:+.2f}, {v['ci95'][1]:+.2f}]"

        for name, r in c["rows"].items():
            pk = r.get("passkey_vs_baseline")
            lines.append(f"| {name} | {r['bits_128k']:.3f} | {r['ppl']:.4f} | {cell(r, 'vs_bf16')} | "
                         f"{cell(r, 'vs_baseline')} | {cell(r, 'vs_hadamard')} | "
                         + ("" if "passkey_accuracy" not in r else f"{100 * r['passkey_accuracy']:.1f} %") + " | "
                         + ("" if pk is None else f"{100 * pk['delta']:+.1f} [{100 * pk['ci95'][0]:+.1f}, "
                                                  f"{100 * pk['ci95'][1]:+.1f}]") + " |")
        if c.get("skipped"):
            lines += ["", f"Not evaluated (--max-seconds reached): {'; '.join(c['skipped'])}."]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # study_common beside this file
    sys.exit(main())
