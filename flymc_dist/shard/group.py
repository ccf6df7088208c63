"""The shards one host holds, as one object: a shard is state (:mod:`.state`), a round
is functions over a group of shards (:mod:`.round`), and the group is what those
functions run over — with one lock per shard, the shards' buffers as typed lists kept
between rounds, and the rounds' wall and CPU seconds. A host
(:class:`~flymc_dist.transport.host.ShardHost`) owns one, beside its channel server and
its relay; nothing here knows how a request arrived.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from flymc_dist.protocol import Proposals, ReplicaReply, ReplicaRound, Reply, Round
from flymc_dist.shard.round import round_shards
from flymc_dist.shard.state import Shard


class ShardGroup:
    """Shards by id, each behind its own lock.

    Protocol calls (rounds, read-ahead requests) can arrive on one thread (the event
    loop, or the round channel's) while set-up and recovery calls arrive on another (a
    Dask actor's): a shard's lock keeps them from interleaving on it. :attr:`shards` is
    never mutated in place (a reader iterating it sees one whole state).
    """

    def __init__(self) -> None:
        #: the shards held, by id (replaced, never mutated in place)
        self.shards: dict[int, Shard] = {}
        self._locks: dict[int, threading.Lock] = {}
        #: the shards' buffers as one typed list (:func:`~flymc_dist.shard.state.typed_lists`)
        self.typed_cache: tuple | None = None
        #: rounds run here and the wall and CPU seconds they took
        self.busy = {"rounds": 0, "round_wall": 0.0, "round_cpu": 0.0}

    def add(self, shard: Shard) -> None:
        """Hold ``shard`` (under its ``spec.shard_id``)."""
        i = shard.spec.shard_id
        self._locks[i] = threading.Lock()
        self.shards = {**self.shards, i: shard}

    def ids(self) -> list[int]:
        """The ids of the shards held, sorted."""
        return sorted(self.shards)

    def on(self, i: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """``Shard.<method>(*args, **kwargs)`` on shard ``i``, under its lock."""
        with self._locks[i]:
            return getattr(self.shards[i], method)(*args, **kwargs)

    def round(self, msg: Round | ReplicaRound) -> dict[int, Reply | ReplicaReply]:
        """One round on every shard here (:func:`~flymc_dist.shard.round.round_shards`
        over all of them at once, under all their locks), by shard id."""
        w, c = time.perf_counter(), time.thread_time()
        ids = self.ids()
        locks = [self._locks[i] for i in ids]
        for lk in locks:
            lk.acquire()
        try:
            replies = round_shards([self.shards[i] for i in ids], msg, self)
        finally:
            for lk in reversed(locks):
                lk.release()
        b = self.busy
        b["rounds"] += 1
        b["round_wall"] += time.perf_counter() - w
        b["round_cpu"] += time.thread_time() - c
        return dict(zip(ids, replies, strict=True))

    def proposals(self, first: int, count: int, generation: int) -> dict[int, Proposals]:
        """:meth:`Shard.proposals` of every shard here (a read-ahead request)."""
        return {i: self.on(i, "proposals", first, count, generation) for i in self.ids()}

    def settle(self) -> None:
        """Each shard's work left by the last round (:meth:`Shard.settle`)."""
        for i in self.ids():
            self.on(i, "settle")

    def close(self) -> None:
        """Drop every shard (closing its rows) now."""
        shards, self.shards = self.shards, {}
        for shard in shards.values():
            shard.close()
        self._locks.clear()
        self.typed_cache = None
