"""The plain INT2 decode kernel, for inputs the production kernel (`kernel.py`) does not take: fp32 queries, several
scale groups per row, page sizes that are not a multiple of the tile, odd code strides.

Grid `(B, H_kv, num_splits)`, same outputs as the production kernel. The GQA group sits on the MMA rows
(`G_PAD >= 16`, padding rows are zero queries); each quarter of a row's code bytes is scored separately
(byte j holds channels j, j+Q, j+2Q, j+3Q), q.k being the sum of four partial dots over Q channels.

One group per row: dequantization folds out of the dots,
    q . k_t = s_t (q . c_t - z_t sum(q)),    sum_t p_t v_t = dot(p s, c) - sum_t p_t s_t z_t,
so the dots run on raw codes, made exact MMA operands without an int -> float conversion: the code is OR-ed
into the mantissa of a float whose mantissa spacing is 1 (bf16 0x4300 | c = 128 + c, fp16 0x6400 | c = 1024 + c,
fp32 0x4B000000 | c = 2^23 + c) and the offset is subtracted (V, and K with fp16/fp32 queries) or folded into the
zero term (K with bf16 queries: q.(c + 128) - (z + 128) sum q). Several groups per row: the tile is dequantized
elementwise before the dots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime_kernels.attention.int2_decode.common import (
    _chunk_bounds,
    _dot,
    _scale_f32,
    _softmax_finish,
    _zero_f32,
)


@triton.jit
def _magic_codes(b, SHIFT: tl.constexpr, dt: tl.constexpr, SUB: tl.constexpr, INTERP: tl.constexpr):
    """Codes `(b >> SHIFT) & 3` of a uint8 tile as `dt` without any int -> float conversion instruction: OFFSET +
    code by a same-width bitcast, minus OFFSET when SUB (exact). The interpreter does bf16 arithmetic on raw bits,
    so there the subtraction runs in fp32."""
    c = (b >> SHIFT) & 3
    if dt == tl.float32:
        x = (c.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
        off: tl.constexpr = 8388608.0
    elif dt == tl.bfloat16:
        x = (c.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
        off: tl.constexpr = 128.0
    else:
        x = (c.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
        off: tl.constexpr = 1024.0
    if SUB:
        if INTERP:
            x = (x.to(tl.float32) - off).to(dt)
        else:
            x = x - off
    return x


@triton.jit
def _dequant_quarter(c, zs, ss, gi, cm):
    """`(code - zero) * scale` of one channel quarter `[BLOCK_N, Q_PAD]`, fp32, per-channel-group scale/zero."""
    return (c.to(tl.float32) - _zero_f32(tl.load(zs + gi, mask=cm, other=0))) * \
        tl.where(cm, _scale_f32(tl.load(ss + gi, mask=cm, other=0)), 0.0)


@triton.jit(do_not_specialize=["split_offset"])
def _int2_decode_fallback_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, km_ptr, vm_ptr,
    qk_scale, split_offset,
    stride_qb, stride_qh,
    stride_kcp, stride_kch, stride_kcr,
    stride_ksp, stride_ksh, stride_ksr,
    stride_vcp, stride_vch, stride_vcr,
    stride_vsp, stride_vsh, stride_vsr,
    stride_btb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, Q: tl.constexpr, Q_PAD: tl.constexpr,
    GS: tl.constexpr, NG: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr,
    INTERP: tl.constexpr, KFOLD: tl.constexpr, CENTER: tl.constexpr,
):
    # KFOLD (bf16 queries, one group per row): the K codes keep their +128 offset, folded into the zero term.
    # CENTER: centered pools (means km/vm fp32 `[H_kv, d]`): lse + q.mu_k * sm_scale, o + mu_v (see `kernel.py`).
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    n_split = tl.num_programs(2)
    start, end = _chunk_bounds(len_ptr, b, sp, n_split, BLOCK_N)

    offs_g = tl.arange(0, G_PAD)
    g_ok = offs_g < GROUP
    offs_j = tl.arange(0, Q_PAD)
    j_ok = offs_j < Q
    offs_n = tl.arange(0, BLOCK_N)
    qm = g_ok[:, None] & j_ok[None, :]
    q_row = q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh + offs_j[None, :]
    q0 = tl.load(q_row, mask=qm, other=0.0)
    q1 = tl.load(q_row + Q, mask=qm, other=0.0)
    q2 = tl.load(q_row + 2 * Q, mask=qm, other=0.0)
    q3 = tl.load(q_row + 3 * Q, mask=qm, other=0.0)
    if FP32:
        cdt = tl.float32
        pdt = tl.float32
    else:
        cdt = q0.dtype
        pdt = tl.float16  # p * scale <= 65504 because the scale itself is stored in fp16
    q0 = q0.to(cdt)
    q1 = q1.to(cdt)
    q2 = q2.to(cdt)
    q3 = q3.to(cdt)
    qsum = tl.sum(q0.to(tl.float32) + q1.to(tl.float32) + q2.to(tl.float32) + q3.to(tl.float32), axis=1)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc0 = tl.zeros([G_PAD, Q_PAD], tl.float32)
    acc1 = tl.zeros([G_PAD, Q_PAD], tl.float32)
    acc2 = tl.zeros([G_PAD, Q_PAD], tl.float32)
    acc3 = tl.zeros([G_PAD, Q_PAD], tl.float32)
    acc_z = tl.zeros([G_PAD], tl.float32)

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for t0 in range(start, end, BLOCK_N):
        t = t0 + offs_n
        t_ok = t < end
        if P % BLOCK_N == 0:
            page = tl.load(bt_row + t0 // P).to(tl.int64)
        else:
            page = tl.load(bt_row + t // P, mask=t_ok, other=0).to(tl.int64)
        r = (t % P).to(tl.int64)
        kc_row = page * stride_kcp + h * stride_kch + r * stride_kcr  # [BLOCK_N]
        vc_row = page * stride_vcp + h * stride_vch + r * stride_vcr
        ks_row = page * stride_ksp + h * stride_ksh + r * stride_ksr
        vs_row = page * stride_vsp + h * stride_vsh + r * stride_vsr
        cm = t_ok[:, None] & j_ok[None, :]
        kb = tl.load(kc_ptr + kc_row[:, None] + offs_j[None, :], mask=cm, other=0)
        vb = tl.load(vc_ptr + vc_row[:, None] + offs_j[None, :], mask=cm, other=0)

        if NG == 1:
            # masked rows: scale 0 in either format (a ue5m3 code 0 would decode to 2^-15)
            ks = tl.where(t_ok, _scale_f32(tl.load(ks_ptr + ks_row, mask=t_ok, other=0)), 0.0)
            kz = _zero_f32(tl.load(kz_ptr + ks_row, mask=t_ok, other=0))
            vs = tl.where(t_ok, _scale_f32(tl.load(vs_ptr + vs_row, mask=t_ok, other=0)), 0.0)
            vz = _zero_f32(tl.load(vz_ptr + vs_row, mask=t_ok, other=0))
            qc = _dot(q0, tl.trans(_magic_codes(kb, 0, cdt, not KFOLD, INTERP)), FP32, INTERP)
            qc += _dot(q1, tl.trans(_magic_codes(kb, 2, cdt, not KFOLD, INTERP)), FP32, INTERP)
            qc += _dot(q2, tl.trans(_magic_codes(kb, 4, cdt, not KFOLD, INTERP)), FP32, INTERP)
            qc += _dot(q3, tl.trans(_magic_codes(kb, 6, cdt, not KFOLD, INTERP)), FP32, INTERP)
            if KFOLD:
                kz = kz + 128.0  # the bf16 magic offset of every code, folded into the zero term
            s = (qc - qsum[:, None] * kz[None, :]) * (ks * qk_scale)[None, :]
        else:
            # Several groups per row: per-channel scale/zero tiles, dequantize, then dot.
            gi0 = (offs_j // GS)[None, :]
            gi1 = ((offs_j + Q) // GS)[None, :]
            gi2 = ((offs_j + 2 * Q) // GS)[None, :]
            gi3 = ((offs_j + 3 * Q) // GS)[None, :]
            kss = ks_ptr + ks_row[:, None]
            kzs = kz_ptr + ks_row[:, None]
            k0 = _dequant_quarter(kb & 3, kzs, kss, gi0, cm)
            k1 = _dequant_quarter((kb >> 2) & 3, kzs, kss, gi1, cm)
            k2 = _dequant_quarter((kb >> 4) & 3, kzs, kss, gi2, cm)
            k3 = _dequant_quarter((kb >> 6) & 3, kzs, kss, gi3, cm)
            qc = _dot(q0, tl.trans(k0.to(cdt)), FP32, INTERP)
            qc += _dot(q1, tl.trans(k1.to(cdt)), FP32, INTERP)
            qc += _dot(q2, tl.trans(k2.to(cdt)), FP32, INTERP)
            qc += _dot(q3, tl.trans(k3.to(cdt)), FP32, INTERP)
            s = qc * qk_scale

        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: tile holds at least one valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc0 = acc0 * alpha[:, None]
        acc1 = acc1 * alpha[:, None]
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
        if NG == 1:
            pv = (p * vs[None, :]).to(pdt)
            acc_z = acc_z * alpha + tl.sum(pv.to(tl.float32) * vz[None, :], axis=1)
            acc0 += _dot(pv, _magic_codes(vb, 0, pdt, True, INTERP), FP32, INTERP)
            acc1 += _dot(pv, _magic_codes(vb, 2, pdt, True, INTERP), FP32, INTERP)
            acc2 += _dot(pv, _magic_codes(vb, 4, pdt, True, INTERP), FP32, INTERP)
            acc3 += _dot(pv, _magic_codes(vb, 6, pdt, True, INTERP), FP32, INTERP)
        else:
            vss = vs_ptr + vs_row[:, None]
            vzs = vz_ptr + vs_row[:, None]
            pc = p.to(cdt)
            acc0 += _dot(pc, _dequant_quarter(vb & 3, vzs, vss, gi0, cm).to(cdt), FP32, INTERP)
            acc1 += _dot(pc, _dequant_quarter((vb >> 2) & 3, vzs, vss, gi1, cm).to(cdt), FP32, INTERP)
            acc2 += _dot(pc, _dequant_quarter((vb >> 4) & 3, vzs, vss, gi2, cm).to(cdt), FP32, INTERP)
            acc3 += _dot(pc, _dequant_quarter((vb >> 6) & 3, vzs, vss, gi3, cm).to(cdt), FP32, INTERP)
        m_i = m_new

    inv, lse = _softmax_finish(m_i, l_i)
    o_row = (o_ptr + b.to(tl.int64) * stride_ob + (h * GROUP + offs_g)[:, None] * stride_oh
             + (split_offset + sp) * stride_os + offs_j[None, :])
    o0 = (acc0 - acc_z[:, None]) * inv[:, None]
    o1 = (acc1 - acc_z[:, None]) * inv[:, None]
    o2 = (acc2 - acc_z[:, None]) * inv[:, None]
    o3 = (acc3 - acc_z[:, None]) * inv[:, None]
    if CENTER:
        km = km_ptr + h * (4 * Q) + offs_j
        vm = vm_ptr + h * (4 * Q) + offs_j
        qmu = tl.sum(q0.to(tl.float32) * tl.load(km, mask=j_ok, other=0.0)[None, :]
                     + q1.to(tl.float32) * tl.load(km + Q, mask=j_ok, other=0.0)[None, :]
                     + q2.to(tl.float32) * tl.load(km + 2 * Q, mask=j_ok, other=0.0)[None, :]
                     + q3.to(tl.float32) * tl.load(km + 3 * Q, mask=j_ok, other=0.0)[None, :], axis=1)
        lse = lse + qmu * (qk_scale * 0.6931471805599453)  # -inf stays -inf
        has = (l_i > 0.0)[:, None]
        o0 += tl.where(has, tl.load(vm, mask=j_ok, other=0.0)[None, :], 0.0)
        o1 += tl.where(has, tl.load(vm + Q, mask=j_ok, other=0.0)[None, :], 0.0)
        o2 += tl.where(has, tl.load(vm + 2 * Q, mask=j_ok, other=0.0)[None, :], 0.0)
        o3 += tl.where(has, tl.load(vm + 3 * Q, mask=j_ok, other=0.0)[None, :], 0.0)
    tl.store(o_row, o0, mask=qm)
    tl.store(o_row + Q, o1, mask=qm)
    tl.store(o_row + 2 * Q, o2, mask=qm)
    tl.store(o_row + 3 * Q, o3, mask=qm)
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + (h * GROUP + offs_g) * stride_lh + split_offset + sp,
             lse, mask=g_ok)
