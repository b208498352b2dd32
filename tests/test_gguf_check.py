"""A GGUF whose metadata lies about its tensors is refused before transformers builds anything from it (issue 54).

The files are written with the `gguf` package's writer from a tiny llama (tests/gguf_helpers.py); the faithful
one must load into the same weights, each forged one must be refused naming its field, exit 2, in seconds.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("gguf")

from cli_helpers import run_cli  # noqa: E402
from gguf_helpers import HEAD_DIM, HEADS, KV_HEADS, tiny_hf_model, write_tiny_gguf  # noqa: E402

from oscar_calib.errors import InputError  # noqa: E402
from oscar_calib.gguf_check import check_gguf  # noqa: E402
from oscar_calib.loading import load_config, load_model  # noqa: E402


def test_a_faithful_gguf_passes_and_loads_the_same_weights(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf")
    geo = check_gguf(path)
    assert (geo.block_count, geo.head_count, geo.head_count_kv, geo.key_length) == (2, HEADS, KV_HEADS, HEAD_DIM)
    model = load_model(str(path), None, torch.float32, "cpu", False)
    reference = tiny_hf_model().state_dict()
    loaded = model.state_dict()
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(loaded[name], reference[name]), name


FORGED = {
    "1,000 blocks over tensors for 2": ({"llama.block_count": 1000}, (), None,
                                        "field 'llama.block_count': says 1000 blocks, but the tensors are those of "
                                        "blocks 0-1 (2 blocks)"),
    "1 block over tensors for 2": ({"llama.block_count": 1}, (), None, "field 'llama.block_count': says 1 blocks"),
    "no block count": ({"llama.block_count": None}, (), None, "field 'llama.block_count': missing"),
    "a block count of 2^40": ({"llama.block_count": 1 << 40}, (), None, "expected an integer in [1, 4096]"),
    "a block count that is text": ({"llama.block_count": "2"}, (), None, "expected one integer in [1, 4096]"),
    "twice the heads": ({"llama.attention.head_count": 8}, (), None,
                        "field 'llama.attention.head_count': gives heads of 8 dimensions, fewer than"),
    "kv heads that do not divide": ({"llama.attention.head_count_kv": 3}, (), None,
                                    "'llama.attention.head_count_kv': 3 does not divide"),
    "one kv head too few": ({"llama.attention.head_count_kv": 1}, (), None,
                            "field 'llama.attention.head_count_kv': tensor 'blk.0.attn_k.weight' has shape [64, 32], "
                            "but the metadata says [64, 16]"),
    "a wider embedding": ({"llama.embedding_length": 128}, (), None, "field 'llama.embedding_length': says 128"),
    "a context of 0": ({"llama.context_length": 0}, (), None, "field 'llama.context_length': expected an integer in"),
    "a context of 2^40": ({"llama.context_length": 1 << 40}, (), None, "'llama.context_length': expected an integer"),
    "a vocabulary larger than the embedding": ({"llama.vocab_size": 300}, (), None,
                                               "field 'llama.vocab_size': says 300, but 'token_embd.weight' has 257"),
    "no architecture": ({}, (), "arch", "field 'general.architecture'"),
    "an attention tensor missing in one block": ({}, ("blk.1.attn_v.weight",), None,
                                                 "tensor 'blk.1.attn_v.weight': missing"),
    "an attention norm missing in one block": ({}, ("blk.0.attn_norm.weight",), None,
                                               "tensor 'blk.0.attn_norm.weight': missing"),
    "no token embedding": ({}, ("token_embd.weight",), None, "'token_embd.weight': missing tensor"),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_a_forged_field_is_refused_naming_it(case, tmp_path):
    fields, drop, special, message = FORGED[case]
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, fields=fields, drop=drop)
    if special == "arch":  # rename the architecture key (same length, so the header stays well formed)
        data = path.read_bytes().replace(b"general.architecture", b"general.architectur_", 1)
        path.write_bytes(data)
    with pytest.raises(InputError) as info:
        check_gguf(path)
    text = str(info.value)
    assert message in text and "\n" not in text, text
    assert text.startswith(f"--model {path}: ")


def test_a_feed_forward_weight_missing_is_refused_after_loading_not_initialised(tmp_path):
    """What the header check leaves to transformers (a block's feed-forward part) is refused from its list of
    missing keys: the weight would otherwise be random."""
    path = write_tiny_gguf(tmp_path / "m.gguf", drop=("blk.1.ffn_gate.weight",))
    check_gguf(path)
    with pytest.raises(InputError, match=r"lacks 1 weight\(s\) the architecture needs "
                                         r"\(model\.layers\.1\.mlp\.gate_proj\.weight\); refusing to initialise"):
        load_model(str(path), None, torch.float32, "cpu", False)


def test_not_a_gguf_and_a_truncated_one_are_one_line(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(InputError, match="not a readable GGUF file"):
        load_config(str(bad), None, False)
    good = write_tiny_gguf(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[:2000])  # inside the tokenizer's metadata
    with pytest.raises(InputError, match="not a readable GGUF file"):
        check_gguf(cut)


def test_run_refuses_the_forged_block_gguf_in_seconds(tmp_path, monkeypatch, capsys):
    """The issue's case: 1,000 blocks claimed, tensors for 2 (it ran > 900 s before). Budget 30 s on 2 cores;
    the CLI's imports are most of what remains."""
    path = write_tiny_gguf(tmp_path / "forged.gguf", fields={"llama.block_count": 1000})
    data = tmp_path / "calib.txt"
    data.write_text("hello there, a few words of text to calibrate on.\n" * 20, encoding="utf-8")
    start = time.perf_counter()
    code, _, err = run_cli(["run", "--model", str(path), "--dataset", str(data), "--samples", "1", "--seq-len", "16", "--out",
                            str(tmp_path / "out")], monkeypatch, capsys)
    elapsed = time.perf_counter() - start
    assert code == 2, err
    assert "field 'llama.block_count': says 1000 blocks" in " ".join(err.split()) and "Traceback" not in err
    assert elapsed < 30, elapsed
    assert not (tmp_path / "out").exists()
