"""The No-U-Turn Sampler: multinomial NUTS with the generalised U-turn criterion.

As in Stan (``base_nuts.hpp``), NumPyro and blackjax: from ``(θ, p)`` with ``p ~ N(0,
M)``, the trajectory doubles in a random direction (a subtree of ``2^depth`` leapfrog
steps built recursively) until

* a subtree is *invalid*: a leaf diverges (energy error above
  ``divergence_threshold``, or zero density) or one of its sub-subtrees U-turns — it is
  then discarded whole;
* the merged trajectory U-turns (its new points stay candidates); or
* ``max_tree_depth`` doublings are done.

The U-turn test is Betancourt's generalised criterion on the sum of momenta ``ρ``
(:func:`~flymc_dist.kernels.hamiltonian.no_u_turn`), applied, as in current Stan,
across each merge as well as around it (three checks per merge; the two extra ones are
the same as the first when a half is a single leaf and are then skipped). The
criterion is evaluated in :func:`merged_rho` (inlined there for speed).

The draw is multinomial on the weights ``exp(H₀ − H)``: uniform progressive sampling
inside subtrees and biased progressive sampling when a subtree is merged into the
trajectory (prefer the new subtree with probability ``min(1, w_new / w_old)``).

Requests: the gradient at the current position (``points`` empty,
``current_grad=True``), the step-size heuristic's trials when the params ask for it
(warm-up only), one point per leapfrog step (``grad=True``), and — rule 2 of
:mod:`flymc_dist.kernels.base`, because the chosen point can lie anywhere on the
trajectory — one last request of the chosen point (index 0) unless it is the last point
evaluated or the starting point. That costs one evaluation (and in shard mode one round
trip) per iteration. The request asks for the gradient too (``grad=True``) although the
kernel does not use it: the shards commit a move from the cache of the last request,
and the next step's first request wants the gradient at the committed point; with
``grad=False`` regular MCMC would recompute it in a further full pass, and FlyMC's
bright-row cache would have no derivatives to commit.

``info.accept_prob`` is Stan's acceptance statistic, the mean over every leapfrog point
of the tree (discarded subtrees included) of ``min(1, exp(H₀ − H))``: the quantity dual
averaging targets.

:meth:`NUTS.fused_steps` is the same transition run whole by a target that can (FlyMC's
replica of the bright rows: :class:`flymc_dist.replica.FusedTargets`, compiled in
:mod:`flymc_dist._compiled_kernels`): the same random numbers in the same order, the same
tree, up to rounding — in one call instead of a generator round per leapfrog step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

import numpy as np

from flymc_dist.kernels.adaptation import HamiltonianKernel
from flymc_dist.kernels.base import EvalRequest, EvalResponse, StepGenerator
from flymc_dist.kernels.hamiltonian import (
    DIVERGENCE_THRESHOLD,
    HamiltonianInfo,
    HamiltonianParams,
    Phase,
    begin_step,
    check_adapt_metric,
    check_metric,
    check_metric_from,
    leapfrog,
    log_add_exp,
    start_phase,
)
from flymc_dist.kernels.rwmh import check_positive, check_probability, checked_value

__all__ = ["NUTS"]


class _Tree(NamedTuple):
    """A (sub)trajectory: its two ends, its multinomial draw, weight and momentum sum."""

    first: Phase  # the end next to where it was started from
    last: Phase  # the outer end (built last)
    proposal: Phase
    log_weight: float  # log Σ exp(H₀ − H) over its points
    rho: np.ndarray  # Σ p over its points


class _Context:
    """One step's trajectory state shared by the recursion."""

    __slots__ = (
        "eps",
        "inv",
        "product",
        "rng",
        "h0",
        "threshold",
        "n_leapfrog",
        "sum_accept",
        "divergent",
        "last",
    )

    def __init__(
        self,
        inv: np.ndarray,
        product: Callable,
        rng: np.random.Generator,
        h0: float,
        threshold: float,
    ) -> None:
        self.eps = 0.0
        self.inv = inv
        self.product = product
        self.rng = rng
        self.h0 = h0
        self.threshold = threshold
        self.n_leapfrog = 0
        self.sum_accept = 0.0
        self.divergent = False
        self.last: Phase | None = None  # the last point evaluated


def merged_rho(
    outer_a: Phase,
    inner_a: Phase,
    rho_a: np.ndarray,
    inner_b: Phase,
    outer_b: Phase,
    rho_b: np.ndarray,
) -> np.ndarray | None:
    """``ρ`` of two adjacent trajectories merged, or None if the merge U-turns.

    ``a`` and ``b`` are adjacent at ``inner_a`` | ``inner_b``. Stan's three checks: around
    the merged trajectory, and across the junction from each side (``a`` extended by
    ``b``'s first point, ``b`` extended by ``a``'s last). An extension check equals the
    first one when the extending side is a single point, and is then skipped.
    """
    # no_u_turn() inlined: this runs about once per leapfrog step
    rho = rho_a + rho_b
    if not (np.dot(outer_a.velocity, rho) > 0.0 and np.dot(outer_b.velocity, rho) > 0.0):
        return None
    if inner_b is not outer_b:
        extended = rho_a + inner_b.momentum
        if not (
            np.dot(outer_a.velocity, extended) > 0.0 and np.dot(inner_b.velocity, extended) > 0.0
        ):
            return None
    if inner_a is not outer_a:
        extended = rho_b + inner_a.momentum
        if not (
            np.dot(inner_a.velocity, extended) > 0.0 and np.dot(outer_b.velocity, extended) > 0.0
        ):
            return None
    return rho


def _leaf(ctx: _Context, new: Phase) -> _Tree | None:
    """A one-point subtree from a new leapfrog point; None if the point diverges."""
    ctx.n_leapfrog += 1
    ctx.last = new
    log_weight = ctx.h0 - new.energy  # −inf at zero density
    # Stan's acceptance statistic min(1, exp(H₀ − H))
    ctx.sum_accept += 1.0 if log_weight >= 0.0 else math.exp(log_weight)
    if not -log_weight <= ctx.threshold:
        ctx.divergent = True
        return None
    return _Tree(new, new, new, log_weight, new.momentum)


def _merge(ctx: _Context, init: _Tree, final: _Tree) -> _Tree | None:
    """Two adjacent halves of a subtree merged; None if the merge U-turns."""
    log_weight = log_add_exp(init.log_weight, final.log_weight)
    # uniform progressive sampling: the final half with probability w_final / w_subtree
    delta = final.log_weight - log_weight
    proposal = (
        final.proposal if delta >= 0.0 or ctx.rng.random() < math.exp(delta) else init.proposal
    )
    rho = merged_rho(init.first, init.last, init.rho, final.first, final.last, final.rho)
    if rho is None:
        return None
    return _Tree(init.first, final.last, proposal, log_weight, rho)


def _build_tree(
    ctx: _Context, start: Phase, depth: int
) -> Generator[EvalRequest, EvalResponse, _Tree | None]:
    """A subtree of ``2^depth`` leapfrog steps of size ``ctx.eps`` from ``start``.

    Returns None if it is invalid (a divergent leaf or an inner U-turn); the leapfrog
    steps taken so far still count in ``ctx``'s acceptance statistic. (Depths 0 and 1
    are written out: a generator per leaf would cost more than the leaf's arithmetic.)
    """
    if depth == 0:
        return _leaf(ctx, (yield from leapfrog(start, ctx.eps, ctx.inv, ctx.product)))
    if depth == 1:
        init = _leaf(ctx, (yield from leapfrog(start, ctx.eps, ctx.inv, ctx.product)))
        if init is None:
            return None
        final = _leaf(ctx, (yield from leapfrog(init.last, ctx.eps, ctx.inv, ctx.product)))
    else:
        init = yield from _build_tree(ctx, start, depth - 1)
        if init is None:
            return None
        final = yield from _build_tree(ctx, init.last, depth - 1)
    if final is None:
        return None
    return _merge(ctx, init, final)


class NUTS(HamiltonianKernel):
    """Multinomial No-U-Turn Sampler with a diagonal or dense metric.

    Parameters
    ----------
    target_accept
        Mean acceptance statistic the warm-up's dual averaging aims for (default 0.8).
    max_tree_depth
        Maximum number of trajectory doublings (default 10: at most 1023 leapfrog steps).
    metric
        ``"dense"`` (default) or ``"diag"``: the form of the inverse metric, seeded from
        the preconditioner and estimated from the warm-up draws. Dense by default: the
        posteriors this package meets have few parameters (tens to hundreds) and strong
        correlations (e.g. duplicated columns), the preconditioner it is seeded from is a
        dense Laplace covariance, and a dense ``M⁻¹ p`` costs one small mat-vec.
    step_size
        Initial step size; default ``P^(−1/4)``. Warm-up adapts it.
    find_step_size
        Run Stan's step-size heuristic during warm-up, at the second step and after every
        metric update (default True).
    divergence_threshold
        Energy error above which a leapfrog step is divergent (default 1000, as Stan).
    adapt_metric
        Whether warm-up estimates the metric from the draws in Stan's slow windows (True,
        default) or keeps the preconditioner's (False; warm-up adapts the step size). In
        FlyMC the draws' covariance is the posterior's, while each step samples θ given
        z, which can be much narrower: ``precondition="bound"`` with ``False`` keeps that
        conditional's own Gaussian (see :func:`flymc_dist.sample`).
    metric_from
        What the slow windows estimate the metric from: ``"draws"`` (their covariance,
        as Stan) or ``"differences"`` (half the covariance of successive draws: the mean
        covariance of the conditional a Gibbs block samples; see
        :class:`~flymc_dist.kernels.adaptation.WindowAdaptation`). Default (None): the
        algorithm's — ``"differences"`` under FlyMC, whose θ-step samples θ given z,
        ``"draws"`` otherwise.

    Notes
    -----
    The returned info is a :class:`~flymc_dist.kernels.hamiltonian.HamiltonianInfo`.
    """

    name = "nuts"
    needs_grad = True
    step_chains = None
    sample_stats = {**HamiltonianKernel.sample_stats, "tree_depth": "int64"}

    def __init__(
        self,
        target_accept: float = 0.8,
        max_tree_depth: int = 10,
        metric: str = "dense",
        step_size: float | None = None,
        find_step_size: bool = True,
        divergence_threshold: float = DIVERGENCE_THRESHOLD,
        adapt_metric: bool = True,
        metric_from: str | None = None,
    ) -> None:
        self.target_accept = check_probability("target_accept", target_accept)
        if (
            isinstance(max_tree_depth, bool)
            or not isinstance(max_tree_depth, int | np.integer)
            or not 1 <= max_tree_depth <= 30
        ):
            raise ValueError(
                f"max_tree_depth must be an integer in [1, 30], got {max_tree_depth!r}"
            )
        self.max_tree_depth = int(max_tree_depth)
        self.metric = check_metric(metric)
        self.step_size = None if step_size is None else check_positive("step_size", step_size)
        if not isinstance(find_step_size, bool | np.bool_):
            raise ValueError(f"find_step_size must be True or False, got {find_step_size!r}")
        self.find_step_size = bool(find_step_size)
        self.divergence_threshold = check_positive("divergence_threshold", divergence_threshold)
        self.adapt_metric = check_adapt_metric(adapt_metric)
        self.metric_from = check_metric_from(metric_from)

    def __repr__(self) -> str:
        return (
            f"NUTS(target_accept={self.target_accept}, max_tree_depth={self.max_tree_depth}, "
            f"metric={self.metric!r}, step_size={self.step_size}, "
            f"metric_from={self.metric_from!r})"
        )

    def fuses(self, params: HamiltonianParams) -> bool:
        """A step fuses unless it runs the step-size heuristic (warm-up only)."""
        return not params.find_step_size

    def fused_settings(self, params: list[HamiltonianParams]) -> tuple[str, tuple]:
        """``"nuts"``: the step sizes, inverse metrics and momentum factors, the tree depth
        and the divergence threshold (see :meth:`.Kernel.fused_settings`)."""
        return "nuts", (
            [p.step_size for p in params],
            [p.inv_metric for p in params],
            [p.momentum_factor for p in params],
            self.max_tree_depth,
            self.divergence_threshold,
        )

    def fused_steps(
        self,
        rngs: list[np.random.Generator],
        positions: np.ndarray,
        params: list[HamiltonianParams],
        targets: Any,
    ) -> tuple[np.ndarray, list[HamiltonianInfo], np.ndarray]:
        """:meth:`step` of every chain run whole by ``targets.nuts`` (see
        :meth:`.Kernel.fused_steps`): the same transitions up to rounding, from the same
        random numbers. Evaluations (and requests, all local): the current position and
        one per leapfrog step (no final request: nothing commits from a cache)."""
        new, floats, ints = targets.nuts(rngs, positions, *self.fused_settings(params)[1])
        infos = []
        for c, p in enumerate(params):
            moved, n_leapfrog, n_evals, depth, divergent = ints[c].tolist()
            if not moved:
                new[c] = positions[c]
            infos.append(
                HamiltonianInfo(
                    accepted=bool(moved),
                    accept_prob=float(floats[c, 2]),
                    index=0 if moved else -1,
                    n_evals=n_evals,
                    n_requests=n_evals,
                    position=new[c],
                    step_size=p.step_size,
                    step_size_found=False,
                    n_leapfrog=n_leapfrog,
                    tree_depth=depth,
                    divergent=bool(divergent),
                    energy=float(floats[c, 1]),
                )
            )
        return new, infos, floats[:, 0]

    def step(
        self, rng: np.random.Generator, position: np.ndarray, params: HamiltonianParams
    ) -> StepGenerator:
        """One NUTS transition from ``position``: a generator (see :mod:`.base`).

        Randomness, in order: the heuristic's momenta (if it runs), ``P`` normals (the
        momentum), then one uniform per doubling (direction) and per merge where a
        progressive-sampling decision is not certain.

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
            leapfrog step, then possibly the chosen point (see the module docstring).

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
        n_evals = trials

        momentum = product(params.momentum_factor, rng.standard_normal(dim))
        z0 = start_phase(position, logp, grad, momentum, inv, product)
        ctx = _Context(inv, product, rng, z0.energy, self.divergence_threshold)
        left = right = sample = z0
        rho = z0.momentum
        log_weight = 0.0
        depth = 0
        while depth < self.max_tree_depth:
            forward = rng.random() > 0.5
            ctx.eps = eps if forward else -eps
            tree = yield from _build_tree(ctx, right if forward else left, depth)
            if tree is None:
                break
            depth += 1
            # biased progressive sampling: the new subtree w.p. min(1, w_new / w_old)
            delta = tree.log_weight - log_weight
            if delta >= 0.0 or rng.random() < math.exp(delta):
                sample = tree.proposal
            log_weight = log_add_exp(log_weight, tree.log_weight)
            if forward:
                rho = merged_rho(left, right, rho, tree.first, tree.last, tree.rho)
                right = tree.last
            else:
                rho = merged_rho(right, left, rho, tree.first, tree.last, tree.rho)
                left = tree.last
            if rho is None:
                break
        n_requests += ctx.n_leapfrog
        n_evals += ctx.n_leapfrog
        accept_prob = ctx.sum_accept / ctx.n_leapfrog

        if sample is z0:
            new, index = position, -1
        else:
            new, index = sample.position, 0
            if sample is not ctx.last:  # rule 2: the new position must be in the last request
                # with its gradient: the evaluator commits the move from this request's
                # cache, and the next step asks for the gradient here (see the module notes)
                response = yield EvalRequest(new[None], True, False)
                checked_value(response.logp[0], "the chosen point")
                n_requests += 1
                n_evals += 1
        info = HamiltonianInfo(
            accepted=index == 0,
            accept_prob=accept_prob,
            index=index,
            n_evals=n_evals,
            n_requests=n_requests,
            position=new,
            step_size=eps,
            step_size_found=params.find_step_size,
            n_leapfrog=ctx.n_leapfrog,
            tree_depth=depth,
            divergent=ctx.divergent,
            energy=sample.energy,
        )
        return new, info
