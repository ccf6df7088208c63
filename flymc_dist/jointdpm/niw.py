"""The collapsed Normal-inverse-Wishart part of JointDPM: per-cluster posterior
statistics kept as a Cholesky factor, updated by rank-one up/downdates, and the
Student-t predictive and marginal likelihood they give.

Prior: ``Σ ~ IW(S0, v0)``, ``μ | Σ ~ N(m0, Σ / k0)``. After ``n`` points the posterior is
NIW with ``k_n = k0 + n``, ``v_n = v0 + n``, ``m_n = (k0 m0 + Σx) / k_n`` and
``S_n = S0 + Σ x xᵀ + k0 m0 m0ᵀ − k_n m_n m_nᵀ``. Adding a point ``x`` to ``(k, m, S)``
gives ``k + 1``, ``(k m + x)/(k + 1)`` and ``S + k/(k + 1) (x − m)(x − m)ᵀ`` — a rank-one
update of the Cholesky factor of ``S``; removing one is the matching downdate. The
predictive of a new point is multivariate Student-t with ``ν = v_n − D + 1`` degrees of
freedom, location ``m_n`` and shape ``S_n (k_n + 1) / (k_n ν)``.

The updates and the predictive are compiled loops (:func:`add_point`, :func:`remove_point`,
:func:`predictive_head`, :func:`log_t`, :func:`scaled_inverse`), shared by the Gibbs step
(:class:`ClusterStats`) and the split–merge move (:mod:`flymc_dist.jointdpm.splitmerge`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np
from scipy.special import multigammaln

from flymc_dist._compiled import JIT

__all__ = [
    "ClusterStats",
    "NIWPrior",
    "add_point",
    "log_marginal",
    "log_t",
    "predictive_head",
    "remove_point",
    "scaled_inverse",
]


class NIWPrior(NamedTuple):
    """The Normal-inverse-Wishart prior ``(m0, k0, v0, S0)``."""

    m0: np.ndarray
    k0: float
    v0: float
    S0: np.ndarray

    @classmethod
    def paper(cls, dim: int, k0: float = 5.0, extra_df: float = 5.0) -> NIWPrior:
        """The sublinear-MH paper's prior: ``m0 = 0``, ``k0``, ``v0 = D + extra_df``,
        ``S0 = v0·I``."""
        v0 = dim + extra_df
        return cls(np.zeros(dim), float(k0), float(v0), v0 * np.eye(dim))


@numba.njit(**JIT)
def add_point(x: np.ndarray, m: np.ndarray, L: np.ndarray, k: float, tmp: np.ndarray) -> None:
    """In place: NIW posterior ``(k, m, L Lᵀ)`` takes point ``x`` — ``m`` moves to ``(k m
    + x)/(k + 1)`` and ``L`` becomes the Cholesky factor of ``L Lᵀ + k/(k + 1) (x − m)(x
    − m)ᵀ`` (a rank-one update, lower); the caller adds 1 to ``k`` and ``v``. ``tmp``: ``D``
    values of scratch."""
    D = x.size
    f = math.sqrt(k / (k + 1.0))
    for a in range(D):
        d = x[a] - m[a]
        tmp[a] = d * f
        m[a] += d / (k + 1.0)
    for a in range(D):
        r = math.hypot(L[a, a], tmp[a])
        c = r / L[a, a]
        s = tmp[a] / L[a, a]
        L[a, a] = r
        for b in range(a + 1, D):
            L[b, a] = (L[b, a] + s * tmp[b]) / c
            tmp[b] = c * tmp[b] - s * L[b, a]


@numba.njit(**JIT)
def remove_point(x: np.ndarray, m: np.ndarray, L: np.ndarray, k: float, tmp: np.ndarray) -> bool:
    """In place: the inverse of :func:`add_point` (``k`` the count before, the caller
    takes 1 from ``k`` and ``v``) — ``m`` back to ``(k m − x)/(k − 1)``, ``L`` downdated
    by ``√((k − 1)/k) (x − m)``. False (``L`` then part-changed) if the result is not
    positive definite."""
    D = x.size
    k2 = k - 1.0
    f = math.sqrt(k2 / k)
    for a in range(D):
        m[a] = (k * m[a] - x[a]) / k2
        tmp[a] = (x[a] - m[a]) * f
    for a in range(D):
        d = L[a, a] * L[a, a] - tmp[a] * tmp[a]
        if not d > 0.0:
            return False
        r = math.sqrt(d)
        c = r / L[a, a]
        s = tmp[a] / L[a, a]
        L[a, a] = r
        for b in range(a + 1, D):
            L[b, a] = (L[b, a] - s * tmp[b]) / c
            tmp[b] = c * tmp[b] - s * L[b, a]
    return True


@numba.njit(**JIT)
def predictive_head(L: np.ndarray, k: float, v: float) -> float:
    """The part of the Student-t log predictive under NIW posterior ``(k, v, ·, L Lᵀ)``
    that does not depend on the point: ``log Γ((ν + D)/2) − log Γ(ν/2) − D/2 log(νπ) −
    ½ log det(shape)``, ``ν = v − D + 1``, shape ``L Lᵀ (k + 1)/(k ν)``."""
    D = L.shape[0]
    nu = v - D + 1.0
    c = (k + 1.0) / (k * nu)
    logdiag = 0.0
    for a in range(D):
        logdiag += math.log(L[a, a])
    return (
        math.lgamma(0.5 * (nu + D))
        - math.lgamma(0.5 * nu)
        - 0.5 * D * math.log(nu * math.pi)
        - 0.5 * (D * math.log(c) + 2.0 * logdiag)
    )


@numba.njit(**JIT)
def log_t(
    x: np.ndarray, m: np.ndarray, L: np.ndarray, k: float, v: float, head: float,
    tmp: np.ndarray,
) -> float:  # fmt: skip
    """The Student-t log predictive of ``x`` under NIW posterior ``(k, v, m, L Lᵀ)``,
    whose :func:`predictive_head` is ``head`` (``tmp``: ``D`` values of scratch)."""
    D = x.size
    nu = v - D + 1.0
    c = (k + 1.0) / (k * nu)
    maha = 0.0
    for a in range(D):
        s = x[a] - m[a]
        for b in range(a):
            s -= L[a, b] * tmp[b]
        tmp[a] = s / L[a, a]
        maha += tmp[a] * tmp[a]
    return head - 0.5 * (nu + D) * math.log1p(maha / c / nu)


@numba.njit(**JIT)
def scaled_inverse(L: np.ndarray, k: float, v: float, A: np.ndarray) -> None:
    """``A = L⁻¹ / √c`` (lower triangular, by forward substitution; ``c = (k + 1)/(k ν)``):
    ``‖A (x − m)‖²`` is the Student-t predictive's Mahalanobis term."""
    D = L.shape[0]
    nu = v - D + 1.0
    scale = 1.0 / math.sqrt((k + 1.0) / (k * nu))
    for j in range(D):
        for i in range(D):
            A[i, j] = 0.0
        for i in range(j, D):
            s = 1.0 if i == j else 0.0
            for b in range(j, i):
                s -= L[i, b] * A[b, j]
            A[i, j] = s / L[i, i]
    for i in range(D):
        for j in range(i + 1):
            A[i, j] *= scale


class ClusterStats:
    """One cluster's NIW posterior ``(n, k_n, v_n, m_n, chol S_n)``, updated point by point.

    Parameters
    ----------
    prior
        The NIW prior (an empty cluster's statistics).
    """

    __slots__ = ("D", "L", "_terms", "k", "m", "n", "prior", "v")

    def __init__(self, prior: NIWPrior) -> None:
        self.prior = prior
        self.D = int(prior.m0.size)
        self.n = 0
        self.k = float(prior.k0)
        self.v = float(prior.v0)
        self.m = np.array(prior.m0, dtype=float)
        self.L = np.linalg.cholesky(np.asarray(prior.S0, float))
        self._terms: tuple | None = None

    @classmethod
    def from_sums(cls, prior: NIWPrior, n: int, sx: np.ndarray, sxx: np.ndarray) -> ClusterStats:
        """The statistics of ``n`` points with sum ``sx`` and sum of outer products ``sxx``
        (one Cholesky factorisation)."""
        out = cls(prior)
        if n == 0:
            return out
        k = prior.k0 + n
        m = (prior.k0 * prior.m0 + sx) / k
        S = prior.S0 + sxx + prior.k0 * np.outer(prior.m0, prior.m0) - k * np.outer(m, m)
        out.n, out.k, out.v, out.m = int(n), float(k), float(prior.v0 + n), m
        out.L = np.linalg.cholesky(0.5 * (S + S.T))
        out._terms = None
        return out

    def add(self, x: np.ndarray) -> None:
        """Add one point: a rank-one update (:func:`add_point`)."""
        add_point(np.asarray(x, float), self.m, self.L, self.k, np.empty(self.D))
        self.k += 1.0
        self.v += 1.0
        self.n += 1
        self._terms = None

    def remove(self, x: np.ndarray) -> None:
        """Remove one point (one that was added): a rank-one downdate
        (:func:`remove_point`).

        Raises
        ------
        FloatingPointError
            The result is not positive definite.
        """
        if self.n < 1:
            raise ValueError("remove: the cluster is empty")
        if not remove_point(np.asarray(x, float), self.m, self.L, self.k, np.empty(self.D)):
            raise FloatingPointError("Cholesky downdate: the matrix is no longer positive definite")
        self.k -= 1.0
        self.v -= 1.0
        self.n -= 1
        self._terms = None

    def predictive_terms(self) -> tuple[np.ndarray, np.ndarray, float, float]:
        """The Student-t predictive as ``(m, A, const, ν)``: ``log t(x) = const −
        (ν + D)/2 · log1p(‖A(x − m)‖² / ν)`` (cached until the next add or remove)."""
        if self._terms is None:
            A = np.empty((self.D, self.D))
            scaled_inverse(self.L, self.k, self.v, A)
            const = predictive_head(self.L, self.k, self.v)
            self._terms = (self.m.copy(), A, const, self.v - self.D + 1.0)
        return self._terms

    def log_predictive(self, x: np.ndarray) -> np.ndarray:
        """The Student-t log predictive density of rows ``x`` (``(D,)`` or ``(T, D)``)."""
        x = np.atleast_2d(np.asarray(x, float))
        D = self.D
        nu = self.v - D + 1.0
        c = (self.k + 1.0) / (self.k * nu)
        y = np.linalg.solve(self.L, (x - self.m).T)  # L⁻¹ δ, (D, T)
        maha = np.sum(y * y, axis=0) / c
        head = predictive_head(self.L, self.k, self.v)
        return head - 0.5 * (nu + D) * np.log1p(maha / nu)

    def log_marginal(self) -> float:
        """``log p(x_1..x_n)`` of the cluster's points under the prior (closed form)."""
        return log_marginal(self.prior, self.n, self.k, self.v, self.L)


def log_marginal(prior: NIWPrior, n: int, k: float, v: float, L: np.ndarray) -> float:
    """The NIW marginal likelihood of ``n`` points whose posterior is ``(k, v, L Lᵀ)``."""
    D = int(prior.m0.size)
    logdet_0 = float(np.linalg.slogdet(np.asarray(prior.S0, float))[1])
    logdet_n = 2.0 * float(np.sum(np.log(np.diag(L))))
    return float(
        -0.5 * n * D * math.log(math.pi)
        + multigammaln(0.5 * v, D)
        - multigammaln(0.5 * prior.v0, D)
        + 0.5 * prior.v0 * logdet_0
        - 0.5 * v * logdet_n
        + 0.5 * D * (math.log(prior.k0) - math.log(k))
    )
