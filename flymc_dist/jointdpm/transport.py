"""Where JointDPM's shards live: in this process (``client="synchronous"``) or as Dask
actors, one shard per actor, placed round-robin on the workers. Results always come
back keyed by shard id, so the driver combines them in shard order whatever the
placement.

A shard whose worker is lost (its calls fail with a broken connection) is recreated on a
live worker from the rows the transport kept, and set back to its labels by the calls
:attr:`DPMTransport.on_recreate` names (the driver knows every row's label: see
:meth:`flymc_dist.jointdpm.sampler.JointDPMSampler.restore_calls`); then the failed call
is made again on it. Every shard call is idempotent (reads, or labels set to values), so
a call repeated on a restored shard changes nothing else."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from flymc_dist.jointdpm.shard import DPMShard
from flymc_dist.protocol import ShardLost
from flymc_dist.transport.dask import live_workers, local_client

log = logging.getLogger(__name__)

#: recoveries tried for one call before the run gives up
MAX_RECOVERIES = 5
#: seconds to wait for a live worker to recreate lost shards on
LIVE_WAIT = 30.0


def _is_lost_host(err: BaseException) -> bool:
    """Whether an actor call's failure is its worker gone (not an error of the call)."""
    return isinstance(err, OSError | TimeoutError) or type(err).__name__ in (
        "CommClosedError",
        "StreamClosedError",
        "RPCClosed",
        "FutureCancelledError",
        "CancelledError",
        "KilledWorker",
    )


__all__ = ["DPMTransport", "open_dpm_transport"]


class DPMTransport:
    """The shards of one run, called by id.

    Parameters
    ----------
    shards
        Shard id -> the shard (a :class:`DPMShard`, or a Dask actor of one).
    client
        The Dask client of actor shards (None in process).
    args
        Shard id -> the arguments that make the shard (to recreate a lost one).
    where
        Shard id -> the worker holding it (actor shards).
    owned
        A client and cluster to close with the transport (an embedded LocalCluster).
    """

    def __init__(
        self,
        shards: dict[int, Any],
        client: Any = None,
        args: dict[int, tuple] | None = None,
        where: dict[int, str] | None = None,
        owned: tuple = (),
    ) -> None:
        self.shards = dict(sorted(shards.items()))
        self.client = client
        self.remote = client is not None
        self.args = dict(args or {})
        self.where = dict(where or {})
        self.owned = owned
        self.round_trips = 0
        #: shard id -> the calls ``(method, args)`` that give a recreated shard its state
        self.on_recreate: Callable[[int], list[tuple[str, tuple]]] | None = None
        #: one record per recovery: lost workers, shards, seconds, time
        self.recoveries: list[dict[str, Any]] = []

    @property
    def name(self) -> str:
        """``"synchronous"`` or ``"dask"``."""
        return "dask" if self.remote else "synchronous"

    def call_some(self, method: str, per_shard: dict[int, tuple]) -> dict[int, Any]:
        """``<method>(*args)`` on each listed shard, all at once (one round trip); shards
        lost on the way are recreated and asked again."""
        self.round_trips += 1
        if not self.remote:
            return {i: getattr(self.shards[i], method)(*a) for i, a in per_shard.items()}
        out: dict[int, Any] = {}
        pending = dict(per_shard)
        for _attempt in range(MAX_RECOVERIES + 1):
            calls = {i: getattr(self.shards[i], method)(*a) for i, a in pending.items()}
            failed = []
            for i, f in calls.items():
                try:
                    out[i] = f.result()
                except Exception as err:  # noqa: BLE001 - sorted by _is_lost_host
                    if not _is_lost_host(err):
                        raise
                    failed.append(i)
            if not failed:
                return out
            self.recover(failed)
            pending = {i: per_shard[i] for i in failed}
        raise ShardLost(f"giving up after {MAX_RECOVERIES} recoveries during {method!r}")

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """``<method>(*args)`` on every shard, in shard order."""
        out = self.call_some(method, {i: args for i in self.shards})
        return [out[i] for i in self.shards]

    def recover(self, ids: list[int]) -> None:
        """Recreate shards ``ids`` (and any other shard of their workers) on live workers
        from their rows, and give them their state by :attr:`on_recreate`'s calls."""
        t0 = time.perf_counter()
        lost = sorted({self.where[i] for i in ids})
        orphans = sorted(i for i, w in self.where.items() if w in lost)
        for i in orphans:
            self.shards.pop(i, None)
        deadline = time.monotonic() + LIVE_WAIT
        while True:
            live = [w for w in sorted(self.client.scheduler_info()["workers"]) if w not in lost]
            if live:
                break
            if time.monotonic() > deadline:
                raise ShardLost(f"no live worker left to recreate shards {orphans} on", lost)
            time.sleep(0.2)
        for n, i in enumerate(orphans):
            target = live[n % len(live)]
            actor = _submit(self.client, self.args[i], target).result()
            for method, a in self.on_recreate(i) if self.on_recreate else []:
                getattr(actor, method)(*a).result()
            self.shards[i], self.where[i] = actor, target
        self.shards = dict(sorted(self.shards.items()))
        event = {
            "lost_workers": lost,
            "shards": orphans,
            "seconds": time.perf_counter() - t0,
            "time": time.time(),
        }
        self.recoveries.append(event)
        log.warning(
            "lost worker(s) %s: recreated JointDPM shards %s with their labels (%.2f s)",
            lost,
            orphans,
            event["seconds"],
        )

    def close(self) -> None:
        """Drop the shards; close an embedded cluster."""
        self.shards = {}
        for thing in self.owned:
            thing.close()


def _submit(client: Any, args: tuple, worker: str) -> Any:
    """A :class:`DPMShard` actor made from ``args`` on ``worker`` (its future); the rows
    are scattered to ``worker`` first, not sent inside the task."""
    j, start, X, y, *rest = args
    Xf, yf = client.scatter([X, y], workers=[worker], hash=False)
    where = {"workers": [worker], "allow_other_workers": False}
    return client.submit(DPMShard, j, start, Xf, yf, *rest, actor=True, pure=False, **where)


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
        return DPMTransport({a[0]: DPMShard(*a) for a in args})
    if client is not None and not hasattr(client, "submit"):
        raise ValueError(
            f"client must be 'synchronous', a distributed.Client or None, not {client!r}"
        )
    owned: tuple = ()
    if client is None:
        client, cluster = local_client(n_workers)
        owned = (client, cluster)
    try:
        workers = live_workers(client)
        where = {a[0]: workers[a[0] % len(workers)] for a in args}
        futures = {a[0]: _submit(client, a, where[a[0]]) for a in args}
        shards = {j: f.result() for j, f in futures.items()}
    except BaseException:
        for thing in owned:
            thing.close()
        raise
    return DPMTransport(shards, client, {a[0]: a for a in args}, where, owned)
