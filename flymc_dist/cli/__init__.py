"""The ``flymc`` command line.

Subcommands::

    flymc demo                       FlyMC vs regular MCMC (NUTS) on 200,000 synthetic rows
    flymc make-data OUT --like …     write a synthetic data set (zarr)
    flymc ingest SRC OUT             .npy / .npz / .csv / Parquet → a validated zarr data set
    flymc run STORE --model … --trace OUT.zarr
                                     sample; draws + stats go to a resumable zarr trace
    flymc summary TRACE              the posterior table and efficiency of a trace
    flymc predict TRACE NEW OUT      the posterior predictive at new rows, into zarr
    flymc bench NAME                 benchmarks: overhead, sublinear, mixing, scale, table1,
                                     scaleout, jointdpm, risk, sv, ingest, loo

Bad input (a missing file, NaN in the data, an unknown model or option, …) ends with
exit status 2 and one line ``flymc: error: <reason>`` on stderr, and writes nothing.
An unexpected internal failure ends with status 1 (set ``FLYMC_DEBUG=1`` for the
traceback); an interrupt (Ctrl-C) with 130; SIGTERM (what a batch scheduler sends) is
handled as Ctrl-C is and ends with 143; output cut short by its reader (``| head``)
with 141, quietly. A run that fails or is stopped after its first checkpoint keeps its
trace, releases its lock, and says, in one more line, how to continue it with
``--resume``.

The subcommands live in :mod:`flymc_dist.cli.demo`, :mod:`flymc_dist.cli.commands`
(make-data, ingest, run, summary) and :mod:`flymc_dist.cli.bench`; the parser in
:mod:`flymc_dist.cli.parser`; what they share in :mod:`flymc_dist.cli.common`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator, Sequence
from types import FrameType

from flymc_dist.cli.bench import BENCH_MODULES, cmd_bench_module
from flymc_dist.cli.commands import resume_hint
from flymc_dist.cli.common import CLIError, usage_error
from flymc_dist.cli.parser import build_parser

__all__ = ["CLIError", "build_parser", "main"]

#: Exit status for bad input or usage.
EXIT_USAGE = 2
#: Exit status for an unexpected internal failure.
EXIT_FAILURE = 1
#: Exit status after Ctrl-C.
EXIT_INTERRUPT = 130
#: Exit status when stdout's reader went away (as a process killed by SIGPIPE).
EXIT_BROKEN_PIPE = 141
#: Exit status after SIGTERM (as a process killed by it).
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is (as Ctrl-C raises KeyboardInterrupt), so a
    run stopped by a batch scheduler keeps its trace, releases its lock and says how to
    resume, as an interrupted one does."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one cannot cut the clean-up
    raise Terminated


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` while the command runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------- entry point


def _dispatch(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH_MODULES:
        return cmd_bench_module(argv[1], argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return int(args.func(args) or 0)


def _drop_cut_short(err: BaseException) -> None:
    """Free the work an interrupt cut short, quietly: its frames (``err``'s traceback)
    may hold a store write that was never awaited (zarr's asynchronous calls), whose
    RuntimeWarning would follow the two lines that say what happened. The trace keeps
    what its last checkpoint wrote; nothing else is lost."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        err.__traceback__ = None
        gc.collect()


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
        an unexpected failure, 130 when interrupted, 143 after SIGTERM.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with _sigterm_as_interrupt():
            return _dispatch(argv)
    except SystemExit as stop:  # --help, --version
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)
    except CLIError as err:
        usage_error(str(err))
        return EXIT_USAGE
    except KeyboardInterrupt as err:
        terminated = isinstance(err, Terminated)
        usage_error("terminated (SIGTERM)" if terminated else "interrupted")
        resume_hint(err)
        _drop_cut_short(err)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPT
    except BrokenPipeError:
        # stdout's reader went away (`flymc summary t.zarr | head -2`): stop quietly
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (ValueError, OSError) as err:
        if os.environ.get("FLYMC_DEBUG"):
            traceback.print_exc()
        usage_error(str(err) or type(err).__name__)
        resume_hint(err)
        return EXIT_USAGE
    except Exception as err:  # noqa: BLE001 - the last line of defence of a CLI
        if os.environ.get("FLYMC_DEBUG"):
            traceback.print_exc()
            usage_error(f"{type(err).__name__}: {err}")
        else:
            usage_error(f"{type(err).__name__}: {err} (set FLYMC_DEBUG=1 for the traceback)")
        resume_hint(err)
        return EXIT_FAILURE
