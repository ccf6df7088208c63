"""Austerity MH over shards: exactness at eps = 0, sublinear data use, bias against exact
MCMC, error shrinking with eps, unbiased shard selection, and the API's labelling; with
the bounds as control variates (the default) and without (bit for bit the plain sampler)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib

import numpy as np
import pytest
import references as R
from scipy import stats
from scipy.special import expit

import flymc_dist as fd
from flymc_dist import diagnostics
from flymc_dist.austerity import sampler as aus
from flymc_dist.bench.sublinear import logistic_data
from flymc_dist.kernels.rwmh import tril_matvec
from flymc_dist.protocol import ShardConfig, ShardSpec
from flymc_dist.rng import ROLE_AUSTERITY, stream
from flymc_dist.transport.inprocess import InProcessTransport

MODEL = fd.LogisticRegression()


def _data(n: int, seed: int = 0, d: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return logistic_data(n, d, seed)


def _map_and_cov(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MAP and Laplace covariance of logistic regression with a N(0, 1) prior (Newton)."""
    th = np.zeros(X.shape[1])
    for _ in range(25):
        p = expit(X @ th)
        g = X.T @ (y - p) - th
        H = (X * (p * (1 - p))[:, None]).T @ X + np.eye(X.shape[1])
        th = th + np.linalg.solve(H, g)
    p = expit(X @ th)
    H = (X * (p * (1 - p))[:, None]).T @ X + np.eye(X.shape[1])
    return th, np.linalg.inv(H)


def _transport(X: np.ndarray, y: np.ndarray, sizes: list[int], seed: int = 0):
    edges = np.concatenate([[0], np.cumsum(sizes)])
    specs = [
        ShardSpec(i, "", int(a), int(b))
        for i, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=True))
    ]
    mem = {s.shard_id: (X[s.start : s.stop], y[s.start : s.stop]) for s in specs}
    config = ShardConfig(
        model=MODEL, algorithm="austerity", chains=1, seed=seed, n_rows=int(edges[-1])
    )
    return InProcessTransport(specs, config, mem), specs


# ------------------------------------------------------------------ the test itself
def _stop_by_definition(n, mean, sd, mu0, N, eps, tails, rounds, min_batches):
    """The stop rule written out for one decision, from scipy's Student-t: returns
    (stop, accept) or None for "continue"."""
    accept = mean > mu0
    if n >= N:
        return True, accept
    if n < 2 or rounds < min_batches:
        return None
    if sd == 0.0:
        return (True, accept) if eps > 0 else None
    s = sd / math.sqrt(n) * math.sqrt(1 - (n - 1) / (N - 1))
    t = (mean - mu0) / s
    # one-sided: |t| beyond the (1 - eps) quantile (the paper's Appendix A)
    tail = stats.t.sf(abs(t), n - 1)
    p = tail if tails == "one" else 2 * tail
    return (True, accept) if p < eps else None


def test_stop_rule_against_its_definition():
    """The stop rule, vectorised, against its definition decision by decision (scipy's
    t distribution): sidedness, rounds before the first test, zero sample sd (decided at
    once unless eps = 0), all rows used (exact, whatever eps)."""
    rng = np.random.default_rng(0)
    N = 400
    k = 1000
    n = rng.integers(1, N + 1, k)
    n[:50] = N
    mean = rng.normal(0, 0.05, k)
    sd = np.abs(rng.normal(0, 0.3, k))
    sd[50:150] = 0.0
    mu0 = rng.normal(0, 0.02, k)
    rounds = rng.integers(1, 6, k)
    m2 = sd**2 * np.maximum(n - 1, 0)
    seen = set()
    for tails in ("one", "two"):
        for eps in (0.0, 0.01, 0.1, 0.3):
            for min_batches in (1, 3):
                stop, acc, _ = aus.stop_rule(
                    n, mean, m2, mu0, N, eps, tails=tails, rounds=rounds, min_batches=min_batches
                )
                for i in range(k):
                    ref = _stop_by_definition(
                        n[i], mean[i], sd[i], mu0[i], N, eps, tails, rounds[i], min_batches
                    )
                    assert bool(stop[i]) == (ref is not None), (tails, eps, min_batches, i)
                    if ref is not None:
                        assert bool(acc[i]) == ref[1]
                seen.add(int(stop.sum()))
    assert len(seen) > 8  # the settings really give different stops
    # the p-value reported: one-sided P(T > |t|)
    nn, mm, ss, mu, e = 50, 0.02, 0.1, 0.0, 0.05
    _, _, p = aus.stop_rule(
        np.array([nn]), np.array([mm]), np.array([ss**2 * (nn - 1)]), np.array([mu]), N, e
    )
    s_ = ss / math.sqrt(nn) * math.sqrt(1 - (nn - 1) / (N - 1))
    assert p[0] == pytest.approx(stats.t.sf(abs((mm - mu) / s_), nn - 1), rel=1e-10)
    with pytest.raises(ValueError, match="tails must be"):
        aus.stop_rule(
            np.array([5]), np.array([0.0]), np.array([1.0]), np.array([0.0]), N, 0.1, tails="left"
        )


def test_one_sided_eps_is_two_sided_twice_eps():
    """On the symmetric t-test a one-sided eps takes the decisions of a two-sided 2·eps,
    bit for bit, both in the stop rule and through whole sequential tests over shards
    (same rows, same stops, same data used). Negative control: one- and two-sided at the
    same eps differ."""
    rng = np.random.default_rng(1)
    N, k = 1000, 20000
    n = rng.integers(2, N, k)
    mean = rng.normal(0, 0.05, k)
    m2 = rng.gamma(2.0, 1.0, k) * (n - 1) * 0.01
    mu0 = rng.normal(0, 0.02, k)
    for e in (0.01, 0.05, 0.3):
        one = aus.stop_rule(n, mean, m2, mu0, N, e, tails="one")
        two = aus.stop_rule(n, mean, m2, mu0, N, 2 * e, tails="two")
        np.testing.assert_array_equal(one[0], two[0])
        np.testing.assert_array_equal(one[1], two[1])
        same_eps = aus.stop_rule(n, mean, m2, mu0, N, e, tails="two")
        assert (same_eps[0] != one[0]).sum() > 100
    X, y, th0 = _data(3000, seed=4)
    thetas, props, log_u = _moves(X, y, 200, seed=5)
    kw = dict(batch_size=100, seed=9, n_shards=3, exact=False)
    one = aus.run_decisions(MODEL, (X, y), thetas, props, log_u, eps=0.05, tails="one", **kw)
    two = aus.run_decisions(MODEL, (X, y), thetas, props, log_u, eps=0.1, tails="two", **kw)
    half = aus.run_decisions(MODEL, (X, y), thetas, props, log_u, eps=0.05, tails="two", **kw)
    a, b, c = one["by_eps"][0], two["by_eps"][0], half["by_eps"][0]
    np.testing.assert_array_equal(a["accept"], b["accept"])
    np.testing.assert_array_equal(a["data_used"], b["data_used"])
    assert c["data_used"].sum() > a["data_used"].sum()  # the stricter test uses more rows


def test_min_batches_and_zero_variance_in_the_sequential_test():
    """No decision stops before min_batches minibatches (unless it has used every row); a
    population whose differences are all equal is decided after the first test's rows
    (zero sample sd), exactly as the exact decision."""
    X, y, _ = _data(2000, seed=6)
    thetas, props, log_u = _moves(X, y, 100, seed=7)
    for mb in (1, 3, 5):
        r = aus.run_decisions(
            MODEL,
            (X, y),
            thetas,
            props,
            log_u,
            eps=0.3,
            batch_size=50,
            seed=3,
            n_shards=2,
            min_batches=mb,
            exact=False,
        )
        used = r["by_eps"][0]["data_used"]
        assert used.min() >= mb * 50
        if mb == 1:
            assert used.min() == 50  # loose eps: some decisions stop at the first test
    # every row identical: every l_i equal, sd = 0 from the start
    Xc = np.tile(X[:1], (600, 1))
    yc = np.ones(600)
    th = np.zeros(3)
    prop = np.array([0.05, -0.02, 0.01])
    lu = -np.random.default_rng(0).standard_exponential(40)
    r = aus.run_decisions(
        MODEL,
        (Xc, yc),
        th,
        prop,
        lu,
        eps=0.01,
        batch_size=20,
        seed=2,
        n_shards=2,
        min_batches=3,
    )
    row = r["by_eps"][0]
    assert np.all(row["data_used"] == 60)
    np.testing.assert_array_equal(row["accept"], r["exact_accept"])
    r0 = aus.run_decisions(
        MODEL, (Xc, yc), th, prop, lu, eps=0.0, batch_size=20, seed=2, n_shards=2
    )
    assert np.all(r0["by_eps"][0]["data_used"] == 600)  # eps = 0 waits for every row


def test_austerity_options_tails_and_min_batches():
    """The options: the default is the paper's one-sided test, k0 selectable; bad values
    refused in one line; the run's info records both."""
    a = fd.Austerity()
    assert a.tails == "one" and a.min_batches == 1
    assert fd.Austerity(tails="two", min_batches=3).changed() == {"tails": "two", "min_batches": 3}
    with pytest.raises(ValueError, match="tails must be 'one' or 'two'"):
        fd.Austerity(tails="both")
    with pytest.raises(ValueError, match="min_batches must be an integer >= 1"):
        fd.Austerity(min_batches=0)


# ------------------------------------------------ expected rows (Korattikara et al.)
#: the paper's Fig. 5 test (Chen, Mansinghka & Ghahramani 2016): one-sided eps = 0.01,
#: minibatches of 100, no test before 3 of them
FIG5_TEST = {"batch_size": 100, "min_batches": 3, "eps": 0.01, "tails": "one"}


def _simulated_rows(pop, mu0, R, rng, *, batch_size, min_batches, eps, tails, chunk=500):
    """Rows the real test uses, ``R`` times: each a fresh shuffle of the population ``pop``
    cut into nested minibatches, :func:`stop_rule` applied after every one (with the
    sample sd, as the sampler does); the first stop's rows."""
    N = pop.size
    n = np.minimum(np.arange(1, -(-N // batch_size) + 1) * batch_size, N)
    K = n.size
    c = pop - pop.mean()  # centred: Σc² − n·c̄² without cancellation
    out = []
    for start in range(0, R, chunk):
        r = min(chunk, R - start)
        perm = rng.permuted(np.broadcast_to(c, (r, N)), axis=1)
        mean = np.cumsum(perm, axis=1)[:, n - 1] / n
        m2 = np.maximum(np.cumsum(perm**2, axis=1)[:, n - 1] - n * mean**2, 0.0)
        stop, _, _ = aus.stop_rule(
            np.broadcast_to(n, (r, K)),
            mean + pop.mean(),
            m2,
            np.full((r, K), mu0),
            N,
            eps,
            tails=tails,
            rounds=np.broadcast_to(np.arange(1, K + 1), (r, K)),
            min_batches=min_batches,
        )
        out.append(n[np.argmax(stop, axis=1)])  # the last stage (all N rows) always stops
    return np.concatenate(out).astype(float)


def test_expected_data_used_against_the_real_test():
    """Korattikara et al.'s expected rows (:func:`expected_data_used`) against the mean
    rows of the real sequential test, simulated by shuffling the population 2,000 times
    per case, at the paper's Fig. 5 settings (N = 5,000: 50 minibatches of 100): a normal
    population decided at the first test, after several stages and near the threshold,
    and a skewed one (exponential, skewness 2) after a few and many stages.

    Tolerance: 4 Monte Carlo se plus 3 % of the rows for the Gaussian approximation
    (Gaussian nested means, the sample sd replaced by σ). With 20,000 shuffles per case
    the gaps were at most 0.3 % for the normal population (within 1.3 se) and 2.2 % for
    the exponential one (7.9 se: its sample mean is skewed and correlated with its sample
    sd at n = 300, which the approximation ignores). Negative control: the prediction
    with σ off by 20 % (more rows) must fail the same check where the test takes several
    stages."""
    rng = np.random.default_rng(20140)
    N, R = 5000, 2000
    pops = {"normal": rng.standard_normal(N), "exponential": rng.exponential(1.0, N)}
    cases = [  # (population, θ = (μ − μ₀)/σ, what the case is)
        ("normal", 0.3, "first"),
        ("normal", 0.06, "several"),
        ("normal", 0.01, "near"),
        ("exponential", 0.06, "several"),
        ("exponential", 0.02, "near"),
    ]
    seen = []
    for name, theta, kind in cases:
        pop = pops[name]
        mu, sigma = float(pop.mean()), float(pop.std())
        mu0 = mu - theta * sigma
        rows = _simulated_rows(pop, mu0, R, rng, **FIG5_TEST)
        sim, se = float(rows.mean()), float(rows.std(ddof=1) / math.sqrt(R))
        tol = 4 * se + 0.03 * sim
        pred = float(aus.expected_data_used(mu, sigma, mu0, N, **FIG5_TEST))
        seen.append((name, theta, round(pred, 1), round(sim, 1), round(se, 2)))
        assert abs(pred - sim) <= tol, (name, theta, pred, sim, se, tol)
        # the case is what it says
        if kind == "first":
            assert np.mean(rows == 300) > 0.95, seen
        elif kind == "several":
            assert 3 < sim / 100 < 20, seen
        else:
            assert sim > 0.4 * N, seen  # (the FPC stops most before the last minibatch)
        if name == "normal" and kind == "several":
            # negative control: σ 20 % too large, at a case where the spread matters
            wrong = float(aus.expected_data_used(mu, 1.2 * sigma, mu0, N, **FIG5_TEST))
            assert abs(wrong - sim) > 2 * tol, (wrong, sim, tol)


def test_expected_data_used_exact_cases():
    """The recursion against closed forms. One test before the exact stage (N = 200, two
    minibatches of 100): 100 + 100·P(the test does not stop), a normal probability; two
    tests (N = 300): the second stage's survival is a bivariate normal rectangle with the
    nested means' covariance (Cov = Var of the larger sample). And the edges: eps = 0 and
    no test possible give N, σ = 0 the first test's rows, an infinite μ₀ no row; the sign
    of μ − μ₀ does not matter; bad input is refused."""
    eps = 0.05
    for N in (200, 300):
        mu, sigma = 0.0, 1.0
        mu0 = np.array([-0.2, -0.05, 0.0, 0.1, 0.3])
        got = aus.expected_data_used(mu, sigma, mu0, N, batch_size=100, eps=eps, tails="two")
        n = np.arange(100, N, 100)
        v = sigma**2 * (N - n) / (n * (N - 1))  # Var of the nested means
        half = stats.t.isf(eps / 2, n - 1) * sigma * math.sqrt(N / (N - 1)) * np.sqrt(v)
        cov = np.minimum.outer(v, v)  # Cov(l̄_i, l̄_j) = Var of the later (smaller) one
        want = []
        for m0 in mu0:
            total = 100.0
            for k in range(1, n.size + 1):  # P(no stop at stages 1..k): a box probability
                mvn = stats.multivariate_normal(np.full(k, mu - m0), cov[:k, :k])
                lo, hi = -half[:k], half[:k]
                if k == 1:
                    alive = stats.norm.cdf(hi[0], mu - m0, math.sqrt(v[0])) - stats.norm.cdf(
                        lo[0], mu - m0, math.sqrt(v[0])
                    )
                else:
                    alive = mvn.cdf(hi, lower_limit=lo)
                total += 100.0 * alive
            want.append(total)
        np.testing.assert_allclose(got, want, rtol=2e-4)
    N = 1000
    kw = {"batch_size": 100, "min_batches": 2, "eps": 0.05}
    assert aus.expected_data_used(0.1, 1.0, 0.0, N, **{**kw, "eps": 0.0}) == N
    assert aus.expected_data_used(0.1, 1.0, 0.0, N, **{**kw, "min_batches": 10}) == N
    assert aus.expected_data_used(0.1, 0.0, 0.0, N, **kw) == 200  # every sample sd zero
    np.testing.assert_array_equal(
        aus.expected_data_used(0.0, 1.0, [np.inf, -np.inf], N, **kw), [0.0, 0.0]
    )
    both = aus.expected_data_used(0.0, 1.0, [[0.02], [-0.02]], N, **kw)
    assert both.shape == (2, 1) and both[0, 0] == pytest.approx(both[1, 0], rel=1e-12)
    assert 200 < both[0, 0] < N
    default = aus.expected_data_used(0.0, 1.0, 0.001, 10_000)  # Austerity's defaults
    assert default == pytest.approx(
        aus.expected_data_used(0.0, 1.0, 0.001, 10_000, batch_size=500, eps=0.01)
    )
    bad = [
        ({"N": 0}, "N must be a positive integer"),
        ({"N": 10.0}, "N must be a positive integer"),
        ({"N": True}, "N must be a positive integer"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"min_batches": 0}, "min_batches must be an integer >= 1"),
        ({"eps": 1.0}, "eps must be in"),
        ({"tails": "left"}, "tails must be 'one' or 'two'"),
        ({"sigma": -1.0}, "sigma must be finite and >= 0"),
        ({"mu": np.nan}, "mu must be finite"),
        ({"mu0": np.nan}, "mu0 must not be NaN"),
        ({"mu": [0.0, 1.0], "mu0": [0.0, 1.0, 2.0]}, "must broadcast together"),
    ]
    for change, match in bad:
        args = {"mu": 0.0, "sigma": 1.0, "mu0": 0.0, "N": 1000, **change}
        with pytest.raises(ValueError, match=match):
            aus.expected_data_used(**args)


@pytest.mark.parametrize("cv", [True, False])
@pytest.mark.parametrize("eps", [0.0, pytest.param(1e-7, marks=pytest.mark.slow)])
def test_tiny_eps_reproduces_exact_mh(eps, cv):
    """Given the same proposals and uniforms, eps = 0 (and a tiny eps) takes exactly the
    exact-MH decisions, with and without control variates; the draw order is the
    documented one."""
    X, y, th0 = _data(1500, seed=1)
    cov = np.diag([0.06, 0.07, 0.07]) ** 2
    init = th0 + 0.02
    S, C, seed = 120, 2, 5
    res = fd.sample(
        MODEL,
        (X, y),
        fd.Austerity(eps=eps, batch_size=150, control_variates=cv),
        fd.RWMH(step_size=1.0),
        client="synchronous",
        num_warmup=0,
        num_samples=S,
        chains=C,
        seed=seed,
        placement=fd.Placement(n_shards=3),
        init=init,
        precondition=cov,
    )
    assert res.info["control_variates"] is cv
    L = np.linalg.cholesky(cov)

    def log_post(t):
        return float(
            MODEL.log_prior(t[None])[0] + MODEL.loglik(MODEL.linear_predictor(t[None], X), y).sum()
        )

    for c in range(C):
        g = stream(seed, ROLE_AUSTERITY, 0, c)
        pos, acc = init.copy(), []
        out = np.empty((S, 3))
        for i in range(S):
            prop = pos + tril_matvec(L, g.standard_normal(3))
            neg_log_u = g.standard_exponential()
            a = log_post(prop) - log_post(pos) > -neg_log_u
            pos = prop if a else pos
            out[i] = pos
            acc.append(a)
        np.testing.assert_array_equal(res.stats["accepted"][c], np.array(acc))
        np.testing.assert_allclose(res.samples[c], out, rtol=0, atol=1e-12)
    used = res.stats["data_used"]
    if eps == 0.0:
        assert np.all(used == 1500)
    else:
        assert used.mean() < 1500  # the test really stopped early sometimes
    assert 0.05 < res.stats["accepted"].mean() < 0.95


def _fixed_move_data_used(n: int, eps: float, batch: int) -> float:
    X, y, th0 = _data(n, seed=2)
    v = np.ones(3) / math.sqrt(3)
    log_u = -np.random.default_rng(3).standard_exponential(80)
    r = aus.run_decisions(
        MODEL,
        (X, y),
        th0,
        th0 + 0.2 * v,
        log_u,
        eps=eps,
        batch_size=batch,
        seed=4,
        n_shards=4,
        exact=False,
    )
    return r["by_eps"][0]["mean_data_used"]


def test_data_used_sublinear_in_n():
    """Rows used per decision of a fixed move, N = 10^3 … 10^5: log-log slope ≤ 0.5."""
    ns = [1_000, 10_000, 100_000]
    used = [_fixed_move_data_used(n, 0.05, 100) for n in ns]
    slope = aus.loglog_slope(ns, used)
    assert slope <= 0.5, (used, slope)
    assert used[-1] / ns[-1] < 0.1 * used[0] / ns[0]  # the fraction falls by > 10x


def _moves(X, y, k, seed):
    """RWMH-like moves from the Laplace approximation, with uniforms."""
    th, cov = _map_and_cov(X, y)
    L = np.linalg.cholesky(cov)
    rng = np.random.default_rng(seed)
    thetas = th + rng.standard_normal((k, 3)) @ L.T
    props = thetas + (2.38 / math.sqrt(3)) * rng.standard_normal((k, 3)) @ L.T
    return thetas, props, -rng.standard_exponential(k)


@pytest.mark.slow
def test_decision_error_shrinks_with_eps():
    """Share of decisions that differ from exact MH on the same (θ, θ′, u): falls with eps
    (common random numbers across eps)."""
    X, y, _ = _data(10_000, seed=6)
    thetas, props, log_u = _moves(X, y, 300, seed=7)
    eps_list = [0.3, 0.1, 0.01, 1e-4]
    r = aus.run_decisions(
        MODEL, (X, y), thetas, props, log_u, eps=eps_list, batch_size=500, seed=8, n_shards=3
    )
    err = np.array([b["error_rate"] for b in r["by_eps"]])
    used = np.array([b["mean_data_used"] for b in r["by_eps"]])
    assert err[0] >= 0.03, err  # the test can see an error at a loose eps
    assert np.all(np.diff(err) <= 0.01), err  # (nearly) monotone
    assert err[-1] <= 0.01 and err[-1] < err[0] / 4, err
    assert np.all(np.diff(used) > 0), used  # a tighter test costs more data


#: the tests reading :func:`exact_10k`: on one xdist worker, so that it is computed once
EXACT_10K_GROUP = pytest.mark.xdist_group("austerity-exact-10k")


@pytest.fixture(scope="module")
def exact_10k():
    """The exact posterior of a 10⁴-row logistic problem (3 parameters, N(0, 1) prior), the
    bias tests' reference: its mean and sd by quadrature on the Laplace approximation's
    axes (references.grid_moments, 13³ points over ±6 sd: 25³ over ±8 sd agree to 2e-8 sd
    in the mean and 1e-7 in the sd), no Markov chain and nothing of the package."""
    X, y, _ = _data(10_000, seed=9)
    th, cov = _map_and_cov(X, y)
    exact = R.grid_moments(R.logistic_logpost(X, y, 1.0), th, np.linalg.cholesky(cov), 13, 6.0)
    assert exact.boundary_logratio < -15, exact.boundary_logratio  # the box holds the mass
    common = {
        "client": "synchronous",
        "num_warmup": 200,
        "chains": 16,
        "seed": 10,
        "placement": fd.Placement(n_shards=2),
        "progress": False,
    }
    return X, y, common, exact


def _close_to_exact(exact: R.Moments, aust: fd.Result) -> np.ndarray:
    """|Δmean| ≤ 0.1 sd + 2 se for every parameter, where se is the run's MC standard error
    of its mean (from its ESS), required ≤ 0.06 sd so that the check has power (it fails
    for a bias of ~0.25 sd); returns the absolute relative error of the posterior sd.

    The runs' 16 × 410 draws give se ≈ 0.04 sd, what 16 × 550 gave beside a 16 × 1500
    exact chain's own MC error when the reference was a chain (√(0.036² + 0.021²))."""
    sd = exact.sd
    se = np.asarray(diagnostics.mcse_mean(aust.samples))
    delta = aust.samples.mean(axis=(0, 1)) - exact.mean
    assert np.all(se <= 0.06 * sd), se / sd
    assert np.all(np.abs(delta) <= 0.1 * sd + 2 * se), (delta / sd, se / sd)
    return np.abs(aust.samples.std(axis=(0, 1), ddof=1) / sd - 1)


@pytest.mark.slow
@pytest.mark.full_grid  # plain austerity; the default's is covered (tests/test_tiers.py)
@EXACT_10K_GROUP
def test_posterior_mean_close_to_exact_posterior(exact_10k):
    """Plain austerity, eps = 0.01 on 10^4 rows: posterior mean within 0.1 posterior sd of
    the exact posterior, up to Monte Carlo error (see _close_to_exact). And eps = 0.3 is
    visibly worse (inflated posterior sd): the error shrinks with eps."""
    X, y, common, exact = exact_10k
    aust = fd.sample(
        MODEL,
        (X, y),
        fd.Austerity(eps=0.01, batch_size=2000, control_variates=False),
        num_samples=410,
        **common,
    )
    loose = fd.sample(
        MODEL,
        (X, y),
        fd.Austerity(eps=0.3, batch_size=2000, control_variates=False),
        **{**common, "num_warmup": 100, "num_samples": 200},
    )
    sd_err = _close_to_exact(exact, aust)
    sd_err_loose = np.abs(loose.samples.std(axis=(0, 1), ddof=1) / exact.sd - 1)
    assert sd_err.max() < 0.1, sd_err
    assert sd_err_loose.min() > sd_err.max(), (sd_err_loose, sd_err)
    assert aust.info["data_used_fraction"] > loose.info["data_used_fraction"]


@pytest.mark.slow
@EXACT_10K_GROUP
def test_control_variates_close_to_exact_posterior_and_error_shrinks_with_eps(exact_10k):
    """Control variates with the defaults (eps = 0.01, batch 500) on 10^4 rows: posterior
    mean within 0.1 posterior sd of the exact posterior for every parameter, up to Monte
    Carlo error (see _close_to_exact), posterior sd within 10 %.

    The error shrinks with eps, measured on the same problem where it is resolvable: the
    share of decisions that differ from exact MH for the same (θ, θ′, u) — the kernel's
    own error (a bound on the one-step total-variation distance to exact MH) — on 4000
    moves from points of the Laplace approximation with the run's adapted RWMH step, with
    common random numbers across eps. With control variates even eps = 0.9 moves the
    posterior by less than CI-sized runs can resolve, so the posterior-mean comparison
    alone could not show the trend. Negative control: plain austerity on the same moves at
    eps = 0.9 errs far more often (the measurement sees errors where they are)."""
    X, y, common, exact = exact_10k
    aust = fd.sample(MODEL, (X, y), algorithm="austerity", num_samples=410, **common)
    assert aust.info["control_variates"] is True and aust.info["eps"] == 0.01
    sd_err = _close_to_exact(exact, aust)
    assert sd_err.max() < 0.1, sd_err
    # the decisions' error against exact MH, on RWMH moves from the (Laplace) posterior
    kp = aust.info["kernel_params"][0]
    step, tril = float(kp["step_size"]), np.asarray(kp["scale_tril"], float)
    th, cov = _map_and_cov(X, y)
    rng = np.random.default_rng(25)
    k = 4000
    thetas = th + rng.standard_normal((k, 3)) @ np.linalg.cholesky(cov).T
    props = thetas + step * rng.standard_normal((k, 3)) @ tril.T
    log_u = -rng.standard_exponential(k)
    eps_list = [0.9, 0.3, 0.1, 0.01]
    r = aus.run_decisions(
        MODEL,
        (X, y),
        thetas,
        props,
        log_u,
        eps=eps_list,
        seed=26,
        n_shards=2,
        control_variates=True,
    )
    err = np.array([b["error_rate"] for b in r["by_eps"]])
    used = np.array([b["mean_data_used"] for b in r["by_eps"]])
    assert err[-1] <= 0.002, err
    assert err[0] >= 3 * max(err[-1], 1 / k), err  # larger at a large eps
    assert np.all(np.diff(err) <= 0.002), err  # (nearly) monotone
    assert np.all(np.diff(used) > 0), used  # a tighter test costs more data
    plain = aus.run_decisions(
        MODEL, (X, y), thetas, props, log_u, eps=0.9, seed=26, n_shards=2, exact=True
    )
    assert plain["by_eps"][0]["error_rate"] > 10 * err[0], (plain["by_eps"][0], err)


# ------------------------------------------------------------------ control variates
_GOLDEN = pathlib.Path(__file__).with_name("data") / "austerity_golden.npz"


def _golden_module():
    spec = importlib.util.spec_from_file_location(
        "make_austerity_golden", _GOLDEN.with_name("make_austerity_golden.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_control_variates_off_is_the_plain_sampler_bit_for_bit(recorded_cpu: None) -> None:
    """control_variates=False reproduces, bit for bit, the draws and statistics recorded
    from the plain sampler (tests/data/make_austerity_golden.py, re-recorded when the rows
    became keyed by row): a fixed-start run and a default (MAP start,
    Laplace preconditioner) run, warm-up adaptation included. Negative control: the same
    runs with control variates use far fewer rows, so the comparison sees a change."""
    gold = _golden_module()
    ref = np.load(_GOLDEN)
    for name in gold.RUNS:
        out = gold.run(name, control_variates=False)
        assert sorted(out) == sorted(k for k in ref.files if k.startswith(name + "_"))
        for key, value in out.items():
            np.testing.assert_array_equal(value, ref[key], err_msg=key)
        cv = gold.run(name)
        assert cv[f"{name}_data_used"].mean() < 0.5 * ref[f"{name}_data_used"].mean()


def _model_problem(name: str):
    """A 1200-row problem of each model, with its log posterior written independently."""
    rng = np.random.default_rng(30)
    N = 1200
    X = np.c_[np.ones(N), rng.standard_normal((N, 2))]
    if name == "logistic":
        y = (rng.random(N) < expit(X @ np.array([0.3, 1.0, -0.5]))).astype(np.int64)
        return fd.LogisticRegression(), X, y, R.logistic_logpost(X, y, 1.0), 3
    if name == "robust":
        y = X @ np.array([0.5, 1.0, -0.7]) + rng.standard_t(4.0, N)
        return (
            fd.RobustRegression(nu=4.0, scale=1.0, prior="laplace", prior_scale=1.0),
            X,
            y,
            R.robust_logpost(X, y, 4.0, 1.0, 1.0),
            3,
        )
    W = np.array([[0.5, -1.0, 0.3], [0.0, 0.8, 0.6], [-0.4, 0.2, -0.9]])
    eta = X @ W.T
    prob = np.exp(eta - eta.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    y = (rng.random(N)[:, None] > np.cumsum(prob, axis=1)).sum(axis=1).astype(np.int64)
    return fd.SoftmaxRegression(n_classes=3), X, y, R.softmax_logpost(X, y, 3, 1.0), 9


def _exact_mh_chain(logpost, start, step, L, g, S):
    """Exact full-data RWMH with the sampler's documented draw order: (accepted, draws)."""
    P = start.size
    pos, lp = start.copy(), float(logpost(start[None])[0])
    acc, out = np.zeros(S, dtype=bool), np.empty((S, P))
    for i in range(S):
        prop = pos + step * tril_matvec(L, g.standard_normal(P))
        neg_log_u = g.standard_exponential()
        lp_prop = float(logpost(prop[None])[0])
        if lp_prop - lp > -neg_log_u:
            pos, lp, acc[i] = prop, lp_prop, True
        out[i] = pos
    return acc, out


@pytest.mark.parametrize(  # softmax's (the longest) with the slow tests
    "name", ["logistic", "robust", pytest.param("softmax", marks=pytest.mark.slow)]
)
def test_control_variates_eps0_is_exact_mh(name):
    """eps = 0 with control variates (bounds tight at the MAP): every decision is the exact
    MH decision computed here from an independent full-data log posterior
    (tests/references.py), given the same proposals and uniforms, and uses all N rows.
    For logistic, robust and softmax regression. Negative control (logistic): dropping the
    collapsed bound's share Σ_all Δβ from the threshold makes decisions wrong."""
    model, X, y, logpost, P = _model_problem(name)
    mode, cov = R.laplace_approximation(logpost, np.zeros(P))
    L = np.linalg.cholesky(cov)
    step = 2.38 / math.sqrt(P)
    S, C, seed = 60, 2, 31
    kw = {
        "algorithm": fd.Austerity(eps=0.0, batch_size=250),
        "kernel": fd.RWMH(step_size=step),
        "client": "synchronous",
        "num_warmup": 0,
        "num_samples": S,
        "chains": C,
        "seed": seed,
        "placement": fd.Placement(n_shards=3),
        "init": mode,
        "precondition": cov,
    }
    res = fd.sample(model, (X, y), **kw)
    assert res.info["control_variates"] is True and res.info["bounds"] == "map"
    flat = res.samples.reshape(C, S, P)
    for c in range(C):
        acc, out = _exact_mh_chain(logpost, mode, step, L, stream(seed, ROLE_AUSTERITY, 0, c), S)
        np.testing.assert_array_equal(res.stats["accepted"][c], acc)
        np.testing.assert_allclose(flat[c], out, rtol=0, atol=1e-12)
    assert np.all(res.stats["data_used"] == X.shape[0])
    assert 0.05 < res.stats["accepted"].mean() < 0.95
    if name == "logistic":
        mp = pytest.MonkeyPatch()
        mp.setattr(aus, "bound_difference", lambda bound, t, p: np.zeros(len(t)))
        try:
            bad = fd.sample(model, (X, y), **kw)
        finally:
            mp.undo()
        assert not np.array_equal(bad.stats["accepted"], res.stats["accepted"])


def test_bound_difference_matches_explicit_sums():
    """Σ_all Δβ from the collapsed statistics equals the explicit per-row sum."""
    model, X, y, _, P = _model_problem("softmax")
    rng = np.random.default_rng(32)
    th_hat = rng.normal(scale=0.5, size=P)
    eta_hat = model.linear_predictor(th_hat[None], X)[0]
    xi = model.tuned_xi(eta_hat, y)
    bound = model.suffstats(X, y, xi)
    th, pr = rng.normal(size=(4, P)), rng.normal(size=(4, P))
    lb = lambda t: model.logbound(model.linear_predictor(t, X), y, xi).sum(axis=1)  # noqa: E731
    np.testing.assert_allclose(
        aus.bound_difference(bound, th, pr), lb(pr) - lb(th), rtol=1e-9, atol=1e-9
    )


#: CI only: the sublinear data use in test_data_used_sublinear_in_n (a fixed move), the
#: sampler with control variates in test_control_variates_close_to_exact_posterior_and_…
@pytest.mark.full_e2e
@pytest.mark.slow
def test_control_variates_sublinear_with_posterior_scaled_proposals():
    """Rows per decision of the sampler as a user runs it (RWMH, default warm-up adaptation:
    the moves shrink as 1/√N), N = 10³ … 10⁵: log-log slope ≤ 0.2 with control variates;
    plain austerity beside it, on the same data, grows almost linearly (slope > 0.5). The
    contrast needs one chain (measured: slope 0.85 and 0.91 with one chain, seeds 24 and
    25; 0.84 with two)."""
    ns = [1_000, 10_000, 100_000]
    cv_used, plain_used, scale = [], [], []
    kw = {
        "client": "synchronous",
        "seed": 24,
        "placement": fd.Placement(n_shards=4),
        "progress": False,
    }
    for n in ns:
        X, y, _ = _data(n, seed=23)
        cv = fd.sample(MODEL, (X, y), "austerity", chains=4, num_warmup=200, num_samples=300, **kw)
        plain = fd.sample(
            MODEL,
            (X, y),
            fd.Austerity(control_variates=False),
            chains=1,
            num_warmup=100,
            num_samples=50,
            **kw,
        )
        cv_used.append(cv.stats["data_used"].mean())
        plain_used.append(plain.stats["data_used"].mean())
        kp = cv.info["kernel_params"][0]
        scale.append(kp["step_size"] * np.sqrt(np.sum(np.square(kp["scale_tril"]), axis=1)))
    slope_cv = aus.loglog_slope(ns, cv_used)
    slope_plain = aus.loglog_slope(ns, plain_used)
    # the proposals are posterior-scaled: their sd falls by ~√10 per decade
    ratio = scale[0] / scale[-1]
    assert np.all((ratio > 5) & (ratio < 20)), ratio
    assert slope_cv <= 0.2, (cv_used, slope_cv)
    assert slope_plain > 0.5, (plain_used, slope_plain)
    assert cv_used[-1] < 0.05 * plain_used[-1], (cv_used, plain_used)


# ------------------------------------------------------------ minibatches across shards
@pytest.mark.slow  # statistical (600 decisions), with its negative control
def test_shard_selection_unbiased():
    """Every row equally likely in every round of a decision, whatever the shard sizes;
    no row twice in a decision; the chains' rows independent. Negative control: rows
    keyed without the chain (every chain the same rows) are caught."""
    N, sizes, batch, R = 1000, [100, 300, 600], 100, 600
    X, y, th0 = _data(N, seed=11)
    transport, specs = _transport(X, y, sizes, seed=12)
    tester = aus.SequentialTester(
        transport, specs, R, eps=0.0, batch_size=batch, seed=13, record_rows=True
    )
    thetas = np.tile(th0, (R, 1))
    dec = tester.decide(thetas, thetas + 0.3, np.zeros(R))
    assert np.all(dec.data_used == N) and dec.round_trips == N // batch
    for r in range(R):
        allr = np.concatenate(dec.rows[r])
        assert allr.size == N and np.unique(allr).size == N
    p = batch / N
    for rnd in (0, 1, 5, 9):
        counts = np.bincount(np.concatenate([dec.rows[r][rnd] for r in range(R)]), minlength=N)
        chi2 = float(np.sum((counts - R * p) ** 2) / (R * p * (1 - p)))
        assert stats.chi2.sf(chi2, N - 1) > 1e-3, (rnd, chi2)
        shard_tot = np.add.reduceat(counts, [0, 100, 400])
        assert stats.chisquare(shard_tot, R * batch * np.array(sizes) / N).pvalue > 1e-3

    # negative control: every chain drawing the same rows must fail
    real = aus.permuted_rows
    mp = pytest.MonkeyPatch()
    mp.setattr(aus, "permuted_rows", lambda key, n, start, count: real(7, n, start, count))
    try:
        bad = aus.SequentialTester(
            transport, specs, R, eps=0.0, batch_size=batch, seed=13, record_rows=True
        ).decide(thetas, thetas + 0.3, np.zeros(R))
    finally:
        mp.undo()
    counts = np.bincount(np.concatenate([bad.rows[r][0] for r in range(R)]), minlength=N)
    chi2 = float(np.sum((counts - R * p) ** 2) / (R * p * (1 - p)))
    assert stats.chi2.sf(chi2, N - 1) < 1e-6


def test_rows_keyed_by_row_not_by_shard():
    """The rows a decision draws, its statistics and its outcome are the same bits for
    every partition of the rows into shards (drawn on the driver from a keyed permutation
    of all N rows, summed in draw order); a huge population costs O(rows drawn)."""
    N = 1000
    X, y, th0 = _data(N, seed=21)
    S = 3
    thetas = np.tile(th0, (S, 1))
    props = thetas + np.array([[0.05], [-0.03], [0.02]])
    outs = []
    for sizes in ([1000], [100, 300, 600], [250] * 4):
        transport, specs = _transport(X, y, sizes, seed=22)
        tester = aus.SequentialTester(
            transport, specs, S, eps=0.05, batch_size=64, seed=23, record_rows=True
        )
        outs.append([tester.decide(thetas, props, np.zeros(S)) for _ in range(3)])
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert np.array_equal(a.accept, b.accept) and np.array_equal(a.mean, b.mean)
            assert np.array_equal(a.p_value, b.p_value)
            for ra, rb in zip(a.rows, b.rows, strict=True):
                assert all(np.array_equal(u, v) for u, v in zip(ra, rb, strict=True))
    assert not np.array_equal(outs[0][0].rows[0][0], outs[0][1].rows[0][0])  # new decision
    big = 3 * 10**9  # beyond numpy's multivariate hypergeometric (10⁹)
    rows = np.concatenate([aus.permuted_rows(k, big, 0, 500) for k in range(200)])
    assert rows.min() >= 0 and rows.max() < big
    assert all(np.unique(rows[i : i + 500]).size == 500 for i in range(0, rows.size, 500))
    thirds = np.bincount(rows * 3 // big, minlength=3)
    assert stats.chisquare(thirds).pvalue > 1e-3


class _Spy:
    """Wraps a transport and records which shards each call reached."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def call_some(self, method, per_shard):
        self.calls.append(sorted(per_shard))
        return self.inner.call_some(method, per_shard)


def test_round_trips_reach_the_drawn_shards_only_and_carry_many_minibatches(monkeypatch):
    """A trip reaches only the shards holding its rows; at eps = 0 (which never stops
    early) one trip carries every minibatch, up to TRIP_ROWS rows a trip; the decision is
    the same however many minibatches a trip carries."""
    X, y, th0 = _data(2000, seed=14)
    transport, specs = _transport(X, y, [200] * 10)
    decisions = []
    for trip_rows in (3, aus.TRIP_ROWS):  # one minibatch of 3 rows a trip, then all
        monkeypatch.setattr(aus, "TRIP_ROWS", trip_rows)
        spy = _Spy(transport)
        tester = aus.SequentialTester(spy, specs, 1, eps=0.0, batch_size=3, seed=15)
        before = transport.round_trips
        dec = tester.decide(th0[None], th0[None] + 0.1, np.zeros(1))
        assert transport.round_trips - before == dec.round_trips == len(spy.calls)
        assert dec.data_used[0] == dec.evaluated[0] == 2000
        decisions.append(dec)
        if trip_rows == 3:
            assert dec.round_trips == math.ceil(2000 / 3)
            assert max(len(c) for c in spy.calls) <= 3
        else:
            assert dec.round_trips == 1 and len(spy.calls[0]) == 10
    assert decisions[0].accept[0] == decisions[1].accept[0]
    assert decisions[0].mean[0] == decisions[1].mean[0]
    np.testing.assert_array_equal(decisions[0].rounds, decisions[1].rounds)


def test_shard_interface_for_add_on_samplers():
    """Austerity reaches a shard only through its public interface: read-only rows (a
    full pass or a gather, with tight points) and the named operations (no arbitrary
    callable, no writes into the shard's attributes, no state kept there)."""
    from flymc_dist.shard import Shard

    X, y, th0 = _data(300, seed=17)
    transport, specs = _transport(X, y, [100, 200])
    shard = transport.host.shards[1]
    ((Xs, ys, xis),) = list(shard.blocks())
    np.testing.assert_array_equal(Xs, X[100:])
    np.testing.assert_array_equal(ys, y[100:])
    with pytest.raises(ValueError, match="read-only"):
        Xs[0, 0] = 1.0
    assert xis is None  # austerity sets tight points only for control variates
    Xr, yr, _ = shard.rows_at(np.array([5, 0]))  # a gather: new arrays
    np.testing.assert_array_equal(Xr, X[[105, 100]])
    np.testing.assert_array_equal(yr, y[[105, 100]])
    assert not hasattr(Shard, "apply")
    # only functions their module marked as shard operations run, by "module:function"
    for name in ("no_such_operation", "numpy:sum", "flymc_dist.no_such:f", "os:system"):
        with pytest.raises(ValueError, match="unknown shard operation"):
            transport.call("operation", name)
    assert aus.OP_BATCH == "flymc_dist.austerity.shard:shard_batch"
    before = dict(vars(shard))
    tester = aus.SequentialTester(transport, specs, 2, eps=0.0, batch_size=50, seed=18)
    tester.decide(np.tile(th0, (2, 1)), np.tile(th0 + 0.1, (2, 1)), np.zeros(2))
    assert set(vars(shard)) == set(before)  # no attribute added to the shard
    assert shard.extension("austerity", dict) == {}  # no state kept in its slot
    assert shard.total_queries == 2 * 2 * 200  # eps = 0: every row of the shard, twice


def test_compiled_dots_and_minibatch_sums_are_numpys_bits():
    """The test trips' hot loops keep numpy's bits (the draws do not move): the shards'
    compiled row products (``pair_dots``, numpy's pairwise order, past 128 features too)
    against ``(X[r] * θ).sum(-1)``, for float32 and float64 rows and several outputs; the
    driver's minibatch sums, taken as the rows of one array, against one minibatch at a
    time (a shorter last one, infinite and NaN values among them). Negative control: a
    plain left-to-right sum differs in the last bits for some row."""
    from flymc_dist._compiled import pair_dots, pairwise_sum

    rng = np.random.default_rng(5)
    for n in (*range(0, 140), 255, 256, 1000, 4099):
        a = rng.standard_normal(n) * rng.exponential(5.0, n)
        assert np.float64(pairwise_sum(a, 0, n)).tobytes() == a.sum().tobytes()
    plain_differs = False
    for dtype in (np.float32, np.float64):
        for D, E in ((1, 1), (3, 1), (21, 3), (51, 1), (129, 2), (300, 1)):
            X = (rng.standard_normal((120, D)) * rng.exponential(3.0, (120, 1))).astype(dtype)
            seg = np.array([0, 50, 50, 120])
            th, pr = rng.normal(0, 5, (3, E * D)), rng.normal(0, 1, (3, E * D))
            got = np.empty((2, 120, E))
            pair_dots(X, seg, th, pr, got)
            want = np.empty_like(got)
            plain = np.empty_like(got)
            for j in range(3):
                a, b = seg[j], seg[j + 1]
                for i, at in enumerate((th, pr)):
                    pts = at[j].reshape(E, D)
                    want[i, a:b] = (X[a:b, None, :] * pts[None]).sum(axis=2)
                    for r in range(a, b):
                        for e in range(E):
                            plain[i, r, e] = sum(float(X[r, d]) * pts[e, d] for d in range(D))
            assert got.tobytes() == want.tobytes(), (dtype, D, E)
            plain_differs |= plain.tobytes() != want.tobytes()
    assert plain_differs
    d = rng.standard_normal(1037) * 3
    d[[7, 500, 501]] = [np.inf, -np.inf, np.inf]
    d[900] = np.nan
    for size in (1, 10, 100, 1037, 5000):
        counts, mean, m2 = aus.batch_stats(d, size)
        for i, at in enumerate(range(0, d.size, size)):
            part = d[at : at + size]
            bad = ~np.isfinite(part)
            with np.errstate(invalid="ignore"):  # inf - inf: NaN
                total = float(np.sum(part[bad] if bad.any() else part))
            want_mean = total if bad.any() else total / part.size
            want_m2 = 0.0 if bad.any() else float(np.sum((part - want_mean) ** 2))
            assert counts[i] == part.size
            assert np.float64(mean[i]).tobytes() == np.float64(want_mean).tobytes()
            assert np.float64(m2[i]).tobytes() == np.float64(want_m2).tobytes()
        assert i == counts.size - 1


# ------------------------------------------------------------------------ the API
def test_sample_api_labels_and_stats():
    X, y, _ = _data(3000, seed=16)
    res = fd.sample(
        MODEL,
        (X, y),
        fd.Austerity(eps=0.05, batch_size=300),
        client="synchronous",
        num_warmup=30,
        num_samples=40,
        chains=3,
        seed=17,
        placement=fd.Placement(n_shards=3),
    )
    assert res.approximate and res.info["approximate"] is True
    assert res.info["algorithm"] == "austerity"
    assert res.info["eps"] == 0.05 and res.info["batch_size"] == 300
    assert res.info["tails"] == "one" and res.info["min_batches"] == 1
    assert res.info["control_variates"] is True and res.info["bounds"] == "map"
    assert "APPROXIMATE" in str(res.summary()) and "APPROXIMATE" in repr(res)
    for key in (
        "sampling_seconds",
        "warmup_seconds",
        "n_rows",
        "n_features",
        "n_shards",
        "total_round_trips",
        "setup_queries",
        "map",
        "kernel_params",
        "transport",
    ):
        assert key in res.info, key
    st = res.stats
    assert res.samples.shape == (3, 40, 3) and res.warmup_samples.shape == (3, 30, 3)
    for key in (
        "accepted",
        "acceptance_rate",
        "n_bright",
        "likelihood_queries",
        "round_trips",
        "lp",
        "data_used",
        "test_rounds",
    ):
        assert st[key].shape == (3, 40), key
    assert np.all(st["n_bright"] == st["data_used"])
    # the queries count every row the shards computed: the rows the test took, and (with
    # min_batches 1, as here) at most as many more of a trip's minibatches left unused
    q, used = st["likelihood_queries"], st["data_used"]
    assert np.all((q >= 2 * used) & (q <= 4 * used))
    assert np.all((st["data_used"] >= 300) & (st["data_used"] <= 3000))
    # a trip brings every undecided chain a minibatch at least, doubling from trip to trip
    assert np.all(st["round_trips"] <= st["test_rounds"].max(axis=0))
    assert np.all(st["round_trips"] <= 1 + np.log2(st["test_rounds"].max(axis=0)))
    assert np.all(st["round_trips"] == st["round_trips"][0])  # shared by the chains
    assert np.all(st["acceptance_rate"] == st["accepted"])
    assert np.all(np.isnan(st["lp"]))
    assert st["log_joint"] is st["lp"]  # the former name still reads
    eff = res.efficiency()
    assert 0 < eff["bright_fraction"] <= 1
    moved = np.any(np.diff(res.samples, axis=1) != 0, axis=2)
    np.testing.assert_array_equal(moved, st["accepted"][:, 1:])
    total_iter_trips = int(
        res.stats["round_trips"][0].sum() + res.warmup_stats["round_trips"][0].sum()
    )
    assert res.info["total_round_trips"] >= total_iter_trips


def test_sample_api_reproducible():
    X, y, _ = _data(1000, seed=18)
    kw = {
        "algorithm": fd.Austerity(eps=0.1, batch_size=100),
        "client": "synchronous",
        "num_warmup": 10,
        "num_samples": 20,
        "chains": 2,
        "seed": 3,
    }
    a = fd.sample(MODEL, (X, y), placement=fd.Placement(n_shards=2), **kw)
    b = fd.sample(MODEL, (X, y), placement=fd.Placement(n_shards=2), **kw)
    np.testing.assert_array_equal(a.samples, b.samples)
    np.testing.assert_array_equal(a.stats["data_used"], b.stats["data_used"])


@pytest.mark.parametrize(
    "opts,match",
    [
        ({"eps": 1.0}, "eps"),
        ({"eps": -0.1}, "eps"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"kernel": "mala"}, "rwmh"),
        ({"kernel": "slice"}, "rwmh"),
        ({"resume": True}, "resume"),
        ({"control_variates": "yes"}, "control_variates"),
        ({"control_variates": 1}, "control_variates"),
        ({"control_variates": None}, "control_variates"),
    ],
)
def test_sample_api_rejects_bad_options(opts, match):
    """A bad option of fd.Austerity is refused when the object is made; a kernel it does
    not run, or a resume without a trace, by fd.sample."""
    X, y, _ = _data(200, seed=19)
    fields = {f.name for f in dataclasses.fields(fd.Austerity)}
    with pytest.raises(ValueError, match=match):
        aus_opts = {k: v for k, v in opts.items() if k in fields}
        fd.sample(
            MODEL,
            (X, y),
            fd.Austerity(**aus_opts),
            client="synchronous",
            num_warmup=0,
            num_samples=2,
            chains=1,
            **{k: v for k, v in opts.items() if k not in fields},
        )


def test_trace_written(tmp_path):
    from flymc_dist.trace import Trace

    X, y, _ = _data(600, seed=20)
    res = fd.sample(
        MODEL,
        (X, y),
        fd.Austerity(batch_size=100),
        client="synchronous",
        num_warmup=5,
        num_samples=7,
        chains=2,
        seed=1,
        trace=str(tmp_path / "t"),
        checkpoint_every=3,
    )
    tr = Trace.open(str(tmp_path / "t"), read_only=True)
    np.testing.assert_array_equal(tr.samples, res.samples)
    np.testing.assert_array_equal(tr.stats["data_used"], res.stats["data_used"])
    assert tr.attrs["algorithm"] == "austerity" and tr.attrs["approximate"] is True


def test_softmax_works():
    """Any GLM model: softmax with K x D parameters, decisions from its per-datum loglik."""
    rng = np.random.default_rng(21)
    X = np.c_[np.ones(900), rng.standard_normal((900, 2))]
    y = rng.integers(0, 3, 900)
    model = fd.SoftmaxRegression(n_classes=3)
    res = fd.sample(
        model,
        (X, y),
        fd.Austerity(batch_size=200),
        client="synchronous",
        num_warmup=10,
        num_samples=10,
        chains=2,
        seed=2,
        placement=fd.Placement(n_shards=2),
    )
    assert res.samples.shape == (2, 10, 3, 3) and res.approximate


# --------------------------------------------------------------------- on a cluster
@pytest.mark.cluster
@pytest.mark.slow
def test_same_draws_on_dask_cluster(tmp_path, local_clusters):
    """The same seed gives identical draws in-process and on Dask actors (2 workers),
    the test trips on the round channel or as Dask RPCs, and with the default layout
    (one shard per worker: before, austerity put its one shard on one worker)."""
    from distributed import Client

    X, y, _ = _data(1200, seed=22)
    path = str(tmp_path / "d.zarr")
    fd.from_numpy(X, y, path, chunk_rows=200)
    kw = {
        "algorithm": fd.Austerity(eps=0.05, batch_size=150),
        "num_warmup": 10,
        "num_samples": 15,
        "chains": 2,
        "seed": 4,
        "placement": fd.Placement(n_shards=3),
    }
    local = fd.sample(MODEL, path, client="synchronous", **kw)
    with Client(local_clusters.get(2), direct_to_workers=True) as client:
        # the test trips on the round channel (the default), then as Dask RPCs
        for channel in ("socket", "dask"):
            place = fd.Placement(n_shards=3, channel=channel)
            remote = fd.sample(MODEL, path, client=client, **{**kw, "placement": place})
            assert remote.info["transport"] == "dask" and remote.info["n_workers"] == 2
            assert remote.info["channel"] == channel
            np.testing.assert_array_equal(local.samples, remote.samples)
            np.testing.assert_array_equal(local.stats["data_used"], remote.stats["data_used"])
            np.testing.assert_array_equal(local.stats["round_trips"], remote.stats["round_trips"])
        # the default layout follows the cluster: one shard on each worker
        default = fd.sample(MODEL, path, client=client, **{**kw, "placement": fd.Placement()})
        assert default.info["n_shards"] == 2 and default.info["n_workers"] == 2
        np.testing.assert_array_equal(local.samples, default.samples)


def test_bench_sublinear_smoke():
    from flymc_dist.bench import sublinear as bench

    r = bench.run_sublinear(
        ns=(1000, 10_000),
        n_decisions=10,
        posterior_warmup=30,
        posterior_samples=30,
        plain_max_n=1000,
        bias_eps=(0.2,),
        bias_rows=2000,
        bias_chains=2,
        bias_warmup=20,
        bias_samples=30,
        bias_batch_size=500,
        error_moves=20,
    )
    assert r["approximate"] is True
    for part in ("fixed", "posterior"):
        for key in ("plain", "cv"):
            s = r[part][key]
            assert len(s["mean_data_used"]) == 2
    f = r["fixed"]
    assert math.isfinite(f["plain"]["slope"]) and math.isfinite(f["cv"]["slope"])
    assert f["plain"]["fraction"][1] < f["plain"]["fraction"][0]
    p = r["posterior"]
    assert p["plain"]["mean_data_used"][1] is None and p["plain"]["slope"] is None  # > max n
    assert math.isfinite(p["cv"]["slope"]) and all(v > 0 for v in p["cv"]["seconds"])
    assert len(r["bias"]["rows"]) == 2  # eps 0.2 without and with control variates
    assert {row["control_variates"] for row in r["bias"]["rows"]} == {False, True}
    text = bench.format(r)
    assert text.startswith("APPROXIMATE") and "log-log slope" in text and "Bias vs eps" in text
    assert "Posterior-scaled" in text and "Fixed move" in text and "--plain-max-n" in text
    assert bench.format is bench.format_sublinear
    only = bench.run_sublinear(
        ns=(1000, 2000), n_decisions=5, plain=False, posterior=False, bias_eps=None
    )
    assert only["fixed"]["plain"] is None and only["posterior"] is None
    assert "control variates" in bench.format(only)
    ooc = bench.run_sublinear(
        ns=(1000, 2000),
        plain=False,
        fixed=False,
        bias_eps=None,
        posterior_warmup=10,
        posterior_samples=10,
        out_of_core=True,
    )["posterior"]
    assert ooc["cv"]["bytes_read_per_iteration"] == [0.0, 0.0]  # in memory
    assert all(b > 0 for b in ooc["cv_out_of_core"]["bytes_read_per_iteration"])
    assert ooc["plain_out_of_core"] is None
    assert "Out of core" in bench.format({"posterior": ooc, "seconds": 1.0})
    with pytest.raises(ValueError, match="nothing to measure"):
        bench.run_sublinear(ns=(1000, 2000), plain=False, control_variates=False)


@pytest.mark.slow  # the bench's quick smoke: test_bench_sublinear_smoke
def test_bench_sublinear_paper_settings():
    """`run_sublinear(paper=True)`: the paper's Fig. 5 settings (one-sided eps = 0.01,
    minibatch 100, no test before 3 of them): no decision reads fewer than 300 rows or
    the whole data set, and the report says which settings ran; Korattikara et al.'s
    expected rows are beside the measured ones, with their ratio."""
    from flymc_dist.bench.sublinear import format_sublinear, run_sublinear

    r = run_sublinear(ns=(250, 400, 1000), paper=True, n_shards=2)
    assert r["paper"] and r["approximate"]
    for row in r["rows"]:
        assert row["mean_data_used"] >= min(300, row["n_rows"])
        # Korattikara et al.'s expected rows beside them: finite, positive, within the data
        for key in ("predicted_data_used", "predicted_over_measured"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert min(300, row["n_rows"]) <= row["predicted_data_used"] <= row["n_rows"]
        assert row["predicted_over_measured"] == pytest.approx(
            row["predicted_data_used"] / row["mean_data_used"]
        )
    assert r["rows"][0]["predicted_data_used"] == 250  # one minibatch short of a test
    text = format_sublinear(r)
    assert "one-sided" in text and "slope" in text
    assert "predicted" in text and "not the run's" in text and "pred/meas" in text
