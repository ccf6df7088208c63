"""The driver's replica of every chain's bright rows: θ-steps without round trips.

With MAP-tuned bounds a chain has tens of bright rows. In replica mode the shards
stay the owners of z (its initial exact draw, every update, its redraw after a fault)
but each round only tells the driver how each chain's bright set changed: the rows
that became bright, with their features, target and tight point, and the ids of the
rows that went dark (:meth:`flymc_dist.shard.Shard.set_replica`). The driver applies
the change here and evaluates the FlyMC conditional's bright part,
``Σ_bright log L~_n(θ)`` and its gradient, locally: a θ-kernel then makes any number
of evaluations (a NUTS trajectory, the slice sampler's shrinkage) for one round
trip per iteration.

Each chain's rows are kept sorted by global row id, and every sum runs in that order,
so the values (and the draws) do not depend on how the rows are spread over shards
and workers.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from flymc_dist._numerics import in_sorted
from flymc_dist.brightness import brighten
from flymc_dist.models.base import BoundStats, Model
from flymc_dist.protocol import ReplicaReply
from flymc_dist.terms import bright_terms, bright_terms_many, check_bounds_held

#: the dark→bright test that :meth:`BrightReplica.block_steps` has compiled in
_COMPILED_BRIGHTEN = brighten


class _Rows:
    """One chain's bright rows: global ids (sorted), features, targets, tight points, and
    (once asked for) the compiled kernel's buffer of them."""

    __slots__ = ("ids", "X", "y", "xi", "buf")

    def __init__(
        self,
        ids: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        xi: np.ndarray,
        buf: np.ndarray | None = None,
    ) -> None:
        self.ids, self.X, self.y, self.xi = ids, X, y, xi
        self.buf = buf


def _two_d(a: np.ndarray) -> np.ndarray:
    """``a`` as rows of one or more values (a view where it can be; empty arrays too)."""
    return a.reshape(a.shape[0], math.prod(a.shape[1:]))


def _kept(held: dict[str, Any], key: str, objects: list[Any], build: Any) -> Any:
    """``build()``, kept in ``held`` under ``key`` while ``objects`` are the same objects
    (held with it, so that an identity check is valid)."""
    kept = held.get(key)
    if (
        kept is None
        or len(kept[0]) != len(objects)
        or any(a is not b for a, b in zip(kept[0], objects, strict=True))
    ):
        kept = held[key] = (list(objects), build())
    return kept[1]


def _pointers(held: dict[str, Any], rngs: list[np.random.Generator]) -> np.ndarray:
    """The generators' addresses the compiled transitions draw through
    (:func:`flymc_dist._compiled_kernels.generator_pointers`), kept in ``held``."""
    from flymc_dist._compiled_kernels import generator_pointers  # numba: where it computes

    return _kept(held, "rngs", rngs, lambda: np.stack([generator_pointers(r) for r in rngs]))


def kernel_inputs(
    held: dict[str, Any], name: str, rngs: list[np.random.Generator], settings: tuple, dim: int
) -> tuple:
    """A compiled transition's inputs from a kernel's
    :meth:`~flymc_dist.kernels.base.Kernel.fused_settings` (``name``, ``settings``), in
    the one form both take: :func:`nuts_inputs`' five values, then the tree depth and the
    divergence threshold (``"nuts"``), or :func:`rwmh_inputs`' five values, then two
    that are not read (``"rwmh"``)."""
    if name == "nuts":
        step_sizes, inv_metrics, momentum_factors, depth, threshold = settings
        return (
            *nuts_inputs(held, rngs, step_sizes, inv_metrics, momentum_factors),
            int(depth),
            float(threshold),
        )
    if name == "rwmh":
        step_sizes, scale_trils = settings
        return (*rwmh_inputs(held, rngs, step_sizes, scale_trils, dim), 0, 0.0)
    raise ValueError(f"no compiled transition {name!r}")


def nuts_inputs(
    held: dict[str, Any],
    rngs: list[np.random.Generator],
    step_sizes: list[float],
    inv_metrics: list[np.ndarray],
    momentum_factors: list[np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """Every chain's NUTS inputs as the compiled transitions take them
    (:func:`flymc_dist._compiled_kernels.nuts_chains`): the generators' addresses, the step
    sizes, the inverse metrics and momentum factors stacked (``(C, P, P)``, or ``(C, 1,
    P)`` when diagonal) and whether they are diagonal. The addresses and the stacks are
    kept in ``held`` while the generators and the metrics are the same objects (the
    kernels' parameters hold their metrics read-only)."""
    pointers = _pointers(held, rngs)
    diag = inv_metrics[0].ndim == 1
    # the metrics read-only (as the kernels' parameters hold them), the positions
    # writable: each array flag is part of numba's signature, and another flag would
    # compile the transitions again
    inv, factor = _kept(
        held,
        "metrics",
        inv_metrics + momentum_factors,
        lambda: tuple(
            _frozen(np.stack([m[None] if diag else m for m in ms]).astype(np.float64))
            for ms in (inv_metrics, momentum_factors)
        ),
    )
    return pointers, np.asarray(step_sizes, dtype=np.float64), inv, factor, diag


def rwmh_inputs(
    held: dict[str, Any],
    rngs: list[np.random.Generator],
    step_sizes: list[float],
    scale_trils: list[np.ndarray | None],
    dim: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """Every chain's random-walk MH inputs as :func:`nuts_inputs` gives NUTS's (the
    compiled transitions take both alike): the generators' addresses, the step sizes, the
    preconditioners stacked twice (in the places of the metric and the momentum factor:
    ``(C, P, P)``, or ``(C, 1, P)`` ones when every chain's is the identity) and whether
    they are diagonal. Kept in ``held`` as :func:`nuts_inputs`' are."""
    pointers = _pointers(held, rngs)
    diag = all(t is None for t in scale_trils)

    def stacked() -> np.ndarray:
        if diag:
            return _frozen(np.ones((len(scale_trils), 1, dim)))
        eye = np.eye(dim)
        return _frozen(np.stack([eye if t is None else t for t in scale_trils]).astype(float))

    factor = _kept(held, "scale_trils", scale_trils, stacked)
    return pointers, np.asarray(step_sizes, dtype=np.float64), factor, factor, diag


class FusedTargets:
    """Every chain's FlyMC conditional given z, compiled: the targets of a kernel's
    :meth:`~flymc_dist.kernels.base.Kernel.fused_steps` in replica mode.

    Chain c's is ``log p(θ) + θᵀAθ + bᵀθ + c + Σ_bright log L~_n(θ)``: the prior, the
    collapsed bound (given as ``S = A + Aᵀ``, ``b``, ``c``), and the chain's rows
    ``buffer[starts[c]:starts[c+1]]`` of the replica (features, then the model's row
    constants), summed in the replica's order.
    """

    __slots__ = (
        "buffer", "starts", "kind", "par", "S", "b", "c", "prior", "clock", "held"
    )  # fmt: skip

    def __init__(
        self,
        buffer: np.ndarray,
        starts: np.ndarray,
        kind: int,
        par: np.ndarray,
        S: np.ndarray,
        b: np.ndarray,
        c: float,
        prior_kind: int,
        prior_k: float,
        prior_const: float,
        clock: np.ndarray | None = None,
        held: dict[str, Any] | None = None,
    ) -> None:
        self.buffer, self.starts, self.kind, self.par = buffer, starts, kind, par
        self.S, self.b, self.c = S, b, c
        self.prior = (prior_kind, prior_k, prior_const)
        #: where the wall seconds of the compiled transitions add up (``clock[0]``)
        self.clock = clock
        #: what :meth:`nuts` builds once and keeps while its inputs are the same objects
        #: (the chains' generators' addresses, the chains' metrics stacked), with the
        #: objects it was built from, so that an identity check is valid
        self.held = {} if held is None else held

    @property
    def n_rows(self) -> np.ndarray:
        """Each chain's bright rows: the likelihood queries of one evaluation."""
        return np.diff(self.starts)

    def nuts(
        self,
        rngs: list[np.random.Generator],
        positions: np.ndarray,
        step_sizes: list[float],
        inv_metrics: list[np.ndarray],
        momentum_factors: list[np.ndarray],
        max_tree_depth: int,
        divergence_threshold: float,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One NUTS transition of every chain on its target, chain after chain, in one
        compiled call (:func:`flymc_dist._compiled_kernels.nuts_chains`): chain c from
        ``positions[c]`` with its own generator, step size and metric.

        Returns
        -------
        positions, floats, ints
            ``(C, P)`` new positions; ``(C, 3)`` log target, energy and acceptance
            statistic; ``(C, 5)`` moved, leapfrog steps, evaluations, tree depth and
            divergent.
        """
        from flymc_dist._compiled_kernels import nuts_chains

        settings = (step_sizes, inv_metrics, momentum_factors, max_tree_depth, divergence_threshold)
        inputs = kernel_inputs(self.held, "nuts", rngs, settings, positions.shape[1])
        return self._transitions(nuts_chains, positions, *inputs)

    def rwmh(
        self,
        rngs: list[np.random.Generator],
        positions: np.ndarray,
        step_sizes: list[float],
        scale_trils: list[np.ndarray | None],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One random-walk MH transition of every chain on its target, chain after chain,
        in one compiled call (:func:`flymc_dist._compiled_kernels.rwmh_chains`): chain c
        from ``positions[c]`` with its own generator, step size and preconditioner.

        Returns
        -------
        positions, floats, ints
            As :meth:`nuts`'s (the energy NaN; no leapfrog steps, 2 evaluations).
        """
        from flymc_dist._compiled_kernels import rwmh_chains

        settings = (step_sizes, scale_trils)
        pointers, eps, _, factor, diag, _, _ = kernel_inputs(
            self.held, "rwmh", rngs, settings, positions.shape[1]
        )
        return self._transitions(rwmh_chains, positions, pointers, eps, factor, diag)

    def _transitions(
        self, chains: Any, positions: np.ndarray, pointers: np.ndarray, *settings: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``chains`` (a compiled transition of every chain: ``nuts_chains`` or
        ``rwmh_chains``) from ``positions``, the generators at ``pointers``, the
        kernel's ``settings`` between the positions and the targets, timed on
        :attr:`clock`."""
        C, P = positions.shape
        out = np.empty((C, P))
        floats = np.empty((C, 3))
        ints = np.empty((C, 5), dtype=np.int64)
        t0 = time.perf_counter()
        thetas = np.array(positions, dtype=np.float64)  # a writable, contiguous copy
        chains(
            pointers, thetas, *settings, self.buffer, self.starts, self.kind, self.par, self.S,
            self.b, self.c, *self.prior, out, floats, ints,
        )  # fmt: skip
        if self.clock is not None:
            self.clock[0] += time.perf_counter() - t0
        return out, floats, ints


def _frozen(a: np.ndarray) -> np.ndarray:
    """``a`` if it is read-only, else a read-only view of it."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view


class BrightReplica:
    """Every chain's bright rows, kept in step with the shards' z.

    Parameters
    ----------
    model
        The model (its ``loglik``, ``logbound``, ``linear_predictor``, ``grad_theta``).
    chains
        Number of chains.
    shard_ranges
        ``(start, stop)`` global rows of each shard, in global shard order: the replies
        of a round come in that order.
    """

    def __init__(self, model: Model, chains: int, shard_ranges: list[tuple[int, int]]) -> None:
        self.model = model
        self.chains = int(chains)
        self.shard_ranges = list(shard_ranges)
        self._rows: list[_Rows | None] = [None] * self.chains
        #: the model's compiled ``log L~`` (one linear predictor per row), or None:
        #: then every chain's rows are also kept with their row constants, in one buffer
        self._compiled: tuple[Any, int, np.ndarray] | None = None
        spec = model.compiled_bright() if model.n_outputs == 1 else None
        if spec is not None:
            from flymc_dist import _compiled  # numba: imported where it computes

            self._compiled = (_compiled, _compiled.KINDS[spec[0]], np.asarray(spec[1], float))
        # every chain's (features, row constants), chain after chain, in one buffer;
        # chain c's rows are _buffer_all[_starts[c]:_starts[c + 1]]
        self._buffer_all: np.ndarray | None = None
        self._starts = np.zeros(self.chains + 1, dtype=np.int64)
        # every chain's global ids, targets and tight points, in the same order
        self._ids_all = np.empty(0, dtype=np.int64)
        self._X_all: np.ndarray | None = None
        self._y_all: np.ndarray | None = None
        self._xi_all: np.ndarray | None = None
        # whether every chain's rows are views of _ids_all, _X_all, ... (after update_z)
        self._views_of_all = False
        # update_z's scratch: (bright rows' values and moves, the proposals' four arrays)
        self._scratch: tuple[np.ndarray, np.ndarray] | None = None
        # the _Rows objects they were built from (held, so that an identity check is valid)
        self._buffers_of: tuple[_Rows, ...] = ()
        # (the bound, its arrays and the prior's terms) of fused_targets
        self._fused_bound: tuple | None = None
        #: wall seconds spent in the compiled θ-kernel transitions of fused_targets
        #: (the call included): the θ-kernel's own compute on the replica
        self.kernel_clock = np.zeros(1)
        #: what the compiled transitions keep from call to call (:func:`nuts_inputs`)
        self.held: dict[str, Any] = {}

    @property
    def fusable(self) -> bool:
        """Whether :meth:`fused_targets` gives compiled targets (the model has a compiled
        form)."""
        return self._compiled is not None

    def n_bright(self) -> np.ndarray:
        """Bright rows of each chain, shape (C,)."""
        return np.array([0 if r is None else r.ids.size for r in self._rows], dtype=np.int64)

    def bright_ids(self) -> list[np.ndarray]:
        """Each chain's bright rows, global ids sorted."""
        return [np.empty(0, dtype=np.int64) if r is None else r.ids for r in self._rows]

    def nbytes(self) -> int:
        """Memory held by the replica's rows."""
        if self._views_of_all:  # every chain's rows are views of the arrays of all: O(1)
            return int(
                self._X_all.nbytes + self._y_all.nbytes + self._xi_all.nbytes
                + self._ids_all.nbytes
            )  # fmt: skip
        return int(
            sum(
                r.X.nbytes + r.y.nbytes + r.xi.nbytes + r.ids.nbytes
                for r in self._rows
                if r is not None
            )
        )

    def apply(self, replies: list[ReplicaReply]) -> None:
        """Apply one round's replies (one per shard, in global shard order)."""
        self._views_of_all = False
        # the compiled kernel's rows of every chain's new rows, one call per reply (the row
        # constants are a function of each row's target and tight point alone)
        new_bufs = [
            self.row_buffer([r.new_X], r.new_y, r.new_xi)
            if self._compiled is not None and r.new_ids.size
            else None
            for r in replies
        ]
        for c in range(self.chains):
            cur = self._rows[c]
            drop: list[np.ndarray] = []
            add: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any]] = []
            ranges: list[tuple[int, int]] = []
            for (start, stop), r, nb in zip(self.shard_ranges, replies, new_bufs, strict=True):
                if r.full[c]:
                    ranges.append((start, stop))
                g0, g1 = r.gone_seg[c], r.gone_seg[c + 1]
                if g1 > g0:
                    drop.append(r.gone_ids[g0:g1])
                n0, n1 = r.new_seg[c], r.new_seg[c + 1]
                if n1 > n0:
                    add.append(
                        (
                            r.new_ids[n0:n1],
                            r.new_X[n0:n1],
                            r.new_y[n0:n1],
                            r.new_xi[n0:n1],
                            None if nb is None else nb[n0:n1],
                        )
                    )
            if cur is not None and (drop or ranges):
                keep = np.ones(cur.ids.size, dtype=bool)
                for start, stop in ranges:
                    keep &= (cur.ids < start) | (cur.ids >= stop)
                if drop:
                    keep &= ~in_sorted(cur.ids, np.sort(np.concatenate(drop)))
                buf = None if cur.buf is None else cur.buf[keep]
                cur = _Rows(cur.ids[keep], cur.X[keep], cur.y[keep], cur.xi[keep], buf)
            if add or cur is None:
                parts = ([] if cur is None else [(cur.ids, cur.X, cur.y, cur.xi)]) + add
                if parts:
                    ids = np.concatenate([p[0] for p in parts])
                    order = np.argsort(ids, kind="stable")
                    # the compiled kernel's buffer: the kept rows' as they are, the new
                    # rows' from new_bufs
                    buf = None
                    if self._compiled is not None and (cur is None or cur.buf is not None):
                        bufs = [] if cur is None else [cur.buf]
                        bufs += [a[4] for a in add]
                        buf = np.concatenate(bufs)[order]
                    cur = _Rows(
                        ids[order],
                        np.concatenate([p[1] for p in parts])[order],
                        np.concatenate([p[2] for p in parts])[order],
                        np.concatenate([p[3] for p in parts])[order],
                        buf,
                    )
                else:
                    r0 = replies[0]
                    cur = _Rows(
                        np.empty(0, dtype=np.int64),
                        r0.new_X[:0],
                        r0.new_y[:0],
                        r0.new_xi[:0],
                    )
            self._rows[c] = cur
        self._rebuild()

    def update_z(
        self,
        thetas: np.ndarray,
        keys: np.ndarray,
        q: float,
        proposed: tuple[np.ndarray, np.ndarray, np.ndarray],
        rows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    ) -> np.ndarray:
        """Every chain's implicit z-update at ``thetas[c]``, here: the shards' compiled
        update (:func:`~flymc_dist.shard.batched.batched_z_update`) with the same
        operations on the same values, so the same bright sets, bit for bit.

        Two compiled calls (:func:`~flymc_dist._compiled.replica_z_propose`, then
        :func:`~flymc_dist._compiled.replica_z_apply`) and a handful of numpy operations,
        whatever the number of chains. The bright rows' ``log L~`` at ``thetas`` are
        evaluated here again, not taken from the θ-step: the compiled NUTS transition sums
        with ``fastmath`` reassociation (:mod:`flymc_dist._compiled_kernels`), so its values
        may differ in the last bit from the shards' update, whose draws these must be; with
        MAP-tuned bounds they are a few rows per chain, a negligible part of the update.

        Parameters
        ----------
        thetas
            ``(C, P)``: each chain's position.
        keys
            ``(C,)`` uint64: each chain's ``Z_DECIDE`` stream at this step.
        q
            The dark→bright proposal probability.
        proposed
            ``(ids, seg, at)``: chain c's proposed global rows ``ids[seg[c]:seg[c+1]]``
            (sorted) and where each sits in ``rows``.
        rows
            ``(buffer, y, xi)`` of the proposed rows (the buffer in :meth:`row_buffer`'s
            form: their features, then their row constants).

        Returns
        -------
        numpy.ndarray
            Likelihood queries of each chain (its bright rows and its dark proposals).
        """
        if self._compiled is None or self._rows[0] is None:  # apply fills every chain
            raise RuntimeError("update_z needs a compiled model and the replica filled")
        jit, kind, par = self._compiled
        self._rebuild()
        buf_all, b_seg, b_idx = self._buffer_all, self._starts, self._ids_all
        thetas = np.ascontiguousarray(thetas, dtype=np.float64)
        ids, seg, pos = proposed
        buf, y, xi = rows
        M, n_prop = b_idx.size, ids.size
        log_q = math.log(q)
        # scratch of the first half, reused from call to call (nothing of it is kept)
        if self._scratch is None or self._scratch[0].size < M or self._scratch[1].size < n_prop:
            self._scratch = (np.empty((2, 2 * M + 64)), np.empty((4, 2 * n_prop + 64)))
        b_sc, c_sc = self._scratch
        b_vals = b_sc[0, :M]
        gone = b_sc[1, :M].view(np.bool_)[:M]  # (any M bytes of the row do)
        cand_u, vals = c_sc[0, :n_prop], c_sc[1, :n_prop]
        cand, cand_at = c_sc[2, :n_prop].view(np.int64), c_sc[3, :n_prop].view(np.int64)
        cand_seg = np.empty(self.chains + 1, dtype=np.int64)
        queries = np.empty(self.chains, dtype=np.int64)
        nan = jit.replica_z_propose(
            buf_all, b_idx, b_seg, self._rows[0].X.shape[1], thetas, keys, log_q, ids, seg,
            pos, buf, kind, par, b_vals, gone, cand, cand_seg, cand_at, cand_u, vals, queries,
        )  # fmt: skip
        n = int(cand_seg[-1])
        cand, cand_at, vals = cand[:n], cand_at[:n], vals[:n]
        if nan:  # the guard over the bright rows' values, then the proposals'
            check_bounds_held(b_vals, b_seg, thetas, lambda j: int(b_idx[j]), self.model)
            check_bounds_held(vals, cand_seg, thetas, lambda j: int(cand[j]), self.model)
        # which proposals turn bright: brighten (looked up here, so that a test can flip
        # it), given log(1 - u) in numpy as it always has been
        acc = brighten(np.log1p(-cand_u[:n]), vals, q)
        new_buf = np.empty((M + n, buf_all.shape[1]))
        new_ids = np.empty(M + n, dtype=np.int64)
        new_src = np.empty(M + n, dtype=np.int64)
        new_starts = np.empty(self.chains + 1, dtype=np.int64)
        m = jit.replica_z_apply(
            buf_all, b_idx, b_seg, gone, cand, cand_seg, cand_at, acc, buf, new_buf, new_ids,
            new_src, new_starts,
        )  # fmt: skip
        if m >= 0:  # some chain's bright set changed
            self._set_all(
                new_ids[:m], new_buf[:m], *self._gathered(new_src[:m], buf, y, xi), new_starts
            )
        return queries

    def loops(self) -> bool:
        """Whether :meth:`block_steps` can run (the model compiled, the replica filled, and
        the dark→bright test :func:`~flymc_dist.brightness.brighten` the one it has
        compiled in: a test that replaces it here gets :meth:`update_z`, which calls it)."""
        return (
            self._compiled is not None
            and self._rows[0] is not None
            and (brighten is _COMPILED_BRIGHTEN)
        )

    def max_rows(self, budget: float) -> int:
        """The most bright rows (over all chains) whose :meth:`nbytes` stay within
        ``budget`` bytes."""
        self._rebuild()
        per_row = self._ids_all.itemsize + sum(
            a.itemsize * math.prod(a.shape[1:]) for a in (self._X_all, self._y_all, self._xi_all)
        )
        return int(budget // per_row)

    def block_steps(
        self,
        n_steps: int,
        block: Any,
        keys: tuple[int, int, int, int],
        q: float,
        thetas: np.ndarray,
        kernel: str,
        inputs: tuple,
        bound: BoundStats,
        max_rows: int,
        max_seconds: float,
    ) -> tuple[int, bool, np.ndarray, np.ndarray, np.ndarray]:
        """Up to ``n_steps`` iterations of every chain in one compiled call
        (:func:`flymc_dist._compiled_loop.replica_steps`): each chain's z-update here, as
        :meth:`update_z` makes it, then its θ-transition (``kernel``: ``"nuts"`` or
        ``"rwmh"``) on :meth:`fused_targets`' target, as :meth:`FusedTargets.nuts` or
        :meth:`FusedTargets.rwmh` makes it; the replica ends as
        :meth:`update_z` would have left it after the last iteration done.

        Parameters
        ----------
        n_steps
            Iterations at most (the proposals ``block`` holds must cover them).
        block
            The read-ahead block (:class:`flymc_dist.ahead.Block`) and, in ``keys``, the
            z streams of the first step: ``(seed, generation, step, purpose)``, the
            step's first pair in the block being ``(step − block.first) · C``.
        keys
            See ``block``.
        q
            The dark→bright proposal probability.
        thetas
            ``(C, P)``: each chain's position (updated in place).
        kernel
            ``"nuts"`` or ``"rwmh"``.
        inputs
            The transition's inputs (:func:`kernel_inputs`).
        bound
            The collapsed bound.
        max_rows
            Return after an iteration that leaves more bright rows (< 0: never).
        max_seconds
            Return after the first iteration that ends this long after the call began.

        Returns
        -------
        done, over_budget, positions, floats, ints
            Iterations done, whether the last left more than ``max_rows`` (fewer than
            ``n_steps`` done and not over: the next one's values hold a NaN, or the time
            ran out); per iteration and chain its new position ``(n, C, P)``, its log
            target, energy and acceptance statistic ``(n, C, 3)`` and its moved, leapfrog
            steps, evaluations, tree depth, divergent, bright rows and likelihood queries
            ``(n, C, 7)``. The transitions' seconds go to :attr:`kernel_clock`.
        """
        from flymc_dist._compiled_loop import KERNELS, OVER_BUDGET, replica_steps  # numba

        _, kind, par = self._compiled
        self._rebuild()
        target = self.fused_targets(bound)
        seed, generation, step, purpose = keys
        C, P = thetas.shape
        M0 = self._ids_all.size
        positions = np.empty((n_steps, C, P))
        floats = np.empty((n_steps, C, 3))
        ints = np.empty((n_steps, C, 7), dtype=np.int64)
        clocks = np.zeros(1)
        buf_rows, y, xi = block.rows
        done, status, buf, ids, starts, origin = replica_steps(
            n_steps, self._rows[0].X.shape[1], self._buffer_all, self._ids_all, self._starts,
            np.arange(M0), block.ids, block.seg, block.at, buf_rows,
            (step - block.first) * C, np.uint64(seed & 0xFFFFFFFFFFFFFFFF), generation, step,
            purpose, math.log(q), kind, par, KERNELS[kernel], inputs[0], thetas, inputs[1],
            inputs[2], inputs[3], inputs[4], int(inputs[5]), float(inputs[6]), target.S,
            target.b, target.c,
            *target.prior, int(max_rows), float(max_seconds), positions, floats, ints, clocks,
        )  # fmt: skip
        self.kernel_clock[0] += clocks[0]
        if done:  # the replica as the last iteration left it
            self._set_all(ids, buf, *self._gathered(origin, buf_rows, y, xi), starts)
        return done, status == OVER_BUDGET, positions[:done], floats[:done], ints[:done]

    def _gathered(
        self, src: np.ndarray, X: np.ndarray, y: np.ndarray, xi: np.ndarray
    ) -> list[np.ndarray]:
        """The features, targets and tight points of new bright rows, each from the
        replica (``src < M``) or from the proposals' rows ``X, y, xi`` (a whole read-ahead
        block's, whose size grows with the hosts: not joined, not copied; ``X`` may be
        its :meth:`row_buffer`, whose first columns are the features)."""
        jit = self._compiled[0]
        out = []
        for a, b in ((self._X_all, X), (self._y_all, y), (self._xi_all, xi)):
            arr = np.empty((src.size,) + a.shape[1:], dtype=np.result_type(a, b))
            jit.gather_rows(_two_d(a), _two_d(b), src, _two_d(arr))
            out.append(arr)
        return out

    def _set_all(
        self,
        ids: np.ndarray,
        buf: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        xi: np.ndarray,
        starts: np.ndarray,
    ) -> None:
        """Every chain's rows from arrays of all of them, chain after chain (chain c's at
        ``starts[c]:starts[c+1]``): each chain's :class:`_Rows` are views of them."""
        rows = []
        for c in range(self.chains):
            s = slice(int(starts[c]), int(starts[c + 1]))
            rows.append(_Rows(ids[s], X[s], y[s], xi[s], buf[s]))
        self._rows = rows
        self._buffer_all, self._starts = buf, starts
        self._ids_all, self._X_all, self._y_all, self._xi_all = ids, X, y, xi
        self._buffers_of = tuple(rows)
        self._views_of_all = True

    def _rebuild(self) -> None:
        """The compiled kernel's buffer, when a chain's rows have changed (an iteration
        where z changed for no chain rebuilds nothing; a changed chain's row constants are
        recomputed, the other chains' copied into the new buffer as they are)."""
        if self._compiled is None or any(r is None for r in self._rows):
            return
        rows = tuple(self._rows)
        if len(rows) != len(self._buffers_of) or any(
            a is not b for a, b in zip(rows, self._buffers_of, strict=True)
        ):
            self._buffer_all = np.concatenate([self._buffer(r) for r in rows])
            self._starts = np.zeros(self.chains + 1, dtype=np.int64)
            self._starts[1:] = np.cumsum([r.ids.size for r in rows])
            self._ids_all = np.concatenate([r.ids for r in rows])
            self._X_all = np.concatenate([r.X for r in rows])
            self._y_all = np.concatenate([r.y for r in rows])
            self._xi_all = np.concatenate([r.xi for r in rows])
            self._buffers_of = rows

    def _buffer(self, rows: _Rows) -> np.ndarray:
        """One chain's rows as the compiled kernel reads them: features, then the model's
        row constants (built once per set of rows; :meth:`apply` carries them over)."""
        if rows.buf is None:
            rows.buf = self.row_buffer([rows.X], rows.y, rows.xi)
        return rows.buf

    def row_buffer(
        self,
        X: list[np.ndarray],
        y: np.ndarray,
        xi: np.ndarray,
        consts: np.ndarray | None = None,
    ) -> np.ndarray:
        """Rows as the compiled kernel reads them: the features (``X``: parts of the rows,
        in order, each copied once into the buffer), then the model's row constants (a
        function of each row's target ``y`` and tight point ``xi`` alone: ``consts``
        where the shards gave them, else computed here)."""
        D = X[0].shape[1]
        if consts is None:
            consts = self.model.row_constants(y, xi)
        buf = np.empty((consts.shape[0], D + consts.shape[1]))
        np.concatenate(X, out=buf[:, :D])  # (a ValueError unless the rows add up)
        buf[:, D:] = consts
        return buf

    def evaluate(
        self, points: list[np.ndarray | None], grad: list[bool]
    ) -> list[tuple[np.ndarray, np.ndarray | None, int] | None]:
        """``Σ_bright log L~`` (and its θ-gradient) of each chain at its points.

        Parameters
        ----------
        points
            Per chain, the points ``(k, P)`` to evaluate, or None.
        grad
            Per chain, whether gradients are wanted.

        Returns
        -------
        list
            Per chain (None where ``points`` was None): the sums ``(k,)``, the gradients
            ``(k, P)`` or None, and the likelihood queries made (``k × M``).
        """
        if self._compiled is not None:
            return self._evaluate_compiled(points, grad)
        out: list[tuple[np.ndarray, np.ndarray | None, int] | None] = [None] * self.chains
        P = None
        for g in (True, False):  # with gradients, then without: one pass each
            sel = [c for c in range(self.chains) if points[c] is not None and bool(grad[c]) is g]
            live = [c for c in sel if self._rows[c].ids.size and points[c].shape[0]]
            terms = (
                bright_terms_many(
                    self.model,
                    [(points[c], self._rows[c].X, self._rows[c].y, self._rows[c].xi) for c in live],
                    g,
                )
                if live
                else []
            )
            done = dict(zip(live, terms, strict=True))
            for c in live:
                self._check_held(done[c][0], points[c], c)
            for c in sel:
                pts = points[c]
                k = pts.shape[0]
                P = pts.shape[1]
                if c in done:
                    vals, dvals = done[c]
                    sums = vals.sum(axis=1)
                    grads = self.model.grad_theta(dvals, self._rows[c].X) if g else None
                else:
                    sums = np.zeros(k)
                    grads = np.zeros((k, P)) if g else None
                out[c] = (sums, grads, k * int(self._rows[c].ids.size))
        return out

    def _check_held(self, vals: np.ndarray, thetas: np.ndarray, c: int) -> None:
        """The guard (:func:`~flymc_dist.terms.check_bounds_held`) over chain ``c``'s
        bright rows' values ``vals`` (k, M) at ``thetas`` (k, P)."""
        ids = self._rows[c].ids
        k, n = vals.shape
        check_bounds_held(
            vals.ravel(), np.arange(k + 1) * n, thetas, lambda j: int(ids[j % n]), self.model
        )

    def _evaluate_compiled(
        self, points: list[np.ndarray | None], grad: list[bool]
    ) -> list[tuple[np.ndarray, np.ndarray | None, int] | None]:
        """:meth:`evaluate` through the model's compiled form: every chain's points in one
        compiled pass per gradient flag."""
        jit, kind, par = self._compiled
        out: list[tuple[np.ndarray, np.ndarray | None, int] | None] = [None] * self.chains
        for g in (True, False):
            sel = [
                c
                for c in range(self.chains)
                if points[c] is not None and points[c].shape[0] and bool(grad[c]) is g
            ]
            if not sel:
                continue
            thetas = np.concatenate([points[c] for c in sel]) if len(sel) > 1 else points[sel[0]]
            chain_of = np.repeat(np.array(sel, dtype=np.int64), [points[c].shape[0] for c in sel])
            n, P = thetas.shape
            sums = np.empty(n)
            grads = np.empty((n, P))
            jit.replica_eval(
                self._buffer_all,
                self._starts,
                P,
                chain_of,
                np.ascontiguousarray(thetas),
                kind,
                par,
                g,
                sums,
                grads,
            )
            if np.isnan(sums).any():  # a broken bound (or a non-finite θ): find the row
                for i in np.flatnonzero(np.isnan(sums)):
                    c = int(chain_of[i])
                    rows = self._rows[c]
                    vals, _ = bright_terms(self.model, self.model.linear_predictor(
                        thetas[i : i + 1], rows.X), rows.y, rows.xi, False)  # fmt: skip
                    self._check_held(vals, thetas[i : i + 1], c)
            off = 0
            for c in sel:
                k = points[c].shape[0]
                out[c] = (
                    sums[off : off + k],
                    grads[off : off + k] if g else None,
                    k * int(self._rows[c].ids.size),
                )
                off += k
        for c in range(self.chains):  # no points: empty results
            if points[c] is not None and out[c] is None:
                P = points[c].shape[1]
                out[c] = (np.zeros(0), np.zeros((0, P)) if grad[c] else None, 0)
        return out

    def fused_targets(self, bound: BoundStats) -> FusedTargets:
        """Every chain's FlyMC conditional (its bright rows here, the collapsed ``bound``,
        the prior) as compiled targets a kernel can run whole steps on
        (:meth:`~flymc_dist.kernels.base.Kernel.fused_steps`); only when :attr:`fusable`,
        after the first :meth:`apply`."""
        if self._compiled is None or self._buffer_all is None:
            raise RuntimeError("no compiled targets: see BrightReplica.fusable")
        _, kind, par = self._compiled
        if self._fused_bound is None or self._fused_bound[0] is not bound:
            from flymc_dist._compiled_kernels import PRIOR_KINDS  # numba: where it computes

            prior_kind, k, const = self.model.prior_compiled_terms()
            self._fused_bound = (
                bound,
                np.ascontiguousarray(bound.A + bound.A.T, dtype=np.float64),
                np.ascontiguousarray(bound.b, dtype=np.float64),
                float(bound.c),
                PRIOR_KINDS[prior_kind],
                k,
                const,
            )
        _, S, b, c, prior_kind, k, const = self._fused_bound
        return FusedTargets(
            self._buffer_all, self._starts, kind, par, S, b, c, prior_kind, k, const,
            self.kernel_clock, self.held,
        )  # fmt: skip
