"""Brightness variables z: the bright/dark structure of one shard for one chain.

The structure is the vectorised equivalent of the paper's Figure 3 array+table:
an array ``idx`` of the bright rows, the same rows sorted (``members``: what a
membership test searches), and the cached ``log L~_n`` of the bright rows at the
chain's current θ (``vals``, aligned with ``idx``), optionally with the derivative of
``log L~_n`` with respect to the linear predictor (``dvals``) for gradient kernels.
It takes O(M) bytes for M bright rows, whatever the shard's size: there is no mask
over the rows (4 GB for 4 chains at 10⁹ rows), which out of core would be the one
thing left in memory that grows with N.

Everything here costs O(M + number of proposals), never O(N): darkening filters
``idx`` (O(M)); the dark→bright proposals (every row independently with
probability q) come from the chain's Bernoulli process over all N rows
(:func:`flymc_dist.streams.bernoulli_rows`), O(log N + number of proposals).
Every random number is keyed by the global row (:mod:`flymc_dist.streams`), so the
updates give the same draws whatever shard holds a row.

With ``log L~_n = log(expm1(delta_n))`` (``delta_n = l_n - beta_n``) the
conditional brightness probability is ``p(z_n = 1 | θ) = 1 - exp(-delta_n)
= sigmoid(log L~_n)``, so the updates work entirely in ``log L~``.

Knows nothing of Dask or models: each update comes in two halves, ``*_propose`` (which
rows to evaluate) and ``*_accept`` (given their ``log L~`` at the chain's current θ),
and the caller evaluates the rows between them (a shard, for all its chains at once).
"""

from __future__ import annotations

import math

import numpy as np

from flymc_dist._numerics import in_sorted, log_sigmoid
from flymc_dist.streams import RowStreams


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

    def __init__(self, n_rows: int, n_outputs: int = 1, track_grad: bool = False) -> None:
        self.n_rows = int(n_rows)
        self.n_outputs = int(n_outputs)
        self.track_grad = bool(track_grad)
        self.idx = np.empty(0, dtype=np.int64)
        #: ``idx`` sorted: what :meth:`contains` searches
        self.members = np.empty(0, dtype=np.int64)
        self.vals = np.empty(0, dtype=np.float64)
        self.dvals: np.ndarray | None = (
            np.empty((0, self.n_outputs), dtype=np.float64) if track_grad else None
        )

    @property
    def n_bright(self) -> int:
        """M, the number of bright rows."""
        return int(self.idx.size)

    def contains(self, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` are bright (a boolean array): a binary search each."""
        return in_sorted(rows, self.members)

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
        members = self.members
        if gone.size:
            members = members[~in_sorted(members, np.sort(gone))]
        if new_rows.size:
            members = np.union1d(members, new_rows).astype(np.int64, copy=False)
        self.members = members
        self.idx = np.concatenate([self.idx[keep], new_rows])
        self.vals = np.concatenate([self.vals[keep], new_vals])
        if self.track_grad:
            self.dvals = np.concatenate([self.dvals[keep], new_dvals])  # type: ignore[index]


def implicit_propose(
    streams: RowStreams, bright: BrightSet, q: float
) -> tuple[np.ndarray, np.ndarray]:
    """First half of the implicit z-update: which bright rows go dark, which dark rows
    propose.

    The implicit update is the Metropolis–Hastings update of every z_n (the paper's
    Algorithm 2, sign corrected): bright rows propose dark and are accepted with
    ``min(1, q / L~_n)``; dark rows propose bright with probability ``q`` and are
    accepted with ``min(1, L~_n / q)`` (:func:`implicit_accept`). Which rows propose is a
    Bernoulli(q) process over *all* rows, the bright ones among them being skipped — the
    same as proposing each dark row with probability q. Between the halves the caller
    evaluates ``log L~`` of the proposing rows at the current θ (the likelihood queries
    of the update: one per proposing row).

    Every random number is the row's own (:class:`~flymc_dist.streams.RowStreams`): a
    bright row's uniform decides its move, and which dark rows propose is the chain's
    Bernoulli(q) process over all N rows, restricted to this shard's rows.

    Returns
    -------
    darken, cand
        A boolean mask over the bright rows, and the (sorted) dark rows proposing
        to brighten; evaluate ``log L~`` of ``cand`` and pass it to
        :func:`implicit_accept`.
    """
    # bright -> dark: accept iff log u < log q - log L~ (a row with L~ = 0 always goes dark)
    darken = streams.log_uniforms(bright.idx) < math.log(q) - bright.vals
    # dark -> bright proposals, decided on the z as it was before this sweep
    cand = streams.rows(streams.propose, q, 0, bright.n_rows)
    return darken, cand[~bright.contains(cand)]


def implicit_accept(
    streams: RowStreams,
    bright: BrightSet,
    q: float,
    darken: np.ndarray,
    cand: np.ndarray,
    vals: np.ndarray,
    dvals: np.ndarray | None,
) -> None:
    """Second half of the implicit z-update (:func:`implicit_propose`): darken the rows
    ``darken`` picks, and accept each dark→bright proposal ``cand`` with ``min(1, L~/q)``
    (:func:`brighten`), ``vals`` (and ``dvals``) its ``log L~`` (and eta-derivative) at
    the current θ."""
    if cand.size:
        accept = brighten(streams.log_uniforms(cand), vals, q)
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


def explicit_propose(streams: RowStreams, bright: BrightSet, fraction: float) -> np.ndarray:
    """First half of the explicit z-update: the rows to resample, each row independently
    with probability ``fraction`` (its Bernoulli process).

    The explicit update is a Gibbs update of these rows' z from their exact conditional
    (:func:`explicit_accept`): the paper's Algorithm 1, which resamples
    ``ceil(fraction * N)`` rows; here their number is Binomial(N, fraction), so that
    which rows are drawn depends on nothing but the rows' own streams. With
    ``fraction = 1`` it draws the whole of z exactly from ``p(z | θ)``: the way to
    (re)initialise a shard.
    """
    return streams.rows(streams.select, fraction, 0, bright.n_rows)


def explicit_accept(
    streams: RowStreams,
    bright: BrightSet,
    rows: np.ndarray,
    vals: np.ndarray,
    dvals: np.ndarray | None,
) -> None:
    """Second half of the explicit z-update (:func:`explicit_propose`): draw z of ``rows``
    from ``sigmoid(log L~)``, ``vals`` (and ``dvals``) their ``log L~`` (and
    eta-derivative) at the current θ."""
    if rows.size == 0:
        return
    z = streams.log_uniforms(rows) < log_sigmoid(vals)
    was_bright = bright.contains(rows)
    # rows resampled as dark: drop them from the bright set
    off = rows[was_bright & ~z]
    keep = (
        ~np.isin(bright.idx, off, assume_unique=True)
        if off.size
        else np.ones(bright.n_bright, dtype=bool)
    )
    on = ~was_bright & z
    bright.replace(keep, rows[on], vals[on], dvals[on] if dvals is not None else None)
