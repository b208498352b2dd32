"""docs/errors.md stays in step with the code: every row of the section "Checkpoints, statistics, pins, resources and
swaps" names a message the code really produces and the exit code the CLI really gives its exception.

A message snippet is looked up among the string literals of `oscar_calib` and `runtime_kernels` (f-strings with
their holes left out, adjacent literals joined, as Python's parser joins them); a message that comes from a library
(pydantic's words) is produced by calling the code. The other tests of issue 33 (test_checkpoint_dir,
test_stats_validation, test_release_pins, test_serving_bounds, test_resources, test_swap_faults) trigger each refusal.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from oscar_calib.cli.exit_codes import exit_code_for

ROOT = Path(__file__).resolve().parents[1]
SECTION = "### Checkpoints, statistics, pins, resources and swaps"


def section_rows() -> list[tuple[str, str, str, list[str]]]:
    """(refused, exit, exception, [message snippets]) of every row of the section's table."""
    text = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    body = text.split(SECTION, 1)[1].split("\n### ", 1)[0]
    rows = []
    for line in body.splitlines():
        if not line.startswith("| ") or line.startswith("| refused") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == 4, line
        refused, code, exc, message = cells
        rows.append((refused, code, exc, re.findall(r"`([^`]+)`", message)))
    return rows


def _render(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "\x00" for v in node.values)
    return None


@functools.lru_cache(maxsize=1)
def source_strings() -> tuple[str, ...]:
    out = []
    for package in ("oscar_calib", "runtime_kernels"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                text = _render(node)
                if text:
                    out.append(text)
    return tuple(out)


def _produced_by_calling(snippet: str) -> str:
    """Messages whose words come from a library: produce them."""
    from runtime_kernels.vllm.config import parse_oscar_config

    raw = {"Input should be a valid boolean": {"path": "x", "allow_other_model": "yes"},
           "Input should be a finite number": {"path": "x", "window_reserve": float("nan")}}[snippet]
    with pytest.raises(ValueError) as info:
        parse_oscar_config({"oscar": raw})
    return str(info.value)


def _exception(name: str) -> type[BaseException]:
    from oscar_calib.errors import InputError
    from oscar_calib.zoo.reference_format import ReferenceFormatError
    from runtime_kernels.atomic import DiskFullError, OutputDirError
    from runtime_kernels.contract import ArtifactError
    from runtime_kernels.loader import UnsafeNameError
    from runtime_kernels.memory_budget import CacheTooLargeError

    return {c.__name__: c for c in (InputError, ReferenceFormatError, DiskFullError, OutputDirError, ArtifactError,
                                    UnsafeNameError, CacheTooLargeError, ValueError)}[name]


ROWS = section_rows()


def test_the_section_has_its_rows():
    assert len(ROWS) >= 40  # one per refusal of issue 33


@pytest.mark.parametrize("refused, code, exc, snippets", ROWS, ids=[r[2] + ":" + r[3][0][:40] for r in ROWS])
def test_each_row_matches_the_code(refused, code, exc, snippets):
    strings = source_strings()
    for snippet in snippets:
        if any(snippet in s for s in strings):
            continue
        assert snippet in _produced_by_calling(snippet), (refused, snippet)
    cls = _exception(exc)
    if code != "—":  # "—": raised by the library or at vLLM start-up only, no exit code to check
        assert exit_code_for(cls("x")) == int(code), (refused, exc, code)
