"""Draws keyed by row: the layout never changes the draws.

Every random number of a z-update is keyed by its global row (:mod:`flymc_dist.streams`)
and full passes sum by fixed blocks (:mod:`flymc_dist.reduce`), so any partition of the
rows into shards, in-process or on any number of workers, gives bit-identical draws —
for every θ-kernel and both z-updates. (The reference draws of
``tests/test_reference_draws.py`` were re-recorded once for these streams.)
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


def _run(data, kernel: str, z_update: str, client, **options) -> fd.Result:
    return fd.sample(
        fd.LogisticRegression(),
        data,
        kernel=kernel,
        z_update=z_update,
        num_warmup=60,
        num_samples=40,
        chains=2,
        seed=5,
        client=client,
        progress=False,
        **options,
    )


def _same(a: fd.Result, b: fd.Result) -> None:
    assert np.array_equal(a.samples, b.samples)
    for key in ("accepted", "n_bright", "likelihood_queries", "log_joint"):
        assert np.array_equal(a.stats[key], b.stats[key]), key


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
    data = _data(n=1200)
    ref = _run(data, "rwmh", "implicit", "synchronous", bounds="untuned", n_shards=1)
    _same(ref, _run(data, "rwmh", "implicit", "synchronous", bounds="untuned", n_shards=3))


def test_layout_dependence_is_visible_without_row_keys(monkeypatch):
    """Negative control: key the z streams by shard (the first design: every shard its own
    step counter and row numbers from its own start) and the draws change with the layout."""
    import flymc_dist.shard.shard as shard_mod

    real = shard_mod.RowStreams

    def by_shard(seed, generation, chain, step, offset, n_total, init=False):
        return real(seed, generation, chain, step, 0, n_total, init)  # local row numbers

    monkeypatch.setattr(shard_mod, "RowStreams", by_shard)
    data = _data()
    a = _run(data, "rwmh", "explicit", "synchronous", n_shards=1)
    b = _run(data, "rwmh", "explicit", "synchronous", n_shards=3)
    assert not np.array_equal(a.samples, b.samples)


@pytest.mark.cluster
@pytest.mark.parametrize("kernel", ["nuts", "rwmh"])
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
