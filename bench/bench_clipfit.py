"""CPU time of one layer's clip fit (`oscar_calib.calibration.clipfit.fit_layer`), this tree against a reference
commit, on the same seeded held-out data; and whether the two trees fit the same errors bit for bit.

    python bench/bench_clipfit.py --out OUT [--old-commit 56b1ab4~1] [--reps 5] [--threads 1]

The shape is the demo's layer (`make demo`: the trained fixture at its 4096-token context): one held-out sequence,
2 KV heads of 2 query heads each, head_dim 128, 256 held-out queries, the shipped recipe (centered, `block_out` key
objective through a 512-wide o_proj, the default grids with their extension, ue5m3 scales, 128/1024 windows).
Each tree runs in its own subprocess with only that tree's `oscar_calib` and `runtime_kernels` on its path; the
reps alternate between the trees so that a load change on the machine hits both. Timing is CPU time of the
process (`time.process_time`) at `--threads` torch threads, so other work on the machine inflates it less than
wall time. Writes OUT/clipfit_cpu.json (the bench schema of `bench/common.py`, times in ms) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHAPE = dict(seqs=1, kv_heads=2, group=2, tokens=4096, head_dim=128, queries=256, hidden=512)


def child(tree: str, threads: int, out: str) -> None:
    """Runs with `tree` first on sys.path: one timed fit of the shape, its errors saved to `out`."""
    import time

    import torch

    import oscar_calib
    import runtime_kernels
    from oscar_calib.calibration.clipfit import fit_layer
    from oscar_calib.config import SolverSettings

    for mod in (oscar_calib, runtime_kernels):
        if Path(tree).resolve() not in Path(mod.__file__).resolve().parents:
            raise SystemExit(f"imported {mod.__name__} from {mod.__file__}, not from {tree}")
    torch.set_num_threads(threads)
    s = SHAPE
    gen = torch.Generator().manual_seed(0)
    scale = torch.linspace(0.3, 3.0, s["head_dim"])  # uneven channels, as real keys have
    keys = torch.randn(s["seqs"], s["kv_heads"], s["tokens"], s["head_dim"], generator=gen) * scale + 0.5
    values = torch.randn(s["seqs"], s["kv_heads"], s["tokens"], s["head_dim"], generator=gen)
    queries = torch.randn(s["seqs"], s["kv_heads"] * s["group"], s["queries"], s["head_dim"], generator=gen)
    positions = torch.randperm(s["tokens"], generator=gen)[:s["queries"]].sort().values[None]
    rot = torch.linalg.qr(torch.randn(s["kv_heads"], s["head_dim"], s["head_dim"], generator=gen,
                                      dtype=torch.float64))[0].float()
    w_o = torch.randn(s["hidden"], s["kv_heads"] * s["group"] * s["head_dim"], generator=gen) / 32
    settings = SolverSettings()
    t0 = time.process_time()
    fit = fit_layer(keys, values, queries, positions, rot, rot.flip(0), settings.k_clip_grid,
                    s["head_dim"] ** -0.5, settings.kv_format(), key_objective=settings.key_clip_objective,
                    v_grid=settings.v_clip_grid, k_mean=keys.mean(dim=(0, 2)), v_mean=values.mean(dim=(0, 2)),
                    o_weight=w_o)
    cpu_s = time.process_time() - t0
    torch.save({"cpu_s": cpu_s, "k_errors": fit.k_errors, "v_errors": fit.v_errors, "k_grid": fit.k_grid,
                "v_grid": fit.v_grid}, out)


def archive(commit: str, dest: str) -> str:
    data = subprocess.run(["git", "archive", commit, "oscar_calib", "runtime_kernels"], capture_output=True,
                          cwd=ROOT, check=True).stdout
    os.makedirs(dest)
    subprocess.run(["tar", "-x", "-C", dest], input=data, check=True)
    return dest


def run_tree(tree: str, threads: int, out: str) -> dict:
    import torch

    env = {**os.environ, "PYTHONPATH": tree}
    subprocess.run([sys.executable, __file__, "--out", os.path.dirname(out), "--_child", tree, str(threads), out],
                   check=True, env=env, cwd=tree)
    return torch.load(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for clipfit_cpu.json")
    p.add_argument("--old-commit", default="56b1ab4~1", help="reference commit (git archive of oscar_calib/ and "
                                                               "runtime_kernels/)")
    p.add_argument("--reps", type=int, default=5, help="timed fits per tree (alternating)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each fit")
    p.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        child(args._child[0], int(args._child[1]), args._child[2])
        return 0
    import statistics

    import torch

    sys.path.insert(0, str(HERE))
    import common

    trees = {"this tree": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        trees["reference"] = archive(args.old_commit, os.path.join(tmp, "old"))
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for rep in range(args.reps):
            for name, tree in trees.items():
                runs[name].append(run_tree(tree, args.threads, os.path.join(tmp, f"{rep}_{len(runs[name])}.pt")))
                print(f"rep {rep} {name}: {runs[name][-1]['cpu_s']:.2f} s CPU", flush=True)
    new, old = runs["this tree"][0], runs["reference"][0]
    same = (new["k_grid"] == old["k_grid"] and new["v_grid"] == old["v_grid"]
            and torch.equal(new["k_errors"], old["k_errors"]) and torch.equal(new["v_errors"], old["v_errors"]))
    rows = []
    for name, rs in runs.items():
        ms = sorted(r["cpu_s"] * 1000 for r in rs)
        q = statistics.quantiles(ms, n=5) if len(ms) > 1 else [ms[0]] * 4
        rows.append(common.row("clip_fit_layer_cpu", name, {**SHAPE, "threads": args.threads},
                               (statistics.median(ms), q[0], q[3]), cpu_ms=ms,
                               tree="HEAD" if name == "this tree" else args.old_commit,
                               k_grid=list(rs[0]["k_grid"]), v_grid=list(rs[0]["v_grid"])))
    ratio = rows[0]["p50_ms"] / rows[1]["p50_ms"]
    rows.append({"op": "clip_fit_layer_cpu", "variant": "comparison", "shape": SHAPE,
                 "cpu_time_ratio_p50": ratio, "errors_bit_identical": same})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "clipfit_cpu.json"
    path.write_text(json.dumps({"meta": common.meta(), "rows": rows}, indent=1))
    for r in rows[:2]:
        print(f"{r['variant']:>10}: median {r['p50_ms'] / 1000:.2f} s CPU over {args.reps} fits")
    print(f"this tree / reference: {ratio:.2f}; errors bit-identical: {same}")
    print("wrote", path)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
