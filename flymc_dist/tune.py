"""Tuning before the first iteration, the same for every algorithm: the MAP estimate,
the Laplace covariance (the kernels' preconditioner) and the chains' starting points.

The FlyMC / regular :class:`~flymc_dist.driver.Driver` and austerity's
:class:`~flymc_dist.austerity.sampler.AusteritySampler` both set up this way. A MAP estimate only
moves the bounds' tight points and the starting points: its accuracy affects speed,
never correctness. (``q_db="auto"`` stays with the driver: it needs the shards' z.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import scipy.linalg

from flymc_dist.models.base import BoundStats, Model
from flymc_dist.protocol import Transport
from flymc_dist.reduce import tree_total
from flymc_dist.rng import ROLE_INIT, stream

if TYPE_CHECKING:
    from scipy.optimize import OptimizeResult

__all__ = [
    "MapEstimate",
    "bound_precision",
    "check_proper",
    "choose_exact_rows",
    "conditional_narrowing",
    "find_map",
    "flat_prior_to_check",
    "initial_positions",
    "laplace_covariance",
    "narrow_columns",
    "needs_map",
    "preconditioner",
    "tight_bounds",
]


#: a column is *narrow* (:func:`narrow_columns`) when at most this many rows carry it ...
EXACT_COLUMN_ROWS = 2000
#: ... and at most this fraction of all the rows
EXACT_COLUMN_FRACTION = 0.01
#: a row carries a narrow column when its ``x²`` is at least this fraction of the
#: column's mean ``x²`` over the rows that carry it
EXACT_ROW_SHARE = 0.1
#: at most this many exact rows in all, and at most this fraction of all the rows
EXACT_MAX_ROWS = 10_000
EXACT_MAX_FRACTION = 0.02


class MapEstimate(NamedTuple):
    """The outcome of :func:`find_map`."""

    theta: np.ndarray  # (P,) the estimate
    neg_hessian: np.ndarray  # (P, P) the log posterior's negative Hessian there
    info: dict[str, Any]  # success, iterations, evaluations, message
    passes: int  # full passes over the data (each: every row at one θ)


def needs_map(
    init: str | np.ndarray, precondition: str | np.ndarray, bounds_at_map: bool = False
) -> bool:
    """Whether a set-up needs the MAP: to start there (``init="map"``), for the Laplace
    preconditioner, or for bounds tight at it."""
    return (
        (isinstance(init, str) and init == "map")
        or (isinstance(precondition, str) and precondition == "laplace")
        or bool(bounds_at_map)
    )


def find_map(
    model: Model,
    transport: Transport,
    n_params: int,
    *,
    maxiter: int = 100,
    x0: np.ndarray | None = None,
    thin: int = 1,
) -> MapEstimate:
    """MAP estimate by trust-region Newton with shard-summed gradients and Hessians.

    With ``thin`` > 1 the search first runs on a subsample — the first 1/``thin`` of the
    rows of every block, their sums scaled up (``Shard.loglik_sum(…, thin)``) — and then
    from its end on full passes, which from so close a start converge in a few
    evaluations: most of the search's passes cost 1/``thin`` of one.

    Parameters
    ----------
    model
        The likelihood and prior.
    transport
        Reaches the shards (``loglik_sum``: one full pass per evaluation).
    n_params
        P.
    maxiter
        Iteration limit of the search (its accuracy affects speed, never exactness).
    x0
        Starting point. Default: zeros for a log-concave model (one mode), otherwise
        :func:`untuned_bound_mode` (for robust regression the ridge least-squares fit, as
        robust-regression fits start; from zeros, a group of rows far from the fit — on
        the flights data the 241 flights at 3 am, delayed by ~110 minutes — can leave the
        search at a local mode 150 nats below the global one, and every chain there).

    Returns
    -------
    MapEstimate
        The estimate, the negative Hessian of the log posterior there (the likelihood's,
        plus the prior's curvature from :meth:`Model.prior_precision`), the search's
        summary and the number of full passes it made.

    Raises
    ------
    FloatingPointError
        If the search diverged.
    """
    cache: dict[bytes, tuple[float, np.ndarray, np.ndarray]] = {}
    loglik: dict[str, tuple[float, np.ndarray, np.ndarray]] = {}
    passes = 0
    now_thin, sub_evaluations = 1, 0  # the thinning evaluations use now; those made thinned

    def evaluate(theta: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """The negated (smoothed: :meth:`Model.prior_map_terms`) log posterior."""
        nonlocal passes, sub_evaluations
        key = np.asarray(theta, float).tobytes() + bytes([now_thin > 1])
        if key not in cache:
            flat = tree_total(transport.call("loglik_sum", np.asarray(theta, float), 2, now_thin))
            if now_thin > 1:
                sub_evaluations += 1
            else:
                passes += 1  # a full pass: every datum at one θ
            P = len(theta)
            v, g, h = float(flat[0]), flat[1 : 1 + P], flat[1 + P :].reshape(P, P)
            _check_finite_derivatives(g, h)
            pv, pg, ph = model.prior_map_terms(np.asarray(theta, float))
            cache.clear()
            cache[key] = (-(v + pv), -(g + pg), -(h + np.diag(ph)))
            loglik["last"] = (v, g, h)
        return cache[key]

    if x0 is not None:
        x0 = np.asarray(x0, float)
    elif model.log_concave:
        x0 = np.zeros(n_params)
    else:
        x0 = untuned_bound_mode(model, transport, n_params)
        passes += 1

    # imported here, not with the package: scipy.optimize adds ~20 MB to every process
    # that imports flymc_dist, Dask workers included (tests/test_imports.py)
    import scipy.optimize

    def search(start: np.ndarray) -> Any:
        return scipy.optimize.minimize(
            lambda t: evaluate(t)[0],
            start,
            jac=lambda t: evaluate(t)[1],
            hess=lambda t: evaluate(t)[2],
            method="trust-exact",
            options={"maxiter": int(maxiter), "gtol": 1e-6},
        )

    res = None
    if thin > 1:
        now_thin = int(thin)
        first = search(x0)
        if np.all(np.isfinite(first.x)):
            x0 = np.asarray(first.x, float)
        now_thin = 1
        res = _newton(evaluate, x0, maxiter)
    if res is None:
        res = search(x0)
    theta = np.asarray(res.x, float)
    if not res.get("extrapolated", False):
        evaluate(theta)  # else: the curvature of the last iterate, one Newton step back
    # the preconditioner's curvature: the likelihood's, plus the prior's Gaussian
    # stand-in (:meth:`Model.prior_precision`), never the smoothing's spike at 0
    neg_h = -loglik["last"][2] + model.prior_precision(n_params)
    info = {
        "success": bool(res.success),
        "iterations": int(res.nit),
        "evaluations": int(res.nfev),
        "message": str(res.message),
        "subsample_thin": int(thin),
        "subsample_evaluations": sub_evaluations,
    }
    if not np.all(np.isfinite(theta)):
        raise FloatingPointError(f"MAP search diverged: {res.message}")
    if flat_prior_to_check(model):
        passes += check_proper(model, transport, theta, -loglik["last"][2], loglik["last"][0])
    return MapEstimate(theta, neg_h, info, passes)


def _check_finite_derivatives(g: np.ndarray, h: np.ndarray) -> None:
    """Raise, naming the first parameter concerned, if the log-likelihood's gradient or
    Hessian summed over the rows is not finite (an overflow: the search cannot go on)."""
    bad = ~(np.isfinite(g) & np.isfinite(h).all(axis=1))
    if bad.any():
        j = int(np.argmax(bad))
        raise FloatingPointError(
            f"the MAP search's log-likelihood derivatives overflow in parameter {j} (its "
            f"{'gradient' if not np.isfinite(g[j]) else 'Hessian'} summed over the rows is "
            "not finite): the data set's column for it holds values too large for float64 "
            "arithmetic: rescale (standardise) it and write the data set again"
        )


#: :func:`_newton` stops once the Newton decrement says the objective is within this many
#: nats of its minimum; from that close, its last step is taken without evaluating where
#: it lands (quadratic convergence puts it within ~``NEWTON_NATS²`` nats of the minimum:
#: a tight point's bound does not notice)
NEWTON_NATS = 1.0


def _newton(evaluate: Any, x0: np.ndarray, maxiter: int) -> OptimizeResult | None:
    """Newton's method from ``x0``, close to the minimum (a subsample's optimum): each
    step one evaluation; once half the Newton decrement ``gᵀH⁻¹g`` is below
    :data:`NEWTON_NATS` the last step is taken without evaluating (``extrapolated``):
    from a subsample's optimum, two full passes. None (the caller then runs the
    trust-region search) where a Hessian is not positive definite or a step does not
    decrease the objective."""
    from scipy.optimize import OptimizeResult  # noqa: F811 (see find_map)

    x = np.asarray(x0, float)
    f, g, h = evaluate(x)
    for it in range(1, int(maxiter) + 1):
        try:
            step = scipy.linalg.cho_solve(scipy.linalg.cho_factor(h), g)
        except np.linalg.LinAlgError:
            return None
        if 0.5 * float(g @ step) < NEWTON_NATS:
            return OptimizeResult(
                x=x - step,
                success=True,
                nit=it,
                nfev=it,
                extrapolated=True,
                message="Newton decrement below tolerance: last step not evaluated",
            )
        x_new = x - step
        f_new, g, h = evaluate(x_new)
        if not f_new <= f:
            return None
        x, f = x_new, f_new
    return OptimizeResult(
        x=x, success=False, nit=int(maxiter), nfev=int(maxiter) + 1, message="maxiter reached"
    )


def flat_prior_to_check(model: Model) -> bool:
    """Whether :func:`find_map` checks that the posterior is proper (and so a set-up must
    search for the MAP whatever its settings): a flat prior on a log-concave likelihood,
    whose posterior is improper exactly when the likelihood has no finite maximum."""
    return getattr(model, "prior", None) == "flat" and bool(getattr(model, "log_concave", False))


#: how far :func:`check_proper` looks along a direction: this many of the Laplace
#: approximation's standard deviations, at most this many times (1 + |θ̂|)
_RAY_SDS = 10.0
_RAY_MAX = 1e6


def check_proper(
    model: Model, transport: Transport, theta: np.ndarray, neg_h: np.ndarray, value: float
) -> int:
    """Refuse a flat prior whose posterior is improper: the log-likelihood does not
    decrease away from the MAP search's end ``theta`` along its own direction (the classes
    are linearly separable: the search runs off to infinity) or along the direction of
    least curvature (one the data do not inform: equal columns, a zero column).

    For a log-concave likelihood with a finite maximum at ``theta`` the log-likelihood
    drops, ``_RAY_SDS`` Laplace standard deviations away in any direction, by tens of
    nats; along a direction of recession it does not drop at all. Up to three full
    passes, only for models with ``prior="flat"``.

    Parameters
    ----------
    model
        The model (its ``prior`` is ``"flat"``).
    transport
        Reaches the shards.
    theta
        Where the MAP search ended.
    neg_h
        The negative Hessian of the log-likelihood there.
    value
        The log-likelihood there.

    Returns
    -------
    int
        The full passes made.

    Raises
    ------
    ValueError
        If the posterior is improper, in one line saying why and what to do.
    """
    h = 0.5 * (neg_h + neg_h.T)
    _, evecs = np.linalg.eigh(h)
    norm = float(np.linalg.norm(theta))
    rays = []
    if norm > 0:
        rays.append(("separation", theta / norm))
    rays.append(("flat", evecs[:, 0]))
    tol = 1e-6 * (1.0 + abs(value))
    passes = 0
    for why, d in rays:
        curv = float(d @ h @ d)
        far = _RAY_MAX * (1.0 + norm)
        step = min(_RAY_SDS / np.sqrt(curv), far) if curv > 0 else far
        ends = (theta + step * d,) if why == "separation" else (theta + step * d, theta - step * d)
        drops = []
        for end in ends:
            v = float(tree_total(transport.call("loglik_sum", end, 0))[0])
            passes += 1
            drops.append(value - v if np.isfinite(v) else np.inf)
        if min(drops) > tol:
            continue
        name = getattr(model, "name", type(model).__name__)
        shown = np.array2string(d, precision=3, max_line_width=10_000, threshold=8)
        if why == "separation":
            cause = (
                f"the log-likelihood keeps increasing along θ's direction {shown} (the MAP "
                f"search stopped at |θ| = {norm:.4g} with log-likelihood {value:.3g}): the "
                "classes are linearly separable"
            )
        else:
            cause = (
                f"the log-likelihood is flat along the direction {shown}: the data do not "
                "inform it (two equal columns, or a column of zeros, say)"
            )
        raise ValueError(
            f"{name} regression with prior='flat' has an improper posterior on these data: "
            f"{cause}; use prior='normal' or 'laplace'"
        )
    return passes


def untuned_bound_mode(model: Model, transport: Transport, n_params: int) -> np.ndarray:
    """The mode of the untuned collapsed bound times the prior's Gaussian stand-in
    (:meth:`Model.prior_precision`): one full pass, and the shards' tight points are left
    as they are.

    The untuned bound is quadratic in θ, so its mode is one linear solve; for robust
    regression (every row's bound tight at residual 0, all equally curved) it is the
    ridge least-squares fit.
    """
    total = tree_total(transport.call("bound_stats", True))
    return np.linalg.solve(bound_precision(total, model, n_params), total.b)


def narrow_columns(energy: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The columns that few rows carry, and the ``x²`` a row needs to carry one.

    Column j is carried by ``n_j = (Σ_n x_nj²)² / Σ_n x_nj⁴`` rows (the effective number:
    k for a 0/1 column with k ones; 1 for a column standardised to 358.8 on one row
    and ~0 elsewhere, as QM9's column 44). It is *narrow* when ``n_j`` is at most
    :data:`EXACT_COLUMN_ROWS` and :data:`EXACT_COLUMN_FRACTION` of the rows. A row
    carries it when ``x_nj² ≥`` :data:`EXACT_ROW_SHARE` ``· Σ_n x_nj² / n_j``.

    Parameters
    ----------
    energy
        ``(2, D)``: ``Σ_n x_nj²`` and ``Σ_n x_nj⁴`` over all rows (``Shard.column_energy``).
    n_rows
        N.

    Returns
    -------
    tuple of numpy.ndarray
        The narrow columns, fewest carrying rows first (ties: by index), and their
        thresholds on ``x²``.
    """
    s1, s2 = np.asarray(energy, dtype=np.float64)
    n_eff = np.full(s1.shape, np.inf)
    np.divide(s1 * s1, s2, out=n_eff, where=s2 > 0)
    limit = min(EXACT_COLUMN_ROWS, EXACT_COLUMN_FRACTION * n_rows)
    columns = np.flatnonzero(n_eff <= limit)
    columns = columns[np.argsort(n_eff[columns], kind="stable")]
    return columns, EXACT_ROW_SHARE * s1[columns] / n_eff[columns]


def choose_exact_rows(transport: Transport, n_rows: int) -> list[int]:
    """Set every shard's exact rows (``exact_rows="auto"``): the rows that carry a narrow
    column (:func:`narrow_columns`), at most :data:`EXACT_MAX_ROWS` and
    :data:`EXACT_MAX_FRACTION` of the rows (the columns most rows carry are dropped
    first until they fit). Before :func:`tight_bounds`, which puts them at the model's
    loose tight points. Two full passes (none of them likelihood queries), one more
    per column dropped.

    Why: a weight that few rows inform is where FlyMC's Gibbs alternation of z and θ
    mixes worst — each of those rows' z moves that weight's conditional by a large
    step, and a dark row is proposed once in ``1/q_db`` iterations. Evaluating such
    rows at every step takes them out of the alternation. On the 3M-row flights data
    (hours 2, 3 and 4 am: 931, 241 and 340 flights; 1,512 exact rows) the
    min-over-weights bulk ESS of 4 × 2,000 NUTS draws went from 10-17 to 2,773-3,028
    (R̂ from 1.16-1.31 to 1.001-1.002).

    Returns
    -------
    list of int
        The exact rows of each shard (all zero when no column is narrow).
    """
    energy = tree_total(transport.call("column_energy"))
    columns, thresholds = narrow_columns(energy, n_rows)
    budget = min(EXACT_MAX_ROWS, EXACT_MAX_FRACTION * n_rows)
    tried = False
    while columns.size:
        counts = [int(k) for k in transport.call("set_exact_rows", columns, thresholds)]
        if sum(counts) <= budget:
            return counts
        columns, thresholds, tried = columns[:-1], thresholds[:-1], True
    if tried:  # every column dropped: clear the rule the shards hold
        transport.call("set_exact_rows", columns, thresholds)
    return [0] * len(transport.specs)


def tight_bounds(transport: Transport, theta_hat: np.ndarray | None) -> BoundStats:
    """Set every shard's tight points at ``theta_hat`` (None: the model's untuned ones)
    and sum their bound statistics (by block: :mod:`flymc_dist.reduce`).

    Austerity's control variates. (A FlyMC set-up sets the tight points and sums the
    same statistics in the pass that draws the chains' first z:
    ``Shard.place_with_bound_stats``.) A cluster transport replays ``set_tight_points``
    on shards it recreates after a fault.
    """
    transport.call("set_tight_points", None if theta_hat is None else np.asarray(theta_hat, float))
    return tree_total(transport.call("bound_stats"))


def bound_precision(bound: BoundStats, model: Model, n_params: int) -> np.ndarray:
    """The precision of θ given z = 0 (every datum dark): ``-(A + Aᵀ)`` of the collapsed
    bound ``θᵀAθ + bᵀθ + c`` plus the prior's curvature (:meth:`Model.prior_precision`).

    With bounds tight at the MAP and few bright rows, θ given z is close to this Gaussian,
    and narrower than the posterior wherever a bound is more curved than its datum's
    log-likelihood — on MNIST 7 vs 9 up to 14.8 times in precision (the Jaakkola–Jordan
    bound of a well-classified image has curvature ~1/(2 |margin|), its log-likelihood
    ~exp(-|margin|)).
    """
    return -(bound.A + bound.A.T) + model.prior_precision(n_params)


def conditional_narrowing(bound_prec: np.ndarray, neg_hessian: np.ndarray) -> float:
    """How many times narrower, in precision, θ given z is than the posterior, at most
    over directions: the largest generalised eigenvalue κ of ``bound_prec`` (θ given that
    every datum is dark, :func:`bound_precision`) against the Laplace precision at the MAP.

    FlyMC alternates θ | z and z | θ. For a Gaussian joint, that two-block Gibbs sampler
    moves θ as an autoregression whose lag-1 autocorrelation in the direction of the
    eigenvector is ``1 − 1/κ``: with θ | z and z | θ drawn exactly, the slowest linear
    combination of θ gets ``1 / (2κ − 1)`` effective draws per iteration (the *Gibbs
    rate*, ``info["gibbs_ess_per_draw"]``). It is read off the bound before the first
    iteration, a forecast, not a bound on what is measured: the bright rows' terms
    narrow θ given z a little further, and an implicit z-update that leaves most z as they
    were mixes more slowly; but an antithetic θ-kernel (NUTS) can beat the Gibbs rate,
    and single parameters mix at least as fast as the slowest direction. Measured (min
    over weights of the bulk ESS per draw, 4 chains of NUTS): MNIST 7 vs 9, κ = 14.8,
    Gibbs rate 0.035, measured 0.026; ``flymc demo``'s data (200,000 × 10), κ = 1.9, 0.35,
    measured 0.26-0.30; 2M × 57 synthetic logistic, κ = 1.9, 0.35, measured 0.49; QM9
    robust regression, κ = 1.6, 0.44, measured 0.08-0.13 (its ridge, not z, is what slows
    it). Regular MCMC has no such limit: its NUTS draws on MNIST are worth 1.1 effective
    draws each.

    No choice of tight points lowers MNIST's κ much: a quadratic lower bound of ``log σ(s)``
    that touches it at a margin ``s₀ ≫ 1`` (slope ≈ 0 there) must stay below ``log σ(s) ≈ s``
    for ``s → −∞``, which takes a curvature of at least ``1 / (2 s₀)`` — what the
    Jaakkola–Jordan bound has — against the log-likelihood's ``e^−s₀``; a bound touching
    further out is less curved but lies below the likelihood at the MAP, so its row is
    bright with a probability that grows far faster than the curvature falls (touching at
    ``1.2 s₀`` for ``s₀ = 6``: 16 % less curvature, brightness 0.05 instead of ~0).

    Parameters
    ----------
    bound_prec
        ``(P, P)`` precision of θ given z = 0.
    neg_hessian
        ``(P, P)`` the log posterior's negative Hessian at the MAP (its eigenvalues are
        clipped positive, as for the preconditioner: :func:`laplace_covariance`).

    Returns
    -------
    float
        κ (at least 0; below 1 where the bound is flatter than the likelihood, e.g. along
        exact rows, whose loose bounds leave their curvature to the bright terms).
    """
    chol = np.linalg.cholesky(laplace_covariance(neg_hessian))
    whitened = chol.T @ (0.5 * (bound_prec + bound_prec.T)) @ chol
    return max(float(np.linalg.eigvalsh(whitened)[-1]), 0.0)


def laplace_covariance(neg_hessian: np.ndarray) -> np.ndarray:
    """Covariance of the Gaussian with precision ``neg_hessian``, eigenvalues clipped positive.

    Robust and softmax log posteriors need not be strictly concave; clipping keeps a
    valid (if imperfect) preconditioner — it affects efficiency, never exactness.
    """
    H = 0.5 * (neg_hessian + neg_hessian.T)
    w, V = np.linalg.eigh(H)
    top = max(float(np.max(np.abs(w))), 1e-12)
    w = np.clip(w, top * 1e-8, None)
    return (V / w) @ V.T


def preconditioner(
    precondition: str | np.ndarray,
    neg_hessian: np.ndarray | None,
    n_params: int,
    bound_precision: np.ndarray | None = None,
) -> np.ndarray:
    """The Cholesky factor ``L`` of the kernels' preconditioning covariance.

    Parameters
    ----------
    precondition
        ``"laplace"`` (the Gaussian at the MAP: needs ``neg_hessian``), ``"bound"`` (the
        Gaussian of FlyMC's collapsed bound and the prior: needs ``bound_precision``),
        ``"identity"``, or a ``(P, P)`` covariance.
    neg_hessian
        The log posterior's negative Hessian at the MAP (see :func:`find_map`).
    n_params
        P.
    bound_precision
        The precision of θ given that every datum is dark (see :func:`bound_precision`).

    Returns
    -------
    numpy.ndarray
        Lower-triangular ``(P, P)``.
    """
    if isinstance(precondition, np.ndarray):
        cov = np.asarray(precondition, float)
    elif isinstance(precondition, str) and precondition == "laplace":
        cov = laplace_covariance(neg_hessian)
    elif isinstance(precondition, str) and precondition == "bound":
        cov = laplace_covariance(bound_precision)
    elif isinstance(precondition, str) and precondition == "identity":
        cov = np.eye(n_params)
    else:
        raise ValueError(
            f"precondition must be 'laplace', 'bound', 'identity' or an array, not {precondition!r}"
        )
    return np.linalg.cholesky(cov)


def initial_positions(
    init: str | np.ndarray,
    theta_map: np.ndarray | None,
    chol: np.ndarray,
    chains: int,
    seed: int,
) -> np.ndarray:
    """Every chain's starting point, ``(chains, P)``.

    ``init="map"``: the MAP jittered by the preconditioner, ``θ_MAP + L z`` with ``z``
    from ``stream(seed, ROLE_INIT, c)``; an array of shape ``(P,)`` or ``(chains, P)``:
    those points.
    """
    P = chol.shape[0]
    positions = np.empty((chains, P))
    if isinstance(init, str):
        if init != "map":
            raise ValueError(f"init must be 'map' or an array, not {init!r}")
        for c in range(chains):
            z = stream(seed, ROLE_INIT, c).standard_normal(P)
            positions[c] = theta_map + chol @ z
    else:
        arr = np.asarray(init, float)
        positions[:] = np.broadcast_to(arr.reshape(-1, P), positions.shape)
    return positions
