"""Robust (Student-t) regression at the FlyMC paper's OPV scale, out of core on a LocalCluster.

The paper's third experiment regresses the HOMO-LUMO gap of 1.8M molecules on 57
features with a Student-t likelihood (nu = 4), a Laplace prior and slice sampling.
That data set is not public; this example uses either

* ``--data opv``: a synthetic float32 store in the OPV shape (1.8M x 57, correlated
  features, Student-t noise), written chunk by chunk, or
* ``--data flights``: 3M US flights (arrival delay on 57 calendar/route features), from
  ``flights_3m.npz`` in ``$FLYMC_DATA_DIR`` (or ``../shared/data``), ingested to a
  float32 store,

both in a temporary directory. The LocalCluster's workers get a memory limit
(``--worker-memory``) below the in-memory size of their shards — rows × (features + 5)
× 8 bytes / workers: the float64 features, the model's row constants, the target and
the tight point — so with ``out_of_core="auto"`` every shard streams its rows once into
a row file in its worker's local directory and reads from it only the rows each
z-update proposes (everything else at its default: one shard per worker, Dask's memory
thresholds as they are). It runs MAP-tuned FlyMC (NUTS; the paper's
slice sampler with ``--kernel slice``) beside a short regular-MCMC run (whose every
likelihood evaluation is then a full pass over the row files), on the same shards and
cluster, and reports whether each shard was out of core, each worker's peak RSS
(measured in the worker), seconds per iteration, R-hat, min ESS and ESS per query.

Run: ``python examples/opv_scale.py --data opv --samples 1000 --workers 2``
(a quick check: ``--rows 200000 --samples 200 --warmup 100 --regular-samples 10``; at so
few rows the default memory limit cannot be below the shards' size — a worker needs
some 420 MB to itself — so add ``--out-of-core true``).

The workers' memory limit is the one Dask enforces (pausing a worker at 80 % of it,
restarting it at 95 %). The peak RSS printed is each worker's own, measured in the
worker. ``--out-of-core false`` with ``--worker-memory`` above the shards' size runs the
same sampler in memory, for comparison.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import flymc_dist as fd
from flymc_dist.bench.scale import peak_rss, reset_peak_rss
from flymc_dist.data import make_opv_like
from flymc_dist.transport.dask import local_client

#: the least memory limit given to a worker by default: its own footprint (Python, Dask,
#: NumPy, numba compiling its kernels) is some 150-250 MB, and an out-of-core shard's
#: full passes add a block of rows at a time
MIN_WORKER_MEMORY = 420 * 10**6


def shard_bytes(rows: int, features: int, workers: int) -> int:
    """The in-memory size of one worker's shard: rows × (features + 5) × 8 / workers."""
    return rows * (features + 5) * 8 // workers


def _out_of_core(text: str) -> str | bool:
    v = text.strip().lower()
    if v == "auto":
        return "auto"
    if v in ("true", "false"):
        return v == "true"
    raise argparse.ArgumentTypeError(f"--out-of-core takes auto, true or false, not {text!r}")


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.0f} MB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", choices=("opv", "flights"), default="opv")
    p.add_argument("--rows", type=int, default=None, help="rows (default: all)")
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--regular-samples", type=int, default=100)
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kernel", default="nuts")
    p.add_argument(
        "--worker-memory",
        type=int,
        default=None,
        help="each worker's memory limit in bytes (default: half its shard's in-memory "
        f"size, rows x (features + 5) x 8 / workers, but at least {MIN_WORKER_MEMORY:,})",
    )
    p.add_argument(
        "--out-of-core",
        type=_out_of_core,
        default="auto",
        help="auto (default: out of core when a shard exceeds its budget, half its "
        "worker's memory limit), true or false",
    )
    p.add_argument(
        "--chunk-rows",
        type=int,
        default=8192,
        help="rows per store chunk (default 8192: ~1.9 MB of float32 features)",
    )
    args = p.parse_args()
    for name in ("samples", "regular_samples"):  # ESS needs at least 4 draws per chain
        if getattr(args, name) < 4:
            p.error(f"--{name.replace('_', '-')} must be at least 4 (ESS needs 4 draws per chain)")

    tmp = Path(tempfile.mkdtemp(prefix="flymc-opv-"))
    try:
        t0 = time.perf_counter()
        store = str(tmp / "data.zarr")
        if args.data == "opv":
            ds = make_opv_like(
                store,
                n_rows=args.rows or 1_800_000,
                n_features=57,
                chunk_rows=args.chunk_rows,
                dtype="float32",
            )
            scale = 1.0
        else:
            from flymc_dist.data.real import flights_to_zarr

            ds = flights_to_zarr(
                store, n_rows=args.rows, chunk_rows=args.chunk_rows, dtype="float32"
            )
            scale = 15.0  # minutes: the bulk of arrival delays
        print(f"{ds!r} written in {time.perf_counter() - t0:.1f} s")
        in_memory = shard_bytes(ds.n_rows, ds.n_features, args.workers)
        limit = args.worker_memory or max(MIN_WORKER_MEMORY, in_memory // 2)
        print(
            f"each worker's shard takes {_mb(in_memory)} in memory; worker memory limit "
            f"{_mb(limit)} ({'below' if limit < in_memory else 'NOT below'} it); "
            f"out_of_core={args.out_of_core!r}"
        )
        model = fd.RobustRegression(nu=4.0, scale=scale, prior="laplace", prior_scale=10.0)
        client, cluster = local_client(args.workers, memory_limit=limit)
        with cluster, client:
            pids = client.run(os.getpid)
            common = dict(
                kernel=args.kernel,
                chains=args.chains,
                client=client,
                seed=0,
                progress=True,
                placement=fd.Placement(out_of_core=args.out_of_core),
            )
            client.run(reset_peak_rss)
            t0 = time.perf_counter()
            fly = fd.sample(
                model,
                ds,
                fd.FlyMC(bounds="map"),
                num_warmup=args.warmup,
                num_samples=args.samples,
                **common,
            )
            t_fly = time.perf_counter() - t0
            rss_fly = client.run(peak_rss)
            client.run(reset_peak_rss)
            t0 = time.perf_counter()
            reg = fd.sample(
                model,
                ds,
                algorithm="regular",
                num_warmup=0,
                num_samples=args.regular_samples,
                init=fly.info["map"].ravel(),
                **common,
            )
            t_reg = time.perf_counter() - t0
            rss_reg = client.run(peak_rss)
            restarted = client.run(os.getpid) != pids
        print(fly.summary())
        ef, er = fly.efficiency(), reg.efficiency()
        for name, res, rss in (("FlyMC", fly, rss_fly), ("regular", reg, rss_reg)):
            print(
                f"{name}: out of core per shard {res.info['out_of_core']} (budget "
                f"{', '.join(_mb(b) for b in res.info['memory_budget'])}); peak RSS per "
                f"worker {', '.join(_mb(rss[a]) for a in sorted(rss))} (limit {_mb(limit)})"
            )
        print(
            f"FlyMC: {t_fly:.0f} s total ({fly.info['setup_seconds']:.0f} s set-up incl. MAP, "
            f"{fly.info.get('setup_bytes_read', 0) / 1e9:.2f} GB streamed); "
            f"{ef['seconds_per_iteration'] * 1e3:.1f} ms/it, "
            f"{ef['queries_per_iteration']:.0f} queries/it "
            f"({100 * ef['bright_fraction']:.4f}% bright), "
            f"{ef['round_trips_per_iteration']:.2f} round trips/it; R-hat max "
            f"{ef['r_hat_max']:.4f}, min ESS {ef['ess_min']:.0f}, ESS/query "
            f"{ef['ess_per_query']:.3g}; whole run {ef['ess_min'] / t_fly:.2f} min-ESS/s"
        )
        print(
            f"regular: {t_reg:.0f} s; {er['seconds_per_iteration'] * 1e3:.1f} ms/it, "
            f"{er['queries_per_iteration']:.0f} queries/it; R-hat max {er['r_hat_max']:.4f}, "
            f"min ESS {er['ess_min']:.0f} ({args.regular_samples} draws from the MAP)"
        )
        print(
            f"per iteration: regular / FlyMC = "
            f"{er['seconds_per_iteration'] / ef['seconds_per_iteration']:.1f}x wall, "
            f"{er['queries_per_iteration'] / ef['queries_per_iteration']:.0f}x queries"
        )
        if restarted:
            print("WARNING: a worker was restarted during the runs (memory limit exceeded?)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
