"""Decode attention over the three-segment INT2 KV cache: functional API with backend dispatch.

`backend="auto"` = Triton for CUDA tensors or when TRITON_INTERPRET=1 is set, otherwise the torch references
of `paged_ref`. Layout of the pools, windows and tables: see `paged_ref`'s module docstring.

- `int2_decode_attention`: split-K over the paged INT2 history -> (o, lse)
- `window_attention`: over the BF16 sink + recent window -> (o, lse)
- `merge_attention`: exact log-sum-exp merge of two partials
- `decode_attention`: both segments with one shared split buffer and a single reduce (fewest launches)
- `rotate_queries` / `unrotate_output`: apply R_K to queries and R_V^T to outputs per KV head.
Queries must already be rotated by R_K; outputs are in the R_V basis.
"""

from __future__ import annotations

import math

import torch

from runtime_kernels._validate import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_dim,
    check_head_dim,
    check_tensor,
    resolve_backend,
)
from runtime_kernels.attention import naive, paged_ref


def _merge():
    """The merge module imports triton; load it only when used (TRITON_INTERPRET must be set before)."""
    from runtime_kernels.attention import merge

    return merge

__all__ = [
    "decode_attention",
    "decode_num_splits",
    "default_num_splits",
    "int2_num_splits",
    "int2_decode_attention",
    "merge_attention",
    "naive",
    "paged_ref",
    "rotate_queries",
    "unrotate_output",
    "window_attention",
]

BLOCK_N = 64  # tokens per inner tile (divides the default page size, so a tile never straddles pages)
# INT2 kernel variant used by default (`triton_int2`):
# 6 = tokens on the MMA rows (transposed dots, no padding rows), codes turned into fp16 operands by one `and` per two
#     codes that leaves them as exact fp16 subnormals (no offset to remove), page ids read a vector at a time so codes
#     AND scales are pipelined by cp.async; 4.34x over cuDNN BF16 at 128K / batch 8 under CUDA graphs, 1.29x faster
#     than impl 5 (bench/results/decode_graph_NVIDIA_H200.md). Needs bf16/fp16 queries with |q| < 4096 and one scale
#     group per row; other inputs run impl 3 (the same bitcast math in plain Triton).
# 5 = the same dots with codes at fp16 exponent 1024 (offset subtracted in fp16), page id loaded per tile.
# 4 = prmt codes in inline PTX on padded MMA rows; 0 = the conversion-instruction kernel (v3).
INT2_IMPL = 6
# Launch shape of the INT2 kernel: 1 warp was the fastest configuration of impl 4 and of impl 5 at every point
# where decode is not launch-bound (128K and 32K at batch 8 and 32).
INT2_NUM_WARPS = 1
# Fixed split rule, for the kernels whose occupancy is not computed (impl 0-4, and the interpreter): 32 programs
# per SM tied 16 at 128K/B8 and 32K/B8 and was 1.24x faster at 128K/B32 with impl 5
# (bench/results/decode_impl5_accuracy_NVIDIA_H200.md). impl 5/6 on a GPU use the whole-wave rule below.
INT2_PROGRAMS_PER_SM = 32
MIN_SPLIT_TOKENS = 256  # never split a sequence into chunks shorter than this (fewer partials to reduce)
# impl 5/6: the split count fills every SM with INT2_WAVES waves of programs, counted from the compiled kernel's
# registers and shared memory (`triton_int2.resident_programs_per_sm`), rounded down so that no wave is left
# partly empty (the fixed rule launched 2.67 waves at 128K / batch 8). Kernel time there: 0.2067 ms vs 0.2031 ms
# for the fixed rule, i.e. no gain; kept for 2.75x fewer partials and for following the kernel's occupancy
# (bench/NOTES_decode.md, v6). Under CUDA graphs 2 waves were slower or equal at every point.
INT2_WAVES = 1
# decode_attention on the Triton path, unless the call says `fused=`: one fused launch (history + window + reduce by
# the last program of each KV head, where the default kernel applies) or the unfused path below. Measured on an H200
# (bench/NOTES_decode.md "v7", "v8"): under CUDA graphs the separate reduce is much faster at batch 1 (128K/B1 0.041
# vs 0.061 ms since it works in channel blocks) and within a few percent either way at batch 8 and 32, so the fused
# launch is not the default; eager calls are bound by host time, which the single launch halves
# (host_overhead_NVIDIA_H200.txt: 144 vs 277 us per call for three launches), so eager callers such as the
# transformers integration (`hf.OscarCache`) ask for it.
DECODE_FUSED = False
# The unfused Triton path: True = two launches (history and window programs in one grid, the window programs last so
# that they run in the slots the INT2 wave leaves free, then the split reduce); False = three (INT2 kernel, window
# kernel, reduce). Where the fused kernel does not apply (other impls, fp32 windows) it is always three. Under CUDA
# graphs on an H200 two launches were faster than three at every point of the table in one run (128K/B8 0.1891 vs
# 0.1915 ms, 32K/B1 0.0169 vs 0.0199, 8K/B1 0.0110 vs 0.0144; bench/results/decode_graph_shared_grid_NVIDIA_H200.md)
# and equal or faster in another (decode_graph_pair_tiles_NVIDIA_H200.md, columns pair=0 vs shared=0).
DECODE_SHARED_GRID = True
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few splits, enough to exercise the reduce
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def default_num_splits(batch: int, kv_heads: int, max_tokens: int, device: torch.device,
                       programs_per_sm: int = 8, block_n: int = BLOCK_N,
                       min_tokens: int = MIN_SPLIT_TOKENS) -> int:
    """Splits per (sequence, KV head) so that about `programs_per_sm` programs run per SM, never a chunk shorter
    than `max(min_tokens, block_n)` tokens. Decided from shapes only (capacity of the block table), so it never
    syncs the GPU. 8 programs per SM (with num_stages=3) was the fastest setting at 128K / batch 8 on an H200
    (bench/results/decode_NVIDIA_H200.md). The chunk floor caps the splits at small shapes, where the split
    reduce cost more than the INT2 kernel (123 splits at 8K / batch 1 before it)."""
    want = -(-programs_per_sm * _sm_count(device) // max(1, batch * kv_heads))
    return max(1, min(_max_chunks(max_tokens, block_n, min_tokens), want))


def _max_chunks(max_tokens: int, block_n: int, min_tokens: int) -> int:
    """The most splits a sequence of `max_tokens` takes: no chunk shorter than max(min_tokens, block_n)."""
    return max(1, -(-max_tokens // max(min_tokens, block_n)))


def int2_num_splits(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len, block_n: int,
                    num_warps: int, num_stages: int, impl: int, whole_pages: bool = False) -> int:
    """Splits per (sequence, KV head) of the INT2 kernel: whole waves of resident programs where the kernel's
    occupancy is known (impl 5/6 on a GPU), else `default_num_splits` with INT2_PROGRAMS_PER_SM. Never a chunk
    shorter than MIN_SPLIT_TOKENS; decided from shapes and the compiled kernel only (no GPU sync)."""
    from runtime_kernels.attention import triton_int2

    slots = triton_int2.resident_programs_per_sm(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                                                 hist_len, block_n, num_warps, num_stages, impl, whole_pages)
    return _splits_for_slots(q, k_codes, block_table, block_n, slots)


def _splits_for_slots(q, k_codes, block_table, block_n: int, slots: int | None) -> int:
    """INT2 splits: INT2_WAVES whole waves of `slots` programs per SM, or the fixed rule where slots is None."""
    b, h_kv, max_tokens = q.shape[0], k_codes.shape[1], block_table.shape[1] * k_codes.shape[2]
    if slots is None:
        return default_num_splits(b, h_kv, max_tokens, q.device, programs_per_sm=INT2_PROGRAMS_PER_SM,
                                  block_n=block_n)
    waves = int(INT2_WAVES * slots * _sm_count(q.device)) // max(1, b * h_kv)
    return max(1, min(_max_chunks(max_tokens, block_n, MIN_SPLIT_TOKENS), waves))


# ----------------------------------------------------------------------------------------------- checks
def _check_q(q: torch.Tensor) -> None:
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    check_head_dim("q", q.shape[2])


def _check_int2(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len) -> None:
    b, h_q, d = q.shape
    dev = q.device
    for name, c in (("k_codes", k_codes), ("v_codes", v_codes)):
        check_tensor(name, c, dtypes=(torch.uint8,), ndim=4, device=dev)
        check_dim(name, c, 3, d // 4, "head_dim // 4 packed bytes per row")
        if c.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous")
    if tuple(v_codes.shape) != tuple(k_codes.shape):
        raise ValueError(f"v_codes: shape {tuple(v_codes.shape)} differs from k_codes {tuple(k_codes.shape)}")
    h_kv = k_codes.shape[1]
    if h_q % h_kv:
        raise ValueError(f"q: {h_q} query heads is not a multiple of the {h_kv} KV heads of k_codes")
    for name, s in (("k_scale", k_scale), ("k_zero", k_zero), ("v_scale", v_scale), ("v_zero", v_zero)):
        check_tensor(name, s, dtypes=(torch.float16,), ndim=4, device=dev)
        if tuple(s.shape[:3]) != tuple(k_codes.shape[:3]) or s.shape[3] < 1 or d % s.shape[3]:
            raise ValueError(f"{name}: expected shape {tuple(k_codes.shape[:3])} + (head_dim // group_size,), "
                             f"got {tuple(s.shape)}")
        if s.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous")
    for a, bn in (("k_zero", "k_scale"), ("v_zero", "v_scale")):
        za, sb = {"k_zero": k_zero, "v_zero": v_zero}[a], {"k_scale": k_scale, "v_scale": v_scale}[bn]
        if za.shape != sb.shape or za.stride() != sb.stride():
            raise ValueError(f"{a}: must have the same shape and strides as {bn}")
    check_tensor("block_table", block_table, dtypes=INT_DTYPES, ndim=2, device=dev)
    check_dim("block_table", block_table, 0, b, "batch size of q")
    check_tensor("hist_len", hist_len, dtypes=INT_DTYPES, ndim=1, device=dev)
    check_dim("hist_len", hist_len, 0, b, "batch size of q")


def _check_window(q, k_win, v_win, slot_ids, win_len) -> None:
    b, h_q, d = q.shape
    dev = q.device
    for name, w in (("k_win", k_win), ("v_win", v_win)):
        check_tensor(name, w, dtypes=FLOAT_DTYPES, ndim=4, device=dev)
        check_dim(name, w, 3, d, "head_dim of q")
        if w.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous")
    if k_win.shape != v_win.shape or k_win.dtype != v_win.dtype:
        raise ValueError(f"v_win: shape/dtype {tuple(v_win.shape)}/{v_win.dtype} differ from k_win "
                         f"{tuple(k_win.shape)}/{k_win.dtype}")
    if h_q % k_win.shape[1]:
        raise ValueError(f"q: {h_q} query heads is not a multiple of the {k_win.shape[1]} KV heads of k_win")
    for name, ix in (("slot_ids", slot_ids), ("win_len", win_len)):
        check_tensor(name, ix, dtypes=INT_DTYPES, ndim=1, device=dev)
        check_dim(name, ix, 0, b, "batch size of q")


def _scale(sm_scale: float | None, d: int) -> float:
    return float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)


def _partials(q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, h_q, d = q.shape
    return (torch.empty(b, h_q, splits, d, dtype=torch.float32, device=q.device),
            torch.empty(b, h_q, splits, dtype=torch.float32, device=q.device))


# ------------------------------------------------------------------------------------------------- API
def int2_decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                          sm_scale: float | None = None, num_splits: int | None = None, backend: str = "auto",
                          block_n: int = BLOCK_N, num_warps: int = INT2_NUM_WARPS, num_stages: int = 3,
                          impl: int | None = None, prefetch: bool = False, whole_pages: bool = False):
    """Decode attention over the paged INT2 history.

    Args:
        q: `[B, H_q, d]` (rotated by R_K). k/v_codes: uint8 `[num_pages, H_kv, P, d // 4]`;
        k/v_scale, k/v_zero: fp16 `[num_pages, H_kv, P, d // G]`; block_table: int `[B, max_pages]`;
        hist_len: int `[B]`. num_splits: split-K factor (default from shapes, `default_num_splits`).
        block_n, num_warps, num_stages, impl, prefetch: kernel tuning (see `triton_int2`; impl None =
        `INT2_IMPL`). whole_pages: promise that every hist_len is a multiple of the page size (as PagedKVCache
        keeps it); the default kernel then skips all masking (tokens of a partial last page would be ignored).
    Returns:
        o fp32 `[B, H_q, d]` (0 where hist_len == 0), lse fp32 `[B, H_q]` (-inf where hist_len == 0).
    """
    _check_q(q)
    _check_int2(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len)
    scale = _scale(sm_scale, q.shape[2])
    if resolve_backend(backend, q.device) == "torch":
        return paged_ref.int2_decode_attention_ref(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                                   block_table, hist_len, scale)
    from runtime_kernels.attention.triton_int2 import launch_int2_decode

    q = q.contiguous()
    impl = INT2_IMPL if impl is None else impl
    splits = num_splits or int2_num_splits(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                                           hist_len, block_n, num_warps, num_stages, impl, whole_pages)
    o_part, lse_part = _partials(q, splits)
    launch_int2_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                       o_part, lse_part, scale, splits, 0, block_n, num_warps, num_stages, impl, prefetch,
                       whole_pages=whole_pages)
    return _merge().reduce_splits_triton(o_part, lse_part)


def window_attention(q, k_win, v_win, slot_ids, win_len, sm_scale: float | None = None, backend: str = "auto",
                     num_splits: int | None = None, block_n: int = BLOCK_N):
    """Decode attention over the full-precision window of each sequence.

    Args:
        q: `[B, H_q, d]`; k_win, v_win: `[num_slots, H_kv, W, d]`; slot_ids, win_len: int `[B]`.
    Returns:
        o fp32 `[B, H_q, d]`, lse fp32 `[B, H_q]` (0 / -inf where win_len == 0).
    """
    _check_q(q)
    _check_window(q, k_win, v_win, slot_ids, win_len)
    scale = _scale(sm_scale, q.shape[2])
    if resolve_backend(backend, q.device) == "torch":
        return paged_ref.window_attention_ref(q, k_win, v_win, slot_ids, win_len, scale)
    from runtime_kernels.attention.triton_window import launch_window_decode

    q = q.contiguous()
    splits = num_splits or default_num_splits(q.shape[0], k_win.shape[1], k_win.shape[2], q.device, block_n=block_n,
                                              min_tokens=block_n)
    o_part, lse_part = _partials(q, splits)
    launch_window_decode(q, k_win, v_win, slot_ids, win_len, o_part, lse_part, scale, splits, 0, block_n)
    return _merge().reduce_splits_triton(o_part, lse_part)


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Exact log-sum-exp merge: o `[..., d]`, lse `[...]` of two disjoint key sets -> (o fp32, lse fp32)."""
    for name, t in (("o_a", o_a), ("o_b", o_b)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, device=o_a.device)
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, device=o_a.device)
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_b: shape {tuple(o_b.shape)} differs from o_a {tuple(o_a.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != tuple(o_a.shape[:-1]):
            raise ValueError(f"{name}: expected shape {tuple(o_a.shape[:-1])} (o without its last dim), "
                             f"got {tuple(t.shape)}")
    return _merge().merge_pair(o_a, lse_a, o_b, lse_b)


def _grid_launch(q, k_codes, k_scale, v_codes, k_win, impl: int, block_n: int, fused: bool | None,
                 window_splits: int | None) -> str | None:
    """Which launch of the fused kernel's grid (history and window programs) a call takes: "fused" (one launch, the
    split reduce in the kernel: `fused`, default `DECODE_FUSED`), "shared" (two: `DECODE_SHARED_GRID`, no explicit
    window split count), or None where that grid does not apply (other kernels, fp32 windows) or is not asked for:
    then three launches."""
    from runtime_kernels.attention import triton_fused

    fused = DECODE_FUSED if fused is None else bool(fused)
    if not (fused or (DECODE_SHARED_GRID and not window_splits)):
        return None
    if not triton_fused.fused_ok(q, k_codes, k_scale, v_codes, k_win, impl, block_n):
        return None
    return "fused" if fused else "shared"


def _fused_splits(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len, k_win, v_win,
                  slot_ids, win_len, block_n, num_warps, num_stages, impl, whole_pages,
                  merge: bool = True) -> tuple[int, int]:
    """(history, window) splits of the fused kernel's grid (merge=False: the two-launch mode): whole waves of its
    own compiled kernel."""
    from runtime_kernels.attention import triton_fused

    slots = triton_fused.resident_programs_per_sm(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                                                  hist_len, k_win, v_win, slot_ids, win_len, block_n, num_warps,
                                                  num_stages, impl, whole_pages, merge)
    return _splits_for_slots(q, k_codes, block_table, block_n, slots), triton_fused.window_splits(k_win.shape[2])


def decode_num_splits(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len, k_win, v_win,
                      slot_ids, win_len, block_n: int = BLOCK_N, num_warps: int = INT2_NUM_WARPS,
                      num_stages: int = 3, impl: int | None = None, whole_pages: bool = False,
                      fused: bool | None = None) -> tuple[int, int]:
    """(history splits, window splits) that `decode_attention` launches by default on the Triton path: whole waves of
    the kernel that runs (the fused kernel's grid in its one- or two-launch form where it applies, `_grid_launch`),
    from shapes and compiled kernels only."""
    impl = INT2_IMPL if impl is None else impl
    launch = _grid_launch(q, k_codes, k_scale, v_codes, k_win, impl, block_n, fused, None)
    if launch is not None:
        return _fused_splits(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len, k_win,
                             v_win, slot_ids, win_len, block_n, num_warps, num_stages, impl, whole_pages,
                             merge=launch == "fused")
    return (int2_num_splits(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len, block_n,
                            num_warps, num_stages, impl, whole_pages),
            default_num_splits(q.shape[0], k_codes.shape[1], k_win.shape[2], q.device, block_n=block_n,
                               min_tokens=block_n))


def decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                     k_win, v_win, slot_ids, win_len, sm_scale: float | None = None, num_splits: int | None = None,
                     window_splits: int | None = None, backend: str = "auto", block_n: int = BLOCK_N,
                     num_warps: int = INT2_NUM_WARPS, num_stages: int = 3, impl: int | None = None,
                     prefetch: bool = False, validate: bool = True, whole_pages: bool = False,
                     counters: torch.Tensor | None = None, fused: bool | None = None):
    """Full decode attention over history (INT2) + window (BF16). Arguments as in `int2_decode_attention`
    and `window_attention`. Returns o fp32 `[B, H_q, d]` (R_V basis), lse fp32 `[B, H_q]`.

    Triton path, for the default kernel with half windows: one launch (`triton_fused`: INT2 splits, window splits
    and the split reduce by the last program of each KV head) when `fused` (None: `DECODE_FUSED`, False) asks for
    it, fewer host microseconds for eager callers; otherwise two (`DECODE_SHARED_GRID`: the same grid of history and
    window programs, then the split reduce), the faster path under CUDA graphs. Other kernels, fp32 windows, an
    explicit `window_splits` or `DECODE_SHARED_GRID = False` take three launches (INT2 kernel and window kernel into
    one split buffer, then the reduce). `counters`: int32
    `[>= B * H_kv]`, zero, for the fused launch's arrival counts (it leaves them zero); None allocates a fresh one
    per call (one small memset). Calls that may run concurrently must not share one. `window_splits` applies to
    the three-launch path (given, it also selects it).

    `whole_pages=True` promises that every hist_len is a multiple of the page size (PagedKVCache's invariant),
    which lets the default INT2 kernel skip all masking (56 fewer instructions per 64-token tile).

    `validate=False` skips the argument checks (about 10 % of the host time of an eager call on an H200 host,
    `bench/results/host_overhead_NVIDIA_H200.txt`): only for callers that built the pools and tables themselves,
    like `PagedKVCache`, which checks them once."""
    if validate:
        _check_q(q)
        _check_int2(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len)
        _check_window(q, k_win, v_win, slot_ids, win_len)
        if k_win.shape[1] != k_codes.shape[1]:
            raise ValueError(f"k_win: {k_win.shape[1]} KV heads, but k_codes has {k_codes.shape[1]}")
    scale = _scale(sm_scale, q.shape[2])
    if resolve_backend(backend, q.device) == "torch":
        o_h, l_h = paged_ref.int2_decode_attention_ref(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                                       block_table, hist_len, scale)
        o_w, l_w = paged_ref.window_attention_ref(q, k_win, v_win, slot_ids, win_len, scale)
        return _merge().merge_pair(o_h, l_h, o_w, l_w)
    from runtime_kernels.attention.triton_int2 import launch_int2_decode
    from runtime_kernels.attention.triton_window import launch_window_decode

    q = q.contiguous()
    b, _, _ = q.shape
    h_kv = k_codes.shape[1]
    impl = INT2_IMPL if impl is None else impl
    launch = _grid_launch(q, k_codes, k_scale, v_codes, k_win, impl, block_n, fused, window_splits)
    if launch is not None:
        # The fused kernel's grid (history and window programs): one launch with the split reduce done by the last
        # program of each KV head, or two with the reduce as a launch of its own (DECODE_SHARED_GRID).
        from runtime_kernels.attention import triton_fused

        in_kernel_reduce = launch == "fused"
        if not in_kernel_reduce:
            counters = None
        elif counters is None:
            counters = torch.zeros(b * h_kv, dtype=torch.int32, device=q.device)
        elif validate:
            check_tensor("counters", counters, dtypes=(torch.int32,), ndim=1, device=q.device)
            if counters.numel() < b * h_kv or not counters.is_contiguous():
                raise ValueError(f"counters: expected a contiguous int32 tensor of at least B * H_kv = "
                                 f"{b * h_kv} elements, got shape {tuple(counters.shape)}")
        if num_splits:
            s_h, s_w = num_splits, triton_fused.window_splits(k_win.shape[2])
        else:  # the fused kernel applies (checked above), so its own split rule directly
            s_h, s_w = _fused_splits(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                                     k_win, v_win, slot_ids, win_len, block_n, num_warps, num_stages, impl,
                                     whole_pages, merge=in_kernel_reduce)
        out = triton_fused.launch_decode_fused(
            q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len, k_win, v_win, slot_ids,
            win_len, counters, scale, s_h, s_w, block_n, num_warps, num_stages, impl, whole_pages,
            merge=in_kernel_reduce)
        return out if in_kernel_reduce else _merge().reduce_splits_triton(*out)
    s_h = num_splits or int2_num_splits(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                                        hist_len, block_n, num_warps, num_stages, impl, whole_pages)
    s_w = window_splits or default_num_splits(b, h_kv, k_win.shape[2], q.device, block_n=block_n,
                                              min_tokens=block_n)  # = decode_num_splits without the fused kernel
    o_part, lse_part = _partials(q, s_h + s_w)
    launch_int2_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, hist_len,
                       o_part, lse_part, scale, s_h, 0, block_n, num_warps, num_stages, impl, prefetch,
                       whole_pages=whole_pages)
    launch_window_decode(q, k_win, v_win, slot_ids, win_len, o_part, lse_part, scale, s_w, s_h, block_n)
    return _merge().reduce_splits_triton(o_part, lse_part)


def rotate_queries(q: torch.Tensor, k_rotation: torch.Tensor) -> torch.Tensor:
    """`q [B, H_q, d] @ R_K[h // g]` per query head (g = H_q / H_kv); k_rotation `[H_kv, d, d]`. Returns q's dtype.
    Done at run time because RoPE sits between q_proj and the rotation, so R_K cannot be folded into q_proj."""
    b, h_q, d = q.shape
    h_kv = k_rotation.shape[0]
    qg = q.reshape(b, h_kv, h_q // h_kv, d).transpose(0, 1).to(k_rotation.dtype)  # [H_kv, B, g, d]
    out = torch.matmul(qg.reshape(h_kv, -1, d), k_rotation)
    return out.reshape(h_kv, b, h_q // h_kv, d).transpose(0, 1).reshape(b, h_q, d).to(q.dtype)


def unrotate_output(o: torch.Tensor, v_rotation: torch.Tensor) -> torch.Tensor:
    """`o [B, H_q, d] @ R_V[h // g]^T` per query head: back from the rotated value basis (can instead be folded
    into o_proj). v_rotation `[H_kv, d, d]`."""
    b, h_q, d = o.shape
    h_kv = v_rotation.shape[0]
    og = o.reshape(b, h_kv, h_q // h_kv, d).transpose(0, 1).to(v_rotation.dtype)
    out = torch.matmul(og.reshape(h_kv, -1, d), v_rotation.transpose(-1, -2))
    return out.reshape(h_kv, b, h_q // h_kv, d).transpose(0, 1).reshape(b, h_q, d).to(o.dtype)
