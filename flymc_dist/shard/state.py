"""A shard's state: a contiguous row range of the data, with everything that lives
beside it.

A :class:`Shard` owns its rows, its per-datum tight points, the bright/dark
structure of every chain, one random stream per chain and its query counters; and its
set-up calls, full passes and the add-on samplers' interface. It is a plain Python
class: in ``client="synchronous"`` mode the driver calls it in-process; on a cluster a
:class:`~flymc_dist.transport.host.ShardHost` holding several shards runs as a Dask
actor on a worker. One code path, two transports.

This module never imports the round: a round is functions over a group of shards
(:func:`~flymc_dist.shard.round.round_shards`, and the compiled z-update
:func:`~flymc_dist.shard.batched.batched_z_update`), using the public steps here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from flymc_dist._numerics import in_sorted
from flymc_dist.brightness import (
    BrightSet,
    explicit_accept,
    explicit_propose,
    implicit_accept,
    implicit_propose,
)
from flymc_dist.data import open_dataset
from flymc_dist.protocol import (
    Ahead,
    Proposals,
    ReplicaReply,
    Reply,
    Request,
    ShardConfig,
    ShardSpec,
    resolve_operation,
)
from flymc_dist.reduce import BlockFold, BlockSums, block_rows, fold_blocks, tree_nodes
from flymc_dist.shard.rowfile import local_directory
from flymc_dist.shard.rows import FileRows, MemoryRows, tail_bytes, weak_method
from flymc_dist.shard.shared import Segment, segment_or_none
from flymc_dist.streams import Z_PROPOSE, RowStreams, bernoulli_rows_many, steps_keys
from flymc_dist.terms import bright_terms, bright_terms_many, check_bounds_held

log = logging.getLogger("flymc_dist")

_T = TypeVar("_T")

#: out of core, the batched z-updates whose proposals :meth:`Shard.settle` has read ahead
#: (each read once, one z-update's a round; all prepared in one call every this many: the
#: prepare costs ~0.2 ms a call whatever its rows, measured at 10^6 x 57)
ROWS_AHEAD = 4


@dataclass
class _Chain:
    theta: np.ndarray
    step: int = 0  # z-updates since the chain was placed: keys its row streams
    bright: BrightSet | None = None  # flymc
    cur_sum: np.ndarray | None = None  # regular: sum of l_n at theta per block (nb,)
    cur_grad: np.ndarray | None = None  # regular: its gradient per block (nb, P) when known
    last_points: np.ndarray | None = None
    last_vals: np.ndarray | None = None  # flymc (k, M) / regular per block (nb, k)
    last_dvals: np.ndarray | None = None  # flymc (k, M, E) / regular grads (nb, k, P)
    extra: dict[str, Any] = field(default_factory=dict)


class Shard:
    """One shard's rows, tight points, brightness per chain, random streams and counters.

    Parameters
    ----------
    spec
        The row range (and store path) of this shard.
    config
        Model and algorithm settings shared by all shards.
    data
        ``(X, y)`` already in memory (tests); otherwise read from ``spec.path`` (opened
        with ``spec.storage_options``).
    budget
        Bytes of memory this shard's rows may take (``config.out_of_core="auto"``); None:
        no budget.

    Notes
    -----
    **Out of core.** A shard whose rows would exceed its budget (or with
    ``config.out_of_core=True``) streams them once from the store into a row file in
    its worker's local directory (:class:`~flymc_dist.shard.rows.FileRows`) and holds in
    memory only what is O(bright): the rows bright in some chain and every chain's
    bright set (:class:`~flymc_dist.brightness.BrightSet`, no mask over the rows). Its
    z-update is the in-memory one: the rows it proposes are read from the file before it
    runs (the next z-update's on a thread, while θ moves: they depend on neither θ nor
    z), so out-of-core draws are the in-memory draws, bit for bit where the evaluations
    are compiled. Full passes (MAP tuning, bound statistics, the exact draw of z,
    regular MCMC) stream the row file.
    """

    def __init__(
        self,
        spec: ShardSpec,
        config: ShardConfig,
        data: tuple[np.ndarray, np.ndarray] | None = None,
        budget: int | None = None,
    ) -> None:
        self.spec = spec
        self.config = config
        if not 0 <= spec.start < spec.stop <= config.n_rows:
            raise ValueError(
                f"shard rows [{spec.start}, {spec.stop}) are not within the data set's "
                f"{config.n_rows} rows (ShardConfig.n_rows)"
            )
        #: N, the rows of the whole data set (see :attr:`ShardConfig.n_rows`)
        self.n_total = int(config.n_rows)
        self.model = config.model
        self.flymc = config.algorithm == "flymc"
        self.memory_budget = budget
        # FlyMC with a compiled log L~ keeps each row's constants beside its features, in
        # one (n, D + K) buffer: evaluating a scattered row then touches one place in
        # memory, not two (the z-update's cost is mostly such cache misses)
        K = self._n_row_constants() if self.flymc else 0
        self._K = K
        #: whether in-memory rows go in shared memory, to be lent to a driver on this
        #: machine that reads ahead its implicit z-update's proposals (:meth:`lend`)
        self._lends = bool(K) and config.z_update == "implicit"
        self._theta_hat: np.ndarray | None = None  # None: untuned tight points
        #: :meth:`column_energy`, when summed as the rows were read from the store
        self._energy: BlockSums | None = None
        #: the rows, in memory or in a local row file (:mod:`flymc_dist.shard.rows`)
        self.rows: MemoryRows | FileRows
        #: rows of the blocks full passes sum by (:mod:`flymc_dist.reduce`): the store's
        #: chunks, or (arrays in memory, 0) :func:`~flymc_dist.reduce.block_rows` of N
        self.block_rows = 0
        prepare = weak_method(self._row_constants)  # no cycle shard -> rows -> shard
        # the features' dtype as stored (float32 or float64; held as float64): what a
        # read-ahead reply sends them as, exactly and in half the bytes from float32
        self._stored = np.dtype(np.float64)
        if data is None:
            ds = open_dataset(
                spec.path, storage_options=spec.storage_options, store_id=spec.store_id
            )
            self.block_rows = B = int(ds.chunk_rows)
            self._stored = np.dtype(ds.dtype)
            n = spec.stop - spec.start
            nbytes = n * (ds.n_features + K + 2) * 8
            # the columns' energy (θ-free) is summed on the way in: no pass of its own
            energy: list[tuple[int, np.ndarray]] = []

            def each(lo: int, X: np.ndarray) -> None:
                energy.append((lo // B, _column_energy(X)))

            if _out_of_core(config.out_of_core, nbytes, budget):
                _check_explicit(config, nbytes * config.chains, budget)
                _check_proposals(n, ds.n_features, K, config, config.q_db, budget)
                self.rows = FileRows(ds, spec.start, spec.stop, K, prepare, local_directory(), each)
            else:
                XC, segment = _row_buffer(n, ds.n_features + K, self._lends)
                ys = []
                for lo, hi, Xb, yb in ds.iter_chunks(spec.start, spec.stop):  # no 2nd copy
                    XC[lo - spec.start : hi - spec.start, : ds.n_features] = Xb
                    ys.append(yb)
                    each(lo, Xb)
                y = np.concatenate(ys) if ys else np.empty(0)
                self.rows = _memory_rows(XC, segment, ds.n_features, y, prepare)
                self.rows.passes = 1  # the store's, read into memory
            if spec.start % B == 0:  # whole blocks (else column_energy says why not)
                self._energy = tree_nodes(energy, -(-self.n_total // B))
        else:
            X, y = data
            if np.asarray(X).dtype == np.float32:
                self._stored = np.dtype(np.float32)
            X = np.asarray(X, dtype=np.float64)
            XC, segment = _row_buffer(X.shape[0], X.shape[1] + K, self._lends)
            XC[:, : X.shape[1]] = X
            self.rows = _memory_rows(XC, segment, X.shape[1], y, prepare)
        self.n, self.n_features = self.rows.n, self.rows.n_features
        self._use_compiled(K)
        self._init_common()
        self.rows.retune()  # out of core: of the resident rows (none yet)

    @property
    def out_of_core(self) -> bool:
        """Whether the rows stay in the store (see the class notes)."""
        return self.rows.out_of_core

    def _use_compiled(self, K: int) -> None:
        """Find the model's compiled log L~ (when it has ``K`` row constants)."""
        #: ``(kind, params)`` of the model's compiled log L~ (the hot path), or None
        self.kernel: tuple[int, np.ndarray] | None = None
        #: the compiled kernels' module (:mod:`flymc_dist._compiled`), when ``kernel`` is set
        self.jit: Any = None
        compiled = self.model.compiled_bright() if K else None
        if compiled is not None:
            from flymc_dist import _compiled  # numba: imported where shards compute

            self.jit = _compiled
            self.kernel = (_compiled.KINDS[compiled[0]], np.asarray(compiled[1], float))

    def _init_common(self) -> None:
        config = self.config
        self.n_params = self.model.n_params(self.n_features)
        self.q_db = float(config.q_db)
        #: gradients of the bright terms kept with z (shard-evaluated gradient kernels)
        self.track_grad = bool(config.track_grad)
        #: rounds reply the change of each chain's bright set (see :meth:`set_replica`)
        self.replica = False
        self._sent: list[np.ndarray | None] = []  # replica mode: the bright rows last sent
        self.chains: list[_Chain] = []
        self.generation = 0
        self.total_queries = 0
        #: bright rows found not resident out of core, and read back (:meth:`_reread_lost`)
        self.lost_rows = 0
        #: the ``seq`` of the last round run here and its reply (a replayed round answers
        #: with it: see :func:`~flymc_dist.shard.round.round_shards`)
        self.round_seq: Any = None
        self.round_reply: Reply | ReplicaReply | None = None
        #: columns and thresholds of the exact rows' rule (see set_exact_rows), or None
        self._exact: tuple[np.ndarray, np.ndarray] | None = None
        #: the shard's buffer as a typed list, when it computes alone (see :func:`typed_lists`)
        self.typed_cache: tuple | None = None
        self._extensions: dict[str, Any] = {}  # see extension()
        self._unsettled = False  # work left for settle()
        #: the chains' proposals drawn so far, by what they were drawn for (see drawn)
        self._draws: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    # ------------------------------------------------------------------ set-up
    def set_tight_points(self, theta_hat: np.ndarray | None) -> None:
        """Tight points at ``theta_hat`` (MAP-tuned) or the model's untuned ones (None)."""
        self._theta_hat = None if theta_hat is None else np.asarray(theta_hat, float)
        self.rows.retune()

    def column_energy(self) -> BlockSums:
        """``Σ_n x_nj²`` and ``Σ_n x_nj⁴`` of every column j over this shard's rows, as
        (2, D) arrays summed by block: what :func:`flymc_dist.tune.narrow_columns` reads
        the rows carrying each column from. Summed while the rows were read from the
        store; for rows given in memory, a full pass."""
        if self._energy is not None:
            return self._energy
        return self._block_sums(lambda X, y, xi: _column_energy(X))

    def _block_sums(
        self, fn: Callable[[np.ndarray, np.ndarray, Any], Any], thin: int = 1
    ) -> BlockSums:
        """``fn(X, y, xi)`` of every block of this shard's rows, added up along the fixed
        tree of :mod:`flymc_dist.reduce` as far as this shard's blocks go: sums that are
        the same bits whatever the layout (a full pass). With ``thin`` > 1, of the first
        ``ceil(B / thin)`` rows of each ``B``-row block only, each block's value scaled by
        its rows over those used (an estimate of the full sums from about 1/``thin`` of the
        rows: not a full pass)."""
        B, first, n_blocks = self._blocking()
        head = None if thin <= 1 else -(-B // int(thin))

        def value(k: int, b: tuple[np.ndarray, np.ndarray, Any]) -> Any:
            if head is None:
                return fn(*b)
            return fn(*b) * (min(B, self.n_total - k * B) / b[1].size)  # block k's rows

        it = self.rows.blocks(B, head)
        return tree_nodes(((first + k, value(first + k, b)) for k, b in enumerate(it)), n_blocks)

    def _blocking(self) -> tuple[int, int, int]:
        """The blocks full passes sum by: their rows ``B``, the index of this shard's first
        and their number over all N rows."""
        B = self.block_rows
        if B <= 0:
            B = block_rows(self.n_total)
        if self.spec.start % B or (self.spec.stop % B and self.spec.stop != self.n_total):
            raise ValueError(
                f"shard rows [{self.spec.start}, {self.spec.stop}) split a block of {B} rows"
            )
        return B, self.spec.start // B, -(-self.n_total // B)

    def set_exact_rows(self, columns: np.ndarray, thresholds: np.ndarray) -> int:
        """The rule of the *exact rows* (``exact_rows``; before :meth:`set_tight_points`):
        the rows with ``x_nj² ≥ thresholds[i]`` for a column ``j = columns[i]``. Their tight
        points become the model's :meth:`~flymc_dist.models.base.Model.exact_xi`: the
        bound still holds, so the chain stays exact, but lies hundreds of nats below the
        likelihood, so such a row is bright with probability 1 and every θ-step evaluates
        it. Returns how many rows of this shard the rule picks (a full pass)."""
        columns = np.asarray(columns, dtype=np.int64)
        thresholds = np.asarray(thresholds, dtype=np.float64)
        self._exact = (columns, thresholds) if columns.size else None
        return sum(int(self._exact_mask(X).sum()) for X, _, _ in self.blocks(65536))

    def _exact_mask(self, X: np.ndarray) -> np.ndarray:
        """Which of the rows ``X`` are exact rows (:meth:`set_exact_rows`)."""
        if self._exact is None:
            return np.zeros(X.shape[0], dtype=bool)
        columns, thresholds = self._exact
        return np.any(np.square(X[:, columns], dtype=np.float64) >= thresholds, axis=1)

    def _loosen(self, X: np.ndarray, y: np.ndarray, xi: np.ndarray) -> None:
        """Put the exact rows among ``(X, y)`` at the model's loose tight points, in ``xi``."""
        mask = self._exact_mask(X)
        if mask.any():
            xi[mask] = self.model.exact_xi(y[mask])

    def _n_row_constants(self) -> int:
        """K, the number of per-row constants of the model's ``log L~`` in one formula (0: none)."""
        if self.model.n_outputs != 1:
            return 0
        y0 = np.zeros(1)
        c = self.model.row_constants(y0, self.model.untuned_xi(y0))
        return 0 if c is None else int(c.shape[1])

    def set_q(self, q_db: float) -> None:
        """Set the dark→bright proposal probability of the implicit z-update."""
        if self.out_of_core:
            _check_proposals(
                self.n, self.n_features, self._K, self.config, float(q_db), self.memory_budget
            )
        self.q_db = float(q_db)
        self._unsettled = True  # the rows read ahead were proposed at the old q
        self.settle()

    def set_replica(self, on: bool) -> None:
        """Serve rounds for a driver-side replica of the bright rows (before
        :meth:`set_positions`).

        In replica mode a round carries one point per chain, the chain's current θ: the
        shard puts the chain there, updates its z at θ, and replies with the change of
        the chain's bright set since its last reply (:meth:`bright_change`); the
        driver evaluates the θ-kernel on its replica. No gradients are kept here then.
        """
        self.replica = bool(on)
        self.track_grad = bool(self.config.track_grad) and not self.replica

    def _expected(self, theta: np.ndarray) -> Callable[[np.ndarray, np.ndarray, Any], float]:
        """A block's ``Σ_n p(z_n = 1 | θ)`` at ``theta`` (see :meth:`expected_bright`)."""
        m = self.model
        thetas = np.asarray(theta, float)[None]

        def expected(X: np.ndarray, y: np.ndarray, xi: np.ndarray) -> float:
            eta = m.linear_predictor(thetas, X)
            delta = np.maximum(m.loglik(eta, y) - m.logbound(eta, y, xi), 0.0)
            return float(-np.expm1(-delta).sum())

        return expected

    def expected_bright(self, theta: np.ndarray) -> BlockSums:
        """``Σ_n p(z_n = 1 | θ) = Σ_n −expm1(−δ_n(θ))`` over this shard's rows, by block:
        the expected number of bright rows at ``theta`` (a full pass; set-up only)."""
        return self._block_sums(self._expected(theta))

    def bound_stats(self, untuned: bool = False) -> BlockSums:
        """This shard's collapsed bound ``sum_n beta_n(theta)`` as a quadratic, by block:
        at the tight points set, or (``untuned``) at the model's untuned ones without
        setting them (the MAP search's start; a full pass)."""
        m = self.model
        return self._block_sums(
            lambda X, y, xi: self._bound_block(X, y, m.untuned_xi(y) if untuned else xi)
        )

    def _bound_block(self, X: np.ndarray, y: np.ndarray, xi: Any) -> Any:
        """One block's share of the collapsed bound: the statistics of the rows ``(X, y)``
        with tight points ``xi`` (:meth:`bound_stats`, :meth:`place_with_bound_stats`)."""
        return self.model.suffstats(X, y, xi)

    def loglik_sum(self, theta: np.ndarray, order: int = 1, thin: int = 1) -> BlockSums:
        """``sum_n l_n(theta)`` with its gradient (order ≥ 1) and Hessian (order 2), by
        block, each block's as one flat array ``[value, gradient (P), Hessian (P·P)]``
        (:func:`flymc_dist.tune.find_map` reads the total).

        Used by MAP tuning; a full pass over the shard (not counted as sampler queries);
        with ``thin`` > 1 an estimate from about 1/``thin`` of the rows (see
        :meth:`_block_sums`), the MAP search's cheap start.
        """
        theta = np.asarray(theta, float)[None]
        m = self.model
        E = m.n_outputs
        D = self.n_features
        P = self.n_params

        def block(X: np.ndarray, y: np.ndarray, _: Any) -> np.ndarray:
            out = np.zeros(1 + (P if order >= 1 else 0) + (P * P if order >= 2 else 0))
            eta = m.linear_predictor(theta, X)
            if order >= 1:
                ll, dl = m.loglik_grad(eta, y)
                out[1 : 1 + P] = m.grad_theta(dl, X)[0]
            else:
                ll = m.loglik(eta, y)
            out[0] = ll.sum()
            if order >= 2:
                h = m.loglik_hess(eta[0], y)  # (n, E, E)
                if E == 1:
                    out[1 + P :] = ((X * h[:, 0, 0][:, None]).T @ X).ravel()
                else:
                    hk = np.einsum("nkl,nd,ne->kdle", h, X, X, optimize=True)
                    out[1 + P :] = hk.reshape(E * D * E * D)
            return out

        return self._block_sums(block, thin)

    def _tight_points(self, X: np.ndarray, y: np.ndarray) -> np.ndarray | None:
        """Tight points of the rows ``(X, y)`` under the current rule (None: none set, as
        in regular MCMC, or austerity before its control variates' θ̂)."""
        if not self.flymc and self._theta_hat is None:
            return None
        if self._theta_hat is None or y.size == 0:
            xi = self.model.untuned_xi(y)
        else:
            xi = self.model.tuned_xi(self._eta_hat(X), y)
        self._loosen(X, y, xi)
        return xi

    def _eta_hat(self, X: np.ndarray) -> np.ndarray:
        """The linear predictors ``(n, E)`` of the rows ``X`` at θ̂, row by row
        (:func:`flymc_dist._compiled.row_dots`): the same bits whichever rows are
        prepared together, in memory or read out of core."""
        from flymc_dist import _compiled

        E = self.model.n_outputs
        eta = np.empty((X.shape[0], E))
        T = self._theta_hat.reshape(E, X.shape[1])
        _compiled.row_dots(np.ascontiguousarray(X, dtype=np.float64), T, eta)
        return eta

    def _row_constants(
        self, X: np.ndarray, y: np.ndarray
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The tight points of the rows ``(X, y)`` and their row constants (None without a
        compiled log L~): how :attr:`rows` prepares them."""
        xi = self._tight_points(X, y)
        return xi, (self.model.row_constants(y, xi) if self._K else None)

    def _gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Features, target and tight point of ``rows`` (bright rows, or out of core rows of
        the current chunk)."""
        return self.rows.gather(rows)

    def set_positions(self, thetas: np.ndarray, generation: int = 0) -> int:
        """Put every chain at ``thetas[c]`` and draw its z exactly from ``p(z | θ)``.

        This is how chains start, and how a recreated shard rejoins a run: an exact
        Gibbs draw of this shard's auxiliary block, so the chain stays exact.

        Returns
        -------
        int
            Likelihood queries made.
        """
        return self._set_positions(thetas, generation, None)

    def place_with_bound_stats(self, thetas: np.ndarray) -> tuple[int, BlockSums]:
        """:meth:`set_positions` at ``thetas`` (FlyMC) and :meth:`bound_stats` at the tight
        points set, in one pass over the rows: the chains' start and the collapsed bound
        of a set-up, the same bits as the two calls. Returns the queries and the sums."""
        if not self.flymc:
            raise ValueError("place_with_bound_stats is FlyMC's (algorithm='flymc')")
        stats = BlockFold(self._blocking()[2])  # folded as they come: O(log blocks) held
        queries = self._set_positions(thetas, 0, stats)
        return queries, stats.sums()

    def _set_positions(self, thetas: np.ndarray, generation: int, stats: BlockFold | None) -> int:
        """:meth:`set_positions`; with ``stats``, the bound statistics of every block
        (:meth:`bound_stats`) are appended to it from the same pass."""
        thetas = np.asarray(thetas, float)
        self.generation = int(generation)
        self.chains = [_Chain(theta=thetas[c].copy()) for c in range(thetas.shape[0])]
        self.rows.reset()
        if self.flymc:
            queries = self._place_z(stats)
        else:
            queries = 0
            for ch in self.chains:
                s, g = self._regular_eval(ch.theta[None], self.track_grad)
                ch.cur_sum = s[:, 0]
                ch.cur_grad = g[:, 0] if g is not None else None
                queries += self.n
        self.round_seq, self.round_reply = None, None
        self._sent = [None] * len(self.chains)  # the next replica reply sends whole sets
        self.total_queries += queries
        return queries

    def streams(self, c: int, init: bool = False, ahead: int = 0) -> RowStreams:
        """Chain ``c``'s row-keyed streams at its current step, or ``ahead`` steps later
        (``init``: the exact draw of z at placement), for this shard's rows."""
        return RowStreams(
            self.config.seed,
            self.generation,
            c,
            0 if init else self.chains[c].step + ahead,
            self.spec.start,
            self.n_total,
            init,
        )

    def _place_z(self, stats: BlockFold | None = None) -> int:
        """Every chain's z drawn exactly from ``p(z | θ)`` — the explicit update of every
        row, from the chains' placement streams — over the rows of each block of
        :meth:`~flymc_dist.shard.rows.MemoryRows.sweep` (in memory one block; out of core
        the row file's, keeping only the rows that turn bright). With ``stats`` (a fold),
        each full-pass block's bound statistics are appended to it, as
        ``(block, suffstats)``. Returns the queries."""
        m = self.model
        B, first, _ = self._blocking()
        for ch in self.chains:
            ch.bright = BrightSet(self.n, m.n_outputs, self.track_grad)
        streams = [self.streams(c, init=True) for c in range(len(self.chains))]
        thetas = np.array([ch.theta for ch in self.chains])
        compiled = self.kernel is not None and not self.track_grad
        if compiled and self.out_of_core:
            return self._place_z_read(streams, thetas, stats)
        with np.errstate(over="ignore", divide="ignore"):
            for lo, hi in self.rows.sweep(B if stats is not None else None):
                rows = np.arange(lo, hi, dtype=np.int64)
                if stats is not None:  # blocks of B rows, as bound_stats sums them
                    for a in range(lo, hi, B):
                        X, y, xi = self.rows.span(a, min(a + B, hi))
                        stats.append((first + a // B, self._bound_block(X, y, xi)))
                if compiled:  # every chain's log L~ in one read of the rows
                    vals = np.empty((len(self.chains), rows.size))
                    kind, par = self.kernel
                    self.jit.eval_rows_at(
                        self.rows.XC, self.n_features, self.rows.locate(rows), thetas, kind,
                        par, vals,
                    )  # fmt: skip
                    self._check_held(vals, thetas, rows)
                for c, (st, ch) in enumerate(zip(streams, self.chains, strict=True)):
                    v, dv = (vals[c], None) if compiled else self._row_evaluator(ch)(rows)
                    explicit_accept(st, ch.bright, rows, v, dv)
                self.rows.keep([ch.bright.members for ch in self.chains])
        # The first z-update's rows are read ahead by the next settle (set_q's, or the
        # next round's), not here: in set-up the q is still ShardConfig's placeholder
        # (0.01) until the driver's set_q, and its proposals with 4 chains are ~4 % of
        # the rows (measured: 2.4 GB per worker at 10⁸ × 57 out of core, read at random
        # and dropped at once by set_q)
        self._unsettled = True
        return len(self.chains) * self.n

    def _place_z_read(
        self, streams: list[RowStreams], thetas: np.ndarray, stats: BlockFold | None
    ) -> int:
        """:meth:`_place_z` out of core, compiled: each block of the row file evaluated
        as read (:meth:`~flymc_dist.shard.rows.FileRows.sweep_read`), and only the rows
        that turn bright in some chain taken in: the same values, so the same draws and
        sums, without the block held in the resident rows as well."""
        B, first, _ = self._blocking()
        kind, par = self.kernel
        D = self.n_features
        with np.errstate(over="ignore", divide="ignore"):
            for lo, hi, X, XC, y, xi in self.rows.sweep_read(B if stats is not None else None):
                if stats is not None:  # blocks of B rows, as bound_stats sums them
                    for a in range(lo, hi, B):
                        s = slice(a - lo, min(a + B, hi) - lo)
                        xs = None if xi is None else xi[s]
                        stats.append((first + a // B, self._bound_block(X[s], y[s], xs)))
                rows = np.arange(lo, hi, dtype=np.int64)
                vals = np.empty((len(self.chains), rows.size))
                self.jit.eval_rows_at(XC, D, rows - lo, thetas, kind, par, vals)
                self._check_held(vals, thetas, rows)
                bright = []
                for c, (st, ch) in enumerate(zip(streams, self.chains, strict=True)):
                    explicit_accept(st, ch.bright, rows, vals[c], None)
                    m = ch.bright.members
                    bright.append(m[np.searchsorted(m, lo) : np.searchsorted(m, hi)])
                self.rows.take_in(np.unique(np.concatenate(bright)), lo, XC, y, xi)
                del X, XC, y, xi, vals
        self._unsettled = True  # as in _place_z: the first z-update's rows read by settle
        return len(self.chains) * self.n

    def drawn(self, aheads: tuple[int, ...] = (0,)) -> list[tuple[tuple, np.ndarray, np.ndarray]]:
        """The shard-local rows every chain's z-update ``ahead`` steps after its next one
        proposes (implicit; the explicit update: selects), its Bernoulli process at that
        step — known now, whatever θ and z become: for each of ``aheads``, ``(key, rows,
        seg)``, chain c's rows sorted at ``rows[seg[c]:seg[c + 1]]``.

        Drawn once and kept (:meth:`settle` draws the next z-updates' ahead, the z-update
        takes them), under ``key``: everything the draw depends on that can change (the
        generation, the update, its probability, each chain's step), so a kept draw is
        never stale. Draws of steps the chains have passed are forgotten."""
        implicit = self.config.z_update == "implicit"
        p = self.q_db if implicit else float(self.config.resample_fraction)
        head = (self.generation, implicit, p)
        now = [ch.step for ch in self.chains]
        out = []
        for ahead in aheads:
            key = (*head, tuple([s + ahead for s in now]))
            got = self._draws.get(key)
            if got is None:
                streams = [self.streams(c, ahead=ahead) for c in range(len(now))]
                keys = [st.propose if implicit else st.select for st in streams]
                lo = np.full(len(now), self.spec.start, dtype=np.int64)
                rows, seg = bernoulli_rows_many(
                    np.array(keys, np.uint64), p, self.n_total, lo, lo + self.n
                )
                first = min(now, default=0)  # forget what no chain will propose again
                self._draws = {
                    k: v
                    for k, v in self._draws.items()
                    if k[:3] == head and max(k[3], default=0) >= first
                }
                got = self._draws[key] = (rows - self.spec.start, seg)
            out.append((key, *got))
        return out

    def settle(self) -> None:
        """The work a z-update leaves for after the round's reply (a host runs it once
        the reply has gone: :meth:`~flymc_dist.transport.host.ShardHost.settle`; else the
        next round starts with it): draw the rows each chain's next z-update will
        propose (:meth:`drawn`, for
        :func:`~flymc_dist.shard.batched.batched_z_update`); out of core also drop the
        rows no chain has bright any more, read and prepare the proposed rows of the
        next z-updates (:data:`ROWS_AHEAD` of them:
        :meth:`~flymc_dist.shard.rows.FileRows.read_ahead`), and have the page cache
        fetch those of the one after (drawn now, read by the next call). Nothing here
        changes a draw: a z-update draws and reads whatever it lacks."""
        if not self._unsettled:
            return
        if self.flymc and self.chains and (self.batched_z or self.out_of_core):
            if self.out_of_core:
                self.rows.keep([ch.bright.members for ch in self.chains])
                self._reread_lost()
                # the batched z-update's next few (a few hundred rows each); else the next
                # only (the explicit update's rows are a fraction of the shard's)
                ahead = self.read_ahead_depth() if self.batched_z else 1
                drawn = self.drawn(tuple(range(ahead + 1)))
                self.rows.read_ahead([(key, rows) for key, rows, _ in drawn[:-1]], drawn[-1][1])
            else:
                self.drawn()
        self._unsettled = False  # not before: after an error the next round tries again

    def read_ahead_depth(self) -> int:
        """Out of core, how many z-updates' proposals :meth:`settle` reads ahead: at
        most :data:`ROWS_AHEAD`, and as many as fit in half the shard's memory budget
        (no budget: :data:`ROWS_AHEAD`); none when one does not fit there (each z-update
        then reads its proposals as it runs, holding one z-update's rows, not two).

        A z-update proposes about ``q · n`` rows per chain; each read ahead is held as it
        was read, then prepared (features and row constants in float64, target, tight
        point), with a copy while it is prepared: about ``8 (4 D + K + 5)`` bytes a row.
        At 5·10⁵ rows × 10 features a shard, q = 0.05 and 4 chains that is ~40 MB a
        z-update, 160 MB for four: more than a 400 MB worker can spare."""
        if self.memory_budget is None:
            return ROWS_AHEAD
        per_update = self.proposal_bytes()
        fit = int((self.memory_budget // 2) // max(per_update, 1.0))
        return min(ROWS_AHEAD, fit)

    def proposal_bytes(self) -> float:
        """About the bytes one step's proposals of every chain take, read and prepared
        (what a read-ahead request's reply carries per step, with room for its copies:
        :meth:`read_ahead_depth` counts the same)."""
        return _proposal_bytes(self.n, self.n_features, self._K, self.config, self.q_db)

    def ahead_steps(self, want: int) -> int:
        """How many steps of proposals one :meth:`proposals` request may ask of this
        shard (the driver's read-ahead in replica mode, :class:`~flymc_dist.ahead.ReadAhead`):
        ``want``, and out of core no more than fit in half the shard's memory budget (as
        :meth:`read_ahead_depth` counts them), at least one.

        A request of ``count`` steps reads and sends about ``count · q · n`` rows per
        chain: at 5·10⁵ rows × 10 features a shard, q = 0.05, 4 chains and 16
        steps, nearly every row of the shard, several times over (measured: 1.47 GB in one
        process holding two such shards, where in memory they take 120 MB)."""
        want = max(1, int(want))
        if not self.out_of_core or self.memory_budget is None:
            return want
        per_step = self.proposal_bytes()
        fit = int((self.memory_budget // 2) // max(per_step, 1.0))
        return max(1, min(want, fit))

    def after_z(self) -> None:
        """After a z-update: the rows hold at least the rows bright in some chain
        (:meth:`settle` drops the others, after the reply)."""
        if self.out_of_core:
            self._reread_lost()
        self._unsettled = True

    def _reread_lost(self) -> None:
        """Out of core: read back any row some chain has bright that is not resident.

        None should be: a z-update makes the rows that turn bright resident, and
        :meth:`settle` keeps every bright row. Once, in CI, a round found a bright row
        missing (not reproduced here in some thousand runs); its values are the row
        file's, so reading it back keeps the draws exact where the round would have
        failed. Each such row is counted (``lost_rows`` in :meth:`state`) and logged,
        with whether the chain's two views of its bright rows agree."""
        bright = [ch.bright.members for ch in self.chains]
        if not self.rows.lacks(bright):  # the usual case
            return
        lost = self.rows.fetch(np.concatenate(bright))
        agree = [
            bool(np.array_equal(np.sort(ch.bright.idx), ch.bright.members)) for ch in self.chains
        ]
        log.warning(
            "out-of-core shard %d: %d bright rows were not resident (first %s; step %s; "
            "bright rows and their sorted copy agree per chain: %s): read back",
            self.spec.shard_id,
            lost.size,
            lost[:5].tolist(),
            [ch.step for ch in self.chains],
            agree,
        )
        self.lost_rows += int(lost.size)

    # -------------------------------------------------------------- evaluation
    def _bright_eval(
        self, thetas: np.ndarray, rows: np.ndarray, grad: bool
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """``log L~`` of ``rows`` at each of ``thetas`` (k, P): (k, m), (k, m, E) or None, X."""
        if not grad and self.kernel is not None:
            return self._bright_eval_many([(thetas, rows)], False)[0]
        m = self.model
        X, y, xi = self._gather(rows)
        if self.replica or not rows.size:
            vals, dvals = bright_terms(m, m.linear_predictor(thetas, X), y, xi, grad)
            self._check_held(vals, thetas, rows)
            return vals, dvals, X
        # the shards' own sums: each block's rows in a product of their own, so that a
        # row's value (BLAS rounds by where a row sits in a product) is the same in
        # every layout, as the sums by block need
        order, _, starts = self.block_groups(rows)
        vals = np.empty((thetas.shape[0], rows.size))
        dvals = np.empty((thetas.shape[0], rows.size, m.n_outputs)) if grad else None
        for a, b in zip(starts, np.append(starts[1:], rows.size), strict=True):
            at = order[a:b]
            v, d = bright_terms(
                m, m.linear_predictor(thetas, X[at]), y[at], None if xi is None else xi[at], grad
            )
            vals[:, at] = v
            if grad:
                dvals[:, at] = d
        self._check_held(vals, thetas, rows)
        return vals, dvals, X

    def _check_held(self, vals: np.ndarray, thetas: np.ndarray, rows: np.ndarray) -> None:
        """The guard (:func:`~flymc_dist.terms.check_bounds_held`) over ``vals`` (k, m):
        ``rows`` at each of ``thetas`` (k, P)."""
        k, n = vals.shape
        check_bounds_held(
            vals.ravel(),
            np.arange(k + 1) * n,
            thetas,
            lambda j: int(rows[j % n] + self.spec.start),
            self.model,
        )

    def _bright_eval_many(
        self, segments: list[tuple[np.ndarray, np.ndarray]], grad: bool
    ) -> list[tuple[np.ndarray, np.ndarray | None, np.ndarray]]:
        """:meth:`_bright_eval` of several ``(thetas (k, P), rows)`` segments in one pass.

        The linear predictors are computed per segment (one small matmul each); the
        model's per-datum work then runs once over all segments together, which is what
        makes a round over C chains cost little more than a round over one.
        """
        if not grad and self.kernel is not None:
            return [(v, None, None) for v, _ in self._compiled_eval(segments)]
        if len(segments) <= 1 or not self.replica:  # the shards' sums: block by block
            return [self._bright_eval(t, r, grad) for t, r in segments]
        rows = [self._gather(r) for _, r in segments]
        terms = bright_terms_many(
            self.model,
            [(t, X, y, xi) for (t, _), (X, y, xi) in zip(segments, rows, strict=True)],
            grad,
        )
        for (t, r), (v, _) in zip(segments, terms, strict=True):
            self._check_held(v, t, r)
        return [(v, d, X) for (v, d), (X, _, _) in zip(terms, rows, strict=True)]

    def _compiled_values(
        self, rows: np.ndarray, thetas: np.ndarray, seg: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Compiled ``log L~`` of ``rows`` laid out in segments — rows ``seg[i]:seg[i+1]``
        at ``thetas[i]`` (P,) — in one compiled pass. Returns the values and each
        segment's sum."""
        vals = np.empty(rows.size)
        sums = np.empty(seg.size - 1)
        kind, par = self.kernel
        self.jit.eval_rows(
            self._lists(),
            self.n_features,
            self.rows.locate(rows),
            seg,
            np.zeros(seg.size - 1, np.int64),
            thetas,
            kind,
            par,
            vals,
            sums,
        )
        check_bounds_held(vals, seg, thetas, lambda j: int(rows[j] + self.spec.start), self.model)
        return vals, sums

    def _compiled_eval(
        self, segments: list[tuple[np.ndarray, np.ndarray]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``log L~`` of several ``(thetas (k, P), rows)`` segments without gradients,
        through the model's compiled form (E = 1), in one pass: each segment's
        values (k, rows) and their sums (k,)."""
        if not segments:
            return []
        if all(t.shape[0] == 1 for t, _ in segments):  # the usual case: no tiling
            rows = np.concatenate([r for _, r in segments]) if len(segments) > 1 else segments[0][1]
            thetas = np.concatenate([t for t, _ in segments])
            sizes = [r.size for _, r in segments]
        else:  # k points per segment: its rows once per point
            rows = np.concatenate([np.tile(r, t.shape[0]) for t, r in segments])
            thetas = np.concatenate([t for t, _ in segments])
            sizes = [r.size for t, r in segments for _ in range(t.shape[0])]
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        vals, sums = self._compiled_values(rows, thetas, np.array(bounds, dtype=np.int64))
        out, off, j = [], 0, 0
        for t, r in segments:
            k, n = t.shape[0], r.size
            out.append((vals[off : off + k * n].reshape(k, n), sums[j : j + k]))
            off += k * n
            j += k
        return out

    def _row_evaluator(self, ch: _Chain):
        grad = self.track_grad

        def evaluate(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
            vals, dvals, _ = self._bright_eval(ch.theta[None], rows, grad)
            return vals[0], (dvals[0] if dvals is not None else None)

        return evaluate

    def _regular_eval(self, thetas: np.ndarray, grad: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """``sum_n l_n`` over each block of the shard's rows (:meth:`tree_blocks`) at each
        of ``thetas`` (k, P): ``(nb, k)``, and the gradients ``(nb, k, P)`` (or None).
        Every block is evaluated alone, so its sums are the same bits in every layout."""
        B, _, nb, _ = self.tree_blocks()
        k = thetas.shape[0]
        sums = np.empty((nb, k))
        grads = np.empty((nb, k, self.n_params)) if grad else None
        for j, (X, y, _) in enumerate(self.blocks(B)):
            s, g = self._regular_block(thetas, X, y, grad)
            sums[j] = s
            if grad:
                grads[j] = g
        return sums, grads

    def _regular_block(
        self, thetas: np.ndarray, X: np.ndarray, y: np.ndarray, grad: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """``sum_n l_n`` over the rows ``(X, y)`` at each of ``thetas`` (and gradients)."""
        m = self.model
        eta = m.linear_predictor(thetas, X)
        if grad:
            ll, dl = m.loglik_grad(eta, y)
            return ll.sum(axis=1), m.grad_theta(dl, X)
        return m.loglik(eta, y).sum(axis=1), None

    # --------------------------------------------------------------- the round
    def _commit(self, ch: _Chain, j: int) -> None:
        ch.theta = ch.last_points[j].copy()
        if self.flymc:
            ch.bright.set_values(
                ch.last_vals[j], ch.last_dvals[j] if ch.last_dvals is not None else None
            )
        else:
            ch.cur_sum = ch.last_vals[:, j]
            ch.cur_grad = ch.last_dvals[:, j] if ch.last_dvals is not None else None

    def update_z_each(self) -> np.ndarray:
        """Update every chain's z at its current θ, shard by shard: explicit updates, kept
        gradients, models without a compiled ``log L~`` (the compiled implicit update is
        :func:`~flymc_dist.shard.batched.batched_z_update`; either through
        :func:`~flymc_dist.shard.round.update_z`). One evaluation for all chains.

        Each chain draws from its own stream in the same order as a chain-by-chain
        update would, so the result does not depend on the batching.
        """
        track = self.track_grad
        implicit = self.config.z_update == "implicit"
        q = self.q_db
        props = []
        streams = [self.streams(c) for c in range(len(self.chains))]
        for st, ch in zip(streams, self.chains, strict=True):
            if implicit:
                props.append(implicit_propose(st, ch.bright, q))
            else:
                fraction = self.config.resample_fraction
                props.append((None, explicit_propose(st, ch.bright, fraction)))
        if self.out_of_core:
            self.rows.fetch(np.concatenate([rows for _, rows in props]))
        segs = [(ch.theta[None], rows) for ch, (_, rows) in zip(self.chains, props, strict=True)]
        live = [i for i, (_, rows) in enumerate(segs) if rows.size]
        evals = (
            dict(zip(live, self._bright_eval_many([segs[i] for i in live], track), strict=True))
            if live
            else {}
        )
        queries = np.zeros(len(self.chains), dtype=np.int64)
        for c, (ch, (darken, rows)) in enumerate(zip(self.chains, props, strict=True)):
            if c in evals:
                v, d, _ = evals[c]
                vals, dvals = v[0], (d[0] if d is not None else None)
            else:
                vals, dvals = np.empty(0), (np.empty((0, self.model.n_outputs)) if track else None)
            if implicit:
                implicit_accept(streams[c], ch.bright, q, darken, rows, vals, dvals)
            else:
                explicit_accept(streams[c], ch.bright, rows, vals, dvals)
            queries[c] = rows.size
            ch.step += 1
        self.after_z()
        return queries

    @property
    def batched_z(self) -> bool:
        """Whether the z-update runs compiled, all chains at once
        (:func:`~flymc_dist.shard.batched.batched_z_update`): implicit
        updates, no gradients, and a model with a compiled ``log L~``."""
        return (
            self.flymc
            and self.config.z_update == "implicit"
            and not self.track_grad
            and self.kernel is not None
        )

    def _lists(self) -> Any:
        """This shard's buffer as a one-element typed list (the kernels' form)."""
        return typed_lists([self], self)

    def _flymc_points(
        self,
        requests: list[Request | None],
        current: np.ndarray,
        current_grad: np.ndarray | None,
        points: np.ndarray,
        points_grad: np.ndarray | None,
        n_bright: np.ndarray,
        queries: np.ndarray,
    ) -> None:
        """Evaluate every chain's requested points on its bright rows (one batched pass);
        the sums per block (the arrays' leading axis: the shard's blocks)."""
        want = [
            c
            for c, r in enumerate(requests)
            if r is not None and r.points.shape[0] and self.chains[c].bright.n_bright
        ]
        grad = any(requests[c].grad for c in want)
        segments = [(requests[c].points, self.chains[c].bright.idx) for c in want]
        if not grad and self.kernel is not None:  # compiled
            results = {
                c: (v, None, None)
                for c, (v, _) in zip(want, self._compiled_eval(segments), strict=True)
            }
        else:
            results = dict(zip(want, self._bright_eval_many(segments, grad), strict=True))
        for c, ch in enumerate(self.chains):
            req = requests[c]
            rows = ch.bright.idx
            M = rows.size
            groups = self.block_groups(rows)
            order, blocks, starts = groups
            if req is not None and req.points.shape[0]:
                k = req.points.shape[0]
                if c in results:
                    vals, dvals, X = results[c]
                    points[blocks, c, :k] = np.add.reduceat(vals[:, order], starts, axis=1).T
                    if req.grad:
                        points_grad[blocks, c, :k] = self._block_grads(dvals, X, groups)
                else:  # nothing bright: the bright sum is empty
                    vals = np.zeros((k, 0))
                    dvals = np.zeros((k, 0, self.model.n_outputs)) if req.grad else None
                ch.last_points, ch.last_vals, ch.last_dvals = req.points, vals, dvals
                queries[c] += k * M
            if req is not None and req.current_grad:
                if ch.bright.dvals is None:
                    raise RuntimeError("gradient kernel on a shard built without track_grad")
                if M:
                    current_grad[blocks, c] = self._block_grads(
                        ch.bright.dvals[None], self._gather(rows)[0], groups
                    )[:, 0]
            n_bright[c] = M
            if M:
                current[blocks, c] = np.add.reduceat(ch.bright.vals[order], starts)

    def _block_grads(
        self, dvals: np.ndarray, X: np.ndarray, groups: tuple[np.ndarray, np.ndarray, np.ndarray]
    ) -> np.ndarray:
        """The gradients of ``k`` bright sums, per group of :meth:`block_groups`: ``dvals``
        (k, M, E) and ``X`` (M, D) of the rows; returns (groups, k, P), each group's
        gradient taken over its rows alone."""
        order, _, starts = groups
        ends = np.append(starts[1:], order.size)
        return np.stack(
            [
                self.model.grad_theta(dvals[:, order[a:b]], X[order[a:b]])
                for a, b in zip(starts, ends, strict=True)
            ]
        )

    def tree_blocks(self) -> tuple[int, int, int, int]:
        """The fixed blocks a round's sums are taken by (:mod:`flymc_dist.reduce`): their
        rows ``B``, this shard's first block, its number of blocks, and the number of
        blocks over all N rows."""
        B, first, n_blocks = self._blocking()
        return B, first, -(-self.n // B), n_blocks

    def block_groups(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Shard-local ``rows`` grouped by block: ``(order, blocks, starts)``, where
        ``rows[order]`` holds each block's rows together (in their order in ``rows``),
        ``blocks[g]`` is group g's shard-local block and ``starts[g]`` where it begins
        in ``order``."""
        bid = np.asarray(rows, dtype=np.int64) // self.tree_blocks()[0]
        order = np.argsort(bid, kind="stable")
        sb = bid[order]
        if not sb.size:
            return order, sb, sb
        starts = np.flatnonzero(np.concatenate([[True], sb[1:] != sb[:-1]]))
        return order, sb[starts], starts

    def tree_reply(
        self,
        current: np.ndarray,
        points: np.ndarray,
        n_bright: np.ndarray,
        queries: np.ndarray,
        current_grad: np.ndarray | None = None,
        points_grad: np.ndarray | None = None,
    ) -> Reply:
        """A round's :class:`Reply` from per-block sums (leading axis: the shard's blocks),
        folded along the fixed block tree (:func:`~flymc_dist.reduce.fold_blocks`):
        O(log blocks) sums per field, which the driver completes in every layout alike."""
        _, first, _, n_blocks = self.tree_blocks()
        tree, cur = fold_blocks(current, first, n_blocks)

        def fold(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else fold_blocks(a, first, n_blocks)[1]

        return Reply(
            cur, fold(points), n_bright, queries, fold(current_grad), fold(points_grad), tree
        )

    def _regular_points(
        self,
        requests: list[Request | None],
        current: np.ndarray,
        current_grad: np.ndarray | None,
        points: np.ndarray,
        points_grad: np.ndarray | None,
        n_bright: np.ndarray,
        queries: np.ndarray,
    ) -> None:
        """Full-data sums at every chain's requested points (all chains in one pass), per
        block: the arrays' leading axis is the shard's blocks."""
        want = [c for c, r in enumerate(requests) if r is not None and r.points.shape[0]]
        if want:
            grad = any(requests[c].grad for c in want)
            sums, grads = self._regular_eval(
                np.concatenate([requests[c].points for c in want]), grad
            )
            off = 0
            for c in want:
                req = requests[c]
                k = req.points.shape[0]
                s_c = sums[:, off : off + k]
                g_c = grads[:, off : off + k] if grads is not None else None
                off += k
                points[:, c, :k] = s_c
                if req.grad:
                    points_grad[:, c, :k] = g_c
                ch = self.chains[c]
                ch.last_points, ch.last_vals, ch.last_dvals = req.points, s_c, g_c
                queries[c] += k * self.n
        for c, ch in enumerate(self.chains):
            req = requests[c]
            if req is not None and req.current_grad:
                if ch.cur_grad is None:
                    _, g = self._regular_eval(ch.theta[None], True)
                    ch.cur_grad = g[:, 0]
                    queries[c] += self.n
                current_grad[:, c] = ch.cur_grad
            current[:, c] = ch.cur_sum
            n_bright[c] = self.n

    def commit_all(self, commits: np.ndarray) -> None:
        """Step 1 of a round: every chain to its committed θ (see
        :func:`~flymc_dist.shard.round.round_shards`)."""
        for c, ch in enumerate(self.chains):
            # A chain whose position was set explicitly (start, recovery) has no batch of
            # its own yet: the driver set it at the committed θ, so there is nothing to commit.
            j = int(commits[c])
            if j >= 0 and ch.last_points is not None:
                self._commit(ch, j)

    def move_to(self, thetas: np.ndarray) -> np.ndarray:
        """Step 1 of a replica-mode round: each chain to its new θ (``thetas[c]``); the
        implicit update's bright→dark moves then need ``log L~`` of its bright rows there.
        Returns the queries, per chain."""
        queries = np.zeros(len(self.chains), dtype=np.int64)
        for c, ch in enumerate(self.chains):
            ch.theta = np.array(thetas[c], dtype=float)
        if self.config.z_update == "implicit":
            live = [c for c, ch in enumerate(self.chains) if ch.bright.n_bright]
            evals = self._bright_eval_many(
                [(self.chains[c].theta[None], self.chains[c].bright.idx) for c in live], False
            )
            for c, (v, _, _) in zip(live, evals, strict=True):
                self.chains[c].bright.set_values(v[0], None)
                queries[c] += v.shape[1]
        return queries

    def bright_change(self, queries: np.ndarray) -> ReplicaReply:
        """Step 3 of a replica-mode round: each chain's bright rows that went dark and
        those that became bright (with their features, target and tight point) since its
        last reply, or its whole set (``full``) after a redraw of z."""
        C = len(self.chains)
        full = np.zeros(C, dtype=bool)
        gone, new = [], []
        for c, ch in enumerate(self.chains):
            now = ch.bright.members
            before = self._sent[c]
            if before is None:
                full[c] = True
                gone.append(np.empty(0, dtype=np.int64))
                new.append(now)
            elif np.array_equal(now, before):
                gone.append(now[:0])  # the usual case: z of this shard's rows unchanged
                new.append(now[:0])
            else:
                gone.append(before[~in_sorted(before, now)])
                new.append(now[~in_sorted(now, before)])
            self._sent[c] = now
        new_rows = np.concatenate(new)
        new_X, new_y, new_xi = self._gather(new_rows)
        return ReplicaReply(
            n_bright=np.array([ch.bright.n_bright for ch in self.chains], dtype=np.int64),
            queries=queries,
            full=full,
            gone_ids=np.concatenate(gone) + self.spec.start,
            gone_seg=np.cumsum([0] + [g.size for g in gone]).astype(np.int64),
            new_ids=new_rows + self.spec.start,
            new_seg=np.cumsum([0] + [r.size for r in new]).astype(np.int64),
            new_X=new_X,
            new_y=new_y,
            new_xi=new_xi,
        )

    def bright_rows(self) -> ReplicaReply:
        """Every chain's whole bright set with its rows (``full``), z unchanged: how a
        driver that updates z itself (:mod:`flymc_dist.ahead`) takes the shards' exact
        draw of z (at placement, resume, recovery)."""
        self._sent = [None] * len(self.chains)
        return self.bright_change(np.zeros(len(self.chains), dtype=np.int64))

    def set_bright(
        self, thetas: np.ndarray, bright: list[np.ndarray], step: int, generation: int
    ) -> int:
        """Take the driver's z (it updated z itself: :mod:`flymc_dist.ahead`): every
        chain at ``thetas[c]`` with the global rows ``bright[c]`` (sorted) of this shard
        bright, its z-updates continuing at ``step`` of the streams of ``generation`` —
        where the driver's would have. Their ``log L~`` (and slopes, when kept) are
        evaluated at θ; out of core the rows are made resident. Returns the queries."""
        self.generation = int(generation)
        track = self.track_grad
        queries = 0
        local = [np.asarray(b, dtype=np.int64) - self.spec.start for b in bright]
        if self.out_of_core:
            self.rows.fetch(np.concatenate(local))
        for c, ch in enumerate(self.chains):
            ch.theta = np.array(thetas[c], dtype=float)
            ch.step = int(step)
            ch.last_points = ch.last_vals = ch.last_dvals = None
            b = BrightSet(self.n, self.model.n_outputs, track)
            rows = local[c]
            if rows.size:
                vals, dvals, _ = self._bright_eval(ch.theta[None], rows, track)
                b.idx, b.members = rows.copy(), rows.copy()
                b.set_values(vals[0], None if dvals is None else dvals[0])
                queries += int(rows.size)
            ch.bright = b
        if self.out_of_core:
            self.rows.keep([ch.bright.members for ch in self.chains])
        self._sent = [ch.bright.members for ch in self.chains]
        self.round_seq, self.round_reply = None, None
        self._unsettled = True
        self.total_queries += queries
        return queries

    def proposals(self, first: int, count: int, generation: int) -> Proposals:
        """The rows of this shard each chain's implicit z-update proposes dark→bright at
        steps ``first .. first + count - 1`` of the streams of ``generation`` (its
        Bernoulli(q) process: known whatever θ and z are), with their data: what a driver
        that updates z itself reads ahead (:class:`~flymc_dist.protocol.Proposals`), the
        features in the dtype they are stored in, their row constants as this shard's own
        z-update reads them. Out of core the rows are read from the row file by
        position."""
        if not self.flymc or self.config.z_update != "implicit":
            raise ValueError("proposals are the implicit FlyMC z-update's")
        return propose(
            self.rows.rows_and_constants,
            self.config.seed,
            len(self.chains),
            self.q_db,
            self.n_total,
            self.spec.start,
            self.n,
            self._stored,
            Ahead(first, count, generation),
        )

    def lend(self) -> tuple[list[int], dict[str, Any]]:
        """This shard's in-memory rows as a driver on this machine reads its proposals
        from them (:mod:`flymc_dist.shard.shared`): the descriptors of the shared memory
        they live in, and what :func:`propose` needs besides. A ``ValueError`` when the
        rows are out of core or in private memory, or no tight points are set."""
        if self.out_of_core or not self.flymc or self.config.z_update != "implicit":
            raise ValueError("only an in-memory shard's implicit z-update lends its rows")
        fds, meta = self.rows.lend()
        meta.update(
            shard_id=self.spec.shard_id,
            start=self.spec.start,
            n_total=self.n_total,
            seed=self.config.seed,
            chains=len(self.chains),
            q=self.q_db,
            stored=self._stored.str,
        )
        return fds, meta

    def round_sums(self, requests: list[Request | None], queries: np.ndarray) -> Reply:
        """Step 3 of a round: the sums (and gradients where asked) at every chain's
        current θ and requested points, over its bright rows (FlyMC) or all rows, taken
        per block and folded along the fixed block tree (:meth:`tree_reply`)."""
        C = len(self.chains)
        P = self.n_params
        nb = self.tree_blocks()[2]
        kmax = max((r.points.shape[0] for r in requests if r is not None), default=0)
        any_grad = any(r is not None and r.grad for r in requests)
        any_cgrad = any(r is not None and r.current_grad for r in requests)
        current = np.zeros((nb, C))
        points = np.zeros((nb, C, kmax))
        for c, r in enumerate(requests):  # NaN beyond each chain's own points
            points[:, c, 0 if r is None else r.points.shape[0] :] = np.nan
        points_grad = np.zeros((nb, C, kmax, P)) if any_grad else None
        current_grad = np.zeros((nb, C, P)) if any_cgrad else None
        n_bright = np.zeros(C, dtype=np.int64)
        fill = self._flymc_points if self.flymc else self._regular_points
        fill(requests, current, current_grad, points, points_grad, n_bright, queries)
        return self.tree_reply(current, points, n_bright, queries, current_grad, points_grad)

    # ------------------------------------------------- the add-on samplers' interface
    def rows_at(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Features, target and tight point (None: none set) of the shard-local ``rows``
        (distinct, any order), as new float64 arrays in that order.

        In memory a gather; out of core a read of those rows from the row file (counted
        in ``state()["bytes_read"]``), with their tight points computed at the shard's
        θ̂. The values are the same either way.
        """
        return self.rows.rows_at(np.asarray(rows, dtype=np.int64))

    def blocks(
        self, block: int | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """Every row, as read-only ``(X, y, xi)`` blocks of ``block`` rows (None: one
        block; ``xi`` None when no tight points are set): a full pass. Out of core, the
        blocks are read from the row file, one ahead."""
        return self.rows.blocks(block)

    def extension(self, name: str, factory: Callable[[], _T]) -> _T:
        """The per-shard state of the add-on sampler ``name``: ``factory()`` on first use,
        then the same object for the shard's lifetime (a recreated shard starts afresh).

        The one place an add-on sampler (austerity) keeps state on a shard; the shard
        never reads it.
        """
        try:
            return self._extensions[name]
        except KeyError:
            state = self._extensions[name] = factory()
            return state

    def count_queries(self, n: int) -> None:
        """Add ``n`` likelihood queries made here by an add-on sampler to
        :attr:`total_queries`."""
        self.total_queries += int(n)

    def operation(self, name: str, *args: Any) -> Any:
        """Run the shard operation ``name`` here, as ``function(self, *args)``: how an
        add-on sampler (austerity) computes beside the rows.

        ``name`` is ``"module:function"`` of a function its own module marked with
        :func:`flymc_dist.protocol.shard_operation` (:func:`~flymc_dist.protocol.resolve_operation`
        imports it here, so a worker knows it whatever it imported before); anything else
        is refused. An operation sees the rows only through the shard's public read-only
        view (:meth:`rows_at`, :meth:`blocks`: the same in memory and out of core) and
        keeps its state in its one named slot (:meth:`extension`), so the bright sets,
        streams and caches stay the shard's own.
        """
        return resolve_operation(name)(self, *args)

    def state(self) -> dict[str, Any]:
        """Counters and brightness for inspection (tests, fault logs)."""
        return {
            "shard_id": self.spec.shard_id,
            "n_rows": self.n,
            "out_of_core": self.out_of_core,
            "memory_budget": self.memory_budget,
            **self.rows.state(),
            "generation": self.generation,
            "total_queries": self.total_queries,
            "lost_rows": self.lost_rows,
            "n_bright": [
                ch.bright.n_bright if ch.bright is not None else self.n for ch in self.chains
            ],
        }

    def close(self) -> None:
        """Release the rows now (out of core: remove the row file)."""
        self.rows.close()


def typed_lists(shards: list[Shard], owner: Any = None) -> Any:
    """The shards' row buffers (``rows.XC``) as a numba typed list (the kernels' form).

    Building one costs more than a round's update, so it is kept on ``owner`` (its
    ``typed_cache``: a :class:`Shard` or a :class:`~flymc_dist.shard.group.ShardGroup`)
    and rebuilt only when the shards or their buffers change (an out-of-core shard's
    grows now and then). The kept tuple holds the shards, so the ids in its key stay
    theirs — all but the owner itself, which outlives its own attribute: holding it there
    would be a reference cycle, keeping a finished run's rows in a worker's memory until
    the garbage collector ran. Without an owner it is built afresh.
    """
    key = tuple((id(sh), id(sh.rows.XC)) for sh in shards)
    cache = None if owner is None else owner.typed_cache
    if cache is not None and cache[0] == key:
        return cache[2]
    lists = (
        key,
        [sh for sh in shards if sh is not owner],
        shards[0].jit.typed_list([sh.rows.XC for sh in shards]),
    )
    if owner is not None:
        owner.typed_cache = lists
    return lists[2]


def _column_energy(X: np.ndarray) -> np.ndarray:
    """``Σ_n x_nj²`` and ``Σ_n x_nj⁴`` of every column of the rows ``X``: (2, D)."""
    sq = np.square(X, dtype=np.float64)
    return np.stack([sq.sum(axis=0), np.square(sq).sum(axis=0)])


def _out_of_core(mode: bool | str, nbytes: int, budget: int | None) -> bool:
    """Whether a shard whose rows take ``nbytes`` in memory stays in its store."""
    if mode == "auto":
        return budget is not None and nbytes > budget
    return bool(mode)


def _proposal_bytes(n: int, n_features: int, K: int, config: ShardConfig, q_db: float) -> float:
    """About the bytes one out-of-core z-update's proposals take, read and prepared
    (see :meth:`Shard.read_ahead_depth`)."""
    return 8 * (4 * n_features + K + 5) * config.chains * q_db * n


def _check_proposals(
    n: int, n_features: int, K: int, config: ShardConfig, q_db: float, budget: int | None
) -> None:
    """Refuse, before anything is read, an out-of-core FlyMC shard whose implicit
    z-update's proposals alone would exceed its memory budget."""
    if config.algorithm != "flymc" or config.z_update != "implicit" or budget is None:
        return
    need = _proposal_bytes(n, n_features, K, config, q_db)
    if need > budget:
        raise ValueError(
            f"out of core: q_db={q_db:g} proposes about {q_db * n * config.chains:,.0f} rows "
            f"a z-update ({need / 1e6:.1f} MB with {config.chains} chains), more than the "
            f"shard's memory budget of {budget / 1e6:.1f} MB: lower q_db, run fewer chains, "
            "or give the workers more memory (or more workers)"
        )


def _check_explicit(config: ShardConfig, nbytes: int, budget: int | None) -> None:
    """Out of core, refuse an explicit z-update whose rows resampled per iteration
    (``resample_fraction`` of ``nbytes``: every chain's rows in memory) exceed the
    shard's memory budget."""
    if config.algorithm != "flymc" or config.z_update != "explicit" or budget is None:
        return
    need = config.resample_fraction * nbytes
    if need > budget:
        raise ValueError(
            f"out of core, the explicit z-update reads resample_fraction="
            f"{config.resample_fraction} of the rows per iteration ({need / 1e6:.0f} MB here "
            f"with {config.chains} chains), more than the shard's memory budget of "
            f"{budget / 1e6:.0f} MB: use z_update='implicit' (the default) or a smaller "
            "resample_fraction"
        )


def propose(
    rows: Callable[[np.ndarray, np.dtype], tuple],
    seed: int,
    chains: int,
    q: float,
    n_total: int,
    start: int,
    n: int,
    stored: np.dtype,
    ahead: Ahead,
) -> Proposals:
    """The rows of the shard ``start .. start + n - 1`` each chain's implicit z-update
    proposes dark→bright at the steps of ``ahead`` (its Bernoulli(``q``) process: known
    whatever θ and z are), with their data as ``rows(local_rows, stored)`` gives them
    (:func:`~flymc_dist.shard.rows.rows_and_constants`): :meth:`Shard.proposals`, and
    the driver's own read of a shard lent to it (the same bits)."""
    keys = steps_keys(seed, ahead.generation, chains, ahead.first, ahead.count, Z_PROPOSE)
    lo = np.full(keys.size, start, dtype=np.int64)
    ids, seg = bernoulli_rows_many(keys, q, n_total, lo, lo + n)
    # (sorted, the inverse with it: 4-5x faster here than numpy's hashed unique alone)
    found, at = np.unique(ids, return_inverse=True)
    # the features as stored (float32: exact, and half the bytes of float64)
    X, y, xi, consts = rows(found - start, stored)
    if xi is None:
        raise ValueError("proposals need the tight points set (set_tight_points)")
    return Proposals(ids, seg, found, at.astype(np.int64, copy=False), X, y, xi, consts)


def _row_buffer(n: int, width: int, shared: bool) -> tuple[np.ndarray, Segment | None]:
    """An in-memory shard's ``(n, width)`` row buffer: in shared memory when ``shared``
    and the platform lends (with its segment), else private."""
    segment = segment_or_none(n * width * 8) if shared else None
    if segment is None:
        return np.empty((n, width)), None
    return segment.array((n, width), np.float64), segment


def _memory_rows(
    XC: np.ndarray, segment: Segment | None, n_features: int, y: Any, prepare: Any
) -> MemoryRows:
    """:class:`MemoryRows` of ``XC``, lendable when it is in shared memory (``segment``)
    and the targets and tight points find a segment too."""
    y = np.asarray(y)
    one_each = y.shape == (XC.shape[0],)  # (a target a row: what a driver reads)
    tail = (
        None if segment is None or not one_each else segment_or_none(tail_bytes(*y.shape, y.dtype))
    )
    if tail is None and segment is not None:
        segment.close()
    return MemoryRows(XC, n_features, y, prepare, None if tail is None else (segment, tail))
