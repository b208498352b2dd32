"""Teacher-forced evaluation: masks, the mixed-precision attention, statistics, the runtime, the CLI.

References are independent: an explicit per-position loop over `segment_attention`, the plain model,
the real runtime (`runtime_kernels.hf.OscarCache`), direct KL / error formulas.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import run_cli
from format_helpers import PAPER
from tiny_models import tiny_model
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oscar_calib.analysis import evaluate as ev
from oscar_calib.analysis.methods import ArtifactInt2, KVMethod, RowwiseInt2
from runtime_kernels.artifact import identity_artifact
from runtime_kernels.attention.naive import segment_attention


def _fmt(sink: int, recent: int, page: int = 1):
    """The windows of a test, token-granular by default (the evaluation's own default page size)."""
    return PAPER.with_(sink_tokens=sink, recent_tokens=recent, page_size=page)


def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _artifact(d=64, layers=2, clip=(0.9, 0.95)):
    art = identity_artifact(layers, 2, 4, d, fmt=PAPER)
    art.k_rotation[:] = _hadamard(d)
    art.v_rotation[:] = _hadamard(d)
    art.k_clip_ratio[:] = clip[0]
    art.v_clip_ratio[:] = clip[1]
    return art


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", head_dim=64, num_layers=2, vocab_size=256)


# ------------------------------------------------------------------------------------------------ masks
@pytest.mark.parametrize("sink,recent", [(4, 8), (0, 1), (64, 256)])
def test_exact_mask_matches_the_rule(sink, recent):
    t = 40
    m = ev.exact_mask(t, _fmt(sink, recent))
    for q in range(t):
        for j in range(q + 1):
            assert bool(m[q, j]) == (j < sink or j > q - recent), (q, j)


def test_exact_mask_with_pages_follows_the_runtime_layout():
    s, r, p, t = 3, 5, 4, 40
    m = ev.exact_mask(t, _fmt(s, r, p))
    for q in range(t):
        n = q + 1
        hist = p * (max(0, n - s - r) // p)  # runtime_kernels.cache: history is whole pages
        assert (~m[q, : q + 1]).sum() == hist
        assert bool((~m[q, s:s + hist]).all())
        # the recent window then holds between r and r + p - 1 tokens
        if hist:
            assert r <= n - s - hist <= r + p - 1


def test_exact_mask_prefill_rows_are_all_bf16():
    m = ev.exact_mask(30, _fmt(2, 4), prefill=20)
    assert bool(m[:20].all()) and not bool(m[20:].all())


# ------------------------------------------------------------------------------------------------ attention
class _Noisy(KVMethod):
    """Adds fixed noise: a quantizer stand-in whose k_hat/v_hat are known to the test."""

    def __init__(self, scale=0.3):
        super().__init__("noisy", "noise")
        self.scale = scale

    def quantizes(self, layer_idx):
        return True

    def fake_quantize(self, layer_idx, keys, values, windows):
        g = torch.Generator().manual_seed(layer_idx)
        return (keys.float() + self.scale * torch.randn(keys.shape, generator=g),
                values.float() + self.scale * torch.randn(values.shape, generator=g))


_SLOW = {}


def _slow_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Reference: for every query position, build its mixed K/V explicitly and attend with segment_attention."""
    method, sink, recent = _SLOW["method"], _SLOW["sink"], _SLOW["recent"]
    b, h_q, t, d = query.shape
    k_hat, v_hat = method.fake_quantize(module.layer_idx, key, value, _fmt(sink, recent))
    outs = []
    for pos in range(t):
        j = torch.arange(pos + 1)
        exact = (j < sink) | (j > pos - recent)
        kk = torch.where(exact[None, None, :, None], key[:, :, :pos + 1].float(), k_hat[:, :, :pos + 1])
        vv = torch.where(exact[None, None, :, None], value[:, :, :pos + 1].float(), v_hat[:, :, :pos + 1])
        o, _ = segment_attention(query[:, :, pos].float(), kk, vv, scale=scaling)
        outs.append(o)
    return torch.stack(outs, dim=1).to(query.dtype), None  # [B, T, H_q, d]


@pytest.mark.parametrize("method", [_Noisy(), RowwiseInt2("int2", fmt=PAPER)], ids=["noisy", "int2"])
def test_mixed_attention_equals_a_per_position_loop(model, method):
    sink, recent = 3, 7
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    AttentionInterface.register("slow_ref", _slow_attention)
    AttentionMaskInterface.register("slow_ref", sdpa_mask)
    _SLOW.update(method=method, sink=sink, recent=recent)
    model.set_attn_implementation("slow_ref")
    try:
        with torch.no_grad():
            ref = model(input_ids=ids, use_cache=False).logits
    finally:
        model.set_attn_implementation("sdpa")
    with torch.no_grad(), ev.evaluating(model, ev.EvalSession(method, _fmt(sink, recent))):
        fast = model(input_ids=ids, use_cache=False).logits
    assert model.config._attn_implementation == "sdpa"  # restored
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)


def test_bf16_method_equals_plain_model_perplexity(model):
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    direct = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    nll, session = ev.method_nll(model, KVMethod(), ids, _fmt(4, 8))
    assert nll.shape == (2, 47)
    assert float(nll.mean()) == pytest.approx(float(direct), rel=1e-5)
    assert session.layers == {}  # nothing quantized, nothing to report


def test_slices_of_query_rows_and_of_the_head_change_no_number(model, monkeypatch):
    """Long windows are scored in slices (query rows of the attention, positions of the output head): the NLL and the
    layer statistics equal those of one slice, and the head really runs once per slice."""
    ids = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(3))
    method, fmt = RowwiseInt2("int2", fmt=PAPER), _fmt(4, 8)
    whole, whole_session = ev.method_nll(model, method, ids, fmt)
    monkeypatch.setattr(ev, "SCORE_ELEMENTS", 2 * 4 * 70 * 9)  # 9 query rows per slice (batch 2, 4 query heads)
    monkeypatch.setattr(ev, "LOGIT_CHUNK", 16)
    calls = []
    hook = model.get_output_embeddings().register_forward_hook(lambda mod, inp, out: calls.append(out.shape[1]))
    try:
        sliced, sliced_session = ev.method_nll(model, method, ids, fmt, batch_size=2)
    finally:
        hook.remove()
    assert calls == [16, 16, 16, 16, 5]  # 69 scored positions
    torch.testing.assert_close(sliced, whole, rtol=0, atol=1e-5)
    for layer, st in whole_session.layers.items():
        assert sliced_session.layers[layer].queries == st.queries
        assert sliced_session.layers[layer].kl_sum == pytest.approx(st.kl_sum, rel=1e-5)
        assert sliced_session.layers[layer].err_num == pytest.approx(st.err_num, rel=1e-5)


@pytest.mark.parametrize("method", [_Noisy(), RowwiseInt2("int2", fmt=PAPER)], ids=["noisy", "int2"])
def test_without_statistics_the_union_sdpa_equals_the_scores_path(model, method, monkeypatch):
    """`collect_stats=False` takes one SDPA over [K; Khat] with the mask [exact, ~exact]: the NLL equals the scores
    path's (itself checked against a per-position loop above)."""
    ids = torch.randint(0, 256, (2, 57), generator=torch.Generator().manual_seed(6))
    with_scores, _ = ev.method_nll(model, method, ids, _fmt(4, 8, page=4), collect_stats=True)
    union, session = ev.method_nll(model, method, ids, _fmt(4, 8, page=4), collect_stats=False)
    assert session.layers == {}
    torch.testing.assert_close(union, with_scores, rtol=0, atol=2e-5)
    monkeypatch.setattr(ev, "SDPA_ROWS", 10)  # 10 query rows per SDPA call, each over its rows' key span
    sliced, _ = ev.method_nll(model, method, ids, _fmt(4, 8, page=4), collect_stats=False)
    torch.testing.assert_close(sliced, union, rtol=0, atol=1e-6)
    assert float((union - ev.method_nll(model, KVMethod(), ids, _fmt(4, 8))[0]).abs().max()) > 1e-3  # INT2 moved it


def test_span_logits_equal_the_forward_s_at_those_positions(model):
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits.float()
    torch.testing.assert_close(ev.span_logits(model, ids, 11, 17), full[:, 11:17], rtol=0, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_an_all_bf16_layer_equals_the_scores_path(window, monkeypatch):
    """A layer the method leaves in BF16 goes through fp32 SDPA; it equals the explicit-scores attention with the same
    causal (and sliding-window) mask, query heads grouped as the KV heads."""
    g = torch.Generator().manual_seed(5)
    b, h_q, h_kv, t, d = 2, 6, 2, 19, 16
    query, key, value = (torch.randn(b, h, t, d, generator=g) for h in (h_q, h_kv, h_kv))
    mask = None
    if window is not None:  # transformers' sliding-window mask: True = may attend
        i = torch.arange(t)
        mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window))[None, None].expand(b, 1, t, t)
    module = SimpleNamespace(layer_idx=0)
    out, _ = ev._eval_attention(None, module, query, key, value, mask, scaling=0.3)
    monkeypatch.setattr(ev, "SDPA_ROWS", 4)  # 4 query rows per SDPA call, each over its rows' key span
    sliced, _ = ev._eval_attention(None, module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(sliced, out, rtol=0, atol=1e-6)
    allowed = ev._allowed_mask(mask, b, t, t, "cpu")
    ref, _, _ = ev.mixed_attention(query.reshape(b, h_kv, h_q // h_kv, t, d), key, value, None, None, None, allowed,
                                   0.3)
    torch.testing.assert_close(out, ref.reshape(b, h_q, t, d).transpose(1, 2), rtol=0, atol=1e-5)


def test_layer_statistics_match_direct_formulas():
    torch.manual_seed(3)
    b, h_kv, g, t, d = 1, 2, 2, 24, 16
    q = torch.randn(b, h_kv * g, t, d)
    k = torch.randn(b, h_kv, t, d)
    v = torch.randn(b, h_kv, t, d)
    method = _Noisy(0.5)
    session = ev.EvalSession(method, _fmt(2, 5))
    module = SimpleNamespace(layer_idx=0)
    out, _ = ev._eval_attention(session, module, q, k, v, None, scaling=d ** -0.5)
    k_hat, v_hat = method.fake_quantize(0, k, v, _fmt(2, 5))
    kl_sum, n, num, den = 0.0, 0, 0.0, 0.0
    for hq in range(h_kv * g):
        hk = hq // g
        for pos in range(t):
            j = torch.arange(pos + 1)
            exact = (j < 2) | (j > pos - 5)
            if bool(exact.all()):
                continue
            s_ref = (q[0, hq, pos] @ k[0, hk, :pos + 1].T) * d ** -0.5
            kk = torch.where(exact[:, None], k[0, hk, :pos + 1], k_hat[0, hk, :pos + 1])
            vv = torch.where(exact[:, None], v[0, hk, :pos + 1], v_hat[0, hk, :pos + 1])
            s = (q[0, hq, pos] @ kk.T) * d ** -0.5
            p_ref, p = s_ref.softmax(-1), s.softmax(-1)
            kl_sum += float((p_ref * (p_ref.log() - p.log())).sum())
            o_ref, o = p_ref @ v[0, hk, :pos + 1], p @ vv
            torch.testing.assert_close(out[0, pos, hq], o, rtol=1e-5, atol=1e-5)
            num += float(((o - o_ref) ** 2).sum())
            den += float((o_ref ** 2).sum())
            n += 1
    stats = session.layers[0].as_dict()
    assert stats["queries"] == n
    assert stats["attn_kl"] == pytest.approx(kl_sum / n, rel=1e-4)
    assert stats["out_rel_err"] == pytest.approx(math.sqrt(num / den), rel=1e-4)


# ------------------------------------------------------------------------------------------------ runtime
@pytest.mark.parametrize("prompt", [20, 41])
def test_simulation_equals_the_real_runtime(model, prompt):
    """Decode logits of OscarCache (INT2 history, page demotion) = the simulation with the same layout."""
    pytest.importorskip("runtime_kernels.hf")
    sink, recent, page = 8, 16, 4
    art = _artifact()
    ids = torch.randint(0, 256, (1, 72), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        served = art.kv_format.with_(sink_tokens=sink, recent_tokens=recent, page_size=page)  # identity: any windows
        rt = ev.runtime_decode_logits(model, art, ids, prompt, served, backend="torch")
        session = ev.EvalSession(ArtifactInt2("oscar", artifact=art), served, False, prefill=prompt)
        with ev.evaluating(model, session):
            sim = model(input_ids=ids, use_cache=False).logits.float()[:, prompt - 1:-1]
        plain = model(input_ids=ids).logits.float()[:, prompt - 1:-1]
    assert rt.shape == sim.shape == (1, 72 - prompt, 256)
    err = float((rt - sim).abs().max())
    assert err < 1e-3 * float(sim.abs().max()), err
    assert float((rt - plain).abs().max()) > 100 * err  # the INT2 history really is in use


def test_generation_agreement_reports_rates(model):
    pytest.importorskip("runtime_kernels.hf")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    out = ev.generation_agreement(model, {"oscar": _artifact()}, ids, 8, _fmt(4, 8, 4))
    assert out["status"] == "ok"
    r = out["methods"]["oscar"]
    assert 0.0 <= r["match_rate"] <= 1.0 and 0 <= r["first_divergence_mean"] <= 8
    # With no quantized history at all (windows cover everything) the runtime is BF16: full agreement.
    out = ev.generation_agreement(model, {"oscar": _artifact()}, ids, 8, _fmt(64, 256, 4))
    assert out["methods"]["oscar"]["match_rate"] == 1.0


# ------------------------------------------------------------------------------------------------ data
class _CharTok:
    """One token per character; EOS = 0."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 250 + 1 for c in text]}


def test_windows_long_documents_stay_whole_and_short_ones_are_packed(tmp_path):
    f = tmp_path / "d.txt"
    f.write_text("a" * 25 + "\n<|endoftext|>\n" + "bbb\n<|endoftext|>\n" + "cc" + "\n<|endoftext|>\n" + "d" * 9)
    docs = ev.read_documents(f)
    assert docs == ["a" * 25, "bbb", "cc", "d" * 9]
    w = ev.make_windows(_CharTok(), docs, 10)
    assert w.long.shape == (2, 10) and bool((w.long == ord("a") % 250 + 1).all())
    assert w.packed.shape == (1, 10)
    assert (w.packed[0] == 0).sum() >= 2  # EOS between packed documents


def test_read_documents_errors_name_the_file(tmp_path):
    from oscar_calib.errors import InputError

    with pytest.raises(InputError, match="no such file"):
        ev.read_documents(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(InputError, match="no text"):
        ev.read_documents(tmp_path / "empty.txt")


def test_evaluate_methods_reports_every_method(model):
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(6))
    windows = ev.Windows(long=ids[:1], packed=ids[1:])
    res = ev.evaluate_methods(model, [KVMethod(), RowwiseInt2("int2", fmt=PAPER)], windows, _fmt(4, 8))
    bf16, int2 = res["methods"]
    assert bf16["ppl_delta_pct"] == 0.0 and bf16["layers"] == []
    assert [x["layer"] for x in int2["layers"]] == [0, 1]
    assert all(x["attn_kl"] > 0 and x["out_rel_err"] > 0 for x in int2["layers"])
    int2_method = RowwiseInt2("int2", fmt=PAPER)
    nll = torch.cat([ev.method_nll(model, int2_method, w, _fmt(4, 8))[0] for w in (ids[:1], ids[1:])])
    assert int2["ppl"] == pytest.approx(math.exp(float(nll.double().mean())), rel=1e-9)
    assert int2["ppl_second_half"] == pytest.approx(math.exp(float(nll[:, 19:].double().mean())), rel=1e-9)
    assert res["windows"] == {"long": 1, "packed": 1}
    json.dumps(res)  # JSON-ready


# ------------------------------------------------------------------------------------------------ quality (CI)
def test_quality_regression_on_the_trained_fixture():
    """On the trained fixture, OSCAR beats naive INT2, QuaRot-style INT2 and KIVI-2 at equal bits.

    Reduced for CPU CI (~15 s): 4 windows of 512 tokens (2 single-document + 2 packed) of the held-out
    text, BF16 sink 16 + recent 64 so that most positions read a quantized history; OSCAR calibrated on
    8 x 512 tokens of the fixture's calibration text with the same windows. docs/quality.md's fp16 table is
    the full-size run (4K contexts, sink 64 + recent 256) on the GPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oscar_calib.analysis.methods import standard_methods
    from oscar_calib.calibration.calibrate import calibrate_model
    from oscar_calib.config import SolverSettings
    from oscar_calib.demo import FIXTURE_DIR, fixture_available

    if not fixture_available():
        pytest.fail(f"the trained fixture is missing from {FIXTURE_DIR}")
    sink, recent, context = 16, 64, 512
    tok = AutoTokenizer.from_pretrained(FIXTURE_DIR)
    lm = AutoModelForCausalLM.from_pretrained(FIXTURE_DIR, dtype=torch.float32).eval()
    cal = ev.make_windows(tok, ev.read_documents(FIXTURE_DIR / "calib.txt"), context, 8)
    # fp16 scales: the rivals' bits (ue5m3 scales would give OSCAR fewer bits than theirs)
    settings = SolverSettings(kv_format={"sink_tokens": sink, "recent_tokens": recent, "scale_format": "float16"})
    art = calibrate_model(lm, torch.cat([cal.long, cal.packed])[:8], settings, compare_alternatives=False)
    windows = ev.make_windows(tok, ev.read_documents(FIXTURE_DIR / "heldout.txt"), context, 4)
    assert windows.long.shape[0] == 2 and windows.packed.shape[0] == 2
    wanted = {"bf16", "int2", "kivi2-g128", "quarot-int2", "oscar-head"}
    fmt = art.kv_format.per_token()
    methods = [m for m in standard_methods(128, fmt, {"oscar-head": art}) if m.name in wanted]
    res = {r["name"]: r for r in ev.evaluate_methods(lm, methods, windows, fmt)["methods"]}
    bits = {name: r["effective_bits"] for name, r in res.items() if name != "bf16"}
    assert len(set(round(b, 9) for b in bits.values())) == 1, bits  # equal bits
    oscar = res["oscar-head"]["ppl"]
    for rival in ("int2", "quarot-int2", "kivi2-g128"):
        assert oscar < res[rival]["ppl"], (rival, {n: r["ppl"] for n, r in res.items()})


# ------------------------------------------------------------------------------------------------ CLI


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from oscar_calib.demo import byte_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    tiny_model("qwen3", head_dim=64, num_layers=2, vocab_size=260, max_position_embeddings=256).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "t.txt"
    gen = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "rotation", "head", "token", "query"]
    docs = [" ".join(words[int(i)] for i in torch.randint(0, 10, (n,), generator=gen)) for n in (60, 5, 8, 7)]
    path.write_text("\n<|endoftext|>\n".join(docs))
    return path


def test_cli_eval_with_an_artifact(tmp_path, monkeypatch, capsys, model_dir, text_file):
    pytest.importorskip("matplotlib")
    from runtime_kernels.artifact import write_artifact

    write_artifact(_artifact(), tmp_path / "art")
    code, out, err = run_cli(["eval", "--model", str(model_dir), "--artifact", str(tmp_path / "art"),
                              "--data", str(text_file), "--context", "64", "--sink", "4", "--recent", "8",
                              "--page-size", "1", "--generation-steps", "8", "--generation-windows", "1",
                              "--json", "--json-out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
                              "--allow-other-model"],  # the artifact is built in memory for another model id
                             monkeypatch, capsys)
    assert code == 0, err
    res = json.loads(out)
    assert json.loads((tmp_path / "r.json").read_text())["methods"] == res["methods"]
    assert [m["name"] for m in res["methods"]] == ["bf16", "int2", "kivi2-g128", "kivi2-g32", "quarot-int2",
                                                   "hadamard-clip", "oscar-head"]
    assert res["windows"]["long"] >= 1 and res["windows"]["packed"] >= 1
    assert res["generation_agreement"]["status"] == "ok"
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_cli_eval_default_fixture_calibrates_on_the_fly(monkeypatch, capsys):
    code, out, err = run_cli(["eval", "--context", "256", "--max-windows", "2", "--calib-samples", "3",
                              "--sink", "16", "--recent", "64", "--generation-steps", "0",
                              "--methods", "bf16,int2,oscar-head,oscar-layer"], monkeypatch, capsys)
    assert code == 0, err
    assert "calibrated oscar-head" in err and "calibrated oscar-layer" in err
    for name in ("bf16", "int2", "oscar-head", "oscar-layer"):
        assert name in out


@pytest.mark.parametrize("args,needle", [
    (["--context", "4096"], "max_position_embeddings"),
    (["--methods", "bf16,nope"], "unknown method"),
    (["--data", "/nonexistent.txt"], "no such file"),
])
def test_cli_eval_bad_input(args, needle, tmp_path, monkeypatch, capsys, model_dir, text_file):
    from runtime_kernels.artifact import write_artifact

    write_artifact(_artifact(), tmp_path / "art")
    base = ["eval", "--model", str(model_dir), "--artifact", str(tmp_path / "art"), "--data", str(text_file),
            "--context", "64", "--sink", "4", "--recent", "8", "--json-out", str(tmp_path / "r.json"),
            "--allow-other-model"]
    code, out, err = run_cli(base + args, monkeypatch, capsys)
    assert code == 2 and needle in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()  # nothing half-written


def test_cli_eval_default_fixture_accepts_the_demos_artifact(tmp_path, monkeypatch, capsys):
    """`oscar-calib run` (demo) names the fixture by its id; `eval --artifact` on the default model must accept it."""
    from oscar_calib.demo import FIXTURE_MODEL_ID
    from runtime_kernels.artifact import identity_artifact, write_artifact

    write_artifact(identity_artifact(4, 2, 4, 128, model_id=FIXTURE_MODEL_ID, fmt=PAPER), tmp_path / "demo")
    code, out, err = run_cli(["eval", "--artifact", str(tmp_path / "demo"), "--context", "256", "--max-windows", "1",
                              "--sink", "16", "--recent", "64", "--generation-steps", "0",
                              "--methods", "bf16,oscar-head"], monkeypatch, capsys)
    assert code == 0, err
    assert "oscar-head" in out


def test_cli_eval_refuses_a_context_the_windows_fill(tmp_path, monkeypatch, capsys):
    """The recipe's windows (128 + 1024) hold a 1024-token window entirely in BF16: nothing to evaluate."""
    from oscar_calib.demo import FIXTURE_MODEL_ID
    from runtime_kernels.artifact import identity_artifact, write_artifact
    from runtime_kernels.format import DEFAULT_FORMAT

    write_artifact(identity_artifact(4, 2, 4, 128, model_id=FIXTURE_MODEL_ID, fmt=DEFAULT_FORMAT), tmp_path / "a")
    code, _, err = run_cli(["eval", "--artifact", str(tmp_path / "a"), "--context", "1024", "--json-out",
                            str(tmp_path / "r.json")], monkeypatch, capsys)
    assert code == 2 and "--context 1024" in err and "sink 128 + recent 1024" in err
    assert not (tmp_path / "r.json").exists()
