"""The cache layout: the one source of the window, page and group defaults.

A sequence's KV cache is `BF16 sink [0, sink_tokens) | INT2 history (pages of page_size tokens) |
BF16 recent (the last recent_tokens)`. Calibration (clip fit), evaluation, the artifact and the runtime all
read their defaults from `DEFAULT_LAYOUT`, so a window size is written down exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MAX_WINDOW_TOKENS = 1 << 20  # a million BF16 tokens per sequence and window: past any real model, far from overflow


@dataclass(frozen=True)
class CacheLayout:
    """Window sizes and quantization granularity of the three-segment cache.

    - `sink_tokens`: first tokens of every sequence kept in BF16 (attention sinks).
    - `recent_tokens`: the most recent tokens kept in BF16; older ones are demoted to INT2.
    - `page_size`: tokens per INT2 page (demotion and the decode kernel work a page at a time).
    - `group_size`: channels per quantization group; None = head_dim (one scale/zero per row).
    """

    sink_tokens: int = 64
    recent_tokens: int = 256
    page_size: int = 64
    group_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("sink_tokens", "recent_tokens"):
            if not 0 <= getattr(self, name) <= MAX_WINDOW_TOKENS:
                raise ValueError(f"CacheLayout.{name} must be in [0, {MAX_WINDOW_TOKENS}], got {getattr(self, name)}")
        if self.page_size <= 0:
            raise ValueError(f"CacheLayout.page_size must be > 0, got {self.page_size}")
        if self.group_size is not None and (self.group_size <= 0 or self.group_size % 4):
            raise ValueError(f"CacheLayout.group_size must be a positive multiple of 4, got {self.group_size}")

    @property
    def window_tokens(self) -> int:
        """Tokens kept in BF16 once a sequence is longer than both windows."""
        return self.sink_tokens + self.recent_tokens

    def with_(self, **changes) -> CacheLayout:
        """A copy with some fields changed (None values are ignored, so optional overrides pass through)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


DEFAULT_LAYOUT = CacheLayout()
# The calibration recipe's windows (`oscar_calib.config.SolverSettings`). With ue5m3 scales the INT2 history costs
# 2.125 bits per element at head_dim 128, which pays for 128/1024 BF16 windows within the 2.284 bits per element at
# 128K that fp16 scales cost at 64/256 (2.247 bits). Measured on both fixtures: bench/results/quality/equal_bits_*.
RECIPE_LAYOUT = CacheLayout(sink_tokens=128, recent_tokens=1024)

__all__ = ["CacheLayout", "DEFAULT_LAYOUT", "MAX_WINDOW_TOKENS", "RECIPE_LAYOUT"]
