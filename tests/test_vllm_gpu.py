"""The CUDA backend inside vLLM on a GPU (`make test-gpu`; skipped without CUDA or without vLLM).

Runs `bench/vllm_gpu_check.py` on the trained fixture (tiny-qwen3, context 4096; an artifact calibrated here with
64/256 windows) with prompts of 700 to 3,900 tokens, nearly all of them in the INT2 history, and checks what the
engine must do there:
- vLLM with CUDA graphs gives the tokens of vLLM eager (graph replay reads the static buffers it was captured on);
- decode steps were booked into the static buffers and read the INT2 history;
- vLLM's greedy tokens equal the project's own `OscarCache` for the first tokens of every prompt, and where they
  part, the reference's top-1 / top-2 logits were within 0.5 of each other (a rounding-order tie, not a bug);
- vLLM's KV capacity at the same KV memory is the INT2 cell's ratio over BF16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("vllm.v1.attention.backends.flash_attn", reason="vLLM (CUDA build) is not installed")

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "oscar_calib" / "fixtures" / "tiny-qwen3"
RUN_ARGS = ["--sink", "64", "--recent", "256", "--seq-len", "1024", "--samples", "8"]


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-gpu")
    art = Path(os.environ["OSCAR_VLLM_GPU_ARTIFACT"]) if os.environ.get("OSCAR_VLLM_GPU_ARTIFACT") else tmp / "art"
    if not art.exists():  # OSCAR_VLLM_GPU_ARTIFACT: the same calibration, made elsewhere (saves the GPU the run)
        subprocess.run([sys.executable, "-m", "oscar_calib", "run", "--out", str(art), *RUN_ARGS], check=True,
                       capture_output=True, cwd=ROOT)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FIXTURE)
    text = (FIXTURE / "heldout.txt").read_text()
    ids = tok(text)["input_ids"]
    prompts = [ids[i * 4000:i * 4000 + n] for i, n in enumerate((3000, 3400, 3900, 700))]  # context 4096
    (tmp / "prompts.json").write_text(json.dumps({"prompts": prompts}))
    out = Path(os.environ.get("OSCAR_VLLM_GPU_OUT") or tmp / "res")  # where the results file and logs stay
    subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_gpu_check.py"), "--model", str(FIXTURE),
                    "--artifact", str(art), "--prompts", str(tmp / "prompts.json"), "--new-tokens", "16",
                    "--kv-gib", "0.25", "--out", str(out), "--modes", "hf", "vllm-bf16", "vllm-oscar",
                    "vllm-oscar-eager"], check=False, cwd=ROOT, env=dict(os.environ))
    found = sorted(out.glob("vllm_gpu_check_*.json"))
    assert found, "bench/vllm_gpu_check.py wrote no results"
    return json.loads(found[0].read_text())


def test_every_side_ran(check):
    assert not check["failed"], check["failed"]


def test_graphs_replay_the_eager_tokens(check):
    rows = check["checks"]["vllm-oscar-eager vs vllm-oscar"]
    assert rows and all(r["equal_tokens"] == r["of"] for r in rows), rows


def test_decode_steps_were_static_and_read_int2(check):
    stats = check["results"]["vllm-oscar"]["engine_stats"]
    assert stats["static_steps"] > 0 and stats["history_tokens"] > 0, stats


def test_tokens_follow_the_project_runtime(check):
    for r in check["checks"]["vllm-oscar vs hf-oscar"]:
        assert r["equal_tokens"] >= 4, r
        if r["equal_tokens"] < r["of"]:
            assert r["ref_top1_minus_top2_logit"] < 0.5, r


def test_capacity_counts_int2_pages(check):
    def tokens(mode):
        lines = [ln for ln in check["logs"][mode] if ln.startswith("GPU KV cache size")]
        return int(lines[0].split(":")[1].split()[0].replace(",", ""))

    assert tokens("vllm-oscar") > 4 * tokens("vllm-bf16")
