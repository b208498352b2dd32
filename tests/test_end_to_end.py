"""End to end: calibrate the trained tiny fixture, write the artifact, push it to a local Hub server, load it back
through `runtime_kernels.load_artifact`, `generate` with `OscarCache` on the kernels (the Triton interpreter on CPU),
and compare with a fake-quant reference built from the loaded artifact (`quant.naive.fake_quantize` on the history
segment of a plain full-precision cache).

The cache keeps bf16 windows, as served: every decode call then takes the production grid (history and window
programs in one grid) at head_dim 128 with whole 64-token pages, int8 scores and quad scale/zero pools, which the test
reads from the plan each call logs (`runtime_kernels.attention.int2_decode.launch`, DEBUG). The reference rounds
where the cache does (the rotated rows and the rotated query to bf16, the history quantized from the bf16 rows) and
is otherwise exact fp32 attention; what is left is the kernel's own arithmetic (bf16 window probabilities, the int8
hi/lo query, fp16 p * scale).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from format_helpers import qfmt
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from oscar_calib.calibration.calibrate import calibrate_model
from oscar_calib.config import SolverSettings
from runtime_kernels import load_artifact
from runtime_kernels.artifact import write_artifact
from runtime_kernels.hf import OscarCache, enable_oscar_attention
from runtime_kernels.quant import naive as quant_naive

pytestmark = pytest.mark.interpreter

FIXTURE = Path(__file__).resolve().parents[1] / "oscar_calib" / "fixtures" / "tiny-qwen3"
TOKEN = "hf_e2e_TOKEN_not_for_printing"
REPO, MODEL, REV = "org/zoo", "tiny/qwen3-fixture", "b" * 40
S, R, P = 4, 8, 64  # small windows, so a short prompt already has whole 64-token INT2 pages
NEW_TOKENS = 6
WINDOW_DTYPE = torch.bfloat16  # the served window dtype, which the production grid takes
# Max |logit difference| over the generated steps (max |logit| 14.7): measured 0.015 (the kernel's bf16 window
# probabilities and int8 hi/lo query); a reference that drops one cached position is 0.20 away, one without the
# history's centering mean 2.0, one without its quantization 0.97.
LOGIT_ATOL = 0.06
LOGGER = "runtime_kernels.attention.int2_decode.launch"


def cache_kw(model, cache):
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return {name: cache}


def rotated_rows(x, rotation):
    """`x [B, H, T, d] @ R [H, d, d]` per head, exactly rounded to fp32, then stored as the window dtype (what the
    cache keeps for every cached position) -> fp32 values `[B, H, T, d]`."""
    return torch.einsum("bhtd,hde->bhte", x.double(), rotation.double()).float().to(WINDOW_DTYPE).float()


def fake_quant_attention(art):
    """Attention over a plain cache's full-precision K/V as the OSCAR cache stores them (the artifact's centering
    mean, rotation, clip ratio, group size, scale format and quantizer): every cached row rotated and rounded to the
    window dtype, the history segment `[S, S + h)` fake-quantized from those rows, `fq(x_rot - mu) + mu`; the query
    rotated and rounded likewise. The attention itself runs in fp32 in the model's basis (everything rotated back)."""
    pos = {int(g): i for i, g in enumerate(art.layer_ids.tolist())}

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        i = pos.get(module.layer_idx)
        if i is not None and query.shape[2] == 1:  # a decode step: every position is read from the OSCAR cache
            n = key.shape[2]
            h = P * (max(0, n - S - R) // P)
            rk, rv = art.k_rotation[i].float(), art.v_rotation[i].float()
            kr, vr = rotated_rows(key, rk), rotated_rows(value, rv)
            for t, mu, ratio in ((kr, art.key_mean("rotated")[i], art.k_clip_ratio[i]),
                                 (vr, art.value_mean("rotated")[i], art.v_clip_ratio[i])):
                for b in range(t.shape[0]):
                    seg = t[b, :, S:S + h].transpose(0, 1)  # [h, H, d], rotated
                    fq = quant_naive.fake_quantize(seg, None, ratio, qfmt(art.group_size, art.scale_format, quantizer=art.quantizer), unrotate=False, mean=mu)
                    t[b, :, S:S + h] = fq.transpose(0, 1)
            rq = rk.repeat_interleave(query.shape[1] // key.shape[1], dim=0)  # query head j reads KV head j // g
            qr = rotated_rows(query, rq)
            query = torch.einsum("bhte,hde->bhtd", qr, rq)  # back to the model's basis (R orthogonal)
            key = torch.einsum("bhte,hde->bhtd", kr, rk)
            value = torch.einsum("bhte,hde->bhtd", vr, rv)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)

    return attention


@torch.no_grad()
def test_calibrate_push_load_generate_matches_the_fake_quant_reference(hub, tmp_path, caplog):
    from oscar_calib.zoo.hub import push

    tok = AutoTokenizer.from_pretrained(FIXTURE)
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    calib = tok((FIXTURE / "calib.txt").read_text(), return_tensors="pt")["input_ids"][0]
    ids = calib[: 4 * 128].reshape(4, 128)
    # the shipped recipe (centered, block_out clips) with the test's small windows
    art = calibrate_model(model, ids, SolverSettings(kv_format={"sink_tokens": S, "recent_tokens": R}), model_id=MODEL,
                          model_revision=REV, holdout_queries=64)
    assert art.is_centered
    write_artifact(art, tmp_path / "art")
    push(tmp_path / "art", REPO, token=TOKEN, endpoint=hub.endpoint)
    loaded = load_artifact(MODEL, repo=REPO, revision="v1", token=TOKEN, cache_dir=tmp_path / "cache",
                           endpoint=hub.endpoint, model_config=model.config)
    for name in ("k_rotation", "v_rotation", "k_clip_ratio", "v_clip_ratio"):
        assert torch.equal(getattr(loaded, name), getattr(art, name)), name  # what was calibrated came back

    prompt = tok((FIXTURE / "heldout.txt").read_text(), return_tensors="pt")["input_ids"][:, :90]
    oscar = enable_oscar_attention(AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval())
    # the model is a local copy of the Hub id the artifact names: the identity rule needs the explicit override
    cache = OscarCache.from_artifact(loaded, oscar.config, batch_size=1, max_tokens=128,
                                     fmt=loaded.kv_format.with_(page_size=P), dtype=WINDOW_DTYPE,
                                     allow_other_model=True)
    with caplog.at_level("DEBUG", logger=LOGGER):
        got = oscar.generate(input_ids=prompt, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, **cache_kw(oscar, cache))
    assert cache.paged.hist_len(cache.seq_ids[0]) == P  # the decode steps read a whole INT2 page
    # Every decode call of every calibrated layer ran the production grid on its fastest tile loop.
    plans = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(plans) == (NEW_TOKENS - 1) * len(loaded.layer_ids)
    for plan in plans:
        for field in ("kernel='grid'", "whole_pages=True", "int8_scores=True", "scale_layout='quad'", "reason=''"):
            assert field in plan, plan

    AttentionInterface.register("e2e_fakequant", fake_quant_attention(loaded))
    from transformers import AttentionMaskInterface

    AttentionMaskInterface.register("e2e_fakequant", sdpa_mask)
    ref = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    ref.set_attn_implementation("e2e_fakequant")
    want = ref.generate(input_ids=prompt, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=0, **cache_kw(ref, DynamicCache()))
    assert torch.equal(got.sequences, want.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits))
    assert diff < LOGIT_ATOL, diff
