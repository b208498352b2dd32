#!/usr/bin/env python3
"""Perplexity against far-token retrieval, per quantizer and clip choice, in the recipe's layout (ue5m3, 128/1024).

For one trained fixture: calibrate OSCAR with each quantizer (`uniform_minmax`, `uniform_unbiased`) and without
clipping, then measure every cache three ways on held-out text, each with a paired 95 % bootstrap interval:
- perplexity over `--max-windows` windows (teacher-forced, the decoder's three segments);
- a passkey probe with `--needles` needles in the INT2 history (key-token accuracy and key NLL, per needle);
- a repeated-passage probe: a span of the INT2 history copied to the end of the window, scored by its NLL there
  (what induction-style retrieval reads; no template).
Every cache here costs the same bits (ue5m3 scales, 128/1024 windows).

    python3 tools/retrieval_study.py --model oscar_calib/fixtures/tiny-qwen3 --context 4096 --needles 256 --out OUT

Writes `retrieval_study_<model>_<context>.json` and `.md`. docs/quality.md ("Far-token retrieval") quotes them.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from study_common import fixture_parser, load_fixture

SPAN = 256  # tokens of the repeated passage


def log(msg: str) -> None:
    print(f"[retrieval_study {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def paired_ci(a: list[float], b: list[float], n_boot: int = 2000, seed: int = 0) -> list[float]:
    """95 % percentile bootstrap interval of mean(a) - mean(b), items resampled together."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    idx = torch.randint(0, x.numel(), (n_boot, x.numel()), generator=torch.Generator().manual_seed(seed))
    d = x[idx].mean(dim=1) - y[idx].mean(dim=1)
    return [float(d.quantile(0.025)), float(d.quantile(0.975))]


def repeated_passages(windows: torch.Tensor, sink: int, recent: int, span: int = SPAN) -> torch.Tensor:
    """Each window `[T]` with its last `span` tokens replaced by a span of its INT2 history (at a depth that
    varies over windows), so that every copied token's source is in the history when it is read."""
    t = windows.shape[1]
    room = t - span - recent - sink - 16
    if room <= 0:
        raise ValueError(f"windows of {t} tokens leave no history for a {span}-token passage")
    out = windows.clone()
    for i in range(out.shape[0]):
        s0 = sink + 16 + (i * 997) % room
        out[i, t - span:] = windows[i, s0:s0 + span]
    return out


def main(argv: list[str] | None = None) -> int:
    p = fixture_parser(__doc__.split("\n\n")[0])
    p.add_argument("--needles", type=int, default=256)
    args = p.parse_args(argv)

    from oscar_calib.analysis.evaluate import make_windows, method_nll, read_documents
    from oscar_calib.analysis.methods import ArtifactInt2, KVMethod, RowwiseInt2, hadamard
    from oscar_calib.analysis.probes import passkey_batch, passkey_scores
    from oscar_calib.calibration.calibrate import calibrate_model
    from oscar_calib.config import SolverSettings
    from runtime_kernels.format import DEFAULT_FORMAT

    t_start = time.perf_counter()
    tok, model, device, dtype = load_fixture(args.model)
    fmt = DEFAULT_FORMAT.per_token()  # the recipe's windows, a token-granular history
    sink, recent, t = fmt.sink_tokens, fmt.recent_tokens, args.context
    d = model.config.head_dim

    cal = make_windows(tok, read_documents(args.model / "calib.txt"), t)
    ids = torch.cat([cal.long, cal.packed])[:args.calib_samples].to(device)
    configs = {"oscar, fitted clips, uniform_minmax": {"quantizer": "uniform_minmax"},
               "oscar, fitted clips, uniform_unbiased (default)": {"quantizer": "uniform_unbiased"},
               "oscar, no clip": {"clip": False, "quantizer": "uniform_minmax"}}
    assert SolverSettings().kv_format.quantizer == "uniform_unbiased", "the default row's label names the default quantizer"
    had = hadamard(d).float()
    methods = [KVMethod(),
               RowwiseInt2("hadamard-clip, uniform_minmax", k_rotation=had, v_rotation=had, k_clip=0.96, v_clip=0.92,
                           fmt=fmt.with_(quantizer="uniform_minmax")),
               RowwiseInt2("hadamard-clip, uniform_unbiased", k_rotation=had, v_rotation=had, k_clip=0.96,
                           v_clip=0.92, fmt=fmt.with_(quantizer="uniform_unbiased"))]
    for name, overrides in configs.items():
        art = calibrate_model(model, ids, SolverSettings(**overrides), compare_alternatives=False)
        assert (art.kv_format.sink_tokens, art.kv_format.recent_tokens, art.scale_format) == (sink, recent, "ue5m3")
        methods.append(ArtifactInt2(name, artifact=art))
        log(f"calibrated {name}: K clips {art.k_clip_ratio.mean():.3f}, V {art.v_clip_ratio.mean():.3f}")

    windows = make_windows(tok, read_documents(args.model / "heldout.txt"), t, args.max_windows)
    eval_ids = torch.cat([windows.long, windows.packed])
    copies = repeated_passages(eval_ids, sink, recent)
    filler = eval_ids[torch.arange(args.needles) % eval_ids.shape[0]]
    lo, hi = (sink + 16) / t, 1.0 - (recent + 64) / t  # needles inside the INT2 history
    needles = passkey_batch(tok, filler, [lo + (hi - lo) * i / max(args.needles - 1, 1)
                                          for i in range(args.needles)], seed=0)
    rows = {}
    for m in methods:
        t0 = time.perf_counter()
        nll, _ = method_nll(model, m, eval_ids, fmt, args.batch_size, collect_stats=False)
        cnll, _ = method_nll(model, m, copies, fmt, args.batch_size, collect_stats=False)
        pk = passkey_scores(model, m, needles, fmt)
        rows[m.name] = {
            "bits_32k": m.effective_bits(32768, d, fmt), "bits_128k": m.effective_bits(131072, d, fmt),
            "window_nll": nll.double().mean(dim=1).tolist(),
            "copy_nll": cnll[:, t - SPAN - 1:].double().mean(dim=1).tolist(),  # the passage's tokens, predicted
            "needle_accuracy": pk["per_needle"]["accuracy"], "needle_nll": pk["per_needle"]["nll"]}
        log(f"{m.name}: {time.perf_counter() - t0:.1f}s")

    def summary(name: str, ref: str) -> dict:
        r, b = rows[name], rows[ref]
        mean = lambda v: sum(v) / len(v)  # noqa: E731
        ppl_ci = paired_ci(r["window_nll"], b["window_nll"])
        return {"ppl": float(torch.exp(torch.tensor(mean(r["window_nll"])))),
                "ppl_delta_pct": 100 * float(torch.expm1(torch.tensor(mean(r["window_nll"]) - mean(b["window_nll"])))),
                "ppl_delta_ci95": [100 * float(torch.expm1(torch.tensor(x))) for x in ppl_ci],
                "copy_nll": mean(r["copy_nll"]), "copy_nll_delta": mean(r["copy_nll"]) - mean(b["copy_nll"]),
                "copy_nll_delta_ci95": paired_ci(r["copy_nll"], b["copy_nll"]),
                "passkey_accuracy": mean(r["needle_accuracy"]),
                "passkey_delta": mean(r["needle_accuracy"]) - mean(b["needle_accuracy"]),
                "passkey_delta_ci95": paired_ci(r["needle_accuracy"], b["needle_accuracy"]),
                "key_nll": mean(r["needle_nll"]), "key_nll_delta_ci95": paired_ci(r["needle_nll"], b["needle_nll"])}

    result = {"model": str(args.model), "context": t, "sink": sink, "recent": recent, "needles": args.needles,
              "windows": eval_ids.shape[0], "span": SPAN, "rows": rows,
              "vs_bf16": {n: summary(n, "bf16") for n in rows},
              "vs_hadamard_clip": {n: summary(n, "hadamard-clip, uniform_minmax") for n in rows},
              "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dtype),
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "seconds": round(time.perf_counter() - t_start, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"retrieval_study_{args.model.name}_{t}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    bits = methods[1].effective_bits(131072, d, fmt)
    lines = [f"{args.model.name}, {t}-token windows, ue5m3 scales, sink {sink} / recent {recent} (every INT2 row "
             f"{bits:.3f} bits per element at 128K); {eval_ids.shape[0]} windows, {args.needles} needles, {SPAN}-token repeated "
             f"passages; {result['device_name']}. Intervals: paired 95 % bootstrap against Hadamard + clip "
             "(uniform_minmax).", "",
             "| cache | ppl | vs BF16 | vs Hadamard + clip | passkey key-token acc. | vs Hadamard + clip (points) | "
             "key NLL | repeated-passage NLL | vs Hadamard + clip |", "|---|---|---|---|---|---|---|---|---|"]
    for n in rows:
        a, h = result["vs_bf16"][n], result["vs_hadamard_clip"][n]
        ci = h["ppl_delta_ci95"]
        pci = [100 * x for x in h["passkey_delta_ci95"]]
        cci = h["copy_nll_delta_ci95"]
        lines.append(f"| {n} | {a['ppl']:.4f} | {a['ppl_delta_pct']:+.2f} % | {h['ppl_delta_pct']:+.2f} % "
                     f"[{ci[0]:+.2f}, {ci[1]:+.2f}] | {100 * a['passkey_accuracy']:.1f} % | "
                     f"{100 * h['passkey_delta']:+.1f} "
                     f"[{pci[0]:+.1f}, {pci[1]:+.1f}] | {a['key_nll']:.3f} | {a['copy_nll']:.3f} | "
                     f"{h['copy_nll_delta']:+.3f} "
                     f"[{cci[0]:+.3f}, {cci[1]:+.3f}] |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
