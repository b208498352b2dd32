"""Checks the commands share, so that one kind of failure is reported the same way everywhere."""

from __future__ import annotations

from typing import Any


def check_model(artifact: Any, config: Any, model: Any = None, model_id: str | None = None,
                allow_other_model: bool = False) -> None:
    """Refuse an artifact made for another model as `ModelMismatchError` (exit 2 in every command).

    The rule is the runtime's (`runtime_kernels.artifact.check_against_model`, shared with `OscarCache`,
    `load_artifact` and the vLLM plugin); this only picks the model's identity the CLI way (`--model-id`, else the
    Hub id the package knows for `model`'s directory, else the config's path) and words the advice as flags. A
    shape or id that disagrees with the *model* is a wrong input (exit 2), not a corrupt file (exit 4).
    """
    from runtime_kernels.artifact import ArtifactError, check_against_model
    from runtime_kernels.loader import ModelMismatchError

    identity = model_id or (local_model_id(model) if model is not None else None)
    try:
        check_against_model(artifact, config, model_id=identity, allow_other_model=allow_other_model, advice="cli")
    except ModelMismatchError:
        raise
    except ArtifactError as exc:
        raise ModelMismatchError(str(exc)) from None


def local_model_id(model: Any) -> str | None:
    """The Hub id a local model directory stands for, where the package knows it: the trained fixture's
    directory is `oscar-calib/tiny-qwen3` (the id the demo's artifacts name). A `.gguf` file stands for its path
    as given (what `run --model x.gguf` records; its config would name the folder). None otherwise."""
    from pathlib import Path

    from oscar_calib.demo import FIXTURE_DIR, FIXTURE_MODEL_ID
    from oscar_calib.loading import is_gguf

    if isinstance(model, str) and is_gguf(model):
        return model

    try:
        same = Path(model).resolve() == FIXTURE_DIR.resolve()
    except (OSError, TypeError, ValueError):
        return None
    return FIXTURE_MODEL_ID if same else None
