"""The shard side of austerity MH (:mod:`flymc_dist.austerity.sampler`): what runs beside the rows.

Two shard operations (marked with :func:`flymc_dist.protocol.shard_operation`, run on a
shard through :meth:`flymc_dist.shard.Shard.operation` by their names):

- :func:`shard_batch`: one test round's new rows for several chains, drawn without
  replacement within each chain's decision, and the statistics of their
  log-likelihood differences;
- :func:`shard_exact_diff`: the full-data difference (a full pass; benchmarks and tests
  score decisions against it).

They see the shard only through its public, read-only view (:meth:`Shard.rows_at`,
:meth:`Shard.blocks`, ``n``, ``spec``, ``model``, ``config``) and keep their per-shard
state (each chain's rows used by its current decision) in the shard's one named slot for
them, :meth:`Shard.extension` ``("austerity", ...)``. Neither module imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from flymc_dist.protocol import shard_operation
from flymc_dist.rng import ROLE_AUSTERITY, stream

if TYPE_CHECKING:
    from flymc_dist.shard import Shard

__all__ = ["EXTENSION", "AusterityRows", "shard_batch", "shard_exact_diff"]

#: the sub-role under ROLE_AUSTERITY of the shards' row-selection streams (the driver's
#: are 0, 1 and 3: see :mod:`flymc_dist.austerity.sampler`)
SUB_SHARD = 2

#: the name of austerity's slot on a shard (:meth:`Shard.extension`)
EXTENSION = "austerity"


class _SlotRows:
    """One chain's without-replacement row draws on one shard, within one decision."""

    __slots__ = ("rng", "decision", "mask", "used", "n_used", "perm", "pos")

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.decision: int | None = None
        self.mask: np.ndarray | None = None  # bool (n,), allocated on first use
        self.used: list[np.ndarray] = []
        self.n_used = 0
        self.perm: np.ndarray | None = None  # dense mode: the remainder, shuffled
        self.pos = 0

    def reset(self, decision: int) -> None:
        """Start a new decision: every row unseen again (O(rows used))."""
        if self.mask is not None:
            if self.perm is not None:
                self.mask[:] = False
            else:
                for u in self.used:
                    self.mask[u] = False
        self.decision = decision
        self.used = []
        self.n_used = 0
        self.perm = None
        self.pos = 0

    def draw(self, n: int, k: int, scratch: np.ndarray) -> np.ndarray:
        """``k`` rows of ``0..n-1`` not drawn yet in this decision, uniformly at random.

        Rejection against the mask while fewer than half the rows are used (expected
        O(k)); otherwise one permutation of the remaining rows, consumed in order.
        ``scratch`` is an int array of length ``n`` (any contents) used to keep the
        first occurrence of repeated candidates in O(k).
        """
        if k > n - self.n_used:
            raise ValueError(f"asked for {k} new rows but only {n - self.n_used} are unseen")
        if k == 0:
            return np.empty(0, dtype=np.int64)
        if self.mask is None:
            self.mask = np.zeros(n, dtype=bool)
        if self.perm is None and 2 * (self.n_used + k) > n:
            self.perm = self.rng.permutation(np.flatnonzero(~self.mask))
            self.pos = 0
        if self.perm is not None:
            rows = self.perm[self.pos : self.pos + k]
            self.pos += k
            self.n_used += k
            return rows
        parts = []
        need = k
        while need:
            cand = self.rng.integers(0, n, size=need + need // 4 + 8)
            cand = cand[~self.mask[cand]]
            # first occurrence of each candidate, in draw order: the last write of a
            # reversed assignment wins, so scratch[v] is the first index holding v
            idx = np.arange(cand.size)
            scratch[cand[::-1]] = idx[::-1]
            cand = cand[scratch[cand] == idx][:need]
            self.mask[cand] = True
            parts.append(cand)
            need -= cand.size
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.used.append(rows)
        self.n_used += k
        return rows


class AusterityRows:
    """Austerity's state on one shard (its :meth:`Shard.extension` slot): for the sampler
    run :attr:`run`, each chain's rows drawn by its current decision, and one int64
    scratch array of the shard's length."""

    __slots__ = ("run", "slots", "scratch")

    def __init__(self) -> None:
        self.run: int | None = None
        self.slots: dict[int, _SlotRows] = {}
        self.scratch = np.zeros(0, dtype=np.int64)

    def for_run(self, run: int, n: int) -> AusterityRows:
        """This state for the run ``run`` (every chain's afresh when the run is new)."""
        if self.run != run:
            self.run, self.slots, self.scratch = run, {}, np.zeros(n, dtype=np.int64)
        return self


@shard_operation
def shard_batch(
    shard: Shard,
    run: int,
    decisions: np.ndarray,
    slots: np.ndarray,
    thetas: np.ndarray,
    proposals: np.ndarray,
    counts: np.ndarray,
    record: bool,
    control_variates: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list | None]:
    """Shard operation: one test round's new rows for several chains.

    Parameters
    ----------
    shard
        The shard (supplied by :meth:`Shard.operation`).
    run
        Identifies the sampler run; a new run starts every chain's state afresh.
    decisions
        ``(m,)`` decision number of each requesting chain; a number different from the
        chain's previous one starts a new decision (all rows unseen again).
    slots
        ``(m,)`` chain (slot) indices.
    thetas, proposals
        ``(m, P)`` current and proposed parameters.
    counts
        ``(m,)`` how many new rows to draw for each chain.
    record
        Also return the global indices of the rows drawn (tests).
    control_variates
        Return the statistics of ``Δδ_i = δ_i(θ′) − δ_i(θ)`` (``δ = ℓ − β``, with the
        shard's tight points) instead of ``l_i``. A row whose ``l_i`` is infinite keeps
        ``l_i`` (it decides alone, as without control variates); a finite ``l_i`` whose
        ``Δδ_i`` is not finite (an overflowing bound) gives NaN, which the driver reports.

    Returns
    -------
    count, mean, m2, rows
        ``(m,)`` arrays: rows drawn, mean of ``l_i = ℓ_i(θ′) − ℓ_i(θ)`` (or ``Δδ_i``)
        over them, and their sum of squared deviations from that mean; ``rows`` is a
        list of index arrays (or None).
    """
    n = shard.n
    state = shard.extension(EXTENSION, AusterityRows).for_run(int(run), n)
    states, scratch = state.slots, state.scratch
    sid = shard.spec.shard_id
    model = shard.model
    m = len(slots)
    counts = np.asarray(counts, dtype=np.int64)
    E = model.n_outputs
    M = int(counts.sum())
    drawn = []
    for j in range(m):
        slot = int(slots[j])
        st = states.get(slot)
        if st is None:
            st = _SlotRows(stream(shard.config.seed, ROLE_AUSTERITY, SUB_SHARD, sid, slot))
            states[slot] = st
        if st.decision != int(decisions[j]):
            st.reset(int(decisions[j]))
        drawn.append(st.draw(n, int(counts[j]), scratch))
    rows = np.concatenate(drawn) if drawn else np.empty(0, dtype=np.int64)
    # every chain's rows in one read (out of core: of the store chunks they touch)
    X, y, xi = shard.rows_at(rows)
    D = X.shape[1]
    eta = np.empty((M, 2 * E))
    o = 0
    for j in range(m):
        k = drawn[j].size
        if k:
            # linear predictors of these rows at this chain's θ and θ′: one small GEMM
            pts = np.concatenate(
                [
                    np.asarray(thetas[j], float).reshape(E, D),
                    np.asarray(proposals[j], float).reshape(E, D),
                ]
            )
            np.matmul(X[o : o + k], pts.T, out=eta[o : o + k])
            o += k
    seg = np.repeat(np.arange(m), counts)
    eta = eta.reshape(M, 2, E).transpose(1, 0, 2)
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
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.bincount(seg, diff, minlength=m) / counts
        m2 = np.bincount(seg, (diff - mean[seg]) ** 2, minlength=m)
    mean[counts == 0] = 0.0
    m2[counts == 0] = 0.0
    bad = ~np.isfinite(diff)
    if bad.any():  # an infinite l_i decides alone (the full mean is infinite too); NaN errs
        for j in np.unique(seg[bad]):
            mean[j] = float(np.sum(diff[bad & (seg == j)]))
            m2[j] = 0.0
    shard.count_queries(2 * rows.size)
    rows_out = None
    if record:
        rows_out = [r + shard.spec.start for r in drawn]
    return counts, mean, m2, rows_out


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
