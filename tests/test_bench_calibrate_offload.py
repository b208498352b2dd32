"""The 70B offload calibration bench (bench/bench_calibrate_offload.py) on CPU, at a tiny Llama shape: the meta
build and in-place materialisation against transformers' own build, accelerate's placement within a tiny
--max-memory (later layers go to disk), and a whole run with layers on disk that gives the same artifact as the
run with the model in memory. The GPU run (70B shape, one H200) is the lead's; this checks what it computes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_calibrate_offload as B  # noqa: E402

from oscar_calib.errors import InputError  # noqa: E402
from oscar_calib.placement import parse_max_memory  # noqa: E402
from runtime_kernels.artifact import read_artifact  # noqa: E402

TINY = B.Geometry(layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=500,
                  max_positions=1280)
TINY_ARGS = ["--layers", "4", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
             "--intermediate", "256", "--vocab", "500", "--max-positions", "1280", "--samples", "4", "--seq-len", "128",
             "--batch-size", "2", "--device", "cpu"]


def fp32_sizes(g: B.Geometry) -> tuple[int, int]:
    """Bytes of the embedding and of one decoder layer in fp32, by arithmetic (not from accelerate)."""
    layer = g.hidden * g.head_dim * (2 * g.heads + 2 * g.kv_heads) + 3 * g.hidden * g.intermediate + 2 * g.hidden
    return g.vocab * g.hidden * 4, layer * 4


def kb(n: int) -> str:
    """A --max-memory size of at least n bytes (the parser takes sizes with a unit)."""
    return f"{n // 1000 + 1}KB"


def test_meta_build_and_materialise_give_the_geometry_and_random_weights():
    from transformers import AutoModelForCausalLM

    model = B.build_meta_model(TINY, torch.float32)
    assert all(p.device.type == "meta" for p in model.parameters())
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (4, 128, 4, 2, 32, 256, 500, 1280)
    assert not cfg.tie_word_embeddings and cfg._name_or_path == B.MODEL_ID
    placed = B.materialise_(model, {"": "cpu"}, seed=0)

    # Independent reference: transformers' ordinary build of the same config has the same parameters and shapes.
    ref = AutoModelForCausalLM.from_config(B.llama_config(TINY))
    assert {n: p.shape for n, p in model.named_parameters()} == {n: p.shape for n, p in ref.named_parameters()}
    n = sum(p.numel() for p in model.parameters())
    assert n == TINY.parameters()
    assert B.LLAMA_70B.parameters() == 70_553_706_496  # Llama-3-70B's published count
    assert placed == {"cpu": 4 * n}
    weights = {}
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and bool(torch.isfinite(p).all()), name
        if "norm" in name:
            assert bool((p == 1).all()), name
        else:
            assert abs(float(p.std()) - B.INIT_STD) < 0.1 * B.INIT_STD and abs(float(p.mean())) < 2e-3, name
            assert p.unique().numel() > 0.9 * p.numel(), name  # not a constant or a short repeated block
            weights[name] = p.detach().clone()
    q0, q1 = weights["model.layers.0.self_attn.q_proj.weight"], weights["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(q0, q1)  # every tensor its own draw
    # The seed decides the weights: the same seed the same values, another seed others.
    again, other = (B.build_meta_model(TINY, torch.float32) for _ in range(2))
    B.materialise_(again, {"": "cpu"}, seed=0)
    B.materialise_(other, {"": "cpu"}, seed=1)
    assert torch.equal(again.model.layers[0].self_attn.q_proj.weight, q0)
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.weight, q0)
    # RoPE buffers stayed real through the empty build, so the model runs: finite logits.
    with torch.no_grad():
        logits = model(input_ids=torch.arange(16)[None]).logits
    assert logits.shape == (1, 16, 500) and bool(torch.isfinite(logits).all())


def test_device_map_from_a_tiny_budget_sends_later_layers_to_disk():
    model = B.build_meta_model(TINY, torch.float32)
    embed, layer = fp32_sizes(TINY)
    seen = []
    for k in (2, 3, 4):
        budget = (embed + k * layer) // 1000 * 1000 + 1000
        device_map = B.plan_device_map(model, "cpu", parse_max_memory([f"cpu={kb(embed + k * layer)}", "disk=1GiB"]))
        counts = B.layers_by_device(device_map, TINY.layers)
        on_cpu = [i for i in range(TINY.layers)
                  if B.mapped_device(f"model.layers.{i}.mlp.up_proj.weight", device_map) == "cpu"]
        assert on_cpu == list(range(len(on_cpu)))  # a prefix in memory, the later layers on disk
        assert counts.get("disk", 0) == TINY.layers - len(on_cpu) > 0
        assert B.mapped_device("lm_head.weight", device_map) == "disk"
        # accelerate keeps one layer's room free for the layer it streams in: what stays fits beside it, and one
        # more layer would not have.
        cpu_bytes = embed + len(on_cpu) * layer
        assert cpu_bytes + layer <= budget < cpu_bytes + 2 * layer
        seen.append(len(on_cpu))
    assert seen == [1, 2, 3]
    # No budget: the whole model on the device.
    assert B.plan_device_map(model, "cpu", None) == {"": "cpu"}
    with pytest.raises(InputError, match=r"--max-memory 0=.*--device cpu"):
        B.plan_device_map(model, "cpu", parse_max_memory(["0=1GiB", "cpu=1GiB"]))


def test_tiny_run_with_layers_on_disk_writes_the_report_and_the_same_artifact(tmp_path):
    in_memory = B.main([*TINY_ARGS, "--out", str(tmp_path / "mem"), "--artifact-dir", str(tmp_path / "mem_art")])
    embed, layer = fp32_sizes(TINY)
    offloaded = B.main([*TINY_ARGS, "--out", str(tmp_path / "off"), "--artifact-dir", str(tmp_path / "off_art"),
                        "--max-memory", f"cpu={kb(embed + 3 * layer)}", "disk=1GiB"])
    assert in_memory.name == offloaded.name == "calibrate_70b_cpu.json"
    r = json.loads(offloaded.read_text())
    assert r["placement"]["layers_by_device"] == {"cpu": 2, "disk": 2}
    assert "disk: layers 2-3" in r["placement"]["describe"]
    s = r["seconds"]
    stages = ("build_materialise", "dispatch", "forward_capture", "solve_and_clip_fit", "calibrate_call", "write")
    assert all(s[k] > 0 for k in stages)
    assert s["end_to_end"] == pytest.approx(s["build_materialise"] + s["dispatch"] + s["calibrate_call"] + s["write"])
    assert s["forward_capture"] + s["solve_and_clip_fit"] <= s["calibrate_call"] <= s["script_total"]
    assert r["target"] == {"seconds": 900, "met": s["end_to_end"] <= 900}
    # The held-out length follows the product's rule: the model's context (1280 here, under the 8192 cap).
    assert r["shape"]["holdout_len"] == 1280 and "model's context" in r["shape"]["holdout_rule"]
    assert r["shape"]["tokens"] == 4 * 128 and r["shape"]["parameters"] == TINY.parameters()
    assert all(row["host_rss_gib"] > 0 and row["host_rss_peak_gib"] >= row["host_rss_gib"]
               for row in r["stages"].values())
    assert r["peak_memory"]["host_peak_rss_gib"] > 0 and r["peak_memory"]["gpu_max_allocated_gib"] is None
    assert "| build+materialise |" in offloaded.with_suffix(".md").read_text()

    art = read_artifact(tmp_path / "off_art")
    assert art.layer_ids.tolist() == [0, 1, 2, 3]
    assert art.k_rotation.shape == (4, 2, 32, 32) and art.v_rotation.shape == (4, 2, 32, 32)
    meta = art.metadata
    assert (meta["num_attention_heads"], meta["num_key_value_heads"], meta["head_dim"]) == ("4", "2", "32")
    assert meta["model_id"] == B.MODEL_ID
    # Streaming the layers from disk changes nothing: the same weights give the same rotations and clips.
    ref = read_artifact(tmp_path / "mem_art")
    for name in ("k_rotation", "v_rotation", "k_clip_ratio", "v_clip_ratio", "k_eigenvalues", "k_mean"):
        assert torch.equal(getattr(art, name), getattr(ref, name)), name
