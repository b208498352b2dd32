"""`tools/real_model.py` never removes a folder it did not make (issue 54 item 2).

The conversion and the download are replaced by tiny stand-ins (a marker and one weights file), so nothing is
fetched; what is tested is the tool's own folder handling: `--out` and `<out>-layersN` of the user's are refused
before any work and left byte for byte as they were; the tool's own folders are replaced in one swap.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_real_model import _tool

from runtime_kernels.atomic import temporaries


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def user_folder(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "sub" / "keep.txt").write_text("also mine")
    return path


def stand_in_conversion(rm, tag: str):
    """A `_convert_into` that writes what the real one does in miniature: a weights file and the marker last."""
    calls = []

    def convert_into(gguf: Path, tmp: Path) -> dict:
        calls.append(tmp)
        (tmp / "model.safetensors").write_bytes(tag.encode())
        marker = {"gguf_sha256": rm.GGUF_SHA256,
                  "weights_sha256": {"model.safetensors": hashlib.sha256(tag.encode()).hexdigest()}}
        (tmp / rm.MARKER).write_text(json.dumps(marker))
        return marker

    return convert_into, calls


@pytest.fixture
def rm(monkeypatch):
    module = _tool()

    def no_fetch(*a, **k):
        raise AssertionError("the tool fetched although it should have refused first")

    monkeypatch.setattr(module, "require_gguf", lambda: None)
    monkeypatch.setattr(module, "fetch_gguf", lambda dest: dest)  # the stand-in conversion never reads it
    monkeypatch.setattr(module, "join_gguf", no_fetch)
    return module


def test_a_folder_of_the_user_as_out_is_refused_before_any_work(rm, tmp_path, monkeypatch, capsys):
    out = user_folder(tmp_path / "mine")
    before = snapshot(out)
    convert_into, calls = stand_in_conversion(rm, "new")
    monkeypatch.setattr(rm, "_convert_into", convert_into)
    monkeypatch.setattr(rm, "fetch_gguf", lambda dest: pytest.fail("fetched before refusing"))
    assert rm.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: exists and was not made by this tool (no {rm.MARKER} in it)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert snapshot(out) == before and calls == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # nothing left beside it
    # `join` (no network) refuses the same folder the same way.
    assert rm.main(["join", "--parts-dir", str(tmp_path / "parts"), "--out", str(out)]) == 2
    assert snapshot(out) == before


@pytest.mark.parametrize("shape", ["file", "symlink"])
def test_a_file_or_symlink_as_out_is_refused(rm, tmp_path, shape, capsys):
    victim = user_folder(tmp_path / "victim")
    out = tmp_path / "out"
    if shape == "file":
        out.write_text("a file")
    else:
        out.symlink_to(victim)
    before = snapshot(victim)
    assert rm.main(["--out", str(out)]) == 2
    assert "is a file or a symlink" in capsys.readouterr().err
    assert snapshot(victim) == before and (out.is_symlink() if shape == "symlink" else out.read_text() == "a file")


def test_the_tools_own_folders_are_made_and_replaced_by_one_swap(rm, tmp_path, monkeypatch):
    out = tmp_path / "model"
    first, _ = stand_in_conversion(rm, "first")
    monkeypatch.setattr(rm, "_convert_into", first)
    assert rm.main(["--out", str(out)]) == 0
    assert rm.is_ready(out) and (out / "model.safetensors").read_bytes() == b"first"
    # Present and verified: nothing is redone.
    again, calls = stand_in_conversion(rm, "again")
    monkeypatch.setattr(rm, "_convert_into", again)
    assert rm.main(["--out", str(out)]) == 0 and calls == []
    # A folder of the tool's that no longer verifies (a weight edited) is replaced as a whole.
    (out / "model.safetensors").write_bytes(b"edited")
    (out / "stray").write_text("left by an older version of the tool")
    assert rm.main(["--out", str(out)]) == 0 and len(calls) == 1
    assert snapshot(out).keys() == {"model.safetensors", rm.MARKER} and rm.is_ready(out)
    assert temporaries(out) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failed_conversion_leaves_the_old_folder_and_no_scratch(rm, tmp_path, monkeypatch, capsys):
    out = tmp_path / "model"
    first, _ = stand_in_conversion(rm, "first")
    monkeypatch.setattr(rm, "_convert_into", first)
    assert rm.main(["--out", str(out)]) == 0
    (out / "model.safetensors").write_bytes(b"edited")  # no longer verified: the next run converts again
    before = snapshot(out)

    def fails(gguf, tmp):
        (tmp / "model.safetensors").write_bytes(b"half")
        raise rm.IntegrityError(f"converted {tmp}: the saved bf16 model disagrees with the GGUF")

    monkeypatch.setattr(rm, "_convert_into", fails)
    assert rm.main(["--out", str(out)]) == 4
    assert snapshot(out) == before and temporaries(out) == []

    def no_marker(gguf, tmp):
        (tmp / "model.safetensors").write_bytes(b"new")
        return {}

    monkeypatch.setattr(rm, "_convert_into", no_marker)
    assert rm.main(["--out", str(out)]) == 4
    assert "has no oscar_real_model.json" in capsys.readouterr().err
    assert snapshot(out) == before and temporaries(out) == []


def test_a_folder_of_the_user_at_out_layers_n_is_refused_before_the_model_loads(rm, tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    sliced = user_folder(tmp_path / "model-layers2")
    before = snapshot(sliced)
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("loaded the model before refusing"))
    with pytest.raises(rm.UsageError, match=r"--slice .*model-layers2: exists and was not made by this tool"):
        rm.write_slice(model_dir, 2)
    assert snapshot(sliced) == before
