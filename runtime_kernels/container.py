"""A bounded reader of the safetensors container: every size is checked before anything is parsed or allocated.

The safetensors library accepts headers up to 100 MB, any number of tensors and duplicate JSON keys (the
last one wins). An artifact has at most a dozen tensors and a header of a few KB, so this module refuses,
in order and before reading any tensor data:

1. a file shorter than 8 bytes, a header length over MAX_HEADER_BYTES or past the end of the file;
2. more than MAX_TENSORS entries (counted on the raw bytes first, so a header of tens of thousands of
   junk tensors is refused in microseconds, and again after parsing);
3. a header that is not strict JSON (duplicate keys in the header or in `__metadata__`, NaN, bad UTF-8);
4. entries that are not exactly {dtype, shape, data_offsets} with a known dtype, non-negative dims and
   offsets that tile the data section exactly (no gaps, overlaps or trailing bytes).

Errors are ArtifactError naming the file, the field and what was expected.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from runtime_kernels.contract import ArtifactError, fail, strict_json_loads

MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 16
MAX_TENSOR_ELEMENTS = 1 << 34  # 64 GiB of fp32: far above any artifact, far below an overflow
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
TORCH_DTYPE_NAMES = {"F32": "float32", "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                     "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry: safetensors dtype code (e.g. 'F32'), shape, byte offsets in the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype_name(self) -> str:
        return TORCH_DTYPE_NAMES.get(self.dtype, self.dtype)


@dataclass(frozen=True)
class SafetensorsHeader:
    """The checked header of one file: its tensors (name -> entry) and its `__metadata__`."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def _is_int(value) -> bool:
    return type(value) is int  # bool is a subclass of int; JSON true is not a size


def parse_header(raw: bytes, file_size: int, source: str) -> SafetensorsHeader:
    """Check the bytes of a header (`raw` = the JSON text) against a file of `file_size` bytes."""
    if raw.count(b'"data_offsets"') > MAX_TENSORS:
        fail(source, "<header>", f"more than {MAX_TENSORS} tensors (an artifact has at most a dozen)")
    header = strict_json_loads(raw, source, "<header>")
    if not isinstance(header, dict):
        fail(source, "<header>", f"expected a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        fail(source, "__metadata__", "expected an object of string values")
    if len(header) > MAX_TENSORS:
        fail(source, "<header>", f"{len(header)} tensors, expected at most {MAX_TENSORS}")
    entries: dict[str, TensorEntry] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
            fail(source, name, f"expected a header entry with exactly {sorted(ENTRY_KEYS)}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_BYTES:
            fail(source, name, f"unknown dtype {dtype!r} (expected one of {sorted(DTYPE_BYTES)})")
        if not isinstance(shape, list) or len(shape) > 8 or not all(_is_int(s) and 0 <= s for s in shape):
            fail(source, name, f"expected a shape of at most 8 non-negative integers, got {shape!r:.80}")
        numel = math.prod(shape)
        if numel > MAX_TENSOR_ELEMENTS:
            fail(source, name, f"{numel} elements, expected at most {MAX_TENSOR_ELEMENTS}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            fail(source, name, f"expected data_offsets [begin, end] of integers, got {offsets!r:.80}")
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != numel * DTYPE_BYTES[dtype]:
            fail(source, name, f"data_offsets {offsets} do not hold {numel} x {dtype} "
                               f"({numel * DTYPE_BYTES[dtype]} bytes)")
        entries[name] = TensorEntry(dtype, tuple(shape), begin, end)
    data_bytes = file_size - 8 - len(raw)
    position = 0
    for name, entry in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != position:
            fail(source, name, f"data_offsets start at {entry.begin}, expected {position} (tensors must tile "
                               "the data section without gaps or overlaps)")
        position = entry.end
    if position != data_bytes:
        fail(source, "<data>", f"the tensors cover {position} bytes, the file's data section has {data_bytes}")
    return SafetensorsHeader(entries, dict(metadata))


NOT_AN_ARTIFACT = ("not an OSCAR artifact: not a safetensors file (an artifact is the 'oscar_kv.safetensors' that "
                   "`oscar-calib run --out DIR` writes; pass DIR or that file)")


def read_header(file: str | os.PathLike) -> SafetensorsHeader:
    """Read and check the header of a safetensors file without touching its tensor data."""
    file = Path(file)
    source = str(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                fail(source, "<header>", f"{NOT_AN_ARTIFACT}; its {size} bytes are too short for a safetensors "
                                         "header")
            (n,) = struct.unpack("<Q", prefix)
            # Random or text bytes read as a length: say what the file is before what its bytes say.
            if n > MAX_HEADER_BYTES:
                fail(source, "<header>", f"{NOT_AN_ARTIFACT}; its first 8 bytes give a header of {n} bytes, "
                                         f"expected at most {MAX_HEADER_BYTES}")
            if n > size - 8:
                fail(source, "<header>", f"{NOT_AN_ARTIFACT}; its header length {n} runs past the end of the "
                                         f"{size}-byte file")
            raw = handle.read(n)
            if not raw.lstrip(b" ").startswith(b"{"):
                fail(source, "<header>", f"{NOT_AN_ARTIFACT}; its header is not a JSON object")
    except OSError as exc:
        raise ArtifactError(f"{source}: cannot read: {exc.strerror or exc}") from None
    return parse_header(raw, size, source)


__all__ = ["MAX_HEADER_BYTES", "MAX_TENSORS", "SafetensorsHeader", "TensorEntry", "parse_header", "read_header"]
