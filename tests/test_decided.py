"""Decided and documented (issue 41, item 8): the disk a row file leaves free is stated
where a shard is refused for want of it; an object-dtype .npz is refused naming the file
and the array."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import flymc_dist as fd
from flymc_dist.data import ingest
from flymc_dist.shard.rowfile import DISK_RESERVE, RowFile


def test_the_disk_reserve_is_stated(tmp_path, monkeypatch):
    X = np.c_[np.ones(50), np.arange(50.0)]
    fd.from_numpy(X, (np.arange(50) % 2).astype(np.int64), str(tmp_path / "d.zarr"))
    ds = fd.open_dataset(str(tmp_path / "d.zarr"))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda d: real(d)._replace(free=DISK_RESERVE + 10))
    out = tmp_path / "rows"
    with pytest.raises(OSError, match=r"0\.27 GB free, of which 0\.27 GB stay free for the worker"):
        RowFile.create(ds, 0, 50, str(out))
    assert os.listdir(out) == []


def test_an_object_npz_names_the_file_and_the_array(tmp_path):
    src = tmp_path / "obj.npz"
    np.savez(src, X=np.ones((4, 2)), y=np.array([1, "a", None, 2], dtype=object))
    with pytest.raises(
        ValueError, match=r"obj\.npz'?: array 'y' cannot be read without unpickling"
    ):
        ingest(str(src), str(tmp_path / "out.zarr"))
    assert not (tmp_path / "out.zarr").exists()
