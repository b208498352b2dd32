"""`--help` a new user can scan: commands in the order they meet them, options in panels, no `<bool>` noise, a help
text for every option, the demo's real `--samples` default."""

from __future__ import annotations

import re

import pytest
from cli_helpers import run_cli


def _help(args, monkeypatch, capsys) -> str:
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run_cli([*args, "--help"], monkeypatch, capsys)
    assert code == 0, err
    return out


def _all_commands():
    import typer.main
    from typer import _click as click

    from oscar_calib.cli import app

    root = typer.main.get_command(app)
    ctx = click.Context(root)
    out = []

    def walk(group, prefix):
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            if hasattr(cmd, "list_commands"):
                walk(cmd, [*prefix, name])
            else:
                out.append(([*prefix, name], cmd, ctx))

    walk(root, [])
    return out


def test_commands_in_the_order_a_user_meets_them(monkeypatch, capsys):
    text = _help([], monkeypatch, capsys)
    listed = re.findall(r"^│ (\w+) ", text, flags=re.M)
    assert listed[:6] == ["run", "eval", "audit", "push", "pull", "zoo"], listed


def test_every_option_has_help_and_no_flag_shows_a_type(monkeypatch, capsys):
    commands = _all_commands()
    assert len(commands) >= 14
    for path, cmd, ctx in commands:
        missing = [p.name for p in cmd.get_params(ctx) if p.param_type_name == "option" and not p.help]
        assert not missing, f"{' '.join(path)}: options without help: {missing}"
        assert "<bool>" not in _help(path, monkeypatch, capsys), " ".join(path)


@pytest.mark.parametrize("command, panels", [
    ("run", ["Model and data", "Recipe", "Output", "Scale"]),
    ("eval", ["Model and data", "Methods and probes", "Output", "Scale"]),
])
def test_options_are_grouped_in_panels(command, panels, monkeypatch, capsys):
    text = _help([command], monkeypatch, capsys)
    for panel in panels:
        assert f"─ {panel} ─" in text, panel
    assert text.index("--model ") > text.index("─ Model and data ─")
    assert text.index("─ Recipe ─" if command == "run" else "─ Output ─") < text.index("--json")


def test_samples_help_states_the_demo_default(monkeypatch, capsys):
    from oscar_calib.cli.run_cmd import _default_samples
    from oscar_calib.demo import fixture_available

    text = " ".join(_help(["run"], monkeypatch, capsys).replace("│", " ").split())
    assert "demo: 4 on the trained fixture, 1 on the random fallback" in text
    assert _default_samples(True) == (4 if fixture_available() else 1) and _default_samples(False) == 32
