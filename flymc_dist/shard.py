"""One shard: a contiguous row range of the data, with everything that lives beside it.

A :class:`Shard` owns its rows, its per-datum tight points, the bright/dark
structure of every chain, one random stream per chain and its query counters.
It is a plain Python class: in ``client="synchronous"`` mode the driver calls it
in-process; on a cluster a :class:`ShardHost` holding several shards runs as a
Dask actor on a worker. One code path, two transports.

The per-iteration protocol is :meth:`Shard.round` (see the driver): in one call
a shard commits each chain's previous decision, updates z at the committed θ
(first round trip of an iteration only), and evaluates the points the chains'
kernels asked for, returning only sums.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import operator
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from flymc_dist._numerics import log_sigmoid
from flymc_dist.austerity import shard as austerity_shard
from flymc_dist.brightness import (
    BrightSet,
    bernoulli_rows,
    brighten,
    explicit_accept,
    explicit_propose,
    explicit_update,
    implicit_accept,
    implicit_propose,
    log_uniform,
    proposal_slots,
)
from flymc_dist.chunks import Chunk, ChunkSource, RowStore, worker_memory_limit
from flymc_dist.data import open_dataset
from flymc_dist.evaluate import bright_terms, bright_terms_many
from flymc_dist.models.base import BoundStats
from flymc_dist.protocol import (
    ReplicaReply,
    Reply,
    Request,
    ShardConfig,
    ShardSpec,
    pack_reply,
    unpack_round,
)
from flymc_dist.rng import ROLE_Z, stream
from flymc_dist.transport.channel import ECHO, ROUND, ChannelServer

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The operations an add-on sampler may run on a shard, by name
#: (:meth:`Shard.operation`): ``name -> function(shard, *args)``.
#:
#: A fixed table rather than any callable sent over the wire, or a registry filled by
#: decorators as modules are imported: a shard runs only code this module names (what
#: can run next to the rows is read here, in one place); a worker knows every operation
#: once it has imported this module, whatever else it happened to import (a registry
#: filled at import time would depend on that); and the operations reach the shard only
#: through its public read-only view (:attr:`Shard.rows`, :attr:`Shard.tight_points`)
#: and their one named slot of state (:meth:`Shard.extension`), so the bright sets,
#: streams and caches stay the shard's own. An add-on sampler adds its shard-side
#: functions (in a module that does not import this one) here.
SHARD_OPERATIONS: dict[str, Callable[..., Any]] = {
    "austerity_batch": austerity_shard.shard_batch,
    "austerity_exact_diff": austerity_shard.shard_exact_diff,
}


class _Spec(NamedTuple):
    """What undoes one chain's speculative z-update (see :meth:`Shard.speculate`)."""

    rng_state: dict
    idx: np.ndarray
    vals: np.ndarray
    gone_rows: np.ndarray  # rows it darkened
    new_rows: np.ndarray  # rows it brightened
    queries: int


@dataclass
class _Chain:
    theta: np.ndarray
    rng: np.random.Generator
    bright: BrightSet | None = None  # flymc
    cur_sum: float = 0.0  # regular: sum of l_n at theta
    cur_grad: np.ndarray | None = None  # regular: its gradient when known
    last_points: np.ndarray | None = None
    last_vals: np.ndarray | None = None  # flymc (k, M) / regular (k,)
    last_dvals: np.ndarray | None = None  # flymc (k, M, E) / regular grads (k, P)
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
    ``config.out_of_core=True``) leaves them in the store and holds in memory only what
    is O(bright) or O(chunk): the rows bright in some chain (:class:`RowStore`), every
    chain's bright structure, and the store chunk the z-updates currently work on, with
    the next one read ahead (:class:`ChunkSource`). Full passes (MAP tuning, bound
    statistics, the exact draws of z, regular MCMC) stream the store chunk by chunk.
    The z-update then works on a *window*, chunk ``k = (t // r) mod m`` at the shard's
    ``t``-th z-update since its chains were placed (``m`` chunks, ``r =
    config.chunk_iterations``, by default chunk bytes / :data:`WINDOW_BYTES`): the
    implicit update (or the explicit one) restricted to
    the window's rows, its bright and dark rows alike, with the dark→bright proposal
    probability raised to ``q·n / window rows`` (capped at 1) so that as many rows are
    proposed per iteration as in memory. This is exact: the z_n are independent given
    θ, so the implicit update of any set of rows chosen without looking at z leaves
    ``p(z | θ)`` invariant (a bright row outside the window stays bright, a dark one
    dark: the identity, also invariant), for any proposal probability in (0, 1]; the
    schedule is fixed in advance, so the chain is a deterministic-scan composition of
    kernels that each leave the posterior invariant. (Updating every bright row but
    only the window's dark rows would not be: rows chosen by their state.) The price:
    a row's z is revisited only once every ``m·r`` iterations.
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
        self.model = config.model
        self.flymc = config.algorithm == "flymc"
        self.memory_budget = budget
        # FlyMC with a fused log L~ keeps each row's constants beside its features, in
        # one (n, D + K) buffer: evaluating a scattered row then touches one place in
        # memory, not two (the z-update's cost is mostly such cache misses)
        K = self._n_row_constants() if self.flymc else 0
        self.out_of_core = False
        self._source: ChunkSource | None = None
        ds = None
        if data is None:
            ds = open_dataset(spec.path, storage_options=spec.storage_options)
            n = spec.stop - spec.start
            # austerity's minibatches are random rows of the whole shard: kept in memory
            mode = config.out_of_core if config.algorithm != "austerity" else False
            self.out_of_core = _out_of_core(
                mode, n * (ds.n_features + K + 2) * 8 + config.chains * n, budget
            )
        if self.out_of_core:
            self._init_out_of_core(ds, K)
        else:
            self._init_in_memory(ds, data, K)
        self._init_common()

    def _init_in_memory(self, ds: Any, data: tuple[np.ndarray, np.ndarray] | None, K: int) -> None:
        """Load the rows (from ``ds``, or ``data``) beside their ``K`` row constants."""
        spec = self.spec
        if data is None:
            n, D = spec.stop - spec.start, ds.n_features
            self._XC = np.empty((n, D + K))
            ys = []
            for lo, hi, Xb, yb in ds.iter_chunks(spec.start, spec.stop):  # no 2nd copy
                self._XC[lo - spec.start : hi - spec.start, :D] = Xb
                ys.append(yb)
            y = np.concatenate(ys) if ys else np.empty(0)
        else:
            X, y = data
            X = np.asarray(X, dtype=np.float64)
            self._XC = np.empty((X.shape[0], X.shape[1] + K))
            self._XC[:, : X.shape[1]] = X
        D = self._XC.shape[1] - K
        self.X = self._XC[:, :D]
        self.y = np.asarray(y)
        self.n = int(self.X.shape[0])
        self.n_features = D
        self.xi = self.model.untuned_xi(self.y) if self.flymc else None
        self.consts: np.ndarray | None = self._XC[:, D:] if K else None
        self._use_compiled(K)
        self._set_row_constants()

    def _use_compiled(self, K: int) -> None:
        """Find the model's compiled fused log L~ (when it has ``K`` row constants)."""
        #: ``(kind, params)`` of the model's compiled fused log L~ (the hot path), or None
        self._kernel: tuple[int, np.ndarray] | None = None
        compiled = self.model.compiled_bright() if K else None
        if compiled is not None:
            from flymc_dist import _compiled  # numba: imported where shards compute

            self._jit = _compiled
            self._kernel = (_compiled.KINDS[compiled[0]], np.asarray(compiled[1], float))

    def _init_out_of_core(self, ds: Any, K: int) -> None:
        """Set up a shard whose rows stay in the store ``ds`` (see the class notes)."""
        self._K = K
        self._source = ChunkSource(ds, self.spec.start, self.spec.stop, self._prepare_chunk)
        self._rows = RowStore(ds.n_features, K)
        #: the z-updates' current chunk
        self._win: Chunk | None = None
        self._theta_hat: np.ndarray | None = None  # None: untuned tight points
        self._z_steps = 0  # z-updates since the chains were placed
        self.n, self.n_features = self.spec.stop - self.spec.start, ds.n_features
        #: iterations each chunk is the window (see the class notes)
        self.chunk_iterations = self.config.chunk_iterations or max(
            1, math.ceil(self._source.max_rows * (self.n_features + 1) * 8 / WINDOW_BYTES)
        )
        self.X = self.y = self.xi = self.consts = self._XC = None
        self._use_compiled(K)

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
        self._seq: Any = None
        self._reply: Reply | ReplicaReply | None = None
        self._spec: dict[int, _Spec] = {}  # chain -> its pending speculative z-update
        self._spec_pending = False  # speculate() has work to do
        self._typed: tuple | None = None  # see _typed_lists
        self._extensions: dict[str, Any] = {}  # see extension()

    # ------------------------------------------------------------------ set-up
    def set_tight_points(self, theta_hat: np.ndarray | None) -> None:
        """Tight points at ``theta_hat`` (MAP-tuned) or the model's untuned ones (None)."""
        if self.out_of_core:  # a chunk's are computed as it is read
            self._source.drop_ahead()  # before the read-ahead thread could see a new θ̂
            self._theta_hat = None if theta_hat is None else np.asarray(theta_hat, float)
            if self.flymc:
                self._rows.set_xi(*self._row_constants(self._rows.X, self._rows.y))
            self._win = None
            return
        if theta_hat is None:
            self.xi = self.model.untuned_xi(self.y)
        else:
            eta = self.model.linear_predictor(np.asarray(theta_hat, float)[None], self.X)[0]
            self.xi = self.model.tuned_xi(eta, self.y)
        self._set_row_constants()

    def _n_row_constants(self) -> int:
        """K, the number of per-row constants of the model's fused ``log L~`` (0: none)."""
        if self.model.n_outputs != 1:
            return 0
        y0 = np.zeros(1)
        c = self.model.row_constants(y0, self.model.untuned_xi(y0))
        return 0 if c is None else int(c.shape[1])

    def _set_row_constants(self) -> None:
        """(Re)compute the model's per-row constants of the fused ``log L~``, in place."""
        if self.consts is not None:
            c = self.model.row_constants(self.y, self.xi)
            if c.shape != self.consts.shape:
                raise ValueError(
                    f"{type(self.model).__name__}.row_constants gave shape "
                    f"{c.shape}, expected {self.consts.shape}"
                )
            self.consts[...] = c

    def set_q(self, q_db: float) -> None:
        """Set the dark→bright proposal probability of the implicit z-update."""
        self.q_db = float(q_db)

    def set_replica(self, on: bool) -> None:
        """Serve rounds for a driver-side replica of the bright rows (before
        :meth:`set_positions`).

        In replica mode a round carries one point per chain, the chain's current θ: the
        shard puts the chain there, updates its z at θ, and replies with the change of
        the chain's bright set since its last reply (:meth:`_replica_round`); the
        driver evaluates the θ-kernel on its replica. No gradients are kept here then.
        """
        self.replica = bool(on)
        self.track_grad = bool(self.config.track_grad) and not self.replica

    def expected_bright(self, theta: np.ndarray) -> float:
        """``Σ_n p(z_n = 1 | θ) = Σ_n −expm1(−δ_n(θ))`` over this shard's rows: the
        expected number of bright rows at ``theta`` (a full pass; set-up only)."""
        theta = np.asarray(theta, float)[None]
        m = self.model
        total = 0.0
        for X, y, xi in self._blocks(65536):
            eta = m.linear_predictor(theta, X)
            delta = np.maximum(m.loglik(eta, y) - m.logbound(eta, y, xi), 0.0)
            total += float(-np.expm1(-delta).sum())
        return total

    def bound_stats(self) -> BoundStats:
        """This shard's collapsed bound ``sum_n beta_n(theta)`` as a quadratic."""
        parts = [self.model.suffstats(X, y, xi) for X, y, xi in self._blocks()]
        return functools.reduce(operator.add, parts)

    def loglik_sum(
        self, theta: np.ndarray, order: int = 1, block: int = 65536
    ) -> tuple[float, np.ndarray | None, np.ndarray | None]:
        """``sum_n l_n(theta)`` with its gradient (order ≥ 1) and Hessian (order 2).

        Used by MAP tuning; a full pass over the shard (not counted as sampler queries).
        """
        theta = np.asarray(theta, float)[None]
        m = self.model
        E = m.n_outputs
        D = self.n_features
        val = 0.0
        grad = np.zeros(self.n_params) if order >= 1 else None
        hess = np.zeros((self.n_params, self.n_params)) if order >= 2 else None
        for X, y, _ in self._blocks(block):
            eta = m.linear_predictor(theta, X)
            if order >= 1:
                ll, dl = m.loglik_grad(eta, y)
                grad += m.grad_theta(dl, X)[0]
            else:
                ll = m.loglik(eta, y)
            val += float(ll.sum())
            if order >= 2:
                h = m.loglik_hess(eta[0], y)  # (n, E, E)
                if E == 1:
                    hess += (X * h[:, 0, 0][:, None]).T @ X
                else:
                    hk = np.einsum("nkl,nd,ne->kdle", h, X, X, optimize=True)
                    hess += hk.reshape(E * D, E * D)
        return val, grad, hess

    def _blocks(
        self, block: int | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """Every row, as ``(X, y, xi)`` blocks of ``block`` rows (None: one block): a full
        pass. Out of core, the blocks are the store's chunks, read one ahead."""
        if self.out_of_core:
            for chunk in self._source.stream():
                yield chunk.X, chunk.y, chunk.xi
            return
        step = self.n if block is None else block
        for lo in range(0, max(self.n, 1), max(step, 1)):
            xi = None if self.xi is None else self.xi[lo : lo + step]
            yield self.X[lo : lo + step], self.y[lo : lo + step], xi

    def _tight_points(self, X: np.ndarray, y: np.ndarray) -> np.ndarray | None:
        """Tight points of the rows ``(X, y)`` of an out-of-core shard (None: regular MCMC)."""
        if not self.flymc:
            return None
        if self._theta_hat is None or y.size == 0:
            return self.model.untuned_xi(y)
        return self.model.tuned_xi(self.model.linear_predictor(self._theta_hat[None], X)[0], y)

    def _row_constants(
        self, X: np.ndarray, y: np.ndarray
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Out of core: the tight points of the rows ``(X, y)`` and their row constants
        (None without a compiled log L~)."""
        xi = self._tight_points(X, y)
        return xi, (self.model.row_constants(y, xi) if self._K else None)

    def _prepare_chunk(self, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Out of core: the tight points of the rows ``(X, y)`` and the rows as one
        ``(n, D + K)`` buffer, features then row constants."""
        xi, consts = self._row_constants(X, y)
        XC = np.empty((X.shape[0], X.shape[1] + self._K))
        XC[:, : X.shape[1]] = X
        if consts is not None:
            XC[:, X.shape[1] :] = consts
        return xi, XC

    def _gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Features, target and tight point of ``rows`` (bright rows, or out of core rows of
        the current chunk)."""
        if self.out_of_core:
            return self._rows.gather(rows, self._win)
        return self.X[rows], self.y[rows], self.xi[rows]

    def set_positions(self, thetas: np.ndarray, generation: int = 0) -> int:
        """Put every chain at ``thetas[c]`` and draw its z exactly from ``p(z | θ)``.

        This is how chains start, and how a recreated shard rejoins a run: an exact
        Gibbs draw of this shard's auxiliary block, so the chain stays exact.

        Returns
        -------
        int
            Likelihood queries made.
        """
        thetas = np.asarray(thetas, float)
        self.generation = int(generation)
        sid = self.spec.shard_id
        self.chains = []
        queries = 0
        # every chain's z as one (chains, rows) array: the batched z-update reads and
        # writes all chains' masks with one fancy index each
        self._masks = np.zeros((thetas.shape[0], self.n), dtype=bool) if self.flymc else None
        for c in range(thetas.shape[0]):
            ch = _Chain(
                theta=thetas[c].copy(),
                rng=stream(self.config.seed, ROLE_Z, sid, c, self.generation),
            )
            if self.flymc:
                ch.bright = BrightSet(
                    self.n, self.model.n_outputs, self.track_grad, mask=self._masks[c]
                )
                if not self.out_of_core:
                    with np.errstate(over="ignore", divide="ignore"):
                        queries += explicit_update(ch.rng, ch.bright, 1.0, self._row_evaluator(ch))
            elif not self.out_of_core:
                s, g = self._regular_eval(ch.theta[None], self.track_grad)
                ch.cur_sum = float(s[0])
                ch.cur_grad = g[0] if g is not None else None
                queries += self.n
            self.chains.append(ch)
        if self.out_of_core:
            queries += self._place_out_of_core()
        self._seq, self._reply = None, None
        self._spec, self._spec_pending = {}, False
        self._sent = [None] * len(self.chains)  # the next replica reply sends whole sets
        self.total_queries += queries
        return queries

    def _place_out_of_core(self) -> int:
        """:meth:`set_positions` of an out-of-core shard, in one streamed pass: each
        chain's z drawn exactly from ``p(z | θ)`` (the same draws, in the same order, as
        the in-memory explicit update of every row), or its full-data sums (regular)."""
        self._win, self._z_steps = None, 0
        m, track, C = self.model, self.track_grad, len(self.chains)
        parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]] = [[] for _ in range(C)]
        held: list[tuple[np.ndarray, ...]] = []
        sums, grads = np.zeros(C), (np.zeros((C, self.n_params)) if track else None)
        thetas = np.array([ch.theta for ch in self.chains])
        lo = 0
        with np.errstate(over="ignore", divide="ignore"):
            for chunk in self._source.stream():
                X, y, xi = chunk.X, chunk.y, chunk.xi
                rows = np.arange(lo, lo + y.size, dtype=np.int64)
                lo += y.size
                if not self.flymc:
                    s, g = self._regular_block(thetas, X, y, track)
                    sums += s
                    if track:
                        grads += g
                    continue
                vals, dvals = bright_terms(m, m.linear_predictor(thetas, X), y, xi, track)
                on_any = np.zeros(y.size, dtype=bool)
                for c, ch in enumerate(self.chains):
                    z = log_uniform(ch.rng, y.size) < log_sigmoid(vals[c])
                    on_any |= z
                    parts[c].append((rows[z], vals[c][z], dvals[c][z] if track else None))
                held.append((rows[on_any], chunk.XC[on_any], y[on_any], xi[on_any]))
        if not self.flymc:
            for c, ch in enumerate(self.chains):
                ch.cur_sum = float(sums[c])
                ch.cur_grad = grads[c] if track else None
            return C * self.n
        for c, ch in enumerate(self.chains):
            rows, vals, dvals = zip(*parts[c], strict=True)
            ch.bright.replace(
                np.zeros(0, dtype=bool),
                np.concatenate(rows),
                np.concatenate(vals),
                np.concatenate(dvals) if track else None,
            )
        if held:
            self._rows.set(*(np.concatenate(a) for a in zip(*held, strict=True)))
        return C * self.n

    def _z_window(self) -> tuple[tuple[int, int], float]:
        """Out of core: the rows of this z-update's window and its proposal probability
        (see the class notes); the window's chunk is read (or taken from the read ahead)
        and the next one started."""
        src, r = self._source, self.chunk_iterations
        t, m = self._z_steps, src.n_chunks
        self._z_steps += 1
        k = (t // r) % m
        if self._win is None or self._win.lo != src.ranges[k][0]:
            self._win = src.get(k, (k + 1) % m if m > 1 else None)
        lo, hi = src.ranges[k]
        return (lo, hi), min(1.0, self.q_db * self.n / max(hi - lo, 1))

    def _hold_bright(self) -> None:
        """Out of core: hold exactly the rows bright in some chain (after a z-update)."""
        idx = [ch.bright.idx for ch in self.chains]
        self._rows.keep(np.unique(np.concatenate(idx)).astype(np.int64, copy=False), self._win)

    # -------------------------------------------------------------- evaluation
    def _bright_eval(
        self, thetas: np.ndarray, rows: np.ndarray, grad: bool
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """``log L~`` of ``rows`` at each of ``thetas`` (k, P): (k, m), (k, m, E) or None, X."""
        if not grad and self._kernel is not None:
            return self._bright_eval_many([(thetas, rows)], False)[0]
        m = self.model
        X, y, xi = self._gather(rows)
        vals, dvals = bright_terms(m, m.linear_predictor(thetas, X), y, xi, grad)
        return vals, dvals, X

    def _bright_eval_many(
        self, segments: list[tuple[np.ndarray, np.ndarray]], grad: bool
    ) -> list[tuple[np.ndarray, np.ndarray | None, np.ndarray]]:
        """:meth:`_bright_eval` of several ``(thetas (k, P), rows)`` segments in one pass.

        The linear predictors are computed per segment (one small matmul each); the
        model's per-datum work then runs once over all segments together, which is what
        makes a round over C chains cost little more than a round over one.
        """
        if not grad and self._kernel is not None:
            return [(v, None, None) for v, _ in self._fused_eval(segments)]
        if len(segments) <= 1:
            return [self._bright_eval(t, r, grad) for t, r in segments]
        rows = [self._gather(r) for _, r in segments]
        terms = bright_terms_many(
            self.model,
            [(t, X, y, xi) for (t, _), (X, y, xi) in zip(segments, rows, strict=True)],
            grad,
        )
        return [(v, d, X) for (v, d), (X, _, _) in zip(terms, rows, strict=True)]

    def _fused_values(
        self, rows: np.ndarray, thetas: np.ndarray, seg: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Fused ``log L~`` of ``rows`` laid out in segments — rows ``seg[i]:seg[i+1]``
        at ``thetas[i]`` (P,) — in one compiled pass. Returns the values and each
        segment's sum."""
        vals = np.empty(rows.size)
        sums = np.empty(seg.size - 1)
        kind, par = self._kernel
        if self.out_of_core:
            XCs, rows, seg_src = self._ooc_locate(rows, seg)
        else:
            XCs, _ = self._lists()
            seg_src = np.zeros(seg.size - 1, np.int64)
        self._jit.eval_rows(
            XCs,
            self.n_features,
            rows,
            seg,
            seg_src,
            thetas,
            kind,
            par,
            vals,
            sums,
        )
        return vals, sums

    def _fused_eval(
        self, segments: list[tuple[np.ndarray, np.ndarray]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``log L~`` of several ``(thetas (k, P), rows)`` segments without gradients,
        through the model's compiled fused form (E = 1), in one pass: each segment's
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
        vals, sums = self._fused_values(rows, thetas, np.array(bounds, dtype=np.int64))
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
        """``sum_n l_n`` over all rows at each of ``thetas`` (k, P) (and gradients)."""
        if not self.out_of_core:
            return self._regular_block(thetas, self.X, self.y, grad)
        sums, grads = np.zeros(thetas.shape[0]), (np.zeros(thetas.shape) if grad else None)
        for X, y, _ in self._blocks():
            s, g = self._regular_block(thetas, X, y, grad)
            sums += s
            if grad:
                grads += g
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
            ch.cur_sum = float(ch.last_vals[j])
            ch.cur_grad = ch.last_dvals[j] if ch.last_dvals is not None else None

    def _update_z_all(self) -> np.ndarray:
        """Update every chain's z at its current θ; one batched evaluation for all chains.

        Each chain draws from its own stream in the same order as a chain-by-chain
        update would, so the result does not depend on the batching.
        """
        track = self.track_grad
        implicit = self.config.z_update == "implicit"
        if self.fused_z:
            return self._update_z_fused()
        window, q = self._z_window() if self.out_of_core else (None, self.q_db)
        props = []
        for ch in self.chains:
            if implicit:
                props.append(implicit_propose(ch.rng, ch.bright, q, window))
            else:
                props.append(
                    (
                        None,
                        explicit_propose(ch.rng, ch.bright, self.config.resample_fraction, window),
                    )
                )
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
                implicit_accept(ch.rng, ch.bright, q, darken, rows, vals, dvals)
            else:
                explicit_accept(ch.rng, ch.bright, rows, vals, dvals)
            queries[c] = rows.size
        if self.out_of_core:
            self._hold_bright()
        return queries

    @property
    def fused_z(self) -> bool:
        """Whether the z-update runs all chains at once (:meth:`_update_z_fused`): implicit
        updates, no gradients, and a model with a compiled fused ``log L~``."""
        return (
            self.flymc
            and self.config.z_update == "implicit"
            and not self.track_grad
            and self._kernel is not None
            and not self.out_of_core
        )

    def _update_z_fused(self, sel: list[int] | None = None, record: bool = False) -> np.ndarray:
        """The implicit z-update of every chain in ``sel`` (default: all) at once: see
        :func:`fused_z_update`. Returns the likelihood queries of each chain in ``sel``."""
        sel = range(len(self.chains)) if sel is None else sel
        return fused_z_update([(self, c) for c in sel], record)

    def _ooc_locate(
        self, rows: np.ndarray, seg: np.ndarray
    ) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray, np.ndarray]:
        """Out of core: the buffers (held rows, window) — a tuple, which the compiled
        functions index as they do a typed list, at no cost to build — and, for each
        segment of ``rows``, which of the two holds it and where (:meth:`RowStore.locate`)."""
        store, win = self._rows, self._win
        window = win.XC if win is not None else np.empty((0, store.XC.shape[1]))
        local = np.empty_like(rows)
        src = np.empty(seg.size - 1, np.int64)
        for i in range(seg.size - 1):
            a, b = seg[i], seg[i + 1]
            src[i], local[a:b] = store.locate(rows[a:b], win)
        return (store.XC, window), local, src

    def _lists(self) -> tuple[Any, Any]:
        """This shard's buffer and masks as one-element typed lists (the kernels' form)."""
        return _typed_lists([self], self)

    # ------------------------------------------------------------ speculation
    def speculate(self) -> None:
        """Update z now, at each chain's current θ, as if its pending proposal will be
        rejected (the likelier outcome at the acceptance rates RWMH is tuned to).

        Called after a round's reply has gone out, while the driver decides; the next
        round then keeps the update of every chain whose proposal was rejected and
        undoes (rng state, bright set, masks) that of every chain that moved, which is
        then updated at its new θ as usual. Either way each chain's z-update is the one
        the plain protocol would make, draw for draw: speculation changes when the
        work is done, never the chain. The undone updates' queries are counted apart
        (``wasted``): they are the price of taking the z-update off the critical path.
        """
        if not self._spec_pending:
            return
        self._spec_pending = False
        todo = [
            c
            for c, ch in enumerate(self.chains)
            if c not in self._spec and ch.last_points is not None
        ]
        with np.errstate(over="ignore", divide="ignore"):
            self._update_z_fused(todo, record=True)

    def _undo_spec(self, c: int) -> int:
        """Undo chain ``c``'s speculative z-update; returns its (wasted) queries."""
        sp = self._spec.pop(c)
        ch = self.chains[c]
        self._masks[c, sp.new_rows] = False
        self._masks[c, sp.gone_rows] = True
        ch.bright.idx, ch.bright.vals = sp.idx, sp.vals
        ch.rng.bit_generator.state = sp.rng_state
        return sp.queries

    def _more_proposals(self, c: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """Proposal rows after ``last`` for chain ``c`` (its gaps fell short), with the
        log-uniforms deciding them: more gaps, then their uniforms, from its stream."""
        rng = self.chains[c].rng
        r = bernoulli_rows(rng, self.n - 1 - last, self.q_db) + (last + 1)
        return r, log_uniform(rng, r.size)

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
        """Evaluate every chain's requested points on its bright rows (one batched pass)."""
        want = [
            c
            for c, r in enumerate(requests)
            if r is not None and r.points.shape[0] and self.chains[c].bright.n_bright
        ]
        grad = any(requests[c].grad for c in want)
        segments = [(requests[c].points, self.chains[c].bright.idx) for c in want]
        if not grad and self._kernel is not None:  # compiled, with the sums
            results = {
                c: (v, None, None, sums)
                for c, (v, sums) in zip(want, self._fused_eval(segments), strict=True)
            }
        else:
            results = {
                c: (v, d, X, v.sum(axis=1))
                for c, (v, d, X) in zip(want, self._bright_eval_many(segments, grad), strict=True)
            }
        for c, ch in enumerate(self.chains):
            req = requests[c]
            rows = ch.bright.idx
            M = rows.size
            if req is not None and req.points.shape[0]:
                k = req.points.shape[0]
                if c in results:
                    vals, dvals, X, sums = results[c]
                    points[c, :k] = sums
                    if req.grad:
                        points_grad[c, :k] = self.model.grad_theta(dvals, X)
                else:  # nothing bright: the bright sum is empty
                    vals = np.zeros((k, 0))
                    dvals = np.zeros((k, 0, self.model.n_outputs)) if req.grad else None
                    points[c, :k] = 0.0
                ch.last_points, ch.last_vals, ch.last_dvals = req.points, vals, dvals
                queries[c] += k * M
            if req is not None and req.current_grad:
                if ch.bright.dvals is None:
                    raise RuntimeError("gradient kernel on a shard built without track_grad")
                current_grad[c] = self.model.grad_theta(
                    ch.bright.dvals[None], self._gather(rows)[0]
                )[0]
            n_bright[c] = M
        if self._kernel is not None:  # the bright sums at the current θ, in one pass
            bounds = [0]
            for ch in self.chains:
                bounds.append(bounds[-1] + ch.bright.vals.size)
            self._jit.segment_sums(
                np.concatenate([ch.bright.vals for ch in self.chains]),
                np.array(bounds, dtype=np.int64),
                current,
            )
        else:
            for c, ch in enumerate(self.chains):
                current[c] = ch.bright.vals.sum()

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
        """Full-data sums at every chain's requested points (all chains in one pass)."""
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
                s_c = sums[off : off + k]
                g_c = grads[off : off + k] if grads is not None else None
                off += k
                points[c, :k] = s_c
                if req.grad:
                    points_grad[c, :k] = g_c
                ch = self.chains[c]
                ch.last_points, ch.last_vals, ch.last_dvals = req.points, s_c, g_c
                queries[c] += k * self.n
        for c, ch in enumerate(self.chains):
            req = requests[c]
            if req is not None and req.current_grad:
                if ch.cur_grad is None:
                    _, g = self._regular_eval(ch.theta[None], True)
                    ch.cur_grad = g[0]
                    queries[c] += self.n
                current_grad[c] = ch.cur_grad
            current[c] = ch.cur_sum
            n_bright[c] = self.n

    def round(
        self,
        seq: Any,
        commits: np.ndarray,
        update_z: bool,
        requests: list[Request | None],
        speculate: bool = False,
    ) -> Reply | ReplicaReply:
        """One round trip for all chains.

        For each chain: commit the previous decision (``commits[c]`` is the row of the
        chain's last evaluated points that became current, or -1), update z at the
        committed θ if ``update_z``, then evaluate the requested points. Idempotent
        in ``seq``: a repeated ``seq`` returns the cached reply (fault recovery
        replays a round without re-applying it).

        With ``speculate`` (one-request kernels: every round starts an iteration), the
        next z-update may be done early, by :meth:`speculate`, once the reply is out.

        Returns
        -------
        Reply or ReplicaReply
            The sums at each chain's current θ and requested points (a
            :class:`ReplicaReply` in replica mode: see :meth:`_replica_round`).
        """
        if seq is not None and seq == self._seq:
            return self._reply
        # one errstate for the whole round (the fused log L~ relies on it; entering one
        # per evaluation would cost as much as the evaluation itself)
        with np.errstate(over="ignore", divide="ignore"):
            if self.replica:
                return self._replica_round(seq, requests)
            return self._round(seq, commits, update_z, requests, speculate)

    def _replica_round(self, seq: Any, requests: list[Request | None]) -> ReplicaReply:
        """A replica-mode round (see :meth:`set_replica`): each chain's one requested
        point is its current θ; z is updated there and the change of the bright set
        since the last reply comes back.

        Returns
        -------
        ReplicaReply
            Each chain's bright rows that went dark and those that became bright (with
            their features, target and tight point), or its whole set (``full``).
        """
        C = len(self.chains)
        queries = np.zeros(C, dtype=np.int64)
        for c, ch in enumerate(self.chains):
            ch.theta = np.array(requests[c].points[0], dtype=float)
        if self.config.z_update == "implicit":
            # the bright→dark moves need log L~ of the bright rows at the new θ
            live = [c for c, ch in enumerate(self.chains) if ch.bright.n_bright]
            evals = self._bright_eval_many(
                [(self.chains[c].theta[None], self.chains[c].bright.idx) for c in live], False
            )
            for c, (v, _, _) in zip(live, evals, strict=True):
                self.chains[c].bright.set_values(v[0], None)
                queries[c] += v.shape[1]
        queries += self._update_z_all()
        full = np.zeros(C, dtype=bool)
        gone, new = [], []
        for c, ch in enumerate(self.chains):
            now = np.sort(ch.bright.idx)
            before = self._sent[c]
            if before is None:
                full[c] = True
                gone.append(np.empty(0, dtype=np.int64))
                new.append(now)
            else:
                gone.append(np.setdiff1d(before, now, assume_unique=True))
                new.append(np.setdiff1d(now, before, assume_unique=True))
            self._sent[c] = now
        new_rows = np.concatenate(new)
        new_X, new_y, new_xi = self._gather(new_rows)
        reply = ReplicaReply(
            n_bright=np.array([ch.bright.n_bright for ch in self.chains], dtype=np.int64),
            queries=queries,
            wasted=np.zeros(C, dtype=np.int64),
            full=full,
            gone_ids=np.concatenate(gone) + self.spec.start,
            gone_seg=np.cumsum([0] + [g.size for g in gone]).astype(np.int64),
            new_ids=new_rows + self.spec.start,
            new_seg=np.cumsum([0] + [r.size for r in new]).astype(np.int64),
            new_X=new_X,
            new_y=new_y,
            new_xi=new_xi,
        )
        self.total_queries += int(queries.sum())
        self._seq, self._reply = seq, reply
        return reply

    def _round(
        self,
        seq: Any,
        commits: np.ndarray,
        update_z: bool,
        requests: list[Request | None],
        speculate: bool,
    ) -> Reply:
        C = len(self.chains)
        P = self.n_params
        kmax = max((r.points.shape[0] for r in requests if r is not None), default=0)
        any_grad = any(r is not None and r.grad for r in requests)
        any_cgrad = any(r is not None and r.current_grad for r in requests)
        current = np.empty(C)
        points = np.empty((C, kmax))
        points.fill(np.nan)
        points_grad = np.zeros((C, kmax, P)) if any_grad else None
        current_grad = np.zeros((C, P)) if any_cgrad else None
        n_bright = np.zeros(C, dtype=np.int64)
        queries = np.zeros(C, dtype=np.int64)
        wasted = np.zeros(C, dtype=np.int64)
        self.speculate()  # if it has not run since the last reply (in-process transports)
        for c, ch in enumerate(self.chains):
            # A chain whose position was set explicitly (start, recovery) has no batch of
            # its own yet: the driver set it at the committed θ, so there is nothing to commit.
            j = int(commits[c])
            if c in self._spec and (j >= 0 or not update_z):
                wasted[c] = self._undo_spec(c)  # it moved: z must be updated at its new θ
            if j >= 0 and ch.last_points is not None:
                self._commit(ch, j)
        if self.flymc:
            if update_z and self._spec:
                done = sorted(self._spec)
                for c in done:
                    queries[c] += self._spec.pop(c).queries
                rest = [c for c in range(C) if c not in done]
                queries[rest] += self._update_z_fused(rest)
            elif update_z:
                queries += self._update_z_all()
            self._flymc_points(
                requests, current, current_grad, points, points_grad, n_bright, queries
            )
        else:
            self._regular_points(
                requests, current, current_grad, points, points_grad, n_bright, queries
            )
        reply = Reply(current, points, n_bright, queries, wasted, current_grad, points_grad)
        self.total_queries += int(queries.sum() + wasted.sum())
        self._seq, self._reply = seq, reply
        self._spec_pending = bool(speculate) and self.fused_z
        return reply

    # ------------------------------------------------- the add-on samplers' interface
    @property
    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The shard's rows ``(X, y)``, ``X`` of shape ``(n, D)``, as read-only views.

        Only an in-memory shard has them (an out-of-core one streams its store: see
        :meth:`_blocks`).
        """
        if self.out_of_core:
            raise RuntimeError(
                f"shard {self.spec.shard_id} is out of core: its rows are not in memory"
            )
        return _read_only(self.X), _read_only(self.y)

    @property
    def tight_points(self) -> np.ndarray | None:
        """Each row's tight point ξ_n as a read-only view (None: none set, e.g. regular
        MCMC or austerity before :meth:`set_tight_points`; out of core: also None)."""
        return None if self.xi is None else _read_only(self.xi)

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
        """Run the shard operation ``name`` (:data:`SHARD_OPERATIONS`) here, as
        ``function(self, *args)``: how an add-on sampler (austerity) computes beside the
        rows."""
        try:
            func = SHARD_OPERATIONS[name]
        except KeyError:
            raise ValueError(
                f"unknown shard operation {name!r}; known: {sorted(SHARD_OPERATIONS)}"
            ) from None
        return func(self, *args)

    def state(self) -> dict[str, Any]:
        """Counters and brightness for inspection (tests, fault logs)."""
        return {
            "shard_id": self.spec.shard_id,
            "n_rows": self.n,
            "out_of_core": self.out_of_core,
            "memory_budget": self.memory_budget,
            "held_rows": int(self._rows.ids.size) if self.out_of_core else self.n,
            "chunk_iterations": self.chunk_iterations if self.out_of_core else None,
            "bytes_read": self._source.bytes_read if self.out_of_core else 0,
            "generation": self.generation,
            "total_queries": self.total_queries,
            "n_bright": [
                ch.bright.n_bright if ch.bright is not None else self.n for ch in self.chains
            ],
        }

    def bright_mask(self, chain: int) -> np.ndarray:
        """The z of one chain as a boolean array over the shard's rows (tests)."""
        return self.chains[chain].bright.mask.copy()


#: out-of-core shards on one worker above which it warns (each has its own window)
MANY_OUT_OF_CORE = 4

#: out of core, ``chunk_iterations=None``: the bytes of rows read per iteration at most (a
#: chunk of float64 features and target stays the window for chunk bytes / WINDOW_BYTES
#: iterations). Reading runs ahead on a thread at some 300 MB/s on a 2-core machine, so
#: this keeps it near 0.4 ms per iteration; a row's z is then revisited once every
#: (shard bytes / WINDOW_BYTES) iterations.
WINDOW_BYTES = 128 * 1024


def _read_only(a: np.ndarray) -> np.ndarray:
    """A view of ``a`` that cannot be written through."""
    v = a.view()
    v.flags.writeable = False
    return v


def _out_of_core(mode: bool | str, nbytes: int, budget: int | None) -> bool:
    """Whether a shard whose rows take ``nbytes`` in memory stays in its store."""
    if mode == "auto":
        return budget is not None and nbytes > budget
    return bool(mode)


def _typed_lists(shards: list[Shard], owner: Any = None) -> tuple[Any, Any]:
    """The shards' feature buffers and masks as numba typed lists (the kernels' form).

    Building them costs more than a round's update, so they are kept on ``owner``
    (its ``_typed``) and rebuilt only when the shards or their arrays change (masks are
    reallocated by :meth:`Shard.set_positions`). The kept tuple holds the shards, so
    the ids in its key stay theirs. Without an owner they are built afresh.
    """
    key = tuple((id(sh), id(sh._XC), id(sh._masks)) for sh in shards)
    if owner is not None and owner._typed is not None and owner._typed[0] == key:
        return owner._typed[2], owner._typed[3]
    jit = shards[0]._jit
    lists = (
        key,
        list(shards),
        jit.typed_list([sh._XC for sh in shards]),
        jit.typed_list([sh._masks for sh in shards]),
    )
    if owner is not None:
        owner._typed = lists
    return lists[2], lists[3]


def fused_z_update(
    pairs: list[tuple[Shard, int]], record: bool = False, owner: Any = None
) -> np.ndarray:
    """The implicit z-update of every (shard, chain) pair in ``pairs`` at once.

    The same moves as :func:`~flymc_dist.brightness.implicit_update` pair by pair
    (bright→dark accepted with ``min(1, q/L~)``, each dark row proposed with
    probability q and accepted with ``min(1, L~/q)``, by :func:`brighten`), in three
    compiled passes over all pairs (:mod:`flymc_dist._compiled`): proposals, their
    ``log L~``, and the update of the bright sets and masks. Each pair draws from its
    chain's stream on its shard — its darkening uniforms, then ``2K`` uniforms for its
    proposal gaps and their acceptance — so the draws do not depend on which pairs are
    updated together: one shard's chains (:meth:`Shard._update_z_fused`) or every
    shard of a host (:meth:`ShardHost.round`). The shards must share their model,
    features and ``q``.

    With ``record``, what is needed to undo each pair's update is kept in its shard's
    ``_spec`` (see :meth:`Shard.speculate`). ``owner`` keeps the typed lists of the
    shards' buffers and masks between calls (:func:`_typed_lists`; default: the shard,
    when the pairs are all on one).

    Returns
    -------
    numpy.ndarray
        Likelihood queries of each pair.
    """
    P = len(pairs)
    if P == 0:
        return np.zeros(0, dtype=np.int64)
    first = pairs[0][0]
    jit, q = first._jit, first.q_db
    shards: list[Shard] = []
    where: dict[int, int] = {}
    for sh, _ in pairs:
        if id(sh) not in where:
            if sh.q_db != q:
                raise ValueError("a fused z-update needs one q_db for all its shards")
            where[id(sh)] = len(shards)
            shards.append(sh)
    XCs, masks = _typed_lists(shards, owner if owner is not None or len(shards) > 1 else first)
    chains = [sh.chains[c] for sh, c in pairs]
    brights = [ch.bright for ch in chains]
    states = [ch.rng.bit_generator.state for ch in chains] if record else None
    bounds = [0]
    for b in brights:
        bounds.append(bounds[-1] + b.idx.size)
    b_seg = np.array(bounds, dtype=np.int64)
    b_idx = np.concatenate([b.idx for b in brights])
    b_vals = np.concatenate([b.vals for b in brights])
    ns = [sh.n for sh, _ in pairs]
    Ks = [proposal_slots(n, q) for n in ns]
    pair_n = np.array(ns, dtype=np.int64)
    pair_K = np.array(Ks, dtype=np.int64)
    pair_shard = np.array([where[id(sh)] for sh, _ in pairs], dtype=np.int64)
    pair_chain = np.array([c for _, c in pairs], dtype=np.int64)
    u_dark = np.empty(bounds[-1])
    u_prop = np.empty((P, 2 * max(Ks)))
    thetas = np.empty((P, first.n_params))
    for i, ch in enumerate(chains):
        ch.rng.random(out=u_dark[bounds[i] : bounds[i + 1]])
        ch.rng.random(out=u_prop[i, : 2 * Ks[i]])
        thetas[i] = ch.theta
    # dark -> bright proposals: rows at the partial sums of Geometric(q) gaps, the
    # bright ones skipped
    cap = sum(Ks)
    cand = np.empty(cap, dtype=np.int64)
    log_u = np.empty(cap)
    cand_seg = np.empty(P + 1, dtype=np.int64)
    last = np.empty(P, dtype=np.int64)
    short = jit.propose(
        u_prop,
        pair_K,
        math.log1p(-q) if q < 1.0 else -math.inf,
        pair_n,
        masks,
        pair_shard,
        pair_chain,
        cand,
        log_u,
        cand_seg,
        last,
    )
    m = int(cand_seg[P])
    cand, log_u = cand[:m], log_u[:m]
    if short:  # a pair's K gaps did not reach its last row (rare)
        cand, log_u = _refill(pairs, last, cand, log_u, cand_seg)
    counts = cand_seg[1:] - cand_seg[:-1]
    vals = np.empty(cand.size)
    kind, par = first._kernel
    jit.eval_rows(
        XCs, first.X.shape[1], cand, cand_seg, pair_shard, thetas, kind, par, vals, np.empty(P)
    )
    acc = brighten(log_u, vals, q)
    new_idx = np.empty(b_idx.size + cand.size, dtype=np.int64)
    new_vals = np.empty(new_idx.size)
    new_seg = np.empty(P + 1, dtype=np.int64)
    gone = np.empty(b_idx.size, dtype=np.int64)
    gone_seg = np.empty(P + 1, dtype=np.int64)
    added = np.empty(P, dtype=np.int64)
    jit.apply(
        masks,
        pair_shard,
        pair_chain,
        b_idx,
        b_vals,
        b_seg,
        u_dark,
        math.log(q),
        cand,
        cand_seg,
        vals,
        acc,
        new_idx,
        new_vals,
        new_seg,
        gone,
        gone_seg,
        added,
    )
    new_bounds = new_seg.tolist()
    for i, b in enumerate(brights):
        lo, hi = new_bounds[i], new_bounds[i + 1]
        if record:
            sh, c = pairs[i]
            sh._spec[c] = _Spec(
                states[i],
                b.idx,
                b.vals,
                gone[gone_seg[i] : gone_seg[i + 1]],
                new_idx[hi - added[i] : hi],
                int(counts[i]),
            )
        b.idx, b.vals = new_idx[lo:hi], new_vals[lo:hi]
    return counts


def _refill(
    pairs: list[tuple[Shard, int]],
    last: np.ndarray,
    cand: np.ndarray,
    log_u: np.ndarray,
    cand_seg: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Append to each pair whose gaps fell short (``last[i] >= 0``) its further dark
    proposals (:meth:`Shard._more_proposals`), keeping candidates pair after pair;
    ``cand_seg`` is updated in place."""
    bounds = cand_seg.tolist()
    rows, logs = [], []
    for i, (sh, c) in enumerate(pairs):
        r_i, l_i = cand[bounds[i] : bounds[i + 1]], log_u[bounds[i] : bounds[i + 1]]
        if last[i] >= 0:
            r, lu = sh._more_proposals(c, int(last[i]))
            dark = ~sh._masks[c, r]
            r_i, l_i = np.concatenate([r_i, r[dark]]), np.concatenate([l_i, lu[dark]])
        rows.append(r_i)
        logs.append(l_i)
        cand_seg[i + 1] = cand_seg[i] + r_i.size
    return np.concatenate(rows), np.concatenate(logs)


class ShardHost:
    """Several shards in one place: in-process, or as one Dask actor per worker.

    Every method fans out to the host's shards and returns a dict keyed by shard id,
    so the driver can combine results in a fixed global shard order (bit-identical
    sums whatever the placement).
    """

    def __init__(
        self,
        specs: list[ShardSpec],
        config: ShardConfig,
        data: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        self.config = config
        self.shards: dict[int, Shard] = {}
        # On a worker, protocol calls and speculative z-updates run on the event loop
        # while set-up and recovery calls run on the actor's thread: one lock per shard
        # keeps them from interleaving on the same shard (a speculation on a surviving
        # shard never waits for a recreated shard's set-up).
        self._locks: dict[int, threading.Lock] = {}
        #: wall and CPU seconds spent in rounds (and in speculation, after replies)
        self._channel: Any = None  # a ChannelServer once open_channel is called
        self._typed: tuple | None = None  # the shards' typed lists: see _typed_lists
        self._busy = {
            "rounds": 0,
            "round_wall": 0.0,
            "round_cpu": 0.0,
            "speculate_wall": 0.0,
            "speculate_cpu": 0.0,
        }
        self.add_shards(specs, data)

    def add_shards(
        self, specs: list[ShardSpec], data: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
    ) -> list[int]:
        """Open more shards here (placement, or recovery of a lost worker's shards).

        Each new shard's memory budget (``out_of_core="auto"``) is ``config.memory_budget``
        or else its share of half the worker's memory limit among the shards held here.
        """
        budget = self.config.memory_budget
        if budget is None:
            limit = worker_memory_limit()
            if limit is not None:
                budget = limit // (2 * max(len(self.shards) + len(specs), 1))
        for spec in specs:
            shard = Shard(spec, self.config, None if data is None else data[spec.shard_id], budget)
            self._locks[spec.shard_id] = threading.Lock()
            self.shards = {**self.shards, spec.shard_id: shard}  # never mutated in place
        ooc = sum(sh.out_of_core for sh in self.shards.values())
        if ooc > MANY_OUT_OF_CORE:
            log.warning(
                "%d out-of-core shards on this worker: each keeps two chunks in memory and "
                "reads its own window every iteration; give each worker one or a few "
                "shards (sample(..., n_shards=...))",
                ooc,
            )
        return sorted(self.shards)

    def shard_ids(self) -> list[int]:
        """The ids of the shards held here."""
        return sorted(self.shards)

    def _on(self, i: int, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._locks[i]:
            return getattr(self.shards[i], method)(*args, **kwargs)

    def call(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        shard_ids: list[int] | None = None,
    ) -> dict[int, Any]:
        """Call ``Shard.<method>(*args, **kwargs)`` on some or all shards here."""
        ids = self.shard_ids() if shard_ids is None else shard_ids
        kwargs = kwargs or {}
        return {i: self._on(i, method, *args, **kwargs) for i in ids}

    def call_each(self, method: str, per_shard: dict[int, tuple]) -> dict[int, Any]:
        """Call ``Shard.<method>(*per_shard[id])`` on each listed shard."""
        return {i: self._on(i, method, *a) for i, a in per_shard.items()}

    def round(
        self,
        seq: Any,
        commits: np.ndarray,
        update_z: bool,
        requests: list[Request | None],
        speculate: bool = False,
    ) -> dict[int, Reply | ReplicaReply]:
        """:meth:`Shard.round` on every shard here."""
        w, c = time.perf_counter(), time.thread_time()
        out = self._round_fused(seq, commits, update_z, requests, speculate)
        if out is None:
            out = {
                i: self._on(i, "round", seq, commits, update_z, requests, speculate)
                for i in self.shards
            }
        b = self._busy
        b["rounds"] += 1
        b["round_wall"] += time.perf_counter() - w
        b["round_cpu"] += time.thread_time() - c
        return out

    def _round_fused(
        self,
        seq: Any,
        commits: np.ndarray,
        update_z: bool,
        requests: list[Request | None],
        speculate: bool,
    ) -> dict[int, Reply] | None:
        """:meth:`Shard.round` on every shard here in one pass, or None where it does not
        apply (then the shards run one by one).

        With several shards per host, a round's fixed cost (tens of small array
        operations per shard) would grow with the shards; here the z-updates of all
        (shard, chain) pairs run as one :func:`fused_z_update` and the bright sums at
        the requested points as one compiled pass. It applies to FlyMC rounds with the
        compiled z-update and gradient-free requests (RWMH's and the slice sampler's
        rounds: any number of points per chain, or none), without speculation or a
        replayed round. Every shard's reply is the one its own
        :meth:`Shard.round` would give, bit for bit: the same draws from the same
        streams, and every sum taken over the same values in the same order.
        """
        shards = [self.shards[i] for i in sorted(self.shards)]
        if (
            len(shards) < 2
            or speculate
            or not all(
                sh.fused_z
                and not sh.replica
                and sh.chains
                and not sh._spec
                and (seq is None or sh._seq != seq)
                for sh in shards
            )
        ):
            return None
        if not all(r is None or (not r.grad and not r.current_grad) for r in requests):
            return None
        C = len(requests)
        ids = sorted(self.shards)
        locks = [self._locks[i] for i in ids]
        for lk in locks:
            lk.acquire()
        try:
            with np.errstate(over="ignore", divide="ignore"):
                return self._round_fused_locked(shards, ids, seq, commits, update_z, requests, C)
        finally:
            for lk in reversed(locks):
                lk.release()

    def _round_fused_locked(
        self,
        shards: list[Shard],
        ids: list[int],
        seq: Any,
        commits: np.ndarray,
        update_z: bool,
        requests: list[Request | None],
        C: int,
    ) -> dict[int, Reply]:
        jit = shards[0]._jit
        XCs, _ = _typed_lists(shards, self)
        js = [int(j) for j in commits]
        for sh in shards:
            sh._spec_pending = False
            for c, ch in enumerate(sh.chains):
                if js[c] >= 0 and ch.last_points is not None:
                    sh._commit(ch, js[c])
        pairs = [(sh, c) for sh in shards for c in range(C)]
        queries = (
            fused_z_update(pairs, owner=self) if update_z else np.zeros(len(pairs), dtype=np.int64)
        )
        # the bright sums at each chain's points (k of them: k segments of its bright
        # rows, as Shard._fused_eval lays them out) and at its current θ, pair by pair
        ks = [0 if r is None else r.points.shape[0] for r in requests]
        kmax = max(ks, default=0)
        brights = [sh.chains[c].bright for sh, c in pairs]
        sizes = [b.idx.size for b in brights]
        row_parts, theta_parts, seg_bounds, seg_shard = [], [], [0], []
        for p, (_, c) in enumerate(pairs):
            k = ks[c]
            if k:
                idx = brights[p].idx
                row_parts.append(idx if k == 1 else np.tile(idx, k))
                theta_parts.append(requests[c].points)
                for _ in range(k):
                    seg_bounds.append(seg_bounds[-1] + sizes[p])
                    seg_shard.append(p // C)
        n_seg = len(seg_shard)
        vals = np.empty(seg_bounds[-1])
        sums = np.empty(n_seg)
        if n_seg:
            kind, par = shards[0]._kernel
            jit.eval_rows(
                XCs,
                shards[0].X.shape[1],
                np.concatenate(row_parts),
                np.array(seg_bounds, dtype=np.int64),
                np.array(seg_shard, dtype=np.int64),
                np.concatenate(theta_parts),
                kind,
                par,
                vals,
                sums,
            )
        cur_bounds = [0]
        for m in sizes:
            cur_bounds.append(cur_bounds[-1] + m)
        current = np.empty(len(pairs))
        jit.segment_sums(
            np.concatenate([b.vals for b in brights]), np.array(cur_bounds, dtype=np.int64), current
        )
        out = {}
        off = j = 0
        for s_i, (sid, sh) in enumerate(zip(ids, shards, strict=True)):
            lo = s_i * C
            points = np.empty((C, kmax))
            points.fill(np.nan)
            q_s = queries[lo : lo + C].copy()
            for c, ch in enumerate(sh.chains):
                k, M = ks[c], sizes[lo + c]
                if not k:
                    continue
                ch.last_points = requests[c].points
                ch.last_vals = vals[off : off + k * M].reshape(k, M)
                ch.last_dvals = None
                points[c, :k] = sums[j : j + k]
                q_s[c] += k * M
                off += k * M
                j += k
            reply = Reply(
                current=current[lo : lo + C].copy(),
                points=points,
                n_bright=np.array(sizes[lo : lo + C], dtype=np.int64),
                queries=q_s,
                wasted=np.zeros(C, dtype=np.int64),
            )
            sh.total_queries += int(q_s.sum())
            sh._seq, sh._reply = seq, reply
            out[sid] = reply
        return out

    def speculate(self) -> None:
        """:meth:`Shard.speculate` on every shard here."""
        w, c = time.perf_counter(), time.thread_time()
        for i in self.shards:
            self._on(i, "speculate")
        self._busy["speculate_wall"] += time.perf_counter() - w
        self._busy["speculate_cpu"] += time.thread_time() - c

    def timing(self) -> dict[str, float]:
        """Rounds served here and the wall / CPU seconds they (and speculation) took."""
        return dict(self._busy)

    def _round_blob(self, blob: bytes) -> tuple[bytes, bool]:
        """:meth:`round` with its arguments and reply pickled into one buffer each;
        also whether a speculative z-update should follow the reply."""
        seq, commits, update_z, requests, speculate = unpack_round(blob)
        return pack_reply(self.round(seq, commits, update_z, requests, speculate)), speculate

    def round_packed(self, blob: bytes) -> bytes:
        """:meth:`round` with its arguments and reply pickled into one buffer each.

        A round's payload is a handful of small arrays; one buffer each way costs the
        Dask RPC layer far less than serialising every array as its own frame. When the
        transport runs it on the worker's event loop (FlyMC), a speculative z-update is
        scheduled behind the reply (a timer callback runs only after the callbacks
        already queued, among them the one that writes the reply); on the actor's thread
        there is no loop, and the next round runs the pending speculation first.
        """
        reply, speculate = self._round_blob(blob)
        if speculate:
            try:
                asyncio.get_running_loop().call_later(0.0, self.speculate)
            except RuntimeError:  # not on an event loop: Shard.round catches up
                pass
        return reply

    # ------------------------------------------------------------ the channel
    def open_channel(self, host: str) -> tuple[tuple[str, int], bytes]:
        """Serve rounds on a socket of ``host`` (see :mod:`flymc_dist.transport.channel`).

        Returns the address to connect to and the token to present. A speculative
        z-update runs on the channel's thread right after its reply is sent.
        """
        self.close_channel()
        self._channel = ChannelServer(self._serve_channel, host)
        # the server holds this host weakly: once Dask drops the actor (its run released
        # it, or the run's client went away), the server stops and its port is freed
        weakref.finalize(self, self._channel.close)
        return self._channel.address, self._channel.token

    def _serve_channel(self, code: int, payload: bytes) -> tuple[bytes, Any]:
        if code == ROUND:
            reply, speculate = self._round_blob(payload)
            return reply, (self.speculate if speculate else None)
        if code == ECHO:
            return payload, None
        raise ValueError(f"unknown channel request code {code}")

    def close_channel(self) -> None:
        """Stop serving rounds on the socket (if open)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def ping(self) -> int:
        """Liveness check: the number of shards held."""
        return len(self.shards)

    def echo(self, blob: bytes) -> bytes:
        """Return ``blob`` unchanged: a bare round trip carrying a round's payload (bench)."""
        return blob
