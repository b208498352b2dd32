"""Compile the product's own Triton launches for sm_90 on a machine without a GPU (Triton's offline compiler), and
read what the compiled kernel holds. Shared by `sass_loop_stats.py` and `grid_occupancy.py`.

`compile_launch(module, name, launch)` runs `launch()`, a product call that compiles a kernel through its JIT
function's `warmup` (`launch_grid(..., warmup=True)`, `launch_history(..., warmup=True)`), with `module.name`
standing in for that JIT function, so the kernel compiles from exactly the arguments and constexprs a GPU launch
would pass.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PTR_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int16: "*i16",
             torch.uint8: "*u8", torch.int32: "*i32"}
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_offline(fn, args: tuple, kw: dict):
    """Compile JIT function `fn` for sm_90 from the positional arguments and keywords a launch passes: tensors as
    16-byte-aligned pointers, ints as i32 (16-divisible where they are, as Triton specialises them, except the
    `do_not_specialize` ones), floats as fp32, constexpr parameters and keywords as constants, and the launch options
    (warps, stages, maxnreg) as options."""
    sig, attrs, const = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = kw[name] if name in kw else args[i]
        if name in kw or param.is_constexpr:
            sig[name], const[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = PTR_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if value % 16 == 0 and name not in fn.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: kw[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def compile_launch(module, name: str, launch):
    """The kernel `launch()` compiles through `module.name`'s `warmup`, compiled offline instead."""
    fn = getattr(module, name)
    compiled = []

    class Offline:  # stands in for the JIT function's GPU warmup
        def warmup(self, *args, grid, **kw):
            compiled.append(compile_offline(fn, args, kw))
            return compiled[-1]

    setattr(module, name, Offline())
    try:
        launch()
    finally:
        setattr(module, name, fn)
    return compiled[0]


def _tool(compiled, tool: str, *flags: str) -> str:
    """stdout of one of Triton's bundled CUDA tools (nvdisasm, cuobjdump) run on the kernel's cubin."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(TOOLS / tool), *flags, path], capture_output=True, text=True, check=True).stdout


def disassemble(compiled, line_info: bool = False) -> str:
    """The kernel's SASS (nvdisasm, Triton's bundled copy)."""
    return _tool(compiled, "nvdisasm", *(["-c", "-g"] if line_info else ["-c"]))


def resources(compiled) -> dict:
    """Registers per thread, shared memory bytes and local-memory stack bytes (spills) of a compiled kernel."""
    res = _tool(compiled, "cuobjdump", "--dump-resource-usage")
    regs, stack = (int(re.search(rf"{k}:(\d+)", res).group(1)) for k in ("REG", "STACK"))
    return {"regs": regs, "shared": int(compiled.metadata.shared), "stack": stack}
