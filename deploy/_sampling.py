"""What the deploy scripts (jobqueue.py, kubernetes.py) share: the sampler's command-line
options and the run itself, given a Dask client. Kept beside them: run them from here (or
copy the folder), ``python deploy/jobqueue.py …``."""

from __future__ import annotations

import argparse
from typing import Any

import flymc_dist as fd

#: the models by name, as ``flymc run --model`` names them
MODELS = {
    "logistic": fd.LogisticRegression,
    "robust": fd.RobustRegression,
    "softmax": fd.SoftmaxRegression,
}


def add_sampler_args(p: argparse.ArgumentParser) -> None:
    """The data set, the trace, the model and the sampler's main knobs."""
    p.add_argument("store", help="the data set (zarr store or s3://… URL), read by every worker")
    p.add_argument("--trace", required=True, help="the zarr trace to write (path or URL)")
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--kernel", default=None, help="theta kernel (default: the library's, NUTS)")
    p.add_argument("--warmup", type=int, default=500, help="warm-up iterations (default 500)")
    p.add_argument("--samples", type=int, default=1000, help="draws per chain (default 1000)")
    p.add_argument("--chains", type=int, default=4, help="chains (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--n-shards", type=int, default=None, help="shards (default: by rows)")
    p.add_argument("--resume", action="store_true", help="continue the run in --trace")
    p.add_argument("--local", type=int, default=None, metavar="N", help="N local workers instead")


def check_sampler_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse counts below one (through ``p.error``: one usage line, exit status 2)."""
    for name in ("warmup", "samples", "chains", "local", "n_shards"):
        value = getattr(args, name)
        least = 0 if name == "warmup" else 1
        if value is not None and value < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}, not {value}")


def local_cluster(n_workers: int) -> Any:
    """``n_workers`` single-threaded local worker processes (``--local``): the embedded
    cluster of ``fd.sample(client=None)``."""
    from flymc_dist.transport.dask import local_cluster as embedded

    return embedded(n_workers)


def sample_on(
    client: Any,
    args: argparse.Namespace,
    n_workers: int,
    storage_options: dict[str, Any] | None = None,
) -> fd.Result:
    """Wait for ``n_workers`` workers, then sample ``args.store`` on them into ``args.trace``.

    The shards are placed on the workers there are when the run starts: waiting for all
    of them first keeps every worker busy.
    """
    client.wait_for_workers(n_workers, timeout=3600)
    ds = fd.open_dataset(args.store, storage_options=storage_options)
    kwargs = {"n_classes": ds.n_classes} if args.model == "softmax" else {}
    return fd.sample(
        MODELS[args.model](**kwargs),
        ds,
        kernel=args.kernel,
        num_warmup=args.warmup,
        num_samples=args.samples,
        chains=args.chains,
        seed=args.seed,
        client=client,
        placement=fd.Placement(n_shards=args.n_shards),
        trace=args.trace,
        resume=args.resume,
    )
