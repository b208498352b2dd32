"""Issue 54 items 1 and 6: lock and scratch files that cannot be redirected, and single-file writes whose
interrupts say what is on disk (runtime_kernels.atomic).

Planted at the lock path `.<name>.oscar-lock`: a symlink to a file of the user's (which must keep its bytes), a
dangling symlink, a symlink to /dev/null, a FIFO, a directory, a second hard link to a file of the user's. Each is
refused in one line naming the lock path, before anything is written; the planted entry, its target and the output
stay as they were, and nothing else is left. Planted under a scratch name (`.<name>.oscar-old-<dead pid>-<ns>`):
a folder without the marker, a symlink to a folder, a folder whose marker is a symlink or says something else;
none is adopted as the output or touched. Single-file writes are stopped by real signals at each stage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_atomic import NEW, OLD, ROOT, contents, finish, write_dir

from runtime_kernels import atomic
from runtime_kernels.atomic import (
    OutputDirError,
    atomic_output_dir,
    output_lock,
    recover,
    temporaries,
    write_file_atomically,
)

SECRET = b"the user's file: must keep these bytes\n"


def listing(root: Path) -> dict[str, str]:
    """Every entry under `root` (not following symlinks): its kind, and the bytes of regular files."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = f"link->{os.readlink(path)}"
            elif path.is_dir():
                out[rel] = "dir"
            elif path.is_file():
                out[rel] = f"file:{path.read_bytes()!r}"
            else:
                out[rel] = "special"
    return out


def plant(lock: Path, shape: str, victim: Path) -> None:
    """Put `shape` at `lock` (the lock path), pointing at or linked to `victim` where it makes sense."""
    if shape == "symlink-to-file":
        lock.symlink_to(victim)
    elif shape == "dangling-symlink":
        lock.symlink_to(lock.parent / "nowhere" / "x")
    elif shape == "symlink-to-dev-null":
        lock.symlink_to("/dev/null")
    elif shape == "fifo":
        os.mkfifo(lock)
    elif shape == "directory":
        lock.mkdir()
        (lock / "inside").write_bytes(SECRET)
    elif shape == "hard-link":
        os.link(victim, lock)
    else:
        raise AssertionError(shape)


LOCK_SHAPES = {"symlink-to-file": "is a symlink", "dangling-symlink": "is a symlink",
               "symlink-to-dev-null": "is a symlink", "fifo": "is a FIFO", "directory": "is a directory",
               "hard-link": "has 2 hard links"}


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("shape", list(LOCK_SHAPES))
def test_anything_but_our_own_file_at_the_lock_path_is_refused(tmp_path, shape, overwrite):
    work = tmp_path / "work"
    work.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(SECRET)
    target = work / "out"
    if overwrite:
        write_dir(target, OLD)
    lock = work / ".out.oscar-lock"
    plant(lock, shape, victim)
    before = listing(work)
    ran = []
    with pytest.raises(OutputDirError) as info:
        with atomic_output_dir(target, overwrite=overwrite) as tmp:
            ran.append(tmp)
    message = str(info.value)
    assert "\n" not in message and ran == []
    assert f"--out {target}: the lock file {lock} {LOCK_SHAPES[shape]}" in message
    assert "nothing was written" in message
    assert victim.read_bytes() == SECRET and victim.stat().st_nlink == (2 if shape == "hard-link" else 1)
    assert listing(work) == before  # the planted entry as it was, the output as it was, nothing added
    with pytest.raises(OutputDirError, match="the lock file"), output_lock(target):
        pass


def test_a_fifo_at_the_lock_path_is_never_opened(tmp_path, monkeypatch):
    """Opening a FIFO could block or (a device) have side effects: the lstat refuses it before any open."""
    os.mkfifo(tmp_path / ".out.oscar-lock")
    opened = []
    real_open = os.open

    def spy(path, flags, *args, **kwargs):
        opened.append((str(path), flags))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(atomic.os, "open", spy)
    with pytest.raises(OutputDirError, match="is a FIFO"), output_lock(tmp_path / "out"):
        pass
    monkeypatch.undo()
    # Only the O_EXCL create was tried (it fails with EEXIST without opening the FIFO).
    assert [f & os.O_EXCL for _, f in opened] == [os.O_EXCL]


def test_a_stale_lock_file_is_taken_over_without_being_written(tmp_path):
    """A lock file left by a killed writer is regular and ours: it is locked, removed and made afresh; its
    own bytes are never changed (a writer truncates and writes only a file it made)."""
    lock = tmp_path / ".out.oscar-lock"
    lock.write_bytes(b"pid 1 on host gone since 2001-01-01T00:00:00")
    handle = open(lock, "rb")  # noqa: SIM115  (kept open to read the old inode after it is unlinked)
    try:
        with atomic_output_dir(tmp_path / "out") as tmp:
            (tmp / "f").write_text("x")
            assert lock.read_text().startswith(f"pid {os.getpid()} on host ")
        assert os.fstat(handle.fileno()).st_nlink == 0  # the old file was unlinked ...
        assert handle.read() == b"pid 1 on host gone since 2001-01-01T00:00:00"  # ... never written
    finally:
        handle.close()
    assert contents(tmp_path / "out") == {"f": "x"} and not lock.exists()


def test_the_lock_is_released_only_if_the_file_is_still_ours(tmp_path):
    """A lock file swapped for a symlink while held: the release removes nothing (the symlink stays)."""
    lock = tmp_path / ".out.oscar-lock"
    victim = tmp_path / "victim.txt"
    victim.write_bytes(SECRET)
    with output_lock(tmp_path / "out"):
        os.unlink(lock)
        lock.symlink_to(victim)
    assert lock.is_symlink() and victim.read_bytes() == SECRET


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _plant_scratch(path: Path, shape: str, target: Path, elsewhere: Path, kind: str) -> None:
    if shape == "no-marker":
        write_dir(path, {"evil": "planted"})
    elif shape == "no-marker-content":
        write_dir(path / "content", {"evil": "planted"})
    elif shape == "symlink-to-folder":
        path.symlink_to(elsewhere)
    elif shape == "marker-is-a-symlink":
        write_dir(path / "content", {"evil": "planted"})
        (elsewhere / "marker").write_bytes(atomic._marker_text(target, kind))
        (path / atomic.SCRATCH_MARKER).symlink_to(elsewhere / "marker")
    elif shape == "marker-of-another-target":
        write_dir(path / "content", {"evil": "planted"})
        (path / atomic.SCRATCH_MARKER).write_bytes(atomic._marker_text(target.parent / "other", kind))
    elif shape == "marker-of-another-kind":
        write_dir(path / "content", {"evil": "planted"})
        (path / atomic.SCRATCH_MARKER).write_bytes(atomic._marker_text(target, "tmp" if kind == "old" else "old"))
    else:
        raise AssertionError(shape)


SCRATCH_SHAPES = ["no-marker", "no-marker-content", "symlink-to-folder", "marker-is-a-symlink",
                  "marker-of-another-target", "marker-of-another-kind"]


@pytest.mark.parametrize("kind", ["old", "tmp"])
@pytest.mark.parametrize("shape", SCRATCH_SHAPES)
def test_a_planted_scratch_folder_is_never_adopted_or_touched(tmp_path, shape, kind):
    work = tmp_path / "work"
    work.mkdir()
    elsewhere = tmp_path / "elsewhere"
    write_dir(elsewhere, {"precious": "x"})
    target = work / "out"  # missing: the state in which an `old` scratch folder would be restored
    planted = work / f".out.oscar-{kind}-{_dead_pid()}-{time.time_ns()}"
    _plant_scratch(planted, shape, target, elsewhere, kind)
    before, before_elsewhere = listing(work), listing(elsewhere)
    assert recover(target) == [] and listing(work) == before
    with atomic_output_dir(target) as tmp:
        for name, text in NEW.items():
            (tmp / name).write_text(text)
    assert contents(target) == NEW  # ours, not the planted folder
    after = listing(work)
    assert {k: v for k, v in after.items() if not k.startswith("out")} == before
    assert listing(elsewhere) == before_elsewhere


def test_our_own_dead_scratch_folders_are_still_cleaned_and_restored(tmp_path):
    target = tmp_path / "out"
    dead = _dead_pid()
    old = atomic._make_scratch(target, "old", "--out")
    write_dir(old / "content", OLD)
    os.rename(old, tmp_path / old.name.replace(f"-{os.getpid()}-", f"-{dead}-"))
    assert [line.split(" from ")[0] for line in recover(target)] == [f"restored {target}"]
    assert contents(target) == OLD and temporaries(target) == []


def test_a_scratch_name_that_exists_is_skipped_not_reused(tmp_path, monkeypatch):
    target = tmp_path / "out"
    taken = tmp_path / f".out.oscar-tmp-{os.getpid()}-1"
    write_dir(taken, {"evil": "planted"})
    names = iter([taken, tmp_path / f".out.oscar-tmp-{os.getpid()}-2"])
    monkeypatch.setattr(atomic, "_temp_name", lambda t, kind: next(names))
    with atomic_output_dir(target) as tmp:
        (tmp / "f").write_text("mine")
    assert contents(target) == {"f": "mine"} and contents(taken) == {"evil": "planted"}


# --- one file ---------------------------------------------------------------------------------------------------
FILE_SHAPES = ["symlink-to-file", "symlink-to-dev-null", "fifo", "directory"]


@pytest.mark.parametrize("shape", FILE_SHAPES)
def test_a_file_output_that_is_a_symlink_or_special_file_is_refused(tmp_path, shape):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(SECRET)
    out = tmp_path / "work" / "merged.safetensors"
    out.parent.mkdir()
    plant(out, shape, victim)
    before = listing(out.parent)
    with pytest.raises(OutputDirError) as info:
        write_file_atomically(out, b"new", "--out")
    assert f"--out {out}: is a" in str(info.value) and "expected a regular file to write" in str(info.value)
    assert victim.read_bytes() == SECRET and listing(out.parent) == before


FILE_CHILD = r"""
import importlib.util, os, sys, time
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # under its real name: the interrupt handler looks it up there
    spec.loader.exec_module(module)
    return module
atomic = load("runtime_kernels.atomic", sys.argv[4] + "/runtime_kernels/atomic.py")
interrupts = load("oscar_calib.interrupts", sys.argv[4] + "/oscar_calib/interrupts.py")
target, stage, marker, nested = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5] == "nested"
def checkpoint(name):
    if name == stage:
        with open(marker + ".tmp", "w") as handle:
            handle.write(name)
        os.replace(marker + ".tmp", marker)
        time.sleep(60)
atomic._checkpoint = checkpoint
with interrupts.handle_interrupts():
    if nested:  # a file written inside an output directory's scratch folder (refit's statistics, an artifact)
        with atomic.atomic_output_dir(target, overwrite=True) as tmp:
            atomic.write_file_atomically(tmp / "part0", b"new")
    else:
        atomic.write_file_atomically(target, b"new")
    checkpoint("after-write")  # the caller's next step (stats merge prints its summary)
print("done", flush=True)
"""

NOTHING = "nothing was written or replaced"
REPLACED = "already holds the complete new content"

# (stage, nested in an output directory, what the file holds after SIGINT / SIGTERM, what the message says)
FILE_STAGES = [("file-created", False, b"old", NOTHING), ("file-written", False, b"old", NOTHING),
               ("file-replaced", False, b"new", REPLACED), ("after-write", False, b"new", REPLACED),
               ("file-replaced", True, b"old", NOTHING)]


def start_file_child(target: Path, stage: str, nested: bool, tmp_path: Path) -> subprocess.Popen:
    marker = tmp_path / f"marker-{stage}-{time.time_ns()}"
    proc = subprocess.Popen([sys.executable, "-c", FILE_CHILD, str(target), stage, str(marker), str(ROOT),
                             "nested" if nested else "file"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 30
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"child never reached stage {stage}: {proc.communicate()}")
        time.sleep(0.01)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["INT", "TERM", "KILL"])
@pytest.mark.parametrize("stage, nested, holds, says", FILE_STAGES,
                         ids=[f"{s[0]}{'-nested' if s[1] else ''}" for s in FILE_STAGES])
def test_a_single_file_write_stopped_at_each_stage_says_what_is_on_disk(tmp_path, sig, stage, nested, holds, says):
    work = tmp_path / "work"
    work.mkdir()
    if nested:
        target = work / "out"
        write_dir(target, {"part0": "old"})
        on_disk = lambda: (target / "part0").read_bytes()  # noqa: E731
    else:
        target = work / "merged.safetensors"
        target.write_bytes(b"old")
        on_disk = target.read_bytes
    proc = start_file_child(target, stage, nested, tmp_path)
    proc.send_signal(sig)
    code, err = finish(proc)
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL and on_disk() in (b"old", b"new")  # whole, old or new
        return
    assert code == (130 if sig == signal.SIGINT else 143) and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert on_disk() == holds
    assert says in err and (NOTHING if says == REPLACED else REPLACED) not in err, err
    if says == REPLACED:
        assert f"{target} {REPLACED}" in err
    assert sorted(p.name for p in work.iterdir()) == [target.name]  # no temporary file or folder left
