"""``flymc bench overhead``: FlyMC's per-iteration cost against the bare round trip.

One run, one cluster, measurements side by side on the same workers and the same
``rows × features`` logistic data set:

(a) MAP-tuned FlyMC with RWMH (``fd.sample(..., client=<the client>)``), its rounds on
    the direct socket channel (:mod:`flymc_dist.transport.channel`, the default on ``tcp://``
    clusters: local sockets to these workers, all on this machine), again on TCP sockets
    (``channel="tcp"``, as to workers on other machines) and again on Dask's actor RPC
    (``channel="dask"``);
(b) regular full-data MCMC with the same kernel;
(c) the bare actor fan-out round trip: a no-op method
    (:meth:`ShardHost.shard_ids <flymc_dist.shard.ShardHost.shard_ids>`) called on the
    shard-host actor of every worker, the way Dask calls an actor method (arguments
    serialised, run on the actor's thread) — what any sampler that calls its actors
    once per iteration pays. The goal's denominator.

For the floors of the ways rounds travel, echoes of a FlyMC round's request are timed on
the same actors too: on the socket channel (local sockets), on TCP sockets, and on Dask's
RPC as the Dask channel sends rounds (raw bytes, run on the worker's event loop).

(a) and (b) run with the samplers' default layout, one shard per worker (so one call
per worker per iteration, like (c)). Their per-iteration time is that of the post-warm-up iterations
(``res.info["sampling_seconds"] / num_samples``). The actor call and the socket echoes
are timed in two batches, before (a) and after the last sampler, so a drift in the
machine's load shows.

Regular MCMC starts where FlyMC's chains ended, with FlyMC's adapted step size and
preconditioner (both target the same posterior), so it needs neither a MAP search nor a
warm-up: its iterations are full passes over the data, and only their time matters here.

The goals the ratios are checked against: FlyMC / bare actor round trip ≤ 1.5 (a FlyMC
iteration costs little more than calling the actors once) and regular / FlyMC ≥ 8 per
iteration.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import tempfile
import time
from typing import Any

import numpy as np

import flymc_dist as fd
from flymc_dist.data import make_logistic
from flymc_dist.options import Placement
from flymc_dist.protocol import Request, Round, ShardConfig, ShardSpec, pack_round
from flymc_dist.transport.dask import DaskTransport, local_client

__all__ = [
    "GOAL_FLYMC_OVER_BARE",
    "GOAL_REGULAR_OVER_FLYMC",
    "format_overhead",
    "run_overhead",
]

#: Goal for (FlyMC seconds per iteration) / (bare round trip seconds).
GOAL_FLYMC_OVER_BARE = 1.5
#: Goal for (regular seconds per iteration) / (FlyMC seconds per iteration).
GOAL_REGULAR_OVER_FLYMC = 8.0
#: Draws per chain below which the per-ESS ratios are flagged as rough.
_MIN_ESS_DRAWS = 200


def _check_int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def _round_payload(chains: int, n_params: int) -> bytes:
    """A FlyMC RWMH round's request, packed as the transport sends it (its size matters)."""
    reqs = [Request(np.zeros((1, n_params)), False, False) for _ in range(chains)]
    return pack_round(Round(1, np.full(chains, -1, dtype=np.int64), True, reqs))


def _time_pings(transport: Any, n: int, how: str, payload: bytes = b"") -> dict[str, float]:
    """Time ``n`` bare fan-out round trips to every host of ``transport``.

    ``how``: ``"actor"`` — :meth:`ShardHost.shard_ids` as Dask calls an actor method
    (arguments serialised, run on the actor's thread); ``"socket"`` — an echo of
    ``payload`` on the socket channel (:meth:`DaskTransport.echo`); ``"rpc"`` — an echo
    of ``payload`` on Dask's RPC the way the Dask channel sends rounds (a raw ``bytes``
    argument, run on the worker's event loop).
    """
    if how == "actor":
        calls = {w: ("shard_ids", (), {}) for w in transport.placement}
    elif how == "rpc":
        calls = {w: ("echo", (payload,), {}) for w in transport.placement}
    elif how != "socket":
        raise ValueError(f"unknown round trip {how!r}")
    times = np.empty(n)
    for i in range(n):
        t = time.perf_counter()
        if how == "socket":
            transport.echo(payload)
        else:
            _ok, bad = transport.fanout_calls(calls)
            if bad:
                raise RuntimeError(f"a bare round trip failed: {bad!r}")
        times[i] = time.perf_counter() - t
    return {
        "mean": float(times.mean()),
        "median": float(np.median(times)),
        "p90": float(np.quantile(times, 0.9)),
        "n": int(n),
    }


def _tcp_echo(
    client: Any, specs: list[ShardSpec], config: ShardConfig, payload: bytes, warm: int, n: int
) -> dict[str, float]:
    """:func:`_time_pings` of the socket echo over TCP (``channel="tcp"``), on hosts of
    their own (a host takes one driver at a time), closed before returning."""
    transport = DaskTransport(client, specs, config, Placement(channel="tcp"))
    try:
        _time_pings(transport, warm, "socket", payload)
        return _time_pings(transport, n, "socket", payload)
    finally:
        transport.close()


def _merge(first: dict[str, float], second: dict[str, float]) -> dict[str, Any]:
    n1, n2 = first["n"], second["n"]
    return {
        "mean": (first["mean"] * n1 + second["mean"] * n2) / (n1 + n2),
        "median": float(np.median([first["median"], second["median"]])),
        "before": first,
        "after": second,
    }


def _sampler_figures(res: Any) -> dict[str, Any]:
    """Per-iteration time and efficiency figures of one ``fd.sample`` result."""
    eff = res.efficiency()
    return {
        "seconds_per_iteration": eff["seconds_per_iteration"],
        "iterations": int(res.samples.shape[1]),
        "warmup": int(res.info["num_warmup"]),
        "n_shards": int(res.info["n_shards"]),
        "n_workers": int(res.info["n_workers"]),
        "queries_per_iteration": eff["queries_per_iteration"],
        "bright_fraction": eff["bright_fraction"],
        "acceptance": eff["acceptance"],
        "round_trips_per_iteration": eff["round_trips_per_iteration"],
        "lending_hosts": int(res.info.get("lending_hosts", 0)),
        "ess_mean": eff["ess_mean"],
        "ess_min": eff["ess_min"],
        "r_hat_max": eff["r_hat_max"],
        "ess_per_iteration": eff["ess_mean"] / (res.samples.shape[0] * res.samples.shape[1]),
        "ess_per_second": eff["ess_per_second"],
        "ess_per_query": eff["ess_per_query"],
        "timing": res.info.get("timing"),
        "setup_seconds": float(res.info["setup_seconds"]),
        "sampling_seconds": float(res.info["sampling_seconds"]),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else float("nan")


def run_overhead(
    rows: int = 2_000_000,
    features: int = 57,
    workers: int = 2,
    iterations: int = 1000,
    chains: int = 4,
    seed: int = 0,
    *,
    regular_iterations: int = 20,
    warmup: int = 200,
    pings: int = 1000,
    workdir: str | None = None,
    client: Any = None,
) -> dict[str, Any]:
    """Measure FlyMC's, regular MCMC's and a bare round trip's per-iteration wall time.

    Parameters
    ----------
    rows, features
        Shape of the synthetic logistic data set (``features`` includes the bias).
    workers
        Worker processes of the LocalCluster started for the run.
    iterations
        Post-warm-up FlyMC iterations timed.
    chains
        Chains (all carried by every round trip).
    seed
        Seeds the data and the samplers.
    regular_iterations
        Regular MCMC iterations timed: fewer than FlyMC's, since each one is a full pass
        over the data (per-iteration times are what is compared).
    warmup
        FlyMC warm-up iterations (step-size adaptation).
    pings
        Bare round trips timed (half before the samplers, half after).
    workdir
        Directory for the temporary data store (default: the system's temp directory).
    client
        An existing ``distributed.Client`` to measure on instead of a new LocalCluster
        (``workers`` is then the number of workers it has; it is left open).

    Returns
    -------
    dict
        ``setup`` (how it was run), ``bare_round_trip``, ``flymc``, ``regular``,
        ``ratios`` and ``goals``.
        Times are in seconds.
    """
    rows = _check_int("rows", rows, 2)
    features = _check_int("features", features, 1)
    workers = _check_int("workers", workers, 1)
    iterations = _check_int("iterations", iterations, 4)
    regular_iterations = _check_int("regular_iterations", regular_iterations, 4)
    warmup = _check_int("warmup", warmup, 0)
    chains = _check_int("chains", chains, 1)
    seed = _check_int("seed", seed, 0)
    pings = _check_int("pings", pings, 2)
    t_start = time.perf_counter()
    out: dict[str, Any] = {
        "setup": {
            "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
            "cores": os.cpu_count(),
            "load_average": _loadavg(),
            "python": platform.python_version(),
            "rows": rows,
            "features": features,
            "workers": workers,
            "chains": chains,
            "iterations": iterations,
            "warmup": warmup,
            "regular_iterations": regular_iterations,
            "pings": pings,
            "seed": seed,
            "kernel": "rwmh",
            "bounds": "map",
            "pinning": "none: driver, scheduler and workers share the machine's cores",
        },
    }
    model = fd.LogisticRegression()
    with tempfile.TemporaryDirectory(prefix="flymc-bench-", dir=workdir) as tmp:
        t = time.perf_counter()
        ds = make_logistic(os.path.join(tmp, "data.zarr"), rows, features, seed=seed)
        out["setup"]["data_seconds"] = time.perf_counter() - t
        t = time.perf_counter()
        own = client is None
        cluster = None
        if own:
            client, cluster = local_client(workers)
        else:
            workers = len(client.scheduler_info()["workers"])
            out["setup"]["workers"] = workers
        out["setup"]["cluster_seconds"] = time.perf_counter() - t
        try:
            client.wait_for_workers(workers, timeout=120)
            # (c) the bare round trip: the same transport, actors and shard layout as (a)
            specs = [
                ShardSpec(i, ds.path, a, b)
                for i, (a, b) in enumerate(ds.shard_ranges(n_shards=workers))
            ]
            config = ShardConfig(
                model=model,
                algorithm="flymc",
                chains=chains,
                seed=seed,
                n_rows=ds.n_rows,
                z_update="implicit",
                q_db=0.01,
                resample_fraction=0.1,
                track_grad=False,
            )
            P = model.n_params(features)
            payload = _round_payload(chains, P)
            out["setup"]["payload_bytes"] = len(payload)
            first_tcp = _tcp_echo(client, specs, config, payload, 50, pings // 2)
            transport = DaskTransport(client, specs, config, Placement(channel="socket"))
            try:
                _time_pings(transport, 50, "actor")  # warm the connections
                _time_pings(transport, 50, "socket", payload)
                _time_pings(transport, 20, "rpc", payload)
                first = _time_pings(transport, pings // 2, "actor")
                first_socket = _time_pings(transport, pings // 2, "socket", payload)
                rpc_echo = _time_pings(transport, max(pings // 4, 2), "rpc", payload)
                out["setup"]["local_channels"] = transport.local_hosts
                out["setup"]["echo_hosts"] = transport.n_workers
            finally:
                transport.close()

            def run(
                algorithm: Any, n_iter: int, n_warm: int, kernel: Any = "rwmh", **opts: Any
            ) -> Any:
                return fd.sample(
                    model,
                    ds,
                    algorithm,
                    kernel,
                    num_warmup=n_warm,
                    num_samples=n_iter,
                    chains=chains,
                    seed=seed,
                    client=client,
                    progress=False,
                    **opts,
                )

            fly = run(fd.FlyMC(bounds="map"), iterations, warmup)
            out["flymc"] = _sampler_figures(fly)
            out["setup"]["channel"] = fly.info["channel"]
            # the same run with its rounds on TCP sockets (as to workers elsewhere)
            out["flymc_tcp"] = _sampler_figures(
                run(fd.FlyMC(bounds="map"), iterations, warmup, placement=Placement(channel="tcp"))
            )
            # the same run with its rounds on Dask's actor RPC: same draws, other time
            out["flymc_dask_channel"] = _sampler_figures(
                run(
                    fd.FlyMC(bounds="map"),
                    iterations,
                    warmup,
                    placement=fd.Placement(channel="dask"),
                )
            )
            # regular MCMC: FlyMC's last draws, step size and preconditioner (no MAP search,
            # no warm-up needed: the chains already sample the posterior)
            kp = fly.info["kernel_params"]
            tril = np.asarray(kp[0]["scale_tril"], float)
            # (init as a list: Driver.setup compares init == "map", ambiguous for an array)
            reg_opts = {
                "init": fly.samples[:, -1].reshape(chains, -1).tolist(),
                "precondition": tril @ tril.T,
                "kernel": fd.RWMH(step_size=float(np.mean([p["step_size"] for p in kp]))),
            }
            out["regular"] = _sampler_figures(run(fd.Regular(), regular_iterations, 0, **reg_opts))
            transport = DaskTransport(client, specs, config, Placement(channel="socket"))
            try:
                _time_pings(transport, 20, "actor")
                _time_pings(transport, 20, "socket", payload)
                second = _time_pings(transport, pings - pings // 2, "actor")
                second_socket = _time_pings(transport, pings - pings // 2, "socket", payload)
            finally:
                transport.close()
            second_tcp = _tcp_echo(client, specs, config, payload, 20, pings - pings // 2)
        finally:
            if own:
                client.close()
                cluster.close()
    out["bare_round_trip"] = _merge(first, second)
    out["socket_echo"] = _merge(first_socket, second_socket)
    out["tcp_echo"] = _merge(first_tcp, second_tcp)
    out["rpc_echo"] = rpc_echo
    f, r, bare = out["flymc"], out["regular"], out["bare_round_trip"]["mean"]
    ratios = {
        "flymc_over_bare": _ratio(f["seconds_per_iteration"], bare),
        "flymc_over_socket_echo": _ratio(f["seconds_per_iteration"], out["socket_echo"]["mean"]),
        "flymc_over_tcp_echo": _ratio(f["seconds_per_iteration"], out["tcp_echo"]["mean"]),
        "flymc_tcp_over_tcp_echo": _ratio(
            out["flymc_tcp"]["seconds_per_iteration"], out["tcp_echo"]["mean"]
        ),
        "flymc_dask_channel_over_bare": _ratio(
            out["flymc_dask_channel"]["seconds_per_iteration"], bare
        ),
        "flymc_dask_channel_over_rpc_echo": _ratio(
            out["flymc_dask_channel"]["seconds_per_iteration"], rpc_echo["mean"]
        ),
        "regular_over_flymc_per_iteration": _ratio(
            r["seconds_per_iteration"], f["seconds_per_iteration"]
        ),
        "flymc_over_regular_ess_per_second": _ratio(f["ess_per_second"], r["ess_per_second"]),
        "flymc_over_regular_ess_per_query": _ratio(f["ess_per_query"], r["ess_per_query"]),
    }
    # ESS from a few dozen draws per chain is noise: say so rather than print a verdict
    ratios["per_ess_reliable"] = bool(
        regular_iterations >= _MIN_ESS_DRAWS and iterations >= _MIN_ESS_DRAWS
    )
    out["ratios"] = ratios
    out["goals"] = {
        "flymc_over_bare": {
            "goal": f"<= {GOAL_FLYMC_OVER_BARE}",
            "met": bool(ratios["flymc_over_bare"] <= GOAL_FLYMC_OVER_BARE),
        },
        "regular_over_flymc_per_iteration": {
            "goal": f">= {GOAL_REGULAR_OVER_FLYMC}",
            "met": bool(ratios["regular_over_flymc_per_iteration"] >= GOAL_REGULAR_OVER_FLYMC),
        },
    }
    out["setup"]["load_average_after"] = _loadavg()
    out["seconds"] = time.perf_counter() - t_start
    return out


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        return None


def _ms(x: float) -> str:
    return f"{1e3 * x:8.2f} ms" if math.isfinite(x) else "     n/a"


def _sig(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else "n/a"


def format_overhead(d: dict[str, Any]) -> str:
    """Render the result of :func:`run_overhead` as a short report.

    Parameters
    ----------
    d
        The dict :func:`run_overhead` returned.

    Returns
    -------
    str
        Several lines, no trailing newline.
    """
    s = d["setup"]
    load = s.get("load_average")
    load_txt = ""
    if load:
        after = s.get("load_average_after")
        load_txt = f"; load average {load[0]:.2f}" + (f" → {after[0]:.2f}" if after else "")
    lines = [
        "flymc bench overhead — per-iteration wall time, all on one cluster",
        f"  run       {s['date']}; {s['machine']}{load_txt}; Python {s['python']}",
        f"  data      {s['rows']:,} rows × {s['features']} features (logistic, incl. bias); "
        f"generated in {s['data_seconds']:.1f} s",
        f"  cluster   LocalCluster, {s['workers']} workers × 1 thread "
        f"(started in {s['cluster_seconds']:.1f} s)",
        f"  sampling  RWMH, {s['chains']} chains; FlyMC {s['warmup']} warm-up + "
        f"{s['iterations']} timed iterations; regular {s['regular_iterations']} timed "
        f"iterations from FlyMC's last draws, step size and preconditioner",
        "",
        f"  {'':36s}{'s / iteration':>13s}  {'shards':>6s}  {'queries/it/chain':>16s}  "
        f"{'ESS/s':>8s}  {'set-up s':>8s}",
    ]

    def floor(label: str, b: dict[str, Any], note: str) -> None:
        extra = (
            f"before {_ms(b['before']['mean']).strip()} / after {_ms(b['after']['mean']).strip()}; "
            if "before" in b
            else ""
        )
        lines.append(
            f"  {label:36s}{_ms(b['mean'])}  {s['workers']:>6d}  {'0':>16s}  "
            f"{'':>8s}  {'':>8s}  {extra}{note}"
        )

    floor(
        "(c) bare actor round trip",
        d["bare_round_trip"],
        "a no-op actor method on every worker, as Dask calls it",
    )
    floor(
        "    echo on the socket channel",
        d["socket_echo"],
        f"a round's {s.get('payload_bytes', 0):,}-byte request, as FlyMC's rounds travel "
        f"({s.get('local_channels', 0)} of {s.get('echo_hosts', 0)} hosts by local sockets)",
    )
    floor("    echo on TCP sockets", d["tcp_echo"], "the same, with channel='tcp'")
    floor("    echo on Dask's RPC", d["rpc_echo"], "the same, as rounds travel with channel='dask'")
    rows = [
        ("(a) FlyMC, MAP-tuned", "flymc"),
        ("    FlyMC, rounds on TCP sockets", "flymc_tcp"),
        ("    FlyMC, rounds on Dask's RPC", "flymc_dask_channel"),
        ("(b) regular MCMC", "regular"),
    ]
    for label, key in rows:
        if key not in d:
            continue
        r = d[key]
        lines.append(
            f"  {label:36s}{_ms(r['seconds_per_iteration'])}  {r['n_shards']:>6d}  "
            f"{r['queries_per_iteration']:>16,.0f}  {_sig(r['ess_per_second']):>8s}  "
            f"{r['setup_seconds']:>8.1f}"
        )
    f = d["flymc"]
    lines.append(
        f"  FlyMC bright fraction {f['bright_fraction']:.3g}, acceptance "
        f"{f['acceptance']:.3f}, {f['round_trips_per_iteration']:.2f} round trips per "
        f"iteration, rows lent by {f.get('lending_hosts', 0)} of {f['n_workers']} hosts "
        f"(TCP: {d.get('flymc_tcp', {}).get('lending_hosts', 0)}); ESS (bulk, mean) "
        f"FlyMC {_sig(f['ess_mean'])} (min "
        f"{_sig(f['ess_min'])}, R-hat max {f['r_hat_max']:.3f}), regular "
        f"{_sig(d['regular']['ess_mean'])} (from "
        f"{d['regular']['iterations']} × {s['chains']} draws: rough)"
    )
    ra, g = d["ratios"], d["goals"]

    def verdict(key: str) -> str:
        return "met" if g[key]["met"] else "NOT met"

    lines += [
        "",
        f"  FlyMC / bare actor round trip {_sig(ra['flymc_over_bare']):>8s}×   "
        f"(goal {g['flymc_over_bare']['goal']}: {verdict('flymc_over_bare')})",
        f"  FlyMC / socket echo           {_sig(ra['flymc_over_socket_echo']):>8s}×   "
        f"(what FlyMC adds to its own channel's floor: compute, not communication)",
        f"  FlyMC / TCP echo              {_sig(ra['flymc_over_tcp_echo']):>8s}×   "
        f"(on TCP sockets: FlyMC {_sig(ra['flymc_tcp_over_tcp_echo'])}× its echo)",
        f"  FlyMC on Dask's RPC: / bare actor round trip "
        f"{_sig(ra['flymc_dask_channel_over_bare'])}×, / its echo "
        f"{_sig(ra['flymc_dask_channel_over_rpc_echo'])}×",
        f"  regular / FlyMC per iteration {_sig(ra['regular_over_flymc_per_iteration']):>8s}×   "
        f"(goal {g['regular_over_flymc_per_iteration']['goal']}: "
        f"{verdict('regular_over_flymc_per_iteration')})",
        f"  FlyMC / regular ESS per second {_sig(ra['flymc_over_regular_ess_per_second']):>7s}×",
        f"  FlyMC / regular ESS per query  {_sig(ra['flymc_over_regular_ess_per_query']):>7s}×",
    ]
    if not ra.get("per_ess_reliable", True):
        lines.append(
            f"    (per ESS: rough — regular MCMC ran {s['regular_iterations']} draws "
            f"per chain; use --regular-iterations {_MIN_ESS_DRAWS} or more for a "
            f"usable figure)"
        )
    for key, label in (
        ("flymc", "(a)"),
        ("flymc_dask_channel", "Dask's RPC"),
    ):
        t = d.get(key, {}).get("timing")
        if t and t.get("hosts"):
            hw = max(h["round_wall"] for h in t["hosts"])
            hc = max(h["round_cpu"] for h in t["hosts"])
            lines.append(
                f"  where FlyMC's time goes, {label}: step {_ms(t['step']).strip()} = "
                f"round trip {_ms(t['round_trip']).strip()} (busiest worker's round "
                f"{_ms(hw).strip()} wall, {_ms(hc).strip()} CPU"
                f") + driver {_ms(t['driver']).strip()}"
            )
    lines.append(f"  total {d['seconds']:.0f} s")
    return "\n".join(lines)
