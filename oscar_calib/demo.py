"""The embedded default of `oscar-calib run` with no arguments: a small model and text shipped in the package.

If the trained fixture (`oscar_calib/fixtures/tiny-qwen3`, a small Qwen3 trained by `tools/train_fixture.py`)
is installed, it is used with its calibration text. Otherwise a tiny randomly initialised Qwen3 is built
from a config, with a byte-level tokenizer, and calibrated on `demo_data/demo.txt`.
"""

from __future__ import annotations

from pathlib import Path

import torch

PACKAGE_DIR = Path(__file__).resolve().parent
FIXTURE_DIR = PACKAGE_DIR / "fixtures" / "tiny-qwen3"
DEMO_TEXT = PACKAGE_DIR / "demo_data" / "demo.txt"
DEMO_MODEL_ID = "oscar-calib/demo-tiny-qwen3"  # the random fallback
FIXTURE_MODEL_ID = "oscar-calib/tiny-qwen3"  # the trained fixture


def fixture_available() -> bool:
    return (FIXTURE_DIR / "config.json").is_file() and any(FIXTURE_DIR.glob("*.safetensors"))


def fixture_revision() -> str:
    """A content revision for the fixture: the first 12 hex digits of its weights' sha256."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(FIXTURE_DIR.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return f"fixture-{digest.hexdigest()[:12]}"


def demo_text_path() -> Path:
    calib = FIXTURE_DIR / "calib.txt"
    return calib if fixture_available() and calib.is_file() else DEMO_TEXT


def byte_tokenizer():
    """A 256-symbol byte-level tokenizer (+ EOS) as a transformers fast tokenizer: no download, no training."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def random_demo_model(seed: int = 0, dtype=torch.float32):
    """A tiny Qwen3 (2 layers, 4 query / 2 KV heads, head_dim 64) with random weights, and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    config = AutoConfig.for_model(
        "qwen3", vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    config._name_or_path = DEMO_MODEL_ID
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return model, tokenizer
