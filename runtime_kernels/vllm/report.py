"""What the plugin says at startup, and where it says it (no vLLM import: tested without vLLM).

vLLM configures one logger, `vllm`, with its handler at INFO and `propagate=False` under it; a logger outside that
tree (`runtime_kernels.vllm.backend`) reaches only the root logger, which has no handler, so Python's last-resort
handler prints WARNING and above and our INFO lines were never seen. `LOGGER_NAME` is a child of `vllm`: its
records go through vLLM's handler, at vLLM's level (`VLLM_LOGGING_LEVEL`), formatted like vLLM's own.
"""

from __future__ import annotations

LOGGER_NAME = "vllm.oscar"


def capacity_gain(n_layers: int, int2_layers: int, packed_bytes: int, dense_bytes: int) -> float:
    """KV tokens per byte with INT2 on `int2_layers` of `n_layers` layers, relative to `dense_bytes` on all of them
    (per token and KV head: `packed_bytes` for an INT2 cell, `dense_bytes` for the model dtype's K + V)."""
    used = int2_layers * packed_bytes + (n_layers - int2_layers) * dense_bytes
    return n_layers * dense_bytes / used


def past_fitted_context_line(source: str, fitted: int, max_model_len: int) -> str:
    """The warning when vLLM may serve sequences longer than the context the artifact's clips were fitted for."""
    return (f"OSCAR: max_model_len {max_model_len} is past the {fitted}-token context {source} was fitted for "
            f"(calibration.holdout_len); quality beyond it is unmeasured: calibrate with `oscar-calib run "
            f"--holdout-len {max_model_len}` or serve with --max-model-len {fitted}")


def startup_line(source: str, model_id: str, int2_layers: list[int], n_layers: int, packed_bytes: int,
                 dense_bytes: int, dtype_name: str, sink: int, recent: int) -> str:
    """One line: what runs in INT2, on which layers, with which windows, and the capacity gained."""
    plain = sorted(set(range(n_layers)) - set(int2_layers))
    kept = f" (layers {plain} keep vLLM's {dtype_name} cache)" if plain else ""
    gain = capacity_gain(n_layers, len(int2_layers), packed_bytes, dense_bytes)
    return (f"OSCAR INT2 KV cache on: layers {sorted(int2_layers)} of {n_layers}{kept}; artifact {source} for "
            f"{model_id}; keys and values rotated, 2-bit codes + scales in vLLM's blocks ({packed_bytes} B per "
            f"token and KV head instead of {dense_bytes} in {dtype_name}), BF16 sink {sink} + recent {recent} "
            f"tokens per request outside vLLM's budget; {gain:.2f}x the KV tokens per byte of KV cache")


def decode_line(eager, static=None, backend: str = "auto", device: str = "cpu") -> str:
    """What the INT2 layers' decode runs, and why: the `DecodePlan` of an eager step (`eager`; None: the torch
    reference, no Triton kernel) and, where CUDA graphs replay static steps, theirs when it differs (`static`)."""
    if eager is None:
        return (f"OSCAR decode: torch reference kernels (kernel_backend '{backend}' on {device}; the Triton kernels "
                "run on CUDA)")
    line = f"OSCAR decode: Triton {eager.summary()}"
    if static is not None and static != eager:
        line += f"; CUDA-graph decode steps: {static.summary()}"
    return line


HISTORY_LINE = "OSCAR INT2 history served"


class HistoryReport:
    """Counts the tokens decode steps read from the INT2 history and says so in one INFO line: at the first step that
    reads any, then every `every` steps that read some. The line is how a user sees that a prompt got past the BF16
    windows and the 2-bit cache was really used (the CPU recipe greps for it).

    The engine calls `record(hist_lens)` once per decode step (not per layer), with the INT2 history length of each
    decode request of the step (`fmt.history_tokens(n)`); it returns the line when one is due, else None.
    """

    def __init__(self, every: int = 64):
        self.every = every
        self.steps = 0  # decode steps that read any history
        self.tokens = 0  # history tokens read, summed over requests and steps (per layer: every layer reads as many)

    def record(self, hist_lens) -> str | None:
        lens = [int(h) for h in hist_lens]
        if not any(lens):
            return None
        self.steps += 1
        self.tokens += sum(lens)
        if self.steps != 1 and self.steps % self.every:
            return None
        return (f"{HISTORY_LINE}: {self.tokens} history tokens read from INT2 over {self.steps} decode step(s); this "
                f"step {sum(1 for h in lens if h)} request(s), up to {max(lens)} tokens each")

    def log(self, hist_lens) -> None:
        """`record`, and the line (if due) on the `vllm.oscar` logger at INFO."""
        import logging

        line = self.record(hist_lens)
        if line is not None:
            logging.getLogger(LOGGER_NAME).info(line)
