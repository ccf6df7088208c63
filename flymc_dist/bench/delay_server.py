"""The delaying proxy's process (:class:`~flymc_dist.bench.delay.DelayProxy` starts it
as a script: ``python delay_server.py HOST PORT DELAY CPUS``; the standard library only).

It runs on ``CPUS`` (comma-separated; empty: those it was started on), listens on a
loopback port, prints the port, and forwards each connection to
``HOST:PORT`` — bytes to it at once, bytes from it ``DELAY`` seconds after they arrived,
in order — until its standard input closes.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import socket
import sys
import threading
import time

__all__: list[str] = []


def _serve(target: tuple[str, int], delay: float, cpus: set[int]) -> None:
    """The proxy process: on ``cpus`` (every thread: none is started yet), listen, print
    the port, forward until standard input closes."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(
        target=_accept, args=(listener, target, delay), name="flymc-delay-accept", daemon=True
    ).start()
    print(listener.getsockname()[1], flush=True)
    sys.stdin.buffer.read()  # until the parent closes it, or ends
    # the forwarding threads are daemons: they end with the process


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


if __name__ == "__main__":
    _serve(
        (sys.argv[1], int(sys.argv[2])),
        float(sys.argv[3]),
        {int(c) for c in sys.argv[4].split(",") if c},
    )
