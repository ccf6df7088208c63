"""A direct socket channel between the driver and the shard hosts, for the per-iteration rounds.

A Dask actor call crosses the client's event loop thread, Dask's RPC framing and the
worker's event loop, each way: about 1.5 ms per fan-out on a 2-core machine, more than
a whole FlyMC round of compute. The rounds are the one call made every iteration, so
they get their own channel: each :class:`~flymc_dist.shard.ShardHost` actor listens on
a TCP port of its worker's host, served by a thread of its own, and the driver writes
the packed round to every host and reads the replies, from its own thread, with plain
blocking sockets.

Everything else — placing the actors, set-up calls, recovery — still goes through Dask,
and so does the channel's set-up: the actor opens the port and returns its address and
a random token over the (possibly TLS-authenticated) Dask connection; a connection
that does not present the token first is dropped before anything is unpickled.

A frame is a 9-byte header — a one-byte code and an unsigned 64-bit length, network
order — followed by that many bytes. Requests carry a method code; replies carry
:data:`OK` (the method's ``bytes``) or :data:`ERROR` (a pickled exception).

Limits: at most :data:`MAX_PENDING` connections may be waiting to present the token
(more are closed at once, so idle connections cannot pile up threads), each for at
most 10 s; after the token, a request larger than :data:`MAX_FRAME` closes the
connection. The server holds its handler's owner (the shard host) weakly: closing the
server, or the host being released (by the run, or by Dask when the driver's client
goes away), stops the listening thread and frees the port.
"""

from __future__ import annotations

import hmac
import logging
import pickle
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from flymc_dist.options import CHANNELS, one_of

log = logging.getLogger("flymc_dist")

HEADER = struct.Struct("!BQ")
TOKEN_BYTES = 32
#: connections at most that have not presented the token yet (more are closed at once)
MAX_PENDING = 16
#: the largest request accepted after the token, in bytes (a round is a few kilobytes)
MAX_FRAME = 64 * 2**20

#: request codes
ROUND = 1
ECHO = 2
AHEAD = 3  # a read-ahead request (replica mode: the driver updates z)
#: reply codes
OK = 0
ERROR = 1

#: ``handler(code, payload) -> reply``
Handler = Callable[[int, bytes], bytes]

#: ``after(code)``: run once a request's reply has been sent
After = Callable[[int], None]


#: values of the ``channel`` option (see :class:`~flymc_dist.transport.dask.DaskTransport`)


def check_channel(value: Any) -> str:
    """Validate the ``channel`` option."""
    return one_of(*CHANNELS)("channel", value)


class ChannelError(OSError):
    """A channel connection failed, closed or timed out: its host is treated as lost."""


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from a blocking socket; :class:`ChannelError` if it closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ChannelError("connection closed")
        got += k
    return bytes(buf)


class ChannelServer:
    """The host side: a listening socket on ``host`` and a thread per connection.

    Parameters
    ----------
    handler
        Serves one request (see :data:`Handler`). Exceptions it raises are sent back. A
        bound method is held weakly: once its object is gone, connections are closed.
    host
        The interface to listen on (the worker's own host).
    after
        Run after each reply has been sent (see :data:`After`): the work a request leaves
        for when the driver has its answer. Held as ``handler`` is; its errors are logged
        (the next request meets them again).
    """

    def __init__(self, handler: Handler, host: str, after: After | None = None) -> None:
        # a bound method weakly (its object, the shard host, must not be kept alive by
        # this server's threads), any other callable as it is
        self._handler_ref = weakref.WeakMethod(handler) if hasattr(handler, "__self__") else None
        self._handler = handler if self._handler_ref is None else None
        self._after_ref = (
            weakref.WeakMethod(after) if after is not None and hasattr(after, "__self__") else None
        )
        self._after = after if self._after_ref is None else None
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._pending = 0  # connections that have not presented the token yet
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._accept, name="flymc-channel-accept", daemon=True
        )
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed (shut down)
                return
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                if self._pending >= MAX_PENDING:
                    conn.close()
                    log.warning(
                        "flymc channel: %d connections are waiting to present the "
                        "token; a new one was closed",
                        self._pending,
                    )
                    continue
                self._pending += 1
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="flymc-channel", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        authenticated = False
        try:
            _nodelay(conn)
            conn.settimeout(10.0)  # for the token only
            if not hmac.compare_digest(_recv_exact(conn, TOKEN_BYTES), self.token):
                log.warning("flymc channel: a connection without the token was dropped")
                return
            with self._lock:
                self._pending -= 1
                authenticated = True
            conn.settimeout(None)
            while True:
                code, n = HEADER.unpack(_recv_exact(conn, HEADER.size))
                if n > MAX_FRAME:
                    log.warning(
                        "flymc channel: a request of %d bytes (more than %d) closed its connection",
                        n,
                        MAX_FRAME,
                    )
                    return
                payload = _recv_exact(conn, n)
                handler = self._handler if self._handler_ref is None else self._handler_ref()
                if handler is None:  # the host is gone
                    return
                try:
                    reply = handler(code, payload)
                    status = OK
                except BaseException as e:  # noqa: BLE001 - sent back to the driver
                    status, reply = ERROR, _pickle_error(e)
                del handler
                conn.sendall(HEADER.pack(status, len(reply)) + reply)
                if status == OK:
                    self._run_after(code)
        except (OSError, ChannelError):
            pass  # the driver went away (or this server is closing)
        finally:
            with self._lock:
                self._conns.discard(conn)
                if not authenticated:
                    self._pending -= 1
            conn.close()

    def _run_after(self, code: int) -> None:
        after = self._after if self._after_ref is None else self._after_ref()
        if after is None:
            return
        try:
            after(code)
        except Exception:  # noqa: BLE001 - the next request meets it again, and says so
            log.debug("flymc channel: the work after a reply failed", exc_info=True)

    def close(self) -> None:
        """Stop listening and close every connection (their threads then end).

        The listening socket is shut down before it is closed: on Linux, closing alone
        does not wake the thread blocked in ``accept()``, which would keep the port open
        and its host alive.
        """
        with self._lock:
            self._closed.set()
            conns = list(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10.0)


def _pickle_error(e: BaseException) -> bytes:
    try:
        return pickle.dumps(e)
    except Exception:  # noqa: BLE001 - an unpicklable exception: send its text
        return pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))


class ChannelClient:
    """The driver side: one connection per host, keyed by worker address."""

    def __init__(self) -> None:
        self._socks: dict[str, socket.socket] = {}

    def connect(
        self, key: str, address: tuple[str, int], token: bytes, timeout: float = 10.0
    ) -> None:
        """Connect to a host's :class:`ChannelServer` and present its token."""
        self.drop(key)
        sock = socket.create_connection(tuple(address), timeout=timeout)
        _nodelay(sock)
        sock.sendall(token)
        sock.settimeout(None)
        self._socks[key] = sock

    def __contains__(self, key: str) -> bool:
        return key in self._socks

    def drop(self, key: str) -> None:
        """Close the connection to ``key`` (if any)."""
        sock = self._socks.pop(key, None)
        if sock is not None:
            sock.close()

    def fanout(
        self, code: int, payload: bytes, keys: list[str], timeout: float
    ) -> tuple[dict[str, bytes], dict[str, BaseException]]:
        """Send ``payload`` to every host in ``keys``, then collect their replies.

        Returns ``(replies, failures)``. A connection that fails, closes or does not
        answer within ``timeout`` seconds is dropped and reported as a
        :class:`ChannelError`; an exception raised by the host's handler is reported
        as itself (the connection stays usable).
        """
        pending, bad = self.post(code, payload, keys)
        ok, late = self.collect(pending, timeout)
        return ok, {**bad, **late}

    def post(
        self, code: int, payload: bytes, keys: list[str]
    ) -> tuple[list[str], dict[str, BaseException]]:
        """Send ``payload`` to every host in ``keys`` without waiting for the replies
        (:meth:`collect` reads them; a connection carries one request at a time).
        Returns the hosts it went to and the failures."""
        frame = HEADER.pack(code, len(payload)) + payload
        bad: dict[str, BaseException] = {}
        pending: list[str] = []
        for k in keys:
            sock = self._socks.get(k)
            if sock is None:
                bad[k] = ChannelError(f"no channel to {k}")
                continue
            try:
                sock.sendall(frame)
                pending.append(k)
            except OSError as e:
                self.drop(k)
                bad[k] = ChannelError(f"sending to {k} failed: {e!r}")
        return pending, bad

    def collect(
        self, keys: list[str], timeout: float
    ) -> tuple[dict[str, bytes], dict[str, BaseException]]:
        """The replies to the requests :meth:`post` sent to ``keys``, within ``timeout``
        seconds (as :meth:`fanout`)."""
        ok: dict[str, bytes] = {}
        bad: dict[str, BaseException] = {}
        deadline = time.monotonic() + timeout
        for k in keys:
            sock = self._socks.get(k)
            if sock is None:
                bad[k] = ChannelError(f"no channel to {k}")
                continue
            try:
                # hosts compute concurrently: reading them in turn waits for the slowest
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                status, n = HEADER.unpack(_recv_exact(sock, HEADER.size))
                body = _recv_exact(sock, n)
                sock.settimeout(None)
            except (OSError, ChannelError) as e:
                self.drop(k)
                bad[k] = ChannelError(f"no reply from {k}: {e!r}")
                continue
            if status == OK:
                ok[k] = body
            else:
                bad[k] = pickle.loads(body)
        return ok, bad

    def close(self) -> None:
        """Close every connection."""
        for k in list(self._socks):
            self.drop(k)
