"""Stream-K decode: the INT2 history of all (sequence, KV head) segments cut into NP equal runs of tiles, one per
program, the BF16 window chunks in the same grid, then one reduce that merges each row's partials.

Why: with a fixed number of splits per segment, the programs of one wave are not spread evenly over the SMs (at
128K / batch 8, 1536 programs of 86 tiles on 1584 slots: 48 SMs run 11 programs, the rest 12, and the kernel is
throughput-bound per SM, so the SMs with 12 set the time), and a batch of mixed lengths gives short and long
programs. Here every program gets the same number of tiles (to one), so the work per SM is even at any batch, any
mix of lengths.

Work layout. Segment s = b * H_kv + h has n_t(b) = ceil(len_b / BLOCK_N) tiles; in that order the history is a line
of T = H_kv * sum_b n_t(b) tiles. Program k of NP takes tiles [floor(k T / NP), floor((k + 1) T / NP)), which may
end in one segment and go on in the next: it writes one partial (o and lse of the GROUP query heads) per segment
it touches, a *piece*. Piece (k, s) is stored at index k + s: along the line every new piece raises k or s (or
both), so k + s never repeats, and the pieces of segment s are the contiguous range [first(s) + s, last(s) + s],
first/last being the programs that own the segment's first and last tile. So the piece buffer has NP + B * H_kv
entries whatever the lengths, and the reduce finds a segment's pieces from the lengths alone (no counters, no
second pass). Window partials go to their own `[B, H_q, S_W, d]` buffer.

Grid `(NP + B * H_kv * S_W,)`: the history programs first, the window programs last, so the window programs run
in the slots the history wave leaves free (as in the fused kernel, `triton_fused`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime_kernels.attention import merge as _merge
from runtime_kernels.attention import triton_int2 as _int2
from runtime_kernels.attention import triton_window as _window
from runtime_kernels.attention.triton_fused import WINDOW_BLOCK, window_splits
from runtime_kernels.attention.triton_int2 import INTERPRET


@triton.jit
def _segment_tiles(len_ptr, n_seq, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per sequence (vectors `[B_PAD]`, zero past n_seq): index, length, tiles n_t (int64), tiles of the sequences
    before it (exclusive prefix, int64); and the total tile count of one KV head."""
    offs = tl.arange(0, B_PAD)
    lens = tl.load(len_ptr + offs, mask=offs < n_seq, other=0).to(tl.int64)
    nt = (lens + BLOCK_N - 1) // BLOCK_N
    incl = tl.cumsum(nt, axis=0)
    return offs, lens, nt, incl - nt, tl.sum(nt, axis=0)


@triton.jit
def _pick(offs, vec, i):
    """`vec[i]` of a register vector (a masked sum: no memory round trip)."""
    return tl.sum(tl.where(offs == i, vec, 0), axis=0)


@triton.jit
def _owner(g, T, NP):
    """The program that owns global tile g: the largest k with floor(k T / NP) <= g (T > 0, int64)."""
    return ((g + 1) * NP - 1) // T


@triton.jit
def _segment_pieces(nt_b, ex_b, h, H: tl.constexpr, T, NP):
    """(index of the first piece, number of pieces) of segment (b, h), from its tile count nt_b and the tiles of the
    sequences before b (ex_b); (0, 0) for an empty segment."""
    seg0 = H * ex_b + h * nt_b
    t_safe = tl.maximum(T, 1)
    first = _owner(seg0, t_safe, NP)
    last = _owner(seg0 + tl.maximum(nt_b, 1) - 1, t_safe, NP)
    return first, tl.where(nt_b > 0, last - first + 1, 0)


@triton.jit(do_not_specialize=["n_seq", "n_prog", "s_win"])
def _decode_streamk_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr,
    kw_ptr, vw_ptr, slot_ptr, wlen_ptr,
    po_ptr, pl_ptr, wo_ptr, wl_ptr,
    qk_scale, n_seq, n_prog, s_win,
    stride_qb, stride_qh,
    stride_kcp: tl.constexpr, stride_kch: tl.constexpr, stride_kcr: tl.constexpr,
    stride_ksp: tl.constexpr, stride_ksh: tl.constexpr, stride_ksr: tl.constexpr,
    stride_vcp: tl.constexpr, stride_vch: tl.constexpr, stride_vcr: tl.constexpr,
    stride_vsp: tl.constexpr, stride_vsh: tl.constexpr, stride_vsr: tl.constexpr,
    stride_btb,
    stride_wks, stride_wkh, stride_wkr,
    stride_wvs, stride_wvh, stride_wvr,
    stride_wob, stride_woh, stride_wos,
    stride_wlb, stride_wlh,
    H: tl.constexpr, B_PAD: tl.constexpr,
    GROUP: tl.constexpr, GP: tl.constexpr, Q: tl.constexpr, U: tl.constexpr, U_PAD: tl.constexpr,
    P: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, VFOLD: tl.constexpr, TILE_ACC: tl.constexpr,
    SUBN: tl.constexpr, PAGE_VEC: tl.constexpr, NPV: tl.constexpr, FULL_TILES: tl.constexpr,
    NC: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_W: tl.constexpr,
):
    # po/pl: fp32 pieces `[n_prog + n_seq * H, GROUP, D]` / `[n_prog + n_seq * H, GROUP]`, contiguous; wo/wl: window
    # partials `[B, H_q, s_win, D]` / `[B, H_q, s_win]`.
    pid = tl.program_id(0)
    if pid < n_prog:
        offs, lens, nt, ex, tiles = _segment_tiles(len_ptr, n_seq, B_PAD, BLOCK_N)
        T = H * tiles
        k = pid.to(tl.int64)
        g = k * T // n_prog
        g_end = (k + 1) * T // n_prog
        while g < g_end:
            # The sequence holding tile g: the first b whose tiles end past g (padding entries end at T > g).
            b = tl.sum((H * (ex + nt) <= g).to(tl.int32), axis=0)
            nt_b = _pick(offs, nt, b)
            within = g - H * _pick(offs, ex, b)
            h = within // nt_b
            t0 = within - h * nt_b
            n = tl.minimum(g_end - g, nt_b - t0)
            piece = k + b * H + h
            start = (t0 * BLOCK_N).to(tl.int32)
            end = tl.minimum((t0 + n) * BLOCK_N, _pick(offs, lens, b)).to(tl.int32)
            _int2._int2_range_t(
                q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, po_ptr + piece * (GROUP * D),
                pl_ptr + piece * GROUP, qk_scale,
                stride_qb, stride_qh, stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
                stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, stride_btb, D, 1,
                b, h.to(tl.int32), start, end,
                GROUP, GP, Q, U, U_PAD, P, BLOCK_N, INTERP, VFOLD, TILE_ACC, SUBN, PAGE_VEC, NPV, FULL_TILES)
            g += n
    else:
        w = pid - n_prog
        b = w % n_seq
        h = (w // n_seq) % H
        _window._window_chunk_t(
            q_ptr, kw_ptr, vw_ptr, slot_ptr, wlen_ptr, wo_ptr, wl_ptr, qk_scale, 0,
            stride_qb, stride_qh, stride_wks, stride_wkh, stride_wkr, stride_wvs, stride_wvh, stride_wvr,
            stride_wob, stride_woh, stride_wos, stride_wlb, stride_wlh,
            b, h, w // (n_seq * H), s_win,
            GROUP, NC, D, D_PAD, BLOCK_W, INTERP)


@triton.jit(do_not_specialize=["n_seq", "n_prog", "s_win"])
def _reduce_streamk_kernel(po_ptr, pl_ptr, wo_ptr, wl_ptr, len_ptr, o_ptr, lse_ptr, n_seq, n_prog, s_win,
                           H: tl.constexpr, GROUP: tl.constexpr, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                           D: tl.constexpr, D_BLK: tl.constexpr, S_BLOCK: tl.constexpr, S_MAX: tl.constexpr,
                           W_MAX: tl.constexpr):
    # Program (row, channel block), row = (b, query head): merges the row's history pieces (a contiguous range of
    # the piece buffer, found from the lengths as the decode kernel cut them) and its s_win window partials.
    row = tl.program_id(0)
    b = row // (H * GROUP)
    hq = row % (H * GROUP)
    h = hq // GROUP
    g = hq % GROUP
    offs, lens, nt, ex, tiles = _segment_tiles(len_ptr, n_seq, B_PAD, BLOCK_N)
    first, count = _segment_pieces(_pick(offs, nt, b), _pick(offs, ex, b), h, H, H * tiles, n_prog)
    p_lo = first + b * H + h  # the segment's first piece
    offs_d = tl.program_id(1) * D_BLK + tl.arange(0, D_BLK)
    d_ok = offs_d < D
    # Weights: one max over both sets of partials (history pieces stride GROUP, window partials stride 1).
    offs_s = tl.arange(0, S_MAX)
    l_h = tl.load(pl_ptr + (p_lo + offs_s) * GROUP + g, mask=offs_s < count, other=float("-inf"))
    offs_w = tl.arange(0, W_MAX)
    w_row = b.to(tl.int64) * (H * GROUP) + hq
    l_w = tl.load(wl_ptr + w_row * s_win + offs_w, mask=offs_w < s_win, other=float("-inf"))
    m = tl.maximum(tl.max(l_h, axis=0), tl.max(l_w, axis=0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.sum(tl.exp(l_h - m_safe), axis=0) + tl.sum(tl.exp(l_w - m_safe), axis=0)
    acc = tl.zeros([D_BLK], tl.float32)
    for s0 in range(0, count, S_BLOCK):
        o_s = s0 + tl.arange(0, S_BLOCK)
        s_ok = o_s < count
        wgt = tl.exp(tl.load(pl_ptr + (p_lo + o_s) * GROUP + g, mask=s_ok, other=float("-inf")) - m_safe)
        o = tl.load(po_ptr + ((p_lo + o_s) * GROUP + g)[:, None] * D + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(wgt[:, None] * o, axis=0)
    w_ok = offs_w < s_win
    wgt = tl.exp(l_w - m_safe)
    o = tl.load(wo_ptr + (w_row * s_win + offs_w)[:, None] * D + offs_d[None, :], mask=w_ok[:, None] & d_ok[None, :],
                other=0.0)
    acc += tl.sum(wgt[:, None] * o, axis=0)
    inv, lse = _merge._merge_finish(m_safe, tot)
    tl.store(o_ptr + row.to(tl.int64) * D + offs_d, acc * inv, mask=d_ok)
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + row, lse)


# Register cap of the stream-K decode kernel (unless `triton_int2.IMPL5_MAXNREG` sets one): left alone, ptxas gives
# it 184 registers (the segment walk around the tile loop), which fits 8 one-warp programs per SM instead of 12; at
# 168 it spills 6 words outside the tile loop and none inside it (Triton 3.6, sm_90: 687 instructions per tile,
# as the INT2 kernel's 674 plus the walk's loop state).
STREAMK_MAXNREG = 168


def _maxnreg_option() -> dict:
    return _int2.maxnreg_option() or ({} if INTERPRET else {"maxnreg": STREAMK_MAXNREG})


def _geometry(q, k_codes, block_n: int) -> dict:
    return dict(B_PAD=max(2, triton.next_power_of_2(q.shape[0])), BLOCK_N=block_n)


def launch_decode_streamk(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                          k_win, v_win, slot_ids, win_len, sm_scale: float, n_prog: int, s_win: int | None = None,
                          block_n: int = 64, num_warps: int = 1, num_stages: int = 3, impl: int = 6,
                          whole_pages: bool = False, warmup: bool = False):
    """Stream-K decode attention -> (o fp32 `[B, H_q, d]`, lse fp32 `[B, H_q]`): n_prog history programs (any count
    >= 1; a GPU caller passes whole waves of resident programs) and s_win window programs per (sequence, KV head)
    (default: `triton_fused.window_splits`), then the reduce. With `warmup`, compile the decode kernel only and
    return it. Shapes as in `attention.decode_attention` (inputs validated there); `triton_fused.fused_ok` must
    hold."""
    import torch

    b, h_q, d = q.shape
    h_kv = k_codes.shape[1]
    group = h_q // h_kv
    s_win = s_win or window_splits(k_win.shape[2])
    n_pieces = n_prog + b * h_kv
    po = torch.empty(n_pieces, group, d, dtype=torch.float32, device=q.device)
    pl = torch.empty(n_pieces, group, dtype=torch.float32, device=q.device)
    wo = torch.empty(b, h_q, s_win, d, dtype=torch.float32, device=q.device)
    wl = torch.empty(b, h_q, s_win, dtype=torch.float32, device=q.device)
    kc, vc = _int2.int16_views(k_codes, v_codes)
    args = (q, kc, k_scale, k_zero, vc, v_scale, v_zero, block_table, hist_len, k_win, v_win, slot_ids, win_len,
            po, pl, wo, wl, sm_scale * 1.4426950408889634, b, n_prog, s_win,
            *_int2.pool_strides(q, kc, k_scale, vc, v_scale, block_table),
            k_win.stride(0), k_win.stride(1), k_win.stride(2),
            v_win.stride(0), v_win.stride(1), v_win.stride(2),
            *_int2.partial_strides(wo, wl))
    geo = _geometry(q, k_codes, block_n)
    kw = dict(**_int2.chunk_constexprs(q, k_codes, block_n, impl == 6, whole_pages), H=h_kv, B_PAD=geo["B_PAD"],
              NC=max(8, triton.next_power_of_2(group)), D=d, D_PAD=max(16, triton.next_power_of_2(d)),
              BLOCK_W=WINDOW_BLOCK, num_warps=num_warps, num_stages=num_stages, **_maxnreg_option())
    grid = (n_prog + b * h_kv * s_win,)
    if warmup:
        return _decode_streamk_kernel.warmup(*args, grid=grid, **kw)
    _decode_streamk_kernel[grid](*args, **kw)
    o = torch.empty(b, h_q, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h_q, dtype=torch.float32, device=q.device)
    most = n_prog // h_kv + 2  # pieces of one segment: at most ceil(n_t NP / T) + 1 <= NP / H_kv + 2 (T >= H_kv n_t)
    d_blk = min(32, triton.next_power_of_2(d))
    _reduce_streamk_kernel[(b * h_q, triton.cdiv(d, d_blk))](
        po, pl, wo, wl, hist_len, o, lse, b, n_prog, s_win, H=h_kv, GROUP=group, B_PAD=geo["B_PAD"],
        BLOCK_N=block_n, D=d, D_BLK=d_blk, S_BLOCK=min(64, triton.next_power_of_2(most)),
        S_MAX=triton.next_power_of_2(most), W_MAX=triton.next_power_of_2(s_win), num_warps=4)
    return o, lse


def resident_programs_per_sm(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                             k_win, v_win, slot_ids, win_len, block_n: int, num_warps: int, num_stages: int,
                             impl: int, whole_pages: bool) -> int | None:
    """Programs of the stream-K decode kernel that fit on one SM (its compiled registers and shared memory; compiled
    once per configuration, no launch). None under the interpreter."""
    if INTERPRET or q.device.type != "cuda":
        return None

    def compile_only():
        return launch_decode_streamk(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                                     k_win, v_win, slot_ids, win_len, 1.0, 3, 1, block_n, num_warps, num_stages, impl,
                                     whole_pages, warmup=True)

    key = (("streamk",) + _int2.chunk_key(q, k_codes, k_scale, v_codes, v_scale, block_table, hist_len, block_n,
                                           num_warps, num_stages, impl, whole_pages)
           + (k_win.dtype, slot_ids.dtype, win_len.dtype, _geometry(q, k_codes, block_n)["B_PAD"]))
    return _int2.cached_slots(key, compile_only, num_warps, q.device)
