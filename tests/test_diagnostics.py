"""Tests for flymc_dist.diagnostics.

The exactness tests compare against a deliberately naive reference written
straight from the algorithm of Vehtari et al. (2021) / the Stan reference
manual: O(n²) direct autocovariances (no FFT), O(N²) tie-averaged ranks, and
Geyer's initial positive / monotone sequences as explicit loops. The
statistical tests check the estimators against analytic truths.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import signal, stats

from flymc_dist import diagnostics as diag

# --------------------------------------------------------------------------------------------
# naive reference implementation
# --------------------------------------------------------------------------------------------


def _ref_split(x: np.ndarray) -> np.ndarray:
    n = x.shape[1]
    half = n // 2
    first = x[:, :half]
    second = x[:, n - half :]
    return np.vstack([first, second])


def _ref_z(x: np.ndarray) -> np.ndarray:
    flat = x.ravel()
    size = flat.size
    less = (flat[None, :] < flat[:, None]).sum(axis=1)
    equal = (flat[None, :] == flat[:, None]).sum(axis=1)
    ranks = less + (equal + 1) / 2.0
    return stats.norm.ppf((ranks - 0.375) / (size + 0.25)).reshape(x.shape)


def _ref_ess(x: np.ndarray) -> float:
    m_chains, n = x.shape
    if np.ptp(x) == 0:
        return np.nan
    acov = np.zeros((m_chains, n))
    for m in range(m_chains):
        xc = x[m] - x[m].mean()
        for lag in range(n):
            acov[m, lag] = np.dot(xc[: n - lag], xc[lag:]) / n
    within = acov[:, 0].mean() * n / (n - 1)
    var_plus = within * (n - 1) / n
    if m_chains > 1:
        var_plus += np.var(x.mean(axis=1), ddof=1)

    def rho_at(lag: int) -> float:
        return 1.0 - (within - acov[:, lag].mean()) / var_plus

    rho = np.zeros(n)
    even, odd = 1.0, rho_at(1)
    rho[0], rho[1] = even, odd
    t = 1
    while t < n - 3 and even + odd > 0:
        even, odd = rho_at(t + 1), rho_at(t + 2)
        if even + odd >= 0:
            rho[t + 1], rho[t + 2] = even, odd
        t += 2
    max_t = t - 2
    if even > 0:
        rho[max_t + 1] = even
    t = 1
    while t <= max_t - 2:
        if rho[t + 1] + rho[t + 2] > rho[t - 1] + rho[t]:
            rho[t + 1] = rho[t + 2] = (rho[t - 1] + rho[t]) / 2.0
        t += 2
    tau = -1.0 + 2.0 * rho[: max_t + 1].sum() + rho[max_t + 1]
    total = m_chains * n
    tau = max(tau, 1.0 / np.log10(total))
    return total / tau


def _ref_rhat_basic(x: np.ndarray) -> float:
    n = x.shape[1]
    b = n * np.var(x.mean(axis=1), ddof=1)
    w = np.mean(np.var(x, axis=1, ddof=1))
    return np.sqrt(((n - 1) / n * w + b / n) / w)


def _ref_all(x: np.ndarray) -> dict[str, float]:
    split = _ref_split(x)
    folded = np.abs(split - np.median(split))
    q05, q95 = np.quantile(x, 0.05), np.quantile(x, 0.95)
    centred_sq = (x - x.mean()) ** 2
    evar = centred_sq.mean()
    varvar = ((centred_sq**2).mean() - evar**2) / _ref_ess(_ref_split(centred_sq))
    return {
        "ess_bulk": _ref_ess(_ref_z(split)),
        "ess_tail": np.fmin(  # a constant indicator has no ESS: use the other one
            _ref_ess(_ref_split((x <= q05).astype(float))),
            _ref_ess(_ref_split((x <= q95).astype(float))),
        ),
        "ess_mean": _ref_ess(split),
        "rhat": max(_ref_rhat_basic(_ref_z(split)), _ref_rhat_basic(_ref_z(folded))),
        "mcse_mean": np.std(x, ddof=1) / np.sqrt(_ref_ess(split)),
        "mcse_sd": np.sqrt(varvar / evar / 4.0),
    }


_FUNCS = {
    "ess_bulk": diag.ess_bulk,
    "ess_tail": diag.ess_tail,
    "ess_mean": diag.ess_mean,
    "rhat": diag.rhat,
    "mcse_mean": diag.mcse_mean,
    "mcse_sd": diag.mcse_sd,
}


def _ar1(rng: np.random.Generator, phi: float, chains: int, draws: int) -> np.ndarray:
    """Stationary Gaussian AR(1) chains with unit innovations."""
    noise = rng.standard_normal((chains, draws))
    start = rng.standard_normal(chains) / np.sqrt(1.0 - phi**2)
    x, _ = signal.lfilter([1.0], [1.0, -phi], noise, axis=1, zi=(phi * start)[:, None])
    return x


# --------------------------------------------------------------------------------------------
# exactness against the naive reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "chains", "draws"),
    [
        ("iid", 4, 50),
        ("iid", 1, 37),
        ("ar_pos", 3, 60),
        ("ar_pos", 2, 9),
        ("ar_neg", 4, 41),  # antithetic: exercises the positive-even-lag improvement
        ("ties", 3, 30),
        ("tiny", 2, 4),
        ("tiny", 1, 5),
        ("shifted", 4, 40),
    ],
)
def test_matches_naive_reference(kind: str, chains: int, draws: int) -> None:
    rng = np.random.default_rng(abs(hash((kind, chains, draws))) % 2**32)
    if kind == "iid" or kind == "tiny":
        x = rng.standard_normal((chains, draws))
    elif kind == "ar_pos":
        x = _ar1(rng, 0.8, chains, draws)
    elif kind == "ar_neg":
        x = _ar1(rng, -0.6, chains, draws)
    elif kind == "ties":
        x = np.round(rng.standard_normal((chains, draws)))
    else:
        x = rng.standard_normal((chains, draws)) + np.arange(chains)[:, None]
    expected = _ref_all(x)
    for name, func in _FUNCS.items():
        np.testing.assert_allclose(func(x), expected[name], rtol=1e-10, err_msg=name)


@settings(max_examples=25, deadline=None, database=None)
@given(
    chains=st.integers(1, 4),
    draws=st.integers(4, 40),
    phi=st.floats(-0.95, 0.95),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_naive_reference_property(chains: int, draws: int, phi: float, seed: int) -> None:
    x = _ar1(np.random.default_rng(seed), phi, chains, draws)
    expected = _ref_all(x)
    for name, func in _FUNCS.items():
        np.testing.assert_allclose(func(x), expected[name], rtol=1e-9, err_msg=name)


# --------------------------------------------------------------------------------------------
# statistical behaviour
# --------------------------------------------------------------------------------------------


def test_iid_ess_close_to_number_of_draws() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1000, 6))
    total = 4 * 1000
    for func, tol in ((diag.ess_bulk, 0.25), (diag.ess_mean, 0.25), (diag.ess_tail, 0.3)):
        values = func(x)
        assert values.shape == (6,)
        np.testing.assert_allclose(values, total, rtol=tol, err_msg=func.__name__)
    np.testing.assert_allclose(diag.rhat(x), 1.0, atol=0.01)
    # MCSE of the mean of iid N(0, 1): 1/sqrt(N); MCSE of the sd: ≈ 1/sqrt(2N).
    np.testing.assert_allclose(diag.mcse_mean(x), 1 / np.sqrt(total), rtol=0.15)
    np.testing.assert_allclose(diag.mcse_sd(x), 1 / np.sqrt(2 * total), rtol=0.2)


def test_ar1_ess_matches_analytic_value() -> None:
    phi = 0.9
    chains, draws = 4, 25_000
    x = _ar1(np.random.default_rng(1), phi, chains, draws)
    analytic = chains * draws * (1 - phi) / (1 + phi)
    assert abs(diag.ess_mean(x) / analytic - 1) < 0.15
    assert abs(diag.ess_bulk(x) / analytic - 1) < 0.15
    # The MCSE of the mean is then sd_stationary / sqrt(ESS).
    sd = 1 / np.sqrt(1 - phi**2)
    assert abs(diag.mcse_mean(x) / (sd / np.sqrt(analytic)) - 1) < 0.1
    assert diag.rhat(x) < 1.01


def test_antithetic_chain_ess_exceeds_draws_but_is_capped() -> None:
    x = _ar1(np.random.default_rng(2), -0.5, 4, 2000)
    total = 4 * 2000
    ess = diag.ess_mean(x)
    assert total < ess <= total * np.log10(total)


def test_rhat_detects_shifted_chain() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 500))
    assert diag.rhat(x) < 1.01
    x[0] += 2.0
    assert diag.rhat(x) > 1.1


def test_rhat_detects_scale_difference_through_folding() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 1000))
    x[0] *= 4.0
    split = diag._split_chains(x[None])
    bulk = diag._rhat_basic(diag._z_scale(split))[0]
    assert bulk < 1.02  # same location: the bulk R̂ cannot see it
    assert diag.rhat(x) > 1.1  # the folded R̂ does


def test_rhat_detects_trend_within_a_single_chain() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 400)) + np.linspace(0, 3, 400)
    assert diag.rhat(x) > 1.1


def test_stuck_chain_is_flagged_not_nan() -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 300))
    x[2] = 0.25  # one chain never moved
    value = diag.rhat(x)
    assert np.isfinite(value) and value > 1.1


# --------------------------------------------------------------------------------------------
# conventions and invariances
# --------------------------------------------------------------------------------------------


def test_odd_number_of_draws_drops_the_middle_draw() -> None:
    rng = np.random.default_rng(7)
    x = _ar1(rng, 0.5, 3, 101)
    trimmed = np.delete(x, 50, axis=1)
    for func in (diag.ess_bulk, diag.ess_mean, diag.rhat):
        assert func(x) == pytest.approx(func(trimmed), rel=1e-12)


def test_rank_diagnostics_invariant_under_monotone_transform() -> None:
    rng = np.random.default_rng(8)
    x = _ar1(rng, 0.7, 4, 200)
    # (The folded R̂ is not invariant: folding around the median depends on the scale.)
    for func in (diag.ess_bulk, diag.ess_tail):
        assert func(np.exp(x)) == pytest.approx(func(x), rel=1e-12)


def test_plain_ess_affine_invariant() -> None:
    rng = np.random.default_rng(9)
    x = _ar1(rng, 0.7, 4, 200)
    assert diag.ess_mean(3.0 * x - 7.0) == pytest.approx(diag.ess_mean(x), rel=1e-9)
    assert diag.mcse_mean(3.0 * x - 7.0) == pytest.approx(3 * diag.mcse_mean(x), rel=1e-9)


def test_ess_tail_prob_forms() -> None:
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 100))
    default = diag.ess_tail(x)
    assert diag.ess_tail(x, 0.05) == default
    assert diag.ess_tail(x, 0.95) == default
    assert diag.ess_tail(x, [0.05, 0.95]) == default
    assert np.isfinite(diag.ess_tail(x, (0.2, 0.8)))


def test_integer_and_bool_input_accepted() -> None:
    rng = np.random.default_rng(11)
    x = rng.integers(0, 5, size=(3, 50))
    assert np.isfinite(diag.ess_bulk(x))
    assert np.isfinite(diag.ess_mean(x > 2))


# --------------------------------------------------------------------------------------------
# degenerate input → NaN
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(_FUNCS))
def test_constant_input_gives_nan(name: str) -> None:
    assert np.isnan(_FUNCS[name](np.full((3, 20), 1.5)))
    assert np.isnan(_FUNCS[name](np.zeros((1, 8))))


@pytest.mark.parametrize("name", sorted(_FUNCS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_draw_gives_nan_for_that_parameter_only(name: str, bad: float) -> None:
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 50, 3))
    x[1, 7, 1] = bad
    out = _FUNCS[name](x)
    assert out.shape == (3,)
    assert np.isnan(out[1])
    assert np.all(np.isfinite(out[[0, 2]]))


def test_chains_constant_at_different_values() -> None:
    x = np.repeat(np.array([[0.0], [1.0]]), 10, axis=1)
    assert diag.rhat(x) == np.inf
    assert np.isfinite(diag.ess_bulk(x))


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(_FUNCS))
@pytest.mark.parametrize(
    "shape", [(), (100,), (0, 100), (4, 3), (4, 0), (2, 3, 5)], ids=lambda s: str(s)
)
def test_bad_shapes_raise(name: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        _FUNCS[name](np.ones(shape))


@pytest.mark.parametrize("name", sorted(_FUNCS))
def test_non_real_dtype_raises(name: str) -> None:
    with pytest.raises(TypeError):
        _FUNCS[name](np.full((2, 10), "a"))
    with pytest.raises(TypeError):
        _FUNCS[name](np.ones((2, 10), dtype=complex))


@pytest.mark.parametrize(
    "prob", [0.0, 1.0, -0.1, 1.5, (0.9, 0.1), (0.1, 0.5, 0.9), (0.0, 0.5), "a", ("a", 0.5)]
)
def test_bad_prob_raises(prob: object) -> None:
    x = np.random.default_rng(13).standard_normal((2, 20))
    with pytest.raises(ValueError):
        diag.ess_tail(x, prob)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# summary and formatting
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("param_shape", [(), (5,), (3, 4)])
def test_summary_shapes_and_values(param_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(14)
    x = rng.standard_normal((4, 200, *param_shape)) + 2.0
    table = diag.summary(x)
    assert set(table) == {"name", *diag.SUMMARY_COLUMNS}
    for column in diag.SUMMARY_COLUMNS:
        assert table[column].shape == param_shape
        assert table[column].dtype == np.float64
    assert table["name"].shape == param_shape
    np.testing.assert_allclose(table["mean"], x.mean(axis=(0, 1)))
    sd = x.reshape(800, -1).std(axis=0, ddof=1).reshape(param_shape)
    np.testing.assert_allclose(table["sd"], sd)
    np.testing.assert_allclose(table["q50"], np.median(x, axis=(0, 1)))
    np.testing.assert_allclose(table["ess_bulk"], diag.ess_bulk(x))
    np.testing.assert_allclose(table["ess_tail"], diag.ess_tail(x))
    np.testing.assert_allclose(table["r_hat"], diag.rhat(x))
    np.testing.assert_allclose(table["mcse_mean"], diag.mcse_mean(x))
    assert np.all(table["q5"] < table["q50"]) and np.all(table["q50"] < table["q95"])


def test_zero_parameters() -> None:
    x = np.ones((2, 10, 0))
    assert diag.ess_bulk(x).shape == (0,)
    table = diag.summary(x)
    assert table["r_hat"].shape == (0,) and table["name"].shape == (0,)
    assert diag.format_summary(table).splitlines()[0].split() == list(diag.SUMMARY_COLUMNS)


def test_summary_labels() -> None:
    rng = np.random.default_rng(15)
    assert diag.summary(rng.standard_normal((2, 10)))["name"][()] == "theta"
    table = diag.summary(rng.standard_normal((2, 10, 3, 5)), names="w")
    assert table["name"][1, 4] == "w[1,4]"
    table = diag.summary(rng.standard_normal((2, 10, 3)), names=["a", "b", "c"])
    assert list(table["name"]) == ["a", "b", "c"]
    with pytest.raises(ValueError):
        diag.summary(rng.standard_normal((2, 10, 3)), names=["a", "b"])
    with pytest.raises(ValueError):
        diag.summary(rng.standard_normal((2, 3, 3)))


def test_summary_degenerate_parameters() -> None:
    rng = np.random.default_rng(16)
    x = rng.standard_normal((2, 30, 3))
    x[:, :, 0] = 4.0
    x[0, 0, 2] = np.nan
    table = diag.summary(x)
    assert table["mean"][0] == 4.0 and table["sd"][0] == 0.0 and table["q95"][0] == 4.0
    assert np.isnan(table["ess_bulk"][0]) and np.isnan(table["r_hat"][0])
    assert all(np.isnan(table[c][2]) for c in diag.SUMMARY_COLUMNS)
    assert all(np.isfinite(table[c][1]) for c in diag.SUMMARY_COLUMNS)


def test_format_summary() -> None:
    rng = np.random.default_rng(17)
    table = diag.summary(rng.standard_normal((2, 50, 3, 5)))
    text = diag.format_summary(table)
    lines = text.splitlines()
    assert len(lines) == 1 + 15
    assert lines[0].split() == list(diag.SUMMARY_COLUMNS)
    assert lines[-1].startswith("theta[2,4] ")
    assert len({len(line) for line in lines}) == 1  # aligned
    short = diag.format_summary(table, max_rows=4).splitlines()
    assert len(short) == 1 + 4 + 1 and "11 more" in short[-1]
    renamed = diag.format_summary(table, names="beta")
    assert "beta[1,4]" in renamed and "theta" not in renamed
    partial = diag.format_summary({"mean": np.arange(3.0), "r_hat": np.array([1.0, np.nan, 2])})
    assert partial.splitlines()[0].split() == ["mean", "r_hat"]
    assert "nan" in partial
    with pytest.raises(ValueError):
        diag.format_summary(table, max_rows=0)
    with pytest.raises(ValueError):
        diag.format_summary({"foo": np.ones(3)})
    with pytest.raises(ValueError):
        diag.format_summary({"mean": np.ones(3), "sd": np.ones(2)})
