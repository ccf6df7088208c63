"""JointDPM's split–merge move: a Metropolis–Hastings proposal that splits one cluster in
two or merges two into one, so that the number of clusters moves by more than the
single-row Gibbs step's one row at a time.

The move (Dahl's sequentially allocated merge–split, with the non-conjugate weights
proposed from Laplace approximations):

1. Choose what to propose, one of two ways with probability ½ each. *By rows*: two
   distinct rows ``i, j`` drawn uniformly (ordered): a split of their cluster if they
   share one, else a merge of their two (good at splitting large clusters). *By
   clusters*: a split or a merge with probability ½; a split picks one of the ``K``
   clusters and an ordered pair ``i, j`` of its members, a merge an ordered pair of
   clusters and a member of each (good at merging small clusters, which rows drawn
   uniformly seldom hit). Each way is reversible on its own; the second's ratio carries
   the choice's probabilities, ``n_C (n_C − 1) / ((K_m + 1) n_A n_B)`` for a split of
   ``C`` into ``A, B`` (``K_m`` the clusters of the merged state).
2. A split of ``C``: ``A ∋ i``, ``B ∋ j``, the other members of ``C`` allocated one at a
   time in a random order, each to ``A`` or ``B`` with probability ``∝ n · t(x)`` (the
   side's current size and Student-t predictive of its members so far,
   :func:`allocate`); weights ``w_A``, ``w_B`` drawn from the Laplace approximations of
   each side's logistic posterior (:func:`laplace`). A merge of ``A ∋ i`` and ``B ∋ j``
   into ``C``: weights ``w_C`` drawn from ``C``'s Laplace approximation.
3. Accept with the MH ratio of the joint ``p(z, w | α)`` (CRP, NIW marginals, logistic
   likelihoods, weight priors), times the reverse proposal's density over the forward
   one's: for a split, ``q(w_C | C) / (q_alloc(A, B) q(w_A | A) q(w_B | B))``, where
   ``q_alloc`` is the probability of the allocation drawn; a merge's ratio is the
   inverse of the split that would undo it (its allocation probability computed for the
   clusters as they are, :func:`allocate` with ``forced`` sides).

The order of allocation is drawn independently of the state and the Laplace
approximations are deterministic functions of their rows, so the move is reversible
with respect to the posterior whatever the quality of either (a poor one is rejected
more often, never wrong). It reads every member of the one or two clusters concerned:
O(N_k) rows, not sublinear like the weights' tests.

Every sum here runs over rows in row order in plain loops (compiled): the same bits
whatever the layout of the shards the rows came from.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from flymc_dist._compiled import JIT
from flymc_dist.jointdpm.niw import add_point, log_t, predictive_head

__all__ = [
    "LAPLACE_REFINE",
    "LAPLACE_STEPS",
    "LAPLACE_SUBSET",
    "allocate",
    "gaussian_draw",
    "gaussian_logpdf",
    "laplace",
    "sums",
]

#: Newton steps from ``w = 0`` of each Laplace approximation (a fixed number: the
#: approximation is a function of its rows alone)
LAPLACE_STEPS = 8
#: above twice this many rows, those steps run on a regular subset of about this many
#: rows, then :data:`LAPLACE_REFINE` steps on all of them
LAPLACE_SUBSET = 4096
LAPLACE_REFINE = 2


@numba.njit(inline="always", **JIT)
def _add(x: np.ndarray, m: np.ndarray, L: np.ndarray, kv: np.ndarray, tmp: np.ndarray) -> None:
    """Add point ``x`` to NIW posterior ``(kv[0], kv[1], m, L)`` (:func:`add_point`)."""
    add_point(x, m, L, kv[0], tmp)
    kv[0] += 1.0
    kv[1] += 1.0


@numba.njit(**JIT)
def allocate(
    X: np.ndarray,
    x_i: np.ndarray,
    x_j: np.ndarray,
    m0: np.ndarray,
    k0: float,
    v0: float,
    L0: np.ndarray,
    u: np.ndarray,
    forced: np.ndarray,
    side: np.ndarray,
) -> float:
    """The sequential allocation of a split: rows ``X`` (in the order drawn) each to side
    0 (with ``x_i``) or 1 (with ``x_j``), with probability ``∝ n_s · t_s(x)`` — the side's
    size and the Student-t predictive of its points so far under the NIW prior ``(m0,
    k0, v0, L0 L0ᵀ)``.

    Parameters
    ----------
    X
        The rows to allocate ``(n, D)``, in order.
    x_i, x_j
        The two sides' first points.
    m0, k0, v0, L0
        The NIW prior (``L0`` the Cholesky factor of ``S0``).
    u
        A uniform per row: row ``r`` goes to side 0 if ``u[r] < P(side 0)``.
    forced
        Per row -1 (drawn with ``u``) or the side it must take (the probability of an
        allocation already made: a merge's reverse).
    side
        Out: each row's side.

    Returns
    -------
    float
        The log probability of the allocation.
    """
    D = x_i.size
    m = np.empty((2, D))
    L = np.empty((2, D, D))
    kv = np.empty((2, 2))
    tmp = np.empty(D)
    for s in range(2):
        m[s] = m0
        L[s] = L0
        kv[s, 0] = k0
        kv[s, 1] = v0
    _add(x_i, m[0], L[0], kv[0], tmp)
    _add(x_j, m[1], L[1], kv[1], tmp)
    head = np.empty(2)  # each side's predictive_head, recomputed when it takes a point
    for s in range(2):
        head[s] = predictive_head(L[s], kv[s, 0], kv[s, 1])
    n0, n1 = 1.0, 1.0
    log_q = 0.0
    for r in range(X.shape[0]):
        x = X[r]
        l0 = math.log(n0) + log_t(x, m[0], L[0], kv[0, 0], kv[0, 1], head[0], tmp)
        l1 = math.log(n1) + log_t(x, m[1], L[1], kv[1, 0], kv[1, 1], head[1], tmp)
        # log P(side 0) and log P(side 1), stably
        hi = max(l0, l1)
        lz = hi + math.log(math.exp(l0 - hi) + math.exp(l1 - hi))
        lp0, lp1 = l0 - lz, l1 - lz
        s = forced[r]
        if s < 0:
            s = 0 if u[r] < math.exp(lp0) else 1
        side[r] = s
        log_q += lp0 if s == 0 else lp1
        _add(x, m[s], L[s], kv[s], tmp)
        head[s] = predictive_head(L[s], kv[s, 0], kv[s, 1])
        if s == 0:
            n0 += 1.0
        else:
            n1 += 1.0
    return log_q


@numba.njit(**JIT)
def sums(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(Σx, Σxxᵀ)`` of rows ``X``, summed in row order."""
    n, D = X.shape
    sx = np.zeros(D)
    sxx = np.zeros((D, D))
    for r in range(n):
        for a in range(D):
            sx[a] += X[r, a]
            for b in range(D):
                sxx[a, b] += X[r, a] * X[r, b]
    return sx, sxx


@numba.njit(inline="always", **JIT)
def _cholesky(H: np.ndarray, R: np.ndarray) -> None:
    """``R`` (lower) with ``R Rᵀ = H``."""
    P = H.shape[0]
    for a in range(P):
        for b in range(a + 1):
            s = H[a, b]
            for c in range(b):
                s -= R[a, c] * R[b, c]
            if a == b:
                R[a, a] = math.sqrt(s)
            else:
                R[a, b] = s / R[b, b]
        for b in range(a + 1, P):
            R[a, b] = 0.0


@numba.njit(inline="always", **JIT)
def _curvature(
    F: np.ndarray, y: np.ndarray, prec: float, w: np.ndarray, stride: int, weight: float,
    g: np.ndarray, H: np.ndarray,
) -> None:  # fmt: skip
    """The gradient ``g`` and negative Hessian ``H`` at ``w`` of the log posterior whose
    likelihood is rows ``0, stride, 2·stride, …`` of ``F``, each counted ``weight`` times."""
    n, P = F.shape
    for a in range(P):
        g[a] = -prec * w[a]
        for b in range(P):
            H[a, b] = prec if a == b else 0.0
    for r in range(0, n, stride):
        eta = 0.0
        for a in range(P):
            eta += F[r, a] * w[a]
        p = 1.0 / (1.0 + math.exp(-eta))
        c = weight * p * (1.0 - p)
        e = weight * (y[r] - p)
        for a in range(P):
            g[a] += e * F[r, a]
            for b in range(a + 1):
                H[a, b] += c * F[r, a] * F[r, b]
    for a in range(P):
        for b in range(a + 1, P):
            H[a, b] = H[b, a]


@numba.njit(inline="always", **JIT)
def _newton_step(w: np.ndarray, g: np.ndarray, R: np.ndarray, tmp: np.ndarray) -> None:
    """``w += H⁻¹ g`` with ``H = R Rᵀ``: ``R t = g``, then ``Rᵀ d = t``."""
    P = w.size
    for a in range(P):
        s = g[a]
        for b in range(a):
            s -= R[a, b] * tmp[b]
        tmp[a] = s / R[a, a]
    for a in range(P - 1, -1, -1):
        s = tmp[a]
        for b in range(a + 1, P):
            s -= R[b, a] * tmp[b]
        tmp[a] = s / R[a, a]
    for a in range(P):
        w[a] += tmp[a]


@numba.njit(**JIT)
def laplace(F: np.ndarray, y: np.ndarray, sd: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The Laplace approximation of the logistic posterior ``N(0, sd²I) Π σ(±wᵀf)`` of
    rows ``F`` (with their bias) and labels ``y``: ``steps`` Newton steps from 0, then
    the curvature there. Above ``2·LAPLACE_SUBSET`` rows the ``steps`` run on every
    ``n // LAPLACE_SUBSET``-th row (each counted that many times) and ``LAPLACE_REFINE``
    steps on all rows finish (Newton converges in a few steps from there): a few passes
    over the rows, not ``steps``. Returns the mean and the lower Cholesky factor ``R`` of
    the precision (``H = R Rᵀ``)."""
    n, P = F.shape
    w = np.zeros(P)
    H = np.empty((P, P))
    R = np.empty((P, P))
    g = np.empty(P)
    tmp = np.empty(P)
    prec = 1.0 / (sd * sd)
    full = steps
    if n > 2 * LAPLACE_SUBSET:
        stride = n // LAPLACE_SUBSET
        for _ in range(steps):
            _curvature(F, y, prec, w, stride, float(stride), g, H)
            _cholesky(H, R)
            _newton_step(w, g, R, tmp)
        full = LAPLACE_REFINE
    for it in range(full + 1):
        _curvature(F, y, prec, w, 1, 1.0, g, H)
        _cholesky(H, R)
        if it == full:
            break
        _newton_step(w, g, R, tmp)
    return w, R


def gaussian_logpdf(w: np.ndarray, mean: np.ndarray, R: np.ndarray) -> float:
    """``log N(w; mean, (R Rᵀ)⁻¹)``: a Laplace approximation's density (``R`` the lower
    Cholesky factor of the precision)."""
    d = R.T @ (np.asarray(w, float) - mean)
    P = mean.size
    return float(
        -0.5 * P * math.log(2.0 * math.pi) + np.sum(np.log(np.diag(R))) - 0.5 * float(d @ d)
    )


def gaussian_draw(rng: np.random.Generator, mean: np.ndarray, R: np.ndarray) -> np.ndarray:
    """A draw from ``N(mean, (R Rᵀ)⁻¹)``: ``mean + R⁻ᵀ ε``."""
    eps = rng.standard_normal(mean.size)
    return mean + np.linalg.solve(R.T, eps)
