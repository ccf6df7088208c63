"""Validated, atomic writing of a data set (:func:`from_numpy`, :func:`from_blocks`).

Input is validated (finite values, shapes, labels of the task) before or as it is
written; the layout written is the one :mod:`flymc_dist.data.store` describes and reads.

Atomicity
---------
:func:`from_numpy` and :func:`ingest` validate all of their input before writing
anything (:func:`from_blocks` and the generators validate each block as it arrives).
Every writer then writes into a temporary sibling (``.<name>.flymc-tmp-<random>``) and
puts it into place only once it is complete. Any failure before that, including
``KeyboardInterrupt``, removes the temporary store and leaves an existing store
untouched. Locally the temporary directory is renamed into place; with
``overwrite=True`` the old store is moved aside and deleted only after the new one is in
place. On an object store (an fsspec URL, :func:`flymc_dist._paths.is_url`; ``file://``
is local) there is no rename: the complete new store is copied into place (server-side
where the store can), the old one first marked as being replaced (its ``"format"``
attribute renamed, so readers refuse it rather than read a mix) and the new root
``zarr.json`` copied last. An interruption during that copy keeps the complete new store
beside and names it. ``overwrite=True`` only ever replaces a flymc_dist data set: a
trace, another zarr store or foreign objects are refused, on disk and on object stores
alike.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import zarr

from flymc_dist._paths import is_url
from flymc_dist.data.store import (
    FORMAT,
    REPLACING,
    Dataset,
    check_dtype,
    default_chunk_rows,
    norm_path,
)

__all__ = [
    "TASKS",
    "check_block",
    "check_chunk_rows",
    "from_blocks",
    "from_numpy",
    "from_pieces",
    "resolve_task",
]

#: Rows per block for validation passes and multi-chunk writes of in-memory arrays.
_WORK_BLOCK_BYTES = 32 * 2**20

#: How the arrays of a data set are written: every chunk stored, even one that holds only
#: the fill value (which no valid chunk does: see :class:`_StoreWriter`).
_EVERY_CHUNK = {"write_empty_chunks": True}

#: How the chunks of a data set are compressed (X and y alike, by every writer): zstd's
#: fast level -1, which stores Huffman-free literals. Measured on 8 MiB chunks against
#: zarr's default (level 3): ~4x faster on full-precision floats (standardised or measured
#: columns: random mantissas, which no level compresses), 1.3-2x on integer-valued,
#: one-hot or float32-born columns, whose chunks it leaves 10-25% larger; decoding is
#: faster too. Writing was half of an ingest's CPU.
_COMPRESSION = {"name": "zstd", "configuration": {"level": -1, "checksum": False}}

#: the data tasks a store records
TASKS = ("binary", "multiclass", "count", "real")


# --------------------------------------------------------------------------- validation


def check_chunk_rows(
    chunk_rows: int | None, n_rows: int, n_features: int, itemsize: int = 8
) -> int:
    if chunk_rows is None:
        return default_chunk_rows(n_rows, n_features, itemsize)
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int | np.integer):
        raise ValueError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return int(min(int(chunk_rows), max(n_rows, 1)))


def _check_numeric(a: np.ndarray, name: str) -> None:
    if a.dtype == np.bool_:
        return
    if not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise ValueError(
            f"{name} must have a real numeric dtype (bool, integer or float), got {a.dtype}"
        )


def _row_blocks(n_rows: int, n_features: int) -> Iterator[tuple[int, int]]:
    step = max(1, _WORK_BLOCK_BYTES // (8 * max(n_features, 1)))
    for s in range(0, n_rows, step):
        yield s, min(s + step, n_rows)


def _first_nonfinite_X(X: np.ndarray, offset: int = 0) -> tuple[int, int] | None:
    """(row, column) of the first non-finite entry of ``X`` (row-major order) or None."""
    if not np.issubdtype(X.dtype, np.floating):
        return None
    for s, e in _row_blocks(X.shape[0], X.shape[1]):
        bad = ~np.isfinite(X[s:e])
        if bad.any():
            r, c = np.unravel_index(int(np.argmax(bad)), bad.shape)
            return offset + s + int(r), int(c)
    return None


def _check_X_finite(X: np.ndarray, offset: int = 0) -> None:
    bad = _first_nonfinite_X(X, offset)
    if bad is not None:
        r, c = bad
        raise ValueError(
            f"X contains a non-finite value (NaN or inf): first at row {r}, column {c} "
            f"(value {X[r - offset, c]!r})"
        )


def _first_overflow_X(X: np.ndarray, dtype: np.dtype, offset: int = 0) -> tuple[int, int] | None:
    """(row, column) of the first finite entry of ``X`` that becomes inf in ``dtype``."""
    if dtype == np.float64 or X.dtype == dtype or X.dtype.itemsize < dtype.itemsize:
        return None
    if np.issubdtype(X.dtype, np.integer) and X.dtype.itemsize <= 8:
        return None  # |int64| < 2**63 is far below float32's max (3.4e38)
    for s, e in _row_blocks(X.shape[0], X.shape[1]):
        with np.errstate(over="ignore"):
            bad = ~np.isfinite(X[s:e].astype(dtype))
        if bad.any():
            r, c = np.unravel_index(int(np.argmax(bad)), bad.shape)
            return offset + s + int(r), int(c)
    return None


def _check_X_fits(X: np.ndarray, dtype: np.dtype, offset: int = 0) -> None:
    """Raise if a (finite) value of ``X`` overflows the storage ``dtype``."""
    bad = _first_overflow_X(X, dtype, offset)
    if bad is not None:
        r, c = bad
        raise ValueError(
            f"X has a value too large for dtype {dtype.name} (max {np.finfo(dtype).max:.4g}): "
            f"first at row {r}, column {c} (value {X[r - offset, c]!r}); store it as float64 "
            "(dtype='float64') or rescale the column"
        )


def magnitude_limit(n_rows: int) -> float:
    """The largest ``|x|`` a data set of ``n_rows`` rows may hold: its fourth power summed
    over every row stays finite in float64 (the set-up sums ``x²`` and ``x⁴`` of every
    column; the bounds' statistics, ``x xᵀ``)."""
    return float((np.finfo(np.float64).max / max(int(n_rows), 1)) ** 0.25)


def _check_X_magnitude(X: np.ndarray, n_rows: int, offset: int = 0) -> None:
    """Raise if a (finite) value of ``X`` is beyond :func:`magnitude_limit` (the arithmetic
    of a run would overflow), naming the first one."""
    if not np.issubdtype(X.dtype, np.floating):
        return  # |int64| < 2**63, far below the limit at any row count
    limit = magnitude_limit(n_rows)
    if limit >= float(np.finfo(X.dtype).max):
        return  # float32, float16: no finite value is beyond it
    for s, e in _row_blocks(X.shape[0], X.shape[1]):
        bad = np.abs(X[s:e]) > limit
        if bad.any():
            r, c = (int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))
            raise ValueError(
                f"X has a value too large to compute with: first at row {offset + s + r}, "
                f"column {c} (value {float(X[s + r, c])!r}); a run sums x² and x⁴ of "
                f"every column over the {n_rows:,} rows, which overflow float64 beyond |x| = "
                f"{limit:.3g}: rescale (standardise) the column"
            )


def _plainly_valid_X(X: np.ndarray, dtype: np.dtype, n_rows: int) -> bool:
    """Whether the smallest and largest values of a float ``X`` show every value valid:
    finite (a NaN makes both NaN), within :func:`magnitude_limit` and, stored as a
    narrower ``dtype``, within its range. Two passes without allocating, against the
    three checks' several; False does not mean invalid, only that they must look."""
    if not np.issubdtype(X.dtype, np.floating) or X.size == 0:
        return False
    bound = magnitude_limit(n_rows)
    if X.dtype.itemsize > dtype.itemsize:
        bound = min(bound, float(np.finfo(dtype).max))
    # as Python floats: the bound may be beyond a narrow X's own range (float16, float32)
    return -bound <= float(X.min()) and float(X.max()) <= bound


def _check_X(X: np.ndarray, dtype: np.dtype, n_rows: int, offset: int = 0) -> None:
    """Raise naming the first value of ``X`` (rows from ``offset``) that is not finite,
    overflows the storage ``dtype`` or is beyond :func:`magnitude_limit`; an ``X`` whose
    smallest and largest values show it valid (:func:`_plainly_valid_X`) passes at once."""
    if _plainly_valid_X(X, dtype, n_rows):
        return
    _check_X_finite(X, offset)
    _check_X_fits(X, dtype, offset)
    _check_X_magnitude(X, n_rows, offset)


def _check_y_finite(y: np.ndarray, offset: int = 0) -> None:
    if not np.issubdtype(y.dtype, np.floating):
        return
    bad = ~np.isfinite(y)
    if bad.any():
        r = int(np.argmax(bad))
        raise ValueError(
            f"y contains a non-finite value (NaN or inf): first at row {offset + r} "
            f"(value {y[r]!r})"
        )


def _integer_valued(y: np.ndarray) -> bool:
    if y.dtype == np.bool_ or np.issubdtype(y.dtype, np.integer):
        return True
    return bool(np.all(y == np.round(y)))


def _infer_task(y: np.ndarray) -> tuple[str, int | None]:
    """Task and class count inferred from finite labels ``y`` (see :func:`from_numpy`)."""
    if _integer_valued(y):
        lo, hi = (int(y.min()), int(y.max())) if y.size else (0, 0)
        if lo >= 0 and hi <= 1:
            return "binary", 2
        if lo >= 0:
            return "multiclass", hi + 1
    return "real", None


def resolve_task(
    task: str | None, n_classes: int | None, y_sample: np.ndarray | None
) -> tuple[str, int | None]:
    """Check ``task`` / ``n_classes``; infer from ``y_sample`` (all of y) if task is None."""
    if task is None:
        if y_sample is None:
            raise ValueError("task must be given explicitly here (it cannot be inferred)")
        task, inferred_k = _infer_task(y_sample)
        if n_classes is None:
            n_classes = inferred_k
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS} or None, got {task!r}")
    if n_classes is not None:
        if isinstance(n_classes, bool) or not isinstance(n_classes, int | np.integer):
            raise ValueError(f"n_classes must be an integer or None, got {n_classes!r}")
        n_classes = int(n_classes)
    if task in ("real", "count"):
        if n_classes is not None:
            raise ValueError(f"n_classes must be None for task {task!r}, got {n_classes}")
    elif task == "binary":
        if n_classes is not None and n_classes != 2:
            raise ValueError(f"n_classes must be 2 (or None) for task 'binary', got {n_classes}")
        n_classes = 2
    else:  # multiclass
        if n_classes is None:
            if y_sample is None:
                raise ValueError("n_classes must be given for task 'multiclass' here")
            n_classes = int(y_sample.max()) + 1 if y_sample.size else 0
        if n_classes < 2:
            raise ValueError(f"task 'multiclass' needs n_classes >= 2, got {n_classes}")
    return task, n_classes


def _check_labels(y: np.ndarray, task: str, n_classes: int | None, offset: int = 0) -> None:
    """Validate a block of (finite) labels against ``task``."""
    if task == "real" or y.size == 0:
        return
    if not _integer_valued(y):
        r = int(np.argmax(y != np.round(y)))
        raise ValueError(
            f"y must be integer-valued for task {task!r}: row {offset + r} has y = {y[r].item()!r}"
        )
    k = 2 if task == "binary" else None if task == "count" else int(n_classes)  # type: ignore[arg-type]
    bad = (y < 0) if k is None else (y < 0) | (y > k - 1)
    if bad.any():
        r = int(np.argmax(bad))
        allowed = "{0, 1}" if task == "binary" else "0, 1, 2, …" if k is None else f"0..{k - 1}"
        raise ValueError(
            f"labels must be in {allowed} for task {task!r}: row {offset + r} has "
            f"y = {y[r].item()!r}"
        )


def _check_feature_names(feature_names: Sequence[str] | None, n_features: int) -> list[str] | None:
    if feature_names is None:
        return None
    if isinstance(feature_names, str):
        raise ValueError("feature_names must be a sequence of strings, not a single string")
    names = [str(n) for n in feature_names]
    if len(names) != n_features:
        raise ValueError(f"feature_names has {len(names)} entries but X has {n_features} columns")
    return names


def _json_safe(value: Any) -> Any:
    """Convert numpy scalars/arrays (nested) to JSON-native Python objects."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _rmtree(path: str) -> None:
    """Remove a directory tree, retrying briefly (zarr's I/O thread may still be writing)."""
    for _ in range(20):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.05)


def _url_fs(path: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """The fsspec file system of URL ``path`` and the path within it (listings not cached)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    with contextlib.suppress(Exception):
        fs.invalidate_cache()
    return fs, root.rstrip("/")


def _url_kind(fs: Any, root: str) -> str:
    """What is at ``root`` on an object store: ``"missing"``, ``"dataset"`` (a flymc_dist
    data set, complete or being replaced), ``"zarr"`` (another zarr store: a trace, say)
    or ``"foreign"`` (objects that are not a zarr store)."""
    import json

    try:
        meta = json.loads(fs.cat_file(f"{root}/zarr.json"))
    except FileNotFoundError:
        return "foreign" if fs.exists(root) else "missing"
    except ValueError:
        return "foreign"
    attrs = meta.get("attributes") if isinstance(meta, dict) else None
    if isinstance(attrs, dict) and FORMAT in (attrs.get("format"), attrs.get(REPLACING)):
        return "dataset"
    return "zarr"


def _check_destination(
    path: str, overwrite: bool, storage_options: dict[str, Any] | None = None
) -> None:
    """Raise if ``path`` exists and may not (or must not) be replaced."""
    if is_url(path):
        kind = _url_kind(*_url_fs(path, storage_options))
        if kind == "missing":
            return
        if not overwrite:
            raise FileExistsError(f"{path!r} already exists (pass overwrite=True to replace it)")
        # the same refusals as on local disk: never delete what is not a flymc data set
        if kind == "foreign":
            raise FileExistsError(
                f"{path!r} exists and is not a zarr store (no zarr.json); refusing to overwrite it"
            )
        if kind == "zarr":
            raise FileExistsError(
                f"{path!r} is a zarr store but not a flymc_dist data set (a trace?); refusing "
                "to overwrite it"
            )
        return
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise FileExistsError(f"{path!r} already exists (pass overwrite=True to replace it)")
    # Refuse to delete something that is not a zarr store: overwrite=True on a typo'd path
    # must not wipe an unrelated directory or file.
    if not os.path.isdir(path) or os.path.islink(path):
        raise FileExistsError(
            f"{path!r} exists and is not a directory; refusing to overwrite it with a data set"
        )
    if os.listdir(path) and not os.path.exists(os.path.join(path, "zarr.json")):
        raise FileExistsError(
            f"{path!r} exists and is not a zarr store (no zarr.json); refusing to overwrite it"
        )
    # nor another kind of zarr store: a sampling trace, say, holds hours of work
    if os.listdir(path) and _store_format(path) != FORMAT:
        raise FileExistsError(
            f"{path!r} is a zarr store but not a flymc_dist data set (a trace?); refusing to "
            "overwrite it"
        )


def _store_format(path: str) -> Any:
    """The ``"format"`` attribute of the zarr group at local ``path`` (None if it has none)."""
    import json

    try:
        with open(os.path.join(path, "zarr.json")) as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return None
    attrs = meta.get("attributes") if isinstance(meta, dict) else None
    return attrs.get("format") if isinstance(attrs, dict) else None


# --------------------------------------------------------------------------- writing


def _write_block(array: Any, start: int, values: np.ndarray) -> None:
    """Write ``values`` into ``array[start:start + len(values)]`` (the single write hook)."""
    array[start : start + values.shape[0]] = values


class _StoreWriter:
    """Write a data set chunk by chunk into a temporary store; commit atomically.

    Use as a context manager; feed row blocks of any size with :meth:`write`. Rows are
    buffered into whole chunks so that every chunk is written exactly once, several chunks
    per zarr call (zarr compresses them concurrently). The zarr writes run on one
    background thread, so producing the next block overlaps compressing the last one;
    at most three buffers (~32 MiB each: filling, queued, being written) are alive. On a
    clean exit with exactly ``n_rows`` rows written the store is committed (see the module
    docstring); on any exception, including ``KeyboardInterrupt`` (or a row-count
    mismatch), the writer thread is stopped and joined and the temporary store is removed.
    """

    def __init__(
        self,
        path: str,
        n_rows: int,
        n_features: int,
        *,
        chunk_rows: int,
        task: str,
        n_classes: int | None,
        feature_names: list[str] | None,
        overwrite: bool,
        extra_attrs: dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        dtype: Any = "float64",
    ) -> None:
        self.path = path
        self.n_rows = int(n_rows)
        self.n_features = int(n_features)
        self.chunk_rows = int(chunk_rows)
        self.task = task
        self.n_classes = n_classes
        self.feature_names = feature_names
        self.overwrite = overwrite
        self.extra_attrs = dict(extra_attrs or {})
        self.storage_options = storage_options
        self.y_dtype = np.float64 if task == "real" else np.int64
        self.x_dtype = check_dtype(dtype)  # storage dtype of X (blocks arrive validated)
        self._written = 0  # rows handed to the writer thread
        per = max(
            1, _WORK_BLOCK_BYTES // (self.x_dtype.itemsize * self.n_features * self.chunk_rows)
        )
        self._buf_rows = min(per * self.chunk_rows, max(self.n_rows, 1))
        self._free: queue.Queue[tuple[np.ndarray, np.ndarray]] = queue.Queue()
        self._new_buffer()
        self._tmp: str | None = None
        self._queue: queue.Queue[tuple[int, np.ndarray, np.ndarray] | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()

    def _new_buffer(self) -> None:
        # Another buffer per flush (the previous one may still be being written): one the
        # writer thread has finished with, else a new one. Reusing them keeps the heap
        # from growing with the rows (freed and reallocated blocks fragment it).
        self._buf_X, self._buf_y = self._take_buffer()
        self._buf_n = 0

    def _take_buffer(self) -> tuple[np.ndarray, np.ndarray]:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return (
                np.empty((self._buf_rows, self.n_features), dtype=self.x_dtype),
                np.empty(self._buf_rows, dtype=self.y_dtype),
            )

    # -- context management
    def __enter__(self) -> _StoreWriter:
        _check_destination(self.path, self.overwrite, self.storage_options)
        if is_url(self.path):
            # written beside, then copied into place (object stores cannot rename)
            parent, _, name = self.path.rpartition("/")
            if not name or parent.endswith(":/"):
                raise ValueError(
                    f"{self.path!r} is the root of a bucket; write a data set under a prefix "
                    "(e.g. s3://bucket/name.zarr)"
                )
            target: Any = f"{parent}/.{name}.flymc-tmp-{uuid.uuid4().hex[:12]}"
        else:
            parent, name = os.path.split(self.path)
            os.makedirs(parent, exist_ok=True)
            target = os.path.join(parent, f".{name}.flymc-tmp-{uuid.uuid4().hex[:12]}")
        self._tmp = target
        mode = "w-"
        try:
            kw: dict[str, Any] = {}
            if self.storage_options and is_url(self.path):
                kw["storage_options"] = self.storage_options
            self._group = zarr.open_group(store=target, mode=mode, zarr_format=3, **kw)
            # Every chunk is stored, and the fill values are impossible data (NaN in X and
            # real y, -1 for labels): a chunk absent from the store is always a loss, never
            # a chunk zarr skipped for holding only the fill value (see Dataset).
            self._X = self._group.create_array(
                "X",
                shape=(self.n_rows, self.n_features),
                chunks=(self.chunk_rows, self.n_features),
                dtype=self.x_dtype.name,
                fill_value=np.nan,
                dimension_names=("row", "feature"),
                config=_EVERY_CHUNK,
                compressors=_COMPRESSION,
            )
            self._y = self._group.create_array(
                "y",
                shape=(self.n_rows,),
                chunks=(self.chunk_rows,),
                dtype=np.dtype(self.y_dtype).name,
                fill_value=np.nan if self.task == "real" else -1,
                dimension_names=("row",),
                config=_EVERY_CHUNK,
                compressors=_COMPRESSION,
            )
            self._thread = threading.Thread(
                target=self._worker, name="flymc-data-writer", daemon=True
            )
            self._thread.start()
        except BaseException:
            self._abort()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is not None:
            self._abort()
            return False
        try:
            self._flush()
            self._finish_thread()
            if self._written != self.n_rows:
                raise RuntimeError(
                    f"internal error: wrote {self._written} rows, expected {self.n_rows}"
                )
            attrs = {
                "n_rows": self.n_rows,
                "n_features": self.n_features,
                "chunk_rows": self.chunk_rows,
                "dtype": self.x_dtype.name,
                "task": self.task,
                "n_classes": self.n_classes,
                "feature_names": self.feature_names,
                # the identity of this data set (a resumed run checks it: see fingerprint)
                "store_id": uuid.uuid4().hex,
                **_json_safe(self.extra_attrs),
            }
            # "format" goes last: it marks the store as complete.
            self._group.attrs.update(attrs)
            self._group.attrs["format"] = FORMAT
            self._commit()
        except BaseException:
            self._abort()
            raise
        return False

    # -- the writer thread
    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None or self._stop.is_set():
                continue  # drain after a failure or an abort
            start, X, y = item
            try:
                _write_block(self._X, start, X)
                _write_block(self._y, start, y)
            except BaseException as e:  # re-raised in the calling thread
                self._error = e
            if X.shape[0] == self._buf_rows and X.base is None:
                self._free.put((X, y))  # a whole buffer: used again

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            self._stop.set()
            raise err

    def _finish_thread(self) -> None:
        """Wait for all queued writes; re-raise a writer error in this thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def _stop_thread(self) -> None:
        """Stop the writer thread without raising (abort path)."""
        self._stop.set()
        if self._thread is not None:
            with contextlib.suppress(queue.Empty):
                while True:
                    self._queue.get_nowait()
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    # -- writing
    def write(self, X: np.ndarray, y: np.ndarray) -> None:
        """Append a block of rows (already validated); any block size."""
        n = X.shape[0]
        if self._written + self._buf_n + n > self.n_rows:
            raise RuntimeError("internal error: more rows than declared")
        i = 0
        cap = self._buf_rows  # a whole number of chunks (or all rows)
        while i < n:
            if self._buf_n == 0 and n - i >= cap:
                # Direct path: a full buffer's worth of whole chunks, copied (the caller
                # may reuse its block while the writer thread still holds ours).
                bx, by = self._take_buffer()
                bx[:] = X[i : i + cap]
                by[:] = y[i : i + cap]
                self._emit(bx, by)
                i += cap
                continue
            take = min(cap - self._buf_n, n - i)
            self._buf_X[self._buf_n : self._buf_n + take] = X[i : i + take]
            self._buf_y[self._buf_n : self._buf_n + take] = y[i : i + take]
            self._buf_n += take
            i += take
            if self._buf_n == cap:
                self._flush()

    def _flush(self) -> None:
        if self._buf_n == self._buf_rows:
            self._emit(self._buf_X, self._buf_y)
            self._new_buffer()
        elif self._buf_n:
            self._emit(self._buf_X[: self._buf_n], self._buf_y[: self._buf_n])
            self._new_buffer()

    def _emit(self, X: np.ndarray, y: np.ndarray) -> None:
        self._raise_pending()
        Xb = np.ascontiguousarray(X, dtype=self.x_dtype)
        yb = np.ascontiguousarray(y, dtype=self.y_dtype)
        self._queue.put((self._written, Xb, yb))
        self._written += Xb.shape[0]

    # -- commit / abort
    def _commit(self) -> None:
        if self._tmp is None:
            return
        if is_url(self.path):
            self._commit_url()
            return
        if not os.path.lexists(self.path):
            os.rename(self._tmp, self.path)
            self._tmp = None
            return
        if not self.overwrite:
            raise FileExistsError(
                f"{self.path!r} appeared while writing (pass overwrite=True to replace it)"
            )
        _check_destination(self.path, self.overwrite)
        parent, name = os.path.split(self.path)
        old = os.path.join(parent, f".{name}.flymc-old-{uuid.uuid4().hex[:12]}")
        os.rename(self.path, old)
        try:
            os.rename(self._tmp, self.path)
        except BaseException:
            os.rename(old, self.path)
            raise
        self._tmp = None
        _rmtree(old)

    def _commit_url(self) -> None:
        """Copy the complete store at ``self._tmp`` into place on an object store.

        The old data set (if any) is first marked as being replaced, so that no reader
        takes it for complete while its objects are swapped; the new root ``zarr.json``
        (with ``"format"``) is copied last. If this is interrupted, the complete new store
        is kept where it was written and the error says where.
        """
        import json

        fs, root = _url_fs(self.path, self.storage_options)
        _, tmp = _url_fs(self._tmp, self.storage_options)  # type: ignore[arg-type]
        kind = _url_kind(fs, root)
        if kind != "missing" and not self.overwrite:
            raise FileExistsError(
                f"{self.path!r} appeared while writing (pass overwrite=True to replace it)"
            )
        _check_destination(self.path, self.overwrite, self.storage_options)
        try:
            if kind == "dataset":
                meta = json.loads(fs.cat_file(f"{root}/zarr.json"))
                attrs = meta.setdefault("attributes", {})
                attrs[REPLACING] = attrs.pop("format", FORMAT)
                fs.pipe_file(f"{root}/zarr.json", json.dumps(meta).encode())
                stale = [f for f in fs.find(root) if f != f"{root}/zarr.json"]
                if stale:
                    fs.rm(stale)
            sources = [f for f in fs.find(tmp) if f != f"{tmp}/zarr.json"]
            fs.copy(sources, [root + f[len(tmp) :] for f in sources])
            fs.copy(f"{tmp}/zarr.json", f"{root}/zarr.json")  # last: marks it complete
        except BaseException as err:
            keep, self._tmp = self._tmp, None  # the complete new store: never removed
            with contextlib.suppress(AttributeError, TypeError):
                err.add_note(
                    f"writing {self.path!r} was interrupted while copying it into place: "
                    f"{self.path!r} is incomplete (refused by readers); the complete new "
                    f"data set is at {keep!r} (copy it into place, or write it again "
                    "with overwrite=True)"
                )
            raise
        with contextlib.suppress(Exception):
            fs.rm(tmp, recursive=True)
        self._tmp = None

    def _abort(self) -> None:
        try:
            self._stop_thread()
        finally:
            if self._tmp is not None and is_url(self._tmp):
                with contextlib.suppress(Exception):  # best effort: the write failed already
                    fs, tmp = _url_fs(self._tmp, self.storage_options)
                    if fs.exists(tmp):
                        fs.rm(tmp, recursive=True)
                self._tmp = None
            elif self._tmp is not None:
                _rmtree(self._tmp)
                self._tmp = None


# --------------------------------------------------------------------------- public writers


def _as_array(a: Any, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype == object:
        raise ValueError(f"{name} must have a real numeric dtype, got dtype object")
    return arr


def from_numpy(
    X: Any,
    y: Any,
    path: str | os.PathLike[str],
    chunk_rows: int | None = None,
    overwrite: bool = False,
    *,
    task: str | None = None,
    n_classes: int | None = None,
    feature_names: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Validate ``(X, y)`` and write them as a flymc_dist zarr store.

    Parameters
    ----------
    X : array_like, shape (N, D)
        Features, real numeric (bool/int/float); stored as ``dtype``. Include a bias column
        yourself if the model needs one.
    y : array_like, shape (N,)
        Targets: {0, 1} for ``"binary"``, 0..K-1 for ``"multiclass"``, integers >= 0 for
        ``"count"``, real for ``"real"``.
    path : str or os.PathLike
        Local directory to create (``file://…`` too), or an fsspec URL (``s3://…``).
    chunk_rows : int, optional
        Rows per zarr chunk. Default: ~8 MiB of stored ``X`` per chunk (so twice the rows
        for float32), at most N. Values larger than N are clipped to N.
    overwrite : bool, default False
        Replace an existing store at ``path``. The old store is removed only after the new
        one is complete. A non-empty directory that is not a zarr store is never replaced.
    task : {"binary", "multiclass", "count", "real"}, optional
        If None it is inferred: integer-valued y with values in {0, 1} -> ``"binary"``;
        other integer-valued y with min >= 0 -> ``"multiclass"`` with
        ``n_classes = max(y) + 1`` (counts must say ``"count"``); anything else ->
        ``"real"``.
    n_classes : int, optional
        Number of classes (``"multiclass"``: default max(y) + 1, must be >= 2;
        ``"binary"``: 2; ``"real"``, ``"count"``: must be None).
    feature_names : sequence of str, optional
        One name per column of ``X``; default: the columns of ``X`` when it is a
        DataFrame, else none. They name the parameters in summaries, the CLI's tables
        and :meth:`~flymc_dist.Result.to_arviz`.
    storage_options : dict, optional
        Passed to fsspec for URL paths.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X`` (``y`` keeps its own: float64 or int64). float32 halves the
        bytes on disk and read; values are rounded to the nearest float32 once, when
        written. Reading (:meth:`Dataset.read`, ...) always returns float64 and all
        arithmetic stays in float64.

    Returns
    -------
    Dataset
        The written data set.

    Raises
    ------
    ValueError
        Wrong shapes, N = 0 or D = 0, non-numeric dtypes, NaN/inf in X (first bad row
        and column reported) or y (first bad row), a value of X whose fourth power summed
        over the rows overflows float64 (:func:`magnitude_limit`: 1.7e76 at 2,000 rows,
        3.7e75 at 10⁶; first bad row and column), with ``dtype="float32"`` a finite value
        of X too large for float32 (first bad row and column), labels out of range, bad
        ``task`` / ``n_classes`` / ``chunk_rows`` / ``feature_names`` / ``dtype``. Nothing
        is written.
    FileExistsError
        ``path`` exists and ``overwrite`` is False. Nothing is written.

    Notes
    -----
    Writing is atomic for local paths (temporary sibling + rename; see the module
    docstring); a failure, including ``KeyboardInterrupt``, leaves no partial store.
    """
    columns = getattr(X, "columns", None)  # a DataFrame's column names
    if feature_names is None and columns is not None:
        feature_names = [str(c) for c in columns]
    X = _as_array(X, "X")
    y = _as_array(y, "y")
    if X.ndim != 2:
        raise ValueError(f"X must be 2-D (N, D), got shape {X.shape}")
    if y.ndim != 1:
        raise ValueError(f"y must be 1-D (N,), got shape {y.shape}")
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but y has {y.shape[0]} entries")
    n, d = X.shape
    if n == 0:
        raise ValueError("the data set is empty (N = 0 rows)")
    if d == 0:
        raise ValueError("X has no columns (D = 0)")
    _check_numeric(X, "X")
    _check_numeric(y, "y")
    x_dtype = check_dtype(dtype)
    chunk_rows = check_chunk_rows(chunk_rows, n, d, x_dtype.itemsize)
    names = _check_feature_names(feature_names, d)
    _check_X(X, x_dtype, n)
    _check_y_finite(y)
    task, n_classes = resolve_task(task, n_classes, y)
    _check_labels(y, task, n_classes)
    path = norm_path(path)
    _check_destination(path, overwrite, storage_options)

    with _StoreWriter(
        path,
        n,
        d,
        chunk_rows=chunk_rows,
        task=task,
        n_classes=n_classes,
        feature_names=names,
        overwrite=overwrite,
        storage_options=storage_options,
        dtype=x_dtype,
    ) as w:
        for s, e in _row_blocks(n, d):
            w.write(X[s:e], y[s:e])
    return Dataset(path, storage_options=storage_options)


def from_blocks(
    blocks: Iterable[tuple[np.ndarray, np.ndarray]],
    path: str | os.PathLike[str],
    n_rows: int,
    n_features: int,
    *,
    task: str,
    n_classes: int | None = None,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    feature_names: Sequence[str] | None = None,
    attrs: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Write a data set from an iterable of ``(X_block, y_block)`` row blocks.

    For data that do not fit in memory (generators, converters). Every block is validated
    as it arrives (shapes, numeric dtype, finiteness, labels); because ``task`` cannot be
    inferred without seeing all of y it must be given, and ``n_classes`` too for
    ``"multiclass"``. A validation error mid-way (including a value of X beyond
    :func:`magnitude_limit`, or, with ``dtype="float32"``, one too large for float32)
    aborts the write; atomicity is as in
    :func:`from_numpy`, so no partial store is left.

    Parameters
    ----------
    blocks : iterable of (ndarray, ndarray)
        Row blocks ``(X_b (n_b, D), y_b (n_b,))`` in row order; sizes are arbitrary.
    path : str or os.PathLike
        Destination (local path or fsspec URL).
    n_rows, n_features : int
        Total shape of ``X``; the blocks must add up to exactly ``n_rows`` rows.
    task : {"binary", "multiclass", "count", "real"}
        Task (required).
    n_classes : int, optional
        As in :func:`from_numpy` (required for ``"multiclass"``).
    chunk_rows : int, optional
        Rows per chunk (default ~8 MiB chunks).
    overwrite : bool, default False
        Replace an existing store.
    feature_names : sequence of str, optional
        Column names.
    attrs : dict, optional
        Extra JSON-able group attributes (must not clash with the reserved names).
    storage_options : dict, optional
        fsspec options for URL paths.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X`` (see :func:`from_numpy`).

    Returns
    -------
    Dataset
        The written data set.
    """
    for name, v in (("n_rows", n_rows), ("n_features", n_features)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    n_rows, n_features = int(n_rows), int(n_features)
    if n_rows <= 0:
        raise ValueError(f"the data set is empty (n_rows = {n_rows})")
    if n_features <= 0:
        raise ValueError(f"n_features must be >= 1, got {n_features}")
    x_dtype = check_dtype(dtype)
    chunk_rows = check_chunk_rows(chunk_rows, n_rows, n_features, x_dtype.itemsize)
    task, n_classes = resolve_task(task, n_classes, None)
    names = _check_feature_names(feature_names, n_features)
    reserved = {
        "format",
        "n_rows",
        "n_features",
        "chunk_rows",
        "dtype",
        "task",
        "n_classes",
        "feature_names",
    }
    extra = dict(attrs or {})
    clash = reserved & set(extra)
    if clash:
        raise ValueError(f"attrs may not set reserved keys {sorted(clash)}")
    path = norm_path(path)
    _check_destination(path, overwrite, storage_options)

    with _StoreWriter(
        path,
        n_rows,
        n_features,
        chunk_rows=chunk_rows,
        task=task,
        n_classes=n_classes,
        feature_names=names,
        overwrite=overwrite,
        extra_attrs=extra,
        storage_options=storage_options,
        dtype=x_dtype,
    ) as w:
        offset = 0
        for Xb, yb in blocks:
            Xb, yb = check_block(Xb, yb, offset, n_rows, n_features, x_dtype, task, n_classes)
            w.write(Xb, yb)
            offset += Xb.shape[0]
        if offset != n_rows:
            raise ValueError(f"blocks contain {offset} rows, expected n_rows = {n_rows}")
    return Dataset(path, storage_options=storage_options)


def check_block(
    Xb: Any,
    yb: Any,
    offset: int,
    n_rows: int,
    n_features: int,
    x_dtype: np.dtype,
    task: str,
    n_classes: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Validate a block of rows starting at row ``offset`` of a data set of ``n_rows`` rows
    (shapes, numeric dtype, finiteness, the storage dtype's range, the magnitude limit,
    labels); the block as arrays.

    Raises
    ------
    ValueError
        Naming the first bad row (and column of ``X``).
    """
    Xb = _as_array(Xb, "X")
    yb = _as_array(yb, "y")
    if Xb.ndim != 2 or Xb.shape[1] != n_features:
        raise ValueError(
            f"X block at row {offset} has shape {Xb.shape}, expected (n, {n_features})"
        )
    if yb.ndim != 1 or yb.shape[0] != Xb.shape[0]:
        raise ValueError(f"y block at row {offset} has shape {yb.shape}, expected ({Xb.shape[0]},)")
    if offset + Xb.shape[0] > n_rows:
        raise ValueError(f"blocks contain more than n_rows = {n_rows} rows")
    _check_numeric(Xb, "X")
    _check_numeric(yb, "y")
    _check_X(Xb, x_dtype, n_rows, offset)
    _check_y_finite(yb, offset)
    _check_labels(yb, task, n_classes, offset)
    return Xb, yb


#: Row pieces in flight at once per worker when writing in parallel (:func:`from_pieces`).
_PIECES_PER_WORKER = 2


def _write_piece(
    tmp: str,
    storage_options: dict[str, Any] | None,
    start: int,
    stop: int,
    payload: Any,
    convert: Callable[[int, int, Any], Iterable[tuple[np.ndarray, np.ndarray]]],
    check: tuple[int, int, str, str, int | None, int],
) -> int:
    """On a worker: convert rows ``start:stop`` (``convert(start, stop, payload)`` yields
    them in blocks), validate each block and write them into the temporary store ``tmp``
    a whole chunk at a time (``start`` begins a chunk; ``stop`` ends one or the data set);
    the rows written.

    A worker holds one block being converted, one chunk being filled and the chunk zarr
    is compressing, whatever the piece's size: a chunk is written as soon as it is whole
    (the workers, not the chunks of one worker, compress in parallel), from the block
    itself when the block holds it whole, else from one reused chunk buffer.
    """
    n_rows, n_features, dtype, task, n_classes, chunk_rows = check
    x_dtype = np.dtype(dtype)
    y_dtype = np.dtype(np.float64 if task == "real" else np.int64)
    kw: dict[str, Any] = {}
    if storage_options and is_url(tmp):
        kw["storage_options"] = storage_options
    group = zarr.open_group(store=tmp, mode="r+", zarr_format=3, **kw)
    # every chunk stored, as the writer that created the arrays has it (the setting is
    # not in the store's metadata): nor does zarr compare each chunk with the fill value
    X_arr, y_arr = (group[a].with_config(_EVERY_CHUNK) for a in ("X", "y"))
    buf_X: np.ndarray | None = None  # the chunk being filled (allocated when needed)
    buf_y: np.ndarray | None = None
    held = 0  # rows of buf_X filled
    at = start  # the first row not yet written

    row = start
    for X, y in convert(start, stop, payload):
        X, y = check_block(X, y, row, n_rows, n_features, x_dtype, task, n_classes)
        m = X.shape[0]
        row += m
        if row > stop:
            raise ValueError(f"rows {start}-{stop - 1}: more rows converted")
        i = 0
        while i < m:
            if held == 0 and m - i >= chunk_rows:
                e = i + chunk_rows
                _write_block(X_arr, at, np.ascontiguousarray(X[i:e], dtype=x_dtype))
                _write_block(y_arr, at, np.ascontiguousarray(y[i:e], dtype=y_dtype))
                at += chunk_rows
                i = e
                continue
            if buf_X is None or buf_y is None:
                buf_X = np.empty((chunk_rows, n_features), dtype=x_dtype)
                buf_y = np.empty(chunk_rows, dtype=y_dtype)
            take = min(chunk_rows - held, m - i)
            buf_X[held : held + take] = X[i : i + take]
            buf_y[held : held + take] = y[i : i + take]
            held += take
            i += take
            if held == chunk_rows:
                _write_block(X_arr, at, buf_X)
                _write_block(y_arr, at, buf_y)
                at += held
                held = 0
        del X, y  # the block is not held while the next one is converted
    if row != stop:
        raise ValueError(f"rows {start}-{stop - 1}: {row - start} rows converted")
    if held:
        _write_block(X_arr, at, buf_X[:held])  # type: ignore[index]
        _write_block(y_arr, at, buf_y[:held])  # type: ignore[index]
    return stop - start


def from_pieces(
    pieces: Iterable[tuple[int, int, Any]],
    convert: Callable[[int, int, Any], Iterable[tuple[np.ndarray, np.ndarray]]],
    path: str | os.PathLike[str],
    n_rows: int,
    n_features: int,
    *,
    task: str,
    n_classes: int | None,
    chunk_rows: int,
    feature_names: Sequence[str] | None = None,
    attrs: dict[str, Any] | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
    client: Any = None,
) -> Dataset:
    """Write a data set from row pieces converted where they are read.

    Each piece ``(start, stop, payload)`` is turned into rows by
    ``convert(start, stop, payload)``, which yields them as ``(X, y)`` blocks in order
    (``payload``: whatever the piece needs, a Dask collection or future is computed
    first), validated as :func:`from_blocks` does and written; a worker holds a few blocks
    of a piece at a time, not the piece. Without a client the pieces are converted here,
    one at a time, in order.
    With a Dask ``client`` each piece is converted and written by a worker into the
    temporary store (pieces must then start at multiples of ``chunk_rows``: no two write
    one chunk), at most two pieces per worker in flight; on the first failure no more
    pieces are started, those in flight are waited for, and nothing is left. The layout,
    the chunk bytes and the attributes are those :func:`from_numpy` writes for the same
    rows; atomicity is as in :func:`from_numpy`.

    Parameters
    ----------
    pieces : iterable of (int, int, object)
        Row ranges covering ``0..n_rows`` in order, with their payloads.
    convert : callable
        ``convert(start, stop, payload)``, an iterable of ``(X, y)`` blocks; picklable when
        ``client`` is given.
    path : str or os.PathLike
        Destination (local path or fsspec URL).
    n_rows, n_features : int
        Shape of ``X``.
    task, n_classes, chunk_rows, feature_names, attrs, overwrite, storage_options, dtype
        As in :func:`from_blocks` (``task`` and ``chunk_rows`` required).
    client : distributed.Client, optional
        Write in parallel on its workers.

    Returns
    -------
    Dataset
    """
    x_dtype = check_dtype(dtype)
    task, n_classes = resolve_task(task, n_classes, None)
    if client is None:

        def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for start, stop, payload in pieces:
                if hasattr(payload, "compute"):
                    payload = payload.compute()
                yield from convert(start, stop, payload)

        return from_blocks(
            blocks(),
            path,
            n_rows,
            n_features,
            task=task,
            n_classes=n_classes,
            chunk_rows=chunk_rows,
            overwrite=overwrite,
            feature_names=feature_names,
            attrs=attrs,
            storage_options=storage_options,
            dtype=x_dtype,
        )
    names = _check_feature_names(feature_names, n_features)
    path = norm_path(path)
    _check_destination(path, overwrite, storage_options)
    check = (int(n_rows), int(n_features), x_dtype.name, task, n_classes, int(chunk_rows))
    n_workers = max(1, len(client.scheduler_info(n_workers=-1).get("workers", {})))
    window = _PIECES_PER_WORKER * n_workers
    with _StoreWriter(
        path,
        n_rows,
        n_features,
        chunk_rows=chunk_rows,
        task=task,
        n_classes=n_classes,
        feature_names=names,
        overwrite=overwrite,
        extra_attrs=dict(attrs or {}),
        storage_options=storage_options,
        dtype=x_dtype,
    ) as w:
        futures: list[Any] = []  # in flight, in row order
        # each piece's future as it ends, whichever ends first (put by the future's own
        # callback, so this module needs no Dask import)
        ended: queue.SimpleQueue[Any] = queue.SimpleQueue()
        todo = iter(pieces)
        expected = 0

        def submit() -> bool:
            nonlocal expected
            piece = next(todo, None)
            if piece is None:
                return False
            start, stop, payload = piece
            if start != expected or (start % chunk_rows and start != n_rows):
                raise ValueError(
                    f"internal error: piece {start}-{stop} does not follow row {expected} "
                    f"or does not start a chunk of {chunk_rows} rows"
                )
            expected = stop
            if hasattr(payload, "__dask_graph__"):
                payload = client.compute(payload)
            future = client.submit(
                _write_piece,
                w._tmp,
                storage_options,
                start,
                stop,
                payload,
                convert,
                check,
                pure=False,
            )
            future.add_done_callback(ended.put)
            futures.append(future)
            return True

        written = 0
        failed = False
        try:
            for _ in range(window):
                if not submit():
                    break
            # a piece is started as soon as any finishes (a worker does not wait for the
            # oldest piece, another worker's, to end); the first failure starts no more
            while futures and not failed:
                f = ended.get()
                if f.status != "finished":
                    failed = True
                    break
                written += f.result()
                futures.remove(f)
                submit()
        except BaseException:
            # no piece may write into the temporary store once it is removed: those in
            # flight (at most the window) are waited for, not cancelled (a running task
            # cannot be stopped)
            client.gather(futures, errors="skip")
            raise
        if failed:
            client.gather(futures, errors="skip")
            # the error of the first failed piece in row order, whichever ended first
            next(f for f in futures if f.status != "finished").result()
        if written != n_rows or expected != n_rows:
            raise ValueError(f"pieces contain {written} rows, expected n_rows = {n_rows}")
        w._written = n_rows
    return Dataset(path, storage_options=storage_options)
