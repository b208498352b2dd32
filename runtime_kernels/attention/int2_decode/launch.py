"""Host side of the INT2 decode kernels: the options object, which kernel takes a call, split counts, launches.

Every call takes its inputs as records (`records.PagePools`, `records.BatchMetadata`, `records.Windows`) and builds
one `DecodePlan` (`plan_decode`: which kernel runs and why, and its compile-time arguments), logged at DEBUG; split
counts, compiled-kernel keys and launches read that plan, so the kernel choice is made once per call.

Paths (`decode`):
- production grid (`fused.py`): fp16/bf16 queries and windows, one scale group per row, int16-viewable code rows,
  page size a multiple of the tile. Two launches (history + window programs, then `merge.reduce_splits_triton`),
  or one with `DecodeOptions.fused` (the split reduce by the last program of each KV head).
- otherwise three launches: the history kernel (`kernel.py`, or `fallback.py` for the inputs it does not take), the
  window kernel (`window.py`), the reduce.
Nothing here reads a module-level switch: every choice is an input or a field of `DecodeOptions`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from runtime_kernels import step_kernels
from runtime_kernels.attention.int2_decode import fallback, fused, kernel, merge, window
from runtime_kernels.attention.int2_decode.common import interpreting
from runtime_kernels.attention.int2_decode.pools import paired_v_pools, quad_pools
from runtime_kernels.attention.int2_decode.records import BatchMetadata, PagePools, Windows
from runtime_kernels.launch_util import next_pow2

TILE_TOKENS = 64  # the production kernel's whole-page tile: four 16-token MMA pieces

LOG = logging.getLogger(__name__)  # DEBUG: the plan of every decode call (`DecodePlan`)


@dataclass(frozen=True)
class DecodeOptions:
    """Launch choices of the decode kernels (frozen, hashable: part of the compiled-kernel cache key).

    - block_n: history tokens per tile (divides the page size in the production kernel).
    - num_warps, num_stages: launch shape of the history programs (1 warp was fastest wherever decode is not
      launch-bound on an H200; `docs/kernels.md`).
    - fused: one launch with the split reduce inside (eager callers) instead of two (CUDA graphs).
    - waves: whole waves of resident programs per SM that the history splits fill (production kernel on a GPU).
    - programs_per_sm: the fixed split rule where the kernel's occupancy is not known (fallback, interpreter).
    - min_split_tokens: never a history chunk shorter than this.
    - window_block, window_split_tokens: window tile and tokens per window program in the production grid.
    - maxnreg: cap on the registers per thread of the production kernels (None: the compiler's choice); more
      programs then fit an SM, at the price of spills where the cap is below what the loop keeps live.
    - pdl: the two-launch grid's split reduce as a programmatic dependent launch (compiled, Hopper or later): its
      programs start while the grid drains and wait for its partials. 0/1 or a bool.
    - prefetch_tiles: each history program of the whole-page loop asks L2 for its first tiles' codes and scales
      before its query prologue (compiled launches; 0: none), so their HBM latency overlaps the prologue. One tile
      (the default) was 0.3-7 % faster than none at all eight points timed on an H100; two were no faster than one
      (`docs/kernels.md`).
    """

    block_n: int = TILE_TOKENS
    num_warps: int = 1
    num_stages: int = 3
    fused: bool = False
    waves: int = 1
    programs_per_sm: int = 32
    min_split_tokens: int = 4 * TILE_TOKENS
    window_block: int = 16
    window_split_tokens: int = 32
    maxnreg: int | None = None
    pdl: bool = False
    prefetch_tiles: int = 1

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps", "num_stages", "waves", "programs_per_sm", "min_split_tokens",
                     "window_block", "window_split_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DecodeOptions.{name}: expected a positive integer, got {v!r}")
        if self.maxnreg is not None and (not isinstance(self.maxnreg, int) or not 24 <= self.maxnreg <= 255):
            raise ValueError(f"DecodeOptions.maxnreg: expected None or an integer in [24, 255], got {self.maxnreg!r}")
        if self.pdl not in (0, 1):  # True and False are 1 and 0; --options passes integers
            raise ValueError(f"DecodeOptions.pdl: expected a bool (or 0/1), got {self.pdl!r}")
        if not isinstance(self.prefetch_tiles, int) or not 0 <= self.prefetch_tiles <= 2:
            raise ValueError(f"DecodeOptions.prefetch_tiles: expected 0, 1 or 2, got {self.prefetch_tiles!r}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"DecodeOptions.block_n: expected a power of two >= 16, got {self.block_n}")

    def launch_kwargs(self) -> dict:
        """Triton launch options of the production kernels: warps, stages and (when set) the register cap."""
        kw = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None:
            kw["maxnreg"] = self.maxnreg
        return kw


DEFAULT_OPTIONS = DecodeOptions()

_SM_COUNT: dict[int, int] = {}  # device index -> SM count (a cache, not a switch)
_SLOTS: dict[tuple, int] = {}  # compiled-kernel key -> programs resident per SM


# ----------------------------------------------------------------------------------------------- split counts
def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 4 under the interpreter (a few splits, enough to exercise the reduce)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def max_chunks(max_tokens: int, block_n: int, min_tokens: int) -> int:
    """The most splits a sequence of `max_tokens` takes: no chunk shorter than max(min_tokens, block_n)."""
    return max(1, -(-max_tokens // max(min_tokens, block_n)))


def default_num_splits(batch: int, kv_heads: int, max_tokens: int, device: torch.device, programs_per_sm: int,
                       block_n: int, min_tokens: int) -> int:
    """Splits per (sequence, KV head) so that about `programs_per_sm` programs run per SM, never a chunk shorter
    than `max(min_tokens, block_n)` tokens. From shapes only (capacity of the block table): never syncs the GPU."""
    want = -(-programs_per_sm * sm_count(device) // max(1, batch * kv_heads))
    return max(1, min(max_chunks(max_tokens, block_n, min_tokens), want))


def splits_for_slots(q, pages: PagePools, batch: BatchMetadata, slots: int | None, opts: DecodeOptions) -> int:
    """History splits: `opts.waves` whole waves of `slots` programs per SM, or the fixed rule where slots is None."""
    b, h_kv, max_tokens = q.shape[0], pages.kv_heads, batch.block_table.shape[1] * pages.page_size
    if slots is None:
        return default_num_splits(b, h_kv, max_tokens, q.device, opts.programs_per_sm, opts.block_n,
                                  opts.min_split_tokens)
    waves = int(opts.waves * slots * sm_count(q.device)) // max(1, b * h_kv)
    return max(1, min(max_chunks(max_tokens, opts.block_n, opts.min_split_tokens), waves))


def window_num_splits(q, windows: Windows, opts: DecodeOptions) -> int:
    """Window splits of the three-launch path (tiles of block_n rows)."""
    k_win = windows.k_win
    return default_num_splits(q.shape[0], k_win.shape[1], k_win.shape[2], q.device, 8, opts.block_n, opts.block_n)


def grid_window_splits(win_capacity: int, opts: DecodeOptions) -> int:
    """Window programs per (sequence, KV head) in the production grid: `window_split_tokens` rows each."""
    return max(1, -(-win_capacity // opts.window_split_tokens))


def programs_per_sm_limit(n_regs: int, shared_bytes: int, num_warps: int, regs_per_sm: int = 65536,
                          smem_per_sm: int = 233472, threads_per_sm: int = 2048, max_blocks: int = 32) -> int:
    """Programs of a compiled kernel that one SM holds at once: the tightest of registers, shared memory (1 KiB
    reserved per block), threads and the block limit. Defaults: Hopper. Registers follow CUDA's occupancy rules:
    allocated per warp in units of 256, and a warp's registers come from one of the SM's 4 sub-partitions, so
    warps per SM = 4 * floor(regs_per_sm / 4 / regs_per_warp) (136 registers: 12 warps, not 15)."""
    regs_per_warp = -(-max(1, n_regs) * 32 // 256) * 256
    by_regs = 4 * (regs_per_sm // 4 // regs_per_warp) // num_warps
    by_smem = smem_per_sm // (shared_bytes + 1024)
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(max_blocks, by_regs, by_smem, by_threads))


def _slots_of(compiled, num_warps: int, device) -> int:
    """Programs per SM of a compiled kernel on `device`."""
    props = torch.cuda.get_device_properties(device)
    if getattr(compiled, "n_regs", None) is None:  # a kernel compiled by `warmup` loads (and counts) lazily
        compiled._init_handles()
    return programs_per_sm_limit(int(compiled.n_regs), int(compiled.metadata.shared), num_warps,
                                 int(getattr(props, "regs_per_multiprocessor", 65536)),
                                 int(getattr(props, "shared_memory_per_multiprocessor", 233472)),
                                 int(getattr(props, "max_threads_per_multi_processor", 2048)))


def cached_slots(key: tuple, compile_only, num_warps: int, device) -> int:
    """Programs per SM of the kernel that `compile_only()` compiles (without launching), once per `key`."""
    if key not in _SLOTS:
        _SLOTS[key] = _slots_of(compile_only(), num_warps, device)
    return _SLOTS[key]


# ----------------------------------------------------------------------------------------------- kernel choice
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


def int16_views(k_codes, v_codes) -> tuple:
    """The code pools as the production kernel reads them: int16 words (8 codes each), strides in int16 units."""
    return k_codes.view(torch.int16), v_codes.view(torch.int16)


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
    if full and v_scale.dtype == torch.uint8 and not quad:
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
    - scale_format: "float16" or "ue5m3" (the pools' dtype); centered: the pools hold x - mean.
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


def _logged(plan: DecodePlan) -> DecodePlan:
    if LOG.isEnabledFor(logging.DEBUG):
        LOG.debug("decode plan: %s", plan)
    return plan


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
