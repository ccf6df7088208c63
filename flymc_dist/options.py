"""The typed options of :func:`flymc_dist.sample`, each declared once.

The algorithm is an object — :class:`FlyMC`, :class:`Regular` or :class:`Austerity` —
holding the options that belong to it; where the shards run is a :class:`Placement`;
the θ-kernel is a kernel object (:class:`~flymc_dist.kernels.NUTS` and the others). Each
field has its type, its default and a one-line doc (``field.metadata["doc"]``), and is
checked once, when the object is made. ``flymc run``'s flags are generated from these
same fields (:mod:`flymc_dist.cli.parser`), so the API and the command line cannot
drift.

>>> FlyMC(q_db=0.01).changed()
{'q_db': 0.01}

This module imports nothing heavy: the command line builds its parser from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "ALGORITHMS",
    "CHANNELS",
    "READ_AHEAD",
    "REPLICA_BUDGET",
    "Austerity",
    "FlyMC",
    "JointDPM",
    "Placement",
    "Regular",
    "RunSettings",
    "algorithm_of",
    "describe",
]

#: the replica's default memory budget in ``bright_replica="auto"`` mode (bytes)
REPLICA_BUDGET = 256 * 2**20
#: replica mode: iterations of dark→bright proposals the driver fetches per shard host:
#: one request to the H hosts carries ``READ_AHEAD · H`` iterations' rows, so the driver
#: sends about one message per ``READ_AHEAD`` iterations whatever H (see
#: :mod:`flymc_dist.ahead`; the bytes per request are capped there). 256 rather than 32:
#: fewer requests and blocks, each with its fixed costs on the hosts and the driver —
#: random-walk MH at 2·10⁶ × 57 on 2 workers 0.037-0.058 ms an iteration against
#: 0.067-0.086; NUTS at 4·10⁵ × 20 the same on 2 workers, and on 16 sharing 2 cores
#: 1.06-1.16× the 2-worker iteration against 1.67-1.75×
READ_AHEAD = 256
#: how rounds travel to the shard hosts
CHANNELS = ("auto", "socket", "tcp", "dask")


def _option(default: Any, doc: str, check: Callable[[str, Any], Any] | None = None) -> Any:
    """A field: its default, its one-line doc, and the check (``check(name, value)``
    returns the value, normalised, or raises ``ValueError`` naming ``name``)."""
    return field(default=default, metadata={"doc": doc, "check": check})


# ------------------------------------------------------------------ value checks


def _is_int(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or _is_numpy(v, "iu")


def _is_real(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or _is_numpy(v, "iuf")


def _is_numpy(v: Any, kinds: str) -> bool:
    dtype = getattr(v, "dtype", None)
    return getattr(v, "ndim", None) == 0 and dtype is not None and dtype.kind in kinds


def one_of(*words: Any) -> Callable[[str, Any], Any]:
    """The check: one of ``words`` (str, True, False or None)."""

    def check(name: str, v: Any) -> Any:
        for w in words:
            if (v is w) or (isinstance(w, str) and isinstance(v, str) and v == w):
                return v
        raise ValueError(f"{name} must be {_or(words)}, not {v!r}")

    check.words = words  # type: ignore[attr-defined]
    return check


def _or(words: tuple) -> str:
    if len(words) == 1:
        return repr(words[0])
    return ", ".join(map(repr, words[:-1])) + f" or {words[-1]!r}"


def number_in(lo: float, hi: float, *, lo_open: bool = True, also: tuple = ()) -> Callable:
    """The check: a real number in ``(lo, hi]`` (``[lo, hi)`` with ``lo_open=False``), or one
    of ``also``."""

    def check(name: str, v: Any) -> Any:
        if any(v is w or (isinstance(v, str) and v == w) for w in also):
            return v
        ok = _is_real(v) and math.isfinite(float(v))
        if ok:
            x = float(v)
            ok = (lo < x <= hi) if lo_open else (lo <= x < hi)
        if not ok:
            span = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g})"
            extra = f"{_or(also)} or " if also else ""
            raise ValueError(f"{name} must be {extra}a number in {span}, not {v!r}")
        return float(v)

    check.words = also  # type: ignore[attr-defined]
    return check


def integer(lo: int, *, none: bool = False) -> Callable[[str, Any], Any]:
    """The check: an integer ``>= lo`` (or None with ``none``)."""

    def check(name: str, v: Any) -> Any:
        if v is None and none:
            return None
        if not _is_int(v) or v < lo:
            what = f"{'None or ' if none else ''}an integer >= {lo}"
            raise ValueError(f"{name} must be {what}, not {v!r}")
        return int(v)

    return check


def seconds(name: str, v: Any) -> float:
    """The check: a finite number of seconds > 0."""
    if not (_is_real(v) and math.isfinite(float(v)) and float(v) > 0):
        raise ValueError(f"{name} must be a number of seconds > 0, not {v!r}")
    return float(v)


def nonnegative_bytes(name: str, v: Any) -> float | int:
    """The check: a number of bytes >= 0."""
    if not (_is_real(v) and float(v) >= 0):
        raise ValueError(f"{name} must be a number of bytes >= 0, not {v!r}")
    return v


def positive_bytes_or_none(name: str, v: Any) -> int | None:
    """The check: None or a positive integer number of bytes."""
    if v is not None and not (_is_int(v) and v > 0):
        raise ValueError(f"{name} must be None or a positive number of bytes, not {v!r}")
    return None if v is None else int(v)


def boolean(name: str, v: Any) -> bool:
    """The check: True or False."""
    if isinstance(v, bool) or _is_numpy(v, "b"):
        return bool(v)
    raise ValueError(f"{name} must be True or False, not {v!r}")


# ------------------------------------------------------------------ the option groups


class _Options:
    """Each field checked (and normalised) by its ``check`` when the object is made."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != f.default
        }


@dataclass(frozen=True)
class FlyMC(_Options):
    """Firefly Monte Carlo (exact): each row has a brightness z_n; a θ-step evaluates only
    the bright rows (and the collapsed bound of the dark ones). The default algorithm."""

    name: ClassVar[str] = "flymc"
    bounds: str = _option(
        "map",
        "tight points of the lower bounds: 'map' (tuned at the MAP estimate) or 'untuned'",
        one_of("map", "untuned"),
    )
    z_update: str = _option(
        "implicit",
        "'implicit' (MH on each z_n, proposal knob q_db) or 'explicit' (Gibbs on a "
        "resample_fraction of the z_n each iteration)",
        one_of("implicit", "explicit"),
    )
    q_db: float | str = _option(
        "auto",
        "implicit z-update: a dark row is proposed bright once in 1/q_db iterations; 'auto': "
        "about as many proposals per iteration as bright rows (4× for HMC and NUTS), plus "
        "one per exact row",
        number_in(0.0, 1.0, also=("auto",)),
    )
    resample_fraction: float = _option(
        0.1,
        "explicit z-update: each row is resampled with this probability per iteration",
        number_in(0.0, 1.0),
    )
    exact_rows: str | None = _option(
        "auto",
        "'auto': rows that alone inform a weight (a rare one-hot column, an extreme value) "
        "get loose bounds and are evaluated at every step; None: off",
        one_of("auto", None),
    )
    bright_replica: str | bool = _option(
        "auto",
        "keep the chains' bright rows on the driver too, so θ-steps need no round trip: "
        "'auto' (when they fit replica_budget), True or False",
        one_of("auto", True, False),
    )
    replica_budget: int = _option(
        REPLICA_BUDGET,
        "bytes the bright replica may hold in 'auto' mode (0: no replica)",
        nonnegative_bytes,
    )
    read_ahead: int = _option(
        READ_AHEAD,
        "replica mode: the driver updates z itself, fetching the rows the next read_ahead × H "
        "iterations will propose in one request to the H shard hosts, about one message per "
        "read_ahead iterations whatever H (fewer iterations where a host's reply would pass "
        "32 MiB or all of them 128 MiB; 0: a round to the shards every iteration)",
        integer(0),
    )


@dataclass(frozen=True)
class Regular(_Options):
    """Regular MCMC (exact): every θ-step evaluates the log-likelihood on every row."""

    name: ClassVar[str] = "regular"


@dataclass(frozen=True)
class Austerity(_Options):
    """Austerity MH (APPROXIMATE; results are labelled so): a sequential t-test on random
    minibatches decides each RWMH step. ``eps`` is one-sided by default, as the paper's
    (Chen, Mansinghka & Ghahramani 2016, Appendix A): ``tails="two"`` with ``2·eps`` takes
    the same decisions."""

    name: ClassVar[str] = "austerity"
    eps: float = _option(
        0.01,
        "tolerance of the sequential test, in the sense tails says (0: exact, a full pass "
        "per step)",
        number_in(0.0, 1.0, lo_open=False),
    )
    tails: str = _option(
        "one",
        "the test's p-value: 'one' (the paper's eps: stop when P(T > |t|) < eps, i.e. the "
        "one-sided level, threshold t⁻¹(1 − eps)) or 'two' (stop when 2·P(T > |t|) < eps; "
        "a one-sided eps decides as a two-sided 2·eps)",
        one_of("one", "two"),
    )
    min_batches: int = _option(
        1,
        "minibatches drawn before the first test (the paper's k0: 3, with minibatches of "
        "10–100 rows)",
        integer(1),
    )
    batch_size: int = _option(500, "rows per minibatch of the sequential test", integer(1))
    control_variates: bool = _option(
        True,
        "test the gap between each row's log-likelihood and its MAP-tuned FlyMC bound "
        "(whose collapsed sum is exact) instead of the log-likelihood differences",
        boolean,
    )


@dataclass(frozen=True)
class RunSettings:
    """The run's own settings that its parts read (the start, the trace, the progress
    line): :func:`flymc_dist.sample`'s keywords beside the algorithm, kernel and
    placement objects, checked there (:func:`flymc_dist.call.make_call`). Each default
    is written here once (``flymc_dist.call.RUN_DEFAULTS`` is made from these fields)."""

    init: Any = _option("map", "the chains' start: 'map' (around the MAP estimate) or θ")
    precondition: Any = _option(
        "laplace", "the kernels' starting metric: 'laplace', 'bound', 'identity' or an array"
    )
    map_maxiter: int = _option(100, "iterations of the MAP search (0: none)")
    trace: Any = _option(None, "the zarr trace the draws are written to as the run goes")
    resume: bool = _option(False, "continue the trace's run from its last checkpoint")
    overwrite_trace: bool = _option(False, "replace an existing trace at ``trace``")
    checkpoint_every: int = _option(100, "iterations between the trace's checkpoints")
    trace_storage_options: dict[str, Any] | None = _option(
        None, "fsspec options of a trace at a URL"
    )
    progress: bool | None = _option(None, "show a progress line (None: when interactive)")


def positive_pair(name: str, v: Any) -> tuple[float, float]:
    """The check: two finite numbers > 0, as a tuple."""
    try:
        a, b = v
        ok = all(_is_real(t) and math.isfinite(float(t)) and float(t) > 0 for t in (a, b))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be two numbers > 0, not {v!r}")
    return float(a), float(b)


def columns_or_none(name: str, v: Any) -> tuple[int, ...] | None:
    """The check: None or a non-empty sequence of distinct column indices >= 0."""
    if v is None:
        return None
    try:
        out = tuple(v)
    except TypeError:
        out = ()
    if not out or not all(_is_int(c) and c >= 0 for c in out) or len(set(out)) != len(out):
        raise ValueError(f"{name} must be None or distinct column indices >= 0, not {v!r}")
    return tuple(int(c) for c in out)


@dataclass(frozen=True)
class JointDPM(_Options):
    """The joint Dirichlet process mixture of logistic experts (Wade et al.; the
    sublinear-MH paper's Sec. 4.2) over a binary data set: clusters with collapsed
    Normal-inverse-Wishart densities over ``density_columns`` and logistic weights
    ``w_k``, a Dirichlet process with concentration ``α``. Run by
    :func:`flymc_dist.sample_jointdpm`; ``eps > 0`` makes the ``w_k`` moves approximate
    (austerity over the cluster's members), ``eps = 0`` is exact."""

    name: ClassVar[str] = "jointdpm"
    alpha_prior: tuple = _option(
        (1.0, 1.0), "(shape, rate) of the Gamma prior of the concentration α", positive_pair
    )
    alpha_update: str = _option(
        "escobar-west",
        "how α moves: 'escobar-west' (exact Gibbs, with its auxiliary variable) or 'mh' "
        "(random walk on log α)",
        one_of("escobar-west", "mh"),
    )
    niw: tuple = _option(
        (5.0, 5.0),
        "(k0, v0 − D) of the Normal-inverse-Wishart prior; m0 = 0, S0 = v0·I (the paper's)",
        positive_pair,
    )
    w_prior: float = _option(
        1.0,
        "sd of the N(0, sd²·I) prior of each cluster's weights (with bias)",
        number_in(0, 1e300),
    )
    density_columns: tuple | None = _option(
        None, "columns of X the mixture's densities model (None: all)", columns_or_none
    )
    step_z: int = _option(100, "rows whose cluster is Gibbs-sampled per iteration", integer(1))
    proposal_sd: float = _option(
        0.2, "sd of the random-walk proposal of each cluster's weights", number_in(0, 1e300)
    )
    eps: float = _option(
        0.0,
        "tolerance of the sequential test on each w_k move (0: exact MH over the cluster)",
        number_in(0.0, 1.0, lo_open=False),
    )
    tails: str = _option(
        "one", "the test's p-value: 'one' (the paper's eps) or 'two'", one_of("one", "two")
    )
    min_batches: int = _option(3, "minibatches before the first test (the paper's k0)", integer(1))
    batch_size: int = _option(10, "members per minibatch of the sequential test", integer(1))
    init_clusters: int = _option(
        1, "clusters at the start (each row's label from its own random number)", integer(1)
    )
    split_merge: int = _option(
        0,
        "split–merge proposals per iteration (0: the paper's program, the labels moved by "
        "the Gibbs step alone); each reads every member of the one or two clusters it "
        "concerns",
        integer(0),
    )


@dataclass(frozen=True)
class Placement(_Options):
    """Where the shards run and how they hold their rows. Placement never changes the
    draws (every random number is keyed by row), only the cost."""

    n_shards: int | None = _option(None, "shards (default: one per worker)", integer(1, none=True))
    rows_per_shard: int | None = _option(
        None, "rows per shard, instead of n_shards", integer(1, none=True)
    )
    out_of_core: str | bool = _option(
        "auto",
        "'auto': a shard whose rows exceed its memory budget streams them once into a "
        "row file on its worker's local disk and reads only the rows it touches; True / "
        "False force it",
        one_of("auto", True, False),
    )
    memory_budget: int | None = _option(
        None,
        "bytes of rows a shard may hold in memory (default: its share of half its "
        "worker's memory limit; in-process: no limit)",
        positive_bytes_or_none,
    )
    channel: str = _option(
        "auto",
        "how rounds travel: 'socket' (a direct socket to each worker's shard host: a "
        "local one on the driver's machine, whose host then lends the driver its "
        "in-memory rows through shared memory; TCP elsewhere), 'tcp' (the same, TCP to "
        "every host: nothing lent), 'dask' (Dask's actor RPC), 'auto' (socket unless the "
        "cluster uses TLS)",
        one_of(*CHANNELS),
    )
    fanout: int = _option(
        4,
        "the most hosts the driver, and each host, sends a shard-evaluated round to on "
        "the socket channel: rounds travel down a tree of hosts, so the driver's cost per "
        "round grows as log W, not W; 0: the driver sends to every host",
        integer(0),
    )
    n_workers: int | None = _option(
        None,
        "workers of the embedded LocalCluster (default: the machine's cores, at most 8)",
        integer(1, none=True),
    )
    timeout: float = _option(
        60.0, "seconds without an answer after which a worker is treated as lost", seconds
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_shards is not None and self.rows_per_shard is not None:
            raise ValueError("give n_shards or rows_per_shard, not both")


#: algorithm name → its options class
ALGORITHMS: dict[str, type[_Options]] = {c.name: c for c in (FlyMC, Regular, Austerity)}  # type: ignore[attr-defined]


def algorithm_of(value: Any) -> FlyMC | Regular | Austerity:
    """``value`` as an algorithm object: one already, or a name (its default options)."""
    if isinstance(value, (FlyMC, Regular, Austerity)):
        return value
    if isinstance(value, str) and value in ALGORITHMS:
        return ALGORITHMS[value]()  # type: ignore[return-value]
    raise ValueError(
        f"algorithm must be fd.FlyMC(…), fd.Regular(), fd.Austerity(…) or one of "
        f"{tuple(ALGORITHMS)}, not {value!r}"
    )


def describe(cls: type) -> list[tuple[str, Any, str]]:
    """``(name, default, doc)`` of each field of an options class."""
    return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(cls)]
