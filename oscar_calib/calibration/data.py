"""Calibration text -> packed token sequences `[N, seq_len]`.

Sources: a Hub dataset (streamed, pinned revision, shuffled with the seed before taking samples),
or a local `.jsonl` (one JSON object per line with the text column, or a `messages` list) or `.txt`
(documents separated by blank lines). Short texts are packed: documents are tokenized, joined with
EOS, and cut into full `seq_len` sequences, so no padding is ever seen by the statistics.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from oscar_calib.config import DataConfig
from oscar_calib.errors import InputError


@dataclass
class PackedData:
    """Token sequences for statistics (`input_ids [samples, T]`) and held-out clip fitting (`holdout_ids`)."""

    input_ids: torch.Tensor
    holdout_ids: torch.Tensor
    documents: int
    tokens_available: int
    source: str


def _refuse_binary(path: Path) -> None:
    """A text dataset holds no NUL bytes; one that does is a binary file given by mistake (checked on the first 64 KiB)."""
    with path.open("rb") as handle:
        head = handle.read(1 << 16)
    if b"\0" in head:
        raise InputError(f"dataset '{path}': looks like a binary file (NUL byte at offset {head.index(0)}); expected "
                         f"UTF-8 text ({'one JSON object per line' if path.suffix != '.txt' else 'plain text'})")


def _local_texts(path: Path, cfg: DataConfig) -> Iterator[str | list]:
    if path.suffix in (".txt", ".jsonl", ".json"):
        _refuse_binary(path)
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8", errors="replace")
        for doc in text.split("\n\n"):
            if doc.strip():
                yield doc
        return
    if path.suffix in (".jsonl", ".json"):
        with path.open("rb") as handle:
            for lineno, raw in enumerate(handle, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InputError(f"dataset '{path}': line {lineno} is not UTF-8 text (byte {exc.start}); expected "
                                     "one JSON object per line") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as exc:
                    raise InputError(f"dataset '{path}': line {lineno} is not valid JSON "
                                     f"({getattr(exc, 'msg', type(exc).__name__)})") from None
                except ValueError as exc:  # e.g. an integer of more digits than int() converts
                    raise InputError(f"dataset '{path}': line {lineno} is not usable JSON ({exc})") from None
                yield _text_of(row, cfg, f"dataset '{path}' line {lineno}")
        return
    raise InputError(f"dataset '{path}': expected a .jsonl or .txt file, or a Hub dataset id")


def _text_of(row: dict, cfg: DataConfig, where: str) -> str | list:
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object with a '{cfg.text_column}' field")
    if cfg.chat_template and isinstance(row.get("messages"), list):
        return row["messages"]
    if cfg.text_column not in row:
        raise InputError(f"{where}: no text column '{cfg.text_column}' (columns: {sorted(row)}); "
                         "pass --text-column")
    value = row[cfg.text_column]
    if not isinstance(value, str):
        raise InputError(f"{where}: column '{cfg.text_column}' must hold strings, got {type(value).__name__}")
    return value


def _hub_texts(cfg: DataConfig) -> Iterator[str | list]:
    try:
        import datasets
    except ImportError:
        from oscar_calib.errors import MissingDependencyError

        kind = "the local dataset folder" if Path(cfg.dataset).is_dir() else "the Hub dataset"
        raise MissingDependencyError(f"--dataset: reading {kind} '{cfg.dataset}' needs the 'datasets' package, which "
                                     "is not installed; install it with `pip install 'oscar-calib[data]'`") from None
    try:
        stream = datasets.load_dataset(cfg.dataset, cfg.dataset_config, revision=cfg.dataset_revision,
                                       split=cfg.split, streaming=True)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for a missing dataset
        raise InputError(f"dataset '{cfg.dataset}' (revision {cfg.dataset_revision or 'main'}, split '{cfg.split}'): "
                         f"cannot be loaded: {type(exc).__name__}: {exc}") from exc
    features = getattr(stream, "features", None)
    if features is not None and cfg.text_column not in features and not (cfg.chat_template and "messages" in features):
        raise InputError(f"dataset '{cfg.dataset}': no text column '{cfg.text_column}' "
                         f"(columns: {sorted(features)}); pass --text-column")
    stream = stream.shuffle(seed=cfg.seed, buffer_size=cfg.shuffle_buffer)
    for row in stream:
        yield _text_of(row, cfg, f"dataset '{cfg.dataset}'")


def iter_texts(cfg: DataConfig, default_path: Path | None = None) -> Iterator[str | list]:
    """Texts (or chat message lists) from the configured source, shuffled with the seed.

    A local file is read whole and shuffled; anything else (a Hub id, or a local dataset folder) goes through
    `datasets` in streaming mode with a shuffle buffer.
    """
    if cfg.dataset is None:
        if default_path is None:
            raise InputError("no --dataset given and no demo text is available")
        path = default_path
    else:
        path = Path(cfg.dataset)
    if cfg.dataset is None or path.is_file() or path.suffix in (".txt", ".jsonl", ".json"):
        if not path.is_file():
            raise InputError(f"dataset '{path}': file not found")
        docs = list(_local_texts(path, cfg))
        random.Random(cfg.seed).shuffle(docs)  # shuffle with the seed before taking samples
        yield from docs
    else:
        yield from _hub_texts(cfg)


def _encode(tokenizer, doc: str | list, chat_template: bool) -> list[int]:
    if chat_template:
        if getattr(tokenizer, "chat_template", None) is None:
            raise InputError("--chat-template was given but the tokenizer has no chat template")
        messages = doc if isinstance(doc, list) else [{"role": "user", "content": doc}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(doc, add_special_tokens=False)["input_ids"]


def pack_documents(token_lists: Iterable[list[int]], seq_len: int, needed: int, eos_id: int | None,
                   bos_id: int | None = None) -> tuple[torch.Tensor, int, int]:
    """Concatenate documents (EOS between them) and cut `needed` full sequences of `seq_len` tokens.

    Returns (ids `[needed, seq_len]` int64, documents used, tokens collected). Stops reading once enough.
    """
    buffer: list[int] = []
    docs = 0
    total = needed * seq_len
    for ids in token_lists:
        if bos_id is not None and (not ids or ids[0] != bos_id):
            ids = [bos_id, *ids]
        buffer.extend(ids)
        if eos_id is not None:
            buffer.append(eos_id)
        docs += 1
        if len(buffer) >= total:
            break
    if len(buffer) < total:
        return torch.tensor(buffer[: (len(buffer) // seq_len) * seq_len], dtype=torch.int64).reshape(-1, seq_len), docs, len(buffer)
    return torch.tensor(buffer[:total], dtype=torch.int64).reshape(needed, seq_len), docs, len(buffer)


def load_calibration_data(cfg: DataConfig, tokenizer, default_path: Path | None = None,
                          source_name: str | None = None) -> PackedData:
    """Tokenize and pack `cfg.samples` sequences of `seq_len` tokens, then `cfg.holdout_samples` held-out sequences
    of `holdout_len` (default `seq_len`) tokens, cut from one stream of documents (the held-out ones come last).

    Raises InputError if the source has fewer tokens than `samples x seq_len + holdout x holdout_len`.
    """
    held_len = cfg.holdout_len or cfg.seq_len
    stats_tokens, held_tokens = cfg.samples * cfg.seq_len, cfg.holdout_samples * held_len
    eos = getattr(tokenizer, "eos_token_id", None)
    token_lists = (_encode(tokenizer, doc, cfg.chat_template) for doc in iter_texts(cfg, default_path))
    flat, docs, tokens = pack_documents(token_lists, stats_tokens + held_tokens, 1, eos)
    source = source_name or cfg.dataset or str(default_path)
    if flat.shape[0] < 1:
        raise InputError(
            f"dataset '{source}': only {tokens} tokens available, but --samples {cfg.samples} x --seq-len "
            f"{cfg.seq_len} (+{cfg.holdout_samples} held out x --holdout-len {held_len}) needs "
            f"{stats_tokens + held_tokens}; lower --samples, --seq-len or --holdout-len")
    flat = flat[0]
    return PackedData(flat[:stats_tokens].reshape(cfg.samples, cfg.seq_len),
                      flat[stats_tokens:].reshape(cfg.holdout_samples, held_len), docs, tokens, source)
