"""Tests of the real-data loaders (skipped when the shared data folder is absent)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flymc_dist.data import open_dataset
from flymc_dist.data import real as datasets


def _require(filename: str) -> Path:
    try:
        return datasets.data_dir(filename)
    except FileNotFoundError as e:
        pytest.skip(f"real data not available ({e})")


@pytest.fixture(scope="module")
def mnist79():
    _require("mnist.npz")
    return datasets.mnist_7_vs_9(return_info=True)


@pytest.fixture(scope="module")
def qm9():
    _require("qm9_gap_57.npz")
    return datasets.qm9_gap(return_info=True)


# --------------------------------------------------------------------------- locating


def test_data_dir_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYMC_DATA_DIR", str(tmp_path))
    assert datasets.data_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="mnist.npz.*FLYMC_DATA_DIR"):
        datasets.data_dir("mnist.npz")
    with pytest.raises(FileNotFoundError, match="FLYMC_DATA_DIR"):
        datasets.mnist_7_vs_9()
    monkeypatch.setenv("FLYMC_DATA_DIR", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="missing"):
        datasets.data_dir()


# --------------------------------------------------------------------------- MNIST


def test_mnist_7_vs_9_shape_and_counts(mnist79) -> None:
    X, y, info = mnist79
    assert X.shape == (12_214, 51) and X.dtype == np.float64 and X.flags.c_contiguous
    assert y.dtype == np.int64
    assert np.sum(y == 0) == 6_265 and np.sum(y == 1) == 5_949  # 7s and 9s
    assert np.all(X[:, 0] == 1.0)
    np.testing.assert_allclose(X[:, 1:].mean(axis=0), 0.0, atol=1e-10)  # centred
    var = X[:, 1:].var(axis=0)
    assert np.all(np.diff(var) <= 1e-9)  # components in decreasing variance
    np.testing.assert_allclose(X[:, 1:].var(axis=0, ddof=1), info["explained_variance"], rtol=1e-8)
    V = info["components"]
    assert V.shape == (784, 50)
    np.testing.assert_allclose(V.T @ V, np.eye(50), atol=1e-10)
    # sign convention: each component's largest-magnitude loading is positive
    assert np.all(V[np.argmax(np.abs(V), axis=0), np.arange(50)] > 0)
    assert info["feature_names"][:2] == ["bias", "pc1"] and len(info["feature_names"]) == 51


def test_pca_sign_convention_is_deterministic() -> None:
    rng = np.random.default_rng(0)
    A = rng.standard_normal((200, 6)) @ np.diag([5, 4, 3, 2, 1, 0.5])
    A -= A.mean(axis=0)
    V1, w1 = datasets._pca(A, 4)
    V2, w2 = datasets._pca(A.copy(), 4)
    np.testing.assert_array_equal(V1, V2)
    assert np.all(np.diff(w1) < 0)
    # same subspace as the SVD, up to the fixed signs
    _, _, Vt = np.linalg.svd(A, full_matrices=False)
    np.testing.assert_allclose(np.abs(V1), np.abs(Vt[:4].T), atol=1e-8)


def test_mnist_classes() -> None:
    _require("mnist.npz")
    X, y = datasets.mnist_classes((2, 0, 1), n_components=10, bias=False)
    assert X.shape == (5_923 + 6_742 + 5_958, 10)
    assert list(np.bincount(y)) == [5_958, 5_923, 6_742]  # label k is classes[k]
    for bad in [(1,), (1, 1), (3, 10), (0, -1)]:
        with pytest.raises(ValueError):
            datasets.mnist_classes(bad)
    with pytest.raises(ValueError, match="n_components"):
        datasets.mnist_classes((0, 1), n_components=0)


# --------------------------------------------------------------------------- QM9


def test_qm9_gap(qm9) -> None:
    X, y, info = qm9
    assert X.shape == (130_831, 57) and y.shape == (130_831,)
    assert info["dropped"] == ["NumRadicalElectrons"]
    assert info["feature_names"][0] == "bias" and len(info["feature_names"]) == 57
    assert np.all(X[:, 0] == 1.0)
    np.testing.assert_allclose(X[:, 1:].mean(axis=0), 0.0, atol=1e-8)
    np.testing.assert_allclose(X[:, 1:].std(axis=0), 1.0, rtol=1e-6)
    assert abs(y.mean()) < 1e-10 and abs(y.std() - 1.0) < 1e-10
    assert abs(info["y_mean"] - 0.252) < 0.001 and abs(info["y_sd"] - 0.047) < 0.001
    assert np.all(np.isfinite(X))


def test_qm9_gap_drop_duplicates() -> None:
    _require("qm9_gap_57.npz")
    X, _, info = datasets.qm9_gap(drop_duplicates=True, return_info=True)
    assert X.shape == (130_831, 51)
    assert set(info["dropped"]) == {
        "NumRadicalElectrons",
        "MaxEStateIndex",
        "Chi0v",
        "Chi1v",
        "Chi2v",
        "Chi3v",
        "Chi4v",
    }
    w = np.linalg.eigvalsh(X.T @ X)  # full column rank, cheaply
    assert w.min() > 1e-12 * w.max()  # (MolWt & co. stay: nearly, not exactly, collinear)


def test_qm9_gap_raw() -> None:
    _require("qm9_gap_57.npz")
    X, y, info = datasets.qm9_gap(standardise=False, bias=False, return_info=True)
    assert X.shape == (130_831, 56)
    assert abs(y.mean() - 0.252) < 0.001
    assert info["y_sd"] == 1.0 and "bias" not in info["feature_names"]


# --------------------------------------------------------------------------- flights


def test_flights_subset() -> None:
    _require("flights_3m.npz")
    X, y, info = datasets.flights(n_rows=20_000, return_info=True)
    names = info["feature_names"]
    assert X.shape == (20_000, 57) and len(names) == 57 and y.dtype == np.float64
    assert np.all(X[:, 0] == 1.0) and np.all(np.isfinite(X))
    np.testing.assert_allclose(X[:, 1:3].mean(axis=0), 0.0, atol=1e-8)
    for prefix, n in [("hour_", 23), ("dow_", 6), ("month_", 5), ("origin_", 10), ("dest_", 10)]:
        cols = [i for i, nm in enumerate(names) if nm.startswith(prefix)]
        assert len(cols) == n
        block = X[:, cols]
        assert set(np.unique(block)) <= {0.0, 1.0}
        assert block.sum(axis=1).max() == 1.0  # one-hot with a reference category
    assert "origin_ORD" in names and "hour_12" not in names
    # full column rank on a random subset (the reference categories are well populated)
    assert np.linalg.matrix_rank(X) == 57
    X0, _ = datasets.flights(n_rows=1000, n_airports=0, seed=3)
    assert X0.shape == (1000, 37)
    with pytest.raises(ValueError, match="n_rows"):
        datasets.flights(n_rows=0)
    with pytest.raises(ValueError, match="n_airports"):
        datasets.flights(n_rows=10, n_airports=-1)


def test_flights_to_zarr_matches_in_memory(tmp_path: Path) -> None:
    _require("flights_3m.npz")
    X, y = datasets.flights(n_rows=5_000, seed=1)
    ds = datasets.flights_to_zarr(tmp_path / "f.zarr", n_rows=5_000, seed=1, chunk_rows=700)
    ds = open_dataset(ds.path)
    assert ds.task == "real" and ds.chunk_rows == 700 and len(ds.feature_names) == 57
    Xr, yr = ds.read()
    np.testing.assert_array_equal(Xr, X)
    np.testing.assert_array_equal(yr, y)
    assert ds.attrs["flights"]["hour_reference"] == 12
