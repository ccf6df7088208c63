"""The in-process transport (the Dask one: :mod:`flymc_dist.transport.dask`).

A transport holds shards grouped in :class:`~flymc_dist.shard.ShardHost` objects and
returns every result as a list in *global shard order*, so the driver combines
them identically whatever the placement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from flymc_dist.protocol import (
    Ahead,
    Proposals,
    ReplicaReply,
    ReplicaRound,
    Reply,
    Round,
    ShardConfig,
    ShardSpec,
)
from flymc_dist.transport.host import ShardHost


class InProcessTransport:
    """All shards in this process: ``client="synchronous"`` (tests, debugging)."""

    name = "synchronous"

    def __init__(
        self,
        specs: list[ShardSpec],
        config: ShardConfig,
        data: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        self.specs = sorted(specs, key=lambda s: s.shard_id)
        self.host = ShardHost(self.specs, config, data)
        self.round_trips = 0
        #: random-stream generation of the shards' z draws (advanced on resume)
        self.generation = 0
        self.recoveries: list[dict[str, Any]] = []

    @property
    def n_workers(self) -> int:
        """Places the shards live in."""
        return 1

    @property
    def hosts(self) -> list[list[int]]:
        """Every shard, in this one place."""
        return [list(range(len(self.specs)))]

    @property
    def lending_hosts(self) -> int:
        """None: the shards are in this process."""
        return 0

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``Shard.<method>`` on every shard, in shard order."""
        self.round_trips += 1
        out = self.host.call(method, args, kwargs)
        return [out[s.shard_id] for s in self.specs]

    def call_each(self, method: str, per_shard: list[tuple]) -> list[Any]:
        """``Shard.<method>(*per_shard[i])`` on shard i, in shard order."""
        self.round_trips += 1
        out = self.host.call_each(
            method, {s.shard_id: a for s, a in zip(self.specs, per_shard, strict=True)}
        )
        return [out[s.shard_id] for s in self.specs]

    def call_some(self, method: str, per_shard: dict[int, tuple]) -> dict[int, Any]:
        """``Shard.<method>(*args)`` on the listed shards only (one round trip)."""
        self.round_trips += 1
        return self.host.call_each(method, per_shard)

    #: rounds are plain method calls
    channel = "in-process"

    def round(self, msg: Round | ReplicaRound, positions: np.ndarray) -> list[Reply | ReplicaReply]:
        """One protocol round on every shard (``positions`` serve fault recovery)."""
        self.round_trips += 1
        out = self.host.round(msg)
        return [out[s.shard_id] for s in self.specs]

    def post_ahead(self, msg: Ahead, prepare: Callable[[list[Proposals]], Any]) -> Any:
        """A read-ahead request, answered and ``prepare`` applied at once (one round
        trip)."""
        self.round_trips += 1
        out = self.host.proposals(msg.first, msg.count, msg.generation)
        return prepare([out[s.shard_id] for s in self.specs])

    def borrow_rows(self) -> None:
        """Nothing to borrow: the shards are in this process."""

    def take_ahead(self, handle: Any) -> Any:
        """What :meth:`post_ahead` prepared (nothing is ever lost in-process)."""
        return handle

    def drop_ahead(self, handle: Any) -> None:
        """Nothing to wait for: :meth:`post_ahead` answered at once."""

    def timing(self) -> list[dict[str, float]]:
        """:meth:`ShardHost.timing` of every host (here: one)."""
        return [self.host.timing()]

    def close(self) -> None:
        """Release the shards (an out-of-core shard's row file is removed)."""
        self.host.release()
