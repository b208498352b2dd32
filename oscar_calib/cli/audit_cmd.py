"""`oscar-calib audit`: per-(layer, KV head) statistics and flags of an artifact, worst first."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from oscar_calib.cli.app import app
from oscar_calib.cli.exit_codes import require
from oscar_calib.cli.options import DeviceOpt, DtypeOpt, JsonOpt, ModelIdOpt, RevisionOpt
from oscar_calib.cli.output import Output

_EXAMPLES = """
Examples:

  oscar-calib audit zoo/demo                               # artifact only: spectra, clips, orthogonality
  oscar-calib audit zoo/demo --model oscar_calib/fixtures/tiny-qwen3 --plots audit/
  oscar-calib audit zoo/qwen3-8b --model Qwen/Qwen3-8B --data text.txt --json > audit.json
"""


def _fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def _table(report: dict, top: int | None):
    from rich.table import Table

    rows = report["heads"][:top] if top else report["heads"]
    acts = report["with_activations"]
    cols = ["layer", "head", "k_clip", "v_clip", "k_top1_share", "v_top1_share", "k_effective_rank"]
    if acts:
        cols += ["k_kurtosis_before", "k_kurtosis_after", "k_channel_ratio_before", "k_channel_ratio_after",
                 "k_err_naive", "k_err_hadamard", "k_err_oscar", "v_err_naive", "v_err_hadamard", "v_err_oscar",
                 "history_mass"]
    t = Table(title=f"{report['artifact']} ({report['granularity']} rotations), worst first; "
                    f"{report['flags_total']} flag(s)")
    short = {"k_top1_share": "K top1", "v_top1_share": "V top1", "k_effective_rank": "K eff.rank",
             "k_kurtosis_before": "K kurt", "k_kurtosis_after": "K kurt rot", "k_channel_ratio_before": "K max/med",
             "k_channel_ratio_after": "K max/med rot", "k_err_naive": "K err naive", "k_err_hadamard": "K err had",
             "k_err_oscar": "K err oscar", "v_err_naive": "V err naive", "v_err_hadamard": "V err had",
             "v_err_oscar": "V err oscar", "history_mass": "INT2 attn"}
    for c in cols:
        t.add_column(short.get(c, c), justify="right")
    t.add_column("flags")
    for r in rows:
        t.add_row(*[_fmt(r.get(c)) for c in cols], ", ".join(r["flags"]))
    return t


@app.command("audit", epilog=_EXAMPLES)
def audit_cmd(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory or oscar_kv.safetensors file.")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model to capture activations from (outlier and error measures).")] = None,
    revision: RevisionOpt = None,
    data: Annotated[Path | None, typer.Option("--data", help="Text for the activations (default: the fixture's heldout.txt).")] = None,
    samples: Annotated[int, typer.Option("--samples", help="Sequences captured.")] = 2,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per captured sequence.")] = 512,
    top: Annotated[int | None, typer.Option("--top", help="Show only the N worst heads in the table.")] = None,
    plots: Annotated[Path | None, typer.Option("--plots", help="Write heatmap PNGs into this directory.")] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    model_id: ModelIdOpt = None,
    allow_other_model: Annotated[bool, typer.Option("--allow-other-model", help="With --model: audit an artifact "
                                                    "calibrated for another model id (shapes must still match).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Per-(layer, KV head) spectra, clip ratios, outliers before/after rotation, INT2 errors and flags.

    Exits 4 after the report when the artifact breaks the contract (the report still shows what is wrong).
    """
    output = Output(as_json, tag="audit")
    if plots is not None:
        require("matplotlib", "plot", "--plots")
    if model is not None and model.lower().endswith(".gguf"):  # transformers reads GGUF through `gguf`
        require("gguf", "gguf", f"--model {model}")
    import torch

    from oscar_calib.analysis.audit import audit_artifact, capture_activations, load_raw
    from oscar_calib.analysis.audit_plots import write_audit_plots
    from oscar_calib.cli.preflight import check_model_ref
    from oscar_calib.errors import InputError, IntegrityError

    if not Path(artifact).exists():
        raise InputError(f"ARTIFACT {artifact}: no such file or directory (expected an artifact directory or "
                         "oscar_kv.safetensors file)")
    check_model_ref(model)
    raw = load_raw(artifact)
    if raw.contract_error:
        output.note(f"the artifact breaks the contract: {raw.contract_error}")
    acts = None
    if model is not None:
        from oscar_calib.analysis.evaluate import make_windows, read_documents
        from oscar_calib.calibration.job import Choices, resolve_device, resolve_dtype
        from oscar_calib.cli.checks import check_model
        from oscar_calib.demo import FIXTURE_DIR
        from oscar_calib.loading import load_model, load_tokenizer
        from runtime_kernels.artifact import read_artifact

        choices = Choices()
        dev = resolve_device(device, choices)
        torch_dtype = resolve_dtype(dtype, dev, choices)
        tok = load_tokenizer(model, revision, False)
        lm = load_model(model, revision, torch_dtype, dev, False)
        if raw.contract_error is None:
            check_model(read_artifact(artifact), lm.config, model=model, model_id=model_id,
                        allow_other_model=allow_other_model)
        data = data or FIXTURE_DIR / "heldout.txt"
        w = make_windows(tok, read_documents(data), seq_len)
        ids = torch.cat([w.long, w.packed])[:samples]
        if ids.shape[0] == 0:
            raise InputError(f"--data {data}: holds fewer than --seq-len {seq_len} tokens")
        output.note(f"capturing {ids.shape[0]} x {seq_len} tokens of {data} on {dev}")
        acts = capture_activations(lm, ids)
    report = audit_artifact(raw, acts)
    if plots is not None:
        written = write_audit_plots(report, plots)
        for p in written:
            output.note(f"wrote {p}")
        report["plots"] = [str(p) for p in written]  # in --json too: the result names every file it wrote
    if as_json:
        output.json(report, indent=1)
    else:
        output.rich(_table(report, top))
        for kind, text in report.get("advice", {}).items():  # the next step for each kind of flag raised
            output.rich(f"[yellow]{kind}[/]: {text}")
    if raw.contract_error:
        raise IntegrityError(f"{raw.source}: breaks the artifact contract: {raw.contract_error}")
