"""The worker side: a shard's rows, z and rounds.

- :mod:`~flymc_dist.shard.shard`: one :class:`Shard` and its :meth:`Shard.round`
  (commit, z-update, sums), in memory or out of core;
- :mod:`~flymc_dist.shard.fused`: the compiled path on arrays (the z-update of many
  chains at once, a round batched over a host's shards);
- :mod:`~flymc_dist.shard.evaluate`: the numpy reference of the bright terms;
- :mod:`~flymc_dist.shard.chunks`: an out-of-core shard's store reads and held rows;
- :mod:`~flymc_dist.shard.host`: :class:`ShardHost`, the shards of one place.
"""

from flymc_dist.shard.host import MANY_OUT_OF_CORE, ShardHost
from flymc_dist.shard.shard import SHARD_OPERATIONS, WINDOW_BYTES, Shard

__all__ = ["MANY_OUT_OF_CORE", "SHARD_OPERATIONS", "WINDOW_BYTES", "Shard", "ShardHost"]
