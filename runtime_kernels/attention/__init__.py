"""Decode attention over the three-segment INT2 KV cache: functional API with backend dispatch.

`backend="auto"` = Triton for CUDA tensors or when TRITON_INTERPRET=1 is set, otherwise the torch references
of `int2_decode.naive`. Layout of the pools, windows and tables: see that module's docstring; the kernels and
their launcher live in `int2_decode/` (README.md there explains the bit tricks).

Inputs travel as three records (`int2_decode/records.py`, no Triton needed to build them): `PagePools` (one layer's
INT2 pages, and the means of a centered cache), `Windows` (its full-precision windows) and `BatchMetadata` (block
table, history and window lengths, window slots, the whole-pages promise).

- `int2_decode_attention`: split-K over the paged INT2 history -> (o, lse)
- `window_attention`: over the BF16 sink + recent window -> (o, lse)
- `merge_attention`: exact log-sum-exp merge of two partials
- `decode_attention`: both segments with one shared split buffer and a single reduce (fewest launches)
- `rotate_queries` / `unrotate_output`: apply R_K to queries and R_V^T to outputs per KV head.
- `decode_plan`: which kernel and tile loop a call takes, and why (every call also logs it at DEBUG to
  `runtime_kernels.attention.int2_decode.launch`).
Queries must already be rotated by R_K; outputs are in the R_V basis. Launch choices: `DecodeOptions`.
"""

from __future__ import annotations

import dataclasses
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
from runtime_kernels.attention import naive
from runtime_kernels.attention.int2_decode import naive as paged_ref
from runtime_kernels.attention.int2_decode.records import BatchMetadata, PagePools, Windows
from runtime_kernels.format import KVFormat, KVFormatError
from runtime_kernels.quant.naive import SCALE_STORAGE


def _launch():
    """The launcher imports triton; load it only when used (TRITON_INTERPRET must be set before)."""
    from runtime_kernels.attention.int2_decode import launch

    return launch


def __getattr__(name: str):
    # `DecodeOptions` / `DEFAULT_OPTIONS` (int2_decode/options.py) and `DecodePlan` (int2_decode/plan.py): neither
    # imports Triton; resolved on first use all the same.
    if name in ("DecodeOptions", "DEFAULT_OPTIONS"):
        from runtime_kernels.attention.int2_decode import options

        return getattr(options, name)
    if name == "DecodePlan":
        from runtime_kernels.attention.int2_decode.plan import DecodePlan

        return DecodePlan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_OPTIONS",
    "BatchMetadata",
    "DecodeOptions",
    "DecodePlan",
    "PagePools",
    "Windows",
    "decode_attention",
    "decode_num_splits",
    "decode_plan",
    "int2_decode_attention",
    "merge_attention",
    "naive",
    "paged_ref",
    "rotate_queries",
    "unrotate_output",
    "window_attention",
]


def _options(options, fused: bool | None):
    """The call's `DecodeOptions`: `options` (default `DEFAULT_OPTIONS`) with `fused` overriding its field."""
    from runtime_kernels.attention.int2_decode import options as launch  # the options alone: no Triton import

    opts = launch.DEFAULT_OPTIONS if options is None else options
    if not isinstance(opts, launch.DecodeOptions):
        raise TypeError(f"options: expected a DecodeOptions, got {type(opts).__name__}")
    return opts if fused is None or bool(fused) == opts.fused else dataclasses.replace(opts, fused=bool(fused))


# ----------------------------------------------------------------------------------------------- checks
def _check_q(q: torch.Tensor) -> None:
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    check_head_dim("q", q.shape[2])


def _check_record(name: str, value, kind: type) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{name}: expected a {kind.__name__} (runtime_kernels.attention.{kind.__name__}), got "
                        f"{type(value).__name__}")


def _check_pages(q, pages: PagePools) -> PagePools:
    """The INT2 pools against q `[B, H_q, d]`. Returns them with the means of a centered cache as fp32 contiguous
    `[H_kv, d]` tensors (the same record when they already are)."""
    _check_record("pages", pages, PagePools)
    b, h_q, d = q.shape
    dev = q.device
    k_codes, v_codes = pages.k_codes, pages.v_codes
    for name, c in (("k_codes", k_codes), ("v_codes", v_codes)):
        check_tensor(f"pages.{name}", c, dtypes=(torch.uint8,), ndim=4, device=dev)
        check_dim(f"pages.{name}", c, 3, d // 4, "head_dim // 4 packed bytes per row")
        if c.stride(-1) != 1:
            raise ValueError(f"pages.{name}: last dim must be contiguous")
    if tuple(v_codes.shape) != tuple(k_codes.shape):
        raise ValueError(f"pages.v_codes: shape {tuple(v_codes.shape)} differs from pages.k_codes "
                         f"{tuple(k_codes.shape)}")
    h_kv = k_codes.shape[1]
    if h_q % h_kv:
        raise ValueError(f"q: {h_q} query heads is not a multiple of the {h_kv} KV heads of pages.k_codes")
    fmt = _check_format(pages, d)
    # Scale and zero are stored as the format's scale format says: fp16, or uint8 (ue5m3 scale, zero in 1/64 code).
    stored = SCALE_STORAGE[fmt.scale_format]
    groups = d // fmt.group(d)
    for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
        s = getattr(pages, name)
        check_tensor(f"pages.{name}", s, ndim=4, device=dev)
        if s.dtype != stored:
            raise TypeError(f"pages.{name}: dtype must be {str(stored).replace('torch.', '')} (pages.fmt.scale_format "
                            f"is '{fmt.scale_format}'), got {str(s.dtype).replace('torch.', '')}")
        if tuple(s.shape) != tuple(k_codes.shape[:3]) + (groups,):
            raise ValueError(f"pages.{name}: expected shape {tuple(k_codes.shape[:3]) + (groups,)} (pages, KV heads, "
                             f"page size, head_dim // pages.fmt group size), got {tuple(s.shape)}")
        if s.stride(-1) != 1:
            raise ValueError(f"pages.{name}: last dim must be contiguous")
    for zero, scale in (("k_zero", "k_scale"), ("v_zero", "v_scale")):
        z, sc = getattr(pages, zero), getattr(pages, scale)
        if z.shape != sc.shape or z.stride() != sc.stride():
            raise ValueError(f"pages.{zero}: must have the same shape and strides as pages.{scale}")
    return _checked_means(pages, q)


def _check_format(pages: PagePools, d: int) -> KVFormat:
    """The pools' format against their page size and head_dim. Returns it."""
    fmt = pages.fmt
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"pages.fmt: expected the KVFormat of the pages (runtime_kernels.format.KVFormat), got "
                        f"{type(fmt).__name__}")
    if fmt.page_size != pages.page_size:
        raise ValueError(f"pages.fmt: page_size is {fmt.page_size}, but pages.k_codes holds pages of "
                         f"{pages.page_size} tokens (shape {tuple(pages.k_codes.shape)})")
    try:
        fmt.group(d)
    except KVFormatError as exc:
        raise ValueError(f"pages.fmt: {exc}") from None
    return fmt


def _checked_means(pages: PagePools, q) -> PagePools:
    """A centered cache's means: both fp32-castable `[H_kv, d]` tensors on q's device when `pages.fmt.centered`,
    else both None. Returns the record with them fp32 and contiguous (no copy when they already are)."""
    k_mean, v_mean = pages.k_mean, pages.v_mean
    if not pages.fmt.centered:
        if k_mean is not None or v_mean is not None:
            raise ValueError(f"pages.{'k_mean' if k_mean is not None else 'v_mean'}: given, but pages.fmt is not "
                             "centered (pass a centered format, or no means)")
        return pages
    if k_mean is None or v_mean is None:
        raise ValueError(f"pages.{'k_mean' if k_mean is None else 'v_mean'}: a centered cache needs both k_mean and "
                         "v_mean (pages.fmt is centered)")
    want = (pages.kv_heads, q.shape[2])
    out = []
    for name, m in (("k_mean", k_mean), ("v_mean", v_mean)):
        check_tensor(f"pages.{name}", m, dtypes=FLOAT_DTYPES, ndim=2, device=q.device)
        if tuple(m.shape) != want:
            raise ValueError(f"pages.{name}: expected shape {want} (KV heads, head_dim), got {tuple(m.shape)}")
        out.append(m if m.dtype == torch.float32 and m.is_contiguous() else m.float().contiguous())
    if out[0] is k_mean and out[1] is v_mean:
        return pages
    return dataclasses.replace(pages, k_mean=out[0], v_mean=out[1])


def _check_batch(q, batch: BatchMetadata, fields: tuple[str, ...], used_by: str) -> None:
    """The batch's `fields` (of block_table, hist_len, slot_ids, win_len) against q `[B, H_q, d]`."""
    _check_record("batch", batch, BatchMetadata)
    b, dev = q.shape[0], q.device
    for name in fields:
        t = getattr(batch, name)
        if t is None:
            raise ValueError(f"batch.{name}: {used_by} needs it, got None")
        check_tensor(f"batch.{name}", t, dtypes=INT_DTYPES, ndim=2 if name == "block_table" else 1, device=dev)
        check_dim(f"batch.{name}", t, 0, b, "batch size of q")


def _check_windows(q, windows: Windows) -> None:
    _check_record("windows", windows, Windows)
    h_q, d = q.shape[1], q.shape[2]
    k_win, v_win = windows.k_win, windows.v_win
    for name, w in (("k_win", k_win), ("v_win", v_win)):
        check_tensor(f"windows.{name}", w, dtypes=FLOAT_DTYPES, ndim=4, device=q.device)
        check_dim(f"windows.{name}", w, 3, d, "head_dim of q")
        if w.stride(-1) != 1:
            raise ValueError(f"windows.{name}: last dim must be contiguous")
    if k_win.shape != v_win.shape or k_win.dtype != v_win.dtype:
        raise ValueError(f"windows.v_win: shape/dtype {tuple(v_win.shape)}/{v_win.dtype} differ from windows.k_win "
                         f"{tuple(k_win.shape)}/{k_win.dtype}")
    if h_q % k_win.shape[1]:
        raise ValueError(f"q: {h_q} query heads is not a multiple of the {k_win.shape[1]} KV heads of windows.k_win")


def _scale(sm_scale: float | None, d: int) -> float:
    return float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)


def _history_ref(q, pages: PagePools, batch: BatchMetadata, scale: float):
    return paged_ref.int2_decode_attention_ref(q, pages.k_codes, pages.k_scale, pages.k_zero, pages.v_codes,
                                               pages.v_scale, pages.v_zero, batch.block_table, batch.hist_len, scale,
                                               pages.k_mean, pages.v_mean, fmt=pages.fmt)


def _window_ref(q, windows: Windows, batch: BatchMetadata, scale: float):
    return paged_ref.window_attention_ref(q, windows.k_win, windows.v_win, batch.slot_ids, batch.win_len, scale)


# ------------------------------------------------------------------------------------------------- API
def int2_decode_attention(q, pages: PagePools, batch: BatchMetadata, *, sm_scale: float | None = None,
                          num_splits: int | None = None, backend: str = "auto", options=None):
    """Decode attention over the paged INT2 history.

    Args:
        q: `[B, H_q, d]` (rotated by R_K).
        pages: `PagePools` (codes uint8 `[num_pages, H_kv, P, d // 4]`; scale/zero `[num_pages, H_kv, P, d // G]`
            fp16 or uint8 as `pages.fmt.scale_format` says; k_mean, v_mean `[H_kv, d]` when `pages.fmt.centered`,
            else None). A centered cache's history logits get + q.mu_k * sm_scale, the history output + mu_v.
        batch: `BatchMetadata` with block_table int `[B, max_pages]` and hist_len int `[B]`; `batch.whole_pages`
            promises that every hist_len is a multiple of the page size (the production kernel then skips all
            masking; tokens of a partial last page would be ignored).
        num_splits: split-K factor (default from shapes and the compiled kernel).
        options: `DecodeOptions` (None: `DEFAULT_OPTIONS`).
    Returns:
        o fp32 `[B, H_q, d]` (0 where hist_len == 0), lse fp32 `[B, H_q]` (-inf where hist_len == 0).
    """
    _check_q(q)
    pages = _check_pages(q, pages)
    _check_batch(q, batch, ("block_table", "hist_len"), "int2_decode_attention")
    scale = _scale(sm_scale, q.shape[2])
    if resolve_backend(backend, q.device) == "torch":
        return _history_ref(q, pages, batch, scale)
    return _launch().history(q.contiguous(), pages, batch, scale, num_splits, _options(options, None))


def window_attention(q, windows: Windows, batch: BatchMetadata, *, sm_scale: float | None = None,
                     backend: str = "auto", num_splits: int | None = None, options=None):
    """Decode attention over the full-precision window of each sequence.

    Args:
        q: `[B, H_q, d]`; windows: `Windows` (k_win, v_win `[num_slots, H_kv, W, d]`); batch: `BatchMetadata` with
        slot_ids and win_len int `[B]` (block_table and hist_len unused).
    Returns:
        o fp32 `[B, H_q, d]`, lse fp32 `[B, H_q]` (0 / -inf where win_len == 0).
    """
    _check_q(q)
    _check_windows(q, windows)
    _check_batch(q, batch, ("slot_ids", "win_len"), "window_attention")
    scale = _scale(sm_scale, q.shape[2])
    if resolve_backend(backend, q.device) == "torch":
        return _window_ref(q, windows, batch, scale)
    return _launch().windows_only(q.contiguous(), windows, batch, scale, num_splits, _options(options, None))


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
    return paged_ref.merge_pair(o_a, lse_a, o_b, lse_b)


def decode_num_splits(q, pages: PagePools, batch: BatchMetadata, windows: Windows, *, fused: bool | None = None,
                      options=None) -> tuple[int, int]:
    """(history splits, window splits) that `decode_attention` launches by default on the Triton path (whole waves
    of the compiled kernel that runs on a GPU; a fixed rule under the interpreter), from shapes only."""
    return _launch().decode_num_splits(q.contiguous(), pages, batch, windows, _options(options, fused))


def decode_plan(q, pages: PagePools, windows: Windows | None = None, *, whole_pages: bool = False,
                fused: bool | None = None, window_splits: int | None = None, options=None,
                compiled: bool | None = None):
    """The `DecodePlan` of a Triton-path call with these inputs: `decode_attention` with `windows`,
    `int2_decode_attention` with windows None; `whole_pages` as `BatchMetadata.whole_pages`. Fields: kernel
    ("grid" | "production" | "fallback"), launches, whole_pages / int8_scores / scale_layout (the production kernel's
    fast tile loop and how it reads the scale/zero pools), scale_format, centered, compiled, and reason: why each
    faster choice was not taken ("" on the fastest path). From shapes, dtypes and strides only: no GPU needed.
    compiled: the target (True: a compiled GPU launch; False: the Triton interpreter; None: this process's, which
    every call logs at DEBUG). Needs no Triton (`int2_decode/plan.py`)."""
    from runtime_kernels.attention.int2_decode.plan import plan_decode

    return plan_decode(q, pages, windows, whole_pages, _options(options, fused), window_splits, compiled)


def decode_attention(q, pages: PagePools, batch: BatchMetadata, windows: Windows, *, sm_scale: float | None = None,
                     num_splits: int | None = None, window_splits: int | None = None, backend: str = "auto",
                     validate: bool = True, counters: torch.Tensor | None = None, fused: bool | None = None,
                     options=None, v_rotation: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """Full decode attention over history (INT2) + window (BF16). Arguments as in `int2_decode_attention` and
    `window_attention` (`batch` needs all four tensors). Returns o fp32 `[B, H_q, d]` (R_V basis), lse fp32
    `[B, H_q]`.

    With `v_rotation` (fp32 `[H_kv, d, d]`) o comes back in the model's value basis, `unrotate_output(o, v_rotation,
    out_dtype)` (out_dtype default fp32): on the Triton path inside the split reduce, with no launch of its own (a
    batch-1 decode step is launch-bound; docs/kernels.md), but for the one-launch form (no separate reduce).

    Triton path, for the inputs the production kernel takes with half windows: two launches (history and window
    programs in one grid, then the split reduce; the faster form under CUDA graphs), or one with `fused=True`
    (`DecodeOptions.fused`: the split reduce by the last program of each KV head; fewer host microseconds for eager
    callers). Other inputs, or an explicit `window_splits` without `fused`, take three launches (history kernel,
    window kernel, reduce). Every call builds one `DecodePlan` (see `decode_plan`) and logs it at DEBUG to
    `runtime_kernels.attention.int2_decode.launch`. `counters`: int32 `[>= B * H_kv]`, zero, for the one-launch
    form's arrival counts (it leaves them zero); None allocates a fresh one per call. Calls that may run
    concurrently must not share one.

    A centered cache (`pages.k_mean`, `pages.v_mean`): only the history segment is corrected, so the merge with the
    windows stays exact. With `validate=False` the means must already be fp32 and contiguous.

    `validate=False` skips the argument checks: only for callers that built the pools and tables themselves,
    like `PagedKVCache`, which checks them once."""
    if validate:
        _check_q(q)
        pages = _check_pages(q, pages)
        _check_batch(q, batch, ("block_table", "hist_len", "slot_ids", "win_len"), "decode_attention")
        _check_windows(q, windows)
        if windows.k_win.shape[1] != pages.kv_heads:
            raise ValueError(f"windows.k_win: {windows.k_win.shape[1]} KV heads, but pages.k_codes has "
                             f"{pages.kv_heads}")
        if v_rotation is not None:
            check_tensor("v_rotation", v_rotation, dtypes=(torch.float32,), ndim=3, device=q.device)
            if tuple(v_rotation.shape) != (pages.kv_heads, q.shape[2], q.shape[2]):
                raise ValueError(f"v_rotation: expected shape [H_kv, d, d] = {[pages.kv_heads, q.shape[2], q.shape[2]]}"
                                 f", got {tuple(v_rotation.shape)}")
    if out_dtype is not None and v_rotation is None:  # o stays in the rotated basis, fp32: nothing would honour it
        raise ValueError("out_dtype: only with v_rotation (the kernel that un-rotates o stores it in out_dtype)")
    out_dtype = out_dtype or torch.float32
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected float16, bfloat16 or float32, got {out_dtype}")
    scale = _scale(sm_scale, q.shape[2])
    if resolve_backend(backend, q.device) == "torch":
        o_h, l_h = _history_ref(q, pages, batch, scale)
        o_w, l_w = _window_ref(q, windows, batch, scale)
        o, lse = paged_ref.merge_pair(o_h, l_h, o_w, l_w)
        if v_rotation is None:
            return o, lse
        return unrotate_output(o, v_rotation, out_dtype=out_dtype, validate=False), lse
    opts = _options(options, fused)
    if opts.fused and counters is not None and validate:
        check_tensor("counters", counters, dtypes=(torch.int32,), ndim=1, device=q.device)
        if counters.numel() < q.shape[0] * pages.kv_heads or not counters.is_contiguous():
            raise ValueError(f"counters: expected a contiguous int32 tensor of at least B * H_kv = "
                             f"{q.shape[0] * pages.kv_heads} elements, got shape {tuple(counters.shape)}")
    return _launch().decode(q.contiguous(), pages, batch, windows, scale, num_splits, window_splits, counters, opts,
                            v_rotation, out_dtype)


def _rotation_kernels(backend: str, device: torch.device):
    """`step_kernels` when `backend` resolves to Triton here (imported on first use: the torch path needs no
    Triton), else None."""
    if resolve_backend(backend, device) != "triton":
        return None
    from runtime_kernels import step_kernels

    return step_kernels


def rotate_queries(q: torch.Tensor, k_rotation: torch.Tensor, out_dtype: torch.dtype | None = None,
                   backend: str = "torch", validate: bool = True) -> torch.Tensor:
    """`q [B, H_q, d] @ R_K[h // g]` per query head (g = H_q / H_kv); k_rotation `[H_kv, d, d]`. fp32 products and
    accumulation, one rounding to `out_dtype` (default q's dtype). Done at run time because RoPE sits between q_proj
    and the rotation, so R_K cannot be folded into q_proj. backend "triton" (or "auto" on a GPU): one launch
    (`step_kernels.rotate_heads`, validated unless `validate=False`) instead of cast, GEMM and cast."""
    out_dtype = out_dtype or q.dtype
    kernels = _rotation_kernels(backend, q.device)
    if kernels is not None:
        return kernels.rotate_heads(q, k_rotation, out_dtype=out_dtype, validate=validate)
    b, h_q, d = q.shape
    h_kv = k_rotation.shape[0]
    qg = q.reshape(b, h_kv, h_q // h_kv, d).transpose(0, 1).to(k_rotation.dtype)  # [H_kv, B, g, d]
    out = torch.matmul(qg.reshape(h_kv, -1, d), k_rotation)
    return out.reshape(h_kv, b, h_q // h_kv, d).transpose(0, 1).reshape(b, h_q, d).to(out_dtype)


def unrotate_output(o: torch.Tensor, v_rotation: torch.Tensor, out_dtype: torch.dtype | None = None,
                    backend: str = "torch", validate: bool = True) -> torch.Tensor:
    """`o [B, H_q, d] @ R_V[h // g]^T` per query head: back from the rotated value basis (can instead be folded
    into o_proj). v_rotation `[H_kv, d, d]`; out_dtype default o's dtype; backend as `rotate_queries`."""
    out_dtype = out_dtype or o.dtype
    kernels = _rotation_kernels(backend, o.device)
    if kernels is not None:
        return kernels.rotate_heads(o, v_rotation, transpose=True, out_dtype=out_dtype, validate=validate)
    b, h_q, d = o.shape
    h_kv = v_rotation.shape[0]
    og = o.reshape(b, h_kv, h_q // h_kv, d).transpose(0, 1).to(v_rotation.dtype)
    out = torch.matmul(og.reshape(h_kv, -1, d), v_rotation.transpose(-1, -2))
    return out.reshape(h_kv, b, h_q // h_kv, d).transpose(0, 1).reshape(b, h_q, d).to(out_dtype)
