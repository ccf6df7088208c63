"""The compiled path of a round on arrays: the implicit z-update of many (shard, chain)
pairs at once, and a whole round batched over the shards of one host.

A FlyMC round is mostly scattered single-row work: the dark→bright proposals of every
chain, their ``log L~``, the new bright sets, the bright sums at the requested points.
Here each of those is one compiled loop (:mod:`flymc_dist._compiled`) over every pair
of a call, so a round over C chains — or over every shard of a host — costs little
more than one over a single chain. Random numbers are drawn in numpy from each chain's
own stream in a documented order, so the results do not depend on which pairs are
batched together: a shard alone (:meth:`~flymc_dist.shard.shard.Shard.round`) and a
host's fused pass (:func:`fused_round`) give the same replies, bit for bit.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from flymc_dist.brightness import bernoulli_rows, brighten, log_uniform, proposal_slots
from flymc_dist.protocol import ReplicaReply, Reply, Request

if TYPE_CHECKING:
    from flymc_dist.shard.shard import Shard


class _Spec(NamedTuple):
    """What undoes one chain's speculative z-update (see :meth:`Shard.speculate`)."""

    rng_state: dict
    idx: np.ndarray
    vals: np.ndarray
    gone_rows: np.ndarray  # rows it darkened
    new_rows: np.ndarray  # rows it brightened
    queries: int


def _typed_lists(shards: list[Shard], owner: Any = None) -> tuple[Any, Any]:
    """The shards' feature buffers and masks as numba typed lists (the kernels' form).

    Building them costs more than a round's update, so they are kept on ``owner``
    (its ``_typed``) and rebuilt only when the shards or their arrays change (masks are
    reallocated by :meth:`Shard.set_positions`). The kept tuple holds the shards, so
    the ids in its key stay theirs. Without an owner they are built afresh.
    """
    key = tuple((id(sh), id(sh._XC), id(sh._masks)) for sh in shards)
    if owner is not None and owner._typed is not None and owner._typed[0] == key:
        return owner._typed[2], owner._typed[3]
    jit = shards[0]._jit
    lists = (
        key,
        list(shards),
        jit.typed_list([sh._XC for sh in shards]),
        jit.typed_list([sh._masks for sh in shards]),
    )
    if owner is not None:
        owner._typed = lists
    return lists[2], lists[3]


def fused_z_update(
    pairs: list[tuple[Shard, int]],
    record: bool = False,
    owner: Any = None,
    window: tuple[int, int, float] | None = None,
) -> np.ndarray:
    """The implicit z-update of every (shard, chain) pair in ``pairs`` at once.

    The same moves as :func:`~flymc_dist.brightness.implicit_update` pair by pair
    (bright→dark accepted with ``min(1, q/L~)``, each dark row proposed with
    probability q and accepted with ``min(1, L~/q)``, by :func:`brighten`), in three
    compiled passes over all pairs (:mod:`flymc_dist._compiled`): proposals, their
    ``log L~``, and the update of the bright sets and masks. Each pair draws from its
    chain's stream on its shard — its darkening uniforms, then ``2K`` uniforms for its
    proposal gaps and their acceptance — so the draws do not depend on which pairs are
    updated together: one shard's chains (:meth:`Shard._update_z_fused`) or every
    shard of a host (:meth:`ShardHost.round`). The shards must share their model,
    features and ``q``.

    With ``record``, what is needed to undo each pair's update is kept in its shard's
    ``_spec`` (see :meth:`Shard.speculate`). ``owner`` keeps the typed lists of the
    shards' buffers and masks between calls (:func:`_typed_lists`; default: the shard,
    when the pairs are all on one).

    ``window = (lo, hi, q)``: an out-of-core shard's update of its rows ``lo:hi`` only
    (the chunk it holds; one shard, no ``record``), with proposal probability ``q``:
    the window's bright rows may go dark and its dark rows may propose, every other row
    keeps its z (see :class:`~flymc_dist.shard.shard.Shard`). The work then runs in the
    window's own row numbers, on its buffer and on its columns of the masks.

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
        if len(shards) > 1 or record:
            raise ValueError("a windowed z-update runs on one shard, without speculation")
        XCs, masks = (first._win.XC,), (first._masks[:, lo:hi],)
        ns = [hi - lo] * P
        inside = [(b.idx >= lo) & (b.idx < hi) for b in brights]
        idx_in = [b.idx[w] - lo for b, w in zip(brights, inside, strict=True)]
        vals_in = [b.vals[w] for b, w in zip(brights, inside, strict=True)]
    states = [ch.rng.bit_generator.state for ch in chains] if record else None
    bounds = [0]
    for r in idx_in:
        bounds.append(bounds[-1] + r.size)
    b_seg = np.array(bounds, dtype=np.int64)
    b_idx = np.concatenate(idx_in)
    b_vals = np.concatenate(vals_in)
    Ks = [proposal_slots(n, q) for n in ns]
    pair_n = np.array(ns, dtype=np.int64)
    pair_K = np.array(Ks, dtype=np.int64)
    pair_shard = np.array([where[id(sh)] for sh, _ in pairs], dtype=np.int64)
    pair_chain = np.array([c for _, c in pairs], dtype=np.int64)
    u_dark = np.empty(bounds[-1])
    u_prop = np.empty((P, 2 * max(Ks)))
    thetas = np.empty((P, first.n_params))
    for i, ch in enumerate(chains):
        ch.rng.random(out=u_dark[bounds[i] : bounds[i + 1]])
        ch.rng.random(out=u_prop[i, : 2 * Ks[i]])
        thetas[i] = ch.theta
    # dark -> bright proposals: rows at the partial sums of Geometric(q) gaps, the
    # bright ones skipped
    cap = sum(Ks)
    cand = np.empty(cap, dtype=np.int64)
    log_u = np.empty(cap)
    cand_seg = np.empty(P + 1, dtype=np.int64)
    last = np.empty(P, dtype=np.int64)
    short = jit.propose(
        u_prop,
        pair_K,
        math.log1p(-q) if q < 1.0 else -math.inf,
        pair_n,
        masks,
        pair_shard,
        pair_chain,
        cand,
        log_u,
        cand_seg,
        last,
    )
    m = int(cand_seg[P])
    cand, log_u = cand[:m], log_u[:m]
    if short:  # a pair's K gaps did not reach its last row (rare)
        cand, log_u = _refill(pairs, last, cand, log_u, cand_seg, ns, q, masks)
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
        if record:
            sh, c = pairs[i]
            sh._spec[c] = _Spec(
                states[i],
                b.idx,
                b.vals,
                gone[gone_seg[i] : gone_seg[i + 1]],
                new_idx[hi_i - added[i] : hi_i],
                int(counts[i]),
            )
        if window is None:
            b.idx, b.vals = new_idx[lo_i:hi_i], new_vals[lo_i:hi_i]
        else:  # the rows outside the window, then the window's
            out = ~inside[i]
            b.idx = np.concatenate([b.idx[out], new_idx[lo_i:hi_i] + lo])
            b.vals = np.concatenate([b.vals[out], new_vals[lo_i:hi_i]])
    return counts


def _refill(
    pairs: list[tuple[Shard, int]],
    last: np.ndarray,
    cand: np.ndarray,
    log_u: np.ndarray,
    cand_seg: np.ndarray,
    ns: list[int],
    q: float,
    masks: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Append to each pair whose gaps fell short (``last[i] >= 0``) its further dark
    proposals among its ``ns[i]`` rows — more gaps, then their uniforms, from its
    chain's stream — keeping candidates pair after pair; ``cand_seg`` is updated in
    place. ``masks`` as given to the compiled proposals (one per shard)."""
    bounds = cand_seg.tolist()
    shard_of: dict[int, int] = {}
    rows, logs = [], []
    for i, (sh, c) in enumerate(pairs):
        r_i, l_i = cand[bounds[i] : bounds[i + 1]], log_u[bounds[i] : bounds[i + 1]]
        if last[i] >= 0:
            rng, after = sh.chains[c].rng, int(last[i]) + 1
            r = bernoulli_rows(rng, ns[i] - after, q) + after
            lu = log_uniform(rng, r.size)
            dark = ~masks[shard_of.setdefault(id(sh), len(shard_of))][c, r]
            r_i, l_i = np.concatenate([r_i, r[dark]]), np.concatenate([l_i, lu[dark]])
        rows.append(r_i)
        logs.append(l_i)
        cand_seg[i + 1] = cand_seg[i] + r_i.size
    return np.concatenate(rows), np.concatenate(logs)


def fusable(shards: list[Shard], seq: Any, requests: list[Request | None], speculate: bool) -> bool:
    """Whether :func:`fused_round` applies to a round over ``shards``: FlyMC rounds with
    the compiled implicit z-update on two shards or more, in memory, without speculation
    or a replayed round — in replica mode whatever the kernel (each request is a chain's
    new θ), otherwise with gradient-free requests (RWMH's and the slice sampler's: any
    number of points per chain, or none)."""
    if len(shards) < 2 or speculate:
        return False
    replica = shards[0].replica
    if not all(
        sh.fused_z
        and sh.replica == replica
        and not sh.out_of_core
        and sh.chains
        and not sh._spec
        and (seq is None or sh._seq != seq)
        for sh in shards
    ):
        return False
    return replica or all(r is None or (not r.grad and not r.current_grad) for r in requests)


def fused_round(
    shards: list[Shard],
    seq: Any,
    commits: np.ndarray,
    update_z: bool,
    requests: list[Request | None],
    owner: Any,
) -> list[Reply] | list[ReplicaReply]:
    """:meth:`Shard.round <flymc_dist.shard.shard.Shard.round>` on every one of
    ``shards`` (where :func:`fusable`), its three steps each batched over them: every
    chain to its θ, one :func:`fused_z_update` of all (shard, chain) pairs, then the
    bright sums at the requested points and at the current θ in one compiled pass.

    With several shards per host a round's fixed cost (tens of small array operations
    per shard) would otherwise grow with the shards. Every shard's reply is the one its
    own ``round`` would give, bit for bit: the same draws from the same streams, and
    every sum taken over the same values in the same order. ``owner`` keeps the typed
    lists of the shards' buffers (:func:`_typed_lists`). Call it under the shards' locks
    and a ``np.errstate(over="ignore", divide="ignore")``.

    In replica mode (:func:`_fused_replica_round`) the steps are each chain to its new θ,
    shard by shard, the one fused z-update, and each shard's bright-set change.
    """
    if shards[0].replica:
        return _fused_replica_round(shards, seq, requests, owner)
    C = len(requests)
    jit = shards[0]._jit
    XCs, _ = _typed_lists(shards, owner)
    for sh in shards:
        sh._spec_pending = False  # a pending speculation is simply not made
        sh._commit_all(commits, update_z)
    pairs = [(sh, c) for sh in shards for c in range(C)]
    queries = (
        fused_z_update(pairs, owner=owner) if update_z else np.zeros(len(pairs), dtype=np.int64)
    )
    # the bright sums at each chain's points (k of them: k segments of its bright
    # rows, as Shard._fused_eval lays them out) and at its current θ, pair by pair
    ks = [0 if r is None else r.points.shape[0] for r in requests]
    kmax = max(ks, default=0)
    brights = [sh.chains[c].bright for sh, c in pairs]
    sizes = [b.idx.size for b in brights]
    row_parts, theta_parts, seg_bounds, seg_shard = [], [], [0], []
    for p, (_, c) in enumerate(pairs):
        k = ks[c]
        if k:
            idx = brights[p].idx
            row_parts.append(idx if k == 1 else np.tile(idx, k))
            theta_parts.append(requests[c].points)
            for _ in range(k):
                seg_bounds.append(seg_bounds[-1] + sizes[p])
                seg_shard.append(p // C)
    n_seg = len(seg_shard)
    vals = np.empty(seg_bounds[-1])
    sums = np.empty(n_seg)
    if n_seg:
        kind, par = shards[0]._kernel
        jit.eval_rows(
            XCs,
            shards[0].X.shape[1],
            np.concatenate(row_parts),
            np.array(seg_bounds, dtype=np.int64),
            np.array(seg_shard, dtype=np.int64),
            np.concatenate(theta_parts),
            kind,
            par,
            vals,
            sums,
        )
    cur_bounds = [0]
    for m in sizes:
        cur_bounds.append(cur_bounds[-1] + m)
    current = np.empty(len(pairs))
    jit.segment_sums(
        np.concatenate([b.vals for b in brights]), np.array(cur_bounds, dtype=np.int64), current
    )
    out = []
    off = j = 0
    for s_i, sh in enumerate(shards):
        lo = s_i * C
        points = np.empty((C, kmax))
        points.fill(np.nan)
        q_s = queries[lo : lo + C].copy()
        for c, ch in enumerate(sh.chains):
            k, M = ks[c], sizes[lo + c]
            if not k:
                continue
            ch.last_points = requests[c].points
            ch.last_vals = vals[off : off + k * M].reshape(k, M)
            ch.last_dvals = None
            points[c, :k] = sums[j : j + k]
            q_s[c] += k * M
            off += k * M
            j += k
        reply = Reply(
            current=current[lo : lo + C].copy(),
            points=points,
            n_bright=np.array(sizes[lo : lo + C], dtype=np.int64),
            queries=q_s,
            wasted=np.zeros(C, dtype=np.int64),
        )
        sh.total_queries += int(q_s.sum())
        sh._seq, sh._reply = seq, reply
        out.append(reply)
    return out


def _fused_replica_round(
    shards: list[Shard], seq: Any, requests: list[Request | None], owner: Any
) -> list[ReplicaReply]:
    """:func:`fused_round` in replica mode: every shard's chains to their new θ (with the
    ``log L~`` of their bright rows there), one :func:`fused_z_update` of all (shard,
    chain) pairs, then each shard's change of its bright sets
    (:meth:`Shard._bright_change`). Each shard touches only its own rows and streams, so
    its reply is the one its own ``round`` would give, bit for bit; what is saved is the
    z-update's fixed cost per shard (measured: 2M × 57 logistic, NUTS, 8 shards on 2
    workers — each host's round 0.68 ms shard by shard, 0.47 ms fused)."""
    C = len(requests)
    moved = [sh._move_to(requests) for sh in shards]
    pairs = [(sh, c) for sh in shards for c in range(C)]
    updated = fused_z_update(pairs, owner=owner)
    out = []
    for s_i, sh in enumerate(shards):
        queries = moved[s_i] + updated[s_i * C : (s_i + 1) * C]
        reply = sh._bright_change(queries)
        sh.total_queries += int(queries.sum())
        sh._seq, sh._reply = seq, reply
        sh._spec_pending = False
        out.append(reply)
    return out
