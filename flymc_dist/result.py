"""What a run returns: :class:`Result` (draws, statistics, run metadata), its
:class:`Summary` table, and :func:`efficiency`, the one formula for cost and ESS figures
(of a :class:`Result` and of a trace, for ``flymc summary``)."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import numpy as np
import zarr

from flymc_dist import diagnostics
from flymc_dist.data import Dataset, open_dataset
from flymc_dist.data.design import Design
from flymc_dist.models import model_from_dict
from flymc_dist.predictive import log_likelihood, loo, predict

__all__ = [
    "Result",
    "Stats",
    "Summary",
    "efficiency",
    "narrowing_line",
    "param_coords",
    "param_dims",
    "param_labels",
]

#: statistics renamed to ArviZ's names: old name -> new name (the old names still read)
STAT_ALIASES = {"accept_prob": "acceptance_rate", "log_joint": "lp"}


class Stats(dict):
    """Per-iteration statistics, name -> ``(chains, draws)`` array.

    A plain dict, except that the names used before the statistics took ArviZ's names
    still read: ``stats["accept_prob"]`` is ``stats["acceptance_rate"]`` and
    ``stats["log_joint"]`` is ``stats["lp"]`` (``in`` and :meth:`get` know them too; they
    are not listed as keys).
    """

    def __missing__(self, key: str) -> np.ndarray:
        new = STAT_ALIASES.get(key)
        if new is not None and dict.__contains__(self, new):
            return self[new]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or (
            isinstance(key, str) and dict.__contains__(self, STAT_ALIASES.get(key, ""))
        )

    def get(self, key: str, default: Any = None) -> Any:
        """``self[key]`` (a former name too), else ``default``."""
        return self[key] if key in self else default


def param_dims(param_shape: tuple[int, ...]) -> tuple[str, ...]:
    """The dimension names of θ: ``("feature",)`` for one weight per column,
    ``("class", "feature")`` for softmax's ``(K, D)``; ``theta_dim_i`` otherwise."""
    if len(param_shape) == 1:
        return ("feature",)
    if len(param_shape) == 2:
        return ("class", "feature")
    return tuple(f"theta_dim_{i}" for i in range(len(param_shape)))


def _names_fit(param_shape: tuple[int, ...], feature_names: Sequence[str] | None) -> bool:
    return (
        feature_names is not None
        and len(param_shape) in (1, 2)
        and len(feature_names) == param_shape[-1]
    )


def param_coords(
    param_shape: tuple[int, ...], feature_names: Sequence[str] | None = None
) -> dict[str, list]:
    """Coordinates of :func:`param_dims`: the feature names (when they fit the last axis,
    else ``0 … D−1``) and the class labels ``0 … K−1``."""
    dims = param_dims(param_shape)
    coords: dict[str, list] = {d: list(range(n)) for d, n in zip(dims, param_shape, strict=True)}
    if _names_fit(param_shape, feature_names):
        coords["feature"] = [str(n) for n in feature_names]
    return coords


def param_labels(
    param_shape: tuple[int, ...], feature_names: Sequence[str] | None = None
) -> list[str] | None:
    """Row labels of a summary as ArviZ writes them: ``theta[age]`` (one weight per
    column) or ``theta[2, age]`` (softmax: class, feature), C order; None when there are
    no feature names that fit (the table then says ``theta[3]``)."""
    if not _names_fit(param_shape, feature_names):
        return None
    names = [str(n) for n in feature_names]
    if len(param_shape) == 1:
        return [f"theta[{n}]" for n in names]
    return [f"theta[{k}, {n}]" for k in range(param_shape[0]) for n in names]


class Summary(dict):
    """Per-parameter diagnostics (a dict of arrays) that prints as a table.

    ``footer`` lines (a Hamiltonian kernel's counts of divergences and max-tree-depth
    hits, E-BFMI, and warnings) print after the table.
    """

    def __init__(
        self,
        table: dict[str, np.ndarray],
        names: list[str] | None = None,
        header: str = "",
        footer: Sequence[str] = (),
    ) -> None:
        super().__init__(table)
        self._names = names
        self._header = header
        self.footer = list(footer)

    def __str__(self) -> str:
        body = diagnostics.format_summary(dict(self), names=self._names)
        parts = ([self._header] if self._header else []) + [body] + self.footer
        return "\n".join(parts)

    __repr__ = __str__


class Result:
    """Draws and per-iteration statistics of a run.

    Attributes
    ----------
    samples
        Post-warm-up draws, shape ``(chains, draws) + param_shape``.
    stats
        Per-iteration statistics (a :class:`Stats` dict), each of shape ``(chains,
        draws)``, under ArviZ's names where ArviZ has one: ``accepted``,
        ``acceptance_rate`` (the kernel's acceptance probability; NUTS: Stan's mean
        acceptance statistic over the tree), ``lp`` (the log target at the draw, up to a
        constant: the log posterior in regular MCMC, FlyMC's log joint of θ and its
        brightness variables; NaN for austerity), ``n_bright``, ``likelihood_queries``,
        ``round_trips``, ``recoveries`` (and ``data_used`` for austerity). HMC and NUTS add
        ``diverging``, ``n_steps`` (leapfrog steps), ``step_size``, ``energy`` (the
        Hamiltonian at the draw) and, NUTS, ``tree_depth``. The former names
        ``accept_prob`` and ``log_joint`` still read.
    warmup_samples, warmup_stats
        The same for the discarded warm-up iterations.
    info
        Run metadata: algorithm, settings, timings, MAP, setup cost, recoveries. For
        MAP-tuned FlyMC, ``conditional_narrowing`` (κ: how many times narrower θ given z
        is than the posterior, in precision, at most over directions) and
        ``gibbs_ess_per_draw`` (``1 / (2κ − 1)``: the effective draws per iteration of
        θ's slowest direction were θ | z and z | θ drawn exactly — a forecast, see
        :func:`flymc_dist.tune.conditional_narrowing`); None otherwise.
    approximate
        True for austerity MH, whose draws do *not* target the exact posterior.
    """

    def __init__(
        self,
        samples: np.ndarray,
        stats: dict[str, np.ndarray],
        warmup_samples: np.ndarray,
        warmup_stats: dict[str, np.ndarray],
        info: dict[str, Any],
        *,
        model: Any = None,
    ) -> None:
        self.samples = samples
        self._model = model
        self.stats = Stats(stats)
        self.warmup_samples = warmup_samples
        self.warmup_stats = Stats(warmup_stats)
        self.info = info
        self.approximate = info.get("algorithm") == "austerity"

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Shape of one draw."""
        return tuple(self.samples.shape[2:])

    @property
    def feature_names(self) -> list[str] | None:
        """The data set's column names (from the store, a DataFrame's columns or
        ``feature_names=``), or None."""
        names = self.info.get("feature_names")
        return None if names is None else [str(n) for n in names]

    def sampler_checks(self) -> dict[str, Any] | None:
        """A Hamiltonian kernel's post-warm-up divergences, max-tree-depth hits and E-BFMI
        per chain (:func:`flymc_dist.diagnostics.hamiltonian_checks`); None for the
        other kernels."""
        return diagnostics.hamiltonian_checks(
            self.stats, self.info.get("max_tree_depth"), self.info.get("algorithm")
        )

    def summary(self, names: list[str] | None = None) -> Summary:
        """Per-parameter mean, sd, MCSE, bulk/tail ESS, rank-normalised split-R̂ and quantiles.

        Rows are labelled by the data set's feature names when it has them
        (``theta[age]``; softmax ``theta[2, age]``), else ``theta[3]``; ``names`` (one
        label per parameter, C order) overrides them. With HMC or NUTS the table is
        followed by the count of post-warm-up divergences and of iterations at the
        maximum tree depth, E-BFMI per chain, and one warning line per problem.
        """
        if names is None:
            names = param_labels(self.param_shape, self.feature_names)
        table = diagnostics.summary(self.samples, names=names)
        header = ""
        if self.approximate:
            header = "APPROXIMATE (austerity MH): draws do not target the exact posterior."
        return Summary(table, names, header, diagnostics.hamiltonian_lines(self.sampler_checks()))

    def efficiency(self) -> dict[str, float]:
        """Cost figures: queries and seconds per iteration, ESS per query and per second
        (see :func:`efficiency`)."""
        return efficiency(
            self.samples,
            self.stats,
            self.info["n_rows"],
            float(self.info.get("sampling_seconds", np.nan)),
        )

    def to_arviz(self, warmup: bool = False) -> Any:
        """The run as an ``arviz.InferenceData`` (needs the ``arviz`` extra).

        Groups ``posterior`` (``theta`` with dims ``chain``, ``draw``, ``feature`` and,
        for softmax, ``class`` before ``feature``; the feature coordinates are the data
        set's column names when it has them) and ``sample_stats`` (every statistic of
        :attr:`stats` under its ArviZ name: ``lp``, ``acceptance_rate``, ``diverging``,
        ``energy``, ``tree_depth``, ``n_steps``, ``step_size``, and this package's own);
        with ``warmup``, also ``warmup_posterior`` and ``warmup_sample_stats``. The run's
        settings (algorithm, kernel, model, sizes, seed, timings, ...) are the attributes
        of every group: scalars as they are, anything else as JSON text.

        Parameters
        ----------
        warmup
            Also hold the warm-up draws and statistics.

        Returns
        -------
        arviz.InferenceData
        """
        try:
            import arviz as az
        except ImportError:
            raise ImportError(
                "Result.to_arviz needs arviz: pip install 'flymc_dist[arviz]'"
            ) from None
        shape = self.param_shape
        coords = param_coords(shape, self.feature_names)
        coords["chain"] = list(range(self.samples.shape[0]))  # draws: ArviZ's 0 … n−1
        dims = {"theta": list(param_dims(shape))}
        groups: dict[str, Any] = {
            "posterior": {"theta": self.samples},
            "sample_stats": dict(self.stats),
        }
        if warmup:
            groups["warmup_posterior"] = {"theta": self.warmup_samples}
            groups["warmup_sample_stats"] = dict(self.warmup_stats)
        idata = az.from_dict(**groups, coords=coords, dims=dims, save_warmup=warmup)
        attrs = self.arviz_attrs()
        for group in idata.groups():
            idata[group].attrs.update(attrs)
        return idata

    def arviz_attrs(self) -> dict[str, Any]:
        """The run's settings as netCDF-safe attributes (:meth:`to_arviz`): the scalar
        entries of :attr:`info` as they are, lists and dicts as JSON text (arrays such as
        the MAP are left out), plus ``inference_library``."""
        attrs: dict[str, Any] = {"inference_library": "flymc_dist"}
        try:
            attrs["inference_library_version"] = metadata.version("flymc_dist")
        except metadata.PackageNotFoundError:  # run from a source tree
            pass
        for key, value in self.info.items():
            if isinstance(value, bool | np.bool_):
                attrs[key] = int(value)
            elif isinstance(value, int | float | str | np.integer | np.floating):
                attrs[key] = value
            elif isinstance(value, dict | list | tuple):
                try:
                    attrs[key] = json.dumps(value, default=_json_default)
                except (TypeError, ValueError):
                    continue
        return attrs

    # -- answers out: predictions, log-likelihoods, LOO
    def model(self) -> Any:
        """The run's model: the one it sampled when it ran in this process (a user's
        family cannot be rebuilt from a description), else rebuilt from :attr:`info`
        (``info["model"]``)."""
        if self._model is not None:
            return self._model
        return model_from_dict(dict(self.info["model"]))

    def dataset(self) -> Any:
        """The data set the run sampled (``info["data"]``), opened again."""
        path = self.info.get("data")
        if not isinstance(path, str):
            raise ValueError(
                f"this run records no data set path (info['data'] is {path!r}): pass data="
            )
        return open_dataset(path, storage_options=self.info.get("storage_options"))

    def design(self) -> Any:
        """The training store's design (categorical levels, centring), or one that takes
        the feature columns by name; None without names."""
        try:
            attrs = self.dataset().attrs
        except (ValueError, FileNotFoundError, OSError):
            attrs = {}
        if "design" in attrs:
            return Design.from_attrs(attrs["design"])
        names = self.feature_names
        return None if names is None else Design(tuple(names), None)

    def predict(
        self,
        new: Any,
        *,
        draws: bool = False,
        interval: float = 0.9,
        seed: int = 0,
        out: str | None = None,
        client: Any = None,
    ) -> dict[str, Any]:
        """The posterior predictive at new rows.

        Parameters
        ----------
        new : ndarray, DataFrame or Dataset
            New rows: an array of the feature columns as the data set was written from
            (before one-hot encoding; standardized as the data set was); a DataFrame with
            the training columns by name (categorical levels encoded as in the data set;
            an unseen level is refused naming it); or a data set (:class:`Dataset`,
            written through the same design), computed chunk by chunk (with ``client``,
            on its workers) and written to the zarr group ``out``.
        draws : bool, default False
            Also return the per-draw values (not for a data set).
        interval : float, default 0.9
            Regression: the central predictive interval's mass.
        seed : int, default 0
            Regression: the seed of the predictive draws.
        out : str, optional
            A data set ``new``: the zarr group to write (required).
        client : distributed.Client, optional
            A data set ``new``: compute on its workers.

        Returns
        -------
        dict
            :func:`flymc_dist.predictive.predict`'s arrays (``"probability"``, or
            ``"mean"``, ``"lower"``, ``"upper"``); for a data set, the zarr arrays written.
        """
        model = self.model()
        if isinstance(new, Dataset):
            return _predict_store(self, model, new, out, client, interval, seed)
        design = self.design()
        if hasattr(new, "columns") and not isinstance(new, np.ndarray):
            if design is None:
                raise ValueError("this run's data set has no column names: pass an array")
            X = design.X({str(c): new[c] for c in new.columns}, "new rows")
        else:
            A = np.asarray(new, dtype=np.float64)
            if A.ndim != 2:
                raise ValueError(f"new must be 2-D (rows, features), got shape {A.shape}")
            if design is not None and design.transformed:
                if design.categorical:
                    raise ValueError(
                        "the data set has categorical columns: pass new rows as a DataFrame"
                    )
                if A.shape[1] != len(design.columns):
                    raise ValueError(
                        f"new has {A.shape[1]} columns, the data set {len(design.columns)}"
                    )
                X = design.X({c: A[:, j] for j, c in enumerate(design.columns)}, "new rows")
            else:
                X = A
        d = int(self.info.get("n_features", X.shape[1]))
        if X.shape[1] != d:
            raise ValueError(f"new has {X.shape[1]} features, the run's data set {d}")
        return predict(model, self.samples, X, draws=draws, interval=interval, seed=seed)

    def log_likelihood(self, rows: Any, data: Any = None) -> np.ndarray:
        """``log p(y_i | θ)`` of every draw at chosen rows of the data set.

        Parameters
        ----------
        rows : array_like of int
            Row indices (any order; duplicates allowed).
        data : Dataset, optional
            The data (default: the run's, :meth:`dataset`).

        Returns
        -------
        ndarray, shape (chains, draws, len(rows))
        """
        ds = self.dataset() if data is None else data
        idx = np.asarray(rows)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError("rows must be a 1-D array of integer row indices")
        order = np.argsort(idx, kind="stable")
        X, y = ds.read_rows(idx[order])
        ll = log_likelihood(self.model(), self.samples, X, y)
        out = np.empty_like(ll)
        out[..., order] = ll
        return out

    def loo(self, n_subsample: int = 400, seed: int = 0, data: Any = None) -> dict[str, Any]:
        """PSIS-LOO's elpd by subsampling rows (:func:`flymc_dist.predictive.loo`): one
        pass over the rows for the surrogate, PSIS on ``n_subsample`` of them."""
        ds = self.dataset() if data is None else data
        return loo(self.model(), self.samples, ds, n_subsample=n_subsample, seed=seed)

    def __repr__(self) -> str:
        C, S = self.samples.shape[:2]
        tag = " APPROXIMATE" if self.approximate else ""
        return (
            f"<Result{tag} algorithm={self.info.get('algorithm')} chains={C} draws={S} "
            f"param_shape={self.param_shape}>"
        )


def _json_default(value: Any) -> Any:
    """numpy scalars and arrays in :meth:`Result.arviz_attrs`' JSON text."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON-able: {type(value).__name__}")


def efficiency(
    samples: np.ndarray,
    stats: dict[str, np.ndarray],
    n_rows: int | None,
    sampling_seconds: float | None,
) -> dict[str, float]:
    """Cost and convergence figures of post-warm-up draws: the one formula for a
    :class:`Result` and for a trace (``flymc summary``).

    Parameters
    ----------
    samples
        Draws, ``(chains, draws) + param_shape``.
    stats
        Per-iteration statistics (``likelihood_queries``, ``n_bright``, ``accepted``,
        ``round_trips``; missing ones give NaN figures).
    n_rows
        N, for the bright fraction (None: NaN).
    sampling_seconds
        Wall seconds of the post-warm-up iterations (None or NaN: NaN per-second figures).

    Returns
    -------
    dict
        ``queries_per_iteration``, ``seconds_per_iteration``, ``bright_fraction``,
        ``acceptance``, ``round_trips_per_iteration``, ``ess_min``, ``ess_median``,
        ``ess_mean`` (bulk ESS over parameters), ``ess_min_per_draw`` (``ess_min`` over all
        chains' draws), ``r_hat_max``, ``ess_per_1000_iterations``,
        ``ess_per_query`` and ``ess_per_second`` (both from the mean ESS).
    """
    C, S = samples.shape[:2]
    flat = samples.reshape(C, S, -1)
    ess = np.atleast_1d(np.asarray(diagnostics.ess_bulk(flat), float))
    rhat = np.atleast_1d(np.asarray(diagnostics.rhat(flat), float))
    nan = float("nan")

    def stat(name: str) -> np.ndarray:
        return np.asarray(stats[name], float) if name in stats else np.full((C, S), nan)

    q = stat("likelihood_queries")
    secs = nan if sampling_seconds is None else float(sampling_seconds)
    mean_ess = float(np.nanmean(ess)) if ess.size else nan
    total_q = float(np.nansum(q))
    return {
        "queries_per_iteration": float(np.nanmean(q)),
        "seconds_per_iteration": secs / S if S else nan,
        "bright_fraction": float(np.nanmean(stat("n_bright")) / n_rows) if n_rows else nan,
        "acceptance": float(np.nanmean(stat("accepted"))),
        "round_trips_per_iteration": float(np.nanmean(stat("round_trips"))),
        "ess_min": float(np.nanmin(ess)) if ess.size else nan,
        "ess_median": float(np.nanmedian(ess)) if ess.size else nan,
        "ess_mean": mean_ess,
        "ess_min_per_draw": float(np.nanmin(ess)) / (C * S) if ess.size and S else nan,
        "r_hat_max": float(np.nanmax(rhat)) if rhat.size else nan,
        "ess_per_1000_iterations": 1000.0 * mean_ess / (C * S) if S else nan,
        "ess_per_query": mean_ess / total_q if total_q else nan,
        "ess_per_second": mean_ess / secs if secs and secs > 0 else nan,
    }


def narrowing_line(info: dict[str, Any], ess_min_per_draw: float) -> str | None:
    """One line on how fast FlyMC can mix (``info["conditional_narrowing"]`` and
    ``info["gibbs_ess_per_draw"]``) beside what it measured, or None when the run has no
    such forecast (regular MCMC, austerity, untuned bounds)."""
    kappa, rate = info.get("conditional_narrowing"), info.get("gibbs_ess_per_draw")
    if kappa is None or rate is None:
        return None
    return (
        f"FlyMC's θ given z is up to {kappa:.1f}× narrower than the posterior (in precision, "
        f"at the MAP): alternating exact draws of θ | z and z | θ would give its slowest "
        f"direction {rate:.3g} effective draws per iteration (measured: "
        f"{ess_min_per_draw:.3g} per draw, the min over parameters)"
    )


def _predict_piece(
    model_dict: dict,
    samples: np.ndarray,
    data: Any,
    out: str,
    start: int,
    stop: int,
    interval: float,
    seed: int,
) -> int:
    """Predict rows ``start:stop`` of ``data`` into the zarr group ``out`` (a worker's
    task)."""
    X, _ = data.read(start, stop)
    res = predict(model_from_dict(model_dict), samples, X, interval=interval, seed=seed + start)
    group = zarr.open_group(out, mode="r+")
    for key, value in res.items():
        group[key][start:stop] = value
    return stop - start


def _predict_store(
    result: Result,
    model: Any,
    data: Any,
    out: str | None,
    client: Any,
    interval: float,
    seed: int,
) -> dict[str, Any]:
    if out is None:
        raise ValueError("predicting a data set writes a zarr group: pass out=")
    d = int(result.info.get("n_features", data.n_features))
    if data.n_features != d:
        raise ValueError(f"the data set has {data.n_features} features, the run's {d}")
    mine = result.design()
    theirs = data.attrs.get("design")
    if mine is not None and mine.transformed and theirs != mine.to_attrs():
        raise ValueError(
            "the data set was not written through this run's design (its categorical levels "
            "or centring differ): write the new rows with the same categorical and "
            "standardize settings from the training data, or pass a DataFrame"
        )
    n = data.n_rows
    K = model.n_outputs if model.task == "multiclass" else None
    group = zarr.open_group(out, mode="w-")
    keys = ("probability",) if model.task != "real" else ("mean", "lower", "upper")
    for key in keys:
        shape = (n, K) if K else (n,)
        chunks = (data.chunk_rows, K) if K else (data.chunk_rows,)
        group.create_array(key, shape=shape, chunks=chunks, dtype="f8")
    spec = (dict(result.info["model"]), result.samples, data, out)
    ranges = data.chunk_ranges()
    if client is None:
        for s, e in ranges:
            _predict_piece(*spec, s, e, interval, seed)
    else:
        task = functools.partial(_predict_piece, *spec, interval=interval, seed=seed)
        futs = client.map(task, [s for s, _ in ranges], [e for _, e in ranges], pure=False)
        client.gather(futs)
    return {key: group[key] for key in keys}
