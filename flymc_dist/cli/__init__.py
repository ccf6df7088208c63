"""The ``flymc`` command line.

Subcommands::

    flymc demo                       FlyMC vs regular MCMC on ~1M synthetic rows
    flymc make-data OUT --like …     write a synthetic data set (zarr)
    flymc ingest SRC OUT             .npy / .npz / .csv → a validated zarr data set
    flymc run STORE --model … --trace OUT.zarr
                                     sample; draws + stats go to a resumable zarr trace
    flymc summary TRACE              the posterior table and efficiency of a trace
    flymc bench overhead|sublinear|mixing|scale   benchmarks

Bad input (a missing file, NaN in the data, an unknown model or option, …) ends with
exit status 2 and one line ``flymc: error: <reason>`` on stderr, and writes nothing.
An unexpected internal failure ends with status 1 (set ``FLYMC_DEBUG=1`` for the
traceback); an interrupt with 130; output cut short by its reader (``| head``) with 141,
quietly. A run that fails after its first checkpoint keeps its trace and says, in one
more line, how to continue it with ``--resume``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

import flymc_dist as fd
from flymc_dist import __version__, data, diagnostics
from flymc_dist.api import kept_trace
from flymc_dist.bench.common import local_client
from flymc_dist.bench.overhead import format_overhead, run_overhead
from flymc_dist.data import ingest, make_logistic, open_dataset
from flymc_dist.models import make_model
from flymc_dist.result import efficiency
from flymc_dist.trace import Trace, _probe

__all__ = ["CLIError", "build_parser", "main"]

#: Exit status for bad input or usage.
EXIT_USAGE = 2
#: Exit status for an unexpected internal failure.
EXIT_FAILURE = 1
#: Exit status after Ctrl-C.
EXIT_INTERRUPT = 130
#: Exit status when stdout's reader went away (as a process killed by SIGPIPE).
EXIT_BROKEN_PIPE = 141

_DEMO_ROWS = 200_000
_DEMO_FEATURES = 10
_DEMO_SAMPLES = 1500
#: regular MCMC's draws: each NUTS iteration of it is tens of full passes over the data
_DEMO_REGULAR_SAMPLES = 60
#: the demo's θ-kernel: NUTS on the driver's replica of the bright rows
_DEMO_KERNEL = "nuts"
#: the θ-kernels (flymc_dist.kernels.KERNELS; named here to keep the CLI's start light)
_KERNELS = ("rwmh", "mala", "slice", "hmc", "nuts")


class CLIError(Exception):
    """Bad input or usage: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors become :class:`CLIError` (one line, no usage dump)."""

    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{message} (see '{self.prog} --help')")


# --------------------------------------------------------------------------- small helpers


def _say(text: str = "") -> None:
    print(text, flush=True)


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _error(text: str) -> None:
    sys.stderr.write(f"flymc: error: {_one_line(text)}\n")
    sys.stderr.flush()


def _int_at_least(lo: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``lo``, else "expected <what>, got '<text>'"."""

    def parse(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = f"int >= {lo}"
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonnegative_int = _int_at_least(0, "an integer >= 0")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}")
    return value


#: storage dtypes of X for make-data and ingest
_DTYPES = ("float64", "float32")
_DTYPE_HELP = (
    "storage dtype of X (default float64; float32 halves the bytes, values rounded once "
    "when written; all arithmetic stays float64)"
)


def _q_db(text: str) -> str | float:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or a number in (0, 1], got {text!r}"
        ) from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number in (0, 1], got {text!r}")
    return value


def _storage_option(text: str) -> tuple[str, Any]:
    """An argparse type: ``KEY=VALUE``, the value parsed as JSON where it can be, else a str."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


_STORAGE_HELP = (
    "an fsspec storage option for URL paths (s3://…), e.g. endpoint_url=http://… "
    "or key=…; repeatable; the value is read as JSON where it can be (quote a "
    "string that looks like a number: secret='\"123\"'), else as a string"
)


def _storage_options(args: argparse.Namespace, *paths: str) -> dict[str, Any] | None:
    """The ``--storage-option`` pairs as a dict (None if none); they need a URL among ``paths``
    (when any are given)."""
    pairs = getattr(args, "storage_option", None) or []
    if not pairs:
        return None
    if paths and not any("://" in p for p in paths):
        raise CLIError(
            "--storage-option applies only to fsspec URLs (s3://…), and no path here is one"
        )
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CLIError(f"--storage-option {key} given twice")
        out[key] = value
    return out


def _url_options(path: str, options: dict[str, Any] | None) -> dict[str, Any] | None:
    """``options`` for a URL ``path``, None for a local one."""
    return options if "://" in path else None


def _progress(args: argparse.Namespace) -> bool | None:
    """``False`` with ``--no-progress``; else None (on for a terminal, off under ``CI``)."""
    return False if getattr(args, "no_progress", False) else None


def _fmt(x: float, spec: str = ".3g") -> str:
    return format(x, spec) if x is not None and math.isfinite(x) else "n/a"


def _percent(x: float) -> str:
    if not math.isfinite(x):
        return "n/a"
    return f"{100 * x:.3g}%"


# --------------------------------------------------------------------------- the parser


def build_parser() -> argparse.ArgumentParser:
    """The ``flymc`` argument parser (all subcommands).

    Returns
    -------
    argparse.ArgumentParser
        Its errors raise :class:`CLIError` instead of exiting.
    """
    parser = _Parser(
        prog="flymc",
        description="Exact Bayesian inference for tall data on "
        "Dask: Firefly Monte Carlo, regular MCMC and (approximate) austerity MH.",
    )
    parser.add_argument("--version", action="version", version=f"flymc_dist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    # ---- demo
    p = sub.add_parser(
        "demo",
        help="FlyMC vs regular MCMC on ~1M synthetic logistic rows",
        description="Generate a synthetic logistic data set (~1M rows) in a "
        "temporary zarr store, sample it with MAP-tuned FlyMC and with regular "
        "MCMC (RWMH, 4 chains) on an embedded LocalCluster, and compare.",
    )
    p.add_argument(
        "--rows", type=_positive_int, default=_DEMO_ROWS, help=f"rows N (default {_DEMO_ROWS:,})"
    )
    p.add_argument(
        "--features",
        type=_positive_int,
        default=_DEMO_FEATURES,
        help=f"features D including the bias column (default {_DEMO_FEATURES})",
    )
    p.add_argument(
        "--samples",
        type=_positive_int,
        default=_DEMO_SAMPLES,
        help=f"FlyMC draws per chain after warm-up (default {_DEMO_SAMPLES})",
    )
    p.add_argument(
        "--warmup",
        type=_nonnegative_int,
        default=None,
        help="FlyMC warm-up iterations (default: samples / 4)",
    )
    p.add_argument(
        "--regular-samples",
        type=_positive_int,
        default=None,
        help=f"regular MCMC draws per chain (default {_DEMO_REGULAR_SAMPLES}; "
        "each evaluation is a full pass over the data)",
    )
    p.add_argument("--chains", type=_positive_int, default=4, help="chains (default 4)")
    p.add_argument(
        "--kernel",
        choices=_KERNELS,
        default=_DEMO_KERNEL,
        help=f"θ-kernel of both samplers (default {_DEMO_KERNEL})",
    )
    p.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        help="workers of the embedded LocalCluster (default: the machine's cores, at most 8)",
    )
    p.add_argument(
        "--synchronous",
        action="store_true",
        help="run in this process instead of on a LocalCluster",
    )
    p.add_argument("--seed", type=_nonnegative_int, default=0, help="seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    p.set_defaults(func=_cmd_demo)

    # ---- make-data
    p = sub.add_parser(
        "make-data",
        help="write a synthetic data set",
        description="Write a synthetic data set as a flymc_dist zarr store.",
    )
    p.add_argument("out", metavar="OUT", help="the store to create (a directory)")
    p.add_argument(
        "--like",
        choices=("logistic", "softmax", "robust", "opv"),
        default="logistic",
        help="generator (default logistic)",
    )
    p.add_argument(
        "--rows",
        type=_positive_int,
        default=None,
        help="rows N (required, except for --like opv: 1,800,000)",
    )
    p.add_argument(
        "--features",
        type=_positive_int,
        default=None,
        help="features D including the bias (required, except for --like opv: 57)",
    )
    p.add_argument(
        "--classes",
        type=_positive_int,
        default=None,
        help="classes K (--like softmax only, required there)",
    )
    p.add_argument(
        "--nu",
        type=_positive_float,
        default=None,
        help="Student-t degrees of freedom of the noise (robust/opv; default 4)",
    )
    p.add_argument(
        "--noise-scale",
        type=_positive_float,
        default=None,
        help="noise scale (robust/opv; default 1)",
    )
    p.add_argument("--seed", type=_nonnegative_int, default=0, help="seed (default 0)")
    p.add_argument(
        "--chunk-rows",
        type=_positive_int,
        default=None,
        help="rows per zarr chunk (default ~8 MiB chunks)",
    )
    p.add_argument("--dtype", choices=_DTYPES, default="float64", help=_DTYPE_HELP)
    p.add_argument("--overwrite", action="store_true", help="replace an existing store")
    p.add_argument(
        "--storage-option",
        type=_storage_option,
        action="append",
        metavar="KEY=VALUE",
        help=_STORAGE_HELP,
    )
    p.set_defaults(func=_cmd_make_data)

    # ---- ingest
    p = sub.add_parser(
        "ingest",
        help="convert .npy/.npz/.csv into a zarr data set",
        description="Validate a .npy (2-D, target column last unless --target), "
        ".npz (arrays X and y) or .csv (header row; target column last unless "
        "--target; a first line of numbers only is read as data, not as a "
        "header) file and write it as a flymc_dist zarr store. Nothing is "
        "written if the data are invalid (NaN/inf, bad labels, wrong shapes).",
    )
    p.add_argument("src", metavar="SRC", help="the .npy, .npz or .csv file")
    p.add_argument("out", metavar="OUT", help="the store to create (a directory)")
    p.add_argument(
        "--target",
        default=None,
        help="the target column: an index for .npy, a header name for .csv "
        "(an index for a .csv without a header row)",
    )
    p.add_argument(
        "--task",
        choices=("binary", "multiclass", "real"),
        default=None,
        help="the task (default: inferred from the target)",
    )
    p.add_argument(
        "--classes", type=_positive_int, default=None, help="number of classes (multiclass)"
    )
    p.add_argument("--chunk-rows", type=_positive_int, default=None, help="rows per chunk")
    p.add_argument("--dtype", choices=_DTYPES, default="float64", help=_DTYPE_HELP)
    p.add_argument("--overwrite", action="store_true", help="replace an existing store")
    p.add_argument(
        "--storage-option",
        type=_storage_option,
        action="append",
        metavar="KEY=VALUE",
        help=_STORAGE_HELP,
    )
    p.set_defaults(func=_cmd_ingest)

    # ---- run
    p = sub.add_parser(
        "run",
        help="sample a posterior into a zarr trace",
        description="Sample the posterior of a model given a data set; draws "
        "and per-iteration statistics are written incrementally to a "
        "resumable zarr trace, and the summary is printed.",
    )
    p.add_argument("store", metavar="STORE", help="a flymc_dist data set (zarr store)")
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, choices=("logistic", "softmax", "robust"))
    g.add_argument(
        "--classes",
        type=_positive_int,
        default=None,
        help="softmax classes K (default: the data set's)",
    )
    g.add_argument(
        "--nu",
        type=_positive_float,
        default=None,
        help="robust: Student-t degrees of freedom (default 4)",
    )
    g.add_argument(
        "--scale", type=_positive_float, default=None, help="robust: Student-t scale (default 1)"
    )
    g.add_argument(
        "--prior",
        choices=("normal", "laplace", "flat"),
        default=None,
        help="prior (default: normal; laplace for robust)",
    )
    g.add_argument(
        "--prior-scale", type=_positive_float, default=None, help="prior scale (default 1)"
    )
    g = p.add_argument_group("sampler")
    g.add_argument(
        "--algorithm",
        choices=("flymc", "regular", "austerity"),
        default="flymc",
        help="flymc (exact, default), regular (exact, full data) or austerity (approximate)",
    )
    g.add_argument(
        "--bounds", choices=("map", "untuned"), default="map", help="FlyMC bounds (default map)"
    )
    g.add_argument("--kernel", choices=_KERNELS, default="rwmh", help="theta kernel (default rwmh)")
    g.add_argument(
        "--z-update",
        choices=("implicit", "explicit"),
        default="implicit",
        help="FlyMC z-update (default implicit)",
    )
    g.add_argument(
        "--q-db",
        type=_q_db,
        default=None,
        help="implicit z-update: dark→bright proposal probability, or 'auto' "
        "(the library's default)",
    )
    g.add_argument(
        "--resample-fraction",
        type=_positive_float,
        default=None,
        help="explicit z-update: fraction of z resampled per iteration",
    )
    g.add_argument("--eps", type=_positive_float, default=None, help="austerity: t-test tolerance")
    g.add_argument(
        "--batch-size", type=_positive_int, default=None, help="austerity: rows per minibatch"
    )
    g.add_argument(
        "--no-control-variates",
        action="store_true",
        help="austerity: plain sequential test on the log-likelihood differences "
        "(default: on their gap to the MAP-tuned bounds)",
    )
    g.add_argument(
        "--warmup",
        type=_nonnegative_int,
        default=500,
        help="warm-up iterations, discarded (default 500)",
    )
    g.add_argument(
        "--samples",
        type=_positive_int,
        default=1000,
        help="draws per chain after warm-up (default 1000)",
    )
    g.add_argument("--chains", type=_positive_int, default=4, help="chains (default 4)")
    g.add_argument("--seed", type=_nonnegative_int, default=0, help="seed (default 0)")
    g = p.add_argument_group("where it runs (default: an embedded LocalCluster)")
    where = g.add_mutually_exclusive_group()
    where.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        default=None,
        help="a Dask scheduler address (tcp://… or tls://…)",
    )
    where.add_argument(
        "--scheduler-file", metavar="FILE", default=None, help="a Dask scheduler file"
    )
    where.add_argument(
        "--synchronous", action="store_true", help="run every shard in this process (no Dask)"
    )
    g.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        help="workers of the embedded LocalCluster (default: cores, at most 8)",
    )
    g.add_argument(
        "--n-shards",
        type=_positive_int,
        default=None,
        help="shards (whole zarr chunks each; default: about 262,144 rows per "
        "shard); at least the number of workers keeps every worker busy",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--trace",
        metavar="OUT.zarr",
        required=True,
        help="the zarr trace to write (draws, stats, checkpoints)",
    )
    mode = g.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        action="store_true",
        help="continue the run recorded in --trace from its last checkpoint",
    )
    mode.add_argument("--overwrite", action="store_true", help="replace an existing trace")
    g.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        default=None,
        help="iterations between trace flushes / checkpoints (default 100)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress line")
    g.add_argument(
        "--storage-option",
        type=_storage_option,
        action="append",
        metavar="KEY=VALUE",
        help=_STORAGE_HELP + "; used for STORE and --trace when they are URLs",
    )
    p.set_defaults(func=_cmd_run)

    # ---- summary
    p = sub.add_parser(
        "summary",
        help="summarise a trace",
        description="Print the posterior summary table and the efficiency "
        "figures of a trace written by 'flymc run'.",
    )
    p.add_argument("trace", metavar="TRACE", help="the zarr trace")
    p.add_argument(
        "--max-rows", type=_positive_int, default=50, help="parameters shown (default 50)"
    )
    p.add_argument(
        "--storage-option",
        type=_storage_option,
        action="append",
        metavar="KEY=VALUE",
        help=_STORAGE_HELP,
    )
    p.set_defaults(func=_cmd_summary)

    # ---- bench
    p = sub.add_parser(
        "bench",
        help="benchmarks (overhead, sublinear, mixing, scale)",
        description="Benchmarks: 'overhead' (FlyMC per iteration against a bare "
        "round trip and regular MCMC), 'sublinear' (austerity MH's data use "
        "against N; see 'flymc bench sublinear --help'), 'mixing' "
        "(converged draws per second of the whole run, FlyMC against regular "
        "MCMC with NUTS; see 'flymc bench mixing --help') and 'scale' (FlyMC's cost "
        "per iteration, memory and mixing against N, in memory or out of core; see "
        "'flymc bench scale --help').",
    )
    bsub = p.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    b = bsub.add_parser("overhead", help="FlyMC vs bare round trip vs regular, per iteration")
    b.add_argument("--rows", type=_positive_int, default=2_000_000, help="rows (default 2,000,000)")
    b.add_argument(
        "--features", type=_positive_int, default=57, help="features incl. bias (default 57)"
    )
    b.add_argument("--workers", type=_positive_int, default=2, help="workers (default 2)")
    b.add_argument(
        "--iterations",
        type=_positive_int,
        default=1000,
        help="timed FlyMC iterations (default 1000)",
    )
    b.add_argument(
        "--regular-iterations",
        type=_positive_int,
        default=20,
        help="timed regular MCMC iterations (default 20)",
    )
    b.add_argument(
        "--warmup",
        type=_nonnegative_int,
        default=200,
        help="FlyMC warm-up iterations (default 200)",
    )
    b.add_argument("--chains", type=_positive_int, default=4, help="chains (default 4)")
    b.add_argument(
        "--pings", type=_positive_int, default=1000, help="bare round trips timed (default 1000)"
    )
    b.add_argument(
        "--default-sharding",
        choices=("flymc", "both", "none"),
        default="flymc",
        help="samplers timed again with the default (data-layout) sharding (default: flymc)",
    )
    b.add_argument("--seed", type=_nonnegative_int, default=0, help="seed (default 0)")
    b.add_argument("--json", metavar="FILE", default=None, help="also write the figures as JSON")
    b.set_defaults(func=_cmd_bench_overhead)
    # the options of these come from run_NAME's signature (see _cmd_bench_module)
    b = bsub.add_parser(
        "sublinear",
        add_help=False,
        help="austerity MH: data used per decision against N, bias against eps",
    )
    b.set_defaults(func=None)
    b = bsub.add_parser(
        "mixing",
        add_help=False,
        help="min-ESS per second of the whole run, FlyMC vs regular (NUTS)",
    )
    b.set_defaults(func=None)
    b = bsub.add_parser(
        "scale",
        add_help=False,
        help="FlyMC's cost per iteration, peak RSS and ESS against N (out of core)",
    )
    b.set_defaults(func=None)
    return parser


# --------------------------------------------------------------------------- demo


def _demo_table(rows: list[tuple[str, str, str]]) -> list[str]:
    w = max(len(r[0]) for r in rows)
    return [f"  {a:<{w}}  {b:>14}  {c:>14}" for a, b, c in rows]


def _agreement(a: Any, b: Any, names: list[str] | None = None) -> str:
    """One line comparing two posteriors' means, in posterior sd and in Monte Carlo error."""
    ta, tb = diagnostics.summary(a.samples), diagnostics.summary(b.samples)
    ma, mb = np.ravel(ta["mean"]), np.ravel(tb["mean"])
    sa, sb = np.ravel(ta["sd"]), np.ravel(tb["sd"])
    ea, eb = np.ravel(ta["ess_bulk"]), np.ravel(tb["ess_bulk"])
    sd = np.sqrt(0.5 * (sa**2 + sb**2))
    d = np.abs(ma - mb) / sd
    mcse = np.sqrt(sa**2 / ea + sb**2 / eb) / sd  # MC error of Δmean, in sd
    z = d / mcse
    if not (np.all(np.isfinite(d)) and np.all(np.isfinite(z))):
        return "agreement: not computable (a parameter has no finite ESS)"
    j = int(np.argmax(d))
    label = names[j] if names is not None and len(names) == d.size else f"parameter {j}"
    # a z above ~4 for any of a handful of parameters is not Monte Carlo noise
    verdict = "agree" if float(z.max()) < 4.0 else "DISAGREE"
    return (
        f"agreement: max |Δmean|/sd = {d[j]:.3f} ({label}; Monte Carlo error of "
        f"the difference ≈ {mcse[j]:.3f} sd, max z = {z.max():.2f} over {d.size} "
        f"parameters) — the posteriors {verdict}"
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    t_all = time.perf_counter()
    samples = args.samples
    warmup = args.warmup if args.warmup is not None else max(samples // 4, 20)
    reg_samples = args.regular_samples or _DEMO_REGULAR_SAMPLES
    if samples < 4 or reg_samples < 4:
        raise CLIError("--samples and --regular-samples must be at least 4 (for the ESS)")
    n, d, chains = args.rows, args.features, args.chains
    _say("flymc demo — Firefly Monte Carlo against regular MCMC, synthetic logistic regression")
    tmp = tempfile.mkdtemp(prefix="flymc-demo-")
    client = cluster = None
    try:
        t = time.perf_counter()
        ds = make_logistic(os.path.join(tmp, "demo.zarr"), n, d, seed=args.seed)
        _say(
            f"  data      {n:,} rows × {d} features (incl. bias) → temporary zarr store, "
            f"{ds.n_chunks} chunks ({time.perf_counter() - t:.1f} s)"
        )
        shards: dict[str, Any] = {}
        if args.synchronous:
            client = "synchronous"
            _say("  cluster   none: every shard in this process (--synchronous)")
        else:
            workers = args.workers or max(1, min(os.cpu_count() or 1, 8))
            t = time.perf_counter()
            client, cluster = local_client(workers)
            client.wait_for_workers(workers, timeout=120)
            # one shard per worker: one actor call per worker per iteration, the cheapest
            shards = {"n_shards": workers}
            _say(
                f"  cluster   embedded LocalCluster, {workers} workers × 1 thread, one shard "
                f"per worker ({time.perf_counter() - t:.1f} s to start)"
            )
        _say(
            f"  sampling  {args.kernel.upper()}, {chains} chains, Laplace-preconditioned, "
            f"started near the MAP: FlyMC {warmup} warm-up + {samples} draws; regular MCMC "
            f"{reg_samples} draws with FlyMC's tuned step size (each of its evaluations is a "
            f"full data pass)"
        )
        model = fd.LogisticRegression()
        common = {
            "kernel": args.kernel,
            "chains": chains,
            "seed": args.seed,
            "client": client,
            "progress": _progress(args),
            **shards,
        }
        t = time.perf_counter()
        fly = fd.sample(
            model,
            ds,
            algorithm="flymc",
            bounds="map",
            num_warmup=warmup,
            num_samples=samples,
            **common,
        )
        t_fly = time.perf_counter() - t
        # Both target the same posterior: regular MCMC reuses FlyMC's adapted step size and
        # skips warm-up (its chains start at MAP + Laplace jitter, close to a posterior draw).
        step = float(np.mean([p["step_size"] for p in fly.info["kernel_params"]]))
        t = time.perf_counter()
        reg = fd.sample(
            model,
            ds,
            algorithm="regular",
            num_warmup=0,
            num_samples=reg_samples,
            kernel_options={"step_size": step},
            **common,
        )
        t_reg = time.perf_counter() - t
    finally:
        if cluster is not None:
            with contextlib.suppress(Exception):
                client.close()
            with contextlib.suppress(Exception):
                cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)

    names = ds.feature_names
    table = diagnostics.summary(fly.samples, names=names)
    _say("")
    _say("FlyMC (MAP-tuned bounds) posterior:")
    _say(diagnostics.format_summary(table, max_rows=4).replace("... ", "… "))
    ef, er = fly.efficiency(), reg.efficiency()
    rh_f = float(np.nanmax(table["r_hat"]))
    rh_r = float(np.nanmax(diagnostics.rhat(reg.samples)))
    _say("")
    rows = [
        ("", "FlyMC", "regular"),
        (
            "ESS bulk, min / mean",
            f"{ef['ess_min']:.0f} / {ef['ess_mean']:.0f}",
            f"{er['ess_min']:.0f} / {er['ess_mean']:.0f}",
        ),
        ("R̂ max", f"{rh_f:.3f}", f"{rh_r:.3f}"),
        ("acceptance", f"{ef['acceptance']:.3f}", f"{er['acceptance']:.3f}"),
        ("bright fraction", _percent(ef["bright_fraction"]), _percent(er["bright_fraction"])),
        (
            "likelihood queries / iteration",
            f"{ef['queries_per_iteration'] * chains:,.0f}",
            f"{er['queries_per_iteration'] * chains:,.0f}",
        ),
        (
            "seconds / iteration",
            f"{ef['seconds_per_iteration']:.4f}",
            f"{er['seconds_per_iteration']:.4f}",
        ),
        ("ESS / second", _fmt(ef["ess_per_second"]), _fmt(er["ess_per_second"])),
        ("ESS / million queries", _fmt(1e6 * ef["ess_per_query"]), _fmt(1e6 * er["ess_per_query"])),
        (
            "set-up (MAP, bounds), s",
            f"{fly.info['setup_seconds']:.1f}",
            f"{reg.info['setup_seconds']:.1f}",
        ),
    ]
    for line in _demo_table(rows):
        _say(line)
    _say(
        "  (queries and seconds per iteration: all chains together; regular MCMC ran fewer "
        "draws, so its ESS and R̂ are rougher)"
    )
    per_it = er["seconds_per_iteration"] / ef["seconds_per_iteration"]
    per_q = ef["ess_per_query"] / er["ess_per_query"]
    per_s = ef["ess_per_second"] / er["ess_per_second"]
    _say("")
    _say(
        f"speedup of FlyMC: {per_it:.1f}× per iteration, {_fmt(per_q)}× in ESS per likelihood "
        f"query, {_fmt(per_s)}× in ESS per second"
    )
    _say(_agreement(fly, reg, names))
    _say(
        f"done in {time.perf_counter() - t_all:.0f} s (FlyMC {t_fly:.0f} s, regular "
        f"{t_reg:.0f} s including set-up)"
    )
    return 0


# --------------------------------------------------------------------------- make-data, ingest


def _describe(ds: Any) -> str:
    task = ds.task + (f", {ds.n_classes} classes" if ds.task == "multiclass" else "")
    return (
        f"{ds.path}: {ds.n_rows:,} rows × {ds.n_features} features, task {task}, "
        f"{ds.n_chunks} chunk(s) of {ds.chunk_rows:,} rows, {ds.dtype.name}"
    )


def _cmd_make_data(args: argparse.Namespace) -> int:
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
        "storage_options": _storage_options(args, args.out),
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
    _say(f"wrote {_describe(ds)} ({time.perf_counter() - t:.1f} s)")
    return 0


def _cmd_ingest(args: argparse.Namespace) -> int:
    target: int | str | None = args.target
    if target is not None and args.src.lower().endswith(".npy"):
        try:
            target = int(target)
        except ValueError:
            raise CLIError(
                f"--target for a .npy file must be a column index, got {args.target!r}"
            ) from None
    t = time.perf_counter()
    ds = ingest(
        args.src,
        args.out,
        target=target,
        task=args.task,
        n_classes=args.classes,
        chunk_rows=args.chunk_rows,
        dtype=args.dtype,
        overwrite=args.overwrite,
        storage_options=_storage_options(args, args.out),
    )
    _say(f"wrote {_describe(ds)} ({time.perf_counter() - t:.1f} s)")
    return 0


# --------------------------------------------------------------------------- run, summary


def _efficiency_lines(eff: dict[str, float], r_hat_max: float, chains: int) -> list[str]:
    secs = eff.get("seconds_per_iteration", float("nan"))
    lines = [
        f"ESS bulk min / mean      {_fmt(eff['ess_min'], '.0f')} / {_fmt(eff['ess_mean'], '.0f')}",
        f"R̂ max                    {_fmt(r_hat_max, '.3f')}",
        f"acceptance               {_fmt(eff['acceptance'], '.3f')}",
        f"bright fraction          {_percent(eff['bright_fraction'])}",
        f"likelihood queries       {eff['queries_per_iteration'] * chains:,.0f} per iteration "
        f"(all {chains} chains)",
        f"round trips              {_fmt(eff['round_trips_per_iteration'], '.2f')} per iteration",
    ]
    if math.isfinite(secs):
        lines.append(f"seconds per iteration    {secs:.4g}")
        lines.append(f"ESS per second           {_fmt(eff['ess_per_second'])}")
    lines.append(f"ESS per million queries  {_fmt(1e6 * eff['ess_per_query'])}")
    return lines


def _param_names(ds: Any, n_params: int) -> list[str] | None:
    names = getattr(ds, "feature_names", None)
    if names and len(names) == n_params:
        return list(names)
    return None


def _build_model(args: argparse.Namespace, ds: Any) -> Any:
    kwargs: dict[str, Any] = {}
    if args.model == "softmax":
        k = args.classes if args.classes is not None else ds.n_classes
        if k is None:
            raise CLIError("--classes is required: the data set has no class count")
        kwargs["n_classes"] = int(k)
    elif args.classes is not None:
        raise CLIError("--classes applies only to --model softmax")
    if args.model == "robust":
        if args.nu is not None:
            kwargs["nu"] = args.nu
        if args.scale is not None:
            kwargs["scale"] = args.scale
    elif args.nu is not None or args.scale is not None:
        raise CLIError("--nu and --scale apply only to --model robust")
    if args.prior is not None:
        kwargs["prior"] = args.prior
    if args.prior_scale is not None:
        kwargs["prior_scale"] = args.prior_scale
    return make_model(args.model, **kwargs)


def _client(args: argparse.Namespace) -> Any:
    if args.workers is not None and (args.scheduler or args.scheduler_file or args.synchronous):
        raise CLIError(
            "--workers applies only to the embedded LocalCluster (not with "
            "--scheduler, --scheduler-file or --synchronous)"
        )
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


def _resume_hint(err: BaseException) -> None:
    """After a failed run that kept its trace: one line saying how to continue it."""
    kept = kept_trace(err)
    if kept is not None:
        sys.stderr.write(
            f"flymc: {kept[0]} keeps {kept[1]:,} iterations (to its last "
            "checkpoint): continue with the same command and --resume\n"
        )
        sys.stderr.flush()


def _cmd_run(args: argparse.Namespace) -> int:
    so = _storage_options(args, args.store, args.trace)
    ds = fd.open_dataset(args.store, storage_options=_url_options(args.store, so))
    model = _build_model(args, ds)
    client = _client(args)
    trace_so = _url_options(args.trace, so)
    if "://" in args.trace:
        trace_path = args.trace
        existed = _probe(trace_path, trace_so) != "missing"
    else:
        trace_path = os.path.abspath(os.path.expanduser(args.trace))
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
    options: dict[str, Any] = {
        "trace": trace_path,
        "resume": args.resume,
        "overwrite_trace": args.overwrite,
        "progress": _progress(args),
    }
    if trace_so is not None:
        options["trace_storage_options"] = trace_so
    for key, value in (
        ("q_db", args.q_db),
        ("resample_fraction", args.resample_fraction),
        ("eps", args.eps),
        ("batch_size", args.batch_size),
        ("checkpoint_every", args.checkpoint_every),
        ("n_workers", args.workers),
        ("n_shards", args.n_shards),
    ):
        if value is not None:
            options[key] = value
    if args.no_control_variates:
        options["control_variates"] = False
    t = time.perf_counter()
    res = fd.sample(
        model,
        ds,
        algorithm=args.algorithm,
        bounds=args.bounds,
        kernel=args.kernel,
        z_update=args.z_update,
        num_warmup=args.warmup,
        num_samples=args.samples,
        chains=args.chains,
        seed=args.seed,
        client=client,
        **options,
    )
    seconds = time.perf_counter() - t
    names = _param_names(ds, int(np.prod(res.param_shape)))
    C, S = res.samples.shape[:2]
    label = {
        "flymc": f"FlyMC ({args.bounds} bounds, {args.z_update} z-update)",
        "regular": "regular MCMC (full data)",
        "austerity": "austerity MH (APPROXIMATE)",
    }[args.algorithm]
    _say(
        f"{label}, {args.kernel}, {model!r}: {C} chains × {S} draws "
        f"(+{args.warmup} warm-up) in {seconds:.1f} s → {args.trace}"
    )
    _say(str(res.summary(names=names)))
    _say("")
    r_hat = diagnostics.rhat(res.samples.reshape(C, S, -1))
    eff = res.efficiency()
    if args.resume:  # the time of this session only covers the resumed part
        eff["seconds_per_iteration"] = float("nan")
    for line in _efficiency_lines(eff, float(np.nanmax(r_hat)), C):
        _say(line)
    return 0


def _trace_efficiency(trace: Any) -> dict[str, float]:
    """:func:`flymc_dist.result.efficiency` of a trace's post-warm-up draws (the wall seconds
    of its sampling iterations are kept with the checkpoint)."""
    secs = (trace.checkpoint or {}).get("seconds", {}).get("sampling")
    return efficiency(trace.samples, trace.stats, trace.attrs.get("n_rows"), secs)


def _cmd_summary(args: argparse.Namespace) -> int:
    so = _storage_options(args)  # for the trace and for its data set (for the names)
    trace = Trace.open(args.trace, read_only=True, storage_options=_url_options(args.trace, so))
    attrs = trace.attrs
    data_path = attrs.get("data")
    if so and "://" not in args.trace and not (isinstance(data_path, str) and "://" in data_path):
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
    _say(head)
    if total and done < total:
        _say(
            f"incomplete: {done} of {total} iterations recorded (continue with flymc run … "
            f"--resume)"
        )
    if attrs.get("algorithm") == "austerity":
        _say("APPROXIMATE (austerity MH): draws do not target the exact posterior.")
    if S < 4:
        raise CLIError(
            f"{args.trace!r} holds {S} post-warm-up draws per chain; a summary needs at least 4"
        )
    names = None
    # a data set at a URL is read only with options given (else it could be a long wait)
    if isinstance(data_path, str) and (os.path.isdir(data_path) or ("://" in data_path and so)):
        with contextlib.suppress(Exception):
            names = _param_names(
                open_dataset(data_path, storage_options=_url_options(data_path, so)),
                int(np.prod(trace.param_shape)),
            )
    table = diagnostics.summary(trace.samples, names=names)
    _say(diagnostics.format_summary(table, max_rows=args.max_rows))
    _say("")
    eff = _trace_efficiency(trace)
    for line in _efficiency_lines(eff, float(np.nanmax(table["r_hat"])), C):
        _say(line)
    return 0


# --------------------------------------------------------------------------- bench


def _cmd_bench_overhead(args: argparse.Namespace) -> int:
    d = run_overhead(
        rows=args.rows,
        features=args.features,
        workers=args.workers,
        iterations=args.iterations,
        chains=args.chains,
        seed=args.seed,
        regular_iterations=args.regular_iterations,
        warmup=args.warmup,
        pings=args.pings,
        default_sharding=args.default_sharding,
    )
    _say(format_overhead(d))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(d, fh, indent=2, default=float)
    return 0


def _param_docs(func: Callable[..., Any]) -> dict[str, str]:
    """Parameter descriptions from a numpydoc ``Parameters`` section (first paragraph)."""
    lines = (inspect.getdoc(func) or "").splitlines()
    out: dict[str, str] = {}
    try:
        i = next(k for k, line in enumerate(lines) if line.strip() == "Parameters") + 2
    except StopIteration:
        return out
    names: list[str] = []
    text: list[str] = []

    def flush() -> None:
        for n in names:
            out[n] = " ".join(text).strip()

    while i < len(lines):
        line = lines[i]
        if line.strip() and not line.startswith(" "):
            if i + 1 < len(lines) and set(lines[i + 1].strip()) == {"-"}:
                break  # the next section
            flush()
            names = [n.strip() for n in line.split(":")[0].split(",")]
            text = []
        elif line.strip():
            text.append(line.strip())
        i += 1
    flush()
    return out


def _signature_parser(func: Callable[..., Any], prog: str, description: str) -> _Parser:
    """A parser with one ``--option`` per keyword parameter of ``func`` (by its default)."""
    parser = _Parser(prog=prog, description=description)
    docs = _param_docs(func)
    for name, par in inspect.signature(func).parameters.items():
        if par.kind in (par.VAR_POSITIONAL, par.VAR_KEYWORD):
            continue
        flag = "--" + name.replace("_", "-")
        default = par.default
        ann = str(par.annotation)
        doc = docs.get(name, "").replace("%", "%%")
        helptext = f"{doc} (default {default!r})".strip()
        if name == "client":
            parser.add_argument(
                flag,
                default=default,
                metavar="CLIENT",
                help="'synchronous', 'local' (an embedded LocalCluster), a "
                "scheduler address or a scheduler file "
                f"(default {default!r})",
            )
        elif isinstance(default, bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=helptext
            )
        elif isinstance(default, (list, tuple)) or "Sequence" in ann or "list" in ann:
            kind = (
                float
                if ("float" in ann or any(isinstance(v, float) for v in (default or ())))
                else int
            )
            parser.add_argument(
                flag,
                nargs="*",
                type=kind,
                default=default,
                metavar="X",
                help=helptext + "; give no value for none",
            )
        elif isinstance(default, int) or (default is None and "int" in ann):
            parser.add_argument(flag, type=int, default=default, help=helptext)
        elif isinstance(default, float) or (default is None and "float" in ann):
            parser.add_argument(flag, type=float, default=default, help=helptext)
        else:
            parser.add_argument(
                flag,
                default=None if default is par.empty else default,
                required=default is par.empty,
                help=helptext,
            )
    return parser


#: ``flymc bench NAME``: the module ``flymc_dist.bench.NAME`` with ``run_NAME`` (its options
#: become the command's) and ``format_NAME``
BENCH_MODULES = ("sublinear", "mixing", "scale")


def _cmd_bench_module(name: str, argv: Sequence[str]) -> int:
    try:
        mod = importlib.import_module(f"flymc_dist.bench.{name}")
    except ImportError as err:
        raise CLIError(f"'bench {name}' is not available in this installation ({err})") from None
    run = getattr(mod, f"run_{name}", None)
    fmt = getattr(mod, f"format_{name}", None)
    if run is None or fmt is None:
        raise CLIError(
            f"'bench {name}' is not available: flymc_dist.bench.{name} lacks "
            f"run_{name}/format_{name}"
        )
    doc = inspect.getdoc(mod) or ""
    parser = _signature_parser(run, f"flymc bench {name}", doc.split("\n\n")[0])
    parser.add_argument(
        "--json", metavar="FILE", default=None, help="also write the figures as JSON"
    )
    args = vars(parser.parse_args(list(argv)))
    json_path = args.pop("json")
    if args.get("client") == "local":
        args["client"] = None
    for key, value in list(args.items()):
        if isinstance(value, list):
            args[key] = tuple(value) if value else None
    d = run(**args)
    _say(fmt(d))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(d, fh, indent=2, default=_json_default)
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return str(value)


# --------------------------------------------------------------------------- entry point


def _dispatch(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH_MODULES:
        return _cmd_bench_module(argv[1], argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return int(args.func(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``flymc`` with ``argv`` (default ``sys.argv[1:]``).

    Parameters
    ----------
    argv
        The arguments after the program name.

    Returns
    -------
    int
        0 on success, 2 for bad input or usage (one line on stderr, nothing written), 1 for
        an unexpected failure, 130 when interrupted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except SystemExit as stop:  # --help, --version
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)
    except CLIError as err:
        _error(str(err))
        return EXIT_USAGE
    except KeyboardInterrupt as err:
        _error("interrupted")
        _resume_hint(err)
        return EXIT_INTERRUPT
    except BrokenPipeError:
        # stdout's reader went away (`flymc summary t.zarr | head -2`): stop quietly
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (ValueError, OSError) as err:
        if os.environ.get("FLYMC_DEBUG"):
            traceback.print_exc()
        _error(str(err) or type(err).__name__)
        _resume_hint(err)
        return EXIT_USAGE
    except Exception as err:  # noqa: BLE001 - the last line of defence of a CLI
        if os.environ.get("FLYMC_DEBUG"):
            traceback.print_exc()
            _error(f"{type(err).__name__}: {err}")
        else:
            _error(f"{type(err).__name__}: {err} (set FLYMC_DEBUG=1 for the traceback)")
        _resume_hint(err)
        return EXIT_FAILURE
