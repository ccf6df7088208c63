"""Out of core, the read-ahead is bounded by the shard's memory budget (issue 41, item 1):
the z-updates whose proposals are read ahead are as many as fit in half the budget (at
most ROWS_AHEAD, at least one), and the draws do not change."""

from __future__ import annotations

import numpy as np
import pytest

import flymc_dist as fd
from flymc_dist.protocol import ShardConfig, ShardSpec
from flymc_dist.shard import Shard
from flymc_dist.shard.round import update_z
from flymc_dist.shard.state import ROWS_AHEAD


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(3)
    X = np.c_[np.ones(3000), rng.normal(size=(3000, 4))]
    y = (rng.random(3000) < 0.5).astype(np.int64)
    path = str(tmp_path_factory.mktemp("ra") / "d.zarr")
    fd.from_numpy(X, y, path, chunk_rows=500)
    return path


def _shard(path: str, budget: int | None) -> Shard:
    config = ShardConfig(
        model=fd.LogisticRegression(),
        algorithm="flymc",
        chains=4,
        seed=1,
        n_rows=3000,
        q_db=0.2,
        out_of_core=True,
        memory_budget=budget,
    )
    sh = Shard(ShardSpec(0, path, 0, 3000), config, None, budget)
    sh.set_tight_points(np.zeros(5))
    sh.set_positions(np.full((4, 5), 0.1))
    update_z([sh])[0]
    sh.settle()
    return sh


def test_the_read_ahead_fits_the_budget(store):
    # one z-update proposes ~0.2 · 3000 rows per chain, 4 chains: ~2,400 rows of
    # 8 (4·5 + K + 5) bytes, ~0.5 MB
    unbounded = _shard(store, None)
    assert unbounded.read_ahead_depth() == ROWS_AHEAD == len(unbounded.rows._staged)
    roomy = _shard(store, 100 * 2**20)
    assert roomy.read_ahead_depth() == ROWS_AHEAD
    per_update = 8 * (4 * 5 + roomy._K + 5) * 4 * 0.2 * 3000
    tight = _shard(store, int(5 * per_update))  # half of it holds two z-updates' proposals
    assert tight.read_ahead_depth() == 2 == len(tight.rows._staged)
    tiny = _shard(store, int(1.5 * per_update))
    assert tiny.read_ahead_depth() == 1 == len(tiny.rows._staged)
    for sh in (unbounded, roomy, tight, tiny):
        sh.close()


def test_the_draws_do_not_depend_on_the_read_ahead(store):
    def run(memory_budget=None):
        return fd.sample(
            fd.LogisticRegression(),
            fd.open_dataset(store),
            fd.FlyMC(q_db=0.2),
            client="synchronous",
            kernel="rwmh",
            num_warmup=30,
            num_samples=40,
            chains=2,
            seed=5,
            progress=False,
            placement=fd.Placement(out_of_core=True, memory_budget=memory_budget),
        )

    per_update = 8 * (4 * 5 + 3 + 5) * 2 * 0.2 * 3000  # K = 3 row constants (logistic)
    a, b = run(), run(memory_budget=int(1.5 * per_update))
    np.testing.assert_array_equal(a.samples, b.samples)
    np.testing.assert_array_equal(a.stats["n_bright"], b.stats["n_bright"])


def test_what_cannot_fit_is_refused_up_front(store, tmp_path, monkeypatch):
    """A z-update whose proposals alone exceed the budget: refused in one line, before
    the row file is written."""
    import os

    monkeypatch.setattr("flymc_dist.shard.state.local_directory", lambda: str(tmp_path))
    with pytest.raises(ValueError, match=r"q_db=0\.2 proposes about 2,400 rows .* budget") as e:
        _shard(store, 100_000)
    assert "\n" not in str(e.value) and os.listdir(tmp_path) == []
    sh = _shard(store, 2**20)  # q 0.2 fits, q 0.9 not: the driver's set_q is refused
    with pytest.raises(ValueError, match=r"q_db=0\.9 proposes"):
        sh.set_q(0.9)
    assert sh.q_db == 0.2
    sh.close()
