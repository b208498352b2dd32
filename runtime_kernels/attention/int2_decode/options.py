"""Launch choices of the INT2 decode kernels: `DecodeOptions` (one frozen value, part of the compiled-kernel cache key)
and `DEFAULT_OPTIONS`. Torch- and Triton-free; the planner (`plan.py`) and the launcher (`launch.py`) read it.
"""

from __future__ import annotations

from dataclasses import dataclass

TILE_TOKENS = 64  # the production kernel's whole-page tile: four 16-token MMA pieces


@dataclass(frozen=True)
class DecodeOptions:
    """Launch choices of the decode kernels (frozen, hashable: part of the compiled-kernel cache key).

    - block_n: history tokens per tile (divides the page size in the production kernel).
    - num_warps, num_stages: launch shape of the history programs (1 warp was fastest wherever decode is not
      launch-bound on an H200; `docs/kernels.md`).
    - fused: one launch with the split reduce inside (eager callers) instead of two (CUDA graphs).
    - waves: whole waves of resident programs per SM that the history splits fill (production kernel on a GPU).
    - programs_per_sm: the fixed split rule where the kernel's occupancy is not known (fallback, interpreter).
    - min_split_tokens: never a history chunk shorter than this.
    - window_block, window_split_tokens: window tile and tokens per window program in the production grid.
    - maxnreg: cap on the registers per thread of the production kernels (None: the compiler's choice); more
      programs then fit an SM, at the price of spills where the cap is below what the loop keeps live.
    - pdl: the two-launch grid's split reduce as a programmatic dependent launch (compiled, Hopper or later): its
      programs start while the grid drains and wait for its partials. 0/1 or a bool.
    - prefetch_tiles: each history program of the whole-page loop asks L2 for its first tiles' codes and scales
      before its query prologue (compiled launches; 0: none), so their HBM latency overlaps the prologue. One tile
      (the default) was 0.3-7 % faster than none at all eight points timed on an H100; two were no faster than one
      (`docs/kernels.md`).
    """

    block_n: int = TILE_TOKENS
    num_warps: int = 1
    num_stages: int = 3
    fused: bool = False
    waves: int = 1
    programs_per_sm: int = 32
    min_split_tokens: int = 4 * TILE_TOKENS
    window_block: int = 16
    window_split_tokens: int = 32
    maxnreg: int | None = None
    pdl: bool = False
    prefetch_tiles: int = 1

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps", "num_stages", "waves", "programs_per_sm", "min_split_tokens",
                     "window_block", "window_split_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DecodeOptions.{name}: expected a positive integer, got {v!r}")
        if self.maxnreg is not None and (not isinstance(self.maxnreg, int) or not 24 <= self.maxnreg <= 255):
            raise ValueError(f"DecodeOptions.maxnreg: expected None or an integer in [24, 255], got {self.maxnreg!r}")
        if self.pdl not in (0, 1):  # True and False are 1 and 0; --options passes integers
            raise ValueError(f"DecodeOptions.pdl: expected a bool (or 0/1), got {self.pdl!r}")
        if not isinstance(self.prefetch_tiles, int) or not 0 <= self.prefetch_tiles <= 2:
            raise ValueError(f"DecodeOptions.prefetch_tiles: expected 0, 1 or 2, got {self.prefetch_tiles!r}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"DecodeOptions.block_n: expected a power of two >= 16, got {self.block_n}")

    def launch_kwargs(self) -> dict:
        """Triton launch options of the production kernels: warps, stages and (when set) the register cap."""
        kw = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None:
            kw["maxnreg"] = self.maxnreg
        return kw


DEFAULT_OPTIONS = DecodeOptions()


__all__ = ["DEFAULT_OPTIONS", "TILE_TOKENS", "DecodeOptions"]
