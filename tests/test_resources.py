"""Issue 33 class 5: ordinary resource failures fail clean.

- A full disk (ENOSPC / EDQUOT, injected with monkeypatch at the write) is one line naming the path and the bytes
  needed, exit 1, and nothing half-written, at every write site: checkpoints, statistics files, output directories
  (run, refit, import, pull --local-dir), merges. `run` refuses before the calibration when the free space is short.
- A reference `.pt` has its storage bounded before any allocation: a stride-0 view (a few bytes shown as 16 GiB),
  many views of one storage, and the legacy (non-zip) format are refused by `load_reference`.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from test_reference_format import config as ref_config
from test_reference_format import reference_dict
from test_scale import EPOCH, args, model_dir, text_file  # noqa: F401  (module-scoped fixtures)

from oscar_calib.zoo.reference_format import ReferenceFormatError, check_storage_bounds, load_reference
from runtime_kernels.atomic import DiskFullError, atomic_output_dir, temporaries

Usage = namedtuple("Usage", "total used free")


@pytest.fixture(autouse=True)
def _epoch(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert lines[-1].startswith("Error: ") and "Traceback" not in err, err
    return lines[-1]


def full_disk_after(monkeypatch, budget: int, code: int = errno.ENOSPC) -> None:
    """Every file opened for writing from now on raises ENOSPC once `budget` bytes were written in all."""
    import builtins

    written = [0]
    real_open, real_fdopen = builtins.open, os.fdopen

    def guard(handle):
        real_write = handle.write

        def write(data):
            written[0] += len(data)
            if written[0] > budget:
                raise OSError(code, os.strerror(code))
            return real_write(data)

        try:
            handle.write = write
        except AttributeError:  # a C-level file object: wrap it instead
            return _Wrapped(handle, write)
        return handle

    def fake_open(file, mode="r", *a, **k):
        handle = real_open(file, mode, *a, **k)
        return guard(handle) if any(c in mode for c in "wax+") else handle

    def fake_fdopen(fd, mode="r", *a, **k):
        handle = real_fdopen(fd, mode, *a, **k)
        return guard(handle) if any(c in mode for c in "wax+") else handle

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "fdopen", fake_fdopen)
    real_write_bytes, real_write_text = Path.write_bytes, Path.write_text

    def write_bytes(self, data):
        written[0] += len(data)
        if written[0] > budget:
            raise OSError(code, os.strerror(code), str(self))
        return real_write_bytes(self, data)

    def write_text(self, data, *a, **k):
        written[0] += len(data)
        if written[0] > budget:
            raise OSError(code, os.strerror(code), str(self))
        return real_write_text(self, data, *a, **k)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    monkeypatch.setattr(Path, "write_text", write_text)


class _Wrapped:
    def __init__(self, handle, write):
        self._h, self.write = handle, write

    def __getattr__(self, name):
        return getattr(self._h, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._h.__exit__(*exc)


# --- full disk at the write sites ---------------------------------------------------------------------------------
@pytest.mark.parametrize("code, name", [(errno.ENOSPC, "ENOSPC"), (errno.EDQUOT, "EDQUOT")])
def test_full_disk_during_run_output_is_one_line_exit_1(code, name, model_dir, text_file, tmp_path,  # noqa: F811
                                                        monkeypatch, capsys):
    import oscar_calib.calibration.job as job

    real = job.write_artifact

    def then_full(*a, **k):  # the calibration is done; the disk fills while the output is written
        full_disk_after(monkeypatch, 0, code)
        return real(*a, **k)

    monkeypatch.setattr(job, "write_artifact", then_full)
    out = tmp_path / "o"
    rc, stdout, err = run_cli(args(model_dir, text_file, out), monkeypatch, capsys)
    line = _one_error_line(err)
    assert rc == 1 and stdout == "" and name in line and str(out) in line and "bytes" in line, err
    assert not out.exists() and temporaries(out) == []


def test_full_disk_while_checkpointing_keeps_the_previous_checkpoint(model_dir, text_file, tmp_path,  # noqa: F811
                                                                    monkeypatch, capsys):
    import oscar_calib.calibration.scale.sharded_capture as sc

    real, calls = sc.save_checkpoint, []

    def save(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            full_disk_after(monkeypatch, 0)
        return real(*a, **k)

    monkeypatch.setattr(sc, "save_checkpoint", save)
    out, ckpt = tmp_path / "o", tmp_path / "o.checkpoint"
    rc, _, err = run_cli(args(model_dir, text_file, out, "--checkpoint-every", "1"), monkeypatch, capsys)
    line = _one_error_line(err)
    assert rc == 1 and "ENOSPC" in line and "oscar.checkpoint.safetensors" in line and "needs" in line, err
    monkeypatch.undo()
    from safetensors import safe_open

    with safe_open(str(ckpt / "oscar.checkpoint.safetensors"), "pt") as f:  # the first one, whole
        assert f.metadata()["next_sample"] == "1"
    assert not list(ckpt.glob(".*tmp-*")) and not out.exists()


def test_run_refuses_before_calibration_when_the_disk_is_too_small(model_dir, text_file, tmp_path,  # noqa: F811
                                                                   monkeypatch, capsys):
    import oscar_calib.calibration.job as job

    def boom(*a, **k):
        raise AssertionError("the run went on to the calibration")

    monkeypatch.setattr(job, "load_calibration_data", boom)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    rc, _, err = run_cli(args(model_dir, text_file, tmp_path / "o"), monkeypatch, capsys)
    line = _one_error_line(err)
    assert rc == 1 and "ENOSPC" in line and "need about" in line and "only 1000 are free" in line, err
    assert "before the calibration" in line and not (tmp_path / "o").exists()


def test_output_size_estimate_bounds_what_a_run_writes(model_dir, text_file, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The estimate the pre-check uses is an upper bound of the real output, and not absurdly loose."""
    from transformers import AutoConfig

    from oscar_calib.calibration.scale.disk_budget import output_bytes

    rc, _, err = run_cli(args(model_dir, text_file, tmp_path / "o"), monkeypatch, capsys)
    assert rc == 0, err
    real = sum(p.stat().st_size for p in (tmp_path / "o").iterdir())
    from runtime_kernels.artifact import read_artifact

    held = read_artifact(tmp_path / "o").fitted_context  # the held-out sequence: the model's context by default
    estimate = output_bytes(AutoConfig.from_pretrained(model_dir), torch.float32, held, 1, 256)
    assert real <= estimate <= real + 2 * 2**20, (real, estimate)  # measured: within the 1 MiB slack


def test_full_disk_inside_an_atomic_output_dir(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "old").write_text("old content")
    full_disk_after(monkeypatch, 10)
    with pytest.raises(DiskFullError, match=r"ENOSPC: no space left on device: needs more than \d+ bytes"):
        with atomic_output_dir(tmp_path / "d", overwrite=True) as tmp:
            (tmp / "f").write_bytes(b"x" * 100)
    monkeypatch.undo()
    assert (tmp_path / "d" / "old").read_text() == "old content" and temporaries(tmp_path / "d") == []


def test_full_disk_cli_sites(model_dir, text_file, tmp_path, monkeypatch, capsys):  # noqa: F811
    rc, _, err = run_cli(args(model_dir, text_file, tmp_path / "s0", "--shard", "0/2"), monkeypatch, capsys)
    assert rc == 0, err
    rc, _, err = run_cli(args(model_dir, text_file, tmp_path / "s1", "--shard", "1/2"), monkeypatch, capsys)
    assert rc == 0, err
    for argv, target in ((["stats", "merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out",
                           str(tmp_path / "m.safetensors")], tmp_path / "m.safetensors"),
                         (["refit", str(tmp_path / "s0"), "--out", str(tmp_path / "r"), *("--sink", "4", "--recent", "8")],
                          tmp_path / "r")):
        with monkeypatch.context() as mp:
            full_disk_after(mp, 0)
            rc, out, err = run_cli(argv, mp, capsys)
        line = _one_error_line(err)
        assert rc == 1 and "ENOSPC" in line and str(target) in line and "bytes" in line, err
        assert not target.exists()
        assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or "oscar-tmp" in p.name]


# --- reference files: storage bounded before allocation ------------------------------------------------------------
def test_a_stride_zero_reference_tensor_is_refused_before_allocation(tmp_path):
    ref = reference_dict(seed=0)
    small = torch.zeros(4)
    ref["layers"][0]["rotation"] = small.as_strided((65536, 65536), (0, 0))  # 16 GiB of float32, 16 bytes stored
    torch.save(ref, tmp_path / "k.pt")
    assert (tmp_path / "k.pt").stat().st_size < 10**5
    t0 = time.perf_counter()
    with pytest.raises(ReferenceFormatError, match=r"field 'layers.0.rotation': a tensor of shape \[65536, 65536\] "
                                                   r"and strides \[0, 0\] would allocate 17179869184 bytes from a "
                                                   r"storage of 16"):
        load_reference(tmp_path / "k.pt")
    assert time.perf_counter() - t0 < 5


def test_many_views_of_one_storage_are_refused(tmp_path):
    ref = reference_dict(seed=0, layers=(0,))
    big = torch.zeros(1 << 16)
    ref["layers"] = {i: {"rotation": big, "eigenvalues": big} for i in range(64)}  # 64 x 2 x 256 KiB from 256 KiB
    torch.save(ref, tmp_path / "k.pt")
    with pytest.raises(ReferenceFormatError, match="more than the file's"):
        load_reference(tmp_path / "k.pt")


def test_the_legacy_format_is_refused(tmp_path):
    torch.save(reference_dict(seed=0), tmp_path / "k.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(ReferenceFormatError, match="zip format"):
        load_reference(tmp_path / "k.pt")


def test_cli_import_of_a_stride_zero_file_is_exit_2(tmp_path, monkeypatch, capsys):
    ref = reference_dict(seed=0)
    ref["layers"][1]["eigenvalues"] = torch.ones(1).as_strided((1 << 33,), (0,))
    torch.save(ref, tmp_path / "k.pt")
    torch.save(reference_dict(seed=1), tmp_path / "v.pt")
    ref_config().save_pretrained(tmp_path / "model")
    rc, _, err = run_cli(["import", "--keys", str(tmp_path / "k.pt"), "--values", str(tmp_path / "v.pt"),
                          "--model-config", str(tmp_path / "model"), "--model-id", "tiny/qwen3", "--out",
                          str(tmp_path / "art")], monkeypatch, capsys)
    assert rc == 2 and "layers.1.eigenvalues" in _one_error_line(err) and not (tmp_path / "art").exists()


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 1 << 12), min_size=1, max_size=3),
       strides=st.lists(st.integers(0, 64), min_size=3, max_size=3), storage=st.integers(1, 4096))
def test_fuzz_views_either_refused_or_backed_by_their_storage(shape, strides, storage):
    base = torch.zeros(storage)
    stride = strides[:len(shape)]
    span = sum((n - 1) * s for n, s in zip(shape, stride)) + 1
    if span > storage:
        return  # torch itself refuses a view past its storage
    view = base.as_strided(shape, stride)
    try:
        check_storage_bounds({"t": view}, "fuzz", 1 << 40)
    except ReferenceFormatError as exc:
        assert "field 't'" in str(exc)
        assert view.numel() * view.element_size() > base.untyped_storage().nbytes()
    else:
        assert view.numel() * view.element_size() <= base.untyped_storage().nbytes()


def test_no_traceback_for_a_bad_reference_through_python(tmp_path):
    (tmp_path / "k.pt").write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(ReferenceFormatError):
        load_reference(tmp_path / "k.pt")



def test_full_disk_while_recording_a_release_leaves_the_manifest_unchanged(tmp_path, monkeypatch):
    from oscar_calib.zoo.manifest import load_manifest, write_manifest

    path = tmp_path / "zoo_manifest.yaml"
    shutil.copyfile(Path(__file__).resolve().parents[1] / "zoo_manifest.yaml", path)
    before = path.read_bytes()
    zoo = load_manifest(path)
    full_disk_after(monkeypatch, 0)
    with pytest.raises(DiskFullError, match=r"zoo_manifest.yaml: ENOSPC: no space left on device: needs \d+ bytes"):
        write_manifest(zoo, path)
    monkeypatch.undo()
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["zoo_manifest.yaml"]
