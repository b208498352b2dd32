"""Model, tokenizer and config loading for calibration, eval and audit (transformers, placed with accelerate).

Every failure becomes an InputError naming `--model` and what was expected (one line, exit code 2).

`--model` may also be a `.gguf` file: transformers' own GGUF loading dequantizes it
(`from_pretrained(parent_dir, gguf_file=name)`, needs the `gguf` package), tokenizer included. Its identity for
the artifact (`model_id`) is the path as given, the same rule as for a local directory, so `eval` and `audit` of
the same file recognise its artifacts (`runtime_kernels.artifact.same_model` compares real paths).
"""

from __future__ import annotations

from pathlib import Path

import torch

from oscar_calib.errors import InputError, MissingDependencyError

GGUF_SUFFIX = ".gguf"
GGUF_PIP = "pip install 'oscar-calib[gguf]'"  # the extra that brings the `gguf` package


def is_gguf(model_ref: str | None) -> bool:
    """Whether `--model` names a GGUF file (by its suffix; whether it exists is checked when it is loaded)."""
    return model_ref is not None and model_ref.lower().endswith(GGUF_SUFFIX)


def _source(model_ref: str) -> tuple[str, dict]:
    """(what to pass to `from_pretrained`, extra keyword arguments): `parent_dir, gguf_file=name` for a GGUF."""
    if not is_gguf(model_ref):
        return model_ref, {}
    path = Path(model_ref)
    if not path.is_file():
        raise InputError(f"--model {model_ref}: no such file (expected a .gguf file, a local directory or a Hub id)")
    try:
        from oscar_calib.gguf_check import check_gguf

        check_gguf(path)  # the metadata against the tensors, before transformers builds anything from it
    except ImportError as exc:
        raise MissingDependencyError(f"--model {model_ref} needs the `gguf` package, which is not installed; "
                                     f"install it with `{GGUF_PIP}` (or `pip install gguf`)") from exc
    return str(path.parent), {"gguf_file": path.name}


def load_config(model_ref: str, revision: str | None, trust_remote_code: bool):
    """The transformers config of a Hub model id or local directory at `revision`."""
    from transformers import AutoConfig

    ref, extra = _source(model_ref)
    try:
        return AutoConfig.from_pretrained(ref, revision=revision, trust_remote_code=trust_remote_code, **extra)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, HTTP errors...
        kind = "local directory" if Path(model_ref).exists() else "Hub model id or local directory"
        raise InputError(f"--model {model_ref}: cannot load its config (expected a {kind} with config.json"
                         f"{', revision ' + revision if revision else ''}): {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc


def load_tokenizer(model_ref: str, revision: str | None, trust_remote_code: bool):
    """The model's tokenizer (AutoTokenizer)."""
    from transformers import AutoTokenizer

    ref, extra = _source(model_ref)
    try:
        return AutoTokenizer.from_pretrained(ref, revision=revision, trust_remote_code=trust_remote_code, **extra)
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
    ref, extra = _source(model_ref)
    try:
        placement = {}
        if isinstance(device_map, str):  # accelerate strategy: honour the memory limits, offload beyond them
            placement = {"max_memory": accelerate_max_memory(max_memory), "offload_folder": str(offload_folder)}
        model, info = AutoModelForCausalLM.from_pretrained(
            ref, revision=revision, dtype=dtype, device_map=device_map, trust_remote_code=trust_remote_code,
            output_loading_info=True, **placement, **extra)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"--model {model_ref}: cannot load the weights: {type(exc).__name__}: {exc}") from exc
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers would have initialised these at random: a calibration of noise
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise InputError(f"--model {model_ref}: the checkpoint lacks {len(missing)} weight(s) the architecture needs "
                         f"({shown}); refusing to initialise them at random (expected a complete checkpoint)")
    return model.eval()


__all__ = ["GGUF_PIP", "is_gguf", "load_config", "load_model", "load_tokenizer"]
