"""The INT2 KV spec of the CUDA backend (`runtime_kernels.vllm.spec`) against vLLM's own sizing and grouping.
Skipped where vLLM is not importable; run against vLLM 0.26's package with `PYTHONPATH=<vllm 0.26 site>`."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pickle
from dataclasses import replace

import pytest
import torch

# not `vllm`: tests/vllm/ is a namespace package of that name
pytest.importorskip("vllm.v1.kv_cache_interface", reason="vLLM is not installed")
VERSION = importlib.metadata.version("vllm") if importlib.util.find_spec("vllm.version") else "?"
if not VERSION.startswith("0.26."):  # the spec is the CUDA backend's, for the release without customize_spec
    pytest.skip(f"vLLM {VERSION}: the INT2 spec route is vLLM 0.26's", allow_module_level=True)

from vllm.v1.core.kv_cache_utils import is_kv_cache_spec_uniform  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs  # noqa: E402

from runtime_kernels.format import KVFormat  # noqa: E402
from runtime_kernels.vllm.layout import PackedLayout  # noqa: E402
from runtime_kernels.vllm.spec import OscarAttentionSpec, int2_spec  # noqa: E402

DENSE = FullAttentionSpec(block_size=64, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)


def cell(head_dim: int, scale_format: str = "ue5m3") -> int:
    fmt = KVFormat(sink_tokens=128, recent_tokens=1024, page_size=64, group_size=None, scale_format=scale_format,
                   quantizer="uniform_minmax", centered=True)
    return PackedLayout(fmt, head_dim).bytes_per_token_head


def test_pages_count_the_packed_cell():
    spec = int2_spec(DENSE, cell(64))
    assert spec.dtype == torch.uint8 and spec.head_size == 64
    assert spec.page_size_bytes == 64 * 3 * cell(64) == 64 * 3 * 36
    assert DENSE.page_size_bytes / spec.page_size_bytes == pytest.approx(256 / 36)
    assert cell(128) == 68  # the 68 B per token and KV head at head_dim 128


def test_merge_and_replace_keep_the_cell_and_pickling_round_trips():
    spec = int2_spec(DENSE, 36)
    merged = OscarAttentionSpec.merge([spec, spec])
    assert type(merged) is OscarAttentionSpec and merged.cell_bytes == 36 and merged == spec
    assert replace(spec, indexes_kv_by_block_stride=True).cell_bytes == 36
    assert pickle.loads(pickle.dumps(spec)) == spec  # the engine-core process receives it pickled
    with pytest.raises(AssertionError, match="one cell size"):
        OscarAttentionSpec.merge([spec, int2_spec(DENSE, 68)])


def test_a_mix_with_dense_layers_is_one_group_of_per_layer_pages():
    ours = int2_spec(DENSE, 36)
    assert is_kv_cache_spec_uniform({"a": ours, "b": ours})
    assert not is_kv_cache_spec_uniform({"a": ours, "b": DENSE})  # different dtypes: no single merged spec
    mixed = UniformTypeKVCacheSpecs.from_specs({"a": ours, "b": DENSE})
    assert mixed is not None and mixed.page_size_bytes == ours.page_size_bytes + DENSE.page_size_bytes
