"""Brightness variables z: the bright/dark structure of one shard for one chain.

The structure is the vectorised equivalent of the paper's Figure 3 array+table:
an array ``idx`` of the bright rows, a boolean ``mask`` over all rows, and the
cached ``log L~_n`` of the bright rows at the chain's current θ (``vals``,
aligned with ``idx``), optionally with the derivative of ``log L~_n`` with
respect to the linear predictor (``dvals``) for gradient kernels.

Everything here costs O(M + number of proposals), never O(N): darkening filters
``idx`` (O(M)); the dark→bright proposals (every row independently with
probability q) are the partial sums of Geometric(q) gaps, O(number of proposals).

With ``log L~_n = log(expm1(delta_n))`` (``delta_n = l_n - beta_n``) the
conditional brightness probability is ``p(z_n = 1 | θ) = 1 - exp(-delta_n)
= sigmoid(log L~_n)``, so the updates work entirely in ``log L~``.

Knows nothing of Dask or models: rows are evaluated through a callback
``evaluate(rows) -> (vals, dvals)`` at the chain's current θ.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from flymc_dist._numerics import log_sigmoid

#: ``evaluate(rows)`` → ``(log L~ of those rows at the current θ, d log L~/d eta or None)``
RowEvaluator = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]]


def log_uniform(rng: np.random.Generator, size: int) -> np.ndarray:
    """``log(U)`` for ``U ~ Uniform(0, 1]``: finite, never ``log(0)``."""
    return np.log1p(-rng.random(size))


class BrightSet:
    """The bright rows of one shard for one chain, with their cached ``log L~``.

    Parameters
    ----------
    n_rows
        Number of rows in the shard.
    n_outputs
        E, the number of linear predictors per datum (for ``dvals``).
    track_grad
        Keep ``d log L~ / d eta`` of the bright rows (gradient kernels).
    """

    def __init__(
        self,
        n_rows: int,
        n_outputs: int = 1,
        track_grad: bool = False,
        mask: np.ndarray | None = None,
    ) -> None:
        self.n_rows = int(n_rows)
        self.n_outputs = int(n_outputs)
        self.track_grad = bool(track_grad)
        if mask is None:
            mask = np.zeros(self.n_rows, dtype=bool)
        elif mask.shape != (self.n_rows,) or mask.dtype != bool or mask.any():
            raise ValueError("mask must be an all-False boolean array of shape (n_rows,)")
        self.mask = mask  # may be a row of a shard's (chains, n_rows) array
        self.idx = np.empty(0, dtype=np.int64)
        self.vals = np.empty(0, dtype=np.float64)
        self.dvals: np.ndarray | None = (
            np.empty((0, self.n_outputs), dtype=np.float64) if track_grad else None
        )

    @property
    def n_bright(self) -> int:
        """M, the number of bright rows."""
        return int(self.idx.size)

    def set_values(self, vals: np.ndarray, dvals: np.ndarray | None) -> None:
        """Replace the cached values of the bright rows (after θ moved)."""
        self.vals = vals
        if self.track_grad:
            self.dvals = dvals

    def replace(
        self,
        keep: np.ndarray,
        new_rows: np.ndarray,
        new_vals: np.ndarray,
        new_dvals: np.ndarray | None,
    ) -> None:
        """Keep the bright rows where ``keep`` is true and brighten ``new_rows`` (dark now)."""
        gone = self.idx[~keep]
        self.mask[gone] = False
        self.mask[new_rows] = True
        self.idx = np.concatenate([self.idx[keep], new_rows])
        self.vals = np.concatenate([self.vals[keep], new_vals])
        if self.track_grad:
            self.dvals = np.concatenate([self.dvals[keep], new_dvals])  # type: ignore[index]


def implicit_propose(
    rng: np.random.Generator,
    bright: BrightSet,
    q: float,
    window: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """First half of :func:`implicit_update`: which bright rows go dark, which dark rows propose.

    With ``window = (lo, hi)`` the update is restricted to the rows ``lo:hi`` — their
    bright and their dark rows alike, so that it still leaves ``p(z | θ)`` invariant
    (the z_n are independent given θ, and the rows a sub-update touches are chosen
    without looking at z): bright rows outside the window stay bright, dark ones dark.

    Returns
    -------
    darken, cand
        A boolean mask over the bright rows, and the (sorted) dark rows proposing
        to brighten; evaluate ``log L~`` of ``cand`` and pass it to
        :func:`implicit_accept`.
    """
    lo, hi = (0, bright.n_rows) if window is None else window
    # bright -> dark: accept iff log u < log q - log L~ (a row with L~ = 0 always goes dark)
    if window is None:
        darken = log_uniform(rng, bright.n_bright) < math.log(q) - bright.vals
    else:
        inside = (bright.idx >= lo) & (bright.idx < hi)
        darken = np.zeros(bright.n_bright, dtype=bool)
        darken[inside] = log_uniform(rng, int(inside.sum())) < math.log(q) - bright.vals[inside]
    # dark -> bright proposals, decided on the z as it was before this sweep
    cand = bernoulli_rows(rng, hi - lo, q) + lo
    return darken, cand[~bright.mask[cand]]


def proposal_slots(n: int, q: float) -> int:
    """Geometric gaps drawn at once for Bernoulli(q) trials over n rows: the mean count
    plus six standard deviations plus eight, so that they reach past the last row in
    all but a vanishing fraction of draws."""
    mean = n * q
    return int(mean + 6.0 * math.sqrt(mean) + 8.0)


def bernoulli_rows(rng: np.random.Generator, n: int, q: float) -> np.ndarray:
    """The rows of ``0..n-1`` kept by independent Bernoulli(q) trials, sorted (int64).

    Drawn as the partial sums of Geometric(q) gaps (the waiting times of a Bernoulli
    process): O(nq) work, one draw of gaps in all but a vanishing fraction of calls.
    """
    if n <= 0 or q <= 0.0:
        return np.empty(0, dtype=np.int64)
    if q >= 1.0:
        return np.arange(n, dtype=np.int64)
    if n > 2**53:  # partial sums of up to k gaps of n + 1 must fit in int64
        raise ValueError(f"bernoulli_rows: n = {n} rows is beyond 2**53")
    k = proposal_slots(n, q)
    pos = gap_positions(rng.geometric(q, size=k), n)
    while pos[-1] < n:  # not yet past the last row: draw more gaps (rare)
        pos = np.concatenate([pos, gap_positions(rng.geometric(q, size=k), n) + pos[-1] + 1])
    return pos[: np.searchsorted(pos, n)]


def gap_positions(gaps: np.ndarray, n: int) -> np.ndarray:
    """The rows reached from row -1 by successive integer gaps (each >= 1), along the
    last axis. Gaps above ``n + 1`` are clipped: the row lands past the last one either
    way, and the sums stay within int64."""
    return np.cumsum(np.minimum(gaps, n + 1), axis=-1) - 1


def implicit_accept(
    rng: np.random.Generator,
    bright: BrightSet,
    q: float,
    darken: np.ndarray,
    cand: np.ndarray,
    vals: np.ndarray,
    dvals: np.ndarray | None,
) -> None:
    """Second half of :func:`implicit_update`: accept dark→bright with ``min(1, L~/q)``."""
    if cand.size:
        accept = brighten(log_uniform(rng, cand.size), vals, q)
        new_rows, new_vals = cand[accept], vals[accept]
        new_dvals = dvals[accept] if dvals is not None else None
    else:
        new_rows, new_vals = cand, np.empty(0)
        new_dvals = np.empty((0, bright.n_outputs)) if bright.track_grad else None
    bright.replace(~darken, new_rows, new_vals, new_dvals)


def brighten(log_u: np.ndarray, vals: np.ndarray, q: float) -> np.ndarray:
    """Which dark→bright proposals are accepted: ``u < L~ / q``, i.e. ``log u < log L~ - log q``.

    (Algorithm 2's line 10 prints the comparison the other way round: a typo.)
    """
    return log_u < vals - math.log(q)


def implicit_update(
    rng: np.random.Generator, bright: BrightSet, q: float, evaluate: RowEvaluator
) -> int:
    """Metropolis–Hastings update of every z_n (the paper's Algorithm 2, sign corrected).

    Bright rows propose dark and are accepted with ``min(1, q / L~_n)``; dark rows
    propose bright with probability ``q`` and are accepted with ``min(1, L~_n / q)``.
    (The paper's line 10 reads "<" where ">" is meant: the dark→bright move is
    accepted when ``u < L~_n / q``.) Which rows propose is drawn as a
    Bernoulli(q) trial per row over *all* rows (:func:`bernoulli_rows`), the bright
    ones among them being skipped — the same as proposing each dark row with
    probability q.

    Parameters
    ----------
    rng
        This shard's and chain's random stream.
    bright
        The structure to update in place (its ``vals`` at the current θ).
    q
        ``q_{d→b}``, the dark→bright proposal probability, in (0, 1].
    evaluate
        Computes ``log L~`` (and its eta-derivative) of dark rows at the current θ.

    Returns
    -------
    int
        The number of likelihood queries made (dark rows evaluated).
    """
    darken, cand = implicit_propose(rng, bright, q)
    vals, dvals = evaluate(cand) if cand.size else (np.empty(0), None)
    implicit_accept(rng, bright, q, darken, cand, vals, dvals)
    return int(cand.size)


def explicit_propose(
    rng: np.random.Generator,
    bright: BrightSet,
    fraction: float,
    window: tuple[int, int] | None = None,
) -> np.ndarray:
    """First half of :func:`explicit_update`: the ``ceil(fraction * N)`` rows to resample
    (with ``window = (lo, hi)``: as many of the rows ``lo:hi``, at most all of them)."""
    lo, hi = (0, bright.n_rows) if window is None else window
    n = hi - lo
    m = min(n, math.ceil(fraction * bright.n_rows))
    if m == n:
        return np.arange(lo, hi, dtype=np.int64)
    return np.sort(rng.choice(n, size=m, replace=False, shuffle=False)).astype(np.int64) + lo


def explicit_accept(
    rng: np.random.Generator,
    bright: BrightSet,
    rows: np.ndarray,
    vals: np.ndarray,
    dvals: np.ndarray | None,
) -> None:
    """Second half of :func:`explicit_update`: draw z of ``rows`` from ``sigmoid(log L~)``."""
    if rows.size == 0:
        return
    z = log_uniform(rng, rows.size) < log_sigmoid(vals)
    was_bright = bright.mask[rows]
    # rows resampled as dark: drop them from the bright set
    off = rows[was_bright & ~z]
    keep = (
        ~np.isin(bright.idx, off, assume_unique=True)
        if off.size
        else np.ones(bright.n_bright, dtype=bool)
    )
    on = ~was_bright & z
    bright.replace(keep, rows[on], vals[on], dvals[on] if dvals is not None else None)


def explicit_update(
    rng: np.random.Generator, bright: BrightSet, fraction: float, evaluate: RowEvaluator
) -> int:
    """Gibbs update of ``ceil(fraction * N)`` random z_n from their exact conditional.

    The paper's Algorithm 1. With ``fraction = 1`` this draws the whole of z exactly
    from ``p(z | θ)``: the way to (re)initialise a shard.

    Returns
    -------
    int
        The number of likelihood queries made (rows evaluated).
    """
    rows = explicit_propose(rng, bright, fraction)
    if rows.size == 0:
        return 0
    vals, dvals = evaluate(rows)
    explicit_accept(rng, bright, rows, vals, dvals)
    return int(rows.size)
