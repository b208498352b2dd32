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


@triton.jit
def _load_part(ptrs, mask, other, CG: tl.constexpr):
    """Masked load of partials; CG: read past the SM's L1 (`.cg`), for partials written by other programs of the
    same launch (L1 is not coherent across SMs)."""
    if CG:
        x = tl.load(ptrs, mask=mask, other=other, cache_modifier=".cg")
    else:
        x = tl.load(ptrs, mask=mask, other=other)
    return x


@triton.jit
def _reduce_rows(op_base, stride_oh, stride_os, lp_base, stride_lh, o_base, lse_base, S, d0,
                 GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, D_BLK: tl.constexpr,
                 S_BLOCK: tl.constexpr, S_MAX: tl.constexpr, CG: tl.constexpr):
    """Merge the S partials of GROUP rows, channels `[d0, d0 + D_BLK)`: row g's partial s is o at `op_base +
    g * stride_oh + s * stride_os + d` and lse at `lp_base + g * stride_lh + s` -> o at `o_base + g * D + d` and
    lse at `lse_base + g` (written by the d0 == 0 program). Each round loads `[GP, S_BLOCK, D_BLK]` partials.
    The split reduce kernel runs it per (row, channel block); the fused decode kernel's last program per KV head
    runs it for the GROUP query heads at once with CG (partials of the same launch)."""
    offs_g = tl.arange(0, GP)
    g_ok = offs_g < GROUP
    offs_d = d0 + tl.arange(0, D_BLK)
    d_ok = offs_d < D
    offs_s = tl.arange(0, S_MAX)
    lse_all = _load_part(lp_base + offs_g[:, None] * stride_lh + offs_s[None, :],
                         g_ok[:, None] & (offs_s < S)[None, :], float("-inf"), CG)  # [GP, S_MAX]
    m = tl.max(lse_all, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.sum(tl.exp(lse_all - m_safe[:, None]), axis=1)
    acc = tl.zeros([GP, D_BLK], tl.float32)
    for s0 in range(0, S, S_BLOCK):
        offs = s0 + tl.arange(0, S_BLOCK)
        gs_ok = g_ok[:, None] & (offs < S)[None, :]
        w = tl.exp(_load_part(lp_base + offs_g[:, None] * stride_lh + offs[None, :], gs_ok, float("-inf"), CG)
                   - m_safe[:, None])  # [GP, S_BLOCK]
        o = _load_part(op_base + offs_g[:, None, None] * stride_oh + offs[None, :, None] * stride_os
                       + offs_d[None, None, :], gs_ok[:, :, None] & d_ok[None, None, :], 0.0, CG)
        acc += tl.sum(w[:, :, None] * o, axis=1)
    inv = tl.where(tot > 0.0, 1.0 / tl.where(tot > 0.0, tot, 1.0), 0.0)
    tl.store(o_base + offs_g[:, None] * D + offs_d[None, :], acc * inv[:, None], mask=g_ok[:, None] & d_ok[None, :])
    if d0 == 0:
        tl.store(lse_base + offs_g,
                 tl.where(tot > 0.0, m_safe + tl.log(tl.where(tot > 0.0, tot, 1.0)), float("-inf")), mask=g_ok)


@triton.jit(do_not_specialize=["S"])
def _reduce_splits_kernel(op_ptr, lp_ptr, o_ptr, lse_ptr, S,
                          D: tl.constexpr, D_BLK: tl.constexpr, S_BLOCK: tl.constexpr, S_MAX: tl.constexpr):
    # Program (row, channel block): row = (batch, query head); o_part / lse_part are contiguous [rows, S, D] /
    # [rows, S]. Channel blocks of 32 give 4x the programs of one per row at d = 128, and each program reads
    # 64 partials per round: at 128K / batch 1 (32 rows of 203 splits) the reduce went from 0.0150 to 0.0049 ms
    # (bench/results/graph_parts_v8_NVIDIA_H200.txt).
    row = tl.program_id(0).to(tl.int64)
    _reduce_rows(op_ptr + row * S * D, S * D, D, lp_ptr + row * S, S, o_ptr + row * D, lse_ptr + row, S,
                 tl.program_id(1) * D_BLK, 1, 1, D, D_BLK, S_BLOCK, S_MAX, False)


def reduce_splits_triton(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reduce_splits_torch` (contiguous fp32 inputs); one launch for all rows."""
    b, h, s, d = o_part.shape
    o = torch.empty(b, h, d, dtype=torch.float32, device=o_part.device)
    lse = torch.empty(b, h, dtype=torch.float32, device=o_part.device)
    d_blk = min(32, triton.next_power_of_2(d))
    _reduce_splits_kernel[(b * h, triton.cdiv(d, d_blk))](
        o_part, lse_part, o, lse, s, D=d, D_BLK=d_blk, S_BLOCK=min(64, triton.next_power_of_2(s)),
        S_MAX=triton.next_power_of_2(s), num_warps=4)
    return o, lse
