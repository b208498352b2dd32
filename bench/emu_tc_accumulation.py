"""CPU emulation of how the INT2 decode kernel accumulates `P @ V` over a split, against float64.

One sequence of `TOKENS` history tokens, one KV head with `GROUP` query heads, bench-like random data.
Accumulation modes:
- chain: the tensor-core accumulator carries the whole chunk (K = 16 steps, fp32 rounded toward zero after
  each step: the tensor-core model);
- tile: a fresh per-tile product added to the chunk total with round-to-nearest fp32 (IMPL5_TILE_ACC);
- vfold: a fresh product on `1024 + code`, the offset subtracted in fp32 afterwards.
Prints the relative RMSE of the merged output vs float64 per split count and mode.

    python bench/emu_tc_accumulation.py SEED SPLITS MODES      e.g.  1 5,9,17,33 chain,tile,vfold
"""

from __future__ import annotations

import math
import os
import sys

import torch

TOKENS = int(os.environ.get("EMU_TOKENS", 130752))  # history at 128K context with 320 BF16 window tokens
HEAD_DIM = 128
GROUP = 4
TILE = 64
LOG2E = 1.4426950408889634


def round_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """float64 -> nearest fp32 toward zero, returned as float64."""
    y = x.float()
    overshoot = y.double().abs() > x.abs()
    return torch.where(overshoot, torch.nextafter(y, torch.zeros_like(y)), y).double()


def tensor_core_mma(acc: torch.Tensor, pv: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """`acc [G, D] + pv [G, n] @ codes [n, D]` in K = 16 steps, truncating after each step."""
    for k in range(0, pv.shape[1], 16):
        acc = round_toward_zero(acc + pv[:, k:k + 16] @ codes[k:k + 16])
    return acc


def fp32(x: torch.Tensor) -> torch.Tensor:
    return x.float().double()


def make_data(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(GROUP, HEAD_DIM, generator=g).to(torch.bfloat16).double()
    k_codes = torch.randint(0, 4, (TOKENS, HEAD_DIM), generator=g).double()
    v_codes = torch.randint(0, 4, (TOKENS, HEAD_DIM), generator=g).double()
    k_scale = (torch.rand(TOKENS, generator=g) * 0.5 + 0.1).half().double()
    v_scale = (torch.rand(TOKENS, generator=g) * 0.5 + 0.1).half().double()
    k_zero = (torch.rand(TOKENS, generator=g) * 3).half().double()
    v_zero = (torch.rand(TOKENS, generator=g) * 3).half().double()
    scores = (q @ k_codes.T - k_zero[None] * q.sum(1)[:, None]) * k_scale[None] * LOG2E / math.sqrt(HEAD_DIM)
    return scores, v_codes, v_scale, v_zero


def split_output(scores, v_codes, v_scale, v_zero, start: int, end: int, mode: str):
    """Online-softmax partial output (o, lse in log2) of tokens [start, end) as the kernel computes it."""
    m = torch.full((GROUP,), -math.inf, dtype=torch.float64)
    denom = torch.zeros(GROUP, dtype=torch.float64)
    acc = torch.zeros(GROUP, HEAD_DIM, dtype=torch.float64)
    acc_zero = torch.zeros(GROUP, dtype=torch.float64)
    for t0 in range(start, end, TILE):
        t1 = min(t0 + TILE, end)
        s = fp32(scores[:, t0:t1])
        m_new = torch.maximum(m, s.max(1).values)
        alpha = fp32(torch.exp2(m - m_new))
        p = torch.exp2(s - m_new[:, None]).float()
        denom = denom * alpha + p.double().sum(1)
        pv = (p * v_scale[t0:t1].float()[None]).half().double()  # fp16 operand of the V product
        acc_zero = fp32(acc_zero * alpha + (pv * v_zero[t0:t1][None]).sum(1))
        codes = v_codes[t0:t1]
        if mode == "chain":
            acc = tensor_core_mma(fp32(acc * alpha[:, None]), pv, codes)
        elif mode == "tile":
            acc = fp32(acc * alpha[:, None] + tensor_core_mma(torch.zeros_like(acc), pv, codes))
        elif mode == "vfold":
            product = tensor_core_mma(torch.zeros_like(acc), pv, codes + 1024)
            acc = fp32(acc * alpha[:, None] + fp32(product - fp32(pv.sum(1) * 1024)[:, None]))
        else:
            raise ValueError(f"mode must be chain, tile or vfold, got {mode!r}")
        m = m_new
    return (acc - acc_zero[:, None]) / denom[:, None], m + torch.log2(denom)


def merged_output(scores, v_codes, v_scale, v_zero, splits: int, mode: str) -> tuple[torch.Tensor, int]:
    per_split = math.ceil(TOKENS / splits)
    chunk = math.ceil(per_split / TILE) * TILE  # tokens per split, rounded up to whole tiles
    outs, lses = [], []
    for sp in range(splits):
        start, end = sp * chunk, min(sp * chunk + chunk, TOKENS)
        if start < end:
            o, lse = split_output(scores, v_codes, v_scale, v_zero, start, end, mode)
            outs.append(o)
            lses.append(lse)
    o, lse = torch.stack(outs, 1), torch.stack(lses, 1)
    w = torch.exp2(lse - lse.max(1, keepdim=True).values)
    return (w[:, :, None] * o).sum(1) / w.sum(1, keepdim=True), chunk


def rel_rmse(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def main(seed: int, split_counts: list[int], modes: list[str]) -> None:
    scores, v_codes, v_scale, v_zero = make_data(seed)
    weights = torch.exp2(scores - scores.max(1, keepdim=True).values)
    exact = (weights @ ((v_codes - v_zero[:, None]) * v_scale[:, None])) / weights.sum(1, keepdim=True)
    for splits in split_counts:
        for mode in modes:
            o, chunk = merged_output(scores, v_codes, v_scale, v_zero, splits, mode)
            print(f"seed {seed} splits {splits} ({chunk} tokens each) {mode}: rel. RMSE vs float64 "
                  f"{rel_rmse(o, exact):.2e}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], sys.argv[3].split(","))
