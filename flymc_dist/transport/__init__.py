"""How the driver reaches its shards: in this process, or Dask actors over a socket channel.

- :mod:`flymc_dist.transport.inprocess`: :class:`InProcessTransport`, every shard in this
  process (``client="synchronous"``: tests, debugging);
- :mod:`flymc_dist.transport.dask`: connecting to Dask, placing the shard-host actors on
  workers, round trips with deadlines and fault recovery (:class:`DaskTransport`,
  :func:`open_transport`);
- :mod:`flymc_dist.transport.channel`: the direct socket channel the per-iteration rounds
  travel on (its server side runs in the shard hosts).

This ``__init__`` imports none of them, on purpose: the shard imports
:mod:`~flymc_dist.transport.channel` (the channel's server side), and the two transports
import the shard, so re-exporting them here would make an import cycle
(shard -> transport -> inprocess -> shard). Import from the modules themselves.
"""
