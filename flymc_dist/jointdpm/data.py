"""The sublinear-MH paper's JointDPM data: four rotated 2-D blobs."""

from __future__ import annotations

import numpy as np

from flymc_dist.rng import stream

__all__ = ["four_blobs"]


def four_blobs(n: int, seed: int = 0, *, spread: float = 0.15) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of four blobs around the origin, one in each diagonal direction ``u_j``:
    in blob ``j`` the positives are centred at radius 1.5 along ``u_j`` and the negatives
    at radius 1.8, each with sd ``spread`` — so each blob's classes are split by a line
    across ``u_j`` (four rotations of one expert), and no single line splits them all.

    Returns
    -------
    X, y
        ``(n, 2)`` points and their 0/1 labels (blob and class each uniformly at random).
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"n must be a positive integer, not {n!r}")
    rng = stream(seed, 7, 1)
    blob = rng.integers(0, 4, n)
    y = rng.integers(0, 2, n)
    angle = np.pi / 4 + blob * np.pi / 2
    radius = np.where(y == 1, 1.5, 1.8)
    centre = radius[:, None] * np.column_stack([np.cos(angle), np.sin(angle)])
    X = centre + spread * rng.standard_normal((n, 2))
    return X, y.astype(float)
