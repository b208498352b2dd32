"""The calibration job behind `oscar-calib run`: resolve defaults, load, capture, solve, write atomically."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from oscar_calib import __version__
from oscar_calib.calibrate import (
    CalibrationReport,
    calibrate_model_with_report,
    check_supported,
)
from oscar_calib.config import CalibrationConfig
from oscar_calib.data import load_calibration_data
from oscar_calib.errors import InputError
from oscar_calib.loading import load_config as _load_config
from oscar_calib.loading import load_model as _load_model
from oscar_calib.loading import load_tokenizer as _load_tokenizer
from oscar_calib.model_card import render_model_card
from runtime_kernels.artifact import (
    ARTIFACT_FILENAME,
    model_geometry,
    text_config,
    write_artifact,
)
from runtime_kernels.atomic import OutputDirError, atomic_output_dir, preflight

LOG_FILENAME = "calibration_log.json"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


def check_output_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse a file, an existing non-empty directory without --overwrite, or an unwritable location, before
    any work starts. Nothing is left on disk here."""
    try:
        preflight(out_dir, overwrite, "--out")
    except OutputDirError as exc:
        raise InputError(str(exc)) from None


def max_positions(config) -> int | None:
    return getattr(text_config(config), "max_position_embeddings", None)


class _Progress:
    """A rich progress bar on stderr with tokens per second."""

    def __init__(self, console: Console, total: int, label: str):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("tokens"), TextColumn("{task.fields[tps]}"), TimeElapsedColumn(),
                                 console=console, transient=False)
        self.task = self.progress.add_task(label, total=total, tps="")
        self.start = time.perf_counter()
        self.done = 0

    def __call__(self, tokens: int, _total: int) -> None:
        self.done += tokens
        rate = self.done / max(time.perf_counter() - self.start, 1e-9)
        self.progress.update(self.task, advance=tokens, tps=f"{rate:,.0f} tok/s")

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)


def environment() -> dict[str, str]:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "oscar_calib": __version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def run_calibration(config: CalibrationConfig, out_dir: str | os.PathLike, overwrite: bool = False,
                    console: Console | None = None) -> Path:
    """Calibrate `config.model` and write the artifact directory `out_dir` (artifact, model card, log).

    Every auto-chosen default is printed with its reason. Nothing is written if any step fails.
    Returns the output directory.
    """
    from oscar_calib import demo

    console = console or Console(stderr=True)
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    choices = Choices()
    timings: dict[str, float] = {}
    t_start = time.perf_counter()

    device = resolve_device(config.device, choices)
    dtype = resolve_dtype(config.dtype, device, choices)
    data_cfg = config.data
    default_text = None
    t0 = time.perf_counter()
    if config.model is None:
        if demo.fixture_available():
            model_ref = str(demo.FIXTURE_DIR)
            choices.set("model", "tiny-qwen3 fixture", "no --model: the small Qwen3 trained for this project")
        else:
            model_ref = None
            choices.set("model", demo.DEMO_MODEL_ID, "no --model: a tiny random Qwen3 built from a config")
        if data_cfg.dataset is None:
            default_text = demo.demo_text_path()
            choices.set("dataset", default_text.name, "no --dataset: the demo text shipped with the package")
    else:
        model_ref = config.model
        if data_cfg.dataset is None:
            raise InputError("--dataset is required with --model (a Hub dataset id, or a local .jsonl/.txt file)")

    if model_ref is None:
        model, tokenizer = demo.random_demo_model(dtype=dtype)
        model.to(device)
        model_config = model.config
        model_id, revision = demo.DEMO_MODEL_ID, "random-init-seed0"
    else:
        model_config = _load_config(model_ref, config.model_revision, config.trust_remote_code)
        check_supported(model_config)
        model = None
        tokenizer = _load_tokenizer(model_ref, config.model_revision, config.trust_remote_code)
        model_id = config.model or demo.FIXTURE_MODEL_ID
        revision = (config.model_revision or getattr(model_config, "_commit_hash", None)
                    or (demo.fixture_revision() if config.model is None else "local"))
    check_supported(model_config)
    limit = max_positions(model_config)
    if limit is not None and data_cfg.seq_len > limit:
        raise InputError(f"--seq-len {data_cfg.seq_len}: above the model's max_position_embeddings={limit}")
    batch_size = resolve_batch_size(config.batch_size, device, data_cfg.seq_len, choices)
    if config.device_map is not None:
        if model_ref is None:
            raise InputError("--device-map needs --model (the demo model is built in memory)")
        choices.set("device_map", config.device_map, "given on the command line: accelerate spreads the layers")
    for key, reason in choices.reasons.items():
        console.print(f"[cyan]{key}[/]={choices.values[key]}: {reason}")

    data = load_calibration_data(data_cfg, tokenizer, default_path=default_text)
    console.print(f"data: {data.input_ids.shape[0]} x {data_cfg.seq_len} tokens for statistics, "
                  f"{data.holdout_ids.shape[0]} x {data_cfg.seq_len} held out, from {data.documents} documents of "
                  f"'{data.source}'")
    if model is None:
        model = _load_model(model_ref, config.model_revision, dtype, device, config.trust_remote_code,
                            config.device_map)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timings["load_s"] = time.perf_counter() - t0

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
        "chat_template": data_cfg.chat_template,
        "packing": "concatenate documents with EOS, cut into full sequences",
        "tokens": int(data.input_ids.numel()),
        "documents": data.documents,
    }
    with _Progress(console, int(data.input_ids.numel() + data.holdout_ids.numel()), "capture") as progress:
        artifact, report = calibrate_model_with_report(
            model, data.input_ids, config.solver, holdout_ids=data.holdout_ids, batch_size=batch_size,
            holdout_queries=data_cfg.holdout_queries, seed=data_cfg.seed, progress=progress,
            model_id=model_id, model_revision=revision, calibration_meta=calibration_meta)
    timings.update(report.timings)

    t0 = time.perf_counter()
    with atomic_output_dir(out_dir, overwrite, "--out") as tmp:
        write_artifact(artifact, tmp)
        log = build_log(config, choices, report, timings, artifact.metadata)
        (tmp / "README.md").write_text(render_model_card(artifact, report, log), encoding="utf-8")
        timings["write_s"] = time.perf_counter() - t0
        timings["total_s"] = time.perf_counter() - t_start
        log["timings"] = timings
        (tmp / LOG_FILENAME).write_text(json.dumps(log, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    summary = report.summary()
    console.print(f"[green]wrote[/] {out_dir}/{ARTIFACT_FILENAME} ({len(report.layer_ids)} layers, "
                  f"skipped {report.skipped_layers or 'none'}) in {timings['total_s']:.1f}s")
    k, v = summary["key_error"], summary["value_rel_out_err"]
    console.print(f"held-out key {summary['key_objective']} {k['fitted']:.4g} (no clip {k['no_clip']:.4g}); value output error "
                  f"{v['fitted']:.4g} (no clip {v['no_clip']:.4g})")
    return out_dir


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
