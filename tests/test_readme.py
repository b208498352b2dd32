"""The README's snippets, executed as printed (the convention: tests/readme_snippets.py).

The marked blocks run in a scratch folder laid out like the clone (`oscar_calib/`, `tests/` linked to this checkout,
`zoo/demo` written by the same command as `make demo`), in a new user's environment: no TRITON_INTERPRET (that
would run the decode kernels in Triton's interpreter), no HF_HUB_OFFLINE (the stand-in Hub block goes online to
127.0.0.1), a Hub cache of its own.
"""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from readme_snippets import blocks, script

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HUB_PORT = 8765  # the port the README's stand-in Hub block serves on


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_block_parses(doc):
    """Unmarked blocks (real model names, the commands of docs/) still parse: python by `ast`, bash by `bash -n`.
    The extractor finds every block the file opens with a language (counted here on the raw lines)."""
    found = blocks(doc)
    opened = sum(1 for line in doc.read_text(encoding="utf-8").splitlines() if re.match(r"^```\w+\s*$", line))
    assert len([b for b in found if b.lang]) == opened
    for b in found:
        if b.lang == "python":
            ast.parse(b.text, filename=f"{doc.name}:{b.line}")
        elif b.lang == "bash":
            r = subprocess.run(["bash", "-n"], input=b.text, text=True, capture_output=True)
            assert r.returncode == 0, f"{doc.name}:{b.line}: {r.stderr}"


def test_the_serving_blocks_are_marked():
    """The blocks a new user needs to publish and serve the demo are runnable (tests below, and .ci/vllm_lane.sh)."""
    found = blocks(README)
    runnable = "\n".join(b.text for b in found if b.tag == "")
    for needle in ('OscarCache.from_pretrained("zoo/demo", model.config, model_id="oscar-calib/tiny-qwen3")',
                   'repo="me/oscar-zoo", revision="v1"', "oscar-calib push zoo/demo", "oscar-calib pull"):
        assert needle in runnable
    assert any(b.tag == "vllm-cpu" for b in found), "the CPU vLLM recipe is run by .ci/vllm_lane.sh"


def test_marker_convention(tmp_path):
    """The extractor takes exactly the marked blocks of a tag, in order, and refuses a marked block of another
    language (so a marking mistake fails here, not silently)."""
    md = tmp_path / "x.md"
    md.write_text("<!-- runnable -->\n```bash\necho a\n```\n\n```bash\necho skipped\n```\n"
                  "<!-- runnable: lane -->\n```python\nprint('lane')\n```\n<!-- runnable -->\n```python\nprint(1)\n```\n")
    text = script(md)
    assert "echo a" in text and "print(1)" in text and "skipped" not in text and "lane" not in text
    r = subprocess.run(["bash", "-c", text], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["a", "1"], r.stderr
    md.write_text("<!-- runnable -->\n```yaml\na: 1\n```\n")
    with pytest.raises(ValueError, match="must be bash or python"):
        script(md)


def _clone(tmp_path: Path) -> tuple[Path, dict]:
    """A folder laid out like the clone, and a new user's environment (see the module docstring)."""
    work = tmp_path / "clone"
    work.mkdir()
    for name in ("oscar_calib", "tests"):
        (work / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "HF_HUB_OFFLINE", "HF_ENDPOINT", "HF_TOKEN")}
    env.update(HF_HOME=str(tmp_path / "hf-home"), PYTHONPATH=str(ROOT), PATH=f"{Path(sys.executable).parent}:"
               f"{env.get('PATH', '')}")
    return work, env


def _run_readme(work: Path, env: dict) -> None:
    """Every `<!-- runnable -->` block of the README in order, in one bash session, as printed."""
    r = subprocess.run(["bash", "-c", script(README)], cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{r.stderr[-4000:]}\n{r.stdout[-2000:]}"
    assert (work / "pulled").is_dir() and (work / "fake-hub").is_dir()
    # the local transformers snippet printed 16 generated tokens of text after a prompt reaching the INT2 history
    assert r.stdout.strip(), r.stdout


def test_readme_snippets_run_on_a_stand_in_demo_artifact(tmp_path):
    """The README's runnable blocks as printed, in the inner loop: `zoo/demo` is an identity artifact of the demo's
    model in the recipe's format, written at once where `make demo` calibrates for a minute (the slow test below
    runs the real demo first). The blocks push it to the stand-in Hub, list and pull it, load it with
    `load_artifact` and serve it in transformers, locally and from the Hub."""
    if not _port_free(HUB_PORT):
        pytest.skip(f"port {HUB_PORT} (the README's stand-in Hub) is in use")
    from transformers import AutoConfig

    from oscar_calib.demo import FIXTURE_DIR, FIXTURE_MODEL_ID
    from runtime_kernels.artifact import identity_artifact, model_geometry, write_artifact
    from runtime_kernels.format import DEFAULT_FORMAT

    work, env = _clone(tmp_path)
    layers, h_q, h_kv, head_dim = model_geometry(AutoConfig.from_pretrained(FIXTURE_DIR))
    write_artifact(identity_artifact(layers, h_kv, h_q, head_dim, model_id=FIXTURE_MODEL_ID, fmt=DEFAULT_FORMAT),
                   work / "zoo" / "demo")
    _run_readme(work, env)


@pytest.mark.slow
def test_readme_snippets_run_as_printed(tmp_path):
    """`make demo`, then every `<!-- runnable -->` block of the README in order: the stand-in Hub push / pull,
    load_artifact from it, and the transformers snippets (local artifact with model_id=, and the Hub form)."""
    if not _port_free(HUB_PORT):
        pytest.skip(f"port {HUB_PORT} (the README's stand-in Hub) is in use")
    work, env = _clone(tmp_path)
    demo = subprocess.run([sys.executable, "-m", "oscar_calib", "run", "--out", "zoo/demo", "--overwrite"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "wrote zoo/demo/:" in demo.stderr and "oscar-calib eval --artifact zoo/demo" in demo.stderr
    card = (work / "zoo" / "demo" / "README.md").read_text()  # the model card: commands, no timings, no empty fields
    assert "OscarCache.from_pretrained" in card and "--with-wheels" in card  # serve it; publish it with its wheel
    assert "Timings" not in card and "None" not in card
    _run_readme(work, env)
