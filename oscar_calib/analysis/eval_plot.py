"""The plot `oscar-calib eval --plot` writes (matplotlib, the `plot` extra)."""

from __future__ import annotations

from pathlib import Path


def write_plot(result: dict, path: Path) -> None:
    """Two panels: perplexity change vs BF16 per method (with its bits), per-layer attention KL per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["methods"] if r["name"] != "bf16"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [f"{r['name']}\n{r['effective_bits_128k']:.2f} b@128K" for r in rows]
    a.bar(range(len(rows)), [r["ppl_delta_pct"] or 0.0 for r in rows], color="tab:blue")
    a.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=8)
    a.set_ylabel("perplexity vs BF16 (%)")
    a.set_title(f"context {result['context']}")
    for r in rows:
        if r["layers"]:
            b.plot([x["layer"] for x in r["layers"]], [max(x["attn_kl"], 1e-12) for x in r["layers"]], marker="o",
                   label=r["name"])
    b.set_yscale("log")
    from matplotlib.ticker import MaxNLocator

    b.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
    b.set_xlabel("layer")
    b.set_ylabel("attention KL to BF16")
    b.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
