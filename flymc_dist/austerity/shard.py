"""The shard side of austerity MH (:mod:`flymc_dist.austerity.sampler`): what runs beside the rows.

Two shard operations (marked with :func:`flymc_dist.protocol.shard_operation`, run on a
shard through :meth:`flymc_dist.shard.Shard.operation` by their names):

- :func:`shard_batch`: the log-likelihood differences of the rows a test round drew
  for several chains (the driver draws the rows, keyed by row: this shard only
  evaluates those that are its own);
- :func:`shard_exact_diff`: the full-data difference (a full pass; benchmarks and tests
  score decisions against it).

They see the shard only through its public, read-only view (:meth:`Shard.rows_at`,
:meth:`Shard.blocks`, ``n``, ``spec``, ``model``) and keep no state on it. Neither
module imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from flymc_dist._compiled import pair_dots
from flymc_dist.protocol import shard_operation

if TYPE_CHECKING:
    from flymc_dist.shard import Shard

__all__ = ["shard_batch", "shard_exact_diff"]


@shard_operation
def shard_batch(
    shard: Shard,
    thetas: np.ndarray,
    proposals: np.ndarray,
    rows: np.ndarray,
    seg: np.ndarray,
    control_variates: bool = False,
) -> np.ndarray:
    """Shard operation: one test round's rows of this shard, for several chains.

    Parameters
    ----------
    shard
        The shard (supplied by :meth:`Shard.operation`).
    thetas, proposals
        ``(m, P)`` current and proposed parameters of the ``m`` chains asking.
    rows
        Shard-local rows, chain ``j``'s at ``rows[seg[j]:seg[j + 1]]`` (distinct within
        a chain; in the order its decision drew them).
    seg
        ``(m + 1,)`` each chain's part of ``rows``.
    control_variates
        Return ``Δδ_i = δ_i(θ′) − δ_i(θ)`` (``δ = ℓ − β``, with the shard's tight points)
        instead of ``l_i``. A row whose ``l_i`` is infinite keeps ``l_i`` (it decides
        alone, as without control variates); a finite ``l_i`` whose ``Δδ_i`` is not
        finite (an overflowing bound) gives NaN, which the driver reports.

    Returns
    -------
    numpy.ndarray
        ``(len(rows),)``: ``l_i = ℓ_i(θ′) − ℓ_i(θ)`` (or ``Δδ_i``) of each row, in the
        order of ``rows``. Each row's value is computed from that row alone (its linear
        predictors summed over the features in order, not in a product of all the rows),
        so it is the same bits whichever rows it is drawn with, on whichever shard.
    """
    rows = np.asarray(rows, dtype=np.int64)
    seg = np.asarray(seg, dtype=np.int64)
    m = seg.size - 1
    if rows.ndim != 1 or (rows.size and not 0 <= rows.min() <= rows.max() < shard.n):
        raise ValueError(f"rows must be this shard's rows, 0 to {shard.n - 1}")
    if m < 0 or seg[0] != 0 or seg[-1] != rows.size or (np.diff(seg) < 0).any():
        raise ValueError("seg must rise from 0 to the number of rows")
    if np.shape(thetas) != np.shape(proposals) or np.shape(thetas)[0] != m:
        raise ValueError(f"thetas and proposals must be {m} chains' points each")
    model = shard.model
    E = model.n_outputs
    M = rows.size
    # every chain's rows in one read (out of core: of the store chunks they touch)
    X, y, xi = shard.rows_at(rows)
    D = X.shape[1]
    eta = np.empty((2, M, E))  # at θ and at θ′, each contiguous whatever M
    # row by row (a BLAS product rounds a row by where it sits in the product), compiled
    pair_dots(
        X,
        seg,
        np.asarray(thetas, float).reshape(m, E * D),
        np.asarray(proposals, float).reshape(m, E * D),
        eta,
    )
    ll = model.loglik(eta, y)
    diff = ll[1] - ll[0]
    if control_variates:
        if xi is None:
            raise RuntimeError(
                "control variates need the shard's tight points (set_tight_points) first"
            )
        with np.errstate(invalid="ignore", over="ignore"):
            lb = model.logbound(eta, y, xi)
            dd = (ll[1] - lb[1]) - (ll[0] - lb[0])
        finite = np.isfinite(diff)
        diff = np.where(finite, np.where(np.isfinite(dd), dd, np.nan), diff)
    shard.count_queries(2 * M)
    return diff


@shard_operation
def shard_exact_diff(
    shard: Shard, thetas: np.ndarray, proposals: np.ndarray, block: int = 1 << 20
) -> np.ndarray:
    """Shard operation: ``sum_i ℓ_i(θ′_s) − ℓ_i(θ_s)`` over all
    rows.

    For each of the ``S`` pairs (rows of ``thetas``/``proposals``); a full pass, used only
    to score decisions against exact MH (benchmarks, tests).
    """
    model = shard.model
    pts = np.concatenate([np.asarray(thetas, float), np.asarray(proposals, float)])
    S = pts.shape[0] // 2
    out = np.zeros(S)
    for X, y, _ in shard.blocks(max(1, block // max(1, pts.shape[0]))):
        ll = model.loglik(model.linear_predictor(pts, X), y).sum(axis=1)
        out += ll[S:] - ll[:S]
    return out
