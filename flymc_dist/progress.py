"""A dependency-free progress line: acceptance, bright count, iterations per second.

Off when ``enabled=False``, and by default (``enabled=None``) off under ``CI`` or when
stderr is not a terminal.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np


class Progress:
    """Prints ``it/total, it/s, acceptance, bright count`` at most every ``interval`` seconds."""

    def __init__(
        self,
        total: int,
        enabled: bool | None = None,
        initial: int = 0,
        interval: float = 0.5,
        label: str = "sampling",
    ) -> None:
        if enabled is None:
            enabled = not os.environ.get("CI") and sys.stderr.isatty()
        self.enabled = bool(enabled)
        self.total = total
        self.count = initial
        self.start_count = initial
        self.label = label
        self.interval = interval
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.accepted = 0.0
        self.n_acc = 0

    def update(self, stats: dict[str, np.ndarray]) -> None:
        """Record one iteration (all chains)."""
        self.count += 1
        self.accepted += float(np.mean(stats["accepted"]))
        self.n_acc += 1
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last < self.interval and self.count < self.total:
            return
        self.last = now
        rate = (self.count - self.start_count) / max(now - self.t0, 1e-9)
        bright = int(np.mean(stats["n_bright"]))
        acc = self.accepted / max(self.n_acc, 1)
        sys.stderr.write(
            f"\r{self.label} {self.count}/{self.total}  {rate:7.1f} it/s  "
            f"accept {acc:5.3f}  bright {bright:>9d}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        """End the line."""
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
