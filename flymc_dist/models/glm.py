"""Generalised linear models whose bounds follow from a curvature bound (DESIGN.md §5).

A *family* gives one datum's log-likelihood ``f(η; y)`` as a function of its linear
predictor ``η = xᵀθ``, its derivative ``f'`` and a curvature bound ``c(y) > 0`` with
``f''(η; y) ≥ −c(y)`` for every ``η``. Then

    B(η) = f(ξ) + f'(ξ) (η − ξ) − ½ c (η − ξ)²  ≤  f(η),

tight at ``η = ξ``, is a quadratic in ``η`` and so in ``θ``:
``β = q₂ η² + q₁ η + q₀`` with ``q₂ = −c/2``, ``q₁ = f'(ξ) + c ξ`` and
``q₀ = f(ξ) − f'(ξ) ξ − ½ c ξ² − ε``. Over many rows it collapses to
``Σ q₂ x xᵀ``, ``Σ q₁ x`` and ``Σ q₀`` (:meth:`GLM.suffstats`). Everything a model
needs — the bound, its collapsed statistics, the compiled ``log L̃`` and its gradient —
is derived here from the family, once.

Families split ``f = core(η; y) + base(y)``: ``base`` (a normalising constant) cancels
in ``ℓ − β``, so the compiled ``log L̃`` and the bound work with ``core`` alone.

Built in: binomial with ``m`` trials (logit link, ``c = m/4``; probit link, ``c = m``),
negative binomial with log link and fixed dispersion ``r`` (``c = (y + r)/4``),
Gaussian with fixed noise sd ``σ`` (``c = 1/σ²``: the bound is the likelihood, so no
row is ever bright). Poisson with a log link has no such bound (``f'' = −e^η`` is
unbounded below) and is refused. :class:`CustomFamily` takes a user's ``f``, ``f'``
and curvature, and checks the bound numerically when tight points are set.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy.special import erfc, gammaln, ndtri

from flymc_dist._numerics import BOUND_EPS, weighted_gram
from flymc_dist.models.base import BoundStats, Model
from flymc_dist.models.priors import Prior, PriorMixin

__all__ = [
    "FAMILIES",
    "GLM",
    "BinomialFamily",
    "CustomFamily",
    "Family",
    "GaussianFamily",
    "NegativeBinomialFamily",
    "bound_coefficients",
    "log_ndtr",
]

#: compiled family ids (:mod:`flymc_dist._compiled`, kind ``"glm"``, ``par[0]``)
BINOMIAL_LOGIT = 0
BINOMIAL_PROBIT = 1
NEGATIVE_BINOMIAL = 2
GAUSSIAN = 3

_LOG_2PI = math.log(2.0 * math.pi)
#: below this, log Φ(x) uses its asymptotic series (erfc(−x/√2) nears underflow)
_NDTR_TAIL = -37.0
#: how far a custom family's bound is checked beyond the data's η range, in units of
#: that range (at least 1 in η either side)
CHECK_WIDEN = 0.5
#: points per row in a custom family's check
CHECK_POINTS = 65


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


# ----- families ----------------------------------------------------------------------
class Family(ABC):
    """One datum's log-likelihood as a function of its linear predictor, with a
    curvature bound: what :class:`GLM` derives a model from.

    Subclasses give :meth:`core` (``f`` without its ``y``-only constant, and ``f'``),
    :meth:`base` (that constant), :meth:`curvature` (``c(y)`` with
    ``f'' ≥ −c(y)`` everywhere), :meth:`validate_targets` and :meth:`untuned_xi`.
    """

    #: family name, e.g. ``"binomial"``
    name: str
    #: link function's name
    link: str
    #: ``f`` is concave in ``η`` (the MAP search may start anywhere)
    log_concave: bool = True
    #: the bound is checked numerically wherever tight points are set (user families)
    checked: bool = False

    @property
    def task(self) -> str:
        """The data task it fits: ``"binary"``, ``"count"`` or ``"real"``."""
        return "real"

    @abstractmethod
    def validate_targets(self, y: np.ndarray) -> None:
        """Raise ``ValueError`` naming the first row whose target the family cannot have."""

    @abstractmethod
    def core(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(f − base(y), f')`` at ``eta`` (broadcasting with ``y``)."""

    @abstractmethod
    def core_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``f''`` at ``eta`` (MAP search)."""

    def base(self, y: np.ndarray) -> np.ndarray:
        """The part of ``f`` that depends on ``y`` alone (default 0)."""
        return np.zeros(np.shape(y))

    @abstractmethod
    def curvature(self, y: np.ndarray) -> np.ndarray:
        """``c(y) > 0`` with ``f''(η; y) ≥ −c(y)`` for every ``η``."""

    @abstractmethod
    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """Tight points without a parameter estimate: an ``η`` that fits ``y``."""

    def compiled(self) -> np.ndarray | None:
        """``par`` of the compiled ``log L̃`` (``par[0]`` the family id), or None."""
        return None

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
        if link not in ("logit", "probit"):
            raise ValueError(f"binomial link must be 'logit' or 'probit', got {link!r}")
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

    def compiled(self) -> np.ndarray:
        """``(BINOMIAL_LOGIT or BINOMIAL_PROBIT, m)``."""
        fid = BINOMIAL_LOGIT if self.link == "logit" else BINOMIAL_PROBIT
        return np.array([fid, float(self.trials)])

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
        if link != "log":
            raise ValueError(f"negative_binomial link must be 'log', got {link!r}")
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

    def compiled(self) -> np.ndarray:
        """``(NEGATIVE_BINOMIAL, r, log r)``."""
        return np.array([NEGATIVE_BINOMIAL, self.dispersion, self._log_r])

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
        if link != "identity":
            raise ValueError(f"gaussian link must be 'identity', got {link!r}")
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

    def compiled(self) -> np.ndarray:
        """``(GAUSSIAN, 1/σ²)``."""
        return np.array([GAUSSIAN, self._prec])

    def to_dict(self) -> dict:
        """``{"family": "gaussian", "link": "identity", "scale": σ}``."""
        return {"family": self.name, "link": self.link, "scale": self.scale}


class CustomFamily(Family):
    """A user's family: ``f(η, y)`` and ``f'(η, y)`` as numba-compilable functions of two
    floats, and a curvature constant ``c > 0`` with ``f''(η, y) ≥ −c`` for every ``η``.

    The functions are compiled to numpy ufuncs (numba ``vectorize``) in each process
    that uses them. Wherever tight points are set, :class:`GLM` checks ``B ≤ f`` for
    every row on a grid over the data's ``η`` range at those points, widened by
    :data:`CHECK_WIDEN` of it (at least 1) either side, and refuses a violation naming
    the row, ``η`` and ``y``. The compiled hot path is not used: shards evaluate these
    ufuncs.

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
    "poisson": _poisson,
}


def bound_coefficients(
    family: Family, y: np.ndarray, xi: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q₂, q₁, q₀)`` of the bound on ``core`` tight at ``xi``:
    ``β_core = q₂ η² + q₁ η + q₀ ≤ core(η)``. ``q₀`` includes the margin
    ``−BOUND_EPS (1 + |f(ξ)| + |f'(ξ) ξ| + c ξ²/2)``.

    Parameters
    ----------
    family
        The family.
    y, xi
        Targets and tight points, shape (n,).

    Returns
    -------
    tuple of numpy.ndarray
        Each (n,).
    """
    y = np.asarray(y, dtype=np.float64)
    xi = np.asarray(xi, dtype=np.float64)
    f0, g0 = family.core(xi, y)
    c = family.curvature(y)
    gx = g0 * xi
    cx2 = 0.5 * c * xi * xi
    q0 = f0 - gx - cx2
    q0 -= BOUND_EPS * (1.0 + np.abs(f0) + np.abs(gx) + cx2)
    return -0.5 * c, g0 + c * xi, q0


def _family(family: str | Family, link: str | None, params: dict[str, Any]) -> Family:
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


class GLM(PriorMixin, Model):
    """A generalised linear model ``y_n ~ family(η_n)``, ``η_n = θᵀx_n``, with the
    family's curvature bound as FlyMC's bound (MAP-tuned: tight at ``η̂_n = θ̂ᵀx_n``).

    Parameters
    ----------
    family
        ``"binomial"``, ``"negative_binomial"``, ``"gaussian"`` (``"poisson"`` is refused,
        saying why), or a :class:`Family` object (e.g. a :class:`CustomFamily`).
    link
        The family's link (default: ``"logit"`` for binomial, ``"log"``, ``"identity"``).
    prior
        ``"normal"`` (default), ``"laplace"`` or ``"flat"``.
    prior_scale
        Prior sd (normal) or scale ``b`` (Laplace); > 0.
    **family_params
        The family's parameters: ``trials`` (binomial), ``dispersion``
        (negative binomial), ``scale`` (Gaussian).
    """

    name = "glm"

    def __init__(
        self,
        family: str | Family,
        link: str | None = None,
        prior: str = "normal",
        prior_scale: float = 1.0,
        **family_params: Any,
    ) -> None:
        self.family = _family(family, link, family_params)
        self._prior = Prior(prior, prior_scale)
        self.log_concave = self.family.log_concave

    @property
    def task(self) -> str:  # type: ignore[override]
        """The family's task."""
        return self.family.task

    @property
    def n_outputs(self) -> int:
        """E = 1."""
        return 1

    @property
    def xi_shape(self) -> tuple[int, ...]:
        """One tight point (a linear predictor) per datum: ``()``."""
        return ()

    def validate_targets(self, y: np.ndarray) -> None:
        """The family's check of ``y``."""
        self.family.validate_targets(y)

    # ----- likelihood ---------------------------------------------------------
    def loglik(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``f(η; y)``: (B, n, 1) -> (B, n)."""
        yv = np.asarray(y, dtype=np.float64)
        return self.family.core(np.asarray(eta, dtype=np.float64)[..., 0], yv)[0] + (
            self.family.base(yv)
        )

    def loglik_grad(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(f, f')``: shapes (B, n) and (B, n, 1)."""
        yv = np.asarray(y, dtype=np.float64)
        f, g = self.family.core(np.asarray(eta, dtype=np.float64)[..., 0], yv)
        return f + self.family.base(yv), g[..., None]

    def loglik_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``f''``: (n, 1) -> (n, 1, 1)."""
        e = np.asarray(eta, dtype=np.float64)[:, 0]
        return self.family.core_hess(e, np.asarray(y, dtype=np.float64))[:, None, None]

    # ----- bound --------------------------------------------------------------
    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """The family's untuned tight points: shape (n,)."""
        xi = self.family.untuned_xi(y)
        if self.family.checked:
            self.check_bound(y, xi)
        return xi

    def tuned_xi(self, eta_hat: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``ξ_n = η̂_n``: (n, 1) -> (n,)."""
        xi = np.asarray(eta_hat, dtype=np.float64)[:, 0].copy()
        if self.family.checked:
            self.check_bound(y, xi)
        return xi

    def check_bound(self, y: np.ndarray, xi: np.ndarray) -> None:
        """Check ``B_ξ(η) ≤ f(η)`` for every row on :data:`CHECK_POINTS` values of ``η``
        spanning ``[min ξ − w, max ξ + w]``, ``w = max(1, CHECK_WIDEN · (max ξ − min ξ))``.

        Raises
        ------
        ValueError
            Naming the first row, ``η`` and ``y`` where the bound exceeds ``f`` by more
            than rounding.
        """
        y = np.asarray(y, dtype=np.float64)
        xi = np.asarray(xi, dtype=np.float64)
        if y.size == 0:
            return
        lo, hi = float(xi.min()), float(xi.max())
        w = max(1.0, CHECK_WIDEN * (hi - lo))
        grid = np.linspace(lo - w, hi + w, CHECK_POINTS)
        for s in range(0, y.size, 4096):
            yb, xb = y[s : s + 4096], xi[s : s + 4096]
            q2, q1, q0 = bound_coefficients(self.family, yb, xb)
            eta = np.concatenate([grid[None, :].repeat(yb.size, 0), xb[:, None]], axis=1)
            f = self.family.core(eta, yb[:, None])[0]
            beta = (q2[:, None] * eta + q1[:, None]) * eta + q0[:, None]
            tol = 1e-9 * (1.0 + np.abs(f) + np.abs(beta))
            bad = ~(beta - f <= tol)  # NaN is a violation too
            if bad.any():
                i, j = np.unravel_index(int(np.argmax(bad)), bad.shape)
                raise ValueError(
                    f"family {self.family.name!r}: its bound exceeds f at row {s + i} "
                    f"(eta = {eta[i, j]!r}, y = {yb[i]!r}, tight at {xb[i]!r}): "
                    f"B - f = {beta[i, j] - f[i, j]!r}; the curvature {self.family.name!r} "
                    f"declares is too small (or f' is not the derivative of f)"
                )

    def _coefficients(self, y: np.ndarray, xi: np.ndarray) -> tuple[np.ndarray, ...]:
        return bound_coefficients(self.family, y, xi)

    def logbound(self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray) -> np.ndarray:
        """``β = q₂ η² + q₁ η + q₀ + base(y)``: (B, n, 1) -> (B, n)."""
        return self.logbound_grad(eta, y, xi)[0]

    def logbound_grad(
        self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(β, dβ/dη = 2 q₂ η + q₁)``."""
        yv = np.asarray(y, dtype=np.float64)
        q2, q1, q0 = self._coefficients(yv, xi)
        e = np.asarray(eta, dtype=np.float64)[..., 0]
        with np.errstate(over="ignore", invalid="ignore"):
            beta = q2 * e * e + q1 * e + q0
        beta += self.family.base(yv)
        return beta, (2.0 * q2 * e + q1)[..., None]

    def row_constants(self, y: np.ndarray, xi: np.ndarray) -> np.ndarray | None:
        """Columns ``y``, ``q₁`` and ``q₀`` (the curvature follows from ``y``), or None
        for a family without a compiled form."""
        if self.family.compiled() is None:
            return None
        _, q1, q0 = self._coefficients(y, xi)
        return np.column_stack([np.asarray(y, dtype=np.float64), q1, q0])

    def compiled_bright(self) -> tuple[str, np.ndarray] | None:
        """``("glm", family parameters)``, or None (a custom family)."""
        par = self.family.compiled()
        return None if par is None else ("glm", par)

    def suffstats(self, X: np.ndarray, y: np.ndarray, xi: np.ndarray) -> BoundStats:
        """``A = Σ q₂ x xᵀ``, ``b = Σ q₁ x``, ``c = Σ (q₀ + base(y))``."""
        X = np.asarray(X)
        if X.ndim != 2 or np.shape(y) != (X.shape[0],) or np.shape(xi) != (X.shape[0],):
            raise ValueError(
                f"suffstats needs X (n, D), y (n,), xi (n,); got {X.shape}, "
                f"{np.shape(y)}, {np.shape(xi)}"
            )
        yv = np.asarray(y, dtype=np.float64)
        q2, q1, q0 = self._coefficients(yv, xi)
        const = float(q0.sum() + self.family.base(yv).sum())
        return BoundStats(weighted_gram(X, q2), np.asarray(q1 @ X, dtype=np.float64), const)

    # ----- serialisation ------------------------------------------------------
    def to_dict(self) -> dict:
        """``{"name": "glm", "family": ..., "link": ..., <parameters>, "prior": ...}``."""
        return {"name": self.name, **self.family.to_dict(), **self._prior.to_dict()}

    def __repr__(self) -> str:
        d = self.family.to_dict()
        args = ", ".join(f"{k}={v!r}" for k, v in d.items())
        return f"GLM({args}, prior={self.prior!r}, prior_scale={self.prior_scale!r})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return False
        if isinstance(self.family, CustomFamily) or isinstance(other.family, CustomFamily):
            return self.family is other.family and self._prior.to_dict() == other._prior.to_dict()
        return other.to_dict() == self.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.to_dict().items())))
