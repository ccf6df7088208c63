"""Forcing ``exact_rows="auto"``'s choice in tests: shared by the conftest fixture
``force_exact_rows`` and by tests/test_exactness.py's pool workers, where no fixture is."""

from __future__ import annotations

import numpy as np
import pytest

from flymc_dist import tune


def force_exact_rows(mp: pytest.MonkeyPatch, column: int, threshold: float) -> None:
    """Make ``exact_rows="auto"`` pick the rows with ``x[:, column]² ≥ threshold``,
    whatever the data — the rule's own limits are for large data (at most N/100 rows
    carry a narrow column), the tests' problems are small. Only the driver-side rule is
    patched (:func:`flymc_dist.tune.narrow_columns` and the row budget), through ``mp``,
    so the shards apply it for real, in-process or on any cluster."""
    mp.setattr(
        tune,
        "narrow_columns",
        lambda energy, n_rows: (np.array([column]), np.array([float(threshold)])),
    )
    mp.setattr(tune, "EXACT_MAX_FRACTION", 1.0)
