"""Host side of the INT2 decode kernels: run a call's `DecodePlan` (`plan.py`) with its split counts (`splits.py`).

Every call takes its inputs as records (`records.PagePools`, `records.BatchMetadata`, `records.Windows`) and builds
one `DecodePlan` (`plan.plan_decode`: which kernel runs and why, and its compile-time arguments), logged at DEBUG
here; split counts, compiled-kernel keys and launches read that plan, so the kernel choice is made once per call.

Paths (`decode`):
- production grid (`fused.py`): fp16/bf16 queries and windows, one scale group per row, int16-viewable code rows,
  page size a multiple of the tile. Two launches (history + window programs, then `merge.reduce_splits_triton`),
  or one with `DecodeOptions.fused` (the split reduce by the last program of each KV head).
- otherwise three launches: the history kernel (`kernel.py`, or `fallback.py` for the inputs it does not take), the
  window kernel (`window.py`), the reduce.
Nothing here reads a module-level switch: every choice is an input or a field of `DecodeOptions` (`options.py`).
The names of `options`, `plan` and `splits` that callers used from here stay importable from here.
"""

from __future__ import annotations

import logging

import torch

from runtime_kernels import step_kernels
from runtime_kernels.attention.int2_decode import fallback, fused, kernel, merge, window
from runtime_kernels.attention.int2_decode.options import DEFAULT_OPTIONS, TILE_TOKENS, DecodeOptions
from runtime_kernels.attention.int2_decode.plan import (
    DecodePlan,
    chunk_constexprs,
    fallback_constexprs,
    grid_declines,
    plan_decode,
    production_declines,
    tile_path,
    window_declines,
)
from runtime_kernels.attention.int2_decode.records import BatchMetadata, PagePools, Windows
from runtime_kernels.attention.int2_decode.splits import (
    cached_slots,
    default_num_splits,
    grid_window_splits,
    max_chunks,
    programs_per_sm_limit,
    sm_count,
    splits_for_slots,
    window_num_splits,
)
from runtime_kernels.launch_util import next_pow2

LOG = logging.getLogger(__name__)  # DEBUG: the plan of every decode call (`DecodePlan`)


def _logged(plan: DecodePlan) -> DecodePlan:
    if LOG.isEnabledFor(logging.DEBUG):
        LOG.debug("decode plan: %s", plan)
    return plan


def int16_views(k_codes, v_codes) -> tuple:
    """The code pools as the production kernel reads them: int16 words (8 codes each), strides in int16 units."""
    return k_codes.view(torch.int16), v_codes.view(torch.int16)



def pool_strides(q, codes: tuple, pages: PagePools, batch: BatchMetadata) -> tuple:
    """Strides of q, the code pools `codes = (K, V)` (in units of the views passed: uint8 or int16), the scale pools
    (zeros share them) and the block table, in the order of the INT2 kernels' arguments."""
    (kc, vc), k_scale, v_scale = codes, pages.k_scale, pages.v_scale
    return (q.stride(0), q.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2),
            k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
            vc.stride(0), vc.stride(1), vc.stride(2),
            v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
            batch.block_table.stride(0))


def partial_strides(o_part, lse_part) -> tuple:
    """Strides of the split buffers `o_part [B, H_q, S, d]`, `lse_part [B, H_q, S]` (the last dims contiguous)."""
    return (o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1))


def _code_views(pages: PagePools, plan: DecodePlan) -> tuple:
    """The code pools as the plan's history kernel reads them: int16 words (production) or bytes (fallback)."""
    return int16_views(pages.k_codes, pages.v_codes) if plan.production else (pages.k_codes, pages.v_codes)


def _mean_ptrs(q, pages: PagePools) -> tuple:
    """The centered cache's means as kernel arguments (q stands in as an unused pointer when uncentered)."""
    return (q, q) if pages.k_mean is None else (pages.k_mean, pages.v_mean)


def _history_args(q, pages: PagePools, batch: BatchMetadata, plan: DecodePlan, o_part, lse_part, sm_scale: float,
                  split_offset: int) -> tuple:
    kc, vc = _code_views(pages, plan)
    k_mean, v_mean = _mean_ptrs(q, pages)
    return (q, kc, pages.k_scale, pages.k_zero, vc, pages.v_scale, pages.v_zero, batch.block_table, batch.hist_len,
            o_part, lse_part, k_mean, v_mean, sm_scale * 1.4426950408889634, split_offset,
            *pool_strides(q, (kc, vc), pages, batch), *partial_strides(o_part, lse_part))


def chunk_key(q, pages: PagePools, batch: BatchMetadata, plan: DecodePlan, opts: DecodeOptions) -> tuple:
    """Everything that selects a different compiled history chunk: constexprs, pool strides (the code pools' in
    bytes), options, dtypes and Triton's specialisation of the block-table stride."""
    block_table, hist_len = batch.block_table, batch.hist_len
    return (q.device.index, q.dtype, opts, block_table.dtype, hist_len.dtype, block_table.stride(0) % 16 == 0,
            pool_strides(q, (pages.k_codes, pages.v_codes), pages, batch)[2:14], tuple(plan.constexprs.values()))


# ----------------------------------------------------------------------------------------------- launches
def launch_history(q, pages: PagePools, batch: BatchMetadata, plan: DecodePlan, o_part, lse_part, sm_scale: float,
                   num_splits: int, split_offset: int, opts: DecodeOptions, warmup: bool = False):
    """Write the history partials into splits `[split_offset, split_offset + num_splits)` of `o_part [B, H_q, S, d]`
    and `lse_part [B, H_q, S]` (fp32) with the plan's history kernel (production or fallback) and constexprs.
    Inputs are validated by the functional API (the means, if any, fp32 and contiguous). Returns Triton's
    compiled-kernel handle (`warmup`: compile only)."""
    grid = (q.shape[0], pages.kv_heads, num_splits)
    args = _history_args(q, pages, batch, plan, o_part, lse_part, sm_scale, split_offset)
    kw = dict(**plan.constexprs, **opts.launch_kwargs())
    if plan.production:
        if warmup:
            return kernel._int2_decode_kernel.warmup(*args, grid=grid, **kw)
        return kernel._int2_decode_kernel[grid](*args, **kw)
    if warmup:
        raise ValueError("launch_history: warmup applies to the production kernel only")
    return fallback._int2_decode_fallback_kernel[grid](*args, **kw)


def history_num_splits(q, pages: PagePools, batch: BatchMetadata, plan: DecodePlan, opts: DecodeOptions) -> int:
    """History splits of the three-launch path: whole waves of the production kernel's compiled occupancy on a GPU,
    the fixed rule elsewhere. From shapes and the compiled kernel only (no GPU sync)."""
    slots = None
    if q.device.type == "cuda" and plan.compiled and plan.production:
        def compile_only():
            o_part, lse_part = _partials(q, 3)
            return launch_history(q, pages, batch, plan, o_part, lse_part, 1.0, 3, 0, opts, warmup=True)

        slots = cached_slots(("int2",) + chunk_key(q, pages, batch, plan, opts), compile_only, opts.num_warps,
                             q.device)
    return splits_for_slots(q, pages, batch, slots, opts)


def _partials(q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, h_q, d = q.shape
    return (torch.empty(b, h_q, splits, d, dtype=torch.float32, device=q.device),
            torch.empty(b, h_q, splits, dtype=torch.float32, device=q.device))


def _reduce_block(group: int, d: int, total: int) -> int:
    """Splits per round of the in-kernel reduce: `[GP, S_BLOCK, D_PAD]` fp32 at 64 registers per lane, so the reduce
    does not raise the kernel's register count."""
    gp = max(4, next_pow2(group))
    return max(1, min(next_pow2(total), 2048 // (gp * max(16, next_pow2(d)))))


def launch_grid(q, pages: PagePools, batch: BatchMetadata, windows: Windows, plan: DecodePlan, counters,
                sm_scale: float, s_hist: int, s_win: int, opts: DecodeOptions, warmup: bool = False):
    """Run the production grid (`fused._decode_grid_kernel`; the plan's kernel must be "grid"). opts.fused: one
    launch -> (o fp32 `[B, H_q, d]`, lse fp32 `[B, H_q]`), counters int32 `[>= B * H_kv]`, all zero (left zero).
    Else -> the partials (o_part `[B, H_q, S, d]`, lse_part `[B, H_q, S]`, S = s_hist + s_win) for
    `merge.reduce_splits_triton`; counters unused (may be None). `warmup`: compile only, return the kernel."""
    b, h_q, d = q.shape
    h_kv = pages.kv_heads
    group = h_q // h_kv
    total = s_hist + s_win
    o_part, lse_part = _partials(q, total)
    o = torch.empty(b, h_q, d, dtype=torch.float32, device=q.device) if opts.fused else o_part
    lse = torch.empty(b, h_q, dtype=torch.float32, device=q.device) if opts.fused else lse_part
    kc, vc = int16_views(pages.k_codes, pages.v_codes)
    if counters is None:  # the two-launch form never touches them
        counters = batch.hist_len
    km, vm = _mean_ptrs(q, pages)
    k_win, v_win = windows.k_win, windows.v_win
    args = (q, kc, pages.k_scale, pages.k_zero, vc, pages.v_scale, pages.v_zero, batch.block_table, batch.hist_len,
            k_win, v_win, batch.slot_ids, batch.win_len, o_part, lse_part, o, lse, counters, km, vm,
            sm_scale * 1.4426950408889634, s_hist,
            *pool_strides(q, (kc, vc), pages, batch),
            k_win.stride(0), k_win.stride(1), k_win.stride(2),
            v_win.stride(0), v_win.stride(1), v_win.stride(2),
            *partial_strides(o_part, lse_part))
    kw = dict(**plan.constexprs,
              NC=max(8, next_pow2(group)), D=d, D_PAD=max(16, next_pow2(d)),
              BLOCK_W=opts.window_block, S_BLOCK=_reduce_block(group, d, total),
              S_MAX=next_pow2(total), MERGE=bool(opts.fused), PDL=_pdl(q, opts),
              **opts.launch_kwargs())
    grid = (b, h_kv, total)
    if warmup:
        return fused._decode_grid_kernel.warmup(*args, grid=grid, **kw)
    fused._decode_grid_kernel[grid](*args, **kw)
    return (o, lse) if opts.fused else (o_part, lse_part)


def _pdl(q: torch.Tensor, opts: DecodeOptions) -> bool:
    """Whether the two-launch grid and its reduce run as a programmatic dependent launch pair (compiled launches)."""
    return bool(opts.pdl) and not opts.fused and q.is_cuda


def _grid_key(q, pages: PagePools, batch: BatchMetadata, windows: Windows, plan: DecodePlan,
              opts: DecodeOptions) -> tuple:
    """What selects a compiled production grid: the history chunk's key and the window inputs' dtypes."""
    return (("grid",) + chunk_key(q, pages, batch, plan, opts)
            + (windows.k_win.dtype, batch.slot_ids.dtype, batch.win_len.dtype))


def _compile_grid(q, pages: PagePools, batch: BatchMetadata, windows: Windows, plan: DecodePlan,
                  opts: DecodeOptions):
    """The production grid these inputs and options compile to (Triton's handle; compiled, not launched)."""
    counters = torch.zeros(q.shape[0] * pages.kv_heads, dtype=torch.int32, device=q.device)
    return launch_grid(q, pages, batch, windows, plan, counters, 1.0, 3, 1, opts, warmup=True)


def grid_num_splits(q, pages: PagePools, batch: BatchMetadata, windows: Windows, plan: DecodePlan,
                    opts: DecodeOptions) -> tuple[int, int]:
    """(history, window) splits of the production grid: whole waves of its own compiled kernel on a GPU."""
    slots = None
    if q.device.type == "cuda" and plan.compiled:
        slots = cached_slots(_grid_key(q, pages, batch, windows, plan, opts),
                             lambda: _compile_grid(q, pages, batch, windows, plan, opts), opts.num_warps, q.device)
    return splits_for_slots(q, pages, batch, slots, opts), grid_window_splits(windows.k_win.shape[2], opts)


def history(q, pages: PagePools, batch: BatchMetadata, sm_scale: float, num_splits: int | None,
            opts: DecodeOptions):
    """History-only decode attention -> (o fp32 `[B, H_q, d]`, lse fp32 `[B, H_q]`)."""
    plan = _logged(plan_decode(q, pages, None, batch.whole_pages, opts))
    splits = num_splits or history_num_splits(q, pages, batch, plan, opts)
    o_part, lse_part = _partials(q, splits)
    launch_history(q, pages, batch, plan, o_part, lse_part, sm_scale, splits, 0, opts)
    return merge.reduce_splits_triton(o_part, lse_part)


def windows_only(q, windows: Windows, batch: BatchMetadata, sm_scale: float, num_splits: int | None,
                 opts: DecodeOptions):
    """Window-only decode attention -> (o, lse)."""
    splits = num_splits or window_num_splits(q, windows, opts)
    o_part, lse_part = _partials(q, splits)
    window.launch_window_decode(q, windows.k_win, windows.v_win, batch.slot_ids, batch.win_len, o_part, lse_part,
                                sm_scale, splits, 0, opts.block_n)
    return merge.reduce_splits_triton(o_part, lse_part)


def decode(q, pages: PagePools, batch: BatchMetadata, windows: Windows, sm_scale: float, num_splits: int | None,
           window_splits: int | None, counters: torch.Tensor | None, opts: DecodeOptions,
           v_rotation: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32):
    """History + window decode attention on the Triton path -> (o `[B, H_q, d]`, lse fp32 `[B, H_q]`).
    One plan per call (logged at DEBUG) picks the kernel, its constexprs and the split rule. With `v_rotation` o is
    un-rotated (`o @ R_V[h // g]^T`) and stored in out_dtype: by the split reduce (`merge.reduce_splits_triton`), or,
    in the one-launch form, which has no separate reduce, by `step_kernels.rotate_heads` after it."""
    plan = _logged(plan_decode(q, pages, windows, batch.whole_pages, opts, window_splits))
    if plan.kernel == "grid":
        if not opts.fused:
            counters = None
        elif counters is None:
            counters = torch.zeros(q.shape[0] * pages.kv_heads, dtype=torch.int32, device=q.device)
        if num_splits:
            s_h, s_w = num_splits, grid_window_splits(windows.k_win.shape[2], opts)
        else:
            s_h, s_w = grid_num_splits(q, pages, batch, windows, plan, opts)
        out = launch_grid(q, pages, batch, windows, plan, counters, sm_scale, s_h, s_w, opts)
        if not opts.fused:
            return merge.reduce_splits_triton(*out, v_rotation, out_dtype, pdl=_pdl(q, opts))
        if v_rotation is None:
            return out
        return step_kernels.rotate_heads(out[0], v_rotation, transpose=True, out_dtype=out_dtype, validate=False), out[1]
    s_h = num_splits or history_num_splits(q, pages, batch, plan, opts)
    s_w = window_splits or window_num_splits(q, windows, opts)
    o_part, lse_part = _partials(q, s_h + s_w)
    launch_history(q, pages, batch, plan, o_part, lse_part, sm_scale, s_h, 0, opts)
    window.launch_window_decode(q, windows.k_win, windows.v_win, batch.slot_ids, batch.win_len, o_part, lse_part,
                                sm_scale, s_w, s_h, opts.block_n)
    return merge.reduce_splits_triton(o_part, lse_part, v_rotation, out_dtype)


def decode_num_splits(q, pages: PagePools, batch: BatchMetadata, windows: Windows,
                      opts: DecodeOptions) -> tuple[int, int]:
    """(history splits, window splits) that `decode` launches by default (its plan, without the log line)."""
    plan = plan_decode(q, pages, windows, batch.whole_pages, opts)
    if plan.kernel == "grid":
        return grid_num_splits(q, pages, batch, windows, plan, opts)
    return history_num_splits(q, pages, batch, plan, opts), window_num_splits(q, windows, opts)


__all__ = [  # the launcher's own names, and those of options/plan/splits that callers import from here
    "DEFAULT_OPTIONS", "TILE_TOKENS", "DecodeOptions", "DecodePlan", "cached_slots", "chunk_constexprs", "chunk_key",
    "decode", "decode_num_splits", "default_num_splits", "fallback_constexprs", "grid_declines", "grid_num_splits",
    "grid_window_splits", "history", "history_num_splits", "int16_views", "launch_grid", "launch_history",
    "max_chunks", "partial_strides", "plan_decode", "pool_strides", "production_declines", "programs_per_sm_limit",
    "sm_count", "splits_for_slots", "tile_path", "window_declines", "window_num_splits", "windows_only",
]
