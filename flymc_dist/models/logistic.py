"""Logistic regression with the Jaakkola–Jordan bound (DESIGN.md §2).

With ``t = 2y - 1`` and ``s = t * eta``, ``l = log sigmoid(s)`` and

    beta(s) = a s^2 + s / 2 + c,   a = -tanh(xi/2) / (4 xi),
    c = -a xi^2 + xi/2 - log(1 + e^xi) - eps,

a global lower bound on ``l`` (in ``s``), tight at ``s = +-xi``. Both ``a`` and
``c`` are even in ``xi``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import expit

from flymc_dist._numerics import BOUND_EPS, log_sigmoid, weighted_gram
from flymc_dist.models.base import BoundStats, Model
from flymc_dist.models.priors import Prior, PriorMixin

__all__ = ["LogisticRegression", "jaakkola_jordan_coefficients"]

_SMALL_XI = 1e-3


def jaakkola_jordan_coefficients(xi: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients ``(a, c)`` of the bound ``beta = a s^2 + s/2 + c`` tight at ``|s| = |xi|``.

    ``c`` already includes the safety margin ``-BOUND_EPS * (1 + |xi|)``.
    Stable for ``xi = 0`` (``a = -1/8``, ``c = -log 2``) and any ``|xi|`` (no
    overflow for ``|xi| >= 710``).

    Parameters
    ----------
    xi
        Tight points, any shape.

    Returns
    -------
    tuple of numpy.ndarray
        ``a`` and ``c``, each shaped like ``xi``.
    """
    ax = np.abs(np.asarray(xi, dtype=np.float64))
    small = ax < _SMALL_XI
    x2 = np.where(small, ax, 0.0) ** 2 if small.any() else None
    # -a * xi^2 = |xi| tanh(|xi|/2) / 4, computed without squaring |xi|.
    m = 0.25 * ax * np.tanh(0.5 * ax)
    safe = np.where(small, 1.0, ax)
    a = m / safe
    a /= -safe
    if x2 is not None:
        # tanh(x)/x = 1 - x^2/3 + 2 x^4/15 - ..., with x = xi/2.
        series = 1.0 - x2 / 12.0 + (x2 * x2) / 120.0
        a = np.where(small, -0.125 * series, a)
        m = np.where(small, 0.125 * x2 * series, m)
    # xi/2 - log(1 + e^xi) = -log(e^{xi/2} + e^{-xi/2}) = -|xi|/2 - log1p(e^{-|xi|}).
    c = m - 0.5 * ax
    c -= np.log1p(np.exp(-ax))
    c -= BOUND_EPS * (1.0 + ax)
    return a, c


def _first_bad(y: np.ndarray, bad: np.ndarray, what: str) -> None:
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"y[{i}] = {y[i].item()!r} is not {what}")


class LogisticRegression(PriorMixin, Model):
    """Binary logistic regression, ``y in {0, 1}``, ``P(y = 1) = sigmoid(theta @ x)``.

    Parameters
    ----------
    prior
        ``"normal"``, ``"laplace"`` or ``"flat"``.
    prior_scale
        Prior sd (normal) or scale ``b`` (Laplace); > 0.
    xi_untuned
        Tight point ``|s|`` used for untuned bounds (default 1.5).
    """

    name = "logistic"
    task = "binary"

    def __init__(
        self, prior: str = "normal", prior_scale: float = 1.0, xi_untuned: float = 1.5
    ) -> None:
        self._prior = Prior(prior, prior_scale)
        if isinstance(xi_untuned, bool) or not isinstance(xi_untuned, numbers.Real):
            raise ValueError(f"xi_untuned must be a real number, got {xi_untuned!r}")
        if not math.isfinite(float(xi_untuned)):
            raise ValueError(f"xi_untuned must be finite, got {xi_untuned!r}")
        self.xi_untuned = float(xi_untuned)

    # ----- shapes / validation ------------------------------------------------
    @property
    def n_outputs(self) -> int:
        """E = 1."""
        return 1

    @property
    def xi_shape(self) -> tuple[int, ...]:
        """One scalar tight point per datum: ``()``."""
        return ()

    def validate_targets(self, y: np.ndarray) -> None:
        """Raise ``ValueError`` naming the first row whose label is not 0 or 1."""
        y = np.asarray(y)
        if y.ndim != 1:
            raise ValueError(f"y must be one-dimensional, got shape {y.shape}")
        if y.dtype == bool:
            return
        if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
            raise ValueError(f"y must hold 0/1 labels, got dtype {y.dtype}")
        _first_bad(y, (y != 0) & (y != 1), "a 0/1 label")

    # ----- likelihood ---------------------------------------------------------
    @staticmethod
    def _s(eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = 2.0 * np.asarray(y, dtype=np.float64) - 1.0
        return np.asarray(eta, dtype=np.float64)[..., 0] * t, t

    def loglik(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``log sigmoid(t * eta)``: (B, n, 1) -> (B, n)."""
        s, _ = self._s(eta, y)
        return log_sigmoid(s)

    def loglik_grad(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(l, dl/deta)`` with ``dl/deta = t * sigmoid(-s)``."""
        s, t = self._s(eta, y)
        # e = exp(-|s|): l = min(s, 0) - log1p(e); sigmoid(-s) = (1 if s < 0 else e) / (1 + e)
        e = np.abs(s)
        np.negative(e, out=e)
        np.exp(e, out=e)
        g = np.where(s < 0.0, 1.0, e)
        g /= 1.0 + e
        g *= t
        np.log1p(e, out=e)
        np.minimum(s, 0.0, out=s)
        s -= e
        return s, g[..., None]

    def loglik_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``-sigmoid(eta) sigmoid(-eta)``: (n, 1) -> (n, 1, 1)."""
        e = np.asarray(eta, dtype=np.float64)
        h = expit(e)
        h *= expit(-e)
        np.negative(h, out=h)
        return h[..., None]

    # ----- bound --------------------------------------------------------------
    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """``xi_n = xi_untuned`` for every datum: shape (n,)."""
        return np.full(np.shape(y)[0], self.xi_untuned)

    def tuned_xi(self, eta_hat: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``xi_n = |eta_hat_n|`` (the bound is tight at the estimate): (n, 1) -> (n,)."""
        return np.abs(np.asarray(eta_hat, dtype=np.float64)[:, 0])

    def exact_xi(self, y: np.ndarray) -> np.ndarray:
        """``xi_n = 10⁴``: ``beta(s) ≈ −2500 + s/2 − s²/40000``, more than 1,000 nats
        below ``log sigmoid(s)`` for ``|s| ≤ 1,000``."""
        return np.full(np.shape(y)[0], 1e4)

    def logbound(self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray) -> np.ndarray:
        """``beta = a s^2 + s/2 + c``: (B, n, 1) -> (B, n)."""
        a, c = jaakkola_jordan_coefficients(xi)
        s, _ = self._s(eta, y)
        with np.errstate(over="ignore"):
            beta = a * s
            beta *= s
        beta += 0.5 * s
        beta += c
        return beta

    def row_constants(self, y: np.ndarray, xi: np.ndarray) -> np.ndarray:
        """Columns ``t = 2y - 1``, ``a`` and ``c`` of every row: (n, 3)."""
        a, c = jaakkola_jordan_coefficients(xi)
        return np.column_stack([2.0 * np.asarray(y, dtype=np.float64) - 1.0, a, c])

    def compiled_bright(self) -> tuple[str, np.ndarray]:
        """``("logistic", no parameters)``: see :meth:`Model.compiled_bright`."""
        return "logistic", np.zeros(0)

    def logbound_grad(
        self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(beta, dbeta/deta)`` with ``dbeta/deta = t (2 a s + 1/2)``."""
        a, c = jaakkola_jordan_coefficients(xi)
        s, t = self._s(eta, y)
        as_ = a * s
        with np.errstate(over="ignore"):
            beta = as_ * s
        beta += 0.5 * s
        beta += c
        as_ *= 2.0
        as_ += 0.5
        as_ *= t
        return beta, as_[..., None]

    def suffstats(self, X: np.ndarray, y: np.ndarray, xi: np.ndarray) -> BoundStats:
        """``A = sum a_n x_n x_n^T``, ``b = 1/2 sum t_n x_n``, ``c = sum c_n``."""
        X = np.asarray(X)
        if X.ndim != 2 or np.shape(y) != (X.shape[0],) or np.shape(xi) != (X.shape[0],):
            raise ValueError(
                f"suffstats needs X (n, D), y (n,), xi (n,); got {X.shape}, "
                f"{np.shape(y)}, {np.shape(xi)}"
            )
        a, c = jaakkola_jordan_coefficients(xi)
        t = 2.0 * np.asarray(y, dtype=np.float64) - 1.0
        b = 0.5 * (t @ X)
        return BoundStats(weighted_gram(X, a), np.asarray(b, dtype=np.float64), float(c.sum()))

    # ----- serialisation ------------------------------------------------------
    def to_dict(self) -> dict:
        """``{"name": "logistic", "prior": ..., "prior_scale": ..., "xi_untuned": ...}``."""
        return {"name": self.name, **self._prior.to_dict(), "xi_untuned": self.xi_untuned}

    def __repr__(self) -> str:
        return (
            f"LogisticRegression(prior={self.prior!r}, prior_scale={self.prior_scale!r}, "
            f"xi_untuned={self.xi_untuned!r})"
        )

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.to_dict() == self.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.to_dict().items())))
