"""Ingest: a ``.npy``, ``.npz`` or ``.csv`` file into a validated data set (:func:`ingest`).

The whole file is read and validated before anything is written; writing is
:func:`flymc_dist.data.write.from_numpy`'s (atomic).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import numpy as np

from flymc_dist.data.store import Dataset, _check_dtype
from flymc_dist.data.write import from_numpy

__all__ = ["ingest"]

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
            X, y = _npz_array(f, src, "X"), _npz_array(f, src, "y")
            names = (
                [str(v) for v in _npz_array(f, src, "feature_names")]
                if "feature_names" in f.files
                else None
            )
    except (OSError, EOFError) as e:
        raise ValueError(f"cannot read {src!r} as a .npz archive: {e}") from e
    return X, y, names


def _npz_array(f: Any, src: str, key: str) -> np.ndarray:
    """Array ``key`` of the open .npz ``f``; an array numpy cannot load without pickle
    (object dtype: Python objects, never read here) is refused naming the file and the
    array."""
    try:
        return f[key]
    except ValueError as e:
        raise ValueError(
            f"{src!r}: array {key!r} cannot be read without unpickling Python objects "
            f"(object dtype; {e}): save it as a numeric array (or, for names, strings)"
        ) from None


def _ingest_csv(
    src: str, target: Any, has_header: bool | None = None
) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
    with open(src, newline="") as fh:
        reader = csv.reader(fh)
        try:
            first = [h.strip() for h in next(reader)]
        except StopIteration:
            raise ValueError(f"{src!r} is empty (expected a header row or data)") from None
        if len(first) < 2:
            raise ValueError(f"{src!r}: needs at least 2 columns (features + target)")
        # a first line of numbers only is data, not a header (the columns are then unnamed),
        # unless said otherwise; 0,1,...,k-1 (the column labels pandas writes for a frame
        # without names) could be either: refused unless said
        numeric = all(_is_float(c) for c in first)
        if has_header is None and numeric and first == [str(i) for i in range(len(first))]:
            raise ValueError(
                f"{src!r}: its first line, {','.join(first)}, may be a header (the column "
                "labels pandas writes for unnamed columns) or a row of data: say which, with "
                "header=True or header=False (flymc ingest --header or --no-header)"
            )
        if has_header is False and not numeric:
            bad = next(c for c in first if not _is_float(c))
            raise ValueError(
                f"{src!r} line 1: non-numeric value {bad!r}, and header=False says it is data"
            )
        header: list[str] | None = (
            first if has_header or (has_header is None and not numeric) else None
        )
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
    header: bool | None = None,
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
          and ``target`` is a column index; ``0,1,…,k−1`` (what pandas writes for unnamed
          columns) is refused as ambiguous unless ``header`` says which it is.
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
    header : bool, optional
        ``.csv`` only: whether the first line is a header (True) or data (False); by
        default, a header unless it is numbers only (see above).

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
    if header is not None and (not isinstance(header, bool) or ext != ".csv"):
        raise ValueError(f"header applies to a .csv file only, as True or False, got {header!r}")
    if ext == ".npy":
        X, y, names = _ingest_npy(src, target)
    elif ext == ".npz":
        X, y, names = _ingest_npz(src, target)
    elif ext == ".csv":
        X, y, names = _ingest_csv(src, target, header)
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
