"""A delaying TCP proxy: added network latency in front of a shard host's round channel.

These machines' kernels have no ``netem``; a proxy in front of each host's channel port
adds a fixed delay to every byte the host sends back (its replies), so a run can be timed
as if its hosts were that much further away. :func:`delayed_channels` routes every round
channel a run opens through a proxy of its own.
"""

from __future__ import annotations

import contextlib
import heapq
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from flymc_dist.transport.channel import ChannelClient

__all__ = ["DelayProxy", "delayed_channels"]


class DelayProxy:
    """Listens on a loopback port and forwards each connection to ``target``: bytes to
    the target at once, bytes from it ``delay`` seconds after they arrived, in order.

    Parameters
    ----------
    target
        ``(host, port)`` to forward to.
    delay
        Seconds added to every reply byte (the added round trip).
    """

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay}")
        self.target = tuple(target)
        self.delay = float(delay)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, name="flymc-delay-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [down, up]
            threading.Thread(target=_pump, args=(down, up), daemon=True).start()
            threading.Thread(target=self._delayed, args=(up, down), daemon=True).start()

    def _delayed(self, src: socket.socket, dst: socket.socket) -> None:
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
                        return
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

        threading.Thread(target=writer, daemon=True).start()
        n = 0
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                with ready:
                    heapq.heappush(queue, (time.monotonic() + self.delay, n, data))
                    n += 1
                    ready.notify()
        except OSError:
            pass
        finally:
            with ready:
                done.set()
                ready.notify()

    def close(self) -> None:
        """Stop listening and close every forwarded connection."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


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
def delayed_channels(delay: Callable[[int], float] | float) -> Iterator[list[DelayProxy]]:
    """Within the block, every round channel the driver connects to a shard host goes
    through a :class:`DelayProxy` of its own: ``delay`` seconds (or ``delay(i)`` for the
    i-th channel connected) added to the host's replies, over TCP (a host's local socket,
    which would bypass the proxy, is not used). Yields the proxies started."""
    original = ChannelClient.connect
    proxies: list[DelayProxy] = []

    def connect(self: Any, key: str, address: tuple[str, int], token: bytes, **kw: Any) -> None:
        d = delay(len(proxies)) if callable(delay) else float(delay)
        proxy = DelayProxy(tuple(address), d)
        proxies.append(proxy)
        original(self, key, proxy.address, token, **{**kw, "local_name": None})

    ChannelClient.connect = connect  # type: ignore[method-assign]
    try:
        yield proxies
    finally:
        ChannelClient.connect = original  # type: ignore[method-assign]
        for p in proxies:
            p.close()
