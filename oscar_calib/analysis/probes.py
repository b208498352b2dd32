"""Long-context probes: does a KV method keep what a far-away token said?

Perplexity averages over every position; these probes ask about facts placed deep in the INT2 history.

- Passkey retrieval (teacher-forced, any `KVMethod`): a random number follows a fixed phrase at a chosen depth of a
  window of held-out text, and the same phrase closes the window. Scored: the fraction of the number's tokens the
  model predicts greedily at the end, and their mean NLL, with the evaluation's three-segment mask (sink | INT2
  history | recent), so the needle is read from the quantized history whenever its depth puts it there.
- Multi-key retrieval (the same scoring): several needles of one form, each naming its own key ("the pass key for
  the river is 51234"), spread over the INT2 history; the question asks for one of them. The others are
  distractors of the same form, which is where 2-bit caches are known to fail while a single needle survives
  (RULER's multi-key needles: KVQuant-2bit 95.4 vs 100 on one needle, 23.4 vs 68.2 on multi-key, at 32K).
- Multi-value retrieval (the same scoring): several needles give the same key different values; the question asks
  for all of them, in the order the window holds them.
- Verbatim recall through the real runtime (`OscarCache`, or transformers' `DynamicCache` for BF16): a prompt holds
  a passage; the model first generates `generate` tokens of its own, then is cued with the passage's first tokens
  and continues greedily. Scored: the fraction of the passage's remaining tokens reproduced exactly.

Shapes: windows are `[N, T]` token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_calib.analysis.evaluate import EvalSession, cache_kw, evaluating, span_logits
from oscar_calib.analysis.methods import KVMethod
from oscar_calib.errors import InputError
from runtime_kernels.format import KVFormat

NEEDLE = " The secret pass key is {key}. Remember it: the pass key is {key}."
QUESTION = " What was the secret pass key? The pass key is"  # + " {key}", the targets


@dataclass
class PasskeyBatch:
    """Windows `[N, T]` with a needle each; `key_spans[i]` = positions `[a, b)` of the key at the recall (targets)."""

    ids: torch.Tensor
    key_spans: list[tuple[int, int]]
    depths: list[float]
    needle_positions: list[int]


def _question_tokens(tokenizer, question: str, answer: str, probe: str) -> tuple[list[int], list[int]]:
    """Token ids of the question and of question + answer; the answer must start a new token, so that the targets
    (the ids after the question's) are the answer alone."""
    head = tokenizer(question, add_special_tokens=False).input_ids
    full = tokenizer(question + answer, add_special_tokens=False).input_ids
    if full[:len(head)] != head:
        raise InputError(f"{probe}: this tokenizer merges the question's last word with the answer; the probe needs "
                         "the answer to start a new token")
    return head, full


def passkey_batch(tokenizer, filler: torch.Tensor, depths: list[float], seed: int = 0) -> PasskeyBatch:
    """Overwrite part of each filler window `[N, T]` with a needle at `depths[i % len(depths)]` (fraction of the
    window) and the question at its end, keeping the length T."""
    if filler.dim() != 2 or filler.shape[0] == 0:
        raise InputError(f"passkey: expected filler windows [N, T], got shape {tuple(filler.shape)}")
    gen = torch.Generator().manual_seed(seed)
    ids, spans, used, positions = [], [], [], []
    for i, row in enumerate(filler):
        key = str(int(torch.randint(10000, 100000, (1,), generator=gen)))
        needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False).input_ids
        head, full = _question_tokens(tokenizer, QUESTION, f" {key}", "passkey")
        t = row.shape[0]
        depth = depths[i % len(depths)]
        pos = int(depth * (t - len(full) - len(needle)))
        if pos + len(needle) > t - len(full):
            raise InputError(f"passkey: windows of {t} tokens are too short for a needle at depth {depth}")
        seq = row.clone()
        seq[pos:pos + len(needle)] = torch.tensor(needle, dtype=seq.dtype)
        seq[t - len(full):] = torch.tensor(full, dtype=seq.dtype)
        ids.append(seq)
        spans.append((t - len(full) + len(head), t))
        used.append(depth)
        positions.append(pos)
    return PasskeyBatch(torch.stack(ids), spans, used, positions)


MULTIKEY_NEEDLE = " The pass key for the {name} is {key}."
MULTIKEY_QUESTION = " What was the pass key for the {name}? The pass key for the {name} is"  # + " {key}"
MULTIKEY_NAMES = ("river", "garden", "lantern", "harbor", "meadow", "candle", "forest", "window")


def multikey_batch(tokenizer, filler: torch.Tensor, lo: float, hi: float, keys: int = 4,
                   seed: int = 0) -> PasskeyBatch:
    """Each filler window `[N, T]` with `keys` needles (distinct names, distinct random keys) in the span of depths
    `[lo, hi)` (fractions of the window), one needle per equal part of it at a random place inside; window i asks for
    the needle of part `i % keys`, so the asked needle's depth sweeps the span over the windows. The question closes
    the window (length T kept). `depths` / `needle_positions` are the asked needle's."""
    _check_needle_inputs("multi-key", filler, lo, hi, "keys", keys)
    gen = torch.Generator().manual_seed(seed)
    ids, spans, used, positions = [], [], [], []
    t = filler.shape[1]
    for i, row in enumerate(filler):
        names = [MULTIKEY_NAMES[j] for j in torch.randperm(len(MULTIKEY_NAMES), generator=gen)[:keys].tolist()]
        values = [str(int(v)) for v in torch.randint(10000, 100000, (keys,), generator=gen)]
        while len(set(values)) < keys:  # distinct keys: a distractor must not carry the asked key
            values = [str(int(v)) for v in torch.randint(10000, 100000, (keys,), generator=gen)]
        asked = i % keys
        head, full = _question_tokens(tokenizer, MULTIKEY_QUESTION.format(name=names[asked]), f" {values[asked]}",
                                      "multi-key")
        body = t - len(full)
        seq = row.clone()
        needles = [tokenizer(MULTIKEY_NEEDLE.format(name=names[j], key=values[j]), add_special_tokens=False).input_ids
                   for j in range(keys)]
        placed = _place_needles(seq, needles, lo, hi, body, gen, "multi-key")
        used.append(placed[asked] / t)
        positions.append(placed[asked])
        seq[body:] = torch.tensor(full, dtype=seq.dtype)
        ids.append(seq)
        spans.append((body + len(head), t))
    return PasskeyBatch(torch.stack(ids), spans, used, positions)


def _check_needle_inputs(probe: str, filler: torch.Tensor, lo: float, hi: float, what: str, count: int) -> None:
    """The inputs every several-needle probe shares: windows `[N, T]`, 2..8 needles, a depth span inside [0, 1]."""
    if filler.dim() != 2 or filler.shape[0] == 0:
        raise InputError(f"{probe}: expected filler windows [N, T], got shape {tuple(filler.shape)}")
    if not 2 <= count <= len(MULTIKEY_NAMES):
        raise InputError(f"{probe}: {what} {count}: expected 2..{len(MULTIKEY_NAMES)}")
    if not 0 <= lo < hi <= 1:
        raise InputError(f"{probe}: depth span [{lo}, {hi}) must lie inside [0, 1]")


def _place_needles(seq: torch.Tensor, needles: list[list[int]], lo: float, hi: float, body: int,
                   gen: torch.Generator, probe: str) -> list[int]:
    """Write needle j of `needles` (token ids) into `seq [T]` at a random place inside the j-th equal part of the
    depths `[lo, hi)` of its first `body` tokens, in order and without overlap; returns their positions."""
    n, t, end, placed = len(needles), seq.shape[0], 0, []
    for j, needle in enumerate(needles):
        a = int((lo + (hi - lo) * j / n) * body)
        b = int((lo + (hi - lo) * (j + 1) / n) * body) - len(needle)
        if b <= max(a, end):
            raise InputError(f"{probe}: windows of {t} tokens are too short for {n} needles in depths "
                             f"[{lo:.3f}, {hi:.3f})")
        pos = int(torch.randint(max(a, end), b, (1,), generator=gen))
        seq[pos:pos + len(needle)] = torch.tensor(needle, dtype=seq.dtype)
        end = pos + len(needle)
        placed.append(pos)
    return placed


MULTIVALUE_NEEDLE = " One of the pass keys for the {name} is {key}."
MULTIVALUE_QUESTION = " What are all the pass keys for the {name}? The pass keys for the {name} are"  # + " k1 k2 ..."


def multivalue_batch(tokenizer, filler: torch.Tensor, lo: float, hi: float, values: int = 4,
                     seed: int = 0) -> PasskeyBatch:
    """Each filler window `[N, T]` with `values` needles naming one key (a name of MULTIKEY_NAMES), each with its own
    random value, one per equal part of the depths `[lo, hi)`; the question asks for all of them, and the targets are
    the values in the order the window holds them, separated by spaces (RULER's multi-value needles, teacher-forced:
    each value is predicted after the ones before it). `depths` / `needle_positions` are the first needle's."""
    _check_needle_inputs("multi-value", filler, lo, hi, "values", values)
    gen = torch.Generator().manual_seed(seed)
    ids, spans, used, positions = [], [], [], []
    t = filler.shape[1]
    for row in filler:
        name = MULTIKEY_NAMES[int(torch.randint(len(MULTIKEY_NAMES), (1,), generator=gen))]
        vals = [str(int(v)) for v in torch.randint(10000, 100000, (values,), generator=gen)]
        head, full = _question_tokens(tokenizer, MULTIVALUE_QUESTION.format(name=name),
                                      "".join(f" {v}" for v in vals), "multi-value")
        body = t - len(full)
        seq = row.clone()
        needles = [tokenizer(MULTIVALUE_NEEDLE.format(name=name, key=v), add_special_tokens=False).input_ids
                   for v in vals]
        placed = _place_needles(seq, needles, lo, hi, body, gen, "multi-value")
        used.append(placed[0] / t)
        positions.append(placed[0])
        seq[body:] = torch.tensor(full, dtype=seq.dtype)
        ids.append(seq)
        spans.append((body + len(head), t))
    return PasskeyBatch(torch.stack(ids), spans, used, positions)


@torch.no_grad()
def passkey_scores(model, method: KVMethod, batch: PasskeyBatch, fmt: KVFormat) -> dict:
    """Greedy accuracy over the key tokens, the fraction of keys entirely right, and the keys' mean NLL; per needle
    too (`per_needle`: accuracy and mean NLL of each key, for intervals over needles). The cache has the windows of
    `fmt` and a token-granular history (page size 1), so a needle's depth alone decides where it is read from."""
    device = next(model.parameters()).device
    hits, tokens, exact, nll = 0, 0, 0, 0.0
    per_acc, per_nll = [], []
    with evaluating(model, EvalSession(method, fmt.per_token(), collect_stats=False)):
        for i in range(batch.ids.shape[0]):
            seq = batch.ids[i:i + 1].to(device)
            a, b = batch.key_spans[i]
            pred = span_logits(model, seq, a - 1, b - 1)[0]  # position j predicts token j + 1
            target = seq[0, a:b]
            ok = pred.argmax(dim=-1) == target
            key_nll = float(-torch.log_softmax(pred, dim=-1).gather(-1, target[:, None]).sum())
            hits += int(ok.sum())
            tokens += b - a
            exact += int(ok.all())
            nll += key_nll
            per_acc.append(float(ok.float().mean()))
            per_nll.append(key_nll / (b - a))
    n = batch.ids.shape[0]
    return {"key_token_accuracy": hits / tokens, "keys_exact": exact / n, "key_nll": nll / tokens, "needles": n,
            "per_needle": {"accuracy": per_acc, "nll": per_nll}}


@torch.no_grad()
def verbatim_recall(model, window: torch.Tensor, passage_start: int, passage_len: int, generate: int, cue: int,
                    artifact=None) -> float:
    """Fraction of `window[passage_start + cue : passage_start + passage_len]` reproduced exactly after the prompt
    `window [T]` (which holds the passage), `generate` free greedy tokens, and the cue `window[passage_start :
    passage_start + cue]`. `artifact` None = BF16 (`DynamicCache`), else through `OscarCache` in the artifact's
    own KV format."""
    if not 0 < cue < passage_len or passage_start + passage_len > window.shape[0]:
        raise InputError(f"verbatim recall: cue {cue} must lie inside a passage of {passage_len} tokens that lies "
                         f"inside the {window.shape[0]}-token prompt")
    device = next(model.parameters()).device
    prompt = window[None].to(device)
    passage = window[passage_start:passage_start + passage_len].to(device)
    total = prompt.shape[1] + generate + passage_len + 1

    def run(cache) -> float:
        logits = model(input_ids=prompt, **cache_kw(model, cache), use_cache=True).logits[:, -1]
        for _ in range(generate):
            tok = logits.argmax(dim=-1, keepdim=True)
            logits = model(input_ids=tok, **cache_kw(model, cache), use_cache=True).logits[:, -1]
        logits = model(input_ids=passage[None, :cue], **cache_kw(model, cache), use_cache=True).logits[:, -1]
        out = []
        for _ in range(passage_len - cue):
            tok = logits.argmax(dim=-1, keepdim=True)
            out.append(tok)
            logits = model(input_ids=tok, **cache_kw(model, cache), use_cache=True).logits[:, -1]
        got = torch.cat(out, dim=1)[0]
        return float((got == passage[cue:]).float().mean())

    if artifact is None:
        from transformers import DynamicCache

        return run(DynamicCache(config=model.config))
    from oscar_calib.interception import AttentionInterception
    from runtime_kernels.hf import ATTENTION_NAME, OscarCache, oscar_attention_forward

    with AttentionInterception(model, ATTENTION_NAME, oscar_attention_forward):
        cache = OscarCache.from_artifact(artifact, model.config, batch_size=1, max_tokens=total,
                                         allow_other_model=True)  # the caller checked the artifact's model
        return run(cache)


def run_probes(model, tokenizer, methods: list[KVMethod], artifacts: dict, windows: torch.Tensor, needles: int,
               fmt: KVFormat, generate: int = 64, passage: int = 48, cue: int = 8) -> dict:
    """Both probes on held-out `windows [N, T]`: passkey for every method (needles spread over the INT2 history of
    `fmt`'s windows), verbatim recall for BF16 and each artifact (`name -> OscarArtifact`) on the first window."""
    sink, recent = fmt.sink_tokens, fmt.recent_tokens
    t = windows.shape[1]
    if t <= sink + recent + 64:
        raise InputError(f"probes: windows of {t} tokens leave no INT2 history past sink {sink} + recent {recent}; "
                         "use a longer --context or smaller windows")
    filler = windows[torch.arange(needles) % windows.shape[0]]
    lo, hi = (sink + 16) / t, 1.0 - (recent + 64) / t  # depths whose needle lies in the INT2 history
    depths = [lo + (hi - lo) * i / max(needles - 1, 1) for i in range(needles)]
    batch = passkey_batch(tokenizer, filler, depths, seed=0)
    out = {"needles": needles, "context": t, "sink": sink, "recent": recent, "depth_range": [lo, hi], "passkey": {},
           "verbatim": {}}
    for m in methods:
        out["passkey"][m.name] = passkey_scores(model, m, batch, fmt)
    prompt_len = t - generate - passage - 1
    start = sink + 32  # the passage sits in the INT2 history of every cache below
    if start + passage > prompt_len - recent:
        out["verbatim"] = {"status": "skipped", "reason": f"a {t}-token window leaves no room for the passage "
                                                           f"in the history (sink {sink}, recent {recent})"}
        return out
    win = windows[0, :prompt_len]
    out["verbatim_setup"] = {"prompt": prompt_len, "passage_start": start, "passage": passage, "cue": cue,
                             "generate": generate}
    out["verbatim"]["bf16"] = verbatim_recall(model, win, start, passage, generate, cue)
    for name, art in artifacts.items():
        out["verbatim"][name] = verbatim_recall(model, win, start, passage, generate, cue, artifact=art)
    return out


__all__ = ["MULTIKEY_NAMES", "MULTIKEY_NEEDLE", "MULTIKEY_QUESTION", "NEEDLE", "PasskeyBatch", "QUESTION",
           "multikey_batch", "multivalue_batch", "passkey_batch", "passkey_scores", "run_probes", "verbatim_recall"]
