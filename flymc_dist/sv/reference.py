"""Independent references for the stochastic-volatility sampler: the Kalman filter and
RTS smoother of the linear-Gaussian state-space model (exact state marginals), and a
bootstrap particle filter's estimate of a panel's marginal log-likelihood.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from flymc_dist._compiled import JIT
from flymc_dist.sv.conditionals import Priors, log_prior

__all__ = ["kalman_smoother", "panel_loglik", "pmmh"]

_LOG2PI = math.log(2.0 * math.pi)


def kalman_smoother(
    x: np.ndarray, phi: float, sigma: float, obs_sd: float
) -> tuple[np.ndarray, np.ndarray]:
    """Exact smoothing marginals of ``h_t ~ N(φ h_{t−1}, σ²)``, ``h_0 = 0``,
    ``x_t ~ N(h_t, r²)``.

    Parameters
    ----------
    x
        One series, ``(T,)``.
    phi, sigma, obs_sd
        φ, σ and the observation sd ``r``.

    Returns
    -------
    mean, var
        ``E[h_t | x_{1:T}]`` and ``Var[h_t | x_{1:T}]``, each ``(T,)``.
    """
    x = np.asarray(x, float)
    T = x.size
    mf, vf, mp, vp = (np.empty(T) for _ in range(4))
    m, v = 0.0, 0.0
    r2 = obs_sd * obs_sd
    for t in range(T):
        mp[t], vp[t] = phi * m, phi * phi * v + sigma * sigma
        k = vp[t] / (vp[t] + r2)
        m, v = mp[t] + k * (x[t] - mp[t]), (1.0 - k) * vp[t]
        mf[t], vf[t] = m, v
    ms, vs = mf.copy(), vf.copy()
    for t in range(T - 2, -1, -1):
        g = vf[t] * phi / vp[t + 1]
        ms[t] = mf[t] + g * (ms[t + 1] - mp[t + 1])
        vs[t] = vf[t] + g * g * (vs[t + 1] - vp[t + 1])
    return ms, vs


@numba.njit(**JIT)
def _pf(x: np.ndarray, phi: float, sigma: float, particles: int, rng: np.random.Generator) -> float:
    S, T = x.shape
    P = particles
    h = np.zeros(P)
    hn = np.empty(P)
    lw = np.empty(P)
    c = np.empty(P)
    total = 0.0
    for s in range(S):
        h[:] = 0.0
        for t in range(T):
            for i in range(P):
                h[i] = phi * h[i] + sigma * rng.standard_normal()
                lw[i] = -0.5 * (_LOG2PI + h[i] + x[s, t] * x[s, t] * math.exp(-h[i]))
            m = lw.max()
            acc = 0.0
            for i in range(P):
                acc += math.exp(lw[i] - m)
                c[i] = acc
            total += m + math.log(acc / P)
            # systematic resampling
            u = rng.random() / P
            j = 0
            for i in range(P):
                target = (u + i / P) * acc
                while j < P - 1 and c[j] <= target:
                    j += 1
                hn[i] = h[j]
            h, hn = hn, h
    return total


def panel_loglik(
    x: np.ndarray, phi: float, sigma: float, *, particles: int = 2000, seed: int = 0
) -> float:
    """A bootstrap particle filter's estimate of ``log p(x | φ, σ)`` for the SV model,
    summed over the panel's independent series.

    Parameters
    ----------
    x
        The panel, ``(series, T)``.
    phi, sigma
        The shared parameters.
    particles
        Particles per series.
    seed
        Seed of the filter's stream (common random numbers across (φ, σ) for a grid).

    Returns
    -------
    float
        The estimate (unbiased on the likelihood scale, so slightly low in logs).
    """
    x = np.ascontiguousarray(x, dtype=np.float64)
    return float(_pf(x, float(phi), float(sigma), int(particles), np.random.default_rng(seed)))


def pmmh(
    x: np.ndarray,
    priors: Priors,
    *,
    n_iter: int,
    particles: int = 200,
    seed: int = 0,
    step: float = 0.1,
    warmup: int = 500,
) -> tuple[np.ndarray, np.ndarray]:
    """Particle-marginal Metropolis–Hastings (Andrieu, Doucet & Holenstein 2010) for the
    panel's (φ, σ): a random walk on ``(logit φ, log σ²)`` accepted with the particle
    filter's likelihood estimate. Exact for any number of particles: a reference that
    shares nothing with particle Gibbs but the model.

    Returns
    -------
    phi, sigma
        ``n_iter`` draws each (after ``warmup`` adapting the step, discarded).
    """
    rng = np.random.default_rng(seed)
    eta = np.array([math.log(0.9 / 0.1), math.log(0.05)])

    def log_target(e: np.ndarray) -> float:
        phi, s2 = 1 / (1 + math.exp(-e[0])), math.exp(e[1])
        lp = log_prior(phi, s2, priors) + math.log(phi) + math.log1p(-phi) + e[1]
        seed_ = int(rng.integers(2**62))
        return lp + panel_loglik(x, phi, math.sqrt(s2), particles=particles, seed=seed_)

    cur = log_target(eta)
    log_step = math.log(step)
    out = np.empty((n_iter, 2))
    for k in range(warmup + n_iter):
        prop = eta + math.exp(log_step) * rng.standard_normal(2)
        new = log_target(prop)
        ok = math.log(rng.random()) < new - cur
        if ok:
            eta, cur = prop, new
        if k < warmup:
            log_step += (float(ok) - 0.25) / math.sqrt(k + 1)
        else:
            out[k - warmup] = (1 / (1 + math.exp(-eta[0])), math.exp(0.5 * eta[1]))
    return out[:, 0], out[:, 1]
