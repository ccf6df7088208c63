"""The exact (φ, σ²) conditionals equal their analytic forms (KS tests, with negative
controls); the series-unit sequential test is exact MH at eps = 0; the panel store."""

import math

import numpy as np
import pytest
from scipy import integrate, stats

from flymc_dist.sv import open_series, series_from_numpy, simulate_sv
from flymc_dist.sv.conditionals import (
    Priors,
    mh_decision,
    phi_conditional_logpdf,
    sample_phi,
    sample_sigma2,
    series_loglik,
)

PR = Priors()
N_DRAWS = 2000


def _phi_cdf(st: np.ndarray, s2: float):
    grid = np.linspace(1e-9, 1 - 1e-9, 20001)
    lp = phi_conditional_logpdf(grid, st, s2, PR)
    dens = np.exp(lp - lp.max())
    cdf = integrate.cumulative_trapezoid(dens, grid, initial=0.0)
    cdf /= cdf[-1]
    return lambda q: np.interp(q, grid, cdf)


@pytest.mark.parametrize(
    "st, s2",
    [
        (np.array([20.0, 17.0, 30.0, 40.0]), 0.5),  # the Beta factor matters
        (np.array([500.0, 490.0, 600.0, 900.0]), 0.09),  # piles up against φ = 1
        (np.array([2.0, -1.0, 5.0, 10.0]), 1.0),  # data pull φ below 0: truncation
    ],
)
def test_phi_conditional(st: np.ndarray, s2: float) -> None:
    rng = np.random.default_rng(0)
    draws = np.array([sample_phi(rng, st, s2, PR) for _ in range(N_DRAWS)])
    assert stats.kstest(draws, _phi_cdf(st, s2)).pvalue > 1e-3


def test_phi_conditional_negative_control() -> None:
    st, s2 = np.array([20.0, 17.0, 30.0, 40.0]), 0.5
    rng = np.random.default_rng(0)
    draws = np.array([sample_phi(rng, st, s2, PR, wrong=True) for _ in range(N_DRAWS)])
    assert stats.kstest(draws, _phi_cdf(st, s2)).pvalue < 1e-6


def test_sigma2_conditional() -> None:
    st, phi = np.array([20.0, 17.0, 30.0, 40.0]), 0.8
    rng = np.random.default_rng(1)
    draws = np.array([sample_sigma2(rng, st, phi, PR) for _ in range(N_DRAWS)])
    rss = st[2] - 2 * phi * st[1] + phi * phi * st[0]
    right = stats.invgamma(PR.s2_a + st[3] / 2, scale=PR.s2_b + rss / 2)
    wrong = stats.invgamma(PR.s2_a + st[3] / 2, scale=PR.s2_b + rss)  # negative control
    assert stats.kstest(draws, right.cdf).pvalue > 1e-3
    assert stats.kstest(draws, wrong.cdf).pvalue < 1e-6


def test_series_loglik_is_the_gaussian_transition_density() -> None:
    h = np.array([[0.3, -0.2, 0.5, 0.1]])
    from flymc_dist.sv.csmc import series_stats

    prev = np.concatenate([[0.0], h[0, :-1]])
    direct = stats.norm.logpdf(h[0], 0.7 * prev, math.sqrt(0.2)).sum()
    np.testing.assert_allclose(series_loglik(series_stats(h), 0.7, 0.2), [direct])


def test_mh_decision_eps0_is_exact_mh() -> None:
    rng = np.random.default_rng(2)
    st = np.abs(rng.normal(size=(137, 4))) + 1
    st[:, 3] = 5
    cur, prop = (0.9, 0.1), (0.92, 0.11)
    li = series_loglik(st, *prop) - series_loglik(st, *cur)
    for mu0 in (li.mean() - 1e-3, li.mean() + 1e-3):
        d = mh_decision(rng, lambda i: st[i], 137, cur, prop, mu0, eps=0.0, batch_size=10)
        assert d.accept == (li.mean() > mu0) and d.series_read == 137


def test_mh_decision_reads_without_replacement() -> None:
    rng = np.random.default_rng(3)
    st = np.ones((50, 4))
    seen: list[int] = []

    def fetch(i: np.ndarray) -> np.ndarray:
        seen.extend(i.tolist())
        return st[i] * (1 + 0.1 * np.asarray(i)[:, None])

    d = mh_decision(rng, fetch, 50, (0.9, 0.1), (0.9, 0.1 + 1e-9), 0.0, eps=0.0, batch_size=7)
    assert sorted(seen) == list(range(50)) and d.series_read == 50


def test_series_store(tmp_path) -> None:
    x, h = simulate_sv(300, 6, 0.9, 0.2, seed=0)
    ds = series_from_numpy(x, tmp_path / "p.zarr", chunk=64)
    again = open_series(tmp_path / "p.zarr")
    assert again == ds and (ds.n_series, ds.length, ds.chunk) == (300, 6, 64)
    np.testing.assert_array_equal(ds.read(), x)
    ranges = ds.shard_ranges(3)
    assert ranges[0][0] == 0 and ranges[-1][1] == 300
    assert all(a % 64 == 0 for a, _ in ranges)  # whole chunks: a series is never split
    with pytest.raises(FileExistsError):
        series_from_numpy(x, tmp_path / "p.zarr")
    bad = x.copy()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError, match="finite"):
        series_from_numpy(bad, tmp_path / "q.zarr")
    with pytest.raises(ValueError, match="T >= 2"):
        series_from_numpy(x[:, :1], tmp_path / "q.zarr")
    assert not (tmp_path / "q.zarr").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["p.zarr"]  # no temporary left
    with pytest.raises(ValueError, match="not a series store"):
        (tmp_path / "r.zarr").mkdir()
        import zarr

        zarr.open_group(store=str(tmp_path / "r.zarr"), mode="w", zarr_format=3)
        open_series(tmp_path / "r.zarr")
