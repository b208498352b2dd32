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
live one (left alone). Each is a scratch folder this module made: it holds the marker file `.oscar-scratch`
and the content in `content/`, and it is touched by a later run only when it is a real folder of this user with
that marker (a folder planted under such a name is ignored, never adopted as the output).

`write_file_atomically(path, payload)` does the same for one file (a temporary file beside it, fsync,
`os.replace`), and `output_lock(target)` keeps one writer per target through a lock file beside it that is
never followed through a symlink, never truncated when another process made it, and refused when it is not a
regular file of this user. Everything here is stdlib, so the serving runtime can use it too.
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
SCRATCH_MARKER = ".oscar-scratch"  # inside every scratch folder this module makes; nothing else is adopted
_CONTENT = "content"  # the scratch folder's payload: the new content (tmp) or the old target moved aside (old)


class OutputDirError(ValueError):
    """The output directory cannot be written (exists without overwrite, not a directory, not writable)."""


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskFullError(OSError):
    """No space (or no quota) left where an output is written; the message names the path and the bytes needed."""

    def __init__(self, message: str, code: int = errno.ENOSPC, path: str | os.PathLike | None = None):
        super().__init__(message)
        self.errno = code
        self.path = None if path is None else str(path)  # the file or directory that did not fit, when known


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
        raise DiskFullError(disk_full_message(path, needed, exc.errno), exc.errno, path) from None


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


def _marker_text(target: Path, kind: str) -> bytes:
    return f"oscar-calib {kind} scratch folder of '{target.name}'\n".encode()


def is_scratch(path: Path, target: Path, kind: str) -> bool:
    """Whether `path` is a scratch folder this module made for `target`: a real folder (not a symlink) of this
    user holding the marker file, a regular file of this user with the expected text."""
    import stat

    try:
        info = os.lstat(path)
        marker = os.lstat(path / SCRATCH_MARKER)
    except OSError:
        return False
    uid = os.geteuid()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
        return False
    if not stat.S_ISREG(marker.st_mode) or marker.st_uid != uid or marker.st_size > 4096:
        return False
    try:
        fd = os.open(path / SCRATCH_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.read(fd, 4096) == _marker_text(target, kind)
    finally:
        os.close(fd)


def _make_scratch(target: Path, kind: str, field: str) -> Path:
    """A new scratch folder `.<name>.oscar-<kind>-<pid>-<ns>` beside `target` with its marker (0700: nobody else
    can enter it). A name that exists already (planted, or a clock that did not move) is skipped, never reused."""
    for _ in range(100):
        root = _temp_name(target, kind)
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:
            continue
        try:
            fd = os.open(root / SCRATCH_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                os.write(fd, _marker_text(target, kind))
            finally:
                os.close(fd)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return root
    raise OutputDirError(f"{field} {target}: no free name for a scratch folder beside it (100 tries); "
                         "nothing was written")


def recover(target: str | os.PathLike) -> list[str]:
    """Repair what an interrupted writer of `target` left: restore `target` from an `old` scratch folder when a
    swap died between its renames, and remove the scratch folders of dead processes. Returns what was done.

    Only scratch folders this module made are touched (`is_scratch`): anything else under such a name (a folder
    without the marker, a symlink, another user's folder) is left alone and never becomes `target`."""
    target = _absolute(target)
    done = []
    for path, kind, pid, ns in temporaries(target):
        if owner_alive(pid, ns) or not is_scratch(path, target, kind):
            continue
        content = path / _CONTENT
        if (kind == "old" and not target.exists() and not target.is_symlink() and not content.is_symlink()
                and content.is_dir()):
            os.rename(content, target)
            shutil.rmtree(path, ignore_errors=True)
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
    the target, `moved_aside` (fallback only) while the old content sits in an `old` scratch folder and the target
    is missing."""

    def __init__(self) -> None:
        self.replaced = False
        self.moved_aside: Path | None = None


def _commit(scratch: Path, target: Path, overwrite: bool, field: str, swap: _Swap) -> None:
    """Move `scratch/content` to `target` (see the module's docstring); the caller removes `scratch`."""
    tmp = scratch / _CONTENT
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
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            old_scratch = _make_scratch(target, "old", field)
            old = old_scratch / _CONTENT
            try:
                os.rename(target, old)
            except OSError as exc:
                shutil.rmtree(old_scratch, ignore_errors=True)
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
                        shutil.rmtree(old_scratch, ignore_errors=True)
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
                shutil.rmtree(old_scratch, ignore_errors=True)
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


def _kind_of(mode: int) -> str:
    import stat

    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _lock_refusal(target: Path, path: Path, field: str, what: str) -> OutputDirError:
    return OutputDirError(f"{field} {target}: the lock file {path} {what} (expected a regular file of this user that "
                          "oscar-calib made); remove it if no oscar-calib command is writing there; nothing was "
                          "written")


def _check_lock_file(info: os.stat_result, target: Path, path: Path, field: str) -> None:
    """Refuse a lock file that is not a plain regular file of this user with one name (never written through)."""
    import stat

    if not stat.S_ISREG(info.st_mode):
        raise _lock_refusal(target, path, field, f"is {_kind_of(info.st_mode)}")
    if info.st_uid != os.geteuid():
        raise _lock_refusal(target, path, field, f"belongs to another user (uid {info.st_uid})")
    if info.st_nlink != 1:
        raise _lock_refusal(target, path, field, f"has {info.st_nlink} hard links")


# Flags for every open of a lock file: never through a symlink, never blocking on a FIFO, never inherited.
_LOCK_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# An open of the lock path failing with one of these means no writable parent (yet): the preflight names that.
_NO_PARENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EROFS})


def _open_lock(path: Path, target: Path, field: str) -> tuple[int, bool] | None:
    """(fd, made by this call) of the lock file, or None when there is nowhere to put it.

    A fresh file is made with O_EXCL; an existing one is checked with lstat before it is opened (a FIFO or a
    device is never opened) and with fstat after (the same inode, still a regular file of this user)."""
    try:
        return os.open(path, _LOCK_FLAGS | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno in _NO_PARENT_ERRNOS or (exc.errno == errno.EACCES and not os.path.lexists(path)):
            return None
        raise _lock_refusal(target, path, field, f"cannot be made ({exc.strerror})") from None
    try:
        before = os.lstat(path)
    except FileNotFoundError:  # the holder removed it meanwhile: the caller tries again
        return -1, False
    _check_lock_file(before, target, path, field)
    try:
        fd = os.open(path, _LOCK_FLAGS)
    except FileNotFoundError:
        return -1, False
    except OSError as exc:  # ELOOP: became a symlink after the lstat; EACCES: not writable
        raise _lock_refusal(target, path, field, f"cannot be opened ({exc.strerror})") from None
    info = os.fstat(fd)
    if (info.st_dev, info.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        return -1, False
    try:
        _check_lock_file(info, target, path, field)
    except OutputDirError:
        os.close(fd)
        raise
    return fd, False


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


@contextlib.contextmanager
def output_lock(target: str | os.PathLike, field: str = "--out") -> Iterator[None]:
    """Hold the lock of `target` (an fcntl lock on `.<name>.oscar-lock` beside it, holding `pid host time`).

    A second writer of the same target, in another process, is refused at once with OutputDirError naming the
    holder. The lock file is never followed through a symlink and never written unless this process made it:
    a stale one (left by a killed writer) is locked, removed and made afresh. Anything at the lock path that is not
    a regular file of this user with one link (a symlink, FIFO, device, directory, another user's file) is refused
    with one OutputDirError naming the path, and left as it was. The lock file is removed on release (after which
    the inode is checked, so a waiter never holds a lock on an unlinked file). Needs the parent directory to exist;
    where `fcntl` is missing, nothing is locked.
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
    fd = None
    for _ in range(100):
        opened = _open_lock(path, target, field)
        if opened is None:  # no writable parent (yet): the preflight names that; nothing to lock
            break
        fd, made = opened
        if fd < 0:  # the file changed between two looks: look again
            fd = None
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"
            finally:
                os.close(fd)
            holder = "".join(c if c.isprintable() else "?" for c in holder)
            raise OutputDirError(f"{field} {target}: another writer holds it ({holder}; lock file {path}); "
                                 "wait for it to finish or choose another path; nothing was written") from None
        if not _same_file(fd, path):  # the holder removed the file between our open and lock: take the new one
            os.close(fd)
            fd = None
            continue
        if made:
            break
        # A stale lock file (its writer was killed): ours now, but not made by us, so it is never written. Remove
        # it and make a fresh one; a process that opened the old inode sees it is gone and looks again.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)
        fd = None
    else:
        raise _lock_refusal(target, path, field, "kept changing while it was taken (100 tries)")
    if fd is None:
        yield
        return
    try:
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%S')}".encode(), 0)
    except BaseException:
        if _same_file(fd, path):
            with contextlib.suppress(OSError):
                os.unlink(path)
        os.close(fd)
        raise
    _HELD[key] = fd
    try:
        yield
    finally:
        _HELD.pop(key, None)
        if _same_file(fd, path):  # never a file that replaced ours at that name
            with contextlib.suppress(OSError):
                os.unlink(path)
        os.close(fd)


def _forget_commits_under(root: Path) -> None:
    """Drop from COMMITTED the files written inside a scratch folder: they never reached their final place as such."""
    prefix = str(root) + os.sep
    COMMITTED[:] = [c for c in COMMITTED if not c.startswith(prefix)]


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

    The directory yielded is `content/` inside a scratch folder `.<name>.oscar-tmp-<pid>-<ns>` that holds this
    module's marker (`is_scratch`), so that only folders made here are ever cleaned up or restored.
    """
    target = preflight(target, overwrite, field)
    target.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(target, field):
        recover(target)
        scratch = _make_scratch(target, "tmp", field)
        tmp = scratch / _CONTENT
        swap = _Swap()
        try:
            os.mkdir(tmp, 0o777)  # the usual directory mode under the umask (mkdtemp would make it 0700)
            _checkpoint("created")
            try:
                yield tmp
                _commit(scratch, target, overwrite, field, swap)
                COMMITTED.append(str(target))
                _checkpoint("after-commit")
            except DiskFullError as exc:
                if exc.path is None or not exc.path.startswith(str(scratch) + os.sep):
                    raise
                # A file of the scratch folder did not fit: the user knows the output by its name, not the scratch's.
                raise DiskFullError(disk_full_message(target, needed_bytes or _tree_bytes(tmp), exc.errno,
                                                      at_least=needed_bytes is None), exc.errno, target) from None
            except KeyboardInterrupt as exc:
                # The directory's own view wins over what a file writer inside the scratch folder said.
                exc.outcome = interrupt_outcome(target, swap)
                raise
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                written = _tree_bytes(tmp)  # what fitted before the disk filled: the output needs more than that
                raise DiskFullError(disk_full_message(target, needed_bytes or written, exc.errno,
                                                      at_least=needed_bytes is None), exc.errno, target) from None
        finally:
            _forget_commits_under(scratch)
            if scratch.exists():
                shutil.rmtree(scratch, ignore_errors=True)


# -- one file --------------------------------------------------------------------------------------------------
def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_outcome(path: Path, replaced: bool) -> str | None:
    """What an interrupt during `write_file_atomically(path)` leaves, when it is not "nothing was replaced"."""
    if replaced:
        return f"{path} already holds the complete new content (the replace had finished); temporaries removed"
    return None


def check_file_target(path: str | os.PathLike, field: str = "--out") -> Path:
    """Refuse a file output that is a symlink, a directory or a special file (FIFO, device, socket): it is replaced
    by a regular file, never written through. Returns the absolute path."""
    import stat

    path = _absolute(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise OutputDirError(f"{field} {path}: cannot be inspected ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise OutputDirError(f"{field} {path}: is {_kind_of(info.st_mode)} (expected a regular file to write); "
                             "nothing was written")
    return path


def write_file_atomically(path: str | os.PathLike, payload: bytes, field: str = "--out") -> Path:
    """Write `payload` to `path` through a fsynced temporary file beside it and `os.replace`.

    A reader (or a process killed at any point) sees the old file or the new one, never part of one. The
    temporary file is `.<name>.tmp-<random>` (made with O_EXCL, so nothing planted is followed), mode 0666 under
    the umask, removed on any failure. `path` must be absent or a regular file (`check_file_target`). After the
    replace, `path` is in `COMMITTED`, and an interrupt from then on carries `outcome` saying that the file holds
    the new content (whether the replace happened is read from the disk: the temporary name is gone). A full
    disk (ENOSPC / EDQUOT) becomes one `DiskFullError` naming `path` and the bytes.
    """
    path = check_file_target(path, field)
    with disk_space_for(path, len(payload)):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        handle = os.fdopen(fd, "wb")
        replaced = False
        try:
            try:
                with handle:
                    _checkpoint("file-created")
                    handle.write(payload)
                    handle.flush()
                    os.fchmod(handle.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600; the usual file mode
                    os.fsync(handle.fileno())
                _checkpoint("file-written")
                check_file_target(path, field)  # a symlink or FIFO that appeared meanwhile: refused, not replaced
                os.replace(tmp, path)
                replaced = True
                COMMITTED.append(str(path))
                _checkpoint("file-replaced")
                _fsync_dir(path.parent)
            except KeyboardInterrupt as exc:
                replaced = replaced or not os.path.lexists(tmp)  # a signal between the replace and the flag
                if replaced and str(path) not in COMMITTED:
                    COMMITTED.append(str(path))
                exc.outcome = file_outcome(path, replaced)
                raise
        finally:
            if not replaced:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    return path


__all__ = ["COMMITTED", "SCRATCH_MARKER", "DiskFullError", "OutputDirError", "atomic_output_dir", "check_file_target",
           "disk_space_for", "exchange", "file_outcome", "free_bytes", "interrupt_outcome", "is_scratch",
           "output_lock", "owner_alive", "preflight", "recover", "temporaries", "write_file_atomically"]
