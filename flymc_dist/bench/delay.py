"""A delaying TCP proxy: added network latency in front of a shard host's round channel.

These machines' kernels have no ``netem``; a proxy in front of each host's channel port
adds a fixed delay to every byte the host sends back (its replies), so a run can be timed
as if its hosts were that much further away. Each proxy runs in a process of its own, as
a network in between would: its work takes no CPU time or interpreter lock from the
driver's threads (:mod:`flymc_dist.bench.delay_server`, run as a script).
:func:`delayed_channels` routes every round channel a run opens through a proxy of its
own.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from flymc_dist.transport.channel import ChannelClient

__all__ = ["DelayProxy", "delayed_channels"]


class DelayProxy:
    """A process that listens on a loopback port and forwards each connection to
    ``target``: bytes to the target at once, bytes from it ``delay`` seconds after they
    arrived, in order.

    Parameters
    ----------
    target
        ``(host, port)`` to forward to.
    delay
        Seconds added to every reply byte (the added round trip).
    cpus
        The CPUs the process runs on (Linux's CPU affinity); ``None``: those of the
        thread that starts it.
    """

    def __init__(self, target: tuple[str, int], delay: float, cpus: set[int] | None = None) -> None:
        if not delay >= 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay}")
        host, port = target
        self.target = (str(host), int(port))
        self.delay = float(delay)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_server.py")
        # its errors to a file, which a long run cannot fill as it would a pipe; it takes
        # its CPUs itself, before it starts a thread
        self._err = tempfile.TemporaryFile()
        mask = "" if cpus is None else ",".join(map(str, sorted(cpus)))
        self._proc = subprocess.Popen(
            [sys.executable, "-I", script, *map(str, self.target), repr(self.delay), mask],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
        )
        #: the proxy's process id
        self.pid = self._proc.pid
        try:
            line = self._proc.stdout.readline() if self._proc.stdout else b""
        except BaseException:  # an interrupt: no process left behind
            self._stop()
            raise
        if not line.strip().isdigit():
            err = self._stop()
            raise RuntimeError(f"the delaying proxy did not start: {err.strip() or line!r}")
        self.address: tuple[str, int] = ("127.0.0.1", int(line))

    def _stop(self) -> str:
        """End the process (its standard input closed, killed if it lingers); its
        standard error. Once: later calls return ``""``."""
        if self._proc.returncode is not None:
            return ""
        try:
            self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
        self._err.seek(0)
        err = self._err.read()
        self._err.close()
        return err.decode(errors="replace")

    def close(self) -> None:
        """Stop the process: every forwarded connection closes with it."""
        self._stop()


@contextlib.contextmanager
def delayed_channels(
    delay: Callable[[int], float] | float, cpus: set[int] | None = None
) -> Iterator[list[DelayProxy]]:
    """Within the block, every round channel the driver connects to a shard host goes
    through a :class:`DelayProxy` of its own: ``delay`` seconds (or ``delay(i)`` for the
    i-th channel connected) added to the host's replies, over TCP (a host's local socket,
    which would bypass the proxy, is not used); each proxy on ``cpus`` (``None``: those of
    the connecting thread). Yields the proxies started."""
    original = ChannelClient.connect
    proxies: list[DelayProxy] = []

    def connect(self: Any, key: str, address: tuple[str, int], token: bytes, **kw: Any) -> None:
        d = delay(len(proxies)) if callable(delay) else float(delay)
        proxy = DelayProxy(tuple(address), d, cpus)
        proxies.append(proxy)
        original(self, key, proxy.address, token, **{**kw, "local_name": None})

    ChannelClient.connect = connect  # type: ignore[method-assign]
    try:
        yield proxies
    finally:
        ChannelClient.connect = original  # type: ignore[method-assign]
        for p in proxies:
            p.close()
