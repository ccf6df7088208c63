"""The trace session of :func:`flymc_dist.sample`: one writer at a time (the trace's
:class:`~flymc_dist.trace.TraceLock`), a resume that matches the run it continues, and a
failure that keeps what can be resumed and removes only what this run created."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from flymc_dist._paths import is_url, local_path
from flymc_dist._unreachable import unreachable
from flymc_dist.call import Call, default_kernel
from flymc_dist.data import Dataset, open_dataset
from flymc_dist.layout import shard_layout
from flymc_dist.options import FlyMC
from flymc_dist.trace import Trace, TraceLock

__all__ = ["data_id", "kept_trace", "shaping_options", "trace_options", "traced"]


def shaping_options(call: Call) -> dict[str, Any]:
    """The settings that shape a run's draws, by name (a resumed run must match them),
    read from the call's typed objects (FlyMC's are its defaults for another
    algorithm)."""
    fly, placement = call.flymc, call.placement
    return {
        "q_db": fly.q_db,
        "kernel_options": call.kernel_options,
        "init": call.init,
        "precondition": call.precondition,
        "map_maxiter": call.map_maxiter,
        "bright_replica": fly.bright_replica,
        "replica_budget": fly.replica_budget,
        "out_of_core": placement.out_of_core,
        "memory_budget": placement.memory_budget,
        "exact_rows": fly.exact_rows,
    }


def trace_options(data: Any, trace: Any, given: dict[str, Any] | None) -> dict[str, Any] | None:
    """The fsspec options of the trace: ``given`` (``trace_storage_options``) if not None,
    else the data set's ``storage_options`` when the trace is a URL of the same protocol
    (e.g. both s3)."""
    if given is not None:
        return dict(given) or None
    ds_options = getattr(data, "storage_options", None)
    if trace is None or not ds_options or not is_url(trace):
        return None
    same = os.fspath(trace).split("://", 1)[0] == str(data.path).split("://", 1)[0]
    return dict(ds_options) if same else None


def data_id(data: Any) -> str:
    """The identity of the data: :meth:`Dataset.fingerprint`, or a hash of in-memory rows."""
    if isinstance(data, tuple):
        X = np.ascontiguousarray(data[0], dtype=float)
        y = np.ascontiguousarray(data[1], dtype=float)
        h = hashlib.sha256(repr((X.shape, y.shape)).encode())
        h.update(X.tobytes())
        h.update(y.tobytes())
        return f"{X.shape[0]}x{X.shape[1]}:in-memory-sha256-{h.hexdigest()[:32]}"
    return (data if isinstance(data, Dataset) else open_dataset(str(data))).fingerprint()


def _canon(value: Any) -> Any:
    """A comparable form: arrays and tuples as lists, integral floats as ints, dicts sorted."""
    if isinstance(value, np.ndarray):
        return _canon(value.tolist())
    if isinstance(value, dict):
        return {str(k): _canon(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: what a trace must record for a resume to be checked: a resume without them is refused
_MUST_RECORD = {
    "data_id": "the identity of its data set",
    "options": "the settings that shape its draws",
}


def _check_resume(call: Call) -> None:
    """Refuse, in one line naming what differs, to resume a trace written by another run:
    the model, the data set (its identity, not only its shape), the algorithm and every
    setting that shapes the draws."""
    path = call.trace
    trace = Trace.open(path, read_only=True, storage_options=call.trace_storage_options)
    if trace.checkpoint is None:
        raise ValueError(f"trace {os.fspath(path)!s} has no checkpoint to resume from")
    trace.verify()  # a chunk of its draws missing: TraceDamagedError, naming it
    specs, _mem, n_rows, n_features, _t, _k, data_path = shard_layout(call.data, call.placement)
    algorithm = call.algorithm.name
    want: dict[str, Any] = {
        "data_id": data_id(call.data),
        "n_rows": n_rows,
        "n_features": n_features,
        "model": call.model.to_dict(),
        "algorithm": algorithm,
        "kernel": default_kernel(call.kernel, algorithm),
        "chains": call.chains,
        "seed": call.seed,
        "num_warmup": call.num_warmup,
        "num_samples": call.num_samples,
        "options": shaping_options(call),
    }
    if isinstance(call.algorithm, FlyMC):
        want.update(bounds=call.algorithm.bounds, z_update=call.algorithm.z_update)
        if call.algorithm.z_update == "explicit":
            want["resample_fraction"] = call.algorithm.resample_fraction
    attrs = trace.attrs
    unrecorded = [k for k in _MUST_RECORD if k not in attrs]
    if unrecorded:  # written before traces recorded them: this run cannot be checked
        what = " and ".join(f"{k!r} ({_MUST_RECORD[k]})" for k in unrecorded)
        raise ValueError(
            f"cannot resume {os.fspath(path)!s}: the trace does not record {what} (it was "
            "written by an older flymc_dist), so this run cannot be checked to continue it "
            "on the same data set with the same settings; start a new trace instead"
        )
    if isinstance(attrs.get("kernel"), str):
        attrs["kernel"] = attrs["kernel"].strip().lower()
    diff = []
    for key, value in want.items():
        if key not in attrs or _canon(attrs[key]) == _canon(value):
            continue
        if key == "data_id":
            diff.append(
                f"another data set ({attrs.get('data')} [{attrs[key]}]; this run: "
                f"{data_path} [{value}])"
            )
        elif key == "options":
            old, new = _canon(attrs[key]), _canon(value)
            diff += [
                f"{k} {old[k]!r} (this run: {new[k]!r})" if k in old else f"no {k}"
                for k in sorted(new)
                if k not in old or old[k] != new[k]
            ]
        else:
            diff.append(f"{key} {attrs[key]!r} (this run: {value!r})")
    if diff:
        raise ValueError(
            f"cannot resume {os.fspath(path)!s}: it was written with " + "; ".join(diff)
        )


#: what :func:`_stamp` returns for a trace whose store cannot be reached
_UNREACHABLE = "unreachable"


def _stamp(path: Any, storage_options: dict[str, Any] | None = None) -> Any:
    """Identity of a trace's root metadata file (it changes with every write): inode and
    time locally, the object's ETag (or time) on an object store; None if it is absent,
    :data:`_UNREACHABLE` if its store cannot be reached."""
    if is_url(path):
        import fsspec

        try:
            fs, root = fsspec.core.url_to_fs(os.fspath(path), **(storage_options or {}))
            fs.invalidate_cache()
            info = fs.info(f"{root.rstrip('/')}/zarr.json")
        except Exception as err:
            if unreachable(err):
                return _UNREACHABLE
            if isinstance(err, OSError | ValueError):
                return None
            raise
        return info.get("ETag") or info.get("LastModified") or info.get("mtime") or info
    try:
        st = os.stat(os.path.join(local_path(path), "zarr.json"))
    except (OSError, TypeError):
        return None
    return (st.st_ino, st.st_mtime_ns)


def kept_trace(err: BaseException) -> tuple[str, int] | None:
    """``(path, iterations)`` of the trace a failed :func:`sample` kept to resume, or None."""
    kept = getattr(err, "flymc_kept_trace", None)
    return kept if isinstance(kept, tuple) else None


def _after_failure(
    path: Any,
    before: Any,
    resume: bool,
    err: BaseException,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """A failed run keeps a trace that has a checkpoint (and says how to resume it), and
    removes one it created that has none; a trace it did not write is never touched.

    Runs under the trace's lock, so whatever changed at ``path`` since ``before`` is this
    run's doing. The same on local disk and on object stores.
    """
    after = _stamp(path, storage_options)
    checkpoint = None
    if after not in (None, _UNREACHABLE) and (resume or after != before):
        try:
            trace = Trace.open(path, read_only=True, storage_options=storage_options)
            checkpoint = trace.checkpoint
        except (OSError, ValueError) as failed:
            if unreachable(failed):
                after = _UNREACHABLE
    if after == _UNREACHABLE:  # what this run checkpointed last, as it wrote it
        saved = getattr(err, "flymc_checkpointed", None)
        if isinstance(saved, int) and saved > 0:
            _keep(err, path, saved, " once its store can be reached again")
        return  # nothing is removed from a store that cannot be reached
    if after is None or (not resume and after == before):
        return  # nothing there, or an older trace this run did not replace yet
    if checkpoint is None or "iteration" not in checkpoint:
        if not resume:
            _remove_trace(path, storage_options)
        return
    _keep(err, path, int(checkpoint["iteration"]) + 1)


def _keep(err: BaseException, path: Any, n: int, when: str = "") -> None:
    """Mark ``err`` as leaving the trace at ``path`` resumable after ``n`` iterations."""
    try:
        err.flymc_kept_trace = (os.fspath(path), n)  # type: ignore[attr-defined]
        err.add_note(
            f"the trace {os.fspath(path)!s} keeps {n} iterations (to its last "
            f"checkpoint): continue the run with resume=True{when}"
        )
    except (AttributeError, TypeError):  # an exception that takes no attributes
        pass


def _remove_trace(path: Any, storage_options: dict[str, Any] | None) -> None:
    """Remove a trace this run created (and left without a checkpoint)."""
    if not is_url(path):
        shutil.rmtree(local_path(path), ignore_errors=True)
        return
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(os.fspath(path), **(storage_options or {}))
        fs.rm(root.rstrip("/"), recursive=True)
    except (OSError, ValueError):
        pass  # best effort: the run failed already


def traced(call: Call, run: Callable[[Call], Any]) -> Any:
    """``run(call)`` with a ``trace``: one writer at a time, a resume that matches, and a
    failure that keeps what can be resumed and removes only what this run created.

    The trace's :class:`~flymc_dist.trace.TraceLock` is held for the whole run, so a
    second run on the same trace is refused before it starts anything (its clean-up
    cannot touch the first run's trace), and two resumes of one trace cannot both run.
    """
    path, so, resume = call.trace, call.trace_storage_options, call.resume
    austerity = call.algorithm.name == "austerity"
    if resume and not austerity:  # no trace there: FileNotFoundError
        Trace.open(path, read_only=True, storage_options=so)
    lock = TraceLock(path, so).acquire()
    try:
        if resume and not austerity:
            _check_resume(call)
        before = _stamp(path, so)
        try:
            return run(call)
        except BaseException as err:
            if not lock.lost:  # else the trace is another run's now: not ours to touch
                _after_failure(path, before, resume, err, so)
            raise
    finally:
        lock.release()
