"""`oscar-calib refit` and `oscar-calib stats merge`: artifacts and statistics without a model run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from oscar_calib.cli.app import app
from oscar_calib.cli.help_layout import UserOrderGroup
from oscar_calib.cli.options import (
    SOLVER_FLAGS,
    DeviceOpt,
    JsonOpt,
    OutDirOpt,
    SolverFlags,
    validation_message,
    with_solver_flags,
)
from oscar_calib.cli.output import Output
from oscar_calib.errors import InputError

stats_app = typer.Typer(help="Work with calibration statistics files (oscar_stats.safetensors).", no_args_is_help=True,
                        cls=UserOrderGroup)
app.add_typer(stats_app, name="stats")

_REFIT_EXAMPLES = """
Examples:

  oscar-calib refit zoo/qwen3-8b/oscar_stats.safetensors --out zoo/qwen3-8b-layer --granularity layer
  oscar-calib refit merged.safetensors --out zoo/qwen3-8b --k-clip-grid 0.9,0.95
"""


@app.command("refit", epilog=_REFIT_EXAMPLES)
@with_solver_flags
def refit_cmd(
    stats: Annotated[Path, typer.Argument(help="Statistics file (or a run's output directory).")],
    out: OutDirOpt,
    solver: SolverFlags = SOLVER_FLAGS,  # --granularity ... --group-size, declared once (cli/options.py)
    device: DeviceOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Build an artifact from saved statistics with no model: the same bytes as the run with these settings."""
    from oscar_calib.calibration.refit import refit

    output = Output(as_json)
    try:
        settings = solver.settings()
    except ValidationError as exc:  # named by the flag, as in `run` (not the settings field behind it)
        raise InputError(validation_message(exc)) from exc
    if device not in (None, "cpu") and not device.startswith("cuda"):
        raise InputError(f"--device {device}: expected cpu, cuda or cuda:N")
    if device and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: no CUDA device is visible (expected cpu, or a machine with a GPU)")
    refit(stats, out, settings, overwrite=overwrite, device=device or "cpu", console=output.console)
    if as_json:
        from oscar_calib.cli._common import run_result  # the same result as `run --json`: a refit is a run

        output.json(run_result(out), indent=2, sort_keys=True)
    else:
        output.result(out)


@stats_app.command("merge", epilog="\nExample:\n\n  oscar-calib stats merge shard0/oscar_stats.safetensors "
                   "shard1/oscar_stats.safetensors --out all.safetensors\n")
def merge_cmd(
    inputs: Annotated[list[Path], typer.Argument(help="Statistics files (or run directories) of disjoint samples.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Merged statistics file to write.")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing file.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Sum statistics files by addition; refuses files of other models, configs, data or tool versions."""
    import contextlib

    from oscar_calib.calibration.calibrate import created_at
    from oscar_calib.calibration.stats_file import load_statistics, merge_statistics, save_statistics
    from runtime_kernels.atomic import check_file_target, output_lock

    output = Output(as_json)
    _check_merge_out(out, overwrite)
    check_file_target(out, "--out")  # a symlink, FIFO or device: refused before the merge, never written through
    with contextlib.ExitStack() as held:  # one writer per file, --overwrite or not (the lock is re-entrant)
        if out.parent.is_dir():
            held.enter_context(output_lock(out, "--out"))
        merged = merge_statistics([(str(p), load_statistics(p)) for p in inputs], created_at())
        out.parent.mkdir(parents=True, exist_ok=True)
        held.enter_context(output_lock(out, "--out"))
        if out.exists() and not overwrite:
            raise InputError(f"--out {out}: already exists (written while this merge ran); pass --overwrite to "
                             "replace it; nothing was written")
        save_statistics(merged, out)
    if as_json:
        from runtime_kernels.loader import file_record

        prov = merged.provenance
        output.json({"out": str(out), **file_record(out), "inputs": [str(p) for p in inputs],
                     "model_id": prov.model_id, "model_revision": prov.model_revision,
                     "sample_ranges": prov.sample_ranges, "tokens": merged.tokens,
                     "layer_ids": list(merged.layer_ids)}, indent=2, sort_keys=True)
    else:
        output.result(out)


def _check_merge_out(out: Path, overwrite: bool) -> None:
    """Refuse, before any input is read, a `--out` that is a directory, not a regular file, exists without
    `--overwrite`, or lies where no file can be created (the real test: a probe file made and removed)."""
    import os
    import tempfile

    if out.is_dir():
        raise InputError(f"--out {out}: is a directory (expected the statistics file to write)")
    if out.exists() and not overwrite:
        raise InputError(f"--out {out}: already exists; pass --overwrite to replace it")
    ancestor = Path(os.path.abspath(out)).parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"--out {out}: {ancestor} is not a directory (expected a path where a file can be created)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".oscar-probe-", dir=ancestor)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"--out {out}: cannot create files in {ancestor} ({exc.strerror}); choose a writable "
                         "location") from None
