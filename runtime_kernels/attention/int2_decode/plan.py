"""Which INT2 decode kernel takes a call, and why: `plan_decode` -> `DecodePlan` (kernel, launches, tile loop, the
decode mode of the pages, the reasons each faster choice was not taken, and the kernel's compile-time arguments).

From the records only: shapes, strides and the pages' format (`PagePools.fmt`: scale format and centering are read
there, never guessed from dtypes); no GPU, no Triton import. `launch.py` runs the plan; `attention.decode_plan` and
the caches (`PagedKVCache.decode_plan`, the vLLM startup line) show it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime_kernels.attention.int2_decode.options import TILE_TOKENS, DecodeOptions
from runtime_kernels.attention.int2_decode.pools import paired_v_pools, quad_pools
from runtime_kernels.attention.int2_decode.records import PagePools, Windows
from runtime_kernels.launch_util import interpreting, next_pow2


def production_declines(q, pages: PagePools, opts: DecodeOptions) -> str:
    """Why the production kernel does not take these inputs ("" when it does). It takes half queries, one
    scale/zero group per row, int16-viewable code rows (even byte counts and strides) and pages made of whole
    tiles."""
    k_codes, k_scale = pages.k_codes, pages.k_scale
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype} queries (the production kernel takes fp16/bf16)"
    if k_scale.shape[3] != 1:
        return f"{k_scale.shape[3]} scale groups per row (the production kernel takes one)"
    if k_codes.shape[3] % 2:
        return f"{k_codes.shape[3]} code bytes per row (odd: not int16-viewable)"
    if k_codes.shape[2] % opts.block_n:
        return f"page size {k_codes.shape[2]} is not a multiple of block_n {opts.block_n}"
    for name, t in (("k_codes", k_codes), ("v_codes", pages.v_codes)):
        if t.stride(3) != 1 or any(st % 2 for st in t.stride()[:3]) or t.storage_offset() % 2:
            return f"{name}: odd strides or offset {tuple(t.stride())}/{t.storage_offset()} (not int16-viewable)"
    return ""


def window_declines(windows: Windows) -> str:
    """Why the production grid does not take these windows ("" when it does): it needs half precision."""
    if windows.k_win.dtype not in (torch.float16, torch.bfloat16):
        return f"{windows.k_win.dtype} windows (the grid takes fp16/bf16)"
    return ""


def grid_declines(q, pages: PagePools, windows: Windows, opts: DecodeOptions) -> str:
    """Why the production grid (history + window programs) does not take these inputs ("" when it does): the
    production kernel's inputs and half-precision windows."""
    return window_declines(windows) or production_declines(q, pages, opts)




def tile_path(pages: PagePools, whole_pages: bool, opts: DecodeOptions) -> tuple[bool, bool, str, list]:
    """The production kernel's tile loop -> (whole pages, int8 scores, scale layout, reasons for each fast path not
    taken). The scale layout is how the whole-page loop reads the four scale/zero pools: "quad" (one load per row,
    `pools.quad_pools`), "paired_v" (V scale and zero in one load, `pools.paired_v_pools`) or "separate". fp16 and
    ue5m3 pools share the loop; the loop reads uint8 pools as 32-bit words, so their buffers must start 4-byte
    aligned (torch allocations do; a view at an odd offset takes the masked tiles)."""
    k_codes, v_scale, v_zero = pages.k_codes, pages.v_scale, pages.v_zero
    reasons = []
    full = bool(whole_pages)
    quad = quad_pools(pages.k_scale, pages.k_zero, v_scale, v_zero)  # aligned for its word reads by definition
    paired = not quad and paired_v_pools(v_scale, v_zero)
    if full and pages.fmt.scale_bytes == 1 and not quad:  # one-byte scales are read as 32-bit words
        pools = [pages.k_scale, pages.k_zero, v_scale] + ([] if paired else [v_zero])
        if any(p.data_ptr() % 4 for p in pools):
            full = False
            reasons.append("ue5m3 pools not 4-byte aligned: masked tiles")
    pieces = full and opts.block_n == TILE_TOKENS
    if not full and not reasons:
        reasons.append("whole_pages not promised: masked tiles")
    elif not pieces:
        reasons.append(f"block_n {opts.block_n}: whole tiles in one step (16-token pieces need {TILE_TOKENS})")
    u = k_codes.shape[3] // 2  # int16 words per row
    # int8 score MMAs need 32 or 64 code bytes per row (head_dim 128 or 256)
    ki8 = pieces and u == max(16, next_pow2(u)) and (2 * u) % 32 == 0 and 2 * u <= 64
    if pieces and not ki8:
        reasons.append(f"head_dim {4 * k_codes.shape[3]}: fp16 scores (int8 scores need head_dim 128 or 256)")
    layout = "quad" if pieces and quad else "paired_v" if pieces and paired else "separate"
    if pieces and layout != "quad":
        reasons.append("scale/zero pools not one quad per row (pools.alloc_quad_pools): "
                       + ("a second load per row for the K scale and zero" if paired else "four loads per row"))
    return full, ki8, layout, reasons


def chunk_constexprs(q, pages: PagePools, full: bool, ki8: bool, layout: str, opts: DecodeOptions,
                     compiled: bool) -> dict:
    """Compile-time arguments of `kernel._int2_chunk` (shared by the history kernel and the production grid), for
    the tile loop `tile_path` chose."""
    k_codes = pages.k_codes
    u = k_codes.shape[3] // 2  # int16 words per row
    group = q.shape[1] // k_codes.shape[1]
    return dict(GROUP=group, GP=max(4, next_pow2(group)), Q=q.shape[2] // 4, U=u, U_PAD=max(16, next_pow2(u)),
                P=k_codes.shape[2], BLOCK_N=opts.block_n, INTERP=not compiled, NPV=64, FULL_TILES=full,
                SZ=layout, KI8=ki8, CENTER=pages.centered,
                PF=opts.prefetch_tiles if compiled and full and opts.block_n == TILE_TOKENS else 0)


def fallback_constexprs(q, pages: PagePools, opts: DecodeOptions, compiled: bool) -> dict:
    """Compile-time arguments of `fallback._int2_decode_fallback_kernel`."""
    d, ng = q.shape[2], pages.k_scale.shape[3]
    group = q.shape[1] // pages.kv_heads
    return dict(GROUP=group, G_PAD=max(16, next_pow2(group)), Q=d // 4, Q_PAD=max(16, next_pow2(d // 4)),
                GS=d // ng, NG=ng, P=pages.page_size, BLOCK_N=opts.block_n, FP32=q.dtype.itemsize == 4,
                INTERP=not compiled, KFOLD=ng == 1 and q.dtype == torch.bfloat16, CENTER=pages.centered)


@dataclass(frozen=True)
class DecodePlan:
    """What a decode call runs, and why (`plan_decode`; logged at DEBUG by every call).

    - kernel: "grid" (history and window programs in one grid), "production" (the production history kernel, then
      the window kernel when there are windows) or "fallback" (the plain history kernel).
    - launches: kernel launches of the call (1: grid with the in-kernel reduce; 2: grid + reduce; 3: history,
      window, reduce; history-only calls: 2).
    - whole_pages, int8_scores: the production kernel's fast tile loop (16-token pieces without masks) and its int8
      score MMAs (False off the production kernel).
    - scale_layout: how that loop reads the scale/zero pools: "quad" (a row's four in one load), "paired_v" (V scale
      and zero in one load) or "separate" (also off the pieces loop; `tile_path`).
    - scale_format: "float16" or "ue5m3", and centered (the pools hold x - mean): the decode mode, read from the
      pages' format (`PagePools.fmt`).
    - reason: why each faster choice was not taken ("; "-joined), "" when the call takes the fastest path.
    - compiled: the target the plan is for: a compiled GPU launch (True) or the Triton interpreter (False).
    - constexprs: the history kernel's compile-time arguments (`chunk_constexprs` for "grid" and "production",
      `fallback_constexprs` for "fallback"); not part of the repr or of equality.
    """

    kernel: str
    launches: int
    whole_pages: bool
    int8_scores: bool
    scale_layout: str
    scale_format: str
    centered: bool
    reason: str
    compiled: bool
    constexprs: dict = field(repr=False, compare=False)

    @property
    def production(self) -> bool:
        """The history runs the production kernel (alone, or in the grid)."""
        return self.kernel != "fallback"

    def summary(self) -> str:
        """One line for a user: the kernel, its launches and tile loop, the decode mode, and why each faster choice
        was not taken (the cache's first-decode log and repr, the vLLM startup line)."""
        loop = ("whole-page tiles, " + ("int8" if self.int8_scores else "fp16") + f" scores, {self.scale_layout} "
                "scale loads") if self.whole_pages else "masked tiles"
        mode = f"{self.scale_format} scales{', centered' if self.centered else ''}"
        target = "" if self.compiled else " (Triton interpreter)"
        why = f"slower choices because: {self.reason}" if self.reason else "the fastest path"
        return f"{self.kernel} kernel, {self.launches} launch(es), {loop}, {mode}{target}; {why}"


def plan_decode(q, pages: PagePools, windows: Windows | None, whole_pages: bool, opts: DecodeOptions,
                window_splits: int | None = None, compiled: bool | None = None) -> DecodePlan:
    """The plan of a decode call on the Triton path: `decode` with `windows`, `history` with windows None. From
    shapes, dtypes and strides only (no GPU needed). compiled: the target (None: this process's, a compiled launch
    unless TRITON_INTERPRET=1)."""
    compiled = not interpreting() if compiled is None else bool(compiled)
    production = production_declines(q, pages, opts)
    if windows is None:
        declined, kernel, launches = production, "production", 2
    else:
        declined = window_declines(windows) or production  # grid_declines, with the production check done once
        if not declined and window_splits and not opts.fused:
            declined = "window_splits given without fused: three launches"
        kernel, launches = ("grid", 1 if opts.fused else 2) if not declined else ("production", 3)
    reasons = [declined] if declined else []
    if not production:
        full, ki8, layout, why = tile_path(pages, whole_pages, opts)
        reasons += why
        constexprs = chunk_constexprs(q, pages, full, ki8, layout, opts, compiled)
    else:
        kernel, full, ki8, layout = "fallback", False, False, "separate"
        constexprs = fallback_constexprs(q, pages, opts, compiled)
    return DecodePlan(kernel, launches, full, ki8, layout, pages.scale_format, pages.centered, "; ".join(reasons),
                      compiled, constexprs)



__all__ = ["DecodePlan", "chunk_constexprs", "fallback_constexprs", "grid_declines", "plan_decode",
           "production_declines", "tile_path", "window_declines"]
