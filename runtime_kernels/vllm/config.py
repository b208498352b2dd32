"""The `oscar` entry of vLLM's `--additional-config`, and the artifact it names (docs/vllm.md section 7).

    --additional-config '{"oscar": {"repo": "my-org/oscar-zoo", "revision": "v1"}}'   # zoo release (Hub)
    --additional-config '{"oscar": {"path": "zoo/demo"}}'                             # local artifact
    --additional-config '{"oscar": {"path": "zoo/demo", "layers": [1, 3]}}'   # INT2 for layers 1, 3 only

Layers without INT2 (not calibrated by the artifact, or left out of `layers`) keep vLLM's own cache.

No vLLM import: `parse_oscar_config` takes vLLM's `additional_config` dict, `load_checked_artifact` the model's
transformers config.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from runtime_kernels.artifact import ArtifactError, ModelMismatchError, OscarArtifact, check_against_model
from runtime_kernels.loader import (
    COMMIT_RE,
    VERSION_RE,
    ReleaseNotFoundError,
    WrongRepoTypeError,
    load_artifact,
)

CONFIG_KEY = "oscar"
MAX_WINDOW_RESERVE = 64.0  # window blocks per request's need: 2 is the default, beyond 64 no prefix reuse pays
_Text = Annotated[str, Field(max_length=4096)]  # paths, ids and revisions: long enough for any real one


class OscarServeConfig(BaseModel):
    """What the server loads. Exactly one of `path` (local directory or .safetensors) and `repo` (zoo repo on the
    Hub, with `revision`: a tag, branch or commit). `model_id` is the served model's Hub id (default: its name as
    vLLM was given it): the release pulled, and the identity the artifact must name; a model served from a local
    copy names its Hub id here. `allow_other_model` accepts an artifact of another model with the same shapes.

    Pins (zoo_manifest.yaml's record of the release): `commit` (the revision must name it) and `expected_sha256`
    (file name -> sha256). A branch name as `revision` is refused unless `allow_unpinned` is set: a branch moves.
    Parsed strictly (pydantic strict mode): `"yes"` is not a boolean, `"2"` not a number, NaN and infinities are
    refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    path: _Text | None = None
    repo: _Text | None = None
    revision: _Text | None = None
    commit: str | None = Field(None, pattern=r"^[0-9a-f]{40}$")
    expected_sha256: Annotated[dict[_Text, Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]],
                               Field(max_length=256)] | None = None
    allow_unpinned: bool = False
    repo_type: Literal["model", "dataset"] = "model"  # the Hub keeps model and dataset repos apart
    model_id: _Text | None = None
    calibration: _Text = "default"
    allow_other_model: bool = False
    kernel_backend: Literal["auto", "torch", "triton"] = "auto"
    # window blocks kept per running request's need (in [1, 64]; extra = prefix reuse)
    window_reserve: float = Field(2.0, ge=1, le=MAX_WINDOW_RESERVE)
    # decoder layers served in INT2 (default: every layer the artifact calibrates); indices as the contract bounds them
    layers: Annotated[list[Annotated[int, Field(ge=0, le=4095)]], Field(max_length=4096)] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> OscarServeConfig:
        if (self.path is None) == (self.repo is None):
            raise ValueError("give exactly one of 'path' (local artifact) and 'repo' (zoo repo on the Hub)")
        if self.revision is not None and not self.revision.strip():
            raise ValueError("'revision' is empty: give a release tag vN or a commit sha, or leave it out with 'commit'")
        if self.repo is not None and not self.revision and not self.commit:
            raise ValueError("'revision' is required with 'repo' (a release tag or commit: serving pins it)")
        if self.repo is not None and self.revision and not self.allow_unpinned \
                and not (VERSION_RE.fullmatch(self.revision) or COMMIT_RE.fullmatch(self.revision)):
            raise ValueError(f"'revision' {self.revision!r} is a branch (it moves, so what is served could change "
                             "under the server); give a release tag vN or a commit sha, with 'commit' and "
                             "'expected_sha256' from zoo_manifest.yaml, or set 'allow_unpinned': true")
        if self.path is not None and self.commit is not None:
            raise ValueError("'commit' pins a Hub release; a local 'path' is pinned with 'expected_sha256'")
        if self.window_reserve < 1:
            raise ValueError(f"'window_reserve' must be >= 1, got {self.window_reserve}")
        if self.layers is not None and (not self.layers or len(set(self.layers)) != len(self.layers)):
            raise ValueError(f"'layers' must be a non-empty list of distinct layer indices, got {self.layers}")
        return self


def parse_oscar_config(additional_config: Any) -> OscarServeConfig | None:
    """The `oscar` entry of vLLM's additional_config (None when absent: the plugin then changes nothing).

    Raises ValueError naming `additional_config.oscar` and the offending field for a malformed entry.
    """
    if not isinstance(additional_config, dict) or CONFIG_KEY not in additional_config:
        return None
    raw = additional_config[CONFIG_KEY]
    if not isinstance(raw, dict):
        raise ValueError(f"additional_config.{CONFIG_KEY}: expected a JSON object, got {type(raw).__name__}")
    try:
        return OscarServeConfig(**raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        # a key of the user's JSON can be any string (a newline too): names that are not identifiers print quoted,
        # so the refusal stays one line
        where = ".".join(p if isinstance(p, str) and p.isidentifier() else repr(p)
                         for p in first.get("loc", ())) or "(entry)"
        msg = " ".join(str(first["msg"]).split())
        raise ValueError(f"additional_config.{CONFIG_KEY}.{where}: {msg}") from None


def load_checked_artifact(cfg: OscarServeConfig, hf_config: Any, served_model: str | None = None) -> OscarArtifact:
    """Load the artifact (local path, or a pinned, sha256-verified zoo release; offline from a warm cache with
    HF_HUB_OFFLINE=1) and check it against the served model's config (the project's one identity rule,
    `check_against_model`). Every refusal is one `ValueError` line naming the `additional_config.oscar` key to
    change (vLLM prints the cause of a failed startup; its options are the config's keys, not our CLI flags); the
    exception keeps its type (ModelMismatchError, ReleaseNotFoundError, ArtifactError: all ValueErrors)."""
    key = f"additional_config.{CONFIG_KEY}"
    try:
        if cfg.path is not None:
            artifact = load_artifact(cfg.path, expected_sha256=cfg.expected_sha256)
            identity = cfg.model_id
        else:
            identity = cfg.model_id or served_model
            if not identity:
                raise ValueError(f"{key}.model_id: needed to pull from '{cfg.repo}' when the served model has no Hub "
                                 "name (e.g. \"model_id\": \"Qwen/Qwen3-8B\")")
            artifact = load_artifact(identity, repo=cfg.repo, revision=cfg.revision, calibration=cfg.calibration,
                                     repo_type=cfg.repo_type, commit=cfg.commit, expected_sha256=cfg.expected_sha256)
        check_against_model(artifact, hf_config, model_id=identity, allow_other_model=cfg.allow_other_model,
                            advice="vllm")
    except WrongRepoTypeError as exc:
        raise ValueError(f"OSCAR: {key}.repo_type: '{exc.repo}' is a {exc.actual} repo, not a {exc.repo_type} repo; "
                         f"set \"repo_type\": \"{exc.actual}\"") from None
    except (ModelMismatchError, ReleaseNotFoundError, ArtifactError) as exc:
        # Same type (callers and tests catch it), one line that says which config key holds the bad input.
        where = f"{key}.path" if cfg.path is not None else f"{key}.repo"
        raise type(exc)(f"OSCAR: {where}: {exc}") from None
    if cfg.layers is not None:
        try:
            artifact = restrict_layers(artifact, cfg.layers)
        except ArtifactError as exc:
            raise ValueError(f"{key}.layers: {exc}") from None
    return artifact


def restrict_layers(artifact: OscarArtifact, keep) -> OscarArtifact:
    """The artifact for decoder layers `keep` only (each a layer it calibrates): every `[A, ...]` tensor keeps the
    rows of those layers, in layer order; metadata unchanged; validated. Raises ArtifactError naming `layer_ids`."""
    ids = artifact.layer_ids.tolist()
    missing = sorted(set(int(i) for i in keep) - set(ids))
    if missing:
        raise ArtifactError(f"{artifact.source}: field 'layer_ids': layers {missing} are not calibrated by the "
                            f"artifact (it has {ids})")
    rows = torch.tensor([artifact.index_of_layer(i) for i in sorted(set(int(i) for i in keep))])
    kw = {f.name: getattr(artifact, f.name) for f in fields(OscarArtifact)}
    kw.update({k: v[rows].clone() for k, v in kw.items() if isinstance(v, torch.Tensor)})
    kw["metadata"] = _restrict_recipe_rows(artifact.metadata, rows.tolist())
    return OscarArtifact(**kw).validate()


def _restrict_recipe_rows(metadata: dict, rows: list[int]) -> dict:
    """The metadata with the recipe's per-layer-row records (`calibration.kv_rms`: `[A][H]` per side) kept for
    `rows` only, so they stay aligned with the restricted tensors."""
    calib = metadata.get("calibration")
    if not isinstance(calib, str):
        return dict(metadata)
    try:
        recipe = json.loads(calib)
    except ValueError:
        return dict(metadata)  # validate() names the field
    record = recipe.get("kv_rms") if isinstance(recipe, dict) else None
    if isinstance(record, dict) and all(isinstance(record.get(s), list) for s in ("k", "v")):
        recipe["kv_rms"] = {s: [record[s][r] for r in rows if r < len(record[s])] for s in ("k", "v")}
        return {**metadata, "calibration": json.dumps(recipe)}
    return dict(metadata)


__all__ = ["CONFIG_KEY", "OscarServeConfig", "load_checked_artifact", "parse_oscar_config", "restrict_layers"]
