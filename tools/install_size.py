"""Installed size of a distribution's dependency closure per extra, from the distributions installed here.

Usage: python tools/install_size.py oscar-calib        (or oscar-kv-runtime: the runtime alone, docs/runtime.md)
The requirements are the installed distribution's own (its METADATA), so `pip install -e .` first. Sizes are the
files each installed distribution lists (its RECORD), so they depend on the wheels installed here (CPU torch on
the development machine).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement

ENV = default_environment()


def dist_size(dist: md.Distribution) -> int:
    total = 0
    for f in dist.files or []:
        try:
            total += os.path.getsize(dist.locate_file(f))
        except OSError:
            pass
    return total


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**ENV, "extra": e}) for e in (extras or {""}))


def closure(todo: list[tuple[str, set[str]]]) -> dict[str, md.Distribution]:
    """Every installed distribution that the (name, extras) of `todo` need, transitively, extras followed."""
    seen: dict[str, md.Distribution] = {}
    visited: set[tuple[str, frozenset[str]]] = set()  # a distribution again with other extras needs more
    while todo:
        name, extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if (key, frozenset(extras)) in visited:
            continue
        visited.add((key, frozenset(extras)))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if applies(req, extras):
                todo.append((req.name, set(req.extras)))
    return seen


def main(name: str) -> None:
    extras = md.distribution(name).metadata.get_all("Provides-Extra") or []
    for chosen in ((), *((e,) for e in extras)):
        deps = closure([(name, set(chosen))])
        total = sum(dist_size(d) for d in deps.values())
        triton = dist_size(deps["triton"]) if "triton" in deps else 0
        print(f"extras={','.join(chosen) or '(none)'}: {len(deps)} distributions, {total / 2**30:.2f} GiB "
              f"(triton {triton / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main(sys.argv[1])
