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

from dataclasses import replace

from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionMetadataBuilder
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from runtime_kernels.vllm.state import (
    STATE,
    OscarImplMixin,
    OscarMetadata,
    active_state,
    layer_of,
    request_steps,
)


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
        requests = request_steps(m, self._engine.fmt.page_size)
        return OscarMetadata(num_actual_tokens=m.num_actual_tokens, plan=self._engine.plan(requests))


class OscarAttentionImpl(OscarImplMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention when OSCAR is off; the OSCAR engine (write + attention in `forward`) when on."""

    def process_weights_after_loading(self, act_dtype) -> None:
        """After the whole model is built and loaded (before vLLM asks the layers for their KV spec): an
        uncalibrated layer gets vLLM's own backend class, so its spec, metadata builder and cache are vLLM's."""
        super().process_weights_after_loading(act_dtype)
        state = active_state()
        if state is None:
            return
        layer = layer_of(self, state.vllm_config)
        if extract_layer_index(layer.layer_name) not in state.calibrated:
            layer.attn_backend = CPUAttentionBackend



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
