"""Several shards in one place: :class:`ShardHost`, in-process or one Dask actor per
worker, serving rounds on Dask's RPC or on a socket of its own
(:mod:`flymc_dist.transport.channel`)."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from typing import Any

import numpy as np

from flymc_dist.protocol import (
    Proposals,
    ReplicaReply,
    ReplicaRound,
    Reply,
    Round,
    ShardConfig,
    ShardSpec,
    WireError,
    check_round,
    pack_arrays,
    pack_proposals,
    pack_reply,
    pack_results,
    partial_sum,
    resolve_operation,
    unpack_ahead,
    unpack_calls,
    unpack_reply,
    unpack_round,
)
from flymc_dist.shard.group import ShardGroup
from flymc_dist.shard.rowfile import worker_memory
from flymc_dist.shard.state import Shard
from flymc_dist.transport.channel import (
    AHEAD,
    CALLS,
    ECHO,
    LEND,
    MAX_FDS,
    ROUND,
    ROUND_TREE,
    ChannelClient,
    ChannelError,
    ChannelServer,
    HostsLost,
    WithFds,
)

log = logging.getLogger("flymc_dist")

#: seconds between a host's checks that its run still holds it (see :class:`ShardHost`)
LEASE_CHECK = 1.0
#: seconds a relay keeps trying to connect to a child another parent has just let go
RELAY_CONNECT = 5.0
#: on a worker, allocations of at least this many bytes are mapped on their own by glibc's
#: malloc, so that freeing one gives its memory back at once (see :func:`_map_large`)
MMAP_THRESHOLD = 256 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


class ShardHost:
    """Several shards in one place: in-process, or as one Dask actor per worker.

    Every method fans out to the host's shards and returns a dict keyed by shard id,
    so the driver can combine results in a fixed global shard order (bit-identical
    sums whatever the placement).

    On a Dask worker the host holds a lease on its run: a thread checks every
    :data:`LEASE_CHECK` seconds that the worker still holds it as its task's actor (or
    is still making it). Dask drops the actor when the run lets it go — its driver's
    client disconnected (the driver died, even by SIGKILL), its transport gave the host
    up after a fault (a stalled worker, a corrupt row file), or another host refused its
    shards while this one opened — and the host then releases everything it placed at
    once (:meth:`release`: its channel, its shards' rows, row files, reading threads and
    file descriptors), without waiting for the garbage collector.
    """

    def __init__(
        self,
        specs: list[ShardSpec],
        config: ShardConfig,
        data: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        self.config = config
        #: the shards held here, each behind its lock, and the rounds over them
        self.group = ShardGroup()
        self._channel: Any = None  # a ChannelServer once open_channel is called
        self._secret: bytes | None = None  # the run's key (open_channel), for the relay
        #: the relay tree below this host (:meth:`set_children`): its children's keys and
        #: addresses, the seconds it waits for them, and its connections to them
        self._children: dict[str, tuple[str, int]] = {}
        self._child_timeout = 0.0
        self._relay: ChannelClient | None = None
        self._released = threading.Event()
        self.add_shards(specs, data)
        _hold_lease(self)

    def add_shards(
        self, specs: list[ShardSpec], data: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
    ) -> list[int]:
        """Open more shards here (placement, or recovery of a lost worker's shards).

        Each new shard's memory budget (``out_of_core="auto"``) is ``config.memory_budget``
        or else its share of half the worker's memory limit among the shards held here,
        and no more than its share of the room the worker has left now
        (:func:`~flymc_dist.shard.rowfile.worker_memory`: a worker's own imports
        take ~150 MB of it before any shard).
        """
        budget = self.config.memory_budget
        if budget is None:
            memory = worker_memory()
            if memory is not None:
                limit, room = memory
                budget = min(
                    limit // (2 * max(len(self.shards) + len(specs), 1)),
                    room // max(len(specs), 1),
                )
        for spec in specs:
            data_i = None if data is None else data[spec.shard_id]
            self.group.add(Shard(spec, self.config, data_i, budget))
        return self.group.ids()

    @property
    def shards(self) -> dict[int, Shard]:
        """The shards held here, by id (:attr:`ShardGroup.shards`)."""
        return self.group.shards

    def shard_ids(self) -> list[int]:
        """The ids of the shards held here."""
        return self.group.ids()

    def call(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        shard_ids: list[int] | None = None,
    ) -> dict[int, Any]:
        """Call ``Shard.<method>(*args, **kwargs)`` on some or all shards here."""
        ids = self.shard_ids() if shard_ids is None else shard_ids
        kwargs = kwargs or {}
        return {i: self.group.on(i, method, *args, **kwargs) for i in ids}

    def call_each(self, method: str, per_shard: dict[int, tuple]) -> dict[int, Any]:
        """Call ``Shard.<method>(*per_shard[id])`` on each listed shard."""
        return {i: self.group.on(i, method, *a) for i, a in per_shard.items()}

    def calls_packed(self, blob: bytes) -> list[bytes | memoryview]:
        """Shard operations on some shards here, their calls packed into one buffer
        (:func:`~flymc_dist.protocol.pack_calls`, each ``("operation", (name, *args))``)
        and their results into one buffer's parts
        (:func:`~flymc_dist.protocol.pack_results`): how an add-on sampler's calls
        (austerity's test trips) travel on the round channel. Every call must be a shard
        operation (:func:`~flymc_dist.protocol.resolve_operation`) on a shard held here,
        checked for all before any runs."""
        calls = unpack_calls(blob)
        unknown = sorted(set(calls) - set(self.shards))
        if unknown:
            raise WireError(f"shards {unknown} are not held here")
        for method, args in calls.values():
            if method != "operation" or not args:
                raise WireError(f"only shard operations travel here, not {method!r}")
            resolve_operation(args[0])
        return pack_results({i: self.group.on(i, m, *a) for i, (m, a) in calls.items()})

    def round(self, msg: Round | ReplicaRound) -> dict[int, Reply | ReplicaReply]:
        """One round on every shard here (:meth:`ShardGroup.round`)."""
        return self.group.round(msg)

    def proposals(self, first: int, count: int, generation: int) -> dict[int, Proposals]:
        """:meth:`Shard.proposals` of every shard here (a read-ahead request)."""
        return self.group.proposals(first, count, generation)

    def proposals_packed(self, blob: bytes) -> bytes:
        """:meth:`proposals` with its request and reply packed into one buffer each."""
        return b"".join(self._proposal_parts(blob))

    def _proposal_parts(self, blob: bytes) -> list[bytes | memoryview]:
        """:meth:`proposals_packed`'s reply as its parts (the round channel sends them as
        they are: a reply of many rows is not copied into one buffer first)."""
        msg = unpack_ahead(blob)
        return pack_proposals(self.proposals(msg.first, msg.count, msg.generation))

    def lend_rows(self) -> WithFds:
        """Every shard's rows here, lent to the driver on this machine
        (:meth:`Shard.lend`): their descriptors, and a description of each (one
        ``pack_arrays`` meta: ``("lent", [meta, …])``, two descriptors a shard, in shard
        order). A ``ValueError`` when some shard cannot lend (the driver then asks this
        host for its proposals)."""
        metas, fds = [], []
        for i in self.group.ids():
            f, meta = self.group.on(i, "lend")
            metas.append(meta)
            fds += f
        if len(fds) > MAX_FDS:
            raise ValueError(f"{len(metas)} shards are more than one reply lends")
        return WithFds(pack_arrays(("lent", metas), []), fds)

    def settle(self) -> None:
        """Each shard's work left by the last round (:meth:`Shard.settle`), run after its
        reply has gone: out of core, the reads of the next z-update's rows, while the
        driver moves θ."""
        self.group.settle()

    def timing(self) -> dict[str, float]:
        """Rounds served here and the wall / CPU seconds they took; ``channel_refused``:
        the handshakes and frames the round channel refused (see
        :attr:`flymc_dist.transport.channel.ChannelServer.refused`)."""
        refused = 0 if self._channel is None else sum(self._channel.refused.values())
        return {**self.group.busy, "channel_refused": refused}

    def round_packed(self, blob: bytes) -> bytes:
        """:meth:`round` with its arguments and reply packed into one buffer each
        (:func:`~flymc_dist.protocol.pack_round`, :func:`~flymc_dist.protocol.pack_reply`).

        A round's payload is a handful of small arrays; one buffer each way costs the
        Dask RPC layer far less than serialising every array as its own frame. The
        message is validated — its layout, finite values, the shards' chains and
        parameters — before any shard sees it.
        """
        return pack_reply(self._checked_round(unpack_round(blob)))

    def _checked_round(self, msg: Round | ReplicaRound) -> dict[int, Reply | ReplicaReply]:
        """:meth:`round`, once the message fits the shards here (:func:`check_round`)."""
        if self.shards:
            first = next(iter(self.shards.values()))
            check_round(msg, self.config.chains, first.n_params)
        return self.round(msg)

    # ----------------------------------------------------------- the relay tree
    def set_children(self, children: list[tuple[str, tuple[str, int]]], timeout: float) -> None:
        """Make this host a relay of shard-evaluated rounds (:meth:`round_tree`) to
        ``children`` (their worker keys and round channel addresses, in shard order),
        each given ``timeout`` seconds to answer; connections to hosts no longer among
        them are closed at once (another relay may take them over). Handed over through
        Dask, like the run's key the relay connects with (:meth:`open_channel`'s)."""
        new = {str(k): (str(a[0]), int(a[1])) for k, a in children}
        relay = self._relay
        if relay is not None:
            for k in list(self._children):
                if new.get(k) != self._children[k]:
                    relay.drop(k)
        self._children, self._child_timeout = new, float(timeout)

    def _connect_child(self, key: str) -> None:
        """Connect to child ``key`` as its parent, retrying while it still holds the
        connection of a parent that let it go (:data:`RELAY_CONNECT` seconds at most)."""
        if self._relay is None:
            self._relay = ChannelClient()
        deadline = time.monotonic() + RELAY_CONNECT
        while True:
            try:
                self._relay.connect(
                    key,
                    self._children[key],
                    self._secret,
                    timeout=min(self._child_timeout, 10.0),
                    role="parent",
                )
                return
            except ChannelError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def round_tree(self, blob: bytes) -> bytes:
        """A shard-evaluated round relayed down the tree of hosts: sent on to this host's
        children (:meth:`set_children`) first, run on the shards here meanwhile, and
        answered with one partial sum of the whole subtree
        (:func:`~flymc_dist.protocol.partial_sum`: the block tree's nodes merged where
        complete, the same bits as the driver's own sum of every shard's reply).

        A child that cannot be reached, closes or does not answer in time is named to
        the driver as lost (:class:`~flymc_dist.transport.channel.HostsLost`), with every
        host its own subtree lost; the driver recovers their shards and replays the
        round, which the shards that ran it answer from their cache.
        """
        msg = unpack_round(blob)
        if not isinstance(msg, Round):
            raise WireError("only a shard-evaluated round travels down the relay tree")
        lost: list[str] = []
        for key in self._children:
            if self._relay is None or key not in self._relay:
                try:
                    self._connect_child(key)
                except OSError:
                    lost.append(key)
        relay = self._relay
        keys = [k for k in self._children if k not in lost]
        sent, bad = relay.post(ROUND_TREE, blob, keys) if keys else ([], {})
        try:
            mine = list(self._checked_round(msg).values())
        finally:  # the children's replies are read whatever happened here
            ok, late = relay.collect(sent, self._child_timeout) if sent else ({}, {})
        errors = {**bad, **late}
        for key, e in errors.items():
            if isinstance(e, HostsLost):
                lost += e.workers
            elif isinstance(e, OSError):
                lost.append(key)
            else:
                raise e
        if lost:
            raise HostsLost(lost)
        parts: list[Any] = mine + [r for k in keys for r in unpack_reply(ok[k]).values()]
        if not parts:
            raise ValueError("a relayed round reached no shard")
        return pack_reply({min(self.shards, default=0): partial_sum(parts)})

    # ------------------------------------------------------------ the channel
    def open_channel(self, host: str, secret: bytes) -> tuple[tuple[str, int], str | None]:
        """Serve rounds on a socket of ``host`` (see :mod:`flymc_dist.transport.channel`)
        to the driver holding the run's key ``secret`` (handed over through Dask).

        Returns the address to connect to, and the name of the local socket a driver on
        this machine connects to instead (None: none here).
        """
        self.close_channel()
        self._secret = secret
        # held weakly by the server, which stops once Dask drops this actor
        self._channel = ChannelServer(self._serve_channel, host, secret, self._after_channel)
        return self._channel.address, self._channel.local_name

    def _serve_channel(self, code: int, payload: bytes) -> bytes | list[bytes | memoryview]:
        if code == ROUND:
            return self.round_packed(payload)
        if code == ROUND_TREE:
            return self.round_tree(payload)
        if code == AHEAD:
            return self._proposal_parts(payload)
        if code == CALLS:
            return self.calls_packed(payload)
        if code == ECHO:
            return payload
        if code == LEND:
            return self.lend_rows()
        raise ValueError(f"unknown channel request code {code}")

    def _after_channel(self, code: int) -> None:
        if code in (ROUND, ROUND_TREE):
            self.settle()

    def close_channel(self) -> None:
        """Stop serving rounds on the socket (if open), and relaying them: the connections
        to this host's children close with it."""
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        self._children = {}
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def release(self) -> None:
        """Stop serving and drop every shard (their rows) now, before Dask releases the
        actor: that happens a moment after the run's client lets it go, so a next run
        started at once on the same workers would load its rows beside these (measured
        at 10⁷ × 20 on 2 workers: a peak of 2.7 GB per worker instead of 1.6)."""
        self._released.set()
        self.close_channel()
        self.group.close()

    def ping(self) -> int:
        """Liveness check: the number of shards held."""
        return len(self.shards)

    def echo(self, blob: bytes) -> bytes:
        """Return ``blob`` unchanged: a bare round trip carrying a round's payload (bench)."""
        return blob


def _hold_lease(host: ShardHost) -> None:
    """In a Dask worker's task (the actor being made), start the thread that releases
    ``host`` once the worker no longer holds it as that task's actor (see
    :class:`ShardHost`); elsewhere nothing."""
    try:
        from distributed import get_worker

        worker = get_worker()
        key = worker.get_current_task()
    except (ImportError, ValueError, KeyError):  # not on a worker, or not in its task
        return
    _map_large()
    threading.Thread(
        target=_watch_lease,
        args=(weakref.ref(host), worker, key, host._released),
        name="flymc-host-lease",
        daemon=True,
    ).start()


def _watch_lease(ref: weakref.ref, worker: Any, key: Any, released: threading.Event) -> None:
    """The lease thread: holds the host weakly and, once the worker is done with task
    ``key`` without holding the host as its actor, releases it.

    Done means the task is neither executing (the host being made, or made and not yet
    handed to the worker) nor the worker's actor: its run let it go, before or after the
    host was ready, and whether or not anything else still refers to the host (the
    garbage collector is not waited for)."""
    while not released.wait(LEASE_CHECK):
        host = ref()
        if host is None:  # collected: its rows went with it
            return
        actor = worker.state.actors.get(key)
        task = worker.state.tasks.get(key)
        making = actor is None and task is not None and task.state == "executing"
        if actor is not host and not making:
            log.info("flymc: a shard host's run let it go; releasing it")
            host.release()
            return
        del host, actor, task


def _map_large() -> None:
    """On a worker with glibc: have malloc map every allocation of :data:`MMAP_THRESHOLD`
    bytes or more on its own (``mallopt(M_MMAP_THRESHOLD)``), elsewhere nothing.

    By default glibc raises that threshold each time a mapped block is freed, up to 32 MB,
    so the blocks a shard allocates and frees by the megabyte (a full pass's rows, a
    read-ahead's proposals) come to be carved from the heap, and freeing them gives the
    worker's memory back to nobody: measured on a shard of 6·10⁵ rows × 10 features out
    of core, a set-up's peak of 515 MB with the default, 398 MB with the threshold held,
    on a 200 MB floor. Its RSS is what a worker's memory limit counts (Dask restarts a
    worker past 95 % of it)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (its mallopt takes this)
    except (OSError, AttributeError):
        return
    libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
