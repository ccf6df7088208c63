"""The numpy reference of FlyMC's bright terms, on rows handed in explicitly.

``log L~_n(θ) = log expm1(ℓ_n(θ) − β_n(θ))`` and its derivative in the linear
predictors, through a model's ``loglik`` and ``logbound``. Shards call it on their own
rows (where no compiled form applies: gradients, softmax), and the driver's replica of
the bright rows (:mod:`flymc_dist.replica`) on the rows it holds, so one formula serves
both and neither knows of the other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flymc_dist._numerics import log_expm1
from flymc_dist.models.base import Model


def log_bright_ratio(
    ll: np.ndarray, lb: np.ndarray, dl: np.ndarray | None, db: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """``log L~ = log expm1(l - beta)`` and, given the eta-derivatives of ``l`` and ``beta``,
    ``d log L~ / d eta = (dl - dbeta) / (1 - exp(-delta))`` (0 where the bound is tight).

    Where ``beta`` exceeds ``l`` by more than :data:`BOUND_TOLERANCE` of their size (a
    broken bound, not rounding) the value is NaN: :func:`check_bounds_held` raises."""
    diff = ll - lb
    broken = diff < -BOUND_TOLERANCE * (1.0 + np.abs(ll) + np.abs(lb))
    delta = np.maximum(diff, 0.0)
    vals = log_expm1(delta)
    if broken.any():
        vals = np.where(broken, np.nan, vals)
    if dl is None:
        return vals, None
    with np.errstate(divide="ignore", invalid="ignore"):
        w = (dl - db) / -np.expm1(-delta)[..., None]
    return vals, np.where(delta[..., None] > 0.0, w, 0.0)


#: as :data:`flymc_dist._compiled.BOUND_TOLERANCE` (which numba compiles as a constant)
BOUND_TOLERANCE = 1e-9


class BoundViolation(FloatingPointError):
    """A row's bound exceeded its likelihood while sampling: the model's bound is wrong."""


def check_bounds_held(
    vals: np.ndarray, seg: np.ndarray, thetas: np.ndarray, row_of: Any, model: Model
) -> None:
    """Raise :class:`BoundViolation` if a row's ``log L~`` (``vals``, laid out in segments
    ``seg``, segment i evaluated at ``thetas[i]``) is NaN at a finite θ: its bound was
    above its likelihood there (see :func:`log_bright_ratio`). ``row_of(j)`` names the
    global row of value ``j``. One ``isnan`` over values already computed."""
    nan = np.isnan(vals)
    if not nan.any():
        return
    for j in np.flatnonzero(nan):
        i = int(np.searchsorted(seg, j, side="right")) - 1
        theta = np.asarray(thetas[i], dtype=np.float64)
        if np.all(np.isfinite(theta)):
            raise BoundViolation(
                f"the bound of {model!r} exceeds the likelihood at row {row_of(int(j))} "
                f"and theta = {np.array2string(theta, precision=6, separator=', ')}: the "
                "declared curvature is too small (or f' is not f's derivative); stopped "
                "rather than sample a wrong posterior"
            )


def bright_terms(
    model: Model, eta: np.ndarray, y: np.ndarray, xi: np.ndarray, grad: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """``log L~`` (and its eta-derivative if ``grad``) at linear predictors ``eta``
    (B, n, E), through the model's ``loglik`` and ``logbound``."""
    if grad:
        ll, dl = model.loglik_grad(eta, y)
        lb, db = model.logbound_grad(eta, y, xi)
        return log_bright_ratio(ll, lb, dl, db)
    return log_bright_ratio(model.loglik(eta, y), model.logbound(eta, y, xi), None, None)


def bright_terms_many(
    model: Model, segments: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], grad: bool
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """:func:`bright_terms` of several ``(thetas (k, P), X (n, D), y (n,), xi)`` segments.

    The linear predictors are computed per segment (one small matmul each); the model's
    per-datum work then runs once over all segments together, which is what makes an
    evaluation for C chains cost little more than one for a single chain.

    Returns
    -------
    list of tuple
        Per segment, the values ``(k, n)`` and, with ``grad``, the eta-derivatives
        ``(k, n, E)`` (else None).
    """
    E = model.n_outputs
    etas, ys, xis, shapes = [], [], [], []
    for thetas, X, y, xi in segments:
        k, n = thetas.shape[0], X.shape[0]
        etas.append(model.linear_predictor(thetas, X).reshape(k * n, E))
        ys.append(np.tile(y, k) if k > 1 else y)
        xis.append(np.tile(xi, (k,) + (1,) * (xi.ndim - 1)) if k > 1 else xi)
        shapes.append((k, n))
    eta = np.concatenate(etas)[None]
    vals, dvals = bright_terms(model, eta, np.concatenate(ys), np.concatenate(xis), grad)
    vals = vals[0]
    dvals = dvals[0] if dvals is not None else None
    out = []
    off = 0
    for k, n in shapes:
        v = vals[off : off + k * n].reshape(k, n)
        d = dvals[off : off + k * n].reshape(k, n, E) if dvals is not None else None
        out.append((v, d))
        off += k * n
    return out
