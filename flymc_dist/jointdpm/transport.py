"""Where JointDPM's shards live: in this process (``client="synchronous"``) or as Dask
actors, one shard per actor, placed round-robin on the workers. Results always come
back keyed by shard id, so the driver combines them in shard order whatever the
placement. On a plain ``tcp://`` cluster an iteration's calls (:data:`CHANNEL_METHODS`)
travel on a socket of each shard's own (:class:`DPMHost`), the way FlyMC's rounds do
(:mod:`flymc_dist.transport.channel`); set-up, recovery and checkpoints go through Dask.

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
from flymc_dist.protocol import (
    ShardLost,
    WireError,
    pack_calls,
    pack_results,
    unpack_calls,
    unpack_results,
)
from flymc_dist.transport.channel import CALLS, ChannelClient, ChannelServer
from flymc_dist.transport.dask import channel_host, live_workers, local_client, plain_tcp

log = logging.getLogger(__name__)

#: recoveries tried for one call before the run gives up
MAX_RECOVERIES = 5
#: seconds to wait for a live worker to recreate lost shards on
LIVE_WAIT = 30.0
#: the shard methods an iteration calls with small messages (label moves, weight tests):
#: on a plain ``tcp://`` cluster they travel on a socket of each shard's own
#: (:mod:`flymc_dist.transport.channel`). Set-up, recovery, checkpoints and split–merge's
#: reads of whole clusters (O(N_k) rows a reply, past the channel's frame limit at scale)
#: go through Dask, as does a call whose request packs to more than
#: :data:`CHANNEL_BYTES` (a split's relabelling of a large cluster)
CHANNEL_METHODS = frozenset({"rows", "move", "batch", "counts"})
#: the largest request sent on the channel (a larger one goes through Dask)
CHANNEL_BYTES = 8 * 2**20
#: seconds a call on the channel may take before its shard is treated as lost
CHANNEL_TIMEOUT = 60.0


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


__all__ = ["CHANNEL_BYTES", "CHANNEL_METHODS", "DPMHost", "DPMTransport", "open_dpm_transport"]


class DPMHost(DPMShard):
    """A :class:`DPMShard` as a Dask actor that also serves :data:`CHANNEL_METHODS` on a
    socket of its own (:meth:`open_channel`): an actor call crosses Dask's RPC and two
    event loops each way (a few milliseconds), a channel call is one authenticated frame
    each way. Arguments and results travel as plain data and arrays
    (:func:`~flymc_dist.protocol.pack_calls`, :func:`~flymc_dist.protocol.pack_results`),
    never pickled; any other method, or another shard's id, is refused. The driver makes
    one call at a time per shard, so a channel call never runs beside an actor call."""

    _channel: ChannelServer | None = None

    def open_channel(self, host: str, secret: bytes) -> tuple[tuple[str, int], str | None]:
        """Serve :data:`CHANNEL_METHODS` on a socket of ``host`` to the driver holding the
        run's key ``secret`` (handed over through Dask); returns its address and local
        socket's name (as :meth:`flymc_dist.transport.host.ShardHost.open_channel`)."""
        self.close_channel()
        # held weakly by the server, which stops once Dask drops this actor
        self._channel = ChannelServer(self._serve_channel, host, secret)
        return self._channel.address, self._channel.local_name

    def _serve_channel(self, code: int, payload: bytes) -> list[bytes | memoryview]:
        if code != CALLS:
            raise ValueError(f"a JointDPM shard serves shard calls only, not code {code}")
        calls = unpack_calls(payload)
        if list(calls) != [self.shard_id]:
            raise WireError(f"calls for shards {sorted(calls)}, this is shard {self.shard_id}")
        method, args = calls[self.shard_id]
        if method not in CHANNEL_METHODS:
            raise WireError(f"{method!r} is not served on the channel")
        return pack_results({self.shard_id: getattr(self, method)(*args)})

    def close_channel(self) -> None:
        """Stop serving on the socket (if open)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None


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
        #: the channel to the shards (:class:`DPMHost`), on a plain ``tcp://`` cluster
        self.chan: ChannelClient | None = None
        if self.remote and plain_tcp(client, sorted(set(self.where.values()))):
            self.chan = ChannelClient()
            for i in self.shards:
                if self.chan is None:  # a shard's channel failed: Dask for every call
                    break
                self._connect(i)

    @property
    def channel(self) -> str:
        """How an iteration's calls travel: ``"in-process"``, ``"socket"`` or ``"dask"``."""
        if not self.remote:
            return "in-process"
        return "socket" if self.chan is not None else "dask"

    def _connect(self, i: int) -> None:
        """Open shard ``i``'s channel (through Dask, with the run's key) and connect to
        it; if that fails, every call goes through Dask from now on."""
        chan = self.chan
        try:
            address, local = (
                self.shards[i].open_channel(channel_host(self.where[i]), chan.secret).result()
            )
            chan.drop(f"shard-{i}")
            chan.connect(f"shard-{i}", address, chan.secret, timeout=10.0, local_name=local)
        except OSError as e:
            log.warning(
                "cannot reach JointDPM shard %d's channel (%r): calls go through Dask", i, e
            )
            chan.close()
            self.chan = None

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
            blobs = None
            if self.chan is not None and method in CHANNEL_METHODS:
                blobs = {i: pack_calls({i: (method, a)}) for i, a in pending.items()}
                if max(map(len, blobs.values()), default=0) > CHANNEL_BYTES:
                    blobs = None
            if blobs is not None:
                got, errors = self._on_channel(blobs)
            else:
                got, errors = self._on_dask(method, pending)
            out.update(got)
            for err in errors.values():
                if not _is_lost_host(err):
                    raise err
            if not errors:
                return out
            self.recover(sorted(errors))
            pending = {i: per_shard[i] for i in errors}
        raise ShardLost(f"giving up after {MAX_RECOVERIES} recoveries during {method!r}")

    def _on_dask(
        self, method: str, per_shard: dict[int, tuple]
    ) -> tuple[dict[int, Any], dict[int, BaseException]]:
        """``<method>(*args)`` as actor calls, all sent before any is waited for: results
        and failures by shard id."""
        calls = {i: getattr(self.shards[i], method)(*a) for i, a in per_shard.items()}
        out: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        for i, f in calls.items():
            try:
                out[i] = f.result()
            except Exception as err:  # noqa: BLE001 - sorted by the caller
                errors[i] = err
        return out, errors

    def _on_channel(
        self, blobs: dict[int, bytes]
    ) -> tuple[dict[int, Any], dict[int, BaseException]]:
        """Calls packed by :func:`~flymc_dist.protocol.pack_calls` (shard id → request) on
        the shards' channels (:meth:`ChannelClient.fanout_each`). Results and failures by
        id, as :meth:`_on_dask`."""
        payloads = {f"shard-{i}": blob for i, blob in blobs.items()}
        got, bad = self.chan.fanout_each(CALLS, payloads, CHANNEL_TIMEOUT)
        out: dict[int, Any] = {}
        for blob in got.values():
            out.update(unpack_results(blob))
        return out, {int(key.removeprefix("shard-")): e for key, e in bad.items()}

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
            if self.chan is not None:
                self._connect(i)
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
        """Drop the shards (their channels stop with them); close an embedded cluster."""
        if self.chan is not None:
            self.chan.close()
        self.shards = {}
        for thing in self.owned:
            thing.close()


def _submit(client: Any, args: tuple, worker: str) -> Any:
    """A :class:`DPMHost` actor made from ``args`` on ``worker`` (its future); the rows
    are scattered to ``worker`` first, not sent inside the task."""
    j, start, X, y, *rest = args
    Xf, yf = client.scatter([X, y], workers=[worker], hash=False)
    where = {"workers": [worker], "allow_other_workers": False}
    return client.submit(DPMHost, j, start, Xf, yf, *rest, actor=True, pure=False, **where)


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
