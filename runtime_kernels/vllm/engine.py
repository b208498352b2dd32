"""One engine step of the three-segment OSCAR cache on vLLM's own blocks (docs/vllm.md sections 2-6).

No vLLM import: the vLLM backend (`runtime_kernels.vllm.backend`) turns vLLM's metadata into `RequestStep`s and
calls `OscarEngine.plan` once per step and `OscarEngine.forward` once per calibrated layer.

Storage:
- vLLM's blocks (`[num_blocks, H, P, C]` bytes per layer, `layout.page_pools`) hold INT2 codes and fp16
  scale/zero of **every** token, written when the token arrives (a pure function of the token's rotated K/V);
- the `WindowStore` holds BF16 (model dtype) rotated rows of the blocks that are in a sink or recent window,
  keyed by physical block id (one host map for all layers).

Per request of `n` tokens (S sink, R recent, P page = vLLM block size, S a multiple of P), as `PagedKVCache`:
history = positions `[S, S + h)` with `h = P * floor(max(0, n - S - R) / P)` read as INT2; sink `[0, min(n, S))`
and recent `[S + h, n)` read in BF16. Attention: decode (one new token on a non-empty request) = window + INT2
history merged exactly (`runtime_kernels.attention.decode_attention`); prefill = full precision over the new
tokens and the cached tokens as cached (`OscarCache`'s prefill and chunked prefill).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from runtime_kernels import attention as attn_api
from runtime_kernels import quant as quant_api
from runtime_kernels._validate import resolve_backend
from runtime_kernels.artifact import ArtifactError, OscarArtifact
from runtime_kernels.attention.int2_decode.records import PagePools
from runtime_kernels.format import KVFormat
from runtime_kernels.memory_budget import check_fits
from runtime_kernels.serving import (
    MEAN_CHECK_ROWS,
    check_served_format,
    check_served_quantizer,
    mean_far_from_data,
    rotate_rows,
)
from runtime_kernels.vllm.layout import PackedLayout, page_pools
from runtime_kernels.vllm.report import HistoryReport


def window_blocks_per_request(fmt: KVFormat) -> int:
    """Blocks one running request can have in its windows: the sink blocks and those of R + P - 1 recent
    tokens, which may straddle one more block."""
    p = fmt.page_size
    return fmt.sink_tokens // p + -(-(fmt.recent_tokens + p - 1) // p) + 1


def check_window_store_fits(device: torch.device, fmt: KVFormat, *, num_layers: int, capacity: int,
                            num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Refuse (CacheTooLargeError, naming the windows and the bytes) a `WindowStore` the device cannot hold, before
    allocating it: windows near the contract's 2^20-token maximum would otherwise fail in the allocator."""
    elem = torch.empty((), dtype=dtype).element_size()
    need = num_layers * 2 * (capacity + 1) * num_kv_heads * fmt.page_size * head_dim * elem
    check_fits(device, need, lambda free: (
        f"field 'sink_tokens'/'recent_tokens': windows of {fmt.sink_tokens} + {fmt.recent_tokens} tokens "
        f"need a window store of {need} bytes ({need / 2**30:.2f} GiB: {capacity} blocks x {num_layers} layers), "
        f"but {device} has {free} bytes ({free / 2**30:.2f} GiB) available; serve with smaller windows or fewer "
        "sequences (max_num_seqs)"))


def decode_plan_for(fmt: KVFormat, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device | str, backend: str, whole_pages: bool):
    """The `DecodePlan` the engine's decode steps in `fmt` run (`attention.decode_plan` on one-block stand-ins of
    vLLM's layer cache, the model-dtype queries and windows), or None where `backend` resolves to the torch
    reference (no Triton kernel). `whole_pages`: eager steps promise it, the static steps of CUDA graphs do not."""
    device = torch.device(device)
    if resolve_backend(backend, device) != "triton":
        return None
    layout = PackedLayout(fmt, head_dim)
    one_block = torch.zeros(1, num_kv_heads, fmt.page_size, layout.bytes_per_token_head, dtype=torch.uint8,
                            device=device)
    pages = page_pools(one_block, layout)
    if fmt.centered:
        mean = torch.zeros(num_kv_heads, head_dim, dtype=torch.float32, device=device)
        pages = replace(pages, k_mean=mean, v_mean=mean)
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    win = torch.zeros(1, num_kv_heads, 1, head_dim, dtype=dtype, device=device)
    return attn_api.decode_plan(q, pages, attn_api.Windows(win, win), whole_pages=whole_pages)


# ----------------------------------------------------------------------------------------------------------
# BF16 windows
# ----------------------------------------------------------------------------------------------------------
class WindowStore:
    """Full-precision rotated rows of the blocks in a window, keyed by physical block id, for every layer.

    Tensors: `k[layer]`, `v[layer]` `[capacity + 1, H, P, d]` in the model dtype. A window block is valid for the
    rows `[0, rows[slot])` written in order since the block's last row-0 write (a block rewritten from row 0
    belongs to new content: vLLM reallocated it). Slots are reclaimed least recently used first, never one
    pinned by the step being planned. Missing rows are read from the block's INT2 bytes instead. One extra slot
    (`scratch`, index `capacity`) takes the padded tokens of a static step.
    """

    def __init__(self, num_layers: int, capacity: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"capacity: expected at least 1 window block, got {capacity}")
        shape = (capacity + 1, num_kv_heads, block_size, head_dim)  # + the scratch slot, never handed out
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.scratch = capacity  # where the padded tokens of a static step write (and read) their window row
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # physical block -> slot, least recent first
        self.rows = [0] * capacity  # valid rows of each slot (-1: written out of order, never readable)
        self._free = list(range(capacity - 1, -1, -1))
        self.fallback_rows = 0  # window rows that had to be read from INT2 (evicted), for stats

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def readable(self, block: int, row: int) -> int | None:
        """Slot holding row `row` of physical `block` in full precision, or None."""
        slot = self.slot_of.get(block)
        if slot is None or self.rows[slot] <= row:
            return None
        return slot

    def touch(self, blocks) -> None:
        for b in blocks:
            if b in self.slot_of:
                self.slot_of.move_to_end(b)

    def slot_for_write(self, block: int, row: int, pinned: set[int]) -> int:
        """The slot that receives row `row` of `block` (allocated or reset at row 0)."""
        slot = self.slot_of.get(block)
        if slot is None:
            slot = self._take(pinned)
            self.slot_of[block] = slot
            self.rows[slot] = 0
        elif row == 0:
            self.rows[slot] = 0
        self.slot_of.move_to_end(block)
        self.rows[slot] = row + 1 if self.rows[slot] == row else -1
        return slot

    def _take(self, pinned: set[int]) -> int:
        if self._free:
            return self._free.pop()
        for block in self.slot_of:  # least recently used first
            if block not in pinned:
                return self.slot_of.pop(block)
        raise RuntimeError(f"window store full: {self.capacity} window blocks are all in use by this step "
                           f"(raise max_num_seqs' window reserve)")


# ----------------------------------------------------------------------------------------------------------
# A step
# ----------------------------------------------------------------------------------------------------------
@dataclass
class RequestStep:
    """One request of the batch: its new tokens are `q[q_start : q_start + q_len]` at positions
    `[n_old, n_old + q_len)`; `blocks` are its physical blocks (vLLM block table row, at least
    ceil((n_old + q_len) / P) entries)."""

    q_start: int
    q_len: int
    n_old: int
    blocks: list[int]

    @property
    def n_new(self) -> int:
        return self.n_old + self.q_len


@dataclass
class SegmentIndex:
    """Where positions of a request are read from: BF16 (`win_slots`, `win_rows`) or INT2 (`pages`, `rows`);
    `order` puts the concatenation [BF16 rows, INT2 rows] back in chronological order."""

    win_slots: torch.Tensor
    win_rows: torch.Tensor
    pages: torch.Tensor
    rows: torch.Tensor
    order: torch.Tensor


@dataclass
class StepPlan:
    """Host-side bookkeeping of one step, shared by every calibrated layer.

    - writes: new token t goes to INT2 `(write_pages[t], write_rows[t])` and BF16 `(write_slots[t], write_rows[t])`;
    - decode requests: token ids `decode_tokens [Bd]`, INT2 `block_table [Bd, max_pages]`, `hist_len [Bd]`, window
      rows gathered by `win_slots/win_rows` into `[Bd, H, win_width, d]` at `(win_batch, win_pos)`, `win_len [Bd]`;
      `whole_pages`: every hist_len is whole pages (False only when an evicted, partly filled block is read as INT2);
    - prefill requests: `(request, SegmentIndex of its cached positions)`.
    """

    num_tokens: int
    write_pages: torch.Tensor
    write_rows: torch.Tensor
    write_slots: torch.Tensor
    decode_tokens: torch.Tensor
    block_table: torch.Tensor
    hist_len: torch.Tensor
    win_slots: torch.Tensor
    win_rows: torch.Tensor
    win_batch: torch.Tensor
    win_pos: torch.Tensor
    win_len: torch.Tensor
    win_width: int
    whole_pages: bool = True
    prefills: list[tuple[RequestStep, SegmentIndex]] = field(default_factory=list)
    slot_ids: torch.Tensor | None = None  # [Bd] rows of the window gather (None: arange, allocated per layer)
    gather: tuple[torch.Tensor, torch.Tensor] | None = None  # preallocated K, V window gathers (static steps)


@dataclass
class EngineStats:
    """What the engine has booked since it was built (host counters, no GPU sync): steps, the decode-only steps
    booked into static buffers (those a CUDA graph can replay), decode tokens, and the tokens of history they read
    from INT2 pages (0 until a request is longer than its sink and recent windows)."""

    steps: int = 0
    static_steps: int = 0
    decode_tokens: int = 0
    history_tokens: int = 0

    def count(self, hist_lens: list[int], static: bool) -> None:
        self.steps += 1
        self.static_steps += int(static)
        self.decode_tokens += len(hist_lens)
        self.history_tokens += int(sum(hist_lens))


def _long(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


NULL_BLOCK = 0  # vLLM's null block: block 0 of the pool is never handed to a request; padded tokens write there


class StaticStep:
    """Preallocated metadata of a decode-only step of up to `max_tokens` requests, filled in place each step, so
    every tensor the layers read keeps its address and shape (what CUDA graph capture needs; the eager `plan`
    allocates fresh tensors instead). Host work per step: the bookkeeping and one copy per buffer.

    Buffers (T = max_tokens, M = max_pages, W = sink + recent + P - 1 window rows, H KV heads, d head_dim):
    write_pages/write_rows/write_slots int64 `[T]`; decode_tokens, slot_ids `[T]` (0..T-1, constant);
    block_table int32 `[T, M]`; hist_len, win_len int32 `[T]`; win_slots/win_rows/win_batch/win_pos int64
    `[T * W]` (unused entries gather the scratch slot into the spare row T); gather K, V `[T + 1, H, W, d]`.
    """

    def __init__(self, max_tokens: int, max_pages: int, fmt: KVFormat, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if max_tokens < 1 or max_pages < 1:
            raise ValueError(f"max_tokens, max_pages: expected >= 1, got {max_tokens}, {max_pages}")
        self.max_tokens, self.max_pages = int(max_tokens), int(max_pages)
        self.win_width = fmt.window_rows
        t, w, dev = self.max_tokens, self.win_width, device
        i64 = dict(dtype=torch.int64, device=dev)
        self.write_pages, self.write_rows, self.write_slots = (torch.zeros(t, **i64) for _ in range(3))
        self.decode_tokens = torch.arange(t, **i64)
        self.slot_ids = torch.arange(t, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(t, self.max_pages, dtype=torch.int32, device=dev)
        self.hist_len = torch.zeros(t, dtype=torch.int32, device=dev)
        self.win_len = torch.zeros(t, dtype=torch.int32, device=dev)
        self.win_slots, self.win_rows, self.win_batch, self.win_pos = (torch.zeros(t * w, **i64) for _ in range(4))
        self.gather = tuple(torch.zeros(t + 1, num_kv_heads, w, head_dim, dtype=dtype, device=dev)
                            for _ in range(2))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer by name (tests check their addresses stay put)."""
        names = ("write_pages", "write_rows", "write_slots", "decode_tokens", "slot_ids", "block_table",
                 "hist_len", "win_len", "win_slots", "win_rows", "win_batch", "win_pos")
        return {**{n: getattr(self, n) for n in names}, "gather_k": self.gather[0], "gather_v": self.gather[1]}

    def fill(self, n: int, pages, rows, slots, tables, hist, window, win_len, scratch: int) -> None:
        """Copy one step's host lists (`n` tokens, padding included) into the buffers: one copy per buffer.
        Window entries past the step's own gather the scratch slot into the spare row (never read)."""
        def put(buf, values):
            buf[:len(values)].copy_(torch.tensor(values, dtype=buf.dtype))

        for buf, values in ((self.write_pages, pages), (self.write_rows, rows), (self.write_slots, slots),
                            (self.hist_len, hist), (self.win_len, win_len)):
            put(buf, values)
        m = self.max_pages
        put(self.block_table, [t + [0] * (m - len(t)) for t in tables] + [[0] * m] * (n - len(tables)))
        used = len(window[0])
        for buf, values, unused in zip((self.win_slots, self.win_rows, self.win_batch, self.win_pos), window,
                                       (scratch, 0, self.max_tokens, 0)):
            put(buf, values)
            buf[used:].fill_(unused)

    def plan(self, n: int) -> StepPlan:
        """The StepPlan of the filled step: fixed views (`[:n]` of the token buffers, whole window lists)."""
        return StepPlan(
            num_tokens=n, write_pages=self.write_pages[:n], write_rows=self.write_rows[:n],
            write_slots=self.write_slots[:n], decode_tokens=self.decode_tokens[:n],
            block_table=self.block_table[:n], hist_len=self.hist_len[:n], win_slots=self.win_slots,
            win_rows=self.win_rows, win_batch=self.win_batch, win_pos=self.win_pos, win_len=self.win_len[:n],
            win_width=self.win_width, whole_pages=False, slot_ids=self.slot_ids[:n],
            gather=self.gather)


class OscarEngine:
    """The INT2 cache of all calibrated layers of one vLLM model.

    Args:
        artifact: validated `OscarArtifact` (rotations, clip ratios, group size, windows).
        fmt: the KV format served (default: the artifact's `kv_format`; the page size is vLLM's block size, the
            rest must be the artifact's, windows aside for an identity artifact: `serving.check_served_format`).
        window_capacity: window blocks in the `WindowStore` (default `2 * max_seqs * window_blocks_per_request`).
        dtype: model dtype (the windows' dtype); backend: kernel backend ("auto" | "torch" | "triton").
    """

    def __init__(self, artifact: OscarArtifact, *, max_seqs: int, dtype: torch.dtype,
                 fmt: KVFormat | None = None, window_capacity: int | None = None,
                 device: torch.device | str = "cpu", backend: str = "auto"):
        artifact.ensure_valid()  # a loaded artifact was validated by its loader: not again
        self.quantizer = check_served_quantizer(artifact)
        self.fmt = check_served_format(artifact, fmt)
        p = self.fmt.page_size
        if self.fmt.sink_tokens % p:
            raise ValueError(f"sink_tokens: must be a multiple of the block size {p} (history pages are vLLM "
                             f"blocks), got {self.fmt.sink_tokens}")
        self.packed = PackedLayout(self.fmt, artifact.head_dim)
        self.num_kv_heads, self.head_dim = artifact.num_kv_heads, artifact.head_dim
        self.local_of = {int(g): i for i, g in enumerate(artifact.layer_ids.tolist())}
        self.device = torch.device(device)
        self.dtype, self.backend = dtype, backend
        self.k_rotation = [r.to(self.device, torch.float32).contiguous() for r in artifact.k_rotation]
        self.v_rotation = [r.to(self.device, torch.float32).contiguous() for r in artifact.v_rotation]
        self.k_clip = [c.to(self.device, torch.float32).contiguous() for c in artifact.k_clip_ratio]
        self.v_clip = [c.to(self.device, torch.float32).contiguous() for c in artifact.v_clip_ratio]
        # Centered caches (contract v2): the INT2 pages hold quant(x_rot - mu); decode adds mu back exactly
        # (q . mu_k on the history logits, the history's probability mass times mu_v), as PagedKVCache does.
        centered = self.fmt.centered
        self.k_mean = [m.to(self.device, torch.float32).contiguous() for m in artifact.key_mean("rotated")] \
            if centered else [None] * len(self.k_rotation)
        self.v_mean = [m.to(self.device, torch.float32).contiguous() for m in artifact.value_mean("rotated")] \
            if centered else [None] * len(self.v_rotation)
        capacity = window_capacity or 2 * int(max_seqs) * window_blocks_per_request(self.fmt)
        check_window_store_fits(self.device, self.fmt, num_layers=len(self.local_of), capacity=capacity,
                                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype)
        self.windows = WindowStore(len(self.local_of), capacity, self.num_kv_heads, p, self.head_dim, dtype,
                                   self.device)
        self.stats = EngineStats()
        self._means_checked: set[int] = set()  # layers whose means were checked against a prefill's rows
        self._page_records: dict[int, tuple[tuple, PagePools]] = {}  # layer -> (its vLLM cache, its PagePools)
        self.history_report = HistoryReport()  # the INFO line that says INT2 history was served

    # -- host bookkeeping --------------------------------------------------------------------------------
    def _window_positions(self, n: int) -> list[int]:
        """Positions read in full precision by a request of `n` tokens: sink, then recent (chronological)."""
        s = self.fmt.sink_tokens
        return list(range(min(n, s))) + list(range(s + self.fmt.history_tokens(n), n))

    def _segments(self, req: RequestStep, n: int, dev) -> tuple[list, list, list, list, list]:
        """(BF16 slots, BF16 rows, INT2 pages, INT2 rows, chronological order) of positions [0, n) of `req`."""
        p, store = self.fmt.page_size, self.windows
        in_window = set(self._window_positions(n))
        ws, wr, ip, ir, kinds = [], [], [], [], []
        for pos in range(n):
            block, row = req.blocks[pos // p], pos % p
            slot = store.readable(block, row) if pos in in_window else None
            if pos in in_window and slot is None:
                store.fallback_rows += 1
            if slot is not None:
                ws.append(slot)
                wr.append(row)
                kinds.append((0, len(ws) - 1))
            else:
                ip.append(block)
                ir.append(row)
                kinds.append((1, len(ip) - 1))
        order = [i if k == 0 else len(ws) + i for k, i in kinds]
        return ws, wr, ip, ir, order

    def _check_blocks(self, requests: list[RequestStep]) -> set[int]:
        """Raise on a request without enough blocks; return the step's blocks (pinned: never reclaimed now)."""
        p = self.fmt.page_size
        for r in requests:
            if len(r.blocks) < -(-r.n_new // p):
                raise ValueError(f"blocks: request at q_start={r.q_start} has {len(r.blocks)} blocks for "
                                 f"{r.n_new} tokens (block size {p})")
        pinned = {b for r in requests for b in r.blocks[:-(-r.n_new // p)]}
        self.windows.touch(pinned)
        return pinned

    def _book_writes(self, requests: list[RequestStep], pinned: set[int]) -> tuple[list, list, list]:
        """(INT2 blocks, rows, window slots) of every new token, in token order; window slots are booked."""
        p, store = self.fmt.page_size, self.windows
        pages, rows, slots = [], [], []
        for r in requests:
            for pos in range(r.n_old, r.n_new):
                block, row = r.blocks[pos // p], pos % p
                pages.append(block)
                rows.append(row)
                slots.append(store.slot_for_write(block, row, pinned))
        return pages, rows, slots

    def _decode_reads(self, decode: list[RequestStep]):
        """Where each decode request reads (the state after its write): INT2 tables and history lengths, and
        the window rows `(slot, row) -> (batch, pos)` with per-request window lengths."""
        p, store = self.fmt.page_size, self.windows
        tables, hist, win_s, win_r, win_b, win_p, win_len = [], [], [], [], [], [], []
        s_blocks = self.fmt.sink_tokens // p
        for i, r in enumerate(decode):
            n = r.n_new
            h = self.fmt.history_tokens(n)
            table = list(r.blocks[s_blocks:s_blocks + h // p])
            count, partial = 0, None
            positions = self._window_positions(n)
            for j in sorted({pos // p for pos in positions}):  # blocks of the window, in order
                block = r.blocks[j]
                mine = [pos for pos in positions if pos // p == j]
                slot = store.readable(block, mine[-1] % p)
                if slot is None:  # evicted: read the block from its INT2 bytes (never stale data)
                    store.fallback_rows += len(mine)
                    if (j + 1) * p > n:  # the newest, partly filled block: last in the table, partial page
                        partial = (block, n - j * p)
                    else:
                        table.append(block)
                    continue
                for pos in mine:
                    win_s.append(slot)
                    win_r.append(pos % p)
                    win_b.append(i)
                    win_p.append(count)
                    count += 1
            hist.append(len(table) * p + (partial[1] if partial else 0))
            if partial:
                table.append(partial[0])
            tables.append(table)
            win_len.append(count)
        return tables, hist, win_s, win_r, win_b, win_p, win_len

    def plan(self, requests: list[RequestStep]) -> StepPlan:
        """Book the step: window slots for the new tokens, and where each request reads its cache from."""
        p, dev = self.fmt.page_size, self.device
        pinned = self._check_blocks(requests)
        # Reads first (they see the cache before this step's writes; writes only touch positions >= n_old).
        decode, prefills = [], []
        for r in requests:
            (decode if r.q_len == 1 and r.n_old > 0 else prefills).append(r)
        pages, rows, slots = self._book_writes(requests, pinned)
        # Decode reads the state after its write: sink and recent BF16 (one token later), history INT2.
        tables, hist, win_s, win_r, win_b, win_p, win_len = self._decode_reads(decode)
        self.stats.count(hist, static=False)
        self.history_report.log(hist)
        width = max([1] + [len(t) for t in tables])
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables] or [[0]], dtype=torch.int32,
                                   device=dev)[:len(tables)]
        prefill_plans = []
        for r in prefills:
            ws, wr, ip, ir, order = self._segments(r, r.n_old, dev)
            prefill_plans.append((r, SegmentIndex(_long(ws, dev), _long(wr, dev), _long(ip, dev), _long(ir, dev),
                                                  _long(order, dev))))
        return StepPlan(
            num_tokens=len(pages), write_pages=_long(pages, dev), write_rows=_long(rows, dev),
            write_slots=_long(slots, dev), decode_tokens=_long([r.q_start for r in decode], dev),
            block_table=block_table, hist_len=torch.tensor(hist, dtype=torch.int32, device=dev),
            win_slots=_long(win_s, dev), win_rows=_long(win_r, dev), win_batch=_long(win_b, dev),
            win_pos=_long(win_p, dev), win_len=torch.tensor(win_len, dtype=torch.int32, device=dev),
            win_width=max([1] + win_len), whole_pages=all(h % p == 0 for h in hist), prefills=prefill_plans)

    def plan_static(self, requests: list[RequestStep], num_tokens: int, bufs: StaticStep) -> StepPlan:
        """Book a decode-only step into `bufs` in place (what a captured CUDA graph replays): the same
        bookkeeping as `plan`, every tensor of the returned plan a fixed view of `bufs`, shapes independent of
        the batch. Token t < len(requests) is request t's new token (q_start == t); tokens
        `[len(requests), num_tokens)` are padding: they write block `NULL_BLOCK` row 0 and the window scratch
        slot, and read one window row (finite outputs, discarded by the caller).

        Raises ValueError naming `requests` (not decode-only, or out of token order) or `num_tokens`."""
        if not max(1, len(requests)) <= num_tokens <= bufs.max_tokens:
            raise ValueError(f"num_tokens: expected {max(1, len(requests))} .. {bufs.max_tokens} (the requests, "
                             f"up to the static buffers' size), got {num_tokens}")
        for t, r in enumerate(requests):
            # A one-token prompt (n_old == 0) is a decode over an empty history: its window is its own token.
            if r.q_len != 1 or r.n_old < 0 or r.q_start != t:
                raise ValueError(f"requests: a static step is decode-only with token t for request t; request {t} "
                                 f"has q_start={r.q_start}, q_len={r.q_len}, n_old={r.n_old}")
        pinned = self._check_blocks(requests)
        pages, rows, slots = self._book_writes(requests, pinned)
        tables, hist, win_s, win_r, win_b, win_p, win_len = self._decode_reads(requests)
        if requests:  # a CUDA-graph capture books padding only: not a step served
            self.stats.count(hist, static=True)
            self.history_report.log(hist)
        if any(len(t) > bufs.max_pages for t in tables):
            raise ValueError(f"requests: a history of more than max_pages={bufs.max_pages} blocks")
        pad, scratch = num_tokens - len(requests), self.windows.scratch
        # padded token i reads one window row: row 0 of the scratch slot, gathered into its own row i
        win_s, win_r = win_s + [scratch] * pad, win_r + [0] * pad
        win_b, win_p = win_b + list(range(len(requests), num_tokens)), win_p + [0] * pad
        bufs.fill(num_tokens, pages + [NULL_BLOCK] * pad, rows + [0] * pad, slots + [scratch] * pad, tables,
                  hist + [0] * pad, (win_s, win_r, win_b, win_p), win_len + [1] * pad, scratch)
        return bufs.plan(num_tokens)

    # -- per layer -------------------------------------------------------------------------------------------
    def local_index(self, layer_idx: int) -> int:
        if layer_idx not in self.local_of:
            raise KeyError(f"layer {layer_idx}: not calibrated by the artifact (layer_ids {sorted(self.local_of)})")
        return self.local_of[layer_idx]

    def forward(self, layer_idx: int, plan: StepPlan, kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, sm_scale: float, out: torch.Tensor, dense_prefill=None) -> torch.Tensor:
        """Write this step's tokens of one layer and compute its attention.

        Args:
            kv_cache: vLLM's layer cache `[num_blocks, H, P, C]` (packed bytes, `layout.page_pools`).
            q: `[T, H_q, d]`, k/v: `[T, H, d]` post-RoPE, model basis (T = plan.num_tokens, padding excluded).
            out: `[T, H_q, d]`, written in place and returned.
            dense_prefill: optional `f(q [T', H_q, d], k, v [T', H, d], out [T', H_q, d])`, causal attention of a
                new request's prompt over its own tokens (nothing is cached before it): the engine's host backend
                runs its own kernel there (FlashAttention on CUDA). None: SDPA, as `OscarCache`'s prefill.
        """
        li = self.local_index(layer_idx)
        pools = self._pages(li, kv_cache)
        win_k, win_v = self.windows.k[li], self.windows.v[li]
        t = plan.num_tokens
        k_rot = rotate_rows(k[:t], self.k_rotation[li]).to(self.dtype)
        v_rot = rotate_rows(v[:t], self.v_rotation[li]).to(self.dtype)
        if li not in self._means_checked and plan.prefills and t >= MEAN_CHECK_ROWS:  # a prefill, never captured
            problem = mean_far_from_data(layer_idx, k_rot, v_rot, self.k_mean[li], self.v_mean[li])
            if problem is not None:
                raise ArtifactError(f"{problem}; nothing of layer {layer_idx} was written")
            self._means_checked.add(li)
        if t:
            win_k[plan.write_slots, :, plan.write_rows] = k_rot
            win_v[plan.write_slots, :, plan.write_rows] = v_rot
            quant_api.write_pages(k_rot, None, self.k_clip[li], pools.k_codes, pools.k_scale, pools.k_zero,
                                  plan.write_pages, plan.write_rows, self.fmt,
                                  backend=self.backend, mean=self.k_mean[li])
            quant_api.write_pages(v_rot, None, self.v_clip[li], pools.v_codes, pools.v_scale, pools.v_zero,
                                  plan.write_pages, plan.write_rows, self.fmt,
                                  backend=self.backend, mean=self.v_mean[li])
        if plan.decode_tokens.numel():
            out[plan.decode_tokens] = self._decode(li, plan, pools, win_k, win_v, q[plan.decode_tokens],
                                                   sm_scale).to(out.dtype)
        for req, seg in plan.prefills:
            lo, hi = req.q_start, req.q_start + req.q_len
            if req.n_old == 0 and dense_prefill is not None:
                dense_prefill(q[lo:hi], k[lo:hi], v[lo:hi], out[lo:hi])
                continue
            past_k, past_v = self._dense_past(li, seg, pools, win_k, win_v, k.dtype)
            out[lo:hi] = _causal_attention(q[lo:hi], torch.cat([past_k, k[lo:hi]]), torch.cat([past_v, v[lo:hi]]),
                                           sm_scale).to(out.dtype)
        return out

    def _pages(self, li: int, kv_cache: torch.Tensor) -> PagePools:
        """Layer `li`'s `PagePools` over vLLM's layer cache (views, in the engine's format, with the layer's means),
        built once per layer cache and kept: vLLM hands every step the same tensor (a new one after a reallocation
        gets new views)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride(), kv_cache.dtype)
        kept = self._page_records.get(li)
        if kept is None or kept[0] != key:
            pages = replace(page_pools(kv_cache, self.packed), k_mean=self.k_mean[li], v_mean=self.v_mean[li])
            kept = self._page_records[li] = (key, pages)
        return kept[1]

    def _decode(self, li, plan: StepPlan, pools, win_k, win_v, q, sm_scale) -> torch.Tensor:
        """Decode queries `[Bd, H_q, d]` -> `[Bd, H_q, d]` fp32 (model basis), as `PagedKVCache.decode_attention`."""
        bd = q.shape[0]
        if plan.gather is not None:  # static step: the buffers are reused, rows past win_len are never read
            kw, vw = plan.gather
        else:
            kw = torch.zeros(bd, self.num_kv_heads, plan.win_width, self.head_dim, dtype=self.dtype,
                             device=q.device)
            vw = torch.zeros_like(kw)
        if plan.win_slots.numel():
            kw[plan.win_batch, :, plan.win_pos] = win_k[plan.win_slots, :, plan.win_rows]
            vw[plan.win_batch, :, plan.win_pos] = win_v[plan.win_slots, :, plan.win_rows]
        q_rot = attn_api.rotate_queries(q, self.k_rotation[li], out_dtype=self.dtype, backend=self.backend,
                                        validate=False)
        slots = plan.slot_ids if plan.slot_ids is not None else torch.arange(bd, dtype=torch.int32,
                                                                             device=q.device)
        batch = attn_api.BatchMetadata(block_table=plan.block_table, hist_len=plan.hist_len, slot_ids=slots,
                                       win_len=plan.win_len, whole_pages=plan.whole_pages)
        o, _ = attn_api.decode_attention(q_rot, pools, batch, attn_api.Windows(kw, vw), sm_scale=sm_scale,
                                         backend=self.backend, v_rotation=self.v_rotation[li])
        return o

    def _dense_past(self, li, seg: SegmentIndex, pools, win_k, win_v, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached positions of a request in order, model basis: BF16 window rows and dequantized INT2 rows.
        Returns k, v `[n_old, H, d]` in `dtype` (as `PagedKVCache.dense_kv`, then cast like `OscarCache`)."""
        from runtime_kernels.quant import naive as quant_naive

        out = []
        for win, codes, scale, zero, rot, mean in (
                (win_k, pools.k_codes, pools.k_scale, pools.k_zero, self.k_rotation[li], self.k_mean[li]),
                (win_v, pools.v_codes, pools.v_scale, pools.v_zero, self.v_rotation[li], self.v_mean[li])):
            rows = win[seg.win_slots, :, seg.win_rows].float()  # [n_bf16, H, d]
            if seg.pages.numel():
                hist = quant_naive.unpack_dequantize(codes[seg.pages, :, seg.rows], scale[seg.pages, :, seg.rows],
                                                     zero[seg.pages, :, seg.rows], self.fmt).float()  # [n_int2, H, d]
                rows = torch.cat([rows, hist if mean is None else hist + mean])
            rows = rows[seg.order] if seg.order.numel() else rows
            out.append(torch.einsum("the,hde->thd", rows, rot).to(dtype))
        return out[0], out[1]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Full-precision causal attention of the last T of N positions: q `[T, H_q, d]`, k/v `[N, H, d]` -> `[T, H_q, d]`.
    GQA by repeating KV heads; computed in the inputs' dtype by SDPA (what `OscarCache`'s prefill runs)."""
    t, h_q, _ = q.shape
    n, h = k.shape[0], k.shape[1]
    kk = k.transpose(0, 1).repeat_interleave(h_q // h, dim=0)  # [H_q, N, d]
    vv = v.transpose(0, 1).repeat_interleave(h_q // h, dim=0)
    mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(diagonal=n - t)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=sm_scale)
    return o.transpose(0, 1)


__all__ = ["NULL_BLOCK", "EngineStats", "OscarEngine", "RequestStep", "SegmentIndex", "StaticStep", "StepPlan",
           "WindowStore", "decode_plan_for", "window_blocks_per_request"]
