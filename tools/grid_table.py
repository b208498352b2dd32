#!/usr/bin/env python3
"""The quality grid of issue 51 from `tools/recipe_study.py` results: one result per cell (model x calibration text x
held-out domain), each judged the way the issue's "Done when" reads.

For every cell: the default row's perplexity change against BF16, against each equal-bits peer (paired 95 %
bootstrap interval over the same windows) and a verdict against the peers (`win`: below every peer beyond its
interval; `tie`: no peer beats it beyond its interval, at least one interval holds 0; `lose`: a peer beats it beyond
its interval); and, where the result has them, passkey, multi-key and multi-value accuracy of BF16, the default and
the best peer with the default's paired interval over needles against each.

    python3 tools/grid_table.py "SmolLM2 8K, prose calib, code held out=OUT1/recipe_study_smollm2-135m.json" ... \
        --default default --out bench/results/quality/grid.md

A peer is a row of at most the default's bits per element at 128K (`bits_128k` in the result). KIVI-2 with 128-token
key blocks spends more (fp16 scales and zeros: 2.495 bits at head_dim 64 against the default's 2.371, 2.309 against
2.185 at head_dim 256): it is compared and listed, but the verdict counts only the peers of equal bits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from passkey_compare import paired_ci  # noqa: E402
from recipe_study import KIVI, PER_LAYER, paired_pct_ci  # noqa: E402

BASELINE = "oscar global clips, centered, min-max"
PEERS = (PER_LAYER, BASELINE, "hadamard global clips, centered, min-max", KIVI)
PROBES = ("passkey", "multikey", "multivalue")


def verdict(deltas: dict[str, tuple[float, float, float]]) -> str:
    """`win` / `tie` / `lose` of the default against peers, from (change %, lo, hi) of the default vs each peer."""
    if any(lo > 0 for _, lo, _ in deltas.values()):
        return "lose"
    return "win" if all(hi < 0 for _, _, hi in deltas.values()) else "tie"


def cell(result: dict, default: str, context: str | None = None, bits_slack: float = 0.02) -> dict:
    """One cell's numbers: the default against BF16 and every peer of at most its bits (+ `bits_slack`) at `context`
    (default: the longest), and the probes."""
    ctx = context or max(result["contexts"], key=int)
    rows = {m["name"]: m for m in result["contexts"][ctx]["methods"]}
    if default not in rows:
        raise SystemExit(f"--default {default!r}: no such row at context {ctx}; rows: {', '.join(rows)}")
    nll = {n: torch.tensor(r["window_nll"], dtype=torch.float64) for n, r in rows.items()}
    d_bits = rows[default].get("bits_128k")
    compared, peers = {}, {}
    for name in PEERS:
        if name not in rows:
            continue
        compared[name] = paired_pct_ci(nll[default], nll[name])
        bits = rows[name].get("bits_128k")
        if d_bits is None or bits is None or bits <= d_bits + bits_slack:
            peers[name] = compared[name]
    out = {"context": int(ctx), "windows": int(nll[default].numel()), "bits_128k": d_bits,
           "bf16_ppl": float(torch.exp(nll["bf16"].mean())),
           "default_vs_bf16": list(paired_pct_ci(nll[default], nll["bf16"])),
           "peers_vs_bf16": {n: list(paired_pct_ci(nll[n], nll["bf16"])) for n in peers},
           "default_vs_peers": {n: list(v) for n, v in compared.items()}, "equal_bits_peers": list(peers),
           "peer_bits_128k": {n: rows[n].get("bits_128k") for n in compared},
           "verdict": verdict(peers) if peers else "none"}
    best = min(peers, key=lambda n: float(nll[n].mean())) if peers else None
    out["best_peer"] = best
    for probe in PROBES:
        scores = result.get(probe, {}).get("scores", {})
        if default not in scores or "bf16" not in scores:
            continue
        acc = {n: torch.tensor(s["per_needle"]["accuracy"], dtype=torch.float64) for n, s in scores.items()}
        entry = {"bf16": 100 * float(acc["bf16"].mean()), "default": 100 * float(acc[default].mean()),
                 "default_vs_bf16": [100 * float((acc[default] - acc["bf16"]).mean()),
                                     *paired_ci(acc[default], acc["bf16"])]}
        probed = [n for n in peers if n in acc]
        if probed:
            top = max(probed, key=lambda n: float(acc[n].mean()))
            entry.update({"best_peer": top, "peer": 100 * float(acc[top].mean()),
                          "default_vs_peer": [100 * float((acc[default] - acc[top]).mean()),
                                              *paired_ci(acc[default], acc[top])]})
        out[probe] = entry
    return out


def fmt(x: list[float]) -> str:
    return f"{x[0]:+.2f} % [{x[1]:+.2f}, {x[2]:+.2f}]"


def markdown(cells: dict[str, dict], default: str) -> str:
    lines = [f"Default row `{default}` in each cell; changes in held-out perplexity with paired 95 % bootstrap "
             "intervals over the same windows; probes in points with paired intervals over needles.", "",
             "| cell | ctx, windows | BF16 ppl | default vs BF16 | vs per-layer OSCAR | vs per-head OSCAR | "
             "vs Hadamard + clip | vs KIVI-2 (more bits) | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for label, c in cells.items():
        vs = [fmt(c["default_vs_peers"][p]) if p in c["default_vs_peers"] else "" for p in PEERS]
        lines.append(f"| {label} | {c['context']}, {c['windows']} | {c['bf16_ppl']:.3f} | {fmt(c['default_vs_bf16'])} | "
                     + " | ".join(vs) + f" | {c['verdict']} |")
    probes = [(label, p, c[p]) for label, c in cells.items() for p in PROBES if p in c]
    if probes:
        lines += ["", "| cell | probe | BF16 | default | default vs BF16 (points) | best peer | default vs it |",
                  "|---|---|---|---|---|---|---|"]
        for label, p, e in probes:
            dv = e["default_vs_bf16"]
            peer = e.get("best_peer", "")
            dp = e.get("default_vs_peer")
            lines.append(f"| {label} | {p} | {e['bf16']:.1f} % | {e['default']:.1f} % | {dv[0]:+.1f} [{dv[1]:+.1f}, "
                         f"{dv[2]:+.1f}] | {peer} {e.get('peer', float('nan')):.1f} % | "
                         + (f"{dp[0]:+.1f} [{dp[1]:+.1f}, {dp[2]:+.1f}]" if dp else "") + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cells", nargs="+", metavar="LABEL=RESULT.json")
    p.add_argument("--default", default="default", help="the default artifact's row (its --artifact name)")
    p.add_argument("--context", default=None, help="the context to judge (default: each result's longest)")
    p.add_argument("--out", type=Path, default=None, help="write the table here (.md) and its numbers (.json)")
    args = p.parse_args(argv)
    cells = {}
    for spec in args.cells:
        label, sep, path = spec.rpartition("=")
        if not sep or not label:
            p.error(f"{spec!r}: expected LABEL=RESULT.json")
        if not Path(path).is_file():
            p.error(f"{spec!r}: no such file {path}")
        cells[label] = cell(json.loads(Path(path).read_text()), args.default, args.context)
    text = markdown(cells, args.default)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(cells, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
