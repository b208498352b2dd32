"""The plugin's startup line (what runs in INT2, where, and the capacity gained) and that it reaches vLLM's handler.

No vLLM here: vLLM's logging setup is one `vllm` logger with a handler and `propagate=False`, reproduced below; the
plugin's logger must be a child of it, or its INFO lines go to the handler-less root logger and are never printed.
"""

from __future__ import annotations

import io
import logging

import torch
from format_helpers import PAPER

from runtime_kernels.format import DEFAULT_FORMAT
from runtime_kernels.vllm.layout import PackedLayout
from runtime_kernels.vllm.report import LOGGER_NAME, capacity_gain, past_fitted_context_line, startup_line


def test_capacity_gain_matches_the_byte_count():
    # every layer INT2: the cell ratio (68 B ue5m3 cells vs 512 B of BF16 K + V at d = 128)
    packed = PackedLayout(DEFAULT_FORMAT, 128).bytes_per_token_head
    dense = PackedLayout.bf16_bytes_per_token_head(128)
    assert (packed, dense) == (68, 512)
    assert abs(capacity_gain(4, 4, packed, dense) - 512 / 68) < 1e-12
    # two of four layers: 4 * 512 / (2 * 68 + 2 * 512)
    assert abs(capacity_gain(4, 2, packed, dense) - 2048 / 1160) < 1e-12
    assert capacity_gain(4, 0, packed, dense) == 1.0


def test_startup_line_names_layers_windows_and_gain():
    line = startup_line("zoo/demo/oscar_kv.safetensors", "oscar-calib/tiny-qwen3", [1, 3], 4, 68, 512, "bfloat16",
                        128, 1024)
    assert "\n" not in line
    for part in ("layers [1, 3] of 4", "layers [0, 2] keep vLLM's bfloat16 cache", "oscar-calib/tiny-qwen3",
                 "68 B per token and KV head instead of 512", "sink 128 + recent 1024", "1.77x"):
        assert part in line, part


def test_past_fitted_context_line_names_both_lengths_and_both_remedies():
    line = past_fitted_context_line("zoo/demo/oscar_kv.safetensors", 4096, 32768)
    assert "\n" not in line
    for part in ("max_model_len 32768 is past the 4096-token context", "--holdout-len 32768", "--max-model-len 4096"):
        assert part in line, part


def test_plugin_logger_is_printed_by_vllms_handler():
    stream = io.StringIO()
    vllm_logger = logging.getLogger("vllm")
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.INFO)
    old = (vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate)
    vllm_logger.handlers, vllm_logger.propagate = [handler], False
    vllm_logger.setLevel(logging.DEBUG)
    try:
        logging.getLogger(LOGGER_NAME).info("OSCAR INT2 KV cache on: test")
    finally:
        vllm_logger.handlers, vllm_logger.level, vllm_logger.propagate = old
    assert "OSCAR INT2 KV cache on: test" in stream.getvalue()


def test_vllm_refusal_names_the_config_keys(tmp_path):
    """Through the plugin's loader (no vLLM needed): a local copy of the model is refused with advice in
    `additional_config.oscar` words, accepted with `model_id` or `allow_other_model`; the exception keeps its type."""
    import pytest
    from transformers import AutoConfig, Qwen3Config

    from runtime_kernels.artifact import ModelMismatchError, identity_artifact, write_artifact
    from runtime_kernels.vllm.config import OscarServeConfig, load_checked_artifact

    Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                hidden_size=128).save_pretrained(tmp_path / "model")
    config = AutoConfig.from_pretrained(tmp_path / "model")
    write_artifact(identity_artifact(2, 2, 4, 32, model_id="org/model", fmt=PAPER), tmp_path / "art")
    path = str(tmp_path / "art")
    with pytest.raises(ModelMismatchError) as info:
        load_checked_artifact(OscarServeConfig(path=path), config)
    text = str(info.value)
    assert text.startswith("OSCAR: additional_config.oscar.path: ") and "\n" not in text
    assert '"model_id": "org/model" in additional_config.oscar' in text
    assert '"allow_other_model": true in additional_config.oscar' in text and "--allow-other-model" not in text
    assert load_checked_artifact(OscarServeConfig(path=path, model_id="org/model"), config).num_layers == 2
    assert load_checked_artifact(OscarServeConfig(path=path, allow_other_model=True), config).num_layers == 2
    with pytest.raises(Exception, match=r"additional_config\.oscar\.path: .*no such file or directory"):
        load_checked_artifact(OscarServeConfig(path=str(tmp_path / "missing")), config)


def test_decode_line_names_the_kernel_and_why_for_eager_and_graph_steps():
    """The startup line of the INT2 layers' decode (`PluginState.decode_line`): the plan of an eager step (whole
    pages) and of the static steps CUDA graphs replay (no whole-pages promise: masked tiles), from the format alone."""
    from runtime_kernels.vllm.engine import decode_plan_for
    from runtime_kernels.vllm.report import decode_line

    kw = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cpu", backend="triton")
    eager = decode_plan_for(DEFAULT_FORMAT, whole_pages=True, **kw)
    static = decode_plan_for(DEFAULT_FORMAT, whole_pages=False, **kw)
    assert (eager.kernel, eager.whole_pages, eager.scale_layout, eager.scale_format, eager.centered) == \
        ("grid", True, "quad", "ue5m3", True)
    line = decode_line(eager, static, "triton", "cuda")
    assert line.startswith("OSCAR decode: Triton grid kernel, 2 launch(es), whole-page tiles, int8 scores, quad ")
    assert "; CUDA-graph decode steps: grid kernel, 2 launch(es), masked tiles" in line
    assert "slower choices because: whole_pages not promised: masked tiles" in line
    assert decode_plan_for(DEFAULT_FORMAT, whole_pages=True, **{**kw, "backend": "torch"}) is None
    assert decode_line(None, None, "auto", "cpu") == ("OSCAR decode: torch reference kernels (kernel_backend 'auto' "
                                                      "on cpu; the Triton kernels run on CUDA)")
