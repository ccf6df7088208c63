"""An interrupted run resumes from its zarr trace and completes all requested draws."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import expit

import flymc_dist as fd
from flymc_dist.driver import Driver
from flymc_dist.trace import Trace


def _data(n: int = 400, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.c_[np.ones(n), rng.normal(size=n)]
    return X, (rng.random(n) < expit(X @ np.array([0.3, -0.8]))).astype(np.int64)


def _sample(trace: str, **kw):
    opts = dict(algorithm="flymc", bounds="map", kernel="rwmh", num_warmup=100,
                num_samples=300, chains=2, seed=1, client="synchronous", progress=False,
                trace=trace, checkpoint_every=40)
    opts.update(kw)
    return fd.sample(fd.LogisticRegression(prior_scale=3.0), _data(), **opts)


@pytest.mark.parametrize("stop_at", [60, 250])  # during warm-up, and during sampling
def test_interrupted_run_resumes_from_trace(tmp_path, monkeypatch, stop_at):
    trace = str(tmp_path / "t.zarr")
    calls = {"n": 0}
    real_step = Driver.step

    def flaky_step(self, adapters=None):
        calls["n"] += 1
        if calls["n"] == stop_at:
            raise KeyboardInterrupt
        return real_step(self, adapters)

    monkeypatch.setattr(Driver, "step", flaky_step)
    with pytest.raises(KeyboardInterrupt):
        _sample(trace)
    monkeypatch.setattr(Driver, "step", real_step)

    tr = Trace.open(trace)
    ck = tr.checkpoint
    done = ck["iteration"] + 1
    # checkpoints every 40 iterations and at the end of warm-up (100): at most 40 lost
    assert stop_at - 40 <= done < stop_at
    saved_w, saved = tr.warmup_samples.copy(), tr.samples.copy()

    res = _sample(trace, resume=True)
    assert res.samples.shape == (2, 300, 2)
    assert res.warmup_samples.shape == (2, 100, 2)
    # what was on disk before the interruption is kept, bit for bit
    np.testing.assert_array_equal(res.warmup_samples[:, :saved_w.shape[1]], saved_w)
    np.testing.assert_array_equal(res.samples[:, :saved.shape[1]], saved)
    final = Trace.open(trace)
    assert final.n_draws == 300 and final.n_warmup_draws == 100
    np.testing.assert_array_equal(final.samples, res.samples)
    assert np.all(np.isfinite(res.samples))
    # the resumed part continues from the checkpointed positions (not from scratch)
    full = _sample(str(tmp_path / "u.zarr"))
    assert np.allclose(res.samples.mean(axis=(0, 1)), full.samples.mean(axis=(0, 1)),
                       atol=0.25)


def test_resume_without_trace_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        _sample(str(tmp_path / "missing.zarr"), resume=True)


def test_existing_trace_is_not_overwritten(tmp_path):
    trace = str(tmp_path / "t.zarr")
    _sample(trace, num_warmup=10, num_samples=10)
    with pytest.raises(FileExistsError):
        _sample(trace, num_warmup=10, num_samples=10)
    res = _sample(trace, num_warmup=10, num_samples=20, overwrite_trace=True)
    assert Trace.open(trace).n_draws == 20 and res.samples.shape[1] == 20
