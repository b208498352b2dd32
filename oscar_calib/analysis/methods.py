"""KV-cache quantization methods compared by `oscar-calib eval` and `oscar-calib audit`.

Every method fake-quantizes (quantize, then dequantize back to the model's basis) with the runtime's
reference quantizer `runtime_kernels.quant.naive`, so evaluation and serving share one quantizer.

Shapes: keys and values are `[B, H_kv, T, d]` as transformers' attention functions receive them
(post-RoPE keys, not repeated for GQA). Positions are absolute within the sequence.

Methods:
- `bf16`: no quantization (the reference).
- `int2`: per-token asymmetric min-max INT2 (groups, scales and quantizer of its `fmt`), no rotation.
- `kivi2-gN`: KIVI-style: keys per channel over blocks of N tokens (blocks start at the end of the
  sink, so the quantized history splits into whole blocks), values per token like `int2`.
- `quarot-int2`: normalised Hadamard rotation, no clipping, then `int2`.
- `hadamard-clip`: Hadamard rotation with the reference's global clip ratios (K 0.96, V 0.92).
- `oscar[...]`: per-(layer, KV head) rotations and clip ratios from an artifact; with means (contract v2),
  a centered cache: `x_hat = fq(x - mu) + mu`. That is exactly what the runtime computes by adding `q . mu_k`
  to the history logits and `(sum of history probabilities) mu_v` to the history output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime_kernels.artifact import OscarArtifact
from runtime_kernels.format import BF16_BITS, CODE_BITS, DEFAULT_FORMAT, KVFormat
from runtime_kernels.quant import naive

KIVI_SCALE_BITS = 16  # KIVI stores each group's scale and zero in 16 bits each (fp16)
# KIVI-2 is a fixed peer baseline, not a format of this project: fp16 scales and zeros, plain min-max rounding (its
# windows and pages are not read; its groups are set per call).
KIVI_FORMAT = DEFAULT_FORMAT.with_(scale_format="float16", quantizer="uniform_minmax", centered=False)


def hadamard(d: int) -> torch.Tensor:
    """Normalised Sylvester Hadamard `[d, d]` float64 (`H[a, b] = (-1)^popcount(a & b) / sqrt(d)`)."""
    from oscar_calib.calibration.solve import hadamard as _hadamard

    return _hadamard(d)


def _to_rows(x: torch.Tensor) -> torch.Tensor:
    """`[B, H, T, d]` -> `[B*T, H, d]` (the `[T, H_kv, d]` layout of the naive quantizer)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b * t, h, d)


def _from_rows(x: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """Inverse of `_to_rows`: `[B*T, H, d]` -> `[B, H, T, d]`."""
    return x.reshape(b, t, x.shape[1], x.shape[2]).transpose(1, 2)


@dataclass
class KVMethod:
    """Base class: a named way of storing the KV history. `bf16` itself is this class."""

    name: str = "bf16"
    description: str = "BF16 KV cache (reference)"

    def quantizes(self, layer_idx: int) -> bool:
        """Whether this method stores layer `layer_idx`'s history quantized."""
        return False

    def history_bits(self, head_dim: int) -> float:
        """Bits per K/V element (mean of keys and values) inside the quantized history."""
        return float(BF16_BITS)

    def effective_bits(self, context_len: int, head_dim: int, windows: KVFormat) -> float:
        """Bits per KV element over a whole context of `context_len` tokens, with the BF16 sink and recent windows
        of `windows` (the evaluation's format) and this method's history."""
        return windows.bits_with_history(context_len, self.history_bits(head_dim))

    def fake_quantize(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
                      windows: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize-dequantize every position of `keys, values [B, H_kv, T, d]`; returns fp32 tensors.

        Which positions a query actually reads quantized is decided by the caller (the mixed mask of `windows`).
        """
        return keys.float(), values.float()


@dataclass
class RowwiseInt2(KVMethod):
    """Per-token INT2 after an optional rotation `x @ R` and per-row clipping (naive / QuaRot / Hadamard-clip).

    `k_rotation, v_rotation`: `[d, d]` shared, or None for no rotation. Clip ratios are scalars (1 = none).
    `fmt` (required): how the history is encoded, i.e. its group size, scale format and quantizer (its windows are
    not used: the evaluation's are).
    """

    k_rotation: torch.Tensor | None = None
    v_rotation: torch.Tensor | None = None
    k_clip: float = 1.0
    v_clip: float = 1.0
    fmt: KVFormat | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.fmt, KVFormat):
            raise TypeError(f"{type(self).__name__} '{self.name}': fmt: expected the KVFormat the history is encoded "
                            f"in, got {type(self.fmt).__name__}")

    def quantizes(self, layer_idx: int) -> bool:
        return True

    def history_bits(self, head_dim: int) -> float:
        return self.fmt.history_bits(head_dim)

    def _one(self, x: torch.Tensor, rotation: torch.Tensor | None, clip: float) -> torch.Tensor:
        ratio = None if clip >= 1.0 else clip
        return centered_fake_quantize(x, rotation, ratio, None, self.fmt)

    def fake_quantize(self, layer_idx, keys, values, windows):
        return self._one(keys, self.k_rotation, self.k_clip), self._one(values, self.v_rotation, self.v_clip)


@dataclass
class LayerTables:
    """One layer's quantizer tables: rotations `[H_kv, d, d]`, clip ratios `[H_kv]`, means `[H_kv, d]` or None."""

    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_clip: torch.Tensor
    v_clip: torch.Tensor
    k_mean: torch.Tensor | None = None
    v_mean: torch.Tensor | None = None

    def to(self, device) -> LayerTables:
        f = lambda t: None if t is None else t.to(device, torch.float32)  # noqa: E731
        return LayerTables(*(f(t) for t in (self.k_rotation, self.v_rotation, self.k_clip, self.v_clip,
                                             self.k_mean, self.v_mean)))


@dataclass
class TableInt2(RowwiseInt2):
    """Per-(layer, KV head) rotations, clip ratios and optional means (`tables`: decoder layer -> LayerTables).

    Layers without tables stay BF16 (as sliding-window layers do in the runtime).
    """

    tables: dict[int, LayerTables] = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, repr=False)

    def quantizes(self, layer_idx: int) -> bool:
        return layer_idx in self.tables

    def fake_quantize(self, layer_idx, keys, values, windows):
        if layer_idx not in self.tables:
            return keys.float(), values.float()
        key = (layer_idx, keys.device)
        if key not in self._cache:
            self._cache[key] = self.tables[layer_idx].to(keys.device)
        t = self._cache[key]
        return (centered_fake_quantize(keys, t.k_rotation, _clip_or_none(t.k_clip), t.k_mean, self.fmt),
                centered_fake_quantize(values, t.v_rotation, _clip_or_none(t.v_clip), t.v_mean, self.fmt))


def artifact_tables(artifact: OscarArtifact, centered: bool = True) -> dict[int, LayerTables]:
    """Decoder layer -> LayerTables of an artifact; means (contract v2, model basis) when `centered`."""
    def mean(kind: str) -> torch.Tensor | None:
        m = artifact.key_mean("original") if kind == "k" else artifact.value_mean("original")
        return m if centered and bool(m.any()) else None  # all zeros: the uncentered path, bit for bit

    k_mean, v_mean = mean("k"), mean("v")
    out = {}
    for a, layer in enumerate(artifact.layer_ids.tolist()):
        out[int(layer)] = LayerTables(
            artifact.k_rotation[a], artifact.v_rotation[a], artifact.k_clip_ratio[a], artifact.v_clip_ratio[a],
            None if k_mean is None else k_mean[a], None if v_mean is None else v_mean[a])
    return out


class ArtifactInt2(TableInt2):
    """OSCAR: per-(layer, KV head) rotations, clip ratios (and means, when the artifact has them), encoded in the
    artifact's own KV format (`artifact.kv_format`: group, scale format, quantizer)."""

    def __init__(self, name: str = "oscar", description: str = "OSCAR artifact", *, artifact: OscarArtifact,
                 centered: bool = True):
        super().__init__(name, description, fmt=artifact.kv_format, tables=artifact_tables(artifact, centered))
        self.artifact = artifact


def centered_fake_quantize(x: torch.Tensor, rotation: torch.Tensor | None, clip, mean: torch.Tensor | None,
                           fmt: KVFormat) -> torch.Tensor:
    """`fq(x - mean) + mean` of `x [B, H_kv, T, d]` (fp32), fq = rotate, clip, INT2 as `fmt` encodes it (group,
    scale format, quantizer), de-rotate.

    `rotation` `[H_kv, d, d]` / `[d, d]` / None; `clip` `[H_kv]`, a scalar or None; `mean` `[H_kv, d]` or None
    (model basis; the rotated mean is `mean @ R`, the same centering in the rotated basis).
    """
    b, _, t, _ = x.shape
    xf = x.float()
    if mean is not None:
        xf = xf - mean.to(xf.device, torch.float32)[None, :, None, :]
    rot = None if rotation is None else rotation.to(x.device, torch.float32)
    out = _from_rows(naive.fake_quantize(_to_rows(xf), rot, clip, fmt), b, t)
    if mean is not None:
        out = out + mean.to(out.device, torch.float32)[None, :, None, :]
    return out


def _clip_or_none(ratio: torch.Tensor) -> torch.Tensor | None:
    """Skip clipping entirely when every head's ratio is 1 (the order statistic would be the max anyway)."""
    return None if bool((ratio >= 1.0).all()) else ratio


@dataclass
class Kivi2(KVMethod):
    """KIVI-2: keys per channel over blocks of `token_group` tokens, values per token (`value_group` channels).

    Blocks start at position `sink` (the sink is never quantized), so with the BF16 recent window the
    quantized history is made of whole blocks, as in KIVI where a block is quantized once it is full.
    A trailing partial block (only ever inside the recent window) is quantized over the tokens it has.
    """

    token_group: int = 32
    value_group: int | None = None

    def quantizes(self, layer_idx: int) -> bool:
        return True

    def history_bits(self, head_dim: int) -> float:
        key_bits = CODE_BITS + 2 * KIVI_SCALE_BITS / self.token_group
        value_bits = CODE_BITS + 2 * KIVI_SCALE_BITS / (self.value_group or head_dim)
        return (key_bits + value_bits) / 2

    def fake_quantize(self, layer_idx, keys, values, windows):
        b, h, t, d = values.shape
        v_hat = _from_rows(naive.fake_quantize(_to_rows(values.float()), None, None,
                                               KIVI_FORMAT.with_(group_size=self.value_group)), b, t)
        return kivi_keys(keys, self.token_group, windows.sink_tokens), v_hat


def kivi_keys(keys: torch.Tensor, token_group: int, start: int = 0) -> torch.Tensor:
    """Per-channel INT2 of `keys [B, H, T, d]` over token blocks `[start + i*G, start + (i+1)*G)`.

    Positions before `start` are returned unchanged (fp32). Uses the runtime quantizer with the token
    axis as the group axis: each (channel, block) gets its own min-max scale and zero.
    """
    k = keys.float()
    out = k.clone()
    t = k.shape[2]
    pos = start
    while pos < t:
        n = min(token_group, t - pos)
        block = k[:, :, pos:pos + n].transpose(-1, -2)  # [B, H, d, n]: channels as rows, tokens as the group
        codes, scale, zero = naive.quantize_groups(block.unsqueeze(-2), KIVI_FORMAT)  # one group of n tokens
        out[:, :, pos:pos + n] = naive.dequantize(codes.squeeze(-2), scale, zero, KIVI_FORMAT).transpose(-1, -2)
        pos += n
    return out


def standard_methods(head_dim: int, windows: KVFormat, artifacts: dict[str, OscarArtifact] | None = None
                     ) -> list[KVMethod]:
    """The methods of the comparison table, in display order (BF16 first, then by family).

    The per-token baselines are min-max INT2 with one group per row (the reference's), storing their scales in the
    artifacts' format when every artifact has the same one (so a ue5m3 artifact is compared at equal bits), in fp16
    otherwise; `windows` is the evaluation's format, whose windows the baselines' format keeps (they do not use them).
    """
    had = hadamard(head_dim).float()
    formats = {a.kv_format.scale_format for a in (artifacts or {}).values()}
    baseline = KVFormat(sink_tokens=windows.sink_tokens, recent_tokens=windows.recent_tokens,
                        page_size=windows.page_size, group_size=None,
                        scale_format=formats.pop() if len(formats) == 1 else "float16", quantizer="uniform_minmax",
                        centered=False)
    methods: list[KVMethod] = [
        KVMethod(),
        RowwiseInt2("int2", "per-token min-max INT2 (group = head_dim), no rotation", fmt=baseline),
        Kivi2("kivi2-g128", "KIVI-2: keys per channel over 128-token blocks, values per token", token_group=128),
        Kivi2("kivi2-g32", "KIVI-2: keys per channel over 32-token blocks, values per token", token_group=32),
        RowwiseInt2("quarot-int2", "Hadamard rotation, no clipping (QuaRot-style)", k_rotation=had, v_rotation=had,
                    fmt=baseline),
        RowwiseInt2("hadamard-clip", "Hadamard rotation, global clip ratios K 0.96 / V 0.92",
                    k_rotation=had, v_rotation=had, k_clip=0.96, v_clip=0.92, fmt=baseline),
    ]
    for name, art in (artifacts or {}).items():
        gran = art.metadata.get("granularity", "?")
        methods.append(ArtifactInt2(name, f"OSCAR artifact ({gran} rotations, fitted clips)", artifact=art))
    return methods


__all__ = [
    "ArtifactInt2",
    "LayerTables",
    "TableInt2",
    "artifact_tables",
    "centered_fake_quantize",
    "KVMethod",
    "Kivi2",
    "RowwiseInt2",
    "hadamard",
    "kivi_keys",
    "standard_methods",
]
