"""Checks of `--model` and `--dataset` made before anything is loaded, so that the common mistakes end in one line
with the documented exit code (docs/errors.md, "Checks before the expensive work"):

- a path that does not exist (`./no-such-model`): exit 2, "no such directory", instead of transformers' rule for
  Hub repo ids;
- a file where a model folder is expected (`--model m/config.json`): exit 2, naming the folder to pass;
- a Hub id while the Hub cannot be reached: exit 5 after one request of at most a few seconds (the client's own
  retries took 26 s), with the `HF_HUB_OFFLINE=1` hint; a Hub id the local cache does not hold while
  `HF_HUB_OFFLINE=1`: exit 5, as docs/cli.md's table says for "not cached while offline";
- a dataset folder or Hub dataset without the `datasets` package: exit 7, naming which of the two it is.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from oscar_calib.errors import HubError, InputError, MissingDependencyError

REACH_TIMEOUT_S = 5.0  # one request: a Hub that answers at all answers well within this


def looks_like_path(ref: str) -> bool:
    """A reference the user meant as a local path: `./x`, `../x`, `/x`, `~/x`, or more than one `/` (Hub ids are
    `NAME` or `ORG/NAME`)."""
    return ref.startswith((".", "/", "~")) or ref.count("/") > 1 or "\\" in ref


def check_model_ref(ref: str | None, flag: str = "--model") -> None:
    """Refuse a local path that does not exist (exit 2) and a Hub id the Hub cannot be reached for (exit 5)."""
    if ref is None:
        return
    path = Path(ref).expanduser()
    if path.is_file() and not ref.lower().endswith(".gguf"):
        raise InputError(f"{flag} {ref}: is a file; pass the model folder that holds config.json and the weights "
                         f"({flag} {path.parent}), or a Hub model id ORG/NAME")
    if path.exists():
        return
    if ref.lower().endswith(".gguf"):
        raise InputError(f"{flag} {ref}: no such file (expected a .gguf checkpoint)")
    if looks_like_path(ref):
        raise InputError(f"{flag} {ref}: no such directory (expected a local model directory with config.json, "
                         "or a Hub model id ORG/NAME)")
    _check_cached_when_offline(f"{flag} {ref}", ref)
    _check_hub_reachable(f"{flag} {ref}", ref)


def _check_cached_when_offline(what: str, repo_id: str) -> None:
    """Offline (HF_HUB_OFFLINE=1), a Hub id the local cache holds no snapshot of cannot load: exit 5 (the Hub's
    "not cached while offline"), not the loader's exit 2 with transformers' two-line advice."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    if not constants.HF_HUB_OFFLINE:
        return
    snapshots = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots"
    if not (snapshots.is_dir() and any(snapshots.iterdir())):
        raise HubError(f"{what}: not in the local Hub cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set; "
                       "unset HF_HUB_OFFLINE to download it once, or pass a local model folder")


def _check_hub_reachable(what: str, repo_id: str) -> None:
    """One quick request for the model's info when online (offline mode is left to the loaders, which read the
    cache). Only a network failure is reported here; anything the Hub answers is left to the loader to word."""
    from huggingface_hub import HfApi, constants

    from runtime_kernels.loader import is_connection_error, unreachable

    if constants.HF_HUB_OFFLINE:
        return
    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        HfApi(endpoint=endpoint).model_info(repo_id, timeout=REACH_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the client raises many types; only connection failures are ours
        if is_connection_error(exc):
            raise HubError(f"{what}: {unreachable(endpoint, 'load it', exc)}") from None


def check_dataset_ref(ref: str | None, flag: str = "--dataset") -> None:
    """A local file must exist; a local folder or a Hub dataset id needs `datasets` (exit 7, nothing run)."""
    if ref is None:
        return
    path = Path(ref).expanduser()
    if path.suffix in (".txt", ".jsonl", ".json") or path.is_file():
        if not path.is_file():
            raise InputError(f"{flag} {ref}: no such file (expected a local .jsonl, .json or .txt file)")
        return
    if not path.exists() and looks_like_path(ref):
        raise InputError(f"{flag} {ref}: no such file or directory (expected a local .jsonl/.txt file, a dataset "
                         "folder, or a Hub dataset id ORG/NAME)")
    if importlib.util.find_spec("datasets") is None:
        kind = f"the local dataset folder '{ref}'" if path.is_dir() else f"the Hub dataset '{ref}'"
        raise MissingDependencyError(f"{flag}: reading {kind} needs the 'datasets' package, which is not installed; "
                                     "install it with `pip install 'oscar-calib[data]'` (or pass a .jsonl/.txt file)")
