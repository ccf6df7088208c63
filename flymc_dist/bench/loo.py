"""``flymc bench loo``: PSIS-LOO by subsampling (``Result.loo``) against full PSIS-LOO on
every row, over many subsampling seeds.

Synthetic logistic regression (an intercept and ``features − 1`` standard normal columns,
fixed true coefficients), sampled by FlyMC with NUTS. Full PSIS-LOO computes every row's
log-likelihood at every draw, in blocks, Pareto-smooths each row's importance ratios
(:func:`flymc_dist.predictive.psis`) and sums the rows' elpd. ``Result.loo`` is then run
with each of ``seeds`` subsampling seeds; the figure is how many of them fall within two
of their own reported subsampling standard errors of the full sum, with the times of both.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import numpy as np
from scipy.special import expit, logsumexp

from flymc_dist.api import sample
from flymc_dist.data import from_numpy
from flymc_dist.diagnostics import ess_bulk, rhat
from flymc_dist.models.logistic import LogisticRegression
from flymc_dist.options import FlyMC
from flymc_dist.predictive import log_likelihood, psis
from flymc_dist.rng import stream

__all__ = ["format_loo", "run_loo"]


def run_loo(
    rows: int = 100_000,
    features: int = 3,
    seeds: int = 20,
    n_subsample: int = 400,
    chains: int = 4,
    warmup: int = 500,
    samples: int = 500,
    seed: int = 0,
    client: Any = "synchronous",
) -> dict[str, Any]:
    """Subsampled LOO against full PSIS-LOO.

    Parameters
    ----------
    rows
        Rows of the synthetic data.
    features
        Columns of the synthetic data, the intercept included.
    seeds
        Subsampling seeds of ``Result.loo``.
    n_subsample
        Rows of each subsample.
    chains
        Chains of the FlyMC-NUTS run.
    warmup
        Warm-up draws per chain of the FlyMC-NUTS run.
    samples
        Kept draws per chain of the FlyMC-NUTS run.
    seed
        Seed of the data and of the run.
    client
        Where the shards run (``"synchronous"``: in this process).

    Returns
    -------
    dict
        ``full`` (elpd, se, max k̂, seconds), ``estimates`` per seed (elpd, subsampling SE,
        SE, within two SEs), ``within``, the run's R̂ and min ESS, seconds.
    """
    rng = stream(seed, 41, 0)
    X = np.c_[np.ones(rows), rng.normal(size=(rows, features - 1))]
    beta = np.linspace(-0.7, 1.2, features)
    y = (rng.random(rows) < expit(X @ beta)).astype(np.int64)
    model = LogisticRegression(prior="normal", prior_scale=1.0)
    with tempfile.TemporaryDirectory(prefix="flymc-bench-loo-") as tmp:
        ds = from_numpy(X, y, os.path.join(tmp, "d.zarr"))
        t0 = time.perf_counter()
        res = sample(
            model, ds, FlyMC(), "nuts", chains=chains, num_warmup=warmup,
            num_samples=samples, seed=seed, client=client, progress=False,
        )  # fmt: skip
        run_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        S = int(np.prod(res.samples.shape[:2]))
        elpd = np.empty(rows)
        k_max = 0.0
        for s in range(0, rows, 4096):
            ll = log_likelihood(model, res.samples, X[s : s + 4096], y[s : s + 4096])
            ll = ll.reshape(S, -1)
            lw, k = psis(-ll)
            elpd[s : s + ll.shape[1]] = logsumexp(lw + ll, axis=0)
            k_max = max(k_max, float(k.max()))
        full = float(elpd.sum())
        full_se = float(np.sqrt(rows * elpd.var()))
        full_seconds = time.perf_counter() - t0
        estimates = []
        t0 = time.perf_counter()
        for s in range(seeds):
            est = res.loo(n_subsample=n_subsample, seed=s)
            estimates.append(
                {
                    "seed": s,
                    "elpd_loo": est["elpd_loo"],
                    "subsampling_se": est["subsampling_se"],
                    "se": est["se"],
                    "within": bool(abs(est["elpd_loo"] - full) < 2 * est["subsampling_se"]),
                }
            )
        loo_seconds = (time.perf_counter() - t0) / max(seeds, 1)
    return {
        "rows": rows,
        "features": features,
        "n_subsample": n_subsample,
        "full": {"elpd_loo": full, "se": full_se, "max_k": k_max, "seconds": full_seconds},
        "estimates": estimates,
        "within": sum(e["within"] for e in estimates),
        "seeds": seeds,
        "rhat_max": float(np.max(rhat(res.samples))),
        "ess_min": float(np.min(ess_bulk(res.samples))),
        "run_seconds": run_seconds,
        "loo_seconds": loo_seconds,
    }


def format_loo(d: dict[str, Any]) -> str:
    """The figures as a table."""
    f = d["full"]
    lines = [
        f"LOO on {d['rows']:,} rows x {d['features']} features (FlyMC-NUTS: R-hat max "
        f"{d['rhat_max']:.3f}, min ESS {d['ess_min']:.0f}, {d['run_seconds']:.1f} s)",
        f"full PSIS-LOO: elpd {f['elpd_loo']:.3f} (se {f['se']:.2f}, max k {f['max_k']:.2f}),"
        f" {f['seconds']:.1f} s",
        f"{'seed':>4} {'elpd_loo':>14} {'subsampling se':>15} {'se':>9} {'|diff|/sub.se':>14}",
    ]
    for e in d["estimates"]:
        z = abs(e["elpd_loo"] - f["elpd_loo"]) / max(e["subsampling_se"], 1e-300)
        lines.append(
            f"{e['seed']:>4} {e['elpd_loo']:>14.3f} {e['subsampling_se']:>15.4f} "
            f"{e['se']:>9.2f} {z:>14.2f}"
        )
    lines.append(
        f"within 2 subsampling SEs of full PSIS-LOO: {d['within']} of {d['seeds']} seeds; "
        f"{d['loo_seconds']:.2f} s per subsampled loo() ({d['n_subsample']} rows)"
    )
    return "\n".join(lines)
