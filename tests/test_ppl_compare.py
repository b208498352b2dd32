"""tools/ppl_compare.py: each row's perplexity change against a reference row, paired over the same windows."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ppl_compare  # noqa: E402


def _result(rows: dict[str, list[float]]) -> dict:
    return {"contexts": {"4096": {"methods": [{"name": n, "window_nll": v} for n, v in rows.items()]}}}


def test_change_is_the_perplexity_ratio_and_its_interval_brackets_it():
    ref = [2.0, 2.1, 1.9, 2.05, 1.95, 2.2, 2.0, 1.8]
    worse = [x + 0.01 + 0.002 * (i % 3) for i, x in enumerate(ref)]  # every window worse: the interval above 0
    table = ppl_compare.compare(_result({"ref": ref, "worse": worse, "same": ref}), "ref")
    change, lo, hi = table["4096"]["worse"]
    want = 100 * math.expm1(sum(worse) / len(worse) - sum(ref) / len(ref))
    assert change == pytest.approx(want, rel=1e-12)
    assert 0 < lo <= change <= hi
    assert table["4096"]["same"] == [0.0, 0.0, 0.0]
    assert "ref" not in table["4096"]


def test_unknown_reference_names_the_rows(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result({"a": [1.0], "b": [1.0]})))
    with pytest.raises(SystemExit, match="no row 'c' at context 4096; rows: a, b"):
        ppl_compare.main([str(path), "--reference", "c"])
