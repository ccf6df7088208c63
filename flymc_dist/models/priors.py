"""Independent priors on the flattened parameter vector, shared by all models.

``prior="normal"``: theta_i ~ N(0, s^2) with ``s = prior_scale``.
``prior="laplace"``: density ``exp(-|theta_i| / b) / (2 b)`` with ``b = prior_scale``.
``prior="flat"``: improper, log density 0 (``prior_scale`` is validated but unused).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["VALID_PRIORS", "Prior", "PriorMixin"]

#: accepted values of ``prior``
VALID_PRIORS = ("normal", "laplace", "flat")
#: the Laplace prior's smoothing in the MAP search, in units of its scale (:meth:`Prior.map_terms`)
MAP_SMOOTHING = 0.01

_LOG_2PI = math.log(2.0 * math.pi)


def _check_positive(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite real number > 0, else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a positive real number, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be finite and > 0, got {v!r}")
    return v


class Prior:
    """An i.i.d. prior on every component of the flattened parameter vector.

    Parameters
    ----------
    kind
        ``"normal"``, ``"laplace"`` or ``"flat"``.
    scale
        Normal: standard deviation; Laplace: scale ``b``. Must be finite and > 0.
    """

    __slots__ = ("kind", "scale", "_inv", "_lognorm")

    def __init__(self, kind: str = "normal", scale: float = 1.0) -> None:
        if not isinstance(kind, str) or kind not in VALID_PRIORS:
            valid = ", ".join(map(repr, VALID_PRIORS))
            raise ValueError(f"prior must be one of {valid}; got {kind!r}")
        self.kind = kind
        self.scale = _check_positive("prior_scale", scale)
        if kind == "normal":
            self._inv = 1.0 / (self.scale * self.scale)
            self._lognorm = -0.5 * _LOG_2PI - math.log(self.scale)
        elif kind == "laplace":
            self._inv = 1.0 / self.scale
            self._lognorm = -math.log(2.0 * self.scale)
        else:
            self._inv = 0.0
            self._lognorm = 0.0

    def logpdf(self, theta: ArrayLike) -> np.ndarray:
        """Log density summed over the last axis: (..., P) -> (...)."""
        theta = np.asarray(theta, dtype=np.float64)
        P = theta.shape[-1]
        if self.kind == "normal":
            return -0.5 * self._inv * np.einsum("...i,...i->...", theta, theta) + P * self._lognorm
        if self.kind == "laplace":
            return -self._inv * np.abs(theta).sum(axis=-1) + P * self._lognorm
        return np.zeros(theta.shape[:-1])

    def grad(self, theta: ArrayLike) -> np.ndarray:
        """Gradient of :meth:`logpdf`: (..., P) -> (..., P). Laplace uses ``sign(0) = 0``."""
        theta = np.asarray(theta, dtype=np.float64)
        if self.kind == "normal":
            return -self._inv * theta
        if self.kind == "laplace":
            return -self._inv * np.sign(theta)
        return np.zeros(theta.shape)

    def map_terms(self, theta: ArrayLike) -> tuple[float, np.ndarray, np.ndarray]:
        """Value, gradient and Hessian diagonal of the log prior as the MAP search uses it.

        Normal and flat: exact. Laplace: ``|θ_i|`` is smoothed to
        ``sqrt(θ_i² + ε²) − ε`` with ``ε = MAP_SMOOTHING · b``, so that Newton's method
        converges (on ``|θ_i|`` itself it cycles around the coordinates whose optimum is
        0 until its iteration limit). The MAP only places the bounds' tight points and
        the starting points: its accuracy affects speed, never exactness.
        """
        theta = np.asarray(theta, dtype=np.float64)
        if self.kind != "laplace":
            return (
                float(self.logpdf(theta)),
                self.grad(theta),
                -np.diag(self.precision(theta.size)).copy(),
            )
        eps = MAP_SMOOTHING * self.scale
        r = np.sqrt(theta * theta + eps * eps)
        val = -self._inv * float((r - eps).sum()) + theta.size * self._lognorm
        return val, -self._inv * theta / r, -self._inv * eps * eps / r**3

    def precision(self, n_params: int) -> np.ndarray:
        """Curvature of ``-logpdf`` as a (P, P) matrix.

        Normal: ``I / s^2``; Laplace: ``I / (2 b^2)`` (the Gaussian with the same
        variance); flat: zeros.
        """
        if isinstance(n_params, bool) or not isinstance(n_params, numbers.Integral) or n_params < 0:
            raise ValueError(f"n_params must be a non-negative integer, got {n_params!r}")
        if self.kind == "normal":
            d = 1.0 / self.scale**2
        elif self.kind == "laplace":
            d = 1.0 / (2.0 * self.scale**2)
        else:
            d = 0.0
        return d * np.eye(int(n_params))

    def compiled_terms(self) -> tuple[str, float, float]:
        """``(kind, k, c)`` with the log density ``−k Σθ²/2 + P c`` (normal),
        ``−k Σ|θ| + P c`` (Laplace) or 0 (flat): what compiled code evaluates."""
        return self.kind, float(self._inv), float(self._lognorm)

    def to_dict(self) -> dict:
        """``{"prior": kind, "prior_scale": scale}``."""
        return {"prior": self.kind, "prior_scale": self.scale}

    def __repr__(self) -> str:
        return f"Prior({self.kind!r}, {self.scale!r})"


class PriorMixin:
    """Implements the prior methods of :class:`~flymc_dist.models.base.Model`.

    The class using it sets ``self._prior`` (a :class:`Prior`) in ``__init__``.
    """

    _prior: Prior

    @property
    def prior(self) -> str:
        """The prior's kind: ``"normal"``, ``"laplace"`` or ``"flat"``."""
        return self._prior.kind

    @property
    def prior_scale(self) -> float:
        """The prior's scale (sd for normal, ``b`` for Laplace)."""
        return self._prior.scale

    def log_prior(self, theta: np.ndarray) -> np.ndarray:
        """Log prior density of theta (B, P) -> (B,)."""
        return self._prior.logpdf(theta)

    def log_prior_grad(self, theta: np.ndarray) -> np.ndarray:
        """Gradient of the log prior: (B, P) -> (B, P)."""
        return self._prior.grad(theta)

    def prior_map_terms(self, theta: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """The log prior for the MAP search at theta (P,): see :meth:`Prior.map_terms`."""
        return self._prior.map_terms(theta)

    def prior_compiled_terms(self) -> tuple[str, float, float]:
        """The prior as compiled code evaluates it: see :meth:`Prior.compiled_terms`."""
        return self._prior.compiled_terms()

    def prior_precision(self, n_params: int) -> np.ndarray:
        """(P, P) curvature of the negative log prior (see :meth:`Prior.precision`)."""
        return self._prior.precision(n_params)
