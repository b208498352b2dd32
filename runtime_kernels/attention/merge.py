"""Exact log-sum-exp merge of partial attention results: a torch pairwise merge and a Triton split reduce.

For partials `(o_s, lse_s)` of disjoint key sets, the attention over their union is
    m = max_s lse_s,  w_s = exp(lse_s - m),  o = sum_s w_s o_s / sum_s w_s,  lse = m + log(sum_s w_s).
Empty partials carry `lse = -inf` (weight 0); when every partial is empty the result is `o = 0, lse = -inf`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def merge_pair(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
               lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials: o `[..., d]`, lse `[...]` each -> (o fp32 `[..., d]`, lse fp32 `[...]`)."""
    lse_a = lse_a.float()
    lse_b = lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a = torch.exp(lse_a - m_safe)
    w_b = torch.exp(lse_b - m_safe)
    tot = w_a + w_b
    o = (w_a.unsqueeze(-1) * o_a.float() + w_b.unsqueeze(-1) * o_b.float()) / tot.clamp_min(1e-30).unsqueeze(-1)
    lse = torch.where(tot > 0, m_safe + torch.log(tot), torch.full_like(tot, float("-inf")))
    return o, lse


def reduce_splits_torch(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge along the split axis: o_part `[B, H, S, d]`, lse_part `[B, H, S]` -> (o `[B, H, d]`, lse `[B, H]`)."""
    m = lse_part.amax(dim=-1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_part - m_safe.unsqueeze(-1))
    tot = w.sum(dim=-1)
    o = (w.unsqueeze(-1) * o_part).sum(dim=-2) / tot.clamp_min(1e-30).unsqueeze(-1)
    lse = torch.where(tot > 0, m_safe + torch.log(tot), torch.full_like(tot, float("-inf")))
    return o, lse


@triton.jit(do_not_specialize=["S"])
def _reduce_splits_kernel(op_ptr, lp_ptr, o_ptr, lse_ptr, S,
                          D: tl.constexpr, D_PAD: tl.constexpr, S_BLOCK: tl.constexpr, S_MAX: tl.constexpr):
    # One program per (batch, query head) row; o_part / lse_part are contiguous [rows, S, D] / [rows, S].
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_s = tl.arange(0, S_MAX)
    lse_all = tl.load(lp_ptr + row * S + offs_s, mask=offs_s < S, other=float("-inf"))
    m = tl.max(lse_all, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.sum(tl.exp(lse_all - m_safe), axis=0)
    acc = tl.zeros([D_PAD], tl.float32)
    for s0 in range(0, S, S_BLOCK):
        offs = s0 + tl.arange(0, S_BLOCK)
        s_ok = offs < S
        w = tl.exp(tl.load(lp_ptr + row * S + offs, mask=s_ok, other=float("-inf")) - m_safe)
        o = tl.load(op_ptr + row * S * D + offs[:, None] * D + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
    inv = tl.where(tot > 0.0, 1.0 / tl.where(tot > 0.0, tot, 1.0), 0.0)
    tl.store(o_ptr + row * D + offs_d, acc * inv, mask=d_ok)
    tl.store(lse_ptr + row, tl.where(tot > 0.0, m_safe + tl.log(tl.where(tot > 0.0, tot, 1.0)), float("-inf")))


def reduce_splits_triton(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reduce_splits_torch` (contiguous fp32 inputs); one launch for all rows."""
    b, h, s, d = o_part.shape
    o = torch.empty(b, h, d, dtype=torch.float32, device=o_part.device)
    lse = torch.empty(b, h, dtype=torch.float32, device=o_part.device)
    _reduce_splits_kernel[(b * h,)](o_part, lse_part, o, lse, s, D=d, D_PAD=triton.next_power_of_2(d),
                                    S_BLOCK=min(16, triton.next_power_of_2(s)),
                                    S_MAX=triton.next_power_of_2(s), num_warps=4)
    return o, lse
