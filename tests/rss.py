"""A process's peak resident memory (Linux), for tests that run it on Dask workers
(``client.run``): reset, then read."""

from __future__ import annotations


def reset_peak_rss() -> None:
    """Start this process's peak RSS (VmHWM) afresh: a worker forked from a large parent
    would otherwise report the parent's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    """This process's peak resident set size since the last reset, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
