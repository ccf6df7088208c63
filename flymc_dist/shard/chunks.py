"""The rows of an out-of-core shard: read from the store a chunk at a time.

A shard whose rows do not fit its memory budget keeps them in the zarr store and holds
in memory only what is O(bright) or O(chunk) (see :class:`flymc_dist.shard.Shard`):

- :class:`ChunkSource` reads the shard's rows one store chunk at a time, whole chunks
  as contiguous slices (zarr's fancy indexing is slow and it keeps no decoded chunks),
  with the next chunk read ahead on a background thread while the caller computes;
- :class:`RowStore` keeps the rows that are bright in some chain — their features,
  target and tight point — sorted by row, for the θ-step's evaluations and the
  driver's replica.

Knows nothing of models, chains or Dask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
from distributed import get_worker

from flymc_dist.data import Dataset


class Chunk(NamedTuple):
    """Rows ``lo:hi`` of a shard (shard-local row numbers) with their data."""

    lo: int
    hi: int
    X: np.ndarray  # (hi - lo, D) float64
    y: np.ndarray  # (hi - lo,)
    xi: np.ndarray | None  # their tight points (see ChunkSource), or None
    XC: np.ndarray  # (hi - lo, D + K): the features and K row constants (X is a view)


class ChunkSource:
    """A shard's rows in its store, read one store chunk at a time with one read ahead.

    Parameters
    ----------
    dataset
        The store.
    start, stop
        The shard's rows in it.
    prepare
        ``prepare(X, y) -> (xi, XC)``: the tight points of a chunk's rows (or None) and
        its rows as features followed by their row constants, computed with the read —
        on the read-ahead thread, off the caller's path.
    """

    def __init__(
        self,
        dataset: Dataset,
        start: int,
        stop: int,
        prepare: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray | None, np.ndarray]],
    ) -> None:
        self._ds = dataset
        self._prepare = prepare
        self.start, self.stop = int(start), int(stop)
        cr = self._ds.chunk_rows
        edges = [self.start]
        while edges[-1] < self.stop:
            edges.append(min((edges[-1] // cr + 1) * cr, self.stop))
        #: the shard-local row ranges of the store chunks the shard overlaps
        self.ranges = [
            (a - self.start, b - self.start) for a, b in zip(edges[:-1], edges[1:], strict=True)
        ]
        self.max_rows = max((b - a for a, b in self.ranges), default=0)
        self._edges = np.asarray(edges, dtype=np.int64)  # store rows where chunks start
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future] | None = None
        #: bytes read from the store so far (as float64 features and targets)
        self.bytes_read = 0

    @property
    def n_chunks(self) -> int:
        """The number of store chunks the shard overlaps."""
        return len(self.ranges)

    def read(self, k: int) -> Chunk:
        """Chunk ``k`` (float64 features), read now."""
        lo, hi = self.ranges[k]
        X, y = self._ds.read(self.start + lo, self.start + hi)
        self.bytes_read += X.nbytes + y.nbytes
        xi, XC = self._prepare(X, y)
        return Chunk(lo, hi, XC[:, : X.shape[1]], y, xi, XC)

    def read_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The shard-local ``rows`` (any order, distinct) as float64 ``(X, y)`` in that
        order: one store read of the chunks they touch (sorted, all fetched concurrently:
        :meth:`Dataset.read_rows`). Each touched chunk is decoded whole, so
        :attr:`bytes_read` counts whole chunks: rows scattered over the shard cost about
        a full pass once they are as many as its chunks."""
        rows = np.asarray(rows, dtype=np.int64)
        order = np.argsort(rows, kind="stable")
        idx = rows[order] + self.start
        X = np.empty((rows.size, self._ds.n_features))
        Xs, y_s = self._ds.read_rows(idx)
        X[order] = Xs
        y = np.empty(rows.size, dtype=y_s.dtype)
        y[order] = y_s
        if rows.size:
            e = self._edges
            touched = np.unique(np.searchsorted(e, idx, side="right") - 1)
            touched_rows = int((e[touched + 1] - e[touched]).sum())
            self.bytes_read += touched_rows * (self._ds.n_features + 1) * 8
        return X, y

    def get(self, k: int, then: int | None = None) -> Chunk:
        """Chunk ``k`` — from the read ahead if it is the one under way — and start
        reading chunk ``then`` in the background."""
        if self._ahead is not None and self._ahead[0] == k:
            chunk, self._ahead = self._ahead[1].result(), None
        else:
            self.drop_ahead()  # a read of another chunk, if any: let it finish, drop it
            chunk = self.read(k)
        if then is not None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="flymc-chunk-read")
            self._ahead = (then, self._pool.submit(self.read, then))
        return chunk

    def drop_ahead(self) -> None:
        """Wait for the read ahead, if any, and forget it (e.g. the tight points it
        computes are out of date)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].result()

    def stream(self) -> Iterator[Chunk]:
        """Every chunk in order, each next one read while the caller works on the last."""
        m = self.n_chunks
        for k in range(m):
            yield self.get(k, k + 1 if k + 1 < m else None)


class RowStore:
    """Rows held in memory by an out-of-core shard, sorted by (shard-local) row number.

    Parameters
    ----------
    n_features
        D, the width of the rows' features.
    n_constants
        K, the row constants kept after them (see :class:`Chunk`).
    """

    def __init__(self, n_features: int, n_constants: int = 0) -> None:
        self.D = int(n_features)
        self.ids = np.empty(0, dtype=np.int64)
        self.XC = np.empty((0, self.D + int(n_constants)))
        self.y = np.empty(0)
        self.xi = np.empty(0)

    @property
    def X(self) -> np.ndarray:
        """The held rows' features (a view)."""
        return self.XC[:, : self.D]

    def _find(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where ``rows`` sit in the store, and which of them it holds."""
        pos = np.searchsorted(self.ids, rows)
        held = pos < self.ids.size
        held[held] = self.ids[pos[held]] == rows[held]
        return pos, held

    def _take(
        self, rows: np.ndarray, window: Chunk | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows (features and constants), target and tight point of ``rows``: held ones
        from the store, the others from the chunk ``window``, where they must lie."""
        rows = np.asarray(rows, dtype=np.int64)
        pos, held = self._find(rows)
        if held.all():
            return self.XC[pos], self.y[pos], self.xi[pos]
        o = _window_offsets(rows[~held], window)
        XC = np.empty((rows.size, self.XC.shape[1]))
        y = np.empty(rows.size, dtype=np.result_type(self.y.dtype, window.y.dtype))
        t = np.empty(rows.size)
        XC[held], y[held], t[held] = self.XC[pos[held]], self.y[pos[held]], self.xi[pos[held]]
        XC[~held], y[~held], t[~held] = window.XC[o], window.y[o], window.xi[o]
        return XC, y, t

    def gather(
        self, rows: np.ndarray, window: Chunk | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Features, target and tight point of ``rows``: held ones from the store, the
        others from the chunk ``window``, where they must lie."""
        XC, y, xi = self._take(rows, window)
        return XC[:, : self.D], y, xi

    def keep(self, needed: np.ndarray, window: Chunk | None) -> None:
        """Hold exactly the sorted rows ``needed``: drop the others, add the new ones from
        ``window``."""
        if needed.size == self.ids.size and np.array_equal(needed, self.ids):
            return
        XC, y, xi = self._take(needed, window)
        self.ids, self.XC, self.y, self.xi = needed.copy(), XC, y, xi

    def set(self, ids: np.ndarray, XC: np.ndarray, y: np.ndarray, xi: np.ndarray) -> None:
        """Replace every held row (sorted ``ids``; features and constants ``XC``)."""
        self.ids, self.XC, self.y, self.xi = ids, XC, y, xi

    def set_xi(self, xi: np.ndarray, consts: np.ndarray | None) -> None:
        """New tight points (and row constants) of the held rows (after a retuning)."""
        self.xi = np.asarray(xi, dtype=np.float64)
        if consts is not None:
            self.XC[:, self.D :] = consts


def _window_offsets(rows: np.ndarray, window: Chunk | None) -> np.ndarray:
    """The offsets of ``rows`` in the chunk ``window``, where they must all lie."""
    off = rows - (window.lo if window is not None else 0)
    if window is None or np.any((off < 0) | (off >= window.hi - window.lo)):
        raise RuntimeError("out-of-core shard: rows neither held nor in the current chunk")
    return off


def worker_memory_limit() -> int | None:
    """The memory limit of the Dask worker this runs on (bytes), or None (no worker, or
    no limit)."""
    try:
        worker: Any = get_worker()
    except ValueError:  # not on a worker
        return None
    limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
    return int(limit) if limit else None
