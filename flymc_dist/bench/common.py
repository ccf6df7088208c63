"""Helpers shared by the benchmarks (:mod:`flymc_dist.bench`) and the ``flymc demo``."""

from __future__ import annotations

import logging
import os
from typing import Any

from flymc_dist.data import Dataset, open_dataset

__all__ = ["local_client", "reusable_store"]


def reusable_store(path: str, rows: int, features: int, **attrs: Any) -> Dataset | None:
    """The store an earlier benchmark run left at ``path``, if it holds these data: its
    shape, and every ``attrs`` item — the store's own attributes (``generator``, ``seed``)
    or one of its properties (``dtype`` by name, ``chunk_rows``; None: any). None when
    there is none, when it cannot be opened (incomplete), or when it differs."""
    if not os.path.exists(path):
        return None
    try:
        ds = open_dataset(path)
    except (ValueError, OSError, KeyError):
        return None
    if ds.n_rows != rows or ds.n_features != features:
        return None
    have = {"dtype": ds.dtype.name, "chunk_rows": ds.chunk_rows}
    for key, want in attrs.items():
        got = have[key] if key in have else ds.attrs.get(key)
        if want is not None and got != want:
            return None
    return ds


def local_client(workers: int) -> tuple[Any, Any]:
    """Start a LocalCluster like ``fd.sample(client=None)`` does, and a client for it.

    Worker processes with one thread each, no dashboard, quiet logs, and a client with
    ``direct_to_workers=True`` (actor calls go straight to the workers).

    Parameters
    ----------
    workers
        Number of worker processes.

    Returns
    -------
    client, cluster
        Close both when done (``client.close(); cluster.close()``).
    """
    from distributed import Client, LocalCluster

    # (the short connect timeout is set by each run's transport, for that run only)
    # No dashboard; the scheduler's bare HTTP server on a free port (":0"), so another
    # cluster holding the default port 8787 causes no warning.
    cluster = LocalCluster(
        n_workers=int(workers),
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        scheduler_kwargs={"dashboard_address": ":0"},
        silence_logs=logging.ERROR,
    )
    try:
        client = Client(cluster, direct_to_workers=True)
    except BaseException:
        cluster.close()
        raise
    return client, cluster
