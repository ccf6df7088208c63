"""Independent reference posteriors for the statistical exactness tests.

Nothing here imports ``flymc_dist``: the log-likelihoods are written again from
their textbook formulas (``scipy.stats`` / ``scipy.special``), the MAP and its
Hessian come from ``scipy.optimize`` and central finite differences, and the
posterior moments come from deterministic quadrature on a fine grid — no Markov
chain anywhere. So a bug in the package's models, bounds, kernels or FlyMC
machinery cannot leak into the "truth" the samplers are compared against.

Quadrature: the grid is laid out along the principal axes of the Laplace
approximation, ``theta = theta_map + L u`` with ``L Lᵀ`` the Laplace covariance
and ``u`` on a regular lattice over ``[-width, width]^P`` (``width = 8`` standard
deviations). The (constant) Jacobian cancels in the normalisation, which is done
in log space with ``logsumexp``. For smooth densities with Gaussian-or-lighter
tails the rectangle rule on such a lattice converges faster than any power of
the spacing; :func:`grid_moments` also reports the largest log density on the
boundary of the box relative to the mode, so callers can assert that the box
holds essentially all the mass.

Each data set is a small, fixed, visibly non-Gaussian problem (skewed marginals):

* logistic regression, bias + 1 feature, 50 rows (skewness 0.25 and 0.34);
* robust (Student-t, ν = 4, σ = 1) regression, bias + 1 feature, Laplace prior,
  60 rows of which 5 are outliers (half-accommodated by the t tails: skewed slope);
* softmax regression, K = 3 classes, D = 1 feature (3 parameters), Normal prior
  (which identifies the direction ``θ + c·1`` the likelihood cannot see).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import scipy.optimize
from scipy import special, stats

LogPost = Callable[[np.ndarray], np.ndarray]  # (G, P) -> (G,)


# --------------------------------------------------------------------------------------------
# log posteriors, written independently of the package
# --------------------------------------------------------------------------------------------
def normal_logprior(theta: np.ndarray, scale: float) -> np.ndarray:
    """i.i.d. N(0, scale²) on every component: (G, P) -> (G,)."""
    return stats.norm.logpdf(theta, loc=0.0, scale=scale).sum(axis=-1)


def laplace_logprior(theta: np.ndarray, scale: float) -> np.ndarray:
    """i.i.d. Laplace(0, scale) on every component: (G, P) -> (G,)."""
    return stats.laplace.logpdf(theta, loc=0.0, scale=scale).sum(axis=-1)


def logistic_logpost(X: np.ndarray, y: np.ndarray, prior_scale: float) -> LogPost:
    """``sum_n log Bernoulli(y_n | sigmoid(θᵀx_n)) + log N(θ | 0, s² I)``."""
    X = np.asarray(X, float)
    y = np.asarray(y, float)

    def logpost(theta: np.ndarray) -> np.ndarray:
        theta = np.atleast_2d(theta)
        eta = theta @ X.T  # (G, N)
        # log p(y | eta) = y eta - log(1 + e^eta)
        ll = (y * eta - np.logaddexp(0.0, eta)).sum(axis=1)
        return ll + normal_logprior(theta, prior_scale)

    return logpost


def robust_logpost(
    X: np.ndarray, y: np.ndarray, nu: float, sigma: float, prior_scale: float
) -> LogPost:
    """``sum_n log t_nu(y_n | θᵀx_n, sigma) + log Laplace(θ | 0, b)``.

    The Student-t density written out (``scipy.stats.t.logpdf`` is the same thing,
    checked in the tests, but too slow for 10⁵ grid points × 10² rows).
    """
    X = np.asarray(X, float)
    y = np.asarray(y, float)
    N = y.size
    const = (
        special.gammaln(0.5 * (nu + 1.0))
        - special.gammaln(0.5 * nu)
        - 0.5 * np.log(nu * np.pi)
        - np.log(sigma)
    )

    def logpost(theta: np.ndarray) -> np.ndarray:
        theta = np.atleast_2d(theta)
        r = (y - theta @ X.T) / sigma  # (G, N) standardised residuals
        ll = N * const - 0.5 * (nu + 1.0) * np.log1p(r * r / nu).sum(axis=1)
        return ll + laplace_logprior(theta, prior_scale)

    return logpost


def softmax_logpost(X: np.ndarray, y: np.ndarray, n_classes: int, prior_scale: float) -> LogPost:
    """``sum_n log softmax(Θ x_n)[y_n] + log N(vec Θ | 0, s² I)``.

    Θ is (K, D), flattened row-major (as the package does).
    """
    X = np.asarray(X, float)
    yi = np.asarray(y, int)
    K, D = n_classes, X.shape[1]
    rows = np.arange(X.shape[0])

    def logpost(theta: np.ndarray) -> np.ndarray:
        theta = np.atleast_2d(theta)
        W = theta.reshape(-1, K, D)
        eta = np.einsum("gkd,nd->kgn", W, X)  # (K, G, N): class-major for a cheap lse
        top = eta.max(axis=0)
        lse = top + np.log(np.exp(eta - top).sum(axis=0))
        ll = (eta[yi, :, rows].T - lse).sum(axis=1)
        return ll + normal_logprior(theta, prior_scale)

    return logpost


# --------------------------------------------------------------------------------------------
# mode, curvature, quadrature
# --------------------------------------------------------------------------------------------
def find_map(logpost: LogPost, x0: np.ndarray) -> np.ndarray:
    """Maximise ``logpost`` with Nelder–Mead polished by BFGS (derivative-free start)."""
    f = lambda t: -float(logpost(np.asarray(t, float)[None])[0])  # noqa: E731
    res = scipy.optimize.minimize(
        f,
        np.asarray(x0, float),
        method="Nelder-Mead",
        options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000, "maxfev": 40000},
    )
    res = scipy.optimize.minimize(f, res.x, method="BFGS", options={"gtol": 1e-9})
    return np.asarray(res.x, float)


def numerical_hessian(logpost: LogPost, x: np.ndarray, h: float = 1e-4) -> np.ndarray:
    """Central-difference Hessian of ``logpost`` at ``x`` (one batched evaluation)."""
    x = np.asarray(x, float)
    P = x.size
    E = np.eye(P) * h
    pts = []
    for i in range(P):
        for j in range(P):
            pts += [x + E[i] + E[j], x + E[i] - E[j], x - E[i] + E[j], x - E[i] - E[j]]
    v = logpost(np.array(pts)).reshape(P, P, 4)
    H = (v[..., 0] - v[..., 1] - v[..., 2] + v[..., 3]) / (4 * h * h)
    return 0.5 * (H + H.T)


def laplace_approximation(logpost: LogPost, x0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MAP and the inverse negative Hessian there (the Laplace covariance)."""
    mode = find_map(logpost, x0)
    cov = np.linalg.inv(-numerical_hessian(logpost, mode))
    return mode, 0.5 * (cov + cov.T)


@dataclass
class Moments:
    """Posterior mean and covariance from quadrature, and how much the box may have missed."""

    mean: np.ndarray
    cov: np.ndarray
    boundary_logratio: float  # max log density on the box boundary minus the max inside
    extra: dict = field(default_factory=dict)

    @property
    def sd(self) -> np.ndarray:
        return np.sqrt(np.diag(self.cov))

    @property
    def skewness(self) -> np.ndarray:
        return self.extra.get("skewness", np.full(self.mean.shape, np.nan))


def grid_moments(
    logpost: LogPost,
    center: np.ndarray,
    basis: np.ndarray,
    n: int,
    width: float = 8.0,
    chunk: int = 20000,
) -> Moments:
    """Moments of ``exp(logpost)`` by the rectangle rule on ``center + basis @ u``.

    ``u`` runs over the lattice ``linspace(-width, width, n)^P``. The density is
    normalised with ``logsumexp``; the mean, covariance and marginal skewness are
    accumulated in chunks of ``chunk`` grid points.
    """
    center = np.asarray(center, float)
    basis = np.asarray(basis, float)
    P = center.size
    axis = np.linspace(-width, width, n)
    mesh = np.stack(np.meshgrid(*([axis] * P), indexing="ij"), axis=-1).reshape(-1, P)
    thetas = center + mesh @ basis.T
    logp = np.concatenate([logpost(thetas[i : i + chunk]) for i in range(0, len(thetas), chunk)])
    if not np.all(np.isfinite(logp)):
        raise FloatingPointError("reference log density not finite on the grid")
    on_edge = np.any(np.abs(mesh) >= width - 1e-12, axis=1)
    w = np.exp(logp - special.logsumexp(logp))
    mean = w @ thetas
    d = thetas - mean
    cov = (d * w[:, None]).T @ d
    sd = np.sqrt(np.diag(cov))
    skew = (w @ d**3) / sd**3
    return Moments(
        mean=mean,
        cov=0.5 * (cov + cov.T),
        boundary_logratio=float(logp[on_edge].max() - logp.max()),
        extra={"skewness": skew, "n_points": int(len(thetas))},
    )


def grid_posterior_2d(
    logpost: LogPost, bounds: tuple[tuple[float, float], tuple[float, float]], n: int = 400
) -> tuple[np.ndarray, np.ndarray]:
    """Mean vector and covariance of a 2-parameter posterior on an axis-aligned box.

    Parameters
    ----------
    logpost
        Unnormalised log density, ``(G, 2) -> (G,)``.
    bounds
        ``((lo_0, hi_0), (lo_1, hi_1))``, e.g. the MAP ± 8 Laplace sd.
    n
        Grid points per axis.
    """
    (a0, b0), (a1, b1) = bounds
    center = np.array([(a0 + b0) / 2, (a1 + b1) / 2])
    basis = np.diag([(b0 - a0) / 2, (b1 - a1) / 2])
    m = grid_moments(logpost, center, basis, n, width=1.0)
    return m.mean, m.cov


def laplace_box(
    logpost: LogPost, x0: np.ndarray, width: float = 8.0
) -> tuple[tuple[float, float], ...]:
    """The axis-aligned box MAP ± ``width`` Laplace sd (for :func:`grid_posterior_2d`)."""
    mode, cov = laplace_approximation(logpost, x0)
    sd = np.sqrt(np.diag(cov))
    return tuple(
        (float(m - width * s), float(m + width * s)) for m, s in zip(mode, sd, strict=True)
    )


def rotated_grid_posterior(logpost: LogPost, x0: np.ndarray, n: int, width: float = 8.0) -> Moments:
    """Grid on the principal axes of the Laplace approximation (any dimension, e.g. 70³)."""
    mode, cov = laplace_approximation(logpost, x0)
    return grid_moments(logpost, mode, np.linalg.cholesky(cov), n, width=width)


# --------------------------------------------------------------------------------------------
# the three problems
# --------------------------------------------------------------------------------------------
@dataclass
class Problem:
    """A data set, the package model's settings, and an independent reference posterior."""

    name: str
    X: np.ndarray
    y: np.ndarray
    settings: dict  # constructor arguments of the package's model
    logpost: LogPost
    x0: np.ndarray

    def reference(self, n: int | None = None) -> Moments:
        """Posterior moments by quadrature: 2-D on the box MAP ± 8 Laplace sd (300² points),
        3-D on the Laplace principal axes (60³ points)."""
        if self.x0.size == 2:
            box = laplace_box(self.logpost, self.x0)
            center = np.array([(lo + hi) / 2 for lo, hi in box])
            basis = np.diag([(hi - lo) / 2 for lo, hi in box])
            return grid_moments(self.logpost, center, basis, n or 300, width=1.0)
        return rotated_grid_posterior(self.logpost, self.x0, n or 60)


def logistic_problem(prior_scale: float = 3.0, shift: float = 0.0) -> Problem:
    """50 rows, bias + 1 feature, 62% ones: both marginals right-skewed (0.25, 0.34)."""
    rng = np.random.default_rng(20240611)
    N = 50
    x = rng.normal(size=N)
    X = np.column_stack([np.ones(N), x])
    y = (rng.random(N) < special.expit(1.0 + 1.5 * x)).astype(np.int64)
    X[:, 1] += shift
    return Problem(
        "logistic",
        X,
        y,
        {"prior": "normal", "prior_scale": prior_scale},
        logistic_logpost(X, y, prior_scale),
        np.array([0.5, 1.0]),
    )


def robust_problem(prior_scale: float = 1.0, shift: float = 0.0) -> Problem:
    """60 rows, Student-t (ν = 4, σ = 1) noise, Laplace prior; 5 outliers (+4…+7) at the
    largest x skew the slope (0.23)."""
    rng = np.random.default_rng(20240612)
    N = 60
    nu, sigma = 4.0, 1.0
    x = rng.normal(size=N)
    X = np.column_stack([np.ones(N), x])
    y = 0.5 + 1.0 * x + sigma * rng.standard_t(nu, size=N)
    out = np.argsort(x)[-5:]  # the largest x values get outlying y: a right-skewed slope
    y[out] += rng.uniform(4.0, 7.0, size=out.size)
    y = y + shift
    return Problem(
        "robust",
        X,
        y,
        {"nu": nu, "scale": sigma, "prior": "laplace", "prior_scale": prior_scale},
        robust_logpost(X, y, nu, sigma, prior_scale),
        np.array([0.5, 1.0]),
    )


def softmax_problem(prior_scale: float = 1.5, shift: float = 0.0) -> Problem:
    """100 rows, K = 3, D = 1 (no bias): 3 parameters, Normal prior."""
    rng = np.random.default_rng(20240613)
    N, K = 100, 3
    x = rng.uniform(-2.0, 2.0, size=N)
    X = x[:, None]
    theta = np.array([-1.5, 0.0, 1.5])
    eta = np.outer(x, theta)
    p = np.exp(eta - special.logsumexp(eta, axis=1, keepdims=True))
    y = np.array([rng.choice(K, p=pk) for pk in p], dtype=np.int64)
    X = X + shift
    return Problem(
        "softmax",
        X,
        y,
        {"n_classes": K, "prior": "normal", "prior_scale": prior_scale},
        softmax_logpost(X, y, K, prior_scale),
        np.array([-1.0, 0.0, 1.0]),
    )


PROBLEMS: dict[str, Callable[..., Problem]] = {
    "logistic": logistic_problem,
    "robust": robust_problem,
    "softmax": softmax_problem,
}
