"""The data layer: a validated, chunked zarr v3 layout for tall data sets.

This module knows nothing of models or Dask. It owns

* the on-disk layout (one zarr v3 group per data set, see below),
* validation and atomic writing (:func:`from_numpy`, :func:`from_blocks`, :func:`ingest`),
* reading (:class:`Dataset`, :func:`open_dataset`) and the shard layout
  (:meth:`Dataset.shard_ranges`),
* synthetic generators that write chunk by chunk (:func:`make_logistic`,
  :func:`make_softmax`, :func:`make_robust`, :func:`make_opv_like`).

Layout
------
A data set is a zarr v3 group with two arrays and a few attributes::

    <path>/            group, attrs {"format": "flymc_dist/1", "n_rows", "n_features",
                                     "chunk_rows", "dtype", "task", "n_classes",
                                     "feature_names", ...}
    <path>/X           (N, D) float64 or float32 (attribute "dtype"), chunks (chunk_rows, D)
    <path>/y           (N,)   float64 (task "real") or int64 ("binary", "multiclass"),
                              chunks (chunk_rows,)

``X`` is stored as float64 (the default) or float32 (``dtype="float32"`` in the writers:
half the bytes; values rounded once when written); every read returns float64, so all
arithmetic is float64 either way. Stores written before the ``"dtype"`` attribute existed
are float64 (:attr:`Dataset.dtype` reads it from the array).

``task`` is one of ``"binary"`` (y in {0, 1}, ``n_classes == 2``), ``"multiclass"``
(y in 0..K-1, ``n_classes == K >= 2``) or ``"real"`` (``n_classes`` is ``None``).
Generators add more attributes (e.g. ``true_theta``); :attr:`Dataset.attrs` exposes them.

Atomicity
---------
:func:`from_numpy` and :func:`ingest` validate all of their input before writing
anything (:func:`from_blocks` and the generators validate each block as it arrives).
For local paths every writer then writes into a temporary
sibling directory (``.<name>.flymc-tmp-<random>``) and renames it into place only on
success; with ``overwrite=True`` the old store is moved aside and deleted only after the
new one is complete. Any failure, including ``KeyboardInterrupt``, removes the temporary
directory and leaves an existing store untouched. For fsspec URLs (paths containing
``"://"``) the store is written in place; the ``"format"`` attribute that marks a
complete store is written last (so :func:`open_dataset` rejects a partial store) and a
best-effort removal is attempted on failure, but atomicity is only guaranteed locally.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import WrapperStore

__all__ = [
    "FORMAT",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_ROWS_PER_SHARD",
    "DataIntegrityError",
    "Dataset",
    "default_chunk_rows",
    "from_numpy",
    "from_blocks",
    "open_dataset",
    "ingest",
    "make_logistic",
    "make_softmax",
    "make_robust",
    "make_opv_like",
]

#: Value of the ``"format"`` attribute that marks a complete flymc_dist store.
FORMAT = "flymc_dist/1"
#: Target size of one chunk of ``X`` when ``chunk_rows`` is not given (8 MiB).
DEFAULT_CHUNK_BYTES = 8 * 2**20
#: Rows per shard of :meth:`Dataset.shard_ranges` when neither argument is given (2**18).
DEFAULT_ROWS_PER_SHARD = 2**18
#: Rows per generation block of the synthetic generators (independent of ``chunk_rows``).
_GEN_BLOCK_ROWS = 2**15
#: Rows per block for validation passes and multi-chunk writes of in-memory arrays.
_WORK_BLOCK_BYTES = 32 * 2**20

_TASKS = ("binary", "multiclass", "real")
#: Storage dtypes of ``X`` (reading always returns float64).
_DTYPES = (np.dtype(np.float64), np.dtype(np.float32))


# --------------------------------------------------------------------------- helpers


def _is_url(path: str | os.PathLike[str]) -> bool:
    return "://" in str(path)


def _norm_path(path: str | os.PathLike[str]) -> str:
    """Absolute local path (workers may have another cwd) or the URL unchanged."""
    p = os.fspath(path)
    if not isinstance(p, str):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if _is_url(p):
        return p.rstrip("/")
    return os.path.abspath(os.path.expanduser(p))


def _check_dtype(dtype: Any) -> np.dtype:
    """The storage dtype of ``X``: float64 (the default) or float32."""
    dt: np.dtype | None = None
    if dtype is not None and not isinstance(dtype, bool):
        with contextlib.suppress(TypeError, ValueError):
            dt = np.dtype(dtype)
    if dt is None or not any(dt == ok for ok in _DTYPES):
        raise ValueError(f"dtype must be 'float64' or 'float32', got {dtype!r}")
    return dt


def default_chunk_rows(n_rows: int, n_features: int, itemsize: int = 8) -> int:
    """Rows per chunk aiming at ~8 MiB of *stored* ``X`` per chunk, within ``[1, n_rows]``.

    Parameters
    ----------
    n_rows, n_features : int
        Shape of ``X``.
    itemsize : int, default 8
        Bytes per stored value of ``X``: 8 for float64, 4 for float32 (twice the rows).

    Returns
    -------
    int
        ``clip(DEFAULT_CHUNK_BYTES // (itemsize * n_features), 1, n_rows)``.
    """
    if isinstance(itemsize, bool) or not isinstance(itemsize, int | np.integer) or itemsize < 1:
        raise ValueError(f"itemsize must be a positive integer, got {itemsize!r}")
    rows = DEFAULT_CHUNK_BYTES // (int(itemsize) * max(int(n_features), 1))
    return int(max(1, min(int(n_rows), rows)))


def _check_chunk_rows(
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


def _resolve_task(
    task: str | None, n_classes: int | None, y_sample: np.ndarray | None
) -> tuple[str, int | None]:
    """Check ``task`` / ``n_classes``; infer from ``y_sample`` (all of y) if task is None."""
    if task is None:
        if y_sample is None:
            raise ValueError("task must be given explicitly here (it cannot be inferred)")
        task, inferred_k = _infer_task(y_sample)
        if n_classes is None:
            n_classes = inferred_k
    if task not in _TASKS:
        raise ValueError(f"task must be one of {_TASKS} or None, got {task!r}")
    if n_classes is not None:
        if isinstance(n_classes, bool) or not isinstance(n_classes, int | np.integer):
            raise ValueError(f"n_classes must be an integer or None, got {n_classes!r}")
        n_classes = int(n_classes)
    if task == "real":
        if n_classes is not None:
            raise ValueError(f"n_classes must be None for task 'real', got {n_classes}")
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
            f"y must be integer-valued for task {task!r}: row {offset + r} has y = {y[r]!r}"
        )
    k = 2 if task == "binary" else int(n_classes)  # type: ignore[arg-type]
    bad = (y < 0) | (y > k - 1)
    if bad.any():
        r = int(np.argmax(bad))
        allowed = "{0, 1}" if task == "binary" else f"0..{k - 1}"
        raise ValueError(
            f"labels must be in {allowed} for task {task!r}: row {offset + r} has y = {y[r]!r}"
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


def _check_destination(
    path: str, overwrite: bool, storage_options: dict[str, Any] | None = None
) -> None:
    """Raise if ``path`` exists and may not (or must not) be replaced."""
    if _is_url(path):
        import fsspec

        fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
        if fs.exists(root) and not overwrite:
            raise FileExistsError(f"{path!r} already exists (pass overwrite=True to replace it)")
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
        self.x_dtype = _check_dtype(dtype)  # storage dtype of X (blocks arrive validated)
        self._written = 0  # rows handed to the writer thread
        per = max(
            1, _WORK_BLOCK_BYTES // (self.x_dtype.itemsize * self.n_features * self.chunk_rows)
        )
        self._buf_rows = min(per * self.chunk_rows, max(self.n_rows, 1))
        self._new_buffer()
        self._tmp: str | None = None
        self._queue: queue.Queue[tuple[int, np.ndarray, np.ndarray] | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()

    def _new_buffer(self) -> None:
        # A fresh buffer per flush: the previous one may still be being written.
        self._buf_X = np.empty((self._buf_rows, self.n_features), dtype=self.x_dtype)
        self._buf_y = np.empty(self._buf_rows, dtype=self.y_dtype)
        self._buf_n = 0

    # -- context management
    def __enter__(self) -> _StoreWriter:
        _check_destination(self.path, self.overwrite, self.storage_options)
        if _is_url(self.path):
            target: Any = self.path
            mode = "w"
        else:
            parent, name = os.path.split(self.path)
            os.makedirs(parent, exist_ok=True)
            self._tmp = os.path.join(parent, f".{name}.flymc-tmp-{uuid.uuid4().hex[:12]}")
            target = self._tmp
            mode = "w-"
        try:
            kw: dict[str, Any] = {}
            if self.storage_options and _is_url(self.path):
                kw["storage_options"] = self.storage_options
            self._group = zarr.open_group(store=target, mode=mode, zarr_format=3, **kw)
            # Every chunk is stored, and the fill values are impossible data (NaN in X and
            # real y, -1 for labels): a chunk absent from the store is always a loss, never
            # a chunk zarr skipped for holding only the fill value (see Dataset).
            every_chunk = {"write_empty_chunks": True}
            self._X = self._group.create_array(
                "X",
                shape=(self.n_rows, self.n_features),
                chunks=(self.chunk_rows, self.n_features),
                dtype=self.x_dtype.name,
                fill_value=np.nan,
                dimension_names=("row", "feature"),
                config=every_chunk,
            )
            self._y = self._group.create_array(
                "y",
                shape=(self.n_rows,),
                chunks=(self.chunk_rows,),
                dtype=np.dtype(self.y_dtype).name,
                fill_value=np.nan if self.task == "real" else -1,
                dimension_names=("row",),
                config=every_chunk,
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
                self._emit(
                    np.array(X[i : i + cap], dtype=self.x_dtype, order="C"),
                    np.array(y[i : i + cap], dtype=self.y_dtype),
                )
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
        if self._buf_n:
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

    def _abort(self) -> None:
        try:
            self._stop_thread()
        finally:
            if self._tmp is not None:
                _rmtree(self._tmp)
                self._tmp = None
            elif _is_url(self.path):
                with contextlib.suppress(Exception):
                    import fsspec

                    fs, root = fsspec.core.url_to_fs(self.path, **(self.storage_options or {}))
                    if fs.exists(root):
                        fs.rm(root, recursive=True)


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
        Targets: {0, 1} for ``"binary"``, 0..K-1 for ``"multiclass"``, real for ``"real"``.
    path : str or os.PathLike
        Local directory to create, or an fsspec URL (contains ``"://"``).
    chunk_rows : int, optional
        Rows per zarr chunk. Default: ~8 MiB of stored ``X`` per chunk (so twice the rows
        for float32), at most N. Values larger than N are clipped to N.
    overwrite : bool, default False
        Replace an existing store at ``path``. The old store is removed only after the new
        one is complete. A non-empty directory that is not a zarr store is never replaced.
    task : {"binary", "multiclass", "real"}, optional
        If None it is inferred: integer-valued y with values in {0, 1} -> ``"binary"``;
        other integer-valued y with min >= 0 -> ``"multiclass"`` with
        ``n_classes = max(y) + 1``; anything else -> ``"real"``.
    n_classes : int, optional
        Number of classes (``"multiclass"``: default max(y) + 1, must be >= 2;
        ``"binary"``: 2; ``"real"``: must be None).
    feature_names : sequence of str, optional
        One name per column of ``X``.
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
        and column reported) or y (first bad row), with ``dtype="float32"`` a finite value
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
    x_dtype = _check_dtype(dtype)
    chunk_rows = _check_chunk_rows(chunk_rows, n, d, x_dtype.itemsize)
    names = _check_feature_names(feature_names, d)
    _check_X_finite(X)
    _check_X_fits(X, x_dtype)
    _check_y_finite(y)
    task, n_classes = _resolve_task(task, n_classes, y)
    _check_labels(y, task, n_classes)
    path = _norm_path(path)
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
    ``"multiclass"``. A validation error mid-way (including, with ``dtype="float32"``, a
    value of X too large for float32) aborts the write; atomicity is as in
    :func:`from_numpy`, so no partial store is left.

    Parameters
    ----------
    blocks : iterable of (ndarray, ndarray)
        Row blocks ``(X_b (n_b, D), y_b (n_b,))`` in row order; sizes are arbitrary.
    path : str or os.PathLike
        Destination (local path or fsspec URL).
    n_rows, n_features : int
        Total shape of ``X``; the blocks must add up to exactly ``n_rows`` rows.
    task : {"binary", "multiclass", "real"}
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
    x_dtype = _check_dtype(dtype)
    chunk_rows = _check_chunk_rows(chunk_rows, n_rows, n_features, x_dtype.itemsize)
    task, n_classes = _resolve_task(task, n_classes, None)
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
    path = _norm_path(path)
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
            Xb = _as_array(Xb, "X")
            yb = _as_array(yb, "y")
            if Xb.ndim != 2 or Xb.shape[1] != n_features:
                raise ValueError(
                    f"X block at row {offset} has shape {Xb.shape}, expected (n, {n_features})"
                )
            if yb.ndim != 1 or yb.shape[0] != Xb.shape[0]:
                raise ValueError(
                    f"y block at row {offset} has shape {yb.shape}, expected ({Xb.shape[0]},)"
                )
            if offset + Xb.shape[0] > n_rows:
                raise ValueError(f"blocks contain more than n_rows = {n_rows} rows")
            _check_numeric(Xb, "X")
            _check_numeric(yb, "y")
            _check_X_finite(Xb, offset)
            _check_X_fits(Xb, x_dtype, offset)
            _check_y_finite(yb, offset)
            _check_labels(yb, task, n_classes, offset)
            w.write(Xb, yb)
            offset += Xb.shape[0]
        if offset != n_rows:
            raise ValueError(f"blocks contain {offset} rows, expected n_rows = {n_rows}")
    return Dataset(path, storage_options=storage_options)


# --------------------------------------------------------------------------- reading


class DataIntegrityError(ValueError):
    """A chunk of a data set is missing from its store, or cannot be decoded."""


class _ChunkGuard(WrapperStore):
    """A read-only view of a store that refuses to read an absent chunk of ``X`` or ``y``.

    zarr reads a chunk that is not in the store as the array's fill value, so a partial
    copy of a store would silently give zeros. Every chunk of a data set is stored (see
    :class:`_StoreWriter`), so an absent one is a loss: this view raises
    :class:`DataIntegrityError` naming the store, the chunk and its rows, on the very read
    that would have used the fill value (no extra request to the store).
    """

    def __init__(
        self,
        store: Any,
        where: str = "",
        chunk_rows: int = 0,
        prefix: str = "",
        legacy: bool = False,
    ) -> None:
        super().__init__(store)
        self._where = where
        self._chunk_rows = chunk_rows
        self._prefix = prefix
        self._legacy = legacy

    def _with_store(self, store: Any) -> _ChunkGuard:
        return type(self)(store, self._where, self._chunk_rows, self._prefix, self._legacy)

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        value = await self._store.get(key, prototype, byte_range)
        if value is None:
            name = self._array_of(key)
            if name is not None:
                raise DataIntegrityError(
                    f"data set {self._where!r} is damaged: chunk {key!r} "
                    f"({_rows_of(key, name, self._prefix, self._chunk_rows)}) is missing from "
                    "the store (a partial copy?); nothing was read in its place"
                    + (
                        " (stores written before every chunk was stored may omit chunks "
                        "holding only zeros: if so, write it again from its source)"
                        if self._legacy
                        else ""
                    )
                )
        return value

    def _array_of(self, key: str) -> str | None:
        """``"X"`` or ``"y"`` if ``key`` is one of their chunks, else None."""
        for name in ("X", "y"):
            head = f"{self._prefix}{name}/"
            if key.startswith(head) and not key.endswith("zarr.json"):
                return name
        return None


def _rows_of(key: str, name: str, prefix: str, chunk_rows: int) -> str:
    """``"rows a-b of X"`` for a chunk key of the default or v2 key encodings."""
    rest = key[len(prefix) + len(name) + 1 :]
    digits = rest[2:] if rest.startswith(("c/", "c.")) else rest
    head = digits.replace(".", "/").split("/")[0]
    if not head.isdigit() or chunk_rows < 1:
        return f"array {name}"
    i = int(head)
    return f"rows {i * chunk_rows}-{(i + 1) * chunk_rows - 1} of {name}"


class Dataset:
    """A flymc_dist data set on disk (or behind an fsspec URL).

    Cheap to pickle: it holds the path and metadata and (re)opens the zarr arrays lazily,
    so it can be shipped to Dask workers. Create with :func:`open_dataset` or a writer.

    Attributes
    ----------
    path : str
        Absolute local path or URL.
    n_rows, n_features, chunk_rows : int
        Shape of ``X`` and rows per zarr chunk.
    dtype : numpy.dtype
        Storage dtype of ``X`` (float64 or float32); reads return float64 either way.
    task : str
        ``"binary"``, ``"multiclass"`` or ``"real"``.
    n_classes : int or None
        2 for binary, K for multiclass, None for real.
    feature_names : list of str or None
        Column names of ``X``.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
    ) -> None:
        self.path = _norm_path(path)
        self.storage_options = dict(storage_options) if storage_options else None
        self._arrays: tuple[Any, Any] | None = None
        group = self._open_group()
        attrs = dict(group.attrs)
        if attrs.get("format") != FORMAT:
            raise ValueError(
                f"{self.path!r} is not a complete flymc_dist data set "
                f"(group attribute 'format' is {attrs.get('format')!r}, expected {FORMAT!r})"
            )
        try:
            X, y = group["X"], group["y"]
        except KeyError as e:
            raise ValueError(f"{self.path!r} is missing the array {e}") from None
        missing = [k for k in ("n_rows", "n_features", "chunk_rows", "task") if k not in attrs]
        if missing:
            raise ValueError(f"{self.path!r}: group attributes {missing} are missing")
        self.n_rows = int(attrs["n_rows"])
        self.n_features = int(attrs["n_features"])
        self.chunk_rows = int(attrs["chunk_rows"])
        self.task = str(attrs["task"])
        self.n_classes = None if attrs.get("n_classes") is None else int(attrs["n_classes"])
        fn = attrs.get("feature_names")
        self.feature_names = None if fn is None else [str(v) for v in fn]
        self._attrs = attrs
        # stores written before the attribute existed are float64; infer from the array
        stored = np.dtype(X.dtype)
        declared = attrs.get("dtype")
        if stored not in _DTYPES or (declared is not None and declared != stored.name):
            raise ValueError(
                f"{self.path!r}: X is stored as {stored} but the attributes declare dtype "
                f"{declared!r} (expected float64 or float32, matching)"
            )
        self.dtype = stored
        if (
            tuple(X.shape) != (self.n_rows, self.n_features)
            or tuple(y.shape) != (self.n_rows,)
            or tuple(X.chunks) != (self.chunk_rows, self.n_features)
            or tuple(y.chunks) != (self.chunk_rows,)
        ):
            raise ValueError(
                f"{self.path!r}: arrays X {X.shape} (chunks {X.chunks}) / y {y.shape} do not "
                f"match the attributes (n_rows={self.n_rows}, n_features={self.n_features}, "
                f"chunk_rows={self.chunk_rows})"
            )
        self._arrays = self._guarded(group)

    # -- opening
    def _open_group(self) -> Any:
        if _is_url(self.path):
            kw: dict[str, Any] = {}
            if self.storage_options:
                kw["storage_options"] = self.storage_options
            try:
                return zarr.open_group(store=self.path, mode="r", zarr_format=3, **kw)
            except FileNotFoundError:
                raise FileNotFoundError(f"no flymc_dist data set at {self.path!r}") from None
            except ValueError as e:  # as for a local path: not a group
                raise ValueError(f"{self.path!r} is not a flymc_dist data set: {e}") from e
            except Exception as e:  # the store cannot be reached (endpoint, credentials, ...)
                keys = sorted(self.storage_options or {})
                how = (
                    f"with storage_options keys {keys}"
                    if keys
                    else "without storage_options "
                    "(a store that needs an endpoint or credentials must be opened with "
                    "open_dataset(path, storage_options=...))"
                )
                raise OSError(
                    f"cannot open the data set at {self.path!r} {how}: {type(e).__name__}: {e}"
                ) from e
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"no flymc_dist data set at {self.path!r} (path not found)")
        if not os.path.isfile(os.path.join(self.path, "zarr.json")):
            raise ValueError(f"{self.path!r} is not a zarr v3 store (no zarr.json)")
        try:
            return zarr.open_group(store=self.path, mode="r", zarr_format=3)
        except Exception as e:  # zarr raises several types for "not a group"
            raise ValueError(f"{self.path!r} is not a flymc_dist data set: {e}") from e

    @property
    def _X(self) -> Any:
        return self._get_arrays()[0]

    @property
    def _y(self) -> Any:
        return self._get_arrays()[1]

    def _get_arrays(self) -> tuple[Any, Any]:
        if self._arrays is None:
            self._arrays = self._guarded(self._open_group())
        return self._arrays

    def _guarded(self, group: Any) -> tuple[Any, Any]:
        """``X`` and ``y`` read through a :class:`_ChunkGuard` (an absent chunk raises)."""
        prefix = f"{group.path}/" if group.path else ""
        store = _ChunkGuard(
            group.store, self.path, self.chunk_rows, prefix, legacy="store_id" not in self._attrs
        )
        g = zarr.open_group(store=store, path=group.path, mode="r", zarr_format=3)
        return g["X"], g["y"]

    def _damage(self, start: int, stop: int, err: Exception) -> Exception:
        """The error to raise for a failed read of rows ``start:stop``: one naming the
        first chunk that cannot be decoded on its own (found by reading them one by one,
        only after a failure), else ``err`` itself (a transient failure)."""
        cr = self.chunk_rows
        for i in range(start // cr, -(-stop // cr)):
            lo, hi = i * cr, min((i + 1) * cr, self.n_rows)
            for name, array in (("X", self._X), ("y", self._y)):
                try:
                    array[lo:hi]
                except DataIntegrityError as e:
                    return e
                except Exception as e:  # noqa: BLE001 - reported with the chunk named
                    key = array.metadata.encode_chunk_key((i,) if name == "y" else (i, 0))
                    return DataIntegrityError(
                        f"data set {self.path!r} is damaged: chunk {f'{name}/{key}'!r} (rows "
                        f"{lo}-{hi - 1} of {name}) cannot be decoded "
                        f"({type(e).__name__}: {e})"
                    )
        return err

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_arrays"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- metadata
    @property
    def shape(self) -> tuple[int, int]:
        """``(n_rows, n_features)``."""
        return (self.n_rows, self.n_features)

    @property
    def n_chunks(self) -> int:
        """Number of zarr chunks along the rows."""
        return -(-self.n_rows // self.chunk_rows)

    @property
    def attrs(self) -> dict[str, Any]:
        """All group attributes (a copy), including generator extras such as ``true_theta``."""
        return dict(self._attrs)

    def __len__(self) -> int:
        return self.n_rows

    def fingerprint(self) -> str:
        """The identity of this data set, cheap to compute: what a resumed run checks.

        ``"<n_rows>x<n_features>:<store_id>"``, the random id written with the store (so a
        copy of a store is the same data set, and two stores of the same shape are not).
        A store written before ids were written gets a hash of its layout attributes and
        of its first and last rows (two chunks read).

        Returns
        -------
        str
        """
        head = f"{self.n_rows}x{self.n_features}:"
        sid = self._attrs.get("store_id")
        if isinstance(sid, str) and sid:
            return head + sid
        import hashlib

        h = hashlib.sha256()
        layout = [
            self.n_rows,
            self.n_features,
            self.chunk_rows,
            self.task,
            self.n_classes,
            self.feature_names,
        ]
        h.update(repr(layout).encode())
        for lo in {0, self.n_rows - 1}:
            X, y = self.read(lo, lo + 1)
            h.update(X.tobytes())
            h.update(np.asarray(y, np.float64).tobytes())
        return head + "sha256-" + h.hexdigest()[:32]

    def __repr__(self) -> str:
        k = f", n_classes={self.n_classes}" if self.task != "real" else ""
        dt = f", dtype={self.dtype.name!r}" if self.dtype != np.float64 else ""
        return (
            f"Dataset({self.path!r}, n_rows={self.n_rows}, n_features={self.n_features}, "
            f"task={self.task!r}{k}, chunk_rows={self.chunk_rows}, n_chunks={self.n_chunks}"
            f"{dt})"
        )

    # -- layout
    def chunk_ranges(self) -> list[tuple[int, int]]:
        """Row ranges ``(start, stop)`` of the zarr chunks."""
        cr, n = self.chunk_rows, self.n_rows
        return [(s, min(s + cr, n)) for s in range(0, n, cr)]

    def shard_ranges(
        self, n_shards: int | None = None, rows_per_shard: int | None = None
    ) -> list[tuple[int, int]]:
        """Split the rows into contiguous shards made of whole zarr chunks.

        The result depends only on the data layout (``n_rows``, ``chunk_rows``) and the
        argument, never on the cluster.

        Parameters
        ----------
        n_shards : int, optional
            Number of shards; chunks are spread as evenly as possible (shard sizes differ
            by at most one chunk, larger shards first). Capped at the number of chunks.
        rows_per_shard : int, optional
            Target rows per shard, rounded to the nearest whole number of chunks (at
            least one chunk).
            With neither argument: ``DEFAULT_ROWS_PER_SHARD`` = 262,144 rows (2**18).

        Returns
        -------
        list of (int, int)
            ``(start, stop)`` row ranges covering ``0..n_rows`` exactly once, in order;
            every ``start`` is a multiple of ``chunk_rows`` and only the last ``stop`` may
            not be.
        """
        if n_shards is not None and rows_per_shard is not None:
            raise ValueError("give n_shards or rows_per_shard, not both")
        n_chunks = self.n_chunks
        cr = self.chunk_rows
        if n_shards is not None:
            if isinstance(n_shards, bool) or not isinstance(n_shards, int | np.integer):
                raise ValueError(f"n_shards must be a positive integer, got {n_shards!r}")
            if n_shards < 1:
                raise ValueError(f"n_shards must be >= 1, got {n_shards}")
            m = min(int(n_shards), n_chunks)
            base, extra = divmod(n_chunks, m)
            bounds = [0]
            for i in range(m):
                bounds.append(bounds[-1] + base + (1 if i < extra else 0))
        else:
            if rows_per_shard is None:
                rows_per_shard = DEFAULT_ROWS_PER_SHARD
            if isinstance(rows_per_shard, bool) or not isinstance(rows_per_shard, int | np.integer):
                raise ValueError(
                    f"rows_per_shard must be a positive integer, got {rows_per_shard!r}"
                )
            if rows_per_shard < 1:
                raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
            per = max(1, int(math.floor(rows_per_shard / cr + 0.5)))
            bounds = list(range(0, n_chunks, per)) + [n_chunks]
        return [
            (b0 * cr, min(b1 * cr, self.n_rows))
            for b0, b1 in zip(bounds[:-1], bounds[1:], strict=True)
        ]

    # -- reading
    def _check_range(self, start: int, stop: int) -> tuple[int, int]:
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self.n_rows:
            raise IndexError(f"row range [{start}, {stop}) is not within [0, {self.n_rows}]")
        return start, stop

    def read(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Read rows ``start:stop``.

        Parameters
        ----------
        start, stop : int
            Row range, ``0 <= start <= stop <= n_rows`` (``stop=None``: to the end).

        Returns
        -------
        X : ndarray, shape (stop - start, n_features)
            float64, C-contiguous.
        y : ndarray, shape (stop - start,)
            float64 (``"real"``) or int64.
        """
        start, stop = self._check_range(start, self.n_rows if stop is None else stop)
        if start == stop:
            return (
                np.empty((0, self.n_features), dtype=np.float64),
                np.empty(0, dtype=self._y.dtype),
            )
        try:
            X = np.ascontiguousarray(self._X[start:stop], dtype=np.float64)
            y = np.ascontiguousarray(self._y[start:stop])
        except DataIntegrityError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged chunk, named; else re-raised
            raise self._damage(start, stop, e) from e
        return X, y

    def read_rows(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """Read the rows at sorted integer ``indices`` (out-of-core access).

        All touched chunks are fetched concurrently in one zarr call (an orthogonal
        selection); only those chunks are read, and the rows are picked from each decoded
        chunk. (Reading the touched chunks as whole contiguous slices and picking the rows
        afterwards was measured ~10% slower on unsharded stores with zarr 3.1: the slice
        copies every decoded chunk into its output before the pick. zarr-python issue
        #3829, a slow orthogonal selection, concerns sharded arrays.)

        Parameters
        ----------
        indices : array_like of int
            Non-decreasing row indices in ``[0, n_rows)`` (duplicates allowed).

        Returns
        -------
        X : ndarray, shape (len(indices), n_features)
            float64 (whatever the storage dtype), C-contiguous.
        y : ndarray, shape (len(indices),)
        """
        idx = np.asarray(indices)
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
        if idx.size == 0:
            return (
                np.empty((0, self.n_features), dtype=np.float64),
                np.empty(0, dtype=self._y.dtype),
            )
        if not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"indices must be integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False)
        if np.any(np.diff(idx) < 0):
            raise ValueError("indices must be sorted (non-decreasing)")
        if idx[0] < 0 or idx[-1] >= self.n_rows:
            raise IndexError(f"indices must be within [0, {self.n_rows})")
        try:
            X = self._X.get_orthogonal_selection((idx, slice(None)))
            y = self._y.get_orthogonal_selection(idx)
        except DataIntegrityError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged chunk, named; else re-raised
            raise self._damage(int(idx[0]), int(idx[-1]) + 1, e) from e
        return np.ascontiguousarray(X, dtype=np.float64), np.ascontiguousarray(y)

    def iter_chunks(
        self, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """Iterate over the zarr chunks intersecting rows ``start:stop``.

        Parameters
        ----------
        start, stop : int
            Row range (default: all rows). Pieces are clipped to it.

        Yields
        ------
        (start, stop, X, y)
            Row range of the piece and its data (as :meth:`read`).
        """
        start, stop = self._check_range(start, self.n_rows if stop is None else stop)
        cr = self.chunk_rows
        s = start
        while s < stop:
            e = min((s // cr + 1) * cr, stop)
            X, y = self.read(s, e)
            yield s, e, X, y
            s = e


def open_dataset(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> Dataset:
    """Open a flymc_dist data set.

    Parameters
    ----------
    path : str or os.PathLike
        Local directory or fsspec URL.
    storage_options : dict, optional
        fsspec options for URLs.

    Returns
    -------
    Dataset

    Raises
    ------
    FileNotFoundError
        Nothing at ``path``.
    ValueError
        ``path`` is not a (complete) flymc_dist store.
    """
    return Dataset(path, storage_options=storage_options)


# --------------------------------------------------------------------------- ingest


def _ingest_npy(src: str, target: int | str | None) -> tuple[np.ndarray, np.ndarray, None]:
    try:
        A = np.load(src, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise ValueError(f"cannot read {src!r} as a numeric .npy array: {e}") from e
    if A.ndim != 2:
        raise ValueError(f"{src!r}: expected a 2-D array (features + target), got {A.shape}")
    if A.shape[1] < 2:
        raise ValueError(f"{src!r}: needs at least 2 columns (features + target), got {A.shape}")
    if target is None:
        t = A.shape[1] - 1
    else:
        if isinstance(target, bool) or not isinstance(target, int | np.integer):
            raise ValueError(f"target for a .npy file must be a column index, got {target!r}")
        t = int(target)
        if not -A.shape[1] <= t < A.shape[1]:
            raise ValueError(f"target column {t} out of range for {A.shape[1]} columns")
        t %= A.shape[1]
    y = A[:, t]
    if t == A.shape[1] - 1:
        X = A[:, :t]
    elif t == 0:
        X = A[:, 1:]
    else:  # needs a copy; fine for an in-memory-sized .npy
        X = np.delete(np.asarray(A), t, axis=1)
    return X, y, None


def _ingest_npz(src: str, target: Any) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
    if target is not None:
        raise ValueError("target is not used for .npz files (they must hold keys 'X' and 'y')")
    try:
        with np.load(src, allow_pickle=False) as f:
            missing = [k for k in ("X", "y") if k not in f.files]
            if missing:
                raise ValueError(
                    f"{src!r} must contain arrays 'X' and 'y'; missing {missing} (has {f.files})"
                )
            X, y = f["X"], f["y"]
            names = [str(v) for v in f["feature_names"]] if "feature_names" in f.files else None
    except (OSError, EOFError) as e:
        raise ValueError(f"cannot read {src!r} as a .npz archive: {e}") from e
    return X, y, names


def _ingest_csv(src: str, target: Any) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
    with open(src, newline="") as fh:
        reader = csv.reader(fh)
        try:
            first = [h.strip() for h in next(reader)]
        except StopIteration:
            raise ValueError(f"{src!r} is empty (expected a header row or data)") from None
        if len(first) < 2:
            raise ValueError(f"{src!r}: needs at least 2 columns (features + target)")
        # a first line of numbers only is data, not a header (the columns are then unnamed)
        header: list[str] | None = None if all(_is_float(c) for c in first) else first
        columns = header if header is not None else [str(i) for i in range(len(first))]
        if target is None:
            t = len(columns) - 1
        elif header is not None:
            if str(target) not in header:
                raise ValueError(f"target column {target!r} not in the header {header}")
            t = header.index(str(target))
        else:
            try:
                t = int(str(target))
            except ValueError:
                raise ValueError(
                    f"{src!r} has no header row (its first line is numbers), so "
                    f"target must be a column index, not {target!r}"
                ) from None
            if not -len(columns) <= t < len(columns):
                raise ValueError(f"target column {t} out of range for {len(columns)} columns")
            t %= len(columns)
        rows: list[list[float]] = [] if header is not None else [[float(c) for c in first]]
        for lineno, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(columns):
                raise ValueError(
                    f"{src!r} line {lineno}: {len(row)} fields, "
                    f"{'header' if header is not None else 'line 1'} has {len(columns)}"
                )
            try:
                rows.append([float(c) for c in row])
            except ValueError:
                bad = next(i for i, c in enumerate(row) if not _is_float(c))
                raise ValueError(
                    f"{src!r} line {lineno}, column {columns[bad]!r}: "
                    f"non-numeric value {row[bad]!r}"
                ) from None
    A = np.array(rows, dtype=np.float64).reshape(len(rows), len(columns))
    y = A[:, t]
    X = np.delete(A, t, axis=1)
    names = None if header is None else header[:t] + header[t + 1 :]
    return X, y, names


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def ingest(
    src: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    target: int | str | None = None,
    task: str | None = None,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    n_classes: int | None = None,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Convert a ``.npy``, ``.npz`` or ``.csv`` file into a flymc_dist store.

    Parameters
    ----------
    src : str or os.PathLike
        Source file, by extension:

        * ``.npy`` — a 2-D numeric array; its last column is y unless ``target`` gives
          another column index (negative indices allowed). Memory-mapped when y is
          the first or last column.
        * ``.npz`` — arrays ``X`` and ``y`` (and optionally ``feature_names``).
        * ``.csv`` — comma separated, with a header row; ``target`` is the name of the
          y column (default: the last column); all other columns are features, named
          after the header. All values must parse as numbers. A first line of numbers
          only is not a header but the first row of data: the features are then unnamed
          and ``target`` is a column index.
    path : str or os.PathLike
        Destination (see :func:`from_numpy`).
    target : int or str, optional
        The y column (see above).
    task : str, optional
        As in :func:`from_numpy` (inferred if None).
    chunk_rows : int, optional
        Rows per chunk.
    overwrite : bool, default False
        Replace an existing store.
    n_classes : int, optional
        As in :func:`from_numpy`.
    storage_options : dict, optional
        fsspec options for a URL ``path``.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X`` (see :func:`from_numpy`).

    Returns
    -------
    Dataset

    Raises
    ------
    FileNotFoundError
        ``src`` does not exist.
    ValueError
        Unknown extension, unreadable or malformed content, or any :func:`from_numpy`
        validation error. Nothing is written.
    """
    src = os.fspath(src)
    _check_dtype(dtype)  # before reading a large file
    if not os.path.isfile(src):
        raise FileNotFoundError(f"source file {src!r} not found")
    ext = Path(src).suffix.lower()
    if ext == ".npy":
        X, y, names = _ingest_npy(src, target)
    elif ext == ".npz":
        X, y, names = _ingest_npz(src, target)
    elif ext == ".csv":
        X, y, names = _ingest_csv(src, target)
    else:
        raise ValueError(f"cannot ingest {src!r}: unknown extension {ext!r} (.npy, .npz, .csv)")
    return from_numpy(
        X,
        y,
        path,
        chunk_rows=chunk_rows,
        overwrite=overwrite,
        task=task,
        n_classes=n_classes,
        feature_names=names,
        storage_options=storage_options,
        dtype=dtype,
    )


# --------------------------------------------------------------------------- generators
#
# Each generator draws its global parameters (true theta, correlations) from
# SeedSequence(seed, spawn_key=(kind, 0)) and the rows in fixed blocks of _GEN_BLOCK_ROWS
# rows, block b from SeedSequence(seed, spawn_key=(kind, 1, b)). The output therefore
# depends only on (seed, n_rows, n_features, ...) and not on chunk_rows; at most one block
# plus one chunk of rows is in memory at a time.

_KIND = {"logistic": 1, "softmax": 2, "robust": 3, "opv": 4}


def _check_gen_args(n_rows: Any, n_features: Any, seed: Any) -> tuple[int, int, int]:
    for name, v, lo in (("n_rows", n_rows, 1), ("n_features", n_features, 1), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise ValueError(f"{name} must be an integer, got {v!r}")
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(n_rows), int(n_features), int(seed)


def _param_rng(seed: int, kind: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_KIND[kind], 0)))


def _block_rngs(seed: int, kind: str, n_rows: int) -> Iterator[tuple[int, np.random.Generator]]:
    for b, s in enumerate(range(0, n_rows, _GEN_BLOCK_ROWS)):
        n = min(_GEN_BLOCK_ROWS, n_rows - s)
        yield n, np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_KIND[kind], 1, b)))


def _features(rng: np.random.Generator, n: int, d: int, chol: np.ndarray | None) -> np.ndarray:
    """Bias column of ones, then d-1 N(0, 1) (or N(0, chol chol^T)) features."""
    X = np.empty((n, d), dtype=np.float64)
    X[:, 0] = 1.0
    if d > 1:
        Z = rng.standard_normal((n, d - 1))
        X[:, 1:] = Z if chol is None else Z @ chol.T
    return X


def _weights(rng: np.random.Generator, d: int, norm: float, bias_sd: float) -> np.ndarray:
    """Bias ~ N(0, bias_sd^2); the other weights a random direction of length ``norm``."""
    theta = np.empty(d)
    theta[0] = bias_sd * rng.standard_normal()
    if d > 1:
        w = rng.standard_normal(d - 1)
        theta[1:] = norm * w / np.linalg.norm(w)
    return theta


def _gen_names(d: int) -> list[str]:
    return ["bias"] + [f"x{i}" for i in range(1, d)]


def _stored(X: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``X`` as it will read back from a store of ``dtype`` (rounded once, as float64)."""
    return X if dtype == np.float64 else X.astype(dtype).astype(np.float64)


def make_logistic(
    path: str | os.PathLike[str],
    n_rows: int,
    n_features: int,
    seed: int = 0,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    *,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Synthetic logistic-regression data, written chunk by chunk.

    ``x = (1, z)`` with ``z ~ N(0, I_{D-1})``; ``y ~ Bernoulli(sigmoid(theta^T x))``. The
    true ``theta`` has bias ``~ N(0, 0.5^2)`` and a uniformly random direction of length
    1.5 for the other weights, so the logit has sd ~1.5 whatever D is: about 25% of the
    labels are "wrong", the problem is far from separable for N >> D and far from trivial.

    Parameters
    ----------
    path : str or os.PathLike
        Destination.
    n_rows : int
        N >= 1.
    n_features : int
        D >= 1, including the bias column (column 0).
    seed : int, default 0
        The output depends only on (seed, n_rows, n_features), not on ``chunk_rows``.
    chunk_rows : int, optional
        Rows per chunk.
    overwrite : bool, default False
        Replace an existing store.
    storage_options : dict, optional
        fsspec options for a URL ``path``.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X``. The features are drawn in float64 and rounded once to
        ``dtype``; the targets are drawn given the rounded features, so the stored data
        are an exact draw from the model. float64 output does not depend on this option.

    Returns
    -------
    Dataset
        Task ``"binary"``; attrs ``true_theta`` (list of D floats), ``generator``, ``seed``.
    """
    n, d, seed = _check_gen_args(n_rows, n_features, seed)
    x_dtype = _check_dtype(dtype)
    theta = _weights(_param_rng(seed, "logistic"), d, norm=1.5, bias_sd=0.5)

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for m, rng in _block_rngs(seed, "logistic", n):
            X = _stored(_features(rng, m, d, None), x_dtype)
            p = 0.5 * (1.0 + np.tanh(0.5 * (X @ theta)))  # sigmoid, overflow-free
            yield X, (rng.random(m) < p).astype(np.int64)

    return from_blocks(
        blocks(),
        path,
        n,
        d,
        task="binary",
        chunk_rows=chunk_rows,
        overwrite=overwrite,
        feature_names=_gen_names(d),
        storage_options=storage_options,
        dtype=x_dtype,
        attrs={"generator": "make_logistic", "seed": seed, "true_theta": theta},
    )


def make_softmax(
    path: str | os.PathLike[str],
    n_rows: int,
    n_features: int,
    n_classes: int,
    seed: int = 0,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    *,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Synthetic softmax-regression data, written chunk by chunk.

    ``x = (1, z)``, ``z ~ N(0, I_{D-1})``; ``y ~ Categorical(softmax(theta x))`` with
    ``theta`` of shape (K, D): each row has bias ``~ N(0, 0.5^2)`` and non-bias weights of
    a random direction with length 1.5.

    Parameters
    ----------
    path : str or os.PathLike
        Destination.
    n_rows, n_features : int
        N >= 1 and D >= 1 (including the bias column 0).
    n_classes : int
        K >= 2.
    seed : int, default 0
        Output depends only on (seed, n_rows, n_features, n_classes).
    chunk_rows : int, optional
        Rows per chunk.
    overwrite : bool, default False
        Replace an existing store.
    storage_options : dict, optional
        fsspec options for a URL ``path``.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X``. The features are drawn in float64 and rounded once to
        ``dtype``; the targets are drawn given the rounded features, so the stored data
        are an exact draw from the model. float64 output does not depend on this option.

    Returns
    -------
    Dataset
        Task ``"multiclass"``; attrs ``true_theta`` (K lists of D floats).
    """
    n, d, seed = _check_gen_args(n_rows, n_features, seed)
    x_dtype = _check_dtype(dtype)
    if isinstance(n_classes, bool) or not isinstance(n_classes, int | np.integer):
        raise ValueError(f"n_classes must be an integer, got {n_classes!r}")
    if n_classes < 2:
        raise ValueError(f"n_classes must be >= 2, got {n_classes}")
    k = int(n_classes)
    prng = _param_rng(seed, "softmax")
    theta = np.stack([_weights(prng, d, norm=1.5, bias_sd=0.5) for _ in range(k)])

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for m, rng in _block_rngs(seed, "softmax", n):
            X = _stored(_features(rng, m, d, None), x_dtype)
            eta = X @ theta.T
            eta -= eta.max(axis=1, keepdims=True)
            p = np.exp(eta)
            cdf = np.cumsum(p, axis=1)
            u = rng.random(m) * cdf[:, -1]
            y = np.minimum((cdf < u[:, None]).sum(axis=1), k - 1)
            yield X, y.astype(np.int64)

    return from_blocks(
        blocks(),
        path,
        n,
        d,
        task="multiclass",
        n_classes=k,
        chunk_rows=chunk_rows,
        overwrite=overwrite,
        feature_names=_gen_names(d),
        storage_options=storage_options,
        dtype=x_dtype,
        attrs={"generator": "make_softmax", "seed": seed, "true_theta": theta},
    )


def _robust(
    kind: str,
    path: str | os.PathLike[str],
    n_rows: int,
    n_features: int,
    seed: int,
    chunk_rows: int | None,
    overwrite: bool,
    nu: float,
    noise_scale: float,
    correlated: bool,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    n, d, seed = _check_gen_args(n_rows, n_features, seed)
    x_dtype = _check_dtype(dtype)
    if not (np.isfinite(nu) and nu > 0):
        raise ValueError(f"nu must be a positive finite number, got {nu!r}")
    if not (np.isfinite(noise_scale) and noise_scale > 0):
        raise ValueError(f"noise_scale must be a positive finite number, got {noise_scale!r}")
    prng = _param_rng(seed, kind)
    theta = _weights(prng, d, norm=2.0, bias_sd=1.0)
    chol = None
    extra: dict[str, Any] = {}
    if correlated and d > 1:
        # Correlation from a low-rank factor model plus noise, standardised exactly
        # (unit variances), like standardised cheminformatic descriptors.
        p = d - 1
        r = max(1, min(8, p))
        W = prng.standard_normal((p, r))
        C = W @ W.T + np.diag(prng.uniform(0.2, 1.0, p))
        s = np.sqrt(np.diag(C))
        C = C / np.outer(s, s)
        chol = np.linalg.cholesky(C)
        extra["feature_correlation_rank"] = r

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for m, rng in _block_rngs(seed, kind, n):
            X = _stored(_features(rng, m, d, chol), x_dtype)
            y = X @ theta + noise_scale * rng.standard_t(nu, m)
            yield X, y

    return from_blocks(
        blocks(),
        path,
        n,
        d,
        task="real",
        chunk_rows=chunk_rows,
        overwrite=overwrite,
        feature_names=_gen_names(d),
        storage_options=storage_options,
        dtype=x_dtype,
        attrs={
            "generator": f"make_{kind}" if kind == "robust" else "make_opv_like",
            "seed": seed,
            "true_theta": theta,
            "nu": float(nu),
            "noise_scale": float(noise_scale),
            **extra,
        },
    )


def make_robust(
    path: str | os.PathLike[str],
    n_rows: int,
    n_features: int,
    seed: int = 0,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    *,
    nu: float = 4.0,
    noise_scale: float = 1.0,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Synthetic robust-regression data with Student-t noise, written chunk by chunk.

    ``x = (1, z)``, ``z ~ N(0, I_{D-1})``; ``y = theta^T x + noise_scale * t_nu``. True
    ``theta``: bias ``~ N(0, 1)``, non-bias weights a random direction of length 2
    (signal variance 4 against noise variance ``noise_scale^2 * nu / (nu - 2)`` = 2).

    Parameters
    ----------
    path : str or os.PathLike
        Destination.
    n_rows, n_features : int
        N >= 1 and D >= 1 (including the bias column 0).
    seed : int, default 0
        Output depends only on the arguments other than ``chunk_rows``/``overwrite``.
    chunk_rows : int, optional
        Rows per chunk.
    overwrite : bool, default False
        Replace an existing store.
    nu : float, default 4.0
        Degrees of freedom of the noise.
    noise_scale : float, default 1.0
        Scale of the noise.
    storage_options : dict, optional
        fsspec options for a URL ``path``.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X``. The features are drawn in float64 and rounded once to
        ``dtype``; the targets are drawn given the rounded features, so the stored data
        are an exact draw from the model. float64 output does not depend on this option.

    Returns
    -------
    Dataset
        Task ``"real"``; attrs ``true_theta``, ``nu``, ``noise_scale``.
    """
    return _robust(
        "robust",
        path,
        n_rows,
        n_features,
        seed,
        chunk_rows,
        overwrite,
        nu,
        noise_scale,
        correlated=False,
        storage_options=storage_options,
        dtype=dtype,
    )


def make_opv_like(
    path: str | os.PathLike[str],
    n_rows: int = 1_800_000,
    n_features: int = 57,
    seed: int = 0,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    *,
    nu: float = 4.0,
    noise_scale: float = 1.0,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Synthetic robust regression in the shape of the paper's OPV experiment.

    As :func:`make_robust` (Student-t noise, nu = 4) but with 1.8M rows, 57 columns (bias +
    56) and correlated, standardised features: ``z ~ N(0, R)`` with ``R`` a random
    correlation matrix from a rank-8 factor model plus diagonal noise (unit variances).

    Parameters
    ----------
    path : str or os.PathLike
        Destination.
    n_rows : int, default 1_800_000
    n_features : int, default 57
        Including the bias column 0.
    seed : int, default 0
    chunk_rows : int, optional
    overwrite : bool, default False
    nu : float, default 4.0
    noise_scale : float, default 1.0
    storage_options : dict, optional
        fsspec options for a URL ``path``.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X``. The features are drawn in float64 and rounded once to
        ``dtype``; the targets are drawn given the rounded features, so the stored data
        are an exact draw from the model. float64 output does not depend on this option.

    Returns
    -------
    Dataset
        Task ``"real"``; attrs ``true_theta``, ``nu``, ``noise_scale``.
    """
    return _robust(
        "opv",
        path,
        n_rows,
        n_features,
        seed,
        chunk_rows,
        overwrite,
        nu,
        noise_scale,
        correlated=True,
        storage_options=storage_options,
        dtype=dtype,
    )
