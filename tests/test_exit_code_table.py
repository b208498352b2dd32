"""docs/cli.md's exit-code table, row by row: each documented code is what the real entry point exits with for a
failure of that kind, with one `Error:` line (no traceback).

Codes a command line reaches by itself (2, 4, 5, 6, 7, and 0 for a warning) are rows of docs/errors.md's table that
tests/test_error_table.py runs as written; this test checks that every such code has a row there. The kinds no
plain command line reaches on demand (1: a full disk, 3: NaN in the captured activations, 130: Ctrl-C) are raised
inside `run` where its first check runs, and go through the same entry point.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_helpers import run_cli
from test_error_table import rows as error_table_rows

from oscar_calib.cli import exit_codes

ROOT = Path(__file__).resolve().parents[1]


def doc_rows() -> list[tuple[int, str]]:
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    block = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return [(int(m.group(1)), m.group(2).strip()) for m in re.finditer(r"^\| (\d+) \| (.+) \|$", block, re.M)]


def _raised(kind: int) -> BaseException:
    from oscar_calib.errors import CaptureError
    from runtime_kernels.atomic import DiskFullError

    return {1: DiskFullError("out: ENOSPC: no space left on device (needs 100 bytes)"),
            3: CaptureError("layer 0: captured key activations contain NaN or Inf"),
            130: KeyboardInterrupt()}[kind]


def test_the_table_has_every_kind_once():
    rows = doc_rows()
    assert [code for code, _ in rows] == [k.code for k in exit_codes.KINDS]
    for (code, meaning), kind in zip(rows, exit_codes.KINDS):
        assert meaning == kind.meaning, code


@pytest.mark.parametrize("code, meaning", doc_rows(), ids=[str(c) for c, _ in doc_rows()])
def test_row(code, meaning, tmp_path, monkeypatch, capsys):
    if code in (1, 3, 130):
        import oscar_calib.cli.preflight as preflight

        def fail(*args, **kwargs):
            raise _raised(code)

        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(preflight, "check_model_ref", fail)
        got, out, err = run_cli(["run", "--model", "./m", "--dataset", "d.txt", "--out", "out"], monkeypatch, capsys)
        assert got == code, err
        assert "Traceback" not in err and not (tmp_path / "out").exists()
        if code != 130:
            assert err.strip().splitlines() == [f"Error: {_raised(code)}"], err
        return
    covered = {c for _, _, c, _ in error_table_rows()}
    assert code in covered, f"exit {code} ({meaning}): add a row that reaches it to docs/errors.md's tested table"
