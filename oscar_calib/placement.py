"""Where the model's layers run: accelerate placement (`--device-map`, `--max-memory`, disk offload) and its report.

The capture needs nothing from this beyond the input device: accelerate's hooks move each layer's inputs to
where its weights are, and the statistics are created on the device the layer's activations are on.
"""

from __future__ import annotations

import json
import re

import torch

from oscar_calib.errors import InputError

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_NAMED_DEVICES = ("cpu", "disk", "mps", "xpu")


def _size_bytes(key: str, size, flag: str) -> int:
    from accelerate.utils import convert_file_size_to_int

    if isinstance(size, str) and size.strip().isdigit():
        size = int(size)  # a bare byte count: accelerate reads only an int as bytes, the command line gives strings
    try:
        value = convert_file_size_to_int(size)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{flag} {key}={size}: expected a size such as 2GiB, 500MB or a number of bytes") from exc
    if value <= 0:
        raise InputError(f"{flag} {key}={size}: the size must be positive")
    return int(value)


def parse_max_memory(values: list[str] | None, flag: str = "--max-memory") -> dict[str, int] | None:
    """`["cpu=2GiB", "0=20GiB"]` or one JSON object `'{"cpu": "2GiB", "0": "20GiB"}'` -> `{"cpu": bytes, "0": bytes}`.

    Keys: a GPU index, or cpu / disk / mps / xpu. Keys stay strings (the config dump is JSON); see
    `accelerate_max_memory` for the form accelerate takes.
    """
    if not values:
        return None
    pairs: list[tuple[str, object]] = []
    for text in values:
        text = text.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InputError(f"{flag} '{text}': not valid JSON ({exc.msg})") from exc
            if not isinstance(obj, dict):
                raise InputError(f"{flag} '{text}': expected a JSON object of device -> size")
            pairs.extend((str(k), v) for k, v in obj.items())
        elif "=" in text:
            key, _, size = text.partition("=")
            pairs.append((key.strip(), size.strip()))
        else:
            raise InputError(f"{flag} '{text}': expected DEVICE=SIZE (e.g. cpu=2GiB, 0=20GiB, disk=100GiB) or JSON")
    out: dict[str, int] = {}
    for key, size in pairs:
        if not (key.isdigit() or key in _NAMED_DEVICES):
            raise InputError(f"{flag} {key}={size}: unknown device '{key}' (expected a GPU index or one of "
                             f"{', '.join(_NAMED_DEVICES)})")
        out[key] = _size_bytes(key, size, flag)
    return out


def accelerate_max_memory(max_memory: dict[str, int] | None) -> dict | None:
    """The form accelerate takes: GPU indices as ints, named devices as strings."""
    if max_memory is None:
        return None
    return {int(k) if k.isdigit() else k: v for k, v in max_memory.items()}


def input_device(model: torch.nn.Module) -> torch.device:
    """Where token ids go: the first placed module's device (accelerate moves them on from there).

    A model offloaded to disk has meta parameters, so its parameters cannot say where it runs.
    """
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        first = next(iter(device_map.values()))
        if isinstance(first, int):
            return torch.device("cuda", first)
        return torch.device("cpu" if first in ("cpu", "disk") else first)
    return next(model.parameters()).device


def _layer_index(module_name: str) -> int | None:
    match = re.search(r"\.layers\.(\d+)$", module_name) or re.search(r"\.layers\.(\d+)\.", module_name)
    return int(match.group(1)) if match else None


def placement_summary(model: torch.nn.Module) -> dict[str, str] | None:
    """Which modules sit where (`hf_device_map`, devices as strings), or None for a model on one device."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return None
    return {name: (f"cuda:{dev}" if isinstance(dev, int) else str(dev)) for name, dev in device_map.items()}


def describe_placement(summary: dict[str, str]) -> str:
    """One line per device: which decoder layers (as ranges) and other modules it holds."""
    by_device: dict[str, tuple[list[int], list[str]]] = {}
    for name, dev in summary.items():
        layers, others = by_device.setdefault(dev, ([], []))
        idx = _layer_index(name)
        if idx is None:
            others.append(name or "(whole model)")
        else:
            layers.append(idx)
    lines = []
    for dev, (layers, others) in by_device.items():
        parts = []
        if layers:
            layers.sort()
            runs, start, prev = [], layers[0], layers[0]
            for cur in [*layers[1:], None]:
                if cur is not None and cur == prev + 1:
                    prev = cur
                    continue
                runs.append(str(start) if start == prev else f"{start}-{prev}")
                start = prev = cur
            parts.append(f"layers {','.join(runs)}")
        parts.extend(others)
        lines.append(f"{dev}: {'; '.join(parts)}")
    return "\n".join(lines)
