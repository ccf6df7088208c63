"""The fused hot path: Bernoulli-row proposals, the all-chains z-update, the fused
``log L~`` of the models, speculative z-updates, and when speculation is switched on.

Statistical checks derive their tolerances from the exact sampling distributions
(binomial counts; the two-state Markov chain of each z_n, as in
``tests/test_brightness.py::_stationarity_z``) with a Bonferroni family-wise level of
0.1%; each has a negative control (a deliberately broken variant) that must fail it.
Everything else is exact: bit-for-bit equality of arrays, replies and RNG states.
"""

from __future__ import annotations

import math
import socket

import numpy as np
import pytest
from scipy import stats

import flymc_dist as fd
import flymc_dist.brightness as brightness_mod
import flymc_dist.shard.fused as fused_mod
from flymc_dist._numerics import log_expm1
from flymc_dist.brightness import bernoulli_rows
from flymc_dist.protocol import Request, ShardConfig, ShardSpec
from flymc_dist.shard import Shard
from flymc_dist.transport.dask import _all_remote


def _crit(m: int, level: float = 0.001) -> float:
    """Two-sided Bonferroni critical value for ``m`` z-scores at family-wise ``level``."""
    return float(stats.norm.ppf(1 - level / (2 * m)))


# ------------------------------------------------------------------------- bernoulli_rows
def _row_frequencies(
    rng: np.random.Generator, n: int, q: float, draws: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inclusion counts per row, per-draw counts, and adjacent-pair co-inclusion counts."""
    incl = np.zeros(n)
    pair = np.zeros(max(n - 1, 0))
    sizes = np.empty(draws)
    for t in range(draws):
        r = bernoulli_rows(rng, n, q)
        z = np.zeros(n, dtype=bool)
        z[r] = True
        incl += z
        pair += z[:-1] & z[1:]
        sizes[t] = r.size
    return incl, sizes, pair


def _assert_bernoulli(
    incl: np.ndarray, sizes: np.ndarray, pair: np.ndarray, n: int, q: float, draws: int
) -> None:
    """Per-row frequencies ≈ q, adjacent co-inclusion ≈ q², count mean/variance ≈ binomial."""
    sd = math.sqrt(draws * q * (1 - q))
    z_row = (incl - draws * q) / sd
    assert np.max(np.abs(z_row)) < _crit(n), np.round(z_row, 2)
    # independence of neighbours (gap arithmetic off by one would couple them)
    q2 = q * q
    z_pair = (pair - draws * q2) / math.sqrt(draws * q2 * (1 - q2))
    assert np.max(np.abs(z_pair)) < _crit(n - 1), np.round(z_pair, 2)
    # count ~ Binomial(n, q): mean and variance (sd of a sample variance of R draws is
    # ~ sigma^2 sqrt(2 / (R - 1) + kurt / R), kurt the excess kurtosis)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / draws)
    kurt = (1 - 6 * q * (1 - q)) / var
    assert abs(sizes.var(ddof=1) / var - 1) < 5 * math.sqrt(2 / (draws - 1) + kurt / draws)


def test_bernoulli_rows_sorted_unique_in_range_int64():
    """Every draw is a strictly increasing int64 array of rows in ``[0, n)``."""
    rng = np.random.default_rng(10)
    for n, q in [(1, 0.5), (7, 0.9), (50, 0.3), (1000, 0.01), (100_000, 0.001), (3, 0.999)]:
        for _ in range(200):
            r = bernoulli_rows(rng, n, q)
            assert r.dtype == np.int64
            assert r.ndim == 1
            assert np.all(np.diff(r) > 0)
            if r.size:
                assert 0 <= r[0] and r[-1] < n


@pytest.mark.parametrize("q", [0.05, 0.3, 0.8])
def test_bernoulli_rows_inclusion_frequencies(q):
    """Each of 50 rows is kept with probability q, independently of its neighbour; the
    count is Binomial(50, q) in mean and variance."""
    n, draws = 50, 12_000
    incl, sizes, pair = _row_frequencies(np.random.default_rng(11), n, q, draws)
    _assert_bernoulli(incl, sizes, pair, n, q, draws)


def test_bernoulli_rows_frequency_check_has_power():
    """Negative control: the same check rejects rows drawn with a slightly wrong q."""
    n, draws, q = 50, 12_000, 0.3
    incl, sizes, pair = _row_frequencies(np.random.default_rng(11), n, 0.32, draws)
    with pytest.raises(AssertionError):
        _assert_bernoulli(incl, sizes, pair, n, q, draws)


def test_bernoulli_rows_refill_loop(monkeypatch):
    """The "gaps fell short" loop (more gaps drawn when the first ``proposal_slots`` do
    not reach the last row; rare at the real slot count) gives the same distribution:
    forced by allotting a single gap per draw."""
    monkeypatch.setattr(brightness_mod, "proposal_slots", lambda n, q: 1)
    n, q, draws = 50, 0.3, 6000
    incl, sizes, pair = _row_frequencies(np.random.default_rng(12), n, q, draws)
    _assert_bernoulli(incl, sizes, pair, n, q, draws)


def test_bernoulli_rows_single_row():
    """n = 1, q = 0.5: the one row is kept half the time; nothing else ever appears."""
    rng = np.random.default_rng(13)
    draws = 20_000
    kept = 0
    for _ in range(draws):
        r = bernoulli_rows(rng, 1, 0.5)
        assert r.size <= 1
        if r.size:
            assert r[0] == 0
            kept += 1
    assert abs(kept - draws / 2) < 4.5 * math.sqrt(draws / 4)


def test_bernoulli_rows_edge_cases():
    """q = 1: every row; n = 0 or q <= 0: none; q = 1e-300: none (no overflow in the
    gap sums, even for a huge n)."""
    rng = np.random.default_rng(14)
    assert np.array_equal(bernoulli_rows(rng, 17, 1.0), np.arange(17))
    assert bernoulli_rows(rng, 17, 1.0).dtype == np.int64
    for n, q in [(0, 0.5), (0, 1.0), (-3, 0.5), (10, 0.0)]:
        r = bernoulli_rows(rng, n, q)
        assert r.size == 0 and r.dtype == np.int64
    for n in (1, 1000, 10**9, 10**15):
        r = bernoulli_rows(rng, n, 1e-300)
        assert r.size == 0 and r.dtype == np.int64
    with pytest.raises(ValueError, match="2\\*\\*53"):  # gap sums would overflow int64
        bernoulli_rows(rng, 2**62, 1e-300)


# ------------------------------------------------------------- the fused z-update: exactness
N_ROWS = 48
THETAS = np.array([[0.5, 1.5], [-1.0, 2.5], [1.5, -1.0]])
THETA_HAT = np.array([0.0, 0.5])
Q = 0.2


def _stat_data() -> tuple[np.ndarray, np.ndarray]:
    """A 2-D logistic shard whose rows span bright probabilities ~0 … 0.95 at THETAS."""
    x = np.random.default_rng(3).permutation(np.linspace(-2.5, 2.5, N_ROWS))
    return np.column_stack([np.ones(N_ROWS), x]), (np.arange(N_ROWS) % 2).astype(float)


def _make_shard(X, y, model, chains: int, seed: int, q: float) -> Shard:
    return Shard(
        ShardSpec(0, "unused", 0, X.shape[0]),
        ShardConfig(model=model, algorithm="flymc", chains=chains, seed=seed, q_db=q),
        data=(X, y),
    )


def _log_lt(model, X: np.ndarray, y: np.ndarray, xi: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """log L~_n(theta) of every row, recomputed with the unfused model functions."""
    eta = model.linear_predictor(np.asarray(theta, float)[None], X)
    return log_expm1(model.loglik(eta, y) - model.logbound(eta, y, xi))[0]


def _fused_stationarity_z(shard: Shard, X, y, sweeps: int) -> tuple[np.ndarray, np.ndarray]:
    """Z-scores (chains, rows) of each z_n's bright frequency under repeated
    ``_update_z_fused`` against p_n = sigmoid(log L~_n(theta_c)), with the exact variance of
    the time average of a two-state chain (P01 = min(q, L~), P10 = min(1, q / L~)).

    Returns the z-scores and the mask of entries used (p_n not ~0)."""
    model, q = shard.model, shard.q_db
    C = len(shard.chains)
    freq = np.zeros((C, shard.n))
    with np.errstate(over="ignore", divide="ignore"):
        for _ in range(20):  # set_positions drew z exactly; a short burn-in regardless
            shard._update_z_fused()
        for _ in range(sweeps):
            shard._update_z_fused()
            freq += shard._masks
    freq /= sweeps
    lt = np.exp(np.array([_log_lt(model, X, y, shard.xi, ch.theta) for ch in shard.chains]))
    p = lt / (1.0 + lt)
    use = p > 1e-4
    lt_u, p_u = lt[use], p[use]
    p01 = np.minimum(q, lt_u)
    p10 = np.minimum(1.0, q / lt_u)
    rho = 1.0 - p01 - p10
    var = p_u * (1 - p_u) / sweeps * (1 + rho) / (1 - rho)
    z = np.zeros_like(freq)
    z[use] = (freq[use] - p_u) / np.sqrt(var)
    # rows with (numerically) zero bright probability are never bright
    assert np.all(freq[p == 0.0] == 0.0)
    return z, use


def _fused_shard(theta_hat, seed: int = 21, q: float = Q) -> tuple[Shard, np.ndarray, np.ndarray]:
    X, y = _stat_data()
    shard = _make_shard(X, y, fd.LogisticRegression(), chains=3, seed=seed, q=q)
    shard.set_tight_points(theta_hat)
    shard.set_positions(THETAS)
    assert shard.fused_z
    return shard, X, y


def test_fused_z_test_data_cover_both_regimes():
    """The stationarity check has power in both regimes: rows with L~ < q (proposal-limited
    brightening) and L~ > q (always accepted when proposed) at every chain's θ."""
    X, y = _stat_data()
    shard, _, _ = _fused_shard(THETA_HAT)
    for ch in shard.chains:
        lt = np.exp(_log_lt(shard.model, X, y, shard.xi, ch.theta))
        p = lt / (1 + lt)
        assert np.sum((lt < Q) & (p > 0.02)) >= 5
        assert np.sum(lt > Q) >= 5


@pytest.mark.parametrize("theta_hat", [THETA_HAT, None], ids=["tuned", "untuned"])
def test_fused_z_update_leaves_conditional_invariant(theta_hat):
    """Three chains at three fixed θ, updated together: every z_n keeps sigmoid(log L~_n)."""
    shard, X, y = _fused_shard(theta_hat)
    z, use = _fused_stationarity_z(shard, X, y, sweeps=4000)
    m = int(use.sum())
    assert m >= 60
    assert np.max(np.abs(z[use])) < _crit(m), np.round(z, 2)
    assert stats.chi2.sf(np.sum(z[use] ** 2), m) > 1e-4


def test_fused_z_flipped_sign_negative_control_fails(monkeypatch):
    """The same check rejects the fused update with Algorithm 2's printed comparison
    (dark→bright accepted when ``u > L~ / q``)."""
    monkeypatch.setattr(fused_mod, "brighten", lambda log_u, vals, q: log_u > vals - math.log(q))
    shard, X, y = _fused_shard(THETA_HAT)
    z, use = _fused_stationarity_z(shard, X, y, sweeps=4000)
    m = int(use.sum())
    assert np.max(np.abs(z[use])) > 2 * _crit(m)
    assert stats.chi2.sf(np.sum(z[use] ** 2), m) < 1e-6


def test_fused_z_refill_path_single_chain_invariant(monkeypatch):
    """A chain whose proposal gaps fall short (:func:`flymc_dist.shard.fused._refill`, forced with
    one slot per chain) still leaves p(z | θ) invariant (one chain: no interleaving)."""
    monkeypatch.setattr(fused_mod, "proposal_slots", lambda n, q: 1)
    X, y = _stat_data()
    shard = _make_shard(X, y, fd.LogisticRegression(), chains=1, seed=22, q=Q)
    shard.set_tight_points(THETA_HAT)
    shard.set_positions(THETAS[1:2])
    z, use = _fused_stationarity_z(shard, X, y, sweeps=3000)
    m = int(use.sum())
    assert np.max(np.abs(z[use])) < _crit(m), np.round(z, 2)
    assert stats.chi2.sf(np.sum(z[use] ** 2), m) > 1e-4


# --------------------------------------------------------- the fused z-update: bookkeeping
def _assert_cache_consistent(shard: Shard, X, y) -> None:
    """Each chain's bright rows are exactly its mask's, its cached values are log L~ of
    those rows at its θ, and its mask is a view of the shard's (chains, rows) array."""
    for c, ch in enumerate(shard.chains):
        b = ch.bright
        assert b.idx.dtype == np.int64
        assert np.unique(b.idx).size == b.idx.size
        assert np.array_equal(np.sort(b.idx), np.flatnonzero(shard._masks[c]))
        assert b.vals.shape == b.idx.shape
        ref = _log_lt(shard.model, X[b.idx], y[b.idx], shard.xi[b.idx], ch.theta)
        np.testing.assert_allclose(b.vals, ref, rtol=1e-12, atol=1e-12)
        assert np.shares_memory(b.mask, shard._masks)
        assert b.mask.base is shard._masks or b.mask.base is shard._masks.base
        assert np.array_equal(b.mask, shard._masks[c])


@pytest.mark.parametrize("model_name", ["logistic", "robust"])
def test_fused_z_update_keeps_cache_consistent(model_name):
    """After every fused sweep (and with a mask row flipped through the shard's array,
    seen by the chain's BrightSet): idx ↔ mask ↔ cached log L~ agree, for both models."""
    rng = np.random.default_rng(31)
    n = 200
    X = np.column_stack([np.ones(n), rng.normal(size=(n, 2))])
    if model_name == "logistic":
        model, y = fd.LogisticRegression(), (rng.random(n) < 0.5).astype(float)
        thetas = np.array([[0.2, 1.0, -0.5], [1.5, -2.0, 0.3], [-0.7, 0.1, 2.2]])
    else:
        model = fd.RobustRegression()
        y = X @ np.array([0.5, 1.0, -1.0]) + rng.standard_t(4, size=n)
        thetas = np.array([[0.5, 1.0, -1.0], [0.0, 2.0, 0.0], [1.0, 0.0, -2.5]])
    shard = _make_shard(X, y, model, chains=3, seed=32, q=0.1)
    shard.set_tight_points(thetas[0])
    shard.set_positions(thetas)
    assert shard.fused_z
    _assert_cache_consistent(shard, X, y)
    total = 0
    with np.errstate(over="ignore", divide="ignore"):
        for _ in range(60):
            total += int(shard._update_z_fused().sum())
            _assert_cache_consistent(shard, X, y)
    assert total > 0
    # the BrightSet's mask is the very memory the fused update writes
    shard._masks[1, 0] = not shard._masks[1, 0]
    assert shard.chains[1].bright.mask[0] == shard._masks[1, 0]


def test_fused_z_refill_path_several_chains_cache_consistent(monkeypatch):
    """With every chain's gaps falling short (one slot each), the cached log L~ of each
    chain must still be its own rows at its own θ (a bug once evaluated the extra rows of
    a chain other than the last at another chain's θ)."""
    monkeypatch.setattr(fused_mod, "proposal_slots", lambda n, q: 1)
    shard, X, y = _fused_shard(None, seed=33, q=0.3)
    with np.errstate(over="ignore", divide="ignore"):
        for _ in range(30):
            shard._update_z_fused()
            _assert_cache_consistent(shard, X, y)


def test_fused_z_queries_count_dark_proposals():
    """Queries per chain = dark rows proposed: with q = 1 every row proposes, so each chain
    evaluates exactly the rows dark before the sweep."""
    shard, _, _ = _fused_shard(THETA_HAT, seed=34, q=1.0)
    with np.errstate(over="ignore", divide="ignore"):
        for _ in range(20):
            dark_before = (~shard._masks).sum(axis=1)
            assert np.array_equal(shard._update_z_fused(), dark_before)


# ------------------------------------------------------------------- fused log L~ per model
def _eta_grid(rng: np.random.Generator, n: int) -> np.ndarray:
    extreme = np.array([0.0, -0.0, 1e-8, -1e-8, 40.0, -40.0, 1e3, -1e3, 1e200, -1e200])
    return np.concatenate([rng.normal(scale=3.0, size=n), extreme])


def _assert_fused_equals_unfused(model, eta: np.ndarray, y: np.ndarray, xi: np.ndarray) -> None:
    consts = model.row_constants(y, xi)
    eta_in, consts_in = eta.copy(), consts.copy()
    with np.errstate(over="ignore", divide="ignore"):
        fused = model.log_bright_rows(eta, consts)
    assert np.array_equal(eta, eta_in) and np.array_equal(consts, consts_in)  # inputs intact
    e3 = eta[None, :, None]
    ref = log_expm1(model.loglik(e3, y) - model.logbound(e3, y, xi))[0]
    assert not np.any(np.isnan(ref))
    assert fused.shape == ref.shape
    fin = np.isfinite(ref)
    assert fin.sum() > eta.size // 2  # mostly finite values: the comparison has content
    np.testing.assert_array_equal(fused[fin], ref[fin])  # bit for bit
    np.testing.assert_array_equal(fused[~fin], ref[~fin])  # the same infinities
    assert np.array_equal(np.isfinite(fused), fin)
    _assert_compiled_matches(model, eta, consts, ref)


def _assert_compiled_matches(model, eta: np.ndarray, consts: np.ndarray, ref: np.ndarray) -> None:
    """The shards' compiled kernel against the numpy reference: the same infinities, and
    L~ = exp(log L~) to 1e-12 relative (1e-13 absolute; its libm may differ from numpy's
    vectorised exp/log in the last bit, which cancellation in l - beta can magnify in
    log L~ where L~ is tiny)."""
    from flymc_dist import _compiled

    kind, par = model.compiled_bright()
    n = eta.size
    XC = np.column_stack([eta, consts])  # one feature, theta = 1: eta exactly
    out, sums = np.empty(n), np.empty(1)
    _compiled.eval_rows(
        _compiled.typed_list([XC]),
        1,
        np.arange(n),
        np.array([0, n]),
        np.zeros(1, np.int64),
        np.ones((1, 1)),
        _compiled.KINDS[kind],
        np.asarray(par, float),
        out,
        sums,
    )
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(out[~fin], ref[~fin])
    assert np.all(np.isfinite(out[fin]))
    big = fin & (ref > 30.0)
    np.testing.assert_allclose(out[big], ref[big], rtol=1e-13)
    small = fin & ~big
    np.testing.assert_allclose(np.exp(out[small]), np.exp(ref[small]), rtol=1e-12, atol=1e-13)
    assert sums[0] == pytest.approx(out.sum(), rel=1e-12) or not np.isfinite(out.sum())


@pytest.mark.parametrize("tuned", [False, True], ids=["untuned", "tuned"])
def test_logistic_fused_log_bright_rows_bit_identical(tuned):
    rng = np.random.default_rng(41)
    model = fd.LogisticRegression(xi_untuned=1.5)
    eta = _eta_grid(rng, 400)
    n = eta.size
    y = (rng.random(n) < 0.5).astype(float)
    if tuned:
        eta_hat = eta + rng.normal(scale=0.5, size=n)
        eta_hat[:5] = [0.0, 1e-5, -2e-4, 800.0, -1e3]  # series branch and huge xi
        xi = model.tuned_xi(eta_hat[:, None], y)
    else:
        xi = model.untuned_xi(y)
    _assert_fused_equals_unfused(model, eta, y, xi)
    # and at the tight point itself (delta ~ eps: tiny L~, finite)
    _assert_fused_equals_unfused(model, (2 * y - 1) * xi, y, xi)


@pytest.mark.parametrize("tuned", [False, True], ids=["untuned", "tuned"])
def test_robust_fused_log_bright_rows_bit_identical(tuned):
    rng = np.random.default_rng(42)
    model = fd.RobustRegression(nu=4.0, scale=0.7)
    eta = _eta_grid(rng, 400)
    n = eta.size
    y = rng.normal(scale=3.0, size=n)
    y[:3] = [0.0, 1e3, -40.0]
    if tuned:
        eta_hat = eta + rng.normal(scale=0.5, size=n)
        eta_hat[3:6] = [1e120, -1e120, 0.0]  # xi clipped at its maximum
        xi = model.tuned_xi(eta_hat[:, None], y)
    else:
        xi = model.untuned_xi(y)
    _assert_fused_equals_unfused(model, eta, y, xi)
    _assert_fused_equals_unfused(model, y - xi, y, xi)


# ------------------------------------------------------------- speculation: Shard protocol
def _twin_shards(
    chains: int = 3, n: int = 300, q: float = 0.05, seed: int = 51
) -> tuple[Shard, Shard, np.ndarray, np.ndarray]:
    """Two identical logistic shards (same data, seed, tight points and positions)."""
    rng = np.random.default_rng(seed)
    X = np.column_stack([np.ones(n), rng.normal(size=(n, 2))])
    y = (rng.random(n) < 1 / (1 + np.exp(-X @ np.array([0.3, 1.0, -1.0])))).astype(float)
    theta_hat = np.array([0.3, 1.0, -1.0])
    thetas = theta_hat + 0.3 * rng.normal(size=(chains, 3))
    out = []
    for _ in range(2):
        s = _make_shard(X, y, fd.LogisticRegression(), chains=chains, seed=seed, q=q)
        s.set_tight_points(theta_hat)
        s.set_positions(thetas)
        assert s.fused_z
        out.append(s)
    return out[0], out[1], X, y


def _assert_same_state(a: Shard, b: Shard) -> None:
    assert np.array_equal(a._masks, b._masks)
    for ca, cb in zip(a.chains, b.chains, strict=True):
        assert np.array_equal(ca.theta, cb.theta)
        assert np.array_equal(ca.bright.idx, cb.bright.idx)
        assert np.array_equal(ca.bright.vals, cb.bright.vals)
        assert ca.rng.bit_generator.state == cb.rng.bit_generator.state


def _requests(rng: np.random.Generator, shard: Shard, scale: float = 0.15) -> list[Request]:
    return [
        Request(
            points=(ch.theta + scale * rng.normal(size=ch.theta.size))[None],
            grad=False,
            current_grad=False,
        )
        for ch in shard.chains
    ]


REPLY_KEYS = ("current", "points", "n_bright", "queries")


def test_undo_spec_restores_state_exactly():
    """``speculate()`` changes z, the cached values and the RNG of every chain;
    ``_undo_spec`` of every chain puts each back exactly (the twin never speculated)."""
    a, b, _, _ = _twin_shards()
    C = len(a.chains)
    rng = np.random.default_rng(52)
    reqs = _requests(rng, a)
    commits = np.full(C, -1, dtype=np.int64)
    ra = a.round(1, commits, True, reqs, True)
    rb = b.round(1, commits, True, reqs, False)
    for k in REPLY_KEYS:
        assert np.array_equal(getattr(ra, k), getattr(rb, k)), k
    _assert_same_state(a, b)
    a.speculate()
    assert sorted(a._spec) == list(range(C))
    for ca, cb in zip(a.chains, b.chains, strict=True):  # speculation really ran
        assert ca.rng.bit_generator.state != cb.rng.bit_generator.state
    assert not np.array_equal(a._masks, b._masks)
    a.speculate()  # a second call is a no-op
    wasted = sum(a._undo_spec(c) for c in range(C))
    assert wasted > 0
    assert a._spec == {}
    _assert_same_state(a, b)
    for c, ch in enumerate(a.chains):
        assert np.shares_memory(ch.bright.mask, a._masks)
        assert np.array_equal(ch.bright.mask, a._masks[c])


def test_commit_every_chain_undoes_all_speculation():
    """A round committing index 0 for every chain undoes every chain's speculative update
    (all wasted), then updates z at the new θ exactly as the twin does."""
    a, b, _, _ = _twin_shards()
    C = len(a.chains)
    rng = np.random.default_rng(53)
    reqs = _requests(rng, a)
    none = np.full(C, -1, dtype=np.int64)
    a.round(1, none, True, reqs, True)
    b.round(1, none, True, reqs, False)
    a.speculate()
    spec_queries = np.array([a._spec[c].queries for c in range(C)])
    reqs = _requests(rng, a)
    zeros = np.zeros(C, dtype=np.int64)
    ra = a.round(2, zeros, True, reqs, False)
    rb = b.round(2, zeros, True, reqs, False)
    assert a._spec == {}
    assert np.array_equal(ra.wasted, spec_queries)
    assert np.array_equal(rb.wasted, np.zeros(C, dtype=np.int64))
    for k in REPLY_KEYS:
        assert np.array_equal(getattr(ra, k), getattr(rb, k)), k
    _assert_same_state(a, b)
    assert a.total_queries == b.total_queries + int(spec_queries.sum())


@pytest.mark.parametrize("seed", [54, 55])
def test_speculation_matches_plain_protocol_round_by_round(seed):
    """50 rounds with a random mix of commits (-1: keep the speculative update; 0: undo
    it) and occasional rounds without a z-update: the speculating shard's replies, bright
    sets, masks and RNG states equal the plain shard's after every round."""
    a, b, X, y = _twin_shards(seed=seed)
    C = len(a.chains)
    rng = np.random.default_rng(seed + 100)
    wasted = 0
    kept = undone = 0
    for seq in range(1, 51):
        commits = np.where(rng.random(C) < 0.5, 0, -1).astype(np.int64)
        update_z = bool(seq == 1 or rng.random() < 0.85)
        for c in a._spec:
            if commits[c] >= 0 or not update_z:
                undone += 1
            else:
                kept += 1
        reqs = _requests(rng, a)
        ra = a.round(seq, commits, update_z, reqs, True)
        rb = b.round(seq, commits, update_z, reqs, False)
        for k in REPLY_KEYS:
            assert np.array_equal(getattr(ra, k), getattr(rb, k)), (seq, k)
        assert not rb.wasted.any()
        wasted += int(ra.wasted.sum())
        _assert_same_state(a, b)
        a.speculate()  # what a worker does once the reply is out
        assert sorted(a._spec) == list(range(C))
    assert kept > 20 and undone > 20  # both outcomes exercised
    assert wasted > 0
    assert a.total_queries == b.total_queries + wasted
    # a repeated seq returns the cached reply and does not disturb the speculation
    last = a._reply
    assert a.round(50, np.zeros(C, dtype=np.int64), True, _requests(rng, a), True) is last
    assert sorted(a._spec) == list(range(C))
    _assert_cache_consistent(a, X, y)


def test_speculation_idle_without_fused_z():
    """Explicit z-updates have no fused path: ``speculate=True`` in a round is a no-op."""
    rng = np.random.default_rng(56)
    n = 100
    X = np.column_stack([np.ones(n), rng.normal(size=n)])
    y = (rng.random(n) < 0.5).astype(float)
    s = Shard(
        ShardSpec(0, "unused", 0, n),
        ShardConfig(
            model=fd.LogisticRegression(), algorithm="flymc", chains=2, seed=1, z_update="explicit"
        ),
        data=(X, y),
    )
    s.set_positions(np.zeros((2, 2)))
    assert not s.fused_z
    s.round(1, np.full(2, -1), True, _requests(rng, s), True)
    s.speculate()
    assert s._spec == {}


# --------------------------------------------------------------- speculation: fd.sample
@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    lp, rp = str(root / "logistic.zarr"), str(root / "robust.zarr")
    fd.data.make_logistic(lp, 3000, 4, seed=61)
    fd.data.make_robust(rp, 3000, 3, seed=62)
    return {"logistic": lp, "robust": rp}


def _sample(path: str, model, **kw):
    args = dict(
        algorithm="flymc",
        bounds="map",
        kernel="rwmh",
        z_update="implicit",
        num_warmup=30,
        num_samples=40,
        chains=3,
        seed=5,
        client="synchronous",
        n_shards=3,
        progress=False,
    )
    args.update(kw)
    return fd.sample(model, path, **args)


def _assert_same_run(a, b) -> None:
    assert np.array_equal(a.samples, b.samples)
    assert np.array_equal(a.warmup_samples, b.warmup_samples)
    assert set(a.stats) == set(b.stats)
    for k in a.stats:
        assert np.array_equal(a.stats[k], b.stats[k]), k
        assert np.array_equal(a.warmup_stats[k], b.warmup_stats[k]), k


@pytest.mark.parametrize("name", ["logistic", "robust"])
def test_sample_speculation_changes_nothing_but_timing(stores, name):
    """``speculate=True`` (every round undoes the update of each chain that moved) gives
    the same draws and statistics as ``speculate=False``; only the wasted work differs."""
    model = fd.LogisticRegression() if name == "logistic" else fd.RobustRegression()
    on = _sample(stores[name], model, speculate=True)
    off = _sample(stores[name], model, speculate=False)
    _assert_same_run(on, off)
    assert on.info["speculate"] is True and off.info["speculate"] is False
    assert on.info["speculative_queries"] > 0
    assert off.info["speculative_queries"] == 0
    assert on.stats["accepted"].any()  # chains moved: undone speculation was exercised
    assert (~on.stats["accepted"]).any()  # and stayed: kept speculation was exercised


def test_sample_speculate_auto_in_process_is_off(stores):
    res = _sample(
        stores["logistic"], fd.LogisticRegression(), speculate="auto", num_warmup=5, num_samples=5
    )
    assert res.info["speculate"] is False
    assert res.info["speculative_queries"] == 0


@pytest.mark.parametrize(
    "kernel,z_update", [("slice", "implicit"), ("mala", "implicit"), ("rwmh", "explicit")]
)
def test_sample_speculation_only_for_one_request_fused_kernels(stores, kernel, z_update):
    """Slice and MALA make several requests per iteration: ``speculate=True`` is accepted
    but inactive. Explicit z-updates have no fused update to speculate with. Either way the
    results equal the non-speculative ones."""
    kw = dict(kernel=kernel, z_update=z_update, num_warmup=10, num_samples=15)
    on = _sample(stores["logistic"], fd.LogisticRegression(), speculate=True, **kw)
    off = _sample(stores["logistic"], fd.LogisticRegression(), speculate=False, **kw)
    _assert_same_run(on, off)
    if kernel != "rwmh":
        assert on.info["speculate"] is False
    assert on.info["speculative_queries"] == 0


def test_sample_regular_ignores_speculate(stores):
    res = _sample(
        stores["logistic"],
        fd.LogisticRegression(),
        algorithm="regular",
        speculate=True,
        num_warmup=5,
        num_samples=5,
    )
    assert res.info["speculate"] is False
    assert res.info["speculative_queries"] == 0


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, "True"])
def test_sample_bad_speculate_raises_before_writing(stores, tmp_path, bad):
    trace = tmp_path / "never.zarr"
    with pytest.raises(ValueError, match="speculate"):
        _sample(stores["logistic"], fd.LogisticRegression(), speculate=bad, trace=str(trace))
    assert not trace.exists()


# ------------------------------------------------------------------------ _all_remote
def _workers(hosts_threads: list[tuple[str, int]]) -> dict[str, dict]:
    return {
        f"tcp://{h}:{4000 + i}": {"host": h, "nthreads": t}
        for i, (h, t) in enumerate(hosts_threads)
    }


def test_all_remote_only_when_every_shard_worker_is_elsewhere():
    """``speculate="auto"`` speculates only when every worker holding shards is remote."""
    remote = _workers([("192.0.2.7", 1)] * 3 + [("198.51.100.3", 8)])
    assert _all_remote(remote, list(remote)) is True
    local = _workers([("127.0.0.1", 1)] * 2)
    assert _all_remote(local, list(local)) is False
    mixed = _workers([("192.0.2.7", 64), ("127.0.0.1", 1)])
    assert _all_remote(mixed, list(mixed)) is False
    assert _all_remote(mixed, [list(mixed)[0]]) is True  # only shard-holding workers count
    assert _all_remote(remote, []) is False  # no shards placed: nothing to speculate on
    assert _all_remote({}, ["tcp://192.0.2.7:1"]) is False  # unknown host: assume local
    here = _workers([(socket.gethostname(), 1)])
    assert _all_remote(here, list(here)) is False


# ------------------------------------------------------ several shards per host: one pass
def _hosts(rng: np.random.Generator, model_name: str, seed: int, replica: bool = False):
    """One host holding four shards of uneven size (one of 10 rows, whose chains go dark)
    and four hosts holding one each, on the same data, positions and streams; and a
    counter of the rounds the fused pass served (``counting``, to patch in for
    ``ShardHost._round_fused``). Returns ``(fused, single, thetas, used, counting)``."""
    from flymc_dist.shard import ShardHost

    n, C = 1500, 3
    X = np.column_stack([np.ones(n), rng.normal(size=(n, 2))])
    if model_name == "logistic":
        model = fd.LogisticRegression()
        y = (rng.random(n) < 1 / (1 + np.exp(-X @ np.array([0.3, 1.0, -1.0])))).astype(float)
    else:
        model = fd.RobustRegression()
        y = X @ np.array([0.3, 1.0, -1.0]) + rng.standard_t(4, size=n)
    theta_hat = np.array([0.3, 1.0, -1.0])
    cuts = [0, 700, 1200, 1490, 1500]
    specs = [
        ShardSpec(i, "unused", a, b)
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))
    ]
    data = {s.shard_id: (X[s.start : s.stop], y[s.start : s.stop]) for s in specs}
    config = ShardConfig(model=model, algorithm="flymc", chains=C, seed=seed, q_db=0.02)
    fused = ShardHost(specs, config, data)
    single = [ShardHost([s], config, {s.shard_id: data[s.shard_id]}) for s in specs]
    thetas = theta_hat + 0.2 * rng.normal(size=(C, 3))
    for host in [fused, *single]:
        host.call("set_tight_points", (theta_hat,))
        if replica:
            host.call("set_replica", (True,))
        host.call("set_positions", (thetas,))
    used = {"fused": 0}
    real = ShardHost._round_fused

    def counting(self, *a):
        out = real(self, *a)
        used["fused"] += out is not None
        return out

    return fused, single, thetas, used, counting


def _fused_round_checked(fused, single, blob: bytes, counting) -> dict:
    """The fused host's replies to the packed round ``blob`` (served through ``counting``),
    after checking that every field of every shard's reply is the one its single-shard
    host gives, bit for bit."""
    from flymc_dist.protocol import unpack_reply
    from flymc_dist.shard import ShardHost

    real = ShardHost._round_fused
    ShardHost._round_fused = counting
    try:
        got = unpack_reply(fused._serve_channel(1, blob)[0])
    finally:
        ShardHost._round_fused = real
    for host in single:
        want = unpack_reply(host._serve_channel(1, blob)[0])
        for sid, rep in want.items():
            assert type(rep) is type(got[sid])
            for key in rep._fields:
                a, b = getattr(got[sid], key), getattr(rep, key)
                assert (a is None) == (b is None), key
                if a is not None:
                    np.testing.assert_array_equal(a, b, err_msg=key)
    return got


def _assert_same_chains(fused, single) -> None:
    """Every shard's bright sets, their values and its chains' streams, as on its own."""
    for host in single:
        ((sid, sh),) = host.shards.items()
        mine = fused.shards[sid]
        for c in range(len(sh.chains)):
            np.testing.assert_array_equal(mine.chains[c].bright.idx, sh.chains[c].bright.idx)
            np.testing.assert_array_equal(mine.chains[c].bright.vals, sh.chains[c].bright.vals)
            assert mine.chains[c].rng.bit_generator.state == sh.chains[c].rng.bit_generator.state


@pytest.mark.parametrize("kernel", ["rwmh", "slice"])
@pytest.mark.parametrize("model_name", ["logistic", "robust"])
def test_host_fused_round_equals_shard_by_shard(model_name, kernel):
    """A host with several shards runs RWMH rounds as one pass over all (shard, chain)
    pairs (ShardHost._round_fused); every shard's reply, bright set and stream must be
    the ones its own Shard.round gives, bit for bit (the placement-independence of the
    draws rests on it). Shards of different sizes, one so small that chains go dark.
    "slice": rounds like the slice sampler's — 0 to 3 points per chain, some chains
    without a request, z updated on every third round only."""
    from flymc_dist.protocol import pack_round

    rng = np.random.default_rng(61)
    fused, single, thetas, used, counting = _hosts(rng, model_name, 62)
    C = thetas.shape[0]
    current = thetas.copy()
    moved = empty = bright = 0
    # each chain's last evaluated points, and the round they were evaluated in: as in the
    # driver's protocol, a chain commits only to points evaluated since the last z-update
    last_pts: list[np.ndarray | None] = [None] * C
    evaluated = [0] * C
    z_round = 0
    for r in range(1, 151):
        commits = np.full(C, -1)
        for c in range(C):
            if (
                last_pts[c] is not None
                and last_pts[c].shape[0]
                and evaluated[c] > z_round
                and rng.random() < 0.4
            ):
                commits[c] = int(rng.integers(last_pts[c].shape[0]))
                current[c] = last_pts[c][commits[c]]
        ks = np.ones(C, dtype=int) if kernel == "rwmh" else rng.integers(0, 4, size=C)
        reqs = []
        for c in range(C):
            if kernel == "slice" and rng.random() < 0.2:
                reqs.append(None)
                continue
            pts = current[c] + 0.1 * rng.normal(size=(int(ks[c]), 3))
            reqs.append(Request(pts, False, False))
            if ks[c]:
                last_pts[c], evaluated[c] = pts, r
        update_z = kernel == "rwmh" or r % 3 == 1
        if update_z:
            z_round = r - 1  # z moves before this round's points are evaluated
        got = _fused_round_checked(
            fused, single, pack_round(r, commits, update_z, reqs, False), counting
        )
        moved += int((commits == 0).sum())
        empty += int((got[3].n_bright == 0).sum())
        bright += int(got[0].n_bright.sum())
    # the fused pass ran every round; chains moved; the 10-row shard's chains were often
    # all dark (empty segments) while the big shard's were not
    assert used["fused"] == 150 and moved > 50 and empty > 0 and bright > 0
    _assert_same_chains(fused, single)


@pytest.mark.parametrize("model_name", ["logistic", "robust"])
def test_host_fused_replica_round_equals_shard_by_shard(model_name):
    """Replica mode (NUTS, HMC, MALA, slice on the driver's copy of the bright rows): a
    host with several shards moves every chain to its new θ shard by shard, then runs one
    z-update over all (shard, chain) pairs and answers each shard's bright-set change
    (fused._fused_replica_round). Every shard's reply — the rows gone dark, the new
    rows with their data, the counts — its bright sets and its streams must be the ones
    its own Shard.round gives, bit for bit, round after round; and the fused pass must be
    the one that ran. Shards of different sizes, one so small that its chains go dark."""
    from flymc_dist.protocol import pack_round

    rng = np.random.default_rng(71)
    fused, single, thetas, used, counting = _hosts(rng, model_name, 72, replica=True)
    C = thetas.shape[0]
    current = thetas.copy()
    changed = empty = 0
    for r in range(1, 121):
        current = current + 0.15 * rng.normal(size=current.shape)  # each chain's new θ
        reqs = [Request(current[c][None], False, False) for c in range(C)]
        got = _fused_round_checked(
            fused, single, pack_round(r, np.full(C, -1), True, reqs, False), counting
        )
        changed += int(got[0].new_ids.size + got[0].gone_ids.size > 0)
        empty += int((got[3].n_bright == 0).sum())
    assert used["fused"] == 120 and changed > 20 and empty > 0
    _assert_same_chains(fused, single)
