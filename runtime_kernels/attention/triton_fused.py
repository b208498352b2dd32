"""One launch for a whole decode attention call: INT2 history splits, BF16 window splits and the split reduce.

Grid `(B, H_kv, S_H + S_W)`. Program `(b, h, s)` with `s < S_H` runs chunk s of the INT2 history
(`triton_int2._int2_chunk_t`, impl 6 or 5), the others run a chunk of the window (`triton_window._window_chunk_t`);
each writes its partial (o, lse) to split s of the shared buffers. Then it counts itself in
`counters[b * H_kv + h]` (atomic, acquire-release at GPU scope, after a barrier so that the whole program's stores
are released), and the program that arrives last merges the `S_H + S_W` partials of the GROUP query heads
(`merge._reduce_group`, reading through L2) and resets the counter to 0, so the buffer is ready for the next call
without a memset (also under CUDA graph replay).

Why one launch: an eager call of the three-kernel path spends about 277 us of host time on three Triton launches
(144 us fused), more than the GPU time of the call up to 128K tokens at batch 8
(`bench/results/host_overhead_NVIDIA_H200.txt`). Under CUDA graphs, where host time is gone, the split reduce by
one warp per KV head makes it slower than three launches at batch 1 and 8, so it is opt-in (`fused=True`).
The window programs come last in the grid, so they fill the slots the INT2 wave leaves free and its tail (putting
them first measured no better: 0.2150 vs 0.2125 ms at 128K / batch 8, 0.8234 vs 0.8368 at batch 32).

`counters` is shared state: calls that may run at the same time (other streams) need their own buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime_kernels.attention import merge as _merge
from runtime_kernels.attention import triton_int2 as _int2
from runtime_kernels.attention import triton_window as _window
from runtime_kernels.attention.triton_int2 import INTERPRET
from runtime_kernels.launch_util import next_pow2

WINDOW_BLOCK = 16  # window tile (tokens): the smallest MMA K, so a one-warp tile fits in registers
WINDOW_SPLIT_TOKENS = 32  # tokens per window program: short programs that fill the INT2 wave's free slots
# Window programs first in the grid (dispatched before the history programs) instead of last.
WINDOWS_FIRST = False


@triton.jit
def _stamp(x):
    """(global timer in ns, SM id) where the program reaches this point (GPU only; x only anchors the asm)."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
    return t, sm


@triton.jit(do_not_specialize=["s_hist"])
def _decode_fused_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr,
    kw_ptr, vw_ptr, slot_ptr, wlen_ptr,
    op_ptr, lp_ptr, o_ptr, lse_ptr, cnt_ptr, tl_ptr,
    qk_scale, s_hist,
    stride_qb, stride_qh,
    # Pool strides are compile-time constants: the cache's pools are contiguous, so they follow from the geometry
    # (one compile per model); see `triton_int2._int2_decode_kernel_t`.
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
    P: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, VFOLD: tl.constexpr, TILE_ACC: tl.constexpr,
    SUBN: tl.constexpr, PAGE_VEC: tl.constexpr, NPV: tl.constexpr, FULL_TILES: tl.constexpr,
    NC: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_W: tl.constexpr,
    S_BLOCK: tl.constexpr, S_MAX: tl.constexpr, MERGE: tl.constexpr = True, WIN_FIRST: tl.constexpr = False,
    S_TAIL: tl.constexpr = 0, SPARE_ZERO: tl.constexpr = False, TIMELINE: tl.constexpr = False,
    VPAIR: tl.constexpr = False, KI8: tl.constexpr = False,
):
    # op/lp: fp32 partials `[B, H_q, S, d]` / `[B, H_q, S]` (lse contiguous along S); o/lse: fp32 `[B, H_q, d]` /
    # `[B, H_q]`, contiguous; cnt: int32 `[>= B * H_kv]`, zero between calls. TIMELINE (bench only): tl_ptr is int64
    # `[B, H_kv, S, 4]`, each program writes (start ns, end ns, SM id, 0 history / 1 window / 2 tail) at its
    # grid position.
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_all = tl.num_programs(2)
    if TIMELINE:
        t_start, sm_id = _stamp(b)
    # Program order along the grid's last axis (blocks are dispatched in that order): history splits then window
    # splits, or with WIN_FIRST the window splits first. Partials are stored history first either way.
    if WIN_FIRST:
        sp = (tl.program_id(2) + s_hist) % n_all
    else:
        sp = tl.program_id(2)
    if sp < s_hist:
        # S_TAIL = 1: two-page tiles (BLOCK_N = 2 P) over the whole tiles of the history (`triton_int2.PAIR_TILES`);
        # an odd page left over runs in the last program of the grid.
        _int2._int2_chunk_t(
            q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, op_ptr, lp_ptr, qk_scale, 0,
            stride_qb, stride_qh, stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
            stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, stride_btb,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
            b, h, sp, s_hist,
            GROUP, GP, Q, U, U_PAD, P, BLOCK_N, INTERP, VFOLD, TILE_ACC, SUBN, PAGE_VEC, NPV, FULL_TILES,
            S_TAIL == 1, S_TAIL, SPARE_ZERO=SPARE_ZERO, VPAIR=VPAIR, KI8=KI8)
    elif sp < n_all - S_TAIL:
        _window._window_chunk_t(
            q_ptr, kw_ptr, vw_ptr, slot_ptr, wlen_ptr, op_ptr, lp_ptr, qk_scale, s_hist,
            stride_qb, stride_qh, stride_wks, stride_wkh, stride_wkr, stride_wvs, stride_wvh, stride_wvr,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
            b, h, sp - s_hist, n_all - s_hist - S_TAIL,
            GROUP, NC, D, D_PAD, BLOCK_W, INTERP)
    else:
        if S_TAIL == 1:  # the page after the last whole two-page tile, if the history has an odd page count
            _int2._int2_chunk_t(
                q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, op_ptr, lp_ptr, qk_scale, 0,
                stride_qb, stride_qh, stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
                stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, stride_btb,
                stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                b, h, sp, 1,
                GROUP, GP, Q, U, U_PAD, P, P, INTERP, VFOLD, TILE_ACC, SUBN, True, NPV, True, False, 2,
                SPARE_ZERO=SPARE_ZERO)

    if TIMELINE:
        t_end, sm_id = _stamp(sp)
        rec = tl_ptr + ((b * tl.num_programs(1) + h) * n_all + tl.program_id(2)).to(tl.int64) * 4
        tl.store(rec, t_start)
        tl.store(rec + 1, t_end)
        tl.store(rec + 2, sm_id.to(tl.int64))
        tl.store(rec + 3, tl.where(sp < s_hist, 0, tl.where(sp < n_all - S_TAIL, 1, 2)).to(tl.int64))

    if MERGE:  # False (two-launch mode): the partials are the result, `merge.reduce_splits_triton` follows
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


def _reduce_block(group: int, d: int, total: int) -> int:
    """Splits per round of the in-kernel reduce: `[GP, S_BLOCK, D_PAD]` fp32 at 64 registers per lane, so the reduce
    does not raise the kernel's register count (168 at Qwen3-8B geometry, as the INT2 loop alone; 8 splits per
    round took 193)."""
    gp = max(4, next_pow2(group))
    return max(1, min(next_pow2(total), 2048 // (gp * max(16, next_pow2(d)))))


def fused_ok(q, k_codes, k_scale, v_codes, k_win, impl: int, block_n: int) -> bool:
    """The fused launch serves the token-rows INT2 kernels (impl 5/6 where they apply) with half-precision windows."""
    import torch

    return (impl in (5, 6) and k_win.dtype in (torch.float16, torch.bfloat16)
            and _int2._impl5_ok(q, k_codes, v_codes, k_scale.shape[3], k_codes.shape[2], block_n))


def window_splits(win_capacity: int) -> int:
    """Window programs per (sequence, KV head): WINDOW_SPLIT_TOKENS tokens each."""
    return max(1, -(-win_capacity // WINDOW_SPLIT_TOKENS))


def launch_decode_fused(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                        k_win, v_win, slot_ids, win_len, counters, sm_scale: float, s_hist: int, s_win: int,
                        block_n: int = 64, num_warps: int = 1, num_stages: int = 3, impl: int = 6,
                        whole_pages: bool = False, warmup: bool = False, merge: bool = True,
                        timeline=None):
    """Run the fused decode kernel -> (o fp32 `[B, H_q, d]`, lse fp32 `[B, H_q]`); with `warmup`, compile only and
    return the compiled kernel. Shapes as in `attention.decode_attention` (inputs validated there); `fused_ok` must
    hold. counters: int32 `[>= B * H_kv]` on q's device, all zero (the kernel leaves them zero); unused (may be
    None) with merge=False.

    merge=False: history and window splits only (no counters, no in-kernel reduce): returns the partials
    (o_part `[B, H_q, S, d]`, lse_part `[B, H_q, S]`) for `merge.reduce_splits_triton`, S = s_hist + s_win, plus one
    with two-page tiles (`triton_int2.pair_tiles_apply`: a program per (sequence, KV head) for an odd last page).
    The window programs come last in the grid, so they run in the slots the INT2 wave leaves free instead of as a
    launch of their own.

    timeline (bench instrumentation, GPU only): int64 `[B, H_kv, S_all, 4]` (S_all = every program of the grid along
    its last axis) that each program fills with (start ns, end ns, SM id, kind: 0 history, 1 window, 2 odd-page
    tail), from the GPU's global timer."""
    import torch

    b, h_q, d = q.shape
    h_kv = k_codes.shape[1]
    group = h_q // h_kv
    pair = _int2.pair_tiles_apply(k_codes, block_n, impl, whole_pages)
    total = s_hist + s_win + int(pair)  # pair: one more program per (sequence, KV head), the odd page
    o_part = torch.empty(b, h_q, total, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(b, h_q, total, dtype=torch.float32, device=q.device)
    o = torch.empty(b, h_q, d, dtype=torch.float32, device=q.device) if merge else o_part  # (unused then)
    lse = torch.empty(b, h_q, dtype=torch.float32, device=q.device) if merge else lse_part
    kc, vc = _int2.int16_views(k_codes, v_codes)
    if counters is None:  # merge=False never touches them
        counters = hist_len
    if timeline is not None:
        if INTERPRET or q.device.type != "cuda":
            raise ValueError("launch_decode_fused: timeline needs a CUDA device (it reads the GPU's global timer)")
        want = (b, h_kv, total, 4)
        if tuple(timeline.shape) != want or timeline.dtype != torch.int64 or not timeline.is_contiguous():
            raise ValueError(f"launch_decode_fused: timeline must be a contiguous int64 tensor of shape {want}, got "
                             f"{timeline.dtype} {tuple(timeline.shape)}")
    args = (q, kc, k_scale, k_zero, vc, v_scale, v_zero, block_table, hist_len, k_win, v_win, slot_ids, win_len,
            o_part, lse_part, o, lse, counters, hist_len if timeline is None else timeline,
            sm_scale * 1.4426950408889634, s_hist,
            *_int2.pool_strides(q, kc, k_scale, vc, v_scale, block_table),
            k_win.stride(0), k_win.stride(1), k_win.stride(2),
            v_win.stride(0), v_win.stride(1), v_win.stride(2),
            *_int2.partial_strides(o_part, lse_part))
    chunk = (_int2.pair_constexprs(q, k_codes, block_n) if pair
             else _int2.chunk_constexprs(q, k_codes, block_n, impl == 6, whole_pages, v_scale, v_zero))
    num_stages = _int2.PAIR_STAGES if pair else num_stages
    kw = dict(**chunk, S_TAIL=int(pair),
              NC=max(8, next_pow2(group)), D=d, D_PAD=max(16, next_pow2(d)),
              BLOCK_W=WINDOW_BLOCK, S_BLOCK=_reduce_block(group, d, total),
              S_MAX=next_pow2(total), MERGE=bool(merge), WIN_FIRST=WINDOWS_FIRST,
              TIMELINE=timeline is not None,
              num_warps=num_warps, num_stages=num_stages,
              **_int2.maxnreg_option())
    grid = (b, h_kv, total)
    if warmup:
        return _decode_fused_kernel.warmup(*args, grid=grid, **kw)
    _decode_fused_kernel[grid](*args, **kw)
    return (o, lse) if merge else (o_part, lse_part)


def resident_programs_per_sm(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                             k_win, v_win, slot_ids, win_len, block_n: int, num_warps: int, num_stages: int,
                             impl: int, whole_pages: bool, merge: bool = True) -> int | None:
    """Programs of the fused kernel that fit on one SM (its compiled registers and shared memory; compiled once per
    configuration, no launch). None under the interpreter."""
    if INTERPRET or q.device.type != "cuda":
        return None

    def compile_only():
        import torch

        counters = torch.zeros(q.shape[0] * k_codes.shape[1], dtype=torch.int32, device=q.device)
        return launch_decode_fused(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                                   k_win, v_win, slot_ids, win_len, counters, 1.0, 3, 1, block_n, num_warps,
                                   num_stages, impl, whole_pages, warmup=True, merge=merge)

    key = (("fused",) + _int2.chunk_key(q, k_codes, k_scale, v_codes, v_scale, block_table, hist_len, block_n,
                                         num_warps, num_stages, impl, whole_pages, v_zero)
           + (k_win.dtype, slot_ids.dtype, win_len.dtype, bool(merge), WINDOWS_FIRST,
              _int2.pair_tiles_apply(k_codes, block_n, impl, whole_pages), _int2.PAIR_STAGES))
    return _int2.cached_slots(key, compile_only, num_warps, q.device)
