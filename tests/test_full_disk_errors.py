"""Issue 54 item 8: a full disk is one line naming the path and the errno (exit 1), whoever wrote: the project's
own writers (export's reference files, audit's PNGs) and a library's write wrapped in its own exception (the Hub
client filling `pull --cache-dir`). Nothing half-written stays behind.

The full disk is simulated with `tests/test_error_table.full_disk` (files opened for writing under a folder fail
their first write with ENOSPC); where this process may mount a 64 KiB tmpfs, a real one is used as well.
"""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli
from format_helpers import PAPER
from test_error_table import full_disk

from oscar_calib.cli.exit_codes import exit_code_for, one_line_message
from runtime_kernels.artifact import identity_artifact, write_artifact

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def artifact(tmp_path):
    return write_artifact(identity_artifact(4, 2, 4, 128, model_id="tiny/m", fmt=PAPER), tmp_path / "art").parent


def test_export_on_a_full_disk_leaves_nothing(artifact, tmp_path, monkeypatch, capsys):
    full_disk(monkeypatch, tmp_path / "disk")
    (tmp_path / "disk").mkdir()
    code, _, err = run_cli(["export", str(artifact), "--out", str(tmp_path / "disk" / "ref")], monkeypatch, capsys)
    # the scratch folder's file fails; the error names the output it was for (runtime_kernels.atomic)
    assert code == 1 and "disk/ref: ENOSPC: no space left on device" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list((tmp_path / "disk").iterdir()) == []  # the temporary directory is gone, no --out


def test_a_library_write_that_fills_the_disk_is_named_not_errno_28(tmp_path, monkeypatch, capsys):
    """`pull --cache-dir` on a full disk: the Hub client's OSError (here wrapped, as its download errors are)."""
    import oscar_calib.zoo.hub as hub

    blob = tmp_path / "cache" / "blobs" / "abc.incomplete"

    def full_pull(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(blob))
        except OSError as exc:
            raise RuntimeError("download of oscar_kv.safetensors failed") from exc

    monkeypatch.setattr(hub, "pull", full_pull)
    code, _, err = run_cli(["pull", "org/model", "--repo", "me/zoo", "--revision", "v1", "--cache-dir",
                            str(tmp_path / "cache")], monkeypatch, capsys)
    line = " ".join(err.split())
    assert code == 1 and f"{blob}: ENOSPC: no space left on device" in line and "Errno" not in line, err
    assert "Traceback" not in err


def test_one_line_message_finds_the_cause_and_leaves_other_errors_alone():
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", "/x/y")
        except OSError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as exc:
        assert exit_code_for(exc) == 1
        assert one_line_message(exc).startswith("/x/y: EDQUOT: disk quota exceeded")
    assert one_line_message(ValueError("plain")) == "plain" and exit_code_for(ValueError("plain")) is None


def test_export_onto_a_real_64k_tmpfs(artifact, tmp_path):
    """The issue's case on a real full filesystem (torch's writer said `RuntimeError ... unexpected pos`)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run = subprocess.run([sys.executable, "-m", "oscar_calib", "export", str(artifact), "--out",
                              str(mount / "ref")], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert run.returncode == 1 and "ENOSPC: no space left on device" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
        assert list(mount.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
