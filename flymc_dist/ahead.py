"""Replica mode without a round per iteration: the driver updates z itself.

In replica mode the driver holds every chain's bright rows and runs the θ-kernel on
them. The implicit z-update of a (chain, step) needs, besides those rows, only the rows
its dark→bright proposals hit: a Bernoulli(q) process keyed by row, chain, step and
stream generation (:mod:`flymc_dist.streams`), which depends on neither θ nor z. So the
rows the next ``depth`` steps will propose are known now. :class:`ReadAhead` asks every
shard host for them — the rows and their data, one request per host per ``depth``
iterations, sent ``depth`` iterations before they are needed — and the driver runs the
z-update on its replica (:meth:`~flymc_dist.replica.BrightReplica.update_z`): the same
operations on the same values as the shards' update, so the same draws, bit for bit,
with no round trip on an iteration's path.

The shards keep their exact draw of z from placement (or the last redraw) and are not
told the driver's updates; nothing reads z there in this mode. Whenever z is drawn
afresh on the shards — at placement, on resume (a new stream generation), after a lost
host's shards are recreated (every shard redrawn, at a new generation) — the driver
takes their draw (:meth:`~flymc_dist.shard.Shard.bright_rows`) and starts again at step
0 of that generation, as the shards' own update would.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any

import numpy as np

from flymc_dist.protocol import Ahead, Proposals, ShardLost, Transport
from flymc_dist.replica import BrightReplica
from flymc_dist.streams import Z_DECIDE, stream_keys

#: read-ahead requests in a row that may lose a host (its shards recreated each time)
#: before a run gives up, as a round does
RECOVERIES = 5
#: the most one read-ahead request may cost a host, in bytes, counted as its shards'
#: :meth:`~flymc_dist.shard.Shard.proposal_bytes` per step (the rows read and prepared,
#: with their copies) times the steps: what the host builds and sends and the driver
#: holds at once. The reply itself is about a third of that, well inside the round
#: channel's frames (:data:`~flymc_dist.transport.channel.MAX_FRAME`, 64 MiB).
REPLY_BYTES = 32 * 2**20
#: the most the driver holds of one request's replies (every host's), in the same bytes:
#: with many hosts the steps per request grow with them (``read_ahead · H``), and this
#: keeps the driver's block bounded where each host's reply is small
BLOCK_BYTES = 4 * REPLY_BYTES
#: read-ahead requests in flight at most: the next block's and the one after it, so that
#: the hosts answer the second while the driver runs the first (one request in flight
#: left the driver waiting for the hosts: RWMH at 2·10⁶ × 57 on two local workers
#: waited 0.9 ms of each 64-iteration block's 3.6). Fewer when their replies would hold
#: more than :data:`BLOCK_BYTES` together.
IN_FLIGHT = 2

__all__ = ["BLOCK_BYTES", "IN_FLIGHT", "REPLY_BYTES", "ReadAhead", "fitting_depth"]


def fitting_depth(want: int, step_bytes: list[float], hosts: list[list[int]]) -> int:
    """Steps of proposals per read-ahead request: ``want``, and no more than keep every
    host's reply within :data:`REPLY_BYTES` and all of them within :data:`BLOCK_BYTES`
    (``step_bytes``: each shard's bytes per step; ``hosts``: each host's shards, as
    positions in that list). 0 when one step is already over: then the shards update z
    themselves, a round per iteration.

    At the default ``q_db`` steps are small (400k × 20 on two hosts, 4 chains, q ≈ 5·10⁻⁵:
    ~27 kB a step; the default 512 steps, 256 per host, ~14 MB). At 10⁶ × 10 on two hosts
    with ``q_db=0.05`` one step counts ~38 MB a host: none (16 steps made replies of
    79-126 MB, more than the channel's frames, and the driver would evaluate 10⁵ proposed
    rows an iteration that the shards evaluate in parallel)."""
    per_host = max(sum(step_bytes[i] for i in shards) for shards in hosts)
    total = sum(step_bytes)
    return int(min(want, REPLY_BYTES // max(per_host, 1.0), BLOCK_BYTES // max(total, 1.0)))


class Block:
    """The proposals of steps ``first .. first + depth - 1`` of every chain, merged over
    the shards: pair ``p = (step - first) * C + c`` at ``ids[seg[p]:seg[p+1]]`` (sorted),
    each at ``at`` in the rows ``(buffer, y, xi)`` (the buffer in
    :meth:`~flymc_dist.replica.BrightReplica.row_buffer`'s form, the row constants the
    hosts sent). Built as :meth:`~flymc_dist.protocol.Transport.post_ahead`'s
    ``prepare``: on the round channel on a thread of the transport's own while the
    driver runs the block before it, or by the driver when it asks first."""

    __slots__ = ("first", "ids", "seg", "at", "rows")

    def __init__(self, first: int, parts: list[Proposals], n_pairs: int, replica: BrightReplica):
        from flymc_dist._compiled import merge_pairs  # numba: where it computes

        self.first = first
        held = [p.rows for p in parts if p.rows.size]
        if all(a[-1] < b[0] for a, b in zip(held, held[1:], strict=False)):
            # the shards' rows in order (so joined, sorted): each pair's ids shard after
            # shard, where each shard said they are
            self.ids = np.empty(sum(p.ids.size for p in parts), dtype=np.int64)
            self.at = np.empty_like(self.ids)
            self.seg = np.empty(n_pairs + 1, dtype=np.int64)
            merge_pairs(
                np.stack([p.seg for p in parts]).astype(np.int64, copy=False),
                np.concatenate([p.ids for p in parts]).astype(np.int64, copy=False),
                np.concatenate([p.at for p in parts]).astype(np.int64, copy=False),
                np.cumsum([0] + [p.ids.size for p in parts], dtype=np.int64),
                np.cumsum([0] + [p.rows.size for p in parts[:-1]], dtype=np.int64),
                self.ids,
                self.at,
                self.seg,
            )
            X = [p.X for p in parts]  # copied once, into the buffer
            y, xi, consts = (
                np.concatenate([getattr(p, k) for p in parts]) for k in ("y", "xi", "consts")
            )
        else:
            labels = np.concatenate(
                [np.repeat(np.arange(n_pairs), np.diff(p.seg)) for p in parts]
            ).astype(np.int64)
            ids = np.concatenate([p.ids for p in parts]).astype(np.int64)
            order = np.argsort(labels, kind="stable")  # each pair's rows, shard after shard
            self.ids = ids[order]
            self.seg = np.zeros(n_pairs + 1, dtype=np.int64)
            np.cumsum(np.bincount(labels, minlength=n_pairs), out=self.seg[1:])
            rows = np.concatenate([p.rows for p in parts]).astype(np.int64)
            sort = np.argsort(rows, kind="stable")
            rows = rows[sort]
            X, y, xi, consts = (
                np.concatenate([getattr(p, k) for p in parts])[sort]
                for k in ("X", "y", "xi", "consts")
            )
            X = [X]
            self.at = np.searchsorted(rows, self.ids)
        self.rows = (replica.row_buffer(X, y, xi, consts), y, xi)

    def step(self, step: int, chains: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every chain's proposals at ``step``: ``(ids, seg, at)``."""
        i0 = (step - self.first) * chains
        a, b = self.seg[i0], self.seg[i0 + chains]
        return self.ids[a:b], self.seg[i0 : i0 + chains + 1] - a, self.at[a:b]


class ReadAhead:
    """The driver's implicit z-update in replica mode, its proposals read ahead.

    Parameters
    ----------
    transport
        Reaches the shard hosts (:meth:`~flymc_dist.protocol.Transport.post_ahead`).
    replica
        The driver's replica of every chain's bright rows (compiled: :attr:`fusable`).
    seed
        The run's seed (the z streams' key).
    q
        The dark→bright proposal probability.
    want
        Steps of proposals per request at most (the ``read_ahead`` option times the
        hosts, and out of core what each shard's memory budget holds).
    step_bytes
        Each shard's bytes of proposals per step
        (:meth:`~flymc_dist.shard.Shard.proposal_bytes`): the steps per request are as
        many as :func:`fitting_depth` allows, taken anew whenever the shards are placed
        again.
    """

    def __init__(
        self,
        transport: Transport,
        replica: BrightReplica,
        seed: int,
        q: float,
        want: int,
        step_bytes: list[float],
    ) -> None:
        if int(want) < 1:
            raise ValueError(f"read_ahead must be >= 1 here, got {want}")
        self.transport = transport
        self.replica = replica
        self.seed = int(seed)
        self.q = float(q)
        self.want = int(want)
        self.step_bytes = list(step_bytes)
        #: steps of proposals per request, and requests in flight at most
        #: (:meth:`take_shards_z` sets them)
        self.depth = 1
        self.in_flight = 1
        self.generation = 0
        #: the next z-update's step (in the streams of :attr:`generation`)
        self.step = 0
        self._block: Block | None = None
        #: the requests in flight, in the order sent: (first step, handle)
        self._pending: collections.deque[tuple[int, Any]] = collections.deque()
        #: read-ahead requests sent (each to every host that does not lend its rows) and
        #: wall seconds spent waiting
        self.requests = 0
        self.wait_seconds = 0.0

    def take_shards_z(self, positions: np.ndarray) -> None:
        """Start from the shards' current draw of z (at placement or after a redraw):
        the replica takes every chain's bright set, the steps restart at 0 of the
        transport's generation, the steps per request fit the hosts as they are now
        (the draws do not depend on them), and the first steps' proposals are asked for.
        ``positions`` are unused here (the shards drew z there). Hosts on the driver's
        machine lend it their rows anew (:meth:`~flymc_dist.protocol.Transport.borrow_rows`):
        their proposals are then read here, not asked for."""
        self._drain()
        self.transport.borrow_rows()
        self.replica.apply(self.transport.call("bright_rows"))
        self.generation = int(self.transport.generation)
        self.step = 0
        self._block = None
        # a recovery may have put several shards on one host: its replies grow with them
        self.depth = max(1, fitting_depth(self.want, self.step_bytes, self.transport.hosts))
        held = self.depth * sum(self.step_bytes)  # one request's replies, all hosts
        self.in_flight = max(1, min(IN_FLIGHT, int(BLOCK_BYTES // max(held, 1.0))))
        self._fill(0)  # the first steps' rows travel while the driver finishes its set-up

    def _drain(self) -> None:
        """Read and drop the answers of the requests still in flight (each connection
        answers its requests in turn): hosts lost on the way are not recovered here,
        the next call meets them."""
        while self._pending:
            _, handle = self._pending.popleft()
            self.transport.drop_ahead(handle)

    def _fill(self, first: int) -> None:
        """Post requests until :attr:`in_flight` are out: the steps after the last one
        in flight, or from ``first`` when none is."""
        nxt = self._pending[-1][0] + self.depth if self._pending else first
        while len(self._pending) < self.in_flight:
            ahead = Ahead(nxt, self.depth, self.generation)
            # the block may be built on a thread of the transport's own while the driver
            # computes: Block takes nothing the driver changes
            prepare = functools.partial(
                Block, nxt, n_pairs=self.depth * self.replica.chains, replica=self.replica
            )
            self._pending.append((nxt, self.transport.post_ahead(ahead, prepare)))
            # sent unless every host lends its rows (then drawn and read here)
            self.requests += self.transport.lending_hosts < len(self.transport.hosts)
            nxt += self.depth

    @property
    def held(self) -> Block | None:
        """The block of proposals held (None before the first), whatever steps it holds."""
        return self._block

    def block(self, positions: np.ndarray) -> Block:
        """The block of proposals that holds :attr:`step`: the one held, or the one read
        ahead for it (then the next one is asked for). ``positions`` are where the shards
        redraw z if a host was lost."""
        step = self.step
        block = self._block
        if block is not None and block.first <= step < block.first + self.depth:
            return block
        for _attempt in range(RECOVERIES):
            first = self.step - self.step % self.depth
            if not self._pending or self._pending[0][0] != first:
                self._drain()
                self._fill(first)
            _, handle = self._pending.popleft()
            t0 = time.perf_counter()
            block = self.transport.take_ahead(handle)
            self.wait_seconds += time.perf_counter() - t0
            if block is not None:
                break
            # hosts were lost and their shards recreated: redraw every z, from step 0 (the
            # requests sent to the hosts as they were are read and dropped)
            self._drain()
            self.transport.call("set_positions", positions, self.transport.generation)
            self.take_shards_z(positions)
        else:
            raise ShardLost(
                f"giving up: {RECOVERIES} read-ahead requests in a row lost a host (each "
                "time its shards were recreated and lost again: see the workers' logs, "
                "e.g. their memory limits)",
                [],
            )
        self._block = block
        self._fill(first + self.depth)
        return self._block

    def update(self, positions: np.ndarray) -> np.ndarray:
        """Every chain's z-update at ``positions`` on the replica (the shards' draws).
        Returns each chain's likelihood queries."""
        proposed = self.block(positions).step(self.step, self.replica.chains)
        keys = stream_keys(self.seed, self.generation, self.replica.chains, self.step, Z_DECIDE)
        queries = self.replica.update_z(positions, keys, self.q, proposed, self._block.rows)
        self.step += 1
        return queries

    def hand_back(self, positions: np.ndarray) -> None:
        """Give z back to the shards (:meth:`~flymc_dist.shard.Shard.set_bright`): each
        chain's bright rows of each shard, at ``positions``, their z-updates continuing at
        this step — for the driver to go on with shard-evaluated rounds."""
        self._drain()
        bright = self.replica.bright_ids()
        per_shard = []
        for spec in self.transport.specs:
            mine = [b[(b >= spec.start) & (b < spec.stop)] for b in bright]
            per_shard.append((positions, mine, self.step, self.generation))
        self.transport.call_each("set_bright", per_shard)

    def close(self) -> None:
        """Read the answers of the requests still in flight (the run is over)."""
        self._drain()
