"""``fd.sample``: the one entry point. It checks every argument, builds the algorithm
(the FlyMC / regular :class:`~flymc_dist.driver.Driver`, or austerity's sampler) and hands
it to the one runner, :func:`flymc_dist.run.run`; around it, the trace session (one
writer at a time, a resume that matches, a failure that keeps what can be resumed)."""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from flymc_dist._paths import is_url as _is_url
from flymc_dist._unreachable import unreachable
from flymc_dist.austerity.sampler import check_control_variates, sample_austerity
from flymc_dist.data import Dataset, open_dataset
from flymc_dist.driver import (
    REPLICA_BUDGET,
    Driver,
    check_bright_replica,
)
from flymc_dist.kernels import get_kernel, kernel_options
from flymc_dist.layout import shard_layout
from flymc_dist.models.base import Model
from flymc_dist.progress import SetupProgress, load_note
from flymc_dist.protocol import ShardConfig, ShardSpec
from flymc_dist.result import Result, Summary, efficiency
from flymc_dist.run import describe_run, run
from flymc_dist.trace import Trace, TraceLock
from flymc_dist.transport.channel import check_channel
from flymc_dist.transport.dask import open_transport

__all__ = [
    "ALGORITHMS",
    "BOUNDS",
    "Result",
    "Summary",
    "Z_UPDATES",
    "efficiency",
    "kept_trace",
    "sample",
]

#: the name tests and older callers import (the layout now lives in :mod:`flymc_dist.layout`)
_shard_layout = shard_layout

log = logging.getLogger("flymc_dist")

ALGORITHMS = ("flymc", "regular", "austerity")
BOUNDS = ("map", "untuned")
Z_UPDATES = ("implicit", "explicit")

_DRIVER_OPTIONS = {
    "init",
    "precondition",
    "map_maxiter",
    "bright_replica",
    "replica_budget",
    "exact_rows",
}
_OTHER_OPTIONS = {
    "q_db",
    "resample_fraction",
    "n_shards",
    "rows_per_shard",
    "trace",
    "resume",
    "overwrite_trace",
    "progress",
    "kernel_options",
    "eps",
    "batch_size",
    "n_workers",
    "timeout",
    "checkpoint_every",
    "channel",
    "control_variates",
    "trace_storage_options",
    "out_of_core",
    "memory_budget",
}
#: options there were once, and what does their job now
_REMOVED_OPTIONS = {
    "hot_rows": "exact_rows='auto', the default, evaluates at every step the rows that "
    "alone decide a weight",
    "speculate": "speculative z-updates lost on every setup measured (1.40 against 1.26 ms "
    "per iteration on 2 workers) and were retired with the row-keyed streams",
    "chunk_iterations": "an out-of-core shard now runs the in-memory z-update, reading the "
    "rows it proposes from a local row file: there is no chunk window any more",
}


def _layout(
    data: Any, options: dict[str, Any], specs: list[ShardSpec]
) -> list[ShardSpec] | Callable[[int], list[ShardSpec]]:
    """The shards: ``specs`` as laid out when ``n_shards`` or ``rows_per_shard`` is
    given, else the layout for the cluster's number of workers (one shard each)."""
    if options.get("n_shards") is not None or options.get("rows_per_shard") is not None:
        return specs
    return lambda n_workers: shard_layout(data, options, n_workers)[0]


def _validate(
    model: Model,
    algorithm: str,
    bounds: str,
    z_update: str,
    num_warmup: int,
    num_samples: int,
    chains: int,
    options: dict[str, Any],
) -> None:
    if not isinstance(model, Model):
        raise TypeError(f"model must be a flymc_dist model, not {type(model).__name__}")
    if getattr(model, "task", None) == "multiclass" and getattr(model, "prior", None) == "flat":
        raise ValueError(
            "softmax regression with prior='flat' has an improper posterior "
            "(adding one vector to every class's weights leaves the likelihood "
            "unchanged): use prior='normal' or 'laplace'"
        )
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, not {algorithm!r}")
    if bounds not in BOUNDS:
        raise ValueError(f"bounds must be one of {BOUNDS}, not {bounds!r}")
    if z_update not in Z_UPDATES:
        raise ValueError(f"z_update must be one of {Z_UPDATES}, not {z_update!r}")
    for name, v, lo in (
        ("num_warmup", num_warmup, 0),
        ("num_samples", num_samples, 1),
        ("chains", chains, 1),
    ):
        if not _is_int(v) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, not {v!r}")
    removed = sorted(set(options) & set(_REMOVED_OPTIONS))
    if removed:
        raise TypeError(
            f"option {removed[0]!r} was removed: {_REMOVED_OPTIONS[removed[0]]}; leave it out"
        )
    unknown = set(options) - _DRIVER_OPTIONS - _OTHER_OPTIONS
    if unknown:
        raise TypeError(
            f"unknown option(s) {sorted(unknown)}; valid options are "
            f"{sorted(_DRIVER_OPTIONS | _OTHER_OPTIONS)}"
        )
    q = options.get("q_db", "auto")
    if not ((isinstance(q, str) and q == "auto") or (_is_real(q) and 0.0 < q <= 1.0)):
        raise ValueError(f"q_db must be 'auto' or a number in (0, 1], not {q!r}")
    f = options.get("resample_fraction", 0.1)
    if not (_is_real(f) and 0.0 < f <= 1.0):
        raise ValueError(f"resample_fraction must be a number in (0, 1], not {f!r}")
    exact = options.get("exact_rows", "auto")
    if not (exact is None or (isinstance(exact, str) and exact == "auto")):
        raise ValueError(f"exact_rows must be 'auto' or None, not {exact!r}")
    check_bright_replica(
        options.get("bright_replica", "auto"), options.get("replica_budget", REPLICA_BUDGET)
    )
    check_channel(options.get("channel", "auto"))
    _check_out_of_core(options)
    if "control_variates" in options:
        check_control_variates(options["control_variates"])


def _check_out_of_core(options: dict[str, Any]) -> None:
    ooc = options.get("out_of_core", "auto")
    if not (isinstance(ooc, bool) or (isinstance(ooc, str) and ooc == "auto")):
        raise ValueError(f"out_of_core must be 'auto', True or False, not {ooc!r}")
    budget = options.get("memory_budget")
    if budget is not None and not (_is_int(budget) and budget > 0):
        raise ValueError(
            f"memory_budget must be None or a positive number of bytes, not {budget!r}"
        )


def _check_task(model: Model, task: str, n_classes: int | None) -> None:
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


def default_kernel(kernel: str | None, algorithm: str) -> str:
    """``kernel``, or when None the default θ-kernel of ``algorithm``: NUTS, except for
    austerity (RWMH, its only kernel)."""
    if kernel is None:
        return "rwmh" if algorithm == "austerity" else "nuts"
    return kernel


def _under_trace_lock(func: Any) -> Any:
    """See :func:`_traced_sample` (defined below, with the rest of the trace session)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _traced_sample(func, args, kwargs)

    return wrapper


@_under_trace_lock
def sample(
    model: Model,
    data: Any,
    algorithm: str = "flymc",
    bounds: str = "map",
    kernel: str | None = None,
    z_update: str = "implicit",
    num_warmup: int = 500,
    num_samples: int = 1000,
    chains: int = 4,
    seed: int = 0,
    client: Any = None,
    **options: Any,
) -> Result:
    """Draw from the posterior of ``model`` given ``data``.

    Parameters
    ----------
    model
        ``LogisticRegression``, ``SoftmaxRegression`` or ``RobustRegression``.
    data
        A :class:`~flymc_dist.data.Dataset` (or its path); an in-memory ``(X, y)``
        pair works with ``client="synchronous"``.
    algorithm
        ``"flymc"`` (exact, default), ``"regular"`` (exact, full data every step) or
        ``"austerity"`` (approximate; results are labelled so).
    bounds
        FlyMC tight points: ``"map"`` (tuned at the MAP estimate) or ``"untuned"``.
    kernel
        θ-kernel: ``"nuts"``, ``"hmc"``, ``"mala"``, ``"slice"`` or ``"rwmh"``. Default
        (None): ``"nuts"``, the one that converges on real posteriors, for FlyMC and
        regular MCMC; ``"rwmh"``, its only kernel, for austerity.
    z_update
        ``"implicit"`` (MH on each z_n, knob ``q_db``) or ``"explicit"`` (Gibbs on a
        ``resample_fraction`` of the z_n each iteration).
    num_warmup, num_samples, chains, seed
        Warm-up iterations (adapt, then discarded), kept draws per chain, chains, seed.
    client
        ``None`` starts an embedded LocalCluster (closed afterwards); a
        ``distributed.Client``; a scheduler address (``tcp://…``/``tls://…``) or scheduler
        file; or ``"synchronous"`` to run in this process.
    **options
        ``exact_rows`` ("auto", the default; or None: off. FlyMC: a column that few rows
        carry — ``(Σ x²)² / Σ x⁴``, the effective number of rows, at most 2,000 and at
        most N/100, such as a one-hot category with a few hundred members, or a
        standardised column with one extreme value — gives a weight that only those
        rows inform, and there FlyMC's alternation of z and θ mixes worst. The rows that
        carry such a column get bounds so loose (still bounds: the chain stays exact)
        that they are bright at every step: each θ-step evaluates their
        log-likelihood, as regular MCMC does, and the others stay FlyMC's. At most
        10,000 rows and N/50 (the columns more rows carry are dropped first); two
        passes at set-up; ``info["exact_rows"]`` counts them. On QM9 it picks one row,
        on the 3M-row flights data 1,512 (three hours of the day), on MNIST and on
        dense synthetic data none, and then changes nothing),
        ``q_db`` ("auto": about as many dark→bright proposals per iteration as bright rows,
        four times as many for HMC and NUTS, plus one per exact row; or a number in (0, 1];
        a dark row is proposed once in ``1/q_db`` iterations, so a weight that one row
        decides — a high-leverage row under a heavy-tailed likelihood — moves only as often,
        unless that row is an exact row: on QM9 without exact rows "auto" (q ≈ 2.5e-4) left
        one such weight unconverged after 10,000 draws, and ``q_db=0.01`` converged it in
        3,000),
        ``resample_fraction`` (0.1: the explicit z-update resamples each row with this
        probability),
        ``n_shards`` / ``rows_per_shard``, ``channel`` ("auto": rounds travel on a
        direct socket to each worker's shard host unless the cluster uses TLS;
        "socket"; "dask": Dask's actor RPC; see :class:`~flymc_dist.transport.dask.DaskTransport`),
        ``init`` ("map" or array), ``precondition`` (the kernel's preconditioner:
        "laplace", the default, the Gaussian at the MAP; "bound", FlyMC only: the Gaussian
        of θ given that every datum is dark, from the collapsed bound and the prior — θ
        given z is close to it when few rows are bright, and narrower than the posterior
        where the bounds are more curved than the log-likelihood: with NUTS and
        ``kernel_options={"adapt_metric": False}`` it took 2.5 times fewer queries per
        effective draw on MNIST, but a ridge the data leave to the prior (QM9's
        duplicated columns) needs the adapted metric; "identity"; or a covariance), ``map_maxiter``,
        ``kernel_options`` (dict of the kernel's options; under FlyMC, HMC and NUTS
        default to ``metric_from="differences"``: warm-up estimates the metric of θ given
        z, the conditional each θ-step samples, from successive draws — see
        :class:`~flymc_dist.kernels.adaptation.WindowAdaptation`; ``"draws"`` estimates
        the posterior's, as Stan and regular MCMC do), ``trace`` (zarr path or fsspec URL),
        ``trace_storage_options`` (fsspec options of a ``trace`` URL, e.g.
        ``{"endpoint_url": …, "key": …, "secret": …}``; default: the data set's
        ``storage_options`` when the trace URL has the same protocol as the data set's,
        e.g. both ``s3://``; ``{}`` for none; never written to the trace),
        ``resume``, ``overwrite_trace``, ``checkpoint_every``, ``progress``,
        ``n_workers`` (embedded cluster), ``timeout`` (seconds; fault detection),
        austerity ``eps``, ``batch_size`` and ``control_variates`` (True, the default:
        the sequential test runs on the gap between each row's log-likelihood and its
        MAP-tuned FlyMC bound, whose collapsed sum is exact; False: plain austerity;
        reported as ``info["control_variates"]``), ``out_of_core`` ("auto": a shard
        whose rows would take more than its memory budget streams them once from the
        store into a row file in its worker's local directory and holds in memory only
        the rows some chain has bright; its z-update is the in-memory one, reading the
        rows it proposes (read ahead on a thread), so its draws are the in-memory draws;
        the explicit z-update reads ``resample_fraction`` × N rows per iteration; True /
        False force it; reported per shard as ``info["out_of_core"]``; austerity's
        minibatches read their rows from the row file), ``memory_budget`` (bytes per
        shard; default: its share of half its worker's memory limit; in-process: none).

    Returns
    -------
    Result
    """
    _validate(model, algorithm, bounds, z_update, num_warmup, num_samples, chains, options)
    _check_arguments(data, seed, options)
    kernel = default_kernel(kernel, algorithm)
    if options.get("trace") is not None:
        options["trace_storage_options"] = _trace_options(data, options)
    specs, mem, n_rows, n_features, task, n_classes, path = shard_layout(data, options)
    _check_task(model, task, n_classes)
    if mem is not None and options.get("out_of_core") is True:
        raise ValueError(
            "out_of_core=True needs a data set in a store: write (X, y) with fd.from_numpy"
        )
    if mem is not None:
        model.validate_targets(np.concatenate([v[1] for v in mem.values()]))
    kernel_opts = dict(options.get("kernel_options", {}))
    if algorithm == "flymc" and "metric_from" in kernel_options(kernel):
        # the θ-step samples θ given z: estimate the metric of that conditional, not of
        # the posterior (see WindowAdaptation)
        kernel_opts.setdefault("metric_from", "differences")
    kern = get_kernel(kernel, **kernel_opts)
    names = feature_names(data)
    shown = SetupProgress(options.get("progress"))  # each set-up pass, as it runs
    if shown.enabled:
        shown.row_bytes = _row_bytes(data, n_features)
    if algorithm == "austerity":
        return sample_austerity(
            model,
            specs,
            mem,
            n_rows=n_rows,
            n_features=n_features,
            path=path,
            kernel=kern,
            num_warmup=num_warmup,
            num_samples=num_samples,
            chains=chains,
            seed=seed,
            client=client,
            options=options,
            feature_names=names,
            progress=shown,
        )
    config = ShardConfig(
        model=model,
        algorithm=algorithm,
        chains=chains,
        seed=seed,
        n_rows=n_rows,
        z_update=z_update,
        resample_fraction=float(options.get("resample_fraction", 0.1)),
        track_grad=kern.needs_grad,
        out_of_core=options.get("out_of_core", "auto"),
        memory_budget=options.get("memory_budget"),
    )
    with shown.phase("load", n_rows) as load:
        load.note = load_note(client, mem)
        transport = open_transport(client, _layout(data, options, specs), config, mem, options)
    try:
        driver = Driver(
            model,
            transport,
            kern,
            n_features=n_features,
            algorithm=algorithm,
            bounds=bounds,
            chains=chains,
            seed=seed,
            q_db=options.get("q_db", "auto"),
            n_rows=n_rows,
            progress=shown,
            **{k: options[k] for k in _DRIVER_OPTIONS if k in options},
        )
        info = describe_run(
            transport=transport,
            n_shards=len(transport.specs),
            data=path,
            model_description=model.to_dict(),
            chains=chains,
            seed=seed,
            n_rows=n_rows,
            n_features=n_features,
            num_warmup=num_warmup,
            num_samples=num_samples,
            feature_names=names,
            algorithm=algorithm,
            bounds=bounds if algorithm == "flymc" else None,
            kernel=kernel,
            z_update=z_update if algorithm == "flymc" else None,
            resample_fraction=config.resample_fraction,
        )
        if options.get("trace") is not None:  # what a resumed run must match
            info.update(data_id=_data_id(data), options=_shaping_options(options))
        return run(driver, info, num_warmup, num_samples, options)
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


# ------------------------------------------------------------------ arguments checked up front


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
        v, (bool, np.bool_)
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


def _check_arguments(data: Any, seed: Any, options: dict[str, Any]) -> None:
    """Every argument :func:`_validate` leaves, before anything starts: one line each."""
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, not {seed!r}")
    _check_data(data)
    t = options.get("timeout", 60.0)
    if not (_is_real(t) and math.isfinite(t) and t > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, not {t!r}")
    for name, lo in (
        ("checkpoint_every", 1),
        ("n_workers", 1),
        ("n_shards", 1),
        ("rows_per_shard", 1),
        ("map_maxiter", 0),
    ):
        v = options.get(name)
        if v is not None and (not _is_int(v) or v < lo):
            raise ValueError(f"{name} must be an integer >= {lo}, not {v!r}")
    if options.get("n_shards") is not None and options.get("rows_per_shard") is not None:
        raise ValueError("give n_shards or rows_per_shard, not both")
    for name in ("resume", "overwrite_trace"):
        if not isinstance(options.get(name, False), (bool, np.bool_)):
            raise ValueError(f"{name} must be True or False, not {options[name]!r}")
    if options.get("progress") is not None and not isinstance(options["progress"], bool):
        raise ValueError(f"progress must be True, False or None, not {options['progress']!r}")
    trace = options.get("trace")
    if trace is not None and not isinstance(trace, (str, os.PathLike)):
        raise ValueError(f"trace must be a path (str or os.PathLike), not {type(trace).__name__}")
    if options.get("resume") and trace is None:
        raise ValueError("resume=True needs trace=<the path of the trace to continue>")
    if options.get("resume") and options.get("overwrite_trace"):
        raise ValueError("resume=True and overwrite_trace=True exclude each other")
    tso = options.get("trace_storage_options")
    if tso is not None:
        if not isinstance(tso, dict) or not all(isinstance(k, str) for k in tso):
            raise ValueError(
                f"trace_storage_options must be a dict of fsspec options with str "
                f"keys, not {type(tso).__name__}"
            )
        if trace is None or not _is_url(trace):
            raise ValueError(
                "trace_storage_options applies only to a trace at an fsspec URL (trace='s3://…')"
            )
    if not isinstance(options.get("kernel_options", {}), dict):
        raise ValueError(
            f"kernel_options must be a dict, not {type(options['kernel_options']).__name__}"
        )
    for name, words in (
        ("init", ("map",)),
        ("precondition", ("laplace", "bound", "identity")),
    ):
        v = options.get(name)
        if v is None or (isinstance(v, str) and v in words):
            continue
        if isinstance(v, str) or np.asarray(v).dtype.kind not in "biuf":
            raise ValueError(
                f"{name} must be {' or '.join(map(repr, words))} or an array of numbers, not {v!r}"
            )


# ------------------------------------------------------------------ the trace session


#: options that shape a run's draws, with their defaults: a resumed run must match them
_SHAPING = {
    "q_db": "auto",
    "kernel_options": {},
    "init": "map",
    "precondition": "laplace",
    "map_maxiter": 100,
    "bright_replica": "auto",
    "replica_budget": REPLICA_BUDGET,
    "out_of_core": "auto",
    "memory_budget": None,
    "exact_rows": "auto",
}


def _shaping_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: options.get(k, default) for k, default in _SHAPING.items()}


def _trace_options(data: Any, options: dict[str, Any]) -> dict[str, Any] | None:
    """The fsspec options of the trace: ``trace_storage_options`` if given, else the data
    set's ``storage_options`` when the trace is a URL of the same protocol (e.g. both s3)."""
    if options.get("trace_storage_options") is not None:
        return dict(options["trace_storage_options"]) or None
    trace, ds_options = options.get("trace"), getattr(data, "storage_options", None)
    if trace is None or not ds_options or not _is_url(trace):
        return None
    same = os.fspath(trace).split("://", 1)[0] == str(data.path).split("://", 1)[0]
    return dict(ds_options) if same else None


def _data_id(data: Any) -> str:
    """The identity of the data: :meth:`Dataset.fingerprint`, or a hash of in-memory rows."""
    if isinstance(data, tuple):
        X = np.ascontiguousarray(data[0], dtype=float)
        y = np.ascontiguousarray(data[1], dtype=float)
        h = hashlib.sha256(repr((X.shape, y.shape)).encode())
        h.update(X.tobytes())
        h.update(y.tobytes())
        return f"{X.shape[0]}x{X.shape[1]}:in-memory-sha256-{h.hexdigest()[:32]}"
    return (data if isinstance(data, Dataset) else open_dataset(str(data))).fingerprint()


def _canon(value: Any) -> Any:
    """A comparable form: arrays and tuples as lists, integral floats as ints, dicts sorted."""
    if isinstance(value, np.ndarray):
        return _canon(value.tolist())
    if isinstance(value, dict):
        return {str(k): _canon(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: what a trace must record for a resume to be checked: a resume without them is refused
_MUST_RECORD = {
    "data_id": "the identity of its data set",
    "options": "the settings that shape its draws",
}


def _check_resume(path: Any, args: dict[str, Any]) -> None:
    """Refuse, in one line naming what differs, to resume a trace written by another run:
    the model, the data set (its identity, not only its shape), the algorithm and every
    setting that shapes the draws."""
    options = args["options"]
    trace = Trace.open(path, read_only=True, storage_options=_trace_options(args["data"], options))
    if trace.checkpoint is None:
        raise ValueError(f"trace {os.fspath(path)!s} has no checkpoint to resume from")
    trace.verify()  # a chunk of its draws missing: TraceDamagedError, naming it
    specs, _mem, n_rows, n_features, _t, _k, data_path = shard_layout(args["data"], options)
    algorithm = args["algorithm"]
    want: dict[str, Any] = {
        "data_id": _data_id(args["data"]),
        "n_rows": n_rows,
        "n_features": n_features,
        "model": args["model"].to_dict(),
        "algorithm": algorithm,
        "kernel": str(default_kernel(args["kernel"], algorithm)).strip().lower(),
        "chains": args["chains"],
        "seed": args["seed"],
        "num_warmup": args["num_warmup"],
        "num_samples": args["num_samples"],
        "options": _shaping_options(options),
    }
    if algorithm == "flymc":
        want.update(bounds=args["bounds"], z_update=args["z_update"])
        if args["z_update"] == "explicit":
            want["resample_fraction"] = float(options.get("resample_fraction", 0.1))
    attrs = trace.attrs
    unrecorded = [k for k in _MUST_RECORD if k not in attrs]
    if unrecorded:  # written before traces recorded them: this run cannot be checked
        what = " and ".join(f"{k!r} ({_MUST_RECORD[k]})" for k in unrecorded)
        raise ValueError(
            f"cannot resume {os.fspath(path)!s}: the trace does not record {what} (it was "
            "written by an older flymc_dist), so this run cannot be checked to continue it "
            "on the same data set with the same settings; start a new trace instead"
        )
    if isinstance(attrs.get("kernel"), str):
        attrs["kernel"] = attrs["kernel"].strip().lower()
    diff = []
    for key, value in want.items():
        if key not in attrs or _canon(attrs[key]) == _canon(value):
            continue
        if key == "data_id":
            diff.append(
                f"another data set ({attrs.get('data')} [{attrs[key]}]; this run: "
                f"{data_path} [{value}])"
            )
        elif key == "options":
            old, new = _canon(attrs[key]), _canon(value)
            diff += [
                f"{k} {old.get(k, _canon(_SHAPING.get(k)))!r} (this run: {new.get(k)!r})"
                for k in sorted(new)
                # an option a trace does not record was not one yet: its default then
                if old.get(k, _canon(_SHAPING.get(k))) != new.get(k)
            ]
        else:
            diff.append(f"{key} {attrs[key]!r} (this run: {value!r})")
    if diff:
        raise ValueError(
            f"cannot resume {os.fspath(path)!s}: it was written with " + "; ".join(diff)
        )


#: what :func:`_stamp` returns for a trace whose store cannot be reached
_UNREACHABLE = "unreachable"


def _stamp(path: Any, storage_options: dict[str, Any] | None = None) -> Any:
    """Identity of a trace's root metadata file (it changes with every write): inode and
    time locally, the object's ETag (or time) on an object store; None if it is absent,
    :data:`_UNREACHABLE` if its store cannot be reached."""
    if _is_url(path):
        import fsspec

        try:
            fs, root = fsspec.core.url_to_fs(os.fspath(path), **(storage_options or {}))
            fs.invalidate_cache()
            info = fs.info(f"{root.rstrip('/')}/zarr.json")
        except Exception as err:
            if unreachable(err):
                return _UNREACHABLE
            if isinstance(err, OSError | ValueError):
                return None
            raise
        return info.get("ETag") or info.get("LastModified") or info.get("mtime") or info
    try:
        st = os.stat(os.path.join(os.fspath(path), "zarr.json"))
    except (OSError, TypeError):
        return None
    return (st.st_ino, st.st_mtime_ns)


def kept_trace(err: BaseException) -> tuple[str, int] | None:
    """``(path, iterations)`` of the trace a failed :func:`sample` kept to resume, or None."""
    kept = getattr(err, "flymc_kept_trace", None)
    return kept if isinstance(kept, tuple) else None


def _after_failure(
    path: Any,
    before: Any,
    resume: bool,
    err: BaseException,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """A failed run keeps a trace that has a checkpoint (and says how to resume it), and
    removes one it created that has none; a trace it did not write is never touched.

    Runs under the trace's lock, so whatever changed at ``path`` since ``before`` is this
    run's doing. The same on local disk and on object stores.
    """
    after = _stamp(path, storage_options)
    checkpoint = None
    if after not in (None, _UNREACHABLE) and (resume or after != before):
        try:
            trace = Trace.open(path, read_only=True, storage_options=storage_options)
            checkpoint = trace.checkpoint
        except (OSError, ValueError) as failed:
            if unreachable(failed):
                after = _UNREACHABLE
    if after == _UNREACHABLE:  # what this run checkpointed last, as it wrote it
        saved = getattr(err, "flymc_checkpointed", None)
        if isinstance(saved, int) and saved > 0:
            _keep(err, path, saved, " once its store can be reached again")
        return  # nothing is removed from a store that cannot be reached
    if after is None or (not resume and after == before):
        return  # nothing there, or an older trace this run did not replace yet
    if checkpoint is None or "iteration" not in checkpoint:
        if not resume:
            _remove_trace(path, storage_options)
        return
    _keep(err, path, int(checkpoint["iteration"]) + 1)


def _keep(err: BaseException, path: Any, n: int, when: str = "") -> None:
    """Mark ``err`` as leaving the trace at ``path`` resumable after ``n`` iterations."""
    try:
        err.flymc_kept_trace = (os.fspath(path), n)  # type: ignore[attr-defined]
        err.add_note(
            f"the trace {os.fspath(path)!s} keeps {n} iterations (to its last "
            f"checkpoint): continue the run with resume=True{when}"
        )
    except (AttributeError, TypeError):  # an exception that takes no attributes
        pass


def _remove_trace(path: Any, storage_options: dict[str, Any] | None) -> None:
    """Remove a trace this run created (and left without a checkpoint)."""
    if not _is_url(path):
        shutil.rmtree(os.fspath(path), ignore_errors=True)
        return
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(os.fspath(path), **(storage_options or {}))
        fs.rm(root.rstrip("/"), recursive=True)
    except (OSError, ValueError):
        pass  # best effort: the run failed already


def _traced_sample(func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """:func:`sample` with a ``trace``: one writer at a time, a resume that matches, and a
    failure that keeps what can be resumed and removes only what this run created.

    The trace's :class:`~flymc_dist.trace.TraceLock` is held for the whole run, so a
    second run on the same trace is refused before it starts anything (its clean-up
    cannot touch the first run's trace), and two resumes of one trace cannot both run.
    """
    call = inspect.signature(func).bind(*args, **kwargs)
    call.apply_defaults()
    a = dict(call.arguments)
    options = a.get("options", {})
    path = options.get("trace")
    if path is None:
        return func(*args, **kwargs)
    _validate(
        a["model"],
        a["algorithm"],
        a["bounds"],
        a["z_update"],
        a["num_warmup"],
        a["num_samples"],
        a["chains"],
        options,
    )
    _check_arguments(a["data"], a["seed"], options)
    resume = bool(options.get("resume"))
    so = _trace_options(a["data"], options)
    if resume and a["algorithm"] != "austerity":  # no trace there: FileNotFoundError
        Trace.open(path, read_only=True, storage_options=so)
    lock = TraceLock(path, so).acquire()
    try:
        if resume and a["algorithm"] != "austerity":
            _check_resume(path, a)
        before = _stamp(path, so)
        try:
            return func(*args, **kwargs)
        except BaseException as err:
            if not lock.lost:  # else the trace is another run's now: not ours to touch
                _after_failure(path, before, resume, err, so)
            raise
    finally:
        lock.release()
