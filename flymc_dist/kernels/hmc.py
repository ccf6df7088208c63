"""Hamiltonian Monte Carlo with a fixed integration time and a jittered step size.

From ``(θ, p)``, ``p ~ N(0, M)``: ``n = ⌈T / ε⌉`` leapfrog steps of size
``ε′ = ε (1 + j (2u − 1))`` (``u`` uniform, jitter ``j`` = 10 % by default, so that the
integration time ``n ε′`` varies and no direction is trapped at a multiple of its
period), then a Metropolis test on the Hamiltonian: accept the end point with
probability ``min(1, exp(H₀ − H₁))``. A trajectory whose energy error exceeds the
divergence threshold (or that reaches zero density) stops and is rejected; the
trajectory's points, hence that rule, are the same forwards and backwards, so the
chain stays exact.

The integration time ``T`` (``trajectory_length``) is fixed, not adapted, in the
units of the metric: with the metric a good estimate of the posterior covariance (what
warm-up adapts), a Gaussian posterior in whitened coordinates oscillates with period
``2π`` in every direction, and ``T = π/2`` (the default) carries a point a quarter
period, to a draw independent of the start. Non-Gaussian posteriors, or a metric far
from the covariance, want NUTS, which chooses the length per iteration.

Requests: the gradient at the current position (``points`` empty, ``current_grad=True``),
the step-size heuristic's trials when the params ask for it (warm-up only), then one
point per leapfrog step (``grad=True``). The end point is the last request's point, so
an accepted move has ``index = 0`` and needs no extra request.
"""

from __future__ import annotations

import math

import numpy as np

from flymc_dist.kernels.adaptation import HamiltonianKernel
from flymc_dist.kernels.base import StepGenerator
from flymc_dist.kernels.hamiltonian import (
    DIVERGENCE_THRESHOLD,
    HamiltonianInfo,
    HamiltonianParams,
    accept_statistic,
    begin_step,
    check_adapt_metric,
    check_metric,
    check_metric_from,
    leapfrog,
    start_phase,
)
from flymc_dist.kernels.rwmh import check_positive, check_probability

__all__ = ["HMC"]


class HMC(HamiltonianKernel):
    """Static-length HMC with a jittered step size and a diagonal or dense metric.

    Parameters
    ----------
    target_accept
        Mean acceptance probability the warm-up's dual averaging aims for (default 0.8).
    trajectory_length
        Integration time ``T`` in units of the metric (default ``π/2``, see the module
        docstring); the number of leapfrog steps is ``⌈T / ε⌉`` for the nominal ``ε``.
    metric
        ``"dense"`` (default) or ``"diag"``; see :class:`~flymc_dist.kernels.nuts.NUTS`.
    step_size
        Initial step size; default ``P^(−1/4)``. Warm-up adapts it.
    jitter
        Relative half-width of the uniform step-size jitter (default 0.1; 0: none).
    max_steps
        Cap on the leapfrog steps per iteration (default 1024), for tiny step sizes.
    find_step_size
        Run Stan's step-size heuristic during warm-up (default True).
    divergence_threshold
        Energy error above which the trajectory is divergent (default 1000).
    adapt_metric
        Whether warm-up estimates the metric from the draws in Stan's slow windows (True,
        default) or keeps the preconditioner's (False; warm-up adapts the step size). In
        FlyMC the draws' covariance is the posterior's, while each step samples θ given
        z, which can be much narrower: ``precondition="bound"`` with ``False`` keeps that
        conditional's own Gaussian (see :func:`flymc_dist.sample`).
    metric_from
        None (default: the algorithm's), ``"draws"`` or ``"differences"``; see
        :class:`~flymc_dist.kernels.nuts.NUTS`.

    Notes
    -----
    The returned info is a :class:`~flymc_dist.kernels.hamiltonian.HamiltonianInfo`
    (``tree_depth`` 0).
    """

    name = "hmc"
    needs_grad = True
    step_chains = None

    def __init__(
        self,
        target_accept: float = 0.8,
        trajectory_length: float = 0.5 * math.pi,
        metric: str = "dense",
        step_size: float | None = None,
        jitter: float = 0.1,
        max_steps: int = 1024,
        find_step_size: bool = True,
        divergence_threshold: float = DIVERGENCE_THRESHOLD,
        adapt_metric: bool = True,
        metric_from: str | None = None,
    ) -> None:
        self.target_accept = check_probability("target_accept", target_accept)
        self.trajectory_length = check_positive("trajectory_length", trajectory_length)
        self.metric = check_metric(metric)
        self.step_size = None if step_size is None else check_positive("step_size", step_size)
        try:
            jitter = float(jitter)
        except (TypeError, ValueError):
            raise ValueError(f"jitter must be a number in [0, 1), got {jitter!r}") from None
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"jitter must lie in [0, 1), got {jitter!r}")
        self.jitter = jitter
        if (
            isinstance(max_steps, bool)
            or not isinstance(max_steps, int | np.integer)
            or max_steps < 1
        ):
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        self.max_steps = int(max_steps)
        if not isinstance(find_step_size, bool | np.bool_):
            raise ValueError(f"find_step_size must be True or False, got {find_step_size!r}")
        self.find_step_size = bool(find_step_size)
        self.divergence_threshold = check_positive("divergence_threshold", divergence_threshold)
        self.adapt_metric = check_adapt_metric(adapt_metric)
        self.metric_from = check_metric_from(metric_from)

    def __repr__(self) -> str:
        return (
            f"HMC(target_accept={self.target_accept}, "
            f"trajectory_length={self.trajectory_length}, metric={self.metric!r}, "
            f"step_size={self.step_size}, jitter={self.jitter}, "
            f"metric_from={self.metric_from!r})"
        )

    def n_steps(self, step_size: float) -> int:
        """Leapfrog steps per iteration at nominal step size ``step_size``."""
        return max(1, min(self.max_steps, math.ceil(self.trajectory_length / step_size)))

    def step(
        self, rng: np.random.Generator, position: np.ndarray, params: HamiltonianParams
    ) -> StepGenerator:
        """One HMC transition from ``position``: a generator (see :mod:`.base`).

        Randomness, in order: the heuristic's momenta (if it runs), ``P`` normals (the
        momentum), one uniform (the jitter), one standard exponential (``−log u``).

        Parameters
        ----------
        rng
            The chain's random stream (the only source of randomness).
        position
            Current position, shape ``(P,)`` (never modified).
        params
            Step size and metric.

        Yields
        ------
        EvalRequest
            The gradient at ``position``, then one point per heuristic trial and per
            leapfrog step.

        Returns
        -------
        tuple of numpy.ndarray and HamiltonianInfo
            The new position and what the step did (``StopIteration.value``).

        Raises
        ------
        FloatingPointError
            On a NaN (or +inf) log density, a −inf one at ``position``, a non-finite
            gradient at ``position`` or a NaN one where the density is positive.
        """
        dim = position.shape[0]
        inv = params.inv_metric
        product, logp, grad, eps, trials = yield from begin_step(rng, position, params)
        n_requests = 1 + trials
        momentum = product(params.momentum_factor, rng.standard_normal(dim))
        eps_jittered = eps * (1.0 + self.jitter * (2.0 * rng.random() - 1.0))
        neg_log_u = rng.standard_exponential()

        state = z0 = start_phase(position, logp, grad, momentum, inv, product)
        n = self.n_steps(eps)
        divergent = False
        done = 0
        while done < n:
            state = yield from leapfrog(state, eps_jittered, inv, product)
            done += 1
            if not state.energy - z0.energy <= self.divergence_threshold:
                divergent = True
                break
        log_ratio = -math.inf if divergent else z0.energy - state.energy
        accepted = log_ratio > -neg_log_u
        new = state.position if accepted else position
        info = HamiltonianInfo(
            accepted=accepted,
            accept_prob=accept_statistic(log_ratio),
            index=0 if accepted else -1,
            n_evals=n_requests - 1 + done,
            n_requests=n_requests + done,
            position=new,
            step_size=eps,
            step_size_found=params.find_step_size,
            n_leapfrog=done,
            tree_depth=0,
            divergent=divergent,
            energy=state.energy if accepted else z0.energy,
        )
        return new, info
