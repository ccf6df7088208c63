"""Where JointDPM's shards live: in this process (``client="synchronous"``) or as Dask
actors, one shard per actor, placed round-robin on the workers. Results always come
back keyed by shard id, so the driver combines them in shard order whatever the
placement."""

from __future__ import annotations

from typing import Any

import numpy as np

from flymc_dist.jointdpm.shard import DPMShard
from flymc_dist.transport.dask import local_client

__all__ = ["DPMTransport", "open_dpm_transport"]


class DPMTransport:
    """The shards of one run, called by id.

    Parameters
    ----------
    shards
        Shard id -> the shard (a :class:`DPMShard`, or a Dask actor of one).
    remote
        Whether calls return futures (Dask actors).
    owned
        A client and cluster to close with the transport (an embedded LocalCluster).
    """

    def __init__(self, shards: dict[int, Any], remote: bool, owned: tuple = ()) -> None:
        self.shards = dict(sorted(shards.items()))
        self.remote = remote
        self.owned = owned
        self.round_trips = 0

    @property
    def name(self) -> str:
        """``"synchronous"`` or ``"dask"``."""
        return "dask" if self.remote else "synchronous"

    def call_some(self, method: str, per_shard: dict[int, tuple]) -> dict[int, Any]:
        """``<method>(*args)`` on each listed shard, all at once (one round trip)."""
        self.round_trips += 1
        calls = {i: getattr(self.shards[i], method)(*a) for i, a in per_shard.items()}
        if self.remote:
            return {i: f.result() for i, f in calls.items()}
        return calls

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """``<method>(*args)`` on every shard, in shard order."""
        out = self.call_some(method, {i: args for i in self.shards})
        return [out[i] for i in self.shards]

    def close(self) -> None:
        """Drop the shards; close an embedded cluster."""
        self.shards = {}
        for thing in self.owned:
            thing.close()


def open_dpm_transport(
    client: Any,
    X: np.ndarray,
    y: np.ndarray,
    bounds: np.ndarray,
    density_columns: list[int],
    chains: int,
    seed: int,
    n_workers: int | None = None,
) -> DPMTransport:
    """Open one shard per row range ``bounds[j] .. bounds[j + 1]``.

    Parameters
    ----------
    client
        ``"synchronous"`` (in this process), a ``distributed.Client``, or None (an
        embedded LocalCluster of ``n_workers`` workers, closed with the transport).
    X, y, bounds
        The rows, their labels and the shards' row ranges.
    density_columns, chains, seed
        As for :class:`DPMShard`.
    """
    args = [
        (j, int(a), X[a:b], y[a:b], density_columns, chains, seed)
        for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
    ]
    if isinstance(client, str) and client == "synchronous":
        return DPMTransport({a[0]: DPMShard(*a) for a in args}, remote=False)
    if client is not None and not hasattr(client, "submit"):
        raise ValueError(
            f"client must be 'synchronous', a distributed.Client or None, not {client!r}"
        )
    owned: tuple = ()
    if client is None:
        client, cluster = local_client(n_workers)
        owned = (client, cluster)
    try:
        workers = sorted(client.scheduler_info()["workers"])
        if not workers:
            raise RuntimeError("the Dask cluster has no workers")
        futures = {
            a[0]: client.submit(
                DPMShard,
                *a,
                actor=True,
                workers=[workers[a[0] % len(workers)]],
                allow_other_workers=False,
                pure=False,
            )
            for a in args
        }
        shards = {j: f.result() for j, f in futures.items()}
    except BaseException:
        for thing in owned:
            thing.close()
        raise
    return DPMTransport(shards, remote=True, owned=owned)
