"""Random numbers keyed by row: every random number of a z-update is a function of
(seed, generation, chain, step, purpose) and a global row or tree node, never of the shard.

A FlyMC z-update needs, for each chain at each step, one uniform per row it decides
(a bright row's bright→dark move, a proposed dark row's acceptance, an explicit draw)
and a Bernoulli(q) process over all N rows (which dark rows propose). Both come from a
*counter-based* generator, Philox4x32-10 (Salmon, Moraes, Dror & Shaw 2011; the
generator of Random123, JAX and cuRAND): a keyed bijection of a 128-bit counter, so the
uniform of row n is computed from n alone, in any order, by whichever shard holds the
row. Any partition of the rows into shards, any placement, in memory or out of core,
then gives the same draws bit for bit, and the layout is free to follow the cluster.

**The stream key** of ``(seed, generation, chain, step, purpose)`` is one Philox block of
``(step, chain, generation·16 + purpose)`` under the seed (mod 2**64) as key.

**Uniforms** (:func:`uniforms_at`, :func:`uniforms_range`): row n's is the block of
counter ``(n mod 2**32, n >> 32, 0, 0)``, its first two words as 53 bits, in [0, 1).

**The Bernoulli(q) process over [0, N)** (:func:`bernoulli_rows`), at O(log N + its
points in the range asked for) per range: a Poisson process of rate
``λ = −log(1 − q)`` per row over ``[0, 2**L)`` (``2**L ≥ N``), row n proposed when at
least one point falls on it, which happens independently for every row with probability
``1 − e^−λ = q``. The points are drawn down a fixed binary tree of row ranges: the
root's count is Poisson(λ·2**L); a node holding more than :data:`LEAF_POINTS` points
splits them between its halves by Binomial(k, 1/2) (k random bits); a node with fewer
places each uniformly in its range. Each node draws from its own counters
``(node index, level + 1, j)``, so a shard descends only into the nodes that meet its
rows and gets exactly the points any other layout would give them.
"""

from __future__ import annotations

import math

import numba
import numpy as np

_JIT = {"cache": True, "nogil": True, "error_model": "numpy"}

#: purposes of a stream (the key's last field)
Z_DECIDE = 1  # a row's uniform in an implicit or explicit z-update
Z_PROPOSE = 2  # the implicit update's dark→bright proposals (a Bernoulli(q) process)
Z_SELECT = 3  # the explicit update's rows to resample (a Bernoulli(fraction) process)
Z_INIT = 4  # the exact draw of z when chains are placed
A_ROWS = 5  # austerity: the order in which a decision draws the rows (a keyed permutation)

#: Feistel rounds of :func:`permuted_rows` (Luby–Rackoff: four of a pseudo-random
#: function give a pseudo-random permutation; more for margin)
FEISTEL_ROUNDS = 8

#: a tree node with at most this many points places them directly
LEAF_POINTS = 16

_M32 = 0xFFFFFFFF


@numba.njit(inline="always", **_JIT)
def _philox(c0: int, c1: int, c2: int, c3: int, k0: int, k1: int) -> tuple[int, int, int, int]:
    """Philox4x32-10 of the counter ``(c0, c1, c2, c3)`` under the key ``(k0, k1)``
    (32-bit words held in uint64)."""
    m = np.uint64(_M32)
    c0, c1, c2, c3 = np.uint64(c0), np.uint64(c1), np.uint64(c2), np.uint64(c3)
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (
            (p1 >> np.uint64(32)) ^ c1 ^ k0,
            p1 & m,
            (p0 >> np.uint64(32)) ^ c3 ^ k1,
            p0 & m,
        )
        k0 = (k0 + np.uint64(0x9E3779B9)) & m
        k1 = (k1 + np.uint64(0xBB67AE85)) & m
    return c0, c1, c2, c3


@numba.njit(**_JIT)
def philox4x32(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Philox4x32-10 of one 4-word counter under a 2-word key (uint64 arrays of 32-bit
    words): the generator itself, for its known-answer tests."""
    o = _philox(counter[0], counter[1], counter[2], counter[3], key[0], key[1])
    return np.array([o[0], o[1], o[2], o[3]], dtype=np.uint64)


@numba.njit(inline="always", **_JIT)
def _to_unit(a: int, b: int) -> float:
    """53 bits of the words ``a``, ``b`` as a double in [0, 1)."""
    hi = np.uint64(a) >> np.uint64(5)
    lo = np.uint64(b) >> np.uint64(6)
    return float(hi * np.uint64(67108864) + lo) * (1.0 / 9007199254740992.0)


@numba.njit(**_JIT)
def _key(seed: int, generation: int, chain: int, step: int, purpose: int) -> np.uint64:
    s = np.uint64(seed)
    m = np.uint64(_M32)
    t = np.uint64(step)
    o = _philox(
        t & m,
        t >> np.uint64(32),
        np.uint64(chain) & m,
        (np.uint64(generation) * np.uint64(16) + np.uint64(purpose)) & m,
        s & m,
        s >> np.uint64(32),
    )
    return o[0] | (o[1] << np.uint64(32))


def stream_key(seed: int, generation: int, chain: int, step: int, purpose: int) -> int:
    """The 64-bit key of the stream of ``(seed, generation, chain, step, purpose)``
    (``seed`` is taken mod 2**64)."""
    for name, v in (("generation", generation), ("chain", chain), ("step", step)):
        if v < 0:
            raise ValueError(f"stream_key: {name} must be >= 0, got {v}")
    return int(_key(np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF), generation, chain, step, purpose))


@numba.njit(**_JIT)
def chain_keys(seed: np.uint64, generation: int, step: int, purpose: int, out: np.ndarray) -> None:
    """:func:`stream_keys`' values written into ``out`` (one per chain), for compiled
    callers: ``seed`` already a uint64."""
    for c in range(out.size):
        out[c] = _key(seed, generation, c, step, purpose)


def stream_keys(seed: int, generation: int, chains: int, step: int, purpose: int) -> np.ndarray:
    """:func:`stream_key` of chains ``0 .. chains - 1`` (the other fields fixed), as a
    uint64 array, in one compiled call."""
    for name, v in (("generation", generation), ("chains", chains), ("step", step)):
        if v < 0:
            raise ValueError(f"stream_keys: {name} must be >= 0, got {v}")
    out = np.empty(int(chains), dtype=np.uint64)
    chain_keys(
        np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF), int(generation), int(step), int(purpose), out
    )
    return out


@numba.njit(**_JIT)
def _steps_keys(
    seed: np.uint64, generation: int, chains: int, first: int, count: int, purpose: int
) -> np.ndarray:
    out = np.empty(count * chains, dtype=np.uint64)
    for t in range(count):
        for c in range(chains):
            out[t * chains + c] = _key(seed, generation, c, first + t, purpose)
    return out


def steps_keys(
    seed: int, generation: int, chains: int, first: int, count: int, purpose: int
) -> np.ndarray:
    """:func:`stream_keys` of steps ``first .. first + count - 1``, step after step
    (``(count · chains,)`` uint64, chain ``c`` of step ``first + t`` at ``t · chains +
    c``), in one compiled call."""
    for name, v in (("generation", generation), ("chains", chains), ("first", first)):
        if v < 0:
            raise ValueError(f"steps_keys: {name} must be >= 0, got {v}")
    if count < 0:
        raise ValueError(f"steps_keys: count must be >= 0, got {count}")
    return _steps_keys(
        np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF),
        int(generation),
        int(chains),
        int(first),
        int(count),
        int(purpose),
    )


@numba.njit(inline="always", **_JIT)
def _uniform(key: np.uint64, n: int, word2: int, word3: int) -> float:
    m = np.uint64(_M32)
    u = np.uint64(n)
    o = _philox(u & m, u >> np.uint64(32), word2, word3, key & m, key >> np.uint64(32))
    return _to_unit(o[0], o[1])


@numba.njit(inline="always", **_JIT)
def uniform_at(key: np.uint64, n: int) -> float:
    """The uniform of row (or index) ``n`` in the stream ``key``: the value
    :func:`uniforms_at` gives it (for compiled callers)."""
    return _uniform(key, n, 0, 0)


@numba.njit(**_JIT)
def _uniforms_range(key: np.uint64, start: int, out: np.ndarray) -> None:
    for i in range(out.size):
        out[i] = _uniform(key, start + i, 0, 0)


def uniforms_at(key: int, rows: np.ndarray, offset: int = 0) -> np.ndarray:
    """The uniforms in [0, 1) of the global rows ``rows + offset`` in the stream ``key``."""
    rows = np.asarray(rows, dtype=np.int64)
    return uniforms_at_many(
        np.array([key], dtype=np.uint64), rows, np.array([0, rows.size]), np.array([offset])
    )


def uniforms_range(key: int, start: int, count: int) -> np.ndarray:
    """The uniforms of the global rows ``start .. start + count - 1`` (a full pass)."""
    out = np.empty(int(count))
    _uniforms_range(np.uint64(key), int(start), out)
    return out


# ------------------------------------------------------------ the Bernoulli process
@numba.njit(**_JIT)
def _poisson(key: np.uint64, index: int, mu: float) -> int:
    """A Poisson(mu) count from the counters ``(index, 0, j)`` (the tree's nodes use
    ``level + 1``): inversion below mu = 10, else Hörmann's PTRS (transformed rejection
    with squeeze)."""
    j = 0
    if mu <= 0.0:
        return 0
    if mu < 10.0:
        u = _uniform(key, index, 0, j)
        k = 0
        p = math.exp(-mu)
        s = p
        while u > s:
            k += 1
            p *= mu / k
            s += p
            if p < 1e-300 and k > mu:  # the tail's mass is below the uniform's resolution
                break
        return k
    slam = math.sqrt(mu)
    loglam = math.log(mu)
    b = 0.931 + 2.53 * slam
    a = -0.059 + 0.02483 * b
    invalpha = 1.1239 + 1.1328 / (b - 3.4)
    vr = 0.9277 - 3.6224 / (b - 2.0)
    while True:
        u = _uniform(key, index, 0, j) - 0.5
        v = _uniform(key, index, 0, j + 1)
        j += 2
        us = 0.5 - abs(u)
        k = math.floor((2.0 * a / us + b) * u + mu + 0.43)
        if us >= 0.07 and v <= vr:
            return int(k)
        if k < 0 or (us < 0.013 and v > us):
            continue
        if math.log(v) + math.log(invalpha) - math.log(a / (us * us) + b) <= (
            -mu + k * loglam - math.lgamma(k + 1.0)
        ):
            return int(k)


@numba.njit(inline="always", **_JIT)
def _popcount(x: np.uint64) -> int:
    c = 0
    while x:
        x &= x - np.uint64(1)
        c += 1
    return c


@numba.njit(**_JIT)
def _split(key: np.uint64, level: int, index: int, k: int) -> int:
    """Binomial(k, 1/2): how many of a node's k points fall in its left half."""
    m = np.uint64(_M32)
    u = np.uint64(index)
    left = 0
    j = 0
    rest = k
    while rest > 0:
        o = _philox(u & m, u >> np.uint64(32), level + 1, j, key & m, key >> np.uint64(32))
        j += 1
        for w in (o[0], o[1], o[2], o[3]):
            if rest >= 32:
                left += _popcount(w)
                rest -= 32
            elif rest > 0:
                left += _popcount(w & ((np.uint64(1) << np.uint64(rest)) - np.uint64(1)))
                rest = 0
    return left


@numba.njit(**_JIT)
def _process(
    key: np.uint64,
    lam: float,
    depth: int,
    n_total: int,
    lo: int,
    hi: int,
    out: np.ndarray,
    stack: np.ndarray,
    buf: np.ndarray,
) -> int:
    """The rows of ``[lo, hi)`` hit by the Poisson points (see the module notes), sorted
    and distinct, into ``out`` (grown as needed: returns the count; the caller reads
    ``out`` after a call that returned ≤ its size, else calls again with a larger one).
    ``stack`` (3, ≥ 2 depth + 8) and ``buf`` (:data:`LEAF_POINTS`) are scratch, shared by
    a caller's calls: a call allocates nothing."""
    hi = min(hi, n_total)
    if hi <= lo:
        return 0
    # an explicit stack of (level, index, count), right child pushed first
    st_level, st_index, st_count = stack[0], stack[1], stack[2]
    root = _poisson(key, 0, lam * float(np.int64(1) << np.int64(depth)))
    sp = 0
    if root > 0:
        st_level[0], st_index[0], st_count[0] = 0, 0, root
        sp = 1
    n = 0
    while sp > 0:
        sp -= 1
        level, index, k = st_level[sp], st_index[sp], st_count[sp]
        size = np.int64(1) << np.int64(depth - level)
        a = index * size
        if size == 1:  # a row hit by k >= 1 points
            if a >= lo and a < hi:
                if n < out.size:
                    out[n] = a
                n += 1
            continue
        if k <= LEAF_POINTS:
            for j in range(k):  # placed, and sorted as they come (k is small)
                r = a + int(_uniform(key, index, level + 1, j) * size)
                i = j
                while i > 0 and buf[i - 1] > r:
                    buf[i] = buf[i - 1]
                    i -= 1
                buf[i] = r
            prev = -1
            for j in range(k):
                r = buf[j]
                if r != prev and r >= lo and r < hi:
                    if n < out.size:
                        out[n] = r
                    n += 1
                prev = r
            continue
        left = _split(key, level, index, k)
        half = size >> np.int64(1)
        mid = a + half
        # right child first, so the left one is taken next (rows come out in order)
        if k - left > 0 and mid < hi and mid + half > lo:
            st_level[sp], st_index[sp], st_count[sp] = level + 1, 2 * index + 1, k - left
            sp += 1
        if left > 0 and a < hi and mid > lo:
            st_level[sp], st_index[sp], st_count[sp] = level + 1, 2 * index, left
            sp += 1
    return n


def tree_depth(n_total: int) -> int:
    """L, the depth of the proposal tree over ``n_total`` rows (``2**L >= n_total``)."""
    return max(0, int(n_total - 1).bit_length())


@numba.njit(**_JIT)
def _process_many(
    keys: np.ndarray,
    lam: float,
    depth: int,
    n_total: int,
    los: np.ndarray,
    his: np.ndarray,
    out: np.ndarray,
    seg: np.ndarray,
) -> int:
    """:func:`_process` of each (key, range) pair, written pair after pair to ``out``
    (``seg`` its bounds); returns the size ``out`` needed (all written when it fits)."""
    n = 0
    seg[0] = 0
    stack = np.empty((3, 2 * depth + 8), dtype=np.int64)
    buf = np.empty(LEAF_POINTS, dtype=np.int64)
    for p in range(keys.size):
        room = out[n:] if n < out.size else out[:0]
        n += _process(keys[p], lam, depth, n_total, los[p], his[p], room, stack, buf)
        seg[p + 1] = n
    return n


def bernoulli_rows_many(
    keys: np.ndarray, q: float, n_total: int, los: np.ndarray, his: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`bernoulli_rows` of several streams and global ranges in one call: the rows
    of pair p at ``rows[seg[p]:seg[p+1]]``."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    los = np.minimum(np.maximum(np.asarray(los, dtype=np.int64), 0), n_total)
    his = np.minimum(np.asarray(his, dtype=np.int64), n_total)
    seg = np.zeros(keys.size + 1, dtype=np.int64)
    if q <= 0.0 or keys.size == 0:
        return np.empty(0, dtype=np.int64), seg
    if q >= 1.0:
        parts = [np.arange(a, max(a, b), dtype=np.int64) for a, b in zip(los, his, strict=True)]
        seg[1:] = np.cumsum([p.size for p in parts])
        return np.concatenate(parts), seg
    if n_total > 2**62:
        raise ValueError(f"bernoulli_rows: {n_total} rows is beyond 2**62")
    lam = -math.log1p(-q)
    depth = tree_depth(n_total)
    span = float(np.maximum(his - los, 0).sum())
    size = int(span * q + 6.0 * math.sqrt(span * q) + 16 * keys.size)
    while True:
        out = np.empty(size, dtype=np.int64)
        n = _process_many(keys, lam, depth, int(n_total), los, his, out, seg)
        if n <= size:
            return out[:n], seg
        size = n


def bernoulli_rows(key: int, q: float, n_total: int, lo: int, hi: int) -> np.ndarray:
    """The global rows of ``[lo, hi)`` kept by the Bernoulli(q) process over ``[0,
    n_total)`` of the stream ``key``: sorted int64, the same rows whatever range
    contains them. O(log N + rows returned) work (q ≥ 1: every row)."""
    rows, _ = bernoulli_rows_many(
        np.array([key], dtype=np.uint64), q, n_total, np.array([lo]), np.array([hi])
    )
    return rows


@numba.njit(**_JIT)
def _uniforms_at_many(
    keys: np.ndarray, rows: np.ndarray, seg: np.ndarray, offsets: np.ndarray, out: np.ndarray
) -> None:
    for p in range(keys.size):
        for i in range(seg[p], seg[p + 1]):
            out[i] = _uniform(keys[p], rows[i] + offsets[p], 0, 0)


def uniforms_at_many(
    keys: np.ndarray, rows: np.ndarray, seg: np.ndarray, offsets: np.ndarray
) -> np.ndarray:
    """:func:`uniforms_at` of several streams: pair p's rows ``rows[seg[p]:seg[p+1]] +
    offsets[p]`` in the stream ``keys[p]``."""
    out = np.empty(rows.size)
    _uniforms_at_many(
        np.ascontiguousarray(keys, dtype=np.uint64),
        np.ascontiguousarray(rows, dtype=np.int64),
        np.ascontiguousarray(seg, dtype=np.int64),
        np.ascontiguousarray(offsets, dtype=np.int64),
        out,
    )
    return out


# ------------------------------------------------------- a keyed permutation of rows
@numba.njit(**_JIT)
def _feistel(key: np.uint64, bits: int, xs: np.ndarray, n: int) -> None:
    """The Feistel network of :func:`permuted_rows` applied once to each of ``xs[:n]``, in
    place: round by round over all the values, whose rounds are independent of each other
    (a value's Philox chain is serial; several in flight overlap on the CPU)."""
    m = np.uint64(_M32)
    k0, k1 = key & m, key >> np.uint64(32)
    one = np.uint64(1)
    u = bits // 2  # the left part's bits; the right part has bits - u
    v = bits - u
    left = np.empty(n, dtype=np.uint64)
    right = np.empty(n, dtype=np.uint64)
    for i in range(n):
        left[i] = xs[i] >> np.uint64(v)
        right[i] = xs[i] & ((one << np.uint64(v)) - one)
    for r in range(FEISTEL_ROUNDS):
        mask = (one << np.uint64(u)) - one
        for i in range(n):
            # (L, R) of u and v bits -> (R, L xor F(R)) of v and u bits: a bijection
            f = _philox(right[i] & m, right[i] >> np.uint64(32), r, A_ROWS, k0, k1)[0]
            left[i], right[i] = right[i], left[i] ^ (np.uint64(f) & mask)
        u, v = v, u
    for i in range(n):
        xs[i] = (left[i] << np.uint64(v)) | right[i]


@numba.njit(**_JIT)
def _permuted(key: np.uint64, n_total: int, bits: int, start: int, out: np.ndarray) -> None:
    xs = np.empty(out.size, dtype=np.uint64)
    at = np.empty(out.size, dtype=np.int64)  # the position in ``out`` of each of ``xs``
    for i in range(out.size):
        xs[i] = np.uint64(start + i)
        at[i] = i
    pending = out.size
    while pending > 0:  # cycle-walk: apply the permutation of [0, 2**bits) until inside [0, N)
        _feistel(key, bits, xs, pending)
        kept = 0
        for j in range(pending):
            if xs[j] < np.uint64(n_total):
                out[at[j]] = np.int64(xs[j])
            else:
                xs[kept], at[kept] = xs[j], at[j]
                kept += 1
        pending = kept


def permuted_rows(key: int, n_total: int, start: int, count: int) -> np.ndarray:
    """Positions ``start .. start + count - 1`` of a pseudo-random permutation of the rows
    ``[0, n_total)`` keyed by ``key`` (:func:`stream_key`): distinct rows, in a random order
    that depends on nothing but ``(key, n_total)`` — not on how the rows are cut into
    shards — at O(count) whatever N.

    A Feistel network on ``bits`` bits (``2**bits ≥ N``, at least 2; halves of
    ``bits // 2`` and the rest bits, alternating) whose round function is Philox4x32-10 of
    ``(right half, round, A_ROWS)`` under the key, restricted to ``[0, N)`` by cycle walking
    (Black & Rogaway 2002: fewer than two walks expected). A prefix of it is a simple
    random sample of the rows without replacement.
    """
    n_total, start, count = int(n_total), int(start), int(count)
    if count < 0 or start < 0 or start + count > n_total:
        raise ValueError(
            f"permuted_rows: positions [{start}, {start + count}) are not within [0, {n_total})"
        )
    bits = max(2, (n_total - 1).bit_length())
    if bits > 64:
        raise ValueError(f"permuted_rows: n_total must be below 2**64, got {n_total}")
    out = np.empty(count, dtype=np.int64)
    _permuted(np.uint64(int(key) & 0xFFFFFFFFFFFFFFFF), n_total, bits, start, out)
    return out


class RowStreams:
    """The streams of one chain's z-update at one step, for a shard whose local row 0 is
    the global row ``offset`` of ``n_total``.

    Parameters
    ----------
    seed, generation, chain, step
        What keys the streams (see the module notes).
    offset
        The global row of the shard's first row.
    n_total
        N, the rows of the whole data set (the proposal tree spans them).
    init
        The exact draw of z at placement: the decisions come from the ``Z_INIT`` stream.
    """

    __slots__ = ("_ids", "_decide", "_keys", "offset", "n_total")

    def __init__(
        self,
        seed: int,
        generation: int,
        chain: int,
        step: int,
        offset: int,
        n_total: int,
        init: bool = False,
    ) -> None:
        self._ids = (seed, generation, chain, step)
        self._decide = Z_INIT if init else Z_DECIDE
        self._keys: dict[int, int] = {}  # computed when first asked for
        self.offset = int(offset)
        self.n_total = int(n_total)

    def _key(self, purpose: int) -> int:
        key = self._keys.get(purpose)
        if key is None:
            key = self._keys[purpose] = stream_key(*self._ids, purpose)
        return key

    @property
    def decide(self) -> int:
        """The key of the rows' decisions (``Z_INIT`` at placement, else ``Z_DECIDE``)."""
        return self._key(self._decide)

    @property
    def propose(self) -> int:
        """The key of the dark→bright proposals' Bernoulli(q) process."""
        return self._key(Z_PROPOSE)

    @property
    def select(self) -> int:
        """The key of the explicit update's Bernoulli(fraction) selection."""
        return self._key(Z_SELECT)

    def log_uniforms(self, rows: np.ndarray) -> np.ndarray:
        """``log(1 - u)`` of the shard-local ``rows``' uniforms: finite, never ``log 0``."""
        return np.log1p(-uniforms_at(self.decide, rows, self.offset))

    def rows(self, key: int, q: float, lo: int, hi: int) -> np.ndarray:
        """The shard-local rows of ``lo:hi`` kept by the Bernoulli(q) process ``key``
        (:attr:`propose` or :attr:`select`)."""
        return (
            bernoulli_rows(key, q, self.n_total, self.offset + lo, self.offset + hi) - self.offset
        )
