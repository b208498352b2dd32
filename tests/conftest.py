"""Test setup: Triton runs in its CPU interpreter when there is no GPU (must be set before triton is imported), and
numpy's BLAS runs one kernel on every x86-64 machine (must be set before numpy is imported)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path


def _pin_blas_kernel() -> None:
    """The interpreter computes `tl.dot` with numpy's OpenBLAS, which picks its matmul kernel by CPU (AVX2 or AVX-512),
    and the kernels sum in different orders: the decode outputs then differ in their last bits between machines, and
    tests that compare recorded bits (tests/test_decode_bitwise.py) hold on one kind only. Every x86-64 CPU with AVX2
    runs OpenBLAS's Haswell kernel and numpy's AVX2 loops, so they are the ones chosen wherever they can run."""
    if "numpy" in sys.modules:
        return  # too late: OpenBLAS chose its kernel when numpy was imported
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if platform.machine() in ("x86_64", "AMD64") and " avx2" in flags:
        os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")
        # numpy's own loops (exp, sums) dispatch to AVX-512 versions where the CPU has them: keep them at AVX2 too.
        os.environ.setdefault("NPY_DISABLE_CPU_FEATURES", "X86_V4 AVX512_ICL AVX512_SPR")


_pin_blas_kernel()

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Tests never touch the real Hub: offline mode unless a test points the client at its own server."""
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "1"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    yield


@pytest.fixture
def hub(tmp_path, monkeypatch, request):
    """The local fake Hub (tests/hub_server.py), online, as `HF_ENDPOINT`; it accepts the test module's TOKEN."""
    import huggingface_hub.constants as constants
    from hub_server import HubServer

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with HubServer(tmp_path / "hub", token=request.module.TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


# `make test-fast` (`-m "not slow"`): the contributor's inner loop. `make test` and CI run everything. Besides the
# tests marked `@pytest.mark.slow` where they are written, these count as slow (durations measured on the 2-core
# development machine under load, `pytest --durations`): every test that runs Triton kernels in the interpreter
# (`interpreter`: seconds per launch), and the tests below, which calibrate or evaluate the trained fixture end to end.
# `make test-fast` took 244 s at load 4-5 with the first half of this list, about 165 s (estimated from the same
# run's durations) with all of it; see docs/cli.md for the measured time.
SLOW_TESTS = (
    "tests/test_cli_run.py::test_demo_runs_without_arguments",  # 86 s: the whole demo, as a user runs it
    "tests/test_cli_run.py::test_demo_falls_back_to_a_random_model_without_the_fixture",  # 83 s
    "tests/test_cli_run.py::test_quantizer_flag_is_recorded_and_an_unknown_one_refused",  # 38 s
    "tests/test_cli_run.py::test_no_clip_writes_unclipped_ratios_and_records_it",  # 36 s
    "tests/test_cli_ux.py::test_eval_picks_cpu_sized_defaults_and_says_so",  # 77 s: a whole CPU eval
    "tests/test_cli_ux.py::test_clip_fit_reports_progress_over_every_layer_fit",  # 15 s
    "tests/test_eval.py",  # evaluations of the fixture, method by method
    "tests/test_fuzz.py",  # hypothesis: hundreds of examples
    # the module fixture `reference` calibrates once (18 s), then each of these re-runs or resumes it
    "tests/test_scale.py::test_refit_reproduces_the_run_byte_for_byte",  # 23 s
    "tests/test_scale.py::test_sigint_leaves_a_consistent_checkpoint_then_resume_gives_the_same_bytes",  # 15 s
    "tests/test_scale.py::test_merge_of_two_halves_equals_the_whole",  # 7 s
    "tests/test_scale.py::test_disk_offload_gives_the_same_artifact",  # 3 s
    "tests/test_scale.py::test_bad_statistics_files_are_refused",
    "tests/test_scale.py::test_checkpoint_file_round_trip_and_refusals",
    "tests/test_scale.py::test_a_dead_peer_turns_into_a_clear_capture_error",  # 4.5 s
    "tests/vllm/test_engine.py::test_ragged_steps_match_paged_cache",  # 8 cases, 3-5 s each
)


def _is_slow(item) -> bool:
    node = item.nodeid.replace("\\", "/")
    return "interpreter" in item.keywords or any(node == s or node.startswith(s + "::") or
                                                  node.startswith(s + "[") for s in SLOW_TESTS)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need a CUDA device and compiled kernels; `interpreter` tests launch Triton kernels on CPU tensors,
    which only the interpreter can do. One process runs Triton one way or the other (TRITON_INTERPRET is read when
    the kernels are defined), so on a GPU machine `make test` runs the GPU tests and skips the interpreter ones, and
    `CUDA_VISIBLE_DEVICES= make test` runs the CPU suite there."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA device")
    elif interpret:
        skips["gpu"] = pytest.mark.skip(reason="TRITON_INTERPRET=1: the GPU tests check the compiled kernels")
    if not interpret:
        skips["interpreter"] = pytest.mark.skip(
            reason="launches Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 (set automatically without a "
                   "GPU; on a GPU machine run `CUDA_VISIBLE_DEVICES= make test`)")
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if `run` gets as far as loading the weights or the data (a refusal must come before)."""
    import oscar_calib.calibration.job as job

    def boom(*args, **kwargs):
        raise AssertionError("the run went on to load the model or the data")

    monkeypatch.setattr(job, "_load_model", boom)
    monkeypatch.setattr(job, "load_calibration_data", boom)
