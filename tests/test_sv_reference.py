"""On an informative panel (σ = 0.3, φ = 0.95, far from the prior's σ ≈ 0.1) the exact
particle-Gibbs sampler agrees with particle-marginal MH — a different method sharing only
the model — on the posterior means and sds of φ and σ, within their MCSEs; a particle
Gibbs with wrong ancestor-sampling weights (the negative control) does not.

The reference chains (tens of CPU seconds) are stored in ``tests/data/sv_pmmh_reference.npz``
by ``tests/data/make_sv_pmmh_reference.py``; their first draws are re-run here and must be
equal bit for bit, so the file is what today's PMMH gives."""

from pathlib import Path

import numpy as np
import pytest
from scipy.stats import norm

from flymc_dist.diagnostics import mcse_mean, mcse_sd
from flymc_dist.sv import StochasticVolatility, sample_sv, series_from_numpy, simulate_sv
from flymc_dist.sv.conditionals import Priors, sample_phi, sample_sigma2
from flymc_dist.sv.csmc import AS_WRONG, OBS_GAUSS, csmc_sweep, series_stats
from flymc_dist.sv.reference import pmmh

pytestmark = pytest.mark.slow

N, T = 6, 50
#: four comparisons (mean and sd of φ and σ): Bonferroni at a 1% family-wise level
Z = norm.ppf(1 - 0.01 / 8)
#: the stored PMMH reference: chains of seeds 1 and 2 with these settings
REFERENCE = Path(__file__).parent / "data" / "sv_pmmh_reference.npz"
PMMH = dict(n_iter=4000, particles=300, warmup=500)


def _panel() -> np.ndarray:
    return simulate_sv(N, T, 0.95, 0.3, seed=11)[0]


@pytest.fixture(scope="module")
def reference():
    """The panel and the stored PMMH draws of φ and σ, ``(2, 4000)`` each."""
    with np.load(REFERENCE) as f:
        return _panel(), f["phi"], f["sigma"]


def test_the_stored_reference_is_what_pmmh_gives(reference, recorded_cpu) -> None:
    """The first 200 draws of the stored chain of seed 1, run again, are equal bit for
    bit (PMMH's draws do not depend on how many follow); a chain of another seed is not."""
    x, phi, sigma = reference
    assert phi.shape == sigma.shape == (2, PMMH["n_iter"])
    again = pmmh(x, Priors(), seed=1, **{**PMMH, "n_iter": 200})
    np.testing.assert_array_equal(again[0], phi[0, :200])
    np.testing.assert_array_equal(again[1], sigma[0, :200])
    assert not np.array_equal(phi[0], phi[1])


def _z(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    zm = (a.mean() - b.mean()) / np.hypot(mcse_mean(a), mcse_mean(b))
    zs = (a.std() - b.std()) / np.hypot(mcse_sd(a), mcse_sd(b))
    return np.array([zm, zs])


def test_particle_gibbs_matches_pmmh(reference, tmp_path) -> None:
    x, phi, sigma = reference
    ds = series_from_numpy(x, tmp_path / "p.zarr")
    res = sample_sv(
        StochasticVolatility(particles=16),
        ds,
        num_warmup=300,
        num_samples=3000,
        chains=4,
        seed=3,
        client="synchronous",
    )
    z = np.concatenate([_z(res.phi, phi), _z(res.sigma, sigma)])
    assert np.all(np.abs(z) < Z), z


def _wrong_gibbs(x: np.ndarray, iters: int, chains: int) -> tuple[np.ndarray, np.ndarray]:
    pr = Priors()
    phis, sigmas = np.empty((chains, iters)), np.empty((chains, iters))
    for c in range(chains):
        rng = np.random.default_rng(c)
        h, phi, s2 = np.zeros_like(x), 0.9, 0.05
        for it in range(300 + iters):
            h = csmc_sweep(
                x,
                h,
                phi,
                np.sqrt(s2),
                seed=9,
                chain=c,
                iteration=it,
                first_series=0,
                particles=16,
                ancestor=AS_WRONG,
            )
            st = series_stats(h).sum(axis=0)
            s2 = sample_sigma2(rng, st, phi, pr)
            phi = sample_phi(rng, st, s2, pr)
            if it >= 300:
                phis[c, it - 300], sigmas[c, it - 300] = phi, np.sqrt(s2)
    return phis, sigmas


def test_wrong_ancestor_weights_disagree(reference) -> None:
    """The negative control, shorter than the sampler's run: it fails by far already
    (measured: |z| up to 58 at 300 draws per chain, 126 at 1,500; Z is 3.0)."""
    x, phi, sigma = reference
    wphi, wsigma = _wrong_gibbs(x, 300, 4)
    z = np.concatenate([_z(wphi, phi), _z(wsigma, sigma)])
    assert np.any(np.abs(z) > Z), z


def _prior_gibbs(wrong: bool, chains: int = 40, iters: int = 300) -> np.ndarray:
    """Particle Gibbs (CSMC-AS and the exact conditionals) on data that say nothing
    (Gaussian observations of sd 100), each chain started from a prior draw."""
    pr = Priors()
    x = np.random.default_rng(0).normal(size=(20, 5))
    phis = np.empty((chains, iters))
    for c in range(chains):
        rng = np.random.default_rng(100 + c)
        phi, s2 = rng.beta(5, 1), 0.05 / rng.gamma(5)
        h = np.zeros_like(x)
        for it in range(iters):
            h = csmc_sweep(
                x,
                h,
                phi,
                np.sqrt(s2),
                seed=1,
                chain=c,
                iteration=it,
                first_series=0,
                particles=8,
                obs=OBS_GAUSS,
                obs_sd=100.0,
            )
            st = series_stats(h).sum(axis=0)
            s2 = sample_sigma2(rng, st, phi, pr)
            phi = sample_phi(rng, st, s2, pr, wrong=wrong)
            phis[c, it] = phi
    return phis


@pytest.mark.parametrize("wrong", [False, True])
def test_uninformative_data_give_back_the_prior(wrong: bool) -> None:
    """40 chains recover the prior mean; the wrong φ-conditional (the negative control)
    misses it by far already on the first 10 of them (measured: z = −14.8 with 10 chains,
    −24.7 with 40; the threshold is 2.6)."""
    phis = _prior_gibbs(wrong, chains=10 if wrong else 40)
    z = (phis.mean() - 5 / 6) / mcse_mean(phis)  # Beta(5, 1) has mean 5/6
    assert (abs(z) > norm.ppf(0.995)) == wrong, z
