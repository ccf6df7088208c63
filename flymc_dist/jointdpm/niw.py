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
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from scipy.special import gammaln, multigammaln

__all__ = [
    "ClusterStats",
    "NIWPrior",
    "chol_downdate",
    "chol_update",
    "log_marginal",
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


def chol_update(L: np.ndarray, x: np.ndarray) -> None:
    """In place: ``L`` becomes the Cholesky factor of ``L Lᵀ + x xᵀ`` (lower)."""
    x = np.array(x, dtype=float)
    n = x.size
    for k in range(n):
        r = math.hypot(L[k, k], x[k])
        c = r / L[k, k]
        s = x[k] / L[k, k]
        L[k, k] = r
        if k + 1 < n:
            L[k + 1 :, k] = (L[k + 1 :, k] + s * x[k + 1 :]) / c
            x[k + 1 :] = c * x[k + 1 :] - s * L[k + 1 :, k]


def chol_downdate(L: np.ndarray, x: np.ndarray) -> None:
    """In place: ``L`` becomes the Cholesky factor of ``L Lᵀ − x xᵀ`` (lower).

    Raises
    ------
    FloatingPointError
        The result is not positive definite.
    """
    x = np.array(x, dtype=float)
    n = x.size
    for k in range(n):
        d = L[k, k] * L[k, k] - x[k] * x[k]
        if not d > 0.0:
            raise FloatingPointError("Cholesky downdate: the matrix is no longer positive definite")
        r = math.sqrt(d)
        c = r / L[k, k]
        s = x[k] / L[k, k]
        L[k, k] = r
        if k + 1 < n:
            L[k + 1 :, k] = (L[k + 1 :, k] - s * x[k + 1 :]) / c
            x[k + 1 :] = c * x[k + 1 :] - s * L[k + 1 :, k]


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
        """Add one point: a rank-one update."""
        d = np.asarray(x, float) - self.m
        chol_update(self.L, d * math.sqrt(self.k / (self.k + 1.0)))
        self.m = self.m + d / (self.k + 1.0)
        self.k += 1.0
        self.v += 1.0
        self.n += 1
        self._terms = None

    def remove(self, x: np.ndarray) -> None:
        """Remove one point (one that was added): a rank-one downdate."""
        if self.n < 1:
            raise ValueError("remove: the cluster is empty")
        x = np.asarray(x, float)
        k2 = self.k - 1.0
        m2 = (self.k * self.m - x) / k2
        d = x - m2
        chol_downdate(self.L, d * math.sqrt(k2 / self.k))
        self.m, self.k, self.v, self.n = m2, k2, self.v - 1.0, self.n - 1
        self._terms = None

    def predictive_terms(self) -> tuple[np.ndarray, np.ndarray, float, float]:
        """The Student-t predictive as ``(m, A, const, ν)``: ``log t(x) = const −
        (ν + D)/2 · log1p(‖A(x − m)‖² / ν)`` (cached until the next add or remove)."""
        if self._terms is None:
            D = self.D
            nu = self.v - D + 1.0
            c = (self.k + 1.0) / (self.k * nu)
            A = np.linalg.inv(self.L) / math.sqrt(c)
            logdet = D * math.log(c) + 2.0 * float(np.sum(np.log(np.diag(self.L))))
            const = float(
                gammaln(0.5 * (nu + D))
                - gammaln(0.5 * nu)
                - 0.5 * D * math.log(nu * math.pi)
                - 0.5 * logdet
            )
            self._terms = (self.m.copy(), A, const, nu)
        return self._terms

    def log_predictive(self, x: np.ndarray) -> np.ndarray:
        """The Student-t log predictive density of rows ``x`` (``(D,)`` or ``(T, D)``)."""
        x = np.atleast_2d(np.asarray(x, float))
        D = self.D
        nu = self.v - D + 1.0
        c = (self.k + 1.0) / (self.k * nu)
        y = np.linalg.solve(self.L, (x - self.m).T)  # L⁻¹ δ, (D, T)
        maha = np.sum(y * y, axis=0) / c
        logdet = D * math.log(c) + 2.0 * float(np.sum(np.log(np.diag(self.L))))
        return (
            gammaln(0.5 * (nu + D))
            - gammaln(0.5 * nu)
            - 0.5 * D * math.log(nu * math.pi)
            - 0.5 * logdet
            - 0.5 * (nu + D) * np.log1p(maha / nu)
        )

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
