"""Shared option types so that flags are spelled the same in every command (like the `hf` CLI)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from runtime_kernels.format import (
    DEFAULT_FORMAT,
    MAX_CLIP_RATIO,
    MIN_CLIP_RATIO,
    QUANTIZERS,
    SCALE_FORMATS,
    KVFormat,
    KVFormatError,
)

RevisionOpt = Annotated[Optional[str], typer.Option("--revision", help="Git revision (branch, tag or commit sha).")]
TokenOpt = Annotated[
    Optional[str],
    typer.Option("--token", help="Hugging Face token; defaults to $HF_TOKEN or the cached login. Never printed."),
]
DeviceOpt = Annotated[
    Optional[str], typer.Option("--device", help="cpu, cuda, cuda:N or auto (default: cuda if available).")
]
DtypeOpt = Annotated[
    Optional[str], typer.Option("--dtype", help="bfloat16, float16 or float32 (default: bf16 on GPU, fp32 on CPU).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
OutDirOpt = Annotated[Path, typer.Option("--out", "-o", help="Output directory.")]
ModelIdOpt = Annotated[Optional[str], typer.Option(
    "--model-id", help="The Hub id --model is a local copy of (e.g. Qwen/Qwen3-8B): the artifact must name it.")]



# Choices as str Enums: typer lists them in --help and refuses other values naming the flag (exit 2).
class ExportFormat(str, Enum):
    reference = "reference"


class HeadReduce(str, Enum):
    none = "none"
    first = "first"


class RepoType(str, Enum):
    model = "model"
    dataset = "dataset"


class Granularity(str, Enum):
    head = "head"
    layer = "layer"


class ValueTarget(str, Enum):
    attn_output = "attn_output"
    logit_weighted = "logit_weighted"


# The KV format's choices are the format module's own lists (one place names them).
ScaleDtype = Enum("ScaleDtype", {name: name for name in SCALE_FORMATS}, type=str)
# The metavar of an option whose help names its choices: the choices joined as one word could not wrap, and at 80
# columns they squeezed the Recipe panel until `--hadamard-key-mass` lost its last letters.
CHOICE = "<name>"
Quantizer = Enum("Quantizer", {name: name for name in QUANTIZERS}, type=str)


class ClipObjective(str, Enum):
    block_out = "block_out"
    out_err = "out_err"
    attn_kl = "attn_kl"
    logit_mse = "logit_mse"


# The solver options of `run` and `refit` (one spelling, one default: SolverSettings' own).
GranularityOpt = Annotated[Granularity, typer.Option(
    "--granularity", help="One rotation per KV head, or the reference's one per layer.")]
ValueTargetOpt = Annotated[ValueTarget, typer.Option(
    "--value-target", metavar=CHOICE, help="attn_output (paper) or logit_weighted (reference code).")]
KGridOpt = Annotated[Optional[str], typer.Option(
    "--k-clip-grid", help="Starting key clip ratios, comma-separated; 1.0 is always added, the fit extends downward.")]
VGridOpt = Annotated[Optional[str], typer.Option(
    "--v-clip-grid", help="Starting value clip ratios, comma-separated; 1.0 is always added.")]
ClipObjectiveOpt = Annotated[ClipObjective, typer.Option(
    "--key-objective", metavar=CHOICE, help="Held-out error that picks clips: block_out (attention-output error after o_proj, keys "
                            "and values), out_err (before o_proj), attn_kl or logit_mse (keys only).")]
ClipOpt = Annotated[bool, typer.Option(
    "--clip/--no-clip", help="Fit per-head clip ratios (--no-clip: none; on the fixtures about the default's far-token "
                             "retrieval at +0.4-0.5 % perplexity).")]
CenteredOpt = Annotated[bool, typer.Option(
    "--centered/--no-centered", help="Subtract the calibrated per-(layer, KV head) key and value means before "
                                     "quantizing (exact: decode adds them back).")]
SinkOpt = Annotated[Optional[int], typer.Option(
    "--sink", help=f"BF16 sink tokens the runtime keeps (recorded in the artifact; default "
                   f"{DEFAULT_FORMAT.sink_tokens}).")]
RecentOpt = Annotated[Optional[int], typer.Option(
    "--recent", help=f"BF16 recent tokens the runtime keeps (recorded in the artifact; default "
                     f"{DEFAULT_FORMAT.recent_tokens}).")]
ScaleDtypeOpt = Annotated[ScaleDtype, typer.Option(
    "--scale-dtype", help="Per-row scale and zero point of the INT2 history: ue5m3 (8 + 8 bits, 2.125 bits per "
                          "element at head_dim 128) or float16 (16 + 16 bits, 2.25).")]
QuantizerOpt = Annotated[Quantizer, typer.Option(
    "--quantizer", metavar=CHOICE, help="How each INT2 row is encoded: uniform_unbiased (min-max over the clipped row, with a gain "
                        "that keeps the row's projection on the unclipped one, so far tokens keep their attention "
                        "logits) or uniform_minmax (the reference's).")]
GroupSizeOpt = Annotated[Optional[int], typer.Option("--group-size", help="Quantization group (default: head_dim).")]
HadamardKeyMassOpt = Annotated[float, typer.Option(
    "--hadamard-key-mass",  # 0..1 is SolverSettings' check: typer's range text widened the Recipe panel past 80 columns
    help="A share from 0 to 1. Keys take the Hadamard rotation in KV heads whose held-out queries put more than this share of their "
         "attention on the INT2 history (the tokens neither BF16 window keeps): those queries are the ones key error "
         "reaches; 1 = the attention-aware rotation in every head.")]


def parse_grid(text: Optional[str], flag: str, default: tuple[float, ...]) -> tuple[float, ...]:
    """A comma-separated clip grid, or `default` when the flag is absent. Each ratio must lie in the contract's
    [MIN_CLIP_RATIO, MAX_CLIP_RATIO] (runtime_kernels.format): a ratio the artifact could not hold is refused here,
    naming the flag, before any work."""
    if text is None:
        return default
    from oscar_calib.errors import InputError

    expected = f"comma-separated clip ratios in [{MIN_CLIP_RATIO:g}, {MAX_CLIP_RATIO:g}]"
    try:
        grid = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise InputError(f"{flag} '{text}': expected {expected}") from exc
    for r in grid:
        if not MIN_CLIP_RATIO <= r <= MAX_CLIP_RATIO:  # NaN fails too
            raise InputError(f"{flag} '{text}': {r:g} is outside [{MIN_CLIP_RATIO:g}, {MAX_CLIP_RATIO:g}] (the "
                             f"contract's clip floor is {MIN_CLIP_RATIO:g}); expected {expected}")
    return grid


# Defaults of the KV format flags: DEFAULT_FORMAT's, the one default (typer shows them in --help).
DEFAULT_SCALE_DTYPE = ScaleDtype(DEFAULT_FORMAT.scale_format)
DEFAULT_QUANTIZER = Quantizer(DEFAULT_FORMAT.quantizer)
DEFAULT_CENTERED = DEFAULT_FORMAT.centered


def solver_settings(granularity: Granularity, value_target: ValueTarget, k_clip_grid: Optional[str],
                    v_clip_grid: Optional[str], key_objective: ClipObjective, centered: bool,
                    sink: Optional[int], recent: Optional[int], group_size: Optional[int],
                    scale_dtype: ScaleDtype, clip: bool, quantizer: Quantizer, hadamard_key_mass: float):
    """SolverSettings from the shared solver options (pydantic errors propagate for the caller to name the flag).
    The KV format is DEFAULT_FORMAT with the format flags given (`format_from_flags`: a bad value names its flag)."""
    from oscar_calib.config import DEFAULT_K_CLIP_GRID, DEFAULT_V_CLIP_GRID, SolverSettings

    fmt = format_from_flags(DEFAULT_FORMAT, sink_tokens=sink, recent_tokens=recent, group_size=group_size,
                            scale_format=scale_dtype.value, quantizer=quantizer.value, centered=centered)
    return SolverSettings(granularity=granularity.value, value_target=value_target.value,
                          k_clip_grid=parse_grid(k_clip_grid, "--k-clip-grid", DEFAULT_K_CLIP_GRID),
                          v_clip_grid=parse_grid(v_clip_grid, "--v-clip-grid", DEFAULT_V_CLIP_GRID),
                          key_clip_objective=key_objective.value, kv_format=fmt, clip=clip,
                          hadamard_key_mass=hadamard_key_mass)


@dataclass(frozen=True)
class SolverFlags:
    """The solver flags of one `run` or `refit` call, as typed (`settings()` builds SolverSettings from them)."""

    granularity: Granularity
    value_target: ValueTarget
    k_clip_grid: Optional[str]
    v_clip_grid: Optional[str]
    key_objective: ClipObjective
    centered: bool
    scale_dtype: ScaleDtype
    quantizer: Quantizer
    hadamard_key_mass: float
    clip: bool
    sink: Optional[int]
    recent: Optional[int]
    group_size: Optional[int]

    def settings(self):
        """SolverSettings (pydantic's ValidationError propagates, for the caller to name the flag)."""
        return solver_settings(**{f.name: getattr(self, f.name) for f in fields(self)})


def _solver_parameters() -> list[inspect.Parameter]:
    """The solver flags, declared once for `run` and `refit`: name, option (help, spelling) and default."""
    from oscar_calib.config import DEFAULT_HADAMARD_KEY_MASS

    declared = (("granularity", GranularityOpt, Granularity.head),
                ("value_target", ValueTargetOpt, ValueTarget.attn_output),
                ("k_clip_grid", KGridOpt, None),
                ("v_clip_grid", VGridOpt, None),
                ("key_objective", ClipObjectiveOpt, ClipObjective.block_out),
                ("centered", CenteredOpt, DEFAULT_CENTERED),
                ("scale_dtype", ScaleDtypeOpt, DEFAULT_SCALE_DTYPE),
                ("quantizer", QuantizerOpt, DEFAULT_QUANTIZER),
                ("hadamard_key_mass", HadamardKeyMassOpt, DEFAULT_HADAMARD_KEY_MASS),
                ("clip", ClipOpt, True),
                ("sink", SinkOpt, None),
                ("recent", RecentOpt, None),
                ("group_size", GroupSizeOpt, None))
    assert [name for name, _, _ in declared] == [f.name for f in fields(SolverFlags)]
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=opt, default=default)
            for name, opt, default in declared]


# The default of a command's `solver` parameter: where `with_solver_flags` puts the flags (never passed on).
SOLVER_FLAGS = None


def with_solver_flags(command: Callable) -> Callable:
    """Give a command the solver flags in place of its `solver: SolverFlags` parameter (typer reads the signature):
    `run` and `refit` spell, document and default them the same way because there is one declaration."""
    signature = inspect.signature(command, eval_str=True)
    solver = _solver_parameters()
    names = [p.name for p in solver]
    params = []
    for p in signature.parameters.values():
        if p.name == "solver":
            params += solver
        else:
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))

    @functools.wraps(command)
    def wrapper(**kwargs):
        flags = SolverFlags(**{name: kwargs.pop(name) for name in names})
        return command(**kwargs, solver=flags)

    wrapper.__signature__ = signature.replace(parameters=params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params} | {"return": signature.return_annotation}
    return wrapper


# KVFormat field -> the flag that sets it (commands that take a format from flags: eval, import).
_FLAG_OF_FORMAT_FIELD = {"sink_tokens": "--sink", "recent_tokens": "--recent", "page_size": "--page-size",
                         "group_size": "--group-size", "scale_format": "--scale-dtype", "quantizer": "--quantizer",
                         "centered": "--centered"}


def format_from_flags(base: KVFormat, **changes) -> KVFormat:
    """`base` with the flags given (None = not given) applied: `format_from_flags(fmt, sink_tokens=sink, ...)`.
    An out-of-range value raises InputError naming the flag."""
    from oscar_calib.errors import InputError

    try:
        return base.with_(**changes)
    except KVFormatError as exc:
        flag = _FLAG_OF_FORMAT_FIELD.get(exc.field, exc.field)
        raise InputError(f"{flag} {changes.get(exc.field)}: {str(exc).split(': ', 1)[1]}") from None


# The Hub keeps models and datasets in separate namespaces: `org/zoo` may be either, so every command that talks
# to a zoo repo takes the same --repo-type (a dataset repo is a common home for non-model files).
RepoTypeOpt = Annotated[RepoType, typer.Option(
    "--repo-type", help="Kind of Hub repo that holds the zoo.", case_sensitive=False)]
ZooRepoTypeOpt = Annotated[Optional[RepoType], typer.Option(
    "--repo-type", help="Kind of Hub repo that holds the zoo (default: the manifest's repo_type, else model).",
    case_sensitive=False, show_default=False)]


# Config field (pydantic `loc`, last part) -> the flag that sets it, where the names differ.
_FLAG_OF_FIELD = {"model_revision": "--revision", "key_clip_objective": "--key-objective", "dataset": "--dataset"}


def flag_for_field(loc: tuple) -> str:
    """The command-line flag of a config field: ("solver", "k_clip_grid", 0) -> "--k-clip-grid"."""
    names = [str(p) for p in loc if isinstance(p, str)]
    if not names:
        return "the options"
    name = names[-1]
    return _FLAG_OF_FIELD.get(name, "--" + name.replace("_", "-"))


def validation_message(exc) -> str:
    """One line for a pydantic ValidationError of a config built from flags, naming the flag, not the field."""
    first = exc.errors()[0]
    msg = first["msg"].removeprefix("Value error, ")
    if not any(isinstance(p, str) for p in first["loc"]):  # a model-level check
        return msg
    flag = flag_for_field(tuple(first["loc"]))
    if first["type"] == "value_error":  # our validators already say what they got
        return f"{flag}: {msg}"
    return f"{flag}: {msg} (got {first.get('input')!r})"
