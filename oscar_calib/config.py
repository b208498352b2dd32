"""Pydantic configuration of a calibration run. `extra="forbid"` everywhere: the dump *is* the recipe.

The JSON dump of `CalibrationConfig` goes into the artifact's `calibration` metadata and the model card.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Any, Literal, Optional

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    field_validator,
)

from runtime_kernels.format import (
    DEFAULT_FORMAT,
    MAX_CLIP_RATIO,
    MIN_CLIP_RATIO,
    QUANTIZERS,
    RECORD_VERSION,
    SCALE_FORMATS,
    KVFormat,
)

# Clip grids (ratio of the order statistic, 1.0 = no clipping). Each contains the reference's global
# ratio (K 0.96, V 0.92) so the per-head fit is never worse than it on the held-out attention-aware error.
# They are starting points: the fit extends a grid downward while its lowest ratio still wins for some head
# (oscar_calib.calibration.clipfit), so no fitted ratio sits at the edge of what was searched.
DEFAULT_K_CLIP_GRID: tuple[float, ...] = (0.94, 0.95, 0.96, 0.97, 0.98, 0.99, 1.0)
DEFAULT_V_CLIP_GRID: tuple[float, ...] = (0.88, 0.90, 0.92, 0.94, 0.96, 0.98, 1.0)
# History mass above which a KV head's keys take the Hadamard rotation (oscar_calib.calibration.key_basis);
# 1.0 = never. Chosen on SmolLM2-135M at its 8K context (docs/recipe.md, "Hadamard keys in the heads that read the
# history"): 0.30 swaps 13 of its 90 KV heads and retrieves passkeys as well as Hadamard + clip (72.7 % against
# 71.1 %) for +0.47 points of perplexity over no swap, still 1.5 % below the global-clip peer; 0.35 retrieves no
# better than no swap. The fixtures' heads all stay below 0.26 at 4K, so their artifacts keep every key basis.
DEFAULT_HADAMARD_KEY_MASS = 0.30


# The longest held-out sequence chosen automatically: the clip fit's held-out capture keeps every key and value of
# it per layer ([S, H_kv, T, d] fp32), so an automatic choice stays affordable for long-context models.
AUTO_HOLDOUT_CAP = 8192


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _kv_format(value: Any) -> KVFormat:
    """A KVFormat as given, or from a mapping of its record's entries (a recipe names those that differ from
    DEFAULT_FORMAT; `KVFormat.from_record` refuses an unknown entry or a value out of its domain, naming it)."""
    if isinstance(value, KVFormat):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of KVFormat fields, got {type(value).__name__}")
    return KVFormat.from_record({**DEFAULT_FORMAT.to_record(), **value})


# JSON Schema of the recipe's `kv_format` (the zoo manifest's schema): the record's entries, every one optional.
_KV_FORMAT_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "description": "runtime_kernels.format.KVFormat's record; entries not given are DEFAULT_FORMAT's.",
    "properties": {
        "record_version": {"const": RECORD_VERSION},
        **{f.name: {"type": "integer", "minimum": 0} for f in fields(KVFormat) if f.name.endswith("_tokens")},
        "page_size": {"type": "integer", "minimum": 1},
        "group_size": {"anyOf": [{"type": "integer", "minimum": 4}, {"type": "null"}]},
        "scale_format": {"enum": list(SCALE_FORMATS)},
        "quantizer": {"enum": list(QUANTIZERS)},
        "centered": {"type": "boolean"},
    },
}
assert set(_KV_FORMAT_SCHEMA["properties"]) == {"record_version", *(f.name for f in fields(KVFormat))}

# SolverSettings' format: a KVFormat in memory, its record (`KVFormat.to_record`) in the recipe's JSON.
KVFormatField = Annotated[KVFormat, BeforeValidator(_kv_format),
                          PlainSerializer(lambda fmt: fmt.to_record(), return_type=dict),
                          WithJsonSchema(_KV_FORMAT_SCHEMA)]


class DataConfig(_Strict):
    """Where the calibration text comes from and how it becomes token sequences."""

    dataset: Optional[str] = Field(
        None, description="Hub dataset id, or a local .jsonl/.txt file. None = the demo text shipped with the package.")
    dataset_revision: Optional[str] = Field(None, description="Pinned dataset revision (Hub datasets).")
    dataset_config: Optional[str] = Field(None, description="Dataset configuration name (Hub datasets).")
    split: str = "train"
    text_column: str = "text"
    # Upper bounds: beyond them no run could finish (2^24 samples, 2^20-token sequences: the contract's window
    # bound); without them a count of 10^23 reached torch as an overflow traceback.
    samples: int = Field(32, ge=1, le=1 << 24, description="Number of packed sequences used for statistics.")
    seq_len: int = Field(2048, ge=8, le=1 << 20, description="Tokens per packed sequence (longer than the recipe's "
                                                            "windows).")
    holdout_samples: int = Field(1, ge=1, le=1 << 16, description="Extra packed sequences held out for fitting clip "
                                                                  "ratios.")
    holdout_len: Optional[int] = Field(
        None, ge=8, le=1 << 20, description="Tokens per held-out sequence (the context the clips are fitted for). None = the "
                                "model's context (max_position_embeddings), at most AUTO_HOLDOUT_CAP and at least "
                                "seq_len: clips fitted on short sequences were measured to hold worse at the "
                                "model's own context (tools/recipe_study.py, docs/recipe.md).")
    holdout_queries: int = Field(256, ge=8, le=1 << 20, description="Query positions sampled per held-out sequence.")
    seed: int = Field(0, ge=-(1 << 63), lt=1 << 64, description="Seed of the data order and the held-out query "
                                                                "positions (torch.manual_seed's range).")
    shuffle_buffer: int = Field(10_000, ge=1, le=1 << 24, description="Streaming shuffle buffer (Hub datasets).")
    chat_template: bool = Field(False, description="Wrap each text (or 'messages' list) with the tokenizer's chat template.")


class SolverSettings(_Strict):
    """How statistics become rotations and clip ratios."""

    granularity: Literal["head", "layer"] = "head"
    value_target: Literal["attn_output", "logit_weighted"] = "attn_output"
    key_target: Literal["query_moment"] = "query_moment"
    k_clip_grid: tuple[float, ...] = DEFAULT_K_CLIP_GRID
    v_clip_grid: tuple[float, ...] = DEFAULT_V_CLIP_GRID
    key_clip_objective: Literal["attn_kl", "logit_mse", "out_err", "block_out"] = Field(
        "block_out", description="Held-out error that picks clip ratios: keys by attention KL, logit MSE or the "
                               "attention-output error (`out_err`, `block_out` = after o_proj; values then too).")
    clip: bool = Field(True, description="Fit per-head clip ratios. False: no clipping (the grids are not searched); "
                                         "with the unbiased quantizer it retrieves far tokens about as well as the "
                                         "default at +0.4-0.5 % perplexity on the fixtures (docs/quality.md, "
                                         "far-token retrieval).")
    hadamard_key_mass: float = Field(
        DEFAULT_HADAMARD_KEY_MASS, ge=0.0, le=1.0,
        description="Keys take the Hadamard rotation (clips fitted for it) in KV heads whose held-out queries put "
                    "more than this share of their attention on the INT2 history (the tokens neither BF16 window keeps); "
                    "1 = the attention-aware rotation in every head (docs/recipe.md).")
    kv_format: KVFormatField = Field(
        DEFAULT_FORMAT, description="The KV format calibrated for (runtime_kernels.format.KVFormat, docs/kv_format.md): "
                                    "windows, group, scale format, quantizer, centering; the clip fit scores every "
                                    "token, so the page size is the runtime's. The artifact records it with "
                                    "`centered` read from the means it holds.")

    @field_validator("k_clip_grid", "v_clip_grid")
    @classmethod
    def _grid_valid(cls, grid: tuple[float, ...]) -> tuple[float, ...]:
        if not grid:
            raise ValueError("a clip grid must not be empty")
        if any(not (MIN_CLIP_RATIO <= r <= MAX_CLIP_RATIO) for r in grid):  # NaN fails too
            raise ValueError(f"clip ratios must lie in [{MIN_CLIP_RATIO}, {MAX_CLIP_RATIO:g}] (the contract's range: "
                             f"below half the order statistic 2-bit levels are spent on nothing), got {list(grid)}")
        grid = tuple(sorted(set(float(r) for r in grid)))
        if grid[-1] != 1.0:
            grid = grid + (1.0,)  # "no clipping" is always a candidate
        return grid


class CalibrationConfig(_Strict):
    """A whole calibration job: model, data, solver, placement."""

    model: Optional[str] = Field(None, description="Hub model id or local directory. None = the embedded demo model.")
    model_revision: Optional[str] = None
    data: DataConfig = DataConfig()
    solver: SolverSettings = SolverSettings()
    device: Optional[str] = Field(None, description="cpu, cuda, cuda:N or auto; None = auto.")
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = None
    batch_size: Optional[int] = Field(None, ge=1, description="Sequences per forward pass; None = auto.")
    device_map: Optional[Literal["auto", "balanced", "balanced_low_0", "sequential"]] = Field(
        None, description="accelerate placement across all visible devices (models larger than one GPU); "
                          "None = the whole model on `device`.")
    max_memory: Optional[dict[str, int]] = Field(
        None, description="Bytes accelerate may place per device ('0', '1', ... for GPUs, 'cpu', 'disk'); beyond "
                          "them layers are offloaded (CPU, then disk). Needs device_map.")
    trust_remote_code: bool = False
