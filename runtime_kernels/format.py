"""KVFormat: how the INT2 KV history is encoded, as one frozen value (the one source of its defaults).

A sequence's KV cache is `BF16 sink [0, sink_tokens) | INT2 history (pages of page_size tokens) | BF16 recent (the
last recent_tokens)`. The history stores each token's rotated key and value row as 2-bit codes with a scale and a
zero point per group of `group_size` channels, in `scale_format`, encoded by `quantizer`, after subtracting the
calibrated per-(layer, KV head) mean when `centered`.

The value is decided once (by `oscar-calib run`'s flags, or read from an artifact: `OscarArtifact.kv_format`) and
travels whole to the clip fit, the evaluation, the caches, the vLLM block layout and the memory budget, so what the
benchmark times is what calibration fitted and what the server runs. The rules that depend on it live here: which
positions are history (`is_history`, `history_tokens`), what a token costs (`bytes_per_token`, `history_bits`,
`bits_per_element`), and its record in the artifact (`to_record` / `from_record`).

Torch-free and pydantic-free on purpose: the CLI reads `DEFAULT_FORMAT` for its help text without importing torch,
and the runtime installs without pydantic. The methods that take positions work elementwise on Python ints and on
integer tensors alike (only arithmetic, comparisons and `&`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

MAX_WINDOW_TOKENS = 1 << 20  # a million BF16 tokens per sequence and window: past any real model, far from overflow
MAX_PAGE_TOKENS = 1 << 16
MAX_GROUP_SIZE = 1024  # the contract's largest head_dim
CODE_BITS = 2
BF16_BITS = 16
# Bytes of each of the scale and the zero point, per group: fp16 both, or an 8-bit ue5m3 scale and an 8-bit zero
# point (`runtime_kernels.quant.naive` says what each encodes).
SCALE_BYTES = {"float16": 2, "ue5m3": 1}
SCALE_FORMATS = tuple(SCALE_BYTES)
# The quantizers this runtime serves (`runtime_kernels.quant.naive.QUANTIZERS` says what they do; levels are uniform
# in both). The contract also reads `lloyd_max` artifacts, which are not served, so they have no KVFormat.
QUANTIZERS = ("uniform_minmax", "uniform_unbiased")
# Artifacts written before the format record: schema v1 named no quantizer or scale format (they were min-max with
# fp16 scales), and no artifact before the record named a page size (the runtime served 64-token pages). The
# contract reads old artifacts with these.
LEGACY_QUANTIZER, LEGACY_SCALE_FORMAT, LEGACY_PAGE_SIZE = "uniform_minmax", "float16", 64
# Clip ratios (of a row's order statistic; 1 = no clipping) the contract accepts: below half the order statistic the
# 2-bit levels are spent on nothing useful. The calibration's flags and settings, its clip fit and the contract's
# check of an artifact all read these bounds.
MIN_CLIP_RATIO = 0.5
MAX_CLIP_RATIO = 1.0
RECORD_VERSION = 1
RECORD_KEY = "kv_format"  # the artifact metadata key holding `to_record()` as JSON


class KVFormatError(ValueError):
    """A KVFormat field (or record entry) out of its domain. `field` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"KVFormat.{field_name}: {message}")
        self.field = field_name


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVFormatError(name, f"expected an integer, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise KVFormatError(name, f"expected an integer in [{low}, {high}], got {value}")


@dataclass(frozen=True)
class KVFormat:
    """Encoding of the INT2 KV history. Every field is required; `DEFAULT_FORMAT` is the recipe's value.

    - `sink_tokens`: first tokens of every sequence kept in BF16 (attention sinks).
    - `recent_tokens`: the most recent tokens kept in BF16; older ones are demoted to INT2.
    - `page_size`: tokens per INT2 page (demotion and the decode kernel work a page at a time; vLLM's block size).
    - `group_size`: channels per scale/zero group; None = head_dim (one scale and zero per row). An artifact's
      format always names it (`resolved`).
    - `scale_format`: `float16` (16-bit scale and zero) or `ue5m3` (8-bit scale and zero point).
    - `quantizer`: `uniform_minmax` or `uniform_unbiased`.
    - `centered`: the history stores `x - mean` with calibrated per-(layer, KV head) means (the artifact's
      `k_mean`/`v_mean`), which decode adds back exactly; costs no bits per token.
    """

    sink_tokens: int
    recent_tokens: int
    page_size: int
    group_size: int | None
    scale_format: str
    quantizer: str
    centered: bool

    def __post_init__(self) -> None:
        _check_int("sink_tokens", self.sink_tokens, 0, MAX_WINDOW_TOKENS)
        _check_int("recent_tokens", self.recent_tokens, 0, MAX_WINDOW_TOKENS)
        _check_int("page_size", self.page_size, 1, MAX_PAGE_TOKENS)
        if self.group_size is not None:
            _check_int("group_size", self.group_size, 4, MAX_GROUP_SIZE)
            if self.group_size % 4:
                raise KVFormatError("group_size", f"expected a multiple of 4 (2-bit codes pack 4 to a byte), "
                                                  f"got {self.group_size}")
        if self.scale_format not in SCALE_FORMATS:
            raise KVFormatError("scale_format", f"expected one of {list(SCALE_FORMATS)}, got {self.scale_format!r}")
        if self.quantizer not in QUANTIZERS:
            raise KVFormatError("quantizer", f"expected one of {list(QUANTIZERS)}, got {self.quantizer!r}")
        if not isinstance(self.centered, bool):
            raise KVFormatError("centered", f"expected a boolean, got {type(self.centered).__name__} "
                                            f"{self.centered!r}")

    # -- copies ------------------------------------------------------------------------------------------
    def with_(self, **changes) -> KVFormat:
        """A copy with some fields changed (None values are ignored, so optional overrides pass through)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def group(self, head_dim: int) -> int:
        """The group size at `head_dim` (None = head_dim). Raises KVFormatError when it does not divide head_dim."""
        g = self.group_size or head_dim
        if head_dim % g or g % 4:
            raise KVFormatError("group_size", f"expected a multiple of 4 dividing head_dim={head_dim}, got {g}")
        return g

    def resolved(self, head_dim: int) -> KVFormat:
        """This format with its group size named (`group(head_dim)`), as an artifact records it."""
        return replace(self, group_size=self.group(head_dim))

    def differences(self, other: KVFormat, *, ignore: tuple[str, ...] = ()) -> list[str]:
        """Names of the fields (outside `ignore`) whose values differ from `other`'s, in field order."""
        return [f.name for f in fields(self)
                if f.name not in ignore and getattr(self, f.name) != getattr(other, f.name)]

    # -- which positions are history -----------------------------------------------------------------------
    @property
    def window_tokens(self) -> int:
        """Tokens kept in BF16 once a sequence is longer than both windows."""
        return self.sink_tokens + self.recent_tokens

    @property
    def window_rows(self) -> int:
        """Rows a sequence's BF16 windows need: the sink, the recent window, and the `page_size - 1` recent tokens
        that wait there until a whole page of them is demoted to the INT2 history (`history_tokens`)."""
        return self.sink_tokens + self.recent_tokens + self.page_size - 1

    def per_token(self) -> KVFormat:
        """This format with one-token pages: the history the clip fit scores (a pair counts as soon as any page
        boundary could put its key in the history) and the teacher-forced evaluation simulates by default."""
        return replace(self, page_size=1)

    def history_tokens(self, seq_len: int) -> int:
        """INT2 history length of a sequence of `seq_len` tokens: whole pages, leaving between recent_tokens and
        recent_tokens + page_size - 1 recent tokens."""
        p = self.page_size
        return p * (max(0, seq_len - self.sink_tokens - self.recent_tokens) // p)

    def is_history(self, position, seq_len):
        """True where the token at `position` of a sequence of `seq_len` tokens is read from the INT2 history.

        The history is `[sink, sink + h)` with `h = history_tokens(seq_len)`. Elementwise on ints or on broadcastable
        integer tensors (e.g. positions `[1, T]` against lengths `[T, 1]` give a `[T, T]` mask).
        """
        p = self.page_size
        s = self.sink_tokens
        # A negative length floors to a negative history, which no position >= sink is below: no clamp needed.
        return (position >= s) & (position < s + p * ((seq_len - s - self.recent_tokens) // p))

    # -- what a token costs --------------------------------------------------------------------------------
    @property
    def scale_bytes(self) -> int:
        """Bytes of each of the scale and the zero point of one group (2 for float16, 1 for ue5m3)."""
        return SCALE_BYTES[self.scale_format]

    @property
    def scale_bits(self) -> int:
        """Bits per group spent on the scale and the zero point together (32 for float16, 16 for ue5m3)."""
        return 2 * 8 * self.scale_bytes

    def bytes_per_token(self, head_dim: int) -> int:
        """Bytes of one token's key and value in one KV head's INT2 history: two rows of `head_dim / 4` code bytes
        and four vectors (K scale, K zero, V scale, V zero) of `head_dim / group` entries of `scale_bytes`."""
        g = self.group(head_dim)
        return 2 * (head_dim // 4) + 4 * self.scale_bytes * (head_dim // g)

    def history_bits(self, head_dim: int) -> float:
        """Bits per K/V element inside the INT2 history: 2-bit codes plus the scale and zero of each group."""
        return CODE_BITS + self.scale_bits / self.group(head_dim)

    def bits_with_history(self, context_len: int, history_bits: float) -> float:
        """Bits per KV element over `context_len` tokens when the history costs `history_bits` per element and the
        sink and recent windows are BF16 (OSCAR_METHOD section 5; the history is counted per token, not per page)."""
        bf16 = min(context_len, self.window_tokens)
        history = context_len - bf16
        return (history * history_bits + bf16 * BF16_BITS) / max(context_len, 1)

    def bits_per_element(self, context_len: int, head_dim: int) -> float:
        """Bits per KV element at `context_len` tokens of this format (`bits_with_history` of `history_bits`)."""
        return self.bits_with_history(context_len, self.history_bits(head_dim))

    # -- the artifact's record -----------------------------------------------------------------------------
    def to_record(self) -> dict[str, Any]:
        """A flat JSON-able dict: `record_version` and every field (group_size None is written as null)."""
        return {"record_version": RECORD_VERSION, **asdict(self)}

    @classmethod
    def from_record(cls, record: Any) -> KVFormat:
        """The format of a `to_record()` dict. Raises KVFormatError naming the entry that is missing, unknown or
        out of its domain."""
        if not isinstance(record, dict):
            raise KVFormatError("record", f"expected a JSON object, got {type(record).__name__}")
        version = record.get("record_version")
        if version != RECORD_VERSION or isinstance(version, bool):
            raise KVFormatError("record_version", f"expected {RECORD_VERSION} (this reader knows record version "
                                                  f"{RECORD_VERSION}), got {version!r}")
        names = [f.name for f in fields(cls)]
        for name in names:
            if name not in record:
                raise KVFormatError(name, "missing from the record")
        unknown = sorted(set(record) - set(names) - {"record_version"})
        if unknown:
            raise KVFormatError(str(unknown[0]), f"unknown record entry (a record names {names})")
        return cls(**{name: record[name] for name in names})


# The recipe: what `oscar-calib run` ships and the one default of the project. ue5m3 scales make the INT2 history cost
# 2.125 bits per element at head_dim 128, which pays for 128/1024 BF16 windows within the 2.284 bits per element at
# 128K that fp16 scales cost at 64/256 (2.247 bits); measured on both fixtures: bench/results/quality/equal_bits_*.
# 64-token pages (docs/recipe.md).
DEFAULT_FORMAT = KVFormat(sink_tokens=128, recent_tokens=1024, page_size=64, group_size=None, scale_format="ue5m3",
                          quantizer="uniform_minmax", centered=True)

__all__ = ["DEFAULT_FORMAT", "KVFormat", "KVFormatError", "MAX_CLIP_RATIO", "MAX_WINDOW_TOKENS", "MIN_CLIP_RATIO",
           "QUANTIZERS", "RECORD_KEY", "RECORD_VERSION", "SCALE_BYTES", "SCALE_FORMATS"]
