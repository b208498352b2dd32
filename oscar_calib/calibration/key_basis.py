"""Where keys take the Hadamard rotation instead of the attention-aware one: the KV heads that read the INT2 history.

The attention-aware key basis (`R = U H P` of the query-moment target) spends its precision on the directions the
*average* calibration query reads. Key error reaches a query only through the attention it puts on the INT2
history (the tokens neither BF16 window keeps), and a retrieval query, which is not average, reads that history
hardest. On SmolLM2-135M at its 8K context the layers whose attention-aware keys cost passkey retrieval are among
those whose queries put the most attention on the history (docs/recipe.md, the history-mass table); the Hadamard
rotation, which spreads the error evenly over every direction, buys retrieval back there. So each KV head whose
held-out queries (its GQA group's) put more than a threshold of their attention on the history takes the Hadamard
key rotation, with key clips fitted for it like any other; its values and every other head keep their bases.
Heads, not layers: within a layer the masses differ by up to 2x, and a swap costs perplexity wherever it is made.
"""

from __future__ import annotations

import torch


def history_share(scores: torch.Tensor, positions: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Each query's causal softmax weight on the INT2 history: `scores` `[..., m, T]` (scaled logits of queries at
    `positions` `[m]` against keys 0..T-1) -> `[..., m]`, the weight on keys at `[sink, p + 1 - recent)`.
    The one definition of the history mass (`oscar-calib audit` reports it per head too)."""
    tokens = torch.arange(scores.shape[-1], device=scores.device)
    p = positions.to(scores.device)[:, None]
    probs = scores.masked_fill(tokens > p, float("-inf")).softmax(-1)
    return (probs * ((tokens >= sink) & (tokens < p + 1 - recent))).sum(-1)


def holdout_history_mass(keys: torch.Tensor, queries: torch.Tensor, positions: torch.Tensor, scaling: float,
                         sink: int, recent: int) -> torch.Tensor | None:
    """Each KV head's mean share of attention on the INT2 history, over its held-out queries that have one.

    A query at position p attends causally (softmax of `scaling * q . k` over keys 0..p); its history mass is the
    weight on keys at `[sink, p + 1 - recent)`. Queries with p < sink + recent have no history and are left out.

    Args:
        keys: `[S, H_kv, T, d]` held-out keys (post-RoPE, as attention sees them).
        queries: `[S, H_q, n, d]` held-out queries at `positions` `[S, n]`; H_q is a multiple of H_kv (GQA groups
            are consecutive query heads).
    Returns:
        `[H_kv]` float64, or None when no held-out query has a history (the sequence fits in the windows).
    """
    s, h_kv, _, _ = keys.shape
    group = queries.shape[1] // h_kv
    total = torch.zeros(h_kv, dtype=torch.float64)
    count = 0
    for i in range(s):
        has = positions[i] >= sink + recent
        if not bool(has.any()):
            continue
        for h in range(h_kv):  # one KV head at a time: [G, m, T] scores stay small at long context
            q = queries[i, h * group:(h + 1) * group][:, has.to(queries.device)].float()
            scores = torch.einsum("gmd,td->gmt", q, keys[i, h].float()) * scaling
            total[h] += float(history_share(scores, positions[i][has], sink, recent).double().sum())
        count += int(has.sum()) * group
    return total / count if count else None


def hadamard_key_heads(masses: dict[int, torch.Tensor | None], threshold: float,
                       granularity: str = "head") -> dict[int, list[int]]:
    """`{layer: [KV heads]}` (ascending, layers with none left out) whose history mass (`masses[layer]` `[H_kv]`)
    exceeds `threshold`. A layer without a history (None) keeps the attention-aware basis. With `granularity`
    "layer" (one rotation per layer) a layer swaps all its heads or none, by the mean of its heads' masses."""
    out = {}
    for layer in sorted(masses):
        m = masses[layer]
        if m is not None and granularity == "layer":
            m = m.mean().expand_as(m)
        heads = [] if m is None else [int(h) for h in (m > threshold).nonzero().flatten()]
        if heads:
            out[layer] = heads
    return out

