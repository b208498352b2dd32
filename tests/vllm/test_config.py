"""The `oscar` entry of vLLM's additional_config (runtime_kernels.vllm.config): no vLLM needed."""

from __future__ import annotations

import pytest
import torch
from format_helpers import PAPER

from runtime_kernels import identity_artifact, write_artifact
from runtime_kernels.artifact import ArtifactError
from runtime_kernels.vllm.config import (
    OscarServeConfig,
    load_checked_artifact,
    parse_oscar_config,
    restrict_layers,
)


def test_absent_entry_means_plugin_off():
    assert parse_oscar_config({}) is None
    assert parse_oscar_config({"other": 1}) is None
    assert parse_oscar_config(None) is None


def test_valid_entries():
    assert parse_oscar_config({"oscar": {"path": "zoo/demo"}}) == OscarServeConfig(path="zoo/demo")
    cfg = parse_oscar_config({"oscar": {"repo": "org/zoo", "revision": "v1"}})
    assert (cfg.repo, cfg.revision, cfg.calibration, cfg.kernel_backend) == ("org/zoo", "v1", "default", "auto")


@pytest.mark.parametrize("entry, message", [
    ({"path": "a", "repo": "b", "revision": "v1"}, r"additional_config\.oscar\.\(entry\).*exactly one of 'path'"),
    ({}, r"exactly one of 'path'"),
    ({"repo": "org/zoo"}, r"'revision' is required"),
    ({"path": "a", "pth": "b"}, r"additional_config\.oscar\.pth: Extra inputs are not permitted"),
    ({"path": "a", "kernel_backend": "cuda"}, r"additional_config\.oscar\.kernel_backend"),
    ({"path": "a", "window_reserve": 0.5}, r"window_reserve: Input should be greater than or equal to 1"),
    ({"path": "a", "layers": []}, r"'layers' must be a non-empty list"),
    ({"path": "a", "layers": [1, 1]}, r"'layers' must be a non-empty list of distinct"),
    ({"path": "a", "layers": ["x"]}, r"additional_config\.oscar\.layers\.0"),
])
def test_malformed_entries_name_the_field(entry, message):
    with pytest.raises(ValueError, match=message):
        parse_oscar_config({"oscar": entry})
    with pytest.raises(ValueError, match=r"additional_config\.oscar: expected a JSON object"):
        parse_oscar_config({"oscar": "zoo/demo"})


def test_artifact_checked_against_the_model(tmp_path):
    from transformers import Qwen3Config

    model = Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        hidden_size=128)
    write_artifact(identity_artifact(2, 2, 4, 32, fmt=PAPER), tmp_path / "good")
    art = load_checked_artifact(OscarServeConfig(path=str(tmp_path / "good")), model)
    assert art.num_kv_heads == 2 and torch.equal(art.layer_ids, torch.tensor([0, 1]))
    write_artifact(identity_artifact(2, 2, 4, 64, fmt=PAPER), tmp_path / "bad")
    with pytest.raises(ArtifactError, match="field 'head_dim': artifact has 64, the model has 32"):
        load_checked_artifact(OscarServeConfig(path=str(tmp_path / "bad")), model)
    with pytest.raises(Exception, match="no such file or directory"):
        load_checked_artifact(OscarServeConfig(path=str(tmp_path / "missing")), model)


def test_layers_restrict_the_artifact_to_their_rows(tmp_path):
    """`layers` keeps exactly the artifact rows of those layers (tensors sliced, not recomputed); a layer the
    artifact does not calibrate is refused naming the field."""
    from transformers import Qwen3Config

    model = Qwen3Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        hidden_size=128)
    art = identity_artifact(3, 2, 4, 32, layer_ids=[0, 2, 3], fmt=PAPER)
    art.k_clip_ratio = torch.tensor([[0.9, 0.8], [0.7, 0.6], [0.55, 0.5]])  # one distinct row per layer
    write_artifact(art.validate(), tmp_path / "a")
    cfg = OscarServeConfig(path=str(tmp_path / "a"), layers=[3, 0])
    sub = load_checked_artifact(cfg, model)
    assert sub.layer_ids.tolist() == [0, 3]
    assert torch.equal(sub.k_clip_ratio, torch.tensor([[0.9, 0.8], [0.55, 0.5]]))
    assert sub.k_rotation.shape == (2, 2, 32, 32) and sub.k_mean.shape == (2, 2, 32)
    with pytest.raises(ValueError, match=r"additional_config\.oscar\.layers: .*field 'layer_ids': layers \[1\] "
                                         r"are not calibrated"):
        load_checked_artifact(OscarServeConfig(path=str(tmp_path / "a"), layers=[1, 2]), model)
    with pytest.raises(Exception, match="field 'layer_ids'"):
        restrict_layers(art, [5])


def test_repo_type_reaches_the_hub_pull(tmp_path, monkeypatch):
    """`repo_type` (a zoo kept in a dataset repo) is passed to `load_artifact`; anything but model/dataset is named."""
    import runtime_kernels.vllm.config as config_mod

    seen = {}

    def fake_load(model_id, **kwargs):
        seen.update(kwargs, model_id=model_id)
        return identity_artifact(2, 2, 4, 32, model_id=model_id, fmt=PAPER)

    monkeypatch.setattr(config_mod, "load_artifact", fake_load)
    from transformers import Qwen3Config

    model = Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        hidden_size=128)
    cfg = parse_oscar_config({"oscar": {"repo": "org/zoo", "revision": "v1", "repo_type": "dataset",
                                        "model_id": "org/model"}})
    load_checked_artifact(cfg, model)
    assert (seen["repo"], seen["revision"], seen["repo_type"], seen["model_id"]) == ("org/zoo", "v1", "dataset",
                                                                                      "org/model")
    with pytest.raises(ValueError, match=r"additional_config\.oscar\.repo_type"):
        parse_oscar_config({"oscar": {"repo": "org/zoo", "revision": "v1", "repo_type": "space"}})
