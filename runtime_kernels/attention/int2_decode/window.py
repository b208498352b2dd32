"""Split-K decode attention over the full-precision (BF16) sink + recent window of each sequence.

Grid `(B, H_kv, num_splits)`; program `(b, h, s)` reads a chunk of rows `[0, win_len[b])` of window slot
`slot_ids[b]`, KV head h, once for all `GROUP` query heads (one `tl.dot` with `G_PAD >= 16` rows) and writes
its normalised partial output and log-sum-exp at split index `split_offset + s` of the shared partial
buffers, so the INT2 history and the window are combined by one reduce (`merge.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime_kernels.attention.int2_decode.common import _chunk_bounds, _dot, _softmax_finish
from runtime_kernels.launch_util import interpreting, next_pow2


@triton.jit(do_not_specialize=["split_offset"])
def _window_decode_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, o_ptr, lse_ptr,
    qk_scale, split_offset,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kr,
    stride_vs, stride_vh, stride_vr,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, FP32: tl.constexpr, INTERP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    n_split = tl.num_programs(2)
    start, end = _chunk_bounds(len_ptr, b, sp, n_split, BLOCK_N)
    slot = tl.load(slot_ptr + b).to(tl.int64)

    offs_g = tl.arange(0, G_PAD)
    g_ok = offs_g < GROUP
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    qm = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=qm, other=0.0)
    kdt = k_ptr.dtype.element_ty
    q = q.to(kdt)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    k_base = k_ptr + slot * stride_ks + h * stride_kh
    v_base = v_ptr + slot * stride_vs + h * stride_vh
    for t0 in range(start, end, BLOCK_N):
        t = t0 + offs_n
        t_ok = t < end
        m2 = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + t[:, None].to(tl.int64) * stride_kr + offs_d[None, :], mask=m2, other=0.0)
        v = tl.load(v_base + t[:, None].to(tl.int64) * stride_vr + offs_d[None, :], mask=m2, other=0.0)
        s = _dot(q, tl.trans(k), FP32, INTERP) * qk_scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32, INTERP)
        m_i = m_new

    inv, lse = _softmax_finish(m_i, l_i)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + (h * GROUP + offs_g)[:, None] * stride_oh
             + (split_offset + sp) * stride_os + offs_d[None, :], acc * inv[:, None], mask=qm)
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + (h * GROUP + offs_g) * stride_lh + split_offset + sp,
             lse, mask=g_ok)


def launch_window_decode(q, k_win, v_win, slot_ids, win_len, o_part, lse_part, sm_scale: float, num_splits: int,
                         split_offset: int = 0, block_n: int = 64, num_warps: int = 4, num_stages: int = 2) -> None:
    """Write window partials into splits `[split_offset, split_offset + num_splits)` of `o_part [B, H_q, S, d]`
    and `lse_part [B, H_q, S]` (fp32). q `[B, H_q, d]`; k_win, v_win `[num_slots, H_kv, W, d]` (same dtype);
    slot_ids, win_len int `[B]`. Inputs are validated by the functional API."""
    b, h_q, d = q.shape
    h_kv = k_win.shape[1]
    group = h_q // h_kv
    _window_decode_kernel[(b, h_kv, num_splits)](
        q, k_win, v_win, slot_ids, win_len, o_part, lse_part,
        sm_scale * 1.4426950408889634, split_offset,
        q.stride(0), q.stride(1),
        k_win.stride(0), k_win.stride(1), k_win.stride(2),
        v_win.stride(0), v_win.stride(1), v_win.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        GROUP=group, G_PAD=max(16, next_pow2(group)), D=d, D_PAD=max(16, next_pow2(d)),
        BLOCK_N=block_n, FP32=k_win.dtype.itemsize == 4, INTERP=interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )


@triton.jit
def _window_chunk_t(
    q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, o_ptr, lse_ptr,
    qk_scale, split_offset,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kr,
    stride_vs, stride_vh, stride_vr,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    b, h, sp, n_split,
    GROUP: tl.constexpr, NC: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One window chunk for the fused decode kernel, shaped for a single warp: tokens on the MMA rows of the score
    dot (`S^T [BLOCK_N, NC] = K @ q^T`, NC >= 8 query-head columns, zero queries past GROUP) and channels on the
    rows of the output (`O^T [D_PAD, NC] += V^T @ P`), so nothing is padded to 16 heads and the accumulator is
    32 registers at d = 128. Tiles are loaded straight into registers (`num_stages=1`): multi-buffering 16-token
    BF16 tiles would need more shared memory than the whole INT2 loop and cut the kernel's occupancy.
    Same inputs and outputs as `_window_decode_kernel` (half windows and queries only)."""
    start, end = _chunk_bounds(len_ptr, b, sp, n_split, BLOCK_N)
    slot = tl.load(slot_ptr + b).to(tl.int64)

    offs_c = tl.arange(0, NC)
    c_ok = offs_c < GROUP
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    kdt = k_ptr.dtype.element_ty
    q_t = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + offs_c)[None, :] * stride_qh + offs_d[:, None],
                  mask=d_ok[:, None] & c_ok[None, :], other=0.0).to(kdt)  # [D_PAD, NC]

    m_i = tl.full([NC], float("-inf"), tl.float32)
    l_i = tl.zeros([NC], tl.float32)
    acc = tl.zeros([D_PAD, NC], tl.float32)
    k_base = k_ptr + slot * stride_ks + h * stride_kh
    v_base = v_ptr + slot * stride_vs + h * stride_vh
    for t0 in tl.range(start, end, BLOCK_N, num_stages=1):
        t = t0 + offs_n
        t_ok = t < end
        k = tl.load(k_base + t[:, None].to(tl.int64) * stride_kr + offs_d[None, :],
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D_PAD]
        v_t = tl.load(v_base + t[None, :].to(tl.int64) * stride_vr + offs_d[:, None],
                      mask=d_ok[:, None] & t_ok[None, :], other=0.0)  # [D_PAD, BLOCK_N]
        s = _dot(k, q_t, False, INTERP) * qk_scale
        s = tl.where(t_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha[None, :] + _dot(v_t, p.to(kdt), False, INTERP)
        m_i = m_new

    inv, lse = _softmax_finish(m_i, l_i)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + (h * GROUP + offs_c)[None, :] * stride_oh
             + (split_offset + sp) * stride_os + offs_d[:, None], acc * inv[None, :],
             mask=d_ok[:, None] & c_ok[None, :])
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + (h * GROUP + offs_c) * stride_lh + split_offset + sp, lse,
             mask=c_ok)
