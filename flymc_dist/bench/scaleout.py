"""``flymc bench scaleout``: FlyMC's cost per iteration against the number of workers
and the network's latency.

One float64 logistic store of ``rows`` × ``features`` (the bias included; written once by
:func:`flymc_dist.data.make_logistic` into ``workdir`` and reused) is sampled by
``fd.FlyMC()`` with its defaults (MAP-tuned bounds, the replica, z updated on the
driver with its proposals read ahead) and the ``kernel``, on a cluster started for each
run the way a user starts one: a ``dask scheduler`` and W ``dask worker`` processes (one
thread each; the executables beside ``sys.executable``) on loopback, the driver in this
process, one shard per worker, the rounds on ``channel`` (default ``"tcp"``: TCP sockets,
as to workers on other machines, which the bench stands for; ``"socket"``, the default of
a run, would reach these workers by local sockets, which the delays below cannot be put
in front of). Each W of ``workers`` runs without added latency; each ``delays_ms``
above 0 runs at the first W with that delay added to every reply of every host (a
:class:`~flymc_dist.bench.delay.DelayProxy`, a process of its own, in front of each
host's round channel). Each ``read_ahead`` (the FlyMC option; 0: a round to the hosts
every iteration) runs every configuration, side by side; with ``shard_evaluated`` every
configuration also runs with ``bright_replica=False`` (mode ``shards``: the hosts
evaluate every point the kernel asks for, a round to every host per evaluation, sent
down a tree of hosts of ``fanout`` children each, :class:`~flymc_dist.options.Placement`'s
option: 0 to compare with the driver sending to every host); with ``austerity`` it also
runs with ``fd.Austerity()``'s defaults (mode ``austerity``: random-walk MH, approximate,
its test trips on the same channel; no CPU or θ figures). With ``driver_cpus`` = k the
driver's threads run on k CPUs of their own and the cluster's processes on the others
(Linux's CPU affinity), as when the workers are other machines: on a machine of few CPUs
the W worker processes otherwise take CPU time from the driver's θ-steps, which then
measure the machine rather than the sampler (the θc column shows it); the delaying
proxies, standing for the network, run on the cluster's CPUs. With ``lean_workers`` each
worker starts without a nanny and with Dask's profiler off: the upkeep of many idle
worker processes, Dask's own, then takes less from a machine of few CPUs.

Figures per run (post-warm-up iterations):

* **ms/it**: wall milliseconds per iteration (an iteration moves every chain once);
* **CPU ms/it**: the driver process's CPU milliseconds per iteration
  (``time.process_time`` between its first and last kept iterations: the sampler's thread
  and the Dask client's together);
* **θ ms/it**: the θ-kernel's wall time per iteration inside the run (the step less
  its z-update: ``info["timing"]["theta_kernel"]``), **z ms/it** the z-update's (with any
  wait for its rows), and **ms/θ**, the ratio of ms/it to θ ms/it;
* **wait** (ms/it): of the step, the driver's wait for the hosts (``info["timing"]
  ["round_trip"]``: its rounds, or in replica mode the read-ahead answers not there yet
  when it needs them): above zero, the hosts rather than the driver set the pace;
* **θc ms/it**: of θ ms/it, the compiled θ-kernel transitions alone (every chain's call,
  ``info["timing"]["theta_compute"]``: the kernel's own compute on the replica), and
  **ms/θc**, the ratio of ms/it to it (the floor is 1);
* **req/host**: requests the driver sent each host while sampling, per 100 iterations;
* **CPU ms/rd** (mode ``shards``): the driver's CPU milliseconds per round trip to the
  hosts (CPU ms/it over the round trips per iteration), the cost of a fan-out;
* **R-hat** (largest rank-normalised split-R̂) and **min ESS** (smallest bulk ESS over
  parameters, all chains pooled).

Below the table, each run's ms/it and CPU ms/it over the first run's.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

import flymc_dist as fd
from flymc_dist.bench.common import reusable_store
from flymc_dist.bench.delay import delayed_channels
from flymc_dist.data import make_logistic
from flymc_dist.diagnostics import ess_bulk, rhat
from flymc_dist.driver import Driver
from flymc_dist.transport.channel import check_channel

__all__ = ["format_scaleout", "run_scaleout", "split_cpus", "threads_on", "user_cluster"]


def _dask() -> str:
    """The ``dask`` command beside this Python."""
    path = os.path.join(os.path.dirname(sys.executable), "dask")
    if not os.path.exists(path):
        raise ImportError(f"no 'dask' command beside {sys.executable}: install distributed")
    return path


def split_cpus(driver_cpus: int) -> tuple[set[int], set[int]]:
    """The first ``driver_cpus`` of the CPUs this process may use, and the others.

    Raises
    ------
    ValueError
        Without Linux's CPU affinity, or when no CPU would be left for the cluster.
    """
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("driver_cpus needs Linux's CPU affinity (os.sched_setaffinity)")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(
            f"driver_cpus needs two CPUs at least (the driver's and the cluster's); this "
            f"process may use {len(cpus)}"
        )
    if not 0 < driver_cpus < len(cpus):
        raise ValueError(
            f"driver_cpus must be between 1 and {len(cpus) - 1} (this process may use "
            f"{len(cpus)} CPUs, and the cluster needs one), got {driver_cpus}"
        )
    return set(cpus[:driver_cpus]), set(cpus[driver_cpus:])


@contextlib.contextmanager
def threads_on(cpus: set[int] | None) -> Iterator[None]:
    """Every thread of this process on ``cpus`` while in the block (threads started in
    it inherit the mask); each thread's own mask back after. ``None``: nothing done."""
    if cpus is None:
        yield
        return
    tasks = "/proc/self/task"
    before = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(tasks)}
    try:
        for tid in before:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended
                os.sched_setaffinity(tid, cpus)
        yield
    finally:
        for tid in (int(t) for t in os.listdir(tasks)):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, before.get(tid, before[threading.get_native_id()]))


@contextlib.contextmanager
def _forking_on(cpus: set[int] | None) -> Iterator[None]:
    """This thread on ``cpus`` while in the block, its own mask back after: a process it
    starts takes the mask of the thread that forks it. ``None``: nothing done."""
    if cpus is None:
        yield
        return
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mask)


@contextlib.contextmanager
def user_cluster(
    workers: int, workdir: str, cpus: set[int] | None = None, lean: bool = False
) -> Iterator[str]:
    """A ``dask scheduler`` and ``workers`` ``dask worker`` processes (one thread each)
    on loopback, as a user starts them; yields the scheduler file; stops them after.
    With ``cpus`` the processes (and any they start) run on those CPUs only; ``lean``
    starts each worker without a nanny and with Dask's profiler off."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    if lean:
        env["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] = "False"
    sched_file = os.path.join(workdir, f"scheduler-{os.getpid()}-{time.time_ns()}.json")
    procs: list[subprocess.Popen] = []
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    try:
        with _forking_on(cpus):  # the processes start on ``cpus``
            procs.append(
                subprocess.Popen(
                    [
                        _dask(),
                        "scheduler",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        "0",
                        "--no-dashboard",
                        "--scheduler-file",
                        sched_file,
                    ],
                    **quiet,
                )  # fmt: skip
            )
            deadline = time.monotonic() + 60
            while not os.path.exists(sched_file):
                if time.monotonic() > deadline:
                    raise RuntimeError("the dask scheduler did not start within 60 s")
                time.sleep(0.1)
            for _ in range(workers):
                procs.append(
                    subprocess.Popen(
                        [
                            _dask(),
                            "worker",
                            "--nthreads",
                            "1",
                            *(["--no-nanny"] if lean else []),
                            "--host",
                            "127.0.0.1",
                            "--no-dashboard",
                            "--memory-limit",
                            "0",
                            "--scheduler-file",
                            sched_file,
                        ],
                        **quiet,
                    )  # fmt: skip
                )
        yield sched_file
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        with contextlib.suppress(OSError):
            os.remove(sched_file)


@contextlib.contextmanager
def _cpu_per_step() -> Iterator[list[tuple[int, float]]]:
    """The process's CPU seconds when each iteration of the run starts, ``(iteration,
    seconds)``: at each :meth:`Driver.step` call, and at the start and the end of each
    :meth:`Driver.steps` call (many iterations), while in the block."""
    step, steps = Driver.step, Driver.steps
    marks: list[tuple[int, float]] = []
    done = [0]  # iterations started

    def one(self: Driver, adapters: Any = None) -> dict[str, np.ndarray]:
        marks.append((done[0], time.process_time()))
        done[0] += 1
        return step(self, adapters)

    def many(
        self: Driver, n: int, seconds: float, positions: np.ndarray, stats: dict[str, np.ndarray]
    ) -> int:
        marks.append((done[0], time.process_time()))
        Driver.step = step  # type: ignore[method-assign]  # its own steps: not marked
        try:
            k = steps(self, n, seconds, positions, stats)
        finally:
            Driver.step = one  # type: ignore[method-assign]
        done[0] += k
        marks.append((done[0], time.process_time()))
        return k

    Driver.step, Driver.steps = one, many  # type: ignore[method-assign]
    try:
        yield marks
    finally:
        Driver.step, Driver.steps = step, steps  # type: ignore[method-assign]


def _one(
    ds: Any, sched_file: str, workers: int, kernel: str, chains: int, warmup: int,
    draws: int, seed: int, read_ahead: int, delay_ms: float, mode: str, fanout: int,
    channel: str, cluster_cpus: set[int] | None,
) -> dict[str, Any]:  # fmt: skip
    from distributed import Client

    if mode == "austerity":  # its defaults, with the one kernel it takes
        algorithm: Any = fd.Austerity()
        kernel = "rwmh"
    else:
        replica = "auto" if mode == "replica" else False
        algorithm = fd.FlyMC(read_ahead=read_ahead, bright_replica=replica)
    # the proxies stand for the network: on the cluster's CPUs, not the driver's
    delay = (
        delayed_channels(delay_ms / 1e3, cluster_cpus)
        if delay_ms > 0
        else contextlib.nullcontext([])
    )
    with Client(scheduler_file=sched_file, direct_to_workers=True) as client:
        client.wait_for_workers(workers, timeout=120)
        with delay, _cpu_per_step() as marks:
            res = fd.sample(
                fd.LogisticRegression(),
                ds,
                algorithm,
                kernel,
                num_warmup=warmup,
                num_samples=draws,
                chains=chains,
                seed=seed,
                client=client,
                # a loaded machine may take long to load the shards or to answer
                placement=fd.Placement(timeout=600.0, fanout=fanout, channel=channel),
                progress=False,
            )
    info = res.info
    timing = info.get("timing", {})
    # from the first kept iteration's start to the last mark (the last one's start, or
    # the end of the last block); austerity's iterations are not FlyMC's driver's: no marks
    first = next((t for i, t in marks if i == warmup), None)
    cpu = None
    if first is not None:
        last_i, last_t = marks[-1]
        cpu = (last_t - first) / max(last_i - warmup, 1)
    wall = info["sampling_seconds"] / draws
    replica = mode == "replica"
    theta = timing.get("theta_kernel")
    compute = timing.get("theta_compute")
    sent = info.get("host_messages") or {}
    x = res.samples.reshape(chains, draws, -1)
    trips = float(np.sum(res.stats["round_trips"][0])) / draws
    return {
        "workers": int(info["n_workers"]),
        "mode": mode,
        "delay_ms": float(delay_ms),
        "read_ahead": int(info.get("read_ahead", 0)),
        "channel": info.get("channel"),
        "ms_per_it": 1e3 * wall,
        "cpu_ms_per_it": None if cpu is None else 1e3 * cpu,
        "round_trips_per_it": trips,
        "cpu_ms_per_round": 1e3 * cpu / trips if cpu and trips and mode == "shards" else None,
        "theta_ms_per_it": None if theta is None else 1e3 * theta,
        "z_ms_per_it": None if timing.get("z_update") is None else 1e3 * timing["z_update"],
        "wait_ms_per_it": None if timing.get("round_trip") is None else 1e3 * timing["round_trip"],
        "per_theta": None if not theta else wall / theta,
        "theta_compute_ms_per_it": None if compute is None else 1e3 * compute,
        "per_theta_compute": None if not compute else wall / compute,
        "requests_per_100_it_per_host": (
            100.0 * max(sent.values()) / (warmup + draws) if sent else None
        ),
        # FlyMC's bright rows (austerity's stat of that name is the rows its tests used)
        "n_bright": None if mode == "austerity" else float(np.mean(res.stats["n_bright"])),
        "rhat": float(np.max(rhat(x))),
        "min_ess": float(np.min(ess_bulk(x))),
    }


def run_scaleout(
    rows: int = 400_000,
    features: int = 20,
    kernel: str = "nuts",
    chains: int = 4,
    num_warmup: int = 200,
    num_samples: int = 1000,
    workers: Sequence[int] = (2, 16),
    delays_ms: Sequence[float] = (1.0,),
    read_ahead: Sequence[int] = (fd.FlyMC().read_ahead,),
    shard_evaluated: bool = False,
    austerity: bool = False,
    fanout: int = fd.Placement().fanout,
    channel: str = "tcp",
    driver_cpus: int = 0,
    lean_workers: bool = False,
    seed: int = 0,
    workdir: str | None = None,
) -> dict[str, Any]:
    """FlyMC's cost per iteration on W workers and with added latency, side by side.

    Parameters
    ----------
    rows, features
        The logistic store's N and D (the bias included).
    kernel
        FlyMC's θ-kernel.
    chains
        Chains per run.
    num_warmup, num_samples
        Warm-up and kept iterations per run.
    workers
        The worker counts, each run without added latency.
    delays_ms
        Milliseconds added to every host's replies, each run at the first worker count
        (0: none).
    read_ahead
        The FlyMC option's values to run every configuration with (0: a round to the
        hosts every iteration).
    shard_evaluated
        Also run every configuration with ``bright_replica=False``.
    austerity
        Also run every configuration with ``fd.Austerity()`` (its defaults, random-walk
        MH: approximate) instead of FlyMC.
    fanout
        The hosts the driver, and each host, sends a round to (0: the driver to every
        host; see :class:`~flymc_dist.options.Placement`).
    channel
        How rounds travel (:class:`~flymc_dist.options.Placement`'s option): ``"tcp"``
        as to hosts on other machines, which these processes stand for.
    driver_cpus
        CPUs of the driver's own (the first of those this process may use; the cluster's
        processes run on the others; Linux). 0: the driver and the cluster share every
        CPU.
    lean_workers
        Start each ``dask worker`` without a nanny and with Dask's profiler off: on a
        machine of few CPUs, the upkeep of many idle workers (measured on 2 CPUs: 0.84
        of a CPU for 16 workers with nannies, 0.26 for 2) otherwise takes CPU time from
        the run.
    seed
        The store's and the runs' seed.
    workdir
        Where the store is kept (default: the system's temporary directory).

    Returns
    -------
    dict
        ``runs`` (one dict per run: the figures of the module notes) and the settings.
    """
    workers, delays_ms, read_ahead = list(workers or ()), list(delays_ms or ()), read_ahead or ()
    if not workers:
        raise ValueError("bench scaleout needs at least one worker count")
    channel = check_channel(channel)
    driver_set, cluster_set = split_cpus(driver_cpus) if driver_cpus else (None, None)
    workdir = workdir or os.path.join(tempfile.gettempdir(), "flymc-bench-scaleout")
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, f"logistic-{rows}x{features}-seed{seed}.zarr")
    # chunks small enough for one shard per worker at the largest W (a shard holds
    # whole chunks)
    chunk = max(1, rows // (4 * max(workers)))
    ds = reusable_store(path, rows, features, seed=seed, dtype="float64", chunk_rows=chunk)
    if ds is None:
        ds = make_logistic(path, rows, features, seed=seed, chunk_rows=chunk, overwrite=True)
    plan = [(w, 0.0) for w in workers] + [(workers[0], float(d)) for d in delays_ms if d > 0]
    runs = []
    for w, d in plan:
        modes = ["replica"] + ["shards"] * shard_evaluated + ["austerity"] * austerity
        cluster = user_cluster(w, workdir, cluster_set, lean_workers)
        with cluster as sched_file, threads_on(driver_set):
            for mode in modes:
                for depth in read_ahead if mode == "replica" else read_ahead[:1]:
                    run = _one(
                        ds, sched_file, w, kernel, chains, num_warmup, num_samples, seed, depth,
                        d, mode, fanout, channel, cluster_set,
                    )  # fmt: skip
                    if run["workers"] != w:
                        raise RuntimeError(
                            f"the run held shards on {run['workers']} of {w} workers"
                        )
                    runs.append(run)
    return {
        "rows": rows,
        "features": features,
        "kernel": kernel,
        "chains": chains,
        "num_warmup": num_warmup,
        "num_samples": num_samples,
        "fanout": fanout,
        "channel": channel,
        "driver_cpus": None if driver_set is None else sorted(driver_set),
        "cluster_cpus": None if cluster_set is None else sorted(cluster_set),
        "lean_workers": lean_workers,
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cpus": os.cpu_count(),
        "runs": runs,
    }


def format_scaleout(d: dict[str, Any]) -> str:
    """The table of :func:`run_scaleout`'s figures."""

    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [
        f"flymc bench scaleout: {d['rows']:,} x {d['features']} logistic, FlyMC defaults, "
        f"{d['kernel']}, {d['chains']} chains, {d['num_warmup']} + {d['num_samples']} "
        f"iterations, fanout {f(d.get('fanout'), 'd')}, channel {d.get('channel')}; load "
        f"average {f(d.get('load'), '.1f')} on {d.get('cpus')} CPUs"
        + (
            f"; the driver on CPUs {d['driver_cpus']}, the cluster on {d['cluster_cpus']}"
            if d.get("driver_cpus")
            else "; the driver and the cluster share them"
        )
        + ("; workers without nannies or Dask's profiler" if d.get("lean_workers") else ""),
        f"{'W':>3}{'mode':>10}{'delay':>7}{'ahead':>6}{'ms/it':>8}{'CPU ms/it':>10}"
        f"{'CPU ms/rd':>10}{'θ ms/it':>9}{'z ms/it':>8}{'wait':>7}{'ms/θ':>6}"
        f"{'θc ms/it':>9}{'ms/θc':>6}"
        f"{'req/100it':>10}{'bright':>8}{'R-hat':>7}{'minESS':>8}",
    ]
    for r in d["runs"]:
        lines.append(
            f"{r['workers']:>3}{r['mode']:>10}{r['delay_ms']:>5.1f}ms{r['read_ahead']:>6}"
            f"{r['ms_per_it']:>8.3f}{f(r['cpu_ms_per_it'], '.3f'):>10}"
            f"{f(r['cpu_ms_per_round'], '.3f'):>10}"
            f"{f(r['theta_ms_per_it'], '.3f'):>9}{f(r['z_ms_per_it'], '.3f'):>8}"
            f"{f(r.get('wait_ms_per_it'), '.3f'):>7}"
            f"{f(r['per_theta'], '.2f'):>6}"
            f"{f(r.get('theta_compute_ms_per_it'), '.3f'):>9}"
            f"{f(r.get('per_theta_compute'), '.2f'):>6}"
            f"{f(r['requests_per_100_it_per_host'], '.1f'):>10}{f(r['n_bright'], '.1f'):>8}"
            f"{r['rhat']:>7.3f}{r['min_ess']:>8.0f}"
        )

    def ratio(r: dict[str, Any], a: dict[str, Any], key: str) -> str:
        return f"{r[key] / a[key]:.2f}x" if r.get(key) and a.get(key) else "-"

    for mode in ("replica", "shards", "austerity"):
        runs = [r for r in d["runs"] if r["mode"] == mode]
        if len(runs) < 2:
            continue
        a = runs[0]
        lines.append(f"{mode}: against its first run (ms/it, CPU ms/it, CPU ms/round):")
        for r in runs[1:]:
            lines.append(
                f"  W={r['workers']} delay {r['delay_ms']:.1f} ms read_ahead {r['read_ahead']}: "
                f"{ratio(r, a, 'ms_per_it')}, {ratio(r, a, 'cpu_ms_per_it')}, "
                f"{ratio(r, a, 'cpu_ms_per_round')}"
            )
    return "\n".join(lines)
