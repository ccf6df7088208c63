"""Sums over all rows that do not depend on how the rows are cut into shards.

A full pass (the MAP search's log-likelihood, the collapsed bound's statistics, the
exact rows' column energies, the expected bright count) sums a value per row. In
floating point the result depends on the order of the additions, so summing each
shard's total would make every run's set-up — and so its draws — depend on the layout
in the last bits. Instead the rows are cut into fixed *blocks* (a store's chunks; for
arrays in memory, :func:`block_rows` rows), which shards never split, and the blocks'
sums are added along one fixed binary tree over the block indices: node ``(l, i)`` sums
the blocks ``[i·2**l, (i+1)·2**l)`` as node ``(l-1, 2i)`` + node ``(l-1, 2i+1)`` (or the
left child alone where the right one lies past the last block). A shard adds up every
node whose blocks it holds all of and returns the nodes it could not complete
(:func:`tree_nodes`, O(log blocks) of them); the driver completes the tree
(:func:`tree_total`). Every node is then the same sum, taken in the same order, whatever
the layout: the totals are bit-identical for any partition into whole blocks.

Values are anything with an elementwise ``+`` (floats, numpy arrays,
:class:`~flymc_dist.models.base.BoundStats`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

#: ``(level, index, value)``: the sum of the blocks ``[index·2**level, (index+1)·2**level)``
Node = tuple[int, int, Any]


class BlockSums(NamedTuple):
    """A shard's part of a full pass's sum: the tree's nodes it completed
    (:func:`tree_nodes`), and how many blocks the whole data set has."""

    n_blocks: int
    nodes: list[Node]


def block_rows(n_rows: int) -> int:
    """The rows of a block of an in-memory data set of ``n_rows`` rows: a power of two
    between 64 and 4096 giving at most about 256 blocks (a function of N alone, so the
    blocks — and the sums — are the same for every layout)."""
    b = 64
    while b < 4096 and b * 256 < n_rows:
        b *= 2
    return b


def _merge(nodes: dict[tuple[int, int], Any], n_blocks: int) -> dict[tuple[int, int], Any]:
    """Combine the nodes bottom-up while a node's children are all present."""
    level = 0
    while True:
        at = sorted(i for (lv, i) in nodes if lv == level)
        if not at and not any(lv > level for lv, _ in nodes):
            return nodes
        width = -(-n_blocks // (1 << level))  # nodes at this level
        if width <= 1:
            return nodes
        done = set()
        for i in at:
            if i in done:
                continue
            parent = i // 2
            left, right = (level, 2 * parent), (level, 2 * parent + 1)
            has_right = 2 * parent + 1 < width
            if left in nodes and (not has_right or right in nodes):
                value = nodes.pop(left)
                if has_right:
                    value = value + nodes.pop(right)
                nodes[(level + 1, parent)] = value
                done.update({2 * parent, 2 * parent + 1})
        level += 1


class BlockFold:
    """A shard's blocks' values folded into the tree as they come (:meth:`append`), each
    node combined as soon as its children are both there: blocks given in increasing
    order leave O(log blocks) values held, not one per block (a full pass's values at
    10⁸ rows, 57 features and order-2 sums: 26 KB each, 36 MB per worker). The nodes
    are the sums :func:`_merge` takes, the same bits."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = int(n_blocks)
        self._nodes: dict[tuple[int, int], Any] = {}

    def append(self, item: tuple[int, Any]) -> None:
        """Add block ``item[0]``'s value ``item[1]`` (a list's ``append``, for callers
        that collect ``(block, value)`` pairs)."""
        b, value = item
        level, i = 0, int(b)
        nodes = self._nodes
        while True:
            width = -(-self.n_blocks // (1 << level))  # nodes at this level
            if width <= 1:
                break
            parent = i // 2
            left, right = 2 * parent, 2 * parent + 1
            if right >= width:  # a left child alone: its parent is the same sum
                if i != left:
                    break
            elif i == left:
                if (level, right) not in nodes:
                    break
                value = value + nodes.pop((level, right))
            else:
                if (level, left) not in nodes:
                    break
                value = nodes.pop((level, left)) + value
            level, i = level + 1, parent
        nodes[(level, i)] = value

    def __len__(self) -> int:
        """The values held now."""
        return len(self._nodes)

    def sums(self) -> BlockSums:
        """The nodes completed, and those left (see :func:`tree_nodes`)."""
        merged = _merge(dict(self._nodes), self.n_blocks)
        return BlockSums(self.n_blocks, [(lv, i, v) for (lv, i), v in sorted(merged.items())])


def tree_nodes(blocks: Iterable[tuple[int, Any]], n_blocks: int) -> BlockSums:
    """A shard's part of the tree: its blocks' values ``(block index, value)`` combined
    into every node they complete; the nodes left, as ``(level, index, value)``. The
    blocks are folded in as they come (:class:`BlockFold`)."""
    fold = BlockFold(n_blocks)
    for item in blocks:
        fold.append(item)
    return fold.sums()


def tree_total(parts: list[BlockSums]) -> Any:
    """The root of the tree from every shard's :func:`tree_nodes` (all blocks covered
    exactly once)."""
    n_blocks = parts[0].n_blocks
    nodes: dict[tuple[int, int], Any] = {}
    for part in parts:
        if part.n_blocks != n_blocks:
            raise ValueError("the shards disagree on the number of blocks")
        for lv, i, v in part.nodes:
            if (lv, i) in nodes:
                raise ValueError(f"block tree node {(lv, i)} given twice")
            nodes[(lv, i)] = v
    nodes = _merge(nodes, n_blocks)
    root = (max(0, (n_blocks - 1).bit_length()), 0)
    if len(nodes) != 1 or root not in nodes:
        raise ValueError(f"the shards' blocks do not cover the {n_blocks} blocks once")
    return nodes[root]


def fold_blocks(values: np.ndarray, first: int, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`tree_nodes` of consecutive blocks, vectorised: ``values[j]`` is block
    ``first + j``'s value (any trailing shape), every block of the shard present.

    Returns
    -------
    nodes, sums
        ``(n, 3)`` int64 rows ``(level, index, n_blocks)`` of the nodes completed (and
        left for the driver), and ``(n, ...)`` their values: the same sums, taken in the
        same order, as :func:`tree_nodes` of the same blocks (O(log blocks) numpy
        additions, whatever the number of blocks).
    """
    vals = np.asarray(values)
    lo, hi = int(first), int(first) + vals.shape[0]
    if not 0 <= lo < hi <= n_blocks:
        raise ValueError(f"blocks [{lo}, {hi}) are not within the {n_blocks} blocks")
    level = 0
    nodes: list[tuple[int, int]] = []
    out: list[np.ndarray] = []
    while True:
        width = -(-n_blocks // (1 << level))  # nodes at this level
        if width <= 1:
            break
        if lo % 2:  # its left sibling lies in another shard
            nodes.append((level, lo))
            out.append(vals[0])
            vals, lo = vals[1:], lo + 1
        if hi % 2 and hi != width:  # its right sibling lies in another shard
            nodes.append((level, hi - 1))
            out.append(vals[-1])
            vals, hi = vals[:-1], hi - 1
        if lo >= hi:
            break
        pairs = (hi - lo) // 2
        parents = vals[0 : 2 * pairs : 2] + vals[1 : 2 * pairs : 2]
        if (hi - lo) % 2:  # the last block's node alone: its parent is the same sum
            parents = np.concatenate([parents, vals[-1:]])
        vals, lo, hi, level = parents, lo // 2, -(-hi // 2), level + 1
    nodes += [(level, lo + j) for j in range(hi - lo)]
    out += list(vals[: hi - lo])
    table = np.array([(lv, i, n_blocks) for lv, i in nodes], dtype=np.int64).reshape(-1, 3)
    return table, np.stack(out)


def merge_nodes(table: np.ndarray, sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Combine block-tree nodes whose children are all present (:func:`_merge`): the
    nodes of several parts (shards, or relays' partial sums) stacked, rows ``(level,
    index, n_blocks)`` of ``table`` with their values ``sums[j]`` (any trailing shape,
    every node's values side by side in one row: one numpy addition per node merged).

    Every node made is its left child's value plus its right one's (or its left child's
    alone where the right one lies past the last block), so merging partial sums first
    (on a relay) and the rest later gives the same bits as merging every shard's nodes
    at once, in whatever grouping.

    Returns
    -------
    table, sums
        The nodes left (every node whose sibling is missing, and the highest ones),
        sorted by level and index.
    """
    rows = np.asarray(table, dtype=np.int64).reshape(-1, 3).tolist()
    if len(rows) != len(sums) or not rows:
        raise ValueError("merge_nodes needs one value per node, and a node at least")
    n_blocks = rows[0][2]
    nodes: dict[tuple[int, int], Any] = {}
    for j, (level, index, n) in enumerate(rows):
        if n != n_blocks:
            raise ValueError("the parts disagree on the number of blocks")
        if (level, index) in nodes:
            raise ValueError(f"block tree node {(level, index)} given twice")
        nodes[(level, index)] = sums[j]
    merged = _merge(nodes, n_blocks)
    keys = sorted(merged)
    out = np.array([(lv, i, n_blocks) for lv, i in keys], dtype=np.int64).reshape(-1, 3)
    return out, np.stack([merged[k] for k in keys])


def check_root(table: np.ndarray) -> None:
    """Raise ValueError unless ``table`` (merged nodes, :func:`merge_nodes`) is the tree's
    root alone: every block covered once."""
    n_blocks = int(table[0, 2])
    root = max(0, (n_blocks - 1).bit_length())
    if table.shape[0] != 1 or table[0, 0] != root or table[0, 1] != 0:
        raise ValueError(f"the shards' blocks do not cover the {n_blocks} blocks once")


def tree_total_arrays(parts: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The root of the tree from every part's ``(nodes, sums)`` (shards'
    :func:`fold_blocks`, or relays' :func:`merge_nodes`): all blocks covered once."""
    table, sums = merge_nodes(
        np.concatenate([t for t, _ in parts]), np.concatenate([v for _, v in parts])
    )
    check_root(table)
    return np.array(sums[0], copy=True)
