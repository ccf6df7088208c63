"""Tests of the models: bounds (B <= L, tightness, collapse), derivatives, priors, API."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from scipy.special import expit, log_expit

from flymc_dist._numerics import BOUND_EPS, log_expm1
from flymc_dist.models import (
    MODELS,
    BoundStats,
    LogisticRegression,
    Model,
    Prior,
    RobustRegression,
    SoftmaxRegression,
    make_model,
    model_from_dict,
)
from flymc_dist.models.families import jaakkola_jordan_coefficients

MODEL_CASES = {
    "logistic": lambda: LogisticRegression(),
    "logistic-laplace": lambda: LogisticRegression(
        prior="laplace", prior_scale=2.0, xi_untuned=0.0
    ),
    "softmax2": lambda: SoftmaxRegression(2, prior="flat"),
    "softmax4": lambda: SoftmaxRegression(4, prior="laplace", prior_scale=0.5),
    "robust": lambda: RobustRegression(),
    "robust-cauchy": lambda: RobustRegression(nu=1.0, scale=0.3, prior="normal"),
    "robust-nu50": lambda: RobustRegression(nu=50.0, scale=2.0, prior="flat"),
}


@pytest.fixture(params=sorted(MODEL_CASES))
def model(request) -> Model:
    return MODEL_CASES[request.param]()


def make_y(model: Model, n: int, rng: np.random.Generator) -> np.ndarray:
    if model.task == "binary":
        return rng.integers(0, 2, n).astype(float)
    if model.task == "multiclass":
        return rng.integers(0, model.n_outputs, n)
    return 3.0 * rng.standard_t(3.0, n)


def make_xi(model: Model, y: np.ndarray, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Tight points from a random eta_hat of the given scale (scale 0: untuned)."""
    if scale == 0:
        return model.untuned_xi(y)
    eta_hat = scale * rng.normal(size=(y.shape[0], model.n_outputs))
    return model.tuned_xi(eta_hat, y)


def random_eta(model: Model, B: int, n: int, rng: np.random.Generator, scale: float):
    return scale * rng.normal(size=(B, n, model.n_outputs))


SCALES = [1e-3, 0.3, 1.0, 5.0, 50.0, 1e4]


# ----- shapes and API ----------------------------------------------------------
def test_shapes(model):
    rng = np.random.default_rng(0)
    B, n, D = 3, 7, 4
    E = model.n_outputs
    y = make_y(model, n, rng)
    model.validate_targets(y)
    X = rng.normal(size=(n, D))
    P = model.n_params(D)
    assert P == D * E
    assert model.param_shape(D) == ((D,) if E == 1 else (E, D))
    theta = rng.normal(size=(B, P))
    eta = model.linear_predictor(theta, X)
    assert eta.shape == (B, n, E)
    xi = make_xi(model, y, rng, 1.0)
    assert xi.shape == (n,) + model.xi_shape
    assert model.untuned_xi(y).shape == (n,) + model.xi_shape
    assert model.loglik(eta, y).shape == (B, n)
    ll, g = model.loglik_grad(eta, y)
    assert ll.shape == (B, n) and g.shape == (B, n, E)
    assert model.loglik_hess(eta[0], y).shape == (n, E, E)
    assert model.logbound(eta, y, xi).shape == (B, n)
    b, gb = model.logbound_grad(eta, y, xi)
    assert b.shape == (B, n) and gb.shape == (B, n, E)
    ss = model.suffstats(X, y, xi)
    assert isinstance(ss, BoundStats)
    assert ss.A.shape == (P, P) and ss.b.shape == (P,) and isinstance(ss.c, float)
    np.testing.assert_array_equal(ss.A, ss.A.T)
    assert model.log_prior(theta).shape == (B,)
    assert model.log_prior_grad(theta).shape == (B, P)
    assert model.prior_precision(P).shape == (P, P)
    assert model.task in ("binary", "multiclass", "real")
    assert model.name in MODELS


def test_grad_values_match_plain_values(model):
    rng = np.random.default_rng(1)
    y = make_y(model, 20, rng)
    eta = random_eta(model, 2, 20, rng, 3.0)
    xi = make_xi(model, y, rng, 2.0)
    np.testing.assert_array_equal(model.loglik_grad(eta, y)[0], model.loglik(eta, y))
    np.testing.assert_array_equal(model.logbound_grad(eta, y, xi)[0], model.logbound(eta, y, xi))


def test_to_dict_roundtrip(model):
    d = model.to_dict()
    json.dumps(d)
    m2 = model_from_dict(json.loads(json.dumps(d)))
    assert type(m2) is type(model)
    assert m2.to_dict() == d
    assert m2 == model and hash(m2) == hash(model)
    assert make_model(d["name"], **{k: v for k, v in d.items() if k != "name"}) == model


# ----- B <= L ------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(MODEL_CASES)),
    eta_scale=st.sampled_from(SCALES),
    xi_scale=st.sampled_from([0.0, *SCALES]),
    seed=st.integers(0, 2**32 - 1),
)
def test_bound_below_loglik_random(name, eta_scale, xi_scale, seed):
    model = MODEL_CASES[name]()
    rng = np.random.default_rng(seed)
    n = 64
    y = make_y(model, n, rng)
    xi = make_xi(model, y, rng, xi_scale)
    eta = random_eta(model, 3, n, rng, eta_scale)
    # also points near the tight points
    eta_hat = xi_scale * rng.normal(size=(n, model.n_outputs))
    xi_t = model.tuned_xi(eta_hat, y)
    near = eta_hat + 1e-6 * rng.normal(size=(2, n, model.n_outputs))
    for e, x in ((eta, xi), (near, xi_t), (eta_hat[None], xi_t)):
        delta = model.loglik(e, y) - model.logbound(e, y, x)
        assert np.all(delta >= 0), delta.min()
        assert not np.any(np.isnan(log_expm1(delta)))


def _tight_tol(ll: np.ndarray, eta: np.ndarray) -> np.ndarray:
    return 1e-9 * (1.0 + np.abs(ll) + np.abs(eta).max(axis=-1))


def test_tight_at_tuned_points(model):
    rng = np.random.default_rng(2)
    n = 200
    y = make_y(model, n, rng)
    for scale in SCALES:
        eta_hat = scale * rng.normal(size=(n, model.n_outputs))
        xi = model.tuned_xi(eta_hat, y)
        ll = model.loglik(eta_hat[None], y)
        delta = ll - model.logbound(eta_hat[None], y, xi)
        assert np.all(delta > 0), delta.min()  # the margin keeps delta > 0 ...
        assert np.all(delta <= _tight_tol(ll, eta_hat)), delta.max()  # ... but tiny


def test_tight_at_untuned_points():
    y = np.array([0.0, 1.0, 0.0, 1.0])
    m = LogisticRegression()
    eta = np.array([[[1.5], [1.5], [-1.5], [-1.5]]])
    delta = m.loglik(eta, y) - m.logbound(eta, y, m.untuned_xi(y))
    assert np.all((delta > 0) & (delta < 1e-10))
    r = RobustRegression(nu=3.0, scale=0.5)
    yr = np.array([0.0, 2.5, -1e3])
    delta = r.loglik(yr[None, :, None], yr) - r.logbound(yr[None, :, None], yr, r.untuned_xi(yr))
    assert np.all((delta > 0) & (delta < 1e-10))
    s = SoftmaxRegression(3)
    ys = np.array([0, 1, 2])
    eta = np.full((1, 3, 3), 7.0)  # psi = 0 is tight along eta = c * 1
    delta = s.loglik(eta, ys) - s.logbound(eta, ys, s.untuned_xi(ys))
    assert np.all((delta > 0) & (delta < 1e-10))


EXTREME = st.one_of(
    st.floats(-1e6, 1e6),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 709.0, 710.0, -710.0, 745.0, 1e4, -1e4, 1e6]),
)


@settings(max_examples=100, deadline=None)
@given(s=EXTREME, xi=EXTREME, label=st.sampled_from([0.0, 1.0]))
def test_logistic_bound_extremes(s, xi, label):
    m = LogisticRegression()
    y = np.array([label, label, label])
    t = 2.0 * label - 1.0
    eta = (t * np.array([s, xi, -xi]))[None, :, None]  # s, and both tight points
    xis = np.full(3, xi)
    ll = m.loglik(eta, y)
    beta = m.logbound(eta, y, xis)
    delta = ll - beta
    assert np.all(np.isfinite(ll)) and np.all(np.isfinite(beta))
    assert np.all(delta >= 0), delta
    assert np.all(delta[0, 1:] > 0)
    assert np.all(delta[0, 1:] <= 1e-9 * (1 + abs(xi))), delta
    _, g = m.logbound_grad(eta, y, xis)
    _, gl = m.loglik_grad(eta, y)
    assert np.all(np.isfinite(g)) and np.all(np.isfinite(gl))
    # at the tight points the bound touches the likelihood: equal slopes
    np.testing.assert_allclose(g[0, 1:, 0], gl[0, 1:, 0], rtol=1e-9, atol=1e-12)


@settings(max_examples=100, deadline=None)
@given(
    y=st.floats(-1e6, 1e6),
    eta=EXTREME,
    xi=EXTREME,
    nu=st.sampled_from([0.3, 1.0, 4.0, 30.0, 1e5]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
)
def test_robust_bound_extremes(y, eta, xi, nu, scale):
    m = RobustRegression(nu=nu, scale=scale)
    ys = np.full(4, y)
    etas = np.array([eta, y - xi, y + xi, y - xi])[None, :, None]
    xis = np.array([xi, xi, xi, 0.0])
    xis[3] = m.tuned_xi(etas[0, 3:], ys[3:])[0]  # exactly |r|
    ll = m.loglik(etas, ys)
    beta = m.logbound(etas, ys, xis)
    delta = ll - beta
    assert np.all(np.isfinite(ll)) and np.all(np.isfinite(beta))
    assert np.all(delta >= 0), delta
    assert delta[0, 3] > 0
    assert np.all(delta[0, 1:] <= 1e-9 * (1 + np.abs(ll[0, 1:]))), delta


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    K=st.integers(2, 5),
    shift=EXTREME,
)
def test_softmax_bound_extremes(data, K, shift):
    vec = st.lists(st.floats(-1e4, 1e4), min_size=K, max_size=K)
    eta = np.array(data.draw(vec))
    psi = np.array(data.draw(vec))
    label = data.draw(st.integers(0, K - 1))
    m = SoftmaxRegression(K)
    y = np.full(3, label)
    etas = np.stack([eta, psi + shift, psi])[None]
    xis = np.stack([psi] * 3)
    ll = m.loglik(etas, y)
    beta = m.logbound(etas, y, xis)
    delta = ll - beta
    assert np.all(np.isfinite(ll)) and np.all(np.isfinite(beta))
    assert np.all(delta >= 0), delta
    assert delta[0, 2] > 0
    assert delta[0, 2] <= 1e-9 * (1 + abs(ll[0, 2])), delta


def test_logistic_coefficients_small_xi():
    a0, c0 = jaakkola_jordan_coefficients(np.array([0.0, -0.0]))
    np.testing.assert_array_equal(a0, -0.125)
    np.testing.assert_allclose(c0, -math.log(2.0) - BOUND_EPS, rtol=1e-15)
    # continuity across the series/direct switch, and evenness
    xi = np.array([0.999e-3, 1.001e-3, 1e-8, 2.0, 800.0, 1e300])
    a, c = jaakkola_jordan_coefficients(xi)
    a_neg, c_neg = jaakkola_jordan_coefficients(-xi)
    np.testing.assert_array_equal(a, a_neg)
    np.testing.assert_array_equal(c, c_neg)
    direct = -np.tanh(xi[:4] / 2) / (4 * xi[:4])
    np.testing.assert_allclose(a[:4], direct, rtol=1e-15)
    np.testing.assert_allclose(a[4:], -1.0 / (4 * xi[4:]), rtol=1e-15)
    assert np.all(np.isfinite(c))


def test_huge_inputs_are_finite_and_warning_free():
    m = LogisticRegression()
    y = np.array([0.0, 1.0, 0.0, 1.0])
    eta = np.array([1e4, 1e4, -1e200, -1e200])[None, :, None]
    ll = m.loglik(eta, y)
    np.testing.assert_allclose(ll[0], [-1e4, 0.0, 0.0, -1e200])
    beta = m.logbound(eta, y, np.full(4, 1.5))
    assert np.all(beta <= ll)
    r = RobustRegression(nu=4.0, scale=2.0)
    yr = np.zeros(3)
    eta = np.array([1e200, -1e300, 3.0])[None, :, None]
    ll = r.loglik(eta, yr)
    # scipy's t.logpdf overflows in x * x here; log1p(r^2/(nu s^2)) = 2 log|r| - log(nu s^2)
    k0 = stats.t.logpdf(0.0, df=4.0, scale=2.0)
    ref = k0 - 2.5 * (2 * np.log([1e200, 1e300]) - np.log(16.0))
    ref = np.append(ref, stats.t.logpdf(0.0, df=4.0, loc=3.0, scale=2.0))
    np.testing.assert_allclose(ll[0], ref, rtol=1e-12)
    assert np.all(r.logbound(eta, yr, np.array([0.0, 1e300, 3.0])) <= ll)
    _, g = r.loglik_grad(eta, yr)
    assert np.all(np.isfinite(g))
    assert np.all(np.isfinite(r.loglik_hess(eta[0], yr)))
    s = SoftmaxRegression(3)
    eta = np.array([[1e5, -1e5, 0.0], [1e100, 1e100, -1e100]])[None]
    ll = s.loglik(eta, np.array([1, 0]))
    np.testing.assert_allclose(ll[0], [-2e5, -math.log(2.0)], rtol=1e-14)
    assert np.all(s.logbound(eta, np.array([1, 0]), np.zeros((2, 3))) <= ll)


# ----- collapsed == explicit -----------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(MODEL_CASES)),
    xi_scale=st.sampled_from([0.0, 0.1, 1.0, 5.0, 30.0]),
    theta_scale=st.sampled_from([0.01, 0.5, 2.0, 10.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_collapsed_equals_explicit(name, xi_scale, theta_scale, seed):
    model = MODEL_CASES[name]()
    rng = np.random.default_rng(seed)
    n, D = 37, 3
    X = rng.normal(size=(n, D))
    y = make_y(model, n, rng)
    xi = make_xi(model, y, rng, xi_scale)
    P = model.n_params(D)
    theta = theta_scale * rng.normal(size=(4, P))
    ss = model.suffstats(X, y, xi)
    eta = model.linear_predictor(theta, X)
    beta = model.logbound(eta, y, xi)
    explicit = beta.sum(axis=-1)
    atol = 1e-10 * (1.0 + np.abs(beta).sum(axis=-1).max())
    np.testing.assert_allclose(ss.value(theta), explicit, rtol=1e-8, atol=atol)
    # gradients of the collapsed form == chain rule on the explicit one
    _, gb = model.logbound_grad(eta, y, xi)
    np.testing.assert_allclose(
        ss.grad(theta), model.grad_theta(gb, X), rtol=1e-8, atol=1e-8 * (1 + atol)
    )
    # shards add up
    half = n // 2
    ss2 = model.suffstats(X[:half], y[:half], xi[:half]) + model.suffstats(
        X[half:], y[half:], xi[half:]
    )
    np.testing.assert_allclose(ss2.value(theta), explicit, rtol=1e-8, atol=atol)


def test_suffstats_rejects_bad_shapes(model):
    rng = np.random.default_rng(3)
    y = make_y(model, 5, rng)
    X = rng.normal(size=(5, 2))
    xi = model.untuned_xi(y)
    with pytest.raises(ValueError, match="suffstats"):
        model.suffstats(X[:4], y, xi)
    with pytest.raises(ValueError, match="suffstats"):
        model.suffstats(X, y, xi[:3])


# ----- derivatives against finite differences ----------------------------------
def _fd_eta(f, eta: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central differences of a per-datum function f(eta) -> (B, n) in each eta[..., e]."""
    out = np.empty(eta.shape)
    for e in range(eta.shape[-1]):
        ep, em = eta.copy(), eta.copy()
        ep[..., e] += h
        em[..., e] -= h
        out[..., e] = (f(ep) - f(em)) / (2 * h)
    return out


def _fd_theta(f, theta: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central differences of f(theta) -> (B,) in each theta[:, p]."""
    out = np.empty(theta.shape)
    for p in range(theta.shape[-1]):
        tp, tm = theta.copy(), theta.copy()
        tp[:, p] += h
        tm[:, p] -= h
        out[:, p] = (f(tp) - f(tm)) / (2 * h)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradients_finite_differences(model, seed):
    rng = np.random.default_rng(seed)
    n, D, B = 25, 3, 2
    X = rng.normal(size=(n, D))
    y = make_y(model, n, rng)
    xi = make_xi(model, y, rng, 2.0)
    eta = random_eta(model, B, n, rng, 2.0)
    kw = {"rtol": 1e-6, "atol": 1e-7}
    np.testing.assert_allclose(
        model.loglik_grad(eta, y)[1], _fd_eta(lambda e: model.loglik(e, y), eta), **kw
    )
    np.testing.assert_allclose(
        model.logbound_grad(eta, y, xi)[1],
        _fd_eta(lambda e: model.logbound(e, y, xi), eta),
        **kw,
    )
    # hessian: finite differences of the gradient
    e0 = eta[0]
    H = model.loglik_hess(e0, y)
    for j in range(model.n_outputs):
        fd = _fd_eta(lambda e, j=j: model.loglik_grad(e, y)[1][..., j], e0[None])[0]
        np.testing.assert_allclose(H[:, j, :], fd, **kw)
    np.testing.assert_allclose(H, np.swapaxes(H, -1, -2), rtol=1e-14, atol=0)
    # chain rule through linear_predictor / grad_theta
    P = model.n_params(D)
    theta = rng.normal(size=(B, P))

    def total_loglik(th):
        return model.loglik(model.linear_predictor(th, X), y).sum(-1)

    g = model.grad_theta(model.loglik_grad(model.linear_predictor(theta, X), y)[1], X)
    np.testing.assert_allclose(g, _fd_theta(total_loglik, theta), rtol=1e-6, atol=1e-6)
    ss = model.suffstats(X, y, xi)
    np.testing.assert_allclose(ss.grad(theta), _fd_theta(ss.value, theta), rtol=1e-6, atol=1e-6)
    # prior (keep Laplace away from its kink)
    theta_p = np.sign(theta) * (0.1 + np.abs(theta))
    np.testing.assert_allclose(
        model.log_prior_grad(theta_p), _fd_theta(model.log_prior, theta_p), rtol=1e-6, atol=1e-7
    )


def test_log_hessian_negative_semidefinite_for_log_concave():
    rng = np.random.default_rng(4)
    for m in (LogisticRegression(), SoftmaxRegression(4)):
        y = make_y(m, 30, rng)
        H = m.loglik_hess(5.0 * rng.normal(size=(30, m.n_outputs)), y)
        assert np.all(np.linalg.eigvalsh(H) <= 1e-15)


# ----- likelihood values against scipy / direct formulas --------------------------
def test_loglik_matches_scipy():
    rng = np.random.default_rng(5)
    n = 300
    eta = 8.0 * rng.normal(size=(2, n, 1))
    y = rng.integers(0, 2, n).astype(float)
    m = LogisticRegression()
    # scipy's bernoulli loses digits in log(1 - p) for large |eta|: compare it where it is
    # accurate, and everywhere against scipy's own stable log_expit.
    ok = np.abs(eta[..., 0]) < 5.0
    ref = stats.bernoulli.logpmf(y, expit(eta[..., 0]))
    np.testing.assert_allclose(m.loglik(eta, y)[ok], ref[ok], rtol=1e-12, atol=1e-14)
    ref = log_expit((2 * y - 1) * eta[..., 0])
    np.testing.assert_allclose(m.loglik(eta, y), ref, rtol=1e-14, atol=1e-300)
    np.testing.assert_allclose(m.loglik(eta, y.astype(bool)), ref, rtol=1e-14, atol=1e-300)
    np.testing.assert_allclose(m.loglik(eta, y.astype(int)), ref, rtol=1e-14, atol=1e-300)
    for nu, sc in ((4.0, 1.0), (1.0, 0.3), (50.0, 2.0), (0.5, 10.0)):
        yr = sc * rng.standard_t(nu, n)
        ref = stats.t.logpdf(yr, df=nu, loc=eta[..., 0], scale=sc)
        np.testing.assert_allclose(
            RobustRegression(nu=nu, scale=sc).loglik(eta, yr), ref, rtol=1e-12, atol=1e-12
        )
    for K in (2, 3, 7):
        etak = 5.0 * rng.normal(size=(2, n, K))
        yk = rng.integers(0, K, n)
        ref = etak[:, np.arange(n), yk] - np.log(np.exp(etak).sum(-1))
        # the naive reference cancels when ll ~ 0: absolute tolerance there
        np.testing.assert_allclose(
            SoftmaxRegression(K).loglik(etak, yk), ref, rtol=1e-12, atol=1e-14
        )
        # labels stored as floats are accepted
        np.testing.assert_allclose(
            SoftmaxRegression(K).loglik(etak, yk.astype(float)), ref, rtol=1e-12, atol=1e-14
        )


def test_softmax_bound_matches_textbook_form():
    """The shift-invariant evaluation equals the DESIGN.md formula."""
    rng = np.random.default_rng(6)
    K, n = 4, 50
    m = SoftmaxRegression(K)
    y = rng.integers(0, K, n)
    eta = 2.0 * rng.normal(size=(3, n, K))
    psi = 2.0 * rng.normal(size=(n, K))
    A = 0.5 * (np.eye(K) - 1.0 / K)
    g = np.exp(psi - np.log(np.exp(psi).sum(-1, keepdims=True)))
    d = eta - psi
    ref = (
        eta[:, np.arange(n), y]
        - np.log(np.exp(psi).sum(-1))
        - np.einsum("bnk,nk->bn", d, g)
        - 0.5 * np.einsum("bnk,kl,bnl->bn", d, A, d)
    )
    beta = m.logbound(eta, y, psi)
    np.testing.assert_allclose(beta, ref, rtol=1e-10, atol=1e-10)
    assert np.all(ref - beta >= 0) and np.all(ref - beta < 1e-10)  # just the margin


# ----- priors -----------------------------------------------------------------------
def test_priors_match_scipy():
    rng = np.random.default_rng(7)
    theta = 3.0 * rng.normal(size=(5, 6))
    for s in (0.1, 1.0, 7.0):
        np.testing.assert_allclose(
            Prior("normal", s).logpdf(theta), stats.norm.logpdf(theta, scale=s).sum(-1), rtol=1e-13
        )
        np.testing.assert_allclose(
            Prior("laplace", s).logpdf(theta),
            stats.laplace.logpdf(theta, scale=s).sum(-1),
            rtol=1e-13,
        )
        np.testing.assert_array_equal(Prior("flat", s).logpdf(theta), np.zeros(5))
        np.testing.assert_array_equal(Prior("flat", s).grad(theta), np.zeros_like(theta))
        np.testing.assert_allclose(Prior("normal", s).precision(3), np.eye(3) / s**2)
        np.testing.assert_allclose(Prior("laplace", s).precision(3), np.eye(3) / (2 * s**2))
        # variance-matched: the Laplace variance is 2 b^2
        assert stats.laplace(scale=s).var() == pytest.approx(2 * s**2)
    np.testing.assert_array_equal(Prior("flat").precision(2), np.zeros((2, 2)))
    np.testing.assert_array_equal(
        Prior("laplace", 2.0).grad(np.array([[0.0, 1.0, -3.0]])), [[0.0, -0.5, 0.5]]
    )
    m = RobustRegression(prior="normal", prior_scale=2.0)
    np.testing.assert_allclose(m.log_prior(theta), stats.norm.logpdf(theta, scale=2.0).sum(-1))
    assert m.prior == "normal" and m.prior_scale == 2.0


# ----- validation ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "ctor",
    [
        lambda: LogisticRegression(prior="gaussian"),
        lambda: LogisticRegression(prior=None),
        lambda: LogisticRegression(prior_scale=0.0),
        lambda: LogisticRegression(prior_scale=-1.0),
        lambda: LogisticRegression(prior_scale=float("nan")),
        lambda: LogisticRegression(prior_scale=float("inf")),
        lambda: LogisticRegression(prior_scale=True),
        lambda: LogisticRegression(prior_scale="1"),
        lambda: LogisticRegression(xi_untuned=float("nan")),
        lambda: SoftmaxRegression(1),
        lambda: SoftmaxRegression(0),
        lambda: SoftmaxRegression(2.5),
        lambda: SoftmaxRegression(True),
        lambda: SoftmaxRegression(3, prior="cauchy"),
        lambda: RobustRegression(nu=0.0),
        lambda: RobustRegression(nu=-2.0),
        lambda: RobustRegression(nu=float("inf")),
        lambda: RobustRegression(scale=0.0),
        lambda: RobustRegression(scale=float("nan")),
        lambda: RobustRegression(scale=1e200),
        lambda: RobustRegression(prior_scale=-3.0),
    ],
)
def test_bad_arguments_raise_value_error(ctor):
    with pytest.raises(ValueError):
        ctor()


def test_validate_targets_messages():
    m = LogisticRegression()
    m.validate_targets(np.array([0, 1, 1, 0]))
    m.validate_targets(np.array([True, False]))
    m.validate_targets(np.array([0.0, 1.0]))
    y = np.zeros(20)
    y[17] = 2
    with pytest.raises(ValueError, match=r"y\[17\] = 2\.0 is not a 0/1 label"):
        m.validate_targets(y)
    with pytest.raises(ValueError, match=r"y\[1\] = nan"):
        m.validate_targets(np.array([0.0, np.nan, 3.0]))
    with pytest.raises(ValueError, match="one-dimensional"):
        m.validate_targets(np.zeros((3, 1)))
    with pytest.raises(ValueError, match="dtype"):
        m.validate_targets(np.array(["0", "1"]))

    s = SoftmaxRegression(3)
    s.validate_targets(np.array([0, 1, 2]))
    s.validate_targets(np.array([0.0, 2.0]))
    with pytest.raises(ValueError, match=r"y\[2\] = 3 is not a class label in 0\.\.2"):
        s.validate_targets(np.array([0, 1, 3, -1]))
    with pytest.raises(ValueError, match=r"y\[0\] = -1"):
        s.validate_targets(np.array([-1, 1]))
    with pytest.raises(ValueError, match=r"y\[1\] = 1\.5"):
        s.validate_targets(np.array([0.0, 1.5]))
    with pytest.raises(ValueError, match=r"y\[0\] = inf"):
        s.validate_targets(np.array([np.inf, 1.0]))

    r = RobustRegression()
    r.validate_targets(np.array([0.5, -1e10, 3]))
    with pytest.raises(ValueError, match=r"y\[2\] = inf is not finite"):
        r.validate_targets(np.array([0.5, 1.0, np.inf, np.nan]))
    with pytest.raises(ValueError, match="dtype"):
        r.validate_targets(np.array([True, False]))


def test_make_model_and_from_dict_errors():
    assert isinstance(make_model("logistic"), LogisticRegression)
    assert make_model("Softmax", n_classes=5).n_outputs == 5
    assert make_model("robust", nu=3.0).nu == 3.0
    with pytest.raises(ValueError, match="'logistic', 'softmax', 'robust'"):
        make_model("poisson")
    with pytest.raises(ValueError, match="bad arguments"):
        make_model("softmax")  # n_classes missing
    with pytest.raises(ValueError, match="bad arguments"):
        make_model("logistic", nu=3.0)
    with pytest.raises(ValueError, match="name"):
        model_from_dict({"prior": "normal"})
    with pytest.raises(ValueError):
        model_from_dict({"name": "robust", "nu": -1.0})
