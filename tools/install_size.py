"""Installed size of oscar-calib's dependency closure per extra, from the distributions installed here.

Usage: python tools/install_size.py pyproject.toml
Sizes are the files each installed distribution lists (its RECORD), so they depend on the wheels installed
here (CPU torch on the development machine).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

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


def closure(names: list[str]) -> dict[str, md.Distribution]:
    """Every installed distribution `names` need, transitively (extras of requirements followed)."""
    seen: dict[str, md.Distribution] = {}
    todo = [(n, set()) for n in names]
    while todo:
        name, extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
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


def main(pyproject: str) -> None:
    with open(pyproject, "rb") as handle:
        project = tomllib.load(handle)["project"]

    def names(reqs: list[str]) -> list[str]:
        return [Requirement(r).name for r in reqs if applies(Requirement(r), set())]

    optional = project.get("optional-dependencies", {})
    for extras in ((), *((e,) for e in optional)):
        deps = closure(names(project["dependencies"]) + [n for e in extras for n in names(optional[e])])
        total = sum(dist_size(d) for d in deps.values())
        triton = dist_size(deps["triton"]) if "triton" in deps else 0
        print(f"extras={','.join(extras) or '(none)'}: {len(deps)} distributions, {total / 2**30:.2f} GiB "
              f"(triton {triton / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main(sys.argv[1])
