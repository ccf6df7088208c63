"""``flymc bench NAME``: the benchmarks of :mod:`flymc_dist.bench`, their options read
from the signature and docstring of ``run_NAME``."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

from flymc_dist.bench.common import write_json
from flymc_dist.bench.overhead import format_overhead, run_overhead
from flymc_dist.cli.common import CLIError, Parser, say

# --------------------------------------------------------------------------- bench


def cmd_bench_overhead(args: argparse.Namespace) -> int:
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
    )
    say(format_overhead(d))
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


def _signature_parser(func: Callable[..., Any], prog: str, description: str) -> Parser:
    """A parser with one ``--option`` per keyword parameter of ``func`` (by its default)."""
    parser = Parser(prog=prog, description=description)
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
            values = default or ()
            kind = (
                str
                if ("str" in ann or any(isinstance(v, str) for v in values))
                else float
                if ("float" in ann or any(isinstance(v, float) for v in values))
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
        elif "None" in ann:  # a text or none: '' gives None
            parser.add_argument(
                flag, type=_text_or_none, default=default, help=helptext + "; '' for none"
            )
        else:
            parser.add_argument(
                flag,
                default=None if default is par.empty else default,
                required=default is par.empty,
                help=helptext,
            )
    return parser


def _text_or_none(value: str) -> str | None:
    """A text option's value: None for the empty text."""
    return value or None


#: the benchmarks whose options come from their run_NAME's signature, and their one line
BENCH_HELP = (
    ("scaleout", "FlyMC's cost per iteration against the number of workers and added latency"),
    ("sublinear", "austerity MH: data used per decision against N, bias against eps"),
    ("mixing", "min-ESS per second of the whole run, FlyMC vs regular (NUTS)"),
    ("scale", "FlyMC's cost per iteration, peak RSS and ESS against N (out of core)"),
    ("table1", "the FlyMC paper's Table 1, all three rows, converged (R-hat <= 1.01)"),
    (
        "jointdpm",
        "JointDPM (the sublinear-MH paper's Fig. 6): held-out accuracy against time, "
        "exact MH against austerity",
    ),
    ("sv", "stochastic volatility: the sublinear-MH paper's Fig. 9, bias, a tall panel"),
    (
        "risk",
        "the sublinear-MH paper's Fig. 4: risk of the predictive mean on held-out "
        "MNIST 7 vs 9 against time, exact MH against austerity",
    ),
    ("ingest", "Parquet ingest in one process and on a cluster against .npy ingest"),
    ("loo", "LOO by subsampling against full PSIS-LOO on every row, over many seeds"),
)


#: ``flymc bench NAME``: the module ``flymc_dist.bench.NAME`` with ``run_NAME`` (its options
#: become the command's) and ``format_NAME``
BENCH_MODULES = tuple(name for name, _ in BENCH_HELP)


def cmd_bench_module(name: str, argv: Sequence[str]) -> int:
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
    try:
        d = run(**args)
    except ImportError as err:  # an optional extra the options asked for
        raise CLIError(str(err)) from None
    say(fmt(d))
    if json_path:
        write_json(json_path, d)
    return 0
