"""Connecting to Dask and placing shard actors on workers.

``client=None`` starts an embedded :class:`distributed.LocalCluster` (worker
processes, one thread each) and closes it afterwards; a :class:`distributed.Client`
is used as it is; a string is a scheduler address (``tcp://…``, ``tls://…``) or the
path of a scheduler file.

Each worker holds one :class:`~flymc_dist.shard.ShardHost` actor with a contiguous
block of shards, which open their own rows from the zarr store: no data rows pass
through the client. A round trip is one ``actor_execute`` RPC per worker, all sent
concurrently from one coroutine (one hop into the client's event loop per round
trip) with a deadline, so a dead worker is noticed at once (its connection fails)
or, at worst, after ``timeout`` seconds.

Faults: when a host fails, its shards are recreated on live workers from the
store, every chain's z on them is redrawn exactly from ``p(z | θ_current)`` (a
valid Gibbs move on that auxiliary block, so the chains stay exact), and the round
is replayed — the surviving shards answer a replayed round from their cache
(:meth:`Shard.round` is idempotent in its sequence number).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from flymc_dist.options import Placement
from flymc_dist.protocol import (
    Ahead,
    Proposals,
    ReplicaReply,
    ReplicaRound,
    Reply,
    Round,
    SchedulerLost,
    ShardConfig,
    ShardLost,
    ShardSpec,
    WireError,
    pack_ahead,
    pack_calls,
    pack_round,
    unpack_arrays,
    unpack_proposals,
    unpack_reply,
    unpack_results,
)
from flymc_dist.shard.shared import LENDING, LentRows
from flymc_dist.shard.state import propose
from flymc_dist.transport.channel import (
    AHEAD,
    CALLS,
    ECHO,
    ROUND,
    ROUND_TREE,
    ChannelClient,
    ChannelError,
    HostsLost,
    check_channel,
)
from flymc_dist.transport.host import ShardHost
from flymc_dist.transport.inprocess import InProcessTransport

log = logging.getLogger("flymc_dist")


class _AheadHandle(NamedTuple):
    """A read-ahead request posted (:meth:`DaskTransport.post_ahead`): how it travels
    (``"socket"``: :class:`_Prepared`; ``"dask"``: a future of the actor calls'
    answers), to which workers, and the ``prepare`` to apply to the answers."""

    how: str
    workers: list[str]
    pending: Any
    prepare: Callable[[list[Proposals]], Any]


class _Prepared:
    """A read-ahead request's answers (``read``, a future) made into what the driver
    takes (``finish``), once: on the transport's building thread when the answers come
    before the driver asks (:meth:`unasked`: the driver computes meanwhile), else by the
    driver itself as it asks (:meth:`result`: it would only wait, and its own CPU is
    free then while the building thread's may be the hosts')."""

    def __init__(self, read: Future, finish: Callable[[Any], Any]) -> None:
        self._read, self._finish = read, finish
        self._lock = threading.Lock()
        self._claimed = self._asked = False
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _claim(self) -> bool:
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed

    def _build(self) -> None:
        try:
            self._value = self._finish(self._read.result())
        except BaseException as e:  # noqa: BLE001 - raised where the driver asks
            self._error = e
        finally:
            self._done.set()

    def unasked(self) -> None:
        """The building thread's part: once the answers are in, build unless the driver
        has asked (then it builds)."""
        with contextlib.suppress(BaseException):  # the driver meets it in result()
            self._read.result()
        if not self._asked and self._claim():
            self._build()

    def drop(self) -> None:
        """Wait for the answers (not for what is built of them) and build nothing more."""
        self._asked = True
        with contextlib.suppress(BaseException):  # dropped with the answers
            self._read.result()

    def result(self) -> Any:
        """``finish(answers)``: built here unless the building thread has begun."""
        self._asked = True
        if self._claim():
            self._build()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


def _scheduler_workers(client: Any) -> dict[str, dict]:
    """The scheduler's workers; :class:`SchedulerLost` if the client lost its scheduler
    (a closed client's ``scheduler_info()`` has no ``"workers"``)."""
    status = getattr(client, "status", "running")
    info = client.scheduler_info() if status == "running" else {}
    workers = info.get("workers") if isinstance(info, dict) else None
    if status != "running" or workers is None:
        try:
            address = client.scheduler.address
        except Exception:  # noqa: BLE001 - only for the message
            address = "?"
        raise SchedulerLost(
            f"the Dask scheduler {address} was lost (the client's connection "
            f"to it is {status!r}); the run cannot go on without it"
        )
    return workers


def live_workers(client: Any, timeout: float = 60.0) -> list[str]:
    """The addresses of the scheduler's workers, sorted, waiting up to ``timeout`` seconds
    for a first one where there is none yet (a cluster just started may list none)."""
    workers = sorted(_scheduler_workers(client))
    if not workers:
        client.wait_for_workers(1, timeout=timeout)
        workers = sorted(_scheduler_workers(client))
    return workers


#: calls run inline on the worker's event loop with raw ``bytes`` arguments: the per-iteration
#: protocol (short: FlyMC's rounds touch the bright rows only) and the bench's bare round trips.
#: Regular MCMC's rounds are full passes over the shard and stay on the actor thread, so a
#: worker's event loop (heartbeats, other clients) never blocks for a whole pass.
INLINE = ("round_packed", "echo", "ping")

#: seconds between the scheduler's answers on which workers it still has, while calls to
#: workers are pending (:meth:`DaskTransport.fanout_calls`)
LIVENESS_POLL = 1.0

#: set-up calls that change a shard's state; replayed, in order, on recreated shards so
#: that they rejoin with the same tight points (hence the same collapsed bound) and q
#: (and exact rows: their rule before the tight points it changes)
REPLAYED = ("set_exact_rows", "set_tight_points", "set_q", "set_replica")


def local_cluster(
    n_workers: int | None = None,
    *,
    memory_limit: str | int | float | None = "auto",
    silence_logs: int = logging.ERROR,
) -> Any:
    """The embedded cluster: what ``fd.sample(client=None)`` runs on.

    The one recipe of a :class:`distributed.LocalCluster` in flymc_dist (the sampler's,
    the benchmarks', the examples', the deploy scripts' ``--local``): worker processes
    with one thread each (BLAS is single-threaded too: the shards' work is many small
    products), no dashboard (the scheduler's bare HTTP server on a free port, so that
    another cluster holding the default port 8787 causes no warning), quiet logs, and
    Dask's statistical profiler off in the workers it starts: it samples every thread's
    stack 100 times a second for a dashboard this cluster does not have, and took half of
    an idle worker's CPU (2 workers: 0.035 of a core each with it, 0.018 without).

    Parameters
    ----------
    n_workers
        Worker processes; None: the machine's cores, at most 8.
    memory_limit
        Each worker's memory limit, as :class:`distributed.LocalCluster` takes it
        (``"auto"``: the machine's memory shared out; None or 0: none).
    silence_logs
        The level below which the cluster's log records are dropped.

    Returns
    -------
    distributed.LocalCluster
        Started; close it when done (or use it in a ``with`` statement).
    """
    import dask
    from distributed import LocalCluster

    # the nannies take the configuration as it is when they are made, and give it to
    # their workers (a restarted worker's too)
    with dask.config.set({"distributed.worker.profile.enabled": False}):
        return LocalCluster(
            n_workers=int(n_workers or max(1, min(os.cpu_count() or 1, 8))),
            threads_per_worker=1,
            processes=True,
            memory_limit=memory_limit,
            dashboard_address=None,
            scheduler_kwargs={"dashboard_address": ":0"},
            silence_logs=silence_logs,
        )


def local_client(
    n_workers: int | None = None,
    *,
    memory_limit: str | int | float | None = "auto",
    silence_logs: int = logging.ERROR,
) -> tuple[Any, Any]:
    """:func:`local_cluster` and a client for it with ``direct_to_workers=True`` (actor
    calls go straight to the workers). The short connect timeout is set by each run's
    transport, for that run only.

    Returns
    -------
    client, cluster
        Close both when done (``client.close(); cluster.close()``, or ``with cluster,
        client:``).
    """
    from distributed import Client

    cluster = local_cluster(n_workers, memory_limit=memory_limit, silence_logs=silence_logs)
    try:
        client = Client(cluster, direct_to_workers=True)
    except BaseException:
        cluster.close()
        raise
    return client, cluster


def client_from(client: Any, n_workers: int | None) -> tuple[Any, Any, bool]:
    """Return ``(client, cluster_or_None, owned)``."""
    from distributed import Client

    if client is None:
        _check_main_guard()
        return (*local_client(n_workers), True)
    if isinstance(client, Client):
        return client, None, False
    if isinstance(client, str):
        if "://" in client:
            return Client(client, direct_to_workers=True), None, True
        if os.path.exists(client):
            return Client(scheduler_file=client, direct_to_workers=True), None, True
        raise ValueError(
            f"client {client!r} is neither a scheduler address (tcp://…, "
            f"tls://…) nor an existing scheduler file"
        )
    raise TypeError(
        f"client must be None, 'synchronous', a distributed.Client, an address or "
        f"a scheduler file, not {type(client).__name__}"
    )


def _is_main_guard(node: ast.stmt) -> bool:
    """Whether ``node`` is ``if __name__ == "__main__":`` (either way round)."""
    if not (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and len(node.test.ops) == 1
        and isinstance(node.test.ops[0], ast.Eq)
    ):
        return False
    sides = [node.test.left, *node.test.comparators]
    return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
        isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
    )


def _check_main_guard() -> None:
    """Refuse to start a LocalCluster from the unguarded top level of a script.

    Dask starts worker processes with ``spawn``, which imports the main script again in
    each of them: a call at the script's top level then runs again in every worker, and
    each fails to start a cluster of its own (hundreds of lines of tracebacks ending in
    "Nanny failed to start"). Detected before anything starts: the line of the script
    being run is not inside ``if __name__ == "__main__":``.
    """
    import dask

    if dask.config.get("distributed.worker.multiprocessing-method", "spawn") == "fork":
        return
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if not script or not os.path.isfile(script):
        return  # an interactive session or python -c: nothing is imported again
    frame = sys._getframe(1)
    line = None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            line = frame.f_lineno
        frame = frame.f_back
    if line is None:
        return
    try:
        with open(script, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return
    for node in tree.body:
        if _is_main_guard(node) and node.lineno <= line <= (node.end_lineno or line):
            return
    raise RuntimeError(
        f"fd.sample(client=None) starts Dask worker processes, which import {script} again "
        "and would run this call again in each: put the code that calls it under "
        '`if __name__ == "__main__":` (or pass client="synchronous" or a Client)'
    )


def open_transport(
    client: Any,
    specs: list[ShardSpec] | Callable[[int], list[ShardSpec]],
    config: ShardConfig,
    mem: dict | None,
    placement: Placement,
) -> Any:
    """The transport for ``client`` (see :func:`flymc_dist.sample`); ``specs`` may be
    the layout for a number of workers (the default layout: one shard per worker);
    ``placement`` says how Dask is used (see :class:`DaskTransport`)."""
    if isinstance(client, str) and client == "synchronous":
        return InProcessTransport(specs(1) if callable(specs) else specs, config, mem)
    if mem is not None:
        raise ValueError(
            "in-memory (X, y) data runs only with client='synchronous'; write it "
            "to a store with fd.from_numpy to use a cluster"
        )
    return DaskTransport(client, specs, config, placement)


#: each level of the relay tree waits this fraction of its parent's timeout for its
#: children, so that a relay names a lost child before its own parent gives it up
RELAY_PATIENCE = 0.9


def relay_tree(hosts: list[str], fanout: int) -> tuple[list[str], dict[str, list[str]]]:
    """The tree shard-evaluated rounds travel down: ``hosts`` (in shard order) cut into at
    most ``fanout`` contiguous groups, the first host of each the relay of the rest, cut
    the same way below it. Every subtree holds consecutive shards (a relay's partial sum
    then merges most of the block tree), and its depth is about log_fanout W.

    Returns
    -------
    top, children
        The hosts the driver sends a round to, and each host's children (in order).
    """
    children: dict[str, list[str]] = {}

    def split(group: list[str]) -> list[str]:
        heads = []
        for part in np.array_split(np.arange(len(group)), min(fanout, len(group))):
            head = group[part[0]]
            children[head] = split([group[i] for i in part[1:]]) if len(part) > 1 else []
            heads.append(head)
        return heads

    return (split(list(hosts)) if hosts else []), children


def channel_host(worker: str) -> str:
    """The interface a worker's round channel listens on: the host of its address."""
    from distributed.comm.addressing import get_address_host

    return get_address_host(worker)


def plain_tcp(client: Any, workers: list[str]) -> bool:
    """Whether the scheduler and ``workers`` are all reached over plain ``tcp://``: only
    then may the round channel (plain TCP too) carry what Dask's comms would."""
    addresses = [*workers, str(getattr(client.scheduler, "address", ""))]
    return all(a.startswith("tcp://") for a in addresses)


def _lent_rows(body: bytes, fds: list[int], specs: list[ShardSpec]) -> list[LentRows]:
    """The rows a host lent (:meth:`~flymc_dist.transport.host.ShardHost.lend_rows`),
    mapped here; a ``ValueError`` (every descriptor closed) unless they are the shards
    ``specs`` it holds, two descriptors each."""
    done: list[LentRows] = []
    try:
        meta, _ = unpack_arrays(body)
        if not (isinstance(meta, tuple) and len(meta) == 2 and meta[0] == "lent"):
            raise WireError("not a description of lent rows")
        metas = meta[1]
        if not isinstance(metas, (list, tuple)) or len(fds) != 2 * len(metas):
            raise ValueError(f"{len(fds)} descriptors for the rows of {len(metas)} shards")
        for k, m in enumerate(metas):
            part, fds[2 * k : 2 * k + 2] = fds[2 * k : 2 * k + 2], [-1, -1]
            done.append(LentRows(m, part))
        held = sorted((s.shard_id, s.start, s.stop - s.start) for s in specs)
        if sorted((r.shard_id, r.start, r.n) for r in done) != held:
            raise ValueError("the rows lent are not the shards the host holds")
        return done
    except BaseException:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        for r in done:
            r.close()
        raise


def _proposals_of(rows: LentRows, msg: Ahead) -> Proposals:
    """A lent shard's answer to the read-ahead request ``msg``, drawn and gathered here
    (:func:`~flymc_dist.shard.state.propose`: the host's own function, on its bytes)."""
    return propose(
        rows.rows_and_constants,
        rows.seed,
        rows.chains,
        rows.q,
        rows.n_total,
        rows.start,
        rows.n,
        rows.stored,
        msg,
    )


class DaskTransport:
    """Shard hosts as Dask actors, one per worker.

    Parameters
    ----------
    client
        See :func:`client_from`.
    specs, config
        The shards and their configuration.
    placement
        Its ``n_workers`` (of an embedded LocalCluster; None: the machine's cores, at
        most 8), ``timeout`` (seconds a single round trip may take before its host is
        declared lost) and ``channel``: how the per-iteration rounds travel.
        ``"socket"``: a direct connection to each host
        (:mod:`flymc_dist.transport.channel`), set up through Dask — a local socket to a
        host on the driver's machine, TCP to the others; ``"tcp"``: the same, TCP to
        every host (as if none were on this machine); ``"dask"``: Dask's actor RPC;
        ``"auto"``: ``"socket"``. Only on a cluster reached over plain ``tcp://``: with
        TLS the rounds stay on Dask's authenticated, encrypted connections whatever
        ``channel`` says (logged when it says ``"socket"`` or ``"tcp"``).
        Set-up, recovery and every other call always go through Dask. None: the
        defaults of :class:`~flymc_dist.options.Placement`.
    """

    name = "dask"

    def __init__(
        self,
        client: Any,
        specs: list[ShardSpec] | Callable[[int], list[ShardSpec]],
        config: ShardConfig,
        placement: Placement | None = None,
    ) -> None:
        placement = Placement() if placement is None else placement
        n_workers, timeout = placement.n_workers, placement.timeout
        #: the relay tree's fanout (0: none), its top hosts and each host's children and
        #: channel address as last handed over (None: to be built, see :meth:`_relay_top`)
        self.fanout = placement.fanout
        self._top: list[str] | None = None
        self._children_sent: dict[str, list[tuple[str, tuple[str, int]]]] = {}
        self._addresses: dict[str, tuple[str, int]] = {}
        self._channel_mode = check_channel(placement.channel)
        import dask

        # a short connect timeout (a dead worker must not stall a call for ~30 s), for this
        # run's connections only: restored by close()
        self._dask_config = dask.config.set({"distributed.comm.timeouts.connect": "5s"})
        try:
            self.client, self.cluster, self.owned = client_from(client, n_workers)
        except BaseException:
            self._dask_config.__exit__(None, None, None)
            raise
        #: the layout for a number of workers, when it follows the cluster
        self._layout = specs if callable(specs) else None
        self.specs = [] if callable(specs) else sorted(specs, key=lambda s: s.shard_id)
        self.config = config
        self.timeout = timeout
        # FlyMC's rounds are short and run inline; regular MCMC's are full passes
        self._inline = (
            set(INLINE) if config.algorithm == "flymc" else set(INLINE) - {"round_packed"}
        )
        self.round_trips = 0
        #: requests sent to each host so far (every call, round and read-ahead: the one
        #: count of messages, whichever way they travel)
        self.messages: dict[str, int] = {}
        self.recoveries: list[dict[str, Any]] = []
        self.generation = 0
        self._futures: dict[str, Any] = {}  # worker -> actor future (keeps the actor alive)
        self._keys: dict[str, str] = {}  # worker -> actor key
        self.placement: dict[str, list[ShardSpec]] = {}
        self._replay: list[tuple[str, tuple, dict]] = []
        self._chan: ChannelClient | None = None
        #: the threads read-ahead requests are sent and answered on, and their answers
        #: made into what the driver takes on (socket channel), in the order posted
        self._ahead_threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        #: the rows hosts on this machine lend the driver (:meth:`borrow_rows`), by worker
        self._lent: dict[str, list[LentRows]] = {}
        started: list[tuple[str, list[ShardSpec], str, Any]] = []
        try:
            workers = live_workers(self.client)
            self._chan = self._channel_client(workers)
            if self._layout is not None:  # the default layout: one shard per worker
                self.specs = sorted(self._layout(len(workers)), key=lambda s: s.shard_id)
            blocks = np.array_split(np.arange(len(self.specs)), min(len(workers), len(self.specs)))
            # every host loads its rows at once (minutes each at 10⁸ rows)
            started = [
                self._submit_host(w, [self.specs[i] for i in block])
                for w, block in zip(workers, blocks, strict=False)
            ]
            for host in started:
                self._host_ready(*host)
        except BaseException:
            # hosts still loading when another failed are released too (their shards'
            # row files go with them), not left to the garbage collector
            for _, _, key, fut in started:
                if key not in self._keys.values():
                    fut.cancel()
            self.close()
            raise

    def _channel_client(self, workers: list[str]) -> ChannelClient | None:
        """The round channel's client, or None (rounds through Dask): the channel is used
        only where every connection of the cluster is plain ``tcp://``; on a TLS cluster
        it would be weaker than Dask's comms, so rounds go through them whatever
        ``channel`` says."""
        if self._channel_mode == "dask":
            return None
        if plain_tcp(self.client, workers):
            return ChannelClient()
        if self._channel_mode in ("socket", "tcp"):
            addresses = [*workers, str(getattr(self.client.scheduler, "address", ""))]
            log.warning(
                "channel=%r on a cluster reached over %s: the rounds go through "
                "Dask's comms instead (the socket channel is plain TCP)",
                self._channel_mode,
                sorted({a.partition("://")[0] + "://" for a in addresses}),
            )
        return None

    @property
    def n_workers(self) -> int:
        """Workers holding shards."""
        return len(self.placement)

    @property
    def hosts(self) -> list[list[int]]:
        """The shards each worker holds, as positions in :attr:`specs`."""
        at = {s.shard_id: i for i, s in enumerate(self.specs)}
        return [[at[s.shard_id] for s in specs] for specs in self.placement.values()]

    def _start_host(self, worker: str, specs: list[ShardSpec]) -> None:
        """Open a shard host holding ``specs`` on ``worker``, and wait until it is up."""
        self._host_ready(*self._submit_host(worker, specs))

    def _submit_host(
        self, worker: str, specs: list[ShardSpec]
    ) -> tuple[str, list[ShardSpec], str, Any]:
        """Start opening a shard host on ``worker`` (its shards load their rows)."""
        key = f"flymc-shardhost-{uuid.uuid4().hex}"
        fut = self.client.submit(
            ShardHost,
            specs,
            self.config,
            actor=True,
            workers=[worker],
            allow_other_workers=False,
            pure=False,
            key=key,
        )
        return worker, specs, key, fut

    def _host_ready(self, worker: str, specs: list[ShardSpec], key: str, fut: Any) -> None:
        """Wait for the host :meth:`_submit_host` started, for as long as its worker is
        there: loading a shard is a full read of its rows (minutes out of core at scale)."""
        while True:
            try:
                fut.result(timeout=self.timeout)
                break
            except TimeoutError:
                if worker not in self.client.sync(self._present):
                    raise ShardLost(f"worker {worker} left while its shards were loading") from None
        self._futures[worker] = fut
        self._keys[worker] = key
        self.placement[worker] = list(specs)
        if self._chan is not None:
            self._open_channel(worker)

    def _open_channel(self, worker: str) -> None:
        """Connect the round channel to the host on ``worker``."""
        secret = self._chan.secret  # the run's key: through Dask, never on the channel
        ok, bad = self.fanout_calls({worker: ("open_channel", (channel_host(worker), secret), {})})
        self.round_trips -= 1  # set-up, not a protocol round trip
        try:
            if bad:  # e.g. the worker's contact address is not one it can listen on
                raise OSError(f"the host could not open it: {bad[worker]!r}")
            address, local_name = ok[worker]
            self._chan.connect(
                worker,
                address,
                secret,
                timeout=min(self.timeout, 10.0),
                local_name=None if self._channel_mode == "tcp" else local_name,
            )
            self._addresses[worker] = tuple(address)
            self._top = None  # a new host: the relay tree is built again
        except OSError as e:
            if self._channel_mode in ("socket", "tcp"):
                raise ShardLost(f"cannot reach the round channel of {worker}: {e!r}") from e
            log.warning(
                "cannot reach the round channel of %s (%r): rounds go through Dask's RPC instead",
                worker,
                e,
            )
            self._chan.close()
            self._chan = None

    @property
    def channel(self) -> str:
        """How rounds travel: ``"socket"`` or ``"dask"``."""
        return "socket" if self._chan is not None else "dask"

    @property
    def local_hosts(self) -> int:
        """Hosts the round channel reaches by a local socket (on the driver's machine)."""
        chan = self._chan
        return 0 if chan is None else sum(chan.is_local(w) for w in self.placement)

    @property
    def lending_hosts(self) -> int:
        """Hosts that lend the driver their rows (:meth:`borrow_rows`): none is sent a
        read-ahead request."""
        return len(self._lent)

    # ------------------------------------------------------------- raw calls
    async def _execute(self, worker: str, function: str, args: tuple, kwargs: dict) -> Any:
        from distributed.protocol import to_serialize

        rpc = self.client.rpc(worker)
        if function in self._inline:
            # A protocol call: one ``bytes`` argument, which msgpack carries as it is (no
            # serialisation family, no extra frames), run on the worker's event loop
            # rather than handed to the actor thread (one thread hop less each way).
            result = await rpc.actor_execute(
                function=function,
                actor=self._keys[worker],
                args=list(args),
                kwargs={"separate_thread": False},
            )
        else:
            result = await rpc.actor_execute(
                function=function,
                actor=self._keys[worker],
                args=[to_serialize(a) for a in args],
                kwargs={k: to_serialize(v) for k, v in kwargs.items()},
            )
        if result["status"] == "OK":
            return result["result"]
        raise result["exception"]

    def fanout_calls(
        self, calls: dict[str, tuple[str, tuple, dict]]
    ) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """Run ``{worker: (function, args, kwargs)}`` concurrently; results and failures.

        A FlyMC protocol call (a round, an echo) taking longer than ``timeout`` fails: its
        host is lost. Any other call — set-up, recovery, regular MCMC's rounds — may be a
        full pass over the shards (minutes, out of core at scale): it fails only once
        its worker has also left the scheduler (or the connection breaks). While calls are
        pending the scheduler is asked every :data:`LIVENESS_POLL` seconds which workers
        it still has, so that a call to a worker that died fails then, not after
        ``timeout``.
        """

        async def run() -> dict[str, Any]:
            loop = asyncio.get_running_loop()
            tasks = {
                w: asyncio.ensure_future(self._execute(w, f, a, k))
                for w, (f, a, k) in calls.items()
            }
            failed: dict[str, BaseException] = {}
            deadline = loop.time() + self.timeout
            pending = set(tasks.values())
            while pending:
                wait = LIVENESS_POLL
                if any(calls[w][0] in self._inline for w, t in tasks.items() if t in pending):
                    wait = min(wait, deadline - loop.time())
                _done, pending = await asyncio.wait(pending, timeout=max(wait, 0.0))
                if not pending:
                    break
                present = await self._present()
                late = loop.time() >= deadline
                for w, t in tasks.items():
                    if t not in pending:
                        continue
                    if w not in present:
                        failed[w] = ShardLost(f"{w} left the scheduler during {calls[w][0]!r}")
                    elif late and calls[w][0] in self._inline:
                        failed[w] = TimeoutError(f"no answer from {w} within {self.timeout} s")
                    else:
                        continue
                    t.cancel()
                    pending.discard(t)
            out: dict[str, Any] = {}
            for w, t in tasks.items():
                if w in failed:
                    out[w] = failed[w]
                elif t.cancelled():
                    out[w] = asyncio.CancelledError()
                else:
                    out[w] = t.exception() if t.exception() is not None else t.result()
            return out

        self._count(list(calls))
        out = self.client.sync(run)
        self.round_trips += 1
        ok, bad = {}, {}
        for w, r in out.items():
            if isinstance(r, BaseException):
                bad[w] = r
            else:
                ok[w] = r
        return ok, bad

    async def _present(self) -> set[str]:
        """The workers the scheduler still counts (none if it does not answer within
        10 s: every pending call's worker is then treated as gone)."""
        try:
            ident = await asyncio.wait_for(self.client.scheduler.identity(n_workers=-1), 10)
        except Exception:  # noqa: BLE001 - no answer: treat the workers as gone
            return set()
        return set(ident.get("workers", {}))

    def _lost(self, bad: dict[str, BaseException]) -> list[str]:
        """Which failures are lost hosts (connection, timeout); re-raise real errors."""
        lost = []
        for w, e in bad.items():
            if isinstance(e, HostsLost):  # below a relay: the hosts it names
                lost += [x for x in e.workers if x in self.placement and x not in lost]
            elif isinstance(e, (OSError, asyncio.TimeoutError, TimeoutError, ShardLost)) or type(
                e
            ).__name__ in ("CommClosedError", "StreamClosedError"):
                lost.append(w)
            else:
                raise e
        return lost

    # ---------------------------------------------------------- the protocol
    def _per_shard(self, results: dict[str, dict[int, Any]]) -> list[Any]:
        return self._per_shard_of(self.specs)(results)

    @staticmethod
    def _per_shard_of(specs: list[Any]) -> Callable[[dict[str, dict[int, Any]]], list[Any]]:
        """Hosts' answers (each a dict by shard id) put in the order of ``specs``."""
        ids = [s.shard_id for s in specs]

        def per_shard(results: dict[str, dict[int, Any]]) -> list[Any]:
            merged: dict[int, Any] = {}
            for r in results.values():
                merged.update(r)
            return [merged[i] for i in ids]

        return per_shard

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``Shard.<method>`` on every shard, in shard order (no recovery: set-up calls)."""
        ok, bad = self.fanout_calls(
            {w: ("call", (method, args, kwargs), {}) for w in self.placement}
        )
        if bad:
            lost = self._lost(bad)
            raise ShardLost(f"workers {lost} were lost during {method!r}")
        if method in REPLAYED:
            self._replay.append((method, args, kwargs))
        return self._per_shard(ok)

    def call_each(self, method: str, per_shard: list[tuple]) -> list[Any]:
        """``Shard.<method>(*per_shard[i])`` on shard i, in shard order."""
        args = {s.shard_id: a for s, a in zip(self.specs, per_shard, strict=True)}
        calls = {
            w: ("call_each", (method, {s.shard_id: args[s.shard_id] for s in specs}), {})
            for w, specs in self.placement.items()
        }
        ok, bad = self.fanout_calls(calls)
        if bad:
            raise ShardLost(f"workers {self._lost(bad)} were lost during {method!r}")
        return self._per_shard(ok)

    def call_some(self, method: str, per_shard: dict[int, tuple]) -> dict[int, Any]:
        """``Shard.<method>(*args)`` on the listed shards only, one request per worker
        involved: shard operations (``method == "operation"``: austerity's test trips)
        on the round channel when it is open, as packed arrays
        (:func:`~flymc_dist.protocol.pack_calls`), anything else as an RPC."""
        mine: dict[str, dict[int, tuple]] = {}
        for w, specs in self.placement.items():
            got = {s.shard_id: per_shard[s.shard_id] for s in specs if s.shard_id in per_shard}
            if got:
                mine[w] = got
        if method == "operation" and self._chan is not None:
            ok, bad = self._operations(mine)
        else:
            ok, bad = self.fanout_calls(
                {w: ("call_each", (method, c), {}) for w, c in mine.items()}
            )
        if bad:
            lost = self._lost(bad)
            raise ShardLost(f"workers {lost} were lost during {method!r}", lost)
        merged: dict[int, Any] = {}
        for r in ok.values():
            merged.update(r)
        return merged

    def _operations(
        self, calls: dict[str, dict[int, tuple]]
    ) -> tuple[dict[str, dict[int, Any]], dict[str, BaseException]]:
        """Shard operations (worker → shard id → ``(name, *args)``) on the round channel,
        each worker's calls as one request (:meth:`ChannelClient.fanout_each`). Results
        and failures by worker, as :meth:`fanout_calls`."""
        payloads = {
            w: pack_calls({i: ("operation", a) for i, a in c.items()}) for w, c in calls.items()
        }
        self._count(list(calls))
        self.round_trips += 1
        got, bad = self._chan.fanout_each(CALLS, payloads, self.timeout)
        return {w: unpack_results(r) for w, r in got.items()}, bad

    def round(self, msg: Round | ReplicaRound, positions: np.ndarray) -> list[Reply | ReplicaReply]:
        """One protocol round on every shard, recovering lost workers' shards.

        ``positions`` are the chains' current (post-commit) positions, used to redraw
        the z of recreated shards exactly. On the socket channel a :class:`Round` goes
        down the relay tree (:attr:`fanout` > 0, :meth:`ShardHost.round_tree`): the
        replies are then one partial sum per top host
        (:func:`~flymc_dist.protocol.partial_sum`), which the driver sums like shards'.
        """
        blob = pack_round(msg)
        for _attempt in range(5):
            if self._chan is not None and self.fanout and isinstance(msg, Round):
                top, bad = self._relay_top()
                if not bad:
                    self._count(top)
                    ok, bad = self._chan.fanout(ROUND_TREE, blob, top, self.timeout)
                    self.round_trips += 1
                if not bad:  # one partial sum of its subtree's shards from each top host
                    return [r for w in top for r in unpack_reply(ok[w]).values()]
            elif self._chan is not None:
                self._count(list(self.placement))
                ok, bad = self._chan.fanout(ROUND, blob, list(self.placement), self.timeout)
                self.round_trips += 1
            else:
                ok, bad = self.fanout_calls(
                    {w: ("round_packed", (blob,), {}) for w in self.placement}
                )
            if not bad:
                return self._per_shard({w: unpack_reply(r) for w, r in ok.items()})
            self._recover(self._lost(bad), positions)
        raise ShardLost("giving up after 5 recoveries in one round")

    def _relay_top(self) -> tuple[list[str], dict[str, BaseException]]:
        """The top of the relay tree (:func:`relay_tree`) over the hosts now, built again
        after a change of hosts: every host whose children changed is told through Dask
        (:meth:`ShardHost.set_children`) with the seconds it waits for them. Returns the
        top and the hosts that failed to be told (then the tree is not built)."""
        if self._top is not None:
            return self._top, {}
        hosts = sorted(self.placement, key=lambda w: min(s.shard_id for s in self.placement[w]))
        top, children = relay_tree(hosts, self.fanout)
        depth = dict.fromkeys(top, 1)
        for w in hosts:  # parents come before their children in shard order
            for c in children.get(w, []):
                depth[c] = depth[w] + 1
        calls = {}
        for w in hosts:
            mine = [(c, self._addresses[c]) for c in children.get(w, [])]
            if mine != self._children_sent.get(w, []):
                timeout = self.timeout * RELAY_PATIENCE ** depth[w]
                calls[w] = ("set_children", (mine, timeout), {})
        if calls:
            ok, bad = self.fanout_calls(calls)
            self.round_trips -= 1  # set-up, not a protocol round trip
            for w in ok:
                self._children_sent[w] = calls[w][1][0]
            if bad:
                return top, bad
        self._top = top
        return top, {}

    def _count(self, workers: list[str]) -> None:
        """One more request sent to each of ``workers`` (:attr:`messages`)."""
        for w in workers:
            self.messages[w] = self.messages.get(w, 0) + 1

    def borrow_rows(self) -> None:
        """Have every host on this machine (reached by a local socket) lend the driver
        its shards' rows (:mod:`flymc_dist.shard.shared`): read-ahead requests then go
        only to the others, and the lenders' proposals are drawn and gathered here, the
        same bits as they would send. Rows lent before are given back first. A host
        that cannot lend (rows out of core, a platform without shared memory) is asked
        as before. Call it with no read-ahead request in flight (nothing else uses the
        channel meanwhile)."""
        self._return_rows()
        chan = self._chan
        if chan is None or not LENDING:
            return
        for w, specs in self.placement.items():
            if not chan.is_local(w):
                continue
            self._count([w])
            try:
                body, fds = chan.borrow(w, self.timeout)
            except Exception as e:  # noqa: BLE001 - this host's proposals travel as ever
                log.debug("the host on %s lends no rows (%r): it is asked for them", w, e)
                continue
            try:
                self._lent[w] = _lent_rows(body, fds, specs)
            except (WireError, ValueError, OSError) as e:
                log.warning("refused the rows %s lent (%r): it is asked for them", w, e)

    def _return_rows(self) -> None:
        """Unmap every lent row, once no thread of the transport's reads them."""
        if not self._lent:
            return
        for thread in self._ahead_threads or ():  # blocks still being built end first
            thread.submit(lambda: None).result()
        lent, self._lent = self._lent, {}
        for rows in lent.values():
            for r in rows:
                r.close()

    def post_ahead(self, msg: Ahead, prepare: Callable[[list[Proposals]], Any]) -> Any:
        """Send a read-ahead request to every host, without waiting for the answers: on
        the round channel, sent and its replies read and checked on a thread of its own
        (each connection carries this one request until :meth:`take_ahead` has its
        reply), then unpacked and ``prepare`` applied to them on another, or by
        :meth:`take_ahead` when it asks first; else as an actor call run in the client's
        event loop, prepared by :meth:`take_ahead`. Returns the handle it takes."""
        blob = pack_ahead(msg)
        workers = list(self.placement)
        lent = self._lent
        asked = [w for w in workers if w not in lent]
        self.round_trips += bool(asked)
        self._count(asked)
        if self._chan is not None:
            # sent and read on a thread of its own, then prepared on another while the
            # driver computes (its compiled loop releases the GIL; the next request goes
            # out meanwhile), or by the driver itself when it asks first (_Prepared);
            # nothing else uses the channel until take_ahead has the answers (a
            # connection carries one request at a time); the shards' order is this
            # request's, whatever happens after
            if self._ahead_threads is None:
                self._ahead_threads = (
                    ThreadPoolExecutor(1, thread_name_prefix="flymc-ahead"),
                    ThreadPoolExecutor(1, thread_name_prefix="flymc-block"),
                )
            reader, builder = self._ahead_threads
            chan, timeout, per_shard = self._chan, self.timeout, self._per_shard_of(self.specs)
            if asked:
                read = reader.submit(chan.fanout, AHEAD, blob, asked, timeout)
            else:  # every host lends its rows: nothing travels
                read = Future()
                read.set_result(({}, {}))

            def answers(
                read: tuple[dict[str, Any], dict[str, BaseException]],
            ) -> tuple[dict[str, Any], dict[str, BaseException], Any]:
                ok, bad = read
                # a lending host is asked nothing: its death is seen on its connection
                bad = {**bad, **{w: ChannelError(f"{w} closed") for w in lent if chan.closed(w)}}
                if bad:
                    return ok, bad, None
                # an error here is raised where the driver takes the block, never by
                # drop_ahead (_Prepared)
                parts = {w: unpack_proposals(r) for w, r in ok.items()}
                for w, rows in lent.items():
                    parts[w] = {r.shard_id: _proposals_of(r, msg) for r in rows}
                return ok, bad, prepare(per_shard(parts))

            job = _Prepared(read, answers)
            builder.submit(job.unasked)
            return _AheadHandle("socket", workers, job, prepare)

        async def run() -> list[Any]:
            return await asyncio.gather(
                *(self._execute(w, "proposals_packed", (blob,), {}) for w in workers),
                return_exceptions=True,
            )

        future = asyncio.run_coroutine_threadsafe(run(), self.client.loop.asyncio_loop)
        return _AheadHandle("dask", workers, future, prepare)

    def take_ahead(self, handle: _AheadHandle) -> Any:
        """What the ``prepare`` of :meth:`post_ahead` made of its request's answers (in
        shard order). A host lost on the way (its connection fails, or no answer within
        ``timeout``) has its shards recreated on live workers (:meth:`recover`): then
        None, and the driver redraws z."""
        ok, bad, prepared = self._ahead_answers(handle)
        if bad:
            for thread in self._ahead_threads or ():  # requests still in flight end first
                thread.submit(lambda: None).result()
            self.recover(self._lost(bad))
            return None
        if prepared is None:  # answered in the event loop: prepared here
            parts = self._per_shard({w: unpack_proposals(r) for w, r in ok.items()})
            prepared = handle.prepare(parts)
        return prepared

    def drop_ahead(self, handle: _AheadHandle) -> None:
        """Wait for the answers to :meth:`post_ahead`'s request and drop them (nothing more
        is prepared of them): hosts lost on the way are not recovered here (the next
        call meets them)."""
        if handle.how == "socket":
            handle.pending.drop()
        else:
            self._ahead_answers(handle)

    def _ahead_answers(
        self, handle: _AheadHandle
    ) -> tuple[dict[str, Any], dict[str, BaseException], Any]:
        """The answers to :meth:`post_ahead`'s request, the hosts that gave none, and
        what ``prepare`` made of them (None: not prepared yet)."""
        how, workers, pending, _ = handle
        if how == "socket":
            return pending.result()  # the channel's own timeout bounds it
        try:
            out = pending.result(self.timeout)
        except TimeoutError:
            out = [TimeoutError("no answer to a read-ahead request")] * len(workers)
        ok, bad = {}, {}
        for w, r in zip(workers, out, strict=True):
            (bad if isinstance(r, BaseException) else ok)[w] = r
        return ok, bad, None

    def recover(self, lost: list[str]) -> None:
        """Recreate the shards of the ``lost`` workers on live ones, without positions.

        For samplers that keep no per-chain state on the shards between calls
        (austerity): the shards are reopened from the store and the set-up calls
        replayed; nothing is redrawn.
        """
        self._recover(lost, None)

    def _recover(self, lost: list[str], positions: np.ndarray | None) -> None:
        t0 = time.perf_counter()
        self._return_rows()  # lent again, where they still are, when z is taken anew
        orphans = [s for w in lost for s in self.placement.pop(w)]
        for w in lost:
            self._futures.pop(w, None)
            self._keys.pop(w, None)
            self._children_sent.pop(w, None)
            self._addresses.pop(w, None)
            if self._chan is not None:
                self._chan.drop(w)
        self._top = None  # the relay tree is built again over the hosts left
        self.generation += 1
        live = [w for w in sorted(_scheduler_workers(self.client)) if w not in lost]
        deadline = time.time() + 30
        while not live and time.time() < deadline:
            time.sleep(0.2)
            live = [w for w in sorted(_scheduler_workers(self.client)) if w not in lost]
        if not live:
            raise ShardLost("no live worker left to recreate the lost shards on")
        # fill new (restarted) workers first, then the least loaded
        placed: dict[str, list[int]] = {}  # worker -> ids of the shards recreated there
        for spec in orphans:
            target = min(live, key=lambda w: len(self.placement.get(w, [])))
            if target not in self.placement:
                self._start_host(target, [spec])
            else:
                ok, bad = self.fanout_calls({target: ("add_shards", ([spec],), {})})
                if bad:
                    raise ShardLost(f"recovery failed on {target}: {bad[target]!r}")
                self.placement[target].append(spec)
            placed.setdefault(target, []).append(spec.shard_id)
        for method, args, kwargs in self._replay:
            _, bad = self.fanout_calls(
                {w: ("call", (method, args, kwargs, ids), {}) for w, ids in placed.items()}
            )
            if bad:
                raise ShardLost(f"recovery failed replaying {method!r}: {bad!r}")
        queries = 0
        if positions is not None:
            ok, bad = self.fanout_calls(
                {
                    w: (
                        "call_each",
                        ("set_positions", {i: (positions, self.generation) for i in ids}),
                        {},
                    )
                    for w, ids in placed.items()
                }
            )
            if bad:
                raise ShardLost(f"recovery failed: {bad!r}")
            queries = int(sum(sum(r.values()) for r in ok.values()))
        event = {
            "lost_workers": lost,
            "shards": [s.shard_id for s in orphans],
            "generation": self.generation,
            "queries": queries,
            "seconds": time.perf_counter() - t0,
            "time": time.time(),
        }
        self.recoveries.append(event)
        log.warning(
            "lost worker(s) %s: recreated shards %s on live workers, z redrawn exactly (%.2f s)",
            lost,
            event["shards"],
            event["seconds"],
        )

    def timing(self) -> list[dict[str, float]]:
        """:meth:`ShardHost.timing` of every host, in worker order (hosts that fail to
        answer are left out: timing is for reports, never worth a recovery)."""
        ok, _bad = self.fanout_calls({w: ("timing", (), {}) for w in self.placement})
        self.round_trips -= 1  # not a protocol round trip
        return [ok[w] for w in sorted(ok)]

    def echo(self, payload: bytes) -> None:
        """One bare round trip carrying ``payload`` to every host and back, the way
        rounds travel (the bench's floor)."""
        if self._chan is not None:
            self._count(list(self.placement))
            _ok, bad = self._chan.fanout(ECHO, payload, list(self.placement), self.timeout)
        else:
            _ok, bad = self.fanout_calls({w: ("echo", (payload,), {}) for w in self.placement})
            self.round_trips -= 1
        if bad:
            raise ShardLost(f"a bare round trip failed: {bad!r}")

    def close(self) -> None:
        """Release the actors; close the client and cluster if we started them."""
        self._return_rows()
        for thread in self._ahead_threads or ():
            thread.shutdown(wait=True)
        self._ahead_threads = None
        if self._chan is not None:
            self._chan.close()
        try:  # stop the hosts' servers and drop their rows now (a live cluster keeps
            # its workers, and a next run may start on them at once)
            self.fanout_calls({w: ("release", (), {}) for w in self.placement})
        except Exception:  # noqa: BLE001 - best effort on shutdown
            log.debug("releasing the shard hosts failed", exc_info=True)
        for f in self._futures.values():
            try:
                f.release()
            except Exception:  # noqa: BLE001 - best effort on shutdown
                log.debug("releasing an actor future failed", exc_info=True)
        self._futures.clear()
        if self.owned:
            self.client.close()
            if self.cluster is not None:
                self.cluster.close()
        if self._dask_config is not None:  # the user's Dask settings again
            self._dask_config.__exit__(None, None, None)
            self._dask_config = None
