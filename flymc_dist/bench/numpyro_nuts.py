"""The same posterior in NumPyro's NUTS on the full data: the reference ``flymc bench
mixing --numpyro`` runs beside FlyMC (the ``numpyro`` extra: ``pip install
'flymc_dist[numpyro]'``).

The model is the package's own, written again in NumPyro: the same likelihood (logistic,
or Student-t with the model's ``nu`` and ``scale``) and the same i.i.d. prior (normal or
Laplace with the model's scale) on the same weights, every row in memory. NumPyro runs
its default NUTS (multinomial, generalised U-turn, ``max_tree_depth`` 10, Stan's windowed
warm-up toward an acceptance of 0.8) with a dense mass matrix (as this package's NUTS),
in float64 (as this package), its chains one after another on the CPU
(``chain_method="sequential"``), started where NumPyro starts by default. The whole run
— tracing and compiling included, which NumPyro does once — is timed; the likelihood
queries are its leapfrog steps (one gradient of every row each) times the rows.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from flymc_dist import diagnostics
from flymc_dist.models import LogisticRegression, RobustRegression


def import_numpyro() -> tuple[Any, Any, Any]:
    """``(jax, numpyro, numpyro.distributions)``, float64 enabled, or an ImportError
    naming the extra."""
    try:
        import jax
        import numpyro
        import numpyro.distributions as dist
    except ImportError as err:
        raise ImportError(
            f"the NumPyro reference needs numpyro and jax: pip install 'flymc_dist[numpyro]' "
            f"({err})"
        ) from None
    jax.config.update("jax_enable_x64", True)
    return jax, numpyro, dist


def numpyro_model(model: Any) -> Any:
    """A NumPyro model function ``f(X, y)`` of the posterior of ``model`` (a
    :class:`~flymc_dist.LogisticRegression` or :class:`~flymc_dist.RobustRegression`
    with a normal or Laplace prior): the weights are the site ``"theta"``.

    Raises
    ------
    ValueError
        For another model or prior.
    """
    if not isinstance(model, LogisticRegression | RobustRegression):
        raise ValueError(
            "the NumPyro reference covers LogisticRegression and RobustRegression, "
            f"not {type(model).__name__}"
        )
    prior, prior_scale = model.prior, model.prior_scale
    if prior not in ("normal", "laplace"):
        raise ValueError(f"the NumPyro reference needs a normal or Laplace prior, not {prior!r}")
    jax, numpyro, dist = import_numpyro()
    jnp = jax.numpy
    robust = isinstance(model, RobustRegression)
    nu, noise = (model.nu, model.scale) if robust else (None, None)
    base = dist.Normal if prior == "normal" else dist.Laplace

    def f(X: Any, y: Any) -> None:
        theta = numpyro.sample("theta", base(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
        mean = jnp.dot(X, theta)
        if robust:
            numpyro.sample("y", dist.StudentT(nu, mean, noise), obs=y)
        else:
            numpyro.sample("y", dist.Bernoulli(logits=mean), obs=y)

    return f


def run_numpyro(
    model: Any,
    X: np.ndarray,
    y: np.ndarray,
    chains: int = 4,
    num_warmup: int = 300,
    num_samples: int = 300,
    seed: int = 0,
) -> dict[str, Any]:
    """NumPyro NUTS on the full data; figures as :func:`flymc_dist.bench.mixing.run_mixing`
    reports them for FlyMC and regular MCMC.

    Parameters
    ----------
    model
        The package's model (see :func:`numpyro_model`).
    X, y
        Every row.
    chains, num_warmup, num_samples
        Chains (run one after another) and their warm-up and kept draws.
    seed
        Seed of ``jax.random.PRNGKey``.

    Returns
    -------
    dict
        ``wall_seconds`` (the whole run, compiling included), ``warmup_seconds``,
        ``sampling_seconds``, ``ess_min``, ``ess_median``, ``r_hat_max``,
        ``min_ess_per_second`` (whole run), ``seconds_per_iteration``,
        ``queries_per_iteration`` (leapfrog steps × rows, sampling),
        ``queries_total`` (warm-up and sampling) and the run's size.
    """
    jax, _, _ = import_numpyro()
    from numpyro.infer import MCMC, NUTS

    f = numpyro_model(model)
    Xj = jax.numpy.asarray(np.asarray(X, dtype=np.float64))
    yj = jax.numpy.asarray(np.asarray(y, dtype=np.float64))
    n_rows = int(X.shape[0])
    mcmc = MCMC(
        NUTS(f, dense_mass=True),
        num_warmup=num_warmup,
        num_samples=num_samples,
        num_chains=chains,
        chain_method="sequential",
        progress_bar=False,
    )
    t0 = time.perf_counter()
    mcmc.warmup(jax.random.PRNGKey(seed), Xj, yj, extra_fields=("num_steps",), collect_warmup=True)
    warm_steps = np.asarray(mcmc.get_extra_fields()["num_steps"], dtype=np.float64)
    t1 = time.perf_counter()
    mcmc.run(mcmc.post_warmup_state.rng_key, Xj, yj, extra_fields=("num_steps",))
    samples = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])
    steps = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["num_steps"], np.float64)
    t2 = time.perf_counter()
    wall = t2 - t0
    flat = samples.reshape(samples.shape[0], samples.shape[1], -1)
    ess = np.atleast_1d(np.asarray(diagnostics.ess_bulk(flat), float))
    r_hat = float(np.max(diagnostics.rhat(flat)))
    return {
        "wall_seconds": wall,
        "setup_seconds": 0.0,
        "warmup_seconds": t1 - t0,
        "sampling_seconds": t2 - t1,
        "draws": int(samples.shape[1]),
        "warmup": int(num_warmup),
        "chains": int(samples.shape[0]),
        "ess_min": float(ess.min()),
        "ess_median": float(np.median(ess)),
        "r_hat_max": r_hat,
        "converged": bool(r_hat <= 1.01),
        "min_ess_per_second": float(ess.min()) / wall if wall > 0 else float("nan"),
        # one iteration of every chain, as the package's samplers step them together
        "seconds_per_iteration": wall / (num_warmup + num_samples),
        "round_trips_per_iteration": float("nan"),
        "queries_per_iteration": float(steps.mean() * n_rows),
        "queries_total": float((warm_steps.sum() + steps.sum()) * n_rows),
        "bright_rows_per_chain": float(n_rows),
        "bright_replica": False,
        "n_rows": n_rows,
    }
