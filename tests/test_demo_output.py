"""The last lines of a run (what was written, sizes, the next two commands) and progress bars at 80 columns."""

from __future__ import annotations

import io

from rich.console import Console

from oscar_calib.cli.run_cmd import written_summary
from oscar_calib.progress import Stages


def test_summary_lists_files_with_sizes_and_the_next_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "zoo" / "demo"
    out.mkdir(parents=True)
    (out / "oscar_kv.safetensors").write_bytes(b"\0" * (3 << 20))
    (out / "README.md").write_text("card")
    (out / "oscar_stats.safetensors").write_bytes(b"\0" * 2048)
    text = written_summary(out.relative_to(tmp_path), None)
    lines = text.splitlines()
    assert lines[0] == "wrote zoo/demo/:"
    assert any("oscar_kv.safetensors" in line and "3.0 MiB" in line for line in lines)
    assert any("oscar_stats.safetensors" in line and "2.0 KiB" in line and "stays local" in line for line in lines)
    assert "calibration_log.json" not in text  # only files that exist
    assert "oscar-calib eval --artifact zoo/demo" in text and "oscar-calib push zoo/demo" in text
    assert max(len(line) for line in lines) <= 80
    assert "--model M --artifact" in written_summary(out, "M")


def test_progress_fits_80_columns_without_cutting_the_counter():
    buf = io.StringIO()
    with Stages(Console(file=buf, width=80, force_terminal=False)) as stages:
        stages.tokens("capture", 10240)(10240, 10240)
        stages.steps("solve + clip fit", "layer fits")("layer 3", 24, 24)
    lines = buf.getvalue().splitlines()
    assert "10240/10240" in lines[0] and "24/24" in lines[1] and "…" not in buf.getvalue()
    assert all(len(line.rstrip()) <= 80 for line in lines)
