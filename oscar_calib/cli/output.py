"""The CLI's one output object: the result on stdout, everything else on stderr.

Every command writes through an `Output` (the idea of huggingface_hub's CLI output object):

- stdout holds the result only: human lines (`result`) and rich tables (`rich`), or, with `--json`, exactly one
  JSON document (`json`) and nothing else; writing human text in `--json` mode, or a second document, is a bug
  and raises.
- stderr holds the rest: notes (`note`; `[eval] ...` for the commands that tag them), warnings (`warn`,
  "Warning: ..."), errors (`error`, "Error: ..."), and the progress bars and lines of the library code a command
  calls (`console`, a rich Console on stderr handed to `job.run_calibration`, `refit`, `progress.Stages`).

Library modules outside `cli/` never print: they write to the console they are given, or log.
Nothing here formats a command's arguments, so a token given on the command line is never echoed.
"""

from __future__ import annotations

import json as _json
import sys
from typing import Any


class OutputError(RuntimeError):
    """A command wrote to stdout in a way its mode forbids (human text with --json, two JSON documents)."""


class Output:
    """Where one command's words go. `as_json`: the result is one JSON document; `tag`: notes read `[tag] ...`."""

    def __init__(self, as_json: bool = False, tag: str | None = None):
        self.as_json = as_json
        self.tag = tag
        self._documents = 0
        self._console = None

    # --- stdout: the result ------------------------------------------------------------------------------------
    def result(self, text: object = "", end: str = "\n") -> None:
        """A line of the human result on stdout (`end=""` writes `text` exactly as given)."""
        self._human("result")
        sys.stdout.write(f"{text}{end}")

    def rich(self, *renderables: Any) -> None:
        """Rich renderables (a table, markup text) on stdout; 200 columns when piped, so a log keeps whole columns."""
        from rich.console import Console

        self._human("rich")
        Console(width=None if sys.stdout.isatty() else 200).print(*renderables)

    def json(self, document: Any, indent: int = 2, sort_keys: bool = False) -> None:
        """The one JSON document of `--json` on stdout (`indent` and `sort_keys` as each command has always used)."""
        if not self.as_json:
            raise OutputError("Output.json: this command was not asked for --json; write the human result instead")
        if self._documents:
            raise OutputError("Output.json: a --json command writes exactly one JSON document; one was written")
        self._documents += 1
        sys.stdout.write(_json.dumps(document, indent=indent, sort_keys=sort_keys) + "\n")

    def _human(self, what: str) -> None:
        if self.as_json:
            raise OutputError(f"Output.{what}: human text on stdout in --json mode (stdout holds the JSON document "
                              "only; write notes with Output.note)")

    # --- stderr: everything else -------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        """Progress and chatter for a person, on stderr (`[tag] text` when the command has a tag)."""
        self._stderr(f"[{self.tag}] {text}" if self.tag else text)

    def warn(self, text: str) -> None:
        self._stderr(f"Warning: {text}")

    def error(self, text: str) -> None:
        self._stderr(f"Error: {text}")

    @property
    def console(self):
        """A rich Console on stderr for progress bars and the library's lines (what `run` and `refit` print)."""
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True)
        return self._console

    def stages(self):
        """Progress bars on stderr (`oscar_calib.progress.Stages`), as a context manager."""
        from oscar_calib.progress import Stages

        return Stages(self.console)

    @staticmethod
    def _stderr(line: str) -> None:
        print(line, file=sys.stderr, flush=True)


__all__ = ["Output", "OutputError"]
