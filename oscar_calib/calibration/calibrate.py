"""Calibration core: capture statistics, solve rotations, fit clip ratios, build the artifact.

Two halves: `capture_statistics` (model + token ids -> `CalibrationStatistics`, which can be saved and merged)
and `artifact_from_statistics` (statistics -> artifact, no model: what `oscar-calib refit` runs).
`calibrate_model` works on a loaded model and token ids (used by tests, eval and the job);
`oscar_calib.calibration.job.run_calibration` is the whole job behind `oscar-calib run` (it imports this module, never
the other way round).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from oscar_calib import __version__
from oscar_calib.calibration.capture import (
    CaptureSession,
    capturing,
    forward_batch,
    sliding_window_layers,
    unsupported_attention_reason,
)
from oscar_calib.calibration.clipfit import MIN_RATIO, ClipFit, fit_layer
from oscar_calib.calibration.key_basis import hadamard_key_heads, holdout_history_mass
from oscar_calib.calibration.solve import solve_rotations
from oscar_calib.calibration.stats import LayerStats
from oscar_calib.calibration.stats_checks import sample_digests
from oscar_calib.calibration.stats_file import CalibrationStatistics, make_provenance
from oscar_calib.config import SolverSettings
from oscar_calib.errors import CaptureError, InputError
from oscar_calib.placement import input_device
from oscar_calib.progress import StepFn
from runtime_kernels.artifact import OscarArtifact, model_geometry
from runtime_kernels.contract import build_metadata, created_at
from runtime_kernels.format import KVFormatError

ProgressFn = Callable[[int, int], None]  # (tokens done in this call, total tokens)
AccumulateFn = Callable[..., "dict[int, LayerStats] | None"]  # (model, session, input_ids, progress)


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
    means: tuple[torch.Tensor, torch.Tensor] | None = None  # ([A, H_kv, d], [A, H_kv, d]) model basis
    hadamard_key_heads: dict[int, list[int]] = field(default_factory=dict)  # {layer: KV heads} keys by Hadamard

    def summary(self) -> dict:
        """JSON-ready headline numbers: mean held-out errors at the fitted ratios vs the global ratios and no clip."""
        if not self.fits:
            return {}
        def at(f: ClipFit, side: str, ratio: float) -> float | None:
            grid, err = (f.k_grid, f.k_errors) if side == "k" else (f.v_grid, f.v_errors)
            return float(err[list(grid).index(ratio)].mean()) if ratio in grid else None

        fits = list(self.fits.values())
        k_fit = float(torch.stack([f.k_errors.min(dim=0).values.mean() for f in fits]).mean())
        v_fit = float(torch.stack([f.v_errors.min(dim=0).values.mean() for f in fits]).mean())
        mean = lambda xs: (sum(xs) / len(xs)) if xs and None not in xs else None  # noqa: E731
        k_ratios = torch.cat([f.k_ratio for f in fits])
        v_ratios = torch.cat([f.v_ratio for f in fits])
        edges = sum(int((f.k_edge | f.v_edge).sum()) for f in fits if f.k_edge is not None)
        return {
            "key_objective": self.key_objective,
            "key_error": {"fitted": k_fit, "global_0.96": mean([at(f, "k", 0.96) for f in fits]),
                          "no_clip": mean([at(f, "k", 1.0) for f in fits])},
            "value_rel_out_err": {"fitted": v_fit, "global_0.92": mean([at(f, "v", 0.92) for f in fits]),
                                  "no_clip": mean([at(f, "v", 1.0) for f in fits])},
            "k_clip_ratio_mean": float(k_ratios.mean()),
            "v_clip_ratio_mean": float(v_ratios.mean()),
            "k_clip_ratio_min": float(k_ratios.min()),
            "v_clip_ratio_min": float(v_ratios.min()),
            "clip_at_grid_edge": edges,
            "alternatives": self.comparison,
            "hadamard_key_heads": {str(k): v for k, v in self.hadamard_key_heads.items()},
        }


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
    device = input_device(model)
    with capturing(model, session):
        for start in range(0, ids.shape[0], batch_size):
            batch = ids[start:start + batch_size].to(device)
            forward_batch(model, batch, session)
            if progress is not None:
                progress(batch.numel(), ids.numel())


def _solve_all(session: CaptureSession, layer_ids: list[int], settings: SolverSettings, value_target: str,
               granularity: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    key_targets = torch.stack([session.stats[i].key_target().cpu() for i in layer_ids])
    value_targets = torch.stack([session.stats[i].value_target(value_target).cpu() for i in layer_ids])
    k_rot, k_eig = solve_rotations(key_targets, granularity)
    v_rot, v_eig = solve_rotations(value_targets, granularity)
    return k_rot, k_eig, v_rot, v_eig


def session_means(session: CaptureSession, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibrated key and value means `[A, H_kv, d]` float32 (model basis, post-RoPE keys)."""
    k = torch.stack([session.stats[i].key_mean().cpu() for i in layer_ids]).float()
    v = torch.stack([session.stats[i].value_mean().cpu() for i in layer_ids]).float()
    return k, v


def o_proj_weights(model, layer_ids: list[int]) -> dict[int, torch.Tensor] | None:
    """Layer -> o_proj weight `[hidden, H_q * d]` (for the `block_out` clip objective), or None if not found."""
    from oscar_calib.calibration.capture import decoder_of

    try:
        layers = decoder_of(model).layers
        return {i: _materialized_weight(layers[i].self_attn.o_proj) for i in layer_ids}
    except (AttributeError, IndexError, TypeError, KeyError):
        return None


def _materialized_weight(linear: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight; for a layer accelerate offloaded (weight on `meta`), the offloaded copy."""
    w = linear.weight
    if w.device.type == "meta":  # accelerate keeps offloaded parameters in its hook's weights_map
        w = linear._hf_hook.weights_map["weight"]
    return w.detach()


def _own_rms(statistics, layer_ids: list[int]) -> dict[str, list[list[float]]]:
    """Root mean square norm of the held-out keys and values per (layer, KV head), model basis (rotations keep
    norms): {"k": [A][H], "v": [A][H]}, 6 significant digits (`runtime_kernels.contract.OWN_RMS_KEY`)."""
    out: dict[str, list[list[float]]] = {"k": [], "v": []}
    for layer in layer_ids:
        keys, values, _, _ = statistics.holdout[layer].stacked()  # [S, H, T, d]
        for side, x in (("k", keys), ("v", values)):
            rms = x.double().pow(2).sum(-1).mean(dim=(0, 2)).sqrt()  # [H]
            out[side].append([float(f"{max(float(r), 1e-30):.6g}") for r in rms])
    return out


def _fit_all(session: CaptureSession, layer_ids: list[int], k_rot, v_rot, settings: SolverSettings,
             no_clip: bool = False, means: tuple[torch.Tensor, torch.Tensor] | None = None,
             o_weights: dict[int, torch.Tensor] | None = None,
             tick: Callable[[], None] | None = None) -> dict[int, ClipFit]:
    """Clip fit of every layer; `means` `([A, H_kv, d], [A, H_kv, d])` for a centered cache (None = uncentered).
    `no_clip` or `settings.clip` False: every ratio 1 (no clipping), the grids unsearched.

    `tick` is called once per layer (progress)."""
    no_clip = no_clip or not settings.clip
    fmt = settings.kv_format
    fits = {}
    for a, layer in enumerate(layer_ids):
        if tick is not None:
            tick()
        keys, values, queries, positions = session.holdout[layer].stacked()
        dev = keys.device
        k_mean = means[0][a].to(dev) if means is not None and fmt.centered else None
        v_mean = means[1][a].to(dev) if means is not None and fmt.centered else None
        w_o = o_weights.get(layer).to(dev) if o_weights and settings.key_clip_objective == "block_out" else None
        fits[layer] = fit_layer(keys, values, queries, positions, k_rot[a].to(dev), v_rot[a].to(dev),
                                (1.0,) if no_clip else settings.k_clip_grid, session.scaling, fmt,
                                key_objective=settings.key_clip_objective,
                                v_grid=(1.0,) if no_clip else settings.v_clip_grid, k_mean=k_mean, v_mean=v_mean,
                                o_weight=w_o, extend=not no_clip)
        if not (bool(torch.isfinite(fits[layer].k_errors).all()) and bool(torch.isfinite(fits[layer].v_errors).all())):
            # fp32 overflow would make every ratio 1.0 without a word; the statistics checks bound the inputs
            raise InputError(f"clip fit of layer {layer}: the held-out errors are not finite (held-out rows or o_proj "
                             "weights beyond what the fit's float32 arithmetic holds); expected the statistics of a "
                             "real capture")
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
    """Calibrate `model` on token ids: `capture_statistics`, then `artifact_from_statistics`.

    Args:
        input_ids: `[N, T]` int64 sequences for the statistics.
        holdout_ids: `[S, T']` sequences for fitting clip ratios (default: the last row of input_ids, which
            is then excluded from the statistics when N > 1).
    Returns:
        (artifact, report). The artifact validates against contract v2.
    """
    settings = settings or SolverSettings()
    _check_group_size(settings, model_geometry(model.config)[3])
    check_holdout_length(settings, (holdout_ids if holdout_ids is not None else input_ids).shape[1])
    statistics = capture_statistics(model, input_ids, holdout_ids, batch_size=batch_size,
                                    holdout_queries=holdout_queries, seed=seed, progress=progress, model_id=model_id,
                                    model_revision=model_revision, calibration_meta=calibration_meta)
    return artifact_from_statistics(statistics, settings, compare_alternatives=compare_alternatives,
                                    fit_progress=fit_progress)


def check_holdout_length(settings: SolverSettings, held_len: int) -> None:
    """Refuse a held-out sequence no longer than the BF16 windows: no held-out query would read an INT2 key."""
    fmt = settings.kv_format
    windows = fmt.window_tokens
    if held_len <= windows:
        raise InputError(
            f"--holdout-len {held_len}: the held-out sequence must be longer than the BF16 windows (sink "
            f"{fmt.sink_tokens} + recent {fmt.recent_tokens} = {windows} tokens), or no held-out query "
            f"reads an INT2 key and the clip fit has nothing to score; use --holdout-len {windows + 64} or more, or "
            "smaller --sink / --recent")


def _check_group_size(settings: SolverSettings, d: int) -> None:
    try:
        settings.kv_format.group(d)
    except KVFormatError as exc:
        raise InputError(f"--group-size {settings.kv_format.group_size}: {str(exc).split(': ', 1)[1]}") from None


def capture_statistics(model, input_ids: torch.Tensor, holdout_ids: torch.Tensor | None = None, *,
                       batch_size: int = 1, holdout_queries: int = 256, seed: int = 0,
                       progress: ProgressFn | None = None, model_id: str | None = None,
                       model_revision: str | None = None, calibration_meta: dict | None = None,
                       accumulate: AccumulateFn | None = None,
                       sample_ranges: list[list[int]] | None = None) -> CalibrationStatistics | None:
    """Run the model over the calibration and held-out sequences and return their statistics.

    Args:
        input_ids: `[N, T]` int64 sequences for the sums; holdout_ids `[S, T']` (default as in
            `calibrate_model_with_report`).
        accumulate: runs the statistics pass, `(model, session, input_ids, progress) -> {layer: LayerStats}`, or
            None on a data-parallel rank other than 0 (default: every batch in order in this process).
        sample_ranges: which samples of the data set `input_ids` are (recorded in the provenance; default all).
    Returns:
        the statistics (held-out capture included), or None where `accumulate` returned None.
    """
    config = model.config
    check_supported(config)
    n_layers, h_q, h_kv, d = model_geometry(config)
    if holdout_ids is None:
        if input_ids.shape[0] > 1:
            input_ids, holdout_ids = input_ids[:-1], input_ids[-1:]
        else:
            holdout_ids = input_ids
    skip = sliding_window_layers(config)
    session = CaptureSession(skip_layers=skip)
    t0 = time.perf_counter()
    if accumulate is None:
        _run_capture(model, session, input_ids, batch_size, progress)
        totals = session.stats
    else:
        totals = accumulate(model, session, input_ids, progress)
        if totals is None:
            return None
    session.stats = totals
    session.mode = "holdout"
    session.query_positions = _holdout_positions(holdout_ids.shape[1], holdout_queries, seed)
    _run_capture(model, session, holdout_ids, batch_size, progress)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0

    if not session.stats:
        raise CaptureError(
            f"model {type(model).__name__}: no full-attention layer reported to the capture function "
            f"({session.calls} attention calls seen, {len(skip)} sliding-window layers skipped); its attention "
            "does not go through transformers' AttentionInterface or every layer is sliding-window")
    if session.geometry != (h_q, h_kv, d):
        raise CaptureError(f"captured geometry (H_q, H_kv, d) = {session.geometry} differs from the config's "
                           f"{(h_q, h_kv, d)}")
    provenance = make_provenance(config, model.dtype, model_id=model_id, model_revision=model_revision,
                                 calibration_meta=calibration_meta, batch_size=batch_size,
                                 holdout_queries=holdout_queries, seed=seed,
                                 sample_ranges=sample_ranges or [[0, int(input_ids.shape[0])]],
                                 skipped_layers=sorted(skip), created=created_at(),
                                 sample_digests=sample_digests(input_ids))
    o_weights = o_proj_weights(model, sorted(session.stats))
    if o_weights and any(w.device.type == "meta" for w in o_weights.values()):
        o_weights = None  # offloaded to disk: not in memory here (the block_out fit then says so)
    return CalibrationStatistics(session.stats, session.holdout, session.scaling, provenance,
                                 timings={"forward_capture_s": capture_s}, o_weights=o_weights)


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Run CPU ops single-threaded: LAPACK's eigh and fp64 matmuls block their sums by thread count, so the
    rotations' last bits would otherwise depend on the machine (measured: 1 ulp on the tiny-qwen3 fixture).
    The solve is `A x H_kv` eigendecompositions of `d x d`, cheap on one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def artifact_from_statistics(statistics: CalibrationStatistics, settings: SolverSettings | None = None, *,
                             compare_alternatives: bool = True, device: torch.device | str | None = None,
                             fit_progress: StepFn | None = None) -> tuple[OscarArtifact, CalibrationReport]:
    """Solve rotations and fit clip ratios from statistics (no model): the one path of `run` and `refit`.

    Args:
        device: where the held-out clip fit runs (default: where the held-out capture already is). The same
            statistics and settings on the same kind of device give the same bytes.
        fit_progress: called `(what, layers done, layers in total)` as the clip fits (and the comparison of
            alternatives) go.
    """
    settings = settings or SolverSettings()
    prov = statistics.provenance
    h_q, h_kv, d = statistics.geometry
    _check_group_size(settings, d)
    layer_ids = statistics.layer_ids
    if not statistics.holdout:
        raise InputError("statistics have no held-out capture (keys, values, queries of the held-out sequences); "
                         "the clip fit needs it: use the statistics file written by `oscar-calib run`")
    session = statistics.holdout_on(device) if device is not None else statistics
    timings = dict(statistics.timings)

    t0 = time.perf_counter()
    # One clip fit pass per layer, plus five per layer for the alternatives compared (3 variants, Hadamard, none).
    total, done = len(layer_ids) * (6 if compare_alternatives else 1), [0]

    def tick(what: str) -> Callable[[], None]:
        def step() -> None:
            if fit_progress is not None:
                fit_progress(what, done[0], total)
            done[0] += 1
        return step

    with one_cpu_thread():  # the same bits whatever the thread count (torchrun sets OMP_NUM_THREADS=1 per rank)
        k_rot, k_eig, v_rot, v_eig = _solve_all(session, layer_ids, settings, settings.value_target,
                                                settings.granularity)
    masses, key_hadamard = history_hadamard_keys(session, layer_ids, settings)
    k_rot = with_hadamard_keys(k_rot, layer_ids, key_hadamard)
    means = session_means(session, layer_ids)
    o_weights = statistics.o_weights if settings.key_clip_objective == "block_out" else None
    if settings.key_clip_objective == "block_out" and o_weights is None:
        raise InputError("--key-objective block_out: the statistics hold no o_proj weights (the model has no "
                         "`self_attn.o_proj` in its decoder layers); use --key-objective out_err")
    fits = _fit_all(session, layer_ids, k_rot, v_rot, settings, means=means, o_weights=o_weights,
                    tick=tick("clip fit"))
    comparison = {}
    if compare_alternatives:
        comparison = _compare_alternatives(session, layer_ids, settings, fits, masses, means, o_weights,
                                           tick("alternatives"))
    if fit_progress is not None:
        fit_progress("done", total, total)
    timings["solve_s"] = time.perf_counter() - t0

    k_ratio = torch.stack([fits[i].k_ratio for i in layer_ids])
    v_ratio = torch.stack([fits[i].v_ratio for i in layer_ids])
    holdout_tokens = int(statistics.holdout[layer_ids[0]].stacked()[0][:, 0, :, 0].numel())
    calib = dict(prov.data)
    samples = prov.data.get("samples")
    if samples is not None and prov.sample_ranges != [[0, samples]]:  # a shard or a partial merge says so
        calib["sample_ranges"] = prov.sample_ranges
        calib["tokens"] = statistics.tokens
    calib.setdefault("tokens", statistics.tokens)
    calib.setdefault("holdout_tokens", holdout_tokens)
    calib["solver"] = json.loads(settings.model_dump_json())
    calib["clip_fit"] = {"grid_extends": True, "min_ratio": MIN_RATIO}  # audit reads where a fit could stop
    calib["kv_rms"] = _own_rms(statistics, layer_ids)  # the contract bounds the means by it (OWN_RMS_RATIO)
    calib["key_basis"] = {"hadamard_heads": {str(i): hs for i, hs in key_hadamard.items()},
                          "hadamard_key_mass": settings.hadamard_key_mass,
                          "history_mass": {str(i): [round(float(x), 4) for x in m] for i, m in masses.items()
                                           if m is not None}}
    # Contract v2 means (model basis, `mean_basis=original`); zeros = that side is not centered.
    k_mean = (means[0] if settings.kv_format.centered else torch.zeros_like(means[0])).contiguous()
    v_mean = (means[1] if settings.kv_format.centered else torch.zeros_like(means[1])).contiguous()
    # The format recorded is the one fitted; centered as the runtime will serve it: when a mean is non-zero.
    fmt = settings.kv_format.with_(centered=bool(k_mean.any() or v_mean.any()))
    meta = build_metadata(
        model_id=prov.model_id, model_revision=prov.model_revision,
        num_attention_heads=h_q, num_key_value_heads=h_kv, head_dim=d, granularity=settings.granularity,
        key_target=settings.key_target, value_target=settings.value_target, calibration=calib,
        tool_version=f"oscar-calib {__version__}", fmt=fmt)
    if prov.created_at:  # a refit keeps the capture's timestamp, so it reproduces the run's bytes
        meta["created_at"] = prov.created_at
    artifact = OscarArtifact(
        layer_ids=torch.tensor(layer_ids, dtype=torch.int64),
        k_rotation=k_rot, v_rotation=v_rot, k_clip_ratio=k_ratio.float(), v_clip_ratio=v_ratio.float(),
        k_eigenvalues=k_eig, v_eigenvalues=v_eig, metadata=meta, source="<calibration>", k_mean=k_mean, v_mean=v_mean,
    ).validate()
    report = CalibrationReport(layer_ids=layer_ids, skipped_layers=list(prov.skipped_layers), tokens=statistics.tokens,
                               holdout_tokens=holdout_tokens, timings=timings, fits=fits,
                               k_grid=settings.k_clip_grid, v_grid=settings.v_clip_grid, comparison=comparison,
                               means=means,
                               key_objective=settings.key_clip_objective, hadamard_key_heads=key_hadamard)
    return artifact, report


def history_masses(session, layer_ids: list[int], sink: int, recent: int) -> dict[int, torch.Tensor | None]:
    """Each layer's held-out history mass `{layer: [H_kv] or None}` (key_basis) under windows sink / recent."""
    masses = {}
    for layer in layer_ids:
        keys, _, queries, positions = session.holdout[layer].stacked()
        masses[layer] = holdout_history_mass(keys, queries, positions, session.scaling, sink, recent)
    return masses


def history_hadamard_keys(session, layer_ids: list[int], settings: SolverSettings
                          ) -> tuple[dict[int, torch.Tensor | None], dict[int, list[int]]]:
    """The history masses under the settings' windows and the KV heads whose keys take the Hadamard rotation (mass
    above `settings.hadamard_key_mass`, `{layer: [heads]}`; whole layers at `granularity` "layer"); neither is
    computed when it is 1."""
    if settings.hadamard_key_mass >= 1.0:
        return {}, {}
    masses = history_masses(session, layer_ids, settings.kv_format.sink_tokens, settings.kv_format.recent_tokens)
    return masses, hadamard_key_heads(masses, settings.hadamard_key_mass, settings.granularity)


def with_hadamard_keys(k_rot: torch.Tensor, layer_ids: list[int], heads: dict[int, list[int]]) -> torch.Tensor:
    """`k_rot` `[A, H_kv, d, d]` with the KV heads `heads[layer]` rotated by the normalised Hadamard matrix."""
    if not heads:
        return k_rot
    from oscar_calib.calibration.solve import hadamard

    out = k_rot.clone()
    h = hadamard(k_rot.shape[-1]).to(k_rot.dtype)
    for layer, hs in heads.items():
        out[layer_ids.index(layer), hs] = h
    return out


def _compare_alternatives(session, layer_ids, settings: SolverSettings, chosen: dict[int, ClipFit],
                          masses: dict[int, torch.Tensor | None], means=None, o_weights=None,
                          tick: Callable[[], None] | None = None) -> dict:
    """Held-out errors (best clip per head) of the other value target and granularity, for the record.

    This is how the defaults were decided: the alternative with the lower attention-aware error wins. Each
    alternative's keys follow the same key-basis rule as the chosen rotations (the history `masses`, at its own
    granularity), so a row differs from the chosen one only in what its name says.
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
            k_rot = with_hadamard_keys(k_rot, layer_ids, hadamard_key_heads(masses, settings.hadamard_key_mass, gran))
            fits = _fit_all(session, layer_ids, k_rot, v_rot, settings, means=means, o_weights=o_weights, tick=tick)
            out[name] = {"key": best(fits, "k"), "value": best(fits, "v")}
    # Baseline without the eigen-basis (Hadamard only) for context.
    from oscar_calib.calibration.solve import hadamard

    h_kv, d = session.stats[layer_ids[0]].key_sum.shape[:2]
    had = hadamard(d).float().expand(len(layer_ids), h_kv, d, d)
    fits = _fit_all(session, layer_ids, had, had, settings, means=means, o_weights=o_weights, tick=tick)
    out["hadamard_only"] = {"key": best(fits, "k"), "value": best(fits, "v")}
    eye = torch.eye(d).expand(len(layer_ids), h_kv, d, d)
    fits = _fit_all(session, layer_ids, eye, eye, settings.model_copy(
                    update={"kv_format": settings.kv_format.with_(centered=False)}), no_clip=True, o_weights=o_weights, tick=tick)
    out["no_rotation_no_clip"] = {"key": best(fits, "k"), "value": best(fits, "v")}
    return out


def calibrate_model(model, input_ids: torch.Tensor, settings: SolverSettings | None = None, **kwargs) -> OscarArtifact:
    """`calibrate_model_with_report` without the report. input_ids `[N, T]`."""
    return calibrate_model_with_report(model, input_ids, settings, **kwargs)[0]
