"""`--json` on the commands that produce a result without a Hub: `refit`, `stats merge`, `zoo build`; and `refit`
errors named by the flag, as in `run` (issue 22, point 4)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from cli_helpers import run_cli
from tiny_models import tiny_model

from oscar_calib.calibration.stats_file import STATS_FILENAME, load_statistics
from oscar_calib.cli import exit_codes
from oscar_calib.demo import byte_tokenizer

WINDOWS = ("--sink", "4", "--recent", "8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=64, num_layers=2, vocab_size=260,
               max_position_embeddings=512).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    gen = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "rotation", "head", "token", "query"]
    path.write_text("\n\n".join(" ".join(words[int(i)] for i in torch.randint(0, 10, (60,), generator=gen))
                                for _ in range(20)))
    return path


def _run(model_dir, text_file, out, monkeypatch, capsys, *extra):
    code, _, err = run_cli(["run", "--model", str(model_dir), "--dataset", str(text_file), "--out", str(out),
                            "--samples", "2", "--seq-len", "32", *WINDOWS, *extra], monkeypatch, capsys)
    assert code == 0, err
    return out


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_refit_and_merge_json(model_dir, text_file, tmp_path, monkeypatch, capsys):
    shards = [_run(model_dir, text_file, tmp_path / f"s{i}", monkeypatch, capsys, "--shard", f"{i}/2")
              for i in range(2)]
    merged = tmp_path / "merged.safetensors"
    code, out, err = run_cli(["stats", "merge", *map(str, shards), "--out", str(merged), "--json"], monkeypatch,
                             capsys)
    assert code == 0, err
    result = json.loads(out)
    stats = load_statistics(merged)
    assert result["out"] == str(merged) and result["sha256"] == sha(merged) and result["size"] == merged.stat().st_size
    assert result["sample_ranges"] == stats.provenance.sample_ranges == [[0, 2]]
    assert result["tokens"] == stats.tokens and result["layer_ids"] == stats.layer_ids == [0, 1]

    code, out, err = run_cli(["refit", str(merged), "--out", str(tmp_path / "r"), *WINDOWS, "--json"], monkeypatch,
                             capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["artifact_sha256"] == sha(tmp_path / "r" / "oscar_kv.safetensors")
    assert result["layer_ids"] == [0, 1] and "key_error" in result["summary"]
    code, out, err = run_cli(["refit", str(merged), "--out", str(tmp_path / "plain"), *WINDOWS], monkeypatch, capsys)
    assert code == 0 and out.strip() == str(tmp_path / "plain")  # without --json: the path alone, as before


@pytest.mark.parametrize("flags, flag", [(["--k-clip-grid", "1.5"], "--k-clip-grid"),
                                         (["--v-clip-grid", "0"], "--v-clip-grid"),
                                         (["--sink", "-1"], "--sink")])
def test_refit_errors_name_the_flag(flags, flag, tmp_path, monkeypatch, capsys):
    stats = tmp_path / STATS_FILENAME  # never read: the settings are checked first
    code, out, err = run_cli(["refit", str(stats), "--out", str(tmp_path / "o"), *flags], monkeypatch, capsys)
    assert code == exit_codes.BAD_INPUT and err.startswith(f"Error: {flag}") and out == "", err
    assert "solver" not in err and "_grid" not in err and not (tmp_path / "o").exists()


def test_zoo_build_json(model_dir, text_file, tmp_path, monkeypatch, capsys):
    rev = "a" * 40
    manifest = tmp_path / "zoo_manifest.yaml"
    manifest.write_text(f"""schema_version: 1
repo: org/zoo
recipes:
  - model_id: tiny/qwen3
    model_revision: "{rev}"
    data: {{dataset: {text_file.name}, samples: 2, seq_len: 32}}
    solver: {{kv_format: {{sink_tokens: 4, recent_tokens: 8}}}}
""")
    (tmp_path / text_file.name).write_text(text_file.read_text())
    argv = ["zoo", "build", "--manifest", str(manifest), "--out-root", str(tmp_path / "b"),
            "--local-model", f"tiny/qwen3={model_dir}", "--device", "cpu", "--json"]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert code == 0, err
    built = tmp_path / "b" / "tiny" / "qwen3" / "default"
    assert json.loads(out) == {"recipes": [{"model_id": "tiny/qwen3", "calibration": "default", "out": str(built),
                                            "built": True}]}
    assert (built / "oscar_kv.safetensors").is_file()
    code, out, err = run_cli(argv, monkeypatch, capsys)  # already built: reported, not rebuilt
    assert code == 0 and json.loads(out)["recipes"][0]["built"] is False and "already built" in err
