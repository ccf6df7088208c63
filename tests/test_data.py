"""Tests of the data layer: layout, validation, atomic writes, shards, generators, ingest."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import zarr

from flymc_dist import data as fdata
from flymc_dist.data import (
    FORMAT,
    Dataset,
    from_blocks,
    from_numpy,
    ingest,
    make_glm,
    make_logistic,
    make_opv_like,
    make_robust,
    make_softmax,
    open_dataset,
)
from flymc_dist.data import write as data_write
from flymc_dist.data.write import magnitude_limit

# --------------------------------------------------------------------------- helpers


def _xy(n: int = 50, d: int = 3, task: str = "real", seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    if task == "binary":
        y = rng.integers(0, 2, n)
    elif task == "multiclass":
        y = rng.integers(0, 4, n)
    else:
        y = rng.standard_normal(n)
    return X, y


def _leftovers(parent: Path, name: str) -> list[str]:
    """Temporary siblings of ``parent / name`` that a writer may have left behind."""
    return [p for p in os.listdir(parent) if p.startswith(f".{name}.flymc-")]


def assert_nothing_written(path: Path) -> None:
    assert not path.exists(), f"{path} should not exist"
    if path.parent.exists():
        assert _leftovers(path.parent, path.name) == []


def assert_clean(path: Path) -> None:
    assert _leftovers(path.parent, path.name) == []


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("task", ["real", "binary", "multiclass"])
def test_round_trip(tmp_path: Path, task: str) -> None:
    X, y = _xy(103, 4, task)
    ds = from_numpy(X, y, tmp_path / "d.zarr", chunk_rows=10)
    assert isinstance(ds, Dataset)
    ds2 = open_dataset(tmp_path / "d.zarr")
    for d in (ds, ds2):
        assert d.path == str((tmp_path / "d.zarr").resolve())
        assert (d.n_rows, d.n_features, d.chunk_rows, d.task) == (103, 4, 10, task)
        assert d.shape == (103, 4) and len(d) == 103 and d.n_chunks == 11
        Xr, yr = d.read(0, 103)
        np.testing.assert_array_equal(Xr, X)
        np.testing.assert_array_equal(yr, y)
        assert Xr.dtype == np.float64 and Xr.flags.c_contiguous
        assert yr.dtype == (np.float64 if task == "real" else np.int64)
    assert ds2.n_classes == {"real": None, "binary": 2, "multiclass": 4}[task]
    g = zarr.open_group(str(tmp_path / "d.zarr"), mode="r")
    assert g.attrs["format"] == FORMAT
    assert g["X"].chunks == (10, 4) and g["y"].chunks == (10,)
    assert g["X"].dtype == np.float64
    assert_clean(tmp_path / "d.zarr")


def test_round_trip_dtypes_names_and_defaults(tmp_path: Path) -> None:
    X = np.arange(12, dtype=np.int32).reshape(6, 2)
    y = np.array([True, False, True, True, False, False])
    ds = from_numpy(X, y, str(tmp_path / "a"), feature_names=["a", "b"])
    assert ds.task == "binary" and ds.n_classes == 2
    assert ds.chunk_rows == 6  # default clipped to N
    assert ds.feature_names == ["a", "b"]
    Xr, yr = ds.read(0, 6)
    np.testing.assert_array_equal(Xr, X.astype(float))
    np.testing.assert_array_equal(yr, y.astype(np.int64))
    # float32 features are widened exactly; chunk_rows larger than N is clipped
    Xf = np.random.default_rng(1).standard_normal((7, 3)).astype(np.float32)
    ds = from_numpy(Xf, np.zeros(7) + 0.5, tmp_path / "b", chunk_rows=1000)
    assert ds.chunk_rows == 7
    np.testing.assert_array_equal(ds.read(0, 7)[0], Xf.astype(np.float64))


def test_default_chunk_rows_about_8_mib() -> None:
    cr = fdata.default_chunk_rows(10**7, 57)
    assert abs(cr * 57 * 8 - 8 * 2**20) <= 57 * 8
    assert fdata.default_chunk_rows(10, 57) == 10
    assert fdata.default_chunk_rows(10**7, 10**7) == 1


@pytest.mark.parametrize(
    ("y", "task", "k"),
    [
        (np.array([0.0, 1.0, 1.0, 0.0]), "binary", 2),
        (np.array([0, 0, 0, 0]), "binary", 2),
        (np.array([0, 2, 1, 4]), "multiclass", 5),
        (np.array([1.0, 2.0, 3.0, 2.0]), "multiclass", 4),
        (np.array([-1, 0, 1, 1]), "real", None),
        (np.array([0.5, 1.0, 0.0, 1.0]), "real", None),
    ],
)
def test_task_inference(tmp_path: Path, y: np.ndarray, task: str, k: int | None) -> None:
    ds = from_numpy(np.ones((4, 1)), y, tmp_path / "t")
    assert (ds.task, ds.n_classes) == (task, k)


def test_explicit_task(tmp_path: Path) -> None:
    y = np.array([0, 1, 1, 0])
    ds = from_numpy(np.ones((4, 1)), y, tmp_path / "r", task="real")
    assert ds.task == "real" and ds.read()[1].dtype == np.float64
    ds = from_numpy(np.ones((4, 1)), y, tmp_path / "m", task="multiclass", n_classes=3)
    assert (ds.task, ds.n_classes) == ("multiclass", 3)
    ds = from_numpy(np.ones((4, 1)), y, tmp_path / "m2", task="multiclass")
    assert ds.n_classes == 2


# --------------------------------------------------------------------------- validation

_rng = np.random.default_rng(0)
_X = _rng.standard_normal((20, 3))
_y = _rng.standard_normal(20)
_yb = _rng.integers(0, 2, 20)


def _with(a: np.ndarray, idx: tuple, value: float) -> np.ndarray:
    a = a.astype(float)
    a[idx] = value
    return a


BAD = {
    "X 1-D": (dict(X=np.ones(5), y=np.ones(5)), "X must be 2-D"),
    "X 3-D": (dict(X=np.ones((5, 2, 2)), y=np.ones(5)), "X must be 2-D"),
    "y 2-D": (dict(X=np.ones((5, 2)), y=np.ones((5, 1))), "y must be 1-D"),
    "length mismatch": (dict(X=np.ones((5, 2)), y=np.ones(4)), "5 rows but y has 4"),
    "N = 0": (dict(X=np.ones((0, 2)), y=np.ones(0)), "empty"),
    "D = 0": (dict(X=np.ones((5, 0)), y=np.ones(5)), "no columns"),
    "X strings": (dict(X=np.array([["a", "b"]]), y=np.ones(1)), "numeric dtype"),
    "X complex": (dict(X=np.ones((2, 2), dtype=complex), y=np.ones(2)), "numeric dtype"),
    "X object": (dict(X=np.array([[1, None]], dtype=object), y=np.ones(1)), "numeric dtype"),
    "y strings": (dict(X=np.ones((2, 2)), y=np.array(["a", "b"])), "numeric dtype"),
    "NaN in X": (dict(X=_with(_X, (7, 2), np.nan), y=_y), r"row 7, column 2"),
    "inf in X": (dict(X=_with(_X, (3, 0), -np.inf), y=_y), r"row 3, column 0"),
    "NaN in y": (dict(X=_X, y=_with(_y, (11,), np.nan)), r"y contains .* row 11"),
    "inf in y": (dict(X=_X, y=_with(_y, (0,), np.inf)), r"y contains .* row 0"),
    "binary label 2": (dict(X=_X, y=_with(_yb, (4,), 2), task="binary"), r"\{0, 1\}.*row 4"),
    "binary label -1": (dict(X=_X, y=_with(_yb, (5,), -1), task="binary"), r"row 5"),
    "binary non-integer": (dict(X=_X, y=_with(_yb, (6,), 0.5), task="binary"), "integer"),
    "multiclass out of range": (
        dict(X=_X, y=_with(_yb, (9,), 3), task="multiclass", n_classes=3),
        r"0\.\.2.*row 9",
    ),
    "multiclass K < 2": (
        dict(X=_X, y=np.zeros(20), task="multiclass", n_classes=1),
        "n_classes >= 2",
    ),
    "binary n_classes 3": (dict(X=_X, y=_yb, task="binary", n_classes=3), "must be 2"),
    "real with n_classes": (dict(X=_X, y=_y, task="real", n_classes=3), "None for task 'real'"),
    "unknown task": (dict(X=_X, y=_y, task="poisson"), "task must be one of"),
    "chunk_rows 0": (dict(X=_X, y=_y, chunk_rows=0), "chunk_rows must be >= 1"),
    "chunk_rows -3": (dict(X=_X, y=_y, chunk_rows=-3), "chunk_rows must be >= 1"),
    "chunk_rows float": (dict(X=_X, y=_y, chunk_rows=2.5), "chunk_rows must be a positive"),
    "feature_names length": (dict(X=_X, y=_y, feature_names=["a"]), "feature_names has 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_validation_errors_write_nothing(tmp_path: Path, case: str) -> None:
    kwargs, match = BAD[case]
    path = tmp_path / "sub" / "bad.zarr"
    with pytest.raises(ValueError, match=match):
        from_numpy(path=path, **kwargs)
    assert_nothing_written(path)
    assert not (tmp_path / "sub").exists()  # not even the parent directory


def test_existing_path_without_overwrite(tmp_path: Path) -> None:
    X, y = _xy()
    path = tmp_path / "d.zarr"
    from_numpy(X, y, path)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        from_numpy(X + 1, y, path)
    np.testing.assert_array_equal(open_dataset(path).read()[0], X)
    assert_clean(path)


def test_overwrite_replaces(tmp_path: Path) -> None:
    X, y = _xy(30, 2)
    path = tmp_path / "d.zarr"
    old = from_numpy(X, y, path, chunk_rows=7)
    X2, y2 = _xy(41, 5, "binary", seed=3)
    new = from_numpy(X2, y2, path, overwrite=True, chunk_rows=4)
    assert (new.n_rows, new.n_features, new.task, new.chunk_rows) == (41, 5, "binary", 4)
    np.testing.assert_array_equal(open_dataset(path).read()[0], X2)
    assert old.path == new.path
    assert_clean(path)


def test_overwrite_refuses_non_stores(tmp_path: Path) -> None:
    X, y = _xy()
    f = tmp_path / "file.txt"
    f.write_text("precious")
    with pytest.raises(FileExistsError, match="not a directory"):
        from_numpy(X, y, f, overwrite=True)
    assert f.read_text() == "precious"
    d = tmp_path / "dir"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a zarr store"):
        from_numpy(X, y, d, overwrite=True)
    assert (d / "precious.txt").read_text() == "keep me"
    # nor a zarr store that is not a data set: a sampling trace
    from flymc_dist.trace import Trace

    t = tmp_path / "t.zarr"
    Trace.create(t, chains=1, param_shape=(2,), stats={"a": bool}, attrs={})
    with pytest.raises(FileExistsError, match="not a flymc_dist data set"):
        from_numpy(X, y, t, overwrite=True)
    assert Trace.open(t, read_only=True).chains == 1
    # an empty directory may be replaced
    e = tmp_path / "empty"
    e.mkdir()
    assert from_numpy(X, y, e, overwrite=True).n_rows == 50
    assert_clean(e)


# --------------------------------------------------------------------------- interrupt safety


class _Boom(Exception):
    pass


def _failing_write_block(monkeypatch: pytest.MonkeyPatch, after: int, exc: BaseException):
    """Make the writer's block write raise ``exc`` on call number ``after + 1``."""
    real = data_write._write_block
    calls = {"n": 0}

    def fake(array, start, values):
        calls["n"] += 1
        if calls["n"] > after:
            raise exc
        real(array, start, values)

    monkeypatch.setattr(data_write, "_write_block", fake)
    # one chunk per zarr write, so that there are many writes
    monkeypatch.setattr(data_write, "_WORK_BLOCK_BYTES", 1)
    return calls


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), _Boom("disk full"), OSError("EIO")])
def test_interrupt_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    X, y = _xy(100, 3)
    path = tmp_path / "d.zarr"
    calls = _failing_write_block(monkeypatch, after=5, exc=exc)
    with pytest.raises(type(exc)):
        from_numpy(X, y, path, chunk_rows=10)
    assert calls["n"] > 5  # it really failed midway
    assert_nothing_written(path)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), _Boom("disk full")])
def test_interrupt_keeps_old_store_on_overwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    X, y = _xy(100, 3)
    path = tmp_path / "d.zarr"
    from_numpy(X, y, path, chunk_rows=10)
    _failing_write_block(monkeypatch, after=4, exc=exc)
    with pytest.raises(type(exc)):
        from_numpy(X + 100, y, path, chunk_rows=10, overwrite=True)
    ds = open_dataset(path)
    np.testing.assert_array_equal(ds.read()[0], X)
    assert ds.chunk_rows == 10
    assert_clean(path)


def test_interrupt_in_generator_leaves_nothing(tmp_path: Path) -> None:
    def blocks():
        for i in range(5):
            if i == 3:
                raise KeyboardInterrupt
            yield np.ones((10, 2)), np.zeros(10)

    path = tmp_path / "g.zarr"
    with pytest.raises(KeyboardInterrupt):
        from_blocks(blocks(), path, 50, 2, task="real", chunk_rows=4)
    assert_nothing_written(path)


def test_from_blocks_validates_each_block(tmp_path: Path) -> None:
    good = (np.ones((10, 2)), np.zeros(10))
    bad_x = (_with(np.ones((10, 2)), (4, 1), np.nan), np.zeros(10))
    path = tmp_path / "g.zarr"
    with pytest.raises(ValueError, match="row 14, column 1"):
        from_blocks([good, bad_x], path, 20, 2, task="real")
    assert_nothing_written(path)
    with pytest.raises(ValueError, match="row 13"):
        from_blocks(
            [good, (np.ones((10, 2)), _with(np.zeros(10), (3,), 2))], path, 20, 2, task="binary"
        )
    assert_nothing_written(path)
    with pytest.raises(ValueError, match="expected n_rows = 30"):
        from_blocks([good, good], path, 30, 2, task="real")
    assert_nothing_written(path)
    with pytest.raises(ValueError, match="more than n_rows"):
        from_blocks([good, good], path, 15, 2, task="real")
    assert_nothing_written(path)
    with pytest.raises(ValueError, match="expected \\(n, 3\\)"):
        from_blocks([good], path, 10, 3, task="real")
    assert_nothing_written(path)
    with pytest.raises(ValueError, match="reserved"):
        from_blocks([good], path, 10, 2, task="real", attrs={"task": "x"})
    assert_nothing_written(path)
    with pytest.raises(ValueError, match="n_classes"):
        from_blocks([good], path, 10, 2, task="multiclass")
    assert_nothing_written(path)
    ds = from_blocks([good, good], path, 20, 2, task="binary", attrs={"note": np.float64(2)})
    assert ds.attrs["note"] == 2.0 and ds.task == "binary"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_check_block_takes_its_shortcut_only_for_valid_blocks(dtype: str) -> None:
    """A block's X is passed by its min and max when they show every value valid; at each
    bound (the magnitude limit, float32's max) it still passes, and just beyond it, or
    with a NaN or an infinity anywhere, the first bad value (in row order) is named."""
    check_block = data_write.check_block
    n_rows, x_dtype = 1000, np.dtype(dtype)
    bound = magnitude_limit(n_rows) if dtype == "float64" else float(np.finfo(np.float32).max)
    args = (n_rows, 3, x_dtype, "real", None)
    X = np.random.default_rng(2).normal(size=(40, 3))
    X[5, 0], X[9, 2] = bound, -bound
    Xb, _ = check_block(X, np.zeros(40), 100, *args)
    assert Xb is X
    above = np.nextafter(bound, np.inf) if dtype == "float64" else 4e38
    cases = [(np.nan, "non-finite"), (np.inf, "non-finite"), (-np.inf, "non-finite")]
    cases.append((-above, "too large"))
    for value, what in cases:
        bad = X.copy()
        bad[31, 1], bad[17, 2] = value, value
        with pytest.raises(ValueError, match=f"{what}.*first at row 117, column 2"):
            check_block(bad, np.zeros(40), 100, *args)


def test_from_blocks_caller_may_reuse_its_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data_write, "_WORK_BLOCK_BYTES", 1)  # blocks take the direct path
    buf_X, buf_y = np.empty((20, 2)), np.empty(20)

    def blocks():
        for i in range(5):
            buf_X[:] = i
            buf_y[:] = i
            yield buf_X, buf_y

    ds = from_blocks(blocks(), tmp_path / "r", 100, 2, task="real", chunk_rows=10)
    X, y = ds.read()
    np.testing.assert_array_equal(y, np.repeat(np.arange(5.0), 20))
    np.testing.assert_array_equal(X[:, 1], y)


# --------------------------------------------------------------------------- opening


def test_open_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no flymc_dist data set"):
        open_dataset(tmp_path / "missing.zarr")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a zarr"):
        open_dataset(tmp_path / "plain")
    g = zarr.open_group(str(tmp_path / "other.zarr"), mode="w", zarr_format=3)
    g.attrs["hello"] = "world"
    with pytest.raises(ValueError, match="not a complete flymc_dist data set"):
        open_dataset(tmp_path / "other.zarr")
    zarr.create_array(str(tmp_path / "arr.zarr"), shape=(3,), dtype="float64")
    with pytest.raises(ValueError, match="not a flymc_dist data set"):
        open_dataset(tmp_path / "arr.zarr")


def test_open_detects_mismatched_arrays(tmp_path: Path) -> None:
    path = tmp_path / "d.zarr"
    from_numpy(*_xy(20, 2), path)
    g = zarr.open_group(str(path), mode="r+")
    g.attrs["n_rows"] = 21
    with pytest.raises(ValueError, match="do not match"):
        open_dataset(path)


def test_fsspec_memory_url() -> None:
    url = "memory://flymc-test/d.zarr"
    X, y = _xy(33, 2, "binary")
    try:
        ds = from_numpy(X, y, url, chunk_rows=8)
        assert ds.path == url
        ds2 = pickle.loads(pickle.dumps(open_dataset(url)))
        np.testing.assert_array_equal(ds2.read()[0], X)
        with pytest.raises(FileExistsError):
            from_numpy(X, y, url)
        assert from_numpy(X[:5], y[:5], url, overwrite=True).n_rows == 5
    finally:
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists("/flymc-test"):
            fs.rm("/flymc-test", recursive=True)
    with pytest.raises(FileNotFoundError):
        open_dataset("memory://flymc-test/missing.zarr")


def test_file_url_is_the_local_directory(tmp_path: Path) -> None:
    """One definition of a URL for data sets, traces and the CLI: ``file://`` is a local
    path (written by rename, checked by inode), everything else with ``://`` a URL."""
    from flymc_dist._paths import is_url, local_path

    assert is_url("s3://bucket/d.zarr") and is_url("memory://d.zarr")
    assert not any(is_url(p) for p in (f"file://{tmp_path}", tmp_path, str(tmp_path), "d.zarr"))
    assert local_path(f"file://{tmp_path}/d.zarr") == tmp_path / "d.zarr"
    X, y = _xy(20, 2, "binary")
    ds = from_numpy(X, y, f"file://{tmp_path}/d.zarr", chunk_rows=8)
    assert ds.path == str(tmp_path / "d.zarr")
    assert (tmp_path / "d.zarr" / "zarr.json").is_file()
    np.testing.assert_array_equal(open_dataset(f"file://{tmp_path}/d.zarr").read()[0], X)
    with pytest.raises(FileExistsError):
        from_numpy(X, y, f"file://{tmp_path}/d.zarr")


# --------------------------------------------------------------------------- reading


@pytest.fixture
def ds(tmp_path: Path) -> Dataset:
    X, y = _xy(103, 4, "multiclass")
    return from_numpy(X, y, tmp_path / "d.zarr", chunk_rows=10)


def test_read_ranges(ds: Dataset) -> None:
    Xa, ya = ds.read()
    X, y = ds.read(17, 42)
    np.testing.assert_array_equal(X, Xa[17:42])
    np.testing.assert_array_equal(y, ya[17:42])
    X, y = ds.read(5, 5)
    assert X.shape == (0, 4) and y.shape == (0,)
    for bad in [(-1, 3), (3, 2), (0, 104)]:
        with pytest.raises(IndexError):
            ds.read(*bad)


def test_read_rows(ds: Dataset) -> None:
    Xa, ya = ds.read()
    idx = np.array([0, 3, 3, 9, 10, 55, 99, 102])
    X, y = ds.read_rows(idx)
    np.testing.assert_array_equal(X, Xa[idx])
    np.testing.assert_array_equal(y, ya[idx])
    assert X.flags.c_contiguous and X.dtype == np.float64
    X, y = ds.read_rows([])
    assert X.shape == (0, 4) and y.shape == (0,)
    with pytest.raises(ValueError, match="sorted"):
        ds.read_rows([5, 2])
    with pytest.raises(IndexError):
        ds.read_rows([0, 103])
    with pytest.raises(IndexError):
        ds.read_rows([-1, 2])
    with pytest.raises(ValueError, match="integers"):
        ds.read_rows([0.5])


def test_iter_chunks(ds: Dataset) -> None:
    Xa, ya = ds.read()
    pieces = list(ds.iter_chunks())
    assert [(s, e) for s, e, _, _ in pieces] == ds.chunk_ranges()
    np.testing.assert_array_equal(np.concatenate([p[2] for p in pieces]), Xa)
    np.testing.assert_array_equal(np.concatenate([p[3] for p in pieces]), ya)
    sub = [(s, e) for s, e, _, _ in ds.iter_chunks(15, 42)]
    assert sub == [(15, 20), (20, 30), (30, 40), (40, 42)]


def test_pickle_is_cheap_and_lazy(ds: Dataset) -> None:
    ds.read(0, 3)  # open the arrays
    blob = pickle.dumps(ds)
    assert len(blob) < 2000
    ds2 = pickle.loads(blob)
    assert ds2.__dict__["_arrays"] is None
    np.testing.assert_array_equal(ds2.read(5, 25)[0], ds.read(5, 25)[0])
    assert (ds2.n_rows, ds2.task, ds2.n_classes) == (ds.n_rows, ds.task, ds.n_classes)


def test_missing_or_corrupt_chunk_fails_loudly_naming_it(tmp_path: Path) -> None:
    """A chunk absent from the store (a partial copy) is never read as the fill value, and
    a chunk that cannot be decoded is named: every reader fails with the store and chunk.
    Labels that are all 0 (zarr's default fill value) in a chunk are still stored."""
    X, y = _xy(60, 2, "binary")
    y[:20] = 0  # chunk 0 of y holds only zeros: it must be written, not skipped
    path = tmp_path / "d.zarr"
    ds = from_numpy(X, y, path, chunk_rows=10)
    assert sorted(os.listdir(path / "y" / "c"), key=int) == [str(i) for i in range(6)]
    np.testing.assert_array_equal(ds.read()[1], y)
    (path / "y" / "c" / "3").unlink()
    fresh = open_dataset(path)
    readers = [
        lambda: fresh.read(),
        lambda: fresh.read(25, 35),
        lambda: fresh.read_rows([1, 31]),
        lambda: list(fresh.iter_chunks()),
        lambda: pickle.loads(pickle.dumps(fresh)).read(),
    ]
    for read in readers:
        with pytest.raises(
            fdata.DataIntegrityError, match=r"d\.zarr.*chunk 'y/c/3' \(rows 30-39 of y\) is missing"
        ):
            read()
    np.testing.assert_array_equal(fresh.read(0, 30)[1], y[:30])  # the rest still reads
    ds = from_numpy(X, y, path, chunk_rows=10, overwrite=True)
    (path / "X" / "c" / "5" / "0").unlink()
    with pytest.raises(fdata.DataIntegrityError, match=r"chunk 'X/c/5/0' \(rows 50-59"):
        open_dataset(path).read()
    from_numpy(X, y, path, chunk_rows=10, overwrite=True)
    chunk = path / "X" / "c" / "2" / "0"
    chunk.write_bytes(chunk.read_bytes()[:7])
    for read in (lambda d: d.read(), lambda d: d.read_rows([3, 24])):
        with pytest.raises(
            fdata.DataIntegrityError,
            match=r"d\.zarr.*chunk 'X/c/2/0' \(rows 20-29 of X\) cannot be "
            "decoded",
        ):
            read(open_dataset(path))


def test_sampling_a_store_with_a_missing_chunk_is_refused(tmp_path: Path) -> None:
    """The shards' load (and so the MAP and every round) refuses a damaged store."""
    import flymc_dist as fd

    X, y = _xy(200, 2, "binary")
    path = tmp_path / "d.zarr"
    from_numpy(X, y, path, chunk_rows=50)
    (path / "y" / "c" / "2").unlink()
    with pytest.raises(fdata.DataIntegrityError, match="chunk 'y/c/2'"):
        fd.sample(
            fd.LogisticRegression(),
            open_dataset(path),
            num_warmup=2,
            num_samples=2,
            chains=1,
            client="synchronous",
            progress=False,
        )


def test_fingerprint_tells_stores_apart(tmp_path: Path) -> None:
    X, y = _xy(40, 2, "real")
    a = from_numpy(X, y, tmp_path / "a.zarr", chunk_rows=10)
    b = from_numpy(X, y, tmp_path / "b.zarr", chunk_rows=10)
    assert a.fingerprint() == open_dataset(tmp_path / "a.zarr").fingerprint()
    assert a.fingerprint() != b.fingerprint() and a.fingerprint().startswith("40x2:")


def test_repr(ds: Dataset) -> None:
    r = repr(ds)
    assert "n_rows=103" in r and "n_features=4" in r and "multiclass" in r and "d.zarr" in r


# --------------------------------------------------------------------------- shard ranges


def _check_shards(ranges: list[tuple[int, int]], n: int, cr: int) -> None:
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (_, e0), (s1, _) in zip(ranges[:-1], ranges[1:], strict=True):
        assert e0 == s1
    for s, e in ranges:
        assert s < e and s % cr == 0
        assert e % cr == 0 or e == n


@pytest.mark.parametrize(("n", "cr"), [(1, 1), (10, 3), (100, 10), (101, 10), (1000, 7)])
def test_shard_ranges_cover_once_and_align(tmp_path: Path, n: int, cr: int) -> None:
    ds = from_numpy(np.zeros((n, 1)), np.zeros(n), tmp_path / "s", chunk_rows=cr)
    n_chunks = -(-n // cr)
    for k in [1, 2, 3, 5, 8, 1000]:
        r = ds.shard_ranges(n_shards=k)
        _check_shards(r, n, cr)
        assert len(r) == min(k, n_chunks)
        sizes = [-(-(e - s) // cr) for s, e in r]  # chunks per shard
        assert max(sizes) - min(sizes) <= 1
    for rps in [1, cr, 2 * cr, 3 * cr + 1, 10**9]:
        r = ds.shard_ranges(rows_per_shard=rps)
        _check_shards(r, n, cr)
        per = max(1, round(rps / cr))
        assert all(e - s == per * cr for s, e in r[:-1])
    _check_shards(ds.shard_ranges(), n, cr)
    covered = np.zeros(n, int)
    for s, e in ds.shard_ranges(n_shards=3):
        covered[s:e] += 1
    assert np.all(covered == 1)


def test_shard_ranges_depend_only_on_layout(tmp_path: Path) -> None:
    a = from_numpy(np.zeros((1000, 1)), np.zeros(1000), tmp_path / "a", chunk_rows=30)
    b = from_numpy(*_xy(1000, 7, "binary"), tmp_path / "b", chunk_rows=30)
    for kw in [{}, {"n_shards": 4}, {"rows_per_shard": 200}]:
        assert a.shard_ranges(**kw) == b.shard_ranges(**kw)
        assert a.shard_ranges(**kw) == open_dataset(a.path).shard_ranges(**kw)
        assert a.shard_ranges(**kw) == pickle.loads(pickle.dumps(a)).shard_ranges(**kw)


def test_shard_ranges_default_and_errors(tmp_path: Path) -> None:
    n = 600_000
    ds = from_blocks(
        [(np.zeros((n, 1)), np.zeros(n))],
        tmp_path / "big",
        n,
        1,
        task="real",
        chunk_rows=50_000,
    )
    # by default one shard (samplers pass the number of workers)
    assert ds.shard_ranges() == [(0, 600_000)]
    # 2**18 rows per shard rounded to 5 chunks of 50k rows
    r = ds.shard_ranges(rows_per_shard=2**18)
    assert r == [(0, 250_000), (250_000, 500_000), (500_000, 600_000)]
    with pytest.raises(ValueError, match="not both"):
        ds.shard_ranges(n_shards=2, rows_per_shard=100)
    with pytest.raises(ValueError):
        ds.shard_ranges(n_shards=0)
    with pytest.raises(ValueError):
        ds.shard_ranges(rows_per_shard=0)


# --------------------------------------------------------------------------- generators


def _spy_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record (start, rows) of every X write, with one chunk per write."""
    real = data_write._write_block
    log: list[tuple[int, int]] = []

    def spy(array, start, values):
        if values.ndim == 2:
            log.append((start, values.shape[0]))
        real(array, start, values)

    monkeypatch.setattr(data_write, "_write_block", spy)
    monkeypatch.setattr(data_write, "_WORK_BLOCK_BYTES", 1)
    return log


def test_make_logistic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _spy_writes(monkeypatch)
    ds = make_logistic(tmp_path / "l", 5000, 6, seed=1, chunk_rows=700)
    assert (ds.n_rows, ds.n_features, ds.task, ds.n_classes) == (5000, 6, "binary", 2)
    # written chunk by chunk, each chunk once
    assert log == [(s, min(700, 5000 - s)) for s in range(0, 5000, 700)]
    X, y = ds.read()
    theta = np.array(ds.attrs["true_theta"])
    assert theta.shape == (6,)
    assert np.all(X[:, 0] == 1.0)
    assert set(np.unique(y)) == {0, 1}
    assert 0.2 < y.mean() < 0.8  # not trivial
    # labels agree with the true logit most, but not all, of the time (not separable)
    agree = np.mean((X @ theta > 0) == (y == 1))
    assert 0.6 < agree < 0.9
    assert ds.attrs["generator"] == "make_logistic" and ds.feature_names[0] == "bias"


def test_generators_deterministic_and_chunk_independent(tmp_path: Path) -> None:
    n = 40_000  # crosses a generation block boundary (2**15 rows)
    a = make_robust(tmp_path / "a", n, 3, seed=5, chunk_rows=999)
    b = make_robust(tmp_path / "b", n, 3, seed=5, chunk_rows=4096)
    c = make_robust(tmp_path / "c", n, 3, seed=6, chunk_rows=999)
    Xa, ya = a.read()
    Xb, yb = b.read()
    np.testing.assert_array_equal(Xa, Xb)
    np.testing.assert_array_equal(ya, yb)
    assert a.attrs["true_theta"] == b.attrs["true_theta"]
    assert not np.array_equal(ya, c.read()[1])
    s1 = make_softmax(tmp_path / "s1", 300, 4, 3, seed=2, chunk_rows=7)
    s2 = make_softmax(tmp_path / "s2", 300, 4, 3, seed=2, chunk_rows=300)
    np.testing.assert_array_equal(s1.read()[1], s2.read()[1])


def test_make_softmax(tmp_path: Path) -> None:
    ds = make_softmax(tmp_path / "s", 3000, 5, 4, seed=0)
    assert (ds.task, ds.n_classes, ds.n_features) == ("multiclass", 4, 5)
    X, y = ds.read()
    assert y.dtype == np.int64 and set(np.unique(y)) == {0, 1, 2, 3}
    theta = np.array(ds.attrs["true_theta"])
    assert theta.shape == (4, 5)
    # the true model predicts better than chance but is far from perfect
    acc = np.mean(np.argmax(X @ theta.T, axis=1) == y)
    assert 0.35 < acc < 0.95


def test_make_robust_heavy_tails(tmp_path: Path) -> None:
    ds = make_robust(tmp_path / "r", 20_000, 4, seed=0)
    assert ds.task == "real" and ds.n_classes is None and ds.attrs["nu"] == 4.0
    X, y = ds.read()
    r = y - X @ np.array(ds.attrs["true_theta"])
    kurt = np.mean((r - r.mean()) ** 4) / np.var(r) ** 2
    assert kurt > 4.0  # Student-t(4) noise: far heavier tails than Gaussian (3)
    assert abs(np.median(r)) < 0.05


def test_make_glm_draws_each_family(tmp_path: Path) -> None:
    """Probit labels and negative-binomial counts from the true weights: the probit
    labels' rate per bin of η is Φ(η), the counts' mean e^η and variance μ + μ²/r
    (moments of 40,000 rows against their standard errors); the same rows for any
    chunking; a Poisson-like wrong variance fails the variance check."""
    from scipy.special import ndtr

    n = 40_000  # crosses a generation block boundary
    pr = make_glm(tmp_path / "p", n, 3, family="probit", seed=4, chunk_rows=999)
    assert (pr.task, pr.attrs["generator"], pr.attrs["family"]) == ("binary", "make_glm", "probit")
    X, y = pr.read()
    p = ndtr(X @ np.array(pr.attrs["true_theta"]))
    assert abs(np.sum(y - p)) / np.sqrt(np.sum(p * (1 - p))) < 4
    again = make_glm(tmp_path / "p2", n, 3, family="probit", seed=4, chunk_rows=4096)
    np.testing.assert_array_equal(y, again.read()[1])
    nb = make_glm(tmp_path / "nb", n, 3, family="negative_binomial", seed=4, dispersion=2.0)
    assert nb.task == "count" and nb.attrs["dispersion"] == 2.0
    X, y = nb.read()
    mu = np.exp(X @ np.array(nb.attrs["true_theta"]))
    var = mu + mu**2 / 2.0
    assert abs(np.sum(y - mu)) / np.sqrt(np.sum(var)) < 4
    # E[(y - μ)²] = var: its sum against its spread (the fourth moment, from the draws)
    dev = (y - mu) ** 2
    assert abs(np.sum(dev - var)) / np.sqrt(np.sum((dev - var) ** 2)) < 4
    assert abs(np.sum(dev - mu)) / np.sqrt(np.sum((dev - mu) ** 2)) > 8  # not Poisson
    with pytest.raises(ValueError, match="family must be one of"):
        make_glm(tmp_path / "x", 10, 2, family="poisson")


def test_make_opv_like_small(tmp_path: Path) -> None:
    ds = make_opv_like(tmp_path / "o", n_rows=20_000, seed=0)
    assert ds.shape == (20_000, 57) and ds.task == "real"
    X, _ = ds.read()
    assert np.all(X[:, 0] == 1.0)
    sd = X[:, 1:].std(axis=0)
    np.testing.assert_allclose(sd, 1.0, atol=0.05)  # standardised
    C = np.corrcoef(X[:, 1:], rowvar=False)
    off = np.abs(C[~np.eye(56, dtype=bool)])
    assert off.max() > 0.3  # correlated features


@pytest.mark.parametrize(
    ("fn", "kwargs", "match"),
    [
        (make_logistic, dict(n_rows=0, n_features=3), "n_rows"),
        (make_logistic, dict(n_rows=10, n_features=0), "n_features"),
        (make_logistic, dict(n_rows=10, n_features=2, seed=-1), "seed"),
        (make_softmax, dict(n_rows=10, n_features=2, n_classes=1), "n_classes"),
        (make_robust, dict(n_rows=10.5, n_features=2), "n_rows"),
        (make_robust, dict(n_rows=10, n_features=2, nu=0.0), "nu"),
        (make_logistic, dict(n_rows=10, n_features=2, chunk_rows=0), "chunk_rows"),
    ],
)
def test_generator_argument_errors(tmp_path: Path, fn, kwargs: dict, match: str) -> None:
    path = tmp_path / "g"
    with pytest.raises(ValueError, match=match):
        fn(path, **kwargs)
    assert_nothing_written(path)


def test_generator_existing_path(tmp_path: Path) -> None:
    make_logistic(tmp_path / "g", 10, 2)
    with pytest.raises(FileExistsError):
        make_logistic(tmp_path / "g", 10, 2)
    assert make_logistic(tmp_path / "g", 20, 2, overwrite=True).n_rows == 20


# --------------------------------------------------------------------------- ingest


def test_ingest_npy(tmp_path: Path) -> None:
    X, y = _xy(40, 3, "binary")
    A = np.column_stack([X, y])
    np.save(tmp_path / "a.npy", A)
    ds = ingest(tmp_path / "a.npy", tmp_path / "a.zarr", chunk_rows=16)
    assert ds.task == "binary" and ds.chunk_rows == 16
    np.testing.assert_array_equal(ds.read()[0], X)
    np.testing.assert_array_equal(ds.read()[1], y)
    B = np.column_stack([X[:, :1], y, X[:, 1:]])
    np.save(tmp_path / "b.npy", B)
    ds = ingest(tmp_path / "b.npy", tmp_path / "b.zarr", target=1, task="real")
    np.testing.assert_array_equal(ds.read()[0], X)
    assert ds.task == "real"
    ds = ingest(tmp_path / "a.npy", tmp_path / "c.zarr", target=0)
    np.testing.assert_array_equal(ds.read()[1], X[:, 0])


def test_ingest_npz(tmp_path: Path) -> None:
    X, y = _xy(40, 3, "multiclass")
    np.savez(tmp_path / "a.npz", X=X, y=y, feature_names=np.array(["p", "q", "r"]))
    ds = ingest(tmp_path / "a.npz", tmp_path / "a.zarr")
    assert ds.task == "multiclass" and ds.feature_names == ["p", "q", "r"]
    np.testing.assert_array_equal(ds.read()[0], X)


def test_ingest_csv(tmp_path: Path) -> None:
    src = tmp_path / "a.csv"
    src.write_text("x1,label,x2\n1.5,0,2\n-1,1,3e2\n\n0,1,4\n")
    ds = ingest(src, tmp_path / "a.zarr", target="label")
    assert ds.task == "binary" and ds.feature_names == ["x1", "x2"]
    np.testing.assert_array_equal(ds.read()[0], [[1.5, 2], [-1, 300], [0, 4]])
    np.testing.assert_array_equal(ds.read()[1], [0, 1, 1])
    ds = ingest(src, tmp_path / "b.zarr")  # default: last column
    assert ds.task == "multiclass" and ds.feature_names == ["x1", "label"]


def test_ingest_csv_without_header_keeps_its_first_row(tmp_path: Path) -> None:
    """A first line of numbers only is data (the columns are then unnamed)."""
    src = tmp_path / "noheader.csv"
    rows = np.column_stack([np.arange(50) / 7, np.arange(50) % 2])
    src.write_text("".join(f"{float(a)!r},{int(b)}\n" for a, b in rows))
    ds = ingest(src, tmp_path / "a.zarr")
    assert ds.n_rows == 50 and ds.feature_names is None and ds.task == "binary"
    np.testing.assert_array_equal(ds.read()[0][:, 0], rows[:, 0])
    ds = ingest(src, tmp_path / "b.zarr", target=0)  # an index: there are no names
    np.testing.assert_array_equal(ds.read()[1], rows[:, 0])
    with pytest.raises(ValueError, match="no header row.*column index"):
        ingest(src, tmp_path / "c.zarr", target="label")
    assert_nothing_written(tmp_path / "c.zarr")


def test_ingest_errors(tmp_path: Path) -> None:
    out = tmp_path / "out.zarr"
    with pytest.raises(FileNotFoundError, match="not found"):
        ingest(tmp_path / "nope.npy", out)
    (tmp_path / "a.txt").write_text("1,2\n")
    with pytest.raises(ValueError, match="unknown extension"):
        ingest(tmp_path / "a.txt", out)
    np.save(tmp_path / "one_d.npy", np.ones(5))
    with pytest.raises(ValueError, match="2-D"):
        ingest(tmp_path / "one_d.npy", out)
    np.save(tmp_path / "one_col.npy", np.ones((5, 1)))
    with pytest.raises(ValueError, match="at least 2 columns"):
        ingest(tmp_path / "one_col.npy", out)
    np.save(tmp_path / "ok.npy", np.ones((5, 3)))
    with pytest.raises(ValueError, match="out of range"):
        ingest(tmp_path / "ok.npy", out, target=3)
    nan = np.ones((5, 3))
    nan[2, 1] = np.nan
    np.save(tmp_path / "nan.npy", nan)
    with pytest.raises(ValueError, match="nan.npy' row 2, column '1'"):
        ingest(tmp_path / "nan.npy", out)
    np.savez(tmp_path / "bad.npz", X=np.ones((3, 2)))
    with pytest.raises(ValueError, match="missing \\['y'\\]"):
        ingest(tmp_path / "bad.npz", out)
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n3,oops\n")
    with pytest.raises(ValueError, match="line 3, column 'b'"):
        ingest(tmp_path / "bad.csv", out)
    (tmp_path / "ragged.csv").write_text("a,b\n1,2\n3\n")
    with pytest.raises(ValueError, match="2 fields|1 fields"):
        ingest(tmp_path / "ragged.csv", out)
    with pytest.raises(ValueError, match="not in the columns"):
        ingest(tmp_path / "bad.csv", out, target="zzz")
    (tmp_path / "nan.csv").write_text("a,b\n1,2\nnan,3\n")
    with pytest.raises(ValueError, match="nan.csv' data row 1, column 'a'"):
        ingest(tmp_path / "nan.csv", out)
    (tmp_path / "empty.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="empty"):
        ingest(tmp_path / "empty.csv", out)
    with pytest.raises(ValueError, match="n_classes >= 2"):
        ingest(tmp_path / "ok.npy", out, task="multiclass", n_classes=1)
    np.save(tmp_path / "lab.npy", np.column_stack([np.ones(4), [0, 1, 2, 1]]))
    with pytest.raises(ValueError, match=r"lab.npy' row 2, column '1': label 2.0 is not in 0..1"):
        ingest(tmp_path / "lab.npy", out, task="binary")
    assert_nothing_written(out)


# --------------------------------------------------------------------------- float32 storage


def test_float32_round_trip(tmp_path: Path) -> None:
    """float32 storage: X rounded once, read back as float64 by every reader; y untouched."""
    X, y = _xy(103, 4, "real")
    X[5, 2] = 1e-3 + 1e-12  # not a float32 value
    ds = from_numpy(X, y, tmp_path / "d.zarr", chunk_rows=10, dtype="float32")
    X32 = X.astype(np.float32).astype(np.float64)
    for d in (ds, open_dataset(tmp_path / "d.zarr"), pickle.loads(pickle.dumps(ds))):
        assert d.dtype == np.float32 and d.attrs["dtype"] == "float32"
        Xr, yr = d.read()
        assert Xr.dtype == np.float64 and Xr.flags.c_contiguous
        np.testing.assert_array_equal(Xr, X32)
        np.testing.assert_array_equal(yr, y)  # y keeps float64
        assert yr.dtype == np.float64
        Xs, ys = d.read_rows([0, 5, 5, 99])
        assert Xs.dtype == np.float64
        np.testing.assert_array_equal(Xs, X32[[0, 5, 5, 99]])
        np.testing.assert_array_equal(ys, y[[0, 5, 5, 99]])
        pieces = list(d.iter_chunks())
        assert all(p[2].dtype == np.float64 for p in pieces)
        np.testing.assert_array_equal(np.concatenate([p[2] for p in pieces]), X32)
    assert "dtype='float32'" in repr(ds)
    g = zarr.open_group(str(tmp_path / "d.zarr"), mode="r")
    assert g["X"].dtype == np.float32 and g["y"].dtype == np.float64
    assert np.isnan(g["X"].fill_value)
    # the default stays float64, bit for bit, and says so
    ds64 = from_numpy(X, y, tmp_path / "e.zarr", chunk_rows=10)
    assert ds64.dtype == np.float64 and ds64.attrs["dtype"] == "float64"
    np.testing.assert_array_equal(ds64.read()[0], X)
    assert "dtype" not in repr(ds64)
    # from_blocks with uneven blocks (rows buffered into whole chunks) rounds the same way
    blocks = ((X[s : s + 7], y[s : s + 7]) for s in range(0, 103, 7))
    dsb = from_blocks(blocks, tmp_path / "f.zarr", 103, 4, task="real", chunk_rows=10,
                      dtype="float32")  # fmt: skip
    assert dsb.dtype == np.float32
    np.testing.assert_array_equal(dsb.read()[0], X32)
    # labels keep int64 under float32 X
    Xb, yb = _xy(30, 3, "binary")
    dsb = from_numpy(Xb, yb, tmp_path / "b.zarr", dtype=np.float32)
    assert dsb.dtype == np.float32 and dsb.read()[1].dtype == np.int64
    assert_clean(tmp_path / "d.zarr")


def test_a_store_of_an_earlier_release_is_refused_saying_so(tmp_path: Path) -> None:
    """A store that records no store id or no dtype (written by an earlier release) is
    refused in one line saying to write it again; a dtype that contradicts the array too."""
    X, y = _xy(20, 3)
    for missing in ("dtype", "store_id"):
        path = tmp_path / f"{missing}.zarr"
        from_numpy(X, y, path, dtype="float32")
        g = zarr.open_group(str(path), mode="r+")
        attrs = dict(g.attrs)
        del attrs[missing]
        g.attrs.put(attrs)
        with pytest.raises(ValueError, match="written by an earlier flymc_dist release") as e:
            open_dataset(path)
        assert "\n" not in str(e.value)
    path = tmp_path / "contradicts.zarr"
    from_numpy(X, y, path, dtype="float32")
    zarr.open_group(str(path), mode="r+").attrs["dtype"] = "float64"
    with pytest.raises(ValueError, match="stored as float32 but the attributes declare"):
        open_dataset(path)


@pytest.mark.parametrize("bad", ["float16", "int32", "complex128", True, None, "double2"])
def test_bad_dtype_writes_nothing(tmp_path: Path, bad: object) -> None:
    X, y = _xy(20, 3)
    with pytest.raises(ValueError, match="dtype must be 'float64' or 'float32'"):
        from_numpy(X, y, tmp_path / "d.zarr", dtype=bad)
    with pytest.raises(ValueError, match="dtype must be"):
        make_logistic(tmp_path / "d.zarr", 10, 2, dtype=bad)
    assert_nothing_written(tmp_path / "d.zarr")


def test_float32_overflow_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    """A value finite in float64 but too large for float32 names its row and column, and
    no store (nor a temporary one) is left; an existing store is kept."""
    X, y = _xy(103, 4)
    X[57, 2] = -4e38
    X[80, 1] = 1e60
    path = tmp_path / "d.zarr"
    match = r"too large for dtype float32.*first at row 57, column 2"
    with pytest.raises(ValueError, match=match):
        from_numpy(X, y, path, chunk_rows=10, dtype="float32")
    assert_nothing_written(path)
    # float32's own max rounds to itself: accepted; float64 storage accepts 4e38 too
    ok = X.copy()
    ok[57, 2], ok[80, 1] = np.finfo(np.float32).max, -np.finfo(np.float32).max
    assert from_numpy(ok, y, path, dtype="float32").read()[0][57, 2] == ok[57, 2]
    np.testing.assert_array_equal(
        from_numpy(X, y, tmp_path / "f64.zarr", dtype="float64").read()[0], X
    )
    # overwrite keeps the old store when the new data do not fit
    before = open_dataset(path).fingerprint()
    with pytest.raises(ValueError, match=match):
        from_numpy(X, y, path, chunk_rows=10, dtype="float32", overwrite=True)
    assert open_dataset(path).fingerprint() == before
    assert_clean(path)
    # from_blocks: found in the block that holds it (global row), after earlier blocks
    # were written to the temporary store, which is removed
    blocks = ((X[s : s + 20], y[s : s + 20]) for s in range(0, 103, 20))
    with pytest.raises(ValueError, match=match):
        from_blocks(blocks, tmp_path / "b.zarr", 103, 4, task="real", chunk_rows=10,
                    dtype="float32")  # fmt: skip
    assert_nothing_written(tmp_path / "b.zarr")
    # ingest
    np.save(tmp_path / "a.npy", np.column_stack([X, y]))
    with pytest.raises(ValueError, match=match):
        ingest(tmp_path / "a.npy", tmp_path / "i.zarr", dtype="float32")
    assert_nothing_written(tmp_path / "i.zarr")


def test_default_chunk_rows_counts_stored_bytes(tmp_path: Path) -> None:
    # float64 chunking is what it was (no itemsize = 8), float32 holds twice the rows
    for d in (1, 3, 57, 1000):
        assert fdata.default_chunk_rows(10**8, d) == fdata.DEFAULT_CHUNK_BYTES // (8 * d)
        assert fdata.default_chunk_rows(10**8, d, 8) == fdata.default_chunk_rows(10**8, d)
        assert fdata.default_chunk_rows(10**8, d, 4) == fdata.DEFAULT_CHUNK_BYTES // (4 * d)
    cr = fdata.default_chunk_rows(10**7, 57, 4)
    assert abs(cr * 57 * 4 - 8 * 2**20) <= 57 * 4
    assert fdata.default_chunk_rows(10, 57, 4) == 10
    with pytest.raises(ValueError, match="itemsize"):
        fdata.default_chunk_rows(10, 5, 0)
    # the writers use it: D = 8192 gives 128 rows (float64) and 256 rows (float32)
    X = np.zeros((300, 8192))
    y = np.zeros(300)
    assert from_numpy(X, y, tmp_path / "a", dtype="float64").chunk_rows == 128
    assert from_numpy(X, y, tmp_path / "b", dtype="float32").chunk_rows == 256
    ds = make_logistic(tmp_path / "c", 300, 8192, dtype="float32")
    assert ds.chunk_rows == 256 and ds.n_chunks == 2


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        (make_logistic, (700, 4)),
        (make_softmax, (700, 4, 3)),
        (make_robust, (700, 4)),
        (make_opv_like, (700, 6)),
    ],
)
def test_generators_with_dtype(tmp_path: Path, fn, args: tuple) -> None:
    """float32 generators draw the same features, rounded once; the targets are drawn given
    the rounded features with the same random numbers; float64 is unchanged."""
    d64 = fn(tmp_path / "a", *args, seed=3, chunk_rows=100)
    d32 = fn(tmp_path / "b", *args, seed=3, chunk_rows=100, dtype="float32")
    dflt = fn(tmp_path / "c", *args, seed=3, chunk_rows=100, dtype="float64")
    assert d64.dtype == dflt.dtype == np.float64 and d32.dtype == np.float32
    X64, y64 = d64.read()
    X32, y32 = d32.read()
    np.testing.assert_array_equal(dflt.read()[0], X64)
    np.testing.assert_array_equal(dflt.read()[1], y64)
    np.testing.assert_array_equal(X32, X64.astype(np.float32).astype(np.float64))
    assert d32.attrs["true_theta"] == d64.attrs["true_theta"]
    assert y32.dtype == y64.dtype
    if d64.task == "real":
        theta = np.asarray(d64.attrs["true_theta"])
        np.testing.assert_allclose(y32 - X32 @ theta, y64 - X64 @ theta, rtol=0, atol=1e-12)
    else:  # labels flip only where the rounding moved a uniform across its threshold
        assert np.mean(y32 != y64) < 0.01


def test_cli_dtype(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flymc_dist.cli import main

    out = tmp_path / "m.zarr"
    args = ["make-data", str(out), "--like", "logistic", "--rows", "500", "--features", "3"]
    assert main([*args, "--dtype", "float32"]) == 0
    assert "float32" in capsys.readouterr().out
    ds = open_dataset(out)
    assert ds.dtype == np.float32
    ref = make_logistic(tmp_path / "r.zarr", 500, 3, dtype="float32")
    np.testing.assert_array_equal(ds.read()[0], ref.read()[0])
    assert main(["make-data", str(tmp_path / "d.zarr"), *args[2:]]) == 0
    assert open_dataset(tmp_path / "d.zarr").dtype == np.float64  # the default
    capsys.readouterr()
    assert main([*args, "--dtype", "float16", "--overwrite"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    # ingest: --dtype float32, and an overflow is one error line with nothing written
    X, y = _xy(40, 3)
    np.save(tmp_path / "a.npy", np.column_stack([X, y]))
    assert main(["ingest", str(tmp_path / "a.npy"), str(tmp_path / "i.zarr"),
                 "--dtype", "float32"]) == 0  # fmt: skip
    assert open_dataset(tmp_path / "i.zarr").dtype == np.float32
    X[7, 1] = 1e39
    np.save(tmp_path / "b.npy", np.column_stack([X, y]))
    capsys.readouterr()
    assert main(["ingest", str(tmp_path / "b.npy"), str(tmp_path / "j.zarr"),
                 "--dtype", "float32"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "row 7, column 1" in err and "Traceback" not in err
    assert_nothing_written(tmp_path / "j.zarr")


# --------------------------------------------------------------------------- read_rows


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_read_rows_matches_read(tmp_path: Path, dtype: str) -> None:
    """read_rows(idx) == read(0, n)[idx] for duplicates, chunk boundaries, first and last
    rows, runs of consecutive chunks and gaps."""
    X, y = _xy(1003, 5, "multiclass", seed=4)
    ds = from_numpy(X, y, tmp_path / "d.zarr", chunk_rows=50, dtype=dtype)
    Xa, ya = ds.read(0, ds.n_rows)
    rng = np.random.default_rng(0)
    cases = [
        np.array([0]),
        np.array([1002]),
        np.array([0, 0, 49, 49, 50, 99, 100, 100, 149, 150, 999, 1000, 1002, 1002]),
        np.arange(1003),
        np.arange(40, 260),  # chunks 0..5, one run
        np.array([10, 260, 261, 730, 731, 731, 732]),  # runs with gaps between them
        np.sort(rng.integers(0, 1003, 300)),  # duplicates likely
        np.sort(rng.integers(500, 650, 40)),
    ]
    for idx in cases:
        X, y = ds.read_rows(idx)
        assert X.dtype == np.float64 and X.flags.c_contiguous and y.dtype == ya.dtype
        np.testing.assert_array_equal(X, Xa[idx])
        np.testing.assert_array_equal(y, ya[idx])
    X, y = ds.read_rows(np.array([3, 4], dtype=np.uint16))  # any integer dtype
    np.testing.assert_array_equal(X, Xa[[3, 4]])


def test_values_whose_powers_overflow_are_refused_naming_row_and_column(tmp_path: Path) -> None:
    """X[100, 1] = 1e300 is finite, but a run sums x² and x⁴ of every column over the rows:
    every writer refuses it at write time, naming its row and column and the limit, and
    writes nothing (#28 item 8); a value just within the limit is written."""
    X, y = _xy(300, 3, "binary")
    X[100, 1] = 1e300
    X[200, 2] = -1e200
    match = r"too large to compute with: first at row 100, column 1 \(value 1e\+300\)"
    with pytest.raises(ValueError, match=match) as info:
        from_numpy(X, y, tmp_path / "d.zarr", chunk_rows=50)
    assert f"{magnitude_limit(300):.3g}" in str(info.value) and "\n" not in str(info.value)
    assert_nothing_written(tmp_path / "d.zarr")
    blocks = ((X[s : s + 64], y[s : s + 64]) for s in range(0, 300, 64))
    with pytest.raises(ValueError, match=match):
        from_blocks(blocks, tmp_path / "b.zarr", 300, 3, task="binary", chunk_rows=50)
    assert_nothing_written(tmp_path / "b.zarr")
    np.save(tmp_path / "a.npy", np.column_stack([X, y]))
    with pytest.raises(ValueError, match=match):
        ingest(tmp_path / "a.npy", tmp_path / "i.zarr")
    assert_nothing_written(tmp_path / "i.zarr")
    ok = X.copy()
    ok[100, 1], ok[200, 2] = magnitude_limit(300), -magnitude_limit(300)
    assert from_numpy(ok, y, tmp_path / "ok.zarr").read()[0][100, 1] == ok[100, 1]
    with np.errstate(over="raise"):  # what a run sums stays finite
        assert np.isfinite((ok**4).sum(axis=0)).all()
