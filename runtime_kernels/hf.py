"""transformers integration: a 2-bit OSCAR KV cache for `model.generate` and an "oscar" attention function.

Usage::

    model = enable_oscar_attention(model)          # registers "oscar" and switches the model to it
    cache = OscarCache.from_pretrained("Qwen/Qwen3-8B", model.config, repo="my-org/oscar-zoo", revision="v1")
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)   # transformers 5.17: past_key_values=cache

Sizing: nothing is sized by hand. The sequence slots are taken from the first prompt's batch (so
`num_return_sequences` and beams, which `generate` expands before the prompt runs, just work) and the INT2
page pool grows (doubling) when a step needs more pages than it has; `max_tokens` is only an initial size.
A step whose pages cannot be allocated raises before anything of that step is written, so the cache
stays consistent.

Not supported, by design: `crop` (assisted / speculative decoding, rollback). Demoted tokens are quantized
and cannot be un-demoted; every layer reports `is_croppable = False`, which transformers >= 5.2x checks
right after the prompt's forward pass (ValueError "Assisted decoding requires a cache that can be
cropped"); on 5.17 the first `crop` raises NotImplementedError naming the reason.

How a step runs (per calibrated layer):
- prefill (`q_len > 1`, or the first token of an empty cache): the layer returns the prompt's keys/values
  (after the history already cached, dequantized, for a chunked prefill); attention runs at full precision
  with SDPA and the causal/padding mask; then the prompt's valid tokens (the padding mask tells which) are
  written into the paged cache as sink | INT2 history | recent.
- decode (`q_len == 1`): the layer appends the new token to the paged cache (demoting a page when the
  recent window is full), and the attention function runs `PagedKVCache.decode_attention`: window
  attention over sink + recent, INT2 attention over the history with `q @ R_K`, exact log-sum-exp merge,
  and the history part mapped back by `R_V^T`.
Layers the artifact does not calibrate (not in `layer_ids`) keep transformers' own BF16 cache layer.

The layer state of a step reaches the attention function through an attribute on the key tensor the
cache returns (`_oscar_layer`), so any other attention path (no cache, a DynamicCache) runs plain SDPA.
Tested against transformers 5.17 and 5.24 (`Cache(layers=...)`, `CacheLayerMixin`, `AttentionInterface`
and `AttentionMaskInterface` are the same in both).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from runtime_kernels._validate import normalize_device
from runtime_kernels.artifact import OscarArtifact, check_against_model, read_artifact
from runtime_kernels.cache import FLOAT_DTYPES, PagedKVCache
from runtime_kernels.format import KVFormat
from runtime_kernels.memory_budget import check_cache_fits
from runtime_kernels.serving import check_served_format

ATTENTION_NAME = "oscar"
_TAG = "_oscar_layer"
_NO_CROP = ("OscarCache cannot crop, so assisted / speculative decoding and rollback are not supported: tokens "
            "demoted to the INT2 history are quantized and cannot be un-demoted; generate without assistant_model "
            "or prompt_lookup_num_tokens")


# ----------------------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------------------
class OscarLayer(CacheLayerMixin):
    """Cache layer of one calibrated decoder layer: a view onto the shared `PagedKVCache`.

    It stores nothing itself; `keys`/`values` stay None. `columns` counts the token columns the model has
    fed this layer (padding included), which is what transformers expects from `get_seq_length`.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: OscarCache, layer_idx: int, local_idx: int):
        super().__init__()
        self.owner, self.layer_idx, self.local_idx = owner, layer_idx, local_idx
        self.columns = 0
        self.mode: str | None = None  # "prefill" or "decode" for the step in flight
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # prompt K/V awaiting the mask

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.columns, self.mode, self.pending = 0, None, None

    def offload(self):  # the pools stay on their device
        pass

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(_NO_CROP)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # handled once by OscarCache
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:  # handled once by OscarCache
        pass

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # handled once by OscarCache
        pass


class OscarCache(Cache):
    """A transformers `Cache` keeping calibrated layers in the three-segment paged INT2 layout.

    Build it with `from_artifact`. One cache serves one `generate` call (or one manual decoding loop) over
    a batch of `batch_size` rows; batch row b is paged sequence `seq_ids[b]`.
    """

    def __init__(self, artifact: OscarArtifact, model_config, *, batch_size: int | None = None,
                 max_tokens: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 backend: str = "auto", fmt: KVFormat | None = None, clip: bool = True, max_seqs: int | None = None,
                 allow_other_model: bool = False, model_id: str | None = None):
        if not isinstance(artifact, OscarArtifact):
            raise TypeError(f"artifact: expected an OscarArtifact (or a path to one), got {type(artifact).__name__}")
        artifact.ensure_valid()  # a loaded artifact was validated by its loader: not again
        # The one identity check of a load (`from_pretrained` leaves it to this constructor).
        check_against_model(artifact, model_config, model_id=model_id, allow_other_model=allow_other_model)
        cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"batch_size: expected a positive integer or None (= the first prompt's), got {batch_size}")
        if max_tokens is not None and int(max_tokens) < 1:
            raise ValueError(f"max_tokens: expected a positive integer or None (= grow as needed), got {max_tokens}")
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
        self.artifact = artifact
        self.batch_rows = int(batch_size or 1)
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self.device = normalize_device(device) if device is not None else None
        self.dtype = dtype
        # The format is settled here, once (the artifact's, or `fmt` where serving may differ: checked now, by name);
        # the pools are built from it at the first update.
        self.fmt = check_served_format(artifact, fmt)
        self.backend, self.clip = backend, clip
        self.max_seqs = int(max_seqs) if max_seqs is not None else (int(batch_size) if batch_size else None)
        # The pools are allocated at the first update; windows the device cannot hold are refused now, with the
        # size they would need (the model's device is not known yet without `device`: the host's memory is used).
        # The pools are checked again at allocation only where this check does not cover them (another device,
        # more slots or pages: `CheckedFit.covers`).
        slots = self.max_seqs or self.batch_rows
        self._fit = check_cache_fits(self.device or torch.device("cpu"), self.fmt,
                                     num_layers=int(artifact.layer_ids.numel()), num_kv_heads=artifact.num_kv_heads,
                                     head_dim=artifact.head_dim, max_pages=self._initial_pages(slots, max_tokens),
                                     max_seqs=slots, window_dtype=dtype or _config_dtype(cfg))
        self.paged: PagedKVCache | None = None  # allocated at the first update (device/dtype of the model)
        self.seq_ids: list[int] | None = None
        self._plan = None
        self._snapshots: list[tuple[int, list[int]]] = []
        self._warned_context = False

        fallback = DynamicCache(config=cfg).layers  # transformers' own layer types for uncalibrated layers
        n_layers = int(cfg.num_hidden_layers)
        local = {int(g): i for i, g in enumerate(artifact.layer_ids.tolist())}
        layers = []
        for idx in range(n_layers):
            base = fallback[idx] if idx < len(fallback) else DynamicLayer()
            if idx in local:
                if type(base) is not DynamicLayer:
                    raise ValueError(f"artifact: field 'layer_ids' names layer {idx}, a "
                                     f"{type(base).__name__} (only full-attention layers can use the INT2 cache)")
                layers.append(OscarLayer(self, idx, local[idx]))
            else:
                layers.append(base)
        self._first_oscar = min(local)
        super().__init__(layers=layers)

    @classmethod
    def from_pretrained(cls, model_id_or_path: str | os.PathLike, model_config, *, repo: str | None = None,
                        revision: str | None = None, calibration: str = "default",
                        expected_sha256: dict[str, str] | None = None, token: str | None = None,
                        cache_dir: str | os.PathLike | None = None, endpoint: str | None = None,
                        repo_type: str = "model", commit: str | None = None, model_id: str | None = None,
                        allow_other_model: bool = False, **cache_kwargs) -> OscarCache:
        """One call from the Hub (or a local artifact) to a cache, through `runtime_kernels.load_artifact`.

        With `repo`, `model_id_or_path` is the model id and `revision` the release (a version tag or commit
        sha): the release is downloaded through the Hub cache, every sha256 verified, and the artifact checked
        against `model_config` (heads, head_dim, layers, model id). Without `repo` it is a local artifact
        directory or file. `repo_type` is the kind of Hub repo `repo` is ("model" or "dataset"). `commit` and
        `expected_sha256` are the pins zoo_manifest.yaml records for the release: anything else is refused.
        `cache_kwargs` go to the constructor (device, dtype, backend, ...).
        """
        from runtime_kernels.loader import load_artifact

        if repo is not None and revision is None and commit is None:
            raise ValueError("revision: required with repo= (a version tag such as 'v1', or a commit sha) so the "
                             "release is pinned")
        if model_id is None and repo is not None:
            model_id = str(model_id_or_path)  # the Hub id the release was asked for is the model's identity
        # The artifact comes back validated and is checked against the model once, by the constructor.
        artifact = load_artifact(model_id_or_path, repo=repo, revision=revision,
                                 expected_sha256=expected_sha256, token=token, cache_dir=cache_dir,
                                 calibration=calibration, endpoint=endpoint, repo_type=repo_type, commit=commit)
        return cls(artifact, model_config, model_id=model_id, allow_other_model=allow_other_model, **cache_kwargs)

    @classmethod
    def from_artifact(cls, artifact: OscarArtifact | str | os.PathLike, model_config, *,
                      batch_size: int | None = None, max_tokens: int | None = None,
                      device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None, backend: str = "auto", fmt: KVFormat | None = None,
                      clip: bool = True, max_seqs: int | None = None, allow_other_model: bool = False,
                      model_id: str | None = None) -> OscarCache:
        """Build a cache for `model_config` from an artifact (object or path); refuses a mismatched artifact.

        Args:
            batch_size: rows of the batch the cache serves (default: the first prompt's batch).
            max_tokens: initial INT2 page pool per row (prompt + generated); the pool grows past it when needed.
            device, dtype: where the pools live and the window dtype (default: those of the first keys seen).
            backend: kernel backend ("auto" = Triton on CUDA, torch on CPU).
            fmt: the KV format to serve in (default: the artifact's `kv_format`); it may differ from the artifact's
                in its page size only (and in its windows for an identity artifact, which fitted nothing).
            clip: False turns clipping off (for exactness checks).
            max_seqs: window slots (default: batch_size, or the first prompt's batch).
            allow_other_model: use an artifact whose model_id names another model (shapes must still match).
            model_id: the Hub id of the model when it was loaded from a local copy (the artifact must name it;
                default: `model_config._name_or_path`).
        """
        if isinstance(artifact, (str, os.PathLike, Path)):
            artifact = read_artifact(artifact)
        return cls(artifact, model_config, batch_size=batch_size, max_tokens=max_tokens, device=device,
                   dtype=dtype, backend=backend, fmt=fmt, clip=clip, max_seqs=max_seqs,
                   allow_other_model=allow_other_model, model_id=model_id)

    # -- internals ------------------------------------------------------------------------------------------
    def _initial_pages(self, slots: int, tokens: int | None) -> int:
        """INT2 pages allocated first: enough for `tokens` per slot (at least one page)."""
        fmt = self.fmt
        pages_per_seq = -(-max(0, (tokens or 0) - fmt.window_tokens) // fmt.page_size)
        return max(1, pages_per_seq * slots)

    def _ensure_paged(self, key_states: torch.Tensor) -> PagedKVCache:
        """Allocate the pools at the first update: slots for this batch, pages for `max_tokens` (or the prompt)."""
        if self.paged is None:
            slots = self.max_seqs or key_states.shape[0]  # an explicit size is kept (and enforced)
            self.paged = PagedKVCache.from_artifact(
                self.artifact, max_pages=self._initial_pages(slots, self.max_tokens or key_states.shape[2]),
                max_seqs=slots, fmt=self.fmt,
                device=self.device or key_states.device, dtype=self.dtype or key_states.dtype,
                clip=self.clip, backend=self.backend, fit=self._fit)
        return self.paged

    def _check_states(self, layer: OscarLayer, name: str, x: torch.Tensor) -> None:
        art = self.artifact
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} (layer {layer.layer_idx}): expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} (layer {layer.layer_idx}): dtype must be float16, bfloat16 or float32, "
                            f"got {x.dtype}")
        if x.dim() != 4 or x.shape[1] != art.num_kv_heads or x.shape[3] != art.head_dim:
            raise ValueError(f"{name} (layer {layer.layer_idx}): expected shape [batch, kv_heads={art.num_kv_heads}, "
                             f"tokens, head_dim={art.head_dim}], got {list(x.shape)}")
        slots = self.paged.max_seqs if self.paged is not None else self.max_seqs
        if self.seq_ids is None and slots is not None and x.shape[0] > slots:
            raise ValueError(f"{name} (layer {layer.layer_idx}): batch size {x.shape[0]} exceeds the cache's "
                             f"{slots} sequence slots (raise batch_size or max_seqs, or leave both unset to size from the prompt)")
        if self.seq_ids is not None and x.shape[0] != self.batch_rows:
            raise ValueError(f"{name} (layer {layer.layer_idx}): batch size {x.shape[0]} does not match the "
                             f"{self.batch_rows} rows already in the cache")
        if self.paged is not None and x.device != self.paged.device:
            raise ValueError(f"{name} (layer {layer.layer_idx}): expected device {self.paged.device} (the "
                             f"cache's), got {x.device}")

    def _update(self, layer: OscarLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        """CacheLayer.update of a calibrated layer. key/value_states: `[B, H, T, d]` (post-RoPE keys)."""
        self._check_states(layer, "key_states", key_states)
        self._check_states(layer, "value_states", value_states)
        if key_states.shape != value_states.shape:
            raise ValueError(f"value_states (layer {layer.layer_idx}): shape {list(value_states.shape)} differs "
                             f"from key_states {list(key_states.shape)}")
        if layer.pending is not None:
            raise RuntimeError(
                f"layer {layer.layer_idx}: the previous prompt was never written to the OscarCache because "
                f"attention did not run through '{ATTENTION_NAME}'; call enable_oscar_attention(model) first")
        paged = self._ensure_paged(key_states)
        t = key_states.shape[2]
        if t == 1 and self.seq_ids is not None:
            # Decode: book the step once (first calibrated layer), then write this layer's new token.
            if layer.local_idx == 0:
                self._plan = self._plan_append(self.seq_ids, [1] * len(self.seq_ids))
            elif self._plan is None or self._plan.num_new != key_states.shape[0]:
                raise RuntimeError(f"layer {layer.layer_idx}: decode step started without layer "
                                   f"{self._first_oscar} (layers must run in order)")
            paged.write_layer(layer.local_idx, self._plan, key_states[:, :, 0], value_states[:, :, 0])
            layer.mode = "decode"
            keys, values = key_states, value_states
        else:
            # Prefill: attend at full precision over (cached history, dequantized) + prompt; write after.
            layer.mode = "prefill"
            layer.pending = (key_states, value_states)
            keys, values = key_states, value_states
            if self.seq_ids is not None and layer.columns:
                if layer.local_idx == 0:  # later layers read their data as it was before this step
                    self._snapshots = [paged.snapshot(s) for s in self.seq_ids]
                past_k, past_v = self._dense_past(layer, key_states.dtype)
                keys, values = torch.cat([past_k, key_states], dim=2), torch.cat([past_v, value_states], dim=2)
        layer.columns += t
        if layer.local_idx == 0:
            self._warn_past_fitted_context(layer.columns)
        setattr(keys, _TAG, layer)
        return keys, values

    def _warn_past_fitted_context(self, columns: int) -> None:
        """Warn once when the sequences grow past the context the artifact's clips were fitted for: clips fitted
        on short sequences were measured to hold worse at longer ones (docs/recipe.md)."""
        fitted = self.artifact.fitted_context
        if fitted is None or columns <= fitted or self._warned_context:
            return
        self._warned_context = True
        warnings.warn(f"{self.artifact.source}: serving {columns} tokens, past the {fitted}-token context its clips "
                      f"were fitted for (calibration.holdout_len); quality beyond it is unmeasured. Calibrate with "
                      f"`oscar-calib run --holdout-len {columns}` (or more) for this context.", stacklevel=4)

    def _plan_append(self, seq_ids: list[int], counts: list[int]):
        """`PagedKVCache.plan_append`, growing the page pool first (doubling) when the step needs more pages."""
        paged = self.paged
        need, free = paged.pages_needed(seq_ids, counts), paged.allocator.num_free
        if need > free:
            total = paged.allocator.num_pages
            try:
                paged.grow_pages(max(2 * total, total + need - free))
            except torch.OutOfMemoryError:
                raise torch.OutOfMemoryError(
                    f"OscarCache: cannot grow the INT2 page pool from {total} pages ({need} needed, {free} free) "
                    f"on {paged.device}; nothing of this step was written (free finished sequences, or use a "
                    "shorter max_new_tokens / smaller batch)") from None
        return paged.plan_append(seq_ids, counts)

    def _dense_past(self, layer: OscarLayer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached tokens of every row as `[B, H, columns, d]`, left-padded with zeros (rows are left-aligned
        to the columns they had, as with left padding), history dequantized to the original basis."""
        b, h, d = self.batch_rows, self.artifact.num_kv_heads, self.artifact.head_dim
        k = torch.zeros(b, h, layer.columns, d, dtype=dtype, device=self.paged.device)
        v = torch.zeros_like(k)
        for row, sid in enumerate(self.seq_ids):
            kr, vr = self.paged.dense_kv(layer.local_idx, sid, self._snapshots[row])  # [n, H, d]
            n = kr.shape[0]
            if n:
                k[row, :, layer.columns - n:] = kr.transpose(0, 1).to(dtype)
                v[row, :, layer.columns - n:] = vr.transpose(0, 1).to(dtype)
        return k, v

    def _commit_prefill(self, layer: OscarLayer, attention_mask: torch.Tensor | None) -> None:
        """Write the pending prompt of `layer`; the first calibrated layer books the step from the mask."""
        k, v = layer.pending
        layer.pending = None
        b, _, t, _ = k.shape
        if layer.local_idx == 0:
            valid = _valid_new_tokens(attention_mask, b, t, layer.columns, k.device)
            if self.seq_ids is None:  # the first prompt fixes the batch (generate may have expanded it)
                self.seq_ids = [self.paged.add_sequence() for _ in range(b)]
                self.batch_rows = b
            self._valid = valid
            self._plan = self._plan_append(self.seq_ids, valid.sum(dim=1).tolist())
        valid = self._valid.to(k.device)
        self.paged.write_layer(layer.local_idx, self._plan, k.transpose(1, 2)[valid], v.transpose(1, 2)[valid])

    # -- Cache API --------------------------------------------------------------------------------------------
    def reset(self):
        if self.paged is not None and self.seq_ids is not None:
            for sid in self.seq_ids:
                self.paged.free_sequence(sid)
        self.seq_ids, self._plan = None, None
        super().reset()

    def free(self) -> None:
        """Release every sequence of the batch (pages and window slots); the cache can then be reused."""
        self.reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(_NO_CROP)

    def _remap_rows(self, sources: list[int]) -> None:
        """New batch row i continues old row sources[i]; duplicated rows fork (their INT2 pages are shared)."""
        if self.seq_ids is None:
            return
        old = self.seq_ids
        used = set(sources)
        for row, sid in enumerate(old):
            if row not in used:
                self.paged.free_sequence(sid)
        taken: set[int] = set()
        new = []
        for src in sources:
            if src in taken:
                new.append(self.paged.fork_sequence(old[src]))
            else:
                taken.add(src)
                new.append(old[src])
        self.seq_ids = new
        self.batch_rows = len(new)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._remap_rows([int(i) for i in beam_idx.tolist()])
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int):
        rows = self.batch_rows if self.seq_ids is None else len(self.seq_ids)
        self._remap_rows([r for r in range(rows) for _ in range(repeats)])
        self.batch_rows = rows * repeats
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor):
        self._remap_rows([int(i) for i in indices.tolist()])
        self.batch_rows = len(indices)
        super().batch_select_indices(indices)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def oscar_layers(self) -> list[OscarLayer]:
        return [layer for layer in self.layers if isinstance(layer, OscarLayer)]


def _config_dtype(cfg) -> torch.dtype:
    """The dtype the model's keys will have, as far as its config says (`config.dtype`, set by `from_pretrained`);
    bf16 when it says nothing usable."""
    dtype = getattr(cfg, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if dtype in FLOAT_DTYPES else torch.bfloat16


def _valid_new_tokens(mask: torch.Tensor | None, batch: int, t: int, columns: int,
                      device: torch.device) -> torch.Tensor:
    """bool `[B, t]`: which of the step's t new columns are real tokens (not padding).

    The last query row of the 4D mask `[B or 1, 1, q, kv]` sees every valid key of its row; its new-token
    columns are `[columns - t, columns)`. A None mask means no padding. Float masks use 0 = visible.
    """
    if mask is None:
        return torch.ones(batch, t, dtype=torch.bool, device=device)
    if mask.dim() != 4:
        raise ValueError(f"attention_mask: expected a 4D mask [batch, 1, q, kv], got {list(mask.shape)}")
    row = mask[:, 0, -1, columns - t:columns]
    visible = row if row.dtype == torch.bool else row == 0
    return visible.expand(batch, t).clone()


# ----------------------------------------------------------------------------------------------------------
# Attention function
# ----------------------------------------------------------------------------------------------------------
def oscar_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface. query `[B, H_q, T, d]`, key/value `[B, H, T_kv, d]`.

    Returns attn_output `[B, T, H_q, d]` (and no weights), like `sdpa_attention_forward`.
    """
    layer = getattr(key, _TAG, None)
    if layer is None:  # not an OscarCache layer (uncalibrated layer, no cache, another cache): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if getattr(module, "layer_idx", layer.layer_idx) != layer.layer_idx:
        raise RuntimeError(f"oscar attention: module layer {module.layer_idx} received the cache of layer "
                           f"{layer.layer_idx}")
    cache = layer.owner
    if layer.mode == "decode":
        if query.shape[2] != 1:
            raise ValueError(f"query: expected one token per row in a decode step, got shape {list(query.shape)}")
        # generate() calls every layer eagerly, so the host time of the launch counts: one fused launch.
        o = cache.paged.decode_attention(layer.local_idx, query[:, :, 0], cache.seq_ids, sm_scale=scaling,
                                         fused=True, out_dtype=query.dtype)
        layer.mode = None
        return o.unsqueeze(1), None  # [B, 1, H_q, d]
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    **kwargs)
    cache._commit_prefill(layer, attention_mask)
    layer.mode = None
    return out, None


def register_oscar_attention() -> None:
    """Register the "oscar" attention function and its mask function (SDPA's) with transformers."""
    AttentionInterface.register(ATTENTION_NAME, oscar_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def enable_oscar_attention(model):
    """Register "oscar" and switch `model` (and its sub-models) to it. Returns the model."""
    register_oscar_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    return model


__all__ = ["ATTENTION_NAME", "OscarCache", "OscarLayer", "enable_oscar_attention", "oscar_attention_forward",
           "register_oscar_attention"]
