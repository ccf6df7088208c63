"""Independent references for the stochastic-volatility sampler: the Kalman filter and
RTS smoother of the linear-Gaussian state-space model (exact state marginals), and a
bootstrap particle filter's estimate of a panel's marginal log-likelihood.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import logsumexp

__all__ = ["kalman_smoother", "panel_loglik"]


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


def panel_loglik(
    x: np.ndarray, phi: float, sigma: float, *, particles: int = 2000, seed: int = 0
) -> float:
    """A bootstrap particle filter's estimate of ``log p(x | φ, σ)`` for the SV model,
    summed over the panel's independent series (vectorised over series × particles).

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
    x = np.asarray(x, float)
    rng = np.random.default_rng(seed)
    S, T = x.shape
    h = np.zeros((S, particles))
    total = 0.0
    for t in range(T):
        h = phi * h + sigma * rng.standard_normal((S, particles))
        lw = -0.5 * (math.log(2 * math.pi) + h + x[:, t : t + 1] ** 2 * np.exp(-h))
        lse = logsumexp(lw, axis=1)
        total += float(np.sum(lse - math.log(particles)))
        w = np.exp(lw - lse[:, None])
        c = np.cumsum(w, axis=1)
        u = (rng.random((S, 1)) + np.arange(particles)) / particles  # systematic
        idx = np.minimum((c[:, None, :] < u[:, :, None]).sum(axis=2), particles - 1)
        h = np.take_along_axis(h, idx, axis=1)
    return total
