"""``flymc bench ingest``: writing a store from Parquet files, in one process and on a Dask
cluster, against the single-process path from an array file (``fd.ingest`` of a ``.npy``:
row ranges read and written by :func:`flymc_dist.data.from_blocks`).

Synthetic rows (``features`` standard normal columns and a 0/1 target) are written once
to ``files`` Parquet files (written 262,144 rows at a time, each a row group, unless
``row_group_rows`` is smaller) and to a ``.npy`` file, in a temporary directory. Each
measured write runs in a process of its own (``python -c``), so its peak resident memory
is its own; the cluster run starts a LocalCluster of ``workers`` single-threaded workers
first, has them import the package, and times the ingest alone, reporting each worker's
peak memory too. Every store written is checked against the first, byte for byte (the
same rows, the same chunks). CPU seconds are reported beside the wall time: on a machine
shared with other work they are the figure its load does not inflate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from flymc_dist.rng import stream

__all__ = ["format_ingest", "run_ingest"]

#: what every measured run starts with: its arguments (source, destination, workers) and
#: ``peak()``, its own high-water mark in MiB (``ru_maxrss`` carries the parent's across
#: exec), and ``cpu()``, the CPU seconds of all its threads
_PRELUDE = """
import json, sys, time
import flymc_dist as fd
src, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
def peak():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("VmHWM")) / 1024
def cpu():
    return time.process_time()
"""

#: the measured writes, each run as ``python -c`` (after :data:`_PRELUDE`); each prints a
#: JSON line: seconds, CPU seconds (of the workers too), this process's and each worker's
#: peak MiB
_RUNS = {
    "npy": """
t, c = time.perf_counter(), cpu()
fd.ingest(src, out, task="binary")
sec, c = time.perf_counter() - t, cpu() - c
print(json.dumps({"seconds": sec, "cpu_seconds": c, "peak_mib": peak()}))
""",
    "parquet": """
t, c = time.perf_counter(), cpu()
fd.from_parquet(src, out, target="y", task="binary")
sec, c = time.perf_counter() - t, cpu() - c
print(json.dumps({"seconds": sec, "cpu_seconds": c, "peak_mib": peak()}))
""",
    "parquet_cluster": """
from distributed import Client, LocalCluster
if __name__ == "__main__":
    with LocalCluster(n_workers=workers, threads_per_worker=1, dashboard_address=":0") as c, \\
            Client(c) as client:
        # the workers import what they will run first (a cluster that serves many runs
        # has done so); the ingest alone is timed
        client.run(lambda: [__import__(m) for m in ("flymc_dist", "pyarrow.parquet", "zarr")])
        w0 = client.run(cpu)
        t, c = time.perf_counter(), cpu()
        fd.from_parquet(src, out, target="y", task="binary", client=client)
        sec, c = time.perf_counter() - t, cpu() - c
        w1, w = client.run(cpu), list(client.run(peak).values())
        c += sum(w1[k] - w0[k] for k in w1)
    print(json.dumps({"seconds": sec, "cpu_seconds": c, "peak_mib": peak(),
                      "worker_peak_mib": w}))
""",
}


def _write_sources(
    where: str, rows: int, features: int, files: int, row_group_rows: int | None, seed: int
) -> tuple[str, str]:
    """The Parquet directory and the ``.npy`` file of the same rows, written in blocks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq_dir = os.path.join(where, "parquet")
    os.makedirs(pq_dir)
    npy = os.path.join(where, "rows.npy")
    A = np.lib.format.open_memmap(npy, mode="w+", dtype=np.float64, shape=(rows, features + 1))
    rng = stream(seed, 31, 0)
    names = [f"x{j}" for j in range(features)]
    bounds = np.linspace(0, rows, files + 1).astype(np.int64)
    for i in range(files):
        s0, s1 = int(bounds[i]), int(bounds[i + 1])
        with pq.ParquetWriter(
            os.path.join(pq_dir, f"part-{i:04d}.parquet"),
            pa.schema([*((n, pa.float64()) for n in names), ("y", pa.int64())]),
        ) as w:
            for s in range(s0, s1, 262144):
                e = min(s + 262144, s1)
                X = rng.normal(size=(e - s, features))
                y = (rng.random(e - s) < 0.5).astype(np.int64)
                A[s:e, :-1], A[s:e, -1] = X, y
                cols = {n: X[:, j] for j, n in enumerate(names)}
                cols["y"] = y
                w.write_table(pa.table(cols), row_group_size=row_group_rows)
    A.flush()
    del A
    return pq_dir, npy


def _same_store(a: str, b: str) -> bool:
    """Both stores hold the same chunk files with the same bytes."""
    for root, _, names in os.walk(a):
        for n in names:
            if n == "zarr.json":
                continue
            p = os.path.join(root, n)
            q = os.path.join(b, os.path.relpath(p, a))
            if not os.path.exists(q):
                return False
            with open(p, "rb") as fa, open(q, "rb") as fb:
                if fa.read() != fb.read():
                    return False
    return True


def run_ingest(
    rows: int = 1_000_000,
    features: int = 56,
    files: int = 4,
    row_group_rows: int | None = None,
    workers: int = 2,
    seed: int = 0,
    workdir: str | None = None,
) -> dict[str, Any]:
    """Time Parquet ingest in one process and on ``workers`` workers against the
    single-process ``.npy`` ingest of the same rows.

    Parameters
    ----------
    rows
        Rows of the synthetic data.
    features
        Feature columns of the synthetic data (the target is one more).
    files
        Parquet files the rows are split into.
    row_group_rows
        Rows per Parquet row group, at most 262,144 (default: 262,144).
    workers
        Workers of the LocalCluster run.
    seed
        Seed of the synthetic rows.
    workdir
        Where the temporary directory goes (default: the system's).

    Returns
    -------
    dict
        Per run: ``seconds``, ``cpu_seconds`` (of every process of the run: on a
        machine shared with other work, the figure its load does not inflate),
        ``peak_mib`` (and ``worker_peak_mib``, one per worker); the ratios of both times
        to the ``npy`` run's; whether every store equals the first.
    """
    out: dict[str, Any] = {
        "rows": rows,
        "features": features,
        "files": files,
        "row_group_rows": row_group_rows,
        "workers": workers,
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="flymc-bench-ingest-", dir=workdir) as tmp:
        pq_dir, npy = _write_sources(tmp, rows, features, files, row_group_rows, seed)
        stores = []
        for name, code in _RUNS.items():
            dest = os.path.join(tmp, f"{name}.zarr")
            src = npy if name == "npy" else pq_dir
            done = subprocess.run(
                [sys.executable, "-c", _PRELUDE + code, src, dest, str(workers)],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"the {name} run failed: {done.stderr.strip()[-2000:]}")
            out["runs"][name] = json.loads(done.stdout.strip().splitlines()[-1])
            stores.append(dest)
        out["identical"] = all(_same_store(stores[0], s) for s in stores[1:])
    base = out["runs"]["npy"]["seconds"]
    out["ratio"] = {k: v["seconds"] / base for k, v in out["runs"].items()}
    cpu = out["runs"]["npy"]["cpu_seconds"]
    out["cpu_ratio"] = {k: v["cpu_seconds"] / cpu for k, v in out["runs"].items()}
    return out


def format_ingest(d: dict[str, Any]) -> str:
    """The figures as a table."""
    lines = [
        f"ingest of {d['rows']:,} rows x {d['features']} features (+ target) from "
        f"{d['files']} Parquet files, row groups of "
        f"{d['row_group_rows'] or 262_144:,} rows",
        f"{'run':<18}{'seconds':>10}{'x npy':>8}{'CPU s':>8}{'x npy':>8}{'peak MiB':>10}"
        f"  workers' peak MiB",
    ]
    for name, r in d["runs"].items():
        wk = " ".join(f"{w:.0f}" for w in r.get("worker_peak_mib", []))
        lines.append(
            f"{name:<18}{r['seconds']:>10.2f}{d['ratio'][name]:>8.2f}{r['cpu_seconds']:>8.1f}"
            f"{d['cpu_ratio'][name]:>8.2f}{r['peak_mib']:>10.0f}  {wk}"
        )
    lines.append(f"stores identical: {d['identical']}")
    return "\n".join(lines)
