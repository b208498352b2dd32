"""The Typer application object. Command modules import `app` and register themselves on it."""

from __future__ import annotations

import inspect
from typing import Annotated

import typer

from oscar_calib import __version__
from oscar_calib.cli.help_layout import UserOrderGroup
from oscar_calib.cli.output import Output

CONTEXT = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="oscar-calib",
    help="Calibrate, publish, audit and evaluate OSCAR rotations for 2-bit KV caches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings=CONTEXT,
    cls=UserOrderGroup,  # commands in the order a user meets them, options in panels (help_layout.py)
)


def _print_version(value: bool) -> None:
    if value:
        Output().result(f"oscar-calib {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", "-V", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Calibrate, publish, audit and evaluate OSCAR rotations for 2-bit KV caches.

    Results go to stdout, progress to stderr. Set OSCAR_CALIB_DEBUG=1 for tracebacks.
    Exit codes: 0 ok, 1 other, 2 bad input, 3 capture, 4 integrity, 5 Hub refused, 6 nothing new,
    7 missing optional dependency, 130 interrupted (`docs/cli.md`).
    """


def _reflow(text: str) -> str:
    """A docstring's paragraphs each on one line; indented paragraphs (examples) and `\\b` ones kept as written."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") or any(line[:1].isspace() for line in p.splitlines())
                       else " ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def reflow_help(typer_app: typer.Typer) -> None:
    """Typer's rich help keeps a docstring's line breaks, so text wrapped for the source showed up broken
    mid-sentence in `--help`; give each command its docstring reflowed, for rich to wrap to the terminal.
    Runs at start-up over the registered commands (no imports, just strings)."""
    for info in typer_app.registered_commands:
        doc = info.help or (info.callback.__doc__ if info.callback else None)
        if doc:
            info.help = _reflow(doc)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            reflow_help(group.typer_instance)
