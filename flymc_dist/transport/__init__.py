"""How the driver reaches its shards: in this process, or Dask actors over a socket channel.

- :mod:`flymc_dist.transport.inprocess`: :class:`InProcessTransport`, every shard in this
  process (``client="synchronous"``: tests, debugging);
- :mod:`flymc_dist.transport.dask`: connecting to Dask, placing the shard-host actors on
  workers, round trips with deadlines and fault recovery (:class:`DaskTransport`,
  :func:`open_transport`);
- :mod:`flymc_dist.transport.channel`: the direct socket channel the per-iteration rounds
  travel on (its server side runs in the shard hosts);
- :mod:`flymc_dist.transport.host`: :class:`ShardHost`, the shards of one place (in this
  process, or one Dask actor per worker) and the channel server their rounds arrive on.

This ``__init__`` imports none of them, on purpose: importing the package for one of them
(the channel, say) should not load the others (Dask, the shards). Import from the
modules themselves.
"""
