"""Tiny GGUF files for tests, written with the `gguf` package's own writer from a tiny transformers llama.

`write_tiny_gguf(path, **lies)` writes a faithful file (llama.cpp's layout: q/k rows permuted as its converter
does, a byte-level BPE tokenizer) or one whose metadata lies: any metadata field overridden, tensors dropped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tiny_models import tiny_model

HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 4, 2, 16, 2, 257

_HF_TO_GGUF = [("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
               ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
               ("post_attention_layernorm", "ffn_norm"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
               ("mlp.down_proj", "ffn_down")]


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 single-byte tokens of a byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (its converter's `permute`; transformers' GGUF loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_model():
    """The transformers model every tiny GGUF is written from (seeded)."""
    return tiny_model("llama", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_layers=LAYERS,
                      vocab_size=VOCAB)


def write_tiny_gguf(path: Path, fields: dict | None = None, drop: tuple[str, ...] = (),
                    reshape: dict[str, tuple[int, ...]] | None = None) -> Path:
    """A llama GGUF of `tiny_hf_model()` at `path`. `fields` overrides metadata (GGUF key -> value; None removes
    it), `drop` leaves tensors out (GGUF names), `reshape` writes zeros of another numpy shape for a tensor."""
    import gguf

    model = tiny_hf_model()
    c = model.config
    meta = {"llama.block_count": c.num_hidden_layers, "llama.context_length": c.max_position_embeddings,
            "llama.embedding_length": c.hidden_size, "llama.feed_forward_length": c.intermediate_size,
            "llama.attention.head_count": c.num_attention_heads, "llama.attention.head_count_kv": c.num_key_value_heads,
            "llama.rope.dimension_count": HEAD_DIM}
    meta.update(fields or {})
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    for key, value in meta.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 1 << 32:
            writer.add_key_value(key, value, _value_type(value))
        else:
            writer.add_uint32(key, value)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]) if getattr(c, "rope_parameters", None)
                              else 10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([*_byte_tokens(), "he"])  # one merge: the BPE converter needs merges
    writer.add_token_merges(["h e"])
    writer.add_token_types([1] * VOCAB)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    state = model.state_dict()
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in range(c.num_hidden_layers):
        for hf, g in _HF_TO_GGUF:
            names[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{hf}.weight"
    for name, hf in names.items():
        if name in drop:
            continue
        w = state[hf].float().numpy()
        if name.endswith("attn_q.weight"):
            w = _permute(w, HEADS)
        elif name.endswith("attn_k.weight"):
            w = _permute(w, KV_HEADS)
        if reshape and name in reshape:
            w = np.zeros(reshape[name], dtype=np.float32)
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _value_type(value):
    import gguf

    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY
    return gguf.GGUFValueType.INT64 if value < 0 or value < 1 << 63 else gguf.GGUFValueType.UINT64
