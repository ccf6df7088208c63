"""The NumPyro reference of `flymc bench mixing --numpyro` targets the package's own
posterior: its log density against the package's, at random points, for every model and
prior it covers, and the wiring of the command."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import flymc_dist as fd
from flymc_dist.bench.numpyro_nuts import numpyro_model
from flymc_dist.cli import main

#: NumPyro and JAX take seconds to import and to trace each model
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def numpyro() -> object:
    """NumPyro (with JAX), imported when the module's first test runs rather than when
    the tests are collected (it takes a second or more), or the module skipped."""
    return pytest.importorskip("numpyro", reason="the numpyro extra (part of the test extra)")


MODELS = [
    fd.LogisticRegression(prior="normal", prior_scale=1.0),
    fd.LogisticRegression(prior="laplace", prior_scale=0.7),
    fd.RobustRegression(nu=4.0, scale=0.5, prior="laplace", prior_scale=1.0),
    fd.RobustRegression(nu=2.5, scale=1.3, prior="normal", prior_scale=2.0),
]


def _data(model: object, n: int = 200, d: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(n, d))
    if isinstance(model, fd.LogisticRegression):
        return X, (rng.random(n) < 0.4).astype(np.int64)
    return X, X @ rng.normal(size=d) + rng.standard_t(3, size=n)


def _log_posterior(model: object, X: np.ndarray, y: np.ndarray, theta: np.ndarray) -> float:
    """The package's unnormalised log posterior: Σ log-likelihood + log prior."""
    eta = model.linear_predictor(theta[None], X)
    return float(model.loglik(eta, y).sum() + model.log_prior(theta[None])[0])


def _numpyro_log_density(model: object, X: np.ndarray, y: np.ndarray, theta: np.ndarray) -> float:
    from numpyro.infer.util import log_density

    from flymc_dist.bench.numpyro_nuts import import_numpyro

    jax, _, _ = import_numpyro()
    f = numpyro_model(model)
    value, _ = log_density(
        f, (jax.numpy.asarray(X), jax.numpy.asarray(y, dtype=float)), {}, {"theta": theta}
    )
    return float(value)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"{m.name}-{m._prior.kind}")
def test_numpyro_model_is_the_package_posterior(model: object) -> None:
    """Equal log densities (to rounding) at points around and far from the data's θ,
    normalising constants included; the same model with another prior scale, likelihood
    parameter or prior family is told apart (a negative control)."""
    X, y = _data(model)
    rng = np.random.default_rng(2)
    for theta in rng.normal(scale=1.5, size=(5, X.shape[1])):
        ours = _log_posterior(model, X, y, theta)
        theirs = _numpyro_log_density(model, X, y, theta)
        assert theirs == pytest.approx(ours, rel=1e-10, abs=1e-8)
    if isinstance(model, fd.RobustRegression):
        wrong = fd.RobustRegression(
            nu=model.nu + 1.0, scale=model.scale, prior=model._prior.kind, prior_scale=1.0
        )
    else:
        other = "laplace" if model._prior.kind == "normal" else "normal"
        wrong = fd.LogisticRegression(prior=other, prior_scale=model._prior.scale)
    theta = rng.normal(size=X.shape[1])
    assert _numpyro_log_density(wrong, X, y, theta) != pytest.approx(
        _log_posterior(model, X, y, theta), rel=1e-6
    )


def test_numpyro_reference_refuses_what_it_does_not_cover() -> None:
    with pytest.raises(ValueError, match="SoftmaxRegression"):
        numpyro_model(fd.SoftmaxRegression(n_classes=3))
    with pytest.raises(ValueError, match="normal or Laplace prior"):
        numpyro_model(fd.LogisticRegression(prior="flat"))


#: CI only (NumPyro's compiles are most of its time): the NumPyro model is the package's
#: posterior in the tests above, and `bench mixing`'s FlyMC side runs in test_cli.py
@pytest.mark.full_e2e
@pytest.mark.slow
def test_bench_mixing_numpyro_is_wired(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`flymc bench mixing --numpyro`: NumPyro's row, the FlyMC / NumPyro ratios and the
    JSON figures (queries: leapfrog steps × rows)."""
    out_json = tmp_path / "mixing.json"
    # two chains, not the default four: NumPyro runs its chains one after another and
    # compiles its NUTS step again for each (most of this test's time)
    args = ["bench", "mixing", "--problem", "logistic", "--rows", "2000", "--features", "3"]
    args += ["--chains", "2", "--num-warmup", "30", "--num-samples", "30", "--no-regular"]
    args += ["--numpyro"]
    args += ["--numpyro-warmup", "20", "--numpyro-samples", "20", "--json", str(out_json)]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "numpyro" in out and "FlyMC / NumPyro NUTS" in out
    d = json.loads(out_json.read_text())
    r = d["numpyro"]
    assert r["draws"] == 20 and r["warmup"] == 20 and r["chains"] == 2
    assert r["n_rows"] == 2000
    assert r["queries_per_iteration"] >= 2000  # at least one leapfrog step of every row
    assert r["queries_total"] % 2000 == 0  # whole leapfrog steps
    assert r["queries_total"] >= r["queries_per_iteration"] * 2 * 20
    assert d["ratios_numpyro"]["min_ess_per_second"] > 0
    code = main(["bench", "mixing", "--kernel", "rwmh", "--numpyro"])
    _, err = capsys.readouterr()
    assert code == 2 and "NUTS with NUTS" in err
