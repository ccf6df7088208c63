"""The FlyMC paper's Table 1, row 1: logistic regression on MNIST 7 vs 9.

12,214 training images of 7s and 9s, projected onto their first 50 principal
components plus a bias column; Gaussian prior; random-walk MH; implicit z-updates.
Regular MCMC, untuned FlyMC and MAP-tuned FlyMC run with the same kernel, chains,
iterations and preconditioner, side by side in one process, and the speedups are
ratios measured in this one run.

Run: ``python examples/mnist_table1.py [--samples 4000] [--warmup 1000] [--chains 4]``
(reads ``../shared/data/mnist.npz``, or ``$FLYMC_DATA_DIR``).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

import flymc_dist as fd
from flymc_dist.data.real import mnist_7_vs_9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--prior-scale", type=float, default=1.0)
    p.add_argument("--q-db", default="auto", help='"auto" or a number in (0, 1]')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client", default="synchronous")
    args = p.parse_args()
    if args.q_db != "auto":
        args.q_db = float(args.q_db)

    X, y = mnist_7_vs_9()
    model = fd.LogisticRegression(prior="normal", prior_scale=args.prior_scale)
    runs = {}
    for label, algorithm in (
        ("regular", fd.Regular()),
        ("untuned FlyMC", fd.FlyMC(bounds="untuned", q_db=args.q_db)),
        ("MAP-tuned FlyMC", fd.FlyMC(bounds="map", q_db=args.q_db)),
    ):
        t0 = time.perf_counter()
        res = fd.sample(
            model,
            (X, y),
            algorithm,
            fd.RWMH(),
            num_warmup=args.warmup,
            num_samples=args.samples,
            chains=args.chains,
            seed=args.seed,
            client=args.client,
            progress=False,
        )
        eff = res.efficiency()
        eff["wall"] = time.perf_counter() - t0
        eff["rhat_max"] = float(np.nanmax(res.summary()["r_hat"]))
        eff["q_db"] = res.info["q_db"]
        runs[label] = (res, eff)

    base = runs["regular"][1]
    qs = ", ".join(f"{runs[k][1]['q_db']:.4g}" for k in ("untuned FlyMC", "MAP-tuned FlyMC"))
    print(
        f"MNIST 7 vs 9: N = {X.shape[0]}, D = {X.shape[1]}; RWMH, implicit z (q_db = "
        f"{args.q_db}: {qs}), Gaussian prior sd {args.prior_scale}; {args.chains} chains x "
        f"{args.samples} draws after {args.warmup} warm-up; client={args.client}; "
        f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}"
    )
    hdr = (
        f"{'algorithm':<18}{'queries/it':>12}{'ESS/1000 it':>13}{'accept':>8}"
        f"{'bright %':>10}{'s/it':>10}{'R-hat max':>11}{'speedup/query':>15}"
        f"{'speedup/s':>11}"
    )
    print(hdr)
    for label, (_, e) in runs.items():
        print(
            f"{label:<18}{e['queries_per_iteration']:>12.1f}{e['ess_per_1000_iterations']:>13.2f}"
            f"{e['acceptance']:>8.3f}{100 * e['bright_fraction']:>10.3f}"
            f"{e['seconds_per_iteration']:>10.5f}{e['rhat_max']:>11.3f}"
            f"{e['ess_per_query'] / base['ess_per_query']:>15.2f}"
            f"{e['ess_per_second'] / base['ess_per_second']:>11.2f}"
        )
    mr = runs["regular"][0].samples.reshape(-1, X.shape[1])
    for label in ("untuned FlyMC", "MAP-tuned FlyMC"):
        mf = runs[label][0].samples.reshape(-1, X.shape[1])
        dev = np.max(np.abs(mf.mean(0) - mr.mean(0)) / mr.std(0))
        print(f"max |mean({label}) - mean(regular)| / sd = {dev:.3f}")
    print(
        "paper (Maclaurin & Adams 2014, Table 1): queries/it 12,214 / 6,252 / 207; "
        "speedup 1 / 0.7 / 22"
    )


if __name__ == "__main__":
    main()
