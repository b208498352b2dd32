"""Run the `oscar-calib` CLI in this process and stop it with a real signal at a chosen point (for tests).

    python tests/fault_runner.py WHEN:N SIGNAL [RANK] -- run --model ...

WHEN is `forward` (before the N-th statistics batch), `checkpoint` (right after the N-th checkpoint is on disk)
or `replace` (the N-th checkpoint is written to its temporary file but not yet renamed into place). SIGNAL is
KILL or INT. With RANK, only that data-parallel rank (`RANK` of torchrun) is stopped.
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> None:
    sep = sys.argv.index("--")
    when, sig_name, *rank = sys.argv[1:sep]
    point, n = when.split(":")
    sig = getattr(signal, f"SIG{sig_name}")
    sys.argv = ["oscar-calib", *sys.argv[sep + 1:]]
    if not rank or os.environ.get("RANK", "0") == rank[0]:
        _arm(point, int(n), sig)
    from oscar_calib.cli import main as cli_main

    cli_main()


def _arm(point: str, n: int, sig: int) -> None:
    import oscar_calib.calibration.scale.sharded_capture as sc

    calls = {"n": 0}

    def hit() -> None:
        calls["n"] += 1
        if calls["n"] == n:
            os.kill(os.getpid(), sig)

    if point == "forward":
        real_forward = sc.forward_batch

        def forward(*args, **kwargs):
            hit()
            return real_forward(*args, **kwargs)

        sc.forward_batch = forward
    elif point == "checkpoint":
        real_save = sc.save_checkpoint

        def save(*args, **kwargs):
            real_save(*args, **kwargs)
            hit()

        sc.save_checkpoint = save
    elif point == "replace":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if str(dst).endswith(".checkpoint.safetensors"):
                hit()
            return real_replace(src, dst, *args, **kwargs)

        os.replace = replace  # the single-file writer (runtime_kernels.atomic) calls `os.replace`
    else:
        raise SystemExit(f"unknown fault point '{point}'")


if __name__ == "__main__":
    main()


def gather_with_a_dead_peer(rank: int, port: int, queue) -> None:
    """Process-group member for tests: rank 1 leaves right after joining; rank 0 then gathers and reports."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    import torch

    from oscar_calib.calibration.scale import distributed
    from oscar_calib.errors import CaptureError

    ctx = distributed.from_environment()
    distributed.initialise(ctx, "cpu")
    if rank == 1:
        os._exit(1)  # a rank that dies without a word
    try:
        distributed.gather_partials(ctx, torch.zeros(3, dtype=torch.float64))
        queue.put("no error")
    except CaptureError as exc:
        queue.put(f"CaptureError: {exc}")
