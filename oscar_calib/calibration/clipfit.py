"""Fit clip ratios per (layer, KV head, K/V) on held-out calibration tokens (OSCAR_METHOD section 4).

The error is attention-aware and reproduces what a decoder sees: for a query at position t, keys and
values at positions `< sink` or `> t - recent` stay exact, the others are (centered,) rotated, clipped,
quantized to INT2 and de-rotated (the runtime's quantizer, `runtime_kernels.quant.naive`).

Objectives (`P` the exact causal softmax, `P_hat` with quantized keys on quantized pairs, `O = P V`):
- keys, `attn_kl`: KL(P || P_hat) of each query's attention distribution, averaged over queries;
- keys, `logit_mse`: mean squared logit error `(scale * q . (k_hat - k))^2` over (query, quantized key) pairs;
- keys, `out_err`: relative attention-output error of the key error alone, `|(P_hat - P) V|^2 / |O|^2`;
- values, `out_err`: relative attention-output error `|P_quant (V_hat - V)|^2 / |O|^2`, `P_quant` = `P` on
  quantized pairs.
With `o_weight` (the layer's `o_proj` weight), the output errors are measured after the output projection
(`block_out`): each query head's output error is mapped through its columns of `W_o` and summed over the group,
so an error in a direction `o_proj` ignores costs nothing.

Why the output errors: a clip trades the rounding noise of every entry against a bias on the clipped
entries. The KL of each query's distribution counts both the same, so it keeps asking for more clipping, while
the bias moves outputs coherently across tokens and layers (perplexity). The output error sees that bias in
the attention output itself. `tools/clip_objective_study.py` measures how well each objective ranks methods by
held-out perplexity (docs/quality.md, "Which defaults, and why").

A fit extends its grid below the lowest candidate while the error still falls there, so that no fitted ratio
sits at the edge of what was searched (unless the floor `MIN_RATIO` is reached; `edge` says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from oscar_calib.errors import InputError
from runtime_kernels.format import MIN_CLIP_RATIO, KVFormat
from runtime_kernels.quant import naive

KEY_OBJECTIVES = ("attn_kl", "logit_mse", "out_err", "block_out")
VALUE_OBJECTIVES = ("out_err", "block_out")
MIN_RATIO = MIN_CLIP_RATIO  # never clip more than half of a row's entries (the contract's floor)
EXTEND_STEP = 0.02


@dataclass
class ClipFit:
    """Per-layer fit result. ratios `[H_kv]`; errors `[len(grid), H_kv]` (float64, on CPU) over `k_grid`/`v_grid`.

    `k_edge`/`v_edge` `[H_kv]` bool: the ratio is the lowest candidate searched (the floor was reached).
    """

    k_ratio: torch.Tensor
    v_ratio: torch.Tensor
    k_errors: torch.Tensor
    v_errors: torch.Tensor
    k_grid: tuple[float, ...] = ()
    v_grid: tuple[float, ...] = ()
    k_edge: torch.Tensor | None = None
    v_edge: torch.Tensor | None = None


def quantized_pair_mask(positions: torch.Tensor, seq_len: int, fmt: KVFormat) -> torch.Tensor:
    """bool `[S, n_q, T]`: True where key j of the query at `positions [S, n_q]` is INT2 in the cache of `fmt`.

    Token-granular (`fmt.per_token()`): a pair counts as soon as any page boundary could put the key in the history,
    so the fit scores every pair a decoder ever reads quantized. Raises InputError when no query reads a quantized key
    (the held-out sequence is not longer than the windows): a fit on such data would score pairs the decoder never
    quantizes.
    """
    j = torch.arange(seq_len, device=positions.device)
    mask = fmt.per_token().is_history(j, positions[..., None] + 1)  # the query at t sees a sequence of t + 1 tokens
    if not bool(mask.any()):
        sink, recent = fmt.sink_tokens, fmt.recent_tokens
        raise InputError(
            f"clip fit: the held-out sequence has {seq_len} tokens, not more than the BF16 windows (sink {sink} + "
            f"recent {recent}), so no held-out query reads an INT2 key; use a longer --seq-len (at least "
            f"{sink + recent + 64}) or smaller windows")
    return mask


@dataclass
class _RotatedRows:
    """One side's held-out rows, shared by every candidate clip ratio: x `[S, H, T, d]` fp32 (model basis), and
    xr = `(x - mean) @ rotation` with its sorted magnitudes (rotating and sorting are most of a candidate's cost
    and do not depend on the ratio). rotation `[H, d, d]` fp32; mean `[H, d]` (model basis) or None."""

    x: torch.Tensor
    rotation: torch.Tensor
    mean: torch.Tensor | None
    xr: torch.Tensor

    @cached_property
    def sorted_abs(self) -> torch.Tensor:
        """`|xr|` sorted along d, on first use: a fit with no ratio below 1 never clips, so never sorts."""
        return self.xr.abs().sort(dim=-1).values


def _rotated_rows(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None) -> _RotatedRows:
    xf = x.float()
    xc = xf if mean is None else xf - mean.float()[None, :, None, :]
    xr = torch.einsum("shtd,hde->shte", xc, rotation.float())
    return _RotatedRows(xf, rotation.float(), None if mean is None else mean.float(), xr)


def _quant_error(rows: _RotatedRows, ratio: float | torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """`fq(x - mean) + mean - x` `[S, H, T, d]` fp32, `fq` in the rotated basis and back, encoded as `fmt` does
    (group, scale format, quantizer). ratio: a scalar or per head `[H]`."""
    r = torch.as_tensor(ratio, dtype=torch.float64)
    clip = (r[None, :, None] if r.dim() == 1 else r) if bool((r < 1.0).any()) else None
    codes, scale, zero = naive.quantize_rows(rows.xr, clip, fmt, sorted_abs=None if clip is None else rows.sorted_abs)
    out = torch.einsum("shte,hde->shtd", naive.dequantize(codes, scale, zero, fmt), rows.rotation)
    return (out if rows.mean is None else out + rows.mean[None, :, None, :]) - rows.x


@dataclass
class _HeldOut:
    """Exact attention of the held-out queries, shared by every candidate ratio."""

    q: torch.Tensor  # [S, H, g*n_q, d]
    k: torch.Tensor  # [S, H, T, d]
    v: torch.Tensor
    qmask: torch.Tensor  # [S, H, g*n_q, T] bool, INT2 pairs
    probs_q: torch.Tensor  # probs on the INT2 pairs (0 elsewhere): what a value error is weighted by
    scores: torch.Tensor  # masked causal scores
    probs: torch.Tensor
    log_p: torch.Tensor
    out: torch.Tensor  # [S, H, g*n_q, d]
    g: int
    scaling: float
    o_weight: torch.Tensor | None  # [H, g, d, hidden]: W_o's columns of each query head, transposed

    def project(self, delta: torch.Tensor) -> torch.Tensor:
        """Output error `[S, H, g*n_q, d]` -> `[S, H, n_q, hidden]` through o_proj (summed over the group)."""
        s, h, gn, d = delta.shape
        dg = delta.reshape(s, h, self.g, gn // self.g, d)
        return torch.einsum("shgnd,hgdo->shno", dg, self.o_weight)

    @cached_property
    def energy(self) -> torch.Tensor:
        """Denominator `[H]` of the relative output errors (computed once: every candidate divides by it)."""
        ref = self.out if self.o_weight is None else self.project(self.out)
        return ref.pow(2).sum(dim=(0, 2, 3)).clamp_min(1e-30)

    def out_err(self, delta: torch.Tensor) -> torch.Tensor:
        """`[H]` relative output error of an output perturbation `[S, H, g*n_q, d]`."""
        d = delta if self.o_weight is None else self.project(delta)
        return d.pow(2).sum(dim=(0, 2, 3)) / self.energy


def _held_out(keys, values, queries, positions, scaling, fmt: KVFormat, o_weight) -> _HeldOut:
    s, h_kv, t, d = keys.shape
    g = queries.shape[1] // h_kv
    n_q = queries.shape[2]
    k = keys.float()
    v = values.float()
    q = queries.float().reshape(s, h_kv, g * n_q, d)
    pos = positions.to(k.device)
    qmask = quantized_pair_mask(pos, t, fmt)  # [S, n_q, T]
    qmask = qmask[:, None, None].expand(s, h_kv, g, n_q, t).reshape(s, h_kv, g * n_q, t)
    causal = (torch.arange(t, device=k.device) <= pos[..., None])[:, None, None]
    causal = causal.expand(s, h_kv, g, n_q, t).reshape(s, h_kv, g * n_q, t)
    scores = (torch.einsum("shqd,shtd->shqt", q, k) * scaling).masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    w = None
    if o_weight is not None:
        # o_proj weight [hidden, H_q * d]: query head i reads columns [i*d, (i+1)*d).
        w = o_weight.float().to(k.device).reshape(-1, h_kv, g, d).permute(1, 2, 3, 0).contiguous()
    return _HeldOut(q, k, v, qmask, probs * qmask, scores, probs, torch.log_softmax(scores, dim=-1),
                    torch.einsum("shqt,shtd->shqd", probs, v), g, scaling, w)


def _key_error(ho: _HeldOut, dk: torch.Tensor, objective: str) -> torch.Tensor:
    """`[H]` error of the key perturbation `dk [S, H, T, d]` under `objective`."""
    logit_err = torch.einsum("shqd,shtd->shqt", ho.q, dk) * ho.scaling * ho.qmask
    if objective == "logit_mse":
        return logit_err.pow(2).sum(dim=(0, 2, 3)) / ho.qmask.sum(dim=(0, 2, 3)).clamp_min(1)
    log_p_hat = torch.log_softmax(ho.scores + logit_err, dim=-1)
    if objective == "attn_kl":
        kl = (ho.probs * (ho.log_p - log_p_hat)).nan_to_num(0.0).sum(dim=-1)  # [S, H, g*n_q]
        return kl.sum(dim=(0, 2)) / (kl.shape[0] * kl.shape[2])
    delta = torch.einsum("shqt,shtd->shqd", log_p_hat.exp() - ho.probs, ho.v)
    return ho.out_err(delta)


def _value_error(ho: _HeldOut, dv: torch.Tensor) -> torch.Tensor:
    return ho.out_err(torch.einsum("shqt,shtd->shqd", ho.probs_q, dv))


class _LayerErrors:
    """The held-out attention of one layer and each side's rotated rows, built once and shared by every candidate
    ratio of a fit (its grid extensions included); arguments as in `clip_errors`."""

    def __init__(self, keys, values, queries, positions, k_rotation, v_rotation, scaling: float, fmt: KVFormat,
                 key_objective: str, k_mean=None, v_mean=None, o_weight=None):
        if key_objective not in KEY_OBJECTIVES:
            raise InputError(f"key clip objective '{key_objective}': expected one of {', '.join(KEY_OBJECTIVES)}")
        if key_objective == "block_out" and o_weight is None:
            raise InputError("key clip objective 'block_out' needs the layer's o_proj weight")
        self.ho = _held_out(keys, values, queries, positions, scaling, fmt,
                            o_weight if key_objective == "block_out" else None)
        self.objective = "out_err" if key_objective == "block_out" else key_objective
        self.fmt = fmt
        self.h_kv = keys.shape[1]
        self._sides = {"k": (k_rotation, k_mean), "v": (v_rotation, v_mean)}
        self._rows: dict[str, _RotatedRows] = {}

    def release(self, side: str) -> None:
        """Drop a side's rotated rows once its search is done (they are as large as the held-out keys)."""
        self._rows.pop(side, None)

    def _rotated(self, side: str) -> _RotatedRows:
        if side not in self._rows:
            rotation, mean = self._sides[side]
            self._rows[side] = _rotated_rows(self.ho.k if side == "k" else self.ho.v, rotation, mean)
        return self._rows[side]

    def _stack(self, errs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(errs).double().cpu() if errs else torch.zeros(0, self.h_kv, dtype=torch.float64)

    def keys(self, grid: tuple[float, ...]) -> torch.Tensor:
        """Key errors `[len(grid), H_kv]` float64 (CPU); an empty grid gives `[0, H_kv]`."""
        return self._stack([_key_error(self.ho, _quant_error(self._rotated("k"), r, self.fmt), self.objective)
                            for r in grid])

    def values(self, grid: tuple[float, ...]) -> torch.Tensor:
        """Value errors `[len(grid), H_kv]` float64 (CPU); an empty grid gives `[0, H_kv]`."""
        return self._stack([_value_error(self.ho, _quant_error(self._rotated("v"), r, self.fmt)) for r in grid])


def clip_errors(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, positions: torch.Tensor,
                k_rotation: torch.Tensor, v_rotation: torch.Tensor, grid: tuple[float, ...], scaling: float,
                fmt: KVFormat, key_objective: str = "attn_kl", v_grid: tuple[float, ...] | None = None,
                k_mean: torch.Tensor | None = None, v_mean: torch.Tensor | None = None,
                o_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention-aware errors of every key clip ratio in `grid` and value clip ratio in `v_grid` (default: `grid`).

    Args:
        keys, values: `[S, H_kv, T, d]`; queries `[S, H_q, n_q, d]`; positions `[S, n_q]` int64.
        k_rotation, v_rotation: `[H_kv, d, d]`. k_mean, v_mean: `[H_kv, d]` (model basis) for a centered cache.
        fmt: the cache's KV format: which pairs are INT2 (its windows) and how they are encoded (group, scale
            format, quantizer), so clips are fitted for the stored grid.
        key_objective: one of KEY_OBJECTIVES; `block_out` needs `o_weight` (`[hidden, H_q * d]`), and then the
            value error is measured after o_proj too.
    Returns:
        key errors `[len(grid), H_kv]`, value errors `[len(v_grid), H_kv]`, float64 (on CPU); an empty grid
        skips that side.
    """
    errors = _LayerErrors(keys, values, queries, positions, k_rotation, v_rotation, scaling, fmt, key_objective,
                          k_mean, v_mean, o_weight)
    return errors.keys(grid), errors.values(grid if v_grid is None else v_grid)


def pick_ratios(errors: torch.Tensor, grid: tuple[float, ...]) -> torch.Tensor:
    """Ratio with the lowest error per head (ties go to the larger ratio: clip less). `[H]` float32."""
    grid_t = torch.tensor(grid, dtype=torch.float64)
    # Reverse so that argmin's first-hit rule prefers the larger ratio on exact ties.
    best_rev = torch.argmin(errors.flip(0), dim=0)
    return grid_t.flip(0)[best_rev].float()


def extended_grid(grid: tuple[float, ...], step: float = EXTEND_STEP) -> tuple[float, ...]:
    """`grid` with one more candidate `step` below its lowest (not below MIN_RATIO); unchanged at the floor."""
    low = round(min(grid) - step, 6)
    return grid if low < MIN_RATIO - 1e-9 else tuple(sorted({low, *grid}))


def _fit_one_side(errors_of, grid: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor, tuple, torch.Tensor]:
    """Search `grid`, extending it downward while some head's best ratio is its lowest candidate.

    errors_of(ratios) -> `[len(ratios), H]`. Returns (ratios `[H]`, errors `[len(grid'), H]`, grid', edge `[H]`).
    """
    grid = tuple(sorted(grid))
    errors = errors_of(grid)
    while True:
        ratio = pick_ratios(errors, grid)
        at_edge = ratio == min(grid)
        wider = extended_grid(grid)
        if not bool(at_edge.any()) or wider == grid:
            return ratio, errors, grid, at_edge
        new = tuple(r for r in wider if r not in grid)
        errors = torch.cat([errors_of(new), errors])
        grid = wider


def fit_layer(keys, values, queries, positions, k_rotation, v_rotation, grid, scaling, fmt: KVFormat, *,
              key_objective: str = "attn_kl", v_grid: tuple[float, ...] | None = None,
              k_mean: torch.Tensor | None = None, v_mean: torch.Tensor | None = None,
              o_weight: torch.Tensor | None = None, extend: bool = True) -> ClipFit:
    """Fit K (over `grid`) and V (over `v_grid`, default `grid`) clip ratios of one layer for the cache of `fmt`;
    shapes as in `clip_errors`.

    With `extend`, a grid whose lowest candidate wins for some head is extended downward (EXTEND_STEP at a time,
    down to MIN_RATIO) until the error turns up.
    """
    v_grid = grid if v_grid is None else v_grid
    errors = _LayerErrors(keys, values, queries, positions, k_rotation, v_rotation, scaling, fmt, key_objective,
                          k_mean, v_mean, o_weight)
    if not extend:
        k_err, v_err = errors.keys(grid), errors.values(v_grid)
        kr, vr = pick_ratios(k_err, grid), pick_ratios(v_err, v_grid)
        return ClipFit(kr, vr, k_err, v_err, tuple(grid), tuple(v_grid), kr == min(grid), vr == min(v_grid))
    # Each side searched on its own (the key error does not depend on the value clip, nor the other way round).
    k_fit = _fit_one_side(errors.keys, grid)
    errors.release("k")
    v_fit = _fit_one_side(errors.values, v_grid)
    floor_k = torch.tensor(min(k_fit[2]) <= MIN_RATIO + 1e-9)
    floor_v = torch.tensor(min(v_fit[2]) <= MIN_RATIO + 1e-9)
    return ClipFit(k_fit[0], v_fit[0], k_fit[1], v_fit[1], k_fit[2], v_fit[2], k_fit[3] & floor_k, v_fit[3] & floor_v)
