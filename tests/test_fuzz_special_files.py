"""Issue 54 item 8, files on disk: special files and symlinks at the lock and scratch paths of every writing command.

Commands: `run`, `refit`, `export`, `import`, `pull --local-dir` (each writes an output directory and holds the lock
`.<out>.oscar-lock` beside it) and `stats merge` (one file, written through a fresh O_EXCL temporary: its only
plantable path is `--out` itself). `push` stages nothing beside the user's files (its scratch is a fresh
`tempfile` folder), so it has no path to plant at.

At the lock path: a symlink to a file of the user's, a FIFO, a symlink to /dev/null. Each command is refused with
one line naming the lock file, exit 2 (docs/errors.md), no traceback; the file the symlink points to keeps its
bytes, and the folder holds exactly what it held. Under a scratch name (`.<out>.oscar-old-<dead pid>-<ns>`, the
name an interrupted swap leaves and the next writer restores): a folder without the project's marker is left
alone and never becomes the output; the command writes its own output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from format_helpers import PAPER
from test_hub import MODEL, REPO, TOKEN, make_artifact  # noqa: F401  (TOKEN: the hub fixture reads it)
from test_reference_format import config as ref_config
from test_reference_format import reference_dict
from test_scale import model_dir, text_file  # noqa: F401  (module-scoped fixtures)
from test_special_files import SECRET, listing

from runtime_kernels.artifact import ARTIFACT_FILENAME, identity_artifact, write_artifact

SEQ = ("--seq-len", "32", "--holdout-len", "32", "--sink", "4", "--recent", "8")


@pytest.fixture(scope="module")
def inputs(model_dir, text_file, tmp_path_factory):  # noqa: F811
    """The tiny model and its text, an artifact, and reference files for `import` (all cheap)."""
    root = tmp_path_factory.mktemp("inputs")
    art = root / "art"
    write_artifact(identity_artifact(2, 2, 4, 16, model_id="tiny/qwen3", fmt=PAPER), art)
    torch.save(reference_dict(seed=0), root / "k.pt")
    torch.save(reference_dict(seed=1), root / "v.pt")
    ref_config().save_pretrained(root / "model")
    # `refit` takes the output lock before it reads the statistics: its lock tests need no real file.
    return {"model": model_dir, "text": text_file, "stats": root / "unread.safetensors", "art": art, "root": root}


@pytest.fixture(scope="module")
def shards(inputs, tmp_path_factory):
    """Two statistics shards of the tiny model (two small calibrations: the slow part of this file)."""
    from oscar_calib.cli import main

    root = tmp_path_factory.mktemp("shards")
    paths = []
    for i in range(2):
        out = root / f"shard{i}"
        argv = ["oscar-calib", "run", "--model", str(inputs["model"]), "--dataset", str(inputs["text"]), "--out",
                str(out), "--samples", "2", "--shard", f"{i}/2", *SEQ]
        mp = pytest.MonkeyPatch()
        mp.setattr(sys, "argv", argv)
        try:
            main()
        except SystemExit as exc:
            assert exc.code in (0, None), exc
        finally:
            mp.undo()
        paths.append(out / "oscar_stats.safetensors")
    return paths


def argv_for(command: str, inputs: dict, out: Path, tmp_path: Path) -> list[str]:
    if command == "run":
        return ["run", "--model", str(inputs["model"]), "--dataset", str(inputs["text"]), "--out", str(out),
                "--samples", "2", *SEQ]
    if command == "refit":
        return ["refit", str(inputs["stats"]), "--out", str(out), "--sink", "4", "--recent", "8"]
    if command == "export":
        return ["export", str(inputs["art"]), "--out", str(out)]
    if command == "import":
        root = inputs["root"]
        return ["import", "--keys", str(root / "k.pt"), "--values", str(root / "v.pt"), "--model-config",
                str(root / "model"), "--model-id", "tiny/qwen3", "--out", str(out)]
    if command == "pull":
        return ["pull", MODEL, "--repo", REPO, "--revision", "v1", "--local-dir", str(out), "--cache-dir",
                str(tmp_path / "cache"), "--token", TOKEN]
    raise AssertionError(command)


def push_release(tmp_path: Path, monkeypatch, capsys) -> None:
    art = make_artifact(tmp_path / "to-push")
    code, _, err = run_cli(["push", str(art), "--repo", REPO, "--token", TOKEN], monkeypatch, capsys)
    assert code == 0, err


def plant_at(path: Path, shape: str, victim: Path) -> None:
    if shape == "symlink-to-file":
        path.symlink_to(victim)
    elif shape == "symlink-to-dev-null":
        path.symlink_to("/dev/null")
    elif shape == "fifo":
        os.mkfifo(path)
    else:
        raise AssertionError(shape)


SHAPES = {"symlink-to-file": "is a symlink", "fifo": "is a FIFO", "symlink-to-dev-null": "is a symlink"}
DIR_COMMANDS = ["run", "refit", "export", "import", "pull"]


def one_error(err: str) -> str:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, err
    return " ".join(errors[0].split())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("command", DIR_COMMANDS)
def test_a_planted_lock_file_is_refused_and_changes_nothing(command, shape, inputs, tmp_path, monkeypatch, capsys,
                                                            request):
    if command == "pull":
        request.getfixturevalue("hub")
        push_release(tmp_path, monkeypatch, capsys)
    elif command == "run":
        request.getfixturevalue("no_model_load")  # refused before the model or the data load
    victim = tmp_path / "victim.txt"
    victim.write_bytes(SECRET)
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    lock = work / ".out.oscar-lock"
    plant_at(lock, shape, victim)
    before = listing(work)
    code, stdout, err = run_cli(argv_for(command, inputs, out, tmp_path), monkeypatch, capsys)
    assert code == 2, err
    line = one_error(err)
    assert f"the lock file {lock} {SHAPES[shape]}" in line and "nothing was written" in line, line
    assert victim.read_bytes() == SECRET
    assert listing(work) == before  # the planted entry as it was, no output, nothing left beside it


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


SLOW = pytest.mark.slow  # a whole (tiny) calibration or fit under a 2-core load: 10-50 s each


@pytest.mark.parametrize("command", [pytest.param(c, marks=SLOW) if c in ("run", "refit") else c for c in DIR_COMMANDS])
def test_a_planted_scratch_folder_is_not_adopted(command, inputs, tmp_path, monkeypatch, capsys, request):
    if command == "pull":
        request.getfixturevalue("hub")
        push_release(tmp_path, monkeypatch, capsys)
    elif command == "refit":
        inputs = {**inputs, "stats": request.getfixturevalue("shards")[0]}
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    planted = work / f".out.oscar-old-{_dead_pid()}-{time.time_ns()}"  # a dead writer's swap, without the marker
    (planted / "content").mkdir(parents=True)
    (planted / "content" / ARTIFACT_FILENAME).write_bytes(SECRET)
    (planted / ARTIFACT_FILENAME).write_bytes(SECRET)
    before = listing(planted)
    code, _, err = run_cli(argv_for(command, inputs, out, tmp_path), monkeypatch, capsys)
    assert code == 0, err
    assert listing(planted) == before  # left alone
    produced = (out / ARTIFACT_FILENAME) if command != "export" else (out / "keys.pt")
    assert produced.is_file() and produced.read_bytes() != SECRET
    assert sorted(p.name for p in work.iterdir()) == sorted(["out", planted.name])


@SLOW
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_stats_merge_onto_a_symlink_or_fifo_is_refused(shape, overwrite, shards, tmp_path, monkeypatch, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(SECRET)
    work = tmp_path / "work"
    work.mkdir()
    out = work / "merged.safetensors"
    plant_at(out, shape, victim)
    before = listing(work)
    argv = ["stats", "merge", *map(str, shards), "--out", str(out)] + (["--overwrite"] if overwrite else [])
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2, err
    line = one_error(err)
    assert str(out) in line
    if overwrite:
        assert f"{SHAPES[shape]} (expected a regular file to write)" in line, line
    assert victim.read_bytes() == SECRET and listing(work) == before


@SLOW
def test_stats_merge_writes_a_file_beside_planted_temporaries(shards, tmp_path, monkeypatch, capsys):
    """Names like the writer's temporaries (`.<name>.tmp-*`), planted as symlinks: the writer's own temporary is a
    fresh O_EXCL name, so none is written through."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(SECRET)
    work = tmp_path / "work"
    work.mkdir()
    out = work / "merged.safetensors"
    for suffix in ("", "x", "abcdefgh"):
        (work / f".merged.safetensors.tmp-{suffix}").symlink_to(victim)
    before = listing(work)
    code, stdout, err = run_cli(["stats", "merge", *map(str, shards), "--out", str(out), "--json"],
                                monkeypatch, capsys)
    assert code == 0, err
    assert json.loads(stdout)["sample_ranges"] == [[0, 2]]
    assert victim.read_bytes() == SECRET
    assert {k: v for k, v in listing(work).items() if k != out.name} == before
