"""Model card (`README.md`) of a calibration artifact: what was calibrated, how, and the headline numbers.

The metadata block is built with `huggingface_hub.ModelCardData`, so a Hub page understands it
(`base_model`, `library_name`, `tags`, `datasets`) and `huggingface_hub.ModelCard.load` reads it back.
"""

from __future__ import annotations

import json

from runtime_kernels.artifact import OscarArtifact

CARD_TAGS = ("oscar-kv", "kv-cache-quantization", "int2")


def card_metadata(model_id: str, dataset: str | None = None):
    """`ModelCardData` of an OSCAR artifact: its base model, our library and tags, the Hub dataset if any."""
    from huggingface_hub import ModelCardData

    local = dataset is None or dataset.endswith((".txt", ".jsonl")) or dataset.count("/") > 1
    return ModelCardData(base_model=model_id, library_name="oscar-calib", tags=list(CARD_TAGS),
                         datasets=None if local else [dataset])


def with_metadata(data, body: str) -> str:
    """`body` (Markdown) under the YAML front matter of `data`, through `huggingface_hub.ModelCard`."""
    from huggingface_hub import ModelCard

    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body.lstrip()}"))


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _why_the_default(alternatives: dict, granularity: str, value_target: str) -> str:
    """A sentence for the reader who sees an alternative with a lower error than the default in the table above."""
    default = f"{granularity}/{value_target}"
    mine = alternatives.get(default)
    lower = []
    if mine is not None:
        for kind, label in (("key", "key"), ("value", "value")):
            best = min(alternatives, key=lambda n: alternatives[n][kind])
            if best != default and alternatives[best][kind] < mine[kind]:
                lower.append(f"`{best}` has the lower {label} error")
    seen = f"Here {' and '.join(lower)} than the default `{default}`. " if lower else ""
    return (f"{seen}Why the default anyway: each column is one error on one held-out calibration sequence, a "
            "metric at a time, and differences of this size are within the noise of one sequence. The default was "
            "chosen on held-out perplexity and far-token retrieval over 16 windows of two models, where per head "
            "and per layer tie within their intervals and per head matters more on models with few KV heads "
            "(docs/quality.md, \"Which defaults, and why\"). `oscar-calib eval --artifact DIR` compares rotations end to "
            "end, with confidence intervals.")


def _ranges(ids: list[int], sep: str) -> str:
    """[0, 3, 4, 5, 8] -> '0<sep>3-5<sep>8' (ascending ids)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return sep.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def head_list(heads: dict[int, list[int]]) -> str:
    """{0: [0], 5: [1, 2]} -> '0:0, 5:1-2' (layer:KV heads; for logs and model cards)."""
    return ", ".join(f"{layer}:{_ranges(hs, ',')}" for layer, hs in heads.items())


def key_basis_summary(basis: dict | None, kv_heads: int) -> str:
    """The card's key-basis cell: which KV heads carry Hadamard keys instead of the attention-aware rotation."""
    if not basis:  # an artifact from before the rule, or imported
        return "the attention-aware rotation in every KV head"
    heads = {int(k): v for k, v in basis.get("hadamard_heads", {}).items()}
    tau = basis.get("hadamard_key_mass")
    if not heads:
        why = "`--hadamard-key-mass 1`" if tau is not None and tau >= 1 else \
            f"no head's held-out queries put more than {tau:g} of their attention on the INT2 history"
        return f"the attention-aware rotation in every KV head ({why})"
    n = sum(map(len, heads.values()))
    return (f"Hadamard keys in {n} of {kv_heads} KV heads (layer:heads {head_list(heads)}; held-out INT2-history "
            f"attention above {tau:g}), the attention-aware rotation in the others")


def render_model_card(artifact: OscarArtifact, report, log: dict) -> str:
    """Markdown with YAML front matter (base_model, tags) for the Hub."""
    meta = artifact.metadata
    calib = json.loads(meta["calibration"])
    summary = report.summary()
    k, v = summary["key_error"], summary["value_rel_out_err"]
    fmt = artifact.kv_format  # as served: a reference import's fp32 scales are stored as fp16
    g, sink, recent = fmt.group_size, fmt.sink_tokens, fmt.recent_tokens

    def bits(context: int) -> float:
        return fmt.bits_per_element(context, artifact.head_dim)

    lines = [
        f"# OSCAR 2-bit KV rotations for `{meta['model_id']}`",
        "",
        f"Attention-aware rotations `R = U H P` and fitted clip ratios for INT2 keys and values "
        f"(sink {sink} + recent {recent} tokens in BF16). "
        f"{bits(131072):.3f} bits per KV element at 128K context, {bits(32768):.3f} at 32K.",
        "",
        "## Calibration",
        "",
        "| field | value |",
        "|---|---|",
        *([f"| model revision | `{meta['model_revision']}` |"] if meta.get("model_revision") not in (None, "", "None")
          else []),
        f"| dataset | `{calib.get('dataset')}`"
        f"{f' (revision `{rev}`)' if (rev := calib.get('dataset_revision')) else ''}, split `{calib.get('split')}` |",
        f"| samples x seq_len | {calib.get('samples')} x {calib.get('seq_len')} ({calib.get('tokens')} tokens), "
        f"{calib.get('holdout_samples')} held out |",
        f"| seed | {calib.get('seed')} |",
        f"| granularity | {meta['granularity']} |",
        f"| INT2 encoding | quantizer `{artifact.quantizer}`, scales `{fmt.scale_format}`, groups of {g} |",
        f"| key target | {meta['key_target']} (query second moment of the GQA group) |",
        f"| key basis | {key_basis_summary(calib.get('key_basis'), artifact.k_rotation.shape[:2].numel())} |",
        f"| value target | {meta['value_target']} |",
        f"| group size | {g} |",
        f"| calibrated layers | {len(report.layer_ids)} (skipped: {report.skipped_layers or 'none'}) |",
        f"| tool | {meta['tool_version']}, created {meta['created_at']} |",
        "",
        "## Held-out attention-aware error",
        "",
        "| | fitted clip | global clip (K 0.96 / V 0.92) | no clip |",
        "|---|---|---|---|",
        f"| key {summary['key_objective']} | {_fmt(k['fitted'])} | {_fmt(k['global_0.96'])} | {_fmt(k['no_clip'])} |",
        f"| value relative output error | {_fmt(v['fitted'])} | {_fmt(v['global_0.92'])} | {_fmt(v['no_clip'])} |",
        "",
        f"Mean fitted clip ratios: K {summary['k_clip_ratio_mean']:.3f}, V {summary['v_clip_ratio_mean']:.3f}; "
        f"{summary['clip_at_grid_edge']} (layer, head) fits at the lowest grid ratio.",
        "",
    ]
    if summary.get("alternatives"):
        lines += ["Alternatives on the same held-out tokens (best clip per head):", "",
                  f"| rotation | key {summary['key_objective']} | value output error |", "|---|---|---|"]
        for name, errs in summary["alternatives"].items():
            lines.append(f"| {name} | {_fmt(errs['key'])} | {_fmt(errs['value'])} |")
        lines += ["", _why_the_default(summary["alternatives"], meta["granularity"], meta["value_target"]), ""]
    model_id = meta["model_id"]
    lines += [
        "## Use",
        "",
        "This folder is a local artifact (`oscar-calib run --out DIR` wrote it). Serve it with the runtime from the "
        "oscar-calib source tree (`pip install \"./runtime[hf]\"` in a clone; neither `oscar-kv-runtime` nor "
        "`oscar-calib` is on PyPI), naming the folder by its path:",
        "",
        *transformers_snippet(model_id, "cache = OscarCache.from_pretrained('path/to/DIR', model.config)   "
                              f"# a local copy of the model: model_id={model_id!r}"),
        "",
        "`oscar-calib push DIR --repo ORG/NAME --with-wheels` publishes it as a release whose card says how to "
        "install the runtime and load the release from any folder.",
        "",
    ]
    return with_metadata(card_metadata(meta["model_id"], calib.get("dataset")), "\n".join(lines))


def transformers_snippet(model_id: str, cache_line: str, show_output: bool = False) -> list[str]:
    """The card's Python block: load `model_id` in transformers, build the cache with `cache_line`, generate (and
    print the continuation with `show_output`). One text for the run card and the release card."""
    return ["```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "from runtime_kernels.hf import OscarCache, enable_oscar_attention",
            f"model = AutoModelForCausalLM.from_pretrained({model_id!r})",
            f"tokenizer = AutoTokenizer.from_pretrained({model_id!r})",
            "enable_oscar_attention(model)",
            cache_line,
            "inputs = tokenizer('Hello', return_tensors='pt')",
            "out = model.generate(**inputs, cache=cache, max_new_tokens=64)",
            *(["print(tokenizer.decode(out[0, inputs['input_ids'].shape[1]:]))"] if show_output else []),
            "```"]
