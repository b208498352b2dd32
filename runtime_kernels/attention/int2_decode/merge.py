"""Triton split reduce: the exact log-sum-exp merge of partial attention results (torch versions: `naive.py`).

For partials `(o_s, lse_s)` of disjoint key sets, the attention over their union is
    m = max_s lse_s,  w_s = exp(lse_s - m),  o = sum_s w_s o_s / sum_s w_s,  lse = m + log(sum_s w_s).
Empty partials carry `lse = -inf` (weight 0); when every partial is empty the result is `o = 0, lse = -inf`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from runtime_kernels.launch_util import next_pow2
from runtime_kernels.triton_rounding import store_rounded

__all__ = ["reduce_splits_triton"]

# Launch shapes of `_reduce_unrotate_kernel`, measured on an H200 (docs/kernels.md): partials per round of a program
# (a `[S_BLOCK, D_PAD]` fp32 tile) and its warps. Few rows (batch 1: 32 rows): every column block its own program,
# each re-merging the row (more programs, more of them in flight). Many rows: one program per row, no re-reads
# (4x re-reads of the partials took 21 us at 1024 rows, the separate reduce and rotation 13 us).
_FEW_ROWS = 128
_FEW_ROWS_TILE, _FEW_ROWS_WARPS = 16384, 4
_MANY_ROWS_TILE, _MANY_ROWS_WARPS = 8192, 2


@triton.jit
def _merge_stats(lse, AXIS: tl.constexpr):
    """Max (0 where all partials are empty) and sum of the weights `exp(lse - max)` of partials' lse, along AXIS."""
    m = tl.max(lse, axis=AXIS)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return m_safe, tl.sum(tl.exp(lse - tl.expand_dims(m_safe, AXIS)), axis=AXIS)


@triton.jit
def _merge_finish(m_safe, tot):
    """-> (1 / total weight, merged lse); no partial at all (tot = 0) gives 0 and -inf (o = 0, lse = -inf)."""
    has = tot > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, tot, 1.0), 0.0)
    return inv, tl.where(has, m_safe + tl.log(tl.where(has, tot, 1.0)), float("-inf"))


@triton.jit
def _load_l2(ptrs, mask, other):
    """Masked load that reads past the SM's L1 (`.cg`): for partials written by other programs of the same launch
    (L1 is not coherent across SMs)."""
    return tl.load(ptrs, mask=mask, other=other, cache_modifier=".cg")


@triton.jit
def _merge_channels(op_row, lp_row, S, stride_os, offs_d, d_ok, N_D: tl.constexpr, S_MAX: tl.constexpr,
                    S_BLOCK: tl.constexpr):
    """Merge the S partials of one (batch, query head) row at the N_D channels `offs_d` (valid where d_ok): o at
    `op_row + s * stride_os + d`, lse at `lp_row + s` -> (merged o fp32 `[N_D]`, merged lse), S_BLOCK partials a
    round."""
    offs_s = tl.arange(0, S_MAX)
    m_safe, tot = _merge_stats(tl.load(lp_row + offs_s, mask=offs_s < S, other=float("-inf")), 0)
    acc = tl.zeros([N_D], tl.float32)
    for s0 in range(0, S, S_BLOCK):
        offs = s0 + tl.arange(0, S_BLOCK)
        s_ok = offs < S
        w = tl.exp(tl.load(lp_row + offs, mask=s_ok, other=float("-inf")) - m_safe)
        o = tl.load(op_row + offs[:, None] * stride_os + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
    inv, lse = _merge_finish(m_safe, tot)
    return acc * inv, lse


@triton.jit
def _reduce_row(op_row, lp_row, o_row, lse_row, S, stride_os, d0,
                D: tl.constexpr, D_BLK: tl.constexpr, S_BLOCK: tl.constexpr, S_MAX: tl.constexpr):
    """Merge the S partials of one (batch, query head) row, channels `[d0, d0 + D_BLK)`: o `op_row + s * stride_os
    + d`, lse `lp_row + s` -> o_row `[D]` (those channels), lse_row (fp32, written by the d0 == 0 program)."""
    offs_d = d0 + tl.arange(0, D_BLK)
    d_ok = offs_d < D
    o, lse = _merge_channels(op_row, lp_row, S, stride_os, offs_d, d_ok, D_BLK, S_MAX, S_BLOCK)
    tl.store(o_row + offs_d, o, mask=d_ok)
    if d0 == 0:
        tl.store(lse_row, lse)


@triton.jit
def _reduce_group(op_base, stride_oh, stride_os, lp_base, stride_lh, o_base, lse_base, S,
                  GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                  S_BLOCK: tl.constexpr, S_MAX: tl.constexpr):
    """`_reduce_row` for GROUP rows and all channels at once (query heads g = 0..GROUP-1 at `op_base + g * stride_oh`, lse at
    `lp_base + g * stride_lh + s`; outputs contiguous from o_base / lse_base), reading through L2. Used by the last
    program of a KV head in the fused decode kernel: one warp, so each round loads `[GP, S_BLOCK, D]` partials of
    all heads together (a quarter of the dependent load rounds of four row-by-row merges)."""
    offs_g = tl.arange(0, GP)
    g_ok = offs_g < GROUP
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_s = tl.arange(0, S_MAX)
    m_safe, tot = _merge_stats(_load_l2(lp_base + offs_g[:, None] * stride_lh + offs_s[None, :],
                                        g_ok[:, None] & (offs_s < S)[None, :], float("-inf")), 1)  # [GP]
    acc = tl.zeros([GP, D_PAD], tl.float32)
    for s0 in range(0, S, S_BLOCK):
        offs = s0 + tl.arange(0, S_BLOCK)
        gs_ok = g_ok[:, None] & (offs < S)[None, :]
        w = tl.exp(_load_l2(lp_base + offs_g[:, None] * stride_lh + offs[None, :], gs_ok, float("-inf"))
                   - m_safe[:, None])  # [GP, S_BLOCK]
        o = _load_l2(op_base + offs_g[:, None, None] * stride_oh + offs[None, :, None] * stride_os
                     + offs_d[None, None, :], gs_ok[:, :, None] & d_ok[None, None, :], 0.0)
        acc += tl.sum(w[:, :, None] * o, axis=1)
    inv, lse = _merge_finish(m_safe, tot)
    tl.store(o_base + offs_g[:, None] * D + offs_d[None, :], acc * inv[:, None], mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse_base + offs_g, lse, mask=g_ok)


@triton.jit(do_not_specialize=["S"])
def _reduce_splits_kernel(op_ptr, lp_ptr, o_ptr, lse_ptr, S,
                          D: tl.constexpr, D_BLK: tl.constexpr, S_BLOCK: tl.constexpr, S_MAX: tl.constexpr,
                          PDL: tl.constexpr):
    # Program (row, channel block): row = (batch, query head); o_part / lse_part are contiguous [rows, S, D] /
    # [rows, S]. Channel blocks of 32 give 4x the programs of one per row at d = 128: at 128K / batch 1 (32 rows of
    # 203 splits) the reduce went from 0.0150 to 0.0049 ms (bench/results/graph_parts_v8_NVIDIA_H200.txt). Up to
    # 512 partials per round (one round at every split count the grid launches on an H100 or H200): about 10 % off
    # the whole decode at 128K and 32K x 1 on an H100 against rounds of 64, within 2 % elsewhere; 8-channel blocks
    # were slower at batch 8 and 32 (bench/results/decode_graph_options_NVIDIA_H100.md).
    if PDL:  # launched as a programmatic dependent of the grid: its partials are visible after the wait
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    _reduce_row(op_ptr + row * S * D, lp_ptr + row * S, o_ptr + row * D, lse_ptr + row, S, D,
                tl.program_id(1) * D_BLK, D, D_BLK, S_BLOCK, S_MAX)


@triton.jit(do_not_specialize=["S"])
def _reduce_unrotate_kernel(op_ptr, lp_ptr, r_ptr, o_ptr, lse_ptr, S, stride_rh, stride_ri, stride_rj,
                            H_Q: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                            BLOCK_E: tl.constexpr, E_BLOCKS: tl.constexpr, S_BLOCK: tl.constexpr,
                            S_MAX: tl.constexpr, PDL: tl.constexpr):
    """Program (row, g): row = (batch, query head) of contiguous `o_part [rows, S, D]`, `lse_part [rows, S]`. Merges
    all D channels of the row's S partials (as `_reduce_row`), then stores column blocks `g * E_BLOCKS + k` (k <
    E_BLOCKS; BLOCK_E columns each) of `o @ M` with `M[i, j]` at `r_ptr + h_kv * stride_rh + i * stride_ri + j *
    stride_rj` (R_V^T of the row's KV head: R's strides swapped), fp32 products and sum, rounded once into o_ptr's
    dtype. With E_BLOCKS < D / BLOCK_E several programs re-merge the same row: more programs for a small batch."""
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    eb = tl.program_id(1)
    h_kv = (row % H_Q) // GROUP
    op_row = op_ptr + row * S * D
    lp_row = lp_ptr + row * S
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    o, lse = _merge_channels(op_row, lp_row, S, D, offs_d, d_ok, D_PAD, S_MAX, S_BLOCK)  # [D_PAD] fp32, as `_reduce_row`
    for k in tl.static_range(E_BLOCKS):
        offs_e = (eb * E_BLOCKS + k) * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = offs_e < D
        m = tl.load(r_ptr + h_kv * stride_rh + offs_d[:, None] * stride_ri + offs_e[None, :] * stride_rj,
                    mask=d_ok[:, None] & e_ok[None, :], other=0.0)  # [D_PAD, BLOCK_E] fp32
        store_rounded(o_ptr + row * D + offs_e, tl.sum(o[:, None] * m, axis=0), e_ok)
    if eb == 0:
        tl.store(lse_ptr + row, lse)


def reduce_splits_triton(o_part: torch.Tensor, lse_part: torch.Tensor, v_rotation: torch.Tensor | None = None,
                         out_dtype: torch.dtype = torch.float32, pdl: bool = False, channels: int = 32,
                         rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reduce_splits_torch` (contiguous fp32 inputs); one launch for all rows.

    With `v_rotation` (fp32 `[H_kv, d, d]`) the same launch also takes o back to the model's value basis, `o @
    R_V[h // g]^T` per query head (`attention.unrotate_output`'s math: fp32 products and sum, summed in another
    order), stored in `out_dtype` (fp32, bf16 or fp16); without it o stays fp32 in the rotated basis. lse is fp32.
    `pdl`: launch as a programmatic dependent of the kernel that wrote the partials (a compiled launch on Hopper or
    later): the reduce's programs may start before that kernel ends and wait (`griddepcontrol.wait`) for its memory.
    `channels`, `rows` (powers of two): without `v_rotation`, the channels each program merges and the partials it
    reads per round.
    """
    pdl = bool(pdl) and o_part.is_cuda
    launch = dict(launch_pdl=True) if pdl else {}
    b, h, s, d = o_part.shape
    lse = torch.empty(b, h, dtype=torch.float32, device=o_part.device)
    if v_rotation is not None:
        o = torch.empty(b, h, d, dtype=out_dtype, device=o_part.device)
        d_pad = max(16, next_pow2(d))
        block_e = min(d_pad, 32)
        n_e = triton.cdiv(d, block_e)
        few = b * h < _FEW_ROWS
        tile, warps = (_FEW_ROWS_TILE, _FEW_ROWS_WARPS) if few else (_MANY_ROWS_TILE, _MANY_ROWS_WARPS)
        e_blocks = 1 if few else n_e
        _reduce_unrotate_kernel[(b * h, n_e // e_blocks)](
            o_part, lse_part, v_rotation, o, lse, s,
            v_rotation.stride(0), v_rotation.stride(2), v_rotation.stride(1),  # swapped: M = R^T
            H_Q=h, GROUP=h // v_rotation.shape[0], D=d, D_PAD=d_pad, BLOCK_E=block_e, E_BLOCKS=e_blocks,
            S_BLOCK=max(1, min(next_pow2(s), tile // d_pad)), S_MAX=next_pow2(s), PDL=pdl, num_warps=warps,
            **launch)
        return o, lse
    o = torch.empty(b, h, d, dtype=torch.float32, device=o_part.device)
    d_blk = min(channels, next_pow2(d))
    _reduce_splits_kernel[(b * h, triton.cdiv(d, d_blk))](
        o_part, lse_part, o, lse, s, D=d, D_BLK=d_blk, S_BLOCK=min(rows, next_pow2(s)),
        S_MAX=next_pow2(s), PDL=pdl, num_warps=4, **launch)
    return o, lse
