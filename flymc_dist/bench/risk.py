"""``flymc bench risk``: the sublinear-MH paper's Fig. 4 — the risk of the posterior
predictive mean on held-out MNIST 7-vs-9 images against wall time, exact MH against
austerity MH (approximate, labelled so).

Data: the 12,214 training 7s and 9s, 50 principal components plus a bias
(:func:`flymc_dist.data.real.mnist_7_vs_9`, from ``$FLYMC_DATA_DIR``), split by a fixed
permutation into ``test_rows`` held-out images and the rest. Model: logistic
regression, prior N(0, 0.1·I) (the paper's). Both samplers run RWMH with the same
warm-up adaptation (Laplace preconditioner at the MAP, step size adapted), chains and
seed; austerity's test is the paper's (one-sided ``eps``, minibatch ``batch_size``, no
test before 3 minibatches). The truth is the predictive mean of a separate, longer
exact run; the risk at draw t is the mean over held-out images of the squared
difference between the running predictive mean of draws 1..t and the truth, plotted
against t × (the run's sampling seconds per draw).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from flymc_dist.api import sample
from flymc_dist.data.real import mnist_7_vs_9
from flymc_dist.kernels.rwmh import RandomWalkMH
from flymc_dist.models.logistic import LogisticRegression
from flymc_dist.options import Austerity, Placement, Regular
from flymc_dist.rng import stream

__all__ = ["format_risk", "run_risk"]


def _predictive(samples: np.ndarray, X: np.ndarray) -> np.ndarray:
    """``σ(Xθ)`` per chain and draw: ``(chains, draws, rows)``."""
    return 1.0 / (1.0 + np.exp(-np.einsum("cdp,np->cdn", samples, X)))


def run_risk(
    samples: int = 1000,
    warmup: int = 300,
    reference_samples: int = 3000,
    chains: int = 2,
    eps: float = 0.01,
    batch_size: int = 100,
    test_rows: int = 2000,
    n_shards: int = 2,
    points: int = 20,
    seed: int = 0,
    client: Any = "synchronous",
) -> dict[str, Any]:
    """Risk of the predictive mean against time, exact MH against austerity.

    Parameters
    ----------
    samples, warmup
        Draws kept and warm-up iterations of each compared run.
    reference_samples
        Draws of the exact reference run (its own seed).
    chains
        Chains per run.
    eps, batch_size
        Austerity's one-sided tolerance and minibatch.
    test_rows
        Held-out images.
    n_shards
        Shards.
    points
        Points of each risk curve.
    seed, client
        Seed; where the shards run.

    Returns
    -------
    dict
        ``curves`` per method (``seconds``, ``risk``), rows per decision, seconds.
    """
    X, y = mnist_7_vs_9()
    perm = stream(seed, 11, 4).permutation(X.shape[0])
    test, train = perm[:test_rows], perm[test_rows:]
    Xtr, ytr, Xte = X[train], y[train], X[test]
    model = LogisticRegression(prior="normal", prior_scale=math.sqrt(0.1))
    place = Placement(n_shards=n_shards)

    def go(alg: Any, n: int, s: int) -> Any:
        return sample(
            model,
            (Xtr, ytr),
            alg,
            RandomWalkMH(),
            placement=place,
            num_warmup=warmup,
            num_samples=n,
            chains=chains,
            seed=s,
            client=client,
            progress=False,
        )

    ref = go(Regular(), reference_samples, seed + 1)
    truth = _predictive(ref.samples, Xte).mean(axis=(0, 1))
    runs = {
        "exact MH": go(Regular(), samples, seed),
        f"austerity eps={eps:g} (one-sided)": go(
            Austerity(
                eps=eps, tails="one", min_batches=3, batch_size=batch_size, control_variates=False
            ),
            samples,
            seed,
        ),
    }
    at = np.unique(np.linspace(1, samples, points).round().astype(int))
    curves = {}
    for name, res in runs.items():
        pred = _predictive(res.samples, Xte).mean(axis=0)  # over chains: (draws, rows)
        running = np.cumsum(pred, axis=0) / np.arange(1, samples + 1)[:, None]
        per_draw = float(res.info["sampling_seconds"]) / samples
        used = res.stats.get("data_used")
        curves[name] = {
            "seconds": (at * per_draw).tolist(),
            "risk": [float(np.mean((running[t - 1] - truth) ** 2)) for t in at],
            "seconds_per_draw": per_draw,
            "rows_per_decision": float(np.mean(used)) if used is not None else float(len(Xtr)),
        }
    return {
        "approximate": True,
        "train_rows": int(len(Xtr)),
        "test_rows": int(test_rows),
        "samples": samples,
        "chains": chains,
        "curves": curves,
    }


def format_risk(d: dict[str, Any]) -> str:
    """The benchmark's figures as text."""
    lines = [
        "Austerity is APPROXIMATE. MNIST 7 vs 9, 50 PCA dims + bias, prior N(0, 0.1 I): "
        f"{d['train_rows']:,} training images, {d['test_rows']:,} held out; "
        f"{d['chains']} chains x {d['samples']} draws",
    ]
    for name, c in d["curves"].items():
        lines.append(
            f"{name}: {c['seconds_per_draw'] * 1e3:.2f} ms/draw, "
            f"{c['rows_per_decision']:.0f} rows per decision"
        )
        lines.append("   seconds  risk")
        for s, r in zip(c["seconds"], c["risk"], strict=True):
            lines.append(f"  {s:8.2f}  {r:.3e}")
    return "\n".join(lines)
