#!/usr/bin/env python3
"""Train the small Qwen3-architecture fixture model (`oscar_calib/fixtures/tiny-qwen3/`) from offline text.

Randomly initialised models have none of what makes 2-bit KV hard (attention sinks, outlier key
channels); this script trains a real one in a few minutes on one GPU so that tests and the demo have it.

Corpus (deterministic for a given Python installation): every `*.py` file of the running
interpreter's standard library (`sysconfig` "stdlib", site-packages excluded), then `*.py` files of
site-packages ("purelib") until `--corpus-mb` is reached, each list sorted by relative path. Files
that are not UTF-8, empty or larger than 1 MB are skipped; identical files are kept once. A file goes
to the held-out pool or the calibration pool by a hash of its relative path (never trained on).

Outputs (in `--out`): `model.safetensors` (bf16), `config.json`, `generation_config.json`,
tokenizer files (byte-level BPE, loadable with `AutoTokenizer.from_pretrained`), `heldout.txt`,
`calib.txt` (documents separated by the line `<|endoftext|>`), and `train_log.json`.

Usage:
    python3 tools/train_fixture.py --out /tmp/fixture                 # real run (GPU, ~5 min)
    python3 tools/train_fixture.py --out /tmp/fixture --smoke         # CPU smoke test (seconds)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

EOS = "<|endoftext|>"
DOC_SEPARATOR = f"\n{EOS}\n"  # how heldout.txt / calib.txt separate documents
MAX_FILE_BYTES = 1_000_000


# ----------------------------------------------------------------------------------------------
# corpus
# ----------------------------------------------------------------------------------------------
def _py_files(root: Path, exclude: tuple[str, ...] = ()) -> list[tuple[str, Path]]:
    """Sorted `(relative path, path)` of `*.py` files under `root`, skipping excluded top folders."""
    out = []
    if not root.is_dir():
        return out
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.split("/", 1)[0] in exclude or not path.is_file():
            continue
        out.append((rel, path))
    out.sort(key=lambda item: item[0])
    return out


def _pool(rel: str) -> str:
    """Deterministic split by path hash: ~2.5 % held-out, ~2.5 % calibration, the rest training."""
    h = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 1000
    return "heldout" if h < 25 else "calib" if h < 50 else "train"


def _files(root: Path, patterns: tuple[str, ...]) -> list[tuple[str, Path]]:
    """Sorted `(relative path, path)` of the files under `root` matching any of `patterns`."""
    if not root.is_dir():
        return []
    out = {(p.relative_to(root).as_posix(), p) for pat in patterns for p in root.rglob(pat) if p.is_file()}
    return sorted(out, key=lambda item: item[0])


def corpus_sources(kind: str) -> list[tuple[str, tuple[str, Path]]]:
    """`(prefix, (relative path, path))` of the corpus files, in a fixed order.

    - `python`: the standard library's `*.py`, then site-packages' `*.py` (the tiny-qwen3 fixture);
    - `c-docs`: C headers under /usr/include, then the prose of site-packages (`*.md`, `*.rst`, `*.txt`), so a
      second fixture is trained on text of another kind (the tiny-llama fixture).
    """
    purelib = Path(sysconfig.get_paths()["purelib"])
    if kind == "python":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        sources = [("stdlib", f) for f in _py_files(stdlib, exclude=("site-packages", "dist-packages"))]
        return sources + [("site", f) for f in _py_files(purelib)]
    if kind == "c-docs":
        sources = [("include", f) for f in _files(Path("/usr/include"), ("*.h",))]
        return sources + [("sitedocs", f) for f in _files(purelib, ("*.md", "*.rst", "*.txt"))]
    raise SystemExit(f"--corpus {kind}: expected 'python' or 'c-docs'")


def collect_corpus(corpus_bytes: int, kind: str = "python") -> dict[str, list[tuple[str, str]]]:
    """Read the offline text. Returns pool name -> list of `(relative path, text)` in a fixed order."""
    sources = corpus_sources(kind)
    pools: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": [], "calib": []}
    seen: set[str] = set()
    total = 0
    for prefix, (rel, path) in sources:
        if total >= corpus_bytes:
            break
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if not raw.strip() or len(raw) > MAX_FILE_BYTES:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if EOS in text:  # keep the separator unambiguous
            continue
        digest = hashlib.sha1(raw).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        name = f"{prefix}/{rel}"
        pools[_pool(name)].append((name, text))
        total += len(raw)
    return pools


def pick_eval_text(docs: list[tuple[str, str]], long_bytes: int, short_bytes: int,
                   long_min: int = 12_000, long_max: int = 40_000, short_max: int = 3_000) -> list[tuple[str, str]]:
    """A held-out/calibration text: some long single files (>= one 4K-token window) and many short ones.

    Documents are taken in a fixed order (sha1 of the path) so the choice is deterministic.
    """
    order = sorted(docs, key=lambda d: hashlib.sha1(d[0].encode()).hexdigest())
    chosen, used_long, used_short = [], 0, 0
    for name, text in order:
        size = len(text.encode())
        if long_min <= size <= long_max and used_long + size <= long_bytes:
            chosen.append((name, text))
            used_long += size
        elif size <= short_max and used_short + size <= short_bytes:
            chosen.append((name, text))
            used_short += size
    return chosen


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE trained on `texts`, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   model_max_length=1_000_000)


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Concatenate the token ids of `texts`, each followed by EOS. Returns int64 `[N]`."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    enc = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    for e in enc:
        ids.extend(e.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# model and training
# ----------------------------------------------------------------------------------------------
def make_config(args, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, Qwen3Config

    if args.arch == "llama":  # no q/k norm; the GQA ratio comes from --heads / --kv-heads
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            head_dim=args.head_dim, max_position_embeddings=args.max_positions, rope_theta=args.rope_theta,
            rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id,
            pad_token_id=eos_id)
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_positions,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, seq_len: int, device, autocast_dtype) -> float:
    """Perplexity of `stream [N]` cut into consecutive windows of `seq_len` (each starting fresh)."""
    model.eval()
    n_win = stream.numel() // seq_len
    nll, count = 0.0, 0
    for i in range(n_win):
        x = stream[i * seq_len:(i + 1) * seq_len].to(device)[None]
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(input_ids=x).logits.float()
        loss = F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum")
        nll += float(loss)
        count += seq_len - 1
    model.train()
    return math.exp(nll / max(count, 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: small corpus, few steps, short sequences")
    p.add_argument("--corpus-mb", type=float, default=100.0)
    p.add_argument("--corpus", choices=("python", "c-docs"), default="python", help="which offline text")
    p.add_argument("--arch", choices=("qwen3", "llama"), default="qwen3")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokenizer-mb", type=float, default=40.0, help="text used to train the tokenizer")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--max-positions", type=int, default=8192)
    p.add_argument("--rope-theta", type=float, default=100_000.0)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--minutes", type=float, default=4.0, help="training time budget; sets the step count")
    p.add_argument("--steps", type=int, default=None, help="fixed step count (overrides --minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--heldout-kb", type=int, default=240)
    p.add_argument("--calib-kb", type=int, default=180)
    args = p.parse_args(argv)
    if args.smoke:
        args.corpus_mb, args.tokenizer_mb = min(args.corpus_mb, 3.0), 1.0
        args.vocab, args.seq_len, args.batch = min(args.vocab, 512), 256, 4
        args.steps, args.warmup = args.steps or 6, 2
        args.heldout_kb, args.calib_kb = 60, 40

    def log(msg: str) -> None:
        print(f"[train_fixture {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    torch.manual_seed(args.seed)
    t0 = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    log(f"device={device} ({'bf16 autocast' if autocast_dtype else 'fp32: no GPU'}), torch {torch.__version__}")

    pools = collect_corpus(int(args.corpus_mb * 1e6), args.corpus)
    train_docs = pools["train"]
    heldout = pick_eval_text(pools["heldout"], args.heldout_kb * 600, args.heldout_kb * 400)
    calib = pick_eval_text(pools["calib"], args.calib_kb * 500, args.calib_kb * 500)
    train_bytes = sum(len(t.encode()) for _, t in train_docs)
    log(f"corpus: {len(train_docs)} train files ({train_bytes / 1e6:.1f} MB), "
        f"held-out {len(heldout)} docs, calib {len(calib)} docs ({time.time() - t0:.1f}s)")

    tok_texts, used = [], 0
    for _, text in train_docs:  # a fixed prefix of the training stream trains the tokenizer
        if used >= args.tokenizer_mb * 1e6:
            break
        tok_texts.append(text)
        used += len(text)
    tokenizer = train_tokenizer(tok_texts, args.vocab)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    log(f"tokenizer: vocab {len(tokenizer)} trained on {used / 1e6:.1f} MB ({time.time() - t0:.1f}s)")

    train_stream = encode_stream(tokenizer, [t for _, t in train_docs])
    heldout_stream = encode_stream(tokenizer, [t for _, t in heldout])
    log(f"tokens: train {train_stream.numel():,} ({train_bytes / train_stream.numel():.2f} bytes/token), "
        f"held-out {heldout_stream.numel():,} ({time.time() - t0:.1f}s)")

    from transformers import AutoModelForCausalLM

    config = make_config(args, len(tokenizer), eos_id)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
        f"head_dim {args.head_dim}, hidden {args.hidden}")
    fwd = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    data = train_stream.to(device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    max_start = data.numel() - args.seq_len - 1

    def batch() -> torch.Tensor:
        starts = torch.randint(0, max_start, (args.batch,), generator=gen)
        idx = starts[:, None] + torch.arange(args.seq_len + 1)[None]
        return data[idx.to(device)]

    def step_fn(step: int, total: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.lr, args.warmup)
        xy = batch()
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = fwd(input_ids=xy[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()  # a tensor: converting every step would synchronise the GPU

    # Time the first steps, then fix the step count so the cosine schedule is well defined.
    model.train()
    curve: list[dict] = []
    # The first steps pay for kernel selection and allocator warm-up: time only the later ones.
    warm, probe = (5, 25) if args.steps is None else (0, 0)
    for s in range(probe):
        if s == warm:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_probe = time.time()
        loss = step_fn(s, 10_000)
    if device.type == "cuda":
        torch.cuda.synchronize()
    sec_per_step = (time.time() - t_probe) / max(probe - warm, 1) if probe else 0.0
    total = args.steps if args.steps is not None else max(probe + 50, int(args.minutes * 60 / sec_per_step))
    log(f"schedule: {total} steps of {args.batch} x {args.seq_len} tokens"
        + (f" ({sec_per_step * 1000:.0f} ms/step measured)" if probe else ""))
    t_train = time.time()
    log_every = max(1, total // 40)
    for s in range(probe, total):
        loss = step_fn(s, total)
        if s % log_every == 0 or s == total - 1:
            elapsed = time.time() - t_train
            tps = (s - probe + 1) * args.batch * args.seq_len / max(elapsed, 1e-9)
            loss = float(loss)
            curve.append({"step": s, "loss": round(loss, 4), "lr": lr_at(s, total, args.lr, args.warmup),
                          "tokens_per_s": round(tps)})
            log(f"step {s:5d}/{total} loss {loss:.4f} ({tps / 1e3:.0f}k tok/s)")
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_time = time.time() - t_train
    tokens_seen = total * args.batch * args.seq_len

    ppl = {}
    for n in sorted({min(args.seq_len, 1024), args.seq_len}):
        ppl[str(n)] = perplexity(model, heldout_stream, n, device, autocast_dtype)
    log(f"held-out perplexity: {ppl}")

    args.out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16).cpu()
    model.config.dtype = torch.bfloat16
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    (args.out / "heldout.txt").write_text(DOC_SEPARATOR.join(t for _, t in heldout), encoding="utf-8")
    (args.out / "calib.txt").write_text(DOC_SEPARATOR.join(t for _, t in calib), encoding="utf-8")
    bf16_ppl = perplexity(model.to(device), heldout_stream, args.seq_len, device, None)
    report = {
        "python": sys.version.split()[0], "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "parameters": n_params, "train_files": len(train_docs), "train_bytes": train_bytes,
        "train_tokens": train_stream.numel(), "heldout_docs": [n for n, _ in heldout],
        "calib_docs": [n for n, _ in calib], "heldout_tokens": heldout_stream.numel(),
        "steps": total, "tokens_seen": tokens_seen, "epochs": tokens_seen / train_stream.numel(),
        "train_seconds": round(train_time, 1),
        "tokens_per_s": round(tokens_seen / max(train_time, 1e-9)),
        "heldout_ppl_autocast": ppl, "heldout_ppl_bf16_weights": {str(args.seq_len): bf16_ppl},
        "loss_curve": curve, "total_seconds": round(time.time() - t0, 1),
    }
    (args.out / "train_log.json").write_text(json.dumps(report, indent=1))
    log(f"wrote {args.out} ({sum(f.stat().st_size for f in args.out.iterdir()) / 1e6:.2f} MB) "
        f"in {time.time() - t0:.0f}s; bf16 held-out ppl @ {args.seq_len}: {bf16_ppl:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
