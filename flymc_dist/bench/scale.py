"""``flymc bench scale``: FlyMC's cost per iteration against N, in memory and out of core.

For each N, a float32 logistic store of N rows × ``features`` (the bias included; written
once by :func:`flymc_dist.data.make_logistic` into ``workdir`` and reused by later runs
when its shape, seed and dtype match) is sampled by MAP-tuned FlyMC on an embedded
LocalCluster of ``workers`` single-threaded worker processes (by default the sampler's
layout, one shard per worker; ``n_shards`` runs other layouts beside it), with the
shards in memory or left in the store as ``out_of_core`` decides (``"auto"``: out of core
when a shard's rows exceed its memory budget, by default its share of half its worker's
memory limit). One cluster serves every N; each worker's peak RSS is reset before each
run and read after it, in the worker.

Figures per N:

* **s/it**: seconds per post-warm-up iteration (sampling seconds / draws; an iteration
  moves every chain once);
* **load s**: the run's seconds outside set-up, warm-up and sampling: starting the
  shards on the workers (reading the rows of in-memory shards), collecting results;
* **set-up s**: the driver's set-up (MAP search, bounds, first z);
* **passes**: the full passes over the rows set-up made (``info["setup_passes"]``: the
  read of the store counts as one; the most any shard made);
* **rows/s** and **MB/s/worker** of the out-of-core shards' set-up passes over their row
  files (``info["setup_bytes_read"]``, records of D float32 features and an int64
  label): rows read over the set-up seconds, summed over workers, and MB per worker
  (one shard per worker, all reading at once). Set-up also computes (gradients, bound
  statistics), so this is the throughput of whole passes, a lower bound on the reads'
  own speed. In-memory shards read no row file: "-";
* **rows/it**: rows an out-of-core shard read by position per iteration after set-up
  (the z-updates' proposals, read ahead; 0 in memory);
* **peak RSS** per worker (VmHWM, reset via ``/proc/self/clear_refs`` before the run:
  Linux only, else not measured), and whether each shard was out of core;
* **bright**: mean bright rows / N; **queries/it**: likelihood queries per chain per
  iteration; **min ESS/it**: the smallest bulk ESS over parameters (all chains pooled) per
  post-warm-up iteration, and per sampling second (**ESS/s**); **R-hat**: the largest
  rank-normalised split-R̂.

Below the table: the least-squares slope of log(s/it) on log N, and, when N = 10⁶ and a
larger N were both run, the largest N's s/it over the s/it at 10⁶ (both of the first
layout's runs); with several layouts, each run's s/it over the first layout's at its N.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import flymc_dist as fd
from flymc_dist.austerity.sampler import loglog_slope
from flymc_dist.bench.common import reusable_store
from flymc_dist.data import make_logistic
from flymc_dist.transport.dask import local_client

__all__ = ["format_scale", "peak_rss", "reset_peak_rss", "run_scale"]

#: the reference size of the cost ratio
REFERENCE_N = 1_000_000


def reset_peak_rss() -> bool:
    """Start this process's peak RSS (VmHWM) afresh; False where that is not possible.

    Needed in workers: one forked from a large parent would otherwise report the parent's
    peak.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss() -> int | None:
    """This process's peak resident set size since the last reset, in bytes (Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _store(
    workdir: str, n: int, d: int, seed: int, chunk_rows: int | None
) -> tuple[Any, float, bool]:
    """The float32 logistic store of ``n × d`` rows: reused when it matches, else written.

    Returns
    -------
    dataset, seconds, reused
        The store, the seconds spent writing it (0 when reused), and whether it was.
    """
    tag = "" if chunk_rows is None else f"_chunk{chunk_rows}"
    path = os.path.join(workdir, f"logistic_{n}x{d}_seed{seed}{tag}_float32.zarr")
    ds = reusable_store(
        path, n, d, dtype="float32", generator="make_logistic", seed=seed, chunk_rows=chunk_rows
    )
    if ds is not None:  # else none, incomplete or foreign: written afresh below
        return ds, 0.0, True
    t0 = time.perf_counter()
    ds = make_logistic(
        path, n, d, seed=seed, chunk_rows=chunk_rows, dtype="float32", overwrite=True
    )
    return ds, time.perf_counter() - t0, False


def _parse_out_of_core(value: str | bool) -> str | bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v == "auto":
        return "auto"
    if v in ("true", "yes", "1"):
        return True
    if v in ("false", "no", "0"):
        return False
    raise ValueError(f"out_of_core must be 'auto', True or False, not {value!r}")


def _figures(res: Any, wall: float, n: int, d: int) -> dict[str, Any]:
    """The figures of one run (see the module docstring)."""
    info = res.info
    eff = res.efficiency()
    draws = int(res.samples.shape[1])
    iterations = draws + int(info["num_warmup"])
    setup_s = float(info["setup_seconds"])
    setup_bytes = int(info.get("setup_bytes_read", 0))
    record = d * 4 + 8  # a row file's record: float32 features and an int64 label
    rows_read = setup_bytes / record
    streamed = rows_read > 0 and setup_s > 0
    shards = max(1, sum(bool(x) for x in info["out_of_core"]))  # those that stream
    rows_per_s = rows_read / setup_s if streamed else None
    return {
        "n_rows": n,
        "wall_seconds": wall,
        "load_seconds": wall
        - setup_s
        - float(info["warmup_seconds"])
        - float(info["sampling_seconds"]),
        "setup_seconds": setup_s,
        "warmup_seconds": float(info["warmup_seconds"]),
        "sampling_seconds": float(info["sampling_seconds"]),
        "seconds_per_iteration": float(info["sampling_seconds"]) / draws,
        "draws": draws,
        "warmup": int(info["num_warmup"]),
        "out_of_core": [bool(x) for x in info["out_of_core"]],
        "memory_budget": list(info["memory_budget"]),
        "setup_bytes_read": setup_bytes,
        "setup_passes": int(info["setup_passes"]),
        "rows_per_second": rows_per_s,
        # one shard per worker, all reading at once
        "mb_per_second_per_worker": (
            None if rows_per_s is None else rows_per_s * record / shards / 1e6
        ),
        "rows_read_per_iteration": int(info.get("rows_read", 0)) / iterations,
        "bright_fraction": float(eff["bright_fraction"]),
        "bright_rows_per_chain": float(res.stats["n_bright"].mean()),
        "queries_per_iteration": float(eff["queries_per_iteration"]),
        "ess_min": float(eff["ess_min"]),
        "ess_min_per_iteration": float(eff["ess_min"]) / draws,
        "ess_min_per_second": float(eff["ess_min"]) / float(info["sampling_seconds"]),
        "r_hat_max": float(eff["r_hat_max"]),
        "converged": bool(eff["r_hat_max"] <= 1.01),
        "q_db": info.get("q_db"),
    }


def run_scale(
    ns: Sequence[float] = (1e5, 1e6, 1e7),
    features: int = 57,
    kernel: str = "rwmh",
    chains: int = 4,
    num_warmup: int = 1000,
    num_samples: int = 5000,
    workers: int = 2,
    memory_limit: str = "auto",
    out_of_core: Sequence[str] = ("auto",),
    memory_budget: float | None = None,
    seed: int = 0,
    workdir: str | None = None,
    chunk_rows: int | None = None,
    n_shards: Sequence[int] = (0,),
) -> dict[str, Any]:
    """FlyMC's cost per iteration, set-up, memory and mixing for each N.

    Parameters
    ----------
    ns
        Row counts (e.g. ``1e5 1e6 1e7 1e8``). Stores of 10⁸ × 57 take 23 GB on disk and
        a long while to write: they are kept in ``workdir`` for the next run.
    features
        D, the bias column included.
    kernel
        FlyMC's θ-kernel.
    chains
        Chains per run.
    num_warmup, num_samples
        Warm-up and kept iterations per run.
    workers
        Worker processes of the embedded LocalCluster (one thread each; one shard each).
    memory_limit
        Each worker's memory limit, as Dask takes it (``"auto"``: Dask's share of the
        machine's memory; or bytes such as ``"2GB"``).
    out_of_core
        The modes each N runs with, one after the other on the same store and cluster:
        ``"auto"`` (a shard goes out of core when its rows exceed its memory budget),
        ``True`` (always) or ``False`` (never); e.g. ``false true`` for in memory and
        out of core side by side.
    memory_budget
        Bytes of rows per shard before ``"auto"`` leaves them in the store (default:
        the shard's share of half its worker's memory limit).
    seed
        Seeds the data (and the store's name) and the chains.
    workdir
        Where the stores are written and kept (default: ``flymc-bench-scale`` in the
        temporary directory).
    chunk_rows
        Rows per store chunk (default: the writer's, ~8 MiB chunks). Shards are cut at
        chunk edges, so a store of fewer chunks than workers has fewer shards.
    n_shards
        The layouts each N runs with, one after the other on the same store and
        cluster: shard counts, ``0`` for the sampler's default (one shard per worker).

    Returns
    -------
    dict
        ``setup`` (how it ran: cores, workers, memory limits, options), ``rows`` (one dict
        of figures per N, see the module docstring), ``slope`` (of log s/it on log N;
        None below two sizes) and ``ratio_to_1e6`` (the largest N's s/it over 10⁶'s, or
        None).
    """
    sizes = [int(round(float(n))) for n in ns]
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"ns must be one or more row counts >= 1, not {list(ns)!r}")
    if features < 2:
        raise ValueError(f"features must be >= 2 (the bias and one more), not {features!r}")
    layouts = [int(k) for k in n_shards]
    if not layouts or any(k < 0 for k in layouts):
        raise ValueError(
            f"n_shards must be one or more counts >= 0 (0: the default), not {n_shards!r}"
        )
    modes = [
        _parse_out_of_core(v)
        for v in ([out_of_core] if isinstance(out_of_core, str | bool) else out_of_core)
    ]
    if not modes:
        raise ValueError("out_of_core must name one or more modes")
    budget = None if memory_budget is None else int(memory_budget)
    workdir = workdir or os.path.join(tempfile.gettempdir(), "flymc-bench-scale")
    os.makedirs(workdir, exist_ok=True)

    t_all = time.perf_counter()
    rows: list[dict[str, Any]] = []
    setup: dict[str, Any] = {
        "features": int(features),
        "kernel": kernel,
        "chains": int(chains),
        "num_warmup": int(num_warmup),
        "num_samples": int(num_samples),
        "workers": int(workers),
        "threads_per_worker": 1,
        "memory_limit": memory_limit,
        "out_of_core": modes if len(modes) > 1 else modes[0],
        "memory_budget": budget,
        "chunk_rows": chunk_rows,
        "n_shards": layouts,
        "seed": int(seed),
        "workdir": workdir,
        "dtype": "float32",
        "cores": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "memory_total": _total_memory(),
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "loadavg_before": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    stores: list[dict[str, Any]] = []
    # (shutdown races log errors)
    client, cluster = local_client(
        workers, memory_limit=memory_limit, silence_logs=logging.CRITICAL
    )
    with cluster, client:
        limits = sorted(w.get("memory_limit") for w in client.scheduler_info()["workers"].values())
        setup["worker_memory_limits"] = limits
        model = fd.LogisticRegression(prior="normal", prior_scale=1.0)
        for n in sizes:
            ds, gen_s, reused = _store(workdir, n, int(features), int(seed), chunk_rows)
            stores.append({"n_rows": n, "path": ds.path, "seconds": gen_s, "reused": reused})
            for ooc, layout in [(m, k) for m in modes for k in layouts]:
                pids = client.run(os.getpid)
                rss_ok = all(client.run(reset_peak_rss).values())
                t0 = time.perf_counter()
                res = fd.sample(
                    model,
                    ds,
                    fd.FlyMC(bounds="map"),
                    kernel,
                    chains=int(chains),
                    num_warmup=int(num_warmup),
                    num_samples=int(num_samples),
                    seed=int(seed),
                    client=client,
                    placement=fd.Placement(
                        n_shards=layout or None, out_of_core=ooc, memory_budget=budget
                    ),
                    progress=False,
                )
                wall = time.perf_counter() - t0
                peaks = client.run(peak_rss)
                fig = _figures(res, wall, n, int(features))
                fig["layout"] = layout
                fig["mode"] = ooc
                fig["peak_rss"] = [peaks[a] if rss_ok else None for a in sorted(peaks)]
                fig["workers_restarted"] = client.run(os.getpid) != pids
                rows.append(fig)
                del res
    setup["stores"] = stores
    setup["loadavg_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "setup": setup,
        "rows": rows,
        "slope": _slope(_first_variant(rows, modes[0], layouts[0])),
        "ratio_to_1e6": _ratio(_first_variant(rows, modes[0], layouts[0])),
        "seconds": time.perf_counter() - t_all,
    }


def _total_memory() -> int | None:
    """The machine's memory in bytes (None where unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _slope(rows: list[dict[str, Any]]) -> float | None:
    """Least-squares slope of log(s/it) on log N over distinct N (None below two)."""
    if len({r["n_rows"] for r in rows}) < 2:
        return None
    return loglog_slope([r["n_rows"] for r in rows], [r["seconds_per_iteration"] for r in rows])


def _ratio(rows: list[dict[str, Any]]) -> float | None:
    """The largest N's s/it over the s/it at 10⁶ (None unless both were run)."""
    ref = [r for r in rows if r["n_rows"] == REFERENCE_N]
    big = max(rows, key=lambda r: r["n_rows"], default=None)
    if not ref or big is None or big["n_rows"] <= REFERENCE_N:
        return None
    return big["seconds_per_iteration"] / ref[0]["seconds_per_iteration"]


def _first_variant(rows: list[dict[str, Any]], mode: Any, layout: int) -> list[dict[str, Any]]:
    """The runs of the first mode and layout (what the slope and the ratio are of)."""
    return [r for r in rows if r["layout"] == layout and r.get("mode", mode) == mode]


def _layout_ratios(rows: list[dict[str, Any]]) -> list[float]:
    """Each run's s/it over the s/it of the first run at its N (1.0 for those)."""
    first: dict[int, float] = {}
    for r in rows:
        first.setdefault(r["n_rows"], r["seconds_per_iteration"])
    return [r["seconds_per_iteration"] / first[r["n_rows"]] for r in rows]


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.0f}"


def _n(n: int) -> str:
    """N compactly: 100000 -> 1e5, 3000 -> 3,000."""
    e = int(math.log10(n)) if n > 0 else 0
    if n >= 10**5 and n % 10**e == 0:
        k = n // 10**e
        return f"{k}e{e}" if k > 1 else f"1e{e}"
    return f"{n:,d}"


def format_scale(d: dict[str, Any]) -> str:
    """The figures of :func:`run_scale` as a table."""
    s = d["setup"]
    lim = s.get("worker_memory_limits") or []
    lim_txt = "/".join(f"{x / 1e9:.2f}" for x in lim) + " GB" if lim else str(s["memory_limit"])
    mem = s.get("memory_total")
    lines = [
        f"flymc bench scale: float32 logistic stores x {s['features']} features, MAP-tuned "
        f"FlyMC, {s['kernel']}, {s['chains']} chains, {s['num_warmup']} warm-up + "
        f"{s['num_samples']} draws, seed {s['seed']}",
        f"run on {s['cores']} cores ({s['machine']}"
        + (f", {mem / 1e9:.0f} GB" if mem else "")
        + f"): embedded LocalCluster of {s['workers']} workers x 1 thread, memory limit "
        f"{s['memory_limit']} ({lim_txt} per worker); out_of_core="
        f"{s['out_of_core']!r}, memory_budget={s['memory_budget']!r}; load "
        f"{s['loadavg_before']} -> {s['loadavg_after']}",
        "s/it: sampling seconds per iteration; passes: full passes of set-up; "
        "rows/s, MB/s/w: set-up's passes over the row files "
        "(rows read / set-up s; MB per worker); RSS: peak per worker; "
        "rows/it: rows read by position per iteration after set-up; bright: mean bright "
        "rows / N; q/it: queries per chain per iteration; minESS/it, ESS/s: min bulk ESS / "
        "draws, / sampling s",
    ]
    modes = s["out_of_core"] if isinstance(s["out_of_core"], list) else [s["out_of_core"]]
    layouts = len(set(s.get("n_shards") or [0])) > 1 or len(modes) > 1
    if layouts:
        lines.append(
            "shards: the run's layout (default: one shard per worker); ooc: each shard out of "
            "core (y) or in memory (n); x first: its s/it over the first run's at that N"
        )
    lay_head = f"{'shards':>11}{'x first':>8}" if layouts else ""
    head = (
        f"{'N':>10}{lay_head}{'ooc':>8}{'load s':>8}{'setup s':>9}{'passes':>7}{'rows/s':>10}"
        f"{'MB/s/w':>8}"
        f"{'ms/it':>9}{'rows/it':>9}{'peak RSS MB':>14}{'bright':>10}{'q/it':>9}"
        f"{'minESS/it':>10}{'ESS/s':>9}{'R-hat':>7}"
    )
    lines.append(head)
    for r, x_first in zip(d["rows"], _layout_ratios(d["rows"]), strict=True):
        ooc = "/".join("y" if x else "n" for x in r["out_of_core"])
        n_sh = len(r["out_of_core"])
        lay = (
            (f"{'default ' + str(n_sh) if not r.get('layout') else n_sh:>11}{x_first:>8.2f}")
            if layouts
            else ""
        )
        rps = "-" if r["rows_per_second"] is None else f"{r['rows_per_second']:.3g}"
        mbs = (
            "-" if r["mb_per_second_per_worker"] is None else f"{r['mb_per_second_per_worker']:.0f}"
        )
        rss = "/".join(_mb(x) for x in r["peak_rss"])
        passes = f"{r['setup_passes']:d}"
        lines.append(
            f"{_n(r['n_rows']):>10}{lay} {ooc:>7}"
            f"{r['load_seconds']:>8.1f}{r['setup_seconds']:>9.1f}"
            f"{passes:>7}{rps:>10}{mbs:>8}"
            f"{1000 * r['seconds_per_iteration']:>9.3f}"
            f"{r['rows_read_per_iteration']:>9.4g}{rss:>14}"
            f"{r['bright_fraction']:>10.2e}{r['queries_per_iteration']:>9.4g}"
            f"{r['ess_min_per_iteration']:>10.4f}{r['ess_min_per_second']:>9.1f}"
            f"{r['r_hat_max']:>7.3f}"
        )
    sl = d.get("slope")
    lines.append(
        "log-log slope of s/it on N"
        + (" (first layout)" if layouts else "")
        + ": "
        + ("- (fewer than two sizes)" if sl is None else f"{sl:.3f}")
    )
    ratio = d.get("ratio_to_1e6")
    if ratio is not None:
        big = max(r["n_rows"] for r in d["rows"])
        lines.append(f"s/it at N = {_n(big)} / s/it at N = 1e6: {ratio:.2f}x")
    bad = [_n(r["n_rows"]) for r in d["rows"] if not r["converged"]]
    if bad:
        lines.append(
            f"NOT CONVERGED (R-hat > 1.01) at N = {', '.join(bad)}: more draws needed for "
            "the ESS figures to mean much"
        )
    restarted = [_n(r["n_rows"]) for r in d["rows"] if r["workers_restarted"]]
    if restarted:
        lines.append(f"WORKERS RESTARTED during the run at N = {', '.join(restarted)}")
    return "\n".join(lines)
