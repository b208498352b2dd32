#!/usr/bin/env python3
"""OSCAR served by vLLM on a GPU, checked token for token against the project's own runtime (docs/vllm.md).

One run, one card, each side in its own process (vLLM's engine runs in-process there,
VLLM_ENABLE_V1_MULTIPROCESSING=0, so the plugin's counters can be read after `generate`):
- `hf-oscar`: transformers + `runtime_kernels.hf.OscarCache` on the same artifact (the reference);
- `hf-bf16`: transformers with its own BF16 cache (what the implementation difference alone costs);
- `vllm-bf16`: `vllm.LLM` with FlashAttention and its BF16 cache;
- `vllm-oscar`: `vllm.LLM` with `additional_config={"oscar": ...}`, CUDA graphs on (vLLM's default);
- `vllm-oscar-eager`: the same with `enforce_eager=True` (graph replay must give the eager tokens);
- `vllm-oscar-partial`: the artifact restricted to layers 2.. (layers 0-1 keep vLLM's FlashAttention and BF16 pages,
  in the same KV cache group as the INT2 layers).
Greedy continuations of the prompts (token ids, tokenized on the CPU: `--prompts` JSON), `--new-tokens` each, all
prompts in one batch. Writes `<out>/vllm_gpu_check_<GPU>.json` (meta, per-mode tokens, first divergences with the
reference's top-1/top-2 logit margin there, KV capacity lines, engine counters) and prints a summary.

    python3 bench/vllm_gpu_check.py --model M --artifact A --prompts P.json --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODES = ("hf", "vllm-bf16", "vllm-oscar", "vllm-oscar-eager", "vllm-oscar-partial")
BLOCK = 64
CAPACITY_LINES = re.compile(r"(GPU KV cache size: [\d,]+ tokens|Maximum concurrency for [\d,]+ tokens per request: "
                            r"[\d.]+x|Using \S+ backend|Using FlashAttention version \d|OSCAR[^\n]*|Capturing CUDA "
                            r"graphs[^\n]*|Graph capturing finished[^\n]*)")


def load_prompts(path: Path) -> list[list[int]]:
    data = json.loads(path.read_text())
    prompts = data["prompts"] if isinstance(data, dict) else data
    if not prompts or not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts):
        raise SystemExit(f"--prompts {path}: expected {{'prompts': [[token ids], ...]}}")
    return prompts


# ------------------------------------------------------------------------------------------------------------
# one side per process
# ------------------------------------------------------------------------------------------------------------
def run_hf(args) -> dict:
    """Reference: transformers + OscarCache (the project's runtime) and transformers' BF16 cache, greedy, one
    prompt at a time; per step the top-1 and top-2 logits."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from runtime_kernels.artifact import read_artifact
    from runtime_kernels.hf import OscarCache, enable_oscar_attention

    prompts = load_prompts(args.prompts)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: to try the reference side without a GPU
    config = AutoConfig.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(dev).eval()
    art = read_artifact(args.artifact)
    fmt = art.kv_format.with_(page_size=BLOCK)  # vLLM's blocks are the pages
    out = {}
    for name in ("hf-oscar", "hf-bf16"):
        m = enable_oscar_attention(model) if name == "hf-oscar" else model
        tokens, tops = [], []
        for p in prompts:
            ids = torch.tensor([p], device=dev)
            kw = {}
            if name == "hf-oscar":
                kw["past_key_values"] = OscarCache(art, config, fmt=fmt, device=dev, dtype=torch.bfloat16,
                                                   model_id=art.metadata.get("model_id"))
            else:
                m.set_attn_implementation("sdpa")
            with torch.no_grad():
                g = m.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0, **kw)
            tokens.append(g.sequences[0, len(p):].tolist())
            tops.append([torch.topk(s[0].float(), 2).values.tolist() for s in g.logits])
        out[name] = {"tokens": tokens, "top2_logits": tops}
    return out


def run_vllm(args, mode: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = load_prompts(args.prompts)
    kw = dict(model=str(args.model), skip_tokenizer_init=True, dtype="bfloat16", block_size=BLOCK,
              max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=8192 * len(prompts),
              kv_cache_memory_bytes=int(args.kv_gib * 2**30), seed=0)
    if mode != "vllm-bf16":
        from runtime_kernels.artifact import read_artifact

        art = read_artifact(args.artifact)
        # The artifact names the model it was calibrated for; the folder served here is a copy of it.
        oscar = {"path": str(args.artifact), "model_id": art.metadata.get("model_id")}
        if mode == "vllm-oscar-partial":
            oscar["layers"] = [i for i in art.layer_ids.tolist() if i >= 2]
        kw["additional_config"] = {"oscar": oscar}
    if mode == "vllm-oscar-eager":
        kw["enforce_eager"] = True
    t0 = time.time()
    llm = LLM(**kw)
    startup = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, logprobs=2, detokenize=False, ignore_eos=True)
    t0 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    gen_s = time.time() - t0
    tokens, top2 = [], []
    for o in outs:
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        top2.append([sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in (c.logprobs or [])])
    res = {"tokens": tokens, "top2_logprobs": top2, "startup_s": round(startup, 1), "generate_s": round(gen_s, 2)}
    if mode != "vllm-bf16":
        from runtime_kernels.vllm.state import STATE

        if STATE.engine is None:
            raise RuntimeError("OSCAR was asked for, but no OSCAR engine was built (the backend was not selected)")
        res["engine_stats"] = vars(STATE.engine.stats)
        res["window_fallback_rows"] = STATE.engine.windows.fallback_rows
    return {mode: res}


# ------------------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------------------
def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(results: dict, ref: str, other: str) -> list[dict]:
    rows = []
    if ref not in results or other not in results:
        return rows
    for i, (a, b) in enumerate(zip(results[ref]["tokens"], results[other]["tokens"])):
        d = first_divergence(a, b)
        row = {"prompt": i, "equal_tokens": len(a) if d is None else d, "of": len(a)}
        if d is not None:
            top = results[ref].get("top2_logits")
            if top and d < len(top[i]):
                row["ref_top1_minus_top2_logit"] = round(top[i][d][0] - top[i][d][1], 4)
            lp = results[other].get("top2_logprobs")
            if lp and d < len(lp[i]) and len(lp[i][d]) == 2:
                row["other_top1_minus_top2_logprob"] = round(lp[i][d][0] - lp[i][d][1], 4)
        rows.append(row)
    return rows


def drive(args) -> int:
    import common

    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_FLASHINFER_SAMPLER="0",
               VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    results, logs, failed = {}, {}, {}
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    for mode in MODES:  # sides measured by an earlier invocation into the same folder (same machine, same card)
        part = args.out / f"_{mode}.json"
        if mode not in args.modes and part.is_file():
            results.update(json.loads(part.read_text()))
            log = args.out / f"vllm_gpu_check_{mode}.log"
            logs[mode] = sorted(set(CAPACITY_LINES.findall(log.read_text(errors="replace")))) if log.is_file() else []
    for mode in args.modes:
        left = args.budget_s - (time.time() - start)
        if left < 90:
            failed[mode] = f"skipped: {left:.0f} s of the time budget left"
            continue
        part = args.out / f"_{mode}.json"
        log = args.out / f"vllm_gpu_check_{mode}.log"
        cmd = [sys.executable, __file__, "--one", mode, "--model", str(args.model), "--artifact", str(args.artifact),
               "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens),
               "--kv-gib", str(args.kv_gib), "--part", str(part)]
        print(f"== {mode}", flush=True)
        with open(log, "w") as fh:
            try:
                rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=max(60, left - 30)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = log.read_text(errors="replace")
        logs[mode] = sorted(set(CAPACITY_LINES.findall(text)))
        if rc == 0 and part.is_file():
            results.update(json.loads(part.read_text()))
        else:
            failed[mode] = f"exit {rc}: " + " | ".join(text.strip().splitlines()[-6:])
        print("\n".join(logs[mode]) or "(no capacity/backend lines)", flush=True)
        if mode in failed:
            print(f"FAILED {mode}: {failed[mode]}", flush=True)
    checks = {f"{o} vs {r}": compare(results, r, o) for r, o in (
        ("hf-oscar", "vllm-oscar"), ("hf-bf16", "vllm-bf16"), ("hf-oscar", "hf-bf16"), ("vllm-oscar", "vllm-oscar-eager"),
        ("hf-oscar", "vllm-oscar-partial"))}
    summary = {"meta": {**common.meta(), "vllm": _vllm_version(), "block_size": BLOCK, "new_tokens": args.new_tokens,
                        "prompt_tokens": [len(p) for p in load_prompts(args.prompts)], "model": str(args.model),
                        "artifact": str(args.artifact)},
               "checks": checks, "logs": logs, "failed": failed,
               "results": {k: {kk: vv for kk, vv in v.items() if kk not in ("top2_logits", "top2_logprobs")}
                           for k, v in results.items()}}
    path = args.out / f"vllm_gpu_check_{common.gpu_tag()}.json"
    path.write_text(json.dumps(summary, indent=1))
    for name, rows in checks.items():
        print(name, [(r["equal_tokens"], r["of"], r.get("ref_top1_minus_top2_logit")) for r in rows], flush=True)
    for k, v in summary["results"].items():
        print(k, {kk: vv for kk, vv in v.items() if kk != "tokens"}, flush=True)
    print(f"wrote {path}", flush=True)
    return 0 if not failed else 1


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:  # noqa: BLE001 - vLLM absent: the hf side alone ran
        return "absent"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the converted model folder (config.json + weights)")
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True, help='JSON {"prompts": [[token ids], ...]}')
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--kv-gib", type=float, default=2.0, help="vLLM's KV cache memory for each side (GiB)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--budget-s", type=float, default=480, help="skip the modes that no longer fit")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        res = run_hf(args) if args.one == "hf" else run_vllm(args, args.one)
        args.part.write_text(json.dumps(res))
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
