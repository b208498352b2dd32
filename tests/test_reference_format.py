"""Reference RotationZoo interop: safe import of formats v1, v2, v3 (executes nothing, plain structure only) and
export of v2 (v3 with a key mean) and v1. The test builds every .pt file itself."""

from __future__ import annotations

import pickle
import sys
from collections import OrderedDict

import pytest
import torch
from format_helpers import PAPER, restamp
from tiny_models import tiny_config

from oscar_calib.errors import InputError
from oscar_calib.zoo.reference_format import (
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
    """Format v1 as the reference writes it: one rotation per layer, source_grouping and layer_id included."""
    rots = orthogonal(len(layers), seed, d)
    return {"format_version": 1, "objective": objective, "source_grouping": "layer",
            "layers": {i: {"layer_id": i, "rotation": rots[n], "eigenvalues": torch.linspace(1, 2, d)}
                       for n, i in enumerate(layers)}}


def reference_v2(layers=(0, 1), heads=2, seed=0, objective="query_moment", version=2, **extra):
    """Format v2/v3: one rotation per KV head; `extra` maps a layer key (k_mean, q_rotation, ...) to a
    function (layer index, rotation [H, d, d]) -> tensor."""
    rots = orthogonal(len(layers) * heads, seed).view(len(layers), heads, D, D)
    out = {"format_version": version, "objective": objective, "source_grouping": "kv_head", "layers": {}}
    for n, i in enumerate(layers):
        entry = {"layer_id": i, "rotation": rots[n], "eigenvalues": torch.linspace(1, 2, D).repeat(heads, 1)}
        entry.update({key: make(i, rots[n]) for key, make in extra.items()})
        out["layers"][i] = entry
    return out


def config(**kw):
    return tiny_config("qwen3", num_heads=4, num_kv_heads=2, head_dim=D, num_layers=2, **kw)


def test_import_builds_a_valid_layer_artifact(tmp_path):
    torch.save(reference_dict(seed=0), tmp_path / "k.pt")
    torch.save(reference_dict(seed=1, objective="logit_weighted"), tmp_path / "v.pt")
    keys, values = load_reference(tmp_path / "k.pt"), load_reference(tmp_path / "v.pt")
    art = reference_to_artifact(keys, values, config(), "tiny/qwen3", "b" * 40, windows=PAPER)
    raw_k = reference_dict(seed=0)["layers"]
    for n, layer in enumerate((0, 1)):
        for h in range(2):  # the one per-layer rotation is repeated for every KV head
            assert torch.equal(art.k_rotation[n, h], raw_k[layer]["rotation"])
    assert torch.equal(art.k_eigenvalues[0, 0], torch.linspace(2, 1, D))  # stored descending
    assert art.metadata["granularity"] == "layer" and art.metadata["value_target"] == "logit_weighted"
    assert torch.all(art.k_clip_ratio == 0.96) and torch.all(art.v_clip_ratio == 0.92)
    write_artifact(art, tmp_path / "out")
    assert read_artifact(tmp_path / "out").num_layers == 2


def test_legacy_v1_without_source_grouping_still_imports():
    data = reference_dict()
    del data["source_grouping"]
    for entry in data["layers"].values():
        del entry["layer_id"]
    keys = validate_reference(data, "old.pt")
    assert keys["source_grouping"] is None and keys["heads"] == 1


def test_v1_export_then_import_round_trips(tmp_path):
    art = identity_artifact(2, 1, 4, D, model_id="tiny/m", fmt=PAPER)
    art.k_rotation = orthogonal(2, 3).unsqueeze(1).contiguous()
    art.v_rotation = orthogonal(2, 4).unsqueeze(1).contiguous()
    paths = export_reference(art, tmp_path / "ref", version=1)
    raw = torch.load(paths["keys"], weights_only=True)
    assert set(raw) == {"format_version", "objective", "source_grouping", "layers"} and set(raw["layers"]) == {0, 1}
    assert raw["format_version"] == 1 and raw["layers"][1]["layer_id"] == 1
    assert torch.equal(raw["layers"][1]["rotation"], art.k_rotation[1, 0])
    back = reference_to_artifact(load_reference(paths["keys"]), load_reference(paths["values"]),
                                 tiny_config("qwen3", num_heads=4, num_kv_heads=1, head_dim=D, num_layers=2), "tiny/m", windows=PAPER)
    assert torch.equal(back.v_rotation, art.v_rotation)


def test_v1_export_refuses_differing_heads_unless_head_reduce(tmp_path):
    art = identity_artifact(2, 2, 4, D, fmt=PAPER)
    art.k_rotation = orthogonal(4, 5).view(2, 2, D, D).contiguous()
    with pytest.raises(InputError, match="head-reduce"):
        export_reference(art, tmp_path / "ref", version=1)
    assert not (tmp_path / "ref").exists()
    keys, values = artifact_to_reference(art, head_reduce="first", version=1)
    assert torch.equal(keys["layers"][1]["rotation"], art.k_rotation[1, 0])
    assert keys["objective"].endswith("head_reduce=first")
    same = identity_artifact(2, 2, 4, D, fmt=PAPER)  # equal heads export without any reduction
    assert artifact_to_reference(same, version=1)[0]["objective"] == "identity"


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
    (lambda d: d.update(format_version=4), "format_version"),
    (lambda d: d.update(format_version=True), "format_version"),
    (lambda d: d.update(source_grouping=3), "source_grouping"),
    (lambda d: d["layers"][0].update(layer_id=1), "layers.0.layer_id"),
    (lambda d: d["layers"][0].update(k_mean=torch.zeros(D)), "layers.0"),  # k_mean is a v3 key
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
        reference_to_artifact(keys, values, tiny_config("qwen3", num_heads=4, num_kv_heads=2, head_dim=32), "m", windows=PAPER)
    with pytest.raises(InputError, match="layers"):
        reference_to_artifact(validate_reference(reference_dict(layers=(0, 5)), "k"),
                              validate_reference(reference_dict(layers=(0, 5)), "v"), config(), "m", windows=PAPER)
    with pytest.raises(ReferenceFormatError, match="different layers"):
        reference_to_artifact(keys, validate_reference(reference_dict(layers=(0,)), "v"), config(), "m", windows=PAPER)


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
                         "--model-config", str(tmp_path / "model"), "--model-id", "tiny/qwen3", "--out", str(tmp_path / "art"),
                         "--sink", "128", "--recent", "1024")
    assert code == 0, err
    assert read_artifact(tmp_path / "art").kv_format.window_tokens == 128 + 1024
    code, out, err = run("export", str(tmp_path / "art"), "--format", "reference", "--out", str(tmp_path / "ref"))
    assert code == 0, err
    exported = torch.load(tmp_path / "ref" / "keys.pt", weights_only=True)  # v2: the layer's rotation per KV head
    assert exported["format_version"] == 2
    for h in range(2):
        assert torch.equal(exported["layers"][0]["rotation"][h], reference_dict(seed=0)["layers"][0]["rotation"])
    code, out, err = run("export", str(tmp_path / "art"), "--format", "reference", "--out", str(tmp_path / "ref1"),
                         "--reference-version", "1")
    assert code == 0, err
    assert torch.equal(torch.load(tmp_path / "ref1" / "keys.pt", weights_only=True)["layers"][0]["rotation"],
                       reference_dict(seed=0)["layers"][0]["rotation"])
    code, out, err = run("import", "--keys", str(tmp_path / "k.pt"), "--values", str(tmp_path / "v.pt"),
                         "--model-config", str(tmp_path / "model"), "--model-id", "tiny/qwen3", "--out", str(tmp_path / "w"),
                         "--recent", str(10 ** 14))
    assert code == 2 and "--recent" in err and not (tmp_path / "w").exists()
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    code, out, err = run("import", "--keys", str(tmp_path / "bad.pt"), "--values", str(tmp_path / "v.pt"),
                         "--model-config", str(tmp_path / "model"), "--model-id", "tiny/qwen3", "--out", str(tmp_path / "x"))
    assert code == 2 and "bad.pt" in err and not (tmp_path / "x").exists()
    code, out, err = run("export", str(tmp_path / "art"), "--format", "gguf", "--out", str(tmp_path / "y"))
    assert code == 2 and not (tmp_path / "y").exists()


def test_v2_import_keeps_one_rotation_per_kv_head():
    keys = validate_reference(reference_v2(seed=0), "k.pt")
    values = validate_reference(reference_v2(seed=1, objective="attn_output"), "v.pt")
    art = reference_to_artifact(keys, values, config(), "tiny/qwen3", windows=PAPER)
    raw = reference_v2(seed=0)["layers"]
    for n, layer in enumerate((0, 1)):
        assert torch.equal(art.k_rotation[n], raw[layer]["rotation"])
    assert not torch.equal(art.k_rotation[0, 0], art.k_rotation[0, 1])
    assert art.metadata["granularity"] == "head" and art.schema_version == 2
    assert art.metadata["scale_dtype"] == "float32" and not art.is_centered
    with pytest.raises(InputError, match="num_key_value_heads"):  # 2 rotations per layer, model has 1 KV head
        reference_to_artifact(keys, values, tiny_config("qwen3", num_heads=4, num_kv_heads=1, head_dim=D,
                                                        num_layers=2), "tiny/qwen3", windows=PAPER)


def test_v3_k_mean_maps_to_original_basis_and_converts_with_the_rotation():
    gen = torch.Generator().manual_seed(7)
    means = {i: torch.randn(2, D, generator=gen) for i in (0, 1)}
    keys = validate_reference(reference_v2(version=3, k_mean=lambda i, r: means[i]), "k.pt")
    values = validate_reference(reference_v2(seed=1, version=3), "v.pt")
    art = reference_to_artifact(keys, values, config(), "tiny/qwen3", windows=PAPER)
    assert art.mean_basis == "original" and art.is_centered
    for n, layer in enumerate((0, 1)):
        assert torch.equal(art.key_mean("original")[n], means[layer])
        for h in range(2):  # x_rot = x @ R, so the rotated mean is mu @ R (row vector), computed here per head
            want = (means[layer][h].double() @ art.k_rotation[n, h].double()).float()
            torch.testing.assert_close(art.k_mean_rotated()[n, h], want, atol=1e-6, rtol=0)
    assert not art.value_mean("rotated").any()
    shared = validate_reference(reference_v2(version=3, k_mean=lambda i, r: torch.ones(D)), "k.pt")
    assert torch.equal(shared["layers"][0]["k_mean"], torch.ones(2, D))  # a [d] mean is shared by the heads
    with pytest.raises(ReferenceFormatError, match="value file"):
        reference_to_artifact(values, keys, config(), "tiny/qwen3", windows=PAPER)


def test_v3_non_orthogonal_q_rotation_is_refused_with_the_reason():
    skewed = lambda i, r: r @ torch.diag(torch.linspace(0.5, 2.0, D))  # noqa: E731 - scales channels: not orthogonal
    with pytest.raises(ReferenceFormatError, match=r"q_rotation.*not orthogonal.*collapse under a scalar INT2.*q\.k"):
        validate_reference(reference_v2(version=3, q_rotation=skewed), "k.pt")
    other = lambda i, r: orthogonal(2, 99)  # noqa: E731 - orthogonal, but not the key rotation
    with pytest.raises(ReferenceFormatError, match="differs from the key rotation"):
        validate_reference(reference_v2(version=3, q_rotation=other), "k.pt")
    same = validate_reference(reference_v2(version=3, q_rotation=lambda i, r: r.clone()), "k.pt")
    assert "q_rotation" not in same["layers"][0]  # redundant with the rotation: nothing else to keep
    transposed = validate_reference(reference_v2(version=3, o_rotation=lambda i, r: r.transpose(-1, -2)), "v.pt")
    assert transposed["heads"] == 2
    with pytest.raises(ReferenceFormatError, match="o_rotation"):
        validate_reference(reference_v2(version=3, o_rotation=lambda i, r: orthogonal(2, 98)), "v.pt")
    with pytest.raises(ReferenceFormatError, match="layers.0"):  # v2 has no q_rotation
        validate_reference(reference_v2(version=2, q_rotation=lambda i, r: r.clone()), "k.pt")


def test_v3_pickle_payload_in_k_mean_executes_nothing(tmp_path):
    import os

    marker = "/tmp/oscar_reference_pwned_v3"
    if os.path.exists(marker):
        os.unlink(marker)

    class EvilMean:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    data = reference_v2(version=3)
    data["layers"][0]["k_mean"] = EvilMean()
    torch.save(data, tmp_path / "evil.pt")
    with pytest.raises(ReferenceFormatError, match="weights_only"):
        load_reference(tmp_path / "evil.pt")
    assert not os.path.exists(marker)


def test_v2_export_round_trips_per_head_and_centred_keys(tmp_path):
    art = identity_artifact(2, 2, 4, D, model_id="tiny/m", fmt=PAPER)
    art.k_rotation = orthogonal(4, 5).view(2, 2, D, D).contiguous()  # heads differ: v2 needs no reduction
    art.v_rotation = orthogonal(4, 6).view(2, 2, D, D).contiguous()
    paths = export_reference(art, tmp_path / "ref")
    raw = torch.load(paths["keys"], weights_only=True)
    assert raw["format_version"] == 2 and raw["source_grouping"] == "kv_head"
    assert list(raw["layers"][0]["rotation"].shape) == [2, D, D]
    back = reference_to_artifact(load_reference(paths["keys"]), load_reference(paths["values"]), config(), "tiny/m", windows=PAPER)
    assert torch.equal(back.k_rotation, art.k_rotation) and torch.equal(back.v_rotation, art.v_rotation)

    art.k_mean = torch.randn(2, 2, D, generator=torch.Generator().manual_seed(3))
    restamp(art)  # now centered
    paths = export_reference(art, tmp_path / "centred")
    raw = torch.load(paths["keys"], weights_only=True)
    assert raw["format_version"] == 3 and torch.equal(raw["layers"][1]["k_mean"], art.k_mean[1])
    assert torch.load(paths["values"], weights_only=True)["format_version"] == 2
    back = reference_to_artifact(load_reference(paths["keys"]), load_reference(paths["values"]), config(), "tiny/m", windows=PAPER)
    assert torch.equal(back.key_mean("original"), art.k_mean)
    with pytest.raises(InputError, match="k_mean"):
        artifact_to_reference(art, version=1)

    rotated = identity_artifact(2, 2, 4, D, model_id="tiny/m", fmt=PAPER)  # a mean stored in the rotated basis exports
    rotated.k_rotation = art.k_rotation                          # in the reference's (original) basis
    rotated.metadata["mean_basis"] = "rotated"
    rotated.k_mean = torch.einsum("ahd,ahde->ahe", art.k_mean.double(), art.k_rotation.double()).float()
    keys, _ = artifact_to_reference(restamp(rotated))
    torch.testing.assert_close(keys["layers"][0]["k_mean"], art.k_mean[0], atol=1e-5, rtol=0)

    art.v_mean = torch.ones(2, 2, D)
    with pytest.raises(InputError, match="v_mean"):
        export_reference(art, tmp_path / "vmean")
    assert not (tmp_path / "vmean").exists()

    art.v_mean = torch.zeros(2, 2, D)  # the reference quantizes min-max: the unbiased gain cannot travel
    restamp(art, quantizer="uniform_unbiased")
    with pytest.raises(InputError, match="field 'quantizer' is 'uniform_unbiased'.*--quantizer uniform_minmax"):
        export_reference(art, tmp_path / "unbiased")
    assert not (tmp_path / "unbiased").exists()
