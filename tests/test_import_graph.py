"""The packages' import graph has no cycles, deferred (function-level) imports included, and no module imports a
private name of another: a command imports shared helpers from `oscar_calib.cli._common`, not from a sibling.

The graph is read statically with `ast` (every `import` / `from ... import` anywhere in a module), so an import
placed inside a function to dodge a cycle at load time still counts as the edge it is.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("oscar_calib", "runtime_kernels")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # the tree does not change during a test session
def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(path: Path, known: dict[str, Path]) -> list[tuple[str, str]]:
    """(imported module, name or '') pairs of the project's own modules that `path` imports anywhere in its body."""
    return _imports_of(path, frozenset(known))


@functools.cache
def _imports_of(path: Path, known: frozenset[str]) -> list[tuple[str, str]]:
    me = module_name(path)
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = me.split(".")[: -node.level] if path.name != "__init__.py" else me.split(".")[: len(me.split(".")) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # `from pkg import module`
                    out.append((sub, ""))
                elif base in known:
                    out.append((base, alias.name))
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    for name, path in known.items():
        for target, _ in imports_of(path, known):
            # a package's __init__ importing its own submodules is how packages are built, not a cycle
            if target != name and not (name == target.rsplit(".", 1)[0] and path.name == "__init__.py"):
                edges[name].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first = last), or None. Iterative DFS with colours."""
    colour = {m: 0 for m in edges}  # 0 new, 1 on the stack, 2 done
    for start in sorted(edges):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(edges[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(child) == 1:
                return path[path.index(child):] + [child]
            elif colour.get(child) == 0:
                colour[child] = 1
                stack.append((child, iter(sorted(edges[child]))))
                path.append(child)
    return None


def test_no_import_cycles_deferred_imports_included():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# The calibration package's modules share only public names. The kernels' private `@triton.jit` helpers
# (`_int2_chunk`, ...) are shared across the kernel modules by Triton's convention and stay out of this rule.
@pytest.mark.parametrize("package", ["oscar_calib"])
def test_no_module_imports_another_modules_private_name(package):
    known = modules()
    offenders = []
    for name, path in known.items():
        if not name.startswith(package):
            continue
        for target, imported in imports_of(path, known):
            if imported.startswith("_") and not imported.startswith("__") and target != name:
                offenders.append(f"{name} imports {target}.{imported}")
    assert not offenders, offenders


# oscar_calib is laid out as its pipeline: shared foundations at the top (config, errors, loading, placement,
# interception, progress, interrupts, demo), then calibration, the zoo and analysis, with the CLI over them. A sub-package may import the
# foundations and the packages listed for it, nothing above: the zoo publishes what calibration wrote without
# importing it, analysis reads artifacts and reuses calibration's pieces, and only the CLI imports the CLI.
LAYERS = {
    "oscar_calib.zoo": set(),
    "oscar_calib.calibration": {"oscar_calib.zoo"},  # the artifact's model card is written with it
    "oscar_calib.analysis": {"oscar_calib.calibration", "oscar_calib.zoo"},
    "oscar_calib.cli": {"oscar_calib.calibration", "oscar_calib.zoo", "oscar_calib.analysis"},
}


def sub_package(module: str) -> str | None:
    return next((p for p in LAYERS if module == p or module.startswith(p + ".")), None)


def test_the_calibration_package_is_laid_out_as_its_pipeline():
    known = modules()
    assert all(p in known for p in LAYERS), "each layer is a package with an __init__.py"
    flat = [m for m, path in known.items() if m.startswith("oscar_calib.") and m.count(".") == 1
            and path.name != "__init__.py"]
    # the foundations only (loading and its GGUF header check among them): every step of the pipeline lives in its
    # sub-package
    assert len(flat) <= 10, flat
    offenders = []
    for name, path in known.items():
        mine = sub_package(name)
        for target, _ in imports_of(path, known):
            theirs = sub_package(target)
            if mine is None:  # a foundation imports no layer (`python -m oscar_calib` is the CLI's entry point)
                if name.startswith("oscar_calib.") and theirs and name != "oscar_calib.__main__":
                    offenders.append(f"foundation {name} imports {target}")
            elif theirs and theirs != mine and theirs not in LAYERS[mine]:
                offenders.append(f"{name} imports {target}")
    assert not offenders, offenders


# calibration/ has two rooms: the steps of a run (data, capture, statistics, solve, clip fit, artifact) and, in
# calibration/scale/, the scale-out (ranks, sharded capture, checkpoints, disk and memory budgets). The scale-out
# works on the steps' statistics and capture session, never on their solver or the job; of the steps only the job,
# which runs both, imports the scale-out.
SCALE = "oscar_calib.calibration.scale"
SCALE_OUT = {"distributed", "sharded_capture", "checkpoint", "disk_budget", "memory"}
STEPS_THE_SCALE_OUT_USES = {"oscar_calib.calibration.stats", "oscar_calib.calibration.stats_checks",
                            "oscar_calib.calibration.stats_file", "oscar_calib.calibration.capture"}


def test_calibration_keeps_its_scale_out_apart_from_the_steps_of_a_run():
    known = modules()
    assert {m.rsplit(".", 1)[-1] for m in known if m.startswith(SCALE + ".")} == SCALE_OUT
    assert not SCALE_OUT & {m.rsplit(".", 1)[-1] for m in known if m.count(".") == 2
                            and m.startswith("oscar_calib.calibration.")}, "a scale-out module outside scale/"
    offenders = []
    for name, path in known.items():
        for target, _ in imports_of(path, known):
            if name.startswith(SCALE + "."):
                if (target.startswith("oscar_calib.calibration.") and not target.startswith(SCALE)
                        and target not in STEPS_THE_SCALE_OUT_USES):
                    offenders.append(f"scale-out {name} imports the step {target}")
            elif (name.startswith("oscar_calib.calibration") and name != "oscar_calib.calibration.job"
                  and target.startswith(SCALE)):
                offenders.append(f"step {name} imports the scale-out {target}")
    assert not offenders, offenders
