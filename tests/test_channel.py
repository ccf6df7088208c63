"""The rounds' socket channel (flymc_dist.transport.channel), on real sockets in this process."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

import flymc_dist as fd
from flymc_dist.transport.channel import (
    ECHO,
    ROUND,
    TOKEN_BYTES,
    ChannelClient,
    ChannelError,
    ChannelServer,
    check_channel,
)


class _Handler:
    """Echoes ECHO; ROUND raises ValueError on b"bad", sleeps on b"slow", else reverses."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bytes]] = []

    def __call__(self, code: int, payload: bytes):
        self.calls.append((code, payload))
        if code == ECHO:
            return payload
        if payload == b"bad":
            raise ValueError("a real error in the round")
        if payload == b"slow":
            time.sleep(2.0)
        return payload[::-1]


@pytest.fixture()
def pair():
    servers = [ChannelServer(_Handler(), "127.0.0.1") for _ in range(2)]
    client = ChannelClient()
    for i, s in enumerate(servers):
        client.connect(f"w{i}", s.address, s.token)
    yield servers, client
    client.close()
    for s in servers:
        s.close()


def test_fanout_round_trip(pair):
    servers, client = pair
    ok, bad = client.fanout(ECHO, b"x" * 5000, ["w0", "w1"], timeout=5)
    assert not bad and ok == {"w0": b"x" * 5000, "w1": b"x" * 5000}
    ok, bad = client.fanout(ROUND, b"abc", ["w0", "w1"], timeout=5)
    assert ok == {"w0": b"cba", "w1": b"cba"} and not bad
    # many in a row on the same connections
    for i in range(200):
        ok, _ = client.fanout(ROUND, str(i).encode(), ["w0", "w1"], timeout=5)
        assert ok["w1"] == str(i).encode()[::-1]


def test_handler_error_comes_back_as_itself_and_connection_survives(pair):
    _, client = pair
    ok, bad = client.fanout(ROUND, b"bad", ["w0"], timeout=5)
    assert not ok and isinstance(bad["w0"], ValueError) and "real error" in str(bad["w0"])
    assert not isinstance(bad["w0"], OSError)  # a real error, not a lost host
    ok, bad = client.fanout(ROUND, b"ok", ["w0"], timeout=5)
    assert ok == {"w0": b"ko"} and not bad


def test_closed_server_is_a_lost_host(pair):
    servers, client = pair
    servers[1].close()
    ok, bad = client.fanout(ROUND, b"abc", ["w0", "w1"], timeout=5)
    assert ok == {"w0": b"cba"}
    assert isinstance(bad["w1"], ChannelError) and isinstance(bad["w1"], OSError)
    assert "w1" not in client  # dropped: the transport recovers the host's shards
    _, bad = client.fanout(ROUND, b"abc", ["w1"], timeout=5)
    assert isinstance(bad["w1"], ChannelError)


def test_timeout_is_a_lost_host(pair):
    _, client = pair
    t = time.perf_counter()
    ok, bad = client.fanout(ROUND, b"slow", ["w0"], timeout=0.3)
    assert time.perf_counter() - t < 1.5
    assert not ok and isinstance(bad["w0"], ChannelError)
    assert "w0" not in client


def test_connection_without_token_is_dropped_before_anything_runs():
    handler = _Handler()
    server = ChannelServer(handler, "127.0.0.1")
    try:
        with socket.create_connection(server.address, timeout=5) as s:
            s.sendall(b"\0" * TOKEN_BYTES)  # wrong token, then a well-formed request
            s.sendall(bytes([ECHO]) + (3).to_bytes(8, "big") + b"abc")
            try:  # closed without a reply (reset: our request was never read)
                assert s.recv(100) == b""
            except ConnectionResetError:
                pass
        assert handler.calls == []
        # a client with the wrong token learns it as a lost host
        client = ChannelClient()
        client.connect("w", server.address, b"\1" * TOKEN_BYTES)
        ok, bad = client.fanout(ECHO, b"abc", ["w"], timeout=5)
        assert not ok and isinstance(bad["w"], ChannelError)
        assert handler.calls == []
        client.close()
    finally:
        server.close()


def test_check_channel():
    for v in ("auto", "socket", "dask"):
        assert check_channel(v) == v
    for v in ("tcp", None, 1, "Socket"):
        with pytest.raises(ValueError, match="channel must be 'auto', 'socket' or 'dask'"):
            check_channel(v)


def test_sample_rejects_bad_channel_before_writing(tmp_path):
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(50), rng.normal(size=50)])
    y = (rng.random(50) < 0.5).astype(float)
    trace = tmp_path / "t.zarr"
    with pytest.raises(ValueError, match="channel must be 'auto', 'socket' or 'dask'"):
        fd.sample(
            fd.LogisticRegression(),
            (X, y),
            client="synchronous",
            num_warmup=5,
            num_samples=5,
            chains=1,
            progress=False,
            channel="udp",
            trace=str(trace),
        )
    assert not trace.exists()


def _refused(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=5).close()
    except OSError:
        return True
    return False


def test_close_wakes_the_accept_thread_and_frees_the_port():
    server = ChannelServer(_Handler(), "127.0.0.1")
    assert not _refused(server.address)
    server.close()
    assert not server._thread.is_alive()  # woken from accept(), not left blocked forever
    assert _refused(server.address)


def test_a_released_host_stops_its_channel():
    """The server holds its host weakly: when the host is dropped (Dask releasing the
    actor), its channel stops, its threads end and its port is freed."""
    import gc
    import weakref

    from flymc_dist.protocol import ShardConfig, ShardSpec
    from flymc_dist.shard import ShardHost

    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(30), rng.normal(size=30)])
    y = (rng.random(30) < 0.5).astype(np.int64)
    config = ShardConfig(
        model=fd.LogisticRegression(), algorithm="flymc", chains=1, seed=0, n_rows=30
    )
    host = ShardHost([ShardSpec(0, "", 0, 30)], config, {0: (X, y)})
    address, token = host.open_channel("127.0.0.1")
    client = ChannelClient()
    client.connect("w", address, token)
    ok, bad = client.fanout(ECHO, b"abc", ["w"], timeout=5)
    assert ok == {"w": b"abc"} and not bad
    thread = host._channel._thread
    alive = weakref.ref(host)
    del host
    gc.collect()
    assert alive() is None
    thread.join(10)
    assert not thread.is_alive() and _refused(address)
    _, bad = client.fanout(ECHO, b"abc", ["w"], timeout=5)
    assert isinstance(bad["w"], ChannelError)
    client.close()


def test_connections_before_the_token_are_capped_and_frames_after_it():
    """Idle connections cannot pile up threads (at most MAX_PENDING wait for the token;
    more are closed at once), and an oversized request closes its connection unread."""
    from flymc_dist.transport.channel import HEADER, MAX_FRAME, MAX_PENDING

    def serving() -> int:
        return sum(t.name == "flymc-channel" for t in threading.enumerate())

    handler = _Handler()
    server = ChannelServer(handler, "127.0.0.1")
    idle = []
    base = serving()  # other tests' connection threads may still be ending
    try:
        for _ in range(MAX_PENDING):
            idle.append(socket.create_connection(server.address, timeout=5))
        t0 = time.time()
        while server._pending < MAX_PENDING and time.time() - t0 < 30:
            time.sleep(0.01)
        assert server._pending == MAX_PENDING
        extra = [socket.create_connection(server.address, timeout=5) for _ in range(20)]
        for s in extra:  # closed by the server before any byte is read
            try:
                assert s.recv(10) == b""
            except ConnectionResetError:
                pass
            s.close()
        assert serving() <= base + MAX_PENDING
        for s in idle:
            s.close()
        idle.clear()
        t0 = time.time()
        while server._pending and time.time() - t0 < 30:
            time.sleep(0.01)
        assert server._pending == 0
        # the driver gets in, and an oversized request closes its connection unread
        with socket.create_connection(server.address, timeout=5) as s:
            s.sendall(server.token + HEADER.pack(ECHO, MAX_FRAME + 1) + b"x" * 1000)
            try:
                assert s.recv(100) == b""
            except ConnectionResetError:
                pass
        assert handler.calls == []
        client = ChannelClient()
        client.connect("w", server.address, server.token)
        ok, bad = client.fanout(ECHO, b"abc", ["w"], timeout=5)
        assert ok == {"w": b"abc"} and not bad
        client.close()
    finally:
        for s in idle:
            s.close()
        server.close()
