"""The benchmarks behind ``flymc bench NAME``, one module each.

- :mod:`flymc_dist.bench.overhead`: FlyMC's per-iteration cost against the bare round trip;
- :mod:`flymc_dist.bench.mixing`: converged draws per second of a whole run, FlyMC against
  regular MCMC;
- :mod:`flymc_dist.bench.scale`: FlyMC's cost per iteration against N, in memory and out
  of core;
- :mod:`flymc_dist.bench.sublinear`: austerity MH's data use against N, and its bias
  against eps;
- :mod:`flymc_dist.bench.table1`: the FlyMC paper's Table 1, all three rows, each
  configuration run until R-hat <= 1.01;
- :mod:`flymc_dist.bench.common`: what they share (:func:`~.common.reusable_store`); they
  start their clusters with :func:`flymc_dist.transport.dask.local_client`.

``flymc bench NAME`` imports ``flymc_dist.bench.NAME`` only when asked for it; this
``__init__`` imports none of them.
"""
