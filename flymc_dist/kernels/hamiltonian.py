"""What the Hamiltonian kernels (:mod:`.hmc`, :mod:`.nuts`) share: metric, leapfrog, energy.

Euclidean HMC on ``H(θ, p) = −log p(θ) + ½ pᵀ M⁻¹ p`` with a diagonal or dense *inverse
metric* ``M⁻¹`` (an approximate posterior covariance). Parameters are a
:class:`HamiltonianParams` NamedTuple of scalars and arrays (so that checkpoints can
write them as JSON); everything derived from the metric that a step needs (the factor
that draws momenta) is computed once, when the params are built, never per step.

A diagonal metric is a 1-D array, a dense one a 2-D array, and a step picks
``np.multiply`` or ``np.dot`` once for all its products ``M⁻¹ p``. Per leapfrog step
the work is a handful of numpy calls on 1-D arrays (:func:`leapfrog`): Python overhead,
not flops, dominates on a cheap target.

Evaluations follow the protocol of :mod:`flymc_dist.kernels.base`: a step's first
request asks for the gradient at the current position (``points`` empty,
``current_grad=True``; rule 1: nothing is cached across steps), then every leapfrog
step is one request of one point with ``grad=True``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

import numpy as np
import scipy.linalg

from flymc_dist.kernels.base import EvalRequest, EvalResponse, KernelInfo
from flymc_dist.kernels.rwmh import check_positive, check_scale_tril, checked_value

__all__ = [
    "DIVERGENCE_THRESHOLD",
    "begin_step",
    "HamiltonianInfo",
    "HamiltonianParams",
    "Phase",
    "accept_statistic",
    "check_adapt_metric",
    "check_metric_from",
    "check_metric",
    "find_reasonable_step_size",
    "hamiltonian_params",
    "initial_hamiltonian_params",
    "initial_phase",
    "kinetic_energy",
    "leapfrog",
    "log_add_exp",
    "metric_product",
    "no_u_turn",
    "start_phase",
]

#: Stan's ``max_deltaH``: an energy error above this marks a divergent trajectory
DIVERGENCE_THRESHOLD = 1000.0
#: the step-size heuristic aims for a one-step acceptance of 0.8 (Stan, NumPyro)
_LOG_HEURISTIC_TARGET = math.log(0.8)
_MAX_HEURISTIC_TRIALS = 60  # a factor 2⁶⁰ either way: stop, whatever the target


class HamiltonianParams(NamedTuple):
    """Parameters of the :class:`~.hmc.HMC` and :class:`~.nuts.NUTS` kernels.

    Build them with :func:`hamiltonian_params` (which derives ``momentum_factor``).
    """

    step_size: float  # ε (nominal: HMC jitters it)
    inv_metric: np.ndarray  # M⁻¹: (P,) diagonal or (P, P) dense
    momentum_factor: np.ndarray  # F with F Fᵀ = M: (P,) or (P, P); a momentum is F z
    find_step_size: bool  # run Stan's step-size heuristic first (warm-up only)


class HamiltonianInfo(KernelInfo):
    """:class:`~flymc_dist.kernels.base.KernelInfo` plus Hamiltonian diagnostics.

    The tuple fields are exactly :class:`KernelInfo`'s (``accept_prob`` is the
    statistic dual averaging targets: HMC's Metropolis acceptance probability, NUTS's
    mean acceptance statistic over the tree). Plain attributes:

    ``position``
        The new position (the warm-up adapter estimates the metric from it).
    ``step_size``
        The nominal step size of the trajectory (the heuristic's result if it ran; HMC
        jitters each trajectory's step around it).
    ``step_size_found``
        The step ran the step-size heuristic (warm-up only); ``step_size`` is its result.
    ``n_leapfrog``
        Leapfrog steps of the trajectory (the heuristic's trial steps not included).
    ``tree_depth``
        NUTS: doublings of the accepted tree; HMC: 0.
    ``divergent``
        The trajectory hit an energy error above the threshold (or zero density).
    ``energy``
        The Hamiltonian at the new state (for the E-BFMI diagnostic).
    """

    position: np.ndarray | None = None
    step_size: float = math.nan
    step_size_found: bool = False
    n_leapfrog: int = 0
    tree_depth: int = 0
    divergent: bool = False
    energy: float = math.nan

    def __new__(
        cls,
        accepted: bool,
        accept_prob: float,
        index: int,
        n_evals: int,
        n_requests: int,
        position: np.ndarray | None = None,
        step_size: float = math.nan,
        step_size_found: bool = False,
        n_leapfrog: int = 0,
        tree_depth: int = 0,
        divergent: bool = False,
        energy: float = math.nan,
    ) -> HamiltonianInfo:
        self = super().__new__(cls, accepted, accept_prob, index, n_evals, n_requests)
        self.position = position
        self.step_size = step_size
        self.step_size_found = step_size_found
        self.n_leapfrog = n_leapfrog
        self.tree_depth = tree_depth
        self.divergent = divergent
        self.energy = energy
        return self


class Phase(NamedTuple):
    """A point of phase space with everything a trajectory needs cached."""

    position: np.ndarray  # θ
    momentum: np.ndarray  # p
    velocity: np.ndarray | None  # M⁻¹ p (NUTS's "sharp" momentum); None at zero density
    grad: np.ndarray | None  # ∇ log p(θ); None at zero density
    logp: float
    energy: float  # H = −log p(θ) + ½ pᵀ M⁻¹ p (+inf at zero density)


# ------------------------------------------------------------------------------- metric
def check_metric(metric: Any) -> str:
    """``metric`` as ``"diag"`` or ``"dense"``, else ValueError naming the argument."""
    if not isinstance(metric, str) or metric.strip().lower() not in ("diag", "dense"):
        raise ValueError(f"metric must be 'diag' or 'dense', got {metric!r}")
    return metric.strip().lower()


def check_adapt_metric(adapt_metric: Any) -> bool:
    """``adapt_metric`` as True or False, else ValueError naming the argument."""
    if isinstance(adapt_metric, bool | np.bool_):
        return bool(adapt_metric)
    raise ValueError(f"adapt_metric must be True or False, got {adapt_metric!r}")


#: what warm-up estimates the metric from (``metric_from`` of HMC and NUTS)
METRIC_SOURCES = ("draws", "differences")


def check_metric_from(metric_from: Any, none: bool = True) -> str | None:
    """``metric_from`` as ``"draws"``, ``"differences"`` or, with ``none``, None (the
    algorithm's choice: ``"differences"`` under FlyMC, else ``"draws"``), else ValueError
    naming the argument."""
    if metric_from is None and none:
        return None
    if not isinstance(metric_from, str) or metric_from.strip().lower() not in METRIC_SOURCES:
        words = "None, 'draws' or 'differences'" if none else "'draws' or 'differences'"
        raise ValueError(f"metric_from must be {words}, got {metric_from!r}")
    return metric_from.strip().lower()


def hamiltonian_params(
    step_size: float, inv_metric: np.ndarray, find_step_size: bool = False
) -> HamiltonianParams:
    """Params from a step size and an inverse metric, deriving the momentum factor.

    Parameters
    ----------
    step_size
        ε (positive).
    inv_metric
        ``M⁻¹``: a positive vector (diagonal) or a symmetric positive-definite matrix.
    find_step_size
        Whether the next step runs the step-size heuristic first.

    Returns
    -------
    HamiltonianParams
        With read-only float64 copies of the arrays.

    Raises
    ------
    ValueError
        On a non-positive step size or an inverse metric that is not finite, not
        positive (definite) or of the wrong shape.
    """
    step_size = check_positive("step_size", step_size)
    inv = np.array(inv_metric, dtype=np.float64, order="C", copy=True)
    if not np.isfinite(inv).all():
        raise ValueError("inv_metric must be finite")
    if inv.ndim == 1 and inv.shape[0] >= 1:
        if not np.all(inv > 0.0):
            raise ValueError("a diagonal inv_metric must be positive")
        factor = 1.0 / np.sqrt(inv)
    elif inv.ndim == 2 and inv.shape[0] == inv.shape[1] >= 1:
        inv = 0.5 * (inv + inv.T)
        try:
            chol = np.linalg.cholesky(inv)
        except np.linalg.LinAlgError:
            raise ValueError("a dense inv_metric must be positive definite") from None
        # M = (L Lᵀ)⁻¹ = L⁻ᵀ L⁻¹: momenta p = L⁻ᵀ z have covariance M
        factor = scipy.linalg.solve_triangular(chol, np.eye(inv.shape[0]), lower=True).T.copy()
    else:
        raise ValueError(f"inv_metric must have shape (P,) or (P, P), got {inv.shape}")
    inv.flags.writeable = False
    factor.flags.writeable = False
    return HamiltonianParams(
        step_size=step_size,
        inv_metric=inv,
        momentum_factor=factor,
        find_step_size=bool(find_step_size),
    )


def initial_hamiltonian_params(
    dim: int, scale_tril: np.ndarray | None, metric: str, step_size: float | None
) -> HamiltonianParams:
    """The kernels' ``init_params``: the metric seeded from the preconditioner.

    ``scale_tril`` is the Cholesky factor ``L`` of a preconditioner covariance; the
    inverse metric is ``L Lᵀ`` (``"dense"``) or its diagonal (``"diag"``), the
    identity when None. The default step size is ``P^(−1/4)`` (the leapfrog's scaling
    with dimension on a well-preconditioned target); warm-up adapts it.
    """
    tril = check_scale_tril(dim, scale_tril)
    metric = check_metric(metric)
    if tril is None:
        inv = np.ones(dim) if metric == "diag" else np.eye(dim)
    elif metric == "diag":
        inv = np.einsum("ij,ij->i", tril, tril)
    else:
        inv = tril @ tril.T
    eps = step_size if step_size is not None else dim**-0.25
    return hamiltonian_params(eps, inv)


def metric_product(inv_metric: np.ndarray) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """``np.multiply`` for a diagonal inverse metric, ``np.dot`` for a dense one.

    Either way ``product(inv_metric, p)`` is ``M⁻¹ p``, and ``product(factor, z)`` a
    momentum draw.
    """
    return np.multiply if inv_metric.ndim == 1 else np.dot


def kinetic_energy(momentum: np.ndarray, velocity: np.ndarray) -> float:
    """``½ pᵀ M⁻¹ p`` from ``p`` and ``M⁻¹ p``."""
    return 0.5 * float(np.dot(momentum, velocity))


# ----------------------------------------------------------------------------- requests
def _grad_row(response: EvalResponse, where: str) -> np.ndarray:
    grad = response.grad
    if grad is None:
        raise ValueError(f"response carries no gradient {where}")
    return grad[0]


def initial_phase(response: EvalResponse, position: np.ndarray) -> tuple[float, np.ndarray]:
    """The log target and its gradient at the current position, from the first response.

    Raises
    ------
    FloatingPointError
        If ``logp_current`` is NaN, ±inf, or the gradient is not finite.
    ValueError
        If the response carries no gradient, or one of the wrong shape.
    """
    logp = checked_value(response.logp_current, "the current position")
    if response.grad_current is None:
        raise ValueError("response carries no gradient at the current position")
    grad = np.asarray(response.grad_current, dtype=np.float64)
    if grad.shape != position.shape:
        raise ValueError(
            f"gradient at the current position has shape {grad.shape}, expected {position.shape}"
        )
    if logp == -math.inf:
        raise FloatingPointError(
            "log density at the current position is -inf: a Hamiltonian "
            "kernel needs a position of positive density"
        )
    if not np.isfinite(grad).all():
        raise FloatingPointError("gradient at the current position is not finite")
    return logp, grad


def start_phase(
    position: np.ndarray,
    logp: float,
    grad: np.ndarray,
    momentum: np.ndarray,
    inv_metric: np.ndarray,
    product: Callable,
) -> Phase:
    """The phase point at the current position with momentum ``momentum``."""
    velocity = product(inv_metric, momentum)
    return Phase(
        position, momentum, velocity, grad, logp, kinetic_energy(momentum, velocity) - logp
    )


def leapfrog(
    state: Phase, eps: float, inv_metric: np.ndarray, product: Callable
) -> Generator[EvalRequest, EvalResponse, Phase]:
    """One leapfrog step of size ``eps`` (negative: backwards in time): one request.

    ``p ← p + ε/2 ∇ log p(θ)``, ``θ ← θ + ε M⁻¹ p``, evaluate, ``p ← p + ε/2 ∇ log p(θ)``.
    Every array of the returned :class:`Phase` is fresh; ``state`` is not modified.

    Yields
    ------
    EvalRequest
        ``points = θ′[None]``, ``grad=True``.

    Returns
    -------
    Phase
        The new point; at zero density (``log p = −inf``) its energy is +inf and its
        gradient and velocity None (the gradient there is never looked at).

    Raises
    ------
    FloatingPointError
        If the log density is NaN or +inf, or the gradient holds a NaN where the
        density is positive. (An infinite gradient or an overflow gives an infinite
        energy: a divergence, not an error.)
    ValueError
        If the response carries no gradient.
    """
    half = 0.5 * eps
    momentum = state.grad * half
    momentum += state.momentum
    position = product(inv_metric, momentum)
    position *= eps
    position += state.position
    response = yield EvalRequest(position[None], True)
    logp = float(response.logp[0])
    if not -math.inf < logp < math.inf:
        if logp == -math.inf:
            return Phase(position, momentum, None, None, logp, math.inf)
        raise FloatingPointError(f"log density is {logp} at a leapfrog point")
    grad = _grad_row(response, "at a leapfrog point")
    momentum += half * grad
    velocity = product(inv_metric, momentum)
    energy = 0.5 * float(np.dot(momentum, velocity)) - logp
    if not energy < math.inf:  # +inf or NaN (overflow, infinite gradient): a divergence
        if np.isnan(grad).any():
            raise FloatingPointError("gradient is NaN at a leapfrog point of positive density")
        energy = math.inf
    return Phase(position, momentum, velocity, grad, logp, energy)


# --------------------------------------------------------------------------- criterion
def no_u_turn(velocity_a: np.ndarray, velocity_b: np.ndarray, rho: np.ndarray) -> bool:
    """The generalised no-U-turn criterion (Betancourt 2017; Stan's ``compute_criterion``).

    True (keep going) iff both end velocities ``M⁻¹ p`` have a positive projection on
    ``rho``, the sum of the momenta of the trajectory between (and including) them. The
    criterion is symmetric in the two ends, so the order in which the trajectory was
    built does not matter.
    """
    return bool(np.dot(velocity_a, rho) > 0.0) and bool(np.dot(velocity_b, rho) > 0.0)


# ------------------------------------------------------------------------ step size


def begin_step(
    rng: np.random.Generator, position: np.ndarray, params: HamiltonianParams
) -> Generator[EvalRequest, EvalResponse, tuple[Callable, float, np.ndarray, float, int]]:
    """The start every Hamiltonian step shares: the gradient at ``position`` (one request,
    rule 1 of :mod:`.base`), then Stan's step-size search if ``params`` asks for it.

    Returns
    -------
    product, logp, grad, step_size, trials
        The metric's product, the log density and gradient at ``position``, the step
        size to use and the search's requests (0 without a search).
    """
    product = metric_product(params.inv_metric)
    response = yield EvalRequest(np.empty((0, position.shape[0])), False, True)
    logp, grad = initial_phase(response, position)
    eps, trials = params.step_size, 0
    if params.find_step_size:
        eps, trials = yield from find_reasonable_step_size(
            rng, position, logp, grad, eps, params, product
        )
    return product, logp, grad, eps, trials


def find_reasonable_step_size(
    rng: np.random.Generator,
    position: np.ndarray,
    logp: float,
    grad: np.ndarray,
    eps: float,
    params: HamiltonianParams,
    product: Callable,
) -> Generator[EvalRequest, EvalResponse, tuple[float, int]]:
    """Stan's ``init_stepsize`` (Hoffman & Gelman 2014, Algorithm 4), as requests.

    From ``eps``: a fresh momentum and one leapfrog step per trial (one request each);
    the first trial fixes the direction (double while the one-step acceptance
    ``exp(−ΔH)`` exceeds 0.8, else halve while it does not), and the search stops at the
    first step size on the other side — as Stan, which also tries ``eps`` twice. At
    most ``60`` trials.

    Returns
    -------
    tuple of float and int
        The step size found and the number of trials (= evaluations).
    """
    dim = position.shape[0]
    inv = params.inv_metric
    factor = params.momentum_factor
    direction = 0
    trials = 0
    while trials < _MAX_HEURISTIC_TRIALS:
        momentum = product(factor, rng.standard_normal(dim))
        start = start_phase(position, logp, grad, momentum, inv, product)
        end = yield from leapfrog(start, eps, inv, product)
        trials += 1
        delta = start.energy - end.energy  # −inf for a divergence
        up = delta > _LOG_HEURISTIC_TARGET
        if direction == 0:
            direction = 1 if up else -1
        elif up != (direction == 1):
            break
        else:
            eps = 2.0 * eps if direction == 1 else 0.5 * eps
    return eps, trials


def log_add_exp(a: float, b: float) -> float:
    """``log(eᵃ + eᵇ)`` on Python floats (either may be −inf)."""
    if a < b:
        a, b = b, a
    if b == -math.inf:
        return a
    return a + math.log1p(math.exp(b - a))


def accept_statistic(log_ratio: float) -> float:
    """``min(1, exp(log_ratio))`` (0 for −inf; no overflow for large ratios)."""
    return 1.0 if log_ratio >= 0.0 else math.exp(log_ratio) if log_ratio < 0.0 else 0.0
