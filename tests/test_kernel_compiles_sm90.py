"""The production history kernel compiles for the H200 (sm_90) with the installed Triton, its inline PTX included.

The interpreter runs the kernels' plain-Triton forms; the byte permutes, shifts and masks written as inline PTX
(`kernel._ASM_QUARTERS`, `kernel._ASM_SUBN`, `common._ue5m3_in_word`, `common._zero_in_word`) only run compiled. This
test compiles the kernel offline for sm_90 with `bench/sass_loop_stats.py` (in a subprocess: the suite's
TRITON_INTERPRET=1 makes every kernel an interpreted function), so a PTX error or a tile loop that spills to local
memory shows up without a GPU. No timing is asserted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # the CUDA assembler Triton ships


def _sass_stats(*args: str) -> tuple[dict[str, int], int]:
    """-> (opcode family -> count in one tile of the loop, registers per thread) from bench/sass_loop_stats.py."""
    if not all((TOOLS / t).exists() for t in ("ptxas", "nvdisasm", "cuobjdump")):
        pytest.skip(f"this Triton ships no CUDA assembler in {TOOLS}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "sass_loop_stats.py"), *args], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    regs = int(re.search(r"(\d+) registers per thread", res.stdout).group(1))
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("by opcode:"))
    ops = {k: int(v) for k, v in re.findall(r"([A-Z0-9_]+) (\d+)", line)}
    return ops, regs


@pytest.mark.parametrize("args", [(), ("--scale-format", "float16", "--uncentered")],
                         ids=["shipped ue5m3 centered", "fp16 uncentered"])
def test_history_kernel_compiles_for_sm90_without_spills(args):
    ops, regs = _sass_stats(*args)
    # The whole-page loop: int8 score MMAs (4 quarters x 4 pieces) and fp16 V MMAs (8 code positions x 4 pieces).
    assert ops.get("IMMA") == 16 and ops.get("HMMA") == 32, ops
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0, f"the tile loop spills to local memory: {ops}"
    assert regs <= 255, regs
