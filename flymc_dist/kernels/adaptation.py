"""Stan's windowed warm-up adaptation of the step size and metric (HMC, NUTS).

The warm-up is split (Stan reference manual, "HMC algorithm parameters"; blackjax
``window_adaptation.build_schedule``) into

1. an initial *fast* buffer (75 steps): only the step size adapts, while the chain
   finds the typical set;
2. *slow* windows (25, 50, 100, … steps, each twice the previous, the last one
   stretched to the end of the slow phase when the next would not fit): the draws of
   each window give a Welford estimate of the posterior (co)variance, which becomes the
   inverse metric at the window's end, shrunk toward the metric it replaces,
   ``(n/(n+P)) Σ̂ + (P/(n+P)) M⁻¹_prev`` (P the dimension; Stan shrinks toward
   ``10⁻³ I`` instead, which is wrong in scale for tall-data posteriors: see
   :func:`regularised_covariance`); the step size is then searched afresh (Stan's
   heuristic, run by the kernel's next step) and dual averaging restarts from it;
3. a terminal *fast* buffer (50 steps): the step size adapts to the last metric.

One addition to Stan: Stan's averaged step size typically gives a mean acceptance
statistic of 0.85-0.93 for a target of 0.8 (the iterates of dual averaging fluctuate
widely within the short terminal buffer, and the acceptance is concave in log ε around
the target: a Jensen gap). After 30 % of the terminal buffer (15 steps) dual averaging
restarts once more, at its averaged value with ``μ`` there and a gentler ``γ = 0.3`` —
as :class:`~flymc_dist.kernels.rwmh.StepSizeAdapter` does for the other kernels —, which
brought NUTS to 0.80-0.83 on the test targets. It is skipped when the terminal phase is
shorter than 40 steps (dual averaging needs about ten steps to recover from the
deliberate overshoot ``μ = log(10 ε)`` of a restart).

When the three do not fit (fewer than 150 steps) they become 15 % / 75 % / 10 % of the
warm-up; below 20 steps the metric is never estimated (the step size still adapts).
One deliberate difference from Stan: Stan never stretches the *first* slow window, so
that e.g. 160 warm-up steps give windows of 25 and 10 draws; here the first window is
stretched like the others (one window of 35). The windows differ from Stan's only for
151 ≤ num_warmup ≤ 199.

The schedule is :func:`build_schedule`, a pure function; :class:`WindowAdaptation` is
the :class:`~flymc_dist.kernels.base.Adapter` the Hamiltonian kernels hand the driver.
The adapter sees only :class:`~flymc_dist.kernels.base.KernelInfo`\\ s: the warm-up
draw comes in ``info.position`` and the heuristic's step size in ``info.step_size``
(:class:`~flymc_dist.kernels.hamiltonian.HamiltonianInfo`).

Stan's heuristic needs evaluations of the target, which an adapter cannot make: the
adapter sets ``params.find_step_size`` and the kernel's next step runs it before its
transition. Since the driver hands the first warm-up step the initial params (not the
adapter's), the first search runs at the *second* warm-up step; the first step runs
with the initial step size.
"""

from __future__ import annotations

import math

import numpy as np

from flymc_dist.kernels.base import Kernel, KernelInfo
from flymc_dist.kernels.hamiltonian import (
    HamiltonianParams,
    check_metric_from,
    hamiltonian_params,
    initial_hamiltonian_params,
)
from flymc_dist.kernels.rwmh import DualAveraging

__all__ = [
    "HamiltonianKernel",
    "Welford",
    "WindowAdaptation",
    "build_schedule",
    "regularised_covariance",
]

#: Stan's default buffer and first-window sizes
INITIAL_BUFFER = 75
FIRST_WINDOW = 25
FINAL_BUFFER = 50
#: below this many warm-up steps the metric is not adapted (as Stan)
MIN_WARMUP_FOR_METRIC = 20
#: the settle restart needs a terminal phase this long (dual averaging first needs about
#: ten steps to come back from its deliberate overshoot after a restart)
MIN_SETTLE_PHASE = 40
_SQRT_HALF = math.sqrt(0.5)


def build_schedule(
    num_warmup: int,
    initial_buffer: int = INITIAL_BUFFER,
    first_window: int = FIRST_WINDOW,
    final_buffer: int = FINAL_BUFFER,
) -> list[tuple[int, int]]:
    """The slow (metric) windows of a warm-up of ``num_warmup`` steps.

    Parameters
    ----------
    num_warmup
        Number of warm-up steps (non-negative).
    initial_buffer, first_window, final_buffer
        Stan's 75, 25 and 50. If they do not fit they become 15 %, 75 % and 10 % of
        ``num_warmup`` (Stan's fallback).

    Returns
    -------
    list of (int, int)
        Half-open windows ``[start, stop)`` of warm-up step indices (0-based),
        contiguous and increasing. The draw of step ``i`` enters the estimate of the
        window holding ``i``; the new metric applies from step ``stop``. Steps before the
        first window form the initial fast buffer, steps from the last ``stop`` on the
        terminal one. Empty when ``num_warmup < 20``.

    Raises
    ------
    ValueError
        On a negative or non-integer argument.

    Examples
    --------
    >>> build_schedule(1000)
    [(75, 100), (100, 150), (150, 250), (250, 450), (450, 950)]
    >>> build_schedule(100)
    [(15, 90)]
    """
    for name, value in (
        ("num_warmup", num_warmup),
        ("initial_buffer", initial_buffer),
        ("first_window", first_window),
        ("final_buffer", final_buffer),
    ):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    num_warmup = int(num_warmup)
    if num_warmup < MIN_WARMUP_FOR_METRIC:
        return []
    if initial_buffer + first_window + final_buffer > num_warmup:
        initial_buffer = int(0.15 * num_warmup)
        final_buffer = int(0.1 * num_warmup)
        first_window = num_warmup - initial_buffer - final_buffer
    if first_window < 1:
        return []
    end = num_warmup - final_buffer  # the slow phase is [initial_buffer, end)
    windows = []
    start, size = initial_buffer, first_window
    while start < end:
        stop = start + size
        # stretch this window to the end when the next (twice as long) would not fit
        if stop + 2 * size > end:
            stop = end
        windows.append((start, stop))
        start, size = stop, 2 * size
    return windows


class Welford:
    """Welford's running mean and (co)variance of vectors (``dense``: full covariance)."""

    def __init__(self, dim: int, dense: bool) -> None:
        self.dense = dense
        self.count = 0
        self.mean = np.zeros(dim)
        self.m2 = np.zeros((dim, dim)) if dense else np.zeros(dim)

    def add(self, x: np.ndarray) -> None:
        """Add one draw."""
        self.count += 1
        delta = x - self.mean
        self.mean += delta / self.count
        if self.dense:
            self.m2 += np.outer(x - self.mean, delta)
        else:
            self.m2 += (x - self.mean) * delta

    def covariance(self) -> np.ndarray:
        """The sample (co)variance (divisor ``n − 1``); needs two draws or more."""
        if self.count < 2:
            raise ValueError("a covariance needs at least two draws")
        cov = self.m2 / (self.count - 1)
        return 0.5 * (cov + cov.T) if self.dense else cov


def regularised_covariance(
    cov: np.ndarray, n: int, previous: np.ndarray | None = None, weight: float | None = None
) -> np.ndarray:
    """An estimated (co)variance from ``n`` draws, regularised.

    With ``previous`` (the metric it replaces), shrunk toward it:
    ``(n/(n+k)) Σ̂ + (k/(n+k)) M⁻¹_prev`` with ``k = weight`` (default: the dimension).
    Without, Stan's ``(n/(n+5)) Σ̂ + 10⁻³ (5/(n+5)) I`` (``I`` a vector of ones for a
    diagonal).

    Why shrink toward the previous metric: Stan's target ``10⁻³ I`` assumes parameters of
    unit scale. A tall-data posterior has standard deviations of 10⁻³ or less in its
    well-determined directions, and a dense estimate from a 25-draw window in tens of
    dimensions is rank-deficient: ``10⁻³ I`` then dominates exactly those directions and
    the step size collapses (QM9 robust regression, 57 weights: ε ≈ 0.01 and ~300
    leapfrog steps per iteration). The previous metric — at first the Laplace
    covariance at the MAP — has the right scale in every direction, and the window's
    draws correct it where they carry information (the ridge of two duplicated columns,
    which the Laplace approximation misses): ε ≈ 0.2 and ~25 steps on that problem.
    """
    if previous is not None:
        k = float(cov.shape[0]) if weight is None else float(weight)
        return (n / (n + k)) * cov + (k / (n + k)) * previous
    shrunk = (n / (n + 5.0)) * cov
    jitter = 1e-3 * (5.0 / (n + 5.0))
    if cov.ndim == 1:
        return shrunk + jitter
    return shrunk + jitter * np.eye(cov.shape[0])


class WindowAdaptation:
    """Stan's windowed adaptation (see the module docstring) as an ``Adapter``.

    Parameters
    ----------
    params
        The starting params; the metric estimated has the form of ``params.inv_metric``
        (1-D: diagonal, 2-D: dense).
    num_warmup
        Number of warm-up steps (non-negative).
    target_accept
        Target of the mean acceptance statistic.
    find_step_size
        Ask the kernel for Stan's step-size heuristic at the second step and after each
        metric update (default True); if False, dual averaging just restarts from its
        current step size after a metric update.
    initial_buffer, first_window, final_buffer
        Passed to :func:`build_schedule`.
    settle, settle_gamma
        Where in the terminal phase (a fraction; 0: never) dual averaging restarts at
        its average, and the ``γ`` it restarts with (see the module docstring).
    adapt_metric
        Estimate the metric in the slow windows (default True). False: the metric stays
        ``params``'s and the whole warm-up adapts the step size (as below 20 steps).
    metric_from
        What a slow window estimates the inverse metric from: ``"draws"`` (default, as
        Stan: their covariance, the target's) or ``"differences"``: half the covariance
        of successive draws, ``Cov(x_t − x_{t−1}) / 2``. The latter is for a kernel that
        is one block of a Gibbs sampler — it samples a conditional ``p(x | z)`` that can be
        much narrower than the marginal its draws follow. For a two-block Gibbs sampler
        of a Gaussian, with exact conditional draws, ``Cov(x_t − x_{t−1}) = 2 E[Cov(x | z)]``
        exactly (stationary chain): the estimate is the mean conditional covariance, the
        shape each step actually samples, whatever the coupling. (For a sampler of the
        target itself it is not a covariance of anything useful: use ``"draws"``.)
    """

    def __init__(
        self,
        params: HamiltonianParams,
        num_warmup: int,
        target_accept: float,
        *,
        find_step_size: bool = True,
        initial_buffer: int = INITIAL_BUFFER,
        first_window: int = FIRST_WINDOW,
        final_buffer: int = FINAL_BUFFER,
        settle: float = 0.3,
        settle_gamma: float = 0.3,
        adapt_metric: bool = True,
        metric_from: str = "draws",
    ) -> None:
        self.metric_from = check_metric_from(metric_from, none=False)
        self._last: np.ndarray | None = None
        self.windows = (
            build_schedule(num_warmup, initial_buffer, first_window, final_buffer)
            if adapt_metric
            else []
        )
        self.num_warmup = int(num_warmup)
        self.target = float(target_accept)
        self.find_step_size = bool(find_step_size)
        self.count = 0
        self._window = 0  # index of the current or next slow window
        self._params = params._replace(find_step_size=False)
        self._da = DualAveraging(params.step_size, self.target)
        self._welford: Welford | None = None
        if not 0.0 <= settle < 1.0:
            raise ValueError(f"settle must lie in [0, 1), got {settle!r}")
        self.settle = float(settle)
        self.settle_gamma = float(settle_gamma)
        last_fast = self.windows[-1][1] if self.windows else 0
        length = self.num_warmup - last_fast
        self._settle_at = (
            last_fast + int(self.settle * length)
            if self.settle > 0.0 and length >= MIN_SETTLE_PHASE
            else -1
        )

    def update(self, info: KernelInfo) -> HamiltonianParams:
        """Feed one warm-up step's info; returns the params for the next step.

        Raises
        ------
        TypeError
            If ``info`` carries no ``position`` (not a Hamiltonian kernel's info).
        """
        if self.count >= self.num_warmup:
            return self.final()
        i = self.count
        self.count += 1
        if getattr(info, "step_size_found", False):  # the step searched: restart there
            self._da = DualAveraging(info.step_size, self.target)
        if i == self._settle_at:  # settle: restart at the average, with a gentler gamma
            x = self._da.final()
            self._da = DualAveraging(x, self.target, mu=math.log(x), gamma=self.settle_gamma)
        eps = self._da.update(min(1.0, float(info.accept_prob)))
        last = self._last  # the previous warm-up draw (metric from differences)
        if self.metric_from == "differences":
            pos = getattr(info, "position", None)
            self._last = None if pos is None else np.array(pos, dtype=np.float64)
        search = self.find_step_size and i == 0
        params = self._params
        if self._window < len(self.windows):
            start, stop = self.windows[self._window]
            if start <= i < stop:
                position = getattr(info, "position", None)
                if position is None:
                    raise TypeError(
                        "windowed adaptation needs info.position (the warm-up "
                        f"draw); {type(info).__name__} has none"
                    )
                if self._welford is None:
                    self._welford = Welford(position.shape[0], params.inv_metric.ndim == 2)
                x = np.asarray(position, dtype=np.float64)
                if self.metric_from == "draws":
                    self._welford.add(x)
                elif last is not None:
                    self._welford.add((x - last) * _SQRT_HALF)
            if i == stop - 1:
                n = self._welford.count
                inv = regularised_covariance(self._welford.covariance(), n, params.inv_metric)
                params = hamiltonian_params(params.step_size, inv)
                self._welford = None
                self._window += 1
                if self.find_step_size:
                    search = True
                else:  # restart dual averaging from the current step size
                    self._da = DualAveraging(eps, self.target)
        self._params = params._replace(step_size=eps, find_step_size=search)
        return self._params

    def final(self) -> HamiltonianParams:
        """The params to sample with: the averaged step size and the last metric."""
        if self.count == 0:
            return self._params
        return self._params._replace(step_size=self._da.final(), find_step_size=False)

    def __repr__(self) -> str:
        return (
            f"WindowAdaptation(num_warmup={self.num_warmup}, target={self.target}, "
            f"windows={self.windows})"
        )


#: the :class:`~flymc_dist.kernels.hamiltonian.HamiltonianInfo` attribute behind each
#: ArviZ statistic name of the Hamiltonian kernels
INFO_ATTRIBUTES = {
    "diverging": "divergent",
    "n_steps": "n_leapfrog",
    "step_size": "step_size",
    "energy": "energy",
    "tree_depth": "tree_depth",
}


class HamiltonianKernel(Kernel):
    """What :class:`~flymc_dist.kernels.hmc.HMC` and :class:`~flymc_dist.kernels.nuts.NUTS`
    share besides their step: parameters seeded from the preconditioner, and Stan's
    windowed warm-up. Subclasses set ``metric``, ``step_size``, ``target_accept``,
    ``find_step_size`` and ``adapt_metric``.

    Their trajectories cross θ's conditional given z in one step, so FlyMC's
    ``q_db="auto"`` proposes four dark rows per bright row and iteration
    (:attr:`~flymc_dist.kernels.base.Kernel.dark_proposals_per_bright`). Measured with
    NUTS, 4 chains, 500 warm-up + 1,000 to 4,000 draws, in-process: on QM9 (robust
    regression, 130,831 rows) one proposal per bright row gave min bulk ESS 57 (R-hat
    1.048), four gave 847 (R-hat 1.009); on MNIST 7 vs 9 min bulk ESS per draw went from
    0.017 to 0.022-0.030, about what proposing every dark row every iteration gives
    (0.028-0.032).
    """

    metric: str
    step_size: float | None
    target_accept: float
    find_step_size: bool
    adapt_metric: bool
    metric_from: str | None
    dark_proposals_per_bright = 4.0
    #: ArviZ's names of the Hamiltonian statistics (NUTS adds ``tree_depth``); the
    #: :class:`~flymc_dist.kernels.hamiltonian.HamiltonianInfo` attribute of each is in
    #: :data:`INFO_ATTRIBUTES`
    sample_stats = {
        "diverging": "bool",
        "n_steps": "int64",
        "step_size": "float64",
        "energy": "float64",
    }

    def info_stats(self, infos: list[KernelInfo]) -> dict[str, np.ndarray]:
        """Each of :attr:`sample_stats` over the chains' infos (see
        :meth:`~flymc_dist.kernels.base.Kernel.info_stats`): ``diverging`` (the trajectory
        hit an energy error above the threshold, or zero density), ``n_steps`` (its
        leapfrog steps), ``step_size`` (its nominal step size), ``energy`` (the
        Hamiltonian at the new state, for E-BFMI) and, for NUTS, ``tree_depth``."""
        return {
            name: np.array([getattr(info, INFO_ATTRIBUTES[name]) for info in infos], dtype=dt)
            for name, dt in self.sample_stats.items()
        }

    def init_params(self, dim: int, scale_tril: np.ndarray | None = None) -> HamiltonianParams:
        """Initial parameters: inverse metric ``L Lᵀ`` (or its diagonal) from the
        preconditioner's Cholesky factor ``L`` (identity when None)."""
        return initial_hamiltonian_params(dim, scale_tril, self.metric, self.step_size)

    def adapter(self, params: HamiltonianParams, num_warmup: int) -> WindowAdaptation:
        """Stan's windowed adaptation of the step size and (``adapt_metric``) the metric
        over ``num_warmup`` steps."""
        return WindowAdaptation(
            params,
            num_warmup,
            self.target_accept,
            find_step_size=self.find_step_size,
            adapt_metric=self.adapt_metric,
            metric_from=self.metric_from or "draws",
        )
