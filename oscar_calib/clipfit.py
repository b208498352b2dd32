"""Fit clip ratios per (layer, KV head, K/V) on held-out calibration tokens (OSCAR_METHOD section 4).

The error is attention-aware and reproduces what a decoder sees: for a query at position t, keys and
values at positions `< sink` or `> t - recent` stay exact, the others are rotated, clipped, quantized
to INT2 and de-rotated (the runtime's quantizer, `runtime_kernels.quant.naive`).

- key error ("attn_kl", default): KL(P || P_hat) of each query's causal attention distribution, where
  P_hat uses the quantized keys on quantized pairs, averaged over queries; ("logit_mse"): mean squared
  logit error `(scale * q . (k_hat - k))^2` over (query, quantized key) pairs
- value error: relative attention-output error `|P_quant (V_hat - V)|^2 / |P V|^2`, with `P` the exact
  causal softmax and `P_quant` its entries on quantized pairs
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime_kernels.quant import naive


@dataclass
class ClipFit:
    """Per-layer fit result. ratios `[H_kv]`; errors `[len(grid), H_kv]` (float64, on CPU)."""

    k_ratio: torch.Tensor
    v_ratio: torch.Tensor
    k_errors: torch.Tensor
    v_errors: torch.Tensor


def quantized_pair_mask(positions: torch.Tensor, seq_len: int, sink: int, recent: int) -> torch.Tensor:
    """bool `[S, n_q, T]`: True where key j of the query at `positions [S, n_q]` is INT2 in the cache.

    Falls back to "every causal pair" when the windows cover the whole held-out sequence.
    """
    j = torch.arange(seq_len, device=positions.device)
    pos = positions[..., None]
    causal = j <= pos
    mask = causal & (j >= sink) & (j <= pos - recent)
    return mask if bool(mask.any()) else causal


def _fake_quant_rotated(x: torch.Tensor, rotation: torch.Tensor, ratio: float, group_size: int | None) -> torch.Tensor:
    """x `[S, H, T, d]` -> quantize-dequantize in the rotated basis, then back; same shape, fp32."""
    xr = torch.einsum("shtd,hde->shte", x.float(), rotation.float())
    xr = naive.clip_rows(xr, ratio) if ratio < 1.0 else xr
    codes, scale, zero = naive.quantize(xr, group_size)
    xq = naive.dequantize(codes, scale, zero)
    return torch.einsum("shte,hde->shtd", xq, rotation.float())


def clip_errors(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, positions: torch.Tensor,
                k_rotation: torch.Tensor, v_rotation: torch.Tensor, grid: tuple[float, ...], scaling: float,
                group_size: int | None = None, sink: int = 64, recent: int = 256,
                key_objective: str = "attn_kl", v_grid: tuple[float, ...] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention-aware errors of every key clip ratio in `grid` and value clip ratio in `v_grid` (default: `grid`).

    Args:
        keys, values: `[S, H_kv, T, d]`; queries `[S, H_q, n_q, d]`; positions `[S, n_q]` int64.
        k_rotation, v_rotation: `[H_kv, d, d]`.
    Returns:
        key errors `[len(grid), H_kv]`, value errors `[len(v_grid), H_kv]`, float64 (on CPU).
    """
    s, h_kv, t, d = keys.shape
    g = queries.shape[1] // h_kv
    n_q = queries.shape[2]
    k = keys.float()
    v = values.float()
    q = queries.float().reshape(s, h_kv, g * n_q, d)
    pos = positions.to(k.device)
    qmask = quantized_pair_mask(pos, t, sink, recent)  # [S, n_q, T]
    qmask = qmask[:, None, None].expand(s, h_kv, g, n_q, t).reshape(s, h_kv, g * n_q, t)
    causal = (torch.arange(t, device=k.device) <= pos[..., None])[:, None, None]
    causal = causal.expand(s, h_kv, g, n_q, t).reshape(s, h_kv, g * n_q, t)
    scores = torch.einsum("shqd,shtd->shqt", q, k) * scaling
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    exact_out = torch.einsum("shqt,shtd->shqd", probs, v)
    out_energy = exact_out.pow(2).sum(dim=(0, 2, 3)).clamp_min(1e-30)  # [H]
    pair_count = qmask.sum(dim=(0, 2, 3)).clamp_min(1).double()
    p_quant = probs * qmask
    v_grid = grid if v_grid is None else v_grid
    k_err = torch.empty(len(grid), h_kv, dtype=torch.float64)
    v_err = torch.empty(len(v_grid), h_kv, dtype=torch.float64)
    masked_scores = scores.masked_fill(~causal, float("-inf"))
    log_p = torch.log_softmax(masked_scores, dim=-1)
    n_queries = s * g * n_q
    for gi, ratio in enumerate(grid):
        dk = _fake_quant_rotated(k, k_rotation, ratio, group_size) - k
        logit_err = torch.einsum("shqd,shtd->shqt", q, dk) * scaling * qmask
        if key_objective == "logit_mse":
            k_err[gi] = logit_err.pow(2).sum(dim=(0, 2, 3)).double().cpu() / pair_count.cpu()
        else:  # KL(P || P_hat) of each query's attention distribution, averaged over queries
            log_p_hat = torch.log_softmax(masked_scores + logit_err, dim=-1)
            kl = (probs * (log_p - log_p_hat)).nan_to_num(0.0).sum(dim=-1)  # [S, H, g*n_q]
            k_err[gi] = kl.sum(dim=(0, 2)).double().cpu() / n_queries
    for gi, ratio in enumerate(v_grid):
        dv = _fake_quant_rotated(v, v_rotation, ratio, group_size) - v
        out_err = torch.einsum("shqt,shtd->shqd", p_quant, dv)
        v_err[gi] = (out_err.pow(2).sum(dim=(0, 2, 3)) / out_energy).double().cpu()
    return k_err, v_err


def pick_ratios(errors: torch.Tensor, grid: tuple[float, ...]) -> torch.Tensor:
    """Ratio with the lowest error per head (ties go to the larger ratio: clip less). `[H]` float32."""
    grid_t = torch.tensor(grid, dtype=torch.float64)
    # Reverse so that argmin's first-hit rule prefers the larger ratio on exact ties.
    best_rev = torch.argmin(errors.flip(0), dim=0)
    return grid_t.flip(0)[best_rev].float()


def fit_layer(keys, values, queries, positions, k_rotation, v_rotation, grid, scaling, group_size=None,
              sink: int = 64, recent: int = 256, key_objective: str = "attn_kl",
              v_grid: tuple[float, ...] | None = None) -> ClipFit:
    """Fit K (over `grid`) and V (over `v_grid`, default `grid`) clip ratios of one layer; shapes as in `clip_errors`."""
    v_grid = grid if v_grid is None else v_grid
    k_err, v_err = clip_errors(keys, values, queries, positions, k_rotation, v_rotation, grid, scaling,
                               group_size, sink, recent, key_objective, v_grid)
    return ClipFit(pick_ratios(k_err, grid), pick_ratios(v_err, v_grid), k_err, v_err)
