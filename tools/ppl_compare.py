"""Compare every row of a `tools/recipe_study.py` result with one reference row: the perplexity change against it
at each context, with the paired 95 % bootstrap interval over the same held-out windows (`paired_pct_ci`).

    python3 tools/ppl_compare.py OUT/recipe_study_smol.json --reference heads0.30 [--out TABLE.md]

A negative change means the reference row is worse than that row; a row the reference beats beyond its interval
has both bounds positive.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_study import paired_pct_ci  # noqa: E402


def compare(result: dict, reference: str) -> dict[str, dict[str, list[float]]]:
    """Context -> row -> [change %, lo, hi] of that row's perplexity against the reference row's."""
    out = {}
    for ctx, block in result["contexts"].items():
        rows = {m["name"]: torch.tensor(m["window_nll"], dtype=torch.float64) for m in block["methods"]}
        if reference not in rows:
            raise SystemExit(f"--reference: no row {reference!r} at context {ctx}; rows: {', '.join(rows)}")
        ref = rows[reference]
        out[ctx] = {name: list(paired_pct_ci(nll, ref)) for name, nll in rows.items() if name != reference}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", type=Path, help="recipe_study_<model>.json")
    p.add_argument("--reference", required=True, help="the row every other is compared with")
    p.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    args = p.parse_args(argv)
    table = compare(json.loads(args.result.read_text()), args.reference)
    ctxs = list(table)
    lines = [f"Perplexity of each row against `{args.reference}` ({args.result.name}), paired 95 % bootstrap "
             "interval over the same windows", "",
             "| cache | " + " | ".join(f"{c}: vs {args.reference}" for c in ctxs) + " |",
             "|---|" + "---|" * len(ctxs)]
    for name in table[ctxs[0]]:
        cells = [table[c].get(name) for c in ctxs]
        lines.append(f"| {name} | " + " | ".join("" if x is None else f"{x[0]:+.2f} % [{x[1]:+.2f}, {x[2]:+.2f}]"
                                                   for x in cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
