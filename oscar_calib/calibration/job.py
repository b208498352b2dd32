"""The calibration job behind `oscar-calib run`: resolve defaults, load, capture, solve, write atomically."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from oscar_calib import __version__
from oscar_calib.calibration.calibrate import (
    CalibrationReport,
    artifact_from_statistics,
    capture_statistics,
    check_holdout_length,
    check_supported,
)
from oscar_calib.calibration.capture import sliding_window_layers
from oscar_calib.calibration.data import load_calibration_data
from oscar_calib.calibration.scale import distributed
from oscar_calib.calibration.scale.checkpoint import (
    checkpoint_exists,
    prepare_checkpoint_dir,
    remove_checkpoint,
)
from oscar_calib.calibration.scale.disk_budget import check_run_space, output_bytes, sums_bytes
from oscar_calib.calibration.scale.memory import peak_memory
from oscar_calib.calibration.scale.sharded_capture import CapturePlan, checkpoint_identity, make_accumulator
from oscar_calib.calibration.stats_file import STATS_FILENAME, make_provenance, save_statistics
from oscar_calib.config import AUTO_HOLDOUT_CAP, CalibrationConfig, DataConfig
from oscar_calib.errors import InputError
from oscar_calib.loading import load_config as _load_config
from oscar_calib.loading import load_model as _load_model
from oscar_calib.loading import load_tokenizer as _load_tokenizer
from oscar_calib.placement import describe_placement, placement_summary
from oscar_calib.progress import Stages, log_console
from oscar_calib.zoo.model_card import head_list, render_model_card
from runtime_kernels.artifact import (
    ARTIFACT_FILENAME,
    model_geometry,
    text_config,
    write_artifact,
)
from runtime_kernels.atomic import OutputDirError, atomic_output_dir, output_lock, preflight
from runtime_kernels.units import format_bytes

logger = logging.getLogger(__name__)

LOG_FILENAME = "calibration_log.json"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class RunOptions:
    """How a run is carried out, not what it computes (so none of it is in the recipe).

    - `checkpoint`: checkpoint directory (default `<out>.checkpoint` beside the output directory; see
      `oscar_calib.calibration.scale.checkpoint`: a directory of its own kind, never an existing file or other directory);
    - `checkpoint_every`: samples between checkpoints (None: no checkpoints, unless resuming);
    - `resume`: continue from the checkpoint (refused if it was made with other settings);
    - `shard`: `(index, count)`: sum only that contiguous part of the samples (merge the statistics later);
    - `offload_folder`: where accelerate puts disk-offloaded weights (default: a temporary directory).
    """

    checkpoint: Path | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    shard: tuple[int, int] | None = None
    offload_folder: Path | None = None
    keep_checkpoint_dir: bool = False  # set by the run: `checkpoint` was an empty directory the user made

    def checkpoint_path(self, out_dir: Path) -> Path:
        return self.checkpoint or out_dir.resolve().parent / f"{out_dir.resolve().name}.checkpoint"

    def checkpointing(self) -> bool:
        return self.checkpoint_every is not None or self.resume


def shard_range(samples: int, shard: tuple[int, int] | None, batch_size: int) -> tuple[int, int]:
    """`[start, end)` of shard `index` of `count`: contiguous, whole batches, as even as batches allow."""
    if shard is None:
        return 0, samples
    index, count = shard
    if count < 1 or not 0 <= index < count:
        raise InputError(f"--shard {index}/{count}: expected INDEX/COUNT with 0 <= INDEX < COUNT")
    batches = -(-samples // batch_size)
    if count > batches:
        raise InputError(f"--shard {index}/{count}: only {batches} batches of {batch_size} samples to share")
    lo, hi = index * batches // count, (index + 1) * batches // count
    return lo * batch_size, min(hi * batch_size, samples)


@dataclass
class Choices:
    """Auto-chosen settings with the reason for each (printed and logged)."""

    values: dict[str, object] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def set(self, key: str, value, reason: str) -> None:
        self.values[key] = value
        self.reasons[key] = reason


def resolve_device(requested: str | None, choices: Choices) -> str:
    if requested in (None, "auto"):
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            choices.set("device", "cuda", f"{n} GPU{'s' if n > 1 else ''} visible")
            return "cuda"
        choices.set("device", "cpu", "no GPU visible")
        return "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {requested}: no CUDA device is visible (expected cpu, or a machine with a GPU)")
    if requested != "cpu" and not requested.startswith("cuda"):
        raise InputError(f"--device {requested}: expected cpu, cuda, cuda:N or auto")
    choices.set("device", requested, "given on the command line")
    return requested


def resolve_dtype(requested: str | None, device: str, choices: Choices) -> torch.dtype:
    # bf16 on a GPU: an fp32 capture of SmolLM2-135M gave the same perplexity at 4K and 8K within +-0.3 % (paired,
    # docs/recipe.md) for twice the memory.
    if requested is None:
        if device.startswith("cuda"):
            choices.set("dtype", "bfloat16", "GPU: the dtype models are served in")
            return torch.bfloat16
        choices.set("dtype", "float32", "CPU: bf16 matmuls are slow there")
        return torch.float32
    choices.set("dtype", requested, "given on the command line")
    return _DTYPES[requested]


def resolve_batch_size(requested: int | None, device: str, seq_len: int, choices: Choices) -> int:
    if requested is not None:
        choices.set("batch_size", requested, "given on the command line")
        return requested
    if device.startswith("cuda"):
        bs = max(1, 16384 // seq_len)
        choices.set("batch_size", bs, f"GPU: ~16K tokens per forward pass at seq_len {seq_len}")
        return bs
    choices.set("batch_size", 1, "CPU")
    return 1


def recorded_model_id(model: str | None) -> str | None:
    """What the statistics and the artifact record for `--model`: the Hub id or path as given, except that a local
    path with a `..` component is recorded absolute (readers refuse `..` in a recorded id: it names a directory on
    push)."""
    if model and ".." in model.replace("\\", "/").split("/") and Path(model).exists():
        return os.path.abspath(model)
    return model


def check_output_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse a file, an existing non-empty directory without --overwrite, or an unwritable location, before
    any work starts. Nothing is left on disk here."""
    try:
        preflight(out_dir, overwrite, "--out")
    except OutputDirError as exc:
        raise InputError(str(exc)) from None


def max_positions(config) -> int | None:
    return getattr(text_config(config), "max_position_embeddings", None)


def resolve_holdout_len(data_cfg: DataConfig, limit: int | None, choices: Choices) -> DataConfig:
    """`data_cfg` with its held-out length decided: as given, else the model's context `limit` (at most
    AUTO_HOLDOUT_CAP, at least --seq-len). Clips fitted on 2048-token sequences over-clipped at a real model's 8K
    context (docs/recipe.md), so the fit sees the context the artifact will serve."""
    if data_cfg.holdout_len is not None:
        if limit is not None and data_cfg.holdout_len > limit:
            raise InputError(f"--holdout-len {data_cfg.holdout_len}: above the model's max_position_embeddings={limit}")
        choices.set("holdout_len", data_cfg.holdout_len, "given on the command line")
        return data_cfg
    n = max(data_cfg.seq_len, min(limit or data_cfg.seq_len, AUTO_HOLDOUT_CAP))
    why = (f"the model's context ({limit} tokens)" if limit is not None and limit <= AUTO_HOLDOUT_CAP else
           f"the model's context, at most {AUTO_HOLDOUT_CAP}" if limit is not None else "no context in the config: --seq-len")
    choices.set("holdout_len", n, f"{why}: clips are fitted for the context they serve")
    return data_cfg.model_copy(update={"holdout_len": n})




def environment() -> dict[str, str]:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "oscar_calib": __version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def run_calibration(config: CalibrationConfig, out_dir: str | os.PathLike, overwrite: bool = False,
                    console: Console | None = None, options: RunOptions | None = None) -> Path | None:
    """Calibrate `config.model` and write the artifact directory `out_dir` (artifact, statistics, card, log).

    Every auto-chosen default is reported with its reason on `console` (the CLI passes its stderr console;
    without one the lines are logged). Nothing is written to `out_dir` if any step fails
    (a checkpoint beside it survives, for `--resume`). Under `torchrun` / `accelerate launch` the samples are
    shared among the ranks and rank 0 writes; the other ranks return None.
    Returns the output directory.
    """
    options = options or RunOptions()
    ctx = distributed.from_environment()
    # One writer per output directory, from the start: a second run to the same --out is refused before it
    # calibrates, naming the first (rank 0 writes, so only rank 0 locks).
    lock = output_lock(out_dir) if ctx is None or ctx.is_main else contextlib.nullcontext()
    try:
        with lock:
            return _run(config, Path(out_dir), overwrite, console, options, ctx)
    finally:
        if ctx is not None:
            distributed.shutdown()


def _run(config: CalibrationConfig, out_dir: Path, overwrite: bool, console: Console | None, options: RunOptions,
         ctx: distributed.DistContext | None) -> Path | None:
    """The steps of a run, in order: checks that need nothing loaded, device, model, sizes, data, capture and solve,
    then the atomic write and the summary."""
    main_rank = ctx is None or ctx.is_main
    # The caller's console (the CLI's output object) on rank 0; else lines are logged, not printed (ranks other
    # than 0 of a data-parallel run, and library callers that passed none).
    console = console if console is not None and main_rank else log_console(logger)
    _check_before_work(config, out_dir, overwrite, options)
    choices = Choices()
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    device, dtype = _device_and_dtype(config, ctx, choices)
    t0 = time.perf_counter()
    source = _model_source(config, choices)
    source = _open_model(config, source, dtype, device)
    sizes = _sizes(config, source, device, dtype, options, out_dir, main_rank, choices)
    for key, reason in choices.reasons.items():
        console.print(f"[cyan]{key}[/]={choices.values[key]}: {reason}")
    data = _load_data(sizes, source, options, console)
    with tempfile.TemporaryDirectory(prefix="oscar-offload-") as scratch:
        model = source.model
        if model is None:
            offload = options.offload_folder or Path(scratch)
            model = _load_model(source.ref, config.model_revision, dtype, device, config.trust_remote_code,
                                config.device_map, config.max_memory, offload)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timings["load_s"] = time.perf_counter() - t0
        placement = placement_summary(model)
        if placement is not None:
            console.print("placement (accelerate):\n" + describe_placement(placement))
        result = _calibrate(model, source.model_id, source.revision, config, sizes.data, data, sizes.batch_size,
                            sizes.sample_range, options, out_dir, ctx, console, dtype)
    if result is None:
        return None
    artifact, report, statistics, plan = result
    timings.update(report.timings)
    log = _write_outputs(out_dir, overwrite, sizes, artifact, report, statistics, plan, config, choices, timings,
                         placement, options, ctx, t_start)
    if plan.checkpoint_path is not None:
        # the statistics file supersedes it; only the run's files go (an empty directory the user made stays)
        remove_checkpoint(plan.checkpoint_path, keep_dir=options.keep_checkpoint_dir)
    _print_summary(console, out_dir, report, log, config)
    return out_dir


def _check_before_work(config: CalibrationConfig, out_dir: Path, overwrite: bool, options: RunOptions) -> None:
    """What can be refused before the model loads: the output directory, the checkpoint, --resume, --max-memory."""
    check_output_dir(out_dir, overwrite)
    if options.checkpointing() or options.checkpoint is not None:  # before the model loads: nothing is lost later
        options.keep_checkpoint_dir = prepare_checkpoint_dir(options.checkpoint_path(out_dir), forbidden=out_dir)
    if options.resume and not checkpoint_exists(options.checkpoint_path(out_dir)):
        raise InputError(f"--resume: no checkpoint at {options.checkpoint_path(out_dir)} (pass --checkpoint PATH)")
    if config.max_memory is not None and config.device_map is None:
        raise InputError("--max-memory needs --device-map (auto, balanced, balanced_low_0 or sequential)")


def _device_and_dtype(config: CalibrationConfig, ctx: distributed.DistContext | None,
                      choices: Choices) -> tuple[str, torch.dtype]:
    """The device (one GPU per rank under a launcher, whose process group starts here) and the capture dtype."""
    device = resolve_device(config.device, choices)
    if ctx is not None:
        if config.device_map is not None:
            raise InputError("--device-map with several ranks (torchrun): each rank would spread its own copy "
                             "over every GPU; use one process with --device-map, or ranks without it")
        if device.startswith("cuda"):
            device = f"cuda:{ctx.local_rank}"
            torch.cuda.set_device(device)
        backend = distributed.initialise(ctx, device)
        choices.set("data_parallel", f"{ctx.world_size} ranks ({backend})",
                    "WORLD_SIZE set by the launcher: the samples are shared among the ranks, rank 0 writes")
    return device, resolve_dtype(config.dtype, device, choices)


@dataclass
class ModelSource:
    """The model a run calibrates, before its weights load.

    - ref: what loads the weights (a Hub id, a folder, a .gguf file); None for the random demo model, built in memory;
    - default_text: the demo text when no --dataset was given (else None);
    - after `_open_model`: its config, tokenizer, the model id and revision the artifact names, and `model` when
      built already (the random demo model)."""

    ref: str | None
    default_text: Path | None
    config: object = None
    tokenizer: object = None
    model_id: str = ""
    revision: str = ""
    model: torch.nn.Module | None = None


def _model_source(config: CalibrationConfig, choices: Choices) -> ModelSource:
    """The model and text a run uses: --model and --dataset, else the demo's (the fixture, or a random Qwen3)."""
    from oscar_calib import demo

    if config.model is not None:
        if config.data.dataset is None:
            raise InputError("--dataset is required with --model (a Hub dataset id, or a local .jsonl/.txt file)")
        return ModelSource(config.model, None)
    if demo.fixture_available():
        ref = str(demo.FIXTURE_DIR)
        choices.set("model", "tiny-qwen3 fixture", "no --model: the small Qwen3 trained for this project")
    else:
        ref = None
        choices.set("model", demo.DEMO_MODEL_ID, "no --model: a tiny random Qwen3 built from a config")
    default_text = None
    if config.data.dataset is None:
        default_text = demo.demo_text_path()
        choices.set("dataset", default_text.name, "no --dataset: the demo text shipped with the package")
    return ModelSource(ref, default_text)


def _open_model(config: CalibrationConfig, source: ModelSource, dtype: torch.dtype, device: str) -> ModelSource:
    """`source` with its config, tokenizer and identity (the weights load later, after every check); the random
    demo model is built here, on `device`."""
    from oscar_calib import demo

    if source.ref is None:
        model, tokenizer = demo.random_demo_model(dtype=dtype)
        model.to(device)
        opened = ModelSource(None, source.default_text, model.config, tokenizer, demo.DEMO_MODEL_ID,
                             "random-init-seed0", model)
    else:
        model_config = _load_config(source.ref, config.model_revision, config.trust_remote_code)
        check_supported(model_config)
        tokenizer = _load_tokenizer(source.ref, config.model_revision, config.trust_remote_code)
        revision = (config.model_revision or getattr(model_config, "_commit_hash", None)
                    or (demo.fixture_revision() if config.model is None else "local"))
        opened = ModelSource(source.ref, source.default_text, model_config, tokenizer,
                             recorded_model_id(config.model) or demo.FIXTURE_MODEL_ID, revision)
    check_supported(opened.config)
    return opened


@dataclass(frozen=True)
class RunSizes:
    """The data settings with the held-out length decided, the batch size, this process's samples `[start, end)`
    and the bytes the output directory will take."""

    data: DataConfig
    batch_size: int
    sample_range: tuple[int, int]
    out_bytes: int


def _sizes(config: CalibrationConfig, source: ModelSource, device: str, dtype: torch.dtype, options: RunOptions,
           out_dir: Path, main_rank: bool, choices: Choices) -> RunSizes:
    """Lengths against the model's context, the batch size, the shard, and the disk space (refused now, not after
    the calibration); --device-map needs a model that loads."""
    limit = max_positions(source.config)
    if limit is not None and config.data.seq_len > limit:
        raise InputError(f"--seq-len {config.data.seq_len}: above the model's max_position_embeddings={limit}")
    data_cfg = resolve_holdout_len(config.data, limit, choices)
    check_holdout_length(config.solver, data_cfg.holdout_len)
    batch_size = resolve_batch_size(config.batch_size, device, data_cfg.seq_len, choices)
    sample_range = shard_range(data_cfg.samples, options.shard, batch_size)
    out_bytes = output_bytes(source.config, dtype, data_cfg.holdout_len, data_cfg.holdout_samples,
                             data_cfg.holdout_queries)
    if main_rank:  # rank 0 writes: a full disk is refused now, not after the calibration
        check_run_space(out_dir, out_bytes,
                        options.checkpoint_path(out_dir) if options.checkpointing() else None,
                        2 * sums_bytes(source.config))
    if config.device_map is not None:
        if source.ref is None:
            raise InputError("--device-map needs --model (the demo model is built in memory)")
        choices.set("device_map", config.device_map, "given on the command line: accelerate spreads the layers")
    return RunSizes(data_cfg, batch_size, sample_range, out_bytes)


def _load_data(sizes: RunSizes, source: ModelSource, options: RunOptions, console: Console):
    """The calibration and held-out token ids, with a line saying how many and from where."""
    data_cfg = sizes.data
    data = load_calibration_data(data_cfg, source.tokenizer, default_path=source.default_text)
    console.print(f"data: {data.input_ids.shape[0]} x {data_cfg.seq_len} tokens for statistics, "
                  f"{data.holdout_ids.shape[0]} x {data_cfg.holdout_len} held out, from {data.documents} documents of "
                  f"'{data.source}'")
    if options.shard is not None:
        console.print(f"shard {options.shard[0]}/{options.shard[1]}: samples [{sizes.sample_range[0]}, "
                      f"{sizes.sample_range[1]})")
    return data


def _write_outputs(out_dir: Path, overwrite: bool, sizes: RunSizes, artifact, report: CalibrationReport, statistics,
                   plan, config: CalibrationConfig, choices: Choices, timings: dict, placement, options: RunOptions,
                   ctx: distributed.DistContext | None, t_start: float) -> dict:
    """Artifact, statistics, model card and log into `out_dir`, atomically (all or nothing); returns the log."""
    t0 = time.perf_counter()
    with atomic_output_dir(out_dir, overwrite, "--out", needed_bytes=sizes.out_bytes) as tmp:
        write_artifact(artifact, tmp)
        save_statistics(statistics, tmp / STATS_FILENAME)
        log = build_log(config, choices, report, timings, artifact.metadata)
        log["placement"] = placement
        log["run"] = {"world_size": ctx.world_size if ctx else 1, "sample_range": list(sizes.sample_range),
                      "shard": list(options.shard) if options.shard else None, "resumed_from_sample": plan.resumed_from,
                      "checkpoint_every": options.checkpoint_every, "statistics_file": STATS_FILENAME}
        log["memory"] = {**peak_memory(), "accumulator_bytes": statistics.accumulator_bytes()}
        (tmp / "README.md").write_text(render_model_card(artifact, report, log), encoding="utf-8")
        timings["write_s"] = time.perf_counter() - t0
        timings["total_s"] = time.perf_counter() - t_start
        log["timings"] = timings
        (tmp / LOG_FILENAME).write_text(json.dumps(log, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return log


def _print_summary(console: Console, out_dir: Path, report: CalibrationReport, log: dict,
                   config: CalibrationConfig) -> None:
    """What was written, the peak memory, the held-out errors and the heads that took Hadamard keys."""
    summary = report.summary()
    mem, timings = log["memory"], log["timings"]
    console.print(f"[green]wrote[/] {out_dir}/{ARTIFACT_FILENAME} ({len(report.layer_ids)} layers, "
                  f"skipped {report.skipped_layers or 'none'}) in {timings['total_s']:.1f}s; peak host memory "
                  f"{format_bytes(mem['host_peak_bytes'])}" + "".join(
                      f", {dev} {format_bytes(b)}" for dev, b in mem["device_peak_bytes"].items()))
    k, v = summary["key_error"], summary["value_rel_out_err"]
    console.print(f"held-out key {summary['key_objective']} {k['fitted']:.4g} (no clip {k['no_clip']:.4g}); value output error "
                  f"{v['fitted']:.4g} (no clip {v['no_clip']:.4g})")
    if report.hadamard_key_heads:
        n = sum(map(len, report.hadamard_key_heads.values()))
        console.print(f"keys rotated by Hadamard in {n} KV heads (layer:heads {head_list(report.hadamard_key_heads)};"
                      f" INT2-history attention share above {config.solver.hadamard_key_mass:g})")


def _calibrate(model, model_id, revision, config: CalibrationConfig, data_cfg, data, batch_size: int,
               sample_range: tuple[int, int], options: RunOptions, out_dir: Path,
               ctx: distributed.DistContext | None, console: Console, dtype: torch.dtype):
    """Statistics pass (sharded, checkpointed), held-out capture and solve. None on ranks other than 0."""
    n_layers, h_q, h_kv, d = model_geometry(model.config)
    console.print(f"model: {model_id} ({n_layers} layers, {h_q} query / {h_kv} KV heads, head_dim {d}, {dtype})")
    calibration_meta = {
        "dataset": data_cfg.dataset or f"oscar-calib demo:{data.source and Path(data.source).name}",
        "dataset_revision": data_cfg.dataset_revision,
        "dataset_config": data_cfg.dataset_config,
        "split": data_cfg.split,
        "text_column": data_cfg.text_column,
        "seed": data_cfg.seed,
        "samples": data_cfg.samples,
        "holdout_samples": data_cfg.holdout_samples,
        "seq_len": data_cfg.seq_len,
        "holdout_len": data_cfg.holdout_len,
        "chat_template": data_cfg.chat_template,
        "packing": "concatenate documents with EOS, cut into full sequences",
        "tokens": int(data.input_ids.numel()),
        "documents": data.documents,
    }
    skip = sliding_window_layers(model.config)
    provenance = make_provenance(model.config, model.dtype, model_id=model_id, model_revision=revision,
                                 calibration_meta=calibration_meta, batch_size=batch_size,
                                 holdout_queries=data_cfg.holdout_queries, seed=data_cfg.seed)
    plan = CapturePlan(batch_size=batch_size, sample_range=sample_range, dist=ctx,
                       checkpoint_path=options.checkpoint_path(out_dir) if options.checkpointing() else None,
                       checkpoint_every=options.checkpoint_every, resume=options.resume,
                       identity=checkpoint_identity(provenance.identity(), sample_range),
                       layers=[i for i in range(n_layers) if i not in skip], geometry=(h_kv, d))
    ids = data.input_ids[sample_range[0]:sample_range[1]]
    tokens = int(ids.numel() + data.holdout_ids.numel())
    with Stages(console) as stages:  # capture (tokens, tok/s) then solve + clip fit (layers), each with an ETA
        statistics = capture_statistics(
            model, ids, data.holdout_ids, batch_size=batch_size, holdout_queries=data_cfg.holdout_queries,
            seed=data_cfg.seed, progress=stages.tokens("capture", tokens), model_id=model_id,
            model_revision=revision, calibration_meta=calibration_meta, accumulate=make_accumulator(plan),
            sample_ranges=[list(sample_range)])
        if statistics is None:
            return None
        if plan.resumed_from is not None:
            console.print(f"resumed from the checkpoint at sample {plan.resumed_from}")
        artifact, report = artifact_from_statistics(
            statistics, config.solver, fit_progress=stages.steps("solve + clip fit", unit="layer fits"))
    return artifact, report, statistics, plan


def build_log(config: CalibrationConfig, choices: Choices, report: CalibrationReport, timings: dict,
              metadata: dict) -> dict:
    """The run log: config, auto choices with reasons, timings, environment and headline statistics."""
    return {
        "config": json.loads(config.model_dump_json()),
        "choices": {k: {"value": choices.values[k], "reason": r} for k, r in choices.reasons.items()},
        "metadata": metadata,
        "layer_ids": report.layer_ids,
        "skipped_layers": report.skipped_layers,
        "timings": timings,
        "environment": environment(),
        "summary": report.summary(),
        "clip_ratios": {str(layer): {"k": f.k_ratio.tolist(), "v": f.v_ratio.tolist()} for layer, f in report.fits.items()},
    }
