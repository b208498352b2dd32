"""Long-context probes (`oscar_calib.analysis.probes`) on the trained fixture at a short context: the passkey windows hold
what they claim, the teacher-forced score equals a plain forward pass for BF16 and falls to 0 for a method that
forgets its history, and verbatim recall equals an independent greedy loop through `generate()`, and the runtime's
when its BF16 windows hold the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
from format_helpers import PAPER

from oscar_calib.analysis.evaluate import make_windows, read_documents
from oscar_calib.analysis.methods import KVMethod
from oscar_calib.analysis.probes import (
    MULTIKEY_NAMES,
    multikey_batch,
    multivalue_batch,
    passkey_batch,
    passkey_scores,
    run_probes,
    verbatim_recall,
)
from oscar_calib.demo import FIXTURE_DIR, fixture_available
from runtime_kernels.artifact import identity_artifact

pytestmark = pytest.mark.skipif(not fixture_available(), reason="trained fixture not installed")
SINK, RECENT = 16, 64


@pytest.fixture(scope="module")
def lm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FIXTURE_DIR)
    model = AutoModelForCausalLM.from_pretrained(FIXTURE_DIR, dtype=torch.float32).eval()
    w = make_windows(tok, read_documents(FIXTURE_DIR / "heldout.txt"), 512, 8)
    return model, tok, torch.cat([w.long, w.packed])[:8]


@pytest.fixture
def torch_backend(monkeypatch):
    """The runtime's torch backend, as on a CPU without TRITON_INTERPRET (`resolve_backend`): these tests are about
    the probes and the cache's place in the model, not the kernels, and the interpreter took ~10 minutes per test
    (the kernels against the torch backend: tests/test_step_kernels.py, tests/test_cache.py).

    The kernel modules are imported first: Triton reads TRITON_INTERPRET when a kernel is defined, so one first
    imported while the variable is unset would stay compiled-only for the rest of the session's interpreter tests."""
    import runtime_kernels.attention.int2_decode.launch  # noqa: F401
    import runtime_kernels.quant.triton_quant  # noqa: F401
    import runtime_kernels.step_kernels  # noqa: F401

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


class Forgetful(KVMethod):
    """Every history key and value read as zero: whatever a needle said is gone."""

    def quantizes(self, layer_idx):
        return True

    def fake_quantize(self, layer_idx, keys, values, windows):
        return torch.zeros_like(keys, dtype=torch.float32), torch.zeros_like(values, dtype=torch.float32)


def test_passkey_windows_hold_the_needle_and_end_with_the_key(lm):
    model, tok, filler = lm
    batch = passkey_batch(tok, filler, [0.2, 0.5])
    assert batch.ids.shape == filler.shape
    for i, (a, b) in enumerate(batch.key_spans):
        key = tok.decode(batch.ids[i, a:b]).strip()
        assert key.isdigit() and len(key) == 5
        needle = tok.decode(batch.ids[i, batch.needle_positions[i]:batch.needle_positions[i] + 24])
        assert f"pass key is {key}" in needle
        assert b == filler.shape[1]


def test_passkey_score_of_bf16_is_a_plain_forward_pass_and_a_forgetful_cache_scores_zero(lm):
    model, tok, filler = lm
    batch = passkey_batch(tok, filler, [0.2, 0.4, 0.6])
    got = passkey_scores(model, KVMethod(), batch, PAPER.with_(sink_tokens=SINK, recent_tokens=RECENT))
    with torch.no_grad():
        logits = model(input_ids=batch.ids, use_cache=False).logits
    hits = sum(int((logits[i, a - 1:b - 1].argmax(-1) == batch.ids[i, a:b]).sum())
               for i, (a, b) in enumerate(batch.key_spans))
    total = sum(b - a for a, b in batch.key_spans)
    assert got["key_token_accuracy"] == pytest.approx(hits / total)
    assert got["key_token_accuracy"] >= 0.6  # measured 0.86: the fixture does retrieve at this depth
    forgot = passkey_scores(model, Forgetful("forgetful"), batch,
                            PAPER.with_(sink_tokens=SINK, recent_tokens=RECENT))
    assert forgot["key_token_accuracy"] < 0.2 and forgot["key_nll"] > got["key_nll"] + 2


def test_multikey_windows_hold_every_needle_and_ask_for_one(lm):
    """Each window holds `keys` needles of distinct names and keys inside the span, in order, and ends with the
    question for one of them followed by that needle's key; the asked needle moves over the windows."""
    import re

    model, tok, filler = lm
    lo, hi = 0.1, 0.8
    batch = multikey_batch(tok, filler, lo, hi, keys=4, seed=3)
    assert batch.ids.shape == filler.shape
    asked_parts = set()
    for i, (a, b) in enumerate(batch.key_spans):
        text = tok.decode(batch.ids[i])
        found = re.findall(r"The pass key for the (\w+) is (\d{5})\.", text)
        assert len(found) == 4 and len({n for n, _ in found}) == 4 and len({k for _, k in found}) == 4, found
        assert all(n in MULTIKEY_NAMES for n, _ in found)
        asked = re.search(r"What was the pass key for the (\w+)\?", text).group(1)
        assert tok.decode(batch.ids[i, a:b]).strip() == dict(found)[asked] and b == filler.shape[1]
        assert lo <= batch.depths[i] < hi
        asked_parts.add([n for n, _ in found].index(asked))
    assert asked_parts == {0, 1, 2, 3}


def test_multikey_score_of_bf16_beats_a_forgetful_cache_and_short_windows_are_refused(lm):
    """BF16 reads the asked key among 3 distractors far above a cache that forgets its history (which can only
    guess); windows too short for the needles are refused with a clear error."""
    from oscar_calib.errors import InputError

    model, tok, filler = lm
    fmt = PAPER.with_(sink_tokens=SINK, recent_tokens=RECENT)
    lo, hi = (SINK + 16) / 512, 1 - (RECENT + 64) / 512
    batch = multikey_batch(tok, filler, lo, hi, keys=4)
    got = passkey_scores(model, KVMethod(), batch, fmt)
    forgot = passkey_scores(model, Forgetful("forgetful"), batch, fmt)
    assert got["key_token_accuracy"] >= 0.5, got  # measured 0.58 on these 8 windows (a single needle: 0.86)
    assert forgot["key_token_accuracy"] < 0.2 and forgot["key_nll"] > got["key_nll"] + 2, forgot
    with pytest.raises(InputError, match="too short for 4 needles"):
        multikey_batch(tok, filler[:, :40], lo, hi, keys=4)
    with pytest.raises(InputError, match="keys 1"):
        multikey_batch(tok, filler, lo, hi, keys=1)


def test_multivalue_windows_hold_every_value_of_one_key_and_ask_for_all(lm):
    """Each window holds `values` needles giving one name distinct values, in order inside the span, and ends with the
    question for all of them followed by the values in the window's order; BF16 recalls them far above a cache that
    forgets its history; too-short windows and a single value are refused."""
    import re

    from oscar_calib.errors import InputError

    model, tok, filler = lm
    fmt = PAPER.with_(sink_tokens=SINK, recent_tokens=RECENT)
    lo, hi = (SINK + 16) / 512, 1 - (RECENT + 64) / 512
    batch = multivalue_batch(tok, filler, lo, hi, values=3, seed=2)
    assert batch.ids.shape == filler.shape
    for i, (a, b) in enumerate(batch.key_spans):
        text = tok.decode(batch.ids[i])
        found = re.findall(r"One of the pass keys for the (\w+) is (\d{5})\.", text)
        assert len(found) == 3 and len({n for n, _ in found}) == 1, found
        assert re.search(rf"What are all the pass keys for the {found[0][0]}\?", text)
        assert tok.decode(batch.ids[i, a:b]).split() == [v for _, v in found] and b == filler.shape[1]
        # the first needle lies in the first third of the span (depths are fractions of the window before the question)
        assert lo * 0.9 <= batch.depths[i] < lo + (hi - lo) / 3
    got = passkey_scores(model, KVMethod(), batch, fmt)
    forgot = passkey_scores(model, Forgetful("forgetful"), batch, fmt)
    # measured: BF16 0.33 of the value tokens (NLL 4.21), the forgetful cache 0.0 (NLL 5.79)
    assert got["key_token_accuracy"] > forgot["key_token_accuracy"] + 0.2, (got, forgot)
    assert forgot["key_nll"] > got["key_nll"] + 1, forgot
    with pytest.raises(InputError, match="too short for 3 needles"):
        multivalue_batch(tok, filler[:, :40], lo, hi, values=3)
    with pytest.raises(InputError, match="values 1"):
        multivalue_batch(tok, filler, lo, hi, values=1)


def _generate_greedy(model, ids, n):
    out = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:]


def test_verbatim_recall_equals_a_greedy_loop_through_generate(lm):
    model, _, filler = lm
    win, start, passage, gen, cue = filler[1, :300], 40, 32, 16, 6
    got = verbatim_recall(model, win, start, passage, gen, cue)
    with torch.no_grad():
        ids = win[None]
        ids = torch.cat([ids, _generate_greedy(model, ids, gen)], dim=1)
        ids = torch.cat([ids, win[None, start:start + cue]], dim=1)
        tail = _generate_greedy(model, ids, passage - cue)[0]
    assert got == pytest.approx(float((tail == win[start + cue:start + passage]).float().mean()))


def test_verbatim_recall_through_the_runtime_equals_bf16_when_the_windows_hold_everything(lm, torch_backend):
    model, _, filler = lm
    win, start, passage, gen, cue = filler[2, :300], 40, 32, 16, 6
    cfg = model.config
    everything = PAPER.with_(sink_tokens=512, recent_tokens=512)
    art = identity_artifact(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim,
                            fmt=everything)
    assert verbatim_recall(model, win, start, passage, gen, cue, artifact=art) == \
        verbatim_recall(model, win, start, passage, gen, cue)


def test_run_probes_refuses_windows_without_a_history(lm):
    from oscar_calib.errors import InputError

    model, tok, filler = lm
    with pytest.raises(InputError, match="no INT2 history"):
        run_probes(model, tok, [KVMethod()], {}, filler, 2, PAPER.with_(sink_tokens=256, recent_tokens=256))


def test_eval_probes_flag_reports_both_probes(tmp_path, monkeypatch, capsys, torch_backend):
    import json

    from cli_helpers import run_cli
    from transformers import AutoConfig

    from oscar_calib.demo import FIXTURE_MODEL_ID
    from runtime_kernels.artifact import write_artifact

    cfg = AutoConfig.from_pretrained(FIXTURE_DIR)
    art = identity_artifact(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim,
                            model_id=FIXTURE_MODEL_ID, fmt=PAPER.with_(sink_tokens=SINK, recent_tokens=RECENT))
    write_artifact(art, tmp_path / "id")
    code, _, err = run_cli(["eval", "--artifact", str(tmp_path / "id"), "--context", "512", "--max-windows", "2",
                            "--generation-steps", "0", "--probes", "2", "--methods", "bf16,oscar-head",
                            "--json-out", str(tmp_path / "r.json")], monkeypatch, capsys)
    assert code == 0, err
    probes = json.loads((tmp_path / "r.json").read_text())["probes"]
    assert set(probes["passkey"]) == {"bf16", "oscar-head"} and probes["needles"] == 2
    assert set(probes["verbatim"]) == {"bf16", "oscar-head"}
    assert (probes["sink"], probes["recent"]) == (SINK, RECENT)
    code, _, err = run_cli(["eval", "--artifact", str(tmp_path / "id"), "--context", "512", "--probes", "-1"],
                           monkeypatch, capsys)
    assert code == 2 and "--probes -1" in err
