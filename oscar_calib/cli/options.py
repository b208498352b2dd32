"""Shared option types so that flags are spelled the same in every command (like the `hf` CLI)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

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



# Choices as str Enums: typer lists them in --help and refuses other values naming the flag (exit 2).
class ExportFormat(str, Enum):
    reference = "reference"


class HeadReduce(str, Enum):
    none = "none"
    first = "first"


class RepoType(str, Enum):
    model = "model"
    dataset = "dataset"


RepoTypeOpt = Annotated[
    RepoType, typer.Option("--repo-type", help="Kind of Hub repo that holds the zoo.", case_sensitive=False)
]


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
    if not any(isinstance(p, str) for p in first["loc"]):  # a model-level check: name the flags it mentions
        return msg.replace("solver.group_size", "--group-size")
    flag = flag_for_field(tuple(first["loc"]))
    if first["type"] == "value_error":  # our validators already say what they got
        return f"{flag}: {msg}"
    return f"{flag}: {msg} (got {first.get('input')!r})"
