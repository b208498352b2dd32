"""The user who only has the zoo: `hf download` of a release, the errors that point the way, sizes printed alike.

Expectations are independent of the code under test: file bytes against the pushed ones with hashlib, the models and
versions a hint must list from what the test pushed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from test_hub import MODEL, REPO, TOKEN, do_push, make_artifact

HF_CLI = "import sys; from huggingface_hub.cli.hf import main; sys.argv[0] = 'hf'; sys.exit(main())"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_hf_download_of_a_whole_release_repo(hub, tmp_path):
    """`hf download ORG/ZOO --revision v1` (snapshot_download: the tree listing, then every file) gets every file
    of the release, byte for byte what was pushed."""
    art = make_artifact(tmp_path / "art", extra={"eval_demo.json": '{"ppl": 1.0}'})
    do_push(hub, art, version="v1")
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0",
           "HF_HOME": str(tmp_path / "hf")}
    out = tmp_path / "dl"
    done = subprocess.run([sys.executable, "-c", HF_CLI, "download", REPO, "--revision", "v1", "--local-dir",
                           str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    base = out / MODEL / "default"
    got = sorted(p.name for p in base.iterdir())
    assert got == ["README.md", "eval_demo.json", "oscar_kv.safetensors", "release.json"], got
    for name in ("oscar_kv.safetensors", "eval_demo.json"):
        assert _sha(base / name) == _sha(art / name), name


# ------------------------------------------------------------------------------------------------ sizes
def test_format_bytes_against_hand_values():
    from runtime_kernels.units import format_bytes

    cases = {0: "0 B", 1023: "1023 B", 1024: "1.0 KiB", 1536: "1.5 KiB", 40_894_464: "39.0 MiB",
             300 * 2**20: "300 MiB", 2**30 - 1: "1.0 GiB", int(1023.6 * 2**20): "1.0 GiB", 3 * 2**40: "3.0 TiB"}
    for n, text in cases.items():
        assert format_bytes(n) == text, n


def test_one_size_for_one_file_in_the_summary_and_in_push(tmp_path, monkeypatch, capsys):
    """The run summary and push's --include-stats warning print the same text for the same file (they used to
    say 39.0 MB and 40.9 MB: two formatters, binary and decimal)."""
    from cli_helpers import run_cli

    from oscar_calib.cli.run_cmd import written_summary

    art = make_artifact(tmp_path / "art")
    (art / "oscar_stats.safetensors").write_bytes(b"\0" * 40_894_464)
    summary = written_summary(art, None)
    code, _, err = run_cli(["push", str(art), "--repo", REPO, "--include-stats", "--dry-run"], monkeypatch, capsys)
    assert code == 0, err
    assert "39.0 MiB" in summary and "(39.0 MiB)" in " ".join(err.split()), (summary, err)


# ------------------------------------------------------------------------------------------------ the CPU vLLM recipe
def test_history_report_counts_int2_tokens_and_speaks_at_first_and_every_64th_step():
    from runtime_kernels.vllm.report import HISTORY_LINE, HistoryReport

    report = HistoryReport(every=64)
    assert report.record([0, 0]) is None and report.steps == 0  # windows only: nothing read from INT2
    first = report.record([64, 0, 128])
    assert first is not None and first.startswith(f"{HISTORY_LINE}: 192 history tokens read from INT2 over 1 ")
    assert "2 request(s), up to 128 tokens each" in first
    said = [report.record([64]) for _ in range(63)]  # steps 2..64
    assert said[:-1] == [None] * 62 and said[-1].startswith(f"{HISTORY_LINE}: {192 + 63 * 64} history tokens")


def _recipe() -> str:
    from readme_snippets import blocks

    root = Path(__file__).resolve().parents[1]
    return "\n".join(b.text for b in blocks(root / "README.md") if b.tag == "vllm-cpu")


def test_cpu_recipe_prompt_reaches_the_int2_history_and_the_lane_checks_it():
    """The recipe's prompt, tokenized by the model it serves, is longer than the demo format's BF16 windows by at
    least one INT2 page; the lane's regex matches the line the engine logs."""
    import re

    from oscar_calib.demo import FIXTURE_DIR
    from runtime_kernels.format import DEFAULT_FORMAT
    from runtime_kernels.vllm.report import HISTORY_LINE, HistoryReport

    recipe = _recipe()
    (chars,) = re.findall(r'open\("oscar_calib/fixtures/tiny-qwen3/heldout.txt"\)\.read\(\)\[:(\d+)\]', recipe)
    from transformers import AutoTokenizer

    tokens = len(AutoTokenizer.from_pretrained(FIXTURE_DIR)((FIXTURE_DIR / "heldout.txt").read_text()[:int(chars)])
                 ["input_ids"])
    fmt = DEFAULT_FORMAT
    assert fmt.history_tokens(tokens) >= fmt.page_size, (tokens, fmt.sink_tokens, fmt.recent_tokens)
    assert f'grep "{HISTORY_LINE}" vllm.log' in recipe
    lane = (Path(__file__).resolve().parents[1] / ".ci" / "vllm_lane.sh").read_text()
    (pattern,) = re.findall(r'grep -Eq "([^"]+)" vllm.log', lane)
    assert re.search(pattern, HistoryReport().record([fmt.history_tokens(tokens)]))
    assert not re.search(pattern, f"{HISTORY_LINE}: 0 history tokens")


def test_cpu_recipe_wait_is_bounded_stops_on_a_dead_server_and_stops_the_server():
    """The wait loop ends after a fixed number of tries or when the server process is gone (run here with a
    server that died at once: it must return within seconds), and the recipe's last line stops the server."""
    import re

    recipe = _recipe()
    (loop,) = re.findall(r"^for i in \$\(seq \d+\); do.*?^done$", recipe, flags=re.S | re.M)
    assert recipe.rstrip().splitlines()[-1].startswith("kill $server")
    script = "false & server=$!\nsleep 0.2\n" + loop.replace("127.0.0.1:8000", "127.0.0.1:9")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert "the server stopped" in done.stdout, done.stdout + done.stderr
    assert subprocess.run(["bash", "-n", "-c", recipe]).returncode == 0
