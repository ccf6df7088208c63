"""A direct socket channel between the driver and the shard hosts, for the per-iteration rounds.

A Dask actor call crosses the client's event loop thread, Dask's RPC framing and the
worker's event loop, each way: about 1.5 ms per fan-out on a 2-core machine, more than
a whole FlyMC round of compute. The rounds are the one call made every iteration, so
they get their own channel: each :class:`~flymc_dist.shard.ShardHost` actor listens on
a TCP port of its worker's host (and on a local socket, for a driver on its machine),
served by a thread of its own, and the driver writes the packed round to every host and
reads the replies, from its own thread, with plain blocking sockets.

Trust: the channel is never weaker than the Dask comms that set it up.

- The driver draws a random key per run (:attr:`ChannelClient.secret`) and hands it to
  each host through Dask's own connection (with TLS, encrypted); it never travels on the
  channel. The channel is only used on a plain ``tcp://`` cluster, where Dask's comms are
  no more private than it is: on a TLS cluster rounds go through Dask
  (:class:`~flymc_dist.transport.dask.DaskTransport`).
- A connection starts with a handshake: the server sends a random nonce, the client
  answers with its own nonce and an HMAC-SHA256 of both under the key, the server proves
  it holds the key too. Both nonces give the connection's session key.
- Every frame then carries a sequence number (1, 2, … per connection and direction) and
  an HMAC-SHA256 under the session key of its direction, header and payload. A forged
  frame, a frame replayed (on this connection or another) or out of order, a handshake
  without the key, or a second driver while one is connected is refused before anything
  is read from it, logged and counted (:attr:`ChannelServer.refused`), and its connection
  closed: it is never applied.
- A host on the driver's machine is also reached by a local socket (Linux: an abstract
  Unix-domain socket of the host's network namespace, :data:`LOCAL`): the server takes
  a local connection only from a process of its own user (``SO_PEERCRED``), then the
  same handshake under the run's key. Its bytes never leave the kernel, which delivers
  them between the two ends only: no one else can inject, alter or replay a frame, which
  is what the MACs guard against on TCP. So its frames are numbered but carry no MAC
  (on a read-ahead reply of 1.6 MB the MACs cost 0.9 ms at each end); a TCP connection
  to the same server is MAC'd as ever (the server decides by the socket it accepted on,
  never by what a client says). A process of the same user could read either process's
  memory anyway.
- Nothing received is unpickled: payloads are the fixed binary layout of
  :mod:`flymc_dist.protocol`, and an error comes back as a code and a UTF-8 message
  (:func:`encode_error`).

A frame is a 17-byte header — a one-byte code, an unsigned 64-bit sequence number and
an unsigned 64-bit length, network order — that many bytes, and (TCP) a 32-byte MAC.
Requests carry a method code; replies carry :data:`OK` (the method's ``bytes``), :data:`ERROR` or
:data:`LOST` (a relay's subtree lost hosts).

Relaying (:data:`ROUND_TREE`): a host may also hold one connection from its parent in a
tree of hosts, which forwards the driver's rounds to it. The parent authenticates with the
same run's key (handed to every host through Dask), under a handshake and session keys of
its own role (:data:`ROLES`), so a relayed frame is authenticated, numbered and refused
like any other, and neither role's frames are valid on the other's connection.

Limits: at most :data:`MAX_PENDING` connections may be in their handshake (more are
closed at once, so idle connections cannot pile up threads), each for at most 10 s; a
request larger than :data:`MAX_FRAME` closes the connection unread. The server holds its
handler's owner (the shard host) weakly: closing the server, or the host being released
(by the run, or by Dask when the driver's client goes away), stops the listening thread
and frees the port.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from flymc_dist.options import CHANNELS, one_of

log = logging.getLogger("flymc_dist")

HEADER = struct.Struct("!BQQ")
#: bytes of the per-run key, of each side's nonce, and of a MAC
KEY_BYTES = 32
NONCE_BYTES = 16
MAC_BYTES = 32
#: the server's greeting, before its nonce
GREETING = b"FLYMC-CH1"
#: whether hosts listen on a local socket too: Linux (abstract Unix-domain sockets, which
#: are bound to their network namespace and leave no file behind, and ``SO_PEERCRED``)
LOCAL = sys.platform.startswith("linux") and hasattr(socket, "SO_PEERCRED")
#: a local socket's name: this prefix and random hex (the abstract namespace's leading
#: NUL is added where the socket is bound or reached)
LOCAL_PREFIX = "flymc-channel-"
_UCRED = struct.Struct("3i")  # SO_PEERCRED's pid, uid, gid
#: connections at most that are in their handshake (more are closed at once)
MAX_PENDING = 16
#: the largest request accepted, in bytes (a round is a few kilobytes)
MAX_FRAME = 64 * 2**20

#: request codes
ROUND = 1
ECHO = 2
AHEAD = 3  # a read-ahead request (replica mode: the driver updates z)
ROUND_TREE = 4  # a round relayed down the tree of hosts (see ShardHost.round_tree)
CALLS = 5  # shard calls by name (austerity's test trips, JointDPM's shard methods)
LEND = 6  # the shards' rows in shared memory, lent to a driver on a local socket only
#: reply codes
OK = 0
ERROR = 1
LOST = 2  # a relay lost hosts of its subtree: their worker addresses, one a line

#: who may connect to a host, by the tag its handshake is keyed with: the driver, and
#: the host's parent in the relay tree (one connection each at a time)
ROLES = {"driver": b"", "parent": b"relay"}


class WithFds(NamedTuple):
    """A reply that carries open file descriptors besides its bytes (:data:`LEND`'s),
    passed by the kernel (``SCM_RIGHTS``) on a local connection only."""

    payload: bytes
    fds: list[int]


#: a reply: one buffer, or its parts in order (sent as they are, not joined first), or
#: a buffer with descriptors
Payload = bytes | list[bytes | memoryview] | WithFds
#: descriptors one reply may carry at most
MAX_FDS = 64

#: ``handler(code, payload) -> reply``
Handler = Callable[[int, bytes], Payload]

#: frames up to this many bytes are joined and MAC'd in one piece (one-shot HMAC, one
#: send, bytes); longer ones are sent and MAC'd part by part and read into one buffer
#: (a view of it), never copied whole
JOIN_BYTES = 1 << 16

#: ``after(code)``: run once a request's reply has been sent
After = Callable[[int], None]

#: the exception types an error reply names, by code (a subclass travels as the first
#: listed it derives from, its own name in the message; anything else as RuntimeError)
ERROR_TYPES: tuple[type[BaseException], ...] = (
    RuntimeError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    FloatingPointError,
    ArithmeticError,
    MemoryError,
    NotImplementedError,
    OSError,
)
_ERROR = struct.Struct("!H")


def check_channel(value: Any) -> str:
    """Validate the ``channel`` option."""
    return one_of(*CHANNELS)("channel", value)


class ChannelError(OSError):
    """A channel connection failed, closed or timed out: its host is treated as lost."""


class HostsLost(ChannelError):
    """Hosts below a relay were lost (``workers``: their keys): raised by a relay's
    handler, it travels to the driver as a :data:`LOST` reply naming them."""

    def __init__(self, workers: list[str]) -> None:
        super().__init__(f"hosts lost below a relay: {workers}")
        self.workers = list(workers)


def encode_error(e: BaseException) -> bytes:
    """An exception as an error reply: the code of its type in :data:`ERROR_TYPES` and
    its message in UTF-8 (prefixed with its own type's name when that is not listed)."""
    code = next((i for i, t in enumerate(ERROR_TYPES) if isinstance(e, t)), 0)
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    if type(e) is not ERROR_TYPES[code]:
        text = f"{type(e).__name__}: {text}"
    return _ERROR.pack(code) + text.encode("utf-8", "replace")[: 1 << 16]


def decode_error(body: bytes) -> BaseException:
    """Invert :func:`encode_error`: a new exception of the named type (an unknown code or
    a malformed body: a :class:`ChannelError`, the host being treated as lost)."""
    if len(body) < _ERROR.size:
        return ChannelError("a malformed error reply")
    (code,) = _ERROR.unpack_from(body)
    if code >= len(ERROR_TYPES):
        return ChannelError(f"an error reply of unknown code {code}")
    return ERROR_TYPES[code](body[_ERROR.size :].decode("utf-8", "replace"))


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from a blocking socket; :class:`ChannelError` if it closes first."""
    buf = bytearray(n)
    _fill(sock, buf)
    return bytes(buf)


def _recv_view(sock: socket.socket, n: int) -> memoryview:
    """:func:`_recv_exact`'s bytes as a read-only view of the buffer they were read into
    (a large reply is not copied again: its MAC is checked on it by :func:`_mac_parts`)."""
    buf = bytearray(n)
    _fill(sock, buf)
    return memoryview(buf).toreadonly()


def _fill(sock: socket.socket, buf: bytearray) -> None:
    view = memoryview(buf)
    got, n = 0, len(buf)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ChannelError("connection closed")
        got += k


def _mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of ``parts`` under ``key`` (one-shot: OpenSSL's fast path)."""
    return hmac.digest(key, b"".join(parts), "sha256")


def _mac_parts(key: bytes, *parts: bytes | memoryview) -> bytes:
    """:func:`_mac` fed part by part: for a frame longer than :data:`JOIN_BYTES`, whose
    parts are not copied into one buffer (a short one costs more this way)."""
    h = hmac.new(key, digestmod="sha256")
    for p in parts:
        h.update(p)
    return h.digest()


def _tag(role: str, local: bool) -> bytes:
    """The handshake's domain: the client's role (:data:`ROLES`) and whether the
    connection is local (each its own proofs and keys)."""
    return ROLES[role] + (b"local" if local else b"")


def _session(
    secret: bytes,
    server_nonce: bytes,
    client_nonce: bytes,
    role: str = "driver",
    local: bool = False,
) -> tuple[bytes, bytes]:
    """The connection's handshake proof (the client's) and its session key, for a client
    of ``role`` (see :data:`ROLES`: each role's proofs and keys are its own) on a TCP or
    a local connection."""
    tag = _tag(role, local)
    return (
        _mac(secret, b"hello" + tag, server_nonce, client_nonce),
        _mac(secret, b"session" + tag, server_nonce, client_nonce),
    )


def _frame(
    session: bytes, direction: bytes, code: int, seq: int, payload: bytes, local: bool = False
) -> bytes:
    header = HEADER.pack(code, seq, len(payload))
    if local:  # a local connection's frames carry no MAC (see the module notes)
        return header + payload
    return header + payload + _mac(session, direction, header, payload)


def _send_frame(
    sock: socket.socket,
    session: bytes,
    direction: bytes,
    code: int,
    seq: int,
    payload: Payload,
    local: bool = False,
) -> None:
    """:func:`_frame` of ``payload`` (its parts joined) sent on ``sock``: a large one part
    by part, its MAC fed the same parts (the frame's bytes are the same); a
    :class:`WithFds` in one message, its descriptors with its first byte (local only)."""
    if isinstance(payload, WithFds):
        if not local or len(payload.fds) > MAX_FDS:
            raise ChannelError("descriptors travel on a local connection only, a few at a time")
        frame = _frame(session, direction, code, seq, payload.payload, local)
        sent = socket.send_fds(sock, [frame], payload.fds)
        if sent < len(frame):
            sock.sendall(frame[sent:])
        return
    if isinstance(payload, bytes):
        sock.sendall(_frame(session, direction, code, seq, payload, local))
        return
    n = sum(memoryview(p).nbytes for p in payload)
    if n <= JOIN_BYTES:
        sock.sendall(_frame(session, direction, code, seq, b"".join(payload), local))
        return
    header = HEADER.pack(code, seq, n)
    mac = () if local else (_mac_parts(session, direction, header, *payload),)
    small: list[bytes] = []  # runs of small parts go out joined
    for p in (header, *payload, *mac):
        if memoryview(p).nbytes < 4096:
            small.append(bytes(p))
            continue
        if small:
            sock.sendall(b"".join(small))
            small = []
        sock.sendall(p)
    if small:
        sock.sendall(b"".join(small))


class Refused(Exception):
    """A frame or handshake the server refused (never applied); ``reason`` counts it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class ChannelServer:
    """The host side: a listening socket on ``host`` (and, where :data:`LOCAL`, a local
    socket named :attr:`local_name`) and a thread per connection.

    Parameters
    ----------
    handler
        Serves one request (see :data:`Handler`). Exceptions it raises are sent back
        (:func:`encode_error`). A bound method is held weakly: once its object is gone
        (Dask dropped the actor: its run released it, or the run's client went away),
        the server stops and its port is freed.
    host
        The interface to listen on (the worker's own host).
    secret
        The run's key (:attr:`ChannelClient.secret`, :data:`KEY_BYTES` bytes), handed
        over through Dask.
    after
        Run after each reply has been sent (see :data:`After`): the work a request leaves
        for when the driver has its answer. Held as ``handler`` is; its errors are logged
        (the next request meets them again).
    """

    def __init__(
        self, handler: Handler, host: str, secret: bytes, after: After | None = None
    ) -> None:
        if not isinstance(secret, bytes) or len(secret) != KEY_BYTES:
            raise ValueError(f"secret must be {KEY_BYTES} bytes")
        # a bound method weakly (its object, the shard host, must not be kept alive by
        # this server's threads), any other callable as it is
        self._handler_ref = weakref.WeakMethod(handler) if hasattr(handler, "__self__") else None
        self._handler = handler if self._handler_ref is None else None
        self._after_ref = (
            weakref.WeakMethod(after) if after is not None and hasattr(after, "__self__") else None
        )
        self._after = after if self._after_ref is None else None
        self._secret = secret
        #: refused handshakes and frames, by reason (never applied)
        self.refused: collections.Counter[str] = collections.Counter()
        listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = listener.getsockname()[:2]
        #: the local socket's name (None: not on this platform), for a driver on this
        #: machine and in this network namespace (:meth:`ChannelClient.connect`)
        self.local_name: str | None = None
        listeners = [(listener, False)]
        if LOCAL:
            name = LOCAL_PREFIX + secrets.token_hex(16)
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                local.bind("\0" + name)
                local.listen()
                listeners.append((local, True))
                self.local_name = name
            except OSError as e:  # e.g. a sandbox without Unix-domain sockets: TCP only
                local.close()
                log.debug("flymc channel: no local socket (%r): TCP only", e)
        self._listeners = [sock for sock, _ in listeners]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._pending = 0  # connections in their handshake
        #: the authenticated connections, one per role (:data:`ROLES`)
        self._peers: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(
                target=self._accept, args=pair, name="flymc-channel-accept", daemon=True
            )
            for pair in listeners
        ]
        for t in self._threads:
            t.start()
        if self._handler_ref is not None:  # the handler's object gone, the server stops
            weakref.finalize(handler.__self__, self.close)

    def _accept(self, listener: socket.socket, local: bool) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:  # closed (shut down)
                return
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                if self._pending >= MAX_PENDING:
                    conn.close()
                    log.warning(
                        "flymc channel: %d connections are in their handshake; a new "
                        "one was closed",
                        self._pending,
                    )
                    continue
                self._pending += 1
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn, local), name="flymc-channel", daemon=True
            ).start()

    def _refuse(self, conn: socket.socket, why: Refused) -> None:
        with self._lock:
            self.refused[why.reason] += 1
        try:
            peer = conn.getpeername() or "a local socket"
        except OSError:
            peer = "?"
        log.warning(
            "flymc channel: refused %s from %s (%s); nothing applied", why.reason, peer, why
        )

    def _handshake(self, conn: socket.socket, local: bool) -> tuple[str, bytes]:
        """Authenticate the driver, or the host's parent in the relay tree; its role and
        session key. :class:`Refused` if it has not the run's key, or another client of
        its role is connected, or (``local``) it is another user's process."""
        if local and (uid := _peer_uid(conn)) != os.getuid():
            raise Refused("local peer", f"a local connection of user {uid}")
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        conn.sendall(GREETING + server_nonce)
        answer = _recv_exact(conn, NONCE_BYTES + MAC_BYTES)
        client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        for role in ROLES:
            expected, session = _session(self._secret, server_nonce, client_nonce, role, local)
            if hmac.compare_digest(proof, expected):
                break
        else:
            raise Refused("handshake", "a connection without the run's key")
        with self._lock:
            if role in self._peers:
                raise Refused(f"second {role}", f"a {role} is connected already")
            self._peers[role] = conn
            self._pending -= 1
        conn.sendall(_mac(self._secret, b"welcome" + _tag(role, local), server_nonce, client_nonce))
        return role, session

    def _read_request(
        self, conn: socket.socket, session: bytes, seq: int, local: bool
    ) -> tuple[int, bytes]:
        """The next request, authenticated (TCP: by its MAC; local: by the connection):
        :class:`Refused` if it is larger than :data:`MAX_FRAME`, forged, replayed or out
        of order."""
        header = _recv_exact(conn, HEADER.size)
        code, got, n = HEADER.unpack(header)
        if n > MAX_FRAME:
            raise Refused("oversized frame", f"a request of {n} bytes (more than {MAX_FRAME})")
        if local:
            payload = _recv_exact(conn, n)
        else:
            body = _recv_exact(conn, n + MAC_BYTES)  # the payload and its MAC, in one read
            payload, mac = body[:n], body[n:]
            if not hmac.compare_digest(mac, _mac(session, b"Q", header, payload)):
                raise Refused("forged frame", f"a request of {n} bytes with a wrong MAC")
        if got != seq:
            raise Refused("replayed frame", f"a request numbered {got}, expected {seq}")
        return code, payload

    def _serve(self, conn: socket.socket, local: bool) -> None:
        role = None
        try:
            if not local:
                _nodelay(conn)
            conn.settimeout(10.0)  # for the handshake only
            role, session = self._handshake(conn, local)
            conn.settimeout(None)
            seq = 1
            while True:
                code, payload = self._read_request(conn, session, seq, local)
                handler = self._handler if self._handler_ref is None else self._handler_ref()
                if handler is None:  # the host is gone
                    return
                try:
                    if code == LEND and not local:
                        raise PermissionError("rows are lent on a local socket only")
                    reply = handler(code, payload)
                    status = OK
                except HostsLost as e:  # a relay's subtree: named to the driver
                    status, reply = LOST, "\n".join(e.workers).encode("utf-8")
                except BaseException as e:  # noqa: BLE001 - sent back to the driver
                    status, reply = ERROR, encode_error(e)
                del handler
                _send_frame(conn, session, b"A", status, seq, reply, local)
                seq += 1
                if status == OK:
                    self._run_after(code)
        except Refused as why:
            self._refuse(conn, why)
        except (OSError, ChannelError):
            pass  # the driver went away (or this server is closing)
        finally:
            with self._lock:
                self._conns.discard(conn)
                if role is not None and self._peers.get(role) is conn:
                    del self._peers[role]  # authenticated (no longer pending) in one step
                else:
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

        The listening sockets are shut down before they are closed: on Linux, closing
        alone does not wake the thread blocked in ``accept()``, which would keep the port
        open and its host alive.
        """
        with self._lock:
            self._closed.set()
            conns = list(self._conns)
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            if threading.current_thread() is not t:
                t.join(timeout=10.0)


class _Connection:
    """One authenticated connection of the driver: its socket, session key, whether it is
    local (frames without MACs) and the sequence number of its next request."""

    def __init__(self, sock: socket.socket, session: bytes, local: bool) -> None:
        self.sock = sock
        self.session = session
        self.local = local
        self.seq = 1


def _peer_uid(sock: socket.socket) -> int:
    """The user of the process at the other end of a local socket (``SO_PEERCRED``)."""
    _pid, uid, _gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return uid


def _connect_local(name: str | None, timeout: float) -> socket.socket | None:
    """A connection to the local socket ``name`` (see :attr:`ChannelServer.local_name`),
    or None: none given, not on this platform, not reachable from here (the host is on
    another machine, or in another network namespace), or held by another user's process
    (whose server would refuse this one: TCP then, as to a host elsewhere)."""
    if name is None or not LOCAL:
        return None
    if not (isinstance(name, str) and name.startswith(LOCAL_PREFIX) and len(name) < 100):
        raise ValueError(f"not a round channel's local socket name: {name!r}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect("\0" + name)
        if _peer_uid(sock) == os.getuid():
            return sock
    except OSError:
        pass
    sock.close()
    return None


class ChannelClient:
    """The driver side: one connection per host, keyed by worker address.

    Draws the run's key (:attr:`secret`): hand it to each host through Dask before
    connecting (:class:`ChannelServer`'s ``secret``).
    """

    def __init__(self) -> None:
        self._conns: dict[str, _Connection] = {}
        #: the run's key (never sent on the channel)
        self.secret = secrets.token_bytes(KEY_BYTES)

    def connect(
        self,
        key: str,
        address: tuple[str, int],
        secret: bytes,
        timeout: float = 10.0,
        role: str = "driver",
        local_name: str | None = None,
    ) -> None:
        """Connect to a host's :class:`ChannelServer` and authenticate with ``secret``
        (the run's key; :class:`ChannelError` if the host does not prove it holds it),
        as the driver or as the host's parent in the relay tree (``role``, see
        :data:`ROLES`): by its local socket ``local_name`` where that is reachable from
        here (:meth:`is_local` then says so), else by TCP to ``address``."""
        self.drop(key)
        sock = _connect_local(local_name, timeout)
        local = sock is not None
        if sock is None:
            sock = socket.create_connection(tuple(address), timeout=timeout)
        try:
            if not local:
                _nodelay(sock)
            hello = _recv_exact(sock, len(GREETING) + NONCE_BYTES)
            if not hello.startswith(GREETING):
                raise ChannelError(f"{address} is not a flymc round channel")
            server_nonce = hello[len(GREETING) :]
            client_nonce = secrets.token_bytes(NONCE_BYTES)
            proof, session = _session(secret, server_nonce, client_nonce, role, local)
            sock.sendall(client_nonce + proof)
            try:
                welcome = _recv_exact(sock, MAC_BYTES)
            except ChannelError:
                raise ChannelError(
                    f"the round channel at {address} refused the handshake (not this run's "
                    "key, or another driver is connected)"
                ) from None
            if not hmac.compare_digest(
                welcome, _mac(secret, b"welcome" + _tag(role, local), server_nonce, client_nonce)
            ):
                raise ChannelError(f"the round channel at {address} does not hold the run's key")
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self._conns[key] = _Connection(sock, session, local)

    def __contains__(self, key: str) -> bool:
        return key in self._conns

    def is_local(self, key: str) -> bool:
        """Whether the connection to ``key`` is a local socket (False: TCP, or none)."""
        conn = self._conns.get(key)
        return conn is not None and conn.local

    def closed(self, key: str) -> bool:
        """Whether the host ``key`` has gone, seen without waiting: no connection, or its
        connection closed from the host's end (its process died) or holding bytes it
        was never asked for. For a host asked nothing for a while (one that lends its
        rows): a request would say so only when it is sent."""
        conn = self._conns.get(key)
        if conn is None:
            return True
        readable, _, _ = select.select([conn.sock], [], [], 0)
        if not readable:
            return False
        try:
            conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            pass
        return True  # closed (b""), failed, or bytes unasked for

    def drop(self, key: str) -> None:
        """Close the connection to ``key`` (if any)."""
        conn = self._conns.pop(key, None)
        if conn is not None:
            conn.sock.close()

    def fanout(
        self, code: int, payload: bytes, keys: list[str], timeout: float
    ) -> tuple[dict[str, bytes | memoryview], dict[str, BaseException]]:
        """Send ``payload`` to every host in ``keys``, then collect their replies.

        Returns ``(replies, failures)``. A connection that fails, closes, does not answer
        within ``timeout`` seconds, or answers with a reply that is not authentic and in
        order is dropped and reported as a :class:`ChannelError`; a reply longer than
        :data:`MAX_FRAME` is dropped unread and reported as a ``ValueError`` (the host
        is not lost: it answered what it was asked); an exception raised by the host's
        handler is reported as a new one of its type (:func:`decode_error`; the
        connection stays usable).
        """
        pending, bad = self.post(code, payload, keys)
        ok, late = self.collect(pending, timeout)
        return ok, {**bad, **late}

    def fanout_each(
        self, code: int, payloads: dict[str, bytes], timeout: float
    ) -> tuple[dict[str, bytes | memoryview], dict[str, BaseException]]:
        """:meth:`fanout` with a payload of its own for each host (``key → payload``):
        every request sent, then every reply read (the hosts compute concurrently)."""
        pending: list[str] = []
        bad: dict[str, BaseException] = {}
        for key, payload in payloads.items():
            sent, failed = self.post(code, payload, [key])
            pending += sent
            bad.update(failed)
        ok, late = self.collect(pending, timeout)
        return ok, {**bad, **late}

    def post(
        self, code: int, payload: bytes, keys: list[str]
    ) -> tuple[list[str], dict[str, BaseException]]:
        """Send ``payload`` to every host in ``keys`` without waiting for the replies
        (:meth:`collect` reads them; a connection carries one request at a time).
        Returns the hosts it went to and the failures."""
        bad: dict[str, BaseException] = {}
        pending: list[str] = []
        for k in keys:
            conn = self._conns.get(k)
            if conn is None:
                bad[k] = ChannelError(f"no channel to {k}")
                continue
            try:
                conn.sock.sendall(_frame(conn.session, b"Q", code, conn.seq, payload, conn.local))
                pending.append(k)
            except OSError as e:
                self.drop(k)
                bad[k] = ChannelError(f"sending to {k} failed: {e!r}")
        return pending, bad

    def collect(
        self, keys: list[str], timeout: float
    ) -> tuple[dict[str, bytes | memoryview], dict[str, BaseException]]:
        """The replies to the requests :meth:`post` sent to ``keys``, within ``timeout``
        seconds (as :meth:`fanout`; one longer than :data:`JOIN_BYTES` is a read-only view
        of the buffer it was read into)."""
        ok: dict[str, bytes | memoryview] = {}
        bad: dict[str, BaseException] = {}
        deadline = time.monotonic() + timeout
        for k in keys:
            conn = self._conns.get(k)
            if conn is None:
                bad[k] = ChannelError(f"no channel to {k}")
                continue
            sock = conn.sock
            try:
                # hosts compute concurrently: reading them in turn waits for the slowest
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                header = _recv_exact(sock, HEADER.size)
                status, seq, n = HEADER.unpack(header)
                if n > MAX_FRAME:
                    # the host is alive and the reply is what was asked: not a lost host
                    # (recreating its shards would only ask again), an error of the run
                    self.drop(k)
                    bad[k] = ValueError(
                        f"{k} replied with {n:,} bytes, more than the round channel's "
                        f"frames of at most {MAX_FRAME:,}"
                    )
                    continue
                tail = 0 if conn.local else MAC_BYTES  # a local frame has no MAC
                if n <= JOIN_BYTES:
                    body = _recv_exact(sock, n + tail)
                else:  # a view of the buffer read into: not copied again
                    body = _recv_view(sock, n + tail)
                body, mac = body[:n], bytes(body[n:])
                sock.settimeout(None)
                if not conn.local:
                    mac_of = _mac if n <= JOIN_BYTES else _mac_parts
                    if not hmac.compare_digest(mac, mac_of(conn.session, b"A", header, body)):
                        raise ChannelError("a reply with a wrong MAC")
                if seq != conn.seq:
                    raise ChannelError(f"reply numbered {seq}, expected {conn.seq}")
            except (OSError, ChannelError) as e:
                self.drop(k)
                bad[k] = ChannelError(f"no reply from {k}: {e!r}")
                continue
            conn.seq += 1
            if status == OK:
                ok[k] = body
            elif status == LOST:
                bad[k] = HostsLost(bytes(body).decode("utf-8", "replace").split("\n"))
            else:
                bad[k] = decode_error(bytes(body))
        return ok, bad

    def borrow(self, key: str, timeout: float) -> tuple[bytes, list[int]]:
        """Ask the host ``key`` for its rows' shared memory (:data:`LEND`): its reply's
        bytes and the descriptors the kernel passed with them (the caller closes them).
        A local connection only; :class:`ChannelError` if the connection fails (then it
        is dropped), the host's error (of its type) if it lends nothing."""
        conn = self._conns.get(key)
        if conn is None or not conn.local:
            raise ChannelError(f"no local channel to {key}")
        sock, fds = conn.sock, []
        try:
            sock.settimeout(timeout)
            sock.sendall(_frame(conn.session, b"Q", LEND, conn.seq, b"", True))
            head, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, MAX_FDS)
            if not head:
                raise ChannelError("connection closed")
            header = head + _recv_exact(sock, HEADER.size - len(head))
            status, seq, n = HEADER.unpack(header)
            if n > MAX_FRAME or seq != conn.seq:
                raise ChannelError(f"a reply of {n} bytes numbered {seq}, expected {conn.seq}")
            body = _recv_exact(sock, n)
            sock.settimeout(None)
        except (OSError, ChannelError) as e:
            for fd in fds:
                os.close(fd)
            self.drop(key)
            raise ChannelError(f"no reply from {key}: {e!r}") from e
        conn.seq += 1
        if status != OK:
            for fd in fds:
                os.close(fd)
            raise decode_error(body)
        return body, list(fds)

    def close(self) -> None:
        """Close every connection."""
        for k in list(self._conns):
            self.drop(k)
