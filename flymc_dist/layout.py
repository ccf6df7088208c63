"""Where the rows live: the shard layout of a data set (or of an in-memory ``(X, y)``
pair), shared by every algorithm's set-up.

The layout follows the cluster: by default one shard per worker. It never changes the
draws (every random number is keyed by row, :mod:`flymc_dist.streams`, and full passes
sum by fixed blocks, :mod:`flymc_dist.reduce`), only the cost. Shards are cut at block
boundaries: a store's chunks, or :func:`flymc_dist.reduce.block_rows` rows in memory."""

from __future__ import annotations

from typing import Any

import numpy as np

from flymc_dist.data import Dataset, open_dataset
from flymc_dist.options import Placement
from flymc_dist.protocol import ShardSpec
from flymc_dist.reduce import block_rows

__all__ = ["shard_layout"]


def shard_layout(
    data: Any, placement: Placement, n_workers: int = 1
) -> tuple[list[ShardSpec], dict | None, int, int, str, int | None, str]:
    """The shards of ``data``: their specs, and the rows themselves for an ``(X, y)`` pair.

    Parameters
    ----------
    data
        A :class:`~flymc_dist.data.Dataset`, a store path, or an in-memory ``(X, y)``.
    placement
        Its ``n_shards`` or ``rows_per_shard`` (neither: ``n_workers`` shards).
    n_workers
        The workers the shards will be placed on (the default's number of shards).

    Returns
    -------
    specs, mem, n_rows, n_features, task, n_classes, path
        The shard specs (those of a store carry its ``storage_options``), the rows of each
        in-memory shard by shard id (None for a store), N, D, the task (``"binary"``,
        ``"multiclass"`` or ``"real"``), the number of classes (or None) and where the
        data live (``"<in memory>"`` for an ``(X, y)`` pair).
    """
    n_shards, rows_per_shard = placement.n_shards, placement.rows_per_shard
    if n_shards is None and rows_per_shard is None:
        n_shards = max(1, int(n_workers))
    if isinstance(data, tuple):
        X, y = data
        X = np.asarray(X, float)
        y = np.asarray(y)
        if X.ndim != 2 or y.ndim != 1 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
            raise ValueError(f"(X, y) must be (N, D) and (N,) with N > 0; got {X.shape}, {y.shape}")
        if not (np.all(np.isfinite(X)) and np.all(np.isfinite(y.astype(float)))):
            raise ValueError("X and y must be finite")
        N = X.shape[0]
        B = block_rows(N)
        n_blocks = -(-N // B)
        k = n_shards or max(1, round(N / rows_per_shard))
        # whole blocks, spread as evenly as possible
        edges = np.minimum(np.linspace(0, n_blocks, min(k, n_blocks) + 1).astype(int) * B, N)
        specs = [
            ShardSpec(i, "", int(a), int(b))
            for i, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=True))
        ]
        mem = {s.shard_id: (X[s.start : s.stop], y[s.start : s.stop]) for s in specs}
        integer = bool(np.all(np.mod(y, 1) == 0)) if y.dtype.kind != "b" else True
        if integer and set(np.unique(y).tolist()) <= {0, 1}:
            task, k = "binary", 2
        elif integer and y.min() >= 0:
            task, k = "multiclass", int(y.max()) + 1
        else:
            task, k = "real", None
        return specs, mem, N, X.shape[1], task, k, "<in memory>"

    ds = data if isinstance(data, Dataset) else open_dataset(str(data))
    ranges = ds.shard_ranges(n_shards=n_shards, rows_per_shard=rows_per_shard)
    # the workers open the store exactly as the driver did (endpoint, credentials, ...)
    specs = [
        ShardSpec(i, ds.path, a, b, ds.storage_options, ds.store_id)
        for i, (a, b) in enumerate(ranges)
    ]
    return specs, None, ds.n_rows, ds.n_features, ds.task, ds.n_classes, ds.path
