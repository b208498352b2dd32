"""The runtime stays slim: importing it pulls in none of the calibration-side packages (DESIGN.md section 2)."""

import subprocess
import sys

import pytest

FORBIDDEN = ("oscar_calib", "transformers", "pydantic", "typer", "rich", "datasets", "accelerate", "yaml", "ruamel")


def test_runtime_kernels_imports_only_its_allowed_dependencies():
    code = (
        "import sys, runtime_kernels, runtime_kernels.cache, runtime_kernels.attention, runtime_kernels.quant, "
        "runtime_kernels.loader\n"
        f"bad = sorted({{m.split('.')[0] for m in sys.modules}} & set({FORBIDDEN!r}))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"runtime_kernels imported {out.stdout.strip()}"


def test_the_zoo_manifest_check_needs_pyyaml_only_when_there_is_a_manifest(tmp_path, monkeypatch):
    """The loader's one YAML read: without PyYAML (huggingface_hub normally brings it) a zoo that has a manifest is
    refused with the install line, since the release cannot be checked against it; a zoo without one needs nothing."""
    from runtime_kernels.artifact import ArtifactError
    from runtime_kernels.loader import ReleaseNotFoundError, check_against_repo_manifest

    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    record = {"version": "v1", "files": {}}
    args = (record, "org/zoo", "a" * 40, "org/model", "default", "v1", "org/zoo@v1")

    def no_manifest(name):
        raise ReleaseNotFoundError(name)

    assert check_against_repo_manifest(*args, download=no_manifest) is None
    manifest = tmp_path / "zoo_manifest.yaml"
    manifest.write_text("schema_version: 1\nreleases: []\n")
    with pytest.raises(ArtifactError, match=r"org/zoo@aaaaaaaaaaaa:zoo_manifest.yaml: checking release 'v1' .*"
                                            r"needs PyYAML.*`pip install pyyaml`; nothing was used"):
        check_against_repo_manifest(*args, download=lambda name: manifest)
