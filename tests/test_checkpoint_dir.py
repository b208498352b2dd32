"""Issue 33 class 1: `run --checkpoint PATH` never overwrites or deletes what is at PATH.

A checkpoint is a directory of its own kind (a marker file and the checkpoint); any other existing path is refused
before the model loads, naming it, and the run's clean-up removes only what runs write there.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from format_helpers import PAPER
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scale import EPOCH, args, model_dir, text_file  # noqa: F401  (module-scoped fixtures)

from oscar_calib.calibration.scale.checkpoint import (
    CHECKPOINT_FILENAME,
    MARKER_FILENAME,
    load_checkpoint,
    prepare_checkpoint_dir,
    save_checkpoint,
)
from oscar_calib.calibration.stats import LayerStats
from oscar_calib.errors import InputError
from runtime_kernels.artifact import identity_artifact, write_artifact


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (and `root` itself when it is a file) -> sha256 of its bytes; links by target."""
    if root.is_symlink():
        return {".": "link:" + os.readlink(root)}
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    return {str(p.relative_to(root)): ("dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*"))}


@pytest.fixture(autouse=True)
def _epoch(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)


def _artifact_dir(path: Path) -> Path:
    write_artifact(identity_artifact(2, 2, 4, 16, model_id="tiny/qwen3", fmt=PAPER), path)
    (path / "README.md").write_text("my model card\n")
    return path


# --- the regression: an existing artifact at PATH ---------------------------------------------------------------
@pytest.mark.parametrize("extra", [["--checkpoint-every", "1"], ["--resume"], []])
def test_checkpoint_onto_an_existing_artifact_leaves_it_untouched(extra, model_dir, text_file, tmp_path,  # noqa: F811
                                                                  monkeypatch, capsys, no_model_load):
    art = _artifact_dir(tmp_path / "my-artifact")
    before = snapshot(art)
    code, out, err = run_cli(args(model_dir, text_file, tmp_path / "o", "--checkpoint", str(art), *extra),
                             monkeypatch, capsys)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert f"--checkpoint {art}: exists and is not a checkpoint directory" in err
    assert snapshot(art) == before  # byte-equal: nothing written, nothing removed
    assert not (tmp_path / "o").exists()


def _hostile(tmp_path: Path, kind: str) -> tuple[Path, Path, str]:
    """(checkpoint path, what must stay unchanged, message) for one kind of path that is not a checkpoint dir."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    full = tmp_path / "full"
    full.mkdir()
    (full / "data.bin").write_bytes(b"\x00\x01")
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / MARKER_FILENAME).write_text("not ours\n")
    (forged / "x").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(a_file)
    return {
        "file": (a_file, a_file, "is a file or a symlink"),
        "symlink": (link, a_file, "is a file or a symlink"),
        "non-empty dir": (full, full, "no OSCAR_CHECKPOINT marker"),
        "wrong marker": (forged, forged, "no OSCAR_CHECKPOINT marker"),
        "under a file": (a_file / "ckpt", a_file, "is not a directory"),
        "proc": (Path("/proc/1/oscar-ckpt"), a_file, "cannot create files in /proc/1"),
        "the output": (tmp_path / "o", a_file, "overlaps the output directory"),
        "inside the output": (tmp_path / "o" / "ckpt", a_file, "overlaps the output directory"),
        "holding the output": (tmp_path, a_file, "overlaps the output directory"),
    }[kind]


@pytest.mark.parametrize("kind", ["file", "symlink", "non-empty dir", "wrong marker", "under a file", "proc",
                                  "the output", "inside the output", "holding the output"])
def test_a_path_that_is_not_a_checkpoint_directory_is_refused_before_the_model_loads(
        kind, model_dir, text_file, tmp_path, monkeypatch, capsys, no_model_load):  # noqa: F811
    path, keep, message = _hostile(tmp_path, kind)
    before = snapshot(keep)
    code, out, err = run_cli(args(model_dir, text_file, tmp_path / "o", "--checkpoint", str(path),
                                  "--checkpoint-every", "1"), monkeypatch, capsys)
    assert code == 2 and message in err and "--checkpoint" in err and str(path) in err, err
    assert err.strip().splitlines()[-1].startswith("Error: ") and "Traceback" not in err
    assert snapshot(keep) == before


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.dictionaries(st.from_regex(r"[a-z]{1,6}(\.[a-z]{1,3})?", fullmatch=True), st.binary(max_size=16),
                             min_size=1, max_size=4))
def test_fuzz_any_non_empty_directory_without_the_marker_is_refused_unchanged(files, tmp_path):
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    for name, data in files.items():
        (root / name).write_bytes(data)
    before = snapshot(root)
    with pytest.raises(InputError, match="not a checkpoint directory"):
        prepare_checkpoint_dir(root)
    assert snapshot(root) == before


def test_a_run_removes_only_what_it_wrote(model_dir, text_file, tmp_path, monkeypatch, capsys):  # noqa: F811
    # An empty directory the user made is used and left (empty) at the end.
    mine = tmp_path / "mine"
    mine.mkdir()
    code, _, err = run_cli(args(model_dir, text_file, tmp_path / "o1", "--checkpoint", str(mine),
                                "--checkpoint-every", "2"), monkeypatch, capsys)
    assert code == 0, err
    assert mine.is_dir() and list(mine.iterdir()) == []
    # The default checkpoint directory is made by the run and removed by it.
    code, _, err = run_cli(args(model_dir, text_file, tmp_path / "o2", "--checkpoint-every", "2"), monkeypatch, capsys)
    assert code == 0, err
    assert not (tmp_path / "o2.checkpoint").exists() and (tmp_path / "o2" / "oscar_kv.safetensors").is_file()


def test_a_file_the_user_put_in_a_checkpoint_directory_stays(tmp_path):
    from oscar_calib.calibration.scale.checkpoint import remove_checkpoint

    path = tmp_path / "c"
    save_checkpoint(path, _totals(), 2, _identity())
    (path / "notes.txt").write_text("mine")
    remove_checkpoint(path)
    assert sorted(p.name for p in path.iterdir()) == ["notes.txt"]


# --- checkpoints validated like artifacts (class 4) -------------------------------------------------------------
def _identity(seq_len: int = 3) -> dict:
    return {"tool_version": "oscar-calib 1", "data": {"seed": 0, "samples": 8, "seq_len": seq_len},
            "geometry": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4}, "sample_range": [0, 8]}


def _totals(samples: int = 2, seq_len: int = 3) -> dict[int, LayerStats]:
    s = LayerStats.zeros(2, 4)
    s.key_sum += torch.eye(4, dtype=torch.float64)
    s.attn_out_sum += torch.eye(4, dtype=torch.float64)
    s.logit_v_sum += torch.eye(4, dtype=torch.float64)
    s.logit_w_sum += 1.0
    s.token_count = samples * seq_len
    s.query_count = s.token_count * 2
    return {0: s}


def test_a_forged_next_sample_is_refused(tmp_path):
    path = tmp_path / "c"
    save_checkpoint(path, _totals(samples=2), 4, _identity())  # the sums of 2 samples, claiming 4
    with pytest.raises(InputError, match=r"field 'next_sample': says 4 samples of 3 tokens \(12 tokens\), but layer "
                                         r"0 counts 6 tokens"):
        load_checkpoint(path, _identity())
    save_checkpoint(path, _totals(samples=2), 2, _identity())
    assert load_checkpoint(path, _identity()).next_sample == 2


@pytest.mark.parametrize("edit, field", [
    (lambda s: s.key_sum.__setitem__((0, 1, 1), float("nan")), "key_sum"),
    (lambda s: s.value_vec_sum.__setitem__((1, 0), float("inf")), "value_vec_sum"),
    (lambda s: s.attn_out_sum.__setitem__((0, 2, 2), -1.0), "attn_out_sum"),
    (lambda s: s.logit_w_sum.__setitem__(0, -3.0), "logit_w_sum"),
    (lambda s: setattr(s, "query_count", 7), "query_count"),
    (lambda s: (setattr(s, "token_count", 0), setattr(s, "query_count", 0)), "token_count"),
])
def test_checkpoint_values_are_checked(edit, field, tmp_path):
    totals = _totals()
    edit(totals[0])
    save_checkpoint(tmp_path / "c", totals, 2, _identity())
    with pytest.raises(InputError, match=f"field '{field}'"):
        load_checkpoint(tmp_path / "c", _identity())


def test_a_checkpoint_file_in_place_of_the_directory_is_not_read(tmp_path):
    save_checkpoint(tmp_path / "c", _totals(), 2, _identity())
    (tmp_path / "c" / MARKER_FILENAME).unlink()
    with pytest.raises(InputError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "c", _identity())
    assert (tmp_path / "c" / CHECKPOINT_FILENAME).is_file()
