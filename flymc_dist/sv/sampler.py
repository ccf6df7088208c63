"""Stochastic volatility over a panel of series: particle Gibbs on the shards, the
shared (φ, σ) on the driver.

Model (Chen, Mansinghka & Ghahramani 2016, Sec. 4.3), for every series ``i``:
``x_{it} = exp(h_{it}/2) ε_{it}``, ``h_{it} ~ N(φ h_{i,t−1}, σ²)``, ``h_{i0} = 0``;
``φ ~ Beta(5, 1)``, ``σ² ~ InvGamma(5, 0.05)``.

Each iteration of each chain:

1. every shard runs one conditional-SMC-with-ancestor-sampling sweep
   (:mod:`flymc_dist.sv.csmc`) of each of its series and replies with the summed
   transition statistics ``(Σh²_{t−1}, Σh_t h_{t−1}, Σh_t², n)`` per global block of
   series (added on the driver in global order: bit-identical whatever the layout);
2. the driver moves (φ, σ²):

   * ``update="exact"`` (default): ``σ² | φ, h`` then ``φ | σ², h`` drawn exactly from
     their conditionals (:mod:`flymc_dist.sv.conditionals`) — an exact Gibbs sampler;
   * ``update="subsampled"`` — **approximate**: the paper's subsampled MH, a random walk
     on ``(logit φ, log σ²)`` whose accept/reject is the sequential test of austerity with
     a *series* as the unit (each series' transition log-likelihood is one datum; the
     series are read from the shards in batches); ``eps = 0`` is exact MH over all series.
     With ``control_variates=True`` (the default) the test runs on the residuals of a
     second-order Taylor expansion of each series' transition log-likelihood in
     ``(φ, log σ²)`` around the chain's point after the sweep, whose sum over all series
     comes from the sweep's summed statistics
     (:class:`~flymc_dist.sv.conditionals.TaylorControlVariate`): the series read per
     decision stop growing with the number of series. Still approximate; given the states
     the exact update is the better choice for this model.

Randomness: a sweep's by (seed, chain, iteration, global series); the driver's by
``stream(seed, ROLE_SV, chain, iteration)``. Nothing depends on the layout or the
number of workers, and a resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr

from flymc_dist.diagnostics import summary as draws_summary
from flymc_dist.rng import stream
from flymc_dist.sv.conditionals import (
    Priors,
    mh_step,
    sample_phi,
    sample_sigma2,
    taylor_sums,
)
from flymc_dist.sv.data import SeriesDataset, open_series
from flymc_dist.sv.shard import SeriesShard
from flymc_dist.transport.dask import client_from, live_workers

__all__ = ["ROLE_SV", "SVResult", "StochasticVolatility", "load_trace", "sample_sv"]

#: spawn-key role of the driver's streams (flymc_dist.rng's roles are 1–4)
ROLE_SV = 20
_SUB_INIT = 0
_SUB_STEP = 1
_SUB_SCALE = 2
#: warm-up adaptation of the subsampled MH's step toward this acceptance rate
TARGET_ACCEPT = 0.3
UPDATES = ("exact", "subsampled")


@dataclass(frozen=True)
class StochasticVolatility:
    """The stochastic-volatility panel model and how its shared (φ, σ) move.

    Parameters
    ----------
    update
        ``"exact"``: Gibbs from the exact conditionals; ``"subsampled"``: the paper's
        subsampled MH over series (approximate unless ``eps = 0``).
    eps
        The sequential test's tolerance (``"subsampled"`` only; 0: exact MH).
    batch_size
        Series added to a subsampled decision per test round.
    mh_steps
        Subsampled MH steps per iteration.
    step
        Initial random-walk sd on ``(logit φ, log σ²)`` (adapted during warm-up).
    particles
        Particles per series in the conditional SMC sweep.
    phi_prior
        ``(a, b)`` of the Beta prior of φ (both >= 1).
    sigma2_prior
        ``(shape, scale)`` of the inverse-gamma prior of σ².
    trace_series
        Global indices of the series whose states are traced.
    control_variates
        ``"subsampled"`` only: run the sequential test on the residuals of a Taylor
        expansion around the chain's point after each sweep (its sum over all series from
        the sweep's summed statistics); False: on the plain differences, as the paper.
    scale_move
        After each sweep, an exact MH move scaling every state and σ by one factor
        ``c`` (a group move: ``log α = Δ_obs + 2 log c + log p(c²σ²) − log p(σ²)``,
        ``Δ_obs`` summed by the shards with the sweep): it breaks the Gibbs coupling of
        σ and the states, the slow direction of particle Gibbs.
    """

    update: str = "exact"
    eps: float = 0.05
    batch_size: int = 50
    mh_steps: int = 1
    step: float = 0.1
    particles: int = 32
    phi_prior: tuple[float, float] = (5.0, 1.0)
    sigma2_prior: tuple[float, float] = (5.0, 0.05)
    trace_series: tuple[int, ...] = (0, 1, 2)
    control_variates: bool = True
    scale_move: bool = True

    def __post_init__(self) -> None:
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {self.update!r}")
        if not (0.0 <= float(self.eps) < 1.0):
            raise ValueError(f"eps must be in [0, 1), got {self.eps}")
        for name in ("batch_size", "mh_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if int(self.particles) < 2:
            raise ValueError(f"particles must be >= 2, got {self.particles}")
        if not self.step > 0:
            raise ValueError(f"step must be > 0, got {self.step}")
        a, b = self.phi_prior
        if not (a >= 1 and b >= 1):
            raise ValueError(f"phi_prior must be (a, b) with a, b >= 1, got {self.phi_prior}")
        s, r = self.sigma2_prior
        if not (s > 0 and r > 0):
            raise ValueError(
                f"sigma2_prior must be (shape > 0, scale > 0), got {self.sigma2_prior}"
            )

    @property
    def priors(self) -> Priors:
        """The priors as :class:`~flymc_dist.sv.conditionals.Priors`."""
        return Priors(*map(float, self.phi_prior), *map(float, self.sigma2_prior))

    @property
    def approximate(self) -> bool:
        """Whether the (φ, σ) update is approximate (subsampled with ``eps > 0``)."""
        return self.update == "subsampled" and self.eps > 0

    def config(self) -> dict[str, Any]:
        """The options as JSON (kept in a trace; a resume must match them)."""
        return {
            "update": self.update,
            "eps": float(self.eps),
            "batch_size": int(self.batch_size),
            "mh_steps": int(self.mh_steps),
            "step": float(self.step),
            "particles": int(self.particles),
            "phi_prior": list(map(float, self.phi_prior)),
            "sigma2_prior": list(map(float, self.sigma2_prior)),
            "trace_series": [int(i) for i in self.trace_series],
            "control_variates": bool(self.control_variates),
            "scale_move": bool(self.scale_move),
        }


@dataclass
class SVResult:
    """Draws of a stochastic-volatility run.

    ``phi``, ``sigma``: ``(chains, draws)``; ``states``: ``(chains, draws, k, T)`` of the
    traced series; ``stats``: per-iteration ``series_read`` (series a (φ, σ) update read:
    every series for the exact update), ``accepted`` (subsampled MH steps accepted),
    ``sweep_seconds`` and ``update_seconds`` (wall time per iteration, all chains),
    ``sweep_cpu_seconds`` (the sweep's CPU seconds on its busiest shard: its critical path
    on free cores) and ``sweep_cpu_total`` (summed over shards).
    """

    phi: np.ndarray
    sigma: np.ndarray
    states: np.ndarray
    traced: tuple[int, ...]
    stats: dict[str, np.ndarray]
    approximate: bool
    info: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, np.ndarray]:
        """Posterior summary of φ and σ (mean, sd, MCSE, quantiles, ESS, R̂)."""
        return draws_summary(np.stack([self.phi, self.sigma], axis=-1), ["phi", "sigma"])


class _InProcess:
    def __init__(self, shards: list[SeriesShard]) -> None:
        self.shards = shards

    def call(self, method: str, *args: Any) -> list[Any]:
        return [getattr(s, method)(*args) for s in self.shards]

    def call_one(self, i: int, method: str, *args: Any) -> Any:
        return getattr(self.shards[i], method)(*args)

    def close(self) -> None:
        self.shards = []


class _DaskActors:
    """One Dask actor per shard, placed round-robin on the workers; every call goes to
    all of them concurrently and the replies come back in shard order."""

    def __init__(
        self, client: Any, kwargs: list[dict[str, Any]], owned: tuple[Any, Any] | None
    ) -> None:
        self.client, self.owned = client, owned
        workers = live_workers(client)
        futs = [
            # pure=False: a fresh actor each run, never one a run with the same options left
            client.submit(
                SeriesShard, actor=True, pure=False, workers=[workers[i % len(workers)]], **kw
            )
            for i, kw in enumerate(kwargs)
        ]
        self.futures = futs  # the actors live while their futures are held
        self.actors = [f.result() for f in futs]

    def call(self, method: str, *args: Any) -> list[Any]:
        futs = [getattr(a, method)(*args) for a in self.actors]
        return [f.result() for f in futs]

    def call_one(self, i: int, method: str, *args: Any) -> Any:
        return getattr(self.actors[i], method)(*args).result()

    def close(self) -> None:
        self.actors = []
        self.futures = []
        if self.owned is not None:
            client, cluster = self.owned
            client.close()
            if cluster is not None:
                cluster.close()


def _open(
    client: Any,
    kwargs_of: Callable[[int], list[dict[str, Any]]],
    n_shards: int | None,
    n_workers: int | None,
) -> Any:
    """The shards, in process (``client="synchronous"``: one shard unless ``n_shards``
    says otherwise) or as Dask actors (one per worker unless ``n_shards`` says)."""
    if isinstance(client, str) and client == "synchronous":
        return _InProcess([SeriesShard(**kw) for kw in kwargs_of(n_shards or 1)])
    c, cluster, owned = client_from(client, n_workers)
    k = n_shards if n_shards is not None else len(live_workers(c))
    return _DaskActors(c, kwargs_of(int(k)), (c, cluster) if owned else None)


def sample_sv(
    model: StochasticVolatility,
    data: SeriesDataset | str,
    *,
    num_warmup: int = 200,
    num_samples: int = 1000,
    chains: int = 4,
    seed: int = 0,
    client: Any = None,
    n_shards: int | None = None,
    n_workers: int | None = None,
    trace: str | None = None,
    resume: bool = False,
    overwrite_trace: bool = False,
    checkpoint_every: int = 100,
    init: tuple[float, float] | None = None,
) -> SVResult:
    """Draw from the posterior of the stochastic-volatility panel model.

    Parameters
    ----------
    model
        :class:`StochasticVolatility`.
    data
        A series store (:func:`~flymc_dist.sv.data.series_from_numpy`) or its path.
    num_warmup, num_samples, chains, seed
        Warm-up iterations (the subsampled MH's step adapts; discarded), kept draws per
        chain, chains, seed. On ``resume``, ``num_samples`` more draws (no warm-up).
    client
        ``"synchronous"`` (in this process), None (an embedded LocalCluster), a
        ``distributed.Client`` or a scheduler address.
    n_shards
        Shards (default: one per worker; one in process). Never changes the draws.
    n_workers
        Workers of the embedded LocalCluster.
    trace
        A zarr directory keeping the draws and, every ``checkpoint_every`` draws and at
        the end, the checkpoint (every series' states, (φ, σ), the step sizes).
    resume
        Continue the run in ``trace`` (same data, model, seed and chains).
    overwrite_trace
        Replace an existing ``trace``.
    init
        ``(φ, σ)`` every chain starts from (None: a draw from the prior per chain); the
        states start at zero. Ignored on ``resume``.

    Returns
    -------
    SVResult
        With ``approximate`` True for the subsampled update with ``eps > 0``.
    """
    if not isinstance(model, StochasticVolatility):
        raise TypeError(f"model must be a StochasticVolatility, not {type(model).__name__}")
    ds = data if isinstance(data, SeriesDataset) else open_series(data)
    for name, v, lo in (
        ("num_warmup", num_warmup, 0),
        ("num_samples", num_samples, 1),
        ("chains", chains, 1),
        ("checkpoint_every", checkpoint_every, 1),
    ):
        if int(v) < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    if init is not None:
        if len(init) != 2 or not (0.0 < float(init[0]) < 1.0 and float(init[1]) > 0):
            raise ValueError(f"init must be (phi in (0, 1), sigma > 0), got {init}")
        init = (float(init[0]), float(init[1]))
    traced = tuple(int(i) for i in model.trace_series if 0 <= int(i) < ds.n_series)
    if len(traced) != len(model.trace_series):
        raise ValueError(f"trace_series must be series indices in [0, {ds.n_series})")
    pr = model.priors
    config = {
        "model": model.config(),
        "seed": int(seed),
        "chains": int(chains),
        "data": [ds.path, ds.n_series, ds.length],
        "init": None if init is None else list(init),
    }
    if resume and trace is None:
        raise ValueError("resume=True needs a trace")
    if trace is not None:
        trace = os.path.abspath(trace)
        if resume:
            g = zarr.open_group(store=trace, mode="r", zarr_format=3)
            if dict(g.attrs["config"]) != config:
                raise ValueError(
                    f"trace {trace!r} was written by a different run: {dict(g.attrs['config'])}"
                )
        elif os.path.exists(trace) and not overwrite_trace:
            raise FileExistsError(
                f"trace {trace!r} exists; pass overwrite_trace=True or resume=True"
            )
    kwargs_of = lambda k: [  # noqa: E731
        dict(
            path=ds.path,
            start=a,
            stop=b,
            chains=int(chains),
            particles=int(model.particles),
            seed=int(seed),
            block=ds.chunk,
            traced=traced,
        )
        for a, b in ds.shard_ranges(k)
    ]
    tp = _open(client, kwargs_of, n_shards, n_workers)
    try:
        return _run(
            tp,
            model,
            ds,
            pr,
            traced,
            config,
            num_warmup,
            num_samples,
            chains,
            seed,
            trace,
            resume,
            checkpoint_every,
            init,
        )
    finally:
        tp.close()


def _run(
    tp,
    model,
    ds,
    pr,
    traced,
    config,
    num_warmup,
    num_samples,
    chains,
    seed,
    trace,
    resume,
    checkpoint_every,
    init,
) -> SVResult:
    ranges = ds.shard_ranges(len(tp.shards) if isinstance(tp, _InProcess) else len(tp.actors))
    starts = np.array([a for a, _ in ranges])
    C = int(chains)
    if resume:
        g = zarr.open_group(store=trace, mode="r+", zarr_format=3)
        if "theta" not in g.attrs:
            raise ValueError(f"trace {trace!r} holds no checkpoint to resume from")
        n_kept = int(g.attrs["n_draws"])
        for name in ("phi", "sigma", "states", "series_read", "accepted"):
            if g[name].shape[1] > n_kept:  # draws appended by an interrupted checkpoint
                g[name].resize((g[name].shape[0], n_kept, *g[name].shape[2:]))
        theta = np.array(g.attrs["theta"], float)
        log_step = np.array(g.attrs["log_step"], float)
        log_cstep = np.array(g.attrs["log_cstep"], float)
        it0 = int(g.attrs["iteration"])
        n_warm = 0
        tp.call("load_states", trace)
    else:
        theta = np.empty((C, 2))
        for c in range(C):
            if init is None:
                r = stream(seed, ROLE_SV, _SUB_INIT, c)
                theta[c] = (r.beta(pr.phi_a, pr.phi_b), pr.s2_b / r.gamma(pr.s2_a))
            else:
                theta[c] = (init[0], init[1] ** 2)
        log_step = np.full(C, math.log(model.step))
        log_cstep = np.full(C, math.log(0.05))
        it0 = 0
        n_warm = int(num_warmup)
        if trace is not None:
            _create_trace(trace, config, C, ds, len(traced))
    n_total = n_warm + int(num_samples)
    phis, sigmas = np.empty((C, num_samples)), np.empty((C, num_samples))
    states = np.empty((C, num_samples, len(traced), ds.length))
    read = np.zeros((C, num_samples), np.int64)
    accepted = np.zeros((C, num_samples), np.int64)
    sweep_s, update_s = np.zeros(num_samples), np.zeros(num_samples)
    cpu_max, cpu_tot = np.zeros(num_samples), np.zeros(num_samples)
    kept_from = 0  # first draw not yet written to the trace
    pending = np.ones(C)  # accepted scale moves the shards have not applied yet

    def fetch_for(c: int):
        def fetch(idx: np.ndarray) -> np.ndarray:
            which = np.searchsorted(starts, idx, side="right") - 1
            out = np.empty((idx.size, 4))
            for s in np.unique(which):
                m = which == s
                out[m] = tp.call_one(int(s), "fetch", c, idx[m])
            out[:, :3] *= pending[c] ** 2
            return out

        return fetch

    for k in range(n_total):
        it = it0 + k
        w0 = time.perf_counter()
        crng = [stream(seed, ROLE_SV, _SUB_SCALE, c, it) for c in range(C)]
        trial = np.ones(C)
        if model.scale_move:
            trial = np.array(
                [math.exp(math.exp(log_cstep[c]) * r.standard_normal()) for c, r in enumerate(crng)]
            )
        replies = tp.call("sweep", it, theta[:, 0].copy(), np.sqrt(theta[:, 1]), pending, trial)
        sums = np.concatenate([r[0] for r in replies], axis=1).sum(axis=1)  # (C, 5)
        tr = np.concatenate([r[1] for r in replies], axis=1) if traced else None
        pending = np.ones(C)
        if model.scale_move:
            for c in range(C):
                cc, s2 = trial[c], theta[c, 1]
                log_a = sums[c, 4] + 2 * math.log(cc)
                log_a += (
                    -(pr.s2_a + 1) * math.log(cc * cc) - pr.s2_b / (cc * cc * s2) + pr.s2_b / s2
                )
                ok = math.log(crng[c].random()) < log_a
                if ok:
                    pending[c] = cc
                    theta[c, 1] = s2 * cc * cc
                    sums[c, :3] *= cc * cc
                    if traced:
                        tr[c] *= cc
                if k < n_warm:
                    log_cstep[c] += (float(ok) - TARGET_ACCEPT) / math.sqrt(k + 1)
        w1 = time.perf_counter()
        n_read = np.zeros(C, np.int64)
        n_acc = np.zeros(C, np.int64)
        for c in range(C):
            rng = stream(seed, ROLE_SV, _SUB_STEP, c, it)
            phi, s2 = theta[c]
            cv = None
            if model.update == "subsampled" and model.control_variates:
                cv = taylor_sums(sums[c], (phi, s2))  # after the scale move: sums[c] agree
            if model.update == "exact":
                s2 = sample_sigma2(rng, sums[c], phi, pr)
                phi = sample_phi(rng, sums[c], s2, pr)
                n_read[c] = ds.n_series
            else:
                for _ in range(model.mh_steps):
                    step = mh_step(
                        rng,
                        (phi, s2),
                        math.exp(log_step[c]),
                        fetch_for(c),
                        ds.n_series,
                        pr,
                        eps=model.eps,
                        batch_size=model.batch_size,
                        control=cv,
                    )
                    phi, s2 = step.point
                    n_read[c] += step.series_read
                    n_acc[c] += step.accept
                    if k < n_warm:  # Robbins–Monro toward TARGET_ACCEPT, warm-up only
                        log_step[c] += (float(step.accept) - TARGET_ACCEPT) / math.sqrt(k + 1)
            theta[c] = (phi, s2)
        w2 = time.perf_counter()
        if k >= n_warm:
            j = k - n_warm
            phis[:, j], sigmas[:, j] = theta[:, 0], np.sqrt(theta[:, 1])
            if traced:
                states[:, j] = tr
            read[:, j], accepted[:, j] = n_read, n_acc
            sweep_s[j], update_s[j] = w1 - w0, w2 - w1
            cpu = [r[2] for r in replies]
            cpu_max[j], cpu_tot[j] = max(cpu), sum(cpu)
            if trace is not None and ((j + 1) % checkpoint_every == 0 or j + 1 == num_samples):
                sl = slice(kept_from, j + 1)
                _checkpoint(
                    trace,
                    tp,
                    it + 1,
                    theta,
                    log_step,
                    phis[:, sl],
                    sigmas[:, sl],
                    states[:, sl],
                    read[:, sl],
                    accepted[:, sl],
                    pending,
                    log_cstep,
                )
                pending = np.ones(C)  # the shards applied them
                kept_from = j + 1
    return SVResult(
        phis,
        sigmas,
        states,
        traced,
        {
            "series_read": read,
            "accepted": accepted,
            "sweep_seconds": sweep_s,
            "update_seconds": update_s,
            "sweep_cpu_seconds": cpu_max,
            "sweep_cpu_total": cpu_tot,
        },
        model.approximate,
        {
            "update": model.update,
            "eps": model.eps,
            "n_series": ds.n_series,
            "length": ds.length,
            "n_shards": len(ranges),
            "first_iteration": it0 + n_warm,
            "step": np.exp(log_step),
            "scale_step": np.exp(log_cstep),
        },
    )


def _create_trace(trace: str, config: dict, C: int, ds: SeriesDataset, k: int) -> None:
    if os.path.exists(trace):
        shutil.rmtree(trace)
    g = zarr.open_group(store=trace, mode="w", zarr_format=3)
    g.create_array("phi", shape=(C, 0), chunks=(C, 1024), dtype="float64")
    g.create_array("sigma", shape=(C, 0), chunks=(C, 1024), dtype="float64")
    g.create_array(
        "states", shape=(C, 0, k, ds.length), chunks=(C, 256, max(k, 1), ds.length), dtype="float64"
    )
    g.create_array("series_read", shape=(C, 0), chunks=(C, 1024), dtype="int64")
    g.create_array("accepted", shape=(C, 0), chunks=(C, 1024), dtype="int64")
    g.create_array(
        "h", shape=(C, ds.n_series, ds.length), chunks=(C, ds.chunk, ds.length), dtype="float64"
    )
    g.attrs.update({"config": config, "iteration": 0, "n_draws": 0})


def _checkpoint(
    trace, tp, iteration, theta, log_step, phi, sigma, states, read, acc, pending, log_cstep
) -> None:
    """Append the draws, then save the states and the driver's state (the iteration last:
    a checkpoint interrupted before it is not taken as done)."""
    g = zarr.open_group(store=trace, mode="r+", zarr_format=3)
    for name, v in (
        ("phi", phi),
        ("sigma", sigma),
        ("states", states),
        ("series_read", read),
        ("accepted", acc),
    ):
        g[name].append(v, axis=1)
    tp.call("save_states", trace, pending)
    g.attrs.update(
        {
            "theta": theta.tolist(),
            "log_step": log_step.tolist(),
            "log_cstep": log_cstep.tolist(),
            "n_draws": int(g["phi"].shape[1]),
        }
    )
    g.attrs["iteration"] = int(iteration)


def load_trace(trace: str) -> dict[str, np.ndarray]:
    """The draws kept in a trace: ``phi``, ``sigma``, ``states``, ``series_read``,
    ``accepted``."""
    g = zarr.open_group(store=os.path.abspath(trace), mode="r", zarr_format=3)
    return {k: np.asarray(g[k][:]) for k in ("phi", "sigma", "states", "series_read", "accepted")}
