"""Model-level decode step: a randomly initialised Qwen3-8B-shaped decoder, OSCAR through PagedKVCache vs BF16.

    python bench/bench_model_decode.py --out DIR [--points 131072x1,32768x8] [--budget-gib 40]
    python bench/bench_model_decode.py --cpu-smoke          # tiny model on CPU under TRITON_INTERPRET=1

One decode step = embedding, 36 decoder layers (RMSNorm, fused QKV, per-head q/k RMSNorm, RoPE, attention, o_proj,
SwiGLU MLP), final norm and LM head, for one new token per sequence, all captured in ONE CUDA graph and replayed.
Attention per layer:
- OSCAR: `PagedKVCache.decode_step` (rotate the new K/V into the BF16 window and rotate q, in one launch; INT2 history
  + BF16 windows; un-rotate inside the split reduce), at the shipped layout: ue5m3 scales, centered K/V, 128/1024
  BF16 windows, page 64. The step is one where no page is demoted (63 steps in 64; `bench_demotion.py` times the
  page demotion of the 64th, amortised per step).
- BF16: a static cache `[B, H_kv, context, d]` per layer, the new K/V written at its position, then
  `scaled_dot_product_attention` with the best of the cuDNN and flash backends (flash-attn is not installed on the
  H200 image; both SDPA backends are timed and the faster one is reported).
The history is filled synthetically (random code bytes, ue5m3 scales in [0.1, 0.6), zeros in [0, 3) codes; random
BF16 K/V) instead of prefilled: the step's time depends on the bytes it reads, not on their values.

Reports ms per step and tokens per second at each point (a point that does not fit the GPU is recorded as skipped,
with the bytes it needs), and at 128K the largest batch whose KV cache fits `--budget-gib`, for each, with the
tokens per second at that batch. Results: `model_decode_<GPU>.json` (bench/common.py schema) and `.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from runtime_kernels.format import DEFAULT_FORMAT, KVFormat  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ModelShape:
    layers: int = 36
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    vocab: int = 151936
    rope_theta: float = 1e6
    eps: float = 1e-6


QWEN3_8B = ModelShape()
SMOKE_SHAPE = ModelShape(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=128, intermediate=512, vocab=512)


RECIPE = DEFAULT_FORMAT  # the cache layout `oscar-calib run` ships (128/1024 windows, ue5m3, centered, page 64)
DEFAULT_POINTS = [(c, b) for c in (32768, 65536, 131072) for b in (1, 8, 32)]
BUDGET_CONTEXT = 131072
MARGIN_BYTES = 6 << 30  # activations, graph pool, allocator slack


# ----------------------------------------------------------------------------------------------- the model
class Decoder:
    """Random-init decoder of `shape`, bf16 weights (std 0.02, norms 1). `step(tokens, attention)`: one decode
    token per sequence -> logits `[B, vocab]`; `attention(layer, q [B, H, d], k [B, H_kv, d], v) -> o [B, H, d]`
    (q, k after RoPE) stores the new K/V and attends over the cache."""

    def __init__(self, shape: ModelShape, device, seed: int = 0, compiled: bool = False):
        self.shape = shape
        # compiled: the work around attention through torch.compile (inductor fuses the norms, RoPE, casts, SiLU and
        # residual adds; the GEMMs stay cuBLAS), as an engine runs a model (vLLM compiles everything but attention
        # and replays CUDA graphs). The same for both caches: only `attention` differs between them.
        self._pre, self._post = pre_attention, post_attention
        if compiled:
            self._pre = torch.compile(pre_attention, dynamic=False, fullgraph=True)
            self._post = torch.compile(post_attention, dynamic=False, fullgraph=True)
        gen = torch.Generator(device=device).manual_seed(seed)
        dt = torch.bfloat16

        def w(*size):
            return (torch.randn(*size, generator=gen, device=device) * 0.02).to(dt)

        s = shape
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.embed = w(s.vocab, s.hidden)
        self.layers = [dict(ln1=torch.ones(s.hidden, device=device, dtype=dt), wqkv=w(s.hidden, qkv),
                            qn=torch.ones(s.head_dim, device=device, dtype=dt),
                            kn=torch.ones(s.head_dim, device=device, dtype=dt),
                            wo=w(s.heads * s.head_dim, s.hidden), ln2=torch.ones(s.hidden, device=device, dtype=dt),
                            wgu=w(s.hidden, 2 * s.intermediate), wd=w(s.intermediate, s.hidden))
                       for _ in range(s.layers)]
        self.norm = torch.ones(s.hidden, device=device, dtype=dt)
        self.lm_head = w(s.hidden, s.vocab)

    def rope(self, position: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[d]` fp32 of `position` (rotate-half convention)."""
        d = self.shape.head_dim
        inv = self.shape.rope_theta ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        ang = torch.cat([inv, inv]) * position
        return ang.cos(), ang.sin()

    def step(self, tokens: torch.Tensor, rope: tuple, attention) -> torch.Tensor:
        s = self.shape
        cos, sin = rope
        x = self.embed[tokens]
        for i, p in enumerate(self.layers):
            q, k, v = self._pre(x, p["ln1"], p["wqkv"], p["qn"], p["kn"], cos, sin, s.heads, s.kv_heads, s.eps)
            x = self._post(x, attention(i, q, k, v), p["wo"], p["ln2"], p["wgu"], p["wd"], s.eps)
        return F.rms_norm(x, (s.hidden,), self.norm, s.eps) @ self.lm_head


def pre_attention(x, ln1, wqkv, qn, kn, cos, sin, heads: int, kv_heads: int, eps: float):
    """`x [B, hidden]` -> q `[B, H, d]`, k, v `[B, H_kv, d]`: RMSNorm, fused QKV, per-head q/k RMSNorm, RoPE."""
    b, d = x.shape[0], cos.shape[-1]
    h = F.rms_norm(x, (x.shape[-1],), ln1, eps)
    q, k, v = (h @ wqkv).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = F.rms_norm(q.view(b, heads, d), (d,), qn, eps)
    k = F.rms_norm(k.view(b, kv_heads, d), (d,), kn, eps)
    return rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin), v.view(b, kv_heads, d)


def post_attention(x, o, wo, ln2, wgu, wd, eps: float):
    """Residual stream after attention output `o [B, H, d]`: o_proj, RMSNorm, SwiGLU MLP, both residual adds."""
    x = x + o.reshape(x.shape[0], -1).to(x.dtype) @ wo
    g, u = (F.rms_norm(x, (x.shape[-1],), ln2, eps) @ wgu).chunk(2, dim=-1)
    return x + (F.silu(g) * u) @ wd


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


# ----------------------------------------------------------------------------------------------- KV caches
def oscar_history(context: int, recipe: KVFormat) -> tuple[int, int]:
    """(history tokens, sequence length after the step) of a sequence of about `context` tokens whose next token
    demotes no page: the recent window ends mid-page."""
    p = recipe.page_size
    hist = (context - recipe.window_tokens - p // 2) // p * p
    return hist, recipe.window_tokens + hist + p // 2


def oscar_bytes_per_seq(shape: ModelShape, context: int, recipe: KVFormat) -> int:
    """KV bytes one sequence holds in PagedKVCache (all layers): its pages (codes, scales, zeros) and its window
    slot (`sink + recent + page - 1` BF16 rows of K and V)."""
    hist, _ = oscar_history(context, recipe)
    sb = recipe.scale_bytes
    row = shape.kv_heads * (2 * shape.head_dim // 4 + 4 * sb)
    window = 2 * shape.kv_heads * (recipe.window_tokens + recipe.page_size - 1) * shape.head_dim * 2
    return shape.layers * (hist * row + window)


def bf16_bytes_per_seq(shape: ModelShape, context: int) -> int:
    return shape.layers * 2 * shape.kv_heads * context * shape.head_dim * 2


class OscarAttention:
    """PagedKVCache at `recipe` with `batch` sequences of about `context` tokens (pages and windows filled with
    random bytes) and the booked append of one token each: `__call__` is what an engine runs per layer."""

    def __init__(self, shape: ModelShape, batch: int, context: int, device, recipe: KVFormat = RECIPE, seed: int = 0):
        from runtime_kernels.cache import PagedKVCache
        from runtime_kernels.quant.naive import ZERO_STEPS, encode_ue5m3

        s = shape
        gen = torch.Generator(device=device).manual_seed(seed)
        hist, n_after = oscar_history(context, recipe)
        rot = torch.linalg.qr(torch.randn(s.layers, s.kv_heads, s.head_dim, s.head_dim, generator=gen,
                                          device=device))[0]
        means = [torch.randn(s.layers, s.kv_heads, s.head_dim, generator=gen, device=device) * 0.3 for _ in "kv"]
        self.cache = PagedKVCache(rot, rot.transpose(-1, -2).contiguous(), torch.full((s.layers, s.kv_heads), 0.96),
                                  torch.full((s.layers, s.kv_heads), 0.96), max_pages=max(1, batch * hist // recipe.page_size),
                                  max_seqs=batch, fmt=recipe, device=device,
                                  k_mean=means[0] if recipe.centered else None,
                                  v_mean=means[1] if recipe.centered else None, check_finite=False)
        assert self.cache.memory_bytes() == batch * oscar_bytes_per_seq(shape, context, recipe)
        # Book the history through the engine API (lengths and pages), then fill every pool with random bytes.
        self.seq_ids = [self.cache.add_sequence() for _ in range(batch)]
        self.cache.plan_append(self.seq_ids, [n_after - 1] * batch)
        for pool in self.cache.pools:
            for codes in (pool.k_codes, pool.v_codes):
                codes.copy_(torch.randint(0, 256, codes.shape, generator=gen, device=device, dtype=torch.uint8))
            for t in (pool.k_scale, pool.v_scale):
                x = torch.rand(t.shape, generator=gen, device=device) * 0.5 + 0.1
                t.copy_(encode_ue5m3(x) if t.dtype == torch.uint8 else x)
            for t in (pool.k_zero, pool.v_zero):
                x = torch.rand(t.shape, generator=gen, device=device) * 3
                t.copy_(torch.floor(x * ZERO_STEPS) if t.dtype == torch.uint8 else x)
            for t in (pool.k_win, pool.v_win):
                t.copy_(torch.randn(t.shape, generator=gen, device=device))
        self.before = {sid: self.cache.snapshot(sid) for sid in self.seq_ids}
        self.plan = self.cache.plan_append(self.seq_ids, [1] * batch)  # the step: a window row per sequence
        self.position = n_after - 1

    def __call__(self, layer: int, q, k, v):
        # write the new K/V and attend, the output in the model's dtype (no cast after)
        return self.cache.decode_step(layer, self.plan, q, k, v, self.seq_ids, out_dtype=q.dtype)


class Bf16Attention:
    """Static BF16 cache `[B, H_kv, context, d]` per layer, the new token at position context - 1 (random history,
    or `history(layer) -> (k, v)` `[B, H_kv, context - 1, d]`), SDPA under `backend`."""

    def __init__(self, shape: ModelShape, batch: int, context: int, device, backend=None, history=None, seed=0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.k, self.v = [], []
        for i in range(shape.layers):
            for store, j in ((self.k, 0), (self.v, 1)):
                t = torch.empty(batch, shape.kv_heads, context, shape.head_dim, device=device, dtype=torch.bfloat16)
                if history is None:
                    t.normal_(generator=gen)
                else:
                    t[:, :, :-1] = history(i)[j]
                store.append(t)
        self.position = context - 1
        self.backend = backend

    def __call__(self, layer: int, q, k, v):
        from torch.nn.attention import sdpa_kernel

        kc, vc = self.k[layer], self.v[layer]
        kc[:, :, self.position] = k
        vc[:, :, self.position] = v
        if self.backend is None:
            o = F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True)
        else:
            with sdpa_kernel([self.backend]):
                o = F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True)
        return o[:, :, 0]


# ----------------------------------------------------------------------------------------------- timing
def capture_step(model: Decoder, attention, batch: int, position: int) -> torch.cuda.CUDAGraph:
    """One decode step of `batch` sequences at `position` captured in a CUDA graph (warmed up on a side stream)."""
    tokens = torch.randint(0, model.shape.vocab, (batch,), device="cuda")
    rope = model.rope(position, "cuda")  # fixed: every replay is the same step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compiles the kernels, fills the cache's metadata, outside the capture
            model.step(tokens, rope, attention)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.step(tokens, rope, attention)
    return graph


def graph_step_ms(model: Decoder, attention, batch: int, position: int) -> tuple[float, float, float]:
    """(p50, p20, p80) ms of one decode step replayed from a single CUDA graph (`capture_step`)."""
    graph = capture_step(model, attention, batch, position)
    times = common.time_ms(graph.replay, rep=300)
    del graph
    return times


def fits(nbytes: int) -> tuple[bool, str]:
    free, _ = torch.cuda.mem_get_info()
    return nbytes + MARGIN_BYTES <= free, f"needs {nbytes / 1e9:.1f} GB of KV cache, {free / 1e9:.1f} GB free"


def measure(model: Decoder, kind: str, context: int, batch: int, device="cuda", recipe: KVFormat = RECIPE,
            timer=None) -> list[dict]:
    """Rows of one (kind, context, batch): OSCAR, or BF16 under each SDPA backend. timer(model, attention, batch,
    position) -> (p50, p20, p80) ms (default `graph_step_ms`)."""
    from torch.nn.attention import SDPBackend

    shape = {"context": context, "batch": batch, "layers": model.shape.layers, "h_q": model.shape.heads,
             "h_kv": model.shape.kv_heads, "d": model.shape.head_dim}
    if kind == "oscar":
        nbytes = batch * oscar_bytes_per_seq(model.shape, context, recipe)
        variants = [("oscar_recipe", None)]
        shape.update(scale_format=recipe.scale_format, centered=recipe.centered, sink=recipe.sink_tokens,
                     recent=recipe.recent_tokens, page=recipe.page_size)  # the committed rows' names
    else:
        nbytes = batch * bf16_bytes_per_seq(model.shape, context)
        variants = [("bf16_sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("bf16_sdpa_flash", SDPBackend.FLASH_ATTENTION)]
    ok, why = fits(nbytes) if device == "cuda" else (True, "")
    if not ok:
        return [{"op": "model_decode_step", "variant": v, "shape": shape, "kv_bytes": nbytes, "skipped": why}
                for v, _ in variants]
    rows = []
    attn = OscarAttention(model.shape, batch, context, device, recipe) if kind == "oscar" else \
        Bf16Attention(model.shape, batch, context, device)
    for variant, backend in variants:
        if kind != "oscar":
            attn.backend = backend
        try:
            t = (timer or graph_step_ms)(model, attn, batch, attn.position)
            rows.append(common.row("model_decode_step", variant, shape, t, kv_bytes=nbytes,
                                   tokens_per_s=batch / t[0] * 1e3))
        except RuntimeError as e:  # a backend that refuses the shape is recorded, not fatal
            rows.append({"op": "model_decode_step", "variant": variant, "shape": shape, "kv_bytes": nbytes,
                         "error": str(e).splitlines()[0][:160]})
    del attn
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def best(rows: list[dict], prefix: str, context: int, batch: int) -> dict | None:
    mine = [r for r in rows if r["variant"].startswith(prefix) and "p50_ms" in r
            and (r["shape"]["context"], r["shape"]["batch"]) == (context, batch)]
    return min(mine, key=lambda r: r["p50_ms"]) if mine else None


def missing(rows: list[dict], prefix: str, context: int, batch: int) -> str:
    """Why a point has no time: it did not fit the GPU, every backend refused it, or it was not run."""
    mine = [r for r in rows if r["variant"].startswith(prefix)
            and (r["shape"]["context"], r["shape"]["batch"]) == (context, batch)]
    if any("skipped" in r for r in mine):
        return "does not fit"
    return "error" if mine else "not run"


def table(rows: list[dict], budget: dict) -> str:
    lines = ["| context | batch | BF16 best ms/step | BF16 tokens/s | OSCAR ms/step | OSCAR tokens/s | OSCAR vs BF16 |",
             "|---|---|---|---|---|---|---|"]
    for c, b in sorted({(r["shape"]["context"], r["shape"]["batch"]) for r in rows}):
        o, f = best(rows, "oscar", c, b), best(rows, "bf16", c, b)
        cell = [str(c), str(b)]
        cell += [f"{f['p50_ms']:.2f}", f"{f['tokens_per_s']:.0f}"] if f else [missing(rows, "bf16", c, b), "-"]
        cell += [f"{o['p50_ms']:.2f}", f"{o['tokens_per_s']:.0f}"] if o else [missing(rows, "oscar", c, b), "-"]
        cell.append(f"{o['tokens_per_s'] / f['tokens_per_s']:.2f}x" if o and f else "-")
        lines.append("| " + " | ".join(cell) + " |")
    lines += ["", f"KV budget {budget['budget_gib']} GiB at context {budget['context']}: BF16 fits "
              f"{budget['bf16_batch']} sequences ({budget.get('bf16_tokens_per_s', float('nan')):.0f} tokens/s), "
              f"OSCAR {budget['oscar_batch']} ({budget.get('oscar_tokens_per_s', float('nan')):.0f} tokens/s): "
              f"{budget['sequences_ratio']:.2f}x the sequences, "
              f"{budget.get('throughput_ratio', float('nan')):.2f}x the tokens/s."]
    return "\n".join(lines) + "\n"


def run(out: str, points, budget_gib: float, shape: ModelShape = QWEN3_8B, device="cuda", recipe: KVFormat = RECIPE,
        budget_context: int = BUDGET_CONTEXT, timer=None, compiled: bool = False) -> tuple[list[dict], dict]:
    """Every point for BF16 and OSCAR, then each at the largest batch whose KV cache fits `budget_gib` at
    `budget_context`; results written to `out` after every measurement -> (rows, budget summary). `compiled`: the
    decoder's work around attention through torch.compile (`Decoder`), results `model_decode_compiled_<GPU>`."""
    t0 = time.perf_counter()
    model = Decoder(shape, device, compiled=compiled)
    name = "model_decode_compiled" if compiled else "model_decode"
    print(f"# model built: {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    budget_bytes = int(budget_gib * (1 << 30))
    budget = {"budget_gib": budget_gib, "context": budget_context,
              "bf16_batch": budget_bytes // bf16_bytes_per_seq(shape, budget_context),
              "oscar_batch": budget_bytes // oscar_bytes_per_seq(shape, budget_context, recipe)}
    budget["sequences_ratio"] = budget["oscar_batch"] / max(1, budget["bf16_batch"])
    todo = [(k, c, b) for c, b in points for k in ("bf16", "oscar")]
    todo += [("bf16", budget_context, budget["bf16_batch"]), ("oscar", budget_context, budget["oscar_batch"])]
    path = None
    for kind, context, batch in todo:
        if batch < 1 or any(r["shape"]["context"] == context and r["shape"]["batch"] == batch
                            and r["variant"].startswith(kind) for r in rows):
            continue
        t1 = time.perf_counter()
        new = measure(model, kind, context, batch, device, recipe, timer)
        rows += new
        for r in new:
            print(r["variant"], context, batch, f"{r['p50_ms']:.3f} ms/step {r['tokens_per_s']:.0f} tok/s"
                  if "p50_ms" in r else r.get("skipped", r.get("error")), f"({time.perf_counter() - t1:.1f} s)",
                  flush=True)
        for key in ("bf16", "oscar"):
            r = best(rows, key, budget_context, budget[f"{key}_batch"])
            if r:
                budget[f"{key}_tokens_per_s"] = r["tokens_per_s"]
        if "bf16_tokens_per_s" in budget and "oscar_tokens_per_s" in budget:
            budget["throughput_ratio"] = budget["oscar_tokens_per_s"] / budget["bf16_tokens_per_s"]
        path = common.write_rows(out, name, rows + [{"op": "kv_budget", "variant": "summary",
                                                              "shape": {"context": budget_context}, **budget}])
    path.with_suffix(".md").write_text(table(rows, budget))
    print(table(rows, budget))
    print("wrote", path, f"({time.perf_counter() - t0:.0f} s)")
    return rows, budget


# ----------------------------------------------------------------------------------------------- CPU smoke
def smoke(batch: int = 2, history_pages: int = 2, seed: int = 0, recipe: KVFormat = RECIPE) -> dict:
    """The OSCAR step of a tiny model through PagedKVCache (eager, CPU; Triton under its interpreter) against the
    same model over a static BF16 cache holding the cache's own (dequantized) contents -> relative RMSE of the
    logits and of layer 0's attention output; `*_swapped`: the same against a BF16 cache whose sequences' contents
    are swapped (what a wrong block table or slot would give)."""
    shape = SMOKE_SHAPE
    context = recipe.window_tokens + recipe.page_size // 2 + history_pages * recipe.page_size
    model = Decoder(shape, "cpu", seed)
    oscar = OscarAttention(shape, batch, context, "cpu", recipe=recipe, seed=seed + 1)
    n_before = oscar.position  # tokens cached before the step

    def history(layer, order):
        kv = [oscar.cache.dense_kv(layer, oscar.seq_ids[j], state=oscar.before[oscar.seq_ids[j]]) for j in order]
        return tuple(torch.stack([x[i] for x in kv]).transpose(1, 2).to(torch.bfloat16) for i in range(2))

    same, swapped = list(range(batch)), [(j + 1) % batch for j in range(batch)]
    refs = {"bf16": Bf16Attention(shape, batch, n_before + 1, "cpu", history=lambda i: history(i, same)),
            "swapped": Bf16Attention(shape, batch, n_before + 1, "cpu", history=lambda i: history(i, swapped))}
    outs = {}

    def tap(name, attn):
        def call(layer, q, k, v):
            o = attn(layer, q, k, v)
            if layer == 0:
                outs[name] = o.float()
            return o
        return call

    tokens = torch.randint(0, shape.vocab, (batch,), generator=torch.Generator().manual_seed(seed))
    rope = model.rope(n_before, "cpu")
    logits = {name: model.step(tokens, rope, tap(name, attn)).float()
              for name, attn in (("oscar", oscar), *refs.items())}

    def rel(a, b):
        return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()

    return {"logits_rel_rmse": rel(logits["oscar"], logits["bf16"]),
            "attention_rel_rmse": rel(outs["oscar"], outs["bf16"]),
            "logits_rel_rmse_swapped": rel(logits["oscar"], logits["swapped"]),
            "attention_rel_rmse_swapped": rel(outs["oscar"], outs["swapped"]),
            "tokens": n_before + 1, "history_tokens": len(oscar.before[oscar.seq_ids[0]][1]) * recipe.page_size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for model_decode_<GPU>.json and .md (GPU run)")
    ap.add_argument("--points", help="comma-separated CONTEXTxBATCH (default: 32K/64K/128K x 1/8/32)")
    ap.add_argument("--budget-gib", type=float, default=40.0, help="KV budget for the sequences-per-GPU rows")
    ap.add_argument("--compiled", action="store_true",
                    help="the work around attention through torch.compile, for both caches (as an engine runs it); "
                         "writes model_decode_compiled_<GPU>")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU under the Triton interpreter")
    args = ap.parse_args()
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print(smoke())
        return 0
    if not args.out:
        sys.exit("bench_model_decode: --out: required for the GPU run")
    if not torch.cuda.is_available():
        sys.exit("bench_model_decode: needs a CUDA GPU (or --cpu-smoke)")
    points = DEFAULT_POINTS if not args.points else [tuple(int(x) for x in p.split("x"))
                                                     for p in args.points.split(",")]
    run(args.out, points, args.budget_gib, compiled=args.compiled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
