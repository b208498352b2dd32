"""One owner for attention interception: a model's attention runs through a function of ours for one `with` block.

transformers (v5) calls each attention layer's function by name from a process-wide registry (`AttentionInterface`);
a model picks the name with `set_attn_implementation`. Capture (statistics), evaluation (fake-quantized KV), the
audit (recorded q/k/v) and the runtime checks (OscarCache) all route attention that way, and all of them through
`AttentionInterception`, which does the whole job as one group (the idea of llm-compressor's `HooksMixin`):

- enter: register `fn` under `name`, and SDPA's mask function under the same name (without one transformers
  silently drops the causal mask); switch the model to `name`.
- exit, also on an exception or KeyboardInterrupt: switch the model back to the implementation it had, and put
  the registry entry back as it was, or retire it when there was none, so that a stray call fails loudly
  instead of feeding a finished session (and the session is not kept alive by the registry).
- nesting is refused: a model already routed through an interception, or a name already in use. Inside, the
  outer routing would silently stop seeing the calls.

Per-use state (a capture session, an evaluation session, the recorded activations) travels with `fn`, bound with
`functools.partial(attention, session)`, never in a module global.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from oscar_calib.errors import InputError


class InterceptionError(RuntimeError):
    """An interception used the wrong way round: nested, re-entered, or its function called after the block."""


class _Routed:
    """What the registry holds under `name` while an interception is active: `fn`, and who owns the entry."""

    def __init__(self, owner: AttentionInterception, fn: Callable):
        self.owner = owner
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class _Retired:
    """What the registry holds under a name after its interception ended, when nothing was registered before."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise InterceptionError(f"attention implementation '{self.name}' was called outside its `with` block; the "
                                "interception that registered it has ended (route the model again to use it)")


def _registry():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return AttentionInterface(), AttentionMaskInterface()


def _current(model: torch.nn.Module) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


def _set(model: torch.nn.Module, name: str) -> None:
    """Switch `model` (and its sub-models) to attention implementation `name`."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - transformers older than the 5.x this project supports
        model.config._attn_implementation = name


def active_interception(model: torch.nn.Module) -> AttentionInterception | None:
    """The interception routing `model` now, or None. Read from the model and the registry (no bookkeeping of
    our own to drift out of step): the model's implementation names an entry that one of ours owns."""
    attention, _ = _registry()
    name = _current(model)
    entry = attention.get(name) if name is not None else None
    return entry.owner if isinstance(entry, _Routed) and entry.owner.active else None


class AttentionInterception:
    """Route `model`'s attention through `fn` under the name `name` for the duration of a `with` block.

    `fn(module, query, key, value, attention_mask, **kwargs) -> (attn_output, weights)` is a transformers
    attention function: query `[B, H_q, T, d]`, key/value `[B, H_kv, S, d]` (post-norm, post-RoPE, not repeated
    for GQA), attn_output `[B, T, H_q, d]`. Bind per-use state with `functools.partial(fn, state)`.

    Use once: `with AttentionInterception(model, "oscar_capture", partial(attention, session)): ...`.
    """

    def __init__(self, model: torch.nn.Module, name: str, fn: Callable):
        if not name or not isinstance(name, str):
            raise ValueError(f"name: expected a non-empty attention implementation name, got {name!r}")
        if not callable(fn):
            raise TypeError(f"fn: expected an attention function, got {type(fn).__name__}")
        self.model = model
        self.name = name
        self.fn = fn
        self.active = False
        self._used = False
        self._previous_impl: str | None = None
        self._previous_entry: Callable | None = None

    def __enter__(self) -> AttentionInterception:
        if self._used:
            raise InterceptionError(f"interception '{self.name}': already used; make a new one for each block")
        attention, masks = _registry()
        outer = active_interception(self.model)
        if outer is not None:
            raise InterceptionError(f"model {type(self.model).__name__}: attention is already routed through "
                                    f"'{outer.name}'; interceptions do not nest (leave that block first)")
        entry = attention.get(self.name)
        if isinstance(entry, _Routed) and entry.owner.active:
            raise InterceptionError(f"attention implementation '{self.name}' is in use by another active "
                                    "interception; interceptions do not nest (leave that block first)")
        self._used = True
        self._previous_impl = _current(self.model) or "sdpa"
        self._previous_entry = entry
        from transformers.masking_utils import sdpa_mask

        type(attention).register(self.name, _Routed(self, self.fn))
        type(masks).register(self.name, sdpa_mask)  # stateless; left registered, as transformers' own are
        self.active = True
        try:
            _set(self.model, self.name)
        except BaseException as exc:
            self._restore()
            if isinstance(exc, Exception):  # transformers raises several types here
                raise InputError(f"model {type(self.model).__name__}: cannot route attention through "
                                 f"AttentionInterface: {exc}") from exc
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        """The model back on its previous implementation, the registry entry back as it was (or retired)."""
        if not self.active:
            return
        attention, _ = _registry()
        try:
            if _current(self.model) != self._previous_impl:
                _set(self.model, self._previous_impl)
        finally:
            self.active = False
            entry = self._previous_entry
            type(attention).register(self.name, entry if entry is not None else _Retired(self.name))
            self._previous_entry = None


__all__ = ["AttentionInterception", "InterceptionError", "active_interception"]
