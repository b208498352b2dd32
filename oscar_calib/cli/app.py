"""The Typer application object. Command modules import `app` and register themselves on it."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="oscar-calib",
    help="Calibrate, publish, audit and evaluate OSCAR rotations for 2-bit KV caches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


@app.callback()
def _root() -> None:
    """Calibrate, publish, audit and evaluate OSCAR rotations for 2-bit KV caches.

    Results go to stdout, progress to stderr. Set OSCAR_CALIB_DEBUG=1 for tracebacks.
    """
