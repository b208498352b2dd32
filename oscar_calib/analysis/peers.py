"""The strongest simple peer of an OSCAR artifact for `eval`: Hadamard + global clip + centering.

Centering is free for any rotation (the runtime adds the means back exactly), so a fair table centers the peer too:
the same per-(layer, KV head) means as the OSCAR artifact (calibrated on its data, or on `eval`'s calibration
windows when it calibrates on the fly), a normalised Hadamard rotation for every head, the global clip ratios
K 0.96 / V 0.92 of the uncentered `hadamard-clip` row, and the artifact's own quantizer, scales and windows. Only
the rotation and the clips differ from OSCAR, which is what the comparison is about.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from oscar_calib.analysis.methods import ArtifactInt2, hadamard
from runtime_kernels.artifact import OscarArtifact

NAME = "hadamard-clip-centered"
K_CLIP, V_CLIP = 0.96, 0.92


def centered_hadamard_clip(artifact: OscarArtifact) -> OscarArtifact:
    """An artifact like `artifact` with Hadamard rotations `[A, H, d, d]` and global clips, keeping its means (stored
    in the original basis, so they do not depend on the rotation) and everything else; validated."""
    a, h, d = artifact.num_layers, artifact.num_kv_heads, artifact.head_dim
    had = hadamard(d).float().expand(a, h, d, d).contiguous()
    kw = {f.name: getattr(artifact, f.name) for f in fields(OscarArtifact)}
    kw.update(k_rotation=had, v_rotation=had.clone(),
              k_clip_ratio=torch.full((a, h), K_CLIP), v_clip_ratio=torch.full((a, h), V_CLIP),
              k_mean=artifact.key_mean("original").clone(), v_mean=artifact.value_mean("original").clone(),
              metadata={**artifact.metadata, "mean_basis": "original", "granularity": "head"},
              source=f"{artifact.source} (Hadamard + clip peer)")
    return replace(OscarArtifact(**kw)).validate()


def centered_peer(artifacts: dict[str, OscarArtifact]) -> list[ArtifactInt2]:
    """The centered Hadamard + clip row for the first artifact with non-zero means (none when nothing is centered)."""
    for art in artifacts.values():
        if bool(art.key_mean("original").abs().sum() > 0) or bool(art.value_mean("original").abs().sum() > 0):
            return [ArtifactInt2(NAME, f"Hadamard rotation, global clip K {K_CLIP} / V {V_CLIP}, centered with the "
                                       "artifact's means, its quantizer", artifact=centered_hadamard_clip(art))]
    return []
