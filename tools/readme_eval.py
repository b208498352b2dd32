#!/usr/bin/env python3
"""The fixtures' quality tables (docs/quality.md): calibrate OSCAR (per head and per layer) and compare every KV method.

Same computation as `oscar-calib eval` (it calls the same entry point, `analysis.eval_job.run_eval`), without the Typer CLI, so it also
runs where only torch + transformers (+ pydantic) are installed. Writes `eval_<context>.json`,
`eval_<context>.md` (a markdown table) and, when matplotlib is there, `eval_<context>.png` into `--out`.

    python3 tools/readme_eval.py --model oscar_calib/fixtures/tiny-qwen3 --context 4096 --out /tmp/eval
"""

from __future__ import annotations

import json
import sys
import time

import torch
from study_common import fixture_parser, load_fixture, solver_settings

MAIN_ROW = "oscar (default clips, fp16)"  # the default solver at the main table's 64/256 windows and fp16 scales
# Windows that ue5m3 scales (2.125 history bits at d = 128) pay for within fp16-scale 64/256's 2.284 bits at 128K.
EQUAL_BITS_LAYOUTS = ((64, 256), (128, 1024), (128, 1280))


def markdown_table(result: dict) -> str:
    lines = [f"Context {result['context']} tokens (BF16 sink {result['sink']} + recent {result['recent']}), "
             f"{result['windows']['long']} single-document + {result['windows']['packed']} packed windows, "
             f"{result['tokens_scored']:,} tokens scored; {result.get('device_name', '')}.", "",
             "| method | bits/elem @32K | @128K | ppl | vs BF16 | 95 % CI | ppl long docs | "
             "ppl packed | attn KL | attn out err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["methods"]:
        d, ci = r["ppl_delta_pct"], r.get("ppl_delta_ci95")
        lines.append(f"| {r['name']} | {r['effective_bits_32k']:.3f} | {r['effective_bits_128k']:.3f} | {r['ppl']:.3f} | "
                     f"{'' if d is None else f'{d:+.2f}%'} | {'' if not ci else f'[{ci[0]:+.2f}, {ci[1]:+.2f}]'} | "
                     f"{r['ppl_long']:.3f} | {r['ppl_packed']:.3f} | {r['mean_attn_kl']:.4f} | {r['mean_out_rel_err']:.4f} |")
    for sweep in result.get("window_sweep", []):
        lines.append(f"| {sweep['name']} @ sink {sweep['sink']} / recent {sweep['recent']} | {sweep['bits_32k']:.3f} | "
                     f"{sweep['bits_128k']:.3f} | {sweep['ppl']:.3f} | {sweep['ppl_delta_pct']:+.2f}% | "
                     f"[{sweep['ci95'][0]:+.2f}, {sweep['ci95'][1]:+.2f}] | | | | |")
    for probe in result.get("probes", []):
        lines.append("")
        lines.append(f"Passkey probe, {probe['needles']} needles in the INT2 history of {probe['context']}-token windows "
                     f"(sink {probe.get('sink')} / recent {probe.get('recent')}):")
        for name, r in probe["passkey"].items():
            v = probe["verbatim"].get(name) if isinstance(probe["verbatim"], dict) else None
            lines.append(f"- {name}: {100 * r['key_token_accuracy']:.1f}% of key tokens, {100 * r['keys_exact']:.0f}% "
                         f"of keys exact, key NLL {r['key_nll']:.3f}"
                         + ("" if not isinstance(v, float) else f"; verbatim recall through the runtime {100 * v:.1f}%"))
    agree = result.get("generation_agreement") or {}
    if agree.get("status") == "ok":
        lines.append("")
        for name, a in agree["methods"].items():
            lines.append(f"- {name} through the real runtime (OscarCache, page {agree['page_size']}): greedy "
                         f"next-token match with BF16 {100 * a['match_rate']:.1f}% over {agree['steps']} steps x "
                         f"{agree['windows']} windows, first divergence at step {a['first_divergence_mean']:.1f} "
                         "on average.")
    elif agree:
        lines += ["", f"- generation agreement: {agree.get('status')} ({agree.get('reason', '')})"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = fixture_parser(__doc__.split("\n\n")[0])
    p.add_argument("--generation-steps", type=int, default=128)
    p.add_argument("--generation-windows", type=int, default=2)
    p.add_argument("--variants", default="default",
                   help="OSCAR rows: 'default' (the shipped SolverSettings only) or 'all' (the candidates the "
                        "defaults were chosen from)")
    p.add_argument("--window-sweep", action="store_true",
                   help="also evaluate hadamard-clip and the default at sink/recent 64/512, 128/1024, 128/2048")
    p.add_argument("--equal-bits", action="store_true",
                   help="also calibrate and evaluate ue5m3 scales (16 bits per group) with the wider windows that "
                        "cost the same bits at 128K as fp16 scales at 64/256, against hadamard-clip in the same layout")
    p.add_argument("--probes", type=int, default=0,
                   help="passkey needles in the INT2 history (and a verbatim-recall check through the runtime) for "
                        "BF16, hadamard-clip and the default, in the main table's windows and, with --equal-bits, in "
                        "the 128/1024 layout")
    args = p.parse_args(argv)

    from oscar_calib.analysis.eval_job import EvalRequest, calibration_ids, eval_methods, run_eval
    from oscar_calib.analysis.evaluate import generation_agreement, make_windows, read_documents
    from oscar_calib.analysis.methods import standard_methods
    from oscar_calib.calibration.calibrate import calibrate_model_with_report
    from runtime_kernels.format import KVFormat

    # The main table's windows (64/256, token-granular history) and fp16 scales.
    main_fmt = KVFormat(sink_tokens=64, recent_tokens=256, page_size=1, group_size=None, scale_format="float16",
                        quantizer="uniform_minmax", centered=False)

    def windows_of(sink: int, recent: int) -> KVFormat:
        return main_fmt.with_(sink_tokens=sink, recent_tokens=recent)

    def log(msg: str) -> None:
        print(f"[readme_eval {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    tok, model, device, dtype = load_fixture(args.model)
    ids = calibration_ids(tok, args.model / "calib.txt", args.context, args.calib_samples).to(device)
    # The main table's rows share its windows (64/256) and fp16 scales, so its bits are equal; the recipe itself
    # (ue5m3 scales, 128/1024 windows) is a row of the --equal-bits sweep.
    variants = {MAIN_ROW: {}}
    if args.variants == "all":
        variants.update({
            "oscar attn_kl, uncentered, min-max": {"key_clip_objective": "attn_kl", "centered": False,
                                             "quantizer": "uniform_minmax"},
            "oscar min-max": {"quantizer": "uniform_minmax"},
            "oscar out_err": {"key_clip_objective": "out_err", "centered": False},
            "oscar out_err centered": {"key_clip_objective": "out_err", "centered": True},
            "oscar block_out centered": {"key_clip_objective": "block_out", "centered": True},
            "oscar-layer out_err centered": {"granularity": "layer", "key_clip_objective": "out_err",
                                           "centered": True},
            "oscar ue5m3": {"scale_format": "ue5m3"},
        })
    # Variants calibrated for other windows, evaluated in those windows (rows of the window sweep).
    layouts = {}
    if args.equal_bits:
        for sink, recent in EQUAL_BITS_LAYOUTS[1:]:  # 64/256 is the main table's "oscar ue5m3"
            layouts[f"oscar ue5m3 [{sink}/{recent}]"] = {"scale_format": "ue5m3", "sink_tokens": sink,
                                                          "recent_tokens": recent}
        layouts["oscar fp16 uncentered attn_kl minmax [128/1024]"] = {
            "key_clip_objective": "attn_kl", "centered": False,
            "sink_tokens": 128, "recent_tokens": 1024, "scale_format": "float16", "quantizer": "uniform_minmax"}
        layouts["oscar ue5m3 minmax [128/1024]"] = {"scale_format": "ue5m3", "sink_tokens": 128, "recent_tokens": 1024,
                                                     "quantizer": "uniform_minmax"}
        layouts["oscar fp16 [128/1024]"] = {"sink_tokens": 128, "recent_tokens": 1024, "scale_format": "float16"}
    variants.update(layouts)
    for name in variants:
        if name not in layouts:
            variants[name] = {"sink_tokens": 64, "recent_tokens": 256, "scale_format": "float16", **variants[name]}
    arts, fits = {}, {}
    for name, overrides in variants.items():
        t0 = time.perf_counter()
        arts[name], report = calibrate_model_with_report(model, ids, solver_settings(**overrides),
                                                         compare_alternatives=False)
        fits[name] = report.summary()
        log(f"calibrated {name} on {ids.shape[0]} x {args.context} tokens in {time.perf_counter() - t0:.1f}s: "
            f"K clips {fits[name]['k_clip_ratio_mean']:.3f} (min {fits[name]['k_clip_ratio_min']:.2f}), "
            f"V {fits[name]['v_clip_ratio_mean']:.3f}; {fits[name]['clip_at_grid_edge']} at a grid edge")
    windows = make_windows(tok, read_documents(args.model / "heldout.txt"), args.context, args.max_windows)
    t0 = time.perf_counter()
    main_arts = {k: v for k, v in arts.items() if k not in layouts}
    # The main table through the entry point `oscar-calib eval` calls (without its centered peer row, and with the
    # agreement below over every artifact, the window-sweep ones included).
    main_request = EvalRequest(fmt=main_fmt, simulated=main_fmt, batch_size=args.batch_size, generation_steps=0,
                               generation_windows=0, probes=0)
    result = run_eval(model, tok, eval_methods(model.config.head_dim, main_fmt, main_arts, with_centered_peer=False),
                      main_arts, windows, main_request)
    log(f"evaluated in {time.perf_counter() - t0:.1f}s")
    result["fits"] = fits
    head_dim = model.config.head_dim
    sweep: list[tuple[object, int, int]] = []  # (method, sink, recent)
    if args.window_sweep:
        chosen = [m for m in standard_methods(head_dim, main_fmt, main_arts) if m.name in ("hadamard-clip", MAIN_ROW)]
        sweep += [(m, sink, recent) for sink, recent in ((64, 512), (128, 1024), (128, 2048)) for m in chosen]
    if args.equal_bits:
        from oscar_calib.analysis.methods import ArtifactInt2, RowwiseInt2, hadamard

        had = hadamard(head_dim).float()
        for sink, recent in EQUAL_BITS_LAYOUTS:
            sweep.append((RowwiseInt2("hadamard-clip ue5m3", k_rotation=had, v_rotation=had, k_clip=0.96,
                                      v_clip=0.92, fmt=main_fmt.with_(scale_format="ue5m3")), sink, recent))
        for name in layouts:
            art = arts[name]
            sweep.append((ArtifactInt2(name, artifact=art), art.kv_format.sink_tokens, art.kv_format.recent_tokens))
    if sweep:
        from oscar_calib.analysis.evaluate import bootstrap_delta_ci, method_nll

        base = {r["name"]: r for r in result["methods"]}
        bf16 = torch.tensor(base["bf16"]["window_nll"], dtype=torch.float64)
        all_w = torch.cat([windows.long, windows.packed])
        result["window_sweep"] = []
        for m, sink, recent in sweep:
            nll, _ = method_nll(model, m, all_w, windows_of(sink, recent), args.batch_size, collect_stats=False)
            win = nll.double().mean(dim=1)
            result["window_sweep"].append({
                "name": m.name, "sink": sink, "recent": recent, "ppl": float(torch.exp(nll.double().mean())),
                "ppl_delta_pct": 100 * float(torch.expm1(win.mean() - bf16.mean())),
                "ci95": list(bootstrap_delta_ci(win, bf16)), "window_nll": win.tolist(),
                "bits_32k": m.effective_bits(32768, head_dim, windows_of(sink, recent)),
                "bits_128k": m.effective_bits(131072, head_dim, windows_of(sink, recent))})
            log(f"window sweep {sink}/{recent} {m.name}: {result['window_sweep'][-1]['ppl_delta_pct']:+.2f}%")
    if args.probes:
        from oscar_calib.analysis.methods import ArtifactInt2, KVMethod, RowwiseInt2, hadamard
        from oscar_calib.analysis.probes import run_probes

        had = hadamard(head_dim).float()
        all_w = torch.cat([windows.long, windows.packed])
        main = [m for m in standard_methods(head_dim, main_fmt, main_arts)
                if m.name in ("bf16", "hadamard-clip", MAIN_ROW)]
        result["probes"] = [run_probes(model, tok, main, {MAIN_ROW: arts[MAIN_ROW]}, all_w,
                                       args.probes, main_fmt)]
        key = "oscar ue5m3 [128/1024]"
        if key in arts:
            wide = [KVMethod(), RowwiseInt2("hadamard-clip ue5m3", k_rotation=had, v_rotation=had, k_clip=0.96,
                                            v_clip=0.92, fmt=main_fmt.with_(scale_format="ue5m3")),
                    ArtifactInt2(key, artifact=arts[key])]
            result["probes"].append(run_probes(model, tok, wide, {key: arts[key]}, all_w, args.probes,
                                               windows_of(128, 1024)))
        log(f"probes: {json.dumps(result['probes'])}")
    if args.generation_steps:
        try:
            gw = torch.cat([windows.long, windows.packed])[:args.generation_windows]
            result["generation_agreement"] = generation_agreement(model, arts, gw, args.generation_steps)
        except Exception as exc:  # noqa: BLE001 - the table is still worth keeping
            result["generation_agreement"] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
        log(f"generation agreement: {result['generation_agreement']}")
    result.update({"model": str(args.model), "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   "dtype": str(dtype), "torch": torch.__version__,
                   "transformers": __import__("transformers").__version__})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"eval_{args.context}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"eval_{args.context}.md").write_text(markdown_table(result))
    print(markdown_table(result))
    try:
        from oscar_calib.analysis.eval_plot import write_plot

        write_plot(result, args.out / f"eval_{args.context}.png")
    except Exception as exc:  # noqa: BLE001 - no matplotlib / typer on this machine: the JSON and table remain
        log(f"no plot: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
