"""FlyMC's sampling iterations in replica mode, many in one compiled call (numba).

In replica mode with NUTS (the defaults) or random-walk MH an iteration is every chain's
implicit z-update on the driver's replica (its proposals read ahead,
:mod:`flymc_dist.ahead`), then every chain's θ-transition on its conditional
(:mod:`flymc_dist._compiled_kernels`). Each is compiled; called once per iteration
from Python, their calls, the arrays built around them and the statistics cost more than
the transitions themselves on a chain with a few bright rows. :func:`replica_steps` runs
the iterations of one read-ahead block in one call: the same compiled functions in the
same order on the same values, so the same draws bit for bit (the dark→bright test is
:func:`flymc_dist.brightness.brighten`'s, in its form here).

It returns to Python before an iteration whose values hold a NaN (the caller's guard
then names the row), after one that left more bright rows than the caller allows (the
replica's memory budget), and after one that ends the caller's time (so that progress is
shown and an interruption is taken within that time).
"""

from __future__ import annotations

import math
import time

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from flymc_dist._compiled import JIT, replica_z_apply, replica_z_propose
from flymc_dist._compiled_kernels import nuts_chains, rwmh_chains
from flymc_dist.streams import chain_keys

#: what :func:`replica_steps` says of how its call ended
DONE, NAN, OVER_BUDGET = 0, 1, 2

#: the θ-kernels :func:`replica_steps` runs
NUTS_KERNEL, RWMH_KERNEL = 0, 1
KERNELS = {"nuts": NUTS_KERNEL, "rwmh": RWMH_KERNEL}


#: the clock :func:`monotonic` reads: ``time.perf_counter``'s on Linux
CLOCK_ID = time.CLOCK_MONOTONIC


@intrinsic
def _clock_gettime(typingctx: object, clock: types.Type) -> tuple:
    """Seconds on the clock ``clock``, read by ``clock_gettime`` from compiled code
    (linked by name: the function stays cacheable); 0 if the clock cannot be read."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202 - numba's signature
        i64 = ir.IntType(64)
        spec = ir.LiteralStructType([i64, i64])
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), spec.as_pointer()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "clock_gettime")
        ts = cgutils.alloca_once(builder, spec)
        builder.store(ir.Constant(spec, [ir.Constant(i64, 0), ir.Constant(i64, 0)]), ts)
        builder.call(fn, [builder.trunc(args[0], ir.IntType(32)), ts])
        sec = builder.sitofp(builder.load(cgutils.gep(builder, ts, 0, 0)), ir.DoubleType())
        nsec = builder.sitofp(builder.load(cgutils.gep(builder, ts, 0, 1)), ir.DoubleType())
        return builder.fadd(sec, builder.fmul(nsec, ir.Constant(ir.DoubleType(), 1e-9)))

    return types.float64(clock), codegen


@numba.njit(**JIT)
def monotonic() -> float:
    """Seconds on :data:`CLOCK_ID`, from compiled code."""
    return _clock_gettime(CLOCK_ID)


@numba.njit(**JIT)
def replica_steps(
    n_steps: int,
    D: int,
    buf: np.ndarray,
    ids: np.ndarray,
    starts: np.ndarray,
    origin: np.ndarray,
    b_ids: np.ndarray,
    b_seg: np.ndarray,
    b_at: np.ndarray,
    rows_buf: np.ndarray,
    pair0: int,
    seed: np.uint64,
    generation: int,
    step0: int,
    purpose: int,
    log_q: float,
    kind: int,
    par: np.ndarray,
    kernel: int,
    rng_at: np.ndarray,
    thetas: np.ndarray,
    eps: np.ndarray,
    inv: np.ndarray,
    factor: np.ndarray,
    diag: bool,
    max_depth: int,
    threshold: float,
    S: np.ndarray,
    b: np.ndarray,
    c: float,
    prior_kind: int,
    prior_inv: float,
    prior_const: float,
    max_rows: int,
    max_seconds: float,
    positions: np.ndarray,
    floats: np.ndarray,
    ints: np.ndarray,
    clocks: np.ndarray,
) -> tuple:
    """Up to ``n_steps`` FlyMC iterations of every chain on the replica, from step
    ``step0`` of the z streams: each chain's implicit z-update
    (:func:`~flymc_dist._compiled.replica_z_propose`, the dark→bright test ``log(1 − u)
    < log L~ − log q``, :func:`~flymc_dist._compiled.replica_z_apply`), then each
    chain's θ-transition, chain after chain: NUTS's
    (:func:`~flymc_dist._compiled_kernels.nuts_chains`) or, ``kernel`` being
    ``KERNELS["rwmh"]``, random-walk MH's (:func:`~flymc_dist._compiled_kernels.rwmh_chains`,
    ``factor`` its preconditioners; ``inv``, ``max_depth`` and ``threshold`` unused).

    The replica: chain c's bright rows ``buf[starts[c]:starts[c+1]]`` (features and
    row constants), global ids ``ids``, and where each row's features, target and tight
    point are (``origin``: the caller's own rows below ``M0 = len(origin)`` at the call,
    the block's row ``k`` at ``M0 + k``). The block: the proposals of pair ``p = (step −
    first) · C + c`` at ``b_ids[b_seg[p]:b_seg[p+1]]`` (sorted), each at ``b_at`` in
    ``rows_buf``; this call's first step is pair ``pair0``'s. ``thetas`` (C, P) are the
    chains' positions (updated here), the NUTS inputs are
    :func:`~flymc_dist._compiled_kernels.nuts_chains`'.

    Iteration i writes every chain's new position into ``positions[i]``, its ``(log
    target, energy, acceptance statistic)`` into ``floats[i]`` and its ``(moved, leapfrog
    steps, evaluations, tree depth, divergent, bright rows, likelihood queries)`` into
    ``ints[i]``; ``clocks[0]`` gains the seconds of the transitions.
    It returns after the first iteration that ends ``max_seconds`` or more after the
    call began (its caller's progress and interruptions wait no longer).

    Returns
    -------
    done, status, buf, ids, starts, origin
        Iterations done, how the call ended (:data:`DONE`; :data:`NAN`: iteration
        ``done``'s z-update met a NaN and was not applied; :data:`OVER_BUDGET`:
        iteration ``done − 1`` left more than ``max_rows`` bright rows, ``max_rows < 0``
        never; :data:`DONE` too when ``max_seconds`` ran out) and the replica after the
        last iteration done.
    """
    C = thetas.shape[0]
    M0 = origin.size
    began = monotonic()
    keys = np.empty(C, dtype=np.uint64)
    queries = np.empty(C, dtype=np.int64)
    cand_seg = np.empty(C + 1, dtype=np.int64)
    for i in range(n_steps):
        chain_keys(seed, generation, step0 + i, purpose, keys)
        p = pair0 + i * C
        a0, a1 = b_seg[p], b_seg[p + C]
        p_seg = b_seg[p : p + C + 1] - a0
        M, n_prop = ids.size, a1 - a0
        b_vals = np.empty(M)
        gone = np.empty(M, dtype=np.bool_)
        cand = np.empty(n_prop, dtype=np.int64)
        cand_at = np.empty(n_prop, dtype=np.int64)
        cand_u = np.empty(n_prop)
        vals = np.empty(n_prop)
        nan = replica_z_propose(
            buf, ids, starts, D, thetas, keys, log_q, b_ids[a0:a1], p_seg, b_at[a0:a1],
            rows_buf, kind, par, b_vals, gone, cand, cand_seg, cand_at, cand_u, vals, queries,
        )  # fmt: skip
        if nan:
            return i, NAN, buf, ids, starts, origin
        n = cand_seg[C]
        acc = np.empty(n, dtype=np.bool_)
        m = M
        for j in range(n):  # brighten: log u < log L~ − log q, with log u = log(1 − u)
            acc[j] = math.log1p(-cand_u[j]) < vals[j] - log_q
            m += acc[j]
        for j in range(M):
            m -= gone[j]
        # the new bright rows, exactly m of them (written only if some set changed)
        new_buf = np.empty((m, buf.shape[1]))
        new_ids = np.empty(m, dtype=np.int64)
        new_src = np.empty(m, dtype=np.int64)
        new_starts = np.empty(C + 1, dtype=np.int64)
        w = replica_z_apply(
            buf, ids, starts, gone, cand, cand_seg, cand_at, acc, rows_buf, new_buf, new_ids,
            new_src, new_starts,
        )  # fmt: skip
        if w >= 0:  # some chain's bright set changed
            new_origin = np.empty(m, dtype=np.int64)
            for k in range(m):
                s = new_src[k]
                new_origin[k] = origin[s] if s < M else M0 + (s - M)
            buf, ids, starts, origin = new_buf, new_ids, new_starts, new_origin
        t1 = monotonic()
        if kernel == NUTS_KERNEL:
            nuts_chains(
                rng_at, thetas, eps, inv, factor, diag, max_depth, threshold, buf, starts,
                kind, par, S, b, c, prior_kind, prior_inv, prior_const, positions[i],
                floats[i], ints[i],
            )  # fmt: skip
        else:
            rwmh_chains(
                rng_at, thetas, eps, factor, diag, buf, starts, kind, par, S, b, c, prior_kind,
                prior_inv, prior_const, positions[i], floats[i], ints[i],
            )  # fmt: skip
        t2 = monotonic()
        clocks[0] += t2 - t1
        for ch in range(C):
            for d in range(thetas.shape[1]):  # not [:] = …: see nuts_transition
                thetas[ch, d] = positions[i, ch, d]
            n_rows = starts[ch + 1] - starts[ch]
            ints[i, ch, 5] = n_rows
            ints[i, ch, 6] = queries[ch] + ints[i, ch, 2] * n_rows
        if 0 <= max_rows < ids.size:
            return i + 1, OVER_BUDGET, buf, ids, starts, origin
        if t2 - began >= max_seconds:
            return i + 1, DONE, buf, ids, starts, origin
    return n_steps, DONE, buf, ids, starts, origin
