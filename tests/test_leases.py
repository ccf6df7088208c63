"""A driver that dies leaves nothing on the workers (issue 41, item 2): SIGKILL the driver
of an out-of-core run on a real LocalCluster, and each worker's row files, reading threads,
their file descriptors and the run's channel threads go."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import flymc_dist as fd

pytestmark = pytest.mark.cluster


def _held(dask_worker=None) -> dict[str, int]:
    """On a worker: what out-of-core runs placed there (files, threads, descriptors)."""
    import glob
    import threading

    files = len(glob.glob(os.path.join(str(dask_worker.local_directory), "flymc-rows-*")))
    fds = 0
    for fd_ in os.listdir("/proc/self/fd"):
        try:
            fds += "flymc-rows-" in os.readlink(f"/proc/self/fd/{fd_}")
        except OSError:
            pass
    names = [t.name for t in threading.enumerate()]
    return {
        "files": files,
        "fds": fds,
        "read_threads": names.count("flymc-row-read"),
        "channel_threads": sum(n.startswith("flymc-channel") for n in names),
    }


def _wait_for(pred, timeout: float, what: str) -> None:
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.5)


def _driver_code(timeout: float = 60.0, algorithm: str = "fd.FlyMC()") -> str:
    """A driver script: an out-of-core run on two shards of the cluster at ``argv[2]``,
    of the store ``argv[1]``, that goes on until it is killed."""
    return (
        "import sys, flymc_dist as fd; fd.sample(fd.LogisticRegression(), sys.argv[1], "
        f"{algorithm}, client=sys.argv[2], placement=fd.Placement(n_shards=2, "
        f"out_of_core=True, timeout={timeout}), num_warmup=10, num_samples=10**7, "
        "chains=2, progress=False)"
    )


def _wait_for_shards(client) -> None:
    """Until every worker holds one out-of-core shard of the driver (its row file, its
    reading thread and the run's channel)."""
    _wait_for(
        lambda: all(
            v["files"] == 1 and v["read_threads"] == 1 and v["channel_threads"] > 0
            for v in client.run(_held).values()
        ),
        180,
        "the driver's out-of-core shards",
    )


def _hosts(dask_worker) -> list:
    """On a worker: the shard hosts it holds as actors."""
    from flymc_dist.transport.host import ShardHost

    return [a for a in list(dask_worker.state.actors.values()) if isinstance(a, ShardHost)]


def _rounds(dask_worker=None) -> int:
    """On a worker: the rounds its shard hosts have served (sampling has begun)."""
    return sum(h.timing()["rounds"] for h in _hosts(dask_worker))


def _store(tmp_path) -> str:
    rng = np.random.default_rng(2)
    X = np.c_[np.ones(4000), rng.normal(size=(4000, 3))]
    y = (rng.random(4000) < 0.5).astype(np.int64)
    path = str(tmp_path / "d.zarr")
    fd.from_numpy(X, y, path, chunk_rows=500)
    return path


EMPTY = {"files": 0, "fds": 0, "read_threads": 0, "channel_threads": 0}


@pytest.fixture(scope="module")
def cluster():
    """The module's 2-worker LocalCluster: its tests stall a worker (and let it run again)
    but kill none, and each ends with nothing held on any worker (started once: each
    start costs seconds of CPU)."""
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as c:
        yield c


@pytest.mark.slow
def test_a_killed_driver_leaves_no_row_file_thread_or_descriptor(tmp_path, cluster):
    from distributed import Client

    path = _store(tmp_path)
    code = _driver_code()
    with Client(cluster) as client:
        before = client.run(_held)
        assert all(v == EMPTY for v in before.values()), before
        driver = subprocess.Popen(
            [sys.executable, "-c", code, path, cluster.scheduler_address],
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_for_shards(client)
            time.sleep(2.0)  # mid-run
        finally:
            driver.kill()  # SIGKILL: nothing of the driver runs after it
            driver.wait()
        _wait_for(
            lambda: all(v == EMPTY for v in client.run(_held).values()),
            60,
            f"the killed driver's resources to go (held: {client.run(_held)})",
        )


def _row_file(dask_worker=None) -> str:
    """On a worker: the path of its one row file."""
    import glob

    (path,) = glob.glob(os.path.join(str(dask_worker.local_directory), "flymc-rows-*"))
    return path


def _truncate(path: str) -> None:
    """On a worker: cut ``path`` to half its size (a disk that lost its tail)."""
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["stalled", "truncated"])
def test_a_lost_shard_leaves_no_row_file_thread_or_descriptor(tmp_path, cluster, fault):
    """A shard lost mid-run and recreated on the other worker — its worker stalled by
    SIGSTOP past the run's timeout, or its row file truncated — leaves nothing where it
    was: once the stalled worker runs again (SIGCONT), or at once for the truncated file,
    that worker holds no row file, reading thread, descriptor or channel thread of the
    run, while the run goes on on the other worker; and once the driver is killed, no
    worker holds anything."""
    import signal

    from distributed import Client

    path = _store(tmp_path)
    with Client(cluster) as client:
        before = client.run(_held)
        assert all(v == EMPTY for v in before.values()), before
        pids = client.run(os.getpid)
        # rounds to the shards every iteration (no replica), each given up after 3 s
        code = _driver_code(timeout=3.0, algorithm="fd.FlyMC(bright_replica=False)")
        # the driver's stderr to a file, shown if it does not recover (a pipe read only at
        # the end would stop a driver that wrote more than a pipe holds)
        said = tmp_path / "driver-stderr"
        with open(said, "wb") as err:
            driver = subprocess.Popen(
                [sys.executable, "-c", code, path, cluster.scheduler_address], stderr=err
            )
        try:
            _wait_for_shards(client)
            # sampling (set-up's full passes wait for a worker however long it takes)
            _wait_for(lambda: all(r > 20 for r in client.run(_rounds).values()), 180, "sampling")
            lost, live = sorted(pids)
            if fault == "stalled":
                os.kill(pids[lost], signal.SIGSTOP)
            else:
                client.run(_truncate, client.run(_row_file, workers=[lost])[lost], workers=[lost])
            try:
                # the driver gives the lost shard up and recreates it on the live worker
                _wait_for(
                    lambda: client.run(_held, workers=[live])[live]["files"] == 2,
                    120,
                    "the lost shard recreated on the live worker",
                )
                if fault == "stalled":  # its actor is dropped meanwhile
                    time.sleep(2.0 * 3.0)
            except AssertionError as e:  # what the driver said: why it did not recover
                tail = said.read_bytes().decode(errors="replace")[-4000:]
                raise AssertionError(f"{e}; the driver's stderr:\n{tail}") from None
            finally:
                if fault == "stalled":
                    os.kill(pids[lost], signal.SIGCONT)
            _wait_for(
                lambda: client.run(_held, workers=[lost])[lost] == EMPTY,
                60,
                f"the lost shard's resources to go (held: {client.run(_held, workers=[lost])})",
            )
            assert driver.poll() is None, said.read_text(errors="replace")[-2000:]  # goes on
            assert client.run(_held, workers=[live])[live]["files"] == 2
        finally:
            driver.kill()
            driver.wait()
        _wait_for(
            lambda: all(v == EMPTY for v in client.run(_held).values()),
            60,
            f"the killed driver's resources to go (held: {client.run(_held)})",
        )
        assert client.run(os.getpid) == pids


def _lease_check(seconds: float) -> None:
    """On a worker: set the seconds between a new host's lease checks."""
    import flymc_dist.transport.host as host

    host.LEASE_CHECK = seconds


_KEPT: list = []


def _keep_hosts(dask_worker=None) -> int:
    """On a worker: hold a reference to each of its shard hosts (as a cycle or a frame
    kept alive by a traceback would); the number held."""
    _KEPT.extend(_hosts(dask_worker))
    return len(_KEPT)


def _drop_hosts() -> None:
    _KEPT.clear()


def test_a_host_let_go_before_its_lease_looked_is_released(tmp_path, cluster):
    """A host whose run lets it go before its lease first looks (another host refused
    its shards just after this one opened: issue 41's q 0.2) is released all the same,
    though something on the worker still refers to it: its row file and descriptor go
    at the lease's next look, not when the garbage collector gets to it. (The lease
    released only a host it had once seen held: a row file stayed in one CI run; this
    test fails so, the host held 13 s later.)"""
    from distributed import Client

    from flymc_dist.protocol import ShardConfig, ShardSpec
    from flymc_dist.transport.host import ShardHost

    path = _store(tmp_path)
    config = ShardConfig(
        model=fd.LogisticRegression(),
        algorithm="flymc",
        chains=2,
        seed=0,
        n_rows=4000,
        out_of_core=True,
    )
    with Client(cluster) as client:
        assert all(v == EMPTY for v in client.run(_held).values())
        worker = sorted(client.run(os.getpid))[0]
        client.run(_lease_check, 3.0, workers=[worker])  # its first look 3 s after opening
        try:
            fut = client.submit(
                ShardHost,
                [ShardSpec(0, path, 0, 4000)],
                config,
                actor=True,
                workers=[worker],
                pure=False,
            )
            fut.result()
            assert client.run(_keep_hosts, workers=[worker])[worker] == 1
            fut.cancel()  # within its lease's first 3 s
            del fut
            _wait_for(
                lambda: client.run(_held, workers=[worker])[worker] == EMPTY,
                10,
                f"the host's rows to go (held: {client.run(_held, workers=[worker])})",
            )
        finally:
            client.run(_drop_hosts, workers=[worker])
            client.run(_lease_check, 1.0, workers=[worker])
