"""FlyMC's iterations in replica mode, a read-ahead block's in one compiled call
(:func:`flymc_dist._compiled_loop.replica_steps`, through ``Driver.steps``): the same
draws and statistics, bit for bit, as the same iterations one :meth:`Driver.step` at a
time — across block ends, checkpoints, a resume, and the hand-back of z to the shards
when the replica outgrows its budget — and a NaN left to the per-iteration guard."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

import flymc_dist as fd
from flymc_dist.driver import Driver
from flymc_dist.replica import BrightReplica
from flymc_dist.trace import Trace


def _data(n: int = 600, seed: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.c_[np.ones(n), rng.normal(size=(n, 3))]
    y = (rng.random(n) < 1 / (1 + np.exp(-X @ np.array([0.2, 1.0, -0.8, 0.5])))).astype(int)
    return X, y


def _run(
    loop: bool, monkeypatch: pytest.MonkeyPatch, kernel: str = "nuts", **kw: object
) -> tuple[fd.Result, int]:
    """A default FlyMC run with ``kernel`` in this process; with ``loop`` False every
    iteration goes through ``Driver.step``. Returns the result and the compiled calls
    made."""
    calls = [0]
    original = BrightReplica.block_steps

    def counted(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls[0] += 1
        return original(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(BrightReplica, "block_steps", counted)
        if not loop:
            m.setattr(Driver, "_block", lambda self, n, positions, stats, i0, seconds: 0)
        options = dict(
            num_warmup=40, num_samples=150, chains=3, seed=5, client="synchronous",
            progress=False, placement=fd.Placement(n_shards=3),
        )  # fmt: skip
        options.update(kw)
        algorithm = options.pop("algorithm", fd.FlyMC(read_ahead=7))
        res = fd.sample(fd.LogisticRegression(), _data(), algorithm, kernel, **options)
    return res, calls[0]


def _same(a: fd.Result, b: fd.Result) -> None:
    np.testing.assert_array_equal(a.samples, b.samples)
    np.testing.assert_array_equal(a.warmup_samples, b.warmup_samples)
    assert set(a.stats) == set(b.stats)
    for k in a.stats:
        np.testing.assert_array_equal(a.stats[k], b.stats[k], err_msg=k)
        np.testing.assert_array_equal(a.warmup_stats[k], b.warmup_stats[k], err_msg=k)


@pytest.mark.parametrize("kernel", ["nuts", "rwmh"])
def test_the_compiled_iterations_are_the_steps(monkeypatch, kernel):
    """Blocks of 7 iterations (one host in process; 40 of warm-up, 150 kept: neither a
    multiple of 7): the same draws and every statistic, round trips and bright rows
    included; the loop ran, a call per block; and a call per iteration when each call's
    time runs out at once. NUTS and random-walk MH alike."""
    looped, calls = _run(True, monkeypatch, kernel)
    stepped, none = _run(False, monkeypatch, kernel)
    assert looped.info["bright_replica"] is True and looped.info["read_ahead"] == 7
    # one at the end of warm-up (none run: the loop made ready), then steps 40, 41 (the
    # block of 35–41), 21 blocks, 189 (more only if a call's time ran out)
    assert none == 0 and 24 <= calls <= 31
    _same(looped, stepped)
    assert looped.stats["round_trips"].sum(axis=1).tolist() == [22, 22, 22]
    # out of time at once: every call returns after one iteration, the same draws
    steps = Driver.steps
    monkeypatch.setattr(Driver, "steps", lambda self, n, seconds, *out: steps(self, n, 0.0, *out))
    one_by_one, calls = _run(True, monkeypatch, kernel)
    assert calls == 1 + 150
    _same(one_by_one, stepped)


def test_with_a_trace_checkpoints_and_a_resume(monkeypatch, tmp_path):
    """Checkpoints every 10 iterations cut the blocks, the same draws; a run interrupted
    during sampling resumes from its trace the same way by blocks and step by step."""
    stepped, _ = _run(False, monkeypatch, trace=str(tmp_path / "a.zarr"), checkpoint_every=10)
    looped, calls = _run(True, monkeypatch, trace=str(tmp_path / "b.zarr"), checkpoint_every=10)
    assert calls >= 15
    _same(looped, stepped)
    trace = tmp_path / "c.zarr"
    left = [6]
    original = BrightReplica.block_steps

    def failing(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        left[0] -= 1
        if left[0] == 0:
            raise KeyboardInterrupt
        return original(self, *a, **k)

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(BrightReplica, "block_steps", failing)
        _run(True, monkeypatch, trace=str(trace), checkpoint_every=10)
    assert Trace.open(str(trace)).samples.shape[1] >= 10  # stopped during sampling
    shutil.copytree(trace, tmp_path / "d.zarr")
    a, _ = _run(True, monkeypatch, trace=str(trace), checkpoint_every=10, resume=True)
    b, _ = _run(
        False, monkeypatch, trace=str(tmp_path / "d.zarr"), checkpoint_every=10, resume=True
    )
    _same(a, b)


def test_over_the_replica_budget_z_goes_back_to_the_shards(monkeypatch):
    """A replica budget that the bright rows outgrow during sampling, not before (seed
    5: at most 6 rows over the chains in warm-up, up to 9 after): the loop returns after
    the iteration that outgrew it, z goes back to the shards there, and the draws are
    the step-by-step run's (the shards evaluate from that iteration on)."""
    probe, _ = _run(True, monkeypatch)
    rows = probe.stats["n_bright"].sum(axis=0)
    assert probe.warmup_stats["n_bright"].sum(axis=0).max() <= 7 < rows.max()
    per_row = 8 * (4 + 1 + 1 + 1)  # features, target, tight point, id
    algorithm = fd.FlyMC(read_ahead=7, replica_budget=7 * per_row)
    stepped, _ = _run(False, monkeypatch, algorithm=algorithm)
    looped, calls = _run(True, monkeypatch, algorithm=algorithm)
    assert stepped.info["bright_replica"] is False  # z was handed back during sampling
    assert 1 <= calls <= int(np.argmax(rows > 7)) // 7 + 3  # + 1: the end of warm-up's
    _same(looped, stepped)


def test_a_nan_is_left_to_the_guard():
    """The compiled call stops before an iteration whose values hold a NaN (here a
    non-finite position) and leaves the replica as it was, for the per-iteration update
    and its guard; the same call at a finite position runs."""
    from flymc_dist.kernels.hamiltonian import hamiltonian_params
    from flymc_dist.protocol import ReplicaReply
    from flymc_dist.replica import nuts_inputs

    X, y = _data(40)
    model = fd.LogisticRegression()
    theta = np.array([[0.2, 1.0, -0.8, 0.5]])
    xi = model.tuned_xi(model.linear_predictor(theta, X)[0], y)
    ids = np.arange(0, 40, 4)
    replica = BrightReplica(model, 1, [(0, 40)])
    one = np.ones(1, dtype=np.int64)
    replica.apply(
        [
            ReplicaReply(
                n_bright=ids.size * one, queries=0 * one, full=np.ones(1, dtype=bool),
                gone_ids=np.empty(0, dtype=np.int64), gone_seg=np.zeros(2, dtype=np.int64),
                new_ids=ids, new_seg=np.array([0, ids.size]), new_X=X[ids], new_y=y[ids],
                new_xi=xi[ids],
            )
        ]
    )  # fmt: skip
    block = type("Block", (), {})()  # the proposals of steps 0 and 1: rows 1 and 2, none
    block.first, block.ids = 0, np.array([1, 2], dtype=np.int64)
    block.seg, block.at = np.array([0, 2, 2], dtype=np.int64), np.array([1, 2], dtype=np.int64)
    block.rows = (replica.row_buffer([X], y, xi), y, xi)
    params = hamiltonian_params(0.1, np.ones(4))
    # the generator and what holds its address kept alive: the compiled call draws from
    # it by that address
    rng, held = np.random.default_rng(0), {}
    nuts = nuts_inputs(held, [rng], [0.1], [params.inv_metric], [params.momentum_factor])
    bound = model.suffstats(X, y, xi)
    args = ((1, 0, 0, 1), 0.1)
    nan = np.full((1, 4), np.nan)
    done, over, pos, _, _ = replica.block_steps(
        2, block, *args, nan, "nuts", (*nuts, 5, 1e3), bound, -1, 1e9
    )
    assert (done, over, pos.shape[0]) == (0, False, 0)
    np.testing.assert_array_equal(replica.bright_ids()[0], ids)
    done, over, pos, _, ints = replica.block_steps(
        2, block, *args, theta.copy(), "nuts", (*nuts, 5, 1e3), bound, -1, 1e9
    )
    assert (done, over, pos.shape) == (2, False, (2, 1, 4))
    assert np.isfinite(pos).all()
    assert ints[-1, 0, 5] == replica.bright_ids()[0].size  # the replica as it left it


def test_the_compiled_clock_is_perf_counter():
    from flymc_dist._compiled_loop import monotonic

    a, b, c = time.perf_counter(), monotonic(), time.perf_counter()
    assert a - 1e-3 <= b <= c + 1e-3
