"""Three-segment paged KV cache: BF16 sink | INT2 history | BF16 recent (OSCAR_METHOD section 6).

One `PagedKVCache` serves a batch of sequences of different lengths for every calibrated attention layer.

Storage per layer (`LayerPool`; H = KV heads, d = head_dim, G = group size, P = page size):
- INT2 pages: `k_codes, v_codes` uint8 `[num_pages, H, P, d // 4]`, `k_scale, k_zero, v_scale, v_zero`
  fp16 (or uint8 for ue5m3 scales) `[num_pages, H, P, d // G]`, holding clipped and quantized rotated keys/values (with G = d, V scale and
  zero are interleaved views of one buffer: `LayerPool`).
- Full-precision windows: `k_win, v_win` `[num_slots, H, W, d]` in the model's dtype, with
  `W = sink + recent + P - 1`. Like the pages they hold the rotated basis (`k @ R_K`, `v @ R_V`, see
  `rotate_rows`), so one rotated query serves both segments and one `R_V^T` maps the merged output
  back (the layout contract of the kernels; the fused `runtime_kernels.attention.decode_attention` runs
  both segments in one split buffer). Demotion quantizes the stored rotated rows directly.

A page id names the same page in every layer's pool, so the page table, the window slots and the
sequence lengths are host-side bookkeeping shared by all layers; the per-layer work of a step is only
the data movement (`write_layer`) and the attention (`decode_attention`).

Per sequence of `n` tokens (S = sink, R = recent, P = page size):
- sink: positions `[0, min(n, S))` at window rows `[0, min(n, S))`;
- history: positions `[S, S + h)` with `h = P * floor(max(0, n - S - R) / P)`, always whole pages, so a
  page is full and never written again once demoted (shared prefixes can reuse it without copy-on-write);
- recent: positions `[S + h, n)` at window rows `S + (p - S - h)`; it holds between R and R + P - 1
  tokens once the history is non-empty. When it would reach R + P, its oldest P tokens are demoted
  (rotated, clipped, quantized, packed) into one fresh page, and the rest shift down: quantization runs
  once per P decode steps per sequence, a page at a time.
The window of a sequence is therefore always chronological and its valid rows are `[0, win_len)`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime_kernels import attention as attn_api
from runtime_kernels import quant as quant_api
from runtime_kernels._validate import FLOAT_DTYPES, normalize_device, resolve_backend
from runtime_kernels.artifact import ArtifactError, OscarArtifact
from runtime_kernels.attention.int2_decode.pools import alloc_quad_pools, quad_pools
from runtime_kernels.attention.int2_decode.records import BatchMetadata, PagePools, Windows
from runtime_kernels.format import KVFormat
from runtime_kernels.memory_budget import CheckedFit, cache_bytes, check_cache_fits
from runtime_kernels.serving import (  # shared with the vLLM engine; the first four are importable from here too
    MAX_KV_MAGNITUDE,
    MEAN_CHECK_ROWS,
    NonFiniteKVError,
    check_served_format,
    check_served_quantizer,
    mean_far_from_data,
    rotate_rows,
)

LOG = logging.getLogger(__name__)  # INFO: the decode path, once per cache (`PagedKVCache._note_decode_path`)


def _step_kernels():
    """The Triton kernels of a decode step (`step_kernels`), imported on first use: the torch path runs without Triton."""
    from runtime_kernels import step_kernels

    return step_kernels


# ----------------------------------------------------------------------------------------------------------
# Allocators
# ----------------------------------------------------------------------------------------------------------
MAX_PAGES = 2**31 - 1  # page ids live in the int32 block table


class PageAllocator:
    """Reference-counted allocator of INT2 page ids `[0, num_pages)`, shared by all layers.

    A page is returned to the free list when its last holder releases it; shared prefix pages are held
    by every sequence that uses them.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"max_pages: expected at least 1 page, got {num_pages}")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def grow(self, num_pages: int) -> None:
        """Add free page ids `[self.num_pages, num_pages)`; low ids are still handed out first."""
        old = self.num_pages
        self.refcount += [0] * (num_pages - old)
        self._free = list(range(num_pages - 1, old - 1, -1)) + self._free
        self.num_pages = num_pages

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages (refcount 1). Raises without taking any when fewer than `n` are free."""
        if n > len(self._free):
            raise RuntimeError(f"out of INT2 pages: need {n}, {len(self._free)} of {self.num_pages} free "
                               f"(raise max_pages/max_tokens or free finished sequences)")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def retain(self, pages: Sequence[int]) -> None:
        """Add a holder to each page (prefix sharing)."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} is not allocated; cannot share it")
            self.refcount[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop a holder from each page; pages without holders go back to the free list."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} released more often than it was held")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)


@dataclass
class SequenceState:
    """Host-side state of one sequence: its window slot, token count and INT2 pages (in order)."""

    seq_id: int
    slot: int
    length: int = 0
    pages: list[int] | None = None

    def __post_init__(self):
        self.pages = [] if self.pages is None else self.pages


@dataclass
class LayerPool:
    """Device storage and the artifact's transform for one calibrated attention layer, as whole records: the decode
    kernels' `PagePools` (INT2 pages, the means of a centered cache, and the cache's format) and `Windows`, built
    once when the pools are allocated and again when they grow (`PagedKVCache.grow_pages`), and passed as they are
    to every decode call.

    Shapes: codes `[num_pages, H, P, d // 4]` uint8; scale/zero `[num_pages, H, P, d // G]` fp16 or uint8 (ue5m3);
    windows `[num_slots, H, W, d]`; rotations `[H, d, d]` fp32; clip ratios `[H]` fp32 (None = no clipping); means
    fp32 `[H, d]` in the rotated basis (None: uncentered). With one group per row (G = d), k_scale, k_zero, v_scale
    and v_zero are the four quarters of one `[num_pages, H, P, 4]` buffer (row strides 4,
    `int2_decode.pools.alloc_quad_pools`); every other pool is contiguous. The tensors are read through the records
    (`pool.k_codes` is `pool.pages.k_codes`).
    """

    pages: PagePools
    windows: Windows
    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_clip: torch.Tensor | None
    v_clip: torch.Tensor | None

    k_codes = property(lambda self: self.pages.k_codes)
    v_codes = property(lambda self: self.pages.v_codes)
    k_scale = property(lambda self: self.pages.k_scale)
    k_zero = property(lambda self: self.pages.k_zero)
    v_scale = property(lambda self: self.pages.v_scale)
    v_zero = property(lambda self: self.pages.v_zero)
    k_mean = property(lambda self: self.pages.k_mean)
    v_mean = property(lambda self: self.pages.v_mean)
    k_win = property(lambda self: self.windows.k_win)
    v_win = property(lambda self: self.windows.v_win)


@dataclass
class AppendPlan:
    """Data movement of one append step, identical for every layer (built once, applied per layer).

    Let X = cat(window rows `k_win[gather_slots, :, gather_rows]` read before any write, new tokens):
    - demotion: `X[demote_src]` is quantized into `pool[demote_pages, :, demote_rows]`;
    - window: `X[win_src]` is written to `k_win[win_slots, :, win_rows]`.
    All index tensors are int64 `[N_*]` on the cache's device. `num_new` is the total new-token count.
    """

    seq_ids: list[int]
    num_tokens: list[int]
    num_new: int
    gather_slots: torch.Tensor
    gather_rows: torch.Tensor
    demote_src: torch.Tensor
    demote_pages: torch.Tensor
    demote_rows: torch.Tensor
    win_src: torch.Tensor
    win_slots: torch.Tensor
    win_rows: torch.Tensor
    first_positions: list[int] = field(default_factory=list)  # position of each sequence's first new token
    # Which cache booked the plan and in what order: a plan applies to its own cache, once per layer, in booking
    # order (`PagedKVCache._check_plan`). None for a plan not booked by `plan_append` (refused by write_layer).
    owner: object | None = field(default=None, repr=False, compare=False)
    serial: int = 0

    @property
    def append_only(self) -> bool:
        """A decode step in which every new token goes straight to a window row: no window row is read back (no
        gather), no page is demoted, at most one token per sequence (63 decode steps in 64). `PagedKVCache.write_layer`
        writes such a step with one Triton launch; prompts keep the batched torch rotation. Index sizes only: no
        host sync."""
        return (self.gather_rows.numel() == 0 and self.demote_src.numel() == 0
                and all(t <= 1 for t in self.num_tokens))


# ----------------------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------------------
class PagedKVCache:
    """Paged three-segment INT2 KV cache for `A` calibrated layers and up to `max_seqs` live sequences.

    Args:
        k_rotation, v_rotation: fp32 `[A, H, d, d]` (row-vector convention `x_rot = x @ R`).
        k_clip_ratio, v_clip_ratio: fp32 `[A, H]` in (0, 1].
        fmt: the KV format (`runtime_kernels.format.KVFormat`): windows S and R, page size P, group size (divides
            d; None = d), scale format of the pages, quantizer, and whether the cache is centered (then `k_mean`
            and `v_mean` are required, and refused otherwise).
        max_pages: INT2 pages in the pool (shared by all sequences and layers).
        max_seqs: window slots (live sequences at once).
        device, dtype: where the pools live and the dtype of the full-precision windows.
        clip: False disables clipping (the clip ratios are ignored).
        backend: kernel backend, "auto" | "torch" | "triton".
        k_mean, v_mean: float `[A, H, d]` per-(layer, KV head) means in the rotated basis (a centered artifact,
            contract v2 `k_mean`/`v_mean`), or None (uncentered). The pages then hold quant(x_rot - mu) and decode
            adds the means back exactly (`attention.PagePools.k_mean`, `v_mean`); windows stay uncentered.
        check_finite: refuse NaN/Inf (and elements beyond the fp16 scale range) at every write with
            `NonFiniteKVError` (docs/errors.md, "Non-finite keys and values"). Costs one reduction and one
            device-to-host sync per layer write; skipped while a CUDA graph is being captured. False trusts the
            caller (a poisoned element then makes its KV head's outputs NaN for as long as it is cached).
    """

    def __init__(self, k_rotation: torch.Tensor, v_rotation: torch.Tensor, k_clip_ratio: torch.Tensor,
                 v_clip_ratio: torch.Tensor, *, fmt: KVFormat, max_pages: int, max_seqs: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, clip: bool = True,
                 backend: str = "auto", k_mean: torch.Tensor | None = None, v_mean: torch.Tensor | None = None,
                 check_finite: bool = True, fit: CheckedFit | None = None):
        if not isinstance(fmt, KVFormat):
            raise TypeError(f"fmt: expected a KVFormat, got {type(fmt).__name__}")
        for name, t in (("k_rotation", k_rotation), ("v_rotation", v_rotation)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[-1] != t.shape[-2]:
                raise ValueError(f"{name}: expected a tensor [A, H, d, d], got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if v_rotation.shape != k_rotation.shape:
            raise ValueError(f"v_rotation: shape {tuple(v_rotation.shape)} must equal k_rotation's "
                             f"{tuple(k_rotation.shape)}")
        a, h, d, _ = k_rotation.shape
        for name, t in (("k_clip_ratio", k_clip_ratio), ("v_clip_ratio", v_clip_ratio)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (a, h):
                raise ValueError(f"{name}: expected shape {[a, h]}, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if d % 4:
            raise ValueError(f"head_dim: must be a multiple of 4 for 2-bit packing, got {d}")
        for name, t in (("k_mean", k_mean), ("v_mean", v_mean)):
            if fmt.centered and t is None:
                raise ValueError(f"{name}: the format is centered (fmt.centered=True), so the cache needs both k_mean "
                                 f"and v_mean")
            if not fmt.centered and t is not None:
                raise ValueError(f"{name}: given, but the format is not centered (fmt.centered=False); pass a centered "
                                 f"format or no means")
        for name, t in (("k_mean", k_mean), ("v_mean", v_mean)):
            if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (a, h, d)
                                  or not t.is_floating_point()):
                raise ValueError(f"{name}: expected a float tensor of shape {[a, h, d]}, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        g = fmt.group(d)  # KVFormatError (a ValueError naming group_size) when it does not divide head_dim
        if int(max_seqs) < 1:
            raise ValueError(f"max_seqs: expected a positive integer, got {max_seqs}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype: window dtype must be float16, bfloat16 or float32, got {dtype}")

        self.device = normalize_device(device)
        self.fmt = fmt.resolved(d)
        self.scale_format, self.quantizer = fmt.scale_format, fmt.quantizer
        sdt = quant_api.scale_storage_dtype(fmt)
        self.dtype = dtype
        self.num_layers, self.num_kv_heads, self.head_dim, self.group_size = a, h, d, g
        self.page_size, self.sink, self.recent = fmt.page_size, fmt.sink_tokens, fmt.recent_tokens
        self.window = fmt.window_rows
        self.backend = backend
        self.check_finite = bool(check_finite)
        self._broken: dict[int, str] = {}  # sequences whose last write was refused half-way -> why
        if isinstance(max_pages, bool) or not 1 <= int(max_pages) <= MAX_PAGES:
            raise ValueError(f"max_pages: expected an integer in [1, {MAX_PAGES}] (page ids are int32 in the block "
                             f"table), got {max_pages}")
        self.max_seqs = int(max_seqs)
        self._free_slots = list(range(self.max_seqs - 1, -1, -1))
        self._seqs: dict[int, SequenceState] = {}
        self._next_id = 0
        self._meta_cache: tuple[tuple, BatchMetadata] | None = None
        self._version = 0

        n_pages, p, w, s = int(max_pages), self.page_size, self.window, self.max_seqs
        # Refused here, with the size the windows would need, rather than by the allocator half-way through; not
        # again when the caller's check (`fit`, OscarCache's at construction) already covers these pools.
        shape = dict(num_layers=a, num_kv_heads=h, head_dim=d, max_pages=n_pages, max_seqs=s, window_dtype=dtype)
        if fit is None or not fit.covers(self.device, cache_bytes(self.fmt, **shape)[0]):
            check_cache_fits(self.device, self.fmt, **shape)
        self.allocator = PageAllocator(n_pages)  # its free list is O(max_pages) host memory: after the check
        self._token = object()  # what this cache's plans carry (`_check_plan`)
        self._plan_serial = 0
        self._layer_serial = [0] * a  # serial of the last plan each layer applied
        self._means_checked: set[int] = set()  # layers whose means were checked against written data
        self._decode_path: str | None = None  # what decode runs and why, said once at the first decode call

        def zeros(shape, dt):
            return torch.zeros(shape, dtype=dt, device=self.device)

        def scale_zero_pools():
            # One group per row: a row's K scale, K zero, V scale and V zero side by side (one `[pages, H, P, 4]`
            # buffer, same bytes), so the whole-page decode loop reads all four with one load per row
            # (docs/kernels.md, "Scale and zero pools").
            if d // g == 1:
                return alloc_quad_pools(n_pages, h, p, self.device, dtype=sdt)
            return tuple(zeros((n_pages, h, p, d // g), sdt) for _ in range(4))

        def fp32(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(self.device, torch.float32).contiguous()

        self.pools: list[LayerPool] = []
        for i in range(a):
            k_scale, k_zero, v_scale, v_zero = scale_zero_pools()
            pages = PagePools(k_codes=zeros((n_pages, h, p, d // 4), torch.uint8),
                              v_codes=zeros((n_pages, h, p, d // 4), torch.uint8),
                              k_scale=k_scale, k_zero=k_zero, v_scale=v_scale, v_zero=v_zero, fmt=self.fmt,
                              k_mean=fp32(None if k_mean is None else k_mean[i]),
                              v_mean=fp32(None if v_mean is None else v_mean[i]))
            self.pools.append(LayerPool(
                pages=pages,
                windows=Windows(zeros((s, h, w, d), dtype), zeros((s, h, w, d), dtype)),
                k_rotation=fp32(k_rotation[i]),
                v_rotation=fp32(v_rotation[i]),
                k_clip=fp32(k_clip_ratio[i]) if clip else None,
                v_clip=fp32(v_clip_ratio[i]) if clip else None,
            ))
        # Arrival counts of the fused decode launch (one per sequence and KV head; every call leaves them zero). The
        # layers of a step run one after another on one stream, so they share it.
        self._attn_counters = zeros((s * h,), torch.int32)

    @classmethod
    def from_artifact(cls, artifact: OscarArtifact, *, max_pages: int, max_seqs: int, fmt: KVFormat | None = None,
                      device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                      clip: bool = True, backend: str = "auto", check_finite: bool = True,
                      fit: CheckedFit | None = None) -> PagedKVCache:
        """Build a cache for every layer of `artifact`, in `fmt` (default: the artifact's own `kv_format`).

        `fmt` must be the artifact's format but for the page size (pages are the runtime's: the clip fit scores
        every token), and for the windows of an identity artifact (which fitted nothing). Refused, naming the field:
        a quantizer this runtime does not serve (`lloyd_max` codebooks), windows that disagree with the ones a
        calibrated artifact's clips were fitted for, and a group size, scale format, quantizer or centering other
        than the artifact's (they are how its tensors are read). A loaded artifact is not validated again
        (`OscarArtifact.ensure_valid`); `fit`: a memory check already made that may cover these pools.
        """
        if not isinstance(artifact, OscarArtifact):
            raise TypeError(f"artifact: expected an OscarArtifact, got {type(artifact).__name__}")
        artifact.ensure_valid()
        check_served_quantizer(artifact)
        fmt = check_served_format(artifact, fmt)
        return cls(artifact.k_rotation, artifact.v_rotation, artifact.k_clip_ratio, artifact.v_clip_ratio, fmt=fmt,
                   max_pages=max_pages, max_seqs=max_seqs, device=device, dtype=dtype, clip=clip, backend=backend,
                   check_finite=check_finite, fit=fit,
                   # a centered artifact (contract v2) carries its means; the pages want them in the rotated basis
                   k_mean=artifact.key_mean("rotated") if fmt.centered else None,
                   v_mean=artifact.value_mean("rotated") if fmt.centered else None)

    # -- geometry -------------------------------------------------------------------------------------------
    def history_tokens(self, n: int) -> int:
        """INT2 history length of a sequence of `n` tokens: whole pages, leaving R..R+P-1 recent tokens."""
        return self.fmt.history_tokens(n)

    def window_len(self, n: int) -> int:
        """Valid window rows (sink + recent) of a sequence of `n` tokens."""
        return n - self.history_tokens(n)

    # -- sequences ------------------------------------------------------------------------------------------
    def _state(self, seq_id: int) -> SequenceState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"seq_id: no live sequence {seq_id} (live: {sorted(self._seqs)})") from None

    def add_sequence(self) -> int:
        """Register an empty sequence and give it a window slot. Returns its id."""
        if not self._free_slots:
            raise RuntimeError(f"out of window slots: all {self.max_seqs} are in use (raise max_seqs "
                               f"or free finished sequences)")
        seq_id = self._next_id
        self._next_id += 1
        self._seqs[seq_id] = SequenceState(seq_id, self._free_slots.pop())
        self._version += 1
        return seq_id

    def grow_pages(self, num_pages: int) -> None:
        """Enlarge the INT2 page pool to `num_pages` pages (every layer), keeping every page and page id.

        New storage is allocated before anything is swapped, so an out-of-memory error leaves the cache as it
        was. Used by `runtime_kernels.hf.OscarCache` to size itself from the generation instead of by hand.
        """
        old = self.allocator.num_pages
        if int(num_pages) <= old:
            return
        n = int(num_pages)

        def grown(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros((n, *t.shape[1:]))
            out[:old] = t
            return out

        new_pools = []
        for pool in self.pools:
            old_sz = (pool.k_scale, pool.k_zero, pool.v_scale, pool.v_zero)
            if quad_pools(*old_sz):  # keep a row's four scale/zero entries in one buffer (read with one load)
                new_sz = alloc_quad_pools(n, self.num_kv_heads, self.page_size, self.device, dtype=pool.k_scale.dtype)
                for new, cur in zip(new_sz, old_sz):
                    new[:old] = cur
            else:
                new_sz = tuple(grown(t) for t in old_sz)
            new_pools.append((grown(pool.k_codes), grown(pool.v_codes), *new_sz))
        for pool, (kc, vc, ks, kz, vs, vz) in zip(self.pools, new_pools):  # the records, rebuilt once here
            pool.pages = dataclasses.replace(pool.pages, k_codes=kc, v_codes=vc, k_scale=ks, k_zero=kz, v_scale=vs,
                                             v_zero=vz)
        self.allocator.grow(n)
        self._meta_cache = None
        self._version += 1

    def pages_needed(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> int:
        """INT2 pages `plan_append(seq_ids, num_tokens)` would allocate."""
        p = self.page_size
        return sum((self.history_tokens(self._state(s).length + int(t)) - len(self._state(s).pages) * p) // p
                   for s, t in zip(seq_ids, num_tokens))

    def free_sequence(self, seq_id: int) -> None:
        """Drop a finished sequence: release its pages (shared ones stay with their other holders) and slot."""
        st = self._state(seq_id)
        self.allocator.release(st.pages)
        self._free_slots.append(st.slot)
        del self._seqs[seq_id]
        self._broken.pop(seq_id, None)
        self._version += 1

    def fork_sequence(self, seq_id: int) -> int:
        """A new sequence with the same tokens as `seq_id`: its INT2 pages are shared (not copied), its window
        rows are copied in every layer. The pages are immutable once written, so no copy-on-write is needed.
        """
        src = self._state(seq_id)
        self._refuse_broken([seq_id])
        new_id = self.add_sequence()
        dst = self._seqs[new_id]
        self.allocator.retain(src.pages)
        dst.pages, dst.length = list(src.pages), src.length
        n = self.window_len(src.length)
        for pool in self.pools:
            pool.k_win[dst.slot, :, :n] = pool.k_win[src.slot, :, :n]
            pool.v_win[dst.slot, :, :n] = pool.v_win[src.slot, :, :n]
        return new_id

    def seq_len(self, seq_id: int) -> int:
        return self._state(seq_id).length

    def hist_len(self, seq_id: int) -> int:
        return len(self._state(seq_id).pages) * self.page_size

    def pages(self, seq_id: int) -> list[int]:
        return list(self._state(seq_id).pages)

    def slot(self, seq_id: int) -> int:
        return self._state(seq_id).slot

    @property
    def live_sequences(self) -> list[int]:
        return sorted(self._seqs)

    # -- append ---------------------------------------------------------------------------------------------
    def plan_append(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> AppendPlan:
        """Book `num_tokens[i]` new tokens for sequence `seq_ids[i]` and return the data movement for them.

        Commits the new lengths and allocates the pages for demoted tokens; nothing changes when it raises
        (unknown sequence, duplicate ids, or not enough free pages). Apply the plan to every layer with
        `write_layer` before that layer's next attention.
        """
        seq_ids, num_tokens = [int(s) for s in seq_ids], [int(t) for t in num_tokens]
        if len(seq_ids) != len(num_tokens):
            raise ValueError(f"num_tokens: expected one count per sequence ({len(seq_ids)}), got {len(num_tokens)}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids: duplicate ids in {seq_ids}")
        if any(t < 0 for t in num_tokens):
            raise ValueError(f"num_tokens: expected non-negative counts, got {num_tokens}")
        states = [self._state(s) for s in seq_ids]
        self._refuse_broken(seq_ids)
        p = self.page_size
        pages_needed = [(self.history_tokens(st.length + t) - len(st.pages) * p) // p
                        for st, t in zip(states, num_tokens)]
        new_pages = self.allocator.allocate(sum(pages_needed))  # raises before anything changes

        gather_slots, gather_rows, demote_src, demote_pages, demote_rows = [], [], [], [], []
        win_src, win_slots, win_rows = [], [], []
        new_base = []  # offset of each sequence's first new token inside the new-token block
        offset = 0
        for t in num_tokens:
            new_base.append(offset)
            offset += t
        n_gather = 0
        gather_index: list[int] = []  # per sequence: X index of its first gathered row
        # First pass: which old window rows are read (only when the sequence demotes: its rows shift).
        for st, need in zip(states, pages_needed):
            gather_index.append(n_gather)
            if need:
                n_old_recent = st.length - min(st.length, self.sink) - len(st.pages) * p
                rows = range(self.sink, self.sink + n_old_recent) if st.length > self.sink else range(0)
                gather_slots.extend([st.slot] * len(rows))
                gather_rows.extend(rows)
                n_gather += len(rows)
        taken = 0
        for st, t, need, base, g0 in zip(states, num_tokens, pages_needed, new_base, gather_index):
            n_old, hist_old = st.length, len(st.pages) * p
            n_new = n_old + t
            hist_new = self.history_tokens(n_new)
            pages = new_pages[taken:taken + need]
            taken += need

            hist_lo, hist_hi = self.sink + hist_old, self.sink + hist_new  # demoted positions [lo, hi)

            def sources(lo: int, hi: int) -> list[int]:
                # X indices of tokens [lo, hi): gathered old recent rows first, then new tokens.
                split = min(max(lo, n_old), hi)
                return (list(range(g0 + lo - hist_lo, g0 + split - hist_lo))
                        + list(range(n_gather + base + split - n_old, n_gather + base + hi - n_old)))

            demote_src.extend(sources(hist_lo, hist_hi))
            demote_pages.extend(pg for pg in pages for _ in range(p))
            demote_rows.extend(list(range(p)) * need)
            # Window rows to (re)write: every new token, plus the old recent tokens that shift down.
            first = n_old if not need else min(n_old, hist_hi)
            sink_lo, sink_hi = first, min(n_new, self.sink)  # new sink tokens, row = position
            rec_lo = max(first, hist_hi, self.sink)  # recent tokens, row = position - history
            for lo, hi, shift in ((sink_lo, sink_hi, 0), (rec_lo, n_new, hist_new)):
                if hi > lo:
                    win_src.extend(sources(lo, hi))
                    win_slots.extend([st.slot] * (hi - lo))
                    win_rows.extend(range(lo - shift, hi - shift))
            st.length = n_new
            st.pages.extend(pages)
        self._version += 1

        # One host-to-device copy for all index lists of the step.
        lists = (gather_slots, gather_rows, demote_src, demote_pages, demote_rows, win_src, win_slots, win_rows)
        flat = torch.tensor([v for values in lists for v in values], dtype=torch.int64).to(self.device)
        parts = torch.split(flat, [len(values) for values in lists])
        first = [st.length - t for st, t in zip(states, num_tokens)]
        self._plan_serial += 1
        return AppendPlan(seq_ids, num_tokens, offset, *parts, first_positions=first, owner=self._token,
                          serial=self._plan_serial)

    def _check_plan(self, layer: int, plan: AppendPlan) -> None:
        """A plan applies to the cache that booked it, to each layer once and in booking order. Re-applying an
        append-only plan to the same layer rewrites the same window rows (benchmarks and graph replays do that);
        re-applying one that gathers or demotes rows would read rows it already moved, so it is refused."""
        if not isinstance(plan, AppendPlan):
            raise TypeError(f"plan: expected an AppendPlan from plan_append, got {type(plan).__name__}")
        if plan.owner is not self._token:
            raise ValueError("plan: booked by another cache (or not by plan_append); book the step with this cache's "
                             "plan_append")
        last = self._layer_serial[layer]
        if plan.serial < last:
            raise ValueError(f"plan: layer {layer} already applied a later plan (step {last}, this is step "
                             f"{plan.serial}); apply each plan to every layer in the order they were booked")
        if plan.serial == last and not plan.append_only:
            raise ValueError(f"plan: already applied to layer {layer}; applying a step that moves or demotes rows "
                             "twice would corrupt the cache")

    def _check_tokens(self, name: str, x: torch.Tensor, n: int) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: dtype must be float16, bfloat16 or float32, got {x.dtype}")
        want = (n, self.num_kv_heads, self.head_dim)
        if tuple(x.shape) != want:
            raise ValueError(f"{name}: expected shape [tokens, kv_heads, head_dim] = {list(want)}, "
                             f"got {list(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"{name}: expected device {self.device} (the cache's), got {x.device}")

    def write_layer(self, layer: int, plan: AppendPlan, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Apply `plan` to one layer: rotate the new tokens, demote (quantize) a page where due, write the window.

        On the Triton backend an append-only step (`AppendPlan.append_only`) is one launch (`step_kernels.append_rows`:
        rotate, cast, store both windows), or, while the non-finite check runs, the torch rotation, the check and one
        launch that casts and stores; the window rows are the same bits as on the torch path.

        Args:
            layer: index into the cache's layers (the artifact's order).
            keys, values: `[plan.num_new, H, d]` new tokens in the original basis (post-RoPE keys),
                sequence after sequence in the plan's order.
        """
        pool = self._pool(layer)
        self._check_plan(int(layer), plan)
        self._check_tokens("keys", keys, plan.num_new)
        self._check_tokens("values", values, plan.num_new)
        self._layer_serial[int(layer)] = plan.serial  # the checks passed: what follows writes or marks broken
        checking = self.check_finite and not self._capturing()
        fast = plan.append_only and self._triton()
        if fast and not checking:  # one launch: rotate, cast and store the new rows of both windows
            _step_kernels().append_rows(keys, values, pool.k_rotation, pool.v_rotation, plan.win_src, plan.win_slots,
                                        plan.win_rows, pool.k_win, pool.v_win, validate=False)
            return
        k_rot = rotate_rows(keys, pool.k_rotation)  # fp32 `[N, H, d]`: checked before the cast to the window dtype
        v_rot = rotate_rows(values, pool.v_rotation)
        if checking:
            problem = self._find_bad_element(layer, plan, k_rot, v_rot)
            if problem is not None:
                # The plan is booked for every layer, and earlier layers may hold the step: those sequences can
                # no longer be served consistently, so they refuse further use until freed.
                for seq_id in plan.seq_ids:
                    self._broken[seq_id] = problem
                raise NonFiniteKVError(f"{problem}; nothing of layer {layer} was written and sequences "
                                       f"{plan.seq_ids} of this step must be freed (free_sequence) and recomputed")
            problem = self._mean_far_from_data(int(layer), k_rot, v_rot)
            if problem is not None:
                for seq_id in plan.seq_ids:
                    self._broken[seq_id] = problem
                raise ArtifactError(f"{problem}; nothing of layer {layer} was written and sequences {plan.seq_ids} "
                                    "of this step must be freed")
        if fast:  # rows checked: one launch casts and stores them (the same bits as the loop below)
            _step_kernels().append_rows(k_rot, v_rot, pool.k_rotation, pool.v_rotation, plan.win_src, plan.win_slots,
                                        plan.win_rows, pool.k_win, pool.v_win, rotate=False, validate=False)
            return
        for x, win, clip, codes, scale, zero, mean in (
            (k_rot, pool.k_win, pool.k_clip, pool.k_codes, pool.k_scale, pool.k_zero, pool.k_mean),
            (v_rot, pool.v_win, pool.v_clip, pool.v_codes, pool.v_scale, pool.v_zero, pool.v_mean),
        ):
            x = x.to(win.dtype)
            # Read the rows that move before anything is written (sources and targets may overlap).
            src = torch.cat([win[plan.gather_slots, :, plan.gather_rows], x]) if plan.gather_rows.numel() else x
            if plan.demote_src.numel():  # rows are already rotated: (center,) clip, quantize, pack
                quant_api.write_pages(src[plan.demote_src], None, clip, codes, scale, zero, plan.demote_pages,
                                      plan.demote_rows, self.fmt, backend=self.backend, mean=mean)
            if plan.win_src.numel():
                win[plan.win_slots, :, plan.win_rows] = src[plan.win_src]

    def _triton(self) -> bool:
        """True when this cache's kernels are Triton's (resolved per call: `backend` is a public attribute)."""
        return resolve_backend(self.backend, self.device) == "triton"

    # -- non-finite policy ----------------------------------------------------------------------------------
    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _mean_far_from_data(self, layer: int, k_rot: torch.Tensor, v_rot: torch.Tensor) -> str | None:
        """Once per layer, at its first write of at least MEAN_CHECK_ROWS rows (`mean_far_from_data`)."""
        pool = self.pools[layer]
        if layer in self._means_checked or (pool.k_mean is None and pool.v_mean is None):
            return None
        if k_rot.shape[0] < MEAN_CHECK_ROWS:
            return None
        problem = mean_far_from_data(layer, k_rot, v_rot, pool.k_mean, pool.v_mean)
        if problem is None:
            self._means_checked.add(layer)
        return problem

    @staticmethod
    def _all_in_range(*rows: torch.Tensor) -> bool:
        """One host sync: every element finite and within MAX_KV_MAGNITUDE (`torch.maximum` keeps a NaN; NaN fails `<=`)."""
        peak = None
        for x in rows:
            if x.numel():
                p = x.abs().amax()
                peak = p if peak is None else torch.maximum(peak, p.to(peak.dtype))
        return peak is None or bool(peak.float() <= MAX_KV_MAGNITUDE)

    def _find_bad_element(self, layer: int, plan: AppendPlan, k_rot: torch.Tensor, v_rot: torch.Tensor) -> str | None:
        """None when the rotated rows `[N, H, d]` may be stored, else where the first bad element is."""
        if self._all_in_range(k_rot, v_rot):
            return None
        for name, x in (("keys", k_rot), ("values", v_rot)):
            bad = ~(x.abs() <= MAX_KV_MAGNITUDE)  # [N, H, d]; NaN compares False
            if bool(bad.any()):
                token, head, channel = (int(i) for i in bad.nonzero()[0])
                value = float(x[token, head, channel])
                what = "NaN" if value != value else ("infinite" if abs(value) == float("inf") else
                                                     f"{value:.3g}, beyond the fp16 range of the INT2 page scales")
                b, seq_start = 0, 0
                while seq_start + plan.num_tokens[b] <= token:  # which sequence of the plan holds that token
                    seq_start += plan.num_tokens[b]
                    b += 1
                position = (plan.first_positions[b] if plan.first_positions else 0) + token - seq_start
                return (f"{name}: non-finite or out-of-range value ({what}) at layer {layer}, KV head {head}, "
                        f"sequence {plan.seq_ids[b]}, position {position} (rotated channel {channel}); refused so that "
                        "this KV head's cache is not poisoned")
        return None

    def _refuse_broken(self, seq_ids: Sequence[int]) -> None:
        broken = [s for s in seq_ids if s in self._broken]
        if broken:
            raise NonFiniteKVError(f"seq_ids: sequence {broken[0]} had a write refused ({self._broken[broken[0]]}); "
                                   "free it and recompute it")

    def append(self, seq_ids: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Append tokens to sequences in every layer at once.

        Args:
            seq_ids: B sequence ids.
            keys, values: one tensor per layer, each `[N, H, d]` (N = B for a decode step, or a list of
                per-sequence tensors `[[T_b, H, d]] * B` per layer for ragged prompts).
        """
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise ValueError(f"keys/values: expected one entry per layer ({self.num_layers}), got "
                             f"{len(keys)}/{len(values)}")
        seq_ids = list(seq_ids)
        if isinstance(keys[0], torch.Tensor):
            counts = [1] * len(seq_ids) if keys[0].shape[0] == len(seq_ids) else None
            if counts is None:
                raise ValueError(f"keys[0]: expected {len(seq_ids)} tokens (one per sequence), got "
                                 f"{keys[0].shape[0]}; pass per-sequence lists for multi-token appends")
            k_layers, v_layers = list(keys), list(values)
        else:
            counts = [int(t.shape[0]) for t in keys[0]]
            k_layers = [torch.cat(list(k)) for k in keys]
            v_layers = [torch.cat(list(v)) for v in values]
        for i in range(self.num_layers):  # validate everything before booking anything
            self._check_tokens(f"keys[{i}]", k_layers[i], sum(counts))
            self._check_tokens(f"values[{i}]", v_layers[i], sum(counts))
        if self.check_finite and not self._capturing() and not self._all_in_range(*k_layers, *v_layers):
            # Refuse before booking: find the layer with the bad element, rotate it as write_layer would, name it.
            self._refuse_broken(seq_ids)
            states = [self._state(s) for s in seq_ids]
            probe = AppendPlan(seq_ids, counts, sum(counts), *([torch.empty(0, dtype=torch.int64)] * 8),
                               first_positions=[st.length for st in states])
            for i in range(self.num_layers):
                pool = self.pools[i]
                problem = self._find_bad_element(i, probe, rotate_rows(k_layers[i], pool.k_rotation),
                                                 rotate_rows(v_layers[i], pool.v_rotation))
                if problem is not None:
                    raise NonFiniteKVError(f"{problem}; nothing was written (the cache is unchanged)")
        if self.check_finite and not self._capturing():  # means against the data, before anything is booked
            for i in range(self.num_layers):
                if i not in self._means_checked and sum(counts) >= MEAN_CHECK_ROWS:
                    pool = self.pools[i]
                    problem = self._mean_far_from_data(i, rotate_rows(k_layers[i], pool.k_rotation),
                                                       rotate_rows(v_layers[i], pool.v_rotation))
                    if problem is not None:
                        raise ArtifactError(f"{problem}; nothing was written (the cache is unchanged)")
        plan = self.plan_append(seq_ids, counts)
        for i in range(self.num_layers):
            self.write_layer(i, plan, k_layers[i], v_layers[i])

    # -- attention ------------------------------------------------------------------------------------------
    def _pool(self, layer: int) -> LayerPool:
        if isinstance(layer, bool):  # int(True) is 1: a flag passed where a layer index belongs
            raise TypeError(f"layer: expected an integer layer index, got {layer!r}")
        try:
            index = operator.index(layer)
        except TypeError:
            raise TypeError(f"layer: expected an integer layer index, got {type(layer).__name__}") from None
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer: expected 0 <= layer < {self.num_layers}, got {layer}")
        return self.pools[index]

    def batch_metadata(self, seq_ids: Sequence[int]) -> BatchMetadata:
        """block_table / hist_len / slot_ids / win_len for `seq_ids` (cached until the next change)."""
        key = (tuple(int(s) for s in seq_ids), self._version)
        if self._meta_cache is not None and self._meta_cache[0] == key:
            return self._meta_cache[1]
        states = [self._state(s) for s in key[0]]
        width = max([1] + [len(st.pages) for st in states])
        # One host tensor, one copy: per row [pages..., 0 padding, hist_len, slot, win_len].
        rows = [st.pages + [0] * (width - len(st.pages))
                + [len(st.pages) * self.page_size, st.slot, self.window_len(st.length)] for st in states]
        packed = torch.tensor(rows, dtype=torch.int32).to(self.device)
        meta = BatchMetadata(block_table=packed[:, :width].contiguous(), hist_len=packed[:, width].contiguous(),
                             slot_ids=packed[:, width + 1].contiguous(), win_len=packed[:, width + 2].contiguous(),
                             whole_pages=True)
        self._meta_cache = (key, meta)
        return meta

    def decode_attention(self, layer: int, q: torch.Tensor, seq_ids: Sequence[int],
                         sm_scale: float | None = None, return_lse: bool = False, fused: bool | None = None,
                         out_dtype: torch.dtype = torch.float32):
        """One decode query per sequence over sink + recent (full precision) and the INT2 history, merged exactly.

        Args:
            layer: index into the cache's layers.
            q: `[B, H_q, d]` post-RoPE queries in the model's basis; rotated here by R_K of each query
                head's KV head (GQA groups share it).
            seq_ids: the B sequences (each must hold at least one token).
            sm_scale: softmax scale (default `1 / sqrt(d)`).
            fused: one kernel launch instead of two on the Triton path (None: `DecodeOptions.fused`, False);
                fewer host microseconds for eager callers, slower under CUDA graphs at small batch (docs/kernels.md).
            out_dtype: o's dtype (fp32, or the model's bf16 / fp16: stored so by the kernel that un-rotates it,
                with no cast after).
        Returns:
            o `[B, H_q, d]` (out_dtype) in the model's value basis (`R_V^T` applied), and with `return_lse` also
            lse fp32 `[B, H_q]` (log-sum-exp of the scaled scores over all cached tokens).
        """
        pool, seq_ids, meta = self._decode_inputs(layer, q, seq_ids, out_dtype, sm_scale)
        q_rot = attn_api.rotate_queries(q, pool.k_rotation, out_dtype=pool.k_win.dtype, backend=self.backend,
                                        validate=False)
        return self._attend(pool, q_rot, meta, sm_scale, return_lse, fused, out_dtype)

    def decode_step(self, layer: int, plan: AppendPlan, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    seq_ids: Sequence[int], sm_scale: float | None = None, return_lse: bool = False,
                    fused: bool | None = None, out_dtype: torch.dtype = torch.float32):
        """One layer of a decode step as an engine's attention call runs it: `write_layer(layer, plan, keys,
        values)`, then `decode_attention(layer, q, seq_ids, ...)`, with the same results.

        On the Triton backend, for an append-only plan (`AppendPlan.append_only`) while the non-finite check is off
        (or under CUDA-graph capture), the append and the query rotation share one launch
        (`step_kernels.append_rows_rotate_queries`): a batch-1 step is launch-bound. q and seq_ids are checked
        before anything is written.
        """
        pool, seq_ids, meta = self._decode_inputs(layer, q, seq_ids, out_dtype, sm_scale)  # valid before the write
        self._check_plan(operator.index(layer), plan)
        checking = self.check_finite and not self._capturing()
        if plan.append_only and self._triton() and not checking:
            self._check_tokens("keys", keys, plan.num_new)
            self._check_tokens("values", values, plan.num_new)
            self._layer_serial[operator.index(layer)] = plan.serial
            q_rot = _step_kernels().append_rows_rotate_queries(
                keys, values, pool.k_rotation, pool.v_rotation, plan.win_src, plan.win_slots, plan.win_rows,
                pool.k_win, pool.v_win, q, out_dtype=pool.k_win.dtype, validate=False)
        else:
            self.write_layer(layer, plan, keys, values)
            q_rot = attn_api.rotate_queries(q, pool.k_rotation, out_dtype=pool.k_win.dtype, backend=self.backend,
                                            validate=False)
        return self._attend(pool, q_rot, meta, sm_scale, return_lse, fused, out_dtype)

    def _decode_inputs(self, layer: int, q, seq_ids, out_dtype, sm_scale=None) -> tuple:
        """Check a decode call's q, seq_ids, out_dtype and sm_scale -> (layer pool, seq_ids as ints, batch
        metadata)."""
        pool = self._pool(layer)
        if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))
                                     or not math.isfinite(sm_scale) or sm_scale <= 0):
            raise ValueError(f"sm_scale: expected a finite positive softmax scale (or None for 1/sqrt(d)), got "
                             f"{sm_scale!r}")
        if any(isinstance(s, bool) for s in seq_ids):
            raise TypeError(f"seq_ids: expected integer sequence ids, got {list(seq_ids)}")
        seq_ids = [int(s) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids: duplicate ids in {seq_ids} (one decode query per sequence)")
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
        if q.dtype not in FLOAT_DTYPES:
            raise TypeError(f"q: dtype must be float16, bfloat16 or float32, got {q.dtype}")
        if q.dim() != 3 or q.shape[0] != len(seq_ids) or q.shape[2] != self.head_dim \
                or q.shape[1] % self.num_kv_heads:
            raise ValueError(f"q: expected shape [B={len(seq_ids)}, H_q (a multiple of {self.num_kv_heads}), "
                             f"d={self.head_dim}], got {list(q.shape)}")
        if q.device != self.device:
            raise ValueError(f"q: expected device {self.device} (the cache's), got {q.device}")
        if out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"out_dtype: expected float16, bfloat16 or float32, got {out_dtype}")
        self._refuse_broken(seq_ids)
        empty = [s for s in seq_ids if self._state(s).length == 0]
        if empty:
            raise ValueError(f"seq_ids: sequences {empty} hold no tokens yet; prefill them before decoding")
        return pool, seq_ids, self.batch_metadata(seq_ids)

    def _attend(self, pool, q_rot, meta, sm_scale, return_lse: bool, fused, out_dtype):
        """Attention of rotated queries over the layer's pools and windows (its records, as kept), un-rotated into
        out_dtype."""
        if self._decode_path is None:
            self._note_decode_path(pool, q_rot, fused)
        o, lse = attn_api.decode_attention(q_rot, pool.pages, meta, pool.windows, sm_scale=sm_scale,
                                           backend=self.backend, validate=False, counters=self._attn_counters,
                                           fused=fused, v_rotation=pool.v_rotation, out_dtype=out_dtype)
        return (o, lse) if return_lse else o

    def _note_decode_path(self, pool: LayerPool, q_rot: torch.Tensor, fused: bool | None) -> None:
        """At the first decode call: say at INFO which kernel decode runs and why (`DecodePlan.summary`), once per
        cache (every call also logs its plan at DEBUG); `repr` shows it from then on."""
        backend = resolve_backend(self.backend, self.device)
        if backend == "triton":
            plan = attn_api.decode_plan(q_rot, pool.pages, pool.windows, whole_pages=True, fused=fused)
            self._decode_path = f"Triton {plan.summary()}"
        else:
            self._decode_path = (f"the torch reference (backend '{self.backend}' on {self.device.type}; the Triton "
                                 "kernels run on CUDA or under TRITON_INTERPRET=1)")
        LOG.info("PagedKVCache (%d layers, %s): decode runs %s", self.num_layers, self._format_text(),
                 self._decode_path)

    def _format_text(self) -> str:
        f = self.fmt
        return (f"sink {f.sink_tokens} + recent {f.recent_tokens}, {f.page_size}-token pages, {f.scale_format} "
                f"scales{', centered' if f.centered else ''}")

    def __repr__(self) -> str:
        path = self._decode_path or "not planned yet (at the first decode call)"
        return (f"PagedKVCache({self.num_layers} layers x {self.num_kv_heads} KV heads x d={self.head_dim}, "
                f"{self._format_text()}, {self.allocator.num_pages} pages, {self.max_seqs} slots, "
                f"{len(self._seqs)} live; decode: {path})")

    # -- dense views (for chunked prefill and inspection) ---------------------------------------------------
    def snapshot(self, seq_id: int) -> tuple[int, list[int]]:
        """(length, pages) of a sequence, to read a layer that has not yet applied the latest plan."""
        st = self._state(seq_id)
        return st.length, list(st.pages)

    def dense_kv(self, layer: int, seq_id: int, state: tuple[int, list[int]] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's keys and values in token order, original basis, history dequantized.

        `state` = an earlier `snapshot(seq_id)`, for a layer whose data is still at that point (the plan of
        the current step is booked before every layer has applied it).
        Returns: k, v fp32 `[n, H, d]`. Materialises the history: meant for multi-token appends on a
        non-empty sequence and for inspection, not for the decode path.
        """
        from runtime_kernels.attention.int2_decode.naive import gather_history

        pool = self._pool(layer)
        st = self._state(seq_id)
        n, page_list = state if state is not None else (st.length, st.pages)
        hist = len(page_list) * self.page_size
        n_sink = min(n, self.sink)
        pages = torch.tensor(page_list, dtype=torch.int64, device=self.device)
        out = []
        for win, codes, scale, zero, rot, mean in (
                (pool.k_win, pool.k_codes, pool.k_scale, pool.k_zero, pool.k_rotation, pool.k_mean),
                (pool.v_win, pool.v_codes, pool.v_scale, pool.v_zero, pool.v_rotation, pool.v_mean)):
            rows = win[st.slot, :, :n - hist].float().transpose(0, 1)  # [n - hist, H, d], rotated
            if hist:
                h = gather_history(codes, scale, zero, pages, hist, self.fmt).transpose(0, 1)  # [hist, H, d], rotated
                if mean is not None:
                    h = h + mean
                rows = torch.cat([rows[:n_sink], h, rows[n_sink:]])
            out.append(torch.einsum("the,hde->thd", rows, rot))  # back to the model's basis
        return out[0], out[1]

    def memory_bytes(self) -> int:
        """Device bytes held by all pools (pages and windows)."""
        total = 0
        for pool in self.pools:
            for t in (pool.k_codes, pool.v_codes, pool.k_scale, pool.k_zero, pool.v_scale, pool.v_zero,
                      pool.k_win, pool.v_win):
                total += t.numel() * t.element_size()
        return total


__all__ = ["MAX_KV_MAGNITUDE", "AppendPlan", "BatchMetadata", "LayerPool", "NonFiniteKVError", "PageAllocator",
           "PagedKVCache", "SequenceState", "check_served_format", "rotate_rows"]
