"""tools/grid_table.py: each cell's verdict of the default against its equal-bits peers, from paired intervals."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import grid_table  # noqa: E402

BF16 = [2.0, 2.1, 1.9, 2.05, 1.95, 2.2, 2.0, 1.8]
PER_HEAD, HADAMARD = grid_table.BASELINE, "hadamard global clips, centered, min-max"


def _shift(rows, by, wobble=0.002):
    return [x + by + wobble * (i % 3) for i, x in enumerate(rows)]


def _result(rows: dict[str, list[float]], bits: dict[str, float] | None = None, probes: dict | None = None) -> dict:
    methods = [{"name": n, "window_nll": v, "bits_128k": (bits or {}).get(n, 2.371)} for n, v in rows.items()]
    return {"contexts": {"8192": {"methods": methods}}, **(probes or {})}


def test_win_tie_and_lose_follow_the_intervals():
    default = _shift(BF16, 0.02)
    better_peer, worse_peer = _shift(BF16, 0.01), _shift(BF16, 0.04)
    win = grid_table.cell(_result({"bf16": BF16, "default": default, PER_HEAD: worse_peer, HADAMARD: worse_peer}),
                          "default")
    assert win["verdict"] == "win"
    change, lo, hi = win["default_vs_peers"][PER_HEAD]
    assert change == pytest.approx(100 * math.expm1(sum(default) / 8 - sum(worse_peer) / 8), rel=1e-12)
    assert lo <= change <= hi < 0
    tie = grid_table.cell(_result({"bf16": BF16, "default": default, PER_HEAD: worse_peer,
                                   HADAMARD: [x + 0.02 * (-1) ** i for i, x in enumerate(default)]}), "default")
    assert tie["verdict"] == "tie"
    lose = grid_table.cell(_result({"bf16": BF16, "default": default, PER_HEAD: worse_peer, HADAMARD: better_peer}),
                           "default")
    assert lose["verdict"] == "lose" and lose["best_peer"] == HADAMARD


def test_a_peer_of_more_bits_is_not_counted_and_probes_are_paired_over_needles():
    default = _shift(BF16, 0.02)
    rows = {"bf16": BF16, "default": default, PER_HEAD: _shift(BF16, 0.04), grid_table.KIVI: _shift(BF16, 0.0)}
    needles = {"bf16": [1.0, 1.0, 0.8, 1.0], "default": [1.0, 0.6, 0.8, 1.0], PER_HEAD: [1.0, 1.0, 0.8, 0.4]}
    probes = {p: {"scores": {n: {"per_needle": {"accuracy": a}} for n, a in needles.items()}}
              for p in ("passkey", "multikey")}
    c = grid_table.cell(_result(rows, {grid_table.KIVI: 2.6}, probes), "default")
    assert grid_table.KIVI not in c["equal_bits_peers"] and c["verdict"] == "win"  # KIVI is better, but spends more
    assert c["default_vs_peers"][grid_table.KIVI][1] > 0
    mk = c["multikey"]
    assert mk["bf16"] == pytest.approx(95.0) and mk["default"] == pytest.approx(85.0)
    assert mk["default_vs_bf16"][0] == pytest.approx(-10.0) and mk["best_peer"] == PER_HEAD
    assert mk["default_vs_peer"][0] == pytest.approx(5.0)
    assert mk["default_vs_peer"][1] <= 5.0 <= mk["default_vs_peer"][2]


def test_the_command_writes_the_table_and_names_a_missing_row(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result({"bf16": BF16, "default": _shift(BF16, 0.02), PER_HEAD: _shift(BF16, 0.04)})))
    out = tmp_path / "grid.md"
    assert grid_table.main([f"SmolLM2 8K, code={path}", "--out", str(out)]) == 0
    assert "| SmolLM2 8K, code | 8192, 8 |" in out.read_text()
    assert json.loads(out.with_suffix(".json").read_text())["SmolLM2 8K, code"]["verdict"] == "win"
    with pytest.raises(SystemExit, match="--default 'nope': no such row at context 8192; rows: bf16, default"):
        grid_table.main([f"c={path}", "--default", "nope"])
