"""Attacks on the round channel of a run on a real Dask LocalCluster (issue 41): a crafted
pickle, a replayed frame, a wrong key, a second driver holding the stolen key, a NaN θ and
a negative shape through Dask's RPC, and channel="socket" on a TLS cluster. Every host
survives, the attacked run's draws are bit-identical to an unattacked run's, and each
attempt is counted."""

from __future__ import annotations

import logging
import os
import pickle
import socket

import numpy as np
import pytest
from scipy.special import expit

import flymc_dist as fd
from flymc_dist.protocol import ReplicaRound, pack_round
from flymc_dist.transport import channel as channel_mod
from flymc_dist.transport import dask as dask_mod

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(11)
    X = np.c_[np.ones(600), rng.normal(size=600)]
    y = (rng.random(600) < expit(X @ np.array([0.5, -1.0]))).astype(np.int64)
    path = str(tmp_path_factory.mktemp("att") / "d.zarr")
    fd.from_numpy(X, y, path, chunk_rows=100)
    return path


def _run(path: str, client, channel: str = "auto", **kw):
    opts = dict(
        # a round every iteration (the shards updating z), for the attacks to ride on
        algorithm=fd.FlyMC(bounds="map", read_ahead=0),
        kernel="rwmh",
        # 100 rounds: the attacks come at rounds 50-60, 40 rounds follow
        num_warmup=40,
        num_samples=60,
        chains=2,
        seed=3,
        placement=fd.Placement(n_shards=3, channel=channel),
        progress=False,
    )
    opts.update(kw)
    model = fd.LogisticRegression(prior="normal", prior_scale=2.0)
    return fd.sample(model, fd.open_dataset(path), client=client, **opts)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _answer(s: socket.socket) -> bytes:
    """What the host sends back before it closes the connection (reset: nothing)."""
    s.settimeout(10)
    try:
        return s.recv(64)
    except ConnectionResetError:
        return b""


def _attack(client: channel_mod.ChannelClient, transport, captured: dict, marker: str) -> dict:
    """Every attack against every host of the run; what each attempt got back."""
    out: dict[str, list] = {}
    for w, conn in client._conns.items():
        address = conn.sock.getpeername()[:2]
        got = out.setdefault(w, [])
        # 1. a crafted pickle, where the old channel unpickled its frames
        blob = pickle.dumps(_Evil(marker))
        with socket.create_connection(address, timeout=10) as s:
            s.recv(64)
            s.sendall(blob + b"\0" * 64)
            got.append(_answer(s))
        # 2. a captured valid frame of this run, replayed on a new connection
        with socket.create_connection(address, timeout=10) as s:
            s.recv(64)
            s.sendall(b"\0" * 48 + captured[w])
            got.append(_answer(s))
        # 3. a wrong key, 4. a second driver holding the run's (stolen) key
        for secret in (os.urandom(channel_mod.KEY_BYTES), client.secret):
            with pytest.raises(channel_mod.ChannelError, match="refused the handshake"):
                channel_mod.ChannelClient().connect("x", address, secret)
        # 5. NaN θ and a negative shape, through Dask's RPC (what any Dask client can send)
        nan = pack_round(ReplicaRound(10**6, np.full((2, 2), np.nan)))
        good = pack_round(ReplicaRound(10**6, np.zeros((2, 2))))
        at = good.index(bytes([0, 2]) + (2).to_bytes(8, "little"))
        negative = good[: at + 2] + (-2).to_bytes(8, "little", signed=True) + good[at + 10 :]
        wrong_c = pack_round(ReplicaRound(10**6, np.zeros((3, 2))))
        for bad in (nan, negative, wrong_c):
            _, errors = transport.fanout_calls({w: ("round_packed", (bad,), {})})
            transport.round_trips -= 1
            got.append(errors[w])
    return out


@pytest.mark.slow
def test_attacks_change_no_draw_and_are_counted(store, local_clusters, tmp_path, monkeypatch):
    from distributed import Client

    marker = tmp_path / "pwned"
    reference = _run(store, "synchronous")
    captured: dict[str, bytes] = {}
    results: dict = {}
    transports: list = []
    fanout = channel_mod.ChannelClient.fanout
    rounds = {"n": 0}
    init = dask_mod.DaskTransport.__init__

    def keep(self, *a, **k):
        transports.append(self)
        init(self, *a, **k)

    def attacked(self, code, payload, keys, timeout):
        rounds["n"] += 1
        if rounds["n"] == 50:  # capture one valid frame per host
            for k in keys:
                conn = self._conns[k]
                captured[k] = channel_mod.HEADER.pack(code, conn.seq, len(payload)) + payload
        if rounds["n"] == 60:
            results.update(_attack(self, transports[-1], captured, str(marker)))
        return fanout(self, code, payload, keys, timeout)

    monkeypatch.setattr(dask_mod.DaskTransport, "__init__", keep)
    monkeypatch.setattr(channel_mod.ChannelClient, "fanout", attacked)
    with Client(local_clusters.get(2), direct_to_workers=True) as client:
        # over TCP, the way a network attacker reaches a host (local sockets: test_channel)
        res = _run(store, client, channel="tcp")
    assert res.info["channel"] == "socket" and rounds["n"] > 60
    assert len(results) == 2 and not marker.exists()
    for got in results.values():
        assert got[:2] == [b"", b""]  # closed without a reply
        nan, negative, wrong_c = got[2:]
        assert isinstance(nan, ValueError) and "NaN" in str(nan)
        assert isinstance(negative, ValueError) and "negative shape" in str(negative)
        assert isinstance(wrong_c, ValueError) and "hold 2 chains" in str(wrong_c)
    # the victim's draws: bit-identical to the unattacked run's
    np.testing.assert_array_equal(res.samples, reference.samples)
    for k in ("n_bright", "likelihood_queries", "accepted"):
        np.testing.assert_array_equal(res.stats[k], reference.stats[k])
    assert not res.info["recoveries"]
    # every attempt on the channel counted by its host
    assert [h["channel_refused"] for h in res.info["timing"]["hosts"]] == [4, 4]


@pytest.mark.slow
def test_a_tls_cluster_never_uses_the_plain_socket(store, caplog):
    """On a TLS cluster the rounds go through Dask's (encrypted, authenticated) comms,
    even with channel="socket": nothing listens in clear for the key to be sniffed."""
    from distributed import Client, LocalCluster
    from distributed.security import Security

    security = Security.temporary()
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            protocol="tls://",
            security=security,
            dashboard_address=None,
            scheduler_kwargs={"dashboard_address": ":0"},
            silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster, security=security, direct_to_workers=True) as client,
    ):
        assert cluster.scheduler_address.startswith("tls://")
        kw = dict(num_warmup=20, num_samples=30)
        with caplog.at_level(logging.WARNING, logger="flymc_dist"):
            res = _run(store, client, channel="socket", **kw)
        listening = client.run(
            lambda: sum(
                t.name.startswith("flymc-channel") for t in __import__("threading").enumerate()
            )
        )
    assert res.info["channel"] == "dask"
    assert "rounds go through Dask's comms instead" in caplog.text
    assert list(listening.values()) == [0]
    np.testing.assert_array_equal(res.samples, _run(store, "synchronous", **kw).samples)
