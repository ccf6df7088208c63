"""An incremental, resumable zarr trace of MCMC draws (STYLE 6; DESIGN §3 "Faults").

Layout of a trace (a zarr v3 group, laid out as ArviZ's ``InferenceData``)::

    <path>/
      zarr.json                          group attributes: the caller's ``attrs``
                                         (algorithm config, model, dataset path, seed,
                                         ...) plus the reserved key "flymc_trace"
                                         (format, shapes, counts, checkpoint)
      posterior/theta                    (chain, draw, *param_dims)  float64
      posterior/chain, posterior/<dim>   coordinates: 0 … C−1, each parameter axis's labels
      sample_stats/<name>                (chain, draw)  the declared dtype
      sample_stats/chain
      warmup_posterior/…, warmup_sample_stats/…   the same for the warm-up draws

Arrays grow along the draw axis (axis 1) and are chunked along it
(``chunk_draws`` draws per chunk, all chains and parameters in one chunk). A trace
written by an earlier release in another layout is refused, in one line saying so.

Reading a trace with xarray and ArviZ
-------------------------------------
Every array carries zarr 3 ``dimension_names`` (``chain``, ``draw`` and the parameter
axes: ``feature``; softmax ``class``, ``feature``) and every group its coordinates (the
feature names when the data set has them), so xarray alone opens a trace, and ArviZ
takes it as it is, no import of this package needed::

    tree = xr.open_datatree(path, engine="zarr", consolidated=False)
    idata = az.InferenceData.from_datatree(tree)   # posterior, sample_stats, warmup_*
    stats = xr.open_zarr(path, group="sample_stats", consolidated=False)  # one group

(``consolidated=False``: a trace keeps no consolidated metadata, which zarr 3 marks as
outside its specification and which would go stale with every append). While a run
appends, the arrays may hold draws beyond the committed count (being written, or after
a crash): slice to ``attrs["flymc_trace"]["committed"]["n_draws"]``. A posterior group
opens at any moment (its one array grows alone); a statistics' group holds several
arrays, resized one after the other, so during that short burst of an append xarray can
refuse it ("conflicting sizes for dimension 'draw'"): open it again. Measured with
appends back to back (``tests/test_arviz.py``), about one open in ten met it; a run
appends once every ``checkpoint_every`` iterations. ArviZ 0.23's ``from_zarr`` refuses
every zarr 3 store ("Found zarr>=3, which is not supported by ArviZ"), whatever its
layout: hence ``from_datatree``.

Crash consistency
-----------------
The authoritative number of draws is stored in the group attributes, never
inferred from the array shapes, and every write puts data before the record
that refers to it:

1. :meth:`Trace.append` writes the draws (arrays grown, data written), and only
   then updates the committed draw counts in the attributes.
2. :meth:`Trace.set_checkpoint` writes the caller's state together with the
   draw counts it refers to, in a single attribute write.

On :meth:`Trace.open` the draw counts are those of the last checkpoint if one
exists, else the last committed counts. Array entries beyond them (a crash
after writing draws but before recording them, or draws appended after the last
checkpoint) are *ignored*: the properties never show them and the next
:meth:`Trace.append` overwrites them. So after a crash the trace and its
checkpoint agree, and resuming from the checkpoint regenerates exactly the
discarded draws. A trace that is shorter than its record is corrupt and
:meth:`Trace.open` raises. Opening never modifies the store (a concurrent
reader cannot damage a running writer); there must be one writer at a time:
:class:`TraceLock` is how a run (``fd.sample``, ``flymc run``) makes sure of it.
With a local path every zarr metadata write is atomic (temporary file, then
rename), so a crash leaves either the old or the new record.

Every chunk of every array is stored, all-zero ones too (zarr omits chunks equal to the
fill value by default), so a chunk of recorded draws absent from the store is a loss: a
read of it, an append over it and :meth:`Trace.verify` raise :class:`TraceDamagedError`
naming it, never reading fill values in its place.
On an object store a write that cannot reach the store is tried again a bounded number
of times (:func:`flymc_dist._unreachable.retry`), then fails with
:class:`~flymc_dist._unreachable.StoreUnreachableError`.

Checkpoint encoding
-------------------
Checkpoint states and ``attrs`` must be JSON-like: ``dict`` with ``str`` keys,
``list``/``tuple`` (read back as lists), ``str``, ``bool``, ``int``, ``float``,
``None``, numpy scalars (read back as Python scalars) and numpy arrays of
bool/integer/float dtype (read back as arrays of the same dtype and shape).
Integers beyond ±2**53 (e.g. the 128-bit words of a numpy bit-generator state)
and non-finite floats are stored as tagged strings, so they survive any JSON
reader exactly; ``rng.bit_generator.state`` of every numpy bit generator
round-trips and restores the stream exactly. A checkpoint's arrays of more than
:data:`_INLINE_ITEMS` items (a JointDPM run's moved labels, say) are not JSON: each is
a zarr array of the ``checkpoint`` group, written before the record that names it; the
arrays of the checkpoint before are deleted once the new record is written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import shutil
import socket
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from numpy.typing import ArrayLike, DTypeLike
from zarr.abc.store import Store
from zarr.core.sync_group import create_nodes
from zarr.storage import MemoryStore, StorePath, WrapperStore

from flymc_dist._paths import is_url, local_path
from flymc_dist._unreachable import retry

__all__ = [
    "Trace",
    "TraceDamagedError",
    "TraceLock",
    "TraceLockedError",
    "TRACE_FORMAT",
    "TRACE_VERSION",
]

TRACE_FORMAT = "flymc_dist.trace"
#: 2: ArviZ's groups (``posterior/theta``, ``sample_stats/<name>``, and their ``warmup_``
#: twins), every chunk stored
TRACE_VERSION = 2
#: where each phase's arrays live: {warmup: (samples, stats group)}
_LAYOUT = {
    False: ("posterior/theta", "sample_stats"),
    True: ("warmup_posterior/theta", "warmup_sample_stats"),
}
#: the sub-groups of a trace's root group
_TRACE_GROUPS = frozenset(
    name for samples, stats in _LAYOUT.values() for name in (samples.split("/")[0], stats)
)

_RESERVED_ATTR = "flymc_trace"
_TAG = "__flymc_type__"
_MAX_EXACT_INT = 2**53
#: a checkpoint's arrays of more items than this are stored as zarr arrays in the
#: trace's ``checkpoint`` group (written before the record that names them), not as JSON
_INLINE_ITEMS = 4096
#: the trace's group of the checkpoints' large arrays
_CHECKPOINT_GROUP = "checkpoint"
_STAT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DEFAULT_CHUNK_DRAWS = 256
#: every array of a trace is written with all its chunks, those equal to the fill value
#: too (zarr omits them by default), so an absent chunk is a loss, never zeros
_EVERY_CHUNK = {"write_empty_chunks": True}
#: arrays of a trace on an object store written at the same time
_URL_WRITERS = 16


# --------------------------------------------------------------------------------------------
# JSON encoding of checkpoint states and attributes
# --------------------------------------------------------------------------------------------


def _encode(value: Any, where: str, spill: Any = None) -> Any:
    """Encode ``value`` into plain JSON types, tagging what JSON cannot hold exactly; an
    array of more than :data:`_INLINE_ITEMS` items goes to ``spill(array)`` (when given),
    which stores it and returns where."""
    if value is None or isinstance(value, (bool, np.bool_, str)):
        return bool(value) if isinstance(value, np.bool_) else value
    if isinstance(value, (int, np.integer)):
        number = int(value)
        if abs(number) <= _MAX_EXACT_INT:
            return number
        return {_TAG: "int", "value": str(number)}
    if isinstance(value, (float, np.floating)):
        number = float(value)
        if math.isfinite(number):
            return number
        return {_TAG: "float", "value": repr(number)}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"{where}: cannot store an array of dtype {value.dtype}")
        if spill is not None and value.size > _INLINE_ITEMS:
            return {_TAG: "stored", "array": spill(value)}
        return {
            _TAG: "ndarray",
            "dtype": value.dtype.str,
            "shape": list(value.shape),
            "data": [_encode(item, where) for item in value.ravel().tolist()],
        }
    if isinstance(value, (list, tuple)):
        return [_encode(item, f"{where}[{i}]", spill) for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        if _TAG in value:
            raise ValueError(f"{where}: the key {_TAG!r} is reserved")
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: dict keys must be str, got {key!r}")
            out[key] = _encode(item, f"{where}[{key!r}]", spill)
        return out
    raise TypeError(f"{where}: cannot store a value of type {type(value).__name__} as JSON")


def _decode(value: Any, load: Any = None) -> Any:
    """Invert :func:`_encode` (``load(where)`` reads an array ``spill`` stored)."""
    if isinstance(value, list):
        return [_decode(item, load) for item in value]
    if isinstance(value, dict):
        tag = value.get(_TAG)
        if tag == "stored" and load is not None:
            return load(value["array"])
        if tag == "int":
            return int(value["value"])
        if tag == "float":
            return float(value["value"])
        if tag == "ndarray":
            data = [_decode(item) for item in value["data"]]
            return np.array(data, dtype=np.dtype(value["dtype"])).reshape(value["shape"])
        return {key: _decode(item, load) for key, item in value.items()}
    return value


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _checkpoint_chunks(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Chunks of a checkpoint's stored array: whole trailing axes, at most about 4M items
    per chunk."""
    row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    return (max(1, min(shape[0], (1 << 22) // max(row, 1))), *shape[1:])


def _record_of(group: zarr.Group) -> dict[str, Any] | None:
    """The trace record of ``group``, or None if the group is not a trace."""
    record = group.attrs.get(_RESERVED_ATTR)
    if isinstance(record, dict) and record.get("format") == TRACE_FORMAT:
        return record
    return None


def _url_options(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``{"storage_options": ...}`` for zarr when ``path`` is a URL and options are given."""
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
    if not storage_options:
        return {}
    if not is_url(path):
        raise ValueError(
            f"storage_options apply to a trace at an fsspec URL only, not to {os.fspath(path)!s}"
        )
    return {"storage_options": dict(storage_options)}


def probe(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> str:
    """Classify ``path``: ``"missing"`` (free to use), ``"trace"`` or ``"other"``."""
    return _probe(path, storage_options)[0]


def _probe(
    path: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    mode: str = "r",
) -> tuple[str, zarr.Group | None]:
    """:func:`probe`'s state of ``path`` and, for ``"trace"``, its root group opened with
    ``mode`` (:meth:`Trace.open` reads it once).

    A trace is a zarr 3 group, so its ``zarr.json`` is read alone first (zarr, given no
    format, reads four metadata objects of both formats: on S3 eight requests). Without
    it, whether a URL holds anything is asked (two requests on S3): nothing is
    ``"missing"``. Otherwise a zarr 2 group is looked for as before, and a prefix without
    a group that holds one of a trace's sub-groups (say, left by an interrupted removal) is
    ``"other"``: :meth:`Trace.create` writes its nodes with no existence check, so it
    must not write there.
    """
    url = is_url(path)
    if not url:
        local = local_path(path)
        if not local.exists():
            return "missing", None
        if local.is_dir() and not any(local.iterdir()):
            return "missing", None
        if not local.is_dir():
            return "other", None
    kw = _url_options(path, storage_options)
    try:
        try:
            group = zarr.open_group(path, mode=mode, zarr_format=3, **kw)
        except FileNotFoundError:  # includes zarr's GroupNotFoundError
            names = _url_children(path, storage_options) if url else None
            if names is not None and not names:
                return "missing", None
            try:  # a zarr 2 group (the only group left)
                group = zarr.open_group(path, mode=mode, zarr_format=2, **kw)
            except FileNotFoundError:
                if names is None or names & _TRACE_GROUPS:
                    return "other", None
                return "missing", None
    except (ValueError, OSError) as err:  # an array, or unreadable metadata
        if url and not isinstance(err, ValueError):  # e.g. access denied
            raise OSError(f"cannot read {path}: {type(err).__name__}: {err}") from err
        return "other", None
    except Exception as err:  # an fsspec client's own error: endpoint unreachable, ...
        raise OSError(f"cannot reach {os.fspath(path)!s}: {type(err).__name__}: {err}") from err
    return ("trace", group) if _record_of(group) is not None else ("other", None)


def _url_children(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None
) -> set[str]:
    """The names directly under the URL ``path``: whether it holds anything, then (if it
    does) one listing. fsspec's cache of them is dropped, so that no later use of the same
    file system instance (removing a failed run's trace, say) sees them stale."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(os.fspath(path), **dict(storage_options or {}))
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    try:
        # exists first: on S3, listing an empty prefix lists its parent too (all of it)
        if not fs.exists(root):
            return set()
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return set()
    finally:
        fs.invalidate_cache(root)
    return {entry.rstrip("/").rpartition("/")[2] for entry in entries}


def _validate_shape(param_shape: object) -> tuple[int, ...]:
    try:
        shape = tuple(param_shape)  # type: ignore[arg-type]
    except TypeError as err:
        raise ValueError(f"param_shape must be a tuple of ints, got {param_shape!r}") from err
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise ValueError(f"param_shape must hold positive ints, got {param_shape!r}")
    return tuple(int(dim) for dim in shape)


def _validate_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _validate_dims(dims: object, shape: tuple[int, ...]) -> tuple[str, ...]:
    """The parameter axes' names: ``dims`` checked against ``shape``, or the defaults."""
    if dims is None:
        return tuple(f"theta_dim_{i}" for i in range(len(shape)))
    if isinstance(dims, str) or not isinstance(dims, Sequence):
        raise ValueError(f"dims must be a sequence of names, got {dims!r}")
    names = tuple(dims)
    reserved = {"chain", "draw"}
    if (
        len(names) != len(shape)
        or not all(isinstance(n, str) and n for n in names)
        or len(set(names)) != len(names)
        or reserved & set(names)
    ):
        raise ValueError(
            f"dims must be {len(shape)} distinct non-empty names (one per axis of "
            f"param_shape {shape}, none of {sorted(reserved)}), got {dims!r}"
        )
    return names


def _validate_coords(
    coords: object, dims: tuple[str, ...], shape: tuple[int, ...]
) -> dict[str, np.ndarray]:
    """Every parameter axis's labels: ``coords`` checked, ``0 … n−1`` for the others."""
    if coords is not None and not isinstance(coords, Mapping):
        raise ValueError(f"coords must be a dict of dim -> labels, got {coords!r}")
    given = dict(coords or {})
    unknown = set(given) - set(dims)
    if unknown:
        raise ValueError(f"coords for unknown dims {sorted(unknown)}; the dims are {dims}")
    out = {}
    for dim, n in zip(dims, shape, strict=True):
        if dim not in given:
            out[dim] = np.arange(n)
            continue
        values = list(given[dim])
        if len(values) != n or not (
            all(isinstance(v, str) for v in values)
            or all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in values)
        ):
            raise ValueError(
                f"coords[{dim!r}] must be {n} labels, all str or all int, got {given[dim]!r}"
            )
        out[dim] = np.array(values, dtype=str if isinstance(values[0], str) else np.int64)
    return out


def _coordinate(group: zarr.Group, dim: str, values: np.ndarray) -> zarr.Array:
    """A one-dimensional xarray coordinate array ``dim`` in ``group`` (its values are
    written by the caller)."""
    dtype = str if values.dtype.kind == "U" else values.dtype
    return group.create_array(
        dim,
        shape=values.shape,
        dtype=dtype,
        dimension_names=(dim,),
        fill_value=None,
        config=_EVERY_CHUNK,
    )


def _empty(
    group: zarr.Group,
    name: str,
    chunks: tuple[int, ...],
    dtype: DTypeLike,
    fill_value: Any,
    dims: tuple[str, ...],
) -> zarr.Array:
    """An array of no draws (``(chains, 0, ...)``) that grows along the draws."""
    return group.create_array(
        name,
        shape=(chunks[0], 0, *chunks[2:]),
        chunks=chunks,
        dtype=dtype,
        fill_value=fill_value,
        dimension_names=dims,
        config=_EVERY_CHUNK,
    )


def _layout(
    chains: int,
    chunk: int,
    shape: tuple[int, ...],
    stat_dtypes: Mapping[str, np.dtype],
    param_dims: tuple[str, ...],
    labels: Mapping[str, np.ndarray],
) -> tuple[dict[str, zarr.Group | zarr.Array], dict[str, np.ndarray]]:
    """Every sub-group and array of a new trace, by key, made by zarr in memory (so their
    metadata is what zarr writes for them, and making them sends no request); and the
    values of its coordinate arrays, by key."""
    root = zarr.create_group(store=MemoryStore(), zarr_format=3)
    nodes: dict[str, zarr.Group | zarr.Array] = {}
    coordinates: dict[str, np.ndarray] = {}
    for warmup in (False, True):
        samples_key, stats_key = _LAYOUT[warmup]
        post_key, samples_name = samples_key.split("/")
        # each group with its xarray coordinates: the chains and the labels of the
        # parameter axes (the draws are 0 … n−1, xarray's default)
        post = nodes[post_key] = root.create_group(post_key)
        for dim, values in {"chain": np.arange(chains), **labels}.items():
            nodes[f"{post_key}/{dim}"] = _coordinate(post, dim, values)
            coordinates[f"{post_key}/{dim}"] = values
        nodes[samples_key] = _empty(
            post,
            samples_name,
            (chains, chunk, *shape),
            np.float64,
            np.nan,
            ("chain", "draw", *param_dims),
        )
        stats_group = nodes[stats_key] = root.create_group(stats_key)
        nodes[f"{stats_key}/chain"] = _coordinate(stats_group, "chain", np.arange(chains))
        coordinates[f"{stats_key}/chain"] = np.arange(chains)
        for name, dtype in stat_dtypes.items():
            nodes[f"{stats_key}/{name}"] = _empty(
                stats_group, name, (chains, chunk), dtype, 0, ("chain", "draw")
            )
    return nodes, coordinates


def _write_node(
    store: Store, key: str, like: zarr.Group | zarr.Array, values: np.ndarray | None
) -> None:
    """Write at ``key`` of ``store`` the metadata document of ``like`` (a node made in
    memory by :func:`_layout`), with no existence or parent check (on an object store one
    request), then, for a coordinate array, its ``values``."""
    # zarr.core.sync_group.create_nodes is private: zarr's public create_hierarchy first
    # reads every node to refuse one that exists (on S3 two requests each, more than the
    # write), and no public function writes a node without such checks
    for _, node in create_nodes(store=store, nodes={key: like.metadata}):
        if values is not None:
            node.with_config(_EVERY_CHUNK)[:] = values


def _concurrently(path: str | os.PathLike[str], calls: list[tuple[Any, ...]]) -> list[Any]:
    """``[f(*args) for f, *args in calls]``: one after the other locally; at the same time
    for a trace on an object store, where each is a few requests of a round trip each
    (appending to 9 arrays: ~45 requests, the time of ~4 instead of 45). Every call has
    ended when this returns or raises (the first failure), so none races a retry."""
    if not is_url(path) or len(calls) < 2:
        return [f(*args) for f, *args in calls]
    with ThreadPoolExecutor(min(_URL_WRITERS, len(calls)), "flymc-trace") as pool:
        futures = [pool.submit(f, *args) for f, *args in calls]
    failures = [f.exception() for f in futures]
    for failure in failures:
        if failure is not None:
            raise failure
    return [f.result() for f in futures]


def _validate_stats(stats: object) -> dict[str, np.dtype]:
    if not isinstance(stats, Mapping):
        raise TypeError(f"stats must be a dict of name -> dtype, got {type(stats).__name__}")
    out: dict[str, np.dtype] = {}
    for name, dtype in stats.items():
        if not isinstance(name, str) or not _STAT_NAME.match(name) or name.startswith("__"):
            raise ValueError(f"stat names must be identifiers not starting with '__', got {name!r}")
        if name in ("chain", "draw"):  # the statistics' group's dimensions
            raise ValueError(f"{name!r} cannot name a stat: it names a dimension")
        try:
            resolved = np.dtype(dtype)
        except TypeError as err:
            raise ValueError(f"stat {name!r}: invalid dtype {dtype!r}") from err
        if resolved.kind not in "biuf":
            raise ValueError(f"stat {name!r}: dtype must be bool, integer or float, got {resolved}")
        out[name] = resolved
    return out


# --------------------------------------------------------------------------------------------
# a missing chunk is a loss
# --------------------------------------------------------------------------------------------


class TraceDamagedError(ValueError):
    """A chunk of a trace that holds recorded draws (or a coordinate) is missing."""


class _ChunkGuard(WrapperStore):
    """A view of a trace's store that refuses to read, as fill values, an absent chunk of
    recorded draws.

    zarr reads a chunk that is not in the store as the array's fill value (NaN draws,
    zero statistics). A trace stores every chunk it writes (:data:`_EVERY_CHUNK`), so an
    absent chunk holding recorded draws is a loss: the read (or the append that would
    rewrite it) raises :class:`TraceDamagedError` naming it, with no extra request.
    ``needed(array_key, chunk_index)`` says whether, and which draws, a chunk should hold.
    """

    def __init__(self, store: Any, where: str, prefix: str, needed: Any) -> None:
        super().__init__(store)
        self._where = where
        self._prefix = prefix
        self._needed = needed

    def _with_store(self, store: Any) -> _ChunkGuard:
        return type(self)(store, self._where, self._prefix, self._needed)

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        value = await self._store.get(key, prototype, byte_range)
        if value is None and key.startswith(self._prefix) and "/c/" in key:
            array, _, index = key[len(self._prefix) :].rpartition("/c/")
            try:
                chunk = tuple(int(i) for i in index.split("/"))
            except ValueError:
                return value
            what = self._needed(array, chunk)
            if what is not None:
                raise TraceDamagedError(
                    f"trace {self._where} is damaged: chunk {key!r} ({what}) is missing from "
                    "the store (a partial copy?); nothing was read in its place (copy the "
                    "trace again from its source, or start a new trace)"
                )
        return value


# --------------------------------------------------------------------------------------------
# the trace
# --------------------------------------------------------------------------------------------


class Trace:
    """An incrementally written, crash-consistent, resumable zarr trace.

    Create one with :meth:`create` or open one with :meth:`open`; do not call the
    constructor directly. See the module docstring for the layout and the
    crash-consistency contract.
    """

    def __init__(
        self,
        group: zarr.Group,
        record: dict[str, Any],
        *,
        path: str | os.PathLike[str],
        read_only: bool,
    ) -> None:
        self._record = record
        self._path = path
        self._read_only = read_only
        self._chains = int(record["chains"])
        self._param_shape = tuple(int(d) for d in record["param_shape"])
        self._stat_dtypes = {name: np.dtype(d) for name, d in record["stats"].items()}
        self._layout = _LAYOUT
        counts = record["checkpoint"] if record["checkpoint"] is not None else record["committed"]
        self._n = {False: int(counts["n_draws"]), True: int(counts["n_warmup_draws"])}
        self._arrays: dict[str, zarr.Array] = {}  # handles, filled by _keep
        #: draws array -> its phase (warm-up or not); its draws per chunk
        self._phase = {
            key: warmup for warmup in (False, True) for key, _, _ in self._array_specs(warmup)
        }
        self._chunk_len: dict[str, int] = {}
        prefix = f"{group.path}/" if group.path else ""
        guard = _ChunkGuard(group.store, os.fspath(path), prefix, self._chunk_needed)
        # the same group through the guard, from the metadata already read (no request);
        # its store is read-only if ``group``'s is: :meth:`open` opens it so
        self._group = zarr.Group(
            zarr.AsyncGroup(metadata=group.metadata, store_path=StorePath(guard, group.path))
        )

    # ----------------------------------------------------------------------------- creation

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        chains: int,
        param_shape: tuple[int, ...],
        stats: Mapping[str, DTypeLike],
        attrs: Mapping[str, Any],
        overwrite: bool = False,
        chunk_draws: int = _DEFAULT_CHUNK_DRAWS,
        storage_options: Mapping[str, Any] | None = None,
        dims: Sequence[str] | None = None,
        coords: Mapping[str, Sequence[Any]] | None = None,
    ) -> Trace:
        """Create an empty trace at ``path``.

        Everything is validated before anything is written.

        Parameters
        ----------
        path
            A local directory (created) or an fsspec URL understood by zarr.
        chains
            Number of chains.
        param_shape
            Shape of one draw of one chain, e.g. ``(D,)`` or ``(K, D)``; positive ints.
        stats
            Per-draw statistics to record, name -> numpy dtype (bool, int or float),
            e.g. ``{"accepted": bool, "n_bright": np.int64, "log_joint": np.float64}``.
        attrs
            JSON-like metadata (algorithm configuration, model, dataset path, seed, ...);
            see the module docstring for the accepted types. The key ``"flymc_trace"`` is
            reserved.
        overwrite
            Replace an existing *trace* at ``path``. Anything else that is not an empty
            directory is never deleted.
        chunk_draws
            Draws per chunk along the draw axis.
        storage_options
            fsspec options (endpoint, credentials, ...) for a trace at a URL.
        dims
            The names of the parameter axes (one per axis of ``param_shape``, e.g.
            ``("feature",)`` or ``("class", "feature")``; default ``theta_dim_0``, ...):
            with ``chain`` and ``draw`` they are every array's zarr ``dimension_names``,
            which xarray reads (see the module docstring).
        coords
            Labels along parameter axes, dim -> one label (str or int) per entry (e.g.
            ``{"feature": ["bias", "age"]}``); the others are ``0 … n−1``. Written, with
            ``chain``, as xarray coordinate arrays.

        Returns
        -------
        Trace
            The new, writable trace with no draws.

        Raises
        ------
        FileExistsError
            If ``path`` exists (and is not an empty directory) and ``overwrite`` is False,
            or if it exists and is not a trace.
        ValueError
            For an invalid ``chains``, ``param_shape``, ``stats``, ``chunk_draws`` or a
            reserved key in ``attrs``.
        TypeError
            If ``attrs`` is not a dict of JSON-like values.
        """
        n_chains = _validate_positive_int(chains, "chains")
        shape = _validate_shape(param_shape)
        stat_dtypes = _validate_stats(stats)
        chunk = _validate_positive_int(chunk_draws, "chunk_draws")
        param_dims = _validate_dims(dims, shape)
        labels = _validate_coords(coords, param_dims, shape)
        if not isinstance(attrs, Mapping):
            raise TypeError(f"attrs must be a dict, got {type(attrs).__name__}")
        if _RESERVED_ATTR in attrs:
            raise ValueError(f"the attribute key {_RESERVED_ATTR!r} is reserved")
        user_attrs = _encode(dict(attrs), "attrs")
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
        url_kw = _url_options(path, storage_options)

        state = probe(path, storage_options)
        if state == "other":
            raise FileExistsError(
                f"{os.fspath(path)!s} exists and is not a flymc trace; refusing to "
                "write there (remove it yourself if it is disposable)"
            )
        if state == "trace" and not overwrite:
            raise FileExistsError(
                f"a trace already exists at {os.fspath(path)!s}; pass overwrite=True to replace it"
            )

        record: dict[str, Any] = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "chains": n_chains,
            "param_shape": list(shape),
            "stats": {name: dtype.str for name, dtype in stat_dtypes.items()},
            "chunk_draws": chunk,
            "committed": {"n_draws": 0, "n_warmup_draws": 0},
            "checkpoint": None,
            "every_chunk": True,
        }
        # every sub-group and array, made by zarr in memory: whatever zarr refuses in
        # them is refused before anything is written
        nodes, coordinates = _layout(n_chains, chunk, shape, stat_dtypes, param_dims, labels)
        created_dir = not is_url(path) and not local_path(path).exists()
        try:
            # The group (with its format marker) first, so that an interrupted create
            # leaves something recognisable as a trace that overwrite=True may replace.
            # Over a trace, zarr first removes everything under it: none of its arrays
            # (a statistic the new trace lacks, a checkpoint's) is left.
            group = zarr.create_group(
                store=path,
                overwrite=state == "trace",
                attributes={**user_attrs, _RESERVED_ATTR: record},
                zarr_format=3,
                **url_kw,
            )
            trace = cls(group, record, path=path, read_only=False)
            trace._write_layout(group, nodes, coordinates)
        except BaseException:
            if created_dir:
                shutil.rmtree(local_path(path), ignore_errors=True)
            raise
        return trace

    def _write_layout(
        self,
        group: zarr.Group,
        nodes: Mapping[str, zarr.Group | zarr.Array],
        coordinates: Mapping[str, np.ndarray],
    ) -> None:
        """Write every sub-group and array of a new trace under its root ``group`` (the
        coordinates with their values); keep the handles of the draws' arrays.

        Each metadata document is one write, with no existence or parent check (on an
        object store one request, where zarr's ``create_array`` sent about nine; they are
        sent together, see :func:`_concurrently`). None can be there already: ``group``'s
        path was empty, or held a trace that :func:`zarr.create_group` has just removed,
        or (a URL) held none of a trace's groups (:func:`_probe`).
        """
        base = f"{group.path}/" if group.path else ""
        _concurrently(
            self._path,
            [
                (_write_node, group.store, base + key, node, coordinates.get(key))
                for key, node in nodes.items()
            ],
        )
        for warmup in (False, True):
            for key, _, _ in self._array_specs(warmup):
                array = zarr.AsyncArray(
                    metadata=nodes[key].metadata, store_path=self._group.store_path / key
                )
                self._keep(key, zarr.Array(array))

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        read_only: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> Trace:
        """Open an existing trace.

        Draws beyond the last checkpoint (or, without a checkpoint, beyond the last
        committed append) are ignored; see the module docstring. Opening never writes.

        Parameters
        ----------
        path
            The trace's location, as given to :meth:`create`.
        read_only
            Open without write access (:meth:`append` and :meth:`set_checkpoint` raise).
        storage_options
            fsspec options (endpoint, credentials, ...) for a trace at a URL.

        Returns
        -------
        Trace

        Raises
        ------
        FileNotFoundError
            If nothing exists at ``path``.
        ValueError
            If ``path`` is not a flymc trace, or is a corrupt one (missing arrays, arrays
            shorter than recorded, inconsistent shapes).
        """
        state, group = _probe(path, storage_options, "r" if read_only else "r+")
        if state == "missing":
            raise FileNotFoundError(f"no trace at {os.fspath(path)!s}")
        record = None if group is None else _record_of(group)
        if group is None or record is None:  # "other"
            raise ValueError(f"{os.fspath(path)!s} is not a flymc trace")
        if record.get("version") != TRACE_VERSION or not record.get("every_chunk"):
            omitted = "" if record.get("every_chunk") else ", chunks of zeros omitted"
            raise ValueError(
                f"{os.fspath(path)!s} is a trace of an earlier flymc_dist release (format "
                f"{record.get('version')!r}{omitted}); this release reads format "
                f"{TRACE_VERSION}: open it with the release that wrote it, or start a new trace"
            )
        try:
            trace = cls(group, record, path=path, read_only=read_only)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"corrupt trace {os.fspath(path)!s}: bad record ({err})") from err
        trace._check_arrays()
        return trace

    def _check_arrays(self) -> None:
        """Check every array exists and holds the recorded draws; keep their handles.

        Raises
        ------
        ValueError
            If the trace is corrupt.
        """
        specs = [(w, *spec) for w in (False, True) for spec in self._array_specs(w)]

        def get(key: str) -> Any:
            try:
                return self._group[key]
            except KeyError:
                return None

        found = _concurrently(self._path, [(get, key) for _, key, _, _ in specs])
        for (warmup, key, tail, dtype), array in zip(specs, found, strict=True):
            prefix = "warmup_" if warmup else ""
            n = self._n[warmup]
            if array is None:
                raise ValueError(f"corrupt trace {self._path!s}: missing array {key!r}")
            if not isinstance(array, zarr.Array):
                raise ValueError(f"corrupt trace {self._path!s}: {key!r} is not an array")
            shape = array.shape
            if shape[0] != self._chains or tuple(shape[2:]) != tail:
                raise ValueError(f"corrupt trace {self._path!s}: {key!r} has shape {shape}")
            if array.dtype != dtype:
                msg = f"corrupt trace {self._path!s}: {key!r} has dtype {array.dtype}"
                raise ValueError(msg)
            if shape[1] < n:
                raise ValueError(
                    f"corrupt trace {self._path!s}: {key!r} holds {shape[1]} draws but "
                    f"{n} {prefix}draws are recorded"
                )
            self._keep(key, array)

    def _keep(self, key: str, array: zarr.Array) -> None:
        """Keep the handle of the draws' array ``key`` (writing every chunk)."""
        self._arrays[key] = array.with_config(_EVERY_CHUNK)
        self._chunk_len[key] = int(array.chunks[1])

    def _chunk_needed(self, array: str, chunk: tuple[int, ...]) -> str | None:
        """Which recorded draws chunk ``chunk`` of ``array`` holds (None: it may be absent,
        as a chunk past the recorded draws, or an all-zero one of an older trace)."""
        if array not in self._phase:  # a coordinate: written whole with the trace
            groups = {g for s, st in self._layout.values() for g in (s.rpartition("/")[0], st)}
            if array.rpartition("/")[0] in groups:
                return f"the coordinate {array}"
            return None
        warmup = self._phase[array]
        per = self._chunk_len.get(array)
        if per is None or len(chunk) < 2:
            return None
        lo, n = chunk[1] * per, self._n[warmup]
        if lo >= n:
            return None
        phase = "warm-up draws" if warmup else "draws"
        return f"{phase} {lo}-{min(lo + per, n) - 1} of {array}"

    def verify(self) -> None:
        """Read every recorded draw, statistic and coordinate once.

        Raises
        ------
        TraceDamagedError
            Naming the first chunk missing from the store.
        """
        for warmup in (False, True):
            for key, _, _ in self._array_specs(warmup):
                self._arrays[key][:, : self._n[warmup]]
        for warmup in (False, True):  # each group's coordinates
            samples, stats = self._layout[warmup]
            post = samples.rpartition("/")[0]
            dims = self._arrays[samples].metadata.dimension_names or ()
            keys = [f"{post}/{dim}" for dim in ("chain", *dims[2:])] + [f"{stats}/chain"]
            for key in keys:
                self._group[key][:]

    def _array_specs(self, warmup: bool) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        """``(key, trailing shape, dtype)`` of every array of one phase, samples first."""
        samples, stats = self._layout[warmup]
        specs = [(samples, self._param_shape, np.dtype(np.float64))]
        specs += [(f"{stats}/{name}", (), dt) for name, dt in self._stat_dtypes.items()]
        return specs

    # ----------------------------------------------------------------------------- writing

    def _require_writable(self) -> None:
        if self._read_only:
            raise PermissionError(f"trace {self._path!s} was opened read-only")

    def _write_record(self, record: dict[str, Any]) -> None:
        self._group.update_attributes({_RESERVED_ATTR: record})

    def _retry(self, write: Any) -> None:
        """``write()``; on an object store retried while it cannot be reached (a bounded
        number of times: then :class:`~flymc_dist._unreachable.StoreUnreachableError`)."""
        if is_url(self._path):
            retry(write, f"trace {os.fspath(self._path)!s}")
        else:
            write()

    def append(
        self,
        samples: ArrayLike,
        stats: Mapping[str, ArrayLike],
        *,
        warmup: bool,
    ) -> None:
        """Append ``n`` draws of every chain.

        The arrays are written first, then the new draw count is committed; a crash in
        between leaves the previous count in force (the partial draws are ignored).

        Parameters
        ----------
        samples
            Array of shape ``(chains, n, *param_shape)`` (cast to float64); ``n`` may be 0.
        stats
            Exactly the declared statistics, each of shape ``(chains, n)``; cast to the
            declared dtype with ``same_kind`` casting (float into an int stat is refused).
        warmup
            Append to the warm-up arrays instead of the sampling arrays.

        Raises
        ------
        ValueError
            For wrong shapes or missing/unknown statistics.
        TypeError
            For a non-real ``samples`` dtype, a non-bool ``warmup``, or a statistic that
            cannot be cast to its declared dtype.
        PermissionError
            If the trace was opened read-only.
        """
        self._require_writable()
        if not isinstance(warmup, (bool, np.bool_)):
            raise TypeError(f"warmup must be a bool, got {warmup!r}")
        warmup = bool(warmup)
        draws = np.asarray(samples)
        if draws.dtype.kind not in "biuf":
            raise TypeError(f"samples must hold real numbers, got dtype {draws.dtype}")
        expected = (self._chains, *self._param_shape)
        if draws.ndim != len(expected) + 1 or (draws.shape[0], *draws.shape[2:]) != expected:
            raise ValueError(
                f"samples must have shape (chains={self._chains}, n, *{self._param_shape}), "
                f"got {draws.shape}"
            )
        n_new = draws.shape[1]
        if not isinstance(stats, Mapping):
            raise TypeError(f"stats must be a dict, got {type(stats).__name__}")
        missing = set(self._stat_dtypes) - set(stats)
        unknown = set(stats) - set(self._stat_dtypes)
        if missing or unknown:
            raise ValueError(
                f"stats must hold exactly {sorted(self._stat_dtypes)}; "
                f"missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        columns: dict[str, np.ndarray] = {}
        for name, dtype in self._stat_dtypes.items():
            column = np.asarray(stats[name])
            if column.shape != (self._chains, n_new):
                raise ValueError(
                    f"stat {name!r} must have shape ({self._chains}, {n_new}), got {column.shape}"
                )
            if not np.can_cast(column.dtype, dtype, casting="same_kind"):
                raise TypeError(f"stat {name!r}: cannot cast {column.dtype} to {dtype}")
            columns[name] = column.astype(dtype, copy=False)
        if n_new == 0:
            return

        start = self._n[warmup]
        stop = start + n_new
        payload = [draws.astype(np.float64, copy=False), *columns.values()]
        specs = self._array_specs(warmup)
        counts = dict(self._record["committed"])
        counts["n_warmup_draws" if warmup else "n_draws"] = stop
        # Keep the other phase's committed count consistent with what this session shows.
        counts["n_draws" if warmup else "n_warmup_draws"] = self._n[not warmup]
        record = {**self._record, "committed": counts}

        def resize(key: str, tail: tuple[int, ...]) -> None:
            self._arrays[key].resize((self._chains, stop, *tail))

        def put(key: str, data: np.ndarray) -> None:
            self._arrays[key][:, start:stop] = data

        def write() -> None:
            # every array resized first, in one burst of metadata writes (this also drops
            # ignored stale draws), then the data: a reader of the statistics' group
            # (xarray) meets arrays of different lengths only during the burst; on an
            # object store each burst's requests are sent together
            _concurrently(self._path, [(resize, key, tail) for key, tail, _ in specs])
            _concurrently(
                self._path,
                [(put, key, data) for (key, _, _), data in zip(specs, payload, strict=True)],
            )
            self._write_record(record)

        self._retry(write)  # the same bytes at the same places: safe to write again
        self._record = record
        self._n[warmup] = stop

    def set_checkpoint(self, state: Mapping[str, Any]) -> None:
        """Record a resumable state referring to all draws appended so far.

        Call it after :meth:`append`, never before: the checkpoint records the current
        draw counts, and on :meth:`open` those counts are authoritative.

        Parameters
        ----------
        state
            A JSON-like dict (see the module docstring): iteration count, current
            positions, kernel parameters, ``rng.bit_generator.state`` dicts, ...

        Raises
        ------
        TypeError, ValueError
            If ``state`` is not a dict of storable values (nothing is written).
        PermissionError
            If the trace was opened read-only.
        """
        self._require_writable()
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        large: list[np.ndarray] = []

        def spill(array: np.ndarray) -> str:
            large.append(array)
            return f"{_CHECKPOINT_GROUP}/{generation}_{len(large) - 1}"

        generation = secrets.token_hex(4)
        encoded = _encode(dict(state), "state", spill)  # validates before anything is written
        counts = {"n_draws": self._n[False], "n_warmup_draws": self._n[True]}
        record = {
            **self._record,
            "committed": dict(counts),
            "checkpoint": {**counts, "state": encoded},
        }

        def write() -> None:
            for i, array in enumerate(large):
                name = f"{_CHECKPOINT_GROUP}/{generation}_{i}"
                stored = self._group.create_array(
                    name,
                    shape=array.shape,
                    dtype=array.dtype,
                    chunks=_checkpoint_chunks(array.shape),
                    overwrite=True,
                    config=_EVERY_CHUNK,
                )
                stored[...] = array
            self._write_record(record)

        self._retry(write)
        self._record = record
        # the arrays of earlier checkpoints (and of one interrupted before its record)
        if _CHECKPOINT_GROUP in self._group:
            for name in list(self._group[_CHECKPOINT_GROUP].array_keys()):
                if not name.startswith(f"{generation}_"):
                    self._retry(lambda n=name: self._group.__delitem__(f"{_CHECKPOINT_GROUP}/{n}"))

    # ----------------------------------------------------------------------------- reading

    @property
    def path(self) -> str | os.PathLike[str]:
        """Where the trace lives."""
        return self._path

    @property
    def read_only(self) -> bool:
        """Whether the trace was opened without write access."""
        return self._read_only

    @property
    def chains(self) -> int:
        """Number of chains."""
        return self._chains

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Shape of one draw of one chain."""
        return self._param_shape

    @property
    def stat_dtypes(self) -> dict[str, np.dtype]:
        """Declared statistics and their dtypes."""
        return dict(self._stat_dtypes)

    @property
    def n_draws(self) -> int:
        """Number of (post-warm-up) draws per chain."""
        return self._n[False]

    @property
    def n_warmup_draws(self) -> int:
        """Number of warm-up draws per chain."""
        return self._n[True]

    @property
    def samples(self) -> np.ndarray:
        """Post-warm-up draws, ``(chains, n_draws, *param_shape)`` float64."""
        return self._arrays[self._layout[False][0]][:, : self._n[False]]

    @property
    def warmup_samples(self) -> np.ndarray:
        """Warm-up draws, ``(chains, n_warmup_draws, *param_shape)`` float64."""
        return self._arrays[self._layout[True][0]][:, : self._n[True]]

    @property
    def stats(self) -> dict[str, np.ndarray]:
        """Post-warm-up statistics, name -> ``(chains, n_draws)``."""
        return self._read_stats(warmup=False)

    @property
    def warmup_stats(self) -> dict[str, np.ndarray]:
        """Warm-up statistics, name -> ``(chains, n_warmup_draws)``."""
        return self._read_stats(warmup=True)

    def _read_stats(self, *, warmup: bool) -> dict[str, np.ndarray]:
        stats = self._layout[warmup][1]
        n = self._n[warmup]
        return {name: self._arrays[f"{stats}/{name}"][:, :n] for name in self._stat_dtypes}

    @property
    def attrs(self) -> dict[str, Any]:
        """The metadata given to :meth:`create` (decoded; tuples come back as lists)."""
        raw = dict(self._group.attrs)
        raw.pop(_RESERVED_ATTR, None)
        return _decode(raw)

    @property
    def checkpoint(self) -> dict[str, Any] | None:
        """The state of the last :meth:`set_checkpoint` (decoded), or None."""
        checkpoint = self._record["checkpoint"]
        if checkpoint is None:
            return None

        def load(where: str) -> np.ndarray:
            if not where.startswith(f"{_CHECKPOINT_GROUP}/") or where not in self._group:
                raise TraceDamagedError(
                    f"trace {self._path!s} is damaged: its checkpoint's array {where!r} is "
                    "missing from the store (a partial copy?)"
                )
            return np.asarray(self._group[where][...])

        return _decode(checkpoint["state"], load)

    def __repr__(self) -> str:
        return (
            f"Trace({os.fspath(self._path)!s}, chains={self._chains}, "
            f"param_shape={self._param_shape}, n_warmup_draws={self.n_warmup_draws}, "
            f"n_draws={self.n_draws}, stats={sorted(self._stat_dtypes)})"
        )


# --------------------------------------------------------------------------------------------
# one writer at a time
# --------------------------------------------------------------------------------------------


class TraceLockedError(OSError):
    """Another live process holds the lock of a trace."""


def _boot_id() -> str | None:
    """This machine's boot id (Linux): tells a reboot, or another machine, from this one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _read_lock(path: str) -> dict[str, Any] | None:
    """The holder recorded in a lock file; None if it is gone; ``{}`` if unreadable."""
    try:
        with open(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _lock_is_stale(holder: dict[str, Any], lock_path: str) -> bool:
    """Whether the process that wrote ``holder`` is certainly gone.

    Only a holder on this machine can be checked: its process no longer exists, or its
    pid now belongs to a process started at another time, or the machine rebooted since.
    A lock file that stayed unreadable for a minute (its writer died while writing it)
    is stale too. A holder on another machine is never presumed dead.
    """
    if not holder:
        try:
            return time.time() - os.stat(lock_path).st_mtime > 60.0
        except OSError:
            return False
    if holder.get("host") != socket.gethostname():
        return False
    if holder.get("pid") == os.getpid() and holder.get("start") == _start_time(os.getpid()):
        # this process: stale unless one of its locks still holds it (a lock it could not
        # remove, its store unreachable then, is no longer held)
        return holder.get("token") not in _HELD
    boot = _boot_id()
    if boot is not None and holder.get("boot") not in (None, boot):
        return True
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    started = holder.get("start")
    return started is not None and _start_time(pid) not in (None, started)


#: the tokens of the locks this process holds
_HELD: set[str] = set()


def _holder(token: str) -> dict[str, Any]:
    """What a lock records of the process taking it: who, where, since when, its token."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "start": _start_time(os.getpid()),
        "token": token,
        "since": time.time(),
    }


def _release_lock(path: str, token: str, made_dirs: list[str]) -> None:
    _HELD.discard(token)
    holder = _read_lock(path)
    if holder is not None and holder.get("token") == token:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    for d in made_dirs:  # directories made only to hold the lock, if still empty
        try:
            os.rmdir(d)
        except OSError:
            break


#: How long a lock on an object store stays valid unless its holder renews it (seconds).
LEASE_SECONDS = 60.0


class _LockObject:
    """The lock object of a trace on an object store: conditional writes, by ETag.

    On S3 (s3fs) every write is conditional on the server: the create with
    ``If-None-Match: *``, a renewal or a take-over with ``If-Match: <ETag>``, the removal
    likewise. Other fsspec stores get the conditional create where fsspec has one
    (``mode="create"``) and compare-then-write for the rest.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        parent, _, name = root.rstrip("/").rpartition("/")
        self.key = f"{parent}/.{name}.flymc-lock" if parent else f".{name}.flymc-lock"
        self.url = f"{url.split('://', 1)[0]}://{self.key}"
        self._s3 = hasattr(self.fs, "call_s3") and hasattr(self.fs, "split_path")

    def _s3_call(self, method: str, **kwargs: Any) -> dict[str, Any]:
        bucket, key, _ = self.fs.split_path(self.key)
        out = self.fs.call_s3(method, Bucket=bucket, Key=key, **kwargs)
        self.fs.invalidate_cache(self.key)
        return out

    def read(self) -> tuple[dict[str, Any], str] | None:
        """``(holder, etag)``; None if there is no lock; ``({}, etag)`` if unreadable."""
        if self._s3:
            from fsspec.asyn import sync

            bucket, key, _ = self.fs.split_path(self.key)

            async def get() -> tuple[str, bytes]:  # the body and its ETag in one request
                out = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
                async with out["Body"] as body:
                    return str(out.get("ETag")), await body.read()

            try:
                etag, text = sync(self.fs.loop, get)
            except FileNotFoundError:
                return None
        else:
            try:
                text = self.fs.cat_file(self.key)
            except FileNotFoundError:
                return None
            etag = text.decode(errors="replace")
        try:
            holder = json.loads(text)
        except ValueError:
            return {}, etag
        return (holder if isinstance(holder, dict) else {}), etag

    def create(self, holder: dict[str, Any]) -> str:
        """Create the lock; its ETag. Raises FileExistsError if it exists."""
        body = json.dumps(holder).encode()
        if self._s3:
            try:
                out = self._s3_call("put_object", Body=body, IfNoneMatch="*")
            except OSError as err:
                if _precondition_failed(err):
                    raise FileExistsError(self.url) from None
                raise
            return str(out.get("ETag"))
        self.fs.pipe_file(self.key, body, mode="create")
        return body.decode()

    def replace(self, holder: dict[str, Any], etag: str) -> str | None:
        """Replace the lock if it still has ``etag``: its new ETag, or None if it changed."""
        body = json.dumps(holder).encode()
        if self._s3:
            try:
                out = self._s3_call("put_object", Body=body, IfMatch=etag)
            except OSError as err:
                if isinstance(err, FileNotFoundError) or _precondition_failed(err):
                    return None
                raise
            return str(out.get("ETag"))
        now = self.read()
        if now is None or now[1] != etag:
            return None
        self.fs.pipe_file(self.key, body)
        return body.decode()

    def delete(self, etag: str) -> None:
        """Remove the lock if it still has ``etag``."""
        if self._s3:
            with contextlib.suppress(FileNotFoundError, OSError):
                self._s3_call("delete_object", IfMatch=etag)
            return
        now = self.read()
        if now is not None and now[1] == etag:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.key)


def _precondition_failed(err: BaseException) -> bool:
    """Whether an S3 error is a failed condition (``If-None-Match`` / ``If-Match``), or the
    conflict S3 reports when two conditional writes race."""
    cause = err.__cause__
    code = getattr(cause, "response", {}).get("Error", {}).get("Code")
    if code in ("PreconditionFailed", "ConditionalRequestConflict"):
        return True
    return "pre-condition" in str(err) or isinstance(err, FileExistsError)


def _lease_is_stale(holder: dict[str, Any]) -> bool:
    """Whether the holder of an object-store lock is gone: its lease ran out (by this
    machine's clock), or it was a process of this machine that no longer runs."""
    expires = holder.get("expires")
    if not isinstance(expires, (int, float)) or time.time() > expires:
        return True
    return holder.get("host") == socket.gethostname() and _lock_is_stale(holder, "")


def _renew(lock: _LockObject, state: dict[str, Any], lease: float, stop: Any) -> None:
    """The holder's heartbeat: renew the lease every third of it, until ``stop`` is set.
    A renewal that finds the lock changed (it was taken over) marks it lost and stops."""
    while not stop.wait(lease / 3.0):
        holder = {**state["holder"], "expires": time.time() + lease}
        try:
            etag = lock.replace(holder, state["etag"])
        except Exception:  # noqa: BLE001 - a store unreachable now: retry next beat
            continue
        if etag is None:
            state["lost"] = True
            return
        state["holder"], state["etag"] = holder, etag


def _release_object_lock(lock: _LockObject, state: dict[str, Any], stop: Any) -> None:
    _HELD.discard(state["holder"].get("token"))
    stop.set()
    thread = state.get("thread")
    if thread is not None and thread.is_alive():
        thread.join(timeout=30.0)
    if not state.get("lost"):
        with contextlib.suppress(Exception):
            lock.delete(state["etag"])


class TraceLock:
    """The one-writer lock of a trace: an exclusive lock file beside it.

    ``<parent>/.<name>.flymc-lock`` (of the real path: symbolic links resolved) is
    created with ``O_CREAT | O_EXCL`` (atomic on local file systems and on NFS v3 and
    later) and records the holder: pid, host, boot
    id, process start time and a random token. :meth:`release` removes it only if it
    still holds this lock's token. A lock left by a process that died is broken by the
    next :meth:`acquire` when the holder was on this machine (its pid is gone or reused,
    or the machine rebooted); a holder on another machine is never presumed dead: the
    error says which lock file to remove once that run is known to be gone. The lock is
    also released when this object is garbage-collected or the interpreter exits.

    A trace behind an fsspec URL gets a lock object beside it, ``.<name>.flymc-lock``,
    created only if absent (on S3 a conditional ``PUT`` with ``If-None-Match: *``) and
    held as a lease: it records when it expires (``lease`` seconds on) and a thread of
    the holder renews it every third of that (a conditional ``PUT`` with ``If-Match``).
    A lock whose lease ran out, or whose holder was a process of this machine that is
    gone, is taken over (conditionally, so two runs cannot both take it). A holder that
    cannot renew for a whole lease (the store unreachable, the process stopped) loses the
    lock: :meth:`release` then raises, since another run may have written meanwhile.

    Parameters
    ----------
    path
        The trace's location (it need not exist yet).
    storage_options
        fsspec options of a trace at a URL.
    lease
        Seconds an object-store lock stays valid without renewal.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        lease: float = LEASE_SECONDS,
    ) -> None:
        self.trace_path = path
        self.path: str | None = None
        self._object: _LockObject | None = None
        if not is_url(path):
            # the real path: a run reaching the trace through a symbolic link (to it or
            # to a directory above it) takes the same lock as one given the real path
            local = Path(os.path.realpath(local_path(path)))
            self.path = str(local.parent / f".{local.name}.flymc-lock")
        else:
            self._object = _LockObject(os.fspath(path), storage_options)
            self.path = self._object.url
        if not (isinstance(lease, (int, float)) and math.isfinite(lease) and lease > 0):
            raise ValueError(f"lease must be a positive number of seconds, got {lease!r}")
        self.lease = float(lease)
        self._state: dict[str, Any] = {}
        self._token: str | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._token is not None

    def acquire(self) -> TraceLock:
        """Take the lock.

        Returns
        -------
        TraceLock
            ``self``.

        Raises
        ------
        TraceLockedError
            If another live process holds it (one line: who, since when, and which file
            to remove if that process is gone).
        """
        if self.path is None or self._token is not None:
            return self
        if self._object is not None:
            return self._acquire_object(self._object)
        parent = os.path.dirname(self.path)
        made: list[str] = []
        d = parent
        while d and not os.path.isdir(d):
            made.append(d)
            d = os.path.dirname(d)
        os.makedirs(parent, exist_ok=True)
        token = secrets.token_hex(16)
        me = _holder(token)
        for _attempt in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_lock(self.path)
                if holder is None:
                    continue  # released meanwhile: try again
                if _lock_is_stale(holder, self.path):
                    self._break(holder)
                    continue
                for dd in made:
                    with contextlib.suppress(OSError):
                        os.rmdir(dd)
                raise TraceLockedError(self._held_by(holder)) from None
            with os.fdopen(fd, "w") as fh:
                json.dump(me, fh)
                fh.flush()
                os.fsync(fh.fileno())
            self._token = token
            _HELD.add(token)
            self._finalizer = weakref.finalize(self, _release_lock, self.path, token, made)
            return self
        raise TraceLockedError(
            f"could not take the lock {self.path} of trace "
            f"{os.fspath(self.trace_path)!s}: it keeps changing hands"
        )

    def _acquire_object(self, lock: _LockObject) -> TraceLock:
        token = secrets.token_hex(16)
        me = {**_holder(token), "expires": time.time() + self.lease}
        for _attempt in range(5):
            try:
                etag = lock.create(me)
            except FileExistsError:
                found = lock.read()
                if found is None:
                    continue  # released meanwhile: try again
                holder, old = found
                if not _lease_is_stale(holder):
                    raise TraceLockedError(self._held_by(holder)) from None
                etag = lock.replace(me, old)  # take it over, unless it changed meanwhile
                if etag is None:
                    continue
            except TraceLockedError:
                raise
            except Exception as err:
                raise OSError(
                    f"cannot take the lock {self.path} of trace "
                    f"{os.fspath(self.trace_path)!s}: {type(err).__name__}: {err}"
                ) from err
            stop = threading.Event()
            self._state = {"holder": me, "etag": etag, "lost": False}
            thread = threading.Thread(
                target=_renew,
                args=(lock, self._state, self.lease, stop),
                name="flymc-trace-lease",
                daemon=True,
            )
            self._state["thread"] = thread
            thread.start()
            self._token = token
            _HELD.add(token)
            self._finalizer = weakref.finalize(self, _release_object_lock, lock, self._state, stop)
            return self
        raise TraceLockedError(
            f"could not take the lock {self.path} of trace "
            f"{os.fspath(self.trace_path)!s}: it keeps changing hands"
        )

    def _break(self, holder: dict[str, Any]) -> None:
        """Remove a stale lock, unless it changed hands since it was read."""
        aside = f"{self.path}.stale-{secrets.token_hex(6)}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = _read_lock(aside)
        if moved is not None and moved != holder:  # a live lock taken meanwhile: put back
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
        with contextlib.suppress(OSError):
            os.unlink(aside)

    def _held_by(self, holder: dict[str, Any]) -> str:
        trace = os.fspath(self.trace_path)
        if not holder:
            return (
                f"trace {trace!s} is locked by another run (lock file {self.path} is being "
                "written); if no run is using it, remove that file"
            )
        since = holder.get("since")
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
            if isinstance(since, (int, float))
            else "?"
        )
        if self._object is not None:
            expires = holder.get("expires")
            left = expires - time.time() if isinstance(expires, (int, float)) else 0.0
            return (
                f"trace {trace!s} is being written by another run (pid {holder.get('pid')} "
                f"on {holder.get('host')}, since {when}); one writer at a time: its lease "
                f"on {self.path} runs out {max(left, 0.0):.0f} s after it stops renewing it"
            )
        return (
            f"trace {trace!s} is being written by another run (pid {holder.get('pid')} on "
            f"{holder.get('host')}, since {when}); one writer at a time: if that run is "
            f"gone, remove {self.path}"
        )

    @property
    def lost(self) -> bool:
        """Whether an object-store lock was taken over after its lease ran out."""
        return bool(self._state.get("lost"))

    def release(self) -> None:
        """Give the lock back (removing its file only if it is still this lock's).

        Raises
        ------
        TraceLockedError
            If an object-store lock was lost while held (another run may have written
            to the trace since).
        """
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = None
        held, self._token = self._token, None
        if held is not None and self.lost:
            raise TraceLockedError(
                f"this run lost the lock {self.path} of trace {os.fspath(self.trace_path)!s}: "
                f"it could not renew it for {self.lease:.0f} s and another run took it over; "
                "the trace may hold another run's writes"
            )

    def __enter__(self) -> TraceLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
