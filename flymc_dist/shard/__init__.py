"""The worker side: a shard's rows, z and rounds.

- :mod:`~flymc_dist.shard.shard`: one :class:`Shard`: its rows, z, streams and full
  passes, in memory or out of core;
- :mod:`~flymc_dist.shard.round`: the round (commit, z-update, sums), written once over
  the shards of a host;
- :mod:`~flymc_dist.shard.batched`: the compiled z-update of many (shard, chain) pairs;
- :mod:`~flymc_dist.shard.rows`: a shard's rows behind one interface, in memory or
  in a local row file;
- :mod:`~flymc_dist.shard.rowfile`: an out-of-core shard's row file, read by position;
- :mod:`~flymc_dist.shard.host`: :class:`ShardHost`, the shards of one place.
"""

from flymc_dist.shard.host import ShardHost
from flymc_dist.shard.shard import Shard

__all__ = ["Shard", "ShardHost"]
