"""The model interface every likelihood implements.

A model is a GLM: each datum n has a linear predictor ``eta_n = theta @ x_n`` with
``E`` outputs (``E = 1`` for logistic and robust regression, ``E = K`` for softmax),
where ``theta`` has shape ``param_shape(D) = (D,)`` (E = 1) or ``(K, D)``.
Internally the samplers work on the *flattened* parameter vector of length
``P = prod(param_shape)``, flattened in C order (row-major), so that for softmax
``theta_flat[k * D + d] == theta[k, d]``.

Every per-datum method works on a *batch* of linear predictors of shape
``(B, n, E)`` (B parameter values, n data) and returns ``(B, n)`` (values) or
``(B, n, E)`` (derivatives with respect to eta). Nothing here knows of Dask,
shards or brightness variables.

Bounds: a per-datum lower bound ``B_n(theta) <= L_n(theta)``, strictly positive,
with a per-datum tight point ``xi`` (array of shape ``(n,) + xi_shape``).
``log B_n`` is a quadratic in theta, so the sum over all data collapses to
``theta_flat @ A @ theta_flat + b @ theta_flat + c`` (see :meth:`suffstats`).
The bound must keep ``delta_n = l_n - beta_n >= 0`` numerically; implementations
subtract a tiny epsilon from the bound's constant for that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np


class BoundStats(NamedTuple):
    """Collapsed bound: ``sum_n beta_n(theta) = theta @ A @ theta + b @ theta + c``.

    Sums over shards add component-wise.
    """

    A: np.ndarray  # (P, P), symmetric
    b: np.ndarray  # (P,)
    c: float

    def __add__(self, other: BoundStats) -> BoundStats:  # type: ignore[override]
        return BoundStats(self.A + other.A, self.b + other.b, float(self.c + other.c))

    def value(self, theta: np.ndarray) -> np.ndarray:
        """Evaluate at ``theta`` of shape ``(..., P)``; returns shape ``(...)``."""
        theta = np.asarray(theta, dtype=np.float64)
        quad = theta @ self.A  # one BLAS call; einsum's three-operand loop is ~10x slower
        quad *= theta
        out = quad.sum(axis=-1)
        out += theta @ self.b
        out += self.c
        return out

    def grad(self, theta: np.ndarray) -> np.ndarray:
        """Gradient at ``theta`` of shape ``(..., P)``."""
        return theta @ (self.A + self.A.T) + self.b

    def value_and_grad(self, theta: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`value` and :meth:`grad` at ``theta`` ``(k, P)`` from one product
        ``θ A``, bit for bit the same: when ``A`` is exactly symmetric
        (``symmetric``, checked once by the caller), ``A + Aᵀ = 2A`` and ``θ (2A)`` is
        ``2 (θ A)`` exactly (scaling by two commutes with every rounding)."""
        theta = np.asarray(theta, dtype=np.float64)
        quad = theta @ self.A
        g = quad * 2.0 if symmetric else theta @ (self.A + self.A.T)
        g += self.b
        quad *= theta
        out = quad.sum(axis=-1)
        out += theta @ self.b
        out += self.c
        return out, g


class Model(ABC):
    """A GLM-type likelihood with a collapsible per-datum lower bound and a prior."""

    #: short name, e.g. "logistic"
    name: str
    #: "binary" | "multiclass" | "real": what ``y`` must look like
    task: str
    #: every log-likelihood term is concave in θ, so the log posterior (with a log-concave
    #: prior) has one mode and the MAP search may start anywhere; False: the search
    #: starts at the mode of the untuned bound (:func:`flymc_dist.tune.find_map`)
    log_concave: bool = True
    #: a bound tuned at an estimate equals the likelihood there (less its margin), so no
    #: row is bright at that estimate (False: e.g. softmax's one-vs-each bound keeps a gap)
    bound_tight: bool = True

    # ----- shapes -------------------------------------------------------------
    @property
    @abstractmethod
    def n_outputs(self) -> int:
        """E, the number of linear predictors per datum."""

    def param_shape(self, n_features: int) -> tuple[int, ...]:
        """Shape of theta for data with ``n_features`` columns."""
        return (n_features,) if self.n_outputs == 1 else (self.n_outputs, n_features)

    def n_params(self, n_features: int) -> int:
        """P, the length of the flattened parameter vector."""
        return int(np.prod(self.param_shape(n_features)))

    # ----- validation ---------------------------------------------------------
    @abstractmethod
    def validate_targets(self, y: np.ndarray) -> None:
        """Raise ``ValueError`` (saying which row) if ``y`` is not valid for this model."""

    # ----- linear predictor ---------------------------------------------------
    def linear_predictor(self, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        """``eta[b, n, e] = sum_d theta[b, e*D + d] * X[n, d]``; theta (B, P), X (n, D)."""
        B, E, D = theta.shape[0], self.n_outputs, X.shape[1]
        eta = X @ theta.reshape(B * E, D).T  # (n, B*E): one BLAS call
        return eta.reshape(X.shape[0], B, E).transpose(1, 0, 2)

    def grad_theta(self, weights: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Chain rule: ``g[b, e*D + d] = sum_n weights[b, n, e] * X[n, d]``; returns (B, P)."""
        B, n, E = weights.shape
        return (weights.transpose(0, 2, 1).reshape(B * E, n) @ X).reshape(B, -1)

    # ----- likelihood ---------------------------------------------------------
    @abstractmethod
    def loglik(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Per-datum log-likelihood ``l_n``: eta (B, n, E), y (n,) -> (B, n)."""

    @abstractmethod
    def loglik_grad(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(l_n, d l_n / d eta)``: shapes (B, n) and (B, n, E)."""

    @abstractmethod
    def loglik_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Second derivative of ``l_n`` in eta: eta (n, E) -> (n, E, E). Used by MAP."""

    # ----- bound --------------------------------------------------------------
    @property
    @abstractmethod
    def xi_shape(self) -> tuple[int, ...]:
        """Trailing shape of one datum's tight point: () or (K,)."""

    @abstractmethod
    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """Tight points used without a MAP estimate: shape (n,) + xi_shape."""

    @abstractmethod
    def tuned_xi(self, eta_hat: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Tight points from eta at a parameter estimate: eta_hat (n, E) -> (n,) + xi_shape."""

    def exact_xi(self, y: np.ndarray) -> np.ndarray | None:
        """Tight points far from every plausible fit, for the rows FlyMC evaluates at every
        step (``exact_rows``): (n,) -> (n,) + xi_shape, or None when the model has none
        (then ``exact_rows`` picks no row).

        The bound there is still a lower bound, so FlyMC stays exact; it lies hundreds of
        nats below the likelihood wherever the linear predictor is within hundreds of
        its tight scale of the data, so such a row is bright with probability
        ``1 − e^−δ`` = 1 in floating point, and contributes ``β + log(e^δ − 1) = l`` to
        θ's target: its exact log-likelihood.
        """
        return None

    @abstractmethod
    def logbound(self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray) -> np.ndarray:
        """Per-datum log lower bound ``beta_n``: (B, n, E) -> (B, n)."""

    @abstractmethod
    def logbound_grad(
        self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(beta_n, d beta_n / d eta)``: shapes (B, n) and (B, n, E)."""

    def row_constants(self, y: np.ndarray, xi: np.ndarray) -> np.ndarray | None:
        """Per-row constants ``(n, K)`` of the compiled ``log L~`` (see
        :meth:`compiled_bright`), or None.

        A model with one linear predictor (E = 1) may precompute, once per set of tight
        points, everything ``log L~_n = log(expm1(l_n - beta_n))`` needs besides
        ``eta_n`` (the label and the bound's coefficients), so that evaluating a few
        hundred scattered rows costs one gather and a handful of arithmetic operations
        each. None (the default): shards use :meth:`loglik` and :meth:`logbound`.
        """
        return None

    def compiled_bright(self) -> tuple[str, np.ndarray] | None:
        """``(kind, params)`` of the compiled ``log L~_n`` of one row, from ``eta_n`` and its
        :meth:`row_constants`, in :mod:`flymc_dist._compiled` (the shards' hot path), or
        None (the default: shards use :meth:`loglik` and :meth:`logbound`). ``params``
        are the model's scalar constants. The compiled value equals
        ``log_expm1(loglik - logbound)`` up to rounding."""
        return None

    @abstractmethod
    def suffstats(self, X: np.ndarray, y: np.ndarray, xi: np.ndarray) -> BoundStats:
        """Collapsed bound over these rows: ``sum_n beta_n(theta)`` as a quadratic."""

    # ----- prior --------------------------------------------------------------
    @abstractmethod
    def log_prior(self, theta: np.ndarray) -> np.ndarray:
        """Log prior density (normalised where proper) of theta (B, P) -> (B,)."""

    @abstractmethod
    def log_prior_grad(self, theta: np.ndarray) -> np.ndarray:
        """Gradient of the log prior: (B, P) -> (B, P)."""

    @abstractmethod
    def prior_precision(self, n_params: int) -> np.ndarray:
        """A (P, P) positive semi-definite curvature of -log prior (zeros for flat), for
        preconditioning; for Laplace use the variance-matched Gaussian's precision."""

    # ----- serialisation ------------------------------------------------------
    @abstractmethod
    def to_dict(self) -> dict:
        """JSON-able description; ``model_from_dict(m.to_dict())`` rebuilds it."""
