"""Eager decode calls of the shipped layout (recipe: ue5m3, centered, 128/1024) for Nsight Compute:

    ncu --set basic --metrics ... python3 bench/ncu_decode.py CONTEXT BATCH [FIELD=INT,...]

The optional third argument sets `DecodeOptions` fields, as `bench_decode_graph.py --options` does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from runtime_kernels import attention as A  # noqa: E402

context, batch = int(sys.argv[1]), int(sys.argv[2])
fields = dict(kv.split("=") for kv in sys.argv[3].split(",")) if len(sys.argv) > 3 else {}
options = A.DecodeOptions(**{k: int(v) for k, v in fields.items()})
a = common.decode_inputs(batch, context, seed=1, scale_format="ue5m3", window=1152)
rec = common.decode_records(a, common.decode_means(2), scale_format="ue5m3")
for _ in range(3):
    A.decode_attention(*rec, validate=False, fused=False, options=options)
torch.cuda.synchronize()
