"""NUTS/HMC statistics under ArviZ's names, the warnings they raise, and the feature names
a run carries into its summary. Tiny in-process runs (``client="synchronous"``); the
checks are deterministic (relations every transition satisfies), not statistical."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from synthetic import logistic_rows

import flymc_dist as fd
from flymc_dist import diagnostics
from flymc_dist.cli import main
from flymc_dist.trace import Trace

HAMILTONIAN = {"diverging", "n_steps", "step_size", "energy"}
EVERY = {"accepted", "acceptance_rate", "lp", "n_bright", "likelihood_queries", "round_trips"}


def _data() -> tuple[np.ndarray, np.ndarray]:
    return logistic_rows(60)


def _run(data=None, model=None, **kw):
    args = dict(
        algorithm="regular",
        kernel="nuts",
        num_warmup=60,
        num_samples=40,
        chains=2,
        seed=5,
        client="synchronous",
        progress=False,
    )
    args.update(kw)
    return fd.sample(model or fd.LogisticRegression(), data or _data(), **args)


@pytest.mark.parametrize(
    "algorithm,kernel",
    [
        (fd.Regular(), "nuts"),
        (fd.FlyMC(), "nuts"),  # the replica: every transition one compiled call
        (fd.FlyMC(bright_replica=False), "nuts"),  # the shards evaluate every point
        (fd.Regular(), "hmc"),
    ],
    ids=["regular-nuts", "flymc-nuts", "flymc-nuts-shards", "regular-hmc"],
)
def test_hamiltonian_stats_in_result_and_trace(tmp_path: Path, algorithm: Any, kernel: str) -> None:
    trace = tmp_path / "t.zarr"
    res = _run(algorithm=algorithm, kernel=kernel, trace=str(trace))
    want = EVERY | HAMILTONIAN | ({"tree_depth"} if kernel == "nuts" else set())
    assert want <= set(res.stats) and want <= set(res.warmup_stats)
    assert ("tree_depth" in res.stats) == (kernel == "nuts")
    st = res.stats
    for name in want:
        assert st[name].shape == (2, 40), name
    assert st["diverging"].dtype == bool and st["n_steps"].dtype == np.int64
    assert np.all(st["n_steps"] >= 1)
    assert np.all((st["acceptance_rate"] >= 0) & (st["acceptance_rate"] <= 1))
    assert np.all(np.isfinite(st["energy"])) and np.all(np.isfinite(st["lp"]))
    # the energy at a draw is at least its potential: H = −lp + ½ pᵀM⁻¹p
    assert np.all(st["energy"] >= -st["lp"] - 1e-9)
    # after warm-up the step size is the adapted one, fixed
    for c in range(2):
        assert np.all(st["step_size"][c] == res.info["kernel_params"][c]["step_size"])
    if kernel == "nuts":
        depth = st["tree_depth"]
        assert np.all((depth >= 1) & (depth <= 10))
        # a tree of depth d holds 2^d − 1 leapfrog steps, plus part of a next subtree
        # when that one is cut off (a divergence or an inner U-turn)
        assert np.all(st["n_steps"] >= 2**depth - 1) and np.all(st["n_steps"] <= 2 ** (depth + 1))
    else:  # HMC: ⌈T / ε⌉ leapfrog steps (fewer only after a divergence)
        eps = st["step_size"]
        full = np.ceil(0.5 * math.pi / eps).astype(np.int64)
        assert np.all((st["n_steps"] == full) | st["diverging"])
    # the trace holds the same, under the same names
    t = Trace.open(trace, read_only=True)
    assert set(t.stats) == set(res.stats)
    for name in want:
        np.testing.assert_array_equal(t.stats[name], st[name])
    # the former names still read
    assert res.stats["accept_prob"] is st["acceptance_rate"]
    assert res.stats["log_joint"] is st["lp"]
    assert "log_joint" in res.stats and res.stats.get("accept_prob") is st["acceptance_rate"]
    assert "log_joint" not in list(res.stats) and res.stats.get("nothing") is None
    with pytest.raises(KeyError):
        res.stats["no_such_stat"]


def test_rwmh_has_no_hamiltonian_stats(small_run) -> None:
    res = small_run("regular", "rwmh")
    assert EVERY <= set(res.stats) and not HAMILTONIAN & set(res.stats)
    assert res.sampler_checks() is None
    assert "NUTS/HMC" not in str(res.summary())


def test_divergences_are_counted_and_warned() -> None:
    """A step size far too large for the posterior, not adapted: most trajectories
    diverge; the summary counts them and says what to try."""
    res = _run(num_warmup=0, kernel=fd.NUTS(step_size=30.0, find_step_size=False))
    checks = res.sampler_checks()
    assert checks["divergences"] == int(res.stats["diverging"].sum()) > 40
    assert checks["iterations"] == 80
    text = str(res.summary())
    warning = [line for line in text.splitlines() if "diverged" in line]
    assert len(warning) == 1 and warning[0].startswith("WARNING:")
    assert f"{checks['divergences']} of 80 post-warm-up iterations" in warning[0]
    assert "target_accept" in warning[0] and "reparameterise" in warning[0]


@pytest.mark.slow
def test_flymc_divergences_come_with_bright_rows() -> None:
    """FlyMC's θ given z is zero where a bright row's bound is tight: NUTS diverges near
    those walls, only in iterations with bright rows (regular NUTS on the same posterior
    does not), and the warning says so instead of Stan's advice."""
    rng = np.random.default_rng(1)
    X = np.column_stack([np.ones(400), rng.standard_normal((400, 2))])
    y = (rng.random(400) < 1 / (1 + np.exp(-X @ np.array([0.5, 1, -1])))).astype(int)
    kw = dict(num_warmup=100, num_samples=1000, chains=4, seed=0)
    res = _run(data=(X, y), algorithm="flymc", **kw)
    checks = res.sampler_checks()
    assert checks["divergences"] > 5
    assert checks["divergences_bright"] == checks["divergences"]
    assert not np.any(res.stats["diverging"] & (res.stats["n_bright"] == 0))
    warning = [line for line in res.summary().footer if "diverged" in line]
    assert len(warning) == 1 and "all with bright rows" in warning[0]
    assert "algorithm='regular'" in warning[0]
    regular = _run(data=(X, y), algorithm="regular", **kw)
    assert regular.sampler_checks()["divergences"] == 0
    # the generic advice when some divergence had no bright row
    lines = diagnostics.hamiltonian_lines({**checks, "divergences_bright": 0})
    assert "reparameterise" in lines[1] and "bright rows" not in lines[1]


def test_max_tree_depth_hits_are_counted_and_warned() -> None:
    """A tiny step size and max_tree_depth 2: no trajectory turns back in 3 steps."""
    res = _run(num_warmup=0, kernel=fd.NUTS(step_size=1e-3, find_step_size=False, max_tree_depth=2))
    assert res.info["max_tree_depth"] == 2
    checks = res.sampler_checks()
    assert checks["max_tree_depth_hits"] == 80 == int((res.stats["tree_depth"] == 2).sum())
    lines = str(res.summary()).splitlines()
    warning = [line for line in lines if "maximum tree depth" in line]
    assert len(warning) == 1 and "raise max_tree_depth" in warning[0]
    assert not any("diverged" in line for line in lines)


def test_a_clean_run_warns_of_nothing() -> None:
    """Negative control: a well-adapted NUTS run on an easy posterior prints its counts
    and no warning."""
    res = _run(num_warmup=200, num_samples=100)
    lines = res.summary().footer
    assert len(lines) == 1 and lines[0].startswith("NUTS/HMC: divergences 0")
    assert not any(line.startswith("WARNING") for line in lines)


def test_e_bfmi() -> None:
    rng = np.random.default_rng(0)
    white = rng.standard_normal((3, 2000))
    # independent energies: E-BFMI ≈ 2; a random walk in energy: ≈ 0
    assert np.allclose(diagnostics.e_bfmi(white), 2.0, atol=0.15)
    walk = np.cumsum(white, axis=1)
    assert np.all(diagnostics.e_bfmi(walk) < 0.05)
    # by hand, for a short chain
    e = np.array([[1.0, 3.0, 2.0, 6.0]])
    want = (4 + 1 + 16) / np.sum((e - e.mean()) ** 2)
    assert diagnostics.e_bfmi(e)[0] == pytest.approx(want)
    assert np.isnan(diagnostics.e_bfmi(np.ones((1, 5))))[0]
    with pytest.raises(ValueError, match="energy must have shape"):
        diagnostics.e_bfmi(np.ones(5))
    # one warning naming the chains below 0.3
    checks = diagnostics.hamiltonian_checks(
        {"diverging": np.zeros((3, 2000), bool), "energy": np.vstack([white[:2], walk[2:]])}
    )
    lines = diagnostics.hamiltonian_lines(checks)
    assert len(lines) == 2 and lines[1].startswith("WARNING: E-BFMI below 0.3 in chain 2 (")


# ------------------------------------------------------------------------------- names
def test_dataframe_columns_name_the_parameters(tmp_path: Path, small_run) -> None:
    pd = pytest.importorskip("pandas")
    X, y = _data()
    df = pd.DataFrame(X, columns=["bias", "age", "dose"])
    ds = fd.from_numpy(df, y, tmp_path / "d.zarr")
    assert ds.feature_names == ["bias", "age", "dose"]
    for data in (ds, (df, y)):  # a store, and a DataFrame in memory
        res = _run(data=data, kernel="rwmh")
        assert res.feature_names == ["bias", "age", "dose"]
        text = str(res.summary())
        assert [line.split()[0] for line in text.splitlines()[1:4]] == [
            "theta[bias]",
            "theta[age]",
            "theta[dose]",
        ]
    # feature_names= wins over the columns
    ds = fd.from_numpy(df, y, tmp_path / "e.zarr", feature_names=["a", "b", "c"])
    assert ds.feature_names == ["a", "b", "c"]
    # a plain array has none: theta[i]
    assert "theta[0]" in str(small_run("regular", "rwmh").summary())


def test_softmax_names_are_class_and_feature(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    X = np.column_stack([np.ones(90), rng.normal(size=90)])
    y = rng.integers(0, 3, size=90)
    ds = fd.from_numpy(X, y, tmp_path / "s.zarr", feature_names=["bias", "x"])
    res = _run(data=ds, model=fd.SoftmaxRegression(n_classes=3), kernel="rwmh")
    labels = list(res.summary()["name"].ravel())
    assert labels == [f"theta[{k}, {n}]" for k in range(3) for n in ("bias", "x")]


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_names_from_a_csv_header_and_nuts_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    X, y = _data()
    csv = tmp_path / "d.csv"
    rows = "\n".join(",".join(f"{v:.6g}" for v in (*X[i, 1:], y[i])) for i in range(len(y)))
    csv.write_text("age,dose,outcome\n" + rows + "\n")
    store = tmp_path / "d.zarr"
    code, _, err = _cli(["ingest", csv, store, "--target", "outcome"], capsys)
    assert code == 0, err
    trace = tmp_path / "t.zarr"
    run = ["run", store, "--model", "logistic", "--synchronous", "--algorithm", "regular"]
    run += ["--warmup", "30", "--samples", "40", "--chains", "2", "--no-progress"]
    code, out, err = _cli([*run, "--max-tree-depth", "1", "--trace", trace], capsys)
    assert code == 0, err
    assert "theta[age]" in out and "theta[dose]" in out
    warning = [line for line in out.splitlines() if "maximum tree depth 1" in line]
    assert len(warning) == 1 and "raise max_tree_depth" in warning[0]
    # flymc summary: the same names (kept with the trace) and the same lines
    code, out2, err = _cli(["summary", trace], capsys)
    assert code == 0, err
    assert "theta[age]" in out2
    nuts = [line for line in out.splitlines() if line.startswith(("NUTS/HMC", "WARNING"))]
    assert nuts and nuts == [
        line for line in out2.splitlines() if line.startswith(("NUTS/HMC", "WARNING"))
    ]
    # the kernel options are checked against the kernel
    code, _, err = _cli([*run, "--target-accept", "1.5", "--trace", tmp_path / "u"], capsys)
    assert code != 0 and "--target-accept: target_accept must lie strictly between 0 and 1" in err
    code, _, err = _cli(
        [*run, "--kernel", "rwmh", "--max-tree-depth", "3", "--trace", tmp_path / "v"], capsys
    )
    assert code != 0 and "--max-tree-depth is not an option of kernel 'rwmh'" in err
    assert not (tmp_path / "v").exists()


def test_resuming_a_trace_with_the_former_stat_names_is_refused(tmp_path: Path) -> None:
    """A trace written before the statistics took ArviZ's names cannot be continued (its
    arrays are named otherwise): one clear error, and the trace is left as it was."""
    import shutil

    import zarr

    trace = tmp_path / "t.zarr"
    kw = dict(kernel="rwmh", num_warmup=5, num_samples=10, trace=str(trace))
    _run(**kw)
    # what an earlier version wrote: accept_prob and log_joint
    for group in ("sample_stats", "warmup_sample_stats"):
        for old, new in (("accept_prob", "acceptance_rate"), ("log_joint", "lp")):
            shutil.move(trace / group / new, trace / group / old)
    root = zarr.open_group(trace, mode="r+")
    record = dict(root.attrs["flymc_trace"])
    record["stats"] = {
        {"acceptance_rate": "accept_prob", "lp": "log_joint"}.get(k, k): v
        for k, v in record["stats"].items()
    }
    root.update_attributes({"flymc_trace": record})
    before = Trace.open(trace, read_only=True)
    with pytest.raises(ValueError, match="written by an earlier version .*start a new trace"):
        _run(resume=True, **kw)
    after = Trace.open(trace, read_only=True)
    assert after.n_draws == before.n_draws == 10 and "log_joint" in after.stats
