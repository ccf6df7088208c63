"""The compiled z-update on arrays: the implicit z-update of many (shard, chain) pairs at
once (every shard of a host, see :mod:`flymc_dist.shard.round`).

A FlyMC round is mostly scattered single-row work: the dark→bright proposals of every
chain, their ``log L~``, the new bright sets, the bright sums at the requested points.
Here each of those is one compiled loop (:mod:`flymc_dist._compiled`) over every pair
of a call, so a round over C chains — or over every shard of a host — costs little
more than one over a single chain. Every random number is keyed by its row
(:mod:`flymc_dist.streams`), so the results depend neither on which pairs are batched
together nor on how the rows are cut into shards.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from flymc_dist.brightness import brighten
from flymc_dist.streams import bernoulli_rows_many, uniforms_at_many

if TYPE_CHECKING:
    from flymc_dist.shard.shard import Shard


def _typed_lists(shards: list[Shard], owner: Any = None) -> tuple[Any, Any]:
    """The shards' feature buffers and masks as numba typed lists (the kernels' form).

    Building them costs more than a round's update, so they are kept on ``owner``
    (its ``_typed``) and rebuilt only when the shards or their arrays change (masks are
    reallocated by :meth:`Shard.set_positions`). The kept tuple holds the shards, so
    the ids in its key stay theirs — all but the owner itself, which outlives its own
    attribute: holding it there would be a reference cycle, keeping a finished run's
    rows in a worker's memory until the garbage collector ran. Without an owner they are
    built afresh.
    """
    key = tuple((id(sh), id(sh.rows.XC), id(sh._masks)) for sh in shards)
    if owner is not None and owner._typed is not None and owner._typed[0] == key:
        return owner._typed[2], owner._typed[3]
    jit = shards[0]._jit
    lists = (
        key,
        [sh for sh in shards if sh is not owner],
        jit.typed_list([sh.rows.XC for sh in shards]),
        jit.typed_list([sh._masks for sh in shards]),
    )
    if owner is not None:
        owner._typed = lists
    return lists[2], lists[3]


def fused_z_update(
    pairs: list[tuple[Shard, int]],
    owner: Any = None,
    window: tuple[int, int, float] | None = None,
) -> np.ndarray:
    """The implicit z-update of every (shard, chain) pair in ``pairs`` at once.

    The same moves as :func:`~flymc_dist.brightness.implicit_update` pair by pair
    (bright→dark accepted with ``min(1, q/L~)``, each dark row proposed with
    probability q and accepted with ``min(1, L~/q)``, by :func:`brighten`), in compiled
    passes over all pairs: proposals, their ``log L~``, and the update of the bright
    sets and masks. Every random number is its row's (:mod:`flymc_dist.streams`): the
    pair's chain's Bernoulli(q) process restricted to the shard's rows, and each row's
    uniform. So the draws depend neither on which pairs are updated together nor on how
    the rows are cut into shards. The shards must share their model, features and ``q``.

    ``owner`` keeps the typed lists of the shards' buffers and masks between calls
    (:func:`_typed_lists`; default: the shard, when the pairs are all on one).

    ``window = (lo, hi, q)``: an out-of-core shard's update of its rows ``lo:hi`` only
    (the chunk it holds; one shard), with proposal probability ``q``: the window's
    bright rows may go dark and its dark rows may propose, every other row keeps its z
    (see :class:`~flymc_dist.shard.shard.Shard`). The work then runs in the window's own
    row numbers, on its buffer and on its columns of the masks.

    Returns
    -------
    numpy.ndarray
        Likelihood queries of each pair.
    """
    P = len(pairs)
    if P == 0:
        return np.zeros(0, dtype=np.int64)
    first = pairs[0][0]
    jit = first._jit
    shards: list[Shard] = []
    where: dict[int, int] = {}
    for sh, _ in pairs:
        if id(sh) not in where:
            if sh.q_db != first.q_db:
                raise ValueError("a fused z-update needs one q_db for all its shards")
            where[id(sh)] = len(shards)
            shards.append(sh)
    chains = [sh.chains[c] for sh, c in pairs]
    brights = [ch.bright for ch in chains]
    if window is None:
        lo, q = 0, first.q_db
        XCs, masks = _typed_lists(shards, owner if owner is not None or len(shards) > 1 else first)
        ns = [sh.n for sh, _ in pairs]
        idx_in = [b.idx for b in brights]
        vals_in = [b.vals for b in brights]
    else:
        lo, hi, q = window
        if len(shards) > 1:
            raise ValueError("a windowed z-update runs on one shard")
        XCs, masks = (first.rows.window.XC,), (first._masks[:, lo:hi],)
        ns = [hi - lo] * P
        inside = [(b.idx >= lo) & (b.idx < hi) for b in brights]
        idx_in = [b.idx[w] - lo for b, w in zip(brights, inside, strict=True)]
        vals_in = [b.vals[w] for b, w in zip(brights, inside, strict=True)]
    streams = [sh._streams(c) for sh, c in pairs]
    keys_z = np.array([st.decide for st in streams], dtype=np.uint64)
    keys_p = np.array([st.propose for st in streams], dtype=np.uint64)
    # global row of each pair's local (window) row 0
    offsets = np.array([sh.spec.start + lo for sh, _ in pairs], dtype=np.int64)
    bounds = [0]
    for r in idx_in:
        bounds.append(bounds[-1] + r.size)
    b_seg = np.array(bounds, dtype=np.int64)
    b_idx = np.concatenate(idx_in)
    b_vals = np.concatenate(vals_in)
    u_dark = uniforms_at_many(keys_z, b_idx, b_seg, offsets)
    thetas = np.array([ch.theta for ch in chains])
    # dark -> bright proposals: the chain's process on the pair's rows, the bright skipped
    rows, seg = bernoulli_rows_many(
        keys_p, q, streams[0].n_total, offsets, offsets + np.array(ns, dtype=np.int64)
    )
    cand = np.empty(rows.size, dtype=np.int64)
    cand_seg = np.empty(P + 1, dtype=np.int64)
    pair_shard = np.array([where[id(sh)] for sh, _ in pairs], dtype=np.int64)
    pair_chain = np.array([c for _, c in pairs], dtype=np.int64)
    jit.dark_rows(masks, pair_shard, pair_chain, rows, seg, offsets, cand, cand_seg)
    cand = cand[: int(cand_seg[P])]
    log_u = np.log1p(-uniforms_at_many(keys_z, cand, cand_seg, offsets))
    counts = cand_seg[1:] - cand_seg[:-1]
    vals = np.empty(cand.size)
    kind, par = first._kernel
    jit.eval_rows(
        XCs, first.n_features, cand, cand_seg, pair_shard, thetas, kind, par, vals, np.empty(P)
    )
    acc = brighten(log_u, vals, q)
    new_idx = np.empty(b_idx.size + cand.size, dtype=np.int64)
    new_vals = np.empty(new_idx.size)
    new_seg = np.empty(P + 1, dtype=np.int64)
    gone = np.empty(b_idx.size, dtype=np.int64)
    gone_seg = np.empty(P + 1, dtype=np.int64)
    added = np.empty(P, dtype=np.int64)
    jit.apply(
        masks,
        pair_shard,
        pair_chain,
        b_idx,
        b_vals,
        b_seg,
        u_dark,
        math.log(q),
        cand,
        cand_seg,
        vals,
        acc,
        new_idx,
        new_vals,
        new_seg,
        gone,
        gone_seg,
        added,
    )
    new_bounds = new_seg.tolist()
    for i, b in enumerate(brights):
        lo_i, hi_i = new_bounds[i], new_bounds[i + 1]
        if window is None:
            b.idx, b.vals = new_idx[lo_i:hi_i], new_vals[lo_i:hi_i]
        else:  # the rows outside the window, then the window's
            out = ~inside[i]
            b.idx = np.concatenate([b.idx[out], new_idx[lo_i:hi_i] + lo])
            b.vals = np.concatenate([b.vals[out], new_vals[lo_i:hi_i]])
        chains[i].step += 1
    return counts
