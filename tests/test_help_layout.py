"""`--help` a new user can scan: commands in the order they meet them, every option in a named panel, no `<bool>` or
`<list[str]>` noise, a help text for every option, `run --help` within two 80 x 50 screens (the rest behind
`--help-all`), the demo's real `--samples` default."""

from __future__ import annotations

import re

import pytest
from cli_helpers import run_cli


def _help(args, monkeypatch, capsys, flag="--help", columns=200) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = run_cli([*args, flag], monkeypatch, capsys)
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


@pytest.mark.parametrize("command, flag, panels", [
    ("run", "--help-all", ["Model and data", "Recipe", "Output", "Scale"]),
    ("eval", "--help", ["Model and data", "Methods and probes", "Output", "Scale"]),
])
def test_options_are_grouped_in_panels(command, flag, panels, monkeypatch, capsys):
    text = _help([command], monkeypatch, capsys, flag)
    for panel in panels:
        assert f"─ {panel} ─" in text, panel
    assert text.index("--model ") > text.index("─ Model and data ─")
    assert text.index("─ Output ─") < text.index("--json")


def test_samples_help_states_the_demo_default(monkeypatch, capsys):
    from oscar_calib.cli.run_cmd import _default_samples
    from oscar_calib.demo import fixture_available

    text = " ".join(_help(["run"], monkeypatch, capsys).replace("│", " ").split())
    assert "demo: 4 on the trained fixture, 1 on the random fallback" in text
    assert _default_samples(True) == (4 if fixture_available() else 1) and _default_samples(False) == 32


def test_every_option_of_every_command_is_in_a_named_panel(monkeypatch, capsys):
    """Each option (`--help` too) sits in a panel of help_layout.PANELS for its command, never in typer's unnamed
    "Options" panel; so no help opens with a panel holding one stray option or only `--help`."""
    from oscar_calib.cli.help_layout import panels_of

    for path, cmd, ctx in _all_commands():
        group = path[0] if len(path) > 1 else None
        named = set(panels_of(group, path[-1]))
        options = [p for p in cmd.get_params(ctx) if p.param_type_name == "option"]
        stray = [p.name for p in options if getattr(p, "rich_help_panel", None) not in named]
        assert named and not stray, f"{' '.join(path)}: options outside a named panel: {stray}"
        flag = "--help-all" if any(p.name == "help_all" for p in options) else "--help"
        text = _help(path, monkeypatch, capsys, flag)
        assert "─ Options ─" not in text and "list[" not in text, " ".join(path)
        for p in options:  # every option is shown (with --help-all where there is one)
            assert p.opts[0] in text, (" ".join(path), p.opts[0])


def test_run_help_fits_two_screens_and_help_all_shows_the_rest(monkeypatch, capsys):
    short = _help(["run"], monkeypatch, capsys, columns=80)
    full = _help(["run"], monkeypatch, capsys, "--help-all", columns=160)
    assert len(short.splitlines()) <= 100, len(short.splitlines())  # two screens of 50 lines at 80 columns
    assert max(len(line) for line in short.splitlines()) <= 80
    for flag in ("--model", "--dataset", "--out", "--help-all"):
        assert flag in short, flag
    for flag in ("--granularity", "--hadamard-key-mass", "--offload-folder", "--trust-remote-code"):
        assert flag not in short and flag in full, flag
    assert short.index("─ Model and data ─") < short.index("─ Output ─")  # the first panel is a named one


def test_no_option_name_is_cut_at_80_columns(monkeypatch, capsys):
    """Rich shortens a column it cannot fit with an ellipsis: at 80 columns a wide metavar (choices joined into one
    word, typer's range text) once squeezed `--hadamard-key-mass` to `--hadamard-key-ma…`. Every option's every name
    must show whole in every command's fullest help."""
    for path, cmd, ctx in _all_commands():
        options = [p for p in cmd.get_params(ctx) if p.param_type_name == "option"]
        flag = "--help-all" if any(p.name == "help_all" for p in options) else "--help"
        text = _help(path, monkeypatch, capsys, flag, columns=80)
        assert "…" not in text, (" ".join(path), [line for line in text.splitlines() if "…" in line])
        for p in options:
            for name in (*p.opts, *p.secondary_opts):
                assert re.search(rf"(^|[\s│]){re.escape(name)}($|[\s│,])", text, flags=re.M), (" ".join(path), name)
