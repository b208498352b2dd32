"""Reference RotationZoo interop: safe import (executes nothing, plain structure only) and export."""

from __future__ import annotations

import pickle
import sys
from collections import OrderedDict

import pytest
import torch
from tiny_models import tiny_config

from oscar_calib.errors import InputError
from oscar_calib.reference_format import (
    ReferenceFormatError,
    artifact_to_reference,
    export_reference,
    load_reference,
    reference_to_artifact,
    validate_reference,
)
from runtime_kernels.artifact import identity_artifact, read_artifact, write_artifact

D = 16


def orthogonal(n: int, seed: int, d: int = D) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, d, d, generator=g, dtype=torch.float64))[0].float()


def reference_dict(layers=(0, 1), seed=0, objective="query_moment", d=D):
    rots = orthogonal(len(layers), seed, d)
    return {"format_version": 1, "objective": objective,
            "layers": {i: {"rotation": rots[n], "eigenvalues": torch.linspace(1, 2, d)} for n, i in enumerate(layers)}}


def config(**kw):
    return tiny_config("qwen3", num_heads=4, num_kv_heads=2, head_dim=D, num_layers=2, **kw)


def test_import_builds_a_valid_layer_artifact(tmp_path):
    torch.save(reference_dict(seed=0), tmp_path / "k.pt")
    torch.save(reference_dict(seed=1, objective="logit_weighted"), tmp_path / "v.pt")
    keys, values = load_reference(tmp_path / "k.pt"), load_reference(tmp_path / "v.pt")
    art = reference_to_artifact(keys, values, config(), "tiny/qwen3", "b" * 40)
    raw_k = reference_dict(seed=0)["layers"]
    for n, layer in enumerate((0, 1)):
        for h in range(2):  # the one per-layer rotation is repeated for every KV head
            assert torch.equal(art.k_rotation[n, h], raw_k[layer]["rotation"])
    assert torch.equal(art.k_eigenvalues[0, 0], torch.linspace(2, 1, D))  # stored descending
    assert art.metadata["granularity"] == "layer" and art.metadata["value_target"] == "logit_weighted"
    assert torch.all(art.k_clip_ratio == 0.96) and torch.all(art.v_clip_ratio == 0.92)
    write_artifact(art, tmp_path / "out")
    assert read_artifact(tmp_path / "out").num_layers == 2


def test_export_then_import_round_trips(tmp_path):
    art = identity_artifact(2, 1, 4, D, model_id="tiny/m")
    art.k_rotation = orthogonal(2, 3).unsqueeze(1).contiguous()
    art.v_rotation = orthogonal(2, 4).unsqueeze(1).contiguous()
    paths = export_reference(art, tmp_path / "ref")
    raw = torch.load(paths["keys"], weights_only=True)
    assert set(raw) == {"format_version", "objective", "layers"} and set(raw["layers"]) == {0, 1}
    assert torch.equal(raw["layers"][1]["rotation"], art.k_rotation[1, 0])
    back = reference_to_artifact(load_reference(paths["keys"]), load_reference(paths["values"]),
                                 tiny_config("qwen3", num_heads=4, num_kv_heads=1, head_dim=D, num_layers=2), "tiny/m")
    assert torch.equal(back.v_rotation, art.v_rotation)


def test_export_refuses_differing_heads_unless_head_reduce(tmp_path):
    art = identity_artifact(2, 2, 4, D)
    art.k_rotation = orthogonal(4, 5).view(2, 2, D, D).contiguous()
    with pytest.raises(InputError, match="head-reduce"):
        export_reference(art, tmp_path / "ref")
    assert not (tmp_path / "ref").exists()
    keys, values = artifact_to_reference(art, head_reduce="first")
    assert torch.equal(keys["layers"][1]["rotation"], art.k_rotation[1, 0])
    assert keys["objective"].endswith("head_reduce=first")
    same = identity_artifact(2, 2, 4, D)  # equal heads export without any reduction
    assert artifact_to_reference(same)[0]["objective"] == "identity"


class Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/oscar_reference_pwned",))


def test_pickle_payload_executes_nothing(tmp_path):
    marker = "/tmp/oscar_reference_pwned"
    import os

    if os.path.exists(marker):
        os.unlink(marker)
    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "objective": "x", "layers": {0: Evil()}}, path)
    with pytest.raises(ReferenceFormatError, match="weights_only"):
        load_reference(path)
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ReferenceFormatError):
        load_reference(raw)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d.pop("objective"), "objective"),
    (lambda d: d.update(format_version=2), "format_version"),
    (lambda d: d.update(format_version="1"), "format_version"),
    (lambda d: d.update(layers={"0": d["layers"][0]}), "layers"),
    (lambda d: d.update(layers={-1: d["layers"][0]}), "layers"),
    (lambda d: d["layers"][0].update(bias=torch.zeros(2)), "layers.0"),
    (lambda d: d["layers"][0].update(rotation=torch.nn.Parameter(d["layers"][0]["rotation"])), "plain torch.Tensor"),
    (lambda d: d["layers"][0].update(rotation=torch.ones(D, D)), "not orthogonal"),
    (lambda d: d["layers"][0].update(rotation=torch.eye(D, dtype=torch.int64)), "floating"),
    (lambda d: d["layers"][0].update(rotation=torch.eye(D)[:, :8]), "square"),
    (lambda d: d["layers"][0].update(eigenvalues=torch.ones(3)), "eigenvalues"),
    (lambda d: d["layers"][1].update(rotation=torch.eye(8), eigenvalues=torch.ones(8)), "head_dim"),
    (lambda d: d["layers"][0].update(eigenvalues=torch.full((D,), float("nan"))), "NaN"),
    (lambda d: d.update(layers=OrderedDict(d["layers"])), "layers"),
])
def test_structure_violations_are_refused(mutate, field):
    data = reference_dict()
    mutate(data)
    with pytest.raises(ReferenceFormatError, match=field):
        validate_reference(data, "ref.pt")


def test_model_mismatch_is_refused():
    keys, values = validate_reference(reference_dict(), "k"), validate_reference(reference_dict(seed=1), "v")
    with pytest.raises(InputError, match="head_dim"):
        reference_to_artifact(keys, values, tiny_config("qwen3", num_heads=4, num_kv_heads=2, head_dim=32), "m")
    with pytest.raises(InputError, match="layers"):
        reference_to_artifact(validate_reference(reference_dict(layers=(0, 5)), "k"),
                              validate_reference(reference_dict(layers=(0, 5)), "v"), config(), "m")
    with pytest.raises(ReferenceFormatError, match="different layers"):
        reference_to_artifact(keys, validate_reference(reference_dict(layers=(0,)), "v"), config(), "m")


def test_cli_import_export(tmp_path, monkeypatch, capsys):
    from oscar_calib.cli import main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["oscar-calib", *args])
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        return code, *capsys.readouterr()

    torch.save(reference_dict(seed=0), tmp_path / "k.pt")
    torch.save(reference_dict(seed=1), tmp_path / "v.pt")
    config().save_pretrained(tmp_path / "model")
    code, out, err = run("import", "--keys", str(tmp_path / "k.pt"), "--values", str(tmp_path / "v.pt"),
                         "--model-config", str(tmp_path / "model"), "--model-id", "tiny/qwen3", "--out", str(tmp_path / "art"))
    assert code == 0, err
    code, out, err = run("export", str(tmp_path / "art"), "--format", "reference", "--out", str(tmp_path / "ref"))
    assert code == 0, err
    assert torch.equal(torch.load(tmp_path / "ref" / "keys.pt", weights_only=True)["layers"][0]["rotation"],
                       reference_dict(seed=0)["layers"][0]["rotation"])
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    code, out, err = run("import", "--keys", str(tmp_path / "bad.pt"), "--values", str(tmp_path / "v.pt"),
                         "--model-config", str(tmp_path / "model"), "--model-id", "tiny/qwen3", "--out", str(tmp_path / "x"))
    assert code == 2 and "bad.pt" in err and not (tmp_path / "x").exists()
    code, out, err = run("export", str(tmp_path / "art"), "--format", "gguf", "--out", str(tmp_path / "y"))
    assert code == 2 and not (tmp_path / "y").exists()
