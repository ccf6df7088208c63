"""JointDPM's driver: the joint Dirichlet process mixture of logistic experts over shards.

Model (Wade et al.; Chen, Mansinghka & Ghahramani 2016, Sec. 4.2). Rows ``(x_i, y_i)``,
``y_i ∈ {0, 1}``; cluster labels ``z`` from a Chinese restaurant process with concentration
``α ~ Gamma(a, b)``; per cluster ``(μ_k, Σ_k) ~ NIW(m0, k0, v0, S0)`` over the density
columns (collapsed: never sampled) and ``w_k ~ N(0, s²I)``; ``x_i | z_i = k ~ N(μ_k, Σ_k)``
and ``y_i | x_i, z_i = k ~ Bernoulli(σ(w_kᵀ[x_i, 1]))``.

One iteration of a chain (the paper's Fig. 7 program):

1. ``α`` given ``K``: Escobar & West's Gibbs step (auxiliary ``η ~ Beta(α + 1, N)``), or a
   random-walk MH step on ``log α``.
2. Collapsed Gibbs on the labels of ``step_z`` rows drawn uniformly by the driver (with
   replacement; each a valid Gibbs move), in order. Row ``i`` leaves its cluster (a
   rank-one Cholesky downdate of its NIW statistics); ``P(z_i = k) ∝ n_k⁻ⁱ t_k(x_i)
   σ_k(y_i)`` for the clusters, ``∝ α t_0(x_i) σ_aux(y_i)`` for a new one whose weights
   are the auxiliary ``w_aux`` — the emptied cluster's own if ``i`` was alone, else a draw
   from the prior (Neal 2000, algorithm 8 with one auxiliary component); ``t`` is the
   Student-t predictive. It joins the chosen cluster (a rank-one update). No full pass:
   the rows are fetched from their shards in one round trip, the moves sent back in one.
   With ``split_merge`` > 0, that many split–merge proposals follow
   (:mod:`flymc_dist.jointdpm.splitmerge`: whole clusters split or merged by MH, reading
   every member of the clusters concerned).
3. Every cluster's ``w_k`` by a random-walk MH step whose decision is the sequential test
   of :func:`flymc_dist.austerity.sampler.stop_rule` over the cluster's members only:
   minibatches of ``batch_size`` members drawn without replacement — the next positions
   of a keyed permutation of the cluster's ranks in row order
   (:func:`flymc_dist.streams.permuted_rows`, O(1) per member, keyed by the chain, its
   weight step and the cluster) — each rank sent to the shard holding it (the shards'
   member counts in shard order) which finds its member by an order-statistic index
   (:class:`~flymc_dist.jointdpm.shard.MemberIndex`, O(log n)); the population size
   ``N_k``. A round trip carries ``min_batches`` minibatches of every undecided cluster,
   then twice as many each trip (:meth:`JointDPMSampler.decide_weights`): round trips
   logarithmic in the minibatches a decision takes, the decisions those of one minibatch
   at a time. ``eps = 0`` uses all ``N_k`` members in row order (in one round: the test
   could not stop earlier) and is exact MH. All clusters' tests share the round trips. A
   decision's cost is O(b log n) per minibatch of ``b`` members (``n`` rows per shard)
   plus O(shards): sublinear in ``N_k``.

The NIW statistics live on the driver, per cluster, summed at the start along the fixed
block tree of :mod:`flymc_dist.reduce` and then moved point by point with the labels; the
labels live on the shards beside the rows, with a member index per chain.

Randomness: a chain's driver stream ``stream(seed, ROLE_JOINTDPM, 0, chain)`` (α, the
rows to update, the Gibbs draws, the auxiliary weights, the proposals, the uniforms, the
split–merge choices), the initial labels, row-keyed, and each weight decision's member
order, keyed. Nothing random happens on a shard and every value a decision sums is
taken in the decision's own order (its keyed order, or row order), whatever shard it
came from; the shards cut at block boundaries
(:func:`shard_bounds`). So the draws (α, K, labels, weights) are bit-identical for every
number of shards, in process and on any cluster.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numba
import numpy as np
from scipy.special import gammaln

from flymc_dist._compiled import JIT
from flymc_dist._numerics import by_range
from flymc_dist.austerity.sampler import TRIP_ROWS, take_minibatches
from flymc_dist.diagnostics import ess_bulk, rhat
from flymc_dist.jointdpm.niw import ClusterStats, NIWPrior
from flymc_dist.jointdpm.shard import (
    RANK_PURPOSE,
    ROLE_JOINTDPM,
    SUB_DRIVER,
    initial_labels,
    last_labels,
    logit_loglik,
)
from flymc_dist.jointdpm.splitmerge import (
    LAPLACE_STEPS,
    allocate,
    gaussian_draw,
    gaussian_logpdf,
    laplace,
    sums,
)
from flymc_dist.jointdpm.transport import DPMTransport, open_dpm_transport
from flymc_dist.options import JointDPM
from flymc_dist.reduce import block_rows, tree_total_arrays
from flymc_dist.rng import rng_state_from_json, rng_state_to_json, stream
from flymc_dist.streams import permuted_rows, stream_key
from flymc_dist.trace import Trace, TraceLock

__all__ = [
    "ChainState",
    "DPMResult",
    "GibbsTable",
    "JointDPMSampler",
    "MovedLabels",
    "sample_jointdpm",
    "shard_bounds",
]

#: the label of "a new cluster" in the Gibbs step's list of choices
NEW = -1
#: sorted cluster sizes kept per draw (the largest ones)
MAX_SIZES = 32


@dataclass
class ChainState:
    """One chain on the driver: ``α``, each cluster's NIW statistics, weights and member
    count per shard, the next free label, and the weight steps taken (the key of the
    next one's member orders)."""

    alpha: float
    stats: dict[int, ClusterStats]
    w: dict[int, np.ndarray]
    counts: dict[int, np.ndarray]
    next_label: int
    rng: np.random.Generator
    tracked: dict[int, int] = field(default_factory=dict)
    decisions: int = 0


class _Proposal(NamedTuple):
    """What one split–merge proposal concerns: a split (of cluster ``ka`` = ``kb``) or a
    merge (of ``ka`` and ``kb``), chosen by rows or by clusters among ``K``; the members
    of the cluster(s) in row order (``rows``, ``Xd``, ``F``, ``y``; for a merge ``in_a``:
    which are ``ka``'s) and the positions ``ii``, ``jj`` of the two anchors."""

    split: bool
    by_rows: bool
    K: int
    ka: int
    kb: int
    rows: np.ndarray
    Xd: np.ndarray
    F: np.ndarray
    y: np.ndarray
    in_a: np.ndarray | None
    ii: int
    jj: int


class MovedLabels:
    """One chain's labels given by the z-updates, the last per row, kept as two sorted
    arrays (16 bytes a row moved; a dict of Python ints took 48): what a recreated shard
    is given back and what a checkpoint keeps. The moves of the last iterations wait in
    two lists and join the arrays every :data:`FLUSH` moves, or when read.

    Parameters
    ----------
    rows, labels
        Moves to start from (a checkpoint's), in any order; a row given twice keeps its
        last label.
    """

    #: pending moves that join the sorted arrays
    FLUSH = 1 << 16

    __slots__ = ("_labels", "_new_labels", "_new_rows", "_rows")

    def __init__(self, rows: np.ndarray | None = None, labels: np.ndarray | None = None) -> None:
        self._rows = np.empty(0, dtype=np.int64)
        self._labels = np.empty(0, dtype=np.int64)
        self._new_rows: list[int] = [] if rows is None else np.asarray(rows).tolist()
        self._new_labels: list[int] = [] if labels is None else np.asarray(labels).tolist()
        if len(self._new_rows) != len(self._new_labels):
            raise ValueError("moved labels: as many rows as labels are needed")
        self._flush()

    def set(self, row: int, label: int) -> None:
        """Row ``row`` now has label ``label``."""
        self._new_rows.append(row)
        self._new_labels.append(label)
        if len(self._new_rows) >= self.FLUSH:
            self._flush()

    def set_many(self, rows: np.ndarray, label: int) -> None:
        """Rows ``rows`` now all have label ``label``."""
        self._new_rows.extend(np.asarray(rows).tolist())
        self._new_labels.extend([label] * len(rows))
        if len(self._new_rows) >= self.FLUSH:
            self._flush()

    def _flush(self) -> None:
        if not self._new_rows:
            return
        rows = np.concatenate([self._rows, np.array(self._new_rows, dtype=np.int64)])
        labels = np.concatenate([self._labels, np.array(self._new_labels, dtype=np.int64)])
        self._new_rows, self._new_labels = [], []
        self._rows, self._labels = last_labels(rows, labels)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, labels)``: every row moved (sorted) and its last label."""
        self._flush()
        return self._rows, self._labels

    def within(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`arrays` of the rows in ``[start, stop)``."""
        rows, labels = self.arrays()
        a, b = np.searchsorted(rows, [start, stop])
        return rows[a:b], labels[a:b]

    def __len__(self) -> int:
        self._flush()
        return int(self._rows.size)


@numba.njit(**JIT)
def _gibbs_log_weights(
    M: np.ndarray,
    A: np.ndarray,
    const: np.ndarray,
    nu: np.ndarray,
    W: np.ndarray,
    n: np.ndarray,
    xd: np.ndarray,
    f: np.ndarray,
    y: float,
    out: np.ndarray,
) -> None:
    """``out[i] = log n_i + log t_i(xd) + log σ(±W_i·f)`` for each row ``i`` of a
    :class:`GibbsTable` (``A`` lower triangular: ``log t_i(x) = const_i − (ν_i + D)/2 ·
    log1p(‖A_i (x − M_i)‖² / ν_i)``; the logistic term ``−log(1 + e^(−s η))``, ``s = 2y
    − 1``, summed feature by feature as :func:`~flymc_dist.jointdpm.shard.logit_loglik`)."""
    D = xd.size
    sign = 2.0 * y - 1.0
    for i in range(out.size):
        eta = W[i, 0] * f[0]
        for p in range(1, f.size):
            eta = eta + W[i, p] * f[p]
        z = -sign * eta  # log σ(s η) = −logaddexp(0, z)
        ll = -(max(z, 0.0) + math.log1p(math.exp(-abs(z))))
        maha = 0.0
        for a in range(D):
            t = 0.0
            for b in range(a + 1):
                t += A[i, a, b] * (xd[b] - M[i, b])
            maha += t * t
        log_t = const[i] - 0.5 * (nu[i] + D) * math.log1p(maha / nu[i])
        out[i] = math.log(n[i]) + log_t + ll


class GibbsTable:
    """One chain's clusters stacked in sorted label order for the Gibbs step, with a last
    row for a new cluster: each cluster's Student-t predictive ``(m, A, const, ν)``
    (:meth:`~flymc_dist.jointdpm.niw.ClusterStats.predictive_terms`), weights and size
    ``n_k`` (the last row: the prior's predictive, the auxiliary weights and ``α``). The
    step moves one row at a time, so it changes one or two rows of the table, not all.

    Parameters
    ----------
    st
        The chain state.
    prior_terms
        An empty cluster's predictive terms.
    P
        Weights per cluster.
    """

    __slots__ = ("A", "M", "W", "const", "labels", "n", "nu", "stale")

    def __init__(self, st: ChainState, prior_terms: tuple, P: int) -> None:
        self.labels = sorted(st.stats)
        terms = [st.stats[k].predictive_terms() for k in self.labels] + [prior_terms]
        self.M = np.stack([t[0] for t in terms])
        self.A = np.stack([t[1] for t in terms])
        self.const = np.array([t[2] for t in terms])
        self.nu = np.array([t[3] for t in terms])
        self.W = np.stack([st.w[k] for k in self.labels] + [np.zeros(P)])
        self.n = np.array([float(st.stats[k].n) for k in self.labels] + [st.alpha])
        #: clusters whose statistics changed since their row was last written
        self.stale: dict[int, ClusterStats] = {}

    def refresh(self, label: int, stats: ClusterStats) -> None:
        """Cluster ``label``'s statistics changed to ``stats`` (its row is rewritten when
        next read: a row left and rejoining its cluster costs one predictive, not two)."""
        self.stale[label] = stats

    def current(self) -> GibbsTable:
        """The table with every changed cluster's row rewritten."""
        for label, stats in self.stale.items():
            i = bisect_left(self.labels, label)
            self.M[i], self.A[i], self.const[i], self.nu[i] = stats.predictive_terms()
            self.n[i] = stats.n
        self.stale.clear()
        return self

    def drop(self, label: int) -> None:
        """Cluster ``label`` emptied."""
        self.stale.pop(label, None)
        i = bisect_left(self.labels, label)
        del self.labels[i]
        self.M, self.A, self.const, self.nu, self.W, self.n = (
            np.delete(a, i, axis=0) for a in (self.M, self.A, self.const, self.nu, self.W, self.n)
        )

    def append(self, label: int, w: np.ndarray) -> None:
        """A new cluster ``label`` (above every label) with weights ``w``, empty; its
        statistics come by :meth:`refresh`."""
        self.labels.append(label)
        self.M, self.A, self.const, self.nu, self.W, self.n = (
            np.insert(a, -1, a[-1], axis=0)
            for a in (self.M, self.A, self.const, self.nu, self.W, self.n)
        )
        self.W[-2] = w


class JointDPMSampler:
    """The driver of JointDPM's chains over a :class:`DPMTransport`'s shards.

    Parameters
    ----------
    options
        The model and sampler settings.
    transport
        The shards.
    bounds
        The shards' row ranges (``bounds[j] .. bounds[j + 1]``).
    n_features
        Columns of ``X`` (the weights have one more: the bias).
    chains, seed
        Chains and the seed of every stream.
    tracked_rows
        Rows whose labels the driver follows (co-clustering of row pairs).
    record_rows
        Keep the global rows each ``w_k`` decision used (tests).
    """

    def __init__(
        self,
        options: JointDPM,
        transport: DPMTransport,
        bounds: np.ndarray,
        n_features: int,
        *,
        chains: int,
        seed: int,
        tracked_rows: np.ndarray | None = None,
        record_rows: bool = False,
    ) -> None:
        self.options = options
        self.transport = transport
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.n_shards = self.bounds.size - 1
        self.N = int(self.bounds[-1])
        self.block = block_rows(self.N)
        self.n_blocks = -(-self.N // self.block)
        if (
            self.bounds[0] != 0
            or np.any(np.diff(self.bounds) <= 0)
            or np.any(self.bounds[1:-1] % self.block)
        ):
            raise ValueError(
                f"bounds must rise from 0 and cut at multiples of {self.block} rows "
                f"(flymc_dist.reduce.block_rows), not {self.bounds.tolist()}"
            )
        self.n_features = int(n_features)
        cols = options.density_columns
        self.density_columns = list(range(n_features)) if cols is None else list(cols)
        if max(self.density_columns) >= n_features:
            raise ValueError(
                f"density_columns {options.density_columns} name a column beyond the "
                f"data's {n_features}"
            )
        self.D = len(self.density_columns)
        self.P = self.n_features + 1
        k0, extra = options.niw
        self.prior = NIWPrior.paper(self.D, k0, extra)
        self.prior_stats = ClusterStats(self.prior)
        self.chains = int(chains)
        self.seed = int(seed)
        self.tracked_rows = (
            np.empty(0, np.int64) if tracked_rows is None else np.asarray(tracked_rows, np.int64)
        )
        self.record_rows = bool(record_rows)
        self.states: list[ChainState] = []
        #: per chain, the label of every row the z-updates have moved (the others hold
        #: their row-keyed initial label): what a recreated shard is given back
        self.known = [MovedLabels() for _ in range(self.chains)]
        transport.on_recreate = self.restore_calls
        #: the rows each w decision of the last step used, per chain (record_rows)
        self.last_rows: list[dict[int, np.ndarray]] = []

    # ---------------------------------------------------------------- set-up
    def setup(self) -> None:
        """Initial labels (row-keyed, ``init_clusters`` of them), their NIW statistics
        summed by the fixed block tree (:mod:`flymc_dist.reduce`: the same sums in every
        layout), weights and ``α`` from their priors."""
        a, b = self.options.alpha_prior
        self.states = []
        L, D = self.options.init_clusters, self.D
        for c in range(self.chains):
            rng = stream(self.seed, ROLE_JOINTDPM, SUB_DRIVER, c)
            replies = self.transport.call_all("init_labels", c, L, self.block, self.n_blocks)
            total = tree_total_arrays([(nodes, sums) for _, nodes, sums in replies])
            counts: dict[int, np.ndarray] = {}
            stats: dict[int, ClusterStats] = {}
            for k in range(L):
                n = int(round(total[k, 0]))
                if n == 0:
                    continue
                sx, sxx = total[k, 1 : 1 + D], total[k, 1 + D :].reshape(D, D)
                stats[k] = ClusterStats.from_sums(self.prior, n, sx, sxx)
                counts[k] = np.array([rep[0].get(k, 0) for rep in replies], dtype=np.int64)
            w = {k: self.options.w_prior * rng.standard_normal(self.P) for k in sorted(stats)}
            alpha = float(rng.gamma(a, 1.0 / b))
            st = ChainState(alpha, stats, w, counts, max(stats) + 1, rng)
            if self.tracked_rows.size:
                _, _, _, z = self._fetch(c, self.tracked_rows)
                st.tracked = {int(r): int(k) for r, k in zip(self.tracked_rows, z, strict=True)}
            self.states.append(st)

    def restore_calls(self, shard: int) -> list[tuple[str, tuple]]:
        """The calls that give a recreated shard every chain's labels: the row-keyed
        initial ones, overwritten by those the z-updates gave (:attr:`known`) — the
        shard's exact state, so the chains go on as if it had never been lost."""
        a, b = int(self.bounds[shard]), int(self.bounds[shard + 1])
        out = []
        for c in range(self.chains):
            z = initial_labels(self.seed, c, a, b - a, self.options.init_clusters)
            rows, labels = self.known[c].within(a, b)
            z[rows - a] = labels
            out.append(("restore", (c, z)))
        return out

    def state_dict(self) -> dict[str, Any]:
        """Every chain's state as JSON-like values (a trace's checkpoint): α, each
        cluster's NIW statistics (``n, k, v, m, L`` as they stand, so that a resumed chain
        computes with the very same numbers), weights, the next label, the driver
        stream, the tracked rows' labels and every label the z-updates gave."""
        out = []
        for c, st in enumerate(self.states):
            labels = sorted(st.stats)
            known_rows, known_labels = self.known[c].arrays()
            out.append(
                {
                    "alpha": st.alpha,
                    "labels": np.array(labels, dtype=np.int64),
                    "n": np.array([st.stats[k].n for k in labels], dtype=np.int64),
                    "k": np.array([st.stats[k].k for k in labels]),
                    "v": np.array([st.stats[k].v for k in labels]),
                    "m": np.stack([st.stats[k].m for k in labels]),
                    "L": np.stack([st.stats[k].L for k in labels]),
                    "w": np.stack([st.w[k] for k in labels]),
                    "next_label": st.next_label,
                    "decisions": st.decisions,
                    "rng": rng_state_to_json(st.rng.bit_generator.state),
                    "tracked": np.array(
                        [st.tracked[int(r)] for r in self.tracked_rows], dtype=np.int64
                    ),
                    "known_rows": known_rows.copy(),
                    "known_labels": known_labels.copy(),
                }
            )
        return {"chains": out}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (instead of :meth:`setup`): the
        chains as they were, every shard given back its labels (:meth:`restore_calls`),
        the member counts read from the shards."""
        chains = state["chains"]
        if len(chains) != self.chains:
            raise ValueError(f"the state holds {len(chains)} chains, not {self.chains}")
        self.states = []
        for c, ch in enumerate(chains):
            self.known[c] = MovedLabels(ch["known_rows"], ch["known_labels"])
            stats: dict[int, ClusterStats] = {}
            w: dict[int, np.ndarray] = {}
            for i, k in enumerate(np.asarray(ch["labels"]).tolist()):
                cs = ClusterStats(self.prior)
                cs.n, cs.k, cs.v = int(ch["n"][i]), float(ch["k"][i]), float(ch["v"][i])
                cs.m = np.array(ch["m"][i], dtype=float)
                cs.L = np.array(ch["L"][i], dtype=float)
                stats[k], w[k] = cs, np.array(ch["w"][i], dtype=float)
            rng = np.random.default_rng()
            rng.bit_generator.state = rng_state_from_json(ch["rng"])
            tracked = dict(
                zip(self.tracked_rows.tolist(), np.asarray(ch["tracked"]).tolist(), strict=True)
            )
            st = ChainState(
                float(ch["alpha"]),
                stats,
                w,
                {},
                int(ch["next_label"]),
                rng,
                tracked,
                int(ch["decisions"]),
            )
            self.states.append(st)
        for j in range(self.n_shards):
            calls = self.restore_calls(j)
            for method, args in calls:
                self.transport.call_some(method, {j: args})
        for c, st in enumerate(self.states):
            per = self.transport.call_all("counts", c)
            st.counts = {k: np.array([p.get(k, 0) for p in per], dtype=np.int64) for k in st.stats}
            if any(int(st.counts[k].sum()) != st.stats[k].n for k in st.stats):
                raise ValueError("the state's cluster sizes disagree with its labels")

    def _shard_of(self, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.bounds, rows, side="right") - 1

    def _fetch(
        self, chain: int, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(Xd, F, y, z)`` of global ``rows`` (in their order), one round trip."""
        sh = self._shard_of(rows)
        calls = {int(j): (chain, rows[sh == j] - self.bounds[j]) for j in np.unique(sh).tolist()}
        got = self.transport.call_some("rows", calls)
        Xd = np.empty((rows.size, self.D))
        F = np.empty((rows.size, self.P))
        y = np.empty(rows.size)
        z = np.empty(rows.size, dtype=np.int64)
        for j, (xd, f, yy, zz) in got.items():
            m = sh == j
            Xd[m], F[m], y[m], z[m] = xd, f, yy, zz
        return Xd, F, y, z

    # ---------------------------------------------------------------- one iteration
    def step(self) -> list[dict[str, Any]]:
        """One iteration of every chain: α, ``step_z`` labels, every cluster's weights."""
        out = []
        self.last_rows = []
        for c, st in enumerate(self.states):
            t0 = time.perf_counter()
            self.update_alpha(st)
            moved = self._update_z(c, st)
            split_merged = sum(self.split_merge(c, st) for _ in range(self.options.split_merge))
            info = self._update_weights(c, st)
            info["moved"] = moved
            info["split_merged"] = split_merged
            info["seconds"] = time.perf_counter() - t0
            out.append(info)
        return out

    def update_alpha(self, st: ChainState) -> None:
        """Move chain state ``st``'s α given its number of clusters K: Escobar & West's
        Gibbs step, or a random-walk MH step on log α (``alpha_update``)."""
        a, b = self.options.alpha_prior
        K, N, rng = len(st.stats), self.N, st.rng
        if self.options.alpha_update == "escobar-west":
            eta = rng.beta(st.alpha + 1.0, N)
            rate = b - math.log(eta)
            odds = (a + K - 1.0) / (N * rate)
            shape = a + K if rng.random() < odds / (1.0 + odds) else a + K - 1.0
            st.alpha = float(rng.gamma(shape, 1.0 / rate))
            return

        def log_target(log_alpha: float) -> float:
            al = math.exp(log_alpha)
            return (
                (a - 1.0) * log_alpha
                - b * al
                + K * log_alpha
                + gammaln(al)
                - gammaln(al + N)
                + log_alpha
            )  # the Jacobian of log α

        cur = math.log(st.alpha)
        prop = cur + 0.5 * rng.standard_normal()
        if log_target(prop) - log_target(cur) > -rng.standard_exponential():
            st.alpha = math.exp(prop)

    def gibbs_table(self, st: ChainState) -> GibbsTable:
        """Chain state ``st``'s clusters as the Gibbs step reads them (:class:`GibbsTable`)."""
        return GibbsTable(st, self.prior_stats.predictive_terms(), self.P)

    def z_log_weights(
        self, table: GibbsTable, xd: np.ndarray, f: np.ndarray, y: float, w_aux: np.ndarray
    ) -> tuple[list[int], np.ndarray]:
        """The Gibbs step's choices for a row that has left its cluster, and their log
        weights: ``log n_k⁻ⁱ + log t_k(x) + log σ_k(y)`` for each cluster of ``table``
        (sorted labels), ``log α + log t_0(x) + log σ_aux(y)`` for a new one (:data:`NEW`,
        last)."""
        table = table.current()
        table.W[-1] = w_aux
        out = np.empty(table.n.size)
        _gibbs_log_weights(table.M, table.A, table.const, table.nu, table.W, table.n, xd, f, y, out)
        return [*table.labels, NEW], out

    def _update_z(self, c: int, st: ChainState) -> int:
        """Collapsed Gibbs on ``step_z`` random rows; returns how many changed cluster."""
        rng = st.rng
        rows = rng.integers(0, self.N, self.options.step_z)
        Xd, F, Y, Z = self._fetch(c, rows)
        current: dict[int, int] = {}
        sh = self._shard_of(rows)
        new_labels = np.empty(rows.size, dtype=np.int64)
        moved = 0
        table = self.gibbs_table(st)
        for i, r in enumerate(rows.tolist()):
            old = current.get(r, int(Z[i]))
            xd, f, y, j = Xd[i], F[i], float(Y[i]), int(sh[i])
            s_old = st.stats[old]
            s_old.remove(xd)
            st.counts[old][j] -= 1
            w_aux = self.options.w_prior * rng.standard_normal(self.P)
            if s_old.n == 0:  # algorithm 8: the emptied cluster's weights are the auxiliary
                w_aux = st.w.pop(old)
                del st.stats[old], st.counts[old]
                table.drop(old)
            else:
                table.refresh(old, s_old)
            labels, lw = self.z_log_weights(table, xd, f, y, w_aux)
            p = np.exp(lw - lw.max())
            cdf = np.cumsum(p)
            pick = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
            new = labels[min(pick, len(labels) - 1)]
            if new == NEW:
                new = st.next_label
                st.next_label += 1
                st.stats[new] = ClusterStats(self.prior)
                st.w[new] = w_aux
                st.counts[new] = np.zeros(self.n_shards, dtype=np.int64)
                table.append(new, w_aux)
            st.stats[new].add(xd)
            table.refresh(new, st.stats[new])
            st.counts[new][j] += 1
            current[r] = new
            self.known[c].set(r, new)
            new_labels[i] = new
            moved += new != old
            if r in st.tracked:
                st.tracked[r] = new
        self._send_moves(c, rows, new_labels)
        return moved

    def _send_moves(self, c: int, rows: np.ndarray, labels: np.ndarray) -> None:
        """Global ``rows`` of chain ``c`` take ``labels`` (in order) on their shards, in
        one round trip."""
        sh = self._shard_of(rows)
        calls = {
            int(j): (c, rows[sh == j] - self.bounds[j], labels[sh == j])
            for j in np.unique(sh).tolist()
        }
        self.transport.call_some("move", calls)

    def _cluster_rows(
        self, c: int, st: ChainState, labels: list[int]
    ) -> list[tuple[np.ndarray, ...]]:
        """Every member of each of clusters ``labels`` of chain ``c``, in row order:
        ``(rows, Xd, F, y)`` per label, in one round trip."""
        where = sorted({j for k in labels for j in np.flatnonzero(st.counts[k]).tolist()})
        got = self.transport.call_some("clusters", {j: (c, labels) for j in where})
        return [
            tuple(np.concatenate([got[j][t][q] for j in where]) for q in range(4))
            for t in range(len(labels))
        ]

    def _split_merge_pair(self, c: int, st: ChainState) -> _Proposal | None:
        """What a split–merge proposal concerns (:mod:`flymc_dist.jointdpm.splitmerge`,
        step 1): chosen by rows or by clusters, with the members of the one or two
        clusters fetched; None where the choice cannot be made (one cluster to merge, a
        one-member cluster to split)."""
        rng = st.rng
        labels = sorted(st.stats)
        K = len(labels)
        by_rows = bool(rng.random() < 0.5)
        if by_rows:  # two distinct rows: a split if they share a cluster, else a merge
            i = int(rng.integers(self.N))
            j = int(rng.integers(self.N - 1))
            j += j >= i
            _, _, _, z = self._fetch(c, np.array([i, j], dtype=np.int64))
            ka, kb = int(z[0]), int(z[1])
            split = ka == kb
        else:  # a split or a merge, then a cluster (two) and two members (one of each)
            split = bool(rng.random() < 0.5)
            if split:
                ka = kb = labels[int(rng.integers(K))]
                if st.stats[ka].n < 2:
                    return None
            else:
                if K < 2:
                    return None
                a_ = int(rng.integers(K))
                b_ = int(rng.integers(K - 1))
                b_ += b_ >= a_
                ka, kb = labels[a_], labels[b_]
        in_a = None
        if split:
            ((rows, Xd, F, y),) = self._cluster_rows(c, st, [ka])
            if by_rows:
                ii, jj = (int(t) for t in np.searchsorted(rows, [i, j]))
            else:  # an ordered pair of members, by rank in row order
                ii = int(rng.integers(rows.size))
                jj = int(rng.integers(rows.size - 1))
                jj += jj >= ii
        else:
            a, b = self._cluster_rows(c, st, [ka, kb])
            order = np.argsort(np.concatenate([a[0], b[0]]), kind="stable")
            rows, Xd, F, y = (np.concatenate([a[q], b[q]])[order] for q in range(4))
            in_a = order < a[0].size
            if by_rows:
                ii, jj = (int(t) for t in np.searchsorted(rows, [i, j]))
            else:  # a member of each, by rank in row order
                at = np.argsort(order)  # where each of a's, then b's members went
                ri, rj = int(rng.integers(a[0].size)), int(rng.integers(b[0].size))
                ii, jj = int(at[ri]), int(at[a[0].size + rj])
        return _Proposal(split, by_rows, K, ka, kb, rows, Xd, F, y, in_a, ii, jj)

    def split_merge(self, c: int, st: ChainState) -> bool:
        """One split–merge proposal on chain ``c`` (:mod:`flymc_dist.jointdpm.splitmerge`);
        returns whether it was accepted."""
        rng, o = st.rng, self.options
        pr = self._split_merge_pair(c, st)
        if pr is None:
            return False
        rest = np.delete(np.arange(pr.rows.size), [pr.ii, pr.jj])
        rest = rest[rng.permutation(rest.size)]
        side = np.empty(rest.size, dtype=np.int8)
        if pr.split:
            u = rng.random(rest.size)
            forced = np.full(rest.size, -1, dtype=np.int8)
        else:
            u = np.zeros(rest.size)
            forced = np.where(pr.in_a[rest], 0, 1).astype(np.int8)
        p = self.prior
        log_alloc = allocate(
            np.ascontiguousarray(pr.Xd[rest]), pr.Xd[pr.ii], pr.Xd[pr.jj], p.m0, p.k0, p.v0,
            self.prior_stats.L, u, forced, side,
        )  # fmt: skip
        parts = {
            "A": np.sort(np.concatenate([[pr.ii], rest[side == 0]])),
            "B": np.sort(np.concatenate([[pr.jj], rest[side == 1]])),
            "C": np.arange(pr.rows.size),
        }
        # each part's rows (C's: all of them, as they are)
        rows_of = {
            name: (pr.F, pr.y, pr.Xd)
            if name == "C"
            else tuple(np.ascontiguousarray(t[idx]) for t in (pr.F, pr.y, pr.Xd))
            for name, idx in parts.items()
        }
        fit, niw = {}, {}
        for name, (Fi, yi, Xi) in rows_of.items():
            fit[name] = laplace(Fi, yi, o.w_prior, LAPLACE_STEPS)
            niw[name] = ClusterStats.from_sums(p, yi.size, *sums(Xi))
        if pr.split:
            w = {"A": gaussian_draw(rng, *fit["A"]), "B": gaussian_draw(rng, *fit["B"])}
            w["C"] = st.w[pr.ka]
        else:
            w = {"A": st.w[pr.ka], "B": st.w[pr.kb], "C": gaussian_draw(rng, *fit["C"])}
        sd2 = o.w_prior**2
        term = {}
        for name, (Fi, yi, _) in rows_of.items():
            ww = w[name]
            term[name] = (
                gammaln(yi.size)
                + niw[name].log_marginal()
                + float(logit_loglik(Fi, yi, ww).sum())
                - 0.5 * self.P * math.log(2.0 * math.pi * sd2)
                - 0.5 * float(ww @ ww) / sd2
            )
        # how the two directions choose. By rows: the same ordered pair either way. By
        # clusters: a split picks one of the merged state's K_m clusters and an ordered
        # pair of its n_C members; the merge that undoes it, the ordered pair (A, B) of
        # the K_m + 1 clusters and a member of each
        log_choose = 0.0
        if not pr.by_rows:
            K_m = pr.K if pr.split else pr.K - 1
            n_a, n_b, n_c = parts["A"].size, parts["B"].size, pr.rows.size
            log_choose = math.log(n_c * (n_c - 1.0) / ((K_m + 1.0) * n_a * n_b))
        # log of [p(split) q(merge | split)] / [p(merged) q(split | merged)]
        log_r = (
            log_choose
            + math.log(st.alpha)
            + term["A"]
            + term["B"]
            - term["C"]
            + gaussian_logpdf(w["C"], *fit["C"])
            - gaussian_logpdf(w["A"], *fit["A"])
            - gaussian_logpdf(w["B"], *fit["B"])
            - log_alloc
        )
        if (log_r if pr.split else -log_r) <= -rng.standard_exponential():
            return False
        if pr.split:
            new = st.next_label
            st.next_label += 1
            moved = pr.rows[parts["B"]]
            per_shard = np.bincount(self._shard_of(moved), minlength=self.n_shards)
            st.counts[new] = per_shard.astype(np.int64)
            st.counts[pr.ka] = st.counts[pr.ka] - per_shard
            st.stats[pr.ka], st.stats[new] = niw["A"], niw["B"]
            st.w[pr.ka], st.w[new] = w["A"], w["B"]
        else:
            new = pr.ka
            moved = pr.rows[~pr.in_a]
            st.counts[pr.ka] = st.counts[pr.ka] + st.counts.pop(pr.kb)
            del st.stats[pr.kb], st.w[pr.kb]
            st.stats[pr.ka], st.w[pr.ka] = niw["C"], w["C"]
        self._relabel(c, st, moved, new)
        return True

    def _relabel(self, c: int, st: ChainState, rows: np.ndarray, label: int) -> None:
        """Give global ``rows`` of chain ``c`` the label ``label``, on their shards and in
        the driver's records (:attr:`known`, the tracked rows)."""
        self._send_moves(c, rows, np.full(rows.size, label, dtype=np.int64))
        self.known[c].set_many(rows, label)
        for r in set(st.tracked).intersection(rows.tolist()):
            st.tracked[r] = label

    def _update_weights(self, c: int, st: ChainState) -> dict[str, Any]:
        """One MH step on every cluster's weights, each decided by the sequential test
        over the cluster's members; all clusters' tests share the round trips."""
        o, rng = self.options, st.rng
        labels = sorted(st.stats)
        S = len(labels)
        W = np.stack([st.w[k] for k in labels])
        Wp = W + o.proposal_sd * rng.standard_normal(W.shape)
        log_u = -rng.standard_exponential(S)
        info = self.decide_weights(c, labels, W, Wp, log_u, o.eps, st.decisions)
        st.decisions += 1
        for s, k in enumerate(labels):
            if info["decision_accept"][s]:
                st.w[k] = Wp[s]
        return info

    def decide_weights(
        self,
        c: int,
        labels: list[int],
        W: np.ndarray,
        Wp: np.ndarray,
        log_u: np.ndarray,
        eps: float,
        key: int,
    ) -> dict[str, Any]:
        """The MH decisions ``w_k → w′_k`` of clusters ``labels`` of chain ``c`` (with log
        uniforms ``log_u``) by the sequential test at ``eps``, concurrently (``labels``
        distinct); nothing moves. ``key`` numbers the decisions (the chain's weight
        steps): cluster ``k``'s members are read in the order of the keyed permutation
        ``stream_key(seed, k, c, key, RANK_PURPOSE)`` of their ranks in row order.

        A round trip asks for several minibatches of every undecided cluster, the next
        ones of its order: ``min_batches`` at first (the test cannot stop before), twice
        as many each trip after; the test then takes them one minibatch at a time, as if
        each had come alone. So the decisions are those of one minibatch a trip, in a
        number of trips logarithmic in the minibatches a decision takes; the members a
        cluster's last trip brought beyond its stop are read but unused.

        Returns
        -------
        dict
            ``decision_accept``, ``decision_n`` (members the test took),
            ``decision_N`` (cluster sizes) and the totals ``decisions``, ``accepted``,
            ``data_used``, ``data_evaluated`` (members the shards computed),
            ``cluster_rows``, ``round_trips`` (with this iteration's two label trips).
        """
        o, st = self.options, self.states[c]
        S = len(labels)
        Nk = np.array([st.stats[k].n for k in labels], dtype=np.int64)
        lp_diff = -0.5 * (np.sum(W * W, axis=1) - np.sum(Wp * Wp, axis=1)) / o.w_prior**2
        mu0 = (log_u + lp_diff) / Nk  # log p(w) − log p(w′) + log u, per member
        # cluster k's members on shard j are its global ranks starts[j] .. stops[j] − 1
        stops = {k: np.cumsum(st.counts[k]) for k in labels}
        ranges = {k: (stops[k] - st.counts[k], stops[k]) for k in labels}
        orders = [stream_key(self.seed, k, c, key, RANK_PURPOSE) for k in labels]
        n = np.zeros(S, dtype=np.int64)
        evaluated = np.zeros(S, dtype=np.int64)
        mean = np.zeros(S)
        m2 = np.zeros(S)
        rounds = np.zeros(S, dtype=np.int64)
        accept = np.zeros(S, dtype=bool)
        done = np.zeros(S, dtype=bool)
        used_rows: dict[int, list] = {k: [] for k in labels}
        B = o.batch_size
        batches = o.min_batches
        trips = 0
        while not done.all():
            per_shard: dict[int, list] = {}
            slots: dict[int, list[tuple[int, np.ndarray | None]]] = {}
            active = np.flatnonzero(~done).tolist()
            # no more than TRIP_ROWS members in a trip (over the clusters), a minibatch at least
            batches = max(1, min(batches, TRIP_ROWS // (B * len(active))))
            for s in active:
                k = labels[s]
                if eps == 0:  # never stops early: every member in one trip, in row order
                    for j in np.flatnonzero(st.counts[k]).tolist():
                        per_shard.setdefault(j, []).append((k, None, W[s], Wp[s], self.record_rows))
                        slots.setdefault(j, []).append((s, None))
                    evaluated[s] = Nk[s]
                    continue
                count = int(min(batches * B, Nk[s] - evaluated[s]))
                g = permuted_rows(orders[s], int(Nk[s]), int(evaluated[s]), count)
                evaluated[s] += count
                for j, at, local in by_range(*ranges[k], g):
                    per_shard.setdefault(j, []).append((k, local, W[s], Wp[s], self.record_rows))
                    slots.setdefault(j, []).append((s, at))
            replies = self.transport.call_some(
                "batch", {j: (c, reqs) for j, reqs in per_shard.items()}
            )
            trips += 1
            batches *= 2
            # each decision's values in its own order (its keyed order, or row order),
            # whatever shards they came from: placement- and layout-independent sums
            got: dict[int, list] = {}
            fetched: dict[int, list] = {}
            for j in sorted(replies):
                for (s, at), (diff, rows) in zip(slots[j], replies[j], strict=True):
                    got.setdefault(s, []).append((at, diff))
                    if rows is not None:
                        fetched.setdefault(s, []).append((at, rows))
            for s, parts in got.items():
                # one minibatch at a time (all the members at once at eps = 0)
                vals = _in_order(parts)
                t = take_minibatches(
                    vals, max(vals.size, 1) if eps == 0 else B, n[s], mean[s], m2[s],
                    rounds[s], mu0[s], int(Nk[s]), eps, tails=o.tails,
                    min_batches=o.min_batches,
                )  # fmt: skip
                n[s], mean[s], m2[s], rounds[s] = t.n, t.mean, t.m2, t.rounds
                if t.stopped:
                    done[s], accept[s] = True, t.accept
                if s in fetched:
                    used_rows[labels[s]].append(_in_order(fetched[s]))
        if self.record_rows:
            self.last_rows.append(
                {k: np.concatenate(v)[: n[s]] for s, (k, v) in enumerate(used_rows.items())}
            )
        return {
            "decisions": S,
            "accepted": int(accept.sum()),
            "data_used": int(n.sum()),
            "data_evaluated": int(evaluated.sum()),
            "cluster_rows": int(Nk.sum()),
            "round_trips": trips + 2,
            "decision_labels": labels,
            "decision_n": n,
            "decision_N": Nk,
            "decision_accept": accept,
            "decision_w": W,
            "decision_proposal": Wp,
            "decision_log_u": log_u,
        }

    # ---------------------------------------------------------------- what a draw shows
    def predict(self, c: int, Xd: np.ndarray, F: np.ndarray) -> np.ndarray:
        """``p(y = 1 | x)`` under chain ``c``'s state for rows ``(Xd, F)``: each cluster
        weighted by ``n_k t_k(x)``, a new cluster by ``α t_0(x)`` (whose expected
        ``σ(wᵀf)`` under the symmetric prior is ½)."""
        st = self.states[c]
        labels = sorted(st.stats)
        logw = np.stack(
            [math.log(st.stats[k].n) + st.stats[k].log_predictive(Xd) for k in labels]
            + [math.log(st.alpha) + self.prior_stats.log_predictive(Xd)]
        )
        W = np.stack([st.w[k] for k in labels])
        p1 = np.vstack([1.0 / (1.0 + np.exp(-(W @ F.T))), np.full((1, Xd.shape[0]), 0.5)])
        wts = np.exp(logw - logw.max(axis=0))
        return np.sum(wts * p1, axis=0) / np.sum(wts, axis=0)

    def sizes(self, c: int) -> np.ndarray:
        """Chain ``c``'s cluster sizes, largest first."""
        return np.sort([s.n for s in self.states[c].stats.values()])[::-1]


@dataclass
class DPMResult:
    """A JointDPM run: label-free quantities per chain and draw, and the run's info.

    ``draws`` holds ``alpha`` and ``K`` ``(chains, draws)``, ``sizes`` ``(chains, draws,
    32)`` (largest first, zero-padded), ``cocluster`` ``(chains, draws, pairs)`` (whether
    each pair of ``pairs`` shares a cluster), ``seconds`` (cumulative wall time of each
    chain's iterations), ``data_used`` and ``cluster_rows`` (members the ``w_k`` tests
    read, and the clusters' total size, per iteration), ``accepted``, ``moved``,
    ``split_merged`` (split–merge proposals accepted, per iteration); with
    test rows, ``accuracy`` (of the running chain-averaged prediction, per chain and
    draw) and ``predictive`` ``(chains, test rows)`` (the final chain averages).
    """

    draws: dict[str, np.ndarray]
    info: dict[str, Any]

    def summary(self) -> dict[str, dict[str, float]]:
        """R̂ and bulk ESS of ``alpha`` and ``K``, with their means."""
        out = {}
        for name in ("alpha", "K"):
            x = np.asarray(self.draws[name], float)
            out[name] = {
                "mean": float(x.mean()),
                "rhat": float(rhat(x)),
                "ess_bulk": float(ess_bulk(x)),
            }
        return out


def _in_order(parts: list[tuple[np.ndarray | None, np.ndarray]]) -> np.ndarray:
    """The values of one decision's pieces ``(positions, values)`` from several shards,
    at their positions (None: the pieces are consecutive, in shard order)."""
    if parts[0][0] is None:
        return np.concatenate([v for _, v in parts])
    out = np.empty(sum(v.size for _, v in parts), dtype=parts[0][1].dtype)
    for at, v in parts:
        out[at] = v
    return out


def shard_bounds(n_rows: int, n_shards: int) -> np.ndarray:
    """The shards' row ranges ``bounds[j] .. bounds[j + 1]``: whole blocks of
    :func:`flymc_dist.reduce.block_rows` rows spread as evenly as possible, at most one
    shard per block (so fewer than ``n_shards`` on a data set of fewer blocks)."""
    B = block_rows(n_rows)
    n_blocks = -(-n_rows // B)
    edges = np.linspace(0, n_blocks, min(n_shards, n_blocks) + 1).astype(np.int64) * B
    return np.minimum(edges, n_rows)


#: the per-iteration statistics of a run (the trace's ``sample_stats``), with their dtypes
STATS = {
    "seconds": np.float64,
    "data_used": np.int64,
    "cluster_rows": np.int64,
    "accepted": np.int64,
    "moved": np.int64,
    "split_merged": np.int64,
    "accuracy": np.float64,
}


def trace_quantities(n_pairs: int) -> list[str]:
    """The names along a JointDPM trace's ``quantity`` axis: ``alpha``, ``K``, the
    :data:`MAX_SIZES` largest cluster sizes, then each traced pair's co-clustering."""
    return (
        ["alpha", "K"]
        + [f"size_{i}" for i in range(MAX_SIZES)]
        + [f"together_{p}" for p in range(n_pairs)]
    )


def _fingerprint(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for x in arrays:
        x = np.ascontiguousarray(x)
        h.update(str((x.dtype.str, x.shape)).encode())
        h.update(x.tobytes())
    return h.hexdigest()


def sample_jointdpm(
    data: Any,
    algorithm: JointDPM | None = None,
    *,
    num_warmup: int = 0,
    num_samples: int = 1000,
    chains: int = 4,
    seed: int = 0,
    client: Any = None,
    n_shards: int | None = None,
    test: tuple[np.ndarray, np.ndarray] | None = None,
    pairs: np.ndarray | None = None,
    predict_every: int = 1,
    trace: str | None = None,
    resume: bool = False,
    overwrite_trace: bool = False,
    checkpoint_every: int = 100,
) -> DPMResult:
    """Run JointDPM's chains over a binary data set.

    Parameters
    ----------
    data
        ``(X, y)`` arrays or a :class:`~flymc_dist.data.Dataset` (read into the shards);
        ``y`` in {0, 1}.
    algorithm
        The model and sampler settings (default ``fd.JointDPM()``).
    num_warmup, num_samples
        Iterations dropped, then kept.
    chains, seed
        Chains, and the seed of every random stream.
    client
        ``"synchronous"`` (every shard in this process), a ``distributed.Client``, or None
        (an embedded LocalCluster).
    n_shards
        Row ranges the data is cut into (default 2, whatever the client; whole blocks,
        :func:`shard_bounds`). The draws depend on neither it nor the placement.
    test
        Held-out ``(X, y)``: the chain-averaged prediction's accuracy is traced.
    pairs
        ``(P, 2)`` row pairs whose co-clustering is traced.
    predict_every
        Iterations between predictions on the test rows.
    trace
        A zarr directory (:class:`~flymc_dist.trace.Trace`) keeping the kept draws' label-
        free quantities (posterior ``theta`` along the :func:`trace_quantities` axis, the
        :data:`STATS` as ``sample_stats``) and, every ``checkpoint_every`` iterations and
        at the end, the checkpoint (:meth:`JointDPMSampler.state_dict`, the running
        predictions, the iteration).
    resume
        Continue the interrupted run in ``trace`` to its ``num_warmup + num_samples``
        iterations (the same data, settings, seed and chains; any ``n_shards`` or client):
        the draws are those of the run never interrupted.
    overwrite_trace
        Replace an existing ``trace``.
    checkpoint_every
        Iterations between checkpoints.

    Returns
    -------
    DPMResult
    """
    alg = JointDPM() if algorithm is None else algorithm
    if not isinstance(alg, JointDPM):
        raise ValueError(f"algorithm must be fd.JointDPM(…), not {alg!r}")
    for name, v, lo in (
        ("num_warmup", num_warmup, 0),
        ("num_samples", num_samples, 1),
        ("chains", chains, 1),
        ("predict_every", predict_every, 1),
        ("checkpoint_every", checkpoint_every, 1),
    ):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, not {v!r}")
    if resume and trace is None:
        raise ValueError("resume=True needs a trace")
    if isinstance(data, tuple):
        X, y = (np.asarray(a, float) for a in data)
    else:
        X, y = data.read()
        X, y = np.asarray(X, float), np.asarray(y, float)
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise ValueError(f"data must be X (N, D) and y (N,), not {X.shape} and {y.shape}")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("data: JointDPM needs binary labels y in {0, 1}")
    if not np.isfinite(X).all():
        raise ValueError("data: X has non-finite values")
    pairs_a = np.empty((0, 2), np.int64) if pairs is None else np.asarray(pairs, np.int64)
    if (
        pairs_a.ndim != 2
        or pairs_a.shape[1] != 2
        or (pairs_a.size and (pairs_a.min() < 0 or pairs_a.max() >= X.shape[0]))
    ):
        raise ValueError("pairs must be (P, 2) row indices of the data")
    if n_shards is None:
        n_shards = 2
    if isinstance(n_shards, bool) or not isinstance(n_shards, int) or not 1 <= n_shards <= len(X):
        raise ValueError(f"n_shards must be an integer in [1, rows], not {n_shards!r}")
    bounds = shard_bounds(X.shape[0], n_shards)
    cols = list(range(X.shape[1])) if alg.density_columns is None else list(alg.density_columns)
    if max(cols) >= X.shape[1]:
        raise ValueError(f"density_columns {alg.density_columns} name a column beyond {X.shape[1]}")
    held = None
    if test is not None:
        held = tuple(np.asarray(a, float) for a in test)
    config = {
        "algorithm": "jointdpm",
        "options": {f: getattr(alg, f) for f in alg.__dataclass_fields__},
        "seed": int(seed),
        "chains": int(chains),
        "num_warmup": int(num_warmup),
        "num_samples": int(num_samples),
        "predict_every": int(predict_every),
        "data": _fingerprint(X, y),
        "test": None if held is None else _fingerprint(*held),
        "pairs": pairs_a.tolist(),
    }
    config = json.loads(json.dumps(config))  # as a trace reads it back (tuples as lists)
    lock = None
    if trace is not None:
        trace = os.path.abspath(trace)
        if resume:
            Trace.open(trace, read_only=True)  # none there: FileNotFoundError
        lock = TraceLock(trace).acquire()
    try:
        tr = _open_trace(trace, resume, overwrite_trace, config, chains, pairs_a.shape[0])
        transport = open_dpm_transport(client, X, y, bounds, cols, chains, seed)
        try:
            tracked = np.unique(pairs_a.ravel())
            sampler = JointDPMSampler(
                alg, transport, bounds, X.shape[1], chains=chains, seed=seed, tracked_rows=tracked
            )
            rec, running, n_pred, t_start = _iterate(
                sampler, config, held, cols, pairs_a, tr, checkpoint_every
            )
            if held is not None:
                rec["predictive"] = running / np.maximum(n_pred, 1)[:, None]
            info = {
                "algorithm": "jointdpm",
                "approximate": alg.eps > 0,
                "options": {f: getattr(alg, f) for f in alg.__dataclass_fields__},
                "n_rows": int(X.shape[0]),
                "n_features": int(X.shape[1]),
                "n_shards": int(bounds.size - 1),
                "transport": transport.name,
                "channel": transport.channel,
                "chains": chains,
                "seed": seed,
                "num_warmup": num_warmup,
                "num_samples": num_samples,
                "round_trips": transport.round_trips,
                "recoveries": transport.recoveries,
                "seconds": time.perf_counter() - t_start,
                "pairs": pairs_a,
                "trace": trace,
            }
            return DPMResult(rec, info)
        finally:
            transport.close()
    finally:
        if lock is not None:
            lock.release()


def _open_trace(
    path: str | None, resume: bool, overwrite: bool, config: dict, chains: int, n_pairs: int
) -> Trace | None:
    """The run's trace: opened (a resume, checked against ``config``) or created."""
    if path is None:
        return None
    if resume:
        tr = Trace.open(path)
        if tr.attrs.get("config") != config:
            diff = sorted(k for k in config if (tr.attrs.get("config") or {}).get(k) != config[k])
            raise ValueError(f"trace {path!r} was written by another run (differs in {diff})")
        if tr.checkpoint is None:
            raise ValueError(f"trace {path!r} holds no checkpoint to resume from")
        return tr
    return Trace.create(
        path,
        chains=chains,
        param_shape=(2 + MAX_SIZES + n_pairs,),
        stats=STATS,
        attrs={"config": config},
        overwrite=overwrite,
        dims=("quantity",),
        coords={"quantity": trace_quantities(n_pairs)},
    )


def _iterate(
    sampler: JointDPMSampler,
    config: dict,
    held: tuple[np.ndarray, np.ndarray] | None,
    cols: list[int],
    pairs: np.ndarray,
    tr: Trace | None,
    checkpoint_every: int,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, float]:
    """Run (or, from ``tr``'s checkpoint, continue) the chains to the end; the kept
    draws, the running predictions and their count, and the start time."""
    C, num_warmup, num_samples = config["chains"], config["num_warmup"], config["num_samples"]
    predict_every = config["predict_every"]
    T = 0 if held is None else held[0].shape[0]
    if held is not None:
        Xtd = held[0][:, cols]
        Ft = np.hstack([held[0], np.ones((T, 1))])
    theta = np.zeros((C, num_samples, 2 + MAX_SIZES + pairs.shape[0]))
    stats = {k: np.zeros((C, num_samples), dtype=d) for k, d in STATS.items()}
    stats["accuracy"][:] = np.nan
    t_start = time.perf_counter()
    ck = None if tr is None else tr.checkpoint
    if ck is not None:
        state = ck
        sampler.load_state(state["sampler"])
        it0 = int(state["iteration"])
        running = np.array(state["running"], dtype=float).reshape(C, T)
        n_pred = np.array(state["n_pred"], dtype=float)
        clock = np.array(state["clock"], dtype=float)
        kept = tr.n_draws
        theta[:, :kept] = tr.samples
        for k, v in tr.stats.items():
            stats[k][:, :kept] = v
    else:
        sampler.setup()
        it0, kept = 0, 0
        running, n_pred, clock = np.zeros((C, T)), np.zeros(C), np.zeros(C)
    written = kept
    total = num_warmup + num_samples
    for it in range(it0, total):
        infos = sampler.step()
        t = it - num_warmup
        for c, inf in enumerate(infos):
            clock[c] += inf["seconds"]
            st = sampler.states[c]
            if held is not None and (it + 1) % predict_every == 0 and t >= 0:
                t0 = time.perf_counter()
                running[c] += sampler.predict(c, Xtd, Ft)
                n_pred[c] += 1
                clock[c] += time.perf_counter() - t0
            if t < 0:
                continue
            sz = sampler.sizes(c)[:MAX_SIZES]
            row = theta[c, t]
            row[0], row[1] = st.alpha, len(st.stats)
            row[2 : 2 + sz.size] = sz
            row[2 + MAX_SIZES :] = [st.tracked[int(a)] == st.tracked[int(b)] for a, b in pairs]
            stats["seconds"][c, t] = clock[c]
            for key in ("data_used", "cluster_rows", "accepted", "moved", "split_merged"):
                stats[key][c, t] = inf[key]
            if held is not None and n_pred[c]:
                avg = running[c] / n_pred[c]
                stats["accuracy"][c, t] = float(np.mean((avg > 0.5) == (held[1] > 0.5)))
        if tr is not None and ((it + 1) % checkpoint_every == 0 or it + 1 == total):
            done = max(0, t + 1)
            if done > written:
                tr.append(
                    theta[:, written:done],
                    {k: v[:, written:done] for k, v in stats.items()},
                    warmup=False,
                )
                written = done
            tr.set_checkpoint(
                {
                    "iteration": it + 1,
                    "sampler": sampler.state_dict(),
                    "running": running,
                    "n_pred": n_pred,
                    "clock": clock,
                }
            )
    rec = {
        "alpha": theta[:, :, 0].copy(),
        "K": theta[:, :, 1].copy(),
        "sizes": theta[:, :, 2 : 2 + MAX_SIZES].astype(np.int64),
        "cocluster": theta[:, :, 2 + MAX_SIZES :].astype(bool),
    }
    for k, v in stats.items():
        if k != "accuracy" or held is not None:
            rec[k] = v
    return rec, running, n_pred, t_start
