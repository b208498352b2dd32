"""History and window programs in one grid, optionally with the split reduce in the same launch.

Grid `(B, H_kv, S_H + S_W)`. Program `(b, h, s)` with `s < S_H` runs chunk s of the INT2 history
(`kernel._int2_chunk`), the others run a chunk of the window (`window._window_chunk_t`); each writes its partial
(o, lse) to split s of the shared buffers. The window programs come last in the grid, so they fill the slots the
INT2 wave leaves free.

MERGE (the one-launch form, for eager callers whose time is host launch overhead): each program then counts itself in
`counters[b * H_kv + h]` (atomic, acquire-release at GPU scope, after a barrier so that the whole program's stores
are released), and the program that arrives last merges the partials of the GROUP query heads
(`merge._reduce_group`, reading through L2) and resets the counter to 0, so the buffer is ready for the next call
without a memset (also under CUDA graph replay). `counters` is shared state: calls that may run at the same time
(other streams) need their own buffer. Without MERGE (the two-launch form, faster under CUDA graphs),
`merge.reduce_splits_triton` follows.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from runtime_kernels.attention.int2_decode import merge as _merge
from runtime_kernels.attention.int2_decode.kernel import _int2_chunk
from runtime_kernels.attention.int2_decode.window import _window_chunk_t


@triton.jit(do_not_specialize=["s_hist"])
def _decode_grid_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr,
    kw_ptr, vw_ptr, slot_ptr, wlen_ptr,
    op_ptr, lp_ptr, o_ptr, lse_ptr, cnt_ptr, km_ptr, vm_ptr,
    qk_scale, s_hist,
    stride_qb, stride_qh,
    # Pool strides are compile-time constants (see `kernel._int2_decode_kernel`).
    stride_kcp: tl.constexpr, stride_kch: tl.constexpr, stride_kcr: tl.constexpr,
    stride_ksp: tl.constexpr, stride_ksh: tl.constexpr, stride_ksr: tl.constexpr,
    stride_vcp: tl.constexpr, stride_vch: tl.constexpr, stride_vcr: tl.constexpr,
    stride_vsp: tl.constexpr, stride_vsh: tl.constexpr, stride_vsr: tl.constexpr,
    stride_btb,
    stride_wks, stride_wkh, stride_wkr,
    stride_wvs, stride_wvh, stride_wvr,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, GP: tl.constexpr, Q: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr,
    P: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, NPV: tl.constexpr, FULL_TILES: tl.constexpr,
    SZ: tl.constexpr, KI8: tl.constexpr, CENTER: tl.constexpr, PF: tl.constexpr,
    NC: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_W: tl.constexpr,
    S_BLOCK: tl.constexpr, S_MAX: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr,
):
    # op/lp: fp32 partials `[B, H_q, S, d]` / `[B, H_q, S]` (lse contiguous along S); o/lse: fp32 `[B, H_q, d]` /
    # `[B, H_q]`, contiguous; cnt: int32 `[>= B * H_kv]`, zero between calls (MERGE only).
    if PDL:  # the split reduce is launched as a programmatic dependent: it may be scheduled once every program began
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_all = tl.num_programs(2)
    sp = tl.program_id(2)
    if sp < s_hist:
        _int2_chunk(
            q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, op_ptr, lp_ptr, qk_scale, 0,
            stride_qb, stride_qh, stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
            stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, stride_btb,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
            b, h, sp, s_hist, km_ptr, vm_ptr,
            GROUP, GP, Q, U, U_PAD, P, BLOCK_N, INTERP, NPV, FULL_TILES, SZ, KI8, CENTER, PF)
    else:
        _window_chunk_t(
            q_ptr, kw_ptr, vw_ptr, slot_ptr, wlen_ptr, op_ptr, lp_ptr, qk_scale, s_hist,
            stride_qb, stride_qh, stride_wks, stride_wkh, stride_wkr, stride_wvs, stride_wvh, stride_wvr,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
            b, h, sp - s_hist, n_all - s_hist,
            GROUP, NC, D, D_PAD, BLOCK_W, INTERP)

    if MERGE:
        # Every thread's partial stores happen before the barrier; the release half of the atomic then publishes them
        # (cumulativity), and its acquire half makes the other programs' partials visible to the last one.
        tl.debug_barrier()
        cnt = cnt_ptr + b * tl.num_programs(1) + h
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == n_all - 1:
            hq = h * GROUP
            _merge._reduce_group(op_ptr + b.to(tl.int64) * stride_ob + hq * stride_oh, stride_oh, stride_os,
                                 lp_ptr + b.to(tl.int64) * stride_lb + hq * stride_lh, stride_lh,
                                 o_ptr + (b.to(tl.int64) * tl.num_programs(1) * GROUP + hq) * D,
                                 lse_ptr + b.to(tl.int64) * tl.num_programs(1) * GROUP + hq,
                                 n_all, GROUP, GP, D, D_PAD, S_BLOCK, S_MAX)
            tl.store(cnt, 0)
