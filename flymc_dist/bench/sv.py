"""Stochastic volatility over a panel (the sublinear-MH paper's Fig. 9 and beyond):
the paper's 200 × 5 configuration and how little its data say, subsampled MH's bias on
an informative panel, and a tall panel's cost.

Parts (``parts``):

- ``paper``: 200 series × T = 5, φ = 0.95, σ = 0.1. The marginal log-likelihood of the
  simulated panel over φ ∈ [0, 0.999] (σ = 0.1) and over σ ∈ [0.03, 0.1] (φ = 0.95), by
  a particle filter with common random numbers: its range in nats says how far the data
  move the posterior from the prior. Then exact Gibbs, exact MH (``eps = 0``) and
  subsampled MH (``eps``): posterior means against the truth and the prior, R̂,
  quantiles and a histogram with the truth marked (Fig. 9's panels), lag-1
  autocorrelation, ESS per second.
- ``informative``: ``informative_series`` × ``informative_length``, σ = 0.3, φ = 0.95:
  subsampled MH's bias on φ and σ against exact Gibbs, in units of their MCSE, with its
  ``eps`` and series read per decision.
- ``tall``: panels of ``tall_series`` series × ``tall_length`` (φ = 0.95, σ = 0.1),
  ``tall_particles`` particles (small: the states are series × T × particles per chain):
  subsampled MH with Taylor control variates (and, with ``tall_plain``, without them on
  the same panel), its series read per decision against the number of series (log-log
  slope) with R̂ and the least ESS of (φ, σ) beside; the particle-Gibbs sweep's seconds
  per iteration on 1 and 2 workers, side by side, in wall time and in CPU seconds of the
  busiest shard (its critical path on free cores: on a loaded machine the wall-time ratio
  is the other jobs' noise). The chains start at the true (φ, σ)
  and the random walk's step at a posterior scale for the states' conditional,
  ``2/√(series·T)`` (then adapted in warm-up): a decision's cost is measured where the
  chain lives, not on its way there.

All timings come from one run on whatever else the machine is doing: compare ratios.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from flymc_dist.austerity.sampler import loglog_slope
from flymc_dist.diagnostics import ess_bulk, mcse_mean, rhat
from flymc_dist.sv import StochasticVolatility, sample_sv, series_from_numpy, simulate_sv
from flymc_dist.sv.reference import panel_loglik
from flymc_dist.transport.dask import local_client

__all__ = ["format_sv", "run_sv"]


def _acf1(x: np.ndarray) -> float:
    x = x - x.mean(axis=1, keepdims=True)
    return float(np.mean(np.sum(x[:, 1:] * x[:, :-1], axis=1) / np.sum(x * x, axis=1)))


#: (φ, σ) of the simulated panels: the paper's (also the tall panels') and the informative one
PAPER_TRUTH = (0.95, 0.1)
INFORMATIVE_TRUTH = (0.95, 0.3)

#: the histograms' bins (Fig. 9's panels): φ over its prior's support, σ over where the
#: paper's and the informative panel's posteriors live
HIST_EDGES = {"phi": np.linspace(0.5, 1.0, 21), "sigma": np.linspace(0.0, 0.5, 21)}

#: a histogram's bar heights, lowest to highest
_BARS = " ▁▂▃▄▅▆▇█"


def _describe(res: Any, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {"seconds": seconds, "approximate": bool(res.approximate)}
    for name in ("phi", "sigma"):
        d = getattr(res, name)
        ess = float(ess_bulk(d))
        out[name] = {
            "mean": float(d.mean()),
            "sd": float(d.std()),
            "mcse": float(mcse_mean(d)),
            "rhat": float(rhat(d)),
            "quantiles": np.quantile(d, [0.05, 0.25, 0.5, 0.75, 0.95]).tolist(),
            "histogram": np.histogram(d, HIST_EDGES[name])[0].tolist(),
            "acf1": _acf1(d),
            "ess": ess,
            "ess_per_s": ess / seconds,
        }
    out["series_read_per_iteration"] = float(res.stats["series_read"].mean())
    out["accept_rate"] = float(res.stats["accepted"].mean())
    return out


def _timed(model: StochasticVolatility, ds: Any, **kw: Any) -> dict[str, Any]:
    t = time.perf_counter()
    res = sample_sv(model, ds, **kw)
    return _describe(res, time.perf_counter() - t)


def run_sv(
    parts: Sequence[str] = ("paper", "informative", "tall"),
    eps: float = 0.02,
    batch_size: int = 20,
    particles: int = 32,
    chains: int = 4,
    num_warmup: int = 200,
    num_samples: int = 1000,
    pf_particles: int = 2000,
    informative_series: int = 200,
    informative_length: int = 50,
    tall_series: Sequence[int] = (100_000, 1_000_000),
    tall_length: int = 5,
    tall_particles: int = 8,
    tall_chains: int = 2,
    tall_warmup: int = 10,
    tall_iterations: int = 20,
    tall_plain: bool = True,
    seed: int = 0,
    workdir: str | None = None,
) -> dict[str, Any]:
    """Run the parts of the stochastic-volatility benchmark.

    Parameters
    ----------
    parts
        Any of ``paper``, ``informative``, ``tall``.
    eps
        The subsampled MH's test tolerance (two-sided; the paper's one-sided 0.01).
    batch_size
        Series per test round.
    particles
        Particles per series in particle Gibbs.
    chains, num_warmup, num_samples
        Of every sampling run (``paper``, ``informative``).
    pf_particles
        Particles of the particle filter measuring the marginal likelihood.
    informative_series, informative_length
        The informative panel's size.
    tall_series
        Panel sizes of the tall part.
    tall_length, tall_particles, tall_chains
        Its series length, particles per series and chains.
    tall_warmup, tall_iterations
        Warm-up and kept iterations per tall run.
    tall_plain
        Also run the tall panels without control variates (2 workers, 2 + 3 iterations:
        only their series read per decision is reported).
    seed
        Seed of data and samplers.
    workdir
        Where the stores go (default: a temporary directory).
    """
    work = workdir or tempfile.mkdtemp(prefix="flymc-sv-")
    os.makedirs(work, exist_ok=True)
    out: dict[str, Any] = {"eps": eps, "batch_size": batch_size, "particles": particles}
    run = dict(chains=chains, num_warmup=num_warmup, num_samples=num_samples, seed=seed)
    if "paper" in parts:
        x, _ = simulate_sv(200, 5, *PAPER_TRUTH, seed=seed)
        ds = series_from_numpy(x, os.path.join(work, "paper.zarr"), overwrite=True)
        phis = np.linspace(0.0, 0.999, 12)
        sigmas = np.linspace(0.03, 0.1, 8)
        phi0, sigma0 = PAPER_TRUTH
        ll_phi = [panel_loglik(x, p, sigma0, particles=pf_particles, seed=seed) for p in phis]
        ll_sig = [panel_loglik(x, phi0, s, particles=pf_particles, seed=seed) for s in sigmas]
        # the filter's own noise at one point, for scale
        noise = np.std(
            [panel_loglik(x, phi0, sigma0, particles=pf_particles, seed=s) for s in range(5)]
        )
        p: dict[str, Any] = {
            "loglik_phi_grid": phis.tolist(),
            "loglik_over_phi": ll_phi,
            "loglik_range_phi": float(np.ptp(ll_phi)),
            "loglik_sigma_grid": sigmas.tolist(),
            "loglik_over_sigma": ll_sig,
            "loglik_range_sigma": float(np.ptp(ll_sig)),
            "pf_noise_sd": float(noise),
        }
        base = dict(particles=particles, batch_size=batch_size)
        p["gibbs"] = _timed(StochasticVolatility(**base), ds, client="synchronous", **run)
        p["exact_mh"] = _timed(
            StochasticVolatility(update="subsampled", eps=0.0, **base),
            ds,
            client="synchronous",
            **run,
        )
        p["subsampled"] = _timed(
            StochasticVolatility(update="subsampled", eps=eps, **base),
            ds,
            client="synchronous",
            **run,
        )
        out["paper"] = p
    if "informative" in parts:
        x, _ = simulate_sv(
            informative_series, informative_length, *INFORMATIVE_TRUTH, seed=seed + 1
        )
        ds = series_from_numpy(x, os.path.join(work, "informative.zarr"), overwrite=True)
        base = dict(particles=particles, batch_size=batch_size)
        g = _timed(StochasticVolatility(**base), ds, client="synchronous", **run)
        s = _timed(
            StochasticVolatility(update="subsampled", eps=eps, **base),
            ds,
            client="synchronous",
            **run,
        )
        bias = {
            k: {
                "difference": s[k]["mean"] - g[k]["mean"],
                "z": (s[k]["mean"] - g[k]["mean"]) / float(np.hypot(s[k]["mcse"], g[k]["mcse"])),
            }
            for k in ("phi", "sigma")
        }
        out["informative"] = {
            "n_series": informative_series,
            "length": informative_length,
            "gibbs": g,
            "subsampled": s,
            "bias": bias,
        }
    if "tall" in parts:
        rows = []
        for n in tall_series:
            x, _ = simulate_sv(int(n), tall_length, *PAPER_TRUTH, seed=seed + 2)
            # ≥ 64 chunks (a power of two series each): shards of whole chunks split the
            # panel evenly over 1 or 2 workers (the default chunk is ~4 MB: 2 at 10⁵ × 5)
            chunk = 1 << max(8, int(np.log2(int(n) / 64)))
            ds = series_from_numpy(
                x, os.path.join(work, f"tall-{n}.zarr"), chunk=chunk, overwrite=True
            )
            del x
            base = dict(
                update="subsampled",
                eps=eps,
                batch_size=batch_size,
                particles=tall_particles,
                trace_series=(),
                step=2.0 / float(np.sqrt(int(n) * tall_length)),
            )
            kw = dict(
                chains=tall_chains,
                seed=seed,
                num_warmup=tall_warmup,
                num_samples=tall_iterations,
                init=PAPER_TRUTH,
            )
            row: dict[str, Any] = {"n_series": int(n)}
            runs = [(w, True) for w in (1, 2)] + ([(2, False)] if tall_plain else [])
            for workers, cv in runs:
                model = StochasticVolatility(control_variates=cv, **base)
                client, cluster = local_client(workers)
                with cluster, client:
                    t = time.perf_counter()
                    # without control variates a decision reads far more series: a few
                    # iterations are enough to count them
                    few = {} if cv else dict(num_warmup=2, num_samples=3)
                    res = sample_sv(model, ds, client=client, **{**kw, **few})
                    wall = time.perf_counter() - t
                decisions = res.stats["series_read"].size * model.mh_steps
                per_decision = float(res.stats["series_read"].sum() / decisions)
                if not cv:
                    row["plain_series_read_per_decision"] = per_decision
                    continue
                row[f"sweep_s_{workers}w"] = float(np.median(res.stats["sweep_seconds"]))
                row[f"sweep_cpu_{workers}w"] = float(np.median(res.stats["sweep_cpu_seconds"]))
                row[f"update_s_{workers}w"] = float(np.median(res.stats["update_seconds"]))
                row[f"wall_{workers}w"] = wall
                row["series_read_per_decision"] = per_decision
                row["accept_rate"] = float(res.stats["accepted"].mean() / model.mh_steps)
                draws = np.stack([res.phi, res.sigma])
                enough = draws.shape[2] >= 4  # the diagnostics' least draws per chain
                row["rhat"] = [float(rhat(d)) if enough else float("nan") for d in draws]
                row["min_ess"] = float(min(ess_bulk(d) for d in draws)) if enough else np.nan
            row["speedup_2w"] = row["sweep_s_1w"] / row["sweep_s_2w"]
            row["cpu_speedup_2w"] = row["sweep_cpu_1w"] / row["sweep_cpu_2w"]
            rows.append(row)
        out["tall"] = rows
        out["tall_config"] = {
            "length": tall_length,
            "particles": tall_particles,
            "chains": tall_chains,
            "warmup": tall_warmup,
            "iterations": tall_iterations,
        }
        if len(rows) > 1:
            ns = [r["n_series"] for r in rows]
            out["tall_read_slope"] = loglog_slope(ns, [r["series_read_per_decision"] for r in rows])
            if tall_plain:
                out["tall_plain_read_slope"] = loglog_slope(
                    ns, [r["plain_series_read_per_decision"] for r in rows]
                )
            out["tall_sweep_slope"] = loglog_slope(ns, [r["sweep_s_1w"] for r in rows])
    return out


def _histogram(counts: Sequence[int], name: str, truth: float) -> str:
    """A histogram as one line of bars over :data:`HIST_EDGES` between its range's ends,
    with ``|`` just before the bin that holds the truth."""
    edges = HIST_EDGES[name]
    top = max(max(counts), 1)
    bars = [_BARS[int(np.ceil(c / top * (len(_BARS) - 1)))] for c in counts]
    at = int(np.searchsorted(edges, truth, side="right")) - 1
    if 0 <= at < len(bars):
        bars.insert(at, "|")
    return f"[{edges[0]:g} {''.join(bars)} {edges[-1]:g}]"


def format_sv(d: dict[str, Any]) -> str:
    """The figures as text."""
    lines = [
        f"stochastic volatility (eps={d['eps']}, batch {d['batch_size']} series, "
        f"{d['particles']} particles)"
    ]

    def row(name: str, r: dict[str, Any], truth: tuple[float, float]) -> str:
        f = r["phi"]
        s = r["sigma"]
        tag = " (approximate)" if r["approximate"] else ""
        return (
            f"  {name:<11} φ {f['mean']:.4f}±{f['sd']:.4f} (mcse {f['mcse']:.4f}, R-hat "
            f"{f['rhat']:.3f}, ess/s {f['ess_per_s']:.2f}, acf1 {f['acf1']:.2f})  "
            f"σ {s['mean']:.4f}±{s['sd']:.4f} (mcse {s['mcse']:.4f}, R-hat {s['rhat']:.3f}, "
            f"ess/s {s['ess_per_s']:.2f}, acf1 {s['acf1']:.2f})  "
            f"series/it {r['series_read_per_iteration']:.0f}{tag}\n"
            f"  {'':<11} φ {_histogram(f['histogram'], 'phi', truth[0])}  "
            f"σ {_histogram(s['histogram'], 'sigma', truth[1])}"
        )

    if "paper" in d:
        p = d["paper"]
        lines.append(
            f"paper 200 × 5 (φ={PAPER_TRUTH[0]:g}, σ={PAPER_TRUTH[1]:g}; prior means φ 0.833, "
            "σ≈0.11):"
        )
        lines.append(
            f"  marginal log-lik range over φ∈[0,0.999]: {p['loglik_range_phi']:.2f} nats; "
            f"over σ∈[0.03,0.1]: {p['loglik_range_sigma']:.2f} nats "
            f"(filter noise sd {p['pf_noise_sd']:.2f})"
        )
        for k in ("gibbs", "exact_mh", "subsampled"):
            lines.append(row(k, p[k], PAPER_TRUTH))
    if "informative" in d:
        q = d["informative"]
        lines.append(
            f"informative {q['n_series']} × {q['length']} "
            f"(φ={INFORMATIVE_TRUTH[0]:g}, σ={INFORMATIVE_TRUTH[1]:g}):"
        )
        lines.append(row("gibbs", q["gibbs"], INFORMATIVE_TRUTH))
        lines.append(row("subsampled", q["subsampled"], INFORMATIVE_TRUTH))
        b = q["bias"]
        lines.append(
            f"  subsampled − exact: φ {b['phi']['difference']:+.4f} (z {b['phi']['z']:+.1f}), "
            f"σ {b['sigma']['difference']:+.4f} (z {b['sigma']['z']:+.1f})"
        )
    if "tall" in d:
        c = d["tall_config"]
        lines.append(
            f"tall panel (T={c['length']}, {c['particles']} particles, {c['chains']} chains, "
            f"{c['iterations']} iterations, control variates): series  read/decision "
            "(plain)  R-hat φ σ  min ESS  accept  sweep s/it 1w  2w  speedup  "
            "(busiest shard's CPU s 1w  2w  ratio)"
        )
        for r in d["tall"]:
            plain = r.get("plain_series_read_per_decision")
            lines.append(
                f"  {r['n_series']:>9}  {r['series_read_per_decision']:>8.1f} "
                f"({'-' if plain is None else f'{plain:.0f}'})  "
                f"{r['rhat'][0]:.2f} {r['rhat'][1]:.2f}  {r['min_ess']:.0f}  "
                f"{r['accept_rate']:.2f}  {r['sweep_s_1w']:.3f}  {r['sweep_s_2w']:.3f}  "
                f"{r['speedup_2w']:.2f}×  ({r['sweep_cpu_1w']:.3f}  {r['sweep_cpu_2w']:.3f}  "
                f"{r['cpu_speedup_2w']:.2f}×)"
            )
        if "tall_read_slope" in d:
            plain = d.get("tall_plain_read_slope")
            lines.append(
                f"  log-log slope: series read {d['tall_read_slope']:.2f}"
                + ("" if plain is None else f" (plain {plain:.2f})")
                + f", sweep {d['tall_sweep_slope']:.2f}"
            )
    return "\n".join(lines)
