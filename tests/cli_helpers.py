"""One way for tests to run the CLI in-process: argv in, (exit code, stdout, stderr) out."""

from __future__ import annotations

import sys


def run_cli(args, monkeypatch, capsys) -> tuple[int, str, str]:
    """Run `oscar-calib *args` through its real entry point; the exit code as the shell would see it."""
    from oscar_calib.cli import main

    monkeypatch.setattr(sys, "argv", ["oscar-calib", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err
