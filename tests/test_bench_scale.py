"""``flymc bench scale``: its figures, table, slope and CLI wiring, on tiny stores.

The run is a real one (an embedded 2-worker LocalCluster, float32 zarr stores, shards
forced out of core) at sizes where it takes seconds; the timings themselves are not
judged (no timed assertions), only that they are there and consistent.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from flymc_dist.austerity.sampler import loglog_slope
from flymc_dist.bench.scale import _first_variant, _ratio, _slope, _store, format_scale
from flymc_dist.cli import main

NS = [3000, 12000]
FEATURES = 5
LIMIT = 10**9  # each worker's memory limit
#: the run's iterations: the figures, not the posterior, are the point
WARMUP, DRAWS = 20, 40


def _cli(args: list, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["bench", "scale", "--help"], capsys)
    assert code == 0
    for flag in (
        "--ns",
        "--features",
        "--kernel",
        "--num-warmup",
        "--num-samples",
        "--memory-limit",
        "--out-of-core",
        "--memory-budget",
        "--n-shards",
        "--workdir",
        "--json",
    ):
        assert flag in out, flag
    code, out, _ = _cli(["bench", "--help"], capsys)
    assert code == 0 and "scale" in out


#: CI only: out-of-core shards on memory-limited workers run end to end in
#: test_out_of_core.py's test_workers_with_less_memory_than_their_shards; the table's
#: figures, slope and layouts in the tests below
@pytest.mark.full_e2e
@pytest.mark.slow
@pytest.mark.cluster
def test_bench_scale_out_of_core(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole command on two tiny stores, shards forced out of core: every figure is
    there and sane, the table shows each N, and the slope is the least-squares one."""
    out_json = tmp_path / "scale.json"
    work = tmp_path / "work"
    code, out, err = _cli(
        [
            "bench",
            "scale",
            "--ns",
            "3e3",  # floats on the command line, as for 1e8
            "1.2e4",
            "--features",
            FEATURES,
            "--num-warmup",
            WARMUP,
            "--num-samples",
            DRAWS,
            "--out-of-core",
            "true",
            "--chunk-rows",
            1000,
            "--memory-limit",
            LIMIT,
            "--workdir",
            work,
            "--json",
            out_json,
        ],
        capsys,
    )
    assert code == 0, err
    d = json.loads(out_json.read_text())
    s = d["setup"]
    assert s["workers"] == 2 and s["cores"] == os.cpu_count() and s["out_of_core"] is True
    assert s["worker_memory_limits"] == [LIMIT, LIMIT]
    assert [st["reused"] for st in s["stores"]] == [False, False]
    rows = d["rows"]
    assert [r["n_rows"] for r in rows] == NS
    for r in rows:
        assert r["out_of_core"] == [True, True]
        assert r["draws"] == DRAWS and r["warmup"] == WARMUP
        assert r["seconds_per_iteration"] > 0 and r["setup_seconds"] > 0
        assert 0 < r["load_seconds"] < r["wall_seconds"]
        # set-up streams whole passes over the row files (MAP search, bounds)
        assert r["setup_bytes_read"] > 0 and 2 <= r["setup_passes"] <= 12
        # whole records: float32 features, a float64 target, a 4-byte checksum
        assert r["setup_bytes_read"] % (FEATURES * 4 + 12) == 0
        assert r["rows_per_second"] > 0 and r["mb_per_second_per_worker"] > 0
        assert r["rows_read_per_iteration"] > 0  # the z-updates' proposals
        assert 0 < r["bright_fraction"] < 0.05 and r["queries_per_iteration"] > 0
        assert r["ess_min"] > 0 and r["ess_min_per_iteration"] == r["ess_min"] / DRAWS
        assert math.isfinite(r["r_hat_max"]) and r["converged"] == (r["r_hat_max"] <= 1.01)
        assert r["workers_restarted"] is False
        assert r["ess_min_per_second"] == pytest.approx(r["ess_min"] / r["sampling_seconds"])
        if os.path.exists("/proc/self/clear_refs"):
            assert len(r["peak_rss"]) == 2
            assert all(20e6 < p < LIMIT for p in r["peak_rss"]), r["peak_rss"]
    spi = [r["seconds_per_iteration"] for r in rows]
    assert d["slope"] == pytest.approx(loglog_slope(NS, spi))
    assert d["ratio_to_1e6"] is None  # no 1e6 point
    # the table
    lines = out.splitlines()
    assert "2 workers x 1 thread" in out and f"run on {os.cpu_count()} cores" in out
    assert any(line.split()[:2] == ["3,000", "y/y"] for line in lines), out
    assert any(line.split()[:2] == ["12,000", "y/y"] for line in lines), out
    assert f"log-log slope of s/it on N: {d['slope']:.3f}" in out
    # the stores are kept and reused when they match
    ds, secs, reused = _store(str(work), 3000, FEATURES, 0, 1000)
    assert reused and secs == 0.0 and ds.dtype == np.float32 and ds.chunk_rows == 1000
    _, _, reused = _store(str(work), 3000, FEATURES, 1, 1000)  # another seed: written
    assert not reused


def _row(n: int, spi: float, converged: bool = True) -> dict:
    return {
        "n_rows": n,
        "out_of_core": [True, True],
        "load_seconds": 0.5,
        "setup_seconds": 1.0,
        "setup_passes": 8,
        "rows_per_second": 1e6,
        "mb_per_second_per_worker": 120.0,
        "seconds_per_iteration": spi,
        "rows_read_per_iteration": 40.0,
        "peak_rss": [5e8, 6e8],
        "bright_fraction": 1e-6,
        "queries_per_iteration": 3.0,
        "ess_min_per_iteration": 0.01,
        "ess_min_per_second": 5.0,
        "r_hat_max": 1.0 if converged else 1.2,
        "converged": converged,
        "workers_restarted": False,
    }


def _setup(**kw: object) -> dict:
    """A run's ``setup`` figures, as :func:`run_scale` gives them, with ``kw`` changed."""
    return {
        "features": 57,
        "kernel": "rwmh",
        "chains": 4,
        "num_warmup": 10,
        "num_samples": 20,
        "seed": 0,
        "cores": 2,
        "machine": "x86_64",
        "memory_total": 24e9,
        "workers": 2,
        "memory_limit": "auto",
        "out_of_core": "auto",
        "memory_budget": None,
        "loadavg_before": [1.0],
        "loadavg_after": [1.0],
        **kw,
    }


def test_slope_ratio_and_table_of_given_figures() -> None:
    rows = [_row(10**5, 1e-3), _row(10**6, 1.2e-3), _row(10**8, 1.8e-3, converged=False)]
    lsq = np.polyfit(np.log([1e5, 1e6, 1e8]), np.log([1e-3, 1.2e-3, 1.8e-3]), 1)[0]
    assert _slope(rows) == pytest.approx(lsq)
    assert _ratio(rows) == pytest.approx(1.5)
    assert _ratio(rows[:2]) is None and _ratio(rows[::2]) is None  # nothing beyond / no 1e6
    assert _slope(rows[:1]) is None
    d = {
        "setup": _setup(worker_memory_limits=[12e9, 12e9]),
        "rows": rows,
        "slope": _slope(rows),
        "ratio_to_1e6": _ratio(rows),
    }
    text = format_scale(d)
    assert "s/it at N = 1e8 / s/it at N = 1e6: 1.50x" in text
    assert "NOT CONVERGED (R-hat > 1.01) at N = 1e8" in text
    assert "12.00/12.00 GB per worker" in text
    assert "500/600" in text  # peak RSS per worker, MB


def test_table_with_several_layouts() -> None:
    """``--n-shards 0 8``: each N runs the default layout and 8 shards; the table says
    which is which and each run's s/it over the first layout's at its N."""
    rows = []
    for n, spi in ((10**5, 1e-3), (10**6, 1e-3)):
        for layout, factor in ((0, 1.0), (8, 2.5)):
            r = _row(n, spi * factor)
            r["layout"] = layout
            r["out_of_core"] = [False] * (layout or 2)
            rows.append(r)
    setup = _setup(features=20, kernel="nuts", n_shards=[0, 8])
    text = format_scale({"setup": setup, "rows": rows, "slope": 0.0, "ratio_to_1e6": None})
    body = [line.split() for line in text.splitlines() if line.split()[:1] in (["1e5"], ["1e6"])]
    assert [b[1:4] for b in body] == [
        ["default", "2", "1.00"],
        ["8", "2.50", "n/n/n/n/n/n/n/n"],
    ] * 2
    assert "log-log slope of s/it on N (first layout): 0.000" in text


def test_table_with_in_memory_and_out_of_core_side_by_side() -> None:
    """``--out-of-core false true``: each N runs in memory, then out of core, on the same
    store and cluster; the out-of-core run's s/it is given over the in-memory one's."""
    rows = []
    for mode, factor in ((False, 1.0), (True, 1.2)):
        r = _row(10**6, 1e-3 * factor)
        r["layout"], r["mode"], r["out_of_core"] = 0, mode, [mode, mode]
        rows.append(r)
    setup = _setup(out_of_core=[False, True])
    text = format_scale({"setup": setup, "rows": rows, "slope": None, "ratio_to_1e6": None})
    body = [line.split() for line in text.splitlines() if line.split()[:1] == ["1e6"]]
    assert [b[1:5] for b in body] == [
        ["default", "2", "1.00", "n/n"],
        ["default", "2", "1.20", "y/y"],
    ]
    assert _first_variant(rows, False, 0) == rows[:1]
