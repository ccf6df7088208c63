"""Data sets from Dask collections (:func:`from_dask`) and from an ``(X, y)`` pair of zarr
arrays written by another tool (:func:`from_zarr`): read block by block, converted,
validated and written as :mod:`flymc_dist.data.ingest` does (with a client, each worker
writes its own whole chunks). Kept out of :mod:`flymc_dist.data`, which imports no Dask.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from flymc_dist.data.design import ColumnStats, Design
from flymc_dist.data.ingest import (
    block_rows,
    check_categorical,
    check_unique,
    resolve_target,
    task_of,
)
from flymc_dist.data.store import Dataset, check_dtype
from flymc_dist.data.write import check_chunk_rows, from_pieces

__all__ = ["from_dask", "from_zarr"]


def _part_stats(part: Any, target: str, cats: list[str], numeric: list[str]) -> ColumnStats:
    stats = ColumnStats()
    stats.update(_columns_of(part), target, cats, numeric)
    return stats


def _columns_of(part: Any) -> Any:
    """A partition (a pandas DataFrame, or a tuple ``(X_block, y_block)`` of arrays) as a
    mapping of columns."""
    if isinstance(part, tuple):
        Xb, yb = part
        Xb = np.asarray(Xb)
        cols = {str(j): Xb[:, j] for j in range(Xb.shape[1])}
        cols["y"] = np.asarray(yb)
        return cols
    return part


def _part_xy(part: Any, design: Design, offset: int) -> np.ndarray:
    cols = _columns_of(part)
    X = design.X(cols, None, offset)
    y = design.y(cols, None, offset)
    return np.column_stack([X, y])


class _SplitXY:
    """``(X, y)`` of a block ``[X | y]`` (the Dask path's pieces)."""

    def __call__(
        self, start: int, stop: int, payload: Any
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        block = np.asarray(payload)
        yield block[:, :-1], block[:, -1]


def from_dask(
    X: Any,
    y: Any,
    path: str | os.PathLike[str],
    *,
    target: str | None = None,
    categorical: Sequence[str] | None = None,
    standardize: bool = False,
    task: str | None = None,
    n_classes: int | None = None,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
    client: Any = None,
) -> Dataset:
    """Write a Dask array pair or a Dask DataFrame as a flymc_dist store.

    Parameters
    ----------
    X : dask.array.Array or dask.dataframe.DataFrame
        Features, ``(N, D)`` (with ``y``), or a DataFrame holding the features and the
        target column.
    y : dask.array.Array or None
        Targets ``(N,)`` for an array ``X``; None for a DataFrame.
    path : str or os.PathLike
        Destination (see :func:`~flymc_dist.data.from_numpy`).
    target : str, optional
        A DataFrame's y column (default: its last column).
    categorical, standardize
        As in :func:`ingest` (a DataFrame's columns).
    task, n_classes, chunk_rows, overwrite, storage_options, dtype
        As in :func:`~flymc_dist.data.from_numpy`.
    client : distributed.Client, optional
        Each worker computes, converts, validates and writes its own row ranges (whole
        chunks); without one, blocks are computed here one at a time.

    Returns
    -------
    Dataset
    """
    import dask
    import dask.array as da

    if not isinstance(standardize, bool):
        raise ValueError(f"standardize must be True or False, got {standardize!r}")
    if isinstance(X, da.Array):
        if y is None or not isinstance(y, da.Array):
            raise ValueError("y must be a Dask array when X is one")
        if X.ndim != 2 or y.ndim != 1:
            raise ValueError(f"X must be 2-D and y 1-D, got shapes {X.shape} and {y.shape}")
        if target is not None or categorical:
            raise ValueError("target and categorical apply to a Dask DataFrame")
        if any(np.isnan(c) for c in X.chunks[0]) or any(np.isnan(c) for c in y.chunks[0]):
            X, y = X.compute_chunk_sizes(), y.compute_chunk_sizes()
        if X.shape[0] != y.shape[0]:
            raise ValueError(f"X has {X.shape[0]} rows but y has {y.shape[0]} entries")
        y = y.rechunk((X.chunks[0],))
        X = X.rechunk({1: -1})
        parts = [
            dask.delayed(tuple)([xb, yb])
            for xb, yb in zip(X.to_delayed()[:, 0], y.to_delayed(), strict=True)
        ]
        columns = [str(j) for j in range(X.shape[1])]
        tgt, named = "y", False
    else:
        if not hasattr(X, "to_delayed") or not hasattr(X, "columns"):
            raise ValueError(f"X must be a Dask array or a Dask DataFrame, got {type(X).__name__}")
        if y is not None:
            raise ValueError("y must be None for a Dask DataFrame (name its column in target)")
        all_cols = [str(c) for c in X.columns]
        check_unique(all_cols, "the DataFrame")
        tgt = resolve_target(all_cols, target, True, "the DataFrame")
        columns = [c for c in all_cols if c != tgt]
        parts = list(X.to_delayed())
        named = True
    cats = check_categorical(categorical, columns, tgt)
    numeric = [c for c in columns if c not in cats] if standardize else []
    per_part = [dask.delayed(_part_stats)(p, tgt, cats, numeric) for p in parts]
    if client is not None:
        part_stats = client.gather(client.compute(per_part))
    else:
        part_stats = dask.compute(*per_part)
    stats = ColumnStats()
    for s in part_stats:
        stats = stats.merge(s)
    lengths = [s.n_rows for s in part_stats]
    n_rows = int(sum(lengths))
    if not n_rows:
        raise ValueError("the data set is empty (N = 0 rows)")
    design = Design.build(columns, tgt, stats, cats, standardize)
    task, n_classes = task_of(task, n_classes, stats)
    x_dtype = check_dtype(dtype)
    d = design.n_features
    chunk_rows = check_chunk_rows(chunk_rows, n_rows, d, x_dtype.itemsize)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    blocks = [
        da.from_delayed(
            dask.delayed(_part_xy)(p, design, int(off)), shape=(n, d + 1), dtype=np.float64
        )
        for p, off, n in zip(parts, offsets[:-1], lengths, strict=True)
        if n
    ]
    XY = da.concatenate(blocks, axis=0)
    per = max(chunk_rows, (block_rows(d + 1) // chunk_rows) * chunk_rows)
    XY = XY.rechunk(((per,) * (n_rows // per) + ((n_rows % per,) if n_rows % per else ()), d + 1))
    bounds = np.concatenate([[0], np.cumsum(XY.chunks[0])]).astype(int)
    pieces = ((int(bounds[i]), int(bounds[i + 1]), XY.blocks[i]) for i in range(len(XY.chunks[0])))
    return from_pieces(
        pieces,
        _SplitXY(),
        path,
        n_rows,
        d,
        task=task,
        n_classes=n_classes,
        chunk_rows=chunk_rows,
        feature_names=design.feature_names if named else None,
        attrs={"design": design.to_attrs()} if design.transformed else None,
        overwrite=overwrite,
        storage_options=storage_options,
        dtype=x_dtype,
        client=client,
    )


def from_zarr(
    X: Any,
    y: Any,
    path: str | os.PathLike[str],
    *,
    source_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Dataset:
    """Write an ``(X, y)`` pair of zarr arrays (written by another tool) as a flymc_dist
    store: the arrays are read block by block (see :func:`from_dask`).

    Parameters
    ----------
    X, y : zarr.Array or str
        The arrays, or their paths or fsspec URLs; ``X`` is ``(N, D)``, ``y`` ``(N,)``.
    path : str or os.PathLike
        Destination.
    source_options : dict, optional
        fsspec options for URL ``X`` and ``y``.
    **kwargs
        As in :func:`from_dask` (``standardize``, ``task``, ``chunk_rows``, ``client``...).

    Returns
    -------
    Dataset
    """
    import dask.array as da

    arrays = []
    for name, a in (("X", X), ("y", y)):
        if isinstance(a, str | os.PathLike):
            try:
                a = da.from_zarr(os.fspath(a), storage_options=source_options)
            except Exception as e:  # noqa: BLE001 - zarr raises several kinds
                raise ValueError(
                    f"cannot open {name} at {os.fspath(a)!r} as a zarr array: {e}"
                ) from e
        else:
            a = da.from_zarr(a)
        arrays.append(a)
    return from_dask(arrays[0], arrays[1], path, **kwargs)
