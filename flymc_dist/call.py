"""What :func:`flymc_dist.sample` was asked: every argument checked once, before anything
starts, into one :class:`Call` (the algorithm and kernel as objects, the placement, the
run's own settings)."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from flymc_dist._paths import is_url
from flymc_dist.data import Dataset
from flymc_dist.kernels import KERNELS, Kernel, get_kernel
from flymc_dist.models.base import Model
from flymc_dist.options import (
    Austerity,
    FlyMC,
    Placement,
    Regular,
    RunSettings,
    algorithm_of,
    boolean,
    integer,
)

__all__ = ["RUN_DEFAULTS", "Call", "check_task", "default_kernel", "make_call"]

#: the settings of the run itself (keyword arguments of :func:`flymc_dist.sample`) and
#: their defaults (of those its parts read: :class:`~flymc_dist.options.RunSettings`)
RUN_DEFAULTS: dict[str, Any] = {
    "num_warmup": 500,
    "num_samples": 1000,
    "chains": 4,
    "seed": 0,
    "client": None,
    "placement": None,
    **{f.name: f.default for f in dataclasses.fields(RunSettings)},
}


@dataclass
class Call:
    """One call of :func:`flymc_dist.sample`, checked.

    Attributes
    ----------
    algorithm
        :class:`~flymc_dist.options.FlyMC`, :class:`~flymc_dist.options.Regular` or
        :class:`~flymc_dist.options.Austerity`.
    kernel
        The θ-kernel object this run uses (a copy of the one given; ``metric_from``
        resolved for the algorithm).
    kernel_options
        The kernel's settings that differ from its defaults, as given (what a trace
        records and a resume must match).
    """

    model: Model
    data: Any
    algorithm: FlyMC | Regular | Austerity
    kernel: Kernel
    kernel_options: dict[str, Any]
    num_warmup: int
    num_samples: int
    chains: int
    seed: int
    client: Any
    placement: Placement
    init: Any
    precondition: Any
    map_maxiter: int
    trace: Any
    resume: bool
    overwrite_trace: bool
    checkpoint_every: int
    trace_storage_options: dict[str, Any] | None
    progress: bool | None

    @property
    def flymc(self) -> FlyMC:
        """The FlyMC options (their defaults for another algorithm)."""
        return self.algorithm if isinstance(self.algorithm, FlyMC) else FlyMC()

    @property
    def settings(self) -> RunSettings:
        """The run's own settings, as its parts read them (the algorithm and the
        placement are read from their objects)."""
        return RunSettings(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(RunSettings)}
        )


def default_kernel(kernel: Any, algorithm: str) -> str:
    """The name of ``kernel`` (a name or a kernel object), or when None the default
    θ-kernel of ``algorithm``: NUTS, except for austerity (RWMH, its only kernel)."""
    if kernel is None:
        return "rwmh" if algorithm == "austerity" else "nuts"
    if isinstance(kernel, Kernel):
        return kernel.name
    return str(kernel).strip().lower()


def make_call(model: Any, data: Any, algorithm: Any, kernel: Any, run: dict[str, Any]) -> Call:
    """Check every argument of :func:`flymc_dist.sample` and gather them into a
    :class:`Call`."""
    placement = run.get("placement")
    alg = algorithm_of(algorithm)
    if placement is None:
        placement = Placement()
    elif not isinstance(placement, Placement):
        raise TypeError(f"placement must be fd.Placement(…), not {type(placement).__name__}")
    _check_model(model)
    _check_data(data)
    for name, lo in (
        ("num_warmup", 0),
        ("num_samples", 1),
        ("chains", 1),
        ("seed", 0),
        ("checkpoint_every", 1),
        ("map_maxiter", 0),
    ):
        run[name] = integer(lo)(name, run[name])
    for name in ("resume", "overwrite_trace"):
        run[name] = boolean(name, run[name])
    if run["progress"] is not None:
        run["progress"] = boolean("progress", run["progress"])
    _check_trace(run)
    for name, words in (("init", ("map",)), ("precondition", ("laplace", "bound", "identity"))):
        v = run[name]
        if isinstance(v, str) and v in words:
            continue
        if isinstance(v, str) or np.asarray(v).dtype.kind not in "biuf":
            raise ValueError(
                f"{name} must be {' or '.join(map(repr, words))} or an array of numbers, not {v!r}"
            )
    if isinstance(run["precondition"], str) and run["precondition"] == "bound":
        if not isinstance(alg, FlyMC):
            raise ValueError("precondition='bound' needs FlyMC's bounds (algorithm=fd.FlyMC())")
    kern, recorded = _kernel(kernel, alg)
    run = {k: v for k, v in run.items() if k != "placement"}
    return Call(
        model=model,
        data=data,
        algorithm=alg,
        kernel=kern,
        kernel_options=recorded,
        placement=placement,
        **run,
    )


def _kernel(kernel: Any, alg: Any) -> tuple[Kernel, dict[str, Any]]:
    """The kernel object of this run (a copy, ``metric_from`` resolved for ``alg``) and its
    settings that differ from the defaults."""
    if kernel is None or isinstance(kernel, str):
        kern = get_kernel(default_kernel(kernel, alg.name))
    elif isinstance(kernel, Kernel):
        kern = copy.copy(kernel)
    else:
        raise TypeError(
            f"kernel must be a kernel object (fd.NUTS(…), fd.RWMH(…), …) or one of "
            f"{sorted(KERNELS)}, not {type(kernel).__name__}"
        )
    recorded = kern.changed()
    if getattr(kern, "metric_from", "") is None:
        # the θ-step of FlyMC samples θ given z: estimate the metric of that conditional,
        # not of the posterior (see WindowAdaptation)
        kern.metric_from = "differences" if isinstance(alg, FlyMC) else "draws"
    return kern, recorded


# ------------------------------------------------------------------ the checks


def _check_model(model: Any) -> None:
    if not isinstance(model, Model):
        raise TypeError(f"model must be a flymc_dist model, not {type(model).__name__}")
    if getattr(model, "task", None) == "multiclass" and getattr(model, "prior", None) == "flat":
        raise ValueError(
            "softmax regression with prior='flat' has an improper posterior "
            "(adding one vector to every class's weights leaves the likelihood "
            "unchanged): use prior='normal' or 'laplace'"
        )


def _check_data(data: Any) -> None:
    """``data`` is a Dataset, a store path, or an ``(X, y)`` pair of real arrays, D >= 1."""
    if isinstance(data, (Dataset, str, os.PathLike)):
        return
    if not isinstance(data, tuple):
        shape = getattr(data, "shape", None)
        raise TypeError(
            f"data must be a Dataset, a store path or an (X, y) tuple, not "
            f"{type(data).__name__}" + (f" of shape {shape}" if shape else "")
        )
    if len(data) != 2:
        raise ValueError(f"data as a tuple must be (X, y), not a tuple of {len(data)}")
    for name, a, ndim in (("X", data[0], 2), ("y", data[1], 1)):
        arr = np.asarray(a)
        if arr.dtype.kind not in "biuf":
            raise ValueError(
                f"{name} must hold real numbers (bool, integer or float), not dtype {arr.dtype}"
            )
        if arr.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimension(s), not shape {arr.shape}")
    if np.shape(data[0])[1] == 0:
        raise ValueError(f"X must have at least one column (D >= 1), not shape {np.shape(data[0])}")


def _check_trace(run: dict[str, Any]) -> None:
    trace = run["trace"]
    if trace is not None and not isinstance(trace, (str, os.PathLike)):
        raise ValueError(f"trace must be a path (str or os.PathLike), not {type(trace).__name__}")
    if run["resume"] and trace is None:
        raise ValueError("resume=True needs trace=<the path of the trace to continue>")
    if run["resume"] and run["overwrite_trace"]:
        raise ValueError("resume=True and overwrite_trace=True exclude each other")
    tso = run["trace_storage_options"]
    if tso is not None:
        if not isinstance(tso, dict) or not all(isinstance(k, str) for k in tso):
            raise ValueError(
                f"trace_storage_options must be a dict of fsspec options with str "
                f"keys, not {type(tso).__name__}"
            )
        if trace is None or not is_url(trace):
            raise ValueError(
                "trace_storage_options applies only to a trace at an fsspec URL (trace='s3://…')"
            )


def check_task(model: Model, task: str, n_classes: int | None) -> None:
    """The model fits the data set's task (and its number of classes)."""
    if model.task == "binary" and task != "binary":
        raise ValueError(
            f"{type(model).__name__} needs 0/1 labels; this data set's task is {task!r}"
        )
    if model.task == "multiclass":
        if task not in ("multiclass", "binary"):
            raise ValueError(
                f"{type(model).__name__} needs class labels; this data set's task is {task!r}"
            )
        k = getattr(model, "n_classes", None)
        if n_classes is not None and k is not None and n_classes > k:
            raise ValueError(f"the data have {n_classes} classes but the model has {k}")
