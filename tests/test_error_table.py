"""docs/errors.md's table of common command-line mistakes, run row by row: the code and the message each row states.

The table is the source (a row added there is tested here); `when` names a condition this test arranges first.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from cli_helpers import run_cli
from format_helpers import PAPER

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"


def full_disk(monkeypatch, root: Path) -> None:
    """Every file opened for writing under `root` (builtins.open: torch.save's bytes; os.fdopen: the atomic file
    writer's temporary files) fails its first write with ENOSPC, as a full disk does."""
    import builtins
    import errno

    real_open = builtins.open

    class Full:
        def __init__(self, handle, name):
            self._handle, self.name = handle, name

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.name))

        def __getattr__(self, attr):
            return getattr(self._handle, attr)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._handle.close()

    def fake_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, Path)) and any(c in mode for c in "wax") and str(root) in str(Path(file).absolute()):
            return Full(handle, file)
        return handle

    import os

    real_fdopen = os.fdopen

    def fake_fdopen(fd, mode="r", *args, **kwargs):  # runtime_kernels.atomic writes through os.fdopen
        handle = real_fdopen(fd, mode, *args, **kwargs)
        name = os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else str(fd)
        if any(c in mode for c in "wax") and str(root) in name:
            return Full(handle, name)
        return handle

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "fdopen", fake_fdopen)


def rows() -> list[tuple[str, str, int, str]]:
    text = DOC.read_text(encoding="utf-8")
    block = text[text.index("<!-- error-table:start -->"):text.index("<!-- error-table:end -->")]
    out = []
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        out.append((cells[0].strip("`"), cells[1], int(cells[2]), cells[3].strip("`")))
    return out


def test_the_table_is_there():
    assert len(rows()) >= 12


def _online_hub(tmp_path, monkeypatch, request):
    """The stand-in Hub (tests/hub_server.py) as HF_ENDPOINT, online, with a cold cache of the test's own."""
    import huggingface_hub.constants as constants
    from hub_server import HubServer

    server = HubServer(tmp_path / "hub").start()
    request.addfinalizer(server.stop)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    return server


@pytest.mark.parametrize("command,when,code,message", rows(), ids=[r[0][12:60] for r in rows()])
def test_row(command, when, code, message, tmp_path, monkeypatch, capsys, request, caplog):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zoo" / "demo").mkdir(parents=True)
    from runtime_kernels.artifact import identity_artifact, write_artifact

    write_artifact(identity_artifact(4, 2, 4, 128, model_id="oscar-calib/tiny-qwen3", fmt=PAPER), tmp_path / "zoo" / "demo")
    missing = re.match(r"`(\w+)` not installed", when)
    if missing:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing.group(1)
                            else real(name, *a))
    elif when == "the Hub unreachable (online)":
        import huggingface_hub.constants as constants

        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    elif when == "offline, empty cache":
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        import huggingface_hub.constants as constants

        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    elif re.fullmatch(r"`[\w./-]+` holds text", when):  # a file that is not what the command expects
        path = tmp_path / when.split("`")[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"model_type": "qwen3", "note": "a text file, not an artifact"}\n')
    elif when == "a release v1 of zoo/demo in me/zoo":
        from oscar_calib.zoo.hub import push

        server = _online_hub(tmp_path, monkeypatch, request)
        push(tmp_path / "zoo" / "demo", "me/zoo", version="v1", endpoint=server.endpoint)
    elif when == "a full disk":
        full_disk(monkeypatch, tmp_path)
    elif when == "a GGUF claiming 1,000 blocks at forged.gguf":
        pytest.importorskip("gguf")
        from gguf_helpers import write_tiny_gguf

        write_tiny_gguf(tmp_path / "forged.gguf", fields={"llama.block_count": 1000})
        (tmp_path / "calib.txt").write_text("a few words to calibrate on\n" * 20, encoding="utf-8")
    elif when == "statistics whose geometry is a list at bad.safetensors":
        import torch
        from safetensors.torch import save_file

        save_file({"layer_ids": torch.zeros(1, dtype=torch.int64)}, str(tmp_path / "bad.safetensors"),
                  metadata={"format": "oscar-stats", "schema_version": "1", "model_id": "org/m", "geometry": "[2, 4]"})
    else:
        assert when == "", f"unknown condition {when!r}: teach this test to arrange it"
    argv = shlex.split(command)
    assert argv[0] == "oscar-calib"
    got, out, err = run_cli(argv[1:], monkeypatch, capsys)
    assert got == code, f"{command}: exit {got}, expected {code}\n{err}"
    # Warnings are log records: the CLI's handler prints them on stderr, pytest's capture takes them in-process.
    err += "".join(f"{r.getMessage()}\n" for r in caplog.records if r.levelno >= 30)
    assert message in " ".join(err.split()), f"{command}: {err}"
    assert "Traceback" not in err
