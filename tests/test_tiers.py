"""The default run's covering subsets: what ``pytest`` leaves to ``pytest --full-grid``.

The tests marked with one of ``tests/conftest.py``'s ``CI_ONLY_MARKERS`` run only with
``--full-grid`` (CI does). A default run must still cover what they cover:

* a parametrised test thinned by default keeps every value of every axis: every token
  (its parameter id split at ``-``: family, algorithm, bounds, kernel, z-update, layout,
  variant) of an instance left out is in the id of an instance that stays, unless
  :data:`COVERED_ELSEWHERE` names the default test that covers that instance's path;
* a test left out whole is in :data:`COVERED_ELSEWHERE`, with a default test that covers
  its path;
* every negative control (a test whose name says ``negative_control`` or ``wrong``) keeps
  at least one instance in the default run.

The memory bounds at full scale (marker ``full_scale``) are not a thinned grid: the same
bounds run at a small scale by default, and CI runs them at full scale.

:func:`test_the_default_run_covers_what_it_leaves_out` reads both the items kept and those
left out (tests/tiers.py): from this session's collection where it holds the whole suite,
else from the whole suite's collection in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from tiers import RECORDS

TESTS = Path(__file__).parent

#: the one-vs-each bound's exactness test (its two instances)
OVE_TEST = "tests/test_softmax_bounds.py::test_one_vs_each_flymc_targets_the_exact_posterior"
#: the tests (a test, or one instance of a parametrised test) left out of the default run
#: whose path another default test covers: left out → the covering default test
COVERED_ELSEWHERE = {
    # benchmarks' and recipes' end-to-end runs
    "tests/test_bench_numpyro.py::test_bench_mixing_numpyro_is_wired": (
        "tests/test_bench_numpyro.py::test_numpyro_model_is_the_package_posterior"
    ),
    "tests/test_bench_scale.py::test_bench_scale_out_of_core": (
        "tests/test_bench_scale.py::test_table_with_in_memory_and_out_of_core_side_by_side"
    ),
    "tests/test_deploy.py::test_jobqueue_script_runs_locally": (
        "tests/test_deploy.py::test_jobqueue_job_script_runs"
    ),
    "tests/test_deploy.py::test_slurm_script_runs_a_job": (
        "tests/test_deploy.py::test_jobqueue_job_script_runs"
    ),
    "tests/test_ingest.py::test_bench_ingest_is_wired": (
        "tests/test_ingest.py::test_parquet_directory_is_the_from_numpy_store"
    ),
    "tests/test_bench_table1.py::test_quick_end_to_end": (
        "tests/test_bench_table1.py::test_decomposition_of_the_speedup_per_query"
    ),
    "tests/test_sv_sampler.py::test_bench_sv_tall_cli": (
        "tests/test_sv_control.py::test_control_variates_read_far_fewer_series"
    ),
    "tests/test_remote.py::test_s3_run_with_s3_trace_resumes_and_matches_local_disk[in-memory]": (
        "tests/test_deploy.py::test_kubernetes_script_runs_on_s3"
    ),
    "tests/test_netns.py::test_firewalled_round_channels_fall_back_to_dask": (
        "tests/test_cluster.py::test_unreachable_channel_falls_back_to_dask"
    ),
    # statistical runs whose path a default statistical test checks: plain austerity's
    # bias (its draws are also compared bit for bit with recorded ones by default); the
    # narrowing forecast's long-run check (the forecast's formula by default); the
    # one-vs-each bound with MALA and implicit updates (the bound with NUTS by default,
    # MALA and implicit updates in the exactness grid)
    "tests/test_austerity.py::test_posterior_mean_close_to_exact_posterior": (
        "tests/test_austerity.py::test_control_variates_close_to_exact_posterior_and_error_shrinks_with_eps"
    ),
    "tests/test_narrowing.py::test_the_slowest_direction_mixes_at_about_the_gibbs_rate": (
        "tests/test_narrowing.py::test_narrowing_is_the_bound_against_the_posterior_precision"
    ),
    OVE_TEST + "[mala-implicit]": OVE_TEST + "[nuts-explicit]",
    # the sublinear data use of austerity with control variates as a user runs it (its
    # sublinearity with a fixed move, and the sampler with control variates, by default)
    "tests/test_austerity.py::test_control_variates_sublinear_with_posterior_scaled_proposals": (
        "tests/test_austerity.py::test_data_used_sublinear_in_n"
    ),
    # the S3 paths of the command line: ingest, run, resume and summary on S3 through the
    # API (its run and resume, as the command line's) and on local disk through the CLI
    "tests/test_remote.py::test_cli_ingest_run_resume_and_summary_on_s3": (
        "tests/test_remote.py::test_s3_run_with_s3_trace_resumes_and_matches_local_disk"
    ),
    # every family through the command line: test_cli's ingest and run of every family;
    # the resume and ArviZ output, family-independent, with the families that stay
    "tests/test_glm.py::test_family_through_cli_arviz_and_resume[probit]": (
        "tests/test_cli.py::test_family_names_through_ingest_and_run[probit]"
    ),
    "tests/test_glm.py::test_family_through_cli_arviz_and_resume[binomial]": (
        "tests/test_cli.py::test_family_names_through_ingest_and_run[binomial]"
    ),
}


def uncovered(kept: list[dict], left_out: list[dict]) -> list[str]:
    """What the default run (``kept``) fails to cover of ``left_out``, one line each.

    Each item is ``{"nodeid", "function", "id", "markers"}``: its node id, its test
    function's node id (``file::[Class::]name``), its parameter id (``""`` if none) and
    its markers' names. Tests at full scale (``full_scale``) are not checked.
    """
    kept_ids = {item["nodeid"] for item in kept}
    kept_functions = {item["function"] for item in kept}
    tokens: dict[str, set[str]] = defaultdict(set)
    for item in kept:
        tokens[item["function"]].update(item["id"].split("-"))
    problems = []
    left_out = [item for item in left_out if "full_scale" not in item["markers"]]
    for item in left_out:
        covering = COVERED_ELSEWHERE.get(item["nodeid"]) or COVERED_ELSEWHERE.get(item["function"])
        if covering is not None:
            if covering not in kept_ids and covering not in kept_functions:
                problems.append(f"{item['nodeid']}: its covering test {covering} is not run")
            continue
        if item["function"] not in kept_functions:
            problems.append(f"{item['nodeid']}: left out whole and not in COVERED_ELSEWHERE")
            continue
        missing = set(item["id"].split("-")) - tokens[item["function"]]
        if missing:
            problems.append(f"{item['nodeid']}: no default instance holds {sorted(missing)}")
    left_out_functions = {item["function"] for item in left_out}
    for function in sorted(left_out_functions - kept_functions):
        name = function.rsplit("::", 1)[-1]
        if "negative_control" in name or "wrong" in name:
            problems.append(f"{function}: a negative control left out of the default run")
    return problems


#: the exactness grid's runs (tests/test_exactness.py)
EXACTNESS_RUNS = {
    f"tests/test_exactness.py::{name}"
    for name in ("test_targets_exact_posterior", "test_out_of_core_exact", "test_exact_rows_exact")
}


#: collects the suite as this session's ``pytest`` would (default or ``--full-grid``) and
#: prints, after a separator line, its records (tests/tiers.py) and the node ids of the
#: items it selected, as JSON
COLLECT = """
import json, sys, pytest
from tiers import RECORDS

class Printer:
    def pytest_collection_finish(self, session):
        kept, left_out = session.config.stash[RECORDS]
        selected = [item.nodeid for item in session.items]
        self.out = {"kept": kept, "left_out": left_out, "selected": selected}

printer = Printer()
args = [sys.argv[1], "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"]
code = pytest.main(args + sys.argv[2:], plugins=[printer])
print("=== items ===")
print(json.dumps(printer.out))
sys.exit(code)
"""


def _collected(request: pytest.FixtureRequest) -> tuple[list[dict], list[dict], set[str]]:
    """The records of the whole suite's collection (tests/tiers.py) and the node ids a run
    selects: this session's if it collected every test file (``pytest`` does), else a
    collection's in a fresh process, with the session's ``--full-grid`` (``pytest
    tests/test_tiers.py`` takes this way)."""
    kept, left_out = request.config.stash[RECORDS]
    files = {item["nodeid"].split("::")[0] for item in kept + left_out}
    if files >= {f"tests/{path.name}" for path in TESTS.glob("test_*.py")}:
        selected = {item.nodeid for item in request.session.items}
        return kept, left_out, selected
    full_grid = ["--full-grid"] if request.config.getoption("full_grid") else []
    pythonpath = os.environ.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", COLLECT, str(TESTS), *full_grid],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=TESTS.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), pythonpath]))},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    items = json.loads(done.stdout.partition("=== items ===")[2])
    return items["kept"], items["left_out"], set(items["selected"])


@pytest.mark.slow
def test_the_default_run_covers_what_it_leaves_out(request: pytest.FixtureRequest) -> None:
    """The whole suite as ``pytest`` collects it: the tests it leaves out are covered by
    the tests it runs (module docstring), and it runs none of them."""
    kept, left_out, selected = _collected(request)
    assert left_out, "the default run leaves nothing out: is --full-grid's deselection gone?"
    left_out_ids = {i["nodeid"] for i in left_out}
    assert not {i["nodeid"] for i in kept} & left_out_ids
    if not request.config.getoption("full_grid"):
        assert not left_out_ids & selected, "a test left out is run"
    problems = uncovered(kept, left_out)
    assert not problems, "\n".join(problems)
    # the exactness grid: its covering subset by default, every run with --full-grid
    from test_exactness import EXACT_COMBOS, EXACT_SUBSET, MODEL_CLASSES, N_RUNS, SUBSET

    def runs(items: list[dict]) -> int:
        return sum(i["function"] in EXACTNESS_RUNS for i in items)

    assert runs(kept) == len(SUBSET) + len(EXACT_SUBSET)
    assert runs(kept) + runs(left_out) == N_RUNS + len(EXACT_COMBOS) * len(MODEL_CLASSES)
    # every entry of COVERED_ELSEWHERE is a test left out (no stale entries)
    names = left_out_ids | {i["function"] for i in left_out}
    stale = set(COVERED_ELSEWHERE) - names
    assert not stale, f"COVERED_ELSEWHERE names tests the default run does not leave out: {stale}"


def _item(function: str, param_id: str = "") -> dict:
    nodeid = f"{function}[{param_id}]" if param_id else function
    return {"nodeid": nodeid, "function": function, "id": param_id, "markers": ["full_grid"]}


def test_negative_control_a_value_only_left_out_is_seen() -> None:
    """The check sees a thinned grid that drops a value, a test left out whole without a
    covering test, and a negative control left out; it accepts a covering subset."""
    f = "tests/test_x.py::test_grid"
    kept = [_item(f, "logistic-rwmh"), _item(f, "robust-nuts")]
    assert uncovered(kept, [_item(f, "robust-rwmh"), _item(f, "logistic-nuts")]) == []
    (problem,) = uncovered(kept, [_item(f, "softmax-rwmh")])
    assert "['softmax']" in problem
    (problem,) = uncovered(kept, [_item("tests/test_x.py::test_alone")])
    assert "left out whole" in problem
    problems = uncovered(kept, [_item("tests/test_x.py::test_negative_control_flip")])
    assert any("a negative control left out" in p for p in problems)
