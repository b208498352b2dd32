"""The runtime wheel a release can carry (`push --with-wheels`), so that its model card's install line works for a
user who has only the zoo: neither `oscar-calib` nor `oscar-kv-runtime` is on a package index.

The wheel is built from the source tree this `oscar_calib` runs from (a clone: `runtime/pyproject.toml` next to
the package), with pip's own builder, offline and without build isolation (setuptools is already installed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from oscar_calib.errors import InputError

RUNTIME_WHEEL_PREFIX = "oscar_kv_runtime-"


def runtime_source_dir() -> Path | None:
    """`runtime/` of the clone the running code comes from, or None (installed from a wheel)."""
    import runtime_kernels

    candidate = Path(runtime_kernels.__file__).resolve().parents[1] / "runtime"
    return candidate if (candidate / "pyproject.toml").is_file() else None


def build_runtime_wheel(out_dir: Path) -> Path:
    """Build the `oscar-kv-runtime` wheel into `out_dir` (about 7 s) and return its path."""
    source = runtime_source_dir()
    if source is None:
        raise InputError("--with-wheels: builds the runtime wheel from the oscar-calib source tree, but this "
                         "oscar_calib is not installed from one; run push from a clone (`pip install -e .` there)")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(out_dir), str(source)], capture_output=True, text=True)
    wheels = sorted(out_dir.glob(f"{RUNTIME_WHEEL_PREFIX}*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        last = (done.stderr.strip().splitlines() or ["no wheel written"])[-1][:300]
        raise InputError(f"--with-wheels: building the runtime wheel from {source} failed: {last}")
    return wheels[0]


def is_runtime_wheel(name: str) -> bool:
    return name.startswith(RUNTIME_WHEEL_PREFIX) and name.endswith(".whl")
