"""Issue 21 class 5: atomic output directories under interrupts (runtime_kernels.atomic, oscar_calib.interrupts).

Real subprocesses are stopped at named stages of a write and sent SIGINT, SIGTERM or SIGKILL; afterwards the
output path holds either the complete old or the complete new directory (never a mix, never a partial one;
the one documented gap, SIGKILL between the two renames of the non-Linux fallback, is repaired by the next
run), and a re-run succeeds and leaves no temporaries. The children load the two stdlib-only modules by path,
so each starts in milliseconds instead of importing torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime_kernels import atomic
from runtime_kernels.atomic import OutputDirError, atomic_output_dir, preflight, recover, temporaries

ROOT = Path(__file__).resolve().parents[1]
OLD = {"part0": "old", "part1": "old", "part2": "old", "only-old": "old"}
NEW = {"part0": "new", "part1": "new", "part2": "new"}

CHILD = r"""
import importlib.util, os, sys, time
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
atomic = load("rk_atomic", sys.argv[5] + "/runtime_kernels/atomic.py")
interrupts = load("oc_interrupts", sys.argv[5] + "/oscar_calib/interrupts.py")
target, stage, mode, marker = sys.argv[1:5]
if mode == "fallback":
    atomic.exchange = lambda a, b: False
def checkpoint(name):
    if name == stage:  # tell the parent by a rename, so no signal lands in a file's close (it would be ignored)
        with open(marker + ".tmp", "w") as handle:
            handle.write(name)
        os.replace(marker + ".tmp", marker)
        time.sleep(60)
atomic._checkpoint = checkpoint
with interrupts.handle_interrupts():
    with atomic.atomic_output_dir(target, overwrite=True) as tmp:
        for i in range(3):
            (tmp / f"part{i}").write_text("new")
            if i == 1:
                checkpoint("writing")
print("done", flush=True)
"""


def contents(path: Path) -> dict[str, str] | None:
    if not path.exists():
        return None
    return {p.name: p.read_text() for p in path.iterdir()}


def write_dir(path: Path, files: dict[str, str]) -> None:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)


def start_child(target: Path, stage: str, mode: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    marker = tmp_path / f"marker-{stage}-{mode}-{time.time_ns()}"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(target), stage, mode, str(marker), str(ROOT)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"child never reached stage {stage}: {proc.communicate()}")
        time.sleep(0.01)
    return proc, marker


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


# (stage, mode, what the target holds right after SIGINT / SIGTERM, right after SIGKILL)
CASES = [
    ("writing", "exchange", OLD, OLD),
    ("before-commit", "exchange", OLD, OLD),
    ("after-exchange", "exchange", NEW, NEW),
    ("between-renames", "fallback", OLD, None),  # SIGKILL: nothing until the next run restores the old one
    ("before-remove-old", "fallback", NEW, NEW),
]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["INT", "TERM", "KILL"])
@pytest.mark.parametrize("stage, mode, after_signal, after_kill", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_signal_at_each_stage_leaves_old_or_new_and_rerun_works(tmp_path, sig, stage, mode, after_signal, after_kill):
    target = tmp_path / "out"
    write_dir(target, OLD)
    proc, _ = start_child(target, stage, mode, tmp_path)
    sent = time.monotonic()
    proc.send_signal(sig)
    code, err = finish(proc)
    stopped_in = time.monotonic() - sent
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
        assert contents(target) == after_kill
    else:
        assert code == (130 if sig == signal.SIGINT else 143), err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert ("Terminated (SIGTERM)" if sig == signal.SIGTERM else "Interrupted") in err
        assert contents(target) == after_signal
        assert temporaries(target) == []  # the handler's cleanup ran
        assert stopped_in < 2.0
    # The next run repairs and cleans whatever was left, then writes normally.
    done = subprocess.run([sys.executable, "-c", CHILD, str(target), "none", mode, str(tmp_path / "m"), str(ROOT)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr
    assert contents(target) == NEW and temporaries(target) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_pid_reuse_is_not_mistaken_for_a_live_owner():
    assert atomic.owner_alive(os.getpid(), 0)
    assert atomic.owner_alive(os.getppid(), time.time_ns())
    if atomic._process_start_s(1) is not None:
        assert not atomic.owner_alive(1, 10**9)  # pid 1 started long after 1970


def test_sigkill_into_a_new_target_leaves_nothing_visible(tmp_path):
    target = tmp_path / "fresh"
    proc, _ = start_child(target, "writing", "exchange", tmp_path)
    proc.kill()
    finish(proc)
    (left,) = temporaries(target)  # hidden, recognisable by name, its owner dead
    assert not target.exists() and left[1] == "tmp" and left[2] == proc.pid
    assert recover(target) == [f"removed stale {left[0].name}"]
    assert temporaries(target) == [] and not target.exists()


# --- in-process behaviour ---------------------------------------------------------------------------------
def test_new_target_and_overwrite_with_and_without_exchange(tmp_path, monkeypatch):
    target = tmp_path / "a" / "out"
    with atomic_output_dir(target) as tmp:
        scratch = tmp.parent  # the content sits inside a marked scratch folder beside the target
        assert scratch.parent == target.parent and scratch.name.startswith(".out.oscar-tmp-")
        assert atomic.is_scratch(scratch, target, "tmp")
        (tmp / "x").write_text("1")
    assert contents(target) == {"x": "1"} and temporaries(target) == []
    with atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "y").write_text("2")
    assert contents(target) == {"y": "2"} and temporaries(target) == []
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    with atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "z").write_text("3")
    assert contents(target) == {"z": "3"} and temporaries(target) == []


def test_exchange_swaps_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_dir(a, {"f": "a"})
    write_dir(b, {"f": "b"})
    if not atomic.exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here (the fallback is tested above)")
    assert contents(a) == {"f": "b"} and contents(b) == {"f": "a"}


def test_mode_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        with atomic_output_dir(tmp_path / "out") as tmp:
            (tmp / "f").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failing_body_changes_nothing(tmp_path, error):
    target = tmp_path / "out"
    write_dir(target, OLD)
    with pytest.raises(type(error)), atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "part0").write_text("new")
        raise error
    assert contents(target) == OLD and temporaries(target) == []


def test_refusals_happen_before_the_body_runs(tmp_path):
    ran = []
    full = tmp_path / "full"
    write_dir(full, {"f": "x"})
    a_file = tmp_path / "file"
    a_file.write_text("x")
    link = tmp_path / "link"
    link.symlink_to(full)
    cases = [(full, False, "already exists and is not empty; pass --overwrite"),
             (a_file, True, "is a file or a symlink"), (link, True, "is a file or a symlink"),
             (a_file / "sub", True, "is not a directory"),
             (Path("/proc/1/oscar-out"), True, "cannot create files in /proc/1")]
    for target, overwrite, message in cases:
        with pytest.raises(OutputDirError, match=message), atomic_output_dir(target, overwrite=overwrite):
            ran.append(target)
    assert ran == [] and contents(full) == {"f": "x"} and a_file.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_preflight_refuses_a_read_only_parent(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(OutputDirError, match="cannot create files"):
            preflight(ro / "deep" / "out")
    finally:
        ro.chmod(0o700)


def test_appeared_meanwhile_without_overwrite_is_refused(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(OutputDirError, match="appeared while the job ran"), atomic_output_dir(target) as tmp:
        (tmp / "f").write_text("mine")
        write_dir(target, {"g": "theirs"})
    assert contents(target) == {"g": "theirs"} and temporaries(target) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_scratch(path: Path, target: Path, kind: str, files: dict[str, str]) -> None:
    """A scratch folder as atomic_output_dir makes it: the marker and the payload in content/."""
    write_dir(path / "content", files)
    (path / atomic.SCRATCH_MARKER).write_bytes(atomic._marker_text(target, kind))


def test_recover_keeps_live_owners_and_restores_or_removes_dead_ones(tmp_path):
    target = tmp_path / "out"
    dead, now = _dead_pid(), time.time_ns()
    live_tmp = tmp_path / f".out.oscar-tmp-{os.getppid()}-{now}"
    dead_tmp = tmp_path / f".out.oscar-tmp-{dead}-{now}"
    dead_old = tmp_path / f".out.oscar-old-{dead}-{now + 1}"
    reused = tmp_path / f".out.oscar-tmp-1-{10**9}"  # pid 1 lives, but started long after 1970: a reused pid
    other = tmp_path / f".other.oscar-tmp-{dead}-{now}"  # another target's temporary: not ours to touch
    for d in (live_tmp, dead_tmp, dead_old, reused, other):
        kind = "old" if "oscar-old" in d.name else "tmp"
        write_scratch(d, tmp_path / d.name.split(".oscar-")[0][1:], kind, {"f": d.name})
    done = recover(target)
    assert contents(target) == {"f": dead_old.name}  # the swap died between its renames: old content is back
    assert live_tmp.exists() and other.exists() and not dead_tmp.exists() and not reused.exists()
    assert not dead_old.exists()
    assert any("restored" in line for line in done) and sum("removed stale" in line for line in done) == 2
    write_scratch(tmp_path / f".out.oscar-old-{dead}-{now + 2}", target, "old", {"f": "older"})
    recover(target)  # the target exists now: a dead writer's old copy is just removed
    assert contents(target) == {"f": dead_old.name}
    assert [t[0] for t in temporaries(target)] == [live_tmp]
