"""Issue 21 classes 4, 5 and 7 on the command line: checks before the expensive work, one line and a documented
exit code for common failures, clean and fast interrupts of a real `oscar-calib run`, and the torch floor."""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
import torch
from format_helpers import PAPER
from safetensors.torch import save_file
from test_cli_run import model_dir, run_cli, text_file  # noqa: F401  (module-scoped fixtures)

from runtime_kernels.artifact import ARTIFACT_FILENAME, identity_artifact, write_artifact
from runtime_kernels.atomic import temporaries

ROOT = Path(__file__).resolve().parents[1]


def _one_error_line(err: str) -> bool:
    """The failure is one `Error:` line, the last one (the lines before are the auto-chosen settings)."""
    lines = err.strip().splitlines()
    return lines[-1].startswith("Error: ") and sum("Error" in x for x in lines) == 1 and "Traceback" not in err


def _args(model, data, out, *extra):
    # 64/256 windows: the held-out sequence (the model's context by default) must be longer than the BF16 windows
    # (checked before the data is read).
    return ["run", "--model", str(model), "--dataset", str(data), "--out", str(out), "--samples", "2",
            "--seq-len", "384", "--sink", "64", "--recent", "256", *extra]


# --- class 7: zero is not a default ----------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--samples", "--seq-len"])
def test_zero_samples_or_seq_len_is_refused_not_defaulted(flag, model_dir, text_file, tmp_path, monkeypatch, capsys,  # noqa: F811
                                                          no_model_load):
    args = ["run", "--model", str(model_dir), "--dataset", str(text_file), "--out", str(tmp_path / "o"), flag, "0"]
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and (flag in err or flag.strip("-").replace("-", "_") in err) and "got 0" in err, err
    assert not (tmp_path / "o").exists()


def test_demo_zero_samples_is_refused(tmp_path, monkeypatch, capsys, no_model_load):
    code, _, err = run_cli(["run", "--out", str(tmp_path / "o"), "--samples", "0"], monkeypatch, capsys)
    assert code == 2 and "samples" in err


# --- class 4: pre-flight of --out -------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["proc", "file", "file-parent", "full"])
def test_unwritable_out_is_refused_before_calibration(case, model_dir, text_file, tmp_path, monkeypatch, capsys,  # noqa: F811
                                                     no_model_load):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("x")
    out, message = {"proc": (Path("/proc/1/oscar-out"), "cannot create files in /proc/1"),
                    "file": (a_file, "is a file"),
                    "file-parent": (a_file / "out", "is not a directory"),
                    "full": (full, "pass --overwrite")}[case]
    t0 = time.perf_counter()
    code, stdout, err = run_cli(_args(model_dir, text_file, out), monkeypatch, capsys)
    assert code == 2 and message in err and "--out" in err and stdout == "", err
    assert _one_error_line(err)
    assert time.perf_counter() - t0 < 10
    assert a_file.read_text() == "x" and (full / "keep").read_text() == "x"


# --- class 4: binary datasets ----------------------------------------------------------------------------
@pytest.mark.parametrize("name, data, message", [
    ("bin.jsonl", bytes(range(256)) * 8, "binary file (NUL byte at offset 0)"),
    ("latin.jsonl", '{"text": "caf\u00e9"}\n'.encode("latin-1"), "line 1 is not UTF-8 text"),
    ("late.jsonl", b'{"text": "ok"}\n' * 3 + b'{"text": "\xff\xfe"}\n', "line 4 is not UTF-8 text"),
    ("gz.jsonl", b"\x1f\x8b\x08\x00" + b"\x00" * 64, "binary file"),
    ("bin.txt", b"hello\x00world" * 10, "binary file"),
    ("deep.jsonl", b"[" * 100000 + b"\n", "line 1 is not valid JSON"),
    ("bigint.jsonl", b'{"text": "a", "n": ' + b"1" * 5000 + b"}\n", "line 1 is not usable JSON"),
], ids=lambda v: v if isinstance(v, str) and v.endswith((".jsonl", ".txt")) else "")
def test_binary_or_broken_dataset_is_one_line_exit_2(name, data, message, model_dir, tmp_path, monkeypatch,  # noqa: F811
                                                     capsys):
    path = tmp_path / name
    path.write_bytes(data)
    code, out, err = run_cli(_args(model_dir, path, tmp_path / "o"), monkeypatch, capsys)
    assert code == 2 and message in err and str(path) in err, err
    assert _one_error_line(err)
    assert not (tmp_path / "o").exists() and temporaries(tmp_path / "o") == []


# --- class 4: audit of mis-shaped tensors -------------------------------------------------------------------
def _artifact_with(tmp_path: Path, **replace) -> Path:
    art = identity_artifact(2, 2, 4, 16, model_id="tiny/qwen3", fmt=PAPER)
    directory = tmp_path / "art"
    write_artifact(art, directory)
    tensors = {n: t.contiguous() for n, t in art.tensors().items()}
    tensors.update(replace)
    save_file(tensors, str(directory / ARTIFACT_FILENAME), metadata=dict(art.metadata))
    return directory


@pytest.mark.parametrize("replace, field", [
    ({"k_rotation": torch.zeros(2, 2, 16)}, "k_rotation"),
    ({"k_rotation": torch.zeros(2, 2, 16, 8)}, "k_rotation"),
    ({"k_rotation": torch.zeros(0, 2, 16, 16)}, "k_rotation"),
    ({"v_rotation": torch.zeros(2, 2, 8, 8)}, "v_rotation"),
    ({"k_clip_ratio": torch.ones(2)}, "k_clip_ratio"),
    ({"v_clip_ratio": torch.ones(2, 3)}, "v_clip_ratio"),
    ({"k_eigenvalues": torch.ones(2, 2)}, "k_eigenvalues"),
    ({"v_eigenvalues": torch.ones(2, 2, 15)}, "v_eigenvalues"),
    ({"layer_ids": torch.arange(3)}, "layer_ids"),
])
def test_audit_of_mis_shaped_tensors_is_one_line_exit_2(replace, field, tmp_path, monkeypatch, capsys):
    directory = _artifact_with(tmp_path, **replace)
    code, out, err = run_cli(["audit", str(directory)], monkeypatch, capsys)
    assert code == 2 and f"field '{field}'" in err and "cannot be audited" in err, err
    assert _one_error_line(err)


def test_audit_of_a_well_shaped_artifact_still_runs(tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(["audit", str(_artifact_with(tmp_path)), "--json"], monkeypatch, capsys)
    assert code == 0, err
    assert len(json.loads(out)["heads"]) == 4


# --- class 5: a real run, interrupted ------------------------------------------------------------------------
@pytest.mark.slow  # about 35 s each on 2 shared CPU cores: a subprocess that imports torch, then a full re-run
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_interrupted_run_stops_fast_and_leaves_the_old_output(sig, model_dir, text_file, tmp_path, monkeypatch,  # noqa: F811
                                                              capsys):
    out = tmp_path / "art"
    out.mkdir()
    (out / "old.txt").write_text("previous run")
    env = {**os.environ, "COLUMNS": "200"}
    long_args = _args(model_dir, text_file, out, "--overwrite")
    proc = subprocess.Popen([sys.executable, "-m", "oscar_calib", *long_args, "--samples", "30"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # wait until the capture (the expensive part) is under way
        seen.append(line)
        if line.startswith("capture") or "tokens" in line:
            break
    else:
        pytest.fail(f"the run ended before capturing: {''.join(seen)}")
    sent = time.monotonic()
    proc.send_signal(sig)
    _, rest = proc.communicate(timeout=60)
    stopped_in = time.monotonic() - sent
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), rest
    assert stopped_in < 2.0
    last = rest.strip().splitlines()[-1]
    assert ("Terminated (SIGTERM)" if sig == signal.SIGTERM else "Interrupted") in last and "run the command again" in last
    assert "Traceback" not in rest
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"] and temporaries(out) == []
    # A re-run after the interrupt works and replaces the old output.
    code, stdout, err = run_cli(long_args, monkeypatch, capsys)
    assert code == 0, err
    assert (out / ARTIFACT_FILENAME).is_file() and not (out / "old.txt").exists() and temporaries(out) == []


# --- class 7: the torch floor ------------------------------------------------------------------------------
def test_torch_floor_excludes_bypassable_weights_only_and_admits_supported_versions():
    from packaging.requirements import Requirement
    from packaging.version import Version

    runtime = tomllib.loads((ROOT / "runtime" / "pyproject.toml").read_text())["project"]["dependencies"]
    main = runpy.run_path(str(ROOT / "setup.py"), run_name="setup_lists")["DEPENDENCIES"]  # oscar-calib's (dynamic)
    for deps in (runtime, main):  # both distributions load artifacts; oscar-calib also imports reference files
        (torch_req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
        for bad in ("2.4.0", "2.5.1"):  # torch.load(weights_only=True) bypassable up to 2.5.1 (CVE-2025-32434)
            assert not torch_req.specifier.contains(bad)
        for good in ("2.6.0", "2.11.0", "2.13.0"):  # the fix, the GPU machine's, this machine's
            assert torch_req.specifier.contains(good)
        assert torch_req.specifier.contains(Version(torch.__version__.split("+")[0]).base_version)
