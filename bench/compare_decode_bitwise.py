"""Bit-for-bit comparison of this tree's decode kernels with a reference tree's (default: main at 90430f9, the
kernel before the int2_decode/ folder) at docs/kernels.md's nine decode points, on a GPU.

    python bench/compare_decode_bitwise.py --out OUT [--old-commit 90430f9 | --old-tree DIR] [--scale-format ue5m3]

The reference tree (a `git archive` of the commit into a temp dir, or a given directory) runs in a subprocess with
only that tree on its import path; it records its split counts and outputs for the same seeded inputs (built by
this file's `bench/common.py`, passed by path), then this process runs its own kernels with the same split counts
and compares with `torch.equal`. Since 710c306 the whole-page loop rounds differently from 90430f9's on purpose
(docs/kernels.md, "Thirty fewer instructions per tile"): a later change that claims the same bits compares against a
tree of 710c306 or newer (`--old-tree`). `--scale-format ue5m3` compares uint8 scale pools (the shipped format; the
reference tree must decode them), fp16 by default. `--old-layout paired_v` gives the reference tree the same values
in the scale/zero layout the cache allocated before quad pools (a tree without the quad loop would take the masked
tiles on quad pools, which sum in another order). Both processes check which `runtime_kernels` they imported, so a
tree cannot be compared with itself. Writes OUT/decode_bitwise_<GPU>.json (one row per point and launch form) and exits 1 on any
difference.
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
FORMS = {"two_launch": False, "one_launch": True}  # decode_attention(fused=...)


def run_decode(A, common, args: tuple, scale_format: str, fused: bool, num_splits: int | None = None) -> tuple:
    """(splits, (o, lse)) of one decode call on `decode_inputs`' tensors, through whichever API the imported tree
    has: the records (`PagePools`, `BatchMetadata`, `Windows`; their format where the tree's `PagePools` carries one)
    or the older loose tensors. num_splits None: the tree's default history splits."""
    if hasattr(A, "PagePools"):
        rec = common.decode_records(args, scale_format=scale_format)
        splits = A.decode_num_splits(*rec, fused=fused)
        out = A.decode_attention(*rec, fused=fused, num_splits=num_splits or splits[0])
    else:
        splits = A.decode_num_splits(*args, whole_pages=True, fused=fused)
        out = A.decode_attention(*args, whole_pages=True, fused=fused, num_splits=num_splits or splits[0])
    return tuple(splits), out


def child(old_tree: str, out_dir: str, scale_format: str, layout: str) -> None:
    """Runs in the reference tree's interpreter: record (splits, o, lse) of every point and launch form, on inputs
    with `scale_format` pools."""
    import torch

    import runtime_kernels
    from runtime_kernels import attention as A

    where = Path(runtime_kernels.__file__).resolve()
    if Path(old_tree).resolve() not in where.parents:
        raise SystemExit(f"reference run imported runtime_kernels from {where}, not from {old_tree}")
    sys.path.insert(0, str(HERE))
    import common

    for context, batch in common.DECODE_POINTS:
        args = common.decode_inputs(batch, context, seed=context + batch, scale_format=scale_format, layout=layout)
        for form, fused in FORMS.items():
            splits, (o, lse) = run_decode(A, common, args, scale_format, fused)
            torch.save({"splits": splits, "o": o.cpu(), "lse": lse.cpu()},
                       os.path.join(out_dir, f"{context}_{batch}_{form}.pt"))
        del args
        torch.cuda.empty_cache()


def reference_tree(args, tmp: str) -> str:
    if args.old_tree:
        return args.old_tree
    dest = os.path.join(tmp, "old")
    os.makedirs(dest)
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, cwd=HERE,
                          check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", args.old_commit, "runtime_kernels"], capture_output=True,
                             cwd=repo, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the results file")
    p.add_argument("--old-commit", default="90430f9", help="reference commit (git archive of runtime_kernels/)")
    p.add_argument("--old-tree", help="reference tree (a directory holding runtime_kernels/), instead of a commit")
    p.add_argument("--scale-format", default="float16", choices=["float16", "ue5m3"],
                   help="scale and zero pools of the compared inputs (default float16)")
    p.add_argument("--old-layout", default="quad", choices=["quad", "paired_v"],
                   help="scale/zero layout of the reference tree's inputs (default quad, as this tree's)")
    p.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        child(*args._child, args.scale_format, args.old_layout)
        return 0

    import torch

    import runtime_kernels
    from runtime_kernels import attention as A

    sys.path.insert(0, str(HERE))
    import common

    with tempfile.TemporaryDirectory() as tmp:
        old = reference_tree(args, tmp)
        if Path(old).resolve() in Path(runtime_kernels.__file__).resolve().parents:
            raise SystemExit(f"this process imported runtime_kernels from the reference tree {old}")
        if not (Path(old) / "runtime_kernels").is_dir():
            raise SystemExit(f"--old-tree: {old} holds no runtime_kernels/ directory")
        rec = os.path.join(tmp, "rec")
        os.makedirs(rec)
        env = {**os.environ, "PYTHONPATH": old}
        subprocess.run([sys.executable, __file__, "--out", args.out, "--scale-format", args.scale_format,
                        "--old-layout", args.old_layout, "--_child", old, rec], env=env, check=True, cwd=tmp)
        rows, same = [], True
        for context, batch in common.DECODE_POINTS:
            inputs = common.decode_inputs(batch, context, seed=context + batch, scale_format=args.scale_format)
            for form, fused in FORMS.items():
                want = torch.load(os.path.join(rec, f"{context}_{batch}_{form}.pt"))
                splits, (o, lse) = run_decode(A, common, inputs, args.scale_format, fused,
                                              num_splits=want["splits"][0])
                equal = torch.equal(o.cpu(), want["o"]) and torch.equal(lse.cpu(), want["lse"])
                same &= equal
                rows.append({"op": "decode_attention", "variant": form,
                             "shape": {"context": context, "batch": batch, "h_q": common.H_Q, "h_kv": common.H_KV,
                                       "d": common.D, "scale_format": args.scale_format},
                             "bit_identical": equal, "splits_reference": list(want["splits"]),
                             "splits_new_default": list(splits),
                             "max_abs_diff": float((o.cpu() - want["o"]).abs().max())})
                print(f"{context:>7} x {batch:<3} {form:<10} bit-identical={equal} splits ref={want['splits']} "
                      f"new default={splits}", flush=True)
            del inputs
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.scale_format == "float16" else f"_{args.scale_format}"
    path = out / f"decode_bitwise_{common.gpu_tag()}{suffix}.json"
    path.write_text(json.dumps({"meta": {**common.meta(), "reference": args.old_tree or args.old_commit,
                                         "reference_layout": args.old_layout},
                                "rows": rows}, indent=1))
    print(f"wrote {path}; all bit-identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
