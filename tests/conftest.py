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
    """Tests never touch the real Hub: offline mode unless a test points the client at its own server.
    huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported, so its constant is set too: otherwise a
    test's outcome would depend on whether an earlier module imported it (at collection, before this fixture set
    the variable) or a test did."""
    import huggingface_hub.constants as constants

    offline = os.environ.get("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline.upper() in constants.ENV_VARS_TRUE_VALUES)
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


# `make test-fast` (`-m "not slow"`): the contributor's inner loop, under 3 minutes on 2 idle cores (docs/cli.md,
# "Timings"). `make test` and CI run everything. Besides the tests marked `@pytest.mark.slow` where they are written,
# these count as slow: every test that runs Triton kernels in the interpreter (`interpreter`: seconds per launch),
# and the tests below. A test is slow when it calibrates, evaluates or generates with a trained fixture end to end,
# compiles kernels, or runs the CLI in several subprocesses; the seconds are `pytest --durations` of the fast suite
# on the 2-core development machine under load (the fast suite first took 3853 s wall for 889 s of CPU there; with this
# list, 147 s wall for 95 s of CPU at load 1.0-2.6).
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
    # whole files: each of their fast tests calibrates, evaluates or compiles
    "tests/test_real_model.py",  # 360 + 137 + 25 s: a slice of SmolLM2-135M (skipped where it is not fetched)
    # a slice of Gemma3-270M (skipped where it is not fetched): 28 + 8 + 7 + 3 s; its checks that need no model stay
    "tests/test_real_gemma3.py::test_calibrated_slice_serves_through_oscar_cache_with_sliding_layers_in_their_own_cache",
    "tests/test_real_gemma3.py::test_the_evaluators_bf16_equals_plain_sdpa_past_the_sliding_window",
    "tests/test_real_gemma3.py::test_converted_model_is_gemma3_and_the_slice_is_its_first_layers",
    "tests/test_real_gemma3.py::test_the_study_refuses_a_tokenizer_that_tokenizes_otherwise_than_at_conversion",
    "tests/test_probes.py",  # 348 + 122 + 111 + 93 s: passkey and verbatim probes through eval and the runtime
    "tests/test_kernel_compiles_sm90.py",  # 73-90 s each: compiles the decode kernels for sm_90 on the CPU
    "tests/test_decode_plan.py::test_the_shipped_format_takes_the_whole_page_loop_in_a_compiled_launch",  # 266 s
    "tests/test_decode_plan.py::test_the_shipped_format_takes_the_production_grid_at_the_bench_shapes",  # 206 s
    "tests/test_cli_run.py::test_run_jsonl_and_dataset_folder",  # 126 s
    "tests/test_cli_run.py::test_run_json_reports_the_files_and_the_fit",  # 109 s
    "tests/test_cli_run.py::test_device_map_places_the_model_with_accelerate",  # 86 s
    "tests/test_cli_run.py::test_interrupted_run_leaves_nothing",  # 83 s
    "tests/test_cli_run.py::test_run_local_model_and_txt",  # 76 s
    "tests/test_hub.py::test_zoo_build_publish_validate",  # 111 s
    "tests/test_cli_json.py::test_refit_and_merge_json",  # 104 s
    "tests/test_cli_json.py::test_zoo_build_json",  # 32 s
    "tests/test_cli_ux.py::test_audit_allow_other_model",  # 48 s
    "tests/test_cli_ux.py::test_compared_panels_share_one_colour_scale_and_show_values",  # 27 s
    "tests/test_cli_ux.py::test_figures_read_as_plain_numbers_and_say_when_nothing_is_flagged",  # 25 s
    "tests/test_model_identity.py::test_audit_and_eval_take_model_id",  # 31 s
    "tests/test_resources.py::test_full_disk_cli_sites",  # 31 s
    "tests/test_resources.py::test_output_size_estimate_bounds_what_a_run_writes",  # 13 s
    "tests/test_key_basis.py::test_threshold_between_heads_swaps_exactly_the_heads_above_it",  # 51 s
    "tests/test_key_basis.py::test_threshold_zero_rotates_every_key_by_hadamard_and_keeps_values",  # 27 s
    "tests/test_key_basis.py::test_alternatives_follow_the_same_key_basis",  # 25 s
    "tests/test_key_basis.py::test_default_threshold_swaps_the_heads_above_it",  # 14 s
    "tests/test_bench_calibrate_offload.py::test_tiny_run_with_layers_on_disk_writes_the_report_and_the_same_artifact",  # 25 s
    "tests/test_checkpoint_dir.py::test_a_run_removes_only_what_it_wrote",  # 18 s
    "tests/test_hf_integration.py::test_trained_fixture_generates_text_with_a_two_bit_history",  # 59 s
    "tests/test_hf_integration.py::test_greedy_generate_with_random_artifact_on_cpu_batched_with_padding",  # 39 s
    "tests/test_hf_integration.py::test_beam_search_and_sampling_match_the_fake_quant_reference",  # 38 s
    "tests/test_hf_integration.py::test_decode_with_int2_history_matches_fake_quant_reference",  # 24 s
    "tests/test_hf_integration.py::test_generate_matches_plain_generation_with_identity_artifact_and_bf16_history",  # 22 s
    "tests/test_hf_integration.py::test_pool_grows_past_max_tokens_and_matches_the_reference",  # 16 s
    "tests/test_unbiased_quantizer.py::test_a_matching_far_key_keeps_its_attention_weight",  # 14 s
    "tests/test_help_layout.py::test_every_option_has_help_and_no_flag_shows_a_type",  # 12 s
    "tests/test_audit.py::test_cli_audit_json_and_plots",  # 12 s
    "tests/test_cache.py::test_prefix_sharing_reuses_pages_and_matches_unshared",  # 11 s
    # the second measurement, with the above slow (the suite: 958 s wall for 300 s of CPU at load 7-8)
    "tests/test_stats_validation.py",  # 126 s: its module fixture calibrates two shards (44 s), a 52 s fuzz
    "tests/test_resources.py::test_full_disk_during_run_output_is_one_line_exit_1",  # 41 + 27 s
    "tests/test_calibrate.py::test_two_runs_same_bytes",  # 38 s
    "tests/test_calibrate.py::test_artifact_contract_round_trip",  # 28 s
    "tests/test_calibrate.py::test_fitted_clip_beats_global_ratios_on_heldout",  # 19 s
    "tests/test_calibrate.py::test_layer_granularity_shares_rotation_across_heads",  # 7 s
    "tests/test_capture_stats.py::test_targets_match_naive_recomputation",  # 50 s over its cases
    "tests/test_cache.py::test_decode_matches_dense_fake_quantized_reference",  # 16 + 16 s
    "tests/vllm/test_engine.py::test_static_step_reuses_its_buffers_and_equals_the_eager_plan",  # 23 s
    "tests/test_release_pinning.py::test_fuzz_release_record_roundtrip",  # 14 s
    "tests/test_release_pinning.py::test_fuzz_release_record_fields",  # 5 s
    "tests/test_audit.py::test_capture_and_error_measures",  # 13 s
    "tests/test_hf_integration.py::test_unsized_cache_serves_num_return_sequences_like_the_reference",  # 9 s
    "tests/test_hf_integration.py::test_serving_past_the_fitted_context_warns_once",  # 6 s
    "tests/test_hf_integration.py::test_identity_artifact_matches_plain_model_while_history_is_bf16",  # 5 s
    "tests/test_hf_integration.py::test_from_pretrained_pulls_a_pinned_release_and_generates",  # 5 s
    "tests/test_runtime_without_triton.py",  # 6 s: a fresh interpreter with Triton hidden
    "tests/test_key_basis.py::test_threshold_one_keeps_the_attention_aware_keys",  # 6 s
    "tests/test_scale.py::test_artifact_bits_do_not_depend_on_the_thread_count",  # 6 s
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
