#!/usr/bin/env python3
"""Check a converted real model's BF16 perplexity before any study: the studies' evaluator on the bf16 directory
against an independent path, the GGUF it was converted from, dequantized and run through transformers' own SDPA.

Issue 51: on a machine whose transformers reads a GGUF's tokenizer wrongly (5.17 with Gemma3: no BOS, other merges)
every number of a study is off while the weights are right. Exit 4 when the two NLLs differ by more than
`--tolerance` or the tokenizers disagree. This tokenizes the first window of each text with the
converted tokenizer, BOS first, and reports both NLLs, the token count of the text's first 2,000 characters under both
tokenizers, and whether the BOS leads.

    python3 tools/bf16_reference.py --model ~/.cache/oscar-calib/gemma3-270m --text T/heldout.txt \\
        --text T/code_heldout.txt --context 2048 --out bench/results/quality/bf16_reference_gemma3-270m_cpu_2048.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_study import chunks, token_stream  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a directory written by tools/real_model.py")
    p.add_argument("--text", type=Path, action="append", required=True)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tolerance", type=float, default=0.01,
                   help="largest |NLL difference| accepted (nats; bf16 rounding of the weights moves it ~1e-3)")
    args = p.parse_args(argv)
    marker = args.model / "oscar_real_model.json"
    if not marker.is_file():
        p.error(f"--model {args.model}: no oscar_real_model.json (convert it with tools/real_model.py)")
    gguf_name = json.loads(marker.read_text())["gguf"]
    gguf_dir = args.model / "gguf"
    if not (gguf_dir / gguf_name).is_file():
        p.error(f"--model {args.model}: no gguf/{gguf_name} (the conversion keeps it there)")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oscar_calib.analysis.evaluate import method_nll, token_nll
    from oscar_calib.analysis.methods import KVMethod
    from runtime_kernels.format import DEFAULT_FORMAT

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    gguf_tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    converted = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
    out = {"model": str(args.model), "gguf": gguf_name, "context": args.context, "texts": {}}
    for path in args.text:
        sample = path.read_text(encoding="utf-8")[:2000]
        ids = chunks(token_stream(tok, path), args.context, 1)
        if tok.bos_token_id is not None:  # BOS first, as the model was trained (the window keeps its length)
            ids = torch.cat([torch.tensor([[tok.bos_token_id]]), ids[:, :-1]], dim=1)
        ours, _ = method_nll(converted, KVMethod(), ids, DEFAULT_FORMAT, collect_stats=False)
        theirs = token_nll(reference, ids)
        out["texts"][path.name] = {
            "tokens_first_2000_chars": {"converted": len(tok(sample).input_ids), "gguf": len(gguf_tok(sample).input_ids)},
            "bos_first": tok(sample).input_ids[:1] == [tok.bos_token_id],
            "nll_evaluator_bf16_directory": float(ours.mean()), "nll_gguf_sdpa": float(theirs.mean())}
        print(path.name, json.dumps(out["texts"][path.name]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out.update({"device": "cpu", "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                "commit": commit, "command": " ".join(sys.argv), "seconds": round(time.perf_counter() - t0, 1)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    bad = {n: t for n, t in out["texts"].items()
           if abs(t["nll_evaluator_bf16_directory"] - t["nll_gguf_sdpa"]) > args.tolerance
           or t["tokens_first_2000_chars"]["converted"] != t["tokens_first_2000_chars"]["gguf"]}
    if bad:
        print(f"error: --model {args.model}: BF16 differs from the GGUF reference on {', '.join(bad)} "
              f"(tolerance {args.tolerance} nats, or the token counts differ): do not run a study", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
