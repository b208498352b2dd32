"""Figures of an audit report (`oscar_calib.analysis.audit.audit_artifact`): heatmaps per metric family and one summary.

Panels meant to be compared (keys before / after the rotation; naive / Hadamard / OSCAR error) share one
colour scale, so the same colour means the same value across them. Cells carry their value when they are
large enough to read. `summary.png` answers "which heads are bad and why": a layer x KV head map of the
flags, and the worst heads' INT2 errors next to the alternatives (or their spectra without activations).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

# Words for the report's field names (titles and axis labels never show raw keys).
LABELS = {
    "k_clip": "key clip ratio", "v_clip": "value clip ratio",
    "k_top1_share": "key spectrum: top eigenvalue share", "v_top1_share": "value spectrum: top eigenvalue share",
    "k_effective_rank": "key spectrum: effective rank", "v_effective_rank": "value spectrum: effective rank",
    "k_kurtosis_before": "keys, before rotation", "k_kurtosis_after": "keys, after rotation",
    "v_kurtosis_before": "values, before rotation", "v_kurtosis_after": "values, after rotation",
    "k_channel_ratio_before": "keys, before rotation", "k_channel_ratio_after": "keys, after rotation",
    "v_channel_ratio_before": "values, before rotation", "v_channel_ratio_after": "values, after rotation",
    "k_err_naive": "keys: no rotation", "k_err_hadamard": "keys: Hadamard", "k_err_oscar": "keys: OSCAR",
    "v_err_naive": "values: no rotation", "v_err_hadamard": "values: Hadamard", "v_err_oscar": "values: OSCAR",
}
# Short cell labels for flags (summary map).
FLAG_WORDS = {
    "nan": "NaN", "non-orthogonal-k": "K not orth.", "non-orthogonal-v": "V not orth.",
    "degenerate-spectrum-k": "K flat spectrum", "degenerate-spectrum-v": "V flat spectrum",
    "clip-at-grid-edge-k": "K clip at edge", "clip-at-grid-edge-v": "V clip at edge",
    "oscar-worse-than-hadamard-k": "K worse than Had.", "oscar-worse-than-hadamard-v": "V worse than Had.",
}
MAX_ANNOTATED_CELLS = 400  # beyond this the numbers are unreadable at any sensible figure size


@dataclass(frozen=True)
class Family:
    """One PNG: rows of panels; the panels of one row share a colour scale (labelled `colorbars[row]`)."""

    name: str
    title: str
    colorbars: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    log: bool = False


FAMILIES = (
    Family("clip_ratios", "Fitted clip ratios (1 = no clipping)", ("clip ratio",), (("k_clip", "v_clip"),)),
    Family("spectrum", "How concentrated the calibration targets are", ("share of the trace", "effective rank"),
           (("k_top1_share", "v_top1_share"), ("k_effective_rank", "v_effective_rank"))),
    Family("kurtosis", "Outliers: kurtosis of the entries (3 = Gaussian)", ("kurtosis", "kurtosis"),
           (("k_kurtosis_before", "k_kurtosis_after"), ("v_kurtosis_before", "v_kurtosis_after")), log=True),
    Family("channel_ratio", "Outlier channels: max / median channel RMS", ("max / median", "max / median"),
           (("k_channel_ratio_before", "k_channel_ratio_after"), ("v_channel_ratio_before", "v_channel_ratio_after")),
           log=True),
    Family("quant_error", "INT2 error per head (keys: relative logit error; values: relative error)",
           ("key relative logit error", "value relative error"), (("k_err_naive", "k_err_hadamard", "k_err_oscar"),
                              ("v_err_naive", "v_err_hadamard", "v_err_oscar")), log=True),
)


def _grid(rows: list[dict], key: str, layers: list[int], heads: list[int]):
    """`[len(layers), len(heads)]` array of `key` (NaN where a head has no value)."""
    import numpy as np

    grid = np.full((len(layers), len(heads)), np.nan)
    for r in rows:
        value = r.get(key)
        if isinstance(value, (int, float)):
            grid[layers.index(r["layer"]), heads.index(r["head"])] = value
    return grid


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf"
    if 100 <= abs(value) < 1e5:  # whole numbers read better than '1.1e+02' in a cell or on a colour bar
        return f"{value:.0f}"
    return f"{value:.2g}" if abs(value) < 0.01 or abs(value) >= 1e5 else f"{value:.3g}"


def _annotate(ax, grid, norm, cmap) -> None:
    """Write each cell's value in black or white, whichever reads on the cell's colour."""
    if grid.size > MAX_ANNOTATED_CELLS:
        return
    size = 7 if grid.size <= 64 else 5
    for (i, j), value in _cells(grid):
        if math.isnan(value):
            continue
        r, g, b, _ = cmap(norm(value)) if math.isfinite(value) else (1, 1, 1, 1)
        colour = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
        ax.text(j, i, _fmt(value), ha="center", va="center", fontsize=size, color=colour)


def _cells(grid):
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            yield (i, j), float(grid[i, j])


def _norm(grids, log: bool):
    """One colour scale for all of `grids` (finite values; log only when every value is positive)."""
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize

    values = np.concatenate([g[np.isfinite(g)].ravel() for g in grids]) if grids else np.array([])
    if values.size == 0:
        return Normalize(0, 1)
    lo, hi = float(values.min()), float(values.max())
    if log and lo > 0 and hi / lo > 10:
        return LogNorm(lo, hi)
    if hi == lo:
        hi = lo + (abs(lo) * 1e-3 or 1.0)
    return Normalize(lo, hi)


def _plain_log_ticks(axis) -> None:
    """Log-axis tick labels as plain numbers (0.02, 0.1, 0.4) instead of mathtext powers (2 x 10^-2); which
    ticks get a label stays matplotlib's choice."""
    from matplotlib.ticker import LogFormatterSciNotation

    class Plain(LogFormatterSciNotation):
        def __call__(self, x, pos=None):
            return _fmt(x) if super().__call__(x, pos) else ""

    axis.set_major_formatter(Plain())
    axis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 1)))  # some in-between labels up to
    # two decades (matplotlib's default stops at one, leaving only 0.01 and 0.1 on a 0.01-0.5 axis)


def _axes_labels(ax, layers: list[int], heads: list[int], left: bool) -> None:
    ax.set_xticks(range(len(heads)), heads, fontsize=7)
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ax.set_xlabel("KV head")
    if left:
        ax.set_ylabel("layer")


def _family_figure(family: Family, report: dict, layers: list[int], heads: list[int]):
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    rows = report["heads"]
    kept = [(row, tuple(k for k in row if any(k in r for r in rows))) for row in family.rows]
    kept = [(row, keys) for row, keys in kept if keys]
    present = [keys for _, keys in kept]
    if not present:
        return None
    cols = max(len(row) for row in present)
    cell_w, cell_h = max(0.45, 3.0 / max(len(heads), 1)), 0.32
    fig, axes = plt.subplots(len(present), cols, squeeze=False, layout="constrained",
                             figsize=(cols * (cell_w * len(heads) + 1.2) + 1.4,
                                      len(present) * (cell_h * len(layers) + 1.3) + 0.8))
    cmap = plt.get_cmap("viridis")
    for i, (row, keys) in enumerate(kept):
        grids = [_grid(rows, k, layers, heads) for k in keys]
        norm = _norm(grids, family.log)
        image = None
        for j, (key, grid) in enumerate(zip(keys, grids)):
            ax = axes[i, j]
            image = ax.imshow(grid, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
            _annotate(ax, grid, norm, cmap)
            ax.set_title(LABELS.get(key, key), fontsize=9)
            _axes_labels(ax, layers, heads, left=j == 0)
            if i < len(present) - 1:
                ax.set_xlabel("")
        for ax in axes[i, len(keys):]:
            ax.axis("off")
        bar = fig.colorbar(image, ax=list(axes[i, :len(keys)]), label=family.colorbars[family.rows.index(row)],
                           shrink=0.9)
        if isinstance(norm, LogNorm):
            _plain_log_ticks(bar.ax.yaxis)
    fig.suptitle(f"{family.title}\n{_artifact_name(report)}", fontsize=10)
    return fig


def _artifact_name(report: dict) -> str:
    path = Path(str(report.get("artifact", "")))
    name = path.parent.name if path.name.endswith(".safetensors") else path.name
    return f"{name} ({report.get('model_id')}, {report.get('granularity')} rotations)"


def _summary_figure(report: dict, layers: list[int], heads: list[int], worst: int = 8):
    """Left: flags per (layer, KV head), named in the cells. Right: the worst heads and why."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap

    rows = report["heads"]
    flags = np.zeros((len(layers), len(heads)))
    words: dict[tuple[int, int], list[str]] = {}
    for r in rows:
        i, j = layers.index(r["layer"]), heads.index(r["head"])
        flags[i, j] = len(r["flags"])
        words[(i, j)] = [FLAG_WORDS.get(f, f) for f in r["flags"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(6.0, 1.1 * len(heads) + 2) + 7,
                                                     max(3.5, 0.36 * len(layers) + 2)),
                                      gridspec_kw={"width_ratios": [max(1.0, len(heads) / 4), 1.6]},
                                      layout="constrained")
    top = int(max(2, flags.max()))
    cmap = ListedColormap(["#e8f5e9"] + list(plt.get_cmap("OrRd")(np.linspace(0.35, 0.9, top))))
    norm = BoundaryNorm(np.arange(-0.5, top + 1.5), cmap.N)
    image = left.imshow(flags, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    if flags.size <= MAX_ANNOTATED_CELLS:
        for (i, j), text in words.items():
            if text:  # clean heads stay blank (green), so the flagged ones stand out
                left.text(j, i, "\n".join(text), ha="center", va="center", fontsize=6,
                          color="white" if len(text) >= 2 else "black")
    _axes_labels(left, layers, heads, left=True)
    left.set_title("flags per head (cell: why; blank = no flag)", fontsize=9)
    if not flags.any():  # an all-green map reads as "nothing drawn" without a word
        left.text(0.5, 0.5, "no head flagged", transform=left.transAxes, ha="center", va="center", fontsize=11,
                  color="#2e7d32", bbox={"facecolor": "white", "edgecolor": "#2e7d32", "boxstyle": "round"})
    fig.colorbar(image, ax=left, label="number of flags", ticks=range(top + 1),  # short on a tall map only
                 shrink=0.9 if len(layers) <= 8 else 0.6, aspect=20 if len(layers) <= 8 else 25)

    bad = rows[:worst]  # the report lists heads worst first (the audit sorts them), as its table does
    which = f"all {len(bad)} heads, worst first" if len(bad) == len(rows) else f"the {len(bad)} worst heads"
    names = [f"L{r['layer']} H{r['head']}" for r in bad]
    x = np.arange(len(bad))
    if report.get("with_activations"):
        variants = (("naive", "no rotation", "#bdbdbd"), ("hadamard", "Hadamard", "#64b5f6"),
                    ("oscar", "OSCAR", "#d84315"))
        width = 0.13
        for n, (kind, hatch) in enumerate((("k", ""), ("v", "//"))):
            for m, (variant, label, colour) in enumerate(variants):
                values = [max(r.get(f"{kind}_err_{variant}", float("nan")), 1e-12) for r in bad]
                offset = (n * 3 + m - 2.5) * width
                right.bar(x + offset, values, width, color=colour, hatch=hatch, edgecolor="black", linewidth=0.3,
                          label=f"{'keys' if kind == 'k' else 'values'}: {label}")
        right.set_yscale("log")
        _plain_log_ticks(right.yaxis)
        right.set_ylabel("INT2 relative error (log scale)")
        right.set_title(f"{which}: INT2 error against the alternatives", fontsize=9)
    else:
        width = 0.35
        right.bar(x - width / 2, [r.get("k_top1_share", float("nan")) for r in bad], width, label="keys",
                  color="#64b5f6")
        right.bar(x + width / 2, [r.get("v_top1_share", float("nan")) for r in bad], width, label="values",
                  color="#d84315")
        right.set_ylabel("top eigenvalue share of the target")
        right.set_title(f"{which}: spectrum concentration (no activations: pass --model for errors)",
                        fontsize=9)
    right.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
    right.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    total = report.get("flags_total", 0)
    contract = report.get("contract_error")
    fig.suptitle(f"Which heads are bad and why: {_artifact_name(report)}; {total} flag(s)"
                 + (f"\ncontract broken: {contract[:110]}" if contract else ""), fontsize=10)
    return fig


def write_audit_plots(report: dict, directory: str | Path) -> list[Path]:
    """`summary.png` and one PNG per metric family present in `report` into `directory`; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from runtime_kernels.atomic import write_file_atomically

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layers = sorted({r["layer"] for r in report["heads"]})
    heads = sorted({r["head"] for r in report["heads"]})
    figures = [("summary", _summary_figure(report, layers, heads))]
    figures += [(f.name, _family_figure(f, report, layers, heads)) for f in FAMILIES]
    written = []
    for name, fig in figures:
        if fig is None:
            continue
        path = directory / f"{name}.png"
        buffer = io.BytesIO()
        try:
            fig.savefig(buffer, dpi=110, bbox_inches="tight", format="png")
        finally:
            plt.close(fig)
        # Renamed into place through a fresh temporary file: an interrupted write leaves no broken PNG, and nothing
        # planted beside it is written through.
        write_file_atomically(path, buffer.getvalue(), "--plots")
        written.append(path)
    return written
