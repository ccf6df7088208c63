"""The statistical proof that every sampler combination targets the exact posterior.

Every combination of algorithm (regular; FlyMC with untuned or MAP-tuned bounds and
implicit or explicit z-updates) and θ-kernel (RWMH, MALA, slice) is run on three small,
visibly non-Gaussian problems (logistic, robust Student-t, softmax with K = 3) and its
draws are compared with an independent quadrature reference (:mod:`references`, which
does not import the package) by one battery, :func:`check_against`.

The battery has negative controls that must fail it, robustly (large z), not marginally:

* FlyMC with the dark→bright acceptance sign flipped (the paper's Algorithm 2 typo,
  shipped by a known fork);
* the correct sampler's draws against the posterior of a different prior scale, and of
  a shifted data set.

Run settings (all runs): 4 chains × (400 warm-up + 1600 kept draws; HMC and NUTS 200 + 600,
see :data:`DRAWS`), 2 shards,
``client="synchronous"``, a fixed seed of its own per run (:func:`run_seed`). FlyMC uses
``q_db = 0.1`` and ``resample_fraction = 0.25`` rather than the defaults (``"auto"``,
0.1): with only 25–50 rows per shard the defaults move z so rarely that the θ chains
need several times more iterations for the same ESS. Exactness holds
for every value of these knobs, so the test loses nothing.

The 112 runs, and the 6 with exact rows, are independent and deterministic: each test
makes its own (a fixed seed of its own, in-process shards), and pytest-xdist spreads the
tests over the cores. The negative controls reuse the runs of :data:`CONTROL_COMBO` and
:data:`OOC_CONTROL_COMBO`, made once per process: their tests share an xdist group.

By default a covering subset runs (:data:`SUBSET`, 16 of the 112 runs and 3 of the 6 with
exact rows, every negative control): every model, kernel and value of every axis that the
grid holds. ``pytest --full-grid`` (CI) runs every run. The family-wise false-alarm rate
is :data:`FAMILY_ALPHA` over the runs of the grid that runs (:func:`run_alpha`). In the
durations of a CI run on a clean clone (2 cores, cold compile caches) the full file took
943 s, this subset's tests 110 s (the earlier subset of every pair of values: 254 s).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field

import exact_rows
import numpy as np
import pytest
import references as R
from scipy import stats

import flymc_dist as fd
import flymc_dist.brightness as brightness_module
import flymc_dist.replica as replica_module
import flymc_dist.shard.batched as batched_module
import flymc_dist.shard.rows as rows_module
import flymc_dist.shard.state as shard_module
from flymc_dist.diagnostics import ess_mean
from flymc_dist.terms import BoundViolation

CHAINS = 4
NUM_WARMUP = 400
NUM_SAMPLES = 1600
#: (warm-up, kept draws) per chain where they differ from the above (see :func:`draws`).
#: HMC's and NUTS's draws are 3-10x as effective as RWMH's (measured on this battery with
#: 400 + 1600: min ESS 760-8,200 against RWMH's 380-430), so with fewer kept draws their
#: ESS (and the power of the check, whose tolerances follow the ESS) stays near RWMH's, at
#: a fraction of their cost, which was most of the file's. 200 warm-up draws hold Stan's
#: windowed adaptation unshrunk: 75 fast, slow windows of 25 and 50, 50 fast. Since FlyMC
#: estimates its metric from successive draws (``metric_from="differences"``), 600 kept
#: draws gave an ESS of 83-84 in two runs (untuned HMC and MAP-tuned NUTS, both with
#: explicit z-updates): 900 keep every run above 100.
DRAWS = {"hmc": (200, 900), "nuts": (200, 900)}


def draws(combo: tuple) -> tuple[int, int]:
    """(warm-up, kept draws) per chain of a run of ``combo``: :data:`DRAWS` for its
    kernel, except with the shards evaluating every point (mode "shards"), where
    gradients come from a z that moves only between iterations and the ESS per draw of
    the untuned or explicit FlyMC runs fell below 100 with 600 draws."""
    if combo[4] == "shards":
        return NUM_WARMUP, NUM_SAMPLES
    return DRAWS.get(combo[2], (NUM_WARMUP, NUM_SAMPLES))


N_SHARDS = 2
SEED = 20240601
FLYMC_OPTIONS = {"q_db": 0.1, "resample_fraction": 0.25}

MODEL_CLASSES = {
    "logistic": fd.LogisticRegression,
    "robust": fd.RobustRegression,
    "softmax": fd.SoftmaxRegression,
}
KERNELS = ("rwmh", "mala", "slice", "hmc", "nuts")
#: kernels that evaluate several points per iteration: by default ("auto") FlyMC runs
#: them on the driver's replica of the bright rows; they also run with the shards
#: evaluating every point (bright_replica=False), and RWMH also on the replica
MULTI_EVAL = ("mala", "slice", "hmc", "nuts")
#: (algorithm, bounds, kernel, z_update, mode); bounds/z_update/mode are None for regular
#: MCMC; mode None is the default bright_replica="auto", else "replica" or "shards"
COMBINATIONS = (
    [("regular", None, k, None, None) for k in KERNELS]
    + [
        ("flymc", b, k, z, None)
        for b in ("untuned", "map")
        for k in KERNELS
        for z in ("implicit", "explicit")
    ]
    + [
        ("flymc", b, k, z, "shards")
        for k in MULTI_EVAL
        for b, z in (("untuned", "implicit"), ("map", "explicit"))
    ]
    + [("flymc", "map", "rwmh", "implicit", "replica")]
)
#: out-of-core shards (mode "ooc": rows in a store of OOC_CHUNK_ROWS-row chunks, streamed into
#: local row files, the z-updates reading the rows they propose): every kernel with the
#: implicit update, and the explicit update, untuned bounds and regular MCMC with one each
OOC_COMBINATIONS = (
    [("flymc", "map", k, "implicit", "ooc") for k in KERNELS]
    + [("flymc", "map", k, "explicit", "ooc") for k in ("rwmh", "nuts")]
    + [("flymc", "untuned", "rwmh", "implicit", "ooc"), ("regular", None, "rwmh", None, "ooc")]
)
OOC_MODELS = ("logistic", "robust")
OOC_CHUNK_ROWS = 8
#: (model, combination) of the in-memory runs: every pair, except softmax with the shards
#: evaluating every point (their evaluation is the models' shared code, which the logistic
#: and robust runs in that mode cover; softmax runs every kernel on the replica)
CASES = [
    (name, combo)
    for name in MODEL_CLASSES
    for combo in COMBINATIONS
    if not (name == "softmax" and combo[4] == "shards")
]
OOC_CASES = [(name, combo) for combo in OOC_COMBINATIONS for name in OOC_MODELS]
N_RUNS = len(CASES) + len(OOC_CASES)
#: the runs of the default (covering) subset, in-memory and out-of-core: each negative
#: control's run, and then few and cheap runs (by CI's durations) that hold, in memory and
#: out of core, every value of every axis (model, algorithm, bounds, kernel, z-update,
#: mode) its grid holds (``test_subset_covers_every_value_of_the_grid`` checks it); CI
#: runs the full grid
SUBSET = {
    # the negative controls' runs
    ("logistic", ("flymc", "map", "rwmh", "implicit", None)),
    ("robust", ("flymc", "map", "rwmh", "implicit", None)),
    ("softmax", ("flymc", "map", "rwmh", "implicit", None)),
    ("logistic", ("flymc", "map", "rwmh", "implicit", "ooc")),
    # in memory
    ("logistic", ("regular", None, "hmc", None, None)),
    ("logistic", ("flymc", "untuned", "nuts", "implicit", None)),
    ("logistic", ("flymc", "map", "rwmh", "implicit", "replica")),
    ("robust", ("flymc", "map", "mala", "implicit", None)),
    ("robust", ("flymc", "map", "slice", "explicit", "shards")),
    ("softmax", ("flymc", "untuned", "hmc", "explicit", None)),
    # out of core (a test of its own: every value of its axes again)
    ("logistic", ("regular", None, "rwmh", None, "ooc")),
    ("logistic", ("flymc", "untuned", "rwmh", "implicit", "ooc")),
    ("logistic", ("flymc", "map", "nuts", "explicit", "ooc")),
    ("robust", ("flymc", "map", "mala", "implicit", "ooc")),
    ("robust", ("flymc", "map", "slice", "implicit", "ooc")),
    ("robust", ("flymc", "map", "hmc", "implicit", "ooc")),
}
#: family-wise false-alarm rate of the runs checked in one session (see :func:`run_alpha`)
FAMILY_ALPHA = 0.01
#: z bound for the second moments (sd, correlation), whose standard errors are rougher
SECOND_MOMENT_Z = 5.0
#: below this ESS a run cannot vouch for anything: the battery fails it
MIN_ESS = 100.0


# --------------------------------------------------------------------------------------------
# the battery
# --------------------------------------------------------------------------------------------
@dataclass
class BatteryResult:
    """What :func:`check_against` found: z-scores per statistic and the verdict."""

    z_mean: np.ndarray  # (P,)
    z_sd: np.ndarray  # (P,)
    z_corr: np.ndarray  # (P, P), zero on the diagonal
    ess: np.ndarray  # (P,) ESS of the mean
    crit_mean: float
    crit_second: float
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def worst(self) -> float:
        """Largest |z| of any statistic."""
        return float(
            max(np.max(np.abs(self.z_mean)), np.max(np.abs(self.z_sd)), np.max(np.abs(self.z_corr)))
        )

    def __str__(self) -> str:
        return (
            f"z_mean={np.round(self.z_mean, 2)} (crit {self.crit_mean:.2f}), "
            f"z_sd={np.round(self.z_sd, 2)}, "
            f"z_corr={np.round(self.z_corr[np.triu_indices_from(self.z_corr, 1)], 2)} "
            f"(crit {self.crit_second:.1f}), ess={np.round(self.ess)}; "
            f"failures: {self.failures or 'none'}"
        )


def _ess(x: np.ndarray) -> np.ndarray:
    """ESS of the mean of every column of (chains, draws, P) draws (split-chain, multi-chain)."""
    return np.atleast_1d(np.asarray(ess_mean(x), float))


def check_against(
    samples: np.ndarray, ref_mean: np.ndarray, ref_cov: np.ndarray, *, alpha: float
) -> BatteryResult:
    """Compare MCMC draws with a reference posterior's mean, sd and correlations.

    Parameters
    ----------
    samples
        Draws, ``(chains, draws, *param_shape)`` with ≥ 4 chains; flattened to P columns.
    ref_mean, ref_cov
        The reference posterior mean (P,) and covariance (P, P).
    alpha
        False-alarm probability of the whole battery for one correct run.

    Tolerances
    ----------
    * **Mean** of each parameter: ``z = (mean − ref_mean) / MCSE`` with
      ``MCSE = sd / sqrt(ESS)``, ESS the multi-chain split-chain ESS of the mean
      (:func:`flymc_dist.diagnostics.ess_mean`, i.e. with the between-chain variance, so
      chains stuck in different places shrink it). Requires ``|z| < Φ⁻¹(1 − α/(2P))``
      (Bonferroni over the P means): 4.08 for P = 2 and 4.18 for P = 3 at
      α = 0.01 / 112 (a 1 % family-wise false-alarm rate over the full grid's 112 runs),
      3.60 and 3.71 at α = 0.01 / 16 (the default subset's 16 runs; :func:`run_alpha`).
    * **Standard deviation**: with ``d = x − mean``, the sample variance is the mean of
      ``d²``, so ``SE(var) = sd(d²) / sqrt(ESS(d²))`` and ``SE(sd) = SE(var) / (2 sd)``.
      For Gaussian draws this is the familiar relative error ``1 / sqrt(2·ESS)``; the
      moment form also covers the skewed, heavier-tailed marginals used here. Requires
      ``|z| < 5`` standard errors.
    * **Correlation** of each pair: the mean of ``u = d_i d_j / (sd_i sd_j)`` estimates
      ρ; ``SE = sd(u) / sqrt(ESS(u))`` (ignoring that the sds are estimated, which only
      makes it conservative). Requires ``|z| < 5``.
    * **ESS** of every mean ≥ 100, otherwise the run proves nothing and fails.

    Returns
    -------
    BatteryResult
        ``passed`` and the z-scores; the failure list says which check failed.
    """
    C = samples.shape[0]
    if C < 4:
        raise ValueError(f"the battery needs at least 4 chains, got {C}")
    x = np.asarray(samples, float).reshape(C, samples.shape[1], -1)
    P = x.shape[2]
    ref_mean = np.asarray(ref_mean, float).reshape(P)
    ref_cov = np.asarray(ref_cov, float).reshape(P, P)
    ref_sd = np.sqrt(np.diag(ref_cov))
    ref_corr = ref_cov / np.outer(ref_sd, ref_sd)

    mean = x.mean(axis=(0, 1))
    d = x - mean
    sd = np.sqrt((d**2).mean(axis=(0, 1)))
    ess = _ess(x)
    z_mean = (mean - ref_mean) / (sd / np.sqrt(ess))

    d2 = d**2
    se_var = d2.reshape(-1, P).std(axis=0) / np.sqrt(_ess(d2))
    z_sd = (sd - ref_sd) / (se_var / (2.0 * sd))

    z_corr = np.zeros((P, P))
    for i in range(P):
        for j in range(i + 1, P):
            u = d[..., i] * d[..., j] / (sd[i] * sd[j])
            se = u.std() / math.sqrt(float(_ess(u[..., None])[0]))
            z_corr[i, j] = z_corr[j, i] = (u.mean() - ref_corr[i, j]) / se

    crit = float(stats.norm.isf(alpha / (2 * P)))
    res = BatteryResult(z_mean, z_sd, z_corr, ess, crit, SECOND_MOMENT_Z)
    if not np.all(np.isfinite(ess)) or np.any(ess < MIN_ESS):
        res.failures.append(f"ESS {np.round(ess)} below {MIN_ESS:.0f}")
    if np.any(~(np.abs(z_mean) < crit)):
        res.failures.append(f"mean off: z={np.round(z_mean, 2)}")
    if np.any(~(np.abs(z_sd) < SECOND_MOMENT_Z)):
        res.failures.append(f"sd off: z={np.round(z_sd, 2)}")
    if np.any(~(np.abs(z_corr) < SECOND_MOMENT_Z)):
        res.failures.append("correlation off")
    return res


# --------------------------------------------------------------------------------------------
# problems, references and runs (cached per module; runs spread over the machine's cores)
# --------------------------------------------------------------------------------------------
_PROBLEMS: dict[str, R.Problem] = {}
_REFERENCES: dict[tuple, R.Moments] = {}
#: the run the negative controls reuse
CONTROL_COMBO = ("flymc", "map", "rwmh", "implicit", None)
#: the out-of-core run its negative control reuses
OOC_CONTROL_COMBO = ("flymc", "map", "rwmh", "implicit", "ooc")


def problem(name: str) -> R.Problem:
    if name not in _PROBLEMS:
        _PROBLEMS[name] = R.PROBLEMS[name]()
    return _PROBLEMS[name]


def reference(name: str, **perturbation: float) -> R.Moments:
    key = (name, tuple(sorted(perturbation.items())))
    if key not in _REFERENCES:
        prob = problem(name) if not perturbation else R.PROBLEMS[name](**perturbation)
        _REFERENCES[key] = prob.reference()
    return _REFERENCES[key]


def run_seed(name: str, combo: tuple) -> int:
    """The fixed seed of one run, distinct for every (problem, combination).

    Runs sharing a seed share their random numbers (the kernel streams and the initial
    jitter are keyed by seed and chain only), and chains driven by common random numbers
    track each other: with one seed for all, regular and FlyMC draws of the same kernel
    were correlated (≈ 0.2 draw by draw), so the 45 checks were not independent tests.
    """
    index = (
        COMBINATIONS.index(combo) if combo in COMBINATIONS else 500 + OOC_COMBINATIONS.index(combo)
    )
    return SEED + 1000 * list(MODEL_CLASSES).index(name) + index


def run_sampler(name: str, combo: tuple) -> fd.Result:
    """One run of the package's sampler on problem ``name`` with ``combo``."""
    algorithm, bounds, kernel, z_update, mode = combo
    prob = problem(name)
    options = dict(FLYMC_OPTIONS) if algorithm == "flymc" else {}
    if mode == "ooc":
        with tempfile.TemporaryDirectory() as tmp:
            store = fd.from_numpy(
                prob.X, prob.y, os.path.join(tmp, "data.zarr"), chunk_rows=OOC_CHUNK_ROWS
            )
            options.update(out_of_core=True)
            res = _sample(name, combo, store, options)
        if not all(res.info["out_of_core"]):
            raise RuntimeError(f"the shards were not out of core: {res.info['out_of_core']}")
        if res.info["lost_rows"]:  # read back in production, an invariant broken here
            raise RuntimeError(f"{res.info['lost_rows']} bright rows were read back")
        return res
    if mode is not None:
        options["bright_replica"] = mode == "replica"
    return _sample(name, combo, (prob.X, prob.y), options)


def _sample(name: str, combo: tuple, data: object, options: dict) -> fd.Result:
    """The run of ``combo`` on problem ``name``'s ``data``; ``options`` are the FlyMC
    algorithm's and ``out_of_core`` (the placement's)."""
    algorithm, bounds, kernel, z_update, _ = combo
    prob = problem(name)
    options = dict(options)
    placement = {k: options.pop(k) for k in ("out_of_core",) if k in options}
    return fd.sample(
        MODEL_CLASSES[name](**prob.settings),
        data,
        fd.FlyMC(bounds=bounds, z_update=z_update, **options)
        if algorithm == "flymc"
        else fd.Regular(),
        kernel,
        num_warmup=draws(combo)[0],
        num_samples=draws(combo)[1],
        chains=CHAINS,
        seed=run_seed(name, combo),
        client="synchronous",
        placement=fd.Placement(n_shards=N_SHARDS, **placement),
        progress=False,
    )


#: the runs made in this process, by (problem, combination, exact rows?): the negative
#: controls reuse the run of :data:`CONTROL_COMBO` (their tests share its xdist group)
_RUNS: dict[tuple, fd.Result] = {}


def cached_run(name: str, combo: tuple, exact: bool = False) -> fd.Result:
    """The run of ``combo`` on problem ``name`` (``exact``: :func:`exact_run`'s), made once
    per process. Every run is independent and deterministic (a fixed seed of its own,
    in-process shards), so where and when it runs does not change its draws."""
    key = (name, combo, exact)
    if key not in _RUNS:
        _RUNS[key] = exact_run(name, combo) if exact else run_sampler(name, combo)
    return _RUNS[key]


#: the xdist group of the tests that read the control runs: one worker makes each run once
CONTROL_GROUP = pytest.mark.xdist_group("exactness-control")


#: the mark of the runs left out of the default subset (tests/conftest.py deselects them
#: unless pytest runs with ``--full-grid``)
FULL_GRID = pytest.mark.full_grid


def _cases(pairs: list[tuple[str, tuple]]) -> list:
    """``(name, combo)`` parameters, those of a control run in :data:`CONTROL_GROUP`, those
    outside :data:`SUBSET` marked :data:`FULL_GRID`."""
    return [
        pytest.param(
            name,
            combo,
            id=f"{name}-{_combo_id(combo)}",
            marks=([CONTROL_GROUP] if combo in (CONTROL_COMBO, OOC_CONTROL_COMBO) else [])
            + ([] if (name, combo) in SUBSET else [FULL_GRID]),
        )
        for name, combo in pairs
    ]


@pytest.fixture
def run_alpha(request: pytest.FixtureRequest) -> float:
    """The false-alarm probability of one run's battery: :data:`FAMILY_ALPHA` over the
    runs of the grid this session checks (the full grid's :data:`N_RUNS` with
    ``--full-grid``, else :data:`SUBSET`'s)."""
    n_runs = N_RUNS if request.config.getoption("full_grid") else len(SUBSET)
    return FAMILY_ALPHA / n_runs


def axis_values(name: str, combo: tuple) -> set[tuple[str, object]]:
    """The (axis, value) pairs of the run of ``combo`` on problem ``name`` (axes: model,
    algorithm, bounds, kernel, z-update, mode)."""
    axes = ("model", "algorithm", "bounds", "kernel", "z_update", "mode")
    return set(zip(axes, (name, *combo), strict=True))


def _combo_id(combo: tuple) -> str:
    return "-".join(c for c in combo if c is not None)


# --------------------------------------------------------------------------------------------
# the references themselves
# --------------------------------------------------------------------------------------------
#: the problems as parameters, softmax's slow: its 3-D quadrature reference costs seconds,
#: which the runs on it share in a full session, but not the edit-test loop
PROBLEM_PARAMS = [
    pytest.param(name, marks=[pytest.mark.slow] if name == "softmax" else [])
    for name in MODEL_CLASSES
]


@pytest.mark.parametrize("name", PROBLEM_PARAMS)
def test_reference_is_converged_and_non_gaussian(name):
    """The grid holds the mass, a coarser grid agrees, and the posterior is not Gaussian."""
    prob = problem(name)
    ref = reference(name)
    assert ref.boundary_logratio < -12.0  # density on the box edge < e^-12 of the mode
    coarse = prob.reference(n=200 if prob.x0.size == 2 else 45)
    np.testing.assert_allclose(coarse.mean, ref.mean, atol=1e-4 * ref.sd.min())
    np.testing.assert_allclose(coarse.sd, ref.sd, rtol=1e-4)
    if name in ("logistic", "robust"):
        assert np.max(np.abs(ref.skewness)) > 0.2  # visibly skewed


@pytest.mark.parametrize("name", PROBLEM_PARAMS)
def test_reference_log_density_matches_package_model(name):
    """Cross-check of the two independent implementations (up to a θ-free constant)."""
    prob = problem(name)
    model = MODEL_CLASSES[name](**prob.settings)
    rng = np.random.default_rng(0)
    thetas = reference(name).mean + rng.normal(size=(7, prob.x0.size))
    eta = model.linear_predictor(thetas, prob.X)
    pkg = model.loglik(eta, prob.y).sum(axis=1) + model.log_prior(thetas)
    np.testing.assert_allclose(pkg, prob.logpost(thetas), rtol=1e-10, atol=1e-8)


# --------------------------------------------------------------------------------------------
# every combination against the reference
# --------------------------------------------------------------------------------------------
def test_subset_covers_every_value_of_the_grid():
    """The default subset holds every negative control's run and every value of every axis
    that the full grid holds (every model, algorithm, bounds, kernel, z-update and mode),
    and so do the runs with exact rows."""
    assert SUBSET <= set(CASES + OOC_CASES)
    assert {(n, CONTROL_COMBO) for n in MODEL_CLASSES} | {("logistic", OOC_CONTROL_COMBO)} <= SUBSET
    exact_grid = [(n, c) for c in EXACT_COMBOS for n in MODEL_CLASSES]
    assert EXACT_SUBSET <= set(exact_grid)
    # each test's grid: in memory, out of core, with exact rows
    for grid, subset in ((CASES, SUBSET), (OOC_CASES, SUBSET), (exact_grid, EXACT_SUBSET)):
        runs = [case for case in grid if case in subset]
        missing = set().union(*(axis_values(*case) for case in grid)) - set().union(
            *(axis_values(*case) for case in runs)
        )
        assert not missing, f"the subset misses {sorted(missing, key=str)}"


@pytest.mark.slow
@pytest.mark.parametrize("name, combo", _cases(CASES))
def test_targets_exact_posterior(name, combo, run_alpha):
    ref = reference(name)
    res = cached_run(name, combo)
    assert res.samples.shape[:2] == (CHAINS, draws(combo)[1])
    assert np.all(np.isfinite(res.samples))
    result = check_against(res.samples, ref.mean, ref.cov, alpha=run_alpha)
    print(f"{name} {_combo_id(combo)}: worst |z| {result.worst:.2f}; {result}")
    assert result.passed, f"{name} {_combo_id(combo)}: {result}"


@pytest.mark.slow
@pytest.mark.parametrize("name, combo", _cases(OOC_CASES))
def test_out_of_core_exact(name, combo, run_alpha):
    """Out-of-core shards (rows in local row files, the z-updates reading the rows they
    propose) target the exact posterior too."""
    ref = reference(name)
    res = cached_run(name, combo)
    assert res.samples.shape[:2] == (CHAINS, draws(combo)[1])
    result = check_against(res.samples, ref.mean, ref.cov, alpha=run_alpha)
    print(f"{name} {_combo_id(combo)}: worst |z| {result.worst:.2f}; {result}")
    assert result.passed, f"{name} {_combo_id(combo)}: {result}"


# --------------------------------------------------------------------------------------------
# negative controls: the battery must see an error
# --------------------------------------------------------------------------------------------
def _flipped_brighten(log_u, vals, q):
    """The fork's bug: dark→bright accepted when u > L~/q (Algorithm 2, line 10, literally)."""
    return log_u > vals - math.log(q)  # wrong sign


@pytest.mark.slow
@CONTROL_GROUP
@pytest.mark.parametrize("name", ["logistic", "robust"])
def test_negative_control_flipped_z_sign_fails(monkeypatch, name, run_alpha):
    """FlyMC with Algorithm 2's typo must fail the battery by a wide margin."""
    good = cached_run(name, CONTROL_COMBO)
    # every implicit z-update (per chain in flymc_dist.brightness, all chains at once in
    # the shard's compiled path, and on the driver's replica with read-ahead) takes its
    # dark→bright decision from `brighten`, looked up by name in its module: flip it in
    # all three — the brightness check below proves the patch took effect
    for module in (batched_module, replica_module):
        assert hasattr(module, "brighten"), f"{module.__name__} no longer calls brighten"
        monkeypatch.setattr(module, "brighten", _flipped_brighten)
    monkeypatch.setattr(brightness_module, "brighten", _flipped_brighten)
    bad = run_sampler(name, CONTROL_COMBO)  # here, in this process: the patch applies
    # the patch took effect: the chains are far too bright
    assert bad.stats["n_bright"].mean() > 3 * good.stats["n_bright"].mean()
    ref = reference(name)
    result = check_against(bad.samples, ref.mean, ref.cov, alpha=run_alpha)
    print(
        f"flipped sign, {name}: worst |z| {result.worst:.1f}; bright "
        f"{bad.stats['n_bright'].mean():.1f} vs {good.stats['n_bright'].mean():.1f}; {result}"
    )
    assert not result.passed
    assert result.worst > 2 * result.crit_mean, str(result)


def _constants_left_out(original):
    """The out-of-core trap: rows read by position from the row file get their features
    but not their row constants (left zero), which live beside the features only for
    the rows a shard holds: every proposal, and every row it brings in, is evaluated
    against the wrong bound."""

    def prepared(self, X, y):
        XC, xi = original(self, X, y)
        XC[:, self.n_features :] = 0.0
        return XC, xi

    return prepared


@pytest.mark.slow
@CONTROL_GROUP
@pytest.mark.parametrize("name", ["logistic"])
def test_negative_control_out_of_core_rows_without_constants_fail(monkeypatch, name, run_alpha):
    """Out of core, evaluating the rows read by position without their row constants
    must fail."""
    good = cached_run(name, OOC_CONTROL_COMBO)
    monkeypatch.setattr(
        rows_module.FileRows, "_prepared", _constants_left_out(rows_module.FileRows._prepared)
    )
    try:
        bad = run_sampler(name, OOC_CONTROL_COMBO)  # here, in this process: the patch applies
    except BoundViolation as e:
        # the bound guard sees it first: a row evaluated above its likelihood stops the run
        assert "exceeds the likelihood at row" in str(e)
        return
    ref = reference(name)
    result = check_against(bad.samples, ref.mean, ref.cov, alpha=run_alpha)
    print(
        f"rows without constants, {name}: worst |z| {result.worst:.1f}; bright "
        f"{bad.stats['n_bright'].mean():.2f} vs {good.stats['n_bright'].mean():.2f}; {result}"
    )
    assert bad.stats["n_bright"].mean() < good.stats["n_bright"].mean()  # it took effect
    assert not result.passed
    assert result.worst > 2 * result.crit_mean, str(result)


#: wrong targets: a different prior scale, and a shifted data set (x or y moved)
WRONG_TARGETS = [
    ("logistic", {"prior_scale": 1.0}),
    ("logistic", {"shift": 0.25}),
    ("robust", {"prior_scale": 0.2}),
    ("robust", {"shift": 0.5}),
    ("softmax", {"prior_scale": 0.6}),
    ("softmax", {"shift": 1.0}),
]


@pytest.mark.slow
@CONTROL_GROUP
@pytest.mark.parametrize(
    "name,perturbation", WRONG_TARGETS, ids=[f"{n}-{next(iter(p))}" for n, p in WRONG_TARGETS]
)
def test_negative_control_wrong_target_fails(name, perturbation, run_alpha):
    """The correct sampler's draws must fail against a slightly different posterior."""
    res = cached_run(name, CONTROL_COMBO)
    right = check_against(res.samples, reference(name).mean, reference(name).cov, alpha=run_alpha)
    assert right.passed, str(right)
    wrong = reference(name, **perturbation)
    result = check_against(res.samples, wrong.mean, wrong.cov, alpha=run_alpha)
    print(f"wrong target {name} {perturbation}: worst |z| {result.worst:.1f}; {result}")
    assert not result.passed
    assert result.worst > 2 * result.crit_mean, str(result)


# --------------------------------------------------------------------------------------------
# exact rows: rows at loose tight points, bright at every step
# --------------------------------------------------------------------------------------------
EXACT_COMBOS = [
    ("flymc", "map", "nuts", "implicit", None),
    ("flymc", "untuned", "rwmh", "explicit", None),
]


def _exact_rule(name: str) -> tuple[int, float, int]:
    """The exact rows of problem ``name`` in these tests: the half of the rows with the
    larger ``x²`` in the last column, as ``(column, threshold, how many rows)``."""
    X = problem(name).X
    x2 = X[:, -1] ** 2
    threshold = float(np.median(x2))
    return X.shape[1] - 1, threshold, int(np.sum(x2 >= threshold))


def _exact_run(name: str, combo: tuple, force_exact_rows) -> tuple[fd.Result, int]:
    """A run whose exact rows are :func:`_exact_rule`'s; returns it and how many rows
    that is. ``force_exact_rows`` is the conftest fixture of that name."""
    column, threshold, n_exact = _exact_rule(name)
    force_exact_rows(column, threshold)
    return _sample(name, combo, (problem(name).X, problem(name).y), dict(FLYMC_OPTIONS)), n_exact


def exact_run(name: str, combo: tuple) -> fd.Result:
    """:func:`_exact_run` with the patch of the conftest fixture ``force_exact_rows``
    (:func:`exact_rows.force_exact_rows`) made here and undone afterwards: its run is
    cached for the process (:func:`cached_run`), beyond one test's fixtures."""
    column, threshold, _ = _exact_rule(name)
    with pytest.MonkeyPatch.context() as mp:
        exact_rows.force_exact_rows(mp, column, threshold)
        return _sample(name, combo, (problem(name).X, problem(name).y), dict(FLYMC_OPTIONS))


#: the runs with exact rows of the default subset: every model and both combinations
EXACT_SUBSET = {
    ("logistic", EXACT_COMBOS[0]),
    ("robust", EXACT_COMBOS[1]),
    ("softmax", EXACT_COMBOS[1]),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, combo",
    [
        pytest.param(
            name,
            combo,
            id=f"{name}-{_combo_id(combo)}",
            marks=[] if (name, combo) in EXACT_SUBSET else [FULL_GRID],
        )
        for combo in EXACT_COMBOS
        for name in MODEL_CLASSES
    ],
)
def test_exact_rows_exact(name, combo, run_alpha):
    """``exact_rows``: half the rows at the model's loose tight points are bright in every
    chain at every iteration (each θ-step evaluates their log-likelihood), the other half
    are FlyMC's as usual; the posterior stays the exact one."""
    res, n_exact = cached_run(name, combo, exact=True), _exact_rule(name)[2]
    assert res.info["exact_rows"] == n_exact > 0
    assert res.stats["n_bright"].min() >= n_exact  # never dark
    assert res.stats["n_bright"].max() < problem(name).X.shape[0]  # FlyMC rows remain
    result = check_against(res.samples, reference(name).mean, reference(name).cov, alpha=run_alpha)
    print(f"exact rows, {name} {_combo_id(combo)}: worst |z| {result.worst:.2f}; {result}")
    assert result.passed, f"{name} {_combo_id(combo)}: {result}"


def _bound_without_exact_rows(self, X, y, xi):
    """The trap on the exact rows: leaving their bound out of the collapsed sum ("they are
    evaluated exactly, so they need no bound") — but their bright term is still
    ``log(L/B − 1)``, so the target gains a factor ``1/B`` per exact row."""
    keep = ~self._exact_mask(X)
    return self.model.suffstats(X[keep], y[keep], xi[keep])


@pytest.mark.slow
def test_negative_control_exact_rows_without_their_bound_fails(
    monkeypatch, force_exact_rows, run_alpha
):
    """Dropping the exact rows' bound from the collapsed sum must fail the battery by a
    wide margin. (Logistic: its loose bound ``≈ −2500 + s/2`` depends on θ; robust
    regression's is flat to 1e-16 there, so the same mistake would cost it nothing.)"""
    monkeypatch.setattr(shard_module.Shard, "_bound_block", _bound_without_exact_rows)
    bad, n_exact = _exact_run("logistic", EXACT_COMBOS[0], force_exact_rows)
    assert bad.info["exact_rows"] == n_exact > 0
    ref = reference("logistic")
    result = check_against(bad.samples, ref.mean, ref.cov, alpha=run_alpha)
    print(f"exact rows without their bound: worst |z| {result.worst:.1f}; {result}")
    assert not result.passed
    assert result.worst > 2 * result.crit_mean, str(result)
