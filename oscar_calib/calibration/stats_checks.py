"""Value checks for calibration sums, statistics files and checkpoints: what a real capture can produce.

`stats_file.sums_from_tensors` checks names, dtypes and shapes; these check the values, so that a statistics file,
a merge or a checkpoint is trusted no more than an artifact (`runtime_kernels.contract`):

- every sum is finite; the second-moment sums (`key_sum`, `attn_out_sum`, `logit_v_sum`: sums of `x^T x`) have a
  non-negative diagonal, and `logit_w_sum` (sums of `k M k^T`, M a second moment) is non-negative;
- counts: `token_count` > 0 and the same in every layer, `query_count = token_count * H_q / H_kv`, and (when the
  provenance records `seq_len`) `token_count = samples summed * seq_len`, the samples being those of the recorded
  sample ranges (a statistics file) or `[start, next_sample)` (a checkpoint);
- the held-out capture: finite, shapes `[S, H_kv, T, d]` / `[S, H_q, n, d]` / `[S, n]`, positions inside `[0, T)`;
- o_proj weights (the block_out clip fit): `[hidden, H_q * d]`, one hidden size for every layer, finite;
- the attention scaling: finite and positive.

Every refusal is an InputError (exit 2) naming the file (`where`) and the field.
"""

from __future__ import annotations

import hashlib
import math

import torch

from oscar_calib.errors import InputError

_SECOND_MOMENTS = ("key_sum", "attn_out_sum", "logit_v_sum")
_SUMS = (*_SECOND_MOMENTS, "logit_w_sum", "key_vec_sum", "value_vec_sum")


def _fail(where: str, field: str, message: str) -> None:
    raise InputError(f"{where}: field '{field}': {message}")


def check_sums(stats: dict, where: str, geometry: dict | None = None) -> None:
    """Finite sums, non-negative where a sum of squares must be, counts positive and consistent across layers.

    stats: layer -> LayerStats. geometry: the provenance's (`num_attention_heads`, `num_key_value_heads`), if known.
    """
    tokens = None
    for layer, s in sorted(stats.items()):
        for name in _SUMS:
            t = getattr(s, name)
            if t is None:
                _fail(where, name, f"missing for layer {layer}")
            if not bool(torch.isfinite(t).all()):
                _fail(where, name, f"layer {layer} contains NaN or Inf (expected the finite sums of a capture)")
        for name in _SECOND_MOMENTS:
            diag = getattr(s, name).diagonal(dim1=-2, dim2=-1)
            if bool((diag < 0).any()):
                _fail(where, name, f"layer {layer} has a negative diagonal entry {float(diag.min())!r} (a sum of "
                                   "squares is >= 0)")
        if bool((s.logit_w_sum < 0).any()):
            _fail(where, "logit_w_sum", f"layer {layer} has a negative weight {float(s.logit_w_sum.min())!r} "
                                        "(expected >= 0)")
        if s.token_count <= 0 or s.query_count <= 0:
            _fail(where, "token_count" if s.token_count <= 0 else "query_count",
                  f"layer {layer} counts {s.token_count} tokens and {s.query_count} queries (expected > 0)")
        if tokens is not None and s.token_count != tokens:
            _fail(where, "token_count", f"layer {layer} counts {s.token_count} tokens, the first layer {tokens} "
                                        "(every layer sees the same tokens)")
        tokens = s.token_count
        if geometry:
            h_q, h_kv = geometry.get("num_attention_heads"), geometry.get("num_key_value_heads")
            if isinstance(h_q, int) and isinstance(h_kv, int) and h_kv > 0 and h_q % h_kv == 0 \
                    and s.query_count != s.token_count * (h_q // h_kv):
                _fail(where, "query_count", f"layer {layer} counts {s.query_count} queries for {s.token_count} "
                                            f"tokens, expected tokens x {h_q // h_kv} (H_q / H_kv)")


def samples_in(ranges) -> int:
    return sum(int(b) - int(a) for a, b in ranges)


def check_counts_match_samples(stats: dict, identity: dict, ranges, where: str, field: str = "sample_ranges") -> None:
    """`token_count = samples in ranges * seq_len` in every layer (`seq_len` from the identity's `data`), and
    `query_count` consistent with the geometry. `field` names what the ranges came from in the message."""
    check_sums(stats, where, identity.get("geometry") if isinstance(identity.get("geometry"), dict) else None)
    data = identity.get("data") if isinstance(identity.get("data"), dict) else {}
    seq_len = data.get("seq_len")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        return  # statistics without a recorded sequence length (hand-made in tests): counts checked above only
    try:
        samples = samples_in(ranges)
    except (TypeError, ValueError):
        _fail(where, field, f"expected [start, end) pairs of integers, got {ranges!r}")
    want = samples * seq_len
    for layer, s in sorted(stats.items()):
        if s.token_count != want:
            _fail(where, field, f"says {samples} samples of {seq_len} tokens ({want} tokens), but layer {layer} "
                                f"counts {s.token_count} tokens; the file was edited or is not what it claims")


def check_ranges(ranges, where: str, total: int | None = None) -> list[list[int]]:
    """`sample_ranges`: a list of [start, end) integer pairs with 0 <= start < end (<= total when known)."""
    if not isinstance(ranges, list) or not ranges:
        _fail(where, "sample_ranges", f"expected a non-empty list of [start, end) pairs, got {ranges!r}")
    out = []
    for r in ranges:
        if not (isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) and 0 <= r[0] < r[1]
                and (total is None or r[1] <= total)):
            bound = f" and end <= {total} (the data's samples)" if total is not None else ""
            _fail(where, "sample_ranges", f"expected [start, end) integer pairs with 0 <= start < end{bound}, "
                                          f"got {r!r}")
        out.append(list(r))
    return out


def check_scaling(scaling: float, where: str) -> None:
    if not (isinstance(scaling, float) and math.isfinite(scaling) and scaling > 0):
        _fail(where, "scaling", f"expected a finite positive attention scaling, got {scaling!r}")


def check_holdout(holdout: dict, geometry: dict, where: str) -> None:
    """Held-out rows per layer: finite keys/values/queries of the geometry's shapes, positions inside the sequence."""
    h_q, h_kv, d = (geometry.get(k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    for layer, rows in sorted(holdout.items()):
        keys, values, queries, positions = rows.stacked()
        if keys.dim() != 4 or tuple(keys.shape[1:2] + keys.shape[3:]) != (h_kv, d):
            _fail(where, "holdout_keys", f"layer {layer} has shape {list(keys.shape)}, expected [S, {h_kv}, T, {d}]")
        if tuple(values.shape) != tuple(keys.shape):
            _fail(where, "holdout_values", f"layer {layer} has shape {list(values.shape)}, expected {list(keys.shape)}")
        s, _, t, _ = keys.shape
        if queries.dim() != 4 or (queries.shape[0], queries.shape[1], queries.shape[3]) != (s, h_q, d):
            _fail(where, "holdout_queries", f"layer {layer} has shape {list(queries.shape)}, expected [{s}, {h_q}, n, {d}]")
        if tuple(positions.shape) != (s, queries.shape[2]) or positions.dtype != torch.int64:
            _fail(where, "holdout_positions", f"layer {layer} is {positions.dtype} {list(positions.shape)}, expected "
                                              f"int64 [{s}, {queries.shape[2]}]")
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= t):
            _fail(where, "holdout_positions", f"layer {layer} has a position outside [0, {t})")
        for name, tensor in (("holdout_keys", keys), ("holdout_values", values), ("holdout_queries", queries)):
            if not bool(torch.isfinite(tensor).all()):
                _fail(where, name, f"layer {layer} contains NaN or Inf (a capture refuses those)")


def check_o_weights(o_weights: dict, geometry: dict, where: str) -> None:
    """o_proj weights `[hidden, H_q * d]`, the same hidden size in every layer, finite."""
    cols = geometry.get("num_attention_heads", 0) * geometry.get("head_dim", 0)
    hidden = None
    for layer, w in sorted(o_weights.items()):
        name = f"o_proj.{layer}"
        if w.dim() != 2 or w.shape[1] != cols or w.shape[0] == 0 or (hidden is not None and w.shape[0] != hidden):
            _fail(where, name, f"has shape {list(w.shape)}, expected [{hidden or 'hidden'}, {cols}] (H_q x head_dim "
                               "columns, one hidden size for every layer): a truncated or foreign weight")
        if not w.is_floating_point() or not bool(torch.isfinite(w).all()):
            _fail(where, name, "contains NaN or Inf, or is not a floating-point tensor")
        hidden = w.shape[0]


def sums_digest(stats: dict) -> str:
    """sha256 of the sums' bytes (layer order): equal digests mean the same samples were summed."""
    digest = hashlib.sha256()
    for layer, s in sorted(stats.items()):
        digest.update(str(layer).encode())
        for name in _SUMS:
            digest.update(getattr(s, name).detach().cpu().contiguous().numpy().tobytes())
        digest.update(f"{s.query_count},{s.token_count}".encode())
    return digest.hexdigest()
