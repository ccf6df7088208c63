"""``flymc bench table1``: the paper's Table 1 command, end to end with ``--quick`` (small
subsets of the real data sets, a few draws), and the rules its cells follow.

The quick run is a real one (every row, kernel and algorithm, in this process); its
figures are not judged, only that every cell is a figure or says why there is none.
"""

from __future__ import annotations

import json
import math
import re
import signal
import time
from pathlib import Path

import pytest

from flymc_dist.bench.table1 import (
    ALGORITHMS,
    ESS_AIM,
    _BudgetSpent,
    _cells,
    _Config,
    _decomposition,
    _forecast_from_probe,
    _within,
    format_table1,
    run_table1,
)
from flymc_dist.cli import main
from flymc_dist.data.real import data_dir

CELLS = (
    "queries_per_iteration",
    "ess_per_1000_min",
    "ess_per_1000_mean",
    "r_hat_max",
    "seconds_per_iteration",
    "speedup_per_query",
    "speedup_per_second",
    "forecast_ess_per_draw",
    "measured_ess_per_draw",
)
NOT_CONVERGED = re.compile(r"^(regular )?not converged within [\d,]+ draws$")


def _need_data() -> None:
    try:
        for name in ("mnist.npz", "qm9_gap_57.npz", "flights_3m.npz"):
            data_dir(name)
    except FileNotFoundError as e:
        pytest.skip(f"real data not available ({e})")


def _is_cell(value: object) -> bool:
    """A figure (finite number), an explicit "not converged within N draws", or a
    not-applicable cell that says why."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return math.isfinite(value)
    return isinstance(value, str) and (
        NOT_CONVERGED.match(value) is not None or value.startswith("n/a: ")
    )


def _measured(draws: int, rhat: float, ess_min: float, queries: float, secs: float) -> dict:
    """The figures of one run as :func:`flymc_dist.bench.table1._run_config` gives them
    (4 chains)."""
    return {
        "draws": draws,
        "warmup": draws // 4,
        "converged": rhat <= 1.01,
        "r_hat_max": rhat,
        "ess_min": ess_min,
        "ess_mean": 2 * ess_min,
        "ess_per_1000_min": 1000 * ess_min / (4 * draws),
        "ess_per_1000_mean": 2000 * ess_min / (4 * draws),
        "queries_per_iteration": queries,
        "seconds_per_iteration": secs,
        "sampling_seconds": secs * draws,
        "ess_min_per_draw": ess_min / (4 * draws),
        "forecast_ess_per_draw": 0.035,
    }


def test_cells_speedups_and_not_converged() -> None:
    """Speedups are min-ESS per query and per second against regular; a run that did not
    converge (or whose regular run did not) has no ESS or speedup figure but says so."""
    base = _measured(1000, 1.004, 400.0, 10_000.0, 0.01)
    fly = _measured(2000, 1.008, 200.0, 100.0, 0.002)
    c = _cells(fly, base, flymc_map=True)
    # ESS per query: (200/8000 it / 100 q) / (400/4000 it / 10,000 q) = 25
    assert c["speedup_per_query"] == pytest.approx(25.0)
    # ESS per second: (200 / 4 s) / (400 / 10 s) = 1.25
    assert c["speedup_per_second"] == pytest.approx(1.25)
    assert c["forecast_ess_per_draw"] == 0.035
    assert c["measured_ess_per_draw"] == pytest.approx(200 / 8000)
    assert _cells(base, base, flymc_map=False)["speedup_per_query"] == pytest.approx(1.0)
    slow = _measured(500, 1.3, 9.0, 100.0, 0.002)
    c = _cells(slow, base, flymc_map=True)
    for key in (
        "ess_per_1000_min",
        "ess_per_1000_mean",
        "speedup_per_query",
        "measured_ess_per_draw",
    ):
        assert c[key] == "not converged within 500 draws"
    assert c["queries_per_iteration"] == 100.0 and c["r_hat_max"] == 1.3
    c = _cells(fly, slow, flymc_map=True)
    assert c["speedup_per_second"] == "regular not converged within 500 draws"
    assert c["ess_per_1000_min"] == pytest.approx(25.0)
    assert _cells(fly, base, flymc_map=False)["forecast_ess_per_draw"].startswith("n/a: ")
    assert all(_is_cell(v) for v in _cells(slow, slow, flymc_map=False).values())
    stuck = _measured(4, math.inf, 4.0, 100.0, 0.002)  # chains that never moved
    c = _cells(stuck, base, flymc_map=True)
    assert c["r_hat_max"] == "not converged within 4 draws"
    assert all(_is_cell(v) for v in c.values())


def test_forecast_from_probe() -> None:
    """A probed regular run (a few draws) gets a labelled forecast from the best regular
    run with the same kernel elsewhere in the table, and only then."""
    probe = {**_measured(4, 3.0, 16.0, 3e6, 2.0), "schedule": "probe"}
    fly = _measured(2000, 1.005, 800.0, 3000.0, 0.02)  # 0.1 ESS per draw
    qm9 = _measured(1000, 1.002, 2000.0, 1e5, 0.1)  # 0.5 ESS per draw
    rows = {
        "qm9/nuts": {"data": "qm9", "kernel": "nuts", "algorithms": {"regular": {"measured": qm9}}},
        "flights/nuts": {
            "data": "flights",
            "kernel": "nuts",
            "algorithms": {"regular": {"measured": probe}, "MAP-tuned FlyMC": {"measured": fly}},
        },
    }
    f = _forecast_from_probe(rows["flights/nuts"], rows)
    assert f["assumed_from"] == "qm9" and f["assumed_regular_ess_min_per_draw"] == 0.5
    assert f["speedup_per_query"] == pytest.approx((0.1 / 3000) / (0.5 / 3e6))
    assert f["speedup_per_second"] == pytest.approx((0.1 / 0.02) / (0.5 / 2.0))
    assert _forecast_from_probe(rows["qm9/nuts"], rows) is None  # not a probe
    rows["qm9/nuts"]["kernel"] = "slice"
    assert _forecast_from_probe(rows["flights/nuts"], rows) is None  # nothing to go by


def test_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="unknown data set 'cifar'"):
        run_table1(quick=True, datasets=("cifar",))
    with pytest.raises(ValueError, match="'paper' and/or 'nuts'"):
        run_table1(quick=True, kernels=("hmc",))
    with pytest.raises(ValueError, match="budget_minutes"):
        run_table1(quick=True, budget_minutes=0)
    with pytest.raises(ValueError, match="softmax_bound must be one of"):
        run_table1(quick=True, softmax_bound="bouchard")
    with pytest.raises(ValueError, match="flymc_precondition must be"):
        run_table1(quick=True, flymc_precondition="identity")


def test_cli_help_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    """The command's options come from ``run_table1``; bad input is a usage error."""
    assert main(["bench", "table1", "--help"]) == 0
    out, _ = capsys.readouterr()
    flags = ("--quick", "--budget-minutes", "--chains", "--datasets", "--kernels", "--json")
    for flag in (*flags, "--softmax-bound", "--flymc-precondition"):
        assert flag in out, flag
    assert main(["bench", "--help"]) == 0
    assert "table1" in capsys.readouterr()[0]
    assert main(["bench", "table1", "--quick", "--datasets", "cifar"]) == 2
    assert "unknown data set 'cifar'" in capsys.readouterr()[1]


def test_decomposition_of_the_speedup_per_query() -> None:
    """MAP-tuned FlyMC's speedup per query is the query ratio times the mixing ratio (the
    latter only when both converged), and the paper's factor is named for its kernel."""
    base = _measured(1000, 1.004, 400.0, 10_000.0, 0.01)
    fly = _measured(2000, 1.008, 200.0, 100.0, 0.002)
    entry = {
        "data": "mnist",
        "kernel": "rwmh",
        "algorithms": {"regular": {"measured": base}, "MAP-tuned FlyMC": {"measured": fly}},
    }
    part = _decomposition(entry)
    assert part["query_ratio"] == pytest.approx(100.0)
    assert part["mixing_ratio"] == pytest.approx(0.25)
    assert part["paper_speedup_per_query"] == 22.0
    # the product is the speedup per query of the cells
    speedup = _cells(fly, base, flymc_map=True)["speedup_per_query"]
    assert part["query_ratio"] * part["mixing_ratio"] == pytest.approx(speedup)
    entry["kernel"] = "nuts"  # not the paper's kernel: no paper figure
    assert _decomposition(entry)["paper_speedup_per_query"] is None
    entry["algorithms"]["MAP-tuned FlyMC"]["measured"] = _measured(500, 1.3, 9.0, 200.0, 0.002)
    part = _decomposition(entry)  # FlyMC not converged: the query ratio only
    assert part["query_ratio"] == pytest.approx(50.0) and part["mixing_ratio"] is None
    del entry["algorithms"]["regular"]
    assert _decomposition(entry) is None


#: CI only: the table's cells, speed-ups, forecasts, decomposition and budget are checked
#: by the tests around it, its samplers against the exact posterior in test_exactness.py
@pytest.mark.full_e2e
@pytest.mark.slow
def test_quick_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``flymc bench table1 --quick``: every row, kernel and algorithm is in the JSON, each
    cell a figure or an explicit "not converged within N draws"; the protocol and the
    paper's figures are printed with the table."""
    _need_data()
    out_json = tmp_path / "table1.json"
    code = main(
        [
            "bench",
            "table1",
            "--quick",
            "--budget-minutes",
            "5",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(out_json),
            "--partial-json",
            str(tmp_path / "partial.json"),
        ]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    d = json.loads(out_json.read_text())
    # the figures so far, written after every run: the last one holds every run made
    partial = json.loads((tmp_path / "partial.json").read_text())
    assert partial["partial"] is True and "partial" not in d
    assert set(partial["rows"]) == set(d["rows"])
    for key, entry in d["rows"].items():  # every run made (the reasons are final only in d)
        for label, a in entry["algorithms"].items():
            runs = partial["rows"][key]["algorithms"][label]["measured"]["attempts"]
            assert json.dumps(runs) == json.dumps(a["measured"]["attempts"]), (key, label)
    assert not list(tmp_path.glob("partial.json.tmp-*"))
    assert d["protocol"]["quick"] is True
    assert set(d["protocol"]["data"]) == {"mnist", "softmax", "qm9", "flights"}
    assert d["protocol"]["data"]["flights"]["out_of_core"] is True
    assert set(d["rows"]) == {
        "mnist/rwmh",
        "mnist/nuts",
        "softmax/mala",
        "softmax/nuts",
        "qm9/slice",
        "qm9/nuts",
        "flights/slice",
        "flights/nuts",
    }
    labels = [label for label, _, _ in ALGORITHMS]
    for key, entry in d["rows"].items():
        assert list(entry["algorithms"]) == labels, key
        part = entry["decomposition"]
        if part is not None:
            assert part["query_ratio"] > 0.0, key
        for label, a in entry["algorithms"].items():
            cells, m = a["cells"], a["measured"]
            assert set(cells) == set(CELLS), (key, label)
            for name, value in cells.items():
                assert _is_cell(value), (key, label, name, value)
            if m["attempts"]:
                assert m["attempts"][-1]["draws"] == m["draws"]
            else:  # left out: the time budget was spent (a heavily loaded machine)
                assert m["reason"] == "not run: the time budget was spent" or re.fullmatch(
                    r"the time budget ran out during its run of [\d,]+ draws per chain",
                    m["reason"],
                )
            if m["converged"]:
                assert m["r_hat_max"] <= 1.01
                assert isinstance(cells["ess_per_1000_min"], float)
            else:
                assert cells["ess_per_1000_min"] == f"not converged within {m['draws']:,} draws"
                assert m["reason"]
            if label == "regular" and m["converged"]:
                assert cells["speedup_per_query"] == pytest.approx(1.0)
    assert d["paper"]["mnist"]["speedup_per_query"][2] == 22.0
    assert "Protocol:" in out and "CIFAR-10" in out and "not available here" in out
    assert "1/0.7/22" in out and "1/1.2/11" in out and "1/-/29" in out
    if any(entry["decomposition"] for entry in d["rows"].values()):
        assert "Speedup per query = query ratio" in out
    assert format_table1(d) in out


@pytest.mark.parametrize(
    ("draws", "ess_min", "most", "expected"),
    [
        (1000, 9.0, 128_000, 16_000),  # far from the aim: the most growth, 16x
        (1000, 100.0, 128_000, 8000),  # 1.25 * 400 / 100 = 5 -> the next power of two, 8
        (1000, 300.0, 128_000, 2000),  # close: at least 2x
        (1000, 5000.0, 128_000, 2000),  # above the aim but not converged: still 2x
        (1000, float("nan"), 128_000, 16_000),  # no ESS (chains that never moved)
        (64_000, 9.0, 128_000, 128_000),  # the schedule's limit
    ],
)
def test_next_draws_grow_by_the_ess_still_missing(
    draws: int, ess_min: float, most: int, expected: int
) -> None:
    c = _Config("1", "mnist", "rwmh", "regular", "regular", "map", "small", 3.0, most)
    c.attempts.append(
        {"draws": draws, "ess_min": ess_min, "wall_seconds": 12.0, "setup_seconds": 2.0}
    )
    assert ESS_AIM == 400.0
    assert c.next_draws() == expected
    # the next run's forecast cost: the last run's warm-up and sampling scaled, set-up once
    assert c.next_seconds() == pytest.approx(expected / draws * 10.0 + 2.0)


def test_a_run_the_budget_cannot_hold_is_stopped() -> None:
    """The wall-clock guard: a run still going when the budget ends is stopped (not
    waited for), the timer is cleared after a run that ends in time, and the previous
    SIGALRM handler is back either way."""
    before = signal.getsignal(signal.SIGALRM)
    t0 = time.perf_counter()
    with pytest.raises(_BudgetSpent):
        _within(0.2, lambda: time.sleep(30))
    assert time.perf_counter() - t0 < 25  # stopped, not the 30 s sleep
    assert _within(5.0, lambda: 7) == 7
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before
