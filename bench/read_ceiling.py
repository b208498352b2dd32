"""How fast can the INT2 decode kernel's bytes be read at all? A kernel that reads exactly what the history programs
read (per 64-token tile of a (sequence, KV head): 2 KiB of K codes, 2 KiB of V codes and four 128-byte fp16 scale /
zero vectors, from pages scattered by the block table, in the same grid of splits) and only XORs the words together,
next to the real INT2 kernel on the same cache, and per cache layout.

    python3 bench/read_ceiling.py --out OUT [--point 131072x8] [--pps 16,28] [--caches 6,6:layout=tile,6:page=128]

If the read-only kernel is not much faster than the INT2 kernel, the access pattern (not the arithmetic) is the
limit, and more speed needs another layout; if it is much faster, the arithmetic is. Writes
`read_ceiling_<gpu>.json` and prints a table (median ms of `triton.testing.do_bench`, L2 flushed, GB/s of history
bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from runtime_kernels.attention.triton_int2 import _pick_page  # noqa: E402 - the INT2 kernel's page pick


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _split_tiles(len_ptr, b, s, n_split, P: tl.constexpr):
    """Tiles `[t_lo, t_hi)` (whole pages) of split s of n_split of sequence b's history."""
    n_tiles = tl.load(len_ptr + b) // P
    per = tl.cdiv(n_tiles, n_split)
    t_lo = s * per
    return t_lo, tl.minimum(t_lo + per, n_tiles)


@triton.jit
def _fold(acc_c, acc_s, kw, vw, ks, kz, vs, vz):
    """XOR one tile into the running checksums: code words (int16) into acc_c, fp16 scale / zero bits into acc_s."""
    acc_c = acc_c ^ (kw.to(tl.int32) ^ vw.to(tl.int32))
    acc_s = acc_s ^ (ks.to(tl.int16, bitcast=True).to(tl.int32) ^ kz.to(tl.int16, bitcast=True).to(tl.int32)
                     ^ vs.to(tl.int16, bitcast=True).to(tl.int32) ^ vz.to(tl.int16, bitcast=True).to(tl.int32))
    return acc_c, acc_s


@triton.jit
def _read_tiles_kernel(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_ptr, len_ptr, out_ptr,
                       stride_kcp, stride_kch, stride_kcr, stride_ksp, stride_ksh, stride_ksr,
                       stride_vcp, stride_vch, stride_vcr, stride_vsp, stride_vsh, stride_vsr, stride_btb,
                       P: tl.constexpr, U: tl.constexpr, CACHE: tl.constexpr = ""):
    """Program (b, h, s): the tiles (one page each) of split s of sequence b's history, KV head h, read and XORed
    into one int32 at `out[b, h, s]`. Codes as int16 words `[P, U]`, scales and zeros as fp16 bits `[P]`."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    t_lo, t_hi = _split_tiles(len_ptr, b, s, tl.num_programs(2), P)
    rows = tl.arange(0, P)
    words = tl.arange(0, U)
    c_off = rows[:, None] * stride_kcr + words[None, :]
    acc_c = tl.zeros([P, U], tl.int32)
    acc_s = tl.zeros([P], tl.int32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    # The next tile's page id is loaded one tile ahead, so a tile costs one memory round trip, not two.
    page_next = tl.load(bt_row + tl.minimum(t_lo, tl.maximum(t_hi - 1, 0)))
    for t in range(t_lo, t_hi):
        page = page_next.to(tl.int64)
        page_next = tl.load(bt_row + tl.minimum(t + 1, t_hi - 1))
        kw = tl.load(kc_ptr + page * stride_kcp + h * stride_kch + c_off, cache_modifier=CACHE)
        vw = tl.load(vc_ptr + page * stride_vcp + h * stride_vch + c_off, cache_modifier=CACHE)
        srow = page * stride_ksp + h * stride_ksh + rows * stride_ksr
        vrow = page * stride_vsp + h * stride_vsh + rows * stride_vsr
        ks = tl.load(ks_ptr + srow, cache_modifier=CACHE)
        kz = tl.load(kz_ptr + srow, cache_modifier=CACHE)
        vs = tl.load(vs_ptr + vrow, cache_modifier=CACHE)
        vz = tl.load(vz_ptr + vrow, cache_modifier=CACHE)
        acc_c, acc_s = _fold(acc_c, acc_s, kw, vw, ks, kz, vs, vz)
    x = tl.reduce(tl.reduce(acc_c, 0, _xor), 0, _xor) ^ tl.reduce(acc_s, 0, _xor)
    tl.store(out_ptr + (b * tl.num_programs(1) + h) * tl.num_programs(2) + s, x)


@triton.jit
def _read_tiles_tma_kernel(kc_desc, ks_desc, kz_desc, vc_desc, vs_desc, vz_desc, bt_ptr, len_ptr, out_ptr,
                           stride_btb, H: tl.constexpr, P: tl.constexpr, U: tl.constexpr, NPV: tl.constexpr,
                           STAGES: tl.constexpr):
    """`_read_tiles_kernel` through the Hopper tensor memory accelerator, with the INT2 kernel's page picks (ids NPV
    at a time into registers, so every address is a function of the loop index and the loop pipelines, STAGES - 1
    tiles in flight): each tile's code blocks `[P, U]` and scale vectors `[1, P]` as TMA box copies from 2-D
    descriptors over the pools (codes `[pages * H * P, U]` int16, scales `[pages * H, P]` fp16), one instruction per
    box instead of a cp.async per lane and 16 bytes."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    t_lo, t_hi = _split_tiles(len_ptr, b, s, tl.num_programs(2), P)
    offs_pv = tl.arange(0, NPV)
    acc_c = tl.zeros([P, U], tl.int32)
    acc_s = tl.zeros([1, P], tl.int32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for jb in range(t_lo, t_hi, NPV):
        pg = tl.load(bt_row + jb + offs_pv, mask=jb + offs_pv < t_hi, other=0)
        # Loads that feed no dot are pipelined only when the loop asks for it.
        for jj in tl.range(0, tl.minimum(NPV, t_hi - jb), num_stages=STAGES):
            row = (_pick_page(pg, offs_pv, jj) * H + h).to(tl.int32)
            kw = kc_desc.load([row * P, 0])
            vw = vc_desc.load([row * P, 0])
            ks = ks_desc.load([row, 0])
            kz = kz_desc.load([row, 0])
            vs = vs_desc.load([row, 0])
            vz = vz_desc.load([row, 0])
            acc_c, acc_s = _fold(acc_c, acc_s, kw, vw, ks, kz, vs, vz)
    x = tl.reduce(tl.reduce(acc_c, 0, _xor), 0, _xor) ^ tl.reduce(tl.reduce(acc_s, 0, _xor), 0, _xor)
    tl.store(out_ptr + (b * tl.num_programs(1) + h) * tl.num_programs(2) + s, x)


def read_tiles(pools, table: torch.Tensor, hist_len: torch.Tensor, splits: int, loads: str = "ldg",
               num_stages: int = 3) -> torch.Tensor:
    """Launch the read-only kernel over whole-page histories -> int32 `[B, H_kv, splits]` XORs. pools: (kc, ks, kz, vc,
    vs, vz) as `attention.decode_attention` takes them (uint8 codes `[pages, H, P, d/4]`, fp16 `[pages, H, P, 1]`).
    loads: "ldg" (plain loads, one tile at a time), "ldg_cg" (the same, L1 bypassed: `.cg`) or "tma" (tensor memory
    accelerator box copies, `num_stages - 1` tiles in flight; contiguous pools, sm_90+)."""
    kc, ks, kz, vc, vs, vz = pools
    b, h, page = table.shape[0], kc.shape[1], kc.shape[2]
    if kc.shape[3] % 2:
        raise ValueError(f"read_tiles: code rows of {kc.shape[3]} bytes, expected an even number (int16 words)")
    kw, vw = kc.view(torch.int16), vc.view(torch.int16)
    out = torch.empty(b, h, splits, dtype=torch.int32, device=kc.device)
    strides = (kw.stride(0), kw.stride(1), kw.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
               vw.stride(0), vw.stride(1), vw.stride(2), vs.stride(0), vs.stride(1), vs.stride(2), table.stride(0))
    if loads in ("ldg", "ldg_cg"):
        _read_tiles_kernel[(b, h, splits)](kw, ks, kz, vw, vs, vz, table, hist_len, out, *strides,
                                           P=page, U=kw.shape[3], CACHE=".cg" if loads == "ldg_cg" else "",
                                           num_warps=1)
    elif loads == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        u = kw.shape[3]
        if not all(t.is_contiguous() for t in (kw, vw, ks, kz, vs, vz)):
            raise ValueError("read_tiles: loads='tma' needs contiguous pools (2-D descriptors over them)")
        codes = [TensorDescriptor.from_tensor(t.view(-1, u), [page, u]) for t in (kw, vw)]
        scales = [TensorDescriptor.from_tensor(t.view(-1, page), [1, page]) for t in (ks, kz, vs, vz)]
        _read_tiles_tma_kernel[(b, h, splits)](codes[0], scales[0], scales[1], codes[1], scales[2], scales[3],
                                               table, hist_len, out, table.stride(0), H=h, P=page, U=u, NPV=64,
                                               STAGES=num_stages, num_warps=1)
    else:
        raise ValueError(f"read_tiles: loads={loads!r}, expected 'ldg', 'ldg_cg' or 'tma'")
    return out


def reference_xor(pools, table: torch.Tensor, hist_len: torch.Tensor) -> torch.Tensor:
    """XOR of every int16 word of codes and fp16 scale / zero bits a (sequence, KV head) history holds -> int32
    `[B, H_kv]` (independent of the split: XOR is associative)."""
    import numpy as np

    pools = [t.cpu() for t in pools]  # codes (uint8, two bytes a word) and fp16 scales / zeros alike as int16
    b, h, page = table.shape[0], pools[0].shape[1], pools[0].shape[2]
    out = np.zeros((b, h), dtype=np.int32)
    for i in range(b):
        pages = table[i, : int(hist_len[i]) // page].cpu().long()
        for j in range(h):
            for t in pools:
                out[i, j] ^= np.bitwise_xor.reduce(
                    t[pages, j].contiguous().view(torch.int16).numpy().astype(np.int32), axis=None)
    return torch.from_numpy(out)


def main() -> None:
    from bench_decode import DEV, H_KV, H_Q, D, make_int2_cache
    from bench_decode_graph import apply_variant, int2_history_bytes, point_inputs, variant_cache

    from runtime_kernels import attention as A
    from runtime_kernels.attention import triton_int2

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--point", default="131072x8", help="CONTEXTxBATCH")
    ap.add_argument("--pps", default="16,28", help="read-only programs per SM (split rule; 28 fit at 72 registers), "
                    "comma-separated")
    ap.add_argument("--caches", default="6,6:layout=tile,6:order=ordered,6:page=128",
                    help="cache layouts as bench_decode_graph variants (their layout=, order=, page= keys; their other "
                    "keys set the INT2 kernel's switches), comma-separated")
    ap.add_argument("--loads", default="ldg,ldg_cg,tma", help="read-only kernels: ldg (plain loads), ldg_cg (plain "
                    "loads bypassing L1), tma (TMA box copies, pipelined), comma-separated")
    ap.add_argument("--once", action="store_true", help="launch each kernel twice without timing (for Nsight Compute: "
                    "ncu -k regex:'_read_tiles|_int2_decode' --metrics ... python3 bench/read_ceiling.py --once ...)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("read_ceiling: needs a CUDA GPU")
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "point": args.point, "rows": []}
    print(f"{report['gpu']}, {args.point}: history bytes read per call, ms (do_bench median, L2 flushed), GB/s")
    for cache in args.caches.split(","):
        context, batch, gen, q = point_inputs(args.point)
        layout, order, page = variant_cache(cache, default_layout="separate")  # the TMA reader needs contiguous pools
        apply_variant(cache)  # the variant's kernel switches (e.g. cp8=1) for the INT2 kernel row
        pools, table, hist_len, *_ = make_int2_cache(batch, context, gen, page, layout=layout, order=order)
        readers = {pps: max(1, pps * n_sm // (batch * H_KV)) for pps in (int(x) for x in args.pps.split(","))}  # splits
        hist_bytes = int2_history_bytes(int(hist_len.sum()))
        splits = A.int2_num_splits(q, *pools, table, hist_len, 64, 1, 3, 6, True)
        o = torch.empty(batch, H_Q, splits, D, device=DEV)
        lse = torch.empty(batch, H_Q, splits, device=DEV)
        def run_int2():
            triton_int2.launch_int2_decode(q, *pools, table, hist_len, o, lse, D ** -0.5, splits, 0, 64, 1, 3, 6,
                                           whole_pages=True)

        if args.once:  # the first launch compiles; a profiler measures the second
            for _ in range(2):
                run_int2()
                for n in readers.values():
                    for loads in args.loads.split(","):
                        read_tiles(pools, table, hist_len, n, loads)
            torch.cuda.synchronize()
            print(f"{cache}: launched the INT2 kernel and the read-only kernels ({args.loads}; {args.pps} per SM) twice")
            continue
        int2 = triton.testing.do_bench(run_int2)
        row = {"cache": cache, "bytes": hist_bytes, "int2_kernel": {"splits": splits, "ms": int2,
                                                                   "gbps": hist_bytes / int2 / 1e6}}
        want = reference_xor(pools, table, hist_len) if batch * context <= 1 << 20 else None
        for pps, n in readers.items():
            for loads in args.loads.split(","):
                name = f"read_only_{loads}_pps{pps}"
                try:
                    got = read_tiles(pools, table, hist_len, n, loads)
                    if want is not None:  # the checksum proves every byte was read (small points: the host XOR is slow)
                        xor = got[..., 0].clone()
                        for s in range(1, n):
                            xor ^= got[..., s]
                        assert torch.equal(xor.cpu(), want), "read_ceiling: checksum mismatch"
                    ms = triton.testing.do_bench(lambda n=n, loads=loads: read_tiles(pools, table, hist_len, n, loads))
                    row[name] = {"splits": n, "ms": ms, "gbps": hist_bytes / ms / 1e6}
                except Exception as e:  # noqa: BLE001 - e.g. TMA on pools that are views; the other rows still run
                    row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
        report["rows"].append(row)
        print(f"{cache}: INT2 kernel {int2:.4f} ms ({row['int2_kernel']['gbps']:.0f} GB/s, {splits} splits) | " +
              " | ".join(f"read-only {k[10:]}/SM " + (f"{v['ms']:.4f} ms ({v['gbps']:.0f} GB/s)" if "ms" in v
                                                       else v["error"])
                         for k, v in row.items() if k.startswith("read_only")), flush=True)
    if args.once:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "read_ceiling_" + report["gpu"].replace(" ", "_") + ".json"), "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
