"""One identity rule on every path: a local copy of a model names its Hub id with `model_id=` / `--model-id`, and
`allow_other_model` waives the check in `load_artifact`, `OscarCache.from_pretrained` / `from_artifact` and the CLI.

The model is a tiny Qwen3 saved to a folder (so its config's `_name_or_path` is that folder, as for a user who
downloaded the weights), the artifact names the Hub id `tiny/qwen3`.
"""

from __future__ import annotations

import pytest
from cli_helpers import run_cli
from format_helpers import PAPER
from test_hub import MODEL, REPO, TOKEN, make_artifact  # noqa: F401  (TOKEN: the hub fixture's token)

from runtime_kernels.artifact import check_against_model, read_artifact
from runtime_kernels.hf import OscarCache
from runtime_kernels.loader import ModelMismatchError, load_artifact


@pytest.fixture
def local_model(tmp_path):
    """A local folder holding a config with the artifact's shapes (2 layers, 4 / 2 heads, head_dim 16)."""
    from transformers import AutoConfig, Qwen3Config

    folder = tmp_path / "my-copy"
    Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
                intermediate_size=128, vocab_size=128).save_pretrained(folder)
    return folder, AutoConfig.from_pretrained(folder)


def test_local_copy_is_refused_with_advice_and_accepted_with_model_id(tmp_path, local_model):
    folder, config = local_model
    art = make_artifact(tmp_path / "art")
    with pytest.raises(ModelMismatchError, match=r"calibrated for 'tiny/qwen3', the model is '.*my-copy'; if that is "
                                                 r"a local copy of 'tiny/qwen3' pass model_id='tiny/qwen3'"):
        OscarCache.from_pretrained(art, config)
    for call in (lambda **kw: OscarCache.from_pretrained(art, config, **kw),
                 lambda **kw: OscarCache.from_artifact(art, config, **kw),
                 lambda **kw: load_artifact(art, model_config=config, **kw)):
        with pytest.raises(ModelMismatchError):
            call()
        assert call(model_id=MODEL) is not None
        assert call(allow_other_model=True) is not None  # honoured on every path (was: from_artifact only)
        with pytest.raises(ModelMismatchError, match="'other/model'"):
            call(model_id="other/model")


def test_shapes_are_never_waived(tmp_path, local_model):
    _, config = local_model
    art = make_artifact(tmp_path / "art", d=32)
    for kw in ({"allow_other_model": True}, {"model_id": MODEL}):
        with pytest.raises(ModelMismatchError, match="head_dim"):
            OscarCache.from_pretrained(art, config, **kw)


def test_hub_form_with_a_local_model(hub, tmp_path, local_model):
    """The README's Hub form on a model loaded from a folder: the release's model id is the identity (the
    constructor used to re-check against the folder's path and refuse)."""
    from oscar_calib.zoo.hub import push

    _, config = local_model
    push(make_artifact(tmp_path / "art"), REPO, token=TOKEN, endpoint=hub.endpoint)
    cache = OscarCache.from_pretrained(MODEL, config, repo=REPO, revision="v1", token=TOKEN,
                                       cache_dir=tmp_path / "c", endpoint=hub.endpoint)
    assert cache.artifact.metadata["model_id"] == MODEL


def test_advice_words_follow_the_caller(tmp_path, local_model):
    """The rule is one function; the advice names the caller's own option (flag, keyword or vLLM config key)."""
    _, config = local_model
    art = read_artifact(make_artifact(tmp_path / "art"))
    expected = {"python": "model_id='tiny/qwen3'", "cli": "--model-id tiny/qwen3",
                "vllm": '"model_id": "tiny/qwen3" in additional_config.oscar'}
    for advice, text in expected.items():
        with pytest.raises(ModelMismatchError) as info:
            check_against_model(art, config, advice=advice)
        assert text in str(info.value)


def test_audit_and_eval_take_model_id(tmp_path, local_model, monkeypatch, capsys):
    """`--model-id` on the command line: refused without it (exit 2, the advice names the flag), accepted with it."""
    import shutil
    from pathlib import Path

    import oscar_calib

    fixture = Path(oscar_calib.__file__).parent / "fixtures" / "tiny-qwen3"
    copy = tmp_path / "copy-of-tiny-qwen3"  # a copy the package does not recognise as its fixture
    shutil.copytree(fixture, copy)
    from runtime_kernels.artifact import identity_artifact, write_artifact

    write_artifact(identity_artifact(4, 2, 4, 128, model_id="oscar-calib/tiny-qwen3", fmt=PAPER), tmp_path / "demo")
    base = ["--model", str(copy), "--artifact", str(tmp_path / "demo"), "--methods", "bf16", "--max-windows", "1",
            "--generation-steps", "0", "--context", "384", "--sink", "64", "--recent", "256"]
    code, _, err = run_cli(["eval", *base], monkeypatch, capsys)
    assert code == 2 and "--model-id oscar-calib/tiny-qwen3" in err and "--allow-other-model" in err, err
    code, _, err = run_cli(["eval", *base, "--model-id", "oscar-calib/tiny-qwen3"], monkeypatch, capsys)
    assert code == 0, err
    code, _, err = run_cli(["eval", *base, "--allow-other-model"], monkeypatch, capsys)
    assert code == 0, err
    audit = ["audit", str(tmp_path / "demo"), "--model", str(copy), "--samples", "1", "--seq-len", "64"]
    code, _, err = run_cli(audit, monkeypatch, capsys)
    assert code == 2 and "--model-id" in err, err
    code, _, err = run_cli([*audit, "--model-id", "oscar-calib/tiny-qwen3"], monkeypatch, capsys)
    assert code == 0, err
