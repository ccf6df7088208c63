"""FlyMC on Kubernetes with the dask-kubernetes operator: a ``KubeCluster`` of workers
from this folder's image (``Dockerfile``), the data set and the trace on S3, and this
script as the driver, in a pod of the same cluster.

    kubectl create secret generic flymc-s3 \\
        --from-literal=AWS_ACCESS_KEY_ID=… --from-literal=AWS_SECRET_ACCESS_KEY=…
    # in a pod running the image, with a service account that may create DaskClusters:
    python /opt/flymc/deploy/kubernetes.py s3://bucket/data.zarr \\
        --trace s3://bucket/run.zarr --model logistic --workers 8 \\
        --image registry.example.org/flymc:0.1.0 --s3-secret flymc-s3

The operator must be installed in the cluster (its Helm chart, ``dask/dask-kubernetes-
operator``). The driver runs inside the cluster because it talks to every worker pod
directly (the rounds' socket channel, deploy/README.md), which a port-forward from outside
does not give. The S3 credentials come from the Secret ``--s3-secret`` into the driver's
and every worker's environment, never on a command line; ``--endpoint-url`` names an S3
service other than AWS (MinIO, Ceph). ``--local N`` runs the same on N local worker
processes (no Kubernetes: to try the script; its test runs that against an S3 server).
"""

from __future__ import annotations

import argparse
from typing import Any

from _sampling import add_sampler_args, check_sampler_args, local_cluster, sample_on

#: the variables s3fs (botocore) reads the credentials from, as the Secret names them
S3_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sampler_args(p)
    k8s = p.add_argument_group("the Dask cluster on Kubernetes")
    k8s.add_argument("--workers", type=int, default=4, help="worker pods (default 4)")
    k8s.add_argument("--image", default="flymc:latest", help="the image (deploy/Dockerfile)")
    k8s.add_argument("--name", default="flymc", help="the DaskCluster's name")
    k8s.add_argument("--namespace", default=None, help="Kubernetes namespace")
    k8s.add_argument("--cpu", default="1", help="CPU per worker pod (default 1)")
    k8s.add_argument("--memory", default="4Gi", help="memory per worker pod (default 4Gi)")
    k8s.add_argument("--s3-secret", default=None, help="Secret holding " + ", ".join(S3_VARIABLES))
    k8s.add_argument("--endpoint-url", default=None, help="S3 endpoint, for non-AWS services")
    args = p.parse_args(argv)
    check_sampler_args(p, args)
    if args.workers < 1:
        p.error(f"--workers must be at least 1, not {args.workers}")
    return args


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """fsspec options of the S3 store; the credentials stay in the environment."""
    return {"endpoint_url": args.endpoint_url} if args.endpoint_url else None


def cluster_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of the operator's ``KubeCluster``: ``--workers`` pods of the image,
    one single-threaded worker each, the S3 credentials from the Secret."""
    env: list[dict[str, Any]] = [
        {"name": "OMP_NUM_THREADS", "value": "1"},
        {"name": "OPENBLAS_NUM_THREADS", "value": "1"},
    ]
    if args.s3_secret:
        env += [
            {"name": v, "valueFrom": {"secretKeyRef": {"name": args.s3_secret, "key": v}}}
            for v in S3_VARIABLES
        ]
    size = {"cpu": args.cpu, "memory": args.memory}
    return {
        "name": args.name,
        "namespace": args.namespace,
        "image": args.image,
        "n_workers": args.workers,
        "resources": {"requests": size, "limits": size},
        "env": env,
        "worker_command": "dask-worker --nthreads 1",
    }


def make_cluster(args: argparse.Namespace) -> Any:
    """The operator's ``KubeCluster`` (or ``--local``'s LocalCluster)."""
    if args.local is not None:
        return local_cluster(args.local)
    try:
        from dask_kubernetes.operator import KubeCluster
    except ImportError as err:
        raise SystemExit(f"kubernetes.py needs dask-kubernetes (in the image): {err}") from None
    return KubeCluster(**cluster_options(args))


def main(argv: list[str] | None = None) -> int:
    """Start the cluster, sample, print the summary."""
    from distributed import Client

    args = parse_args(argv)
    with make_cluster(args) as cluster, Client(cluster, direct_to_workers=True) as client:
        res = sample_on(client, args, args.local or args.workers, storage_options(args))
    print(res.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
