"""Stochastic volatility over a panel of series (the sublinear-MH paper's Sec. 4.3):
conditional SMC with ancestor sampling on the shards, the shared (φ, σ) on the driver by
their exact conditionals or by subsampled MH over series (approximate)."""

from flymc_dist.sv.data import SeriesDataset, open_series, series_from_numpy, simulate_sv
from flymc_dist.sv.sampler import StochasticVolatility, SVResult, load_trace, sample_sv

__all__ = [
    "SVResult",
    "SeriesDataset",
    "StochasticVolatility",
    "load_trace",
    "open_series",
    "sample_sv",
    "series_from_numpy",
    "simulate_sv",
]
