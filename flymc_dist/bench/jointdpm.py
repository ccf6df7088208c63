"""``flymc bench jointdpm``: the sublinear-MH paper's Fig. 6 — JointDPM on four rotated
blobs, held-out accuracy of the chain-averaged prediction against time, exact MH on the
clusters' weights against austerity (eps = 0.3, one-sided, as the paper's).

Both runs use the same seed, data and settings (the paper's: NIW k0 = 5, v0 = D + 5, S0
= v0·I, α ~ Gamma(1, 1), w ~ N(0, I) with a bias, drift sd 0.2, minibatch 10, no test
before 3 minibatches); only ``eps`` differs. Reported per run: the accuracy curve
against each chain's own wall time, the time to reach the exact run's final accuracy
(less ``tolerance``: the mean over the chains that reach it, and how many do), the
members the weight tests read against the clusters' sizes (the paper's cost measure),
the clusters found (K's posterior mean and the largest clusters' sizes), and R̂ / bulk
ESS of K and α.

The ``tall`` part runs one chain of austerity and one of exact MH per data size (10⁴ to
10⁶ rows of the same design by default) on a LocalCluster: the members a weight decision
reads against the clusters' sizes (the log-log slope of the austerity runs'), and each
run's seconds per iteration — where austerity's saving grows with N_k.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from flymc_dist.jointdpm.data import four_blobs
from flymc_dist.jointdpm.sampler import sample_jointdpm
from flymc_dist.options import JointDPM
from flymc_dist.transport.dask import local_client

__all__ = ["format_jointdpm", "run_jointdpm"]

PARTS = ("fig6", "tall")


def _time_to(acc: np.ndarray, seconds: np.ndarray, target: float) -> np.ndarray:
    """Each chain's first time its accuracy reaches ``target`` (NaN if it never does)."""
    out = []
    for a, s in zip(acc, seconds, strict=True):
        hit = np.flatnonzero(a >= target)
        out.append(s[hit[0]] if hit.size else np.nan)
    return np.array(out)


def run_jointdpm(
    parts: Sequence[str] = ("fig6",),
    rows: int = 10000,
    test_rows: int = 1000,
    iterations: int = 300,
    warmup: int = 0,
    chains: int = 2,
    eps: float = 0.3,
    step_z: int = 50,
    init_clusters: int = 10,
    split_merge: int = 0,
    n_shards: int = 2,
    tolerance: float = 0.005,
    seed: int = 0,
    client: Any = "synchronous",
    plot: str | None = "jointdpm.png",
    tall_rows: Sequence[int] = (10_000, 100_000, 1_000_000),
    tall_iterations: int = 30,
    workers: int = 2,
) -> dict[str, Any]:
    """Exact MH and austerity on JointDPM's weights, side by side; and both's cost per
    iteration on tall data.

    Parameters
    ----------
    parts
        Any of ``fig6``, ``tall``.
    rows
        Training points of the four-blob data.
    test_rows
        Held-out points of the four-blob data.
    iterations
        Iterations kept (each: α, step_z labels, every cluster's weights).
    warmup
        Iterations run first and dropped.
    chains
        Chains per run.
    eps
        The approximate run's tolerance (one-sided, the paper's).
    step_z
        Labels Gibbs-sampled per iteration.
    init_clusters
        Clusters at the start.
    split_merge
        Split–merge proposals per iteration of the Fig. 6 runs (0: the paper's program;
        each reads every member of the clusters concerned, so the tall part leaves them
        out).
    n_shards
        Row ranges.
    tolerance
        Accuracy below the exact run's final accuracy that counts as reaching it.
    seed
        Seed of the data and of the runs.
    client
        Where the shards run ('synchronous', 'local', an address).
    plot
        A PNG of accuracy against time (None: none; skipped without matplotlib).
    tall_rows
        Data sizes of the tall part.
    tall_iterations
        Iterations (after ``warmup``) per tall run, one chain each (an austerity run
        and an exact one per size).
    workers
        Dask workers of the tall part's LocalCluster (one shard each).

    Returns
    -------
    dict
        ``fig6`` (``runs`` per eps: curves, times, data use, clusters, diagnostics;
        ``speedup``) and ``tall`` (per size: rows read per decision, mean N_k, seconds per
        iteration, the exact run's rows read and seconds per iteration, and ``speedup``,
        exact's seconds per iteration over austerity's; the slope), for the parts run.
    """
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise ValueError(f"parts must be some of {', '.join(PARTS)}, not {list(parts)}")
    out: dict[str, Any] = {}
    if "fig6" in parts:
        fig6 = (rows, test_rows, iterations, warmup, chains, eps, step_z, init_clusters)
        out["fig6"] = _fig6(*fig6, split_merge, n_shards, tolerance, seed, client, plot)
    if "tall" in parts:
        tall = (tall_rows, tall_iterations, warmup, eps, step_z, init_clusters)
        out["tall"] = _tall(*tall, workers, seed)
    return out


def _tall(
    sizes: Sequence[int],
    iterations: int,
    warmup: int,
    eps: float,
    step_z: int,
    init_clusters: int,
    workers: int,
    seed: int,
) -> dict[str, Any]:
    """Per data size, on a LocalCluster of ``workers`` workers, an austerity run and an
    exact one (``eps=0``) beside it: the same data, seed and settings."""
    runs = []
    client, cluster = local_client(workers)
    try:
        for n in sizes:
            X, y = four_blobs(int(n), seed)
            row: dict[str, Any] = {"rows": int(n)}
            for tol, key in ((eps, ""), (0.0, "exact_")):
                t0 = time.perf_counter()
                res = sample_jointdpm(
                    (X, y),
                    JointDPM(eps=tol, step_z=step_z, init_clusters=init_clusters),
                    num_warmup=warmup,
                    num_samples=iterations,
                    chains=1,
                    seed=seed,
                    client=client,
                    n_shards=workers,
                )
                wall = time.perf_counter() - t0
                d = res.draws
                K = d["K"][0].astype(float)
                sec = np.diff(d["seconds"][0], prepend=0.0)
                row[f"{key}rows_per_decision"] = float((d["data_used"][0] / K).mean())
                row[f"{key}seconds_per_iteration"] = float(np.median(sec))
                row[f"{key}wall_seconds"] = wall
                if not key:
                    row["mean_cluster_size"] = float((d["cluster_rows"][0] / K).mean())
                    row["K_mean"] = float(K.mean())
            row["speedup"] = row["exact_seconds_per_iteration"] / row["seconds_per_iteration"]
            runs.append(row)
    finally:
        client.close()
        cluster.close()
    x = np.log([r["mean_cluster_size"] for r in runs])
    z = np.log([r["rows_per_decision"] for r in runs])
    slope = float(np.polyfit(x, z, 1)[0]) if len(runs) > 1 else float("nan")
    return {"eps": eps, "workers": workers, "iterations": iterations, "runs": runs, "slope": slope}


def _fig6(
    rows: int,
    test_rows: int,
    iterations: int,
    warmup: int,
    chains: int,
    eps: float,
    step_z: int,
    init_clusters: int,
    split_merge: int,
    n_shards: int,
    tolerance: float,
    seed: int,
    client: Any,
    plot: str | None,
) -> dict[str, Any]:
    """Exact MH and austerity, side by side, on the paper's Fig. 6 data."""
    X, y = four_blobs(rows, seed)
    Xt, yt = four_blobs(test_rows, seed + 1000)
    runs = {}
    for e in (0.0, eps):
        alg = JointDPM(eps=e, step_z=step_z, init_clusters=init_clusters, split_merge=split_merge)
        t0 = time.perf_counter()
        res = sample_jointdpm(
            (X, y),
            alg,
            num_warmup=warmup,
            num_samples=iterations,
            chains=chains,
            seed=seed,
            client=client,
            n_shards=n_shards,
            test=(Xt, yt),
        )
        d = res.draws
        runs[e] = {
            "eps": e,
            "seconds": time.perf_counter() - t0,
            "accuracy": d["accuracy"],
            "chain_seconds": d["seconds"],
            "final_accuracy": float(np.mean(d["accuracy"][:, -1])),
            "data_used_per_iteration": float(d["data_used"].mean()),
            "cluster_rows_per_iteration": float(d["cluster_rows"].mean()),
            "K_mean": float(d["K"].mean()),
            "K_last": d["K"][:, -1].tolist(),
            "largest_sizes": d["sizes"][:, -1, :8].tolist(),
            "summary": res.summary(),
            "seconds_per_iteration": float(d["seconds"][:, -1].mean() / (iterations + warmup)),
            "split_merged_per_iteration": float(d["split_merged"].mean()),
        }
    exact, approx = runs[0.0], runs[eps]
    target = exact["final_accuracy"] - tolerance
    for r in runs.values():
        # the mean over the chains that reach the target, and how many do (a chain may
        # settle just below it)
        times = _time_to(r["accuracy"], r["chain_seconds"], target)
        reached = times[np.isfinite(times)]
        r["chain_time_to_target"] = times.tolist()
        r["chains_reaching"] = int(reached.size)
        r["time_to_target"] = float(reached.mean()) if reached.size else float("nan")
    out = {
        "rows": rows,
        "test_rows": test_rows,
        "iterations": iterations,
        "chains": chains,
        "step_z": step_z,
        "split_merge": split_merge,
        "target_accuracy": target,
        "runs": [exact, approx],
        "speedup": exact["time_to_target"] / approx["time_to_target"],
        "data_ratio": exact["data_used_per_iteration"] / approx["data_used_per_iteration"],
        "plot": None,
    }
    if plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return out
        fig, ax = plt.subplots(figsize=(6, 4))
        for r, colour in ((exact, "C0"), (approx, "C1")):
            label = "exact MH" if r["eps"] == 0 else f"austerity eps={r['eps']:g} (one-sided)"
            for c in range(chains):
                ax.plot(
                    r["chain_seconds"][c],
                    r["accuracy"][c],
                    color=colour,
                    alpha=0.8,
                    label=label if c == 0 else None,
                )
        ax.set_xlabel("seconds (each chain's own)")
        ax.set_ylabel("held-out accuracy of the chain average")
        ax.set_title(f"JointDPM, four blobs, {rows:,} rows")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
        plt.close(fig)
        out["plot"] = plot
    return out


def format_jointdpm(d: dict[str, Any]) -> str:
    """The benchmark's figures as text."""
    lines = []
    if "fig6" in d:
        lines.append(_format_fig6(d["fig6"]))
    if "tall" in d:
        t = d["tall"]
        lines += [
            f"JointDPM tall: eps={t['eps']:g} (one-sided), {t['workers']} workers, one chain, "
            f"{t['iterations']} iterations; beside it exact MH (eps=0) on the same data",
            f"{'rows':>10} {'K mean':>7} {'mean N_k':>10} {'read/decision':>13} {'s/iter':>8}"
            f" {'exact read':>10} {'exact s/iter':>12} {'exact/eps':>9}",
        ]
        for r in t["runs"]:
            lines.append(
                f"{r['rows']:>10,} {r['K_mean']:>7.2f} {r['mean_cluster_size']:>10.0f} "
                f"{r['rows_per_decision']:>13.1f} {r['seconds_per_iteration']:>8.4f}"
                f" {r['exact_rows_per_decision']:>10.0f}"
                f" {r['exact_seconds_per_iteration']:>12.4f} {r['speedup']:>8.2f}x"
            )
        lines.append(f"log-log slope of rows read per decision in N_k: {t['slope']:.3f}")
    return "\n".join(lines)


def _format_fig6(d: dict[str, Any]) -> str:
    """Fig. 6's figures as text."""
    lines = [
        f"JointDPM on four blobs: {d['rows']:,} rows, {d['test_rows']:,} held out; "
        f"{d['chains']} chains x {d['iterations']} iterations, step_z={d['step_z']}, "
        f"split_merge={d['split_merge']}",
        f"{'eps':>5} {'final acc':>9} {'t->target s':>11} {'chains':>6} {'s/iter':>8} "
        f"{'rows read/it':>12} {'of':>8} {'K mean':>7} {'Rhat K':>7} {'Rhat a':>7}",
    ]
    for r in d["runs"]:
        s = r["summary"]
        reach = f"{r['chains_reaching']}/{d['chains']}"
        lines.append(
            f"{r['eps']:>5g} {r['final_accuracy']:>9.3f} {r['time_to_target']:>11.2f} "
            f"{reach:>6} "
            f"{r['seconds_per_iteration']:>8.4f} {r['data_used_per_iteration']:>12.0f} "
            f"{r['cluster_rows_per_iteration']:>8.0f} {r['K_mean']:>7.2f} "
            f"{s['K']['rhat']:>7.3f} {s['alpha']['rhat']:>7.3f}"
        )
    lines.append(
        f"target accuracy {d['target_accuracy']:.3f}: eps>0 reaches it {d['speedup']:.2f}x "
        f"sooner (mean time of the chains that reach it; 'chains': how many do); its "
        f"weight tests read {d['data_ratio']:.1f}x fewer rows"
    )
    for r in d["runs"]:
        lines.append(
            f"  eps={r['eps']:g}: clusters at the end {r['K_last']}, largest sizes "
            f"{r['largest_sizes'][0]}; split-merge moves accepted per iteration "
            f"{r['split_merged_per_iteration']:.3f}"
        )
    if d["plot"]:
        lines.append(f"plot: {d['plot']}")
    return "\n".join(lines)
