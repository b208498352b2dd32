"""Calibration benchmark: a randomly initialised Qwen3-8B-shaped model on 128 x 2048 tokens (GPU).

Reports wall time split into load / forward+capture / solve / write, the plain forward time of the same
batches without capture (capture overhead), and peak GPU memory. Writes `calibrate_<gpu>.json` and a
Markdown table to --out.

    python bench/bench_calibrate.py --out bench/results                # full size (needs ~20 GB GPU memory)
    python bench/bench_calibrate.py --layers 2 --samples 4 --seq-len 256 --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oscar_calib.calibration.calibrate import calibrate_model_with_report  # noqa: E402
from oscar_calib.calibration.capture import decoder_of  # noqa: E402
from oscar_calib.config import SolverSettings  # noqa: E402
from runtime_kernels.artifact import write_artifact  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_model(layers: int, device: str, dtype: torch.dtype):
    """Qwen3-8B geometry: hidden 4096, 32 query / 8 KV heads, head_dim 128, MLP 12288, vocab 151936."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                               num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000,
                               tie_word_embeddings=False)
    cfg._name_or_path = "random-init/Qwen3-8B-shape"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


@torch.no_grad()
def plain_forward_time(model, ids: torch.Tensor, batch_size: int, device: str) -> float:
    decoder = decoder_of(model)
    sync(device)
    t0 = time.perf_counter()
    for start in range(0, ids.shape[0], batch_size):
        decoder(input_ids=ids[start:start + batch_size].to(device), use_cache=False)
    sync(device)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compare", action="store_true", help="skip the held-out comparison of alternatives")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32

    t_total = time.perf_counter()
    t0 = time.perf_counter()
    model = build_model(args.layers, args.device, dtype)
    sync(args.device)
    load_s = time.perf_counter() - t0

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151936, (args.samples + 1, args.seq_len), generator=gen)
    stats_ids, holdout = ids[:-1], ids[-1:]

    # Warm-up (kernel selection, allocator) on one batch, excluded from both timings.
    plain_forward_time(model, stats_ids[: args.batch_size], args.batch_size, args.device)
    plain_s = plain_forward_time(model, stats_ids, args.batch_size, args.device)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()

    art, report = calibrate_model_with_report(
        model, stats_ids, SolverSettings(), holdout_ids=holdout, batch_size=args.batch_size,
        compare_alternatives=not args.no_compare)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        write_artifact(art, tmp)
    write_s = time.perf_counter() - t0
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None
    total_s = time.perf_counter() - t_total

    # forward+capture also includes the held-out pass (1 extra sequence); scale plain time to match.
    plain_matched = plain_s * (args.samples + 1) / args.samples
    import transformers

    result = {
        "benchmark": "calibration",
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "shape": {"layers": args.layers, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
                  "samples": args.samples, "seq_len": args.seq_len, "batch_size": args.batch_size,
                  "tokens": args.samples * args.seq_len, "dtype": str(dtype)},
        "compare_alternatives": not args.no_compare,
        "seconds": {"load": load_s, "forward_capture": report.timings["forward_capture_s"],
                    "solve_and_clip_fit": report.timings["solve_s"], "write": write_s,
                    "end_to_end_excluding_plain_forward_reference": load_s + report.timings["forward_capture_s"]
                    + report.timings["solve_s"] + write_s,
                    "plain_forward_same_tokens": plain_matched, "script_total": total_s},
        "capture_overhead_vs_plain_forward": report.timings["forward_capture_s"] / plain_matched - 1.0,
        "tokens_per_second_capture": (args.samples + 1) * args.seq_len / report.timings["forward_capture_s"],
        "peak_gpu_memory_gib": peak_gib,
        "summary": report.summary(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if not args.device.startswith("cuda") else "h200" if "H200" in result["gpu"] else "gpu"
    path = args.out / f"calibrate_{tag}{'_nocompare' if args.no_compare else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    s = result["seconds"]
    print("| load | forward+capture | solve+clip fit | write | end to end | plain forward | capture overhead | peak GiB |")
    print(f"| {s['load']:.1f} s | {s['forward_capture']:.1f} s | {s['solve_and_clip_fit']:.1f} s | {s['write']:.2f} s | "
          f"{s['end_to_end_excluding_plain_forward_reference']:.1f} s | {s['plain_forward_same_tokens']:.1f} s | "
          f"{100 * result['capture_overhead_vs_plain_forward']:+.0f} % | "
          f"{peak_gib if peak_gib is None else round(peak_gib, 1)} |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
