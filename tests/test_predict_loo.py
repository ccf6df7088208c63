"""Answers out: the posterior predictive against a direct numpy computation from the
draws (arrays, DataFrames with categorical columns, stores on a cluster), PSIS against
ArviZ's, and LOO by subsampling against full PSIS-LOO on every row."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.special import expit, logsumexp

import flymc_dist as fd
from flymc_dist.predictive import psis

N, D = 10_000, 3


def _laplace_draws(X, y, chains=4, draws=500, seed=0, prior_scale=1.0):
    """Draws of a Gaussian approximation of the logistic posterior (the estimators are
    checked against computations on the same draws, so they need not be exact)."""

    def nlp(t):
        s = X @ t
        return -(y * s - np.logaddexp(0, s)).sum() + 0.5 * (t @ t) / prior_scale**2

    def grad(t):
        return -X.T @ (y - expit(X @ t)) + t / prior_scale**2

    t = minimize(nlp, np.zeros(X.shape[1]), jac=grad, method="BFGS").x
    p = expit(X @ t)
    H = (X * (p * (1 - p))[:, None]).T @ X + np.eye(X.shape[1]) / prior_scale**2
    rng = np.random.default_rng(seed)
    L = np.linalg.cholesky(np.linalg.inv(H))
    z = rng.standard_normal((chains, draws, X.shape[1]))
    return t + z @ L.T


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rng = np.random.default_rng(11)
    X = np.c_[np.ones(N), rng.normal(size=(N, D - 1))]
    y = (rng.random(N) < expit(X @ np.array([-0.3, 1.2, -0.7]))).astype(np.int64)
    path = tmp_path_factory.mktemp("loo") / "d.zarr"
    ds = fd.from_numpy(X, y, path, chunk_rows=1000, feature_names=["one", "a", "b"])
    samples = _laplace_draws(X, y)
    model = fd.LogisticRegression(prior="normal", prior_scale=1.0)
    info = {
        "model": model.to_dict(),
        "data": ds.path,
        "n_rows": N,
        "n_features": D,
        "feature_names": ["one", "a", "b"],
    }
    return fd.Result(samples, {}, samples[:, :0], {}, info), X, y


def test_predict_arrays_is_the_mean_over_draws(run) -> None:
    res, X, _ = run
    new = np.c_[np.ones(7), np.linspace(-2, 2, 7), np.linspace(1, -1, 7)]
    got = res.predict(new, draws=True)
    theta = res.samples.reshape(-1, D)
    direct = expit(new @ theta.T)  # (n, draws)
    np.testing.assert_allclose(got["probability"], direct.mean(axis=1), rtol=1e-12)
    np.testing.assert_allclose(got["draws"], direct.T, rtol=1e-12)
    with pytest.raises(ValueError, match="new has 2 features"):
        res.predict(new[:, :2])


def test_predict_a_store_on_the_cluster_writes_zarr(run, tmp_path, local_clusters) -> None:
    from distributed import Client

    res, X, _ = run
    ds = fd.open_dataset(res.info["data"])
    with Client(local_clusters.get(2)) as client:
        arrays = res.predict(ds, out=str(tmp_path / "p.zarr"), client=client)
    theta = res.samples.reshape(-1, D)
    np.testing.assert_allclose(arrays["probability"][:], expit(X @ theta.T).mean(axis=1))


def test_predict_dataframe_with_categorical_levels(tmp_path) -> None:
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(2)
    n = 300
    frame = pd.DataFrame(
        {"dist": rng.gamma(2.0, 100.0, n), "carrier": rng.choice(["AA", "DL", "UA"], n)}
    )
    frame["late"] = (rng.random(n) < 0.3).astype(int)
    frame.to_csv(tmp_path / "f.csv", index=False)
    ds = fd.ingest(
        tmp_path / "f.csv",
        tmp_path / "f.zarr",
        target="late",
        categorical=["carrier"],
        standardize=True,
    )
    Xs, ys = ds.read()
    samples = _laplace_draws(Xs, ys, chains=2, draws=200)
    info = {
        "model": fd.LogisticRegression().to_dict(),
        "data": ds.path,
        "n_features": 3,
        "feature_names": ds.feature_names,
    }
    res = fd.Result(samples, {}, samples[:, :0], {}, info)
    new = pd.DataFrame({"dist": [50.0, 400.0], "carrier": ["UA", "AA"]})
    got = res.predict(new)["probability"]
    design = ds.attrs["design"]
    z = (new["dist"].to_numpy() - design["center"][0]) / design["scale"][0]
    Xn = np.c_[z, [0.0, 0.0], [1.0, 0.0]]
    theta = samples.reshape(-1, 3)
    np.testing.assert_allclose(got, expit(Xn @ theta.T).mean(axis=1), rtol=1e-12)
    with pytest.raises(ValueError, match=r"column 'carrier': level 'WN' was not seen"):
        res.predict(pd.DataFrame({"dist": [1.0], "carrier": ["WN"]}))
    with pytest.raises(ValueError, match="categorical columns: pass new rows as a DataFrame"):
        res.predict(np.ones((2, 2)))


def test_log_likelihood_of_chosen_rows(run) -> None:
    res, X, y = run
    rows = np.array([9000, 3, 3, 512])
    ll = res.log_likelihood(rows)
    theta = res.samples.reshape(-1, D)
    s = X[rows] @ theta.T
    direct = (y[rows][:, None] * s - np.logaddexp(0, s)).T.reshape(4, 500, 4)
    np.testing.assert_allclose(ll, direct, rtol=1e-10)


def test_psis_matches_arviz() -> None:
    az = pytest.importorskip("arviz")
    rng = np.random.default_rng(0)
    lr = np.c_[rng.standard_t(3, size=(2000, 1)), rng.normal(size=(2000, 1)) * 2]
    lw, k = psis(lr)
    lw_az, k_az = az.psislw(lr.T.copy())  # arviz: one row per target
    np.testing.assert_allclose(k, k_az, atol=1e-8)
    np.testing.assert_allclose(lw, np.asarray(lw_az).T, atol=1e-8)


@pytest.fixture(scope="module")
def full_loo(run):
    """Full PSIS-LOO on every one of the 10⁴ rows."""
    res, _, _ = run
    ll = res.log_likelihood(np.arange(N)).reshape(-1, N)
    lw, k = psis(-ll)
    elpd_i = logsumexp(lw + ll, axis=0)
    return float(elpd_i.sum()), float(np.sqrt(N * elpd_i.var())), k


@pytest.mark.slow
def test_loo_by_subsampling_is_within_its_se_of_full_psis_loo(run, full_loo) -> None:
    res, _, _ = run
    full, full_se, k = full_loo
    assert np.all(k < 0.7)
    within, ses = 0, {}
    for seed in range(6):
        est = res.loo(n_subsample=300, seed=seed)
        assert est["n_subsample"] == 300 and est["pareto_k"].shape == (300,)
        assert est["subsampling_se"] > 0
        within += abs(est["elpd_loo"] - full) < 2 * est["subsampling_se"]
        # the reported SE of elpd (as full PSIS-LOO reports it) is estimated well too
        assert abs(est["se"] - full_se) < 0.25 * full_se
    assert within >= 5
    for m in (100, 2000):
        ses[m] = np.mean([res.loo(n_subsample=m, seed=s)["subsampling_se"] for s in range(3)])
    assert ses[2000] < ses[100] / 3  # ~ sqrt(20 · (1 − 0.2)) = 4 times smaller


@pytest.mark.slow
def test_loo_negative_control_a_wrong_model_scores_worse(run, full_loo) -> None:
    """The estimate sees a model change: the same draws with one coefficient's sign
    flipped are far worse, by many subsampling SEs (and compare ranks them so)."""
    res, _, _ = run
    flipped = res.samples.copy()
    flipped[..., 1] *= -1
    bad = fd.Result(flipped, {}, flipped[:, :0], {}, dict(res.info))
    a, b = res.loo(seed=1), bad.loo(seed=1)
    assert a["elpd_loo"] - b["elpd_loo"] > 10 * (a["subsampling_se"] + b["subsampling_se"])
    table = fd.compare({"right": a, "flipped": b})
    assert [r["name"] for r in table] == ["right", "flipped"]
    assert table[1]["elpd_diff"] < 0 and table[1]["diff_se"] > 0


def test_a_sampled_run_predicts_and_scores_its_rows(tmp_path) -> None:
    """Through fd.sample (in process): the run records what predict and loo need."""
    rng = np.random.default_rng(4)
    X = np.c_[np.ones(600), rng.normal(size=(600, 1))]
    y = (rng.random(600) < expit(X @ np.array([0.2, 1.0]))).astype(np.int64)
    ds = fd.from_numpy(X, y, tmp_path / "d.zarr", feature_names=["one", "x"])
    res = fd.sample(
        fd.LogisticRegression(),
        ds,
        fd.Regular(),
        "rwmh",
        num_warmup=100,
        num_samples=100,
        chains=2,
        seed=0,
        client="synchronous",
    )
    theta = res.samples.reshape(-1, 2)
    np.testing.assert_allclose(
        res.predict(X[:5])["probability"], expit(X[:5] @ theta.T).mean(axis=1), rtol=1e-12
    )
    est = res.loo(n_subsample=600)  # every row: no subsampling error
    assert est["subsampling_se"] == 0 and np.isfinite(est["elpd_loo"])


def test_cli_predict_from_a_trace(tmp_path, capsys) -> None:
    import zarr

    from flymc_dist.cli import main

    rng = np.random.default_rng(5)
    X = np.c_[np.ones(400), rng.normal(size=(400, 1))]
    y = (rng.random(400) < expit(X @ np.array([0.1, 0.8]))).astype(np.int64)
    ds = fd.from_numpy(X, y, tmp_path / "d.zarr", chunk_rows=100)
    fd.sample(
        fd.LogisticRegression(),
        ds,
        fd.Regular(),
        "rwmh",
        num_warmup=50,
        num_samples=50,
        chains=2,
        seed=0,
        client="synchronous",
        trace=str(tmp_path / "t.zarr"),
    )
    code = main(["predict", str(tmp_path / "t.zarr"), ds.path, str(tmp_path / "p.zarr")])
    assert code == 0, capsys.readouterr().err
    from flymc_dist.trace import Trace

    samples = Trace.open(str(tmp_path / "t.zarr"), read_only=True).samples.reshape(-1, 2)
    got = zarr.open_group(str(tmp_path / "p.zarr"), mode="r")["probability"][:]
    np.testing.assert_allclose(got, expit(X @ samples.T).mean(axis=1), rtol=1e-12)


def test_bench_loo_is_wired(tmp_path, capsys) -> None:
    """`flymc bench loo` on a tiny problem: the full sum, every seed's row, the count, the
    JSON."""
    import json

    from flymc_dist.cli import main

    out_json = tmp_path / "f.json"
    args = ["bench", "loo", "--rows", "2000", "--seeds", "3", "--warmup", "60"]
    code = main([*args, "--samples", "60", "--chains", "2", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "full PSIS-LOO" in out and "of 3 seeds" in out
    d = json.loads(out_json.read_text())
    assert len(d["estimates"]) == 3 and 0 <= d["within"] <= 3
    assert np.isfinite(d["full"]["elpd_loo"]) and d["full"]["elpd_loo"] < 0


def _glm_run(model, X, y, tmp_path):
    ds = fd.from_numpy(X, y, tmp_path / "g.zarr", task=model.task)
    return fd.sample(
        model, ds, fd.Regular(), "rwmh", num_warmup=150, num_samples=150, chains=2, seed=0,
        client="synchronous", progress=False,
    )  # fmt: skip


def test_predict_follows_the_family(tmp_path) -> None:
    """Probit's probability is Φ(η), not σ(η); a negative binomial's mean is e^η and its
    interval holds about 90 % of fresh counts drawn from the same process; a user's
    family, which gives only its log-likelihood, is refused in one line."""
    from scipy.special import ndtr

    rng = np.random.default_rng(7)
    X = np.c_[np.ones(2000), rng.normal(size=(2000, 1))]
    eta = X @ np.array([0.2, 0.6])
    y = (rng.random(2000) < ndtr(eta)).astype(np.int64)
    res = _glm_run(fd.GLM("binomial", link="probit"), X, y, tmp_path / "p")
    theta = res.samples.reshape(-1, 2)
    got = res.predict(X[:5])["probability"]
    np.testing.assert_allclose(got, ndtr(X[:5] @ theta.T).mean(axis=1), rtol=1e-12)
    assert not np.allclose(got, expit(X[:5] @ theta.T).mean(axis=1), rtol=1e-3)

    mu = np.exp(X @ np.array([0.5, 0.4]))
    counts = rng.poisson(rng.gamma(2.0, mu / 2.0))
    res = _glm_run(fd.GLM("negative_binomial", dispersion=2.0), X, counts, tmp_path / "n")
    theta = res.samples.reshape(-1, 2)
    out = res.predict(X, interval=0.9)
    np.testing.assert_allclose(out["mean"], np.exp(X @ theta.T).mean(axis=1), rtol=1e-12)
    fresh = rng.poisson(rng.gamma(2.0, mu / 2.0))
    inside = np.mean((fresh >= out["lower"]) & (fresh <= out["upper"]))
    assert inside > 0.88, inside  # counts are discrete: at least 90 % inside, in theory
    # negative control: a Poisson interval at the same means (no overdispersion) misses
    fit = np.exp(X @ theta.T)
    lo, hi = np.quantile(np.random.default_rng(0).poisson(fit), [0.05, 0.95], axis=1)
    assert np.mean((fresh >= lo) & (fresh <= hi)) < inside - 0.03  # 0.915 against 0.97

    import numba

    @numba.njit
    def f(eta, y):
        return -0.5 * (y - eta) ** 2

    @numba.njit
    def df(eta, y):
        return y - eta

    own = fd.CustomFamily(f, df, curvature=1.0, name="mine", log_concave=True)
    yr = X @ np.array([0.1, 1.0]) + rng.normal(size=2000)
    res = _glm_run(fd.GLM(own), X, yr, tmp_path / "c")
    with pytest.raises(ValueError, match="'mine' family gives no predictive") as e:
        res.predict(X[:3])
    assert "\n" not in str(e.value)
    assert res.log_likelihood([0, 5]).shape == (2, 150, 2)  # its log-likelihood works
    assert np.isfinite(res.loo(n_subsample=200)["elpd_loo"])
