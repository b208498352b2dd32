"""KV formats the tests use, and a helper to retag an artifact in memory.

The product has one default (`runtime_kernels.format.DEFAULT_FORMAT`, the recipe's 128/1024 ue5m3 windows); tests pick
whatever format their shapes need and say so.
"""

from __future__ import annotations

import json

from runtime_kernels.artifact import OscarArtifact
from runtime_kernels.contract import ArtifactError, format_record_json
from runtime_kernels.format import RECORD_KEY, KVFormat

# The paper's 64/256 windows with fp16 scales, min-max INT2, no centering, 64-token pages: the layout most tests were
# written for (and the one v1 artifacts were made with).
PAPER = KVFormat(sink_tokens=64, recent_tokens=256, page_size=64, group_size=None, scale_format="float16",
                 quantizer="uniform_minmax", centered=False)


def restamp(art: OscarArtifact, **metadata: str) -> OscarArtifact:
    """`art` with `metadata` entries set (another quantizer, scale dtype, windows) and its `kv_format` record
    rewritten to what its separate keys and means now say (page size kept); dropped when the quantizer has no KV
    format (lloyd_max). Tests retag artifacts built for one format as another; the contract refuses a stale record."""
    old = art.metadata.pop(RECORD_KEY, None)
    art.metadata.update(metadata)
    try:
        fmt = art.kv_format
    except ArtifactError:
        return art
    if old is not None:
        fmt = fmt.with_(page_size=json.loads(old)["page_size"])
    art.metadata[RECORD_KEY] = format_record_json(fmt)
    return art


def served(art: OscarArtifact, page: int | None = None, sink: int | None = None, recent: int | None = None) -> KVFormat:
    """The artifact's own format with a test's page size and windows (None = the artifact's; the runtime takes other
    windows only for an identity artifact, which fitted nothing)."""
    return art.kv_format.with_(page_size=page, sink_tokens=sink, recent_tokens=recent)


def qfmt(group_size: int | None = None, scale_format: str = "float16", quantizer: str = "uniform_minmax") -> KVFormat:
    """PAPER with another group, scale format or quantizer: the format a quantization test encodes with (the windows
    and pages are not read by `runtime_kernels.quant`)."""
    return PAPER.with_(group_size=group_size, scale_format=scale_format, quantizer=quantizer)
