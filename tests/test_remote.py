"""Data sets and traces on object storage: a real S3 API (moto's server on loopback).

The workers of a LocalCluster (separate processes) must open the store with the fsspec
``storage_options`` the driver opened it with, carried by the shard specs: every ``AWS_*``
variable of this process (and so of the workers it starts) points at a closed loopback
port with bogus credentials, so nothing but the options reaches the server.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from scipy.special import expit

try:
    import s3fs
    from moto.server import ThreadedMotoServer
except ImportError as err:  # the "test" extra installs both
    pytest.skip(
        f"S3 tests need moto[server] and s3fs (pip install 'flymc_dist[test]'): {err}",
        allow_module_level=True,
    )

import flymc_dist as fd
from flymc_dist.cli import main
from flymc_dist.data.write import from_blocks
from flymc_dist.driver import Driver
from flymc_dist.protocol import ShardConfig, ShardSpec
from flymc_dist.trace import Trace, TraceLock, TraceLockedError

SECRET = "s3cr3t-value-never-stored"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with a bucket; yields the storage options to reach it.

    The environment meanwhile sends any S3 client that is *not* given these options to a
    closed port on loopback, with bogus keys, one attempt, no instance metadata look-up.
    """
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    closed = socket.socket()  # bound, never listening: connections to it are refused
    closed.bind(("127.0.0.1", 0))
    bogus = f"http://127.0.0.1:{closed.getsockname()[1]}"
    nowhere = str(tmp_path_factory.mktemp("aws") / "none")
    env = {
        "AWS_ENDPOINT_URL": bogus,
        "AWS_ENDPOINT_URL_S3": bogus,
        "AWS_ACCESS_KEY_ID": "bogus",
        "AWS_SECRET_ACCESS_KEY": "bogus",
        "AWS_CONFIG_FILE": nowhere,
        "AWS_SHARED_CREDENTIALS_FILE": nowhere,
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(key)
        for key, value in env.items():
            mp.setenv(key, value)
        server.start()
        try:
            host, port = server.get_host_and_port()
            opts = {"endpoint_url": f"http://{host}:{port}", "key": "test-key", "secret": SECRET}
            # moto's buckets live in the process, not the server (another module's may
            # still be there): start from none
            urllib.request.urlopen(
                urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST"),
                timeout=10,
            ).close()
            s3fs.S3FileSystem(**opts).mkdir("bucket")
            yield {"options": opts, "bogus": bogus}
        finally:
            server.stop()
            closed.close()


@pytest.fixture(scope="module")
def data(s3, tmp_path_factory):
    """The same rows on local disk and on S3 (same chunk_rows)."""
    rng = np.random.default_rng(7)
    n = 2000
    X = np.c_[np.ones(n), rng.normal(size=(n, 2))]
    y = (rng.random(n) < expit(X @ np.array([0.4, -1.0, 0.6]))).astype(np.int64)
    local = fd.from_numpy(X, y, tmp_path_factory.mktemp("local") / "d.zarr", chunk_rows=250)
    remote = fd.from_numpy(
        X, y, "s3://bucket/d.zarr", chunk_rows=250, storage_options=s3["options"]
    )
    return local, remote


@pytest.fixture(scope="module")
def client(s3):
    """Two worker processes, started with the bogus AWS_* environment of ``s3``."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    )
    c = Client(cluster, direct_to_workers=True)
    yield c
    c.close()
    cluster.close()


def _interrupted_then_resumed(monkeypatch, data, trace: str, client, stop_at: int = 55, **kw):
    """A run stopped by Ctrl-C at step ``stop_at`` (past its second checkpoint, in the kept
    draws), then resumed from its trace."""
    opts = dict(
        # several read-ahead requests in the run's 90 iterations (the default asks for 256)
        algorithm=fd.FlyMC(bounds="map", read_ahead=32),
        kernel="rwmh",
        num_warmup=30,
        num_samples=60,
        chains=2,
        seed=4,
        placement=fd.Placement(n_shards=2),
        client=client,
        progress=False,
        trace=trace,
        checkpoint_every=25,
    )
    opts.update(kw)
    model = fd.LogisticRegression(prior_scale=3.0)
    real_step, calls = Driver.step, {"n": 0}

    def flaky_step(self, adapters=None):
        calls["n"] += 1
        if calls["n"] == stop_at:
            raise KeyboardInterrupt
        return real_step(self, adapters)

    monkeypatch.setattr(Driver, "step", flaky_step)
    monkeypatch.delattr(Driver, "steps", raising=False)  # each iteration by step (see test_cli)
    with pytest.raises(KeyboardInterrupt):
        fd.sample(model, data, **opts)
    monkeypatch.setattr(Driver, "step", real_step)
    return fd.sample(model, data, resume=True, **opts)


# ------------------------------------------------------------------ the data layer on S3


def test_open_dataset_with_options_reads_what_was_written(s3, data):
    local, remote = data
    ds = fd.open_dataset("s3://bucket/d.zarr", storage_options=s3["options"])
    assert (ds.n_rows, ds.chunk_rows, ds.fingerprint()) == (2000, 250, remote.fingerprint())
    for a, b in zip(ds.read(), local.read(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_open_without_options_is_one_clear_line(s3, data):
    """Today's failure on a worker, seen on the driver: no options, so the client goes to the
    (here: closed, loopback) default endpoint; one line says so, with no option values."""
    with pytest.raises(OSError, match="without storage_options") as info:
        fd.open_dataset("s3://bucket/d.zarr")
    msg = str(info.value)
    assert "\n" not in msg and "s3://bucket/d.zarr" in msg and s3["bogus"] in msg


def test_shard_spec_carries_options_picklably_and_hides_them():
    import pickle

    opts = {
        "endpoint_url": "http://127.0.0.1:1",
        "key": "k",
        "secret": SECRET,
        "client_kwargs": {"region_name": "x"},
    }
    spec = ShardSpec(0, "s3://b/d.zarr", 0, 10, opts)
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and again.storage_options == opts
    assert SECRET not in repr(spec)
    assert hash(spec) == hash(ShardSpec(0, "s3://b/d.zarr", 0, 10))
    assert ShardSpec(0, "p", 0, 10).storage_options is None  # the default: local stores


# ------------------------------------------------------------------ a cluster run on S3


@pytest.mark.slow
@pytest.mark.cluster
def test_workers_see_only_the_bogus_environment(s3, client):
    env = client.run(
        lambda: {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID")}
    )
    assert len(env) == 2
    for got in env.values():
        assert got == {"AWS_ENDPOINT_URL": s3["bogus"], "AWS_ACCESS_KEY_ID": "bogus"}


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize(
    "out_of_core",
    [
        # in CI only (--full-grid): test_deploy's test_kubernetes_script_runs_on_s3 runs
        # in-memory shards from S3 on two workers, its trace on S3, with the in-process
        # draws; the resume from an S3 trace runs here out of core (tests/test_tiers.py)
        pytest.param(False, id="in-memory", marks=pytest.mark.full_e2e),
        pytest.param(True, id="out-of-core"),
    ],
)
def test_s3_run_with_s3_trace_resumes_and_matches_local_disk(
    s3, data, client, tmp_path, monkeypatch, out_of_core
):
    """Data and trace on S3, shards on two worker processes, interrupted and resumed: the
    draws equal those of the same rows on local disk in process (same seed, chunks,
    shards). Out of
    core, the shards read the rows from S3 a chunk at a time, also after the resume."""
    local, remote = data
    opts = s3["options"]
    url = f"s3://bucket/run-{out_of_core}/t.zarr"  # the data set's options are reused
    kw = dict(placement=fd.Placement(n_shards=2, out_of_core=out_of_core))
    res = _interrupted_then_resumed(monkeypatch, remote, url, client, **kw)
    # the same rows on local disk, in process (the same draws on workers as in process is
    # test_cluster's; a second cluster run here cost ~10 s)
    ref = _interrupted_then_resumed(
        monkeypatch, local, str(tmp_path / "t.zarr"), "synchronous", **kw
    )
    assert res.info["out_of_core"] == [out_of_core] * 2 == ref.info["out_of_core"]
    assert res.info["transport"] == "dask" and res.info["n_workers"] == 2
    assert res.samples.shape == (2, 60, 3)
    np.testing.assert_array_equal(res.samples, ref.samples)
    np.testing.assert_array_equal(res.warmup_samples, ref.warmup_samples)
    for k in res.stats:
        if k != "round_trips":  # a cost: a read-ahead request carries read_ahead · hosts steps
            np.testing.assert_array_equal(res.stats[k], ref.stats[k])
    if out_of_core:  # two hosts asked against one in process: half the requests
        assert 0 < res.stats["round_trips"].sum() < ref.stats["round_trips"].sum()
    else:  # the hosts (local) lend their rows: nothing travels while sampling
        assert res.info["lending_hosts"] == 2 and res.stats["round_trips"].sum() == 0
    tr = Trace.open(url, read_only=True, storage_options=opts)
    assert (tr.n_warmup_draws, tr.n_draws) == (30, 60)
    np.testing.assert_array_equal(tr.samples, res.samples)
    assert tr.attrs["data"] == "s3://bucket/d.zarr"
    # the credentials never reach the trace
    fs = s3fs.S3FileSystem(**opts)
    assert SECRET not in fs.cat(f"{url[len('s3://') :]}/zarr.json").decode()


@pytest.mark.slow
@pytest.mark.cluster
def test_workers_without_the_options_fail_in_one_line(s3, data, client):
    """Shard specs without the options (as before they carried them): the workers cannot
    reach the store, and the error is one line naming the store and the missing options."""
    from flymc_dist.transport.dask import DaskTransport

    _local, remote = data
    config = ShardConfig(
        model=fd.LogisticRegression(), algorithm="flymc", chains=1, seed=0, n_rows=2000
    )
    specs = [ShardSpec(0, remote.path, 0, 1000), ShardSpec(1, remote.path, 1000, 2000)]
    with pytest.raises(OSError, match="without storage_options") as info:
        DaskTransport(client, specs, config)
    msg = str(info.value)
    assert "\n" not in msg and "s3://bucket/d.zarr" in msg and s3["bogus"] in msg


# ------------------------------------------------------------------ the API's checks


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(trace_storage_options={"key": "k"}), "applies only to a trace at an fsspec URL"),
        (
            dict(trace="t.zarr", trace_storage_options={"key": "k"}),
            "applies only to a trace at an fsspec URL",
        ),
        (dict(trace="s3://b/t.zarr", trace_storage_options="key=k"), "must be a dict"),
        (dict(trace="s3://b/t.zarr", trace_storage_options={1: "k"}), "str keys"),
    ],
)
def test_trace_storage_options_are_checked_before_anything_starts(kw, match):
    X = np.c_[np.ones(10), np.arange(10.0)]
    y = np.arange(10) % 2
    with pytest.raises(ValueError, match=match) as info:
        fd.sample(fd.LogisticRegression(), (X, y), client="synchronous", **kw)
    assert SECRET not in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------ the command line


@pytest.mark.slow
@pytest.mark.full_e2e  # the S3 paths of the command line (tests/test_tiers.py)
def test_cli_ingest_run_resume_and_summary_on_s3(s3, tmp_path, capsys):
    opts = s3["options"]
    so = [
        f"--storage-option=endpoint_url={opts['endpoint_url']}",
        f"--storage-option=key={opts['key']}",
        f"--storage-option=secret={opts['secret']}",
    ]
    rng = np.random.default_rng(3)
    X = np.c_[np.ones(300), rng.normal(size=300)]
    src = tmp_path / "d.npy"
    np.save(src, np.c_[X, (rng.random(300) < expit(X @ [0.2, 1.0])).astype(float)])
    assert main(["ingest", str(src), "s3://bucket/cli/d.zarr", "--chunk-rows", "100", *so]) == 0
    assert (
        main(["make-data", "s3://bucket/cli/m.zarr", "--rows", "50", "--features", "2", *so]) == 0
    )
    assert fd.open_dataset("s3://bucket/cli/m.zarr", storage_options=opts).n_rows == 50
    run = [
        "run",
        "s3://bucket/cli/d.zarr",
        "--model",
        "logistic",
        "--warmup",
        "20",
        "--samples",
        "30",
        "--chains",
        "2",
        "--synchronous",
        "--no-progress",
        "--trace",
        "s3://bucket/cli/t.zarr",
        *so,
    ]
    assert main(run) == 0
    first = Trace.open("s3://bucket/cli/t.zarr", storage_options=opts).samples.copy()
    assert first.shape == (2, 30, 2)
    capsys.readouterr()
    assert main(run) == 2  # exists: refused in one line
    assert "already exists" in capsys.readouterr().err
    assert main(run + ["--resume"]) == 0  # complete already: the same draws
    np.testing.assert_array_equal(
        Trace.open("s3://bucket/cli/t.zarr", storage_options=opts).samples, first
    )
    capsys.readouterr()
    assert main(["summary", "s3://bucket/cli/t.zarr", *so]) == 0
    out = capsys.readouterr().out
    assert "2 chains × 30 draws" in out
    # without the options: one line each, naming the store (the default endpoint is closed)
    for argv, needle in (
        (run[:-3], "without storage_options"),
        (["summary", "s3://bucket/cli/t.zarr"], "cannot reach"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and "s3://bucket/cli/" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--storage-option", "novalue"], "expected KEY=VALUE"),
        (["--storage-option", "=x"], "expected KEY=VALUE"),
        (["--storage-option", "key=a", "--storage-option", "key=b"], "given twice"),
    ],
)
def test_cli_bad_storage_options_are_one_line(tmp_path, capsys, argv, match):
    code = main(["summary", str(tmp_path / "t.zarr"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and match in err and err.count("\n") == 1


def test_cli_storage_option_on_local_paths_is_refused(tmp_path, capsys):
    code = main(
        ["ingest", str(tmp_path / "x.npy"), str(tmp_path / "d.zarr"), "--storage-option", "key=1"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "applies only to fsspec URLs" in err


def test_cli_storage_option_values_are_json_where_possible():
    from flymc_dist.cli.parser import _storage_option

    assert _storage_option("anon=true") == ("anon", True)
    assert _storage_option('client_kwargs={"region_name": "eu"}') == (
        "client_kwargs",
        {"region_name": "eu"},
    )
    assert _storage_option("endpoint_url=http://h:1") == ("endpoint_url", "http://h:1")
    assert _storage_option('secret="123"') == ("secret", "123")
    assert _storage_option("secret=a=b") == ("secret", "a=b")
    assert json.dumps(_storage_option("n=5")) == '["n", 5]'


# ------------------------------------------------------------------ overwrite on S3


def _s3fs(s3):
    fs = s3fs.S3FileSystem(**s3["options"])
    fs.invalidate_cache()
    return fs


def _xy_s3(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.c_[np.ones(n), rng.normal(size=(n, 2))]
    return X, (rng.random(n) < 0.5).astype(np.int64)


@pytest.mark.slow
def test_s3_overwrite_refuses_a_trace(s3):
    """``overwrite`` over a finished trace is refused (as on disk); the trace is kept."""
    opts, url = s3["options"], "s3://bucket/ow/trace.zarr"
    tr = Trace.create(
        url, chains=1, param_shape=(3,), stats={"a": np.float64}, attrs={}, storage_options=opts
    )
    tr.append(np.ones((1, 4, 3)), {"a": np.zeros((1, 4))}, warmup=False)
    X, y = _xy_s3(40)
    with pytest.raises(FileExistsError, match="not a flymc_dist data set"):
        fd.from_numpy(X, y, url, overwrite=True, storage_options=opts)
    assert Trace.open(url, storage_options=opts).n_draws == 4
    code = main(
        [
            "make-data",
            url,
            "--rows",
            "50",
            "--features",
            "2",
            "--overwrite",
            f"--storage-option=endpoint_url={opts['endpoint_url']}",
            f"--storage-option=key={opts['key']}",
            f"--storage-option=secret={opts['secret']}",
        ]
    )
    assert code == 2
    assert Trace.open(url, storage_options=opts).n_draws == 4


@pytest.mark.parametrize("where", ["ow/foreign.zarr/notes.txt", "ow/plain.zarr"])
def test_s3_overwrite_refuses_foreign_objects(s3, where):
    """A prefix (or a key) holding objects that are not a zarr store is never deleted."""
    fs = _s3fs(s3)
    fs.pipe_file(f"bucket/{where}", b"keep me")
    url = "s3://bucket/" + ("ow/foreign.zarr" if "/notes" in where else where)
    X, y = _xy_s3(40)
    with pytest.raises(FileExistsError, match="not a zarr store"):
        fd.from_numpy(X, y, url, overwrite=True, storage_options=s3["options"])
    assert _s3fs(s3).cat_file(f"bucket/{where}") == b"keep me"


def _late_failure(X: np.ndarray, y: np.ndarray, failure: BaseException | None):
    """Row blocks of (X, y); the last block carries a NaN (or raises ``failure``)."""
    step = 10
    for s in range(0, len(y), step):
        Xb = X[s : s + step].copy()
        if s + step >= len(y):
            if failure is not None:
                raise failure
            Xb[-1, 1] = np.nan
        yield Xb, y[s : s + step]


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(None, id="nan", marks=pytest.mark.slow),
        pytest.param(KeyboardInterrupt(), id="ctrl-c"),
    ],
)
def test_s3_failed_overwrite_keeps_the_old_data_set(s3, failure):
    """A NaN in a late block, or Ctrl-C, during an overwrite: the old data set is intact
    and nothing is left beside it."""
    opts, url = s3["options"], f"s3://bucket/ow/keep-{failure is None}.zarr"
    X, y = _xy_s3(60, seed=1)
    old = fd.from_numpy(X, y, url, chunk_rows=10, storage_options=opts)
    before = sorted(_s3fs(s3).find("bucket/ow"))
    X2, y2 = _xy_s3(60, seed=2)
    with pytest.raises(ValueError if failure is None else KeyboardInterrupt):
        from_blocks(
            _late_failure(X2, y2, failure),
            url,
            60,
            3,
            task="binary",
            chunk_rows=10,
            overwrite=True,
            storage_options=opts,
        )
    again = fd.open_dataset(url, storage_options=opts)
    assert again.fingerprint() == old.fingerprint()
    np.testing.assert_array_equal(again.read()[0], X)
    assert sorted(_s3fs(s3).find("bucket/ow")) == before


@pytest.mark.slow
def test_s3_overwrite_replaces_a_data_set_whole(s3):
    """A successful overwrite: the new rows, a new identity, none of the old chunks."""
    opts, url = s3["options"], "s3://bucket/ow/swap.zarr"
    X, y = _xy_s3(60, seed=3)
    old = fd.from_numpy(X, y, url, chunk_rows=10, storage_options=opts)
    X2, y2 = _xy_s3(30, seed=4)
    new = fd.from_numpy(X2, y2, url, chunk_rows=15, overwrite=True, storage_options=opts)
    assert new.fingerprint() != old.fingerprint()
    again = fd.open_dataset(url, storage_options=opts)
    np.testing.assert_array_equal(again.read()[0], X2)
    keys = sorted(k for k in _s3fs(s3).find("bucket/ow") if "swap" in k)
    assert all(k.startswith("bucket/ow/swap.zarr/") for k in keys)  # nothing left beside
    assert sorted(k.rsplit("/c/", 1)[-1] for k in keys if "/X/c/" in k) == ["0/0", "1/0"]


@pytest.mark.slow
def test_s3_overwrite_interrupted_while_copying_names_the_new_store(s3, monkeypatch):
    """The connection lost while the new store is copied into place: readers refuse the
    half-swapped store (never read a mix), the error names the complete new store, and writing again
    with overwrite=True recovers."""
    opts, url = s3["options"], "s3://bucket/ow/cut.zarr"
    X, y = _xy_s3(40, seed=5)
    fd.from_numpy(X, y, url, chunk_rows=10, storage_options=opts)
    real_copy = s3fs.S3FileSystem._cp_file

    async def cut(self, *args, **kwargs):
        raise ConnectionError("connection lost")

    monkeypatch.setattr(s3fs.S3FileSystem, "_cp_file", cut)
    X2, y2 = _xy_s3(40, seed=6)
    with pytest.raises(ConnectionError) as info:
        fd.from_numpy(X2, y2, url, chunk_rows=10, overwrite=True, storage_options=opts)
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "the complete new data set is at 's3://bucket/ow/.cut.zarr.flymc-tmp-" in note
    with pytest.raises(ValueError, match="is being replaced"):
        fd.open_dataset(url, storage_options=opts)
    monkeypatch.setattr(s3fs.S3FileSystem, "_cp_file", real_copy)
    fd.from_numpy(X2, y2, url, chunk_rows=10, overwrite=True, storage_options=opts)
    np.testing.assert_array_equal(fd.open_dataset(url, storage_options=opts).read()[0], X2)


# ------------------------------------------------------------------ the lock of S3 traces


def _s3_holder(url: str, opts: dict) -> subprocess.Popen:
    """Another process that takes the lock of the S3 trace ``url`` and holds it until
    killed."""
    code = (
        "import json, sys, time; from flymc_dist.trace import TraceLock; "
        "lock = TraceLock(sys.argv[1], json.loads(sys.argv[2])).acquire(); "
        "print('held', flush=True); time.sleep(600)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, url, json.dumps(opts)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _small_run(ds, url: str, **kw):
    kw = {"seed": 1, **kw}
    return fd.sample(
        fd.LogisticRegression(prior_scale=3.0),
        ds,
        algorithm="regular",
        kernel="rwmh",
        num_warmup=10,
        num_samples=20,
        chains=1,
        client="synchronous",
        progress=False,
        trace=url,
        checkpoint_every=10,
        **kw,
    )


@pytest.mark.slow
def test_s3_trace_has_one_writer_at_a_time(s3, data):
    """A live process holds the lock of an S3 trace: a second run (with overwrite) is
    refused in one line naming it, the trace is untouched; once that process is gone
    (killed: no release) the lock is taken over."""
    _local, remote = data
    opts, url = s3["options"], "s3://bucket/lock/t.zarr"
    first = _small_run(remote, url)
    holder = _s3_holder(url, opts)
    try:
        with pytest.raises(TraceLockedError, match=f"pid {holder.pid} ") as info:
            _small_run(remote, url, overwrite_trace=True, seed=2)
        assert "\n" not in str(info.value) and "lease" in str(info.value)
        np.testing.assert_array_equal(Trace.open(url, storage_options=opts).samples, first.samples)
    finally:
        holder.kill()
        holder.wait()
    again = _small_run(remote, url, overwrite_trace=True, seed=2)
    assert not np.array_equal(again.samples, first.samples)
    assert not _s3fs(s3).exists("bucket/lock/.t.zarr.flymc-lock")  # released


@pytest.mark.slow
def test_s3_trace_lock_is_a_lease(s3):
    """A lock from another machine is honoured while its lease runs and taken over once it
    ran out; a held lock is renewed; one taken over behind its holder's back is lost, and
    its release says so."""
    opts, url = s3["options"], "s3://bucket/lease/t.zarr"
    fs, key = _s3fs(s3), "bucket/lease/.t.zarr.flymc-lock"
    other = {"pid": 1, "host": "elsewhere", "token": "x", "since": time.time()}
    fs.pipe_file(key, json.dumps({**other, "expires": time.time() + 60}).encode())
    with pytest.raises(TraceLockedError, match="elsewhere"):
        TraceLock(url, opts).acquire()
    fs.pipe_file(key, json.dumps({**other, "expires": time.time() - 1}).encode())
    lock = TraceLock(url, opts, lease=1.0).acquire()
    first = json.loads(_s3fs(s3).cat_file(key))["expires"]
    time.sleep(1.2)
    renewed = json.loads(_s3fs(s3).cat_file(key))
    assert renewed["token"] != "x" and renewed["expires"] > first
    with pytest.raises(TraceLockedError):
        TraceLock(url, opts).acquire()
    lock.release()
    assert not _s3fs(s3).exists(key)
    lock = TraceLock(url, opts, lease=1.0).acquire()
    _s3fs(s3).pipe_file(key, json.dumps({**other, "expires": time.time() + 60}).encode())
    time.sleep(1.0)
    with pytest.raises(TraceLockedError, match="lost the lock"):
        lock.release()
    assert json.loads(_s3fs(s3).cat_file(key))["host"] == "elsewhere"  # not removed
    _s3fs(s3).rm_file(key)


def _counted_requests(monkeypatch) -> collections.Counter:
    """The requests every s3fs client of this process sends from now on, by operation."""
    sent: collections.Counter = collections.Counter()
    real = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):
        sent[method] += 1
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    return sent


def test_s3_trace_create_writes_each_object_once(s3, monkeypatch):
    """Creating a trace on S3 writes each of its objects once, with a handful of requests
    besides (zarr's create_array sent about nine per array, and the arrays were read back:
    273 requests for a small run's trace, now 39); opening it reads its root once and each
    draws' array once. overwrite leaves none of the old trace's objects; a prefix holding
    a trace's sub-groups but no group is refused and left as it is, one holding other
    objects is written beside them."""
    opts, root = s3["options"], "bucket/requests"
    kw = dict(
        chains=2,
        param_shape=(3,),
        attrs={"seed": 1},
        storage_options=opts,
        dims=("feature",),
        coords={"feature": ["a", "b", "c"]},
    )
    stats = {"accepted": np.bool_, "lp": np.float64, "n": np.int64}
    sent = _counted_requests(monkeypatch)
    trace = Trace.create(f"s3://{root}/t.zarr", stats=stats, **kw)
    created = dict(sent)
    objects = _s3fs(s3).find(f"{root}/t.zarr")
    # the root, 4 groups, per phase 2 + 1 coordinates (with a chunk each), theta, 3 stats
    assert len(objects) == 1 + 4 + 2 * (2 * 3 + 1 + 3)
    assert created["put_object"] == len(objects)
    assert sum(created.values()) - created["put_object"] <= 8, created
    trace.append(
        np.ones((2, 4, 3)), {k: np.ones((2, 4), v) for k, v in stats.items()}, warmup=False
    )
    sent.clear()
    opened = Trace.open(f"s3://{root}/t.zarr", storage_options=opts)
    assert opened.n_draws == 4 and "put_object" not in sent
    assert sum(sent.values()) <= 2 * (1 + 2 * (1 + len(stats))), dict(sent)

    Trace.create(f"s3://{root}/t.zarr", stats={"lp": np.float64}, overwrite=True, **kw)
    assert not [o for o in _s3fs(s3).find(f"{root}/t.zarr") if "/accepted/" in o or "/n/" in o]
    assert Trace.open(f"s3://{root}/t.zarr", storage_options=opts).stat_dtypes == {
        "lp": np.dtype(np.float64)
    }

    fs = _s3fs(s3)
    fs.pipe_file(f"{root}/orphan.zarr/sample_stats/lp/c/0/0", b"left by a removal")
    with pytest.raises(FileExistsError, match="not a flymc trace"):
        Trace.create(f"s3://{root}/orphan.zarr", stats=stats, overwrite=True, **kw)
    assert _s3fs(s3).find(f"{root}/orphan.zarr") == [f"{root}/orphan.zarr/sample_stats/lp/c/0/0"]
    fs.pipe_file(f"{root}/notes.zarr/README", b"keep me")
    Trace.create(f"s3://{root}/notes.zarr", stats=stats, **kw)
    assert _s3fs(s3).cat_file(f"{root}/notes.zarr/README") == b"keep me"
    assert Trace.open(f"s3://{root}/notes.zarr", storage_options=opts).n_draws == 0


@pytest.mark.slow
def test_failed_run_on_an_s3_trace_keeps_it_and_says_how_to_resume(s3, data, capsys, monkeypatch):
    """As on local disk: a run failing after a checkpoint keeps its S3 trace, the command
    line prints the --resume hint, and --resume finishes it; a run failing before any
    checkpoint leaves nothing behind."""
    opts = s3["options"]
    so = [f"--storage-option={k}={v}" for k, v in opts.items()]
    real_step, calls = Driver.step, {"n": 0}

    def failing_at(n: int):
        def step(self, adapters=None):
            calls["n"] += 1
            if calls["n"] == n:
                raise RuntimeError("the cluster went away")
            return real_step(self, adapters)

        return step

    base = ["run", "s3://bucket/d.zarr", "--model", "logistic", "--algorithm", "regular"]
    base += ["--kernel", "rwmh", "--warmup", "10", "--samples", "30", "--chains", "1"]
    base += ["--synchronous", "--no-progress", "--checkpoint-every", "10", *so]
    monkeypatch.setattr(Driver, "step", failing_at(25))
    capsys.readouterr()
    assert main([*base, "--trace", "s3://bucket/fail/t.zarr"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "the cluster went away" in lines[0]
    assert "s3://bucket/fail/t.zarr keeps 20 iterations" in lines[1] and "--resume" in lines[1]
    monkeypatch.setattr(Driver, "step", real_step)
    assert main([*base, "--trace", "s3://bucket/fail/t.zarr", "--resume"]) == 0
    assert Trace.open("s3://bucket/fail/t.zarr", storage_options=opts).n_draws == 30
    calls["n"] = 0
    monkeypatch.setattr(Driver, "step", failing_at(5))
    assert main([*base, "--trace", "s3://bucket/fail/early.zarr"]) == 1
    assert "--resume" not in capsys.readouterr().err
    assert not _s3fs(s3).exists("bucket/fail/early.zarr")


@pytest.mark.slow
def test_s3_reads_after_a_rewrite_fail_naming_both_ids(s3, monkeypatch):
    """A data set on S3 replaced while open: the next identity check (here: every read)
    fails naming both store_ids, as on local disk."""
    import flymc_dist.data.store as store

    opts, url = s3["options"], "s3://bucket/ident/d.zarr"
    X, y = _xy_s3(60, seed=7)
    ds = fd.from_numpy(X, y, url, chunk_rows=10, storage_options=opts)
    monkeypatch.setattr(store, "URL_CHECK_SECONDS", 0.0)
    np.testing.assert_array_equal(ds.read(0, 5)[0], X[:5])
    new = fd.from_numpy(X + 1.0, y, url, chunk_rows=10, overwrite=True, storage_options=opts)
    for _ in range(2):
        with pytest.raises(store.StoreReplacedError) as info:
            ds.read_rows([1, 30])
        assert ds.store_id in str(info.value) and new.store_id in str(info.value)


# ------------------------------------------------------------------ an unreachable store


@pytest.fixture
def fragile(s3):
    """A second moto server (same process, so the same buckets), which a test may stop and
    start again on the same port; yields ``(options, stop, start)``."""
    state = {"server": ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)}
    state["server"].start()
    host, port = state["server"].get_host_and_port()
    opts = {"endpoint_url": f"http://{host}:{port}", "key": "test-key", "secret": SECRET}

    def stop():
        state["server"].stop()

    def start():
        state["server"] = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
        state["server"].start()

    yield opts, stop, start
    with contextlib.suppress(Exception):
        state["server"].stop()


@pytest.mark.slow
def test_an_unreachable_data_set_is_not_called_damaged_and_reads_are_retried(fragile, monkeypatch):
    """The endpoint down: a read fails after a bounded number of attempts saying the store
    cannot be reached (not "damaged", not "replaced"); an endpoint back within them is
    read as if nothing happened (#28 item 7)."""
    import threading

    import flymc_dist._unreachable as unreachable
    from flymc_dist.data import DataIntegrityError, StoreReplacedError, StoreUnreachableError

    opts, stop, start = fragile
    X, y = _xy_s3(80, seed=3)
    ds = fd.from_numpy(X, y, "s3://bucket/down/d.zarr", chunk_rows=20, storage_options=opts)
    monkeypatch.setattr(unreachable, "RETRY_PAUSE", 0.05)
    stop()
    for read in (lambda: ds.read(0, 50), lambda: ds.read_rows([3, 70])):
        with pytest.raises(StoreUnreachableError) as info:
            read()
        assert not isinstance(info.value, DataIntegrityError | StoreReplacedError)
        msg = str(info.value)
        assert "cannot be reached" in msg and "3 attempts" in msg and "not damaged" in msg
        assert "\n" not in msg and "EndpointConnectionError" in msg
    monkeypatch.setattr(unreachable, "RETRY_PAUSE", 3.0)  # back long before the retry
    threading.Timer(0.2, start).start()
    np.testing.assert_array_equal(ds.read(0, 50)[0], X[:50])


@pytest.mark.slow
def test_an_s3_trace_unreachable_mid_run_is_kept_with_the_resume_hint(fragile, monkeypatch, capsys):
    """The endpoint of an S3 trace goes down mid-run: the command line says the store
    cannot be reached (one line, no traceback, not "damaged") and how to resume; once it
    is back, --resume completes the run (#28 item 7)."""
    import flymc_dist._unreachable as unreachable

    opts, stop, start = fragile
    X, y = _xy_s3(300, seed=4)
    fd.from_numpy(X, y, "s3://bucket/down/run.zarr", chunk_rows=100, storage_options=opts)
    monkeypatch.setattr(unreachable, "RETRY_PAUSE", 0.05)
    so = [f"--storage-option={k}={v}" for k, v in opts.items()]
    argv = ["run", "s3://bucket/down/run.zarr", "--model", "logistic", "--algorithm", "regular"]
    argv += ["--kernel", "rwmh", "--warmup", "10", "--samples", "20", "--chains", "1"]
    argv += ["--synchronous", "--no-progress", "--checkpoint-every", "10", *so]
    argv += ["--trace", "s3://bucket/down/t.zarr"]
    real_step, calls = Driver.step, {"n": 0}

    def step(self, adapters=None):
        calls["n"] += 1
        if calls["n"] == 25:
            stop()
        return real_step(self, adapters)

    monkeypatch.setattr(Driver, "step", step)
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("flymc: error: trace s3://bucket/down/t.zarr cannot be reached")
    assert "not damaged" in lines[0] and "Traceback" not in lines[0]
    assert "s3://bucket/down/t.zarr keeps 20 iterations" in lines[1]
    assert "--resume once its store can be reached again" in lines[1]
    start()
    monkeypatch.setattr(Driver, "step", real_step)
    assert main([*argv, "--resume"]) == 0
    trace = Trace.open("s3://bucket/down/t.zarr", storage_options=opts)
    assert trace.n_draws == 20 and np.all(np.isfinite(trace.samples))
