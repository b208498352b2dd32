"""Atomic output directories that survive interrupts (SIGINT, SIGTERM, SIGKILL, power loss between steps).

`atomic_output_dir(target, overwrite=...)` yields a fresh temporary directory beside `target`; when the
block ends normally, the temporary directory becomes `target` in one step, and when it raises (an error,
Ctrl-C, SIGTERM) it is removed. There is never a moment where a reader sees a half-written `target`:

- new target: one `rename(tmp, target)`;
- `overwrite` of an existing directory: `renameat2(RENAME_EXCHANGE)` swaps the two directories atomically
  (Linux >= 3.15, through ctypes), then the old content, now at the temporary name, is removed. Where the
  exchange is not available (other systems, some filesystems), the fallback is `rename(target, old)`,
  `rename(tmp, target)`, `rmtree(old)`; a crash between the two renames leaves `target` missing for a
  moment, and the next `atomic_output_dir` (or `recover`) on that target puts `old` back.

Temporaries are named `.<name>.oscar-tmp-<pid>-<ns>` / `.<name>.oscar-old-<pid>-<ns>` (pid and creation time
in ns), so a later run can tell those of a dead process (removed, or restored for `old`) from those of a
live one (left alone). Everything here is stdlib, so the serving runtime can use it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

_TEMP_RE = re.compile(r"\.(?P<name>.+)\.oscar-(?P<kind>tmp|old)-(?P<pid>[0-9]{1,10})-(?P<ns>[0-9]{1,20})")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class OutputDirError(ValueError):
    """The output directory cannot be written (exists without overwrite, not a directory, not writable)."""


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskFullError(OSError):
    """No space (or no quota) left where an output is written; the message names the path and the bytes needed."""

    def __init__(self, message: str, code: int = errno.ENOSPC):
        super().__init__(message)
        self.errno = code


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes (for this user) on the filesystem that holds `path` or its nearest existing ancestor."""
    probe = _absolute(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def disk_full_message(path: str | os.PathLike, needed: int | None, code: int = errno.ENOSPC,
                      at_least: bool = False) -> str:
    """`PATH: ENOSPC: no space left on device: needs N bytes, F are free there; ...` (one line)."""
    name = "EDQUOT: disk quota exceeded" if code == errno.EDQUOT else "ENOSPC: no space left on device"
    free = free_bytes(path)
    need = f"needs {'more than ' if at_least else ''}{needed} bytes" if needed is not None else "needs more space"
    have = f", {free} are free there" if free is not None else ""
    return (f"{path}: {name}: {need}{have}; free space or choose another location (nothing was replaced; "
            "temporaries removed)")


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


@contextlib.contextmanager
def disk_space_for(path: str | os.PathLike, needed: int | None) -> Iterator[None]:
    """Turn ENOSPC / EDQUOT raised inside the block into one `DiskFullError` naming `path` and `needed` bytes."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise DiskFullError(disk_full_message(path, needed, exc.errno), exc.errno) from None


def _checkpoint(stage: str) -> None:
    """No-op; tests replace it to stop or kill a process at a named stage of the commit."""


# -- liveness of the process that made a temporary ---------------------------------------------------------
def _boot_time_s() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def _process_start_s(pid: int) -> float | None:
    """Start time (epoch seconds) of a live process on Linux, else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command name
    except (OSError, ValueError, IndexError):
        return None
    boot = _boot_time_s()
    return None if boot is None else boot + ticks / os.sysconf("SC_CLK_TCK")


def owner_alive(pid: int, created_ns: int) -> bool:
    """Whether the process that created a temporary at `created_ns` still runs (pid reuse is detected on Linux)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    except OverflowError:
        return False
    start = _process_start_s(pid)
    # A process started after the temporary was made is a new owner of a reused pid (2 s for clock ticks).
    return start is None or start <= created_ns / 1e9 + 2.0


# -- recovery ------------------------------------------------------------------------------------------
def temporaries(target: Path) -> list[tuple[Path, str, int, int]]:
    """(path, kind 'tmp'|'old', pid, created_ns) of every temporary of `target` in its parent, oldest first."""
    found = []
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return []
    for entry in entries:
        m = _TEMP_RE.fullmatch(entry.name)
        if m and m["name"] == target.name:
            found.append((entry, m["kind"], int(m["pid"]), int(m["ns"])))
    return sorted(found, key=lambda item: item[3])


def recover(target: str | os.PathLike) -> list[str]:
    """Repair what an interrupted writer of `target` left: restore `target` from an `old` temporary when a
    swap died between its renames, and remove the temporaries of dead processes. Returns what was done."""
    target = _absolute(target)
    done = []
    for path, kind, pid, ns in temporaries(target):
        if owner_alive(pid, ns):
            continue
        if kind == "old" and not target.exists() and not target.is_symlink():
            os.rename(path, target)
            done.append(f"restored {target} from {path.name}")
        else:
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed stale {path.name}")
    return done


# -- checks before the expensive work ----------------------------------------------------------------------
def _absolute(target: str | os.PathLike) -> Path:
    target = Path(target)
    return Path(os.path.abspath(target.parent)) / target.name if target.name else Path(os.path.abspath(target))


def preflight(target: str | os.PathLike, overwrite: bool = False, field: str = "--out") -> Path:
    """Refuse an output directory that cannot be written, before any work starts. Creates nothing that stays.

    Refused: `target` is a file or symlink; a non-empty directory without `overwrite`; a parent that is a
    file; a parent (or nearest existing ancestor) where this process cannot create a directory.
    Returns the absolute target path.
    """
    target = _absolute(target)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise OutputDirError(f"{field} {target}: is a file or a symlink (expected a directory to create)")
    if target.is_dir() and not overwrite and any(target.iterdir()):
        raise OutputDirError(f"{field} {target}: already exists and is not empty; pass --overwrite to replace it")
    ancestor = target.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputDirError(f"{field} {target}: {ancestor} is not a directory")
    try:  # the real test (os.access is wrong for root, ACLs and read-only mounts)
        probe = tempfile.mkdtemp(prefix=".oscar-probe-", dir=ancestor)
        os.rmdir(probe)
    except OSError as exc:
        raise OutputDirError(f"{field} {target}: cannot create files in {ancestor} ({exc.strerror}); "
                             "choose a writable location") from None
    return target


# -- the swap ------------------------------------------------------------------------------------------
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux renameat2 RENAME_EXCHANGE). False when unsupported."""
    if not os.uname().sysname == "Linux":
        return False
    try:
        libc = _libc()
        fn = getattr(libc, "renameat2", None) if libc is not None else None
    except OSError:
        fn = None
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _fsync_tree(root: Path) -> None:
    """Flush file contents and directory entries before the rename makes them visible."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with contextlib.suppress(OSError), open(os.path.join(dirpath, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, name))
    return total


def _temp_name(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.oscar-{kind}-{os.getpid()}-{time.time_ns()}"


class _Swap:
    """Where a commit stands, so that every failure says what is on disk: `replaced` once the new content is at
    the target, `moved_aside` (fallback only) while the old content sits at `old` and the target is missing."""

    def __init__(self) -> None:
        self.replaced = False
        self.moved_aside: Path | None = None


def _commit(tmp: Path, target: Path, overwrite: bool, field: str, swap: _Swap) -> None:
    _fsync_tree(tmp)
    _checkpoint("before-commit")
    if not target.exists():
        try:
            os.rename(tmp, target)  # replaces an empty directory that appeared meanwhile, refuses a full one
        except OSError as exc:
            if target.exists():
                raise OutputDirError(f"{field} {target}: appeared while the job ran ({exc.strerror}); nothing was "
                                     "replaced; pass --overwrite to replace it") from None
            raise OutputDirError(f"{field} {target}: could not be created ({exc.strerror}); nothing was written "
                                 "(temporaries removed)") from None
        swap.replaced = True
    else:
        if target.is_symlink() or not target.is_dir():
            raise OutputDirError(f"{field} {target}: became a file while the job ran; nothing was replaced")
        if not overwrite and any(target.iterdir()):
            raise OutputDirError(f"{field} {target}: appeared while the job ran; pass --overwrite to replace it")
        try:
            exchanged = exchange(tmp, target)
        except OSError as exc:  # renameat2 is one step: it failed as a whole, the target is as it was
            raise OutputDirError(f"{field} {target}: the new content could not be swapped in ({exc.strerror}); "
                                 f"{target} keeps its old content, nothing was replaced") from None
        if exchanged:  # tmp now holds the old content (removed by the caller's clean-up)
            swap.replaced = True
            _checkpoint("after-exchange")
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            old = _temp_name(target, "old")
            try:
                os.rename(target, old)
            except OSError as exc:
                raise OutputDirError(f"{field} {target}: could not move the old content aside ({exc.strerror}); "
                                     "nothing was replaced") from None
            swap.moved_aside = old
            try:
                _checkpoint("between-renames")
                os.rename(tmp, target)
            except BaseException as exc:  # an interrupt or error between the renames: put the old content back
                if not target.exists():
                    try:
                        os.rename(old, target)
                        swap.moved_aside = None
                    except OSError:
                        pass  # the message below says where the old content is
                if isinstance(exc, OSError):
                    raise OutputDirError(
                        f"{field} {target}: the new content could not be moved in ({exc.strerror}); "
                        + (f"{target} keeps its old content, nothing was replaced" if swap.moved_aside is None else
                           f"{target} is missing and its old content is at {old}; once this process has ended, the next "
                           f"run (or runtime_kernels.atomic.recover('{target}')) puts it back")) from None
                raise
            swap.moved_aside = None
            swap.replaced = True
            try:
                _checkpoint("before-remove-old")
            finally:  # the new content is in place; an interrupt here must not leave the old copy behind
                shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(target.parent)


def interrupt_outcome(target: Path, swap: _Swap) -> str | None:
    """What an interrupt during the commit of `target` leaves, when it is not "nothing was replaced"."""
    if swap.replaced:
        return (f"{target} already holds the complete new content (the swap had finished); the old content and "
                "temporaries are removed")
    if swap.moved_aside is not None and not target.exists():
        return (f"{target} is missing and its old content is at {swap.moved_aside}; the next run (or "
                f"runtime_kernels.atomic.recover('{target}')) puts it back")
    return None


# Targets this process has replaced, in order (`oscar_calib.interrupts` reads it: an interrupt after a commit must
# not claim that nothing was replaced).
COMMITTED: list[str] = []


# -- one writer per target ---------------------------------------------------------------------------------------
_HELD: dict[str, int] = {}  # lock path -> fd, for locks this process holds (re-entrant within the process)


def _lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.oscar-lock"


@contextlib.contextmanager
def output_lock(target: str | os.PathLike, field: str = "--out") -> Iterator[None]:
    """Hold the lock of `target` (an fcntl lock on `.<name>.oscar-lock` beside it, holding `pid host time`).

    A second writer of the same target, in another process, is refused at once with OutputDirError naming the
    holder. The lock file is removed on release (after which the inode is checked, so a waiter never holds a lock
    on an unlinked file). Needs the parent directory to exist; where `fcntl` is missing, nothing is locked.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    import socket

    target = _absolute(target)
    path = _lock_path(target)
    key = str(path)
    if key in _HELD:
        yield
        return
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # no writable parent (yet): the preflight names that; nothing to lock
            fd = None
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise OutputDirError(f"{field} {target}: another writer holds it ({holder}; lock file {path}); "
                                 "wait for it to finish or choose another path; nothing was written") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file between our open and lock: take the new one
    if fd is None:
        yield
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}"
                  .encode(), 0)
    _HELD[key] = fd
    try:
        yield
    finally:
        _HELD.pop(key, None)
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


@contextlib.contextmanager
def atomic_output_dir(target: str | os.PathLike, overwrite: bool = False, field: str = "--out",
                      needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield an empty temporary directory beside `target`; on success it becomes `target` atomically.

    Before anything: `preflight` (refuses a target that cannot be written), the target's lock (`output_lock`: a
    concurrent writer of the same target is refused, naming the holder) and `recover` (repairs and cleans what
    interrupted runs left). On any exception, including KeyboardInterrupt (and SIGTERM through
    `oscar_calib.interrupts`), the temporary directory is removed and `target` is untouched, except when the swap
    had already happened: an interrupt then carries `outcome` (what is on disk), which the interrupt handler
    prints instead of "nothing was replaced". A full disk (ENOSPC / EDQUOT) raises one `DiskFullError` naming
    `target` and the bytes needed (`needed_bytes`, else more than what was written).
    """
    target = preflight(target, overwrite, field)
    target.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(target, field):
        recover(target)
        tmp = _temp_name(target, "tmp")
        os.mkdir(tmp, 0o777)  # the usual directory mode under the umask (mkdtemp would make it 0700)
        swap = _Swap()
        try:
            _checkpoint("created")
            try:
                yield tmp
                _commit(tmp, target, overwrite, field, swap)
                COMMITTED.append(str(target))
                _checkpoint("after-commit")
            except DiskFullError:
                raise
            except KeyboardInterrupt as exc:
                outcome = interrupt_outcome(target, swap)
                if outcome is not None:
                    exc.outcome = outcome
                raise
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                written = _tree_bytes(tmp)  # what fitted before the disk filled: the output needs more than that
                raise DiskFullError(disk_full_message(target, needed_bytes or written, exc.errno,
                                                      at_least=needed_bytes is None), exc.errno) from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["COMMITTED", "DiskFullError", "OutputDirError", "atomic_output_dir", "disk_space_for", "exchange",
           "free_bytes", "interrupt_outcome", "output_lock", "owner_alive", "preflight", "recover", "temporaries"]
