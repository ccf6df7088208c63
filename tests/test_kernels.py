"""Tests of the θ-kernels (:mod:`flymc_dist.kernels`).

Three layers:

* deterministic pieces (STYLE 9): stub targets that always accept / always reject,
  the round-trip protocol (requests per step, rule 2, NaN and −inf handling), the
  exact MALA proposal correction, the slice sampler's batching (same draws for every
  ``batch`` / ``shrink_ahead``), parameter validation and the adapters;
* one statistical battery (STYLE 7, 8) run on every kernel × target, with tolerances
  from the ESS, including a target that changes between steps (rule 1);
* negative controls: kernels with a deliberate error must *fail* the same battery.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from flymc_dist.diagnostics import ess_bulk
from flymc_dist.kernels import (
    KERNELS,
    MALA,
    EvalRequest,
    EvalResponse,
    Kernel,
    KernelInfo,
    MALAParams,
    RandomWalkMH,
    RWMHParams,
    SliceInfo,
    SliceParams,
    SliceSampler,
    get_kernel,
    run_step,
)

Z_CRIT = 4.0  # per-moment |error| / MCSE tolerance (two-sided p ≈ 6e-5 per check)


# =============================================================================== targets
class Target:
    """A log density with gradient, vectorised over rows of ``X`` (k, P)."""

    dim: int
    mean: np.ndarray
    cov: np.ndarray

    def logp(self, X: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def grad(self, X: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def refresh(self, position: np.ndarray, rng: np.random.Generator) -> None:
        """Called at the start of every step (a target that moves between steps)."""


class Gaussian(Target):
    def __init__(self, mean: np.ndarray, cov: np.ndarray) -> None:
        self.mean = np.asarray(mean, float)
        self.cov = np.asarray(cov, float)
        self.dim = self.mean.shape[0]
        self.prec = np.linalg.inv(self.cov)

    def logp(self, X: np.ndarray) -> np.ndarray:
        D = X - self.mean
        return -0.5 * np.einsum("ij,jk,ik->i", D, self.prec, D)

    def grad(self, X: np.ndarray) -> np.ndarray:
        return -(X - self.mean) @ self.prec


class Gamma(Target):
    """Gamma(shape, 1): skewed, −inf for x ≤ 0 (where the gradient is NaN on purpose)."""

    def __init__(self, shape: float) -> None:
        self.shape = shape
        self.dim = 1
        self.mean = np.array([shape])
        self.cov = np.array([[shape]])

    def logp(self, X: np.ndarray) -> np.ndarray:
        x = X[:, 0]
        out = np.full(x.shape, -np.inf)
        ok = x > 0
        out[ok] = (self.shape - 1.0) * np.log(x[ok]) - x[ok]
        return out

    def grad(self, X: np.ndarray) -> np.ndarray:
        x = X[:, 0]
        out = np.full(x.shape, np.nan)
        ok = x > 0
        out[ok] = (self.shape - 1.0) / x[ok] - 1.0
        return out[:, None]


class GibbsMixture(Target):
    """θ given an auxiliary label a that is Gibbs-resampled before every step.

    Joint ``p(a, θ) = π_a N(θ; μ_a, σ_a²)``; the kernels see ``log N(θ; μ_a, σ_a²) + c_a``
    (any constant ``c_a`` is valid within a step, as FlyMC's bright sums shift when z
    moves) and a is redrawn from ``p(a | θ)`` at the start of each step, so the
    θ-marginal is the mixture. A kernel that reuses a log density from a previous step
    (breaking rule 1) is biased.
    """

    weights = np.array([0.5, 0.5])
    mus = np.array([0.0, 0.0])  # a scale mixture: variance 1.25, heavier tails
    sigmas = np.array([0.5, 1.5])
    offsets = np.array([0.0, 4.0])

    def __init__(self) -> None:
        self.dim = 1
        m = float(self.weights @ self.mus)
        second = float(self.weights @ (self.sigmas**2 + self.mus**2))
        self.mean = np.array([m])
        self.cov = np.array([[second - m * m]])
        self.label = 0

    def logp(self, X: np.ndarray) -> np.ndarray:
        mu, sigma = self.mus[self.label], self.sigmas[self.label]
        return -0.5 * ((X[:, 0] - mu) / sigma) ** 2 - math.log(sigma) + self.offsets[self.label]

    def grad(self, X: np.ndarray) -> np.ndarray:
        mu, sigma = self.mus[self.label], self.sigmas[self.label]
        return (-(X - mu) / sigma**2).reshape(-1, 1)

    def refresh(self, position: np.ndarray, rng: np.random.Generator) -> None:
        logw = (
            np.log(self.weights)
            - np.log(self.sigmas)
            - 0.5 * ((position[0] - self.mus) / self.sigmas) ** 2
        )
        prob1 = 1.0 / (1.0 + math.exp(logw[0] - logw[1]))
        self.label = int(rng.random() < prob1)


class Flat(Target):
    """Constant log density: every proposal is accepted."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def logp(self, X: np.ndarray) -> np.ndarray:
        return np.zeros(X.shape[0])

    def grad(self, X: np.ndarray) -> np.ndarray:
        return np.zeros_like(X)


class Needle(Target):
    """Zero density everywhere but at the current position: every proposal is rejected."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.position: np.ndarray | None = None

    def logp(self, X: np.ndarray) -> np.ndarray:
        return np.where((X == self.position).all(axis=1), 0.0, -np.inf)

    def grad(self, X: np.ndarray) -> np.ndarray:
        return np.zeros_like(X)


# ============================================================================= evaluator
class Evaluator:
    """Answers a kernel's requests for one chain and checks the protocol rules.

    ``step`` drives one kernel step with :func:`run_step`, refreshing the target at the
    first request (rule 1: the target may change between steps, never within), then
    checks rule 2 (the new position is the current one or a row of the *last*
    request) and that the info's request / evaluation counts are right.
    """

    def __init__(self, target: Target, position: np.ndarray, seed: int = 0) -> None:
        self.target = target
        self.position = np.array(position, dtype=float)
        self.aux_rng = np.random.default_rng([seed, 99])
        self.requests: list[EvalRequest] = []
        self.n_points = 0

    def __call__(self, request: EvalRequest, first: bool) -> EvalResponse:
        if first:
            self.target.refresh(self.position, self.aux_rng)
        self.requests.append(request)
        self.n_points += request.points.shape[0]
        current = self.position[None]
        if isinstance(self.target, Needle):
            self.target.position = self.position
        logp_current = float(self.target.logp(current)[0])
        grad_current = self.target.grad(current)[0] if request.current_grad else None
        if request.points.shape[0]:
            logp = self.target.logp(request.points)
            grad = self.target.grad(request.points) if request.grad else None
        else:
            logp, grad = np.empty(0), (np.empty((0, self.target.dim)) if request.grad else None)
        return EvalResponse(logp_current, grad_current, logp, grad)

    def step(
        self, kernel: Any, rng: np.random.Generator, params: Any
    ) -> tuple[np.ndarray, KernelInfo]:
        self.requests = []
        self.n_points = 0
        new, info = run_step(kernel.step(rng, self.position, params), self)
        expected = self.position if info.index == -1 else self.requests[-1].points[info.index]
        assert np.array_equal(new, expected), "rule 2: not the current point or a last-request row"
        assert info.n_requests == len(self.requests)
        if not isinstance(kernel, MALA):
            assert info.n_evals == self.n_points
        self.position = np.array(new, dtype=float)
        return self.position, info


def sample(
    kernel: Any,
    target: Target,
    *,
    chains: int = 4,
    num_warmup: int = 400,
    num_samples: int = 1500,
    seed: int = 0,
    scale_tril: np.ndarray | None = None,
    init: np.ndarray | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Run independent chains with warm-up adaptation; draws (chains, num_samples, P)."""
    P = target.dim
    draws = np.empty((chains, num_samples, P))
    keys = ("accept_prob", "n_requests", "n_evals")
    info_stats = {k: np.empty((chains, num_samples)) for k in keys}
    for c in range(chains):
        rng = np.random.default_rng([seed, c])
        start = target.mean if init is None else init
        start = start + 0.1 * rng.standard_normal(P) * np.sqrt(np.diagonal(target.cov))
        ev = Evaluator(target, start, seed=seed * 1000 + c)
        params = kernel.init_params(P, scale_tril)
        adapter = kernel.adapter(params, num_warmup)
        for _ in range(num_warmup):
            _, info = ev.step(kernel, rng, params)
            params = adapter.update(info)
        params = adapter.final()
        for i in range(num_samples):
            draws[c, i], info = ev.step(kernel, rng, params)
            for k in keys:
                info_stats[k][c, i] = getattr(info, k)
    return draws, info_stats


# =============================================================================== battery
def check_moments(
    draws: np.ndarray, mean: np.ndarray, cov: np.ndarray, z_crit: float = Z_CRIT
) -> None:
    """Assert means and (co)variances agree with the truth within ``z_crit`` MCSEs.

    The MCSE of each estimated moment is ``sd / √ESS`` with the bulk ESS of the
    quantity averaged (draws ``(chains, draws, P)``). Raises AssertionError listing
    every failing moment.
    """
    P = draws.shape[2]
    failures = []
    for j in range(P):
        x = draws[:, :, j]
        z = (x.mean() - mean[j]) / (x.std() / math.sqrt(ess_bulk(x)))
        if not abs(z) < z_crit:
            failures.append(f"mean[{j}]: {x.mean():.4f} vs {mean[j]:.4f} (z={z:.1f})")
        for k in range(j, P):
            f = (x - mean[j]) * (draws[:, :, k] - mean[k])
            z = (f.mean() - cov[j, k]) / (f.std() / math.sqrt(ess_bulk(f)))
            if not abs(z) < z_crit:
                failures.append(f"cov[{j},{k}]: {f.mean():.4f} vs {cov[j, k]:.4f} (z={z:.1f})")
    assert not failures, "; ".join(failures)


def battery(kernel: Any, target: Target, **kwargs: Any) -> None:
    """Sample ``target`` with ``kernel`` (4 chains after warm-up) and check its moments."""
    draws, _ = sample(kernel, target, **kwargs)
    check_moments(draws, target.mean, target.cov)


ROUGH_TRIL = np.linalg.cholesky(np.array([[1.5, 0.3], [0.3, 0.6]]))  # a poor preconditioner

TARGETS: dict[str, tuple[Callable[[], Target], np.ndarray | None]] = {
    "gauss2d": (lambda: Gaussian([1.0, -2.0], [[1.0, 1.2], [1.2, 4.0]]), ROUGH_TRIL),
    "gamma": (lambda: Gamma(3.0), None),
    "gibbs_mixture": (GibbsMixture, None),
}


#: the battery's targets, each kernel's quick one (gauss2d: correlated, badly
#: preconditioned) in the quick set and the others with the slow tests
BATTERY_TARGETS = [
    pytest.param(name, marks=[] if name == "gauss2d" else [pytest.mark.slow])
    for name in sorted(TARGETS)
]


#: the gradient kernels, whose non-Gaussian cases here run in CI only (``--full-grid``):
#: test_kernels_hmc.py's battery runs them on a banana and a ridge by default
GRADIENT_KERNELS = ("hmc", "nuts")


@pytest.mark.parametrize(
    ("kernel_name", "target_name"),
    [
        pytest.param(
            kernel,
            target,
            id=f"{kernel}-{target}",
            marks=[]
            if target == "gauss2d"
            else [pytest.mark.slow]
            + ([pytest.mark.full_grid] if kernel in GRADIENT_KERNELS else []),
        )
        for kernel in sorted(KERNELS)
        for target in sorted(TARGETS)
    ],
)
def test_battery(kernel_name: str, target_name: str) -> None:
    make, tril = TARGETS[target_name]
    battery(get_kernel(kernel_name), make(), scale_tril=tril, seed=1)


@pytest.mark.parametrize("target_name", BATTERY_TARGETS)
def test_battery_slice_random_directions(target_name: str) -> None:
    """Hit-and-run (``directions="random"``), the slice sampler's other direction rule."""
    make, tril = TARGETS[target_name]
    battery(SliceSampler(directions="random"), make(), scale_tril=tril, seed=1)


def test_slice_steps_along_the_preconditioners_principal_axes() -> None:
    """With ``directions="axes"`` every evaluated point lies on a line through the current
    position along one of ``L``'s principal axes ``s_i u_i`` (``L Lᵀ = Σ s_i² u_i u_iᵀ``,
    each of whitened length 1), and every axis is used."""
    kernel = SliceSampler()
    axes = kernel._axes(ROUGH_TRIL, 2)
    cov = ROUGH_TRIL @ ROUGH_TRIL.T
    assert axes.shape == (2, 2)
    np.testing.assert_allclose(sum(np.outer(a, a) for a in axes), cov, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(np.linalg.solve(ROUGH_TRIL, axes.T), axis=0), 1.0)
    assert kernel._axes(ROUGH_TRIL, 2) is axes  # computed once per preconditioner
    ev = Evaluator(Gaussian([1.0, -2.0], [[1.0, 1.2], [1.2, 4.0]]), np.array([1.0, -2.0]))
    rng = np.random.default_rng(8)
    params = kernel.init_params(2, ROUGH_TRIL)
    used = set()
    for _ in range(60):
        start = ev.position.copy()
        ev.step(kernel, rng, params)
        for request in ev.requests:
            for point in request.points:
                d = point - start
                # parallel to exactly one axis: the cross product with it vanishes
                cross = np.abs(axes[:, 0] * d[1] - axes[:, 1] * d[0])
                hit = np.flatnonzero(cross <= 1e-9 * max(np.linalg.norm(d), 1.0))
                assert hit.size == 1, (d, axes)
                used.add(int(hit[0]))
    assert used == {0, 1}


def test_slice_rejects_unknown_directions() -> None:
    with pytest.raises(ValueError, match="directions must be one of"):
        SliceSampler(directions="diagonal")


# ------------------------------------------------------------------ negative controls
class UncorrectedMALA(MALA):
    """Negative control: MALA without the proposal-density correction."""

    @staticmethod
    def _log_q_ratio(noise: np.ndarray, v: np.ndarray, v_new: np.ndarray, eps: float) -> float:
        return 0.0


class StaleRWMH(RandomWalkMH):
    """Negative control: reuses the log density computed in a previous step (breaks rule 1).

    Exact on a fixed target, biased when the target moves between steps.
    """

    def __init__(self) -> None:
        super().__init__()
        self._cache: dict[bytes, float] = {}

    def step(self, rng, position, params):  # type: ignore[no-untyped-def]
        inner = super().step(rng, position, params)
        response = yield next(inner)
        stale = self._cache.get(position.tobytes(), float(response.logp_current))
        try:
            inner.send(response._replace(logp_current=stale))
        except StopIteration as stop:
            new, info = stop.value
        fresh = float(response.logp[0] if info.index == 0 else response.logp_current)
        self._cache = {new.tobytes(): fresh}  # one step old when used
        return new, info


def test_negative_control_uncorrected_mala_fails() -> None:
    make, tril = TARGETS["gauss2d"]
    with pytest.raises(AssertionError, match="cov|mean"):
        battery(UncorrectedMALA(), make(), scale_tril=tril, seed=1)


def test_negative_control_stale_logp_fails_on_moving_target() -> None:
    battery(StaleRWMH(), Gaussian([1.0, -2.0], [[1.0, 1.2], [1.2, 4.0]]), seed=1)  # exact here
    with pytest.raises(AssertionError, match="cov|mean"):
        battery(StaleRWMH(), GibbsMixture(), seed=1)


# ======================================================================== deterministic
KERNEL_FACTORIES = {
    "rwmh": RandomWalkMH,
    "mala": MALA,
    "slice": SliceSampler,
    "slice_b1": lambda: SliceSampler(batch=1),
}


@pytest.mark.parametrize("name", sorted(KERNEL_FACTORIES))
def test_always_accept_on_flat_target(name: str) -> None:
    kernel = KERNEL_FACTORIES[name]()
    ev = Evaluator(Flat(3), np.array([0.5, -1.0, 2.0]))
    rng = np.random.default_rng(3)
    params = kernel.init_params(3, None)
    for _ in range(20):
        before = ev.position
        new, info = ev.step(kernel, rng, params)
        assert info.accepted and info.accept_prob == 1.0 and info.index >= 0
        assert not np.array_equal(new, before)
        if isinstance(kernel, SliceSampler):  # flat: stepping out always uses its budget
            assert info.n_expand == kernel.max_steps_out - 1 and info.n_contract == 0


@pytest.mark.parametrize("name", sorted(KERNEL_FACTORIES))
@pytest.mark.parametrize("start", [[0.5, -1.0, 2.0], [0.0, 0.0, 0.0]])
def test_always_reject_on_needle_target(name: str, start: list[float]) -> None:
    kernel = KERNEL_FACTORIES[name]()
    ev = Evaluator(Needle(3), np.array(start))
    rng = np.random.default_rng(4)
    params = kernel.init_params(3, None)
    for _ in range(5):
        before = ev.position
        new, info = ev.step(kernel, rng, params)
        assert not info.accepted and info.index == -1
        np.testing.assert_array_equal(new, before)
        if not isinstance(kernel, SliceSampler):
            assert info.accept_prob == 0.0


def test_requests_of_rwmh_and_mala() -> None:
    """RWMH asks for the proposal's log density only, MALA for the current gradient and
    then the proposal's log density and gradient, one request each, every step."""
    target = Gaussian(np.zeros(4), np.eye(4))
    rng = np.random.default_rng(5)
    for kernel, shapes in ((RandomWalkMH(), [(1, 4)]), (MALA(), [(0, 4), (1, 4)])):
        ev = Evaluator(target, np.ones(4))
        params = kernel.init_params(4, None)
        for _ in range(30):
            _, info = ev.step(kernel, rng, params)
            assert info.n_requests == len(shapes) == len(ev.requests)
            assert [r.points.shape for r in ev.requests] == shapes
            assert info.n_evals == 1
        if isinstance(kernel, MALA):
            assert ev.requests[0].current_grad and not ev.requests[0].grad
            assert ev.requests[1].grad and not ev.requests[1].current_grad
        else:
            assert not (ev.requests[0].grad or ev.requests[0].current_grad)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernels_declare_what_they_need(name: str) -> None:
    """Every kernel is a :class:`Kernel` and declares ``needs_grad`` and ``step_chains``
    (the driver reads them directly); a kernel whose requests never ask for gradients
    says so."""
    kernel = get_kernel(name)
    assert isinstance(kernel, Kernel)
    assert isinstance(type(kernel).needs_grad, bool)
    assert kernel.step_chains is None or callable(kernel.step_chains)
    target = Gaussian(np.zeros(3), np.eye(3))
    ev = Evaluator(target, np.ones(3))
    params = kernel.init_params(3, None)
    rng = np.random.default_rng(7)
    asked_grad = False
    for _ in range(20):
        _, info = ev.step(kernel, rng, params)
        asked_grad |= any(r.grad or r.current_grad for r in ev.requests)
    assert asked_grad == kernel.needs_grad


def test_rwmh_uses_logp_current_of_the_same_response() -> None:
    """Accept iff log u < logp′ − logp_current, whatever happened in earlier steps."""
    kernel = RandomWalkMH()
    params = kernel.init_params(2, None)
    for delta, expected in ((-np.inf, False), (50.0, True), (-50.0, False)):
        gen = kernel.step(np.random.default_rng(0), np.zeros(2), params)
        req = next(gen)
        with pytest.raises(StopIteration) as stop:
            gen.send(EvalResponse(7.0, None, np.array([7.0 + delta]), None))
        new, info = stop.value.value
        assert info.accepted is expected
        np.testing.assert_array_equal(new, req.points[0] if expected else np.zeros(2))


def test_mala_acceptance_matches_explicit_proposal_densities() -> None:
    """The MH ratio equals the one computed from the Gaussian proposal densities."""
    target = Gaussian([0.3, -0.2, 1.0], [[2.0, 0.5, 0.1], [0.5, 1.0, -0.3], [0.1, -0.3, 0.8]])
    tril = np.linalg.cholesky(np.array([[1.0, 0.2, 0.0], [0.2, 0.5, 0.1], [0.0, 0.1, 2.0]]))
    sigma = tril @ tril.T
    kernel = MALA()
    params = MALAParams(step_size=0.9, scale_tril=tril)
    rng = np.random.default_rng(6)
    checked = 0
    for _ in range(20):
        theta = rng.standard_normal(3)
        ev = Evaluator(target, theta)
        _, info = ev.step(kernel, rng, params)
        prop = ev.requests[-1].points[0]
        eps = params.step_size

        def log_q(to: np.ndarray, frm: np.ndarray, eps: float = eps) -> float:
            mean = frm + 0.5 * eps**2 * sigma @ target.grad(frm[None])[0]
            return stats.multivariate_normal.logpdf(to, mean, eps**2 * sigma)

        log_ratio = (
            target.logp(prop[None])[0]
            - target.logp(theta[None])[0]
            + log_q(theta, prop)
            - log_q(prop, theta)
        )
        assert info.accept_prob == pytest.approx(min(1.0, math.exp(log_ratio)), rel=1e-9)
        checked += 0.0 < info.accept_prob < 1.0
    assert checked >= 5  # the comparison was not only at the clip


@pytest.mark.parametrize("name", sorted(KERNEL_FACTORIES))
def test_nan_raises(name: str) -> None:
    kernel = KERNEL_FACTORIES[name]()
    params = kernel.init_params(2, None)

    class NaNTarget(Gaussian):
        def logp(self, X: np.ndarray) -> np.ndarray:
            return np.full(X.shape[0], np.nan)

    ev = Evaluator(NaNTarget(np.zeros(2), np.eye(2)), np.zeros(2))
    with pytest.raises(FloatingPointError):
        ev.step(kernel, np.random.default_rng(0), params)


def test_nan_at_proposal_raises_even_with_finite_current() -> None:
    for kernel in (RandomWalkMH(), MALA(), SliceSampler()):
        params = kernel.init_params(1, None)
        gen = kernel.step(np.random.default_rng(0), np.zeros(1), params)
        req = next(gen)
        with pytest.raises(FloatingPointError):
            while True:
                k = req.points.shape[0]
                req = gen.send(EvalResponse(0.0, np.zeros(1), np.full(k, np.nan), np.zeros((k, 1))))


def test_mala_nan_gradient_raises_only_where_density_is_positive() -> None:
    kernel = MALA()
    params = kernel.init_params(1, None)
    gen = kernel.step(np.random.default_rng(0), np.zeros(1), params)
    next(gen)
    gen.send(EvalResponse(0.0, np.zeros(1), np.empty(0), None))
    with pytest.raises(StopIteration) as stop:  # -inf at the proposal: NaN gradient ignored
        gen.send(EvalResponse(0.0, None, np.array([-np.inf]), np.full((1, 1), np.nan)))
    assert stop.value.value[1].index == -1
    gen = kernel.step(np.random.default_rng(0), np.zeros(1), params)
    next(gen)
    gen.send(EvalResponse(0.0, np.zeros(1), np.empty(0), None))
    with pytest.raises(FloatingPointError):
        gen.send(EvalResponse(0.0, None, np.array([-1.0]), np.full((1, 1), np.nan)))


# ------------------------------------------------------------------------ slice batching
def _slice_run(
    kernel: SliceSampler,
    target: Target,
    params: SliceParams | None,
    steps: int,
    seed: int,
    adapt: bool = False,
) -> tuple[np.ndarray, int, int]:
    rng = np.random.default_rng(seed)
    ev = Evaluator(target, target.mean + 0.3)
    if params is None:
        params = kernel.init_params(target.dim, None)
    adapter = kernel.adapter(params, steps) if adapt else None
    draws = np.empty((steps, target.dim))
    n_req = n_eval = 0
    for i in range(steps):
        draws[i], info = ev.step(kernel, rng, params)
        n_req += info.n_requests
        n_eval += info.n_evals
        if adapter is not None:
            params = adapter.update(info)
    return draws, n_req, n_eval


@pytest.mark.parametrize("width", [0.05, 1.0, 20.0])
@pytest.mark.parametrize("target_name", ["gauss5", "gamma"])
def test_slice_batching_gives_identical_draws(target_name: str, width: float) -> None:
    """Speculative batching is exact: the draws equal sequential Neal (batch=1)."""
    target = (
        Gamma(3.0)
        if target_name == "gamma"
        else Gaussian(np.arange(5.0), np.diag([0.1, 1.0, 4.0, 1.0, 0.5]))
    )
    params = SliceParams(width=width, scale_tril=None)
    ref, req_ref, eval_ref = _slice_run(
        SliceSampler(batch=1, max_steps_out=8), target, params, 150, seed=11
    )
    assert np.unique(ref, axis=0).shape[0] > 100  # it moves
    for batch, ahead in ((2, 0), (4, 0), (4, 4), (3, 7), (16, 1)):
        kernel = SliceSampler(batch=batch, shrink_ahead=ahead, max_steps_out=8)
        draws, n_req, _ = _slice_run(kernel, target, params, 150, seed=11)
        np.testing.assert_array_equal(draws, ref)
        assert n_req < req_ref


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    log_width=st.floats(-3.0, 3.0),
    batch=st.integers(1, 9),
    ahead=st.integers(0, 9),
    max_steps_out=st.integers(1, 12),
)
def test_slice_batching_identical_property(
    seed: int, log_width: float, batch: int, ahead: int, max_steps_out: int
) -> None:
    target = Gaussian([0.0, 1.0], [[1.0, 0.9], [0.9, 1.0]])
    params = SliceParams(width=math.exp(log_width), scale_tril=None)
    ref, _, _ = _slice_run(
        SliceSampler(batch=1, shrink_ahead=0, max_steps_out=max_steps_out),
        target,
        params,
        25,
        seed=seed,
    )
    draws, _, _ = _slice_run(
        SliceSampler(batch=batch, shrink_ahead=ahead, max_steps_out=max_steps_out),
        target,
        params,
        25,
        seed=seed,
    )
    np.testing.assert_array_equal(draws, ref)


def test_slice_batching_identical_under_adaptation() -> None:
    """With the same ``target_expand`` the adapted widths, hence draws, do not depend on batch."""
    target = Gaussian(np.zeros(3), np.diag([1.0, 9.0, 0.25]))
    runs = [
        _slice_run(
            SliceSampler(batch=b, shrink_ahead=a, target_expand=0.3),
            target,
            None,
            200,
            seed=12,
            adapt=True,
        )
        for b, a in ((1, 0), (4, 4), (5, 0))
    ]
    for draws, _, _ in runs[1:]:
        np.testing.assert_array_equal(draws, runs[0][0])


def test_slice_one_round_trip_when_the_first_batch_suffices() -> None:
    kernel = SliceSampler(batch=4)  # shrink_ahead defaults to batch
    assert kernel.shrink_ahead == 4
    ev = Evaluator(Gaussian(np.zeros(2), np.eye(2)), np.zeros(2))
    rng = np.random.default_rng(13)
    params = SliceParams(width=12.0, scale_tril=None)
    counts = []
    for _ in range(200):
        counts.append(ev.step(kernel, rng, params)[1].n_requests)
        assert ev.requests[0].points.shape == (2 + 4, 2)  # both ends + 4 candidates
    assert counts.count(1) > 100


def test_slice_ends_outside_at_minus_inf() -> None:
    """On Gamma near 0 the left end is at −inf: outside the slice, never selected."""
    kernel = SliceSampler(batch=2)
    ev = Evaluator(Gamma(3.0), np.array([0.05]))
    rng = np.random.default_rng(14)
    params = SliceParams(width=5.0, scale_tril=None)
    for _ in range(300):
        new, _ = ev.step(kernel, rng, params)
        assert new[0] > 0.0


# ------------------------------------------------------------------------------ adaptation
P10 = 10
_A = np.random.default_rng(2024).standard_normal((P10, P10))
COV10 = _A @ _A.T / P10 + 0.5 * np.eye(P10)


@pytest.mark.parametrize("kernel_name", ["rwmh", "mala"])
@pytest.mark.parametrize("precondition", [True, False])
def test_adaptation_reaches_target_accept(kernel_name: str, precondition: bool) -> None:
    kernel = get_kernel(kernel_name)
    target = Gaussian(np.zeros(P10), COV10)
    tril = np.linalg.cholesky(COV10) if precondition else None
    _, info = sample(
        kernel, target, chains=1, num_warmup=1000, num_samples=1500, seed=21, scale_tril=tril
    )
    assert info["accept_prob"].mean() == pytest.approx(kernel.target_accept, abs=0.05)


def test_slice_width_adaptation_reaches_target_share() -> None:
    kernel = SliceSampler(batch=4)
    target = Gaussian(np.zeros(P10), COV10)
    rng = np.random.default_rng(22)
    ev = Evaluator(target, np.zeros(P10))
    params = kernel.init_params(P10, np.linalg.cholesky(COV10))
    adapter = kernel.adapter(params, 1000)
    for _ in range(1000):
        params = adapter.update(ev.step(kernel, rng, params)[1])
    params = adapter.final()
    shares = []
    for _ in range(1500):
        info = ev.step(kernel, rng, params)[1]
        total = info.n_expand + info.n_contract
        shares.append(kernel.target_expand if total == 0 else info.n_expand / total)
    assert np.mean(shares) == pytest.approx(kernel.target_expand, abs=0.05)


def test_adapter_final_and_freeze() -> None:
    kernel = RandomWalkMH()
    params = kernel.init_params(2, None)
    adapter = kernel.adapter(params, 3)
    assert adapter.final() == params  # no updates yet: the initial params
    info = KernelInfo(True, 1.0, 0, 1, 1)
    seen = [adapter.update(info) for _ in range(3)]
    assert all(p.step_size > params.step_size for p in seen)  # always accepting: grow
    final = adapter.final()
    assert isinstance(final, RWMHParams) and final.scale_tril is None
    assert adapter.update(info) == final  # frozen after num_warmup updates
    assert kernel.adapter(params, 0).update(info) == params


# ------------------------------------------------------------------------ API / validation
def test_get_kernel() -> None:
    assert isinstance(get_kernel("rwmh"), RandomWalkMH)
    assert isinstance(get_kernel("MALA", target_accept=0.6), MALA)
    slice_kernel = get_kernel("slice", batch=2, max_steps_out=5)
    assert isinstance(slice_kernel, SliceSampler) and slice_kernel.batch == 2
    with pytest.raises(ValueError, match="unknown kernel 'bogus'"):
        get_kernel("bogus")
    with pytest.raises(TypeError, match=r"\['bogus', 'other'\]"):
        get_kernel("rwmh", bogus=1, other=2)
    with pytest.raises(TypeError, match="batch"):
        get_kernel("mala", batch=2)
    for name, bad in (
        ("rwmh", {"target_accept": 1.5}),
        ("mala", {"step_size": -1.0}),
        ("slice", {"batch": 0}),
        ("slice", {"width": np.inf}),
        ("slice", {"max_steps_out": 2.5}),
    ):
        with pytest.raises(ValueError):
            get_kernel(name, **bad)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_init_params_validation(name: str) -> None:
    kernel = get_kernel(name)
    tril = np.array([[1.0, 0.0], [0.5, 2.0]])
    params = kernel.init_params(2, tril)
    arrays = [v for v in params if isinstance(v, np.ndarray)]  # scale_tril, or a metric
    assert arrays and not any(a.flags.writeable for a in arrays)
    before = [a.copy() for a in arrays]
    tril[0, 0] = 5.0  # the params hold a copy
    for a, b in zip(arrays, before, strict=True):
        np.testing.assert_array_equal(a, b)
    for bad in (
        np.eye(3),
        np.array([[1.0, 0.1], [0.0, 1.0]]),
        np.array([[1.0, 0.0], [0.0, 0.0]]),
        np.array([[np.nan, 0.0], [0.0, 1.0]]),
    ):
        with pytest.raises(ValueError):
            kernel.init_params(2, bad)
    with pytest.raises(ValueError):
        kernel.init_params(0, None)


def test_initial_step_sizes() -> None:
    assert RandomWalkMH().init_params(16, None).step_size == pytest.approx(2.38 / 4)
    assert MALA().init_params(64, None).step_size == pytest.approx(1.65 / 2)
    assert RandomWalkMH(step_size=0.1).init_params(16, None).step_size == 0.1


def test_slice_info_is_a_kernel_info_and_pickles() -> None:
    info = SliceInfo(True, 1.0, 3, 9, 2, n_expand=4, n_contract=1)
    assert isinstance(info, KernelInfo) and tuple(info) == (True, 1.0, 3, 9, 2)
    back = pickle.loads(pickle.dumps(info))
    assert back == info and (back.n_expand, back.n_contract) == (4, 1)


def test_same_seed_same_draws() -> None:
    for name in KERNELS:
        a, _ = sample(get_kernel(name), Gamma(2.0), chains=1, num_warmup=20, num_samples=50)
        b, _ = sample(get_kernel(name), Gamma(2.0), chains=1, num_warmup=20, num_samples=50)
        np.testing.assert_array_equal(a, b)
