"""FlyMC's forecast of its own mixing: ``info["conditional_narrowing"]`` (κ, how many times
narrower in precision θ given z is than the posterior, at most over directions) and
``info["gibbs_ess_per_draw"]`` (``1 / (2κ − 1)``: the effective draws per iteration of the
slowest linear combination of θ under the two-block Gibbs sampler of θ and z, were both
blocks drawn exactly).

Both are read off the collapsed bound and the Laplace approximation at the MAP before the
first iteration; here they are computed independently from the data, and the forecast is
held against measured draws in the direction it describes: FlyMC mixes there at about
the Gibbs rate, while regular NUTS, on the same posterior and direction, mixes far faster
(so the check could fail).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

import flymc_dist as fd
from flymc_dist.diagnostics import ess_bulk


def _data(slope: float, n: int = 3000, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Logistic data whose classes are the better separated the larger ``slope``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2))
    X = np.column_stack([np.ones(n), x])
    eta = 0.2 + slope * x[:, 0] - 0.5 * x[:, 1]
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-eta))).astype(np.int64)
    return X, y


def _run(data, **kw):
    args = dict(
        algorithm=fd.FlyMC(bounds="map"),
        kernel="nuts",
        num_warmup=0,
        num_samples=1,
        chains=2,
        seed=3,
        client="synchronous",
        placement=fd.Placement(n_shards=2),
        progress=False,
    )
    args.update(kw)
    return fd.sample(fd.LogisticRegression(), data, **args)


def _precisions(X: np.ndarray, theta_map: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """θ given every datum dark (Jaakkola–Jordan curvature ``tanh(ξ/2)/(2ξ)`` at
    ``ξ = |xᵀθ_MAP|``) and the posterior at the MAP (``σ(s)(1 − σ(s))`` per row), each
    plus the Normal(0, 1) prior's identity."""
    s = X @ theta_map
    xi = np.abs(s)
    p = 1.0 / (1.0 + np.exp(-s))
    eye = np.eye(X.shape[1])
    return (X.T * (np.tanh(xi / 2.0) / (2.0 * xi))) @ X + eye, (X.T * (p * (1.0 - p))) @ X + eye


@pytest.mark.parametrize("slope, low, high", [(0.3, 1.0, 1.5), (6.0, 4.0, np.inf)])
def test_narrowing_is_the_bound_against_the_posterior_precision(slope, low, high):
    """κ is the largest generalised eigenvalue of the two precisions (scipy's generalised
    symmetric eigensolver), the Gibbs rate ``1 / (2κ − 1)``. Weakly separated classes give κ
    near 1; well separated ones — well-classified rows, whose bound is far more curved
    than their log-likelihood — a large κ. Regular MCMC and untuned bounds report None."""
    X, y = _data(slope)
    res = _run((X, y))
    bound_prec, post_prec = _precisions(X, res.info["map"])
    kappa = scipy.linalg.eigh(bound_prec, post_prec, eigvals_only=True)[-1]
    assert res.info["conditional_narrowing"] == pytest.approx(kappa, rel=1e-8)
    assert res.info["gibbs_ess_per_draw"] == pytest.approx(1.0 / (2.0 * kappa - 1.0), rel=1e-8)
    assert low <= kappa < high
    for other in (fd.Regular(), fd.FlyMC(bounds="untuned")):
        res = _run((X, y), algorithm=other)
        assert res.info["conditional_narrowing"] is None
        assert res.info["gibbs_ess_per_draw"] is None


@pytest.mark.slow
@pytest.mark.full_grid  # the forecast's check by a long run (tests/test_tiers.py)
def test_the_slowest_direction_mixes_at_about_the_gibbs_rate():
    """On well-separated data (κ ≈ 10, Gibbs rate 0.051), FlyMC's NUTS draws projected on
    the slowest direction — ``w = B v``, v the top generalised eigenvector and B the
    bound's precision: the left eigenvector of the Gibbs autoregression ``I − B⁻¹ P`` —
    with every z redrawn exactly every iteration, have a bulk ESS per draw between 0.4 and
    1.3 times the Gibbs rate (measured 0.029: the bright rows' terms narrow θ given z
    further than the bound alone; 1.3 allows for the ESS estimate's own error at this
    length, and for NUTS's draws of θ | z, which need not be independent). Regular NUTS
    gets 1.2 in the same direction and must exceed 3 times the rate: the limit is
    FlyMC's alternation, not the direction."""
    X, y = _data(6.0)
    # the best case for FlyMC: z redrawn exactly from p(z | θ) every iteration
    fly = _run(
        (X, y),
        num_warmup=300,
        num_samples=3000,
        chains=4,
        algorithm=fd.FlyMC(z_update="explicit", resample_fraction=1.0),
    )
    rate = fly.info["gibbs_ess_per_draw"]
    bound_prec, post_prec = _precisions(X, fly.info["map"])
    _, vecs = scipy.linalg.eigh(bound_prec, post_prec)
    w = bound_prec @ vecs[:, -1]

    def per_draw(res) -> float:
        proj = res.samples @ w
        return float(ess_bulk(proj)) / proj.size

    fly_rate = per_draw(fly)
    reg = _run((X, y), algorithm="regular", num_warmup=300, num_samples=500, chains=4)
    reg_rate = per_draw(reg)
    assert 0.4 * rate <= fly_rate <= 1.3 * rate, (fly_rate, rate)
    assert reg_rate > 3.0 * rate, (reg_rate, rate)
