"""Calibration at scale on one GPU: a randomly initialised Llama-3-70B-shaped model, part of it offloaded (issue 30).

The model is built on the meta device, placed by accelerate's `infer_auto_device_map` within `--max-memory` (parsed
by the product's own `oscar_calib.placement`, as `oscar-calib run --device-map auto --max-memory ...` takes it),
materialised parameter by parameter straight on its mapped device with random values (never the whole model on the
host first), and dispatched with accelerate's hooks, so offloaded layers stream to the GPU for every forward. Then
the product's `calibrate_model_with_report` on random tokens (128 x 2048 for the statistics plus one held-out
sequence at the model's context, the product's rule) and the artifact is written. Reports seconds, GPU memory and
host memory per stage against the 15-minute target; writes `calibrate_70b_<tag>.json` and `.md` to --out and prints
one timestamped line per stage (flushed: a run cut short still shows how far it got).

A separate script from bench_calibrate.py (which it reuses): the in-memory 8B bench has one load step and a plain
forward reference, this one five stages with placement and host memory; keeping them apart leaves the 8B bench's
outputs and committed results as they were.

    python bench/bench_calibrate_offload.py --max-memory 0=118GiB cpu=100GiB --out bench/results     # one H200
    python bench/bench_calibrate_offload.py --device cpu --layers 2 --hidden 256 --heads 4 --kv-heads 2 \\
        --head-dim 64 --intermediate 512 --vocab 1000 --samples 4 --seq-len 256 --holdout-len 1300   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_calibrate import sync  # noqa: E402
from common import commit  # noqa: E402

from oscar_calib.calibration.calibrate import calibrate_model_with_report  # noqa: E402
from oscar_calib.calibration.capture import decoder_of  # noqa: E402
from oscar_calib.calibration.job import (  # noqa: E402
    Choices,
    max_positions,
    resolve_batch_size,
    resolve_holdout_len,
)
from oscar_calib.config import AUTO_HOLDOUT_CAP, DataConfig, SolverSettings  # noqa: E402
from oscar_calib.errors import InputError  # noqa: E402
from oscar_calib.placement import (  # noqa: E402
    accelerate_max_memory,
    describe_placement,
    parse_max_memory,
    placement_summary,
)
from runtime_kernels.artifact import write_artifact  # noqa: E402

MODEL_ID = "random-init/Llama-70B-shape"
TARGET_S = 15 * 60  # issue 30: calibration of a 70B model on one GPU within 15 minutes, end to end
INIT_STD = 0.02  # transformers' initializer_range for Llama
# GPU memory left outside the weights when --max-memory is not given: activations of a batch of 8 x 2048 at 70B
# shape (~6 GiB: MLP 3 x B T I bf16, the capture's fp32 copies of q and the per-head output, the residual stream),
# the held-out capture of every layer (~2.8 GiB at 8192 tokens, see `memory_estimate`), the clip fit's scores
# (~3 GiB at 8192 keys), the CUDA context and the allocator's slack. accelerate also keeps room for the largest
# streamed layer inside the GPU's budget.
DEFAULT_GPU_HEADROOM = 20 << 30
HOST_RESERVE = 8 << 30  # host memory left to the process itself (torch, CUDA libraries, the token ids)
FILL_CHUNK = 1 << 27  # elements per GPU-generated chunk of an offloaded tensor (256 MiB of bf16)


@dataclass(frozen=True)
class Geometry:
    """A Llama decoder's shape (the config fields it becomes)."""

    layers: int = 80
    hidden: int = 8192
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 28672
    vocab: int = 128256
    max_positions: int = 8192
    rope_theta: float = 500000.0

    def parameters(self) -> int:
        """Parameter count: embedding, per layer q/k/v/o, gate/up/down and two norms, final norm, untied head."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return 2 * self.vocab * self.hidden + self.layers * layer + self.hidden


LLAMA_70B = Geometry()  # Llama-3-70B


def llama_config(geom: Geometry):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("llama", vocab_size=geom.vocab, hidden_size=geom.hidden,
                               intermediate_size=geom.intermediate, num_hidden_layers=geom.layers,
                               num_attention_heads=geom.heads, num_key_value_heads=geom.kv_heads,
                               head_dim=geom.head_dim, max_position_embeddings=geom.max_positions,
                               rope_theta=geom.rope_theta, tie_word_embeddings=False)
    cfg._name_or_path = MODEL_ID
    return cfg


def build_meta_model(geom: Geometry, dtype: torch.dtype):
    """The causal LM with every parameter on the meta device (no memory); buffers (RoPE frequencies) are real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(llama_config(geom), dtype=dtype)
    meta_buffers = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if meta_buffers:
        raise RuntimeError(f"buffers left on the meta device by the empty build: {meta_buffers[:3]}")
    return model.eval()


def layer_class(model) -> str:
    """The decoder layer's class name (accelerate never splits one over two devices)."""
    return type(decoder_of(model).layers[0]).__name__


def plan_device_map(model, device: str, max_memory: dict[str, int] | None) -> dict[str, int | str]:
    """Module name -> device (GPU index, "cpu" or "disk"), as accelerate places a model within `max_memory`
    (`{"0": bytes, "cpu": bytes, "disk": bytes}`, `parse_max_memory`'s form). None: the whole model on `device`."""
    from accelerate import infer_auto_device_map

    if max_memory is None:
        return {"": (torch.device(device).index or 0) if device.startswith("cuda") else "cpu"}
    gpus = [k for k in max_memory if k.isdigit()]
    if gpus and not device.startswith("cuda"):
        raise InputError(f"--max-memory {gpus[0]}=...: a GPU budget with --device {device} (expected cpu and disk "
                         "budgets only, or --device cuda)")
    if gpus and int(max(gpus, key=int)) >= torch.cuda.device_count():
        raise InputError(f"--max-memory {max(gpus, key=int)}=...: only {torch.cuda.device_count()} GPU(s) visible")
    return dict(infer_auto_device_map(model, max_memory=accelerate_max_memory(max_memory),
                                      no_split_module_classes=[layer_class(model)]))


def mapped_device(name: str, device_map: dict) -> int | str:
    """The device of parameter `name`: the entry of its longest prefix in `device_map`."""
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        key = ".".join(parts[:i])
        if key in device_map:
            return device_map[key]
    raise KeyError(f"parameter {name}: no entry of the device map covers it")


def fill_normal_(t: torch.Tensor, std: float, gen: torch.Generator, buffer: torch.Tensor | None = None) -> None:
    """Fill `t` with N(0, std) drawn by `gen`, in place. When `gen` lives on another device than `t` (a GPU
    generator for an offloaded tensor), draw there chunk by chunk into `buffer` (1-D, `t`'s dtype) and copy down.

    Why the GPU draws for the host: measured on this project's CPU machine (2 cores), `normal_` fills 0.25 GiB/s of
    bf16 (so about 2 GiB/s on 16 cores: ~8 s for the ~16 GiB a 70B offloads); a GPU draws hundreds of GiB/s and the
    copy down is bounded by PCIe (a few seconds, estimated; build_materialise reports it). Tiling one random block
    was as fast on the CPU (3 GiB/s on 2 cores) but repeats weights; the GPU draw keeps every value independent."""
    if _same_device(gen.device, t.device):
        t.normal_(0.0, std, generator=gen)
        return
    flat = t.view(-1)
    for start in range(0, flat.numel(), buffer.numel()):
        n = min(buffer.numel(), flat.numel() - start)
        flat[start:start + n].copy_(buffer[:n].normal_(0.0, std, generator=gen))


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one ("cuda" and "cuda:0" are, with one current device)."""
    return a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))


def materialise_(model, device_map: dict, seed: int, std: float = INIT_STD, fill_device: str = "cpu") -> dict:
    """Give every meta parameter real storage on its mapped device: N(0, std) weights, norm weights 1.

    Parameters mapped to "disk" are made on the host (accelerate's `dispatch_model` writes them to the offload
    folder and drops them). Draws come from one generator on `fill_device` (the GPU when one is used), so the host
    never holds more than its own share of the weights. Returns bytes per device (`"cuda:0"`, `"cpu"`, `"disk"`).
    """
    gen = torch.Generator(device=fill_device).manual_seed(seed)
    buffer = None
    placed: dict[str, int] = {}
    for name, param in list(model.named_parameters()):
        where = mapped_device(name, device_map)
        device = torch.device("cuda", where) if isinstance(where, int) else torch.device("cpu")
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        t = torch.empty(param.shape, dtype=param.dtype, device=device)
        if "norm" in type(module).__name__.lower():
            t.fill_(1.0)
        else:
            if buffer is None and not _same_device(device, gen.device):
                buffer = torch.empty(FILL_CHUNK, dtype=param.dtype, device=gen.device)
            fill_normal_(t, std, gen, buffer)
        module._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
        key = f"cuda:{where}" if isinstance(where, int) else where
        placed[key] = placed.get(key, 0) + t.numel() * t.element_size()
    del buffer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return placed


def dispatch(model, device_map: dict, offload_dir: str | None):
    """accelerate's `dispatch_model`: hooks that run offloaded layers on the GPU, streaming their weights in."""
    from accelerate import dispatch_model

    return dispatch_model(model, device_map=device_map, offload_dir=offload_dir)


def layers_by_device(device_map: dict, layers: int) -> dict[str, int]:
    """How many decoder layers each device holds (`{"cuda:0": 71, "cpu": 9}`)."""
    counts: dict[str, int] = {}
    for i in range(layers):
        where = mapped_device(f"model.layers.{i}.self_attn.q_proj.weight", device_map)
        key = f"cuda:{where}" if isinstance(where, int) else where
        counts[key] = counts.get(key, 0) + 1
    return counts


def memory_estimate(geom: Geometry, batch: int, seq_len: int, holdout_len: int, holdout_queries: int,
                    dtype: torch.dtype) -> dict[str, int]:
    """Bytes of what the GPU holds besides the weights (upper-ish estimates, for choosing --max-memory).

    The held-out capture keeps, per layer, keys and values `[S, H_kv, T, d]` and the sampled queries
    `[S, H_q, n_q, d]` in the model dtype on the device the layer's activations are on: the GPU for every layer,
    offloaded ones included (accelerate runs them there). It lives until the clip fit ends.
    """
    e = torch.empty((), dtype=dtype).element_size()
    tokens = batch * seq_len
    return {
        "mlp_intermediates": 3 * tokens * geom.intermediate * e,  # gate, up, act(gate) * up alive together
        "capture_fp32_copies": 4 * tokens * geom.heads * geom.head_dim * 4,  # q and out as fp32, einsum operands
        "residual_and_attention": 6 * tokens * geom.hidden * e,
        "holdout_capture": geom.layers * (2 * geom.kv_heads * holdout_len * geom.head_dim
                                          + geom.heads * min(holdout_queries, holdout_len) * geom.head_dim) * e,
        "clip_fit_scores": 6 * geom.heads * min(holdout_queries, holdout_len) * holdout_len * 4,  # scores, probs...
        "statistics": geom.layers * geom.kv_heads * (3 * geom.head_dim ** 2 + 2 * geom.head_dim + 1) * 8,
    }


def default_max_memory(device: str) -> tuple[dict[str, int], str]:
    """`--max-memory` when none is given on a GPU: the GPU less DEFAULT_GPU_HEADROOM, the host's available memory
    less HOST_RESERVE. Returns (budget, reason)."""
    index = torch.device(device).index or 0
    total = torch.cuda.get_device_properties(index).total_memory
    available = host_available_bytes()
    budget = {str(index): total - DEFAULT_GPU_HEADROOM, "cpu": max(available - HOST_RESERVE, 1 << 30)}
    reason = (f"no --max-memory: GPU {index} total {total / 2**30:.1f} GiB less {DEFAULT_GPU_HEADROOM >> 30} GiB "
              f"headroom, host available {available / 2**30:.1f} GiB less {HOST_RESERVE >> 30} GiB")
    return budget, reason


def host_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def _status_bytes(field: str) -> int | None:
    """A `/proc/self/status` field in bytes (VmRSS: resident now, VmHWM: its peak)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


GIB = 2**30


class StageLog:
    """Seconds and memory of each stage; prints one flushed, timestamped line as each ends."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.start_time = time.perf_counter()
        self.stages: dict[str, dict] = {}
        self._t = self.start_time

    def say(self, text: str) -> None:
        now = datetime.datetime.now().strftime("%H:%M:%S")
        print(f"[{now} +{time.perf_counter() - self.start_time:7.1f}s] {text}", flush=True)

    def begin(self) -> None:
        if self.cuda:
            sync("cuda")
            torch.cuda.reset_peak_memory_stats()
        self._t = time.perf_counter()

    def end(self, name: str, note: str = "") -> dict:
        if self.cuda:
            sync("cuda")
        wall = time.perf_counter() - self._t
        row = {"seconds": wall, "host_rss_gib": _gib(_status_bytes("VmRSS")),
               "host_rss_peak_gib": _gib(_status_bytes("VmHWM"))}
        if self.cuda:
            row.update(gpu_allocated_gib=torch.cuda.memory_allocated() / GIB,
                       gpu_peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                       gpu_peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
        self.stages[name] = row
        gpu = (f" | GPU {row['gpu_allocated_gib']:.1f} GiB (stage peak {row['gpu_peak_allocated_gib']:.1f}, "
               f"reserved {row['gpu_peak_reserved_gib']:.1f})" if self.cuda else "")
        self.say(f"{name}: {row['seconds']:.1f} s | host RSS {row['host_rss_gib']:.1f} GiB "
                 f"(peak {row['host_rss_peak_gib']:.1f}){gpu}{' | ' + note if note else ''}")
        self._t = time.perf_counter()
        return row


def _size(n: int) -> str:
    return f"{n / GIB:.1f}GiB" if n >= GIB else f"{n / 2**20:.1f}MiB"


def _gib(n: int | None) -> float | None:
    return None if n is None else n / GIB


def parse_args(argv: list[str] | None):
    g = LLAMA_70B
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=g.layers)
    p.add_argument("--hidden", type=int, default=g.hidden)
    p.add_argument("--heads", type=int, default=g.heads)
    p.add_argument("--kv-heads", type=int, default=g.kv_heads)
    p.add_argument("--head-dim", type=int, default=g.head_dim)
    p.add_argument("--intermediate", type=int, default=g.intermediate)
    p.add_argument("--vocab", type=int, default=g.vocab)
    p.add_argument("--max-positions", type=int, default=g.max_positions, help="max_position_embeddings")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--holdout-len", type=int, default=None,
                   help=f"held-out tokens (default: the product's rule, min(max_positions, {AUTO_HOLDOUT_CAP}), "
                        "at least --seq-len)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per forward (default: oscar-calib run's rule, ~16K tokens on a GPU: 8 at 2048)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="default bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--max-memory", nargs="+", default=None, metavar="DEVICE=SIZE",
                   help="as `oscar-calib run --max-memory`: 0=118GiB cpu=100GiB (disk=... needs no flag: a temporary "
                        "offload folder). Default on a GPU: its memory less 20 GiB; on the CPU: the whole model there")
    p.add_argument("--compare", action="store_true", help="also the held-out comparison of alternatives (5x the fit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--artifact-dir", type=Path, default=None, help="keep the artifact here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    geom = Geometry(args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate,
                    args.vocab, args.max_positions, LLAMA_70B.rope_theta)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise InputError(f"--device {args.device}: no CUDA device is visible (expected --device cpu)")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if cuda else torch.float32
    log = StageLog(args.device)
    gpu_name = torch.cuda.get_device_name(torch.device(args.device).index or 0) if cuda else "cpu"
    log.say(f"{MODEL_ID}: {geom.layers} layers, {geom.heads}q/{geom.kv_heads}kv x {geom.head_dim}, hidden "
            f"{geom.hidden}, MLP {geom.intermediate}, {geom.parameters() / 1e9:.2f} B parameters "
            f"({geom.parameters() * torch.empty((), dtype=dtype).element_size() / GIB:.1f} GiB {dtype}) on {gpu_name}")

    max_memory = parse_max_memory(args.max_memory)
    if max_memory is not None:
        mm_reason = "given on the command line"
    elif cuda:
        max_memory, mm_reason = default_max_memory(args.device)
    else:
        mm_reason = "no --max-memory on the CPU: the whole model in host memory"
    shown = ", ".join(f"{k}={_size(v)}" for k, v in (max_memory or {}).items()) or "none"
    log.say(f"max_memory: {shown} ({mm_reason})")

    choices = Choices()  # the product's rule for the held-out length (oscar-calib run's `resolve_holdout_len`)
    data_cfg = resolve_holdout_len(DataConfig(samples=args.samples, seq_len=args.seq_len,
                                              holdout_len=args.holdout_len), geom.max_positions, choices)
    holdout_len = data_cfg.holdout_len
    args.batch_size = resolve_batch_size(args.batch_size, args.device, args.seq_len, choices)
    for key in ("holdout_len", "batch_size"):
        log.say(f"{key}={choices.values[key]}: {choices.reasons[key]}")
    estimate = memory_estimate(geom, args.batch_size, args.seq_len, holdout_len, data_cfg.holdout_queries, dtype)
    log.say(f"beyond the weights the GPU holds at most about {_size(sum(estimate.values()))} (estimate; the terms do "
            f"not all coexist), of which the "
            f"held-out capture {_size(estimate['holdout_capture'])} until the clip fit ends")
    importlib.import_module("transformers.models.llama.modeling_llama")  # imported before the build is timed

    # Stage 1: build on meta, place, materialise on the mapped devices.
    log.begin()
    model = build_meta_model(geom, dtype)
    if max_positions(model.config) != geom.max_positions:
        raise RuntimeError(f"config max_position_embeddings {max_positions(model.config)} != {geom.max_positions}")
    device_map = plan_device_map(model, args.device, max_memory)
    placed = materialise_(model, device_map, args.seed, fill_device=args.device if cuda else "cpu")
    per_layer = layers_by_device(device_map, geom.layers)
    log.end("build_materialise", note=f"layers {per_layer}, weights " +
            ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in placed.items()))

    # Stage 2: dispatch (hooks; disk-mapped weights written to a temporary offload folder).
    with tempfile.TemporaryDirectory(prefix="oscar-bench-offload-") as scratch:
        log.begin()
        model = dispatch(model, device_map, scratch if "disk" in device_map.values() else None)
        placement = placement_summary(model)
        free_gib = torch.cuda.mem_get_info()[0] / GIB if cuda else None  # what the activations have (CUDA view)
        row = log.end("dispatch", note=f"GPU free {free_gib:.1f} GiB" if cuda else "")
        row["gpu_free_gib"] = free_gib
        log.say("placement (accelerate):\n" + describe_placement(placement))

        # Stage 3 + 4: the product's calibration call; the first clip-fit step marks the end of the capture.
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, geom.vocab, (args.samples, args.seq_len), generator=gen)
        holdout = torch.randint(0, geom.vocab, (1, holdout_len), generator=gen)
        # One call per forward batch: the statistics batches, then the held-out sequence.
        seen = {"batches": 0, "tokens": 0}
        n_batches = -(-args.samples // args.batch_size) + 1
        capture_start = time.perf_counter()

        def progress(tokens: int, _total: int) -> None:
            seen["batches"] += 1
            seen["tokens"] += tokens
            rate = seen["tokens"] / max(time.perf_counter() - capture_start, 1e-9)
            log.say(f"capture batch {seen['batches']}/{n_batches}: {seen['tokens']:,} tokens, {rate:,.0f} tok/s")

        fit_marks = {"started": False}

        def fit_progress(what: str, done: int, total: int) -> None:
            if not fit_marks["started"]:
                fit_marks["started"] = True
                log.end("forward_capture_and_solve", note="capture of statistics and held-out, then the eigensolve")
                log.begin()
            step = max(1, total // 8)
            if done % step == 0 or done == total:
                log.say(f"{what}: {done}/{total}")

        log.begin()
        art, report = calibrate_model_with_report(
            model, ids, SolverSettings(), holdout_ids=holdout, batch_size=args.batch_size,
            compare_alternatives=args.compare, progress=progress, fit_progress=fit_progress, seed=args.seed)
        log.end("clip_fit")
        calibrate_wall = log.stages["forward_capture_and_solve"]["seconds"] + log.stages["clip_fit"]["seconds"]

    # Stage 5: write the artifact.
    log.begin()
    with tempfile.TemporaryDirectory() as tmp:
        art_dir = args.artifact_dir or Path(tmp)
        write_artifact(art, art_dir)
        artifact_bytes = sum(f.stat().st_size for f in Path(art_dir).iterdir() if f.is_file())
    log.end("write", note=f"artifact {artifact_bytes / 2**20:.1f} MiB")

    stages = log.stages
    end_to_end = stages["build_materialise"]["seconds"] + stages["dispatch"]["seconds"] + calibrate_wall \
        + stages["write"]["seconds"]
    t = report.timings
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    import accelerate
    import transformers

    result = {
        "benchmark": "calibration_offload",
        "model": MODEL_ID,
        "gpu": gpu_name,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__, "python": platform.python_version()},
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {**asdict(geom), "parameters": geom.parameters(), "dtype": str(dtype), "samples": args.samples,
                  "seq_len": args.seq_len, "tokens": args.samples * args.seq_len, "holdout_sequences": 1,
                  "holdout_len": holdout_len, "holdout_rule": choices.reasons["holdout_len"],
                  "holdout_queries": data_cfg.holdout_queries, "batch_size": args.batch_size},
        "compare_alternatives": args.compare,
        "placement": {"max_memory_bytes": max_memory, "max_memory_reason": mm_reason,
                      "layers_by_device": per_layer, "weight_bytes_by_device": placed,
                      "describe": describe_placement(placement), "device_map": placement},
        "seconds": {
            "build_materialise": stages["build_materialise"]["seconds"],
            "dispatch": stages["dispatch"]["seconds"],
            "forward_capture": t["forward_capture_s"],  # statistics pass + held-out pass (report's own timer)
            "solve_and_clip_fit": t["solve_s"],
            "calibrate_call": calibrate_wall,  # the two above plus provenance and o_proj gathering
            "write": stages["write"]["seconds"],
            "end_to_end": end_to_end,
            "script_total": time.perf_counter() - log.start_time,  # after imports
        },
        "tokens_per_second_capture": (args.samples * args.seq_len + holdout_len) / t["forward_capture_s"],
        "target": {"seconds": TARGET_S, "met": end_to_end <= TARGET_S},
        "stages": stages,
        "peak_memory": {
            "gpu_max_allocated_gib": max((s.get("gpu_peak_allocated_gib", 0) for s in stages.values()), default=None)
            if cuda else None,
            "gpu_max_reserved_gib": max((s.get("gpu_peak_reserved_gib", 0) for s in stages.values()), default=None)
            if cuda else None,
            "gpu_total_gib": torch.cuda.get_device_properties(torch.device(args.device).index or 0).total_memory / GIB
            if cuda else None,
            "host_peak_rss_gib": rss_peak / GIB,
        },
        "gpu_memory_estimate_bytes": estimate,
        "artifact": {"layers": len(report.layer_ids), "bytes": artifact_bytes,
                     "kept_at": str(args.artifact_dir) if args.artifact_dir else None},
        "summary": report.summary(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if not cuda else "h200" if "H200" in gpu_name else "gpu"
    path = args.out / f"calibrate_70b_{tag}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    path.with_suffix(".md").write_text(md)
    print(md, flush=True)
    log.say(f"wrote {path} and {path.with_suffix('.md').name}")
    return path


def markdown(r: dict) -> str:
    s, pm, sh = r["seconds"], r["peak_memory"], r["shape"]
    gpu = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    layers = ", ".join(f"{k} {v}" for k, v in r["placement"]["layers_by_device"].items())
    return (
        f"# Calibration of {r['model']} on {r['gpu']} ({r['commit'][:12]})\n\n"
        f"{sh['layers']} layers, {sh['heads']}q/{sh['kv_heads']}kv x {sh['head_dim']}, {sh['parameters'] / 1e9:.1f} B "
        f"parameters, {sh['dtype']}; {sh['samples']} x {sh['seq_len']} tokens + 1 x {sh['holdout_len']} held out "
        f"({sh['holdout_rule']}); batch {sh['batch_size']}; layers: {layers}; torch {r['versions']['torch']}, "
        f"transformers {r['versions']['transformers']}, accelerate {r['versions']['accelerate']}.\n\n"
        "| build+materialise | dispatch | forward+capture | solve+clip fit | write | end to end | target | "
        "GPU peak alloc / reserved GiB | host peak RSS GiB |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        f"| {s['build_materialise']:.1f} s | {s['dispatch']:.1f} s | {s['forward_capture']:.1f} s | "
        f"{s['solve_and_clip_fit']:.1f} s | {s['write']:.2f} s | {s['end_to_end']:.1f} s | "
        f"{r['target']['seconds'] // 60} min: {'met' if r['target']['met'] else 'NOT met'} | "
        f"{gpu(pm['gpu_max_allocated_gib'])} / {gpu(pm['gpu_max_reserved_gib'])} | {pm['host_peak_rss_gib']:.1f} |\n"
    )


if __name__ == "__main__":
    try:
        main()
    except InputError as exc:
        sys.exit(f"error: {exc}")
