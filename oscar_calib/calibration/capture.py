"""Capture post-norm, post-RoPE q/k/v of every attention layer through transformers' AttentionInterface.

`capturing` routes the model's attention through `oscar_capture` (an `AttentionInterception`, the one owner of
attention routing) for a `with` block. The function delegates the actual attention to SDPA and hands q, k, v and
the per-head output to the `CaptureSession` bound to it. One forward pass sees every layer; there is no KV cache
during calibration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import torch

from oscar_calib.calibration.stats import LayerStats
from oscar_calib.errors import CaptureError
from oscar_calib.interception import AttentionInterception
from runtime_kernels.artifact import text_config

CAPTURE_NAME = "oscar_capture"


@dataclass
class HoldoutRows:
    """Held-out activations of one layer for fitting clip ratios.

    keys, values `[S, H_kv, T, d]`; queries `[S, H_q, n_q, d]` at sequence positions `positions [S, n_q]`.
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    queries: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.cat(self.keys), torch.cat(self.values), torch.cat(self.queries), torch.cat(self.positions))


class CaptureSession:
    """Receives every attention call of a forward pass and accumulates statistics or held-out rows.

    mode "stats": add q/k/v/out into fp64 `LayerStats`; mode "holdout": keep the keys and values of the
    batch plus the queries at `query_positions`.
    """

    def __init__(self, skip_layers: set[int] | None = None, stats_device: torch.device | str | None = None):
        self.skip_layers = set(skip_layers or ())
        self.stats_device = stats_device
        self.stats: dict[int, LayerStats] = {}
        self.holdout: dict[int, HoldoutRows] = {}
        self.mode = "stats"
        self.query_positions: torch.Tensor | None = None
        self.geometry: tuple[int, int, int] | None = None  # (H_q, H_kv, d)
        self.scaling: float | None = None
        self.calls = 0
        self._finite: list[tuple[int, str, torch.Tensor]] = []

    def check_finite(self) -> None:
        """Raise CaptureError naming the first layer whose captured q/k/v held NaN or Inf."""
        if not self._finite:
            return
        flags = torch.stack([f for _, _, f in self._finite]).cpu()
        entries, self._finite = self._finite, []
        if not bool(flags.all()):
            layer, name, _ = entries[int((~flags).nonzero()[0, 0])]
            raise CaptureError(f"layer {layer}: captured {name} activations contain NaN or Inf "
                               "(check --dtype; float16 overflows on some models)")

    def observe(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, scaling: float | None) -> None:
        """q `[B, H_q, T, d]`, k/v `[B, H_kv, T, d]`, out `[B, H_q, T, d]` (per-head attention output)."""
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise CaptureError(f"attention module {type(module).__name__} has no layer_idx; cannot attribute statistics")
        self.calls += 1
        if layer in self.skip_layers:
            return
        if q.shape[-1] != k.shape[-1] or k.shape[-1] != v.shape[-1]:
            raise CaptureError(
                f"layer {layer}: q/k/v head dims differ ({q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}); "
                "only standard multi-head / grouped-query attention is supported (not MLA)")
        if q.shape[1] % k.shape[1]:
            raise CaptureError(f"layer {layer}: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
        # Non-finite checks stay on the device (a host sync per layer would stall the forward pass);
        # `check_finite` reads them once per batch.
        for name, t in (("query", q), ("key", k), ("value", v)):
            self._finite.append((layer, name, torch.isfinite(t).all()))
        self.geometry = (q.shape[1], k.shape[1], q.shape[-1])
        self.scaling = scaling if scaling is not None else q.shape[-1] ** -0.5
        if self.mode == "stats":
            if layer not in self.stats:
                dev = self.stats_device or q.device
                self.stats[layer] = LayerStats.zeros(k.shape[1], k.shape[-1], device=dev)
            dev = self.stats[layer].key_sum.device
            self.stats[layer].update(q.to(dev), k.to(dev), v.to(dev), out.to(dev))
        elif self.mode == "holdout":
            pos = self.query_positions
            rows = self.holdout.setdefault(layer, HoldoutRows())
            rows.keys.append(k.detach().clone())
            rows.values.append(v.detach().clone())
            rows.queries.append(q[:, :, pos.to(q.device)].detach().clone())
            rows.positions.append(pos.expand(q.shape[0], -1).clone())


def _capture_attention(session: CaptureSession, module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The routed attention function: SDPA, then report the tensors to `session` (bound by `capturing`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    session.observe(module, query, key, value, out.transpose(1, 2), scaling)
    return out, weights


def unsupported_attention_reason(config) -> str | None:
    """Why a config's attention cannot be calibrated (MLA, no heads), or None if it looks supported."""
    cfg = text_config(config)
    if getattr(cfg, "kv_lora_rank", None) or getattr(cfg, "q_lora_rank", None):
        return (f"model_type '{cfg.model_type}' uses multi-head latent attention (MLA); "
                "OSCAR needs per-head keys and values (standard MHA/GQA)")
    if not getattr(cfg, "num_attention_heads", None):
        return f"model_type '{cfg.model_type}' has no num_attention_heads in its config"
    return None


def sliding_window_layers(config) -> set[int]:
    """Decoder layers whose attention is sliding-window (skipped: their KV cache is already bounded)."""
    cfg = text_config(config)
    layer_types = getattr(cfg, "layer_types", None)
    n = cfg.num_hidden_layers
    if layer_types:
        return {i for i, t in enumerate(layer_types) if t != "full_attention"}
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return set(range(n))
    return set()


@contextlib.contextmanager
def capturing(model: torch.nn.Module, session: CaptureSession) -> Iterator[CaptureSession]:
    """Route `model`'s attention through the capture function, reporting to `session`, for the block.

    The previous attention implementation is restored afterwards, also on error; nesting is refused
    (`oscar_calib.interception`).
    """
    with AttentionInterception(model, CAPTURE_NAME, partial(_capture_attention, session)):
        yield session


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The base decoder of a causal LM (skips the LM head: calibration never needs logits)."""
    prefix = getattr(model, "base_model_prefix", "model")
    return getattr(model, prefix, model)


@torch.no_grad()
def forward_batch(model: torch.nn.Module, input_ids: torch.Tensor, session: CaptureSession) -> None:
    """One forward pass through the decoder without a KV cache, inside `capturing(model, session)`; then
    `session.check_finite()`. input_ids `[B, T]`."""
    decoder = decoder_of(model)
    decoder(input_ids=input_ids, use_cache=False)
    session.check_finite()
