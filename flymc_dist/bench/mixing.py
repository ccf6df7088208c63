"""``flymc bench mixing``: converged draws per second of the whole run, FlyMC against regular MCMC.

Both run the same θ-kernel (NUTS by default) on the same shards, side by side in one
process: MAP-tuned FlyMC (on the driver's replica of the bright rows, one round trip
per iteration) and regular MCMC (every gradient a full pass over the data, all chains'
requests in one round trip). For each it reports the whole run's wall seconds (set-up:
MAP search, bounds, first z; warm-up; sampling — the cluster is started before and is
not counted), the minimum and median over parameters of the bulk ESS, the largest
R̂, min-ESS per second of the whole run, and per iteration the round trips, likelihood
queries and seconds. A speed figure means something only with R̂ ≤ 1.01 beside it.
With ``--numpyro`` (the ``numpyro`` extra) the same posterior also runs in NumPyro's NUTS
on the full data, in this process after the others, timed the same way
(:mod:`flymc_dist.bench.numpyro_nuts`).

Problems:

* ``qm9``: robust (Student-t, ν = 4, scale 0.5) regression of the standardised QM9
  HOMO–LUMO gap on 56 standardised RDKit descriptors + bias, Laplace(0, 1) prior, all
  130,831 rows, duplicated columns kept (their weights' difference is a ridge that only
  the prior bounds) — needs the shipped data sets (``$FLYMC_DATA_DIR``);
* ``mnist``: logistic regression, MNIST 7 vs 9 (12,214 rows, 50 principal components +
  bias), Normal(0, 1) prior — the FlyMC paper's Table 1 problem;
* ``flights``: robust (Student-t, ν = 4, scale 15 minutes) regression of the arrival
  delay of 3M US flights on 57 calendar and route features (one-hot hours, days,
  months, airports), Laplace(0, 10) prior, float32 store — three of its hours (2, 3 and
  4 am) are carried by 241-931 flights each: FlyMC's exact rows;
* ``logistic``: synthetic logistic regression, ``rows`` × ``features`` (the bias
  included), Normal(0, 1) prior;
* ``probit`` and ``negative_binomial``: the GLM families (``fd.GLM("binomial",
  link="probit")``; ``fd.GLM("negative_binomial", dispersion=2)``) on synthetic data of
  that family (:func:`~flymc_dist.data.make_glm`), ``rows`` × ``features``, Normal(0, 1)
  prior.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import tempfile
import time
from typing import Any

import numpy as np

import flymc_dist as fd
from flymc_dist.bench.common import reusable_store
from flymc_dist.bench.numpyro_nuts import import_numpyro, run_numpyro
from flymc_dist.data import make_glm, make_logistic
from flymc_dist.data.generate import GLM_GENERATORS
from flymc_dist.data.real import flights_to_zarr, mnist_7_vs_9, qm9_gap
from flymc_dist.kernels import get_kernel
from flymc_dist.result import narrowing_line
from flymc_dist.transport.dask import local_client

PROBLEMS = ("qm9", "mnist", "flights", "logistic", "probit", "negative_binomial")
#: shape of the ``flights`` problem's store (what a reused store must have)
_FLIGHTS_ROWS, _FLIGHTS_FEATURES = 3_000_000, 57
#: the rows of the table, in order
SAMPLERS = ("flymc", "regular", "numpyro")


def _problem(problem: str, rows: int, features: int, seed: int, workdir: str) -> tuple[Any, Any]:
    """The model and a zarr store of the data (what every worker reads). A store that an
    earlier run left in ``workdir`` is reused when it holds these data (its shape, and for
    ``logistic`` the generator's seed: :func:`reusable_store`); a foreign store under its
    name is left alone, and writing then fails with the store's "already exists" error."""
    if problem == "qm9":
        model = fd.RobustRegression(nu=4.0, scale=0.5, prior="laplace", prior_scale=1.0)
        load = qm9_gap
    elif problem == "mnist":
        model = fd.LogisticRegression(prior="normal", prior_scale=1.0)
        load = mnist_7_vs_9
    elif problem == "logistic":
        model = fd.LogisticRegression(prior="normal", prior_scale=1.0)
        path = os.path.join(workdir, f"logistic_{rows}x{features}_seed{seed}.zarr")
        ds = reusable_store(path, rows, features, generator="make_logistic", seed=seed)
        if ds is None:
            ds = make_logistic(path, n_rows=rows, n_features=features, seed=seed)
        return model, ds
    elif problem in GLM_GENERATORS:
        model = (
            fd.GLM("binomial", link="probit", prior="normal", prior_scale=1.0)
            if problem == "probit"
            else fd.GLM("negative_binomial", dispersion=2.0, prior="normal", prior_scale=1.0)
        )
        path = os.path.join(workdir, f"{problem}_{rows}x{features}_seed{seed}.zarr")
        ds = reusable_store(path, rows, features, generator="make_glm", seed=seed)
        if ds is None:
            ds = make_glm(path, rows, features, family=problem, seed=seed, overwrite=True)
        return model, ds
    elif problem == "flights":
        model = fd.RobustRegression(nu=4.0, scale=15.0, prior="laplace", prior_scale=10.0)
        path = os.path.join(workdir, "flights.zarr")
        n = _FLIGHTS_ROWS
        ds = reusable_store(path, n, _FLIGHTS_FEATURES)
        return model, ds if ds is not None else flights_to_zarr(path, dtype="float32")
    else:
        raise ValueError(f"problem must be one of {PROBLEMS}, not {problem!r}")
    X, y = load()
    path = os.path.join(workdir, f"{problem}.zarr")
    ds = reusable_store(path, X.shape[0], X.shape[1])
    return model, ds if ds is not None else fd.from_numpy(X, y, path)


def _figures(res: Any, wall: float) -> dict[str, Any]:
    """Convergence and cost figures of one run (``wall``: its whole run's seconds)."""
    eff = res.efficiency()
    iters = res.samples.shape[1] + int(res.info["num_warmup"])
    return {
        "wall_seconds": wall,
        "setup_seconds": float(res.info["setup_seconds"]),
        "warmup_seconds": float(res.info["warmup_seconds"]),
        "sampling_seconds": float(res.info["sampling_seconds"]),
        "draws": int(res.samples.shape[1]),
        "warmup": int(res.info["num_warmup"]),
        "chains": int(res.samples.shape[0]),
        "ess_min": eff["ess_min"],
        "ess_median": eff["ess_median"],
        "r_hat_max": eff["r_hat_max"],
        "converged": bool(eff["r_hat_max"] <= 1.01),
        "min_ess_per_second": eff["ess_min"] / wall if wall > 0 else math.nan,
        "seconds_per_iteration": (
            float(res.info["warmup_seconds"]) + float(res.info["sampling_seconds"])
        )
        / iters,
        "round_trips_per_iteration": eff["round_trips_per_iteration"],
        "queries_per_iteration": eff["queries_per_iteration"],
        "queries_total": float(
            res.stats["likelihood_queries"].sum()
            + res.warmup_stats["likelihood_queries"].sum()
            + res.info["setup_queries"]
        ),
        "bright_rows_per_chain": float(res.stats["n_bright"].mean()),
        "bright_replica": bool(res.info.get("bright_replica", False)),
        "n_rows": int(res.info["n_rows"]),
        "kernel": res.info["kernel_repr"],
        "q_db": res.info.get("q_db"),
        "exact_rows": res.info.get("exact_rows"),
        "ess_min_per_draw": eff["ess_min_per_draw"],
        "conditional_narrowing": res.info.get("conditional_narrowing"),
        "gibbs_ess_per_draw": res.info.get("gibbs_ess_per_draw"),
    }


def run_mixing(
    problem: str = "qm9",
    kernel: str = "nuts",
    chains: int = 4,
    num_warmup: int = 500,
    num_samples: int = 1000,
    regular_warmup: int = 300,
    regular_samples: int = 300,
    rows: int = 2_000_000,
    features: int = 57,
    workers: int = 2,
    client: str | None = "synchronous",
    seed: int = 0,
    regular: bool = True,
    workdir: str | None = None,
    precondition: str = "laplace",
    adapt_metric: bool = True,
    max_tree_depth: int | None = None,
    q_db: float | None = None,
    exact_rows: bool = True,
    numpyro: bool = False,
    numpyro_warmup: int = 300,
    numpyro_samples: int = 300,
) -> dict[str, Any]:
    """Run FlyMC and regular MCMC with one kernel on one problem and compare them.

    Parameters
    ----------
    problem
        ``"qm9"``, ``"mnist"``, ``"flights"``, ``"logistic"``, ``"probit"`` or
        ``"negative_binomial"`` (see the module
        docstring).
    kernel
        The θ-kernel of both samplers (``"nuts"`` by default).
    chains
        Chains of each run.
    num_warmup
        FlyMC's warm-up draws per chain.
    num_samples
        FlyMC's kept draws per chain.
    regular_warmup
        Regular MCMC's warm-up draws per chain (each of its gradients is a full pass over
        the data). With 0 it starts, like every run, at the MAP jittered by the Laplace
        covariance (near a posterior draw), with that covariance as its metric and FlyMC's
        adapted step size: the cheap way to time it on data too large for its warm-up.
    regular_samples
        Regular MCMC's kept draws per chain.
    rows
        Rows of the ``logistic`` problem.
    features
        Columns of the ``logistic`` problem, the bias included.
    workers
        Worker processes of the LocalCluster when ``client`` is None.
    client
        ``"synchronous"`` (in this process, the default), None (a LocalCluster of
        ``workers`` started first and not timed), or a scheduler address.
    seed
        Seeds both runs.
    regular
        Also run regular MCMC (the ratios need it).
    workdir
        Where the zarr store is written, and reused by a later run with the same data
        (default: a temporary directory, removed after).
    precondition
        FlyMC's preconditioner: ``"laplace"`` (default) or ``"bound"`` (the Gaussian of
        θ given that every datum is dark); regular MCMC's is always ``"laplace"``.
    adapt_metric
        HMC/NUTS in FlyMC: estimate the metric from the warm-up draws (default), or keep
        the preconditioner's (``--no-adapt-metric``).
    max_tree_depth
        NUTS's tree depth limit in both runs (default: the kernel's, 10). FlyMC's θ-step
        is one block of a Gibbs sampler whose coupling to z limits its mixing: on
        MNIST 7 vs 9 (1,000 + 10,000 draws), 3 gave 0.72 times the min ESS of 10 for 0.63
        times the likelihood queries, 2 gave 0.50 times for 0.45.
    q_db
        FlyMC's dark→bright proposal probability (default: ``"auto"``). On ``qm9`` one
        weight is decided by one row, which "auto" proposes once in ~4,000 iterations
        when it is not an exact row (``--no-exact-rows``): 0.01 converges it then (see
        :func:`flymc_dist.sample`).
    exact_rows
        FlyMC's ``exact_rows="auto"`` (default; ``--no-exact-rows``: None): the rows that
        carry a column few rows carry are evaluated at every step (see
        :func:`flymc_dist.sample`).
    numpyro
        Also run the same posterior in NumPyro's NUTS on the full data, in this process,
        after the others (needs the ``numpyro`` extra; see
        :mod:`flymc_dist.bench.numpyro_nuts`).
    numpyro_warmup, numpyro_samples
        NumPyro's warm-up and kept draws per chain.

    Returns
    -------
    dict
        ``setup`` (how it ran), ``flymc`` and ``regular`` figures, and ``ratios``.
    """
    if problem not in PROBLEMS:
        raise ValueError(f"problem must be one of {PROBLEMS}, not {problem!r}")
    if precondition not in ("laplace", "bound"):
        raise ValueError(f"precondition must be 'laplace' or 'bound', not {precondition!r}")
    if numpyro:  # before anything runs: a missing extra is said at once
        if kernel != "nuts":
            raise ValueError(f"numpyro=True compares NUTS with NUTS, not with {kernel!r}")
        import_numpyro()
    fly: dict[str, Any] = {"bounds": "map"}
    if q_db is not None:
        fly["q_db"] = float(q_db)
    if not exact_rows:
        fly["exact_rows"] = None
    shared_kernel: dict[str, Any] = {}  # kernel options of both runs
    if max_tree_depth is not None:
        if kernel != "nuts":
            raise ValueError(f"max_tree_depth is an option of NUTS, not of {kernel!r}")
        shared_kernel["max_tree_depth"] = int(max_tree_depth)
    fly_kernel = get_kernel(
        kernel, **shared_kernel, **({} if adapt_metric else {"adapt_metric": False})
    )
    own_dir = workdir is None
    workdir = tempfile.mkdtemp(prefix="flymc-mixing-") if own_dir else workdir
    cluster = None
    try:
        t0 = time.perf_counter()
        model, ds = _problem(problem, rows, features, seed, workdir)
        ingest = time.perf_counter() - t0
        if client is None:
            client, cluster = local_client(workers)
        common = dict(chains=chains, seed=seed, client=client, progress=False)
        out: dict[str, Any] = {
            "setup": {
                "problem": problem,
                "kernel": kernel,
                "chains": chains,
                "n_rows": ds.n_rows,
                "n_features": ds.n_features,
                "ingest_seconds": ingest,
                "client": client if isinstance(client, str) else f"LocalCluster({workers})",
                "cores": os.cpu_count(),
                "machine": platform.processor() or platform.machine(),
                "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
                "precondition": precondition,
                "adapt_metric": bool(adapt_metric),
                "max_tree_depth": max_tree_depth,
                "q_db": q_db,
                "exact_rows": bool(exact_rows),
                "loadavg_before": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            }
        }
        t0 = time.perf_counter()
        res = fd.sample(
            model,
            ds,
            fd.FlyMC(**fly),
            fly_kernel,
            num_warmup=num_warmup,
            num_samples=num_samples,
            precondition=precondition,
            **common,
        )
        out["flymc"] = _figures(res, time.perf_counter() - t0)
        if regular:
            if regular_warmup == 0:
                steps = [p["step_size"] for p in res.info["kernel_params"]]
                shared_kernel["step_size"] = float(np.mean(steps))
            t0 = time.perf_counter()
            res = fd.sample(
                model,
                ds,
                fd.Regular(),
                get_kernel(kernel, **shared_kernel),
                num_warmup=regular_warmup,
                num_samples=regular_samples,
                **common,
            )
            out["regular"] = _figures(res, time.perf_counter() - t0)
            f, r = out["flymc"], out["regular"]
            out["ratios"] = {
                "min_ess_per_second": f["min_ess_per_second"] / r["min_ess_per_second"],
                "seconds_per_iteration": r["seconds_per_iteration"] / f["seconds_per_iteration"],
                "queries_per_iteration": r["queries_per_iteration"] / f["queries_per_iteration"],
                "ess_per_query": (
                    (f["ess_min"] / f["queries_total"]) / (r["ess_min"] / r["queries_total"])
                ),
            }
        if numpyro:
            X, y = ds.read()
            out["numpyro"] = run_numpyro(model, X, y, chains, numpyro_warmup, numpyro_samples, seed)
            del X, y
            f, r = out["flymc"], out["numpyro"]
            out["ratios_numpyro"] = {
                "min_ess_per_second": f["min_ess_per_second"] / r["min_ess_per_second"],
                "ess_per_query": (
                    (f["ess_min"] / f["queries_total"]) / (r["ess_min"] / r["queries_total"])
                ),
            }
        out["setup"]["loadavg_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        return out
    finally:
        if cluster is not None:
            client.close()
            cluster.close()
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def format_mixing(d: dict[str, Any]) -> str:
    """The figures of :func:`run_mixing` as a table."""
    s = d["setup"]
    lines = [
        f"flymc bench mixing: {s['problem']} ({s['n_rows']:,} rows x {s['n_features']} "
        f"features), {s['kernel']}, {s['chains']} chains, client {s['client']}; "
        f"{s['cores']} cores, load {s['loadavg_before']} -> {s['loadavg_after']}; FlyMC "
        f"preconditioner {s.get('precondition', 'laplace')}"
        + ("" if s.get("adapt_metric", True) else " (metric kept through warm-up)")
        + ("" if s.get("max_tree_depth") is None else f"; max tree depth {s['max_tree_depth']}")
        + ("" if s.get("q_db") is None else f"; FlyMC q_db {s['q_db']}")
        + ("" if s.get("exact_rows", True) else "; FlyMC without exact rows"),
        "whole run = set-up (MAP, bounds, first z) + warm-up + sampling; "
        "ESS: bulk, min and median over parameters",
    ]
    head = (
        f"{'sampler':<8}{'draws':>11}{'whole s':>9}{'setup s':>9}{'ms/it':>9}"
        f"{'min ESS':>9}{'med ESS':>9}{'R-hat max':>10}{'minESS/s':>10}{'rt/it':>7}"
        f"{'queries/it':>12}{'bright/chain':>13}{'exact':>7}"
    )
    lines.append(head)
    for name in SAMPLERS:
        f = d.get(name)
        if f is None:
            continue
        trips = f["round_trips_per_iteration"]
        lines.append(
            f"{name:<8}{f['warmup']:>5}+{f['draws']:<5}{f['wall_seconds']:>9.1f}"
            f"{f['setup_seconds']:>9.1f}{1000 * f['seconds_per_iteration']:>9.2f}"
            f"{f['ess_min']:>9.0f}{f['ess_median']:>9.0f}{f['r_hat_max']:>10.3f}"
            f"{f['min_ess_per_second']:>10.2f}"
            + (f"{trips:>7.1f}" if math.isfinite(trips) else f"{'-':>7}")
            + f"{f['queries_per_iteration']:>12.4g}{f['bright_rows_per_chain']:>13.1f}"
            + f"{'-' if f.get('exact_rows') is None else f['exact_rows']:>7}"
        )
    line = narrowing_line(d.get("flymc", {}), d.get("flymc", {}).get("ess_min_per_draw"))
    if line is not None:
        lines.append(line)
    r = d.get("ratios")
    if r:
        lines.append(
            f"FlyMC / regular: min-ESS per second of the whole run "
            f"{r['min_ess_per_second']:.1f}x, per iteration "
            f"{r['seconds_per_iteration']:.1f}x faster, "
            f"{r['queries_per_iteration']:.0f}x fewer queries per iteration, "
            f"min-ESS per query {r['ess_per_query']:,.1f}x"
        )
    r = d.get("ratios_numpyro")
    if r:
        lines.append(
            f"FlyMC / NumPyro NUTS (full data, dense metric, float64, compiling included): "
            f"min-ESS per second of the whole run {r['min_ess_per_second']:.1f}x, "
            f"min-ESS per query {r['ess_per_query']:,.1f}x"
        )
    bad = [n for n in SAMPLERS if n in d and not d[n]["converged"]]
    if bad:
        lines.append(
            f"NOT CONVERGED (R-hat > 1.01): {', '.join(bad)} - its speed figures "
            "are not to be trusted"
        )
    return "\n".join(lines)
