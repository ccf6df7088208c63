"""The shared parameters (φ, σ²) given the states, from the transition statistics
``(S, C, Q, n) = (Σh²_{t−1}, Σh_t h_{t−1}, Σh_t², number of transitions)``.

Given the states the transitions' likelihood is
``(2πσ²)^{−n/2} exp(−(Q − 2φC + φ²S) / (2σ²))``. With ``φ ~ Beta(a_φ, b_φ)`` and
``σ² ~ InvGamma(a_σ, b_σ)``:

* ``σ² | φ, h ~ InvGamma(a_σ + n/2, b_σ + (Q − 2φC + φ²S)/2)`` — drawn exactly.
* ``φ | σ², h ∝ φ^{a_φ−1}(1−φ)^{b_φ−1} N(φ; C/S, σ²/S)`` on ``[0, 1]`` — drawn exactly
  by rejection: with ``a_φ, b_φ ≥ 1`` the Beta factor is log-concave, so its tangent at
  the conditional's mode bounds it above; the proposal is the normal ``N(C/S + v g, v)``
  (``v = σ²/S``, ``g`` the tangent's slope) truncated to ``[0, 1]`` (drawn by inverse
  CDF, :func:`scipy.stats.truncnorm`), accepted with probability
  ``exp(log Beta(φ) − tangent(φ)) ≤ 1``. Near the mode the acceptance is high; it is an
  exact draw whatever it is.

And the paper's subsampled MH over series (:func:`mh_decision`): approximate, with or
without Taylor control variates (:class:`TaylorControlVariate`).

Taylor control variates
-----------------------
In ``u = (φ, ρ)``, ``ρ = log σ²``, series ``i``'s transition log-likelihood is
``ℓ_i(u) = −(n_i/2)(log 2π + ρ) − R_i(φ) e^{−ρ}/2`` with ``R_i(φ) = Q_i − 2φC_i + φ²S_i``.
Its second-order Taylor expansion around a centre ``û``,
``T_i(u) = ℓ_i(û) + g_iᵀ(u − û) + ½(u − û)ᵀH_i(u − û)``, has a gradient ``g_i`` and a
Hessian ``H_i`` linear in the series' statistics, so their sums over all series come from
the summed statistics the shards already send with every sweep (O(1), no series read).
The MH difference ``l_i = ℓ_i(u′) − ℓ_i(u)`` splits into the expansion's change
``ΔT_i = T_i(u′) − T_i(u)``, whose sum over all series is known, and a residual
``l_i − ΔT_i``; the sequential test runs on the residuals against the threshold
``μ₀ − Σ_all ΔT_i / N`` (Bardenet, Doucet & Holmes 2017; Quiroz, Kohn, Villani & Tran
2019) — the wiring of austerity's control variates from the bounds. ``ℓ_i`` is not
quadratic in ``ρ``, so the residuals are not zero: they shrink like ``|u − û|³`` (with
``û`` the chain's point after each sweep, like the cube of the proposal's scale), and with
proposals of posterior scale the series a decision reads stop growing with the number of
series. At ``n = N`` the decision is the exact MH decision, as without them.

This is an approximation kept for the paper's algorithm and for models without a
conjugate structure: **given the states, the exact conditionals above exist and are the
better choice** for this model (they read no series at all and are exact); subsampled MH
stays approximate whenever ``eps > 0``, control variates or not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from scipy.special import betaln, gammaln

from flymc_dist.austerity.sampler import stop_rule

__all__ = [
    "Priors",
    "TaylorControlVariate",
    "log_prior",
    "mh_decision",
    "mh_step",
    "phi_conditional_logpdf",
    "sample_phi",
    "sample_sigma2",
    "series_loglik",
    "taylor_change",
    "taylor_sums",
    "taylor_terms",
]


class Priors(NamedTuple):
    """``φ ~ Beta(phi_a, phi_b)``, ``σ² ~ InvGamma(s2_a, s2_b)``."""

    phi_a: float = 5.0
    phi_b: float = 1.0
    s2_a: float = 5.0
    s2_b: float = 0.05


def log_prior(phi: float, sigma2: float, pr: Priors) -> float:
    """``log p(φ) + log p(σ²)`` (normalised; −inf outside the support)."""
    if not (0.0 < phi < 1.0) or not sigma2 > 0:
        return -math.inf
    lp = (pr.phi_a - 1) * math.log(phi) + (pr.phi_b - 1) * math.log1p(-phi)
    lp -= betaln(pr.phi_a, pr.phi_b)
    lp += pr.s2_a * math.log(pr.s2_b) - gammaln(pr.s2_a)
    lp += -(pr.s2_a + 1) * math.log(sigma2) - pr.s2_b / sigma2
    return lp


def sample_sigma2(rng: np.random.Generator, stats: np.ndarray, phi: float, pr: Priors) -> float:
    """An exact draw of ``σ² | φ, h`` from the summed statistics ``(S, C, Q, n)``."""
    S, C, Q, n = (float(v) for v in stats[:4])
    rss = max(Q - 2.0 * phi * C + phi * phi * S, 0.0)
    shape = pr.s2_a + 0.5 * n
    rate = pr.s2_b + 0.5 * rss
    return rate / rng.gamma(shape)


def _mode(m: float, v: float, a: float, b: float) -> float:
    """The mode on [0, 1] of ``(a−1) log φ + (b−1) log(1−φ) − (φ−m)²/(2v)`` (concave),
    by bisection on its derivative."""

    def d(p: float) -> float:
        return (a - 1) / p - (b - 1) / (1 - p) - (p - m) / v

    lo, hi = 1e-12, 1 - 1e-12
    if d(hi) >= 0:
        return hi
    if d(lo) <= 0:
        return lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if d(mid) > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def phi_conditional_logpdf(phi: np.ndarray, stats: np.ndarray, sigma2: float, pr: Priors):
    """The unnormalised ``log p(φ | σ², h)`` on (0, 1) (for tests and plots)."""
    S, C = float(stats[0]), float(stats[1])
    phi = np.asarray(phi, float)
    return (
        (pr.phi_a - 1) * np.log(phi)
        + (pr.phi_b - 1) * np.log1p(-phi)
        - 0.5 * S / sigma2 * phi * phi
        + C / sigma2 * phi
    )


def sample_phi(
    rng: np.random.Generator,
    stats: np.ndarray,
    sigma2: float,
    pr: Priors,
    *,
    wrong: bool = False,
    max_tries: int = 100_000,
) -> float:
    """An exact draw of ``φ | σ², h`` by rejection from a tangent envelope (module doc).

    ``wrong=True`` draws ``N(C/S, σ²/S)`` truncated to [0, 1], leaving out the Beta
    prior: only the negative control of the tests.
    """
    # imported here, not with the package: scipy.stats adds ~25 MB to every process
    # that imports flymc_dist, Dask workers included (tests/test_imports.py)
    from scipy.stats import truncnorm

    if pr.phi_a < 1 or pr.phi_b < 1:
        raise ValueError("the exact φ draw needs a log-concave Beta prior (phi_a, phi_b >= 1)")
    S, C = float(stats[0]), float(stats[1])
    if S <= 0:  # no transition informs φ: its prior
        return float(rng.beta(pr.phi_a, pr.phi_b))
    m, v = C / S, sigma2 / S
    a, b = pr.phi_a, pr.phi_b
    p0 = _mode(m, v, a, b)
    g = (a - 1) / p0 - (b - 1) / (1 - p0)
    mu = m if wrong else m + v * g
    sd = math.sqrt(v)
    lo, hi = (0.0 - mu) / sd, (1.0 - mu) / sd
    lt0 = (a - 1) * math.log(p0) + (b - 1) * math.log1p(-p0)
    for _ in range(max_tries):
        phi = float(truncnorm.rvs(lo, hi, loc=mu, scale=sd, random_state=rng))
        phi = min(max(phi, 1e-300), 1 - 1e-16)
        if wrong:
            return phi
        lbeta = (a - 1) * math.log(phi) + (b - 1) * math.log1p(-phi)
        if math.log(rng.random()) < lbeta - (lt0 + g * (phi - p0)):
            return phi
    raise RuntimeError(f"the φ rejection sampler did not accept in {max_tries} tries")


def series_loglik(stats: np.ndarray, phi: float, sigma2: float) -> np.ndarray:
    """Each series' transition log-likelihood from its rows of ``(S, C, Q, n)``."""
    st = np.atleast_2d(stats)
    rss = st[:, 2] - 2.0 * phi * st[:, 1] + phi * phi * st[:, 0]
    return -0.5 * st[:, 3] * math.log(2 * math.pi * sigma2) - 0.5 * rss / sigma2


def taylor_terms(stats: np.ndarray, centre: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """Gradient and Hessian of ``ℓ_i`` in ``u = (φ, log σ²)`` at ``centre = (φ̂, σ̂²)``.

    Parameters
    ----------
    stats
        ``(..., 4)`` statistics ``(S, C, Q, n)``: of single series, or summed (both are
        linear in them, so the terms of summed statistics are the summed terms).
    centre
        ``(φ̂, σ̂²)``.

    Returns
    -------
    grad, hess
        ``(..., 2)`` and ``(..., 2, 2)``.
    """
    st = np.asarray(stats, float)
    phi, s2 = float(centre[0]), float(centre[1])
    S, C, Q, n = st[..., 0], st[..., 1], st[..., 2], st[..., 3]
    w = 1.0 / s2
    lin = (C - phi * S) * w  # −R′(φ)/2 · e^{−ρ}
    half_r = 0.5 * (Q - 2.0 * phi * C + phi * phi * S) * w
    grad = np.stack([lin, half_r - 0.5 * n], axis=-1)
    hess = np.stack(
        [np.stack([-S * w, -lin], axis=-1), np.stack([-lin, -half_r], axis=-1)], axis=-2
    )
    return grad, hess


def taylor_change(
    grad: np.ndarray,
    hess: np.ndarray,
    centre: tuple[float, float],
    cur: tuple[float, float],
    prop: tuple[float, float],
) -> np.ndarray:
    """``T(u′) − T(u)`` of the quadratic expansion with ``grad``, ``hess`` at ``centre``
    (points as ``(φ, σ²)``; broadcast over the leading axes of ``grad`` and ``hess``)."""
    c = np.array([centre[0], math.log(centre[1])])
    d = np.array([cur[0], math.log(cur[1])]) - c
    dp = np.array([prop[0], math.log(prop[1])]) - c
    quad = np.einsum("...ij,i,j->...", hess, dp, dp) - np.einsum("...ij,i,j->...", hess, d, d)
    return grad @ (dp - d) + 0.5 * quad


class TaylorControlVariate(NamedTuple):
    """The expansion's centre ``(φ̂, σ̂²)`` and its gradient and Hessian summed over all
    series (:func:`taylor_sums`)."""

    centre: tuple[float, float]
    grad: np.ndarray  # (2,)
    hess: np.ndarray  # (2, 2)

    def total_change(self, cur: tuple[float, float], prop: tuple[float, float]) -> float:
        """``Σ_all (T_i(u′) − T_i(u))``: no series read."""
        return float(taylor_change(self.grad, self.hess, self.centre, cur, prop))

    def series_change(
        self, stats: np.ndarray, cur: tuple[float, float], prop: tuple[float, float]
    ) -> np.ndarray:
        """``T_i(u′) − T_i(u)`` of the series with statistics ``stats`` ``(k, 4)``."""
        g, h = taylor_terms(np.atleast_2d(stats), self.centre)
        return taylor_change(g, h, self.centre, cur, prop)


def taylor_sums(stats: np.ndarray, centre: tuple[float, float]) -> TaylorControlVariate:
    """The control variate centred at ``centre = (φ̂, σ̂²)`` from the statistics summed
    over all series ``(S, C, Q, n)`` (once per sweep, on the driver)."""
    st = np.asarray(stats, float)[:4]
    if st.shape != (4,):
        raise ValueError(f"stats must hold the summed (S, C, Q, n), got shape {st.shape}")
    if not (0.0 < centre[0] < 1.0 and centre[1] > 0):
        raise ValueError(f"centre must be (phi in (0, 1), sigma2 > 0), got {centre}")
    g, h = taylor_terms(st, centre)
    return TaylorControlVariate((float(centre[0]), float(centre[1])), g, h)


class MHDecision(NamedTuple):
    """One subsampled MH decision: accepted, series read, test rounds."""

    accept: bool
    series_read: int
    rounds: int


def mh_decision(
    rng: np.random.Generator,
    fetch: Callable[[np.ndarray], np.ndarray],
    n_series: int,
    cur: tuple[float, float],
    prop: tuple[float, float],
    mu0: float,
    *,
    eps: float,
    batch_size: int,
    control: TaylorControlVariate | None = None,
) -> MHDecision:
    """The sequential MH test with a *series* as the unit (approximate for ``eps > 0``;
    ``eps = 0`` reads every series and is exact MH).

    Accept iff the mean over all series of ``l_i = ℓ_i(θ′) − ℓ_i(θ)`` exceeds ``mu0``,
    judged from series drawn without replacement in batches of ``batch_size``, stopping by
    :func:`flymc_dist.austerity.sampler.stop_rule`. With a ``control`` variate the test
    runs on the residuals ``l_i − ΔT_i`` against ``mu0 − Σ_all ΔT_i / N`` (module doc):
    the same decision once every series is read, the same series drawn.

    Parameters
    ----------
    fetch
        ``fetch(indices) -> (len(indices), 4)`` statistics of those global series.
    control
        The Taylor control variate of the current sweep (None: the plain test).
    """
    if control is not None:
        mu0 = mu0 - control.total_change(cur, prop) / n_series
    used = np.zeros(0, dtype=np.int64)
    taken: set[int] = set()
    n, mean, m2 = 0, 0.0, 0.0
    rounds = 0
    while True:
        need = min(batch_size, n_series - n)
        if n + need > n_series // 2:
            rest = np.setdiff1d(np.arange(n_series), used, assume_unique=False)
            new = rng.permutation(rest)[:need]
        else:
            new = np.zeros(0, dtype=np.int64)
            while new.size < need:
                cand = rng.integers(0, n_series, size=2 * (need - new.size))
                keep = []
                for c in cand.tolist():
                    if c not in taken:
                        taken.add(c)
                        keep.append(c)
                        if new.size + len(keep) == need:
                            break
                new = np.concatenate([new, np.asarray(keep, dtype=np.int64)])
        taken.update(new.tolist())
        used = np.concatenate([used, new])
        st = fetch(new)
        li = series_loglik(st, prop[0], prop[1]) - series_loglik(st, cur[0], cur[1])
        if control is not None:
            li = li - control.series_change(st, cur, prop)
        # Chan et al.'s merge of (n, mean, M2)
        nb, mb = li.size, float(li.mean())
        m2b = float(np.sum((li - mb) ** 2))
        tot = n + nb
        delta = mb - mean
        mean = mean + delta * nb / tot
        m2 = m2 + m2b + delta * delta * n * nb / tot
        n = tot
        rounds += 1
        stop, acc, _ = stop_rule(
            np.array([n]), np.array([mean]), np.array([m2]), np.array([mu0]), n_series, eps
        )
        if bool(stop[0]):
            return MHDecision(bool(acc[0]), n, rounds)


class MHStep(NamedTuple):
    """One subsampled MH step: the new ``(φ, σ²)``, accepted, series read."""

    point: tuple[float, float]
    accept: bool
    series_read: int


def _log_target_prior(phi: float, s2: float, pr: Priors) -> float:
    """The prior on ``(logit φ, log σ²)`` (with the Jacobian)."""
    return log_prior(phi, s2, pr) + math.log(phi) + math.log1p(-phi) + math.log(s2)


def mh_step(
    rng: np.random.Generator,
    cur: tuple[float, float],
    step: float,
    fetch: Callable[[np.ndarray], np.ndarray],
    n_series: int,
    pr: Priors,
    *,
    eps: float,
    batch_size: int,
    control: TaylorControlVariate | None = None,
) -> MHStep:
    """One subsampled MH step on ``(φ, σ²)``: a Gaussian random walk of sd ``step`` on
    ``(logit φ, log σ²)`` accepted by :func:`mh_decision` (approximate for ``eps > 0``).

    Draws from ``rng``, in order: two standard normals (the move), one uniform, then the
    decision's series.

    Parameters
    ----------
    cur
        The current ``(φ, σ²)``.
    fetch, n_series, eps, batch_size, control
        As :func:`mh_decision`.
    pr
        The priors.
    """
    phi, s2 = cur
    eta = np.array([math.log(phi / (1 - phi)), math.log(s2)])
    prop = eta + step * rng.standard_normal(2)
    phi_p = 1.0 / (1.0 + math.exp(-prop[0]))
    s2_p = math.exp(prop[1])
    log_u = math.log(rng.random())
    if not (0.0 < phi_p < 1.0 and s2_p > 0):  # a move rounded onto the boundary
        return MHStep((phi, s2), False, 0)
    mu0 = (log_u + _log_target_prior(phi, s2, pr) - _log_target_prior(phi_p, s2_p, pr)) / n_series
    d = mh_decision(
        rng,
        fetch,
        n_series,
        (phi, s2),
        (phi_p, s2_p),
        mu0,
        eps=eps,
        batch_size=batch_size,
        control=control,
    )
    if d.accept:
        return MHStep((phi_p, s2_p), True, d.series_read)
    return MHStep((phi, s2), False, d.series_read)
