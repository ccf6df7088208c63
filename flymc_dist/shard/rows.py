"""A shard's rows behind one interface: in memory (:class:`MemoryRows`) or in a local
row file, out of core (:class:`FileRows`).

:class:`~flymc_dist.shard.state.Shard` reads its rows only through these methods, so the
z-updates, evaluations and full passes are written once:

- ``XC``, ``y``, ``xi``: the *resident* rows — features then the ``K`` row constants of the
  model's compiled ``log L~`` in one ``(·, D + K)`` buffer (evaluating a scattered row
  then touches one place in memory), targets and tight points: every row in memory;
  out of core the rows some chain has bright and those fetched for this z-update;
- ``locate(rows)``: where shard-local rows sit in those buffers (in memory: the rows);
- ``fetch(rows)``: make rows resident now (out of core; in memory every row is);
  ``read_ahead(wanted, later)``: read and prepare the next z-updates' proposals
  between rounds, and have the page cache fetch the one after's; ``proposals(key,
  rows)``: the buffer a z-update evaluates its proposals from, and where each sits there;
- ``admit(rows, at)``: make resident the proposals that turned bright (before the
  round's reply); ``keep(bright)``: drop the rows no chain has bright (after it);
- ``sweep()``: every row resident in turn, for the exact draw of z at placement;
- ``retune()``: tight points and row constants of the resident rows under the current
  rule; ``blocks(block)``: every row as read-only ``(X, y, xi)`` blocks (a full pass);
- ``gather(rows)`` / ``rows_at(rows)``: resident rows / any rows;
  ``rows_and_constants(rows, dtype)``: any rows with their constants (a read-ahead's);
- ``state()``, ``close()``.

``prepare(X, y) -> (xi, consts)`` gives the tight points of rows and their constants under
the shard's current rule (tuned at θ̂ or not, exact rows), row by row: a row's values do
not depend on the rows prepared with it, so out-of-core rows, prepared as they are read,
are the same bits as in memory.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numba
import numpy as np

from flymc_dist._compiled import JIT
from flymc_dist._numerics import in_sorted
from flymc_dist.shard.rowfile import BLOCK_BYTES, RowFile

Prepare = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray | None, np.ndarray | None]]


# ------------------------------------------------------------ the arena's compiled loops
# A round's bookkeeping of the resident rows touches a few rows among a few hundred: in
# numpy it is a dozen array operations of a few microseconds each (measured: 0.2 ms of
# an out-of-core round at 10^6 x 57), here one compiled call each.


@numba.njit(**JIT)
def _find(ids: np.ndarray, slot: np.ndarray, rows: np.ndarray, out: np.ndarray) -> int:
    """The slots of ``rows`` among the sorted resident ``ids`` (their slots ``slot``)
    into ``out``; returns the index of the first row not resident, or -1."""
    n = ids.size
    for i in range(rows.size):
        r = rows[i]
        k = np.searchsorted(ids, r)
        if k == n or ids[k] != r:
            return i
        out[i] = slot[k]
    return -1


@numba.njit(**JIT)
def _admit(
    ids: np.ndarray,
    slot: np.ndarray,
    free: np.ndarray,
    rows: np.ndarray,
    at: np.ndarray,
    src_XC: np.ndarray,
    src_y: np.ndarray,
    src_xi: np.ndarray,
    XC: np.ndarray,
    y: np.ndarray,
    xi: np.ndarray,
    new_ids: np.ndarray,
    new_slot: np.ndarray,
) -> int:
    """Make resident the distinct ``rows`` (any order, repeats allowed) that are not:
    each from position ``at`` of the buffers ``src_*`` into the next free slot (``free``
    in order) of the arena ``XC``, ``y``, ``xi`` (``xi`` two-dimensional; zero columns:
    none). Writes the merged sorted ids and their slots to ``new_ids`` / ``new_slot``
    (room for ``ids.size + rows.size``) and returns the number of rows added (the free
    slots used)."""
    order = np.argsort(rows)
    add = np.empty(rows.size, dtype=np.int64)
    k = 0
    last = -1
    for j in range(rows.size):
        i = order[j]
        r = rows[i]
        if r == last:
            continue
        last = r
        p = np.searchsorted(ids, r)
        if p < ids.size and ids[p] == r:
            continue
        s = free[k]
        a = at[i]
        for d in range(XC.shape[1]):
            XC[s, d] = src_XC[a, d]
        y[s] = src_y[a]
        for e in range(xi.shape[1]):
            xi[s, e] = src_xi[a, e]
        add[k] = r
        k += 1
    i = j = o = 0
    while i < ids.size or j < k:
        if j == k or (i < ids.size and ids[i] < add[j]):
            new_ids[o] = ids[i]
            new_slot[o] = slot[i]
            i += 1
        else:
            new_ids[o] = add[j]
            new_slot[o] = free[j]
            j += 1
        o += 1
    return k


@numba.njit(**JIT)
def _split_rows(
    XC: np.ndarray, D: int, rows: np.ndarray, X: np.ndarray, consts: np.ndarray
) -> None:
    """``XC[rows]`` split into its features ``X`` and constants ``consts``, each row read
    once (two numpy gathers read it twice, each a pass of its own over scattered rows)."""
    W = XC.shape[1]
    for k in range(rows.size):
        r = rows[k]
        if not 0 <= r < XC.shape[0]:
            raise IndexError("a row beyond the shard's rows")
        for d in range(D):
            X[k, d] = XC[r, d]
        for d in range(D, W):
            consts[k, d - D] = XC[r, d]


def xi_offset(n: int, y_dtype: np.dtype) -> int:
    """Where the tight points start in a lent shard's second segment: after its ``n``
    targets of ``y_dtype``, 8-byte aligned."""
    return -(-n * np.dtype(y_dtype).itemsize // 8) * 8


def tail_bytes(n: int, y_dtype: np.dtype) -> int:
    """The bytes of a lent shard's second segment: ``n`` targets of ``y_dtype``, then
    ``n`` float64 tight points."""
    return xi_offset(n, y_dtype) + 8 * n


def rows_and_constants(
    XC: np.ndarray,
    D: int,
    y: np.ndarray,
    xi: np.ndarray | None,
    rows: np.ndarray,
    dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """Features (as ``dtype``), targets, tight points (None: none set) and row constants
    ``(n, K)`` of ``rows`` of the buffer ``XC`` (features, then constants): what a
    read-ahead reply carries, the same bits wherever the buffer is read (the host's own
    memory, or the driver's view of it lent, :mod:`flymc_dist.shard.shared`)."""
    n = rows.size
    X = np.empty((n, D), dtype=dtype)
    consts = np.empty((n, XC.shape[1] - D), dtype=XC.dtype)
    _split_rows(XC, D, rows, X, consts)
    return X, y[rows], None if xi is None else xi[rows], consts


@numba.njit(**JIT)
def _bright_in_any(ids: np.ndarray, members: np.ndarray, seg: np.ndarray, out: np.ndarray) -> int:
    """Whether each of ``ids`` is among some chain's sorted bright rows
    (``members[seg[c]:seg[c + 1]]``), into ``out``; returns how many are."""
    kept = 0
    for i in range(ids.size):
        r = ids[i]
        hit = False
        for c in range(seg.size - 1):
            lo, hi = seg[c], seg[c + 1]
            p = lo + np.searchsorted(members[lo:hi], r)
            if p < hi and members[p] == r:
                hit = True
                break
        out[i] = hit
        kept += hit
    return kept


@numba.njit(**JIT)
def _not_in(ids: np.ndarray, rows: np.ndarray) -> bool:
    """Whether any of the sorted ``rows`` is not among the sorted ``ids``: one merge."""
    i = 0
    for j in range(rows.size):
        r = rows[j]
        while i < ids.size and ids[i] < r:
            i += 1
        if i == ids.size or ids[i] != r:
            return True
    return False


@numba.njit(**JIT)
def _distinct_rows(rows: np.ndarray, out: np.ndarray, pos: np.ndarray) -> int:
    """The distinct ``rows`` (any order, repeats allowed), sorted, into ``out``, and
    where each of ``rows`` sits there into ``pos``; returns their number."""
    order = np.argsort(rows)
    k = -1
    for j in range(rows.size):
        i = order[j]
        r = rows[i]
        if k < 0 or r != out[k]:
            k += 1
            out[k] = r
        pos[i] = k
    return k + 1


def distinct(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(rows, return_inverse=True)`` of int64 rows, in one compiled pass."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    out = np.empty(rows.size, dtype=np.int64)
    pos = np.empty(rows.size, dtype=np.int64)
    return out[: _distinct_rows(rows, out, pos)], pos


#: the tight points' stand-in when there are none (the compiled loops' form)
_NO_XI = np.empty((0, 0))


def _as_2d(a: np.ndarray | None) -> np.ndarray:
    """``a`` as (rows, columns) for the compiled loops (None: no columns)."""
    if a is None:
        return _NO_XI
    if a.ndim == 1:
        return a[:, None]
    return a if a.ndim == 2 else a.reshape(a.shape[0], math.prod(a.shape[1:]))


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
    segments
        Where ``XC`` lives in shared memory, and a second segment of at least
        :func:`tail_bytes` for the targets and tight points: the rows can then be lent
        to a driver on this machine (:meth:`lend`). None: private memory.
    """

    out_of_core = False

    def __init__(
        self,
        XC: np.ndarray,
        n_features: int,
        y: np.ndarray,
        prepare: Prepare,
        segments: tuple[Any, Any] | None = None,
    ) -> None:
        self.XC = XC
        self.n_features = int(n_features)
        self.X = XC[:, : self.n_features]
        self.y = np.asarray(y)
        self.n = int(XC.shape[0])
        self._segments = segments
        #: the tight points' place in shared memory (None: private memory)
        self._xi_shared: np.ndarray | None = None
        if segments is not None:
            tail = segments[1]
            y_shared = tail.array((self.n,), self.y.dtype)
            y_shared[...] = self.y
            self.y = y_shared
            self._xi_shared = tail.array((self.n,), np.float64, xi_offset(self.n, self.y.dtype))
        self._consts = XC[:, self.n_features :] if XC.shape[1] > self.n_features else None
        self._prepare = prepare
        self.xi: np.ndarray | None = None
        #: full passes over the rows so far (the caller counts the load from a store)
        self.passes = 0

    def retune(self) -> None:
        """Tight points and row constants of every row, under the current rule."""
        xi, consts = self._prepare(self.X, self.y)
        shared = self._xi_shared
        if (
            shared is not None
            and isinstance(xi, np.ndarray)
            and xi.shape == shared.shape
            and xi.dtype == shared.dtype
        ):
            shared[...] = xi  # where a driver this memory is lent to reads it
            xi = shared
        self.xi = xi
        if self._consts is not None and consts is not None:
            if consts.shape != self._consts.shape:
                raise ValueError(
                    f"row_constants gave shape {consts.shape}, expected {self._consts.shape}"
                )
            self._consts[...] = consts

    def blocks(
        self, block: int | None, head: int | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray, Any]]:
        """Every row as read-only ``(X, y, xi)`` blocks of ``block`` rows (None: one); with
        ``head``, only the first ``head`` rows of each block (a subsample, not a pass)."""
        step = max(self.n if block is None else block, 1)
        take = step if head is None else min(step, max(int(head), 1))
        self.passes += head is None
        for lo in range(0, max(self.n, 1), step):
            xi = None if self.xi is None else read_only(self.xi[lo : lo + take])
            yield read_only(self.X[lo : lo + take]), read_only(self.y[lo : lo + take]), xi

    def locate(self, rows: np.ndarray) -> np.ndarray:
        """Where ``rows`` sit in :attr:`XC`: the rows themselves."""
        return rows

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Features, target and tight point of ``rows``."""
        return self.X[rows], self.y[rows], self.xi[rows]

    def rows_at(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """:meth:`gather` of any rows, with None for unset tight points."""
        return self.X[rows], self.y[rows], None if self.xi is None else self.xi[rows]

    def rows_and_constants(
        self, rows: np.ndarray, dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """:meth:`rows_at`, the features as ``dtype`` (float32 where they were stored so:
        exact, and no float64 copy made first), and the rows' constants ``(n, K)`` under
        the current rule as the z-update reads them (K = 0: none):
        :func:`rows_and_constants`."""
        return rows_and_constants(self.XC, self.n_features, self.y, self.xi, rows, dtype)

    def lend(self) -> tuple[list[int], dict[str, Any]]:
        """The descriptors of the shared memory the rows live in (:attr:`XC`; the targets
        and tight points) and how they are laid out (see
        :mod:`flymc_dist.shard.shared`); a ``ValueError`` when they are not in shared
        memory or no tight points are set."""
        if self._segments is None or self._xi_shared is None:
            raise ValueError("these rows are not in shared memory")
        if self.xi is not self._xi_shared:
            raise ValueError("no tight points in shared memory (none set yet, or not one a row)")
        return [s.fd for s in self._segments], {
            "n": self.n,
            "width": int(self.XC.shape[1]),
            "n_features": self.n_features,
            "y_dtype": self.y.dtype.str,
        }

    def sweep(self, unit: int | None = None) -> Iterator[tuple[int, int]]:
        """Every row, resident: one range (a full pass)."""
        self.passes += 1
        yield 0, self.n

    def span(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, Any]:
        """Rows ``lo:hi`` as read-only ``(X, y, xi)``, as :meth:`blocks` gives them."""
        xi = None if self.xi is None else read_only(self.xi[lo:hi])
        return read_only(self.X[lo:hi]), read_only(self.y[lo:hi]), xi

    def fetch(self, rows: np.ndarray) -> np.ndarray:
        """Nothing to read: every row is here (none made resident)."""
        return np.empty(0, dtype=np.int64)

    def proposals(self, key: Any, rows: np.ndarray) -> tuple[np.ndarray, None]:
        """The buffer a z-update evaluates its proposed ``rows`` from (:attr:`XC`), and
        where each sits there (None: at its own row)."""
        return self.XC, None

    def read_ahead(self, wanted: list[tuple[Any, np.ndarray]], later: np.ndarray) -> None:
        """Nothing to read ahead."""

    def admit(self, rows: np.ndarray, at: np.ndarray) -> None:
        """Nothing to take in: every row is here."""

    def keep(self, bright: list[np.ndarray]) -> None:
        """Nothing to drop."""

    def reset(self) -> None:
        """Nothing to forget."""

    def close(self) -> None:
        """Close the shared memory's descriptors, if any (the memory itself goes with the
        last array, or lent mapping, that holds it)."""
        for segment in self._segments or ():
            segment.close()

    def state(self) -> dict[str, Any]:
        """What the shard reports of its storage."""
        return {"held_rows": self.n, "rows_read": 0, "bytes_read": 0, "passes": self.passes}


class FileRows:
    """A shard's rows in a local row file (:class:`~flymc_dist.shard.rowfile.RowFile`),
    with in memory only the *resident* rows: those bright in some chain, and those a
    z-update is about to evaluate.

    The z-update is the in-memory one: its dark→bright proposals (the rows of each
    chain's Bernoulli(q) process, which depend on neither θ nor z) are read before it
    runs — the next iteration's between rounds, once the last round's reply has gone
    (:meth:`read_ahead`) — into a buffer of their own (:meth:`proposals`); the few that
    turn bright are copied into the resident rows (:meth:`admit`), and rows no chain
    has bright any more are dropped after the reply (:meth:`keep`). Resident rows sit
    in an arena (``XC``, ``y``, ``xi``) at slots found through the sorted ``ids``
    (:meth:`locate`), so taking in and dropping a few rows moves nothing else.

    Parameters
    ----------
    dataset
        The store (read once, into the row file).
    start, stop
        The shard's rows in it.
    n_constants
        K.
    prepare
        The tight points' and row constants' rule (see the module notes); applied to rows
        as they are read.
    directory
        Where the row file goes.
    each
        Sees every store chunk as it is read (:meth:`RowFile.create`).
    """

    out_of_core = True

    def __init__(
        self,
        dataset: Any,
        start: int,
        stop: int,
        n_constants: int,
        prepare: Prepare,
        directory: str,
        each: Callable[[int, np.ndarray], None] | None = None,
    ) -> None:
        self._K = int(n_constants)
        self._prepare = prepare
        self.file = RowFile.create(dataset, start, stop, directory, each)
        self.n, self.n_features = self.file.n, self.file.n_features
        #: full passes over the rows so far: the store's, into the row file, then the file's
        self.passes = 1
        self.ids = np.empty(0, dtype=np.int64)  # the resident rows, sorted
        self._slot = np.empty(0, dtype=np.int64)  # their slots in the arena
        self._free = np.empty(0, dtype=np.int64)  # free slots
        self.XC = np.empty((0, self.n_features + self._K))
        self.y = np.empty(0, dtype=self.file.rec_dtype["y"])
        self.xi: np.ndarray | None = None
        #: the next z-updates' proposals, read and prepared ahead (:meth:`read_ahead`):
        #: sorted rows, their buffer, targets and tight points
        self._ahead: tuple[np.ndarray, np.ndarray, np.ndarray, Any] | None = None
        #: the proposals :attr:`_ahead` holds, by key: where each of them sits in it
        self._ahead_for: dict[Any, np.ndarray] = {}
        #: proposals read ahead, not yet prepared, by key: their sorted distinct rows,
        #: where each proposal sits among them, and their features and targets
        self._staged: dict[Any, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        #: the last :meth:`proposals`' buffer: rows, their features, targets, tight points
        self._proposed: tuple[np.ndarray, np.ndarray, np.ndarray, Any] | None = None
        #: rows read by position (the z-updates' proposals, read ahead or not)
        self.rows_read = 0

    # ---------------------------------------------------------------- the arena
    def _prepared(self, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, Any]:
        """Rows ``(X, y)`` as one ``(n, D + K)`` buffer with their row constants, and their
        tight points, under the current rule."""
        xi, consts = self._prepare(X, y)
        XC = np.empty((X.shape[0], self.n_features + self._K))
        XC[:, : self.n_features] = X
        if self._K and consts is not None:
            XC[:, self.n_features :] = consts
        return XC, xi

    def _room(self, m: int, xi: Any) -> None:
        """Free slots for ``m`` more rows (growing the arena), and room for tight points
        shaped as ``xi``'s rows (if not None)."""
        if self._free.size < m:  # grow the arena
            cap = self.XC.shape[0]
            new_cap = max(2 * cap, cap + m - self._free.size, 64)
            grown = np.empty((new_cap, self.XC.shape[1]))
            grown[:cap] = self.XC
            self.XC = grown
            y_new = np.empty(new_cap, dtype=self.y.dtype)
            y_new[:cap] = self.y
            self.y = y_new
            if xi is not None:
                xi_new = np.empty((new_cap,) + np.shape(xi)[1:])
                if self.xi is not None:
                    xi_new[:cap] = self.xi
                self.xi = xi_new
            self._free = np.concatenate([self._free, np.arange(cap, new_cap, dtype=np.int64)])
        if xi is not None and self.xi is None:
            self.xi = np.empty((self.XC.shape[0],) + np.shape(xi)[1:])

    def _insert(self, rows: np.ndarray, XC: np.ndarray, y: np.ndarray, xi: Any) -> None:
        """Make the sorted ``rows`` (none resident) resident, with their data."""
        m = rows.size
        if m == 0:
            return
        self._room(m, xi)
        slots, self._free = self._free[:m], self._free[m:]
        self.XC[slots] = XC
        self.y[slots] = y
        if xi is not None:
            self.xi[slots] = xi
        pos = np.searchsorted(self.ids, rows)
        self.ids = np.insert(self.ids, pos, rows)
        self._slot = np.insert(self._slot, pos, slots)

    def _keep(self, keep: np.ndarray) -> None:
        """Keep resident the resident rows where ``keep`` is true; an arena mostly free
        (after a sweep) shrinks to twice what it holds."""
        if not keep.all():
            self._free = np.concatenate([self._free, self._slot[~keep]])
            self.ids, self._slot = self.ids[keep], self._slot[keep]
        cap, live = self.XC.shape[0], self.ids.size
        if cap > 4 * max(live, 256):
            new_cap = 2 * max(live, 64)
            self.XC = self._moved(self.XC, new_cap)
            self.y = self._moved(self.y, new_cap)
            if self.xi is not None:
                self.xi = self._moved(self.xi, new_cap)
            self._slot = np.arange(live, dtype=np.int64)
            self._free = np.arange(live, new_cap, dtype=np.int64)

    def _moved(self, a: np.ndarray, cap: int) -> np.ndarray:
        """``a``'s resident slots, in order, at the start of a new array of ``cap`` rows."""
        out = np.empty((cap,) + a.shape[1:], dtype=a.dtype)
        out[: self._slot.size] = a[self._slot]
        return out

    def locate(self, rows: np.ndarray) -> np.ndarray:
        """Where the resident ``rows`` sit in :attr:`XC`."""
        out = np.empty(rows.size, dtype=np.int64)
        bad = _find(self.ids, self._slot, np.ascontiguousarray(rows, dtype=np.int64), out)
        if bad >= 0:
            raise RuntimeError(f"out-of-core shard: row {int(rows[bad])} asked for is not resident")
        return out

    def _read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any]:
        """The sorted distinct ``rows`` read from the row file and prepared:
        ``(rows, XC, y, xi)``."""
        self.rows_read += rows.size
        X, y = self.file.read(rows)
        XC, xi = self._prepared(X, y)
        return rows, XC, y, xi

    def _take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any]:
        """The sorted distinct ``rows`` and maybe more, prepared, sorted by row: those read
        ahead (if any), with what they lack of ``rows`` read now; ``(rows, XC, y, xi)``."""
        ahead = self._ahead
        if ahead is None:
            return self._read(rows)
        missing = rows[~in_sorted(rows, ahead[0])]
        if not missing.size:
            return ahead
        # proposed at another q or step than read ahead (rare): merged in
        more = self._read(missing)
        order = np.argsort(np.concatenate([ahead[0], missing]), kind="stable")
        return tuple(
            None if a is None else np.concatenate([a, b])[order]
            for a, b in zip(ahead, more, strict=True)
        )

    def fetch(self, rows: np.ndarray) -> np.ndarray:
        """Make ``rows`` resident: from the rows read ahead where it has them, else read
        now; prepared (tight points, row constants) under the current rule. Returns the
        rows that were not resident, sorted."""
        rows = np.unique(rows)
        missing = rows[~in_sorted(rows, self.ids)]
        if missing.size:
            got, XC, y, xi = self._take(missing)
            self._ahead, self._ahead_for = None, {}  # taken in: not held twice
            use = in_sorted(got, missing)
            self._insert(got[use], XC[use], y[use], None if xi is None else xi[use])
        return missing

    def proposals(self, key: Any, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The buffer a z-update evaluates its proposed ``rows`` (every chain's, with
        repeats) from, and where each of them sits there: the rows read ahead, when they
        were read for these proposals (``key``: :meth:`read_ahead`'s); else those rows
        with any of ``rows`` they lack, read now. Nothing is made resident:
        :meth:`admit` takes in, from this buffer, the rows that turned bright (a few)."""
        pos = self._ahead_for.pop(key, None)
        if pos is not None and self._ahead is not None:
            self._proposed = self._ahead
            return self._proposed[1], pos
        self._proposed = self._take(np.unique(rows))
        return self._proposed[1], np.searchsorted(self._proposed[0], rows)

    def read_ahead(self, wanted: list[tuple[Any, np.ndarray]], later: np.ndarray) -> None:
        """Between rounds: have the proposals of the next z-updates (``wanted``: each
        one's key and rows — every chain's, with repeats — in order) read and prepared,
        and ask for ``later`` (the one after's) to be brought into the page cache in the
        background.

        Each z-update's rows are read once, by the first call that wants them (in a run,
        the one ``len(wanted)`` - 1 z-updates before: a call reads one z-update's rows);
        once the next z-update's are not prepared, every wanted z-update's are prepared
        together, into one buffer (a call in ``len(wanted)`` prepares: the prepare's
        cost is mostly per call, the reads' per row). The next round then need not read
        or prepare, and this call's next calls need not wait for the disk."""
        later, _ = distinct(later)
        if later.size:
            self.file.advise(later)
        staged = {}
        for key, rows in wanted:
            got = self._staged.get(key)
            if got is None:
                d, pos = distinct(rows)
                self.rows_read += d.size
                got = (d, pos, *self.file.read(d))
            staged[key] = got
        self._staged = staged  # proposals no longer wanted are forgotten
        if wanted and wanted[0][0] not in self._ahead_for:
            self._ahead, self._ahead_for = None, {}  # spent: not held beside the next
            self._prepare_ahead([key for key, _ in wanted])

    def _prepare_ahead(self, keys: list[Any]) -> None:
        """The staged proposals of ``keys`` prepared into one buffer, :attr:`_ahead` (each
        row once), with where each proposal sits there."""
        parts = [self._staged[key] for key in keys]
        d, pos = distinct(np.concatenate([p[0] for p in parts]))
        src = np.empty(d.size, dtype=np.int64)  # a row of the staged reads for each of d
        src[pos] = np.arange(pos.size)
        X = np.concatenate([p[2] for p in parts])[src]
        y = np.concatenate([p[3] for p in parts])[src]
        XC, xi = self._prepared(X, y)
        self._ahead = (d, XC, y, xi)
        self._ahead_for = {}
        off = 0
        for key, (rows, at, _, _) in zip(keys, parts, strict=True):
            self._ahead_for[key] = pos[off + at]
            off += rows.size

    def admit(self, rows: np.ndarray, at: np.ndarray) -> None:
        """Make resident the ``rows`` (any order, repeats allowed) that turned bright in
        the z-update of the last :meth:`proposals`, from where they sit in its buffer
        (``at``); rows resident already stay as they are."""
        proposed = self._proposed
        if proposed is None:
            raise RuntimeError("out-of-core shard: rows admitted with no proposals read")
        m = rows.size
        if m == 0:
            return
        _, XC, y, xi = proposed
        self._room(m, xi)
        n = self.ids.size
        new_ids = np.empty(n + m, dtype=np.int64)
        new_slot = np.empty(n + m, dtype=np.int64)
        k = _admit(
            self.ids, self._slot, self._free, rows, at, XC, y, _as_2d(xi),
            self.XC, self.y, _as_2d(None if xi is None else self.xi), new_ids, new_slot,
        )  # fmt: skip
        self.ids, self._slot, self._free = new_ids[: n + k], new_slot[: n + k], self._free[k:]

    def lacks(self, bright: list[np.ndarray]) -> bool:
        """Whether some chain has bright (``bright``: each chain's bright rows, sorted) a
        row that is not resident: never, unless the resident rows lost track of one
        (:meth:`~flymc_dist.shard.state.Shard._reread_lost` then reads it back). One
        merge per chain (measured: 7 µs for 4 chains of 120 bright rows)."""
        return any(_not_in(self.ids, b) for b in bright)

    def keep(self, bright: list[np.ndarray]) -> None:
        """Keep resident only the rows some chain has bright (``bright``: each chain's
        bright rows, sorted)."""
        self._proposed = None
        if not self.ids.size:
            return
        bounds = [0]
        for b in bright:
            bounds.append(bounds[-1] + b.size)
        seg = np.array(bounds, dtype=np.int64)
        members = np.concatenate(bright) if bright else np.empty(0, np.int64)
        keep = np.empty(self.ids.size, dtype=bool)
        _bright_in_any(self.ids, members, seg, keep)
        self._keep(keep)

    def sweep(self, unit: int | None = None) -> Iterator[tuple[int, int]]:
        """Every row resident in turn: the row file's blocks (of a multiple of ``unit``
        rows, if given), each read (one ahead) into the arena before it is yielded; the
        caller keeps what it needs with :meth:`keep` after each."""
        for lo, hi, _, XC, y, xi in self.sweep_read(unit):
            rows = np.arange(lo, hi, dtype=np.int64)
            new = ~in_sorted(rows, self.ids)
            self._insert(rows[new], XC[new], y[new], None if xi is None else xi[new])
            yield lo, hi

    def sweep_read(
        self, unit: int | None = None
    ) -> Iterator[tuple[int, int, np.ndarray, np.ndarray, np.ndarray, Any]]:
        """Every row once, as :meth:`sweep`'s blocks, *not* made resident: ``(lo, hi, X,
        XC, y, xi)``, the block as read (float64 features) and prepared. The caller makes
        resident what it keeps (:meth:`take_in`): a set-up's exact draw of z keeps a few
        rows of each block, and taking the whole block in first would hold it twice more
        (the arena grown to a block, and the copy it is given; measured ~60 MB a block of
        2·10⁵ rows × 10 features)."""
        self._ahead = self._proposed = None
        self._ahead_for, self._staged = {}, {}
        self.passes += 1
        block = max(1, BLOCK_BYTES // ((self.n_features + self._K + 2) * 8))
        if unit:
            block = max(unit, block // unit * unit)
        for lo, hi, X, y in self.file.blocks(block):
            XC, xi = self._prepared(X, y)
            yield lo, hi, X, XC, y, xi
            del X, XC, y, xi  # not held beside the next block

    def take_in(self, rows: np.ndarray, lo: int, XC: np.ndarray, y: np.ndarray, xi: Any) -> None:
        """Make the sorted distinct ``rows`` of a :meth:`sweep_read` block starting at row
        ``lo`` resident (those resident already stay as they are)."""
        rows = rows[~in_sorted(rows, self.ids)]
        self._room(0, xi)  # the tight points' arena, even when no row is taken in
        at = rows - lo
        self._insert(rows, XC[at], y[at], None if xi is None else xi[at])

    def span(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, Any]:
        """The resident rows ``lo:hi`` as ``(X, y, xi)`` (during a :meth:`sweep`)."""
        return self.gather(np.arange(lo, hi, dtype=np.int64))

    # ---------------------------------------------------------------- the rest
    def retune(self) -> None:
        """New tight points and row constants for the resident rows (rows read from now
        on are prepared under the new rule)."""
        self._proposed = self._ahead = None  # prepared under the old rule
        self._ahead_for = {}
        if self.ids.size:
            X = self.XC[self._slot, : self.n_features]
            xi, consts = self._prepare(X, self.y[self._slot])
            if xi is not None:
                if self.xi is None:
                    self.xi = np.empty((self.XC.shape[0],) + np.shape(xi)[1:])
                self.xi[self._slot] = xi
            if self._K and consts is not None:
                self.XC[self._slot, self.n_features :] = consts

    def blocks(
        self, block: int | None, head: int | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray, Any]]:
        """Every row as read-only ``(X, y, xi)`` blocks of ``block`` rows (None: the row
        file's), read from the row file one ahead; with ``head``, only the first ``head``
        rows of each block are read (a subsample, not a pass)."""
        self.passes += head is None
        for _, _, X, y in self.file.blocks(block or self.file.block_rows, head):
            xi, _ = self._prepare(X, y)
            yield read_only(X), read_only(y), None if xi is None else read_only(xi)

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Features, target and tight point of the resident ``rows``."""
        pos = self.locate(rows)
        return self.XC[pos, : self.n_features], self.y[pos], self.xi[pos]

    def rows_at(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Any distinct ``rows``, in their order: read from the row file, with their tight
        points."""
        return self.rows_and_constants(rows, np.dtype(np.float64))[:3]

    def rows_and_constants(
        self, rows: np.ndarray, dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """:meth:`rows_at` with the features then as ``dtype``, and the rows' constants
        ``(n, K)`` (K = 0: none), prepared as the z-update's rows are (:meth:`_prepared`)."""
        order = np.argsort(rows, kind="stable")
        self.rows_read += rows.size
        wanted = rows[order]
        # every row asked of the disk at once, then read: scattered rows not in the page
        # cache come in parallel, not one wait after another (34,000 rows of a 2.4 GB
        # file, none cached: 1.3 s read as they come, 0.4 s so; all cached: +10 %)
        self.file.advise(wanted)
        X_s, y_s = self.file.read(wanted)
        X = np.empty_like(X_s)
        y = np.empty_like(y_s)
        X[order], y[order] = X_s, y_s
        xi, consts = self._prepare(X, y)
        consts = np.empty((rows.size, 0)) if consts is None else consts
        return X.astype(dtype, copy=False), y, xi, consts

    def reset(self) -> None:
        """Chains placed anew: nothing stays resident."""
        self._proposed = self._ahead = None
        self._ahead_for, self._staged = {}, {}
        self._keep(np.zeros(self.ids.size, dtype=bool))

    def close(self) -> None:
        """Remove the row file."""
        self._ahead = self._proposed = None
        self._ahead_for, self._staged = {}, {}
        self.file.close()

    def state(self) -> dict[str, Any]:
        """What the shard reports of its storage."""
        return {
            "held_rows": int(self.ids.size),
            "rows_read": self.rows_read,
            "bytes_read": self.file.bytes_read,
            "passes": self.passes,
        }
