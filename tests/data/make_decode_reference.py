"""Throw-away: record the pre-refactor decode kernel's outputs (TRITON_INTERPRET=1) at small shapes covering every
production path, for tests/test_decode_bitwise.py. Run from the repo root on the commit that the test names:
    TRITON_INTERPRET=1 python tests/data/make_decode_reference.py
"""
import json
import os

os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from runtime_kernels import attention as A  # noqa: E402
from runtime_kernels.quant import naive as qnaive  # noqa: E402

# name: (d, group, lens, splits, mode, whole_pages, paired_v, q dtype, group_size)
CASES = {
    "d128_g4_whole_s1_shared_vpair": (128, 4, [256, 0, 128], 1, "shared", True, True, "bf16", None),
    "d128_g4_whole_s3_fused_vpair": (128, 4, [256, 0, 128], 3, "fused", True, True, "bf16", None),
    "d128_g4_tail_s2_shared": (128, 4, [130, 0, 71], 2, "shared", False, False, "bf16", None),
    "d128_g4_tail_s1_fused": (128, 4, [130, 0, 71], 1, "fused", False, False, "bf16", None),
    "d64_g8_whole_s2_shared_vpair": (64, 8, [192, 64, 0], 2, "shared", True, True, "bf16", None),
    "d64_g8_tail_s3_fused": (64, 8, [150, 5, 0], 3, "fused", False, False, "bf16", None),
    "d256_g1_whole_s2_fused_vpair": (256, 1, [128, 0], 2, "fused", True, True, "bf16", None),
    "d256_g1_tail_s1_shared": (256, 1, [70, 64], 1, "shared", False, False, "bf16", None),
    "d128_g8_whole_s2_shared": (128, 8, [128, 64], 2, "shared", True, False, "bf16", None),
    "d128_g1_whole_s1_fused_vpair": (128, 1, [192, 0], 1, "fused", True, True, "fp16", None),
    "d128_g4_whole_auto_shared_vpair": (128, 4, [320, 64], None, "shared", True, True, "bf16", None),
    "d128_g4_hist_whole_auto_vpair": (128, 4, [256, 0, 128], None, "history", True, True, "bf16", None),
    "d64_g4_hist_tail_s2": (64, 4, [130, 0, 71], 2, "history", False, False, "bf16", None),
    "fallback_fp32q_d128_g4_tail_s2": (128, 4, [130, 0, 71], 2, "shared", False, False, "fp32", None),
    "fallback_group32_d64_g4_s2": (64, 4, [130, 64], 2, "shared", False, False, "bf16", 32),
}
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PAGE, W = 64, 40


def make_inputs(d, group, lens, qdt, group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    h_kv = 2
    max_pages = max(1, max(-(-n // PAGE) for n in lens))
    n_pages = len(lens) * max_pages + 1

    def pool():
        x = torch.randn(n_pages * PAGE, h_kv, d, generator=gen) * torch.exp(
            0.5 * torch.randn(n_pages * PAGE, h_kv, 1, generator=gen))
        c, s, z = qnaive.quantize_pack(x, None, None, group_size or d)
        return [t.reshape(n_pages, PAGE, h_kv, -1).transpose(1, 2).contiguous() for t in (c, s, z)]

    kc, ks, kz = pool()
    vc, vs, vz = pool()
    table = torch.randperm(n_pages, generator=gen)[: len(lens) * max_pages].reshape(len(lens), max_pages)
    wdt = torch.float32 if qdt == torch.float32 else qdt
    k_win = torch.randn(len(lens) + 1, h_kv, W, d, generator=gen).to(wdt)
    v_win = torch.randn(len(lens) + 1, h_kv, W, d, generator=gen).to(wdt)
    q = (torch.randn(len(lens), h_kv * group, d, generator=gen) * 1.5).to(qdt)
    slot_ids = torch.randperm(len(lens) + 1, generator=gen)[: len(lens)].to(torch.int32)
    win_len = torch.randint(1, W + 1, (len(lens),), generator=gen).to(torch.int32)
    return dict(q=q, k_codes=kc, k_scale=ks, k_zero=kz, v_codes=vc, v_scale=vs, v_zero=vz,
                block_table=table.to(torch.int32), hist_len=torch.tensor(lens, dtype=torch.int32),
                k_win=k_win, v_win=v_win, slot_ids=slot_ids, win_len=win_len)


def paired(vs, vz):
    from runtime_kernels.attention.triton_int2 import alloc_paired_v_pools, paired_v_pools

    ps, pz = alloc_paired_v_pools(vs.shape[0], vs.shape[1], vs.shape[2], vs.device)
    ps.copy_(vs)
    pz.copy_(vz)
    assert paired_v_pools(ps, pz)
    return ps, pz


def run(case, t):
    d, group, lens, splits, mode, whole, vpair, qdt, gs = case
    vs, vz = paired(t["v_scale"], t["v_zero"]) if vpair else (t["v_scale"], t["v_zero"])
    pool = (t["k_codes"], t["k_scale"], t["k_zero"], t["v_codes"], vs, vz, t["block_table"], t["hist_len"])
    if mode == "history":
        return A.int2_decode_attention(t["q"], *pool, backend="triton", num_splits=splits, whole_pages=whole)
    return A.decode_attention(t["q"], *pool, t["k_win"], t["v_win"], t["slot_ids"], t["win_len"], backend="triton",
                              num_splits=splits, whole_pages=whole, fused=mode == "fused")


if __name__ == "__main__":
    out = {}
    meta = {}
    for i, (name, case) in enumerate(CASES.items()):
        t = make_inputs(case[0], case[1], case[2], DT[case[7]], case[8], seed=100 + i)
        o, lse = run(case, t)
        for k, v in t.items():
            out[f"{name}.{k}"] = v.contiguous()
        out[f"{name}.o"] = o
        out[f"{name}.lse"] = lse
        meta[name] = dict(splits=case[3], mode=case[4], whole_pages=case[5], paired_v=case[6])
        print(name, tuple(o.shape), float(o.abs().max()), flush=True)
    save_file(out, "tests/data/decode_reference.safetensors", metadata={"cases": json.dumps(meta)})
