"""flymc_dist: exact Bayesian inference for tall data on a Dask cluster.

Firefly Monte Carlo (Maclaurin & Adams 2014) with collapsible lower bounds,
regular full-data MCMC as the baseline, and (approximate, labelled) austerity MH.
"""

from flymc_dist.api import sample
from flymc_dist.data import Dataset, from_numpy, open_dataset
from flymc_dist.models import LogisticRegression, RobustRegression, SoftmaxRegression
from flymc_dist.result import Result

__all__ = [
    "Dataset",
    "LogisticRegression",
    "Result",
    "RobustRegression",
    "SoftmaxRegression",
    "from_numpy",
    "open_dataset",
    "sample",
]

__version__ = "0.1.0"
