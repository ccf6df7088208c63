"""Whether two runs gave the same draws: the check the tests that change where or how a
run computes (layouts, transports, lent rows) share."""

from __future__ import annotations

import numpy as np

#: the per-iteration statistics every such run must also give alike
STATS = ("n_bright", "likelihood_queries", "lp", "accepted")


def same_draws(a, b, stats: tuple[str, ...] = STATS) -> None:
    """Assert that results ``a`` and ``b`` hold the same draws, warm-up included, and the
    same ``stats``, bit for bit."""
    assert np.array_equal(a.samples, b.samples)
    assert np.array_equal(a.warmup_samples, b.warmup_samples)
    for k in stats:
        assert np.array_equal(a.stats[k], b.stats[k]), k
