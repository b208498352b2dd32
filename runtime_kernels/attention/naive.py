"""Readable torch reference for segment attention with log-sum-exp, and the exact merge (OSCAR_METHOD section 6).

Decode attention over a KV cache is computed per segment (BF16 sink+recent, INT2 history); each
segment returns its partial output `o_s` and `lse_s = log sum_j exp(score_j)`, and
`merge` combines them: `o = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m)` with `m = max_s lse_s`.
An empty segment has `lse = -inf` and contributes nothing.
"""

from __future__ import annotations

import math

import torch


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries over one segment, in fp32, with GQA by head grouping.

    Args:
        q: `[B, H_q, d]` one decode query per sequence.
        k, v: `[B, H_kv, N, d]` the segment's keys and values (already dequantized for INT2 references).
        mask: optional bool `[B, N]`, True where the position is valid (for ragged batches).
    Returns:
        o `[B, H_q, d]` fp32 (zeros where the segment is empty), lse `[B, H_q]` fp32 (-inf where empty).
    """
    b, h_q, d = q.shape
    h_kv, n = k.shape[1], k.shape[2]
    g = h_q // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qg = q.float().reshape(b, h_kv, g, d)
    scores = torch.einsum("bhgd,bhnd->bhgn", qg, k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if n else torch.full((b, h_kv, g), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    probs = torch.nan_to_num(probs, nan=0.0)
    o = torch.einsum("bhgn,bhnd->bhgd", probs, v.float())
    return o.reshape(b, h_q, d), lse.reshape(b, h_q)


def merge(outputs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of partial attention results.

    Args:
        outputs: list of `[..., d]` partial outputs (each already normalised within its segment).
        lses: list of `[...]` log-sum-exp of each segment's scores (-inf for an empty segment).
    Returns:
        o `[..., d]`, lse `[...]` of the union of the segments.
    """
    lse = torch.stack(lses).float()
    m = lse.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # exp(-inf) = 0 for empty segments
    total = w.sum(dim=0)
    o = sum(w_s.unsqueeze(-1) * o_s.float() for w_s, o_s in zip(w, outputs))
    o = o / total.clamp_min(1e-30).unsqueeze(-1)
    return o, m_safe + torch.log(total)
