"""The evaluation entry point: the KV methods compared, their teacher-forced evaluation, the runtime's greedy agreement,
the passkey probes and each OSCAR row against its best peer, as one call.

`oscar-calib eval` (oscar_calib/cli/eval_cmd.py) and tools/readme_eval.py both call `run_eval`; the command adds only
what a command adds (flags, defaults sized for the device, loading, printing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from oscar_calib.analysis.evaluate import (
    Windows,
    bootstrap_delta_ci,
    evaluate_methods,
    generation_agreement,
    make_windows,
    read_documents,
)
from oscar_calib.analysis.methods import KVMethod, standard_methods
from oscar_calib.analysis.peers import centered_peer
from oscar_calib.errors import InputError
from runtime_kernels.format import KVFormat


@dataclass(frozen=True)
class EvalRequest:
    """What one evaluation computes beyond the methods' perplexity and attention error.

    - fmt: the KV format the methods are served in (windows, scales, quantizer);
    - simulated: `fmt` at the page size the teacher-forced history grows by (1 = per token);
    - generation_steps / generation_windows: greedy steps through the runtime per window, and how many windows
      (0 steps: skipped);
    - probes: passkey needles placed in the INT2 history, plus a verbatim-recall check (0: skipped).
    """

    fmt: KVFormat
    simulated: KVFormat
    batch_size: int
    generation_steps: int
    generation_windows: int
    probes: int


def calibration_ids(tokenizer, path: Path, context: int, samples: int) -> torch.Tensor:
    """int64 `[n, context]`: at most `samples` windows of the text at `path` (the last is held out for the clip fit)."""
    w = make_windows(tokenizer, read_documents(path), context)
    ids = torch.cat([w.long, w.packed])[:samples]
    if ids.shape[0] < 2:
        raise InputError(f"--calib-data {path}: gives {ids.shape[0]} window(s) of {context} tokens; "
                         "expected at least 2 (one is held out for the clip fit); pass more text or a shorter --context")
    return ids


def eval_methods(head_dim: int, fmt: KVFormat, artifacts: dict, names: list[str] | None = None, *,
                 with_centered_peer: bool = True) -> list[KVMethod]:
    """BF16, the INT2 baselines and one row per artifact (`standard_methods`), with the centered Hadamard + clip
    peer next to the first OSCAR row; only `names` (in table order) when given, refusing an unknown one."""
    methods = standard_methods(head_dim, fmt, artifacts)
    if with_centered_peer:
        first_oscar = next((i for i, m in enumerate(methods) if m.name in artifacts), len(methods))
        methods[first_oscar:first_oscar] = centered_peer(artifacts)  # the strongest simple peer, next to OSCAR
    if names:
        known = [m.name for m in methods]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InputError(f"--methods: unknown method(s) {unknown}; expected names from {known}")
        methods = [m for m in methods if m.name in names]
    return methods


def check_generation_steps(steps: int, context: int, fmt: KVFormat) -> None:
    """The greedy agreement needs a prompt longer than the two windows inside a `context`-token window."""
    windows = fmt.sink_tokens + fmt.recent_tokens
    if steps > 0 and steps >= context - windows:
        raise InputError(f"--generation-steps {steps}: must leave a prompt longer than sink + recent ({windows}) "
                         f"inside the {context}-token window (pass --generation-steps 0 to skip)")


def compare_to_best_peer(result: dict, oscar_names: list[str]) -> dict:
    """Each OSCAR row against the best non-OSCAR INT2 row of no more bits at 128K (lowest perplexity): the paired
    bootstrap interval of the perplexity change over the same windows, and a verdict that a reader can trust (a tie
    when the interval holds 0)."""
    rows = {r["name"]: r for r in result["methods"]}
    out = {}
    for name in oscar_names:
        r = rows.get(name)
        if r is None:
            continue
        # a peer of no more bits at 128K (KIVI with 32-token groups spends 2.74 bits: not a peer of a 2.25-bit cache)
        peers = [p for p in result["methods"] if p["name"] not in oscar_names and p["name"] != "bf16"
                 and p["effective_bits_128k"] <= r["effective_bits_128k"] + 1e-9]
        if not peers:
            continue
        best = min(peers, key=lambda p: p["ppl"])
        lo, hi = bootstrap_delta_ci(torch.tensor(r["window_nll"]), torch.tensor(best["window_nll"]))
        delta = 100.0 * (r["ppl"] / best["ppl"] - 1.0)
        verdict = "tie" if lo != lo or lo <= 0 <= hi else ("better" if hi < 0 else "worse")
        out[name] = {"peer": best["name"], "delta_pct": delta, "ci95": [lo, hi], "verdict": verdict}
    return out


def run_eval(model, tokenizer, methods: list[KVMethod], artifacts: dict, windows: Windows, request: EvalRequest,
             progress: Callable[[str, str], None] | None = None) -> dict:
    """Evaluate `methods` on `windows` (teacher-forced, `request.simulated`), then the runtime's greedy agreement of
    each artifact and the passkey probes when asked, and each artifact's row against its best peer.

    Returns `evaluate_methods`' result with `generation_agreement`, `probes`, `vs_best_peer`, the software versions
    and `seconds` added. `progress(method, window_kind)` is called after each method and window set."""
    t0 = time.perf_counter()
    result = evaluate_methods(model, methods, windows, request.simulated, request.batch_size, progress=progress)
    every = torch.cat([windows.long, windows.packed])
    if request.generation_steps > 0:
        result["generation_agreement"] = generation_agreement(model, artifacts, every[:request.generation_windows],
                                                              request.generation_steps, request.fmt)
    if request.probes > 0:
        from oscar_calib.analysis.probes import run_probes

        result["probes"] = run_probes(model, tokenizer, methods, artifacts, every, request.probes, request.fmt)
    result["vs_best_peer"] = compare_to_best_peer(result, list(artifacts))
    result.update({"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                   "seconds": round(time.perf_counter() - t0, 1)})
    return result
