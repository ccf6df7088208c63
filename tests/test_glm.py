"""GLM families with bounds from a curvature bound (:mod:`flymc_dist.models.families`).

Deterministic checks of every family's bound (B ≤ f at random (η, y) including
extremes, tight at ξ, collapsed sum == explicit sum, compiled log L̃ == numpy's), then
the statistical proof: each new family's FlyMC and regular draws against a 2-D
quadrature posterior written here with scipy.stats (independent of the package), with
the ESS-based battery of ``test_exactness``, 4 chains; and a negative control, a
Bernoulli-logit family declaring half its curvature, that the set-up refuses.
"""

from __future__ import annotations

import functools
import json
import math

import numba
import numpy as np
import pytest
import references as R
from scipy import special, stats
from test_exactness import check_against

import flymc_dist as fd
from flymc_dist import _compiled
from flymc_dist.models import make_model, model_from_dict
from flymc_dist.terms import bright_terms

#: (family, parameters, target generator given a rng and n)
FAMILY_CASES = {
    "logit5": ("binomial", {"trials": 5}, lambda g, n: g.integers(0, 6, n)),
    "probit": ("binomial", {"link": "probit"}, lambda g, n: g.integers(0, 2, n)),
    "probit3": ("binomial", {"link": "probit", "trials": 3}, lambda g, n: g.integers(0, 4, n)),
    "negbin": ("negative_binomial", {"dispersion": 2.5}, lambda g, n: g.integers(0, 40, n)),
    "gaussian": ("gaussian", {"scale": 0.7}, lambda g, n: 5.0 * g.normal(size=n)),
}


def _case(name: str, n: int, seed: int = 0):
    family, params, gen = FAMILY_CASES[name]
    g = np.random.default_rng(seed)
    y = gen(g, n).astype(float)
    xi = g.normal(size=n) * g.choice([0.01, 1.0, 10.0, 60.0], n)
    eta = g.normal(size=(4, n)) * g.choice([0.01, 1.0, 10.0, 100.0, 3000.0], (4, n))
    return fd.GLM(family, **params), y, xi, eta[..., None]


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_bound_below_likelihood_and_tight(name):
    m, y, xi, eta = _case(name, 4000)
    ll, lb = m.loglik(eta, y), m.logbound(eta, y, xi)
    assert np.all(np.isfinite(ll)) and np.all(np.isfinite(lb))
    # rounding of the quadratic's terms, ~1e-16 of their size, is all that may cross
    assert np.all(ll - lb >= -1e-14 * (1.0 + np.abs(ll) + np.abs(lb)))
    if name != "gaussian":  # the Gaussian's bound is its likelihood: no strict gap
        far = np.abs(eta[..., 0] - xi) > 1.0
        assert np.all((ll - lb)[far] > 0.0)
    at = xi[None, :, None]
    gap = m.loglik(at, y) - m.logbound(at, y, xi)
    scale = 1.0 + np.abs(m.loglik(at, y)) + xi**2
    assert np.all(gap >= 0.0) and np.all(gap <= 1e-10 * scale)
    # the bound's derivative is f' at the tight point
    _, dl = m.loglik_grad(at, y)
    _, db = m.logbound_grad(at, y, xi)
    np.testing.assert_allclose(db, dl, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_loglik_is_the_families_density(name):
    """``loglik`` against scipy.stats; ``loglik_hess`` against a difference of ``f'``."""
    m, y, _, eta = _case(name, 300)
    e = np.clip(eta[0, :, 0], -8.0, 8.0)
    f = m.family
    if name == "gaussian":
        ref = stats.norm.logpdf(y, e, f.scale)
    elif name == "negbin":
        r = f.dispersion
        ref = stats.nbinom.logpmf(y, r, r / (r + np.exp(e)))
    elif f.link == "logit":
        ref = stats.binom.logpmf(y, f.trials, special.expit(e))
    else:  # binom.logpmf at Φ(e) loses log(1 − Φ(e)) for large e
        ref = (
            stats.binom.logpmf(y, f.trials, 0.5)
            + f.trials * math.log(2.0)
            + y * stats.norm.logcdf(e)
            + (f.trials - y) * stats.norm.logcdf(-e)
        )
    np.testing.assert_allclose(m.loglik(e[None, :, None], y)[0], ref, rtol=1e-9, atol=1e-9)
    h = 1e-5
    _, gp = m.loglik_grad((e + h)[None, :, None], y)
    _, gm = m.loglik_grad((e - h)[None, :, None], y)
    hess = m.loglik_hess(e[:, None], y)[:, 0, 0]
    np.testing.assert_allclose(hess, (gp - gm)[0, :, 0] / (2 * h), rtol=1e-5, atol=1e-6)
    assert np.all(hess >= -f.curvature(y) * (1 + 1e-12))


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_collapsed_sum_equals_explicit_sum(name):
    m, y, xi, _ = _case(name, 500, seed=1)
    g = np.random.default_rng(2)
    X = g.normal(size=(500, 3))
    thetas = 0.3 * g.normal(size=(5, 3))
    st = m.suffstats(X, y, xi)
    explicit = m.logbound(m.linear_predictor(thetas, X), y, xi).sum(axis=1)
    np.testing.assert_allclose(st.value(thetas), explicit, rtol=1e-11)


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_compiled_log_bright_matches_numpy(name):
    m, y, xi, eta = _case(name, 2000, seed=3)
    kind, par = m.compiled_bright()
    XC = np.column_stack([np.ones(y.size), m.row_constants(y, xi)])
    thetas = np.clip(eta[:, :1, 0], -50.0, 50.0)
    out = np.empty((thetas.shape[0], y.size))
    _compiled.eval_rows_at(XC, 1, np.arange(y.size), thetas, _compiled.KINDS[kind], par, out)
    ref, _ = bright_terms(m, np.repeat(thetas[:, :, None], y.size, axis=1), y, xi, False)
    assert np.array_equal(np.isfinite(out), np.isfinite(ref))
    # as δ = ℓ − β = log(1 + L̃): near δ = 0 (the Gaussian's everywhere) log L̃ ≈ log δ
    # magnifies the terms' rounding
    np.testing.assert_allclose(np.logaddexp(0.0, out), np.logaddexp(0.0, ref), atol=1e-9)


def test_targets_validated_per_family():
    with pytest.raises(ValueError, match=r"y\[2\] = 6.0 is not an integer count in 0..5"):
        fd.GLM("binomial", trials=5).validate_targets(np.array([0.0, 5.0, 6.0]))
    with pytest.raises(ValueError, match=r"y\[1\] = -1 is not a non-negative integer"):
        fd.GLM("negative_binomial").validate_targets(np.array([0, -1]))
    with pytest.raises(ValueError, match=r"y\[0\] = 1.5 is not an integer"):
        fd.GLM("binomial", link="probit").validate_targets(np.array([1.5]))
    with pytest.raises(ValueError, match=r"y\[1\] = nan is not finite"):
        fd.GLM("gaussian").validate_targets(np.array([0.0, np.nan]))


def test_poisson_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"curvature .* unbounded below"):
        fd.GLM("poisson")
    with pytest.raises(ValueError, match="unknown family 'gamma'"):
        fd.GLM("gamma")
    with pytest.raises(ValueError, match="link must be 'log'"):
        fd.GLM("negative_binomial", link="identity")


def test_description_round_trip():
    for name, (family, params, _) in FAMILY_CASES.items():
        m = fd.GLM(family, prior="laplace", prior_scale=2.0, **params)
        assert model_from_dict(m.to_dict()) == m, name
        assert make_model("glm", family=family, **params).family.to_dict() == m.family.to_dict()


# ---------------------------------------------------------------------------------------
# exactness against 2-D quadrature
# ---------------------------------------------------------------------------------------
def _problem(name: str, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray, dict, R.LogPost]:
    """About 40 rows, bias + one feature, a normal prior (sd 2); the reference log
    posterior from scipy.stats."""
    g = np.random.default_rng({"probit": 11, "logit5": 12, "negbin": 13, "gaussian": 14}[name])
    N = 40
    x = g.normal(size=N)
    X = np.column_stack([np.ones(N), x])
    eta = 0.3 + 0.8 * x
    family, params, _ = FAMILY_CASES[name]
    if name == "probit":
        y = (g.random(N) < stats.norm.cdf(eta)).astype(float)
    elif name == "logit5":
        y = g.binomial(5, special.expit(eta)).astype(float)
    elif name == "negbin":
        r = params["dispersion"]
        y = g.negative_binomial(r, r / (r + np.exp(eta))).astype(float)
    else:
        y = eta + params["scale"] * g.normal(size=N)
    X = X.copy()
    X[:, 1] += shift
    prior_sd = 2.0

    def logpost(theta: np.ndarray) -> np.ndarray:
        e = np.atleast_2d(theta) @ X.T
        if name == "probit":
            ll = stats.norm.logcdf(np.where(y > 0, e, -e))
        elif name == "logit5":
            ll = stats.binom.logpmf(y, 5, special.expit(e))
        elif name == "negbin":
            r = params["dispersion"]
            ll = stats.nbinom.logpmf(y, r, r / (r + np.exp(e)))
        else:
            ll = stats.norm.logpdf(y, e, params["scale"])
        return ll.sum(axis=1) + stats.norm.logpdf(np.atleast_2d(theta), 0, prior_sd).sum(axis=1)

    model = {"family": family, "prior": "normal", "prior_scale": prior_sd, **params}
    return X, y, model, logpost


@functools.cache
def _family_reference(name: str) -> R.Moments:
    """:func:`_reference` of family ``name``'s problem, made once per process (its three
    runs are checked against it)."""
    return _reference(_problem(name)[3])


def _reference(logpost: R.LogPost) -> R.Moments:
    box = R.laplace_box(logpost, np.zeros(2), width=12.0)
    center = np.array([(lo + hi) / 2 for lo, hi in box])
    basis = np.diag([(hi - lo) / 2 for lo, hi in box])
    return R.grid_moments(logpost, center, basis, 300, width=1.0)


#: (algorithm, bounds, kernel); 4 chains × (300 + 1200)
RUNS = [("flymc", "map", "nuts"), ("flymc", "untuned", "mala"), ("regular", None, "nuts")]
#: 4 families × 3 runs, 1 % family-wise false alarms
ALPHA = 0.01 / (4 * len(RUNS))


def _run(X, y, model_kwargs, algorithm, bounds, kernel, seed):
    if algorithm == "flymc":
        alg = fd.FlyMC(q_db=0.5, resample_fraction=1.0, bounds=bounds)
    else:
        alg = fd.Regular()
    return fd.sample(
        fd.GLM(**model_kwargs),
        (X, y),
        algorithm=alg,
        kernel=kernel,
        num_warmup=300,
        num_samples=1200,
        chains=4,
        seed=seed,
        client="synchronous",
        placement=fd.Placement(n_shards=2),
        progress=False,
    )


#: the (family, run) pairs of the default run: every family and every run once (CI runs
#: all 12; tests/test_tiers.py checks the cover)
DEFAULT_CASES = {
    ("probit", RUNS[0]),
    ("logit5", RUNS[1]),
    ("negbin", RUNS[2]),
    ("gaussian", RUNS[0]),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, run",
    [
        pytest.param(
            name,
            run,
            id="-".join(str(v) for v in (name, *run)),
            marks=[] if (name, run) in DEFAULT_CASES else [pytest.mark.full_grid],
        )
        for run in RUNS
        for name in ["probit", "logit5", "negbin", "gaussian"]
    ],
)
def test_family_exact_against_quadrature(name, run):
    X, y, model, _ = _problem(name)
    ref = _family_reference(name)
    assert ref.boundary_logratio < -20
    seed = 4300 + 10 * ["probit", "logit5", "negbin", "gaussian"].index(name) + RUNS.index(run)
    res = _run(X, y, model, *run, seed)
    verdict = check_against(res.samples, ref.mean, ref.cov, alpha=ALPHA)
    assert verdict.passed, str(verdict)
    if name == "gaussian" and run[0] == "flymc":  # the bound is the likelihood
        assert int(np.max(res.stats["n_bright"])) == 0


@pytest.mark.slow
def test_negative_control_shifted_data_fails():
    """The battery sees a wrong target: probit FlyMC draws against the posterior of the
    data with the feature shifted by 0.4."""
    X, y, model, _ = _problem("probit")
    _, _, _, wrong = _problem("probit", shift=0.4)
    res = _run(X, y, model, "flymc", "map", "nuts", 4399)
    ref = _reference(wrong)
    assert not check_against(res.samples, ref.mean, ref.cov, alpha=ALPHA).passed


# ---------------------------------------------------------------------------------------
# a user-defined family
# ---------------------------------------------------------------------------------------
@numba.njit
def _logit_f(eta: float, y: float) -> float:
    s = eta if y > 0.5 else -eta
    return min(s, 0.0) - math.log1p(math.exp(-abs(s)))


@numba.njit
def _logit_df(eta: float, y: float) -> float:
    return y - 1.0 / (1.0 + math.exp(-eta))


def test_custom_family_is_the_builtin_family():
    """A user's Bernoulli-logit with c = 1/4 gives the built-in binomial's bound."""
    m = fd.GLM(fd.CustomFamily(_logit_f, _logit_df, 0.25, targets="binary"))
    ref = fd.GLM("binomial")
    g = np.random.default_rng(5)
    y = g.integers(0, 2, 300).astype(float)
    xi = m.tuned_xi(g.normal(size=(300, 1)) * 3, y)
    eta = 10 * g.normal(size=(2, 300, 1))
    np.testing.assert_allclose(m.loglik(eta, y), ref.loglik(eta, y), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        m.logbound(eta, y, xi), ref.logbound(eta, y, xi), rtol=1e-12, atol=1e-12
    )
    assert m.compiled_bright() is None


def test_negative_control_custom_family_curvature_too_small_refused():
    """Declaring c = 1/8 for the logit (whose curvature reaches −1/4) is caught at set-up,
    naming the row, η and y."""
    m = fd.GLM(fd.CustomFamily(_logit_f, _logit_df, 0.125, name="halved"))
    g = np.random.default_rng(6)
    y = g.integers(0, 2, 50).astype(float)
    with pytest.raises(ValueError, match=r"bound exceeds f at row \d+ \(eta = .*, y = "):
        m.tuned_xi(g.normal(size=(50, 1)), y)
    X = np.column_stack([np.ones(50), g.normal(size=50)])
    with pytest.raises(ValueError, match="'halved' declares is too small"):
        fd.sample(m, (X, y), num_warmup=10, num_samples=10, client="synchronous", progress=False)


@pytest.mark.slow
def test_custom_family_exact_against_quadrature():
    """The user's logit family, FlyMC with MAP-tuned bounds, against quadrature."""
    g = np.random.default_rng(15)
    N = 40
    X = np.column_stack([np.ones(N), g.normal(size=N)])
    y = (g.random(N) < special.expit(0.3 + X[:, 1])).astype(float)

    def logpost(theta: np.ndarray) -> np.ndarray:
        e = np.atleast_2d(theta) @ X.T
        ll = stats.bernoulli.logpmf(y, special.expit(e))
        return ll.sum(axis=1) + stats.norm.logpdf(np.atleast_2d(theta), 0, 2.0).sum(axis=1)

    ref = _reference(logpost)
    m = fd.GLM(fd.CustomFamily(_logit_f, _logit_df, 0.25, log_concave=True), prior_scale=2.0)
    res = fd.sample(
        m,
        (X, y),
        algorithm=fd.FlyMC(q_db=0.5, resample_fraction=1.0),
        kernel="nuts",
        num_warmup=300,
        num_samples=1200,
        chains=4,
        seed=4390,
        client="synchronous",
        placement=fd.Placement(n_shards=2),
        progress=False,
    )
    verdict = check_against(res.samples, ref.mean, ref.cov, alpha=ALPHA)
    assert verdict.passed, str(verdict)


# ---------------------------------------------------------------------------------------
# every family through the CLI, ArviZ output and a trace resume
# ---------------------------------------------------------------------------------------
#: CLI --model, its flags, the store's task, the target generator
CLI_CASES = {
    "probit": (["--model", "probit"], "binary", lambda g, e: g.random(e.size) < 0.5 + 0 * e),
    "binomial": (
        ["--model", "binomial", "--trials", "4", "--link", "probit"],
        "count",
        lambda g, e: g.binomial(4, special.expit(e)),
    ),
    "negative_binomial": (
        ["--model", "negative_binomial", "--dispersion", "3"],
        "count",
        lambda g, e: g.negative_binomial(3, 3 / (3 + np.exp(e))),
    ),
    "gaussian": (
        ["--model", "gaussian", "--scale", "0.5"],
        "real",
        lambda g, e: e + g.normal(size=e.size),
    ),
}


#: the families through this test by default: negative_binomial (in the quick set) and
#: gaussian; probit and binomial in CI only (``--full-grid``), since the resume and the ArviZ output
#: do not depend on the family, and test_cli's test_family_names_through_ingest_and_run
#: runs every family through the command line (tests/test_tiers.py)
CLI_DEFAULT = ("negative_binomial", "gaussian")


@pytest.mark.parametrize(
    "name",
    [
        n
        if n == "negative_binomial"
        else pytest.param(
            n, marks=[pytest.mark.slow] + ([] if n in CLI_DEFAULT else [pytest.mark.full_e2e])
        )
        for n in CLI_CASES
    ],
)
def test_family_through_cli_arviz_and_resume(name, tmp_path, capsys, monkeypatch):
    from flymc_dist.cli import main
    from flymc_dist.driver import Driver
    from flymc_dist.trace import Trace

    flags, task, gen = CLI_CASES[name]
    g = np.random.default_rng(7)
    X = np.column_stack([np.ones(300), g.normal(size=300)])
    y = gen(g, 0.2 + 0.5 * X[:, 1]).astype(float if task == "real" else np.int64)
    store = tmp_path / "d.zarr"
    fd.from_numpy(X, y, str(store), task=task)
    common = ["--synchronous", "--warmup", "20", "--samples", "20", "--chains", "2"]
    common += ["--no-progress", "--checkpoint-every", "10"]

    def run(trace, *extra):
        code = main(["run", str(store), *flags, *common, "--trace", str(trace), *extra])
        return code, capsys.readouterr().err

    ref = tmp_path / "ref.zarr"
    code, err = run(ref)
    assert code == 0, err
    full = Trace.open(ref, read_only=True)
    assert full.samples.shape == (2, 20, 2) and np.all(np.isfinite(full.samples))
    assert full.attrs["model"]["name"] == "glm"

    calls = {"n": 0}
    real_step = Driver.step

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 33:
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    trace = tmp_path / "t.zarr"
    monkeypatch.setattr(Driver, "step", interrupted)
    monkeypatch.delattr(Driver, "steps")  # every iteration through step (see test_cli)
    assert run(trace)[0] == 130
    monkeypatch.undo()
    kept = Trace.open(trace, read_only=True).samples.copy()
    code, err = run(trace, "--resume")
    assert code == 0, err
    done = Trace.open(trace, read_only=True)
    assert done.samples.shape == (2, 20, 2)
    np.testing.assert_array_equal(done.samples[:, : kept.shape[1]], kept)

    res = fd.sample(
        fd.GLM(**{k: v for k, v in full.attrs["model"].items() if k != "name"}),
        str(store),
        num_warmup=20,
        num_samples=20,
        chains=2,
        client="synchronous",
        progress=False,
    )
    idata = res.to_arviz()
    assert idata.posterior["theta"].shape == (2, 20, 2)
    assert json.loads(idata.posterior.attrs["model"])["family"] == full.attrs["model"]["family"]


# ---------------------------------------------------------------------------------------
# the guard while sampling
# ---------------------------------------------------------------------------------------
def _guard_data():
    g = np.random.default_rng(8)
    X = np.column_stack([np.ones(200), g.normal(size=200)])
    y = (g.random(200) < special.expit(0.5 + 2.0 * X[:, 1])).astype(float)
    return X, y


def _flymc(model, data, kernel="rwmh"):
    return fd.sample(
        model,
        data,
        algorithm=fd.FlyMC(q_db=0.5, resample_fraction=1.0),
        kernel=kernel,
        num_warmup=30,
        num_samples=30,
        chains=2,
        client="synchronous",
        placement=fd.Placement(n_shards=2),
        progress=False,
    )


@pytest.mark.parametrize("kernel", ["rwmh", "mala"])
def test_negative_control_guard_catches_too_small_curvature(kernel):
    """A user family declaring c = 1/8 for the logit (true curvature reaches −1/4), with
    the set-up check off (as if the violation lay outside the range it checks): the
    first row evaluated where B > L stops the run, naming the row and θ."""
    fam = fd.CustomFamily(_logit_f, _logit_df, 0.125, name="halved", log_concave=True)
    fam.checked = False
    with pytest.raises(FloatingPointError, match=r"exceeds the likelihood at row \d+ and theta"):
        _flymc(fd.GLM(fam), _guard_data(), kernel)
    # the correct curvature runs
    fam.c = 0.25
    assert np.all(np.isfinite(_flymc(fd.GLM(fam), _guard_data(), kernel).samples))


def test_negative_control_guard_in_the_compiled_path(monkeypatch):
    """A built-in family whose row constants put its bound 1 nat above the likelihood at
    the tight point: the compiled log L̃ flags it, and the run stops."""
    original = fd.GLM.row_constants

    def raised(self, y, xi):
        c = original(self, y, xi)
        c[:, 2] += 1.0
        return c

    monkeypatch.setattr(fd.GLM, "row_constants", raised)
    with pytest.raises(FloatingPointError, match=r"exceeds the likelihood at row \d+"):
        _flymc(fd.GLM("binomial"), _guard_data())


@pytest.mark.slow
def test_the_readme_family_runs(tmp_path, monkeypatch):
    """The README's user family, run as written on a small store of its kind of data."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index("### GLM families and your own likelihood") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.splitlines()) <= 60
    g = np.random.default_rng(9)
    X = np.column_stack([np.ones(300), g.normal(size=300)])
    fd.from_numpy(X, X @ np.array([1.0, -2.0]) + g.logistic(size=300), str(tmp_path / "data.zarr"))
    monkeypatch.chdir(tmp_path)
    # the README's call with a small run, in this process
    code = code.replace(
        "fd.NUTS())",
        'fd.NUTS(), num_warmup=50, num_samples=50, client="synchronous", progress=False)',
    )
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    res = ns["res"]
    assert res.samples.shape == (4, 50, 2)
    assert np.all(np.abs(res.samples.mean(axis=(0, 1)) - [1.0, -2.0]) < 0.5)


# ---------------------------------------------------------------------------------------
# the existing models as families
# ---------------------------------------------------------------------------------------
def test_existing_models_are_glm_instances():
    """The names users know are GLMs of the logistic and Student-t families; their
    descriptions, kinds and family descriptions round-trip."""
    for m, family, kind in [
        (fd.LogisticRegression(prior="laplace", xi_untuned=0.5), "logistic", "logistic"),
        (fd.RobustRegression(nu=3.0, scale=0.5, prior="normal"), "student_t", "robust"),
        (fd.SoftmaxRegression(3, prior_scale=2.0), "softmax", None),
    ]:
        assert isinstance(m, fd.GLM) and m.family.name == family
        assert (m.compiled_bright() or (None,))[0] == kind
        assert model_from_dict(m.to_dict()) == m
        g = fd.GLM(family, prior=m.prior, prior_scale=m.prior_scale, **_params(m.family))
        assert model_from_dict(g.to_dict()) == g and g != m
        assert g.family.to_dict() == m.family.to_dict()
    with pytest.raises(ValueError, match="xi_untuned must be finite"):
        fd.LogisticRegression(xi_untuned=float("inf"))
    with pytest.raises(ValueError, match="student_t link must be 'identity'"):
        fd.GLM("student_t", link="log")


def _params(family) -> dict:
    return {k: v for k, v in family.to_dict().items() if k not in ("family", "link")}


def _closed_form_vs_curvature(m, y, xi, eta_hat):
    """The family's closed-form coefficients in η (``q₂ η² + q₁ η + q₀``) against the
    generic derivation from ``f``, ``f'`` at the tight point ``η̂`` with the curvature
    ``c(ξ) = −2 q₂``: the same quadratic."""
    X = np.ones((y.size, 1))
    st = [m.suffstats(X[i : i + 1], y[i : i + 1], xi[i : i + 1]) for i in range(y.size)]
    q2 = np.array([s.A[0, 0] for s in st])
    q1 = np.array([s.b[0] for s in st])
    q0 = np.array([s.c for s in st])
    f, g = m.loglik_grad(eta_hat[None, :, None], y)
    f, g = f[0], g[0, :, 0]
    c = -2.0 * q2
    np.testing.assert_allclose(q1, g + c * eta_hat, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(q0, f - g * eta_hat - 0.5 * c * eta_hat**2, rtol=1e-9, atol=1e-9)
    return c


def test_logistic_family_is_a_tighter_curvature_bound():
    """Jaakkola–Jordan as a curvature bound: tangent at ``η̂`` with ``c(ξ) = tanh(ξ/2)/(2ξ)``,
    at most the fixed curvature 1/4 (equal at ξ = 0)."""
    m = fd.LogisticRegression()
    g = np.random.default_rng(11)
    y = g.integers(0, 2, 200).astype(float)
    eta_hat = g.normal(size=200) * g.choice([0.0, 0.1, 1.0, 10.0], 200)
    c = _closed_form_vs_curvature(m, y, m.tuned_xi(eta_hat[:, None], y), eta_hat)
    ax = np.abs(eta_hat)
    ref = np.where(ax > 1e-3, np.tanh(ax / 2) / (2 * np.where(ax > 0, ax, 1)), 0.25)
    np.testing.assert_allclose(c, ref, rtol=1e-6)
    assert np.all(c <= m.family.curvature(y) * (1 + 1e-12))


def test_student_t_family_is_a_tighter_curvature_bound():
    """The Student-t tangent in ``r²`` as a curvature bound: tangent at ``η̂`` with
    ``c(ξ) = (ν + 1)/(νσ² + ξ²)``, at most the fixed ``(ν + 1)/(νσ²)``."""
    m = fd.RobustRegression(nu=3.0, scale=0.7)
    g = np.random.default_rng(12)
    y = 3.0 * g.normal(size=200)
    eta_hat = y + g.normal(size=200) * g.choice([0.0, 0.1, 1.0, 10.0], 200)
    xi = m.tuned_xi(eta_hat[:, None], y)
    c = _closed_form_vs_curvature(m, y, xi, eta_hat)
    np.testing.assert_allclose(c, 4.0 / (3.0 * 0.49 + xi**2), rtol=1e-12)
    assert np.all(c <= m.family.curvature(y) * (1 + 1e-12))


@pytest.mark.parametrize(
    "named, family",
    [
        (fd.LogisticRegression(prior_scale=2.0), fd.GLM("logistic", prior_scale=2.0)),
        (
            fd.RobustRegression(nu=4.0, scale=0.5),
            fd.GLM("student_t", nu=4.0, scale=0.5, prior="laplace"),
        ),
        (fd.SoftmaxRegression(3), fd.GLM("softmax", n_classes=3)),
    ],
    ids=["logistic", "robust", "softmax"],
)
def test_named_model_and_glm_family_draw_the_same(named, family):
    """``fd.GLM(<family>)`` is the named model: the same draws, bit for bit (FlyMC with
    MAP-tuned bounds, on the driver's compiled replica where the family has a compiled
    form, and regular MCMC)."""
    g = np.random.default_rng(13)
    X = np.column_stack([np.ones(200), g.normal(size=200)])
    e = 0.3 + 0.8 * X[:, 1]
    y = {
        "logistic": g.random(200) < special.expit(e),
        "robust": e + g.standard_t(4, 200),
        "softmax": g.integers(0, 3, 200),
    }[named.name].astype(float)
    for alg in (fd.FlyMC(), fd.Regular()):
        a, b = (
            fd.sample(
                m,
                (X, y),
                algorithm=alg,
                kernel="mala",
                num_warmup=20,
                num_samples=20,
                chains=2,
                seed=3,
                client="synchronous",
                progress=False,
            )
            for m in (named, family)
        )
        assert np.array_equal(a.samples, b.samples)
        assert np.array_equal(a.stats["log_joint"], b.stats["log_joint"])
