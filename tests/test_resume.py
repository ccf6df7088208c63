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
    opts = dict(
        algorithm=fd.FlyMC(bounds="map"),
        kernel="rwmh",
        num_warmup=100,
        num_samples=300,
        chains=2,
        seed=1,
        client="synchronous",
        progress=False,
        trace=trace,
        checkpoint_every=40,
    )
    opts.update(kw)
    return fd.sample(fd.LogisticRegression(prior_scale=3.0), _data(), **opts)


# during warm-up, and during sampling (the longer run slow)
@pytest.mark.parametrize("stop_at", [60, pytest.param(250, marks=pytest.mark.slow)])
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
    monkeypatch.delattr(Driver, "steps", raising=False)  # each iteration by step (see test_cli)
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
    np.testing.assert_array_equal(res.warmup_samples[:, : saved_w.shape[1]], saved_w)
    np.testing.assert_array_equal(res.samples[:, : saved.shape[1]], saved)
    final = Trace.open(trace)
    assert final.n_draws == 300 and final.n_warmup_draws == 100
    np.testing.assert_array_equal(final.samples, res.samples)
    assert np.all(np.isfinite(res.samples))
    # the resumed part continues from the checkpointed positions (not from scratch)
    full = _sample(str(tmp_path / "u.zarr"))
    assert np.allclose(res.samples.mean(axis=(0, 1)), full.samples.mean(axis=(0, 1)), atol=0.25)


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


@pytest.mark.slow
def test_resume_refuses_what_differs(tmp_path):
    """A resume must match the trace's data set (its identity, not only its shape), model,
    algorithm and every setting that shapes the draws; one line names what differs."""
    trace = str(tmp_path / "t.zarr")
    X, y = _data()
    a = fd.from_numpy(X, y, tmp_path / "a.zarr", chunk_rows=100)
    X2, y2 = _data(seed=6)  # another data set of the same shape
    b = fd.from_numpy(X2, y2, tmp_path / "b.zarr", chunk_rows=100)
    kw = dict(num_warmup=10, num_samples=20)
    fd.sample(
        fd.LogisticRegression(prior_scale=3.0),
        a,
        client="synchronous",
        progress=False,
        trace=trace,
        checkpoint_every=10,
        chains=2,
        seed=1,
        **kw,
    )
    before = Trace.open(trace).samples.copy()

    def resume(data=a, model=None, **more):
        opts = dict(
            client="synchronous",
            progress=False,
            trace=trace,
            checkpoint_every=10,
            chains=2,
            seed=1,
            resume=True,
            **kw,
        )
        opts.update(more)
        return fd.sample(model or fd.LogisticRegression(prior_scale=3.0), data, **opts)

    cases = [
        (dict(data=b), r"another data set \(.*a\.zarr .*this run: .*b\.zarr"),
        (dict(data=str(tmp_path / "b.zarr")), "another data set"),
        (dict(data=(X, y)), "another data set"),
        (dict(model=fd.RobustRegression()), "model"),
        (dict(model=fd.LogisticRegression(prior_scale=1.0)), "model"),
        (dict(chains=3), r"chains 2 \(this run: 3\)"),
        (dict(num_warmup=11), r"num_warmup 10 \(this run: 11\)"),
        (dict(seed=2), "seed 1"),
        (dict(algorithm="regular"), "algorithm 'flymc'"),
        (dict(kernel="mala"), "kernel 'nuts'"),  # the default, resolved
        (dict(algorithm=fd.FlyMC(bounds="untuned")), "bounds 'map'"),
        (dict(algorithm=fd.FlyMC(q_db=0.5)), r"q_db 'auto' \(this run: 0.5\)"),
        (dict(precondition="identity"), "precondition"),
    ]
    for change, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            resume(**change)
        assert "\n" not in str(info.value)
    np.testing.assert_array_equal(Trace.open(trace).samples, before)
    # the same data set, copied elsewhere, and the same settings: accepted
    import shutil

    shutil.copytree(tmp_path / "a.zarr", tmp_path / "copy.zarr")
    res = resume(data=str(tmp_path / "copy.zarr"))
    np.testing.assert_array_equal(res.samples, before)


def test_api_failure_keeps_a_checkpointed_trace_and_says_so(tmp_path, monkeypatch):
    """fd.sample failing mid-run: a trace with a checkpoint is kept (the error says how to
    resume); one without is removed, as it created it."""
    trace = str(tmp_path / "t.zarr")
    real_step = Driver.step
    calls = {"n": 0}

    def failing(self, adapters=None):
        calls["n"] += 1
        if calls["n"] == 90:
            raise RuntimeError("lost")
        return real_step(self, adapters)

    monkeypatch.setattr(Driver, "step", failing)
    with pytest.raises(RuntimeError, match="lost") as info:
        _sample(trace)
    assert any("keeps 80 iterations" in n and "resume=True" in n for n in info.value.__notes__)
    assert Trace.open(trace).checkpoint["iteration"] == 79
    calls["n"] = -1000
    monkeypatch.setattr(Driver, "step", real_step)
    assert _sample(trace, resume=True).samples.shape == (2, 300, 2)
    calls["n"] = 0
    monkeypatch.setattr(Driver, "step", failing)
    with pytest.raises(RuntimeError, match="lost"):
        _sample(str(tmp_path / "u.zarr"), checkpoint_every=100)
    assert not (tmp_path / "u.zarr").exists()


@pytest.mark.parametrize("gone", [("data_id",), ("options",), ("data_id", "options")])
def test_resume_refuses_a_trace_that_does_not_record_its_data_set(tmp_path, monkeypatch, gone):
    """A trace written before traces recorded their data set's identity and options (here:
    those attributes removed) cannot be checked against this run: a resume is refused,
    saying why, rather than splicing another data set's posterior onto it."""
    import zarr

    trace = str(tmp_path / "t.zarr")
    real_step, calls = Driver.step, {"n": 0}

    def flaky_step(self, adapters=None):
        calls["n"] += 1
        if calls["n"] == 150:
            raise KeyboardInterrupt
        return real_step(self, adapters)

    monkeypatch.setattr(Driver, "step", flaky_step)
    monkeypatch.delattr(Driver, "steps", raising=False)  # each iteration by step (see test_cli)
    with pytest.raises(KeyboardInterrupt):
        _sample(trace)
    monkeypatch.setattr(Driver, "step", real_step)
    group = zarr.open_group(trace, mode="r+")
    for key in gone:
        del group.attrs[key]
    before = Trace.open(trace).samples.copy()
    with pytest.raises(ValueError, match="does not record") as info:
        _sample(trace, resume=True)
    msg = str(info.value)
    assert "\n" not in msg and all(k in msg for k in gone) and "cannot be checked" in msg
    np.testing.assert_array_equal(Trace.open(trace).samples, before)


def test_cli_refuses_a_trace_missing_a_chunk(tmp_path, capsys, monkeypatch):
    """A trace copied in part (a chunk of its statistics gone): `flymc summary` and
    `--resume` fail in one line naming the chunk (no NaN table, no wrong acceptance, no
    resume hint), and the trace is left as it was (#28 item 6)."""
    import os

    from flymc_dist.cli import main

    store = str(tmp_path / "d.zarr")
    fd.from_numpy(*_data(), store, chunk_rows=100)
    trace = str(tmp_path / "t.zarr")
    base = ["run", store, "--model", "logistic", "--algorithm", "regular", "--kernel", "rwmh"]
    base += ["--warmup", "10", "--samples", "60", "--chains", "1", "--synchronous"]
    base += ["--no-progress", "--checkpoint-every", "10", "--trace", trace]
    real_step, calls = Driver.step, {"n": 0}

    def flaky_step(self, adapters=None):
        calls["n"] += 1
        if calls["n"] == 45:
            raise KeyboardInterrupt
        return real_step(self, adapters)

    monkeypatch.setattr(Driver, "step", flaky_step)
    monkeypatch.delattr(Driver, "steps", raising=False)  # each iteration by step (see test_cli)
    assert main(base) == 130
    monkeypatch.setattr(Driver, "step", real_step)
    chunk = os.path.join(trace, "sample_stats", "accepted", "c", "0", "0")
    os.remove(chunk)
    capsys.readouterr()
    for argv in (["summary", trace], [*base, "--resume"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert "is damaged: chunk 'sample_stats/accepted/c/0/0'" in err[0]
        assert "draws 0-29 of sample_stats/accepted" in err[0]
    assert not os.path.exists(chunk) and Trace.open(trace).n_draws == 30
