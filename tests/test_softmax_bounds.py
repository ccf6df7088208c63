"""Softmax's one-vs-each bound (``SoftmaxRegression(bound="one_vs_each")``).

Deterministic checks (no statistics): the bound lies below the log-likelihood at random
``(θ, x, y)`` and tight points, extremes included (huge margins, ties, K up to 10); its
gap at the tight points is the one-vs-each gap in closed form (zero for K = 2, where it
is Jaakkola–Jordan's logistic bound); the collapsed statistics equal the direct sum of
the rows' bounds; its gradient is the bound's derivative; the forecast κ the driver
reports is the generalised eigenvalue of the bound's precision against the posterior's,
computed here from the formulas. Statistical: FlyMC with it targets the exact softmax
posterior of :mod:`test_exactness` (its quadrature reference and battery), and the same
bound with its curvature halved is stopped by the bound guard (negative control).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
from scipy.special import logsumexp, softplus
from test_exactness import CHAINS, FLYMC_OPTIONS, N_SHARDS, SEED, check_against, problem, reference

import flymc_dist as fd
from flymc_dist.models.families import SoftmaxFamily, jaakkola_jordan_coefficients
from flymc_dist.terms import BoundViolation

OVE = "one_vs_each"


def _case(K: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows, labels, tight points and linear predictors spanning every regime: logits
    from 0 (ties) to 10³ (huge margins, either sign), and exact ties."""
    rng = np.random.default_rng(seed)
    n = 400
    scale = rng.choice([0.0, 0.1, 1.0, 10.0, 100.0, 1000.0], size=(n, 1))
    psi = rng.normal(size=(n, K)) * scale
    psi[:20] = 3.0  # every logit tied at the tight point
    y = rng.integers(0, K, size=n)
    eta = np.concatenate(
        [
            psi[None] + rng.normal(size=(3, n, K)) * rng.choice([0.01, 1.0, 30.0], (3, 1, 1)),
            rng.normal(size=(2, n, K)) * 1000.0,
            np.full((1, n, K), -7.0),  # ties in η
            psi[None],  # at the tight points
        ]
    )
    return psi, y, eta, rng.normal(size=(n, 4))


def _ove_gap(u: np.ndarray) -> np.ndarray:
    """``Σ_{k≠y} softplus(u_k) − log(1 + Σ_{k≠y} e^{u_k})`` from ``u = η − η_y`` (u_y = 0)."""
    return softplus(u).sum(axis=-1) - np.log(2.0) - logsumexp(u, axis=-1)


@pytest.mark.parametrize("K", [2, 3, 5, 10])
def test_bound_below_likelihood_with_the_one_vs_each_gap(K):
    model = fd.SoftmaxRegression(K, bound=OVE)
    psi, y, eta, _ = _case(K, seed=K)
    ll = model.loglik(eta, y)
    lb = model.logbound(eta, y, psi)
    assert np.all(np.isfinite(lb))
    assert np.all(lb <= ll)  # strictly below: the margin keeps δ > 0 after rounding
    # at the tight points the gap is the one-vs-each inequality's, and no less
    u = psi - psi[np.arange(y.size), y][:, None]
    gap = ll[-1] - lb[-1]
    assert np.all(np.abs(gap - _ove_gap(u)) <= 1e-9 * (1.0 + np.abs(u).sum(axis=1)))
    assert np.all(gap > 0.0)
    if K == 2:  # Jaakkola–Jordan's logistic bound, tight at its tight point
        assert gap.max() < 1e-8
    # Böhning's bound is tight there (the default, unchanged)
    boh = fd.SoftmaxRegression(K)
    assert np.all(boh.logbound(eta, y, psi) <= ll)
    assert np.max(ll[-1] - boh.logbound(psi[None], y, psi)[0]) < 1e-8


@pytest.mark.parametrize("K", [3, 10])
def test_bound_is_the_sum_of_jaakkola_jordan_terms(K):
    """An independent evaluation: Σ over the other classes of the logistic bound on
    ``log σ(η_y − η_k)`` tight at ``|ψ_y − ψ_k|``."""
    model = fd.SoftmaxRegression(K, bound=OVE)
    psi, y, eta, _ = _case(K, seed=10 + K)
    rows = np.arange(y.size)
    s = eta[..., rows, y][..., None] - eta
    a, c = jaakkola_jordan_coefficients(psi[rows, y][:, None] - psi)
    terms = a * s * s + 0.5 * s + c
    terms[..., rows, y] = 0.0
    np.testing.assert_allclose(model.logbound(eta, y, psi), terms.sum(-1), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("K", [2, 3, 10])
def test_collapsed_statistics_equal_the_direct_sum(K):
    model = fd.SoftmaxRegression(K, bound=OVE)
    psi, y, _, X = _case(K, seed=20 + K)
    keep = np.abs(psi).max(1) < 200  # values below ~1e8, so the comparison is precise
    psi, y, X = psi[keep], y[keep], X[keep]
    stats = model.suffstats(X, y, psi)
    P = K * X.shape[1]
    assert stats.A.shape == (P, P) and np.array_equal(stats.A, stats.A.T)
    thetas = np.random.default_rng(K).normal(size=(5, P)) * 2.0
    direct = model.logbound(model.linear_predictor(thetas, X), y, psi).sum(axis=1)
    np.testing.assert_allclose(stats.value(thetas), direct, rtol=1e-10)
    # no curvature along θ → θ + c1 (the likelihood's flat direction)
    flat = np.tile(np.eye(X.shape[1]), (K, 1))  # column d: θ[k, d] += 1 for every k
    np.testing.assert_allclose(stats.A @ flat, 0.0, atol=1e-9 * np.abs(stats.A).max())


@pytest.mark.parametrize("K", [3, 10])
def test_gradient_is_the_bound_derivative(K):
    model = fd.SoftmaxRegression(K, bound=OVE)
    psi, y, eta, _ = _case(K, seed=30 + K)
    eta = eta[:3]  # moderate logits: finite differences are precise there
    beta, g = model.logbound_grad(eta, y, psi)
    np.testing.assert_array_equal(beta, model.logbound(eta, y, psi))
    h = 1e-6 * (1.0 + np.abs(eta))
    for k in range(K):
        up, down = eta.copy(), eta.copy()
        up[..., k] += h[..., k]
        down[..., k] -= h[..., k]
        num = (model.logbound(up, y, psi) - model.logbound(down, y, psi)) / (2 * h[..., k])
        np.testing.assert_allclose(g[..., k], num, rtol=1e-5, atol=1e-5)


def test_bound_is_named_and_refused_when_unknown():
    model = fd.SoftmaxRegression(3, bound=OVE)
    assert model.to_dict()["bound"] == OVE and not model.bound_tight
    assert fd.SoftmaxRegression(3).bound == "bohning" and fd.SoftmaxRegression(3).bound_tight
    assert fd.GLM("softmax", n_classes=3, bound=OVE).family.bound_name == OVE
    from flymc_dist.models import model_from_dict

    assert model_from_dict(model.to_dict()) == model
    assert model != fd.SoftmaxRegression(3)
    with pytest.raises(ValueError, match="softmax bound must be 'bohning' or 'one_vs_each'"):
        fd.SoftmaxRegression(3, bound="bouchard")


def _separated(n: int = 1500, seed: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Three well separated classes: most rows classified with large margins."""
    rng = np.random.default_rng(seed)
    X = np.column_stack([np.ones(n), rng.normal(size=(n, 2))])
    W = np.array([[0.0, 4.0, 0.0], [0.0, -2.0, 3.5], [0.0, -2.0, -3.5]])
    logits = X @ W.T
    p = np.exp(logits - logsumexp(logits, axis=1, keepdims=True))
    y = (rng.random(n)[:, None] > np.cumsum(p, axis=1)).sum(axis=1)
    return X, y


def test_narrowing_forecast_is_the_bound_against_the_posterior():
    """The driver's κ with the one-vs-each bound is the largest generalised eigenvalue of
    ``Σ kron(M_n, x xᵀ) + I`` (``M_n`` the bound's curvature in η, written out here)
    against ``Σ kron(diag p − ppᵀ, x xᵀ) + I``; on well separated classes it is several
    times below Böhning's."""
    X, y = _separated()
    kappa = {}
    for bound in ("bohning", OVE):
        res = fd.sample(
            fd.SoftmaxRegression(3, bound=bound),
            (X, y),
            fd.FlyMC(bounds="map"),
            "nuts",
            num_warmup=0,
            num_samples=1,
            chains=1,
            seed=0,
            client="synchronous",
            progress=False,
        )
        kappa[bound] = res.info["conditional_narrowing"]
    n, D, K = X.shape[0], X.shape[1], 3
    eta = X @ res.info["map"].reshape(K, D).T
    p = np.exp(eta - logsumexp(eta, axis=1, keepdims=True))
    u = eta - eta[np.arange(n), y][:, None]
    lam = np.where(np.abs(u) < 1e-8, 0.25, np.tanh(np.abs(u) / 2) / (2 * np.abs(u) + 1e-300))
    lam[np.arange(n), y] = 0.0
    M = np.zeros((n, K, K))
    for k in range(K):
        e = np.zeros((n, K))
        e[:, k] -= 1.0
        e[np.arange(n), y] += 1.0  # e_y − e_k (zero for k = y)
        M += lam[:, k, None, None] * e[:, :, None] * e[:, None, :]
    H = p[:, :, None] * (np.eye(K)[None] - p[:, None, :])

    def prec(W: np.ndarray) -> np.ndarray:
        out = np.einsum("njk,nd,ne->jdke", W, X, X).reshape(K * D, K * D)
        return out + np.eye(K * D)

    expected = scipy.linalg.eigh(prec(M), prec(H), eigvals_only=True)[-1]
    assert kappa[OVE] == pytest.approx(expected, rel=1e-6)
    assert kappa[OVE] < kappa["bohning"] / 3.0, kappa


# ----- exactness ---------------------------------------------------------------------------
#: (kernel, z-update): the paper's kernel of row 2, and the default NUTS with explicit updates
OVE_COMBOS = [("mala", "implicit"), ("nuts", "explicit")]


def _run(kernel: str, z_update: str, seed: int) -> fd.Result:
    prob = problem("softmax")
    warmup, kept = (200, 900) if kernel == "nuts" else (400, 1600)
    return fd.sample(
        fd.SoftmaxRegression(**prob.settings, bound=OVE),
        (prob.X, prob.y),
        fd.FlyMC(bounds="map", z_update=z_update, **FLYMC_OPTIONS),
        kernel,
        num_warmup=warmup,
        num_samples=kept,
        chains=CHAINS,
        seed=seed,
        client="synchronous",
        placement=fd.Placement(n_shards=N_SHARDS),
        progress=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel, z_update",
    # the paper's kernel in CI only (--full-grid): the bound's path is the same with NUTS
    [pytest.param(*c, marks=[pytest.mark.full_grid] if c[0] == "mala" else []) for c in OVE_COMBOS],
)
def test_one_vs_each_flymc_targets_the_exact_posterior(kernel, z_update):
    """FlyMC with the one-vs-each bound, against the softmax quadrature reference (the
    battery of :mod:`test_exactness`, a 1 % false-alarm rate over these runs)."""
    res = _run(kernel, z_update, SEED + 7000 + OVE_COMBOS.index((kernel, z_update)))
    assert res.model().bound == OVE
    assert res.stats["n_bright"].mean() > 0  # rows are bright: the bound is in play
    ref = reference("softmax")
    result = check_against(res.samples, ref.mean, ref.cov, alpha=0.01 / len(OVE_COMBOS))
    print(f"one-vs-each {kernel}/{z_update}: worst |z| {result.worst:.2f}; {result}")
    assert result.passed, str(result)


@pytest.mark.slow
def test_negative_control_halved_curvature_is_stopped(monkeypatch):
    """The one-vs-each bound with every class's curvature halved (``a`` of each
    Jaakkola–Jordan term, its constant kept) lies above the likelihood near its tight
    points: the bound guard must stop the run, naming a row; were it not stopped, its
    draws must fail the battery."""
    original = SoftmaxFamily.bound_coefficients

    def halved(self, y, xi):
        coef = original(self, y, xi)
        return (0.5 * coef[0], coef[1]) if self.bound_name == OVE else coef

    monkeypatch.setattr(SoftmaxFamily, "bound_coefficients", halved)
    try:
        bad = _run("mala", "implicit", SEED + 7100)
    except BoundViolation as e:
        assert "exceeds the likelihood at row" in str(e)
        return
    ref = reference("softmax")
    result = check_against(bad.samples, ref.mean, ref.cov, alpha=0.01)
    assert not result.passed, str(result)
