"""The batched z-update and its random numbers: the row-keyed streams (Philox4x32-10,
the Bernoulli process over all rows, the block-tree sums), the z-update of all chains in
one compiled call, and the models' ``log L~`` in one formula (numpy and compiled).

Statistical checks derive their tolerances from the exact sampling distributions
(binomial counts; the two-state Markov chain of each z_n, as in
``tests/test_brightness.py::_stationarity_z``) with a Bonferroni family-wise level of
0.1%; each has a negative control (a deliberately broken variant) that must fail it.
Everything else is exact: bit-for-bit equality of arrays.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

import flymc_dist as fd
import flymc_dist.shard.batched as batched_mod
from flymc_dist import streams
from flymc_dist._numerics import log_expm1
from flymc_dist.protocol import ShardConfig, ShardSpec
from flymc_dist.reduce import tree_nodes, tree_total
from flymc_dist.shard import Shard
from flymc_dist.shard.round import round_shards, update_z


def _crit(m: int, level: float = 0.001) -> float:
    """Two-sided Bonferroni critical value for ``m`` z-scores at family-wise ``level``."""
    return float(stats.norm.ppf(1 - level / (2 * m)))


# ------------------------------------------------------------------ row-keyed streams
#: Random123's published known-answer vectors for Philox4x32-10 (counter, key, output)
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, out", PHILOX_KAT)
def test_philox_known_answers(counter, key, out):
    got = streams.philox4x32(np.array(counter, np.uint64), np.array(key, np.uint64))
    assert tuple(int(x) for x in got) == out


def _permuted_by_definition(key: int, n_total: int, position: int) -> int:
    """One position of :func:`streams.permuted_rows` as its docstring defines it, row by
    row in Python: Feistel rounds of Philox (the known-answer-tested generator) on halves
    of ``bits // 2`` and the rest bits, alternating, cycle-walked into ``[0, N)``."""
    bits = max(2, (n_total - 1).bit_length())
    k = np.array([key & 0xFFFFFFFF, key >> 32], np.uint64)
    x = position
    while True:
        u, v = bits // 2, bits - bits // 2
        left, right = x >> v, x & ((1 << v) - 1)
        for r in range(streams.FEISTEL_ROUNDS):
            c = np.array([right & 0xFFFFFFFF, right >> 32, r, streams.A_ROWS], np.uint64)
            f = int(streams.philox4x32(c, k)[0])
            left, right = right, left ^ (f & ((1 << u) - 1))
            u, v = v, u
        x = (left << v) | right
        if x < n_total:
            return x


@pytest.mark.parametrize("n_total", [1, 2, 5, 1000, 1025, 2**20 + 3, 10**12 + 39])
def test_permuted_rows_by_definition(n_total):
    """The compiled permutation, computed round by round over many rows at once, gives
    every position what the definition gives it; a full one is a permutation."""
    key = streams.stream_key(7, 0, 1, 5, streams.A_ROWS)
    start = n_total // 3
    count = min(n_total - start, 300)
    got = streams.permuted_rows(key, n_total, start, count)
    want = [_permuted_by_definition(key, n_total, start + i) for i in range(count)]
    assert got.tolist() == want
    n = min(n_total, 5000)
    assert np.array_equal(np.sort(streams.permuted_rows(key, n, 0, n)), np.arange(n))


def test_steps_keys_are_the_stream_keys():
    """The read-ahead's keys of many steps in one call are ``stream_key``'s, step after
    step and chain after chain (a large seed taken mod 2**64 as there); bad input refused."""
    seed = 2**70 + 12345
    keys = streams.steps_keys(seed, 3, 4, 100, 9, streams.Z_PROPOSE)
    want = [
        streams.stream_key(seed, 3, c, 100 + t, streams.Z_PROPOSE)
        for t in range(9)
        for c in range(4)
    ]
    assert keys.dtype == np.uint64 and keys.tolist() == want
    assert streams.steps_keys(seed, 3, 4, 100, 0, streams.Z_PROPOSE).size == 0
    for bad in ((-1, 4, 0, 1), (0, 4, -1, 1), (0, 4, 0, -1)):
        with pytest.raises(ValueError, match="steps_keys"):
            streams.steps_keys(1, *bad[:2], bad[2], bad[3], streams.Z_PROPOSE)


def test_uniforms_keyed_by_row_only():
    """A row's uniform is the same whatever range or order asks for it; streams differ."""
    key = streams.stream_key(7, 0, 1, 5, streams.Z_DECIDE)
    u = streams.uniforms_range(key, 1000, 500)
    rows = np.random.default_rng(0).permutation(500)
    assert np.array_equal(streams.uniforms_at(key, rows, 1000), u[rows])
    other = streams.uniforms_range(streams.stream_key(7, 0, 1, 6, streams.Z_DECIDE), 1000, 500)
    assert not np.any(u == other)
    assert np.all((u >= 0.0) & (u < 1.0))
    # uniform: a Kolmogorov-Smirnov test on 10^5 draws
    assert stats.kstest(streams.uniforms_range(key, 0, 100_000), "uniform").pvalue > 1e-4


@pytest.mark.parametrize("n_total", [1, 2, 37, 1000, 2**20 + 3])
def test_bernoulli_rows_same_whatever_range(n_total):
    """Any partition of [0, N) into ranges gives the same rows as the whole: sorted,
    distinct, int64, in range."""
    rng = np.random.default_rng(n_total)
    for q in (0.003, 0.2, 0.9):
        key = streams.stream_key(3, 0, 0, int(q * 1000), streams.Z_PROPOSE)
        whole = streams.bernoulli_rows(key, q, n_total, 0, n_total)
        assert whole.dtype == np.int64
        assert np.all(np.diff(whole) > 0) and (whole.size == 0 or 0 <= whole[0])
        assert whole.size == 0 or whole[-1] < n_total
        cuts = np.sort(rng.integers(0, n_total + 1, size=5))
        edges = [0, *cuts.tolist(), n_total]
        parts = [
            streams.bernoulli_rows(key, q, n_total, a, b)
            for a, b in zip(edges[:-1], edges[1:], strict=True)
        ]
        assert np.array_equal(np.concatenate(parts), whole)
        many, seg = streams.bernoulli_rows_many(
            np.full(len(edges) - 1, key, np.uint64), q, n_total, edges[:-1], edges[1:]
        )
        assert np.array_equal(many, whole) and seg[-1] == whole.size


def _inclusion_z(q: float, n: int = 200, reps: int = 4000, bias: float = 0.0) -> np.ndarray:
    """Z-scores of each row's inclusion frequency against q over ``reps`` streams."""
    hits = np.zeros(n)
    for t in range(reps):
        key = streams.stream_key(11, 0, 0, t, streams.Z_PROPOSE)
        hits[streams.bernoulli_rows(key, q * (1 + bias), n, 0, n)] += 1
    return (hits - reps * q) / np.sqrt(reps * q * (1 - q))


@pytest.mark.parametrize("q", [0.01, 0.3])
def test_bernoulli_rows_inclusion_frequencies(q):
    """Every row is proposed with probability q, independently (binomial counts)."""
    z = _inclusion_z(q)
    assert np.max(np.abs(z)) < _crit(z.size)
    assert stats.chi2.sf(np.sum(z**2), z.size) > 1e-4


def test_bernoulli_rows_frequency_check_has_power():
    """Negative control: a process 10% too dense fails the same check."""
    z = _inclusion_z(0.3, bias=0.1)
    assert stats.chi2.sf(np.sum(z**2), z.size) < 1e-6


def test_bernoulli_counts_are_binomial():
    """The number of rows proposed over 10^5 rows at q = 1e-3 is Binomial(10^5, q):
    mean and variance within their sampling error over 2,000 streams."""
    n, q, reps = 100_000, 1e-3, 2000
    counts = np.array(
        [
            streams.bernoulli_rows(streams.stream_key(5, 0, 0, t, 2), q, n, 0, n).size
            for t in range(reps)
        ]
    )
    mean, var = n * q, n * q * (1 - q)
    assert abs(counts.mean() - mean) < 4 * math.sqrt(var / reps)
    assert abs(counts.var() / var - 1) < 4 * math.sqrt(2 / reps)


def test_bernoulli_rows_edge_cases():
    key = streams.stream_key(0, 0, 0, 0, streams.Z_PROPOSE)
    assert np.array_equal(streams.bernoulli_rows(key, 1.0, 17, 3, 9), np.arange(3, 9))
    assert streams.bernoulli_rows(key, 0.0, 17, 0, 17).size == 0
    assert streams.bernoulli_rows(key, 0.5, 17, 9, 3).size == 0
    with pytest.raises(ValueError, match="beyond"):
        streams.bernoulli_rows(key, 1e-300, 2**63 - 1, 0, 10)


def test_block_tree_sums_same_for_every_partition():
    """:mod:`flymc_dist.reduce`: the total of per-block values is the same bits for any
    partition of the blocks into contiguous parts (and differs from a plain running sum
    in general, so the test can see a layout-dependent order)."""
    rng = np.random.default_rng(2)
    for n_blocks in (1, 2, 5, 16, 33):
        v = rng.standard_normal((n_blocks, 4)) * 10.0 ** rng.integers(-8, 8, (n_blocks, 4))
        ref = tree_total([tree_nodes(enumerate(v), n_blocks)])
        np.testing.assert_allclose(ref, v.sum(axis=0), rtol=1e-12, atol=1e-4)
        for _ in range(20):
            k = int(rng.integers(1, n_blocks + 1))
            cuts = np.sort(rng.choice(np.arange(1, n_blocks), size=k - 1, replace=False))
            edges = [0, *cuts.tolist(), n_blocks]
            parts = [
                tree_nodes([(b, v[b]) for b in range(a, c)], n_blocks)
                for a, c in zip(edges[:-1], edges[1:], strict=True)
            ]
            assert np.array_equal(tree_total(parts), ref)
    with pytest.raises(ValueError, match="twice"):
        tree_total([tree_nodes([(0, 1.0)], 2), tree_nodes([(0, 1.0)], 2)])
    with pytest.raises(ValueError, match="cover"):
        tree_total([tree_nodes([(0, 1.0)], 3)])


def test_block_fold_gives_the_merged_nodes_and_holds_log_blocks():
    """A pass's block values folded as they come (:class:`~flymc_dist.reduce.BlockFold`)
    give the nodes the whole pass's values merged at once give, the same bits, whatever
    the blocks' order; in increasing order at most two values per tree level are held at
    a time, not one per block (36 MB per worker per pass at 10⁸ × 57)."""
    from flymc_dist.reduce import BlockFold, _merge

    rng = np.random.default_rng(4)
    for n_blocks in (1, 2, 5, 16, 33, 1000):
        v = rng.standard_normal((n_blocks, 3)) * 10.0 ** rng.integers(-8, 8, (n_blocks, 3))
        for _ in range(5):
            a = int(rng.integers(0, n_blocks))
            c = int(rng.integers(a + 1, n_blocks + 1))
            for shuffled in (False, True):
                order = rng.permutation(np.arange(a, c)) if shuffled else np.arange(a, c)
                fold, held = BlockFold(n_blocks), 0
                for b in order:
                    fold.append((int(b), v[b]))
                    held = max(held, len(fold))
                want = _merge({(0, b): v[b] for b in range(a, c)}, n_blocks)
                got = fold.sums()
                assert got.n_blocks == n_blocks
                assert [(lv, i) for lv, i, _ in got.nodes] == sorted(want)
                for lv, i, x in got.nodes:
                    assert np.array_equal(x, want[(lv, i)])
                if not shuffled:  # per level: the part's left edge, and the growing end
                    assert held <= 2 * ((n_blocks - 1).bit_length() + 1)


# ----------------------------------------------------------- the batched z-update: exactness
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
        ShardConfig(
            model=model, algorithm="flymc", chains=chains, seed=seed, n_rows=X.shape[0], q_db=q
        ),
        data=(X, y),
    )


def _log_lt(model, X: np.ndarray, y: np.ndarray, xi: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """log L~_n(theta) of every row, recomputed from the model's loglik and logbound."""
    eta = model.linear_predictor(np.asarray(theta, float)[None], X)
    return log_expm1(model.loglik(eta, y) - model.logbound(eta, y, xi))[0]


def _batched_stationarity_z(shard: Shard, X, y, sweeps: int) -> tuple[np.ndarray, np.ndarray]:
    """Z-scores (chains, rows) of each z_n's bright frequency under repeated
    the batched ``update_z`` against p_n = sigmoid(log L~_n(theta_c)), with the exact variance of
    the time average of a two-state chain (P01 = min(q, L~), P10 = min(1, q / L~)).

    Returns the z-scores and the mask of entries used (p_n not ~0)."""
    model, q = shard.model, shard.q_db
    C = len(shard.chains)
    freq = np.zeros((C, shard.n))
    with np.errstate(over="ignore", divide="ignore"):
        for _ in range(20):  # set_positions drew z exactly; a short burn-in regardless
            update_z([shard])[0]
        for _ in range(sweeps):
            update_z([shard])[0]
            freq += _masks(shard)
    freq /= sweeps
    lt = np.exp(np.array([_log_lt(model, X, y, shard.rows.xi, ch.theta) for ch in shard.chains]))
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


def _batched_shard(theta_hat, seed: int = 21, q: float = Q) -> tuple[Shard, np.ndarray, np.ndarray]:
    X, y = _stat_data()
    shard = _make_shard(X, y, fd.LogisticRegression(), chains=3, seed=seed, q=q)
    shard.set_tight_points(theta_hat)
    shard.set_positions(THETAS)
    assert shard.batched_z
    return shard, X, y


def test_batched_z_test_data_cover_both_regimes():
    """The stationarity check has power in both regimes: rows with L~ < q (proposal-limited
    brightening) and L~ > q (always accepted when proposed) at every chain's θ."""
    X, y = _stat_data()
    shard, _, _ = _batched_shard(THETA_HAT)
    for ch in shard.chains:
        lt = np.exp(_log_lt(shard.model, X, y, shard.rows.xi, ch.theta))
        p = lt / (1 + lt)
        assert np.sum((lt < Q) & (p > 0.02)) >= 5
        assert np.sum(lt > Q) >= 5


@pytest.mark.parametrize(  # untuned bounds (most rows bright) with the slow tests
    "theta_hat", [THETA_HAT, pytest.param(None, marks=pytest.mark.slow)], ids=["tuned", "untuned"]
)
def test_batched_z_update_leaves_conditional_invariant(theta_hat):
    """Three chains at three fixed θ, updated together: every z_n keeps sigmoid(log L~_n)."""
    shard, X, y = _batched_shard(theta_hat)
    z, use = _batched_stationarity_z(shard, X, y, sweeps=4000)
    m = int(use.sum())
    assert m >= 60
    assert np.max(np.abs(z[use])) < _crit(m), np.round(z, 2)
    assert stats.chi2.sf(np.sum(z[use] ** 2), m) > 1e-4


def test_batched_z_flipped_sign_negative_control_fails(monkeypatch):
    """The same check rejects the batched update with Algorithm 2's printed comparison
    (dark→bright accepted when ``u > L~ / q``)."""
    monkeypatch.setattr(batched_mod, "brighten", lambda log_u, vals, q: log_u > vals - math.log(q))
    shard, X, y = _batched_shard(THETA_HAT)
    z, use = _batched_stationarity_z(shard, X, y, sweeps=4000)
    m = int(use.sum())
    assert np.max(np.abs(z[use])) > 2 * _crit(m)
    assert stats.chi2.sf(np.sum(z[use] ** 2), m) < 1e-6


# ------------------------------------------------------- the batched z-update: bookkeeping
def _masks(shard: Shard) -> np.ndarray:
    """Every chain's z as one (chains, rows) boolean array."""
    z = np.zeros((len(shard.chains), shard.n), dtype=bool)
    for c, ch in enumerate(shard.chains):
        z[c, ch.bright.idx] = True
    return z


def _assert_cache_consistent(shard: Shard, X, y) -> None:
    """Each chain's bright rows are distinct, its sorted members are exactly those rows,
    and its cached values are log L~ of those rows at its θ."""
    for ch in shard.chains:
        b = ch.bright
        assert b.idx.dtype == np.int64 and b.members.dtype == np.int64
        assert np.unique(b.idx).size == b.idx.size
        assert np.array_equal(np.sort(b.idx), b.members)
        assert b.vals.shape == b.idx.shape
        ref = _log_lt(shard.model, X[b.idx], y[b.idx], shard.rows.xi[b.idx], ch.theta)
        np.testing.assert_allclose(b.vals, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("model_name", ["logistic", "robust"])
def test_batched_z_update_keeps_cache_consistent(model_name):
    """After every batched sweep: idx ↔ sorted members ↔ cached log L~ agree, for both
    models."""
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
    assert shard.batched_z
    _assert_cache_consistent(shard, X, y)
    total = 0
    with np.errstate(over="ignore", divide="ignore"):
        for _ in range(60):
            total += int(update_z([shard])[0].sum())
            _assert_cache_consistent(shard, X, y)
    assert total > 0


def test_batched_z_queries_count_dark_proposals():
    """Queries per chain = dark rows proposed: with q = 1 every row proposes, so each chain
    evaluates exactly the rows dark before the sweep."""
    shard, _, _ = _batched_shard(THETA_HAT, seed=34, q=1.0)
    with np.errstate(over="ignore", divide="ignore"):
        for _ in range(20):
            dark_before = (~_masks(shard)).sum(axis=1)
            assert np.array_equal(update_z([shard])[0], dark_before)


# ---------------------------------------------------------- log L~ in one formula, per model
def _eta_grid(rng: np.random.Generator, n: int) -> np.ndarray:
    extreme = np.array([0.0, -0.0, 1e-8, -1e-8, 40.0, -40.0, 1e3, -1e3, 1e200, -1e200])
    return np.concatenate([rng.normal(scale=3.0, size=n), extreme])


def _assert_formula_equals_reference(model, eta: np.ndarray, y: np.ndarray, xi: np.ndarray) -> None:
    """The compiled ``log L~`` in one formula (from ``eta`` and the model's row constants)
    against the numpy reference ``log_expm1(loglik - logbound)``."""
    consts = model.row_constants(y, xi)
    e3 = eta[None, :, None]
    ref = log_expm1(model.loglik(e3, y) - model.logbound(e3, y, xi))[0]
    assert not np.any(np.isnan(ref))
    fin = np.isfinite(ref)
    assert fin.sum() > eta.size // 2  # mostly finite values: the comparison has content
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
def test_logistic_compiled_log_bright_matches_reference(tuned):
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
    _assert_formula_equals_reference(model, eta, y, xi)
    # and at the tight point itself (delta ~ eps: tiny L~, finite)
    _assert_formula_equals_reference(model, (2 * y - 1) * xi, y, xi)


@pytest.mark.parametrize("tuned", [False, True], ids=["untuned", "tuned"])
def test_robust_compiled_log_bright_matches_reference(tuned):
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
    _assert_formula_equals_reference(model, eta, y, xi)
    _assert_formula_equals_reference(model, y - xi, y, xi)


def test_replica_z_values_are_the_shards_bits():
    """The driver's z-update on its replica (:func:`replica_z_propose`, its linear
    predictors four rows at a time) gives every bright row and every dark proposal the
    ``log L~`` the shards' kernel (:func:`eval_segments`, one row after another) gives
    it, bit for bit: 0 to 9 bright rows and proposals per chain (each count's remainder
    after the rows taken four at a time), 57 features, one chain's proposals among its
    bright rows skipped."""
    from flymc_dist import _compiled

    rng = np.random.default_rng(43)
    model = fd.LogisticRegression()
    kind, par = model.compiled_bright()
    D, C = 57, 10
    n_bright, n_prop = np.arange(C), np.arange(C)[::-1].copy()

    def rows(n: int) -> np.ndarray:
        X = rng.normal(size=(n, D)) / np.sqrt(D)
        y = (rng.random(n) < 0.5).astype(float)
        xi = model.tuned_xi(X @ rng.normal(size=D)[:, None], y)
        return np.column_stack([X, model.row_constants(y, xi)])

    buf, rows_buf = rows(int(n_bright.sum())), rows(int(n_prop.sum()) + 1)
    starts = np.concatenate([[0], np.cumsum(n_bright)])
    ids = np.concatenate([np.sort(rng.choice(1000, k, replace=False)) for k in n_bright])
    p_seg = np.concatenate([[0], np.cumsum(n_prop)])
    p_ids = np.concatenate([np.sort(rng.choice(1000, k, replace=False)) + 1000 for k in n_prop])
    p_at = rng.permutation(p_ids.size)
    # chain 8's one proposal is its first bright row: not a dark proposal, not evaluated
    p_ids[p_seg[8]] = ids[starts[8]]
    thetas = rng.normal(size=(C, D))
    keys = np.arange(1, C + 1, dtype=np.uint64)
    b_vals, gone = np.empty(ids.size), np.empty(ids.size, dtype=bool)
    cand, cand_at = np.empty(p_ids.size, np.int64), np.empty(p_ids.size, np.int64)
    cand_u, cand_vals = np.empty(p_ids.size), np.empty(p_ids.size)
    cand_seg, queries = np.empty(C + 1, np.int64), np.empty(C, np.int64)
    _compiled.replica_z_propose(
        buf, ids, starts, D, thetas, keys, -3.0, p_ids, p_seg, p_at, rows_buf,
        _compiled.KINDS[kind], np.asarray(par, float), b_vals, gone, cand, cand_seg, cand_at,
        cand_u, cand_vals, queries,
    )  # fmt: skip
    n = int(cand_seg[-1])
    assert n == p_ids.size - 1 and np.all(np.isfinite(cand_vals[:n]))
    assert list(queries) == [n_bright[c] + n_prop[c] - (c == 8) for c in range(C)]
    want = np.empty(ids.size)
    _compiled.eval_segments(
        buf, D, np.arange(ids.size), starts, thetas, _compiled.KINDS[kind], par, want
    )
    np.testing.assert_array_equal(b_vals.view(np.int64), want.view(np.int64))
    want = np.empty(n)
    _compiled.eval_segments(
        rows_buf, D, cand_at[:n], cand_seg, thetas, _compiled.KINDS[kind], par, want
    )
    np.testing.assert_array_equal(cand_vals[:n].view(np.int64), want.view(np.int64))


@pytest.mark.parametrize("replica", [False, True])
def test_a_dropped_shard_is_freed_at_once(replica: bool) -> None:
    """No reference cycle through a shard (its cached typed lists, its rows' callback
    into it): once nothing refers to a host and its shards, they are freed at once, not
    when the garbage collector happens to run — a worker would otherwise keep a finished
    run's rows."""
    import gc
    import weakref

    from flymc_dist.protocol import ReplicaRound, Request, Round
    from flymc_dist.transport.host import ShardHost

    rng = np.random.default_rng(0)
    n = 3000
    X = np.column_stack([np.ones(n), rng.normal(size=(n, 3))])
    y = (rng.random(n) < 0.5).astype(float)
    config = ShardConfig(
        model=fd.LogisticRegression(), algorithm="flymc", chains=2, seed=0, n_rows=n, q_db=0.01
    )

    def used() -> tuple[weakref.ref, weakref.ref]:
        host = ShardHost([ShardSpec(0, "", 0, 1024), ShardSpec(1, "", 1024, n)], config, {
            0: (X[:1024], y[:1024]), 1: (X[1024:], y[1024:])
        })  # fmt: skip
        shards = list(host.shards.values())
        for sh in shards:
            sh.set_tight_points(np.zeros(4))
            sh.set_replica(replica)
            sh.set_positions(np.zeros((2, 4)))
        thetas = np.zeros((2, 4))
        if replica:
            host.round(ReplicaRound(1, thetas))
        else:
            host.round(Round(1, np.full(2, -1), True, [Request(thetas[:1], False, False)] * 2))
        for sh in shards:  # a shard alone (it then keeps its own typed lists)
            msg = ReplicaRound(2, thetas) if replica else Round(2, np.full(2, -1), True, [None] * 2)
            round_shards([sh], msg)
        return weakref.ref(host), weakref.ref(shards[0])

    enabled = gc.isenabled()
    gc.disable()
    try:
        host, shard = used()
        assert host() is None and shard() is None
    finally:
        if enabled:
            gc.enable()
