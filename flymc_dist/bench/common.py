"""Helpers shared by the benchmarks (:mod:`flymc_dist.bench`) and the ``flymc demo``."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["local_client"]


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
