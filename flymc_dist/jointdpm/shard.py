"""One JointDPM shard: its rows, every chain's cluster label of each of them, and per
chain and cluster a member array (O(1) insert and remove, uniform draws without
replacement for the austerity test of that cluster's weights).

A plain class: called in-process (``client="synchronous"``) or as a Dask actor, the same
code either way (:mod:`flymc_dist.jointdpm.transport`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flymc_dist.rng import stream
from flymc_dist.streams import stream_key, uniforms_range

__all__ = ["ROLE_JOINTDPM", "DPMShard", "MemberArray", "logit_loglik"]

#: the spawn-key role of JointDPM's random streams (:func:`flymc_dist.rng.stream`):
#: sub-role 0 is a chain's driver stream, 1 a shard's member draws
ROLE_JOINTDPM = 42
SUB_DRIVER = 0
SUB_MEMBERS = 1
#: the row-keyed stream of the initial labels (:func:`flymc_dist.streams.stream_key`
#: purpose; the z-update's purposes are 1–4)
INIT_PURPOSE = 15


def logit_loglik(F: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``log σ(±wᵀf)`` of rows ``F`` (with their bias column) and labels ``y`` in {0, 1};
    ``w`` may be ``(P,)`` or ``(K, P)`` (then ``(K, n)``)."""
    eta = np.asarray(w, float) @ np.asarray(F, float).T
    return -np.logaddexp(0.0, -(2.0 * np.asarray(y, float) - 1.0) * eta)


class MemberArray:
    """The rows of one cluster on one shard: an array with O(1) insert and remove (the
    last member fills a removed one's place) and uniform draws without replacement (a
    partial Fisher–Yates shuffle of the array itself, restarted by :meth:`restart`; a
    draw of every member left takes them as they stand)."""

    __slots__ = ("count", "rows", "taken")

    def __init__(self) -> None:
        self.rows = np.empty(8, dtype=np.int64)
        self.count = 0
        self.taken = 0

    def insert(self, row: int, pos: np.ndarray) -> None:
        """Add local ``row``; ``pos[row]`` becomes its place."""
        if self.count == self.rows.size:
            self.rows = np.concatenate([self.rows, np.empty_like(self.rows)])
        self.rows[self.count] = row
        pos[row] = self.count
        self.count += 1

    def remove(self, row: int, pos: np.ndarray) -> None:
        """Remove local ``row`` (its place is ``pos[row]``)."""
        i = int(pos[row])
        last = self.rows[self.count - 1]
        self.rows[i] = last
        pos[last] = i
        self.count -= 1

    def restart(self) -> None:
        """A new decision: every member unseen again."""
        self.taken = 0

    def draw(self, rng: np.random.Generator, m: int, pos: np.ndarray) -> np.ndarray:
        """``m`` members not yet drawn since :meth:`restart`, uniformly without replacement."""
        if self.taken + m > self.count:
            raise ValueError(f"cannot draw {m} of {self.count - self.taken} unseen members")
        t = self.taken
        if t + m == self.count:  # every member left: their order does not matter
            self.taken = self.count
            return self.rows[t : self.count].copy()
        picks = rng.integers(np.arange(t, t + m), self.count) if m else np.empty(0, np.int64)
        rows = self.rows
        for j, r in enumerate(picks):
            a, b = rows[t + j], rows[r]
            rows[t + j], rows[r] = b, a
            pos[b], pos[a] = t + j, r
        self.taken = t + m
        return rows[t : t + m].copy()


class DPMShard:
    """One contiguous row range ``[start, start + n)``: the rows (density columns and the
    logistic features with their bias), and per chain the labels and member arrays.

    Parameters
    ----------
    shard_id, start
        The shard's id (its member-draw stream) and first global row.
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
        self.pos = np.zeros((chains, self.n), dtype=np.int64)
        self.members: list[dict[int, MemberArray]] = [{} for _ in range(chains)]
        self.rngs = [
            stream(seed, ROLE_JOINTDPM, SUB_MEMBERS, self.shard_id, c) for c in range(chains)
        ]
        #: likelihood evaluations (one row at one w) made for austerity decisions
        self.queries = 0

    def init_labels(self, chain: int, n_clusters: int) -> dict[int, tuple[int, Any, Any]]:
        """Give every row a label in ``0 .. n_clusters − 1`` from its own row-keyed uniform
        (the same labels whatever the layout); return each label's ``(n, Σx, Σxxᵀ)``."""
        key = stream_key(self.seed, 0, chain, ROLE_JOINTDPM, INIT_PURPOSE)
        u = uniforms_range(key, self.start, self.n)
        z = np.minimum((u * n_clusters).astype(np.int64), n_clusters - 1)
        self.z[chain] = z
        self.members[chain] = {}
        for r in range(self.n):
            self.members[chain].setdefault(int(z[r]), MemberArray()).insert(r, self.pos[chain])
        out = {}
        for k in sorted(self.members[chain]):
            xs = self.Xd[z == k]
            out[k] = (int(xs.shape[0]), xs.sum(axis=0), xs.T @ xs)
        return out

    def rows(self, chain: int, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The density columns, logistic features (with bias) and labels of ``local`` rows,
        and their current cluster labels: ``(Xd, F, y, z)``."""
        local = np.asarray(local, dtype=np.int64)
        return self.Xd[local], self.F[local], self.y[local], self.z[chain, local].copy()

    def move(self, chain: int, local: np.ndarray, labels: np.ndarray) -> None:
        """Give ``local`` rows their new ``labels``, in order (member arrays follow)."""
        z, pos, members = self.z[chain], self.pos[chain], self.members[chain]
        for r, k in zip(np.asarray(local).tolist(), np.asarray(labels).tolist(), strict=True):
            old = int(z[r])
            if old == k:
                continue
            arr = members[old]
            arr.remove(r, pos)
            if arr.count == 0:
                del members[old]
            members.setdefault(k, MemberArray()).insert(r, pos)
            z[r] = k

    def counts(self, chain: int) -> dict[int, int]:
        """Each label's member count here."""
        return {k: a.count for k, a in sorted(self.members[chain].items())}

    def batch(self, chain: int, requests: list[tuple]) -> list[tuple[int, float, float, Any]]:
        """For each request ``(label, new_decision, m, w, w_prop, record)``: draw ``m`` of
        the cluster's unseen members here and return ``(m, mean, M2, rows)`` of their
        ``l_i = log L_i(w_prop) − log L_i(w)`` (``rows``: their global indices when
        ``record``, else None)."""
        out = []
        pos = self.pos[chain]
        for label, new, m, w, w_prop, record in requests:
            arr = self.members[chain][int(label)]
            if new:
                arr.restart()
            rows = arr.draw(self.rngs[chain], int(m), pos)
            F, y = self.F[rows], self.y[rows]
            ll = logit_loglik(F, y, np.stack([np.asarray(w_prop, float), np.asarray(w, float)]))
            diff = ll[0] - ll[1]
            self.queries += 2 * int(m)
            mean = float(diff.mean()) if m else 0.0
            m2 = float(np.sum((diff - mean) ** 2)) if m else 0.0
            out.append((int(m), mean, m2, rows + self.start if record else None))
        return out

    def z_of(self, chain: int) -> np.ndarray:
        """Every row's label (tests and checkpoints: a full copy)."""
        return self.z[chain].copy()
