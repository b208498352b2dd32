"""`oscar-calib eval`: perplexity and per-layer attention error of BF16, INT2 baselines and OSCAR, side by side."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from oscar_calib.cli.app import app
from oscar_calib.cli.exit_codes import require
from oscar_calib.cli.options import DeviceOpt, DtypeOpt, JsonOpt, ModelIdOpt, RevisionOpt, format_from_flags
from oscar_calib.cli.output import Output
from oscar_calib.errors import InputError
from runtime_kernels.format import DEFAULT_FORMAT

_EXAMPLES = """
Examples:

  oscar-calib eval                                         # trained fixture, calibrated on the fly, 2K context
  oscar-calib eval --context 4096 --device cuda --json-out eval.json --plot eval.png
  oscar-calib eval --model Qwen/Qwen3-8B --artifact zoo/qwen3-8b --data text.txt --context 8192
"""


def _sized(output: Output, value, flag: str, on_gpu: bool, gpu, cpu):
    """`value`, or the default sized for the device, noted with its reason (a CPU run should take minutes)."""
    if value is not None:
        return value
    chosen = gpu if on_gpu else cpu
    output.note(f"{flag} {chosen} ({'GPU' if on_gpu else f'CPU-sized default; {gpu} on a GPU'}; pass {flag} to choose)")
    return chosen


def _calibrate(output: Output, model, tokenizer, calib_path: Path, context: int, samples: int, fmt) -> dict:
    """OSCAR artifacts (per-head and per-layer rotations) calibrated on `calib_path` for the KV format `fmt`."""
    from oscar_calib.analysis.eval_job import calibration_ids
    from oscar_calib.calibration.calibrate import calibrate_model
    from oscar_calib.config import SolverSettings

    ids = calibration_ids(tokenizer, calib_path, context, samples)
    device = next(model.parameters()).device
    out = {}
    for gran in ("head", "layer"):
        t0 = time.perf_counter()
        settings = SolverSettings(granularity=gran, kv_format=fmt)
        with output.stages() as stages:
            out[f"oscar-{gran}"] = calibrate_model(model, ids.to(device), settings, compare_alternatives=False,
                                                   progress=stages.tokens(f"capture oscar-{gran}", ids.numel()),
                                                   fit_progress=stages.steps(f"clip fit oscar-{gran}", "layers"))
        output.note(f"calibrated oscar-{gran} on {ids.shape[0]} x {context} tokens of {calib_path.name} "
                    f"({time.perf_counter() - t0:.1f}s)")
    return out


def _pct(x) -> str:
    return "n/a" if not isinstance(x, float) else f"{100 * x:.0f}%"


def _ci(ci) -> str:
    return "" if not ci or any(x != x for x in ci) else f" [{ci[0]:+.2f}, {ci[1]:+.2f}]"


def _table(result: dict):
    from rich.table import Table

    vs = result.get("vs_best_peer", {})
    t = Table(title=f"KV methods at context {result['context']} (sink {result['sink']}, recent {result['recent']}; "
                    f"{result['windows']['long']} long + {result['windows']['packed']} packed windows)",
              caption="Intervals: 95 % paired bootstrap over the windows; a change whose interval holds 0 is a tie.")
    for col in ("method", "bits@128K", "ppl", "Δ vs BF16 [95 % CI]", "vs best peer [95 % CI]", "attn KL", "out err"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for r in result["methods"]:
        delta = r["ppl_delta_pct"]
        peer = vs.get(r["name"])
        peer_text = (f"{peer['delta_pct']:+.2f}%{_ci(peer['ci95'])} vs {peer['peer']}: {peer['verdict']}"
                     if peer else "")
        t.add_row(r["name"], f"{r['effective_bits_128k']:.2f}", f"{r['ppl']:.3f}",
                  "" if delta is None else f"{delta:+.2f}%{_ci(r.get('ppl_delta_ci95'))}", peer_text,
                  f"{r['mean_attn_kl']:.4f}", f"{r['mean_out_rel_err']:.4f}")
    return t


@app.command("eval", epilog=_EXAMPLES)
def eval_cmd(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Hub model id, local directory or .gguf file (default: the trained fixture).")] = None,
    revision: RevisionOpt = None,
    model_id: ModelIdOpt = None,
    artifact: Annotated[list[Path] | None, typer.Option("--artifact", "-a", help="OSCAR artifact (repeatable). Default: calibrate per-head and per-layer on --calib-data.")] = None,
    data: Annotated[Path | None, typer.Option("--data", help="Text file; documents separated by lines '<|endoftext|>' (default: the fixture's heldout.txt).")] = None,
    calib_data: Annotated[Path | None, typer.Option("--calib-data", help="Calibration text when no --artifact is given (default: the fixture's calib.txt).")] = None,
    calib_samples: Annotated[int | None, typer.Option("--calib-samples", help="Windows of calibration text (last one held out for the clip fit; default 16 on a GPU, 6 on a CPU).")] = None,
    context: Annotated[int, typer.Option("--context", help="Tokens per evaluation window (longer than sink + recent).")] = 2048,
    max_windows: Annotated[int | None, typer.Option("--max-windows", help="At most this many windows (long and packed share it; default 16 on a GPU, 4 on a CPU).")] = None,
    sink: Annotated[int | None, typer.Option("--sink", help=f"BF16 sink tokens (default: the artifact's, else the recipe's {DEFAULT_FORMAT.sink_tokens}).")] = None,
    recent: Annotated[int | None, typer.Option("--recent", help=f"BF16 recent tokens (default: the artifact's, else the recipe's {DEFAULT_FORMAT.recent_tokens}).")] = None,
    page_size: Annotated[int | None, typer.Option("--page-size", help="History grows this many tokens at a time (default: per token, as the clip fit scores it).", show_default=False)] = None,
    methods: Annotated[str | None, typer.Option("--methods", help="Comma-separated subset of method names.")] = None,
    generation_steps: Annotated[int | None, typer.Option("--generation-steps", help="Greedy steps per window for the runtime agreement (0 = skip; default 64 on a GPU, 16 on a CPU).")] = None,
    generation_windows: Annotated[int, typer.Option("--generation-windows", help="Windows used for the runtime agreement.")] = 2,
    probes: Annotated[int | None, typer.Option("--probes", help="Passkey needles placed in the INT2 history, plus a verbatim-recall check through the runtime (0 = skip; default 16 on a GPU, 0 on a CPU).")] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help="Windows per forward pass (default: 1 on CPU, 4 on GPU).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json-out", help="Write the full results as JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG plot here.")] = None,
    as_json: JsonOpt = False,
    allow_other_model: Annotated[bool, typer.Option("--allow-other-model", help="Use an --artifact calibrated for another model id (shapes must still match).")] = False,
) -> None:
    """Teacher-forced evaluation of KV methods as a decoder sees them (BF16 sink + recent, INT2 history)."""
    if plot is not None:
        require("matplotlib", "plot", "--plot")
    from oscar_calib.analysis.eval_job import EvalRequest, check_generation_steps, eval_methods, run_eval
    from oscar_calib.analysis.evaluate import make_windows, read_documents
    from oscar_calib.demo import FIXTURE_DIR
    from runtime_kernels.artifact import model_geometry

    output = Output(as_json, tag="eval")
    model, model_id, data = _inputs(output, model, model_id, artifact, data, context)
    dev, torch_dtype = _device(output, device, dtype)
    calib_samples, max_windows, generation_steps, bs, probes = _sizes(
        output, dev.startswith("cuda"), calib_samples, max_windows, generation_steps, batch_size, probes)
    tokenizer, lm = _load(model, revision, torch_dtype, dev, context)
    arts = _read_artifacts(artifact or [], lm.config, model, model_id, allow_other_model)
    fmt = _format(arts, sink, recent, context)
    if not arts:
        arts = _calibrate(output, lm, tokenizer, calib_data or FIXTURE_DIR / "calib.txt", context, calib_samples, fmt)
    windows = make_windows(tokenizer, read_documents(data), context, max_windows)
    if not windows.all():
        raise InputError(f"--data {data}: holds fewer than {context} tokens (no full window)")
    wanted = [m.strip() for m in methods.split(",") if m.strip()] if methods else None
    all_methods = eval_methods(model_geometry(lm.config)[3], fmt, arts, wanted)
    check_generation_steps(generation_steps, context, fmt)  # before the evaluation, not after it
    output.note(f"{windows.long.shape[0]} long + {windows.packed.shape[0]} packed windows of {context} tokens; "
                f"methods: {', '.join(m.name for m in all_methods)}")
    # the teacher-forced history grows a page at a time
    request = EvalRequest(fmt=fmt, simulated=format_from_flags(fmt.per_token(), page_size=page_size), batch_size=bs,
                          generation_steps=generation_steps, generation_windows=generation_windows, probes=probes)
    with output.stages() as stages:
        progress = _progress(stages, len(all_methods) * len(list(windows.all())))
        result = run_eval(lm, tokenizer, all_methods, arts, windows, request, progress=progress)
    result.update({"model": model, "data": str(data), "device": dev, "dtype": str(torch_dtype).replace("torch.", "")})
    _report(output, result, json_out, plot, as_json)


def _sizes(output: Output, on_gpu: bool, calib_samples, max_windows, generation_steps, batch_size, probes):
    """The sizes left unset, at their GPU or CPU default (noted); a negative --probes is refused."""
    calib_samples = _sized(output, calib_samples, "--calib-samples", on_gpu, gpu=16, cpu=6)
    max_windows = _sized(output, max_windows, "--max-windows", on_gpu, gpu=16, cpu=4)
    generation_steps = _sized(output, generation_steps, "--generation-steps", on_gpu, gpu=64, cpu=16)
    batch_size = _sized(output, batch_size, "--batch-size", on_gpu, gpu=4, cpu=1)
    probes = _sized(output, probes, "--probes", on_gpu, gpu=16, cpu=0)
    if probes < 0:
        raise InputError(f"--probes {probes}: expected 0 (skip) or a number of passkey needles")
    return calib_samples, max_windows, generation_steps, batch_size, probes


def _format(arts: dict, sink, recent, context: int):
    """The one KV format of this evaluation: the first artifact's (else the recipe's), with --sink/--recent; the
    context must leave an INT2 history between the windows."""
    fmt = format_from_flags(next(iter(arts.values())).kv_format if arts else DEFAULT_FORMAT, sink_tokens=sink,
                            recent_tokens=recent)
    windows = fmt.sink_tokens + fmt.recent_tokens
    if context <= windows:
        raise InputError(f"--context {context}: the windows (sink {fmt.sink_tokens} + recent {fmt.recent_tokens}) "
                         f"leave no INT2 history to evaluate; use --context {2 * windows} or more, or smaller "
                         "--sink/--recent")
    return fmt


def _progress(stages, total: int):
    """A progress callback for `run_eval`: one step per method and window set, out of `total`."""
    step, done = stages.steps("eval", unit="method x window set"), [0]

    def advance(name: str, kind: str) -> None:
        done[0] += 1
        step(f"{name} ({kind})", done[0], total)

    step("", 0, total)
    return advance


def _inputs(output: Output, model, model_id, artifacts, data, context: int):
    """(model, model_id, data) with the fixture's defaults, after the checks that need nothing loaded."""
    from oscar_calib.cli.checks import local_model_id
    from oscar_calib.cli.preflight import check_model_ref
    from oscar_calib.demo import FIXTURE_DIR, FIXTURE_MODEL_ID, fixture_available
    from oscar_calib.loading import is_gguf

    check_model_ref(model)  # a missing path (exit 2) or an unreachable Hub (exit 5) before anything loads
    for path in artifacts or []:
        if not path.exists():
            raise InputError(f"--artifact {path}: no such directory (expected an artifact directory or "
                             "oscar_kv.safetensors file)")
    if model is None:
        if not fixture_available():
            raise InputError("--model is required: the trained fixture is not installed with this package")
        model, model_id = str(FIXTURE_DIR), model_id or FIXTURE_MODEL_ID  # the id the demo's artifacts name
        output.note(f"model={model} (the trained fixture: no --model given)")
    elif is_gguf(model):
        require("gguf", "gguf", f"--model {model}")
        model_id = local_model_id(model)  # what `run --model x.gguf` names in the artifact
    if data is None:
        data = FIXTURE_DIR / "heldout.txt"
        output.note(f"data={data} (the fixture's held-out text: no --data given)")
    if context < 8:
        raise InputError(f"--context {context}: expected at least 8 tokens")
    return model, model_id, data


def _device(output: Output, device, dtype):
    """The device and torch dtype, each auto-chosen value noted with its reason."""
    from oscar_calib.calibration.job import Choices, resolve_device, resolve_dtype

    choices = Choices()
    dev = resolve_device(device, choices)
    torch_dtype = resolve_dtype(dtype, dev, choices)
    for key, reason in choices.reasons.items():
        output.note(f"{key}={choices.values[key]} ({reason})")
    return dev, torch_dtype


def _load(model: str, revision, torch_dtype, dev: str, context: int):
    """The tokenizer and the model; a context beyond the model's positions is refused."""
    from oscar_calib.calibration.job import max_positions
    from oscar_calib.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(model, revision, False)
    lm = load_model(model, revision, torch_dtype, dev, False)
    limit = max_positions(lm.config)
    if limit is not None and context > limit:
        raise InputError(f"--context {context}: the model's max_position_embeddings is {limit}")
    return tokenizer, lm


def _read_artifacts(paths: list[Path], config, model: str, model_id, allow_other_model: bool) -> dict:
    """name -> artifact, each checked against the model; names `oscar-<granularity>`, primed when repeated."""
    from oscar_calib.cli.checks import check_model
    from runtime_kernels.artifact import read_artifact

    arts = {}
    for path in paths:
        art = read_artifact(path)
        check_model(art, config, model=model, model_id=model_id, allow_other_model=allow_other_model)
        name = f"oscar-{art.metadata.get('granularity', 'head')}"
        while name in arts:
            name += "'"
        arts[name] = art
    return arts


def _report(output: Output, result: dict, json_out: Path | None, plot: Path | None, as_json: bool) -> None:
    """The files asked for, then the table (or the JSON) and the agreement and probe lines."""
    pr = result.get("probes")
    if pr:
        brief = {name: {k: v for k, v in r.items() if k != "per_needle"} for name, r in pr["passkey"].items()}
        output.note(f"probes: passkey {json.dumps(brief)}; verbatim {json.dumps(pr['verbatim'])}")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=1))
        output.note(f"wrote {json_out}")
    if plot is not None:
        from oscar_calib.analysis.eval_plot import write_plot

        write_plot(result, plot)
        output.note(f"wrote {plot}")
    if as_json:
        output.json(result, indent=1)
        return
    output.rich(_table(result))  # no truncated columns in pipes/logs
    agree = result.get("generation_agreement")
    if agree and agree.get("status") == "ok":
        for name, r in agree["methods"].items():
            output.rich(f"{name}: greedy next-token match with BF16 through the runtime "
                        f"{100 * r['match_rate']:.1f}% over {agree['steps']} steps "
                        f"(first divergence at step {r['first_divergence_mean']:.1f} on average)")
    elif agree:
        output.rich(f"generation agreement: {agree['status']} ({agree.get('reason', '')})")
    if pr:
        for name, r in pr["passkey"].items():
            output.rich(f"{name}: passkey {100 * r['key_token_accuracy']:.0f}% of key tokens, "
                        f"{100 * r['keys_exact']:.0f}% of {r['needles']} keys exact; verbatim recall "
                        f"{_pct(pr['verbatim'].get(name))}")
        if "bf16" not in pr["passkey"]:
            output.rich(f"bf16: verbatim recall {_pct(pr['verbatim'].get('bf16'))}")
