"""A round on the worker side, written once: :func:`round_shards` over the shards one
host holds (in-process, a single shard, or every shard of a Dask worker).

A round is the Gibbs composite of FlyMC read in one function (numpyro's
``HMCECS.sample`` has the same shape), in three steps over every (shard, chain) pair:

1. **each chain to its θ**: commit the previous decision (a :class:`Round`'s
   ``commits[c]``, the row of chain ``c``'s last evaluated points that became current,
   or -1); in replica mode (a :class:`ReplicaRound`) the chain's new θ is sent;
2. **z at that θ** (FlyMC, when ``update_z``; always in replica mode): one compiled
   implicit update of every pair where the model has a compiled ``log L~`` and no
   gradients are kept (:func:`~flymc_dist.shard.batched.batched_z_update`), shard by shard
   otherwise (explicit updates, gradients);
3. **the answer**: the sums at each chain's current θ and requested points over its
   bright rows (FlyMC) or all rows (regular), compiled over every pair where it can be;
   in replica mode, the change of each chain's bright set.

Every random number is keyed by its row (:mod:`flymc_dist.streams`), so how the rows
are cut into shards and which shards share a host change nothing but the cost.
Idempotent in ``seq``: a shard whose last round had this ``seq`` answers with its cached
reply (fault recovery replays a round without re-applying it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flymc_dist.protocol import ReplicaReply, ReplicaRound, Reply, Request, Round
from flymc_dist.shard.batched import batched_z_update
from flymc_dist.shard.state import Shard, typed_lists
from flymc_dist.terms import check_bounds_held


def round_shards(
    shards: list[Shard], msg: Round | ReplicaRound, owner: Any = None
) -> list[Reply | ReplicaReply]:
    """One round on every one of ``shards`` (see the module notes): their replies, in
    order. ``owner`` keeps the typed lists of the shards' buffers between rounds (their
    :class:`~flymc_dist.shard.group.ShardGroup`; default: built afresh or on the shard)."""
    replica = isinstance(msg, ReplicaRound)
    if any(sh.replica != replica for sh in shards):
        raise ValueError(
            f"a {type(msg).__name__} for shards "
            f"{'not ' if replica else ''}in replica mode (Shard.set_replica)"
        )
    seq = msg.seq
    todo = [sh for sh in shards if seq is None or sh.round_seq != seq]
    C = msg.thetas.shape[0] if replica else len(msg.requests)
    queries = {id(sh): np.zeros(C, dtype=np.int64) for sh in todo}
    # one errstate for the whole round (the compiled log L~ relies on it; entering one per
    # evaluation would cost as much as the evaluation itself)
    with np.errstate(over="ignore", divide="ignore"):
        for sh in todo:  # what the last round left (when nothing ran it after its reply)
            sh.settle()
        for sh in todo:  # 1. each chain to its θ
            if replica:
                queries[id(sh)] += sh.move_to(msg.thetas)
            else:
                sh.commit_all(msg.commits)
        live = [sh for sh in todo if replica or (sh.flymc and msg.update_z)]
        for sh, q in zip(live, update_z(live, owner), strict=True):  # 2. z at θ
            queries[id(sh)] += q
        # 3. the answer
        requests = [] if replica else msg.requests
        compiled = [sh for sh in todo if not replica and _compiled_sums(sh, requests)]
        replies = _bright_sums(compiled, requests, queries, owner) if compiled else {}
        for sh in todo:
            q_s = queries[id(sh)]
            if replica:
                replies[id(sh)] = sh.bright_change(q_s)
            elif id(sh) not in replies:
                replies[id(sh)] = sh.round_sums(requests, q_s)
            sh.total_queries += int(replies[id(sh)].queries.sum())
            sh.round_seq, sh.round_reply = seq, replies[id(sh)]
    return [sh.round_reply for sh in shards]


def update_z(shards: list[Shard], owner: Any = None) -> list[np.ndarray]:
    """Every chain's z-update on each of ``shards`` at its current θ (step 2 of a round):
    one compiled implicit update of every (shard, chain) pair where the model has a
    compiled ``log L~`` and no gradients are kept (:func:`batched_z_update`), shard by
    shard otherwise (:meth:`~flymc_dist.shard.state.Shard.update_z_each`). ``owner`` as
    in :func:`round_shards`. Returns each shard's likelihood queries, per chain."""
    out = {id(sh): np.zeros(len(sh.chains), dtype=np.int64) for sh in shards}
    batched = [sh for sh in shards if sh.batched_z]
    if batched:
        pairs = [(sh, c) for sh in batched for c in range(len(sh.chains))]
        q = batched_z_update(pairs, owner=owner if len(batched) > 1 else None)
        at = 0
        for sh in batched:
            out[id(sh)] += q[at : at + len(sh.chains)]
            at += len(sh.chains)
    for sh in shards:
        if not sh.batched_z:
            out[id(sh)] += sh.update_z_each()
    return [out[id(sh)] for sh in shards]


def _compiled_sums(sh: Shard, requests: list[Request | None]) -> bool:
    """Whether the shard's bright sums run compiled: FlyMC with a compiled ``log L~``,
    and no gradient asked for."""
    return (
        sh.flymc
        and sh.kernel is not None
        and all(r is None or (not r.grad and not r.current_grad) for r in requests)
    )


def _bright_sums(
    shards: list[Shard],
    requests: list[Request | None],
    queries: dict[int, np.ndarray],
    owner: Any,
) -> dict[int, Reply]:
    """Step 3 for FlyMC shards with a compiled ``log L~`` and no gradients: the bright
    sums at each chain's points (k of them: k segments of its bright rows) and at its
    current θ, for every (shard, chain) pair in one compiled pass each. Returns each
    shard's reply, by ``id``; keeps each chain's values at its points for the commit."""
    C = len(requests)
    jit = shards[0].jit
    XCs = typed_lists(shards, owner if len(shards) > 1 else shards[0])
    pairs = [(sh, c) for sh in shards for c in range(C)]
    ks = [0 if r is None else r.points.shape[0] for r in requests]
    kmax = max(ks, default=0)
    brights = [sh.chains[c].bright for sh, c in pairs]
    sizes = [b.idx.size for b in brights]
    row_parts, theta_parts, seg_bounds, seg_shard, seg_pair = [], [], [0], [], []
    for p, (_, c) in enumerate(pairs):
        k = ks[c]
        if k:
            at = pairs[p][0].rows.locate(brights[p].idx)  # where they sit in the buffer
            row_parts.append(at if k == 1 else np.tile(at, k))
            theta_parts.append(requests[c].points)
            for _ in range(k):
                seg_bounds.append(seg_bounds[-1] + sizes[p])
                seg_shard.append(p // C)
                seg_pair.append(p)
    n_seg = len(seg_shard)
    vals = np.empty(seg_bounds[-1])
    sums = np.empty(n_seg)
    if n_seg:
        kind, par = shards[0].kernel
        rows, thetas = np.concatenate(row_parts), np.concatenate(theta_parts)
        seg, seg_of = np.array(seg_bounds, dtype=np.int64), np.array(seg_shard, dtype=np.int64)
        jit.eval_rows(XCs, shards[0].n_features, rows, seg, seg_of, thetas, kind, par, vals, sums)
        bounds = np.array(seg_bounds, dtype=np.int64)

        def row_of(j: int) -> int:
            i = int(np.searchsorted(bounds, j, side="right")) - 1
            p = seg_pair[i]
            return int(brights[p].idx[j - bounds[i]] + pairs[p][0].spec.start)

        check_bounds_held(vals, bounds, thetas, row_of, shards[0].model)
    out: dict[int, Reply] = {}
    off = 0
    for s_i, sh in enumerate(shards):
        lo = s_i * C
        nb = sh.tree_blocks()[2]
        current = np.zeros((nb, C))  # the sums per block, folded by tree_reply
        points = np.zeros((nb, C, kmax))
        q_s = queries[id(sh)]
        for c, ch in enumerate(sh.chains):
            k, M = ks[c], sizes[lo + c]
            points[:, c, k:] = np.nan
            order, blocks, starts = sh.block_groups(brights[lo + c].idx)
            if M:
                current[blocks, c] = np.add.reduceat(brights[lo + c].vals[order], starts)
            if not k:
                continue
            ch.last_points = requests[c].points
            ch.last_vals = vals[off : off + k * M].reshape(k, M)
            ch.last_dvals = None
            if M:
                points[blocks, c, :k] = np.add.reduceat(ch.last_vals[:, order], starts, axis=1).T
            q_s[c] += k * M
            off += k * M
        out[id(sh)] = sh.tree_reply(
            current, points, np.array(sizes[lo : lo + C], dtype=np.int64), q_s
        )
    return out
