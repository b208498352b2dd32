"""zoo_manifest.yaml: strict YAML, pydantic schema, the committed JSON Schema, CLI exit codes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from oscar_calib.zoo.manifest import (
    ManifestError,
    ZooManifest,
    dump_manifest,
    json_schema,
    load_manifest,
    parse_manifest,
    safe_load_yaml,
)

ROOT = Path(__file__).resolve().parents[1]
SHA = "c" * 40
GOOD = f"""schema_version: 1
repo: org/zoo
recipes:
  - model_id: Qwen/Qwen3-8B
    model_revision: "{SHA}"
    data:
      dataset: calib.txt
      samples: 4
releases:
  - model_id: Qwen/Qwen3-8B
    model_revision: "{SHA}"
    repo: org/zoo
    version: v1
    commit: "{'d' * 40}"
    files:
      - {{name: oscar_kv.safetensors, sha256: "{'e' * 64}", size: 10}}
      - {{name: release.json, sha256: "{'f' * 64}", size: 5}}
    metrics: {{ppl: 1.5}}
"""


def test_good_manifest_parses_and_round_trips():
    zoo = parse_manifest(GOOD)
    assert zoo.recipes[0].data.samples == 4 and zoo.releases[0].sha256s()["release.json"] == "f" * 64
    assert zoo.pending() == [] and zoo.latest_release("Qwen/Qwen3-8B").version == "v1"
    again = parse_manifest(dump_manifest(zoo))
    assert again == zoo
    config = zoo.recipes[0].to_config()
    assert config.model == "Qwen/Qwen3-8B" and config.model_revision == SHA and config.data.samples == 4


def test_committed_manifest_is_valid():
    zoo = load_manifest(ROOT / "zoo_manifest.yaml")
    assert zoo.recipes and not zoo.releases


def test_committed_schema_equals_generated():
    committed = (ROOT / "zoo_manifest.schema.json").read_text()
    assert committed == json_schema(), "regenerate: oscar-calib zoo schema --write zoo_manifest.schema.json"
    schema = json.loads(committed)
    assert schema["additionalProperties"] is False and "recipes" in schema["properties"]


@pytest.mark.parametrize("bad, field", [
    (GOOD.replace("schema_version: 1", "schema_version: 1\nrepos: x"), "repos"),                  # unknown top key
    (GOOD.replace("      samples: 4", "      samples: 4\n      sampels: 5"), "sampels"),            # unknown nested key
    (GOOD.replace(f'model_revision: "{SHA}"', "model_revision: main", 1), "model_revision"),       # unpinned
    (GOOD.replace(f'model_revision: "{SHA}"', f'model_revision: "{SHA[:39]}"', 1), "model_revision"),
    (GOOD.replace("dataset: calib.txt", "dataset: HuggingFaceFW/fineweb"), "dataset_revision"),   # unpinned data
    (GOOD.replace("model_id: Qwen/Qwen3-8B", "model_id: ../etc", 1), "model_id"),
    (GOOD.replace("repo: org/zoo", "repo: /abs/zoo", 1), "repo"),
    (GOOD.replace("name: oscar_kv.safetensors", "name: ../oscar_kv.safetensors"), "name"),
    (GOOD.replace("version: v1", "version: latest"), "version"),
])
def test_schema_violations_name_the_field(bad, field):
    with pytest.raises(ManifestError, match=field):
        parse_manifest(bad)


def test_release_must_match_a_recipe_and_be_unique():
    orphan = GOOD.replace("  - model_id: Qwen/Qwen3-8B\n    model_revision", "  - model_id: Qwen/Qwen3-4B\n    model_revision", 1)
    with pytest.raises(ManifestError, match="no recipe"):
        parse_manifest(orphan)
    twice = GOOD + GOOD[GOOD.index("  - model_id: Qwen/Qwen3-8B\n    model_revision: \"" + SHA + "\"\n    repo"):]
    with pytest.raises(ManifestError, match="recorded twice"):
        parse_manifest(twice)


@pytest.mark.parametrize("text, match", [
    ("a: !!python/object/apply:os.system ['echo hi']", "tags are not allowed"),
    ("a: !custom 1", "tags are not allowed"),
    ("a: !!str 1", "tags are not allowed"),
    ("a: &x 1\nb: *x", "anchors and aliases"),
    ("a: 1\na: 2", "duplicate key 'a'"),
    ("a:\n  b: 1\n  b: 2", "duplicate key 'b'"),
    ("base: &b {x: 1}\nc:\n  <<: *b", "anchors and aliases"),
    ("? [1, 2]\n: x", "keys must be strings"),
    ("a: [1, 2", "not valid YAML"),
])
def test_strict_yaml_refuses(text, match):
    with pytest.raises(ManifestError, match=match):
        safe_load_yaml(text, "m.yaml")


def test_dates_stay_strings_and_nothing_executes(tmp_path):
    assert safe_load_yaml("d: 2024-01-01") == {"d": "2024-01-01"}
    marker = tmp_path / "pwned"
    with pytest.raises(ManifestError):
        safe_load_yaml(f"a: !!python/object/apply:os.system ['touch {marker}']")
    assert not marker.exists()


def test_top_level_must_be_a_mapping_and_size_is_bounded():
    with pytest.raises(ManifestError, match="mapping"):
        parse_manifest("- 1\n- 2")
    with pytest.raises(ManifestError, match="larger"):
        parse_manifest("a: " + "x" * (1 << 20))


def test_cli_validate_exit_codes(tmp_path, monkeypatch, capsys):
    from oscar_calib.cli import main

    def run(path):
        monkeypatch.setattr(sys, "argv", ["oscar-calib", "zoo", "validate", "--manifest", str(path), "--offline"])
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        return code, *capsys.readouterr()

    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    assert run(good)[:2] == (0, "valid\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD + "extra_key: 1\n")
    code, out, err = run(bad)
    assert code == 2 and "extra_key" in err and out == ""
    code, out, err = run(tmp_path / "missing.yaml")
    assert code == 2 and "cannot read" in err


def test_write_manifest_is_atomic_and_reads_back(tmp_path):
    from oscar_calib.zoo.manifest import write_manifest

    zoo = parse_manifest(GOOD)
    path = tmp_path / "zoo_manifest.yaml"
    write_manifest(zoo, path)
    assert load_manifest(path) == zoo and [p.name for p in tmp_path.iterdir()] == ["zoo_manifest.yaml"]
    assert isinstance(zoo, ZooManifest)
