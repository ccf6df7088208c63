"""``flymc bench sublinear``: austerity MH's data use against N, and its bias against eps.

Every measurement is made with and without control variates from the bounds
(``control_variates=True``, the sampler's default; see :mod:`flymc_dist.austerity.sampler`), on
logistic data sets of growing N from one generating θ₀ (Chen, Mansinghka & Ghahramani
2016, Fig. 5; Korattikara et al. 2014; Bardenet, Doucet & Holmes 2017):

1. **Fixed move.** A proposal ``θ₀ → θ₀ + distance · v`` (``v`` a fixed unit vector),
   decided ``n_decisions`` times (fresh ``u`` and fresh minibatches each): the mean
   rows a decision used, its error rate against exact MH, and the least-squares slope of
   log(rows used) on log N. With a fixed move the evidence per row does not shrink
   with N, so the rows needed level off and the slope tends to 0 even without control
   variates.
2. **Posterior-scaled proposal.** What a user runs: ``fd.sample(algorithm="austerity")``
   with RWMH and its default warm-up adaptation (Laplace preconditioner at the MAP, step
   size adapted), ``posterior_warmup + posterior_samples`` iterations of
   ``posterior_chains`` chains; the rows per decision after warm-up (mean, median,
   max), the slope of the mean against N, and the seconds of the whole run. The moves
   shrink as 1/√N: plain austerity then needs an almost constant *fraction* of the data
   (slope ≈ 0.9, the known limit); with control variates the spread of ``Δδ`` shrinks
   as 1/N, like the evidence, and the rows needed stay nearly flat. Plain runs are
   skipped above ``plain_max_n`` (they cost ≈ N rows per decision: minutes at 10⁶).
3. **Bias vs eps** on one ``bias_rows``-row problem: the posterior mean of austerity
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
from flymc_dist.api import sample
from flymc_dist.austerity.sampler import expected_data_used, loglog_slope, run_decisions
from flymc_dist.data import from_numpy
from flymc_dist.kernels.rwmh import RandomWalkMH, tril_matvec
from flymc_dist.models.logistic import LogisticRegression
from flymc_dist.options import Austerity, Placement, Regular
from flymc_dist.rng import ROLE_AUSTERITY, stream
from flymc_dist.transport.dask import client_from

__all__ = ["format", "format_sublinear", "logistic_data", "run_paper_fig5", "run_sublinear"]

#: sub-role of the benchmark's own random streams (data, u, moves)
_BENCH = 7

#: the chain's states at which :func:`run_paper_fig5` computes the expected rows
PREDICTION_STATES = 100


def logistic_data(
    n_rows: int, n_features: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def _dataset(
    n_rows: int, n_features: int, seed: int, client: Any, tmp: str | None, store: bool = False
) -> Any:
    """``(X, y)`` in memory for the synchronous client (unless ``store``), else a zarr
    store."""
    X, y, theta0 = logistic_data(n_rows, n_features, seed)
    if isinstance(client, str) and client == "synchronous" and not store:
        return (X, y), theta0
    if tmp is None:
        raise ValueError("a cluster client or out_of_core needs a directory for the stores")
    return from_numpy(X, y, f"{tmp}/logistic_{n_rows}.zarr", overwrite=True), theta0


def _variants(control_variates: bool, plain: bool) -> list[bool]:
    """The control-variate settings to measure: plain first."""
    out = ([False] if plain else []) + ([True] if control_variates else [])
    if not out:
        raise ValueError("nothing to measure: control_variates and plain are both False")
    return out


def _key(cv: bool) -> str:
    return "cv" if cv else "plain"


def _slope(ns: Sequence[int], used: Sequence[float | None]) -> float | None:
    """log-log slope over the sizes that were measured (None below two)."""
    pts = [(n, u) for n, u in zip(ns, used, strict=True) if u is not None]
    if len(pts) < 2:
        return None
    return loglog_slope([n for n, _ in pts], [u for _, u in pts])


def run_sublinear(
    ns: Sequence[int] = (10**4, 10**5, 10**6),
    eps: float = 0.05,
    batch_size: int = 500,
    seed: int = 0,
    client: Any = "synchronous",
    *,
    n_features: int = 3,
    distance: float = 0.2,
    n_decisions: int = 100,
    n_shards: int = 4,
    control_variates: bool = True,
    plain: bool = True,
    fixed: bool = True,
    posterior: bool = True,
    posterior_eps: float = 0.01,
    posterior_warmup: int = 300,
    posterior_samples: int = 600,
    posterior_chains: int = 2,
    plain_max_n: int = 100_000,
    out_of_core: bool = False,
    bias_eps: Sequence[float] | None = (0.2, 0.1, 0.05, 0.01),
    bias_rows: int = 10_000,
    bias_chains: int = 8,
    bias_warmup: int = 150,
    bias_samples: int = 450,
    bias_batch_size: int = 2000,
    bias_shards: int = 2,
    error_moves: int = 400,
    workdir: str | None = None,
    paper: bool = False,
) -> dict[str, Any]:
    """Data used per austerity decision against N, and bias against eps.

    Parameters
    ----------
    ns
        Data set sizes (at least two, ideally spanning two decades or more; up to 10⁷
        fits in a few GB of memory).
    eps, batch_size
        Test tolerance and rows per round of the fixed-move decisions; ``batch_size`` is
        also the posterior-scaled runs' rows per round.
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
        Fixed-move decisions averaged per N.
    n_shards
        Shards per data set.
    control_variates
        Measure austerity with control variates from the bounds (the sampler's default).
    plain
        Measure plain austerity (``control_variates=False``).
    fixed
        Run the fixed-move measurement.
    posterior
        Run the posterior-scaled measurement (the sampler with its default adaptation).
    posterior_eps
        Test tolerance of the posterior-scaled runs (the sampler's default 0.01).
    posterior_warmup, posterior_samples, posterior_chains
        Iterations (warm-up adapts the step size; only later decisions are counted) and
        chains of each posterior-scaled run.
    plain_max_n
        Largest N for plain austerity with the posterior-scaled proposal (it uses a near
        constant fraction of N per decision: ≈ 3 minutes at 10⁵ rows, ≈ 30 at 10⁶).
    out_of_core
        Also run each posterior-scaled measurement with its shards forced out of core,
        right after the same run in memory, both from one zarr store: seconds and store
        bytes read per iteration side by side (each test round then reads the store
        chunks its rows touch).
    bias_eps
        Tolerances of the bias table (None or empty: skip the bias part).
    bias_rows, bias_chains, bias_warmup, bias_samples, bias_batch_size, bias_shards
        The bias problem's size, the chains run on it (exact and austerity alike), the
        austerity batch size and the shard count there.
    error_moves
        Moves scored for the per-decision error rate.
    workdir
        Where to write zarr stores for a cluster client.
    paper
        Instead, the sublinear-MH paper's Fig. 5 settings (see :func:`run_paper_fig5`):
        ``ns``, ``seed`` and ``n_shards`` are used, every other option ignored.

    Returns
    -------
    dict
        ``"fixed"`` and ``"posterior"`` (None when not run): ``ns``, settings, and per
        variant (``"plain"``, ``"cv"``, or None when not run) the per-N figures
        (``mean_data_used``, ``fraction``, ``seconds``, ``seconds_per_iteration``,
        ``bytes_read_per_iteration``, …; None where skipped) and ``slope``; with
        ``out_of_core``, ``"posterior"`` also has ``"plain_out_of_core"`` and
        ``"cv_out_of_core"``, the same figures out of core; ``"bias"``: ``rows`` (one
        dict per variant and eps) and the exact reference; ``"seconds"``;
        ``"approximate": True``.
    """
    ns = [int(n) for n in ns]
    if len(ns) < 2:
        raise ValueError("ns needs at least two sizes to fit a slope")
    if paper:
        return run_paper_fig5(ns, seed=seed, n_shards=n_shards)
    variants = _variants(control_variates, plain)
    t0 = time.perf_counter()
    model = LogisticRegression()
    v = np.ones(n_features) / math.sqrt(n_features)
    local = isinstance(client, str) and client == "synchronous"
    need_dir = (not local or out_of_core) and workdir is None
    tmpdir = tempfile.TemporaryDirectory() if need_dir else None
    tmp = workdir if workdir is not None else (tmpdir.name if tmpdir is not None else None)
    cluster, owned = None, False
    if not local:  # one client (and embedded cluster, for None) for the whole benchmark
        client, cluster, owned = client_from(client, None)
    fix_rows: dict[bool, dict[str, list]] = {cv: {} for cv in variants}
    post_rows: dict[bool, dict[str, list]] = {cv: {} for cv in variants}
    ooc_rows: dict[bool, dict[str, list]] = {cv: {} for cv in variants}
    try:
        log_u = -stream(seed, ROLE_AUSTERITY, _BENCH, 2).standard_exponential(n_decisions)
        for n in ns:
            data, theta0 = _dataset(n, n_features, seed, client, tmp, store=out_of_core)
            if fixed:
                exact_accept = None
                for cv in variants:
                    t = time.perf_counter()
                    r = run_decisions(
                        model,
                        data,
                        theta0,
                        theta0 + distance * v,
                        log_u,
                        eps=eps,
                        batch_size=batch_size,
                        seed=seed,
                        n_shards=n_shards,
                        client=client,
                        exact=exact_accept is None,
                        control_variates=cv,
                    )
                    if exact_accept is None:
                        exact_accept = r["exact_accept"]
                    row = r["by_eps"][0]
                    _append(
                        fix_rows[cv],
                        {
                            "mean_data_used": row["mean_data_used"],
                            "fraction": row["fraction"],
                            "mean_rounds": float(row["rounds"].mean()),
                            "error_rate": float(np.mean(row["accept"] != exact_accept)),
                            "seconds": time.perf_counter() - t,
                        },
                    )
            if posterior:
                for cv in variants:
                    modes = [(post_rows, False)] + ([(ooc_rows, True)] if out_of_core else [])
                    for rows, ooc in modes:
                        if not cv and n > plain_max_n:
                            _append(rows[cv], None)
                            continue
                        _append(
                            rows[cv],
                            _posterior_run(
                                model,
                                data,
                                n,
                                cv,
                                eps=posterior_eps,
                                batch_size=batch_size,
                                warmup=posterior_warmup,
                                samples=posterior_samples,
                                chains=posterior_chains,
                                seed=seed,
                                n_shards=n_shards,
                                client=client,
                                out_of_core=ooc if out_of_core else "auto",
                            ),
                        )
            del data
        common = {
            "ns": ns,
            "n_features": int(n_features),
            "n_shards": int(n_shards),
            "batch_size": int(batch_size),
        }
        fixed_out = None
        if fixed:
            fixed_out = {
                **common,
                "eps": float(eps),
                "distance": float(distance),
                "n_decisions": int(n_decisions),
                "plain": None,
                "cv": None,
            }
            for cv, rows in fix_rows.items():
                fixed_out[_key(cv)] = {**rows, "slope": _slope(ns, rows["mean_data_used"])}
        post_out = None
        if posterior:
            post_out = {
                **common,
                "eps": float(posterior_eps),
                "warmup": int(posterior_warmup),
                "samples": int(posterior_samples),
                "chains": int(posterior_chains),
                "plain_max_n": int(plain_max_n),
                "plain": None,
                "cv": None,
                **({"plain_out_of_core": None, "cv_out_of_core": None} if out_of_core else {}),
            }
            for cv, rows in post_rows.items():
                post_out[_key(cv)] = {**rows, "slope": _slope(ns, rows["mean_data_used"])}
                if out_of_core:
                    ooc = ooc_rows[cv]
                    post_out[_key(cv) + "_out_of_core"] = {
                        **ooc,
                        "slope": _slope(ns, ooc["mean_data_used"]),
                    }
        bias = None
        if bias_eps:
            bias = _bias_vs_eps(
                model,
                list(bias_eps),
                variants,
                bias_rows,
                n_features,
                seed,
                client,
                tmp,
                chains=bias_chains,
                warmup=bias_warmup,
                samples=bias_samples,
                batch_size=bias_batch_size,
                n_shards=bias_shards,
                error_moves=error_moves,
            )
    finally:
        if owned:
            client.close()
            if cluster is not None:
                cluster.close()
        if tmpdir is not None:
            tmpdir.cleanup()
    return {
        "approximate": True,
        "fixed": fixed_out,
        "posterior": post_out,
        "bias": bias,
        "seconds": time.perf_counter() - t0,
    }


#: the per-N figures of a posterior-scaled run (None where skipped)
_POSTERIOR_KEYS = (
    "mean_data_used",
    "median_data_used",
    "max_data_used",
    "fraction",
    "exact_fraction",
    "acceptance",
    "step_size",
    "seconds",
    "setup_seconds",
    "seconds_per_iteration",
    "bytes_read_per_iteration",
)


def _append(rows: dict[str, list], figures: dict[str, Any] | None) -> None:
    """Append one N's figures to per-key lists (None for every key when skipped)."""
    keys = figures.keys() if figures is not None else (rows.keys() or _POSTERIOR_KEYS)
    for k in keys:
        rows.setdefault(k, []).append(None if figures is None else figures[k])


def _posterior_run(
    model: LogisticRegression,
    data: Any,
    n_rows: int,
    cv: bool,
    *,
    eps: float,
    batch_size: int,
    warmup: int,
    samples: int,
    chains: int,
    seed: int,
    n_shards: int,
    client: Any,
    out_of_core: bool | str = "auto",
) -> dict[str, Any]:
    """One austerity run as a user makes it (default adaptation); its data use per decision."""
    t = time.perf_counter()
    res = sample(
        model,
        data,
        Austerity(eps=eps, batch_size=batch_size, control_variates=cv),
        num_warmup=warmup,
        num_samples=samples,
        chains=chains,
        seed=seed,
        client=client,
        placement=Placement(n_shards=n_shards, out_of_core=out_of_core),
        progress=False,
    )
    secs = time.perf_counter() - t
    used = res.stats["data_used"]
    iterations = warmup + samples
    info = res.info
    return {
        "mean_data_used": float(used.mean()),
        "median_data_used": float(np.median(used)),
        "max_data_used": int(used.max()),
        "fraction": float(used.mean() / n_rows),
        "exact_fraction": float(res.info["exact_fraction"]),
        "acceptance": float(res.stats["accepted"].mean()),
        "step_size": float(res.info["kernel_params"][0]["step_size"]),
        "seconds": secs,
        "setup_seconds": float(info["setup_seconds"]),
        "seconds_per_iteration": (info["warmup_seconds"] + info["sampling_seconds"]) / iterations,
        "bytes_read_per_iteration": (info["bytes_read"] - info["setup_bytes_read"]) / iterations,
    }


def _bias_vs_eps(
    model: LogisticRegression,
    eps_list: list[float],
    variants: list[bool],
    n_rows: int,
    n_features: int,
    seed: int,
    client: Any,
    tmp: str | None,
    *,
    chains: int,
    warmup: int,
    samples: int,
    batch_size: int,
    n_shards: int,
    error_moves: int,
) -> dict[str, Any]:
    """Posterior-mean error and per-decision error rate of austerity MH at each eps."""
    data, _ = _dataset(n_rows, n_features, seed, client, tmp)
    common = {
        "num_warmup": warmup,
        "num_samples": samples,
        "chains": chains,
        "seed": seed,
        "client": client,
        "placement": Placement(n_shards=n_shards),
        "progress": False,
    }
    t = time.perf_counter()
    # exact RWMH: its adapted step and covariance make the moves the decisions are tried on
    ref = sample(model, data, Regular(), "rwmh", **common)
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
    props = np.stack(
        [th + step * tril_matvec(tril, mrng.standard_normal(th.size)) for th in thetas]
    )
    log_u = -mrng.standard_exponential(error_moves)
    rows = []
    for cv in variants:
        dec = run_decisions(
            model,
            data,
            thetas,
            props,
            log_u,
            eps=eps_list,
            batch_size=batch_size,
            seed=seed,
            n_shards=n_shards,
            client=client,
            control_variates=cv,
        )
        for e, d in zip(eps_list, dec["by_eps"], strict=True):
            t = time.perf_counter()
            res = sample(
                model,
                data,
                Austerity(eps=e, batch_size=batch_size, control_variates=cv),
                **common,
            )
            secs = time.perf_counter() - t
            af = res.samples.reshape(chains, samples, -1)
            a_mean = af.mean(axis=(0, 1))
            a_mcse = np.asarray(diagnostics.mcse_mean(af))
            se = np.sqrt(a_mcse**2 + ref_mcse**2)
            z = (a_mean - ref_mean) / ref_sd
            rows.append(
                {
                    "control_variates": cv,
                    "eps": e,
                    "mean_error_sd": float(np.max(np.abs(z))),  # max over parameters, in sd
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
                }
            )
    return {
        "n_rows": n_rows,
        "chains": chains,
        "num_warmup": warmup,
        "num_samples": samples,
        "batch_size": batch_size,
        "exact_mean": ref_mean.tolist(),
        "exact_sd": ref_sd.tolist(),
        "exact_acceptance": float(ref.stats["accepted"].mean()),
        "exact_seconds": ref_secs,
        "error_moves": error_moves,
        "rows": rows,
    }


def _f(value: float | None, spec: str, width: int) -> str:
    """``value`` formatted, or a dash where it was not measured."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def _at(part: dict[str, Any], key: str, name: str, i: int) -> Any:
    """Figure ``name`` at the ``i``-th N of variant ``key`` (None: not measured)."""
    sub = part.get(key)
    return None if sub is None else sub[name][i]


def _slope_line(part: dict[str, Any]) -> str:
    out = []
    for key, name in (("plain", "plain"), ("cv", "control variates")):
        if part.get(key) is not None:
            sl = part[key]["slope"]
            out.append(f"{name} {'-' if sl is None else f'{sl:.3f}'}")
    return "log-log slope of rows per decision on N: " + ", ".join(out)


def run_paper_fig5(ns: Sequence[int], *, seed: int = 0, n_shards: int = 4) -> dict[str, Any]:
    """The sublinear-MH paper's Fig. 5 settings: plain austerity (no control variates) on
    logistic data with two synthetic features and a bias, prior N(0, 0.1·I), eps = 0.01
    one-sided (the paper's; a two-sided 0.02), minibatches of 100 with no test before 3
    of them, a random-walk proposal of sd 0.1 (identity preconditioner, no adaptation),
    300 iterations of one chain from the generating θ₀, in this process.

    Beside the rows measured, Korattikara et al.'s expected rows (their Eq. 19,
    :func:`~flymc_dist.austerity.sampler.expected_data_used`) at the chain's own states:
    at ``PREDICTION_STATES`` evenly spaced draws ``θ_t`` of the run, a proposal ``θ′ =
    θ_t + 0.1·ξ`` (``ξ`` standard normal) and a ``log u = −Exp(1)``, both drawn here from
    a fixed-seed generator — the bench's own proposals at the chain's states, not the
    run's (the run does not record its proposals) — every row's ``l_i = log p(y_i|θ′) −
    log p(y_i|θ_t)`` over the whole data set, their mean and population sd, ``μ₀ =
    (log u + log p(θ_t) − log p(θ′))/N`` as the sampler forms it, and the expectation
    averaged over the states.

    Returns
    -------
    dict
        ``paper: True``, the settings, and per N the mean and median rows per decision,
        their fraction of N, the acceptance rate and the seconds (of the run alone);
        ``predicted_data_used`` (the expected rows averaged over the states),
        ``predicted_over_measured`` (its ratio to ``mean_data_used``), and the standard
        errors of both means (``mean_data_used_se``: of the 300 decisions, as if
        independent; ``predicted_se``: over the states); ``slope`` of the mean rows
        against N (log-log); ``prediction``: how the prediction was made.
    """
    alg = Austerity(eps=0.01, tails="one", min_batches=3, batch_size=100, control_variates=False)
    model = LogisticRegression(prior="normal", prior_scale=math.sqrt(0.1))
    step = 0.1
    rows = []
    for n in ns:
        X, y, theta0 = logistic_data(int(n), 3, seed)
        t0 = time.perf_counter()
        res = sample(
            model,
            (X, y),
            alg,
            RandomWalkMH(step_size=step),
            placement=Placement(n_shards=min(n_shards, int(n))),
            num_warmup=0,
            num_samples=300,
            chains=1,
            seed=seed,
            client="synchronous",
            init=theta0,
            precondition=np.eye(3),
            progress=False,
        )
        secs = time.perf_counter() - t0
        used = res.stats["data_used"].ravel()
        pred = _expected_rows_at_states(model, X, y, res.samples[0], alg, step, seed)
        rows.append(
            {
                "n_rows": int(n),
                "mean_data_used": float(used.mean()),
                "median_data_used": float(np.median(used)),
                "fraction": float(used.mean() / n),
                "acceptance": float(res.stats["accepted"].mean()),
                "seconds": secs,
                "predicted_data_used": float(pred.mean()),
                "predicted_over_measured": float(pred.mean() / used.mean()),
                "mean_data_used_se": float(used.std(ddof=1) / math.sqrt(used.size)),
                "predicted_se": float(pred.std(ddof=1) / math.sqrt(pred.size)),
            }
        )
    return {
        "paper": True,
        "approximate": True,
        "settings": "eps=0.01 one-sided, batch 100, k0=3, proposal sd 0.1, 300 iterations, "
        "prior N(0, 0.1 I), D=2 + bias, plain austerity",
        "prediction": f"Korattikara et al.'s expected rows (Eq. 19) at {PREDICTION_STATES} "
        "evenly spaced states of the chain, for proposals and u drawn by the bench from "
        "them (not the run's: it does not record its proposals)",
        "rows": rows,
        "slope": loglog_slope(ns, [r["mean_data_used"] for r in rows]),
    }


def _expected_rows_at_states(
    model: LogisticRegression,
    X: np.ndarray,
    y: np.ndarray,
    draws: np.ndarray,
    alg: Austerity,
    step: float,
    seed: int,
) -> np.ndarray:
    """Korattikara et al.'s expected rows of one decision at each of
    ``PREDICTION_STATES`` evenly spaced ``draws`` (one chain's, ``(S, P)``), for a
    random-walk proposal of sd ``step`` (identity preconditioner) and a ``u`` drawn here,
    from a generator keyed by ``(seed, N)``: every row's log-likelihood difference, its
    mean, population sd and the sampler's threshold ``μ₀``."""
    N = X.shape[0]
    at = np.unique(np.linspace(0, draws.shape[0] - 1, PREDICTION_STATES).round().astype(int))
    thetas = np.asarray(draws, float)[at]
    rng = stream(seed, ROLE_AUSTERITY, _BENCH, 4, N)
    props = thetas + step * rng.standard_normal(thetas.shape)
    log_u = -rng.standard_exponential(at.size)
    mu, sigma = np.empty(at.size), np.empty(at.size)
    for k in range(at.size):
        pair = np.stack([thetas[k], props[k]])
        ll = model.loglik(model.linear_predictor(pair, X), y)  # (2, N)
        diff = ll[1] - ll[0]
        mu[k], sigma[k] = diff.mean(), diff.std()
    # the sampler's threshold (symmetric proposal: no q term)
    mu0 = (log_u + model.log_prior(thetas) - model.log_prior(props)) / N
    return expected_data_used(
        mu,
        sigma,
        mu0,
        N,
        batch_size=alg.batch_size,
        min_batches=alg.min_batches,
        eps=alg.eps,
        tails=alg.tails,
    )


def _format_paper(result: dict[str, Any]) -> str:
    lines = [
        "APPROXIMATE (austerity MH): sequential-test decisions, not exact MH.",
        f"The sublinear-MH paper's Fig. 5 settings: {result['settings']}",
    ]
    if "prediction" in result:
        lines.append(f"predicted: {result['prediction']}")
    lines.append(
        f"{'N':>10} {'rows/decision':>14} {'median':>8} {'fraction':>9} {'accept':>7} "
        f"{'secs':>7} {'predicted':>10} {'pred/meas':>9} {'se meas':>8} {'se pred':>8}"
    )
    for r in result["rows"]:
        lines.append(
            f"{r['n_rows']:>10,d} {r['mean_data_used']:>14.1f} {r['median_data_used']:>8.0f} "
            f"{r['fraction']:>9.4f} {r['acceptance']:>7.3f} {r['seconds']:>7.1f} "
            f"{_f(r.get('predicted_data_used'), '.1f', 10)} "
            f"{_f(r.get('predicted_over_measured'), '.3f', 9)} "
            f"{_f(r.get('mean_data_used_se'), '.1f', 8)} {_f(r.get('predicted_se'), '.1f', 8)}"
        )
    if "prediction" in result:
        lines.append(
            "(se meas: of the mean over the run's decisions, as if independent; se pred: "
            "over the states)"
        )
    lines.append(f"log-log slope of rows per decision against N: {result['slope']:.3f}")
    return "\n".join(lines)


def format_sublinear(result: dict[str, Any]) -> str:
    """The report of :func:`run_sublinear` as text."""
    if result.get("paper"):
        return _format_paper(result)
    lines = ["APPROXIMATE (austerity MH): sequential-test decisions, not exact MH."]
    f = result.get("fixed")
    if f:
        lines += [
            "",
            f"Fixed move: data used per decision vs N  (logistic, D={f['n_features']}, move of "
            f"length {f['distance']:g}, eps={f['eps']:g}, batch={f['batch_size']}, "
            f"{f['n_decisions']} decisions, {f['n_shards']} shards)",
            f"{'':>12} {' plain ':-^35}   {' control variates ':-^35}",
            f"{'N':>12} {'rows used':>11} {'fraction':>9} {'err':>6} {'secs':>6}   "
            f"{'rows used':>11} {'fraction':>9} {'err':>6} {'secs':>6}",
        ]
        for i, n in enumerate(f["ns"]):
            cells = []
            for key in ("plain", "cv"):
                cells.append(
                    f"{_f(_at(f, key, 'mean_data_used', i), '.1f', 11)} "
                    f"{_f(_at(f, key, 'fraction', i), '.4f', 9)} "
                    f"{_f(_at(f, key, 'error_rate', i), '.3f', 6)} "
                    f"{_f(_at(f, key, 'seconds', i), '.1f', 6)}"
                )
            lines.append(f"{n:>12,d} " + "   ".join(cells))
        lines.append(_slope_line(f))
    p = result.get("posterior")
    if p:
        lines += [
            "",
            f"Posterior-scaled proposal: RWMH with the default warm-up adaptation, "
            f"{p['warmup']} + {p['samples']} iterations x {p['chains']} chains, "
            f"eps={p['eps']:g}, batch={p['batch_size']}; rows per decision after warm-up "
            f"(mean, median, max) and the seconds of the whole run",
            f"{'':>12} {' plain ':-^41}   {' control variates ':-^41}",
            f"{'N':>12} {'mean':>9} {'median':>7} {'max':>9} {'accept':>6} {'secs':>6}   "
            f"{'mean':>9} {'median':>7} {'max':>9} {'accept':>6} {'secs':>6} {'cv/plain':>9}",
        ]
        for i, n in enumerate(p["ns"]):
            cells = []
            for key in ("plain", "cv"):
                cells.append(
                    f"{_f(_at(p, key, 'mean_data_used', i), '.1f', 9)} "
                    f"{_f(_at(p, key, 'median_data_used', i), '.0f', 7)} "
                    f"{_f(_at(p, key, 'max_data_used', i), ',d', 9)} "
                    f"{_f(_at(p, key, 'acceptance', i), '.3f', 6)} "
                    f"{_f(_at(p, key, 'seconds', i), '.1f', 6)}"
                )
            a = _at(p, "plain", "mean_data_used", i)
            c = _at(p, "cv", "mean_data_used", i)
            ratio = None if a is None or c is None else c / a
            lines.append(f"{n:>12,d} " + "   ".join(cells) + f" {_f(ratio, '.4f', 9)}")
        lines.append(_slope_line(p))
        if p.get("cv_out_of_core") is not None or p.get("plain_out_of_core") is not None:
            lines += [
                "Out of core (the same runs with their shards forced out of core, each right "
                "after its in-memory run, from one store): seconds and MB read per iteration",
                f"{'':>12} {' plain ':-^36}   {' control variates ':-^36}",
                f"{'N':>12} {'ms/it mem':>9} {'ms/it ooc':>9} {'ratio':>7} {'MB/it':>8}   "
                f"{'ms/it mem':>9} {'ms/it ooc':>9} {'ratio':>7} {'MB/it':>8}",
            ]
            for i, n in enumerate(p["ns"]):
                cells = []
                for key in ("plain", "cv"):
                    mem = _at(p, key, "seconds_per_iteration", i)
                    ooc = _at(p, key + "_out_of_core", "seconds_per_iteration", i)
                    mb = _at(p, key + "_out_of_core", "bytes_read_per_iteration", i)
                    cells.append(
                        f"{_f(None if mem is None else 1e3 * mem, '.2f', 9)} "
                        f"{_f(None if ooc is None else 1e3 * ooc, '.2f', 9)} "
                        f"{_f(None if mem is None or ooc is None else ooc / mem, '.1f', 7)} "
                        f"{_f(None if mb is None else mb / 1e6, '.2f', 8)}"
                    )
                lines.append(f"{n:>12,d} " + "   ".join(cells))
        if p.get("plain") is not None and any(n > p["plain_max_n"] for n in p["ns"]):
            lines.append(
                f"(plain austerity skipped above N = {p['plain_max_n']:,d}: it uses a "
                f"near constant fraction of the rows per decision; raise "
                f"--plain-max-n to run it)"
            )
    b = result.get("bias")
    if b:
        lines += [
            "",
            f"Bias vs eps  ({b['n_rows']:,d} rows; {b['chains']} chains x {b['num_samples']} "
            f"draws after {b['num_warmup']} warm-up; batch={b['batch_size']}; reference: "
            f"exact regular MH)",
            f"{'CV':>5} {'eps':>6} {'|dmean|/sd':>11} {'MC se/sd':>9} {'sd ratio':>9} "
            f"{'data frac':>10} {'exact':>6} {'accept':>7} {'RT/iter':>8} {'dec err':>8} "
            f"{'secs':>6}",
        ]
        for r in b["rows"]:
            lines.append(
                f"{'yes' if r['control_variates'] else 'no':>5} "
                f"{r['eps']:>6g} {r['mean_error_sd']:>11.3f} {r['mc_se_sd']:>9.3f} "
                f"{min(r['sd_ratio']):>4.2f}-{max(r['sd_ratio']):<4.2f} "
                f"{r['data_used_fraction']:>10.3f} {r['exact_fraction']:>6.2f} "
                f"{r['acceptance']:>7.3f} {r['round_trips_per_iteration']:>8.2f} "
                f"{r['decision_error_rate']:>8.4f} {r['seconds']:>6.1f}"
            )
        lines.append(
            f"(|dmean|/sd: largest over parameters; 'dec err': share of "
            f"{b['error_moves']} RWMH-like moves decided differently from exact MH)"
        )
    lines.append(f"total {result['seconds']:.1f} s")
    return "\n".join(lines)


#: the name the CLI uses
format = format_sublinear  # noqa: A001 - module-level API name chosen by the CLI
