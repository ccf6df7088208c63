"""Robust (Student-t) linear regression with a tangent bound (DESIGN.md §2).

With residual ``r = y - eta``, ``h = (nu + 1) / 2`` and
``f(s) = -h log1p(s / (nu sigma^2))`` (convex in ``s = r^2``),

    l    = K0 + f(r^2),   K0 = log G(h) - log G(nu/2) - log(nu pi sigma^2) / 2,
    beta = K0 + f(xi^2) + f'(xi^2) (r^2 - xi^2) - eps,  f'(s) = -h / (nu sigma^2 + s),

so ``beta = a r^2 + c`` with ``a = f'(xi^2)``: a lower bound tight at ``r = +-xi``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from scipy.special import gammaln

from flymc_dist._numerics import BOUND_EPS, weighted_gram
from flymc_dist.models.base import BoundStats, Model
from flymc_dist.models.priors import Prior, PriorMixin

__all__ = ["RobustRegression"]

#: Tight points are clipped to ``_XI_MAX * min(1, sqrt(nu) * sigma)`` (any tight
#: point gives a valid bound; this only keeps ``xi**2 / (nu sigma^2)`` finite).
_XI_MAX = 1e100


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a positive real number, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be finite and > 0, got {v!r}")
    return v


class RobustRegression(PriorMixin, Model):
    """Linear regression with Student-t noise: ``y = theta @ x + sigma * t_nu``.

    Parameters
    ----------
    nu
        Degrees of freedom, > 0 (default 4, as in Maclaurin & Adams 2014).
    scale
        Noise scale ``sigma`` > 0.
    prior
        ``"normal"``, ``"laplace"`` (default) or ``"flat"``.
    prior_scale
        Prior sd (normal) or scale ``b`` (Laplace); > 0.
    """

    name = "robust"
    task = "real"
    #: the Student-t log-density is not concave in the residual: a group of rows far
    #: from the fit (a weight only they inform) can hold a second mode
    log_concave = False

    def __init__(
        self,
        nu: float = 4.0,
        scale: float = 1.0,
        prior: str = "laplace",
        prior_scale: float = 1.0,
    ) -> None:
        self.nu = _positive("nu", nu)
        self.scale = _positive("scale", scale)
        self._prior = Prior(prior, prior_scale)
        nus2 = self.nu * (self.scale * self.scale)  # may overflow to inf: checked next
        if not (math.isfinite(nus2) and nus2 > 1e-300):
            raise ValueError(
                f"nu * scale**2 = {nus2!r} is out of the floating-point range; rescale y"
            )
        self._h = 0.5 * (self.nu + 1.0)
        self._nus2 = nus2
        self._inv_nus2 = 1.0 / nus2
        self._log_inv_nus2 = -math.log(nus2)
        self._xi_max = _XI_MAX * min(1.0, math.sqrt(nus2))
        self._const = float(
            gammaln(self._h) - gammaln(0.5 * self.nu) - 0.5 * math.log(math.pi * nus2)
        )

    # ----- shapes / validation ------------------------------------------------
    @property
    def n_outputs(self) -> int:
        """E = 1."""
        return 1

    @property
    def xi_shape(self) -> tuple[int, ...]:
        """One scalar tight point (an absolute residual) per datum: ``()``."""
        return ()

    def validate_targets(self, y: np.ndarray) -> None:
        """Raise ``ValueError`` naming the first non-finite target."""
        y = np.asarray(y)
        if y.ndim != 1:
            raise ValueError(f"y must be one-dimensional, got shape {y.shape}")
        if y.dtype == bool or not (
            np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)
        ):
            raise ValueError(f"y must hold real numbers, got dtype {y.dtype}")
        bad = ~np.isfinite(y)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"y[{i}] = {y[i].item()!r} is not finite")

    # ----- likelihood ---------------------------------------------------------
    @staticmethod
    def _r(eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.asarray(y, dtype=np.float64) - np.asarray(eta, dtype=np.float64)[..., 0]

    def _log1p_q(self, r: np.ndarray) -> np.ndarray:
        """``log1p(r^2 / (nu sigma^2))`` without overflow for huge ``|r|``."""
        with np.errstate(over="ignore"):
            q = r * r
            q *= self._inv_nus2
        out = np.log1p(q)
        big = np.isinf(q)
        if big.any():
            rb = np.abs(r[big])
            out[big] = 2.0 * np.log(rb) + self._log_inv_nus2
        return out

    def loglik(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Student-t log density of ``y`` at location ``eta``: (B, n, 1) -> (B, n)."""
        out = self._log1p_q(self._r(eta, y))
        out *= -self._h
        out += self._const
        return out

    def loglik_grad(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(l, dl/deta)`` with ``dl/deta = 2 h r / (nu sigma^2 + r^2)``."""
        r = self._r(eta, y)
        out = self._log1p_q(r)
        out *= -self._h
        out += self._const
        with np.errstate(over="ignore"):
            den = r * r
        den += self._nus2
        g = r / den
        g *= 2.0 * self._h
        return out, g[..., None]

    def loglik_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``-2 h (nu sigma^2 - r^2) / (nu sigma^2 + r^2)^2``: (n, 1) -> (n, 1, 1)."""
        r = self._r(eta, y)
        with np.errstate(over="ignore"):
            den = r * r
        den += self._nus2
        p = self._nus2 / den  # nu sigma^2 / D, in (0, 1]
        h = 2.0 * p - 1.0
        h /= den
        h *= -2.0 * self._h
        return h[..., None, None]

    # ----- bound --------------------------------------------------------------
    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """``xi_n = 0`` (the tangent at zero residual): shape (n,)."""
        return np.zeros(np.shape(y)[0])

    def tuned_xi(self, eta_hat: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``xi_n = |y_n - eta_hat_n|``: (n, 1) -> (n,)."""
        return np.abs(self._r(eta_hat, y))

    def exact_xi(self, y: np.ndarray) -> np.ndarray:
        """``xi_n = 1e8 sqrt(nu) scale``: a tangent at ``r² = 1e16 nu scale²``, below the
        log-density by about ``h (35.8 − log(1 + u))`` nats at ``u = r² / (nu scale²)``,
        ``h = (nu + 1) / 2``: for ν = 4, more than 50 while ``u ≤ 10⁶`` (residuals up to
        2,000 scales)."""
        return np.full(np.shape(y)[0], 1e8 * math.sqrt(self._nus2))

    def bound_coefficients(self, xi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(a, c)`` with ``beta = a r^2 + c``; ``c`` includes the margin ``-eps_n``.

        ``eps_n = BOUND_EPS * (1 + |K0| + |f(xi^2)| + |a xi^2|)``.
        """
        ax = np.minimum(np.abs(np.asarray(xi, dtype=np.float64)), self._xi_max)
        s0 = ax * ax
        den = s0 + self._nus2
        a = -self._h / den
        m = s0 / den  # -a xi^2 / h, in [0, 1)
        m *= self._h
        f0 = np.log1p(s0 * self._inv_nus2)
        f0 *= -self._h
        c = f0 + m
        c += self._const
        c -= BOUND_EPS * (1.0 + abs(self._const) + m - f0)
        return a, c

    def logbound(self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray) -> np.ndarray:
        """``beta = a r^2 + c``: (B, n, 1) -> (B, n)."""
        a, c = self.bound_coefficients(xi)
        r = self._r(eta, y)
        with np.errstate(over="ignore"):
            r *= r
        r *= a
        r += c
        return r

    def row_constants(self, y: np.ndarray, xi: np.ndarray) -> np.ndarray:
        """Columns ``y``, ``a`` and ``c`` of every row: (n, 3)."""
        a, c = self.bound_coefficients(xi)
        return np.column_stack([np.asarray(y, dtype=np.float64), a, c])

    def compiled_bright(self) -> tuple[str, np.ndarray]:
        """``("robust", (h, const, 1/(nu sigma^2), log 1/(nu sigma^2)))``: see
        :meth:`Model.compiled_bright`."""
        return "robust", np.array([self._h, self._const, self._inv_nus2, self._log_inv_nus2])

    def logbound_grad(
        self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(beta, dbeta/deta)`` with ``dbeta/deta = -2 a r``."""
        a, c = self.bound_coefficients(xi)
        r = self._r(eta, y)
        with np.errstate(over="ignore"):
            beta = r * r
        beta *= a
        beta += c
        r *= a
        r *= -2.0
        return beta, r[..., None]

    def suffstats(self, X: np.ndarray, y: np.ndarray, xi: np.ndarray) -> BoundStats:
        """``A = sum a_n x x^T``, ``b = -2 sum a_n y_n x_n``, ``c = sum (a_n y_n^2 + c_n)``."""
        X = np.asarray(X)
        if X.ndim != 2 or np.shape(y) != (X.shape[0],) or np.shape(xi) != (X.shape[0],):
            raise ValueError(
                f"suffstats needs X (n, D), y (n,), xi (n,); got {X.shape}, "
                f"{np.shape(y)}, {np.shape(xi)}"
            )
        a, c = self.bound_coefficients(xi)
        yv = np.asarray(y, dtype=np.float64)
        ay = a * yv
        b = -2.0 * (ay @ X)
        const = float(ay @ yv + c.sum())
        return BoundStats(weighted_gram(X, a), np.asarray(b, dtype=np.float64), const)

    # ----- serialisation ------------------------------------------------------
    def to_dict(self) -> dict:
        """``{"name": "robust", "nu": ..., "scale": ..., "prior": ..., "prior_scale": ...}``."""
        return {"name": self.name, "nu": self.nu, "scale": self.scale, **self._prior.to_dict()}

    def __repr__(self) -> str:
        return (
            f"RobustRegression(nu={self.nu!r}, scale={self.scale!r}, prior={self.prior!r}, "
            f"prior_scale={self.prior_scale!r})"
        )

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.to_dict() == self.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.to_dict().items())))
