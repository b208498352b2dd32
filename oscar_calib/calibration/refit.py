"""`refit`: an artifact directory from a statistics file, with no model (the same path as `oscar-calib run`)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from rich.console import Console

from oscar_calib.calibration.calibrate import artifact_from_statistics
from oscar_calib.calibration.job import LOG_FILENAME, atomic_output_dir, check_output_dir, environment
from oscar_calib.calibration.stats_file import STATS_FILENAME, load_statistics, save_statistics
from oscar_calib.config import SolverSettings
from oscar_calib.progress import log_console
from oscar_calib.zoo.model_card import render_model_card
from runtime_kernels.artifact import ARTIFACT_FILENAME, write_artifact
from runtime_kernels.atomic import output_lock


def refit(stats_path: Path, out_dir: Path, settings: SolverSettings, overwrite: bool = False,
          device: str = "cpu", console: Console | None = None) -> Path:
    """Solve and fit from `stats_path` into `out_dir` (artifact, the statistics, model card, log), atomically.

    Bytes equal those of the run that wrote the statistics when `settings` are the run's solver settings and the
    clip fit runs on the same kind of device (`device`, default cpu).
    """
    console = console or log_console(logging.getLogger(__name__))  # the CLI passes its own; a library caller gets logs
    check_output_dir(out_dir, overwrite)
    with output_lock(out_dir):  # one writer per output from the start, as `run`: a second refit is refused before it fits
        return _refit(stats_path, Path(out_dir), settings, overwrite, device, console)


def _refit(stats_path: Path, out_dir: Path, settings: SolverSettings, overwrite: bool, device: str,
           console: Console) -> Path:
    t0 = time.perf_counter()
    statistics = load_statistics(stats_path)
    prov = statistics.provenance
    console.print(f"statistics: {prov.model_id} @ {prov.model_revision}, {len(statistics.layer_ids)} layers, "
                  f"{statistics.tokens} tokens, samples {prov.sample_ranges}")
    artifact, report = artifact_from_statistics(statistics, settings, device=device)
    timings = {"load_s": 0.0, **report.timings}
    with atomic_output_dir(out_dir, overwrite) as tmp:
        write_artifact(artifact, tmp)
        save_statistics(statistics, tmp / STATS_FILENAME)
        log = {"refit_from": str(stats_path), "statistics": prov.to_metadata(), "solver": json.loads(settings.model_dump_json()),
               "metadata": artifact.metadata, "layer_ids": report.layer_ids, "skipped_layers": report.skipped_layers,
               "environment": environment(), "summary": report.summary(),
               "clip_ratios": {str(layer): {"k": f.k_ratio.tolist(), "v": f.v_ratio.tolist()}
                               for layer, f in report.fits.items()}}
        timings["total_s"] = time.perf_counter() - t0
        log["timings"] = timings
        (tmp / "README.md").write_text(render_model_card(artifact, report, log), encoding="utf-8")
        (tmp / LOG_FILENAME).write_text(json.dumps(log, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    console.print(f"[green]wrote[/] {out_dir}/{ARTIFACT_FILENAME} from {stats_path} in {timings['total_s']:.1f}s")
    return out_dir
