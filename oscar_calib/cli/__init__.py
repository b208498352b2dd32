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
    from runtime_kernels.artifact import ArtifactError

    try:
        app()  # standalone: click prints usage errors itself and exits 2
    except (OscarError, ArtifactError) as exc:
        if os.environ.get("OSCAR_CALIB_DEBUG"):
            raise
        code = getattr(exc, "exit_code", 4 if isinstance(exc, ArtifactError) else 1)
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(code)
    except KeyboardInterrupt:
        print("Interrupted; nothing was written.", file=sys.stderr)
        sys.exit(130)
