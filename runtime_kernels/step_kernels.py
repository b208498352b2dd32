"""Triton kernels for the small work around decode attention in one `PagedKVCache` step (issue 30).

One decode step per layer rotates the new K and V rows, casts them and writes them into the full-precision windows
(`PagedKVCache.write_layer`), rotates the queries and un-rotates the attention output (`decode_attention`). In torch
that is about 17 small kernels per layer (fp64 GEMVs, casts, index gathers and scatters, fp32 GEMMs); here it is
one launch before attention (`append_rows_rotate_queries`, for `PagedKVCache.decode_step`) or two (the calls below),
and the un-rotation happens inside the attention's split reduce (`merge.reduce_splits_triton`):

- `append_rows`: the new rows of an append-only step (no window row moves, no page is demoted) rotated per KV head
  (`rotate_rows`' contract: exact products, accumulated in fp64, rounded once to fp32, then cast to the window
  dtype) and stored at `(win_slots[i], h, win_rows[i])` of both windows. With `rotate=False` the rows are already
  rotated (fp32) and are only cast and stored (the eager path that checks them for non-finite values first).
- `rotate_heads`: `x [B, H_q, d] @ R[h // g]` (or `R[h // g]^T`) per query head with fp32 products and fp32
  accumulation, stored in the output dtype: the query rotation (out = window dtype) of `decode_attention`, and the
  un-rotation (transpose) where the attention has no separate reduce (its one-launch form).

Nothing here synchronises with the host or allocates beyond the returned outputs, so a CUDA graph can capture it.
The torch references are `runtime_kernels.serving.rotate_rows` and `runtime_kernels.attention.rotate_queries` /
`unrotate_output`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime_kernels._validate import FLOAT_DTYPES, INT_DTYPES, check_tensor
from runtime_kernels.launch_util import next_pow2
from runtime_kernels.triton_rounding import store_rounded

__all__ = ["append_rows", "append_rows_rotate_queries", "rotate_heads"]

# Columns per append program: a [d, _APPEND_BLOCK_E] fp64 tile (d = 128, one row: 64 programs for 8 KV heads).
_APPEND_BLOCK_E = 32


def _step_warps(rows: int) -> int:
    """Warps per program of the append / rotation launches for `rows` appended rows (or query batch). Measured on an
    H200 with the combined launch (docs/kernels.md): 4 warps fastest at one row (3.1 us against 3.5 with 2), 2 at 8
    and 32 rows (4.2 against 5.1 us, 10.6 against 12.0)."""
    return 4 if rows <= 2 else 2


# ------------------------------------------------------------------------------------------------ append
@triton.jit
def _rotate_store_cols(x_ptr, r_ptr, w_ptr, e0, stride_xd, stride_ri, stride_rj,
                       D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_E: tl.constexpr, ROTATE: tl.constexpr):
    """Columns `[e0, e0 + BLOCK_E)` of one row: `w[e] = window_dtype(fp32(sum_d fp64(x[d]) * fp64(R[d, e])))`, or
    (not ROTATE) `w[e] = window_dtype(x[e])`.

    The fp64 products of fp32 (or narrower) operands are exact; only the order of the fp64 sum differs from
    torch's GEMV, which can move the fp32 rounding only when the exact sum lies within ~d * 2^-53 (relative) of an
    fp32 rounding boundary. Each column's sum is the same whichever program computes it, so splitting the columns
    over programs changes no bit."""
    offs_e = e0 + tl.arange(0, BLOCK_E)
    e_ok = offs_e < D
    if ROTATE:
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        # via fp32: exact for every input dtype (the interpreter would read bf16 -> fp64 as the raw uint16 bits)
        x = tl.load(x_ptr + offs_d * stride_xd, mask=d_ok, other=0.0).to(tl.float32).to(tl.float64)
        r = tl.load(r_ptr + offs_d[:, None] * stride_ri + offs_e[None, :] * stride_rj,
                    mask=d_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float64)
        y = tl.sum(x[:, None] * r, axis=0).to(tl.float32)  # one rounding fp64 -> fp32, as rotate_rows
        store_rounded(w_ptr + offs_e, y, e_ok)
    else:
        x = tl.load(x_ptr + offs_e * stride_xd, mask=e_ok, other=0.0).to(tl.float32)
        store_rounded(w_ptr + offs_e, x, e_ok)


@triton.jit
def _append_block(
    i, h, j, k_ptr, v_ptr, rk_ptr, rv_ptr, src_ptr, slot_ptr, row_ptr, kw_ptr, vw_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_rkh, stride_rki, stride_rkj, stride_rvh, stride_rvi, stride_rvj,
    stride_kws, stride_kwh, stride_kwr, stride_vws, stride_vwh, stride_vwr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_E: tl.constexpr, N_E: tl.constexpr, ROTATE: tl.constexpr,
):
    """Block `(i, h, j)`: new row `src[i]` of KV head h to window row `(slot[i], h, row[i])`, columns of block
    `j % N_E` of K (j < N_E) or of V. A decode step appends one row per sequence, so the work is split over columns
    and K/V for latency: one [D, BLOCK_E] fp64 tile per program, not the whole row of both (a one-row step ran
    12 us on an H200 with 8 programs)."""
    h = h.to(tl.int64)
    e0 = (j % N_E) * BLOCK_E
    src = tl.load(src_ptr + i).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    row = tl.load(row_ptr + i).to(tl.int64)
    if j < N_E:
        _rotate_store_cols(k_ptr + src * stride_kt + h * stride_kh, rk_ptr + h * stride_rkh,
                           kw_ptr + slot * stride_kws + h * stride_kwh + row * stride_kwr, e0,
                           stride_kd, stride_rki, stride_rkj, D, D_PAD, BLOCK_E, ROTATE)
    else:
        _rotate_store_cols(v_ptr + src * stride_vt + h * stride_vh, rv_ptr + h * stride_rvh,
                           vw_ptr + slot * stride_vws + h * stride_vwh + row * stride_vwr, e0,
                           stride_vd, stride_rvi, stride_rvj, D, D_PAD, BLOCK_E, ROTATE)


@triton.jit
def _append_rows_kernel(
    k_ptr, v_ptr, rk_ptr, rv_ptr, src_ptr, slot_ptr, row_ptr, kw_ptr, vw_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_rkh, stride_rki, stride_rkj, stride_rvh, stride_rvi, stride_rvj,
    stride_kws, stride_kwh, stride_kwr, stride_vws, stride_vwh, stride_vwr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_E: tl.constexpr, N_E: tl.constexpr, ROTATE: tl.constexpr,
):
    """Program `(i, h, j)`: `_append_block(i, h, j)`."""
    _append_block(tl.program_id(0), tl.program_id(1), tl.program_id(2),
                  k_ptr, v_ptr, rk_ptr, rv_ptr, src_ptr, slot_ptr, row_ptr, kw_ptr, vw_ptr,
                  stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                  stride_rkh, stride_rki, stride_rkj, stride_rvh, stride_rvi, stride_rvj,
                  stride_kws, stride_kwh, stride_kwr, stride_vws, stride_vwh, stride_vwr,
                  D, D_PAD, BLOCK_E, N_E, ROTATE)


def _check_append(keys, values, k_rotation, v_rotation, src, slots, rows, k_win, v_win, rotate: bool) -> None:
    dev = k_win.device
    for name, w in (("k_win", k_win), ("v_win", v_win)):
        check_tensor(name, w, dtypes=FLOAT_DTYPES, ndim=4, device=dev)
        if w.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous (window rows are stored whole)")
    if v_win.shape != k_win.shape:
        raise ValueError(f"v_win: shape {tuple(v_win.shape)} differs from k_win {tuple(k_win.shape)}")
    h, d = k_win.shape[1], k_win.shape[3]
    for name, x in (("keys", keys), ("values", values)):
        check_tensor(name, x, dtypes=FLOAT_DTYPES if rotate else (torch.float32,), ndim=3, device=dev)
        if tuple(x.shape[1:]) != (h, d):
            raise ValueError(f"{name}: expected shape [N, H={h}, d={d}] (the windows' heads and head_dim), got "
                             f"{tuple(x.shape)}")
    for name, r in (("k_rotation", k_rotation), ("v_rotation", v_rotation)):
        check_tensor(name, r, dtypes=(torch.float32,), ndim=3, device=dev)
        if tuple(r.shape) != (h, d, d):
            raise ValueError(f"{name}: expected shape [H, d, d] = {[h, d, d]}, got {tuple(r.shape)}")
    n = src.shape[0] if isinstance(src, torch.Tensor) else 0
    for name, t in (("win_src", src), ("win_slots", slots), ("win_rows", rows)):
        check_tensor(name, t, dtypes=INT_DTYPES, ndim=1, device=dev)
        if t.shape[0] != n:
            raise ValueError(f"{name}: expected {n} entries (one per written row, as win_src), got {t.shape[0]}")


def append_rows(keys: torch.Tensor, values: torch.Tensor, k_rotation: torch.Tensor, v_rotation: torch.Tensor,
                win_src: torch.Tensor, win_slots: torch.Tensor, win_rows: torch.Tensor, k_win: torch.Tensor,
                v_win: torch.Tensor, *, rotate: bool = True, validate: bool = True) -> None:
    """`k_win[win_slots[i], h, win_rows[i]] = window_dtype(rotate_rows(keys, k_rotation)[win_src[i], h])` for every
    i and KV head h, the same for values with v_rotation into v_win, in one launch. Nothing else is written.

    Args:
        keys, values: `[N, H, d]` new rows in the model's basis (fp16, bf16 or fp32; any strides); with
            `rotate=False` already rotated fp32 rows, only cast and stored.
        k_rotation, v_rotation: fp32 `[H, d, d]` (row-vector convention `x_rot = x @ R`).
        win_src, win_slots, win_rows: int `[M]` source row, window slot and window row of each written row;
            (slot, row) pairs must be distinct and in range (not checked: reading them would sync the host).
        k_win, v_win: `[num_slots, H, W, d]` windows (same shape; last dim contiguous), written in place.
        validate: False skips the metadata checks (for `PagedKVCache`, which built every argument itself).
    """
    if validate:
        _check_append(keys, values, k_rotation, v_rotation, win_src, win_slots, win_rows, k_win, v_win, rotate)
    if win_src.shape[0] == 0:
        return
    args, consts, blocks = _append_launch(keys, values, k_rotation, v_rotation, win_src, win_slots, win_rows, k_win,
                                          v_win)
    _append_rows_kernel[blocks](*args, **consts, ROTATE=bool(rotate), num_warps=_step_warps(blocks[0]))


def _append_launch(keys, values, k_rotation, v_rotation, win_src, win_slots, win_rows, k_win, v_win):
    """(arguments, constexprs, blocks `(M, H, 2 * N_E)`) of `_append_block` for these tensors."""
    m, h, d = win_src.shape[0], k_win.shape[1], k_win.shape[3]
    d_pad = next_pow2(d)
    block_e = min(d_pad, _APPEND_BLOCK_E)
    n_e = triton.cdiv(d, block_e)
    args = (keys, values, k_rotation, v_rotation, win_src, win_slots, win_rows, k_win, v_win,
            keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
            k_rotation.stride(0), k_rotation.stride(1), k_rotation.stride(2),
            v_rotation.stride(0), v_rotation.stride(1), v_rotation.stride(2),
            k_win.stride(0), k_win.stride(1), k_win.stride(2), v_win.stride(0), v_win.stride(1), v_win.stride(2))
    return args, dict(D=d, D_PAD=d_pad, BLOCK_E=block_e, N_E=n_e), (m, h, 2 * n_e)


# ------------------------------------------------------------------------------------------------ per-head rotation
@triton.jit
def _rotate_block(
    bb, h, eb, x_ptr, r_ptr, o_ptr, B,
    stride_xb, stride_xh, stride_xd,
    stride_rh, stride_ri, stride_rj,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_B: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Block `(bb, h, eb)`: rows `(b, h * GROUP + j)` for b in `[bb * BLOCK_B, (bb + 1) * BLOCK_B)` and j < GROUP
    (ROWS >= max(16, BLOCK_B * GROUP) padded rows), output columns `[eb * BLOCK_E, (eb + 1) * BLOCK_E)`; R of KV head h is
    read once for all of them. `o = x @ M` with `M[i, j]` at `r_ptr + h * stride_rh + i * stride_ri + j * stride_rj`
    (swapped strides give R^T), fp32 products and accumulation."""
    offs_r = tl.arange(0, ROWS)
    b = bb * BLOCK_B + offs_r // GROUP
    head = h * GROUP + offs_r % GROUP
    r_ok = (offs_r < BLOCK_B * GROUP) & (b < B)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < D
    x = tl.load(x_ptr + b[:, None].to(tl.int64) * stride_xb + head[:, None] * stride_xh + offs_d[None, :] * stride_xd,
                mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [ROWS, D_PAD]
    m = tl.load(r_ptr + h.to(tl.int64) * stride_rh + offs_d[:, None] * stride_ri + offs_e[None, :] * stride_rj,
                mask=d_ok[:, None] & e_ok[None, :], other=0.0)  # [D_PAD, BLOCK_E] fp32
    # fp32 products and accumulation ("ieee": no TF32 on a GPU); the interpreter multiplies the same fp32 tiles.
    y = tl.dot(x, m, input_precision="ieee")  # [ROWS, BLOCK_E] fp32
    store_rounded(o_ptr + b[:, None].to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_e[None, :], y,
                  r_ok[:, None] & e_ok[None, :])


@triton.jit(do_not_specialize=["B"])
def _rotate_heads_kernel(
    x_ptr, r_ptr, o_ptr, B,
    stride_xb, stride_xh, stride_xd,
    stride_rh, stride_ri, stride_rj,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_B: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Program `(bb, h, eb)`: `_rotate_block(bb, h, eb)`."""
    _rotate_block(tl.program_id(0), tl.program_id(1), tl.program_id(2), x_ptr, r_ptr, o_ptr, B,
                  stride_xb, stride_xh, stride_xd, stride_rh, stride_ri, stride_rj, stride_ob, stride_oh,
                  GROUP, BLOCK_B, ROWS, D, D_PAD, BLOCK_E)


def _check_rotate(x, rotation, out_dtype) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("rotation", rotation, dtypes=(torch.float32,), ndim=3, device=x.device)
    h_kv, d = rotation.shape[0], x.shape[2]
    if tuple(rotation.shape[1:]) != (d, d):
        raise ValueError(f"rotation: expected shape [H_kv, d, d] with d={d} (x's head_dim), got "
                         f"{tuple(rotation.shape)}")
    if x.shape[1] % h_kv:
        raise ValueError(f"x: {x.shape[1]} query heads is not a multiple of the {h_kv} KV heads of rotation")
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected float16, bfloat16 or float32, got {out_dtype}")


def rotate_heads(x: torch.Tensor, rotation: torch.Tensor, *, transpose: bool = False,
                 out_dtype: torch.dtype = torch.float32, validate: bool = True) -> torch.Tensor:
    """`x [B, H_q, d] @ R[h // g]` per query head (`R[h // g]^T` with `transpose`), g = H_q / H_kv, in one launch.

    Products and accumulation in fp32 (x is widened to fp32 first), one rounding to `out_dtype` at the store: the
    math of `attention.rotate_queries(x.float(), R).to(out_dtype)` (transpose: `unrotate_output`), summed in another
    order than torch's GEMM.

    Args:
        x: `[B, H_q, d]` fp16, bf16 or fp32 (any strides).
        rotation: fp32 `[H_kv, d, d]`.
    Returns:
        `[B, H_q, d]` contiguous, `out_dtype`.
    """
    if validate:
        _check_rotate(x, rotation, out_dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    args, consts, blocks = _rotate_launch(x, rotation, out, transpose)
    _rotate_heads_kernel[blocks](*args, **consts, num_warps=_step_warps(x.shape[0]))
    return out


def _rotate_launch(x, rotation, out, transpose: bool):
    """(arguments, constexprs, blocks `(B / BLOCK_B, H_kv, d / BLOCK_E)`) of `_rotate_block` for these tensors."""
    b, h_q, d = x.shape
    h_kv = rotation.shape[0]
    group = h_q // h_kv
    rows = max(16, next_pow2(group))  # rows of a program: several sequences' query groups share one R tile
    block_b = max(1, rows // group)
    d_pad = max(16, next_pow2(d))  # tl.dot needs 16 or more along every side
    block_e = min(d_pad, 32)  # narrow column blocks: a batch-1 step still spreads over d / 32 programs per KV head
    si, sj = (rotation.stride(2), rotation.stride(1)) if transpose else (rotation.stride(1), rotation.stride(2))
    args = (x, rotation, out, b, x.stride(0), x.stride(1), x.stride(2), rotation.stride(0), si, sj,
            out.stride(0), out.stride(1))
    consts = dict(GROUP=group, BLOCK_B=block_b, ROWS=rows, D=d, D_PAD=d_pad, BLOCK_E=block_e)
    return args, consts, (triton.cdiv(b, block_b), h_kv, triton.cdiv(d, block_e))


# ------------------------------------------------------------------------------------------------ both, one launch
@triton.jit(do_not_specialize=["B", "N_APPEND"])
def _append_rotate_kernel(
    k_ptr, v_ptr, rk_ptr, rv_ptr, src_ptr, slot_ptr, row_ptr, kw_ptr, vw_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_rkh, stride_rki, stride_rkj, stride_rvh, stride_rvi, stride_rvj,
    stride_kws, stride_kwh, stride_kwr, stride_vws, stride_vwh, stride_vwr,
    x_ptr, r_ptr, o_ptr, B, stride_xb, stride_xh, stride_xd, stride_rh, stride_ri, stride_rj, stride_ob, stride_oh,
    N_APPEND,
    H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_E: tl.constexpr, N_E: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_B: tl.constexpr, ROWS: tl.constexpr, Q_D_PAD: tl.constexpr, Q_BLOCK_E: tl.constexpr,
    N_EQ: tl.constexpr,
):
    """Program p < N_APPEND: append block `(i, h, j)` of `_append_rows_kernel` (p in row-major order over
    `(M, H, 2 * N_E)`); after them, rotation block `(bb, h, eb)` of `_rotate_heads_kernel` (over `(B / BLOCK_B, H,
    N_EQ)`). The two sets touch disjoint memory, so one grid runs both."""
    pid = tl.program_id(0)
    if pid < N_APPEND:
        per_row = H * 2 * N_E
        r = pid % per_row
        _append_block(pid // per_row, r // (2 * N_E), r % (2 * N_E),
                      k_ptr, v_ptr, rk_ptr, rv_ptr, src_ptr, slot_ptr, row_ptr, kw_ptr, vw_ptr,
                      stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                      stride_rkh, stride_rki, stride_rkj, stride_rvh, stride_rvi, stride_rvj,
                      stride_kws, stride_kwh, stride_kwr, stride_vws, stride_vwh, stride_vwr,
                      D, D_PAD, BLOCK_E, N_E, True)
    else:
        r = pid - N_APPEND
        per_bb = H * N_EQ
        _rotate_block(r // per_bb, (r % per_bb) // N_EQ, r % N_EQ, x_ptr, r_ptr, o_ptr, B,
                      stride_xb, stride_xh, stride_xd, stride_rh, stride_ri, stride_rj, stride_ob, stride_oh,
                      GROUP, BLOCK_B, ROWS, D, Q_D_PAD, Q_BLOCK_E)


def append_rows_rotate_queries(keys: torch.Tensor, values: torch.Tensor, k_rotation: torch.Tensor,
                               v_rotation: torch.Tensor, win_src: torch.Tensor, win_slots: torch.Tensor,
                               win_rows: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, q: torch.Tensor, *,
                               out_dtype: torch.dtype | None = None, validate: bool = True) -> torch.Tensor:
    """`append_rows(keys, values, ...)` and `rotate_heads(q, k_rotation, out_dtype=out_dtype)` in one launch: the
    work before a decode step's attention (a batch-1 step is launch-bound: one launch fewer per layer). The same
    programs as the two calls, so the same bits.

    Args: as `append_rows` (rotating) and `rotate_heads`; q `[B, H_q, d]`; out_dtype default the windows' dtype.
    Returns: the rotated queries, `[B, H_q, d]` contiguous, out_dtype.
    """
    out_dtype = out_dtype or k_win.dtype
    if validate:
        _check_append(keys, values, k_rotation, v_rotation, win_src, win_slots, win_rows, k_win, v_win, True)
        _check_rotate(q, k_rotation, out_dtype)
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    a_args, a_consts, a_blocks = _append_launch(keys, values, k_rotation, v_rotation, win_src, win_slots, win_rows,
                                                k_win, v_win)
    r_args, r_consts, r_blocks = _rotate_launch(q, k_rotation, out, transpose=False)
    n_append = a_blocks[0] * a_blocks[1] * a_blocks[2]
    n_rotate = r_blocks[0] * r_blocks[1] * r_blocks[2]
    if n_append + n_rotate == 0:
        return out
    _append_rotate_kernel[(n_append + n_rotate,)](
        *a_args, *r_args, n_append, H=a_blocks[1], D=a_consts["D"], D_PAD=a_consts["D_PAD"],
        BLOCK_E=a_consts["BLOCK_E"], N_E=a_consts["N_E"], GROUP=r_consts["GROUP"], BLOCK_B=r_consts["BLOCK_B"],
        ROWS=r_consts["ROWS"], Q_D_PAD=r_consts["D_PAD"], Q_BLOCK_E=r_consts["BLOCK_E"], N_EQ=r_blocks[2],
        num_warps=_step_warps(max(a_blocks[0], q.shape[0])),
    )
    return out
