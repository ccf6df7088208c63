"""The round protocol between the driver and the shards: what a round carries, and how.

A *round* is one call from the driver to every shard, for all chains at once
(:meth:`flymc_dist.shard.Shard.round`): a typed message goes out — a :class:`Round`
(each chain's commit and :class:`Request`), or in replica mode a :class:`ReplicaRound`
(each chain's θ only) — and a :class:`Reply` of small arrays (in replica mode a
:class:`ReplicaReply`) comes back per shard. :class:`ShardSpec` says where a shard's
rows are (and how to open their store), :class:`ShardConfig` how every shard of a run
behaves. A round and its replies travel as raw array bytes behind a small pickled header
(:func:`pack_round`, :func:`pack_reply`): pickling each array costs more than a round's
compute for a few chains.
"""

from __future__ import annotations

import importlib
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from flymc_dist.models.base import Model


def shard_operation(func: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``func(shard, *args)`` as a shard operation, run on a shard by
    :meth:`flymc_dist.shard.Shard.operation` under the name :func:`operation_name` gives.

    How an add-on sampler (austerity) registers what it computes beside the rows, in its
    own module: the shard imports nothing of it, and runs only functions so marked.
    """
    func.shard_operation = operation_name(func)  # type: ignore[attr-defined]
    return func


def operation_name(func: Callable[..., Any]) -> str:
    """The name a shard operation travels under: ``"module:function"``."""
    return f"{func.__module__}:{func.__qualname__}"


def resolve_operation(name: str) -> Callable[..., Any]:
    """The shard operation called ``name`` (see :func:`shard_operation`): its module is
    imported where it runs. A name that is not a function marked with
    :func:`shard_operation` is refused (ValueError): no arbitrary callable runs on a shard.
    """
    module, _, qualname = str(name).partition(":")
    func = None
    if module and qualname:
        try:
            func = getattr(importlib.import_module(module), qualname, None)
        except ImportError:
            func = None
    if getattr(func, "shard_operation", None) != name:
        raise ValueError(
            f"unknown shard operation {name!r}: not a function marked with "
            f"flymc_dist.protocol.shard_operation"
        )
    return func  # type: ignore[return-value]


@dataclass(frozen=True)
class ShardSpec:
    """Where a shard's rows are: ``[start, stop)`` of the store at ``path``.

    ``storage_options`` are the fsspec options the driver opened the store with (an
    endpoint, credentials), so that a worker opens it the same way; they are left out of
    the repr (they may hold secrets) and of the hash. ``store_id`` is the identity of the
    data set the run opened (:attr:`flymc_dist.data.Dataset.store_id`): a shard opening a
    store rewritten since — on set-up, or recreated after a fault — refuses it.
    """

    shard_id: int
    path: str
    start: int
    stop: int
    storage_options: dict[str, Any] | None = field(default=None, repr=False, hash=False)
    store_id: str | None = None


@dataclass(frozen=True)
class ShardConfig:
    """How the shards of one run behave (the same for every shard)."""

    model: Model
    algorithm: str  # "flymc" | "regular" | "austerity"
    chains: int
    seed: int
    #: N, the rows of the whole data set: the z-updates' random streams span them, so
    #: that every shard draws its rows' part of one process whatever the layout
    n_rows: int
    z_update: str = "implicit"  # "implicit" | "explicit"
    q_db: float = 0.01  # the driver may replace it ("auto") through Shard.set_q
    resample_fraction: float = 0.1
    track_grad: bool = False
    #: rows kept in a local row file, not in memory: True, False, or "auto" (when a shard's
    #: rows in memory would exceed ``memory_budget``; see :class:`flymc_dist.shard.Shard`)
    out_of_core: bool | str = "auto"
    #: bytes of memory a shard may use for its rows ("auto" mode); None: its share of
    #: half its worker's memory limit (no limit, or in-process: no budget, in memory)
    memory_budget: int | None = None


class Request(NamedTuple):
    """One chain's part of a round trip (see :class:`flymc_dist.kernels.base.EvalRequest`)."""

    points: np.ndarray  # (k, P)
    grad: bool
    current_grad: bool


def pack_arrays(meta: Any, arrays: list[np.ndarray]) -> bytes:
    """``meta`` (small plain Python data) and ``arrays`` as one buffer.

    The arrays travel as their raw bytes after a pickled header of ``meta`` and their
    dtypes and shapes: pickling each array through its ``__reduce__`` costs ~10 µs
    apiece, more than a round's compute for a few chains.
    """
    arrays = [np.ascontiguousarray(a) for a in arrays]
    head = pickle.dumps(
        (meta, [(a.dtype.str, a.shape) for a in arrays]), protocol=pickle.HIGHEST_PROTOCOL
    )
    pad = -(len(head) + 8) % 8  # the arrays start 8-byte aligned
    return b"".join(
        [len(head).to_bytes(8, "little"), head, b"\0" * pad] + [a.tobytes() for a in arrays]
    )


def unpack_arrays(blob: bytes) -> tuple[Any, list[np.ndarray]]:
    """Invert :func:`pack_arrays`; the arrays are read-only views of ``blob``."""
    n = int.from_bytes(blob[:8], "little")
    meta, specs = pickle.loads(blob[8 : 8 + n])
    off = 8 + n + (-(n + 8) % 8)
    out = []
    for dt, shape in specs:
        dtype = np.dtype(dt)
        count = math.prod(shape)
        out.append(np.frombuffer(blob, dtype, count, off).reshape(shape))
        off += count * dtype.itemsize
    return meta, out


class Round(NamedTuple):
    """A round's message when the shards answer with sums (regular MCMC, and FlyMC with
    ``bright_replica=False``): every chain's decision to commit, whether z moves, and the
    points each chain's kernel asks for."""

    seq: Any  #: the round's number: a shard replays its cached reply to a repeated one
    commits: np.ndarray  #: ``(C,)`` int: the row of each chain's last points now current, or -1
    update_z: bool  #: FlyMC: update z after the commits (the iteration's first round)
    requests: list[Request | None]  #: each chain's points (None: it has finished its step)


class ReplicaRound(NamedTuple):
    """A replica-mode round's message: every chain's new θ; the shards update z there and
    answer with the change of each chain's bright set (:class:`ReplicaReply`)."""

    seq: Any  #: as :attr:`Round.seq`
    thetas: np.ndarray  #: ``(C, P)``: each chain's position


def pack_round(msg: Round | ReplicaRound) -> bytes:
    """A round's message as the one buffer :meth:`ShardHost.round_packed` takes."""
    if isinstance(msg, ReplicaRound):
        return pack_arrays(("replica", msg.seq), [np.asarray(msg.thetas, dtype=float)])
    shapes = [None if r is None else (bool(r.grad), bool(r.current_grad)) for r in msg.requests]
    meta = (
        "round",
        msg.seq,
        np.asarray(msg.commits, dtype=np.int64).tolist(),
        bool(msg.update_z),
        shapes,
    )
    return pack_arrays(meta, [r.points for r in msg.requests if r is not None])


def unpack_round(blob: bytes) -> Round | ReplicaRound:
    """Invert :func:`pack_round`."""
    meta, arrays = unpack_arrays(blob)
    if meta[0] == "replica":
        return ReplicaRound(meta[1], arrays[0])
    _, seq, commits, update_z, shapes = meta
    it = iter(arrays)
    requests = [None if f is None else Request(next(it), f[0], f[1]) for f in shapes]
    return Round(seq, np.asarray(commits, dtype=np.int64), update_z, requests)


class Reply(NamedTuple):
    """One shard's reply to a round (:meth:`flymc_dist.shard.Shard.round`), or the sum of
    every shard's (:meth:`flymc_dist.driver.Driver._aggregate`).

    Every field holds one entry per chain ``c`` of the run (``C`` chains, ``P``
    parameters, ``kmax`` the most points any chain asked for in the round).

    Attributes
    ----------
    current : numpy.ndarray
        ``(C,)`` float: the shard's likelihood part at each chain's current θ (FlyMC:
        ``Σ_bright log L~_n``; regular MCMC: ``Σ_n l_n``). In a shard's reply, one such
        sum per node of the fixed block tree (``tree``): ``(n, C)``, and likewise a
        leading axis on ``points``, ``current_grad`` and ``points_grad``.
    points : numpy.ndarray
        ``(C, kmax)`` float: the same at each requested point, padded with NaN beyond a
        chain's own number of points.
    n_bright : numpy.ndarray
        ``(C,)`` int64: bright rows of each chain after the round's z-update (regular
        MCMC: every row).
    queries : numpy.ndarray
        ``(C,)`` int64: likelihood queries the round made for each chain.
    current_grad : numpy.ndarray or None
        ``(C, P)`` float: the gradient of ``current``, when some chain asked for it.
    points_grad : numpy.ndarray or None
        ``(C, kmax, P)`` float: the gradients at the points, when some chain asked.
    tree : numpy.ndarray or None
        A shard's reply: ``(n, 3)`` int64, row ``j`` the ``(level, index, blocks)`` of the
        node of :mod:`flymc_dist.reduce`'s fixed block tree whose sums are entry ``j`` of
        the sums' leading axis (:func:`~flymc_dist.reduce.fold_blocks`): the driver
        completes the tree, so the sums do not depend on the layout. None in a sum.
    """

    current: np.ndarray
    points: np.ndarray
    n_bright: np.ndarray
    queries: np.ndarray
    current_grad: np.ndarray | None = None
    points_grad: np.ndarray | None = None
    tree: np.ndarray | None = None


class ReplicaReply(NamedTuple):
    """One shard's reply to a round in replica mode
    (:meth:`flymc_dist.shard.Shard.set_replica`): the change of every chain's bright set
    since the shard's last reply, applied by :meth:`flymc_dist.replica.BrightReplica.apply`.

    The rows of all chains are concatenated, chain after chain; ``*_seg`` delimit each
    chain's part (chain ``c``'s new rows are ``new_ids[new_seg[c]:new_seg[c + 1]]``).

    Attributes
    ----------
    n_bright : numpy.ndarray
        ``(C,)`` int64: bright rows of each chain after the round's z-update.
    queries : numpy.ndarray
        ``(C,)`` int64: likelihood queries the round made for each chain.
    full : numpy.ndarray
        ``(C,)`` bool: the chain's whole bright set is sent (its first reply, or after a
        redraw of z): the replica drops every row of this shard first.
    gone_ids : numpy.ndarray
        int64, global ids of the rows that went dark.
    gone_seg : numpy.ndarray
        ``(C + 1,)`` int64: each chain's part of ``gone_ids``.
    new_ids : numpy.ndarray
        int64, global ids of the rows that became bright.
    new_seg : numpy.ndarray
        ``(C + 1,)`` int64: each chain's part of the ``new_*`` arrays.
    new_X : numpy.ndarray
        ``(len(new_ids), D)`` float: the new rows' features.
    new_y : numpy.ndarray
        The new rows' targets.
    new_xi : numpy.ndarray
        The new rows' tight points.
    """

    n_bright: np.ndarray
    queries: np.ndarray
    full: np.ndarray
    gone_ids: np.ndarray
    gone_seg: np.ndarray
    new_ids: np.ndarray
    new_seg: np.ndarray
    new_X: np.ndarray
    new_y: np.ndarray
    new_xi: np.ndarray


#: the reply types by their tag on the wire
_REPLY_TYPES: tuple[type[Reply] | type[ReplicaReply], ...] = (Reply, ReplicaReply)


def pack_reply(reply: dict[int, Reply | ReplicaReply]) -> bytes:
    """A host's round reply (shard id → its :class:`Reply` or :class:`ReplicaReply`) as
    one buffer: per shard, its type's tag and which fields are present (None: absent),
    then the arrays of the fields present, in field order."""
    meta = []
    arrays: list[np.ndarray] = []
    for sid, r in reply.items():
        present = [a is not None for a in r]
        meta.append((sid, type(r) is ReplicaReply, present))
        arrays += [a for a in r if a is not None]
    return pack_arrays(meta, arrays)


def unpack_reply(blob: bytes) -> dict[int, Reply | ReplicaReply]:
    """Invert :func:`pack_reply` (the arrays are read-only views of ``blob``)."""
    meta, arrays = unpack_arrays(blob)
    it = iter(arrays)
    return {
        sid: _REPLY_TYPES[tag]._make([next(it) if p else None for p in present])
        for sid, tag, present in meta
    }


class Transport(Protocol):
    """How the driver reaches its shards: in-process
    (:class:`flymc_dist.transport.inprocess.InProcessTransport`) or Dask actors
    (:class:`flymc_dist.transport.dask.DaskTransport`). Every result comes back as a list in
    global shard order (:attr:`specs`), so the driver combines them identically whatever
    the placement."""

    #: ``"synchronous"`` or ``"dask"``
    name: str
    #: the shards, in global shard order
    specs: list[ShardSpec]
    #: round trips made so far
    round_trips: int
    #: random-stream generation of the shards' z draws (advanced by resume and recovery)
    generation: int
    #: fault recoveries so far (one dict each)
    recoveries: list[dict[str, Any]]
    #: how rounds travel: ``"in-process"``, ``"socket"`` or ``"dask"``
    channel: str

    @property
    def n_workers(self) -> int:
        """Places the shards live in."""

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``Shard.<method>(*args, **kwargs)`` on every shard, in shard order."""

    def call_each(self, method: str, per_shard: list[tuple]) -> list[Any]:
        """``Shard.<method>(*per_shard[i])`` on shard i, in shard order."""

    def call_some(self, method: str, per_shard: dict[int, tuple]) -> dict[int, Any]:
        """``Shard.<method>(*args)`` on the listed shards only (one round trip)."""

    def round(self, msg: Round | ReplicaRound, positions: np.ndarray) -> list[Reply | ReplicaReply]:
        """One protocol round on every shard (``positions``: where recovery redraws z)."""

    def timing(self) -> list[dict[str, float]]:
        """Each shard host's busy seconds (for reports)."""

    def close(self) -> None:
        """Release the shards (and a cluster started for the run)."""
