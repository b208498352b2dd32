"""Per-opcode summary of an Nsight Compute source page: executed instructions and warp-stall samples by SASS opcode,
and the opcode mix of the hot loop (the instructions executed about as often as the most executed one).

    ncu -k regex:_decode_grid_kernel -s 2 -c 1 --import-source yes --section SourceCounters --section WarpStateStats \\
        -o REP python3 bench/ncu_decode.py 131072 8
    ncu -i REP.ncu-rep --page source --csv --print-source sass > SASS.csv
    python3 bench/ncu_sass_summary.py SASS.csv
"""

from __future__ import annotations

import collections
import csv
import re
import sys

OPCODE = re.compile(r"(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?")
STALLS = ("stall_math", "stall_wait", "stall_short_sb", "stall_long_sb", "stall_not_selected", "stall_selected",
          "stall_dispatch")


def main(path: str) -> int:
    rows = list(csv.reader(open(path)))
    hdr = rows[1]
    ix = {h: i for i, h in enumerate(hdr)}
    data = [r for r in rows[2:] if len(r) >= len(hdr)]
    executed, samples = collections.Counter(), collections.Counter()
    stalls: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    per_line = []
    for r in data:
        m = OPCODE.match(r[ix["Source"]].strip())
        op = m.group(2) if m else "?"
        n = int(r[ix["Instructions Executed"]] or 0)
        executed[op] += n
        samples[op] += int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
        for k in STALLS:
            stalls[op][k] += int(r[ix[k]] or 0)
        per_line.append((op + (m.group(3) or "" if m else ""), n))
    top = max(n for _, n in per_line)
    hot = collections.Counter(op for op, n in per_line if n >= 0.9 * top)
    print(f"{path}: {sum(executed.values())} warp instructions executed; hot loop: {sum(hot.values())} SASS "
          f"instructions executed >= 90 % as often as the most executed one ({top})")
    print("hot loop by opcode:", ", ".join(f"{k} {v}" for k, v in hot.most_common()))
    tot, tot_s = sum(executed.values()), max(1, sum(samples.values()))
    print(f"{'opcode':10s} {'executed':>9s} {'samples':>8s}  stall samples by reason")
    for op, n in executed.most_common(30):
        reasons = ", ".join(f"{k[6:]} {v}" for k, v in stalls[op].items() if v)
        print(f"{op:10s} {100 * n / tot:8.1f}% {100 * samples[op] / tot_s:7.1f}%  {reasons}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
