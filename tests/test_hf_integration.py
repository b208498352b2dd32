"""OscarCache + "oscar" attention inside transformers, against independent references.

References:
- the plain model with its own DynamicCache (identity artifact, clipping off, history still BF16);
- a test-only attention function over a DynamicCache that replaces the history segment of the keys and
  values by `naive.fake_quantize` (the documented split: sink S, history P * floor((n - S - R) / P), rest
  recent) and otherwise runs SDPA. It shares no code with runtime_kernels.cache.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from format_helpers import PAPER, qfmt, served
from tiny_models import tiny_model
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from runtime_kernels.artifact import ArtifactError, identity_artifact, write_artifact
from runtime_kernels.attention.int2_decode.pools import quad_pools
from runtime_kernels.cache import PagedKVCache
from runtime_kernels.hf import OscarCache, OscarLayer, enable_oscar_attention
from runtime_kernels.quant import naive as quant_naive

S, R, P = 4, 8, 4
HQ, H, D, G = 4, 2, 16, 8
FIXTURE = Path(__file__).resolve().parents[1] / "oscar_calib" / "fixtures" / "tiny-qwen3"


def random_artifact(num_layers=2, layer_ids=None, clip=(0.9, 0.95), seed=0, heads=(HQ, H), head_dim=D,
                    group_size=G):
    hq, h = heads
    ids = layer_ids if layer_ids is not None else list(range(num_layers))
    art = identity_artifact(num_layers, h, hq, head_dim, layer_ids=ids, group_size=group_size, fmt=PAPER)
    gen = torch.Generator().manual_seed(seed)
    a = len(ids)
    for name in ("k_rotation", "v_rotation"):
        q, _ = torch.linalg.qr(torch.randn(a, h, head_dim, head_dim, generator=gen, dtype=torch.float64))
        setattr(art, name, q.float().contiguous())
    art.k_clip_ratio = torch.full((a, h), clip[0])
    art.v_clip_ratio = torch.full((a, h), clip[1])
    return art.validate()


def model(seed=0, layers=2):
    return tiny_model("qwen3", seed=seed, num_heads=HQ, num_kv_heads=H, head_dim=D, num_layers=layers)


def cache_kw(model_, **kw):
    """Name of the cache argument of forward/generate: `cache` (newer transformers) or `past_key_values`."""
    name = "cache" if "cache" in inspect.signature(type(model_).forward).parameters else "past_key_values"
    return {name: kw.pop("cache"), **kw}


def make_cache(art, m, batch_size=1, clip=True, recent=R, **kw):
    opts = dict(max_tokens=256, fmt=served(art, P, S, recent), backend="torch", clip=clip)
    return OscarCache.from_artifact(art, m.config, batch_size=batch_size, **{**opts, **kw})


# -- the independent reference: fake-quantized history over a plain DynamicCache --------------------------------
def _history(n):
    return P * (max(0, n - S - R) // P)


def make_reference_attention(art, use_clip=True):
    """Attention over a DynamicCache's full-precision K/V with the history segment fake-quantized."""
    layer_pos = {int(g): i for i, g in enumerate(art.layer_ids.tolist())}

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        i = layer_pos.get(module.layer_idx)
        q_len, kv_len = query.shape[2], key.shape[2]
        if i is not None and kv_len > q_len or (i is not None and q_len == 1):
            # decode: the split counts the new token; chunked prefill: only the tokens cached before the chunk
            h = _history(kv_len) if q_len == 1 else _history(kv_len - q_len)
            if h:
                kc = art.k_clip_ratio[i] if use_clip else None
                vc = art.v_clip_ratio[i] if use_clip else None
                key, value = key.clone(), value.clone()
                seg_k = key[:, :, S:S + h].transpose(1, 2)  # [B, h, H, d]
                seg_v = value[:, :, S:S + h].transpose(1, 2)
                for b in range(key.shape[0]):
                    key[b, :, S:S + h] = quant_naive.fake_quantize(seg_k[b], art.k_rotation[i], kc, qfmt(G)).transpose(0, 1)
                    value[b, :, S:S + h] = quant_naive.fake_quantize(seg_v[b], art.v_rotation[i], vc, qfmt(G)).transpose(0, 1)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)

    return attention


def reference_model(art, seed=0, layers=2, use_clip=True):
    AttentionInterface.register("fakequant_ref", make_reference_attention(art, use_clip))
    AttentionMaskInterface.register("fakequant_ref", sdpa_mask)
    m = model(seed, layers)
    m.set_attn_implementation("fakequant_ref")
    return m


def step_logits(m, cache, prompt, new_tokens):
    """Prefill `prompt [1, T]`, then feed `new_tokens` one at a time; logits of every fed position."""
    out = [m(input_ids=prompt, use_cache=True, **cache_kw(m, cache=cache)).logits[0]]
    for t in new_tokens:
        out.append(m(input_ids=t.view(1, 1), use_cache=True, **cache_kw(m, cache=cache)).logits[0])
    return torch.cat(out)


# -- tests ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_identity_artifact_matches_plain_model_while_history_is_bf16():
    m, plain = enable_oscar_attention(model()), model()
    art = identity_artifact(2, H, HQ, D, fmt=PAPER)
    cache = make_cache(art, m, clip=False)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (1, 10), generator=gen)
    new = torch.randint(0, 256, (S + R + P - 1 - 10,), generator=gen)  # stop before the first demotion
    got = step_logits(m, cache, prompt, new)
    want = step_logits(plain, DynamicCache(), prompt, new)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert cache.paged.hist_len(cache.seq_ids[0]) == 0 and cache.get_seq_length() == S + R + P - 1
    # one more token demotes a page: now the INT2 history is read and the logits move away from BF16
    extra = torch.tensor([7])
    got2 = m(input_ids=extra.view(1, 1), use_cache=True, **cache_kw(m, cache=cache)).logits[0, -1]
    plain_cache = DynamicCache()
    want2 = step_logits(plain, plain_cache, prompt, torch.cat([new, extra]))[-1]
    assert cache.paged.hist_len(cache.seq_ids[0]) == P
    assert (got2 - want2).abs().max() > 1e-4


@torch.no_grad()
def test_decode_with_int2_history_matches_fake_quant_reference():
    art = random_artifact()
    m, ref = enable_oscar_attention(model()), reference_model(art)
    cache = make_cache(art, m)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (1, 23), generator=gen)  # prefill already fills sink | history | recent
    new = torch.randint(0, 256, (12,), generator=gen)  # three more demotions
    got = step_logits(m, cache, prompt, new)
    want = step_logits(ref, DynamicCache(), prompt, new)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    sid = cache.seq_ids[0]
    assert cache.paged.hist_len(sid) == _history(23 + 12) > _history(23)


@torch.no_grad()
def test_chunked_prefill_attends_over_dequantized_history():
    art = random_artifact()
    m, ref = enable_oscar_attention(model()), reference_model(art)
    cache, ref_cache = make_cache(art, m), DynamicCache()
    gen = torch.Generator().manual_seed(2)
    chunks = [torch.randint(0, 256, (1, n), generator=gen) for n in (21, 9)]
    for c in chunks:
        got = m(input_ids=c, use_cache=True, **cache_kw(m, cache=cache)).logits
        want = ref(input_ids=c, use_cache=True, **cache_kw(ref, cache=ref_cache)).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert cache.paged.seq_len(cache.seq_ids[0]) == 30


@torch.no_grad()
def test_uncalibrated_layers_keep_a_plain_cache_layer():
    art = random_artifact(num_layers=1, layer_ids=[1])
    m, ref = enable_oscar_attention(model()), reference_model(art)
    cache = make_cache(art, m)
    assert not isinstance(cache.layers[0], OscarLayer) and isinstance(cache.layers[1], OscarLayer)
    gen = torch.Generator().manual_seed(3)
    prompt, new = torch.randint(0, 256, (1, 20), generator=gen), torch.randint(0, 256, (6,), generator=gen)
    torch.testing.assert_close(step_logits(m, cache, prompt, new), step_logits(ref, DynamicCache(), prompt, new),
                               atol=1e-4, rtol=1e-4)
    assert cache.layers[0].get_seq_length() == cache.layers[1].get_seq_length() == 26


@torch.no_grad()
def test_greedy_generate_with_random_artifact_on_cpu_batched_with_padding():
    art = random_artifact()
    m = enable_oscar_attention(model())
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randint(1, 256, (n,), generator=gen) for n in (17, 26)]
    ids = torch.zeros(2, 26, dtype=torch.long)
    mask = torch.zeros(2, 26, dtype=torch.long)
    for b, r in enumerate(rows):  # left padding
        ids[b, 26 - len(r):], mask[b, 26 - len(r):] = r, 1
    cache = make_cache(art, m, batch_size=2)
    out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0,
                     **cache_kw(m, cache=cache))
    assert out.shape == (2, 26 + 14)
    lengths = [cache.paged.seq_len(s) for s in cache.seq_ids]
    assert lengths == [17 + 13, 26 + 13]  # padding is not stored; the last token is never fed back
    assert all(cache.paged.hist_len(s) > 0 for s in cache.seq_ids)
    for b, r in enumerate(rows):  # each row alone gives the same tokens as in the padded batch
        single = make_cache(art, m, batch_size=1)
        alone = m.generate(input_ids=r[None], max_new_tokens=14, do_sample=False, pad_token_id=0,
                           **cache_kw(m, cache=single))
        assert torch.equal(alone[0, len(r):], out[b, 26:])
    cache.free()
    assert cache.paged.allocator.num_free == cache.paged.allocator.num_pages


@torch.no_grad()
def test_generate_matches_plain_generation_with_identity_artifact_and_bf16_history():
    m, plain = enable_oscar_attention(model()), model()
    art = identity_artifact(2, H, HQ, D, fmt=PAPER)
    prompt = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(5))
    cache = make_cache(art, m, clip=False, recent=64)
    a = m.generate(input_ids=prompt, max_new_tokens=20, do_sample=False, pad_token_id=0, **cache_kw(m, cache=cache))
    b = plain.generate(input_ids=prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


@torch.no_grad()
def test_num_return_sequences_share_the_prompt_pages():
    art = random_artifact()
    m = enable_oscar_attention(model())
    prompt = torch.randint(1, 256, (1, 30), generator=torch.Generator().manual_seed(6))
    cache = make_cache(art, m, batch_size=1, max_seqs=3)
    cache.batch_repeat_interleave(1)  # no-op before prefill
    m(input_ids=prompt, use_cache=True, **cache_kw(m, cache=cache))
    cache.batch_repeat_interleave(3)
    pages = [cache.paged.pages(s) for s in cache.seq_ids]
    assert len(cache.seq_ids) == 3 and pages[0] == pages[1] == pages[2] and pages[0]
    tok = torch.tensor([[5], [5], [5]])
    logits = m(input_ids=tok, use_cache=True, **cache_kw(m, cache=cache)).logits
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)
    torch.testing.assert_close(logits[0], logits[2], atol=0, rtol=0)


@torch.no_grad()
@pytest.mark.skipif(not (FIXTURE / "model.safetensors").is_file(), reason="trained fixture not present")
def test_trained_fixture_generates_text_with_a_two_bit_history():
    tok = AutoTokenizer.from_pretrained(FIXTURE)
    m = enable_oscar_attention(AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval())
    cfg = m.config
    art = random_artifact(num_layers=cfg.num_hidden_layers, heads=(cfg.num_attention_heads, cfg.num_key_value_heads),
                          head_dim=cfg.head_dim, group_size=32, clip=(0.96, 0.92))
    art.metadata["model_id"] = str(FIXTURE)  # the identity rule: the artifact must name the model
    prompt = tok("The history of the", return_tensors="pt")
    cache = OscarCache.from_artifact(art, cfg, batch_size=1, max_tokens=128, fmt=served(art, 8, 4, 8),
                                     backend="torch")
    out = m.generate(**prompt, max_new_tokens=24, do_sample=False, **cache_kw(m, cache=cache))
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert out.shape[1] > prompt["input_ids"].shape[1] and text.strip()
    assert cache.paged.hist_len(cache.seq_ids[0]) > 0  # part of the context was read back from 2-bit pages


def test_artifact_path_and_artifact_for_another_model(tmp_path):
    m = model()
    art = random_artifact()
    write_artifact(art, tmp_path / "a")
    assert isinstance(OscarCache.from_artifact(tmp_path / "a", m.config), OscarCache)
    wrong = identity_artifact(2, H, HQ, 2 * D, fmt=PAPER)
    with pytest.raises(ArtifactError, match="'head_dim'.*artifact has 32.*model has 16"):
        OscarCache.from_artifact(wrong, m.config)
    too_deep = identity_artifact(3, H, HQ, D, fmt=PAPER)
    with pytest.raises(ArtifactError, match="'layer_ids'"):
        OscarCache.from_artifact(too_deep, m.config)
    with pytest.raises(TypeError, match="artifact"):
        OscarCache.from_artifact(42, m.config)
    with pytest.raises(ValueError, match="batch_size"):
        OscarCache.from_artifact(art, m.config, batch_size=0)


@torch.no_grad()
def test_bad_states_name_the_tensor():
    m = model()
    cache = make_cache(random_artifact(), m, batch_size=1)
    k = torch.randn(1, H, 3, D)
    with pytest.raises(TypeError, match=r"key_states \(layer 0\).*dtype"):
        cache.update(k.to(torch.int32), k, 0)
    with pytest.raises(ValueError, match=r"value_states \(layer 0\).*shape"):
        cache.update(k, torch.randn(1, H + 1, 3, D), 0)
    with pytest.raises(ValueError, match=r"key_states \(layer 1\).*batch size 2"):
        cache.update(torch.randn(2, H, 3, D), torch.randn(2, H, 3, D), 1)
    cache.update(k, k, 0)  # allocates the pools on the CPU
    with pytest.raises(ValueError, match=r"key_states \(layer 1\).*device"):
        cache.update(k.to("meta"), k.to("meta"), 1)
    assert isinstance(cache.paged, PagedKVCache)


@torch.no_grad()
def test_forgetting_enable_oscar_attention_is_an_error_not_a_silent_fallback():
    m = model()  # plain SDPA: the prompt would never reach the paged cache
    cache = make_cache(random_artifact(), m)
    m(input_ids=torch.randint(0, 256, (1, 8)), use_cache=True, **cache_kw(m, cache=cache))
    with pytest.raises(RuntimeError, match="enable_oscar_attention"):
        m(input_ids=torch.tensor([[3]]), use_cache=True, **cache_kw(m, cache=cache))


@torch.no_grad()
def test_beam_search_and_sampling_match_the_fake_quant_reference():
    art = random_artifact()
    m, ref = enable_oscar_attention(model()), reference_model(art)
    prompt = torch.randint(1, 256, (1, 20), generator=torch.Generator().manual_seed(8))
    for opts in (dict(num_beams=3, do_sample=False, num_return_sequences=2),
                 dict(do_sample=True, top_k=4, num_return_sequences=3)):
        cache = make_cache(art, m, batch_size=3)  # beams reorder rows (shared pages fork), samples expand
        torch.manual_seed(0)
        got = m.generate(input_ids=prompt, max_new_tokens=8, pad_token_id=0, **opts, **cache_kw(m, cache=cache))
        torch.manual_seed(0)
        want = ref.generate(input_ids=prompt, max_new_tokens=8, pad_token_id=0, **opts)
        assert torch.equal(got, want)
        assert all(cache.paged.hist_len(s) > 0 for s in cache.seq_ids)


@torch.no_grad()
def test_pool_grows_past_max_tokens_and_matches_the_reference():
    art = random_artifact()
    m, ref = enable_oscar_attention(model()), reference_model(art)
    prompt = torch.randint(1, 256, (2, S + R + 3 * P), generator=torch.Generator().manual_seed(9))
    cache = make_cache(art, m, batch_size=None, max_tokens=S + R + P)  # room for one page per row
    got = m.generate(input_ids=prompt, max_new_tokens=3 * P + 1, do_sample=False, pad_token_id=0,
                     **cache_kw(m, cache=cache))
    want = ref.generate(input_ids=prompt, max_new_tokens=3 * P + 1, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    n = got.shape[1]
    assert cache.paged.allocator.num_pages >= 2 * _history(n - 1) // P > 2  # grew past the initial 2 pages


@torch.no_grad()
def test_unsized_cache_serves_num_return_sequences_like_the_reference():
    """No batch_size, max_tokens or max_seqs: slots come from the expanded prompt batch, pages grow."""
    art = random_artifact()
    m, ref = enable_oscar_attention(model()), reference_model(art)
    prompt = torch.randint(1, 256, (1, 2 * (S + R)), generator=torch.Generator().manual_seed(10))
    cache = OscarCache.from_artifact(art, m.config, fmt=served(art, P, S, R), backend="torch")
    opts = dict(do_sample=True, top_k=4, num_return_sequences=3, max_new_tokens=2 * P, pad_token_id=0)
    torch.manual_seed(1)
    got = m.generate(input_ids=prompt, **opts, **cache_kw(m, cache=cache))
    torch.manual_seed(1)
    want = ref.generate(input_ids=prompt, **opts)
    assert got.shape[0] == 3 and torch.equal(got, want)
    assert cache.paged.max_seqs == 3


@torch.no_grad()
def test_assisted_decoding_is_refused_with_the_reason():
    art = random_artifact()
    m, assistant = enable_oscar_attention(model()), model(seed=1)
    prompt = torch.randint(1, 256, (1, 10), generator=torch.Generator().manual_seed(11))
    cache = make_cache(art, m)
    assert not cache.is_croppable
    with pytest.raises((ValueError, NotImplementedError), match="crop"):
        m.generate(input_ids=prompt, assistant_model=assistant, max_new_tokens=6, do_sample=False, pad_token_id=0,
                   **cache_kw(m, cache=cache))
    with pytest.raises(NotImplementedError, match="assisted"):
        cache.crop(1)


@torch.no_grad()
@pytest.mark.parametrize("group", [G, D])  # D: one group per row, the four scale/zero pools in one quad buffer
def test_grow_pages_keeps_every_page_and_the_decode_output(group):
    art = random_artifact(group_size=group)
    paged = PagedKVCache.from_artifact(art, max_pages=3, max_seqs=2, fmt=served(art, P, S, R), backend="torch")
    gen = torch.Generator().manual_seed(12)
    sids = [paged.add_sequence(), paged.add_sequence()]
    n = S + R + P + 2  # one demoted page per sequence
    plan = paged.plan_append(sids, [n, n])
    for layer in range(paged.num_layers):
        paged.write_layer(layer, plan, torch.randn(2 * n, H, D, generator=gen), torch.randn(2 * n, H, D, generator=gen))
    q = torch.randn(2, HQ, D, generator=gen)
    before = paged.decode_attention(0, q, sids)
    names = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero")
    pools = [getattr(paged.pools[0], n).clone() for n in names]
    quad = quad_pools(*(getattr(paged.pools[0], n) for n in names[2:]))
    assert quad == (group == D)
    paged.grow_pages(7)
    assert paged.allocator.num_pages == 7 and paged.allocator.num_free == 5
    for old, new in zip(pools, (getattr(paged.pools[0], n) for n in names)):
        assert new.shape[0] == 7 and torch.equal(new[:3], old)
    assert quad_pools(*(getattr(paged.pools[0], n) for n in names[2:])) == quad  # the layout survives growth
    assert torch.equal(paged.decode_attention(0, q, sids), before)
    assert paged.pages_needed(sids, [P, 0]) == 1 and paged.allocator.allocate(5)  # the new ids are usable


@torch.no_grad()
def test_from_pretrained_pulls_a_pinned_release_and_generates(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants
    from hub_server import HubServer
    from test_hub import MODEL, REPO, TOKEN, do_push, make_artifact

    from runtime_kernels.artifact import read_artifact
    from runtime_kernels.loader import ModelMismatchError

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    m = enable_oscar_attention(model())
    local = make_artifact(tmp_path / "a", d=D, h_kv=H)
    layout = dict(fmt=served(read_artifact(local), P, S, R), backend="torch")
    prompt = torch.randint(1, 256, (1, S + R + 2 * P), generator=torch.Generator().manual_seed(13))
    with HubServer(tmp_path / "hub", token=TOKEN) as hub:
        do_push(hub, local)
        pull = dict(repo=REPO, revision="v1", token=TOKEN, cache_dir=tmp_path / "c", endpoint=hub.endpoint)
        cache = OscarCache.from_pretrained(MODEL, m.config, **pull, **layout)
        with pytest.raises(ValueError, match="revision"):
            OscarCache.from_pretrained(MODEL, m.config, repo=REPO)
        wrong = tiny_model("qwen3", num_heads=HQ, num_kv_heads=H, head_dim=2 * D, num_layers=2).config
        with pytest.raises(ModelMismatchError, match="head_dim"):
            OscarCache.from_pretrained(MODEL, wrong, **pull)
    assert torch.equal(cache.artifact.k_rotation, read_artifact(local).k_rotation)
    got = m.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, **cache_kw(m, cache=cache))
    again = OscarCache.from_pretrained(local, m.config, **layout)  # a local artifact: same one-call path
    want = m.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, **cache_kw(m, cache=again))
    assert torch.equal(got, want) and cache.paged.hist_len(cache.seq_ids[0]) > 0


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.skipif(not (FIXTURE / "model.safetensors").is_file(), reason="trained fixture not present")
def test_readme_serving_example_on_gpu():
    """The README's serving snippet on a GPU: bf16 fixture, `device="cuda"`, the default layout (page 64, sink 64,
    recent 256) and kernels, a prompt long enough to fill INT2 pages. The first new token comes from the
    full-precision prefill, so it equals plain generation's; the rest decode over a 2-bit history."""
    tok = AutoTokenizer.from_pretrained(FIXTURE)
    load = lambda: AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.bfloat16).cuda().eval()  # noqa: E731
    m, plain = enable_oscar_attention(load()), load()
    cfg = m.config
    art = random_artifact(num_layers=cfg.num_hidden_layers, heads=(cfg.num_attention_heads, cfg.num_key_value_heads),
                          head_dim=cfg.head_dim, group_size=cfg.head_dim, clip=(0.96, 0.92))
    text = (Path(__file__).resolve().parents[1] / "runtime_kernels" / "cache.py").read_text()
    prompt = tok(text, return_tensors="pt", truncation=True, max_length=1200).to("cuda")
    n = prompt["input_ids"].shape[1]
    cache = OscarCache.from_artifact(art, cfg, batch_size=1, max_tokens=2048, device="cuda")
    out = m.generate(**prompt, max_new_tokens=16, do_sample=False, **cache_kw(m, cache=cache))
    ref = plain.generate(**prompt, max_new_tokens=16, do_sample=False)
    assert out.shape == ref.shape and out[0, n] == ref[0, n]
    assert cache.paged.hist_len(cache.seq_ids[0]) >= 64 * ((n - 64 - 256) // 64) > 0


@torch.no_grad()
def test_serving_past_the_fitted_context_warns_once():
    """An artifact records the context its clips were fitted for; serving past it warns once, naming both lengths,
    and serving within it is silent (an artifact that records nothing never warns)."""
    import json
    import warnings

    m = enable_oscar_attention(model())
    art = random_artifact()
    art.metadata["calibration"] = json.dumps({"holdout_len": 20, "seq_len": 8})
    assert art.fitted_context == 20
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_logits(m, make_cache(art, m), prompt, torch.arange(8))  # 20 tokens: within the fitted context
    assert not [w for w in caught if "fitted for" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_logits(m, make_cache(art, m), prompt, torch.arange(12))  # 24 tokens: past it
    hits = [str(w.message) for w in caught if "fitted for" in str(w.message)]
    assert len(hits) == 1 and "serving 21 tokens, past the 20-token context" in hits[0], hits
    art.metadata["calibration"] = json.dumps({"seq_len": 8})  # written before holdout_len was recorded
    assert art.fitted_context == 8
    art.metadata["calibration"] = "{}"
    assert art.fitted_context is None
