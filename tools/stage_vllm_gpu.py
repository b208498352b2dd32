#!/usr/bin/env python3
"""vLLM 0.26.0 onto a GPU machine that has no package index, in parts that fit one transfer each.

The GPU image has Python 3.12, torch 2.11.0+cu130, triton 3.6 and transformers 5.17, but not vLLM nor 21 of the
wheels `from vllm import LLM` needs. `constraints/vllm-gpu-0.26.txt` pins them by sha256 (docs/vllm-gpu-staging.md).

    # here (package index reachable): download with --require-hashes, trim vllm's wheel, bundle, split
    python3 tools/stage_vllm_gpu.py prepare --out .stage [--extra FILE ...] [--part-mb 33]
    # on the GPU machine, once per part, in calls made back to back (each carries one .stage/part-NN folder)
    python3 tools/stage_vllm_gpu.py receive --part .stage/part-00 --stage /root/stage
    # on the GPU machine, after the last part: join, verify, install to a target folder
    python3 tools/stage_vllm_gpu.py install --stage /root/stage --target /root/vllm-site
    export PYTHONPATH=/root/vllm-site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1

The vllm wheel is trimmed of what serving a dense model on Hopper never loads (`TRIMMED`: FlashAttention 2, the Rust
`vllm serve` front end, the MoE kernels and vendored JIT sources), which halves it; `--full-vllm` keeps it whole.
Every part, the joined bundle and every wheel in it are checked against the sha256 that `prepare` recorded in
`manifest.json` (which travels in every part); the downloads themselves were checked against the pinned lock.

Exit codes: 0 done, 1 a download or pip failed, 2 a bad option, 4 a sha256 mismatch or a missing part.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints" / "vllm-gpu-0.26.txt"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
             "manylinux_2_5_x86_64")
# Members of vllm's wheel that a dense model on sm_90 never imports (checked on the GPU: "Using FlashAttention
# version 3" and the import guards in vllm/platforms/cuda.py, vllm/utils/deep_gemm.py).
TRIMMED = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FlashAttention 2 (FA3 serves Hopper)
           "vllm/vllm-rs",  # the Rust front end of `vllm serve`; the offline LLM does not start it
           "vllm/_moe_C_stable_libtorch.abi3.so",  # MoE kernels, imported under contextlib.suppress(ImportError)
           "vllm/third_party/deep_gemm/",  # FP8 GEMM JIT sources, imported lazily when DeepGEMM is enabled
           "vllm/third_party/fmha_sm100/")  # Blackwell-only attention sources
MANIFEST = "manifest.json"
BUNDLE = "bundle.tar"


class StageError(Exception):
    exit_code = 4


class FetchError(Exception):
    exit_code = 1


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def say(msg: str) -> None:
    print(f"[stage_vllm_gpu] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------------------
# here
# ------------------------------------------------------------------------------------------------------------
def download(dest: Path) -> list[Path]:
    """Every pinned wheel into `dest` (pip checks each against the lock's sha256)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), "-r", str(LOCK)]
    for tag in PLATFORMS:
        cmd += ["--platform", tag]
    say(f"pip download -r {LOCK.relative_to(ROOT)} (--require-hashes) -> {dest}")
    if subprocess.run(cmd).returncode:
        raise FetchError(f"pip download failed for {LOCK}; is the package index reachable?")
    wheels = sorted(dest.glob("*.whl"))
    pinned = [line.split()[0] for line in LOCK.read_text().splitlines() if line and not line.startswith("#")]
    if len(wheels) < len(pinned):
        raise StageError(f"{dest}: {len(wheels)} wheels for {len(pinned)} pins")
    return wheels


def trim_wheel(src: Path, dest_dir: Path, drop: tuple[str, ...]) -> Path:
    """A copy of wheel `src` without the members under `drop` (and their RECORD lines); same file name."""
    out = dest_dir / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
        for info in zin.infolist():
            if info.filename.startswith(drop):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "\n".join(line for line in lines if not line.startswith(drop)).encode() + b"\n"
            zout.writestr(info, data)
    return out


def _made_here(out: Path) -> bool:
    """Whether `out` is empty or holds only part-NN folders with a manifest (what `prepare` writes and replaces)."""
    return out.is_dir() and all(p.is_dir() and p.name.startswith("part-") and (p / MANIFEST).is_file()
                                for p in out.iterdir())


def prepare(out: Path, extras: list[Path], part_bytes: int, full_vllm: bool, cache: Path) -> None:
    for e in extras:
        if not e.is_file():
            raise StageError(f"--extra {e}: not a file")
    if out.exists() and not _made_here(out):
        raise StageError(f"--out {out}: exists and is not a stage folder this tool made (part-NN folders with "
                         f"their {MANIFEST}); give an empty or new folder")
    wheels = download(cache)
    with tempfile.TemporaryDirectory(prefix="stage-") as tmp:
        tmp = Path(tmp)
        entries = []
        for w in wheels:
            if w.name.startswith("vllm-") and not full_vllm:
                before = w.stat().st_size
                w = trim_wheel(w, tmp, TRIMMED)
                say(f"trimmed {w.name}: {before / 1e6:.1f} MB -> {w.stat().st_size / 1e6:.1f} MB")
            entries.append(w)
        bundle = tmp / BUNDLE
        files = {}
        with tarfile.open(bundle, "w") as tar:
            for path, kind in [(w, "wheel") for w in entries] + [(e, "extra") for e in extras]:
                tar.add(path, arcname=f"{kind}s/{path.name}")
                files[f"{kind}s/{path.name}"] = sha256(path)
        size = bundle.stat().st_size
        n = -(-size // part_bytes)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        parts = {}
        with open(bundle, "rb") as f:
            for i in range(n):
                d = out / f"part-{i:02d}"
                d.mkdir()
                data = f.read(part_bytes)
                (d / f"{BUNDLE}.{i:02d}").write_bytes(data)
                parts[f"{BUNDLE}.{i:02d}"] = hashlib.sha256(data).hexdigest()
        manifest = {"bundle_sha256": sha256(bundle), "bundle_bytes": size, "parts": parts, "files": files,
                    "lock_sha256": sha256(LOCK), "trimmed": [] if full_vllm else list(TRIMMED)}
        for i in range(n):
            (out / f"part-{i:02d}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    say(f"{len(entries)} wheels + {len(extras)} extras = {size / 1e6:.1f} MB in {n} parts of <= "
        f"{part_bytes / 1e6:.0f} MB under {out}/part-NN")


# ------------------------------------------------------------------------------------------------------------
# on the GPU machine
# ------------------------------------------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise StageError(f"{folder}: no {MANIFEST} (not a part made by `prepare`)")
    return json.loads(path.read_text())


def receive(part: Path, stage: Path) -> None:
    """Check one carried part against its manifest and copy it into `stage`."""
    manifest = read_manifest(part)
    chunks = [p for p in part.iterdir() if p.name in manifest["parts"]]
    if len(chunks) != 1:
        raise StageError(f"--part {part}: expected one {BUNDLE}.NN named in {MANIFEST}, found {len(chunks)}")
    chunk = chunks[0]
    got = sha256(chunk)
    if got != manifest["parts"][chunk.name]:
        raise StageError(f"{chunk}: sha256 {got}, expected {manifest['parts'][chunk.name]} (damaged in transfer)")
    stage.mkdir(parents=True, exist_ok=True)
    known = stage / MANIFEST
    if known.is_file() and read_manifest(stage)["bundle_sha256"] != manifest["bundle_sha256"]:
        raise StageError(f"{stage}: holds parts of another bundle; empty it first")
    shutil.copyfile(chunk, stage / chunk.name)
    shutil.copyfile(part / MANIFEST, known)
    have = sorted(p.name for p in stage.glob(f"{BUNDLE}.*"))
    say(f"{chunk.name} ok; {stage} holds {len(have)} of {len(manifest['parts'])} parts")


def install(stage: Path, target: Path, wheels_only: bool = False) -> None:
    """Join the parts, check everything, pip-install the wheels into `target` (no index, no dependencies).

    `wheels_only`: the wheels come first in the bundle, so the parts that hold them are enough to install vLLM;
    the extras after them (a model's GGUF) are left out, and each wheel is checked by its own sha256."""
    manifest = read_manifest(stage)
    names = sorted(manifest["parts"])
    missing = [name for name in names if not (stage / name).is_file()]
    if wheels_only:
        names = names[:names.index(missing[0])] if missing else names
    elif missing:
        raise StageError(f"{stage}: missing parts {missing} (the machine went cold between calls? re-send them)")
    bundle = stage / BUNDLE
    with open(bundle, "wb") as out:
        for name in names:
            got = sha256(stage / name)
            if got != manifest["parts"][name]:
                raise StageError(f"{stage / name}: sha256 {got}, expected {manifest['parts'][name]}")
            with open(stage / name, "rb") as f:
                shutil.copyfileobj(f, out)
    if len(names) == len(manifest["parts"]) and sha256(bundle) != manifest["bundle_sha256"]:
        raise StageError(f"{bundle}: the joined bundle does not match its sha256")
    unpacked = stage / "unpacked"
    shutil.rmtree(unpacked, ignore_errors=True)
    wanted = [rel for rel in manifest["files"] if rel.startswith("wheels/") or not wheels_only]
    todo = set(wanted)
    with tarfile.open(bundle, "r|") as tar:  # a stream: a bundle cut after the wheels is read up to its cut
        try:
            for member in tar:
                if member.name in todo:
                    tar.extract(member, unpacked, filter="data")
                    todo.discard(member.name)
                if not todo:
                    break
        except (tarfile.ReadError, EOFError):
            pass
    if todo:
        raise StageError(f"{sorted(todo)}: not in the {len(names)} of {len(manifest['parts'])} parts received")
    for rel in wanted:
        if sha256(unpacked / rel) != manifest["files"][rel]:
            raise StageError(f"{unpacked / rel}: sha256 mismatch")
    wheels = sorted(str(p) for p in (unpacked / "wheels").glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(target), *wheels]
    say(f"pip install {len(wheels)} wheels -> {target}")
    if subprocess.run(cmd).returncode:
        raise FetchError("pip install of the staged wheels failed")
    say(f"done: export PYTHONPATH={target}:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 "
        f"HF_HUB_OFFLINE=1; extras are in {unpacked / 'extras'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="download, trim, bundle and split (where the package index is reachable)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--extra", type=Path, action="append", default=[], help="a file to carry beside the wheels")
    p.add_argument("--part-mb", type=float, default=33.0, help="part size in MB (default 33)")
    p.add_argument("--full-vllm", action="store_true", help="keep vllm's wheel whole")
    p.add_argument("--cache", type=Path, default=Path("~/.cache/oscar-calib/vllm-gpu-wheels").expanduser())
    r = sub.add_parser("receive", help="check one carried part and copy it into the stage folder")
    r.add_argument("--part", type=Path, required=True)
    r.add_argument("--stage", type=Path, default=Path("/root/stage"))
    i = sub.add_parser("install", help="join, check and install the staged wheels")
    i.add_argument("--stage", type=Path, default=Path("/root/stage"))
    i.add_argument("--target", type=Path, required=True)
    i.add_argument("--wheels-only", action="store_true", help="install from the parts that hold the wheels")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "prepare":
            if not 1 <= args.part_mb <= 60:
                print("error: --part-mb: expected 1 to 60 (a part and the checkout share one 64 MiB transfer), got "
                      f"{args.part_mb}", file=sys.stderr)
                return 2
            prepare(args.out, args.extra, int(args.part_mb * 1e6), args.full_vllm, args.cache)
        elif args.cmd == "receive":
            receive(args.part, args.stage)
        else:
            install(args.stage, args.target, args.wheels_only)
    except (StageError, FetchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
