"""Shared builders and error measures of the kernel tests (decode attention, cache, GPU tests)."""

from __future__ import annotations

import torch
from format_helpers import qfmt

from runtime_kernels.attention import naive as attn_naive
from runtime_kernels.attention.int2_decode import naive as paged_ref
from runtime_kernels.attention.int2_decode.pools import (
    alloc_paired_v_pools,
    alloc_quad_pools,
    paired_v_pools,
    quad_pools,
)
from runtime_kernels.attention.int2_decode.records import BatchMetadata, PagePools, Windows
from runtime_kernels.format import KVFormat
from runtime_kernels.quant import naive as qnaive


def rel_rmse(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-3) -> float:
    """RMSE of the difference over max(RMS of the reference, floor)."""
    err = (got.float() - want.float()).pow(2).mean().sqrt()
    return (err / want.float().pow(2).mean().sqrt().clamp_min(floor)).item()


def assert_lse_close(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """Same empty rows (-inf) and finite lse within atol."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], rtol=0, atol=atol), (got[fin] - want[fin]).abs().max()


SCALE_LAYOUTS = ("separate", "paired_v", "quad")


def pool_layout(pool) -> str:
    """The scale/zero layout of a `make_pool` tuple: "quad", "paired_v" or "separate" (`int2_decode.pools`)."""
    return "quad" if quad_pools(pool[1], pool[2], pool[4], pool[5]) else \
        "paired_v" if paired_v_pools(pool[4], pool[5]) else "separate"


def relayout(pool, layout: str):
    """`pool` (a `make_pool` tuple, one group per row for the interleaved layouts) with its four scale/zero pools
    copied into `layout`: "separate" (four buffers), "paired_v" (V scale and zero in one `[.., 2]` buffer) or
    "quad" (all four in one `[.., 4]` buffer, what the cache allocates)."""
    ks, kz, vs, vz = pool[1], pool[2], pool[4], pool[5]
    shape, dev, dt = ks.shape[:3], ks.device, ks.dtype
    if layout == "quad":
        new = alloc_quad_pools(*shape, dev, dtype=dt)
    elif layout == "paired_v":
        new = (torch.empty_like(ks, memory_format=torch.contiguous_format),
               torch.empty_like(kz, memory_format=torch.contiguous_format),
               *alloc_paired_v_pools(*shape, dev, dtype=dt))
    elif layout == "separate":
        new = tuple(torch.empty(t.shape, dtype=dt, device=dev) for t in (ks, kz, vs, vz))
    else:
        raise ValueError(f"layout: expected one of {SCALE_LAYOUTS}, got {layout!r}")
    for dst, src in zip(new, (ks, kz, vs, vz)):
        dst.copy_(src)
    out = list(pool)
    out[1], out[2], out[4], out[5] = new
    assert pool_layout(out) == layout
    return tuple(out)


def make_pool(lens, h_kv, d, page, group_size=None, seed=0, extra_pages=3, device="cpu", scale_format="float16",
              layout="separate"):
    """Random INT2 pools + a shuffled block table for sequences of the given history lengths.

    Returns codes/scale/zero for K and V (`[num_pages, H, P, *]`; scale/zero fp16, or uint8 for ue5m3), block_table
    int32 `[B, max_pages]`, hist_len int32 `[B]`. layout: how the scale/zero pools sit in memory (`relayout`; one
    group per row for "paired_v" and "quad", the layout the cache allocates).
    """
    gen = torch.Generator().manual_seed(seed)
    g = group_size or d
    max_pages = max(1, max(-(-n // page) for n in lens))
    n_pages = len(lens) * max_pages + extra_pages

    def pool():
        x = torch.randn(n_pages * page, h_kv, d, generator=gen) * torch.exp(
            0.5 * torch.randn(n_pages * page, h_kv, 1, generator=gen))
        c, s, z = qnaive.quantize_pack(x, None, None, qfmt(g, scale_format))
        return [t.reshape(n_pages, page, h_kv, -1).transpose(1, 2).contiguous().to(device) for t in (c, s, z)]

    kc, ks, kz = pool()
    vc, vs, vz = pool()
    table = torch.randperm(n_pages, generator=gen)[: len(lens) * max_pages].reshape(len(lens), max_pages)
    out = (kc, ks, kz, vc, vs, vz, table.to(torch.int32).to(device),
           torch.tensor(lens, dtype=torch.int32, device=device))
    return out if layout == "separate" else relayout(out, layout)


def pool_format(pool, centered: bool = False) -> KVFormat:
    """The format `make_pool`'s tensors were made in: its page size and groups (from the shapes), the scale format
    it was asked for (it stores ue5m3 as uint8, float16 as fp16), and `centered`. Windows do not matter to the
    pools (0 and 0)."""
    kc, ks = pool[0], pool[1]
    return KVFormat(sink_tokens=0, recent_tokens=0, page_size=kc.shape[2], group_size=4 * kc.shape[3] // ks.shape[3],
                    scale_format="ue5m3" if ks.dtype == torch.uint8 else "float16", quantizer="uniform_minmax",
                    centered=centered)


def pages_of(pool, means=None) -> PagePools:
    """`make_pool`'s pools as the decode API's record, in `pool_format`; means: (k_mean, v_mean) `[H_kv, d]` of a
    centered cache."""
    kc, ks, kz, vc, vs, vz = pool[:6]
    km, vm = means if means is not None else (None, None)
    return PagePools(k_codes=kc, v_codes=vc, k_scale=ks, k_zero=kz, v_scale=vs, v_zero=vz, k_mean=km, v_mean=vm,
                     fmt=pool_format(pool, centered=means is not None))


def batch_of(pool, slot_ids=None, win_len=None, whole_pages=False) -> BatchMetadata:
    """`make_pool`'s block table and history lengths (and a window's slots and lengths) as the decode API's record."""
    return BatchMetadata(block_table=pool[6], hist_len=pool[7], slot_ids=slot_ids, win_len=win_len,
                         whole_pages=whole_pages)


def decode_inputs(pool, k_win, v_win, slot_ids, win_len, whole_pages=False, means=None) -> tuple:
    """(pages, batch, windows): what `decode_attention` takes after q."""
    return (pages_of(pool, means), batch_of(pool, slot_ids, win_len, whole_pages), Windows(k_win, v_win))


def decode_records(args, whole_pages=False, means=None) -> tuple:
    """A decode call's 13 loose tensors (q, the 8 of `make_pool`, k_win, v_win, slot_ids, win_len) -> (q, pages,
    batch, windows), what `decode_attention` takes."""
    return (args[0], *decode_inputs(args[1:9], *args[9:13], whole_pages=whole_pages, means=means))


def make_q(b, h_q, d, dtype, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h_q, d, generator=gen) * 1.5).to(dtype).to(device)


def make_window(n_slots, h_kv, w, d, dtype, seed=4, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n_slots, h_kv, w, d, generator=gen).to(dtype).to(device),
            torch.randn(n_slots, h_kv, w, d, generator=gen).to(dtype).to(device))


def dense_reference(q, pool, lens, k_win=None, v_win=None, slot_ids=None, win_len=None):
    """Per sequence, in fp32: one softmax over [dequantized history ++ valid window rows] -> (o `[B, H_q, d]`,
    lse `[B, H_q]`); (0, -inf) for a sequence with nothing to attend to. lens: the history tokens to take."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        k = paged_ref.gather_history(pool[0], pool[1], pool[2], pool[6][b], int(lens[b]), pool_format(pool))
        v = paged_ref.gather_history(pool[3], pool[4], pool[5], pool[6][b], int(lens[b]), pool_format(pool))
        if k_win is not None:
            n_w = int(win_len[b])
            k = torch.cat([k, k_win[int(slot_ids[b]), :, :n_w].float()], dim=1)
            v = torch.cat([v, v_win[int(slot_ids[b]), :, :n_w].float()], dim=1)
        if k.shape[1] == 0:
            outs.append(torch.zeros(1, q.shape[1], q.shape[2], device=q.device))
            lses.append(torch.full((1, q.shape[1]), float("-inf"), device=q.device))
            continue
        o, lse = attn_naive.segment_attention(q[b:b + 1].float(), k[None], v[None])
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
