"""Pool the passkey (or multi-key) probes of several `tools/recipe_study.py` results (one per needle seed) and compare each row
with a reference row: token accuracy over every needle, and the paired 95 % bootstrap interval of the difference
(needles resampled together, so each row is compared on the same needles).

    python3 tools/passkey_compare.py R_seed0.json R_seed1.json --reference "hadamard global clips, centered, min-max"
    python3 tools/passkey_compare.py R_seed0.json --probe multikey --reference bf16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def pooled(paths: list[Path], probe: str = "passkey") -> dict[str, torch.Tensor]:
    """Row -> per-needle accuracy `[needles of every file]`, for the rows every file measured."""
    runs = []
    for p in paths:
        result = json.loads(p.read_text())
        if probe not in result:
            raise SystemExit(f"{p}: no '{probe}' probe in this result")
        runs.append(result[probe]["scores"])
    rows = [r for r in runs[0] if all(r in run for run in runs)]
    return {r: torch.tensor(sum((run[r]["per_needle"]["accuracy"] for run in runs), []), dtype=torch.float64)
            for r in rows}


def paired_ci(a: torch.Tensor, b: torch.Tensor, n_boot: int = 10000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of mean(a - b) over needles resampled with replacement (points)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, a.numel(), (n_boot, a.numel()), generator=gen)
    diffs = (a - b)[idx].mean(dim=1)
    lo, hi = torch.quantile(diffs, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return 100 * lo, 100 * hi


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--reference", required=True, help="the row every other is compared with")
    p.add_argument("--probe", default="passkey", choices=("passkey", "multikey"))
    args = p.parse_args(argv)
    rows = pooled(args.results, args.probe)
    if args.reference not in rows:
        p.error(f"--reference {args.reference!r}: not a row of every file (rows: {', '.join(rows)})")
    ref = rows[args.reference]
    print(f"{ref.numel()} needles from {len(args.results)} file(s); difference vs `{args.reference}`, paired 95 % "
          "bootstrap interval over needles\n")
    print(f"| cache | {args.probe} | vs reference |\n|---|---|---|")
    for name, acc in rows.items():
        diff = "" if name == args.reference else (
            f"{100 * float((acc - ref).mean()):+.1f} [{paired_ci(acc, ref)[0]:+.1f}, {paired_ci(acc, ref)[1]:+.1f}]")
        print(f"| {name} | {100 * float(acc.mean()):.1f} % | {diff} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
