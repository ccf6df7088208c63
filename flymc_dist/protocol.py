"""The round protocol between the driver and the shards: what a round carries, and how.

A *round* is one call from the driver to every shard, for all chains at once
(:meth:`flymc_dist.shard.Shard.round`): a typed message goes out — a :class:`Round`
(each chain's commit and :class:`Request`), or in replica mode a :class:`ReplicaRound`
(each chain's θ only) — and a :class:`Reply` of small arrays (in replica mode a
:class:`ReplicaReply`) comes back per shard. :class:`ShardSpec` says where a shard's
rows are (and how to open their store), :class:`ShardConfig` how every shard of a run
behaves. A round and its replies travel in a fixed binary layout (:func:`pack_arrays`):
the arrays' raw bytes behind a header of explicit lengths, whitelisted dtypes and shapes,
validated on arrival (:func:`unpack_round`, :func:`unpack_reply`); nothing received is
unpickled.
"""

from __future__ import annotations

import importlib
import math
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from flymc_dist.models.base import Model
from flymc_dist.reduce import merge_nodes


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


#: the modules whose shard operations a shard imports on demand; any other module must
#: already be imported where the shard runs (nothing else is imported by name)
OPERATION_MODULES = ("flymc_dist.austerity.shard",)


def resolve_operation(name: str) -> Callable[..., Any]:
    """The shard operation called ``name`` (see :func:`shard_operation`).

    ``name`` is ``"module:function"``; the module is imported only if it is one of
    :data:`OPERATION_MODULES` or already imported, so that naming a module runs none of
    its code. Anything else, or a name that is not a function marked with
    :func:`shard_operation`, is refused (ValueError): no arbitrary callable runs on a shard.
    """
    refused = ValueError(
        f"unknown shard operation {name!r}: not a function marked with "
        f"flymc_dist.protocol.shard_operation"
    )
    if not isinstance(name, str):
        raise refused
    module, _, qualname = name.partition(":")
    if not (module and qualname.isidentifier()):
        raise refused
    if module not in sys.modules and module not in OPERATION_MODULES:
        raise refused
    func = getattr(importlib.import_module(module), qualname, None)
    if getattr(func, "shard_operation", None) != name:
        raise refused
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


#: the dtypes an array may travel as (little-endian, by their code on the wire)
WIRE_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in ("<f8", "<f4", "<i8", "<i4", "<i2", "|i1", "<u8", "<u4", "<u2", "|u1", "|b1")
)
_DTYPE_CODE = {dt: i for i, dt in enumerate(WIRE_DTYPES)}
#: whether each wire dtype is this machine's own (little-endian: all of them)
_NATIVE = [dt == dt.newbyteorder("=") for dt in WIRE_DTYPES]
#: the most dimensions an array may have, and the deepest nesting of a message's meta
MAX_NDIM = 4
MAX_DEPTH = 8
_MAGIC = b"FLYMC1\0\0"  # 8 bytes: the arrays start 8-byte aligned
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
#: meta value tags: None, False, True, int, float, str, bytes, list, dict
_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _BYTES, _LIST, _DICT = b"NFTifsblm"
#: each tag as the one byte written
_TAG = [bytes([c]) for c in range(256)]
#: an array's dtype code and dimensions, and its shape by number of dimensions
_SPEC = struct.Struct("<BB")
_SHAPE = [struct.Struct(f"<{d}q") for d in range(MAX_NDIM + 1)]


class ShardLost(RuntimeError):
    """A host (worker) stopped answering; ``workers`` are the lost ones, when known."""

    def __init__(self, message: str, workers: list[str] | None = None) -> None:
        super().__init__(message)
        self.workers = list(workers or [])


class SchedulerLost(ShardLost):
    """The Dask scheduler is gone: no shard can be recreated, the run cannot go on."""


class WireError(ValueError):
    """A message that does not decode: bad layout, length, dtype, shape or value. Nothing
    of it has been applied."""


def _put(out: list[bytes], v: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise WireError(f"meta nested deeper than {MAX_DEPTH}")
    if v is None:
        out.append(_TAG[_NONE])
    elif isinstance(v, bool | np.bool_):
        out.append(_TAG[_TRUE if v else _FALSE])
    elif isinstance(v, int | np.integer):
        out += [_TAG[_INT], _I64.pack(int(v))]
    elif isinstance(v, float | np.floating):
        out += [_TAG[_FLOAT], _F64.pack(float(v))]
    elif isinstance(v, str | bytes):
        b = v.encode() if isinstance(v, str) else v
        out += [_TAG[_STR if isinstance(v, str) else _BYTES], _U32.pack(len(b)), b]
    elif isinstance(v, list | tuple):
        out += [_TAG[_LIST], _U32.pack(len(v))]
        for x in v:
            _put(out, x, depth + 1)
    elif isinstance(v, dict):
        out += [_TAG[_DICT], _U32.pack(len(v))]
        for k, x in v.items():
            _put(out, k, depth + 1)
            _put(out, x, depth + 1)
    else:
        raise TypeError(f"meta cannot carry a {type(v).__name__} (only plain values)")


class _Reader:
    """Reads a message's buffer front to back, refusing anything past its end."""

    def __init__(self, blob: bytes | memoryview) -> None:
        self.blob = memoryview(blob).cast("B")
        self.size = len(self.blob)
        self.off = 0

    def skip(self, n: int) -> int:
        """Step over ``n`` bytes; returns where they start."""
        at = self.off
        if n < 0 or at + n > self.size:
            raise WireError(f"message truncated: {n} bytes wanted at {at} of {self.size}")
        self.off = at + n
        return at

    def take(self, n: int) -> memoryview:
        at = self.skip(n)
        return self.blob[at : at + n]

    def unpack(self, fmt: struct.Struct) -> tuple:
        return fmt.unpack_from(self.blob, self.skip(fmt.size))

    def u32(self) -> int:
        return self.unpack(_U32)[0]

    def value(self, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"meta nested deeper than {MAX_DEPTH}")
        tag = self.blob[self.skip(1)]
        if tag == _NONE:
            return None
        if tag == _FALSE or tag == _TRUE:
            return tag == _TRUE
        if tag == _INT:
            return self.unpack(_I64)[0]
        if tag == _FLOAT:
            return self.unpack(_F64)[0]
        if tag == _STR:
            try:
                return str(self.take(self.u32()), "utf-8")
            except UnicodeDecodeError as e:
                raise WireError(f"meta string is not UTF-8: {e}") from None
        if tag == _BYTES:
            return bytes(self.take(self.u32()))
        if tag == _LIST:
            n = self.u32()
            if n > self.size - self.off:  # each item takes a byte at least
                raise WireError(f"meta list of {n} items longer than the message")
            return tuple([self.value(depth + 1) for _ in range(n)])
        if tag == _DICT:
            n = self.u32()
            if 2 * n > self.size - self.off:
                raise WireError(f"meta dict of {n} items longer than the message")
            out = {}
            for _ in range(n):
                k = self.value(depth + 1)
                if not isinstance(k, int | str | bytes | bool | None):
                    raise WireError(f"meta dict key of type {type(k).__name__}")
                out[k] = self.value(depth + 1)
            return out
        raise WireError(f"unknown meta tag {bytes([tag])!r}")


def pack_arrays(meta: Any, arrays: list[np.ndarray]) -> bytes:
    """``meta`` (small plain data: None, bool, int, float, str, bytes, lists, tuples and
    dicts of them) and ``arrays`` as one buffer (:func:`pack_arrays_parts` joined);
    nothing in it is pickled."""
    return b"".join(pack_arrays_parts(meta, arrays))


def pack_arrays_parts(meta: Any, arrays: list[np.ndarray]) -> list[bytes | memoryview]:
    """:func:`pack_arrays`' buffer as its parts in order, the arrays' bytes not copied
    (views of C-contiguous little-endian arrays): what a socket can send as they are.

    The layout: an 8-byte magic; the meta's length and its tagged encoding; the number
    of arrays and, for each, its dtype's code in :data:`WIRE_DTYPES`, its number of
    dimensions and its shape; then the arrays' raw bytes, 8-byte aligned. Pickling each
    array through its ``__reduce__`` would cost ~10 µs apiece, more than a round's
    compute for a few chains, and would run code on the receiving side.
    """
    body: list[bytes] = []
    _put(body, meta, 0)
    head = b"".join(body)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    specs = [_U32.pack(len(arrays))]
    for a in arrays:
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        if dt not in _DTYPE_CODE:
            raise TypeError(f"an array of dtype {a.dtype} cannot travel (see WIRE_DTYPES)")
        if a.ndim > MAX_NDIM:
            raise TypeError(f"an array of {a.ndim} dimensions cannot travel (at most {MAX_NDIM})")
        specs.append(struct.pack(f"<BB{a.ndim}q", _DTYPE_CODE[dt], a.ndim, *a.shape))
    spec = b"".join(specs)
    n = 8 + 4 + len(head) + len(spec)
    return [_MAGIC, _U32.pack(len(head)), head, spec, b"\0" * (-n % 8)] + [_raw(a) for a in arrays]


def _raw(a: np.ndarray) -> bytes | memoryview:
    """The bytes of ``a`` (C-contiguous), little-endian, as a view where they already are."""
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return memoryview(a).cast("B") if a.size else b""


def unpack_arrays(blob: bytes) -> tuple[Any, list[np.ndarray]]:
    """Invert :func:`pack_arrays`, refusing (:class:`WireError`) anything that does not
    fit its layout: a wrong magic, a length past the end or short of it, an unknown dtype,
    a negative shape. The arrays are read-only views of ``blob``."""
    r = _Reader(blob)
    if bytes(r.take(8)) != _MAGIC:
        raise WireError("not a flymc message (wrong magic)")
    n_head = r.u32()
    end = r.off + n_head
    meta = r.value()
    if r.off != end:
        raise WireError(f"meta of {r.off - end + n_head} bytes, its header says {n_head}")
    n_arrays = r.u32()
    if 2 * n_arrays > r.size - r.off:
        raise WireError(f"{n_arrays} arrays announced in a message of {r.size} bytes")
    specs = []
    for _ in range(n_arrays):
        code, ndim = r.unpack(_SPEC)
        if code >= len(WIRE_DTYPES) or ndim > MAX_NDIM:
            raise WireError(f"array of dtype code {code} and {ndim} dimensions refused")
        shape = r.unpack(_SHAPE[ndim])
        if any(d < 0 for d in shape):
            raise WireError(f"array of negative shape {shape} refused")
        specs.append((code, shape))
    r.skip(-r.off % 8)
    out = []
    for code, shape in specs:
        dtype = WIRE_DTYPES[code]
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if nbytes > r.size - r.off:
            raise WireError(f"array of shape {shape} longer than the message")
        a = np.frombuffer(r.blob, dtype, count, r.skip(nbytes)).reshape(shape)
        if dtype.kind == "b" and count and a.view(np.uint8).max() > 1:
            raise WireError("a boolean array holds bytes other than 0 and 1")
        out.append(a if _NATIVE[code] else a.astype(dtype.newbyteorder("="), copy=False))
    if r.off != r.size:
        raise WireError(f"{r.size - r.off} bytes after the last array")
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


def _finite_matrix(a: np.ndarray, what: str) -> np.ndarray:
    if a.dtype != np.float64 or a.ndim != 2:
        raise WireError(f"{what} must be a 2-D float64 array, not {a.ndim}-D {a.dtype}")
    if not np.isfinite(a).all():
        raise WireError(f"{what} holds NaN or infinite values")
    return a


def _int(v: Any, what: str, lo: int = -(2**63)) -> int:
    if type(v) is not int or v < lo:
        raise WireError(f"{what} must be an integer >= {lo}, not {v!r}")
    return v


def unpack_round(blob: bytes) -> Round | ReplicaRound:
    """Invert :func:`pack_round`, validating the message before anything uses it
    (:class:`WireError`: wrong layout, a NaN or infinite θ, a shape that does not fit).
    How many chains and parameters the shards have is checked by :func:`check_round`."""
    meta, arrays = unpack_arrays(blob)
    if not isinstance(meta, tuple) or not meta or meta[0] not in ("replica", "round"):
        raise WireError("not a round message")
    if meta[0] == "replica":
        if len(meta) != 2 or len(arrays) != 1:
            raise WireError("a replica round carries its seq and one array")
        return ReplicaRound(_int(meta[1], "seq"), _finite_matrix(arrays[0], "thetas"))
    if len(meta) != 5:
        raise WireError("a round carries seq, commits, update_z and the requests' flags")
    _, seq, commits, update_z, flags = meta
    if not isinstance(commits, tuple) or not isinstance(flags, tuple) or len(commits) != len(flags):
        raise WireError("a round's commits and requests must be one per chain")
    if type(update_z) is not bool:
        raise WireError("update_z must be a bool")
    for f in flags:
        if f is not None and not (
            isinstance(f, tuple) and len(f) == 2 and all(type(b) is bool for b in f)
        ):
            raise WireError(f"a request's flags must be None or two bools, not {f!r}")
    if len(arrays) != sum(f is not None for f in flags):
        raise WireError("a round carries one array of points per request")
    it = iter(arrays)
    requests = [
        None if f is None else Request(_finite_matrix(next(it), "points"), f[0], f[1])
        for f in flags
    ]
    return Round(
        _int(seq, "seq"),
        np.array([_int(c, "commit", -1) for c in commits], dtype=np.int64),
        update_z,
        requests,
    )


def check_round(msg: Round | ReplicaRound, chains: int, n_params: int) -> None:
    """Refuse (:class:`WireError`) a round whose chains or parameters are not the
    shards' ``chains`` and ``n_params``."""
    if isinstance(msg, ReplicaRound):
        if msg.thetas.shape != (chains, n_params):
            raise WireError(
                f"thetas of shape {msg.thetas.shape}, the shards hold {chains} chains "
                f"of {n_params} parameters"
            )
        return
    if len(msg.requests) != chains or msg.commits.shape != (chains,):
        raise WireError(f"a round for {len(msg.requests)} chains, the shards hold {chains}")
    for r in msg.requests:
        if r is not None and r.points.shape[1] != n_params:
            raise WireError(
                f"points of {r.points.shape[1]} parameters, the shards' model has {n_params}"
            )


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


#: the fields of a :class:`Reply` summed along the block tree, and those counted
SUM_FIELDS = tuple(
    Reply._fields.index(f) for f in ("current", "points", "current_grad", "points_grad")
)
COUNT_FIELDS = tuple(Reply._fields.index(f) for f in ("n_bright", "queries"))


def partial_sum(replies: list[Reply]) -> Reply:
    """Several shards' replies to one round (or partial sums of them) as one partial sum:
    the nodes of the fixed block tree they hold, merged wherever a node's children are
    all there (:func:`~flymc_dist.reduce.merge_nodes`), and the counts added.

    Every node is the same sum whoever merges it, so a relay's partial sum of its
    subtree's shards, merged again by the driver, gives the bits the driver gets from
    every shard's own reply: the layout and the relay tree change no draw. The sums
    travel packed side by side per node (one numpy addition per node merged), and the
    result keeps a reply's leading node axis (``tree`` its nodes).
    """
    first = replies[0]
    sums = [i for i in SUM_FIELDS if first[i] is not None]
    if any(r.tree is None or any(r[i] is None for i in sums) for r in replies):
        raise WireError("replies to one round must all carry the block tree and sums")
    shapes = [first[i].shape[1:] for i in sums]
    try:
        packed = np.concatenate(
            [
                np.concatenate(
                    [r[i].reshape(r.tree.shape[0], math.prod(r[i].shape[1:])) for i in sums],
                    axis=1,
                )
                for r in replies
            ]
        )
        table, merged = merge_nodes(np.concatenate([r.tree for r in replies]), packed)
    except ValueError as e:
        raise WireError(f"replies that do not fit one round: {e}") from None
    out: list[np.ndarray | None] = [None] * len(first)
    off = 0
    for i, shape in zip(sums, shapes, strict=True):
        width = math.prod(shape)
        out[i] = merged[:, off : off + width].reshape(merged.shape[0], *shape)
        off += width
    for i in COUNT_FIELDS:
        acc = np.array(first[i], copy=True)
        for r in replies[1:]:
            acc += r[i]
        out[i] = acc
    out[Reply._fields.index("tree")] = table
    return Reply._make(out)


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
    """Invert :func:`pack_reply`, validating the layout (:class:`WireError`); the arrays
    are read-only views of ``blob``."""
    meta, arrays = unpack_arrays(blob)
    if not isinstance(meta, tuple):
        raise WireError("not a reply message")
    it = iter(arrays)
    out: dict[int, Reply | ReplicaReply] = {}
    try:
        for sid, tag, present in meta:
            kind = _REPLY_TYPES[int(tag)]
            if not isinstance(present, tuple) or len(present) != len(kind._fields):
                raise WireError(f"a {kind.__name__} has {len(kind._fields)} fields")
            out[_int(sid, "shard id", 0)] = kind._make([next(it) if p else None for p in present])
    except (TypeError, ValueError, StopIteration) as e:
        raise WireError(f"not a reply message: {e}") from None
    if next(it, None) is not None:
        raise WireError("a reply carries more arrays than its fields")
    return out


class Ahead(NamedTuple):
    """A read-ahead request (replica mode, the driver updating z): the rows every chain's
    dark→bright proposals hit at steps ``first .. first + count - 1`` of the streams of
    ``generation``, with their data (:class:`Proposals`), from every shard of a host."""

    first: int
    count: int
    generation: int


class Proposals(NamedTuple):
    """One shard's answer to an :class:`Ahead`: the rows each (step, chain) pair proposes,
    pair ``p = (step - first) * C + chain`` at ``ids[seg[p]:seg[p + 1]]`` (global ids,
    sorted), and the data of those rows once each (``rows``, sorted global ids, with their
    features ``X`` — float32 when the data are stored so, float64 else —, targets ``y``,
    tight points ``xi`` and the model's row constants ``consts``, ``(n, K)`` float64, as
    the shard's own z-update reads them); each id is ``rows[at]``."""

    ids: np.ndarray
    seg: np.ndarray
    rows: np.ndarray
    at: np.ndarray
    X: np.ndarray
    y: np.ndarray
    xi: np.ndarray
    consts: np.ndarray


def pack_ahead(msg: Ahead) -> bytes:
    """A read-ahead request as one buffer (:meth:`ShardHost.proposals_packed` takes it)."""
    return pack_arrays(("ahead", int(msg.first), int(msg.count), int(msg.generation)), [])


def unpack_ahead(blob: bytes) -> Ahead:
    """Invert :func:`pack_ahead`."""
    meta, _ = unpack_arrays(blob)
    if not (isinstance(meta, tuple) and len(meta) == 4 and meta[0] == "ahead"):
        raise ValueError("not a read-ahead request")
    return Ahead(*(int(v) for v in meta[1:]))


def pack_proposals(reply: dict[int, Proposals]) -> list[bytes | memoryview]:
    """A host's :class:`Proposals` (shard id → its answer) as one buffer's parts
    (:func:`pack_arrays_parts`: joined, the buffer :func:`unpack_proposals` reads)."""
    arrays: list[np.ndarray] = []
    for r in reply.values():
        arrays += list(r)
    return pack_arrays_parts(list(reply), arrays)


def unpack_proposals(blob: bytes) -> dict[int, Proposals]:
    """Invert :func:`pack_proposals` (the arrays are read-only views of ``blob``)."""
    sids, arrays = unpack_arrays(blob)
    n = len(Proposals._fields)
    return {sid: Proposals._make(arrays[i * n : (i + 1) * n]) for i, sid in enumerate(sids)}


def _tree(v: Any, arrays: list[np.ndarray]) -> tuple:
    """``v`` as the meta carries it, its arrays appended to ``arrays``: ``("a", i)`` for
    an array (the ``i``-th), ``("t", *items)`` for a list or tuple, ``("d", k1, v1, …)``
    for a dict (plain keys), ``("v", v)`` for a plain value (None, bool, int, float, str,
    bytes)."""
    if isinstance(v, np.ndarray):
        arrays.append(v)
        return ("a", len(arrays) - 1)
    if isinstance(v, list | tuple):
        return ("t", *(_tree(x, arrays) for x in v))
    if isinstance(v, dict):
        return ("d", *(y for k, x in v.items() for y in (k, _tree(x, arrays))))
    return ("v", v)


def _untree(node: Any, arrays: list[np.ndarray]) -> Any:
    """Invert :func:`_tree` (:class:`WireError` if ``node`` does not fit); lists come back
    as tuples."""
    if not (isinstance(node, tuple) and node and node[0] in ("a", "t", "d", "v")):
        raise WireError(f"not an encoded value: {node!r:.80}")
    tag = node[0]
    if tag == "v":
        if len(node) != 2 or isinstance(node[1], tuple | dict):
            raise WireError("a plain value is one value")
        return node[1]
    if tag == "a":
        if len(node) != 2 or type(node[1]) is not int or not 0 <= node[1] < len(arrays):
            raise WireError(f"an array reference {node!r:.80} names none of {len(arrays)}")
        return arrays[node[1]]
    if tag == "t":
        return tuple(_untree(x, arrays) for x in node[1:])
    if len(node) % 2 != 1:
        raise WireError("a dict is keys and values in pairs")
    keys = node[1::2]
    if not all(isinstance(k, int | str | bytes | bool | None) for k in keys):
        raise WireError("a dict's keys must be plain values")
    return {k: _untree(x, arrays) for k, x in zip(keys, node[2::2], strict=True)}


def pack_calls(calls: dict[int, tuple[str, tuple]]) -> bytes:
    """Method calls on some shards of a host (shard id → ``(method, args)``) as one
    buffer: the names and the arguments' plain values in the meta, their arrays as
    arrays (any nesting of lists, tuples and dicts of them: :func:`_tree`). Nothing is
    pickled. Which methods may run is the host's to say."""
    arrays: list[np.ndarray] = []
    meta = tuple(
        (int(sid), str(method), _tree(tuple(args), arrays)) for sid, (method, args) in calls.items()
    )
    return pack_arrays(("calls", meta), arrays)


def unpack_calls(blob: bytes) -> dict[int, tuple[str, tuple]]:
    """Invert :func:`pack_calls`, validating the layout (:class:`WireError`); the arrays
    are read-only views of ``blob``, lists come back as tuples."""
    meta, arrays = unpack_arrays(blob)
    if not (isinstance(meta, tuple) and len(meta) == 2 and meta[0] == "calls"):
        raise WireError("not a shard calls message")
    if not isinstance(meta[1], tuple):
        raise WireError("a shard calls message lists its calls")
    out: dict[int, tuple[str, tuple]] = {}
    for call in meta[1]:
        if not (isinstance(call, tuple) and len(call) == 3 and isinstance(call[1], str)):
            raise WireError("a shard call is a shard id, a method and its arguments")
        args = _untree(call[2], arrays)
        if not isinstance(args, tuple):
            raise WireError("a shard call's arguments must be a list")
        out[_int(call[0], "shard id", 0)] = (call[1], args)
    return out


def pack_results(results: dict[int, Any]) -> list[bytes | memoryview]:
    """Shard calls' results (shard id → arrays and plain data, nested as
    :func:`pack_calls` takes them) as one buffer's parts (:func:`unpack_results` reads
    them joined)."""
    arrays: list[np.ndarray] = []
    meta = tuple((int(sid), _tree(r, arrays)) for sid, r in results.items())
    return pack_arrays_parts(("results", meta), arrays)


def unpack_results(blob: bytes) -> dict[int, Any]:
    """Invert :func:`pack_results` (:class:`WireError` if it does not fit)."""
    meta, arrays = unpack_arrays(blob)
    if not (isinstance(meta, tuple) and len(meta) == 2 and meta[0] == "results"):
        raise WireError("not a shard calls reply")
    if not isinstance(meta[1], tuple):
        raise WireError("a shard calls reply lists its results")
    out: dict[int, Any] = {}
    for item in meta[1]:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise WireError("a result is a shard id and its value")
        out[_int(item[0], "shard id", 0)] = _untree(item[1], arrays)
    return out


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

    @property
    def hosts(self) -> list[list[int]]:
        """The shards each place holds, as positions in :attr:`specs` (a read-ahead
        request's reply carries every shard of its host)."""

    @property
    def lending_hosts(self) -> int:
        """Hosts that lend the driver their rows (:meth:`borrow_rows`): a read-ahead
        request travels to the others only."""

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``Shard.<method>(*args, **kwargs)`` on every shard, in shard order."""

    def call_each(self, method: str, per_shard: list[tuple]) -> list[Any]:
        """``Shard.<method>(*per_shard[i])`` on shard i, in shard order."""

    def call_some(self, method: str, per_shard: dict[int, tuple]) -> dict[int, Any]:
        """``Shard.<method>(*args)`` on the listed shards only (one round trip)."""

    def round(self, msg: Round | ReplicaRound, positions: np.ndarray) -> list[Reply | ReplicaReply]:
        """One protocol round on every shard (``positions``: where recovery redraws z).
        A :class:`Round`'s replies may be partial sums of several shards' (a relay tree's,
        :func:`partial_sum`), in shard order."""

    def post_ahead(self, msg: Ahead, prepare: Callable[[list[Proposals]], Any]) -> Any:
        """Send a read-ahead request to every host without waiting: a handle for
        :meth:`take_ahead`. ``prepare`` is applied to the answers (in shard order) once
        every host has answered: on a thread of the transport's own while the caller
        computes, or in :meth:`take_ahead` (it must not touch the transport)."""

    def borrow_rows(self) -> None:
        """Have the hosts that can lend the driver their rows do so (shared memory, on
        its machine): their read-ahead answers are then drawn and read by the driver,
        the same bits (:mod:`flymc_dist.shard.shared`). With no request in flight."""

    def take_ahead(self, handle: Any) -> Any:
        """What ``prepare`` made of the answers to :meth:`post_ahead`'s request; None when
        hosts were lost on the way and their shards recreated (the driver then redraws
        z)."""

    def drop_ahead(self, handle: Any) -> None:
        """Wait for the answers to :meth:`post_ahead`'s request and drop them (hosts lost
        on the way are left for the next call to meet)."""

    def timing(self) -> list[dict[str, float]]:
        """Each shard host's busy seconds (for reports)."""

    def close(self) -> None:
        """Release the shards (and a cluster started for the run)."""
