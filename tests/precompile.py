"""Fill numba's on-disk cache before the test processes start (``tests/conftest.py``).

Every ``cache=True`` kernel is compiled by the first process that calls it and loaded
from ``__pycache__`` by the others. On a clean clone the test processes (pytest-xdist's
workers, each Dask worker they start) all begin with an empty cache and compile the same
kernels side by side, each a few seconds. Run before them, in two processes that split the
kernels between them, these tiny runs compile once what the tests' runs call most (the
same call signatures: they are what the tests use), so the tests load it instead.

``python tests/precompile.py PART`` runs part ``PART`` (0 or 1) of :data:`PARTS`;
``tests/conftest.py`` runs both where the cache is missing or older than the kernels.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

import flymc_dist as fd

#: the tiny runs' sizes: compilation depends on the arguments' types, not on their sizes
TINY = dict(num_warmup=10, num_samples=2, chains=2, seed=1, client="synchronous", progress=False)


def _rows(n: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of a bias and two features with 0/1 labels."""
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(n), rng.normal(size=(n, 2))])
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-X @ np.array([0.3, 1.0, -0.7])))).astype(np.int64)
    return X, y


def _replica() -> None:
    """The default path: FlyMC with NUTS on the driver's replica of the bright rows; and
    JointDPM's (its label step, weight tests and split–merge moves)."""
    fd.sample(fd.LogisticRegression(), _rows(), **TINY)
    X, y = _rows()
    fd.sample_jointdpm(
        (X[:, 1:], y),
        fd.JointDPM(eps=0.3, init_clusters=2, split_merge=1),
        num_samples=3,
        chains=1,
        client="synchronous",
    )


def _shards() -> None:
    """The shards' own kernels: FlyMC's implicit and explicit z-updates evaluated on the
    shards, in memory and out of core; regular MCMC; austerity."""
    data = _rows()
    for z_update in ("implicit", "explicit"):
        algorithm = fd.FlyMC(z_update=z_update, bright_replica=False)
        fd.sample(fd.LogisticRegression(), data, algorithm, "rwmh", **TINY)
    with tempfile.TemporaryDirectory() as tmp:
        store = fd.from_numpy(*data, str(Path(tmp) / "d.zarr"), chunk_rows=50)
        placement = fd.Placement(n_shards=2, out_of_core=True)
        algorithm = fd.FlyMC(bright_replica=False)
        fd.sample(fd.LogisticRegression(), store, algorithm, "rwmh", placement=placement, **TINY)
    fd.sample(fd.LogisticRegression(), data, fd.Regular(), "nuts", **TINY)
    fd.sample(fd.LogisticRegression(), data, fd.Austerity(), "rwmh", **TINY)


#: the two parts, of about equal compile time, run side by side
PARTS = (_replica, _shards)


if __name__ == "__main__":
    PARTS[int(sys.argv[1])]()
