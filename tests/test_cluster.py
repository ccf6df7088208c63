"""The same sampler on real Dask clusters: LocalCluster, and `dask scheduler` / `dask worker`
processes driven by address; determinism across placements; a worker SIGKILLed mid-run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from scipy.special import expit, logsumexp

import flymc_dist as fd
from flymc_dist.jointdpm.data import four_blobs

pytestmark = pytest.mark.cluster

#: read-ahead iterations per host where a test needs several requests in a short run
AHEAD = 32


def _logistic_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.c_[np.ones(n), rng.normal(size=n)]
    y = (rng.random(n) < expit(X @ np.array([0.5, -1.0]))).astype(np.int64)
    return X, y


_REFERENCES: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}


def _grid_moments(
    X: np.ndarray, y: np.ndarray, prior_sd: float, lo: np.ndarray, hi: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray]:
    g0, g1 = np.linspace(lo[0], hi[0], n), np.linspace(lo[1], hi[1], n)
    t0, t1 = np.meshgrid(g0, g1, indexing="ij")
    th = np.stack([t0.ravel(), t1.ravel()], 1)
    s = (th @ X.T) * (2 * y - 1)
    lp = -np.logaddexp(0, -s).sum(1) - 0.5 * (th**2).sum(1) / prior_sd**2
    w = np.exp(lp - logsumexp(lp))
    mean = w @ th
    return mean, np.sqrt(w @ (th - mean) ** 2)


def _grid_reference(X: np.ndarray, y: np.ndarray, prior_sd: float) -> tuple[np.ndarray, np.ndarray]:
    """Posterior mean and sd of 2-D Bayesian logistic regression by grid quadrature:
    a coarse grid to locate the posterior, then a fine grid over mean ± 8 sd."""
    key = X.tobytes() + y.tobytes() + np.float64(prior_sd).tobytes()
    if key not in _REFERENCES:
        m, sd = _grid_moments(X, y, prior_sd, np.array([-4.0, -4.0]), np.array([4.0, 4.0]), 161)
        _REFERENCES[key] = _grid_moments(X, y, prior_sd, m - 8 * sd, m + 8 * sd, 241)
    return _REFERENCES[key]


#: exact rows of the cluster tests (``force_exact_rows``): those with |x| >= 1.5, ~13 %
EXACT_X2 = 2.25


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    X, y = _logistic_data(600, seed=11)
    path = str(tmp_path_factory.mktemp("cl") / "d.zarr")
    fd.from_numpy(X, y, path, chunk_rows=100)
    return path, X, y


@pytest.fixture(scope="module")
def local_client(local_clusters):
    """A client of the session's shared 2-worker LocalCluster."""
    from distributed import Client

    client = Client(local_clusters.get(2), direct_to_workers=True)
    yield client
    client.close()


#: the rounds on the direct socket only (no fallback to Dask's RPC)
_SOCKET = fd.Placement(n_shards=3, channel="socket")


def _run(store_path: str, client, **kw):
    model = fd.LogisticRegression(prior="normal", prior_scale=2.0)
    opts = dict(
        algorithm=fd.FlyMC(bounds="map"),
        kernel="rwmh",
        num_warmup=200,
        num_samples=300,
        chains=2,
        seed=3,
        placement=fd.Placement(n_shards=3),
        progress=False,
    )
    opts.update(kw)
    return fd.sample(model, fd.open_dataset(store_path), client=client, **opts)


@pytest.mark.slow
def test_deterministic_across_placements(store, local_client, local_clusters):
    """Same seed ⇒ bit-identical draws in-process, on 1 worker and on 2 workers (100
    iterations: identity needs no more)."""
    path, kw = store[0], dict(num_warmup=40, num_samples=60)
    sync = _run(path, "synchronous", **kw)
    two = _run(path, local_client, **kw)
    assert two.info["n_workers"] == 2
    one_worker = local_client.scheduler_info()["workers"]
    first = sorted(one_worker)[0]
    # one worker: the session's shared 1-worker cluster
    from distributed import Client

    with Client(local_clusters.get(1), direct_to_workers=True) as cl1:
        one = _run(path, cl1, **kw)
    assert one.info["n_workers"] == 1 and first
    np.testing.assert_array_equal(sync.samples, two.samples)
    np.testing.assert_array_equal(sync.samples, one.samples)
    for k in ("n_bright", "likelihood_queries", "accepted"):
        np.testing.assert_array_equal(sync.stats[k], two.stats[k])
    # rounds on the direct socket (the default here: plain tcp://; local sockets, the
    # workers being on this machine), on TCP sockets, or on Dask's actor RPC
    assert two.info["channel"] == "socket" and two.info["local_channels"] == 2
    tcp = _run(path, local_client, placement=fd.Placement(n_shards=3, channel="tcp"), **kw)
    assert tcp.info["channel"] == "socket" and tcp.info["local_channels"] == 0
    np.testing.assert_array_equal(sync.samples, tcp.samples)
    rpc = _run(path, local_client, placement=fd.Placement(n_shards=3, channel="dask"), **kw)
    assert rpc.info["channel"] == "dask"
    np.testing.assert_array_equal(sync.samples, rpc.samples)
    for k in ("n_bright", "likelihood_queries", "accepted", "log_joint"):
        np.testing.assert_array_equal(sync.stats[k], rpc.stats[k])
    other = _run(path, local_client, seed=4, **kw)
    assert not np.array_equal(other.samples, two.samples)


def test_unreachable_channel_falls_back_to_dask(store, local_client, monkeypatch, caplog):
    """A host whose socket cannot be reached (a firewall, say): with channel="auto" the
    rounds go through Dask's RPC instead (same draws); with channel="socket" it is an
    error."""
    from flymc_dist.transport import channel as channel_mod

    def refuse(self, key, address, token, timeout=10.0, **kw):
        raise ConnectionRefusedError(f"refused by the test: {address}")

    monkeypatch.setattr(channel_mod.ChannelClient, "connect", refuse)
    path = store[0]
    res = _run(path, local_client, num_warmup=20, num_samples=30)
    assert res.info["channel"] == "dask"
    assert "rounds go through Dask's RPC instead" in caplog.text
    sync = _run(path, "synchronous", num_warmup=20, num_samples=30)
    np.testing.assert_array_equal(res.samples, sync.samples)
    with pytest.raises(Exception, match="cannot reach the round channel"):
        _run(path, local_client, num_warmup=5, num_samples=5, placement=_SOCKET)


def test_host_that_cannot_listen_falls_back_to_dask(store, local_client, monkeypatch):
    """The host's side refuses (its contact address is not one it can listen on, say):
    the same fallback. The refusal is made in the driver's process by handing the host
    an address no machine has (TEST-NET-1), so the worker's bind fails for real."""
    import flymc_dist.transport.dask as cluster_mod

    monkeypatch.setattr(cluster_mod, "channel_host", lambda worker: "192.0.2.1")
    res = _run(store[0], local_client, num_warmup=10, num_samples=10)
    assert res.info["channel"] == "dask"
    with pytest.raises(Exception, match="cannot reach the round channel"):
        _run(store[0], local_client, num_warmup=5, num_samples=5, placement=_SOCKET)


@pytest.mark.slow
def test_tls_cluster_keeps_rounds_on_dask(store):
    """On a TLS cluster (temporary self-signed credentials) the rounds stay on Dask's
    encrypted, authenticated RPC with channel="auto", as do austerity's test trips and
    JointDPM's shard calls; the draws are the same as in process."""
    pytest.importorskip("cryptography")
    from distributed import Client, LocalCluster
    from distributed.security import Security

    sec = Security.temporary()
    path = store[0]
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            protocol="tls://",
            security=sec,
            dashboard_address=":0",
        ) as cluster,
        Client(cluster, security=sec, direct_to_workers=True) as client,
    ):
        assert all(w.startswith("tls://") for w in client.scheduler_info()["workers"])
        res = _run(path, client, num_warmup=30, num_samples=40)
        # austerity's test trips and JointDPM's shard calls stay on Dask too
        aus = fd.Austerity(eps=0.05, batch_size=50)
        aus_tls = _run(path, client, algorithm=aus, num_warmup=10, num_samples=10)
        X, y = four_blobs(300, 1)
        dpm = {"num_samples": 4, "chains": 1, "seed": 2, "n_shards": 2}
        dpm_tls = fd.sample_jointdpm((X, y), fd.JointDPM(eps=0.3), client=client, **dpm)
    assert res.info["channel"] == "dask" and res.info["n_workers"] == 2
    assert aus_tls.info["channel"] == "dask" and dpm_tls.info["channel"] == "dask"
    sync = _run(path, "synchronous", num_warmup=30, num_samples=40)
    np.testing.assert_array_equal(res.samples, sync.samples)
    aus_sync = _run(path, "synchronous", algorithm=aus, num_warmup=10, num_samples=10)
    np.testing.assert_array_equal(aus_tls.samples, aus_sync.samples)
    dpm_sync = fd.sample_jointdpm((X, y), fd.JointDPM(eps=0.3), client="synchronous", **dpm)
    np.testing.assert_array_equal(dpm_tls.draws["alpha"], dpm_sync.draws["alpha"])
    np.testing.assert_array_equal(dpm_tls.draws["sizes"], dpm_sync.draws["sizes"])


def test_one_round_trip_per_rwmh_iteration(store, local_client):
    res = _run(
        store[0],
        local_client,
        algorithm=fd.FlyMC(bounds="map", read_ahead=0),
        num_warmup=20,
        num_samples=30,
    )
    assert np.all(res.stats["round_trips"] == 1)
    assert np.all(res.warmup_stats["round_trips"] == 1)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["rwmh", "slice"])
def test_posterior_on_local_cluster(store, local_client, kernel):
    """A representative subset of the exactness battery, on a 2-worker LocalCluster."""
    path, X, y = store
    mean, sd = _grid_reference(X, y, prior_sd=2.0)
    res = _run(
        path,
        local_client,
        kernel=kernel,
        num_warmup=400,
        num_samples=1500 if kernel == "rwmh" else 800,
        chains=4,
    )
    from flymc_dist.diagnostics import ess_mean

    draws = res.samples
    for j in range(2):
        x = draws[:, :, j]
        ess = ess_mean(x)
        z = (x.mean() - mean[j]) / (x.std() / np.sqrt(ess))
        assert abs(z) < 3.5, (j, z, ess)
        assert abs(x.std() / sd[j] - 1) < 5 / np.sqrt(2 * ess), (j, x.std(), sd[j])


def _worker_resources() -> dict[str, int]:
    """Run on a worker: its shard hosts, flymc threads, listening TCP sockets and shards."""

    def count() -> tuple[int, int, int, int]:
        import gc
        import threading

        import psutil

        from flymc_dist.shard import Shard
        from flymc_dist.transport.host import ShardHost

        gc.collect()
        hosts = sum(isinstance(o, ShardHost) for o in gc.get_objects())
        threads = sum(t.name.startswith("flymc") for t in threading.enumerate())
        ports = sum(c.status == psutil.CONN_LISTEN for c in psutil.Process().net_connections("tcp"))
        shards = sum(isinstance(o, Shard) for o in gc.get_objects())
        return hosts, threads, ports, shards

    return count


@pytest.mark.slow
def test_runs_and_a_killed_driver_leave_no_shard_host_behind(store, tmp_path, monkeypatch):
    """Runs on one long-lived cluster leave each worker's shard hosts, flymc threads and
    listening ports at their count before the first run, and a driver killed mid-run
    leaves none either (Dask drops its actors; the host's channel server then stops).
    Every round port a run used refuses connections afterwards. A run drops its shards
    (their rows) before it returns, not when Dask gets round to its actors: a next run
    started at once would load its rows beside them."""
    from distributed import Client, LocalCluster

    from flymc_dist.transport import channel as channel_mod

    used: list[tuple[str, int]] = []
    local: list[str] = []
    connect = channel_mod.ChannelClient.connect

    def recording(self, key, address, token, timeout=10.0, local_name=None):
        used.append(tuple(address))
        local.append(local_name)
        return connect(self, key, address, token, timeout, local_name=local_name)

    monkeypatch.setattr(channel_mod.ChannelClient, "connect", recording)
    count = _worker_resources()
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster, direct_to_workers=True) as client,
    ):
        before = client.run(count)
        assert all(v[0] == 0 and v[1] == 0 for v in before.values()), before
        for _ in range(3):
            res = _run(
                store[0], client, num_warmup=10, num_samples=10, placement=fd.Placement(n_shards=2)
            )
            assert res.info["channel"] == "socket"
            held = client.run(count)  # at once
            assert all(v[3] == 0 for v in held.values()), held
        _wait_for(lambda: client.run(count) == before, 30, "the hosts to be released")
        assert len(used) == 6 and all(local)  # the workers are here: local sockets too
        for address in used:
            with pytest.raises(OSError):
                socket.create_connection(address, timeout=5).close()
        for name in local:  # the local sockets are gone with their hosts
            with pytest.raises(OSError), socket.socket(socket.AF_UNIX) as s:
                s.connect("\0" + name)
        # a driver that disappears mid-run (SIGKILL): its hosts go with its client
        code = (
            "import sys, flymc_dist as fd; fd.sample(fd.LogisticRegression(), sys.argv[1], "
            "client=sys.argv[2], placement=fd.Placement(n_shards=2), num_warmup=10, "
            "num_samples=10**7, chains=2, "
            "progress=False)"
        )
        driver = subprocess.Popen(
            [sys.executable, "-c", code, store[0], cluster.scheduler_address],
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_for(
                lambda: all(v[0] == 1 and v[1] > 0 for v in client.run(count).values()),
                120,
                "the driver's hosts",
            )
            time.sleep(1.0)  # mid-run
        finally:
            driver.kill()
            driver.wait()
        _wait_for(lambda: client.run(count) == before, 60, "the killed driver's hosts to go")


# ---------------------------------------------------------------- real processes
#: how long a test waits for what always comes (a process started, draws in a trace): a
#: guard against a hang only, long enough for a loaded machine
HANG = 600.0


def _wait_for(pred, timeout: float, what: str) -> None:
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


class ProcessCluster:
    """`dask scheduler` and two `dask worker` processes (no nanny) on loopback, started by
    this interpreter (``python -m dask``, not the first `dask` on PATH).

    One serves the module's tests: :meth:`ready` restarts only what a test killed (a
    worker; everything, after the scheduler)."""

    N_WORKERS = 2

    def __init__(self, directory) -> None:
        self.scheduler_file = str(directory / "scheduler.json")
        self.env = dict(os.environ, DASK_DISTRIBUTED__WORKER__DAEMON="False")
        self.scheduler: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.address = ""

    @property
    def _common(self) -> list[str]:
        """The options of every process: on loopback, no dashboard, the scheduler file."""
        return ["--host", "127.0.0.1", "--no-dashboard", "--scheduler-file", self.scheduler_file]

    def _start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "dask", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.env,
        )

    def ready(self) -> dict:
        """The cluster with its scheduler and every worker running (those a test killed
        started again), as the tests read it."""
        from distributed import Client

        if self.scheduler is None or self.scheduler.poll() is not None:
            self.close()
            if os.path.exists(self.scheduler_file):
                os.remove(self.scheduler_file)
            self.scheduler = self._start("scheduler", "--port", "0", *self._common)
            _wait_for(lambda: os.path.exists(self.scheduler_file), HANG, "the scheduler file")
        self.workers = [w for w in self.workers if w.poll() is None]
        while len(self.workers) < self.N_WORKERS:
            self.workers.append(
                self._start("worker", "--nthreads", "1", "--no-nanny", *self._common)
            )
        with Client(scheduler_file=self.scheduler_file, direct_to_workers=True) as c:
            # the killed workers' places taken: exactly the live ones are known
            _wait_for(
                lambda: len(c.scheduler_info(n_workers=-1)["workers"]) == self.N_WORKERS,
                HANG,
                f"{self.N_WORKERS} workers",
            )
            self.address = c.scheduler.address
        return {
            "address": self.address,
            "scheduler_file": self.scheduler_file,
            "scheduler": self.scheduler,
        }

    def close(self) -> None:
        """Stop every process, one at a time, the workers first: a worker told to stop
        while the scheduler is closing can hang in its own close (distributed 2026.8: a
        CancelledError in ``rpc.close``) and stay alive until killed (20 s a test)."""
        procs = [p for p in (self.scheduler, *self.workers) if p is not None]
        for p in procs[::-1]:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.scheduler, self.workers = None, []


@pytest.fixture(scope="module")
def process_cluster_of_module(tmp_path_factory):
    """The module's :class:`ProcessCluster`, stopped at its end."""
    cluster = ProcessCluster(tmp_path_factory.mktemp("process_cluster"))
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture()
def process_cluster(process_cluster_of_module):
    """`dask scheduler` and two `dask worker` processes (no nanny) on loopback: the
    module's, with what an earlier test killed started again."""
    return process_cluster_of_module.ready()


@pytest.mark.slow
def test_real_cluster_by_address(store, process_cluster):
    path = store[0]
    res = _run(path, process_cluster["address"], num_warmup=50, num_samples=100)
    sync = _run(path, "synchronous", num_warmup=50, num_samples=100)
    assert res.info["n_workers"] == 2
    np.testing.assert_array_equal(res.samples, sync.samples)
    by_file = _run(path, process_cluster["scheduler_file"], num_warmup=10, num_samples=10)
    assert by_file.samples.shape == (2, 10, 2)


def _kill_a_worker_once(pids: dict, trace: str, draws: int) -> tuple[threading.Thread, dict]:
    """A started thread that SIGKILLs the last worker of ``pids`` once ``trace`` holds
    ``draws`` draws; the dict it fills says which worker and when (or the error)."""
    from flymc_dist.trace import Trace

    killed: dict[str, object] = {}

    def enough_draws() -> bool:
        try:  # the trace may be half-created when we look
            return Trace.open(trace).n_draws >= draws
        except (FileNotFoundError, ValueError, KeyError):
            return False

    def killer() -> None:
        try:
            _wait_for(enough_draws, HANG, "draws in the trace")
        except Exception as err:  # noqa: BLE001 - reported through `killed`
            killed["error"] = err
            return
        victim = sorted(pids)[-1]
        os.kill(pids[victim], signal.SIGKILL)
        killed["worker"] = victim
        killed["time"] = time.time()

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    return th, killed


#: the variants of a worker killed mid-run in the default run: each kernel, the relay, exact
#: rows and out-of-core shards once; "rwmh" (the relayed run's path without the relay)
#: and "nuts" (the exact-rows run's without its rows) in CI only (``--full-grid``;
#: tests/test_tiers.py checks the cover)
KILL_DEFAULT = ("rwmh-relayed", "nuts-exact-rows", "rwmh-out-of-core")


@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel",
    [
        pytest.param(k, marks=[] if k in KILL_DEFAULT else [pytest.mark.full_grid])
        for k in ["rwmh", "rwmh-relayed", "nuts", "nuts-exact-rows", "rwmh-out-of-core"]
    ],
)
def test_worker_killed_mid_run(
    store, process_cluster, tmp_path, kernel, force_exact_rows, monkeypatch
):
    """SIGKILL a worker mid-run: the run completes, the lost shards are recreated on the
    live worker with z redrawn exactly, and the posterior is still right. RWMH with the
    shards' own sums (``bright_replica=False``), the driver sending to every host, and
    relayed (``fanout=1``: the driver sends rounds to the first host only, which forwards
    them to the killed one and names it lost); NUTS on the driver's replica of the bright rows
    (the recreated shards send their whole bright sets, which replace their rows); RWMH
    with out-of-core shards (recreated out of core, their z drawn in a streamed pass);
    NUTS with exact rows (the recreated shards replay their rule before
    their tight points)."""
    from distributed import Client

    from flymc_dist.trace import Trace

    path, X, y = store
    trace = str(tmp_path / "trace.zarr")
    fly, place = {
        "rwmh": ({"bright_replica": False}, {"fanout": 0}),
        "rwmh-relayed": ({"bright_replica": False}, {"fanout": 1}),
        "nuts": ({"bright_replica": True}, {}),
        "nuts-exact-rows": ({"bright_replica": True}, {}),
        "rwmh-out-of-core": ({}, {"out_of_core": True}),
    }[kernel]
    ooc = kernel.endswith("out-of-core")
    exact = kernel.endswith("exact-rows")
    if exact:
        force_exact_rows(1, EXACT_X2)
    relayed = kernel.endswith("-relayed")
    for suffix in ("-out-of-core", "-exact-rows", "-relayed"):
        kernel = kernel.removesuffix(suffix)
    # rows lent mapped here right after each recovery: none (the lost host's would pin
    # its memory until the run's end; the live ones' are lent again as z is taken anew)
    from flymc_dist.transport.dask import DaskTransport

    mapped_after_recovery: list[int] = []
    recover = DaskTransport._recover

    def recording(self, *args):
        recover(self, *args)
        with open("/proc/self/maps") as f:
            mapped_after_recovery.append(sum("flymc-lent-rows" in line for line in f))

    monkeypatch.setattr(DaskTransport, "_recover", recording)
    with Client(process_cluster["address"], direct_to_workers=True) as client:
        th, killed = _kill_a_worker_once(client.run(os.getpid), trace, 100)
        res = _run(
            path,
            client,
            algorithm=fd.FlyMC(bounds="map", **fly),
            kernel=kernel,
            num_warmup=300,
            num_samples=2000,
            chains=4,
            trace=trace,
            checkpoint_every=50,
            placement=fd.Placement(n_shards=3, timeout=10, **place),
        )
        th.join(timeout=5)
    assert "worker" in killed, killed
    if exact:
        n_exact = int(np.sum(X[:, 1] ** 2 >= EXACT_X2))
        assert res.info["exact_rows"] == n_exact > 0
        assert res.stats["n_bright"].min() >= n_exact  # also after the recovery
    if ooc:
        assert res.info["out_of_core"] == [True] * 3
    elif kernel == "rwmh":
        assert not res.info["bright_replica"]
        if relayed:  # the killed host was below the relay: not the one sent rounds
            assert killed["worker"] != sorted(res.info["host_messages"])[0]
    else:
        # z on the driver, its proposals read ahead (a recovery asks again at once, for
        # IN_FLIGHT requests, and the block taken asks for the next)
        from flymc_dist.ahead import IN_FLIGHT

        assert res.info["bright_replica"] and res.stats["round_trips"].max() <= 1 + IN_FLIGHT
        # the hosts on this machine lend their rows (asked nothing: the kill is seen on
        # the killed host's connection), before the kill and after the recovery
        assert res.info["lending_hosts"] >= 1
        assert mapped_after_recovery and set(mapped_after_recovery) == {0}
        assert res.stats["round_trips"].sum() <= 4 * (
            1 + IN_FLIGHT + 2000 // res.info["read_ahead"]
        )
    assert res.samples.shape == (4, 2000, 2)
    assert np.all(np.isfinite(res.samples))
    rec = res.info["recoveries"]
    assert len(rec) >= 1 and rec[0]["lost_workers"] == [killed["worker"]]
    assert res.stats["recoveries"].sum() + res.warmup_stats["recoveries"].sum() >= 1
    # the driver noticed within a few seconds of the kill
    assert rec[0]["time"] - killed["time"] < 10
    mean, sd = _grid_reference(X, y, prior_sd=2.0)
    from flymc_dist.diagnostics import ess_mean

    for j in range(2):
        x = res.samples[:, :, j]
        ess = ess_mean(x)
        assert abs(x.mean() - mean[j]) / (x.std() / np.sqrt(ess)) < 3.5
    assert Trace.open(trace).n_draws == 2000


@pytest.mark.slow
def test_worker_killed_mid_austerity_run(store, process_cluster, tmp_path):
    """Austerity: SIGKILL a worker mid-run; its shards are reopened on the live worker,
    the decision in progress starts over, and the run completes with all its draws. The
    loss is noticed when the worker leaves the scheduler, not after the placement's
    ``timeout`` (before, the run stalled for all of it: 60 s by default)."""
    from distributed import Client

    from flymc_dist.trace import Trace

    path, X, y = store
    trace = str(tmp_path / "aus.zarr")
    with Client(process_cluster["address"], direct_to_workers=True) as client:
        th, killed = _kill_a_worker_once(client.run(os.getpid), trace, 10)
        res = _run(
            path,
            client,
            algorithm=fd.Austerity(eps=0.05, batch_size=150),
            num_warmup=30,
            num_samples=300,
            chains=2,
            trace=trace,
            checkpoint_every=5,
            placement=fd.Placement(n_shards=3),
        )
        finished = time.time()
        th.join(timeout=5)
    assert "worker" in killed, killed
    assert finished - killed["time"] < fd.Placement().timeout / 2
    assert res.samples.shape == (2, 300, 2) and np.all(np.isfinite(res.samples))
    rec = res.info["recoveries"]
    assert len(rec) >= 1 and rec[0]["lost_workers"] == [killed["worker"]]
    assert res.info["restarted_decisions"] >= 1 and res.info["restarted_queries"] >= 0
    assert Trace.open(trace).n_draws == 300
    # approximate, but not far off: within half a posterior sd of the exact mean
    mean, sd = _grid_reference(X, y, prior_sd=2.0)
    assert np.all(np.abs(res.samples.reshape(-1, 2).mean(axis=0) - mean) < 0.5 * sd)


@pytest.mark.slow
def test_resume_recovery_resume_never_reuse_a_z_stream(
    store, process_cluster, tmp_path, monkeypatch
):
    """The shards' z streams are keyed by a generation that resume and fault recovery
    advance together: a fresh run (0), its resume (1), a worker lost during that resume
    (2) and a second resume (3) each draw from streams no other segment used. (Before,
    a resume always took generation 1 and a recovery counted from 0 again in each
    segment, so a recovery after a resume, or a second resume, reused a z stream.)"""
    import psutil
    from distributed import Client

    from flymc_dist.driver import Driver
    from flymc_dist.trace import Trace

    path = store[0]
    trace = str(tmp_path / "trace.zarr")
    real_step = Driver.step

    def stop_after(n: int, kill: tuple[int, int] | None = None):
        """Driver.step interrupted at its ``n``-th call; with ``kill = (k, pid)``, the
        worker ``pid`` SIGKILLed (and gone) before the ``k``-th: in the run's own course,
        so the next read-ahead request meets the lost worker whatever the machine's
        speed."""
        calls = {"n": 0}

        def step(self, adapters=None):
            calls["n"] += 1
            if kill is not None and calls["n"] == kill[0]:
                victim = psutil.Process(kill[1])
                victim.kill()
                victim.wait(HANG)
            if calls["n"] == n:
                raise KeyboardInterrupt
            return real_step(self, adapters)

        return step

    kw = dict(
        algorithm=fd.FlyMC(bounds="map", read_ahead=AHEAD),
        num_warmup=100,
        num_samples=600,
        trace=trace,
        checkpoint_every=20,
        placement=fd.Placement(n_shards=3, timeout=10),
    )
    # every iteration through Driver.step (after warm-up the replica's run a block per
    # call of Driver.steps: test_compiled_loop shows the same draws)
    monkeypatch.delattr(Driver, "steps")
    with Client(process_cluster["address"], direct_to_workers=True) as client:
        monkeypatch.setattr(Driver, "step", stop_after(150))
        with pytest.raises(KeyboardInterrupt):
            _run(path, client, **kw)
        assert Trace.open(trace).checkpoint["generation"] == 0
        # the resumed segment loses a worker 50 iterations in, then is interrupted in turn:
        # a request covers AHEAD iterations per host (2 hosts) and one more is in
        # flight, so a request meets the lost worker before the interruption
        assert 50 + 2 * (2 * AHEAD) < 300
        pids = client.run(os.getpid)
        monkeypatch.setattr(Driver, "step", stop_after(300, kill=(50, pids[sorted(pids)[-1]])))
        with pytest.raises(KeyboardInterrupt):
            _run(path, client, resume=True, **kw)
        assert Trace.open(trace).checkpoint["generation"] == 2  # resume 1, recovery 2
        monkeypatch.setattr(Driver, "step", real_step)
        res = _run(path, client, resume=True, **kw)
    assert Trace.open(trace).checkpoint["generation"] == 3
    assert res.samples.shape == (2, 600, 2) and np.all(np.isfinite(res.samples))


@pytest.mark.parametrize("kernel", ["slice", "nuts", "nuts-exact-rows"])
def test_replica_mode_deterministic_across_placements(
    store, local_client, local_clusters, kernel, force_exact_rows
):
    """Replica mode (the θ-kernel on the driver's copy of the bright rows): the same
    draws in-process, on 1 and on 2 workers (also with exact rows), the workers lending
    their rows (no request while sampling)."""
    from distributed import Client

    path = store[0]
    kernel_id = kernel
    if kernel.endswith("exact-rows"):
        force_exact_rows(1, EXACT_X2)
    kernel = kernel.removesuffix("-exact-rows")
    kw = dict(
        algorithm=fd.FlyMC(bounds="map", bright_replica=True, read_ahead=AHEAD),
        kernel=kernel,
        num_warmup=50,
        num_samples=100,
    )
    sync = _run(path, "synchronous", **kw)
    two = _run(path, local_client, **kw)
    with Client(local_clusters.get(1), direct_to_workers=True) as cl1:
        one = _run(path, cl1, **kw)
    assert sync.info["bright_replica"] and two.info["bright_replica"]
    assert two.info["n_workers"] == 2 and one.info["n_workers"] == 1
    if kw["kernel"] == "nuts":
        assert (sync.info["exact_rows"] > 0) == (kernel_id == "nuts-exact-rows")
    for other in (one, two):
        np.testing.assert_array_equal(sync.samples, other.samples)
        for k in ("n_bright", "likelihood_queries", "accepted", "log_joint"):
            np.testing.assert_array_equal(sync.stats[k], other.stats[k])
        # the driver's own z-update, its proposals read ahead: the hosts (local) lend
        # their rows, so nothing travels (a request per block otherwise: test_scaleout)
        depth = other.info["read_ahead"]  # read_ahead iterations per host
        assert depth == AHEAD * other.info["n_workers"]
        assert other.info["lending_hosts"] == other.info["n_workers"]
        assert other.stats["round_trips"].max() == 0


@pytest.mark.slow
def test_scheduler_killed_mid_run_says_so_and_keeps_the_trace(
    store, process_cluster, tmp_path, capsys
):
    """SIGKILL the `dask scheduler` mid-run (`flymc run --scheduler …`): the error says the
    scheduler was lost (no KeyError), and the trace, checkpointed, is kept for --resume."""
    from flymc_dist.cli import main
    from flymc_dist.trace import Trace

    trace = str(tmp_path / "t.zarr")
    sched = process_cluster["scheduler"]

    def killer() -> None:
        def checkpointed() -> bool:
            try:
                return Trace.open(trace, read_only=True).n_draws >= 100
            except (FileNotFoundError, ValueError, KeyError):
                return False

        _wait_for(checkpointed, HANG, "draws in the trace")
        sched.send_signal(signal.SIGKILL)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    code = main(
        [
            "run",
            store[0],
            "--model",
            "logistic",
            "--scheduler",
            process_cluster["address"],
            "--warmup",
            "50",
            "--samples",
            "100000",
            "--chains",
            "2",
            "--checkpoint-every",
            "50",
            "--no-progress",
            "--trace",
            trace,
        ]
    )
    th.join(5)
    _, err = capsys.readouterr()
    assert sched.poll() is not None, "the scheduler was not killed"
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) >= 2, err
    assert "scheduler" in lines[-2] and "was lost" in lines[-2], err
    assert "KeyError" not in err
    assert "--resume" in lines[-1] and "keeps" in lines[-1]
    kept = Trace.open(trace, read_only=True)
    assert kept.checkpoint is not None and kept.n_draws >= 100


@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_what_to_do(store, tmp_path):
    """fd.sample(client=None) at a script's unguarded top level: worker processes would
    import the script again and run it; refused before any starts, in one line saying
    what to do (no "Nanny failed to start" tracebacks). Guarded, the same call runs."""
    call = (
        f"fd.sample(fd.LogisticRegression(), {store[0]!r}, num_warmup=5, num_samples=5, "
        "chains=1, placement=fd.Placement(n_workers=1), progress=False)\nprint('sampled')\n"
    )
    scripts = {
        "bare": "import flymc_dist as fd\n" + call,
        "guarded": "import flymc_dist as fd\nif __name__ == '__main__':\n"
        + "".join(f"    {line}\n" for line in call.splitlines()),
    }
    out = {}
    for name, text in scripts.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        out[name] = subprocess.run(
            [sys.executable, str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env=dict(os.environ, CI="1"),
        )
    bare = out["bare"]
    assert bare.returncode == 1 and "Nanny failed" not in bare.stderr
    last = bare.stderr.strip().splitlines()[-1]
    assert 'if __name__ == "__main__":' in last and "bare.py" in last
    assert out["guarded"].returncode == 0, out["guarded"].stderr
    assert "sampled" in out["guarded"].stdout


@pytest.mark.slow
def test_a_set_up_pass_may_outlast_the_timeout(store, monkeypatch):
    """A full pass (here a slow MAP pass) longer than ``timeout`` does not declare its
    worker lost while the scheduler still has it: only protocol rounds are timed out."""
    from distributed import Client, LocalCluster

    from flymc_dist.shard import Shard

    real = Shard.loglik_sum

    def slow(self, *args, **kwargs):
        time.sleep(1.0)  # twice the timeout
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Shard, "loglik_sum", slow)  # workers in this process: it applies
    with (
        LocalCluster(n_workers=2, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        res = _run(
            store[0],
            client,
            placement=fd.Placement(n_shards=3, timeout=0.5),
            num_warmup=20,
            num_samples=20,
            map_maxiter=2,
        )
    assert res.info["recoveries"] == [] and res.samples.shape == (2, 20, 2)


def test_connect_timeout_is_scoped_to_the_run(store, local_client):
    """The short connect timeout a run uses is not left in the user's Dask settings."""
    import dask

    with dask.config.set({"distributed.comm.timeouts.connect": "17s"}):
        _run(store[0], local_client, num_warmup=5, num_samples=5)
        assert dask.config.get("distributed.comm.timeouts.connect") == "17s"


def _busy(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def test_the_embedded_cluster_runs_no_profiler(local_client):
    """The embedded cluster's workers (``local_cluster``) have Dask's statistical
    profiler off: nothing samples their threads' stacks, even while a task keeps one
    busy (with it on, 0.3 s of work left 12–25)."""
    import dask

    local_client.submit(_busy, 0.3, pure=False).result()
    enabled = local_client.run(lambda: dask.config.get("distributed.worker.profile.enabled"))
    assert set(enabled.values()) == {False}
    samples = local_client.run(_profile_samples)
    assert set(samples.values()) == {0}


def _profile_samples(dask_worker: Any) -> int:
    """The stack samples a worker's profiler holds, recent and past."""
    past = sum(p["count"] for _, p in dask_worker.profile_history)
    return int(dask_worker.profile_recent["count"] + past)
