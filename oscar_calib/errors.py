"""Known errors: each becomes one clear message on stderr (no traceback).

These types say what went wrong; the exit code of each kind of failure is decided in one place, the
CLI's table (`oscar_calib.cli.exit_codes`), not here.
"""

from __future__ import annotations


class OscarError(Exception):
    """A user-facing error. The message names the input, the field and what was expected."""


class InputError(OscarError):
    """Bad command-line input, model, dataset or output path."""


class CaptureError(OscarError):
    """Something went wrong while capturing activations (NaN/Inf, unsupported attention)."""


class IntegrityError(OscarError):
    """A downloaded or stored file does not match its recorded hash or the contract."""


class HubError(OscarError):
    """A Hub operation was refused (moving a tag, racing publisher, missing release)."""


class MissingDependencyError(OscarError):
    """An optional package needed by the requested input or option is not installed (the message gives the pip
    command); raised before any work."""
