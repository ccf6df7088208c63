"""Synthetic data sets, written chunk by chunk (:func:`make_logistic`, :func:`make_softmax`,
:func:`make_robust`, :func:`make_opv_like`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from scipy.special import ndtr

from flymc_dist.data.store import Dataset, check_dtype
from flymc_dist.data.write import from_blocks

__all__ = ["make_logistic", "make_opv_like", "make_robust", "make_softmax"]

#: Rows per generation block of the synthetic generators (independent of ``chunk_rows``).
_GEN_BLOCK_ROWS = 2**15


# --------------------------------------------------------------------------- generators
#
# Each generator draws its global parameters (true theta, correlations) from
# SeedSequence(seed, spawn_key=(kind, 0)) and the rows in fixed blocks of _GEN_BLOCK_ROWS
# rows, block b from SeedSequence(seed, spawn_key=(kind, 1, b)). The output therefore
# depends only on (seed, n_rows, n_features, ...) and not on chunk_rows; at most one block
# plus one chunk of rows is in memory at a time.

_KIND = {"logistic": 1, "softmax": 2, "robust": 3, "opv": 4, "probit": 5, "negative_binomial": 6}


def _check_gen_args(n_rows: Any, n_features: Any, seed: Any) -> tuple[int, int, int]:
    for name, v, lo in (("n_rows", n_rows, 1), ("n_features", n_features, 1), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise ValueError(f"{name} must be an integer, got {v!r}")
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(n_rows), int(n_features), int(seed)


def _param_rng(seed: int, kind: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_KIND[kind], 0)))


def _block_rngs(seed: int, kind: str, n_rows: int) -> Iterator[tuple[int, np.random.Generator]]:
    for b, s in enumerate(range(0, n_rows, _GEN_BLOCK_ROWS)):
        n = min(_GEN_BLOCK_ROWS, n_rows - s)
        yield n, np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_KIND[kind], 1, b)))


def _features(rng: np.random.Generator, n: int, d: int, chol: np.ndarray | None) -> np.ndarray:
    """Bias column of ones, then d-1 N(0, 1) (or N(0, chol chol^T)) features."""
    X = np.empty((n, d), dtype=np.float64)
    X[:, 0] = 1.0
    if d > 1:
        Z = rng.standard_normal((n, d - 1))
        X[:, 1:] = Z if chol is None else Z @ chol.T
    return X


def _weights(rng: np.random.Generator, d: int, norm: float, bias_sd: float) -> np.ndarray:
    """Bias ~ N(0, bias_sd^2); the other weights a random direction of length ``norm``."""
    theta = np.empty(d)
    theta[0] = bias_sd * rng.standard_normal()
    if d > 1:
        w = rng.standard_normal(d - 1)
        theta[1:] = norm * w / np.linalg.norm(w)
    return theta


def _gen_names(d: int) -> list[str]:
    return ["bias"] + [f"x{i}" for i in range(1, d)]


def _stored(X: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``X`` as it will read back from a store of ``dtype`` (rounded once, as float64)."""
    return X if dtype == np.float64 else X.astype(dtype).astype(np.float64)


def make_logistic(
    path: str | os.PathLike[str],
    n_rows: int,
    n_features: int,
    seed: int = 0,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    *,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Synthetic logistic-regression data, written chunk by chunk.

    ``x = (1, z)`` with ``z ~ N(0, I_{D-1})``; ``y ~ Bernoulli(sigmoid(theta^T x))``. The
    true ``theta`` has bias ``~ N(0, 0.5^2)`` and a uniformly random direction of length
    1.5 for the other weights, so the logit has sd ~1.5 whatever D is: about 25% of the
    labels are "wrong", the problem is far from separable for N >> D and far from trivial.

    Parameters
    ----------
    path : str or os.PathLike
        Destination.
    n_rows : int
        N >= 1.
    n_features : int
        D >= 1, including the bias column (column 0).
    seed : int, default 0
        The output depends only on (seed, n_rows, n_features), not on ``chunk_rows``.
    chunk_rows : int, optional
        Rows per chunk.
    overwrite : bool, default False
        Replace an existing store.
    storage_options : dict, optional
        fsspec options for a URL ``path``.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X``. The features are drawn in float64 and rounded once to
        ``dtype``; the targets are drawn given the rounded features, so the stored data
        are an exact draw from the model. float64 output does not depend on this option.

    Returns
    -------
    Dataset
        Task ``"binary"``; attrs ``true_theta`` (list of D floats), ``generator``, ``seed``.
    """
    n, d, seed = _check_gen_args(n_rows, n_features, seed)
    x_dtype = check_dtype(dtype)
    theta = _weights(_param_rng(seed, "logistic"), d, norm=1.5, bias_sd=0.5)

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for m, rng in _block_rngs(seed, "logistic", n):
            X = _stored(_features(rng, m, d, None), x_dtype)
            p = 0.5 * (1.0 + np.tanh(0.5 * (X @ theta)))  # sigmoid, overflow-free
            yield X, (rng.random(m) < p).astype(np.int64)

    return from_blocks(
        blocks(),
        path,
        n,
        d,
        task="binary",
        chunk_rows=chunk_rows,
        overwrite=overwrite,
        feature_names=_gen_names(d),
        storage_options=storage_options,
        dtype=x_dtype,
        attrs={"generator": "make_logistic", "seed": seed, "true_theta": theta},
    )


def make_softmax(
    path: str | os.PathLike[str],
    n_rows: int,
    n_features: int,
    n_classes: int,
    seed: int = 0,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    *,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Synthetic softmax-regression data, written chunk by chunk.

    ``x = (1, z)``, ``z ~ N(0, I_{D-1})``; ``y ~ Categorical(softmax(theta x))`` with
    ``theta`` of shape (K, D): each row has bias ``~ N(0, 0.5^2)`` and non-bias weights of
    a random direction with length 1.5.

    Parameters
    ----------
    path : str or os.PathLike
        Destination.
    n_rows, n_features : int
        N >= 1 and D >= 1 (including the bias column 0).
    n_classes : int
        K >= 2.
    seed : int, default 0
        Output depends only on (seed, n_rows, n_features, n_classes).
    chunk_rows : int, optional
        Rows per chunk.
    overwrite : bool, default False
        Replace an existing store.
    storage_options : dict, optional
        fsspec options for a URL ``path``.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X``. The features are drawn in float64 and rounded once to
        ``dtype``; the targets are drawn given the rounded features, so the stored data
        are an exact draw from the model. float64 output does not depend on this option.

    Returns
    -------
    Dataset
        Task ``"multiclass"``; attrs ``true_theta`` (K lists of D floats).
    """
    n, d, seed = _check_gen_args(n_rows, n_features, seed)
    x_dtype = check_dtype(dtype)
    if isinstance(n_classes, bool) or not isinstance(n_classes, int | np.integer):
        raise ValueError(f"n_classes must be an integer, got {n_classes!r}")
    if n_classes < 2:
        raise ValueError(f"n_classes must be >= 2, got {n_classes}")
    k = int(n_classes)
    prng = _param_rng(seed, "softmax")
    theta = np.stack([_weights(prng, d, norm=1.5, bias_sd=0.5) for _ in range(k)])

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for m, rng in _block_rngs(seed, "softmax", n):
            X = _stored(_features(rng, m, d, None), x_dtype)
            eta = X @ theta.T
            eta -= eta.max(axis=1, keepdims=True)
            p = np.exp(eta)
            cdf = np.cumsum(p, axis=1)
            u = rng.random(m) * cdf[:, -1]
            y = np.minimum((cdf < u[:, None]).sum(axis=1), k - 1)
            yield X, y.astype(np.int64)

    return from_blocks(
        blocks(),
        path,
        n,
        d,
        task="multiclass",
        n_classes=k,
        chunk_rows=chunk_rows,
        overwrite=overwrite,
        feature_names=_gen_names(d),
        storage_options=storage_options,
        dtype=x_dtype,
        attrs={"generator": "make_softmax", "seed": seed, "true_theta": theta},
    )


def _robust(
    kind: str,
    path: str | os.PathLike[str],
    n_rows: int,
    n_features: int,
    seed: int,
    chunk_rows: int | None,
    overwrite: bool,
    nu: float,
    noise_scale: float,
    correlated: bool,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    n, d, seed = _check_gen_args(n_rows, n_features, seed)
    x_dtype = check_dtype(dtype)
    if not (np.isfinite(nu) and nu > 0):
        raise ValueError(f"nu must be a positive finite number, got {nu!r}")
    if not (np.isfinite(noise_scale) and noise_scale > 0):
        raise ValueError(f"noise_scale must be a positive finite number, got {noise_scale!r}")
    prng = _param_rng(seed, kind)
    theta = _weights(prng, d, norm=2.0, bias_sd=1.0)
    chol = None
    extra: dict[str, Any] = {}
    if correlated and d > 1:
        # Correlation from a low-rank factor model plus noise, standardised exactly
        # (unit variances), like standardised cheminformatic descriptors.
        p = d - 1
        r = max(1, min(8, p))
        W = prng.standard_normal((p, r))
        C = W @ W.T + np.diag(prng.uniform(0.2, 1.0, p))
        s = np.sqrt(np.diag(C))
        C = C / np.outer(s, s)
        chol = np.linalg.cholesky(C)
        extra["feature_correlation_rank"] = r

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for m, rng in _block_rngs(seed, kind, n):
            X = _stored(_features(rng, m, d, chol), x_dtype)
            y = X @ theta + noise_scale * rng.standard_t(nu, m)
            yield X, y

    return from_blocks(
        blocks(),
        path,
        n,
        d,
        task="real",
        chunk_rows=chunk_rows,
        overwrite=overwrite,
        feature_names=_gen_names(d),
        storage_options=storage_options,
        dtype=x_dtype,
        attrs={
            "generator": f"make_{kind}" if kind == "robust" else "make_opv_like",
            "seed": seed,
            "true_theta": theta,
            "nu": float(nu),
            "noise_scale": float(noise_scale),
            **extra,
        },
    )


def make_robust(
    path: str | os.PathLike[str],
    n_rows: int,
    n_features: int,
    seed: int = 0,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    *,
    nu: float = 4.0,
    noise_scale: float = 1.0,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Synthetic robust-regression data with Student-t noise, written chunk by chunk.

    ``x = (1, z)``, ``z ~ N(0, I_{D-1})``; ``y = theta^T x + noise_scale * t_nu``. True
    ``theta``: bias ``~ N(0, 1)``, non-bias weights a random direction of length 2
    (signal variance 4 against noise variance ``noise_scale^2 * nu / (nu - 2)`` = 2).

    Parameters
    ----------
    path : str or os.PathLike
        Destination.
    n_rows, n_features : int
        N >= 1 and D >= 1 (including the bias column 0).
    seed : int, default 0
        Output depends only on the arguments other than ``chunk_rows``/``overwrite``.
    chunk_rows : int, optional
        Rows per chunk.
    overwrite : bool, default False
        Replace an existing store.
    nu : float, default 4.0
        Degrees of freedom of the noise.
    noise_scale : float, default 1.0
        Scale of the noise.
    storage_options : dict, optional
        fsspec options for a URL ``path``.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X``. The features are drawn in float64 and rounded once to
        ``dtype``; the targets are drawn given the rounded features, so the stored data
        are an exact draw from the model. float64 output does not depend on this option.

    Returns
    -------
    Dataset
        Task ``"real"``; attrs ``true_theta``, ``nu``, ``noise_scale``.
    """
    return _robust(
        "robust",
        path,
        n_rows,
        n_features,
        seed,
        chunk_rows,
        overwrite,
        nu,
        noise_scale,
        correlated=False,
        storage_options=storage_options,
        dtype=dtype,
    )


#: the GLM families :func:`make_glm` draws, with the true weights' (length, bias sd)
GLM_GENERATORS = {"probit": (1.0, 0.3), "negative_binomial": (0.5, 0.5)}


def make_glm(
    path: str | os.PathLike[str],
    n_rows: int,
    n_features: int,
    family: str = "probit",
    seed: int = 0,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    *,
    dispersion: float = 2.0,
    storage_options: dict[str, Any] | None = None,
) -> Dataset:
    """Synthetic data of a GLM family (the models of ``fd.GLM``), written chunk by chunk.

    ``x = (1, z)``, ``z ~ N(0, I_{D-1})``. ``"probit"``: ``y ~ Bernoulli(Φ(θᵀx))``, the
    non-bias weights a random direction of length 1, bias ``~ N(0, 0.3²)``;
    ``"negative_binomial"``: counts with mean ``μ = exp(θᵀx)`` and variance
    ``μ + μ²/r`` (``r = dispersion``; a gamma-Poisson draw), weights of length 0.5,
    bias ``~ N(0, 0.5²)``.

    Parameters
    ----------
    path : str or os.PathLike
        Destination.
    n_rows, n_features : int
        N >= 1 and D >= 1 (including the bias column 0).
    family : {"probit", "negative_binomial"}, default "probit"
        What ``y`` is drawn from.
    seed : int, default 0
        Output depends only on the arguments other than ``chunk_rows``/``overwrite``.
    chunk_rows : int, optional
        Rows per chunk.
    overwrite : bool, default False
        Replace an existing store.
    dispersion : float, default 2.0
        ``r`` of the negative binomial (unused for probit).
    storage_options : dict, optional
        fsspec options for a URL ``path``.

    Returns
    -------
    Dataset
        Task ``"binary"`` (probit) or ``"count"``; attrs ``generator`` (``make_glm``),
        ``family``, ``seed``, ``true_theta`` and for counts ``dispersion``.
    """
    if family not in GLM_GENERATORS:
        raise ValueError(f"family must be one of {sorted(GLM_GENERATORS)}, not {family!r}")
    r = float(dispersion)
    if not math.isfinite(r) or r <= 0:
        raise ValueError(f"dispersion must be a positive number, not {dispersion!r}")
    n, d, seed = _check_gen_args(n_rows, n_features, seed)
    norm, bias_sd = GLM_GENERATORS[family]
    theta = _weights(_param_rng(seed, family), d, norm=norm, bias_sd=bias_sd)

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for m, rng in _block_rngs(seed, family, n):
            X = _features(rng, m, d, None)
            eta = X @ theta
            if family == "probit":
                y = (rng.random(m) < ndtr(eta)).astype(np.int64)
            else:
                y = rng.poisson(rng.gamma(r, np.exp(eta) / r)).astype(np.int64)
            yield X, y

    attrs: dict[str, Any] = {"generator": "make_glm", "family": family, "seed": seed}
    if family == "negative_binomial":
        attrs["dispersion"] = r
    return from_blocks(
        blocks(),
        path,
        n,
        d,
        task="binary" if family == "probit" else "count",
        chunk_rows=chunk_rows,
        overwrite=overwrite,
        feature_names=_gen_names(d),
        storage_options=storage_options,
        attrs={**attrs, "true_theta": theta},
    )


def make_opv_like(
    path: str | os.PathLike[str],
    n_rows: int = 1_800_000,
    n_features: int = 57,
    seed: int = 0,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    *,
    nu: float = 4.0,
    noise_scale: float = 1.0,
    storage_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
) -> Dataset:
    """Synthetic robust regression in the shape of the paper's OPV experiment.

    As :func:`make_robust` (Student-t noise, nu = 4) but with 1.8M rows, 57 columns (bias +
    56) and correlated, standardised features: ``z ~ N(0, R)`` with ``R`` a random
    correlation matrix from a rank-8 factor model plus diagonal noise (unit variances).

    Parameters
    ----------
    path : str or os.PathLike
        Destination.
    n_rows : int, default 1_800_000
    n_features : int, default 57
        Including the bias column 0.
    seed : int, default 0
    chunk_rows : int, optional
    overwrite : bool, default False
    nu : float, default 4.0
    noise_scale : float, default 1.0
    storage_options : dict, optional
        fsspec options for a URL ``path``.
    dtype : {"float64", "float32"}, default "float64"
        Storage dtype of ``X``. The features are drawn in float64 and rounded once to
        ``dtype``; the targets are drawn given the rounded features, so the stored data
        are an exact draw from the model. float64 output does not depend on this option.

    Returns
    -------
    Dataset
        Task ``"real"``; attrs ``true_theta``, ``nu``, ``noise_scale``.
    """
    return _robust(
        "opv",
        path,
        n_rows,
        n_features,
        seed,
        chunk_rows,
        overwrite,
        nu,
        noise_scale,
        correlated=True,
        storage_options=storage_options,
        dtype=dtype,
    )
