"""`AttentionInterception`, the one owner of attention routing: the model comes back exactly as it was (also after an
exception or a Ctrl-C inside the block), nesting is refused, and per-use state travels with the function.

The routed function used here scales SDPA's output, so a routing that did not take effect, or was not undone,
shows in the logits; the reference is the same model's forward before any interception."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from format_helpers import PAPER
from tiny_models import tiny_model
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from oscar_calib.analysis.evaluate import EvalSession, evaluating
from oscar_calib.analysis.methods import standard_methods
from oscar_calib.calibration.capture import CaptureSession, capturing
from oscar_calib.errors import InputError
from oscar_calib.interception import AttentionInterception, InterceptionError, active_interception

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def _scaled(calls: list, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA with its output doubled; records the layer of every call in `calls` (the bound per-use state)."""
    calls.append(module.layer_idx)
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
    return 2 * out, weights


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=32, num_layers=3)


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model(input_ids=IDS, use_cache=False).logits


def test_routes_every_layer_then_restores_the_model_bit_for_bit(model):
    before_impl = model.config._attn_implementation
    before = _logits(model)
    calls: list[int] = []
    with AttentionInterception(model, "oscar_test", partial(_scaled, calls)) as icpt:
        assert active_interception(model) is icpt and model.config._attn_implementation == "oscar_test"
        inside = _logits(model)
    assert calls == [0, 1, 2]  # one call per layer, into the state bound to this use
    assert not torch.equal(inside, before)  # the routing took effect
    assert model.config._attn_implementation == before_impl and active_interception(model) is None
    assert torch.equal(_logits(model), before)
    assert calls == [0, 1, 2]  # the finished use sees no more calls


@pytest.mark.parametrize("error", [ValueError("boom"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
def test_restores_after_an_error_inside_the_block(model, error):
    before_impl, before = model.config._attn_implementation, _logits(model)
    with pytest.raises(type(error)):
        with AttentionInterception(model, "oscar_test", partial(_scaled, [])):
            _logits(model)
            raise error
    assert model.config._attn_implementation == before_impl and active_interception(model) is None
    assert torch.equal(_logits(model), before)


def test_the_registry_entry_is_put_back_or_retired(model):
    def own(*args, **kwargs):  # someone else's function registered under the name before us
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("oscar_test_prev", own)
    with AttentionInterception(model, "oscar_test_prev", partial(_scaled, [])):
        assert AttentionInterface()["oscar_test_prev"] is not own
    assert AttentionInterface()["oscar_test_prev"] is own
    with AttentionInterception(model, "oscar_test_new", partial(_scaled, [])):
        pass
    # Nothing was registered before: a stray call after the block fails loudly instead of feeding the old state.
    retired = AttentionInterface()["oscar_test_new"]
    with pytest.raises(InterceptionError, match="'oscar_test_new' was called outside its `with` block"):
        retired(None, None, None, None, None)


def test_nesting_is_refused_and_the_outer_use_keeps_working(model):
    other = tiny_model("llama", num_heads=4, num_kv_heads=2, head_dim=32, num_layers=1)
    calls: list[int] = []
    with AttentionInterception(model, "oscar_outer", partial(_scaled, calls)):
        with pytest.raises(InterceptionError, match="already routed through 'oscar_outer'; interceptions do not nest"):
            with AttentionInterception(model, "oscar_inner", partial(_scaled, [])):
                pass
        with pytest.raises(InterceptionError, match="'oscar_outer' is in use by another active interception"):
            with AttentionInterception(other, "oscar_outer", partial(_scaled, [])):
                pass
        # the refused attempts changed nothing: the outer routing still sees every layer
        _logits(model)
        assert calls == [0, 1, 2] and model.config._attn_implementation == "oscar_outer"
    assert active_interception(model) is None and active_interception(other) is None


def test_capture_inside_evaluation_is_refused(model):
    fmt = PAPER.with_(sink_tokens=2, recent_tokens=2)
    method = standard_methods(32, fmt)[0]
    with evaluating(model, EvalSession(method, fmt)):
        with pytest.raises(InterceptionError, match="interceptions do not nest"):
            with capturing(model, CaptureSession()):
                pass


def test_an_interception_is_used_once(model):
    icpt = AttentionInterception(model, "oscar_test", partial(_scaled, []))
    with icpt:
        pass
    with pytest.raises(InterceptionError, match="already used"):
        with icpt:
            pass


def test_a_model_that_cannot_switch_is_refused_and_left_alone(model, monkeypatch):
    before_impl = model.config._attn_implementation

    def refuse(name):
        raise ValueError(f"{name} is not supported")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    with pytest.raises(InputError, match="cannot route attention through AttentionInterface: oscar_test2 is not"):
        with AttentionInterception(model, "oscar_test2", partial(_scaled, [])):
            pass
    assert model.config._attn_implementation == before_impl and active_interception(model) is None
    with pytest.raises(InterceptionError):  # nothing of the failed use is left registered
        AttentionInterface()["oscar_test2"](None, None, None, None, None)


@pytest.mark.parametrize("name, fn", [("", lambda *a: a), ("x", None)])
def test_bad_arguments_are_named(model, name, fn):
    with pytest.raises((ValueError, TypeError), match="name: expected|fn: expected"):
        AttentionInterception(model, name, fn)
