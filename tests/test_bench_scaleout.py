"""``flymc bench scaleout``'s table, and the driver-side pieces it times."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from flymc_dist.bench.delay import DelayProxy
from flymc_dist.bench.scaleout import (
    format_scaleout,
    run_scaleout,
    split_cpus,
    threads_on,
    user_cluster,
)
from flymc_dist.streams import Z_DECIDE, stream_key, stream_keys


def _run(**kw: object) -> dict:
    base = {
        "workers": 2, "mode": "replica", "delay_ms": 0.0, "read_ahead": 16,
        "channel": "socket", "ms_per_it": 1.2, "cpu_ms_per_it": 1.0, "round_trips_per_it": 0.07,
        "cpu_ms_per_round": None, "theta_ms_per_it": 0.8, "z_ms_per_it": 0.3,
        "wait_ms_per_it": 0.05, "per_theta": 1.5, "theta_compute_ms_per_it": 0.6,
        "per_theta_compute": 2.0,
        "requests_per_100_it_per_host": 6.5, "n_bright": 2.8, "rhat": 1.004, "min_ess": 1677.0,
    }  # fmt: skip
    return {**base, **kw}


def test_table_shows_the_theta_kernels_compute_and_the_ratio_to_it() -> None:
    d = {
        "rows": 400_000, "features": 20, "kernel": "nuts", "chains": 4, "num_warmup": 200,
        "num_samples": 1000, "load": 3.2, "cpus": 2,
        "runs": [_run(), _run(workers=16, ms_per_it=1.5, theta_compute_ms_per_it=None,
                              per_theta_compute=None)],
    }  # fmt: skip
    text = format_scaleout(d)
    header = text.splitlines()[1]
    assert "θc ms/it" in header and "ms/θc" in header and "wait" in header
    first = text.splitlines()[2].split()
    assert first[8:10] == ["0.300", "0.050"]  # the z-update, of which the wait
    assert "0.600" in first and "2.00" in first
    # a run without the compiled kernel's figure shows a dash there
    assert text.splitlines()[3].split()[11:13] == ["-", "-"]
    assert "W=16 delay 0.0 ms read_ahead 16: 1.25x" in text


def test_table_compares_the_shard_evaluated_runs_per_round_among_themselves() -> None:
    shards = {"mode": "shards", "read_ahead": 0, "round_trips_per_it": 8.0}
    d = {
        "rows": 400_000, "features": 20, "kernel": "nuts", "chains": 4, "num_warmup": 200,
        "num_samples": 1000, "load": 3.2, "cpus": 2,
        "runs": [_run(), _run(workers=16, ms_per_it=1.5),
                 _run(**shards, cpu_ms_per_it=4.0, cpu_ms_per_round=0.5),
                 _run(**shards, workers=16, cpu_ms_per_it=12.0, cpu_ms_per_round=1.5)],
    }  # fmt: skip
    text = format_scaleout(d)
    assert text.splitlines()[4].split()[1:2] == ["shards"] and "0.500" in text.splitlines()[4]
    assert "replica: against its first run" in text and "shards: against its first run" in text
    assert "W=16 delay 0.0 ms read_ahead 0: 1.00x, 3.00x, 3.00x" in text


def test_table_shows_austerity_runs_without_driver_figures() -> None:
    aus = {"mode": "austerity", "read_ahead": 0, "cpu_ms_per_it": None, "theta_ms_per_it": None,
           "z_ms_per_it": None, "per_theta": None, "theta_compute_ms_per_it": None,
           "per_theta_compute": None, "n_bright": None, "round_trips_per_it": 1.9}  # fmt: skip
    d = {
        "rows": 400_000, "features": 20, "kernel": "nuts", "chains": 4, "num_warmup": 200,
        "num_samples": 1000, "load": 3.2, "cpus": 2,
        "runs": [_run(), _run(**aus, ms_per_it=6.5), _run(**aus, workers=4, ms_per_it=7.8)],
    }  # fmt: skip
    text = format_scaleout(d)
    row = text.splitlines()[3].split()
    assert row[1] == "austerity" and row[4] == "6.500" and row[5] == "-"
    assert "austerity: against its first run" in text
    assert "W=4 delay 0.0 ms read_ahead 0: 1.20x, -, -" in text


def test_no_worker_count_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one worker count"):
        run_scaleout(workers=None)


def test_stream_keys_are_stream_key_of_each_chain() -> None:
    for seed in (0, 7, 2**64 - 1, -3):
        for generation, step in ((0, 0), (2, 15), (1, 2**40)):
            got = stream_keys(seed, generation, 5, step, Z_DECIDE)
            want = [stream_key(seed, generation, c, step, Z_DECIDE) for c in range(5)]
            assert got.dtype == np.uint64 and got.tolist() == want
    with pytest.raises(ValueError, match="step must be >= 0"):
        stream_keys(0, 0, 2, -1, Z_DECIDE)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_driver_cpus_must_leave_the_cluster_one() -> None:
    n = len(os.sched_getaffinity(0))
    for bad in (-1, n, n + 3):
        with pytest.raises(ValueError, match="driver_cpus must be between 1 and"):
            split_cpus(bad)
    with pytest.raises(ValueError, match="driver_cpus must be between"):
        run_scaleout(workers=(2,), driver_cpus=n)  # refused before any store is written
    mask = os.sched_getaffinity(0)
    try:  # a process on one CPU: no split
        os.sched_setaffinity(0, {min(mask)})
        with pytest.raises(ValueError, match="two CPUs at least.*may use 1"):
            split_cpus(1)
    finally:
        os.sched_setaffinity(0, mask)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_cluster_runs_on_its_cpus_and_the_driver_keeps_its_own(tmp_path: Path) -> None:
    from distributed import Client

    mine, theirs = split_cpus(1)
    before = os.sched_getaffinity(0)
    with user_cluster(1, str(tmp_path), theirs) as sched_file:
        assert os.sched_getaffinity(0) == before  # the driver's mask given back
        with Client(scheduler_file=sched_file) as client:
            client.wait_for_workers(1, timeout=60)
            masks = client.run(os.sched_getaffinity, 0)
            assert list(masks.values()) == [theirs]
            assert client.run_on_scheduler(os.sched_getaffinity, 0) == theirs
    # every thread of the process on the driver's CPUs in the block, its own mask after
    seen: list[set[int]] = []
    with threads_on(mine):
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        assert os.sched_getaffinity(0) == mine
    assert seen == [mine] and os.sched_getaffinity(0) == before


@pytest.mark.parametrize("lean", [False, True])
def test_lean_workers_have_no_nanny_and_no_profiler(lean: bool, tmp_path: Path) -> None:
    import dask
    from distributed import Client

    with (
        user_cluster(1, str(tmp_path), lean=lean) as sched_file,
        Client(scheduler_file=sched_file) as client,
    ):
        client.wait_for_workers(1, timeout=60)
        (worker,) = client.scheduler_info()["workers"].values()
        assert (worker.get("nanny") is None) == lean
        profiling = client.run(dask.config.get, "distributed.worker.profile.enabled")
        assert list(profiling.values()) == [not lean]


def _echo_server() -> tuple[socket.socket, list[float]]:
    """A loopback server echoing each connection's bytes; the times they arrived."""
    server = socket.create_server(("127.0.0.1", 0))
    arrived: list[float] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 16):
                arrived.append(time.monotonic())
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, arrived


def _read(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n and (data := sock.recv(n - len(out))):
        out += data
    return out


def test_the_delaying_proxy_delays_the_replies_only_in_a_process_of_its_own() -> None:
    """Bytes both ways intact; each reply reaches the client no sooner than the delay
    after the client sent what it answers, while what the client sends reaches the
    target at once; the proxy is another process, on the CPUs asked for, and ends with
    its close (and the connection with it)."""
    server, arrived = _echo_server()
    cpus = {min(os.sched_getaffinity(0))}
    proxy = DelayProxy(server.getsockname()[:2], 0.2, cpus)
    try:
        pid = proxy.pid
        assert pid != os.getpid() and os.sched_getaffinity(pid) == cpus
        with socket.create_connection(proxy.address) as client:
            payload = bytes(range(256)) * 1000
            sent = time.monotonic()
            client.sendall(payload)
            got = _read(client, len(payload))
            came = time.monotonic()
            assert got == payload
            assert came - sent >= 0.2  # the delay, on the replies
            assert arrived[0] - sent < 0.2  # not on the requests
            proxy.close()
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # ended, and waited for
            client.settimeout(10)
            assert client.recv(1) == b""  # the forwarded connection went with it
    finally:
        proxy.close()
        server.close()


def test_a_negative_delay_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="delay must be >= 0 seconds, got -1"):
        DelayProxy(("127.0.0.1", 9), -1.0)
    with pytest.raises(ValueError, match="delay must be >= 0 seconds, got nan"):
        DelayProxy(("127.0.0.1", 9), float("nan"))


def test_a_proxy_on_cpus_it_cannot_have_says_so_and_leaves_no_process() -> None:
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(RuntimeError, match="the delaying proxy did not start: .*Invalid argument"):
        DelayProxy(("127.0.0.1", 9), 0.1, {4096})
    assert {p.pid for p in psutil.Process().children()} == before
