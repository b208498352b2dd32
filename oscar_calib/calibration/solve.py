"""From second-moment targets to rotations `R = U H P` (OSCAR_METHOD section 3).

All matrices are row-vector convention: `x_rot = x @ R`. Targets are `[..., d, d]` symmetric PSD.
"""

from __future__ import annotations

import torch

from runtime_kernels.artifact import ORTHOGONALITY_TOL, orthogonality_error


def hadamard(d: int) -> torch.Tensor:
    """Normalised Sylvester Hadamard `[d, d]` float64: `H[a, b] = (-1)^popcount(a & b) / sqrt(d)`."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for the Hadamard transform, got {d}")
    idx = torch.arange(d)
    bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1.0 - 2.0 * parity.double()) / d**0.5


def bit_reverse(i: int, nbits: int) -> int:
    """Reverse the lowest `nbits` bits of `i`."""
    out = 0
    for _ in range(nbits):
        out = (out << 1) | (i & 1)
        i >>= 1
    return out


def bit_reversal_indices(d: int) -> torch.Tensor:
    """`[bitrev(j) for j in range(d)]` for a power-of-two `d`, int64."""
    nbits = d.bit_length() - 1
    return torch.tensor([bit_reverse(j, nbits) for j in range(d)], dtype=torch.int64)


def bit_reversal_permutation(eigenvalues: torch.Tensor) -> torch.Tensor:
    """`perm[bitrev(i)] = s[i]` with `s = argsort(eigenvalues, descending)`; `[..., d]` int64 (batched).

    bitrev is an involution, so `perm[j] = s[bitrev(j)]`. With eigh's ascending order and distinct
    eigenvalues this is `perm[j] = d - 1 - bitrev(j)`.
    """
    d = eigenvalues.shape[-1]
    order = torch.sort(eigenvalues, dim=-1, descending=True, stable=True).indices
    return order[..., bit_reversal_indices(d)]


def canonical_signs(vectors: torch.Tensor) -> torch.Tensor:
    """Flip each column so that its largest-magnitude entry (first one on ties) is positive."""
    idx = vectors.abs().argmax(dim=-2, keepdim=True)
    signs = torch.sign(torch.gather(vectors, -2, idx))
    signs[signs == 0] = 1
    return vectors * signs


def rotations_from_targets(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`R = U H P` for a stack of symmetric targets `[..., d, d]` (one batched fp64 eigh).

    Returns:
        R `[..., d, d]` float64 orthogonal, eigenvalues `[..., d]` float64 descending.
    """
    t = targets.double()
    t = 0.5 * (t + t.transpose(-1, -2))  # symmetrise: accumulation order leaves tiny asymmetries
    evals, evecs = torch.linalg.eigh(t)  # ascending
    evecs = canonical_signs(evecs)
    d = t.shape[-1]
    perm = bit_reversal_permutation(evals)  # [..., d]
    u_h = evecs @ hadamard(d)
    rotation = torch.gather(u_h, -1, perm.unsqueeze(-2).expand_as(u_h))  # columns reordered: (U H)[:, perm]
    return rotation, torch.sort(evals, dim=-1, descending=True).values


def rotation_from_target(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`R = U H P` for one target `[d, d]`; see `rotations_from_targets`."""
    r, ev = rotations_from_targets(target[None])
    return r[0], ev[0]


def solve_rotations(targets: torch.Tensor, granularity: str = "head") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotations for a stack of targets.

    Args:
        targets: `[A, H, d, d]` per (layer, KV head), each normalised by its token count.
        granularity: "head" (one R per KV head) or "layer" (mean of the head targets, shared by all heads).
    Returns:
        rotations `[A, H, d, d]` float32, eigenvalues `[A, H, d]` float32 (descending).
    Raises:
        ValueError if a rotation is not orthogonal to `ORTHOGONALITY_TOL` in fp32.
    """
    a, h, d, _ = targets.shape
    if granularity not in ("head", "layer"):
        raise ValueError(f"granularity must be 'head' or 'layer', got '{granularity}'")
    if granularity == "layer":
        rot, ev = rotations_from_targets(targets.double().mean(dim=1))
        rotations, eigenvalues = rot[:, None].expand(a, h, d, d), ev[:, None].expand(a, h, d)
    else:
        rotations, eigenvalues = rotations_from_targets(targets)
    rot32 = rotations.float().contiguous()
    err = orthogonality_error(rot32)
    if err > ORTHOGONALITY_TOL:
        raise ValueError(f"solver produced a non-orthogonal rotation (max |R R^T - I| = {err:.2e})")
    return rot32, eigenvalues.float().contiguous()


def target_from_rotation(rotation: torch.Tensor, eigenvalues: torch.Tensor) -> torch.Tensor:
    """The symmetric target `U diag(eigenvalues) U^T` whose `rotations_from_targets` gave `rotation` (its inverse).

    An artifact stores `R = (U H)[:, perm]` and the spectrum (descending), not the target; this rebuilds it, e.g. to
    blend an artifact's key target with another. `perm[j] = s[bitrev(j)]` with `s` the descending order of eigh's
    ascending eigenvalues, i.e. `s[i] = d - 1 - i` (distinct eigenvalues), so column `perm[j]` of `U H` is `R[:, j]`
    and the eigenvector of the i-th largest eigenvalue is column `d - 1 - i` of `U = (U H) H`.

    Args:
        rotation: `[..., d, d]`; eigenvalues `[..., d]` descending (as `rotations_from_targets` and the artifact's
            `k_eigenvalues` give them).
    Returns:
        `[..., d, d]` float64 symmetric.
    """
    r = rotation.double()
    d = r.shape[-1]
    perm = (d - 1 - bit_reversal_indices(d)).to(r.device)
    u_h = torch.empty_like(r)
    u_h[..., perm] = r  # column perm[j] of U H is column j of R
    u = u_h @ hadamard(d).to(r.device)  # H is symmetric and orthogonal: (U H) H = U
    ascending = eigenvalues.double().flip(-1)  # column d - 1 - i of U belongs to the i-th largest eigenvalue
    return (u * ascending[..., None, :]) @ u.transpose(-1, -2)
