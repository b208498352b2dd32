"""Progress bars with an ETA (rich, on stderr) for the long steps: capture, solve + clip fit, evaluation.

One `Stages` display holds one bar per step; each step gets a callback that the computation calls as it
advances. The callbacks take plain numbers, so the computing modules import nothing from rich.

The console comes from the caller (the CLI's output object, `oscar_calib.cli.output`); a library function whose
caller gave none writes to `log_console`, which draws nothing and logs its lines: library code does not print.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

StepFn = Callable[[str, int, int], None]  # (what is running now, steps done, steps in total)


def log_console(logger: logging.Logger):
    """A rich Console that draws nothing (progress bars included) and logs each printed line at INFO, markup
    removed: where a library function writes when its caller passed no console."""
    from rich.console import Console
    from rich.text import Text

    class LogConsole(Console):
        def print(self, *objects, **kwargs) -> None:
            logger.info(" ".join(Text.from_markup(o).plain if isinstance(o, str) else str(o) for o in objects))

    return LogConsole(stderr=True, quiet=True)


class Stages:
    """A rich `Progress` on `console` (a rich Console on stderr, or `log_console`); use as a context manager."""

    def __init__(self, console):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.table import Column

        self.console = console

        def fixed() -> Column:
            return Column(no_wrap=True)

        # Under 100 columns (an 80-column terminal) the free-text note (tokens per second, the layer being fitted)
        # is left out so that the counter and the times are never cut (the counter used to read "10240/102…").
        columns = [TextColumn("[bold]{task.description}", table_column=fixed()), BarColumn(bar_width=10),
                   MofNCompleteColumn(table_column=fixed()), TextColumn("{task.fields[unit]}", table_column=fixed()),
                   TimeElapsedColumn(table_column=fixed()), TextColumn("ETA"),
                   TimeRemainingColumn(table_column=fixed())]
        if self.console.width >= 100:
            columns.append(TextColumn("{task.fields[note]}", table_column=Column(no_wrap=True, overflow="ellipsis")))
        self.progress = Progress(*columns, console=self.console, transient=False)

    def __enter__(self) -> Stages:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def tokens(self, label: str, total: int) -> Callable[[int, int], None]:
        """Callback `(tokens done in this call, total)` for a token-counting step; shows tokens per second."""
        task = self.progress.add_task(label, total=total, unit="tokens", note="")
        start, done = time.perf_counter(), [0]

        def advance(tokens: int, _total: int) -> None:
            done[0] += tokens
            rate = done[0] / max(time.perf_counter() - start, 1e-9)
            self.progress.update(task, advance=tokens, note=f"{rate:,.0f} tok/s")

        return advance

    def steps(self, label: str, unit: str = "steps") -> StepFn:
        """Callback `(note, done, total)` for a step counted in units (layers, windows); the total may be
        learned at the first call."""
        task = self.progress.add_task(label, total=None, unit=unit, note="")

        def advance(note: str, done: int, total: int) -> None:
            self.progress.update(task, completed=done, total=total, note=note)

        return advance
