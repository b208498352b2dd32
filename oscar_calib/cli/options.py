"""Shared option types so that flags are spelled the same in every command (like the `hf` CLI)."""

from __future__ import annotations

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
