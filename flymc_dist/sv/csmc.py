"""Conditional SMC with ancestor sampling (CSMC-AS; Lindsten, Jordan & Schön 2014) for
every series of a block, vectorised over series (one compiled loop over series, arrays
of particles per time step).

The state model is ``h_t ~ N(φ h_{t−1}, σ²)`` with ``h_0 = 0``; the observation density
is the stochastic-volatility one, ``x_t ~ N(0, exp(h_t))`` (:data:`OBS_SV`), or a
Gaussian ``x_t ~ N(h_t, r²)`` (:data:`OBS_GAUSS`, the linear-Gaussian model the tests
compare with the Kalman/RTS smoother).

One sweep of a series, given its reference path ``h*``: particle ``P − 1`` is the
reference at every step; the others are propagated from multinomially resampled
ancestors; the reference's ancestor is drawn with weights
``w_{t−1}^j · N(h*_t; φ h_{t−1}^j, σ²)`` (ancestor sampling); the new path is traced
back from a particle drawn by its final weight. This is a Markov kernel leaving the
smoothing distribution ``p(h_{1:T} | x_{1:T}, φ, σ)`` invariant.

Random numbers are keyed by (seed, chain, iteration, purpose) and the *global series
index*: series ``s`` uses the uniforms of rows ``s·K … s·K + K − 1`` of the counter-based
stream :func:`flymc_dist.streams.stream_key` (``K = uniforms_per_series(T, P)``), so a
series' draws do not depend on which shard holds it nor on the series beside it.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from flymc_dist._compiled import JIT
from flymc_dist.streams import stream_key, uniforms_range

__all__ = [
    "AS_RIGHT",
    "AS_WRONG",
    "OBS_GAUSS",
    "OBS_SV",
    "PURPOSE_CSMC",
    "csmc_sweep",
    "series_stats",
    "uniforms_per_series",
]

#: observation densities
OBS_SV = 0  # x_t ~ N(0, exp(h_t))
OBS_GAUSS = 1  # x_t ~ N(h_t, r²)
#: ancestor-sampling weights: the right ones, or w_{t−1} alone (a negative control)
AS_RIGHT = 0
AS_WRONG = 1
#: the stream purpose of a sweep (streams' z-update purposes are 1–4)
PURPOSE_CSMC = 5

_LOG2PI = math.log(2.0 * math.pi)


def uniforms_per_series(length: int, particles: int) -> int:
    """Uniforms one sweep of one series uses: Box–Muller pairs for the ``T(P−1)``
    propagation normals, ``(T−1)(P−1)`` resampling, ``T−1`` ancestor, one final."""
    n_norm = length * (particles - 1)
    return 2 * ((n_norm + 1) // 2) + (length - 1) * (particles - 1) + (length - 1) + 1


@numba.njit(inline="always", **JIT)
def _normal(u: np.ndarray, j: int) -> float:
    a = u[2 * (j // 2)]
    b = u[2 * (j // 2) + 1]
    rad = math.sqrt(-2.0 * math.log1p(-a))
    if j % 2 == 0:
        return rad * math.cos(2.0 * math.pi * b)
    return rad * math.sin(2.0 * math.pi * b)


@numba.njit(inline="always", **JIT)
def _obs(x: float, h: float, obs: int, r: float) -> float:
    if obs == OBS_SV:
        return -0.5 * (_LOG2PI + h + x * x * math.exp(-h))
    d = x - h
    return -0.5 * (_LOG2PI + 2.0 * math.log(r) + d * d / (r * r))


@numba.njit(inline="always", **JIT)
def _pick(cdf: np.ndarray, u: float) -> int:
    """The first index whose cumulative weight exceeds ``u · total``."""
    target = u * cdf[cdf.size - 1]
    lo, hi = 0, cdf.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cdf[mid] > target:
            hi = mid
        else:
            lo = mid + 1
    return lo


@numba.njit(**JIT)
def _csmc_block(
    x: np.ndarray,
    href: np.ndarray,
    phi: float,
    sigma: float,
    u: np.ndarray,
    n_part: int,
    obs: int,
    r: float,
    as_mode: int,
    out: np.ndarray,
) -> None:
    S, T = x.shape
    P = n_part
    Q = P - 1
    part = np.empty((T, P))
    anc = np.zeros((T, P), dtype=np.int64)
    logw = np.empty(P)
    cdf = np.empty(P)
    n_norm = T * Q
    off_res = 2 * ((n_norm + 1) // 2)
    off_as = off_res + (T - 1) * Q
    off_fin = off_as + (T - 1)
    inv2s2 = 0.5 / (sigma * sigma)
    for s in range(S):
        us = u[s]
        for i in range(Q):
            part[0, i] = sigma * _normal(us, i)
        part[0, Q] = href[s, 0]
        for i in range(P):
            logw[i] = _obs(x[s, 0], part[0, i], obs, r)
        for t in range(1, T):
            m = logw.max()
            acc = 0.0
            for i in range(P):
                acc += math.exp(logw[i] - m)
                cdf[i] = acc
            for i in range(Q):
                a = _pick(cdf, us[off_res + (t - 1) * Q + i])
                anc[t, i] = a
                part[t, i] = phi * part[t - 1, a] + sigma * _normal(us, t * Q + i)
            hr = href[s, t]
            part[t, Q] = hr
            # ancestor sampling for the reference
            if as_mode == AS_RIGHT:
                for j in range(P):
                    d = hr - phi * part[t - 1, j]
                    cdf[j] = logw[j] - d * d * inv2s2
            else:
                for j in range(P):
                    cdf[j] = logw[j]
            m2 = cdf.max()
            acc = 0.0
            for j in range(P):
                acc += math.exp(cdf[j] - m2)
                cdf[j] = acc
            anc[t, Q] = _pick(cdf, us[off_as + t - 1])
            for i in range(P):
                logw[i] = _obs(x[s, t], part[t, i], obs, r)
        m = logw.max()
        acc = 0.0
        for i in range(P):
            acc += math.exp(logw[i] - m)
            cdf[i] = acc
        k = _pick(cdf, us[off_fin])
        for t in range(T - 1, -1, -1):
            out[s, t] = part[t, k]
            k = anc[t, k]


def csmc_sweep(
    x: np.ndarray,
    href: np.ndarray,
    phi: float,
    sigma: float,
    *,
    seed: int,
    chain: int,
    iteration: int,
    first_series: int,
    particles: int,
    obs: int = OBS_SV,
    obs_sd: float = 1.0,
    ancestor: int = AS_RIGHT,
    block: int = 256,
) -> np.ndarray:
    """One CSMC-AS sweep of every series of ``x`` given the reference paths ``href``.

    Parameters
    ----------
    x, href
        Observations and reference states, ``(series, T)``; series ``i`` is global
        series ``first_series + i``.
    phi, sigma
        The state model's autoregression and innovation sd.
    seed, chain, iteration
        Key the random numbers (with the global series index).
    first_series
        Global index of ``x``'s first series.
    particles
        Particles per series (at least 2).
    obs, obs_sd
        Observation density (:data:`OBS_SV` or :data:`OBS_GAUSS` with sd ``obs_sd``).
    ancestor
        :data:`AS_RIGHT`; :data:`AS_WRONG` only as a negative control in tests.
    block
        Series per call of the compiled loop (bounds the uniforms held at once; does
        not change the draws).

    Returns
    -------
    numpy.ndarray
        The new paths, ``(series, T)``.
    """
    x = np.ascontiguousarray(x, dtype=np.float64)
    href = np.ascontiguousarray(href, dtype=np.float64)
    if x.ndim != 2 or href.shape != x.shape:
        raise ValueError(
            f"x and href must be (series, T) of one shape; got {x.shape}, {href.shape}"
        )
    if int(particles) < 2:
        raise ValueError(f"particles must be >= 2, got {particles}")
    if not (sigma > 0 and math.isfinite(sigma) and math.isfinite(phi)):
        raise ValueError(f"sigma must be > 0 and phi finite; got phi={phi}, sigma={sigma}")
    S, T = x.shape
    K = uniforms_per_series(T, int(particles))
    key = stream_key(seed, 0, chain, iteration, PURPOSE_CSMC)
    out = np.empty_like(x)
    for a in range(0, S, block):
        b = min(S, a + block)
        u = uniforms_range(key, (first_series + a) * K, (b - a) * K).reshape(b - a, K)
        _csmc_block(
            x[a:b],
            href[a:b],
            float(phi),
            float(sigma),
            u,
            int(particles),
            int(obs),
            float(obs_sd),
            int(ancestor),
            out[a:b],
        )
    return out


def series_stats(h: np.ndarray) -> np.ndarray:
    """Each series' transition statistics ``(Σh²_{t−1}, Σh_t h_{t−1}, Σh_t², n)`` with
    ``h_0 = 0`` (so ``n = T`` transitions), shape ``(series, 4)``."""
    h = np.asarray(h, float)
    prev = h[:, :-1]
    out = np.empty((h.shape[0], 4))
    out[:, 0] = np.einsum("st,st->s", prev, prev)
    out[:, 1] = np.einsum("st,st->s", h[:, 1:], prev)
    out[:, 2] = np.einsum("st,st->s", h, h)
    out[:, 3] = h.shape[1]
    return out
