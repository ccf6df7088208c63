"""Draws keyed by row: the layout never changes the draws, for every algorithm.

Every random number of a z-update is keyed by its global row (:mod:`flymc_dist.streams`),
full passes and every round's sums (regular MCMC's full-data sums, FlyMC's shard-evaluated
bright sums) are taken by fixed blocks along one fixed tree (:mod:`flymc_dist.reduce`),
and austerity draws each decision's rows from a keyed permutation of all N rows on the
driver (:func:`flymc_dist.streams.permuted_rows`), so any partition of the rows into
shards, in-process or on any number of workers, gives bit-identical draws — FlyMC with
every θ-kernel, both z-updates, in replica and shard-evaluated mode; regular MCMC with
every kernel; austerity with and without control variates. (The reference draws of
``tests/test_reference_draws.py`` were re-recorded for these streams and sums.)
"""

from __future__ import annotations

import numpy as np
import pytest

import flymc_dist as fd


def _data(n: int = 3000, d: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.column_stack([np.ones(n), rng.standard_normal((n, d - 1))])
    theta = rng.standard_normal(d)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-X @ theta))).astype(float)
    return X, y


def _run(
    data, kernel: str, z_update: str, client, bounds: str = "map", n_shards: int | None = None
) -> fd.Result:
    """FlyMC with ``z_update`` and ``bounds`` on ``n_shards`` shards (None: the default
    layout, one shard per worker); short: the point is the bits, not the posterior."""
    return fd.sample(
        fd.LogisticRegression(),
        data,
        fd.FlyMC(z_update=z_update, bounds=bounds),
        kernel,
        num_warmup=30,
        num_samples=20,
        chains=2,
        seed=5,
        client=client,
        placement=fd.Placement(n_shards=n_shards),
        progress=False,
    )


def _same(a: fd.Result, b: fd.Result) -> None:
    assert np.array_equal(a.samples, b.samples)
    for key in ("accepted", "n_bright", "likelihood_queries", "log_joint"):
        assert np.array_equal(a.stats[key], b.stats[key], equal_nan=True), key


#: short trajectories: the point is the bits, not the posterior
_SHORT = {"nuts": fd.NUTS(max_tree_depth=4), "hmc": fd.HMC(max_steps=8)}


def _sample(data, algorithm, kernel: str | None, client, n_shards: int | None = None):
    """A short run of any algorithm (tiny: the point is the bits, not the posterior)."""
    return fd.sample(
        fd.LogisticRegression(),
        data,
        algorithm=algorithm,
        kernel=_SHORT.get(kernel, kernel),
        num_warmup=20,
        num_samples=15,
        chains=2,
        seed=3,
        client=client,
        placement=fd.Placement(n_shards=n_shards),
        progress=False,
    )


def _across_layouts(data, algorithm, kernel: str | None) -> fd.Result:
    """n_shards in {1, 2, 3, 4} in-process give the same draws; returns the first."""
    ref = _sample(data, algorithm, kernel, "synchronous", 1)
    for k in (2, 3, 4):
        res = _sample(data, algorithm, kernel, "synchronous", k)
        assert res.info["n_shards"] == k
        _same(ref, res)
    return ref


_KERNELS = ["nuts", "hmc", "mala", "rwmh", "slice"]


@pytest.mark.parametrize("z_update", ["implicit", "explicit"])
@pytest.mark.parametrize(  # NUTS and HMC, the longest here, in the full suite only
    "kernel",
    [pytest.param(k, marks=pytest.mark.slow) if k in ("nuts", "hmc") else k for k in _KERNELS],
)
def test_shard_evaluated_flymc_identical_for_every_partition(kernel, z_update):
    """FlyMC with the shards evaluating every point (``bright_replica=False``): the bright
    sums are taken per block and added along the fixed tree, whatever the layout."""
    if z_update == "explicit" and kernel not in ("nuts", "rwmh"):
        pytest.skip("explicit updates: one gradient and one gradient-free kernel suffice")
    ref = _across_layouts(_data(n=640), fd.FlyMC(bright_replica=False, z_update=z_update), kernel)
    assert not ref.info["bright_replica"]


@pytest.mark.parametrize("kernel", ["hmc", "mala"])
def test_replica_flymc_identical_for_every_partition(kernel):
    """The replica mode with the kernels the test above leaves out."""
    ref = _across_layouts(_data(n=640), fd.FlyMC(), kernel)
    assert ref.info["bright_replica"]


@pytest.mark.parametrize(  # HMC (NUTS's gradients stay quick) with the slow tests
    "kernel", [pytest.param(k, marks=pytest.mark.slow) if k == "hmc" else k for k in _KERNELS]
)
def test_regular_identical_for_every_partition(kernel):
    """Regular MCMC: full-data sums (and gradients) per block along the fixed tree."""
    _across_layouts(_data(n=640), fd.Regular(), kernel)


@pytest.mark.parametrize("control_variates", [pytest.param(False, marks=pytest.mark.slow), True])
def test_austerity_identical_for_every_partition(control_variates):
    """Austerity: each decision's rows from a keyed permutation of all N rows, the round's
    statistics summed in draw order. The decisions stop early (a real minibatch test)."""
    data = _data(n=6000)
    algo = fd.Austerity(eps=0.05, batch_size=100, control_variates=control_variates)
    ref = _across_layouts(data, algo, None)
    used = ref.stats["data_used"]
    assert used.min() < 6000 and used.mean() < 0.8 * 6000


def test_layout_dependence_of_sums_is_visible(monkeypatch):
    """Negative control: add the shards' nodes shard by shard (the first design's sums)
    and regular NUTS's draws change with the layout in the last bits."""
    import flymc_dist.driver as driver_mod
    from flymc_dist.protocol import COUNT_FIELDS, SUM_FIELDS, Reply

    def by_shard(replies):
        first = replies[0]
        out = list(first)
        for i in SUM_FIELDS:
            if first[i] is not None:
                out[i] = sum(r[i].sum(axis=0) for r in replies)[None]
        for i in COUNT_FIELDS:
            out[i] = sum(r[i] for r in replies)
        n_blocks = int(first.tree[0, 2])
        out[Reply._fields.index("tree")] = np.array([[(n_blocks - 1).bit_length(), 0, n_blocks]])
        return Reply._make(out)

    monkeypatch.setattr(driver_mod, "partial_sum", by_shard)
    data = _data(n=640)
    a = _sample(data, fd.Regular(), "nuts", "synchronous", 1)
    b = _sample(data, fd.Regular(), "nuts", "synchronous", 3)
    assert not np.array_equal(a.samples, b.samples)


def test_layout_dependence_of_austerity_rows_is_visible(monkeypatch):
    """Negative control: let each shard pick rows of its own (its first rows, as many as
    the draw gave it) and austerity's draws change with the layout."""
    import flymc_dist.austerity.sampler as aus

    real = aus.SequentialTester._route

    def by_shard(self, drawn):
        out = real(self, drawn)
        return {
            j: (sl, np.concatenate([np.arange(k) for k in np.diff(seg)]), seg, at)
            for j, (sl, _, seg, at) in out.items()
        }

    monkeypatch.setattr(aus.SequentialTester, "_route", by_shard)
    data = _data(n=6000)
    algo = fd.Austerity(eps=0.05, batch_size=100, control_variates=False)
    a = _sample(data, algo, None, "synchronous", 1)
    b = _sample(data, algo, None, "synchronous", 3)
    assert not np.array_equal(a.stats["data_used"], b.stats["data_used"])


@pytest.mark.parametrize("z_update", ["implicit", "explicit"])
@pytest.mark.parametrize("kernel", ["nuts", "rwmh", "slice"])
def test_draws_identical_for_every_partition(kernel, z_update):
    """n_shards in {1, 2, 3, 7} in-process: the same draws and statistics, bit for bit."""
    data = _data()
    ref = _run(data, kernel, z_update, "synchronous", n_shards=1)
    assert ref.info["bright_replica"]  # the default for every kernel where it fits
    for k in (2, 3, 7):
        res = _run(data, kernel, z_update, "synchronous", n_shards=k)
        assert res.info["n_shards"] == k
        _same(ref, res)


def test_untuned_bounds_identical_for_every_partition():
    """Untuned bounds (most rows bright, every z-update touching many rows) too."""
    data = _data(n=640)
    ref = _run(data, "rwmh", "implicit", "synchronous", bounds="untuned", n_shards=1)
    _same(ref, _run(data, "rwmh", "implicit", "synchronous", bounds="untuned", n_shards=3))


def test_layout_dependence_is_visible_without_row_keys(monkeypatch):
    """Negative control: key the z streams by shard (the first design: every shard its own
    step counter and row numbers from its own start) and the draws change with the layout."""
    import flymc_dist.shard.state as shard_mod

    real = shard_mod.RowStreams

    def by_shard(seed, generation, chain, step, offset, n_total, init=False):
        return real(seed, generation, chain, step, 0, n_total, init)  # local row numbers

    monkeypatch.setattr(shard_mod, "RowStreams", by_shard)
    data = _data()
    a = _run(data, "rwmh", "explicit", "synchronous", n_shards=1)
    b = _run(data, "rwmh", "explicit", "synchronous", n_shards=3)
    assert not np.array_equal(a.samples, b.samples)


@pytest.mark.cluster
@pytest.mark.parametrize(  # NUTS on workers stays quick in test_cluster.py's replica test
    "kernel", [pytest.param("nuts", marks=pytest.mark.slow), "rwmh"]
)
def test_draws_identical_in_process_and_on_workers(tmp_path, kernel, local_clusters):
    """A store: in-process with 1 and 5 shards, on a 1- and a 2-worker LocalCluster with
    the default layout (one shard per worker) and with 5 shards — the same draws."""
    from distributed import Client

    X, y = _data(n=4000)
    ds = fd.from_numpy(X, y, str(tmp_path / "d.zarr"), chunk_rows=250)
    ref = _run(ds, kernel, "implicit", "synchronous")
    assert ref.info["n_shards"] == 1
    _same(ref, _run(ds, kernel, "implicit", "synchronous", n_shards=5))
    for workers in (1, 2):
        with Client(local_clusters.get(workers)) as client:
            res = _run(ds, kernel, "implicit", client)
            assert res.info["n_shards"] == workers  # the layout follows the cluster
            _same(ref, res)
            _same(ref, _run(ds, kernel, "implicit", client, n_shards=5))


@pytest.mark.cluster
@pytest.mark.parametrize(
    "algorithm, kernel",
    [
        (fd.Regular(), "nuts"),
        # quick on workers in test_relay.py's 2-worker test
        pytest.param(fd.FlyMC(bright_replica=False), "nuts", marks=pytest.mark.slow),
        (fd.Austerity(eps=0.05, batch_size=100), None),
    ],
    ids=["regular", "flymc-shard-evaluated", "austerity"],
)
def test_every_algorithm_identical_in_process_and_on_workers(
    tmp_path, algorithm, kernel, local_clusters
):
    """A store of 250-row chunks: in-process with 1 and 3 shards, and on a 2-worker
    LocalCluster with 2 shards — the same draws for regular MCMC, FlyMC with the shards
    evaluating and austerity."""
    from distributed import Client

    X, y = _data(n=3000)
    ds = fd.from_numpy(X, y, str(tmp_path / "d.zarr"), chunk_rows=250)
    ref = _sample(ds, algorithm, kernel, "synchronous", 1)
    _same(ref, _sample(ds, algorithm, kernel, "synchronous", 3))
    with Client(local_clusters.get(2)) as client:
        res = _sample(ds, algorithm, kernel, client, 2)
        assert res.info["n_shards"] == 2 and res.info["n_workers"] == 2
        _same(ref, res)


def test_fold_blocks_is_the_block_tree():
    """A shard's vectorised fold (:func:`~flymc_dist.reduce.fold_blocks`) leaves the same
    nodes with the same bits as the block-by-block fold, and the driver's completion is
    the one-shard total for every cut into shards; a node given twice is refused."""
    from flymc_dist.reduce import fold_blocks, tree_nodes, tree_total, tree_total_arrays

    rng = np.random.default_rng(1)
    for nb in (1, 2, 3, 5, 8, 13, 245, 257):
        v = rng.standard_normal((nb, 3)) * 10.0 ** rng.integers(-8, 8, (nb, 1))
        whole = tree_total([tree_nodes(((b, v[b]) for b in range(nb)), nb)])
        for _ in range(10):
            k = int(rng.integers(1, min(nb, 6) + 1))
            cuts = np.sort(rng.choice(np.arange(1, nb), k - 1, replace=False)) if nb > 1 else []
            edges = [0, *cuts, nb]
            parts = [fold_blocks(v[a:b], a, nb) for a, b in zip(edges[:-1], edges[1:], strict=True)]
            for (a, b), (nodes, vals) in zip(
                zip(edges[:-1], edges[1:], strict=True), parts, strict=True
            ):
                ref = tree_nodes(((x, v[x]) for x in range(a, b)), nb)
                assert [(lv, i) for lv, i, _ in ref.nodes] == [tuple(r[:2]) for r in nodes]
                assert all(
                    np.array_equal(x, y) for (_, _, x), y in zip(ref.nodes, vals, strict=True)
                )
            assert np.array_equal(tree_total_arrays(parts), whole)
    nodes, vals = fold_blocks(np.ones((4, 1)), 0, 8)
    with pytest.raises(ValueError, match="given twice"):
        tree_total_arrays([(nodes, vals), (nodes, vals)])
