"""z-updates: invariance of p(z | θ), cost scaling, and the Algorithm-2 sign trap."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from scipy import stats

from flymc_dist import brightness
from flymc_dist.brightness import (
    BrightSet,
    explicit_accept,
    explicit_propose,
    implicit_accept,
    implicit_propose,
)
from flymc_dist.streams import RowStreams

#: ``evaluate(rows)`` → ``(log L~ of those rows at the current θ, d log L~/d eta or None)``
RowEvaluator = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]]


def implicit_update(
    streams: RowStreams, bright: BrightSet, q: float, evaluate: RowEvaluator
) -> int:
    """One implicit z-update of one chain (Algorithm 2, sign corrected): the production
    halves with ``evaluate`` between them, as a shard runs them. Returns the likelihood
    queries made (dark rows evaluated)."""
    darken, cand = implicit_propose(streams, bright, q)
    vals, dvals = evaluate(cand) if cand.size else (np.empty(0), None)
    implicit_accept(streams, bright, q, darken, cand, vals, dvals)
    return int(cand.size)


def explicit_update(
    streams: RowStreams, bright: BrightSet, fraction: float, evaluate: RowEvaluator
) -> int:
    """One explicit (Gibbs) z-update of one chain: the production halves with
    ``evaluate`` between them. Returns the likelihood queries made (rows evaluated)."""
    rows = explicit_propose(streams, bright, fraction)
    if rows.size == 0:
        return 0
    vals, dvals = evaluate(rows)
    explicit_accept(streams, bright, rows, vals, dvals)
    return int(rows.size)


def _z(b: BrightSet) -> np.ndarray:
    """z of a bright set as a boolean array over its rows."""
    z = np.zeros(b.n_rows, dtype=bool)
    z[b.idx] = True
    return z


class _Steps:
    """Successive steps' row-keyed streams of one chain over ``n`` rows (what a shard
    hands the updates), in place of a random generator."""

    def __init__(self, seed: int, n: int) -> None:
        self.seed, self.n, self.t = seed, n, 0

    def __call__(self) -> RowStreams:
        self.t += 1
        return RowStreams(self.seed, 0, 0, self.t, 0, self.n)


def _fixed_evaluator(log_lt: np.ndarray, counter: list[int]):
    def evaluate(rows: np.ndarray):
        counter[0] += rows.size
        return log_lt[rows], None

    return evaluate


def _stationarity_z(update, log_lt: np.ndarray, q: float, sweeps: int, seed: int) -> np.ndarray:
    """Per-datum z-scores of the bright frequency against p = sigmoid(log L~).

    Each z_n is a two-state Markov chain with P(0→1) = q·min(1, L~/q) and
    P(1→0) = min(1, q/L~); its lag-1 autocorrelation is rho = 1 − P01 − P10, so the
    variance of the time-average is p(1 − p)/T · (1 + rho)/(1 − rho) exactly.
    """
    n = log_lt.size
    rng = _Steps(seed, n)
    bright = BrightSet(n)  # start all dark: far from stationarity
    counter = [0]
    evaluate = _fixed_evaluator(log_lt, counter)
    burn = 50
    freq = np.zeros(n)
    for t in range(burn + sweeps):
        update(rng(), bright, q, evaluate)
        if t >= burn:
            freq += _z(bright)
    freq /= sweeps
    lt = np.exp(log_lt)
    p = lt / (1.0 + lt)
    p01 = q * np.minimum(1.0, lt / q)
    p10 = np.minimum(1.0, q / lt)
    rho = 1.0 - p01 - p10
    var = p * (1 - p) / sweeps * (1 + rho) / (1 - rho)
    return (freq - p) / np.sqrt(var)


LOG_LT = np.linspace(-3.0, 3.0, 60)  # bright probabilities 0.05 … 0.95
CRIT = stats.norm.ppf(1 - 0.001 / (2 * LOG_LT.size))  # Bonferroni, family-wise 0.1%


@pytest.mark.parametrize("q", [0.1, 0.5, 1.0])
def test_implicit_update_leaves_conditional_invariant(q):
    z = _stationarity_z(implicit_update, LOG_LT, q, sweeps=4000, seed=1)
    assert np.max(np.abs(z)) < CRIT, np.round(z, 2)
    # and as a whole: sum of squares ~ chi2(N)
    assert stats.chi2.sf(np.sum(z**2), LOG_LT.size) > 1e-4


def test_flipped_sign_negative_control_fails(monkeypatch):
    """The same check must reject Algorithm 2 with the paper's typo (the trap in DESIGN.md):
    dark→bright accepted when u > L~/q."""
    monkeypatch.setattr(brightness, "brighten", lambda log_u, vals, q: log_u > vals - math.log(q))
    z = _stationarity_z(implicit_update, LOG_LT, 0.1, sweeps=4000, seed=1)
    assert np.max(np.abs(z)) > CRIT
    assert stats.chi2.sf(np.sum(z**2), LOG_LT.size) < 1e-6


def test_explicit_update_draws_exact_conditional():
    log_lt = np.linspace(-4, 4, 40)
    rng = _Steps(2, log_lt.size)
    p = 1 / (1 + np.exp(-log_lt))
    reps = 3000
    counts = np.zeros(log_lt.size)
    for _ in range(reps):
        b = BrightSet(log_lt.size)
        explicit_update(rng(), b, 1.0, _fixed_evaluator(log_lt, [0]))
        counts += _z(b)
    z = (counts - reps * p) / np.sqrt(reps * p * (1 - p))
    assert np.max(np.abs(z)) < stats.norm.ppf(1 - 0.001 / (2 * log_lt.size))


def test_explicit_partial_update_leaves_conditional_invariant():
    log_lt = np.linspace(-3, 3, 30)
    rng = _Steps(3, log_lt.size)
    p = 1 / (1 + np.exp(-log_lt))
    b = BrightSet(log_lt.size)
    ev = _fixed_evaluator(log_lt, [0])
    sweeps = 6000
    freq = np.zeros(log_lt.size)
    for t in range(sweeps + 50):
        explicit_update(rng(), b, 0.25, ev)
        if t >= 50:
            freq += _z(b)
    freq /= sweeps
    # each z_n is refreshed with probability 0.25 per sweep: rho = 0.75
    var = p * (1 - p) / sweeps * (1 + 0.75) / (1 - 0.75)
    z = (freq - p) / np.sqrt(var)
    assert np.max(np.abs(z)) < stats.norm.ppf(1 - 0.001 / (2 * log_lt.size))


def test_bright_structure_consistent_after_updates():
    log_lt = np.random.default_rng(4).normal(size=500)
    rng = _Steps(4, 500)
    b = BrightSet(500)
    ev = _fixed_evaluator(log_lt, [0])
    for _ in range(200):
        implicit_update(rng(), b, 0.2, ev)
        assert np.array_equal(np.sort(b.idx), b.members)
        assert np.array_equal(b.vals, log_lt[b.idx])
        explicit_update(rng(), b, 0.1, ev)
        assert np.array_equal(np.sort(b.idx), b.members)
        assert np.array_equal(b.vals, log_lt[b.idx])


def test_implicit_cost_scales_with_proposals_not_n():
    """Queries per sweep = dark rows proposed (~ q·(N − M)); nothing touches all N rows."""
    n, q = 200_000, 0.001
    rng = _Steps(5, n)
    log_lt = np.full(n, -8.0)  # bright probability ~3e-4: M small
    b = BrightSet(n)
    counter = [0]
    ev = _fixed_evaluator(log_lt, counter)
    total = 0
    for _ in range(100):
        total += implicit_update(rng(), b, q, ev)
    assert total == counter[0]
    expected = 100 * q * n
    assert abs(total - expected) < 5 * math.sqrt(expected)


def test_tight_bound_bright_row_always_darkens():
    """log L~ = -inf (bound tight): a bright row there has probability zero."""
    rng = _Steps(6, 3)
    b = BrightSet(3)
    b.replace(np.zeros(0, bool), np.array([0, 1, 2]), np.array([-np.inf, 0.0, -np.inf]), None)
    log_lt = np.array([-np.inf, 0.0, -np.inf])
    implicit_update(rng(), b, 0.5, _fixed_evaluator(log_lt, [0]))
    assert not _z(b)[0] and not _z(b)[2]
