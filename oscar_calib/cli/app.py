"""The Typer application object. Command modules import `app` and register themselves on it."""

from __future__ import annotations

from typing import Annotated

import typer

from oscar_calib import __version__

CONTEXT = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="oscar-calib",
    help="Calibrate, publish, audit and evaluate OSCAR rotations for 2-bit KV caches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings=CONTEXT,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"oscar-calib {__version__}")
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
