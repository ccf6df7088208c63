"""Progress on stderr, with tqdm: the sampling bar and each set-up pass.

tqdm rather than rich: it is what NumPyro and emcee show (PyMC moved to rich), it is
pure Python with no dependencies of its own, and a line it writes reads the same in a
terminal, a notebook's stderr and a SLURM log.

* :class:`Progress`, the sampling bar: iterations done of all, iterations per second,
  the acceptance rate so far (mean over chains and iterations) and the bright rows per
  chain at the last iteration, all chains together (they step together).
* :class:`SetupProgress`, the set-up passes (the load from the store, the MAP search,
  the exact rows, the bound statistics, the first draw of z, ...): the driver wraps
  each pass in :meth:`SetupProgress.phase`; while it runs the line shows the seconds
  so far (refreshed from a thread: the pass itself reports nothing until it ends, the
  shards send no progress of their own), and when it ends the rows it went through,
  rows per second and bytes per second.

Either is off when ``enabled=False``, and by default (``enabled=None``) off under
``CI`` or when stderr is not a terminal (:func:`progress_enabled`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

__all__ = [
    "Progress",
    "SetupPass",
    "SetupProgress",
    "load_note",
    "map_search_rows",
    "progress_enabled",
]


def progress_enabled(option: bool | None) -> bool:
    """Whether to show progress: ``option`` when given, else on only for a terminal
    stderr outside ``CI``."""
    if option is None:
        return not os.environ.get("CI") and sys.stderr.isatty()
    return bool(option)


class _Bar(tqdm):
    """tqdm on stderr without its monitor thread (the bars here refresh themselves), as
    wide as the terminal: 100 × 24 where the terminal reports no size (a pseudo-terminal
    without one, e.g. under ``script``), where tqdm would print empty lines."""

    monitor_interval = 0

    def __init__(self, **kwargs: Any) -> None:
        size = None
        try:
            if os.get_terminal_size(sys.stderr.fileno()).columns <= 0:
                size = (100, 24)
        except (AttributeError, OSError, ValueError):  # not a terminal: tqdm's default
            pass
        super().__init__(
            file=sys.stderr,
            ncols=None if size is None else size[0],
            nrows=None if size is None else size[1],
            dynamic_ncols=size is None,
            mininterval=0.0,
            leave=True,
            **kwargs,
        )


def _per_second(amount: float, seconds: float, suffix: str) -> str:
    """``amount`` per second, SI-scaled: ``"1.23M rows/s"``, ``"98.1MB/s"``."""
    return f"{tqdm.format_sizeof(amount / max(seconds, 1e-9), suffix)}/s"


class Progress:
    """The sampling bar: ``it/total``, it/s, acceptance so far and bright rows per chain.

    Parameters
    ----------
    total
        Iterations of the run (warm-up and sampling).
    enabled
        True / False force it; None: :func:`progress_enabled`.
    initial
        Iterations done before (a resumed run).
    interval
        Seconds between two refreshes at most (the statistics are read only then).
    label
        The bar's description (``"<label> (warm-up)"`` during warm-up).
    num_warmup
        Iterations of warm-up.
    """

    def __init__(
        self,
        total: int,
        enabled: bool | None = None,
        initial: int = 0,
        interval: float = 0.5,
        label: str = "sampling",
        num_warmup: int = 0,
    ) -> None:
        self.enabled = progress_enabled(enabled)
        self.total = total
        self.label = label
        self.num_warmup = num_warmup
        self.count = initial
        self.interval = interval
        self.last = 0.0
        self.accepted = 0.0
        self.n_acc = 0
        self._bar: tqdm | None = None
        if self.enabled:
            self._bar = _Bar(
                total=total,
                initial=initial,
                desc=f"{label} (warm-up)" if initial < num_warmup else label,
                unit="it",
                miniters=0,
            )

    def update(self, stats: dict[str, np.ndarray]) -> None:
        """Record one iteration (all chains)."""
        accepted = stats["accepted"]
        self.count += 1
        self.accepted += np.count_nonzero(accepted) / accepted.size  # np.mean's value, sooner
        self.n_acc += 1
        self._refresh(stats["n_bright"], 1)

    def update_many(self, stats: dict[str, np.ndarray]) -> None:
        """Record iterations, statistics ``(chains, n)``: as :meth:`update` on each in
        turn, the bar refreshed once."""
        accepted = stats["accepted"]
        C, n = accepted.shape
        for j in range(n):
            self.accepted += np.count_nonzero(accepted[:, j]) / C
        self.count += n
        self.n_acc += n
        self._refresh(stats["n_bright"][:, -1], n)

    def _refresh(self, n_bright: np.ndarray, n: int) -> None:
        """Redraw the bar after ``n`` more iterations (every ``interval`` seconds at most,
        and at the end), with the last one's bright rows ``n_bright`` (per chain)."""
        if self._bar is None:
            return
        if self.count - n < self.num_warmup <= self.count:  # warm-up ended
            self._bar.set_description_str(self.label, refresh=False)
        now = time.perf_counter()
        if now - self.last < self.interval and self.count < self.total:
            return
        self.last = now
        acc = self.accepted / max(self.n_acc, 1)
        bright = int(np.mean(n_bright))
        self._bar.set_postfix_str(f"accept {acc:.3f}, bright {bright:,}", refresh=False)
        self._bar.update(self.count - self._bar.n)

    def close(self) -> None:
        """End the bar (its last state stays on the line)."""
        if self._bar is not None:
            if self.count > self._bar.n:
                self._bar.update(self.count - self._bar.n)
            self._bar.close()
            self._bar = None


@dataclass
class SetupPass:
    """What a set-up pass reports when it ends (set by the code it wraps).

    Attributes
    ----------
    rows
        Rows the pass went through (over all its full passes), 0: not known.
    note
        A few words on its outcome (``"3 full passes"``, ``"12 rows chosen"``).
    """

    rows: float = 0
    note: str = ""


class SetupProgress:
    """One line per set-up pass: while it runs, its seconds so far; at its end, the rows
    it went through, rows per second and bytes per second.

    Parameters
    ----------
    enabled
        True / False force it; None: :func:`progress_enabled`.
    row_bytes
        Bytes of one row as the passes read it (features and target; the store's
        dtype): rows per second times this is the bytes per second shown (0: none shown).
    interval
        Seconds between refreshes of a running pass's line.
    """

    def __init__(
        self, enabled: bool | None = None, row_bytes: int = 0, interval: float = 0.5
    ) -> None:
        self.enabled = progress_enabled(enabled)
        self.row_bytes = int(row_bytes)
        self.interval = float(interval)

    @contextmanager
    def phase(self, name: str, rows: float = 0) -> Iterator[SetupPass]:
        """Show the pass ``name`` while the ``with`` block runs it; ``rows`` (or what
        the block sets on the :class:`SetupPass` it is given) are the rows it goes
        through."""
        done = SetupPass(rows)
        if not self.enabled:
            yield done
            return
        bar = _Bar(
            total=None,
            desc=name,
            bar_format="{desc}: {elapsed} ...",
        )
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(self.interval):
                bar.refresh()

        ticker = threading.Thread(target=tick, name=f"flymc-progress-{name}", daemon=True)
        ticker.start()
        t0 = time.perf_counter()
        ok = False
        try:
            yield done
            ok = True
        finally:
            stop.set()
            ticker.join()
            seconds = time.perf_counter() - t0
            # the closing line whole (tqdm would cut it to the terminal's width)
            bar.leave = False
            bar.close()
            _Bar.write(f"{name}: {self._final(done, seconds, ok)}", file=sys.stderr)

    def _final(self, done: SetupPass, seconds: float, ok: bool) -> str:
        """The pass's closing words."""
        if not ok:
            return f"failed after {seconds:.2f} s"
        parts = [f"{seconds:.2f} s"]
        if done.rows > 0:
            parts[0] = f"{tqdm.format_sizeof(done.rows)} rows in {seconds:.2f} s"
            parts.append(_per_second(done.rows, seconds, " rows"))
            if self.row_bytes > 0:
                parts.append(_per_second(done.rows * self.row_bytes, seconds, "B"))
        if done.note:
            parts.append(done.note)
        return ", ".join(parts)


def map_search_rows(found: Any, n_rows: int, thin: int = 1) -> tuple[float, str]:
    """The rows a MAP search (:class:`~flymc_dist.tune.MapEstimate` ``found``) went
    through, and its passes in words."""
    sub = int(found.info.get("subsample_evaluations", 0))
    rows = found.passes * n_rows + sub * -(-n_rows // max(thin, 1))
    note = f"{found.passes} full passes" + (f", {sub} on 1/{thin} of the rows" if sub else "")
    return rows, note


def load_note(client: Any, mem: dict | None) -> str:
    """Where the load reads the rows from, and what else it waits on."""
    note = "from the store" if mem is None else "given in memory"
    return note + (", with the cluster's start" if client is None else "")
