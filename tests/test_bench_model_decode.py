"""The model-level decode bench (bench/bench_model_decode.py) on CPU: its OSCAR step through PagedKVCache (Triton
under the interpreter) against the same model over a BF16 cache of the cache's own dequantized contents, and its
KV-budget arithmetic. The GPU run (CUDA graph, Qwen3-8B shape) is the lead's; this checks what it computes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_model_decode as B  # noqa: E402

pytestmark = pytest.mark.interpreter


def test_oscar_decode_step_matches_bf16_attention_over_the_dequantized_cache():
    """Small windows keep the interpreter fast; the layout code is the recipe's (ue5m3, centered, page 64).
    Measured: attention 2.6e-3, logits 6.9e-3 (bf16 K/V and activations); a cache whose sequences are swapped
    (a wrong block table or slot) is off by about 0.75 in both."""
    got = B.smoke(batch=2, history_pages=2, recipe=B.RECIPE.with_(sink_tokens=16, recent_tokens=64))
    assert got["history_tokens"] == 128 and got["tokens"] == 16 + 64 + 32 + 128
    assert got["attention_rel_rmse"] < 1.5e-2 and got["logits_rel_rmse"] < 3e-2
    assert got["attention_rel_rmse_swapped"] > 0.3 and got["logits_rel_rmse_swapped"] > 0.3


def test_kv_budget_arithmetic_at_128k():
    """At 128K and 40 GiB the recipe's cache holds 15 Qwen3-8B sequences and BF16 2 (7.5x); the per-sequence bytes
    are the cache's own (`OscarAttention` asserts them against `PagedKVCache.memory_bytes`)."""
    budget = 40 << 30
    bf16 = B.bf16_bytes_per_seq(B.QWEN3_8B, 131072)
    oscar = B.oscar_bytes_per_seq(B.QWEN3_8B, 131072, B.RECIPE)
    assert bf16 == 36 * 2 * 8 * 131072 * 128 * 2
    hist, n = B.oscar_history(131072, B.RECIPE)
    assert hist % 64 == 0 and n - hist - 128 - 1024 == 32  # the recent window ends mid-page: no demotion
    assert (budget // bf16, budget // oscar) == (2, 15)
    # The tiny shape through a real cache: the formula is the cache's bytes.
    B.OscarAttention(B.SMOKE_SHAPE, 2, 16 + 64 + 32 + 64, "cpu", recipe=B.RECIPE.with_(sink_tokens=16, recent_tokens=64))


def test_the_decoder_step_is_a_qwen3_layer_stack():
    """The step calls attention once per layer with q, k, v per head, fused QKV and logits over the vocab; the bench
    builds it at Qwen3-8B shape."""
    m = B.Decoder(B.ModelShape(layers=1, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=32, vocab=50),
                  "cpu")
    assert m.layers[0]["wqkv"].shape == (64, (4 + 4) * 16)
    seen = []

    def attention(layer, q, k, v):
        seen.append((q.shape, k.shape, v.shape))
        return torch.zeros_like(q)
    logits = m.step(torch.tensor([1, 2, 3]), m.rope(5, "cpu"), attention)
    assert logits.shape == (3, 50) and seen == [((3, 4, 16), (3, 2, 16), (3, 2, 16))]
    assert B.QWEN3_8B.layers == 36 and (B.QWEN3_8B.heads, B.QWEN3_8B.kv_heads, B.QWEN3_8B.head_dim) == (32, 8, 128)


def test_the_run_measures_every_point_and_the_budget_batches(tmp_path):
    """The GPU run's flow on CPU (tiny model, eager steps timed by a stand-in): every point for both caches, then
    the budget batches, results and table written."""
    import json

    def timer(model, attention, batch, position):
        tokens = torch.zeros(batch, dtype=torch.int64)
        model.step(tokens, model.rope(position, "cpu"), attention)
        return (1.0, 1.0, 1.0)

    recipe = B.RECIPE.with_(sink_tokens=16, recent_tokens=64)
    context = 16 + 64 + 32 + 64
    per_seq = B.oscar_bytes_per_seq(B.SMOKE_SHAPE, context, recipe)
    rows, budget = B.run(str(tmp_path), [(context, 1)], 3 * per_seq / (1 << 30), shape=B.SMOKE_SHAPE, device="cpu",
                         recipe=recipe, budget_context=context, timer=timer)
    assert budget["oscar_batch"] == 3 and budget["bf16_batch"] == 3 * per_seq // B.bf16_bytes_per_seq(
        B.SMOKE_SHAPE, context)
    got = {(r["variant"], r["shape"]["batch"]) for r in rows if "p50_ms" in r}
    assert ("oscar_recipe", 1) in got and ("oscar_recipe", 3) in got
    assert {b for v, b in got if v.startswith("bf16")} == {1, budget["bf16_batch"]}  # a backend refusing is recorded
    saved = json.loads(next(tmp_path.glob("model_decode_*.json")).read_text())
    assert saved["rows"][-1]["op"] == "kv_budget" and saved["meta"]["commit"]
    assert "OSCAR vs BF16" in next(tmp_path.glob("model_decode_*.md")).read_text()


@pytest.mark.slow  # inductor compiles C++ kernels for two graphs on CPU: 5 to 25 s
def test_the_compiled_decoder_computes_the_eager_step():
    """`--compiled` puts the work around attention through torch.compile for both caches; it must be the same
    model. Measured on CPU: logits within 7e-3 relative RMSE of the eager step (inductor keeps fp32 between the
    fused ops where eager rounds to bf16); another token's logits are 1.5 away."""
    shape = B.ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=32, vocab=50)
    eager, compiled = B.Decoder(shape, "cpu"), B.Decoder(shape, "cpu", compiled=True)

    def attention(layer, q, k, v):  # any function of q, k and v that reaches the output
        return q * 0.5 + k.repeat_interleave(q.shape[1] // k.shape[1], dim=1) - v.mean()

    def rel(a, b):
        return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()

    tokens = torch.tensor([1, 2, 3])
    want = eager.step(tokens, eager.rope(5, "cpu"), attention).float()
    got = compiled.step(tokens, compiled.rope(5, "cpu"), attention).float()
    other = compiled.step(torch.tensor([4, 5, 6]), compiled.rope(5, "cpu"), attention).float()
    assert rel(got, want) < 2e-2
    assert rel(other, want) > 0.3
