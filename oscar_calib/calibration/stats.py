"""fp64 accumulators of the attention-aware targets, per (layer, KV head). They merge by addition.

For one layer with `g = H_q / H_kv` query heads per KV head, and tensors as attention consumes them
(post-norm, post-RoPE): q `[B, H_q, T, d]`, k/v `[B, H_kv, T, d]`, per-head attention output o `[B, H_q, T, d]`:

- `key_sum[h]       = sum_{b,t,i in group h} q^T q`           (key target M_h; count = B*T*g)
- `attn_out_sum[h]  = sum_{b,t,i in group h} o^T o`           (paper's value target C_S = V^T S^T S V)
- `logit_v_sum[h]   = sum_{b,t} w_t v^T v`, `w_t = k_t M_h^(batch) k_t^T` (reference code's value target,
   with `M_h^(batch)` the query moment of the same forward batch, so shards stay additive)
- `logit_w_sum[h]   = sum_{b,t} w_t`                            (normalises the weights to mean 1)
- `key_vec_sum[h]   = sum_{b,t} k`, `value_vec_sum[h] = sum_{b,t} v` (`[H_kv, d]`: the means a centered cache
   subtracts before quantizing; count = B*T)

Per-batch products are computed in fp32 on the activations' device and added into fp64 sums.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@contextlib.contextmanager
def exact_tf32_matmuls(dtype: torch.dtype) -> Iterator[None]:
    """Allow TF32 for fp32 matmuls whose inputs came from bf16/fp16 tensors.

    TF32 keeps 10 mantissa bits, enough to hold bf16 (7) and fp16 (10) values exactly, and accumulates
    in fp32: on such inputs it computes the same products as full fp32, several times faster.
    """
    if dtype not in (torch.bfloat16, torch.float16) or not torch.cuda.is_available():
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@dataclass
class LayerStats:
    """Sums for one attention layer. Tensors `[H_kv, d, d]` float64 except the scalar counts."""

    key_sum: torch.Tensor
    attn_out_sum: torch.Tensor
    logit_v_sum: torch.Tensor
    logit_w_sum: torch.Tensor  # [H_kv] float64
    key_vec_sum: torch.Tensor | None = None  # [H_kv, d] float64
    value_vec_sum: torch.Tensor | None = None  # [H_kv, d] float64
    query_count: int = 0  # tokens x query heads per group (same for every head)
    token_count: int = 0

    @classmethod
    def zeros(cls, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu") -> LayerStats:
        z = lambda: torch.zeros(num_kv_heads, head_dim, head_dim, dtype=torch.float64, device=device)  # noqa: E731
        zv = lambda: torch.zeros(num_kv_heads, head_dim, dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(), z(), z(), torch.zeros(num_kv_heads, dtype=torch.float64, device=device), zv(), zv())

    def update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """Add one forward batch. Shapes: q, out `[B, H_q, T, d]`; k, v `[B, H_kv, T, d]`."""
        b, h_q, t, d = q.shape
        h_kv = k.shape[1]
        g = h_q // h_kv
        qf = q.float().reshape(b, h_kv, g, t, d)
        of = out.float().reshape(b, h_kv, g, t, d)
        kf = k.float()
        vf = v.float()
        with exact_tf32_matmuls(q.dtype):  # q and out hold bf16/fp16 values: TF32 products are exact
            key_batch = torch.einsum("bhgtd,bhgte->hde", qf, qf)
            self.attn_out_sum += torch.einsum("bhgtd,bhgte->hde", of, of).double()
        self.key_sum += key_batch.double()
        m_batch = key_batch / (b * t * g)  # [H_kv, d, d]
        w = torch.einsum("bhtd,hde,bhte->bht", kf, m_batch, kf)  # expected squared raw logit of each key
        self.logit_v_sum += torch.einsum("bht,bhtd,bhte->hde", w, vf, vf).double()
        self.logit_w_sum += w.sum(dim=(0, 2)).double()
        self.key_vec_sum += kf.sum(dim=(0, 2)).double()
        self.value_vec_sum += vf.sum(dim=(0, 2)).double()
        self.query_count += b * t * g
        self.token_count += b * t

    def to(self, device: torch.device | str) -> LayerStats:
        """A copy on `device` (the same object when it is already there)."""
        if self.key_sum.device == torch.device(device):
            return self
        return LayerStats(self.key_sum.to(device), self.attn_out_sum.to(device), self.logit_v_sum.to(device),
                          self.logit_w_sum.to(device), self.key_vec_sum.to(device), self.value_vec_sum.to(device),
                          self.query_count, self.token_count)

    def merge_(self, other: LayerStats) -> LayerStats:
        """In-place sum with another shard's statistics (e.g. another rank or data shard)."""
        self.key_sum += other.key_sum.to(self.key_sum.device)
        self.attn_out_sum += other.attn_out_sum.to(self.key_sum.device)
        self.logit_v_sum += other.logit_v_sum.to(self.key_sum.device)
        self.logit_w_sum += other.logit_w_sum.to(self.key_sum.device)
        self.key_vec_sum += other.key_vec_sum.to(self.key_sum.device)
        self.value_vec_sum += other.value_vec_sum.to(self.key_sum.device)
        self.query_count += other.query_count
        self.token_count += other.token_count
        return self

    # -- normalised targets ---------------------------------------------------------------
    def key_target(self) -> torch.Tensor:
        """Query second moment of each group, `[H_kv, d, d]` float64."""
        return self.key_sum / max(self.query_count, 1)

    def key_mean(self) -> torch.Tensor:
        """Mean post-RoPE key of each KV head, `[H_kv, d]` float64 (model basis)."""
        return self.key_vec_sum / max(self.token_count, 1)

    def value_mean(self) -> torch.Tensor:
        """Mean value of each KV head, `[H_kv, d]` float64 (model basis)."""
        return self.value_vec_sum / max(self.token_count, 1)

    def value_target(self, kind: str) -> torch.Tensor:
        """`attn_output` (paper) or `logit_weighted` (reference code), `[H_kv, d, d]` float64."""
        if kind == "attn_output":
            return self.attn_out_sum / max(self.query_count, 1)
        if kind == "logit_weighted":
            return self.logit_v_sum / self.logit_w_sum.clamp_min(1e-300)[:, None, None]
        raise ValueError(f"unknown value target '{kind}' (expected 'attn_output' or 'logit_weighted')")
