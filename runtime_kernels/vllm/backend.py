"""vLLM attention backend for the OSCAR INT2 cache (docs/vllm.md).

`OscarAttentionBackend` extends vLLM's CPU backend and replaces it (`register_backend(CPU_ATTN, ...)`, see
`plugin.register`). Without an `oscar` entry in vLLM's `additional_config` every method defers to the parent, so
vLLM behaves as without the plugin. With one:
- the artifact is loaded and checked against the model when the first attention layer is built (startup, before
  the KV cache is sized and before any request); a mismatch raises and vLLM does not start;
- `customize_spec` declares the packed INT2 cell (`PackedLayout.bytes_per_token_head`, 72 B at d = 128) so vLLM's
  allocator and its reported KV capacity count INT2 pages;
- layers the artifact does not calibrate are handed back to vLLM's own `CPUAttentionBackend` once the model is
  built (`OscarAttentionImpl.process_weights_after_loading`), so they keep vLLM's spec (model-dtype pages), its
  metadata builder and its kernels; vLLM then holds both page sizes in one KV cache group (one block table,
  per-layer page sizes: `UniformTypeKVCacheSpecs`) and counts both in its capacity;
- the metadata builder books each step once (`OscarEngine.plan`) and every layer's `forward` runs
  `OscarEngine.forward` (write + attention) on its vLLM layer cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionMetadataBuilder
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from runtime_kernels.artifact import OscarArtifact, model_geometry
from runtime_kernels.vllm.config import OscarServeConfig, load_checked_artifact, parse_oscar_config
from runtime_kernels.vllm.engine import OscarEngine, RequestStep, StepPlan, window_blocks_per_request
from runtime_kernels.vllm.layout import PackedLayout
from runtime_kernels.vllm.plugin import KV_CACHE_DTYPE
from runtime_kernels.vllm.report import LOGGER_NAME, past_fitted_context_line, startup_line

logger = init_logger(LOGGER_NAME)  # a child of vLLM's `vllm` logger: printed at vLLM's level (report.py says why)


class _PluginState:
    """What the process serves: the vLLM config seen last, its `oscar` entry, the artifact and the engine."""

    def __init__(self) -> None:
        self.vllm_config = None
        self.cfg: OscarServeConfig | None = None
        self.artifact: OscarArtifact | None = None
        self.engine: OscarEngine | None = None
        self.calibrated: frozenset[int] = frozenset()  # decoder layer indices with the INT2 cache

    def update(self, vllm_config) -> None:
        """(Re)load for a new vLLM config (a new `LLM` in this process): parse, load, check; raise on mismatch."""
        if vllm_config is None or vllm_config is self.vllm_config:
            return
        cfg = parse_oscar_config(getattr(vllm_config, "additional_config", None))
        cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
        if cfg is None and cache_dtype == KV_CACHE_DTYPE:
            raise ValueError(f"kv_cache_dtype '{KV_CACHE_DTYPE}' needs an artifact: pass --additional-config "
                             f"'{{\"oscar\": {{\"repo\": ..., \"revision\": ...}}}}' (or {{\"path\": ...}})")
        if cfg is not None and cache_dtype not in ("auto", KV_CACHE_DTYPE):
            raise ValueError(f"kv_cache_dtype: additional_config.oscar stores the cache in INT2; expected 'auto' or "
                             f"'{KV_CACHE_DTYPE}', got '{cache_dtype}'")
        self.vllm_config, self.cfg, self.artifact, self.engine = vllm_config, cfg, None, None
        self.calibrated = frozenset()
        if cfg is None:
            return
        model_config = vllm_config.model_config
        try:
            artifact = load_checked_artifact(cfg, model_config.hf_config, served_model=model_config.model)
        except Exception as exc:
            self.vllm_config, self.cfg = None, None  # a retry re-checks instead of serving half-configured
            # vLLM buries the cause in a long engine traceback: say it once, on one line, before raising it.
            logger.error("%s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            raise
        self.artifact = artifact
        self.calibrated = frozenset(int(i) for i in artifact.layer_ids.tolist())
        n_layers = model_geometry(model_config.hf_config)[0]
        dtype = getattr(model_config, "dtype", None) or torch.bfloat16  # for the log line only (vLLM sets it)
        dense = 2 * artifact.head_dim * torch.empty((), dtype=dtype).element_size()
        logger.info("%s", startup_line(str(artifact.source), artifact.metadata.get("model_id", "?"),
                                       sorted(self.calibrated), n_layers, self.packed.bytes_per_token_head, dense,
                                       str(dtype).replace("torch.", ""), artifact.kv_format.sink_tokens,
                                       artifact.kv_format.recent_tokens))
        fitted, served = artifact.fitted_context, getattr(model_config, "max_model_len", None)
        if fitted is not None and isinstance(served, int) and served > fitted:
            logger.warning("%s", past_fitted_context_line(str(artifact.source), fitted, served))

    @property
    def packed(self) -> PackedLayout:
        return PackedLayout(self.artifact.kv_format, self.artifact.head_dim)

    def engine_for(self, vllm_config, block_size: int, device: torch.device) -> OscarEngine:
        if self.engine is None:
            art, cfg = self.artifact, self.cfg
            fmt = art.kv_format.with_(page_size=block_size)  # vLLM's blocks are the INT2 pages
            max_seqs = int(vllm_config.scheduler_config.max_num_seqs)
            capacity = math.ceil(cfg.window_reserve * max_seqs * window_blocks_per_request(fmt))
            self.engine = OscarEngine(art, max_seqs=max_seqs, dtype=vllm_config.model_config.dtype, fmt=fmt,
                                      window_capacity=capacity, device=device, backend=cfg.kernel_backend)
            logger.info("OSCAR window store: %d blocks of %d tokens, %.1f MiB (outside vLLM's KV budget)",
                        capacity, block_size, self.engine.windows.nbytes() / 2**20)
        return self.engine


STATE = _PluginState()


def active_state(vllm_config=None) -> _PluginState | None:
    """The plugin state when the current vLLM config asks for OSCAR, else None (vLLM's own behaviour)."""
    STATE.update(vllm_config if vllm_config is not None else get_current_vllm_config_or_none())
    return STATE if STATE.cfg is not None else None


@dataclass
class OscarMetadata:
    """Per-step metadata of the OSCAR layers: the real token count and the step's plan (shared by layers)."""

    num_actual_tokens: int
    plan: StepPlan


class OscarMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder when OSCAR is off; otherwise turns vLLM's batch into `RequestStep`s and books the step."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        state = active_state(vllm_config)
        if state is None:
            self._engine = None
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            return
        plain = [n for n in layer_names if extract_layer_index(n) not in state.calibrated]
        if plain or kv_cache_spec.state_content_bytes != state.packed.bytes_per_token_head:
            # Uncalibrated layers are routed to vLLM's backend after loading; reaching here means they were not.
            raise RuntimeError(f"OSCAR metadata builder: layers {plain} are not calibrated by the artifact but got "
                               f"the INT2 spec {kv_cache_spec} (process_weights_after_loading did not run?)")
        AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        self._engine = state.engine_for(vllm_config, kv_cache_spec.block_size, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        if self._engine is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        p = self._engine.fmt.page_size
        starts = m.query_start_loc_cpu.tolist()
        seq_lens = m.seq_lens.cpu().tolist()
        table = m.block_table_tensor.cpu()
        requests = []
        for i in range(m.num_reqs):
            q_len = starts[i + 1] - starts[i]
            if q_len <= 0:
                continue
            n = int(seq_lens[i])
            requests.append(RequestStep(starts[i], q_len, n - q_len, table[i, :-(-n // p)].tolist()))
        return OscarMetadata(num_actual_tokens=m.num_actual_tokens, plan=self._engine.plan(requests))


class OscarAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention when OSCAR is off; the OSCAR engine (write + attention in `forward`) when on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        active_state()  # loads and checks the artifact at model build time (startup fails on a mismatch)
        self._oscar: dict[str, bool] = {}  # layer name -> INT2 cache (False: vLLM's own)

    def process_weights_after_loading(self, act_dtype) -> None:
        """After the whole model is built and loaded (before vLLM asks the layers for their KV spec): an
        uncalibrated layer gets vLLM's own backend class, so its spec, metadata builder and cache are vLLM's."""
        super().process_weights_after_loading(act_dtype)
        state = active_state()
        if state is None:
            return
        layer = _layer_of(self, state.vllm_config)
        if extract_layer_index(layer.layer_name) not in state.calibrated:
            layer.attn_backend = CPUAttentionBackend

    def _is_oscar(self, layer) -> bool:
        name = layer.layer_name
        if name not in self._oscar:
            self._oscar[name] = STATE.cfg is not None and extract_layer_index(name) in STATE.calibrated
        return self._oscar[name]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if not isinstance(attn_metadata, OscarMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("OSCAR attention: fused output quantization is not supported")
        t = attn_metadata.num_actual_tokens
        STATE.engine.forward(extract_layer_index(layer.layer_name), attn_metadata.plan, kv_cache, query[:t],
                             key[:t], value[:t], self.scale, output[:t])
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self._is_oscar(layer):  # written by forward, which needs the tokens before they are quantized
            return
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


def _layer_of(impl, vllm_config):
    """The vLLM `Attention` module that owns `impl` (vLLM builds the impl without telling it its layer)."""
    for module in vllm_config.compilation_config.static_forward_context.values():
        if getattr(module, "impl", None) is impl:
            return module
    raise RuntimeError("OSCAR attention: the layer of this attention impl is not in vLLM's forward context")


class OscarAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with an optional OSCAR INT2 cache (selected by `additional_config={"oscar": {...}}`)."""

    @staticmethod
    def get_impl_cls():
        return OscarAttentionImpl

    @staticmethod
    def get_builder_cls():
        return OscarMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        state = active_state()
        if state is None:
            return super().customize_spec(spec)
        return replace(spec, state_content_bytes=state.packed.bytes_per_token_head)


__all__ = ["OscarAttentionBackend", "OscarAttentionImpl", "OscarMetadata", "OscarMetadataBuilder", "STATE",
           "active_state"]
