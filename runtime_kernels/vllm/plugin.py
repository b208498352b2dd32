"""The `vllm.general_plugins` entry point: registers the OSCAR backend (and, where vLLM has it, the dtype).

vLLM calls `register()` in the engine process and in every worker, possibly more than once: it is idempotent.
What it registers (docs/vllm.md section 1):
- every release: `register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)` (an override of the member; the
  backend defers to vLLM's CPU backend unless `additional_config` has an `oscar` entry);
- where `AttentionBackendEnum.CUSTOM` exists (0.32 and 0.33): `register_backend(CUSTOM, BACKEND_PATH)` for
  `--attention-backend CUSTOM`;
- where `vllm.config.cache.register_kv_cache_dtype` exists (0.33): the dtype name `oscar_int2`.
"""

from __future__ import annotations

BACKEND_PATH = "runtime_kernels.vllm.backend.OscarAttentionBackend"
KV_CACHE_DTYPE = "oscar_int2"

_registered: dict[str, object] | None = None


def register() -> dict[str, object]:
    """Register once per process; returns what was registered (the same dict on later calls)."""
    global _registered
    if _registered is not None:
        return _registered
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    done: dict[str, object] = {}
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    done["CPU_ATTN"] = BACKEND_PATH
    if "CUSTOM" in AttentionBackendEnum.__members__:
        register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
        done["CUSTOM"] = BACKEND_PATH
    try:
        from vllm.config.cache import register_kv_cache_dtype  # vLLM >= 0.33
    except ImportError:
        register_kv_cache_dtype = None
    if register_kv_cache_dtype is not None:
        register_kv_cache_dtype(KV_CACHE_DTYPE)(_dtype_handler())
        done["kv_cache_dtype"] = KV_CACHE_DTYPE
    _registered = done
    return done


def _dtype_handler() -> type:
    """vLLM 0.33's `KVCacheDTypeHandler` for `oscar_int2`: bytes (uint8) storage, kernels owned by the backend.

    `KVQuantMode.CUSTOM` is an alias of `OCTAVE_K3V4` (same IntEnum value, so `is_octave` is True for it too);
    the plugin never dispatches on the mode, only on its own dtype name and `additional_config` (pinned in
    tests/vllm/test_registration.py)."""
    import torch
    from vllm.v1.kv_cache_interface import KVQuantMode

    class OscarInt2Dtype:
        name = KV_CACHE_DTYPE

        def torch_dtype(self) -> torch.dtype:
            return torch.uint8

        def quant_mode(self) -> KVQuantMode:
            return KVQuantMode.CUSTOM

    return OscarInt2Dtype


__all__ = ["BACKEND_PATH", "KV_CACHE_DTYPE", "register"]
