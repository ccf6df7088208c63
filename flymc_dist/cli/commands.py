"""``flymc make-data``, ``ingest``, ``run``, ``summary`` and ``predict``."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from typing import Any

import numpy as np
import zarr

import flymc_dist as fd
from flymc_dist import data, diagnostics
from flymc_dist._paths import is_url, local_path
from flymc_dist._unreachable import unreachable
from flymc_dist.api import kept_trace
from flymc_dist.call import default_kernel
from flymc_dist.cli.common import (
    CLIError,
    fmt,
    percent,
    progress_from,
    say,
    storage_options_from,
    url_options,
)
from flymc_dist.cli.flags import flag_of, kernel_from_args, options_from_args
from flymc_dist.data import TASKS, Dataset, ingest, open_dataset
from flymc_dist.models import make_model
from flymc_dist.result import Result, efficiency, narrowing_line, param_labels
from flymc_dist.trace import Trace, probe

# --------------------------------------------------------------------------- make-data, ingest


def _describe(ds: Any) -> str:
    task = ds.task + (f", {ds.n_classes} classes" if ds.task == "multiclass" else "")
    return (
        f"{ds.path}: {ds.n_rows:,} rows × {ds.n_features} features, task {task}, "
        f"{ds.n_chunks} chunk(s) of {ds.chunk_rows:,} rows, {ds.dtype.name}"
    )


def cmd_make_data(args: argparse.Namespace) -> int:
    like = args.like
    rows, features = args.rows, args.features
    if like == "opv":
        rows = 1_800_000 if rows is None else rows
        features = 57 if features is None else features
    for opt, value in (("--rows", rows), ("--features", features)):
        if value is None:
            raise CLIError(f"{opt} is required for --like {like}")
    if like == "softmax" and args.classes is None:
        raise CLIError("--classes is required for --like softmax")
    if like != "softmax" and args.classes is not None:
        raise CLIError("--classes applies only to --like softmax")
    noise = {k: v for k, v in (("nu", args.nu), ("noise_scale", args.noise_scale)) if v is not None}
    if noise and like not in ("robust", "opv"):
        raise CLIError("--nu and --noise-scale apply only to --like robust or opv")
    common = {
        "seed": args.seed,
        "chunk_rows": args.chunk_rows,
        "dtype": args.dtype,
        "overwrite": args.overwrite,
        "storage_options": storage_options_from(args, args.out),
    }
    t = time.perf_counter()
    if like == "logistic":
        ds = data.make_logistic(args.out, rows, features, **common)
    elif like == "softmax":
        ds = data.make_softmax(args.out, rows, features, args.classes, **common)
    elif like == "robust":
        ds = data.make_robust(args.out, rows, features, **common, **noise)
    else:
        ds = data.make_opv_like(args.out, rows, features, **common, **noise)
    say(f"wrote {_describe(ds)} ({time.perf_counter() - t:.1f} s)")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    target: int | str | None = args.target
    if target is not None and args.src.lower().endswith(".npy"):
        try:
            target = int(target)
        except ValueError:
            raise CLIError(
                f"--target for a .npy file must be a column index, got {args.target!r}"
            ) from None
    t = time.perf_counter()
    opts = storage_options_from(args, args.out, args.src)
    client = None
    if args.scheduler is not None:
        if "://" not in args.scheduler:
            raise CLIError(
                f"--scheduler must be an address like tcp://host:8786, got {args.scheduler!r}"
            )
        from distributed import Client

        client = Client(args.scheduler)
    try:
        ds = ingest(
            args.src,
            args.out,
            target=target,
            categorical=args.categorical,
            standardize=args.standardize,
            task=args.task if args.task in (None, *TASKS) else task_of_model(args.task),
            n_classes=args.classes,
            chunk_rows=args.chunk_rows,
            dtype=args.dtype,
            overwrite=args.overwrite,
            storage_options=opts if is_url(args.out) else None,
            source_options=opts if is_url(args.src) else None,
            header=args.header,
            client=client,
        )
    finally:
        if client is not None:
            client.close()
    say(f"wrote {_describe(ds)} ({time.perf_counter() - t:.1f} s)")
    return 0


# --------------------------------------------------------------------------- run, summary


def _efficiency_lines(eff: dict[str, float], r_hat_max: float, chains: int) -> list[str]:
    secs = eff.get("seconds_per_iteration", float("nan"))
    lines = [
        f"ESS bulk min / mean      {fmt(eff['ess_min'], '.0f')} / {fmt(eff['ess_mean'], '.0f')}",
        f"R̂ max                    {fmt(r_hat_max, '.3f')}",
        f"acceptance               {fmt(eff['acceptance'], '.3f')}",
        f"bright fraction          {percent(eff['bright_fraction'])}",
        f"likelihood queries       {eff['queries_per_iteration'] * chains:,.0f} per iteration "
        f"(all {chains} chains)",
        f"round trips              {fmt(eff['round_trips_per_iteration'], '.2f')} per iteration",
    ]
    if math.isfinite(secs):
        lines.append(f"seconds per iteration    {secs:.4g}")
        lines.append(f"ESS per second           {fmt(eff['ess_per_second'])}")
    lines.append(f"ESS per million queries  {fmt(1e6 * eff['ess_per_query'])}")
    return lines


def _algorithm(args: argparse.Namespace) -> Any:
    """The algorithm object of ``--algorithm`` with its flags; the flags of another
    algorithm are refused."""
    groups = {"flymc": fd.FlyMC, "austerity": fd.Austerity}
    made: Any = fd.Regular()
    for name, cls in groups.items():
        given = options_from_args(args, cls)
        if name == args.algorithm:
            made = cls(**given)
        elif given:
            flags = ", ".join(flag_of(k) for k in given)
            raise CLIError(f"{flags} applies only to --algorithm {name}")
    return made


#: ``--model``'s names: the three models' and the GLM families' (``student_t`` is the
#: Student-t family's name for ``robust``)
MODEL_NAMES = (
    "logistic",
    "softmax",
    "robust",
    "student_t",
    "probit",
    "binomial",
    "negative_binomial",
    "gaussian",
)


def _model_of(name: str, kwargs: dict[str, Any]) -> Any:
    """The model ``--model name`` means, built with ``kwargs``."""
    if name == "student_t":
        name = "robust"
    if name in ("logistic", "softmax", "robust"):
        return make_model(name, **kwargs)
    if name == "probit":
        kwargs = {**kwargs, "link": "probit"}
    return make_model("glm", family="binomial" if name == "probit" else name, **kwargs)


def task_of_model(name: str) -> str:
    """The data task of ``--model name`` with its default parameters (``ingest --task``
    takes a model name for it): e.g. ``"count"`` for ``negative_binomial``, ``"binary"``
    for ``binomial`` (one trial; ``--task count`` for more)."""
    return _model_of(name, {"n_classes": 2} if name == "softmax" else {}).task


def _build_model(args: argparse.Namespace, ds: Any) -> Any:
    kwargs: dict[str, Any] = {}
    if args.bound is not None:
        if args.model != "softmax":
            raise CLIError("--bound applies only to --model softmax")
        kwargs["bound"] = args.bound
    if args.model == "softmax":
        k = args.classes if args.classes is not None else ds.n_classes
        if k is None:
            raise CLIError("--classes is required: the data set has no class count")
        kwargs["n_classes"] = int(k)
    elif args.classes is not None:
        raise CLIError("--classes applies only to --model softmax")
    if args.model in ("robust", "student_t"):
        if args.nu is not None:
            kwargs["nu"] = args.nu
    elif args.nu is not None:
        raise CLIError("--nu applies only to --model robust (student_t)")
    if args.scale is not None:
        if args.model not in ("robust", "student_t", "gaussian"):
            raise CLIError("--scale applies only to --model robust (student_t) or gaussian")
        kwargs["scale"] = args.scale
    for flag, value, models in (
        ("--trials", args.trials, ("binomial", "probit")),
        ("--link", args.link, ("binomial",)),
        ("--dispersion", args.dispersion, ("negative_binomial",)),
    ):
        if value is not None:
            if args.model not in models:
                raise CLIError(f"{flag} applies only to --model {' or '.join(models)}")
            kwargs[flag[2:]] = value
    if args.prior is not None:
        kwargs["prior"] = args.prior
    if args.prior_scale is not None:
        kwargs["prior_scale"] = args.prior_scale
    return _model_of(args.model, kwargs)


def _client(args: argparse.Namespace) -> Any:
    if args.synchronous:
        return "synchronous"
    if args.scheduler is not None:
        if "://" not in args.scheduler:
            raise CLIError(
                f"--scheduler must be an address like tcp://host:8786, got {args.scheduler!r}"
            )
        return args.scheduler
    if args.scheduler_file is not None:
        if not os.path.isfile(args.scheduler_file):
            raise CLIError(f"scheduler file {args.scheduler_file!r} not found")
        return args.scheduler_file
    return None


def resume_hint(err: BaseException) -> None:
    """After a failed run that kept its trace: one line saying how to continue it."""
    kept = kept_trace(err)
    if kept is not None:
        when = " once its store can be reached again" if unreachable(err) else ""
        sys.stderr.write(
            f"flymc: {kept[0]} keeps {kept[1]:,} iterations (to its last "
            f"checkpoint): continue with the same command and --resume{when}\n"
        )
        sys.stderr.flush()


def cmd_run(args: argparse.Namespace) -> int:
    so = storage_options_from(args, args.store, args.trace)
    ds = fd.open_dataset(args.store, storage_options=url_options(args.store, so))
    model = _build_model(args, ds)
    client = _client(args)
    trace_so = url_options(args.trace, so)
    if is_url(args.trace):
        trace_path = args.trace
        existed = probe(trace_path, trace_so) != "missing"
    else:
        trace_path = os.path.abspath(os.path.expanduser(local_path(args.trace)))
        existed = os.path.exists(trace_path) and (
            not os.path.isdir(trace_path) or bool(os.listdir(trace_path))
        )
    # a resume must match the trace's model, data set and settings: fd.sample checks
    # (and the trace's lock keeps a second run off it); a failed run keeps a trace that
    # has a checkpoint and removes only one it created itself (see flymc_dist.api)
    if args.resume:
        if not existed:
            raise CLIError(f"--resume: no trace at {args.trace!r}")
    elif existed:
        if not args.overwrite:
            raise CLIError(
                f"{args.trace!r} already exists (use --overwrite to replace it, or "
                f"--resume to continue it)"
            )
        try:
            Trace.open(trace_path, read_only=True, storage_options=trace_so)
        except (ValueError, OSError):
            raise CLIError(
                f"{args.trace!r} exists and is not a flymc trace; refusing to overwrite it"
            ) from None
    algorithm = _algorithm(args)
    placement = fd.Placement(**options_from_args(args, fd.Placement))
    if placement.n_workers is not None and client is not None:
        raise CLIError(
            "--workers applies only to the embedded LocalCluster (not with "
            "--scheduler, --scheduler-file or --synchronous)"
        )
    kernel = kernel_from_args(args, default_kernel(args.kernel, args.algorithm))
    t = time.perf_counter()
    res = fd.sample(
        model,
        ds,
        algorithm,
        kernel,
        num_warmup=args.warmup,
        num_samples=args.samples,
        chains=args.chains,
        seed=args.seed,
        client=client,
        placement=placement,
        precondition=args.precondition,
        map_maxiter=args.map_maxiter,
        trace=trace_path,
        resume=args.resume,
        overwrite_trace=args.overwrite,
        checkpoint_every=args.checkpoint_every,
        trace_storage_options=trace_so,
        progress=progress_from(args),
    )
    seconds = time.perf_counter() - t
    C, S = res.samples.shape[:2]
    label = {
        "flymc": f"FlyMC ({res.info['bounds']} bounds, {res.info['z_update']} z-update)",
        "regular": "regular MCMC (full data)",
        "austerity": "austerity MH (APPROXIMATE)",
    }[args.algorithm]
    kernel = default_kernel(args.kernel, args.algorithm)
    say(
        f"{label}, {kernel}, {model!r}: {C} chains × {S} draws "
        f"(+{args.warmup} warm-up) in {seconds:.1f} s → {args.trace}"
    )
    say(str(res.summary()))  # rows named by the data set's columns, NUTS/HMC warnings
    say("")
    r_hat = diagnostics.rhat(res.samples.reshape(C, S, -1))
    eff = res.efficiency()
    if args.resume:  # the time of this session only covers the resumed part
        eff["seconds_per_iteration"] = float("nan")
    for line in _efficiency_lines(eff, float(np.nanmax(r_hat)), C):
        say(line)
    line = narrowing_line(res.info, eff["ess_min_per_draw"])
    if line is not None:
        say(line)
    return 0


def _trace_efficiency(trace: Any, stats: dict[str, np.ndarray]) -> dict[str, float]:
    """:func:`flymc_dist.result.efficiency` of a trace's post-warm-up draws (the wall seconds
    of its sampling iterations are kept with the checkpoint)."""
    secs = (trace.checkpoint or {}).get("seconds", {}).get("sampling")
    return efficiency(trace.samples, stats, trace.attrs.get("n_rows"), secs)


def cmd_summary(args: argparse.Namespace) -> int:
    so = storage_options_from(args)  # for the trace and for its data set (for the names)
    trace = Trace.open(args.trace, read_only=True, storage_options=url_options(args.trace, so))
    attrs = trace.attrs
    data_path = attrs.get("data")
    if so and not is_url(args.trace) and not is_url(data_path):
        raise CLIError(
            "--storage-option applies only to fsspec URLs (s3://…), and neither the "
            "trace nor its data set is at one"
        )
    C, S = trace.chains, trace.n_draws
    total = attrs.get("num_warmup", 0) + attrs.get("num_samples", 0)
    done = trace.n_warmup_draws + S
    head = (
        f"{args.trace}: {attrs.get('algorithm', '?')}"
        f"{' (' + str(attrs['bounds']) + ' bounds)' if attrs.get('bounds') else ''}, "
        f"kernel {attrs.get('kernel', '?')}, model {attrs.get('model', {}).get('name', '?')}"
        f", {C} chains × {S} draws (+{trace.n_warmup_draws} warm-up)"
    )
    say(head)
    if total and done < total:
        say(
            f"incomplete: {done} of {total} iterations recorded (continue with flymc run … "
            f"--resume)"
        )
    if attrs.get("algorithm") == "austerity":
        say("APPROXIMATE (austerity MH): draws do not target the exact posterior.")
    if S < 4:
        raise CLIError(
            f"{args.trace!r} holds {S} post-warm-up draws per chain; a summary needs at least 4"
        )
    names = attrs.get("feature_names")  # kept with the trace since it has them
    # older traces: from the data set (one at a URL only with options given, else it
    # could be a long wait)
    if names is None and (
        isinstance(data_path, str) and (os.path.isdir(data_path) or (is_url(data_path) and so))
    ):
        with contextlib.suppress(Exception):
            names = open_dataset(
                data_path, storage_options=url_options(data_path, so)
            ).feature_names
    table = diagnostics.summary(trace.samples, names=param_labels(trace.param_shape, names))
    say(diagnostics.format_summary(table, max_rows=args.max_rows))
    stats = trace.stats
    for line in diagnostics.hamiltonian_lines(
        diagnostics.hamiltonian_checks(stats, attrs.get("max_tree_depth"), attrs.get("algorithm"))
    ):
        say(line)
    say("")
    eff = _trace_efficiency(trace, stats)
    for line in _efficiency_lines(eff, float(np.nanmax(table["r_hat"])), C):
        say(line)
    line = narrowing_line(attrs, eff["ess_min_per_draw"])  # kept with the trace's set-up
    if line is not None:
        say(line)
    return 0


# --------------------------------------------------------------------------- predict


def cmd_predict(args: argparse.Namespace) -> int:
    so = storage_options_from(args)
    trace = Trace.open(args.trace, read_only=True, storage_options=url_options(args.trace, so))
    info = dict(trace.attrs)
    samples = trace.samples
    if samples.shape[1] == 0:
        raise CLIError(f"{args.trace!r} holds no post-warm-up draws to predict with")
    res = Result(samples, {}, samples[:, :0], {}, info)
    if os.path.exists(args.out):
        raise CLIError(f"{args.out!r} already exists")
    t = time.perf_counter()
    new = args.new
    low = new.lower().rstrip("/")
    if low.endswith((".csv", ".parquet", ".pq")):
        import pandas as pd

        frame = pd.read_csv(new) if low.endswith(".csv") else pd.read_parquet(new)
        design = res.design()
        target = None if design is None else design.target
        out = res.predict(
            frame.drop(columns=[c for c in [target] if c in frame]), interval=args.interval
        )
        group = zarr.open_group(args.out, mode="w-")
        for key, value in out.items():
            group.create_array(key, data=np.asarray(value))
        n = len(frame)
    else:
        ds: Dataset = open_dataset(new, storage_options=url_options(new, so))
        client = None
        if args.scheduler is not None:
            from distributed import Client

            client = Client(args.scheduler)
        try:
            res.predict(ds, out=args.out, client=client, interval=args.interval)
        finally:
            if client is not None:
                client.close()
        n = ds.n_rows
    say(f"wrote predictions for {n:,} rows to {args.out} ({time.perf_counter() - t:.1f} s)")
    return 0
