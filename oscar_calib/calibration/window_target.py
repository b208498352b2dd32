"""A window-aware key target: the query second moment weighted by how much each query reads the INT2 history.

The OSCAR key target `M_h = mean over the group's queries of q^T q` (stats.py) weights every query equally. With
BF16 sink and recent windows, only the attention a query pays to keys in the INT2 history feels key quantization
error: a query near the start of a sequence, or one whose attention sits in its recent window, does not care how the
history is rotated. This module weights each query by its exact attention on INT2 keys:

    M_far[h] = sum_t w_t q_t^T q_t / sum_t w_t,   w_t = sum over INT2 positions j of p_tj      ("mass")
                                                  w_t = sum over INT2 positions j of p_tj^2    ("mass2")

with `p_t = softmax(scale * q_t K^T)` over the causal prefix (exact keys), summed over the query heads of the KV
head's group. `mass2` emphasises peaky attention on a few history keys (retrieval) over diffuse attention.
`uniform` (w_t = 1) is the plain query second moment of the same queries, for comparison.

Which pairs are INT2 follows the clip fit (`clipfit.quantized_pair_mask`): token-granular pages, the query at
position t sees a sequence of t + 1 tokens. Used by `tools/recipe_study.py --window-aware-keys`; no default of the
product reads it.
"""

from __future__ import annotations

import torch

from oscar_calib.errors import InputError
from runtime_kernels.format import KVFormat

WEIGHTINGS = ("mass", "mass2", "uniform")


def far_attention_weights(keys: torch.Tensor, queries: torch.Tensor, positions: torch.Tensor, scaling: float,
                          fmt: KVFormat, weighting: str = "mass") -> torch.Tensor:
    """Each held-out query's weight `w_t` (see the module docstring), float64.

    Args:
        keys: `[S, H_kv, T, d]` exact keys (post-norm, post-RoPE) of S held-out sequences.
        queries: `[S, H_q, n_q, d]` queries at `positions [S, n_q]` (int64, each < T); query head i belongs to KV
            head `i // (H_q // H_kv)`.
        scaling: the attention's logit scale (e.g. `d ** -0.5`).
        fmt: the cache format whose windows decide which keys are INT2.
        weighting: one of WEIGHTINGS.
    Returns:
        `[S, H_kv, g, n_q]` float64 weights, g = H_q // H_kv.
    Raises:
        InputError for an unknown weighting, mismatched shapes, or when no query reads an INT2 key (the windows cover
        every held-out query's prefix): there is nothing to weight by, and falling back to uniform weights would
        silently return a different target.
    """
    if weighting not in WEIGHTINGS:
        raise InputError(f"window-aware key target: weighting '{weighting}', expected one of {', '.join(WEIGHTINGS)}")
    s, h_kv, t, d = keys.shape
    if queries.dim() != 4 or queries.shape[0] != s or queries.shape[3] != d or queries.shape[1] % h_kv:
        raise InputError(f"window-aware key target: queries {tuple(queries.shape)} do not match keys "
                         f"{tuple(keys.shape)} (expected [S, H_q, n_q, d] with H_q a multiple of H_kv)")
    n_q = queries.shape[2]
    if tuple(positions.shape) != (s, n_q):
        raise InputError(f"window-aware key target: positions {tuple(positions.shape)}, expected {(s, n_q)}")
    g = queries.shape[1] // h_kv
    pos = positions.to(keys.device)
    j = torch.arange(t, device=keys.device)
    far = fmt.per_token().is_history(j, pos[..., None] + 1)  # [S, n_q, T], as the clip fit counts INT2 pairs
    if not bool(far.any()):
        raise InputError(
            f"window-aware key target: no held-out query reads an INT2 key (sequence of {t} tokens, query positions "
            f"up to {int(pos.max())}, BF16 windows sink {fmt.sink_tokens} + recent {fmt.recent_tokens}); use a longer "
            "held-out sequence or smaller windows")
    if weighting == "uniform":
        return torch.ones(s, h_kv, g, n_q, dtype=torch.float64, device=keys.device)
    causal = j <= pos[..., None]  # [S, n_q, T]
    out = torch.empty(s, h_kv, g, n_q, dtype=torch.float64, device=keys.device)
    for h in range(h_kv):  # one KV head at a time: scores are [S, g, n_q, T] fp64, not H_kv times that
        k = keys[:, h].double()  # [S, T, d]
        q = queries[:, h * g:(h + 1) * g].double()  # [S, g, n_q, d]
        scores = torch.einsum("sgnd,std->sgnt", q, k) * scaling
        p = torch.softmax(scores.masked_fill(~causal[:, None], float("-inf")), dim=-1)
        p = p if weighting == "mass" else p * p
        out[:, h] = (p * far[:, None]).sum(dim=-1)
    return out


def window_aware_key_target(keys: torch.Tensor, queries: torch.Tensor, positions: torch.Tensor, scaling: float,
                            fmt: KVFormat, weighting: str = "mass") -> torch.Tensor:
    """`M_far[h] = sum_t w_t q_t^T q_t / sum_t w_t` over the group's held-out queries; shapes and weightings as in
    `far_attention_weights`.

    Returns:
        `[H_kv, d, d]` float64 symmetric PSD, on the keys' device (`solve.rotations_from_targets` turns it into `R`).
    Raises:
        InputError as `far_attention_weights`, and when a KV head's weights sum to zero (its queries' attention on
        the history underflows): that head has no window-aware target.
    """
    w = far_attention_weights(keys, queries, positions, scaling, fmt, weighting)  # [S, H_kv, g, n_q]
    s, h_kv, g, n_q = w.shape
    q = queries.double().reshape(s, h_kv, g, n_q, -1)
    total = w.sum(dim=(0, 2, 3))  # [H_kv]
    if not bool((total > 0).all()):
        heads = torch.nonzero(total <= 0).flatten().tolist()
        raise InputError(f"window-aware key target ({weighting}): KV heads {heads} put no attention on INT2 keys")
    return torch.einsum("shgn,shgnd,shgne->hde", w, q, q) / total[:, None, None]


def blend_targets(a: torch.Tensor, b: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """`alpha * a / tr(a) + (1 - alpha) * b / tr(b)` per head, `[..., d, d]` -> `[..., d, d]` float64.

    Each target is normalised by its trace first, so the blend mixes the two *shapes* in the stated proportion
    whatever their scales (the held-out queries' norms need not match the statistics' mean); only the eigenvectors
    and the order of the eigenvalues reach the rotation, so the overall scale is immaterial.
    """
    if not 0.0 <= alpha <= 1.0:
        raise InputError(f"blend_targets: alpha must lie in [0, 1], got {alpha}")
    tr = lambda m: m.double().diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None].clamp_min(1e-300)  # noqa: E731
    return alpha * a.double() / tr(a) + (1 - alpha) * b.double() / tr(b)
