"""Rows lent through shared memory (:mod:`flymc_dist.shard.shared`): a host on the
driver's machine lends it its in-memory rows, and the driver draws and reads their
read-ahead proposals itself — the same draws as when every host is asked (over TCP, or
with rows out of core), no read-ahead request to a lending host, nothing left mapped or
open after the run; the descriptors travel on a local socket only, and the driver refuses
a segment that could shrink under it or is shorter than described."""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest
from draws import same_draws
from scipy.special import expit

import flymc_dist as fd
from flymc_dist.shard.shared import LENDING, LentRows, Segment
from flymc_dist.transport.channel import (
    LEND,
    ChannelClient,
    ChannelError,
    ChannelServer,
    WithFds,
)

pytestmark = pytest.mark.skipif(not LENDING, reason="rows are lent on Linux only")


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    rng = np.random.default_rng(3)
    n = 6000
    X = np.c_[np.ones(n), rng.normal(size=(n, 3))]
    y = (rng.random(n) < expit(X @ np.array([0.2, -0.8, 0.5, 1.0]))).astype(np.int64)
    return fd.from_numpy(X, y, str(tmp_path_factory.mktemp("lend") / "d.zarr"), chunk_rows=500)


def _run(data, client, kernel: str, **placement):
    return fd.sample(
        fd.LogisticRegression(),
        data,
        fd.FlyMC(read_ahead=32),
        kernel,
        num_warmup=100,
        num_samples=200,
        chains=3,
        seed=11,
        client=client,
        placement=fd.Placement(**placement),
        progress=False,
    )


def _lent_maps() -> int:
    """Mappings of lent rows in this process."""
    with open("/proc/self/maps") as f:
        return sum("flymc-lent-rows" in line for line in f)


def _lent_fds() -> int:
    """Open descriptors of lent rows in this process."""
    n = 0
    for fd_name in os.listdir("/proc/self/fd"):
        try:
            n += "flymc-lent-rows" in os.readlink(f"/proc/self/fd/{fd_name}")
        except OSError:
            pass
    return n


@pytest.mark.cluster
@pytest.mark.parametrize("kernel", ["rwmh", "nuts"])
def test_local_hosts_lend_their_rows_with_the_same_draws(kernel, ds, local_clusters):
    """On 2 local workers both hosts lend their rows: no read-ahead request is sent while
    sampling (only the run's end reads each host's timing), and the draws are those of
    the same run asked over TCP (no lending) and with the rows out of core (not lent:
    their hosts are asked)."""
    from distributed import Client

    with Client(local_clusters.get(2), direct_to_workers=True) as client:
        lent = _run(ds, client, kernel)
        asked = _run(ds, client, kernel, channel="tcp")
        on_disk = _run(ds, client, kernel, out_of_core=True)
    assert lent.info["lending_hosts"] == 2
    assert asked.info["lending_hosts"] == 0 and on_disk.info["lending_hosts"] == 0
    assert lent.info["local_channels"] == on_disk.info["local_channels"] == 2
    assert all(n <= 4 for n in lent.info["host_messages"].values()), lent.info
    trips = lent.stats["round_trips"].sum() + lent.warmup_stats["round_trips"].sum()
    assert trips == 0
    # the hosts that were asked were sent a request every read_ahead iterations
    T = asked.info["read_ahead"]
    assert all(n >= 300 // T for n in asked.info["host_messages"].values()), asked.info
    same_draws(lent, asked)
    same_draws(lent, on_disk)
    assert lent.info["read_ahead"] == asked.info["read_ahead"] == T


@pytest.mark.cluster
def test_lent_rows_are_given_back(ds):
    """After a run that borrowed rows, the driver maps none of them, and the workers
    hold no descriptor of them (their shards released). On a cluster of its own: the
    shared ones may hold another test's shards."""
    from flymc_dist.transport.dask import local_client

    before = _lent_maps()
    client, cluster = local_client(2)
    try:
        res = _run(ds, client, "rwmh")
        held = client.run(_lent_fds)
    finally:
        client.close()
        cluster.close()
    assert res.info["lending_hosts"] == 2
    assert _lent_maps() == before == 0
    assert set(held.values()) == {0}, held


def _server(reply):
    """A round channel server whose handler answers :data:`LEND` with ``reply()``."""
    from flymc_dist.transport.channel import LOCAL

    if not LOCAL:
        pytest.skip("local sockets are Linux's")
    secret = os.urandom(32)
    server = ChannelServer(
        lambda code, payload: reply() if code == LEND else payload, "127.0.0.1", secret
    )
    return server, secret


def test_rows_are_lent_on_a_local_socket_only():
    """The same server lends on its local socket (the descriptor arrives, the bytes
    readable) and refuses to on TCP (an error reply, no descriptor sent)."""
    seg = Segment(4096)
    seg.array((512,), np.float64)[:] = np.arange(512.0)
    server, secret = _server(lambda: WithFds(b"meta", [seg.fd]))
    try:
        local = ChannelClient()
        local.connect("h", server.address, secret, local_name=server.local_name)
        body, fds = local.borrow("h", 5.0)
        assert bytes(body) == b"meta" and len(fds) == 1
        m = mmap.mmap(fds[0], 4096, prot=mmap.PROT_READ)
        assert np.frombuffer(m, np.float64)[511] == 511.0
        del m
        os.close(fds[0])
        local.close()  # one driver at a time: the server lets the first go
        remote = ChannelClient()
        for _ in range(50):
            try:
                remote.connect("h", server.address, secret)  # TCP
                break
            except ChannelError:
                time.sleep(0.05)
        assert not remote.is_local("h")
        with pytest.raises(ChannelError, match="no local channel"):
            remote.borrow("h", 5.0)
        ok, bad = remote.fanout(LEND, b"", ["h"], 5.0)  # asked anyway, on TCP
        assert not ok and "local socket only" in str(bad["h"]), bad
        remote.close()
    finally:
        server.close()
        seg.close()


def _meta(n: int, width: int) -> dict:
    return {
        "n": n, "width": width, "n_features": width - 3, "y_dtype": "<f8", "shard_id": 0,
        "start": 0, "n_total": n, "seed": 1, "chains": 2, "q": 0.01, "stored": "<f8",
    }  # fmt: skip


def test_a_driver_refuses_rows_that_could_shrink_or_are_short():
    """A segment without the seals, shorter than described, or described with more
    features than its rows hold, is refused (its descriptors closed all the same); a
    sealed one of the right size is mapped read-only."""
    n, width = 100, 7

    def fds(xc_bytes: int, sealed: bool = True) -> list[int]:
        out = []
        for size in (xc_bytes, 16 * n):
            if sealed:
                seg = Segment(size)
                out.append(os.dup(seg.fd))
                seg.close()
            else:
                fd = os.memfd_create("flymc-lent-rows")
                os.ftruncate(fd, size)
                out.append(fd)
        return out

    bad = fds(n * width * 8, sealed=False)
    with pytest.raises(ValueError, match="sealed"):
        LentRows(_meta(n, width), bad)
    short = fds(n * width * 8 - 8)
    with pytest.raises(ValueError, match="bytes"):
        LentRows(_meta(n, width), short)
    wide = fds(n * width * 8)  # more features than the rows' width: reads past them
    with pytest.raises(ValueError, match="described"):
        LentRows({**_meta(n, width), "n_features": width + 1}, wide)
    for d in bad + short + wide:  # closed by LentRows
        with pytest.raises(OSError):
            os.fstat(d)
    good = LentRows(_meta(n, width), fds(n * width * 8))
    assert good.XC.shape == (n, width) and not good.XC.flags.writeable
    with pytest.raises(ValueError):
        good.XC[0, 0] = 1.0
    good.close()
