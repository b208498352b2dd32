"""The CLI's one output object (`oscar_calib.cli.output.Output`): results on stdout (with --json exactly one JSON
document and nothing else), everything else on stderr; and no other code in oscar_calib writes to the terminal
(the source is read, as tests/test_import_graph.py does for imports)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from oscar_calib.cli.output import Output, OutputError

PACKAGE = Path(__file__).resolve().parent.parent / "oscar_calib"
OUTPUT_MODULE = PACKAGE / "cli" / "output.py"


def test_json_mode_writes_one_document_and_nothing_else_on_stdout(capsys):
    output = Output(as_json=True, tag="eval")
    output.note("chosen --max-windows 4")
    output.warn("careful")
    output.json({"b": 1, "a": [1.5, None]}, indent=1, sort_keys=True)
    for write in (lambda: output.result("x"), lambda: output.rich("x"), lambda: output.json({})):
        with pytest.raises(OutputError):
            write()
    out, err = capsys.readouterr()
    assert json.loads(out) == {"a": [1.5, None], "b": 1}
    assert out == json.dumps({"b": 1, "a": [1.5, None]}, indent=1, sort_keys=True) + "\n"
    assert err == "[eval] chosen --max-windows 4\nWarning: careful\n"


def test_human_mode_result_on_stdout_chatter_on_stderr(capsys):
    output = Output()
    output.result("zoo/demo")
    output.result('{"exact": true}\n', end="")  # written as given (the schema command's text)
    output.note("wrote zoo/demo/:")
    output.error("--out: already exists")
    with pytest.raises(OutputError, match="not asked for --json"):
        output.json({"a": 1})
    out, err = capsys.readouterr()
    assert out == 'zoo/demo\n{"exact": true}\n'
    assert err == "wrote zoo/demo/:\nError: --out: already exists\n"


def test_rich_output_is_wide_when_piped(capsys):
    from rich.table import Table

    table = Table("method", "ppl")
    table.add_row("x" * 150, "1.0")  # wider than an 80-column terminal: kept whole in a pipe
    Output().rich(table)
    out = capsys.readouterr().out
    assert "x" * 150 in out and "1.0" in out


def _writes_to_the_terminal(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls that print, echo or write to stdout/stderr, or build a rich Console that is not quiet."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = ast.unparse(f)
        if name in ("print", "typer.echo", "click.echo", "typer.secho", "sys.stdout.write", "sys.stderr.write"):
            found.append((node.lineno, name))
        elif name.endswith("Console") and not any(k.arg == "quiet" for k in node.keywords):
            found.append((node.lineno, name))
    return found


def test_only_the_output_object_writes_to_the_terminal():
    """Commands write through `Output`; library modules take the console they are given, or log. A test that can
    fail: it reads every module, and the output module itself is found (so the scan is not empty)."""
    offenders, seen_output = [], False
    for path in sorted(PACKAGE.rglob("*.py")):
        hits = _writes_to_the_terminal(ast.parse(path.read_text(encoding="utf-8")))
        if path == OUTPUT_MODULE:
            seen_output = bool(hits)
            continue
        offenders += [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}" for line, name in hits]
    assert seen_output, "the scan found no terminal writes in cli/output.py: the scan itself is broken"
    assert not offenders, "write through oscar_calib.cli.output.Output (commands) or log (library):\n" + "\n".join(
        offenders)
