"""The rounds' socket channel (flymc_dist.transport.channel), on real sockets in this process."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

import flymc_dist as fd
from flymc_dist.transport import channel as channel_mod
from flymc_dist.transport.channel import (
    ECHO,
    KEY_BYTES,
    ROUND,
    ChannelClient,
    ChannelError,
    ChannelServer,
    check_channel,
)

SECRET = b"k" * KEY_BYTES


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
    client = ChannelClient()
    servers = [ChannelServer(_Handler(), "127.0.0.1", client.secret) for _ in range(2)]
    for i, s in enumerate(servers):
        client.connect(f"w{i}", s.address, client.secret)
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


def test_connection_without_the_key_is_dropped_before_anything_runs(caplog):
    handler = _Handler()
    server = ChannelServer(handler, "127.0.0.1", SECRET)
    try:
        with socket.create_connection(server.address, timeout=5) as s:
            s.recv(100)  # the greeting
            s.sendall(b"\0" * 48)  # a wrong proof, then a request
            s.sendall(bytes([ECHO]) + (1).to_bytes(8, "big") + (3).to_bytes(8, "big") + b"abc")
            try:  # closed without a reply (reset: our request was never read)
                assert s.recv(100) == b""
            except ConnectionResetError:
                pass
        # a client with another key learns it at connect
        client = ChannelClient()
        with pytest.raises(ChannelError, match="refused the handshake"):
            client.connect("w", server.address, b"\1" * KEY_BYTES)
        assert handler.calls == []
        _wait(lambda: server.refused["handshake"] == 2)
        assert "refused handshake" in caplog.text
        client.close()
    finally:
        server.close()


def _wait(pred, timeout: float = 10.0) -> None:
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout:
            raise AssertionError("timed out")
        time.sleep(0.01)


def test_check_channel():
    for v in ("auto", "socket", "tcp", "dask"):
        assert check_channel(v) == v
    for v in ("udp", None, 1, "Socket"):
        with pytest.raises(ValueError, match="channel must be 'auto', 'socket', 'tcp' or 'dask'"):
            check_channel(v)


def test_sample_rejects_bad_channel_before_writing(tmp_path):
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(50), rng.normal(size=50)])
    y = (rng.random(50) < 0.5).astype(float)
    trace = tmp_path / "t.zarr"
    with pytest.raises(ValueError, match="channel must be 'auto', 'socket', 'tcp' or 'dask'"):
        fd.sample(
            fd.LogisticRegression(),
            (X, y),
            client="synchronous",
            num_warmup=5,
            num_samples=5,
            chains=1,
            progress=False,
            placement=fd.Placement(channel="udp"),
            trace=str(trace),
        )
    assert not trace.exists()


def _refused(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=5).close()
    except OSError:
        return True
    return False


def _local_reachable(name: str | None) -> bool:
    """Whether the local socket ``name`` takes connections (False for None)."""
    if name is None:
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + name)
    except OSError:
        return False
    finally:
        sock.close()
    return True


def test_close_wakes_the_accept_thread_and_frees_the_port():
    server = ChannelServer(_Handler(), "127.0.0.1", SECRET)
    assert not _refused(server.address)
    server.close()
    # woken from accept(), TCP's and the local socket's, not left blocked forever
    assert not any(t.is_alive() for t in server._threads)
    assert _refused(server.address) and not _local_reachable(server.local_name)


def test_a_released_host_stops_its_channel():
    """The server holds its host weakly: when the host is dropped (Dask releasing the
    actor), its channel stops, its threads end and its port is freed."""
    import gc
    import weakref

    from flymc_dist.protocol import ShardConfig, ShardSpec
    from flymc_dist.transport.host import ShardHost

    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(30), rng.normal(size=30)])
    y = (rng.random(30) < 0.5).astype(np.int64)
    config = ShardConfig(
        model=fd.LogisticRegression(), algorithm="flymc", chains=1, seed=0, n_rows=30
    )
    host = ShardHost([ShardSpec(0, "", 0, 30)], config, {0: (X, y)})
    client = ChannelClient()
    address, local_name = host.open_channel("127.0.0.1", client.secret)
    client.connect("w", address, client.secret, local_name=local_name)
    ok, bad = client.fanout(ECHO, b"abc", ["w"], timeout=5)
    assert ok == {"w": b"abc"} and not bad
    threads = host._channel._threads
    alive = weakref.ref(host)
    del host
    gc.collect()
    assert alive() is None
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    assert _refused(address) and not _local_reachable(local_name)
    _, bad = client.fanout(ECHO, b"abc", ["w"], timeout=5)
    assert isinstance(bad["w"], ChannelError)
    client.close()


def test_shard_calls_travel_as_arrays_and_refuse_the_rest(tmp_path):
    """Austerity's test trips on a host's channel (CALLS): the diffs are the bits the
    shard computes in place; a call that is not a shard operation, an operation that is
    not one, a shard not held, or a message not in the layout is refused before anything
    runs, and the connection goes on. The calls' layout carries nested lists, tuples,
    dicts, arrays and plain values, and refuses what does not fit it."""
    from flymc_dist.austerity.shard import shard_batch
    from flymc_dist.protocol import (
        ShardConfig,
        ShardSpec,
        WireError,
        operation_name,
        pack_arrays,
        pack_calls,
        pack_results,
        unpack_calls,
        unpack_results,
    )
    from flymc_dist.transport.channel import CALLS
    from flymc_dist.transport.host import ShardHost

    nested = (3, [None, (np.arange(4), b"x")], {"k": 2.5, 7: [np.ones((2, 2))]}, True)
    ((method, back),) = unpack_calls(pack_calls({4: ("m", nested)})).values()
    assert method == "m" and back[0] == 3 and back[1][0] is None and back[1][1][1] == b"x"
    np.testing.assert_array_equal(back[1][1][0], np.arange(4))
    assert back[2]["k"] == 2.5 and back[2][7][0].shape == (2, 2) and back[3] is True
    got = unpack_results(b"".join(pack_results({1: [np.zeros(3), None], 2: {"n": 5}})))
    assert got[1][1] is None and got[1][0].shape == (3,) and got[2] == {"n": 5}
    for meta in (
        ("calls", ((0, "m", ("a", 0)),)),  # an array no message carries
        ("calls", ((0, "m", ("t", ("q", 1))),)),  # an unknown tag
        ("calls", ((0, "m", ("v", 1)),)),  # arguments that are not a list
        ("calls", ((-1, "m", ("t",)),)),  # a negative shard id
        ("calls", ((0, "m", ("d", "k")),)),  # a dict without its value
        ("calls", ((0, "m", ("t", ("d", ("v", 1), ("v", 2)))),)),  # a dict keyed by a tuple
        ("results", ()),  # not calls
    ):
        with pytest.raises(WireError):
            unpack_calls(pack_arrays(meta, []))

    rng = np.random.default_rng(3)
    X = np.column_stack([np.ones(40), rng.normal(size=(40, 2))])
    y = (rng.random(40) < 0.5).astype(np.int64)
    config = ShardConfig(
        model=fd.LogisticRegression(), algorithm="austerity", chains=2, seed=0, n_rows=40
    )
    host = ShardHost(
        [ShardSpec(0, "", 0, 20), ShardSpec(1, "", 20, 40)],
        config,
        {0: (X[:20], y[:20]), 1: (X[20:], y[20:])},
    )
    client = ChannelClient()
    address, _ = host.open_channel("127.0.0.1", client.secret)
    client.connect("w", address, client.secret)  # TCP: every frame MAC'd
    try:
        op = operation_name(shard_batch)
        thetas, proposals = rng.normal(size=(2, 3)), rng.normal(size=(2, 3))
        args = {
            i: (thetas, proposals, rng.permutation(20)[:7], np.array([0, 3, 7]), False)
            for i in (0, 1)
        }
        calls = {i: ("operation", (op, *a)) for i, a in args.items()}
        ok, bad = client.fanout(CALLS, pack_calls(calls), ["w"], timeout=10)
        assert not bad
        got = unpack_results(ok["w"])
        for i, a in args.items():
            assert got[i].tobytes() == shard_batch(host.shards[i], *a).tobytes()
        marker = tmp_path / "ran"
        rows_out = (*args[0][:2], np.array([0, 25]), np.array([0, 1, 2]), False)
        refused = {
            "unknown shard operation": {0: ("operation", ("os:system", f"touch {marker}"))},
            "only shard operations": {0: ("close", ())},
            "not held here": {5: calls[0]},
            "this shard's rows": {0: ("operation", (op, *rows_out))},
        }
        for name, bad_calls in refused.items():
            _, bad = client.fanout(CALLS, pack_calls(bad_calls), ["w"], timeout=10)
            assert isinstance(bad["w"], ValueError) and name in str(bad["w"]), bad["w"]
        for blob in (pack_arrays(("calls", ((0, "operation", ("a", 9)),)), []), b"junk"):
            _, bad = client.fanout(CALLS, blob, ["w"], timeout=10)
            assert isinstance(bad["w"], ValueError)
        assert not marker.exists() and host.shards  # nothing ran, nothing closed
        ok, bad = client.fanout(ECHO, b"still here", ["w"], timeout=10)
        assert ok == {"w": b"still here"} and not bad
    finally:
        client.close()
        host.release()


def test_connections_in_handshake_are_capped_and_frames_after_it():
    """Idle connections cannot pile up threads (at most MAX_PENDING in their handshake;
    more are closed at once), and an oversized request closes its connection unread."""
    from flymc_dist.transport.channel import HEADER, MAX_FRAME, MAX_PENDING

    def serving() -> int:
        return sum(t.name == "flymc-channel" for t in threading.enumerate())

    handler = _Handler()
    client = ChannelClient()
    server = ChannelServer(handler, "127.0.0.1", client.secret)
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
        client.connect("w", server.address, client.secret)
        sock = client._conns["w"].sock
        sock.sendall(HEADER.pack(ECHO, 1, MAX_FRAME + 1) + b"x" * 1000)
        try:
            assert sock.recv(100) == b""
        except ConnectionResetError:
            pass
        assert handler.calls == []
        _wait(lambda: server.refused["oversized frame"] == 1)
        client.connect("w", server.address, client.secret)
        ok, bad = client.fanout(ECHO, b"abc", ["w"], timeout=5)
        assert ok == {"w": b"abc"} and not bad
        client.close()
    finally:
        for s in idle:
            s.close()
        server.close()


# ------------------------------------------------------------------ attacks (issue 41)
class _Recorder:
    """Wraps a connected client's socket: every byte the driver sends is kept."""

    def __init__(self, client: ChannelClient, key: str) -> None:
        self.sent: list[bytes] = []
        conn = client._conns[key]
        real = conn.sock

        class Sock:
            def __getattr__(_, name):
                return getattr(real, name)

            def sendall(_, data):
                self.sent.append(bytes(data))
                return real.sendall(data)

        conn.sock = Sock()
        self.real = real


def test_a_replayed_frame_is_refused_on_its_connection_and_on_another(caplog):
    handler = _Handler()
    client = ChannelClient()
    server = ChannelServer(handler, "127.0.0.1", client.secret)
    try:
        client.connect("w", server.address, client.secret)
        rec = _Recorder(client, "w")
        ok, _ = client.fanout(ROUND, b"abc", ["w"], timeout=5)
        assert ok == {"w": b"cba"}
        frame = rec.sent[-1]
        # on another connection: its handshake cannot be replayed (fresh nonces)
        with socket.create_connection(server.address, timeout=5) as s:
            s.recv(100)
            s.sendall(b"\0" * 48 + frame)
            _closed(s)
        # on the driver's own connection: out of sequence
        rec.real.sendall(frame)
        _closed(rec.real)
        assert handler.calls == [(ROUND, b"abc")]  # applied once, never again
        _wait(lambda: server.refused["replayed frame"] == 1 and server.refused["handshake"] == 1)
        assert "refused replayed frame" in caplog.text
    finally:
        client.close()
        server.close()


def test_a_forged_frame_and_a_second_driver_are_refused():
    handler = _Handler()
    client = ChannelClient()
    server = ChannelServer(handler, "127.0.0.1", client.secret)
    try:
        client.connect("w", server.address, client.secret)
        # a second driver, even with the key, while one is connected
        other = ChannelClient()
        with pytest.raises(ChannelError):
            other.connect("w", server.address, client.secret)
        _wait(lambda: server.refused["second driver"] == 1)
        ok, bad = client.fanout(ECHO, b"still here", ["w"], timeout=5)
        assert ok == {"w": b"still here"} and not bad
        # a frame whose payload was changed in flight
        rec = _Recorder(client, "w")
        client.fanout(ROUND, b"abc", ["w"], timeout=5)
        from flymc_dist.transport.channel import HEADER

        forged = bytearray(rec.sent[-1])
        forged[HEADER.size] ^= 1
        forged[1:9] = (3).to_bytes(8, "big")  # the next sequence number
        rec.real.sendall(bytes(forged))
        _closed(rec.real)
        _wait(lambda: server.refused["forged frame"] == 1)
        assert handler.calls == [(ECHO, b"still here"), (ROUND, b"abc")]
    finally:
        client.close()
        server.close()


def _closed(sock: socket.socket) -> None:
    sock.settimeout(5)
    try:
        assert sock.recv(100) == b""
    except ConnectionResetError:
        pass


def test_a_crafted_pickle_runs_nothing(tmp_path):
    """What the old channel unpickled: a pickle whose loading runs a command. Sent raw,
    after the greeting, as a frame: refused, nothing runs, the server goes on."""
    import os
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    blob = pickle.dumps(Evil())
    handler = _Handler()
    client = ChannelClient()
    server = ChannelServer(handler, "127.0.0.1", client.secret)
    try:
        for data in (blob, bytes([ROUND]) + len(blob).to_bytes(8, "big") + blob):
            with socket.create_connection(server.address, timeout=5) as s:
                s.recv(100)
                s.sendall(data + b"\0" * 64)
                _closed(s)
        _wait(lambda: server.refused["handshake"] == 2)
        client.connect("w", server.address, client.secret)
        ok, _ = client.fanout(ECHO, b"up", ["w"], timeout=5)
        assert ok == {"w": b"up"}
        # and a pickle inside an authenticated round is refused by the round's layout
        from flymc_dist.protocol import WireError, unpack_reply, unpack_round

        for unpack in (unpack_round, unpack_reply):
            with pytest.raises(WireError):
                unpack(blob)
        assert not marker.exists() and handler.calls == [(ECHO, b"up")]
    finally:
        client.close()
        server.close()


def test_errors_travel_as_a_code_and_a_message():
    from flymc_dist.transport.channel import decode_error, encode_error

    class Custom(ValueError):
        pass

    for e, kind, text in (
        (ValueError("bad θ"), ValueError, "bad θ"),
        (FileNotFoundError(2, "gone"), OSError, "FileNotFoundError: [Errno 2] gone"),
        (Custom("x"), ValueError, "Custom: x"),
        (KeyError("k"), KeyError, "k"),
        (SystemExit(3), RuntimeError, "SystemExit: 3"),
    ):
        back = decode_error(encode_error(e))
        assert type(back) is kind and str(back).strip("'") == text
    for junk in (b"", b"\xff\xff boom"):
        assert isinstance(decode_error(junk), ChannelError)


# ------------------------------------------------------------ the round's wire layout
def _round():
    from flymc_dist.protocol import Request, Round

    reqs = [Request(np.array([[0.1, 0.2]]), False, True), None]
    return Round(7, np.array([-1, 0]), True, reqs)


def test_round_layout_round_trips_and_refuses_what_does_not_fit():
    from flymc_dist.protocol import (
        ReplicaRound,
        WireError,
        check_round,
        pack_arrays,
        pack_round,
        unpack_round,
    )

    back = unpack_round(pack_round(_round()))
    assert back.seq == 7 and back.update_z and back.requests[1] is None
    np.testing.assert_array_equal(back.requests[0].points, [[0.1, 0.2]])
    check_round(back, 2, 2)
    with pytest.raises(WireError, match="2 chains of 3 parameters|model has 3"):
        check_round(back, 2, 3)
    with pytest.raises(WireError, match="for 2 chains, the shards hold 4"):
        check_round(back, 4, 2)
    good = pack_round(ReplicaRound(3, np.zeros((2, 2))))
    assert unpack_round(good).seq == 3
    bad = {
        "NaN θ": pack_round(ReplicaRound(3, np.array([[0.0, np.nan], [0, 0]]))),
        "inf point": pack_arrays(
            ("round", 1, (-1,), True, ((False, False),)), [np.full((1, 2), np.inf)]
        ),
        "truncated": good[:-3],
        "trailing": good + b"\0" * 8,
        "wrong magic": b"X" + good[1:],
        "int θ": pack_arrays(("replica", 3), [np.zeros((2, 2), dtype=np.int64)]),
        "1-D θ": pack_arrays(("replica", 3), [np.zeros(4)]),
        "commit -2": pack_arrays(("round", 1, (-2,), True, (None,)), []),
        "str seq": pack_arrays(("replica", "3"), [np.zeros((2, 2))]),
        "missing points": pack_arrays(("round", 1, (-1,), True, ((False, False),)), []),
        "unknown kind": pack_arrays(("exec", "os.system"), []),
    }
    # a negative shape, an unknown dtype code and a huge shape, written by hand
    from flymc_dist.protocol import WIRE_DTYPES

    f8 = WIRE_DTYPES.index(np.dtype("<f8"))
    shape_at = good.index(bytes([f8, 2]) + (2).to_bytes(8, "little", signed=True))
    bad["negative shape"] = (
        good[: shape_at + 2] + (-2).to_bytes(8, "little", signed=True) + good[shape_at + 10 :]
    )
    bad["unknown dtype"] = good[:shape_at] + bytes([200]) + good[shape_at + 1 :]
    bad["huge shape"] = (
        good[: shape_at + 2] + (2**40).to_bytes(8, "little", signed=True) + good[shape_at + 10 :]
    )
    for name, blob in bad.items():
        with pytest.raises(WireError):
            unpack_round(blob)
        assert name


def test_resolve_operation_refuses_before_importing(tmp_path, monkeypatch):
    import sys

    from flymc_dist.protocol import operation_name, resolve_operation

    (tmp_path / "flymc_side_effect.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\ndef f(shard):\n    return 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (
        None,
        3,
        b"x:y",
        "",
        "os",
        "os:system",
        "flymc_side_effect:f",
        ":f",
        "os:path.join",
    ):
        with pytest.raises(ValueError, match="unknown shard operation"):
            resolve_operation(name)
    assert "flymc_side_effect" not in sys.modules and not (tmp_path / "imported").exists()
    from flymc_dist.austerity.shard import shard_batch

    assert resolve_operation(operation_name(shard_batch)) is shard_batch


def test_a_large_reply_goes_in_parts_and_arrives_whole():
    """Frames longer than JOIN_BYTES are sent part by part with a MAC fed the same parts,
    never joined: the bytes on the wire are the joined frame's (checked on a socket
    pair against ``_frame``), the MAC is the one-shot MAC of the joined bytes, and a
    handler's reply given as parts (an array's buffer among them) arrives whole and
    authentic; a byte changed on the way is refused as a wrong MAC."""
    from flymc_dist.transport.channel import JOIN_BYTES, _frame, _mac, _send_frame

    big = np.arange(3 * JOIN_BYTES // 8, dtype=np.int64)
    parts = [b"head", memoryview(big).cast("B"), b"", b"tail"]
    joined = b"".join(bytes(p) for p in parts)
    assert len(joined) > JOIN_BYTES
    assert _mac(SECRET, b"A", joined[:9], joined) == _mac(SECRET, b"A", joined[:9] + joined)
    a, b = socket.socketpair()
    with a, b:
        want = _frame(SECRET, b"A", ROUND, 7, joined)
        sender = threading.Thread(target=_send_frame, args=(a, SECRET, b"A", ROUND, 7, parts))
        sender.start()
        got = bytearray()
        while len(got) < len(want):
            got += b.recv(1 << 20)
        sender.join()
    assert bytes(got) == want

    class Parts(_Handler):
        def __call__(self, code: int, payload: bytes):
            return parts if payload == b"parts" else super().__call__(code, payload)

    client = ChannelClient()
    server = ChannelServer(Parts(), "127.0.0.1", client.secret)
    try:
        client.connect("w", server.address, client.secret)
        ok, bad = client.fanout(ROUND, b"parts", ["w"], timeout=5)
        assert not bad and bytes(ok["w"]) == joined
        ok, bad = client.fanout(ECHO, joined, ["w"], timeout=5)
        assert not bad and bytes(ok["w"]) == joined
    finally:
        client.close()
        server.close()
    # the same frame with one payload byte changed: refused by the MAC check
    forged = bytearray(want)
    forged[len(want) // 2] ^= 1
    a, b = socket.socketpair()
    with a, b:
        a.sendall(bytes(forged))
        from flymc_dist.transport.channel import HEADER, MAC_BYTES, _recv_view

        header = _recv_view(b, HEADER.size)
        body = _recv_view(b, HEADER.unpack(header)[2] + MAC_BYTES)
        assert _mac(SECRET, b"A", header, body[:-MAC_BYTES]) != bytes(body[-MAC_BYTES:])
        assert (
            _mac(SECRET, b"A", want[: HEADER.size], want[HEADER.size : -MAC_BYTES])
            == (want[-MAC_BYTES:])
        )


_needs_local = pytest.mark.skipif(
    not channel_mod.LOCAL, reason="local sockets: Linux only (abstract Unix-domain sockets)"
)


class _Parts(_Handler):
    """Answers b"parts" with a large reply given as parts, else as :class:`_Handler`."""

    def __init__(self, parts: list) -> None:
        super().__init__()
        self.parts = parts

    def __call__(self, code: int, payload: bytes):
        return self.parts if payload == b"parts" else super().__call__(code, payload)


@_needs_local
def test_a_local_socket_carries_frames_without_macs():
    """A client on the server's machine connects by its local socket (the same
    handshake, the run's key): small and large requests and replies, an error reply and
    the sequence numbers work as on TCP, and the frames carry no MAC (a local frame is
    the TCP frame without its last MAC_BYTES). A name nothing listens on, or none, gives
    TCP; a name that is not a channel's is refused."""
    from flymc_dist.transport.channel import JOIN_BYTES, MAC_BYTES, _frame

    big = np.arange(3 * JOIN_BYTES // 8, dtype=np.int64)
    parts = [b"head", memoryview(big).cast("B"), b"tail"]
    joined = b"".join(bytes(p) for p in parts)
    handler = _Parts(parts)
    client = ChannelClient()
    server = ChannelServer(handler, "127.0.0.1", client.secret)
    try:
        assert server.local_name.startswith(channel_mod.LOCAL_PREFIX)
        client.connect("w", server.address, client.secret, local_name=server.local_name)
        assert client.is_local("w") and client._conns["w"].sock.family == socket.AF_UNIX
        rec = _Recorder(client, "w")
        ok, bad = client.fanout(ROUND, b"abc", ["w"], timeout=5)
        assert ok == {"w": b"cba"} and not bad
        tcp_frame = _frame(client._conns["w"].session, b"Q", ROUND, 1, b"abc")
        assert rec.sent[-1] == tcp_frame[:-MAC_BYTES]  # the same frame, no MAC
        ok, bad = client.fanout(ROUND, b"parts", ["w"], timeout=5)
        assert not bad and bytes(ok["w"]) == joined
        ok, bad = client.fanout(ECHO, joined, ["w"], timeout=5)
        assert not bad and bytes(ok["w"]) == joined
        _, bad = client.fanout(ROUND, b"bad", ["w"], timeout=5)
        assert isinstance(bad["w"], ValueError)
        ok, _ = client.fanout(ECHO, b"after", ["w"], timeout=5)
        assert ok == {"w": b"after"} and client._conns["w"].seq == 6
        # TCP to the same server still works, MAC'd, for another role's client
        other = ChannelClient()
        other.connect("p", server.address, client.secret, role="parent")
        assert not other.is_local("p")
        ok, _ = other.fanout(ECHO, b"tcp", ["p"], timeout=5)
        assert ok == {"p": b"tcp"}
        other.close()
        _wait(lambda: "parent" not in server._peers)
        # nothing listening under that name: TCP; a name of no channel: refused
        gone = ChannelClient()
        gone.connect("w", server.address, client.secret, role="parent",
                     local_name=channel_mod.LOCAL_PREFIX + "0" * 32)  # fmt: skip
        assert not gone.is_local("w")
        gone.close()
        with pytest.raises(ValueError, match="local socket name"):
            ChannelClient().connect("w", server.address, client.secret, local_name="@x")
    finally:
        client.close()
        server.close()
    assert not server.refused


@_needs_local
def test_a_local_socket_refuses_a_wrong_key_and_a_second_driver():
    handler = _Handler()
    client = ChannelClient()
    server = ChannelServer(handler, "127.0.0.1", client.secret)
    try:
        with pytest.raises(ChannelError, match="refused the handshake"):
            ChannelClient().connect(
                "w", server.address, b"\1" * KEY_BYTES, local_name=server.local_name
            )
        _wait(lambda: server.refused["handshake"] == 1)
        client.connect("w", server.address, client.secret, local_name=server.local_name)
        with pytest.raises(ChannelError, match="refused the handshake"):
            ChannelClient().connect(
                "w", server.address, client.secret, local_name=server.local_name
            )
        _wait(lambda: server.refused["second driver"] == 1)
        ok, _ = client.fanout(ECHO, b"still here", ["w"], timeout=5)
        assert ok == {"w": b"still here"} and handler.calls == [(ECHO, b"still here")]
    finally:
        client.close()
        server.close()


def test_a_tcp_client_cannot_take_a_local_session():
    """Whether a connection's frames go without MACs is the server's to say, by the
    socket it accepted on: a TCP client that answers the handshake as a local one (the
    run's key, the local domain) is refused, so no TCP connection is ever unMAC'd."""
    from flymc_dist.transport.channel import GREETING, NONCE_BYTES, _session

    handler = _Handler()
    server = ChannelServer(handler, "127.0.0.1", SECRET)
    try:
        with socket.create_connection(server.address, timeout=5) as s:
            hello = s.recv(len(GREETING) + NONCE_BYTES)
            client_nonce = b"n" * NONCE_BYTES
            proof, _ = _session(SECRET, hello[len(GREETING) :], client_nonce, local=True)
            s.sendall(client_nonce + proof)
            _closed(s)
        _wait(lambda: server.refused["handshake"] == 1)
        assert handler.calls == []
    finally:
        server.close()


_OTHER_USER = """
import os, socket, sys
os.setgid(65534)
os.setuid(65534)  # nobody
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect("\\0" + sys.argv[1])
try:
    got = s.recv(100)
except ConnectionResetError:
    got = b""
print(len(got))
"""


@_needs_local
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a process as another user")
def test_a_local_socket_refuses_another_users_process():
    """A process of another user (a real one: ``nobody``) reaches the local socket's name
    but is refused before the handshake (no greeting), and counted; nothing runs."""
    import subprocess
    import sys

    handler = _Handler()
    server = ChannelServer(handler, "127.0.0.1", SECRET)
    try:
        out = subprocess.run(
            [sys.executable, "-c", _OTHER_USER, server.local_name],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "0"  # closed at once: not even the greeting
        _wait(lambda: server.refused["local peer"] == 1)
        assert handler.calls == []
    finally:
        server.close()


_SERVER_AS_OTHER_USER = """
import os, sys
from flymc_dist.transport.channel import ChannelServer  # (nobody cannot read root's Python)
os.setgid(65534)
os.setuid(65534)  # nobody
server = ChannelServer(lambda code, payload: payload, "127.0.0.1", bytes.fromhex(sys.argv[1]))
print(server.address[0], server.address[1], server.local_name, flush=True)
sys.stdin.read()  # until the test closes it
server.close()
"""


@_needs_local
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a process as another user")
def test_a_driver_reaches_another_users_host_by_tcp():
    """A host run by another user (``nobody``) on this machine: its local socket is not
    used (its server would refuse this user), the driver connects by TCP, MAC'd."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER_AS_OTHER_USER, SECRET.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        host, port, name = proc.stdout.readline().split()
        client = ChannelClient()
        client.connect("w", (host, int(port)), SECRET, local_name=name)
        assert not client.is_local("w")
        ok, bad = client.fanout(ECHO, b"by tcp", ["w"], timeout=5)
        assert ok == {"w": b"by tcp"} and not bad
        client.close()
    finally:
        proc.stdin.close()
        proc.wait(30)
