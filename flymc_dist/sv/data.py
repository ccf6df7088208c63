"""A panel of series: a zarr v3 store holding one array ``x`` of shape
``(n_series, T)``, chunked by whole series, and the synthetic stochastic-volatility
panels of the tests and benchmarks.

A store is written to a temporary directory beside its path and renamed into place, so
a failed write leaves nothing behind. Shards are ranges of whole chunks: a series is
never split.
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

__all__ = ["KIND", "SeriesDataset", "open_series", "series_from_numpy", "simulate_sv"]

#: the store's ``kind`` attribute
KIND = "series"


def _chunk_series(n_series: int, length: int) -> int:
    """Series per chunk: about 4 MB of float64, at least 256 (a power of two)."""
    target = max(256, (4 << 20) // (8 * max(length, 1)))
    return int(min(1 << int(math.log2(target)), max(1, n_series)))


@dataclass(frozen=True)
class SeriesDataset:
    """A panel store: ``n_series`` series of length ``length``, chunked by ``chunk`` series."""

    path: str
    n_series: int
    length: int
    chunk: int

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Series ``start .. stop − 1`` as a ``(series, T)`` float64 array."""
        stop = self.n_series if stop is None else stop
        if not 0 <= start <= stop <= self.n_series:
            raise ValueError(f"series range [{start}, {stop}) is outside [0, {self.n_series})")
        g = zarr.open_group(store=self.path, mode="r", zarr_format=3)
        return np.asarray(g["x"][start:stop], dtype=np.float64)

    def shard_ranges(self, n_shards: int) -> list[tuple[int, int]]:
        """``n_shards`` contiguous ranges of whole chunks, as even as possible (fewer when
        there are fewer chunks)."""
        if int(n_shards) < 1:
            raise ValueError(f"n_shards must be >= 1, got {n_shards}")
        n_chunks = -(-self.n_series // self.chunk)
        k = min(int(n_shards), n_chunks)
        edges = np.minimum(np.linspace(0, n_chunks, k + 1).astype(int) * self.chunk, self.n_series)
        return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def series_from_numpy(
    x: Any, path: str | os.PathLike[str], *, chunk: int | None = None, overwrite: bool = False
) -> SeriesDataset:
    """Validate a panel and write it to a zarr store.

    Parameters
    ----------
    x
        ``(n_series, T)`` finite real observations, ``T >= 2``.
    path
        Where the store goes (a local directory).
    chunk
        Series per chunk (default: about 4 MB, at least 256); a shard is whole chunks.
    overwrite
        Replace an existing store at ``path``.

    Returns
    -------
    SeriesDataset
    """
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"x must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2:
        raise ValueError(f"x must be (n_series >= 1, T >= 2), got shape {arr.shape}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError("x must be finite (no NaN or inf)")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"path {path!r} exists; pass overwrite=True to replace it")
    c = _chunk_series(*arr.shape) if chunk is None else int(chunk)
    if c < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        g = zarr.open_group(store=tmp, mode="w", zarr_format=3)
        a = g.create_array("x", shape=arr.shape, chunks=(c, arr.shape[1]), dtype="float64")
        a[:] = arr
        g.attrs.update({"kind": KIND, "n_series": arr.shape[0], "length": arr.shape[1]})
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return SeriesDataset(path, arr.shape[0], arr.shape[1], c)


def open_series(path: str | os.PathLike[str]) -> SeriesDataset:
    """Open a panel store written by :func:`series_from_numpy`."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(os.path.join(path, "zarr.json")):
        raise ValueError(f"{path!r} is not a zarr v3 store (no zarr.json)")
    g = zarr.open_group(store=path, mode="r", zarr_format=3)
    if g.attrs.get("kind") != KIND or "x" not in g:
        raise ValueError(f"{path!r} is not a series store (kind {g.attrs.get('kind')!r})")
    a = g["x"]
    if a.ndim != 2 or a.shape != (g.attrs["n_series"], g.attrs["length"]):
        raise ValueError(f"{path!r}: array x has shape {a.shape}, attributes disagree")
    return SeriesDataset(path, int(a.shape[0]), int(a.shape[1]), int(a.chunks[0]))


def simulate_sv(
    n_series: int, length: int, phi: float, sigma: float, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """A panel from the model: ``h_t ~ N(φ h_{t−1}, σ²)``, ``h_0 = 0``,
    ``x_t = exp(h_t / 2) ε_t``.

    Returns
    -------
    x, h
        Observations and states, each ``(n_series, length)``.
    """
    if n_series < 1 or length < 2:
        raise ValueError(f"need n_series >= 1 and length >= 2, got {n_series}, {length}")
    rng = np.random.default_rng(seed)
    h = np.empty((n_series, length))
    prev = np.zeros(n_series)
    for t in range(length):
        prev = phi * prev + sigma * rng.standard_normal(n_series)
        h[:, t] = prev
    x = np.exp(h / 2) * rng.standard_normal((n_series, length))
    return x, h
