"""Issue 33 class 6: the output swap tells the truth in every fault, and one writer per target.

Faults are injected at each step of `runtime_kernels.atomic`'s commit: a signal at each named stage (a real
subprocess, as in tests/test_atomic.py) and an OSError from each rename / exchange (in process). After each, the
message must match what is on disk: "nothing was replaced" only when the target holds its old content, "already
holds the complete new content" only when it holds the new one, and a missing target only with where its old content
is. A second writer of a target that one writer holds is refused, naming the holder's pid and host.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli
from test_atomic import CHILD, NEW, OLD, ROOT, contents, finish, start_child, write_dir

from runtime_kernels import atomic
from runtime_kernels.atomic import OutputDirError, atomic_output_dir, output_lock, temporaries

NOTHING = "nothing was written or replaced"
REPLACED = "already holds the complete new content"

# (stage, mode, what the target holds after SIGINT / SIGTERM, what the message must say)
STAGES = [
    ("created", "exchange", OLD, NOTHING),
    ("writing", "exchange", OLD, NOTHING),
    ("before-commit", "exchange", OLD, NOTHING),
    ("after-exchange", "exchange", NEW, REPLACED),
    ("after-commit", "exchange", NEW, REPLACED),
    ("before-commit", "fallback", OLD, NOTHING),
    ("between-renames", "fallback", OLD, NOTHING),
    ("before-remove-old", "fallback", NEW, REPLACED),
    ("after-commit", "fallback", NEW, REPLACED),
]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
@pytest.mark.parametrize("stage, mode, holds, says", STAGES, ids=[f"{s[0]}-{s[1]}" for s in STAGES])
def test_the_interrupt_message_matches_the_disk(tmp_path, sig, stage, mode, holds, says):
    target = tmp_path / "out"
    write_dir(target, OLD)
    proc, _ = start_child(target, stage, mode, tmp_path)
    proc.send_signal(sig)
    code, err = finish(proc)
    assert code == (130 if sig == signal.SIGINT else 143) and "Traceback" not in err, err
    assert contents(target) == holds
    assert says in err and (NOTHING if says == REPLACED else REPLACED) not in err, err
    assert len(err.strip().splitlines()) == 1 and temporaries(target) == []


def _failing(real, fail_on: int, counter: list[int], code: int = errno.EIO):
    def fn(*args, **kwargs):
        counter[0] += 1
        if counter[0] == fail_on:
            raise OSError(code, os.strerror(code), str(args[0]))
        return real(*args, **kwargs)
    return fn


# (mode, which os.rename call fails (1-based; 0 = none), the restore fails too)
RENAME_FAULTS = [("exchange-error", 0, False), ("fallback", 1, False), ("fallback", 2, False), ("fallback", 2, True),
                 ("new-target", 1, False)]


@pytest.mark.parametrize("mode, fail_on, restore_fails", RENAME_FAULTS,
                         ids=[f"{m}-{n}{'-norestore' if r else ''}" for m, n, r in RENAME_FAULTS])
def test_an_error_at_each_swap_step_says_what_is_on_disk(mode, fail_on, restore_fails, tmp_path, monkeypatch):
    target = tmp_path / "out"
    if mode != "new-target":
        write_dir(target, OLD)
    if mode == "exchange-error":
        monkeypatch.setattr(atomic, "exchange", _failing(lambda a, b: True, 1, [0]))
    else:
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    counter = [0]
    real_rename = os.rename
    if restore_fails:
        def rename(src, dst):
            counter[0] += 1
            if counter[0] >= fail_on:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
            return real_rename(src, dst)
    else:
        rename = _failing(real_rename, fail_on, counter) if fail_on else real_rename
    with pytest.raises(OutputDirError) as info:
        with atomic_output_dir(target, overwrite=True) as tmp:
            for name, text in NEW.items():
                (tmp / name).write_text(text)
            monkeypatch.setattr(atomic.os, "rename", rename)
    monkeypatch.setattr(atomic.os, "rename", real_rename)
    message = str(info.value)
    assert "\n" not in message and str(target) in message
    if "is missing" in message:  # only when it is, and with where the old content went
        assert not target.exists() and restore_fails
        old = Path(message.split("old content is at ")[1].split(";")[0])
        assert contents(old) == OLD
        monkeypatch.setattr(atomic, "owner_alive", lambda pid, ns: False)  # as the next run sees it, once we exit
        atomic.recover(target)
        assert contents(target) == OLD
    elif mode == "new-target":
        assert "nothing was written" in message and not target.exists()
    else:
        assert "nothing was replaced" in message and contents(target) == OLD
    assert not [t for t in temporaries(target) if t[1] == "tmp"]


def test_the_interrupt_handler_believes_the_disk_not_the_default(tmp_path, monkeypatch, caplog):
    """In process: an interrupt after a commit, outside the swap (the caller's next step), says what was written."""
    from oscar_calib.interrupts import handle_interrupts

    target = tmp_path / "out"
    said: list[str] = []
    with pytest.raises(SystemExit) as info:
        with handle_interrupts(fast_exit=False, say=said.append):
            with atomic_output_dir(target) as tmp:
                (tmp / "a").write_text("new")
            raise KeyboardInterrupt  # e.g. Ctrl-C while the command prints its summary
    assert info.value.code == 130
    assert len(said) == 1 and f"{target} {REPLACED}" in said[0] and NOTHING not in said[0]
    with caplog.at_level("WARNING", logger="oscar_calib.interrupts"), pytest.raises(SystemExit):
        with handle_interrupts(fast_exit=False):  # no `say`: the library logs the line, it does not print it
            raise KeyboardInterrupt  # nothing written in this command: the default words
    assert NOTHING in caplog.text


# --- one writer per target ---------------------------------------------------------------------------------------
def test_a_second_writer_is_refused_naming_the_lock_holder(tmp_path):
    target = tmp_path / "out"
    write_dir(target, OLD)
    proc, _ = start_child(target, "writing", "exchange", tmp_path)  # holds the lock, mid-write
    try:
        with pytest.raises(OutputDirError, match=rf"another writer holds it \(pid {proc.pid} on host "
                                                 rf"{socket.gethostname()} since .*; lock file .*\.out\.oscar-lock\)"):
            with atomic_output_dir(target, overwrite=True) as tmp:
                (tmp / "mine").write_text("x")
        assert contents(target) == OLD
    finally:
        proc.kill()
        finish(proc)
    with atomic_output_dir(target, overwrite=True) as tmp:  # the holder died: its lock went with it
        (tmp / "mine").write_text("x")
    assert contents(target) == {"mine": "x"}
    assert not (tmp_path / ".out.oscar-lock").exists()


def test_concurrent_writers_one_wins_the_other_is_refused(tmp_path):
    """Several processes write the same target at once: each either commits whole content or is refused."""
    target = tmp_path / "out"
    write_dir(target, OLD)
    script = CHILD.replace('checkpoint("writing")', 'time.sleep(0.3)')
    procs = [subprocess.Popen([sys.executable, "-c", script, str(target), "none", "exchange", str(tmp_path / f"m{i}"),
                               str(ROOT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    results = [p.communicate(timeout=60) for p in procs]
    won = [p for p, (out, _) in zip(procs, results) if p.returncode == 0 and "done" in out]
    refused = [err for p, (_, err) in zip(procs, results) if p.returncode != 0]
    assert len(won) >= 1 and len(won) + len(refused) == 4
    assert all("another writer holds it (pid" in err for err in refused), refused
    assert contents(target) == NEW and temporaries(target) == []


def test_a_second_run_to_the_same_out_is_refused_before_it_calibrates(tmp_path, monkeypatch, capsys):
    import oscar_calib.calibration.job as job

    out = tmp_path / "o"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('a', {str(ROOT / 'runtime_kernels' / 'atomic.py')!r})\n"
        "a = importlib.util.module_from_spec(spec); spec.loader.exec_module(a)\n"
        f"with a.output_lock({str(out)!r}):\n"
        "    print('held', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"

        def boom(*a, **k):
            raise AssertionError("the second run went on to load the model")

        monkeypatch.setattr(job, "_load_model", boom)
        monkeypatch.setattr(job, "load_calibration_data", boom)
        code, _, err = run_cli(["run", "--out", str(out), "--samples", "1", "--seq-len", "64", "--sink", "4",
                                "--recent", "8"], monkeypatch, capsys)
        assert code == 2 and f"pid {holder.pid}" in err and "another writer holds it" in err, err
        assert "Traceback" not in err and not out.exists()
    finally:
        holder.kill()
        holder.wait()


def test_output_lock_is_reentrant_in_one_process(tmp_path):
    with output_lock(tmp_path / "x"):
        with output_lock(tmp_path / "x"):
            assert (tmp_path / ".x.oscar-lock").exists()
    assert not (tmp_path / ".x.oscar-lock").exists()
