"""`oscar-calib import` and `oscar-calib export --format reference`: the authors' RotationZoo files.

See oscar_calib.zoo.reference_format for the format, the safety rules and the head-reduction rule.
Exit codes: 2 bad or unsafe input file / option / output path, 4 the result breaks the artifact contract.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from oscar_calib.cli._common import load_config, translate_errors
from oscar_calib.cli.app import app
from oscar_calib.cli.options import ExportFormat, HeadReduce, JsonOpt, format_from_flags
from oscar_calib.cli.output import Output
from oscar_calib.errors import InputError
from runtime_kernels.format import DEFAULT_FORMAT

_IMPORT_EXAMPLES = """
Examples:

  oscar-calib import --keys rot_k.pt --values rot_v.pt --model-config ./Qwen3-8B --model-id Qwen/Qwen3-8B \\
      --model-revision <sha> --out zoo/qwen3-8b-reference
"""


@app.command("import", epilog=_IMPORT_EXAMPLES)
def import_cmd(
    keys: Annotated[Path, typer.Option("--keys", help="Reference file with the key rotations.")],
    values: Annotated[Path, typer.Option("--values", help="Reference file with the value rotations.")],
    model_config: Annotated[Path, typer.Option("--model-config", help="Local model dir or config.json (heads, head_dim).")],
    model_id: Annotated[str, typer.Option("--model-id", help="Hub id of the model the rotations are for.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Artifact directory to create.")],
    model_revision: Annotated[str, typer.Option("--model-revision", help="Model commit sha.")] = "unknown",
    k_clip: Annotated[float, typer.Option("--k-clip", help="Key clip ratio for every head (reference: 0.96).")] = 0.96,
    v_clip: Annotated[float, typer.Option("--v-clip", help="Value clip ratio for every head (reference: 0.92).")] = 0.92,
    sink: Annotated[int | None, typer.Option("--sink", help=f"BF16 sink tokens the reference served with (default: the recipe's {DEFAULT_FORMAT.sink_tokens}).")] = None,
    recent: Annotated[int | None, typer.Option("--recent", help=f"BF16 recent tokens the reference served with (default: the recipe's {DEFAULT_FORMAT.recent_tokens}).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out directory.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Convert a reference key file + value file (format v1, v2 or v3) into a validated contract-v2 artifact."""
    from oscar_calib import __version__
    from oscar_calib.zoo.reference_format import load_reference, reference_to_artifact
    from runtime_kernels.artifact import ARTIFACT_FILENAME, write_artifact
    from runtime_kernels.atomic import atomic_output_dir, preflight
    from runtime_kernels.loader import check_model_id

    output = Output(as_json)
    with translate_errors():
        check_model_id(model_id, "--model-id")
    preflight(out, overwrite, "--out")  # before reading anything
    windows = format_from_flags(DEFAULT_FORMAT, sink_tokens=sink, recent_tokens=recent)
    config = load_config(model_config)
    k_ref = load_reference(keys)
    v_ref = load_reference(values)
    artifact = reference_to_artifact(k_ref, v_ref, config, model_id, model_revision, k_clip, v_clip,
                                     tool_version=f"oscar-calib {__version__}", windows=windows)
    with translate_errors(), atomic_output_dir(out, overwrite, "--out") as tmp:  # interrupts leave nothing half-written
        write_artifact(artifact, tmp)
    path = out / ARTIFACT_FILENAME
    if as_json:
        output.json({"artifact": str(path), "layers": artifact.num_layers, "model_id": model_id,
                     "key_objective": k_ref["objective"], "value_objective": v_ref["objective"]}, indent=2)
    else:
        output.result(path)
    output.note(f"imported {artifact.num_layers} layer(s) ({k_ref['objective']} / {v_ref['objective']})")


_EXPORT_EXAMPLES = """
Examples:

  oscar-calib export zoo/qwen3-8b --format reference --out ref/qwen3-8b          # format v2, per KV head
  oscar-calib export zoo/qwen3-8b --format reference --out ref/qwen3-8b --reference-version 1 --head-reduce first
"""


@app.command("export", epilog=_EXPORT_EXAMPLES)
def export_cmd(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Artifact directory or .safetensors file.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for keys.pt and values.pt.")],
    fmt: Annotated[ExportFormat, typer.Option("--format", help="Output format: reference (the authors' "
                                                               "RotationZoo).")] = ExportFormat.reference,
    head_reduce: Annotated[HeadReduce, typer.Option("--head-reduce", help="none: refuse differing per-head "
                                                    "rotations; first: use KV head 0's rotation per layer.")
                           ] = HeadReduce.none,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out directory.")] = False,
    model_config: Annotated[Path | None, typer.Option("--model-config", help="Check the artifact against this model first.")] = None,
    reference_version: Annotated[int, typer.Option("--reference-version", help="2: per KV head (v3 when keys are centred); "
                                                                               "1: one rotation per layer.")] = 2,
    allow_other_model: Annotated[bool, typer.Option("--allow-other-model", help="With --model-config: check shapes only, "
                                                                                "not that the artifact names this model.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write an artifact in the reference format (keys.pt, values.pt; v2 per KV head, or v1 per layer)."""
    from oscar_calib.cli.checks import check_model
    from oscar_calib.zoo.reference_format import export_reference
    from runtime_kernels.artifact import read_artifact
    from runtime_kernels.atomic import atomic_output_dir, preflight

    output = Output(as_json)
    if fmt != "reference":
        raise InputError(f"--format {fmt!r}: expected 'reference'")
    preflight(out, overwrite, "--out")
    with translate_errors():
        artifact = read_artifact(directory)
    if model_config is not None:
        check_model(artifact, load_config(model_config), model=model_config,
                    allow_other_model=allow_other_model)
    with atomic_output_dir(out, overwrite, "--out") as tmp:  # interrupts leave nothing half-written
        written = export_reference(artifact, tmp, head_reduce=getattr(head_reduce, "value", head_reduce),
                                   overwrite=True, version=reference_version)
    written = {name: out / Path(path).name for name, path in written.items()}
    if as_json:
        output.json({name: str(path) for name, path in written.items()}, indent=2, sort_keys=True)
    else:
        output.result(out)
    if not bool((artifact.k_clip_ratio == artifact.k_clip_ratio.flatten()[0]).all()) or not bool(
            (artifact.v_clip_ratio == artifact.v_clip_ratio.flatten()[0]).all()):
        output.note("note: the reference format has no clip ratios; the fitted per-head ratios were not exported")
