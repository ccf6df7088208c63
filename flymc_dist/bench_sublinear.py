"""``flymc bench sublinear``: austerity MH's data use against N, and its bias against eps.

Two measurements (Chen, Mansinghka & Ghahramani 2016, Fig. 5; Korattikara et al. 2014):

1. **Data used per decision vs N.** Logistic data sets of growing N from one generating
   θ₀; a *fixed* proposal ``θ₀ → θ₀ + distance · v`` (``v`` a fixed unit vector), decided
   ``n_decisions`` times (fresh ``u`` and fresh minibatches each); the mean number of rows
   a decision used, and the least-squares slope of log(rows used) on log N. With a fixed
   move the evidence per row does not shrink with N, so the rows needed level off and the
   slope tends to 0; it is the transition from "all rows" at small N that gives a positive
   slope. (A proposal scaled to the posterior, ∝ 1/√N, would use a roughly constant
   *fraction* instead — the well-known limit of austerity MH; see the report's notes.)
2. **Bias vs eps** on one ``bias_rows``-row problem: the posterior mean of austerity
   chains at each eps against exact regular MH (``fd.sample(algorithm="regular")``), in
   posterior sd and with the Monte Carlo standard error of the difference; and the
   per-decision error rate (decisions that differ from the exact MH decision for the
   same θ, θ′, u) on moves drawn like a tuned RWMH chain's from the exact posterior —
   precise where the posterior-mean bias is lost in Monte Carlo noise.

Everything here is approximate-algorithm output and is labelled so.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from flymc_dist import diagnostics
from flymc_dist.austerity import loglog_slope, run_decisions
from flymc_dist.kernels.rwmh import tril_matvec
from flymc_dist.models.logistic import LogisticRegression
from flymc_dist.shard import ROLE_AUSTERITY, stream

__all__ = ["format", "format_sublinear", "logistic_data", "run_sublinear"]

#: sub-role of the benchmark's own random streams (data, u, moves)
_BENCH = 7


def logistic_data(n_rows: int, n_features: int, seed: int) -> tuple[np.ndarray, np.ndarray,
                                                                    np.ndarray]:
    """In-memory logistic data: ``x = (1, z)``, ``z ~ N(0, I)``, ``y ~ Bernoulli(σ(θ₀ᵀx))``.

    θ₀ depends on ``(seed, n_features)`` only (the same for every N): bias 0.3, the other
    weights a fixed direction of length 1.2.

    Returns
    -------
    X, y, theta0
        ``(N, D)`` floats, ``(N,)`` int8 labels, ``(D,)`` generating parameters.
    """
    prng = stream(seed, ROLE_AUSTERITY, _BENCH, 0, n_features)
    w = prng.standard_normal(n_features - 1)
    if w.size:
        w *= 1.2 / float(np.linalg.norm(w))
    theta0 = np.concatenate([[0.3], w])
    rng = stream(seed, ROLE_AUSTERITY, _BENCH, 1, n_rows, n_features)
    X = np.empty((n_rows, n_features))
    X[:, 0] = 1.0
    X[:, 1:] = rng.standard_normal((n_rows, n_features - 1))
    p = 1.0 / (1.0 + np.exp(-(X @ theta0)))
    y = (rng.random(n_rows) < p).astype(np.int8)
    return X, y, theta0


def _dataset(n_rows: int, n_features: int, seed: int, client: Any, tmp: str | None) -> Any:
    """``(X, y)`` in memory for the synchronous client, else a zarr store."""
    X, y, theta0 = logistic_data(n_rows, n_features, seed)
    if isinstance(client, str) and client == "synchronous":
        return (X, y), theta0
    from flymc_dist.data import from_numpy

    if tmp is None:
        raise ValueError("a cluster client needs a directory for the data stores")
    return from_numpy(X, y, f"{tmp}/logistic_{n_rows}.zarr", overwrite=True), theta0


def run_sublinear(ns: Sequence[int] = (10**4, 10**5, 10**6), eps: float = 0.05,
                  batch_size: int = 500, seed: int = 0, client: Any = "synchronous", *,
                  n_features: int = 3, distance: float = 0.2, n_decisions: int = 100,
                  n_shards: int = 4, bias_eps: Sequence[float] | None = (0.2, 0.1, 0.05, 0.01),
                  bias_rows: int = 10_000, bias_chains: int = 8, bias_warmup: int = 150,
                  bias_samples: int = 450, bias_batch_size: int = 2000, bias_shards: int = 2,
                  error_moves: int = 400, workdir: str | None = None) -> dict[str, Any]:
    """Data used per austerity decision against N, and bias against eps.

    Parameters
    ----------
    ns
        Data set sizes (at least two, ideally spanning two decades or more).
    eps, batch_size
        Test tolerance and rows per round for the data-use measurement.
    seed
        Seeds data, ``u`` draws, minibatches and chains.
    client
        ``"synchronous"`` (in-memory data) or anything :func:`flymc_dist.sample` takes:
        ``None`` starts one embedded LocalCluster for the whole benchmark; data are then
        written to zarr stores under ``workdir`` or a temporary directory.
    n_features
        D, including the bias column.
    distance
        Length of the fixed move ``θ₀ → θ₀ + distance · v``, ``v = (1, …, 1)/√D``.
    n_decisions
        Decisions averaged per N.
    n_shards
        Shards per data set.
    bias_eps
        Tolerances of the bias table (None or empty: skip the bias part).
    bias_rows, bias_chains, bias_warmup, bias_samples, bias_batch_size, bias_shards
        The bias problem's size, the chains run on it (exact and austerity alike), the
        austerity batch size and the shard count there.
    error_moves
        Moves scored for the per-decision error rate.
    workdir
        Where to write zarr stores for a cluster client.

    Returns
    -------
    dict
        ``"sublinear"``: ``ns``, ``mean_data_used``, ``fraction``, ``mean_rounds``,
        ``error_rate``, ``slope``, settings; ``"bias"``: ``rows`` (one dict per eps) and
        the exact reference; ``"seconds"``; ``"approximate": True``.
    """
    ns = [int(n) for n in ns]
    if len(ns) < 2:
        raise ValueError("ns needs at least two sizes to fit a slope")
    t0 = time.perf_counter()
    model = LogisticRegression()
    v = np.ones(n_features) / math.sqrt(n_features)
    local = isinstance(client, str) and client == "synchronous"
    tmpdir = None if local or workdir is not None else tempfile.TemporaryDirectory()
    tmp = workdir if workdir is not None else (tmpdir.name if tmpdir is not None else None)
    cluster, owned = None, False
    if not local:  # one client (and embedded cluster, for None) for the whole benchmark
        from flymc_dist.cluster import _client_from

        client, cluster, owned = _client_from(client, None)
    try:
        used, frac, rounds, errs, secs = [], [], [], [], []
        log_u = -stream(seed, ROLE_AUSTERITY, _BENCH, 2).standard_exponential(n_decisions)
        for n in ns:
            t = time.perf_counter()
            data, theta0 = _dataset(n, n_features, seed, client, tmp)
            r = run_decisions(model, data, theta0, theta0 + distance * v, log_u, eps=eps,
                              batch_size=batch_size, seed=seed, n_shards=n_shards,
                              client=client)
            row = r["by_eps"][0]
            used.append(row["mean_data_used"])
            frac.append(row["fraction"])
            rounds.append(float(row["rounds"].mean()))
            errs.append(row["error_rate"])
            secs.append(time.perf_counter() - t)
            del data
        sub = {"ns": ns, "mean_data_used": used, "fraction": frac, "mean_rounds": rounds,
               "error_rate": errs, "seconds": secs, "slope": loglog_slope(ns, used),
               "eps": float(eps), "batch_size": int(batch_size), "distance": float(distance),
               "n_decisions": int(n_decisions), "n_features": int(n_features),
               "n_shards": int(n_shards)}
        bias = None
        if bias_eps:
            bias = _bias_vs_eps(model, list(bias_eps), bias_rows, n_features, seed, client, tmp,
                                chains=bias_chains, warmup=bias_warmup, samples=bias_samples,
                                batch_size=bias_batch_size, n_shards=bias_shards,
                                error_moves=error_moves)
    finally:
        if owned:
            client.close()
            if cluster is not None:
                cluster.close()
        if tmpdir is not None:
            tmpdir.cleanup()
    return {"approximate": True, "sublinear": sub, "bias": bias,
            "seconds": time.perf_counter() - t0}


def _bias_vs_eps(model: LogisticRegression, eps_list: list[float], n_rows: int, n_features: int,
                 seed: int, client: Any, tmp: str | None, *, chains: int, warmup: int,
                 samples: int, batch_size: int, n_shards: int,
                 error_moves: int) -> dict[str, Any]:
    """Posterior-mean error and per-decision error rate of austerity MH at each eps."""
    from flymc_dist.api import sample

    data, _ = _dataset(n_rows, n_features, seed, client, tmp)
    common = {"num_warmup": warmup, "num_samples": samples, "chains": chains, "seed": seed,
              "client": client, "n_shards": n_shards}
    t = time.perf_counter()
    ref = sample(model, data, algorithm="regular", **common)
    ref_secs = time.perf_counter() - t
    flat = ref.samples.reshape(chains, samples, -1)
    ref_mean = flat.mean(axis=(0, 1))
    ref_sd = flat.std(axis=(0, 1), ddof=1)
    ref_mcse = np.asarray(diagnostics.mcse_mean(flat))
    # moves like a tuned RWMH chain's: from exact draws, with the exact run's adapted step
    kp = ref.info["kernel_params"][0]
    step, tril = float(kp["step_size"]), np.asarray(kp["scale_tril"], float)
    mrng = stream(seed, ROLE_AUSTERITY, _BENCH, 3)
    pool = flat.reshape(-1, flat.shape[-1])
    thetas = pool[mrng.integers(0, pool.shape[0], size=error_moves)]
    props = np.stack([th + step * tril_matvec(tril, mrng.standard_normal(th.size))
                      for th in thetas])
    log_u = -mrng.standard_exponential(error_moves)
    dec = run_decisions(model, data, thetas, props, log_u, eps=eps_list,
                        batch_size=batch_size, seed=seed, n_shards=n_shards, client=client)
    rows = []
    for e, d in zip(eps_list, dec["by_eps"], strict=True):
        t = time.perf_counter()
        res = sample(model, data, algorithm="austerity", eps=e, batch_size=batch_size, **common)
        secs = time.perf_counter() - t
        af = res.samples.reshape(chains, samples, -1)
        a_mean = af.mean(axis=(0, 1))
        a_mcse = np.asarray(diagnostics.mcse_mean(af))
        se = np.sqrt(a_mcse ** 2 + ref_mcse ** 2)
        z = (a_mean - ref_mean) / ref_sd
        rows.append({
            "eps": e,
            "mean_error_sd": float(np.max(np.abs(z))),  # max over parameters, in posterior sd
            "mean_error_by_param": z.tolist(),
            "mc_se_sd": float(np.max(se / ref_sd)),  # MC standard error of that difference
            "sd_ratio": (af.std(axis=(0, 1), ddof=1) / ref_sd).tolist(),
            "data_used_fraction": float(res.info["data_used_fraction"]),
            "exact_fraction": float(res.info["exact_fraction"]),
            "acceptance": float(res.stats["accepted"].mean()),
            "round_trips_per_iteration": float(res.stats["round_trips"].mean()),
            "decision_error_rate": float(d["error_rate"]),
            "decision_data_fraction": float(d["fraction"]),
            "seconds": secs,
        })
    return {"n_rows": n_rows, "chains": chains, "num_warmup": warmup, "num_samples": samples,
            "batch_size": batch_size, "exact_mean": ref_mean.tolist(),
            "exact_sd": ref_sd.tolist(), "exact_acceptance": float(ref.stats["accepted"].mean()),
            "exact_seconds": ref_secs, "error_moves": error_moves, "rows": rows}


def format_sublinear(result: dict[str, Any]) -> str:
    """The report of :func:`run_sublinear` as text."""
    s = result["sublinear"]
    lines = [
        "APPROXIMATE (austerity MH): sequential-test decisions, not exact MH.",
        f"Data used per decision vs N  (logistic, D={s['n_features']}, fixed move of length "
        f"{s['distance']:g}, eps={s['eps']:g}, batch={s['batch_size']}, "
        f"{s['n_decisions']} decisions, {s['n_shards']} shards)",
        f"{'N':>12} {'rows used':>12} {'fraction':>10} {'rounds':>8} {'err rate':>9} "
        f"{'secs':>7}",
    ]
    for i, n in enumerate(s["ns"]):
        lines.append(f"{n:>12,d} {s['mean_data_used'][i]:>12.1f} {s['fraction'][i]:>10.4f} "
                     f"{s['mean_rounds'][i]:>8.2f} {s['error_rate'][i]:>9.3f} "
                     f"{s['seconds'][i]:>7.1f}")
    lines.append(f"log-log slope of rows used on N: {s['slope']:.3f}")
    b = result.get("bias")
    if b:
        lines += [
            "",
            f"Bias vs eps  ({b['n_rows']:,d} rows; {b['chains']} chains x {b['num_samples']} "
            f"draws after {b['num_warmup']} warm-up; batch={b['batch_size']}; reference: "
            f"exact regular MH)",
            f"{'eps':>6} {'|dmean|/sd':>11} {'MC se/sd':>9} {'sd ratio':>9} {'data frac':>10} "
            f"{'exact':>6} {'accept':>7} {'RT/iter':>8} {'dec err':>8} {'secs':>6}",
        ]
        for r in b["rows"]:
            lines.append(
                f"{r['eps']:>6g} {r['mean_error_sd']:>11.3f} {r['mc_se_sd']:>9.3f} "
                f"{min(r['sd_ratio']):>4.2f}-{max(r['sd_ratio']):<4.2f} "
                f"{r['data_used_fraction']:>10.3f} {r['exact_fraction']:>6.2f} "
                f"{r['acceptance']:>7.3f} {r['round_trips_per_iteration']:>8.2f} "
                f"{r['decision_error_rate']:>8.4f} {r['seconds']:>6.1f}")
        lines.append(f"(|dmean|/sd: largest over parameters; 'dec err': share of "
                     f"{b['error_moves']} RWMH-like moves decided differently from exact MH)")
    lines.append(f"total {result['seconds']:.1f} s")
    return "\n".join(lines)


#: the name the CLI uses
format = format_sublinear  # noqa: A001 - module-level API name chosen by the CLI
