"""Austerity Metropolis–Hastings over shards (approximate; every output says so).

The sequential-test MH of Korattikara, Chen & Welling (2014), in the form of Chen,
Mansinghka & Ghahramani (2016, Algorithm 2, "Sequential Test for MH Decision").
An MH step with proposal ``θ′`` and uniform ``u`` accepts iff

    mean_{i=1..N} l_i  >  μ₀ = (1/N) [log u + log p(θ) − log p(θ′) + log q(θ′|θ) − log q(θ|θ′)],

with ``l_i = ℓ_i(θ′) − ℓ_i(θ)``. Instead of the full mean, the decision is taken
from a *simple random sample* of the ``l_i`` that grows in minibatches (drawn
without replacement from the whole population across shards). After each batch,
with ``n`` rows used, mean ``l̄`` and sample sd ``s_l``,

    s = s_l / √n · √(1 − (n − 1)/(N − 1)),   t = (l̄ − μ₀) / s,

and the test stops when its p-value is below ``eps`` (accept iff ``l̄ > μ₀``). The
p-value is one-sided by default, ``P(T_{n−1} > |t|)`` (``tails="one"``), as the paper's ε
is (its Appendix A: the threshold ``t⁻¹(1 − ε)``; Venture rejects when the p-value is below
ε and accepts when it is above ``1 − ε``); ``tails="two"`` uses ``2·P(T_{n−1} > |t|)``, so a
one-sided ``eps`` takes the decisions of a two-sided ``2·eps`` (the paper's ε = 0.01 is a
two-sided 0.02). No test runs before ``min_batches`` minibatches (the paper's ``k0 = 3``,
with minibatches of 10–100 rows; the default is 1, a minibatch of 500 rows being well past
where the t approximation needs help); after that, a sample sd of zero decides at once
(``eps > 0``). When every row has been used the decision is the exact MH decision, and
``eps = 0`` (which never stops early) therefore reproduces exact MH.

Control variates from the bounds (``control_variates=True``, the default)
--------------------------------------------------------------------------
FlyMC's per-datum lower bounds ``β_i ≤ ℓ_i`` (quadratic in θ, tight points set at the
MAP exactly as FlyMC's ``bounds="map"`` does) split each difference into

    l_i = Δβ_i + Δδ_i,   Δβ_i = β_i(θ′) − β_i(θ),   Δδ_i = δ_i(θ′) − δ_i(θ),   δ = ℓ − β ≥ 0.

``Σ_all Δβ_i`` is known exactly from the collapsed sufficient statistics the driver
sums once (``(θ′ − θ)ᵀA(θ′ + θ) + bᵀ(θ′ − θ)``: O(P²), no data), so the decision becomes

    mean_{i=1..N} Δδ_i  >  μ₀ − (1/N) Σ_all Δβ_i,

and the sequential test above runs on the ``Δδ_i`` instead of the ``l_i``: the same
sampling of rows, finite-population correction, stopping rule and random streams.

*Why it is valid.* Nothing about the decision rule changes: at ``n = N`` the test uses
every row and the decision is the exact MH decision (up to rounding), so ``eps = 0``
is exact MH as before; for ``eps > 0`` the sequential test's approximation (a t-test
on a finite-population sample) is made on a variable of far smaller spread. A bound
that is loose, or tight at a poor estimate, only makes ``Δδ`` less concentrated (more
data per decision), never the target different from plain austerity's.

*What it changes, and the cost.* With tight points at the MAP, ``δ_i`` is second order
in the distance from the tight point, so for moves of posterior size (``‖θ′ − θ‖``
∝ 1/√N, which warm-up adaptation gives) ``sd(Δδ) = O(1/N)`` while the gap
``mean(l) − μ₀`` is also ``O(1/N)``: the rows a decision needs no longer grow with N
(plain austerity's ``sd(l) = O(1/√N)`` makes them grow almost linearly). The price:
one MAP search and one pass to set the tight points and sum the bound statistics at
set-up (``info["setup_queries"]``, ``info["setup_seconds"]``), one float (or ``K``)
of tight point per row on the shards, and the bound evaluated beside ``ℓ`` on the
rows a decision draws (counted as no extra likelihood queries: the bound is not
``L_n``). Works for every model (each has ``logbound`` and ``suffstats``).

``control_variates=False`` is the plain sampler, draw for draw what it was before the
option existed (same streams, same arithmetic).

Minibatches across shards
-------------------------
Each chain's decision draws its rows on the driver, keyed by row: the rows of decision
``d`` of chain ``c`` are, in order, a keyed pseudo-random permutation of all ``N`` rows
(:func:`flymc_dist.streams.permuted_rows`, keyed by ``(seed, c, d)``); a test round
takes the next ``batch_size`` of them, so the batches are a simple random sample of
all ``N`` rows without replacement, whatever the shards, at O(rows drawn) — no O(N)
work per decision. The driver sends each row to the shard holding it: one round trip
per test round (:meth:`call_some` to the shards that hold drawn rows), carrying every
still undecided chain. The shard side lives in :mod:`flymc_dist.austerity.shard`, run
as the shard operation :func:`~flymc_dist.austerity.shard.shard_batch`
(:meth:`flymc_dist.shard.Shard.operation`): it returns each row's ``l_i`` (``Δδ_i``
with control variates), each computed from its row alone, and keeps no state.

The driver computes each round's ``(count, mean, M2)`` over the chain's new
differences in the order they were drawn and merges it with Chan et al.'s pairwise
update — the same information as ``(n, Σl, Σl²)`` without the cancellation of
``Σl² − n l̄²``. Rows, sums and decisions are therefore the same bits for every
partition of the rows into shards, in-process or on any workers.

Randomness (layout-independent): the proposal and ``u`` of chain ``c`` come from
``stream(seed, ROLE_AUSTERITY, 0, c)`` (``P`` standard normals, then one standard
exponential ``−log u``, in that order, every iteration, as the RWMH kernel draws);
the rows of its decision ``d`` from the permutation keyed by
``stream_key(seed, 0, c, d, A_ROWS)``.

Statistics per iteration: ``accepted``; ``acceptance_rate`` (the decision as 0.0/1.0 —
the MH probability is never computed); ``data_used`` and ``n_bright`` (rows in the
decision); ``likelihood_queries`` (``ℓ_i`` at ``θ`` and at ``θ′`` of every row the shards
computed: the decision's, and the rest of its last trip's minibatches — fewer than the
decision's with ``min_batches = 1``, fewer than twice them in general);
``round_trips`` (trips to the shards of the iteration, shared by all chains, as for the
other algorithms: a trip carries several minibatches of each undecided chain, doubling
from trip to trip, see :meth:`SequentialTester._decide`); ``test_rounds`` (minibatches
this chain's test took); ``lp`` (NaN: the full-data log joint is never computed).

Cost and limits: the driver holds nothing per row (a decision's next rows are the next
positions of its permutation). ``info["setup_queries"]`` counts the
full passes of the MAP search (``N`` per pass). Out of core (``out_of_core``, as for
FlyMC) a shard reads each test round's rows from its store (:meth:`Shard.rows_at`):
the store chunks they touch, each decoded whole — of ``m`` chunks, ``b`` scattered rows
touch ``m (1 − (1 − 1/m)^b)``, so a round of more rows than the shard has chunks costs
about a full pass of reading (``info["bytes_read"]``), where in memory it costs ``b``
rows. The rows, and so the decisions and draws, are those of the same run in memory.

Faults: when a worker is lost during a test round, its shards are reopened on live
workers (their tight points set again) and the decision in progress starts over as a
new one (every row unseen again).
The moment of a fault does not depend on the data, so the restarted test is distributed
as a fresh one and the sampler is unchanged; the draws differ from a run without the
fault (the restarted decision draws from a new permutation). Recoveries are listed in
``info["recoveries"]``, the restarted decisions counted in
``info["restarted_decisions"]`` and the queries of their abandoned attempts in
``info["restarted_queries"]``.

Kernels: only RWMH. A MALA proposal needs the full-data gradient (a minibatch
gradient would make ``q(θ′|θ)`` itself random and the ratio wrong); slice sampling
takes no accept/reject decision to test.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import stdtr, stdtrit

from flymc_dist._numerics import by_range
from flymc_dist.austerity.shard import shard_batch, shard_exact_diff
from flymc_dist.kernels.base import KernelInfo
from flymc_dist.kernels.rwmh import RandomWalkMH
from flymc_dist.layout import shard_layout
from flymc_dist.models.base import BoundStats, Model
from flymc_dist.options import Austerity, Placement, RunSettings
from flymc_dist.progress import SetupProgress, load_note, map_search_rows
from flymc_dist.protocol import ShardConfig, ShardLost, ShardSpec, Transport, operation_name
from flymc_dist.result import Result
from flymc_dist.rng import ROLE_AUSTERITY, stream
from flymc_dist.run import describe_run, run, storage_info
from flymc_dist.streams import A_ROWS, permuted_rows, stream_key
from flymc_dist.transport.dask import open_transport
from flymc_dist.tune import (
    find_map,
    flat_prior_to_check,
    initial_positions,
    needs_map,
    preconditioner,
    tight_bounds,
)

#: the shard operations this sampler runs (:mod:`flymc_dist.austerity.shard`), by name
OP_BATCH = operation_name(shard_batch)
OP_EXACT_DIFF = operation_name(shard_exact_diff)

__all__ = [
    "AUSTERITY_STATS",
    "AusteritySampler",
    "Decisions",
    "TRIP_ROWS",
    "SequentialTester",
    "Taken",
    "bound_difference",
    "decision_data_used",
    "expected_data_used",
    "loglog_slope",
    "batch_stats",
    "run_decisions",
    "running_stats",
    "sample_austerity",
    "stop_rule",
    "take_minibatches",
    "tight_bounds",
]

#: per-iteration statistics of an austerity run, name -> dtype
AUSTERITY_STATS: dict[str, str] = {
    "accepted": "bool",
    "acceptance_rate": "float64",
    "n_bright": "int64",
    "likelihood_queries": "int64",
    "round_trips": "int64",
    "lp": "float64",
    "data_used": "int64",
    "test_rounds": "int64",
}

#: sub-role under ROLE_AUSTERITY of the proposals' streams
_SUB_PROPOSAL = 0


# ==================================================================== driver side
def stop_rule(
    n: np.ndarray,
    mean: np.ndarray,
    m2: np.ndarray,
    mu0: np.ndarray,
    N: int,
    eps: float,
    *,
    tails: str = Austerity.tails,
    rounds: np.ndarray | int | None = None,
    min_batches: int = Austerity.min_batches,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sequential test after a round (vectorised over chains).

    With ``t = (l̄ − μ₀)/s`` and ``T`` Student-t with ``n − 1`` degrees of freedom, the
    test's p-value is ``P(T > |t|)`` (``tails="one"``, the paper's: Chen, Mansinghka &
    Ghahramani 2016, Appendix A, stop when ``|t|`` exceeds ``t⁻¹(1 − eps)``) or
    ``2·P(T > |t|)`` (``tails="two"``); the decision is taken when it is below ``eps``.
    A one-sided ``eps`` is therefore a two-sided ``2·eps``, decision for decision.

    No test runs before ``min_batches`` rounds (the paper's ``k0``) or on fewer than two
    rows; after that a zero sample sd decides at once (``eps > 0``; ``eps = 0`` waits for
    every row). All ``N`` rows used: the exact decision, whatever ``eps``.

    Parameters
    ----------
    n, mean, m2
        Rows used so far, their mean ``l̄`` and sum of squared deviations.
    mu0
        The thresholds ``μ₀``.
    N
        Population size.
    eps
        Test tolerance.
    tails
        ``"one"`` or ``"two"``: which p-value is compared with ``eps``.
    rounds
        Rounds (minibatches) each decision has drawn (None: enough to test).
    min_batches
        Rounds before the first test.

    Returns
    -------
    stop, accept, p_value
        Whether each decision is taken, the decision (``l̄ > μ₀``; meaningful where
        ``stop``), and the test's p-value (0 when all ``N`` rows are used or the sample
        sd is zero, 1 while the test cannot run).
    """
    if tails not in ("one", "two"):
        raise ValueError(f"tails must be 'one' or 'two', not {tails!r}")
    n = np.asarray(n)
    mean = np.asarray(mean, float)
    mu0 = np.asarray(mu0, float)
    exact = n >= N
    ready = n >= 2
    if rounds is not None:
        ready = ready & (np.asarray(rounds) >= min_batches)
    p = np.ones(mean.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        sd = np.sqrt(np.asarray(m2, float) / (n - 1))
        fpc = np.sqrt(np.clip(1.0 - (n - 1) / max(N - 1, 1), 0.0, None))
        s = sd / np.sqrt(n) * fpc
        t = (mean - mu0) / s
        can = ready & (sd > 0) & (s > 0) & ~exact
        one = stdtr(np.maximum(n - 1, 1), -np.abs(t))
        p = np.where(can, one if tails == "one" else 2.0 * one, p)
    zero_sd = ready & (sd == 0) & ~exact & (eps > 0)
    p = np.where(exact | zero_sd, 0.0, p)
    infinite = ~np.isfinite(mean) | ~np.isfinite(mu0)
    stop = exact | zero_sd | (p < eps) | infinite
    accept = mean > mu0
    return stop, accept, p


#: grid points per standard deviation of a stage's Gaussian step in the recursion of
#: :func:`expected_data_used` (Simpson's rule): 4 is within 3·10⁻⁵ (relative) of 16 on
#: the expected rows, at N = 10³–10⁵, minibatches of 1–100 rows and θ = 0–10
_POINTS_PER_SD = 4
#: the recursion stops once every decision's P(undecided) is below this (the rows left
#: then add less than N times it)
_UNDECIDED_TOL = 1e-12


def expected_data_used(
    mu: ArrayLike,
    sigma: ArrayLike,
    mu0: ArrayLike,
    N: int,
    *,
    batch_size: int = Austerity.batch_size,
    min_batches: int = Austerity.min_batches,
    eps: float = Austerity.eps,
    tails: str = Austerity.tails,
) -> np.ndarray:
    """Expected rows the sequential test uses for one decision (Korattikara et al. 2014).

    The population is ``N`` values ``l_i`` with mean ``mu`` and population sd ``sigma``
    (``σ² = Σ (l_i − μ)² / N``), the threshold ``mu0``; the test is :func:`stop_rule`'s:
    minibatches of ``batch_size`` rows drawn without replacement, nested (stage ``j`` has
    used ``n_j = min(j·m, N)`` rows), no test before ``min_batches`` of them nor on fewer
    than two rows, stop when the p-value of ``t = (l̄_j − μ₀)/s_j`` is below ``eps``
    (``s_j = sd/√n_j · √(1 − (n_j − 1)/(N − 1))``), all ``N`` rows: the exact decision.
    This is Korattikara, Chen & Welling's (2014) analysis of the test's error and data use
    (the expected rows, their Eq. 19), computed by a numerical recursion over the stages.

    *Approximations* (theirs): the nested means ``l̄_j`` are jointly Gaussian with the
    moments of sampling without replacement, and the sample sd is replaced by its
    population value ``S = σ·√(N/(N − 1))`` (the sd with ``N − 1``, which the sample sd,
    ``n − 1`` in its denominator, estimates without bias). The test then stops at stage
    ``j`` iff ``|l̄_j − μ₀| > c_j · S/√n_j · √((N − n_j)/(N − 1))``, with ``c_j`` the
    Student-t quantile ``t⁻¹_{n_j−1}(1 − eps)`` (``tails="one"``) or
    ``t⁻¹_{n_j−1}(1 − eps/2)`` (``"two"``). A sample sd of zero (which stops
    :func:`stop_rule` at once) is not modelled, except ``sigma = 0``: every sample sd is
    zero and the first test decides.

    *The chain.* With ``x_j = l̄_j − μ₀``, sampling without replacement gives
    ``E x_j = μ − μ₀``, ``v_j = Var l̄_j = σ²(N − n_j)/(n_j(N − 1))`` and, for nested
    samples, ``Cov(l̄_i, l̄_j) = v_j`` (``n_i ≤ n_j``: the later, smaller variance; the
    ``n_j − n_i`` new rows are correlated ``−σ²/(N − 1)`` with each old one). Rescale to
    ``w_j = x_j·u_j/σ`` with ``u_j = σ²/v_j = n_j(N − 1)/(N − n_j)``, i.e. ``w_j =
    (N − 1)/(σ(N − n_j)) · Σ_{i ≤ n_j} (l_i − μ₀)``, a rescaled partial sum: then
    ``Cov(w_i, w_j) = u_i u_j v_j/σ² = u_i`` for ``i ≤ j`` and ``E w_j = θ·u_j`` with
    ``θ = (μ − μ₀)/σ``, so ``w`` is a Brownian motion with drift ``θ`` observed at the
    times ``u_j``: a Gauss–Markov chain with independent steps
    ``w_j − w_{j−1} ~ N(θ·Δu_j, Δu_j)``. The stop condition becomes ``|w_j| > b_j =
    c_j·√(N/(N − 1))·√u_j``, free of ``σ``. The sub-density of the undecided,
    ``g_j(w) dw = P(no stop through stage j, w_j ∈ dw)``, obeys

        g_{j0}(w) = φ(w; θu_{j0}, u_{j0})·1{|w| ≤ b_{j0}}                (first test j0)
        g_j(w)    = 1{|w| ≤ b_j} ∫ g_{j−1}(x) φ(w − x; θΔu_j, Δu_j) dx,

    and ``E[rows] = Σ_j n_j P(stop at j) = n_{j0} + Σ_{j0 ≤ j < K} (n_{j+1} − n_j) ∫ g_j``
    (``K``: the last stage, ``n_K = N``, which always decides). The drift enters only as
    the likelihood ratio of a path (Girsanov: the stopping region does not depend on
    ``θ``), ``g_j^θ(w) = g_j^0(w)·exp(θw − θ²u_j/2)``, so one driftless recursion serves
    every decision of a call. It is computed on a grid of each stage's interval
    ``[−b_j, b_j]`` by Simpson's rule, with ``_POINTS_PER_SD`` points per sd of the
    neighbouring steps (``Δu``: within 3·10⁻⁵ of a grid four times finer), the step's
    Gaussian cut at ±9 sd; the tilt is at most ``exp(b_j²/(2u_j)) ≈ exp(c_j²/2)`` on the
    grid (15 at ``c = 2.33``), so it amplifies the grid's error little. Cost: about 72
    Gaussian evaluations per grid point and stage (``G_j ≲ 8·c_j·√(N/(4m))`` points),
    0.15 s at ``N = 10⁵`` with ``m = 100`` (1,000 stages), plus ``G_j`` per decision and
    stage; it grows as ``(N/m)^1.5`` and ends early once every decision is decided with
    probability ``1 − 10⁻¹²``.

    Parameters
    ----------
    mu, sigma, mu0
        Population mean and population sd (``ddof = 0``) of each decision's ``l_i``, and
        its threshold ``μ₀`` (broadcast together: one expectation per decision).
    N
        Population size (rows).
    batch_size, min_batches, eps, tails
        The test's settings, as :class:`~flymc_dist.options.Austerity` takes them.

    Returns
    -------
    numpy.ndarray
        Expected rows used per decision (float, the broadcast shape; ``N`` where the
        test never stops early, ``0`` where ``mu0`` is infinite: such a decision takes
        no row).

    Raises
    ------
    ValueError
        ``N`` not a positive integer, bad test settings, a non-finite ``mu`` or
        ``sigma``, a negative ``sigma`` or a NaN ``mu0``.
    """
    if isinstance(N, bool) or not isinstance(N, int | np.integer) or N < 1:
        raise ValueError(f"N must be a positive integer, not {N!r}")
    N = int(N)
    m = _check_batch_size(batch_size)
    eps = _check_eps(eps)
    # validated as the options are (the same messages)
    opts = Austerity(tails=tails, min_batches=min_batches)
    tails, min_batches = opts.tails, opts.min_batches
    try:
        mu, sigma, mu0 = np.broadcast_arrays(
            np.asarray(mu, float), np.asarray(sigma, float), np.asarray(mu0, float)
        )
    except ValueError as e:
        raise ValueError(f"mu, sigma and mu0 must broadcast together: {e}") from None
    if not np.all(np.isfinite(mu)):
        raise ValueError("mu must be finite")
    if not np.all(np.isfinite(sigma)) or np.any(sigma < 0):
        raise ValueError("sigma must be finite and >= 0")
    if np.any(np.isnan(mu0)):
        raise ValueError("mu0 must not be NaN")
    n = np.minimum(np.arange(1, -(-N // m) + 1, dtype=np.int64) * m, N)  # n_1 … n_K = N
    tested = np.flatnonzero((np.arange(1, n.size + 1) >= min_batches) & (n >= 2) & (n < N))
    out = np.full(mu.shape, float(N))
    if eps == 0 or not tested.size:
        out[np.isinf(mu0)] = 0.0
        return out
    j0 = int(tested[0])  # 0-based: the stages j0 … K−2 are tested, K−1 is exact
    nt = n[j0:-1].astype(float)
    u = nt * (N - 1) / (N - nt)
    q = eps if tails == "one" else eps / 2
    b = -stdtrit(nt - 1, q) * math.sqrt(N / (N - 1)) * np.sqrt(u)
    steps = np.diff(n[j0:]).astype(float)  # rows added after each tested stage
    finite = np.isfinite(mu0)
    zero = finite & (sigma == 0)
    live = finite & ~zero
    theta = np.where(live, (mu - np.where(finite, mu0, 0.0)) / np.where(live, sigma, 1.0), 0.0)
    th = theta[live]
    alive = np.zeros((th.size, u.size))  # P(undecided after stage j0 + k), per decision
    du = np.diff(u, prepend=0.0)  # the first: w_{j0}'s variance u_{j0}
    # each stage's grid resolves the step into it and the step out of it
    sd = np.sqrt(np.minimum(du, np.append(du[1:], np.inf)))
    x = wts = g = None
    for k in range(u.size):
        half = max(1, math.ceil(b[k] * _POINTS_PER_SD / sd[k]))
        w = np.linspace(-b[k], b[k], 2 * half + 1)
        simpson = np.full(w.size, 2.0)
        simpson[1::2] = 4.0
        simpson[[0, -1]] = 1.0
        simpson *= (w[1] - w[0]) / 3.0
        if k == 0:
            g = np.exp(-0.5 * w**2 / u[0]) / math.sqrt(2 * math.pi * u[0])
        else:
            # the step's Gaussian over the previous grid, within ±9 sd of each node (a
            # band of source nodes per node: both grids are uniform)
            step = math.sqrt(du[k])
            width = min(x.size, math.ceil(18 * step / (x[1] - x[0])) + 2)
            lo = np.clip(np.searchsorted(x, w - 9 * step), 0, x.size - width)
            at = lo[:, None] + np.arange(width)[None, :]
            z = (w[:, None] - x[at]) / step
            kernel = np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi * du[k])
            g = np.einsum("ik,ik->i", kernel, (wts * g)[at])
        x, wts = w, simpson
        with np.errstate(divide="ignore", over="ignore"):
            logmass = np.log(wts * g)
            # log of g^θ = g^0·exp(θw − θ²u/2), written w²/2u − (w − θu)²/2u (no inf − inf)
            tilt = (w**2)[None, :] - (w[None, :] - th[:, None] * u[k]) ** 2
            alive[:, k] = np.exp(logmass[None, :] + tilt / (2 * u[k])).sum(axis=1)
        if k and not np.any(alive[:, k] > _UNDECIDED_TOL):
            break  # every decision decided: P(undecided) only falls from here
    rows = n[j0] + np.clip(alive, 0.0, 1.0) @ steps
    out[live] = rows
    out[zero] = float(n[j0])
    out[~finite] = 0.0
    return out


#: the most rows one round trip of a test asks the shards for, over all chains (its
#: minibatches grow by doubling up to it): what the shards read and compute at once
TRIP_ROWS = 2**16


class Decisions(NamedTuple):
    """The outcome of one sequential test per slot (chain)."""

    accept: np.ndarray  # (S,) bool
    data_used: np.ndarray  # (S,) int64: rows in the decision
    rounds: np.ndarray  # (S,) int64: test rounds each slot took part in
    round_trips: int  # round trips of the whole call (shared by all slots)
    mean: np.ndarray  # (S,) l̄ over the rows used (control variates: Δδ̄ + Σ_all Δβ / N)
    p_value: np.ndarray  # (S,) p-value at the stop (0 when exact)
    rows: list | None  # per slot, per round: global row indices (record_rows only)
    evaluated: np.ndarray  # (S,) int64: rows the shards computed (data_used and unused)


class SequentialTester:
    """Driver side of the sequential MH test, for several chains ("slots") at once.

    Parameters
    ----------
    transport
        Reaches the shards (``call_some``); in-process or Dask.
    specs
        The shards (their ids and row ranges).
    slots
        Number of concurrent decisions (chains).
    eps
        Test tolerance (``0`` = exact MH).
    batch_size
        Rows added to each decision per round (the last round may be smaller).
    seed
        Seed of the row permutations.
    tails, min_batches
        The test's p-value (``"one"``: the paper's, or ``"two"``) and the rounds before
        its first test (see :func:`stop_rule`).
    record_rows
        Return the global row indices every decision drew (tests; costs bandwidth).
    bound
        The collapsed bound ``Σ_all β_n(θ)`` of the shards' current tight points (see
        :func:`tight_bounds`): the test then runs on ``Δδ`` with the threshold
        ``μ₀ − Σ_all Δβ / N`` (control variates). None: plain austerity on ``l``.
    """

    def __init__(
        self,
        transport: Transport,
        specs: Sequence[ShardSpec],
        slots: int,
        *,
        eps: float,
        batch_size: int,
        seed: int,
        tails: str = Austerity.tails,
        min_batches: int = Austerity.min_batches,
        record_rows: bool = False,
        bound: BoundStats | None = None,
    ) -> None:
        self.transport = transport
        self.tails = Austerity(tails=tails).tails
        self.min_batches = Austerity(min_batches=min_batches).min_batches
        specs = sorted(specs, key=lambda s: s.shard_id)
        self.shard_ids = np.array([s.shard_id for s in specs], dtype=np.int64)
        self.sizes = np.array([s.stop - s.start for s in specs], dtype=np.int64)
        self.N = int(self.sizes.sum())
        self.slots = int(slots)
        self.eps = _check_eps(eps)
        self.batch_size = _check_batch_size(batch_size)
        self.seed = int(seed)
        self.record_rows = bool(record_rows)
        self.bound = (
            None
            if bound is None
            else BoundStats(
                0.5 * (np.asarray(bound.A, float) + np.asarray(bound.A, float).T),
                np.asarray(bound.b, float),
                float(bound.c),
            )
        )
        #: the shards' first rows and ends, in global shard order (where a row goes)
        self.starts = np.array([s.start for s in specs], dtype=np.int64)
        self.stops = np.array([s.stop for s in specs], dtype=np.int64)
        self.decision = 0
        #: decisions started over after a lost worker's shards were recreated
        self.restarts = 0
        #: rows evaluated by decisions that were started over (their queries: twice that)
        self.restarted_rows = 0

    def decide(self, thetas: np.ndarray, proposals: np.ndarray, mu0: np.ndarray) -> Decisions:
        """One sequential MH test per slot: accept iff the mean of ``l_i`` exceeds ``μ₀``.

        With a ``bound`` (control variates) the test runs on ``Δδ_i`` against
        ``μ₀ − Σ_all Δβ / N``: the same decision at ``n = N``.

        Parameters
        ----------
        thetas, proposals
            ``(S, P)`` current and proposed parameters.
        mu0
            ``(S,)`` thresholds.

        Returns
        -------
        Decisions
        """
        S = self.slots
        thetas = np.asarray(thetas, float).reshape(S, -1)
        proposals = np.asarray(proposals, float).reshape(S, -1)
        mu0 = np.asarray(mu0, float).reshape(S)
        if np.isnan(mu0).any():
            raise FloatingPointError("the MH threshold mu0 is NaN (log prior or log u)")
        shift = None
        if self.bound is not None:
            shift = bound_difference(self.bound, thetas, proposals) / self.N
            with np.errstate(invalid="ignore"):
                mu0 = mu0 - shift
            if np.isnan(mu0).any():
                raise FloatingPointError(
                    "the control-variate threshold is NaN (the collapsed "
                    "bound overflows at a proposal)"
                )
        for _attempt in range(5):
            key = self.decision
            self.decision += 1
            try:
                dec = self._decide(thetas, proposals, mu0, key)
                if shift is not None:  # report the estimate of mean(l), as without
                    dec = dec._replace(mean=dec.mean + shift)
                return dec
            except ShardLost as lost:
                if not lost.workers or not hasattr(self.transport, "recover"):
                    raise
                # The lost shards are reopened on live workers and the test starts over
                # as a new decision (a new permutation, every row unseen again). When a worker dies
                # does not depend on the data, so a restarted test is distributed as a
                # fresh one: the sampler stays what it was.
                self.transport.recover(lost.workers)
                self.restarts += 1
                self.restarted_rows += int(getattr(lost, "rows_used", 0))
        raise ShardLost("giving up after 5 recoveries in one decision")

    def _decide(
        self, thetas: np.ndarray, proposals: np.ndarray, mu0: np.ndarray, key: int
    ) -> Decisions:
        """:meth:`decide` as decision number ``key``.

        A round trip asks for several minibatches of every undecided chain, the next ones
        of its permutation: ``min_batches`` at first (the test cannot stop before), twice
        as many each trip after (all that is left at ``eps = 0``, which never stops
        early). The test then takes them one minibatch at a time, as if each had come
        alone: the same sums and stops, so the same decisions, in a number of trips
        logarithmic in the minibatches a decision takes. A chain that stops part-way leaves
        the rest unused: ``data_used`` counts the rows the test took, ``evaluated`` all the
        rows the shards computed — fewer than twice as many with ``min_batches = 1``, fewer
        than three times in general (a stop at the first minibatch of the second trip,
        which carried ``2 · min_batches``)."""
        S = self.slots
        N, B = self.N, self.batch_size
        n = np.zeros(S, dtype=np.int64)
        evaluated = np.zeros(S, dtype=np.int64)
        mean = np.zeros(S)
        m2 = np.zeros(S)
        rounds = np.zeros(S, dtype=np.int64)
        accept = np.zeros(S, dtype=bool)
        p_val = np.ones(S)
        # a threshold of +inf (θ′ outside the prior's support) rejects; -inf accepts
        done = ~np.isfinite(mu0)
        accept[done] = mu0[done] < 0
        p_val[done] = 0.0
        rows_log: list | None = [[] for _ in range(S)] if self.record_rows else None
        trips = 0
        cv = self.bound is not None
        # each chain's rows in the order of its own keyed permutation of all N rows
        order = [stream_key(self.seed, 0, c, key, A_ROWS) for c in range(S)]
        batches = N if self.eps == 0 else self.min_batches  # minibatches per chain this trip
        while not done.all():
            active = np.flatnonzero(~done)
            # no more than TRIP_ROWS rows in a trip (over the chains), one minibatch at least
            batches = max(1, min(batches, TRIP_ROWS // (B * active.size)))
            drawn = {
                int(c): permuted_rows(
                    order[c], N, int(evaluated[c]), min(batches * B, N - int(evaluated[c]))
                )
                for c in active
            }
            per_shard = self._route(drawn)
            calls = {
                int(self.shard_ids[j]): (OP_BATCH, thetas[sl], proposals[sl], rows, seg, cv)
                for j, (sl, rows, seg, _) in per_shard.items()
            }
            try:
                replies = self.transport.call_some("operation", calls)
            except Exception as e:  # a lost worker: say how many rows this attempt used
                e.rows_used = int(n.sum())
                raise
            trips += 1
            diffs = {c: np.empty(r.size) for c, r in drawn.items()}
            for j, (sl, _, seg, at) in per_shard.items():
                got = np.asarray(replies[int(self.shard_ids[j])], float)
                for i, c in enumerate(sl):
                    diffs[int(c)][at[i]] = got[seg[i] : seg[i + 1]]
            for c, r in drawn.items():
                evaluated[c] += r.size
            # each chain takes its minibatches one at a time, as if each had come alone,
            # until its test stops: the running (n, mean, M2) after each, and the test at
            # each of them in one call
            for c in active.tolist():
                t = take_minibatches(
                    diffs[c], B, n[c], mean[c], m2[c], rounds[c], mu0[c], N, self.eps,
                    tails=self.tails, min_batches=self.min_batches,
                )  # fmt: skip
                if t.nan:
                    raise FloatingPointError("a log-likelihood difference is NaN")
                n[c], mean[c], m2[c], rounds[c] = t.n, t.mean, t.m2, t.rounds
                if rows_log is not None:
                    rows_log[c].extend(drawn[c][i : i + B] for i in range(0, t.taken * B, B))
                if t.stopped:
                    accept[c], p_val[c], done[c] = t.accept, t.p_value, True
            batches *= 2
        return Decisions(accept, n.copy(), rounds, trips, mean, p_val, rows_log, evaluated)

    def _route(
        self, drawn: dict[int, np.ndarray]
    ) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]]:
        """The global rows each chain drew, sent to the shards holding them: per shard
        index ``j``, the chains asking, their shard-local rows (each chain's in its draw
        order), each chain's part of them, and where those rows sit in its draw."""
        per: dict[int, tuple[list[int], list[np.ndarray], list[np.ndarray]]] = {}
        for c, rows in drawn.items():
            for j, at, local_rows in by_range(self.starts, self.stops, rows):
                slots, local, where = per.setdefault(j, ([], [], []))
                slots.append(c)
                local.append(local_rows)
                where.append(at)
        out = {}
        for j in sorted(per):
            slots, local, where = per[j]
            seg = np.cumsum([0] + [r.size for r in local]).astype(np.int64)
            out[j] = (np.array(slots, dtype=np.int64), np.concatenate(local), seg, where)
        return out


def bound_difference(bound: BoundStats, thetas: np.ndarray, proposals: np.ndarray) -> np.ndarray:
    """``Σ_all β_n(θ′) − Σ_all β_n(θ)`` from the collapsed bound, for each row pair.

    Written as ``(θ′ − θ)ᵀA(θ′ + θ) + bᵀ(θ′ − θ)`` (``A`` symmetric), which never forms
    the two large totals (≈ N·log 2 each) whose difference it is, and drops ``c``.

    Parameters
    ----------
    bound
        ``Σ_all β_n(θ) = θᵀAθ + bᵀθ + c`` with ``A`` symmetric.
    thetas, proposals
        ``(S, P)`` current and proposed parameters.

    Returns
    -------
    numpy.ndarray
        ``(S,)`` differences.
    """
    thetas = np.asarray(thetas, float)
    proposals = np.asarray(proposals, float)
    d = proposals - thetas
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sum((d @ bound.A) * (proposals + thetas), axis=-1) + d @ bound.b


def batch_stats(diffs: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(count, mean, M2)`` of each minibatch of a chain's new differences ``diffs`` (in
    the order its decision drew them: the same sums whatever the layout), the minibatches
    its consecutive runs of ``size`` (the last one shorter if they do not divide). An
    infinite ``l_i`` decides alone (the full mean is infinite too): a minibatch's mean
    is then the sum of its infinite ones and M2 zero; NaN stays NaN (the caller reports
    it). Whole minibatches are summed as the rows of one array: numpy adds each row as
    it adds one minibatch alone, so the bits are those of one minibatch at a time."""
    d = np.asarray(diffs, dtype=float)
    k = -(-d.size // size)
    whole = d.size // size
    counts = np.full(k, size, dtype=np.int64)
    mean = np.zeros(k)
    m2 = np.zeros(k)
    if k > whole:
        counts[-1] = d.size - whole * size
    with np.errstate(invalid="ignore", over="ignore"):  # ±inf and NaN: the caller's
        if whole:
            body = d[: whole * size].reshape(whole, size)
            mean[:whole] = body.sum(axis=1) / size
            m2[:whole] = ((body - mean[:whole, None]) ** 2).sum(axis=1)
        # minibatches holding an infinite (or NaN) value, and a shorter last one, alone
        redo = [i for i in range(whole) if not np.isfinite(mean[i])] + list(range(whole, k))
        for i in redo:
            part = d[i * size : (i + 1) * size]
            bad = ~np.isfinite(part)
            if bad.any():
                mean[i] = float(np.sum(part[bad]))
                m2[i] = 0.0
                continue
            mean[i] = float(np.sum(part)) / part.size
            m2[i] = float(np.sum((part - mean[i]) ** 2))
    return counts, mean, m2


def running_stats(
    n: int, mean: float, m2: float, nb: np.ndarray, mean_b: np.ndarray, m2_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One slot's ``(n, mean, M2)`` after each of its batches ``(nb, mean_b, m2_b)`` in
    turn, from ``(n, mean, m2)``: Chan et al.'s pairwise update, batch after batch. An
    infinite batch mean (an infinite ``l_i``) makes the mean infinite (opposite
    infinities give NaN, which the caller reports)."""
    k = len(nb)
    out_n = np.empty(k, dtype=np.int64)
    out_mean = np.empty(k)
    out_m2 = np.empty(k)
    na, ma, m2a = int(n), float(mean), float(m2)
    for i in range(k):
        b, mb, m2bi = int(nb[i]), float(mean_b[i]), float(m2_b[i])
        tot = na + b
        if math.isfinite(mb) and math.isfinite(ma) and b > 0:
            delta = mb - ma
            new_mean = ma + delta * b / tot
            new_m2 = m2a + m2bi + delta * delta * na * b / tot
        else:
            new_mean, new_m2 = ma, m2a
        if b > 0 and not math.isfinite(mb):
            new_mean = mb if math.isfinite(ma) else ma + mb
        na, ma, m2a = tot, new_mean, new_m2
        out_n[i], out_mean[i], out_m2[i] = na, ma, m2a
    return out_n, out_mean, out_m2


class Taken(NamedTuple):
    """One decision after :func:`take_minibatches`: its running ``(n, mean, M2)`` and
    minibatch count, how many of the trip's minibatches it took, whether its test stopped
    (then ``accept`` and ``p_value`` are the decision), and whether a NaN mean came at or
    before that stop (the caller reports it)."""

    n: int
    mean: float
    m2: float
    rounds: int
    taken: int
    stopped: bool
    accept: bool
    p_value: float
    nan: bool


def take_minibatches(
    diffs: np.ndarray,
    size: int,
    n: int,
    mean: float,
    m2: float,
    rounds: int,
    mu0: float,
    N: int,
    eps: float,
    *,
    tails: str,
    min_batches: int,
) -> Taken:
    """A decision takes a trip's differences ``diffs`` one minibatch of ``size`` at a
    time, as if each had come alone, until its test stops: the running statistics after
    each minibatch (:func:`batch_stats`, :func:`running_stats`), then :func:`stop_rule`
    at each of them in one call; the state after the first minibatch at which it stops,
    else after the last."""
    pn, pmean, pm2 = running_stats(n, mean, m2, *batch_stats(diffs, size))
    k = pn.size
    prounds = rounds + np.arange(1, k + 1)
    stop, acc, p = stop_rule(
        pn,
        pmean,
        pm2,
        np.full(k, mu0),
        N,
        eps,
        tails=tails,
        rounds=prounds,
        min_batches=min_batches,
    )
    stops = np.flatnonzero(stop)
    nans = np.flatnonzero(np.isnan(pmean))
    stopped = bool(stops.size)
    j = int(stops[0]) if stopped else k - 1
    nan = bool(nans.size) and (not stopped or stops[0] >= nans[0])
    return Taken(
        int(pn[j]), float(pmean[j]), float(pm2[j]), int(prounds[j]), j + 1, stopped,
        bool(acc[j]), float(p[j]), nan,
    )  # fmt: skip


def _check_eps(eps: Any) -> float:
    try:
        out = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"eps must be a number in [0, 1), not {eps!r}") from None
    if not 0.0 <= out < 1.0:
        raise ValueError(f"eps must be in [0, 1), not {eps!r}")
    return out


def _check_batch_size(batch_size: Any) -> int:
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int | np.integer)
        or batch_size < 1
    ):
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
    return int(batch_size)


# ====================================================================== sampling
class AusteritySampler:
    """Austerity MH's chains, as the one runner (:func:`flymc_dist.run.run`) drives them.

    :meth:`setup` finds the MAP (when the start, the preconditioner or the control
    variates need it), sets the tight points and sums the collapsed bound (control
    variates), and places the chains as the FlyMC driver does; :meth:`step` is one
    sequential-test MH iteration of every chain: RWMH's proposal
    (:meth:`~flymc_dist.kernels.rwmh.RandomWalkMH.propose`, from
    ``stream(seed, ROLE_AUSTERITY, 0, c)``), then one :meth:`SequentialTester.decide`
    for all chains. Not resumable (:meth:`checkpoint` is None).

    Parameters
    ----------
    model, transport, kernel, specs
        The likelihood and prior, the shards, the RWMH kernel, the shard layout.
    n_features, n_rows
        D and N.
    chains, seed
        Number of chains; the seed of every random stream.
    austerity
        The sequential test: its tolerance, its sidedness, the rounds before its first
        test and the rows per round; whether it runs on the gap to MAP-tuned bounds.
    settings
        The start (``init``, ``precondition``, ``map_maxiter``), as for
        :class:`~flymc_dist.driver.Driver`.
    progress
        Shows each set-up pass while it runs (default: nothing shown).
    """

    stat_names = AUSTERITY_STATS

    def __init__(
        self,
        model: Model,
        transport: Transport,
        kernel: RandomWalkMH,
        specs: Sequence[ShardSpec],
        *,
        n_features: int,
        n_rows: int,
        chains: int,
        seed: int,
        austerity: Austerity,
        settings: RunSettings,
        progress: SetupProgress | None = None,
    ) -> None:
        self.model = model
        self.transport = transport
        self.kernel = kernel
        self.specs = list(specs)
        self.n_features = int(n_features)
        self.n_rows = int(n_rows)
        self.chains = int(chains)
        self.seed = int(seed)
        self.eps = austerity.eps
        self.tails = austerity.tails
        self.min_batches = austerity.min_batches
        self.batch_size = austerity.batch_size
        self.control_variates = austerity.control_variates
        self.init = settings.init
        self.precondition = settings.precondition
        self.map_maxiter = int(settings.map_maxiter)
        self.progress = progress if progress is not None else SetupProgress(False)
        self.P = model.n_params(n_features)
        self.param_shape = model.param_shape(n_features)
        self.positions = np.empty((self.chains, self.P))
        self.params: list[Any] = []
        self.theta_map: np.ndarray | None = None
        self.map_info: dict[str, Any] = {}
        self.setup_queries = 0
        self.setup_seconds = 0.0
        self.tester: SequentialTester | None = None
        self.rngs = [stream(seed, ROLE_AUSTERITY, _SUB_PROPOSAL, c) for c in range(self.chains)]

    def setup(self) -> None:
        """MAP (if needed), tight points and collapsed bound (control variates),
        preconditioner and initial positions, as the FlyMC driver does."""
        t0 = time.perf_counter()
        neg_h = None
        if needs_map(self.init, self.precondition, self.control_variates) or flat_prior_to_check(
            self.model
        ):
            with self.progress.phase("MAP search") as shown:
                found = find_map(self.model, self.transport, self.P, maxiter=self.map_maxiter)
                shown.rows, shown.note = map_search_rows(found, self.n_rows)
            self.theta_map, neg_h, self.map_info = found.theta, found.neg_hessian, found.info
            self.setup_queries = found.passes * self.n_rows  # every datum at one θ a pass
        # control variates: tight points at the MAP, as FlyMC's bounds="map" (its accuracy
        # affects how much data a decision needs, never which decision is taken at n = N)
        bound = None
        if self.control_variates:
            with self.progress.phase("bound statistics", self.n_rows):
                bound = tight_bounds(self.transport, self.theta_map)
        chol = preconditioner(self.precondition, neg_h, self.P)
        self.positions = initial_positions(self.init, self.theta_map, chol, self.chains, self.seed)
        self.setup_seconds = time.perf_counter() - t0
        self.tester = SequentialTester(
            self.transport,
            self.specs,
            self.chains,
            eps=self.eps,
            batch_size=self.batch_size,
            seed=self.seed,
            tails=self.tails,
            min_batches=self.min_batches,
            bound=bound,
        )
        self.params = [self.kernel.init_params(self.P, chol) for _ in range(self.chains)]

    def setup_info(self) -> dict[str, Any]:
        """Each shard's storage (in memory or out of core), the MAP and the set-up's cost
        (the full passes of the MAP search)."""
        storage = storage_info(self.transport)
        return {
            "out_of_core": storage["out_of_core"],
            "memory_budget": storage["memory_budget"],
            "setup_bytes_read": storage["bytes_read"],
            "setup_passes": storage["passes"],
            "map": None if self.theta_map is None else self.theta_map.reshape(self.param_shape),
            "map_info": self.map_info,
            "setup_queries": self.setup_queries,
            "setup_seconds": self.setup_seconds,
        }

    def step(self, adapters: list[Any] | None = None) -> dict[str, np.ndarray]:
        """One MH iteration of every chain, each decided by a sequential test."""
        C = self.chains
        positions = self.positions
        props, neg_log_u = self.kernel.propose(self.rngs, positions, self.params)
        log_u = -np.asarray(neg_log_u, float)
        # symmetric proposal: log q(θ′|θ) − log q(θ|θ′) = 0
        mu0 = (log_u + self.model.log_prior(positions) - self.model.log_prior(props)) / self.n_rows
        dec = self.tester.decide(positions, props, mu0)
        self.positions = np.where(dec.accept[:, None], props, positions)
        if adapters is not None:
            for c in range(C):
                a = bool(dec.accept[c])
                self.params[c] = adapters[c].update(
                    KernelInfo(
                        accepted=a,
                        accept_prob=float(a),
                        index=0 if a else -1,
                        n_evals=1,
                        n_requests=int(dec.rounds[c]),
                    )
                )
        return {
            "accepted": dec.accept,
            "acceptance_rate": dec.accept.astype(float),
            "n_bright": dec.data_used,
            "likelihood_queries": 2 * dec.evaluated,
            "round_trips": np.full(C, dec.round_trips, dtype=np.int64),
            "lp": np.full(C, np.nan),
            "data_used": dec.data_used,
            "test_rounds": dec.rounds,
        }

    def checkpoint(self, iteration: int) -> None:
        """None: austerity runs are not resumable (the trace keeps draws, no checkpoint)."""
        return None

    def restore(self, checkpoint: dict[str, Any]) -> None:
        """Refused: austerity runs cannot be resumed."""
        raise ValueError("austerity runs cannot be resumed (no checkpoint is written)")

    def timing(self) -> None:
        """None: no per-round timing breakdown."""
        return None

    def run_info(self, stats: dict[str, np.ndarray]) -> dict[str, Any]:
        """Restarted decisions, the share of the data the kept decisions used, and the
        bytes of rows read from the store (out of core: every touched chunk)."""
        return {
            "bytes_read": storage_info(self.transport)["bytes_read"],
            "restarted_decisions": int(self.tester.restarts),
            "restarted_queries": 2 * int(self.tester.restarted_rows),
            "data_used_fraction": float(stats["data_used"].mean() / self.n_rows),
            "exact_fraction": float((stats["data_used"] >= self.n_rows).mean()),
        }


def sample_austerity(
    model: Model,
    specs: list[ShardSpec] | Callable[[int], list[ShardSpec]],
    mem: dict | None,
    *,
    n_rows: int,
    n_features: int,
    path: str,
    kernel: Any,
    num_warmup: int,
    num_samples: int,
    chains: int,
    seed: int,
    client: Any,
    austerity: Austerity,
    placement: Placement,
    settings: RunSettings,
    feature_names: list[str] | None = None,
    progress: SetupProgress | None = None,
) -> Result:
    """Austerity MH (approximate) — what ``fd.sample(..., algorithm="austerity")`` runs:
    builds an :class:`AusteritySampler` and runs it with :func:`flymc_dist.run.run`.

    Parameters
    ----------
    model
        The likelihood and prior.
    specs, mem
        Shard layout (or the layout for a number of workers: the default, one shard per
        worker) and, for in-memory ``(X, y)``, the rows per shard.
    n_rows, n_features, path
        Data size and where it lives (for ``info``).
    kernel
        The θ-kernel; must be RWMH (its step size and preconditioner are used, and its
        step size adapts during warm-up towards ``target_accept`` from the decisions).
    num_warmup, num_samples, chains, seed, client
        As for :func:`flymc_dist.sample`.
    austerity
        The test: ``eps`` (its tolerance; 0 gives exact MH), ``tails``, ``min_batches``,
        ``batch_size`` and ``control_variates`` (the test runs on the gap to FlyMC's
        MAP-tuned bounds, see the module docstring; False: plain austerity).
    placement
        Where the shards run and how they hold their rows.
    settings
        ``init``, ``precondition``, ``map_maxiter``, ``trace`` (zarr path, written as
        the run goes; ``resume`` is not supported), ``overwrite_trace``, ``progress``.
    feature_names
        The data's column names (for ``info``, the summary and ArviZ), or None.
    progress
        Shows each set-up pass while it runs (default: as ``settings.progress`` says).

    Returns
    -------
    Result
        ``info["algorithm"] == "austerity"``, ``info["approximate"] is True`` (and
        ``Result.approximate``); ``stats`` as listed in the module docstring.

    Raises
    ------
    ValueError
        A kernel other than RWMH, or ``resume``. (``eps``, ``batch_size`` and
        ``control_variates`` were checked when their :class:`~flymc_dist.options.Austerity`
        was made.)
    """
    eps, batch_size = austerity.eps, austerity.batch_size
    tails, min_batches = austerity.tails, austerity.min_batches
    control_variates = austerity.control_variates
    if not isinstance(kernel, RandomWalkMH):
        raise ValueError(
            f"austerity MH supports kernel='rwmh' only, not "
            f"{getattr(kernel, 'name', kernel)!r}: MALA's proposal needs the "
            f"full-data gradient and slice sampling has no MH decision to test"
        )
    if settings.resume:
        raise ValueError("austerity runs cannot be resumed (no checkpoint is written)")
    config = ShardConfig(
        model=model,
        algorithm="austerity",
        chains=chains,
        seed=seed,
        n_rows=n_rows,
        out_of_core=placement.out_of_core,
        memory_budget=placement.memory_budget,
    )
    shown = progress if progress is not None else SetupProgress(settings.progress)
    with shown.phase("load", n_rows) as load:
        load.note = load_note(client, mem)
        transport = open_transport(client, specs, config, mem, placement)
    specs = transport.specs  # as placed: one shard per worker by default
    try:
        sampler = AusteritySampler(
            model,
            transport,
            kernel,
            specs,
            n_features=n_features,
            n_rows=n_rows,
            chains=chains,
            seed=seed,
            austerity=austerity,
            settings=settings,
            progress=shown,
        )
        info = describe_run(
            transport=transport,
            n_shards=len(specs),
            data=path,
            model_description=model.to_dict(),
            chains=chains,
            seed=seed,
            n_rows=n_rows,
            n_features=n_features,
            num_warmup=num_warmup,
            num_samples=num_samples,
            algorithm="austerity",
            approximate=True,
            eps=eps,
            tails=tails,
            min_batches=min_batches,
            batch_size=batch_size,
            control_variates=control_variates,
            bounds="map" if control_variates else None,
            feature_names=feature_names,
            kernel=kernel.name,
            z_update=None,
            q_db=None,
            resample_fraction=None,
        )
        info["lp"] = "not computed (NaN): austerity never evaluates the full likelihood"
        info["channel"] = transport.channel  # how the test trips travel
        return run(sampler, info, num_warmup, num_samples, settings, label="austerity")
    finally:
        transport.close()


def run_decisions(
    model: Model,
    data: Any,
    thetas: np.ndarray,
    proposals: np.ndarray,
    log_u: np.ndarray,
    *,
    eps: float | Sequence[float] = 0.05,
    batch_size: int = 500,
    seed: int = 0,
    n_shards: int | None = None,
    client: Any = "synchronous",
    exact: bool = True,
    control_variates: bool | np.ndarray = False,
    tails: str = Austerity.tails,
    min_batches: int = Austerity.min_batches,
) -> dict[str, Any]:
    """Austerity decisions for given ``(θ, θ′, u)`` triples, scored against exact MH.

    All triples are decided concurrently (as slots of one :class:`SequentialTester`,
    each with its own minibatch streams); with several ``eps`` the same triples and
    the same row streams are reused for each (common random numbers).

    Parameters
    ----------
    model
        The likelihood and prior.
    data
        ``(X, y)`` (synchronous only), a Dataset or its path.
    thetas, proposals
        ``(S, P)`` current and proposed parameters, or ``(P,)`` for one fixed pair used by
        every decision (then ``S = len(log_u)``).
    log_u
        ``(S,)`` log uniforms of the MH decisions.
    eps, batch_size, seed, n_shards, client
        Test tolerance(s), rows per round, seed, shard count, where to run.
    exact
        Also compute the exact decisions (one extra full pass per pair) and error rates.
    control_variates
        False: plain austerity. True: control variates from bounds tight at the MAP
        (found here as the sampler finds it). An array ``(P,)``: bounds tight at that
        estimate instead.
    tails, min_batches
        The test's sidedness and the rounds before its first test (:func:`stop_rule`).

    Returns
    -------
    dict
        ``n_rows``; ``theta_hat`` (the tight points' estimate, or None);
        ``exact_accept`` (S,) and ``exact_mean`` (S,) when ``exact``; and
        ``by_eps``: a list (one per eps) of dicts with ``eps``, ``accept``, ``data_used``,
        ``rounds`` (arrays), ``mean_data_used``, ``fraction``, ``round_trips``,
        ``error_rate`` (when ``exact``).
    """
    log_u = np.asarray(log_u, float).ravel()
    S = log_u.size
    thetas = np.asarray(thetas, float)
    proposals = np.asarray(proposals, float)
    single = thetas.ndim == 1 and proposals.ndim == 1
    if thetas.ndim == 1:
        thetas = np.tile(thetas.ravel(), (S, 1))
    if proposals.ndim == 1:
        proposals = np.tile(proposals.ravel(), (S, 1))
    thetas = thetas.reshape(S, -1)
    proposals = proposals.reshape(S, -1)
    eps_list = [float(eps)] if np.ndim(eps) == 0 else [float(e) for e in eps]
    placement = Placement(n_shards=n_shards)
    specs, mem, N, D, _, _, _ = shard_layout(data, placement)
    config = ShardConfig(model=model, algorithm="austerity", chains=1, seed=seed, n_rows=N)
    transport = open_transport(client, specs, config, mem, placement)
    out: dict[str, Any] = {"n_rows": N, "theta_hat": None, "by_eps": []}
    try:
        bound = None
        if control_variates is not False:
            if isinstance(control_variates, bool | np.bool_):
                theta_hat = _find_map(model, transport, D) if control_variates else None
            else:
                theta_hat = np.asarray(control_variates, float).ravel()
            if theta_hat is not None:
                out["theta_hat"] = theta_hat
                bound = tight_bounds(transport, theta_hat)
        mu0 = (log_u + model.log_prior(thetas) - model.log_prior(proposals)) / N
        if exact:
            k = 1 if single else S  # one fixed pair: one full pass
            parts = transport.call("operation", OP_EXACT_DIFF, thetas[:k], proposals[:k])
            exact_mean = np.broadcast_to(np.sum(np.stack(parts), axis=0) / N, (S,))
            out["exact_mean"] = exact_mean
            out["exact_accept"] = exact_mean > mu0
        for e in eps_list:
            tester = SequentialTester(
                transport,
                specs,
                S,
                eps=e,
                batch_size=batch_size,
                seed=seed,
                tails=tails,
                min_batches=min_batches,
                bound=bound,
            )
            dec = tester.decide(thetas, proposals, mu0)
            row = {
                "eps": e,
                "accept": dec.accept,
                "data_used": dec.data_used,
                "rounds": dec.rounds,
                "mean_data_used": float(dec.data_used.mean()),
                "fraction": float(dec.data_used.mean() / N),
                "round_trips": dec.round_trips,
            }
            if exact:
                row["error_rate"] = float(np.mean(dec.accept != out["exact_accept"]))
            out["by_eps"].append(row)
    finally:
        transport.close()
    return out


def _find_map(model: Model, transport: Transport, n_features: int) -> np.ndarray:
    """The MAP estimate, found as the sampler's set-up finds it."""
    return find_map(model, transport, model.n_params(n_features)).theta


def decision_data_used(
    model: Model,
    data: Any,
    theta: np.ndarray,
    proposal: np.ndarray,
    *,
    n_decisions: int = 200,
    eps: float = 0.05,
    batch_size: int = 500,
    seed: int = 0,
    n_shards: int | None = None,
    client: Any = "synchronous",
) -> dict[str, Any]:
    """Rows used by ``n_decisions`` austerity decisions of one fixed move ``θ → θ′``.

    Each decision has its own ``u`` (from ``seed``) and its own minibatches.

    Returns
    -------
    dict
        ``n_rows``, ``data_used`` (array), ``mean_data_used``, ``fraction``, ``accept``,
        ``exact_accept``, ``error_rate``, ``rounds``, ``round_trips``.
    """
    log_u = -stream(seed, ROLE_AUSTERITY, 3).standard_exponential(n_decisions)
    r = run_decisions(
        model,
        data,
        theta,
        proposal,
        log_u,
        eps=eps,
        batch_size=batch_size,
        seed=seed,
        n_shards=n_shards,
        client=client,
    )
    row = r["by_eps"][0]
    return {
        "n_rows": r["n_rows"],
        "data_used": row["data_used"],
        "mean_data_used": row["mean_data_used"],
        "fraction": row["fraction"],
        "accept": row["accept"],
        "exact_accept": r["exact_accept"],
        "error_rate": row["error_rate"],
        "rounds": row["rounds"],
        "round_trips": row["round_trips"],
    }


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x``."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    return float(np.polyfit(lx, ly, 1)[0])
