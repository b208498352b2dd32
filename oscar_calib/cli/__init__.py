"""`oscar-calib` command line. Results go to stdout, progress and chatter to stderr, all through one output object
per command (`oscar_calib.cli.output.Output`).

Known errors print one line and exit with the code of their kind (`oscar_calib.cli.exit_codes`, the one
table); set `OSCAR_CALIB_DEBUG=1` to see the traceback. Command modules import torch, transformers and
Triton inside their command functions only, so `oscar-calib --help` starts fast.
"""

from __future__ import annotations

import os
import sys

from oscar_calib.cli import (
    audit_cmd,  # noqa: F401  (registers `audit`)
    eval_cmd,  # noqa: F401  (registers `eval`)
    hub_cmd,  # noqa: F401  (registers `push`, `pull`)
    interop_cmd,  # noqa: F401  (registers `import`, `export`)
    run_cmd,  # noqa: F401  (registers `run`)
    stats_cmd,  # noqa: F401  (registers `refit`, `stats merge`)
    zoo_cmd,  # noqa: F401  (registers `zoo`)
)
from oscar_calib.cli.app import app, reflow_help
from oscar_calib.cli.exit_codes import exit_code_for, one_line_message
from oscar_calib.cli.output import Output

reflow_help(app)


def main() -> None:
    from oscar_calib.interrupts import handle_interrupts  # Ctrl-C / SIGTERM: one line, exit 130 / 143

    # Leave with os._exit after a signal only when this is the program's entry point (the console script or
    # `python -m oscar_calib` calls it from `__main__`); called in-process, raise SystemExit instead.
    entry = sys._getframe(1).f_globals.get("__name__") == "__main__"
    out = Output()  # the interrupt line and the one-line error: stderr, whatever the command's mode
    with handle_interrupts(fast_exit=entry, say=out.note):  # Ctrl-C and SIGTERM: cleanup, one line, exit 130 / 143
        try:
            app()  # standalone: click prints usage errors itself and exits 2
        except Exception as exc:
            code = exit_code_for(exc)
            if code is None or os.environ.get("OSCAR_CALIB_DEBUG"):
                raise
            out.error(one_line_message(exc))
            sys.exit(code)
