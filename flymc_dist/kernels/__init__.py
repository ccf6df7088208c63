"""θ-kernels: generators speaking the request/response protocol of :mod:`.base`.

They know nothing of FlyMC, shards or Dask. Each kernel has ``init_params(dim,
scale_tril)``, ``step(rng, position, params)`` (a generator), ``adapter(params,
num_warmup)`` (warm-up adaptation, kept outside the kernel) and a class attribute
``needs_grad`` (its requests ask for gradients).

>>> kernel = get_kernel("rwmh", target_accept=0.3)
>>> params = kernel.init_params(2, None)
"""

from __future__ import annotations

import inspect
from typing import Any

from flymc_dist.kernels.adaptation import WindowAdaptation, build_schedule
from flymc_dist.kernels.base import (
    Adapter,
    EvalRequest,
    EvalResponse,
    Kernel,
    KernelInfo,
    StepGenerator,
    run_step,
)
from flymc_dist.kernels.hamiltonian import HamiltonianInfo, HamiltonianParams
from flymc_dist.kernels.hmc import HMC
from flymc_dist.kernels.mala import MALA, MALAParams
from flymc_dist.kernels.nuts import NUTS
from flymc_dist.kernels.rwmh import DualAveraging, RandomWalkMH, RWMHParams, StepSizeAdapter
from flymc_dist.kernels.slice import SliceInfo, SliceParams, SliceSampler

__all__ = [
    "HMC",
    "KERNELS",
    "MALA",
    "NUTS",
    "Adapter",
    "DualAveraging",
    "EvalRequest",
    "EvalResponse",
    "HamiltonianInfo",
    "HamiltonianParams",
    "Kernel",
    "KernelInfo",
    "MALAParams",
    "RWMHParams",
    "RandomWalkMH",
    "SliceInfo",
    "SliceParams",
    "SliceSampler",
    "StepGenerator",
    "StepSizeAdapter",
    "WindowAdaptation",
    "build_schedule",
    "get_kernel",
    "kernel_options",
    "run_step",
]

#: kernel name → class
KERNELS: dict[str, type] = {
    "rwmh": RandomWalkMH,
    "mala": MALA,
    "slice": SliceSampler,
    "hmc": HMC,
    "nuts": NUTS,
}


def kernel_options(name: str) -> list[str]:
    """The constructor options of the kernel called ``name`` (empty for an unknown name)."""
    cls = KERNELS.get(name.strip().lower()) if isinstance(name, str) else None
    if cls is None:
        return []
    return [p for p in inspect.signature(cls).parameters if p != "self"]


def get_kernel(name: str, **options: Any) -> Kernel:
    """Build the kernel called ``name`` with keyword ``options``.

    Parameters
    ----------
    name
        ``"rwmh"``, ``"mala"``, ``"slice"``, ``"hmc"`` or ``"nuts"`` (case-insensitive).
    **options
        Constructor options of that kernel (e.g. ``target_accept``, ``step_size``;
        ``batch``, ``max_steps_out``, ``shrink_ahead``, ``width`` for slice;
        ``metric`` (``"dense"`` or ``"diag"``), ``find_step_size``,
        ``divergence_threshold`` for hmc and nuts; ``max_tree_depth`` for nuts;
        ``trajectory_length``, ``jitter``, ``max_steps`` for hmc).

    Returns
    -------
    Kernel
        The kernel instance.

    Raises
    ------
    ValueError
        For an unknown name or an invalid option value.
    TypeError
        For options the kernel does not take (all of them are named).
    """
    if not isinstance(name, str) or name.strip().lower() not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; choose one of {sorted(KERNELS)}")
    cls = KERNELS[name.strip().lower()]
    accepted = kernel_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"kernel {cls.name!r} got unknown option(s) {unknown}; it accepts {accepted}"
        )
    return cls(**options)
