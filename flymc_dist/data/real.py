"""Loaders for the real data sets shipped beside the project (never copied into it).

The data folder is located, in order, from

1. the environment variable ``FLYMC_DATA_DIR`` (if set, it is the only place searched:
   an explicit setting is never silently bypassed),
2. ``<repository root>/../shared/data`` (the repository root is the parent of the
   ``flymc_dist`` package directory),
3. ``/work/shared/data``.

A missing folder or file raises :class:`FileNotFoundError` with the places searched;
tests skip on that. See the folder's ``README.md`` for the contents of each archive.

Every loader returns ``(X, y)`` with ``X`` float64, C-contiguous, **bias column first**
(if ``bias=True``), and accepts ``return_info=True`` to return ``(X, y, info)`` where
``info`` is a small dict documented per loader (feature names, the standardisation
constants, PCA components, ...).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import scipy.linalg

from flymc_dist.data.store import Dataset
from flymc_dist.data.write import from_blocks

__all__ = [
    "data_dir",
    "mnist_7_vs_9",
    "mnist_classes",
    "qm9_gap",
    "flights",
    "flights_to_zarr",
    "FLIGHTS_HOUR_REFERENCE",
]

_MNIST = "mnist.npz"
_QM9 = "qm9_gap_57.npz"
_FLIGHTS = "flights_3m.npz"

#: Reference hour of day (no one-hot column) of the flights features; a busy hour, so
#: the hour one-hots are not nearly collinear with the bias column.
FLIGHTS_HOUR_REFERENCE = 12
_DOW_NAMES = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_FLIGHTS_BLOCK_ROWS = 2**16


def _candidates() -> list[Path]:
    out = []
    env = os.environ.get("FLYMC_DATA_DIR")
    if env:
        out.append(Path(env).expanduser())
    repo_root = Path(__file__).resolve().parent.parent
    out.append(repo_root.parent / "shared" / "data")
    out.append(Path("/work/shared/data"))
    return out


def data_dir(filename: str | None = None) -> Path:
    """The real-data folder (or a file in it).

    Parameters
    ----------
    filename : str, optional
        If given, the folder must contain this file and its path is returned.

    Returns
    -------
    pathlib.Path
        The first candidate folder (see the module docstring) that exists (and holds
        ``filename``).

    Raises
    ------
    FileNotFoundError
        None of the candidates exists (or holds ``filename``); the message lists them.
        If ``FLYMC_DATA_DIR`` is set, only it is searched.
    """
    env = os.environ.get("FLYMC_DATA_DIR")
    cands = [Path(env).expanduser()] if env else _candidates()
    for c in cands:
        if c.is_dir() and (filename is None or (c / filename).is_file()):
            return c if filename is None else c / filename
    what = f"the file {filename!r}" if filename else "the real-data folder"
    raise FileNotFoundError(
        f"cannot find {what}; looked in: {', '.join(str(c) for c in cands)}. "
        "Set FLYMC_DATA_DIR to the folder holding mnist.npz, qm9_gap_57.npz and "
        "flights_3m.npz."
    )


def _with_bias(Z: np.ndarray, bias: bool) -> np.ndarray:
    n, d = Z.shape
    if not bias:
        return np.ascontiguousarray(Z, dtype=np.float64)
    X = np.empty((n, d + 1), dtype=np.float64)
    X[:, 0] = 1.0
    X[:, 1:] = Z
    return X


def _check_int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {v}")
    return int(v)


# --------------------------------------------------------------------------- MNIST


def _pca(Xc: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k principal axes of centred ``Xc`` via ``eigh`` of the scatter matrix.

    Sign convention: the entry of largest magnitude of every axis is positive.
    Returns ``(components (p, k), variances (k,))``.
    """
    S = Xc.T @ Xc
    p = S.shape[0]
    w, V = scipy.linalg.eigh(S, subset_by_index=[p - k, p - 1])  # ascending
    order = np.arange(k)[::-1]
    w, V = w[order], V[:, order]
    piv = np.argmax(np.abs(V), axis=0)
    V *= np.sign(V[piv, np.arange(V.shape[1])])
    return np.ascontiguousarray(V), w / max(Xc.shape[0] - 1, 1)


def mnist_classes(
    classes: Sequence[int] | None = (0, 1, 2),
    n_components: int = 50,
    bias: bool = True,
    *,
    return_info: bool = False,
) -> tuple[np.ndarray, ...] | tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """MNIST training images of some digits, PCA-projected (softmax / logistic regression).

    Pixels are scaled to [0, 1], centred on the mean of the selected images and projected
    onto their first ``n_components`` principal components (computed on exactly those
    images with ``eigh`` of the 784 x 784 scatter matrix; each component's largest-magnitude
    loading is positive, so the result is deterministic). A bias column of ones is put
    first if ``bias``.

    Parameters
    ----------
    classes : sequence of int or None, default (0, 1, 2)
        Distinct digits (at least 2); ``None`` for all ten. Label ``k`` in the output is
        ``classes[k]`` (the order given).
    n_components : int, default 50
        Number of principal components, 1..784.
    bias : bool, default True
        Prepend a column of ones.
    return_info : bool, default False
        Also return ``info``: ``{"classes", "mean" (784,), "components" (784, k),
        "explained_variance" (k,), "feature_names"}`` — apply ``(x / 255 - mean) @
        components`` to project other images the same way.

    Returns
    -------
    X : ndarray, shape (N, n_components + bias)
    y : ndarray of int64, shape (N,)
        Values 0..K-1.
    info : dict, only if ``return_info``
    """
    if classes is None:
        classes = tuple(range(10))
    cls = [_check_int("each class", c, 0, 9) for c in classes]
    if len(cls) < 2 or len(set(cls)) != len(cls):
        raise ValueError(f"classes must be at least 2 distinct digits, got {list(classes)}")
    k = _check_int("n_components", n_components, 1, 784)
    with np.load(data_dir(_MNIST)) as f:
        Xr, yr = f["X_train"], f["y_train"]
    mask = np.isin(yr, cls)
    labels = yr[mask]
    Xs = Xr[mask].astype(np.float64)
    Xs /= 255.0
    mean = Xs.mean(axis=0)
    Xs -= mean
    comps, var = _pca(Xs, k)
    X = _with_bias(Xs @ comps, bias)
    lut = np.full(10, -1, dtype=np.int64)
    lut[cls] = np.arange(len(cls))
    y = lut[labels]
    if not return_info:
        return X, y
    names = (["bias"] if bias else []) + [f"pc{i + 1}" for i in range(k)]
    info = {
        "classes": cls,
        "mean": mean,
        "components": comps,
        "explained_variance": var,
        "feature_names": names,
    }
    return X, y, info


def mnist_7_vs_9(
    n_components: int = 50, bias: bool = True, *, return_info: bool = False
) -> tuple[np.ndarray, ...] | tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The FlyMC paper's logistic-regression data: MNIST training 7s and 9s.

    12,214 images (6,265 sevens, 5,949 nines), PCA-50 + bias = 51 features;
    ``y = 1`` for a 9 and ``0`` for a 7. Same as ``mnist_classes((7, 9), ...)``.

    Parameters
    ----------
    n_components : int, default 50
    bias : bool, default True
    return_info : bool, default False
        See :func:`mnist_classes`.

    Returns
    -------
    X : ndarray, shape (12214, n_components + bias)
    y : ndarray of int64 in {0, 1}
    info : dict, only if ``return_info``
    """
    return mnist_classes((7, 9), n_components=n_components, bias=bias, return_info=return_info)


# --------------------------------------------------------------------------- QM9


def qm9_gap(
    standardise: bool = True,
    bias: bool = True,
    *,
    drop_duplicates: bool = False,
    return_info: bool = False,
) -> tuple[np.ndarray, ...] | tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """QM9 HOMO-LUMO gap on 57 RDKit descriptors (robust regression, OPV stand-in).

    Columns that are exactly constant (``NumRadicalElectrons``) are dropped, leaving 56
    descriptors (+ bias = 57 features). With ``standardise`` every remaining column and
    ``y`` are centred and scaled to unit standard deviation (population sd, ``ddof=0``).
    Strongly collinear columns (e.g. ``MolWt`` / ``HeavyAtomMolWt`` / ``ExactMolWt``) are
    kept: a real-data property. Six columns are exact copies of another one in QM9
    (``MaxEStateIndex`` = ``MaxAbsEStateIndex`` and ``Chi{0..4}v`` = ``Chi{0..4}n``), so by
    default X has rank 51 of 57 and the likelihood is flat along 6 directions (only the
    prior identifies them); ``drop_duplicates=True`` removes them (50 + bias, full rank).

    Parameters
    ----------
    standardise : bool, default True
        Standardise X columns and y. If False, X is the raw descriptors (float64) and y
        the gap in hartree.
    bias : bool, default True
        Prepend a column of ones (after standardising).
    drop_duplicates : bool, default False
        Also drop every column exactly equal to an earlier one (they are listed in
        ``info["dropped"]`` too).
    return_info : bool, default False
        Also return ``info = {"feature_names", "dropped", "x_mean", "x_sd", "y_mean",
        "y_sd", "index"}``: names of the kept columns (with ``"bias"`` first if
        ``bias``), names of the dropped ones, the standardisation constants of the kept
        columns (``x_mean``/``x_sd`` arrays, ``y_mean``/``y_sd`` floats; means 0 and sds 1
        if not ``standardise``) and the QM9 molecule index of every row. The gap in
        hartree is ``y * y_sd + y_mean``.

    Returns
    -------
    X : ndarray, shape (130831, 56 + bias) (50 + bias with ``drop_duplicates``)
    y : ndarray of float64, shape (130831,)
    info : dict, only if ``return_info``
    """
    with np.load(data_dir(_QM9)) as f:
        Xr = f["X"].astype(np.float64)
        y = f["y"].astype(np.float64)
        names = [str(s) for s in f["feature_names"]]
        index = f["index"]
    keep = np.ptp(Xr, axis=0) > 0
    if drop_duplicates:
        cols = np.ascontiguousarray(Xr.T)  # contiguous columns for fast comparison
        sums = cols.sum(axis=1)
        for j in range(cols.shape[0]):
            if keep[j] and any(
                keep[i] and sums[i] == sums[j] and np.array_equal(cols[i], cols[j])
                for i in range(j)
            ):
                keep[j] = False
        del cols
    dropped = [n for n, k in zip(names, keep, strict=True) if not k]
    Z = np.ascontiguousarray(Xr[:, keep])
    del Xr
    kept = [n for n, k in zip(names, keep, strict=True) if k]
    if standardise:
        x_mean = Z.mean(axis=0)
        x_sd = Z.std(axis=0)
        Z -= x_mean
        Z /= x_sd
        y_mean = float(y.mean())
        y_sd = float(y.std())
        y = (y - y_mean) / y_sd
    else:
        x_mean, x_sd = np.zeros(Z.shape[1]), np.ones(Z.shape[1])
        y_mean, y_sd = 0.0, 1.0
    X = _with_bias(Z, bias)
    if not return_info:
        return X, y
    info = {
        "feature_names": (["bias"] if bias else []) + kept,
        "dropped": dropped,
        "x_mean": x_mean,
        "x_sd": x_sd,
        "y_mean": y_mean,
        "y_sd": y_sd,
        "index": index,
    }
    return X, y, info


# --------------------------------------------------------------------------- flights


class _FlightsPlan:
    """Row selection, constants and names of the flights features (small: 1-D arrays)."""

    def __init__(self, n_rows: int | None, n_airports: int, seed: int) -> None:
        # cheap checks before loading anything
        if n_rows is not None:
            _check_int("n_rows", n_rows, 1)
        _check_int("n_airports", n_airports, 0)
        _check_int("seed", seed, 0)
        with np.load(data_dir(_FLIGHTS)) as f:
            minute = f["minute"]
            delay = f["delay"]
            distance = f["distance"]
            origin = f["origin"]
            dest = f["destination"]
            origin_names = [str(s) for s in f["origin_names"]]
            dest_names = [str(s) for s in f["destination_names"]]
        total = minute.shape[0]
        n_air = _check_int("n_airports", n_airports, 0, min(len(origin_names), len(dest_names)))
        # Busiest airports over the whole file (independent of the row subset).
        self.top_origin = np.argsort(
            -np.bincount(origin, minlength=len(origin_names)), kind="stable"
        )[:n_air]
        self.top_dest = np.argsort(-np.bincount(dest, minlength=len(dest_names)), kind="stable")[
            :n_air
        ]
        if n_rows is None:
            rows = None
            n = total
        else:
            n = _check_int("n_rows", n_rows, 1, total)
            rng = np.random.default_rng(np.random.SeedSequence(_check_int("seed", seed, 0)))
            rows = np.sort(rng.choice(total, size=n, replace=False))
        self.n_rows = n

        def take(a: np.ndarray) -> np.ndarray:
            return a if rows is None else a[rows]

        self.minute = take(minute)
        self.delay = take(delay)
        self.distance = take(distance)
        self.origin = take(origin)
        self.dest = take(dest)
        logd = np.log(self.distance.astype(np.float64))
        self.logd_mean, self.logd_sd = float(logd.mean()), float(logd.std())
        days = (self.minute - self.minute.min()) / 1440.0
        self.t0 = int(self.minute.min())
        self.days_mean, self.days_sd = float(days.mean()), float(days.std()) or 1.0
        self.hours = [h for h in range(24) if h != FLIGHTS_HOUR_REFERENCE]
        self.names = (
            ["bias", "log_distance", "trend"]
            + [f"hour_{h:02d}" for h in self.hours]
            + [f"dow_{d}" for d in _DOW_NAMES[1:]]
            + [f"month_{m:02d}" for m in range(2, 7)]
            + [f"origin_{origin_names[i]}" for i in self.top_origin]
            + [f"dest_{dest_names[i]}" for i in self.top_dest]
        )
        self.n_features = len(self.names)

    def block(self, s: int, e: int, dtype: Any = np.float64) -> tuple[np.ndarray, np.ndarray]:
        m = e - s
        minute = self.minute[s:e]
        X = np.zeros((m, self.n_features), dtype=dtype)
        X[:, 0] = 1.0
        X[:, 1] = (np.log(self.distance[s:e].astype(np.float64)) - self.logd_mean) / self.logd_sd
        X[:, 2] = ((minute - self.t0) / 1440.0 - self.days_mean) / self.days_sd
        col = 3
        r = np.arange(m)
        # hour one-hots (reference FLIGHTS_HOUR_REFERENCE)
        hour = (minute // 60) % 24
        hcol = np.full(24, -1)
        hcol[self.hours] = np.arange(23)
        hc = hcol[hour]
        ok = hc >= 0
        X[r[ok], col + hc[ok]] = 1.0
        col += 23
        # day of week, Monday = 0 (1970-01-01 was a Thursday); reference Monday
        dow = (minute // 1440 + 3) % 7
        ok = dow > 0
        X[r[ok], col + dow[ok] - 1] = 1.0
        col += 6
        # month 1..6 (Jan-Jun 2001; the 6 rows at 2001-07-01 00:00 count as June);
        # reference January
        month = minute.astype("datetime64[m]").astype("datetime64[M]").astype(np.int64) % 12 + 1
        month = np.minimum(month, 6)
        ok = month > 1
        X[r[ok], col + month[ok] - 2] = 1.0
        col += 5
        for codes, top in ((self.origin[s:e], self.top_origin), (self.dest[s:e], self.top_dest)):
            for j, a in enumerate(top):
                X[codes == a, col + j] = 1.0
            col += len(top)
        return X, self.delay[s:e].astype(np.float64)

    def blocks(self, dtype: Any = np.float64) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for s in range(0, self.n_rows, _FLIGHTS_BLOCK_ROWS):
            yield self.block(s, min(s + _FLIGHTS_BLOCK_ROWS, self.n_rows), dtype)

    def info(self) -> dict[str, Any]:
        return {
            "feature_names": list(self.names),
            "log_distance_mean": self.logd_mean,
            "log_distance_sd": self.logd_sd,
            "trend_origin_minute": self.t0,
            "trend_mean_days": self.days_mean,
            "trend_sd_days": self.days_sd,
            "hour_reference": FLIGHTS_HOUR_REFERENCE,
            "dow_reference": "Mon",
            "month_reference": 1,
        }


def flights(
    n_rows: int | None = None,
    n_airports: int = 10,
    *,
    seed: int = 0,
    dtype: Any = np.float64,
    return_info: bool = False,
) -> tuple[np.ndarray, ...] | tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """US domestic flights, Jan-Jun 2001: arrival delay (minutes) for robust regression.

    Features (57 with the default ``n_airports=10``), in order:

    * ``bias`` (ones);
    * ``log_distance``: log of the distance in miles, standardised;
    * ``trend``: days since the first scheduled flight, standardised;
    * ``hour_HH``: 23 one-hots for the scheduled hour, reference hour
      :data:`FLIGHTS_HOUR_REFERENCE` (12);
    * ``dow_Tue`` ... ``dow_Sun``: 6 day-of-week one-hots, reference Monday;
    * ``month_02`` ... ``month_06``: 5 month one-hots, reference January (the 6 flights
      scheduled at 2001-07-01 00:00 count as June);
    * ``origin_XXX``, ``dest_XXX``: one-hots for the ``n_airports`` busiest origin and
      destination airports (busiest over the whole file); all others are the reference.

    Standardisation constants are computed on the selected rows (``info``). The output is
    filled block by block (no full-size temporaries beyond the result itself; the result
    for all 3M rows in float64 is 1.4 GB — see :func:`flights_to_zarr` for a bounded-memory
    alternative).

    Parameters
    ----------
    n_rows : int, optional
        ``None``: all 3,000,000 rows in file (time) order. Otherwise a uniformly random
        subset of that size without replacement, drawn with ``seed``, kept in time order.
    n_airports : int, default 10
        Busiest airports one-hot encoded (for origin and for destination each);
        features = 37 + 2 * n_airports.
    seed : int, default 0
        Seed of the row subset (unused when ``n_rows`` is None).
    dtype : numpy dtype, default float64
        dtype of ``X`` (float32 halves the memory).
    return_info : bool, default False
        Also return ``info`` (feature names, standardisation constants, references).

    Returns
    -------
    X : ndarray, shape (n_rows, 37 + 2 * n_airports)
    y : ndarray of float64 (arrival delay in minutes)
    info : dict, only if ``return_info``
    """
    plan = _FlightsPlan(n_rows, n_airports, seed)
    X = np.empty((plan.n_rows, plan.n_features), dtype=dtype)
    y = np.empty(plan.n_rows, dtype=np.float64)
    s = 0
    for Xb, yb in plan.blocks(dtype):
        e = s + Xb.shape[0]
        X[s:e] = Xb
        y[s:e] = yb
        s = e
    if return_info:
        return X, y, plan.info()
    return X, y


def flights_to_zarr(
    path: str | os.PathLike[str],
    n_rows: int | None = None,
    n_airports: int = 10,
    *,
    seed: int = 0,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Write the :func:`flights` features to a flymc_dist store, chunk by chunk.

    Memory stays bounded (the 1-D source columns, ~60 MB, plus a few blocks) whatever
    ``n_rows``. Writing is atomic as for :func:`flymc_dist.data.from_numpy`.

    Parameters
    ----------
    path : str or os.PathLike
        Destination (local path or fsspec URL).
    n_rows, n_airports, seed
        As in :func:`flights`.
    chunk_rows : int, optional
        Rows per zarr chunk (default ~8 MiB chunks).
    overwrite : bool, default False
        Replace an existing store.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X`` (reads return float64 either way).

    Returns
    -------
    Dataset
        Task ``"real"``; the ``info`` of :func:`flights` is stored in the group attributes
        (under ``"flights"``), and ``feature_names`` as usual.
    """
    plan = _FlightsPlan(n_rows, n_airports, seed)
    info = plan.info()
    names = info.pop("feature_names")
    return from_blocks(
        plan.blocks(),
        path,
        plan.n_rows,
        plan.n_features,
        task="real",
        chunk_rows=chunk_rows,
        overwrite=overwrite,
        feature_names=names,
        dtype=dtype,
        attrs={
            "source": "flights_3m.npz",
            "flights": {**info, "seed": seed, "n_airports": n_airports},
        },
    )
