"""Each KV head's INT2-history attention mass from a statistics file, and the heads each threshold would give
Hadamard keys (`oscar-calib run/refit --hadamard-key-mass`): the numbers behind docs/recipe.md's threshold.

    python3 tools/history_mass.py ART/oscar_stats.safetensors --thresholds 0.2,0.25,0.3 [--json OUT.json] [--costs]

--costs also fits key clips for both bases in every layer (the run's own settings and held-out objective) and prints
each layer's held-out key error with the attention-aware rotation and with Hadamard: what a swap costs the average
query, beside how much the layer's queries read the history.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stats", type=Path, help="oscar_stats.safetensors written by `oscar-calib run`")
    p.add_argument("--thresholds", default="0.2,0.25,0.3")
    p.add_argument("--sink", type=int, default=None, help="default: the format's (DEFAULT_FORMAT)")
    p.add_argument("--recent", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--costs", action="store_true", help="held-out key error of each basis, per layer (slow on a CPU)")
    args = p.parse_args(argv)

    from oscar_calib.calibration.calibrate import history_masses
    from oscar_calib.calibration.key_basis import hadamard_key_heads
    from oscar_calib.calibration.stats_file import load_statistics
    from oscar_calib.config import SolverSettings
    from oscar_calib.zoo.model_card import head_list

    stats = load_statistics(args.stats)
    windows = {k: v for k, v in (("sink_tokens", args.sink), ("recent_tokens", args.recent)) if v is not None}
    settings = SolverSettings(kv_format=windows)
    fmt = settings.kv_format
    masses = history_masses(stats, stats.layer_ids, fmt.sink_tokens, fmt.recent_tokens)
    per_head = {layer: (None if m is None else [round(float(x), 4) for x in m]) for layer, m in masses.items()}
    print("layer  mass (mean of KV heads; per head)")
    for layer, m in masses.items():
        print(f"{layer:5d}  " + ("-" if m is None else f"{float(m.mean()):.3f}  " + " ".join(f"{x:.3f}" for x in m)))
    picks = {}
    for tau in (float(t) for t in args.thresholds.split(",")):
        heads = hadamard_key_heads(masses, tau)
        picks[str(tau)] = {str(layer): hs for layer, hs in heads.items()}
        n = sum(map(len, heads.values()))
        print(f"--hadamard-key-mass {tau:g}: {n} KV heads (layer:heads) {head_list(heads) or 'none'}")
    report = {"stats": str(args.stats), "history_mass": per_head, "hadamard_heads": picks}
    if args.costs:
        report["key_error"] = key_costs(stats, settings)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def key_costs(stats, settings) -> dict[str, dict[str, float]]:
    """Layer -> held-out key error (the settings' objective, fitted clips, mean over KV heads) with the
    attention-aware rotation and with Hadamard, as `artifact_from_statistics` fits them."""
    from oscar_calib.calibration.calibrate import _fit_all, _solve_all, session_means, with_hadamard_keys

    layer_ids = stats.layer_ids
    k_rot, _, v_rot, _ = _solve_all(stats, layer_ids, settings, settings.value_target, settings.granularity)
    means = session_means(stats, layer_ids)
    o_weights = stats.o_weights if settings.key_clip_objective == "block_out" else None
    keys_only = settings.model_copy(update={"v_clip_grid": (1.0,)})  # values are not compared: a short search
    out = {}
    every = {layer: list(range(k_rot.shape[1])) for layer in layer_ids}
    for name, rot in (("attention_aware", k_rot), ("hadamard", with_hadamard_keys(k_rot, layer_ids, every))):
        fits = _fit_all(stats, layer_ids, rot, v_rot, keys_only, means=means, o_weights=o_weights)
        for layer in layer_ids:
            out.setdefault(str(layer), {})[name] = float(fits[layer].k_errors.min(dim=0).values.mean())
    print("layer  key error: attention-aware  hadamard  ratio")
    for layer, e in out.items():
        e["ratio"] = e["hadamard"] / e["attention_aware"] if e["attention_aware"] > 0 else float("nan")
        print(f"{int(layer):5d}  {e['attention_aware']:.4g}  {e['hadamard']:.4g}  {e['ratio']:.3f}")
    return out


if __name__ == "__main__":
    sys.exit(main())
