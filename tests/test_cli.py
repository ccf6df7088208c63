"""The ``flymc`` command line, end to end on small stores.

Most tests call :func:`flymc_dist.cli.main` in-process (``--synchronous`` where a run is
involved); a few run the real entry point in a subprocess, and the ones that start a
LocalCluster are marked ``cluster``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from flymc_dist.cli import main
from flymc_dist.data import from_numpy, open_dataset
from flymc_dist.options import READ_AHEAD
from flymc_dist.trace import Trace

ROWS = 2000
FEATURES = 4


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``main(args)`` with its exit status, stdout and stderr."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m flymc_dist.cli args`` in a fresh process (as a user would run it)."""
    env = {**os.environ, "CI": "1"}
    return subprocess.run(
        [sys.executable, "-m", "flymc_dist.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def assert_usage_error(code: int, err: str, *needles: str) -> None:
    """Exit status 2 and exactly one line ``flymc: error: …`` on stderr, no traceback."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("flymc: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]


def assert_nothing_written(path: Path) -> None:
    """``path`` does not exist and no temporary sibling was left behind."""
    assert not path.exists()
    leftovers = [
        p.name
        for p in path.parent.iterdir()
        if p.name == path.name or p.name.startswith(f".{path.name}.")
    ]
    assert leftovers == [], leftovers


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small logistic store made by ``flymc make-data``."""
    path = tmp_path_factory.mktemp("cli") / "logistic.zarr"
    assert (
        main(
            [
                "make-data",
                str(path),
                "--like",
                "logistic",
                "--rows",
                str(ROWS),
                "--features",
                str(FEATURES),
                "--seed",
                "1",
                "--chunk-rows",
                "500",
            ]
        )
        == 0
    )
    return path


def run_args(store: Path, trace: Path, *extra: str) -> list[str]:
    """A quick synchronous ``flymc run`` of the logistic model."""
    return [
        "run",
        str(store),
        "--model",
        "logistic",
        "--synchronous",
        "--warmup",
        "20",
        "--samples",
        "40",
        "--chains",
        "2",
        "--no-progress",
        "--trace",
        str(trace),
        *extra,
    ]


# --------------------------------------------------------------------------- make-data


@pytest.mark.parametrize(
    ("like", "extra", "task"),
    [
        ("logistic", [], "binary"),
        ("softmax", ["--classes", "3"], "multiclass"),
        ("robust", ["--nu", "5"], "real"),
        ("opv", [], "real"),
    ],
)
def test_make_data_every_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], like: str, extra: list[str], task: str
) -> None:
    out = tmp_path / f"{like}.zarr"
    code, stdout, err = run_cli(
        ["make-data", out, "--like", like, "--rows", 300, "--features", 5, *extra], capsys
    )
    assert code == 0, err
    ds = open_dataset(out)
    assert ds.shape == (300, 5)
    assert ds.task == task
    assert "300 rows" in stdout


def test_make_data_bad_options_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "d.zarr"
    cases = [
        (["--like", "softmax", "--rows", 100, "--features", 3], "--classes"),
        (["--like", "logistic", "--features", 3], "--rows"),
        (["--like", "logistic", "--rows", 0, "--features", 3], "positive integer"),
        (["--like", "nonsense", "--rows", 10, "--features", 3], "invalid choice"),
        (["--like", "logistic", "--rows", 10, "--features", 3, "--classes", 2], "softmax"),
    ]
    for args, needle in cases:
        code, _, err = run_cli(["make-data", out, *args], capsys)
        assert_usage_error(code, err, needle)
        assert_nothing_written(out)


def test_make_data_refuses_to_overwrite(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["make-data", store, "--rows", 10, "--features", 2], capsys)
    assert_usage_error(code, err, "exists")
    assert open_dataset(store).shape == (ROWS, FEATURES)


# --------------------------------------------------------------------------- ingest


def _xy(n: int = 200, d: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.column_stack([np.ones(n), rng.standard_normal((n, d - 1))])
    y = (rng.random(n) < 0.5).astype(np.int64)
    return X, y


def test_ingest_npy_npz_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    X, y = _xy()
    np.save(tmp_path / "a.npy", np.column_stack([y, X]))  # target first
    np.savez(tmp_path / "b.npz", X=X, y=y)
    with open(tmp_path / "c.csv", "w") as fh:
        fh.write("bias,u,v,label\n")
        for xi, yi in zip(X, y, strict=True):
            fh.write(",".join(repr(float(v)) for v in xi) + f",{yi}\n")
    for src, extra in (
        ("a.npy", ["--target", "0"]),
        ("b.npz", []),
        ("c.csv", ["--target", "label"]),
    ):
        out = tmp_path / (src + ".zarr")
        code, stdout, err = run_cli(["ingest", tmp_path / src, out, *extra], capsys)
        assert code == 0, err
        ds = open_dataset(out)
        Xr, yr = ds.read()
        np.testing.assert_array_equal(Xr, X)
        np.testing.assert_array_equal(yr, y)
        assert ds.task == "binary"
        assert "200 rows" in stdout
    assert open_dataset(tmp_path / "c.csv.zarr").feature_names == ["bias", "u", "v"]


def test_ingest_bad_input_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    X, y = _xy()
    Xn = X.copy()
    Xn[17, 1] = np.nan
    np.savez(tmp_path / "nan.npz", X=Xn, y=y)
    with open(tmp_path / "nan.csv", "w") as fh:
        fh.write("a,b,y\n1.0,2.0,1\n3.0,nan,0\n")
    np.savez(tmp_path / "labels.npz", X=X, y=y + 5.5)
    out = tmp_path / "out.zarr"
    cases = [
        (tmp_path / "missing.npy", [], "not found"),
        (tmp_path / "nan.npz", [], "non-finite"),
        (tmp_path / "nan.csv", [], "non-finite"),
        (tmp_path / "nan.npz", ["--task", "binary"], "non-finite"),
        (tmp_path / "labels.npz", ["--task", "binary"], "integer"),
        (tmp_path / "nan.npz", ["--task", "nonsense"], "invalid choice"),
    ]
    for src, extra, needle in cases:
        code, _, err = run_cli(["ingest", src, out, *extra], capsys)
        assert_usage_error(code, err, needle)
        assert_nothing_written(out)


@pytest.mark.slow
def test_error_in_a_real_process_is_one_line(tmp_path: Path) -> None:
    """The installed entry point: status 2, one line on stderr, no traceback."""
    proc = run_subprocess(["ingest", tmp_path / "nope.csv", tmp_path / "out.zarr"])
    assert_usage_error(proc.returncode, proc.stderr, "not found")
    assert proc.stdout == ""
    assert_nothing_written(tmp_path / "out.zarr")


# --------------------------------------------------------------------------- run, summary, resume


def test_run_then_summary(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.zarr"
    code, out, err = run_cli(run_args(store, trace), capsys)
    assert code == 0, err
    t = Trace.open(trace, read_only=True)
    assert t.samples.shape == (2, 40, FEATURES)
    assert t.warmup_samples.shape == (2, 20, FEATURES)
    assert set(t.stats) >= {"accepted", "n_bright", "likelihood_queries", "lp", "acceptance_rate"}
    assert "ess_bulk" in out and "r_hat" in out and "theta[x1]" in out  # names from the store
    assert "likelihood queries" in out
    assert "narrower than the posterior" in out  # MAP-tuned FlyMC's forecast of its mixing
    code, out2, err = run_cli(["summary", trace], capsys)
    assert code == 0, err
    assert "flymc" in out2 and "ess_bulk" in out2 and "bright fraction" in out2
    forecast = [x for x in out.splitlines() if "narrower than the posterior" in x]
    assert forecast and forecast[0] in out2  # the same line, from the trace's attributes
    # wall time is kept with the checkpoint: seconds per iteration and ESS per second
    secs = t.checkpoint["seconds"]
    assert secs["warmup"] > 0 and secs["sampling"] > 0
    line = next(x for x in out2.splitlines() if x.startswith("seconds per iteration"))
    assert float(line.split()[-1]) == pytest.approx(secs["sampling"] / 40, rel=1e-3)
    assert "ESS per second" in out2
    # the table printed by summary is the one printed by run
    table = [line for line in out.splitlines() if line.startswith("theta[x1] ")]
    assert table and table[0] in out2


@pytest.mark.parametrize(
    ("algorithm", "extra"),
    [
        ("regular", []),
        ("flymc", ["--kernel", "mala", "--z-update", "explicit", "--bounds", "untuned"]),
        ("austerity", ["--eps", "0.1", "--batch-size", "200"]),
        ("austerity", ["--no-control-variates"]),
    ],
)
def test_run_algorithms(
    store: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    algorithm: str,
    extra: list[str],
) -> None:
    trace = tmp_path / f"{algorithm}.zarr"
    code, out, err = run_cli(run_args(store, trace, "--algorithm", algorithm, *extra), capsys)
    assert code == 0, err
    assert Trace.open(trace, read_only=True).n_draws == 40
    assert "narrower than the posterior" not in out  # a forecast of MAP-tuned FlyMC only
    if algorithm == "austerity":
        assert "APPROXIMATE" in out
        cv = Trace.open(trace, read_only=True).attrs["control_variates"]
        assert cv is ("--no-control-variates" not in extra)


def test_run_other_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for like, model, extra in (
        ("softmax", "softmax", ["--classes", "3"]),
        ("robust", "robust", ["--nu", "4"]),
    ):
        data = tmp_path / f"{like}.zarr"
        make = ["make-data", data, "--like", like, "--rows", 600, "--features", 3]
        assert run_cli(make + (["--classes", "3"] if like == "softmax" else []), capsys)[0] == 0
        trace = tmp_path / f"{like}-trace.zarr"
        args = [
            "run",
            data,
            "--model",
            model,
            *extra,
            "--synchronous",
            "--warmup",
            10,
            "--samples",
            10,
            "--chains",
            2,
            "--no-progress",
            "--trace",
            trace,
        ]
        code, out, err = run_cli(args, capsys)
        assert code == 0, err
        shape = (3, 3) if model == "softmax" else (3,)
        assert Trace.open(trace, read_only=True).samples.shape == (2, 10, *shape)


#: every family name ``--model`` takes, the task ``ingest --task <name>`` records for it,
#: and its targets (from η = x·(0.5, −1, 0.8))
FAMILY_DATA = {
    "logistic": "binary",
    "probit": "binary",
    "binomial": "binary",
    "negative_binomial": "count",
    "gaussian": "real",
    "student_t": "real",
    "softmax": "multiclass",
}


def _family_targets(task: str, eta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if task == "binary":
        return (rng.random(eta.size) < 1.0 / (1.0 + np.exp(-eta))).astype(np.int64)
    if task == "count":
        return rng.poisson(np.exp(eta)).astype(np.int64)
    if task == "multiclass":
        return np.digitize(eta, [-0.5, 0.5]).astype(np.int64)
    return eta + rng.standard_normal(eta.size)


@pytest.mark.parametrize("name", list(FAMILY_DATA))
def test_family_names_through_ingest_and_run(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ingest --task <family>`` records the family's task (counts as counts, not as
    class labels) and ``run --model <family>`` samples it (softmax with the one-vs-each
    bound)."""
    rng = np.random.default_rng(7)
    X = np.column_stack([np.ones(300), rng.standard_normal((300, 2))])
    y = _family_targets(FAMILY_DATA[name], X @ np.array([0.5, -1.0, 0.8]), rng)
    np.savez(tmp_path / "d.npz", X=X, y=y)
    data, trace = tmp_path / "d.zarr", tmp_path / "t.zarr"
    code, _, err = run_cli(["ingest", tmp_path / "d.npz", data, "--task", name], capsys)
    assert code == 0, err
    assert open_dataset(data).task == FAMILY_DATA[name]
    extra = ["--bound", "one_vs_each"] if name == "softmax" else []
    args = ["run", data, "--model", name, *extra, "--synchronous", "--no-progress"]
    args += ["--warmup", 10, "--samples", 10, "--chains", 2, "--trace", trace]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    tr = Trace.open(trace, read_only=True)
    assert tr.samples.shape == (2, 10, *((3, 3) if name == "softmax" else (3,)))
    if name == "softmax":
        assert tr.attrs["model"]["bound"] == "one_vs_each"
    else:
        other = tmp_path / "t2.zarr"
        args = ["run", data, "--model", name, "--bound", "one_vs_each", "--synchronous"]
        code, _, err = run_cli([*args, "--trace", other], capsys)
        assert_usage_error(code, err, "--bound applies only to --model softmax")
        assert_nothing_written(other)


def test_resume_after_interrupt_continues_exactly(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C keeps the checkpointed trace; --resume finishes it with the same draws."""
    from flymc_dist.driver import Driver

    ref = tmp_path / "ref.zarr"
    extra = ["--algorithm", "regular", "--checkpoint-every", "10"]
    assert run_cli(run_args(store, ref, *extra), capsys)[0] == 0

    original = Driver.step
    calls = {"n": 0}

    def interrupted_step(self: Driver, *args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 36:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    trace = tmp_path / "t.zarr"
    monkeypatch.setattr(Driver, "step", interrupted_step)
    monkeypatch.delattr(Driver, "steps")  # every iteration through step (see _gated)
    code, _, err = run_cli(run_args(store, trace, *extra), capsys)
    monkeypatch.undo()
    assert code == 130
    assert "--resume" in err
    part = Trace.open(trace, read_only=True)
    assert part.checkpoint is not None and part.checkpoint["iteration"] == 29
    assert part.n_draws == 10
    first = part.checkpoint["seconds"]

    code, out, err = run_cli(run_args(store, trace, *extra, "--resume"), capsys)
    assert code == 0, err
    done, full = Trace.open(trace, read_only=True), Trace.open(ref, read_only=True)
    assert done.samples.shape == full.samples.shape == (2, 40, FEATURES)
    np.testing.assert_allclose(done.samples, full.samples, rtol=0, atol=1e-12)
    # the resumed segment's seconds are added to the first one's
    assert done.checkpoint["seconds"]["warmup"] == pytest.approx(first["warmup"])
    assert done.checkpoint["seconds"]["sampling"] > first["sampling"]


def test_failure_after_a_checkpoint_keeps_the_trace(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh run that fails after its first checkpoint keeps its trace and says, in one
    line, how to resume it; one that fails before any checkpoint leaves nothing behind."""
    from flymc_dist.driver import Driver

    ref = tmp_path / "ref.zarr"
    extra = ["--algorithm", "regular", "--checkpoint-every", "10"]
    assert run_cli(run_args(store, ref, *extra), capsys)[0] == 0
    original = Driver.step

    def failing_at(n: int) -> object:
        calls = {"n": 0}

        def step(self: Driver, *args: object, **kwargs: object) -> object:
            calls["n"] += 1
            if calls["n"] == n:
                raise RuntimeError("the cluster went away")
            return original(self, *args, **kwargs)

        return step

    trace = tmp_path / "t.zarr"
    monkeypatch.setattr(Driver, "step", failing_at(36))
    monkeypatch.delattr(Driver, "steps")  # every iteration through step (see _gated)
    code, _, err = run_cli(run_args(store, trace, *extra), capsys)
    assert code == 1 and "the cluster went away" in err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("flymc: error: ")
    assert "keeps 30 iterations" in lines[1] and "--resume" in lines[1]
    assert Trace.open(trace, read_only=True).checkpoint["iteration"] == 29
    monkeypatch.setattr(Driver, "step", original)
    code, _, err = run_cli(run_args(store, trace, *extra, "--resume"), capsys)
    assert code == 0, err
    np.testing.assert_allclose(
        Trace.open(trace, read_only=True).samples,
        Trace.open(ref, read_only=True).samples,
        rtol=0,
        atol=1e-12,
    )
    # no checkpoint yet: nothing to resume, nothing kept
    early = tmp_path / "early.zarr"
    monkeypatch.setattr(Driver, "step", failing_at(5))
    code, _, err = run_cli(run_args(store, early, *extra), capsys)
    assert code == 1 and "--resume" not in err
    assert_nothing_written(early)


def _gated(
    monkeypatch: pytest.MonkeyPatch, where: str, thread: str, at: int = 1
) -> tuple[threading.Event, threading.Event]:
    """Hold the run of thread ``thread`` at its ``at``-th call of ``Driver.<where>`` until
    the returned ``release`` is set; ``reached`` is set when it gets there."""
    from flymc_dist.driver import Driver

    reached, release = threading.Event(), threading.Event()
    original = getattr(Driver, where)
    calls = {"n": 0}

    def gated(self: Driver, *args: object, **kwargs: object) -> object:
        if threading.current_thread().name == thread:
            calls["n"] += 1
            if calls["n"] == at:
                reached.set()
                release.wait(120)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Driver, where, gated)
    if where == "step":
        # after warm-up the replica's iterations run a block per call of Driver.steps
        # (test_compiled_loop: the same draws): without it, every one calls step
        monkeypatch.delattr(Driver, "steps")
    return reached, release


def _in_thread(name: str, args: list, codes: dict[str, int]) -> threading.Thread:
    th = threading.Thread(
        target=lambda: codes.__setitem__(name, main([str(a) for a in args])), name=name, daemon=True
    )
    th.start()
    return th


@pytest.mark.slow
def test_two_runs_on_one_trace_one_writer(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fresh runs on one trace path at once (both pass the "already exists" check): one
    writes it, the other is refused and removes nothing, and the trace is whole."""
    ref = tmp_path / "ref.zarr"
    extra = ["--checkpoint-every", "5"]
    assert run_cli(run_args(store, ref, *extra), capsys)[0] == 0
    trace = tmp_path / "t.zarr"
    b_reached, b_release = _gated(monkeypatch, "setup", "B")  # B: before any trace exists
    a_reached, a_release = _gated(monkeypatch, "step", "A", at=32)  # A: after 6 checkpoints
    codes: dict[str, int] = {}
    tb = _in_thread("B", run_args(store, trace, *extra), codes)
    assert b_reached.wait(120)
    ta = _in_thread("A", run_args(store, trace, *extra), codes)
    t0 = time.time()
    while not (a_reached.is_set() or "A" in codes) and time.time() - t0 < 120:
        time.sleep(0.05)
    b_release.set()  # B goes on: it writes the trace, or (A holding it) fails
    tb.join(120)
    a_release.set()
    ta.join(120)
    _, err = capsys.readouterr()
    assert sorted(codes.values()) == [0, 2], (codes, err)
    done, full = Trace.open(trace, read_only=True), Trace.open(ref, read_only=True)
    assert done.n_draws == 40 and done.checkpoint["iteration"] == 59
    np.testing.assert_array_equal(done.warmup_samples, full.warmup_samples)
    np.testing.assert_array_equal(done.samples, full.samples)
    assert "being written by another run" in err, err
    assert run_cli(["summary", trace], capsys)[0] == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".t.zarr")] == []


@pytest.mark.slow
def test_a_trace_being_written_refuses_resume_and_overwrite(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a run writes a trace, a --resume or an --overwrite of it is refused at once
    (one line naming the run that holds it) and the running one completes unharmed."""
    ref = tmp_path / "ref.zarr"
    extra = ["--checkpoint-every", "5"]
    assert run_cli(run_args(store, ref, *extra), capsys)[0] == 0
    trace = tmp_path / "t.zarr"
    reached, release = _gated(monkeypatch, "step", "A", at=12)
    codes: dict[str, int] = {}
    ta = _in_thread("A", run_args(store, trace, *extra), codes)
    assert reached.wait(120)
    capsys.readouterr()
    for mode in ("--resume", "--overwrite"):
        code, _, err = run_cli(run_args(store, trace, *extra, mode), capsys)
        assert_usage_error(code, err, "being written by another run", f"pid {os.getpid()}")
        assert Trace.open(trace, read_only=True).checkpoint["iteration"] == 9
    release.set()
    ta.join(120)
    assert codes == {"A": 0}
    np.testing.assert_array_equal(
        Trace.open(trace, read_only=True).samples, Trace.open(ref, read_only=True).samples
    )


def test_resume_and_overwrite_rules(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.zarr"
    assert run_cli(run_args(store, trace), capsys)[0] == 0
    before = Trace.open(trace, read_only=True).samples.copy()
    # exists: refused without --overwrite / --resume, and left as it was
    code, _, err = run_cli(run_args(store, trace), capsys)
    assert_usage_error(code, err, "already exists")
    # resume with other settings: refused
    code, _, err = run_cli(run_args(store, trace, "--resume", "--seed", "5"), capsys)
    assert_usage_error(code, err, "seed")
    np.testing.assert_array_equal(Trace.open(trace, read_only=True).samples, before)
    # resume of a finished run: nothing to do, same draws
    code, _, err = run_cli(run_args(store, trace, "--resume"), capsys)
    assert code == 0, err
    np.testing.assert_array_equal(Trace.open(trace, read_only=True).samples, before)
    # overwrite: a new run
    code, _, err = run_cli(run_args(store, trace, "--overwrite", "--seed", "3"), capsys)
    assert code == 0, err
    assert not np.array_equal(Trace.open(trace, read_only=True).samples, before)
    # resume of nothing; overwrite of something that is not a trace
    code, _, err = run_cli(run_args(store, tmp_path / "none.zarr", "--resume"), capsys)
    assert_usage_error(code, err, "no trace")
    assert_nothing_written(tmp_path / "none.zarr")
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    code, _, err = run_cli(run_args(store, other, "--overwrite"), capsys)
    assert_usage_error(code, err, "not a flymc trace")
    assert (other / "keep.txt").read_text() == "mine"


def test_run_on_a_store_missing_a_chunk_fails_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A partial copy of a store: never a posterior from zeros read in place of a chunk."""
    data = tmp_path / "c.zarr"
    assert (
        main(["make-data", str(data), "--rows", "4000", "--features", "3", "--chunk-rows", "500"])
        == 0
    )
    for chunk in (data / "y" / "c" / "3", data / "X" / "c" / "5" / "0"):
        saved = chunk.read_bytes()
        chunk.unlink()
        trace = tmp_path / "t.zarr"
        code, _, err = run_cli(run_args(data, trace), capsys)
        name = "/".join(chunk.relative_to(data).parts)
        assert_usage_error(code, err, "c.zarr", f"chunk '{name}'", "missing")
        assert_nothing_written(trace)
        chunk.write_bytes(saved)
    assert run_cli(run_args(data, trace), capsys)[0] == 0


def test_resume_with_another_store_of_the_same_width_is_refused(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Resuming on another data set of the same shape would splice two posteriors."""
    other = tmp_path / "other.zarr"
    assert (
        main(
            [
                "make-data",
                str(other),
                "--like",
                "logistic",
                "--rows",
                str(ROWS),
                "--features",
                str(FEATURES),
                "--seed",
                "2",
                "--chunk-rows",
                "500",
            ]
        )
        == 0
    )
    trace = tmp_path / "t.zarr"
    assert run_cli(run_args(store, trace), capsys)[0] == 0
    before = Trace.open(trace, read_only=True).samples.copy()
    args = run_args(other, trace, "--resume")
    code, _, err = run_cli(args, capsys)
    assert_usage_error(code, err, "cannot resume", "another data set", "other.zarr")
    np.testing.assert_array_equal(Trace.open(trace, read_only=True).samples, before)
    # another layout does not change the draws (they are keyed by row): it may resume
    code, _, err = run_cli(run_args(store, trace, "--resume", "--n-shards", "2"), capsys)
    assert code == 0, err
    np.testing.assert_array_equal(Trace.open(trace, read_only=True).samples, before)


def test_run_bad_input_writes_nothing(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.zarr"
    robust = tmp_path / "robust.zarr"
    assert (
        run_cli(["make-data", robust, "--like", "robust", "--rows", 100, "--features", 2], capsys)[
            0
        ]
        == 0
    )
    cases = [
        (["run", store, "--model", "poisson", "--trace", trace], "invalid choice"),
        (
            [
                "run",
                tmp_path / "missing.zarr",
                "--model",
                "logistic",
                "--synchronous",
                "--trace",
                trace,
            ],
            "no flymc_dist data set",
        ),
        (run_args(store, trace)[:1] + [tmp_path], "not a zarr"),
        (["run", robust, "--model", "logistic", "--synchronous", "--trace", trace], "0/1"),
        (run_args(store, trace, "--kernel", "gibbs"), "invalid choice"),
        (run_args(store, trace, "--samples", "0"), "positive integer"),
        (run_args(store, trace, "--q-db", "2"), "--q-db"),
        (run_args(store, trace, "--nu", "3"), "robust"),
        (["run", store, "--model", "logistic", "--synchronous"], "--trace"),
        (run_args(store, trace, "--workers", "2"), "--workers"),
    ]
    for args, needle in cases:
        if args[:1] == ["run"] and len(args) == 2:  # the bare directory, as STORE
            args = ["run", args[1], "--model", "logistic", "--synchronous", "--trace", trace]
        code, _, err = run_cli(args, capsys)
        assert_usage_error(code, err, needle)
        assert_nothing_written(trace)


@pytest.mark.slow
def test_summary_into_a_closed_pipe_is_quiet(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flymc summary t.zarr | head -2`: no "Broken pipe" when the reader has gone."""
    trace = tmp_path / "t.zarr"
    assert run_cli(run_args(store, trace), capsys)[0] == 0
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "flymc_dist.cli", "summary", str(trace)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=240,
            env={**os.environ, "CI": "1"},
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_ingest_csv_without_header_and_not_over_a_trace(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "noheader.csv"
    src.write_text("".join(f"{i / 10},{i % 2}\n" for i in range(50)))
    code, out, err = run_cli(["ingest", src, tmp_path / "o.zarr"], capsys)
    assert code == 0, err
    assert "50 rows" in out
    trace = tmp_path / "t.zarr"
    assert run_cli(run_args(store, trace), capsys)[0] == 0
    code, _, err = run_cli(["ingest", src, trace, "--overwrite"], capsys)
    assert_usage_error(code, err, "not a flymc_dist data set")
    assert Trace.open(trace, read_only=True).n_draws == 40


def test_summary_errors(tmp_path: Path, store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["summary", tmp_path / "missing.zarr"], capsys)
    assert_usage_error(code, err, "no trace")
    code, _, err = run_cli(["summary", store], capsys)
    assert_usage_error(code, err, "not a flymc trace")


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["frobnicate"], capsys)
    assert_usage_error(code, err, "invalid choice")
    assert run_cli([], capsys)[0] == 2
    code, out, _ = run_cli(["run", "--help"], capsys)
    assert code == 0 and "--scheduler-file" in out
    code, out, _ = run_cli(["bench", "sublinear", "--help"], capsys)
    assert code == 0 and "--ns" in out
    # the demo's help says what it runs (its defaults, not a figure of an earlier release)
    code, out, _ = run_cli(["demo", "--help"], capsys)
    flat = " ".join(out.split())
    assert code == 0 and "200,000 rows by default" in flat and "NUTS by default" in flat


# --------------------------------------------------------------------------- demo, bench


def test_demo_synchronous(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        [
            "demo",
            "--rows",
            3000,
            "--features",
            3,
            "--samples",
            200,
            "--chains",
            2,
            "--synchronous",
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0, err
    for needle in (
        "FlyMC",
        "regular",
        "ESS bulk",
        "R̂ max",
        "bright fraction",
        "likelihood queries",
        "seconds / iteration",
        "speedup",
        "agreement",
        "narrower than the posterior",
        "would give its slowest direction",
    ):
        assert needle in out
    assert "DISAGREE" not in out


def test_demo_removes_its_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    code, _, err = run_cli(
        [
            "demo",
            "--rows",
            500,
            "--features",
            2,
            "--samples",
            20,
            "--chains",
            2,
            "--synchronous",
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0, err
    assert list(tmp_path.iterdir()) == []


def test_bench_sublinear_is_wired(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        [
            "bench",
            "sublinear",
            "--ns",
            1000,
            3000,
            "--n-decisions",
            5,
            "--posterior-warmup",
            20,
            "--posterior-samples",
            20,
            "--no-plain",
            "--bias-eps",
        ],
        capsys,
    )
    assert code == 0, err
    assert "APPROXIMATE" in out and "slope" in out and "Posterior-scaled" in out
    code, _, err = run_cli(["bench", "sublinear", "--ns", "many"], capsys)
    assert_usage_error(code, err, "--ns")


def test_bench_mixing_is_wired(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`flymc bench mixing` on a small synthetic problem, in this process: both samplers,
    the ratios, and the JSON figures."""
    import json

    out_json = tmp_path / "mixing.json"
    small = ["bench", "mixing", "--problem", "logistic", "--rows", 3000, "--features", 3]
    small += ["--num-warmup", 30, "--num-samples", 30, "--json", out_json]
    code, out, err = run_cli([*small, "--regular-warmup", 0, "--regular-samples", 10], capsys)
    assert code == 0, err
    assert "flymc" in out and "regular" in out and "FlyMC / regular" in out
    d = json.loads(out_json.read_text())
    assert d["flymc"]["bright_replica"] is True
    # the driver updates z itself: one request per READ_AHEAD iterations at most (30
    # iterations may need none beyond the warm-up's), never a round per iteration
    assert 0 <= d["flymc"]["round_trips_per_iteration"] <= math.ceil(30 / READ_AHEAD) / 30
    assert d["regular"]["queries_per_iteration"] > d["flymc"]["queries_per_iteration"]
    assert d["setup"]["precondition"] == "laplace" and d["setup"]["adapt_metric"] is True
    # FlyMC's forecast of its own mixing, beside what it measured
    kappa, rate = d["flymc"]["conditional_narrowing"], d["flymc"]["gibbs_ess_per_draw"]
    assert kappa >= 1.0 and rate == pytest.approx(1.0 / (2.0 * kappa - 1.0))
    f = d["flymc"]
    assert f["ess_min_per_draw"] == pytest.approx(f["ess_min"] / (f["chains"] * f["draws"]))
    assert f"up to {kappa:.1f}× narrower" in out and f"direction {rate:.3g} effective" in out
    assert d["regular"]["conditional_narrowing"] is None
    code, _, err = run_cli(["bench", "mixing", "--problem", "cifar"], capsys)
    assert code == 2 and "problem" in err
    # FlyMC with the bounds' Gaussian as its kept metric (regular MCMC left out)
    code, out, err = run_cli(
        [*small, "--no-regular", "--precondition", "bound", "--no-adapt-metric"], capsys
    )
    assert code == 0, err
    assert "preconditioner bound (metric kept through warm-up)" in out
    d = json.loads(out_json.read_text())
    assert d["setup"]["precondition"] == "bound" and d["setup"]["adapt_metric"] is False
    code, _, err = run_cli(["bench", "mixing", "--precondition", "diag"], capsys)
    assert code == 2 and "precondition" in err
    # NUTS's depth limit reaches both runs; other kernels have none
    code, out, err = run_cli(
        [*small, "--regular-warmup", 0, "--regular-samples", 5, "--max-tree-depth", 3], capsys
    )
    assert code == 0, err
    assert "max tree depth 3" in out
    d = json.loads(out_json.read_text())
    assert d["setup"]["max_tree_depth"] == 3
    assert all("max_tree_depth=3" in d[run]["kernel"] for run in ("flymc", "regular"))
    assert "metric_from='differences'" in d["flymc"]["kernel"]
    assert "metric_from='draws'" in d["regular"]["kernel"]
    code, out, err = run_cli([*small, "--no-regular", "--q-db", 0.05], capsys)
    assert code == 0, err
    assert "FlyMC q_db 0.05" in out and json.loads(out_json.read_text())["setup"]["q_db"] == 0.05
    code, _, err = run_cli([*small, "--kernel", "rwmh", "--max-tree-depth", 3], capsys)
    assert code == 2 and "max_tree_depth" in err


def test_bench_mixing_reuses_its_store(tmp_path: Path) -> None:
    """A store an earlier `bench mixing --workdir` run left is reused when it holds the
    same data; another seed gets its own; a foreign store under the name is left alone
    (the writer's one-line error)."""
    from flymc_dist.bench.mixing import _problem

    _, first = _problem("logistic", 500, 3, 0, str(tmp_path))
    _, again = _problem("logistic", 500, 3, 0, str(tmp_path))
    assert again.path == first.path and again.n_rows == 500
    _, other = _problem("logistic", 500, 3, 1, str(tmp_path))
    assert other.path != first.path
    foreign = tmp_path / "logistic_600x3_seed0.zarr"
    from_numpy(np.zeros((10, 3)), np.zeros(10), str(foreign))
    with pytest.raises((ValueError, FileExistsError), match="already exists"):
        _problem("logistic", 600, 3, 0, str(tmp_path))
    assert open_dataset(str(foreign)).n_rows == 10


@pytest.fixture(scope="module")
def cluster_client(local_clusters) -> object:
    """A client of the session's shared 2-worker LocalCluster (started once: it is slow)."""
    from distributed import Client

    client = Client(local_clusters.get(2), direct_to_workers=True)
    client.wait_for_workers(2, timeout=120)
    yield client
    client.close()


@pytest.mark.slow
@pytest.mark.cluster
def test_run_on_a_scheduler(
    store: Path, tmp_path: Path, cluster_client: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real entry point, on a running scheduler; then its summary."""
    trace = tmp_path / "t.zarr"
    address = cluster_client.scheduler.address  # type: ignore[attr-defined]
    proc = run_subprocess(
        [
            "run",
            store,
            "--model",
            "logistic",
            "--scheduler",
            address,
            "--warmup",
            20,
            "--samples",
            30,
            "--chains",
            2,
            "--trace",
            trace,
        ]
    )
    assert proc.returncode == 0, proc.stderr
    assert "ess_bulk" in proc.stdout and "x1" in proc.stdout
    assert Trace.open(trace, read_only=True).n_draws == 30
    code, out, err = run_cli(["summary", trace], capsys)
    assert code == 0, err
    assert "x1" in out


@pytest.mark.slow
@pytest.mark.cluster
def test_bench_overhead_tiny(cluster_client: object) -> None:
    from flymc_dist.bench.overhead import format_overhead, run_overhead

    d = run_overhead(
        rows=4000,
        features=3,
        workers=2,
        iterations=20,
        chains=2,
        regular_iterations=5,
        warmup=5,
        pings=20,
        client=cluster_client,
    )
    for key in ("bare_round_trip", "flymc", "regular", "ratios", "goals", "setup"):
        assert key in d
    assert d["setup"]["workers"] == 2
    assert d["bare_round_trip"]["mean"] > 0
    # the driver updates z itself: a request per READ_AHEAD · 2 iterations at most (20
    # iterations may need none beyond the warm-up's), never a round per iteration
    assert 0 <= d["flymc"]["round_trips_per_iteration"] <= math.ceil(20 / READ_AHEAD) / 20
    assert d["regular"]["queries_per_iteration"] == 4000
    assert d["socket_echo"]["mean"] > 0 and d["rpc_echo"]["mean"] > 0
    assert d["tcp_echo"]["mean"] > 0
    assert d["setup"]["payload_bytes"] > 100 and d["setup"]["channel"] == "socket"
    # the workers are on this machine: every host reached by a local socket
    assert d["setup"]["local_channels"] == d["setup"]["echo_hosts"] >= 1
    # FlyMC with its rounds on TCP sockets and on Dask's RPC: the same draws
    assert d["flymc_tcp"]["ess_mean"] == d["flymc"]["ess_mean"]
    assert d["flymc_dask_channel"]["ess_mean"] == d["flymc"]["ess_mean"]
    assert d["flymc_tcp"]["r_hat_max"] == d["flymc"]["r_hat_max"]  # beside the speed, finite
    assert math.isfinite(d["flymc"]["r_hat_max"])
    assert d["ratios"]["flymc_over_socket_echo"] > 0
    assert d["ratios"]["flymc_tcp_over_tcp_echo"] > 0
    text = format_overhead(d)
    assert "FlyMC / bare actor round trip" in text and "4,000 rows" in text
    assert "echo on the socket channel" in text and "echo on TCP sockets" in text
    assert "Dask's RPC" in text
    assert "where FlyMC's time goes" in text
    assert f"R-hat max {d['flymc']['r_hat_max']:.3f}" in text
    t = d["flymc"]["timing"]
    assert len(t["hosts"]) == d["flymc"]["n_workers"]
    # rounds are the shards' z-updates: with the driver's own, none while sampling
    assert all(h["rounds"] == 0 for h in t["hosts"])


@pytest.mark.slow
@pytest.mark.cluster
def test_demo_on_an_embedded_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    """What a newcomer runs, in small: its own 2-worker LocalCluster, closed afterwards."""
    code, out, err = run_cli(
        [
            "demo",
            "--rows",
            4000,
            "--features",
            3,
            "--samples",
            60,
            "--chains",
            2,
            "--workers",
            2,
            "--no-progress",
        ],
        capsys,
    )
    assert code == 0, err
    assert "2 workers" in out and "speedup" in out and "agreement" in out


def test_cli_kernel_names_are_the_package_kernels():
    """The CLI names the kernels without importing them (a light start): the same set."""
    from flymc_dist.cli import parser
    from flymc_dist.kernels import KERNELS

    assert set(parser._KERNELS) == set(KERNELS)


def test_flat_prior_on_separable_data_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``flymc run --prior flat`` on separable logistic data: refused in one line (exit 2),
    no trace left, instead of draws in the thousands and exit 0."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=300)
    X = np.column_stack([np.ones(300), x])
    store = from_numpy(X, (x > 0.1).astype(np.int64), tmp_path / "sep.zarr").path
    trace = tmp_path / "t.zarr"
    code, _, err = run_cli(run_args(Path(store), trace, "--prior", "flat"), capsys)
    assert code == 2 and "improper posterior" in err and "separable" in err
    assert err.count("\n") == 1 and not trace.exists()
