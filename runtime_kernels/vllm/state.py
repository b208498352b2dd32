"""What both vLLM backends of the plugin share: the process's plugin state, the step metadata, and vLLM's batch turned
into `RequestStep`s (docs/vllm.md). Imports vLLM's config and logger, no attention backend: the CPU backend
(`backend.py`, over vLLM's CPU_ATTN) and the CUDA backend (`cuda_backend.py`, over FLASH_ATTN) build on it.

The state is loaded once per vLLM config, in every process that builds attention layers:
- the artifact is loaded and checked against the model when the first attention layer is built (startup, before
  the KV cache is sized and before any request); a mismatch raises and vLLM does not start;
- the engine (`OscarEngine`: INT2 pages in vLLM's blocks, BF16 windows beside them) is built by the first metadata
  builder, which knows vLLM's block size and device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from runtime_kernels.artifact import OscarArtifact, model_geometry
from runtime_kernels.vllm.config import OscarServeConfig, load_checked_artifact, parse_oscar_config
from runtime_kernels.vllm.engine import (
    OscarEngine,
    RequestStep,
    StepPlan,
    decode_plan_for,
    window_blocks_per_request,
)
from runtime_kernels.vllm.layout import PackedLayout
from runtime_kernels.vllm.plugin import KV_CACHE_DTYPE
from runtime_kernels.vllm.report import LOGGER_NAME, decode_line, past_fitted_context_line, startup_line

logger = init_logger(LOGGER_NAME)  # a child of vLLM's `vllm` logger: printed at vLLM's level (report.py says why)


class PluginState:
    """What the process serves: the vLLM config seen last, its `oscar` entry, the artifact and the engine."""

    def __init__(self) -> None:
        self.vllm_config = None
        self.cfg: OscarServeConfig | None = None
        self.artifact: OscarArtifact | None = None
        self.engine: OscarEngine | None = None
        self.calibrated: frozenset[int] = frozenset()  # decoder layer indices with the INT2 cache
        self._decode_line: str | None = None  # what decode runs and why (`decode_line`), computed once

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
        self.calibrated, self._decode_line = frozenset(), None
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

    def decode_line(self, block_size: int | None = None, device=None) -> str:
        """What the INT2 layers' decode runs and why (`report.decode_line`: the kernel of an eager step and of the
        static steps CUDA graphs replay), for vLLM's block size and device (default: its cache and device configs).
        Computed once; the startup lines show it."""
        if self._decode_line is None:
            vc, art = self.vllm_config, self.artifact
            block_size = block_size or getattr(vc.cache_config, "block_size", None)
            device = torch.device(device or getattr(getattr(vc, "device_config", None), "device", None) or "cpu")
            _, h_q, h_kv, d = model_geometry(vc.model_config.hf_config)
            kw = dict(num_heads=h_q, num_kv_heads=h_kv, head_dim=d, dtype=vc.model_config.dtype, device=device,
                      backend=self.cfg.kernel_backend)
            # vLLM's blocks are the INT2 pages (as `engine_for` serves them); the artifact's own format until vLLM
            # has sized its blocks
            fmt = art.kv_format.with_(page_size=int(block_size) if block_size else None)
            eager = decode_plan_for(fmt, whole_pages=True, **kw)
            static = decode_plan_for(fmt, whole_pages=False, **kw) if device.type == "cuda" else None
            self._decode_line = decode_line(eager, static, self.cfg.kernel_backend, device.type)
        return self._decode_line

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
            logger.info("%s (INT2 layers %s)", self.decode_line(block_size, device), sorted(self.calibrated))
        return self.engine


STATE = PluginState()


def active_state(vllm_config=None) -> PluginState | None:
    """The plugin state when the current vLLM config asks for OSCAR, else None (vLLM's own behaviour)."""
    STATE.update(vllm_config if vllm_config is not None else get_current_vllm_config_or_none())
    return STATE if STATE.cfg is not None else None


@dataclass
class OscarMetadata:
    """Per-step metadata of the OSCAR layers: the token count the layers see and the step's plan (shared by
    layers). Under a CUDA graph of a padded decode batch the count includes the padding (`StaticStep`)."""

    num_actual_tokens: int
    plan: StepPlan


def request_steps(common_attn_metadata, page_size: int) -> list[RequestStep]:
    """vLLM's batch (`CommonAttentionMetadata`) as the engine's requests, in batch order; requests with no new
    token (the padding of a CUDA-graph batch) are left out. Reads the query starts, sequence lengths and block
    table on the host (one copy each)."""
    m = common_attn_metadata
    starts = m.query_start_loc_cpu.tolist()
    seq_lens = m.seq_lens.cpu().tolist()
    table = m.block_table_tensor.cpu()
    requests = []
    for i in range(m.num_reqs):
        q_len = starts[i + 1] - starts[i]
        if q_len <= 0:
            continue
        n = int(seq_lens[i])
        requests.append(RequestStep(starts[i], q_len, n - q_len, table[i, :-(-n // page_size)].tolist()))
    return requests


class OscarImplMixin:
    """What both backends' attention impls do the same way (put before vLLM's impl class in the bases): the OSCAR
    engine runs a calibrated layer when the step's metadata is OSCAR's, vLLM's impl everything else. `dense_prefill`
    is the backend's kernel for a new prompt (None: the engine's SDPA); `self._oscar` caches which layers are INT2."""

    dense_prefill = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        active_state()  # loads and checks the artifact at model build time (startup fails on a mismatch)
        self._oscar: dict[str, bool] = {}  # layer name -> INT2 cache (False: vLLM's own impl)

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
                             key[:t], value[:t], self.scale, output[:t], dense_prefill=self.dense_prefill)
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self._is_oscar(layer):  # written by forward, which needs the tokens before they are quantized
            return
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


def layer_of(impl, vllm_config):
    """The vLLM `Attention` module that owns `impl` (vLLM builds the impl without telling it its layer)."""
    for module in vllm_config.compilation_config.static_forward_context.values():
        if getattr(module, "impl", None) is impl:
            return module
    raise RuntimeError("OSCAR attention: the layer of this attention impl is not in vLLM's forward context")


__all__ = ["STATE", "OscarImplMixin", "OscarMetadata", "PluginState", "active_state", "layer_of", "request_steps"]
