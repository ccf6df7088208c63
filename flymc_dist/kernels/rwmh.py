"""Preconditioned Gaussian random-walk Metropolis–Hastings, and the pieces the kernels share.

The proposal is ``θ′ = θ + ε L z`` with ``z ~ N(0, I)`` and ``L`` a lower-triangular
preconditioner (the Cholesky factor of an approximate posterior covariance; identity
when None). The proposal is symmetric, so the acceptance ratio is the ratio of target
densities: one round trip per step, whose response carries both ``log p(θ′)`` and a
fresh ``log p(θ)`` (rule 1 of :mod:`flymc_dist.kernels.base`).

Step-size adaptation lives outside the kernel (:meth:`RandomWalkMH.adapter`): dual
averaging of ``log ε`` towards ``target_accept`` (Hoffman & Gelman 2014, §3.2).

This module also hosts the small helpers the other kernels use (log-density checks,
triangular mat-vecs, :class:`DualAveraging`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from flymc_dist.kernels.base import (
    ChainsStepGenerator,
    EvalRequest,
    EvalResponse,
    Kernel,
    KernelInfo,
    StepGenerator,
)

__all__ = ["DualAveraging", "RWMHParams", "RandomWalkMH", "StepSizeAdapter"]


# --------------------------------------------------------------------------- shared helpers
def check_scale_tril(dim: int, scale_tril: np.ndarray | None) -> np.ndarray | None:
    """Validate a preconditioner and return a read-only float64 copy.

    Parameters
    ----------
    dim
        Number of parameters ``P`` (positive).
    scale_tril
        Lower-triangular ``(P, P)`` matrix with a positive, finite diagonal, or None
        for the identity.

    Returns
    -------
    numpy.ndarray or None
        The validated copy (None stays None).

    Raises
    ------
    ValueError
        On a bad ``dim``, wrong shape, non-finite entries, a non-zero strict upper
        triangle or a non-positive diagonal.
    """
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    if scale_tril is None:
        return None
    tril = np.array(scale_tril, dtype=np.float64, order="C", copy=True)
    if tril.shape != (dim, dim):
        raise ValueError(f"scale_tril must have shape ({dim}, {dim}), got {tril.shape}")
    if not np.isfinite(tril).all():
        raise ValueError("scale_tril must be finite")
    if np.any(np.triu(tril, k=1)):
        raise ValueError("scale_tril must be lower triangular (a Cholesky factor)")
    if not np.all(np.diagonal(tril) > 0.0):
        raise ValueError("scale_tril must have a positive diagonal (a Cholesky factor)")
    tril.flags.writeable = False
    return tril


def check_positive(name: str, value: Any) -> float:
    """``value`` as a finite positive float, else ValueError naming ``name``."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if not (math.isfinite(out) and out > 0.0):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return out


def check_probability(name: str, value: Any) -> float:
    """``value`` as a float strictly inside (0, 1), else ValueError naming ``name``."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in (0, 1), got {value!r}") from None
    if not 0.0 < out < 1.0:
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value!r}")
    return out


def tril_matvec(tril: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """``L @ x`` (``x`` itself when L is None).

    A plain ``gemv`` through numpy: scipy's threaded ``dtrmv`` would do half the
    flops, but on a loaded 2-core machine its thread hand-off measured 10-20 ms per
    call at P = 600 (against ~0.3 ms here).
    """
    if tril is None:
        return x
    return np.dot(tril, x)


def tril_rmatvec(tril: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """``L.T @ x`` (``x`` itself when L is None)."""
    if tril is None:
        return x
    return np.dot(x, tril)


def checked_value(value: float, where: str) -> float:
    """``value`` as a float; NaN or +inf raise FloatingPointError naming ``where``."""
    value = float(value)
    if math.isnan(value) or value == math.inf:
        raise FloatingPointError(f"log density at {where} is {value}")
    return value


def checked_logp_current(response: EvalResponse) -> float:
    """The response's ``logp_current`` as a float; NaN or +inf raise FloatingPointError."""
    return checked_value(response.logp_current, "the current position")


def checked_logp(response: EvalResponse, k: int) -> np.ndarray:
    """The response's ``logp`` as a float array of length ``k``.

    ``-inf`` is allowed (a point of zero density); NaN or ``+inf`` raise
    FloatingPointError, a wrong length raises ValueError.
    """
    logp = np.asarray(response.logp, dtype=np.float64)
    if logp.shape != (k,):
        raise ValueError(f"response has logp of shape {logp.shape}, expected ({k},)")
    # one reduction: the maximum is NaN if any entry is, and +inf if any entry is
    if k and not logp.max() < math.inf:
        raise FloatingPointError(f"log density is NaN or +inf at an evaluated point: {logp}")
    return logp


def checked_logp_single(response: EvalResponse) -> float:
    """The one ``logp`` of a one-point response as a float: :func:`checked_logp` with
    ``k = 1`` checked on the Python float (no array reductions for a single value)."""
    logp = np.asarray(response.logp, dtype=np.float64)
    if logp.shape != (1,):
        raise ValueError(f"response has logp of shape {logp.shape}, expected (1,)")
    return checked_value(logp[0], "the evaluated point")


def mh_accept_prob(log_ratio: float) -> float:
    """``min(1, exp(log_ratio))``, with NaN (``-inf - -inf``) counted as 0."""
    if log_ratio >= 0.0:
        return 1.0
    if log_ratio < 0.0:
        return math.exp(log_ratio)
    return 0.0  # NaN


class DualAveraging:
    """Dual averaging of ``log x`` so that a statistic averages to a target.

    Hoffman & Gelman (2014), Algorithm 5: after the ``m``-th statistic ``a_m``,
    ``H̄ ← (1 − 1/(m + t0)) H̄ + (target − a_m)/(m + t0)``,
    ``log x = μ − √m/γ · H̄`` and ``log x̄ ← m^{−κ} log x + (1 − m^{−κ}) log x̄``.
    A statistic above the target makes ``x`` grow.

    Parameters
    ----------
    x0
        Initial value (positive).
    target
        The value the statistic should average to.
    mu
        Shrinkage point of ``log x``; default ``log(10 x0)``.
    gamma, t0, kappa
        The usual constants (0.05, 10, 0.75).
    """

    def __init__(
        self,
        x0: float,
        target: float,
        *,
        mu: float | None = None,
        gamma: float = 0.05,
        t0: float = 10.0,
        kappa: float = 0.75,
    ) -> None:
        x0 = check_positive("x0", x0)
        self.target = float(target)
        self.mu = math.log(10.0 * x0) if mu is None else float(mu)
        self.gamma = gamma
        self.t0 = t0
        self.kappa = kappa
        self.count = 0
        self.h_bar = 0.0
        self.log_x = math.log(x0)
        self.log_x_bar = math.log(x0)

    def update(self, statistic: float) -> float:
        """Feed one statistic; returns the next ``x``."""
        statistic = float(statistic)
        if math.isnan(statistic):
            raise FloatingPointError("adaptation statistic is NaN")
        self.count += 1
        m = self.count
        eta = 1.0 / (m + self.t0)
        self.h_bar = (1.0 - eta) * self.h_bar + eta * (self.target - statistic)
        self.log_x = self.mu - math.sqrt(m) / self.gamma * self.h_bar
        weight = m ** (-self.kappa)
        self.log_x_bar = weight * self.log_x + (1.0 - weight) * self.log_x_bar
        return math.exp(self.log_x)

    def final(self) -> float:
        """The averaged ``x̄`` (the value to use after adaptation)."""
        return math.exp(self.log_x_bar)


class StepSizeAdapter:
    """Warm-up adaptation of one positive field of a params NamedTuple.

    Each :meth:`update` feeds ``statistic(info)`` to a :class:`DualAveraging` and returns
    the params with the field replaced. After ``restart`` × ``num_warmup`` updates the
    dual averaging restarts from its averaged value with ``μ`` there and the gentler
    ``restart_gamma`` (as Stan restarts it between windows): the first phase finds the
    scale, the second reduces the fluctuation of the iterates, whose Jensen gap otherwise
    leaves the final acceptance a few hundredths off target. After ``num_warmup``
    updates the field is frozen at the averaged value, which :meth:`final` returns.

    Parameters
    ----------
    params
        Starting params (a NamedTuple with the field ``field``).
    num_warmup
        Number of warm-up steps (non-negative).
    target
        Target of the statistic's average.
    field
        Name of the adapted field (e.g. ``"step_size"``).
    statistic
        Maps a :class:`~flymc_dist.kernels.base.KernelInfo` to the adapted statistic;
        default ``info.accept_prob``.
    restart
        Fraction of the warm-up after which to restart (0 or 1: never).
    restart_gamma
        ``γ`` of the second phase.
    """

    def __init__(
        self,
        params: Any,
        num_warmup: int,
        target: float,
        *,
        field: str = "step_size",
        statistic: Any = None,
        restart: float = 0.5,
        restart_gamma: float = 0.5,
    ) -> None:
        if (
            isinstance(num_warmup, bool)
            or not isinstance(num_warmup, int | np.integer)
            or num_warmup < 0
        ):
            raise ValueError(f"num_warmup must be a non-negative integer, got {num_warmup!r}")
        if field not in params._fields:
            raise ValueError(f"params {type(params).__name__} have no field {field!r}")
        if not 0.0 <= restart <= 1.0:
            raise ValueError(f"restart must lie in [0, 1], got {restart!r}")
        self.num_warmup = int(num_warmup)
        self.field = field
        self.target = float(target)
        self.count = 0
        self._restart_at = int(restart * self.num_warmup) if 0.0 < restart < 1.0 else -1
        self._restart_gamma = check_positive("restart_gamma", restart_gamma)
        self._params = params
        self._statistic = statistic if statistic is not None else _accept_prob
        self._da = DualAveraging(getattr(params, field), self.target)

    def update(self, info: KernelInfo) -> Any:
        """Feed one warm-up step's info; returns the params for the next step."""
        if self.count >= self.num_warmup:
            return self.final()
        if self.count == self._restart_at:
            x = self._da.final()
            self._da = DualAveraging(x, self.target, mu=math.log(x), gamma=self._restart_gamma)
        self.count += 1
        value = self._da.update(self._statistic(info))
        self._params = self._params._replace(**{self.field: value})
        return self._params

    def final(self) -> Any:
        """The params to sample with: the averaged value (the start if never updated)."""
        if self.count == 0:
            return self._params
        return self._params._replace(**{self.field: self._da.final()})


def _accept_prob(info: KernelInfo) -> float:
    return info.accept_prob


# --------------------------------------------------------------------------- the kernel
class RWMHParams(NamedTuple):
    """Parameters of :class:`RandomWalkMH`."""

    step_size: float  # ε
    scale_tril: np.ndarray | None  # L, lower triangular (P, P); None = identity


class RandomWalkMH(Kernel):
    """Preconditioned Gaussian random-walk Metropolis–Hastings: ``θ′ = θ + ε L z``.

    One request per step, ``EvalRequest(points=θ′[None])``; accept iff
    ``log u < log p(θ′) − logp_current`` using that same response's ``logp_current``.

    Parameters
    ----------
    target_accept
        Mean acceptance probability the warm-up adaptation aims for (default 0.234).
    step_size
        Initial ε; default ``2.38 / √P``.
    """

    name = "rwmh"
    needs_grad = False

    def __init__(self, target_accept: float = 0.234, step_size: float | None = None) -> None:
        self.target_accept = check_probability("target_accept", target_accept)
        self.step_size = None if step_size is None else check_positive("step_size", step_size)

    def __repr__(self) -> str:
        return f"RandomWalkMH(target_accept={self.target_accept}, step_size={self.step_size})"

    def init_params(self, dim: int, scale_tril: np.ndarray | None = None) -> RWMHParams:
        """Initial parameters for ``dim`` parameters and an optional preconditioner."""
        tril = check_scale_tril(dim, scale_tril)
        eps = self.step_size if self.step_size is not None else 2.38 / math.sqrt(dim)
        return RWMHParams(step_size=eps, scale_tril=tril)

    def step(
        self, rng: np.random.Generator, position: np.ndarray, params: RWMHParams
    ) -> StepGenerator:
        """One transition from ``position``: a generator (see :mod:`.base`).

        Randomness: ``P`` standard normals, then one standard exponential (``−log u``),
        whatever happens.

        Parameters
        ----------
        rng
            The chain's random stream (the only source of randomness).
        position
            Current position, shape ``(P,)``.
        params
            Step size and preconditioner.

        Yields
        ------
        EvalRequest
            One request: the proposal ``θ′[None]``.

        Returns
        -------
        tuple of numpy.ndarray and KernelInfo
            The new position and what the step did (``StopIteration.value``).

        Raises
        ------
        FloatingPointError
            If a response holds a NaN (or +inf) log density.
        """
        direction, neg_log_u = self._draw(rng, position.shape[0], params)
        proposal = direction  # θ′ = θ + ε L z, in place in the fresh array L z
        proposal *= params.step_size
        proposal += position
        response = yield EvalRequest(proposal[None])
        logp_current = checked_logp_current(response)
        logp_new = checked_logp_single(response)
        info = self._decide(self._log_ratio(logp_new, logp_current), neg_log_u)
        return (proposal if info.accepted else position), info

    def step_chains(
        self, rngs: list[np.random.Generator], positions: np.ndarray, params: list[RWMHParams]
    ) -> ChainsStepGenerator:
        """Every chain's :meth:`step` at once (see :class:`.base.ChainsStep`).

        The same draws from each chain's stream and the same floating-point operations
        as :meth:`step`, element by element, so the same result bit for bit; only the
        scaling by ε and the shift by θ run once for all chains. A subclass that
        overrides :meth:`step` must override this too (or set it to None).

        Parameters
        ----------
        rngs
            One random stream per chain.
        positions
            Current positions, shape ``(C, P)``.
        params
            One parameter set per chain.

        Yields
        ------
        numpy.ndarray
            The proposals ``θ′``, shape ``(C, P)``.

        Returns
        -------
        tuple of numpy.ndarray and list of KernelInfo
            The new positions (a fresh array) and each chain's info.

        Raises
        ------
        FloatingPointError
            If a log density sent back is NaN (or +inf).
        """
        proposals, neg_log_u = self.propose(rngs, positions, params)
        logp_current, logp = yield proposals
        infos = []
        for c, (cur, new) in enumerate(zip(logp_current.tolist(), logp.tolist(), strict=True)):
            cur = checked_value(cur, "the current position")
            new = checked_value(new, "an evaluated point")
            infos.append(self._decide(self._log_ratio(new, cur), neg_log_u[c]))
        accepted = np.array([[info.accepted] for info in infos])
        return np.where(accepted, proposals, positions), infos

    def propose(
        self, rngs: list[np.random.Generator], positions: np.ndarray, params: list[RWMHParams]
    ) -> tuple[np.ndarray, list[float]]:
        """Every chain's proposal ``θ′ = θ + ε L z`` and its ``−log u``: a step's randomness
        and arithmetic, as :meth:`step` makes them (also austerity's proposal, whose
        decision is a sequential test instead of ``log u < log p(θ′) − log p(θ)``).

        Parameters
        ----------
        rngs
            One random stream per chain (``P`` standard normals, then one standard
            exponential are drawn from each).
        positions
            Current positions, shape ``(C, P)``.
        params
            One parameter set per chain.

        Returns
        -------
        proposals, neg_log_u
            A fresh ``(C, P)`` array of proposals and each chain's ``−log u``.
        """
        C, P = positions.shape
        proposals = np.empty((C, P))
        neg_log_u = [0.0] * C
        for c in range(C):
            proposals[c], neg_log_u[c] = self._draw(rngs[c], P, params[c])
        proposals *= np.array([[p.step_size] for p in params])
        proposals += positions
        return proposals, neg_log_u

    @staticmethod
    def _draw(rng: np.random.Generator, dim: int, params: RWMHParams) -> tuple[np.ndarray, float]:
        """A step's randomness: the direction ``L z`` (a fresh array) and ``−log u``.

        ``P`` standard normals, then one standard exponential, whatever happens.
        """
        noise = rng.standard_normal(dim)
        neg_log_u = rng.standard_exponential()
        return tril_matvec(params.scale_tril, noise), neg_log_u

    def fuses(self, params: RWMHParams) -> bool:
        """Every step fuses, unless a subclass changes the transition (its draws, its
        proposal, its decision or its step): then it runs as that subclass writes it."""
        cls = type(self)
        return all(
            getattr(cls, name) is getattr(RandomWalkMH, name)
            for name in ("step", "step_chains", "propose", "_draw", "_decide", "_log_ratio")
        )

    def fused_settings(self, params: list[RWMHParams]) -> tuple[str, tuple]:
        """``"rwmh"``: the step sizes and preconditioners (see
        :meth:`.Kernel.fused_settings`)."""
        return "rwmh", ([p.step_size for p in params], [p.scale_tril for p in params])

    def fused_steps(
        self,
        rngs: list[np.random.Generator],
        positions: np.ndarray,
        params: list[RWMHParams],
        targets: Any,
    ) -> tuple[np.ndarray, list[KernelInfo], np.ndarray]:
        """:meth:`step` of every chain run whole by ``targets.rwmh`` (see
        :meth:`.Kernel.fused_steps`): the same random numbers, proposals and decisions up
        to rounding. Evaluations: the current position and the proposal."""
        new, floats, ints = targets.rwmh(rngs, positions, *self.fused_settings(params)[1])
        infos = [
            KernelInfo(
                accepted=bool(moved),
                accept_prob=float(prob),
                index=0 if moved else -1,
                n_evals=2,
                n_requests=2,
            )
            for moved, prob in zip(ints[:, 0].tolist(), floats[:, 2].tolist(), strict=True)
        ]
        return new, infos, floats[:, 0]

    @staticmethod
    def _decide(log_ratio: float, neg_log_u: float) -> KernelInfo:
        """Accept iff ``log u < log_ratio`` (so never for NaN or -inf)."""
        accepted = bool(log_ratio > -neg_log_u)
        return KernelInfo(
            accepted=accepted,
            accept_prob=mh_accept_prob(log_ratio),
            index=0 if accepted else -1,
            n_evals=1,
            n_requests=1,
        )

    def _log_ratio(self, logp_new: float, logp_current: float) -> float:
        """Log acceptance ratio (Python floats: ``-inf - -inf`` is a silent NaN)."""
        return logp_new - logp_current

    def adapter(self, params: RWMHParams, num_warmup: int) -> StepSizeAdapter:
        """Dual averaging of ``log ε`` towards ``target_accept`` over ``num_warmup`` steps."""
        return StepSizeAdapter(params, num_warmup, self.target_accept, field="step_size")
