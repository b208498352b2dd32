"""A load does each check once: one validation of the artifact, one model-identity check, one parse of its metadata
and format, one memory-fit check, from `OscarCache.from_pretrained` through the first decode steps, and for the
vLLM plugin's load path (`load_checked_artifact`, then the engine and the layout it builds).

The counted functions are wrapped wherever a `runtime_kernels` module holds them (modules import them by name), so a
call through any of those names counts.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_hf_integration import cache_kw
from transformers import AutoConfig, AutoModelForCausalLM

from runtime_kernels import contract, memory_budget
from runtime_kernels.artifact import check_against_model, identity_artifact, read_artifact, write_artifact
from runtime_kernels.format import KVFormat
from runtime_kernels.hf import OscarCache, enable_oscar_attention

FIXTURE = Path(__file__).resolve().parents[1] / "oscar_calib" / "fixtures" / "tiny-qwen3"
# Small windows and pages, so a short prompt and a few decode steps read INT2 pages.
FMT = KVFormat(sink_tokens=4, recent_tokens=8, page_size=4, group_size=None, scale_format="ue5m3",
               quantizer="uniform_minmax", centered=False)
COUNTED = {
    "validation": (contract, "validate_tensors"),
    "metadata parse": (contract, "parse_metadata"),
    "format parse": (contract, "kv_format_of"),
    "identity": (sys.modules["runtime_kernels.artifact"], "check_against_model"),
    "memory fit": (memory_budget, "check_fits"),
}


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts of the calls of each COUNTED function, through every `runtime_kernels` module that holds it."""
    counts: Counter = Counter()
    for label, (home, name) in COUNTED.items():
        original = getattr(home, name)

        def spy(*args, _original=original, _label=label, **kwargs):
            counts[_label] += 1
            return _original(*args, **kwargs)

        for module in [m for n, m in sys.modules.items() if n.startswith("runtime_kernels") and m is not None]:
            for attr, value in list(vars(module).items()):
                if value is original:  # under its own name or an alias (`validate_tensors as _validate_contract`)
                    monkeypatch.setattr(module, attr, spy)
    return counts


def _artifact_dir(tmp_path: Path, config) -> Path:
    layers, heads, kv_heads, d = (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                                  config.head_dim)
    art = identity_artifact(layers, kv_heads, heads, d, model_id=str(FIXTURE), fmt=FMT)
    write_artifact(art, tmp_path / "art")
    return tmp_path / "art"


def test_from_pretrained_and_generate_check_each_thing_once(tmp_path, calls):
    config = AutoConfig.from_pretrained(FIXTURE)
    torch.manual_seed(0)
    model = enable_oscar_attention(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    model.config._name_or_path = str(FIXTURE)
    path = _artifact_dir(tmp_path, config)
    calls.clear()
    cache = OscarCache.from_pretrained(path, model.config, backend="torch", max_tokens=64)
    prompt = torch.randint(1, config.vocab_size, (1, 20))
    model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, **cache_kw(model, cache=cache))
    assert cache.paged.hist_len(cache.seq_ids[0]) > 0  # the steps read INT2 pages: the whole path ran
    assert dict(calls) == {label: 1 for label in COUNTED}, dict(calls)


def test_a_changed_artifact_is_validated_again(tmp_path, calls):
    """The record of a passed validation is for the object as it was: an in-place edit or new metadata is checked."""
    config = AutoConfig.from_pretrained(FIXTURE)
    art = read_artifact(_artifact_dir(tmp_path, config))
    calls.clear()
    art.ensure_valid()
    assert calls["validation"] == 0
    art.k_clip_ratio[0, 0] = 0.1  # in place: below the contract's clip floor
    with pytest.raises(contract.ArtifactError, match="k_clip_ratio"):
        art.ensure_valid()
    art = read_artifact(tmp_path / "art")
    art.metadata["model_id"] = "someone/else"
    calls.clear()
    art.ensure_valid()
    assert calls["validation"] == 1
    with pytest.raises(contract.ArtifactError, match="model_id"):
        check_against_model(art, config)


def test_vllm_load_path_checks_each_thing_once(tmp_path, calls):
    pytest.importorskip("pydantic")
    from runtime_kernels.vllm.config import OscarServeConfig, load_checked_artifact
    from runtime_kernels.vllm.engine import OscarEngine
    from runtime_kernels.vllm.layout import PackedLayout

    config = AutoConfig.from_pretrained(FIXTURE)
    path = _artifact_dir(tmp_path, config)
    calls.clear()
    art = load_checked_artifact(OscarServeConfig(path=str(path), model_id=str(FIXTURE)), config)
    engine = OscarEngine(art, max_seqs=2, dtype=torch.float32, fmt=art.kv_format.with_(page_size=4),
                         window_capacity=8, backend="torch")
    for _ in range(3):  # the plugin asks for the packed layout at every spec and shape query
        PackedLayout(art.kv_format, art.head_dim)
    assert engine.fmt.page_size == 4
    assert dict(calls) == {label: 1 for label in COUNTED}, dict(calls)
