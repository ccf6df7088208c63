"""``fd.sample``: the one entry point. It checks every argument (:mod:`flymc_dist.call`),
builds the algorithm (the FlyMC / regular :class:`~flymc_dist.driver.Driver`, or
austerity's sampler) and hands it to the one runner, :func:`flymc_dist.run.run`; with a
trace, inside the trace session (:mod:`flymc_dist.session`)."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from flymc_dist.austerity.sampler import sample_austerity
from flymc_dist.call import RUN_DEFAULTS, Call, check_task, make_call
from flymc_dist.data import Dataset, open_dataset
from flymc_dist.driver import Driver
from flymc_dist.kernels import KERNELS, Kernel
from flymc_dist.layout import shard_layout
from flymc_dist.models.base import Model
from flymc_dist.options import Austerity, FlyMC, Placement, Regular, describe
from flymc_dist.progress import SetupProgress, load_note
from flymc_dist.protocol import ShardConfig
from flymc_dist.result import Result, Summary, efficiency
from flymc_dist.run import describe_run, run
from flymc_dist.session import data_id, kept_trace, shaping_options, trace_options, traced
from flymc_dist.transport.dask import open_transport

__all__ = ["Result", "Summary", "efficiency", "feature_names", "kept_trace", "sample"]


def sample(
    model: Model,
    data: Any,
    algorithm: str | FlyMC | Regular | Austerity = "flymc",
    kernel: str | Kernel | None = None,
    *,
    num_warmup: int = 500,
    num_samples: int = 1000,
    chains: int = 4,
    seed: int = 0,
    client: Any = None,
    placement: Placement | None = None,
    init: str | np.ndarray = "map",
    precondition: str | np.ndarray = "laplace",
    map_maxiter: int = 100,
    trace: str | None = None,
    resume: bool = False,
    overwrite_trace: bool = False,
    checkpoint_every: int = 100,
    trace_storage_options: dict[str, Any] | None = None,
    progress: bool | None = None,
) -> Result:
    """Draw from the posterior of ``model`` given ``data``.

    >>> res = fd.sample(model, data, fd.FlyMC(q_db=0.01), fd.NUTS(target_accept=0.9))

    Parameters
    ----------
    model
        ``LogisticRegression``, ``SoftmaxRegression`` or ``RobustRegression``.
    data
        A :class:`~flymc_dist.data.Dataset` (or its path); an in-memory ``(X, y)``
        pair works with ``client="synchronous"``.
    algorithm
        ``fd.FlyMC(…)`` (exact; the default), ``fd.Regular()`` (exact, every row at every
        step) or ``fd.Austerity(…)`` (approximate; results are labelled so); a name,
        ``"flymc"``, ``"regular"`` or ``"austerity"``, is that object with its defaults.
        Their options are listed below.
    kernel
        The θ-kernel: ``fd.NUTS(…)``, ``fd.HMC(…)``, ``fd.MALA(…)``, ``fd.Slice(…)`` or
        ``fd.RWMH(…)`` (each documents its options), or its name for its defaults.
        Default: NUTS for FlyMC and regular MCMC; RWMH, its only kernel, for austerity.
    num_warmup, num_samples, chains, seed
        Warm-up iterations (adapt, then discarded), kept draws per chain, chains, seed.
    client
        ``None`` starts an embedded LocalCluster (closed afterwards); a
        ``distributed.Client``; a scheduler address (``tcp://…``/``tls://…``) or scheduler
        file; or ``"synchronous"`` to run in this process.
    placement
        ``fd.Placement(…)``: where the shards run and how they hold their rows (options
        below). It never changes the draws.
    init
        ``"map"`` (start near the MAP, jittered by the Laplace covariance) or an array.
    precondition
        The kernel's preconditioner: ``"laplace"`` (the Gaussian at the MAP), ``"bound"``
        (FlyMC: the Gaussian of θ given that every row is dark), ``"identity"``, or a
        covariance.
    map_maxiter
        Iterations of the MAP search.
    trace
        A zarr path or fsspec URL the draws are written to as the run goes (resumable).
    resume
        Continue the run recorded in ``trace`` (same model, data and settings). FlyMC's
        z is not checkpointed: it is redrawn exactly from p(z | θ) at the checkpointed
        θ (a valid Gibbs step), so the resumed draws are an exact continuation but not
        those of the uninterrupted run.
    overwrite_trace
        Replace an existing trace.
    checkpoint_every
        Iterations between checkpoints of the trace.
    trace_storage_options
        fsspec options of a ``trace`` URL (default: the data set's, when both are URLs of
        one protocol; ``{}``: none). Never written to the trace.
    progress
        Show set-up passes and a sampling bar (default: when the output is a terminal).

    Returns
    -------
    Result

    Notes
    -----
    __OPTIONS__
    """
    given = dict(locals())
    run_args = {k: given[k] for k in RUN_DEFAULTS}
    call = make_call(model, data, algorithm, kernel, run_args)
    if call.trace is None:
        return _sample(call)
    call.trace_storage_options = trace_options(data, call.trace, call.trace_storage_options)
    return traced(call, _sample)


def _options_doc() -> str:
    """The options of the algorithm and placement objects, for :func:`sample`'s docstring."""
    lines = ["The kernels and their options' defaults (each class documents them):\n"]
    for alias, name in (
        ("NUTS", "nuts"),
        ("HMC", "hmc"),
        ("MALA", "mala"),
        ("Slice", "slice"),
        ("RWMH", "rwmh"),
    ):
        params = inspect.signature(KERNELS[name]).parameters.values()
        shown = ", ".join(f"{p.name}={p.default!r}" for p in params)
        lines.append(f"    - ``fd.{alias}({shown})``")
    lines.append("")
    for cls in (FlyMC, Austerity, Placement):
        lines.append(f"``fd.{cls.__name__}`` options:\n")
        for name, default, doc in describe(cls):
            lines.append(f"    - ``{name}`` (default ``{default!r}``): {doc}")
        lines.append("")
    return "\n".join(f"    {line}" if line else "" for line in lines).strip()


sample.__doc__ = (sample.__doc__ or "").replace("__OPTIONS__", _options_doc())


def _sample(call: Call) -> Result:
    """Run a checked call."""
    data, alg, kern, placement = call.data, call.algorithm, call.kernel, call.placement
    settings = call.settings
    specs, mem, n_rows, n_features, task, n_classes, path = shard_layout(data, placement)
    check_task(call.model, task, n_classes)
    if mem is not None and call.placement.out_of_core is True:
        raise ValueError(
            "out_of_core=True needs a data set in a store: write (X, y) with fd.from_numpy"
        )
    if mem is not None:
        call.model.validate_targets(np.concatenate([v[1] for v in mem.values()]))
    names = feature_names(data)
    shown = SetupProgress(call.progress)  # each set-up pass, as it runs
    if shown.enabled:
        shown.row_bytes = _row_bytes(data, n_features)
    sizes = dict(num_warmup=call.num_warmup, num_samples=call.num_samples, chains=call.chains)
    layout = specs
    if call.placement.n_shards is None and call.placement.rows_per_shard is None:
        # one shard per worker of the cluster, whichever algorithm
        layout = lambda n_workers: shard_layout(data, placement, n_workers)[0]  # noqa: E731
    if isinstance(alg, Austerity):
        return sample_austerity(
            call.model,
            layout,
            mem,
            n_rows=n_rows,
            n_features=n_features,
            path=path,
            kernel=kern,
            seed=call.seed,
            client=call.client,
            austerity=alg,
            placement=placement,
            settings=settings,
            feature_names=names,
            progress=shown,
            **sizes,
        )
    fly = call.flymc
    config = ShardConfig(
        model=call.model,
        algorithm=alg.name,
        chains=call.chains,
        seed=call.seed,
        n_rows=n_rows,
        z_update=fly.z_update,
        resample_fraction=fly.resample_fraction,
        # a q given as a number: an out-of-core shard whose proposals cannot fit its
        # budget is refused as it opens, before its row file is written (else at set_q)
        **({} if isinstance(fly.q_db, str) else {"q_db": float(fly.q_db)}),
        track_grad=kern.needs_grad,
        out_of_core=call.placement.out_of_core,
        memory_budget=call.placement.memory_budget,
    )
    with shown.phase("load", n_rows) as load:
        load.note = load_note(call.client, mem)
        transport = open_transport(call.client, layout, config, mem, placement)
    try:
        driver = Driver(
            call.model,
            transport,
            kern,
            n_features=n_features,
            algorithm=alg,
            chains=call.chains,
            seed=call.seed,
            n_rows=n_rows,
            settings=settings,
            progress=shown,
        )
        flymc = isinstance(alg, FlyMC)
        info = describe_run(
            transport=transport,
            n_shards=len(transport.specs),
            data=path,
            model_description=call.model.to_dict(),
            seed=call.seed,
            n_rows=n_rows,
            n_features=n_features,
            feature_names=names,
            algorithm=alg.name,
            bounds=fly.bounds if flymc else None,
            kernel=kern.name,
            z_update=fly.z_update if flymc else None,
            resample_fraction=fly.resample_fraction,
            **sizes,
        )
        if call.trace is not None:  # what a resumed run must match
            info.update(data_id=data_id(data), options=shaping_options(call))
        return run(driver, info, call.num_warmup, call.num_samples, settings)
    finally:
        transport.close()


def _row_bytes(data: Any, n_features: int) -> int:
    """Bytes of one row as set-up passes read it (features in the store's dtype, in
    memory float64, and the target): what set-up progress counts bytes per second in."""
    if isinstance(data, tuple):
        return 8 * (n_features + 1)
    ds = data if isinstance(data, Dataset) else open_dataset(str(data))
    return int(ds.dtype.itemsize) * n_features + 8


def feature_names(data: Any) -> list[str] | None:
    """The column names of ``data``: a :class:`~flymc_dist.data.Dataset`'s (or its
    path's) ``feature_names`` (a CSV header at ``flymc ingest``, a DataFrame's columns or
    ``feature_names=`` at :func:`~flymc_dist.data.from_numpy`), an in-memory ``(X, y)``
    pair's ``X.columns`` when ``X`` is a DataFrame; else None."""
    if isinstance(data, tuple):
        columns = getattr(data[0], "columns", None)
        return None if columns is None else [str(c) for c in columns]
    ds = data if isinstance(data, Dataset) else open_dataset(str(data))
    names = ds.feature_names
    return None if names is None else list(names)
