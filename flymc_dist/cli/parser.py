"""The ``flymc`` argument parser: every subcommand, its options and their types."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

from flymc_dist import __version__
from flymc_dist.cli.bench import BENCH_HELP, cmd_bench_overhead
from flymc_dist.cli.commands import (
    MODEL_NAMES,
    cmd_ingest,
    cmd_make_data,
    cmd_predict,
    cmd_run,
    cmd_summary,
)
from flymc_dist.cli.common import Parser
from flymc_dist.cli.demo import (
    DEMO_FEATURES,
    DEMO_KERNEL,
    DEMO_REGULAR_SAMPLES,
    DEMO_ROWS,
    DEMO_SAMPLES,
    cmd_demo,
)
from flymc_dist.cli.flags import add_kernel_flags, add_option_flags
from flymc_dist.data import TASKS
from flymc_dist.kernels import KERNELS
from flymc_dist.models.families import SOFTMAX_BOUNDS
from flymc_dist.options import Austerity, FlyMC, Placement

#: the θ-kernels
_KERNELS = tuple(KERNELS)


# --------------------------------------------------------------------------- argument types


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


# --------------------------------------------------------------------------- the parser


def build_parser() -> argparse.ArgumentParser:
    """The ``flymc`` argument parser (all subcommands).

    Returns
    -------
    argparse.ArgumentParser
        Its errors raise :class:`CLIError` instead of exiting.
    """
    parser = Parser(
        prog="flymc",
        description="Exact Bayesian inference for tall data on "
        "Dask: Firefly Monte Carlo, regular MCMC and (approximate) austerity MH.",
    )
    parser.add_argument("--version", action="version", version=f"flymc_dist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    # ---- demo
    p = sub.add_parser(
        "demo",
        help=f"FlyMC vs regular MCMC on {DEMO_ROWS:,} synthetic logistic rows",
        description=f"Generate a synthetic logistic data set ({DEMO_ROWS:,} rows by default) "
        "in a temporary zarr store, sample it with MAP-tuned FlyMC and with regular MCMC "
        f"({DEMO_KERNEL.upper()} by default, 4 chains) on an embedded LocalCluster, and "
        "compare.",
    )
    p.add_argument(
        "--rows", type=_positive_int, default=DEMO_ROWS, help=f"rows N (default {DEMO_ROWS:,})"
    )
    p.add_argument(
        "--features",
        type=_positive_int,
        default=DEMO_FEATURES,
        help=f"features D including the bias column (default {DEMO_FEATURES})",
    )
    p.add_argument(
        "--samples",
        type=_positive_int,
        default=DEMO_SAMPLES,
        help=f"FlyMC draws per chain after warm-up (default {DEMO_SAMPLES})",
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
        help=f"regular MCMC draws per chain (default {DEMO_REGULAR_SAMPLES}; "
        "each evaluation is a full pass over the data)",
    )
    p.add_argument("--chains", type=_positive_int, default=4, help="chains (default 4)")
    p.add_argument(
        "--kernel",
        choices=_KERNELS,
        default=DEMO_KERNEL,
        help=f"θ-kernel of both samplers (default {DEMO_KERNEL})",
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
    p.add_argument(
        "--no-progress", action="store_true", help="no progress (set-up passes, sampling bar)"
    )
    p.set_defaults(func=cmd_demo)

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
    p.set_defaults(func=cmd_make_data)

    # ---- ingest
    p = sub.add_parser(
        "ingest",
        help="convert .npy/.npz/.csv/Parquet into a zarr data set",
        description="Validate a .npy (2-D, target column last unless --target), "
        ".npz (arrays X and y), Parquet (a file, a directory or a URL; target column "
        "last unless --target) or .csv (header row; target column last unless "
        "--target; a first line of numbers only is read as data, not as a "
        "header, and 0,1,...,k-1 is refused unless --header or --no-header says "
        "which) file and write it as a flymc_dist zarr store. Nothing is "
        "written if the data are invalid (NaN/inf, bad labels, wrong shapes).",
    )
    p.add_argument("src", metavar="SRC", help="the .npy, .npz, .csv or Parquet file or directory")
    p.add_argument("out", metavar="OUT", help="the store to create (a directory)")
    p.add_argument(
        "--target",
        default=None,
        help="the target column: an index for .npy, a header name for .csv "
        "(an index for a .csv without a header row)",
    )
    p.add_argument(
        "--task",
        choices=(*TASKS, *MODEL_NAMES),
        default=None,
        help="the task, or the --model the data are for (its task: e.g. negative_binomial "
        "is count, binomial binary); default: inferred from the target, where counts "
        "are inferred as multiclass labels",
    )
    p.add_argument(
        "--classes", type=_positive_int, default=None, help="number of classes (multiclass)"
    )
    p.add_argument("--chunk-rows", type=_positive_int, default=None, help="rows per chunk")
    p.add_argument("--dtype", choices=_DTYPES, default="float64", help=_DTYPE_HELP)
    p.add_argument("--overwrite", action="store_true", help="replace an existing store")
    p.add_argument(
        "--header",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=".csv: the first line is a header (--header) or data (--no-header); by "
        "default a header unless it is numbers only",
    )
    p.add_argument(
        "--categorical",
        action="append",
        metavar="COLUMN",
        default=None,
        help="one-hot encode this column (repeat the flag for more; .csv with a header, "
        "Parquet); the first level in sorted order is the reference",
    )
    p.add_argument(
        "--standardize",
        action="store_true",
        help="centre and scale every non-constant numeric feature (recorded in the store)",
    )
    p.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="a Dask scheduler address: its workers convert and write row ranges in "
        "parallel (Parquet, .npy)",
    )
    p.add_argument(
        "--storage-option",
        type=_storage_option,
        action="append",
        metavar="KEY=VALUE",
        help=_STORAGE_HELP,
    )
    p.set_defaults(func=cmd_ingest)

    # ---- predict
    p = sub.add_parser(
        "predict",
        help="the posterior predictive of a trace's draws at new rows",
        description="Compute the posterior predictive (class probabilities, or the "
        "predictive mean and interval) of a trace's draws at new rows: a data set "
        "written with the training data's settings (computed chunk by chunk, on the "
        "cluster with --scheduler) or a small .csv/.parquet file of the training "
        "columns; written as a zarr group.",
    )
    p.add_argument("trace", metavar="TRACE", help="the trace of a run (flymc run --trace)")
    p.add_argument("new", metavar="NEW", help="a data set, or a .csv/.parquet file")
    p.add_argument("out", metavar="OUT", help="the zarr group to create")
    p.add_argument(
        "--interval",
        type=float,
        default=0.9,
        help="regression: the central predictive interval's mass (default 0.9)",
    )
    p.add_argument("--scheduler", default=None, metavar="ADDRESS", help="a Dask scheduler")
    p.add_argument(
        "--storage-option",
        type=_storage_option,
        action="append",
        metavar="KEY=VALUE",
        help=_STORAGE_HELP,
    )
    p.set_defaults(func=cmd_predict)

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
    g.add_argument(
        "--model",
        required=True,
        choices=MODEL_NAMES,
        help="the likelihood; student_t is robust's family name; probit, binomial, "
        "negative_binomial and gaussian are GLM families (fd.GLM)",
    )
    g.add_argument(
        "--bound",
        choices=SOFTMAX_BOUNDS,
        default=None,
        help="softmax: FlyMC's bound, Böhning's fixed curvature (the default) or "
        "one_vs_each, whose curvature falls with each row's margins",
    )
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
        "--scale",
        type=_positive_float,
        default=None,
        help="robust: Student-t scale; gaussian: noise sd (default 1)",
    )
    g.add_argument(
        "--trials", type=_positive_int, default=None, help="binomial: trials per row (default 1)"
    )
    g.add_argument(
        "--link",
        choices=("logit", "probit"),
        default=None,
        help="binomial: the link (default logit)",
    )
    g.add_argument(
        "--dispersion",
        type=_positive_float,
        default=None,
        help="negative_binomial: dispersion r, variance mu + mu^2/r (default 1)",
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
        "--kernel",
        choices=_KERNELS,
        default=None,
        help="theta kernel (default nuts; rwmh, its only one, for austerity)",
    )
    g.add_argument(
        "--precondition",
        choices=("laplace", "bound", "identity"),
        default="laplace",
        help="the kernel's preconditioner: the Gaussian at the MAP (laplace, default), "
        "FlyMC's Gaussian of theta with every row dark (bound), or none (identity)",
    )
    g.add_argument(
        "--map-maxiter",
        type=_nonnegative_int,
        default=100,
        help="iterations of the MAP search (default 100)",
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
    add_option_flags(g, Placement)
    add_option_flags(p.add_argument_group("FlyMC (--algorithm flymc)"), FlyMC)
    add_option_flags(p.add_argument_group("austerity (--algorithm austerity)"), Austerity)
    add_kernel_flags(p.add_argument_group("theta-kernel options (each for the kernels named)"))
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
        default=100,
        help="iterations between trace flushes / checkpoints (default 100)",
    )
    g.add_argument(
        "--no-progress", action="store_true", help="no progress (set-up passes, sampling bar)"
    )
    g.add_argument(
        "--storage-option",
        type=_storage_option,
        action="append",
        metavar="KEY=VALUE",
        help=_STORAGE_HELP + "; used for STORE and --trace when they are URLs",
    )
    p.set_defaults(func=cmd_run)

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
    p.set_defaults(func=cmd_summary)

    # ---- bench
    p = sub.add_parser(
        "bench",
        help="benchmarks (" + ", ".join(["overhead", *(name for name, _ in BENCH_HELP)]) + ")",
        description="Benchmarks: 'overhead' (FlyMC per iteration against a bare "
        "round trip and regular MCMC), 'sublinear' (austerity MH's data use "
        "against N; see 'flymc bench sublinear --help'), 'mixing' "
        "(converged draws per second of the whole run, FlyMC against regular "
        "MCMC with NUTS; see 'flymc bench mixing --help'), 'scale' (FlyMC's cost "
        "per iteration, memory and mixing against N, in memory or out of core; see "
        "'flymc bench scale --help'), 'table1' (the FlyMC paper's Table 1, all three "
        "rows, each run to R-hat <= 1.01; see 'flymc bench table1 --help'), "
        "'scaleout' (FlyMC's cost per iteration against the number of workers and added "
        "latency; see 'flymc bench scaleout --help'), and the others listed below (each "
        "'flymc bench NAME --help' gives its options).",
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
    b.add_argument("--seed", type=_nonnegative_int, default=0, help="seed (default 0)")
    b.add_argument("--json", metavar="FILE", default=None, help="also write the figures as JSON")
    b.set_defaults(func=cmd_bench_overhead)
    # the options of these come from run_NAME's signature (see cmd_bench_module)
    for name, helptext in BENCH_HELP:
        bsub.add_parser(name, add_help=False, help=helptext).set_defaults(func=None)
    return parser
