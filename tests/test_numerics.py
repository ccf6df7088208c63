"""Tests of flymc_dist._numerics against high-precision (decimal) references."""

from __future__ import annotations

import math
import warnings
from decimal import Decimal, localcontext

import numpy as np
import pytest
import scipy.special
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flymc_dist._numerics import (
    BOUND_EPS,
    in_sorted,
    log_expm1,
    log_sigmoid,
    log_softmax,
    logsumexp,
    sigmoid,
    softmax,
    weighted_gram,
)


def _ref_log_expm1(x: float) -> float:
    """log(exp(x) - 1) with enough decimal digits that cancellation cannot hurt."""
    if x > 1000.0:
        return x - math.exp(-x)  # exact to well below an ulp of x
    with localcontext() as ctx:
        ctx.prec = 60 + max(0, -int(math.floor(math.log10(x))))
        d = Decimal(x)  # the exact binary value
        return float((d.exp() - 1).ln())


def _ref_log_sigmoid(x: float) -> float:
    with localcontext() as ctx:
        # 1 + exp(-x) must keep exp(-x)'s digits for x > 0; for x < 0 the result
        # is x - log1p(e^x) and e^x below 1e-20 |x| cannot matter.
        ctx.prec = 60 + (int(x / 2.3) if x > 0 else 20)
        d = Decimal(x)
        return float(-((-d).exp() + 1).ln())


# ----- log_expm1 -------------------------------------------------------------
def test_log_expm1_special_values():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = log_expm1(np.array([0.0, -0.0, -1.0, -1e300, np.inf, np.nan]))
    assert np.all(out[:4] == -np.inf)
    assert out[4] == np.inf
    assert np.isnan(out[5])
    assert log_expm1(0.0) == -np.inf
    assert np.ndim(log_expm1(1.0)) == 0
    assert log_expm1(np.zeros((2, 3))).shape == (2, 3)


def test_log_expm1_grid_against_decimal():
    xs = np.concatenate(
        [np.geomspace(5e-324, 1e-5, 40), np.geomspace(1e-5, 50, 200), [math.log(2)], [700, 1e5]]
    )
    out = log_expm1(xs)
    ref = np.array([_ref_log_expm1(float(x)) for x in xs])
    # absolute accuracy ~ulp of the result's inputs; relative where the result is not near 0
    np.testing.assert_allclose(out, ref, rtol=2e-15, atol=4e-16)


def test_log_expm1_asymptotes():
    tiny = np.geomspace(1e-300, 1e-9, 30)
    np.testing.assert_allclose(log_expm1(tiny), np.log(tiny) + tiny / 2, rtol=1e-15)
    big = np.array([40.0, 100.0, 709.0, 800.0, 1e6, 1e300])
    np.testing.assert_allclose(log_expm1(big), big - np.exp(-big), rtol=1e-16)
    mid = np.linspace(0.01, 30, 101)
    np.testing.assert_allclose(log_expm1(mid), np.log(np.expm1(mid)), rtol=1e-13, atol=1e-15)


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0.0, max_value=1e300, allow_subnormal=True))
def test_log_expm1_hypothesis(x):
    out = float(log_expm1(x))
    if x == 0.0:
        assert out == -np.inf
    else:
        ref = _ref_log_expm1(x)
        assert math.isclose(out, ref, rel_tol=4e-15, abs_tol=1e-15)


# ----- sigmoid / log_sigmoid -------------------------------------------------
def test_log_sigmoid_and_sigmoid():
    xs = np.concatenate([-np.geomspace(1e4, 1e-8, 60), [0.0], np.geomspace(1e-8, 700, 60)])
    ref = np.array([_ref_log_sigmoid(float(x)) for x in xs])
    np.testing.assert_allclose(log_sigmoid(xs), ref, rtol=4e-16, atol=0)
    np.testing.assert_allclose(sigmoid(xs), np.exp(ref), rtol=4e-15, atol=0)
    ext = np.array([-np.inf, -1e308, 1e308, np.inf])
    np.testing.assert_array_equal(log_sigmoid(ext), [-np.inf, -1e308, 0.0, 0.0])
    np.testing.assert_array_equal(sigmoid(ext), [0.0, 0.0, 1.0, 1.0])
    assert np.ndim(log_sigmoid(0.0)) == 0
    assert log_sigmoid(0.0) == pytest.approx(-math.log(2), rel=1e-16)


# ----- logsumexp / softmax ---------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 5),
    st.floats(1e-3, 1e4),
    st.integers(0, 2**32 - 1),
)
@example(2, 3, 2.890625, 3)
def test_logsumexp_softmax_match_scipy(n, K, scale, seed):
    a = np.random.default_rng(seed).normal(scale=scale, size=(n, K))
    # a result near 0 (a sum of exponentials near 1) has an absolute error of an ulp of
    # the terms, not a relative one: found at n=2, K=3, scale 2.89, seed 3 (2.07e-4,
    # 1.1e-16 apart)
    atol = 1e-15 * (1.0 + scale)
    np.testing.assert_allclose(
        logsumexp(a), scipy.special.logsumexp(a, axis=-1), rtol=1e-14, atol=atol
    )
    np.testing.assert_allclose(
        logsumexp(a, axis=0, keepdims=True),
        scipy.special.logsumexp(a, axis=0, keepdims=True),
        rtol=1e-14,
        atol=atol,
    )
    p = softmax(a)
    np.testing.assert_allclose(p, scipy.special.softmax(a, axis=-1), rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(
        log_softmax(a), scipy.special.log_softmax(a, axis=-1), rtol=1e-12, atol=1e-14 * scale
    )


def test_logsumexp_extremes():
    a = np.array(
        [
            [1e308, 1e308, 0.0],
            [-np.inf, -np.inf, -np.inf],
            [np.inf, 0.0, 1.0],
            [-1e308, -1e308, -np.inf],
            [0.0, 0.0, 0.0],
        ]
    )
    out = logsumexp(a)
    assert out[0] == 1e308  # 1e308 + log 2 rounds to 1e308
    assert out[1] == -np.inf
    assert out[2] == np.inf
    assert out[3] == -1e308
    assert out[4] == pytest.approx(math.log(3), rel=1e-15)
    p = softmax(a[[0, 3, 4]])
    np.testing.assert_allclose(p, [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [1 / 3] * 3], rtol=1e-15)
    assert np.ndim(logsumexp(np.array([1.0, 2.0]))) == 0


# ----- weighted_gram and the bound margin ------------------------------------
def test_weighted_gram_chunks():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(103, 4))
    w = rng.normal(size=103)
    ref = (X * w[:, None]).T @ X
    for chunk in (1, 7, 103, 1000):
        G = weighted_gram(X, w, chunk_rows=chunk)
        np.testing.assert_allclose(G, ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(G, G.T)
    np.testing.assert_allclose(weighted_gram(X, chunk_rows=10), X.T @ X, rtol=1e-12)
    np.testing.assert_array_equal(weighted_gram(np.zeros((0, 3)), np.zeros(0)), np.zeros((3, 3)))


def test_bound_eps_is_small_but_above_rounding():
    assert 1e3 * np.finfo(float).eps < BOUND_EPS <= 1e-10


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 40), max_size=30),
    st.lists(st.integers(0, 40), max_size=30, unique=True),
)
def test_in_sorted_is_isin(values: list[int], ref: list[int]) -> None:
    """Membership by binary search equals ``np.isin`` (empty sides, values past both
    ends of the reference, repeats among the values)."""
    v = np.array(values, dtype=np.int64)
    r = np.sort(np.array(ref, dtype=np.int64))
    got = in_sorted(v, r)
    assert got.dtype == bool
    np.testing.assert_array_equal(got, np.isin(v, r))
