"""An out-of-core shard's rows in a file of its worker's local directory, read by position.

At set-up an out-of-core shard streams its rows from the store once (a local
directory, or object storage: the only read of the store) into a file beside the
worker (:meth:`RowFile.create`): one fixed-size record per row, its features in the
store's dtype then its target. From then on it reads any rows by position
(:meth:`RowFile.read`) with ``pread`` from a compiled loop, asks the kernel to bring
rows it will read soon into the page cache (:meth:`RowFile.advise`), and streams whole
blocks for full passes (:meth:`RowFile.blocks`, one block read ahead on a thread).
Reads go through the page cache, which the kernel reclaims under pressure and which is
not the worker's memory (Dask's memory monitor counts a process's resident set; a
memory-mapped file's pages would count).

Knows nothing of models, chains or Dask, but for the local directory it asks the
worker for (:func:`local_directory`).
"""

from __future__ import annotations

import itertools
import os
import queue
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numba
import numpy as np
from distributed import get_worker
from numba import types

from flymc_dist.data import Dataset

#: libc's ``pread(fd, buffer, count, offset)``, linked by name (so the compiled loop below
#: is cached on disk: a ctypes function pointer would be a dynamic global, compiled anew in
#: every process); the buffer is passed as its address, an integer of a pointer's width
_pread = types.ExternalFunction(
    "pread", types.intp(types.intc, types.intp, types.uintp, types.int64)
)

#: libc's ``posix_fadvise(fd, offset, len, advice)``, linked by name as :data:`_pread` is
_fadvise = types.ExternalFunction(
    "posix_fadvise", types.intc(types.intc, types.int64, types.int64, types.intc)
)

#: ``POSIX_FADV_WILLNEED`` (Linux): start reading these bytes into the page cache, now
_WILLNEED = 3

#: rows of each block a full pass reads at once (at most: the shard's blocks may be fewer)
BLOCK_BYTES = 16 * 1024 * 1024


@numba.njit(cache=True, nogil=True)
def _run_end(rows: np.ndarray, i: int) -> int:
    """Where the run of consecutive rows that starts at ``rows[i]`` ends (exclusive)."""
    k = i + 1
    while k < rows.size and rows[k] == rows[k - 1] + 1:
        k += 1
    return k


@numba.njit(cache=True, nogil=True)
def _pread_rows(fd: int, rows: np.ndarray, record: int, out: np.ndarray) -> int:
    """Read the records of the sorted ``rows`` into ``out`` (a C-contiguous array of
    ``rows.size`` records), one ``pread`` per run of consecutive rows. Returns the number
    of rows read in full (``rows.size`` unless a read came up short)."""
    base = out.ctypes.data
    n = rows.size
    i = 0
    while i < n:
        k = _run_end(rows, i)
        want = (k - i) * record
        done = 0
        while done < want:  # pread may return less than asked (signals, large reads)
            got = _pread(fd, base + i * record + done, want - done, rows[i] * record + done)
            if got <= 0:
                return i
            done += got
        i = k
    return n


@numba.njit(cache=True, nogil=True)
def _advise_rows(fd: int, rows: np.ndarray, record: int) -> None:
    """Ask the kernel to read the records of the sorted ``rows`` into the page cache, in
    the background (``POSIX_FADV_WILLNEED``): one call per run of consecutive rows, none
    of which waits for the disk."""
    i = 0
    while i < rows.size:
        k = _run_end(rows, i)
        _fadvise(fd, rows[i] * record, (k - i) * record, _WILLNEED)
        i = k


def local_directory() -> str:
    """Where this process keeps its row files: the Dask worker's local directory, or the
    system's temporary directory outside a worker."""
    try:
        worker: Any = get_worker()
    except ValueError:  # not on a worker
        return tempfile.gettempdir()
    return str(worker.local_directory)


def worker_memory_limit() -> int | None:
    """The memory limit of the Dask worker this runs on (bytes), or None (no worker, or
    no limit)."""
    try:
        worker: Any = get_worker()
    except ValueError:  # not on a worker
        return None
    limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
    return int(limit) if limit else None


class RowFile:
    """A shard's rows ``start:stop`` of a store, in a local file of fixed-size records.

    Made by :meth:`create`; removed by :meth:`close` (also when it is garbage collected,
    or its process exits normally).

    Attributes
    ----------
    n, n_features
        Rows and features.
    record
        Bytes per row: ``n_features`` values of the store's dtype, then the target.
    bytes_read
        Bytes read from the file so far, by position and by block.
    """

    def __init__(self, path: str, n: int, n_features: int, x_dtype: Any, y_dtype: Any) -> None:
        self.path = path
        self.n, self.n_features = int(n), int(n_features)
        self._rec = np.dtype([("X", np.dtype(x_dtype), (self.n_features,)), ("y", y_dtype)])
        self.record = int(self._rec.itemsize)
        self._fd = os.open(path, os.O_RDONLY)
        self._pool: _Reader | None = None
        self.bytes_read = 0
        self._finalizer = weakref.finalize(self, _remove, self._fd, path)

    @classmethod
    def create(
        cls,
        dataset: Dataset,
        start: int,
        stop: int,
        directory: str,
        each: Callable[[int, np.ndarray], None] | None = None,
    ) -> RowFile:
        """Stream rows ``start:stop`` of ``dataset`` into a new file in ``directory``;
        ``each(lo, X)`` sees every store chunk on the way (its first row, float64 features).

        Raises
        ------
        OSError
            ``directory`` has not room for the file (checked before anything is written),
            or a write failed (the partial file is removed).
        """
        n, D = int(stop - start), int(dataset.n_features)
        chunks = dataset.iter_chunks(start, stop)
        first = next(chunks)  # its target's dtype sizes the records
        rec = np.dtype([("X", dataset.dtype, (D,)), ("y", first[3].dtype)])
        need = n * rec.itemsize
        os.makedirs(directory, exist_ok=True)
        free = shutil.disk_usage(directory).free
        if need > free - 256 * 1024 * 1024:  # leave the disk some room
            raise OSError(
                f"out of core: this shard's rows need {need / 1e9:.2f} GB of local disk in "
                f"{directory!r}, which has {free / 1e9:.2f} GB free; give the workers a "
                "local directory with more room (dask worker --local-directory), more "
                "memory, or more workers"
            )
        fd, path = tempfile.mkstemp(prefix="flymc-rows-", suffix=".bin", dir=directory)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                for lo, _, X, y in itertools.chain([first], chunks):
                    if each is not None:
                        each(lo, X)
                    block = np.empty(y.size, dtype=rec)
                    block["X"] = X
                    block["y"] = y
                    f.write(memoryview(block).cast("B"))
            return cls(path, n, D, dataset.dtype, rec["y"])
        except BaseException:
            os.unlink(path)
            raise

    @property
    def block_rows(self) -> int:
        """Rows per block of a full pass (:data:`BLOCK_BYTES` of records)."""
        return max(1, BLOCK_BYTES // self.record)

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sorted, distinct shard-local ``rows`` as float64 features and targets.

        Safe to call from a thread: the read itself holds no lock of Python's.
        """
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        buf = np.empty(rows.size, dtype=self._rec)
        if rows.size and (rows[0] < 0 or rows[-1] >= self.n):
            raise IndexError(f"rows outside the shard's {self.n}")
        got = _pread_rows(self._fd, rows, self.record, buf)
        if got != rows.size:
            raise OSError(f"{self.path}: short read at row {int(rows[got])}")
        self.bytes_read += rows.size * self.record
        return np.ascontiguousarray(buf["X"], dtype=np.float64), buf["y"].copy()

    def advise(self, rows: np.ndarray) -> None:
        """Start bringing the sorted, distinct ``rows`` into the page cache without waiting
        for them (a later :meth:`read` of them then need not wait for the disk)."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.size and (rows[0] < 0 or rows[-1] >= self.n):
            raise IndexError(f"rows outside the shard's {self.n}")
        _advise_rows(self._fd, rows, self.record)

    def read_range(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``lo:hi`` (one ``pread``)."""
        return self.read(np.arange(lo, hi, dtype=np.int64))

    def submit(self, fn: Any, *args: Any) -> _Job:
        """Run ``fn(*args)`` on this file's reading thread; ``.result()`` waits for it."""
        if self._pool is None:
            self._pool = _Reader()
        return self._pool.submit(fn, *args)

    def blocks(
        self, block: int, head: int | None = None
    ) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """Every row, as ``(lo, hi, X, y)`` blocks of ``block`` rows (with ``head``, the
        first ``head`` rows of each), each next one read while the caller works on the
        last."""
        edges = list(range(0, self.n, max(block, 1))) + [self.n]
        take = max(block, 1) if head is None else max(int(head), 1)
        spans = [(a, min(b, a + take)) for a, b in zip(edges[:-1], edges[1:], strict=True)]
        ahead = self.submit(self.read_range, *spans[0]) if spans else None
        for k, (lo, hi) in enumerate(spans):
            X, y = ahead.result()
            if k + 1 < len(spans):
                ahead = self.submit(self.read_range, *spans[k + 1])
            yield lo, hi, X, y

    def close(self) -> None:
        """Stop the reading thread and remove the file."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._finalizer()


class _Job:
    """One call run on a :class:`_Reader`: its result, or its error, once it is done."""

    __slots__ = ("fn", "args", "done", "value", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def result(self) -> Any:
        """Wait for the call, and return its value (or raise its error)."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class _Reader:
    """One thread running calls in order (a full pass's next block): a few microseconds a
    hand-off, where a ``ThreadPoolExecutor`` takes about a hundred."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="flymc-row-read", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Job:
        job = _Job(fn, args)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.value = job.fn(*job.args)
            except BaseException as e:  # handed to the caller of result()
                job.error = e
            finally:
                job.done.set()

    def close(self) -> None:
        """Finish the calls queued, and stop."""
        self._jobs.put(None)
        self._thread.join()


def _remove(fd: int, path: str) -> None:
    """Close ``fd`` and remove ``path`` (once; missing is fine)."""
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
