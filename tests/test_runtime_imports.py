"""The runtime stays slim: importing it pulls in none of the calibration-side packages (DESIGN.md section 2)."""

import subprocess
import sys

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
