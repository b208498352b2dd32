"""Teacher-forced evaluation of KV-cache methods: what a decoder with a sink | INT2 history | recent cache sees.

For query position `t` of a window, key/value position `j <= t` is read from the INT2 history when
`fmt.is_history(j, t + 1)` (`runtime_kernels.format.KVFormat`: `[sink, sink + P * floor((t + 1 - sink - recent) / P))`
with the format's page size P; the evaluation's default P = 1 is token-granular) and in BF16 otherwise.

One forward pass per window and method, through a custom attention function registered with
transformers' AttentionInterface (and the SDPA mask under the same name). Inside, for each layer:

    S_exact = q . k_j,  S_quant = q . khat_j          (scaled; khat = fake-quantized keys)
    S = where(exact[t, j], S_exact, S_quant), causal -inf above the diagonal
    P = softmax(S);  O = (P * exact) V + (P * ~exact) Vhat

which is exactly attention over the per-position mixed K/V. The layer's reference (same q, k, v, all
BF16) comes for free, so each layer also reports the attention-score KL(P_ref || P) and the relative
output error |O - O_ref| / |O_ref|, over the query positions that read at least one quantized key.
Without those statistics (`collect_stats=False`) the same attention is one fp32 SDPA over the keys [K; Khat] with the
mask [exact, ~exact]: a softmax over the union of the two key sets, without the [T, S] scores.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from oscar_calib.analysis.methods import KVMethod
from oscar_calib.errors import InputError
from oscar_calib.interception import AttentionInterception
from runtime_kernels.artifact import model_geometry
from runtime_kernels.format import KVFormat

EVAL_ATTENTION = "oscar_eval"
DOC_SEPARATOR = "<|endoftext|>"  # a line of its own separates documents in a .txt file
SCORE_ELEMENTS = 1 << 28  # attention scores per slice of query rows (1 GiB of fp32)
SDPA_ROWS = 1024  # query rows per SDPA call: each call reads only the keys those rows may attend to
LOGIT_CHUNK = 2048  # positions per slice of the output head: Gemma 3's 262k vocabulary is 8.6 GB of fp32 logits at 8K
# Causal LMs whose forward is `lm_head(decoder(ids))` (then at most config.final_logit_softcapping): their logits may
# be formed a slice of positions at a time. Others (logit scales, extra heads) take the plain forward.
SLICED_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "smollm3"})


# ----------------------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------------------
def exact_mask(q_len: int, fmt: KVFormat, device: torch.device | str = "cpu", prefill: int = 0) -> torch.Tensor:
    """bool `[T, T]`: True where query `t` reads key `j` in BF16 (sink or recent window of `fmt`), False where
    quantized (`fmt.is_history(j, t + 1)`, at the format's page size).

    Entries above the diagonal are True (they are masked by causality anyway). Queries `t < prefill` read
    everything in BF16: the runtime's prefill attends over the prompt at full precision.
    """
    t = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(q_len, device=device)[None, :]
    quantized = fmt.is_history(j, t + 1) & (t >= prefill)  # the query at t sees a sequence of t + 1 tokens
    return ~quantized


# ----------------------------------------------------------------------------------------------------------
# the attention function
# ----------------------------------------------------------------------------------------------------------
@dataclass
class LayerStats:
    """Sums over (sequences, query heads, affected query positions) for one layer."""

    kl_sum: float = 0.0
    queries: int = 0
    err_num: float = 0.0
    err_den: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"attn_kl": self.kl_sum / max(self.queries, 1),
                "out_rel_err": math.sqrt(self.err_num / self.err_den) if self.err_den > 0 else 0.0,
                "queries": self.queries}


@dataclass
class EvalSession:
    """What the attention function applies while active: one method, the window sizes, the statistics."""

    method: KVMethod
    fmt: KVFormat  # its windows and page size decide which pairs are INT2 (`exact_mask`)
    collect_stats: bool = True
    prefill: int = 0
    layers: dict[int, LayerStats] = field(default_factory=dict)
    _masks: dict = field(default_factory=dict, repr=False)

    def mask(self, n: int, device) -> torch.Tensor:
        key = (n, str(device))
        if key not in self._masks:
            self._masks[key] = exact_mask(n, self.fmt, device, self.prefill)
        return self._masks[key]


def mixed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor | None,
                    v_hat: torch.Tensor | None, exact: torch.Tensor | None, allowed: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention over the per-position mixed cache, in fp32.

    Args:
        q: `[B, H_kv, g, T, d]` queries grouped by KV head. k, v, k_hat, v_hat: `[B, H_kv, S, d]`.
        exact: bool `[T, S]` (True = BF16), or None for all-BF16. allowed: bool broadcastable to `[B, H_kv, g, T, S]`.
    Returns:
        out `[B, H_kv, g, T, d]`, scores `S` used (masked, `[B, H_kv, g, T, S]`), exact scores (masked).
    """
    # Few passes over the [T, S] tensors (they dominate a long window's time): the scale goes on q, masks in place,
    # and O = P Vhat + (P * exact)(V - Vhat) instead of (P * exact) V + (P - P * exact) Vhat.
    q = q * scale
    hidden = ~allowed
    s_exact = torch.einsum("bhgtd,bhsd->bhgts", q, k).masked_fill_(hidden, float("-inf"))
    if exact is None:
        p = torch.softmax(s_exact, dim=-1)
        return torch.einsum("bhgts,bhsd->bhgtd", p, v), s_exact, s_exact
    s_quant = torch.einsum("bhgtd,bhsd->bhgts", q, k_hat).masked_fill_(hidden, float("-inf"))
    s = torch.where(exact, s_exact, s_quant)
    del s_quant
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhgts,bhsd->bhgtd", p, v_hat) + torch.einsum("bhgts,bhsd->bhgtd", p * exact, v - v_hat)
    return out, s, s_exact


def _allowed_mask(attention_mask: torch.Tensor | None, b: int, t: int, s: int, device) -> torch.Tensor:
    """bool broadcastable to `[B, 1, 1, T, S]`: causal, intersected with transformers' mask when given."""
    allowed = torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)
    allowed = allowed[None, None, None]
    if attention_mask is not None:
        m = attention_mask[..., -t:, :s]
        m = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
        allowed = allowed & m.reshape(m.shape[0], 1, 1, t, s)
    return allowed


def _eval_attention(session: EvalSession | None, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    **kwargs):
    """Routed attention function (`session` bound by `evaluating`; None = all BF16). query `[B, H_q, T, d]`,
    key/value `[B, H_kv, S, d]` (post-RoPE)."""
    b, h_q, t, d = query.shape
    h_kv, s = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    allowed = _allowed_mask(attention_mask, b, t, s, query.device)
    layer = getattr(module, "layer_idx", 0)
    quantize = session is not None and session.method.quantizes(layer)
    if quantize and t != s:
        raise InputError("oscar_eval attention: teacher-forced evaluation runs without a KV cache "
                         f"(got {t} queries over {s} keys); call the model with use_cache=False")
    k32, v32 = key.float(), value.float()
    gqa = h_q != h_kv
    if not quantize:
        # An all-BF16 layer (a sliding-window layer of a hybrid, every layer of the BF16 row) needs no scores of its
        # own: fp32 SDPA with the same mask, without the [T, S] tensors.
        out = _sliced_sdpa(query, [(k32, v32, allowed[:, 0])], scale, gqa)
        return out.transpose(1, 2).contiguous().to(query.dtype), None
    k_hat, v_hat = session.method.fake_quantize(layer, key, value, session.fmt)
    exact = session.mask(t, query.device)
    if not session.collect_stats:
        # Attention over the mixed cache is a softmax over the union of two key sets: BF16 key j where exact[t, j],
        # INT2 key j elsewhere: SDPA over [K; Khat] with that mask, without [T, S] scores (the statistics below
        # need the scores).
        out = _sliced_sdpa(query, [(k32, v32, allowed[:, 0] & exact),
                                   (k_hat.float(), v_hat.float(), allowed[:, 0] & ~exact)], scale, gqa)
        return out.transpose(1, 2).contiguous().to(query.dtype), None
    # Softmax is per query row, so rows can go in slices: a slice's score tensors stay near SCORE_ELEMENTS
    # (Gemma 3 at 16K would otherwise hold several [4, 16K, 16K] fp32 tensors at once).
    rows = max(1, SCORE_ELEMENTS // (b * h_q * s))
    q = query.float().reshape(b, h_kv, h_q // h_kv, t, d)
    outs = []
    for a in range(0, t, rows):
        z = slice(a, min(a + rows, t))
        part = allowed[..., z, :]  # [B?, 1, 1, rows, S]
        out, scores, ref_scores = mixed_attention(q[..., z, :], k32, v32, k_hat, v_hat, exact[z], part, scale)
        _accumulate(session, layer, scores, ref_scores, out, v32, exact[z], part)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    return out.reshape(b, h_q, t, d).transpose(1, 2).contiguous().to(query.dtype), None


def _key_spans(mask: torch.Tensor, rows: int) -> list[tuple[int, int]]:
    """`[lo, hi)` per slice of `rows` query rows: the key columns that some row of the slice allows in `mask
    [B?, 1, T, S]` (bool); `(0, 0)` where none does. All slices at once: one device sync per layer, not one per
    slice."""
    t, s = mask.shape[-2:]
    m = mask.reshape(-1, t, s).any(dim=0)  # [T, S]
    if t % rows:
        m = torch.cat([m, m.new_zeros(rows - t % rows, s)])
    cols = m.view(-1, rows, s).any(dim=1).to(torch.int8)  # [slices, S]
    lo, hi, any_ = cols.argmax(dim=1), s - cols.flip(1).argmax(dim=1), cols.any(dim=1)
    return [(a, b) if ok else (0, 0) for a, b, ok in zip(lo.tolist(), hi.tolist(), any_.tolist())]


def _sliced_sdpa(query: torch.Tensor, key_sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], scale: float,
                 enable_gqa: bool) -> torch.Tensor:
    """fp32 softmax attention of `query [B, H_q, T, d]` over the concatenation of key sets, each `(K [B, H_kv, S, d],
    V [B, H_kv, S, d], allowed bool [B?, 1, T, S])`; returns `[B, H_q, T, d]`.

    Query rows go `SDPA_ROWS` at a time, and each slice reads only the span of each set's keys its rows may attend to
    (the causal triangle's upper half, a sliding window's far past, the INT2 history of early rows are skipped); a
    slice stays within SCORE_ELEMENTS where a backend forms the scores (SDPA's math fallback, e.g. head_dim 256 in
    fp32)."""
    b, h_q, t, _ = query.shape
    s_all = sum(k.shape[2] for k, _, _ in key_sets)
    rows = max(1, min(SDPA_ROWS, SCORE_ELEMENTS // max(1, b * h_q * s_all)))
    spans = [_key_spans(allowed, rows) for _, _, allowed in key_sets]
    outs = []
    for i, a in enumerate(range(0, t, rows)):
        ks, vs, ms = [], [], []
        for (k, v, allowed), set_spans in zip(key_sets, spans):
            m = allowed[..., a:a + rows, :]
            lo, hi = set_spans[i]
            ks.append(k[:, :, lo:hi])
            vs.append(v[:, :, lo:hi])
            ms.append(m[..., lo:hi])
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:a + rows].float(), torch.cat(ks, dim=2), torch.cat(vs, dim=2), attn_mask=torch.cat(ms, dim=-1),
            scale=scale, enable_gqa=enable_gqa))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _accumulate(session: EvalSession, layer: int, scores, ref_scores, out, v, exact, allowed) -> None:
    """Add this call's KL(P_ref || P) and output error over queries that read a quantized key."""
    affected = ((~exact)[None, None, None] & allowed).any(dim=-1)  # [B?, 1, 1, T]
    affected = affected.expand(out.shape[:-1])
    if not bool(affected.any()):
        return
    logp = torch.log_softmax(scores, dim=-1)
    logp_ref = torch.log_softmax(ref_scores, dim=-1)
    p_ref = logp_ref.exp()
    kl = torch.where(p_ref > 0, p_ref * (logp_ref - logp), torch.zeros_like(p_ref)).sum(dim=-1)
    o_ref = torch.einsum("bhgts,bhsd->bhgtd", p_ref, v)
    st = session.layers.setdefault(layer, LayerStats())
    st.kl_sum += float(kl[affected].sum())
    st.queries += int(affected.sum())
    st.err_num += float(((out - o_ref) ** 2).sum(dim=-1)[affected].sum())
    st.err_den += float((o_ref ** 2).sum(dim=-1)[affected].sum())


@contextlib.contextmanager
def evaluating(model: torch.nn.Module, session: EvalSession) -> Iterator[EvalSession]:
    """Route `model`'s attention through the evaluation function, applying `session`, for the block; restore it
    afterwards, also on error. Nesting is refused (`oscar_calib.interception`)."""
    with AttentionInterception(model, EVAL_ATTENTION, partial(_eval_attention, session)):
        yield session


# ----------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------
def read_documents(path: str | Path) -> list[str]:
    """Documents of a text file: split on lines holding only `<|endoftext|>`; a file without one is one document."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--data {path}: no such file (expected a UTF-8 text file)")
    text = path.read_text(encoding="utf-8", errors="replace")
    docs = [d.strip("\n") for d in text.split(f"\n{DOC_SEPARATOR}\n")]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise InputError(f"--data {path}: the file holds no text")
    return docs


@dataclass
class Windows:
    """Evaluation windows `[N, context]` int64: single long documents and packed short documents."""

    long: torch.Tensor
    packed: torch.Tensor

    def all(self) -> list[tuple[str, torch.Tensor]]:
        return [(kind, w) for kind, w in (("long", self.long), ("packed", self.packed)) if w.shape[0]]


def make_windows(tokenizer, documents: list[str], context: int, max_windows: int | None = None) -> Windows:
    """Cut documents into windows of `context` tokens.

    A document of at least `context` tokens gives consecutive non-overlapping windows of its own ("long"
    windows: one document, long-range structure); shorter documents are joined with EOS and packed
    ("packed" windows). With `max_windows`, long and packed windows share the budget (half each when
    both exist).
    """
    eos = tokenizer.eos_token_id
    long_w, stream = [], []
    for doc in documents:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        if len(ids) >= context:
            long_w += [ids[i:i + context] for i in range(0, len(ids) - context + 1, context)]
        else:
            stream += ids + ([eos] if eos is not None else [])
    packed_w = [stream[i:i + context] for i in range(0, len(stream) - context + 1, context)]
    if max_windows is not None:
        n_long = min(len(long_w), max(max_windows - min(len(packed_w), max_windows // 2), 0))
        long_w, packed_w = long_w[:n_long], packed_w[:max_windows - n_long]

    def stack(ws):
        return torch.tensor(ws, dtype=torch.int64) if ws else torch.zeros(0, context, dtype=torch.int64)

    return Windows(stack(long_w), stack(packed_w))


# ----------------------------------------------------------------------------------------------------------
# perplexity
# ----------------------------------------------------------------------------------------------------------
def _head(model, hidden: torch.Tensor) -> torch.Tensor:
    """The output head of a `SLICED_HEAD_MODELS` model on hidden states `[B, n, hidden]`: logits `[B, n, V]` (fp32)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:  # as the model's forward does, in its dtype
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


@torch.no_grad()
def span_logits(model, input_ids: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Logits `[B, stop - start, V]` (fp32) at positions `[start, stop)` of `input_ids [B, T]`, without a KV cache;
    only those positions go through the output head where the architecture allows (`SLICED_HEAD_MODELS`)."""
    if getattr(model.config, "model_type", None) not in SLICED_HEAD_MODELS:
        return model(input_ids=input_ids, use_cache=False).logits[:, start:stop].float()
    hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    return _head(model, hidden[:, start:stop])


@torch.no_grad()
def token_nll(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token negative log-likelihood `[B, T-1]` (fp32) of `input_ids [B, T]`, without a KV cache.

    For the architectures of `SLICED_HEAD_MODELS` the decoder runs once and the output head `LOGIT_CHUNK` positions at
    a time, so the fp32 logits of a long window never exist at once; the numbers are those of the plain forward."""
    if getattr(model.config, "model_type", None) not in SLICED_HEAD_MODELS:
        logits = model(input_ids=input_ids, use_cache=False).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        return -logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, T, hidden]
    parts = []
    for a in range(0, input_ids.shape[1] - 1, LOGIT_CHUNK):
        z = slice(a, min(a + LOGIT_CHUNK, input_ids.shape[1] - 1))
        logp = torch.log_softmax(_head(model, hidden[:, z]), dim=-1)
        parts.append(-logp.gather(-1, input_ids[:, z.start + 1:z.stop + 1, None]).squeeze(-1))
    return torch.cat(parts, dim=1)


@torch.no_grad()
def method_nll(model, method: KVMethod, windows: torch.Tensor, fmt: KVFormat, batch_size: int = 1,
               collect_stats: bool = True) -> tuple[torch.Tensor, EvalSession]:
    """NLL `[N, T-1]` of every window under `method` in a cache of `fmt`, and the session with per-layer statistics."""
    session = EvalSession(method, fmt, collect_stats)
    device = next(model.parameters()).device
    parts = []
    with evaluating(model, session):
        for i in range(0, windows.shape[0], batch_size):
            parts.append(token_nll(model, windows[i:i + batch_size].to(device)).cpu())
    return torch.cat(parts), session


def ppl(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean())) if nll.numel() else float("nan")


def bootstrap_delta_ci(window_nll: torch.Tensor, ref_window_nll: torch.Tensor, n_boot: int = 2000,
                       level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the ppl change (percent) of a method against a reference.

    `window_nll`, `ref_window_nll`: `[N]` mean NLL of the same N windows under each. Windows are resampled
    together (paired), so what the interval measures is the noise of choosing these windows, not of the model.
    """
    a, b = window_nll.double(), ref_window_nll.double()
    if a.numel() < 2:
        return float("nan"), float("nan")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, a.numel(), (n_boot, a.numel()), generator=gen)
    deltas = 100.0 * torch.expm1(a[idx].mean(dim=1) - b[idx].mean(dim=1))
    tail = (1.0 - level) / 2
    return float(deltas.quantile(tail)), float(deltas.quantile(1.0 - tail))


# ----------------------------------------------------------------------------------------------------------
# the comparison
# ----------------------------------------------------------------------------------------------------------
def evaluate_methods(model, methods: list[KVMethod], windows: Windows, fmt: KVFormat, batch_size: int = 1,
                     progress=None) -> dict:
    """Run every method over every window in a cache of `fmt` (its windows; its page size is the granularity of the
    simulated history). Returns a JSON-ready dict (see `oscar-calib eval --json`)."""
    head_dim = model_geometry(model.config)[3]
    context = int(windows.long.shape[1])
    rows = []
    for method in methods:
        nll_parts, layer_stats, kinds = [], {}, {}
        for kind, w in windows.all():
            nll, session = method_nll(model, method, w, fmt, batch_size)
            nll_parts.append(nll)
            kinds[kind] = ppl(nll)
            for layer, st in session.layers.items():
                acc = layer_stats.setdefault(layer, type(st)())
                acc.kl_sum += st.kl_sum
                acc.queries += st.queries
                acc.err_num += st.err_num
                acc.err_den += st.err_den
            if progress:
                progress(method.name, kind)
        nll = torch.cat(nll_parts)
        half = nll.shape[1] // 2
        layers = [{"layer": i, **layer_stats[i].as_dict()} for i in sorted(layer_stats)]
        rows.append({
            "name": method.name,
            "description": method.description,
            "effective_bits": method.effective_bits(context, head_dim, fmt),
            "history_bits": method.history_bits(head_dim),
            "effective_bits_32k": method.effective_bits(32768, head_dim, fmt),
            "effective_bits_128k": method.effective_bits(131072, head_dim, fmt),
            "ppl": ppl(nll),
            "ppl_second_half": ppl(nll[:, half:]),
            "ppl_long": kinds.get("long", float("nan")),
            "ppl_packed": kinds.get("packed", float("nan")),
            "mean_attn_kl": (sum(r["attn_kl"] for r in layers) / len(layers)) if layers else 0.0,
            "mean_out_rel_err": (sum(r["out_rel_err"] for r in layers) / len(layers)) if layers else 0.0,
            "layers": layers,
            "window_nll": nll.double().mean(dim=1).tolist(),
        })
    base = next((r for r in rows if r["name"] == "bf16"), None)
    for r in rows:
        r["ppl_delta_pct"] = 100.0 * (r["ppl"] / base["ppl"] - 1.0) if base else None
        r["ppl_delta_ci95"] = (list(bootstrap_delta_ci(torch.tensor(r["window_nll"]), torch.tensor(base["window_nll"])))
                               if base and r is not base else None)
    return {
        "context": context,
        "sink": fmt.sink_tokens,
        "recent": fmt.recent_tokens,
        "page_size": fmt.page_size,
        "windows": {kind: int(w.shape[0]) for kind, w in (("long", windows.long), ("packed", windows.packed))},
        "tokens_scored": int(sum(w.shape[0] for _, w in windows.all()) * (context - 1)),
        "methods": rows,
    }


# ----------------------------------------------------------------------------------------------------------
# generation agreement through the real runtime
# ----------------------------------------------------------------------------------------------------------
def runtime_available() -> str | None:
    """None when `runtime_kernels.hf.OscarCache` can be imported, else the reason it cannot."""
    try:
        from runtime_kernels.hf import OscarCache  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return f"runtime_kernels.hf.OscarCache is not available ({type(exc).__name__}: {exc})"
    return None


def cache_kw(model, cache) -> dict:
    """`{name: cache}` for a forward call: `cache=` where the model's forward takes it (transformers 5.2x, which
    deprecates `past_key_values=` with a FutureWarning), else `past_key_values=` (5.17 knows only that)."""
    import inspect

    takes_cache = "cache" in inspect.signature(model.forward).parameters
    return {"cache" if takes_cache else "past_key_values": cache}


@torch.no_grad()
def greedy_continuation(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """BF16 (plain cache) greedy continuation: `prompt [1, P]` -> `[1, steps]` token ids."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(input_ids=prompt, **cache_kw(model, cache), use_cache=True).logits[:, -1]
    out = []
    for _ in range(steps):
        tok = logits.argmax(dim=-1, keepdim=True)
        out.append(tok)
        logits = model(input_ids=tok, **cache_kw(model, cache), use_cache=True).logits[:, -1]
    return torch.cat(out, dim=1)


@torch.no_grad()
def runtime_decode_logits(model, artifact, tokens: torch.Tensor, prompt_len: int, fmt: KVFormat | None = None,
                          backend: str = "auto") -> torch.Tensor:
    """Logits `[1, T - prompt_len, V]` of the real runtime (OscarCache in `fmt`, default the artifact's own format)
    decoding `tokens [1, T]` one at a time.

    The prompt `tokens[:, :prompt_len]` is prefilled (full precision, then written as sink | INT2 | recent);
    every later token is a decode step whose attention reads the INT2 history. Row i of the result is
    the prediction made at position `prompt_len - 1 + i`.
    """
    from runtime_kernels.hf import ATTENTION_NAME, OscarCache, oscar_attention_forward

    with AttentionInterception(model, ATTENTION_NAME, oscar_attention_forward):
        cache = OscarCache.from_artifact(artifact, model.config, batch_size=1, max_tokens=tokens.shape[1] + 1,
                                         fmt=fmt, backend=backend,
                                         allow_other_model=True)  # identity: checked by the caller
        logits = [model(input_ids=tokens[:, :prompt_len], **cache_kw(model, cache), use_cache=True).logits[:, -1:]]
        for pos in range(prompt_len, tokens.shape[1] - 1):
            logits.append(model(input_ids=tokens[:, pos:pos + 1], **cache_kw(model, cache), use_cache=True).logits)
        return torch.cat(logits, dim=1).float()


def generation_agreement(model, artifacts: dict, windows: torch.Tensor, steps: int,
                         fmt: KVFormat | None = None) -> dict:
    """Greedy next-token agreement with BF16 through the real runtime.

    Each artifact is served in its own format, with the windows and page size of `fmt` when given (a calibrated
    artifact's cache refuses windows other than those its clips were fitted for).
    For each window, the first `T - steps` tokens are the prompt; BF16 generates `steps` tokens greedily;
    the runtime (OscarCache, INT2 history) decodes the same tokens and predicts at every step. Reports the
    fraction of steps where its argmax equals BF16's greedy token, and the first step where they differ
    (the runtime's own greedy generation is identical to BF16 up to that step).
    """
    reason = runtime_available()
    if reason is not None:
        return {"status": "missing", "reason": reason}
    device = next(model.parameters()).device
    served = {name: art.kv_format if fmt is None else
              art.kv_format.with_(sink_tokens=fmt.sink_tokens, recent_tokens=fmt.recent_tokens, page_size=fmt.page_size)
              for name, art in artifacts.items()}
    pages = {f.page_size for f in served.values()}
    out: dict = {"status": "ok", "steps": steps, "windows": int(windows.shape[0]),
                 "page_size": pages.pop() if len(pages) == 1 else sorted(pages), "methods": {}}
    refs = []
    for w in windows:
        prompt = w[None, :w.shape[0] - steps].to(device)
        refs.append(torch.cat([prompt, greedy_continuation(model, prompt, steps)], dim=1))
    for name, art in artifacts.items():
        matches, first = [], []
        for seq in refs:
            p = seq.shape[1] - steps
            logits = runtime_decode_logits(model, art, seq, p, served[name])
            pred = logits.argmax(dim=-1)[0, :steps]
            ok = (pred == seq[0, p:]).float()
            matches.append(float(ok.mean()))
            miss = (ok == 0).nonzero()
            first.append(int(miss[0, 0]) if miss.numel() else steps)
        out["methods"][name] = {"match_rate": sum(matches) / len(matches),
                                "first_divergence_mean": sum(first) / len(first)}
    return out


__all__ = [
    "EvalSession",
    "bootstrap_delta_ci",
    "cache_kw",
    "Windows",
    "evaluate_methods",
    "evaluating",
    "exact_mask",
    "make_windows",
    "method_nll",
    "mixed_attention",
    "read_documents",
    "generation_agreement",
    "greedy_continuation",
    "runtime_available",
    "runtime_decode_logits",
    "token_nll",
]
