"""A shard's rows behind one interface: in memory (:class:`MemoryRows`) or left in the
store (:class:`StoreRows`).

:class:`~flymc_dist.shard.shard.Shard` reads its rows only through these methods, so the
z-updates, evaluations and full passes are written once:

- ``retune()``: recompute the tight points and row constants (``prepare``'s rule);
- ``blocks(block)``: every row as read-only ``(X, y, xi)`` blocks (a full pass);
- ``gather(rows)``: features, target and tight point of rows the shard may touch now
  (bright rows; out of core also the current window's);
- ``rows_at(rows)``: any rows, for the add-on samplers (out of core: a store read);
- ``compiled(rows, seg)``: the buffers the compiled ``log L~`` reads ``rows`` from;
- ``z_window(q)`` / ``after_z(ids)``: the rows a z-update may change and its proposal
  probability (all rows in memory; out of core the current chunk), and what to hold after;
- ``state()``: what ``Shard.state`` reports of the storage.

Each holds its rows as one ``(n, D + K)`` buffer ``XC`` (features, then the ``K`` row
constants of the model's compiled ``log L~``): evaluating a scattered row then touches
one place in memory, not two. ``prepare(X, y) -> (xi, consts)`` gives the tight points of
rows and their constants under the shard's current rule (tuned at θ̂ or not, exact rows).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from flymc_dist.shard.chunks import Chunk, ChunkSource, RowStore

Prepare = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray | None, np.ndarray | None]]

#: out of core, ``chunk_iterations=None``: the bytes of rows read per iteration at most (a
#: chunk of float64 features and target stays the window for chunk bytes / WINDOW_BYTES
#: iterations). Reading runs ahead on a thread at some 300 MB/s on a 2-core machine, so
#: this keeps it near 0.4 ms per iteration; a row's z is then revisited once every
#: (shard bytes / WINDOW_BYTES) iterations.
WINDOW_BYTES = 128 * 1024


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """The bound ``method`` called through a weak reference to its object: rows may then
    call back into their shard without a reference cycle, which would keep a finished
    run's rows in a worker's memory until the garbage collector happened to run
    (measured: 1 GB per worker at 10⁷ × 20 after each run on a reused cluster)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        if bound is None:
            raise RuntimeError("the shard these rows belonged to is gone")
        return bound(*args)

    return call


def read_only(a: np.ndarray) -> np.ndarray:
    """A view of ``a`` that cannot be written through."""
    v = a.view()
    v.flags.writeable = False
    return v


class MemoryRows:
    """A shard's rows in memory.

    Parameters
    ----------
    XC
        ``(n, D + K)`` float64: the features, then room for the ``K`` row constants.
    n_features
        D.
    y
        The targets.
    prepare
        The tight points' and row constants' rule (see the module notes).
    """

    out_of_core = False

    def __init__(self, XC: np.ndarray, n_features: int, y: np.ndarray, prepare: Prepare) -> None:
        self.XC = XC
        self.n_features = int(n_features)
        self.X = XC[:, : self.n_features]
        self.y = np.asarray(y)
        self.n = int(XC.shape[0])
        self._consts = XC[:, self.n_features :] if XC.shape[1] > self.n_features else None
        self._prepare = prepare
        self.xi: np.ndarray | None = None
        #: rows of each full pass's blocks: any (the caller's)
        self.chunk_rows: int | None = None

    def retune(self) -> None:
        """Tight points and row constants of every row, under the current rule."""
        xi, consts = self._prepare(self.X, self.y)
        self.xi = xi
        if self._consts is not None and consts is not None:
            if consts.shape != self._consts.shape:
                raise ValueError(
                    f"row_constants gave shape {consts.shape}, expected {self._consts.shape}"
                )
            self._consts[...] = consts

    def blocks(self, block: int | None) -> Iterator[tuple[np.ndarray, np.ndarray, Any]]:
        """Every row as read-only ``(X, y, xi)`` blocks of ``block`` rows (None: one)."""
        step = max(self.n if block is None else block, 1)
        for lo in range(0, max(self.n, 1), step):
            xi = None if self.xi is None else read_only(self.xi[lo : lo + step])
            yield read_only(self.X[lo : lo + step]), read_only(self.y[lo : lo + step]), xi

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Features, target and tight point of ``rows``."""
        return self.X[rows], self.y[rows], self.xi[rows]

    def rows_at(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """:meth:`gather` of any rows, with None for unset tight points."""
        return self.X[rows], self.y[rows], None if self.xi is None else self.xi[rows]

    def compiled(
        self, rows: np.ndarray, seg: np.ndarray, lists: Callable[[], Any]
    ) -> tuple[Any, np.ndarray, np.ndarray]:
        """The buffers the compiled ``log L~`` reads (``lists()``: the shard's typed list
        of this buffer), ``rows`` there, and each segment's buffer (all the one)."""
        return lists(), rows, np.zeros(seg.size - 1, np.int64)

    def z_window(self, q: float) -> tuple[tuple[int, int] | None, float]:
        """Every row, at proposal probability ``q``."""
        return None, q

    def after_z(self, bright: list[np.ndarray]) -> None:
        """Nothing to hold: every row is here."""

    def reset(self) -> None:
        """Nothing to forget."""

    def drop_prepared(self) -> None:
        """Nothing is prepared ahead."""

    def state(self) -> dict[str, Any]:
        """What the shard reports of its storage."""
        return {"held_rows": self.n, "chunk_iterations": None, "bytes_read": 0}


class StoreRows:
    """A shard's rows left in the store: in memory only what is O(bright) or O(chunk).

    The rows bright in some chain (:class:`RowStore`) and the store chunk the z-updates
    currently work on, with the next one read ahead (:class:`ChunkSource`); full passes
    stream the store chunk by chunk. The z-update works on a *window*, chunk
    ``k = (t // r) mod m`` at the ``t``-th z-update since the chains were placed (``m``
    chunks, ``r`` = ``chunk_iterations``, by default chunk bytes / :data:`WINDOW_BYTES`),
    with the proposal probability raised to ``q·n / window rows`` (capped at 1): see
    :class:`~flymc_dist.shard.shard.Shard` for why that is exact.

    Parameters
    ----------
    dataset
        The store.
    start, stop
        The shard's rows in it.
    n_constants
        K.
    prepare
        The tight points' and row constants' rule (see the module notes); applied to each
        chunk as it is read.
    chunk_iterations
        ``r`` above (None: by :data:`WINDOW_BYTES`).
    """

    out_of_core = True

    def __init__(
        self,
        dataset: Any,
        start: int,
        stop: int,
        n_constants: int,
        prepare: Prepare,
        chunk_iterations: int | None,
    ) -> None:
        self._K = int(n_constants)
        self._prepare = prepare
        self.source = ChunkSource(dataset, start, stop, self._prepare_chunk)
        self.held = RowStore(dataset.n_features, self._K)
        #: the z-updates' current chunk
        self.window: Chunk | None = None
        self._z_steps = 0  # z-updates since the chains were placed
        self.n, self.n_features = int(stop - start), int(dataset.n_features)
        #: rows of each full pass's blocks: the store's chunks
        self.chunk_rows: int | None = self.source.max_rows if self.source.n_chunks > 1 else None
        #: iterations each chunk is the window
        self.chunk_iterations = chunk_iterations or max(
            1, math.ceil(self.source.max_rows * (self.n_features + 1) * 8 / WINDOW_BYTES)
        )

    def _prepare_chunk(self, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """The tight points of a chunk's rows and the rows as one ``(n, D + K)`` buffer."""
        xi, consts = self._prepare(X, y)
        XC = np.empty((X.shape[0], X.shape[1] + self._K))
        XC[:, : X.shape[1]] = X
        if self._K and consts is not None:
            XC[:, X.shape[1] :] = consts
        return xi, XC

    def retune(self) -> None:
        """New tight points: recomputed for the held rows, and for each chunk as it is
        read (the read ahead, computed under the old rule, is dropped)."""
        self.source.drop_ahead()
        xi, consts = self._prepare(self.held.X, self.held.y)
        if xi is not None:
            self.held.set_xi(xi, consts if self._K else None)
        self.window = None

    def blocks(self, block: int | None) -> Iterator[tuple[np.ndarray, np.ndarray, Any]]:
        """Every row as read-only ``(X, y, xi)`` blocks: the store's chunks, read one ahead
        (``block`` is not used)."""
        for chunk in self.source.stream():
            xi = None if chunk.xi is None else read_only(chunk.xi)
            yield read_only(chunk.X), read_only(chunk.y), xi

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Features, target and tight point of ``rows``: held, or in the window."""
        return self.held.gather(rows, self.window)

    def rows_at(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Any rows: one read of the store chunks they touch (counted in ``bytes_read``),
        with their tight points."""
        X, y = self.source.read_rows(rows)
        xi, _ = self._prepare(X, y)
        return X, y, xi

    def compiled(
        self, rows: np.ndarray, seg: np.ndarray, lists: Callable[[], Any]
    ) -> tuple[Any, np.ndarray, np.ndarray]:
        """The buffers (held rows, window) — a tuple, which the compiled functions index
        as they do a typed list, at no cost to build — ``rows`` in them, and which of the
        two holds each segment (:func:`flymc_dist._compiled.locate_segments`)."""
        from flymc_dist import _compiled

        store, win = self.held, self.window
        window = win.XC if win is not None else np.empty((0, store.XC.shape[1]))
        local = np.empty_like(rows)
        src = np.empty(seg.size - 1, np.int64)
        lo, hi = (win.lo, win.hi) if win is not None else (0, 0)
        if not _compiled.locate_segments(store.ids, rows, seg, lo, hi, local, src):
            raise RuntimeError("out-of-core shard: rows neither held nor in the current chunk")
        return (store.XC, window), local, src

    def z_window(self, q: float) -> tuple[tuple[int, int], float]:
        """This z-update's window and its proposal probability; the window's chunk is read
        (or taken from the read ahead) and the next one started."""
        src, r = self.source, self.chunk_iterations
        t, m = self._z_steps, src.n_chunks
        self._z_steps += 1
        k = (t // r) % m
        if self.window is None or self.window.lo != src.ranges[k][0]:
            self.window = src.get(k, (k + 1) % m if m > 1 else None)
        lo, hi = src.ranges[k]
        return (lo, hi), min(1.0, q * self.n / max(hi - lo, 1))

    def after_z(self, bright: list[np.ndarray]) -> None:
        """Hold exactly the rows bright in some chain (``bright``: each chain's)."""
        ids = np.unique(np.concatenate(bright)).astype(np.int64, copy=False)
        self.held.keep(ids, self.window)

    def reset(self) -> None:
        """Chains placed anew: the window schedule starts again."""
        self.window, self._z_steps = None, 0

    def drop_prepared(self) -> None:
        """Forget the chunk read ahead (its tight points were prepared under the old rule)."""
        self.source.drop_ahead()

    def state(self) -> dict[str, Any]:
        """What the shard reports of its storage."""
        return {
            "held_rows": int(self.held.ids.size),
            "chunk_iterations": self.chunk_iterations,
            "bytes_read": self.source.bytes_read,
        }
