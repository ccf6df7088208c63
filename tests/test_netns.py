"""A multi-host layout on one machine: the scheduler, two workers and the driver each in a
network namespace of its own, joined by a bridge, on addresses that exist only inside
those namespaces (198.18.29.0/24, the range set aside for network tests, RFC 2544).

This is the layout of a real cluster as the sampler sees it: every process has its own
network stack, the driver reaches the scheduler and the workers by their own addresses,
and each worker's round channel listens on its worker's address. With the workers'
firewalls (nftables, inside their namespaces) closing every port but Dask's, the driver
cannot reach the round channels: ``channel="auto"`` then sends the rounds through Dask's
RPC, with one warning line, and the draws are the same.

Root only (``ip netns``); skipped with the reason otherwise. ``nft`` comes from the
machine's own packages (``.ci/run`` installs nftables from the apt cache where it is
missing); without it the firewall test is skipped, saying so.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from netns import Layout, ipv4, sh, why_no_netns
from synthetic import logistic_rows

import flymc_dist as fd

pytestmark = pytest.mark.cluster

#: each host's address on the test network (a /24)
HOSTS = {"sched": "198.18.29.1", "w1": "198.18.29.2", "w2": "198.18.29.3", "drv": "198.18.29.4"}
SCHEDULER_PORT = 8786
#: the one port a worker listens on for Dask (``--worker-port``); the firewall leaves it open
WORKER_PORT = 40001
#: the nftables table the firewall test adds in each worker's namespace
NFT_TABLE = "flymc_test"

#: the run compared with the in-process one (small: the point is the network, not the chain)
RUN = dict(num_warmup=20, num_samples=30, chains=2, seed=5, progress=False)

#: the driver, run in its own namespace: samples by scheduler address and saves what it got
DRIVER = """
import json, sys
import numpy as np
import flymc_dist as fd
store, address, out, run = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
res = fd.sample(fd.LogisticRegression(), fd.open_dataset(store), fd.FlyMC(bounds="map"),
                placement=fd.Placement(n_shards=4), client=address, **run)
np.savez(out, samples=res.samples, n_bright=res.stats["n_bright"],
         log_joint=res.stats["log_joint"], channel=res.info["channel"],
         local_channels=res.info["local_channels"], n_workers=res.info["n_workers"])
"""


def _dask(*args: str) -> list[str]:
    """Dask's command line run by this interpreter (not the first `dask` on PATH, nor none
    when pytest runs from a venv that is not activated)."""
    return [sys.executable, "-m", "dask", *args]


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """The scheduler and two workers running, each in its namespace; the driver's empty."""
    why = why_no_netns()
    if why is not None:
        pytest.skip(why)
    lay = Layout(tmp_path_factory.mktemp("netns"), HOSTS, subnet_bits=24, tag="hosts")
    try:
        lay.build()
        sched = f"tcp://{HOSTS['sched']}:{SCHEDULER_PORT}"
        lay.start(
            "sched",
            _dask(
                "scheduler",
                "--host",
                HOSTS["sched"],
                "--port",
                str(SCHEDULER_PORT),
                "--no-dashboard",
            ),
        )
        for w in ("w1", "w2"):
            lay.start(
                w,
                _dask(
                    "worker",
                    sched,
                    "--host",
                    HOSTS[w],
                    "--worker-port",
                    str(WORKER_PORT),
                    "--nthreads",
                    "1",
                    "--no-nanny",
                    "--no-dashboard",
                ),
            )
        # wait, from the driver's namespace, until both workers have joined
        wait = (
            "import sys; from distributed import Client; "
            "c = Client(sys.argv[1], timeout=60); c.wait_for_workers(2, timeout=120); "
            "print(sorted(c.scheduler_info()['workers']))"
        )
        done = lay.run("drv", [sys.executable, "-c", wait, sched], timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"the workers did not join: {done.stderr[-2000:]}{lay.all_logs()}")
        lay.scheduler = sched
        lay.workers = done.stdout.strip()
        yield lay
    finally:
        lay.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    X, y = logistic_rows(800, seed=29)
    path = str(tmp_path_factory.mktemp("data") / "d.zarr")
    fd.from_numpy(X, y, path, chunk_rows=100)
    return path


@pytest.fixture(scope="module")
def in_process(store):
    """The reference: every shard in the test process (no network at all)."""
    return fd.sample(
        fd.LogisticRegression(),
        fd.open_dataset(store),
        fd.FlyMC(bounds="map"),
        placement=fd.Placement(n_shards=4),
        client="synchronous",
        **RUN,
    )


def _drive(layout: Layout, store: str, tmp: Path, **extra) -> tuple[dict, str]:
    """Run :data:`DRIVER` in the driver's namespace; its saved result and its stderr."""
    out = tmp / "res.npz"
    done = layout.run(
        "drv",
        [sys.executable, "-c", DRIVER, store, layout.scheduler, str(out), json.dumps(RUN | extra)],
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"the driver failed ({done.returncode}):\n{done.stderr[-3000:]}{layout.all_logs()}"
        )
    with np.load(out) as f:
        return {k: f[k] for k in f.files}, done.stderr


def _same_draws(got: dict, ref) -> None:
    np.testing.assert_array_equal(got["samples"], ref.samples)
    np.testing.assert_array_equal(got["n_bright"], ref.stats["n_bright"])
    np.testing.assert_array_equal(got["log_joint"], ref.stats["log_joint"])


def test_addresses_exist_only_in_the_namespaces(layout):
    """The hosts' addresses are on no interface of the machine's own namespace, and each
    namespace holds exactly its own (besides loopback); the workers joined by them."""
    assert not ipv4(sh("ip", "-j", "addr")) & set(HOSTS.values())
    for host, address in HOSTS.items():
        held = ipv4(sh("ip", "-n", layout.ns(host), "-j", "addr"))
        assert held == {address, "127.0.0.1"}, (host, held)
    assert layout.workers == str(sorted(f"tcp://{HOSTS[w]}:{WORKER_PORT}" for w in ("w1", "w2")))


@pytest.mark.slow
def test_rounds_cross_the_bridge_on_the_socket_channel(layout, store, in_process, tmp_path):
    """The driver in its namespace samples on the scheduler and workers in theirs: the
    rounds go over the direct socket channel — by TCP: a host's local socket is bound to
    its own namespace, out of the driver's reach — and the draws are the in-process ones."""
    got, err = _drive(layout, store, tmp_path)
    assert str(got["channel"]) == "socket" and int(got["local_channels"]) == 0, err
    assert int(got["n_workers"]) == 2
    _same_draws(got, in_process)
    assert "round channel" not in err, err


def _block_round_channels(layout: Layout) -> None:
    """In each worker's namespace: new TCP connections are dropped, but to Dask's port."""
    rules = f"""
table inet {NFT_TABLE} {{
    chain input {{
        type filter hook input priority 0; policy accept;
        ct state established,related accept
        iif "lo" accept
        tcp dport {WORKER_PORT} accept
        meta l4proto tcp counter drop
    }}
}}
"""
    for w in ("w1", "w2"):
        sh("ip", "netns", "exec", layout.ns(w), "nft", "-f", "-", input=rules)


def _dropped(layout: Layout, w: str) -> int:
    """Packets the firewall of worker ``w`` dropped so far."""
    out = json.loads(
        sh("ip", "netns", "exec", layout.ns(w), "nft", "-j", "list", "table", "inet", NFT_TABLE)
    )
    for item in out["nftables"]:
        for e in item.get("rule", {}).get("expr", []):
            if "counter" in e:
                return int(e["counter"]["packets"])
    raise RuntimeError(f"no counter in {NFT_TABLE} of {w}: {out}")


#: CI only (its connection attempts wait out the connect timeout): the fallback to Dask's
#: RPC runs by default in test_cluster.py's test_unreachable_channel_falls_back_to_dask, the
#: rounds across this network in test_rounds_cross_the_bridge_on_the_socket_channel
@pytest.mark.full_e2e
@pytest.mark.slow
def test_firewalled_round_channels_fall_back_to_dask(layout, store, in_process, tmp_path):
    """Each worker's firewall drops every new connection but to Dask's port: the driver's
    connection to a round channel times out, ``channel="auto"`` says so in one warning
    line and sends the rounds through Dask's RPC; the draws are the in-process ones."""
    if shutil.which("nft") is None:
        pytest.skip("nft is not installed (.ci/run installs nftables from the apt cache)")
    _block_round_channels(layout)
    try:
        got, err = _drive(layout, store, tmp_path)
        dropped = sum(_dropped(layout, w) for w in ("w1", "w2"))
    finally:
        for w in ("w1", "w2"):
            sh("ip", "netns", "exec", layout.ns(w), "nft", "delete", "table", "inet", NFT_TABLE)
    assert dropped > 0  # the firewall, not something else, stopped the channel
    assert str(got["channel"]) == "dask", err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "cannot reach the round channel of tcp://198.18.29." in lines[0], err
    assert "rounds go through Dask's RPC instead" in lines[0], err
    _same_draws(got, in_process)
