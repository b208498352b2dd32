"""The KV format crosses its borders whole: no module but `runtime_kernels/format.py` derives or defaults one.

`runtime_kernels.format.KVFormat` is the one value of the INT2 history's encoding and `DEFAULT_FORMAT` its one
default; everything else takes the value (`fmt`) and reads its fields. This test reads the source tree (every .py
file under `runtime_kernels/` and `oscar_calib/`, parsed with `ast`) and reports, as `path:line: rule: text`:

1. `literal-name`: a string literal equal to a scale format or quantizer name that is unique to the format
   (`ue5m3`, `uniform_minmax`, `uniform_unbiased`; from `format.SCALE_FORMATS` / `format.QUANTIZERS`), except as
   the right-hand side of a comparison whose left side is an attribute `.scale_format` or `.quantizer` (that reads
   the value: `fmt.scale_format == "ue5m3"`). `float16` is also the name of a torch dtype (model dtypes, window
   dtypes), so the literal rule cannot tell its uses apart; rules 2 and 3 cover it.
2. `constant-default`: a format field (`sink_tokens`, `recent_tokens`, `page_size`, `group_size`, `scale_format`,
   `quantizer`, `centered`, and the spellings `sink`, `recent`, `page`, `group`, `scale_dtype`) given a constant
   (a number or a string, anywhere in the expression; None and booleans are not format values) as a parameter
   default, a keyword argument, or an annotated class field; or a module-level name ending in `PAGE_SIZE`,
   `GROUP_SIZE`, `SCALE_FORMAT`, `SCALE_DTYPE`, `QUANTIZER`, `SINK_TOKENS` or `RECENT_TOKENS` bound to a constant.
3. `dtype-inference`: a comparison of an attribute `.dtype` with `torch.uint8` or a `torch.float8_*` dtype (the
   storage dtypes that would name a scale format), or a call of a function whose name says it maps a dtype to a
   format (`scale_format_of`, `format_of_dtype`).

`ALLOWED` lists the few findings that are not format derivation, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

from runtime_kernels.format import QUANTIZERS, SCALE_FORMATS

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("runtime_kernels", "oscar_calib")
FORMAT_MODULE = "runtime_kernels/format.py"

# (path, rule, the finding's text): why it is not a format derivation.
ALLOWED = {
    ("runtime_kernels/quant/naive.py", "literal-name", "ue5m3"):
        "SCALE_STORAGE maps each format name to the torch dtype its scales are stored in (name -> dtype, never "
        "back); format.py is torch-free, so the table lives with the quantizer, checked against SCALE_FORMATS",
    ("oscar_calib/analysis/methods.py", "constant-default", "scale_format"):
        "KIVI_FORMAT and the per-token baselines' fallback: the peer methods' own fixed encodings (fp16 min-max), "
        "compared against the project's format, not formats of this project",
    ("oscar_calib/analysis/methods.py", "constant-default", "quantizer"): "as above: KIVI-2 and the baselines",
    ("oscar_calib/analysis/methods.py", "literal-name", "uniform_minmax"): "as above: KIVI-2 and the baselines",
    ("oscar_calib/analysis/audit.py", "literal-name", "uniform_minmax"): "as above: AUDIT_FORMAT",
    ("oscar_calib/analysis/audit.py", "constant-default", "scale_format"):
        "AUDIT_FORMAT: the audit compares rotations at one fixed scale format whatever the artifact stores",
    ("oscar_calib/analysis/audit.py", "constant-default", "quantizer"):
        "AUDIT_FORMAT: min-max for a codebook artifact the runtime does not serve (its rotations are still audited)",
    ("oscar_calib/zoo/reference_format.py", "constant-default", "scale_format"):
        "the reference implementation's export format is fixed by that code (fp16/fp32 scales, min-max, one group "
        "per row): a foreign format's facts, read and written by import/export",
    ("oscar_calib/zoo/reference_format.py", "constant-default", "quantizer"): "as above: the reference's format",
    ("oscar_calib/zoo/reference_format.py", "literal-name", "uniform_minmax"): "as above: the reference's format",
    ("oscar_calib/zoo/reference_format.py", "constant-default", "REFERENCE_SCALE_DTYPE"):
        "as above: the reference stores fp32 scales",
}

UNIQUE_NAMES = frozenset(SCALE_FORMATS + QUANTIZERS) - {"float16"}
FIELD_NAMES = frozenset({"sink_tokens", "recent_tokens", "page_size", "group_size", "scale_format", "quantizer",
                         "centered", "sink", "recent", "page", "group", "scale_dtype"})
CONSTANT_SUFFIXES = ("PAGE_SIZE", "GROUP_SIZE", "SCALE_FORMAT", "SCALE_DTYPE", "QUANTIZER", "SINK_TOKENS",
                     "RECENT_TOKENS")
READING_ATTRIBUTES = frozenset({"scale_format", "quantizer"})
INFERRING_CALLS = frozenset({"scale_format_of", "format_of_dtype"})


def _format_constant(node: ast.AST) -> bool:
    """True when `node` holds a number or string constant anywhere (None and booleans are not format values)."""
    return any(isinstance(n, ast.Constant) and isinstance(n.value, (int, float, str)) and not isinstance(n.value, bool)
               for n in ast.walk(node))


def _storage_dtype(node: ast.AST) -> bool:
    """`torch.uint8` or `torch.float8_*`."""
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
            and (node.attr == "uint8" or node.attr.startswith("float8")))


def format_findings(source: str, path: str = "<string>") -> list[tuple[str, int, str, str]]:
    """(path, line, rule, text) of every format derivation in `source` (rules: the module docstring)."""
    tree = ast.parse(source)
    found = []
    reading = set()  # ids of literals that are the right-hand side of `x.scale_format == ...`
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            left = node.left
            if isinstance(left, ast.Attribute) and left.attr in READING_ATTRIBUTES:
                for comp in node.comparators:
                    reading.update(id(n) for n in ast.walk(comp))
            operands = [left, *node.comparators]
            if any(isinstance(o, ast.Attribute) and o.attr == "dtype" for o in operands) and any(
                    _storage_dtype(n) for o in operands for n in ast.walk(o)):
                found.append((path, node.lineno, "dtype-inference", ast.unparse(node)))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in INFERRING_CALLS:
                found.append((path, node.lineno, "dtype-inference", name))
            for kw in node.keywords:
                if kw.arg in FIELD_NAMES and _format_constant(kw.value):
                    found.append((path, kw.value.lineno, "constant-default", kw.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg in FIELD_NAMES and _format_constant(default):
                    found.append((path, default.lineno, "constant-default", arg.arg))
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and stmt.target.id in FIELD_NAMES and stmt.value is not None and _format_constant(stmt.value)):
                    found.append((path, stmt.lineno, "constant-default", stmt.target.id))
    for stmt in tree.body:  # module-level constants named as a format field
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(
            stmt, ast.AnnAssign) and stmt.value is not None else []
        for t in targets:
            if isinstance(t, ast.Name) and t.id.endswith(CONSTANT_SUFFIXES) and _format_constant(stmt.value):
                found.append((path, stmt.lineno, "constant-default", t.id))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in UNIQUE_NAMES
                and id(node) not in reading):
            found.append((path, node.lineno, "literal-name", node.value))
    return sorted(set(found), key=lambda f: (f[1], f[2], f[3]))


def tree_findings() -> list[tuple[str, int, str, str]]:
    """Findings over the scanned packages, less format.py and ALLOWED."""
    out = []
    for package in SCANNED:
        for file in sorted((ROOT / package).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            if rel == FORMAT_MODULE:
                continue
            out += [f for f in format_findings(file.read_text(), rel) if (f[0], f[2], f[3]) not in ALLOWED]
    return out


def test_no_module_but_format_py_derives_or_defaults_the_format():
    found = tree_findings()
    assert not found, "format derived outside runtime_kernels/format.py (take a KVFormat instead):\n" + "\n".join(
        f"{p}:{line}: {rule}: {text}" for p, line, rule, text in found)


def test_every_allowance_is_still_needed():
    """An ALLOWED entry that matches nothing is stale: it would let a later derivation in unseen."""
    seen = set()
    for package in SCANNED:
        for file in (ROOT / package).rglob("*.py"):
            rel = file.relative_to(ROOT).as_posix()
            seen.update((f[0], f[2], f[3]) for f in format_findings(file.read_text(), rel))
    assert not set(ALLOWED) - seen, sorted(set(ALLOWED) - seen)


PLANTED = '''
import torch

PAGE_SIZE = 64

def write(x, group_size=128, *, scale_format="float16"):
    fmt = "ue5m3" if x.dtype == torch.uint8 else "float16"
    return launch(x, page_size=16, quantizer="uniform_unbiased")

class Settings:
    sink_tokens: int = 128
    recent_tokens: int = None

def reads(fmt, x):
    if fmt.scale_format == "ue5m3" and fmt.quantizer != "uniform_minmax":
        return scale_format_of(x.dtype)
'''


def test_the_checker_reports_each_kind_of_planted_derivation():
    """Each rule fires on a planted violation, and the value reads (`fmt.scale_format == "ue5m3"`, a None default)
    do not."""
    found = {(line, rule, text) for _, line, rule, text in format_findings(PLANTED)}
    assert found == {
        (4, "constant-default", "PAGE_SIZE"),
        (6, "constant-default", "group_size"),
        (6, "constant-default", "scale_format"),
        (7, "literal-name", "ue5m3"),
        (7, "dtype-inference", "x.dtype == torch.uint8"),
        (8, "constant-default", "page_size"),
        (8, "constant-default", "quantizer"),
        (8, "literal-name", "uniform_unbiased"),
        (11, "constant-default", "sink_tokens"),
        (16, "dtype-inference", "scale_format_of"),
    }



def test_a_clip_ratio_below_the_floor_fails_when_the_flags_are_parsed(tmp_path, monkeypatch, capsys):
    """`--k-clip-grid 0.3` is refused before any model or statistics file is read: one line naming the flag, the
    value and the floor, exit 2 (bad input, docs/errors.md), nothing written."""
    from cli_helpers import run_cli

    from oscar_calib.cli import exit_codes
    from runtime_kernels.format import MIN_CLIP_RATIO

    stats = tmp_path / "missing.safetensors"  # never read: the flags are checked first
    for command in (["refit", str(stats)], ["run", "--model", str(tmp_path / "no-model")]):
        code, out, err = run_cli([*command, "--out", str(tmp_path / "o"), "--k-clip-grid", "0.3,0.9"],
                                 monkeypatch, capsys)
        assert code == exit_codes.BAD_INPUT and out == "", err
        line = err.strip()
        assert "\n" not in line and line.startswith("Error: --k-clip-grid '0.3,0.9': 0.3 is outside"), line
        assert f"clip floor is {MIN_CLIP_RATIO:g}" in line
        assert not (tmp_path / "o").exists()
