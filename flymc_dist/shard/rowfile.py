"""An out-of-core shard's rows in a file of its worker's local directory, read by position.

At set-up an out-of-core shard streams its rows from the store once (a local
directory, or object storage: the only read of the store) into a file beside the
worker (:meth:`RowFile.create`): one fixed-size record per row, its features in the
store's dtype, its target, and a 32-bit checksum of the record and its row number (every
write checked, a short one continued). From then on it reads any rows by position
(:meth:`RowFile.read`) with ``pread`` from a compiled loop, asks the kernel to bring
rows it will read soon into the page cache (:meth:`RowFile.advise`), and streams whole
blocks for full passes (:meth:`RowFile.blocks`, one block read ahead on a thread).
Every record read is checked against its checksum (:func:`check_records`): a file changed
in place after it was written (another shard's bytes, a shift) is an :class:`OSError`
naming the file and the row, never silently read. Reads go through the page cache,
which the kernel reclaims under pressure and which is not the worker's memory (Dask's
memory monitor counts a process's resident set; a memory-mapped file's pages would
count).

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

import dask
import numba
import numpy as np
from distributed import get_worker
from numba import types

from flymc_dist._compiled import JIT
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

#: bytes of the local disk a row file always leaves free: the worker spills data, writes
#: logs and holds other shards' row files in the same directory, and a disk filled to the
#: last byte fails all of them (a row file that does not fit with this left free is
#: refused before anything is written)
DISK_RESERVE = 256 * 1024 * 1024

#: rows of each block a full pass reads at once (at most: the shard's blocks may be fewer)
BLOCK_BYTES = 16 * 1024 * 1024


#: a record's checksum: its row number and its 32-bit words before the checksum, mixed
_SEED = np.uint64(0x9E3779B97F4A7C15)
_ROW = np.uint64(0xC2B2AE3D27D4EB4F)
_MUL = np.uint64(0xFF51AFD7ED558CCD)


@numba.njit(**JIT)
def _checksums(words: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """Each record's checksum into ``out``: ``words`` is ``(n, W)`` uint32, the records
    (their last word is the stored checksum, left out), ``rows`` their row numbers."""
    s29, s32 = np.uint64(29), np.uint64(32)
    m = words.shape[1] - 1  # the words checked
    for i in range(words.shape[0]):
        h = _SEED ^ (np.uint64(rows[i]) * _ROW)
        for j in range(0, m - 1, 2):  # two words at a time
            v = np.uint64(words[i, j]) | (np.uint64(words[i, j + 1]) << s32)
            h = (h ^ v) * _MUL
            h ^= h >> s29
        if m % 2:
            h = (h ^ np.uint64(words[i, m - 1])) * _MUL
        h = (h ^ (h >> s32)) * _ROW
        out[i] = np.uint32(h >> s32)


@numba.njit(**JIT)
def _first_bad(words: np.ndarray, rows: np.ndarray) -> int:
    """The index of the first record whose stored checksum is not its own, or -1."""
    sums = np.empty(words.shape[0], dtype=np.uint32)
    _checksums(words, rows, sums)
    last = words.shape[1] - 1
    for i in range(words.shape[0]):
        if sums[i] != words[i, last]:
            return i
    return -1


def record_dtype(x_dtype: Any, y_dtype: Any, n_features: int) -> np.dtype:
    """A row file's record: the features, the target, padding to 4 bytes, the checksum."""
    fields = [("X", np.dtype(x_dtype), (int(n_features),)), ("y", np.dtype(y_dtype))]
    pad = -sum(np.dtype(f[1]).itemsize * (f[2][0] if len(f) > 2 else 1) for f in fields) % 4
    if pad:
        fields.append(("pad", np.uint8, (pad,)))
    return np.dtype(fields + [("check", "<u4")])


def check_records(buf: np.ndarray, rows: np.ndarray, path: str) -> None:
    """Refuse (:class:`OSError` naming ``path`` and the row) records of ``buf`` (read from
    ``rows``) whose checksum is not theirs."""
    if not buf.size:
        return
    words = buf.view(np.uint32).reshape(buf.size, -1)
    bad = _first_bad(words, rows)
    if bad >= 0:
        raise OSError(
            f"{path}: row {int(rows[bad])} (its record at byte {int(rows[bad]) * buf.itemsize}) "
            "fails its checksum: the row file was changed after it was written"
        )


def _write_all(fd: int, data: memoryview, path: str, at: int) -> None:
    """Write all of ``data`` (``at`` bytes written before), continuing short writes;
    :class:`OSError` naming ``path`` and the cause if a write fails or makes no progress."""
    done = 0
    while done < len(data):
        try:
            k = os.write(fd, data[done:])
        except OSError as e:
            raise OSError(
                e.errno,
                f"out of core: writing the row file {path!r} failed after "
                f"{at + done} bytes: {e.strerror}",
            ) from None
        if k <= 0:
            raise OSError(
                f"out of core: writing the row file {path!r} made no progress after "
                f"{at + done} bytes"
            )
        done += k


@numba.njit(**JIT)
def _run_end(rows: np.ndarray, i: int) -> int:
    """Where the run of consecutive rows that starts at ``rows[i]`` ends (exclusive)."""
    k = i + 1
    while k < rows.size and rows[k] == rows[k - 1] + 1:
        k += 1
    return k


@numba.njit(**JIT)
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


@numba.njit(**JIT)
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


def worker_memory() -> tuple[int, int] | None:
    """The memory limit of the Dask worker this runs on and the room left under it
    (bytes), or None (no worker, or no limit).

    The room is what the worker may still take before Dask pauses it (its
    ``distributed.worker.memory.pause`` fraction of the limit; 0.95, where Dask
    restarts it, when pausing is off) less the process's memory now: what is free for
    shards opened here, after the worker's own imports and what it holds already."""
    try:
        worker: Any = get_worker()
    except ValueError:  # not on a worker
        return None
    limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
    if not limit:
        return None
    pause = dask.config.get("distributed.worker.memory.pause") or 0.95
    used = worker.monitor.get_process_memory()
    return int(limit), max(int(float(pause) * int(limit)) - int(used), 0)


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
        self.rec_dtype = record_dtype(x_dtype, y_dtype, self.n_features)
        self.record = int(self.rec_dtype.itemsize)
        self._fd = os.open(path, os.O_RDONLY)
        self._pool: _Reader | None = None
        self.bytes_read = 0
        # the reading thread's queue, once it runs: the finalizer stops the thread too
        self._queues: list[queue.SimpleQueue] = []
        self._finalizer = weakref.finalize(self, _remove, self._fd, path, self._queues)

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
            or a write failed or made no progress (naming the file and the cause; the
            partial file is removed).
        """
        n, D = int(stop - start), int(dataset.n_features)
        chunks = dataset.iter_chunks(start, stop)
        first = next(chunks)  # its target's dtype sizes the records
        rec = record_dtype(dataset.dtype, first[3].dtype, D)
        need = n * rec.itemsize
        os.makedirs(directory, exist_ok=True)
        free = shutil.disk_usage(directory).free
        if need > free - DISK_RESERVE:
            raise OSError(
                f"out of core: this shard's rows need {need / 1e9:.2f} GB of local disk in "
                f"{directory!r}, which has {free / 1e9:.2f} GB free, of which "
                f"{DISK_RESERVE / 1e9:.2f} GB stay free for the worker (its spill, logs and "
                "other shards' files); give the workers a local directory with more room "
                "(dask worker --local-directory), more memory, or more workers"
            )
        fd, path = tempfile.mkstemp(prefix="flymc-rows-", suffix=".bin", dir=directory)
        try:
            at = 0
            for lo, _, X, y in itertools.chain([first], chunks):
                if each is not None:
                    each(lo, X)
                block = np.zeros(y.size, dtype=rec)
                block["X"] = X
                block["y"] = y
                words = block.view(np.uint32).reshape(y.size, -1)
                rows = np.arange(lo - start, lo - start + y.size, dtype=np.int64)
                _checksums(words, rows, block["check"])
                _write_all(fd, memoryview(block).cast("B"), path, at)
                at += block.nbytes
            os.close(fd)
            fd = -1
            return cls(path, n, D, dataset.dtype, rec["y"])
        except BaseException:
            if fd >= 0:
                os.close(fd)
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
        buf = np.empty(rows.size, dtype=self.rec_dtype)
        if rows.size and (rows[0] < 0 or rows[-1] >= self.n):
            raise IndexError(f"rows outside the shard's {self.n}")
        got = _pread_rows(self._fd, rows, self.record, buf)
        if got != rows.size:
            raise OSError(f"{self.path}: short read at row {int(rows[got])}")
        check_records(buf, rows, self.path)
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
            self._queues.append(self._pool.jobs)
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
        """Stop the reading thread and remove the file (also done, but for waiting for
        the thread, when the file is garbage collected: the thread holds no reference to
        it between calls)."""
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
    hand-off, where a ``ThreadPoolExecutor`` takes about a hundred.

    Between calls the thread holds nothing of them (a finished call's function and
    arguments are dropped): a row file whose owner is gone is not kept alive by its
    reading thread, and its finalizer stops the thread.
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_serve_jobs, args=(self.jobs,), name="flymc-row-read", daemon=True
        )
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Job:
        job = _Job(fn, args)
        self.jobs.put(job)
        return job

    def close(self) -> None:
        """Finish the calls queued, and stop."""
        self.jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()


def _serve_jobs(jobs: queue.SimpleQueue) -> None:
    """The reading thread: run the queued calls until a None."""
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job.value = job.fn(*job.args)
        except BaseException as e:  # handed to the caller of result()
            job.error = e
        finally:
            job.fn = job.args = None  # nothing of the call held between calls
            job.done.set()
            del job


def _remove(fd: int, path: str, queues: list[queue.SimpleQueue]) -> None:
    """Stop the reading threads of ``queues``, close ``fd`` and remove ``path`` (once;
    missing is fine)."""
    for q in queues:
        q.put(None)
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
