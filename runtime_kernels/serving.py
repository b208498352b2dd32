"""What both serving engines share, `PagedKVCache` (`runtime_kernels.cache`) and the vLLM engine
(`runtime_kernels.vllm.engine`): the format an artifact is served in (`check_served_format`,
`check_served_quantizer`), how a token's rows are rotated (`rotate_rows`, exactly rounded, so a token gets the same
INT2 codes in a prompt as in a decode step), and the bounds written data must keep (`MAX_KV_MAGNITUDE`,
`NonFiniteKVError`, `mean_far_from_data`).
"""

from __future__ import annotations

import torch

from runtime_kernels import quant as quant_api
from runtime_kernels.artifact import OscarArtifact
from runtime_kernels.format import KVFormat


def rotate_rows(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """`x [T, H, d] @ R [H, d, d]` per head, accumulated in fp64 and rounded to fp32.

    The exactly rounded product does not depend on how many tokens are rotated together (an fp32 GEMM's
    summation order does), so a token gets the same rotated row, and the same INT2 codes, whether it
    arrived in a prompt or in a decode step.
    """
    return torch.einsum("thd,hde->the", x.double(), rotation.double()).float()


# Largest magnitude a stored (rotated) element may have: the INT2 pages keep scale and zero in fp16, whose range
# this is; a larger element would give an infinite scale and poison the page like a NaN does.
MAX_KV_MAGNITUDE = float(torch.finfo(torch.float16).max)


def check_served_quantizer(artifact: OscarArtifact) -> str:
    """The artifact's quantizer if this runtime serves it (`quant.naive.QUANTIZERS`); ValueError naming the field
    otherwise (`lloyd_max` codebooks: the int8 key scores rely on uniform levels)."""
    if artifact.quantizer not in quant_api.naive.QUANTIZERS:
        raise ValueError(f"{artifact.source}: field 'quantizer' is '{artifact.quantizer}'; this runtime serves "
                         f"{' and '.join(quant_api.naive.QUANTIZERS)} INT2 (uniform levels: the int8 key scores "
                         "rely on them)")
    return artifact.quantizer


def check_served_format(artifact: OscarArtifact, fmt: KVFormat | None) -> KVFormat:
    """The format to serve `artifact` in: its own `kv_format` when `fmt` is None, else `fmt` after checking that
    it differs from the artifact's only where serving may (the page size; the windows of an identity artifact, which
    fitted nothing). Raises ValueError naming the field and both values."""
    own = artifact.kv_format
    if fmt is None:
        return own
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"fmt: expected a KVFormat or None (the artifact's), got {type(fmt).__name__}")
    fmt = fmt.resolved(artifact.head_dim)
    fitted_nothing = artifact.metadata.get("key_target") == "identity"
    for name in fmt.differences(own, ignore=("page_size",)):
        asked, fitted = getattr(fmt, name), getattr(own, name)
        if name in ("sink_tokens", "recent_tokens"):
            if fitted_nothing:
                continue
            raise ValueError(f"{artifact.source}: {name}={asked} disagrees with the artifact's {name}={fitted} (its "
                             f"clips were fitted for those windows); recalibrate with --{name.split('_')[0]} {asked}, "
                             f"or serve the artifact's own format (fmt=None)")
        raise ValueError(f"{artifact.source}: {name}={asked!r} disagrees with the artifact's {name}={fitted!r} (how "
                         "its tensors are read); serve the artifact's own format (fmt=None, or its kv_format with "
                         "another page_size)")
    return fmt


class NonFiniteKVError(ValueError):
    """A key or value to be cached is NaN, infinite or beyond the fp16 range of the INT2 page scales.

    Refused at the write (nothing of that layer is written), naming the layer, KV head, sequence and position,
    because one such element would make every later attention output of that KV head's query group NaN.
    """


# A centered cache's means against the data it is given (`PagedKVCache._mean_far_from_data`): a mean of that data
# is at most its RMS norm (Jensen); 4x leaves room for prompts that differ from the calibration text. Checked on the
# first write of at least MEAN_CHECK_ROWS rows per layer (a prefill), then not again.
MEAN_DATA_RATIO = 4.0
MEAN_CHECK_ROWS = 16


def mean_far_from_data(layer: int, k_rot: torch.Tensor, v_rot: torch.Tensor, k_mean: torch.Tensor | None,
                       v_mean: torch.Tensor | None) -> str | None:
    """None when each KV head's mean (`[H, d]`, rotated basis) is within MEAN_DATA_RATIO x the root mean square norm
    of the rows the model writes (`[T, H, d]`, rotated), else what is wrong (one host sync).

    A mean the data really has is at most that data's RMS norm (Jensen: |E x| <= sqrt(E |x|^2)); a forged or foreign
    mean far outside it sets the INT2 step, so every page would hold the mean, not the data. The bound comes from the
    data, not from the artifact (whose recorded eigenvalues or RMS a forger can scale too). Used by `PagedKVCache`
    and the vLLM engine at a layer's first prefill."""
    for name, x, mean in (("k_mean", k_rot, k_mean), ("v_mean", v_rot, v_mean)):
        if mean is None:
            continue
        rms = x.float().pow(2).sum(-1).mean(0).sqrt()  # [H]
        ratio = mean.norm(dim=-1) / rms.clamp_min(1e-30)
        worst = int(ratio.argmax())
        if float(ratio[worst]) > MEAN_DATA_RATIO:
            return (f"field '{name}': |mean| = {float(mean[worst].norm()):.4g} at layer {layer}, KV head {worst} is "
                    f"{float(ratio[worst]):.3g} x the root mean square norm {float(rms[worst]):.4g} of the "
                    f"{x.shape[0]} rows this model writes (a mean of that data is at most 1x; refused above "
                    f"{MEAN_DATA_RATIO:g}x): a forged or foreign artifact, whose pages would quantize the mean, "
                    "not the data")
    return None


__all__ = ["MAX_KV_MAGNITUDE", "MEAN_CHECK_ROWS", "MEAN_DATA_RATIO", "NonFiniteKVError", "check_served_format",
           "check_served_quantizer", "mean_far_from_data", "rotate_rows"]
