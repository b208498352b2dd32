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
