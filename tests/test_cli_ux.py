"""CLI polish: fast `--help` (no torch/Triton), `-h`/`--version`, one exit code per kind of failure, early
optional-dependency checks, `audit` failing on a contract break, and the audit figures' shared scales."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_helpers import run_cli
from format_helpers import PAPER
from tiny_models import tiny_model

from oscar_calib.cli import exit_codes
from oscar_calib.demo import byte_tokenizer
from runtime_kernels.artifact import identity_artifact, write_artifact

REPO_ROOT = Path(__file__).resolve().parents[1]




# ------------------------------------------------------------------------------------------------ start-up
HEAVY = ("torch", "triton", "transformers", "safetensors", "huggingface_hub", "numpy", "matplotlib")


HELP_ARGVS = [["--help"], ["-h"], ["zoo", "--help"], ["push", "-h"], ["eval", "--help"], ["audit", "--help"],
              ["run", "--help"], ["--version"], ["pull", "-h"], ["refit", "-h"], ["stats", "merge", "-h"],
              ["zoo", "list", "-h"]]


def test_help_imports_neither_torch_nor_triton():
    """Every help screen and --version, one after the other in one fresh interpreter (one start-up, not twelve): a
    heavy module imported by any of them shows after it, named with the argv that imported it."""
    code = textwrap.dedent(f"""
        import sys
        from oscar_calib.cli import main
        for argv in {HELP_ARGVS!r}:
            sys.argv = ["oscar-calib", *argv]
            try:
                main()
            except SystemExit as exc:
                assert not exc.code, (argv, exc.code)
            heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))
            print("HEAVY " + " ".join(argv) + "=" + ",".join(heavy))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("HEAVY ")]
    assert len(lines) == len(HELP_ARGVS), proc.stdout[-500:]
    assert all(line.endswith("=") for line in lines), [line for line in lines if not line.endswith("=")]


def test_short_help_and_version(monkeypatch, capsys):
    code, out_short, _ = run_cli(["-h"], monkeypatch, capsys)
    assert code == 0
    code, out_long, _ = run_cli(["--help"], monkeypatch, capsys)
    assert code == 0 and out_short == out_long and "Usage" in out_long
    from oscar_calib import __version__

    code, out, _ = run_cli(["--version"], monkeypatch, capsys)
    assert code == 0 and out.strip() == f"oscar-calib {__version__}"


def test_choices_are_listed_in_help(monkeypatch, capsys):
    code, out, _ = run_cli(["export", "--help"], monkeypatch, capsys)
    assert code == 0 and "reference" in out and "none" in out and "first" in out
    code, out, _ = run_cli(["zoo", "list", "--help"], monkeypatch, capsys)
    assert code == 0 and "model" in out and "dataset" in out
    # A value outside the choices is a usage error (2) naming the flag.
    code, _, err = run_cli(["export", "x", "--out", "y", "--head-reduce", "mean"], monkeypatch, capsys)
    assert code == 2 and "--head-reduce" in err


# ------------------------------------------------------------------------------------------------ exit codes
def test_exit_code_table_maps_runtime_types_without_their_own_codes():
    from oscar_calib.errors import CaptureError, HubError, InputError, IntegrityError, OscarError
    from oscar_calib.zoo.manifest import ManifestError
    from oscar_calib.zoo.reference_format import ReferenceFormatError
    from runtime_kernels.artifact import ArtifactError
    from runtime_kernels.loader import ModelMismatchError, ReleaseNotFoundError, UnsafeNameError

    expected = {OscarError: 1, InputError: 2, ManifestError: 2, ReferenceFormatError: 2, CaptureError: 3,
                IntegrityError: 4, ArtifactError: 4, HubError: 5, ReleaseNotFoundError: 5, UnsafeNameError: 2,
                ModelMismatchError: 2, exit_codes.UnchangedRelease: 6, exit_codes.MissingDependency: 7}
    for cls, code in expected.items():
        assert exit_code_for_type(cls) == code, cls
        assert not hasattr(cls, "exit_code"), f"{cls.__name__} carries a CLI exit code"
    assert exit_codes.exit_code_for(ValueError("x")) is None  # unexpected: keeps its traceback
    # Every code of the table is documented, and the table in docs/cli.md is the generated one.
    assert {k.code for k in exit_codes.KINDS} >= set(expected.values())
    assert exit_codes.table_markdown() in (REPO_ROOT / "docs" / "cli.md").read_text()


def exit_code_for_type(cls):
    try:
        raise cls("x")
    except Exception as exc:  # noqa: BLE001 - any type
        return exit_codes.exit_code_for(exc)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=64, num_layers=2, vocab_size=260).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_artifact_for_another_model_is_exit_2_in_every_command(tmp_path, monkeypatch, capsys, model_dir):
    write_artifact(identity_artifact(2, 2, 4, 32, fmt=PAPER), tmp_path / "a")  # head_dim 32; the model has 64
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 40)
    commands = {
        "audit": ["audit", str(tmp_path / "a"), "--model", str(model_dir)],
        "export": ["export", str(tmp_path / "a"), "--out", str(tmp_path / "ref"), "--model-config", str(model_dir)],
        "eval": ["eval", "--model", str(model_dir), "--artifact", str(tmp_path / "a"), "--data", str(text),
                 "--context", "64", "--generation-steps", "0"],
    }
    for name, args in commands.items():
        code, _, err = run_cli(args, monkeypatch, capsys)
        assert code == exit_codes.BAD_INPUT, (name, code, err)
        assert "head_dim" in err and "Traceback" not in err, name
    assert not (tmp_path / "ref").exists()


def test_audit_exits_4_on_a_contract_break_after_the_report(tmp_path, monkeypatch, capsys):
    from safetensors.torch import save_file

    art = identity_artifact(2, 2, 4, 32, fmt=PAPER)
    art.k_rotation[0, 0] *= 1.5  # not orthogonal: breaks the contract
    (tmp_path / "bad").mkdir()
    save_file({n: t.contiguous() for n, t in art.tensors().items()}, str(tmp_path / "bad" / "oscar_kv.safetensors"),
              metadata=art.metadata)
    code, out, err = run_cli(["audit", str(tmp_path / "bad"), "--json"], monkeypatch, capsys)
    assert code == exit_codes.INTEGRITY, err
    report = json.loads(out)  # the report is still complete
    assert report["contract_error"] and "non-orthogonal-k" in report["heads"][0]["flags"]
    assert "breaks the artifact contract" in err
    write_artifact(identity_artifact(2, 2, 4, 32, fmt=PAPER), tmp_path / "good")
    code, _, err = run_cli(["audit", str(tmp_path / "good"), "--json"], monkeypatch, capsys)
    assert code == 0, err


@pytest.fixture
def no_matplotlib(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name.split(".")[0] == "matplotlib" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_matplotlib_is_caught_before_the_run(tmp_path, monkeypatch, capsys, no_matplotlib):
    write_artifact(identity_artifact(2, 2, 4, 32, fmt=PAPER), tmp_path / "a")
    for args, flag in ((["audit", str(tmp_path / "a"), "--plots", str(tmp_path / "plots")], "--plots"),
                       (["eval", "--plot", str(tmp_path / "e.png")], "--plot")):
        code, out, err = run_cli(args, monkeypatch, capsys)
        assert code == exit_codes.MISSING_DEPENDENCY, err
        assert flag in err and "pip install 'oscar-calib[plot]'" in err
        assert "[eval]" not in err and "[audit]" not in err  # nothing ran: no progress lines
    assert not (tmp_path / "plots").exists() and not (tmp_path / "e.png").exists()


# ------------------------------------------------------------------------------------------------ figures
def _report(layers=3, heads=2):
    rows = []
    for la in range(layers):
        for h in range(heads):
            rows.append({"layer": la, "head": h, "k_clip": 0.9 + 0.01 * la, "v_clip": 1.0 - 0.02 * h,
                         "k_err_naive": 0.1 * (la + 1), "k_err_hadamard": 0.05 * (la + 1), "k_err_oscar": 0.01 * (h + 1),
                         "v_err_naive": 0.3, "v_err_hadamard": 0.2, "v_err_oscar": 0.1 + 0.01 * la,
                         "flags": ["clip-at-grid-edge-k"] if la == 0 else []})
    return {"artifact": "zoo/x/oscar_kv.safetensors", "model_id": "m", "granularity": "head", "heads": rows,
            "with_activations": True, "flags_total": heads, "contract_error": None}


def test_compared_panels_share_one_colour_scale_and_show_values(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from oscar_calib.analysis import audit_plots

    report = _report()
    fam = next(f for f in audit_plots.FAMILIES if f.name == "quant_error")
    fig = audit_plots._family_figure(fam, report, [0, 1, 2], [0, 1])
    axes = [ax for ax in fig.axes if ax.images]
    assert len(axes) == 6
    key_norms = {(ax.images[0].norm.vmin, ax.images[0].norm.vmax) for ax in axes[:3]}
    assert len(key_norms) == 1  # naive, Hadamard and OSCAR keys: one scale, spanning all three panels
    keys = [r[k] for r in report["heads"] for k in ("k_err_naive", "k_err_hadamard", "k_err_oscar")]
    assert key_norms.pop() == pytest.approx((min(keys), max(keys)))
    assert axes[3].images[0].norm.vmax == pytest.approx(0.3)  # values: their own shared scale
    assert [t.get_text() for t in axes[0].texts] == ["0.1", "0.1", "0.2", "0.2", "0.3", "0.3"]
    assert all("_" not in ax.get_title() for ax in axes)  # titles in words
    plt.close(fig)
    written = audit_plots.write_audit_plots(report, tmp_path)
    assert [p.name for p in written] == ["summary.png", "clip_ratios.png", "quant_error.png"]
    assert all(p.stat().st_size > 10_000 for p in written)


def test_figures_read_as_plain_numbers_and_say_when_nothing_is_flagged(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from oscar_calib.analysis import audit_plots

    assert [audit_plots._fmt(v) for v in (123.4, 0.0051, 0.256, 7.0, 2.5e5)] == ["123", "0.0051", "0.256", "7", "2.5e+05"]
    report = _report(layers=2, heads=2)
    for row in report["heads"]:
        row["flags"] = []
    report["flags_total"] = 0
    fig = audit_plots._summary_figure(report, [0, 1], [0, 1])
    flags_ax, bars_ax = fig.axes[0], fig.axes[1]
    assert "no head flagged" in [t.get_text() for t in flags_ax.texts]
    assert bars_ax.get_title().startswith("all 4 heads, worst first")
    fig.canvas.draw()
    labels = [t.get_text() for t in bars_ax.get_yticklabels() + bars_ax.get_yticklabels(minor=True)]
    assert any(labels) and not any("$" in t or "10^" in t or "\u00d7" in t for t in labels), labels
    plt.close(fig)
    report["heads"][0]["flags"] = ["clip-at-grid-edge-k"]
    fig = audit_plots._summary_figure(report, [0, 1], [0, 1], worst=2)
    assert "K clip at edge" in [t.get_text() for t in fig.axes[0].texts]
    assert "no head flagged" not in [t.get_text() for t in fig.axes[0].texts]
    assert fig.axes[1].get_title().startswith("the 2 worst heads")
    plt.close(fig)
    written = audit_plots.write_audit_plots(report, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)  # no temporary files left


def test_the_fixture_directory_stands_for_its_hub_id(tmp_path, monkeypatch, capsys):
    from oscar_calib.cli.checks import local_model_id
    from oscar_calib.demo import FIXTURE_DIR, FIXTURE_MODEL_ID, fixture_available

    if not fixture_available():
        pytest.skip("trained fixture not installed")
    assert local_model_id(FIXTURE_DIR) == FIXTURE_MODEL_ID and local_model_id(tmp_path) is None
    import json as _json

    cfg = _json.loads((FIXTURE_DIR / "config.json").read_text())
    shape = (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["num_attention_heads"],
             cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    for model_id, code_wanted in ((FIXTURE_MODEL_ID, 0), ("someone/else", exit_codes.BAD_INPUT)):
        write_artifact(identity_artifact(*shape, model_id=model_id, fmt=PAPER), tmp_path / model_id.replace("/", "_"))
        code, _, err = run_cli(["export", str(tmp_path / model_id.replace("/", "_")), "--out",
                                str(tmp_path / f"ref-{code_wanted}"), "--model-config", str(FIXTURE_DIR)],
                               monkeypatch, capsys)
        assert code == code_wanted, err


def test_audit_allow_other_model(tmp_path, monkeypatch, capsys, model_dir):
    pytest.importorskip("matplotlib")
    write_artifact(identity_artifact(2, 2, 4, 64, model_id="someone/else", fmt=PAPER), tmp_path / "a")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 40)
    argv = ["audit", str(tmp_path / "a"), "--model", str(model_dir), "--data", str(text), "--seq-len", "64",
            "--samples", "1", "--json"]
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert code == exit_codes.BAD_INPUT and "model_id" in err and "--allow-other-model" in err
    code, out, err = run_cli([*argv, "--allow-other-model", "--plots", str(tmp_path / "plots")], monkeypatch, capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["with_activations"] is True
    assert sorted(report["plots"]) == sorted(str(p) for p in (tmp_path / "plots").iterdir())
    assert {Path(p).name for p in report["plots"]} >= {"summary.png", "quant_error.png", "kurtosis.png"}


# ------------------------------------------------------------------------------------------------ progress
def test_clip_fit_reports_progress_over_every_layer_fit():
    import torch

    from oscar_calib.calibration.calibrate import calibrate_model_with_report
    from oscar_calib.config import SolverSettings

    m = tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2, vocab_size=64)
    ids = torch.randint(0, 64, (3, 32), generator=torch.Generator().manual_seed(0))
    for compare, passes in ((False, 1), (True, 6)):
        calls, tokens = [], []
        calibrate_model_with_report(m, ids, SolverSettings(kv_format={"sink_tokens": 4, "recent_tokens": 8}),
                                    compare_alternatives=compare, holdout_queries=8,
                                    progress=lambda n, total: tokens.append((n, total)),
                                    fit_progress=lambda what, done, total: calls.append((what, done, total)))
        total = 2 * passes  # 2 layers x (chosen fit + alternatives)
        assert {c[2] for c in calls} == {total} and calls[-1] == ("done", total, total)
        assert [c[1] for c in calls] == list(range(total + 1))  # one step per layer fit, in order
        assert sum(n for n, _ in tokens) == ids.numel()


@pytest.mark.slow  # a whole eval (two calibrations, 4 windows, 16 agreement steps): ~30 s of CPU
def test_eval_picks_cpu_sized_defaults_and_says_so(tmp_path, monkeypatch, capsys, model_dir):
    text = tmp_path / "t.txt"
    text.write_text("\n<|endoftext|>\n".join(f"document {i}: " + "the quick brown fox jumps " * 30
                                             for i in range(12)))
    code, out, err = run_cli(["eval", "--model", str(model_dir), "--data", str(text), "--calib-data", str(text),
                              "--context", "64", "--device", "cpu", "--methods", "bf16,oscar-head", "--sink", "4",
                              "--recent", "8", "--json"],
                             monkeypatch, capsys)
    assert code == 0, err
    for line in ("--max-windows 4 (CPU-sized default; 16 on a GPU", "--calib-samples 6 (CPU-sized default",
                 "--generation-steps 16 (CPU-sized default", "--batch-size 1 (CPU-sized default"):
        assert line in err, err
    result = json.loads(out)
    assert result["windows"]["long"] + result["windows"]["packed"] <= 4
    assert result["generation_agreement"]["steps"] == 16


def test_explicit_eval_sizes_are_kept_and_not_logged(capsys):
    from oscar_calib.cli.eval_cmd import _sized
    from oscar_calib.cli.output import Output

    output = Output(tag="eval")
    assert _sized(output, 2, "--max-windows", on_gpu=False, gpu=16, cpu=4) == 2
    assert _sized(output, None, "--max-windows", on_gpu=True, gpu=16, cpu=4) == 16
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[eval] --max-windows 16 (GPU" in err  # only the chosen default is logged


def test_export_json_names_the_files_written(tmp_path, monkeypatch, capsys):
    write_artifact(identity_artifact(2, 2, 4, 32, fmt=PAPER), tmp_path / "a")
    code, out, err = run_cli(["export", str(tmp_path / "a"), "--out", str(tmp_path / "ref"), "--json"],
                             monkeypatch, capsys)
    assert code == 0, err
    written = json.loads(out)
    assert set(written) >= {"keys", "values"} and all(Path(p).is_file() for p in written.values())
