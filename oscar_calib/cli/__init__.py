"""`oscar-calib` command line. Results go to stdout, progress and chatter to stderr.

Known errors (`OscarError`, `ArtifactError`) print one line and exit with their code; set
`OSCAR_CALIB_DEBUG=1` to see the traceback.
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
from oscar_calib.cli.app import app
from oscar_calib.errors import OscarError


def main() -> None:
    from oscar_calib.interrupts import handle_interrupts
    from runtime_kernels.artifact import ArtifactError
    from runtime_kernels.atomic import OutputDirError

    # Leave with os._exit after a signal only when this is the program's entry point (the console script or
    # `python -m oscar_calib` calls it from `__main__`); called in-process, raise SystemExit instead.
    entry = sys._getframe(1).f_globals.get("__name__") == "__main__"
    with handle_interrupts(fast_exit=entry):  # Ctrl-C and SIGTERM: cleanup, one line, exit 130 / 143
        try:
            app()  # standalone: click prints usage errors itself and exits 2
        except (OscarError, ArtifactError, OutputDirError) as exc:
            if os.environ.get("OSCAR_CALIB_DEBUG"):
                raise
            code = getattr(exc, "exit_code", 4 if isinstance(exc, ArtifactError) else 1)
            print(f"Error: {exc}", file=sys.stderr)
            sys.exit(code)
