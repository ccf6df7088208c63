"""Reference draws: refactors keep the draws, bit for bit.

What this fixture is for
------------------------
``tests/data/reference_draws.npz`` holds the draws (``res.samples``) and the
per-iteration statistics ``accepted``, ``n_bright``, ``likelihood_queries`` and
``log_joint`` of every configuration in :data:`CONFIGS`, recorded from the code
at the commit named in the file (``__meta__commit``). A restructure, an
optimisation or a new feature that is meant to leave the existing samplers
unchanged must reproduce every one of them exactly: :func:`test_reference_draws`
reruns each configuration and compares with ``np.array_equal`` (``log_joint``
with ``equal_nan=True``: austerity records NaN there). Statistical tests show a
sampler is *right*; this file shows it is *unchanged*.

The configurations are small (300 rows, 2 shards, 2 chains, 50 warm-up + 40
kept draws) and cover every algorithm ("flymc", "regular", "austerity") ×
kernel ("rwmh", "mala", "slice"; austerity has only "rwmh") × z-update
("implicit", "explicit") × bounds ("map", "untuned"), over the three models,
so that each model meets each algorithm and each kernel; data in memory and in
a zarr store; in-process and on a 1- and a 2-worker LocalCluster (the same
draws as in-process, which :func:`test_recorded_twins_agree` checks on the
recorded file); a run interrupted and resumed from its trace, beside the same
run uninterrupted; and a run that loses a worker (SIGKILL) at a fixed iteration.
"regular" and "austerity" ignore ``z_update`` and ``bounds`` today; their
configurations pass varied values anyway, so the draws also pin down that the
values stay ignored.

Two runs recorded beside their twins, and what they show today:

* **resumed** (interrupted by an exception raised from ``Driver.step`` before
  iteration 65, checkpoints every 10 iterations, then ``resume=True``) agrees
  with **uninterrupted** (the same run with a trace, never stopped; itself
  equal to the run without a trace) on the first 10 kept draws (what the trace
  held at the interruption), and not after: a resumed run redraws every chain's z exactly from
  ``p(z | θ)`` (generation 1 of the z streams) instead of restoring it, a valid
  Gibbs move that changes the draws. Both are recorded.
* **recovered**: the worker holding shard 1 is SIGKILLed from a patched
  ``Driver.step`` just before iteration 60 and the test waits until the process
  is dead before the step runs. The step's first round fails on the dead
  worker at once, the lost shard is recreated on a live worker and its z redrawn
  exactly at the chains' positions (z streams keyed by row, chain, step and
  recovery generation, never by shard or worker), and the round replayed. Nothing in
  this depends on timing or placement, so the whole run is deterministic
  (checked by repeated runs when it was recorded); it equals its fault-free twin
  up to the fault (the first 10 kept draws) and differs after it. The runner
  raises if the fault did not happen as designed (one recovery, of shard 1, in
  that iteration).

Re-recording
------------
::

    PYTHONPATH=$PWD python tests/test_reference_draws.py --record

regenerates the file from :data:`CONFIGS` (it starts a LocalCluster for the
cluster configurations). **Re-recording is allowed only with a documented
reason**: a defect fix (or a deliberate change of a sampler) that changes draws,
named in the commit message that changes the .npz, with the configurations it
changes. A refactor that fails this test has changed the draws: find out why,
do not re-record. Adding configurations (with a re-record that leaves the
existing entries bit-identical) needs no more reason than that.

Re-recorded on 2026-11-25 for the row-keyed streams (:mod:`flymc_dist.streams`): every
FlyMC configuration's z-updates draw from new streams, full passes sum by fixed blocks,
and ``bright_replica="auto"`` now takes the replica for RWMH too, so every entry changed.

Configurations added on 2026-11-26 (the others bit-identical): NUTS and HMC were not
recorded at all, nor the default path (NUTS on the driver's replica), where a refactor
of the compiled log L~ changed the draws unnoticed.

Re-recorded on 2026-11-26: the tight points at θ̂ are computed row by row
(:func:`flymc_dist._compiled.row_dots`) instead of by one BLAS product, so that an
out-of-core shard preparing only the rows it reads gets the same bits. Only the
MAP-tuned FlyMC configurations changed (six entries); the other 24 are bit-identical.

Re-recorded on 2026-11-26 (later): the slice sampler's default directions became the
preconditioner's principal axes (``directions="axes"``; hit-and-run before), a deliberate
change of the sampler. Only the eight slice configurations changed; the others are
bit-identical.

Re-recorded on 2026-11-28 so that no algorithm's draws depend on the layout (issue 41,
item 5): a round's sums — regular MCMC's full-data sums and FlyMC's shard-evaluated
bright sums (``bright_replica=False``) — are taken per fixed block (each block's rows
evaluated alone) and added along the fixed block tree of :mod:`flymc_dist.reduce`,
instead of per shard and then shard by shard; and austerity draws each decision's rows
from a keyed permutation of all N rows on the driver (:func:`flymc_dist.streams.permuted_rows`)
instead of per-shard counts and per-shard streams. Changed: the three austerity entries
(other rows, other draws); every regular entry and the shard-evaluated FlyMC entries of
untuned bounds, MALA, HMC or the robust/softmax models in the last bits of ``log_joint``
and (through adaptation) of the draws (at most 5e-6 for HMC, 2e-12 otherwise). Unchanged
bit for bit: the replica entries and the nine others listed by the re-recording commit.

Re-recorded on 2026-11-29, ``likelihood_queries`` of the three austerity entries only: a
test's trip to the shards now carries several minibatches (doubling from trip to trip),
the test takes them one at a time with the same decisions, and the queries count every
row the shards computed, the unused rest of a last trip included. Every other array of
the file, the austerity draws included, was checked unchanged bit for bit before the
three were replaced.

Configuration added on 2026-11-29 (every other entry bit-identical): random-walk MH on
the driver's replica (``bright_replica="auto"``), whose transition is now compiled
(:func:`flymc_dist._compiled_kernels.rwmh_transition`), per iteration and a read-ahead
block at a time; no entry pinned that path before (the others run with the shards
evaluating).

Configurations added on 2026-11-30 (every other entry bit-identical): NUTS and random-walk
MH on the replica of a wide logistic model (P = 20, :data:`MODELS`). Every other entry
has P = 3, narrower than the blocks the compiled code takes at a time: a mat-vec
rewritten eight rows at a time changed NUTS's draws at P = 20 while every entry here
passed (at P = 10 it gave the same draws too).

The data sets are made here by numpy from fixed seeds and also stored in the
file; :func:`test_reference_draws` first checks that they are regenerated
identically, so that a change of numpy's random streams is reported as such,
not as a change of the sampler.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy.special import expit

import flymc_dist as fd
from flymc_dist.driver import Driver

DATA_FILE = Path(__file__).resolve().parent / "data" / "reference_draws.npz"
STAT_KEYS = ("accepted", "n_bright", "likelihood_queries", "log_joint")
N_ROWS, CHUNK_ROWS, N_SHARDS = 300, 50, 2
#: 50 warm-up iterations: with 20, RWMH's dual averaging (which starts by trying 10× the
#: initial step) left acceptance at 0.02-0.1 and the draws barely moving
CHAINS, WARMUP, DRAWS = 2, 50, 40
#: the models' data sets (:func:`make_data`): three of P = 3, and a logistic one of P =
#: 20, wider than the blocks the compiled kernels' code runs in (the compiler's vectors
#: take a sum 16 terms at a time, a hand-written block 4 or 8 rows), with a remainder: at
#: P = 3, and up to P = 12, none of that code runs, and a change to it could change the
#: draws of every wider model unseen
MODELS = ("logistic", "robust", "softmax", "wide")
WIDE_BETA = np.array([0.5, -1.0, 0.8, 0.3, -0.4, 0.6, 0.0, -0.7, 0.2, 0.5] * 2)
#: kept draws that twins share before a resume or a fault
SHARED_DRAWS = 10
#: resumed runs: checkpoints every 10 iterations; the interruption comes before iteration
#: 65 (0-based), so the trace holds iterations 0..59: the warm-up and 10 kept draws
CHECKPOINT_EVERY, INTERRUPT_AT_CALL = 10, WARMUP + SHARED_DRAWS + 6
#: recovered run: the worker holding shard 1 dies before iteration 60 (0-based), i.e. the
#: 61st call of Driver.step: the warm-up and 10 kept draws come before the fault
KILL_AT_CALL, KILLED_SHARD = WARMUP + SHARED_DRAWS + 1, 1


@dataclass(frozen=True)
class Config:
    """One recorded run of :func:`flymc_dist.sample`.

    Attributes
    ----------
    name
        Key of its arrays in the data file (``<name>__samples``, ``<name>__<stat>``).
    model
        ``"logistic"``, ``"robust"`` or ``"softmax"`` (see :func:`make_model`).
    algorithm, kernel, z_update, bounds
        As for :func:`flymc_dist.sample`.
    data
        ``"memory"``: an ``(X, y)`` pair; ``"zarr"``: a store written by ``fd.from_numpy``.
    workers
        0: ``client="synchronous"``; n: a LocalCluster with n workers.
    mode
        ``"plain"``; ``"uninterrupted"`` (with a trace); ``"resumed"`` (interrupted,
        then resumed from the trace); ``"recovered"`` (a worker SIGKILLed mid-run).
    options
        Further ``fd.sample`` options, as ``(key, value)`` pairs.
    seed
        The run's seed (the same for all; the negative control changes it).
    twin, twin_draws
        A configuration whose recorded arrays must equal this one's: all of them
        (``twin_draws`` None) or the first ``twin_draws`` kept draws.
    """

    name: str
    model: str
    algorithm: str
    kernel: str
    z_update: str = "implicit"
    bounds: str = "map"
    data: str = "memory"
    workers: int = 0
    mode: str = "plain"
    options: tuple[tuple[str, Any], ...] = ()
    twin: str | None = None
    twin_draws: int | None = field(default=None)
    seed: int = 7


_AUS = (("eps", 0.05), ("tails", "two"), ("batch_size", 40))
_REPLICA = (("bright_replica", "auto"),)

#: the table. FlyMC: 3 kernels × 4 (z_update, bounds), each kernel on every model;
#: regular: every model × kernel; austerity: every model; then cluster, resume, fault.
CONFIGS: tuple[Config, ...] = (
    # ------------------------------------------------------------------ flymc
    Config(
        "logistic-flymc-rwmh-implicit-map-zarr",
        "logistic",
        "flymc",
        "rwmh",
        "implicit",
        "map",
        data="zarr",
    ),
    Config("robust-flymc-rwmh-implicit-untuned", "robust", "flymc", "rwmh", "implicit", "untuned"),
    Config(
        "softmax-flymc-rwmh-explicit-map-zarr",
        "softmax",
        "flymc",
        "rwmh",
        "explicit",
        "map",
        data="zarr",
    ),
    Config(
        "logistic-flymc-rwmh-explicit-untuned", "logistic", "flymc", "rwmh", "explicit", "untuned"
    ),
    Config(
        "robust-flymc-mala-implicit-map-zarr",
        "robust",
        "flymc",
        "mala",
        "implicit",
        "map",
        data="zarr",
    ),
    Config(
        "softmax-flymc-mala-implicit-untuned", "softmax", "flymc", "mala", "implicit", "untuned"
    ),
    Config("logistic-flymc-mala-explicit-map", "logistic", "flymc", "mala", "explicit", "map"),
    Config(
        "robust-flymc-mala-explicit-untuned-zarr",
        "robust",
        "flymc",
        "mala",
        "explicit",
        "untuned",
        data="zarr",
    ),
    Config("softmax-flymc-slice-implicit-map", "softmax", "flymc", "slice", "implicit", "map"),
    Config(
        "logistic-flymc-slice-implicit-untuned-zarr",
        "logistic",
        "flymc",
        "slice",
        "implicit",
        "untuned",
        data="zarr",
    ),
    Config(
        "robust-flymc-slice-explicit-map-zarr",
        "robust",
        "flymc",
        "slice",
        "explicit",
        "map",
        data="zarr",
    ),
    Config(
        "softmax-flymc-slice-explicit-untuned", "softmax", "flymc", "slice", "explicit", "untuned"
    ),
    # ---------------------------------------------------------------- regular
    # the default path: NUTS, its whole transition compiled on the driver's replica of
    # the bright rows (bright_replica="auto"); and NUTS with the shards evaluating
    Config(
        "logistic-flymc-nuts-implicit-map-replica",
        "logistic",
        "flymc",
        "nuts",
        "implicit",
        "map",
        options=_REPLICA,
    ),
    Config(
        "robust-flymc-nuts-implicit-map-replica",
        "robust",
        "flymc",
        "nuts",
        "implicit",
        "map",
        data="zarr",
        options=_REPLICA,
    ),
    # NUTS and random-walk MH on the replica of the wide model (2026-11-30): NUTS's dense
    # metric of 20 × 20, the z-update's linear predictors over 20 features
    *(
        Config(f"wide-flymc-{k}-implicit-map-replica", "wide", "flymc", k, options=_REPLICA)
        for k in ("nuts", "rwmh")
    ),
    # random-walk MH on the replica: its transition compiled too (2026-11-29)
    Config(
        "logistic-flymc-rwmh-implicit-map-replica",
        "logistic",
        "flymc",
        "rwmh",
        "implicit",
        "map",
        options=_REPLICA,
    ),
    Config(
        "logistic-flymc-hmc-implicit-untuned", "logistic", "flymc", "hmc", "implicit", "untuned"
    ),
    Config("logistic-regular-nuts", "logistic", "regular", "nuts"),
    Config("logistic-regular-rwmh", "logistic", "regular", "rwmh"),
    Config(
        "robust-regular-rwmh-zarr", "robust", "regular", "rwmh", "explicit", "untuned", data="zarr"
    ),
    Config("softmax-regular-rwmh", "softmax", "regular", "rwmh", "explicit", "map"),
    Config(
        "logistic-regular-mala-zarr",
        "logistic",
        "regular",
        "mala",
        "implicit",
        "untuned",
        data="zarr",
    ),
    Config("robust-regular-mala", "robust", "regular", "mala"),
    Config(
        "softmax-regular-mala-zarr",
        "softmax",
        "regular",
        "mala",
        "explicit",
        "untuned",
        data="zarr",
    ),
    Config("logistic-regular-slice", "logistic", "regular", "slice", "explicit", "map"),
    Config("robust-regular-slice", "robust", "regular", "slice", "implicit", "untuned"),
    Config("softmax-regular-slice-zarr", "softmax", "regular", "slice", data="zarr"),
    # -------------------------------------------------------------- austerity
    Config("logistic-austerity-rwmh", "logistic", "austerity", "rwmh", options=_AUS),
    Config(
        "robust-austerity-rwmh-zarr",
        "robust",
        "austerity",
        "rwmh",
        "explicit",
        "untuned",
        data="zarr",
        options=_AUS,
    ),
    Config(
        "softmax-austerity-rwmh",
        "softmax",
        "austerity",
        "rwmh",
        "implicit",
        "untuned",
        options=_AUS,
    ),
    # ---------------------------------------------------------------- cluster
    Config(
        "robust-flymc-slice-explicit-map-zarr-1worker",
        "robust",
        "flymc",
        "slice",
        "explicit",
        "map",
        data="zarr",
        workers=1,
        twin="robust-flymc-slice-explicit-map-zarr",
    ),
    Config(
        "logistic-flymc-rwmh-implicit-map-zarr-2workers",
        "logistic",
        "flymc",
        "rwmh",
        "implicit",
        "map",
        data="zarr",
        workers=2,
        twin="logistic-flymc-rwmh-implicit-map-zarr",
    ),
    Config(
        "softmax-regular-mala-zarr-2workers",
        "softmax",
        "regular",
        "mala",
        "explicit",
        "untuned",
        data="zarr",
        workers=2,
        twin="softmax-regular-mala-zarr",
    ),
    Config(
        "logistic-flymc-rwmh-implicit-map-zarr-2workers-recovered",
        "logistic",
        "flymc",
        "rwmh",
        "implicit",
        "map",
        data="zarr",
        workers=2,
        mode="recovered",
        options=(("timeout", 30.0),),
        twin="logistic-flymc-rwmh-implicit-map-zarr-2workers",
        twin_draws=SHARED_DRAWS,
    ),
    # ----------------------------------------------------------------- resume
    Config(
        "robust-flymc-rwmh-implicit-untuned-uninterrupted",
        "robust",
        "flymc",
        "rwmh",
        "implicit",
        "untuned",
        mode="uninterrupted",
        twin="robust-flymc-rwmh-implicit-untuned",
    ),
    Config(
        "robust-flymc-rwmh-implicit-untuned-resumed",
        "robust",
        "flymc",
        "rwmh",
        "implicit",
        "untuned",
        mode="resumed",
        twin="robust-flymc-rwmh-implicit-untuned-uninterrupted",
        twin_draws=SHARED_DRAWS,
    ),
)

_BY_NAME = {c.name: c for c in CONFIGS}
if len(_BY_NAME) != len(CONFIGS):  # pragma: no cover - a typo in the table
    raise RuntimeError("duplicate configuration names in CONFIGS")


# ------------------------------------------------------------------- data and models
def make_data(model: str) -> tuple[np.ndarray, np.ndarray]:
    """The deterministic synthetic data set of ``model``: bias column + 2 features (19
    for ``"wide"``, a logistic model of :data:`WIDE_BETA`)."""
    seed = {"logistic": 101, "robust": 102, "softmax": 103, "wide": 104}[model]
    rng = np.random.default_rng(seed)
    X = np.c_[
        np.ones(N_ROWS), rng.normal(size=(N_ROWS, WIDE_BETA.size - 1 if model == "wide" else 2))
    ]
    if model == "wide":
        y = (rng.random(N_ROWS) < expit(X @ WIDE_BETA)).astype(np.int64)
    elif model == "logistic":
        y = (rng.random(N_ROWS) < expit(X @ np.array([0.5, -1.0, 0.8]))).astype(np.int64)
    elif model == "robust":
        y = X @ np.array([1.0, 2.0, -1.0]) + 0.5 * rng.standard_t(4.0, size=N_ROWS)
    else:
        W = np.array([[0.0, 1.0, -1.0], [0.5, -1.0, 0.5], [-0.5, 0.0, 1.0]])
        y = np.argmax(X @ W.T + rng.gumbel(size=(N_ROWS, 3)), axis=1).astype(np.int64)
    return X, y


def make_model(model: str) -> Any:
    """A fresh model object."""
    if model in ("logistic", "wide"):
        return fd.LogisticRegression(prior="normal", prior_scale=2.0)
    if model == "robust":
        return fd.RobustRegression(nu=4.0, scale=1.0, prior="laplace", prior_scale=2.0)
    return fd.SoftmaxRegression(n_classes=3, prior="normal", prior_scale=2.0)


# ----------------------------------------------------------------- Driver.step hooks
class _Interrupted(Exception):
    """Raised from a patched ``Driver.step`` to interrupt a run."""


@contextmanager
def _before_step(at_call: int, action: Callable[[Driver], None]) -> Iterator[dict[str, int]]:
    """Run ``action(driver)`` just before the ``at_call``-th call of ``Driver.step``."""
    real = Driver.step
    calls = {"n": 0}

    def step(self: Driver, adapters: list[Any] | None = None) -> dict[str, np.ndarray]:
        calls["n"] += 1
        if calls["n"] == at_call:
            action(self)
        return real(self, adapters)

    Driver.step = step
    try:
        yield calls
    finally:
        Driver.step = real


def _interrupt(driver: Driver) -> None:
    raise _Interrupted


def _is_dead(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie not yet reaped)."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _killer(client: Any, shard_id: int, done: dict[str, Any]) -> Callable[[Driver], None]:
    """An action that SIGKILLs the worker holding ``shard_id`` and waits until it is dead."""

    def kill(driver: Driver) -> None:
        placement = driver.transport.placement
        victim = next(
            w for w, specs in placement.items() if any(s.shard_id == shard_id for s in specs)
        )
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while not _is_dead(pid):
            if time.monotonic() - t0 > 30:
                raise TimeoutError(f"worker {victim} (pid {pid}) did not die")
            time.sleep(0.01)
        done.update(worker=victim, pid=pid)

    return kill


# ----------------------------------------------------------------------- the runner
def run_config(
    cfg: Config, workdir: Path, client_for: Callable[[int], Any] | None = None
) -> dict[str, np.ndarray]:
    """Run ``cfg`` and return its recorded arrays: ``samples`` and :data:`STAT_KEYS`.

    Parameters
    ----------
    cfg
        The configuration.
    workdir
        An empty directory for its zarr store and trace.
    client_for
        ``client_for(n)`` returns a ``distributed.Client`` of an n-worker cluster
        (needed only when ``cfg.workers``).
    """
    X, y = make_data(cfg.model)
    if cfg.data == "zarr":
        data: Any = fd.from_numpy(X, y, str(workdir / f"{cfg.model}.zarr"), chunk_rows=CHUNK_ROWS)
    else:
        data = (X, y)
    if cfg.workers:
        if client_for is None:
            raise ValueError(f"{cfg.name} needs a cluster: pass client_for")
        client = client_for(cfg.workers)
    else:
        client = "synchronous"
    extra_opts = dict(cfg.options)
    groups: dict[str, dict[str, Any]] = {"flymc": {}, "austerity": {}, "placement": {}}
    for key, value in extra_opts.items():
        for group, cls in (
            ("flymc", fd.FlyMC),
            ("austerity", fd.Austerity),
            ("placement", fd.Placement),
        ):
            if key in {f.name for f in dataclasses.fields(cls)}:
                groups[group][key] = value
    if cfg.algorithm == "flymc":
        # recorded with the shards evaluating every point the kernel asks for: pinned,
        # since the default ("auto") now runs multi-evaluation kernels on the driver's
        # replica of the bright rows (a new mode, covered by tests/test_replica.py)
        algorithm: Any = fd.FlyMC(
            bounds=cfg.bounds,
            z_update=cfg.z_update,
            **{"bright_replica": False, **groups["flymc"]},
        )
    elif cfg.algorithm == "austerity":
        # recorded as plain austerity: control variates (now the default) change the test
        algorithm = fd.Austerity(**{"control_variates": False, **groups["austerity"]})
    else:
        algorithm = fd.Regular()
    opts: dict[str, Any] = dict(
        algorithm=algorithm,
        kernel=cfg.kernel,
        num_warmup=WARMUP,
        num_samples=DRAWS,
        chains=CHAINS,
        seed=cfg.seed,
        client=client,
        placement=fd.Placement(**{"n_shards": N_SHARDS, **groups["placement"]}),
        progress=False,
    )

    def sample(**extra: Any) -> Any:
        return fd.sample(make_model(cfg.model), data, **{**opts, **extra})

    if cfg.mode == "plain":
        res = sample()
    elif cfg.mode == "uninterrupted":
        res = sample(trace=str(workdir / "trace.zarr"), checkpoint_every=CHECKPOINT_EVERY)
    elif cfg.mode == "resumed":
        trace = str(workdir / "trace.zarr")
        try:
            with _before_step(INTERRUPT_AT_CALL, _interrupt):
                sample(trace=trace, checkpoint_every=CHECKPOINT_EVERY)
        except _Interrupted:
            pass
        else:
            raise RuntimeError(f"{cfg.name}: the run was not interrupted")
        from flymc_dist.trace import Trace

        done = Trace.open(trace).checkpoint["iteration"]
        if done != WARMUP + SHARED_DRAWS - 1:
            raise RuntimeError(
                f"{cfg.name}: checkpoint at iteration {done}, expected {WARMUP + SHARED_DRAWS - 1}"
            )
        res = sample(trace=trace, checkpoint_every=CHECKPOINT_EVERY, resume=True)
    elif cfg.mode == "recovered":
        killed: dict[str, Any] = {}
        with _before_step(KILL_AT_CALL, _killer(client, KILLED_SHARD, killed)):
            res = sample()
        _check_recovery(cfg, res, killed)
    else:
        raise ValueError(f"unknown mode {cfg.mode!r} in {cfg.name}")
    out = {"samples": np.asarray(res.samples)}
    out.update({k: np.asarray(res.stats[k]) for k in STAT_KEYS})
    return out


def _check_recovery(cfg: Config, res: Any, killed: dict[str, Any]) -> None:
    """The fault happened as designed: one recovery, of shard 1, in iteration 60."""
    rec = res.info["recoveries"]
    per_iter = np.concatenate([res.warmup_stats["recoveries"][0], res.stats["recoveries"][0]])
    if (
        "worker" not in killed
        or len(rec) != 1
        or rec[0]["lost_workers"] != [killed["worker"]]
        or rec[0]["shards"] != [KILLED_SHARD]
        or np.flatnonzero(per_iter).tolist() != [KILL_AT_CALL - 1]
    ):
        raise RuntimeError(
            f"{cfg.name}: the fault did not happen as designed: killed={killed}, "
            f"recoveries={rec}, per iteration={np.flatnonzero(per_iter)}"
        )


# ------------------------------------------------------------------------- clusters
class ClusterPool:
    """One LocalCluster (worker processes, one thread each), scaled to what a run needs."""

    def __init__(self) -> None:
        self.cluster: Any = None
        self.client: Any = None

    def client_for(self, n_workers: int) -> Any:
        """A client of the cluster with exactly ``n_workers`` running workers."""
        import logging

        from distributed import Client, LocalCluster

        if self.cluster is None:
            self.cluster = LocalCluster(
                n_workers=n_workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address=":0",
                silence_logs=logging.ERROR,
            )
            self.client = Client(self.cluster, direct_to_workers=True)
        self.cluster.scale(n_workers)
        t0 = time.monotonic()
        while len(self.client.scheduler_info()["workers"]) != n_workers:
            if time.monotonic() - t0 > 120:
                raise TimeoutError(f"the LocalCluster did not reach {n_workers} workers")
            time.sleep(0.05)
        return self.client

    def close(self) -> None:
        """Close the client and the cluster."""
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()
        self.cluster = self.client = None


# ------------------------------------------------------------------------ comparing
def first_difference(key: str, want: np.ndarray, got: np.ndarray) -> str | None:
    """None if equal bit for bit (NaN == NaN for ``log_joint``), else what differs first.

    "First" is the earliest draw (axis 1) in which any chain differs.
    """
    if want.shape != got.shape or want.dtype != got.dtype:
        return (
            f"{key}: recorded shape {want.shape} dtype {want.dtype}, "
            f"got shape {got.shape} dtype {got.dtype}"
        )
    if np.array_equal(want, got, equal_nan=key == "log_joint"):
        return None
    diff = want != got
    if key == "log_joint":
        diff &= ~(np.isnan(want) & np.isnan(got))
    idx = np.argwhere(diff)
    first = tuple(int(i) for i in idx[np.lexsort((idx[:, 0], idx[:, 1]))[0]])
    return (
        f"{key}: first difference at index {first} (chain {first[0]}, draw {first[1]}): "
        f"recorded {want[first].item()!r}, got {got[first].item()!r}; {len(idx)} of "
        f"{want.size} elements differ"
    )


def _load() -> dict[str, np.ndarray]:
    if not DATA_FILE.exists():
        pytest.fail(f"{DATA_FILE} is missing: see this module's docstring to record it")
    with np.load(DATA_FILE) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    """The recorded arrays."""
    return _load()


@pytest.fixture(scope="module")
def shared_clients(local_clusters: Any) -> Iterator[Callable[[int], Any]]:
    """``client_for(n)``: a client of the session's shared n-worker LocalCluster (started
    once for every test that needs one), for the cluster configurations that leave their
    workers as they found them."""
    from distributed import Client

    clients: dict[int, Any] = {}

    def client_for(n_workers: int) -> Any:
        if n_workers not in clients:
            clients[n_workers] = Client(local_clusters.get(n_workers), direct_to_workers=True)
            clients[n_workers].wait_for_workers(n_workers, timeout=120)
        return clients[n_workers]

    try:
        yield client_for
    finally:
        # the last made first: each client, made the default, restores on closing the Dask
        # settings it found (closed in another order, the first one's would stay set)
        for client in reversed(list(clients.values())):
            client.close()


@pytest.fixture(scope="module")
def cluster_pool() -> Iterator[ClusterPool]:
    """A LocalCluster of this module's own, for the configuration that kills a worker."""
    pool = ClusterPool()
    try:
        yield pool
    finally:
        pool.close()


def _param(cfg: Config) -> Any:
    """``cfg`` as a test case: on a cluster, in :data:`~conftest.PROCESS_GROUP`; the run
    that kills a worker (a cluster of its own) with the slow tests, as every fault run."""
    marks = [pytest.mark.cluster] if cfg.workers else []
    if cfg.mode == "recovered":
        marks.append(pytest.mark.slow)
    return pytest.param(cfg, id=cfg.name, marks=marks)


@pytest.mark.parametrize("cfg", [_param(c) for c in CONFIGS])
def test_reference_draws(
    cfg: Config,
    reference: dict[str, np.ndarray],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    recorded_cpu: None,
) -> None:
    """Rerun ``cfg``: its draws and statistics equal the recorded ones bit for bit."""
    X, y = make_data(cfg.model)
    if not (
        np.array_equal(X, reference[f"__data__{cfg.model}__X"])
        and np.array_equal(y, reference[f"__data__{cfg.model}__y"])
    ):
        pytest.fail(
            f"{cfg.name}: make_data({cfg.model!r}) no longer gives the recorded data "
            f"set (numpy's random streams changed?): the comparison is meaningless"
        )
    client_for = None
    if cfg.mode == "recovered":  # it kills a worker: not on the session's shared clusters
        client_for = request.getfixturevalue("cluster_pool").client_for
    elif cfg.workers:
        client_for = request.getfixturevalue("shared_clients")
    got = run_config(cfg, tmp_path, client_for)
    problems = []
    for key in ("samples",) + STAT_KEYS:
        name = f"{cfg.name}__{key}"
        if name not in reference:
            problems.append(f"{key}: not in the recorded file")
            continue
        msg = first_difference(key, reference[name], got[key])
        if msg:
            problems.append(msg)
    if problems:
        pytest.fail(
            f"config {cfg.name!r} does not reproduce its recorded draws:\n  "
            + "\n  ".join(problems)
        )


def test_recorded_twins_agree(reference: dict[str, np.ndarray]) -> None:
    """In the file: cluster runs equal their in-process twins; a resumed run and a run
    that lost a worker equal their twins up to the resume or the fault."""
    problems = []
    for cfg in CONFIGS:
        if cfg.twin is None:
            continue
        n = cfg.twin_draws
        for key in ("samples",) + STAT_KEYS:
            a, b = reference[f"{cfg.name}__{key}"], reference[f"{cfg.twin}__{key}"]
            if n is not None:
                a, b = a[:, :n], b[:, :n]
            msg = first_difference(key, b, a)
            if msg:
                problems.append(f"{cfg.name} vs {cfg.twin}: {msg}")
    assert not problems, "\n".join(problems)


def test_comparison_sees_a_change(reference: dict[str, np.ndarray], tmp_path: Path) -> None:
    """Negative controls: another seed, and one draw moved by one ulp, are reported, with
    the first differing index; NaN equals NaN only in ``log_joint``."""
    cfg = _BY_NAME["logistic-flymc-rwmh-explicit-untuned"]
    other = run_config(replace(cfg, seed=cfg.seed + 1), tmp_path)
    msg = first_difference("samples", reference[f"{cfg.name}__samples"], other["samples"])
    assert msg is not None and "first difference at index (0, 0, " in msg, msg
    want = reference[f"{cfg.name}__samples"]
    got = want.copy()
    got[1, 17, 2] = np.nextafter(got[1, 17, 2], np.inf)
    got[0, 25, 0] = np.nextafter(got[0, 25, 0], np.inf)
    msg = first_difference("samples", want, got)
    assert msg is not None and "index (1, 17, 2)" in msg and "2 of" in msg, msg
    lj = reference["logistic-austerity-rwmh__log_joint"]
    assert np.isnan(lj).all() and first_difference("log_joint", lj, lj.copy()) is None
    assert first_difference("log_joint", lj, np.zeros_like(lj)) is not None
    assert first_difference("samples", want, want.astype(np.float32)) is not None


def test_table_covers_every_combination() -> None:
    """Every algorithm × kernel × z_update × bounds (for FlyMC), every model with every
    algorithm and every kernel."""
    flymc = {(c.kernel, c.z_update, c.bounds) for c in CONFIGS if c.algorithm == "flymc"}
    assert {k for k, _, _ in flymc} == {"rwmh", "mala", "slice", "nuts", "hmc"}
    assert len({f for f in flymc if f[0] in ("rwmh", "mala", "slice")}) == 12
    # the default path: NUTS with the driver's replica
    assert any(c.kernel == "nuts" and ("bright_replica", "auto") in c.options for c in CONFIGS)
    pairs = {(c.model, c.algorithm, c.kernel) for c in CONFIGS}
    for m in ("logistic", "robust", "softmax"):
        for a, kernels in (
            ("flymc", ("rwmh", "mala", "slice")),
            ("regular", ("rwmh", "mala", "slice")),
            ("austerity", ("rwmh",)),
        ):
            for k in kernels:
                assert (m, a, k) in pairs, (m, a, k)
    assert {c.workers for c in CONFIGS} == {0, 1, 2}
    assert {c.mode for c in CONFIGS} == {"plain", "uninterrupted", "resumed", "recovered"}


# ------------------------------------------------------------------------- recorder
def record() -> None:
    """Run every configuration and write :data:`DATA_FILE`."""
    arrays: dict[str, np.ndarray] = {}
    for m in MODELS:
        arrays[f"__data__{m}__X"], arrays[f"__data__{m}__y"] = make_data(m)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    arrays["__meta__commit"] = np.array(commit)
    arrays["__meta__numpy"] = np.array(np.__version__)
    pool = ClusterPool()
    t_all = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for cfg in CONFIGS:
                t0 = time.perf_counter()
                work = Path(tmp) / cfg.name
                work.mkdir()
                out = run_config(cfg, work, pool.client_for)
                for k, v in out.items():
                    arrays[f"{cfg.name}__{k}"] = v
                print(f"{time.perf_counter() - t0:6.2f} s  {cfg.name}", flush=True)
    finally:
        pool.close()
    DATA_FILE.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(DATA_FILE, **arrays)
    print(
        f"wrote {DATA_FILE} ({DATA_FILE.stat().st_size} bytes, {len(CONFIGS)} configurations, "
        f"{time.perf_counter() - t_all:.1f} s)"
    )
    for cfg in CONFIGS:
        if cfg.twin is not None:
            n = cfg.twin_draws
            same = all(
                np.array_equal(
                    arrays[f"{cfg.name}__{k}"], arrays[f"{cfg.twin}__{k}"], equal_nan=True
                )
                for k in ("samples",) + STAT_KEYS
            )
            head = n is None or all(
                np.array_equal(
                    arrays[f"{cfg.name}__{k}"][:, :n],
                    arrays[f"{cfg.twin}__{k}"][:, :n],
                    equal_nan=True,
                )
                for k in ("samples",) + STAT_KEYS
            )
            print(f"{cfg.name} vs {cfg.twin}: all equal={same}, first {n} draws equal={head}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: PYTHONPATH=$PWD python {sys.argv[0]} --record")
    # as tests/conftest.py: one BLAS thread and the recorded CPU kernels (OpenBLAS's,
    # numpy's SIMD), set before numpy loads (so: start again)
    _pinned = {
        **dict.fromkeys(("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"), "1"),
        "OPENBLAS_CORETYPE": "Haswell",
        "NPY_ENABLE_CPU_FEATURES": "X86_V3",
    }
    if any(os.environ.get(k) != v for k, v in _pinned.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_pinned})
    record()
