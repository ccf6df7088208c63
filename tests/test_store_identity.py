"""A data set replaced at its path while a run reads it: every read of the store checks its
identity (its ``store_id``, new with every rewrite) and fails naming both; out-of-core
shards read the store once, at set-up, so a run keeps the rows it started on."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from scipy.special import expit

import flymc_dist as fd
from flymc_dist.data import StoreReplacedError
from flymc_dist.driver import Driver
from flymc_dist.layout import shard_layout
from flymc_dist.protocol import ShardConfig
from flymc_dist.shard import Shard


def _data(n: int = 900, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.c_[np.ones(n), rng.normal(size=(n, 2))]
    y = (rng.random(n) < expit(X @ np.array([0.3, -1.2, 0.8]))).astype(np.int64)
    return X, y


def _rewrite_in_another_process(path: str, seed: int) -> None:
    """``from_numpy(..., overwrite=True)`` of other rows of the same shape, run by another
    process (as ``flymc make-data --overwrite`` would be)."""
    code = (
        "import sys, numpy as np, flymc_dist as fd; "
        "rng = np.random.default_rng(int(sys.argv[2])); "
        "X = np.c_[np.ones(900), rng.normal(size=(900, 2))]; "
        "fd.from_numpy(X, (rng.random(900) < 0.5).astype(np.int64), sys.argv[1], "
        "chunk_rows=64, overwrite=True)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code, path, str(seed)], check=True, env=env)


def test_reads_after_a_rewrite_fail_naming_both_ids(tmp_path):
    X, y = _data()
    ds = fd.from_numpy(X, y, tmp_path / "d.zarr", chunk_rows=64)
    np.testing.assert_array_equal(ds.read(0, 10)[0], X[:10])
    new = fd.from_numpy(X + 1.0, y, tmp_path / "d.zarr", chunk_rows=64, overwrite=True)
    assert new.store_id != ds.store_id
    for read in (lambda: ds.read(0, 10), lambda: ds.read_rows([3, 70, 800])):
        with pytest.raises(StoreReplacedError) as info:
            read()
        msg = str(info.value)
        assert ds.store_id in msg and new.store_id in msg and "\n" not in msg
    with pytest.raises(StoreReplacedError, match=ds.store_id):
        fd.open_dataset(tmp_path / "d.zarr", store_id=ds.store_id)


def test_a_shard_opened_after_a_rewrite_refuses_it(tmp_path):
    """A shard set up (or recreated after a fault) once the store was rewritten: refused
    by its spec's store_id, in memory and out of core."""
    X, y = _data()
    ds = fd.from_numpy(X, y, tmp_path / "d.zarr", chunk_rows=64)
    specs = shard_layout(ds, fd.Placement(n_shards=2))[0]
    assert {s.store_id for s in specs} == {ds.store_id}
    config = ShardConfig(
        model=fd.LogisticRegression(), algorithm="flymc", chains=1, seed=0, n_rows=900
    )
    Shard(specs[1], config)  # the store the run opened: fine
    _rewrite_in_another_process(str(tmp_path / "d.zarr"), seed=9)
    for out_of_core in (False, True):
        cfg = ShardConfig(**{**config.__dict__, "out_of_core": out_of_core})
        with pytest.raises(StoreReplacedError, match=ds.store_id):
            Shard(specs[1], cfg)


@pytest.mark.slow
def test_an_out_of_core_run_keeps_the_rows_it_read(tmp_path, monkeypatch):
    """Another process rewrites the store 60 iterations into an out-of-core run: the run
    read its rows once, into its row files, at set-up (checking the store's identity),
    so it finishes on the data set it names — its draws are those of the same run with
    no rewrite, bit for bit — and a shard set up afresh after the rewrite would be
    refused (:func:`test_a_shard_opened_after_a_rewrite_refuses_it`)."""
    X, y = _data()
    path = str(tmp_path / "d.zarr")
    ds = fd.from_numpy(X, y, path, chunk_rows=64)
    kw = dict(
        kernel="rwmh",
        num_warmup=50,
        num_samples=100,
        chains=2,
        seed=8,
        placement=fd.Placement(n_shards=2, out_of_core=True),
        client="synchronous",
        progress=False,
    )
    model = fd.LogisticRegression(prior_scale=3.0)
    quiet = fd.sample(model, ds, **kw)
    real_step, calls = Driver.step, {"n": 0}

    def step(self, adapters=None):
        calls["n"] += 1
        if calls["n"] == 60:
            _rewrite_in_another_process(path, seed=11)
        return real_step(self, adapters)

    monkeypatch.setattr(Driver, "step", step)
    monkeypatch.delattr(Driver, "steps", raising=False)  # each iteration by step (see test_cli)
    res = fd.sample(model, ds, **kw)
    assert calls["n"] > 60 and fd.open_dataset(path).store_id != ds.store_id
    np.testing.assert_array_equal(res.samples, quiet.samples)
