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
- the attention scaling: finite, positive and within 64x of 1/sqrt(head_dim) either way (every released model);
- the second moments are positive semidefinite (symmetric, eigenvalues >= -1e-5 x the largest: fp32 batch products
  summed in fp64 stay far inside that), not only their diagonals;
- magnitudes a model can produce: held-out keys, values and queries, means and mean squares of the sums, and o_proj
  weights at most 65504 (fp16's range: the INT2 pages keep fp16 scales, and the serving cache refuses larger
  elements), and held-out queries within 10^4 of the sums' mean square (the same distribution): a tensor scaled by
  1e30 once turned every clip ratio into 1.0 through fp32 overflow in the fit;
- `sample_digests` (one per summed sample, the sha256 of its token ids): a merge refuses two inputs that summed a
  sample of the same tokens, however their sums or ranges were edited;
- the model id has no `..` component, control character or quote (it names a directory on push and is printed
  into the model card's code).

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


SCALING_SPREAD = 64.0  # scaling x sqrt(head_dim) of released models: 1/128 x sqrt(128) (Granite) to ~1.3 (Gemma2)
MAX_ACTIVATION = 65504.0  # fp16's largest: the INT2 pages keep fp16 scales; the serving cache refuses larger
HOLDOUT_SPREAD = 1e4  # held-out mean square vs the sums' (one distribution: measured within 2x on real captures)
PSD_TOLERANCE = 1e-5  # eigenvalue floor relative to the largest (fp32 batch products summed in fp64)


def check_scaling(scaling: float, where: str, head_dim: int | None = None) -> None:
    """Finite and positive; with `head_dim`, within SCALING_SPREAD of 1/sqrt(head_dim) either way."""
    if not (isinstance(scaling, float) and math.isfinite(scaling) and scaling > 0):
        _fail(where, "scaling", f"expected a finite positive attention scaling, got {scaling!r}")
    if isinstance(head_dim, int) and head_dim > 0:
        low, high = 1 / (SCALING_SPREAD * math.sqrt(head_dim)), SCALING_SPREAD / math.sqrt(head_dim)
        if not low <= scaling <= high:
            _fail(where, "scaling", f"expected an attention scaling in [{low:.3g}, {high:.3g}] (1/sqrt(head_dim="
                                    f"{head_dim}) within {SCALING_SPREAD:g}x), got {scaling!r}")


def check_psd(stats: dict, where: str) -> None:
    """Second-moment sums symmetric and positive semidefinite per (layer, KV head), by their eigenvalues."""
    for layer, s in sorted(stats.items()):
        for name in _SECOND_MOMENTS:
            m = getattr(s, name)
            scale = m.abs().amax(dim=(-2, -1)).clamp_min(1e-300)
            asym = float(((m - m.transpose(-2, -1)).abs().amax(dim=(-2, -1)) / scale).max())
            if asym > PSD_TOLERANCE:
                _fail(where, name, f"layer {layer} is not symmetric (relative asymmetry {asym:.3g}; a sum of x^T x "
                                   "is symmetric)")
            eig = torch.linalg.eigvalsh(m)
            floor = -PSD_TOLERANCE * eig[..., -1].clamp_min(0)
            bad = eig[..., 0] < floor
            if bool(bad.any()):
                head = int(bad.nonzero()[0][-1]) if bad.dim() else 0
                _fail(where, name, f"layer {layer}, KV head {head} has eigenvalue {float(eig[..., 0].min()):.6g} "
                                   f"below -{PSD_TOLERANCE:g} x its largest (a sum of x^T x is positive "
                                   "semidefinite)")


def check_magnitudes(stats: dict, holdout: dict, o_weights: dict | None, where: str) -> None:
    """Means, mean squares, held-out rows and o_proj weights of magnitudes a model produces (MAX_ACTIVATION);
    held-out queries within HOLDOUT_SPREAD of the sums' mean square."""
    big = MAX_ACTIVATION
    for layer, s in sorted(stats.items()):
        tokens, queries = max(s.token_count, 1), max(s.query_count, 1)
        for name, mean in (("key_vec_sum", s.key_vec_sum / tokens), ("value_vec_sum", s.value_vec_sum / tokens)):
            if float(mean.abs().max()) > big:
                _fail(where, name, f"layer {layer} has a mean element of {float(mean.abs().max()):.6g}, above "
                                   f"{big:g} (the fp16 range of the INT2 pages)")
        for name, count in (("key_sum", queries), ("attn_out_sum", queries)):
            mean_sq = getattr(s, name).diagonal(dim1=-2, dim2=-1) / count
            if float(mean_sq.max()) > big * big:
                _fail(where, name, f"layer {layer} has a mean square of {float(mean_sq.max()):.6g}, above {big:g}^2 "
                                   "(the fp16 range of the INT2 pages)")
    for layer, rows in sorted(holdout.items()):
        for name, t in zip(("holdout_keys", "holdout_values", "holdout_queries"), rows.stacked()[:3]):
            if t.numel() and float(t.abs().max()) > big:
                _fail(where, name, f"layer {layer} has an element of {float(t.abs().max()):.6g}, above {big:g} (the "
                                   "fp16 range of the INT2 pages; the serving cache refuses such rows)")
        queries = rows.stacked()[2]
        if layer in stats and queries.numel():
            held = float(queries.double().pow(2).mean())
            s = stats[layer]
            summed = float(s.key_sum.diagonal(dim1=-2, dim2=-1).sum()) / max(s.query_count, 1) / s.key_sum.shape[-1]
            if summed > 0 and not summed / HOLDOUT_SPREAD <= held <= summed * HOLDOUT_SPREAD:
                _fail(where, "holdout_queries", f"layer {layer} has a mean square of {held:.6g}, but 'key_sum' says "
                                                f"{summed:.6g} (expected within {HOLDOUT_SPREAD:g}x: the held-out text "
                                                "comes from the same data)")
    for layer, w in sorted((o_weights or {}).items()):
        if w.numel() and float(w.abs().max()) > big:
            _fail(where, f"o_proj.{layer}", f"has an element of {float(w.abs().max()):.6g}, above {big:g} (no "
                                            "model's output projection is that large)")


_DIGEST_CHARS = frozenset("0123456789abcdef")


def sample_digests(input_ids: torch.Tensor) -> list[str]:
    """One digest per sample (row of `input_ids` `[N, T]`): the first 16 hex digits of the sha256 of its int64
    token ids. Two samples of the same tokens have the same digest, whatever sums were made of them."""
    rows = input_ids.detach().to("cpu", torch.int64).contiguous()
    return [hashlib.sha256(row.numpy().tobytes()).hexdigest()[:16] for row in rows]


def check_sample_digests(digests, ranges, where: str) -> None:
    """`sample_digests`: a list of 16-hex-digit strings, one per sample of the (checked) sample ranges."""
    if not isinstance(digests, list) or not all(isinstance(x, str) and len(x) == 16 and set(x) <= _DIGEST_CHARS
                                                for x in digests):
        _fail(where, "sample_digests", "expected a list of 16-hex-digit strings (one per summed sample)")
    if len(digests) != samples_in(ranges):
        _fail(where, "sample_digests", f"lists {len(digests)} samples, but 'sample_ranges' {ranges} holds "
                                       f"{samples_in(ranges)}; the file was edited or is not what it claims")


def check_recorded_model_id(value, where: str) -> None:
    """A model id read from a file: a Hub id or the path `run` was given, never with a `..` component, a control
    character or a quote (it becomes a directory on push and is printed into the model card's code)."""
    if not isinstance(value, str) or not value or len(value) > 1024:
        _fail(where, "model_id", f"expected a Hub model id or a model path, got {str(value)[:60]!r}")
    if any(ord(c) < 32 or ord(c) == 127 or c in "'\"`" for c in value):
        _fail(where, "model_id", f"expected no control characters or quotes, got {ascii(value)[:80]}")
    if ".." in value.replace("\\", "/").split("/"):
        _fail(where, "model_id", f"expected no '..' component, got {value[:80]!r} (a Hub id is 'ORG/NAME'; a local "
                                 "model is recorded by its path without '..')")


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
