"""A delaying TCP proxy: added network latency in front of a shard host's round channel.

These machines' kernels have no ``netem``; a proxy in front of each host's channel port
adds a fixed delay to every byte the host sends back (its replies), so a run can be timed
as if its hosts were that much further away. Each proxy runs in a process of its own, as
a network in between would: its work takes no CPU time or interpreter lock from the
driver's threads. :func:`delayed_channels` routes every round channel a run opens through
a proxy of its own.

Run as a script (``python delay.py HOST PORT DELAY``, standard library only), this module
is that process: it prints the port it listens on and forwards until its standard input
closes.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

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
        script = os.path.abspath(__file__)
        self._proc = subprocess.Popen(
            [sys.executable, "-I", script, *map(str, self.target), repr(self.delay)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        if cpus is not None:
            os.sched_setaffinity(self._proc.pid, cpus)
        line = self._proc.stdout.readline() if self._proc.stdout else b""
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
            _, err = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        return err.decode(errors="replace")

    def close(self) -> None:
        """Stop the process: every forwarded connection closes with it."""
        self._stop()


def _serve(target: tuple[str, int], delay: float) -> None:
    """The proxy process: listen, print the port, forward until standard input closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(
        target=_accept, args=(listener, target, delay), name="flymc-delay-accept", daemon=True
    ).start()
    print(listener.getsockname()[1], flush=True)
    sys.stdin.buffer.read()  # until the parent closes it, or ends
    os._exit(0)  # the forwarding threads die with the process


def _accept(listener: socket.socket, target: tuple[str, int], delay: float) -> None:
    """Forward each connection ``listener`` accepts to ``target``."""
    while True:
        down, _ = listener.accept()
        try:
            up = socket.create_connection(target)
        except OSError:  # the target is gone: so is this connection
            down.close()
            continue
        for s in (down, up):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_pump, args=(down, up), daemon=True).start()
        threading.Thread(target=_delayed, args=(up, down, delay), daemon=True).start()


def _delayed(src: socket.socket, dst: socket.socket, delay: float) -> None:
    """Forward ``src`` to ``dst``, each chunk ``delay`` seconds after it arrived."""
    queue: list[tuple[float, int, bytes]] = []
    ready = threading.Condition()
    done = threading.Event()

    def writer() -> None:
        while True:
            with ready:
                while not queue and not done.is_set():
                    ready.wait()
                if not queue:
                    break
                due, _, data = queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    ready.wait(wait)
                    continue
                heapq.heappop(queue)
            try:
                dst.sendall(data)
            except OSError:
                return
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    threading.Thread(target=writer, daemon=True).start()
    n = 0
    try:
        while True:
            data = src.recv(1 << 20)
            if not data:
                break
            with ready:
                heapq.heappush(queue, (time.monotonic() + delay, n, data))
                n += 1
                ready.notify()
    except OSError:
        pass
    finally:
        with ready:
            done.set()
            ready.notify()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Forward ``src`` to ``dst`` as it comes; close ``dst``'s sending side at the end."""
    try:
        while True:
            data = src.recv(1 << 20)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def delayed_channels(
    delay: Callable[[int], float] | float, cpus: set[int] | None = None
) -> Iterator[list[DelayProxy]]:
    """Within the block, every round channel the driver connects to a shard host goes
    through a :class:`DelayProxy` of its own: ``delay`` seconds (or ``delay(i)`` for the
    i-th channel connected) added to the host's replies, over TCP (a host's local socket,
    which would bypass the proxy, is not used); each proxy on ``cpus`` (``None``: those of
    the connecting thread). Yields the proxies started."""
    from flymc_dist.transport.channel import ChannelClient

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


if __name__ == "__main__":
    _serve((sys.argv[1], int(sys.argv[2])), float(sys.argv[3]))
