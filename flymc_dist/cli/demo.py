"""``flymc demo``: FlyMC against regular MCMC on a synthetic data set, on a LocalCluster."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

import flymc_dist as fd
from flymc_dist import diagnostics
from flymc_dist.cli.common import CLIError, fmt, percent, progress_from, say
from flymc_dist.data import make_logistic
from flymc_dist.kernels import get_kernel
from flymc_dist.result import narrowing_line
from flymc_dist.transport.dask import local_client

DEMO_ROWS = 200_000
DEMO_FEATURES = 10
DEMO_SAMPLES = 1500
#: regular MCMC's draws: each NUTS iteration of it is tens of full passes over the data
DEMO_REGULAR_SAMPLES = 60
#: the demo's θ-kernel: NUTS on the driver's replica of the bright rows
DEMO_KERNEL = "nuts"


# --------------------------------------------------------------------------- demo


def _demo_table(rows: list[tuple[str, str, str]]) -> list[str]:
    w = max(len(r[0]) for r in rows)
    return [f"  {a:<{w}}  {b:>14}  {c:>14}" for a, b, c in rows]


def _agreement(a: Any, b: Any, names: list[str] | None = None) -> str:
    """One line comparing two posteriors' means, in posterior sd and in Monte Carlo error."""
    ta, tb = diagnostics.summary(a.samples), diagnostics.summary(b.samples)
    ma, mb = np.ravel(ta["mean"]), np.ravel(tb["mean"])
    sa, sb = np.ravel(ta["sd"]), np.ravel(tb["sd"])
    ea, eb = np.ravel(ta["ess_bulk"]), np.ravel(tb["ess_bulk"])
    sd = np.sqrt(0.5 * (sa**2 + sb**2))
    d = np.abs(ma - mb) / sd
    mcse = np.sqrt(sa**2 / ea + sb**2 / eb) / sd  # MC error of Δmean, in sd
    z = d / mcse
    if not (np.all(np.isfinite(d)) and np.all(np.isfinite(z))):
        return "agreement: not computable (a parameter has no finite ESS)"
    j = int(np.argmax(d))
    label = names[j] if names is not None and len(names) == d.size else f"parameter {j}"
    # a z above ~4 for any of a handful of parameters is not Monte Carlo noise
    verdict = "agree" if float(z.max()) < 4.0 else "DISAGREE"
    return (
        f"agreement: max |Δmean|/sd = {d[j]:.3f} ({label}; Monte Carlo error of "
        f"the difference ≈ {mcse[j]:.3f} sd, max z = {z.max():.2f} over {d.size} "
        f"parameters) — the posteriors {verdict}"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    t_all = time.perf_counter()
    samples = args.samples
    warmup = args.warmup if args.warmup is not None else max(samples // 4, 20)
    reg_samples = args.regular_samples or DEMO_REGULAR_SAMPLES
    if samples < 4 or reg_samples < 4:
        raise CLIError("--samples and --regular-samples must be at least 4 (for the ESS)")
    n, d, chains = args.rows, args.features, args.chains
    say("flymc demo — Firefly Monte Carlo against regular MCMC, synthetic logistic regression")
    tmp = tempfile.mkdtemp(prefix="flymc-demo-")
    client = cluster = None
    try:
        t = time.perf_counter()
        ds = make_logistic(os.path.join(tmp, "demo.zarr"), n, d, seed=args.seed)
        say(
            f"  data      {n:,} rows × {d} features (incl. bias) → temporary zarr store, "
            f"{ds.n_chunks} chunks ({time.perf_counter() - t:.1f} s)"
        )
        if args.synchronous:
            client = "synchronous"
            say("  cluster   none: every shard in this process (--synchronous)")
        else:
            workers = args.workers or max(1, min(os.cpu_count() or 1, 8))
            t = time.perf_counter()
            client, cluster = local_client(workers)
            client.wait_for_workers(workers, timeout=120)
            say(
                f"  cluster   embedded LocalCluster, {workers} workers × 1 thread, one shard "
                f"per worker ({time.perf_counter() - t:.1f} s to start)"
            )
        say(
            f"  sampling  {args.kernel.upper()}, {chains} chains, Laplace-preconditioned, "
            f"started near the MAP: FlyMC {warmup} warm-up + {samples} draws; regular MCMC "
            f"{reg_samples} draws with FlyMC's tuned step size (each of its evaluations is a "
            f"full data pass)"
        )
        model = fd.LogisticRegression()
        common = {
            "chains": chains,
            "seed": args.seed,
            "client": client,
            "progress": progress_from(args),
        }
        t = time.perf_counter()
        fly = fd.sample(
            model,
            ds,
            fd.FlyMC(bounds="map"),
            args.kernel,
            num_warmup=warmup,
            num_samples=samples,
            **common,
        )
        t_fly = time.perf_counter() - t
        # Both target the same posterior: regular MCMC reuses FlyMC's adapted step size and
        # skips warm-up (its chains start at MAP + Laplace jitter, close to a posterior draw).
        step = float(np.mean([p["step_size"] for p in fly.info["kernel_params"]]))
        t = time.perf_counter()
        reg = fd.sample(
            model,
            ds,
            fd.Regular(),
            get_kernel(args.kernel, step_size=step),
            num_warmup=0,
            num_samples=reg_samples,
            **common,
        )
        t_reg = time.perf_counter() - t
    finally:
        if cluster is not None:
            with contextlib.suppress(Exception):
                client.close()
            with contextlib.suppress(Exception):
                cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)

    names = ds.feature_names
    table = diagnostics.summary(fly.samples, names=names)
    say("")
    say("FlyMC (MAP-tuned bounds) posterior:")
    say(diagnostics.format_summary(table, max_rows=4).replace("... ", "… "))
    ef, er = fly.efficiency(), reg.efficiency()
    rh_f = float(np.nanmax(table["r_hat"]))
    rh_r = float(np.nanmax(diagnostics.rhat(reg.samples)))
    say("")
    rows = [
        ("", "FlyMC", "regular"),
        (
            "ESS bulk, min / mean",
            f"{ef['ess_min']:.0f} / {ef['ess_mean']:.0f}",
            f"{er['ess_min']:.0f} / {er['ess_mean']:.0f}",
        ),
        ("R̂ max", f"{rh_f:.3f}", f"{rh_r:.3f}"),
        ("acceptance", f"{ef['acceptance']:.3f}", f"{er['acceptance']:.3f}"),
        ("bright fraction", percent(ef["bright_fraction"]), percent(er["bright_fraction"])),
        (
            "likelihood queries / iteration",
            f"{ef['queries_per_iteration'] * chains:,.0f}",
            f"{er['queries_per_iteration'] * chains:,.0f}",
        ),
        (
            "seconds / iteration",
            f"{ef['seconds_per_iteration']:.4f}",
            f"{er['seconds_per_iteration']:.4f}",
        ),
        ("ESS / second", fmt(ef["ess_per_second"]), fmt(er["ess_per_second"])),
        ("ESS / million queries", fmt(1e6 * ef["ess_per_query"]), fmt(1e6 * er["ess_per_query"])),
        (
            "set-up (MAP, bounds), s",
            f"{fly.info['setup_seconds']:.1f}",
            f"{reg.info['setup_seconds']:.1f}",
        ),
    ]
    for line in _demo_table(rows):
        say(line)
    say(
        "  (queries and seconds per iteration: all chains together; regular MCMC ran fewer "
        "draws, so its ESS and R̂ are rougher)"
    )
    per_it = er["seconds_per_iteration"] / ef["seconds_per_iteration"]
    per_q = ef["ess_per_query"] / er["ess_per_query"]
    per_s = ef["ess_per_second"] / er["ess_per_second"]
    say("")
    say(
        f"speedup of FlyMC: {per_it:.1f}× per iteration, {fmt(per_q)}× in ESS per likelihood "
        f"query, {fmt(per_s)}× in ESS per second"
    )
    line = narrowing_line(fly.info, ef["ess_min_per_draw"])
    if line is not None:
        say(line)
    say(_agreement(fly, reg, names))
    say(
        f"done in {time.perf_counter() - t_all:.0f} s (FlyMC {t_fly:.0f} s, regular "
        f"{t_reg:.0f} s including set-up)"
    )
    return 0
