#!/usr/bin/env python3
"""Which recipe holds at a real model's own context: every component of the default measured alone and together.

For one model, a calibration text and one or more held-out texts of other sources, this calibrates the recipe's variants from
shared captures and evaluates each, in the recipe's layout (ue5m3 scales, 128/1024 BF16 windows, 64-token pages:
every row costs the same bits), at every `--contexts` length on the same held-out windows:
- perplexity (teacher-forced, the decoder's three segments), its change against BF16 and against the centered
  per-head rotation with global clips (the strongest simple peer of issue 29), each with a paired 95 % bootstrap
  interval over windows;
- at the longest context, a passkey probe with `--needles` needles spread over the INT2 history, and a multi-key
  probe on as many windows (`--multikey K` needles of one form in each, one asked: `probes.multikey_batch`).

Components varied: the quantizer (min-max, unbiased, unbiased on keys only), the length of the held-out sequence the
clips are fitted on (2048 as shipped, or the longest context), the length of the statistics sequences, fitted
against global clips, per head against per layer, centering, the capture dtype, and the rotation itself
(OSCAR against Hadamard with the same centering, clip fit and quantizer: the claim the method rests on), and, with
`--window-aware-keys`, the key target (each query weighted by its attention on INT2 keys: `window_target.py`).

    python3 tools/recipe_study.py --model ~/.cache/oscar-calib/smollm2-135m --calib calib.txt --heldout heldout.txt \
        --contexts 2048,4096,8192 --windows 16 --needles 32 --out OUT

The peers (OSCAR per head and per layer with global clips, Hadamard) are calibrated from the study's own capture,
with every key rotated by OSCAR's own matrix (no Hadamard keys). `--recipe` adds candidate defaults calibrated from
the same capture; `--heldout` may repeat (the captures and calibrations are shared).

Writes `recipe_study_<model>.json` (every per-window NLL, fits, versions, device, commit, command) and `.md`, in
`OUT/NAME/` per held-out text when there are several.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime_kernels.format import DEFAULT_FORMAT  # noqa: E402

SINK_DEFAULT, RECENT_DEFAULT, PAGE = DEFAULT_FORMAT.sink_tokens, DEFAULT_FORMAT.recent_tokens, DEFAULT_FORMAT.page_size
BASELINE = "oscar global clips, centered, min-max"  # per-head rotations
PER_LAYER = "oscar per layer, global clips, centered, min-max"
KIVI = "kivi2-g128"


def log(msg: str) -> None:
    print(f"[recipe_study {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def token_stream(tok, path: Path) -> torch.Tensor:
    """The file's documents tokenized and joined with EOS, `[N]` int64."""
    from oscar_calib.analysis.evaluate import read_documents

    ids: list[int] = []
    for doc in read_documents(path):
        ids += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return torch.tensor(ids, dtype=torch.int64)


def check_tokenizer(model_dir: Path, tok) -> None:
    """Stop when the tokenizer here does not tokenize as it did at conversion (`tools/real_model.py` records the
    count of its check paragraph): transformers 5.17 reads Gemma3's tokenizer wrongly (issue 51), and every number of
    a study would then be off. A directory without that record is not checked."""
    marker = model_dir / "oscar_real_model.json"
    if not marker.is_file():
        return
    want = json.loads(marker.read_text()).get("check", {}).get("tokenizer")
    if not want:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from real_model import CHECK_TEXT

    ids = tok(CHECK_TEXT).input_ids
    got = {"tokens": len(ids), "bos_first": tok.bos_token_id is not None and ids[:1] == [tok.bos_token_id]}
    if got["tokens"] != want["tokens"] or got["bos_first"] != want["bos_first"]:
        raise SystemExit(f"--model {model_dir}: the tokenizer gives {got} on the conversion's check paragraph, "
                         f"the conversion recorded {want['tokens']} tokens, BOS first {want['bos_first']} "
                         f"(transformers {__import__('transformers').__version__}); tokenize with the one it was "
                         "converted by")


def chunks(stream: torch.Tensor, length: int, n: int, from_end: bool = False) -> torch.Tensor:
    """`[n, length]` consecutive chunks from the start (or the end) of `stream`."""
    need = n * length
    if stream.numel() < need:
        raise SystemExit(f"text too short: {stream.numel()} tokens, need {need} for {n} x {length}")
    part = stream[-need:] if from_end else stream[:need]
    return part.reshape(n, length)


def paired_pct_ci(a: torch.Tensor, b: torch.Tensor, n_boot: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """ppl change (percent) of window NLLs `a [N]` against `b [N]`, and its paired 95 % bootstrap interval."""
    from oscar_calib.analysis.evaluate import bootstrap_delta_ci

    lo, hi = bootstrap_delta_ci(a, b, n_boot=n_boot, seed=seed)
    return 100 * float(torch.expm1(a.double().mean() - b.double().mean())), lo, hi


def parse_layer_set(spec: str) -> tuple[str, list[int]]:
    """'0,3-8' -> ('0,3-8', [0, 3, 4, 5, 6, 7, 8]); a single range 'A-B' keeps the tables' older labels ('7-7')."""
    layers: set[int] = set()
    for part in spec.split(","):
        a, _, b = part.strip().partition("-")
        lo, hi = int(a), int(b or a)
        if lo > hi:
            raise ValueError(part)
        layers.update(range(lo, hi + 1))
    return spec, sorted(layers)


def parse_recipe(spec: str) -> tuple[str, dict]:
    """'per layer=granularity=layer,hadamard_key_mass=0.2' -> ('per layer', {'granularity': 'layer',
    'hadamard_key_mass': 0.2}); values are read as JSON where they parse (numbers, true/false), else kept as text."""
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise ValueError(f"expected NAME=FIELD=VALUE[,FIELD=VALUE], got {spec!r}")
    fields = {}
    for part in filter(None, rest.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"expected FIELD=VALUE, got {part!r} in {spec!r}")
        try:
            fields[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            fields[key.strip()] = value.strip()
    return name, fields


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--calib", type=Path, required=True)
    p.add_argument("--heldout", action="append", required=True, metavar="[NAME=]PATH",
                   help="held-out text (repeat for several: one results folder OUT/NAME each, NAME defaulting to the "
                        "file's stem; the captures and calibrations are shared, the probes read the first one)")
    p.add_argument("--contexts", default="2048,4096,8192")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--needles", type=int, default=32)
    p.add_argument("--samples", type=int, default=32, help="statistics sequences of 2048 tokens (as `run`)")
    p.add_argument("--stats-len", type=int, default=2048)
    p.add_argument("--sink", type=int, default=SINK_DEFAULT)
    p.add_argument("--recent", type=int, default=RECENT_DEFAULT)
    p.add_argument("--artifact", action="append", default=[], metavar="NAME=DIR",
                   help="also evaluate this artifact (e.g. one written by `oscar-calib run`); the peers are calibrated "
                        "from the study's own capture")
    p.add_argument("--no-variants", action="store_true", help="skip the variant grid: peers and --artifact rows only")
    p.add_argument("--multikey", type=int, default=4, metavar="K",
                   help="needles per window of the multi-key probe (0: no multi-key probe)")
    p.add_argument("--multivalue", type=int, default=0, metavar="V",
                   help="values of one key per window in a multi-value probe on the needle windows (0: none)")
    p.add_argument("--passkey-methods", default="", help="semicolon-separated rows the passkey probe runs (default all)")
    p.add_argument("--only", default="", help="semicolon-separated rows to evaluate (default: all)")
    p.add_argument("--floors", default="", metavar="K/V;...",
                   help="rows of the first --artifact with its fitted clips floored, e.g. '0.96/0.92;1/0.92' "
                        "(1 = that side not floored): does the clips' spread below the global ratios cost retrieval?")
    p.add_argument("--ceilings", default="", metavar="K/V;...",
                   help="rows of the first --artifact with its fitted clips capped (clip at least this much)")
    p.add_argument("--mixed", action="store_true",
                   help="rows of the first --artifact with one side's rotation and fitted clips taken from the "
                        "fitted Hadamard row (keys Hadamard / values OSCAR, and the other way round)")
    p.add_argument("--hadamard-key-layers", default="", metavar="A-B[,C-D];...",
                   help="rows of the first --artifact with the fitted Hadamard row's keys (rotation, clips, means) in "
                        "the given layers only, one row per ';'-separated set of ','-separated ranges (e.g. "
                        "'0-14;15-29;0,3-8'): where in depth does the key rotation cost retrieval?")
    p.add_argument("--key-gain", action="store_true",
                   help="a row of the first --artifact with the unbiased quantizer on keys only (values as stored)")
    p.add_argument("--window-aware-keys", action="store_true",
                   help="rows of the first --artifact with keys rotated by R = U H P of a window-aware key target "
                        "(each held-out query weighted by its attention mass on INT2 keys, by its squared mass, a 50/50 "
                        "blend of the mass target with the artifact's own, or uniformly: the control) and key clips "
                        "fitted for it")
    p.add_argument("--recipe", action="append", default=[], metavar="NAME=FIELD=VALUE[,FIELD=VALUE]",
                   help="a row calibrated from the study's capture by the product's default solver settings with "
                        "these fields changed (SolverSettings or KVFormat fields, e.g. 'per layer=granularity=layer', "
                        "'no hadamard keys=hadamard_key_mass=1'; 'defaults=' changes none): candidate defaults side by "
                        "side, all from one capture")
    p.add_argument("--needle-seed", type=int, default=0, help="seed of the passkey keys (0: the tables' needles)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if (args.floors or args.ceilings or args.mixed or args.hadamard_key_layers
            or args.key_gain or args.window_aware_keys) and not args.artifact:
        p.error("--floors, --ceilings, --mixed, --hadamard-key-layers, --key-gain and "
                "--window-aware-keys change the first --artifact's tables: give --artifact NAME=DIR")
    heldout_specs = []
    for spec in args.heldout:
        name, sep, path = spec.partition("=")
        heldout_specs.append((name, Path(path)) if sep else (Path(spec).stem, Path(spec)))
    if len({n for n, _ in heldout_specs}) != len(heldout_specs):
        p.error(f"--heldout: two texts share a name ({', '.join(n for n, _ in heldout_specs)}); name them NAME=PATH")
    try:
        recipes = [parse_recipe(spec) for spec in args.recipe]
    except ValueError as exc:
        p.error(f"--recipe: {exc}")
    try:
        key_layer_sets = [parse_layer_set(part) for part in filter(None, args.hadamard_key_layers.split(";"))]
    except ValueError:
        p.error(f"--hadamard-key-layers: expected sets of ranges like '0-14;15-29;0,3-8', got "
                f"{args.hadamard_key_layers!r}")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    SINK, RECENT = args.sink, args.recent  # noqa: N806
    fmt = DEFAULT_FORMAT.with_(sink_tokens=SINK, recent_tokens=RECENT)  # every row's cache: ue5m3, the given windows

    from study_common import solver_settings

    from oscar_calib.analysis.evaluate import method_nll
    from oscar_calib.analysis.methods import (
        Kivi2,
        KVMethod,
        LayerTables,
        TableInt2,
        artifact_tables,
        centered_fake_quantize,
    )
    from oscar_calib.analysis.methods import hadamard as hadamard_matrix
    from oscar_calib.analysis.probes import multikey_batch, multivalue_batch, passkey_batch, passkey_scores
    from oscar_calib.calibration.calibrate import (
        _fit_all,
        artifact_from_statistics,
        capture_statistics,
        session_means,
    )
    from oscar_calib.calibration.solve import solve_rotations, target_from_rotation
    from oscar_calib.calibration.window_target import blend_targets, window_aware_key_target

    class SidedTables(TableInt2):
        """TableInt2 with its own quantizer per side (keys, values)."""

        def __init__(self, name: str, tables: dict, k_quantizer: str, v_quantizer: str):
            super().__init__(name, name, fmt=fmt.with_(quantizer=k_quantizer), tables=tables)
            self.v_quantizer = v_quantizer

        def fake_quantize(self, layer_idx, keys, values, windows):
            if layer_idx not in self.tables:
                return keys.float(), values.float()
            key = (layer_idx, keys.device)  # moved once per layer and device, as TableInt2 does
            if key not in self._cache:
                self._cache[key] = self.tables[layer_idx].to(keys.device)
            t = self._cache[key]
            clip = lambda r: None if bool((r >= 1.0).all()) else r  # noqa: E731
            return (centered_fake_quantize(keys, t.k_rotation, clip(t.k_clip), t.k_mean, self.fmt),
                    centered_fake_quantize(values, t.v_rotation, clip(t.v_clip), t.v_mean,
                                           self.fmt.with_(quantizer=self.v_quantizer)))

    @dataclass
    class KiviLayers(Kivi2):
        """KIVI-2 in the calibrated layers only: a hybrid's sliding-window layers keep their BF16 cache, as they do
        under every OSCAR row."""

        layers: frozenset = frozenset()

        def quantizes(self, layer_idx):
            return layer_idx in self.layers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the evaluation's fp32 attention stays fp32
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(args.model)
    check_tokenizer(args.model, tok)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    contexts = [int(c) for c in args.contexts.split(",")]
    long_ctx = max(contexts)
    head_dim = model.config.head_dim if getattr(model.config, "head_dim", None) else (
        model.config.hidden_size // model.config.num_attention_heads)

    cal = token_stream(tok, args.calib)
    helds = [(name, path, token_stream(tok, path)) for name, path in heldout_specs]
    log(f"calibration text {cal.numel():,} tokens, held-out " + ", ".join(f"{n} {h.numel():,}" for n, _, h in helds))
    n_stats_long = max(1, args.samples * args.stats_len // long_ctx)
    stats_short = chunks(cal, args.stats_len, args.samples)  # as `run`: N sequences of --seq-len ...
    fit_short = cal[args.samples * args.stats_len:(args.samples + 1) * args.stats_len][None]  # ... + one held out
    stats_long = chunks(cal, long_ctx, n_stats_long)  # the same tokens in sequences of the serving context
    fit_long = chunks(cal, long_ctx, 1, from_end=True)  # a held-out sequence of the serving context (disjoint)
    if args.samples * args.stats_len + long_ctx > cal.numel():
        raise SystemExit("calibration text too short for disjoint statistics and long held-out sequences")

    t0 = time.perf_counter()
    caps = {}

    def capture(name: str, ids, holdout, m=model):
        t = time.perf_counter()
        caps[name] = capture_statistics(m, ids, holdout, batch_size=max(1, 16384 // ids.shape[1]),
                                        model_id=str(args.model))
        log(f"capture {name}: {ids.shape[0]} x {ids.shape[1]} + held-out {tuple(holdout.shape)} in "
            f"{time.perf_counter() - t:.1f}s")

    if not args.no_variants:
        capture("stats2k/fit2k", stats_short, fit_short)
    capture("stats2k/fitlong", stats_short, fit_long)  # as `run` captures: the model's dtype (bf16 on a GPU)
    if not args.no_variants:
        capture("statslong/fitlong", stats_long, fit_long)
    if device == "cuda" and not args.no_variants:  # the capture dtype: the same data captured by an fp32 copy of the model
        model32 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
        capture("fp32 stats2k/fitlong", stats_short, fit_long, m=model32)
        del model32
        torch.cuda.empty_cache()

    base = dict(scale_format="ue5m3", sink_tokens=SINK, recent_tokens=RECENT)
    arts, fits = {}, {}

    def calibrate(name: str, cap: str, **overrides) -> None:
        t = time.perf_counter()
        arts[name], report = artifact_from_statistics(caps[cap], solver_settings(**{**base, **overrides}),
                                                      compare_alternatives=False)
        fits[name] = {"capture": cap, "settings": overrides, **report.summary()}
        log(f"calibrated {name} in {time.perf_counter() - t:.1f}s: K clips {fits[name]['k_clip_ratio_mean']:.3f}, "
            f"V {fits[name]['v_clip_ratio_mean']:.3f}")

    from runtime_kernels.artifact import read_artifact

    external = {}
    for spec in args.artifact:
        name, _, path = spec.partition("=")
        external[name] = read_artifact(Path(path) / "oscar_kv.safetensors")
    # The peers' source: OSCAR itself, every key rotated by its own attention-aware matrix (no Hadamard keys).
    calibrate("fitlong min-max", "stats2k/fitlong", quantizer="uniform_minmax", hadamard_key_mass=1.0)
    calibrate("fitlong min-max, per layer", "stats2k/fitlong", quantizer="uniform_minmax", granularity="layer",
              hadamard_key_mass=1.0)
    if not args.no_variants:
        calibrate("default (shipped)", "stats2k/fit2k", quantizer="uniform_unbiased")
        calibrate("fit2k min-max", "stats2k/fit2k", quantizer="uniform_minmax")
        calibrate("fitlong unbiased", "stats2k/fitlong", quantizer="uniform_unbiased")
        calibrate("fitlong min-max, uncentered", "stats2k/fitlong", quantizer="uniform_minmax", centered=False)
        calibrate("fitlong min-max, no clip", "stats2k/fitlong", quantizer="uniform_minmax", clip=False)
        calibrate("statslong fitlong min-max", "statslong/fitlong", quantizer="uniform_minmax")
        calibrate("statslong fitlong unbiased", "statslong/fitlong", quantizer="uniform_unbiased")
        if "fp32 stats2k/fitlong" in caps:
            calibrate("fitlong min-max, fp32 capture", "fp32 stats2k/fitlong", quantizer="uniform_minmax")
    for name, fields in recipes:  # candidate defaults: the product's solver settings, these fields changed
        calibrate(name, "stats2k/fitlong", **fields)
    arts.update(external)

    methods: list[KVMethod] = [KVMethod()]

    def tables_of(name: str, centered: bool = True, clips: tuple[float, float] | None = None) -> dict:
        tabs = artifact_tables(arts[name], centered)
        if clips is not None:
            for t in tabs.values():
                t.k_clip = torch.full_like(t.k_clip, clips[0])
                t.v_clip = torch.full_like(t.v_clip, clips[1])
        return tabs

    def add(name: str, tables: dict, kq: str = "uniform_minmax", vq: str | None = None) -> None:
        methods.append(SidedTables(name, tables, kq, vq or kq))

    for name in arts:
        if args.no_variants and name == "fitlong min-max":
            continue
        add(name, tables_of(name, centered=bool(arts[name].key_mean("original").any())), arts[name].quantizer)
    if not args.no_variants:
        add("fitlong unbiased keys, min-max values",
            {layer: LayerTables(u.k_rotation, u.v_rotation, u.k_clip, m.v_clip, u.k_mean, u.v_mean)
             for (layer, u), m in zip(tables_of("fitlong unbiased").items(), tables_of("fitlong min-max").values())},
            "uniform_unbiased", "uniform_minmax")
    # Global clips (the reference's 0.96 / 0.92) on the per-head rotations, and Hadamard with the same means.
    add(BASELINE, tables_of("fitlong min-max", True, (0.96, 0.92)))
    add(PER_LAYER, tables_of("fitlong min-max, per layer", True, (0.96, 0.92)))
    methods.append(KiviLayers(KIVI, "KIVI-2: keys per channel over 128-token blocks, values per token",
                              token_group=128, layers=frozenset(caps["stats2k/fitlong"].layer_ids)))
    add("oscar global clips, centered, unbiased", tables_of("fitlong min-max", True, (0.96, 0.92)), "uniform_unbiased")
    add("oscar global clips, uncentered, min-max", tables_of("fitlong min-max", False, (0.96, 0.92)))
    had = hadamard_matrix(head_dim).float()

    def hadamard_tables(centered: bool, clips: tuple[float, float] | None, cap: str = "stats2k/fitlong",
                        quantizer: str = "uniform_minmax") -> dict:
        st = caps[cap]
        layer_ids = st.layer_ids
        h_kv = st.geometry[1]
        means = session_means(st, layer_ids)
        rot = had.expand(len(layer_ids), h_kv, head_dim, head_dim).contiguous()
        if clips is None:  # clips fitted for the Hadamard basis, exactly as OSCAR's are for its own
            settings = solver_settings(**{**base, "quantizer": quantizer, "centered": centered})
            fit = _fit_all(st, layer_ids, rot, rot, settings, means=means, o_weights=st.o_weights)
            kc = [fit[i].k_ratio for i in layer_ids]
            vc = [fit[i].v_ratio for i in layer_ids]
        else:
            kc = [torch.full((h_kv,), clips[0]) for _ in layer_ids]
            vc = [torch.full((h_kv,), clips[1]) for _ in layer_ids]
        return {layer: LayerTables(rot[a], rot[a], kc[a], vc[a], means[0][a] if centered else None,
                                   means[1][a] if centered else None) for a, layer in enumerate(layer_ids)}

    add("hadamard global clips, centered, min-max", hadamard_tables(True, (0.96, 0.92)))
    add("hadamard global clips, centered, unbiased", hadamard_tables(True, (0.96, 0.92)), "uniform_unbiased")
    add("hadamard global clips, uncentered, min-max", hadamard_tables(False, (0.96, 0.92)))
    had_fit = hadamard_tables(True, None)
    add("hadamard fitlong min-max (fitted clips)", had_fit)
    first = args.artifact[0].partition("=")[0] if args.artifact else None
    for spec, bound in ((args.floors, "floors"), (args.ceilings, "ceilings")):
        for part in filter(None, spec.split(";")):
            kf, _, vf = part.partition("/")
            kf, vf = float(kf), float(vf)
            tabs = tables_of(first, centered=bool(arts[first].key_mean("original").any()))
            for t in tabs.values():
                if bound == "floors":
                    t.k_clip = t.k_clip.clamp_min(kf) if kf < 1 else t.k_clip
                    t.v_clip = t.v_clip.clamp_min(vf) if vf < 1 else t.v_clip
                else:
                    t.k_clip, t.v_clip = t.k_clip.clamp_max(kf), t.v_clip.clamp_max(vf)
            add(f"{first}, clip {bound} {kf:g}/{vf:g}", tabs, arts[first].quantizer)
    def with_hadamard(side: str, layers: list[int] | None) -> dict:
        """The first artifact's tables with one side's rotation, fitted clips and means taken from the fitted
        Hadamard row, in `layers` (None: every layer). Both rows are centered."""
        own = tables_of(first, centered=True)

        def pick(i: int, o: LayerTables, h: LayerTables, field: str) -> torch.Tensor | None:
            if not field.startswith(side):
                return getattr(o, field)
            return getattr(h if (layers is None or i in layers) else o, field)
        return {i: LayerTables(*(pick(i, o, h, f) for f in ("k_rotation", "v_rotation", "k_clip", "v_clip", "k_mean",
                                                             "v_mean")))
                for (i, o), h in zip(own.items(), had_fit.values())}

    def window_aware_key_tables() -> dict[str, dict]:
        """Label -> the first artifact's tables with its keys rotated by `R = U H P` of a window-aware key target
        (`oscar_calib.calibration.window_target`, from the held-out capture the clip fit reads) and key clips fitted
        for that rotation by the artifact's own fit settings. Values (rotation, clips, mean) and the key mean stay the
        artifact's: means are kept in the model basis (`LayerTables`, `centered_fake_quantize` rotate them with
        whatever rotation the row uses), so the same key mean centers the new basis."""
        st = caps["stats2k/fitlong"]
        layer_ids = st.layer_ids
        art = arts[first]
        if art.layer_ids.tolist() != list(layer_ids):
            raise SystemExit(f"--window-aware-keys: artifact {first} has layers {art.layer_ids.tolist()}, the "
                             f"capture {list(layer_ids)}")
        solver = art.calibration.get("solver")
        if solver is None:  # an imported artifact does not record its fit: the study's own settings then
            log(f"--window-aware-keys: {first} records no solver settings; key clips fitted with the study's")
            solver = {"quantizer": art.quantizer}
        settings = solver_settings(**{**solver, **base})  # the artifact's fit, for the format every row is read in
        own = tables_of(first, centered=bool(art.key_mean("original").any()))
        means = (art.key_mean("original"), art.value_mean("original"))  # model basis; zeros = that side uncentered
        t = time.perf_counter()
        # The blend's M_h is the artifact's own key target, rebuilt from its rotation and spectrum (`run` draws its
        # statistics from other tokens than this study's capture, so the capture's M_h is not the one it solved).
        m_h = target_from_rotation(art.k_rotation, art.k_eigenvalues)  # [A, H_kv, d, d]
        # "uniform": the plain query moment of the same held-out queries, clips refitted alike: the control that
        # separates the weighting from the smaller sample (the held-out queries) the weighted targets come from.
        targets: dict[str, list[torch.Tensor]] = {"mass": [], "mass^2": [], "blend": [], "uniform": []}
        for a, layer in enumerate(layer_ids):
            keys, _, queries, positions = st.holdout[layer].stacked()
            m_far = window_aware_key_target(keys, queries, positions, st.scaling, settings.kv_format(), "mass").cpu()
            targets["mass"].append(m_far)
            targets["mass^2"].append(window_aware_key_target(keys, queries, positions, st.scaling,
                                                             settings.kv_format(), "mass2").cpu())
            targets["blend"].append(blend_targets(m_far, m_h[a], 0.5))
            targets["uniform"].append(window_aware_key_target(keys, queries, positions, st.scaling,
                                                              settings.kv_format(), "uniform").cpu())
        log(f"window-aware key targets in {time.perf_counter() - t:.1f}s")
        out = {}
        for label, stack in targets.items():
            t = time.perf_counter()
            # solve_rotations: rotations_from_targets (R = U H P) with the artifact's granularity and the
            # orthogonality check of the product's solve.
            k_rot, _ = solve_rotations(torch.stack(stack), settings.granularity)
            fit = _fit_all(st, layer_ids, k_rot, art.v_rotation, settings, means=means, o_weights=st.o_weights)
            kc = torch.stack([fit[i].k_ratio for i in layer_ids])  # the value fit is discarded: values stay as stored
            fits[f"{first}, window-aware keys ({label})"] = {
                "capture": "stats2k/fitlong", "key_target": label, "settings": settings.model_dump(mode="json"),
                "k_clip_ratio_mean": float(kc.mean()), "k_clip_ratio_min": float(kc.min()),
                "k_rotation_max_diff_vs_artifact": float((k_rot - art.k_rotation).abs().max())}
            log(f"window-aware keys ({label}): K clips {float(kc.mean()):.3f} (min {float(kc.min()):.3f}) in "
                f"{time.perf_counter() - t:.1f}s")
            out[label] = {layer: LayerTables(k_rot[a], o.v_rotation, kc[a], o.v_clip, o.k_mean, o.v_mean)
                          for a, (layer, o) in enumerate(own.items())}
        return out

    if args.mixed:
        for side in ("k", "v"):
            add(f"{first}, hadamard {'keys' if side == 'k' else 'values'}", with_hadamard(side, None),
                arts[first].quantizer)
    for spec, layers in key_layer_sets:
        add(f"{first}, hadamard keys in layers {spec}", with_hadamard("k", layers), arts[first].quantizer)
    if args.key_gain:
        add(f"{first}, unbiased keys", tables_of(first, centered=bool(arts[first].key_mean("original").any())),
            "uniform_unbiased", arts[first].quantizer)
    if args.window_aware_keys:
        for label, tabs in window_aware_key_tables().items():
            add(f"{first}, window-aware keys ({label})", tabs, arts[first].quantizer)
    log(f"{len(methods)} caches ready in {time.perf_counter() - t0:.1f}s")
    if args.only:
        keep = {"bf16", BASELINE, *args.only.split(";"), *(name for name, _ in recipes)}
        methods = [m for m in methods if m.name in keep]

    def study(heldout: Path, held: torch.Tensor, out_dir: Path, needles: int) -> None:
        """Every row on `held`'s windows at every context; with `needles`, the probes at the longest."""
        result = {"model": str(args.model), "calib": str(args.calib), "heldout": str(heldout), "contexts": {}, "fits": fits, "sink": SINK, "recent": RECENT, "page": PAGE,
                  "scale_format": "ue5m3", "head_dim": head_dim,
                  "bits_per_element": {"128k": fmt.bits_per_element(131072, head_dim),
                                       **{str(c): fmt.bits_per_element(c, head_dim) for c in contexts}}}
        stem = f"recipe_study_{args.model.name}"

        def save() -> None:  # after every row, so a run stopped by a time limit keeps what it measured
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))

        bits_128k = {m.name: m.effective_bits(131072, head_dim, fmt) for m in methods}
        for ctx in contexts:
            windows = chunks(held, ctx, args.windows)
            rows = {}
            for m in methods:
                t = time.perf_counter()
                nll, _ = method_nll(model, m, windows, fmt, 1, collect_stats=False)
                rows[m.name] = nll.double().mean(dim=1)
                log(f"{ctx}: {m.name}: ppl {float(torch.exp(rows[m.name].mean())):.4f} ({time.perf_counter() - t:.1f}s)")
            out = []
            for name, w in rows.items():
                d, lo, hi = paired_pct_ci(w, rows["bf16"])
                b, blo, bhi = paired_pct_ci(w, rows[BASELINE]) if BASELINE in rows else (float("nan"),) * 3
                out.append({"name": name, "ppl": float(torch.exp(w.mean())), "delta_vs_bf16_pct": d,
                            "bits_128k": bits_128k[name],
                            "ci95_vs_bf16": [lo, hi], "delta_vs_baseline_pct": b, "ci95_vs_baseline": [blo, bhi],
                            "window_nll": w.tolist()})
            result["contexts"][str(ctx)] = {"windows": args.windows, "tokens_scored": args.windows * (ctx - 1),
                                            "methods": out}
            save()
            if ctx == long_ctx and needles:
                lo_d, hi_d = (SINK + 16) / ctx, 1.0 - (RECENT + 64) / ctx
                depths = [lo_d + (hi_d - lo_d) * i / max(needles - 1, 1) for i in range(needles)]
                spare = held.numel() // ctx - args.windows  # windows the perplexity rows did not read
                filler = (chunks(held, ctx, needles, from_end=True) if spare >= needles
                          else windows[torch.arange(needles) % windows.shape[0]])
                chosen = set(args.passkey_methods.split(";")) if args.passkey_methods else None
                probed = [m for m in methods if chosen is None or m.name in chosen or m.name == "bf16"]
                # (result key, its count field, count, batch): one needle, several keys, several values of one key
                needle_probes = [("passkey", "needles", needles, lambda: passkey_batch(
                            tok, filler, depths, seed=args.needle_seed)),
                        ("multikey", "keys", args.multikey, lambda: multikey_batch(
                            tok, filler, lo_d, hi_d, keys=args.multikey, seed=args.needle_seed)),
                        ("multivalue", "values", args.multivalue, lambda: multivalue_batch(
                            tok, filler, lo_d, hi_d, values=args.multivalue, seed=args.needle_seed))]
                for probe, field, count, make_batch in needle_probes:
                    if not count:
                        continue
                    probe_batch, scores = make_batch(), {}
                    result[probe] = {"context": ctx, "windows": needles, field: count, "depth_range": [lo_d, hi_d],
                                     "needle_seed": args.needle_seed, "scores": scores}
                    for m in probed:
                        scores[m.name] = passkey_scores(model, m, probe_batch, fmt)
                        log(f"{probe} {ctx}: {m.name}: {100 * scores[m.name]['key_token_accuracy']:.1f}%")
                        save()

        commit = os.environ.get("OSCAR_BENCH_COMMIT") or subprocess.run(  # a copy without .git names its commit
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        result.update({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dtype),
                       "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                       "commit": commit, "command": " ".join(sys.argv), "seconds": time.perf_counter() - t0})
        save()
        (out_dir / f"{stem}.md").write_text(markdown(result))
        print(markdown(result))

    for i, (name, path, held) in enumerate(helds):
        # one folder per held-out text when there are several; the probes read the first text's filler only
        study(path, held, args.out if len(helds) == 1 else args.out / name, args.needles if i == 0 else 0)
    return 0


def markdown(result: dict) -> str:
    ctxs = list(result["contexts"])
    lines = [f"Model `{result['model']}`, ue5m3 scales, sink {result['sink']} / recent {result['recent']}, page "
             f"{result['page']}: {result['bits_per_element']['128k']:.3f} bits per element at 128K for every INT2 row. "
             f"{result.get('device', '')}, {result.get('dtype', '')}. ppl change vs BF16 and vs `{BASELINE}` with "
             "paired 95 % bootstrap intervals over windows.", ""]
    head = "| cache | " + " | ".join(f"{c}: vs BF16 | {c}: vs baseline" for c in ctxs)
    pk, mk, mv = result.get("passkey"), result.get("multikey"), result.get("multivalue")
    lines += [head + (f" | passkey @{pk['context']}" if pk else "") + (f" | multi-key ({mk['keys']}) @{mk['context']}"
                                                                      if mk else "")
              + (f" | multi-value ({mv['values']}) @{mv['context']}" if mv else "") + " |",
              "|---|" + "---|---|" * len(ctxs) + "".join("---|" for probe in (pk, mk, mv) if probe)]
    names = [m["name"] for m in result["contexts"][ctxs[0]]["methods"]]
    for name in names:
        cells = []
        for c in ctxs:
            r = next(m for m in result["contexts"][c]["methods"] if m["name"] == name)
            lo, hi = r["ci95_vs_bf16"]
            blo, bhi = r["ci95_vs_baseline"]
            cells.append(f"{r['delta_vs_bf16_pct']:+.2f} % [{lo:+.2f}, {hi:+.2f}]" if name != "bf16"
                         else f"ppl {r['ppl']:.3f}")
            cells.append("" if name in ("bf16", BASELINE) else f"{r['delta_vs_baseline_pct']:+.2f} % [{blo:+.2f}, {bhi:+.2f}]")
        for probe in (pk, mk, mv):
            if probe:
                sc = probe["scores"].get(name)
                cells.append("" if sc is None else f"{100 * sc['key_token_accuracy']:.1f} %")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
