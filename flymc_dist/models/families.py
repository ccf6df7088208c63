"""GLM families: one row's log-likelihood with a curvature bound (DESIGN.md §5).

A *family* gives one datum's log-likelihood ``f(η; y)`` as a function of its linear
predictor ``η = xᵀθ``, its derivative ``f'`` and a curvature bound ``c(y) > 0`` with
``f''(η; y) ≥ −c(y)`` for every ``η``. Then

    B(η) = f(ξ) + f'(ξ) (η − ξ) − ½ c (η − ξ)²  ≤  f(η),

tight at ``η = ξ``, is a quadratic in ``η`` and so in ``θ``:
``β = q₂ η² + q₁ η + q₀`` with ``q₂ = −c/2``, ``q₁ = f'(ξ) + c ξ`` and
``q₀ = f(ξ) − f'(ξ) ξ − ½ c ξ² − ε``. Over many rows it collapses to
``Σ q₂ x xᵀ``, ``Σ q₁ x`` and ``Σ q₀`` (:meth:`Family.collapse`). Everything a model
needs — the bound, its collapsed statistics, the compiled ``log L̃`` and its gradient —
is derived here from the family, once; :class:`~flymc_dist.models.glm.GLM` is the model
made from one.

Families split ``f = core(η; y) + base(y)``: ``base`` (a normalising constant) cancels
in ``ℓ − β``, so the compiled ``log L̃`` and the bound work with ``core`` alone.

Built in: binomial with ``m`` trials (logit link, ``c = m/4``; probit link, ``c = m``),
negative binomial with log link and fixed dispersion ``r`` (``c = (y + r)/4``),
Gaussian with fixed noise sd ``σ`` (``c = 1/σ²``: the bound is the likelihood, so no
row is ever bright); two families with a tighter, ξ-dependent curvature whose bound
they give in closed form (:meth:`Family.bound_coefficients` and what reads it):
:class:`LogisticFamily` (Jaakkola–Jordan, ``c(ξ) = tanh(ξ/2)/(2ξ) ≤ 1/4``; the model
:class:`~flymc_dist.models.logistic.LogisticRegression`) and :class:`StudentTFamily`
(the tangent in ``r²``, ``c(ξ) = (ν + 1)/(νσ² + ξ²)``; the model
:class:`~flymc_dist.models.robust.RobustRegression`); and :class:`SoftmaxFamily`, K
linear predictors per row with Böhning's fixed curvature *matrix* or the one-vs-each
bound, a Jaakkola–Jordan curvature per class against the label (the model
:class:`~flymc_dist.models.softmax.SoftmaxRegression`). Poisson with a log link has no
such bound (``f'' = −e^η`` is unbounded below) and is refused. :class:`CustomFamily`
takes a user's ``f``, ``f'`` and curvature, and checks the bound numerically when tight
points are set.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import erfc, expit, gammaln, ndtr, ndtri

from flymc_dist._numerics import BOUND_EPS, log_sigmoid, logsumexp, weighted_gram
from flymc_dist.models.base import BoundStats

__all__ = [
    "FAMILIES",
    "SOFTMAX_BOUNDS",
    "BinomialFamily",
    "CustomFamily",
    "Family",
    "GaussianFamily",
    "LogisticFamily",
    "NegativeBinomialFamily",
    "SoftmaxFamily",
    "StudentTFamily",
    "jaakkola_jordan_coefficients",
    "log_ndtr",
    "resolve_family",
]

#: compiled family ids (:mod:`flymc_dist._compiled`, kind ``"glm"``, ``par[0]``)
BINOMIAL_LOGIT = 0
BINOMIAL_PROBIT = 1
NEGATIVE_BINOMIAL = 2
GAUSSIAN = 3

_LOG_2PI = math.log(2.0 * math.pi)
#: below this, log Φ(x) uses its asymptotic series (erfc(−x/√2) nears underflow)
_NDTR_TAIL = -37.0
#: the logistic family's untuned tight point ``|s|``
XI_UNTUNED = 1.5
#: the Student-t family's degrees of freedom and scale (Maclaurin & Adams 2014: ν = 4)
STUDENT_T_NU = 4.0
STUDENT_T_SCALE = 1.0
#: below this ``|ξ|``, the Jaakkola–Jordan coefficients use their series
_SMALL_XI = 1e-3
#: Student-t tight points are clipped to ``_XI_MAX * min(1, √ν σ)``
_XI_MAX = 1e100
#: the softmax family's bounds (:class:`SoftmaxFamily`), its default first
SOFTMAX_BOUNDS = ("bohning", "one_vs_each")


def _check_link(family: str, link: str, allowed: tuple[str, ...]) -> None:
    """Refuse a ``link`` the family does not have, naming the ones it does."""
    if link not in allowed:
        names = " or ".join(repr(a) for a in allowed)
        raise ValueError(f"{family} link must be {names}, got {link!r}")


def _real(name: str, value: object, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or (positive and v <= 0.0):
        raise ValueError(f"{name} must be finite{' and > 0' if positive else ''}, got {v!r}")
    return v


def _first_bad(y: np.ndarray, bad: np.ndarray, what: str) -> None:
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"y[{i}] = {y[i].item()!r} is not {what}")


def _numeric_1d(y: np.ndarray) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"y must be one-dimensional, got shape {y.shape}")
    if y.dtype != bool and not (
        np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)
    ):
        raise ValueError(f"y must hold numbers, got dtype {y.dtype}")
    yf = y.astype(np.float64)
    _first_bad(y, ~np.isfinite(yf), "finite")
    return yf


# ----- numerics shared (formula for formula) with the compiled kernel -----------------
def _softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + e^x)``."""
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0.0, 1.0, e) / (1.0 + e)


def log_ndtr(x: np.ndarray) -> np.ndarray:
    """``log Φ(x)``, the standard normal log CDF, for every real ``x``.

    ``log1p(−erfc(x/√2)/2)`` for ``x > 0``, ``log(erfc(−x/√2)/2)`` down to −37 and the
    asymptotic series ``−x²/2 − log(−x) − log(2π)/2 + log(1 − x⁻² + 3x⁻⁴ − 15x⁻⁶ +
    105x⁻⁸)`` below (relative error < 1e-14 there). The compiled kernel uses the same.
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        pos = np.log1p(-0.5 * erfc(x / math.sqrt(2.0)))
        mid = np.log(0.5 * erfc(-x / math.sqrt(2.0)))
        u = 1.0 / (x * x)
        tail = (
            -0.5 * x * x
            - np.log(-x)
            - 0.5 * _LOG_2PI
            + np.log1p(u * (-1.0 + u * (3.0 + u * (-15.0 + u * 105.0))))
        )
    return np.where(x > 0.0, pos, np.where(x >= _NDTR_TAIL, mid, tail))


def _mills(x: np.ndarray, log_cdf: np.ndarray) -> np.ndarray:
    """``φ(x) / Φ(x)`` from ``log Φ(x)``."""
    return np.exp(-0.5 * x * x - 0.5 * _LOG_2PI - log_cdf)


def jaakkola_jordan_coefficients(xi: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients ``(a, c)`` of the bound ``β = a s² + s/2 + c`` on ``log σ(s)``, tight
    at ``|s| = |ξ|``.

    ``c`` already includes the safety margin ``−BOUND_EPS (1 + |ξ|)``. Stable for
    ``ξ = 0`` (``a = −1/8``, ``c = −log 2``) and any ``|ξ|`` (no overflow for
    ``|ξ| ≥ 710``).

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
    # −a ξ² = |ξ| tanh(|ξ|/2) / 4, computed without squaring |ξ|.
    m = 0.25 * ax * np.tanh(0.5 * ax)
    safe = np.where(small, 1.0, ax)
    a = m / safe
    a /= -safe
    if x2 is not None:
        # tanh(x)/x = 1 − x²/3 + 2x⁴/15 − ..., with x = ξ/2.
        series = 1.0 - x2 / 12.0 + (x2 * x2) / 120.0
        a = np.where(small, -0.125 * series, a)
        m = np.where(small, 0.125 * x2 * series, m)
    # ξ/2 − log(1 + e^ξ) = −log(e^{ξ/2} + e^{−ξ/2}) = −|ξ|/2 − log1p(e^{−|ξ|}).
    c = m - 0.5 * ax
    c -= np.log1p(np.exp(-ax))
    c -= BOUND_EPS * (1.0 + ax)
    return a, c


# ----- families ----------------------------------------------------------------------
class Family(ABC):
    """One datum's log-likelihood as a function of its linear predictor, with a
    curvature bound: what :class:`~flymc_dist.models.glm.GLM` derives a model from.

    Subclasses give :meth:`core` (``f`` without its ``y``-only constant, and ``f'``),
    :meth:`core_hess`, :meth:`curvature` (``c(y)`` with ``f'' ≥ −c(y)`` everywhere),
    :meth:`validate_targets`, :meth:`untuned_xi` and :meth:`to_dict`; optionally
    :meth:`base` (that constant), :meth:`value` (``f`` alone, cheaper), :meth:`tuned_xi`,
    :meth:`exact_xi` and :meth:`compiled`. The bound follows from these
    (:meth:`bound_coefficients`, :meth:`bound`, :meth:`collapse`,
    :meth:`row_constants`); a family with a tighter, ξ-dependent curvature in closed
    form (Jaakkola–Jordan, the Student-t tangent in ``r²``) or a curvature matrix
    (Böhning's, ``n_outputs = K``) overrides those instead.
    """

    #: family name, e.g. ``"binomial"``
    name: str
    #: link function's name
    link: str
    #: ``f`` is concave in ``η`` (the MAP search may start anywhere)
    log_concave: bool = True
    #: the bound is checked numerically wherever tight points are set (user families)
    checked: bool = False
    #: linear predictors per row (``K`` for a multiclass family: ``η``, ``f'`` and the
    #: tight points then carry a trailing axis of length K)
    n_outputs: int = 1
    #: the bound equals ``f`` (less its margin) at its tight points, so no row is bright
    #: at the estimate the tight points were set from (False: a bound that keeps a gap
    #: there, e.g. softmax's one-vs-each)
    tight: bool = True

    @property
    def task(self) -> str:
        """The data task it fits: ``"binary"``, ``"count"``, ``"real"`` or ``"multiclass"``."""
        return "real"

    @abstractmethod
    def validate_targets(self, y: np.ndarray) -> None:
        """Raise ``ValueError`` naming the first row whose target the family cannot have."""

    @abstractmethod
    def core(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(f − base(y), f')`` at ``eta`` (broadcasting with ``y``)."""

    def value(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """:meth:`core`'s value alone (a family may compute it more cheaply)."""
        return self.core(eta, y)[0]

    @abstractmethod
    def core_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``f''`` at ``eta`` (MAP search)."""

    def base(self, y: np.ndarray) -> np.ndarray | None:
        """The part of ``f`` that depends on ``y`` alone, or None (the default: none)."""
        return None

    @abstractmethod
    def curvature(self, y: np.ndarray) -> np.ndarray:
        """``c(y) > 0`` with ``f''(η; y) ≥ −c(y)`` for every ``η``."""

    @abstractmethod
    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """Tight points without a parameter estimate: an ``η`` that fits ``y``."""

    def tuned_xi(self, eta_hat: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Tight points from ``η̂``, the linear predictors at a parameter estimate
        (default: ``η̂`` itself)."""
        return np.array(eta_hat, dtype=np.float64, copy=True)

    def exact_xi(self, y: np.ndarray) -> np.ndarray | None:
        """Tight points far from every plausible fit (see
        :meth:`flymc_dist.models.base.Model.exact_xi`), or None (the default)."""
        return None

    # ----- the bound, derived from f, f' and the curvature ------------------------
    def bound_coefficients(self, y: np.ndarray, xi: np.ndarray) -> tuple[np.ndarray, ...]:
        """``(q₂, q₁, q₀)`` of the bound on ``core`` tight at ``xi``:
        ``β_core = q₂ η² + q₁ η + q₀ ≤ core(η)``, with ``q₂ = −c/2``,
        ``q₁ = f'(ξ) + c ξ`` and ``q₀ = f(ξ) − f'(ξ) ξ − c ξ²/2 − ε``, the margin
        ``ε = BOUND_EPS (1 + |f(ξ)| + |f'(ξ) ξ| + c ξ²/2)``.

        A family with a tighter, ξ-dependent curvature (a bound in closed form) gives
        its own coefficients here, in whatever form its :meth:`bound`,
        :meth:`collapse` and :meth:`row_constants` read.

        Parameters
        ----------
        y, xi
            Targets and tight points, shape (n,).

        Returns
        -------
        tuple of numpy.ndarray
            Each (n,).
        """
        y = np.asarray(y, dtype=np.float64)
        xi = np.asarray(xi, dtype=np.float64)
        f0, g0 = self.core(xi, y)
        c = self.curvature(y)
        gx = g0 * xi
        cx2 = 0.5 * c * xi * xi
        q0 = f0 - gx - cx2
        q0 -= BOUND_EPS * (1.0 + np.abs(f0) + np.abs(gx) + cx2)
        return -0.5 * c, g0 + c * xi, q0

    def bound(
        self, eta: np.ndarray, y: np.ndarray, coef: tuple[np.ndarray, ...], grad: bool = True
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """``(β_core, dβ/dη)`` at ``eta`` (B, n) from :meth:`bound_coefficients`:
        ``q₂ η² + q₁ η + q₀`` and ``2 q₂ η + q₁`` (None without ``grad``)."""
        q2, q1, q0 = coef
        with np.errstate(over="ignore", invalid="ignore"):
            beta = q2 * eta * eta + q1 * eta + q0
        return beta, (2.0 * q2 * eta + q1) if grad else None

    def collapse(self, X: np.ndarray, y: np.ndarray, coef: tuple[np.ndarray, ...]) -> BoundStats:
        """``Σ_n β_core`` over rows ``X`` (n, D) as a quadratic in θ:
        ``A = Σ q₂ x xᵀ``, ``b = Σ q₁ x``, ``c = Σ q₀``."""
        q2, q1, q0 = coef
        return BoundStats(
            weighted_gram(X, q2), np.asarray(q1 @ X, dtype=np.float64), float(q0.sum())
        )

    def row_constants(self, y: np.ndarray, coef: tuple[np.ndarray, ...]) -> np.ndarray:
        """The ``(n, 3)`` row constants :meth:`compiled`'s kind reads: ``y``, ``q₁`` and
        ``q₀`` for kind ``"glm"`` (the curvature follows from ``y``)."""
        _, q1, q0 = coef
        return np.column_stack([np.asarray(y, dtype=np.float64), q1, q0])

    def compiled(self) -> tuple[str, np.ndarray] | None:
        """``(kind, par)`` of the compiled ``log L̃`` (:mod:`flymc_dist._compiled`):
        ``("glm", (family id, its parameters))`` for a family of :func:`_glm_core`, its
        own kind for a family with a closed-form bound; None (the default): shards
        evaluate :meth:`core` and :meth:`bound`."""
        return None

    # ----- the predictive, for res.predict ------------------------------------------
    def mean(self, eta: np.ndarray) -> np.ndarray:
        """``E[y | η]`` (the inverse link; for a multiclass family each class's
        probability, over the trailing axis): what ``predict`` averages over the
        draws. A family without one (a user's) refuses."""
        raise ValueError(
            f"the {self.name!r} family gives no predictive distribution (only its "
            "log-likelihood): predict needs a family with a mean and draws of y"
        )

    def draw(self, eta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One draw of ``y`` given each ``η`` (``predict``'s intervals for counts and
        real targets)."""
        self.mean(eta)  # the same refusal
        raise NotImplementedError

    @abstractmethod
    def to_dict(self) -> dict:
        """``{"family": ..., "link": ..., <parameters>}``."""


class BinomialFamily(Family):
    """``y`` successes of ``trials`` Bernoulli trials with success probability
    ``σ(η)`` (``link="logit"``, ``c = m/4``) or ``Φ(η)`` (``link="probit"``, ``c = m``:
    ``(log Φ)'' ∈ (−1, 0)``).

    Parameters
    ----------
    trials
        ``m ≥ 1``, the same for every row (1: binary data).
    link
        ``"logit"`` (default) or ``"probit"``.
    """

    name = "binomial"

    def __init__(self, trials: int = 1, link: str = "logit") -> None:
        if isinstance(trials, bool) or not isinstance(trials, numbers.Integral) or trials < 1:
            raise ValueError(f"trials must be an integer >= 1, got {trials!r}")
        _check_link("binomial", link, ("logit", "probit"))
        self.trials = int(trials)
        self.link = link

    @property
    def task(self) -> str:
        """``"binary"`` for one trial, else ``"count"``."""
        return "binary" if self.trials == 1 else "count"

    def validate_targets(self, y: np.ndarray) -> None:
        """Integers in ``0 … trials``."""
        yf = _numeric_1d(y)
        bad = (yf != np.round(yf)) | (yf < 0) | (yf > self.trials)
        _first_bad(np.asarray(y), bad, f"an integer count in 0..{self.trials}")

    def core(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Logit: ``y η − m softplus(η)``; probit: ``y log Φ(η) + (m − y) log Φ(−η)``."""
        m = float(self.trials)
        if self.link == "logit":
            return y * eta - m * _softplus(eta), y - m * _sigmoid(eta)
        lp, ln = log_ndtr(eta), log_ndtr(-eta)
        return y * lp + (m - y) * ln, y * _mills(eta, lp) - (m - y) * _mills(-eta, ln)

    def core_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Logit ``−m σ(η) σ(−η)``; probit ``−y R(η)(η + R(η)) − (m−y) R(−η)(R(−η) − η)``."""
        m = float(self.trials)
        if self.link == "logit":
            return -m * _sigmoid(eta) * _sigmoid(-eta)
        rp, rn = _mills(eta, log_ndtr(eta)), _mills(-eta, log_ndtr(-eta))
        return -y * rp * (eta + rp) - (m - y) * rn * (rn - eta)

    def base(self, y: np.ndarray) -> np.ndarray:
        """``log C(m, y)``."""
        m = float(self.trials)
        return gammaln(m + 1.0) - gammaln(y + 1.0) - gammaln(m - y + 1.0)

    def curvature(self, y: np.ndarray) -> np.ndarray:
        """``m/4`` (logit) or ``m`` (probit)."""
        c = 0.25 * self.trials if self.link == "logit" else float(self.trials)
        return np.full(np.shape(y), c)

    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """The link of ``(y + ½) / (m + 1)``."""
        p = (np.asarray(y, dtype=np.float64) + 0.5) / (self.trials + 1.0)
        return np.log(p / (1.0 - p)) if self.link == "logit" else ndtri(p)

    def compiled(self) -> tuple[str, np.ndarray]:
        """``("glm", (BINOMIAL_LOGIT or BINOMIAL_PROBIT, m))``."""
        fid = BINOMIAL_LOGIT if self.link == "logit" else BINOMIAL_PROBIT
        return "glm", np.array([fid, float(self.trials)])

    def mean(self, eta: np.ndarray) -> np.ndarray:
        """``m p`` with ``p = σ(η)`` or ``Φ(η)`` (for one trial, the probability of 1)."""
        p = expit(eta) if self.link == "logit" else ndtr(eta)
        return p if self.trials == 1 else self.trials * p

    def draw(self, eta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Binomial(m, p) successes."""
        return rng.binomial(self.trials, self.mean(eta) / self.trials).astype(np.float64)

    def to_dict(self) -> dict:
        """``{"family": "binomial", "link": ..., "trials": m}``."""
        return {"family": self.name, "link": self.link, "trials": self.trials}


class NegativeBinomialFamily(Family):
    """Counts with mean ``μ = e^η`` and variance ``μ + μ²/r`` (log link, fixed
    dispersion ``r``): ``f = y η − (y + r) log(r + e^η) + const``, ``f'' =
    −(y + r) σ(η − log r) σ(log r − η) ≥ −(y + r)/4``.

    Parameters
    ----------
    dispersion
        ``r > 0``.
    """

    name = "negative_binomial"
    link = "log"

    def __init__(self, dispersion: float = 1.0, link: str = "log") -> None:
        _check_link("negative_binomial", link, ("log",))
        self.dispersion = _real("dispersion", dispersion)
        self._log_r = math.log(self.dispersion)

    @property
    def task(self) -> str:
        """``"count"``."""
        return "count"

    def validate_targets(self, y: np.ndarray) -> None:
        """Non-negative integers."""
        yf = _numeric_1d(y)
        _first_bad(np.asarray(y), (yf != np.round(yf)) | (yf < 0), "a non-negative integer")

    def core(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``y η − (y + r) softplus(η − log r)`` and ``y − (y + r) σ(η − log r)``."""
        u = eta - self._log_r
        w = y + self.dispersion
        return y * eta - w * _softplus(u), y - w * _sigmoid(u)

    def core_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``−(y + r) σ(u) σ(−u)``, ``u = η − log r``."""
        u = eta - self._log_r
        return -(y + self.dispersion) * _sigmoid(u) * _sigmoid(-u)

    def base(self, y: np.ndarray) -> np.ndarray:
        """``log Γ(y + r) − log Γ(r) − log Γ(y + 1) − y log r``."""
        r = self.dispersion
        return gammaln(y + r) - gammaln(r) - gammaln(y + 1.0) - y * self._log_r

    def curvature(self, y: np.ndarray) -> np.ndarray:
        """``(y + r)/4``."""
        return 0.25 * (np.asarray(y, dtype=np.float64) + self.dispersion)

    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """``log(y + ½)``."""
        return np.log(np.asarray(y, dtype=np.float64) + 0.5)

    def compiled(self) -> tuple[str, np.ndarray]:
        """``("glm", (NEGATIVE_BINOMIAL, r, log r))``."""
        return "glm", np.array([NEGATIVE_BINOMIAL, self.dispersion, self._log_r])

    def mean(self, eta: np.ndarray) -> np.ndarray:
        """``μ = e^η``."""
        return np.exp(eta)

    def draw(self, eta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A count of mean ``μ`` and variance ``μ + μ²/r`` (gamma-Poisson)."""
        r = self.dispersion
        return rng.poisson(rng.gamma(r, self.mean(eta) / r)).astype(np.float64)

    def to_dict(self) -> dict:
        """``{"family": "negative_binomial", "link": "log", "dispersion": r}``."""
        return {"family": self.name, "link": self.link, "dispersion": self.dispersion}


class GaussianFamily(Family):
    """``y ~ N(η, σ²)`` with a fixed ``σ`` (identity link): ``c = 1/σ²`` is exact, so
    the bound is the likelihood (less its safety margin) and no row is ever bright.

    Parameters
    ----------
    scale
        ``σ > 0``.
    """

    name = "gaussian"
    link = "identity"

    def __init__(self, scale: float = 1.0, link: str = "identity") -> None:
        _check_link("gaussian", link, ("identity",))
        self.scale = _real("scale", scale)
        self._prec = 1.0 / (self.scale * self.scale)

    def validate_targets(self, y: np.ndarray) -> None:
        """Finite numbers."""
        _numeric_1d(y)

    def core(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``−(y − η)²/(2σ²)`` and ``(y − η)/σ²``."""
        r = y - eta
        return -0.5 * self._prec * r * r, self._prec * r

    def core_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``−1/σ²``."""
        return np.full(np.broadcast(eta, y).shape, -self._prec)

    def base(self, y: np.ndarray) -> np.ndarray:
        """``−log σ − log(2π)/2``."""
        return np.full(np.shape(y), -math.log(self.scale) - 0.5 * _LOG_2PI)

    def curvature(self, y: np.ndarray) -> np.ndarray:
        """``1/σ²``."""
        return np.full(np.shape(y), self._prec)

    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """``y``."""
        return np.asarray(y, dtype=np.float64).copy()

    def compiled(self) -> tuple[str, np.ndarray]:
        """``("glm", (GAUSSIAN, 1/σ²))``."""
        return "glm", np.array([GAUSSIAN, self._prec])

    def mean(self, eta: np.ndarray) -> np.ndarray:
        """``η``."""
        return np.asarray(eta, dtype=np.float64)

    def draw(self, eta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``η + σ ε``, ``ε ~ N(0, 1)``."""
        return eta + self.scale * rng.standard_normal(np.shape(eta))

    def to_dict(self) -> dict:
        """``{"family": "gaussian", "link": "identity", "scale": σ}``."""
        return {"family": self.name, "link": self.link, "scale": self.scale}


class CustomFamily(Family):
    """A user's family: ``f(η, y)`` and ``f'(η, y)`` as numba-compilable functions of two
    floats, and a curvature constant ``c > 0`` with ``f''(η, y) ≥ −c`` for every ``η``.

    The functions are compiled to numpy ufuncs (numba ``vectorize``) in each process
    that uses them. Wherever tight points are set, the GLM checks ``B ≤ f`` for every
    row on a grid over the data's ``η`` range at those points, widened by
    :data:`~flymc_dist.models.glm.CHECK_WIDEN` of it (at least 1) either side, and
    refuses a violation naming the row, ``η`` and ``y``. The compiled hot path is not
    used: shards evaluate these ufuncs.

    Parameters
    ----------
    f, df
        ``f(eta, y) -> float`` (the log-likelihood) and its derivative in ``eta``.
    curvature
        ``c > 0``.
    name
        A name for messages and ``repr``.
    log_concave
        ``f`` is concave in ``η`` (then the MAP search may start at zero).
    targets
        ``"real"`` (any finite ``y``, default), ``"count"`` (non-negative integers) or
        ``"binary"`` (0/1).
    """

    checked = True
    link = "custom"

    def __init__(
        self,
        f: Callable[[float, float], float],
        df: Callable[[float, float], float],
        curvature: float,
        *,
        name: str = "custom",
        log_concave: bool = False,
        targets: str = "real",
    ) -> None:
        if not callable(f) or not callable(df):
            raise ValueError("f and df must be functions of (eta, y)")
        if targets not in ("real", "count", "binary"):
            raise ValueError(f"targets must be 'real', 'count' or 'binary', got {targets!r}")
        self.f, self.df = f, df
        self.c = _real("curvature", curvature)
        self.name = str(name)
        self.log_concave = bool(log_concave)
        self.targets = targets
        self._ufuncs: tuple[Any, Any] | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_ufuncs"] = None  # compiled again where it is used
        return state

    @property
    def task(self) -> str:
        """The ``targets`` given."""
        return self.targets

    def _compiled_ufuncs(self) -> tuple[Any, Any]:
        if self._ufuncs is None:
            import numba

            sig = ["float64(float64, float64)"]
            self._ufuncs = tuple(
                numba.vectorize(sig)(getattr(fn, "py_func", fn)) for fn in (self.f, self.df)
            )
        return self._ufuncs

    def validate_targets(self, y: np.ndarray) -> None:
        """Finite; integers ≥ 0 (``"count"``); 0/1 (``"binary"``)."""
        yf = _numeric_1d(y)
        if self.targets == "count":
            _first_bad(np.asarray(y), (yf != np.round(yf)) | (yf < 0), "a non-negative integer")
        elif self.targets == "binary":
            _first_bad(np.asarray(y), (yf != 0) & (yf != 1), "a 0/1 label")

    def core(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The user's ``f`` and ``f'``."""
        f, df = self._compiled_ufuncs()
        eta = np.asarray(eta, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        return f(eta, y), df(eta, y)

    def value(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The user's ``f`` alone."""
        f, _ = self._compiled_ufuncs()
        return f(np.asarray(eta, dtype=np.float64), np.asarray(y, dtype=np.float64))

    def core_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """A central difference of ``f'`` (MAP search only: speed, never exactness)."""
        f, df = self._compiled_ufuncs()
        eta = np.asarray(eta, dtype=np.float64)
        h = 1e-5 * (1.0 + np.abs(eta))
        y = np.asarray(y, dtype=np.float64)
        return (df(eta + h, y) - df(eta - h, y)) / (2.0 * h)

    def curvature(self, y: np.ndarray) -> np.ndarray:
        """The constant given."""
        return np.full(np.shape(y), self.c)

    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """``η = 0``."""
        return np.zeros(np.shape(y))

    def to_dict(self) -> dict:
        """``{"family": "custom:<name>", "link": "custom", "curvature": c}`` (not
        rebuildable from the description: the functions are code)."""
        return {"family": f"custom:{self.name}", "link": self.link, "curvature": self.c}


class LogisticFamily(Family):
    """Binary data with a logit link and the Jaakkola–Jordan bound: a tighter,
    ξ-dependent curvature ``c(ξ) = tanh(ξ/2) / (2ξ) ≤ 1/4``.

    With ``t = 2y − 1`` and ``s = tη``, ``f = log σ(s)`` and

        β(s) = a s² + s/2 + c,   a = −tanh(ξ/2) / (4ξ),
        c = −a ξ² + ξ/2 − log(1 + e^ξ) − ε,

    a global lower bound on ``f`` tight at ``s = ±ξ`` (``log σ(s) − s/2`` is convex in
    ``s²``, and β is its tangent there). In the family's terms ``q₂ = a``,
    ``q₁ = t/2`` and ``q₀ = c`` (:func:`jaakkola_jordan_coefficients`), in closed form.
    Tight points are ``ξ = |η̂|`` (``a`` and ``c`` are even in ``ξ``).

    Parameters
    ----------
    xi_untuned
        Tight point ``|s|`` used for untuned bounds.
    link
        ``"logit"`` (the only one).
    """

    name = "logistic"
    link = "logit"

    def __init__(self, xi_untuned: float = XI_UNTUNED, link: str = "logit") -> None:
        _check_link("logistic", link, ("logit",))
        self.xi_untuned = _real("xi_untuned", xi_untuned, positive=False)

    @property
    def task(self) -> str:
        """``"binary"``."""
        return "binary"

    def validate_targets(self, y: np.ndarray) -> None:
        """0/1 labels (or booleans)."""
        y = np.asarray(y)
        if y.ndim != 1:
            raise ValueError(f"y must be one-dimensional, got shape {y.shape}")
        if y.dtype == bool:
            return
        if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
            raise ValueError(f"y must hold 0/1 labels, got dtype {y.dtype}")
        _first_bad(y, (y != 0) & (y != 1), "a 0/1 label")

    def core(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``log σ(s)`` and ``t σ(−s)``, ``s = tη``, from one ``e^{−|s|}``."""
        t = 2.0 * np.asarray(y, dtype=np.float64) - 1.0
        s = eta * t
        # l = min(s, 0) − log1p(e); σ(−s) = (1 if s < 0 else e) / (1 + e), e = exp(−|s|)
        e = np.abs(s)
        np.negative(e, out=e)
        np.exp(e, out=e)
        g = np.where(s < 0.0, 1.0, e)
        g /= 1.0 + e
        g *= t
        np.log1p(e, out=e)
        np.minimum(s, 0.0, out=s)
        s -= e
        return s, g

    def value(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``log σ(tη)`` alone."""
        return log_sigmoid(eta * (2.0 * np.asarray(y, dtype=np.float64) - 1.0))

    def core_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``−σ(η) σ(−η)``."""
        e = np.asarray(eta, dtype=np.float64)
        h = expit(e)
        h *= expit(-e)
        np.negative(h, out=h)
        return h

    def curvature(self, y: np.ndarray) -> np.ndarray:
        """``1/4``, the fixed bound (the bound used is the tighter ``c(ξ)``)."""
        return np.full(np.shape(y), 0.25)

    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """``ξ_n = xi_untuned``."""
        return np.full(np.shape(y)[0], self.xi_untuned)

    def tuned_xi(self, eta_hat: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``ξ_n = |η̂_n|``."""
        return np.abs(np.asarray(eta_hat, dtype=np.float64))

    def exact_xi(self, y: np.ndarray) -> np.ndarray:
        """``ξ_n = 10⁴``: ``β(s) ≈ −2500 + s/2 − s²/40000``, more than 1,000 nats
        below ``log σ(s)`` for ``|s| ≤ 1,000``."""
        return np.full(np.shape(y)[0], 1e4)

    def bound_coefficients(self, y: np.ndarray, xi: np.ndarray) -> tuple[np.ndarray, ...]:
        """``(a, t/2, c)`` (:func:`jaakkola_jordan_coefficients`)."""
        a, c = jaakkola_jordan_coefficients(xi)
        return a, 0.5 * (2.0 * np.asarray(y, dtype=np.float64) - 1.0), c

    def row_constants(self, y: np.ndarray, coef: tuple[np.ndarray, ...]) -> np.ndarray:
        """Columns ``t``, ``a`` and ``c`` (kind ``"logistic"``)."""
        a, _, c = coef
        return np.column_stack([2.0 * np.asarray(y, dtype=np.float64) - 1.0, a, c])

    def compiled(self) -> tuple[str, np.ndarray]:
        """``("logistic", no parameters)``."""
        return "logistic", np.zeros(0)

    def mean(self, eta: np.ndarray) -> np.ndarray:
        """``σ(η)``, the probability of 1."""
        return expit(eta)

    def draw(self, eta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Bernoulli(σ(η)) labels."""
        return (rng.random(np.shape(eta)) < self.mean(eta)).astype(np.float64)

    def to_dict(self) -> dict:
        """``{"family": "logistic", "link": "logit", "xi_untuned": ...}``."""
        return {"family": self.name, "link": self.link, "xi_untuned": self.xi_untuned}


class StudentTFamily(Family):
    """Real data with Student-t noise around ``η`` (identity link), ``ν`` degrees of
    freedom and scale ``σ``, with the tangent bound in ``r²``: a tighter, ξ-dependent
    curvature ``c(ξ) = (ν + 1) / (νσ² + ξ²) ≤ (ν + 1) / (νσ²)``.

    With residual ``r = y − η``, ``h = (ν + 1)/2`` and ``g(u) = −h log1p(u / (νσ²))``
    (convex in ``u = r²``),

        f = K₀ + g(r²),   K₀ = log Γ(h) − log Γ(ν/2) − log(νπσ²)/2,
        β = K₀ + g(ξ²) + g'(ξ²)(r² − ξ²) − ε = a r² + c,   a = g'(ξ²) = −h / (νσ² + ξ²),

    a lower bound tight at ``r = ±ξ``. Tight points are absolute residuals,
    ``ξ = |y − η̂|`` (untuned: 0). The bound is kept in its residual form ``a r² + c``
    (its coefficients in ``η`` are ``q₂ = a``, ``q₁ = −2ay``, ``q₀ = ay² + c``):
    fewer roundings near the fit, where ``r`` is small and ``y`` is not.

    Parameters
    ----------
    nu
        Degrees of freedom ``ν > 0``.
    scale
        Noise scale ``σ > 0``.
    link
        ``"identity"`` (the only one).
    """

    name = "student_t"
    link = "identity"
    #: the Student-t log-density is not concave in the residual: a group of rows far
    #: from the fit (a weight only they inform) can hold a second mode
    log_concave = False

    def __init__(
        self, nu: float = STUDENT_T_NU, scale: float = STUDENT_T_SCALE, link: str = "identity"
    ) -> None:
        _check_link("student_t", link, ("identity",))
        self.nu = _real("nu", nu)
        self.scale = _real("scale", scale)
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

    def validate_targets(self, y: np.ndarray) -> None:
        """Finite real numbers (not booleans)."""
        y = np.asarray(y)
        if y.ndim != 1:
            raise ValueError(f"y must be one-dimensional, got shape {y.shape}")
        if y.dtype == bool or not (
            np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)
        ):
            raise ValueError(f"y must hold real numbers, got dtype {y.dtype}")
        _first_bad(y, ~np.isfinite(y), "finite")

    def _log1p_q(self, r: np.ndarray) -> np.ndarray:
        """``log1p(r² / (νσ²))`` without overflow for huge ``|r|``."""
        with np.errstate(over="ignore"):
            q = r * r
            q *= self._inv_nus2
        out = np.log1p(q)
        big = np.isinf(q)
        if big.any():
            rb = np.abs(r[big])
            out[big] = 2.0 * np.log(rb) + self._log_inv_nus2
        return out

    def core(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``K₀ − h log1p(r²/(νσ²))`` (the whole log density: ``base`` is 0) and
        ``2 h r / (νσ² + r²)``."""
        r = y - eta
        out = self._log1p_q(r)
        out *= -self._h
        out += self._const
        with np.errstate(over="ignore"):
            den = r * r
        den += self._nus2
        g = r / den
        g *= 2.0 * self._h
        return out, g

    def value(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``K₀ − h log1p(r²/(νσ²))`` alone."""
        out = self._log1p_q(y - eta)
        out *= -self._h
        out += self._const
        return out

    def core_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``−2 h (νσ² − r²) / (νσ² + r²)²``."""
        r = y - eta
        with np.errstate(over="ignore"):
            den = r * r
        den += self._nus2
        p = self._nus2 / den  # νσ² / D, in (0, 1]
        h = 2.0 * p - 1.0
        h /= den
        h *= -2.0 * self._h
        return h

    def curvature(self, y: np.ndarray) -> np.ndarray:
        """``(ν + 1) / (νσ²)``, the fixed bound (the bound used is the tighter ``c(ξ)``)."""
        return np.full(np.shape(y), 2.0 * self._h * self._inv_nus2)

    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """``ξ_n = 0`` (the tangent at zero residual)."""
        return np.zeros(np.shape(y)[0])

    def tuned_xi(self, eta_hat: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``ξ_n = |y_n − η̂_n|``."""
        return np.abs(np.asarray(y, dtype=np.float64) - np.asarray(eta_hat, dtype=np.float64))

    def exact_xi(self, y: np.ndarray) -> np.ndarray:
        """``ξ_n = 10⁸ √ν σ``: a tangent at ``r² = 10¹⁶ νσ²``, below the log-density by
        about ``h (35.8 − log(1 + u))`` nats at ``u = r² / (νσ²)``: for ν = 4, more than
        50 while ``u ≤ 10⁶`` (residuals up to 2,000 scales)."""
        return np.full(np.shape(y)[0], 1e8 * math.sqrt(self._nus2))

    def bound_coefficients(self, y: np.ndarray, xi: np.ndarray) -> tuple[np.ndarray, ...]:
        """``(a, c)`` with ``β = a r² + c``; ``c`` includes the margin
        ``ε = BOUND_EPS (1 + |K₀| + |g(ξ²)| + |a ξ²|)``. Tight points are clipped to
        ``10¹⁰⁰ min(1, √ν σ)`` (any tight point gives a valid bound; this keeps
        ``ξ²/(νσ²)`` finite)."""
        ax = np.minimum(np.abs(np.asarray(xi, dtype=np.float64)), self._xi_max)
        s0 = ax * ax
        den = s0 + self._nus2
        a = -self._h / den
        m = s0 / den  # −a ξ² / h, in [0, 1)
        m *= self._h
        f0 = np.log1p(s0 * self._inv_nus2)
        f0 *= -self._h
        c = f0 + m
        c += self._const
        c -= BOUND_EPS * (1.0 + abs(self._const) + m - f0)
        return a, c

    def bound(
        self, eta: np.ndarray, y: np.ndarray, coef: tuple[np.ndarray, ...], grad: bool = True
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """``a r² + c`` and ``−2 a r``."""
        a, c = coef
        r = y - eta
        with np.errstate(over="ignore"):
            beta = r * r
        beta *= a
        beta += c
        if not grad:
            return beta, None
        r *= a
        r *= -2.0
        return beta, r

    def collapse(self, X: np.ndarray, y: np.ndarray, coef: tuple[np.ndarray, ...]) -> BoundStats:
        """``A = Σ a x xᵀ``, ``b = −2 Σ a y x``, ``c = Σ a y² + Σ c``."""
        a, c = coef
        ay = a * y
        b = -2.0 * (ay @ X)
        return BoundStats(
            weighted_gram(X, a), np.asarray(b, dtype=np.float64), float(ay @ y + c.sum())
        )

    def row_constants(self, y: np.ndarray, coef: tuple[np.ndarray, ...]) -> np.ndarray:
        """Columns ``y``, ``a`` and ``c`` (kind ``"robust"``)."""
        a, c = coef
        return np.column_stack([np.asarray(y, dtype=np.float64), a, c])

    def compiled(self) -> tuple[str, np.ndarray]:
        """``("robust", (h, K₀, 1/(νσ²), log 1/(νσ²)))``."""
        return "robust", np.array([self._h, self._const, self._inv_nus2, self._log_inv_nus2])

    def mean(self, eta: np.ndarray) -> np.ndarray:
        """``η`` (the location; the mean where ``ν > 1``)."""
        return np.asarray(eta, dtype=np.float64)

    def draw(self, eta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``η + scale · t_ν``."""
        return eta + self.scale * rng.standard_t(self.nu, size=np.shape(eta))

    def to_dict(self) -> dict:
        """``{"family": "student_t", "link": "identity", "nu": ν, "scale": σ}``."""
        return {"family": self.name, "link": self.link, "nu": self.nu, "scale": self.scale}


def _relative_to_label(a: np.ndarray, yi: np.ndarray) -> np.ndarray:
    """``a - a[..., n, y_n]`` for ``a`` of shape (..., n, K)."""
    ar = np.arange(yi.shape[0])
    return a - a[..., ar, yi][..., None]


class SoftmaxFamily(Family):
    """``K`` classes, ``y ∈ {0, …, K−1}``, with ``K`` linear predictors per row
    (``η = θx``, ``θ`` of shape (K, D)) and one of two bounds (``bound``): Böhning's
    (``"bohning"``, the default), with the fixed curvature *matrix*
    ``A_K = (I − 11ᵀ/K)/2``, which dominates the Hessian of ``lse`` everywhere; or the
    one-vs-each bound (``"one_vs_each"``), whose curvature adapts to each row's margins.

    ``f = η_y − lse(η)``; with ``g = softmax(ψ)`` and ``d = η − ψ``,
    ``lse(η) ≤ lse(ψ) + dᵀg + dᵀA_K d/2``, so ``β = η_y − lse(ψ) − dᵀg − dᵀA_K d/2 − ε``
    is a lower bound on ``f``, tight at ``η = ψ`` (and along ``η = ψ + c1``): the
    curvature bound of a scalar family with ``c`` a matrix. Tight points are ``K``
    logits per row (MAP-tuned ``ψ_n = η̂_n``).

    Numerics: ``f`` and ``β`` are both invariant under ``η → η + c1``, so they are
    computed from the differences ``u = η − η_y`` and ``w = ψ − ψ_y``
    (``e = d − d_y = u − w``): ``f = −lse(u)``,
    ``β = −lse(w) − gᵀe − Σ_k (e_k − mean(e))²/4 − ε``. This keeps ``δ = f − β ≥ 0``
    after rounding even for huge logits along the flat direction, where a naive
    evaluation loses ``~1e-16 |η|``.

    One-vs-each (Titsias 2016; Bouchard 2007's bound with its free offset at ``η_y``,
    less its ``log 2``): with ``u_k = η_k − η_y``,
    ``f = −log(1 + Σ_{k≠y} e^{u_k}) ≥ Σ_{k≠y} log σ(−u_k)`` (since
    ``Π(1 + a_k) ≥ 1 + Σ a_k`` for ``a_k ≥ 0``), and each ``log σ(s_k)``, ``s_k = −u_k``,
    is bounded by Jaakkola–Jordan tight at ``|s_k| = ξ_k``:
    ``β = Σ_{k≠y} (a_k u_k² − u_k/2 + c_k)`` (:func:`jaakkola_jordan_coefficients`,
    ``a_k = −tanh(ξ_k/2)/(4ξ_k)``). Its curvature in ``u_k`` is
    ``tanh(ξ_k/2)/(2ξ_k) ≤ 1/4``, about ``1/(2|margin|)`` for a class far below the
    label's, where Böhning's stays ``1/2``; it is invariant under ``η → η + c1`` (no
    curvature along the likelihood's flat direction), and not tight at its tight
    points: the gap there, ``Σ_{k≠y} softplus(u_k) − log(1 + Σ_{k≠y} e^{u_k})``, is
    ``≈ Σ_{j<k} e^{u_j + u_k}`` for a confidently classified row, and at most
    ``(K − 1) log 2 − log K`` (all logits equal). Tight points are the same ``K``
    logits ``ψ_n`` as Böhning's (MAP-tuned ``ψ_n = η̂_n``), read as
    ``ξ_nk = |ψ_nk − ψ_ny|``.

    Parameters
    ----------
    n_classes
        ``K ≥ 2``.
    link
        ``"softmax"`` (the only one).
    bound
        ``"bohning"`` (default) or ``"one_vs_each"``.
    """

    name = "softmax"
    link = "softmax"

    def __init__(
        self, n_classes: int, link: str = "softmax", bound: str = SOFTMAX_BOUNDS[0]
    ) -> None:
        _check_link("softmax", link, ("softmax",))
        if bound not in SOFTMAX_BOUNDS:
            names = " or ".join(map(repr, SOFTMAX_BOUNDS))
            raise ValueError(f"softmax bound must be {names}, got {bound!r}")
        self.bound_name = bound
        self.tight = bound == "bohning"
        if isinstance(n_classes, bool) or not isinstance(n_classes, numbers.Integral):
            raise ValueError(f"n_classes must be an integer >= 2, got {n_classes!r}")
        if n_classes < 2:
            raise ValueError(f"n_classes must be >= 2, got {n_classes!r}")
        self.n_outputs = self.n_classes = int(n_classes)
        K = self.n_classes
        self._A_K = 0.5 * (np.eye(K) - np.full((K, K), 1.0 / K))

    @property
    def task(self) -> str:
        """``"multiclass"``."""
        return "multiclass"

    def validate_targets(self, y: np.ndarray) -> None:
        """Class labels in ``0..K−1``."""
        y = np.asarray(y)
        if y.ndim != 1:
            raise ValueError(f"y must be one-dimensional, got shape {y.shape}")
        if y.dtype == bool:
            return
        K = self.n_classes
        what = f"a class label in 0..{K - 1} (n_classes = {K})"
        if np.issubdtype(y.dtype, np.integer):
            _first_bad(y, (y < 0) | (y >= K), what)
        elif np.issubdtype(y.dtype, np.floating):
            ok = np.isfinite(y)
            ok[ok] = (y[ok] == np.floor(y[ok])) & (y[ok] >= 0) & (y[ok] < K)
            _first_bad(y, ~ok, what)
        else:
            raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")

    @staticmethod
    def _labels(y: np.ndarray) -> np.ndarray:
        return np.asarray(y).astype(np.intp, copy=False)

    def core(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``η_y − lse(η)`` and ``e_y − softmax(η)``: eta (..., n, K) -> (..., n), (..., n, K)."""
        yi = self._labels(y)
        u = _relative_to_label(eta, yi)
        lse = logsumexp(u, keepdims=True)
        g = u - lse
        np.exp(g, out=g)
        np.negative(g, out=g)
        g[..., np.arange(yi.shape[0]), yi] += 1.0
        return -lse[..., 0], g

    def value(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``η_y − lse(η) = −lse(u)`` alone."""
        out = logsumexp(_relative_to_label(eta, self._labels(y)))
        np.negative(out, out=out)
        return out

    def core_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``−(diag(p) − ppᵀ)``, ``p = softmax(η)``: (n, K) -> (n, K, K)."""
        p = eta - logsumexp(eta, keepdims=True)
        np.exp(p, out=p)
        H = p[..., :, None] * p[..., None, :]
        idx = np.arange(self.n_classes)
        H[..., idx, idx] -= p
        return H

    def curvature(self, y: np.ndarray) -> np.ndarray:
        """``A_K`` for every row: (n, K, K)."""
        return np.broadcast_to(self._A_K, np.shape(y) + self._A_K.shape)

    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """``ψ_n = 0``: (n, K)."""
        return np.zeros((np.shape(y)[0], self.n_classes))

    def exact_xi(self, y: np.ndarray) -> np.ndarray:
        """``ψ_n = −1000 e_{y_n}`` (the label's logit 1,000 below the others'): the bound
        is about ``1000² (K − 1) / (4K) ≥ 125,000`` nats below the log-likelihood where the
        logits differ by much less than 1,000."""
        yi = self._labels(y)
        psi = np.zeros((yi.shape[0], self.n_classes))
        psi[np.arange(yi.shape[0]), yi] = -1000.0
        return psi

    def bound_coefficients(self, y: np.ndarray, xi: np.ndarray) -> tuple[np.ndarray, ...]:
        """Böhning: ``(ψ, w = ψ − ψ_y, lse(w), g = softmax(ψ), ε)`` with
        ``ε = BOUND_EPS (1 + lse(w))``. One-vs-each: ``(a, c)``, each (n, K), the
        Jaakkola–Jordan coefficients at ``ξ_k = |ψ_k − ψ_y|`` (margins included), zero in
        the label's column."""
        yi = self._labels(y)
        if self.bound_name == "one_vs_each":
            a, c = jaakkola_jordan_coefficients(
                _relative_to_label(np.asarray(xi, dtype=np.float64), yi)
            )
            rows = np.arange(yi.shape[0])
            a[rows, yi] = 0.0
            c[rows, yi] = 0.0
            return a, c
        psi = np.asarray(xi, dtype=np.float64)
        w = _relative_to_label(psi, yi)
        lse_w = logsumexp(w)
        g = w - lse_w[:, None]
        np.exp(g, out=g)
        return psi, w, lse_w, g, BOUND_EPS * (1.0 + lse_w)

    def bound(
        self, eta: np.ndarray, y: np.ndarray, coef: tuple[np.ndarray, ...], grad: bool = True
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """``β`` and ``dβ/dη``: (..., n, K) -> (..., n), (..., n, K). Böhning:
        ``dβ/dη = e_y − g − A_K (η − ψ)``. One-vs-each: ``β = Σ_k (a_k u_k² − u_k/2 + c_k)``
        over ``k ≠ y`` (``a_y = c_y = 0``, ``u_y = 0``), ``dβ/dη_k = 2a_k u_k − ½`` for
        ``k ≠ y`` and minus their sum for ``y``."""
        yi = self._labels(y)
        if self.bound_name == "one_vs_each":
            return self._one_vs_each(eta, yi, coef, grad)
        _, w, lse_w, g, eps = coef
        e = _relative_to_label(eta, yi)
        e -= w
        beta = np.einsum("...nk,nk->...n", e, g)
        e -= e.mean(axis=-1, keepdims=True)
        beta += 0.25 * np.einsum("...nk,...nk->...n", e, e)
        beta += lse_w + eps
        np.negative(beta, out=beta)
        if not grad:
            return beta, None
        # A_K (η − ψ) = (e − mean(e)) / 2
        e *= -0.5
        e -= g
        e[..., np.arange(yi.shape[0]), yi] += 1.0
        return beta, e

    def _one_vs_each(
        self, eta: np.ndarray, yi: np.ndarray, coef: tuple[np.ndarray, ...], grad: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The one-vs-each bound and its η-derivative (see :meth:`bound`)."""
        a, c = coef
        u = _relative_to_label(eta, yi)
        g = a * u  # a_k u_k
        beta = np.einsum("...nk,...nk->...n", g, u)
        beta -= 0.5 * u.sum(axis=-1)  # u_y = 0
        beta += c.sum(axis=-1)
        if not grad:
            return beta, None
        g *= 2.0
        g -= 0.5
        rows = np.arange(yi.shape[0])
        g[..., rows, yi] = 0.0
        g[..., rows, yi] = -g.sum(axis=-1)
        return beta, g

    def collapse(self, X: np.ndarray, y: np.ndarray, coef: tuple[np.ndarray, ...]) -> BoundStats:
        """In the row-major flattened ``θ`` (K, D). Böhning: ``β_n = −ηᵀA_Kη/2 + v_nᵀη +
        c_n`` with ``v_n = e_{y_n} − g_n + A_K ψ_n`` and
        ``c_n = −lse(ψ_n) + ψ_nᵀg_n − ψ_nᵀA_Kψ_n/2 − ε_n``; so
        ``A = −kron(A_K, Σ x xᵀ)/2``, ``b = vec(VᵀX)``, ``c = Σ c_n``. One-vs-each:
        ``β_n = ηᵀM_nη + v_nᵀη + Σ_k c_nk`` with ``M_n = Σ_{k≠y} a_k (e_y − e_k)(e_y −
        e_k)ᵀ`` and ``v_n = Σ_{k≠y} (e_y − e_k)/2``; block ``(j, k)`` of ``A`` is
        ``Σ_n M_njk x_n x_nᵀ`` (K(K+1)/2 weighted Gram matrices: a per-row curvature)."""
        yi = self._labels(y)
        if self.bound_name == "one_vs_each":
            a, cc = coef
            n, K, D = X.shape[0], self.n_classes, X.shape[1]
            rows = np.arange(n)
            M = np.zeros((n, K, K))
            idx = np.arange(K)
            M[:, idx, idx] = a
            M[rows, yi, :] -= a
            M[rows, :, yi] -= a
            M[rows, yi, yi] = a.sum(axis=1)
            A = np.empty((K * D, K * D))
            for j in range(K):
                for k in range(j, K):
                    blk = weighted_gram(X, M[:, j, k])
                    A[j * D : (j + 1) * D, k * D : (k + 1) * D] = blk
                    A[k * D : (k + 1) * D, j * D : (j + 1) * D] = blk
            V = np.full((n, K), -0.5)
            V[rows, yi] = 0.5 * (K - 1)
            return BoundStats(A, np.asarray((V.T @ X).ravel(), dtype=np.float64), float(cc.sum()))
        psi, w, lse_w, g, eps = coef
        n = X.shape[0]
        pc = psi - psi.mean(axis=1, keepdims=True)  # (I − 11ᵀ/K) ψ = 2 A_K ψ
        # −lse(ψ) + ψᵀg = Σ_k g_k log g_k, with log g = w − lse(w)
        lg = w - lse_w[:, None]
        c = np.einsum("nk,nk->", g, lg) - 0.25 * np.einsum("nk,nk->", pc, pc) - eps.sum()
        V = 0.5 * pc
        V -= g
        V[np.arange(n), yi] += 1.0
        b = (V.T @ X).ravel()
        A = -0.5 * np.kron(self._A_K, weighted_gram(X))
        return BoundStats(A, np.asarray(b, dtype=np.float64), float(c))

    def mean(self, eta: np.ndarray) -> np.ndarray:
        """Each class's probability, ``softmax(η)`` over the trailing axis."""
        return np.exp(eta - logsumexp(eta, axis=-1, keepdims=True))

    def draw(self, eta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A class label per row, from its probabilities."""
        cum = np.cumsum(self.mean(eta), axis=-1)
        u = rng.random(np.shape(eta)[:-1] + (1,))
        return np.minimum((u > cum).sum(axis=-1), self.n_classes - 1).astype(np.float64)

    def to_dict(self) -> dict:
        """``{"family": "softmax", "link": "softmax", "n_classes": K, "bound": ...}``."""
        return {
            "family": self.name,
            "link": self.link,
            "n_classes": self.n_classes,
            "bound": self.bound_name,
        }


def _poisson(**_: object) -> Family:
    raise ValueError(
        "family 'poisson' with a log link has no quadratic lower bound: its curvature "
        "f''(η) = −e^η is unbounded below, so no constant c(y) bounds it; use "
        "'negative_binomial' (c = (y + r)/4), whose large-r limit is the Poisson"
    )


#: family name -> constructor (keyword arguments: link and the family's parameters)
FAMILIES: dict[str, Callable[..., Family]] = {
    "binomial": BinomialFamily,
    "negative_binomial": NegativeBinomialFamily,
    "gaussian": GaussianFamily,
    "logistic": LogisticFamily,
    "student_t": StudentTFamily,
    "softmax": SoftmaxFamily,
    "poisson": _poisson,
}


def resolve_family(family: str | Family, link: str | None, params: dict[str, Any]) -> Family:
    """The family ``GLM(family, link, **params)`` means: a :class:`Family` object as
    given (then ``link`` and ``params`` must be empty), or one of :data:`FAMILIES` built
    from its name, ``link`` and ``params``; a one-line ``ValueError`` otherwise."""
    if isinstance(family, Family):
        if link is not None or params:
            raise ValueError("link and family parameters go to the family object, not GLM")
        return family
    if not isinstance(family, str) or family not in FAMILIES:
        valid = ", ".join(map(repr, FAMILIES))
        raise ValueError(f"unknown family {family!r}; valid names are {valid}")
    if link is not None:
        params = {**params, "link": link}
    try:
        return FAMILIES[family](**params)
    except TypeError as err:
        raise ValueError(f"bad arguments for family {family!r}: {err}") from err
