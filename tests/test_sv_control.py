"""Taylor control variates for the subsampled (φ, σ) MH over series.

Pieces (deterministic): the expansion's gradient and Hessian are those of each series'
transition log-likelihood (finite differences); the terms of the summed statistics equal
the summed terms; the residuals are not zero and shrink like the cube of the proposal's
scale while the plain differences shrink like its first power; ``eps = 0`` with control
variates is the exact MH decision.

Statistics: given fixed states, subsampled MH with control variates draws (φ, σ) from
the exact conditional ``p(φ, σ² | h)`` (computed by quadrature on a grid) within MCSE
over several chains, while control variates whose summed expansion is taken at a wrong
centre (the negative control) do not; and it reads far fewer series per decision than
the plain test with the same posterior-scaled proposals (counts).
"""

import math

import numpy as np
import pytest
from scipy.special import logsumexp
from scipy.stats import norm

from flymc_dist.diagnostics import mcse_mean
from flymc_dist.sv import simulate_sv
from flymc_dist.sv.conditionals import (
    Priors,
    TaylorControlVariate,
    log_prior,
    mh_decision,
    mh_step,
    series_loglik,
    taylor_sums,
    taylor_terms,
)
from flymc_dist.sv.csmc import series_stats

PR = Priors()
#: two comparisons (means of φ and σ): Bonferroni at a 1% family-wise level
Z = norm.ppf(1 - 0.01 / 4)


@pytest.fixture(scope="module")
def states() -> np.ndarray:
    """Per-series statistics of simulated states: 2,000 series × T = 10, φ = 0.9, σ = 0.3."""
    _, h = simulate_sv(2000, 10, 0.9, 0.3, seed=4)
    return series_stats(h)


def test_taylor_terms_are_the_derivatives(states) -> None:
    st = states[:50]
    centre = (0.85, 0.1)
    g, h = taylor_terms(st, centre)

    def ell(u: np.ndarray) -> np.ndarray:
        return series_loglik(st, u[0], math.exp(u[1]))

    u0, e = np.array([centre[0], math.log(centre[1])]), 1e-5
    for k in range(2):
        d = np.zeros(2)
        d[k] = e
        np.testing.assert_allclose((ell(u0 + d) - ell(u0 - d)) / (2 * e), g[:, k], atol=1e-6)
        for j in range(2):
            f = np.zeros(2)
            f[j] = e
            fd = (ell(u0 + d + f) - ell(u0 + d - f) - ell(u0 - d + f) + ell(u0 - d - f)) / (
                4 * e * e
            )
            np.testing.assert_allclose(fd, h[:, k, j], rtol=1e-4, atol=1e-3)
    cv = taylor_sums(states.sum(axis=0), centre)
    gs, hs = taylor_terms(states, centre)
    np.testing.assert_allclose(cv.grad, gs.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(cv.hess, hs.sum(axis=0), rtol=1e-12)
    # the sum of the series' changes is the summed expansion's change
    prop = (0.86, 0.11)
    np.testing.assert_allclose(
        cv.series_change(states, centre, prop).sum(), cv.total_change(centre, prop), rtol=1e-10
    )
    with pytest.raises(ValueError, match="centre"):
        taylor_sums(states.sum(axis=0), (1.0, 0.1))
    with pytest.raises(ValueError, match="stats"):
        taylor_sums(states[:2], centre)


def test_residual_spread_shrinks_like_the_cube_of_the_scale(states) -> None:
    centre = (0.9, 0.09)
    cv = taylor_sums(states.sum(axis=0), centre)
    direction = np.array([0.6, 0.8])
    scales = 0.04 * 0.5 ** np.arange(4)
    plain, resid = [], []
    for s in scales:
        prop = (centre[0] + s * direction[0] * 0.1, centre[1] * math.exp(s * direction[1]))
        li = series_loglik(states, *prop) - series_loglik(states, *centre)
        r = li - cv.series_change(states, centre, prop)
        plain.append(li.std())
        resid.append(r.std())
    resid, plain = np.array(resid), np.array(plain)
    assert np.all(resid > 0)  # an approximation, not the exact sums in disguise
    assert np.all(resid < 1e-2 * plain)
    slope_r = np.polyfit(np.log(scales), np.log(resid), 1)[0]
    slope_p = np.polyfit(np.log(scales), np.log(plain), 1)[0]
    assert 2.8 < slope_r < 3.2, slope_r
    assert 0.9 < slope_p < 1.1, slope_p


def test_eps0_with_control_variates_is_exact_mh(states) -> None:
    rng = np.random.default_rng(1)
    st = states[:157]
    cur, prop = (0.9, 0.09), (0.91, 0.095)
    cv = taylor_sums(st.sum(axis=0), cur)
    li = series_loglik(st, *prop) - series_loglik(st, *cur)
    for mu0 in (li.mean() - 1e-6, li.mean() + 1e-6):
        d = mh_decision(
            rng, lambda i: st[i], 157, cur, prop, mu0, eps=0.0, batch_size=10, control=cv
        )
        assert d.accept == (li.mean() > mu0) and d.series_read == 157


def _exact_moments(st: np.ndarray) -> tuple[float, float, float, float]:
    """Mean and sd of φ and σ under ``p(φ, σ² | h)``, by quadrature on a grid in
    ``(φ, log σ²)`` wide enough to hold the mass."""
    tot = st.sum(axis=0)
    S, C, Q, n = tot
    phi0 = C / S
    s20 = (Q - 2 * phi0 * C + phi0 * phi0 * S) / n
    sd_phi, sd_rho = math.sqrt(s20 / S), math.sqrt(2.0 / n)
    phi = phi0 + sd_phi * np.linspace(-9, 9, 601)
    rho = math.log(s20) + sd_rho * np.linspace(-9, 9, 601)
    P, R = np.meshgrid(phi, rho, indexing="ij")
    s2 = np.exp(R)
    logp = -0.5 * n * R - 0.5 * (Q - 2 * P * C + P * P * S) / s2 + R  # + log Jacobian of ρ
    logp += np.vectorize(lambda p, v: log_prior(p, v, PR))(P, s2)
    w = np.exp(logp - logsumexp(logp))
    sig = np.sqrt(s2)
    mp, ms = float((w * P).sum()), float((w * sig).sum())
    return (
        mp,
        ms,
        math.sqrt(float((w * (P - mp) ** 2).sum())),
        float(math.sqrt((w * (sig - ms) ** 2).sum())),
    )


def _chains(st: np.ndarray, step: float, n: int, *, control: str, seed: int) -> dict:
    """Subsampled MH on ``(φ, σ²)`` given fixed states, four chains, the expansion
    re-centred at the current point before every step (as the sampler does after a
    sweep); ``control``: "right", "wrong_centre" (the summed expansion at a point a few
    posterior sds away: the negative control) or "none"."""
    tot = st.sum(axis=0)
    phi0 = tot[1] / tot[0]
    s20 = (tot[2] - 2 * phi0 * tot[1] + phi0 * phi0 * tot[0]) / tot[3]
    off = 3.0 * math.sqrt(s20 / tot[0])  # three conditional sds of φ
    draws = np.empty((4, n, 2))
    reads = []
    for c in range(4):
        rng = np.random.default_rng([seed, c])
        point = (phi0, s20)
        for k in range(n):
            cv = None
            if control == "right":
                cv = taylor_sums(tot, point)
            elif control == "wrong_centre":
                g, h = taylor_terms(tot, (point[0] + off, point[1]))
                cv = TaylorControlVariate(point, g, h)
            out = mh_step(
                rng,
                point,
                step,
                lambda i: st[i],
                st.shape[0],
                PR,
                eps=0.05,
                batch_size=20,
                control=cv,
            )
            point = out.point
            draws[c, k] = point[0], math.sqrt(point[1])
            reads.append(out.series_read)
    return {"phi": draws[..., 0], "sigma": draws[..., 1], "reads": np.array(reads)}


def _z(d: dict, mp: float, ms: float) -> np.ndarray:
    return np.array(
        [
            (d["phi"].mean() - mp) / mcse_mean(d["phi"]),
            (d["sigma"].mean() - ms) / mcse_mean(d["sigma"]),
        ]
    )


#: a posterior-scaled random-walk step on (logit φ, log σ²) for :func:`states`
STEP = 0.04


@pytest.mark.slow
def test_control_variates_match_the_exact_conditional_and_a_wrong_centre_fails(states) -> None:
    mp, ms, sp, ss = _exact_moments(states)
    right = _chains(states, STEP, 1500, control="right", seed=7)
    z = _z(right, mp, ms)
    assert np.all(np.abs(z) < Z), z
    assert abs(right["phi"].std() - sp) < 0.25 * sp and abs(right["sigma"].std() - ss) < 0.25 * ss
    wrong = _chains(states, STEP, 1500, control="wrong_centre", seed=7)
    zw = _z(wrong, mp, ms)
    assert np.any(np.abs(zw) > 3 * Z), zw


@pytest.mark.slow
def test_control_variates_read_far_fewer_series(states) -> None:
    with_cv = _chains(states, STEP, 50, control="right", seed=8)["reads"]
    plain = _chains(states, STEP, 50, control="none", seed=8)["reads"]
    assert with_cv.mean() <= 25 and plain.mean() > 8 * with_cv.mean(), (
        with_cv.mean(),
        plain.mean(),
    )


# ------------------------------------------------------------------ the whole sampler
#: an informative panel where particle Gibbs mixes (σ = 1.5: the states' spread is not
#: lost in the log χ² noise): 200 series × T = 10
SAMPLER_RUN = dict(num_warmup=200, num_samples=500, chains=4, client="synchronous")
SUBSAMPLED = dict(
    update="subsampled", eps=0.05, batch_size=20, mh_steps=5, particles=8, trace_series=()
)


#: the tests reading :func:`informative` (its exact run costs as much as each test's own):
#: on one xdist worker, so that it is made once
INFORMATIVE_GROUP = pytest.mark.xdist_group("sv-control-informative")


@pytest.fixture(scope="module")
def informative(tmp_path_factory):
    from flymc_dist.sv import StochasticVolatility, sample_sv, series_from_numpy

    x, _ = simulate_sv(200, 10, 0.8, 1.5, seed=7)
    ds = series_from_numpy(x, tmp_path_factory.mktemp("svcv") / "p.zarr")
    exact = sample_sv(StochasticVolatility(particles=8, trace_series=()), ds, seed=1, **SAMPLER_RUN)
    return ds, exact


def _zz(a, b) -> np.ndarray:
    return np.array(
        [
            (a.phi.mean() - b.phi.mean()) / np.hypot(mcse_mean(a.phi), mcse_mean(b.phi)),
            (a.sigma.mean() - b.sigma.mean()) / np.hypot(mcse_mean(a.sigma), mcse_mean(b.sigma)),
        ]
    )


@pytest.mark.slow
@INFORMATIVE_GROUP
def test_sampler_with_control_variates_matches_exact_gibbs(informative) -> None:
    from flymc_dist.sv import StochasticVolatility, sample_sv

    ds, exact = informative
    res = sample_sv(StochasticVolatility(**SUBSAMPLED), ds, seed=2, **SAMPLER_RUN)
    assert res.approximate
    z = _zz(res, exact)
    assert np.all(np.abs(z) < Z), z
    # series read per decision: about one batch (mh_steps decisions per iteration)
    assert res.stats["series_read"].mean() / SUBSAMPLED["mh_steps"] < 2 * 20


@pytest.mark.slow
@INFORMATIVE_GROUP
def test_sampler_with_a_wrong_taylor_centre_fails(informative, monkeypatch) -> None:
    """Negative control: the summed expansion taken three conditional sds of φ away from
    the centre the series' terms use."""
    import flymc_dist.sv.sampler as sampler_mod
    from flymc_dist.sv import StochasticVolatility, sample_sv

    def wrong(stats, centre):
        off = 3.0 * math.sqrt(centre[1] / stats[0])
        g, h = taylor_terms(np.asarray(stats)[:4], (centre[0] + off, centre[1]))
        return TaylorControlVariate((float(centre[0]), float(centre[1])), g, h)

    monkeypatch.setattr(sampler_mod, "taylor_sums", wrong)
    ds, exact = informative
    res = sample_sv(StochasticVolatility(**SUBSAMPLED), ds, seed=2, **SAMPLER_RUN)
    z = _zz(res, exact)
    assert np.any(np.abs(z) > Z), z
