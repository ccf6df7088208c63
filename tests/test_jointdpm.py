"""JointDPM: the collapsed NIW pieces against scipy, the Gibbs conditional against
brute force, the order-statistic member index, the weight tests' keyed member orders
and doubling trips against one minibatch at a time, eps = 0
decisions against exact MH over a cluster's members, draws bit-identical for 1, 2, 3
shards in process and on 2 Dask workers, a worker SIGKILLed mid-run, trace and resume
(identical to the uninterrupted run), and (slow) the posterior over partitions of 8 rows
against exhaustive enumeration, with the Gibbs step alone and with split–merge moves,
each with a negative control that must fail; the split's allocation probabilities and
the Laplace weight proposal against brute force and scipy."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import threading

import numpy as np
import pytest
from scipy import integrate, stats
from scipy.special import gammaln, logsumexp

import flymc_dist as fd
from flymc_dist.austerity.sampler import stop_rule
from flymc_dist.diagnostics import mcse_mean
from flymc_dist.jointdpm.data import four_blobs
from flymc_dist.jointdpm.niw import ClusterStats, NIWPrior
from flymc_dist.jointdpm.sampler import (
    NEW,
    ChainState,
    JointDPMSampler,
    MovedLabels,
    shard_bounds,
)
from flymc_dist.jointdpm.shard import RANK_PURPOSE, DPMShard, MemberIndex, logit_loglik
from flymc_dist.jointdpm.splitmerge import LAPLACE_STEPS, allocate, gaussian_logpdf, laplace, sums
from flymc_dist.jointdpm.transport import open_dpm_transport
from flymc_dist.streams import permuted_rows, stream_key


# ------------------------------------------------------------------ the NIW pieces
def test_student_t_predictive_after_1000_updates_equals_scipy():
    """1,000 random rank-one updates and downdates, then the predictive equals
    scipy.stats.multivariate_t built from the remaining points from scratch; the
    marginal likelihood equals the chain rule of predictives."""
    D = 3
    prior = NIWPrior.paper(D)
    rng = np.random.default_rng(0)
    c = ClusterStats(prior)
    pts: list[np.ndarray] = []
    downdates = 0
    for _ in range(1000):
        if pts and rng.random() < 0.45:
            c.remove(pts.pop(int(rng.integers(len(pts)))))
            downdates += 1
        else:
            x = rng.normal(size=D) * [1.0, 2.0, 0.5] + 1.0
            pts.append(x)
            c.add(x)
    assert downdates > 400
    X = np.array(pts)
    n = len(X)
    k, v = prior.k0 + n, prior.v0 + n
    m = (prior.k0 * prior.m0 + X.sum(0)) / k
    S = prior.S0 + X.T @ X + prior.k0 * np.outer(prior.m0, prior.m0) - k * np.outer(m, m)
    nu = v - D + 1
    t = stats.multivariate_t(loc=m, shape=S * (k + 1) / (k * nu), df=nu)
    q = rng.normal(size=(20, D)) * 2
    np.testing.assert_allclose(c.log_predictive(q), t.logpdf(q), rtol=1e-10, atol=1e-10)
    mm, A, const, nu2 = c.predictive_terms()
    direct = const - 0.5 * (nu2 + D) * np.log1p(np.sum(((q - mm) @ A.T) ** 2, axis=1) / nu2)
    np.testing.assert_allclose(direct, t.logpdf(q), rtol=1e-10, atol=1e-10)
    fresh = ClusterStats(prior)
    chain = 0.0
    for x in X[:15]:
        chain += fresh.log_predictive(x)[0]
        fresh.add(x)
    assert chain == pytest.approx(fresh.log_marginal(), rel=1e-12)
    # negative control: a wrong degrees of freedom is seen
    wrong = stats.multivariate_t(loc=m, shape=S * (k + 1) / (k * nu), df=nu + 1)
    assert np.max(np.abs(c.log_predictive(q) - wrong.logpdf(q))) > 1e-3


def _allocate(X, x_i, x_j, prior, u=None, forced=None):
    n = len(X)
    side = np.empty(n, dtype=np.int8)
    u = np.zeros(n) if u is None else u
    forced = np.full(n, -1, dtype=np.int8) if forced is None else np.asarray(forced, np.int8)
    L0 = np.linalg.cholesky(prior.S0)
    log_q = allocate(X, x_i, x_j, prior.m0, prior.k0, prior.v0, L0, u, forced, side)
    return log_q, side


def test_split_allocation_probabilities():
    """The split's sequential allocation: the probabilities of all 2⁶ allocations of six
    rows (computed with forced sides) sum to one; a drawn allocation's log probability
    is the forced one of the same sides; and each step's probability is ``n_s t_s(x)``
    normalised, with ``t`` the NIW Student-t predictive (:class:`ClusterStats`)."""
    D = 2
    prior = NIWPrior.paper(D)
    rng = np.random.default_rng(3)
    X = rng.normal(size=(6, D)) * 1.5
    x_i, x_j = np.array([-1.0, 0.5]), np.array([1.2, -0.3])
    total = sum(
        math.exp(_allocate(X, x_i, x_j, prior, forced=f)[0])
        for f in itertools.product((0, 1), repeat=6)
    )
    assert total == pytest.approx(1.0, abs=1e-12)
    for seed in range(5):
        u = np.random.default_rng(seed).random(6)
        log_q, side = _allocate(X, x_i, x_j, prior, u=u)
        assert _allocate(X, x_i, x_j, prior, forced=side)[0] == pytest.approx(log_q, abs=1e-12)
    a, b = ClusterStats(prior), ClusterStats(prior)
    a.add(x_i)
    b.add(x_j)
    expect = 0.0
    for x, s_ in zip(X[:3], (0, 1, 1), strict=True):
        la = math.log(a.n) + a.log_predictive(x)[0]
        lb = math.log(b.n) + b.log_predictive(x)[0]
        expect += (la if s_ == 0 else lb) - np.logaddexp(la, lb)
        (a if s_ == 0 else b).add(x)
    got = _allocate(X[:3], x_i, x_j, prior, forced=(0, 1, 1))[0]
    assert got == pytest.approx(expect, rel=1e-12)
    sx, sxx = sums(X)
    np.testing.assert_allclose(sx, X.sum(0), rtol=1e-14)
    np.testing.assert_allclose(sxx, X.T @ X, rtol=1e-14)


def test_laplace_approximation_is_the_posterior_mode_and_curvature():
    """The split–merge's weight proposal: the mean is the logistic posterior's mode (as
    found by scipy's BFGS) and the precision its Hessian there, for a small cluster and
    for one large enough to start on a subset of its rows; the density is the
    Gaussian's."""
    from scipy.optimize import minimize

    rng = np.random.default_rng(1)
    F = np.column_stack([rng.normal(size=(40, 2)), np.ones(40)])
    y = (rng.random(40) < 1 / (1 + np.exp(-F @ [1.5, -1.0, 0.3]))).astype(float)
    sd = 1.3
    mean, R = laplace(F, y, sd, LAPLACE_STEPS)

    def neg_log_post(w):
        return -float(logit_loglik(F, y, w).sum()) + 0.5 * float(w @ w) / sd**2

    opt = minimize(neg_log_post, np.zeros(3), method="BFGS", options={"gtol": 1e-10})
    np.testing.assert_allclose(mean, opt.x, atol=1e-6)
    p = 1 / (1 + np.exp(-F @ mean))
    H = (F * (p * (1 - p))[:, None]).T @ F + np.eye(3) / sd**2
    np.testing.assert_allclose(R @ R.T, H, rtol=1e-10)
    w = rng.normal(size=3)
    ref = stats.multivariate_normal(mean, np.linalg.inv(H)).logpdf(w)
    assert gaussian_logpdf(w, mean, R) == pytest.approx(ref, rel=1e-10)
    # a large cluster: the steps on a subset, two on every row, reach the mode too
    F = np.column_stack([rng.normal(size=(20000, 2)), np.ones(20000)])
    y = (rng.random(20000) < 1 / (1 + np.exp(-F @ [1.5, -1.0, 0.3]))).astype(float)
    mean, R = laplace(F, y, sd, LAPLACE_STEPS)
    p = 1 / (1 + np.exp(-F @ mean))
    grad = F.T @ (y - p) - mean / sd**2
    H = (F * (p * (1 - p))[:, None]).T @ F + np.eye(3) / sd**2
    np.testing.assert_allclose(R @ R.T, H, rtol=1e-8)
    # Newton's next step from the mean, in posterior sds: within 10⁻³ sd of the mode
    step = np.linalg.solve(H, grad) / np.sqrt(np.diag(np.linalg.inv(H)))
    assert np.max(np.abs(step)) < 1e-3, step


def test_member_index_insert_remove_select():
    """The order-statistic index follows random moves: a cluster's r-th member in row
    order is the r-th of np.flatnonzero(z == k), for every rank; counts agree; a rank
    past the end is refused."""
    rng = np.random.default_rng(1)
    z = rng.integers(0, 3, 300)
    index = MemberIndex(z)
    for _ in range(2000):
        r, k = int(rng.integers(300)), int(rng.integers(0, 5))
        old = int(z[r])
        if old != k:
            z[r] = k
            index.move(r, old, k)
    assert index.labels() == sorted(set(z.tolist()))
    for k in range(5):
        members = np.flatnonzero(z == k)
        assert index.count(k) == members.size
        np.testing.assert_array_equal(index.members(k), members)
        ranks = rng.permutation(members.size)
        np.testing.assert_array_equal(index.select(k, ranks), members[ranks])
    with pytest.raises(ValueError, match="ranks must lie"):
        index.select(0, np.array([index.count(0)]))


def test_bulk_moves_leave_the_index_row_by_row_moves_leave():
    """A shard's move of many rows at once (a split or merge relabels whole clusters;
    repeated rows keep their last label) leaves the labels and the index — block counts,
    Fenwick trees, totals, emptied clusters dropped — exactly as moving them one by one."""
    from flymc_dist.jointdpm.shard import BULK_MOVE, DPMShard

    rng = np.random.default_rng(4)
    n = 5000
    X = rng.normal(size=(n, 2))
    y = (rng.random(n) < 0.5).astype(float)
    bulk, single = (DPMShard(0, 0, X, y, [0, 1], 1, 0) for _ in range(2))
    for sh in (bulk, single):
        sh.restore(0, np.arange(n) % 4)
    for step in range(6):
        rows = rng.integers(0, n, 3 * BULK_MOVE)
        labels = rng.integers(0, 6, rows.size)
        if step == 5:  # cluster 1 emptied into 7
            rows = np.flatnonzero(bulk.z[0] == 1)
            labels = np.full(rows.size, 7)
        bulk.move(0, rows, labels)
        for r, k in zip(rows, labels, strict=True):
            single.move(0, np.array([r]), np.array([k]))
        np.testing.assert_array_equal(bulk.z[0], single.z[0])
        a, b = bulk.index[0], single.index[0]
        assert a.totals == b.totals and sorted(a.blocks) == sorted(b.blocks)
        for k in a.blocks:
            np.testing.assert_array_equal(a.blocks[k], b.blocks[k])
            np.testing.assert_array_equal(a.trees[k], b.trees[k])
    assert 1 not in bulk.index[0].totals and bulk.index[0].count(7) > 0


def test_moved_labels_keep_each_rows_last_label(monkeypatch):
    """The compact store of moved labels answers as a dict of the last label per row:
    across flushes, from a checkpoint's arrays in any order, and by row range."""
    monkeypatch.setattr(MovedLabels, "FLUSH", 7)  # many flushes, some moves pending
    rng = np.random.default_rng(3)
    moves = zip(rng.integers(0, 50, 400).tolist(), rng.integers(0, 9, 400).tolist(), strict=True)
    store, want = MovedLabels(), {}
    for i, (r, k) in enumerate(moves):
        store.set(r, k)
        want[r] = k
        if i % 53 == 0:
            rows, labels = store.arrays()
            assert dict(zip(rows.tolist(), labels.tolist(), strict=True)) == want
    rows, labels = store.arrays()
    assert rows.tolist() == sorted(want) and labels.tolist() == [want[r] for r in sorted(want)]
    assert len(store) == len(want)
    sub_rows, sub_labels = store.within(10, 20)
    assert sub_rows.tolist() == [r for r in sorted(want) if 10 <= r < 20]
    assert sub_labels.tolist() == [want[r] for r in sub_rows.tolist()]
    # a checkpoint's arrays, reversed: the same store
    again = MovedLabels(rows[::-1], labels[::-1])
    assert [a.tolist() for a in again.arrays()] == [rows.tolist(), labels.tolist()]
    with pytest.raises(ValueError, match="as many rows as labels"):
        MovedLabels(rows, labels[:-1])


# ------------------------------------------------------------------ a small problem
X8 = np.array([-2.2, -1.9, -1.4, -0.3, 0.4, 1.6, 2.0, 2.5])[:, None]
Y8 = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
PAIRS = [(0, 1), (0, 7), (2, 3), (5, 6)]


def _sampler(alg, X=X8, y=Y8, n_shards=2, chains=1, seed=0, cls=JointDPMSampler, **kw):
    bounds = shard_bounds(len(X), n_shards)
    cols = list(range(X.shape[1])) if alg.density_columns is None else list(alg.density_columns)
    tr = open_dpm_transport("synchronous", X, y, bounds, cols, chains, seed)
    s = cls(alg, tr, bounds, X.shape[1], chains=chains, seed=seed, **kw)
    s.setup()
    return s


def _log_joint(z, w, alpha, X, y, prior, a_prior=(1.0, 1.0)):
    """log p(z, w | α) p(data | z, w) up to a constant: CRP × NIW marginals (closed form
    from the clusters' sums) × logistic likelihood × weight priors."""
    labels = sorted(set(z))
    K, N = len(labels), len(z)
    out = K * math.log(alpha) + gammaln(alpha) - gammaln(alpha + N)
    F = np.hstack([X, np.ones((N, 1))])
    for k in labels:
        idx = [i for i in range(N) if z[i] == k]
        out += gammaln(len(idx))
        xs = X[idx][:, [0]]
        cs = ClusterStats.from_sums(prior, len(idx), xs.sum(0), xs.T @ xs)
        out += cs.log_marginal()
        out += float(logit_loglik(F[idx], y[idx], w[k]).sum())
        out += float(stats.norm.logpdf(w[k]).sum())
    return out


def test_z_conditional_equals_brute_force():
    """The Gibbs conditional of one label (Student-t predictives with counts n_k⁻ⁱ, α and
    the auxiliary weights for a new cluster) equals the normalised full joint over the
    label's values, computed from closed-form marginals — for a row in a shared cluster
    and for a singleton (whose weights become the auxiliary)."""
    s = _sampler(fd.JointDPM())
    prior = s.prior
    rng = np.random.default_rng(3)
    z = [0, 0, 1, 1, 1, 2, 3, 3]
    w = {k: rng.normal(size=2) for k in range(4)}
    F = np.hstack([X8, np.ones((8, 1))])
    for i in (1, 5):  # 1 shares cluster 0; 5 is alone in cluster 2
        alpha = 0.7
        stats_ = {}
        for k in set(z):
            idx = [j for j in range(8) if z[j] == k and j != i]
            if idx:
                xs = X8[idx]
                stats_[k] = ClusterStats.from_sums(prior, len(idx), xs.sum(0), xs.T @ xs)
        w_aux = w[z[i]] if z[i] not in stats_ else rng.normal(size=2)
        st = ChainState(alpha, stats_, {k: w[k] for k in stats_}, {}, 10, rng)
        labels, lw = s.z_log_weights(s.gibbs_table(st), X8[i], F[i], float(Y8[i]), w_aux)
        got = np.exp(lw - logsumexp(lw))
        brute = []
        for k in labels:
            zz = list(z)
            ww = dict(st.w)
            if k == NEW:
                zz[i], ww[99] = 99, w_aux
            else:
                zz[i] = k
            # the auxiliary weights: the new cluster's when chosen, else drawn from the
            # prior beside the state (algorithm 8's extended space), so p(w_aux) is
            # in every candidate's joint
            aux = 0.0 if k == NEW else float(stats.norm.logpdf(w_aux).sum())
            brute.append(_log_joint(zz, ww, alpha, X8, Y8, prior) + aux)
        brute = np.exp(np.array(brute) - logsumexp(brute))
        np.testing.assert_allclose(got, brute, rtol=1e-9, atol=1e-12)
        # negative control: without n_k the conditional differs
        wrong = lw - np.log([st.stats[k].n for k in labels[:-1]] + [alpha])
        assert np.max(np.abs(np.exp(wrong - logsumexp(wrong)) - brute)) > 1e-3


def test_eps0_decisions_are_exact_mh_over_members():
    """eps = 0: every w_k decision reads each of the cluster's members once (its rows are
    exactly the cluster's members on the shards) and takes the exact MH decision."""
    X, y = four_blobs(600, 2)
    s = _sampler(fd.JointDPM(init_clusters=4, step_z=50), X, y, n_shards=3, record_rows=True)
    F = np.hstack([X, np.ones((len(X), 1))])
    decided = 0
    for _ in range(5):
        (info,) = s.step()
        z = np.concatenate(s.transport.call_all("z_of", 0))
        rows = s.last_rows[0]
        for j, k in enumerate(info["decision_labels"]):
            members = np.flatnonzero(z == k)
            assert sorted(rows[k].tolist()) == members.tolist()
            w, wp = info["decision_w"][j], info["decision_proposal"][j]
            Fm, ym = F[members], y[members]
            diff = logit_loglik(Fm, ym, wp) - logit_loglik(Fm, ym, w)
            lhs = diff.sum() - 0.5 * (wp @ wp - w @ w)
            assert bool(lhs > info["decision_log_u"][j]) == bool(info["decision_accept"][j])
            decided += 1
    assert decided >= 15


def test_austerity_decisions_use_the_paper_rule():
    """eps > 0: no decision reads fewer than min_batches × batch_size members (or the
    whole cluster), and some stop well before the whole cluster."""
    X, y = four_blobs(2000, 4)
    alg = fd.JointDPM(init_clusters=3, step_z=20, eps=0.3, batch_size=10, min_batches=3)
    s = _sampler(alg, X, y, n_shards=2)
    used, total = [], []
    for _ in range(4):
        (info,) = s.step()
        used.extend(info["decision_n"].tolist())
        total.extend(info["decision_N"].tolist())
    used, total = np.array(used), np.array(total)
    assert np.all(used >= np.minimum(30, total))
    assert np.mean(used < total / 4) > 0.5


def test_weight_tests_take_one_minibatch_at_a_time_in_their_keyed_order():
    """eps > 0: each cluster's decision, made with several minibatches a round trip
    (doubling), is the sequential test taken one minibatch at a time over the cluster's
    members in the order of its keyed permutation — recomputed here from the data and
    the labels alone: the same members used and the same accept/reject — in far fewer
    round trips than minibatches."""
    X, y = four_blobs(4000, 3)
    alg = fd.JointDPM(init_clusters=3, step_z=30, eps=0.05, batch_size=10, min_batches=3)
    s = _sampler(alg, X, y, n_shards=3)
    for _ in range(3):
        s.step()
    st = s.states[0]
    z = np.concatenate(s.transport.call_all("z_of", 0))
    F = np.hstack([X, np.ones((len(X), 1))])
    labels = sorted(st.stats)
    rng = np.random.default_rng(2)
    checked = minibatches = 0
    for key in range(10, 16):
        W = np.stack([st.w[k] for k in labels])
        Wp = W + 0.02 * rng.standard_normal(W.shape)
        log_u = -rng.standard_exponential(len(labels))
        trips_before = s.transport.round_trips
        d = s.decide_weights(0, labels, W, Wp, log_u, alg.eps, key)
        trips = s.transport.round_trips - trips_before
        for i, k in enumerate(labels):
            members = np.flatnonzero(z == k)
            N = members.size
            order = members[permuted_rows(stream_key(s.seed, k, 0, key, RANK_PURPOSE), N, 0, N)]
            vals = logit_loglik(F[order], y[order], Wp[i]) - logit_loglik(F[order], y[order], W[i])
            lp = -0.5 * (W[i] @ W[i] - Wp[i] @ Wp[i])
            mu0 = (log_u[i] + lp) / N
            for b, n in enumerate(range(10, N + 10, 10)):
                n = min(n, N)
                m = vals[:n].mean()
                stop, acc, _ = stop_rule(
                    np.array([n]), np.array([m]), np.array([np.sum((vals[:n] - m) ** 2)]),
                    np.array([mu0]), N, alg.eps, tails="one", rounds=np.array([b + 1]),
                    min_batches=3,
                )  # fmt: skip
                if stop[0]:
                    break
            assert d["decision_n"][i] == n and d["decision_accept"][i] == acc[0], (k, key)
            checked += 1
            minibatches = max(minibatches, b + 1)
        assert trips <= 1 + math.ceil(math.log2(minibatches / 3 + 1)), (trips, minibatches)
    assert checked >= 12 and minibatches >= 8


@pytest.mark.slow
def test_decision_error_shrinks_with_eps():
    """On one state of the four-blob chain, the same weight moves (w, w′, u) decided at
    eps = 0.3, 0.1, 0.01 against the exact decision (eps = 0): the share that differ
    falls with eps, and the loosest one errs visibly (the comparison can see an error),
    while reading fewer members."""
    X, y = four_blobs(3000, 8)
    s = _sampler(fd.JointDPM(init_clusters=4, step_z=30), X, y, n_shards=2)
    for _ in range(3):
        s.step()
    st = s.states[0]
    labels = sorted(st.stats)
    rng = np.random.default_rng(9)
    reps = 60
    W = np.stack([st.w[k] for k in labels])
    moves = [
        (W + 0.05 * rng.standard_normal(W.shape), -rng.standard_exponential(len(labels)))
        for _ in range(reps)
    ]
    exact = [
        s.decide_weights(0, labels, W, wp, lu, 0.0, key)["decision_accept"]
        for key, (wp, lu) in enumerate(moves)
    ]
    err, used = [], []
    for e in (0.3, 0.1, 0.01):
        wrong = rows = 0
        for key, ((wp, lu), ex) in enumerate(zip(moves, exact, strict=True)):
            d = s.decide_weights(0, labels, W, wp, lu, e, key)
            wrong += int(np.sum(d["decision_accept"] != ex))
            rows += d["data_used"]
        err.append(wrong / (reps * len(labels)))
        used.append(rows)
    assert err[0] > 0.02 and err[0] > err[1] >= err[2], err
    assert err[2] < 0.02 and used[0] < used[2] < 3000 * reps, (err, used)


@pytest.mark.parametrize("how", ["escobar-west", "mh"])
def test_alpha_update_targets_its_conditional(how):
    """With K fixed, repeated α moves have the mean of p(α | K, N) ∝ Gamma(α; 1, 1)
    α^K Γ(α)/Γ(α + N) (quadrature), within 4 MCSE; negative control: the same chain
    is far from the conditional of another N."""
    s = _sampler(fd.JointDPM(alpha_update=how))
    K, N = 3, s.N

    def cond_mean(n):
        def f(al, p):
            return al**p * math.exp(K * math.log(al) - al + gammaln(al) - gammaln(al + n))

        top = integrate.quad(f, 0, np.inf, args=(1,))[0]
        return top / integrate.quad(f, 0, np.inf, args=(0,))[0]

    st = ChainState(1.0, {k: None for k in range(K)}, {}, {}, K, np.random.default_rng(4))
    draws = np.empty((4, 3000))
    for c in range(4):
        for t in range(draws.shape[1]):
            s.update_alpha(st)
            draws[c, t] = st.alpha
    est, se = draws.mean(), float(mcse_mean(draws))
    assert abs(est - cond_mean(N)) < 4 * se, (est, cond_mean(N), se)
    assert abs(est - cond_mean(4 * N)) > 8 * se


def test_options_and_bad_input():
    """JointDPM's options are checked once, in one line naming the argument."""
    assert fd.JointDPM().changed() == {}
    assert fd.JointDPM(niw=[2, 3]).niw == (2.0, 3.0)
    for kw, match in (
        ({"alpha_prior": (1.0, -1.0)}, "alpha_prior must be two numbers > 0"),
        ({"niw": 5}, "niw must be two numbers > 0"),
        ({"density_columns": [0, 0]}, "density_columns must be None or distinct"),
        ({"alpha_update": "slice"}, "alpha_update must be"),
        ({"step_z": 0}, "step_z must be an integer >= 1"),
        ({"eps": 1.0}, "eps must be"),
        ({"split_merge": -1}, "split_merge must be an integer >= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            fd.JointDPM(**kw)
    with pytest.raises(ValueError, match="binary labels"):
        fd.sample_jointdpm((X8, Y8 + 2), client="synchronous", num_samples=2)
    with pytest.raises(ValueError, match="client must be"):
        fd.sample_jointdpm((X8, Y8), client="tcp-nowhere", num_samples=2)
    with pytest.raises(ValueError, match="density_columns"):
        fd.sample_jointdpm(
            (X8, Y8), fd.JointDPM(density_columns=(3,)), client="synchronous", num_samples=2
        )


# ------------------------------------------------------------------ placement
def _run(client, n_shards=3, **kw):
    X, y = four_blobs(900, 5)
    Xt, yt = four_blobs(200, 6)
    alg = fd.JointDPM(init_clusters=3, step_z=40, eps=0.3)
    return fd.sample_jointdpm(
        (X, y),
        alg,
        num_samples=12,
        chains=2,
        seed=11,
        client=client,
        n_shards=n_shards,
        test=(Xt, yt),
        pairs=[(0, 1), (2, 500)],
        **kw,
    )


def _final_state(client, n_shards, steps=10, kill_at=None):
    """Every chain's α, weights, NIW statistics and labels after ``steps`` iterations
    (and the recoveries); ``kill_at``: SIGKILL the worker of shard 1 as that iteration
    starts."""
    X, y = four_blobs(900, 5)
    bounds = shard_bounds(len(X), n_shards)
    tr = open_dpm_transport(client, X, y, bounds, [0, 1], 2, 11)
    # on a Dask cluster an iteration's calls travel on the shards' channels
    assert tr.channel == ("in-process" if client == "synchronous" else "socket")
    try:
        s = JointDPMSampler(
            fd.JointDPM(init_clusters=2, step_z=40, eps=0.3, split_merge=1),
            tr,
            bounds,
            2,
            chains=2,
            seed=11,
        )
        s.setup()
        pids = client.run(os.getpid) if kill_at is not None else {}
        split_merged = np.zeros(2, dtype=np.int64)
        for it in range(steps):
            if it == kill_at:
                victim = tr.where[1]
                threading.Thread(target=os.kill, args=(pids[victim], signal.SIGKILL)).start()
            split_merged += [info["split_merged"] for info in s.step()]
        out = [split_merged.tolist()]
        for c, st in enumerate(s.states):
            z = np.concatenate(tr.call_all("z_of", c))
            stats_ = {k: (v.n, v.m.tobytes(), v.L.tobytes()) for k, v in st.stats.items()}
            w = {k: v.tobytes() for k, v in st.w.items()}
            out.append((st.alpha, w, stats_, z.tobytes()))
        if kill_at is not None:
            return out, tr.recoveries, victim
        return bounds.size - 1, out
    finally:
        tr.close()


@pytest.mark.slow
def test_identical_draws_for_every_layout_and_on_two_workers(local_clusters, monkeypatch):
    """The same seed gives bit-identical draws (α, every cluster's weights and NIW
    statistics, every row's label) with 1, 2 or 3 shards in process and with 2 or 3 shards
    on a 2-worker Dask LocalCluster (shards as actors); and sample_jointdpm's traced
    quantities (α, K, sizes, co-clustering, data used, accuracy) too."""
    from distributed import Client

    ref = {}
    for ns in (1, 2, 3):
        got, ref[ns] = _final_state("synchronous", ns)
        assert got == ns
    with Client(local_clusters.get(2), direct_to_workers=True) as client:
        dask = {ns: _final_state(client, ns)[1] for ns in (2, 3)}
        b = _run(client, n_shards=2)
        # every request too large for the channel: each call through Dask instead
        import flymc_dist.jointdpm.transport as transport_mod

        monkeypatch.setattr(transport_mod, "CHANNEL_BYTES", 0)
        dask["2, through Dask"] = _final_state(client, 2)[1]
    a = _run("synchronous", n_shards=1)
    c = _run("synchronous", n_shards=3)
    for name, other in (
        ("2", ref[2]),
        ("3", ref[3]),
        *(("dask " + str(k), v) for k, v in dask.items()),
    ):
        assert other == ref[1], name
    # the comparison is not vacuous: a cluster was made (label 2 of init_clusters=2), and
    # a split or merge accepted
    assert sum(ref[1][0]) > 0
    assert any(max(w) >= 2 for _, w, _, _ in ref[1][1:])
    for _, _, stats_, z in ref[1][1:]:
        assert sorted(np.unique(np.frombuffer(z, np.int64)).tolist()) == sorted(stats_)
    assert b.info["transport"] == "dask" and b.info["n_shards"] == 2
    assert b.info["channel"] == "socket"
    assert a.info["n_shards"] == 1 and c.info["n_shards"] == 3
    for key in ("alpha", "K", "sizes", "cocluster", "data_used", "accepted", "accuracy"):
        np.testing.assert_array_equal(a.draws[key], b.draws[key], err_msg=key)
        np.testing.assert_array_equal(a.draws[key], c.draws[key], err_msg=key)
    assert a.draws["accepted"].sum() > 0
    assert a.draws["data_used"].sum() < a.draws["cluster_rows"].sum()  # austerity stopped early
    d = _run("synchronous", predict_every=1)
    np.testing.assert_array_equal(a.draws["alpha"], d.draws["alpha"])


@pytest.mark.slow
@pytest.mark.cluster
def test_worker_killed_mid_run_completes_with_the_same_draws():
    """SIGKILL the worker of one shard of three on a 2-worker LocalCluster mid-run: the
    lost shards are recreated on a live worker from their rows with the labels the driver
    knows (row-keyed initial ones and every move since), the run completes, and its
    state — α, weights, NIW statistics, every label — is bit-identical to the run in
    process that lost nothing (so it is the same valid chain)."""
    from flymc_dist.transport.dask import local_client

    _, ref = _final_state("synchronous", 3, steps=20)
    client, cluster = local_client(2)
    try:
        got, recoveries, victim = _final_state(client, 3, steps=20, kill_at=8)
    finally:
        client.close()
        cluster.close()
    assert len(recoveries) >= 1, recoveries
    assert recoveries[0]["lost_workers"] == [victim] and 1 in recoveries[0]["shards"]
    assert got == ref


def _same_bits(a, b) -> bool:
    """Whether ``a`` and ``b`` hold the same values, arrays bit for bit (lists and
    tuples alike)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def test_a_shard_serves_its_iteration_calls_on_its_channel_and_nothing_else(tmp_path):
    """A JointDPM shard host's channel answers the iteration's calls with the shard's
    own results (arrays and plain data, not pickled) and refuses, before anything runs,
    any other method (set-up, restore, Python's own), another shard's id, and a message
    that is not calls; the connection goes on."""
    from flymc_dist.jointdpm.transport import CHANNEL_METHODS, DPMHost
    from flymc_dist.protocol import pack_arrays, pack_calls, unpack_results
    from flymc_dist.transport.channel import CALLS, ECHO, ChannelClient

    X, y = four_blobs(200, 3)
    host = DPMHost(4, 0, X, y, [0, 1], 1, 7)
    host.init_labels(0, 3, 64, 4)
    twin = DPMShard(4, 0, X, y, [0, 1], 1, 7)
    twin.init_labels(0, 3, 64, 4)
    client = ChannelClient()
    address, _ = host.open_channel("127.0.0.1", client.secret)
    client.connect("s", address, client.secret)  # TCP: every frame MAC'd
    try:
        w = np.array([0.5, -1.0, 0.2, 0.1])
        calls = {
            "rows": (0, np.array([3, 1, 150])),
            "counts": (0,),
            "batch": (0, [(1, np.array([0, 2]), w, w + 0.1, True), (2, None, w, w, False)]),
            "move": (0, np.array([5]), np.array([1])),
        }
        assert set(calls) == CHANNEL_METHODS
        for method, args in calls.items():
            ok, bad = client.fanout(CALLS, pack_calls({4: (method, args)}), ["s"], timeout=10)
            assert not bad, bad
            got, want = unpack_results(ok["s"])[4], getattr(twin, method)(*args)
            assert _same_bits(got, want), method
        marker = tmp_path / "ran"
        for method, args, text in (
            ("restore", (0, np.zeros(200, dtype=np.int64)), "not served"),
            ("clusters", (0, [0, 2]), "not served"),  # O(N_k) rows a reply: through Dask
            ("init_labels", (0, 1, 64, 4), "not served"),
            ("__init__", (0, 0, X, y, [0], 1, 0), "not served"),
            ("counts", (0,), "this is shard 4"),
        ):
            sid = 5 if text.startswith("this") else 4
            _, bad = client.fanout(CALLS, pack_calls({sid: (method, args)}), ["s"], timeout=10)
            assert isinstance(bad["s"], ValueError) and text in str(bad["s"]), bad["s"]
        for blob in (pack_arrays(("exec", f"touch {marker}"), []), b"junk"):
            _, bad = client.fanout(CALLS, blob, ["s"], timeout=10)
            assert isinstance(bad["s"], ValueError)
        _, bad = client.fanout(ECHO, b"x", ["s"], timeout=10)
        assert isinstance(bad["s"], ValueError)  # shard calls only
        np.testing.assert_array_equal(host.z_of(0), twin.z_of(0))  # nothing else moved
        assert not marker.exists()
    finally:
        client.close()
        host.close_channel()


# ------------------------------------------------------------------ trace and resume
def _traced(trace, **kw):
    X, y = four_blobs(600, 5)
    Xt, yt = four_blobs(100, 6)
    opts = dict(
        num_warmup=5,
        num_samples=16,
        chains=2,
        seed=11,
        client="synchronous",
        n_shards=2,
        test=(Xt, yt),
        pairs=[(0, 1), (2, 500)],
        trace=trace,
        checkpoint_every=4,
    )
    opts.update(kw)
    alg = fd.JointDPM(init_clusters=2, step_z=30, eps=0.3, split_merge=1)
    return fd.sample_jointdpm((X, y), alg, **opts)


# during warm-up, and during sampling
@pytest.mark.parametrize("stop_at", [6, pytest.param(15, marks=pytest.mark.slow)])
def test_interrupted_run_resumes_identically(tmp_path, monkeypatch, stop_at):
    """A run interrupted at iteration ``stop_at`` resumes from its trace's checkpoint (on
    3 shards, where it ran on 2) and gives the draws of the run never interrupted, bit
    for bit: α, K, sizes, co-clustering, data used, accuracy and the final predictive;
    the trace holds the label-free quantities by name; a resume of another run (another
    seed) is refused, as is a new run over the trace."""
    from flymc_dist.trace import Trace

    full = _traced(str(tmp_path / "full.zarr"))
    path = str(tmp_path / "t.zarr")
    calls = {"n": 0}
    real_step = JointDPMSampler.step

    def flaky_step(self):
        calls["n"] += 1
        if calls["n"] == stop_at:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(JointDPMSampler, "step", flaky_step)
    with pytest.raises(KeyboardInterrupt):
        _traced(path)
    monkeypatch.setattr(JointDPMSampler, "step", real_step)
    ck = Trace.open(path).checkpoint
    assert stop_at - 4 <= ck["iteration"] < stop_at
    with pytest.raises(ValueError, match="another run"):
        _traced(path, resume=True, seed=12)
    with pytest.raises(FileExistsError):
        _traced(path)
    res = _traced(path, resume=True, n_shards=3)
    assert res.info["n_shards"] == 3
    for key in full.draws:
        if key != "seconds":
            np.testing.assert_array_equal(res.draws[key], full.draws[key], err_msg=key)
    tr, ref = Trace.open(path), Trace.open(str(tmp_path / "full.zarr"))
    assert tr.n_draws == 16 and tr.checkpoint["iteration"] == 21
    np.testing.assert_array_equal(tr.samples, ref.samples)
    np.testing.assert_array_equal(tr.samples[:, :, 1], full.draws["K"])
    np.testing.assert_array_equal(tr.stats["accuracy"], full.draws["accuracy"])
    assert full.draws["K"].max() > full.draws["K"].min()  # the chains moved
    assert full.draws["split_merged"].sum() > 0  # and a split or merge was accepted
    with pytest.raises(FileNotFoundError):
        _traced(str(tmp_path / "missing.zarr"), resume=True)


def test_resume_before_any_checkpoint_is_refused(tmp_path, monkeypatch):
    """Interrupted before its first checkpoint, a trace has nothing to resume from."""
    path = str(tmp_path / "t.zarr")
    monkeypatch.setattr(
        JointDPMSampler, "step", lambda self: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    with pytest.raises(KeyboardInterrupt):
        _traced(path)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="no checkpoint"):
        _traced(path, resume=True)


def test_trace_reads_with_xarray(tmp_path):
    """The trace opens with xarray alone: the quantities by name along ``quantity``."""
    xr = pytest.importorskip("xarray")
    path = str(tmp_path / "x.zarr")
    res = _traced(path, num_samples=4, num_warmup=0)
    post = xr.open_zarr(path, group="posterior", consolidated=False)
    names = list(post["quantity"].values)
    assert names[:3] == ["alpha", "K", "size_0"] and names[-1] == "together_1"
    np.testing.assert_array_equal(post["theta"].sel(quantity="alpha").values, res.draws["alpha"])


# ------------------------------------------------------------------ known truth
def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for j in range(len(part)):
            yield [*part[:j], [first, *part[j]], *part[j + 1 :]]


def _exact_posterior(X, y, prior, a=1.0, b=1.0, nodes=60):
    """P(K) and P(z_i = z_j) by enumerating every partition: the NIW marginal in closed
    form, ∫ N(w; 0, I) Π σ dw by Gauss–Hermite quadrature, ∫ p(α) CRP dα by quad."""
    N = len(X)
    F = np.hstack([X, np.ones((N, 1))])
    t, h = np.polynomial.hermite.hermgauss(nodes)
    W = np.sqrt(2.0) * np.array(list(itertools.product(t, t)))
    logh = np.log(np.array([hi * hj for hi in h for hj in h]) / np.pi)
    block = {}
    for mask in range(1, 2**N):
        idx = [i for i in range(N) if mask >> i & 1]
        xs = X[idx]
        cs = ClusterStats.from_sums(prior, len(idx), xs.sum(0), xs.T @ xs)
        ll = logit_loglik(F[idx], y[idx], W).sum(axis=1)
        block[mask] = cs.log_marginal() + logsumexp(ll + logh) + gammaln(len(idx))

    def crp(K):
        f = lambda al: math.exp(  # noqa: E731
            (a - 1) * math.log(al) - b * al + K * math.log(al) + gammaln(al) - gammaln(al + N)
        )
        return math.log(integrate.quad(f, 0, np.inf, limit=200)[0])

    log_alpha_term = {K: crp(K) for K in range(1, N + 1)}
    logs, Ks, parts = [], [], []
    for part in _partitions(list(range(N))):
        masks = [sum(1 << i for i in blk) for blk in part]
        logs.append(log_alpha_term[len(part)] + sum(block[m] for m in masks))
        Ks.append(len(part))
        parts.append(part)
    p = np.exp(np.array(logs) - logsumexp(logs))
    Ks = np.array(Ks)
    pk = np.array([p[Ks == k].sum() for k in range(1, N + 1)])
    co = []
    for i, j in PAIRS:
        together = [any(i in b_ and j in b_ for b_ in part) for part in parts]
        co.append(float(p[np.array(together)].sum()))
    return len(parts), pk, np.array(co)


class _NoCounts(JointDPMSampler):
    """Negative control: the Gibbs conditional without the n_k⁻ⁱ count."""

    def z_log_weights(self, table, xd, f, y, w_aux):
        labels, lw = super().z_log_weights(table, xd, f, y, w_aux)
        return labels, lw - np.log(table.n)


def _chain_estimates(cls, chains=4, iters=2500, burn=200, seed=0, step_z=8, split_merge=0):
    alg = fd.JointDPM(step_z=step_z, init_clusters=2, split_merge=split_merge)
    s = _sampler(alg, chains=chains, seed=seed, cls=cls, tracked_rows=np.arange(8))
    K = np.zeros((chains, iters))
    co = np.zeros((chains, iters, len(PAIRS)))
    for it in range(burn + iters):
        s.step()
        if it < burn:
            continue
        for c, st in enumerate(s.states):
            K[c, it - burn] = len(st.stats)
            co[c, it - burn] = [st.tracked[i] == st.tracked[j] for i, j in PAIRS]
    return K, co


def _floored_mcse(ind: np.ndarray) -> float:
    """An indicator's MCSE, at least 1e-3: also where it never changed (MCSE NaN)."""
    m = float(mcse_mean(ind))
    return m if m > 1e-3 else 1e-3


def _z_scores(K, co, pk, pco):
    out = []
    for k in range(1, 5):
        ind = (K == k).astype(float)
        out.append((ind.mean() - pk[k - 1]) / _floored_mcse(ind))
    for p in range(co.shape[-1]):
        ind = co[..., p].astype(float)
        out.append((ind.mean() - pco[p]) / _floored_mcse(ind))
    return np.array(out)


@pytest.mark.slow
def test_partition_posterior_matches_enumeration():
    """N = 8, D = 1: every one of the Bell(8) = 4,140 partitions enumerated, so P(K) and
    the co-clustering of four row pairs are exact; four eps = 0 chains agree within
    their MCSE (|z| < 3.5 over 8 quantities). Negative control: the same chains without
    the n_k⁻ⁱ count in the Gibbs conditional fail the same test by far (|z| > 6), already
    at a fifth of the length (measured at 500 draws, seeds 1–4: K = 1 never visited, and
    |z| ≥ 20 for P(K = 2) and every co-clustering; a bias's z-score grows as √length)."""
    n_parts, pk, pco = _exact_posterior(X8, Y8, NIWPrior.paper(1))
    assert n_parts == 4140
    assert 0.05 < pk[0] < 0.9 and pk[1] > 0.05 and pk[2] > 0.02  # an informative posterior
    K, co = _chain_estimates(JointDPMSampler)
    z = _z_scores(K, co, pk, pco)
    assert np.all(np.abs(z) < 3.5), (z, pk[:4], pco)
    K2, co2 = _chain_estimates(_NoCounts, iters=500, seed=1)
    z2 = _z_scores(K2, co2, pk, pco)
    assert np.max(np.abs(z2)) > 6, z2


@pytest.mark.slow
def test_split_merge_keeps_the_partition_posterior(monkeypatch):
    """The same enumeration with one split–merge proposal beside each single-row Gibbs
    move (``step_z=1``, so that the split–merge moves carry much of the chain): four
    chains agree with the exact P(K) and co-clustering within their MCSE, and more than
    a third of the proposals are accepted. Negative control: the same move without the
    allocation's probability in its ratio fails the same test by far (measured at 500
    draws, seed 1: P(K = 1) 0.85 against 0.22, |z| > 75). (Leaving out the cluster
    choice's probabilities instead gave max |z| 5.8 at 2,500 draws: this test sees it
    too, if by less.)"""
    import flymc_dist.jointdpm.sampler as sampler_mod

    _, pk, pco = _exact_posterior(X8, Y8, NIWPrior.paper(1))
    n_moves = {"tried": 0, "accepted": 0}
    real = JointDPMSampler.split_merge

    def counted(self, c, st):
        n_moves["tried"] += 1
        ok = real(self, c, st)
        n_moves["accepted"] += ok
        return ok

    monkeypatch.setattr(JointDPMSampler, "split_merge", counted)
    K, co = _chain_estimates(JointDPMSampler, iters=2000, step_z=1, split_merge=1)
    z = _z_scores(K, co, pk, pco)
    assert np.all(np.abs(z) < 3.5), (z, pk[:4], pco)
    assert n_moves["accepted"] > n_moves["tried"] / 3, n_moves
    real_allocate = sampler_mod.allocate
    monkeypatch.setattr(sampler_mod, "allocate", lambda *a: real_allocate(*a) * 0.0)
    K2, co2 = _chain_estimates(JointDPMSampler, iters=500, seed=1, step_z=1, split_merge=1)
    z2 = _z_scores(K2, co2, pk, pco)
    assert np.max(np.abs(z2)) > 6, z2


def test_bench_jointdpm_is_wired(tmp_path, capsys, monkeypatch):
    """`flymc bench jointdpm` on a tiny problem: both runs, the table, JSON and the plot;
    ``--split-merge`` reaches the runs."""
    from flymc_dist.cli import main

    out_json = tmp_path / "f.json"
    plot = tmp_path / "f.png"
    code = main(
        [
            "bench",
            "jointdpm",
            "--rows",
            "300",
            "--test-rows",
            "60",
            "--iterations",
            "4",
            "--step-z",
            "10",
            "--init-clusters",
            "2",
            "--split-merge",
            "2",
            "--plot",
            str(plot),
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "final acc" in out and "eps>0 reaches" in out and "split_merge=2" in out
    assert out_json.exists() and plot.exists()
    fig6 = json.loads(out_json.read_text())["fig6"]
    assert fig6["split_merge"] == 2
    assert sum(r["split_merged_per_iteration"] for r in fig6["runs"]) > 0
    # --plot '' draws none (a text option's empty value is None)
    monkeypatch.chdir(tmp_path)
    plot.unlink()
    args = ["bench", "jointdpm", "--rows", "300", "--test-rows", "60", "--iterations", "4"]
    assert main([*args, "--step-z", "5", "--plot", ""]) == 0
    assert "plot:" not in capsys.readouterr().out and not list(tmp_path.glob("*.png"))


@pytest.mark.slow
@pytest.mark.cluster
def test_bench_jointdpm_tall_reads_a_few_members_per_decision(tmp_path, capsys):
    """`flymc bench jointdpm --parts tall` on 2 workers: one run per size; austerity reads
    far fewer members per weight decision than the clusters hold at the larger size."""
    import json

    from flymc_dist.cli import main

    code = main(
        ["bench", "jointdpm", "--parts", "tall", "--tall-rows", "2000", "20000"]
        + ["--tall-iterations", "4", "--step-z", "10", "--init-clusters", "2"]
        + ["--json", str(tmp_path / "t.json")]
    )
    assert code == 0 and "log-log slope" in capsys.readouterr().out
    runs = json.loads((tmp_path / "t.json").read_text())["tall"]["runs"]
    assert [r["rows"] for r in runs] == [2000, 20000]
    big = runs[1]
    assert big["rows_per_decision"] < big["mean_cluster_size"] / 5, big
    # exact MH beside it reads every member of every cluster
    for r in runs:
        assert r["exact_rows_per_decision"] == pytest.approx(r["mean_cluster_size"], rel=0.05)
        assert r["speedup"] > 0
