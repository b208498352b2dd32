"""tools/stage_vllm_gpu.py: trim, bundle, split, receive, join, check and install, on small wheels built here (no
package index: `download` is replaced by the wheels of the test)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import random
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("stage_vllm_gpu", ROOT / "tools" / "stage_vllm_gpu.py")
stage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stage)


def make_wheel(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel `name-1.0-py3-none-any.whl` holding `files` (path -> bytes) and a RECORD of them."""
    dist = f"{name}-1.0.dist-info"
    files = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    out = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return out


@pytest.fixture
def wheels(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    big = random.Random(0).randbytes(100_000)  # incompressible: the bundle spans several parts
    vllm = make_wheel(src, "vllm", {"vllm/__init__.py": b"VERSION = 'stub'\n", "vllm/vllm-rs": big,
                                    "vllm/third_party/deep_gemm/x.py": b"x = 1\n", "vllm/keep.bin": big})
    dep = make_wheel(src, "stagedep", {"stagedep/__init__.py": b"ANSWER = 42\n"})
    return [vllm, dep]


def test_trim_wheel_drops_members_and_their_record_lines(wheels, tmp_path):
    out = tmp_path / "trimmed"
    out.mkdir()
    trimmed = stage.trim_wheel(wheels[0], out, ("vllm/vllm-rs", "vllm/third_party/deep_gemm/"))
    with zipfile.ZipFile(trimmed) as z:
        names = set(z.namelist())
        record = z.read("vllm-1.0.dist-info/RECORD").decode()
    assert "vllm/vllm-rs" not in names and "vllm/third_party/deep_gemm/x.py" not in names
    assert {"vllm/__init__.py", "vllm/keep.bin"} <= names
    assert "vllm-rs" not in record and "deep_gemm" not in record and "vllm/keep.bin" in record


def test_parts_travel_join_check_and_install(wheels, tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "download", lambda dest: wheels)
    extra = tmp_path / "model.part00"
    extra.write_bytes(b"gguf bytes" * 1000)
    out = tmp_path / ".stage"
    stage.prepare(out, [extra], part_bytes=40_000, full_vllm=False, cache=tmp_path / "cache")
    parts = sorted(out.glob("part-*"))
    assert len(parts) >= 3
    manifest = json.loads((parts[0] / stage.MANIFEST).read_text())
    assert manifest["trimmed"] == list(stage.TRIMMED)
    assert set(manifest["files"]) == {"wheels/vllm-1.0-py3-none-any.whl", "wheels/stagedep-1.0-py3-none-any.whl",
                                      "extras/model.part00"}
    dest = tmp_path / "root-stage"
    for part in parts[:-1]:
        stage.receive(part, dest)
    with pytest.raises(stage.StageError, match="missing parts"):
        stage.install(dest, tmp_path / "site")
    stage.receive(parts[-1], dest)
    target = tmp_path / "site"
    stage.install(dest, target)
    assert (target / "stagedep" / "__init__.py").read_text() == "ANSWER = 42\n"
    assert (target / "vllm" / "keep.bin").is_file() and not (target / "vllm" / "vllm-rs").exists()
    assert (dest / "unpacked" / "extras" / "model.part00").read_bytes() == extra.read_bytes()


def test_wheels_install_from_the_parts_that_hold_them(wheels, tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "download", lambda dest: wheels)
    extra = tmp_path / "model.gguf"
    extra.write_bytes(random.Random(1).randbytes(300_000))  # the extras come after the wheels, in later parts
    out = tmp_path / ".stage"
    stage.prepare(out, [extra], part_bytes=40_000, full_vllm=False, cache=tmp_path / "cache")
    parts = sorted(out.glob("part-*"))
    dest = tmp_path / "root-stage"
    for part in parts[:4]:
        stage.receive(part, dest)
    target = tmp_path / "site"
    stage.install(dest, target, wheels_only=True)
    assert (target / "stagedep" / "__init__.py").is_file() and (target / "vllm" / "keep.bin").is_file()
    with pytest.raises(stage.StageError, match="missing parts"):
        stage.install(dest, tmp_path / "site2")


def test_a_damaged_part_is_refused(wheels, tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "download", lambda dest: wheels)
    out = tmp_path / ".stage"
    stage.prepare(out, [], part_bytes=40_000, full_vllm=True, cache=tmp_path / "cache")
    part = sorted(out.glob("part-*"))[1]
    chunk = next(part.glob(f"{stage.BUNDLE}.*"))
    data = bytearray(chunk.read_bytes())
    data[100] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(stage.StageError, match="damaged in transfer"):
        stage.receive(part, tmp_path / "root-stage")


def test_cli_refuses_a_part_size_that_cannot_travel(capsys):
    assert stage.main(["prepare", "--out", "x", "--part-mb", "70"]) == 2
    assert "--part-mb" in capsys.readouterr().err


def test_prepare_refuses_a_folder_it_did_not_make(wheels, tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "download", lambda dest: wheels)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(stage.StageError, match="not a stage folder"):
        stage.prepare(out, [], part_bytes=40_000, full_vllm=True, cache=tmp_path / "cache")
    assert (out / "notes.txt").read_text() == "keep"


def test_lock_pins_every_wheel_by_sha256():
    lines = [ln for ln in stage.LOCK.read_text().splitlines() if ln and not ln.startswith("#")]
    assert any(ln.startswith("vllm==0.26.0 ") for ln in lines)
    for ln in lines:
        name, _, digest = ln.partition(" --hash=sha256:")
        assert "==" in name and len(digest) == 64, ln


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
