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
from typing import Any

import numpy as np

from flymc_dist.brightness import brighten
from flymc_dist.shard.state import Shard, typed_lists
from flymc_dist.streams import uniforms_at_many
from flymc_dist.terms import check_bounds_held


def batched_z_update(pairs: list[tuple[Shard, int]], owner: Any = None) -> np.ndarray:
    """The implicit z-update of every (shard, chain) pair in ``pairs`` at once.

    The same moves as :func:`~flymc_dist.brightness.implicit_propose` and
    :func:`~flymc_dist.brightness.implicit_accept` pair by pair
    (bright→dark accepted with ``min(1, q/L~)``, each dark row proposed with
    probability q and accepted with ``min(1, L~/q)``, by :func:`brighten`), in compiled
    passes over all pairs: proposals, their ``log L~``, and the update of the bright
    sets. Every random number is its row's (:mod:`flymc_dist.streams`): the pair's
    chain's Bernoulli(q) process restricted to the shard's rows, and each row's uniform.
    So the draws depend neither on which pairs are updated together nor on how the rows
    are cut into shards. The shards must share their model, features and ``q``. An
    out-of-core shard's candidates are evaluated from the buffer its proposals were read
    into (``rows.proposals``; mostly read ahead already), so its update is this same one.

    ``owner`` keeps the typed list of the shards' buffers between calls
    (:func:`~flymc_dist.shard.state.typed_lists`; default: the shard, when the pairs are
    all on one).

    Returns
    -------
    numpy.ndarray
        Likelihood queries of each pair.
    """
    P = len(pairs)
    if P == 0:
        return np.zeros(0, dtype=np.int64)
    first = pairs[0][0]
    jit = first.jit
    shards, where = _shards_of(pairs)
    q = first.q_db
    chains = [sh.chains[c] for sh, c in pairs]
    brights = [ch.bright for ch in chains]
    streams = [sh.streams(c) for sh, c in pairs]
    keys_z = np.array([st.decide for st in streams], dtype=np.uint64)
    # global row of each pair's local row 0
    offsets = np.array([sh.spec.start for sh, _ in pairs], dtype=np.int64)
    b_seg = _bounds([b.idx.size for b in brights])
    b_idx = np.concatenate([b.idx for b in brights])
    b_vals = np.concatenate([b.vals for b in brights])
    members = np.concatenate([b.members for b in brights])
    u_dark = uniforms_at_many(keys_z, b_idx, b_seg, offsets)
    thetas = np.array([ch.theta for ch in chains])
    pair_shard = np.array([where[id(sh)] for sh, _ in pairs], dtype=np.int64)
    # dark -> bright proposals: the chain's process on the pair's rows, the bright skipped;
    # out of core evaluated from the buffer its shard read them into
    rows, seg, pos, bufs = _proposals(pairs, shards, where)
    cand = np.empty(rows.size, dtype=np.int64)
    at = np.empty(rows.size, dtype=np.int64)
    cand_seg = np.empty(P + 1, dtype=np.int64)
    jit.dark_rows(members, b_seg, rows, seg, pos, cand, cand_seg, at)
    n_cand = int(cand_seg[P])
    cand, at = cand[:n_cand], at[:n_cand]
    log_u = np.log1p(-uniforms_at_many(keys_z, cand, cand_seg, offsets))
    counts = cand_seg[1:] - cand_seg[:-1]
    ooc = [s_i for s_i, sh in enumerate(shards) if sh.out_of_core]
    typed_owner = owner if owner is not None or len(shards) > 1 else first
    XCs = tuple(bufs) if ooc else typed_lists(shards, typed_owner)  # ooc: built afresh
    vals = _candidate_values(shards, XCs, (cand, at, cand_seg), pair_shard, thetas, offsets)
    acc = brighten(log_u, vals, q)
    new_idx, new_vals, new_members, new_seg = _apply(
        jit, (b_idx, b_vals, b_seg, members), u_dark, q, (cand, cand_seg, vals, acc)
    )
    if ooc:  # out of core: the rows that turned bright become resident, from the buffer
        cand_shard = None if len(shards) == 1 else np.repeat(pair_shard, counts)
        for s_i in ooc:
            take = acc if cand_shard is None else acc & (cand_shard == s_i)
            shards[s_i].rows.admit(cand[take], at[take])
    new_bounds = new_seg.tolist()
    for i, b in enumerate(brights):
        lo, hi = new_bounds[i], new_bounds[i + 1]
        b.idx, b.vals, b.members = new_idx[lo:hi], new_vals[lo:hi], new_members[lo:hi]
        chains[i].step += 1
    for sh in shards:
        sh.after_z()
    return counts


def _shards_of(pairs: list[tuple[Shard, int]]) -> tuple[list[Shard], dict[int, int]]:
    """The distinct shards of ``pairs``, in order of first appearance, and where each
    is among them (by ``id``); refused unless they share one ``q_db``."""
    shards: list[Shard] = []
    where: dict[int, int] = {}
    for sh, _ in pairs:
        if id(sh) not in where:
            if sh.q_db != pairs[0][0].q_db:
                raise ValueError("a batched z-update needs one q_db for all its shards")
            where[id(sh)] = len(shards)
            shards.append(sh)
    return shards, where


def _apply(
    jit: Any,
    bright: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    u_dark: np.ndarray,
    q: float,
    decided: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every pair's new bright set, in one compiled pass: the bright rows (``bright``:
    rows, values, segments and sorted members) less those that went dark (each row's
    uniform ``u_dark`` against ``q / L~``), plus the candidates accepted (``decided``:
    rows, segments, values and whether each turned bright). Returns the new rows,
    values, sorted members and segments."""
    b_idx, b_vals, b_seg, members = bright
    cand, cand_seg, vals, acc = decided
    new_idx = np.empty(b_idx.size + cand.size, dtype=np.int64)
    new_vals = np.empty(new_idx.size)
    new_members = np.empty(new_idx.size, dtype=np.int64)
    new_seg = np.empty(b_seg.size, dtype=np.int64)
    jit.apply(
        b_idx, b_vals, b_seg, members, u_dark, math.log(q), cand, cand_seg, vals, acc,
        new_idx, new_vals, new_members, new_seg,
    )  # fmt: skip
    return new_idx, new_vals, new_members, new_seg


def _candidate_values(
    shards: list[Shard],
    XCs: Any,
    candidates: tuple[np.ndarray, np.ndarray, np.ndarray],
    pair_shard: np.ndarray,
    thetas: np.ndarray,
    offsets: np.ndarray,
) -> np.ndarray:
    """``log L~`` of every pair's candidates (``(cand, at, cand_seg)``: their
    shard-local rows, where each sits in its shard's buffer of ``XCs``, and each pair's
    segment) at the pair's θ, in one compiled pass, under the bound guard
    (:func:`~flymc_dist.terms.check_bounds_held`)."""
    first = shards[0]
    cand, at, cand_seg = candidates
    vals = np.empty(cand.size)
    kind, par = first.kernel
    first.jit.eval_rows(
        XCs,
        first.n_features,
        at,
        cand_seg,
        pair_shard,
        thetas,
        kind,
        par,
        vals,
        np.empty(pair_shard.size),
    )
    check_bounds_held(
        vals,
        cand_seg,
        thetas,
        lambda j: int(cand[j] + offsets[np.searchsorted(cand_seg, j, side="right") - 1]),
        first.model,
    )
    return vals


def _proposals(
    pairs: list[tuple[Shard, int]], shards: list[Shard], where: dict[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """Every pair's proposed shard-local rows — its chain's Bernoulli(q) process on its
    shard's rows at the chain's step, drawn ahead between rounds where it could be
    (:meth:`Shard.drawn`) — with their segments (pair after pair), where each sits in
    its shard's buffer (empty when every shard is in memory: at its own row), and each
    shard's buffer (in memory its rows; out of core the rows read for its proposals)."""
    drawn = [sh.drawn()[0] for sh in shards]
    held = [sh.rows.proposals(key, rows) for sh, (key, rows, _) in zip(shards, drawn, strict=True)]
    bufs = [buf for buf, _ in held]
    ooc = any(pos is not None for _, pos in held)
    if len(shards) == 1 and pairs == [(shards[0], c) for c in range(len(shards[0].chains))]:
        _, rows, seg = drawn[0]  # a round's layout on one shard: its chains in order
        return rows, seg, held[0][1] if ooc else _AT_OWN_ROW, bufs
    parts, where_at = [], []
    for sh, c in pairs:
        s_i = where[id(sh)]
        _, r, sg = drawn[s_i]
        lo, hi = sg[c], sg[c + 1]
        parts.append(r[lo:hi])
        if ooc:
            pos = held[s_i][1]
            where_at.append(r[lo:hi] if pos is None else pos[lo:hi])
    rows = np.concatenate(parts)
    seg = _bounds([r.size for r in parts])
    return rows, seg, np.concatenate(where_at) if ooc else _AT_OWN_ROW, bufs


#: no positions in a buffer: every proposal is evaluated at its own row (in memory)
_AT_OWN_ROW = np.empty(0, dtype=np.int64)


def _bounds(sizes: list[int]) -> np.ndarray:
    """Segment bounds ``[0, s0, s0 + s1, …]`` of consecutive parts of ``sizes``."""
    out = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    return out
