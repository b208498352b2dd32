"""Audit an OSCAR artifact per (layer, KV head): spectra, clip ratios, outliers, quantization error, flags.

From the artifact alone: orthogonality of each rotation, NaN/Inf, spectrum concentration of the key and
value targets (share of the top eigenvalue, effective rank), fitted clip ratios (and whether a ratio
sits at the lowest ratio of the calibration grid). With activations (a model and some text): outlier
measures of keys and values before and after the rotation (kurtosis, max/median channel RMS), and the
simulated INT2 error of naive (no rotation), Hadamard (no clip) and OSCAR (the artifact) per head:
keys by the relative logit error `E[(q . (k_hat - k))^2] / E[(q . k)^2]` over the head's query group,
values by the relative error `|v_hat - v|^2 / |v|^2`; and the head's history mass: the share of its queries'
attention that falls on the INT2 history under the artifact's windows (key error can only reach a query through it).

Flags: `non-orthogonal`, `nan`, `degenerate-spectrum` (non-positive top eigenvalue, negative
eigenvalues or an all-equal spectrum, which leaves the eigenbasis arbitrary), `clip-at-grid-edge` (the fitted
ratio is the lowest the fit could search: the grid's floor for artifacts whose fit extends its grid until the error
turns up, else the grid's lowest ratio),
`oscar-worse-than-hadamard` (keys or values), `contract: ...` (the artifact breaks contract v1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from oscar_calib.calibration.key_basis import history_share
from oscar_calib.errors import InputError
from oscar_calib.interception import AttentionInterception
from runtime_kernels.artifact import (
    ORTHOGONALITY_TOL,
    TENSOR_NAMES,
    ArtifactError,
    read_raw,
    validate_tensors,
)
from runtime_kernels.format import DEFAULT_FORMAT, QUANTIZERS, KVFormat
from runtime_kernels.quant import naive

AUDIT_ATTENTION = "oscar_audit"
# The audit compares rotations (naive, Hadamard, OSCAR) at one scale format, fp16, whatever the artifact
# stores: scale rounding is not what it measures. Min-max for an artifact whose quantizer the runtime does not serve
# (a codebook artifact's rotations are still compared); the group and a served quantizer are the artifact's.
AUDIT_FORMAT = DEFAULT_FORMAT.with_(scale_format="float16", quantizer="uniform_minmax")  # windows and pages unread


@dataclass
class RawArtifact:
    """Artifact tensors and metadata as stored, before (or despite) validation."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    source: str
    contract_error: str | None = None


def load_raw(path: str | Path) -> RawArtifact:
    """Read an artifact without refusing it, so that a broken one can still be audited."""
    try:
        file, tensors, metadata = read_raw(path)
    except ArtifactError as exc:
        raise InputError(f"artifact {exc}") from exc
    missing = [n for n in TENSOR_NAMES if n not in tensors]
    if missing:
        raise InputError(f"artifact {file}: field '{missing[0]}': missing tensor; nothing to audit")
    _check_auditable(tensors, str(file))
    group = metadata.get("group_size") or None
    d = tensors["k_rotation"].shape[-1]
    if group is not None and not (group.isdigit() and len(group) < 6 and int(group) > 0 and d % int(group) == 0):
        raise InputError(f"artifact {file}: field 'group_size': {group[:40]!r} cannot be audited (expected a positive "
                         f"integer dividing head_dim {d})")
    error = None
    try:
        validate_tensors(tensors, metadata, str(file))
    except ArtifactError as exc:
        error = str(exc)
    return RawArtifact(tensors, metadata, str(file), error)


def _check_auditable(tensors: dict[str, torch.Tensor], source: str) -> None:
    """The shapes the audit indexes by: a broken contract is reported, but these must hold to read per head.

    layer_ids `[A]`; rotations `[A, H, d, d]`; clip ratios `[A, H]`; eigenvalues `[A, H, d]` (A, H, d >= 1).
    """
    def shape(name: str) -> tuple[int, ...]:
        return tuple(tensors[name].shape)

    rot = shape("k_rotation")
    if len(rot) != 4 or rot[2] != rot[3] or min(rot, default=0) < 1:
        raise InputError(f"artifact {source}: field 'k_rotation': shape {list(rot)} cannot be audited "
                         "(expected [A, H, d, d] with A, H, d >= 1); run `oscar-calib audit` on a complete artifact")
    a, h, d, _ = rot
    want = {"layer_ids": (a,), "v_rotation": rot, "k_clip_ratio": (a, h), "v_clip_ratio": (a, h),
            "k_eigenvalues": (a, h, d), "v_eigenvalues": (a, h, d)}
    for name, expected in want.items():
        if shape(name) != expected:
            raise InputError(f"artifact {source}: field '{name}': shape {list(shape(name))} cannot be audited next to "
                             f"k_rotation {list(rot)} (expected {list(expected)})")


# ----------------------------------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------------------------------
def spectrum_stats(eig: torch.Tensor) -> dict[str, float]:
    """Concentration of a spectrum `[d]`: top-1 share, top-8 share, effective rank exp(entropy)."""
    e = eig.double().clamp_min(0)
    total = float(e.sum())
    if not math.isfinite(total) or total <= 0:
        return {"top1_share": float("nan"), "top8_share": float("nan"), "effective_rank": float("nan")}
    p = e / total
    s = p.sort(descending=True).values
    ent = float(-(p[p > 0] * p[p > 0].log()).sum())
    return {"top1_share": float(s[0]), "top8_share": float(s[:8].sum()), "effective_rank": math.exp(ent)}


def degenerate(eig: torch.Tensor) -> bool:
    """Non-positive top eigenvalue, clearly negative eigenvalues, or an all-equal spectrum."""
    e = eig.double()
    if not bool(torch.isfinite(e).all()):
        return True
    top = float(e.max())
    if top <= 0:
        return True
    if float(e.min()) < -1e-6 * top:
        return True
    return float(e.max() - e.min()) <= 1e-9 * top


def kurtosis(x: torch.Tensor) -> float:
    """Kurtosis `E[(x - mu)^4] / var^2` of all entries of `x` (3 for a Gaussian)."""
    x = x.double().flatten()
    c = x - x.mean()
    var = float((c ** 2).mean())
    return float((c ** 4).mean()) / var ** 2 if var > 0 else float("nan")


def channel_ratio(x: torch.Tensor) -> float:
    """max / median of per-channel RMS of `x [T, d]` (a large value means outlier channels)."""
    rms = x.double().pow(2).mean(dim=0).sqrt()
    med = float(rms.median())
    return float(rms.max()) / med if med > 0 else float("inf")


def _fq(x: torch.Tensor, rotation: torch.Tensor | None, clip: float, fmt: KVFormat,
        mean: torch.Tensor | None) -> torch.Tensor:
    """Fake-quantize rows `x [T, d]` with the runtime quantizer (rotation `[d, d]` or None), centered on `mean [d]`
    (model basis) when given: `fq(x - mean) + mean`, what a centered cache stores and reads back."""
    ratio = None if clip >= 1.0 else clip
    xc = x.float() if mean is None else x.float() - mean.float()
    out = naive.fake_quantize(xc[:, None], rotation, ratio, fmt)[:, 0].float()
    return out if mean is None else out + mean.float()


def key_logit_error(k: torch.Tensor, k_hat: torch.Tensor, q: torch.Tensor) -> float:
    """`E[(q . (k_hat - k))^2] / E[(q . k)^2]` over all (query, key) pairs. k, k_hat `[T, d]`, q `[n, d]`."""
    num = float(((q.double() @ (k_hat - k).double().T) ** 2).mean())
    den = float(((q.double() @ k.double().T) ** 2).mean())
    return num / den if den > 0 else float("nan")


def history_mass(q: torch.Tensor, k: torch.Tensor, sink: int, recent: int, max_queries: int) -> float | None:
    """Mean share of attention on the INT2 history: for a query at position p, the softmax weight (scale
    1 / sqrt(d), causal) on keys at `[sink, p + 1 - recent)`, the tokens neither window keeps.

    q `[N, G, T, d]` (a KV head's query group), k `[N, T, d]`; up to `max_queries` queries, evenly spread over the
    positions that have a history (p >= sink + recent). None when no position has one (T <= sink + recent)."""
    n, g, t, d = q.shape
    first = sink + recent
    if t <= first:
        return None
    pos = torch.arange(first, t)
    picks = torch.linspace(0, n * g * pos.numel() - 1, min(max_queries, n * g * pos.numel())).long()
    seq, rest = picks // (g * pos.numel()), picks % (g * pos.numel())
    head, p = rest // pos.numel(), pos[rest % pos.numel()]
    scores = torch.einsum("qd,qtd->qt", q[seq, head, p].double(), k[seq].double()) / math.sqrt(d)
    return float(history_share(scores, p, sink, recent).mean())


def rel_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    den = float(x.double().pow(2).sum())
    return float((x_hat.double() - x.double()).pow(2).sum()) / den if den > 0 else float("nan")


# ----------------------------------------------------------------------------------------------------------
# activations
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Activations:
    """Post-RoPE queries, keys and values per layer: q `[N, H_q, T, d]`, k/v `[N, H_kv, T, d]` (fp32, CPU)."""

    q: dict[int, torch.Tensor] = field(default_factory=dict)
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)


def _record_attention(acts: Activations, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """Routed attention function: SDPA, keeping q, k and v in `acts` (bound by `capture_activations`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    i = module.layer_idx
    for store, t in ((acts.q, query), (acts.k, key), (acts.v, value)):
        t = t.detach().float().cpu()
        store[i] = torch.cat([store[i], t]) if i in store else t
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


@torch.no_grad()
def capture_activations(model, input_ids: torch.Tensor) -> Activations:
    """Run `input_ids [N, T]` through `model` and keep every layer's post-RoPE q, k and v."""
    acts = Activations()
    with AttentionInterception(model, AUDIT_ATTENTION, partial(_record_attention, acts)):
        device = next(model.parameters()).device
        for row in input_ids:
            model(input_ids=row[None].to(device), use_cache=False)
    return acts


# ----------------------------------------------------------------------------------------------------------
# the audit
# ----------------------------------------------------------------------------------------------------------
def _clip_grid(metadata: dict[str, str], kind: str) -> list[float] | None:
    """The recorded clip grid for `kind` ("k" or "v"): `<kind>_clip_grid`, or the older shared `clip_grid`."""
    try:
        solver = json.loads(metadata.get("calibration", "{}")).get("solver", {})
        grid = solver.get(f"{kind}_clip_grid") or solver.get("clip_grid")
    except (json.JSONDecodeError, AttributeError):
        return None
    return sorted(float(x) for x in grid) if grid else None


ADVICE = {
    "clip-at-grid-edge": "the held-out error still fell at the lowest ratio searched, so the best clip is below "
                         "it: recalibrate with a lower --k-clip-grid / --v-clip-grid start (older artifacts: "
                         "recalibrate with this version, whose fit extends the grid until the error turns up); "
                         "a fit that reaches the floor means extreme outliers: inspect the head with --plots",
    "oscar-worse-than-hadamard": "the fitted rotation quantizes this head worse than a plain Hadamard: check the "
                                 "calibration data is like the serving data, or use --granularity layer",
    "degenerate-spectrum": "the target's spectrum is flat or non-positive, so the eigenbasis is arbitrary: the "
                           "head saw too few tokens; calibrate on more data",
    "non-orthogonal": "the rotation is not orthogonal: the artifact is corrupt; recalibrate",
    "nan": "the artifact holds NaN/Inf: recalibrate (and check the model's activations)",
}


def _search_floor(metadata: dict[str, str], grid: list[float] | None) -> float | None:
    """The lowest ratio the fit could choose: the extension floor when the fit extends its grid, else the grid's."""
    try:
        fit = json.loads(metadata.get("calibration", "{}")).get("clip_fit") or {}
    except (json.JSONDecodeError, AttributeError):
        fit = {}
    if fit.get("grid_extends"):
        return float(fit.get("min_ratio", 0.5))
    return grid[0] if grid and len(grid) > 1 else None


def _windows(metadata: dict[str, str]) -> tuple[int, int] | None:
    """(sink, recent) tokens the artifact's format keeps at full precision; None where it records none."""
    try:
        return int(metadata["sink_tokens"]), int(metadata["recent_tokens"])
    except (KeyError, ValueError):
        return None


def _head_means(raw: RawArtifact, a: int, h: int, rk: torch.Tensor, rv: torch.Tensor):
    """(key mean, value mean) `[d]` of one head in the model basis, or None where the artifact has none (v1/zero)."""
    out = []
    for name, r in (("k_mean", rk), ("v_mean", rv)):
        m = raw.tensors.get(name)
        if m is None or not bool(m[a, h].any()):
            out.append(None)
            continue
        m = m[a, h].float()
        out.append(m @ r.T if raw.metadata.get("mean_basis") == "rotated" else m)  # rotated: mu = mu_rot R^T
    return tuple(out)


def audit_artifact(raw: RawArtifact, acts: Activations | None = None, max_queries: int = 256) -> dict:
    """Per-(layer, KV head) report, worst first. Returns a JSON-ready dict."""
    t = raw.tensors
    layer_ids = t["layer_ids"].tolist()
    h_kv, d = t["k_rotation"].shape[1], t["k_rotation"].shape[-1]
    group = int(raw.metadata.get("group_size", d) or d)
    quantizer = raw.metadata.get("quantizer")
    fmt = AUDIT_FORMAT.with_(group_size=group, quantizer=quantizer if quantizer in QUANTIZERS else None)
    grids = {"k": _clip_grid(raw.metadata, "k"), "v": _clip_grid(raw.metadata, "v")}
    windows = _windows(raw.metadata)
    floors = {kind: _search_floor(raw.metadata, grid) for kind, grid in grids.items()}
    had = None
    if acts is not None:
        from oscar_calib.analysis.methods import hadamard

        had = hadamard(d).float()
    eye = torch.eye(d)
    heads = []
    for a, layer in enumerate(layer_ids):
        for h in range(h_kv):
            rk, rv = t["k_rotation"][a, h].float(), t["v_rotation"][a, h].float()
            ck, cv = float(t["k_clip_ratio"][a, h]), float(t["v_clip_ratio"][a, h])
            ek, evl = t["k_eigenvalues"][a, h], t["v_eigenvalues"][a, h]
            row: dict = {"layer": int(layer), "head": h, "k_clip": ck, "v_clip": cv, "flags": []}
            for name, r in (("k", rk), ("v", rv)):
                err = float((r @ r.T - eye).abs().max()) if bool(torch.isfinite(r).all()) else float("nan")
                row[f"{name}_orth_err"] = err
                if not err <= ORTHOGONALITY_TOL:
                    row["flags"].append(f"non-orthogonal-{name}")
            finite = all(bool(torch.isfinite(x).all()) for x in (rk, rv, ek, evl, t["k_clip_ratio"][a, h],
                                                                  t["v_clip_ratio"][a, h]))
            if not finite:
                row["flags"].append("nan")
            for name, e in (("k", ek), ("v", evl)):
                row.update({f"{name}_{key}": val for key, val in spectrum_stats(e).items()})
                if degenerate(e):
                    row["flags"].append(f"degenerate-spectrum-{name}")
            for name, c in (("k", ck), ("v", cv)):
                if floors[name] is not None and c <= floors[name] + 1e-6:
                    row["flags"].append(f"clip-at-grid-edge-{name}")
            if acts is not None and layer in acts.k and finite:
                _activation_stats(row, acts, layer, h, h_kv, rk, rv, ck, cv, had, fmt, max_queries,
                                  _head_means(raw, a, h, rk, rv))
            if acts is not None and layer in acts.k and windows is not None:
                g = acts.q[layer].shape[1] // h_kv
                row["history_mass"] = history_mass(acts.q[layer][:, h * g:(h + 1) * g], acts.k[layer][:, h],
                                                   *windows, max_queries)
            heads.append(row)
    heads.sort(key=_badness, reverse=True)
    return {"artifact": raw.source, "model_id": raw.metadata.get("model_id"),
            "granularity": raw.metadata.get("granularity"), "contract_error": raw.contract_error,
            "clip_grid": grids, "clip_search_floor": floors, "with_activations": acts is not None, "heads": heads,
            "advice": {kind: text for kind, text in ADVICE.items()
                       if any(f.startswith(kind) for r in heads for f in r["flags"])},
            "flags_total": sum(len(r["flags"]) for r in heads) + (1 if raw.contract_error else 0)}


def _activation_stats(row, acts, layer, h, h_kv, rk, rv, ck, cv, had, fmt: KVFormat, max_queries,
                      means=(None, None)) -> None:
    """Per-head activation statistics; the errors of every rotation use one format `fmt` (the artifact's group and
    quantizer, AUDIT_FORMAT's scales), so that the comparison is of rotations alone."""
    k = acts.k[layer][:, h].reshape(-1, rk.shape[0])  # [N*T, d]
    v = acts.v[layer][:, h].reshape(-1, rk.shape[0])
    q_all = acts.q[layer]
    g = q_all.shape[1] // h_kv
    q = q_all[:, h * g:(h + 1) * g].transpose(1, 2).reshape(-1, rk.shape[0])  # [N*T*g, d]
    q = q[torch.linspace(0, q.shape[0] - 1, min(max_queries, q.shape[0])).long()]
    for name, x, r in (("k", k, rk), ("v", v, rv)):
        xr = x @ r
        row[f"{name}_kurtosis_before"] = kurtosis(x)
        row[f"{name}_kurtosis_after"] = kurtosis(xr)
        row[f"{name}_channel_ratio_before"] = channel_ratio(x)
        row[f"{name}_channel_ratio_after"] = channel_ratio(xr)
    variants = {"naive": (None, None, 1.0, 1.0), "hadamard": (had, had, 1.0, 1.0), "oscar": (rk, rv, ck, cv)}
    for vname, (r_k, r_v, c_k, c_v) in variants.items():
        m_k, m_v = means if vname == "oscar" else (None, None)  # the artifact's centering applies to OSCAR only
        row[f"k_err_{vname}"] = key_logit_error(k, _fq(k, r_k, c_k, fmt, m_k), q)
        row[f"v_err_{vname}"] = rel_error(v, _fq(v, r_v, c_v, fmt, m_v))
    for name in ("k", "v"):
        if row[f"{name}_err_oscar"] > row[f"{name}_err_hadamard"]:
            row["flags"].append(f"oscar-worse-than-hadamard-{name}")


def _badness(row: dict) -> tuple:
    """Sort key: broken before merely weak, then by OSCAR's error (keys + values) or the clip ratios."""
    severe = sum(1 for f in row["flags"] if f.startswith(("nan", "non-orth", "degenerate")))
    err = row.get("k_err_oscar", 0.0) + row.get("v_err_oscar", 0.0)
    err = err if math.isfinite(err) else float("inf")
    return (severe, len(row["flags"]), err, -min(row["k_clip"], row["v_clip"]))


def write_heatmaps(report: dict, directory: str | Path) -> list[Path]:
    """The audit figures (`oscar_calib.analysis.audit_plots.write_audit_plots`): summary plus one PNG per family."""
    from oscar_calib.analysis.audit_plots import write_audit_plots

    return write_audit_plots(report, directory)


__all__ = [
    "Activations",
    "RawArtifact",
    "audit_artifact",
    "capture_activations",
    "channel_ratio",
    "degenerate",
    "key_logit_error",
    "kurtosis",
    "load_raw",
    "rel_error",
    "spectrum_stats",
    "write_heatmaps",
]
