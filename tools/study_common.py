"""What the fixture studies in `tools/` share: their common flags, and how they load a trained fixture."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def fixture_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the flags every study takes: the fixture, the context, the output folder, how many held-out
    windows and calibration windows, and the batch size."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", type=Path, required=True, help="a trained fixture (oscar_calib/fixtures/<name>)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-windows", type=int, default=16)
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    return p


def load_fixture(path: Path):
    """(tokenizer, model, device, dtype): bf16 on a GPU, fp32 on CPU, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return tok, model, device, dtype




def solver_settings(**flat):
    """SolverSettings from a flat mapping of its own fields and KVFormat's (`scale_format`, `quantizer`, `centered`,
    the windows ...): the studies' variants stay one dict each. A `kv_format` entry (an artifact's recorded solver)
    is the base the flat format fields change; an older artifact's flat `scale_dtype` / `center_keys` /
    `center_values` are read as the format's fields."""
    from dataclasses import fields

    from oscar_calib.config import SolverSettings
    from runtime_kernels.format import KVFormat

    if "scale_dtype" in flat:  # an artifact calibrated before SolverSettings held one kv_format recorded these
        flat["scale_format"] = flat.pop("scale_dtype")
    sides = {flat.pop(k) for k in ("center_keys", "center_values") if k in flat}
    if sides:
        if len(sides) > 1:
            raise SystemExit("an artifact that centers only keys or only values has no KVFormat (centered is both)")
        flat["centered"] = sides.pop()
    fmt = {k: flat.pop(k) for k in list(flat) if k in {f.name for f in fields(KVFormat)}}
    base = flat.pop("kv_format", None) or {}
    return SolverSettings(**flat, kv_format={**dict(base), **fmt})
