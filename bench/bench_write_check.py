"""Cost of the non-finite check of `PagedKVCache.write_layer` on the decode path (docs/errors.md).

One decode step = `plan_append` once, then per layer `write_layer` (rotate, check, window write or page demotion)
and `decode_attention`. Times eager steps with `check_finite` on and off, same cache geometry and data.

    python bench/bench_write_check.py --out OUT                # GPU if visible; Qwen3-8B geometry (8 KV / 32 q, d 128)
    python bench/bench_write_check.py --out OUT --device cpu --layers 2 --steps 20 --context 1024
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from runtime_kernels.artifact import identity_artifact
from runtime_kernels.cache import PagedKVCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_FORMAT  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_times(check: bool, batch: int, context: int, layers: int, steps: int, device: str) -> dict[str, float]:
    art = identity_artifact(layers, 8, 32, 128, fmt=BENCH_FORMAT)
    gen = torch.Generator().manual_seed(0)
    for name in ("k_rotation", "v_rotation"):
        q, _ = torch.linalg.qr(torch.randn(layers, 8, 128, 128, generator=gen, dtype=torch.float64))
        setattr(art, name, q.float().contiguous())
    probe = PagedKVCache.from_artifact(art, max_pages=1, max_seqs=1, device="cpu")
    pages = batch * ((context + steps) // probe.page_size + 2)
    cache = PagedKVCache.from_artifact(art, max_pages=pages, max_seqs=batch, device=device, dtype=torch.bfloat16,
                                       check_finite=check)
    ids = [cache.add_sequence() for _ in range(batch)]
    prompt = torch.randn(context, 8, 128, device=device, dtype=torch.bfloat16)
    cache.append(ids, [[prompt] * batch] * layers, [[prompt] * batch] * layers)
    k = torch.randn(batch, 8, 128, device=device, dtype=torch.bfloat16)
    q = torch.randn(batch, 32, 128, device=device, dtype=torch.bfloat16)

    def one_step(attend: bool) -> None:
        plan = cache.plan_append(ids, [1] * batch)
        for layer in range(layers):
            cache.write_layer(layer, plan, k, k)
            if attend:
                cache.decode_attention(layer, q, ids)

    out = {}
    for attend in (False, True):
        for _ in range(5):
            one_step(attend)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            one_step(attend)
        _sync(device)
        per_layer_us = (time.perf_counter() - t0) / (steps * layers) * 1e6
        out["write_plus_attention_us" if attend else "write_us"] = per_layer_us
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    rows = []
    for batch in (1, 8, 32):
        on = step_times(True, batch, args.context, args.layers, args.steps, args.device)
        off = step_times(False, batch, args.context, args.layers, args.steps, args.device)
        rows.append({"batch": batch, "context": args.context, "device": args.device, "check_on": on, "check_off": off,
                     "write_overhead_us": on["write_us"] - off["write_us"],
                     "step_overhead_pct": 100 * (on["write_plus_attention_us"] / off["write_plus_attention_us"] - 1)})
        print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    (args.out / "write_check.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
