"""Ingest from where users keep data: CSV (streamed; byte-order marks, encodings, names),
``.npy`` by row ranges, Parquet (files, directories, S3), Dask collections and foreign zarr
arrays, in one process and on a cluster's workers. Every path writes the store
``from_numpy`` writes for the same rows: the same bytes of X and y, the same attributes."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flymc_dist as fd

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ingest_module = importlib.import_module("flymc_dist.data.ingest")


# --------------------------------------------------------------------------- helpers


def _data(n: int = 1000, d: int = 4, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = (rng.random(n) < 0.4).astype(np.int64)
    return X, y


def _files(path: Path) -> dict[str, bytes]:
    """Every file of a local store by relative path (the root zarr.json's attributes apart)."""
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = Path(root) / name
            rel = str(full.relative_to(path))
            if rel != "zarr.json":
                out[rel] = full.read_bytes()
    return out


def _attrs(path: Path) -> dict:
    attrs = json.loads((path / "zarr.json").read_text())["attributes"]
    attrs.pop("store_id")
    return attrs


def assert_same_store(a: fd.Dataset, b: fd.Dataset) -> None:
    """The bytes of X and y (every chunk, every array's metadata) and the attributes
    (but the random store_id) of two local stores are equal."""
    path_a, path_b = Path(a.path), Path(b.path)
    fa, fb = _files(path_a), _files(path_b)
    assert sorted(fa) == sorted(fb)
    assert any(k.startswith("X/c") for k in fa)
    for k in fa:
        assert fa[k] == fb[k], k
    assert _attrs(path_a) == _attrs(path_b)


def _nothing_at(path: Path) -> None:
    assert not path.exists()
    assert [p for p in os.listdir(path.parent) if p.startswith(f".{path.name}.flymc-")] == []


def _write_parquet_dir(X, y, where: Path, names, splits=(0, 300, 700), group=128) -> Path:
    where.mkdir()
    bounds = [*splits, len(y)]
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        cols = {n: X[s:e, j] for j, n in enumerate(names)}
        cols["label"] = y[s:e]
        pq.write_table(pa.table(cols), where / f"part-{i:02d}.parquet", row_group_size=group)
    (where / "_SUCCESS").write_text("")
    return where


#: ``parallel``: without a client, then with the session's 2-worker cluster (the client
#: fixture, taken by the test: marked cluster so that it runs in the process group, on the
#: xdist worker that holds the shared clusters, not on another that would start its own)
PARALLEL = [False, pytest.param(True, marks=pytest.mark.cluster)]


@pytest.fixture(scope="module")
def client(local_clusters):
    from distributed import Client

    with Client(local_clusters.get(2)) as c:
        yield c


# --------------------------------------------------------------------------- CSV


def _write_csv(path: Path, X, y, header: list[str] | None, bom: bool = False) -> None:
    lines = [] if header is None else [",".join(header)]
    lines += [
        ",".join([*(repr(float(v)) for v in row), str(int(t))]) for row, t in zip(X, y, strict=True)
    ]
    text = "\n".join(lines) + "\n"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())


@pytest.mark.parametrize("bom", [False, True])
@pytest.mark.parametrize("header", [True, False])
def test_csv_with_or_without_bom_is_the_from_numpy_store(tmp_path, bom, header) -> None:
    X, y = _data(700)
    names = ["a", "b", "c", "d", "label"] if header else None
    _write_csv(tmp_path / "s.csv", X, y, names, bom=bom)
    got = fd.ingest(tmp_path / "s.csv", tmp_path / "got.zarr", chunk_rows=64)
    ref = fd.from_numpy(
        X, y, tmp_path / "ref.zarr", chunk_rows=64, feature_names=names[:-1] if names else None
    )
    assert got.n_rows == 700  # the first row is kept behind a mark
    assert got.feature_names == (["a", "b", "c", "d"] if header else None)
    assert_same_store(got, ref)


def test_csv_refusals_name_the_file_and_line(tmp_path) -> None:
    out = tmp_path / "out.zarr"
    (tmp_path / "latin.csv").write_bytes("a,b\n1,0\n2,1\ncaf\xe9,1\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.csv' line 4 is not UTF-8.*0xe9") as info:
        fd.ingest(tmp_path / "latin.csv", out)
    assert "\n" not in str(info.value)
    (tmp_path / "latinh.csv").write_bytes("caf\xe9,b\n1,0\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latinh\.csv' line 1 is not UTF-8"):
        fd.ingest(tmp_path / "latinh.csv", out)
    (tmp_path / "dup.csv").write_text("a,b,a,y\n1,2,3,0\n")
    with pytest.raises(ValueError, match=r"dup\.csv' header: column name\(s\) \['a'\]"):
        fd.ingest(tmp_path / "dup.csv", out)
    (tmp_path / "dupy.csv").write_text("a,y,y\n1,0,1\n")
    with pytest.raises(ValueError, match=r"\['y'\] appear more than once"):
        fd.ingest(tmp_path / "dupy.csv", out, target="y")
    (tmp_path / "late.csv").write_bytes(b"a,b\n" + b"1,0\n" * 5000 + b"1,x\n")
    with pytest.raises(ValueError, match=r"late\.csv' line 5002, column 'b': non-numeric"):
        fd.ingest(tmp_path / "late.csv", out)
    _nothing_at(out)


def test_csv_categorical_and_standardized(tmp_path) -> None:
    rng = np.random.default_rng(0)
    n = 400
    carrier = rng.choice(["AA", "DL", "UA"], n)
    dist = rng.gamma(3.0, 200.0, n)
    y = (rng.random(n) < 0.3).astype(int)
    lines = ["dist,carrier,late"] + [
        f"{float(d)!r},{c},{t}" for d, c, t in zip(dist, carrier, y, strict=True)
    ]
    (tmp_path / "f.csv").write_text("\n".join(lines) + "\n")
    ds = fd.ingest(
        tmp_path / "f.csv",
        tmp_path / "f.zarr",
        target="late",
        categorical=["carrier"],
        standardize=True,
    )
    assert ds.feature_names == ["dist", "carrier[DL]", "carrier[UA]"]
    X, yy = ds.read()
    np.testing.assert_array_equal(yy, y)
    np.testing.assert_allclose(X[:, 0], (dist - dist.mean()) / dist.std(), atol=1e-12)
    np.testing.assert_array_equal(X[:, 1], carrier == "DL")
    np.testing.assert_array_equal(X[:, 2], carrier == "UA")
    design = ds.attrs["design"]
    assert design["categorical"] == {"carrier": ["AA", "DL", "UA"]}
    assert design["center"][1:] == [0.0, 0.0] and design["scale"][1:] == [1.0, 1.0]


@pytest.mark.slow
@pytest.mark.full_scale
def test_peak_memory_of_a_csv_ingest_does_not_grow_with_the_file(tmp_path) -> None:
    """A 20 MB and an 80 MB CSV, read, converted and written in 4 MiB blocks: the peak RSS
    of a fresh process grows by a small fraction of the 60 MB between them (the old reader
    held a file as Python floats: 7× its size). With the default 32 MiB blocks the same
    holds beyond ~250 MB (three write buffers of 32 MiB are the floor)."""
    rng = np.random.default_rng(1)
    d = 16
    X = rng.normal(size=(20_000, d))
    y = rng.integers(0, 2, 20_000)
    block = "".join(
        ",".join([*(repr(float(v)) for v in row), str(int(t))]) + "\n"
        for row, t in zip(X, y, strict=True)
    ).encode()
    header = (",".join([f"x{j}" for j in range(d)] + ["y"]) + "\n").encode()
    code = (
        "import resource, sys, flymc_dist as fd, pyarrow.csv; "
        "w = sys.modules['flymc_dist.data.write']; i = sys.modules['flymc_dist.data.ingest']; "
        "w._WORK_BLOCK_BYTES = i._BLOCK_BYTES = 2**22; i._CSV_BLOCK_BYTES = 2**21; {}"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def peak(body: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", code.format(body)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        return int(out.stdout.split()[-1])

    base = peak("")
    sizes, peaks = [], []
    for mb in (20, 80):
        src = tmp_path / f"big{mb}.csv"
        with open(src, "wb") as fh:
            fh.write(header)
            for _ in range(-(-mb * 2**20 // len(block))):
                fh.write(block)
        sizes.append(src.stat().st_size)
        out = tmp_path / f"big{mb}.zarr"
        peaks.append(peak(f"fd.ingest({str(src)!r}, {str(out)!r}, chunk_rows=4096); "))
        assert fd.open_dataset(out).n_rows == (sizes[-1] - len(header)) // len(block) * 20_000
        src.unlink()
    for size, p in zip(sizes, peaks, strict=True):
        print(
            f"CSV {size / 1e6:.0f} MB: peak RSS {p / 1e6:.0f} MB ({base / 1e6:.0f} MB after "
            f"the imports), {(p - base) / size:.2f}x the file above that"
        )
    assert peaks[1] - peaks[0] < 0.15 * (sizes[1] - sizes[0])


# --------------------------------------------------------------------------- .npy


def test_npy_by_row_ranges_is_the_from_numpy_store(tmp_path) -> None:
    X, y = _data(900)
    np.save(tmp_path / "a.npy", np.column_stack([X[:, :2], y, X[:, 2:]]))
    got = fd.ingest(tmp_path / "a.npy", tmp_path / "got.zarr", target=2, chunk_rows=100)
    ref = fd.from_numpy(X, y, tmp_path / "ref.zarr", chunk_rows=100)
    assert_same_store(got, ref)


# --------------------------------------------------------------------------- Parquet


@pytest.mark.parametrize("parallel", PARALLEL)
def test_parquet_directory_is_the_from_numpy_store(tmp_path, parallel, request) -> None:
    X, y = _data(1000)
    names = ["a", "b", "c", "d"]
    src = _write_parquet_dir(X, y, tmp_path / "src", names)
    client = request.getfixturevalue("client") if parallel else None
    got = fd.from_parquet(src, tmp_path / "got.zarr", target="label", chunk_rows=96, client=client)
    ref = fd.from_numpy(X, y, tmp_path / "ref.zarr", chunk_rows=96, feature_names=names)
    assert_same_store(got, ref)
    # the default chunking is from_numpy's too, and a single file reads as a directory does
    pq.write_table(
        pa.table({**{n: X[:, j] for j, n in enumerate(names)}, "label": y}),
        tmp_path / "one.parquet",
    )
    got = fd.ingest(tmp_path / "one.parquet", tmp_path / "one.zarr", client=client)
    ref = fd.from_numpy(X, y, tmp_path / "ref1.zarr", feature_names=names)
    assert_same_store(got, ref)
    # float32 storage: the values rounded once, as from_numpy rounds them
    kw = {"chunk_rows": 96, "dtype": "float32"}
    got = fd.from_parquet(src, tmp_path / "got32.zarr", target="label", client=client, **kw)
    ref = fd.from_numpy(X, y, tmp_path / "ref32.zarr", feature_names=names, **kw)
    assert_same_store(got, ref)


@pytest.mark.parametrize(  # on the workers: in the full suite only (the pieces are the same)
    "parallel", [False, pytest.param(True, marks=[pytest.mark.cluster, pytest.mark.slow])]
)
def test_parquet_pieces_across_row_groups_are_the_from_numpy_store(
    tmp_path, parallel, request, monkeypatch
) -> None:
    """Blocks of 100 rows (the block size cut down) against row groups of 70 and chunks of
    96: pieces start at row groups rounded up to chunks, batches are sliced across group
    and file boundaries, and the store is still from_numpy's, byte for byte."""
    monkeypatch.setattr(ingest_module, "_BLOCK_BYTES", 100 * 8 * 5)
    X, y = _data(1000)
    names = ["a", "b", "c", "d"]
    src = _write_parquet_dir(X, y, tmp_path / "src", names, group=70)
    table = ingest_module._ParquetTable(str(src), None)
    starts = table.piece_starts(96)
    assert starts[0] == 0 and len(starts) > 3 and all(s % 96 == 0 for s in starts)
    assert all(b - a >= 100 for a, b in zip(starts[:-1], starts[1:], strict=True))
    blocks = list(table.read_blocks(250, 777, ["a", "label"]))
    assert [off for off, _ in blocks][0] == 250
    got_a = np.concatenate([np.asarray(c["a"]) for _, c in blocks])
    np.testing.assert_array_equal(got_a, X[250:777, 0])
    client = request.getfixturevalue("client") if parallel else None
    got = fd.from_parquet(src, tmp_path / "got.zarr", target="label", chunk_rows=96, client=client)
    ref = fd.from_numpy(X, y, tmp_path / "ref.zarr", chunk_rows=96, feature_names=names)
    assert_same_store(got, ref)


@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_bad_value_in_the_middle_of_parquet_names_file_row_column(
    tmp_path, parallel, request
) -> None:
    X, y = _data(1000)
    X[512, 2] = np.nan  # file part-01 holds rows 300..699: its row 212
    src = _write_parquet_dir(X, y, tmp_path / "src", ["a", "b", "c", "d"])
    client = request.getfixturevalue("client") if parallel else None
    out = tmp_path / "out.zarr"
    with pytest.raises(ValueError, match=r"part-01\.parquet' row 212, column 'c'") as info:
        fd.from_parquet(src, out, target="label", chunk_rows=64, client=client, task="binary")
    assert "\n" not in str(info.value)
    _nothing_at(out)
    # a label outside the task's, in the last file
    y2 = y.copy()
    y2[901] = 2
    src2 = _write_parquet_dir(np.ones_like(X), y2, tmp_path / "src2", ["a", "b", "c", "d"])
    with pytest.raises(ValueError, match=r"part-02\.parquet' row 201, column 'label': label 2"):
        fd.from_parquet(src2, out, target="label", chunk_rows=64, client=client, task="binary")
    _nothing_at(out)


@pytest.mark.cluster
def test_bad_values_in_two_pieces_name_the_first(tmp_path, client, monkeypatch) -> None:
    """Pieces on two workers, each with a bad value: whichever piece fails first, the
    error names the first bad value in row order (the file's row and column), and nothing
    is written."""
    monkeypatch.setattr(ingest_module, "_BLOCK_BYTES", 100 * 8 * 5)  # pieces of >= 100 rows
    X, y = _data(1000)
    X[950, 1] = np.inf  # the last piece: the smaller, it may well fail first
    X[310, 3] = np.nan  # part-01 holds rows 300..699: its row 10
    src = _write_parquet_dir(X, y, tmp_path / "src", ["a", "b", "c", "d"], group=64)
    assert len(ingest_module._ParquetTable(str(src), None).piece_starts(64)) > 4
    out = tmp_path / "out.zarr"
    for _ in range(3):
        with pytest.raises(ValueError, match=r"part-01\.parquet' row 10, column 'd'"):
            fd.from_parquet(src, out, target="label", chunk_rows=64, client=client, task="binary")
        _nothing_at(out)


def test_parquet_string_column_needs_categorical(tmp_path) -> None:
    t = pa.table({"a": [1.0, 2.0, 3.0], "c": ["x", "y", "x"], "label": [0, 1, 0]})
    pq.write_table(t, tmp_path / "s.parquet")
    with pytest.raises(ValueError, match=r"column 'c' is not numeric.*categorical"):
        fd.from_parquet(tmp_path / "s.parquet", tmp_path / "o.zarr")
    ds = fd.from_parquet(tmp_path / "s.parquet", tmp_path / "o.zarr", categorical=["c"])
    assert ds.feature_names == ["a", "c[y]"]
    np.testing.assert_array_equal(ds.read()[0], [[1, 0], [2, 1], [3, 0]])


def test_arrow_numeric_columns_are_their_values_without_pandas(tmp_path) -> None:
    """Integer and floating Parquet columns are read from their values buffers: every
    width, a slice (an offset into the buffer), chunked arrays of 0, 1 and 3 chunks, nulls
    as NaN; the same values and dtype as pyarrow's ``to_numpy``. A fresh process that
    ingests Parquet does not import pandas (pyarrow's ``to_numpy`` does: ~1 s in a fresh
    worker); the negative control calls ``to_numpy`` and must see it imported."""
    from flymc_dist.data.design import column_values

    rng = np.random.default_rng(11)
    values = rng.normal(size=50) * 100
    for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint64(),
              pa.float16(), pa.float32(), pa.float64()):  # fmt: skip
        arr = pa.array(values.astype(t.to_pandas_dtype()))
        for col in (arr, arr.slice(7, 30), arr.slice(50), pa.chunked_array([arr.slice(3, 9)]),
                    pa.chunked_array([arr.slice(0, 4), arr.slice(20, 0), arr.slice(31, 9)]),
                    pa.chunked_array([], t)):  # fmt: skip
            got, want = column_values(col), np.asarray(col.to_numpy())
            assert got.dtype == want.dtype and got.shape == want.shape, (t, len(col))
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(column_values(pa.array([1, None, 3])), [1.0, np.nan, 3.0])
    X, y = _data(300)
    pq.write_table(pa.table({"a": X[:, 0], "b": X[:, 1], "label": y}), tmp_path / "s.parquet")
    run = (
        "import sys, pyarrow.parquet as pq, flymc_dist as fd\n"
        "fd.from_parquet(sys.argv[1], sys.argv[2], task='binary', chunk_rows=64)\n"
        "seen = ['pandas' in sys.modules]\n"
        "pq.read_table(sys.argv[1]).column('a').to_numpy()\n"
        "print(seen + ['pandas' in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", run, str(tmp_path / "s.parquet"), str(tmp_path / "s.zarr")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[False,", "True]"]
    np.testing.assert_array_equal(fd.open_dataset(tmp_path / "s.zarr").read()[0], X[:, :2])


# --------------------------------------------------------------------------- Dask, zarr


@pytest.mark.parametrize("parallel", PARALLEL)
def test_dask_array_and_dataframe_are_the_from_numpy_store(tmp_path, parallel, request) -> None:
    import dask.array as da
    import dask.dataframe as dd
    import pandas as pd

    X, y = _data(1000)
    client = request.getfixturevalue("client") if parallel else None
    ref = fd.from_numpy(X, y, tmp_path / "ref.zarr", chunk_rows=80)
    got = fd.from_dask(
        da.from_array(X, chunks=(137, 4)),
        da.from_array(y, chunks=251),
        tmp_path / "a.zarr",
        chunk_rows=80,
        client=client,
    )
    assert_same_store(got, ref)
    frame = pd.DataFrame(X, columns=["a", "b", "c", "d"]).assign(label=y)
    got = fd.from_dask(
        dd.from_pandas(frame, npartitions=7),
        None,
        tmp_path / "f.zarr",
        chunk_rows=80,
        client=client,
    )
    ref = fd.from_numpy(
        X, y, tmp_path / "reff.zarr", chunk_rows=80, feature_names=["a", "b", "c", "d"]
    )
    assert_same_store(got, ref)


def test_foreign_zarr_pair_is_the_from_numpy_store(tmp_path, client) -> None:
    import zarr

    X, y = _data(1000)
    zx = zarr.create_array(tmp_path / "fx.zarr", shape=X.shape, chunks=(333, 2), dtype="f8")
    zx[:] = X
    zy = zarr.create_array(tmp_path / "fy.zarr", shape=y.shape, chunks=(100,), dtype="i4")
    zy[:] = y
    ref = fd.from_numpy(X, y, tmp_path / "ref.zarr")
    assert_same_store(fd.from_zarr(str(tmp_path / "fx.zarr"), zy, tmp_path / "a.zarr"), ref)
    assert_same_store(
        fd.from_zarr(zx, str(tmp_path / "fy.zarr"), tmp_path / "b.zarr", client=client), ref
    )
    zx[417, 1] = np.inf
    with pytest.raises(ValueError, match=r"row 417, column '1'"):
        fd.from_zarr(zx, zy, tmp_path / "c.zarr", client=client)
    _nothing_at(tmp_path / "c.zarr")


def test_cli_ingests_parquet_with_categorical_and_standardize(tmp_path, capsys) -> None:
    from flymc_dist.cli import main

    t = pa.table({"dist": [1.0, 2.0, 4.0, 5.0], "c": ["b", "a", "b", "c"], "y": [0, 1, 1, 0]})
    pq.write_table(t, tmp_path / "t.parquet")
    code = main(
        [
            "ingest",
            str(tmp_path / "t.parquet"),
            str(tmp_path / "t.zarr"),
            "--target",
            "y",
            "--categorical",
            "c",
            "--standardize",
        ]
    )
    assert code == 0, capsys.readouterr().err
    ds = fd.open_dataset(tmp_path / "t.zarr")
    assert ds.feature_names == ["dist", "c[b]", "c[c]"]
    np.testing.assert_allclose(ds.read()[0][:, 0], (np.array([1, 2, 4, 5]) - 3) / np.sqrt(2.5))


# --------------------------------------------------------------------------- S3


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback with a bucket: the storage options to reach it."""
    import logging
    import urllib.request

    s3fs = pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        opts = {"endpoint_url": f"http://{host}:{port}", "key": "k", "secret": "s"}
        urllib.request.urlopen(
            urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST"),
            timeout=10,
        ).close()
        s3fs.S3FileSystem(**opts).mkdir("ingest")
        yield opts
    finally:
        server.stop()


@pytest.mark.slow
def test_parquet_on_s3_into_s3_by_the_workers_or_nothing(tmp_path, s3, client) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**s3)
    X, y = _data(1000)
    src = _write_parquet_dir(X, y, tmp_path / "src", ["a", "b", "c", "d"])
    for f in sorted(os.listdir(src)):
        fs.put(str(src / f), f"ingest/src/{f}")
    got = fd.from_parquet(
        "s3://ingest/src",
        "s3://ingest/d.zarr",
        target="label",
        chunk_rows=96,
        client=client,
        storage_options=s3,
        source_options=s3,
    )
    ref = fd.from_numpy(
        X, y, tmp_path / "ref.zarr", chunk_rows=96, feature_names=["a", "b", "c", "d"]
    )
    a, b = got.read(), ref.read()
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert got.attrs["feature_names"] == ["a", "b", "c", "d"]
    X[777, 0] = np.nan
    bad = _write_parquet_dir(X, y, tmp_path / "bad", ["a", "b", "c", "d"])
    fs.put(str(bad / "part-02.parquet"), "ingest/src/part-02.parquet")
    with pytest.raises(ValueError, match=r"part-02\.parquet' row 77, column 'a'"):
        fd.from_parquet(
            "s3://ingest/src",
            "s3://ingest/e.zarr",
            target="label",
            chunk_rows=96,
            client=client,
            storage_options=s3,
            source_options=s3,
        )
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ingest")) == ["d.zarr", "src"]


#: CI only: its three paths (npy, Parquet, Parquet on a cluster) are each checked against
#: the from_numpy store by the tests above
@pytest.mark.full_e2e
@pytest.mark.slow
@pytest.mark.cluster
def test_bench_ingest_is_wired(tmp_path, capsys) -> None:
    """`flymc bench ingest` on a tiny problem: the three runs, their stores identical, the
    table and the JSON."""
    from flymc_dist.cli import main

    out_json = tmp_path / "f.json"
    args = ["bench", "ingest", "--rows", "3000", "--features", "3", "--files", "2"]
    code = main([*args, "--workdir", str(tmp_path), "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "parquet_cluster" in out and "stores identical: True" in out
    d = json.loads(out_json.read_text())
    assert d["identical"] is True
    assert set(d["runs"]) == {"npy", "parquet", "parquet_cluster"}
