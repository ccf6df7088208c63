"""Out-of-core shards: rows left in the store, read a chunk at a time.

Their exactness (every kernel, both z-updates, regular MCMC; and a negative control) is
in ``test_exactness.py``; a worker SIGKILLed in out-of-core mode in ``test_cluster.py``;
a store on S3 in ``test_remote.py``. Here: the pieces, the options, placement
independence, resume, and a cluster whose workers' memory is below their shards' size.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from scipy.special import expit

import flymc_dist as fd
from flymc_dist.data import make_logistic
from flymc_dist.driver import Driver
from flymc_dist.protocol import ShardConfig, ShardSpec
from flymc_dist.shard import Shard
from flymc_dist.shard.chunks import Chunk, ChunkSource, RowStore


def _data(n: int, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.c_[np.ones(n), rng.normal(size=(n, 2))]
    y = (rng.random(n) < expit(X @ np.array([0.3, -1.2, 0.8]))).astype(np.int64)
    return X, y


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    X, y = _data(900)
    path = tmp_path_factory.mktemp("ooc") / "d.zarr"
    return fd.from_numpy(X, y, path, chunk_rows=64), X, y


def _run(data, client="synchronous", **kw):
    opts = dict(
        kernel="rwmh",
        num_warmup=100,
        num_samples=150,
        chains=2,
        seed=8,
        n_shards=3,
        progress=False,
        out_of_core=True,
        chunk_iterations=4,
    )
    opts.update(kw)
    return fd.sample(fd.LogisticRegression(prior_scale=3.0), data, client=client, **opts)


# ------------------------------------------------------------------ the pieces
def test_chunk_source_reads_the_shard_chunk_by_chunk(store):
    ds, X, y = store
    src = ChunkSource(ds, 100, 400, lambda X_, y_: (y_ * 2.0, X_))
    # the shard [100, 400) cut at the store's 64-row chunk edges, in shard-local rows
    assert src.ranges == [(0, 28), (28, 92), (92, 156), (156, 220), (220, 284), (284, 300)]
    got = list(src.stream())
    assert [(c.lo, c.hi) for c in got] == src.ranges
    np.testing.assert_array_equal(np.concatenate([c.X for c in got]), X[100:400])
    np.testing.assert_array_equal(np.concatenate([c.y for c in got]), y[100:400])
    np.testing.assert_array_equal(got[2].xi, 2.0 * y[192:256])  # computed with the read
    # a read ahead of another chunk is dropped, not returned in its place
    src.get(1, then=3)
    assert src.get(4).lo == 220
    assert src.get(3, then=0).lo == 156
    assert src.get(0).lo == 0


def test_row_store_gathers_held_rows_and_the_window(store):
    _, X, y = store
    rows = RowStore(3)
    rows.set(np.array([3, 9]), X[[3, 9]], y[[3, 9]].astype(float), np.array([0.3, 0.9]))
    win = Chunk(64, 128, X[64:128], y[64:128], np.arange(64.0), X[64:128])
    Xg, yg, xg = rows.gather(np.array([9, 70, 3]), win)
    np.testing.assert_array_equal(Xg, X[[9, 70, 3]])
    np.testing.assert_array_equal(yg, y[[9, 70, 3]])
    np.testing.assert_array_equal(xg, [0.9, 6.0, 0.3])
    rows.keep(np.array([9, 70]), win)  # 3 dropped, 70 taken from the window
    np.testing.assert_array_equal(rows.ids, [9, 70])
    np.testing.assert_array_equal(rows.X, X[[9, 70]])
    with pytest.raises(RuntimeError, match="neither held nor in the current chunk"):
        rows.gather(np.array([5]), win)
    with pytest.raises(RuntimeError, match="neither held nor in the current chunk"):
        rows.gather(np.array([70, 200]), None)


def _locate(ids: np.ndarray, rows: np.ndarray, window: Chunk) -> tuple[int, np.ndarray]:
    """Where all of ``rows`` are, by numpy: ``(0, positions in ids)`` when all are held,
    else ``(1, offsets in the window)``, where they must all lie."""
    pos = np.searchsorted(ids, rows)
    if np.all(ids[np.minimum(pos, ids.size - 1)] == rows):
        return 0, pos
    if np.any((rows < window.lo) | (rows >= window.hi)):
        raise RuntimeError("rows neither held nor in the current chunk")
    return 1, rows - window.lo


def test_compiled_locate_agrees_with_numpy():
    """The shards' compiled lookup of scattered rows (held or in the window) gives, one
    segment at a time, what a numpy lookup gives, and refuses rows that are neither."""
    from flymc_dist._compiled import locate_segments

    rng = np.random.default_rng(3)
    store = RowStore(2)
    held_in_win = np.array([510, 520, 530])
    ids = np.union1d(rng.choice(np.arange(600, 1000), 37, replace=False), held_in_win)
    store.set(ids, rng.normal(size=(ids.size, 2)), np.zeros(ids.size), np.zeros(ids.size))
    win = Chunk(500, 600, None, np.zeros(100), np.zeros(100), np.zeros((100, 2)))
    in_win = np.setdiff1d(np.arange(500, 600), ids)
    segments = [
        rng.choice(ids, 7),  # all held
        rng.choice(in_win, 5),  # all in the window (none held)
        np.concatenate([held_in_win, rng.choice(in_win, 2)]),  # mixed, all in the window
        np.empty(0, dtype=np.int64),
    ]
    rows = np.concatenate(segments).astype(np.int64)
    seg = np.cumsum([0] + [s.size for s in segments]).astype(np.int64)
    local, src = np.empty_like(rows), np.empty(len(segments), dtype=np.int64)
    assert locate_segments(store.ids, rows, seg, win.lo, win.hi, local, src)
    for i, part in enumerate(segments):
        where, pos = _locate(store.ids, part, win) if part.size else (0, part)
        assert src[i] == where
        np.testing.assert_array_equal(local[seg[i] : seg[i + 1]], pos)
    assert list(src[:3]) == [0, 1, 1]  # each kind occurred
    outside = np.array([ids[0], 450], dtype=np.int64)  # one held, one nowhere
    two = np.array([0, 2], dtype=np.int64)
    ok = locate_segments(store.ids, outside, two, win.lo, win.hi, np.empty(2, np.int64), src)
    assert not ok


def test_a_shard_holds_only_its_bright_rows(store):
    ds, _, _ = store
    config = ShardConfig(
        model=fd.LogisticRegression(prior_scale=3.0),
        algorithm="flymc",
        chains=3,
        seed=1,
        n_rows=ds.n_rows,
        q_db=0.05,
        out_of_core=True,
        chunk_iterations=2,
    )
    sh = Shard(ShardSpec(0, ds.path, 0, 900), config)
    assert sh.out_of_core and not hasattr(sh.rows, "X")  # no rows array
    sh.set_tight_points(np.array([0.3, -1.2, 0.8]))
    sh.set_positions(np.tile([0.3, -1.2, 0.8], (3, 1)))
    for _ in range(30):
        sh._update_z_all()
        bright = np.unique(np.concatenate([ch.bright.idx for ch in sh.chains]))
        np.testing.assert_array_equal(sh.rows.held.ids, bright)  # exactly the bright rows
        assert sh.rows.window is not None and sh.rows.window.hi - sh.rows.window.lo <= 64
        for ch in sh.chains:  # the masks and the bright sets agree
            assert set(np.flatnonzero(ch.bright.mask)) == set(ch.bright.idx)
    state = sh.state()
    assert state["out_of_core"] and state["held_rows"] == bright.size
    assert state["chunk_iterations"] == 2 and state["bytes_read"] > 0


def test_auto_follows_the_budget(store):
    ds, _, _ = store
    model = fd.LogisticRegression()
    spec = ShardSpec(0, ds.path, 0, 900)
    config = ShardConfig(model=model, algorithm="flymc", chains=2, seed=0, n_rows=ds.n_rows)
    assert not Shard(spec, config).out_of_core  # "auto", no budget (in-process): in memory
    assert Shard(spec, config, budget=1000).out_of_core
    assert not Shard(spec, config, budget=10**9).out_of_core
    forced = dataclasses.replace(config, out_of_core=False)
    assert not Shard(spec, forced, budget=1000).out_of_core
    aus = dataclasses.replace(config, algorithm="austerity", chains=1)
    assert Shard(spec, aus, budget=1000).out_of_core  # austerity follows it too


def test_shard_rows_at_reads_the_same_values_out_of_core(store):
    """The add-on samplers' view of the rows: a gather in memory, a read of the touched
    store chunks out of core (counted whole), the same values in the order asked."""
    ds, X, y = store
    model = fd.LogisticRegression()
    spec = ShardSpec(0, ds.path, 100, 400)
    config = ShardConfig(model=model, algorithm="austerity", chains=1, seed=0, n_rows=ds.n_rows)
    inmem = Shard(spec, config)
    ooc = Shard(spec, dataclasses.replace(config, out_of_core=True))
    rows = np.array([250, 3, 77, 29, 28, 299, 0])
    for theta_hat in (None, np.array([0.2, -1.0, 0.5])):
        if theta_hat is not None:
            inmem.set_tight_points(theta_hat)
            ooc.set_tight_points(theta_hat)
        before = ooc.state()["bytes_read"]
        Xa, ya, ta = inmem.rows_at(rows)
        Xb, yb, tb = ooc.rows_at(rows)
        np.testing.assert_array_equal(Xa, X[100 + rows])
        np.testing.assert_array_equal(Xb, Xa)
        np.testing.assert_array_equal(yb, ya)
        if theta_hat is None:
            assert ta is None and tb is None  # austerity sets no tight points of its own
        else:
            np.testing.assert_allclose(tb, ta, rtol=1e-12)
        # the shard's chunks (local rows) 0:28, 28:92, 220:284 and 284:300, touched, are
        # decoded whole: 28 + 64 + 64 + 16 rows of 3 features and a target, as float64
        assert ooc.state()["bytes_read"] - before == (28 + 64 + 64 + 16) * 4 * 8
    assert inmem.state()["bytes_read"] == 0
    blocks = list(ooc.blocks())
    np.testing.assert_array_equal(np.concatenate([b[0] for b in blocks]), X[100:400])
    ((Xm, ym, _),) = list(inmem.blocks())
    assert not Xm.flags.writeable and not ym.flags.writeable


@pytest.mark.parametrize("control_variates", [False, True])
def test_austerity_out_of_core_takes_the_same_decisions(store, control_variates):
    """Austerity's minibatches read through the store out of core: the same rows, the
    same values, so the same decisions and draws as in memory: bit for bit from a given
    start; with control variates, to rounding (the MAP's full passes sum chunk by chunk
    out of core, and the tight points come from GEMMs of other shapes)."""
    kw = dict(algorithm="austerity", chunk_iterations="auto", control_variates=control_variates)
    kw.update(batch_size=40, num_warmup=10, num_samples=30)
    if not control_variates:  # no MAP (whose full passes sum in another order out of core)
        kw.update(init=np.array([0.3, -1.2, 0.8]), precondition=np.diag([0.01, 0.02, 0.02]))
    ooc = _run(store[0], **kw)
    inmem = _run(store[0], **{**kw, "out_of_core": False})
    assert ooc.info["out_of_core"] == [True] * 3 and inmem.info["out_of_core"] == [False] * 3
    assert ooc.info["bytes_read"] > 0 and inmem.info["bytes_read"] == 0
    if control_variates:
        np.testing.assert_allclose(ooc.samples, inmem.samples, rtol=1e-9, atol=1e-12)
    else:
        np.testing.assert_array_equal(ooc.samples, inmem.samples)
    np.testing.assert_array_equal(ooc.stats["data_used"], inmem.stats["data_used"])
    np.testing.assert_array_equal(ooc.stats["accepted"], inmem.stats["accepted"])


# ------------------------------------------------------------------ the API
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(out_of_core="yes"), "out_of_core must be 'auto', True or False"),
        (dict(memory_budget=-1), "memory_budget must be None or a positive number"),
        (dict(chunk_iterations=0), "chunk_iterations must be 'auto' or an integer >= 1"),
    ],
)
def test_bad_options_are_one_clear_line(store, kw, match):
    with pytest.raises(ValueError, match=match) as info:
        _run(store[0], **kw)
    assert "\n" not in str(info.value)


def test_auto_chunk_iterations_follow_the_kernel():
    """Under "auto", a new window chunk every iteration for gradient kernels (the sweep over z
    limits their mixing), the shard's byte rule (None) for RWMH and slice."""
    from flymc_dist.api import _chunk_iterations
    from flymc_dist.kernels import get_kernel

    for name in ("nuts", "hmc", "mala"):
        assert _chunk_iterations("auto", get_kernel(name)) == 1
    for name in ("rwmh", "slice"):
        assert _chunk_iterations("auto", get_kernel(name)) is None
    assert _chunk_iterations(7, get_kernel("nuts")) == 7


def test_in_memory_data_cannot_be_forced_out_of_core(store):
    _, X, y = store
    with pytest.raises(ValueError, match="needs a data set in a store"):
        _run((X, y))


def test_info_reports_each_shard(store):
    res = _run(store[0], num_warmup=5, num_samples=5)
    assert res.info["out_of_core"] == [True] * 3
    assert res.info["chunk_iterations"] == [4] * 3
    assert res.info["memory_budget"] == [None] * 3
    inmem = _run(store[0], num_warmup=5, num_samples=5, out_of_core="auto")
    assert inmem.info["out_of_core"] == [False] * 3  # in-process: no budget
    auto = _run(store[0], num_warmup=5, num_samples=5, out_of_core="auto", memory_budget=1000)
    assert auto.info["out_of_core"] == [True] * 3 and auto.info["memory_budget"] == [1000] * 3
    default = _run(store[0], num_warmup=5, num_samples=5, chunk_iterations="auto")
    assert default.info["chunk_iterations"] == [1] * 3  # 64-row chunks: 2 KiB each


def test_resume_matches_an_uninterrupted_run(store, tmp_path, monkeypatch):
    """Interrupted at step 120 and resumed: the draws kept before the interruption are
    the uninterrupted run's; the run completes with its shards still out of core."""
    full = _run(store[0], trace=str(tmp_path / "a.zarr"))
    real_step, calls = Driver.step, {"n": 0}

    def flaky_step(self, adapters=None):
        calls["n"] += 1
        if calls["n"] == 120:
            raise KeyboardInterrupt
        return real_step(self, adapters)

    monkeypatch.setattr(Driver, "step", flaky_step)
    trace = str(tmp_path / "b.zarr")
    with pytest.raises(KeyboardInterrupt):
        _run(store[0], trace=trace, checkpoint_every=10)
    monkeypatch.setattr(Driver, "step", real_step)
    res = _run(store[0], trace=trace, checkpoint_every=10, resume=True)
    assert res.info["out_of_core"] == [True] * 3
    assert res.samples.shape == full.samples.shape
    np.testing.assert_array_equal(res.warmup_samples, full.warmup_samples)
    np.testing.assert_array_equal(res.samples[:, :10], full.samples[:, :10])
    with pytest.raises(ValueError, match="out_of_core"):  # a resume must keep the mode
        _run(store[0], trace=trace, resume=True, out_of_core=False)


@pytest.mark.cluster
def test_deterministic_across_placements(store):
    """Out of core, the same seed gives the same draws in-process and on 2 workers."""
    from distributed import Client, LocalCluster

    sync = _run(store[0], kernel="nuts")
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster, direct_to_workers=True) as client,
    ):
        two = _run(store[0], client, kernel="nuts")
    assert two.info["n_workers"] == 2 and two.info["out_of_core"] == [True] * 3
    assert two.info["bright_replica"]
    np.testing.assert_array_equal(sync.samples, two.samples)
    for k in ("n_bright", "likelihood_queries", "accepted"):
        np.testing.assert_array_equal(sync.stats[k], two.stats[k])


def _reset_peak_rss() -> None:
    """Start this process's peak RSS (VmHWM) afresh (Linux): a worker forked from a large
    parent would otherwise report the parent's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int:
    """This process's peak resident set size since the last reset, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_workers_with_less_memory_than_their_shards(tmp_path):
    """Two workers limited to 400 MB, each holding a shard that would take 440 MB in
    memory, everything else at its default: "auto" leaves the rows in the store, the
    run completes, no worker is restarted, and each worker's peak RSS (measured in the
    worker) stays under its limit."""
    from distributed import Client, LocalCluster

    limit = 400 * 10**6
    ds = make_logistic(tmp_path / "big.zarr", 11_000_000, 5, seed=2)
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            memory_limit=limit,
            dashboard_address=":0",
        ) as cluster,
        Client(cluster, direct_to_workers=True) as client,
    ):
        pids = client.run(os.getpid)
        client.run(_reset_peak_rss)
        res = fd.sample(
            fd.LogisticRegression(),
            ds,
            client=client,
            num_warmup=50,
            num_samples=100,
            chains=2,
            seed=1,
            progress=False,
        )  # defaults: one shard per worker, Dask's memory thresholds as they are
        peak = client.run(_peak_rss)
        assert client.run(os.getpid) == pids  # no worker was restarted
    # each shard: 5.5M rows of 5 features (+ 3 row constants, target, tight point) in float64
    shard_bytes = 5_500_000 * (5 + 3 + 2) * 8
    assert shard_bytes > limit
    assert res.info["out_of_core"] == [True, True]
    assert res.info["memory_budget"] == [limit // 2] * 2
    assert res.samples.shape == (2, 100, 5) and np.all(np.isfinite(res.samples))
    assert all(p < limit for p in peak.values()), peak


@pytest.mark.parametrize("case", ["gaps", "flipped"])
def test_windowed_z_update_leaves_the_conditional_invariant(tmp_path, monkeypatch, case):
    """Out of core, the compiled z-update on a moving window (two chunks, each the window
    for one iteration in turn) keeps each z_n's bright frequency at sigmoid(log L~_n(θ))
    at fixed θ, within the exact sd of the time average of a two-state chain. "flipped"
    (negative control): Algorithm 2's printed dark→bright comparison must fail the check."""
    from scipy import stats

    import flymc_dist.shard.fused as fused_mod
    from flymc_dist._numerics import log_expm1

    if case == "flipped":
        monkeypatch.setattr(fused_mod, "brighten", lambda log_u, v, q: log_u > v - np.log(q))
    n, q, sweeps = 96, 0.2, 4000
    x = np.random.default_rng(3).permutation(np.linspace(-2.5, 2.5, n))
    X, y = np.column_stack([np.ones(n), x]), (np.arange(n) % 2).astype(float)
    path = str(tmp_path / "z.zarr")
    fd.from_numpy(X, y, path, chunk_rows=n // 2)
    model = fd.LogisticRegression()
    config = ShardConfig(
        model=model, algorithm="flymc", chains=2, seed=5, n_rows=n, q_db=q,
        out_of_core=True, chunk_iterations=1,
    )  # fmt: skip
    shard = Shard(ShardSpec(0, path, 0, n), config)
    theta_hat, thetas = np.array([0.0, 0.5]), np.array([[0.5, 1.5], [-1.0, 2.5]])
    shard.set_tight_points(theta_hat)
    shard.set_positions(thetas)
    assert shard.out_of_core and shard.fused_z
    freq = np.zeros((2, n))
    with np.errstate(over="ignore", divide="ignore"):
        for _ in range(20):
            shard._update_z_all()
        for _ in range(sweeps):
            shard._update_z_all()
            freq += shard._masks
    freq /= sweeps
    xi = model.tuned_xi(model.linear_predictor(theta_hat[None], X)[0], y)
    eta = model.linear_predictor(thetas, X)
    with np.errstate(over="ignore", divide="ignore"):
        lt = np.exp(log_expm1(model.loglik(eta, y) - model.logbound(eta, y, xi)))
    p = lt / (1.0 + lt)
    use = p > 1e-4
    q_w, updates = 2 * q, sweeps / 2  # the window is half the rows, each its turn
    lt_u, p_u = lt[use], p[use]
    rho = 1.0 - np.minimum(q_w, lt_u) - np.minimum(1.0, q_w / lt_u)
    z = (freq[use] - p_u) / np.sqrt(p_u * (1 - p_u) / updates * (1 + rho) / (1 - rho))
    m = int(use.sum())
    assert m >= 60
    crit = stats.norm.ppf(1 - 0.001 / (2 * m))
    if case == "flipped":
        assert np.max(np.abs(z)) > 2 * crit
        assert stats.chi2.sf(np.sum(z**2), m) < 1e-6
        return
    assert np.max(np.abs(z)) < crit, np.round(z, 2)
    assert stats.chi2.sf(np.sum(z**2), m) > 1e-4
    assert np.all(freq[p == 0.0] == 0.0)
