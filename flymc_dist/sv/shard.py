"""One shard of a panel: a contiguous range of whole series, their current states for
every chain, and the statistics of the last sweep. An ordinary class: called in
process (``client="synchronous"``) or run as a Dask actor, one per shard."""

from __future__ import annotations

import time

import numpy as np
import zarr

from flymc_dist.sv.csmc import csmc_sweep, series_stats
from flymc_dist.sv.data import open_series

__all__ = ["SeriesShard"]


class SeriesShard:
    """Series ``start .. stop − 1`` of the store at ``path``.

    Parameters
    ----------
    path, start, stop
        The store and the shard's series range (whole chunks).
    chains, particles, seed
        The run's chains, particles per series, and seed.
    block
        Series per summed block: the sums of each global block of ``block`` series are
        returned separately and added by the driver in global order, so they are
        bit-identical whatever the layout (shards start at multiples of ``block``).
    traced
        Global indices of the series whose states are returned with every sweep.
    """

    def __init__(
        self,
        path: str,
        start: int,
        stop: int,
        *,
        chains: int,
        particles: int,
        seed: int,
        block: int,
        traced: tuple[int, ...] = (),
    ) -> None:
        if start % block:
            raise ValueError(f"shard start {start} is not a multiple of the block {block}")
        self.start, self.stop = int(start), int(stop)
        self.x = open_series(path).read(start, stop)
        self.chains, self.particles, self.seed, self.block = chains, particles, seed, block
        self.h = np.zeros((chains, stop - start, self.x.shape[1]))
        self.stats = np.zeros((chains, stop - start, 4))
        self.traced = [int(i) - start for i in traced if start <= int(i) < stop]

    def sweep(
        self,
        iteration: int,
        phis: np.ndarray,
        sigmas: np.ndarray,
        pending: np.ndarray,
        trial: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """One CSMC-AS sweep of every series for every chain.

        Parameters
        ----------
        iteration, phis, sigmas
            The iteration (keys the random numbers) and each chain's (φ, σ).
        pending
            Each chain's accepted scale of the last iteration's scale move, applied to
            the states before the sweep (1: none).
        trial
            Each chain's proposed scale ``c`` of this iteration's scale move.

        Returns
        -------
        sums, states, cpu
            Per chain and global block, the summed ``(S, C, Q, n, Δ)`` with
            ``Δ = Σ_t log N(x_t; 0, e^{c h_t}) − log N(x_t; 0, e^{h_t})`` at the new
            states: ``(chains, blocks, 5)``; the traced series' new states ``(chains, k, T)``;
            the CPU seconds of this call's thread (what the sweep costs whatever else the
            machine runs).
        """
        cpu0 = time.thread_time()
        n = self.stop - self.start
        nb = -(-n // self.block)
        sums = np.empty((self.chains, nb, 5))
        x2 = self.x * self.x
        for c in range(self.chains):
            if pending[c] != 1.0:
                self.h[c] *= pending[c]
            self.h[c] = csmc_sweep(
                self.x,
                self.h[c],
                float(phis[c]),
                float(sigmas[c]),
                seed=self.seed,
                chain=c,
                iteration=iteration,
                first_series=self.start,
                particles=self.particles,
            )
            self.stats[c] = series_stats(self.h[c])
            h = self.h[c]
            delta = -0.5 * ((trial[c] - 1.0) * h + x2 * (np.exp(-trial[c] * h) - np.exp(-h)))
            d = delta.sum(axis=1)
            for b in range(nb):
                blk = slice(b * self.block, (b + 1) * self.block)
                sums[c, b, :4] = self.stats[c, blk].sum(axis=0)
                sums[c, b, 4] = d[blk].sum()
        return sums, self.h[:, self.traced].copy(), time.thread_time() - cpu0

    def fetch(self, chain: int, series: np.ndarray) -> np.ndarray:
        """The last sweep's statistics of global series ``series`` for ``chain`` (before
        a pending scale: the driver applies it)."""
        return self.stats[chain, np.asarray(series, dtype=np.int64) - self.start]

    def save_states(self, trace: str, pending: np.ndarray) -> None:
        """Apply the pending scales, then write the states into the trace's ``h`` array
        (this shard's rows)."""
        for c in range(self.chains):
            if pending[c] != 1.0:
                self.h[c] *= pending[c]
                self.stats[c] = series_stats(self.h[c])
        g = zarr.open_group(store=trace, mode="r+", zarr_format=3)
        g["h"][:, self.start : self.stop] = self.h

    def load_states(self, trace: str) -> None:
        """Read the states back from the trace's ``h`` array (resume)."""
        g = zarr.open_group(store=trace, mode="r", zarr_format=3)
        self.h = np.asarray(g["h"][:, self.start : self.stop], dtype=np.float64)
        for c in range(self.chains):
            self.stats[c] = series_stats(self.h[c])

    def ping(self) -> int:
        """Series held (a liveness check)."""
        return self.stop - self.start
