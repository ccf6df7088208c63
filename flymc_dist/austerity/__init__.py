"""Austerity MH (approximate, always labelled so): a sequential test over shards.

- :mod:`flymc_dist.austerity.sampler`: the driver side, the sequential t-test on
  minibatches drawn across shards (with control variates from the bounds), a sampler run
  by :func:`flymc_dist.run.run`;
- :mod:`flymc_dist.austerity.shard`: its shard side (row draws without replacement,
  batch statistics), run as named shard operations.

This ``__init__`` imports neither, on purpose: the FlyMC shard imports
:mod:`~flymc_dist.austerity.shard` (to list its operations) and the sampler reaches the
shards through :mod:`flymc_dist.transport.dask`, which imports the shard; a re-export
here would close the cycle shard -> austerity -> sampler -> transport -> shard.
"""
