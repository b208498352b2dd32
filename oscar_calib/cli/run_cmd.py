"""`oscar-calib run`: calibrate a model into an artifact directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from oscar_calib.cli._common import run_result
from oscar_calib.cli.app import app
from oscar_calib.cli.exit_codes import require
from oscar_calib.cli.options import (
    SOLVER_FLAGS,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    RevisionOpt,
    SolverFlags,
    validation_message,
    with_solver_flags,
)
from oscar_calib.cli.output import Output
from oscar_calib.config import CalibrationConfig, DataConfig
from oscar_calib.errors import InputError

_EXAMPLES = """
Examples:

  oscar-calib run                                          # embedded demo -> ./zoo/demo
  oscar-calib run --model Qwen/Qwen3-8B --dataset data.jsonl --out zoo/qwen3-8b
  oscar-calib run --model Qwen/Qwen3-8B --dataset HuggingFaceFW/fineweb-edu --dataset-revision <sha> \\
      --split train --samples 128 --seq-len 2048 --out zoo/qwen3-8b
  torchrun --nproc-per-node 8 -m oscar_calib run --model Qwen/Qwen3-8B --dataset data.jsonl --out zoo/q8
  oscar-calib run --model M --dataset d.jsonl --out zoo/m --checkpoint-every 16     # then --resume after a crash
  oscar-calib run --model big --dataset d.jsonl --out zoo/big --device-map auto --max-memory 0=70GiB --max-memory cpu=200GiB
"""


def _shard(text: Optional[str]) -> tuple[int, int] | None:
    if text is None:
        return None
    index, _, count = text.partition("/")
    index, count = index.strip(), count.strip()
    # ASCII digits only: str.isdigit() also takes '²' and other digits int() refuses
    if not (index.isascii() and count.isascii() and index.isdigit() and count.isdigit()) or len(text) > 24:
        raise InputError(f"--shard {ascii(text)}: expected INDEX/COUNT of ASCII digits, e.g. 0/2")
    return int(index), int(count)


def _default_samples(demo: bool) -> int:
    """32 sequences; the demo 4 on the fixture's calibration text, 1 on the small demo text of the random fallback
    (its 4.6K tokens hold one 2048-token sequence and the held-out one)."""
    if not demo:
        return 32
    from oscar_calib.demo import fixture_available

    return 4 if fixture_available() else 1


@app.command("run", epilog=_EXAMPLES)
@with_solver_flags
def run(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Hub model id, local directory or .gguf file (default: demo).")] = None,
    revision: RevisionOpt = None,
    dataset: Annotated[Optional[str], typer.Option("--dataset", "-d", help="Hub dataset id, or a local .jsonl/.txt file.")] = None,
    dataset_revision: Annotated[Optional[str], typer.Option("--dataset-revision", help="Pinned dataset revision.")] = None,
    dataset_config: Annotated[Optional[str], typer.Option("--dataset-config", help="Dataset configuration name.")] = None,
    split: Annotated[str, typer.Option("--split", help="Split of a Hub dataset or dataset folder.")] = "train",
    text_column: Annotated[str, typer.Option("--text-column", help="Field holding the text in .jsonl rows and datasets.")] = "text",
    samples: Annotated[Optional[int], typer.Option("--samples", help="Packed sequences for statistics (default 32; the demo: 4 on the trained fixture, 1 on the random fallback).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per statistics sequence (default 2048).")] = None,
    holdout_len: Annotated[Optional[int], typer.Option("--holdout-len", help="Tokens of the held-out sequence the clips are fitted on: the context the artifact is fitted for (default: the model's context, at most 8192; must exceed sink + recent).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Shuffles the documents (local files) or the stream's buffer (Hub) before sampling.")] = 0,
    chat_template: Annotated[bool, typer.Option("--chat-template/--no-chat-template", help="Render `messages` rows (or each text as a user turn) with the tokenizer's chat template.")] = False,
    solver: SolverFlags = SOLVER_FLAGS,  # --granularity ... --group-size, declared once (cli/options.py)
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Sequences per forward pass (default: ~16K tokens per forward on a GPU, 1 on a CPU).")] = None,
    device_map: Annotated[Optional[str], typer.Option("--device-map", help="auto, balanced, balanced_low_0 or sequential: spread a large model over all visible devices with accelerate.")] = None,
    max_memory: Annotated[Optional[list[str]], typer.Option("--max-memory", help="Per-device limit for --device-map, repeatable: 0=70GiB, cpu=200GiB, disk=1TiB (or one JSON object); layers beyond it are offloaded.")] = None,
    offload_folder: Annotated[Optional[Path], typer.Option("--offload-folder", help="Where disk-offloaded weights go (default: a temporary directory).")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option("--checkpoint-every", min=1, help="Checkpoint the statistics every K samples (atomic write).")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", help="Checkpoint directory (default: <out>.checkpoint beside --out); an existing path must be a checkpoint directory.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the checkpoint; refused if it was made with other settings.")] = False,
    shard: Annotated[Optional[str], typer.Option("--shard", help="INDEX/COUNT: sum only that contiguous part of the samples (merge with `oscar-calib stats merge`).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output directory (default: zoo/demo for the demo).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Run the model repo's own Python code (only for repos you trust).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Calibrate OSCAR rotations and clip ratios for a causal LM and write a validated artifact."""
    from oscar_calib.calibration.job import RunOptions
    from oscar_calib.cli.preflight import check_dataset_ref, check_model_ref
    from oscar_calib.loading import is_gguf
    from oscar_calib.placement import parse_max_memory

    output = Output(as_json)
    if is_gguf(model):  # transformers reads GGUF files through the optional `gguf` package
        require("gguf", "gguf", f"--model {model}")

    try:
        settings = solver.settings()  # the flags first: a clip ratio below the floor fails before any path is read
    except ValidationError as exc:
        raise InputError(validation_message(exc)) from exc
    demo = model is None
    check_model_ref(model)  # before anything loads: a missing path (2), an unreachable Hub (5), no `datasets` (7)
    check_dataset_ref(dataset)
    data = dict(dataset=dataset, dataset_revision=dataset_revision, dataset_config=dataset_config, split=split,
                text_column=text_column, samples=_default_samples(demo) if samples is None else samples,
                seq_len=2048 if seq_len is None else seq_len, holdout_len=holdout_len, seed=seed,
                chat_template=chat_template)
    config = _config(model=model, model_revision=revision, data=data, solver=settings, device=device, dtype=dtype,
                     batch_size=batch_size, device_map=device_map, max_memory=parse_max_memory(max_memory),
                     trust_remote_code=trust_remote_code)
    out = _out_dir(out, demo)
    options = RunOptions(checkpoint=checkpoint, checkpoint_every=checkpoint_every, resume=resume,
                         shard=_shard(shard), offload_folder=offload_folder)
    if _calibrate(output, config, out, overwrite, options) is None:  # ranks > 0 of a data-parallel run write nothing
        return
    if as_json:
        output.json(run_result(Path(out)), indent=2, sort_keys=True)
    else:
        output.note(written_summary(Path(out), model))
        output.result(out)


def _config(*, data: dict, **fields) -> CalibrationConfig:
    """The run's CalibrationConfig from the flags; a value pydantic refuses is a one-line InputError naming its flag."""
    try:
        return CalibrationConfig(data=DataConfig(**data), **fields)
    except ValidationError as exc:
        raise InputError(validation_message(exc)) from exc


def _out_dir(out: Optional[Path], demo: bool) -> Path:
    """--out, which only the demo may leave out (it writes zoo/demo)."""
    if out is not None:
        return out
    if not demo:
        raise InputError("--out is required with --model (the artifact directory to create)")
    return Path("zoo/demo")


def _calibrate(output: Output, config, out: Path, overwrite: bool, options):
    """`run_calibration`; on Ctrl-C / SIGTERM, says where the checkpoint is kept before the interrupt goes on
    (oscar_calib.interrupts prints the outcome, exit 130 / 143)."""
    from oscar_calib.calibration.job import run_calibration

    try:
        return run_calibration(config, out, overwrite=overwrite, options=options, console=output.console)
    except KeyboardInterrupt:
        from oscar_calib.calibration.scale.checkpoint import checkpoint_exists

        kept = options.checkpoint_path(out)
        if options.checkpointing() and checkpoint_exists(kept):
            output.note(f"the checkpoint {kept} is kept for --resume")
        raise


# What each file of an output directory is, for the summary a run ends with (push uploads only the first two).
_WHAT = {"oscar_kv.safetensors": "artifact (what serving loads)",
         "README.md": "model card",
         "calibration_log.json": "run log (stays local)",
         "oscar_stats.safetensors": "statistics (stays local)"}


def written_summary(out: Path, model: str | None) -> str:
    """A few lines on stderr: what was written (paths, sizes) and the next two commands."""
    from runtime_kernels.units import format_bytes

    lines = [f"wrote {out}/:"]
    for name, what in _WHAT.items():
        path = out / name
        if path.is_file():
            lines.append(f"  {name:<24} {format_bytes(path.stat().st_size):>9}  {what}")
    model_flag = "" if model is None else f" --model {model}"
    lines += ["next:",
              f"  oscar-calib eval{model_flag} --artifact {out}      # vs BF16 and the baselines",
              f"  oscar-calib push {out} --repo ORG/NAME --dry-run   # what push would upload"]
    return "\n".join(lines)
