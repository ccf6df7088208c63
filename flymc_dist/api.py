"""``fd.sample``: the one entry point, and the :class:`Result` it returns."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from flymc_dist import diagnostics
from flymc_dist.channel import check_channel
from flymc_dist.driver import (
    STAT_NAMES,
    Driver,
    check_speculate,
    params_to_json,
    rng_state_from_json,
)
from flymc_dist.kernels import get_kernel
from flymc_dist.models.base import Model
from flymc_dist.progress import Progress
from flymc_dist.shard import ShardConfig, ShardSpec

log = logging.getLogger("flymc_dist")

ALGORITHMS = ("flymc", "regular", "austerity")
BOUNDS = ("map", "untuned")
Z_UPDATES = ("implicit", "explicit")

_DRIVER_OPTIONS = {"init", "precondition", "map_maxiter", "speculate"}
_OTHER_OPTIONS = {"q_db", "resample_fraction", "n_shards", "rows_per_shard", "trace", "resume",
                  "overwrite_trace", "progress", "kernel_options", "eps", "batch_size",
                  "n_workers", "timeout", "checkpoint_every", "channel", "control_variates"}


class Summary(dict):
    """Per-parameter diagnostics (a dict of arrays) that prints as a table."""

    def __init__(self, table: dict[str, np.ndarray], names: list[str] | None = None,
                 header: str = "") -> None:
        super().__init__(table)
        self._names = names
        self._header = header

    def __str__(self) -> str:
        body = diagnostics.format_summary(dict(self), names=self._names)
        return f"{self._header}\n{body}" if self._header else body

    __repr__ = __str__


class Result:
    """Draws and per-iteration statistics of a run.

    Attributes
    ----------
    samples
        Post-warm-up draws, shape ``(chains, draws) + param_shape``.
    stats
        Per-iteration statistics, each of shape ``(chains, draws)``: ``accepted``,
        ``accept_prob``, ``n_bright``, ``likelihood_queries``, ``round_trips``,
        ``log_joint`` (and ``data_used`` for austerity).
    warmup_samples, warmup_stats
        The same for the discarded warm-up iterations.
    info
        Run metadata: algorithm, settings, timings, MAP, setup cost, recoveries.
    approximate
        True for austerity MH, whose draws do *not* target the exact posterior.
    """

    def __init__(self, samples: np.ndarray, stats: dict[str, np.ndarray],
                 warmup_samples: np.ndarray, warmup_stats: dict[str, np.ndarray],
                 info: dict[str, Any]) -> None:
        self.samples = samples
        self.stats = stats
        self.warmup_samples = warmup_samples
        self.warmup_stats = warmup_stats
        self.info = info
        self.approximate = info.get("algorithm") == "austerity"

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Shape of one draw."""
        return tuple(self.samples.shape[2:])

    def summary(self, names: list[str] | None = None) -> Summary:
        """Per-parameter mean, sd, MCSE, bulk/tail ESS, rank-normalised split-R̂ and quantiles."""
        table = diagnostics.summary(self.samples, names=names)
        header = ""
        if self.approximate:
            header = "APPROXIMATE (austerity MH): draws do not target the exact posterior."
        return Summary(table, names, header)

    def efficiency(self) -> dict[str, float]:
        """Cost figures: queries and seconds per iteration, ESS per query and per second."""
        C, S = self.samples.shape[:2]
        flat = self.samples.reshape(C, S, -1)
        ess = np.array([diagnostics.ess_bulk(flat[:, :, j]) for j in range(flat.shape[2])])
        q = self.stats["likelihood_queries"]
        secs = float(self.info.get("sampling_seconds", np.nan))
        n_iter = S
        min_ess = float(np.nanmin(ess)) if ess.size else float("nan")
        mean_ess = float(np.nanmean(ess)) if ess.size else float("nan")
        total_q = float(q.sum())
        return {
            "queries_per_iteration": float(q.mean()),
            "seconds_per_iteration": secs / n_iter if n_iter else float("nan"),
            "bright_fraction": float(self.stats["n_bright"].mean() / self.info["n_rows"]),
            "acceptance": float(self.stats["accepted"].mean()),
            "round_trips_per_iteration": float(self.stats["round_trips"].mean()),
            "ess_min": min_ess,
            "ess_mean": mean_ess,
            "ess_per_1000_iterations": 1000.0 * mean_ess / (C * n_iter),
            "ess_per_query": mean_ess / total_q if total_q else float("nan"),
            "ess_per_second": mean_ess / secs if secs else float("nan"),
        }

    def to_arviz(self) -> Any:
        """An ``arviz.InferenceData`` (needs the ``arviz`` extra)."""
        try:
            import arviz as az
        except ImportError as err:  # pragma: no cover - optional extra
            raise ImportError("to_arviz needs arviz: pip install 'flymc_dist[arviz]'") from err
        return az.from_dict(posterior={"theta": self.samples},
                            sample_stats={k: v for k, v in self.stats.items()})

    def __repr__(self) -> str:
        C, S = self.samples.shape[:2]
        tag = " APPROXIMATE" if self.approximate else ""
        return (f"<Result{tag} algorithm={self.info.get('algorithm')} chains={C} draws={S} "
                f"param_shape={self.param_shape}>")


def _validate(model: Model, algorithm: str, bounds: str, z_update: str, num_warmup: int,
              num_samples: int, chains: int, options: dict[str, Any]) -> None:
    if not isinstance(model, Model):
        raise TypeError(f"model must be a flymc_dist model, not {type(model).__name__}")
    if getattr(model, "task", None) == "multiclass" and getattr(model, "prior", None) == "flat":
        raise ValueError("softmax regression with prior='flat' has an improper posterior "
                         "(adding one vector to every class's weights leaves the likelihood "
                         "unchanged): use prior='normal' or 'laplace'")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, not {algorithm!r}")
    if bounds not in BOUNDS:
        raise ValueError(f"bounds must be one of {BOUNDS}, not {bounds!r}")
    if z_update not in Z_UPDATES:
        raise ValueError(f"z_update must be one of {Z_UPDATES}, not {z_update!r}")
    for name, v, lo in (("num_warmup", num_warmup, 0), ("num_samples", num_samples, 1),
                        ("chains", chains, 1)):
        if not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, not {v!r}")
    unknown = set(options) - _DRIVER_OPTIONS - _OTHER_OPTIONS
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; valid options are "
                        f"{sorted(_DRIVER_OPTIONS | _OTHER_OPTIONS)}")
    q = options.get("q_db", "auto")
    if not (q == "auto" or (isinstance(q, (int, float)) and 0.0 < q <= 1.0)):
        raise ValueError(f"q_db must be 'auto' or a number in (0, 1], not {q!r}")
    f = options.get("resample_fraction", 0.1)
    if not 0.0 < f <= 1.0:
        raise ValueError(f"resample_fraction must be in (0, 1], not {f!r}")
    check_speculate(options.get("speculate", False))
    check_channel(options.get("channel", "auto"))
    if "control_variates" in options:
        from flymc_dist.austerity import check_control_variates

        check_control_variates(options["control_variates"])


def _check_task(model: Model, task: str, n_classes: int | None) -> None:
    if model.task == "binary" and task != "binary":
        raise ValueError(f"{type(model).__name__} needs 0/1 labels; this data set's task is "
                         f"{task!r}")
    if model.task == "multiclass":
        if task not in ("multiclass", "binary"):
            raise ValueError(f"{type(model).__name__} needs class labels; this data set's task "
                             f"is {task!r}")
        k = getattr(model, "n_classes", None)
        if n_classes is not None and k is not None and n_classes > k:
            raise ValueError(f"the data have {n_classes} classes but the model has {k}")


def _shard_layout(data: Any, options: dict[str, Any]) -> tuple[list[ShardSpec], dict | None,
                                                              int, int, str, int | None, str]:
    """Shard specs (and in-memory rows for an (X, y) pair)."""
    n_shards = options.get("n_shards")
    rows_per_shard = options.get("rows_per_shard")
    if isinstance(data, tuple):
        X, y = data
        X = np.asarray(X, float)
        y = np.asarray(y)
        if X.ndim != 2 or y.ndim != 1 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
            raise ValueError(f"(X, y) must be (N, D) and (N,) with N > 0; got {X.shape}, "
                             f"{y.shape}")
        if not (np.all(np.isfinite(X)) and np.all(np.isfinite(y.astype(float)))):
            raise ValueError("X and y must be finite")
        N = X.shape[0]
        k = n_shards or (max(1, -(-N // rows_per_shard)) if rows_per_shard else 1)
        edges = np.linspace(0, N, min(k, N) + 1).astype(int)
        specs = [ShardSpec(i, "", int(a), int(b)) for i, (a, b) in
                 enumerate(zip(edges[:-1], edges[1:], strict=True))]
        mem = {s.shard_id: (X[s.start:s.stop], y[s.start:s.stop]) for s in specs}
        integer = bool(np.all(np.mod(y, 1) == 0)) if y.dtype.kind != "b" else True
        if integer and set(np.unique(y).tolist()) <= {0, 1}:
            task, k = "binary", 2
        elif integer and y.min() >= 0:
            task, k = "multiclass", int(y.max()) + 1
        else:
            task, k = "real", None
        return specs, mem, N, X.shape[1], task, k, "<in memory>"
    from flymc_dist.data import Dataset, open_dataset

    ds = data if isinstance(data, Dataset) else open_dataset(str(data))
    ranges = ds.shard_ranges(n_shards=n_shards, rows_per_shard=rows_per_shard)
    specs = [ShardSpec(i, ds.path, a, b) for i, (a, b) in enumerate(ranges)]
    return specs, None, ds.n_rows, ds.n_features, ds.task, ds.n_classes, ds.path


def sample(model: Model, data: Any, algorithm: str = "flymc", bounds: str = "map",
           kernel: str = "rwmh", z_update: str = "implicit", num_warmup: int = 500,
           num_samples: int = 1000, chains: int = 4, seed: int = 0, client: Any = None,
           **options: Any) -> Result:
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
        θ-kernel: ``"rwmh"``, ``"mala"`` or ``"slice"``.
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
        ``q_db`` ("auto": about as many dark→bright proposals as bright rows; or a
        number in (0, 1]), ``speculate`` (False; True: FlyMC with RWMH on a cluster
        updates z while the driver decides, as if the proposal will be rejected, and
        undoes it when it was not — the same draws, sometimes fewer milliseconds per
        iteration (not on 2-core machines: measure with ``flymc bench overhead``);
        undone work is reported as ``info["speculative_queries"]``; "auto": only when
        every worker holding shards is on another machine), ``resample_fraction`` (0.1),
        ``n_shards`` / ``rows_per_shard``, ``channel`` ("auto": rounds travel on a
        direct socket to each worker's shard host unless the cluster uses TLS;
        "socket"; "dask": Dask's actor RPC; see :class:`~flymc_dist.cluster.DaskTransport`),
        ``init`` ("map" or array), ``precondition`` ("laplace", "identity" or a
        covariance), ``map_maxiter``, ``kernel_options`` (dict), ``trace`` (zarr path),
        ``resume``, ``overwrite_trace``, ``checkpoint_every``, ``progress``,
        ``n_workers`` (embedded cluster), ``timeout`` (seconds; fault detection),
        austerity ``eps``, ``batch_size`` and ``control_variates`` (True, the default:
        the sequential test runs on the gap between each row's log-likelihood and its
        MAP-tuned FlyMC bound, whose collapsed sum is exact; False: plain austerity;
        reported as ``info["control_variates"]``).

    Returns
    -------
    Result
    """
    _validate(model, algorithm, bounds, z_update, num_warmup, num_samples, chains, options)
    specs, mem, n_rows, n_features, task, n_classes, path = _shard_layout(data, options)
    _check_task(model, task, n_classes)
    if mem is not None:
        model.validate_targets(np.concatenate([v[1] for v in mem.values()]))
    kern = get_kernel(kernel, **options.get("kernel_options", {}))
    if algorithm == "austerity":
        from flymc_dist.austerity import sample_austerity

        return sample_austerity(model, specs, mem, n_rows=n_rows, n_features=n_features,
                                path=path, kernel=kern, num_warmup=num_warmup,
                                num_samples=num_samples, chains=chains, seed=seed, client=client,
                                options=options)
    config = ShardConfig(model=model, algorithm=algorithm, chains=chains, seed=seed,
                         z_update=z_update,
                         resample_fraction=float(options.get("resample_fraction", 0.1)),
                         track_grad=kernel == "mala")
    from flymc_dist.cluster import open_transport

    transport = open_transport(client, specs, config, mem, options)
    try:
        driver = Driver(model, transport, kern, n_features=n_features, algorithm=algorithm,
                        bounds=bounds, chains=chains, seed=seed,
                        q_db=options.get("q_db", "auto"), n_rows=n_rows,
                        **{k: options[k] for k in _DRIVER_OPTIONS if k in options})
        info = {"algorithm": algorithm, "bounds": bounds if algorithm == "flymc" else None,
                "kernel": kernel, "z_update": z_update if algorithm == "flymc" else None,
                "resample_fraction": config.resample_fraction,
                "chains": chains, "seed": seed, "n_rows": n_rows, "n_features": n_features,
                "n_shards": len(specs), "transport": transport.name,
                "n_workers": transport.n_workers, "data": path, "model": model.to_dict(),
                "num_warmup": num_warmup, "num_samples": num_samples}
        return _run(driver, transport, info, num_warmup, num_samples, options)
    finally:
        transport.close()


def _run(driver: Driver, transport: Any, info: dict[str, Any], num_warmup: int,
         num_samples: int, options: dict[str, Any]) -> Result:
    C, P = driver.chains, driver.P
    shape = driver.param_shape
    trace = None
    start = 0
    trace_path = options.get("trace")
    checkpoint_every = int(options.get("checkpoint_every", 100))
    if trace_path is not None:
        from flymc_dist.trace import Trace

        if options.get("resume"):
            trace = Trace.open(trace_path)
            ck = trace.checkpoint
            if ck is None:
                raise ValueError(f"trace {trace_path} has no checkpoint to resume from")
            start = int(ck["iteration"]) + 1
    driver.setup()
    info["q_db"] = driver.q_db if info["algorithm"] == "flymc" else None
    info["map"] = None if driver.theta_map is None else driver.theta_map.reshape(shape)
    info["map_info"] = driver.map_info
    info["setup_queries"] = driver.setup_queries
    info["setup_seconds"] = driver.setup_seconds
    if trace_path is not None and trace is None:
        from flymc_dist.trace import Trace

        attrs = {k: v for k, v in info.items() if k not in ("map",)}
        trace = Trace.create(trace_path, chains=C, param_shape=shape,
                             stats={k: np.dtype(v) for k, v in STAT_NAMES.items()},
                             attrs=attrs, overwrite=bool(options.get("overwrite_trace", False)))
    if start:
        ck = trace.checkpoint
        driver.positions = np.asarray(ck["positions"], float)
        kp = type(driver.params[0])
        driver.params = [kp(**{k: (np.asarray(v) if isinstance(v, list) else v)
                               for k, v in p.items()}) for p in ck["params"]]
        for r, s in zip(driver.rngs, ck["rng_states"], strict=True):
            r.bit_generator.state = rng_state_from_json(s)
        driver.seq = int(ck.get("seq", 0)) + 1_000_000
        # a fresh exact draw of z at the resumed positions: a valid Gibbs step
        transport.call("set_positions", driver.positions, 1)
    total = num_warmup + num_samples
    n_keep = num_samples
    samples = np.empty((C, n_keep, P))
    wsamples = np.empty((C, num_warmup, P))
    stats = {k: np.zeros((C, n_keep), dtype=v) for k, v in STAT_NAMES.items()}
    wstats = {k: np.zeros((C, num_warmup), dtype=v) for k, v in STAT_NAMES.items()}
    if start and trace is not None:
        prev_w, prev = trace.warmup_samples, trace.samples
        wsamples[:, :prev_w.shape[1]] = prev_w.reshape(C, -1, P)
        samples[:, :prev.shape[1]] = prev.reshape(C, -1, P)
        for k in STAT_NAMES:
            wstats[k][:, :prev_w.shape[1]] = trace.warmup_stats[k]
            stats[k][:, :prev.shape[1]] = trace.stats[k]
    progress = Progress(total, enabled=options.get("progress"), initial=start)
    buf: list[tuple[bool, np.ndarray, dict]] = []
    snap = _timing_snapshot(driver, transport) if num_warmup <= start else None
    t0 = time.perf_counter()
    t_warm_end = t0 if num_warmup <= start else None
    # wall seconds of warm-up and of sampling, over every segment of a resumed run (kept
    # in the trace's checkpoint, so that `flymc summary` can report seconds per iteration)
    before = dict((trace.checkpoint or {}).get("seconds", {})) if start else {}

    def seconds_so_far() -> dict[str, float]:
        now = time.perf_counter()
        end_w = t_warm_end if t_warm_end is not None else now
        return {"warmup": float(before.get("warmup", 0.0)) + end_w - t0,
                "sampling": float(before.get("sampling", 0.0))
                + (now - t_warm_end if t_warm_end is not None else 0.0)}

    try:
        for i, warm, pos, st in driver.iterations(num_warmup, num_samples, start=start):
            if warm:
                wsamples[:, i] = pos
                for k in STAT_NAMES:
                    wstats[k][:, i] = st[k]
            else:
                j = i - num_warmup
                samples[:, j] = pos
                for k in STAT_NAMES:
                    stats[k][:, j] = st[k]
            if i == num_warmup - 1:
                snap = _timing_snapshot(driver, transport)
                t_warm_end = time.perf_counter()
            progress.update(st)
            if trace is not None:
                buf.append((warm, pos, st))
                if len(buf) >= checkpoint_every or i == total - 1 or (
                        warm and i == num_warmup - 1):
                    _flush(trace, buf, shape)
                    trace.set_checkpoint({**driver.checkpoint(i), "seconds": seconds_so_far()})
                    buf = []
    finally:
        progress.close()
    t_end = time.perf_counter()
    info["sampling_seconds"] = t_end - (t_warm_end if t_warm_end is not None else t0)
    info["warmup_seconds"] = (t_warm_end - t0) if t_warm_end is not None else 0.0
    if snap is not None:
        info["timing"] = _timing_report(snap, _timing_snapshot(driver, transport),
                                        num_samples - max(start - num_warmup, 0))
    info["total_round_trips"] = int(transport.round_trips)
    info["speculate"] = bool(driver.speculate)
    info["channel"] = getattr(transport, "channel", "in-process")
    info["speculative_queries"] = int(driver.wasted_queries)
    info["recoveries"] = list(getattr(transport, "recoveries", []))
    info["kernel_params"] = [params_to_json(p) for p in driver.params]
    return Result(samples.reshape((C, n_keep) + shape), stats,
                  wsamples.reshape((C, num_warmup) + shape), wstats, info)


def _timing_snapshot(driver: Driver, transport: Any) -> dict[str, Any]:
    return {"step": driver.step_seconds, "round": driver.round_seconds,
            "hosts": transport.timing() if hasattr(transport, "timing") else []}


def _timing_report(a: dict[str, Any], b: dict[str, Any], iterations: int) -> dict[str, Any]:
    """Seconds per post-warm-up iteration: where the time of a step went.

    ``step`` (the driver's whole iteration) = ``round_trip`` (waiting on the transport:
    the round trips' communication plus the workers' ``host_round_wall``) + ``driver``
    (kernels, sums, bookkeeping). Per host: rounds served, wall and CPU seconds per
    round, and speculation's wall seconds per iteration (work done after replies).
    """
    n = max(int(iterations), 1)
    hosts = []
    if len(a["hosts"]) == len(b["hosts"]):
        for ha, hb in zip(a["hosts"], b["hosts"], strict=True):
            rounds = hb["rounds"] - ha["rounds"]
            per = max(rounds, 1)
            hosts.append({"rounds": int(rounds),
                          "round_wall": (hb["round_wall"] - ha["round_wall"]) / per,
                          "round_cpu": (hb["round_cpu"] - ha["round_cpu"]) / per,
                          "speculate_wall": (hb["speculate_wall"] - ha["speculate_wall"]) / n})
    step = (b["step"] - a["step"]) / n
    rt = (b["round"] - a["round"]) / n
    return {"iterations": n, "step": step, "round_trip": rt, "driver": step - rt,
            "hosts": hosts}


def _flush(trace: Any, buf: list[tuple[bool, np.ndarray, dict]], shape: tuple[int, ...]) -> None:
    for warm in (True, False):
        part = [b for b in buf if b[0] == warm]
        if not part:
            continue
        C = part[0][1].shape[0]
        s = np.stack([b[1] for b in part], axis=1).reshape((C, len(part)) + shape)
        st = {k: np.stack([b[2][k] for b in part], axis=1) for k in STAT_NAMES}
        trace.append(s, st, warmup=warm)
