"""KVFormat: the one value for the encoding of the INT2 history.

Its rules are checked against what the runtime really does (the bytes a `PagedKVCache` allocates, the positions it
demotes), its record against the artifact round trip and the contract's refusals, and the product tree against
stray window / scale-format defaults (so the "one default" rule cannot regress).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
from format_helpers import PAPER, restamp
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_kernels.artifact import ArtifactError, identity_artifact, read_artifact, write_artifact
from runtime_kernels.cache import PagedKVCache
from runtime_kernels.contract import V1_TENSOR_NAMES, parse_metadata
from runtime_kernels.format import DEFAULT_FORMAT, MAX_WINDOW_TOKENS, KVFormat, KVFormatError

ROOT = Path(__file__).resolve().parents[1]

formats = st.builds(
    KVFormat, sink_tokens=st.integers(0, 40), recent_tokens=st.integers(0, 40), page_size=st.integers(1, 16),
    group_size=st.sampled_from([None, 4, 8, 16]), scale_format=st.sampled_from(["float16", "ue5m3"]),
    quantizer=st.sampled_from(["uniform_minmax", "uniform_unbiased"]), centered=st.booleans())


def _cache(fmt: KVFormat, d: int = 16, h: int = 2, layers: int = 1, pages: int = 8) -> PagedKVCache:
    art = identity_artifact(layers, h, 2 * h, d, fmt=PAPER)
    means = torch.zeros(layers, h, d) if fmt.centered else None
    return PagedKVCache(art.k_rotation, art.v_rotation, art.k_clip_ratio, art.v_clip_ratio, fmt=fmt, max_pages=pages,
                        max_seqs=1, dtype=torch.bfloat16, backend="torch", k_mean=means, v_mean=means)


# --- what a token costs, against a real cache ---------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(fmt=formats)
def test_bytes_per_token_is_what_a_cache_page_holds(fmt):
    """The pool bytes of one INT2 page, divided by its (token, KV head) cells, are `bytes_per_token`."""
    d, h, pages = 16, 2, 3
    cache = _cache(fmt, d=d, h=h, pages=pages)
    pool = cache.pools[0]
    page_bytes = sum(t.numel() * t.element_size()
                     for t in (pool.k_codes, pool.v_codes, pool.k_scale, pool.k_zero, pool.v_scale, pool.v_zero))
    assert page_bytes == pages * h * fmt.page_size * fmt.bytes_per_token(d)
    assert fmt.history_bits(d) == pytest.approx(8 * fmt.bytes_per_token(d) / (2 * d), rel=1e-12)


@pytest.mark.parametrize("fmt", [PAPER, DEFAULT_FORMAT, PAPER.with_(group_size=32, scale_format="ue5m3")],
                         ids=["paper", "recipe", "g32-ue5m3"])
@pytest.mark.parametrize("context", [100, 1500, 5000])
def test_bits_per_element_counts_the_bytes_a_per_token_cache_stores(fmt, context):
    """A cache with one-token pages (the formula counts the history per token) holds `context` tokens of a
    sequence in BF16 windows and INT2 rows; their bits per element are `bits_per_element`."""
    d = 128
    fmt1 = fmt.per_token()
    cache = _cache(fmt1, d=d, h=1, pages=context)
    sid = cache.add_sequence()
    cache.plan_append([sid], [context])  # books the segments as a prompt of `context` tokens would
    hist = cache.hist_len(sid)
    win_bits = 8 * cache.pools[0].k_win.element_size()  # bf16 windows: 16 bits per element
    int2_bits = 8 * fmt1.bytes_per_token(d)  # per token: K and V of one KV head
    stored = hist * int2_bits + (context - hist) * 2 * d * win_bits
    assert fmt.bits_per_element(context, d) == pytest.approx(stored / (context * 2 * d), rel=1e-12)


def test_published_numbers():
    """OSCAR_METHOD section 5 (fp16 scales, 64/256) and the recipe's equal-bits claim (ue5m3, 128/1024)."""
    assert round(PAPER.bits_per_element(131072, 128), 2) == 2.28
    assert DEFAULT_FORMAT.history_bits(128) == 2.125
    assert round(DEFAULT_FORMAT.bits_per_element(131072, 128), 3) == 2.247
    assert (PAPER.bytes_per_token(128), DEFAULT_FORMAT.bytes_per_token(128)) == (72, 68)  # the vLLM cell sizes


# --- which positions are history, against a real cache --------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(fmt=formats, n=st.integers(0, 120))
def test_is_history_is_where_the_cache_demotes(fmt, n):
    cache = _cache(fmt, pages=128)
    sid = cache.add_sequence()
    if n:
        cache.plan_append([sid], [n])
    hist = cache.hist_len(sid)
    assert fmt.history_tokens(n) == hist
    want = [fmt.sink_tokens <= j < fmt.sink_tokens + hist for j in range(n)]
    assert [bool(fmt.is_history(j, n)) for j in range(n)] == want  # scalar
    got = fmt.is_history(torch.arange(n), torch.tensor(n))  # vectorised: the same rule on tensors
    assert got.tolist() == want


def test_is_history_broadcasts_a_mask():
    fmt = PAPER.with_(sink_tokens=2, recent_tokens=3, page_size=2)
    t = torch.arange(12)
    mask = fmt.is_history(t[None, :], t[:, None] + 1)  # [query, key]: the key's tier when the query is decoded
    for q in range(12):
        for j in range(12):
            assert bool(mask[q, j]) == bool(fmt.is_history(j, q + 1))


# --- the record -------------------------------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(fmt=formats)
def test_record_round_trips_through_json(fmt):
    record = json.loads(json.dumps(fmt.to_record()))
    assert record["record_version"] == 1
    assert KVFormat.from_record(record) == fmt


@pytest.mark.parametrize("fmt", [PAPER.with_(sink_tokens=8, recent_tokens=24, page_size=16),
                                 DEFAULT_FORMAT.with_(group_size=32, quantizer="uniform_unbiased")])
def test_an_artifact_records_its_format_and_reads_it_back(tmp_path, fmt):
    art = identity_artifact(2, 2, 4, 64, fmt=fmt)
    assert art.kv_format == fmt.resolved(64).with_(centered=False)  # identity: zero means, so uncentered
    art.k_mean = torch.full((2, 2, 64), 0.5)
    restamp(art)
    back = read_artifact(write_artifact(art, tmp_path))
    assert back.kv_format == fmt.resolved(64).with_(centered=True)
    assert json.loads(back.metadata["kv_format"]) == back.kv_format.to_record()
    assert (back.metadata["sink_tokens"], back.metadata["scale_dtype"]) == (str(fmt.sink_tokens), fmt.scale_format)


def test_v1_and_pre_record_artifacts_map_to_their_own_explicit_format(tmp_path):
    """Without a record: the windows and group the metadata names, v1's fp16 min-max (v1) or the separate keys (v2),
    64-token pages, centering from the means. Not the recipe's default."""
    art = identity_artifact(2, 2, 4, 64, fmt=PAPER.with_(sink_tokens=32, recent_tokens=96, group_size=32))
    meta = {k: v for k, v in art.metadata.items() if k not in ("mean_basis", "quantizer", "scale_dtype", "kv_format")}
    meta["schema_version"] = "1"
    from safetensors.torch import save_file

    (tmp_path / "v1").mkdir()
    save_file({n: getattr(art, n).contiguous() for n in V1_TENSOR_NAMES}, str(tmp_path / "v1" / "oscar_kv.safetensors"),
              metadata=meta)
    want = KVFormat(sink_tokens=32, recent_tokens=96, page_size=64, group_size=32, scale_format="float16",
                    quantizer="uniform_minmax", centered=False)
    assert read_artifact(tmp_path / "v1").kv_format == want
    v2 = identity_artifact(2, 2, 4, 64, fmt=DEFAULT_FORMAT.with_(sink_tokens=16, page_size=8))
    del v2.metadata["kv_format"]  # an artifact written before the record
    assert v2.kv_format == DEFAULT_FORMAT.with_(sink_tokens=16, group_size=64, centered=False)  # page: 64


# --- refusals name the field ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("sink_tokens", -1), ("recent_tokens", MAX_WINDOW_TOKENS + 1), ("sink_tokens", True), ("sink_tokens", 1.0),
    ("page_size", 0), ("group_size", 6), ("group_size", 0), ("scale_format", "bfloat16"), ("quantizer", "lloyd_max"),
    ("centered", 1)])
def test_bad_fields_are_refused_naming_them(field, value):
    with pytest.raises(KVFormatError, match=rf"KVFormat\.{field}: expected") as info:
        PAPER.with_(**{field: value})
    assert info.value.field == field


def test_records_are_refused_naming_the_entry():
    good = PAPER.to_record()
    with pytest.raises(KVFormatError, match=r"KVFormat\.page_size: missing"):
        KVFormat.from_record({k: v for k, v in good.items() if k != "page_size"})
    with pytest.raises(KVFormatError, match=r"KVFormat\.window: unknown record entry"):
        KVFormat.from_record({**good, "window": 3})
    with pytest.raises(KVFormatError, match=r"KVFormat\.record_version: expected 1"):
        KVFormat.from_record({**good, "record_version": 2})
    with pytest.raises(KVFormatError, match=r"KVFormat\.record: expected a JSON object"):
        KVFormat.from_record([good])


@pytest.mark.parametrize("change,field,expected", [
    ({"sink_tokens": 65}, "kv_format", "entry 'sink_tokens' is 65 but field 'sink_tokens' says 64"),
    ({"scale_format": "ue5m3"}, "kv_format", "entry 'scale_format' is 'ue5m3' but field 'scale_dtype' says"),
    ({"centered": True}, "kv_format", "entry 'centered' is True but the artifact's k_mean/v_mean are all zero"),
    ({"page_size": 0}, "kv_format", "entry 'page_size'"),
])
def test_an_artifact_whose_record_disagrees_is_refused(tmp_path, change, field, expected):
    art = identity_artifact(1, 2, 4, 16, fmt=PAPER)
    record = {**json.loads(art.metadata["kv_format"]), **change}
    art.metadata["kv_format"] = json.dumps(record)
    with pytest.raises(ArtifactError, match=f"field '{field}'") as info:
        art.validate()
    assert expected in str(info.value)


def test_a_v1_file_may_not_carry_the_v2_record():
    art = identity_artifact(1, 2, 4, 16, fmt=PAPER)
    meta = {**art.metadata, "schema_version": "1"}
    with pytest.raises(ArtifactError, match="field 'kv_format': is a contract v2 field"):
        parse_metadata({k: v for k, v in meta.items() if k not in ("mean_basis", "quantizer", "scale_dtype")}, "f")


def test_the_cache_serves_an_artifact_only_in_its_own_format_but_the_page():
    art = identity_artifact(1, 2, 4, 16, fmt=PAPER)
    art.metadata["key_target"] = "query_moment"  # as calibration writes it: its clips hold for its windows
    assert PagedKVCache.from_artifact(art, max_pages=1, max_seqs=1).fmt == art.kv_format
    assert PagedKVCache.from_artifact(art, max_pages=1, max_seqs=1, fmt=art.kv_format.with_(page_size=8)).page_size == 8
    for change in ({"recent_tokens": 8}, {"quantizer": "uniform_unbiased"}, {"group_size": 8}):
        name = next(iter(change))
        with pytest.raises(ValueError, match=f"{name}=.* disagrees with the artifact's {name}="):
            PagedKVCache.from_artifact(art, max_pages=1, max_seqs=1, fmt=art.kv_format.with_(**change))


# --- one default in the product tree ------------------------------------------------------------------------------
PRODUCT = ("oscar_calib", "runtime_kernels")
# The whole product tree, kernel primitives included: a primitive takes the scale format and quantizer as required
# keywords (its caller holds the KVFormat), so a bare call cannot silently pick fp16 min-max.
FORMAT_NAMES = re.compile(r"(sink|recent|page_size|scale_format|scale_dtype|quantizer|group_size)")
# A flag default that is not the format's: the teacher-forced evaluation's history granularity (1 = per token).
ALLOWED = {("oscar_calib/cli/eval_cmd.py", "page_size")}


def _product_files():
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            yield rel, ast.parse(path.read_text(encoding="utf-8"))


def _is_literal(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, str)) and not isinstance(node.value, bool)


def test_no_window_or_scale_defaults_outside_the_format():
    """No argument or field named for a format property defaults to a literal (write `fmt: KVFormat`, or read
    DEFAULT_FORMAT); the retired layout names are gone."""
    stray = []
    for rel, tree in _product_files():
        if rel == "runtime_kernels/format.py":
            continue
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                pos = a.posonlyargs + a.args
                pairs += list(zip(pos[len(pos) - len(a.defaults):], a.defaults))
                pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                pairs = [(arg.arg, d) for arg, d in pairs]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                pairs = [(node.target.id, node.value)]
            for name, default in pairs:
                if FORMAT_NAMES.search(name) and _is_literal(default) and (rel, name) not in ALLOWED:
                    stray.append(f"{rel}:{default.lineno}: {name} = {default.value!r}")
            if isinstance(node, ast.Name) and node.id in ("DEFAULT_LAYOUT", "RECIPE_LAYOUT", "CacheLayout"):
                stray.append(f"{rel}:{node.lineno}: {node.id}")
    assert not stray, "format defaults outside runtime_kernels/format.py:\n" + "\n".join(stray)


def test_literal_windows_are_written_once():
    """Only DEFAULT_FORMAT spells windows or a page size as numbers; every other KVFormat is built from a value."""
    literal = []
    for rel, tree in _product_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "KVFormat", "with_"):
                for kw in node.keywords:
                    if kw.arg in ("sink_tokens", "recent_tokens", "page_size") and _is_literal(kw.value):
                        literal.append(f"{rel}:{node.lineno}: {kw.arg}={kw.value.value}")
    assert literal == ["runtime_kernels/format.py:"
                       f"{_default_line()}: {k}" for k in ("sink_tokens=128", "recent_tokens=1024", "page_size=64")]


def _default_line() -> int:
    text = (ROOT / "runtime_kernels" / "format.py").read_text(encoding="utf-8")
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("DEFAULT_FORMAT = KVFormat("))


def test_the_run_help_prints_the_default_from_the_value():
    from oscar_calib.cli.options import RecentOpt, SinkOpt

    helps = [opt.__metadata__[0].help for opt in (SinkOpt, RecentOpt)]
    assert str(DEFAULT_FORMAT.sink_tokens) in helps[0] and str(DEFAULT_FORMAT.recent_tokens) in helps[1]
    for rel, _ in _product_files():
        text = (ROOT / rel).read_text(encoding="utf-8")
        assert "128 / 1024" not in text and "default 1024" not in text, rel
