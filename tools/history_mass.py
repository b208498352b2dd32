"""Each layer's INT2-history attention mass from a statistics file, and the layers each threshold would give
Hadamard keys (`oscar-calib run/refit --hadamard-key-mass`): the numbers behind docs/recipe.md's threshold.

    python3 tools/history_mass.py ART/oscar_stats.safetensors --thresholds 0.2,0.25,0.3 [--json OUT.json]
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
    args = p.parse_args(argv)

    from oscar_calib.calibration.calibrate import history_hadamard_keys
    from oscar_calib.calibration.job import layer_list
    from oscar_calib.calibration.key_basis import hadamard_key_layers
    from oscar_calib.calibration.stats_file import load_statistics
    from oscar_calib.config import SolverSettings

    stats = load_statistics(args.stats)
    windows = {k: v for k, v in (("sink_tokens", args.sink), ("recent_tokens", args.recent)) if v is not None}
    masses, _ = history_hadamard_keys(stats, stats.layer_ids, SolverSettings(hadamard_key_mass=0.0, **windows))
    mean = {layer: (None if m is None else round(float(m.mean()), 4)) for layer, m in masses.items()}
    print("layer  mass (mean of KV heads; per head)")
    for layer, m in masses.items():
        print(f"{layer:5d}  " + ("-" if m is None else f"{float(m.mean()):.3f}  " + " ".join(f"{x:.3f}" for x in m)))
    picks = {}
    for tau in (float(t) for t in args.thresholds.split(",")):
        layers = hadamard_key_layers(masses, tau)
        picks[str(tau)] = layers
        print(f"--hadamard-key-mass {tau:g}: layers {layer_list(layers) or 'none'}")
    if args.json:
        args.json.write_text(json.dumps({"stats": str(args.stats), "history_mass": mean, "hadamard_layers": picks},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
