"""Shared pieces of the product benchmarks (torch only: `compare_decode_bitwise.py` also runs it against an older
runtime_kernels): the serving geometry, pool builders, timing, and the one results schema.

Results schema (`write_rows`): a JSON file `{"meta": {...}, "rows": [...]}`; meta holds gpu, torch, triton, python,
commit, date; every row holds op, variant, shape (a dict), p50_ms, p20_ms, p80_ms (CUDA-event quantiles of
`triton.testing.do_bench`), plus free-form extra fields.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

H_KV, H_Q, D = 8, 32, 128  # Qwen3-8B attention geometry
# The windows the committed fp16 decode tables were measured with (64/256, 64-token pages): kept so the rows stay
# comparable; bench_decode_graph.py's `recipe` format and bench_model_decode.py measure the recipe's own format.
_BENCH = dict(sink_tokens=64, recent_tokens=256, page_size=64, group_size=None, scale_format="float16",
              quantizer="uniform_minmax", centered=False)
try:
    from runtime_kernels.format import KVFormat

    BENCH_FORMAT = KVFormat(**_BENCH)
except ImportError:  # a reference tree from before KVFormat (compare_decode_bitwise.py's child imports this file)
    BENCH_FORMAT = None
PAGE = _BENCH["page_size"]
WIN = _BENCH["sink_tokens"] + _BENCH["recent_tokens"]  # BF16 sink + recent rows of a long sequence
QUANTILES = [0.5, 0.2, 0.8]
# docs/kernels.md's decode table: context x batch.
DECODE_POINTS = [(c, b) for c in (131072, 32768, 8192) for b in (1, 8, 32)]


def decode_inputs(batch: int, context: int, seed: int, device: str = "cuda", scale_format: str = "float16",
                  window: int = WIN, layout: str = "quad", geometry: tuple[int, int, int] = (H_KV, H_Q, D)) -> tuple:
    """`decode_attention`'s inputs at a (KV heads, query heads, head_dim) geometry (Qwen3-8B's by default), as
    `PagedKVCache` lays them out: `context - window` history tokens rounded down to whole pages (random code bytes,
    scales in [0.1, 0.6), zeros in [0, 3) codes, scale/zero pools interleaved per row as the cache's, pages scattered
    over the pool), `window` full BF16 window rows (sink + recent), bf16 queries. scale_format "float16" stores scales
    and zeros as fp16, "ue5m3" as uint8 (the same draws, rounded to ue5m3 and 1/64 codes). Deterministic in `seed` for a
    given torch build and device (the float16 default draws what it always did: `compare_decode_bitwise.py` compares
    against recorded outputs). layout: "quad" (the cache's) or "paired_v" (V scale and zero in one `[.., 2]` buffer, K
    scale and zero apart: what the cache allocated before the quads, for comparisons with trees that do not read quads);
    the same values either way."""
    from runtime_kernels.quant.naive import SCALE_STORAGE, ZERO_STEPS, encode_ue5m3

    h_kv, h_q, d = geometry
    gen = torch.Generator(device=device).manual_seed(seed)
    hist = (context - window) // PAGE * PAGE
    pages_per_seq = max(1, hist // PAGE)
    n_pages = batch * pages_per_seq
    sdt = SCALE_STORAGE[scale_format]
    kc, vc = (torch.randint(0, 256, (n_pages, h_kv, PAGE, d // 4), dtype=torch.uint8, device=device, generator=gen)
              for _ in range(2))
    # One [.., 4] buffer of (K scale, K zero, V scale, V zero) per row, as the cache allocates them
    # (`int2_decode.pools.alloc_quad_pools`; written out so that older trees can read these inputs too).
    if layout == "quad":
        quad = torch.empty(n_pages, h_kv, PAGE, 4, dtype=sdt, device=device)
        ks, kz, vs, vz = quad[..., 0:1], quad[..., 1:2], quad[..., 2:3], quad[..., 3:4]
    elif layout == "paired_v":
        ks, kz = (torch.empty(n_pages, h_kv, PAGE, 1, dtype=sdt, device=device) for _ in range(2))
        pair = torch.empty(n_pages, h_kv, PAGE, 2, dtype=sdt, device=device)
        vs, vz = pair[..., 0:1], pair[..., 1:2]
    else:
        raise ValueError(f"layout: expected 'quad' or 'paired_v', got {layout!r}")

    def scales(shape):
        x = torch.rand(shape, device=device, generator=gen) * 0.5 + 0.1
        return x if sdt == torch.float16 else encode_ue5m3(x)

    def zeros(shape):
        x = torch.rand(shape, device=device, generator=gen) * 3
        return x if sdt == torch.float16 else torch.floor(x * ZERO_STEPS).to(torch.uint8)

    ks.copy_(scales(ks.shape))
    vs.copy_(scales(vs.shape))
    kz.copy_(zeros(kz.shape))
    vz.copy_(zeros(vz.shape))
    table = torch.randperm(n_pages, device=device, generator=gen).reshape(batch, pages_per_seq).to(torch.int32)
    hist_len = torch.full((batch,), hist, dtype=torch.int32, device=device)
    k_win, v_win = (torch.randn(batch, h_kv, window, d, device=device, generator=gen).to(torch.bfloat16)
                    for _ in range(2))
    slot_ids = torch.randperm(batch, device=device, generator=gen).to(torch.int32)
    win_len = torch.full((batch,), window, dtype=torch.int32, device=device)
    q = torch.randn(batch, h_q, d, device=device, generator=gen).to(torch.bfloat16)
    return q, kc, ks, kz, vc, vs, vz, table, hist_len, k_win, v_win, slot_ids, win_len


def decode_records(args: tuple, means: tuple | None = None, *, scale_format: str) -> tuple:
    """`decode_inputs`' 13 tensors (made with `scale_format`) as `runtime_kernels.attention.decode_attention` takes
    them -> (q, pages, batch, windows): whole pages (as `PagedKVCache` calls it), the means of a centered cache when
    given, and (in trees whose `PagePools` carries its format) the bench format with that scale format and
    centering. Only for trees with the record API (imported here, so `decode_inputs` itself still serves older
    trees)."""
    import dataclasses

    from runtime_kernels.attention import BatchMetadata, PagePools, Windows

    q, kc, ks, kz, vc, vs, vz, table, hist_len, k_win, v_win, slot_ids, win_len = args
    km, vm = means if means is not None else (None, None)
    fmt = {}
    if "fmt" in {f.name for f in dataclasses.fields(PagePools)}:
        fmt["fmt"] = BENCH_FORMAT.with_(scale_format=scale_format, centered=means is not None)
    pages = PagePools(k_codes=kc, v_codes=vc, k_scale=ks, k_zero=kz, v_scale=vs, v_zero=vz, k_mean=km, v_mean=vm,
                      **fmt)
    batch = BatchMetadata(block_table=table, hist_len=hist_len, slot_ids=slot_ids, win_len=win_len,
                          whole_pages=True)
    return q, pages, batch, Windows(k_win, v_win)


def decode_means(seed: int, device: str = "cuda", geometry: tuple[int, int, int] = (H_KV, H_Q, D)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `[H_kv, d]` K and V means of a centered cache at `geometry` (what the pools of `decode_inputs` are
    centered on)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(geometry[0], geometry[2], device=device, generator=gen) * 0.3 for _ in range(2))


def time_ms(fn, rep: int = 200) -> tuple[float, float, float]:
    """(p50, p20, p80) milliseconds of `fn()` by `triton.testing.do_bench` (L2 flushed between calls)."""
    import triton

    return tuple(float(x) for x in triton.testing.do_bench(fn, rep=rep, quantiles=QUANTILES))


def time_graph_ms(fn, rep: int = 200) -> tuple[float, float, float]:
    """(p50, p20, p80) milliseconds of one replay of `fn` captured in a CUDA graph (host launch time removed)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, rep)


def events_ms(graph: torch.cuda.CUDAGraph, n: int, reps: int = 50) -> float:
    """Median milliseconds per call of a CUDA graph holding `n` calls back to back, by CUDA events around whole
    replays (no L2 flush: the calls run as an engine's step runs them), after 5 warm-up replays."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    return sorted(times)[reps // 2]


def commit() -> str:
    """The git commit of the tree the benchmark runs from ('unknown' outside a checkout). OSCAR_BENCH_COMMIT, where
    set, names it instead: a copy of the tree on another machine can carry a stale .git."""
    if os.environ.get("OSCAR_BENCH_COMMIT"):
        return os.environ["OSCAR_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def meta() -> dict:
    """Where and with what a result was measured."""
    import triton

    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def row(op: str, variant: str, shape: dict, times: tuple[float, float, float], **extra) -> dict:
    """One result row of the schema."""
    return {"op": op, "variant": variant, "shape": shape, "p50_ms": times[0], "p20_ms": times[1],
            "p80_ms": times[2], **extra}


def gpu_state() -> dict:
    """SM clock (MHz) and board power (W) read right after a measurement, through NVML: the H200 holds its 700 W cap
    under the INT2 decode and its SM clock falls with heat (docs/kernels.md, "Sustained load"), so a
    timing is read with the clock it ran at. Empty where NVML is not available."""
    try:
        return {"sm_clock_mhz": torch.cuda.clock_rate(), "power_w": round(torch.cuda.power_draw() / 1000, 1)}
    except Exception:  # noqa: BLE001 - NVML missing or not permitted: the row simply has no clock
        return {}


def gpu_tag() -> str:
    return (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu").replace(" ", "_")


def write_rows(out_dir: str, name: str, rows: list[dict]) -> Path:
    """Write `{meta, rows}` to `out_dir/<name>_<GPU>.json` atomically (a temp file renamed into place)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_{gpu_tag()}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta(), "rows": rows}, indent=1))
    os.replace(tmp, path)
    return path
