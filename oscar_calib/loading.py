"""Model, tokenizer and config loading for calibration, eval and audit (transformers, placed with accelerate).

Every failure becomes an InputError naming `--model` and what was expected (one line, exit code 2).
"""

from __future__ import annotations

from pathlib import Path

import torch

from oscar_calib.errors import InputError


def load_config(model_ref: str, revision: str | None, trust_remote_code: bool):
    """The transformers config of a Hub model id or local directory at `revision`."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_ref, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, HTTP errors...
        kind = "local directory" if Path(model_ref).exists() else "Hub model id or local directory"
        raise InputError(f"--model {model_ref}: cannot load its config (expected a {kind} with config.json"
                         f"{', revision ' + revision if revision else ''}): {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc


def load_tokenizer(model_ref: str, revision: str | None, trust_remote_code: bool):
    """The model's tokenizer (AutoTokenizer)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_ref, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"--model {model_ref}: cannot load its tokenizer: {type(exc).__name__}: {exc}") from exc


def load_model(model_ref: str, revision: str | None, dtype: torch.dtype, device: str, trust_remote_code: bool,
               device_map: str | None = None, max_memory: dict | None = None, offload_folder=None):
    """The causal LM in eval mode, in `dtype`, on `device` (or spread by accelerate with `device_map`, within
    `max_memory` per device and offloading beyond it to CPU or `offload_folder`)."""
    from transformers import AutoModelForCausalLM

    from oscar_calib.placement import accelerate_max_memory

    # accelerate places the weights straight onto the device (no full CPU copy first), or spreads the layers
    # over every visible device with an accelerate strategy ("auto", "balanced", ...). Statistics then live on
    # each layer's own device and only the d x d targets move to the CPU for the solver.
    if device_map is None:
        device_map = {"": device} if device != "cpu" else None
    try:
        placement = {}
        if isinstance(device_map, str):  # accelerate strategy: honour the memory limits, offload beyond them
            placement = {"max_memory": accelerate_max_memory(max_memory), "offload_folder": str(offload_folder)}
        model = AutoModelForCausalLM.from_pretrained(model_ref, revision=revision, dtype=dtype, device_map=device_map,
                                                     trust_remote_code=trust_remote_code, **placement)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"--model {model_ref}: cannot load the weights: {type(exc).__name__}: {exc}") from exc
    return model.eval()


__all__ = ["load_config", "load_model", "load_tokenizer"]
