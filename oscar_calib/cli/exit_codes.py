"""The one table from exception types to exit codes. Only the CLI knows exit codes.

Runtime exceptions (`runtime_kernels`, `oscar_calib`) say what went wrong; this table says which kind of
failure that is, so that the same failure has the same code in every command (an artifact for another
model is 2 in `audit`, `eval`, `export` and `pull` alike).

Types are named by "module.QualName" and matched along the exception's MRO (most specific first), so
looking a code up imports nothing: `oscar-calib --help` stays free of torch.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

SUCCESS = 0
OTHER = 1
BAD_INPUT = 2
CAPTURE = 3
INTEGRITY = 4
HUB_REFUSED = 5
UNCHANGED = 6
MISSING_DEPENDENCY = 7
INTERRUPTED = 130


@dataclass(frozen=True)
class ExitKind:
    code: int
    meaning: str


KINDS: tuple[ExitKind, ...] = (
    ExitKind(SUCCESS, "success"),
    ExitKind(OTHER, "other known error"),
    ExitKind(BAD_INPUT, "bad input: option, model, dataset, output path, manifest, unsafe repo id / file name / "
                        "revision, malformed reference file, artifact made for another model, a zoo repo of the other "
                        "`--repo-type`"),
    ExitKind(CAPTURE, "capture failed: unsupported attention, NaN/Inf in activations"),
    ExitKind(INTEGRITY, "integrity: sha256 mismatch, an artifact that breaks the contract"),
    ExitKind(HUB_REFUSED, "the Hub refused: tag exists with other content, concurrent publisher, unknown "
                          "repo / revision / release, bad credentials, not cached while offline"),
    ExitKind(UNCHANGED, "nothing new: `push --version` of content that an earlier version already holds "
                        "(pass --allow-unchanged to accept)"),
    ExitKind(MISSING_DEPENDENCY, "an optional dependency of the requested feature is not installed "
                                 "(the message gives the pip command); nothing was run"),
    ExitKind(INTERRUPTED, "interrupted (Ctrl-C / SIGINT)"),
)

# Exception type -> exit code. Subclasses not listed take the code of their nearest listed base.
EXCEPTION_CODES: dict[str, int] = {
    "oscar_calib.errors.OscarError": OTHER,
    "oscar_calib.errors.InputError": BAD_INPUT,
    "oscar_calib.errors.CaptureError": CAPTURE,
    "oscar_calib.errors.IntegrityError": INTEGRITY,
    "oscar_calib.errors.HubError": HUB_REFUSED,
    "oscar_calib.errors.MissingDependencyError": MISSING_DEPENDENCY,
    "oscar_calib.cli.exit_codes.UnchangedRelease": UNCHANGED,
    "oscar_calib.cli.exit_codes.MissingDependency": MISSING_DEPENDENCY,
    "runtime_kernels.contract.ArtifactError": INTEGRITY,
    "runtime_kernels.contract.DuplicateKeyError": INTEGRITY,
    "runtime_kernels.artifact.ModelMismatchError": BAD_INPUT,
    "runtime_kernels.loader.UnsafeNameError": BAD_INPUT,
    "runtime_kernels.loader.WrongRepoTypeError": BAD_INPUT,  # before its base ReleaseNotFoundError (MRO order)
    "runtime_kernels.loader.ReleaseNotFoundError": HUB_REFUSED,
    "runtime_kernels.loader.HubUnreachableError": HUB_REFUSED,
    "runtime_kernels.atomic.OutputDirError": BAD_INPUT,
    "runtime_kernels.atomic.DiskFullError": OTHER,  # a full disk / quota: the path and the bytes needed
    "runtime_kernels.cache.NonFiniteKVError": BAD_INPUT,
}


class UnchangedRelease(Exception):
    """`push --version vN` found the content already released as another version: nothing was created."""


class MissingDependency(Exception):
    """An optional package needed by a requested option is not installed."""


def exit_code_for(exc: BaseException) -> int | None:
    """The exit code of a known failure, or None for an unexpected exception (which keeps its traceback)."""
    for cls in type(exc).__mro__:
        code = EXCEPTION_CODES.get(f"{cls.__module__}.{cls.__qualname__}")
        if code is not None:
            return code
    if disk_full_cause(exc) is not None:  # a write site without its own DiskFullError (a library's write)
        return OTHER
    return None


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full_cause(exc: BaseException) -> OSError | None:
    """The ENOSPC / EDQUOT OSError that `exc` is or was raised from (libraries wrap it: the Hub client's
    download, torch's writer), or None."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def one_line_message(exc: BaseException) -> str:
    """The line printed for a known failure: its message, or for a full disk that no write site named, the path
    and errno in the project's words (`runtime_kernels.atomic.disk_full_message`) instead of `[Errno 28] ...`."""
    cause = disk_full_cause(exc)
    if cause is None or type(exc).__name__ == "DiskFullError":
        return str(exc)
    from runtime_kernels.atomic import free_bytes

    where = cause.filename or getattr(exc, "filename", None) or "the output location"
    name = "EDQUOT: disk quota exceeded" if cause.errno == errno.EDQUOT else "ENOSPC: no space left on device"
    free = free_bytes(where) if where != "the output location" else None
    have = f" ({free} bytes are free there)" if free is not None else ""
    return f"{where}: {name}{have}; free space or choose another location, then run the command again"


def require(module: str, extra: str, flag: str) -> None:
    """Fail before any work when `flag` needs `module` and it is not importable (checked without importing)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingDependency(f"{flag} needs {module}, which is not installed; install it with "
                                f"`pip install 'oscar-calib[{extra}]'` (or `pip install {module}`)")


def table_markdown() -> str:
    """The exit-code table as Markdown (README and docs/cli.md show it; a test keeps them in step)."""
    rows = ["| code | meaning |", "|---|---|"] + [f"| {k.code} | {k.meaning} |" for k in KINDS]
    return "\n".join(rows)
