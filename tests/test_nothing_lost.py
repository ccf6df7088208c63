"""Issue #28, round two: what a user meets at the command line and in ``fd.sample`` when
the data hold values too large to compute with, a run is stopped by SIGTERM, a CSV header
is all numbers, or a trace is reached through a symbolic link."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from scipy.special import expit

import flymc_dist as fd
from flymc_dist.cli import main


def _logistic(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.c_[np.ones(n), rng.normal(size=(n, 2))]
    return X, (rng.random(n) < expit(X @ np.array([0.4, -1.0, 0.6]))).astype(np.int64)


# --------------------------------------------------------------------------- item 8


def test_cli_ingest_refuses_a_value_whose_powers_overflow(tmp_path: Path, capsys) -> None:
    """A CSV cell of 1e300: `flymc ingest` ends with status 2 and one line naming its row
    and column; nothing is written."""
    X, y = _logistic(50)
    X[10, 1] = 1e300
    np.savetxt(tmp_path / "d.csv", np.column_stack([X, y]), delimiter=",", fmt="%.17g")
    capsys.readouterr()
    assert main(["ingest", str(tmp_path / "d.csv"), str(tmp_path / "d.zarr")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "too large to compute with: first at row 10, column 1" in err[0]
    assert not (tmp_path / "d.zarr").exists()


@pytest.mark.parametrize("algorithm", ["flymc", "regular"])
def test_an_overflow_in_the_map_search_names_the_parameter(tmp_path: Path, algorithm) -> None:
    """A store holding 1e300 (as written before writers refused it): the run fails at the
    MAP search naming the parameter whose derivatives overflow, not with scipy's "array
    must not contain infs or NaNs"."""
    X, y = _logistic()
    fd.from_numpy(X, y, tmp_path / "d.zarr", chunk_rows=100)
    zarr.open_group(tmp_path / "d.zarr", mode="r+")["X"][100, 1] = 1e300
    with (
        np.errstate(over="ignore", invalid="ignore"),
        pytest.raises(FloatingPointError, match="overflow in parameter 1 ") as info,
    ):
        fd.sample(
            fd.LogisticRegression(),
            fd.open_dataset(tmp_path / "d.zarr"),
            algorithm=algorithm,
            kernel="rwmh",
            num_warmup=10,
            num_samples=10,
            chains=1,
            client="synchronous",
            progress=False,
        )
    assert "too large for float64" in str(info.value) and "\n" not in str(info.value)


# --------------------------------------------------------------------------- SIGTERM


def test_an_interrupt_frees_the_work_it_cut_short_without_a_warning() -> None:
    """An interrupt that cuts a store's asynchronous write short leaves a coroutine never
    awaited in its traceback's frames (zarr's): the CLI frees it before it exits, without
    the RuntimeWarning that would follow its two lines (it did, now and then, after
    SIGTERM). Negative control: freed plainly, the same frames warn."""
    import gc
    import warnings

    from flymc_dist.cli import _drop_cut_short

    async def write() -> None:
        pass

    def cut_short() -> None:
        pending = write()  # noqa: F841 - held by this frame, never awaited
        raise KeyboardInterrupt

    def caught() -> BaseException:
        try:
            cut_short()
        except KeyboardInterrupt as err:
            return err
        raise AssertionError("not interrupted")

    for quiet in (True, False):
        err = caught()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            if quiet:
                _drop_cut_short(err)
            else:
                err.__traceback__ = None
                gc.collect()
        warned = any("never awaited" in str(w.message) for w in got)
        assert warned is not quiet


@pytest.mark.slow
def test_sigterm_keeps_the_trace_releases_the_lock_and_prints_the_resume_hint(
    tmp_path: Path,
) -> None:
    """A batch scheduler stops `flymc run` with SIGTERM after its first checkpoint: it ends
    with status 143 and two lines (terminated; how to resume), its lock is released and
    --resume continues the trace."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from flymc_dist.trace import Trace, TraceLock

    X, y = _logistic()
    fd.from_numpy(X, y, tmp_path / "d.zarr", chunk_rows=100)
    trace = tmp_path / "t.zarr"
    argv = ["run", str(tmp_path / "d.zarr"), "--model", "logistic", "--algorithm", "regular"]
    argv += ["--kernel", "rwmh", "--warmup", "10", "--chains", "1", "--synchronous"]
    argv += ["--no-progress", "--checkpoint-every", "10", "--trace", str(trace)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flymc_dist.cli", *argv, "--samples", "1000000"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        while True:  # until the first checkpoint is written
            assert proc.poll() is None
            try:
                if Trace.open(trace, read_only=True).checkpoint is not None:
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = err.strip().splitlines()
    assert proc.returncode == 143, err
    assert len(lines) == 2 and lines[0] == "flymc: error: terminated (SIGTERM)", lines
    assert f"{trace} keeps" in lines[1] and "--resume" in lines[1]
    assert not Path(TraceLock(trace).path).exists()  # released, not left stale
    done = int(Trace.open(trace, read_only=True).checkpoint["iteration"]) + 1
    assert f"keeps {done:,} iterations" in lines[1]


# --------------------------------------------------------------------------- CSV header


def test_an_all_numeric_csv_header_is_not_read_as_data_silently(tmp_path: Path, capsys) -> None:
    """`0,1,2,3`, the header pandas writes for unnamed columns, could be a header or a
    row: `flymc ingest` refuses to guess (one line, nothing written); --header and
    --no-header say which. Other numeric first lines are data, as before."""
    X, y = _logistic(30)
    body = "\n".join(",".join(f"{v:.17g}" for v in [*x, t]) for x, t in zip(X, y, strict=True))
    src, out = tmp_path / "d.csv", tmp_path / "d.zarr"
    src.write_text("0,1,2,3\n" + body + "\n")
    capsys.readouterr()
    assert main(["ingest", str(src), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "0,1,2,3, may be a header" in err[0] and "--no-header" in err[0]
    assert not out.exists()
    assert main(["ingest", str(src), str(out), "--header"]) == 0
    ds = fd.open_dataset(out)
    assert ds.n_rows == 30 and ds.feature_names == ["0", "1", "2"]
    np.testing.assert_array_equal(ds.read()[0], X)
    assert main(["ingest", str(src), str(tmp_path / "e.zarr"), "--no-header"]) == 0
    X1, y1 = fd.open_dataset(tmp_path / "e.zarr").read()  # as asked: the line is a row
    assert X1.shape == (31, 3) and list(X1[0]) == [0, 1, 2] and y1[0] == 3
    src.write_text("1,0.5,2,1\n" + body + "\n")  # a first row of data, as before
    assert main(["ingest", str(src), str(tmp_path / "f.zarr")]) == 0
    assert fd.open_dataset(tmp_path / "f.zarr").n_rows == 31
