"""One JointDPM shard: its rows, every chain's cluster label of each of them, and per
chain and cluster an order-statistic index of the cluster's members here (O(log n)
insert, remove and "the r-th member in row order").

Nothing here is random and nothing depends on the shard's history: a shard's state is a
function of its rows and their labels, so a lost shard is rebuilt exactly from the
labels (:meth:`DPMShard.restore`), and the members a ``w_k`` test reads are named by
their rank in row order, drawn on the driver — the same rows whatever the layout.

A plain class: called in-process (``client="synchronous"``) or as a Dask actor, the same
code either way (:mod:`flymc_dist.jointdpm.transport`).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from flymc_dist._compiled import JIT
from flymc_dist.reduce import fold_blocks
from flymc_dist.streams import stream_key, uniforms_range

__all__ = [
    "RANK_PURPOSE",
    "ROLE_JOINTDPM",
    "SELECT_BLOCK",
    "DPMShard",
    "MemberIndex",
    "initial_labels",
    "last_labels",
    "logit_loglik",
]

#: the spawn-key role of JointDPM's random streams (:func:`flymc_dist.rng.stream`):
#: sub-role 0 is a chain's driver stream
ROLE_JOINTDPM = 42
SUB_DRIVER = 0
#: the row-keyed stream of the initial labels (:func:`flymc_dist.streams.stream_key`
#: purpose; the z-update's purposes are 1–4, austerity's 5)
INIT_PURPOSE = 15
#: the keyed order in which a weight decision reads its cluster's members (a
#: :func:`flymc_dist.streams.permuted_rows` permutation of their ranks)
RANK_PURPOSE = 16
#: rows per block of a :class:`MemberIndex` (a select scans one block)
SELECT_BLOCK = 64
#: rows of one :meth:`DPMShard.move` above which the index is recounted per label
#: (O(blocks) per label) rather than moved row by row (O(log n) per row)
BULK_MOVE = 256


def logit_loglik(F: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``log σ(±wᵀf)`` of rows ``F`` (with their bias column) and labels ``y`` in {0, 1};
    ``w`` may be ``(P,)`` or ``(K, P)`` (then ``(K, n)``). Each ``wᵀf`` is summed column
    by column, never by a BLAS product whose rounding may depend on how many rows it is
    given: a row's value is the same bits in whatever batch (and so on whatever shard)."""
    W = np.asarray(w, float)
    F = np.asarray(F, float)
    eta = W[..., :1] * F[:, 0]
    for p in range(1, F.shape[1]):
        eta = eta + W[..., p : p + 1] * F[:, p]
    return -np.logaddexp(0.0, -(2.0 * np.asarray(y, float) - 1.0) * eta)


def last_labels(rows: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Moves ``rows[i]`` → ``labels[i]`` in the order given, as each row's last label:
    the distinct rows, sorted, and their labels."""
    order = np.argsort(rows, kind="stable")  # a row's moves in the order they came
    rows, labels = rows[order], labels[order]
    last = np.ones(rows.size, dtype=bool)
    last[:-1] = rows[1:] != rows[:-1]
    return rows[last], labels[last]


def initial_labels(seed: int, chain: int, start: int, n: int, n_clusters: int) -> np.ndarray:
    """The initial labels of rows ``start .. start + n − 1`` in ``0 .. n_clusters − 1``,
    each from its own row-keyed uniform (the same whatever the layout)."""
    key = stream_key(seed, 0, chain, ROLE_JOINTDPM, INIT_PURPOSE)
    u = uniforms_range(key, start, n)
    return np.minimum((u * n_clusters).astype(np.int64), n_clusters - 1)


@numba.njit(**JIT)
def _select(
    tree: np.ndarray, n_blocks: int, top: int, z: np.ndarray, k: int, ranks: np.ndarray,
    out: np.ndarray,
) -> None:  # fmt: skip
    """:meth:`MemberIndex.select`: for each rank, the descent of cluster ``k``'s Fenwick
    tree to the block holding its member, then that block's scan."""
    for i in range(ranks.size):
        pos, left, step = 0, ranks[i] + 1, top
        while step:
            nxt = pos + step
            if nxt <= n_blocks and tree[nxt] < left:
                left -= tree[nxt]
                pos = nxt
            step >>= 1
        j, stop = pos * SELECT_BLOCK, min(pos * SELECT_BLOCK + SELECT_BLOCK, z.size)
        out[i] = -1  # not found: the index disagrees with the labels (the caller raises)
        while j < stop:
            if z[j] == k:
                left -= 1
                if left == 0:
                    out[i] = j
                    break
            j += 1


@numba.njit(**JIT)
def _members(blocks: np.ndarray, z: np.ndarray, k: int, out: np.ndarray) -> int:
    """Every row of label ``k`` in ``z``, in row order, into ``out`` (sized for their
    number), scanning only the blocks of ``SELECT_BLOCK`` rows whose count ``blocks[b]``
    is not zero. Returns the rows found (``out.size`` unless the counts disagree with
    ``z``; never more)."""
    w = 0
    for b in range(blocks.size):
        if blocks[b] == 0:
            continue
        for r in range(b * SELECT_BLOCK, min((b + 1) * SELECT_BLOCK, z.size)):
            if z[r] == k:
                if w == out.size:
                    return w + 1
                out[w] = r
                w += 1
    return w


class MemberIndex:
    """Where one chain's clusters have their members on one shard, in row order.

    The rows are cut into blocks of :data:`SELECT_BLOCK`; per cluster, its member count
    in each block and a Fenwick tree over those counts. Insert and remove are O(log n);
    the ``r``-th member in row order is a descent of the tree (O(log n)) and a scan of
    one block (O(:data:`SELECT_BLOCK`)); every member in order costs the blocks that
    hold some.

    Parameters
    ----------
    z
        The chain's labels of the shard's rows (kept, not copied: the index reads them).
    """

    def __init__(self, z: np.ndarray) -> None:
        self.z = z
        self.n_blocks = -(-z.size // SELECT_BLOCK)
        self.blocks: dict[int, np.ndarray] = {}
        self.trees: dict[int, np.ndarray] = {}
        self.totals: dict[int, int] = {}
        self._top = 1 << max(0, self.n_blocks.bit_length() - 1)
        for k in np.unique(z).tolist():
            if k < 0:
                continue
            cnt = np.bincount(np.flatnonzero(z == k) // SELECT_BLOCK, minlength=self.n_blocks)
            self._set(int(k), cnt.astype(np.int64))

    def _set(self, k: int, counts: np.ndarray) -> None:
        i = np.arange(1, self.n_blocks + 1)
        prefix = np.concatenate([[0], np.cumsum(counts)])
        self.blocks[k] = counts
        self.trees[k] = np.concatenate([[0], prefix[i] - prefix[i - (i & -i)]])
        self.totals[k] = int(prefix[-1])

    def count(self, k: int) -> int:
        """Members of cluster ``k`` here."""
        return self.totals.get(k, 0)

    def labels(self) -> list[int]:
        """The clusters with members here, sorted."""
        return sorted(self.totals)

    def _add(self, k: int, row: int, delta: int) -> None:
        if k not in self.blocks:
            self._set(k, np.zeros(self.n_blocks, dtype=np.int64))
        b = row // SELECT_BLOCK
        self.blocks[k][b] += delta
        self.totals[k] += delta
        tree, i = self.trees[k], b + 1
        while i <= self.n_blocks:
            tree[i] += delta
            i += i & -i
        if self.totals[k] == 0:
            del self.blocks[k], self.trees[k], self.totals[k]

    def move(self, row: int, old: int, new: int) -> None:
        """Row ``row`` (whose label in ``z`` is already ``new``) leaves ``old`` for ``new``."""
        self._add(old, row, -1)
        self._add(new, row, +1)

    def move_many(self, rows: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        """Distinct ``rows`` (whose labels in ``z`` are already ``new``) leave ``old``
        for ``new``: each label concerned recounted per block, its tree rebuilt — the
        index :meth:`move` row by row would give."""
        b = np.asarray(rows, dtype=np.int64) // SELECT_BLOCK
        old, new = np.asarray(old), np.asarray(new)
        for k in np.unique(np.concatenate([old, new])).tolist():
            counts = self.blocks.get(k)
            counts = np.zeros(self.n_blocks, np.int64) if counts is None else counts.copy()
            counts -= np.bincount(b[old == k], minlength=self.n_blocks)
            counts += np.bincount(b[new == k], minlength=self.n_blocks)
            if counts.any():
                self._set(k, counts)
            elif k in self.blocks:
                del self.blocks[k], self.trees[k], self.totals[k]

    def select(self, k: int, ranks: np.ndarray) -> np.ndarray:
        """The rows of cluster ``k``'s members of 0-based ``ranks`` in row order."""
        ranks = np.asarray(ranks, dtype=np.int64)
        if ranks.size and (ranks.min() < 0 or ranks.max() >= self.count(k)):
            raise ValueError(f"ranks must lie in [0, {self.count(k)}) for cluster {k}")
        out = np.empty(ranks.size, dtype=np.int64)
        if ranks.size:
            _select(self.trees[k], self.n_blocks, self._top, self.z, k, ranks, out)
            if out.min() < 0:
                raise RuntimeError(f"cluster {k}'s member index disagrees with its labels")
        return out

    def members(self, k: int) -> np.ndarray:
        """Every member of cluster ``k`` here, in row order."""
        if k not in self.blocks:
            return np.empty(0, dtype=np.int64)
        out = np.empty(self.totals[k], dtype=np.int64)
        if _members(self.blocks[k], self.z, k, out) != out.size:
            raise RuntimeError(f"cluster {k}'s member index disagrees with its labels")
        return out


class DPMShard:
    """One contiguous row range ``[start, start + n)``: the rows (density columns and the
    logistic features with their bias), and per chain the labels and member index.

    Parameters
    ----------
    shard_id, start
        The shard's id and first global row.
    X, y
        The rows and their 0/1 labels.
    density_columns
        The columns of ``X`` modelled by the Normal-inverse-Wishart mixture.
    chains, seed
        The chains whose labels the shard keeps; the run's seed.
    """

    def __init__(
        self,
        shard_id: int,
        start: int,
        X: np.ndarray,
        y: np.ndarray,
        density_columns: list[int],
        chains: int,
        seed: int,
    ) -> None:
        self.shard_id = int(shard_id)
        self.start = int(start)
        X = np.asarray(X, float)
        self.n = X.shape[0]
        self.Xd = np.ascontiguousarray(X[:, density_columns])
        self.F = np.hstack([X, np.ones((self.n, 1))])
        self.y = np.asarray(y, float)
        self.seed = int(seed)
        self.z = np.full((chains, self.n), -1, dtype=np.int64)
        self.index = [MemberIndex(self.z[c]) for c in range(chains)]
        #: likelihood evaluations (one row at one w) made for the ``w_k`` decisions
        self.queries = 0

    def init_labels(
        self, chain: int, n_clusters: int, block: int, n_blocks: int
    ) -> tuple[dict[int, int], np.ndarray, np.ndarray]:
        """Give every row its initial label; return each label's member count here, and
        the fixed block tree's nodes (:func:`flymc_dist.reduce.fold_blocks`, blocks of
        ``block`` rows of the ``n_blocks``) of ``[n, Σx, vec Σxxᵀ]`` per label
        ``(n_clusters, 1 + D + D²)`` — sums the same in every layout."""
        if self.start % block:
            raise ValueError(f"shard {self.shard_id} starts at row {self.start}, not a block")
        self.restore(chain, initial_labels(self.seed, chain, self.start, self.n, n_clusters))
        D = self.Xd.shape[1]
        feats = np.hstack(
            [
                np.ones((self.n, 1)),
                self.Xd,
                (self.Xd[:, :, None] * self.Xd[:, None, :]).reshape(-1, D * D),
            ]
        )
        first = self.start // block
        vals = np.zeros((-(-self.n // block), n_clusters, feats.shape[1]))
        z = self.z[chain]
        for b in range(vals.shape[0]):
            fb, zb = feats[b * block : (b + 1) * block], z[b * block : (b + 1) * block]
            for k in range(n_clusters):
                vals[b, k] = (fb * (zb == k)[:, None]).sum(axis=0)
        nodes, sums = fold_blocks(vals, first, n_blocks)
        return self.counts(chain), nodes, sums

    def restore(self, chain: int, z: np.ndarray) -> None:
        """Set chain ``chain``'s labels of every row to ``z`` (its index rebuilt)."""
        z = np.asarray(z, dtype=np.int64)
        if z.shape != (self.n,):
            raise ValueError(f"z must hold the shard's {self.n} labels, not {z.shape}")
        self.z[chain] = z
        self.index[chain] = MemberIndex(self.z[chain])

    def rows(self, chain: int, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The density columns, logistic features (with bias) and labels of ``local`` rows,
        and their current cluster labels: ``(Xd, F, y, z)``."""
        local = np.asarray(local, dtype=np.int64)
        return self.Xd[local], self.F[local], self.y[local], self.z[chain, local].copy()

    def move(self, chain: int, local: np.ndarray, labels: np.ndarray) -> None:
        """Give ``local`` rows their new ``labels``, in order (the index follows); a row
        already holding its label is left alone, so a repeated call changes nothing."""
        z, index = self.z[chain], self.index[chain]
        local = np.asarray(local, dtype=np.int64)
        labels = np.asarray(labels, dtype=np.int64)
        if local.size <= BULK_MOVE:
            for r, k in zip(local.tolist(), labels.tolist(), strict=True):
                old = int(z[r])
                if old == k:
                    continue
                z[r] = k
                index.move(r, old, k)
            return
        local, labels = last_labels(local, labels)
        old = z[local]
        changed = old != labels
        local, old, labels = local[changed], old[changed], labels[changed]
        z[local] = labels
        index.move_many(local, old, labels)

    def counts(self, chain: int) -> dict[int, int]:
        """Each label's member count here."""
        index = self.index[chain]
        return {k: index.count(k) for k in index.labels()}

    def batch(self, chain: int, requests: list[tuple]) -> list[tuple[np.ndarray, Any]]:
        """For each request ``(label, ranks, w, w_prop, record)``: the cluster's members of
        0-based ``ranks`` here in row order (None: every member, in row order), and their
        ``l_i = log L_i(w_prop) − log L_i(w)`` in the same order; returns ``(l, rows)``
        per request (``rows``: their global indices when ``record``, else None)."""
        out = []
        index = self.index[chain]
        for label, ranks, w, w_prop, record in requests:
            k = int(label)
            rows = index.members(k) if ranks is None else index.select(k, ranks)
            ll = logit_loglik(
                self.F[rows],
                self.y[rows],
                np.stack([np.asarray(w_prop, float), np.asarray(w, float)]),
            )
            self.queries += 2 * rows.size
            out.append((ll[0] - ll[1], rows + self.start if record else None))
        return out

    def clusters(
        self, chain: int, labels: list[int]
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """For each of ``labels``, its members here in row order: ``(rows, Xd, F, y)``
        (``rows`` global)."""
        index = self.index[chain]
        out = []
        for k in labels:
            rows = index.members(int(k))
            out.append((rows + self.start, self.Xd[rows], self.F[rows], self.y[rows]))
        return out

    def z_of(self, chain: int) -> np.ndarray:
        """Every row's label (tests and checkpoints: a full copy)."""
        return self.z[chain].copy()
