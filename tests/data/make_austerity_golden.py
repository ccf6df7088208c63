"""Regenerate ``austerity_golden.npz``: austerity draws of today's sampler (no control
variates), against which ``control_variates=False`` is checked bit for bit.

Generated at commit 9577f69 (before control variates existed) with

    PYTHONPATH=. OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE=Haswell \
        NPY_ENABLE_CPU_FEATURES=X86_V3 python tests/data/make_austerity_golden.py

(the CPU kernels pinned as ``tests/conftest.py`` pins them for the comparison; the two
variables are named here since they were found to matter, on an AVX-512 machine, after
the recording, which ran on an AVX2 one).

Re-running it on later code with ``control_variates=False`` must give the same file.
Re-recorded on 2026-11-25 (documented reason): the MAP search now sums its full passes
by fixed blocks along a fixed tree (:mod:`flymc_dist.reduce`, so that the layout does not
change the draws) and the default layout is one shard per worker; the MAP start and the
Laplace preconditioner change in the last bits, and so do the draws.
Re-recorded on 2026-11-28 (documented reason, a deliberate change of the sampler): the
minibatch rows are drawn on the driver from a keyed permutation of all N rows
(:func:`flymc_dist.streams.permuted_rows`) instead of per-shard counts and per-shard
streams, and each round's statistics are summed in draw order, so that the layout does
not change the draws; every decision uses other rows, so every draw changed.
Since austerity's ``tails`` option (2026-11-28; default ``"one"``, the paper's) the runs
state ``tails="two"``, the test they were recorded with: the file is unchanged.
Re-recorded on 2026-11-29, the ``round_trips`` arrays only: a trip to the shards now
carries several minibatches of each undecided chain (doubling from trip to trip), so
fewer trips (898 → 302 in the fixed run's kept draws); every other array, the draws
included, was checked unchanged bit for bit before they were replaced.
"""

from __future__ import annotations

import pathlib

import numpy as np

import flymc_dist as fd
from flymc_dist.bench.sublinear import logistic_data

#: the runs: name -> (data size, seed of the data, sample() keywords, fd.Austerity options)
RUNS = {
    # fixed init and preconditioner: the draws depend on the decisions only
    "fixed": (
        1500,
        1,
        {
            "num_warmup": 30,
            "num_samples": 40,
            "chains": 2,
            "seed": 7,
            "placement": fd.Placement(n_shards=3),
            "init": np.array([0.32, 1.16, 0.38]),
            "precondition": np.diag([0.06, 0.07, 0.07]) ** 2,
        },
        {"eps": 0.05, "tails": "two", "batch_size": 100},
    ),
    # the defaults of the recording: MAP start, Laplace preconditioner, eps 0.01
    # two-sided (the default became the paper's one-sided test later), batch 500
    "default": (
        3000,
        2,
        {
            "num_warmup": 30,
            "num_samples": 40,
            "chains": 2,
            "seed": 8,
            "placement": fd.Placement(n_shards=2),
        },
        {"tails": "two"},
    ),
}
KEYS = ("accepted", "data_used", "test_rounds", "round_trips")


def run(name: str, **extra: object) -> dict[str, np.ndarray]:
    """The arrays of run ``name``, with ``extra`` fd.Austerity options."""
    n, dseed, kw, aus = RUNS[name]
    X, y, _ = logistic_data(n, 3, dseed)
    algorithm = fd.Austerity(**{**aus, **extra})
    res = fd.sample(fd.LogisticRegression(), (X, y), algorithm, client="synchronous", **kw)
    out = {f"{name}_samples": res.samples, f"{name}_warmup_samples": res.warmup_samples}
    for k in KEYS:
        out[f"{name}_{k}"] = res.stats[k]
        out[f"{name}_warmup_{k}"] = res.warmup_stats[k]
    return out


if __name__ == "__main__":
    extra = {"control_variates": False}  # recorded as plain austerity
    arrays = {}
    for name in RUNS:
        arrays.update(run(name, **extra))
    np.savez(pathlib.Path(__file__).with_name("austerity_golden.npz"), **arrays)
