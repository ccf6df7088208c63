"""JointDPM: the joint Dirichlet process mixture of logistic experts (the sublinear-MH
paper's Sec. 4.2) on shards.

- :mod:`~flymc_dist.jointdpm.niw`: the collapsed Normal-inverse-Wishart statistics
  (rank-one Cholesky up/downdates, Student-t predictive, marginal likelihood);
- :mod:`~flymc_dist.jointdpm.shard`: a shard's rows, labels and order-statistic member index;
- :mod:`~flymc_dist.jointdpm.transport`: the shards in process or as Dask actors (lost ones
  recreated);
- :mod:`~flymc_dist.jointdpm.sampler`: the driver (α, collapsed Gibbs on labels,
  austerity or exact MH on each cluster's weights) and :func:`sample_jointdpm`;
- :mod:`~flymc_dist.jointdpm.data`: the paper's four-blob data.
"""

from flymc_dist.jointdpm.sampler import DPMResult, JointDPMSampler, sample_jointdpm

__all__ = ["DPMResult", "JointDPMSampler", "sample_jointdpm"]
