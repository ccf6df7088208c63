"""Answers out of a run: the posterior predictive (:func:`predict`), per-row
log-likelihoods (:func:`log_likelihood`) and LOO at scale (:func:`loo`, :func:`compare`).

LOO by subsampling (Magnusson, Andersen, Jonasson & Vehtari 2019): every row gets a cheap
surrogate ``π̃_i`` of its LOO predictive density, and PSIS-LOO (Vehtari, Simpson, Gelman,
Yao & Gabry 2024) is computed exactly on a simple random sample of ``m`` rows only; the
difference estimator ``Σ π̃_i + N · mean_j (elpd_j − π̃_j)`` is unbiased for the full
PSIS-LOO elpd whatever the surrogate, and the better the surrogate the smaller its
subsampling variance. The surrogate: each row's log-likelihood expanded to second order in
its linear predictor at the posterior mean, integrated against the posterior's Gaussian
approximation in closed form (``−log E[1/p(y_i | θ)]``): one pass over the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.special import logsumexp

__all__ = ["compare", "log_likelihood", "loo", "predict", "psis"]


# --------------------------------------------------------------------------- PSIS


#: elements of the largest temporary array a batch of Pareto fits makes
_GPD_BATCH_ELEMENTS = 1 << 22


def _gpd_fit(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Generalized Pareto shape and scale of each row of exceedances ``x`` (``(B, M)``,
    each row sorted ascending) by Zhang & Stephens (2009)'s empirical Bayes estimate, with
    the weakly informative prior on the shape of Vehtari et al. (2024) (towards 0.5, worth
    10 observations)."""
    n = x.shape[1]
    m = 30 + int(np.sqrt(n))
    b = 1.0 - np.sqrt(m / (np.arange(1, m + 1, dtype=float) - 0.5))
    b = b / (3.0 * x[:, int(n / 4 + 0.5) - 1 : int(n / 4 + 0.5)])  # (B, m)
    b += 1.0 / x[:, -1:]
    k = np.log1p(-b[:, :, None] * x[:, None, :]).mean(axis=2)
    profile = n * (np.log(-(b / k)) - k - 1.0)
    w = 1.0 / np.exp(profile[:, None, :] - profile[:, :, None]).sum(axis=2)
    w = np.where(w >= 10 * np.finfo(float).eps, w, 0.0)
    w /= w.sum(axis=1, keepdims=True)
    b_post = np.sum(b * w, axis=1)
    k_post = np.log1p(-b_post[:, None] * x).mean(axis=1)
    sigma = -k_post / b_post
    k_post = (n * k_post + 10 * 0.5) / (n + 10)
    return k_post, sigma


def _largest(rows: np.ndarray, K: int) -> np.ndarray:
    """The last ``K`` of each row's stable ascending argsort (the ``K`` largest entries,
    ties in index order), found by a partition: ``(B, K)`` indices."""
    S = rows.shape[1]
    part = np.argpartition(rows, S - K, axis=1)[:, S - K :]
    vals = np.take_along_axis(rows, part, axis=1)
    order = np.lexsort((part, vals), axis=1)
    top = np.take_along_axis(part, order, axis=1)
    # a row with its K-th largest value tied outside the K, or with NaN, where the
    # partition's choice among the ties may not be the stable sort's: sorted in full
    v = np.take_along_axis(vals, order[:, :1], axis=1)
    ties = (rows == v).sum(axis=1) != (vals == v).sum(axis=1)
    for i in np.flatnonzero(ties | np.isnan(v[:, 0]) | np.isnan(vals).any(axis=1)).tolist():
        top[i] = np.argsort(rows[i], kind="stable")[-K:]
    return top


def psis(log_ratios: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pareto-smoothed importance sampling (Vehtari et al. 2024) of each column.

    Parameters
    ----------
    log_ratios : ndarray, shape (S, n)
        Log importance ratios, one column per target (for LOO: ``−log p(y_i | θ_s)``).

    Returns
    -------
    log_weights : ndarray, shape (S, n)
        Smoothed, normalised log weights.
    k : ndarray, shape (n,)
        The Pareto shape estimates k̂ (above 0.7: unreliable; NaN: too few draws, or a
        quarter of the tail tied, as repeated draws of a Metropolis chain give; those
        columns' weights are left unsmoothed).
    """
    lr = np.asarray(log_ratios, dtype=np.float64)
    S, n = lr.shape
    M = int(min(np.ceil(0.2 * S), np.ceil(3 * np.sqrt(S))))
    out = lr - lr.max(axis=0)
    ks = np.full(n, np.nan)
    if M >= 5 and S > M:
        p = (np.arange(1, M + 1) - 0.5) / M
        per = max(1, _GPD_BATCH_ELEMENTS // ((30 + int(np.sqrt(M))) * M))
        for lo in range(0, n, per):  # columns in batches: the fit's temporaries bounded
            cols = out[:, lo : lo + per]
            top = _largest(np.ascontiguousarray(cols.T), M + 1).T  # (M + 1, columns)
            tail = top[1:]
            cutoff = np.take_along_axis(cols, top[:1], axis=0)[0]
            x = np.exp(np.take_along_axis(cols, tail, axis=0)) - np.exp(cutoff)
            # a tail of ties (repeated draws of a Metropolis chain): unsmoothed
            fit = np.flatnonzero(np.all(np.isfinite(x), axis=0) & (x[int(M / 4 + 0.5) - 1] > 0))
            if not fit.size:
                continue
            k, sigma = _gpd_fit(x[:, fit].T)
            ks[lo + fit] = k
            smooth = np.isfinite(k) & (sigma > 0)
            fit, k, sigma = fit[smooth], k[smooth, None], sigma[smooth, None]
            k_safe = np.where(k == 0, 1.0, k)
            q = np.where(
                k == 0,
                -sigma * np.log1p(-p),
                sigma / k_safe * np.expm1(-k * np.log1p(-p)),
            )  # (columns, M): the fitted tail's quantiles
            smoothed = np.minimum(np.log(np.exp(cutoff[fit, None]) + q), 0.0)
            part = cols[:, fit]
            np.put_along_axis(part, tail[:, fit], smoothed.T, axis=0)
            cols[:, fit] = part
    out -= logsumexp(out, axis=0)
    return out, ks


# --------------------------------------------------------------------------- per row


def _flat(samples: np.ndarray) -> np.ndarray:
    C, S = samples.shape[:2]
    return samples.reshape(C * S, -1)


def _eta(model: Any, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Linear predictors ``(B, n, E)`` of flattened draws ``theta (B, P)``."""
    return model.linear_predictor(np.ascontiguousarray(theta), np.ascontiguousarray(X))


def log_likelihood(
    model: Any, samples: np.ndarray, X: np.ndarray, y: np.ndarray, block: int = 4096
) -> np.ndarray:
    """``log p(y_i | θ_s)`` of every draw and row: ``(chains, draws, n)``."""
    C, S = samples.shape[:2]
    theta = _flat(samples)
    out = np.empty((C * S, X.shape[0]))
    for s in range(0, X.shape[0], block):
        e = min(s + block, X.shape[0])
        out[:, s:e] = model.loglik(_eta(model, theta, X[s:e]), y[s:e])
    return out.reshape(C, S, X.shape[0])


def _surrogate(
    model: Any, mean: np.ndarray, cov: np.ndarray, X: np.ndarray, y: np.ndarray
) -> np.ndarray:
    """Each row's approximate LOO log predictive density (see the module docstring)."""
    E = model.n_outputs
    D = X.shape[1]
    m = _eta(model, mean[None, :], X)[0]  # (n, E)
    a, b = model.loglik_grad(m[None], y)
    a, b = a[0], b[0]  # (n,), (n, E)
    H = model.loglik_hess(m, y)  # (n, E, E)
    Sig = cov.reshape(E, D, E, D)
    Sv = np.einsum("nd,kdle,ne->nkl", X, Sig, X)  # (n, E, E): Var of the linear predictors
    eye = np.eye(E)
    M = eye + Sv @ H
    sign, logdet = np.linalg.slogdet(M)
    ok = sign > 0
    Sb = np.einsum("nkl,nl->nk", Sv, b)
    quad = np.full(X.shape[0], np.nan)
    if ok.any():
        sol = np.linalg.solve(M[ok], Sb[ok][..., None])[..., 0]
        quad[ok] = np.einsum("nk,nk->n", b[ok], sol)
    first = np.einsum("nk,nk->n", b, Sb)  # first order only, where the quadratic fails
    out = np.where(ok, a + 0.5 * np.where(ok, logdet, 0.0) - 0.5 * quad, a - 0.5 * first)
    return out


def loo(
    model: Any,
    samples: np.ndarray,
    data: Any,
    *,
    n_subsample: int = 400,
    seed: int = 0,
    block: int = 65536,
) -> dict[str, Any]:
    """PSIS-LOO's elpd estimated from a random subsample of rows (module docstring).

    Parameters
    ----------
    model : Model
        The run's model.
    samples : ndarray
        Draws ``(chains, draws) + param_shape``.
    data : Dataset
        The data the run sampled.
    n_subsample : int, default 400
        Rows on which PSIS-LOO is computed exactly (all of them if N is smaller).
    seed : int, default 0
        Seed of the subsample.
    block : int, default 65536
        Rows read at a time in the surrogate's pass.

    Returns
    -------
    dict
        ``elpd_loo`` (the estimate), ``se`` (the standard error of elpd_loo as full
        PSIS-LOO reports it, estimated from the subsample), ``subsampling_se`` (the
        estimate's standard error from subsampling alone), ``p_loo`` (the effective number
        of parameters, estimated the same way), ``n_rows``, ``n_subsample``, ``rows`` (the
        sampled rows), ``pareto_k`` (their k̂), ``n_bad_k`` (how many above 0.7).
    """
    if isinstance(n_subsample, bool) or not isinstance(n_subsample, int | np.integer):
        raise ValueError(f"n_subsample must be a positive integer, got {n_subsample!r}")
    if n_subsample < 2:
        raise ValueError(f"n_subsample must be >= 2, got {n_subsample}")
    N = int(data.n_rows)
    theta = _flat(samples)
    mean = theta.mean(axis=0)
    cov = np.atleast_2d(np.cov(theta, rowvar=False))
    # one pass: the surrogate of every row, and the log-likelihood at the mean (for p_loo)
    approx = np.empty(N)
    at_mean = np.empty(N)
    for s in range(0, N, block):
        X, y = data.read(s, min(s + block, N))
        approx[s : s + X.shape[0]] = _surrogate(model, mean, cov, X, y)
        at_mean[s : s + X.shape[0]] = model.loglik(_eta(model, mean[None, :], X), y)[0]
    m = min(int(n_subsample), N)
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(N, size=m, replace=False))
    X, y = data.read_rows(rows)
    ll = log_likelihood(model, samples, X, y).reshape(theta.shape[0], m)
    lw, k = psis(-ll)
    elpd = logsumexp(lw + ll, axis=0)
    lpd = logsumexp(ll, axis=0) - np.log(ll.shape[0])
    est, v_est, se2 = _diff_est(approx, elpd, rows)
    # p_loo = lpd − elpd_loo, with lpd's surrogate the log-likelihood at the mean
    lpd_est, _, _ = _diff_est(at_mean, lpd, rows)
    return {
        "elpd_loo": float(est),
        "se": float(np.sqrt(max(se2, 0.0))),
        "subsampling_se": float(np.sqrt(max(v_est, 0.0))),
        "p_loo": float(lpd_est - est),
        "n_rows": N,
        "n_subsample": m,
        "rows": rows,
        "pareto_k": k,
        "n_bad_k": int(np.sum(k > 0.7)),
        "elpd_rows": elpd,
    }


def _diff_est(
    approx: np.ndarray, exact: np.ndarray, rows: np.ndarray
) -> tuple[float, float, float]:
    """Magnusson et al. (2019)'s difference estimator under simple random sampling without
    replacement: the total, its subsampling variance, and the estimated ``N · Var(elpd_i)``
    (the square of full PSIS-LOO's reported SE)."""
    N, m = approx.size, exact.size
    a = approx[rows]
    e = exact - a
    total = approx.sum() + N * e.mean()
    var_e = e.var(ddof=1) if m > 1 else 0.0
    v_total = N * N * (1.0 - m / N) * var_e / m
    sum_sq = np.sum(approx**2) + N * np.mean(exact**2 - a**2)
    se2 = sum_sq - (total**2 - v_total) / N
    return float(total), float(v_total), float(se2)


def compare(results: dict[str, dict[str, Any]] | Sequence[dict[str, Any]]) -> list[dict]:
    """Rank LOO estimates (:meth:`flymc_dist.Result.loo`'s) by elpd.

    Parameters
    ----------
    results : dict of name to loo output, or a sequence of them
        Estimates on the same rows.

    Returns
    -------
    list of dict
        One per model, best first: ``name``, ``elpd_loo``, ``se``, ``elpd_diff`` (from the
        best), ``diff_se`` (the SE of that difference from the rows both subsamples share,
        by the same difference estimator; NaN when they share fewer than 2).
    """
    items = dict(results) if isinstance(results, dict) else dict(enumerate(results))
    if len(items) < 2:
        raise ValueError("compare needs two or more LOO estimates")
    ns = {v["n_rows"] for v in items.values()}
    if len(ns) != 1:
        raise ValueError(f"the estimates are on different numbers of rows: {sorted(ns)}")
    order = sorted(items, key=lambda k: -items[k]["elpd_loo"])
    best = items[order[0]]
    out = []
    for name in order:
        r = items[name]
        common, ia, ib = np.intersect1d(best["rows"], r["rows"], return_indices=True)
        if name == order[0]:
            dse = 0.0
        elif common.size >= 2:
            d = best["elpd_rows"][ia] - r["elpd_rows"][ib]
            dse = float(np.sqrt(r["n_rows"] * d.var(ddof=1)))
        else:
            dse = float("nan")
        out.append(
            {
                "name": name,
                "elpd_loo": r["elpd_loo"],
                "se": r["se"],
                "elpd_diff": r["elpd_loo"] - best["elpd_loo"],
                "diff_se": dse,
            }
        )
    return out


# --------------------------------------------------------------------------- predict


def predict(
    model: Any,
    samples: np.ndarray,
    X: np.ndarray,
    *,
    draws: bool = False,
    interval: float = 0.9,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """The posterior predictive at rows ``X`` (already in the model's features).

    Parameters
    ----------
    model : Model
        The run's model.
    samples : ndarray
        Draws ``(chains, draws) + param_shape``.
    X : ndarray, shape (n, D)
        Rows.
    draws : bool, default False
        Also return the per-draw values (``"draws"``, ``(chains · draws, n[, K])``:
        probabilities, or for regression one predictive draw of y per posterior draw).
    interval : float, default 0.9
        Regression: the central posterior predictive interval's mass.
    seed : int, default 0
        Regression: the seed of the predictive draws of y.

    Returns
    -------
    dict
        Binary: ``"probability"`` (of class 1, ``(n,)``: the family's inverse link,
        ``σ(η)`` or probit's ``Φ(η)``); multiclass: ``"probability"`` ``(n, K)``; counts
        and real targets: ``"mean"`` (``E[y | x]`` over the draws: the location, or a
        count family's ``e^η`` / ``m p``), ``"lower"``, ``"upper"`` (the interval of
        predictive draws of y, one per posterior draw).
    """
    if not 0.0 < float(interval) < 1.0:
        raise ValueError(f"interval must be in (0, 1), got {interval!r}")
    theta = _flat(samples)
    eta = _eta(model, theta, np.asarray(X, dtype=np.float64))  # (B, n, E)
    family = model.family
    task = model.task
    if task in ("binary", "multiclass"):
        p = family.mean(eta if task == "multiclass" else eta[..., 0])
        out = {"probability": p.mean(axis=0)}
    else:
        loc = eta[..., 0]
        p = family.draw(loc, np.random.default_rng(seed))
        lo = (1.0 - float(interval)) / 2.0
        out = {
            "mean": family.mean(loc).mean(axis=0),
            "lower": np.quantile(p, lo, axis=0),
            "upper": np.quantile(p, 1.0 - lo, axis=0),
        }
    if draws:
        out["draws"] = p
    return out
