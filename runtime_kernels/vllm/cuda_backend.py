"""vLLM CUDA attention backend for the OSCAR INT2 cache, over vLLM's FlashAttention backend (docs/vllm.md).

`OscarFlashAttentionBackend` subclasses vLLM's `FlashAttentionBackend` (FlashAttention 3 on Hopper). The plugin
registers it as `CUSTOM` and over `FLASH_ATTN` (`plugin.register`); without an `oscar` entry in vLLM's
`additional_config` every method defers to FlashAttention, so vLLM behaves as without the plugin. With one:
- layers the artifact does not calibrate are handed back to vLLM's own `FlashAttentionBackend` once the model is
  loaded (`process_weights_after_loading`): their spec, metadata builder, cache and kernels are vLLM's;
- a calibrated layer's KV spec is `spec.OscarAttentionSpec` (the packed INT2 cell per token and KV head, uint8),
  so vLLM's block count, admission and capacity report count INT2 pages; its cache is `[blocks, H, P, cell]`;
- the metadata builder books each step once: a decode-only step into the preallocated `StaticStep` buffers (what
  vLLM's full CUDA graphs of decode batches replay: `AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE`), any other
  step with `OscarEngine.plan`, run eagerly between vLLM's piecewise graphs;
- every calibrated layer's `forward` runs `OscarEngine.forward`: the new tokens written as INT2 codes and BF16
  window rows, decode attention by the project's Triton kernels (BF16 sink + recent windows, INT2 history, exact
  merge), and a new request's prompt by FlashAttention itself (`flash_attn_varlen_func`, causal, over the prompt).
"""

from __future__ import annotations

import types

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder
from vllm.v1.attention.backends import flash_attn as vllm_fa
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from runtime_kernels.vllm.engine import StaticStep
from runtime_kernels.vllm.spec import OscarAttentionSpec, int2_spec
from runtime_kernels.vllm.state import (
    OscarImplMixin,
    OscarMetadata,
    active_state,
    layer_of,
    logger,
    request_steps,
)


class OscarFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    """FlashAttention's builder when OSCAR is off; otherwise books each step of the INT2 layers (one builder for
    all of them: they form one attention group)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        state = active_state(vllm_config)
        if state is None:
            self._engine = None
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            return
        plain = [n for n in layer_names if extract_layer_index(n) not in state.calibrated]
        if plain or not isinstance(kv_cache_spec, OscarAttentionSpec):
            # Uncalibrated layers are routed to FlashAttention after loading; reaching here means they were not.
            raise RuntimeError(f"OSCAR metadata builder: layers {plain} are not calibrated by the artifact, or the "
                               f"INT2 layers got vLLM's spec {kv_cache_spec} (process_weights_after_loading did "
                               "not run?)")
        AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        self._engine = state.engine_for(vllm_config, kv_cache_spec.block_size, device)
        self.reorder_batch_threshold = 1  # decodes first: a decode-only step is then token t = request t
        self.supports_update_block_table = False  # every step is booked by `build` (the window store moves)
        comp = vllm_config.compilation_config
        max_tokens = max(int(vllm_config.scheduler_config.max_num_seqs), int(comp.max_cudagraph_capture_size or 0))
        max_pages = -(-int(vllm_config.model_config.max_model_len) // kv_cache_spec.block_size)
        eng = self._engine
        self._static = StaticStep(max_tokens, max_pages, eng.fmt, eng.num_kv_heads, eng.head_dim, eng.dtype,
                                  device)
        logger.info("OSCAR: decode steps of up to %d tokens are booked into static buffers (%d blocks per "
                    "request) that vLLM's CUDA graphs replay", max_tokens, max_pages)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if isinstance(kv_cache_spec, OscarAttentionSpec):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False if self._engine is not None else super().use_cascade_attention(*args, **kwargs)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        if self._engine is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        requests = request_steps(m, self._engine.fmt.page_size)
        decode_only = all(r.q_len == 1 and r.q_start == t for t, r in enumerate(requests))
        if decode_only and 0 < m.num_actual_tokens <= self._static.max_tokens:
            plan = self._engine.plan_static(requests, m.num_actual_tokens, self._static)
        else:
            plan = self._engine.plan(requests)
        return OscarMetadata(num_actual_tokens=m.num_actual_tokens, plan=plan)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        """The captured step: every token is padding (writes the null block and the scratch window slot), so the
        capture leaves no trace in the cache; the replayed launches read the same static buffers."""
        if self._engine is None:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        n = common_attn_metadata.num_actual_tokens
        return OscarMetadata(num_actual_tokens=n, plan=self._engine.plan_static([], n, self._static))


class OscarFlashAttentionImpl(OscarImplMixin, FlashAttentionImpl):
    """FlashAttention when OSCAR is off or the layer is not calibrated; the OSCAR engine when on."""

    def process_weights_after_loading(self, act_dtype) -> None:
        """After the model is loaded, before vLLM asks the layers for their KV spec: an uncalibrated layer gets
        vLLM's `FlashAttentionBackend`; a calibrated one reports the INT2 spec (vLLM 0.26 has no
        `customize_spec`, so the layer's own `get_kv_cache_spec` is wrapped, on this layer only)."""
        super().process_weights_after_loading(act_dtype)
        state = active_state()
        if state is None:
            return
        layer = layer_of(self, state.vllm_config)
        index = extract_layer_index(layer.layer_name)
        if index not in state.calibrated:
            layer.attn_backend = FlashAttentionBackend
            logger.info("OSCAR: layer %d (%s) -> vLLM FLASH_ATTN (not calibrated by the artifact)", index,
                        layer.layer_name)
            return
        cell = state.packed.bytes_per_token_head
        dense_spec = type(layer).get_kv_cache_spec

        def get_kv_cache_spec(module, vllm_config):
            return int2_spec(dense_spec(module, vllm_config), cell)

        layer.get_kv_cache_spec = types.MethodType(get_kv_cache_spec, layer)
        logger.info("OSCAR: layer %d (%s) -> OscarFlashAttentionBackend (INT2 history, %d B per token and KV head); "
                    "%s", index, layer.layer_name, cell, state.decode_line())

    def dense_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """A new request's prompt: causal FlashAttention over its own tokens (`[T, H_q, d]`, `[T, H, d]`), written
        into `out [T, H_q, d]`; the cache is not read (there is nothing cached before a new prompt)."""
        n = q.shape[0]
        cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        vllm_fa.flash_attn_varlen_func(q=q, k=k, v=v, out=out, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n,
                                       max_seqlen_k=n, softmax_scale=self.scale, causal=True,
                                       fa_version=self.vllm_flash_attn_version)



class OscarFlashAttentionBackend(FlashAttentionBackend):
    """FLASH_ATTN with an optional OSCAR INT2 cache (selected by `additional_config={"oscar": {...}}`)."""

    @staticmethod
    def get_impl_cls():
        return OscarFlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return OscarFlashAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """`[blocks, H, P, cell]` bytes for the INT2 layers (`layout.page_pools` views it), FlashAttention's shape
        otherwise (vLLM asks this class only for layers that kept it: the uncalibrated ones were handed back)."""
        state = active_state()
        if state is None:
            return FlashAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                                                            cache_dtype_str)
        return (num_blocks, num_kv_heads, block_size, state.packed.bytes_per_token_head)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """Identity for the INT2 layers: a block's tokens are contiguous cells per KV head, as the kernels read
        them. No cross-layer layout (vLLM then keeps one tensor per layer)."""
        if active_state() is None:
            return FlashAttentionBackend.get_kv_cache_stride_order(include_num_layers_dimension)
        if include_num_layers_dimension:
            raise NotImplementedError("OSCAR INT2 layers keep one KV tensor per layer")
        return (0, 1, 2, 3)


__all__ = ["OscarFlashAttentionBackend", "OscarFlashAttentionImpl", "OscarFlashAttentionMetadataBuilder"]
