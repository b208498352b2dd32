"""Tiny randomly initialised causal LMs built from configs (no downloads), for tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ARCH_TYPES = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "mistral": "mistral"}


def tiny_config(arch: str = "qwen3", num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64,
                num_layers: int = 2, vocab_size: int = 256, max_position_embeddings: int = 2048, **extra):
    """A config of the given family with `hidden_size = num_heads * head_dim` (head_dim set explicitly)."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=num_heads * head_dim,
        intermediate_size=2 * num_heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(extra)
    return AutoConfig.for_model(ARCH_TYPES[arch], **kwargs)


def tiny_model(arch: str = "qwen3", seed: int = 0, dtype=torch.float32, **kwargs):
    """Build, seed and return an eval-mode tiny model of the family `arch`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kwargs), dtype=dtype)
    return model.eval()
