"""Conditional SMC with ancestor sampling leaves the smoothing distribution invariant:
its state marginals on a linear-Gaussian model match the Kalman/RTS smoother within
MCSE; with wrong ancestor-sampling weights (the negative control) they do not."""

import numpy as np
import pytest
from scipy.stats import norm

from flymc_dist.diagnostics import mcse_mean, mcse_sd
from flymc_dist.sv.csmc import AS_RIGHT, AS_WRONG, OBS_GAUSS, OBS_SV, csmc_sweep, series_stats
from flymc_dist.sv.reference import kalman_smoother

PHI, SIGMA, R, T = 0.9, 1.0, 0.5, 12


def _data() -> np.ndarray:
    rng = np.random.default_rng(7)
    h, x = 0.0, np.empty(T)
    for t in range(T):
        h = PHI * h + SIGMA * rng.standard_normal()
        x[t] = h + R * rng.standard_normal()
    x[5] += 3.0  # an outlier pulls the smoother away from the prior
    return x


def _run(ancestor: int, seed: int, chains: int = 64, iters: int = 400, particles: int = 5):
    x = np.tile(_data(), (chains, 1))  # every series is an independent chain on the same data
    h = np.zeros_like(x)
    draws = np.empty((chains, iters, T))
    for it in range(iters):
        h = csmc_sweep(
            x,
            h,
            PHI,
            SIGMA,
            seed=seed,
            chain=0,
            iteration=it,
            first_series=0,
            particles=particles,
            obs=OBS_GAUSS,
            obs_sd=R,
            ancestor=ancestor,
        )
        draws[:, it] = h
    return draws[:, 50:]


def _z_scores(draws: np.ndarray) -> np.ndarray:
    ms, vs = kalman_smoother(_data(), PHI, SIGMA, R)
    est_m = draws.mean(axis=(0, 1))
    est_s = draws.std(axis=(0, 1))
    zm = (est_m - ms) / mcse_mean(draws)
    zs = (est_s - np.sqrt(vs)) / mcse_sd(draws)
    return np.concatenate([zm, zs])


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_csmc_matches_rts(seed: int) -> None:
    z = _z_scores(_run(AS_RIGHT, seed))
    # 2T tests per seed: Bonferroni at a 1% family-wise level
    assert np.max(np.abs(z)) < norm.ppf(1 - 0.005 / z.size), z


def test_wrong_ancestor_weights_fail() -> None:
    z = _z_scores(_run(AS_WRONG, 0))
    assert np.max(np.abs(z)) > norm.ppf(1 - 0.005 / z.size) * 2, z


def test_draws_do_not_depend_on_the_layout() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((10, 6))
    h = rng.standard_normal((10, 6)) * 0.1
    kw = dict(seed=3, chain=1, iteration=4, particles=8, obs=OBS_SV)
    whole = csmc_sweep(x, h, 0.9, 0.3, first_series=0, **kw)
    parts = np.vstack(
        [
            csmc_sweep(x[:3], h[:3], 0.9, 0.3, first_series=0, **kw),
            csmc_sweep(x[3:], h[3:], 0.9, 0.3, first_series=3, block=2, **kw),
        ]
    )
    np.testing.assert_array_equal(whole, parts)
    other = csmc_sweep(x, h, 0.9, 0.3, first_series=0, **{**kw, "iteration": 5})
    assert not np.array_equal(whole, other)


def test_series_stats() -> None:
    h = np.array([[1.0, 2.0, 3.0]])
    np.testing.assert_array_equal(series_stats(h), [[1 + 4, 2 + 6, 1 + 4 + 9, 3]])


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="particles"):
        csmc_sweep(
            np.zeros((2, 3)),
            np.zeros((2, 3)),
            0.5,
            1.0,
            seed=0,
            chain=0,
            iteration=0,
            first_series=0,
            particles=1,
        )
