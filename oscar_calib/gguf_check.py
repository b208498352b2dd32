"""A GGUF file's metadata checked against its own tensors, before transformers builds anything from it.

transformers builds the model from the metadata (`<arch>.block_count` blocks of `<arch>.attention.head_count`
heads ...) and then fills it from the tensors; whatever the file lacks is randomly initialised and a block count
of 1,000 over tensors for 2 builds and initialises 1,000 blocks (minutes, then a model that is mostly noise).
Here the header alone is read (`gguf.GGUFReader` memory-maps the file; ~20 ms for a small model, well under a
second for a 100 MB one) and every field that shapes the model is compared with the tensors that are really there:

- the blocks the tensors name (`blk.N.*`) are exactly 0 .. block_count - 1;
- every block holds its attention projections (`attn_q`, `attn_k`, `attn_v` or the fused `attn_qkv`, and
  `attn_output`) and every attention tensor (norms included) that another block holds; the file holds `token_embd`;
- embedding length, head counts, key/value lengths and vocabulary size agree with those tensors' shapes;
- context length and the counts lie in bounds no real model leaves.

A lie is an `InputError` (exit 2) naming the file and the field. The rest of the architecture's weights are
checked after loading, from transformers' own list of missing keys (`oscar_calib.loading.load_model`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from oscar_calib.errors import InputError

MAX_BLOCKS = 4096
MAX_HEADS = 4096
MAX_EMBEDDING = 1 << 20
MAX_HEAD_DIM = 4096
MAX_CONTEXT = 1 << 24  # 16 M tokens: above every released context window (10 M at most)
MAX_VOCAB = 1 << 24

_ATTENTION_KINDS = frozenset({"attn_norm", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "attn_q_norm",
                              "attn_k_norm"})
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class GGUFGeometry:
    """What the checked header says: the architecture and the fields that shape the model."""

    architecture: str
    block_count: int
    head_count: int
    head_count_kv: int
    embedding_length: int
    key_length: int
    value_length: int
    context_length: int


def _refuse(path: Path, field: str, text: str, what: str = "field") -> InputError:
    return InputError(f"--model {path}: GGUF {what} '{field}': {text}; the file's metadata does not describe its "
                      "tensors (a damaged or forged file), nothing was loaded")


class _Header:
    """The parsed header: typed access to the metadata fields, by name."""

    def __init__(self, path: Path, reader):
        self.path, self.reader = path, reader

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def value(self, key: str):
        try:
            return self.reader.fields[key].contents()
        except Exception as exc:  # noqa: BLE001 - a damaged value (bad UTF-8, a type code gguf cannot read)
            raise _refuse(self.path, key, f"cannot be read ({type(exc).__name__})") from exc

    def string(self, key: str) -> str:
        if not self.has(key):
            raise _refuse(self.path, key, "missing (expected the model's architecture name)")
        value = self.value(key)
        if not isinstance(value, str) or not value or len(value) > 64:
            raise _refuse(self.path, key, f"expected a short string, got {str(value)[:40]!r}")
        return value

    def integer(self, key: str, low: int, high: int, default: int | None = None) -> int:
        """A scalar integer in [low, high]; `default` when the field is absent (None: the field is required)."""
        if not self.has(key):
            if default is None:
                raise _refuse(self.path, key, f"missing (expected an integer in [{low}, {high}])")
            value = default
        else:
            value = self.value(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _refuse(self.path, key, f"expected one integer in [{low}, {high}], got {str(value)[:40]}")
        if not low <= value <= high:
            raise _refuse(self.path, key, f"expected an integer in [{low}, {high}], got {value}")
        return value


def _open(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - a damaged header raises ValueError, IndexError, KeyError, ...
        reason = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise InputError(f"--model {path}: not a readable GGUF file ({type(exc).__name__}: {reason}); expected a "
                         "GGUF v2/v3 model file") from exc


def _shape(tensor) -> tuple[int, ...]:
    """A tensor's dimensions in GGUF's order (ne[0] first: the row length, e.g. the embedding width)."""
    return tuple(int(n) for n in tensor.shape)


def _geometry(path: Path, header: _Header) -> GGUFGeometry:
    arch = header.string("general.architecture")
    blocks = header.integer(f"{arch}.block_count", 1, MAX_BLOCKS)
    heads = header.integer(f"{arch}.attention.head_count", 1, MAX_HEADS)
    kv_heads = header.integer(f"{arch}.attention.head_count_kv", 1, heads, default=heads)
    if heads % kv_heads:
        raise _refuse(path, f"{arch}.attention.head_count_kv",
                      f"{kv_heads} does not divide {arch}.attention.head_count = {heads}")
    embedding = header.integer(f"{arch}.embedding_length", 1, MAX_EMBEDDING)
    key_length = header.integer(f"{arch}.attention.key_length", 1, MAX_HEAD_DIM,
                                default=max(1, embedding // heads))
    value_length = header.integer(f"{arch}.attention.value_length", 1, MAX_HEAD_DIM, default=key_length)
    context = header.integer(f"{arch}.context_length", 1, MAX_CONTEXT)
    rope = header.integer(f"{arch}.rope.dimension_count", 0, MAX_HEAD_DIM, default=0)
    if rope > key_length:  # rotary dimensions live inside one head: a head count that splits heads too thin
        field = f"{arch}.attention.key_length" if header.has(f"{arch}.attention.key_length") else \
            f"{arch}.attention.head_count"
        raise _refuse(path, field, f"gives heads of {key_length} dimensions, fewer than "
                                   f"{arch}.rope.dimension_count = {rope} (rotary dimensions lie inside one head)")
    return GGUFGeometry(arch, blocks, heads, kv_heads, embedding, key_length, value_length, context)


def _check_blocks(path: Path, geo: GGUFGeometry, kinds: dict[int, dict[str, tuple[int, ...]]]) -> None:
    field = f"{geo.architecture}.block_count"
    found = sorted(kinds)
    if found != list(range(geo.block_count)):
        held = f"blocks {found[0]}-{found[-1]} ({len(found)} blocks)" if found else "no block tensors"
        missing = sorted(set(range(geo.block_count)) - set(found))[:3]
        detail = f", block {missing[0]} has none" if missing and len(found) < geo.block_count else ""
        raise _refuse(path, field, f"says {geo.block_count} blocks, but the tensors are those of {held}{detail}")


def _expect(path: Path, geo: GGUFGeometry, name: str, got: tuple[int, ...], want: tuple[int, ...],
            field: str) -> None:
    if got != want:
        raise _refuse(path, field, f"tensor '{name}' has shape {list(got)}, but the metadata says {list(want)} "
                                   f"(embedding_length {geo.embedding_length}, head_count {geo.head_count}, "
                                   f"head_count_kv {geo.head_count_kv}, key_length {geo.key_length})")


def _missing(path: Path, name: str) -> InputError:
    return _refuse(path, name + ".weight", "missing (every block needs its attention projections)", what="tensor")


def _check_uniform(path: Path, kinds: dict[int, dict[str, tuple[int, ...]]]) -> None:
    """Every block holds the attention tensors (norms included) that any block holds: a block of a dense decoder
    never lacks one (the feed-forward part may differ between blocks, e.g. dense and expert blocks)."""
    present = {kind for shapes in kinds.values() for kind in shapes if kind in _ATTENTION_KINDS}
    for index in sorted(kinds):
        for kind in sorted(present - set(kinds[index])):
            raise _refuse(path, f"blk.{index}.{kind}.weight", "missing, though other blocks hold theirs (every "
                                                              "block of the architecture needs it)", what="tensor")


def _check_attention(path: Path, geo: GGUFGeometry, block: int, shapes: dict[str, tuple[int, ...]]) -> None:
    a, d = geo.architecture, geo.embedding_length
    q_width, k_width, v_width = (geo.head_count * geo.key_length, geo.head_count_kv * geo.key_length,
                                 geo.head_count_kv * geo.value_length)
    prefix = f"blk.{block}."
    if "attn_qkv" in shapes:
        _expect(path, geo, prefix + "attn_qkv.weight", shapes["attn_qkv"], (d, q_width + k_width + v_width),
                f"{a}.attention.head_count")
    else:
        for kind in ("attn_q", "attn_k", "attn_v"):
            if kind not in shapes:
                raise _missing(path, prefix + kind)
        _expect(path, geo, prefix + "attn_q.weight", shapes["attn_q"], (d, q_width), f"{a}.attention.head_count")
        _expect(path, geo, prefix + "attn_k.weight", shapes["attn_k"], (d, k_width), f"{a}.attention.head_count_kv")
        _expect(path, geo, prefix + "attn_v.weight", shapes["attn_v"], (d, v_width), f"{a}.attention.head_count_kv")
    for kind in ("attn_q_norm", "attn_k_norm"):  # per-head norms (Qwen3, Gemma3): one weight per head dimension
        if kind in shapes:
            _expect(path, geo, f"{prefix}{kind}.weight", shapes[kind], (geo.key_length,), f"{a}.attention.key_length")
    if "attn_output" not in shapes:
        raise _missing(path, prefix + "attn_output")
    _expect(path, geo, prefix + "attn_output.weight", shapes["attn_output"], (geo.head_count * geo.value_length, d),
            f"{a}.embedding_length")


def _check_embedding(path: Path, geo: GGUFGeometry, header: _Header, top: dict[str, tuple[int, ...]]) -> None:
    a = geo.architecture
    if "token_embd.weight" not in top:
        raise _refuse(path, "token_embd.weight", "missing tensor (every model needs its token embedding)")
    shape = top["token_embd.weight"]
    if len(shape) != 2 or shape[0] != geo.embedding_length:
        raise _refuse(path, f"{a}.embedding_length", f"says {geo.embedding_length}, but tensor 'token_embd.weight' "
                                                     f"has shape {list(shape)} (expected [{geo.embedding_length}, "
                                                     "vocabulary size])")
    rows = shape[1]
    if header.has(f"{a}.vocab_size"):
        vocab = header.integer(f"{a}.vocab_size", 1, MAX_VOCAB)
        if vocab != rows:
            raise _refuse(path, f"{a}.vocab_size", f"says {vocab}, but 'token_embd.weight' has {rows} rows")
    elif header.has("tokenizer.ggml.tokens"):  # transformers takes the vocabulary size from the token list
        tokens = len(header.reader.fields["tokenizer.ggml.tokens"].data)
        if tokens != rows:
            raise _refuse(path, "tokenizer.ggml.tokens", f"lists {tokens} tokens, but 'token_embd.weight' has {rows} "
                                                         "rows (expected one row per token)")
    if "output.weight" in top and top["output.weight"] != shape:
        raise _refuse(path, f"{a}.embedding_length", f"tensor 'output.weight' has shape {list(top['output.weight'])}, "
                                                     f"expected that of 'token_embd.weight' {list(shape)}")


@functools.lru_cache(maxsize=8)
def _checked(path: str, _mtime_ns: int, _size: int) -> GGUFGeometry:
    file = Path(path)
    header = _Header(file, _open(file))
    geo = _geometry(file, header)
    blocks: dict[int, dict[str, tuple[int, ...]]] = {}
    top: dict[str, tuple[int, ...]] = {}
    for tensor in header.reader.tensors:
        match = _BLOCK.match(tensor.name)
        if match is None:
            top[tensor.name] = _shape(tensor)
            continue
        index = int(match.group(1))
        if index >= MAX_BLOCKS:
            raise _refuse(file, f"{geo.architecture}.block_count", f"tensor '{tensor.name}' names block {index}, "
                                                                   f"but the file says {geo.block_count} blocks")
        if match.group(3) == "weight":
            blocks.setdefault(index, {})[match.group(2)] = _shape(tensor)
        else:
            blocks.setdefault(index, {})
    _check_blocks(file, geo, blocks)
    _check_embedding(file, geo, header, top)
    _check_uniform(file, blocks)
    for index in range(geo.block_count):
        _check_attention(file, geo, index, blocks[index])
    return geo


def check_gguf(path: str | Path) -> GGUFGeometry:
    """The geometry of a GGUF file whose metadata its tensors confirm; InputError (exit 2) naming the field
    otherwise. Reads the header only; the result is remembered per (path, mtime, size)."""
    file = Path(path)
    try:
        stat = file.stat()
    except OSError as exc:
        raise InputError(f"--model {path}: cannot read the GGUF file ({exc.strerror})") from exc
    return _checked(str(file), stat.st_mtime_ns, stat.st_size)


__all__ = ["GGUFGeometry", "check_gguf"]
