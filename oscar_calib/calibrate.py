"""Calibration core: capture statistics, solve rotations, fit clip ratios, build the artifact.

`calibrate_model` works on a loaded model and token ids (used by tests, eval and the job);
`run_calibration` (in `oscar_calib.job`) is the whole job behind `oscar-calib run`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from oscar_calib import __version__
from oscar_calib.capture import (
    CaptureSession,
    capturing,
    forward_batch,
    sliding_window_layers,
    unsupported_attention_reason,
)
from oscar_calib.clipfit import ClipFit, fit_layer
from oscar_calib.config import SolverSettings
from oscar_calib.errors import CaptureError, InputError
from oscar_calib.progress import StepFn
from oscar_calib.solve import solve_rotations
from runtime_kernels.artifact import FORMAT_NAME, SCHEMA_VERSION, OscarArtifact, model_geometry

ProgressFn = Callable[[int, int], None]  # (tokens done in this call, total tokens)


@dataclass
class CalibrationReport:
    """What happened, for the log and the model card. Errors are held-out attention-aware errors."""

    layer_ids: list[int]
    skipped_layers: list[int]
    tokens: int
    holdout_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    fits: dict[int, ClipFit] = field(default_factory=dict)
    k_grid: tuple[float, ...] = ()
    v_grid: tuple[float, ...] = ()
    comparison: dict[str, dict[str, float]] = field(default_factory=dict)
    key_objective: str = "attn_kl"

    def summary(self) -> dict:
        """JSON-ready headline numbers: mean held-out errors at the fitted ratios vs the global ratios and no clip."""
        if not self.fits:
            return {}
        def at(err: torch.Tensor, grid: tuple[float, ...], ratio: float) -> float | None:
            return float(err[list(grid).index(ratio)].mean()) if ratio in grid else None

        k_fit = float(torch.stack([f.k_errors.min(dim=0).values.mean() for f in self.fits.values()]).mean())
        v_fit = float(torch.stack([f.v_errors.min(dim=0).values.mean() for f in self.fits.values()]).mean())
        k_glob = [at(f.k_errors, self.k_grid, 0.96) for f in self.fits.values()]
        v_glob = [at(f.v_errors, self.v_grid, 0.92) for f in self.fits.values()]
        k_none = [at(f.k_errors, self.k_grid, 1.0) for f in self.fits.values()]
        v_none = [at(f.v_errors, self.v_grid, 1.0) for f in self.fits.values()]
        mean = lambda xs: (sum(xs) / len(xs)) if xs and None not in xs else None  # noqa: E731
        k_ratios = torch.cat([f.k_ratio for f in self.fits.values()])
        v_ratios = torch.cat([f.v_ratio for f in self.fits.values()])
        return {
            "key_objective": self.key_objective,
            "key_error": {"fitted": k_fit, "global_0.96": mean(k_glob), "no_clip": mean(k_none)},
            "value_rel_out_err": {"fitted": v_fit, "global_0.92": mean(v_glob), "no_clip": mean(v_none)},
            "k_clip_ratio_mean": float(k_ratios.mean()),
            "v_clip_ratio_mean": float(v_ratios.mean()),
            "clip_at_grid_edge": int(((k_ratios == min(self.k_grid)) | (v_ratios == min(self.v_grid))).sum()),
            "alternatives": self.comparison,
        }


def created_at() -> str:
    """UTC timestamp; honours SOURCE_DATE_EPOCH so that two identical runs give identical bytes."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    now = _dt.datetime.fromtimestamp(int(epoch), _dt.timezone.utc) if epoch else _dt.datetime.now(_dt.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def check_supported(config) -> None:
    """Refuse models whose attention OSCAR cannot calibrate, naming the field."""
    reason = unsupported_attention_reason(config)
    if reason:
        raise InputError(reason)
    _, h_q, h_kv, d = model_geometry(config)
    if d & (d - 1) or d < 4:
        raise InputError(f"model config: head_dim={d} is not a power of two (the Hadamard rotation needs 2^n)")
    if h_q % h_kv:
        raise InputError(f"model config: num_attention_heads={h_q} is not a multiple of num_key_value_heads={h_kv}")


def _run_capture(model, session: CaptureSession, ids: torch.Tensor, batch_size: int,
                 progress: ProgressFn | None) -> None:
    device = next(model.parameters()).device
    with capturing(model, session):
        for start in range(0, ids.shape[0], batch_size):
            batch = ids[start:start + batch_size].to(device)
            forward_batch(model, batch)
            if progress is not None:
                progress(batch.numel(), ids.numel())


def _solve_all(session: CaptureSession, layer_ids: list[int], settings: SolverSettings, value_target: str,
               granularity: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    key_targets = torch.stack([session.stats[i].key_target().cpu() for i in layer_ids])
    value_targets = torch.stack([session.stats[i].value_target(value_target).cpu() for i in layer_ids])
    k_rot, k_eig = solve_rotations(key_targets, granularity)
    v_rot, v_eig = solve_rotations(value_targets, granularity)
    return k_rot, k_eig, v_rot, v_eig


def _fit_all(session: CaptureSession, layer_ids: list[int], k_rot, v_rot, settings: SolverSettings,
             no_clip: bool = False, tick: Callable[[], None] | None = None) -> dict[int, ClipFit]:
    fits = {}
    for a, layer in enumerate(layer_ids):
        if tick is not None:
            tick()
        keys, values, queries, positions = session.holdout[layer].stacked()
        dev = keys.device
        fits[layer] = fit_layer(keys, values, queries, positions, k_rot[a].to(dev), v_rot[a].to(dev),
                                (1.0,) if no_clip else settings.k_clip_grid, session.scaling, settings.group_size,
                                settings.sink_tokens, settings.recent_tokens, settings.key_clip_objective,
                                (1.0,) if no_clip else settings.v_clip_grid)
    return fits


def _holdout_positions(seq_len: int, n: int, seed: int) -> torch.Tensor:
    """Sorted distinct query positions, spread over the sequence (seeded, so reproducible)."""
    gen = torch.Generator().manual_seed(seed)
    n = min(n, seq_len)
    return torch.randperm(seq_len, generator=gen)[:n].sort().values


def calibrate_model_with_report(model, input_ids: torch.Tensor, settings: SolverSettings | None = None,
                                holdout_ids: torch.Tensor | None = None, batch_size: int = 1,
                                holdout_queries: int = 256, seed: int = 0, compare_alternatives: bool = True,
                                progress: ProgressFn | None = None, model_id: str | None = None,
                                model_revision: str | None = None, calibration_meta: dict | None = None,
                                fit_progress: StepFn | None = None) -> tuple[OscarArtifact, CalibrationReport]:
    """Calibrate `model` on token ids.

    Args:
        input_ids: `[N, T]` int64 sequences for the statistics.
        holdout_ids: `[S, T']` sequences for fitting clip ratios (default: the last row of input_ids, which
            is then excluded from the statistics when N > 1).
        fit_progress: called `(what, layers done, layers in total)` as the clip fits (and the comparison of
            the alternatives) advance, for a progress bar.
    Returns:
        (artifact, report). The artifact validates against contract v1.
    """
    settings = settings or SolverSettings()
    config = model.config
    check_supported(config)
    n_layers, h_q, h_kv, d = model_geometry(config)
    if settings.group_size and d % settings.group_size:
        raise InputError(f"group_size={settings.group_size} must divide head_dim={d}")
    if holdout_ids is None:
        if input_ids.shape[0] > 1:
            input_ids, holdout_ids = input_ids[:-1], input_ids[-1:]
        else:
            holdout_ids = input_ids
    skip = sliding_window_layers(config)
    session = CaptureSession(skip_layers=skip)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    _run_capture(model, session, input_ids, batch_size, progress)
    session.mode = "holdout"
    session.query_positions = _holdout_positions(holdout_ids.shape[1], holdout_queries, seed)
    _run_capture(model, session, holdout_ids, batch_size, progress)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timings["forward_capture_s"] = time.perf_counter() - t0

    layer_ids = sorted(session.stats)
    if not layer_ids:
        raise CaptureError(
            f"model {type(model).__name__}: no full-attention layer reported to the capture function "
            f"({session.calls} attention calls seen, {len(skip)} sliding-window layers skipped); its attention "
            "does not go through transformers' AttentionInterface or every layer is sliding-window")
    if session.geometry != (h_q, h_kv, d):
        raise CaptureError(f"captured geometry (H_q, H_kv, d) = {session.geometry} differs from the config's "
                           f"{(h_q, h_kv, d)}")

    t0 = time.perf_counter()
    # One clip fit pass per layer, plus five per layer for the alternatives compared (3 variants, Hadamard, none).
    total, done = len(layer_ids) * (6 if compare_alternatives else 1), [0]

    def tick(what: str) -> Callable[[], None]:
        def step() -> None:
            if fit_progress is not None:
                fit_progress(what, done[0], total)
            done[0] += 1
        return step

    k_rot, k_eig, v_rot, v_eig = _solve_all(session, layer_ids, settings, settings.value_target, settings.granularity)
    fits = _fit_all(session, layer_ids, k_rot, v_rot, settings, tick=tick("clip fit"))
    comparison = {}
    if compare_alternatives:
        comparison = _compare_alternatives(session, layer_ids, settings, fits, tick("alternatives"))
    if fit_progress is not None:
        fit_progress("done", total, total)
    timings["solve_s"] = time.perf_counter() - t0

    k_ratio = torch.stack([fits[i].k_ratio for i in layer_ids])
    v_ratio = torch.stack([fits[i].v_ratio for i in layer_ids])
    calib = dict(calibration_meta or {})
    calib.setdefault("tokens", int(input_ids.numel()))
    calib.setdefault("holdout_tokens", int(holdout_ids.numel()))
    calib["solver"] = json.loads(settings.model_dump_json())
    meta = {
        "format": FORMAT_NAME,
        "schema_version": str(SCHEMA_VERSION),
        "model_id": model_id or str(getattr(config, "_name_or_path", "") or "unknown"),
        "model_revision": model_revision or str(getattr(config, "_commit_hash", None) or "unknown"),
        "num_attention_heads": str(h_q),
        "num_key_value_heads": str(h_kv),
        "head_dim": str(d),
        "bits": "2",
        "group_size": str(settings.group_size or d),
        "sink_tokens": str(settings.sink_tokens),
        "recent_tokens": str(settings.recent_tokens),
        "granularity": settings.granularity,
        "key_target": settings.key_target,
        "value_target": settings.value_target,
        "calibration": json.dumps(calib, sort_keys=True),
        "tool_version": f"oscar-calib {__version__}",
        "created_at": created_at(),
    }
    artifact = OscarArtifact(
        layer_ids=torch.tensor(layer_ids, dtype=torch.int64),
        k_rotation=k_rot, v_rotation=v_rot, k_clip_ratio=k_ratio.float(), v_clip_ratio=v_ratio.float(),
        k_eigenvalues=k_eig, v_eigenvalues=v_eig, metadata=meta, source="<calibration>",
    ).validate()
    report = CalibrationReport(layer_ids=layer_ids, skipped_layers=sorted(skip), tokens=int(input_ids.numel()),
                               holdout_tokens=int(holdout_ids.numel()), timings=timings, fits=fits,
                               k_grid=settings.k_clip_grid, v_grid=settings.v_clip_grid, comparison=comparison,
                               key_objective=settings.key_clip_objective)
    return artifact, report


def _compare_alternatives(session, layer_ids, settings: SolverSettings, chosen: dict[int, ClipFit],
                          tick: Callable[[], None] | None = None) -> dict:
    """Held-out errors (best clip per head) of the other value target and granularity, for the record.

    This is how the defaults were decided: the alternative with the lower attention-aware error wins.
    """
    def best(fits: dict[int, ClipFit], kind: str) -> float:
        errs = [(f.k_errors if kind == "k" else f.v_errors).min(dim=0).values.mean() for f in fits.values()]
        return float(torch.stack(errs).mean())

    out = {f"{settings.granularity}/{settings.value_target}": {"key": best(chosen, "k"), "value": best(chosen, "v")}}
    for gran in ("head", "layer"):
        for vt in ("attn_output", "logit_weighted"):
            name = f"{gran}/{vt}"
            if name in out:
                continue
            k_rot, _, v_rot, _ = _solve_all(session, layer_ids, settings, vt, gran)
            fits = _fit_all(session, layer_ids, k_rot, v_rot, settings, tick=tick)
            out[name] = {"key": best(fits, "k"), "value": best(fits, "v")}
    # Baseline without the eigen-basis (Hadamard only) for context.
    from oscar_calib.solve import hadamard

    h_kv, d = session.stats[layer_ids[0]].key_sum.shape[:2]
    had = hadamard(d).float().expand(len(layer_ids), h_kv, d, d)
    fits = _fit_all(session, layer_ids, had, had, settings, tick=tick)
    out["hadamard_only"] = {"key": best(fits, "k"), "value": best(fits, "v")}
    eye = torch.eye(d).expand(len(layer_ids), h_kv, d, d)
    fits = _fit_all(session, layer_ids, eye, eye, settings, no_clip=True, tick=tick)
    out["no_rotation_no_clip"] = {"key": best(fits, "k"), "value": best(fits, "v")}
    return out


def calibrate_model(model, input_ids: torch.Tensor, settings: SolverSettings | None = None, **kwargs) -> OscarArtifact:
    """`calibrate_model_with_report` without the report. input_ids `[N, T]`."""
    return calibrate_model_with_report(model, input_ids, settings, **kwargs)[0]


def run_calibration(config, out_dir, overwrite: bool = False, console=None):
    """The whole job behind `oscar-calib run` (see `oscar_calib.job.run_calibration`)."""
    from oscar_calib.job import run_calibration as _run

    return _run(config, out_dir, overwrite=overwrite, console=console)
