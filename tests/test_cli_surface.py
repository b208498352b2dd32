"""The CLI's surface as a whole (issue 22): every command that produces a result has `--json`, every command that
talks to a zoo repo has `--repo-type`, Hub-command errors name the flag, and the README's serving section shows the one-call Hub path with `cache=`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from format_helpers import PAPER

from oscar_calib.cli import app

REPO_ROOT = Path(__file__).resolve().parents[1]
NO_RESULT = {"zoo schema"}  # prints the JSON Schema itself: already machine-readable
HUB_FACING = {"push", "pull", "zoo publish", "zoo list"}  # `zoo validate` reads each release's recorded repo_type


def _commands(group, prefix: str = "") -> dict:
    """Every leaf command by its full name ("zoo list"); typer's groups are duck-typed (`.commands`)."""
    out = {}
    for name, cmd in group.commands.items():
        path = f"{prefix}{name}"
        if hasattr(cmd, "commands"):
            out |= _commands(cmd, path + " ")
        else:
            out[path] = cmd
    return out


def _flags(cmd) -> set[str]:
    return {opt for p in cmd.params for opt in getattr(p, "opts", [])}


COMMANDS = _commands(typer.main.get_command(app))


def test_every_result_has_json():
    assert {"run", "refit", "stats merge", "push", "pull", "audit", "eval", "import", "export", "zoo build",
            "zoo validate", "zoo publish", "zoo list"} <= set(COMMANDS)
    missing = sorted(name for name, cmd in COMMANDS.items() if name not in NO_RESULT and "--json" not in _flags(cmd))
    assert missing == []
    listed = (REPO_ROOT / "docs" / "cli.md").read_text().partition("`--json` prints")[2].partition("\n- ")[0]
    assert all(f"`{name}`" in listed for name in COMMANDS if name not in NO_RESULT), listed


def test_every_hub_facing_command_has_repo_type_and_token():
    for name in HUB_FACING:
        flags = _flags(COMMANDS[name])
        assert {"--repo-type", "--token", "--repo"} <= flags, name
    # Any other command that takes a --token talks to the Hub too and must be listed above (or explain why not).
    others = {name for name, cmd in COMMANDS.items() if "--token" in _flags(cmd)} - HUB_FACING
    assert others == {"zoo validate"}


def test_readme_serving_section_shows_the_one_call_hub_path_and_cache_kwarg():
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.partition("## Serve in transformers")[2].partition("\n## ")[0]
    assert section, "the README has no section '## Serve in transformers'"
    blocks = [part.partition("```")[0] for part in section.split("```python\n")[1:]]
    for block in blocks:
        compile(block, "README serving snippet", "exec")  # valid Python (tests/test_readme.py runs them)
    code = "\n".join(blocks)
    assert re.search(r"OscarCache\.from_pretrained\([^)]*repo=[^)]*revision=", code), code
    assert re.search(r"\.generate\([^)]*\bcache=cache\b", code), code
    assert not re.search(r"\.generate\([^)]*past_key_values=", code)  # the old, deprecated spelling is not the call


@pytest.mark.parametrize("argv, flag", [
    (["push", "{art}", "--repo", "bad"], "--repo"),
    (["push", "{art}", "--repo", "org/../zoo", "--dry-run"], "--repo"),
    (["push", "{art}", "--repo", "org/zoo", "--version", "3"], "--version"),
    (["push", "{art}", "--repo", "org/zoo", "--calibration", "../x", "--dry-run"], "--calibration"),
    (["push", "{tmp}/missing", "--repo", "org/zoo"], "DIR"),
    (["pull", "m/x", "--repo", "org/zoo", "--revision", "v1;"], "--revision"),
    (["pull", "m/../x", "--repo", "org/zoo", "--revision", "v1"], "MODEL"),
    (["pull", "m/x", "--repo", "org/zoo", "--revision", "v1", "--calibration", "a\tb"], "--calibration"),
    (["zoo", "list", "--repo", "bad"], "--repo"),
    (["zoo", "publish", "--repo", "bad"], "--repo"),
])
def test_hub_command_errors_name_the_flag(argv, flag, tmp_path, monkeypatch, capsys):
    from cli_helpers import run_cli

    from oscar_calib.cli import exit_codes
    from runtime_kernels.artifact import identity_artifact, write_artifact

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the names are checked first
    write_artifact(identity_artifact(2, 2, 4, 32, fmt=PAPER), tmp_path / "a")
    argv = [a.format(art=tmp_path / "a", tmp=tmp_path) for a in argv]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert code == exit_codes.BAD_INPUT and out == "", err
    assert err.startswith(f"Error: {flag}") and "field '" not in err, err


def test_help_paragraphs_are_reflowed_for_the_terminal():
    from oscar_calib.cli.app import _reflow

    assert _reflow("First line.\n\n    Second paragraph\n    goes on.\n\n    Examples:\n\n        a  # x\n        b\n") == \
        "First line.\n\nSecond paragraph goes on.\n\nExamples:\n\n    a  # x\n    b"
    from oscar_calib.cli import app as the_app

    def infos(t):
        yield from t.registered_commands
        for group in t.registered_groups:
            yield from infos(group.typer_instance)

    helps = {info.callback.__name__: info.help for info in infos(the_app)}
    assert "push_cmd" in helps and "With `--version vN`, that is an error" in helps["push_cmd"]
    for name, text in helps.items():  # rich keeps line breaks: none may be left inside a prose paragraph
        for para in (text or "").split("\n\n"):
            assert "\n" not in para or para.startswith("\b") or para.splitlines()[1][:1].isspace(), (name, para)
