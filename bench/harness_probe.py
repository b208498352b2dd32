"""Why bench_decode_graph.py and decode_plain_graph.py disagree at 128K x 8 (issue 30): the same OSCAR graphs timed
(a) by the bench's `triton.testing.do_bench` and (b) by a plain CUDA-event loop, before and after the BF16 graphs,
with 2 distinct layers repeated to 16 calls (the bench at this size) and with 16 distinct layers (the plain harness);
the SM clock and power drawn are read after every measurement.

    python3 bench/harness_probe.py [CONTEXT BATCH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode_graph as B  # noqa: E402
import common  # noqa: E402

from runtime_kernels import attention as A  # noqa: E402


def oscar_graph(context: int, batch: int, fmt: str, distinct: int | None):
    scale_format, centered, sink, recent = B.FORMATS[fmt]
    window = sink + recent
    n = distinct or 2
    layers = [common.decode_inputs(batch, context, seed=context + batch + i, scale_format=scale_format,
                                   window=window) for i in range(n)]
    means = common.decode_means(context + batch) if centered else None
    recs = [common.decode_records(a, means, scale_format=scale_format) for a in layers]
    calls = [lambda r=r: A.decode_attention(*r, validate=False, fused=False) for r in recs]
    return B.capture(calls), layers


def report(tag: str, graph, n: int) -> None:
    dob = common.time_ms(graph.replay, rep=300)[0] / n
    ev = common.events_ms(graph, n)
    print(f"{tag:42s} do_bench {dob:.4f} ms  events {ev:.4f} ms  sm_clock {torch.cuda.clock_rate()} MHz  "
          f"power {torch.cuda.power_draw() / 1000:.0f} W", flush=True)


def oscar_rows(context: int, batch: int, tag: str) -> None:
    """Both formats, with 2 distinct layers repeated to 16 calls (the bench) and with 16 distinct layers."""
    for fmt in ("recipe", "fp16_64_256"):
        for distinct in (None, 16):
            (g, n), layers = oscar_graph(context, batch, fmt, distinct)
            report(f"{tag} {fmt} distinct={distinct or 2}", g, n)
            del g, layers
            torch.cuda.empty_cache()


def main() -> None:
    context, batch = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (131072, 8)
    print(torch.cuda.get_device_name(), common.commit(), f"{context}x{batch}", flush=True)
    oscar_rows(context, batch, "cold")
    from torch.nn.attention import SDPBackend

    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        g, n = B.capture(B.bf16_calls(context, batch, backend))
        report(f"bf16 {name}", g, n)
        del g
        torch.cuda.empty_cache()
    oscar_rows(context, batch, "after bf16")


if __name__ == "__main__":
    main()
