"""Calibrating at scale (issue 20): statistics files, refit, merge, data parallel, checkpoint/resume, offload.

Every equality here is on the bytes (sha256) of what `oscar-calib run` writes, against an uninterrupted
one-process run with the same settings (`reference`), unless the test says how close it asserts.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from safetensors import safe_open
from tiny_models import tiny_model

from oscar_calib.calibration.calibrate import artifact_from_statistics, capture_statistics
from oscar_calib.calibration.job import shard_range
from oscar_calib.calibration.solve import hadamard
from oscar_calib.calibration.stats_file import (
    STATS_FILENAME,
    load_statistics,
    merge_statistics,
    save_statistics,
)
from oscar_calib.cli import main
from oscar_calib.config import SolverSettings
from oscar_calib.demo import byte_tokenizer
from oscar_calib.errors import InputError
from oscar_calib.placement import describe_placement, parse_max_memory
from runtime_kernels.artifact import read_artifact

EPOCH = "1700000000"
ROOT = Path(__file__).resolve().parent.parent
SAMPLES = 5  # odd: the last data-parallel round has an idle rank




def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digests(out: Path) -> dict[str, str]:
    return {name: sha(out / name) for name in ("oscar_kv.safetensors", STATS_FILENAME)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=64, num_layers=2, vocab_size=260,
               max_position_embeddings=512, seed=1).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    gen = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "rotation", "head", "token", "query"]
    path.write_text("\n\n".join(" ".join(words[int(i)] for i in torch.randint(0, 10, (60,), generator=gen))
                                for _ in range(20)))
    return path


WINDOWS = ("--sink", "4", "--recent", "8")
SMALL_WINDOWS = SolverSettings(kv_format={"sink_tokens": 4, "recent_tokens": 8})  # the test sequences are short: windows they exceed, run and refit alike


def args(model_dir, text_file, out, *extra):
    return ["run", "--model", str(model_dir), "--dataset", str(text_file), "--out", str(out),
            "--samples", str(SAMPLES), "--seq-len", "32", *WINDOWS, *extra]


@pytest.fixture(autouse=True)
def _fixed_time(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)


@pytest.fixture(scope="module")
def reference(model_dir, text_file, tmp_path_factory):
    """An uninterrupted one-process run: its output directory."""
    out = tmp_path_factory.mktemp("ref") / "art"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
        mp.setattr(sys, "argv", ["oscar-calib", *args(model_dir, text_file, out)])
        with pytest.raises(SystemExit) as exc:
            main()
    assert exc.value.code == 0
    return out


def subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(SOURCE_DATE_EPOCH=EPOCH, OSCAR_CALIB_DIST_TIMEOUT="60", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT / "tests") + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def run_sub(cmd: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def torchrun(*cmd: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *cmd]


# -- statistics file, refit, merge -------------------------------------------------------------------------------
def test_refit_reproduces_the_run_byte_for_byte(reference, tmp_path, monkeypatch, capsys):
    stats = load_statistics(reference)
    meta = stats.provenance
    assert meta.sample_ranges == [[0, SAMPLES]] and meta.data["seed"] == 0 and meta.data["seq_len"] == 32
    assert meta.capture == {"dtype": "float32", "batch_size": 1, "holdout_queries": 256, "seed": 0}
    assert stats.holdout, "the held-out capture travels with the sums"
    code, stdout, stderr = run_cli(["refit", str(reference / STATS_FILENAME), "--out", str(tmp_path / "r"), *WINDOWS],
                                   monkeypatch, capsys)
    assert code == 0, stderr
    assert digests(tmp_path / "r") == digests(reference)
    # A refit with other solver settings changes the artifact, through the same code path.
    code, _, stderr = run_cli(["refit", str(reference), "--out", str(tmp_path / "l"), "--granularity", "layer", *WINDOWS],
                              monkeypatch, capsys)
    assert code == 0, stderr
    art = read_artifact(tmp_path / "l")
    assert art.metadata["granularity"] == "layer" and torch.equal(art.k_rotation[:, 0], art.k_rotation[:, 1])
    # --hadamard-key-mass reaches the refit: at 0 every KV head whose queries read the history takes Hadamard keys.
    code, _, stderr = run_cli(["refit", str(reference), "--out", str(tmp_path / "h"), "--hadamard-key-mass", "0",
                               *WINDOWS], monkeypatch, capsys)
    assert code == 0, stderr
    art, ref = read_artifact(tmp_path / "h"), read_artifact(reference)
    chosen = json.loads(art.metadata["calibration"])["key_basis"]["hadamard_heads"]
    assert chosen == {"0": [0, 1], "1": [0, 1]}
    assert torch.equal(art.k_rotation, hadamard(64).float().expand_as(art.k_rotation))
    assert torch.equal(art.v_rotation, ref.v_rotation)
    log = json.loads((reference / "calibration_log.json").read_text())
    d, h_kv, layers = 64, 2, 2
    assert log["memory"]["accumulator_bytes"] == layers * (3 * h_kv * d * d + h_kv + 2 * h_kv * d) * 8  # O(A H_kv d^2)
    assert log["memory"]["host_peak_bytes"] > 2**20 and log["run"]["world_size"] == 1


def test_merge_of_two_halves_equals_the_whole(model_dir, text_file, tmp_path, monkeypatch, capsys, reference):
    for i in range(2):
        code, _, stderr = run_cli(args(model_dir, text_file, tmp_path / f"s{i}", "--shard", f"{i}/2"), monkeypatch, capsys)
        assert code == 0, stderr
    merged_path = tmp_path / "merged.safetensors"
    code, _, stderr = run_cli(["stats", "merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(merged_path)],
                              monkeypatch, capsys)
    assert code == 0, stderr
    merged, whole = load_statistics(merged_path), load_statistics(reference)
    assert merged.provenance.sample_ranges == [[0, SAMPLES]]
    assert load_statistics(tmp_path / "s0").provenance.sample_ranges == [[0, 2]]
    for layer in whole.stats:
        a, b = merged.stats[layer], whole.stats[layer]
        assert (a.query_count, a.token_count) == (b.query_count, b.token_count)
        for name in ("key_sum", "attn_out_sum", "logit_v_sum", "logit_w_sum", "key_vec_sum", "value_vec_sum"):
            x, y = getattr(a, name), getattr(b, name)
            # (s0 + s1) + (s2 + s3 + s4) against (((s0 + s1) + s2) + s3) + s4: fp64 summation order only. The
            # per-batch terms are fp32 products, so a few of them add exactly in fp64 (measured: 0); allow 4 ulp.
            assert ((x - y).abs().max() / y.abs().max()).item() <= 4 * torch.finfo(torch.float64).eps, name
    art_m, _ = artifact_from_statistics(merged, SMALL_WINDOWS, compare_alternatives=False)
    art_w = read_artifact(reference)
    assert torch.equal(art_m.k_clip_ratio, art_w.k_clip_ratio) and torch.equal(art_m.v_clip_ratio, art_w.v_clip_ratio)
    assert (art_m.k_rotation - art_w.k_rotation).abs().max() < 1e-6  # measured: 0 (the sums are the same bits)
    assert (art_m.v_rotation - art_w.v_rotation).abs().max() < 1e-6
    # Refusals name the field.
    code, _, stderr = run_cli(["stats", "merge", str(tmp_path / "s0"), str(tmp_path / "s0"), "--out",
                               str(tmp_path / "x.safetensors")], monkeypatch, capsys)
    assert code == 2 and "sample_ranges" in stderr and not (tmp_path / "x.safetensors").exists()
    other = load_statistics(tmp_path / "s1")
    other.provenance.data["seed"] = 7
    save_statistics(other, tmp_path / "seed7.safetensors")
    other.provenance.data["seed"] = 0
    other.provenance.tool_version = "oscar-calib 0.0.1"
    save_statistics(other, tmp_path / "old.safetensors")
    for bad, field in (("seed7", "'data.seed'"), ("old", "'tool_version'")):
        code, _, stderr = run_cli(["stats", "merge", str(tmp_path / "s0"), str(tmp_path / f"{bad}.safetensors"),
                                   "--out", str(tmp_path / "x.safetensors")], monkeypatch, capsys)
        assert code == 2 and field in stderr, stderr


def test_statistics_merge_by_addition_in_memory():
    """capture_statistics on two sample halves, merged, against the whole (library level, any order of halves)."""
    model = tiny_model("llama", num_heads=4, num_kv_heads=4, head_dim=64, num_layers=1)
    ids = torch.randint(0, 256, (5, 16), generator=torch.Generator().manual_seed(2))
    hold = ids[-1:]
    whole = capture_statistics(model, ids[:4], hold, holdout_queries=8)
    a = capture_statistics(model, ids[:2], hold, holdout_queries=8, sample_ranges=[[0, 2]])
    b = capture_statistics(model, ids[2:4], hold, holdout_queries=8, sample_ranges=[[2, 4]])
    merged = merge_statistics([("b", b), ("a", a)], "2023-11-14T22:13:20Z")
    assert merged.provenance.sample_ranges == [[0, 4]]
    torch.testing.assert_close(merged.stats[0].key_sum, whole.stats[0].key_sum, rtol=4e-16, atol=0)
    c = capture_statistics(model, ids[1:3], hold, holdout_queries=8, sample_ranges=[[1, 3]])
    with pytest.raises(InputError, match="sample_ranges"):
        merge_statistics([("a", a), ("c", c)], "")


def test_bad_statistics_files_are_refused(tmp_path, monkeypatch, capsys, reference):
    code, _, stderr = run_cli(["refit", str(reference / "oscar_kv.safetensors"), "--out", str(tmp_path / "o")],
                              monkeypatch, capsys)
    assert code == 2 and "'format'" in stderr and "oscar-stats" in stderr and not (tmp_path / "o").exists()
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    code, _, stderr = run_cli(["refit", str(tmp_path / "junk.safetensors"), "--out", str(tmp_path / "o")],
                              monkeypatch, capsys)
    assert code == 2 and "junk.safetensors" in stderr and not (tmp_path / "o").exists()
    code, _, stderr = run_cli(["stats", "merge", str(reference), "--out", str(tmp_path / "m.safetensors")],
                              monkeypatch, capsys)
    assert code == 2 and "at least two" in stderr
    code, _, stderr = run_cli(["stats", "merge", str(reference), str(reference), "--out", str(tmp_path)],
                              monkeypatch, capsys)
    assert code == 2 and "is a directory" in stderr
    code, _, stderr = run_cli(["refit", str(reference), "--out", str(tmp_path / "o"), "--device", "tpu"],
                              monkeypatch, capsys)
    assert code == 2 and "--device tpu" in stderr and not (tmp_path / "o").exists()


# -- data parallel -------------------------------------------------------------------------------------------------
@pytest.mark.slow  # subprocesses (torch + transformers start-up each); still part of `make test`
def test_two_gloo_ranks_give_the_one_process_bytes(model_dir, text_file, tmp_path, reference):
    out = tmp_path / "dp"
    proc = run_sub(torchrun("-m", "oscar_calib", *args(model_dir, text_file, out)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data_parallel=2 ranks (gloo)" in proc.stderr
    assert digests(out) == digests(reference)  # batches added in sample order on rank 0: the same bits
    assert json.loads((out / "calibration_log.json").read_text())["run"]["world_size"] == 2


@pytest.mark.slow  # subprocesses (torch + transformers start-up each); still part of `make test`
def test_a_killed_rank_fails_the_job_with_no_artifact(model_dir, text_file, tmp_path):
    out = tmp_path / "dp"
    proc = run_sub(torchrun(str(ROOT / "tests" / "fault_runner.py"), "forward:2", "KILL", "1", "--",
                            *args(model_dir, text_file, out)))
    assert proc.returncode != 0
    # the launcher stops rank 0 and names the root cause: rank 1, killed
    assert "Signal 9 (SIGKILL)" in proc.stderr and "rank      : 1" in proc.stderr, proc.stderr[-3000:]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".dp.")]


def test_a_dead_peer_turns_into_a_clear_capture_error(monkeypatch):
    """Without a launcher to stop the others, the collective itself fails and names the rank."""
    import multiprocessing as mp
    import socket

    import fault_runner

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=fault_runner.gather_with_a_dead_peer, args=(r, port, queue)) for r in (0, 1)]
    monkeypatch.setenv("OSCAR_CALIB_DIST_TIMEOUT", "30")  # the children inherit it
    try:
        for p in procs:
            p.start()
        message = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert message.startswith("CaptureError: data parallel: rank 0 of 2: exchanging statistics"), message
    assert "no artifact is written" in message


# -- checkpoint and resume -----------------------------------------------------------------------------------------
def test_sigint_leaves_a_consistent_checkpoint_then_resume_gives_the_same_bytes(model_dir, text_file, tmp_path,
                                                                                 monkeypatch, capsys, reference):
    import oscar_calib.calibration.scale.sharded_capture as sc

    out, ckpt_dir = tmp_path / "art", tmp_path / "art.checkpoint"
    ckpt = ckpt_dir / "oscar.checkpoint.safetensors"
    real, calls = sc.forward_batch, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, delivered inside the third batch
        return real(*a, **k)

    monkeypatch.setattr(sc, "forward_batch", interrupted)
    code, _, stderr = run_cli(args(model_dir, text_file, out, "--checkpoint-every", "1"), monkeypatch, capsys)
    assert code == 130 and "kept for --resume" in stderr
    assert not out.exists() and ckpt.exists()
    with safe_open(str(ckpt), "pt") as f:
        assert f.metadata()["next_sample"] == "2"  # the two whole batches before the interrupt
    # A resume with other settings is refused, naming the field; the checkpoint stays.
    code, _, stderr = run_cli(args(model_dir, text_file, out, "--resume", "--seed", "1"), monkeypatch, capsys)
    assert code == 2 and "data.seed=0" in stderr and "data.seed=1" in stderr and ckpt.exists()
    code, _, stderr = run_cli(args(model_dir, text_file, out, "--resume", "--dtype", "bfloat16"), monkeypatch, capsys)
    assert code == 2 and "capture.dtype" in stderr
    monkeypatch.setattr("oscar_calib.calibration.stats_file.__version__", "9.9.9")
    code, _, stderr = run_cli(args(model_dir, text_file, out, "--resume"), monkeypatch, capsys)
    assert code == 2 and "tool_version" in stderr
    monkeypatch.undo()
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    code, _, stderr = run_cli(args(model_dir, text_file, out, "--resume"), monkeypatch, capsys)
    assert code == 0, stderr
    assert "resumed from the checkpoint at sample 2" in stderr
    assert digests(out) == digests(reference) and not ckpt_dir.exists()


@pytest.mark.slow  # subprocesses (torch + transformers start-up each); still part of `make test`
def test_sigkill_at_several_points_then_resume_gives_the_same_bytes(model_dir, text_file, tmp_path, reference):
    out, ckpt_dir = tmp_path / "art", tmp_path / "art.checkpoint"
    ckpt = ckpt_dir / "oscar.checkpoint.safetensors"
    runner = [sys.executable, str(ROOT / "tests" / "fault_runner.py")]
    run_args = args(model_dir, text_file, out, "--checkpoint-every", "1")
    # 1: killed inside the second batch (one checkpoint on disk); 2: killed between writing the next checkpoint
    # and renaming it into place; 3: killed just after a checkpoint; then a resume runs to the end.
    for fault, resume, position in (("forward:2", [], 1), ("replace:1", ["--resume"], 1),
                                    ("checkpoint:1", ["--resume"], 2)):
        proc = run_sub([*runner, fault, "KILL", "--", *run_args, *resume])
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        assert not out.exists()
        with safe_open(str(ckpt), "pt") as f:  # always a whole checkpoint, at the last completed position
            assert f.metadata()["next_sample"] == str(position), fault
    proc = run_sub([sys.executable, "-m", "oscar_calib", *run_args, "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from the checkpoint at sample 2" in proc.stderr
    assert digests(out) == digests(reference)
    assert not ckpt_dir.exists() and not list(tmp_path.glob(".art.checkpoint*"))


# -- placement -----------------------------------------------------------------------------------------------------
def test_disk_offload_gives_the_same_artifact(model_dir, text_file, tmp_path, monkeypatch, capsys, reference):
    out = tmp_path / "off"
    code, _, stderr = run_cli(args(model_dir, text_file, out, "--device-map", "sequential", "--max-memory", "cpu=100KB",
                                   "--max-memory", "disk=1GiB"), monkeypatch, capsys)
    assert code == 0, stderr
    assert "placement (accelerate)" in stderr and "disk" in stderr
    log = json.loads((out / "calibration_log.json").read_text())
    assert "disk" in log["placement"].values() and log["config"]["max_memory"] == {"cpu": 100_000, "disk": 2**30}
    assert digests(out) == digests(reference)


def test_bad_scale_options(model_dir, text_file, tmp_path, monkeypatch, capsys):
    cases = [
        (["--max-memory", "cpu=1GiB"], "--max-memory needs --device-map"),
        (["--device-map", "auto", "--max-memory", "cpu=lots"], "--max-memory cpu=lots"),
        (["--device-map", "auto", "--max-memory", "gpu0=1GiB"], "unknown device 'gpu0'"),
        (["--shard", "2/2"], "--shard 2/2"),
        (["--shard", "one"], "--shard 'one'"),
        (["--resume"], "--resume: no checkpoint"),
    ]
    for extra, message in cases:
        code, _, stderr = run_cli(args(model_dir, text_file, tmp_path / "bad", *extra), monkeypatch, capsys)
        assert code == 2 and message in stderr, (extra, stderr)
        assert not (tmp_path / "bad").exists()


def test_parse_max_memory_and_placement_text():
    assert parse_max_memory(["0=2GiB", "cpu=1MB"]) == {"0": 2**31, "cpu": 1_000_000}
    assert parse_max_memory(['{"1": "1KiB", "disk": 5}']) == {"1": 1024, "disk": 5}
    assert parse_max_memory(["cpu=1438696", '{"0": "2048"}']) == {"cpu": 1438696, "0": 2048}  # bare byte counts
    assert parse_max_memory(None) is None
    for bad in (["cpu"], ["{not json"], ["cpu=-1"], ["cpu=0"], ["cpu=12 parsecs"]):
        with pytest.raises(InputError, match="--max-memory"):
            parse_max_memory(bad)
    text = describe_placement({"model.embed_tokens": "cuda:0", "model.layers.0": "cuda:0", "model.layers.1": "cuda:0",
                               "model.layers.2": "cpu", "model.layers.4": "cpu", "model.norm": "disk"})
    assert text.splitlines() == ["cuda:0: layers 0-1; model.embed_tokens", "cpu: layers 2,4", "disk: model.norm"]


def test_shard_ranges_cover_the_samples_once():
    for samples, bs, count in ((10, 3, 3), (7, 1, 2), (4, 4, 1)):
        ranges = [shard_range(samples, (i, count), bs) for i in range(count)]
        assert ranges[0][0] == 0 and ranges[-1][1] == samples
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(start % bs == 0 for start, _ in ranges)
    with pytest.raises(InputError, match="--shard 0/5"):
        shard_range(4, (0, 5), 1)


def test_artifact_from_statistics_needs_the_holdout(model_dir):
    model = tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=64, num_layers=1)
    stats = capture_statistics(model, torch.randint(0, 256, (2, 16)), holdout_queries=8)
    stats.holdout = {}
    with pytest.raises(InputError, match="held-out capture"):
        artifact_from_statistics(stats, SolverSettings())


def test_artifact_bits_do_not_depend_on_the_thread_count():
    """torchrun runs each rank with OMP_NUM_THREADS=1; the solve must give the one-process bits anyway
    (without pinning, eigh and the fp64 matmul of d = 128 targets differ in the last bit between 1 and 2 threads)."""
    from oscar_calib.calibration.capture import HoldoutRows
    from oscar_calib.calibration.stats import LayerStats
    from oscar_calib.calibration.stats_file import CalibrationStatistics, StatsProvenance

    g = torch.Generator().manual_seed(0)
    layers, h_kv, h_q, d, t, n = 2, 8, 16, 128, 16, 8

    def spd():
        x = torch.randn(h_kv, 4 * d, d, generator=g, dtype=torch.float64)
        return x.transpose(1, 2) @ x

    stats = {i: LayerStats(spd(), spd(), spd(), torch.rand(h_kv, generator=g, dtype=torch.float64) + 1,
                           torch.randn(h_kv, d, generator=g, dtype=torch.float64) * 50,
                           torch.randn(h_kv, d, generator=g, dtype=torch.float64) * 50, query_count=100, token_count=50)
             for i in range(layers)}
    holdout = {i: HoldoutRows([torch.randn(1, h_kv, t, d, generator=g)], [torch.randn(1, h_kv, t, d, generator=g)],
                              [torch.randn(1, h_q, n, d, generator=g)], [torch.arange(t - n, t)[None]])
               for i in range(layers)}
    geometry = {"num_hidden_layers": layers, "num_attention_heads": h_q, "num_key_value_heads": h_kv, "head_dim": d}
    statistics = CalibrationStatistics(stats, holdout, d ** -0.5,
                                       StatsProvenance("m", "r", "h", geometry, {}, {}, [[0, 1]], [], EPOCH))
    before = torch.get_num_threads()
    arts = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            settings = SolverSettings(kv_format={"sink_tokens": 2, "recent_tokens": 4}, key_clip_objective="out_err")  # no o_proj here
            arts.append(artifact_from_statistics(statistics, settings, compare_alternatives=False)[0])
    finally:
        torch.set_num_threads(before)
    for name, tensor in arts[0].tensors().items():
        assert torch.equal(tensor, getattr(arts[1], name)), name


def test_checkpoint_file_round_trip_and_refusals(tmp_path, reference):
    from oscar_calib.calibration.scale.checkpoint import MARKER_FILENAME, load_checkpoint, save_checkpoint
    from oscar_calib.calibration.stats import LayerStats

    totals = {3: LayerStats.zeros(2, 4)}
    totals[3].key_sum += torch.eye(4, dtype=torch.float64) * torch.arange(1, 3, dtype=torch.float64)[:, None, None]
    totals[3].query_count, totals[3].token_count = 12, 6
    identity = {"tool_version": "oscar-calib 1", "data": {"seed": 0, "samples": 8, "seq_len": 3},
                "geometry": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4}, "sample_range": [0, 8]}
    path = tmp_path / "c.checkpoint"
    save_checkpoint(path, totals, 2, identity)
    assert sorted(p.name for p in path.iterdir()) == [MARKER_FILENAME, "oscar.checkpoint.safetensors"]
    back = load_checkpoint(path, identity)
    assert back.next_sample == 2 and torch.equal(back.totals[3].key_sum, totals[3].key_sum)
    assert (back.totals[3].query_count, back.totals[3].token_count) == (12, 6)
    assert not list(path.glob(".*.tmp-*"))
    with pytest.raises(InputError, match=r"data\.samples=8.*data\.samples=16"):
        load_checkpoint(path, {**identity, "data": {"seed": 0, "samples": 16, "seq_len": 3}})
    with pytest.raises(InputError, match="not a checkpoint directory"):
        load_checkpoint(reference, identity)
    with pytest.raises(InputError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "missing", identity)
