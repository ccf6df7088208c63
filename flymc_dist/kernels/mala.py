"""Preconditioned Metropolis-adjusted Langevin algorithm (MALA).

With mass matrix ``M⁻¹ = L Lᵀ`` (``L`` the preconditioner, identity when None) the
proposal is ``θ′ = θ + ½ε² L Lᵀ ∇ log p(θ) + ε L z = θ + ε L (z + ½ε v)`` with
``v = Lᵀ ∇ log p(θ)``. Writing ``v′ = Lᵀ ∇ log p(θ′)``, the reverse move needs
noise ``z′ = −(z + ½ε (v + v′))``, so the Metropolis–Hastings log ratio is::

    log p(θ′) − log p(θ) − ½‖z + ½ε (v + v′)‖² + ½‖z‖²

(no triangular solve). Two round trips per step: the gradient at the current
position under the *current* target (it may have changed since the last step, rule 1
of :mod:`flymc_dist.kernels.base`), then ``log p`` and its gradient at ``θ′``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from flymc_dist.kernels.base import EvalRequest, Kernel, KernelInfo, StepGenerator
from flymc_dist.kernels.rwmh import (
    StepSizeAdapter,
    check_positive,
    check_probability,
    check_scale_tril,
    checked_logp,
    checked_logp_current,
    mh_accept_prob,
    tril_matvec,
    tril_rmatvec,
)

__all__ = ["MALA", "MALAParams"]


class MALAParams(NamedTuple):
    """Parameters of :class:`MALA`."""

    step_size: float  # ε
    scale_tril: np.ndarray | None  # L, lower triangular (P, P); None = identity


def _checked_grad(grad: np.ndarray | None, dim: int, where: str) -> np.ndarray:
    if grad is None:
        raise ValueError(f"response carries no gradient {where}")
    grad = np.asarray(grad, dtype=np.float64)
    if grad.shape != (dim,):
        raise ValueError(f"gradient {where} has shape {grad.shape}, expected ({dim},)")
    if not np.isfinite(grad).all():
        raise FloatingPointError(f"gradient {where} is not finite")
    return grad


class MALA(Kernel):
    """Preconditioned MALA with the exact (asymmetric) proposal correction.

    Requests per step: ``EvalRequest(points=np.empty((0, P)), current_grad=True)``,
    then ``EvalRequest(points=θ′[None], grad=True)``. The acceptance test uses the
    ``logp_current`` of the second response. ``info.n_evals`` is 1: the proposal (the
    gradient at the current position is not counted as an evaluated point).

    Parameters
    ----------
    target_accept
        Mean acceptance probability the warm-up adaptation aims for (default 0.57).
    step_size
        Initial ε; default ``1.65 · P^(−1/6)`` (Roberts & Rosenthal 1998 scaling for a
        well-preconditioned, roughly Gaussian target).
    """

    name = "mala"
    needs_grad = True
    step_chains = None

    def __init__(self, target_accept: float = 0.57, step_size: float | None = None) -> None:
        self.target_accept = check_probability("target_accept", target_accept)
        self.step_size = None if step_size is None else check_positive("step_size", step_size)

    def __repr__(self) -> str:
        return f"MALA(target_accept={self.target_accept}, step_size={self.step_size})"

    def init_params(self, dim: int, scale_tril: np.ndarray | None = None) -> MALAParams:
        """Initial parameters for ``dim`` parameters and an optional preconditioner."""
        tril = check_scale_tril(dim, scale_tril)
        eps = self.step_size if self.step_size is not None else 1.65 * dim ** (-1.0 / 6.0)
        return MALAParams(step_size=eps, scale_tril=tril)

    def step(
        self, rng: np.random.Generator, position: np.ndarray, params: MALAParams
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
            Two requests: the gradient at ``position``, then ``θ′[None]`` with its
            gradient.

        Returns
        -------
        tuple of numpy.ndarray and KernelInfo
            The new position and what the step did (``StopIteration.value``).

        Raises
        ------
        FloatingPointError
            If a response holds a NaN (or +inf) log density,
            or a non-finite gradient where the density is positive.
        """
        dim = position.shape[0]
        eps = params.step_size
        tril = params.scale_tril
        noise = rng.standard_normal(dim)
        neg_log_u = rng.standard_exponential()

        response = yield EvalRequest(points=np.empty((0, dim)), current_grad=True)
        checked_logp_current(response)
        v = tril_rmatvec(tril, _checked_grad(response.grad_current, dim, "at the current position"))
        proposal = position + eps * tril_matvec(tril, noise + 0.5 * eps * v)

        response = yield EvalRequest(points=proposal[None], grad=True)
        logp_current = checked_logp_current(response)
        logp_new = float(checked_logp(response, 1)[0])
        if logp_new == -math.inf:
            log_ratio = -math.inf  # zero density: reject; its gradient is meaningless
        else:
            if response.grad is None:
                raise ValueError("response carries no gradient at the proposal")
            grad_new = _checked_grad(np.asarray(response.grad)[0], dim, "at the proposal")
            v_new = tril_rmatvec(tril, grad_new)
            log_ratio = logp_new - logp_current + self._log_q_ratio(noise, v, v_new, eps)
        accepted = log_ratio > -neg_log_u  # False for NaN and -inf
        info = KernelInfo(
            accepted=bool(accepted),
            accept_prob=mh_accept_prob(log_ratio),
            index=0 if accepted else -1,
            n_evals=1,
            n_requests=2,
        )
        return (proposal if accepted else position), info

    @staticmethod
    def _log_q_ratio(noise: np.ndarray, v: np.ndarray, v_new: np.ndarray, eps: float) -> float:
        """``log q(θ | θ′) − log q(θ′ | θ)`` in whitened coordinates."""
        back = noise + 0.5 * eps * (v + v_new)
        return 0.5 * (float(noise @ noise) - float(back @ back))

    def adapter(self, params: MALAParams, num_warmup: int) -> StepSizeAdapter:
        """Dual averaging of ``log ε`` towards ``target_accept`` over ``num_warmup`` steps."""
        return StepSizeAdapter(params, num_warmup, self.target_accept, field="step_size")
