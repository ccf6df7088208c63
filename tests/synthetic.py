"""Small synthetic data sets shared by the tests (numpy only, fixed seeds)."""

from __future__ import annotations

import numpy as np


def logistic_rows(n: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of a bias and two standard normal features, with 0/1 labels drawn from
    a logistic model of intercept 0.3 and weights (1.0, -0.7)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2))
    X = np.column_stack([np.ones(n), x])
    logit = 0.3 + x @ np.array([1.0, -0.7])
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    return X, y
