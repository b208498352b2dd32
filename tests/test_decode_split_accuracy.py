"""INT2 decode accuracy vs the split structure (the bench's 131072 x 32 `WRONG` flags).

Bench-like data: random code bytes, fp16 scales U(0.1, 0.6), zeros U(0, 3), so V is almost zero-mean and the output
is a heavily cancelled average, pages scattered over the pool. The exact answer is computed in float64 from the
dequantized pool. CPU (interpreter): the result must not depend on the number of splits or on the V accumulation
mode (no bookkeeping error, every token exactly once). GPU: at the failing geometry (130752 tokens, 5 / 9 / 17
splits) the default kernel stays within 2e-3 of the exact answer whatever the split count (tensor cores accumulate
with truncation; the chained accumulator drifted ~(chunk tokens / 16) ulp and the cancellation made that 1e-2)."""

from __future__ import annotations

import math

import pytest
import torch

from runtime_kernels import attention as A
from runtime_kernels.attention.int2_decode import naive as paged_ref
from tests.kernel_helpers import batch_of, pages_of, pool_format


def bench_like_pool(lens, h_kv, d, page, device, seed=0):
    """Pool as bench_decode.make_int2_cache builds it (random bytes, plausible scales), shuffled block table."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = max(-(-n // page) for n in lens)
    n = len(lens) * pages_per_seq + 5

    def codes():
        return torch.randint(0, 256, (n, h_kv, page, d // 4), dtype=torch.uint8, device=device, generator=gen)

    def vec(lo, width):
        return (torch.rand(n, h_kv, page, 1, device=device, generator=gen) * width + lo).half()

    kc, vc = codes(), codes()
    ks, vs, kz, vz = vec(0.1, 0.5), vec(0.1, 0.5), vec(0.0, 3.0), vec(0.0, 3.0)
    table = torch.randperm(n, device=device, generator=gen)[: len(lens) * pages_per_seq]
    table = table.reshape(len(lens), pages_per_seq).to(torch.int32)
    return kc, ks, kz, vc, vs, vz, table, torch.tensor(lens, dtype=torch.int32, device=device)


def exact_reference(q, kc, ks, kz, vc, vs, vz, table, hist_len):
    """float64 attention over the dequantized history: o `[B, H_q, d]`, lse `[B, H_q]`."""
    b, h_q, d = q.shape
    g = h_q // kc.shape[1]
    outs, lses = [], []
    for i in range(b):
        n = int(hist_len[i])
        k = paged_ref.gather_history(kc, ks, kz, table[i], n, pool_format((kc, ks))).double()  # [H_kv, n, d]
        v = paged_ref.gather_history(vc, vs, vz, table[i], n, pool_format((vc, vs))).double()
        k = k.repeat_interleave(g, dim=0)
        v = v.repeat_interleave(g, dim=0)
        s = torch.einsum("hd,hnd->hn", q[i].double(), k) / math.sqrt(d)
        lse = torch.logsumexp(s, dim=1)
        outs.append(torch.einsum("hn,hnd->hd", torch.exp(s - lse[:, None]), v))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def rel(got, want) -> float:
    return ((got.double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


@pytest.mark.interpreter
def test_split_count_does_not_change_the_answer_cpu():
    """Scaled-down 131072 x 32 structure: a 4160-token history over 65 scattered pages, split 5 / 9 / 17 ways
    (chunks of 832 / 512 / 256 tokens, uneven last chunk), production kernel (masked tiles: the whole-page pieces
    take minutes under the interpreter at this length; they are checked bit for bit by test_decode_bitwise.py and
    at this geometry on the GPU below) vs float64."""
    pool = bench_like_pool([4160, 3001], h_kv=1, d=32, page=64, device="cpu", seed=3)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    o_ex, lse_ex = exact_reference(q, *pool)
    for splits in (5, 9, 17):
        o, lse = A.int2_decode_attention(q, pages_of(pool), batch_of(pool), backend="triton", num_splits=splits)
        assert rel(o, o_ex) < 2e-3, splits  # fp16 rounding of p * scale only
        assert (lse.double() - lse_ex).abs().max().item() < 2e-4, splits


@pytest.mark.gpu
@pytest.mark.parametrize("whole", [True, False])
def test_long_chunks_stay_accurate_on_gpu(whole):
    """The failing bench geometry per sequence: 130752 tokens (2043 pages of 64, scattered), 8 KV heads, 32 query
    heads, d 128, bf16 q, split 5 / 9 / 17 ways as at 131072 x 32. The production kernel (per-tile V dots added by
    an FFMA, not chained in the truncating MMA accumulator) must be within 2e-3 of float64 at every split count."""
    pool = bench_like_pool([130752, 130752], h_kv=8, d=128, page=64, device="cuda", seed=7)
    q = torch.randn(2, 32, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(8))
    q = q.to(torch.bfloat16)
    o_ex, lse_ex = exact_reference(q, *pool)
    errs = {}
    for splits in (5, 9, 17):
        o, lse = A.int2_decode_attention(q, pages_of(pool), batch_of(pool, whole_pages=whole), num_splits=splits)
        errs[splits] = rel(o, o_ex)
        assert (lse.double() - lse_ex).abs().max().item() < 1e-3
    assert max(errs.values()) < 2e-3, errs
