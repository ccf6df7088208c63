"""A row file's writes are checked and its reads verified (issue 41, items 3 and 4): a short
write while creating it fails naming the file and the cause; a file changed in place
after it was written is never read silently."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import flymc_dist as fd
from flymc_dist.shard.rowfile import RowFile


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(5)
    X = np.c_[np.ones(900), rng.normal(size=(900, 2))]
    y = (rng.random(900) < 0.5).astype(np.int64)
    path = str(tmp_path_factory.mktemp("rf") / "d.zarr")
    fd.from_numpy(X, y, path, chunk_rows=100)
    return fd.open_dataset(path), X, y


def test_a_short_write_fails_naming_the_file_and_the_cause(store, tmp_path):
    """A real short write: the process's file-size limit (RLIMIT_FSIZE) lets the kernel
    write part of a block, then refuses the rest (EFBIG), as a disk that fills up does.
    Before, the short count was ignored and a shifted file was read as the rows."""
    ds = store[0]
    out = tmp_path / "rows"
    code = textwrap.dedent(
        f"""
        import resource, signal, sys
        import flymc_dist as fd
        from flymc_dist.shard.rowfile import RowFile
        ds = fd.open_dataset({ds.path!r})
        RowFile.create(ds, 0, 10, {str(tmp_path)!r}).close()  # compiled (and cached) first
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_001, 10_001))
        try:
            f = RowFile.create(ds, 0, 900, {str(out)!r})
        except OSError as e:
            print("ERROR", e)
            sys.exit(0)
        print("CREATED", f.path, f.n)
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    assert line.startswith("ERROR"), line
    assert "writing the row file" in line and str(out) in line and "File too large" in line
    assert len(line.splitlines()) == 1
    assert os.listdir(out) == []  # the partial file is removed


def _other(record: int, buf: bytes, at: int, src: int) -> bytes:
    """``buf`` with the record at row ``at`` replaced by the record at row ``src``."""
    return buf[: at * record] + buf[src * record : (src + 1) * record] + buf[(at + 1) * record :]


@pytest.mark.parametrize("how", ["another row's record", "a flipped byte", "a shift"])
def test_a_row_file_changed_in_place_is_never_read_silently(store, tmp_path, how):
    ds, X, _ = store
    f = RowFile.create(ds, 100, 400, str(tmp_path))
    try:
        with open(f.path, "rb") as fh:
            buf = fh.read()
        rec = f.record
        if how == "another row's record":  # a valid record, at the wrong place
            new = _other(rec, buf, 37, 250)
        elif how == "a flipped byte":
            new = bytearray(buf)
            new[37 * rec + 3] ^= 0x10
            new = bytes(new)
        else:  # every record from row 37 on moved by 8 bytes
            new = buf[: 37 * rec] + b"\0" * 8 + buf[37 * rec : -8]
        with open(f.path, "r+b") as fh:  # in place: the shard's open descriptor sees it
            fh.write(new)
        np.testing.assert_array_equal(f.read(np.array([0, 36]))[0], X[[100, 136]])
        for read in (
            lambda: f.read(np.array([5, 37, 200])),
            lambda: list(f.blocks(64)),
        ):
            with pytest.raises(OSError, match="row 37 .* fails its checksum") as err:
                read()
            assert f.path in str(err.value) and "\n" not in str(err.value)
    finally:
        f.close()


def test_an_out_of_core_run_refuses_a_changed_row_file(store, monkeypatch):
    """In a run (in process: nothing to recover onto), a row file overwritten with another
    part of the data after it was written stops the run with the file and row named,
    where it went on with wrong draws before."""
    ds = store[0]
    create = RowFile.create.__func__
    files: list[RowFile] = []

    def corrupting(cls, *a, **k):
        f = create(cls, *a, **k)
        files.append(f)
        with open(f.path, "r+b") as fh:
            buf = fh.read()
            fh.seek(0)
            fh.write(buf[f.record :] + buf[: f.record])  # every row now its neighbour's
        return f

    monkeypatch.setattr(RowFile, "create", classmethod(corrupting))
    with pytest.raises(OSError, match="fails its checksum") as err:
        fd.sample(
            fd.LogisticRegression(prior_scale=3.0),
            ds,
            client="synchronous",
            kernel="rwmh",
            num_warmup=20,
            num_samples=20,
            chains=2,
            seed=1,
            progress=False,
            placement=fd.Placement(out_of_core=True),
        )
    assert any(f.path in str(err.value) for f in files)
