"""A shard's rows behind one interface: in memory (:class:`MemoryRows`) or in a local
row file, out of core (:class:`FileRows`).

:class:`~flymc_dist.shard.shard.Shard` reads its rows only through these methods, so the
z-updates, evaluations and full passes are written once:

- ``XC``, ``y``, ``xi``: the *resident* rows — features then the ``K`` row constants of the
  model's compiled ``log L~`` in one ``(·, D + K)`` buffer (evaluating a scattered row
  then touches one place in memory), targets and tight points: every row in memory;
  out of core the rows some chain has bright and those fetched for this z-update;
- ``locate(rows)``: where shard-local rows sit in those buffers (in memory: the rows);
- ``fetch(rows)``: make rows resident now (out of core; in memory every row is);
  ``read_ahead(rows, later)``: read and prepare the next z-update's proposals between
  rounds, and have the page cache fetch the one after's;
- ``after_z(bright)`` / ``keep()``: make resident what the chains' bright sets need / drop
  the rest (after the round's reply);
- ``sweep()``: every row resident in turn, for the exact draw of z at placement;
- ``retune()``: tight points and row constants of the resident rows under the current
  rule; ``blocks(block)``: every row as read-only ``(X, y, xi)`` blocks (a full pass);
- ``gather(rows)`` / ``rows_at(rows)``: resident rows / any rows;
- ``state()``, ``close()``.

``prepare(X, y) -> (xi, consts)`` gives the tight points of rows and their constants under
the shard's current rule (tuned at θ̂ or not, exact rows), row by row: a row's values do
not depend on the rows prepared with it, so out-of-core rows, prepared as they are read,
are the same bits as in memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from flymc_dist._numerics import in_sorted
from flymc_dist.shard.rowfile import BLOCK_BYTES, RowFile

Prepare = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray | None, np.ndarray | None]]


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
        #: full passes over the rows so far (the caller counts the load from a store)
        self.passes = 0

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

    def sweep(self, unit: int | None = None) -> Iterator[tuple[int, int]]:
        """Every row, resident: one range (a full pass)."""
        self.passes += 1
        yield 0, self.n

    def span(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, Any]:
        """Rows ``lo:hi`` as read-only ``(X, y, xi)``, as :meth:`blocks` gives them."""
        xi = None if self.xi is None else read_only(self.xi[lo:hi])
        return read_only(self.X[lo:hi]), read_only(self.y[lo:hi]), xi

    def fetch(self, rows: np.ndarray) -> None:
        """Nothing to read: every row is here."""

    def proposals(self, rows: np.ndarray) -> tuple[np.ndarray, None]:
        """The buffer a z-update evaluates its proposed ``rows`` from (:attr:`XC`), and
        the sorted rows it holds (None: all, at their own positions)."""
        return self.XC, None

    def read_ahead(self, rows: np.ndarray, later: np.ndarray) -> None:
        """Nothing to read ahead."""

    def after_z(self, bright: list[np.ndarray], keep: bool = True) -> None:
        """Nothing to hold: every row is here."""

    def keep(self) -> None:
        """Nothing to drop."""

    def reset(self) -> None:
        """Nothing to forget."""

    def close(self) -> None:
        """Nothing to release but memory."""

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
    (:meth:`read_ahead`) — and dropped after it unless they turned bright. Resident
    rows sit in an arena (``XC``, ``y``, ``xi``) at slots found through the sorted
    ``ids`` (:meth:`locate`), so fetching and dropping a few rows moves nothing else.

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
        self.y = np.empty(0, dtype=self.file._rec["y"])
        self.xi: np.ndarray | None = None
        #: the next z-update's proposals, read and prepared ahead (:meth:`read_ahead`):
        #: sorted rows, their buffer, targets and tight points
        self._ahead: tuple[np.ndarray, np.ndarray, np.ndarray, Any] | None = None
        #: the rows the chains' bright sets need, while :meth:`keep` has yet to drop the rest
        self._needed: np.ndarray | None = None
        #: the last :meth:`proposals`: rows, their buffer, targets and tight points
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

    def _insert(self, rows: np.ndarray, XC: np.ndarray, y: np.ndarray, xi: Any) -> None:
        """Make the sorted ``rows`` (none resident) resident, with their data."""
        m = rows.size
        if m == 0:
            return
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
        slots, self._free = self._free[:m], self._free[m:]
        self.XC[slots] = XC
        self.y[slots] = y
        if xi is not None:
            self.xi[slots] = xi
        pos = np.searchsorted(self.ids, rows)
        self.ids = np.insert(self.ids, pos, rows)
        self._slot = np.insert(self._slot, pos, slots)

    def _keep(self, needed: np.ndarray) -> None:
        """Keep resident exactly the resident rows among the sorted ``needed``; an arena
        mostly free (after a sweep) shrinks to twice what it holds."""
        keep = in_sorted(self.ids, needed)
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
        pos = np.searchsorted(self.ids, rows)
        ok = pos < self.ids.size
        ok[ok] = self.ids[pos[ok]] == rows[ok]
        if not ok.all():
            raise RuntimeError("out-of-core shard: rows asked for that are not resident")
        return self._slot[pos]

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
        ahead, self._ahead = self._ahead, None
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

    def fetch(self, rows: np.ndarray) -> None:
        """Make ``rows`` resident: from the rows read ahead where it has them, else read
        now; prepared (tight points, row constants) under the current rule."""
        rows = np.unique(rows)
        missing = rows[~in_sorted(rows, self.ids)]
        if missing.size:
            got, XC, y, xi = self._take(missing)
            use = in_sorted(got, missing)
            self._insert(got[use], XC[use], y[use], None if xi is None else xi[use])

    def proposals(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The buffer a z-update evaluates its proposed ``rows`` from, and the sorted rows
        it holds: the rows read ahead (the chains' proposals at this step), with any of
        ``rows`` they lack read now. Nothing is made resident: :meth:`after_z` takes in,
        from this buffer, the rows that turned bright (a few), so the proposals cost no
        bookkeeping of the resident rows."""
        self._proposed = self._take(np.unique(rows))
        return self._proposed[1], self._proposed[0]

    def read_ahead(self, rows: np.ndarray, later: np.ndarray) -> None:
        """Read and prepare ``rows`` (the next z-update's proposals) now, between rounds,
        and ask for ``later`` (the one after's) to be brought into the page cache in the
        background: the next round need not read, and the reads of this call's next
        call need not wait for the disk."""
        later = np.unique(later)
        if later.size:
            self.file.advise(later)
        self._ahead = self._read(np.unique(rows))

    def after_z(self, bright: list[np.ndarray], keep: bool = True) -> None:
        """Make resident the rows bright in some chain (``bright``: each chain's): those
        that turned bright come from the last :meth:`proposals`. With ``keep``, drop the
        others now; else :meth:`keep` does, later (after the round's reply)."""
        needed = np.unique(np.concatenate(bright)) if bright else np.empty(0, np.int64)
        proposed, self._proposed = self._proposed, None
        if proposed is not None:
            new = needed[~in_sorted(needed, self.ids)]
            if new.size:
                at = np.searchsorted(proposed[0], new)
                xi = proposed[3]
                self._insert(new, proposed[1][at], proposed[2][at], None if xi is None else xi[at])
        self._needed = needed
        if keep:
            self.keep()

    def keep(self) -> None:
        """Keep resident only the rows the last :meth:`after_z` found needed."""
        needed, self._needed = self._needed, None
        if needed is not None:
            self._keep(needed)

    def sweep(self, unit: int | None = None) -> Iterator[tuple[int, int]]:
        """Every row resident in turn: the row file's blocks (of a multiple of ``unit``
        rows, if given), each read (one ahead) into the arena before it is yielded; the
        caller keeps what it needs with :meth:`after_z` after each."""
        self._ahead = None
        self.passes += 1
        block = max(1, BLOCK_BYTES // ((self.n_features + self._K + 2) * 8))
        if unit:
            block = max(unit, block // unit * unit)
        for lo, hi, X, y in self.file.blocks(block):
            rows = np.arange(lo, hi, dtype=np.int64)
            XC, xi = self._prepared(X, y)
            new = ~in_sorted(rows, self.ids)
            self._insert(rows[new], XC[new], y[new], None if xi is None else xi[new])
            yield lo, hi

    def span(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, Any]:
        """The resident rows ``lo:hi`` as ``(X, y, xi)`` (during a :meth:`sweep`)."""
        return self.gather(np.arange(lo, hi, dtype=np.int64))

    # ---------------------------------------------------------------- the rest
    def retune(self) -> None:
        """New tight points and row constants for the resident rows (rows read from now
        on are prepared under the new rule)."""
        self._proposed = self._ahead = None  # prepared under the old rule
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
        order = np.argsort(rows, kind="stable")
        X_s, y_s = self.file.read(rows[order])
        X = np.empty_like(X_s)
        y = np.empty_like(y_s)
        X[order], y[order] = X_s, y_s
        xi, _ = self._prepare(X, y)
        return X, y, xi

    def reset(self) -> None:
        """Chains placed anew: nothing stays resident."""
        self._proposed = self._ahead = self._needed = None
        self._keep(np.empty(0, dtype=np.int64))

    def close(self) -> None:
        """Remove the row file."""
        self._ahead = None
        self.file.close()

    def state(self) -> dict[str, Any]:
        """What the shard reports of its storage."""
        return {
            "held_rows": int(self.ids.size),
            "rows_read": self.rows_read,
            "bytes_read": self.file.bytes_read,
            "passes": self.passes,
        }
