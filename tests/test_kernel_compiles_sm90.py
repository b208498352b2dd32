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


def _run_bench(script: str, *args: str) -> str:
    """stdout of an offline-compiling bench script (in a subprocess, without the suite's TRITON_INTERPRET)."""
    if not all((TOOLS / t).exists() for t in ("ptxas", "nvdisasm", "cuobjdump")):
        pytest.skip(f"this Triton ships no CUDA assembler in {TOOLS}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def _sass_stats(*args: str, out: str | None = None) -> tuple[dict[str, int], int]:
    """-> (opcode family -> count in one tile of the loop, registers per thread) from bench/sass_loop_stats.py (run
    with args, or its stdout `out` from a run already made)."""
    out = out if out is not None else _run_bench("sass_loop_stats.py", *args)
    regs = int(re.search(r"(\d+) registers per thread", out).group(1))
    line = next(ln for ln in out.splitlines() if ln.startswith("by opcode:"))
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


def test_l2_prefetch_is_issued_before_the_query_conversion_for_sm90():
    """`DecodeOptions(prefetch_tiles=2)` compiled for sm_90: the prologue asks L2 for two tiles' K codes, V codes and
    quad scale rows (6 prefetches per lane) before the query's int8 conversion starts, so their HBM latency overlaps
    it (in one basic block the compiler sank them to the loop's own loads), and the loop does not spill."""
    out = _run_bench("sass_loop_stats.py", "--prefetch-tiles", "2")
    m = re.search(r"L2 prefetches in the prologue: (\d+), the last at instruction (\d+) of (\d+); the query's int8 "
                  r"conversion starts at (\d+)", out)
    assert m, out
    n, last, _, frnd = map(int, m.groups())
    assert n == 6 and last < frnd, out
    ops, _ = _sass_stats(out=out)
    assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0, ops


def test_production_grid_compiles_for_sm90_without_spills():
    """The production grid at Qwen3-8B geometry with the default options (`bench/grid_occupancy.py`, offline): no
    spills, and the programs per SM it reports are `launch.programs_per_sm_limit` of its registers and shared memory
    (what the split rule sizes the wave by on the GPU)."""
    from runtime_kernels.attention.int2_decode.launch import programs_per_sm_limit

    out = _run_bench("grid_occupancy.py", "--geometry", "8,32,128", "--caps", "0")
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines() if ln.startswith("| 8/32/128")]
    assert len(rows) == 1 and rows[0][1] == "none", rows
    regs, shared, stack, programs = map(int, rows[0][2:6])
    assert stack == 0, rows  # spill stack bytes
    assert programs == programs_per_sm_limit(regs, shared, 1) and programs >= 8, rows
