"""Tests for flymc_dist.trace: round trips, growth, checkpoints, crash consistency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

import flymc_dist.trace as trace_module
from flymc_dist.trace import Trace, TraceDamagedError, TraceLock, TraceLockedError, probe

pytestmark = pytest.mark.filterwarnings("error")

STATS = {
    "accepted": np.bool_,
    "n_bright": np.int64,
    "likelihood_queries": np.int64,
    "log_joint": np.float64,
}


def _batch(rng: np.random.Generator, chains: int, n: int, param_shape: tuple[int, ...]) -> tuple:
    samples = rng.standard_normal((chains, n, *param_shape))
    stats = {
        "accepted": rng.random((chains, n)) < 0.3,
        "n_bright": rng.integers(0, 1000, (chains, n)),
        "likelihood_queries": rng.integers(0, 10**12, (chains, n)),
        "log_joint": rng.standard_normal((chains, n)) * 1e3,
    }
    return samples, stats


def _new(path: Path, chains: int = 3, param_shape: tuple[int, ...] = (4,), **kw) -> Trace:
    return Trace.create(
        path, chains=chains, param_shape=param_shape, stats=STATS, attrs={"seed": 0}, **kw
    )


def _concat(batches: list[tuple]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    samples = np.concatenate([b[0] for b in batches], axis=1)
    stats = {k: np.concatenate([b[1][k] for b in batches], axis=1) for k in STATS}
    return samples, stats


def _assert_content(trace: Trace, batches: list[tuple], *, warmup: bool) -> None:
    samples, stats = _concat(batches)
    got_samples = trace.warmup_samples if warmup else trace.samples
    got_stats = trace.warmup_stats if warmup else trace.stats
    np.testing.assert_array_equal(got_samples, samples)
    assert got_samples.dtype == np.float64
    assert set(got_stats) == set(STATS)
    for name, dtype in STATS.items():
        assert got_stats[name].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got_stats[name], stats[name])
    assert (trace.n_warmup_draws if warmup else trace.n_draws) == samples.shape[1]


# --------------------------------------------------------------------------------------------
# round trips and growth
# --------------------------------------------------------------------------------------------


def test_create_append_open_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    attrs = {
        "algorithm": {"name": "flymc", "kernel": "rwmh", "q_db": 0.01, "steps": (1, 2)},
        "model": {"class": "LogisticRegression", "prior_scale": np.float64(1.5)},
        "dataset": "/data/x.zarr",
        "seed": 12345,
        "prior_mean": np.zeros(3),
    }
    trace = Trace.create(tmp_path / "t", chains=2, param_shape=(3,), stats=STATS, attrs=attrs)
    assert trace.n_draws == trace.n_warmup_draws == 0
    assert trace.samples.shape == (2, 0, 3) and trace.warmup_samples.shape == (2, 0, 3)
    assert trace.checkpoint is None
    warm = [_batch(rng, 2, 5, (3,))]
    main = [_batch(rng, 2, 7, (3,))]
    trace.append(*warm[0], warmup=True)
    trace.append(*main[0], warmup=False)
    _assert_content(trace, warm, warmup=True)
    _assert_content(trace, main, warmup=False)

    reopened = Trace.open(tmp_path / "t")
    _assert_content(reopened, warm, warmup=True)
    _assert_content(reopened, main, warmup=False)
    assert reopened.chains == 2 and reopened.param_shape == (3,)
    assert reopened.stat_dtypes == {k: np.dtype(v) for k, v in STATS.items()}
    got = reopened.attrs
    assert got["algorithm"] == {"name": "flymc", "kernel": "rwmh", "q_db": 0.01, "steps": [1, 2]}
    assert got["model"]["prior_scale"] == 1.5 and got["seed"] == 12345
    np.testing.assert_array_equal(got["prior_mean"], np.zeros(3))
    assert "flymc_trace" not in got
    assert "n_draws=7" in repr(reopened)


@pytest.mark.parametrize("param_shape", [(), (2, 3)])
def test_other_parameter_shapes(tmp_path: Path, param_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    trace = _new(tmp_path / "t", chains=2, param_shape=param_shape)
    batches = [_batch(rng, 2, n, param_shape) for n in (3, 4)]
    for batch in batches:
        trace.append(*batch, warmup=False)
    _assert_content(Trace.open(tmp_path / "t"), batches, warmup=False)


def test_growth_across_many_appends_and_chunks(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    trace = _new(tmp_path / "t", chunk_draws=16)
    warm, main = [], []
    for i in range(20):
        n = int(rng.integers(0, 40))
        batch = _batch(rng, 3, n, (4,))
        (warm if i < 8 else main).append(batch)
        trace.append(*batch, warmup=i < 8)
        if i % 7 == 0:
            trace.set_checkpoint({"iteration": i})
    trace.set_checkpoint({"iteration": 20})
    _assert_content(trace, warm, warmup=True)
    _assert_content(trace, main, warmup=False)
    reopened = Trace.open(tmp_path / "t", read_only=True)
    _assert_content(reopened, warm, warmup=True)
    _assert_content(reopened, main, warmup=False)
    assert zarr.open_group(tmp_path / "t", mode="r")["posterior/theta"].chunks == (3, 16, 4)


def test_appends_continue_after_reopen(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    batches = [_batch(rng, 3, n, (4,)) for n in (10, 20, 5)]
    trace = _new(tmp_path / "t", chunk_draws=8)
    trace.append(*batches[0], warmup=False)
    trace.set_checkpoint({"iteration": 10})
    trace = Trace.open(tmp_path / "t")
    trace.append(*batches[1], warmup=False)
    trace.set_checkpoint({"iteration": 30})
    trace = Trace.open(tmp_path / "t")
    trace.append(*batches[2], warmup=False)
    trace.set_checkpoint({"iteration": 35})
    reopened = Trace.open(tmp_path / "t")
    _assert_content(reopened, batches, warmup=False)
    assert reopened.checkpoint == {"iteration": 35}


def test_append_without_checkpoint_persists(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    batches = [_batch(rng, 3, n, (4,)) for n in (6, 9)]
    trace = _new(tmp_path / "t")
    for batch in batches:
        trace.append(*batch, warmup=False)
    _assert_content(Trace.open(tmp_path / "t"), batches, warmup=False)


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------


def _advance(gen: np.random.Generator) -> None:
    gen.standard_normal(17)
    gen.random(3)  # leaves a buffered uint32 / odd state for some bit generators
    gen.integers(0, 2**40, 5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.random.default_rng(1),
        lambda: np.random.default_rng(np.random.SeedSequence(2024).spawn(4)[3]),
        lambda: np.random.Generator(np.random.PCG64(np.random.SeedSequence(7, spawn_key=(2, 5)))),
        lambda: np.random.Generator(np.random.PCG64DXSM(3)),
        lambda: np.random.Generator(np.random.MT19937(4)),
        lambda: np.random.Generator(np.random.Philox(5)),
        lambda: np.random.Generator(np.random.SFC64(6)),
    ],
    ids=["default_rng", "spawned", "spawn_key", "pcg64dxsm", "mt19937", "philox", "sfc64"],
)
def test_bit_generator_state_round_trip(tmp_path: Path, make) -> None:
    gen = make()
    _advance(gen)
    state = gen.bit_generator.state
    trace = _new(tmp_path / "t")
    trace.set_checkpoint({"rng": state, "chain_rngs": [state, state]})
    expected = gen.standard_normal(50), gen.integers(0, 2**63, 20), gen.random(7)

    restored_state = Trace.open(tmp_path / "t").checkpoint["rng"]
    fresh = np.random.Generator(type(gen.bit_generator)())
    fresh.bit_generator.state = restored_state
    got = fresh.standard_normal(50), fresh.integers(0, 2**63, 20), fresh.random(7)
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)
    # The restored state equals the original, element for element.
    assert json.dumps(_plain(restored_state)) == json.dumps(_plain(state))


def _plain(value):
    """Make a bit-generator state comparable as JSON (arrays to lists)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return [value.dtype.str, value.tolist()]
    return value


def test_seed_sequence_can_be_rebuilt_from_checkpoint(tmp_path: Path) -> None:
    root = np.random.SeedSequence()  # 128-bit OS entropy: a big int
    child = root.spawn(3)[1]
    grandchild_before = child.spawn(2)[1]
    trace = _new(tmp_path / "t")
    trace.set_checkpoint(
        {
            "entropy": child.entropy,
            "spawn_key": child.spawn_key,
            "n_children_spawned": child.n_children_spawned,
        }
    )
    ck = Trace.open(tmp_path / "t").checkpoint
    rebuilt = np.random.SeedSequence(
        ck["entropy"], spawn_key=tuple(ck["spawn_key"]), n_children_spawned=0
    )
    np.testing.assert_array_equal(rebuilt.generate_state(4), child.generate_state(4))
    np.testing.assert_array_equal(
        rebuilt.spawn(2)[1].generate_state(4), grandchild_before.generate_state(4)
    )
    assert ck["n_children_spawned"] == 2


def test_checkpoint_values_round_trip_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    state = {
        "iteration": 1234,
        "positions": rng.standard_normal((3, 4)),
        "positions32": rng.standard_normal(5).astype(np.float32),
        "step_sizes": [0.1, 1 / 3, 2.0**-1074, 1.7976931348623157e308],
        "special": [float("nan"), float("inf"), float("-inf"), -0.0],
        "big": [2**53, 2**53 + 1, -(2**64) - 3, 2**200],
        "u64": np.array([0, 2**63, 2**64 - 1], dtype=np.uint64),
        "flags": np.array([True, False]),
        "numpy_scalars": [np.int64(-5), np.float64(0.25), np.bool_(True)],
        "nested": {"a": (1, (2, 3)), "b": None, "c": "text", "d": True},
        "empty": np.zeros((0, 3)),
    }
    trace = _new(tmp_path / "t")
    trace.set_checkpoint(state)
    got = Trace.open(tmp_path / "t").checkpoint
    assert got["iteration"] == 1234
    for key in ("positions", "positions32", "u64", "flags", "empty"):
        assert got[key].dtype == state[key].dtype and got[key].shape == state[key].shape
        np.testing.assert_array_equal(got[key], state[key])
    assert got["step_sizes"] == state["step_sizes"]
    assert np.isnan(got["special"][0]) and got["special"][1:3] == [np.inf, -np.inf]
    assert str(got["special"][3]) == "-0.0"
    assert got["big"] == state["big"] and all(type(v) is int for v in got["big"])
    assert got["numpy_scalars"] == [-5, 0.25, True]
    assert got["nested"] == {"a": [1, [2, 3]], "b": None, "c": "text", "d": True}
    # The stored attributes are strict JSON (no NaN literals, no ints beyond 2**53).
    text = (tmp_path / "t" / "zarr.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    record = json.loads(text)["attributes"]["flymc_trace"]
    assert record["checkpoint"]["n_draws"] == 0


@pytest.mark.parametrize(
    ("state", "error"),
    [
        ({"x": object()}, TypeError),
        ({1: 2}, TypeError),
        ({"x": {3: 4}}, TypeError),
        ({"x": np.array([1 + 2j])}, TypeError),
        ({"x": np.array(["a"])}, TypeError),
        ({"x": {"__flymc_type__": "int", "value": "1"}}, ValueError),
        ([1, 2], TypeError),
    ],
)
def test_bad_checkpoint_state_writes_nothing(tmp_path: Path, state, error) -> None:
    trace = _new(tmp_path / "t")
    trace.set_checkpoint({"iteration": 1})
    with pytest.raises(error):
        trace.set_checkpoint(state)
    assert trace.checkpoint == {"iteration": 1}
    assert Trace.open(tmp_path / "t").checkpoint == {"iteration": 1}


# --------------------------------------------------------------------------------------------
# creation and opening: refusals and validation
# --------------------------------------------------------------------------------------------


def test_overwrite_refusal_and_overwrite(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    trace = _new(tmp_path / "t")
    trace.append(*_batch(rng, 3, 5, (4,)), warmup=False)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        _new(tmp_path / "t")
    assert Trace.open(tmp_path / "t").n_draws == 5  # untouched
    fresh = _new(tmp_path / "t", chains=2, param_shape=(7,), overwrite=True)
    assert fresh.n_draws == 0 and fresh.samples.shape == (2, 0, 7)
    reopened = Trace.open(tmp_path / "t")
    assert reopened.n_draws == 0 and reopened.param_shape == (7,)


def test_never_deletes_what_is_not_a_trace(tmp_path: Path) -> None:
    precious = tmp_path / "data"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match="not a flymc trace"):
            _new(precious, overwrite=overwrite)
    assert (precious / "thesis.tex").read_text() == "years of work"
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(FileExistsError):
        _new(a_file, overwrite=True)
    zarr.create_group(tmp_path / "other_group", attributes={"foo": 1})
    with pytest.raises(FileExistsError):
        _new(tmp_path / "other_group", overwrite=True)
    assert zarr.open_group(tmp_path / "other_group", mode="r").attrs["foo"] == 1


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_create_failing_after_its_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A create failing while it writes the arrays removes the directory it made; on a URL
    it leaves its group first written, with the format marker: a trace, which only
    overwrite=True replaces (every node of it)."""
    path = tmp_path / "t" if where == "local" else f"memory://flymc-failing/{tmp_path.name}"
    real, calls = trace_module._write_node, {"n": 0}

    def failing(*args: object) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("no space left")
        real(*args)

    monkeypatch.setattr(trace_module, "_write_node", failing)
    with pytest.raises(OSError, match="no space left"):
        _new(path)
    monkeypatch.setattr(trace_module, "_write_node", real)
    if where == "local":
        assert not (tmp_path / "t").exists()
        return
    assert probe(path) == "trace"
    with pytest.raises(FileExistsError, match="overwrite=True"):
        _new(path)
    _new(path, overwrite=True).append(*_batch(np.random.default_rng(3), 3, 2, (4,)), warmup=True)
    assert Trace.open(path).n_warmup_draws == 2


def test_empty_directory_is_usable(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert _new(tmp_path / "empty").n_draws == 0
    assert Trace.open(str(tmp_path / "empty")).chains == 3


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"chains": 0}, ValueError),
        ({"chains": 2.0}, ValueError),
        ({"chains": True}, ValueError),
        ({"param_shape": (0,)}, ValueError),
        ({"param_shape": (-1, 2)}, ValueError),
        ({"param_shape": 3}, ValueError),
        ({"param_shape": (2.5,)}, ValueError),
        ({"stats": {"bad name": float}}, ValueError),
        ({"stats": {"__x": float}}, ValueError),
        ({"stats": {"s": "U3"}}, ValueError),
        ({"stats": {"s": complex}}, ValueError),
        ({"stats": {"s": "not-a-dtype"}}, ValueError),
        ({"stats": ["accepted"]}, TypeError),
        ({"attrs": {"flymc_trace": 1}}, ValueError),
        ({"attrs": {"x": object()}}, TypeError),
        ({"attrs": [1]}, TypeError),
        ({"chunk_draws": 0}, ValueError),
        ({"overwrite": "yes"}, TypeError),
    ],
)
def test_create_validates_before_writing(tmp_path: Path, kwargs: dict, error: type) -> None:
    args = {"chains": 2, "param_shape": (3,), "stats": STATS, "attrs": {}}
    args.update(kwargs)
    with pytest.raises(error):
        Trace.create(tmp_path / "t", **args)
    assert not (tmp_path / "t").exists()


def test_open_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Trace.open(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x").write_text("x")
    with pytest.raises(ValueError, match="not a flymc trace"):
        Trace.open(tmp_path / "plain")
    zarr.create_group(tmp_path / "group")
    with pytest.raises(ValueError, match="not a flymc trace"):
        Trace.open(tmp_path / "group")
    zarr.create_array(tmp_path / "array", shape=(3,), dtype="f8")
    with pytest.raises(ValueError, match="not a flymc trace"):
        Trace.open(tmp_path / "array")


def test_read_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(10)
    _new(tmp_path / "t").append(*_batch(rng, 3, 4, (4,)), warmup=False)
    trace = Trace.open(tmp_path / "t", read_only=True)
    assert trace.read_only and trace.n_draws == 4
    with pytest.raises(PermissionError):
        trace.append(*_batch(rng, 3, 4, (4,)), warmup=False)
    with pytest.raises(PermissionError):
        trace.set_checkpoint({})


def test_append_validation(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    trace = _new(tmp_path / "t")
    samples, stats = _batch(rng, 3, 4, (4,))
    bad_calls = [
        (ValueError, samples[:2], stats),
        (ValueError, samples[..., :3], stats),
        (ValueError, samples[:, :, :, None], stats),
        (ValueError, samples, {k: v for k, v in stats.items() if k != "accepted"}),
        (ValueError, samples, {**stats, "extra": np.zeros((3, 4))}),
        (ValueError, samples, {**stats, "n_bright": np.zeros((3, 5), int)}),
        (TypeError, samples, {**stats, "n_bright": np.zeros((3, 4))}),  # float into int
        (TypeError, samples.astype(complex), stats),
        (TypeError, samples, [1, 2]),
    ]
    for error, s, st in bad_calls:
        with pytest.raises(error):
            trace.append(s, st, warmup=False)
    with pytest.raises(TypeError):
        trace.append(samples, stats, warmup="no")  # type: ignore[arg-type]
    assert trace.n_draws == 0 and Trace.open(tmp_path / "t").n_draws == 0
    trace.append(samples[:, :0], {k: v[:, :0] for k, v in stats.items()}, warmup=False)
    assert trace.n_draws == 0


# --------------------------------------------------------------------------------------------
# crash consistency
# --------------------------------------------------------------------------------------------


class _Crash(RuntimeError):
    """A simulated process death."""


def test_draws_after_last_checkpoint_are_ignored_on_open(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    good = [_batch(rng, 3, 9, (4,))]
    trace = _new(tmp_path / "t", chunk_draws=4)
    trace.append(*good[0], warmup=False)
    trace.set_checkpoint({"iteration": 9})
    # A crash between append and set_checkpoint: the draws are written, the checkpoint is not.
    trace.append(*_batch(rng, 3, 6, (4,)), warmup=False)
    assert trace.n_draws == 15
    assert zarr.open_group(tmp_path / "t", mode="r")["posterior/theta"].shape[1] == 15

    resumed = Trace.open(tmp_path / "t")
    assert resumed.checkpoint == {"iteration": 9}
    _assert_content(resumed, good, warmup=False)
    # Resuming regenerates the discarded draws; they overwrite the stale ones.
    more = _batch(rng, 3, 2, (4,))
    resumed.append(*more, warmup=False)
    resumed.set_checkpoint({"iteration": 11})
    final = Trace.open(tmp_path / "t")
    _assert_content(final, [*good, more], warmup=False)
    assert zarr.open_group(tmp_path / "t", mode="r")["posterior/theta"].shape[1] == 11


def test_crash_before_commit_keeps_previous_count(tmp_path: Path, monkeypatch) -> None:
    rng = np.random.default_rng(13)
    good = [_batch(rng, 3, 5, (4,))]
    trace = _new(tmp_path / "t")
    trace.append(*good[0], warmup=False)  # no checkpoint: committed counts rule

    def crash(self, record) -> None:
        raise _Crash

    monkeypatch.setattr(Trace, "_write_record", crash)
    with pytest.raises(_Crash):
        trace.append(*_batch(rng, 3, 7, (4,)), warmup=False)
    monkeypatch.undo()
    group = zarr.open_group(tmp_path / "t", mode="r")
    assert group["posterior/theta"].shape[1] == 12  # data written
    _assert_content(Trace.open(tmp_path / "t"), good, warmup=False)  # but not committed


def test_crash_between_arrays_of_one_append(tmp_path: Path, monkeypatch) -> None:
    """Every array resized, samples and one stat written, the other stat not yet: the
    partly written draws are all ignored."""
    rng = np.random.default_rng(14)
    good = [_batch(rng, 3, 5, (4,))]
    trace = _new(tmp_path / "t")
    trace.append(*good[0], warmup=True)
    trace.set_checkpoint({"phase": "warmup"})
    original = zarr.Array.__setitem__
    calls = {"n": 0}

    def flaky(self, key, value) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Crash
        original(self, key, value)

    monkeypatch.setattr(zarr.Array, "__setitem__", flaky)
    with pytest.raises(_Crash):
        trace.append(*_batch(rng, 3, 4, (4,)), warmup=True)
    monkeypatch.undo()
    lengths = {
        key: zarr.open_group(tmp_path / "t", mode="r")[key].shape[1]
        for key in (
            "warmup_posterior/theta",
            "warmup_sample_stats/accepted",
            "warmup_sample_stats/log_joint",
        )
    }
    # resized together before any data is written (a reader meets unequal lengths only
    # during that burst of metadata writes)
    assert set(lengths.values()) == {9}
    reopened = Trace.open(tmp_path / "t")
    _assert_content(reopened, good, warmup=True)
    assert reopened.n_draws == 0 and reopened.checkpoint == {"phase": "warmup"}


def test_set_checkpoint_records_the_draws_it_refers_to(tmp_path: Path) -> None:
    rng = np.random.default_rng(15)
    trace = _new(tmp_path / "t")
    trace.append(*_batch(rng, 3, 3, (4,)), warmup=True)
    trace.append(*_batch(rng, 3, 8, (4,)), warmup=False)
    trace.set_checkpoint({"iteration": 11})
    record = zarr.open_group(tmp_path / "t", mode="r").attrs["flymc_trace"]
    assert record["checkpoint"]["n_warmup_draws"] == 3
    assert record["checkpoint"]["n_draws"] == 8


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_checkpoints_large_arrays_are_zarr_arrays_not_json(tmp_path: Path, where: str) -> None:
    """An array of a checkpoint beyond the inline size is stored as a zarr array (the
    record stays small), read back exactly, replaced by the next checkpoint's (no array
    of an earlier checkpoint is left), and one missing from the store is refused."""
    path = tmp_path / "t" if where == "local" else f"memory://flymc-ck/{tmp_path.name}"
    rng = np.random.default_rng(18)
    trace = _new(path)
    trace.append(*_batch(rng, 3, 4, (4,)), warmup=False)
    big = rng.integers(0, 9, (3, 10_000), dtype=np.int64)
    trace.set_checkpoint({"chains": [{"labels": big, "small": np.arange(3)}], "iteration": 4})
    record = zarr.open_group(path, mode="r").attrs["flymc_trace"]
    assert len(json.dumps(record)) < 4_000
    got = Trace.open(path, read_only=True).checkpoint
    np.testing.assert_array_equal(got["chains"][0]["labels"], big)
    assert got["chains"][0]["labels"].dtype == np.int64
    np.testing.assert_array_equal(got["chains"][0]["small"], np.arange(3))
    trace.set_checkpoint({"chains": [{"labels": big[::-1].copy()}], "iteration": 5})
    group = zarr.open_group(path, mode="r+")
    assert len(list(group["checkpoint"].array_keys())) == 1
    np.testing.assert_array_equal(Trace.open(path).checkpoint["chains"][0]["labels"], big[::-1])
    del group[f"checkpoint/{next(iter(group['checkpoint'].array_keys()))}"]
    with pytest.raises(TraceDamagedError, match="checkpoint's array"):
        Trace.open(path).checkpoint  # noqa: B018
    trace.set_checkpoint({"iteration": 6})
    assert not list(zarr.open_group(path, mode="r")["checkpoint"].array_keys())


def test_truncated_arrays_are_reported_as_corrupt(tmp_path: Path) -> None:
    rng = np.random.default_rng(16)
    trace = _new(tmp_path / "t")
    trace.append(*_batch(rng, 3, 6, (4,)), warmup=False)
    trace.set_checkpoint({"iteration": 6})
    zarr.open_group(tmp_path / "t", mode="r+")["sample_stats/n_bright"].resize((3, 4))
    with pytest.raises(ValueError, match="corrupt"):
        Trace.open(tmp_path / "t")


def test_missing_array_is_reported_as_corrupt(tmp_path: Path) -> None:
    _new(tmp_path / "t")
    group = zarr.open_group(tmp_path / "t", mode="r+")
    del group["warmup_sample_stats/log_joint"]
    with pytest.raises(ValueError, match="corrupt"):
        Trace.open(tmp_path / "t")


def test_unsupported_version_is_refused(tmp_path: Path) -> None:
    _new(tmp_path / "t")
    group = zarr.open_group(tmp_path / "t", mode="r+")
    record = dict(group.attrs["flymc_trace"])
    group.update_attributes({"flymc_trace": {**record, "version": 99}})
    with pytest.raises(ValueError, match="version"):
        Trace.open(tmp_path / "t")


def test_fsspec_url(request: pytest.FixtureRequest) -> None:
    url = f"memory://flymc-trace-test/{request.node.name}"
    rng = np.random.default_rng(17)
    batch = _batch(rng, 3, 5, (4,))
    trace = _new(url)  # type: ignore[arg-type]
    trace.append(*batch, warmup=False)
    trace.set_checkpoint({"iteration": 5})
    with pytest.raises(FileExistsError):
        _new(url)  # type: ignore[arg-type]
    reopened = Trace.open(url)
    _assert_content(reopened, [batch], warmup=False)
    assert reopened.checkpoint == {"iteration": 5}
    with pytest.raises(FileNotFoundError):
        Trace.open(url + "-missing")


# --------------------------------------------------------------------------------------------
# one writer at a time
# --------------------------------------------------------------------------------------------


def _holder(path: Path) -> subprocess.Popen:
    """Another process that takes the lock of ``path`` and holds it until killed."""
    code = (
        "import sys, time; from flymc_dist.trace import TraceLock; "
        "lock = TraceLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_lock_one_holder_across_processes_and_a_dead_holder_is_broken(tmp_path: Path) -> None:
    path = tmp_path / "t.zarr"
    proc = _holder(path)
    try:
        with pytest.raises(
            TraceLockedError,
            match=rf"being written by another run \(pid {proc.pid} on .*"
            r"remove .*\.t\.zarr\.flymc-lock",
        ):
            TraceLock(path).acquire()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    lock = TraceLock(path).acquire()  # its holder died: the stale lock is broken
    assert lock.held and os.path.exists(lock.path)
    with pytest.raises(TraceLockedError):
        TraceLock(path).acquire()  # held by this live process
    lock.release()
    assert not os.path.exists(lock.path) and not path.exists()
    with TraceLock(path) as again:
        assert again.held
    assert not os.path.exists(again.path)


def test_lock_of_another_machine_is_never_presumed_dead(tmp_path: Path) -> None:
    path = tmp_path / "t.zarr"
    lock = TraceLock(path)
    holder = {"pid": 1, "host": "some-other-host", "token": "x", "since": 0.0}
    Path(lock.path).write_text(json.dumps(holder))
    with pytest.raises(TraceLockedError, match="some-other-host"):
        lock.acquire()
    assert json.loads(Path(lock.path).read_text()) == holder  # left alone
    # release never removes a lock that is not its own
    lock.release()
    assert os.path.exists(lock.path)
    os.unlink(lock.path)
    lock.acquire()
    Path(lock.path).write_text(json.dumps(holder))  # someone broke and retook it
    lock.release()
    assert json.loads(Path(lock.path).read_text()) == holder


def test_lock_makes_no_directories_it_leaves(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "t.zarr"
    with TraceLock(path):
        assert (tmp_path / "a" / "b").is_dir()
    assert not (tmp_path / "a").exists()


def test_dimension_names_and_coordinates(tmp_path: Path) -> None:
    """Every array names its dimensions (zarr 3 ``dimension_names``, what xarray reads);
    the coordinates are arrays of their own; bad ``dims`` / ``coords`` write nothing."""
    _new(tmp_path / "t", param_shape=(2, 4), dims=("class", "feature"),
         coords={"feature": ["a", "b", "c", "d"]})  # fmt: skip
    group = zarr.open_group(tmp_path / "t", mode="r")
    assert group["posterior/theta"].metadata.dimension_names == (
        "chain",
        "draw",
        "class",
        "feature",
    )
    assert group["warmup_posterior/theta"].metadata.dimension_names[:2] == ("chain", "draw")
    assert group["sample_stats/accepted"].metadata.dimension_names == ("chain", "draw")
    assert group["warmup_sample_stats/accepted"].metadata.dimension_names == ("chain", "draw")
    assert list(group["posterior/feature"][:]) == ["a", "b", "c", "d"]
    assert list(group["posterior/class"][:]) == [0, 1]
    assert list(group["sample_stats/chain"][:]) == [0, 1, 2]
    # the defaults name every axis
    _new(tmp_path / "u")
    dims = zarr.open_group(tmp_path / "u", mode="r")["posterior/theta"].metadata.dimension_names
    assert dims == ("chain", "draw", "theta_dim_0")
    for dims, coords, match in (
        (("feature",), None, "dims must be 2 distinct"),
        (("x", "x"), None, "dims must be 2 distinct"),
        (("chain", "x"), None, "dims must be 2 distinct"),
        (("k", "f"), {"g": [0, 1]}, "coords for unknown dims"),
        (("k", "f"), {"f": ["a", "b"]}, r"coords\['f'\] must be 4 labels"),
        (("k", "f"), {"f": ["a", 1, "c", "d"]}, "all str or all int"),
    ):
        with pytest.raises(ValueError, match=match):
            _new(tmp_path / "bad", param_shape=(2, 4), dims=dims, coords=coords)
        assert not (tmp_path / "bad").exists()


def test_traces_of_an_earlier_release_are_refused_in_one_line(tmp_path: Path) -> None:
    """A trace of format version 1 (arrays at the root: ``samples``, ``stats/<name>``…),
    or of format 2 written before every chunk was stored, is refused saying so; a new
    trace is written in format 2, every chunk stored."""
    rng = np.random.default_rng(21)
    samples, stats = _batch(rng, 3, 6, (4,))
    record = {
        "format": "flymc_dist.trace",
        "version": 1,
        "chains": 3,
        "param_shape": [4],
        "stats": {k: np.dtype(v).str for k, v in STATS.items()},
        "chunk_draws": 16,
        "committed": {"n_draws": 6, "n_warmup_draws": 0},
        "checkpoint": None,
    }
    group = zarr.create_group(tmp_path / "old", attributes={"seed": 0, "flymc_trace": record})
    group.create_array("samples", data=samples, chunks=(3, 16, 4))
    with pytest.raises(ValueError, match=r"earlier flymc_dist release \(format 1, chunks of"):
        Trace.open(tmp_path / "old", read_only=True)
    _new(tmp_path / "new")
    record = zarr.open_group(tmp_path / "new", mode="r").attrs["flymc_trace"]
    assert record["version"] == 2 and record["every_chunk"] is True
    Trace.open(tmp_path / "new", read_only=True)
    del record["every_chunk"]
    zarr.open_group(tmp_path / "new", mode="r+").update_attributes({"flymc_trace": record})
    with pytest.raises(ValueError, match=r"\(format 2, chunks of zeros omitted\); this release"):
        Trace.open(tmp_path / "new", read_only=True)
    # a stat cannot take a dimension's name
    with pytest.raises(ValueError, match="'chain' cannot name a stat"):
        Trace.create(tmp_path / "bad", chains=2, param_shape=(2,), stats={"chain": int}, attrs={})


# --------------------------------------------------------------------------------------------
# a missing chunk is a loss (#28 item 6)
# --------------------------------------------------------------------------------------------


def _zeros_and_draws(tmp_path: Path) -> tuple[Trace, tuple]:
    """A trace of 10 draws in chunks of 4, whose statistics are all zero (the fill value)."""
    rng = np.random.default_rng(30)
    samples, stats = _batch(rng, 3, 10, (4,))
    stats = {k: np.zeros_like(v) for k, v in stats.items()}
    trace = _new(tmp_path / "t", chunk_draws=4)
    trace.append(samples, stats, warmup=False)
    trace.set_checkpoint({"iteration": 9})
    return trace, (samples, stats)


def test_every_chunk_is_written_even_all_zero(tmp_path: Path) -> None:
    """zarr omits chunks equal to the fill value unless told not to: a trace writes them
    (statistics of zeros, the chain coordinate [0]), also after it is reopened."""
    trace, (samples, stats) = _zeros_and_draws(tmp_path)
    for name in STATS:
        assert sorted(os.listdir(tmp_path / "t" / "sample_stats" / name / "c" / "0")) == [
            "0",
            "1",
            "2",
        ]
    reopened = Trace.open(tmp_path / "t")
    reopened.append(samples[:, :4], {k: v[:, :4] for k, v in stats.items()}, warmup=False)
    assert (tmp_path / "t" / "sample_stats" / "accepted" / "c" / "0" / "3").exists()
    one = Trace.create(tmp_path / "one", chains=1, param_shape=(2,), stats=STATS, attrs={})
    assert (tmp_path / "one" / "posterior" / "chain" / "c" / "0").exists()
    one.verify()


@pytest.mark.parametrize(
    "chunk, match",
    [
        ("sample_stats/accepted/c/0/1", r"draws 4-7 of sample_stats/accepted"),
        ("posterior/theta/c/0/2/0", r"draws 8-9 of posterior/theta"),
        ("posterior/theta_dim_0/c/0", r"the coordinate posterior/theta_dim_0"),
    ],
)
def test_a_missing_chunk_is_refused_naming_it(tmp_path: Path, chunk: str, match: str) -> None:
    """A chunk gone from a trace (a partial copy) is never read as fill values (NaN draws,
    zero statistics): reading it, appending over it and verify() raise, naming it."""
    trace, _ = _zeros_and_draws(tmp_path)
    trace.verify()
    os.remove(tmp_path / "t" / chunk)
    damaged = Trace.open(tmp_path / "t", read_only=True)
    with pytest.raises(TraceDamagedError, match=f"chunk '{chunk}' \\({match}\\) is missing"):
        damaged.verify()
    if chunk.startswith("posterior/theta/"):
        with pytest.raises(TraceDamagedError, match=match):
            np.asarray(damaged.samples)
        with pytest.raises(TraceDamagedError, match=match):  # appending rewrites that chunk
            Trace.open(tmp_path / "t").append(
                *_batch(np.random.default_rng(0), 3, 1, (4,)), warmup=False
            )
    elif "accepted" in chunk:
        with pytest.raises(TraceDamagedError, match=match):
            dict(damaged.stats)
        assert damaged.samples.shape == (3, 10, 4)  # the others read
    with pytest.raises(TraceDamagedError) as info:
        damaged.verify()
    assert "\n" not in str(info.value)


def test_chunks_past_the_recorded_draws_may_be_absent(tmp_path: Path) -> None:
    """Only chunks holding recorded draws must exist: draws past the checkpoint (a crash
    before it) and the other phase's empty arrays are no loss."""
    trace, (samples, stats) = _zeros_and_draws(tmp_path)
    trace.append(samples, stats, warmup=False)  # 20 draws, 10 of them past the checkpoint
    os.remove(tmp_path / "t" / "sample_stats" / "accepted" / "c" / "0" / "4")
    reopened = Trace.open(tmp_path / "t")
    assert reopened.n_draws == 10
    reopened.verify()
    reopened.append(samples, stats, warmup=False)
    reopened.set_checkpoint({"iteration": 19})
    assert Trace.open(tmp_path / "t").n_draws == 20


def test_lock_through_a_symbolic_link_protects_the_real_path(tmp_path: Path) -> None:
    """A run given a symbolic link to a trace (or to a directory above it) takes the lock
    of the real path: a second run given the real path is refused, and the other way."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")
    os.symlink(tmp_path / "real" / "t.zarr", tmp_path / "link.zarr")
    _new(tmp_path / "real" / "t.zarr")
    for first, second in (
        (tmp_path / "link.zarr", tmp_path / "real" / "t.zarr"),
        (tmp_path / "real" / "t.zarr", tmp_path / "alias" / "t.zarr"),
    ):
        with TraceLock(first):
            with pytest.raises(TraceLockedError, match="being written by another run"):
                TraceLock(second).acquire()
        TraceLock(second).acquire().release()  # free again
