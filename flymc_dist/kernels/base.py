"""The protocol between a θ-kernel and whatever evaluates the log density.

Kernels know nothing of FlyMC, shards or Dask. A kernel step is a *generator*:
it yields :class:`EvalRequest` objects (a batch of points to evaluate) and is
sent back an :class:`EvalResponse` for each; when it returns, its return value
(``StopIteration.value``) is ``(new_position, KernelInfo)``.

Why a generator: the driver runs all chains at once and puts every chain's
pending request into one round trip to the shards; a kernel that needs several
evaluations per iteration (slice, MALA) simply yields several times.

A kernel whose every step is exactly one request of one point without gradients
(RWMH) may also offer ``step_chains`` (a :class:`ChainsStep`): every chain's step as one
generator over arrays, which the driver prefers because it spares a generator, a
request and a response per chain. It must give bit for bit what :meth:`Kernel.step`
gives chain by chain.

Rules every kernel obeys (the driver relies on them):

1. Every response carries ``logp_current``: the log target at the *current*
   position, freshly computed. The target may change between iterations
   (FlyMC's brightness variables move), so a kernel must never reuse a log
   density cached from a previous iteration; within one iteration the target is
   fixed.
2. The new position is either the current one (``info.index == -1``) or row
   ``info.index`` of ``points`` of the *last* request the step yielded. (That is
   how the shards commit a move from their caches without recomputing.)
3. ``logp`` values may be ``-inf`` (a point of zero density): treat as reject.
   NaN is a bug upstream: raise ``FloatingPointError``.
4. A step yields at least one request.
5. All randomness comes from the ``rng`` passed in.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from typing import Any, NamedTuple, Protocol

import numpy as np


class EvalRequest(NamedTuple):
    """A batch of points to evaluate in one round trip."""

    points: np.ndarray  # (k, P), k >= 0
    grad: bool = False  # gradients at the points wanted
    current_grad: bool = False  # gradient at the current position wanted


class EvalResponse(NamedTuple):
    """The log target (and gradients) for an :class:`EvalRequest`."""

    logp_current: float
    grad_current: np.ndarray | None  # (P,) when requested
    logp: np.ndarray  # (k,)
    grad: np.ndarray | None  # (k, P) when requested


class KernelInfo(NamedTuple):
    """What one kernel step did."""

    accepted: bool  # the position moved
    accept_prob: float  # MH acceptance probability (slice: 1.0)
    index: int  # row of the last request's points now current, or -1
    n_evals: int  # number of points evaluated in this step
    n_requests: int  # number of requests (round trips) this step used


StepGenerator = Generator[EvalRequest, EvalResponse, tuple[np.ndarray, KernelInfo]]

#: yields the proposals (C, P), is sent ``(logp_current (C,), logp (C,))``, returns
#: ``(new_positions (C, P), infos)``
ChainsStepGenerator = Generator[
    np.ndarray, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, list[KernelInfo]]
]


class ChainsStep(Protocol):
    """A kernel's ``step_chains``: every chain's step at once (one point per chain)."""

    def __call__(
        self, rngs: list[np.random.Generator], positions: np.ndarray, params: list[Any]
    ) -> ChainsStepGenerator:
        """One transition of every chain, as :meth:`Kernel.step` of each chain would make
        it, bit for bit.

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
            The proposals, shape ``(C, P)``: chain c's one request is row c.

        Returns
        -------
        tuple of numpy.ndarray and list of KernelInfo
            A fresh array of the new positions ``(C, P)`` and each chain's info.
        """


class Kernel:
    """Base class of the θ-kernels: what a kernel declares, and the methods it provides.

    The driver reads the declarations directly; nothing keys on a kernel's name.

    Attributes
    ----------
    name
        The kernel's name (``get_kernel``'s key).
    target_accept
        Mean acceptance probability (or statistic) warm-up adaptation aims for.
    needs_grad
        Its requests ask for gradients (``grad`` / ``current_grad``): whoever evaluates
        the target must be able to give them. Every kernel sets it (no default: a new
        gradient kernel must not silently get none).
    step_chains
        None (the default), or a method stepping every chain at once (a
        :class:`ChainsStep`), which the driver then prefers to :meth:`step`.
    dark_proposals_per_bright
        How many dark→bright proposals per bright row FlyMC's ``q_db="auto"`` makes per
        iteration (default 1): a kernel whose every step crosses θ's conditional given z
        moves the bright set's own conditional as far, and z must be proposed faster to
        follow it.
    sample_stats
        The per-iteration statistics of the kernel's own beyond every kernel's
        (``accepted``, ``acceptance_rate``), name -> dtype, under ArviZ's names (the
        Hamiltonian kernels: ``diverging``, ``n_steps``, ``step_size``, ``energy``, NUTS
        also ``tree_depth``); :meth:`info_stats` gives their values. Empty by default.
    """

    name: str
    target_accept: float
    needs_grad: bool
    step_chains: ChainsStep | None = None
    dark_proposals_per_bright: float = 1.0
    sample_stats: dict[str, str] = {}

    def settings(self) -> dict[str, Any]:
        """Every constructor option of this kernel and its value, e.g. ``{"target_accept":
        0.8, "max_tree_depth": 10, …}`` for NUTS."""
        return {name: getattr(self, name) for name in _options_of(type(self))}

    def changed(self) -> dict[str, Any]:
        """The settings that differ from those of the kernel made with no options."""
        defaults = type(self)().settings()
        return {k: v for k, v in self.settings().items() if v != defaults[k]}

    def info_stats(self, infos: list[KernelInfo]) -> dict[str, np.ndarray]:
        """The values of :attr:`sample_stats` for one step of every chain.

        Parameters
        ----------
        infos
            Each chain's info of the step (the kernel's own :class:`KernelInfo` kind).

        Returns
        -------
        dict of str to numpy.ndarray
            Every name of :attr:`sample_stats`, shape ``(len(infos),)``, of its dtype.
        """
        return {}

    def init_params(self, dim: int, scale_tril: np.ndarray | None) -> Any:
        """Initial parameters: ``scale_tril`` is a Cholesky factor of an approximate
        posterior covariance (a preconditioner), or None for the identity."""
        raise NotImplementedError

    def step(self, rng: np.random.Generator, position: np.ndarray, params: Any) -> StepGenerator:
        """One transition from ``position``."""
        raise NotImplementedError

    def adapter(self, params: Any, num_warmup: int) -> Adapter:
        """A fresh warm-up adapter starting from ``params``."""
        raise NotImplementedError

    def fuses(self, params: Any) -> bool:
        """Whether the step with ``params`` can run whole on a fused target
        (:meth:`fused_steps`); False by default."""
        return False

    def fused_settings(self, params: list[Any]) -> tuple[str, tuple]:
        """Every chain's settings as a fused target's compiled transition takes them:
        the transition's name (the target's method, e.g. ``"nuts"``) and its arguments
        after the generators and positions. What :meth:`fused_steps` passes, and what a
        loop of many steps on the same target takes (FlyMC's read-ahead blocks)."""
        raise NotImplementedError

    def fused_steps(
        self,
        rngs: list[np.random.Generator],
        positions: np.ndarray,
        params: list[Any],
        targets: Any,
    ) -> tuple[np.ndarray, list[KernelInfo], np.ndarray]:
        """One transition of every chain (chain c from ``positions[c]`` with ``rngs[c]``
        and ``params[c]``) run whole by ``targets``, an evaluator that can run this
        kernel's trajectories compiled (the driver's replica in FlyMC:
        ``targets.nuts(...)``), each chain drawing the same random numbers in the same
        order as :meth:`step`.

        Returns
        -------
        tuple
            The new positions ``(C, P)``, each chain's info, and the log target at each
            new position ``(C,)``.
        """
        raise NotImplementedError


def _options_of(cls: type) -> list[str]:
    """A kernel class's constructor options."""
    return [
        name
        for name, p in inspect.signature(cls).parameters.items()
        if p.kind is p.POSITIONAL_OR_KEYWORD or p.kind is p.KEYWORD_ONLY
    ]


class Adapter(Protocol):
    """Warm-up adaptation, outside the kernel.

    An adapter sees only the kernel's infos: one that needs more than the acceptance
    (the windowed adaptation of :mod:`.adaptation` estimates the metric from the warm-up
    draws) reads it from the kernel's :class:`KernelInfo` subclass (there
    :class:`~flymc_dist.kernels.hamiltonian.HamiltonianInfo`'s ``position``).
    """

    def update(self, info: KernelInfo) -> Any:
        """Feed one warm-up step's info; returns the params for the next step."""

    def final(self) -> Any:
        """The params to sample with after warm-up."""


def params_to_json(params: Any) -> dict[str, Any]:
    """A kernel's parameters (a NamedTuple of scalars and arrays) as JSON-able lists."""
    out = {}
    for k, v in params._asdict().items():
        out[k] = np.asarray(v).tolist() if v is not None else None
    return out


def params_from_json(cls: type, value: dict[str, Any]) -> Any:
    """Inverse of :func:`params_to_json`: the parameters as the NamedTuple ``cls``."""
    return cls(**{k: (np.asarray(v) if isinstance(v, list) else v) for k, v in value.items()})


def run_step(step: StepGenerator, evaluate) -> tuple[np.ndarray, KernelInfo]:
    """Drive a single step with ``evaluate(request, is_first) -> EvalResponse``.

    A convenience for tests and single-chain use; the driver interleaves chains.
    """
    request = next(step)
    first = True
    while True:
        response = evaluate(request, first)
        first = False
        try:
            request = step.send(response)
        except StopIteration as stop:
            return stop.value
