"""The runtime installs on its own (docs/runtime.md): `pip install ./runtime` into a fresh virtual environment (no
system site-packages) brings torch, safetensors and huggingface_hub and none of the calibrator's packages; there an
artifact that `oscar-calib run` wrote loads in one line, and a decode step through the INT2 cache (its torch path:
no Triton there) gives, bit for bit, what the full development install gives for the same inputs.

torch is installed there at this environment's version, through pip's own configuration (the wheel cache, the
find-links and indexes of pip.conf), as .ci/run installs it. The test skips only when pip cannot resolve torch and
its dependencies (no index reachable); any other failure of the install fails it. 43-61 s on 2 cores shared at load 6-8
(torch 18 s, the runtime 12 s, calibration 11 s, each serving process 4-9 s).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from safetensors.torch import load_file, save_file
from tiny_models import tiny_model

from oscar_calib.demo import byte_tokenizer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# The calibrator's packages (oscar-calib's own dependencies) and Triton (the `gpu` extra): none belongs there.
NOT_IN_RUNTIME = ("oscar-calib", "transformers", "accelerate", "pydantic", "typer", "rich", "ruamel-yaml", "triton",
                  "datasets")
# The modules of those packages (and PyYAML's): none may be imported by loading and serving an artifact.
NOT_IMPORTED = ("oscar_calib", "transformers", "accelerate", "pydantic", "typer", "rich", "ruamel", "triton",
                "datasets", "yaml")

# Run by both interpreters: load the artifact in one line, prefill 150 tokens (sink 4 | two INT2 pages | recent),
# one decode query per layer; the outputs to argv[3], then what it imported and from where as JSON on stdout.
SERVE = """
import json, sys
import torch
from safetensors.torch import load_file, save_file
import runtime_kernels

torch.set_num_threads(1)
art = runtime_kernels.load_artifact(sys.argv[1])
x = load_file(sys.argv[2])
cache = runtime_kernels.PagedKVCache.from_artifact(art, max_pages=8, max_seqs=1, dtype=torch.bfloat16)
sid = cache.add_sequence()
layers = range(art.num_layers)
cache.append([sid], [[x[f"k{i}"]] for i in layers], [[x[f"v{i}"]] for i in layers])
save_file({f"o{i}": cache.decode_attention(i, x[f"q{i}"], [sid]).contiguous() for i in layers}, sys.argv[3])
runtime_kernels.write_artifact(art, sys.argv[3] + ".artifact")  # writing needs numpy (safetensors[torch])
print(json.dumps({"runtime_kernels": runtime_kernels.__file__,
                  "imported": sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[4])))}))
"""

# What the environment holds: every distribution (normalized name) and which of them require PyYAML (not through
# one of their extras, which nothing here asked for).
INVENTORY = """
import json, re
from importlib.metadata import distributions
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
dists = {norm(d.metadata["Name"]): d for d in distributions()}
needs_yaml = sorted(n for n, d in dists.items() for r in d.requires or []
                    if norm(re.split(r"[ ;<>=!~\\[(]", r, 1)[0]) == "pyyaml" and "extra" not in r.partition(";")[2])
print(json.dumps({"installed": sorted(dists), "require_pyyaml": needs_yaml}))
"""


def clean_env() -> dict[str, str]:
    """This process's environment without what would put the checkout or this environment's packages on the path,
    and without TRITON_INTERPRET (the runtime then picks its torch path, as on a CPU server)."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV", "TRITON_INTERPRET"}
    return {k: v for k, v in os.environ.items() if k not in drop} | {"PYTHONNOUSERSITE": "1"}


def pip(venv_python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """This environment's pip, installing into the venv (`pip --python`): the venv itself holds no pip."""
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(venv_python), *args], capture_output=True,
                          text=True, cwd=cwd, env=clean_env())


def calibrate(root: Path, monkeypatch, capsys) -> Path:
    """`oscar-calib run` on a tiny Qwen3 (2 layers, 2 KV heads, head_dim 64), sink 4 and recent 8: an artifact
    with fitted rotations, written by the main package. --no-clip: the clip fit would take 25 s of the test's time
    (the cache's clipping is checked against its reference in tests/test_cache.py, not here)."""
    model = root / "tiny-qwen3"
    tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=64, num_layers=2, vocab_size=260,
               max_position_embeddings=256).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)
    gen = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "rotation", "head", "token", "query"]
    text = root / "calib.txt"
    text.write_text("\n\n".join(" ".join(words[int(i)] for i in torch.randint(0, 10, (60,), generator=gen))
                                 for _ in range(20)))
    out = root / "art"
    code, _, err = run_cli(["run", "--model", str(model), "--dataset", str(text), "--out", str(out), "--samples", "2",
                            "--seq-len", "64", "--sink", "4", "--recent", "8", "--no-clip"], monkeypatch, capsys)
    assert code == 0, err
    return out


def test_runtime_installs_alone_loads_an_artifact_and_decodes_like_the_full_install(tmp_path, monkeypatch, capsys):
    from runtime_kernels import read_artifact

    # first the environment (an offline machine skips before calibrating): torch, at this version
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=clean_env())
    python = venv / "bin" / "python"
    # --no-compile: no .pyc for the ~2000 modules of torch that nothing here imports (60 s -> 11 s to install)
    got = pip(python, "install", "--quiet", "--no-compile", f"torch=={torch.__version__}", cwd=tmp_path)
    # into an empty venv nothing can conflict: a failure to resolve means torch or one of its dependencies is on no
    # index pip reaches (offline: "No matching distribution"; torch in a local wheel cache, sympy nowhere: "conflicting")
    if got.returncode != 0 and re.search(r"No matching distribution found|Could not find a version that satisfies|"
                                         r"ResolutionImpossible", got.stderr):
        pytest.skip(f"pip reaches no index with torch=={torch.__version__} and its dependencies (offline?): "
                    f"{got.stderr.strip()[-300:]}")
    assert got.returncode == 0, got.stderr[-3000:]

    artifact_dir = calibrate(tmp_path, monkeypatch, capsys)
    art = read_artifact(artifact_dir)
    heads, kv_heads, d = (int(art.metadata[k]) for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    gen = torch.Generator().manual_seed(1)
    inputs = {}
    for i in range(art.num_layers):
        inputs[f"k{i}"] = torch.randn(150, kv_heads, d, generator=gen).to(torch.bfloat16)
        inputs[f"v{i}"] = torch.randn(150, kv_heads, d, generator=gen).to(torch.bfloat16)
        inputs[f"q{i}"] = torch.randn(1, heads, d, generator=gen).to(torch.bfloat16)
    save_file(inputs, tmp_path / "inputs.safetensors")
    script = tmp_path / "serve.py"
    script.write_text(SERVE)

    def serve(interpreter: str, out: str, env: dict[str, str]) -> dict:
        proc = subprocess.run([interpreter, str(script), str(artifact_dir), str(tmp_path / "inputs.safetensors"),
                               str(tmp_path / out), json.dumps(NOT_IMPORTED)], capture_output=True, text=True,
                              cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    # the reference: the same script with this checkout's packages, as the full install serves
    full = serve(sys.executable, "full.safetensors", clean_env() | {"PYTHONPATH": str(ROOT)})
    assert Path(full["runtime_kernels"]).is_relative_to(ROOT)

    # the runtime's wheel, built here with this environment's setuptools (`pip install ./runtime` builds the same in
    # an isolated environment: 15 s more; `pip install -e .` exercises that path in CI), then installed with its
    # dependencies from the index
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--wheel-dir", str(wheels), str(ROOT / "runtime")], capture_output=True, text=True,
                           env=clean_env())
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("oscar_kv_runtime-*.whl")
    got = pip(python, "install", "--quiet", "--no-compile", str(wheel), cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]

    inventory = subprocess.run([str(python), "-c", INVENTORY], capture_output=True, text=True, check=True,
                               cwd=tmp_path, env=clean_env())  # not the checkout: `-c` puts the cwd on sys.path
    inv = json.loads(inventory.stdout)
    assert {"oscar-kv-runtime", "torch", "safetensors", "huggingface-hub"} <= set(inv["installed"])
    assert sorted(set(inv["installed"]) & set(NOT_IN_RUNTIME)) == []
    # PyYAML is there only as huggingface_hub's own dependency; the runtime neither declares nor imports it to serve
    assert inv["require_pyyaml"] in ([], ["huggingface-hub"])

    alone = serve(str(python), "alone.safetensors", clean_env())
    assert Path(alone["runtime_kernels"]).is_relative_to(venv), alone  # the installed copy, not the checkout
    assert alone["imported"] == [] and full["imported"] == []
    want, have = load_file(tmp_path / "full.safetensors"), load_file(tmp_path / "alone.safetensors")
    assert sorted(have) == sorted(want) == [f"o{i}" for i in range(art.num_layers)]
    # the artifact written back by each install is the file that was loaded, byte for byte
    original = (artifact_dir / "oscar_kv.safetensors").read_bytes()
    for out in ("full", "alone"):
        assert (tmp_path / f"{out}.safetensors.artifact" / "oscar_kv.safetensors").read_bytes() == original, out
    for name in want:
        assert torch.isfinite(want[name]).all()
        assert torch.equal(have[name], want[name]), f"{name}: max |diff| {(have[name] - want[name]).abs().max()}"
