"""`oscar-calib refit` and `oscar-calib stats merge`: artifacts and statistics without a model run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from oscar_calib.cli.app import app
from oscar_calib.cli.options import DeviceOpt, OutDirOpt
from oscar_calib.cli.run_cmd import ClipObjective, Granularity, ValueTarget
from oscar_calib.config import DEFAULT_K_CLIP_GRID, DEFAULT_V_CLIP_GRID, SolverSettings
from oscar_calib.errors import InputError

stats_app = typer.Typer(help="Work with calibration statistics files (oscar_stats.safetensors).", no_args_is_help=True)
app.add_typer(stats_app, name="stats")

_REFIT_EXAMPLES = """
Examples:

  oscar-calib refit zoo/qwen3-8b/oscar_stats.safetensors --out zoo/qwen3-8b-layer --granularity layer
  oscar-calib refit merged.safetensors --out zoo/qwen3-8b --k-clip-grid 0.9,0.95
"""


def _grid(text: Optional[str], flag: str, default: tuple[float, ...]) -> tuple[float, ...]:
    if text is None:
        return default
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise InputError(f"{flag} '{text}': expected comma-separated ratios in (0, 1]") from exc


@app.command("refit", epilog=_REFIT_EXAMPLES)
def refit_cmd(
    stats: Annotated[Path, typer.Argument(help="Statistics file (or a run's output directory).")],
    out: OutDirOpt,
    granularity: Annotated[Granularity, typer.Option("--granularity", help="One rotation per KV head or per layer.")] = Granularity.head,
    value_target: Annotated[ValueTarget, typer.Option("--value-target", help="attn_output or logit_weighted.")] = ValueTarget.attn_output,
    k_clip_grid: Annotated[Optional[str], typer.Option("--k-clip-grid", help="Key clip ratios, comma-separated.")] = None,
    v_clip_grid: Annotated[Optional[str], typer.Option("--v-clip-grid", help="Value clip ratios, comma-separated.")] = None,
    key_objective: Annotated[ClipObjective, typer.Option("--key-objective", help="Held-out error that picks clips (as in `run`).")] = ClipObjective.block_out,
    center_keys: Annotated[bool, typer.Option("--center-keys/--no-center-keys", help="Subtract the calibrated key mean before quantizing.")] = True,
    center_values: Annotated[bool, typer.Option("--center-values/--no-center-values", help="Subtract the calibrated value mean before quantizing.")] = True,
    sink: Annotated[Optional[int], typer.Option("--sink", help="BF16 sink tokens (default 64).")] = None,
    recent: Annotated[Optional[int], typer.Option("--recent", help="BF16 recent tokens (default 256).")] = None,
    group_size: Annotated[Optional[int], typer.Option("--group-size", help="Quantization group (default: head_dim).")] = None,
    device: DeviceOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")] = False,
) -> None:
    """Build an artifact from saved statistics with no model: the same bytes as the run with these settings."""
    from oscar_calib.refit import refit

    try:
        settings = SolverSettings(granularity=granularity.value, value_target=value_target.value,
                                  k_clip_grid=_grid(k_clip_grid, "--k-clip-grid", DEFAULT_K_CLIP_GRID),
                                  v_clip_grid=_grid(v_clip_grid, "--v-clip-grid", DEFAULT_V_CLIP_GRID),
                                  key_clip_objective=key_objective.value, group_size=group_size,
                                  center_keys=center_keys, center_values=center_values,
                                  **{k: v for k, v in (("sink_tokens", sink), ("recent_tokens", recent)) if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise InputError(f"option '{field}': {first['msg']} (got {first.get('input')!r})") from exc
    if device not in (None, "cpu") and not device.startswith("cuda"):
        raise InputError(f"--device {device}: expected cpu, cuda or cuda:N")
    if device and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: no CUDA device is visible (expected cpu, or a machine with a GPU)")
    refit(stats, out, settings, overwrite=overwrite, device=device or "cpu")
    typer.echo(str(out))


@stats_app.command("merge", epilog="\nExample:\n\n  oscar-calib stats merge shard0/oscar_stats.safetensors "
                   "shard1/oscar_stats.safetensors --out all.safetensors\n")
def merge_cmd(
    inputs: Annotated[list[Path], typer.Argument(help="Statistics files (or run directories) of disjoint samples.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Merged statistics file to write.")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing file.")] = False,
) -> None:
    """Sum statistics files by addition; refuses files of other models, configs, data or tool versions."""
    from oscar_calib.calibrate import created_at
    from oscar_calib.stats_file import load_statistics, merge_statistics, save_statistics

    if out.is_dir():
        raise InputError(f"--out {out}: is a directory (expected the statistics file to write)")
    if out.exists() and not overwrite:
        raise InputError(f"--out {out}: already exists; pass --overwrite to replace it")
    merged = merge_statistics([(str(p), load_statistics(p)) for p in inputs], created_at())
    save_statistics(merged, out)
    typer.echo(str(out))
