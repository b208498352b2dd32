"""bench/results holds the product's evidence only: every file there is cited by the README or a page of docs/, and
bench/results/README.md lists each one (card, what it measures, which doc cites it). A run's log or a probe that no
doc cites belongs in git history, not in the tree."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "README.md"


def _cited_names(text: str) -> set[str]:
    """File names a text mentions, with the shorthand `name.{json,md}` expanded to each name."""
    names = set()
    for token in set(re.findall(r"[A-Za-z0-9_.{},/-]+", text)):
        parts = re.split(r"(\{[^{}]*\})", token)
        options = [p[1:-1].split(",") if p.startswith("{") and p.endswith("}") else [p] for p in parts]
        for combo in itertools.product(*options):
            names.add("".join(combo).rstrip(".,;:)`").rsplit("/", 1)[-1])
    return names


def _result_files() -> list[str]:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p != INDEX)


def test_expansion_of_the_brace_shorthand():
    assert _cited_names("see `quality/x_{a,b}_4096.{json,md}`.") >= {"x_a_4096.json", "x_b_4096.md"}


def test_every_results_file_is_cited_by_the_readme_or_docs():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited = set().union(*(_cited_names(p.read_text(encoding="utf-8")) for p in docs))
    uncited = [f for f in _result_files() if f.rsplit("/", 1)[-1] not in cited]
    assert not uncited, f"bench/results files no doc cites (cite them or delete them): {uncited}"


def test_the_index_lists_every_file_and_only_existing_ones():
    rows = re.findall(r"^\| `([^`]+)` \|", INDEX.read_text(encoding="utf-8"), flags=re.M)
    assert len(rows) == len(set(rows)), "a file is listed twice"
    files = _result_files()
    assert sorted(rows) == files, (f"not in the index: {sorted(set(files) - set(rows))}; "
                                   f"in the index but not on disk: {sorted(set(rows) - set(files))}")
