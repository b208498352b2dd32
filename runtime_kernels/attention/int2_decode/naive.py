"""Readable torch references for the paged INT2 KV layout: the definitions the decode kernels are tested against,
and the CPU backend of the functional API. They favour clarity over speed (a Python loop over the batch).

Pool layout for one attention layer (H = KV heads, d = head_dim, G = group size, P = page size):
- codes: uint8 `[num_pages, H, P, d // 4]` (quarter-split packing of `naive.pack`)
- scale, zero: `[num_pages, H, P, d // G]`, float16 both, or uint8 both (ue5m3 scale code and zero point in 1/64
  code, `runtime_kernels.quant.naive`): the pools' dtype is the scale format
- windows: `[num_slots, H, W, d]` (bf16 on GPU; any float dtype), rows `[0, win_len)` valid
- `block_table` int `[B, max_pages]`, `hist_len` int `[B]`: token t of sequence b's history lives at
  page `block_table[b, t // P]`, row `t % P`.
Keys in the pool are already rotated by R_K; queries passed here must be rotated by R_K too; outputs are
in the R_V-rotated value basis.
"""

from __future__ import annotations

import math

import torch

from runtime_kernels.attention import naive as attn_naive
from runtime_kernels.format import KVFormat
from runtime_kernels.quant import naive as quant_naive


def gather_history(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, pages: torch.Tensor,
                   length: int, fmt: KVFormat) -> torch.Tensor:
    """Dequantize one sequence's INT2 history.

    Args:
        codes: `[num_pages, H, P, d // 4]` uint8 pool; scale, zero: `[num_pages, H, P, d // G]` stored as
            `fmt.scale_format` says (fp16, or uint8 for ue5m3).
        pages: int `[n]` page ids of the sequence, in order (at least `ceil(length / P)` of them).
        length: number of history tokens.
        fmt: the pools' format (its scale format decodes the scales).
    Returns:
        fp32 `[H, length, d]` in the rotated basis.
    """
    p = codes.shape[2]
    n_pages = -(-length // p)
    ids = pages[:n_pages].long()
    # [n, H, P, *] -> [H, n * P, *] so that token t sits at row t.
    c = codes[ids].permute(1, 0, 2, 3).reshape(codes.shape[1], n_pages * p, codes.shape[3])
    s = scale[ids].permute(1, 0, 2, 3).reshape(scale.shape[1], n_pages * p, scale.shape[3])
    z = zero[ids].permute(1, 0, 2, 3).reshape(zero.shape[1], n_pages * p, zero.shape[3])
    return quant_naive.unpack_dequantize(c[:, :length], s[:, :length], z[:, :length], fmt)


def _one_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[H_q, d]`, k/v `[H, N, d]` -> (o `[H_q, d]` fp32, lse `[H_q]` fp32); empty segment -> (0, -inf)."""
    h_q, d = q.shape
    if k.shape[1] == 0:
        return (torch.zeros(h_q, d, dtype=torch.float32, device=q.device),
                torch.full((h_q,), float("-inf"), dtype=torch.float32, device=q.device))
    o, lse = attn_naive.segment_attention(q[None], k[None], v[None], scale=sm_scale)
    return o[0], lse[0]


def int2_decode_attention_ref(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                              v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                              block_table: torch.Tensor, hist_len: torch.Tensor,
                              sm_scale: float | None = None, k_mean: torch.Tensor | None = None,
                              v_mean: torch.Tensor | None = None, *, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query per sequence over its paged INT2 history, in the pools' format `fmt`.

    Args:
        q: `[B, H_q, d]` queries, already rotated by R_K.
        k_codes, v_codes: `[num_pages, H, P, d // 4]` uint8; k/v_scale, k/v_zero: `[num_pages, H, P, d // G]` fp16.
        block_table: int `[B, max_pages]`; hist_len: int `[B]`.
        sm_scale: softmax scale (default `1 / sqrt(d)`).
        k_mean, v_mean: fp32 `[H, d]` means of a centered cache (the pools hold quant(x_rot - mu)): the history's
            keys and values are dequant + mu. None: uncentered.
    Returns:
        o fp32 `[B, H_q, d]` (rotated V basis; 0 where hist_len == 0), lse fp32 `[B, H_q]` (-inf where empty).
    """
    b, h_q, d = q.shape
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    outs, lses = [], []
    for i in range(b):
        n = int(hist_len[i])
        k = gather_history(k_codes, k_scale, k_zero, block_table[i], n, fmt)
        v = gather_history(v_codes, v_scale, v_zero, block_table[i], n, fmt)
        if k_mean is not None:
            k = k + k_mean.float()[:, None, :]
            v = v + v_mean.float()[:, None, :]
        o, lse = _one_segment(q[i], k, v, sm_scale)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def hilo_query_ref(q: torch.Tensor) -> torch.Tensor:
    """The query as the production kernel's int8 score MMAs see it (whole pages, head_dim 128/256), fp32.

    Per (sequence, head): sq = max |q| / 127; hi = round(q / sq) and lo = round(254 (q / sq - hi)), both int8 in
    [-127, 127]; the kernel scores with 254 hi + lo, i.e. with q~ = sq (hi + lo / 254), within sq / 508 of q.
    Rounding is half up (floor(x + 0.5)), as in the kernel.
    """
    x = q.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    sq = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    qs = x / sq
    hi = torch.floor(qs + 0.5)
    lo = torch.floor((qs - hi) * 254.0 + 0.5)
    return (sq.double() * (hi.double() + lo.double() / 254.0)).float()


def window_attention_ref(q: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, slot_ids: torch.Tensor,
                         win_len: torch.Tensor, sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over the full-precision sink + recent window of each sequence.

    Args:
        q: `[B, H_q, d]`; k_win, v_win: `[num_slots, H, W, d]`; slot_ids, win_len: int `[B]`
        (rows `[0, win_len[b])` of slot `slot_ids[b]` are valid).
    Returns:
        o fp32 `[B, H_q, d]`, lse fp32 `[B, H_q]` (0 / -inf where win_len == 0).
    """
    b, h_q, d = q.shape
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    outs, lses = [], []
    for i in range(b):
        s, n = int(slot_ids[i]), int(win_len[i])
        o, lse = _one_segment(q[i], k_win[s, :, :n].float(), v_win[s, :, :n].float(), sm_scale)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def merge_attention_ref(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                        lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial results: o `[..., d]`, lse `[...]` each -> (o, lse) of the union (fp32)."""
    o, lse = attn_naive.merge([o_a, o_b], [lse_a, lse_b])
    both_empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    lse = torch.where(both_empty, torch.full_like(lse, float("-inf")), lse)
    return o, lse


def quantize_pack_ref(x: torch.Tensor, rotation: torch.Tensor | None, clip_ratio: torch.Tensor | None,
                      fmt: KVFormat, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x [T, H, d]` -> (packed uint8 `[T, H, d // 4]`, scale and zero `[T, H, d // G]`: fp16, or uint8 for ue5m3),
    as `fmt` encodes the history."""
    return quant_naive.quantize_pack(x, rotation, clip_ratio, fmt, mean=mean)


def write_pages_ref(x: torch.Tensor, rotation: torch.Tensor | None, clip_ratio: torch.Tensor | None,
                    codes_pool: torch.Tensor, scale_pool: torch.Tensor, zero_pool: torch.Tensor,
                    page_ids: torch.Tensor, rows: torch.Tensor, fmt: KVFormat,
                    mean: torch.Tensor | None = None) -> None:
    """Quantize `x [T, H, d]` as `fmt` encodes the history and scatter token t into `pool[page_ids[t], :, rows[t]]`
    (in place).

    Pools: codes `[num_pages, H, P, d // 4]` uint8, scale/zero `[num_pages, H, P, d // G]` stored as `scale_format`
    says (fp16, or uint8 for ue5m3); page_ids, rows: int `[T]`.
    """
    packed, scale, zero = quantize_pack_ref(x, rotation, clip_ratio, fmt, mean)
    p, r = page_ids.long(), rows.long()
    codes_pool[p, :, r] = packed
    scale_pool[p, :, r] = scale.to(scale_pool.dtype)
    zero_pool[p, :, r] = zero.to(zero_pool.dtype)


def merge_pair(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
               lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials: o `[..., d]`, lse `[...]` each -> (o fp32 `[..., d]`, lse fp32 `[...]`)."""
    lse_a = lse_a.float()
    lse_b = lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a = torch.exp(lse_a - m_safe)
    w_b = torch.exp(lse_b - m_safe)
    tot = w_a + w_b
    o = (w_a.unsqueeze(-1) * o_a.float() + w_b.unsqueeze(-1) * o_b.float()) / tot.clamp_min(1e-30).unsqueeze(-1)
    lse = torch.where(tot > 0, m_safe + torch.log(tot), torch.full_like(tot, float("-inf")))
    return o, lse


def reduce_splits_torch(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge along the split axis: o_part `[B, H, S, d]`, lse_part `[B, H, S]` -> (o `[B, H, d]`, lse `[B, H]`)."""
    m = lse_part.amax(dim=-1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_part - m_safe.unsqueeze(-1))
    tot = w.sum(dim=-1)
    o = (w.unsqueeze(-1) * o_part).sum(dim=-2) / tot.clamp_min(1e-30).unsqueeze(-1)
    lse = torch.where(tot > 0, m_safe + torch.log(tot), torch.full_like(tot, float("-inf")))
    return o, lse
