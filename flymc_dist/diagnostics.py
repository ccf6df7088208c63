"""MCMC convergence and efficiency diagnostics.

Rank-normalised split-R̂, bulk and tail effective sample sizes (ESS) and Monte
Carlo standard errors, following Vehtari, Gelman, Simpson, Carpenter & Bürkner
(2021), "Rank-normalization, folding, and localization: an improved R̂ for
assessing convergence of MCMC", *Bayesian Analysis* 16(2), 667-718,
doi:10.1214/20-BA1221, with the numerical conventions of Stan / ``posterior`` /
ArviZ, so results agree with those packages for the same input:

* chains are split in two halves; with an odd number of draws the middle draw
  is dropped;
* rank normalisation uses average ranks for ties over *all* (split) draws and
  Blom's offset, ``z = Φ⁻¹((r − 3/8) / (S + 1/4))``;
* autocovariances are the biased (divide-by-n) estimates computed by FFT with
  zero padding to a fast length ≥ 2n;
* the autocorrelation sum is truncated by Geyer's initial positive sequence and
  smoothed by his initial monotone sequence, including the positive even lag of
  the first negative pair ("improved estimate"), and τ̂ is floored at
  ``1 / log10(S)`` so ESS ≤ S·log10(S).

Layers (STYLE 11): private cores take validated, finite ``(chains, draws)``
float arrays, stacked along a leading parameter axis as ``(P, chains, draws)``
so that FFTs, ranks and quantiles run vectorised over parameters, and return
one value per 2-D slice; public functions validate the input and options,
accept ``(chains, draws, *param_shape)`` and return one value per parameter.
Degenerate input (any NaN/±inf, or all draws of a parameter equal) gives NaN
for that parameter, never an exception; malformed input (wrong shape, fewer
than 4 draws per chain, bad ``prob``) raises ``ValueError``; a non-real dtype
raises ``TypeError``.

Deliberate differences from the reference packages (all on degenerate input):

* constant draws give NaN ESS (``posterior`` convention; ArviZ returns the
  number of draws); in the tail ESS, a constant quantile indicator (heavy
  ties) is skipped and the other tail's ESS used, which matches ArviZ;
* a single chain gets a (split) R̂ (Stan / ``posterior``); ArviZ returns NaN;
* ``mcse_sd`` follows ``posterior``: Kenney & Keeping's variance of the
  variance with the ESS of the squared centred draws (arviz-stats has used
  other variants over time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy import fft as _fft
from scipy import special as _special

__all__ = [
    "ess_bulk",
    "ess_tail",
    "ess_mean",
    "rhat",
    "mcse_mean",
    "mcse_sd",
    "summary",
    "format_summary",
    "SUMMARY_COLUMNS",
    "EBFMI_THRESHOLD",
    "e_bfmi",
    "hamiltonian_checks",
    "hamiltonian_lines",
]

#: Minimum number of draws per chain accepted by the public functions.
MIN_DRAWS = 4

#: Numeric columns of :func:`summary`, in display order.
SUMMARY_COLUMNS: tuple[str, ...] = (
    "mean",
    "sd",
    "mcse_mean",
    "q5",
    "q50",
    "q95",
    "ess_bulk",
    "ess_tail",
    "r_hat",
)

_BLOM_OFFSET = 3.0 / 8.0


# --------------------------------------------------------------------------------------------
# private cores: (chains, draws) arrays stacked along a leading parameter axis, i.e. shape
# (P, chains, draws), float64, finite (validated by the callers); each returns shape (P,).
# Every core treats each 2-D (chains, draws) slice independently.
# --------------------------------------------------------------------------------------------


def _is_constant(x: np.ndarray) -> np.ndarray:
    """Whether all draws of each parameter are equal up to a few ulps of their magnitude."""
    span = x.max(axis=(1, 2)) - x.min(axis=(1, 2))
    scale = np.abs(x).max(axis=(1, 2))
    return span <= 8.0 * np.finfo(np.float64).eps * scale


def _split_chains(x: np.ndarray) -> np.ndarray:
    """Split each chain into halves: ``(P, C, n) -> (P, 2C, n // 2)``, dropping a middle draw."""
    n = x.shape[2]
    half = n // 2
    return np.concatenate((x[:, :, :half], x[:, :, n - half :]), axis=1)


def _z_scale(x: np.ndarray) -> np.ndarray:
    """Rank-normalise the draws of each parameter jointly (average ties, Blom's offset)."""
    # scipy.stats costs about 0.5 s to import, in every process that imports flymc_dist
    # (each worker, each CLI call): only the diagnostics need it, and only this function
    from scipy.stats import rankdata

    n_params = x.shape[0]
    ranks = rankdata(x.reshape(n_params, -1), method="average", axis=1)
    size = x[0].size
    z = _special.ndtri((ranks - _BLOM_OFFSET) / (size - 2.0 * _BLOM_OFFSET + 1.0))
    return z.reshape(x.shape)


def _fold(x: np.ndarray) -> np.ndarray:
    """Fold around each parameter's median: ``|x − median(x)|``."""
    return np.abs(x - np.median(x, axis=(1, 2), keepdims=True))


def _quantile(x: np.ndarray, prob: float) -> np.ndarray:
    """Each parameter's quantile over all its draws (linear interpolation, H&F type 7)."""
    return np.quantile(x.reshape(x.shape[0], -1), prob, axis=1)


def _autocov(x: np.ndarray) -> np.ndarray:
    """Biased autocovariance of every chain at every lag, by FFT: ``(P, C, n) -> (P, C, n)``."""
    n = x.shape[2]
    m = _fft.next_fast_len(2 * n, real=True)
    centred = x - x.mean(axis=2, keepdims=True)
    spectrum = _fft.rfft(centred, n=m, axis=2)
    power = spectrum.real**2 + spectrum.imag**2
    return _fft.irfft(power, n=m, axis=2)[:, :, :n] / n


def _ess(x: np.ndarray) -> np.ndarray:
    """Effective sample size of the mean of each parameter (chains as given, no splitting).

    Multi-chain autocorrelation estimate of Vehtari et al. (2021, eqs. 10-11) truncated
    by Geyer's initial positive sequence and made monotone by Geyer's initial monotone
    sequence. NaN for a constant parameter.
    """
    _, n_chains, n = x.shape
    acov = _autocov(x)
    mean_var = acov[:, :, 0].mean(axis=1) * n / (n - 1.0)  # W: mean within-chain variance
    var_plus = mean_var * (n - 1.0) / n
    if n_chains > 1:
        var_plus = var_plus + np.var(x.mean(axis=2), axis=1, ddof=1)  # + B / n
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = 1.0 - (mean_var[:, None] - acov.mean(axis=1)) / var_plus[:, None]
    rho[:, 0] = 1.0
    invalid = _is_constant(x) | ~np.all(np.isfinite(rho), axis=1)
    rho[invalid] = 0.0  # placeholder values; these parameters get NaN below

    # Pairs P_k = rho[2k] + rho[2k+1]. Pair k >= 1 is examined while the previous pair
    # was positive and 2k < n - 2; examination stops at the first pair whose sum is <= 0.
    n_pairs = max((n - 3) // 2 + 1, 1)
    pairs = rho[:, 0 : 2 * n_pairs : 2] + rho[:, 1 : 2 * n_pairs : 2]
    if n_pairs == 1:
        k_last = np.zeros(len(x), dtype=np.intp)
    else:
        nonpositive = pairs[:, 1:] <= 0.0
        k_last = np.where(nonpositive.any(axis=1), nonpositive.argmax(axis=1) + 1, n_pairs - 1)
        k_last[pairs[:, 0] <= 0.0] = 0
    # Pairs 0 .. k_last-1 are kept, made non-increasing by a running minimum.
    running_min = np.minimum.accumulate(pairs, axis=1)
    kept = np.where(np.arange(n_pairs) < k_last[:, None], running_min, 0.0).sum(axis=1)
    # The even lag of the last examined pair counts if that pair was kept or is positive.
    rows = np.arange(len(x))
    even = rho[rows, 2 * k_last]
    last_pair = pairs[rows, k_last]
    even = np.where((k_last == 0) | (last_pair >= 0.0) | (even > 0.0), even, 0.0)
    total = n_chains * n
    tau = np.maximum(-1.0 + 2.0 * kept + even, 1.0 / np.log10(total))
    return np.where(invalid, np.nan, total / tau)


def _rhat_basic(x: np.ndarray) -> np.ndarray:
    """Classic potential scale reduction factor of each parameter (chains as given)."""
    n = x.shape[2]
    between = n * np.var(x.mean(axis=2), axis=1, ddof=1)
    within = np.var(x, axis=2, ddof=1).mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt((between / within + n - 1.0) / n)


def _rhat_from_z(z_split: np.ndarray, z_folded: np.ndarray) -> np.ndarray:
    """Max of bulk and folded R̂; the bulk alone where the folded draws are constant."""
    bulk = _rhat_basic(z_split)
    tail = _rhat_basic(z_folded)
    return np.where(np.isnan(tail), bulk, np.fmax(bulk, tail))


def _rhat_rank(x: np.ndarray) -> np.ndarray:
    """Rank-normalised split-R̂: max of the bulk and the folded (tail) versions."""
    split = _split_chains(x)
    out = _rhat_from_z(_z_scale(split), _z_scale(_fold(split)))
    return np.where(_is_constant(x), np.nan, out)


def _ess_bulk(x: np.ndarray) -> np.ndarray:
    """ESS of the rank-normalised split chains."""
    out = _ess(_z_scale(_split_chains(x)))
    return np.where(_is_constant(x), np.nan, out)


def _ess_below(x: np.ndarray, threshold: np.ndarray) -> np.ndarray:
    """ESS of the indicator ``x <= threshold`` (per parameter) on split chains."""
    return _ess(_split_chains((x <= threshold[:, None, None]).astype(np.float64)))


def _ess_tail(x: np.ndarray, prob: tuple[float, float]) -> np.ndarray:
    """Minimum of the quantile-indicator ESS at the two tail probabilities."""
    low = _ess_below(x, _quantile(x, prob[0]))
    high = _ess_below(x, _quantile(x, prob[1]))
    out = np.fmin(low, high)  # a constant indicator (heavy ties) has no ESS: use the other
    return np.where(_is_constant(x), np.nan, out)


def _ess_mean(x: np.ndarray) -> np.ndarray:
    """Plain (not rank-normalised) split-chain ESS, for the MCSE of the mean."""
    return _ess(_split_chains(x))


def _sd(x: np.ndarray) -> np.ndarray:
    """Standard deviation (ddof=1) of each parameter over all its draws."""
    return np.std(x.reshape(x.shape[0], -1), axis=1, ddof=1)


def _mcse_mean(x: np.ndarray) -> np.ndarray:
    """Monte Carlo standard error of the mean: ``sd / sqrt(ess_mean)``."""
    return _sd(x) / np.sqrt(_ess_mean(x))


def _mcse_sd(x: np.ndarray) -> np.ndarray:
    """Monte Carlo standard error of the standard deviation.

    Variance of the variance estimate by Kenney & Keeping (1951), with the ESS of the
    squared centred draws, then a first-order Taylor step from variance to sd.
    """
    centred_sq = (x - x.mean(axis=(1, 2), keepdims=True)) ** 2
    ess = _ess_mean(centred_sq)
    evar = centred_sq.mean(axis=(1, 2))
    varvar = ((centred_sq**2).mean(axis=(1, 2)) - evar**2) / ess
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.sqrt(varvar / evar / 4.0)
    return np.where(_is_constant(x), np.nan, out)


# --------------------------------------------------------------------------------------------
# validation and dispatch
# --------------------------------------------------------------------------------------------

# Parameters per block, so that (block, chains, 2 * draws) complex FFT buffers stay small.
_BLOCK_ELEMENTS = 2**21


def _as_draws(x: object, name: str = "x") -> np.ndarray:
    """Validate ``x`` as a ``(chains, draws, *param_shape)`` array of reals, as float64."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim < 2:
        raise ValueError(
            f"{name} must have shape (chains, draws, *param_shape), got shape {arr.shape}; "
            "for a single chain use x[None, :]"
        )
    n_chains, n_draws = arr.shape[:2]
    if n_chains < 1:
        raise ValueError(f"{name} has no chains (shape {arr.shape})")
    if n_draws < MIN_DRAWS:
        raise ValueError(
            f"{name} needs at least {MIN_DRAWS} draws per chain, got {n_draws} (shape {arr.shape})"
        )
    return arr.astype(np.float64, copy=False)


def _stacked(x: np.ndarray) -> np.ndarray:
    """``(C, S, *param_shape) -> (P, C, S)`` with P the number of parameters."""
    n_chains, n_draws = x.shape[:2]
    n_params = int(np.prod(x.shape[2:], dtype=np.int64))
    return np.moveaxis(x.reshape(n_chains, n_draws, n_params), 2, 0)


def _validate_prob(prob: object) -> tuple[float, float]:
    """Validate ``prob`` for :func:`ess_tail`: a pair ``0 < lo <= hi < 1`` or a scalar."""
    if np.ndim(prob) == 0:
        try:
            p = float(prob)  # type: ignore[arg-type]
        except (TypeError, ValueError) as err:
            raise ValueError(f"prob must be a number or a pair of numbers, got {prob!r}") from err
        pair = (min(p, 1.0 - p), max(p, 1.0 - p))
    else:
        values = np.asarray(prob, dtype=object).ravel()
        if values.size != 2:
            raise ValueError(f"prob must be a number or a pair of numbers, got {prob!r}")
        try:
            pair = (float(values[0]), float(values[1]))
        except (TypeError, ValueError) as err:
            raise ValueError(f"prob must be a number or a pair of numbers, got {prob!r}") from err
    lo, hi = pair
    if not (0.0 < lo < 1.0 and 0.0 < hi < 1.0):
        raise ValueError(f"prob values must lie strictly between 0 and 1, got {prob!r}")
    if lo > hi:
        raise ValueError(f"prob must be (low, high) with low <= high, got {prob!r}")
    return pair


def _apply(
    x: np.ndarray,
    core: Callable[[np.ndarray], dict[str, np.ndarray]],
    columns: Sequence[str],
) -> dict[str, np.ndarray]:
    """Run ``core`` over all parameters in blocks; NaN for parameters with non-finite draws.

    ``core`` maps a ``(P, C, S)`` block to ``columns`` arrays of shape ``(P,)``; the
    result has arrays of shape ``param_shape``.
    """
    param_shape = x.shape[2:]
    stacked = _stacked(x)
    n_params = stacked.shape[0]
    out = {name: np.full(n_params, np.nan) for name in columns}
    finite = np.flatnonzero(np.all(np.isfinite(stacked), axis=(1, 2)))
    block = max(1, _BLOCK_ELEMENTS // (x.shape[0] * x.shape[1]))
    for start in range(0, finite.size, block):
        index = finite[start : start + block]
        for name, values in core(stacked[index]).items():
            out[name][index] = values
    return {name: values.reshape(param_shape) for name, values in out.items()}


def _public(x: ArrayLike, core: Callable[[np.ndarray], np.ndarray]) -> float | np.ndarray:
    """Validate, run one core per parameter, and return a float for 2-D input."""
    draws = _as_draws(x)
    result = _apply(draws, lambda block: {"value": core(block)}, ("value",))["value"]
    return float(result) if draws.ndim == 2 else result


# --------------------------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------------------------


def ess_bulk(x: ArrayLike) -> float | np.ndarray:
    """Bulk effective sample size (rank-normalised split-chain ESS).

    Parameters
    ----------
    x
        Draws of shape ``(chains, draws, *param_shape)``, at least 4 draws per chain.

    Returns
    -------
    float or numpy.ndarray
        A float for 2-D input, else an array of shape ``param_shape``. NaN for a
        parameter with non-finite or constant draws.

    Raises
    ------
    ValueError
        If ``x`` has fewer than two dimensions, no chains or fewer than 4 draws.
    TypeError
        If ``x`` does not hold real numbers.
    """
    return _public(x, _ess_bulk)


def ess_tail(x: ArrayLike, prob: float | Sequence[float] = (0.05, 0.95)) -> float | np.ndarray:
    """Tail effective sample size: the smaller ESS of the two tail-quantile indicators.

    Parameters
    ----------
    x
        Draws of shape ``(chains, draws, *param_shape)``, at least 4 draws per chain.
    prob
        ``(low, high)`` tail probabilities, or one probability ``p`` meaning
        ``(min(p, 1 - p), max(p, 1 - p))``. Values strictly between 0 and 1.

    Returns
    -------
    float or numpy.ndarray
        A float for 2-D input, else an array of shape ``param_shape``. NaN for a
        parameter with non-finite or constant draws. Where one quantile indicator
        is constant (heavy ties), the other one's ESS is used; NaN if both are.

    Raises
    ------
    ValueError
        For a malformed ``x`` (see :func:`ess_bulk`) or ``prob``.
    TypeError
        If ``x`` does not hold real numbers.
    """
    pair = _validate_prob(prob)
    return _public(x, lambda a: _ess_tail(a, pair))


def ess_mean(x: ArrayLike) -> float | np.ndarray:
    """Plain split-chain effective sample size for the mean (no rank normalisation).

    Parameters
    ----------
    x
        Draws of shape ``(chains, draws, *param_shape)``, at least 4 draws per chain.

    Returns
    -------
    float or numpy.ndarray
        A float for 2-D input, else an array of shape ``param_shape``; NaN for
        non-finite or constant draws.

    Raises
    ------
    ValueError
        For a malformed ``x`` (see :func:`ess_bulk`).
    TypeError
        If ``x`` does not hold real numbers.
    """
    return _public(x, _ess_mean)


def rhat(x: ArrayLike) -> float | np.ndarray:
    """Rank-normalised split-R̂: the larger of the bulk and the folded (tail) R̂.

    A single chain is split in two and still gets an R̂ (it then diagnoses
    within-chain non-stationarity only).

    Parameters
    ----------
    x
        Draws of shape ``(chains, draws, *param_shape)``, at least 4 draws per chain.

    Returns
    -------
    float or numpy.ndarray
        A float for 2-D input, else an array of shape ``param_shape``. NaN for
        non-finite or constant draws; ``inf`` when every split chain is constant
        but the chains disagree.

    Raises
    ------
    ValueError
        For a malformed ``x`` (see :func:`ess_bulk`).
    TypeError
        If ``x`` does not hold real numbers.
    """
    return _public(x, _rhat_rank)


def mcse_mean(x: ArrayLike) -> float | np.ndarray:
    """Monte Carlo standard error of the posterior mean, ``sd / sqrt(ess_mean)``.

    Parameters
    ----------
    x
        Draws of shape ``(chains, draws, *param_shape)``, at least 4 draws per chain.

    Returns
    -------
    float or numpy.ndarray
        A float for 2-D input, else an array of shape ``param_shape``; NaN for
        non-finite or constant draws.

    Raises
    ------
    ValueError
        For a malformed ``x`` (see :func:`ess_bulk`).
    TypeError
        If ``x`` does not hold real numbers.
    """
    return _public(x, _mcse_mean)


def mcse_sd(x: ArrayLike) -> float | np.ndarray:
    """Monte Carlo standard error of the posterior standard deviation.

    Moments-of-moments estimate without assuming normality (Kenney & Keeping,
    1951) with the ESS of the squared centred draws, as in ``posterior``.

    Parameters
    ----------
    x
        Draws of shape ``(chains, draws, *param_shape)``, at least 4 draws per chain.

    Returns
    -------
    float or numpy.ndarray
        A float for 2-D input, else an array of shape ``param_shape``; NaN for
        non-finite or constant draws.

    Raises
    ------
    ValueError
        For a malformed ``x`` (see :func:`ess_bulk`).
    TypeError
        If ``x`` does not hold real numbers.
    """
    return _public(x, _mcse_sd)


# --------------------------------------------------------------------------------------------
# summary table
# --------------------------------------------------------------------------------------------


def _labels(param_shape: tuple[int, ...], names: str | Sequence[str] | None) -> np.ndarray:
    """Row labels, shaped ``param_shape``: ``theta``, ``theta[3]``, ``theta[1,4]`` or given."""
    size = int(np.prod(param_shape, dtype=np.int64))
    if names is None or isinstance(names, str):
        base = "theta" if names is None else names
        if not base:
            raise ValueError("names must be a non-empty string or a sequence of labels")
        if not param_shape:
            return np.array(base, dtype=object)
        labels = [f"{base}[{','.join(str(i) for i in idx)}]" for idx in np.ndindex(param_shape)]
        return np.array(labels, dtype=object).reshape(param_shape)
    labels = list(names)
    if len(labels) != size or not all(isinstance(label, str) for label in labels):
        raise ValueError(
            f"names must be a base name or {size} strings (one per parameter, C order), "
            f"got {len(labels)} items"
        )
    return np.array(labels, dtype=object).reshape(param_shape)


def summary(samples: ArrayLike, names: str | Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Per-parameter posterior summary and convergence diagnostics.

    Parameters
    ----------
    samples
        Draws of shape ``(chains, draws, *param_shape)``, at least 4 draws per chain.
    names
        A base name (default ``"theta"``), giving labels ``theta``, ``theta[3]`` or
        ``theta[1,4]`` (0-based, C order), or one label per parameter in C order.

    Returns
    -------
    dict of str to numpy.ndarray
        ``"name"`` (labels, object dtype) and the float columns of
        :data:`SUMMARY_COLUMNS`: ``mean``, ``sd`` (ddof=1), ``mcse_mean``,
        ``q5``, ``q50``, ``q95`` (linear interpolation over all chains),
        ``ess_bulk``, ``ess_tail``, ``r_hat``; every array has shape
        ``param_shape``. A parameter with non-finite draws gets NaN everywhere;
        a constant one gets its value as mean and quantiles, sd 0 and NaN for
        the rest.

    Raises
    ------
    ValueError
        For a malformed ``samples`` (see :func:`ess_bulk`) or ``names``.
    TypeError
        If ``samples`` does not hold real numbers.
    """
    x = _as_draws(samples, "samples")
    labels = _labels(x.shape[2:], names)
    table = _apply(x, _summary_block, SUMMARY_COLUMNS)
    return {"name": labels, **table}


def _summary_block(x: np.ndarray) -> dict[str, np.ndarray]:
    """All summary columns for a ``(P, C, S)`` block, sharing the split and rank work."""
    flat = x.reshape(x.shape[0], -1)
    constant = _is_constant(x)
    q5, q50, q95 = np.quantile(flat, (0.05, 0.5, 0.95), axis=1)
    split = _split_chains(x)
    z_split = _z_scale(split)
    sd = np.std(flat, axis=1, ddof=1)
    columns = {
        "mean": flat.mean(axis=1),
        "sd": sd,
        "mcse_mean": sd / np.sqrt(_ess(split)),
        "q5": q5,
        "q50": q50,
        "q95": q95,
        "ess_bulk": _ess(z_split),
        "ess_tail": np.fmin(_ess_below(x, q5), _ess_below(x, q95)),
        "r_hat": _rhat_from_z(z_split, _z_scale(_fold(split))),
    }
    for name in ("mcse_mean", "ess_bulk", "ess_tail", "r_hat"):
        columns[name] = np.where(constant, np.nan, columns[name])
    return columns


def _format_value(column: str, value: float) -> str:
    """One table cell: ESS as integers, R̂ with 3 decimals, the rest with 4 significant."""
    if not np.isfinite(value):
        return str(value)
    if column in ("ess_bulk", "ess_tail"):
        return f"{value:.0f}"
    if column == "r_hat":
        return f"{value:.3f}"
    return f"{value:.4g}"


def format_summary(
    table: dict[str, np.ndarray],
    names: str | Sequence[str] | None = None,
    max_rows: int | None = 50,
) -> str:
    """Render a :func:`summary` table as aligned text, one row per parameter.

    Parameters
    ----------
    table
        Output of :func:`summary` (any subset of its float columns; ``"name"``
        optional).
    names
        Row labels overriding ``table["name"]``: a base name or one label per
        parameter (see :func:`summary`).
    max_rows
        Show at most this many parameters (then a line saying how many were left
        out); ``None`` shows all.

    Returns
    -------
    str
        The table, rows separated by newlines, no trailing newline.

    Raises
    ------
    ValueError
        If ``table`` has no known column, its columns differ in shape, ``names``
        does not fit, or ``max_rows`` is not a positive integer or None.
    """
    if max_rows is not None and (
        isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) or max_rows < 1
    ):
        raise ValueError(f"max_rows must be a positive integer or None, got {max_rows!r}")
    columns = [c for c in SUMMARY_COLUMNS if c in table]
    if not columns:
        raise ValueError(f"table has none of the summary columns {SUMMARY_COLUMNS}")
    values = {c: np.asarray(table[c], dtype=np.float64) for c in columns}
    param_shape = values[columns[0]].shape
    if any(v.shape != param_shape for v in values.values()):
        raise ValueError("table columns differ in shape")
    if names is not None or "name" not in table:
        labels = _labels(param_shape, names)
    else:
        labels = np.asarray(table["name"], dtype=object)
        if labels.shape != param_shape:
            raise ValueError("table['name'] does not match the shape of the columns")
    flat_labels = [str(label) for label in labels.ravel()]
    n_rows = len(flat_labels)
    shown = n_rows if max_rows is None else min(n_rows, int(max_rows))
    rows = [
        [flat_labels[i]] + [_format_value(c, values[c].ravel()[i]) for c in columns]
        for i in range(shown)
    ]
    header = ["", *columns]
    widths = [max(len(row[j]) for row in [header, *rows]) for j in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(widths[j]) if j == 0 else cell.rjust(widths[j]) for j, cell in enumerate(row)
        ).rstrip()
        for row in [header, *rows]
    ]
    if shown < n_rows:
        lines.append(f"... {n_rows - shown} more parameters not shown")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Hamiltonian sampler diagnostics
# --------------------------------------------------------------------------------------------

#: E-BFMI below this in a chain is warned about (Betancourt 2016; Stan, PyMC and ArviZ use 0.3)
EBFMI_THRESHOLD = 0.3


def e_bfmi(energy: ArrayLike) -> np.ndarray:
    """The energy Bayesian fraction of missing information of each chain.

    ``E-BFMI = Σ_s (E_s − E_{s−1})² / Σ_s (E_s − Ē)²`` over one chain's post-warm-up energies
    (the Hamiltonian at each draw): how well the momentum resampling moves the chain
    between energy levels (Betancourt 2016, "Diagnosing suboptimal cotangent
    disintegrations in Hamiltonian Monte Carlo"). Below :data:`EBFMI_THRESHOLD` the
    chain explores the energy distribution poorly. The same formula as Stan's and ArviZ's
    ``bfmi``. Under FlyMC the energy is that of θ given z, whose target the z-update also
    moves between iterations: its changes count in the numerator too.

    Parameters
    ----------
    energy
        ``(chains, draws)``, at least 2 draws.

    Returns
    -------
    numpy.ndarray
        ``(chains,)``; NaN for a chain with non-finite or constant energies.

    Raises
    ------
    ValueError
        If ``energy`` is not 2-D with at least 2 draws.
    """
    e = np.asarray(energy, dtype=np.float64)
    if e.ndim != 2 or e.shape[1] < 2:
        raise ValueError(f"energy must have shape (chains, draws >= 2), got {e.shape}")
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.square(np.diff(e, axis=1)).sum(axis=1) / np.square(
            e - e.mean(axis=1, keepdims=True)
        ).sum(axis=1)
    out[~np.isfinite(e).all(axis=1)] = np.nan
    return np.where(np.isfinite(out), out, np.nan)


def hamiltonian_checks(
    stats: dict[str, ArrayLike], max_tree_depth: int | None = None, algorithm: str | None = None
) -> dict[str, object] | None:
    """What a Hamiltonian kernel's statistics say about a run's post-warm-up iterations.

    Parameters
    ----------
    stats
        Per-iteration statistics ``(chains, draws)``: ``diverging`` and ``energy`` (and,
        for NUTS, ``tree_depth``), as :class:`flymc_dist.Result` and a trace hold them.
    max_tree_depth
        NUTS's maximum tree depth (iterations at it are counted), or None.
    algorithm
        The run's algorithm: under ``"flymc"`` the divergences of iterations with bright
        rows are counted apart (``n_bright`` in ``stats``; see :func:`hamiltonian_lines`).

    Returns
    -------
    dict or None
        None when ``stats`` has no ``diverging`` (not a Hamiltonian kernel). Else
        ``iterations`` (all chains'), ``divergences``, ``divergences_bright`` (FlyMC:
        those in iterations with bright rows; else None), ``max_tree_depth`` and
        ``max_tree_depth_hits`` (None without a tree depth), and ``e_bfmi``
        (``(chains,)``, NaN with fewer than 2 draws).
    """
    if "diverging" not in stats:
        return None
    div = np.asarray(stats["diverging"], dtype=bool)
    hits = None
    if max_tree_depth is not None and "tree_depth" in stats:
        hits = int(np.count_nonzero(np.asarray(stats["tree_depth"]) >= int(max_tree_depth)))
    energy = np.asarray(stats.get("energy", np.full(div.shape, np.nan)), dtype=np.float64)
    bfmi = (
        e_bfmi(energy)
        if energy.ndim == 2 and energy.shape[1] >= 2
        else np.full(div.shape[0], np.nan)
    )
    bright = None
    if algorithm == "flymc" and "n_bright" in stats:
        bright = int(np.count_nonzero(div & (np.asarray(stats["n_bright"]) > 0)))
    return {
        "iterations": int(div.size),
        "divergences": int(np.count_nonzero(div)),
        "divergences_bright": bright,
        "max_tree_depth": None if hits is None else int(max_tree_depth),
        "max_tree_depth_hits": hits,
        "e_bfmi": bfmi,
    }


def hamiltonian_lines(checks: dict[str, object] | None) -> list[str]:
    """The report of :func:`hamiltonian_checks`: one line of counts, then one warning line
    per problem saying what to try (as Stan and PyMC do). Empty for None."""
    if checks is None:
        return []
    n, div, hits = checks["iterations"], checks["divergences"], checks["max_tree_depth_hits"]
    depth = checks["max_tree_depth"]
    bfmi = np.asarray(checks["e_bfmi"], dtype=np.float64)

    def share(k: int) -> str:
        return f"{k:,} of {n:,} post-warm-up iterations ({100.0 * k / n:.2g}%)" if n else "0"

    parts = [f"divergences {div:,}"]
    if hits is not None:
        parts.append(f"at max tree depth {depth}: {hits:,}")
    finite = bfmi[np.isfinite(bfmi)]
    parts.append("E-BFMI " + (" ".join(f"{b:.2f}" for b in bfmi) if finite.size else "n/a"))
    lines = ["NUTS/HMC: " + ", ".join(parts) + " (per chain)"]
    if div and checks.get("divergences_bright") == div:
        lines.append(
            f"WARNING: {share(div)} diverged, all with bright rows: FlyMC's θ given z is "
            "zero where a bright row's bound is tight, and trajectories that come close stop "
            "(the next z-update moves that wall), which slows mixing; if they are many, "
            "raise target_accept (e.g. 0.95); to check the posterior itself, run "
            "algorithm='regular' on a subsample"
        )
    elif div:
        lines.append(
            f"WARNING: {share(div)} diverged: the posterior has regions the step size cannot "
            "follow and the draws may be biased; raise target_accept (e.g. 0.95) or "
            "reparameterise the model (e.g. standardise the columns, a wider prior)"
        )
    if hits:
        lines.append(
            f"WARNING: {share(hits)} hit the maximum tree depth {depth}: the trajectories "
            "were cut short (an efficiency problem, not a bias); raise max_tree_depth"
        )
    low = [c for c, b in enumerate(bfmi) if np.isfinite(b) and b < EBFMI_THRESHOLD]
    if low:
        which = ", ".join(f"{c} ({bfmi[c]:.2f})" for c in low)
        lines.append(
            f"WARNING: E-BFMI below {EBFMI_THRESHOLD} in chain {which}: the momentum "
            "resampling explores the energy poorly; reparameterise the model (heavy tails, "
            "funnels) or adapt a dense metric with a longer warm-up"
        )
    return lines
