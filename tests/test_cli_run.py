"""`oscar-calib run`: the demo, local datasets, and every bad input (clear message, non-zero exit, nothing written)."""

import json

import pytest
import torch
from cli_helpers import run_cli
from tiny_models import tiny_model

from oscar_calib.demo import byte_tokenizer
from runtime_kernels.artifact import read_artifact


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 saved with a byte-level tokenizer, as a local model directory."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=64, num_layers=2, vocab_size=260,
               max_position_embeddings=512).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    gen = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "rotation", "head", "token", "query"]
    docs = [" ".join(words[int(i)] for i in torch.randint(0, 10, (60,), generator=gen)) for _ in range(40)]
    path.write_text("\n\n".join(docs))
    return path


def _nothing_written(parent, name):
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")], "temporary files left behind"


def _args(model_dir, data, out, *extra):
    return ["run", "--model", str(model_dir), "--dataset", str(data), "--out", str(out), "--samples", "2",
            "--seq-len", "64", "--sink", "4", "--recent", "8", *extra]


def test_run_local_model_and_txt(model_dir, text_file, tmp_path, monkeypatch, capsys):
    out = tmp_path / "art"
    code, stdout, stderr = run_cli(_args(model_dir, text_file, out), monkeypatch, capsys)
    assert code == 0, stderr
    assert stdout.strip() == str(out)
    art = read_artifact(out)
    assert art.metadata["model_id"] == str(model_dir)
    calib = json.loads(art.metadata["calibration"])
    assert calib["samples"] == 2 and calib["seq_len"] == 64 and calib["tokens"] == 128 and calib["seed"] == 0
    # the clips are fitted on a held-out sequence of the model's context (its config says 512)
    assert calib["holdout_len"] == 512 and calib["holdout_tokens"] == 512
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model:")
    # the card's bits follow the artifact: 2-bit codes + 8-bit scale and zero per 64-channel row, 4 + 8 BF16 tokens
    want = lambda n: ((n - 12) * (2 + 2 * 8 / 64) + 12 * 16) / n  # noqa: E731
    assert f"{want(131072):.3f} bits per KV element at 128K context, {want(32768):.3f} at 32K" in card
    assert "quantizer `uniform_minmax`, scales `ue5m3`" in card
    # the card names the KV heads whose keys took the Hadamard rotation, as the artifact records them
    heads = {int(k): v for k, v in calib["key_basis"]["hadamard_heads"].items()}
    if heads:
        n = sum(map(len, heads.values()))
        assert f"| key basis | Hadamard keys in {n} of {art.k_rotation.shape[:2].numel()} KV heads (layer:heads " in card
    else:
        assert "| key basis | the attention-aware rotation in every KV head (no head's held-out queries" in card
    log = json.loads((out / "calibration_log.json").read_text())
    assert log["choices"]["device"]["reason"] == "no GPU visible"
    assert set(log["timings"]) >= {"load_s", "forward_capture_s", "solve_s", "write_s", "total_s"}
    assert "device=cpu: no GPU visible" in stderr
    # refuses to overwrite, then overwrites with --overwrite
    before = (out / "oscar_kv.safetensors").read_bytes()
    code, _, stderr = run_cli(_args(model_dir, text_file, out), monkeypatch, capsys)
    assert code == 2 and "already exists" in stderr and "--overwrite" in stderr
    assert (out / "oscar_kv.safetensors").read_bytes() == before
    code, _, stderr = run_cli(_args(model_dir, text_file, out, "--overwrite", "--granularity", "layer"),
                              monkeypatch, capsys)
    assert code == 0, stderr
    assert read_artifact(out).metadata["granularity"] == "layer"


def test_run_jsonl_and_dataset_folder(model_dir, tmp_path, monkeypatch, capsys):
    rows = [{"body": f"document {i} " + "token " * 50} for i in range(30)]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    code, _, stderr = run_cli(_args(model_dir, jsonl, tmp_path / "a", "--text-column", "body"), monkeypatch, capsys)
    assert code == 0, stderr
    # A folder of data files goes through `datasets` streaming (the Hub code path, offline).
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text(jsonl.read_text())
    code, _, stderr = run_cli(_args(model_dir, folder, tmp_path / "b", "--text-column", "body"), monkeypatch, capsys)
    assert code == 0, stderr
    calib = json.loads(read_artifact(tmp_path / "b").metadata["calibration"])
    assert calib["dataset"] == str(folder) and calib["split"] == "train"


@pytest.mark.parametrize(
    "case,expected_code,message",
    [
        ("unknown_model", 2, "--model /nonexistent/model: no such directory"),
        ("no_text_column", 2, "no text column 'text'"),
        ("folder_no_text_column", 2, "no text column 'text'"),
        ("too_few_tokens", 2, "needs"),
        ("seq_len_too_long", 2, "--seq-len 1024: above the model's max_position_embeddings=512"),
        ("head_dim_not_pow2", 2, "head_dim=48 is not a power of two"),
        ("out_is_file", 2, "is a file"),
        ("nan_activations", 3, "contain NaN or Inf"),
        ("bad_granularity", 2, "granularity"),
    ],
)
def test_bad_input(case, expected_code, message, model_dir, text_file, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    model, data, extra = str(model_dir), str(text_file), []
    if case == "unknown_model":
        model = "/nonexistent/model"
    elif case == "no_text_column":
        data = tmp_path / "x.jsonl"
        data.write_text('{"content": "hello"}\n')
    elif case == "folder_no_text_column":
        data = tmp_path / "folder"
        data.mkdir()
        (data / "train.jsonl").write_text('{"content": "hello"}\n')
    elif case == "too_few_tokens":
        extra = ["--samples", "5000"]
    elif case == "seq_len_too_long":
        extra = ["--seq-len", "1024"]
    elif case == "head_dim_not_pow2":
        model = tmp_path / "hd48"
        tiny_model("llama", num_heads=4, num_kv_heads=2, head_dim=48, num_layers=1, vocab_size=260).save_pretrained(model)
        byte_tokenizer().save_pretrained(model)
    elif case == "out_is_file":
        out.write_text("not a directory")
    elif case == "nan_activations":
        model = tmp_path / "nan"
        m = tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=64, num_layers=1, vocab_size=260)
        with torch.no_grad():
            m.model.layers[0].self_attn.v_proj.weight[3, 3] = float("inf")
        m.save_pretrained(model)
        byte_tokenizer().save_pretrained(model)
    elif case == "bad_granularity":
        extra = ["--granularity", "token"]
    args = _args(model, data, out) + extra
    code, stdout, stderr = run_cli(args, monkeypatch, capsys)
    assert code == expected_code, stderr
    assert message in stderr
    if case == "bad_granularity":  # a choice option: click refuses it as a usage error, listing the choices
        assert "'token' is not one of 'head', 'layer'" in " ".join(stderr.replace("│", " ").split())
    else:
        assert [line for line in stderr.splitlines() if line.startswith("Error:")] != []
    assert "Traceback" not in stderr
    if case == "out_is_file":
        assert out.read_text() == "not a directory"
    else:
        _nothing_written(tmp_path, "out")


def test_demo_runs_without_arguments(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = run_cli(["run"], monkeypatch, capsys)
    assert code == 0, stderr
    art = read_artifact(tmp_path / "zoo" / "demo")
    assert art.num_layers >= 1
    assert "no --model" in stderr and "no --dataset" in stderr


def test_interrupted_run_leaves_nothing(model_dir, text_file, tmp_path, monkeypatch, capsys):
    import oscar_calib.calibration.job as job

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "write_artifact", interrupted)  # interrupt while the artifact is being written
    code, _, stderr = run_cli(_args(model_dir, text_file, tmp_path / "out"), monkeypatch, capsys)
    assert code == 130 and "nothing was written" in stderr
    _nothing_written(tmp_path, "out")


def test_chat_template_wraps_texts_and_messages(tmp_path, monkeypatch, capsys):
    from oscar_calib.calibration.data import load_calibration_data
    from oscar_calib.config import DataConfig

    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    rows = [{"messages": [{"role": "user", "content": f"q{i} " * 20}, {"role": "assistant", "content": "a " * 20}]}
            for i in range(10)]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = load_calibration_data(DataConfig(dataset=str(path), samples=2, seq_len=32, chat_template=True), tok)
    text = tok.decode(data.input_ids[0].tolist() + data.holdout_ids[0].tolist())
    assert "<user>q" in text and "<assistant>a" in text
    # Without --chat-template the 'messages' rows have no text column: a clear error.
    from oscar_calib.errors import InputError

    with pytest.raises(InputError, match="no text column 'text'"):
        load_calibration_data(DataConfig(dataset=str(path), samples=2, seq_len=32), tok)
    tok.chat_template = None
    with pytest.raises(InputError, match="has no chat template"):
        load_calibration_data(DataConfig(dataset=str(path), samples=2, seq_len=32, chat_template=True), tok)


def test_packing_and_seeded_shuffle(tmp_path):
    from oscar_calib.calibration.data import load_calibration_data
    from oscar_calib.config import DataConfig

    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(f"doc{i:02d} " + "x" * 10 for i in range(30)))
    tok = byte_tokenizer()
    a = load_calibration_data(DataConfig(dataset=str(path), samples=3, seq_len=40, seed=1), tok)
    b = load_calibration_data(DataConfig(dataset=str(path), samples=3, seq_len=40, seed=1), tok)
    c = load_calibration_data(DataConfig(dataset=str(path), samples=3, seq_len=40, seed=2), tok)
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)
    assert a.input_ids.shape == (3, 40) and a.holdout_ids.shape == (1, 40)
    # Documents are packed back to back with EOS between them: no padding, full sequences.
    flat = torch.cat([a.input_ids.flatten(), a.holdout_ids.flatten()]).tolist()
    assert flat.count(tok.eos_token_id) >= 160 // 17 - 1


def test_demo_falls_back_to_a_random_model_without_the_fixture(tmp_path, monkeypatch, capsys):
    import oscar_calib.demo as demo

    monkeypatch.setattr(demo, "fixture_available", lambda: False)
    code, _, stderr = run_cli(["run", "--out", str(tmp_path / "d")], monkeypatch, capsys)
    assert code == 0, stderr
    art = read_artifact(tmp_path / "d")
    assert art.metadata["model_id"] == demo.DEMO_MODEL_ID and art.head_dim == 64
    assert json.loads(art.metadata["calibration"])["dataset"].endswith("demo.txt")


def test_device_map_places_the_model_with_accelerate(model_dir, text_file, tmp_path, monkeypatch, capsys):
    code, _, stderr = run_cli(_args(model_dir, text_file, tmp_path / "dm", "--device-map", "auto"), monkeypatch, capsys)
    assert code == 0, stderr
    assert "device_map=auto" in stderr
    log = json.loads((tmp_path / "dm" / "calibration_log.json").read_text())
    assert log["config"]["device_map"] == "auto"
    code, _, stderr = run_cli(_args(model_dir, text_file, tmp_path / "dm2", "--device-map", "everywhere"),
                              monkeypatch, capsys)
    assert code == 2 and "--device-map" in stderr
    _nothing_written(tmp_path, "dm2")


def test_run_json_reports_the_files_and_the_fit(model_dir, text_file, tmp_path, monkeypatch, capsys):
    import hashlib

    out = tmp_path / "art"
    code, stdout, stderr = run_cli(_args(model_dir, text_file, out, "--json"), monkeypatch, capsys)
    assert code == 0, stderr
    result = json.loads(stdout)
    artifact = out / "oscar_kv.safetensors"
    assert result["artifact"] == str(artifact) and result["layer_ids"] == read_artifact(out).layer_ids.tolist()
    assert result["artifact_sha256"] == hashlib.sha256(artifact.read_bytes()).hexdigest()
    assert result["summary"]["key_objective"] == "block_out" and result["summary"]["clip_at_grid_edge"] == 0


def test_run_lists_and_checks_the_solver_choices(model_dir, text_file, tmp_path, monkeypatch, capsys):
    code, _, stderr = run_cli(_args(model_dir, text_file, tmp_path / "x", "--key-objective", "kl"), monkeypatch, capsys)
    flat = " ".join(stderr.replace("│", " ").split())  # rich draws the usage error in a box
    assert code == 2 and "'kl' is not one of" in flat and "block_out" in flat
    assert not (tmp_path / "x").exists()


def test_no_clip_writes_unclipped_ratios_and_records_it(model_dir, text_file, tmp_path, monkeypatch, capsys):
    """--no-clip: every clip ratio 1 (nothing searched), recorded in the recipe; the default run clips some heads."""
    code, _, err = run_cli(_args(model_dir, text_file, tmp_path / "nc", "--no-clip"), monkeypatch, capsys)
    assert code == 0, err
    art = read_artifact(tmp_path / "nc")
    assert bool((art.k_clip_ratio == 1).all()) and bool((art.v_clip_ratio == 1).all())
    assert json.loads(art.metadata["calibration"])["solver"]["clip"] is False
    code, _, err = run_cli(_args(model_dir, text_file, tmp_path / "c"), monkeypatch, capsys)
    assert code == 0, err
    clipped = read_artifact(tmp_path / "c")
    assert bool((clipped.k_clip_ratio < 1).any() or (clipped.v_clip_ratio < 1).any())
    assert torch.equal(clipped.k_rotation, art.k_rotation)  # only the clips differ


def test_quantizer_flag_is_recorded_and_an_unknown_one_refused(model_dir, text_file, tmp_path, monkeypatch, capsys):
    """--quantizer: the artifact's metadata and recipe carry it (default uniform_minmax); only a min-max artifact
    exports to the reference's format; an unknown name is exit 2 naming the flag, with nothing written."""
    code, _, err = run_cli(_args(model_dir, text_file, tmp_path / "mm", "--no-centered"), monkeypatch, capsys)
    assert code == 0, err
    art = read_artifact(tmp_path / "mm")
    assert art.quantizer == "uniform_minmax"
    assert json.loads(art.metadata["calibration"])["solver"]["kv_format"]["quantizer"] == "uniform_minmax"
    code, _, err = run_cli(["export", str(tmp_path / "mm"), "--out", str(tmp_path / "ref")], monkeypatch, capsys)
    assert code == 0, err
    code, _, err = run_cli(_args(model_dir, text_file, tmp_path / "ub", "--quantizer", "uniform_unbiased",
                                 "--no-centered"), monkeypatch, capsys)
    assert code == 0, err
    assert read_artifact(tmp_path / "ub").quantizer == "uniform_unbiased"
    code, _, err = run_cli(["export", str(tmp_path / "ub"), "--out", str(tmp_path / "ref2")], monkeypatch, capsys)
    assert code != 0 and "field 'quantizer' is 'uniform_unbiased'" in " ".join(err.split())
    assert not (tmp_path / "ref2").exists()
    code, _, err = run_cli(_args(model_dir, text_file, tmp_path / "x", "--quantizer", "lloyd"), monkeypatch, capsys)
    flat = " ".join(err.split())
    assert code == 2 and "--quantizer" in flat and "'lloyd' is not one of" in flat
    assert not (tmp_path / "x").exists()
