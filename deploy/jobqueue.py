"""FlyMC on a SLURM or PBS cluster through dask-jobqueue: submits the Dask workers as batch
jobs, waits for them, and samples with ``fd.sample`` from where it runs (a login node, or a
job of its own).

    pip install flymc_dist dask-jobqueue
    python deploy/jobqueue.py /shared/data.zarr --trace /shared/run.zarr --model logistic \\
        --jobs 8 --queue batch --memory 8GB --walltime 02:00:00

Each job is one single-threaded worker (each shard's work is single-threaded); the shards
follow the data layout, not the cluster, so the same seed gives the same draws on any
number of jobs. ``--pbs`` submits with PBS instead of SLURM; ``--job-directive`` adds an
``#SBATCH`` / ``#PBS`` line (``--job-directive=--account=proj``); ``--interface ib0`` puts
Dask's and the rounds' traffic on that network. ``--resume`` continues a run cut short
from its trace's last checkpoint. ``--local N`` runs the same on N local worker processes
(no batch system: to try the script; its test runs that).

The driver talks to every worker directly (the rounds' socket channel, deploy/README.md):
run it where the compute nodes can be reached, as a login node usually can.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from _sampling import add_sampler_args, check_sampler_args, local_cluster, sample_on


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sampler_args(p)
    jobs = p.add_argument_group("the batch jobs")
    jobs.add_argument("--jobs", type=int, default=4, help="worker jobs (default 4)")
    jobs.add_argument("--pbs", action="store_true", help="PBS instead of SLURM")
    jobs.add_argument("--queue", default=None, help="partition (SLURM) or queue (PBS)")
    jobs.add_argument("--memory", default="4GB", help="memory per job (default 4GB)")
    jobs.add_argument("--walltime", default="02:00:00", help="per job (default 02:00:00)")
    jobs.add_argument("--interface", default=None, help="network interface, e.g. ib0")
    jobs.add_argument(
        "--job-directive",
        action="append",
        default=[],
        help="an extra #SBATCH/#PBS directive, e.g. --job-directive=--account=proj",
    )
    jobs.add_argument("--python", default=sys.executable, help="the nodes' python")
    args = p.parse_args(argv)
    check_sampler_args(p, args)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, not {args.jobs}")
    return args


def cluster_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of ``SLURMCluster`` / ``PBSCluster``: one job, one worker process,
    one thread; the scheduler's HTTP server (it starts one even without a dashboard, on
    8787 unless told) on a free port: nothing here reads it, and 8787 is often taken."""
    return {
        "cores": 1,
        "processes": 1,
        "memory": args.memory,
        "walltime": args.walltime,
        "queue": args.queue,
        "interface": args.interface,
        "job_extra_directives": list(args.job_directive),
        "job_name": "flymc-worker",
        "python": args.python,
        "scheduler_options": {"dashboard_address": ":0"},
    }


def make_cluster(args: argparse.Namespace) -> Any:
    """dask-jobqueue's cluster, scaled to ``--jobs`` jobs (or ``--local``'s LocalCluster)."""
    if args.local is not None:
        return local_cluster(args.local)
    try:
        from dask_jobqueue import PBSCluster, SLURMCluster
    except ImportError as err:
        raise SystemExit(f"jobqueue.py needs dask-jobqueue: {err}") from None
    cluster = (PBSCluster if args.pbs else SLURMCluster)(**cluster_options(args))
    cluster.scale(jobs=args.jobs)
    return cluster


def main(argv: list[str] | None = None) -> int:
    """Start the cluster, sample, print the summary."""
    from distributed import Client

    args = parse_args(argv)
    with make_cluster(args) as cluster, Client(cluster, direct_to_workers=True) as client:
        res = sample_on(client, args, args.local or args.jobs)
    print(res.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
