"""Several shards in one place: :class:`ShardHost`, in-process or one Dask actor per
worker, serving rounds on Dask's RPC or on a socket of its own
(:mod:`flymc_dist.transport.channel`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from typing import Any

import numpy as np

from flymc_dist.protocol import (
    ReplicaReply,
    Reply,
    Request,
    ShardConfig,
    ShardSpec,
    pack_reply,
    unpack_round,
)
from flymc_dist.shard.chunks import worker_memory_limit
from flymc_dist.shard.fused import fusable, fused_round
from flymc_dist.shard.shard import Shard
from flymc_dist.transport.channel import ECHO, ROUND, ChannelServer

log = logging.getLogger(__name__)

#: out-of-core shards on one worker above which it warns (each has its own window)
MANY_OUT_OF_CORE = 4


class ShardHost:
    """Several shards in one place: in-process, or as one Dask actor per worker.

    Every method fans out to the host's shards and returns a dict keyed by shard id,
    so the driver can combine results in a fixed global shard order (bit-identical
    sums whatever the placement).
    """

    def __init__(
        self,
        specs: list[ShardSpec],
        config: ShardConfig,
        data: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        self.config = config
        self.shards: dict[int, Shard] = {}
        # On a worker, protocol calls and speculative z-updates run on the event loop
        # while set-up and recovery calls run on the actor's thread: one lock per shard
        # keeps them from interleaving on the same shard (a speculation on a surviving
        # shard never waits for a recreated shard's set-up).
        self._locks: dict[int, threading.Lock] = {}
        #: wall and CPU seconds spent in rounds (and in speculation, after replies)
        self._channel: Any = None  # a ChannelServer once open_channel is called
        self._typed: tuple | None = None  # the shards' typed lists: see _typed_lists
        self._busy = {
            "rounds": 0,
            "round_wall": 0.0,
            "round_cpu": 0.0,
            "speculate_wall": 0.0,
            "speculate_cpu": 0.0,
        }
        self.add_shards(specs, data)

    def add_shards(
        self, specs: list[ShardSpec], data: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
    ) -> list[int]:
        """Open more shards here (placement, or recovery of a lost worker's shards).

        Each new shard's memory budget (``out_of_core="auto"``) is ``config.memory_budget``
        or else its share of half the worker's memory limit among the shards held here.
        """
        budget = self.config.memory_budget
        if budget is None:
            limit = worker_memory_limit()
            if limit is not None:
                budget = limit // (2 * max(len(self.shards) + len(specs), 1))
        for spec in specs:
            shard = Shard(spec, self.config, None if data is None else data[spec.shard_id], budget)
            self._locks[spec.shard_id] = threading.Lock()
            self.shards = {**self.shards, spec.shard_id: shard}  # never mutated in place
        ooc = sum(sh.out_of_core for sh in self.shards.values())
        if ooc > MANY_OUT_OF_CORE:
            log.warning(
                "%d out-of-core shards on this worker: each keeps two chunks in memory and "
                "reads its own window every iteration; give each worker one or a few "
                "shards (sample(..., n_shards=...))",
                ooc,
            )
        return sorted(self.shards)

    def shard_ids(self) -> list[int]:
        """The ids of the shards held here."""
        return sorted(self.shards)

    def _on(self, i: int, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._locks[i]:
            return getattr(self.shards[i], method)(*args, **kwargs)

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
        return {i: self._on(i, method, *args, **kwargs) for i in ids}

    def call_each(self, method: str, per_shard: dict[int, tuple]) -> dict[int, Any]:
        """Call ``Shard.<method>(*per_shard[id])`` on each listed shard."""
        return {i: self._on(i, method, *a) for i, a in per_shard.items()}

    def round(
        self,
        seq: Any,
        commits: np.ndarray,
        update_z: bool,
        requests: list[Request | None],
        speculate: bool = False,
    ) -> dict[int, Reply | ReplicaReply]:
        """:meth:`Shard.round` on every shard here."""
        w, c = time.perf_counter(), time.thread_time()
        out = self._round_fused(seq, commits, update_z, requests, speculate)
        if out is None:
            out = {
                i: self._on(i, "round", seq, commits, update_z, requests, speculate)
                for i in self.shards
            }
        b = self._busy
        b["rounds"] += 1
        b["round_wall"] += time.perf_counter() - w
        b["round_cpu"] += time.thread_time() - c
        return out

    def _round_fused(
        self,
        seq: Any,
        commits: np.ndarray,
        update_z: bool,
        requests: list[Request | None],
        speculate: bool,
    ) -> dict[int, Reply | ReplicaReply] | None:
        """:meth:`Shard.round` on every shard here in one pass
        (:func:`~flymc_dist.shard.fused.fused_round`), or None where it does not apply
        (then the shards run one by one)."""
        ids = sorted(self.shards)
        shards = [self.shards[i] for i in ids]
        if not fusable(shards, seq, requests, speculate):
            return None
        locks = [self._locks[i] for i in ids]
        for lk in locks:
            lk.acquire()
        try:
            with np.errstate(over="ignore", divide="ignore"):
                replies = fused_round(shards, seq, commits, update_z, requests, self)
        finally:
            for lk in reversed(locks):
                lk.release()
        return dict(zip(ids, replies, strict=True))

    def speculate(self) -> None:
        """:meth:`Shard.speculate` on every shard here."""
        w, c = time.perf_counter(), time.thread_time()
        for i in self.shards:
            self._on(i, "speculate")
        self._busy["speculate_wall"] += time.perf_counter() - w
        self._busy["speculate_cpu"] += time.thread_time() - c

    def timing(self) -> dict[str, float]:
        """Rounds served here and the wall / CPU seconds they (and speculation) took."""
        return dict(self._busy)

    def _round_blob(self, blob: bytes) -> tuple[bytes, bool]:
        """:meth:`round` with its arguments and reply pickled into one buffer each;
        also whether a speculative z-update should follow the reply."""
        seq, commits, update_z, requests, speculate = unpack_round(blob)
        return pack_reply(self.round(seq, commits, update_z, requests, speculate)), speculate

    def round_packed(self, blob: bytes) -> bytes:
        """:meth:`round` with its arguments and reply pickled into one buffer each.

        A round's payload is a handful of small arrays; one buffer each way costs the
        Dask RPC layer far less than serialising every array as its own frame. When the
        transport runs it on the worker's event loop (FlyMC), a speculative z-update is
        scheduled behind the reply (a timer callback runs only after the callbacks
        already queued, among them the one that writes the reply); on the actor's thread
        there is no loop, and the next round runs the pending speculation first.
        """
        reply, speculate = self._round_blob(blob)
        if speculate:
            try:
                asyncio.get_running_loop().call_later(0.0, self.speculate)
            except RuntimeError:  # not on an event loop: Shard.round catches up
                pass
        return reply

    # ------------------------------------------------------------ the channel
    def open_channel(self, host: str) -> tuple[tuple[str, int], bytes]:
        """Serve rounds on a socket of ``host`` (see :mod:`flymc_dist.transport.channel`).

        Returns the address to connect to and the token to present. A speculative
        z-update runs on the channel's thread right after its reply is sent.
        """
        self.close_channel()
        self._channel = ChannelServer(self._serve_channel, host)
        # the server holds this host weakly: once Dask drops the actor (its run released
        # it, or the run's client went away), the server stops and its port is freed
        weakref.finalize(self, self._channel.close)
        return self._channel.address, self._channel.token

    def _serve_channel(self, code: int, payload: bytes) -> tuple[bytes, Any]:
        if code == ROUND:
            reply, speculate = self._round_blob(payload)
            return reply, (self.speculate if speculate else None)
        if code == ECHO:
            return payload, None
        raise ValueError(f"unknown channel request code {code}")

    def close_channel(self) -> None:
        """Stop serving rounds on the socket (if open)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def ping(self) -> int:
        """Liveness check: the number of shards held."""
        return len(self.shards)

    def echo(self, blob: bytes) -> bytes:
        """Return ``blob`` unchanged: a bare round trip carrying a round's payload (bench)."""
        return blob
