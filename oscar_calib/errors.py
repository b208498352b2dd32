"""Known errors: each becomes one clear message on stderr and a documented exit code (no traceback)."""

from __future__ import annotations


class OscarError(Exception):
    """A user-facing error. The message names the input, the field and what was expected."""

    exit_code = 1


class InputError(OscarError):
    """Bad command-line input, model, dataset or output path (exit 2)."""

    exit_code = 2


class CaptureError(OscarError):
    """Something went wrong while capturing activations (NaN/Inf, unsupported attention) (exit 3)."""

    exit_code = 3


class IntegrityError(OscarError):
    """A downloaded or stored file does not match its recorded hash or the contract (exit 4)."""

    exit_code = 4


class HubError(OscarError):
    """A Hub operation was refused (moving a tag, racing publisher, missing release) (exit 5)."""

    exit_code = 5


EXIT_CODES = {
    0: "success",
    1: "other known error",
    2: "bad input (model, dataset, option, output path, manifest, artifact for another model, "
       "unsafe repo id / file name / revision, unreadable or malformed reference RotationZoo file)",
    3: "capture failed (unsupported attention, NaN/Inf in activations)",
    4: "integrity check failed (sha256 mismatch, artifact breaks the contract)",
    5: "hub refused the operation (tag exists with other content, concurrent publisher, unknown release, "
       "bad credentials, release not in the cache while offline)",
}
