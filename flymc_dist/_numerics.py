"""Numerically stable elementwise helpers shared by the models and the samplers.

Everything here is vectorised numpy, works on arrays of any shape, and emits no
numpy ``RuntimeWarning`` for any finite or infinite input: where an infinity is
the intended answer (``log(0)``, overflow to ``inf``), the warning is silenced
locally with :func:`numpy.errstate`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import expit

__all__ = [
    "BOUND_EPS",
    "log_expm1",
    "log_sigmoid",
    "log_softmax",
    "logsumexp",
    "sigmoid",
    "softmax",
    "weighted_gram",
]

#: Relative safety margin subtracted from every per-datum log bound: datum ``n``
#: uses ``eps_n = BOUND_EPS * (1 + m_n)``, where ``m_n`` is the magnitude of the
#: terms of its bound at the tight point (so the margin dominates their rounding
#: error, ~1e-16 * m_n, by a factor of several thousand). It keeps
#: ``delta_n = l_n - beta_n >= 0`` after rounding and costs a bright
#: probability of ~1e-12 per datum at the tight point, which is negligible.
BOUND_EPS = 1e-12


def _result(out: np.ndarray) -> np.ndarray:
    """Return 0-d results as numpy scalars, everything else unchanged."""
    return out[()] if out.ndim == 0 else out


def log_expm1(delta: ArrayLike) -> np.ndarray:
    """Stable ``log(exp(delta) - 1)`` for ``delta >= 0``.

    Evaluated as ``delta + log(-expm1(-delta))``, accurate to a few ulp in
    absolute terms for every ``delta >= 0`` (``~log(delta)`` for tiny delta,
    ``~delta`` for large delta). Negative inputs (rounding noise in
    ``l_n - beta_n``) are clipped to 0. ``delta == 0`` gives ``-inf`` without a
    warning; ``inf`` gives ``inf``; NaN propagates.

    Parameters
    ----------
    delta
        Array of gaps ``l_n - beta_n``.

    Returns
    -------
    numpy.ndarray
        Same shape as ``delta`` (a numpy scalar for scalar input).
    """
    d = np.array(delta, dtype=np.float64)  # a copy: clipped in place
    np.maximum(d, 0.0, out=d)
    out = np.negative(d, out=np.empty_like(d))
    np.expm1(out, out=out)
    np.negative(out, out=out)
    with np.errstate(divide="ignore"):
        np.log(out, out=out)
    out += d
    return _result(out)


def log_sigmoid(s: ArrayLike) -> np.ndarray:
    """Stable ``log(1 / (1 + exp(-s))) = -logaddexp(0, -s)``.

    Evaluated as ``min(s, 0) - log1p(exp(-|s|))`` (the same value to an ulp, about
    twice as fast as ``numpy.logaddexp``).

    Parameters
    ----------
    s
        Array of logits (any real, including ``+-inf``).

    Returns
    -------
    numpy.ndarray
        Same shape as ``s``.
    """
    s = np.asarray(s, dtype=np.float64)
    e = np.abs(s, out=np.empty_like(s))
    np.negative(e, out=e)
    np.exp(e, out=e)
    np.log1p(e, out=e)
    out = np.minimum(s, 0.0, out=np.empty_like(s))
    out -= e
    return _result(out)


def sigmoid(s: ArrayLike) -> np.ndarray:
    """Logistic function ``1 / (1 + exp(-s))``, without overflow.

    Parameters
    ----------
    s
        Array of logits.

    Returns
    -------
    numpy.ndarray
        Same shape as ``s``, values in ``[0, 1]``.
    """
    return _result(np.asarray(expit(np.asarray(s, dtype=np.float64))))


#: Reductions over a last axis at most this long loop over its columns: numpy's own
#: reductions over a short contiguous axis are ~5-10x slower (K = 2..8 classes).
_SHORT_AXIS = 8


def _is_last(a: np.ndarray, axis: int) -> bool:
    return a.ndim > 0 and axis in (-1, a.ndim - 1) and 0 < a.shape[-1] <= _SHORT_AXIS


def _reduce(a: np.ndarray, axis: int, ufunc: np.ufunc) -> np.ndarray:
    """``ufunc.reduce`` along ``axis`` with the axis kept; fast for short last axes."""
    if not _is_last(a, axis):
        return ufunc.reduce(a, axis=axis, keepdims=True)
    out = a[..., 0:1].copy()
    for k in range(1, a.shape[-1]):
        ufunc(out, a[..., k : k + 1], out=out)
    return out


def _safe_max(a: np.ndarray, axis: int) -> np.ndarray:
    """Max along ``axis`` (kept), with non-finite maxima replaced by 0 for shifting."""
    m = _reduce(a, axis, np.maximum)
    if not np.all(np.isfinite(m)):
        m = np.where(np.isfinite(m), m, 0.0)
    return m


def logsumexp(a: ArrayLike, axis: int = -1, keepdims: bool = False) -> np.ndarray:
    """``log(sum(exp(a), axis))``, shifted by the maximum before exponentiating.

    Rows that are all ``-inf`` give ``-inf``; a row containing ``+inf`` gives
    ``+inf``; NaN propagates. No warnings.

    Parameters
    ----------
    a
        Input array.
    axis
        Axis to reduce (default: the last).
    keepdims
        Keep the reduced axis with length 1.

    Returns
    -------
    numpy.ndarray
        ``a``'s shape without ``axis`` (or with length 1 there if ``keepdims``).
    """
    a = np.asarray(a, dtype=np.float64)
    m = _safe_max(a, axis)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        e = a - m
        np.exp(e, out=e)
        out = _reduce(e, axis, np.add)
        np.log(out, out=out)
    out += m
    if not keepdims:
        out = np.squeeze(out, axis=axis)
    return _result(out)


def log_softmax(a: ArrayLike, axis: int = -1) -> np.ndarray:
    """``a - logsumexp(a)`` along ``axis`` (stable).

    Parameters
    ----------
    a
        Input array.
    axis
        Axis to normalise over (default: the last).

    Returns
    -------
    numpy.ndarray
        Same shape as ``a``.
    """
    a = np.asarray(a, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return _result(a - logsumexp(a, axis=axis, keepdims=True))


def softmax(a: ArrayLike, axis: int = -1) -> np.ndarray:
    """``exp(a) / sum(exp(a))`` along ``axis``, shifted by the maximum.

    A row that is all ``-inf`` gives NaN (the softmax is undefined there).

    Parameters
    ----------
    a
        Input array.
    axis
        Axis to normalise over (default: the last).

    Returns
    -------
    numpy.ndarray
        Same shape as ``a``; rows sum to 1.
    """
    a = np.asarray(a, dtype=np.float64)
    m = _safe_max(a, axis)
    with np.errstate(over="ignore", invalid="ignore"):
        e = a - m
        np.exp(e, out=e)
        e /= _reduce(e, axis, np.add)
    return _result(e)


def in_sorted(values: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Membership of each of ``values`` in the sorted array ``ref`` (a boolean mask).

    ``np.isin`` / ``np.setdiff1d`` sort their inputs on every call; for the few dozen
    sorted row ids of a bright-set change a binary search is several times cheaper.
    """
    if ref.size == 0:
        return np.zeros(values.shape, dtype=bool)
    pos = np.searchsorted(ref, values)
    pos[pos == ref.size] = 0
    return ref[pos] == values


def by_range(
    starts: np.ndarray, stops: np.ndarray, rows: np.ndarray
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Global ``rows`` split among consecutive ranges ``[starts[j], stops[j])`` (in
    order, each starting where the one before stopped; some may be empty): per range
    holding any, in range order, ``(j, where they sit in rows, rows − starts[j])``."""
    which = np.searchsorted(stops, rows, side="right")
    out = []
    for j in np.unique(which).tolist():
        at = np.flatnonzero(which == j)
        out.append((j, at, rows[at] - starts[j]))
    return out


def weighted_gram(X: ArrayLike, w: ArrayLike | None = None, chunk_rows: int = 32768) -> np.ndarray:
    """Symmetric ``sum_n w_n x_n x_n^T`` (or ``X^T X`` when ``w`` is None).

    Rows are processed in chunks so the temporary ``w * X`` never exceeds
    ``chunk_rows * D`` floats, whatever the number of rows.

    Parameters
    ----------
    X
        Array (n, D).
    w
        Weights (n,), or None for all ones.
    chunk_rows
        Rows per BLAS call.

    Returns
    -------
    numpy.ndarray
        (D, D) symmetric matrix, float64.
    """
    X = np.asarray(X)
    n, D = X.shape
    out = np.zeros((D, D))
    if w is not None:
        w = np.asarray(w, dtype=np.float64)
    for start in range(0, n, chunk_rows):
        Xc = np.asarray(X[start : start + chunk_rows], dtype=np.float64)
        if w is None:
            out += Xc.T @ Xc
        else:
            out += Xc.T @ (Xc * w[start : start + chunk_rows, None])
    out += out.T
    out *= 0.5
    return out
