#!/usr/bin/env python3
"""Study: a fitted 4-level codebook per (layer, KV head) against uniform INT2 levels, at equal bits.

The reference's newest tree quantizes with Lloyd-Max levels fitted on the rotated rows. Here each row is
normalised by its own min and max exactly as the uniform quantizer does (`u = (x - lo) / (hi - lo)` in
[0, 1], the same per-row scale and zero, so the same bits), and the four levels are fitted per (layer,
KV head, K or V) by Lloyd-Max on the calibration windows' rows (a 1024-bin histogram of `u`). Uniform levels
are {0, 1/3, 2/3, 1}. Held-out perplexity is measured with the evaluation's teacher-forced three-segment mask.

Rows: the default artifact (uniform, fitted clips); codebooks on values only (the int8 key-score path of the
decode kernel needs uniform key levels), on keys and values, each with the fitted clips and without clipping.

    python3 tools/codebook_study.py --model oscar_calib/fixtures/tiny-qwen3 --context 4096 --out /tmp/cb
"""

from __future__ import annotations

import json
import sys
import time

import torch
from study_common import fixture_parser, load_fixture

BINS = 1024


def lloyd_max(hist: torch.Tensor, levels: int = 4, iters: int = 200) -> torch.Tensor:
    """Levels `[levels]` in [0, 1] minimising the squared error of a density given as `hist [BINS]` on [0, 1]."""
    centers = (torch.arange(hist.numel(), dtype=torch.float64) + 0.5) / hist.numel()
    w = hist.double()
    c = torch.linspace(0, 1, levels, dtype=torch.float64)
    for _ in range(iters):
        edges = (c[1:] + c[:-1]) / 2
        cell = torch.bucketize(centers, edges)
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, w)
        moment = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, w * centers)
        new = torch.where(mass > 0, moment / mass.clamp(min=1e-300), c)
        if torch.allclose(new, c, atol=1e-9):
            break
        c = new
    return c


def codebook_quantize(xr: torch.Tensor, book: torch.Tensor | None, scale_format: str) -> torch.Tensor:
    """Rows `xr [..., H, d]` (rotated, centered, clipped) -> dequantized, with per-head levels `book [H, 4]`
    in units of the row range; None = the runtime's uniform quantizer."""
    from runtime_kernels.quant import naive

    if book is None:
        from runtime_kernels.format import DEFAULT_FORMAT

        fmt = DEFAULT_FORMAT.with_(scale_format=scale_format, quantizer="uniform_minmax")
        c, s, z = naive.quantize(xr, fmt)
        return naive.dequantize(c, s, z, fmt)
    lo = xr.amin(-1, keepdim=True)
    span = (xr.amax(-1, keepdim=True) - lo).clamp(min=1e-12)
    u = (xr - lo) / span
    b = book.to(xr.device, torch.float32)  # [H, 4]
    b = b.view(*([1] * (xr.dim() - 2)), b.shape[0], 1, 4)
    idx = (u.unsqueeze(-1) - b).abs().argmin(-1, keepdim=True)
    return lo + span * torch.gather(b.expand(*u.shape, 4), -1, idx).squeeze(-1)


def main(argv: list[str] | None = None) -> int:
    p = fixture_parser(__doc__.split("\n\n")[0])
    args = p.parse_args(argv)

    from oscar_calib.analysis.evaluate import bootstrap_delta_ci, make_windows, method_nll, read_documents
    from oscar_calib.analysis.methods import ArtifactInt2, KVMethod, _from_rows, _to_rows
    from oscar_calib.calibration.calibrate import calibrate_model_with_report
    from oscar_calib.config import SolverSettings
    from runtime_kernels.quant import naive

    def log(msg: str) -> None:
        print(f"[codebook_study {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    class CodebookInt2(ArtifactInt2):
        """The artifact's rotations and means; its clips or none; uniform or fitted levels per (layer, head)."""

        def __init__(self, name, artifact, clip: bool, sides: tuple[str, ...]):
            super().__init__(name, artifact=artifact)
            self.clip, self.sides = clip, sides
            self.hist: dict[tuple[int, str], torch.Tensor] = {}
            self.books: dict[tuple[int, str], torch.Tensor] | None = None  # None while fitting

        def _side(self, layer, side, x, rot, ratio, mean):
            b, _, t, _ = x.shape
            xf = x.float() - mean[None, :, None, :] if mean is not None else x.float()
            xr = naive.rotate(_to_rows(xf), rot)
            if self.clip and ratio is not None and bool((ratio < 1).any()):
                xr = naive.clip_rows(xr, ratio)
            if self.books is None:  # fitting: histogram of the normalised rows, uniform meanwhile
                lo = xr.amin(-1, keepdim=True)
                u = (xr - lo) / (xr.amax(-1, keepdim=True) - lo).clamp(min=1e-12)
                bins = (u.clamp(0, 1 - 1e-7) * BINS).long()  # [N, H, d]
                h = torch.zeros(xr.shape[1], BINS, dtype=torch.float64, device=xr.device)
                h.scatter_add_(1, bins.transpose(0, 1).reshape(xr.shape[1], -1),
                               torch.ones_like(bins, dtype=torch.float64).transpose(0, 1).reshape(xr.shape[1], -1))
                self.hist[(layer, side)] = self.hist.get((layer, side), 0) + h.cpu()
                book = None
            else:
                book = self.books.get((layer, side)) if side in self.sides else None
            xq = codebook_quantize(xr, book, self.fmt.scale_format)
            out = xq @ rot.transpose(-1, -2) if rot.dim() == 2 else torch.einsum("the,hde->thd", xq, rot)
            out = _from_rows(out, b, t)
            return out + mean[None, :, None, :] if mean is not None else out

        def fake_quantize(self, layer_idx, keys, values, windows):
            if layer_idx not in self.tables:
                return keys.float(), values.float()
            t = self.tables[layer_idx].to(keys.device)
            return (self._side(layer_idx, "k", keys, t.k_rotation, t.k_clip, t.k_mean),
                    self._side(layer_idx, "v", values, t.v_rotation, t.v_clip, t.v_mean))

        def _per_head(self) -> dict[tuple[int, str], torch.Tensor]:
            """(layer, side) -> levels `[H_kv, 4]` fitted on the histograms gathered so far."""
            return {key: torch.stack([lloyd_max(row) for row in h]) for key, h in self.hist.items()}

    tok, model, device, dtype = load_fixture(args.model)
    cal = make_windows(tok, read_documents(args.model / "calib.txt"), args.context)
    ids = torch.cat([cal.long, cal.packed])[:args.calib_samples]
    art, _ = calibrate_model_with_report(model, ids.to(device), SolverSettings(), compare_alternatives=False)
    held = make_windows(tok, read_documents(args.model / "heldout.txt"), args.context, args.max_windows)
    held = torch.cat([held.long, held.packed])

    fmt = art.kv_format.per_token()  # the artifact's windows, a per-token history
    bf16, _ = method_nll(model, KVMethod(), held, fmt, args.batch_size, collect_stats=False)
    ref = bf16.double().mean(1)
    rows = []
    variants = [("uniform, fitted clips (default)", None),
                ("codebook V, fitted clips", (True, ("v",))), ("codebook V, no clip", (False, ("v",))),
                ("codebook K+V, fitted clips", (True, ("k", "v"))), ("codebook K+V, no clip", (False, ("k", "v")))]
    base_win = None
    for name, spec in variants:
        if spec is None:
            m = ArtifactInt2(name, artifact=art)
            books = None
        else:
            m = CodebookInt2(name, art, *spec)
            t0 = time.perf_counter()
            method_nll(model, m, ids, fmt, args.batch_size, collect_stats=False)  # fit on the calibration windows
            books = m._per_head()
            m.books = books
            log(f"fitted {name} codebooks in {time.perf_counter() - t0:.1f}s")
        nll, _ = method_nll(model, m, held, fmt, args.batch_size, collect_stats=False)
        win = nll.double().mean(1)
        base_win = win if base_win is None else base_win
        row = {"name": name, "ppl": float(torch.exp(nll.double().mean())),
               "ppl_delta_pct": 100 * float(torch.expm1(win.mean() - ref.mean())),
               "ci95": list(bootstrap_delta_ci(win, ref)),
               "vs_default_pct": 100 * float(torch.expm1(win.mean() - base_win.mean())),
               "vs_default_ci95": list(bootstrap_delta_ci(win, base_win)) if spec is not None else None}
        if books:
            allb = torch.cat([b for (layer, side), b in books.items() if side in m.sides])
            row["levels_mean"] = allb.mean(0).tolist()
        rows.append(row)
        log(f"{name}: {row['ppl_delta_pct']:+.2f}% vs BF16, {row['vs_default_pct']:+.2f}% vs default")
    out = {"model": str(args.model), "context": args.context, "windows": int(held.shape[0]),
           "bf16_ppl": float(torch.exp(bf16.double().mean())), "rows": rows,
           "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"codebook_{args.model.name}_{args.context}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
