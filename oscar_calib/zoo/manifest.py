"""`zoo_manifest.yaml`: what the zoo calibrates (recipes) and what it published (releases).

The file is parsed with a strict YAML loader (no tags, no anchors/aliases, no duplicate keys, no
implicit dates, and none of YAML 1.1's surprising implicit conversions: `0755` (octal), `1:30`
(base 60), `0x1f`, `1_000`, `.inf`, `yes`/`on`/`off` are refused unless quoted; a boolean is accepted
only for a boolean field, so `schema_version: true` is an error) and validated by pydantic models
with `extra="forbid"`, so a typo is an error, not a silently ignored key. A recipe's local dataset
path is relative to the manifest's folder; absolute paths and `..` are refused, so a manifest means
the same on every machine and cannot point outside its checkout. Model revisions must be pinned to a 40-hex commit sha; a recipe's settings
are the `data` and `solver` sections of `oscar_calib.config.CalibrationConfig`. The JSON Schema
beside the file (`zoo_manifest.schema.json`) is generated from these models
(`oscar-calib zoo schema --write`).

`zoo publish` records a release by editing the file round-trip (`append_release`, ruamel.yaml): comments,
order and the user's spelling of everything else stay as written.

Every problem raises ManifestError (a bad input) naming the file, the field and what was expected.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from oscar_calib.config import CalibrationConfig, DataConfig, SolverSettings
from oscar_calib.errors import InputError
from runtime_kernels.artifact import ARTIFACT_FILENAME
from runtime_kernels.loader import (
    RELEASE_FILENAME,
    UnsafeNameError,
    check_component,
    check_model_id,
    check_relative_file,
    check_repo_id,
)

MANIFEST_FILENAME = "zoo_manifest.yaml"
SCHEMA_FILENAME = "zoo_manifest.schema.json"
MAX_MANIFEST_BYTES = 1 << 20
SHA1_RE = r"^[0-9a-f]{40}$"
SHA256_RE = r"^[0-9a-f]{64}$"
VERSION_RE = r"^v[1-9][0-9]{0,5}$"
RepoTypeName = Literal["model", "dataset"]  # the Hub repo kinds a zoo can live in (runtime_kernels.loader.REPO_TYPES)


class ManifestError(InputError):
    """A manifest that cannot be read or breaks the schema."""


# --- strict YAML ---------------------------------------------------------------------------------
class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses tags, anchors, aliases, merge keys and duplicate keys; dates stay strings."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        event = self.peek_event()
        where = f"line {event.start_mark.line + 1}"
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ManifestError(f"{self._source}: {where}: YAML anchors and aliases are not allowed")
        tag = getattr(event, "tag", None)
        if tag is not None and tag != "!":
            raise ManifestError(f"{self._source}: {where}: YAML tags are not allowed (found '{tag}')")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise ManifestError(f"{self._source}: line {key_node.start_mark.line + 1}: merge keys '<<' are not allowed")
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise ManifestError(f"{self._source}: line {key_node.start_mark.line + 1}: "
                                    f"mapping keys must be strings, got {key!r}")
            if key in seen:
                raise ManifestError(f"{self._source}: line {key_node.start_mark.line + 1}: duplicate key '{key}' "
                                    f"(first at line {seen[key]})")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# Plain (unquoted) scalars that YAML 1.1 would convert: only these spellings are taken as numbers, booleans
# or null; anything else that a resolver turned into one (octal, base 60, hex, '_' separators, .inf/.nan,
# yes/no/on/off) is refused so that the value is never silently something else than what was meant.
_PLAIN_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_PLAIN_FLOAT = re.compile(r"[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")
_PLAIN_BOOL = ("true", "false")
_PLAIN_NULL = ("", "~", "null")


def _strict_scalar(kind: str, pattern):
    base = {"int": yaml.SafeLoader.construct_yaml_int, "float": yaml.SafeLoader.construct_yaml_float,
            "bool": yaml.SafeLoader.construct_yaml_bool, "null": yaml.SafeLoader.construct_yaml_null}[kind]

    def construct(loader, node):  # noqa: ANN001 - PyYAML's signature
        ok = pattern.fullmatch(node.value) if hasattr(pattern, "fullmatch") else node.value in pattern
        if node.style is None and not ok:
            raise ManifestError(f"{loader._source}: line {node.start_mark.line + 1}: {node.value!r} is ambiguous "
                                f"YAML (YAML 1.1 reads it as the {kind} {base(loader, node)!r}); quote it to keep "
                                "the text, or write a plain decimal number / true / false / null")
        return base(loader, node)

    return construct


for _kind, _pattern in (("int", _PLAIN_INT), ("float", _PLAIN_FLOAT), ("bool", _PLAIN_BOOL), ("null", _PLAIN_NULL)):
    _StrictLoader.add_constructor(f"tag:yaml.org,2002:{_kind}", _strict_scalar(_kind, _pattern))


def safe_load_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML with `_StrictLoader`. Every failure is a ManifestError naming `source` and the line."""
    loader = None
    try:
        loader = _StrictLoader(text)  # the reader already rejects some characters here
        loader._source = source
        return loader.get_single_data()
    except ManifestError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ManifestError(f"{source}: {where}not valid YAML: {problem}") from None
    except RecursionError:
        raise ManifestError(f"{source}: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


# --- schema --------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _name_check(check, value: str, field_name: str) -> str:
    try:
        return check(value, field_name)
    except UnsafeNameError as exc:
        raise ValueError(str(exc)) from None


class _ModelKeyed(_Strict):
    """Checks shared by recipes and releases: the model id and calibration name become Hub path parts."""

    @field_validator("model_id", check_fields=False)
    @classmethod
    def _model_id(cls, value: str) -> str:
        return _name_check(check_model_id, value, "model_id")

    @field_validator("calibration", check_fields=False)
    @classmethod
    def _calibration(cls, value: str) -> str:
        return _name_check(check_component, value, "calibration")


def _check_dataset_path(dataset: str) -> None:
    """A recipe's dataset (a Hub id or a path relative to the manifest) may not be absolute or contain '..'."""
    posix = PurePosixPath(dataset.replace("\\", "/"))
    if posix.is_absolute() or PureWindowsPath(dataset).drive or dataset.startswith("~"):
        raise ValueError(f"data.dataset: {dataset!r} is an absolute path; expected a Hub dataset id or a path "
                         "relative to the manifest's folder")
    if ".." in posix.parts:
        raise ValueError(f"data.dataset: {dataset!r} contains '..'; expected a path inside the manifest's folder")


class Recipe(_ModelKeyed):
    """What to calibrate: a pinned model and the calibration settings (sections of CalibrationConfig)."""

    model_id: str = Field(description="Hub model id, e.g. 'Qwen/Qwen3-8B'.")
    model_revision: str = Field(pattern=SHA1_RE, description="The model's commit sha (40 hex digits): pinned.")
    calibration: str = Field("default", description="Calibration name; the release path is '<model_id>/<calibration>/'.")
    data: DataConfig = Field(description="Calibration data (oscar_calib.config.DataConfig).")
    solver: SolverSettings = Field(default_factory=SolverSettings, description="Solver settings (oscar_calib.config.SolverSettings).")
    dtype: str | None = Field(None, pattern=r"^(bfloat16|float16|float32)$")
    description: str = ""

    @model_validator(mode="after")
    def _data_pinned(self) -> Recipe:
        dataset = self.data.dataset
        local = dataset is not None and dataset.endswith((".txt", ".jsonl"))
        if dataset is not None:
            _check_dataset_path(dataset)
        if dataset is not None and not local:
            if not (self.data.dataset_revision and re.fullmatch(SHA1_RE[1:-1], self.data.dataset_revision)):
                raise ValueError(f"data.dataset_revision: Hub dataset '{dataset}' must be pinned to a 40-hex commit "
                                 f"sha, got {self.data.dataset_revision!r}")
        return self

    @property
    def key(self) -> tuple[str, str]:
        return self.model_id, self.calibration

    def to_config(self, model: str | None = None, device: str | None = None,
                  base_dir: str | Path | None = None) -> CalibrationConfig:
        """The CalibrationConfig of this recipe. `model` overrides where the weights are read from (a local
        mirror of `model_id` at `model_revision`); the revision is then not passed on. `base_dir` is the
        manifest's folder: a local dataset path is read relative to it."""
        data = self.data
        if base_dir is not None and data.dataset is not None and (Path(base_dir) / data.dataset).exists():
            data = data.model_copy(update={"dataset": str(Path(base_dir) / data.dataset)})
        return CalibrationConfig(model=model or self.model_id, model_revision=None if model else self.model_revision,
                                 data=data, solver=self.solver, device=device, dtype=self.dtype)


class ReleaseFile(_Strict):
    name: str = Field(description="File name inside the release directory.")
    sha256: str = Field(pattern=SHA256_RE)
    size: int = Field(ge=0)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _name_check(check_relative_file, value, "name")


class Release(_ModelKeyed):
    """What was published: where, which version tag, which commit, and every file's hash."""

    model_id: str
    calibration: str = "default"
    model_revision: str = Field(pattern=SHA1_RE)
    repo: str = Field(description="Zoo repo id 'ORG/NAME'.")
    repo_type: RepoTypeName = Field("model", description="Kind of Hub repo `repo` is: model (default) or dataset.")
    version: str = Field(pattern=VERSION_RE, description="Version tag, e.g. 'v3'.")
    commit: str = Field(pattern=SHA1_RE, description="The commit the tag named when it was published.")
    files: list[ReleaseFile] = Field(min_length=1)
    metrics: dict[str, float] = Field(default_factory=dict)

    @field_validator("repo")
    @classmethod
    def _repo(cls, value: str) -> str:
        return _name_check(check_repo_id, value, "repo")

    @model_validator(mode="after")
    def _files(self) -> Release:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("files: duplicate file names")
        for required in (ARTIFACT_FILENAME, RELEASE_FILENAME):
            if required not in names:
                raise ValueError(f"files: must list '{required}'")
        return self

    @property
    def key(self) -> tuple[str, str]:
        return self.model_id, self.calibration

    @property
    def path_in_repo(self) -> str:
        return f"{self.model_id}/{self.calibration}"

    def sha256s(self) -> dict[str, str]:
        return {f.name: f.sha256 for f in self.files}


class ZooManifest(_Strict):
    """The whole zoo: a default repo, recipes, and the releases published from them."""

    schema_version: int = Field(1, ge=1, le=1)
    repo: str = Field(description="Default zoo repo id 'ORG/NAME' for `zoo publish`.")
    repo_type: RepoTypeName = Field("model", description="Kind of Hub repo `repo` is: model (default) or dataset.")
    recipes: list[Recipe] = Field(default_factory=list)
    releases: list[Release] = Field(default_factory=list)

    @field_validator("repo")
    @classmethod
    def _repo(cls, value: str) -> str:
        return _name_check(check_repo_id, value, "repo")

    @model_validator(mode="after")
    def _consistent(self) -> ZooManifest:
        keys = [r.key for r in self.recipes]
        dup = next((k for k in keys if keys.count(k) > 1), None)
        if dup:
            raise ValueError(f"recipes: two recipes for model_id '{dup[0]}' calibration '{dup[1]}'")
        recipes = {r.key: r for r in self.recipes}
        seen: set[tuple[str, str, str]] = set()
        for i, rel in enumerate(self.releases):
            recipe = recipes.get(rel.key)
            if recipe is None:
                raise ValueError(f"releases.{i}: no recipe for model_id '{rel.model_id}' calibration '{rel.calibration}'")
            if rel.model_revision != recipe.model_revision:
                raise ValueError(f"releases.{i}.model_revision: '{rel.model_revision}' differs from the recipe's "
                                 f"'{recipe.model_revision}'")
            if (rel.repo, rel.repo_type, rel.version) in seen:
                raise ValueError(f"releases.{i}: version '{rel.version}' of '{rel.repo}' recorded twice")
            seen.add((rel.repo, rel.repo_type, rel.version))
        return self

    def pending(self) -> list[Recipe]:
        """Recipes without a release."""
        released = {r.key for r in self.releases}
        return [r for r in self.recipes if r.key not in released]

    def latest_release(self, model_id: str, calibration: str = "default") -> Release | None:
        hits = [r for r in self.releases if r.key == (model_id, calibration)]
        return max(hits, key=lambda r: int(r.version[1:])) if hits else None


def _format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not in the schema; check the spelling)"
        parts.append(f"field '{loc}': {msg}")
    more = len(exc.errors()) - 5
    return f"{source}: " + "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def _boolean_fields(model: type[BaseModel], seen: set | None = None) -> set[str]:
    """Names of the boolean fields of `model` and the models nested in it."""
    seen = set() if seen is None else seen
    names: set[str] = set()
    if model in seen:
        return names
    seen.add(model)
    for name, info in model.model_fields.items():
        if info.annotation is bool:
            names.add(name)
        for sub in getattr(info.annotation, "__args__", ()) + (info.annotation,):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                names |= _boolean_fields(sub, seen)
            elif dataclasses.is_dataclass(sub):  # the recipe's KVFormat (`centered`)
                names |= {f.name for f in dataclasses.fields(sub) if f.type in (bool, "bool")}
    return names


def _refuse_misplaced_booleans(data: Any, source: str, path: str = "") -> None:
    """pydantic would read `true` as 1 for an integer field (`schema_version: true`); only boolean fields
    may hold booleans."""
    allowed = _boolean_fields(ZooManifest)
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, bool) and key not in allowed:
            raise ManifestError(f"{source}: field '{where}': expected a number or text, got the YAML boolean "
                                f"{str(value).lower()}")
        _refuse_misplaced_booleans(value, source, where)


def parse_manifest(text: str, source: str = MANIFEST_FILENAME) -> ZooManifest:
    """Parse and validate manifest text. Raises ManifestError only."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{source}: larger than {MAX_MANIFEST_BYTES} bytes")
    data = safe_load_yaml(text, source)
    if not isinstance(data, dict):
        raise ManifestError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    _refuse_misplaced_booleans(data, source)
    try:
        return ZooManifest.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(_format_validation_error(exc, source)) from None
    except RecursionError:
        raise ManifestError(f"{source}: nested too deeply") from None


def load_manifest(path: str | Path) -> ZooManifest:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the manifest: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path}: not UTF-8 text: {exc}") from None
    return parse_manifest(text, str(path))


def dump_manifest(manifest: ZooManifest) -> str:
    """YAML text of a manifest (plain types only, so it round-trips through parse_manifest)."""
    data = json.loads(manifest.model_dump_json(exclude_defaults=False))
    header = "# The OSCAR rotation zoo. Schema: zoo_manifest.schema.json (oscar-calib zoo schema --write).\n"
    return header + yaml.safe_dump(data, sort_keys=False, allow_unicode=False, width=110)


def write_manifest(manifest: ZooManifest, path: str | Path) -> None:
    """Write atomically (temporary file + rename): a crash never leaves half a manifest."""
    path = Path(path)
    text = dump_manifest(manifest)
    parse_manifest(text, str(path))  # what we write must read back
    _replace_text(path, text)


def append_release(path: str | Path, release: Release) -> ZooManifest:
    """Record `release` in the manifest at `path` by editing the file round-trip (ruamel.yaml): comments,
    key order, quoting and unexpanded defaults of everything else stay as the user wrote them. What is
    written must parse strictly and equal the old manifest plus `release`; the swap is atomic."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedSeq
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString

    path = Path(path)
    before = load_manifest(path)
    rt = YAML(typ="rt")
    rt.preserve_quotes = True
    rt.width = 110
    rt.indent(mapping=2, sequence=4, offset=2)
    doc = rt.load(path.read_text(encoding="utf-8"))
    entry = json.loads(release.model_dump_json())
    if entry["repo_type"] == "model":  # the default stays unwritten, as in the releases recorded before it existed
        del entry["repo_type"]
    for key in ("model_revision", "commit"):  # hex that YAML could read as a number: always quoted
        entry[key] = DoubleQuotedScalarString(entry[key])
    for file in entry["files"]:
        file["sha256"] = DoubleQuotedScalarString(file["sha256"])
    releases = doc.get("releases")
    if releases is None or (not releases and getattr(releases, "fa", None) is not None and releases.fa.flow_style()):
        releases = CommentedSeq()  # `releases: []` becomes a block list
        doc["releases"] = releases
    releases.append(entry)
    buffer = io.StringIO()
    rt.dump(doc, buffer)
    text = buffer.getvalue()
    after = parse_manifest(text, str(path))
    expected = ZooManifest(schema_version=before.schema_version, repo=before.repo, repo_type=before.repo_type,
                           recipes=before.recipes, releases=[*before.releases, release])
    if after != expected:
        raise ManifestError(f"{path}: editing the manifest in place changed more than the new release; "
                            "nothing was written")
    _replace_text(path, text)
    return after


def _replace_text(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path` and rename it over `path` (runtime_kernels.atomic: the
    temporary is made with O_EXCL under a random name, so nothing planted is written through); a full disk is one
    DiskFullError naming the path and the bytes (the temporary file is removed, the manifest unchanged)."""
    from runtime_kernels.atomic import write_file_atomically

    write_file_atomically(path, text.encode("utf-8"), "manifest")


def json_schema() -> str:
    """The JSON Schema of the manifest, as committed in zoo_manifest.schema.json."""
    schema = ZooManifest.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "OSCAR rotation zoo manifest"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"
