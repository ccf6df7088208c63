"""The one runner: every algorithm's run, iteration by iteration, into a :class:`Result`.

An algorithm (the FlyMC / regular :class:`~flymc_dist.driver.Driver`, austerity's
:class:`~flymc_dist.austerity.sampler.AusteritySampler`) is a :class:`Sampler`: a set-up, and a
``step`` that moves every chain by one iteration. :func:`run` owns everything else, the
same way for each: the warm-up schedule (kernel parameters adapt, then are fixed), the
draws and statistics, the trace (buffered appends, checkpoints, resume), progress,
timing and the common run information.

A round (one round trip to the shards) lives in :mod:`flymc_dist.driver` and
:mod:`flymc_dist.protocol`; a run lives here.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

import numpy as np

from flymc_dist.kernels.base import Adapter, Kernel, params_to_json
from flymc_dist.models.base import Model
from flymc_dist.options import RunSettings
from flymc_dist.progress import Progress
from flymc_dist.protocol import Transport
from flymc_dist.result import Result, param_coords, param_dims
from flymc_dist.trace import Trace

__all__ = ["Sampler", "run"]


class Sampler(Protocol):
    """What :func:`run` drives: one algorithm's chains.

    A sampler may also have ``steps(n, seconds, positions, stats)``: after warm-up, up to
    ``n`` iterations in one call, as many as end within about ``seconds`` (at least one),
    their positions written into ``positions`` ``(chains, n, P)`` and :meth:`step`'s
    statistics into ``stats`` ``(chains, n)`` (views of the run's arrays), returning how
    many ran — the same as that many calls of :meth:`step`
    (:meth:`flymc_dist.driver.Driver.steps`); with ``n = 0`` none, the calls after made
    ready (:func:`run` asks at the end of warm-up).

    Attributes
    ----------
    chains, P, param_shape
        Number of chains, parameters per chain, and the shape of one draw.
    kernel
        The θ-kernel whose :meth:`~flymc_dist.kernels.base.Kernel.adapter` warm-up uses.
    params
        Each chain's kernel parameters (the runner replaces them after warm-up).
    positions
        ``(chains, P)``: every chain's current position.
    transport
        Reaches the shards (round trips and recoveries are reported from it).
    stat_names
        The per-iteration statistics :meth:`step` returns, name -> dtype.
    model
        The model sampled (the result keeps it: :meth:`~flymc_dist.result.Result.model`).
    """

    chains: int
    P: int
    param_shape: tuple[int, ...]
    kernel: Kernel
    params: list[Any]
    positions: np.ndarray
    transport: Transport
    stat_names: dict[str, str]
    model: Model

    def setup(self) -> None:
        """Everything before the first iteration (MAP, bounds, starting points, …)."""

    def setup_info(self) -> dict[str, Any]:
        """Run information the set-up settled (written to a new trace's attributes)."""

    def step(self, adapters: list[Adapter] | None) -> dict[str, np.ndarray]:
        """One iteration of every chain (feeding ``adapters`` during warm-up); its
        statistics, each of shape ``(chains,)``."""

    def checkpoint(self, iteration: int) -> dict[str, Any] | None:
        """A JSON-able state to resume from after ``iteration``; None: not resumable."""

    def restore(self, checkpoint: dict[str, Any]) -> None:
        """Continue from a :meth:`checkpoint` (called after :meth:`setup`)."""

    def timing(self) -> dict[str, Any] | None:
        """Cumulative timing counters (see :func:`timing_report`), or None."""

    def run_info(self, stats: dict[str, np.ndarray]) -> dict[str, Any]:
        """Closing run information, given the post-warm-up statistics."""


def run(
    sampler: Sampler,
    info: dict[str, Any],
    num_warmup: int,
    num_samples: int,
    settings: RunSettings,
    *,
    label: str = "sampling",
) -> Result:
    """Run ``sampler`` for ``num_warmup`` adapting and ``num_samples`` kept iterations.

    Parameters
    ----------
    sampler
        The algorithm's chains (not set up yet).
    info
        Run information known before the set-up; completed here and returned as
        ``Result.info`` (a new trace's attributes are ``info`` after the set-up, less
        the MAP).
    num_warmup, num_samples
        Iterations of warm-up (kernel parameters adapt, draws are kept apart) and of
        sampling.
    settings
        Its ``trace`` (path or URL), ``trace_storage_options``, ``resume``,
        ``overwrite_trace``, ``checkpoint_every`` and ``progress``, as for
        :func:`flymc_dist.sample`.
    label
        The progress line's label.

    Returns
    -------
    Result
    """
    C, shape = sampler.chains, sampler.param_shape
    trace = _resumed(settings, sampler.stat_names)
    start = 0 if trace is None else int(trace.checkpoint["iteration"]) + 1
    trace = _set_up(sampler, info, settings, trace, start)
    total = num_warmup + num_samples
    draws = _Draws(sampler, num_warmup, num_samples, trace if start else None)
    progress = Progress(total, settings.progress, initial=start, label=label, num_warmup=num_warmup)
    warm_done = num_warmup <= start
    snap = sampler.timing() if warm_done else None
    clock = _Clock(warm_done, dict(trace.checkpoint.get("seconds", {})) if start else {})
    try:
        snap = _iterate(
            sampler, draws, trace, (progress, clock), range(start, total), num_warmup,
            int(settings.checkpoint_every), snap,
        )  # fmt: skip
    finally:
        progress.close()
    clock.report(info)
    if snap is not None:
        info["timing"] = timing_report(
            snap, sampler.timing(), num_samples - max(start - num_warmup, 0)
        )
    info["total_round_trips"] = int(sampler.transport.round_trips)
    info.update(sampler.run_info(draws.stats))
    info["recoveries"] = list(sampler.transport.recoveries)
    info["kernel_params"] = [params_to_json(p) for p in sampler.params]
    info["kernel_repr"] = repr(sampler.kernel)  # with the options it ran with
    return Result(
        draws.samples.reshape((C, num_samples) + shape),
        draws.stats,
        draws.wsamples.reshape((C, num_warmup) + shape),
        draws.wstats,
        info,
        model=sampler.model,
    )


def _set_up(
    sampler: Sampler, info: dict[str, Any], settings: RunSettings, trace: Trace | None, start: int
) -> Trace | None:
    """Set ``sampler`` up and complete ``info`` with what it learnt; a new trace made
    (``settings.trace``, not a resume) or the resumed one's checkpoint restored.
    Returns the run's trace (None: none)."""
    # what the summary's warnings need (the kernel's targets, as it runs with them)
    for key in ("target_accept", "max_tree_depth"):
        value = getattr(sampler.kernel, key, None)
        if value is not None:
            info[key] = value
    sampler.setup()
    info.update(sampler.setup_info())
    if settings.trace is not None and trace is None:
        trace = _new_trace(settings, sampler, info)
    if start:
        sampler.restore(trace.checkpoint)
    return trace


class _Clock:
    """Wall seconds of warm-up and of sampling, over every segment of a resumed run
    (``before``: the earlier segments', kept in the trace's checkpoint so that
    ``flymc summary`` can report seconds per iteration)."""

    def __init__(self, warm_done: bool, before: dict[str, float]) -> None:
        self.t0 = time.perf_counter()
        self.warm_end = self.t0 if warm_done else None
        self.before = before

    def end_warmup(self) -> None:
        """Warm-up ends now."""
        self.warm_end = time.perf_counter()

    def so_far(self) -> dict[str, float]:
        """Seconds of warm-up and of sampling up to now, earlier segments included."""
        now = time.perf_counter()
        end_w = self.warm_end if self.warm_end is not None else now
        return {
            "warmup": float(self.before.get("warmup", 0.0)) + end_w - self.t0,
            "sampling": float(self.before.get("sampling", 0.0))
            + (now - self.warm_end if self.warm_end is not None else 0.0),
        }

    def report(self, info: dict[str, Any]) -> None:
        """``info``'s ``sampling_seconds`` and ``warmup_seconds`` (this segment's)."""
        t_end = time.perf_counter()
        info["sampling_seconds"] = t_end - (self.warm_end if self.warm_end is not None else self.t0)
        info["warmup_seconds"] = (self.warm_end - self.t0) if self.warm_end is not None else 0.0


def _iterate(
    sampler: Sampler,
    draws: _Draws,
    trace: Trace | None,
    meters: tuple[Progress, _Clock],
    iterations: range,
    num_warmup: int,
    checkpoint_every: int,
    snap: dict[str, float] | None,
) -> dict[str, float] | None:
    """Run ``iterations`` (of ``num_warmup`` warm-up and then sampling), keeping each
    draw in ``draws`` and, every ``checkpoint_every`` and at the ends of warm-up and of
    the run, in ``trace`` with a checkpoint. Returns the sampler's timing at the end of
    warm-up (``snap``, taken there if it ends here). A run that fails says on its
    exception how many iterations its trace keeps (``flymc_checkpointed``)."""
    progress, clock = meters
    shape, names = sampler.param_shape, sampler.stat_names
    total = iterations.stop
    # warm-up adapts the kernel parameters (outside the kernel); at its end the adapted
    # parameters are fixed, so warm-up cannot leak into sampling
    adapters = None
    if iterations.start < num_warmup:
        adapters = [
            sampler.kernel.adapter(p, num_warmup - iterations.start) for p in sampler.params
        ]
    buf: list[tuple[bool, np.ndarray, dict]] = []
    saved = iterations.start  # iterations the trace's last checkpoint keeps
    # after warm-up, a sampler that has ``steps`` runs many iterations per call
    steps = getattr(sampler, "steps", None)
    try:
        i = iterations.start
        while i < total:
            warm = i < num_warmup
            if not warm and steps is not None:
                # as many iterations as the trace's next flush allows and end within the
                # progress bar's interval (an interruption is taken between calls)
                n = total - i if trace is None else min(total - i, checkpoint_every - len(buf))
                n = steps(n, progress.interval, *draws.window(i, n))
                pos_n, st_n = draws.window(i, n)  # the iterations that ran
                progress.update_many(st_n)
                if trace is not None:
                    buf.extend(
                        (False, pos_n[:, j], {k: v[:, j] for k, v in st_n.items()})
                        for j in range(n)
                    )
                i += n
            else:
                st = sampler.step(adapters if warm else None)
                if warm and i == num_warmup - 1:
                    sampler.params = [a.final() for a in adapters]
                    adapters = None
                pos = sampler.positions.copy()
                draws.put(i, pos, st)
                if i == num_warmup - 1:
                    if steps is not None:  # sampling's calls made ready, in warm-up's time
                        steps(0, 0.0, *draws.window(num_warmup, 0))
                    snap = sampler.timing()
                    clock.end_warmup()
                progress.update(st)
                if trace is not None:
                    buf.append((warm, pos, st))
                i += 1
            if trace is not None and (
                len(buf) >= checkpoint_every or i == total or i == num_warmup
            ):
                _flush(trace, buf, shape, names)
                checkpoint = sampler.checkpoint(i - 1)
                if checkpoint is not None:
                    trace.set_checkpoint({**checkpoint, "seconds": clock.so_far()})
                    saved = i
                buf = []
    except BaseException as err:
        # what the trace keeps, as this run wrote it: said even if the trace's store
        # cannot be reached to read it back (see flymc_dist.api)
        if trace is not None and saved:
            with contextlib.suppress(AttributeError, TypeError):
                err.flymc_checkpointed = saved  # type: ignore[attr-defined]
        raise
    return snap


def _resumed(settings: RunSettings, names: dict[str, str]) -> Trace | None:
    """The trace a resumed run continues (None: not a resume), refused unless it has a
    checkpoint and records the statistics ``names``."""
    if settings.trace is None or not settings.resume:
        return None
    path = settings.trace
    trace = Trace.open(path, storage_options=settings.trace_storage_options)
    if trace.checkpoint is None:
        raise ValueError(f"trace {path} has no checkpoint to resume from")
    if set(trace.stat_dtypes) != set(names):
        raise ValueError(
            f"trace {path} was written by an earlier version (it records the "
            f"statistics {sorted(trace.stat_dtypes)}, this version {sorted(names)}): it "
            "cannot be resumed; start a new trace"
        )
    return trace


def _new_trace(settings: RunSettings, sampler: Sampler, info: dict[str, Any]) -> Trace:
    """A new trace at ``settings.trace`` for the draws of ``sampler``; its attributes
    are ``info`` (less the MAP)."""
    shape = sampler.param_shape
    return Trace.create(
        settings.trace,
        chains=sampler.chains,
        param_shape=shape,
        stats={k: np.dtype(v) for k, v in sampler.stat_names.items()},
        attrs={k: v for k, v in info.items() if k != "map"},
        overwrite=bool(settings.overwrite_trace),
        storage_options=settings.trace_storage_options,
        dims=param_dims(shape),
        coords=param_coords(shape, info.get("feature_names")),
    )


class _Draws:
    """A run's draws and statistics, kept apart during warm-up: ``(C, iterations, P)``
    and ``(C, iterations)`` arrays, those of earlier segments read from ``trace`` (a
    resumed run's)."""

    def __init__(
        self, sampler: Sampler, num_warmup: int, num_samples: int, trace: Trace | None
    ) -> None:
        C, P, names = sampler.chains, sampler.P, sampler.stat_names
        self.num_warmup = num_warmup
        self.samples = np.empty((C, num_samples, P))
        self.wsamples = np.empty((C, num_warmup, P))
        self.stats = {k: np.zeros((C, num_samples), dtype=v) for k, v in names.items()}
        self.wstats = {k: np.zeros((C, num_warmup), dtype=v) for k, v in names.items()}
        if trace is not None:  # what earlier segments drew, as the trace keeps it
            prev_w, prev = trace.warmup_samples, trace.samples
            self.wsamples[:, : prev_w.shape[1]] = prev_w.reshape(C, -1, P)
            self.samples[:, : prev.shape[1]] = prev.reshape(C, -1, P)
            for k in names:
                self.wstats[k][:, : prev_w.shape[1]] = trace.warmup_stats[k]
                self.stats[k][:, : prev.shape[1]] = trace.stats[k]

    def window(self, i: int, n: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Where post-warm-up iterations ``i .. i + n - 1`` are kept: views of the
        positions ``(C, n, P)`` and the statistics ``(C, n)``, written in place."""
        out = slice(i - self.num_warmup, i - self.num_warmup + n)
        return self.samples[:, out], {k: v[:, out] for k, v in self.stats.items()}

    def put(self, i: int, pos: np.ndarray, st: dict[str, np.ndarray]) -> None:
        """Keep iteration ``i``'s positions and statistics."""
        warm = i < self.num_warmup
        samples, stats = (self.wsamples, self.wstats) if warm else (self.samples, self.stats)
        j = i if warm else i - self.num_warmup
        samples[:, j] = pos
        for k in stats:
            stats[k][:, j] = st[k]


def describe_run(
    *,
    transport: Transport,
    n_shards: int,
    data: str,
    model_description: dict[str, Any],
    chains: int,
    seed: int,
    n_rows: int,
    n_features: int,
    num_warmup: int,
    num_samples: int,
    feature_names: list[str] | None = None,
    **algorithm: Any,
) -> dict[str, Any]:
    """The run information every sampler reports before its set-up: its own keys
    ``algorithm`` (``"algorithm"``, ``"kernel"``, ``"bounds"``, ...) first, then the data
    (with its column names, ``feature_names``, or None), the cluster and the run's size,
    under the same names for each."""
    return {
        **algorithm,
        "chains": chains,
        "seed": seed,
        "n_rows": n_rows,
        "n_features": n_features,
        "n_shards": n_shards,
        "transport": transport.name,
        "n_workers": transport.n_workers,
        "data": data,
        "feature_names": None if feature_names is None else [str(n) for n in feature_names],
        "model": model_description,
        "num_warmup": num_warmup,
        "num_samples": num_samples,
    }


def storage_info(transport: Transport) -> dict[str, Any]:
    """Each shard's storage: ``out_of_core`` and ``memory_budget`` (lists, one per shard);
    ``bytes_read``, the bytes its out-of-core shards have read from their row files so
    far; ``rows_read``, the rows they have read by position, not in full passes
    (z-update proposals, for a shard's own z-update or read ahead for the driver's;
    austerity's minibatches); ``passes``, the full passes over the rows so far (the most
    any shard made: the read of the store counts as one); ``lost_rows``, the bright rows
    out-of-core shards found not resident and read back (none, but for a fault)."""
    states = transport.call("state")
    return {
        "out_of_core": [bool(st["out_of_core"]) for st in states],
        "memory_budget": [st["memory_budget"] for st in states],
        "bytes_read": sum(int(st["bytes_read"]) for st in states),
        "rows_read": sum(int(st["rows_read"]) for st in states),
        "passes": max((int(st["passes"]) for st in states), default=0),
        "lost_rows": sum(int(st["lost_rows"]) for st in states),
    }


def timing_report(a: dict[str, Any], b: dict[str, Any], iterations: int) -> dict[str, Any]:
    """Seconds per post-warm-up iteration: where the time of a step went.

    ``a`` and ``b`` are :meth:`Sampler.timing` at the end of warm-up and at the end.
    ``step`` (the driver's whole iteration) = ``round_trip`` (waiting on the transport:
    the round trips' communication plus the workers' ``host_round_wall``) + ``driver``
    (kernels, sums, bookkeeping). Per host: rounds served, wall and CPU seconds per
    round, and the handshakes and frames its round channel refused over the whole run
    (``channel_refused``: see :mod:`flymc_dist.transport.channel`). The driver's samplers
    also give ``z_update`` (FlyMC's z-update in replica mode: its round, or its update on
    the replica with the wait for read-ahead rows) and ``theta_kernel``, the rest of the
    step: the θ-kernel on the replica; ``theta_compute``, of that the compiled θ-kernel
    transitions alone (each chain's call, where the kernel runs whole on the replica).
    """
    n = max(int(iterations), 1)
    hosts = []
    if len(a["hosts"]) == len(b["hosts"]):
        for ha, hb in zip(a["hosts"], b["hosts"], strict=True):
            rounds = hb["rounds"] - ha["rounds"]
            per = max(rounds, 1)
            hosts.append(
                {
                    "rounds": int(rounds),
                    "round_wall": (hb["round_wall"] - ha["round_wall"]) / per,
                    "round_cpu": (hb["round_cpu"] - ha["round_cpu"]) / per,
                    "channel_refused": int(hb["channel_refused"]),
                }
            )
    step = (b["step"] - a["step"]) / n
    rt = (b["round"] - a["round"]) / n
    out = {"iterations": n, "step": step, "round_trip": rt, "driver": step - rt, "hosts": hosts}
    if "z" in a and "z" in b:  # replica mode: the z-updates, and the θ-kernel's the rest
        out["z_update"] = (b["z"] - a["z"]) / n
        out["theta_kernel"] = step - out["z_update"]
    if a.get("theta") is not None and b.get("theta") is not None:
        # the compiled θ-kernel transitions alone (replica mode, a fused kernel)
        out["theta_compute"] = (b["theta"] - a["theta"]) / n
    return out


def _flush(
    trace: Trace,
    buf: list[tuple[bool, np.ndarray, dict]],
    shape: tuple[int, ...],
    names: dict[str, str],
) -> None:
    """Append the buffered iterations to the trace (warm-up and sampling apart)."""
    for warm in (True, False):
        part = [b for b in buf if b[0] == warm]
        if not part:
            continue
        C = part[0][1].shape[0]
        s = np.stack([b[1] for b in part], axis=1).reshape((C, len(part)) + shape)
        st = {k: np.stack([b[2][k] for b in part], axis=1) for k in names}
        trace.append(s, st, warmup=warm)
