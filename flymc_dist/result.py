"""What a run returns: :class:`Result` (draws, statistics, run metadata), its
:class:`Summary` table, and :func:`efficiency`, the one formula for cost and ESS figures
(of a :class:`Result` and of a trace, for ``flymc summary``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from flymc_dist import diagnostics

__all__ = ["Result", "Summary", "efficiency", "narrowing_line"]


class Summary(dict):
    """Per-parameter diagnostics (a dict of arrays) that prints as a table."""

    def __init__(
        self, table: dict[str, np.ndarray], names: list[str] | None = None, header: str = ""
    ) -> None:
        super().__init__(table)
        self._names = names
        self._header = header

    def __str__(self) -> str:
        body = diagnostics.format_summary(dict(self), names=self._names)
        return f"{self._header}\n{body}" if self._header else body

    __repr__ = __str__


class Result:
    """Draws and per-iteration statistics of a run.

    Attributes
    ----------
    samples
        Post-warm-up draws, shape ``(chains, draws) + param_shape``.
    stats
        Per-iteration statistics, each of shape ``(chains, draws)``: ``accepted``,
        ``accept_prob``, ``n_bright``, ``likelihood_queries``, ``round_trips``,
        ``log_joint`` (and ``data_used`` for austerity).
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
    ) -> None:
        self.samples = samples
        self.stats = stats
        self.warmup_samples = warmup_samples
        self.warmup_stats = warmup_stats
        self.info = info
        self.approximate = info.get("algorithm") == "austerity"

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Shape of one draw."""
        return tuple(self.samples.shape[2:])

    def summary(self, names: list[str] | None = None) -> Summary:
        """Per-parameter mean, sd, MCSE, bulk/tail ESS, rank-normalised split-R̂ and quantiles."""
        table = diagnostics.summary(self.samples, names=names)
        header = ""
        if self.approximate:
            header = "APPROXIMATE (austerity MH): draws do not target the exact posterior."
        return Summary(table, names, header)

    def efficiency(self) -> dict[str, float]:
        """Cost figures: queries and seconds per iteration, ESS per query and per second
        (see :func:`efficiency`)."""
        return efficiency(
            self.samples,
            self.stats,
            self.info["n_rows"],
            float(self.info.get("sampling_seconds", np.nan)),
        )

    def to_arviz(self) -> Any:
        """An ``arviz.InferenceData`` (needs the ``arviz`` extra)."""
        try:
            import arviz as az
        except ImportError as err:  # pragma: no cover - optional extra
            raise ImportError("to_arviz needs arviz: pip install 'flymc_dist[arviz]'") from err
        return az.from_dict(
            posterior={"theta": self.samples}, sample_stats={k: v for k, v in self.stats.items()}
        )

    def __repr__(self) -> str:
        C, S = self.samples.shape[:2]
        tag = " APPROXIMATE" if self.approximate else ""
        return (
            f"<Result{tag} algorithm={self.info.get('algorithm')} chains={C} draws={S} "
            f"param_shape={self.param_shape}>"
        )


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
