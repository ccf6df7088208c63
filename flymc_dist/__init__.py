"""flymc_dist: exact Bayesian inference for tall data on a Dask cluster.

Firefly Monte Carlo (Maclaurin & Adams 2014) with collapsible lower bounds,
regular full-data MCMC as the baseline, and (approximate, labelled) austerity MH.
"""

from flymc_dist.api import sample
from flymc_dist.dask_data import from_dask, from_zarr
from flymc_dist.data import Dataset, from_numpy, from_parquet, ingest, open_dataset
from flymc_dist.jointdpm import sample_jointdpm
from flymc_dist.kernels import HMC, MALA, NUTS
from flymc_dist.kernels import RandomWalkMH as RWMH
from flymc_dist.kernels import SliceSampler as Slice
from flymc_dist.models import (
    GLM,
    CustomFamily,
    LogisticRegression,
    RobustRegression,
    SoftmaxRegression,
)
from flymc_dist.options import Austerity, FlyMC, JointDPM, Placement, Regular
from flymc_dist.predictive import compare
from flymc_dist.result import Result
from flymc_dist.sv import (
    StochasticVolatility,
    open_series,
    sample_sv,
    series_from_numpy,
)

__all__ = [
    "GLM",
    "HMC",
    "MALA",
    "NUTS",
    "RWMH",
    "Austerity",
    "CustomFamily",
    "Dataset",
    "FlyMC",
    "JointDPM",
    "LogisticRegression",
    "Placement",
    "Regular",
    "Result",
    "RobustRegression",
    "Slice",
    "SoftmaxRegression",
    "StochasticVolatility",
    "compare",
    "from_dask",
    "from_numpy",
    "from_parquet",
    "from_zarr",
    "ingest",
    "open_dataset",
    "open_series",
    "sample",
    "sample_jointdpm",
    "sample_sv",
    "series_from_numpy",
]

__version__ = "0.1.0"
