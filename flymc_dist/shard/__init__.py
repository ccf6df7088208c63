"""The worker side: a shard is state; a round is functions over a group of shards.

- :mod:`~flymc_dist.shard.state`: one :class:`Shard`: its rows, z, streams, set-up
  calls, full passes and the add-on samplers' interface, in memory or out of core
  (imports nothing of the round);
- :mod:`~flymc_dist.shard.round`: the round (commit, z-update, sums), written once over
  a group of shards (every shard of a host, or one);
- :mod:`~flymc_dist.shard.group`: the shards one host holds (:class:`ShardGroup`), each
  behind its lock, and the rounds and read-ahead requests over them;
- :mod:`~flymc_dist.shard.batched`: the compiled z-update of many (shard, chain) pairs;
- :mod:`~flymc_dist.shard.rows`: a shard's rows behind one interface, in memory or
  in a local row file;
- :mod:`~flymc_dist.shard.rowfile`: an out-of-core shard's row file, read by position.

A host (:class:`~flymc_dist.transport.host.ShardHost`, the transport's) owns a group and
the socket its rounds arrive on: nothing here imports it.
"""

from flymc_dist.shard.state import Shard

__all__ = ["Shard"]
