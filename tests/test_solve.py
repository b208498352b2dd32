"""Solver: Hadamard, bit-reversal permutation, R = U H P, canonical signs, orthogonality."""

import itertools

import pytest
import torch

from oscar_calib.calibration.solve import (
    bit_reversal_permutation,
    canonical_signs,
    hadamard,
    rotation_from_target,
    rotations_from_targets,
    solve_rotations,
    target_from_rotation,
)


def test_bit_reversal_first_entries_d128():
    # eigh order is ascending, so eigenvalue index == rank from the bottom.
    perm = bit_reversal_permutation(torch.arange(128, dtype=torch.float64))
    assert perm[:8].tolist() == [127, 63, 95, 31, 111, 47, 79, 15]


@pytest.mark.parametrize("d", [4, 64, 128, 256])
def test_bit_reversal_matches_closed_form(d):
    nbits = d.bit_length() - 1
    rev = lambda j: int(format(j, f"0{nbits}b")[::-1], 2)  # noqa: E731 - independent string-based bitrev
    perm = bit_reversal_permutation(torch.arange(d, dtype=torch.float64))
    assert perm.tolist() == [d - 1 - rev(j) for j in range(d)]
    assert sorted(perm.tolist()) == list(range(d))


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128])
def test_hadamard_entries_and_orthogonality(d):
    h = hadamard(d)
    for a, b in itertools.product(range(d), repeat=2):
        if a < 8 and b < 8:
            assert h[a, b] == pytest.approx((-1) ** bin(a & b).count("1") / d**0.5)
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12)


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        hadamard(96)


def _random_spd(d, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    return a @ a.T + 0.1 * torch.eye(d, dtype=torch.float64)


def test_rotation_is_u_h_p_and_orthogonal():
    d = 64
    t = _random_spd(d, 0)
    r, ev = rotation_from_target(t)
    assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-10)
    ref_ev, _ = torch.linalg.eigh(t)
    assert torch.allclose(ev, ref_ev.flip(0), atol=1e-8)
    # Undo H and P: R P^T H^T must be an eigenbasis of t (columns = eigenvectors, ascending).
    perm = bit_reversal_permutation(ref_ev)
    u_h = torch.empty_like(r)
    u_h[:, perm] = r
    u = u_h @ hadamard(d).T
    assert torch.allclose(u.T @ t @ u, torch.diag(ref_ev), atol=1e-8)


def test_canonical_signs_make_rotation_sign_invariant():
    t = _random_spd(32, 1)
    v = torch.linalg.eigh(t).eigenvectors
    c1, c2 = canonical_signs(v), canonical_signs(-v)
    assert torch.equal(c1, c2)
    assert (c1.gather(0, c1.abs().argmax(0, keepdim=True)) > 0).all()


def test_solve_rotations_same_input_same_bytes():
    targets = torch.stack([torch.stack([_random_spd(16, s) for s in range(3)]) for _ in range(2)])
    r1, e1 = solve_rotations(targets, "head")
    r2, e2 = solve_rotations(targets.clone(), "head")
    assert r1.numpy().tobytes() == r2.numpy().tobytes()
    assert e1.numpy().tobytes() == e2.numpy().tobytes()
    assert r1.dtype == torch.float32 and r1.shape == (2, 3, 16, 16)
    err = (r1 @ r1.transpose(-1, -2) - torch.eye(16)).abs().max()
    assert err < 1e-5


def test_layer_granularity_uses_mean_target_for_all_heads():
    targets = torch.stack([_random_spd(16, s) for s in range(4)])[None]
    r, ev = solve_rotations(targets, "layer")
    ref, ref_ev = rotation_from_target(targets[0].mean(0))
    for h in range(4):
        assert torch.allclose(r[0, h].double(), ref, atol=1e-6)
        assert torch.allclose(ev[0, h].double(), ref_ev, atol=1e-4)


def test_bad_granularity():
    with pytest.raises(ValueError, match="granularity"):
        solve_rotations(torch.eye(4)[None, None], "token")


@pytest.mark.parametrize("d", [8, 64])
def test_target_from_rotation_inverts_rotations_from_targets(d):
    targets = torch.stack([torch.stack([_random_spd(d, 10 * a + h) for h in range(3)]) for a in range(2)])
    r, ev = rotations_from_targets(targets)  # [2, 3, d, d], [2, 3, d]
    back = target_from_rotation(r, ev)
    torch.testing.assert_close(back, targets, rtol=1e-9, atol=1e-9 * float(targets.abs().max()))
    # as an artifact stores them (float32): the target to float32 precision, and its rotation again
    back32 = target_from_rotation(r.float(), ev.float())
    torch.testing.assert_close(back32, targets, rtol=1e-4, atol=1e-5 * float(targets.abs().max()))
    assert float((rotations_from_targets(back32)[0] - r).abs().max()) < 1e-3
