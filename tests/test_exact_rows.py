"""Exact rows (``exact_rows="auto"``) and the MAP search's start for robust regression.

Exactness of FlyMC with exact rows (three models, two kernels, both bounds and z-updates)
and its negative control are in ``test_exactness.py``; a worker SIGKILLed with exact rows,
and the same draws in-process and on 1 and 2 workers, in ``test_cluster.py``. Here: the
rule that picks the rows, the models' loose tight points, what a run reports, and the
MAP search that must not stop at a local mode.
"""

from __future__ import annotations

import numpy as np
import pytest

import flymc_dist as fd
from flymc_dist import tune
from flymc_dist.models import LogisticRegression, RobustRegression, SoftmaxRegression


def _energy(X: np.ndarray) -> np.ndarray:
    sq = X**2
    return np.stack([sq.sum(0), (sq**2).sum(0)])


def _narrow_data(n: int, ones: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Bias, a Gaussian column, 0/1 columns with ``ones`` ones (disjoint rows), and a
    column standardised to ~0 except one large value (QM9's column 44 in small)."""
    rng = np.random.default_rng(seed)
    cols = [np.ones(n), rng.normal(size=n)]
    start = 0
    for k in ones:
        c = np.zeros(n)
        c[start : start + k] = 1.0
        cols.append(c)
        start += k
    spike = np.zeros(n)
    spike[n - 1] = 1.0
    cols.append((spike - spike.mean()) / spike.std())
    X = np.column_stack(cols)
    eta = X @ np.r_[0.2, -1.0, np.full(len(ones), 1.0), 0.05]
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-eta))).astype(np.int64)
    return X, y


def test_narrow_columns_picks_the_columns_few_rows_carry():
    X, _ = _narrow_data(3000, (12, 25))
    columns, thresholds = tune.narrow_columns(_energy(X), X.shape[0])
    # fewest carrying rows first: the spike (1 row), the 12 ones, the 25 ones; the bias
    # and the Gaussian column (thousands of rows) are not narrow
    np.testing.assert_array_equal(columns, [4, 2, 3])
    for j, t in zip(columns, thresholds, strict=True):
        picked = np.flatnonzero(X[:, j] ** 2 >= t)
        expected = {4: [2999], 2: np.arange(12), 3: np.arange(12, 37)}[int(j)]
        np.testing.assert_array_equal(picked, expected)


def test_narrow_columns_limit_follows_the_rows():
    """At most N/100 (and 2,000) carrying rows: 25 ones are narrow among 3,000 rows, not
    among 2,000; a zero column is never narrow."""
    X, _ = _narrow_data(2000, (12, 25))
    X = np.c_[X, np.zeros(2000)]
    columns, _ = tune.narrow_columns(_energy(X), X.shape[0])
    np.testing.assert_array_equal(columns, [4, 2])


@pytest.mark.parametrize(
    "model,y",
    [
        (RobustRegression(nu=4.0, scale=15.0), np.linspace(-3000.0, 3000.0, 41)),
        (RobustRegression(nu=30.0, scale=1e-3), np.linspace(-1.0, 1.0, 41)),
        (LogisticRegression(), np.tile([0.0, 1.0], 20)),
        (SoftmaxRegression(n_classes=4), np.tile([0, 1, 2, 3], 10)),
    ],
    ids=["robust", "robust-narrow", "logistic", "softmax"],
)
def test_exact_tight_points_keep_a_bound_far_below_the_likelihood(model, y):
    """The loose tight points give a lower bound (δ = l − β ≥ 0 everywhere, even at
    linear predictors of 1e6) that lies more than 50 nats below the likelihood wherever
    the linear predictor is within hundreds of the data's scale."""
    rng = np.random.default_rng(1)
    xi = model.exact_xi(y)
    E = model.n_outputs
    span = float(np.max(np.abs(y))) if model.task == "real" else 0.0
    scale = getattr(model, "scale", 1.0)
    near = span + 300.0 * scale * rng.uniform(-1, 1, size=(50, y.shape[0], E))
    far = 1e6 * rng.standard_normal((50, y.shape[0], E))
    d_near = model.loglik(near, y) - model.logbound(near, y, xi)
    d_far = model.loglik(far, y) - model.logbound(far, y, xi)
    assert np.all(np.isfinite(d_near)) and d_near.min() > 50.0
    assert np.all(d_far >= 0.0)


def _sample(data, **kw):
    opts = dict(
        kernel="nuts",
        num_warmup=60,
        num_samples=60,
        chains=2,
        seed=4,
        placement=fd.Placement(n_shards=2),
        client="synchronous",
        progress=False,
    )
    opts.update(kw)
    return fd.sample(fd.LogisticRegression(prior="normal", prior_scale=2.0), data, **opts)


def test_a_run_evaluates_its_exact_rows_at_every_step():
    X, y = _narrow_data(3000, (12, 25))
    res = _sample((X, y))
    assert res.info["exact_rows"] == 12 + 25 + 1
    # bright in every chain at every iteration, whatever θ
    assert res.stats["n_bright"].min() >= 38
    assert res.warmup_stats["n_bright"].min() >= 38
    off = _sample((X, y), algorithm=fd.FlyMC(exact_rows=None))
    assert off.info["exact_rows"] is None
    assert off.stats["n_bright"].min() < 38
    regular = _sample((X, y), algorithm="regular", num_warmup=10, num_samples=5)
    assert regular.info["exact_rows"] is None


def test_exact_rows_fit_the_budget():
    """At most N/50 rows: three narrow columns of 9, 9 and 5 ones among 1,000 rows are 24
    rows with the spike, over the budget of 20: the widest narrow column is dropped."""
    X, y = _narrow_data(1000, (9, 9, 5))
    res = _sample((X, y), num_warmup=20, num_samples=10)
    assert res.info["exact_rows"] == 9 + 5 + 1


def test_dense_data_get_no_exact_rows_and_the_same_draws():
    rng = np.random.default_rng(2)
    X = np.c_[np.ones(3000), rng.normal(size=(3000, 2))]
    y = (rng.random(3000) < 0.4).astype(np.int64)
    auto, off = _sample((X, y)), _sample((X, y), algorithm=fd.FlyMC(exact_rows=None))
    assert auto.info["exact_rows"] == 0
    np.testing.assert_array_equal(auto.samples, off.samples)


def test_out_of_core_shards_pick_the_same_exact_rows(tmp_path):
    X, y = _narrow_data(3000, (12, 25))
    ds = fd.from_numpy(X, y, tmp_path / "d.zarr", chunk_rows=256)
    ooc = fd.Placement(n_shards=2, out_of_core=True)
    res = _sample(ds, placement=ooc, num_warmup=20, num_samples=20)
    assert res.info["out_of_core"] == [True, True]
    assert res.info["exact_rows"] == 38
    assert res.stats["n_bright"].min() >= 38


@pytest.mark.parametrize("bad", ["on", True, 0.5])
def test_exact_rows_option_is_checked(bad):
    X, y = _narrow_data(3000, (12,))
    with pytest.raises(ValueError, match="exact_rows must be 'auto' or None"):
        _sample((X, y), algorithm=fd.FlyMC(exact_rows=bad))


# ---------------------------------------------------------------- the MAP search's start
def _two_mode_data() -> tuple[np.ndarray, np.ndarray]:
    """Robust regression whose 0/1 column's 40 rows split: 15 fit at weight 0, 25 at
    weight 30 (scale 1): the log posterior has a local mode near 0 and the global one
    near 30, ~200 nats higher (as the flights data's 3 am hour)."""
    rng = np.random.default_rng(7)
    n = 2000
    X = np.c_[np.ones(n), rng.normal(size=n), np.zeros(n)]
    X[:40, 2] = 1.0
    y = X[:, :2] @ np.array([1.0, 2.0]) + 0.5 * rng.standard_t(4, size=n)
    y[15:40] += 30.0
    return X, y


def _log_posterior(model, X, y, theta) -> float:
    eta = (X @ theta)[:, None]
    return float(model.loglik(eta[None], y).sum() + model.log_prior(theta[None]).sum())


def _map(model, X, y) -> np.ndarray:
    res = fd.sample(
        model, (X, y), algorithm="regular", kernel="rwmh", num_warmup=0, num_samples=1,
        chains=1, client="synchronous", progress=False,
    )  # fmt: skip
    return np.asarray(res.info["map"])


def test_robust_map_search_finds_the_global_mode(monkeypatch):
    """From the untuned bound's mode (least squares), the search reaches the global mode;
    from zeros (the start of log-concave models, forced here) it stops at the local one."""
    X, y = _two_mode_data()
    model = RobustRegression(nu=4.0, scale=1.0, prior="normal", prior_scale=100.0)
    found = _map(model, X, y)
    assert abs(found[2] - 30.0) < 1.0
    monkeypatch.setattr(RobustRegression, "log_concave", True)
    local = _map(model, X, y)
    assert abs(local[2]) < 1.0
    gap = _log_posterior(model, X, y, found) - _log_posterior(model, X, y, local)
    assert gap > 100.0
