"""Test-session set-up, before numpy is loaded: one BLAS thread per process, and on
x86-64 the CPU kernels the bit-for-bit fixtures were recorded with.

The suite starts Dask worker processes beside the test process on 2 cores;
multithreaded BLAS in every process makes small matrix products 10–50× slower.

``tests/data/reference_draws.npz`` and ``tests/data/austerity_golden.npz`` hold draws
to compare bit for bit. OpenBLAS picks its kernels by CPU when it loads, and numpy its
SIMD loops (``exp``, ``log``, reductions): on an AVX-512 machine both differ from the
AVX2 code the files were recorded with and round differently in the last bit, which
changes every draw after the first. On any x86-64-v3 CPU the recorded choice is pinned
(:data:`RECORDED_CPU`, unless set otherwise); workers started by the tests inherit it.
Where it cannot be, the bit-for-bit tests skip through the :func:`recorded_cpu`
fixture, saying why.
"""

import contextlib
import functools
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# the property tests draw the same examples on every run (a seed per test): a run fails
# or passes as the one before it did, and an example worth keeping is written down with
# @example (test_numerics' logsumexp near 0 was found by a CI run's own draws)
settings.register_profile("flymc", derandomize=True)
settings.load_profile("flymc")

#: what the bit-for-bit fixtures were recorded with: OpenBLAS's kernels for Haswell and
#: numpy's (>= 2.4) SIMD dispatch up to x86-64-v3 (AVX2), set before numpy loads
RECORDED_CPU = {"OPENBLAS_CORETYPE": "Haswell", "NPY_ENABLE_CPU_FEATURES": "X86_V3"}
#: the CPU flags (as Linux names them) both need: x86-64-v3
X86_V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"})


def _cpu_flags() -> set[str]:
    """This CPU's flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def _cpu_mismatch() -> str | None:
    """Pin :data:`RECORDED_CPU` if this session can; else say why it cannot."""
    why = "the bit-for-bit fixtures were recorded with " + ", ".join(
        f"{k}={v}" for k, v in RECORDED_CPU.items()
    )
    machine = platform.machine()
    if machine.lower() not in ("x86_64", "amd64") or not X86_V3_FLAGS <= _cpu_flags():
        return f"{why}, which this CPU ({machine}) cannot run"
    numpy_version = tuple(int(p) for p in version("numpy").split(".")[:2])
    if numpy_version < (2, 4):
        return f"{why}; numpy {version('numpy')} names its CPU features differently"
    for key, value in RECORDED_CPU.items():
        if os.environ.setdefault(key, value) != value:
            return f"{why}; {key} is set to {os.environ[key]!r}"
    return None


#: why this session cannot reproduce the recorded draws, or None if it can
CPU_MISMATCH = _cpu_mismatch()
#: numpy loaded before this file (by a pytest plugin): the pins came too late
NUMPY_LOADED_EARLY = "numpy" in sys.modules


@pytest.fixture
def recorded_cpu() -> None:
    """Skip a bit-for-bit comparison with recorded draws where this session's CPU kernels
    (OpenBLAS's, numpy's SIMD) are not those they were recorded with (module docstring)."""
    if CPU_MISMATCH is not None:
        pytest.skip(CPU_MISMATCH)
    if NUMPY_LOADED_EARLY:
        pytest.fail(
            "numpy was loaded before tests/conftest.py could pin the recorded CPU kernels "
            "(by a pytest plugin? block it with -p no:NAME in pyproject's addopts)"
        )


@pytest.fixture
def force_exact_rows(monkeypatch):
    """``force(column, threshold)``: :func:`exact_rows.force_exact_rows` for this test (make
    ``exact_rows="auto"`` pick the rows with ``x[:, column]² ≥ threshold``)."""
    from exact_rows import force_exact_rows as force

    return functools.partial(force, monkeypatch)


class LocalClusters:
    """Started :class:`distributed.LocalCluster` s shared by the tests, one per worker
    count: the package's own recipe (:func:`flymc_dist.transport.dask.local_cluster`).

    Starting one costs seconds (the worker processes import the package): a test that
    does not depend on fresh workers (one that kills a worker, limits their memory or sets
    their environment does) takes its cluster from here and makes its own client for it,
    with the options it needs.
    """

    def __init__(self) -> None:
        self._clusters: dict[int, object] = {}

    def get(self, n_workers: int) -> object:
        """The shared cluster with ``n_workers`` workers (started on first use)."""
        if n_workers not in self._clusters:
            from flymc_dist.transport.dask import local_cluster

            self._clusters[n_workers] = local_cluster(n_workers)
        return self._clusters[n_workers]

    def close(self) -> None:
        """Close every cluster started here."""
        while self._clusters:
            self._clusters.popitem()[1].close()


#: the shared small runs' data (:func:`synthetic.logistic_rows`) and sizes
SMALL_ROWS, SMALL_RUN = 60, dict(num_warmup=60, num_samples=40, chains=2, seed=5)


@pytest.fixture(scope="session")
def small_run():
    """``small_run(algorithm, kernel)``: one small in-process run of logistic regression
    on the shared synthetic data (``logistic_rows(SMALL_ROWS)``, :data:`SMALL_RUN`'s
    sizes), made on first use and shared by every test of the session (of the xdist
    worker) that reads one aspect of it (its stats, names, summary). Read it, never
    change it: a test that needs other settings makes its own run."""
    from synthetic import logistic_rows

    import flymc_dist as fd

    runs: dict[tuple[str, str], object] = {}

    def get(algorithm: str, kernel: str) -> fd.Result:
        if (algorithm, kernel) not in runs:
            runs[algorithm, kernel] = fd.sample(
                fd.LogisticRegression(),
                logistic_rows(SMALL_ROWS),
                algorithm,
                kernel,
                client="synchronous",
                progress=False,
                **SMALL_RUN,
            )
        return runs[algorithm, kernel]

    return get


#: the session's shared LocalClusters (:func:`local_clusters`)
SHARED_CLUSTERS = LocalClusters()


@pytest.fixture(scope="session")
def local_clusters():
    """The session's shared LocalClusters (:class:`LocalClusters`), closed at its end or
    when the tests that start processes are done (:func:`pytest_runtest_teardown`)."""
    try:
        yield SHARED_CLUSTERS
    finally:
        SHARED_CLUSTERS.close()


#: the xdist group of the tests that start processes (Dask clusters, command-line tools,
#: network namespaces): one worker runs them one after another, beside the other workers'
#: in-process tests, so that they never compete for the cores with each other
PROCESS_GROUP = "processes"


def _xdist_group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return mark.args[0] if mark.args else mark.kwargs.get("name")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """On a pytest-xdist worker, after the last test of :data:`PROCESS_GROUP` (which the
    worker runs one after another): close the shared clusters, whose idle workers would
    otherwise take CPU from every later test until the session ends (measured idle: 8 % of
    a core for one worker, 11 % for two). A later test that asks for one starts it
    again."""
    yield
    if not hasattr(item.config, "workerinput") or _xdist_group(item) != PROCESS_GROUP:
        return
    if nextitem is None or _xdist_group(nextitem) != PROCESS_GROUP:
        SHARED_CLUSTERS.close()


#: the markers of the tests that run only with ``--full-grid``
CI_ONLY_MARKERS = ("full_grid", "full_scale", "full_e2e")


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--full-grid``: run every configuration of the statistical grids, the tests at full
    scale and the end-to-end runs another test covers (CI does; tests/test_tiers.py checks
    that the default run covers what it leaves out)."""
    parser.addoption(
        "--full-grid",
        action="store_true",
        help="run every configuration of the statistical grids (the exactness grid of "
        "tests/test_exactness.py and others), not only their covering subsets, the memory "
        "bounds at full scale and the end-to-end runs whose path other tests cover (the "
        "tests marked " + ", ".join(CI_ONLY_MARKERS) + " are deselected without it)",
    )


def _ci_only(item: pytest.Item) -> bool:
    """Whether ``item`` runs only with ``--full-grid`` (a marker of :data:`CI_ONLY_MARKERS`)."""
    return any(item.get_closest_marker(m) is not None for m in CI_ONLY_MARKERS)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Record what a default run keeps and leaves out (:data:`tiers.RECORDS`); deselect
    the tests marked with :data:`CI_ONLY_MARKERS` unless pytest runs with ``--full-grid``;
    put the tests marked ``cluster`` (or using :func:`local_clusters`) in
    :data:`PROCESS_GROUP`, before pytest-xdist reads the groups."""
    from tiers import RECORDS, record_of

    kept: list[pytest.Item] = []
    left_out: list[pytest.Item] = []
    for item in items:
        (left_out if _ci_only(item) else kept).append(item)
    config.stash[RECORDS] = ([record_of(i) for i in kept], [record_of(i) for i in left_out])
    if left_out and not config.getoption("full_grid"):
        items[:] = kept
        config.hook.pytest_deselected(items=left_out)
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        if item.get_closest_marker("cluster") is not None or "local_clusters" in getattr(
            item, "fixturenames", ()
        ):
            item.add_marker(pytest.mark.xdist_group(PROCESS_GROUP))


#: the source files of the package's cached numba kernels (tests/precompile.py compiles them)
KERNEL_FILES = (
    "streams.py",
    "_compiled.py",
    "_compiled_kernels.py",
    "_compiled_loop.py",
    "shard/rows.py",
    "shard/rowfile.py",
    "jointdpm/niw.py",
    "jointdpm/shard.py",
    "jointdpm/splitmerge.py",
    "jointdpm/sampler.py",
)
#: the report header's and summary's lines on compiling the kernels ahead
PRECOMPILED = pytest.StashKey[list[str]]()
#: the folder where the parts say they are done (a file each), and its key in
#: pytest-xdist's ``workerinput``
PRECOMPILE_FOLDER = pytest.StashKey[Path]()
PRECOMPILE_DIR = "flymc_precompile_dir"
#: how long an xdist worker waits for the compiling ahead before it runs its tests anyway
PRECOMPILE_WAIT = 600.0


def _stale_kernels(package: Path) -> bool:
    """Whether some kernel file of ``package`` has no numba cache in its ``__pycache__``
    written since the file last changed (its kernels would then be compiled again)."""
    for name in KERNEL_FILES:
        source = package / name
        index = list((source.parent / "__pycache__").glob(f"{source.stem}.*.nbi"))
        if not index or max(p.stat().st_mtime for p in index) < source.stat().st_mtime:
            return True
    return False


def _drop_kernel_caches(package: Path) -> None:
    """Remove every kernel file's numba cache. Numba checks a cached function against
    its own file only: a kernel that calls one of another file (the compiled loop calls
    the transitions and the z-update) keeps the callee's old code, inlined, after only
    the callee's file changed — the tests would run the old code and pass. Once one
    kernel file is stale, all are compiled again."""
    for folder in {(package / name).parent / "__pycache__" for name in KERNEL_FILES}:
        for cached in (*folder.glob("*.nbi"), *folder.glob("*.nbc")):
            cached.unlink(missing_ok=True)


def _await_part(proc: subprocess.Popen, part: int, folder: Path, lines: list[str]) -> None:
    """Wait for part ``part`` of tests/precompile.py (``proc``), then say how it went in
    ``lines`` and leave ``folder/<part>`` for the workers waiting on it."""
    t0 = time.perf_counter()
    err = proc.communicate()[1]
    if proc.returncode == 0:
        lines.append(f"part {part} took {time.perf_counter() - t0:.0f} s")
    else:
        lines.append(f"part {part} failed ({(err.strip().splitlines() or ['no message'])[-1]})")
    with contextlib.suppress(OSError):  # the session may have ended (and removed it)
        (folder / str(part)).touch()


def pytest_configure(config: pytest.Config) -> None:
    """On pytest-xdist's controller, where the kernels' cache is missing or older than
    their files (a clean clone, an edited kernel): drop it (:func:`_drop_kernel_caches`)
    and start compiling them once, in the two parts of ``tests/precompile.py`` side by
    side, so that the workers and their Dask workers load them instead of each compiling
    them (measured: the tests' processes compiled each kernel up to four times on a clean
    clone). The workers start and collect the tests meanwhile, and wait for both parts
    before their first test (:func:`pytest_runtestloop`)."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    spec = importlib.util.find_spec("flymc_dist")
    if config.option.collectonly or spec is None or spec.origin is None:
        return
    package = Path(spec.origin).parent
    if not _stale_kernels(package):
        return
    _drop_kernel_caches(package)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(package.parent), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("precompile.py")
    folder = Path(tempfile.mkdtemp(prefix="flymc-precompile-"))
    config.add_cleanup(functools.partial(shutil.rmtree, folder, ignore_errors=True))
    lines: list[str] = []
    config.stash[PRECOMPILED] = lines
    config.stash[PRECOMPILE_FOLDER] = folder
    for part in (0, 1):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(part)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        config.add_cleanup(proc.kill)  # a session ended early stops it (no-op once done)
        threading.Thread(target=_await_part, args=(proc, part, folder, lines), daemon=True).start()


def pytest_configure_node(node: Any) -> None:
    """Tell each pytest-xdist worker where the parts started by :func:`pytest_configure`
    say they are done."""
    folder = node.config.stash.get(PRECOMPILE_FOLDER, None)
    if folder is not None:
        node.workerinput[PRECOMPILE_DIR] = str(folder)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """On a pytest-xdist worker, after collecting: wait until both parts of the compiling
    ahead are done (at most :data:`PRECOMPILE_WAIT` s), so that no test compiles what they
    compile."""
    folder = getattr(session.config, "workerinput", {}).get(PRECOMPILE_DIR)
    if folder is None:
        return
    deadline = time.monotonic() + PRECOMPILE_WAIT
    while time.monotonic() < deadline and not all(
        (Path(folder) / str(part)).exists() for part in (0, 1)
    ):
        time.sleep(0.05)


def pytest_report_header(config: pytest.Config) -> str | None:
    """Say that the kernels are being compiled ahead, where :func:`pytest_configure`
    started it."""
    if PRECOMPILED not in config.stash:
        return None
    return "numba kernels: compiling ahead (tests/precompile.py) while the workers start"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """How long the compiling ahead took (each part, from its start), if it ran."""
    lines = config.stash.get(PRECOMPILED, None)
    if lines:
        terminalreporter.write_line("numba kernels compiled ahead: " + "; ".join(sorted(lines)))
