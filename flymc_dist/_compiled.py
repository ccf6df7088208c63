"""Compiled (numba) kernels of a shard's hot path: FlyMC's implicit z-update and bright sums.

What remains of a FlyMC round once the data are sharded is a few hundred scattered
rows per chain — the dark→bright proposals and the bright rows — each a dot product
and a handful of transcendental functions. In numpy that work is dominated by the
cost of launching array operations (tens per round, a few microseconds each), not by
the arithmetic; here each phase is one compiled loop.

The kernels implement ``log L~_n = log expm1(ℓ_n − β_n)`` of one row from its linear
predictor and the model's row constants (its label and bound coefficients, see
:meth:`~flymc_dist.models.base.Model.row_constants`) for the models that provide a
compiled form (:meth:`~flymc_dist.models.base.Model.compiled_bright`), with the
operations of the models' numpy ``loglik`` and ``logbound``; the results agree with
``log_expm1(loglik − logbound)`` to rounding (the libm and numpy's vectorised
``exp``/``log`` may differ in the last bit; ``tests/test_batched_z.py`` bounds the
difference), and every transport runs these same kernels, so draws are identical
in-process and on any number of workers.

Random numbers are never drawn here: they come from the rows' own streams
(:mod:`flymc_dist.streams`) and are passed in.

**Why the models' compiled forms sit behind a** ``kind`` **switch here,** rather than each
model registering its own jitted row function with kernels that take it as an argument:
numba compiles a kernel that receives a jitted function (or closes over one) afresh in
every process. Measured with numba's own counters: a second process has no cache hit
for such a kernel (every call signature compiles again, about a second each), so every
worker would pay that compilation at each start, and again after each recovery. With
the switch every kernel here is compiled once and cached on disk. The GLM families
(:mod:`flymc_dist.models.families`) whose bound follows from a fixed curvature share one kind,
``"glm"``: each is a branch of :func:`_glm_core` (its ``f``, ``f'`` and curvature bound),
chosen by ``par[0]``, and the bound is derived from them in one place. A family with its
own closed-form bound (a tighter, ξ-dependent curvature: the logistic family's
Jaakkola–Jordan bound, the Student-t family's tangent in ``r²``) has its own kind id in
:data:`KINDS` and branch in :func:`_bright_and_slope` (the operations of its numpy
``core`` and ``bound``; :func:`_log_bright` takes its value), named by its
:meth:`~flymc_dist.models.families.Family.compiled`; its ``row_constants`` are the
``(c0, c1, c2)`` that branch reads.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba.typed import List

from flymc_dist.streams import uniform_at

#: compiled kinds of :meth:`Model.compiled_bright` (the families' :meth:`Family.compiled`)
LOGISTIC = 0
ROBUST = 1
GLM = 2
KINDS = {"logistic": LOGISTIC, "robust": ROBUST, "glm": GLM}

#: the flags of every compiled kernel of the package's hot path (cached on disk, the GIL
#: released, numpy's error model)
JIT = {"cache": True, "nogil": True, "error_model": "numpy"}
_LOG_2PI = math.log(2.0 * math.pi)
#: a bound above its likelihood by more than this, relative to their size, is broken (a
#: wrong curvature), not rounding: its log L~ is NaN, which the callers' guard
#: (:func:`flymc_dist.terms.check_bounds_held`) turns into an error naming row and θ
BOUND_TOLERANCE = 1e-9


@numba.njit(inline="always", **JIT)
def _log_expm1(delta: float) -> float:
    """``log(exp(delta) - 1)`` of ``max(delta, 0)``, as :func:`flymc_dist._numerics.log_expm1`."""
    d = max(delta, 0.0)
    return d + math.log(-math.expm1(-d))


@numba.njit(inline="always", **JIT)
def _softplus(x: float) -> float:
    """``log(1 + e^x)``, as :mod:`flymc_dist.models.families`."""
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


@numba.njit(inline="always", **JIT)
def _sigmoid(x: float) -> float:
    e = math.exp(-abs(x))
    return (1.0 if x >= 0.0 else e) / (1.0 + e)


@numba.njit(inline="always", **JIT)
def _log_ndtr(x: float) -> float:
    """``log Φ(x)``, as :func:`flymc_dist.models.families.log_ndtr`."""
    if x > 0.0:
        return math.log1p(-0.5 * math.erfc(x / math.sqrt(2.0)))
    if x >= -37.0:
        return math.log(0.5 * math.erfc(-x / math.sqrt(2.0)))
    u = 1.0 / (x * x)
    return (
        -0.5 * x * x
        - math.log(-x)
        - 0.5 * _LOG_2PI
        + math.log1p(u * (-1.0 + u * (3.0 + u * (-15.0 + u * 105.0))))
    )


@numba.njit(inline="always", **JIT)
def _glm_core(par: np.ndarray, eta: float, y: float) -> tuple[float, float, float]:
    """A GLM family's ``core(η; y)``, its derivative and its curvature bound ``c(y)``
    (:mod:`flymc_dist.models.families`, formula for formula)."""
    fam = par[0]
    if fam == 0.0:  # binomial, logit link; par = (0, m)
        m = par[1]
        return y * eta - m * _softplus(eta), y - m * _sigmoid(eta), 0.25 * m
    if fam == 1.0:  # binomial, probit link; par = (1, m)
        m = par[1]
        lp = _log_ndtr(eta)
        ln = _log_ndtr(-eta)
        phi = -0.5 * eta * eta - 0.5 * _LOG_2PI
        d = y * math.exp(phi - lp) - (m - y) * math.exp(phi - ln)
        return y * lp + (m - y) * ln, d, m
    if fam == 2.0:  # negative binomial, log link; par = (2, r, log r)
        u = eta - par[2]
        w = y + par[1]
        return y * eta - w * _softplus(u), y - w * _sigmoid(u), 0.25 * w
    # Gaussian, identity link; par = (3, 1/σ²)
    r = y - eta
    return -0.5 * par[1] * r * r, par[1] * r, par[1]


@numba.njit(inline="always", **JIT)
def _bright_and_slope(
    kind: int, par: np.ndarray, eta: float, c0: float, c1: float, c2: float
) -> tuple[float, float]:
    """:func:`_log_bright` and its derivative in ``eta``,
    ``(ℓ' − β') / (1 − e^−δ)`` (0 where the bound is tight, δ = 0)."""
    if kind == LOGISTIC:  # c = (t, a, c); s = t eta
        s = eta * c0
        e = math.exp(-abs(s))  # shared by log σ(s) and σ(−s)
        delta = min(s, 0.0) - math.log1p(e)
        beta = c1 * s * s + 0.5 * s + c2
        # dℓ/dη = t σ(−s); dβ/dη = t (2 a s + 1/2)
        sig_neg = e / (1.0 + e) if s >= 0.0 else 1.0 / (1.0 + e)
        dl = c0 * sig_neg
        db = c0 * (2.0 * c1 * s + 0.5)
    elif kind == GLM:  # c = (y, q1, q0); par = (family id, its parameters)
        delta, dl, curv = _glm_core(par, eta, c0)
        beta = -0.5 * curv * eta * eta + c1 * eta + c2
        db = -curv * eta + c1
    else:  # ROBUST: c = (y, a, c); r = y − η; par = (h, const, 1/(ν σ²), log 1/(ν σ²))
        r = c0 - eta
        qq = r * r * par[2]
        if math.isinf(qq):
            lq = 2.0 * math.log(abs(r)) + par[3]
        else:
            lq = math.log1p(qq)
        delta = lq * -par[0] + par[1]
        beta = r * r * c1 + c2
        # dℓ/dη = 2 h r / (ν σ² + r²) = 2 h r (1/(νσ²)) / (1 + r²/(νσ²)); dβ/dη = −2 a r
        dl = 2.0 * par[0] * r * par[2] / (1.0 + qq)
        db = -2.0 * c1 * r
    diff = delta - beta
    if diff < -BOUND_TOLERANCE * (1.0 + abs(delta) + abs(beta)):
        return math.nan, math.nan  # the bound is broken here: the callers' guard raises
    d = max(diff, 0.0)
    if d <= 0.0:
        return -math.inf, 0.0
    p = -math.expm1(-d)  # p(z = 1 | θ) = 1 − e^−δ, shared by the value and the slope
    return d + math.log(p), (dl - db) / p


@numba.njit(inline="always", **JIT)
def _log_bright(kind: int, par: np.ndarray, eta: float, c0: float, c1: float, c2: float) -> float:
    """``log L~`` of one row at linear predictor ``eta`` with row constants
    ``(c0, c1, c2)`` (the models' ``row_constants``): :func:`_bright_and_slope`'s value,
    the one place each model's compiled log L~ is written (a caller that wants the value
    alone leaves the slope unused, and the compiler drops it)."""
    return _bright_and_slope(kind, par, eta, c0, c1, c2)[0]


@numba.njit(**JIT)
def replica_eval(
    XC: np.ndarray,
    starts: np.ndarray,
    D: int,
    chain_of: np.ndarray,
    thetas: np.ndarray,
    kind: int,
    par: np.ndarray,
    grad: bool,
    sums: np.ndarray,
    grads: np.ndarray,
) -> None:
    """``Σ log L~`` over chain ``c = chain_of[i]``'s rows ``XC[starts[c]:starts[c + 1]]``
    (features, then row constants; every chain's rows in one buffer) at each point
    ``thetas[i]``, into ``sums[i]``; with ``grad`` also its gradient in θ
    (the first ``D`` entries of ``grads[i]``). Rows in their order: the driver's
    replica keeps them sorted by global row id."""
    for i in range(thetas.shape[0]):
        total = 0.0
        for d in range(D):
            grads[i, d] = 0.0
        for r in range(starts[chain_of[i]], starts[chain_of[i] + 1]):
            eta = 0.0
            for d in range(D):
                eta += XC[r, d] * thetas[i, d]
            if grad:
                v, w = _bright_and_slope(kind, par, eta, XC[r, D], XC[r, D + 1], XC[r, D + 2])
                for d in range(D):
                    grads[i, d] += w * XC[r, d]
            else:
                v = _log_bright(kind, par, eta, XC[r, D], XC[r, D + 1], XC[r, D + 2])
            total += v
        sums[i] = total


@numba.njit(**JIT)
def row_dots(X: np.ndarray, T: np.ndarray, out: np.ndarray) -> None:
    """``out[n, e] = sum_d X[n, d] * T[e, d]``, each summed over d in order.

    What a shard computes its tight points from (``eta`` at θ̂): a row's value is then
    the same bits whichever rows are computed with it. A BLAS product is not (measured
    with OpenBLAS: ``(X @ t)[rows]`` and ``X[rows] @ t`` differ in the last bit for about
    one row in twenty), and an out-of-core shard prepares only the rows it reads.
    """
    for n in range(X.shape[0]):
        for e in range(T.shape[0]):
            total = 0.0
            for d in range(X.shape[1]):
                total += X[n, d] * T[e, d]
            out[n, e] = total


@numba.njit(inline="always", **JIT)
def _run_sum(a: np.ndarray, lo: int, n: int) -> float:
    """:func:`pairwise_sum` of a run of at most 128 values (numpy's leaf)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    whole = n - n % 8
    while i < whole:
        k = lo + i
        r0 += a[k]
        r1 += a[k + 1]
        r2 += a[k + 2]
        r3 += a[k + 3]
        r4 += a[k + 4]
        r5 += a[k + 5]
        r6 += a[k + 6]
        r7 += a[k + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@numba.njit(**JIT)
def pairwise_sum(a: np.ndarray, lo: int, n: int) -> float:
    """``a[lo:lo + n].sum()`` in numpy's order, so the same bits: numpy adds a contiguous
    run by pairwise summation — below 8 values one after another, up to 128 in eight
    running sums combined as ``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))`` and
    then the rest one by one, beyond that the two halves (the first a multiple of 8
    long) each so, then added. Written without recursion (numba's on-disk cache cannot
    hold a recursive function): the halves on a stack, each sum added to its sibling's
    once both are done."""
    if n <= 128:
        return _run_sum(a, lo, n)
    # tasks (start, length, 0: to sum | 1: to add its two halves' sums) and the sums done
    t_lo = np.empty(192, dtype=np.int64)
    t_n = np.empty(192, dtype=np.int64)
    t_add = np.empty(192, dtype=np.bool_)
    sums = np.empty(64)
    top, done = 0, 0
    t_lo[0], t_n[0], t_add[0] = lo, n, False
    while top >= 0:
        at, m, add = t_lo[top], t_n[top], t_add[top]
        top -= 1
        if add:
            done -= 1
            sums[done - 1] = sums[done - 1] + sums[done]
        elif m <= 128:
            sums[done] = _run_sum(a, at, m)
            done += 1
        else:
            half = m // 2
            half -= half % 8
            # popped last to first: the first half, then the second, then their sum
            t_lo[top + 1], t_n[top + 1], t_add[top + 1] = at, m, True
            t_lo[top + 2], t_n[top + 2], t_add[top + 2] = at + half, m - half, False
            t_lo[top + 3], t_n[top + 3], t_add[top + 3] = at, half, False
            top += 3
    return sums[0]


@numba.njit(**JIT)
def pair_dots(
    X: np.ndarray, seg: np.ndarray, thetas: np.ndarray, proposals: np.ndarray, out: np.ndarray
) -> None:
    """``out[0, r, e] = Σ_d X[r, d]·θ_j[e, d]`` and ``out[1, r, e]`` the same at θ′_j, for
    chain ``j``'s rows ``r`` in ``seg[j]:seg[j + 1]`` (``thetas[j]``, ``proposals[j]``:
    ``E × D`` values, output by output), each sum in numpy's pairwise order
    (:func:`pairwise_sum`): the bits of ``(X[r, None, :] * θ_j.reshape(E, D)).sum(-1)``,
    a row's value the same whichever rows it is computed with."""
    D = X.shape[1]
    E = out.shape[2]
    tmp = np.empty(D)
    for j in range(seg.size - 1):
        for r in range(seg[j], seg[j + 1]):
            for i in range(2):
                pts = thetas[j] if i == 0 else proposals[j]
                for e in range(E):
                    for d in range(D):
                        tmp[d] = X[r, d] * pts[e * D + d]
                    out[i, r, e] = pairwise_sum(tmp, 0, D)


@numba.njit(**JIT)
def touch_rows(XCs, rows: np.ndarray, seg: np.ndarray, seg_shard: np.ndarray) -> float:
    """Read one value per cache line of every row in ``rows`` (segment i's rows in the
    buffer ``XCs[seg_shard[i]]``).

    The rows are scattered over a large buffer, so each costs a TLB walk and several
    cache misses. Loads in this loop are independent of each other and the loop body
    is tiny, so the processor keeps many of them in flight; in a loop that also does
    each row's dot product, the next row's misses start only once the current row's
    arithmetic is under way. Measured on 400 random rows of 60 float64: 185 µs without
    this pass, 100 µs with it. Returns a sum so that the loads are not optimised away.
    """
    t = 0.0
    for i in range(seg.size - 1):
        XC = XCs[seg_shard[i]]
        W = XC.shape[1]
        for j in range(seg[i], seg[i + 1]):
            r = rows[j]
            for d in range(0, W, 8):
                t += XC[r, d]
            t += XC[r, W - 1]
    return t


@numba.njit(**JIT)
def eval_rows(
    XCs,
    D: int,
    rows: np.ndarray,
    seg: np.ndarray,
    seg_shard: np.ndarray,
    thetas: np.ndarray,
    kind: int,
    par: np.ndarray,
    out: np.ndarray,
    sums: np.ndarray,
) -> float:
    """``log L~`` of ``rows``, laid out in segments: rows ``seg[i]:seg[i+1]`` of the
    buffer ``XCs[seg_shard[i]]`` (features, then row constants) at ``thetas[i]``. Writes
    the values to ``out`` and each segment's sum to ``sums[i]``. Returns
    :func:`touch_rows`'s sum (meaningless)."""
    t = touch_rows(XCs, rows, seg, seg_shard)
    for i in range(seg.size - 1):
        XC = XCs[seg_shard[i]]
        total = 0.0
        for j in range(seg[i], seg[i + 1]):
            r = rows[j]
            eta = 0.0
            for d in range(D):
                eta += XC[r, d] * thetas[i, d]
            v = _log_bright(kind, par, eta, XC[r, D], XC[r, D + 1], XC[r, D + 2])
            out[j] = v
            total += v
        sums[i] = total
    return t


@numba.njit(**JIT)
def eval_segments(
    XC: np.ndarray,
    D: int,
    rows: np.ndarray,
    seg: np.ndarray,
    thetas: np.ndarray,
    kind: int,
    par: np.ndarray,
    out: np.ndarray,
) -> None:
    """:func:`eval_rows` on one buffer without the sums: ``log L~`` of the rows
    ``XC[rows[seg[i]:seg[i+1]]]`` at ``thetas[i]``, into ``out`` (the same operations,
    in the same order: the same bits)."""
    for i in range(seg.size - 1):
        for j in range(seg[i], seg[i + 1]):
            r = rows[j]
            eta = 0.0
            for d in range(D):
                eta += XC[r, d] * thetas[i, d]
            out[j] = _log_bright(kind, par, eta, XC[r, D], XC[r, D + 1], XC[r, D + 2])


@numba.njit(**JIT)
def eval_rows_at(
    XC: np.ndarray,
    D: int,
    rows: np.ndarray,
    thetas: np.ndarray,
    kind: int,
    par: np.ndarray,
    out: np.ndarray,
) -> None:
    """``log L~`` of ``rows`` of the buffer ``XC`` at every one of ``thetas`` (C, P):
    ``out[c, j]`` for ``rows[j]`` at ``thetas[c]``, each row read once for all of them
    (the exact draw of every chain's z at placement: a pass over all rows). The same
    operations, in the same order, as :func:`eval_rows`: the same bits."""
    for j in range(rows.size):
        r = rows[j]
        for c in range(thetas.shape[0]):
            eta = 0.0
            for d in range(D):
                eta += XC[r, d] * thetas[c, d]
            out[c, j] = _log_bright(kind, par, eta, XC[r, D], XC[r, D + 1], XC[r, D + 2])


@numba.njit(**JIT)
def segment_sums(vals: np.ndarray, seg: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = sum(vals[seg[i]:seg[i+1]])``, in order."""
    for i in range(seg.size - 1):
        total = 0.0
        for j in range(seg[i], seg[i + 1]):
            total += vals[j]
        out[i] = total


@numba.njit(**JIT)
def dark_rows(
    members: np.ndarray,
    m_seg: np.ndarray,
    rows: np.ndarray,
    seg: np.ndarray,
    pos: np.ndarray,
    cand: np.ndarray,
    cand_seg: np.ndarray,
    at: np.ndarray,
) -> None:
    """The dark rows among each (shard, chain) pair's proposed shard-local ``rows``
    (``seg``): pair p's rows not among its sorted bright rows
    ``members[m_seg[p]:m_seg[p+1]]`` (a binary search each), written pair after pair to
    ``cand`` (``cand_seg``), and where each sits in its shard's buffer to ``at``: its
    ``pos`` entry (the proposals' buffer, out of core), or the row itself (``pos``
    empty: every shard in memory)."""
    m = 0
    cand_seg[0] = 0
    own = pos.size == 0
    for p in range(seg.size - 1):
        bright = members[m_seg[p] : m_seg[p + 1]]
        for i in range(seg[p], seg[p + 1]):
            r = rows[i]
            k = np.searchsorted(bright, r)
            if k == bright.size or bright[k] != r:
                cand[m] = r
                at[m] = r if own else pos[i]
                m += 1
        cand_seg[p + 1] = m


@numba.njit(**JIT)
def apply(
    b_idx: np.ndarray,
    b_vals: np.ndarray,
    b_seg: np.ndarray,
    members: np.ndarray,
    u_dark: np.ndarray,
    log_q: float,
    cand: np.ndarray,
    cand_seg: np.ndarray,
    vals: np.ndarray,
    acc: np.ndarray,
    new_idx: np.ndarray,
    new_vals: np.ndarray,
    new_members: np.ndarray,
    new_seg: np.ndarray,
) -> None:
    """Apply every (shard, chain) pair's z-update: its bright rows go dark when
    ``log(1-u) < log q - log L~`` (``u`` from ``u_dark``), its accepted candidates
    (``acc``; sorted within a pair) turn bright.

    Pair p's bright rows are ``b_idx[b_seg[p]:b_seg[p+1]]`` with their values, and the
    same rows sorted in ``members`` (same segments). Its new bright set is written to
    ``new_idx``/``new_vals`` at ``new_seg[p]:new_seg[p+1]`` — the rows it keeps, in their
    order, then the accepted ones — and the same rows sorted to ``new_members`` (a
    merge: O(M) per pair, no sort of the bright rows).
    """
    o = 0
    for c in range(b_seg.size - 1):
        new_seg[c] = o
        n_gone = 0
        gone = np.empty(b_seg[c + 1] - b_seg[c], dtype=np.int64)
        for j in range(b_seg[c], b_seg[c + 1]):
            if math.log1p(-u_dark[j]) < log_q - b_vals[j]:
                gone[n_gone] = b_idx[j]
                n_gone += 1
            else:
                new_idx[o] = b_idx[j]
                new_vals[o] = b_vals[j]
                o += 1
        for j in range(cand_seg[c], cand_seg[c + 1]):
            if acc[j]:
                new_idx[o] = cand[j]
                new_vals[o] = vals[j]
                o += 1
        # the sorted bright rows: the kept members merged with the accepted candidates
        gone = np.sort(gone[:n_gone])
        w = new_seg[c]
        g = 0
        a = cand_seg[c]
        for j in range(b_seg[c], b_seg[c + 1]):
            r = members[j]
            while g < n_gone and gone[g] < r:
                g += 1
            if g < n_gone and gone[g] == r:
                continue
            while a < cand_seg[c + 1] and (not acc[a] or cand[a] < r):
                if acc[a]:
                    new_members[w] = cand[a]
                    w += 1
                a += 1
            new_members[w] = r
            w += 1
        while a < cand_seg[c + 1]:
            if acc[a]:
                new_members[w] = cand[a]
                w += 1
            a += 1
    new_seg[b_seg.size - 1] = o


@numba.njit(**JIT)
def _linear_predictors(
    X: np.ndarray, at: np.ndarray, n: int, thetas: np.ndarray, c: int, D: int, out: np.ndarray
) -> None:
    """``out[k] = X[at[k], :D] · thetas[c]`` for ``k < n``: each sum in the order of
    :func:`eval_rows` (``d = 0, 1, …``, from ``0.0``: the same bits), four rows at a
    time. A row's sum is a chain of ``D`` dependent additions; four independent chains
    run side by side on the processor, where one row after another would wait on each
    addition in turn: 1.4× faster alone at ``D = 57``, and in :func:`replica_z_propose`,
    where each row's sum was followed by its ``log L~``, random-walk MH's compiled
    iterations at 2M × 57 went from 28–29 µs to 24."""
    k = 0
    while k + 4 <= n:
        r0, r1, r2, r3 = at[k], at[k + 1], at[k + 2], at[k + 3]
        e0 = e1 = e2 = e3 = 0.0
        for d in range(D):
            t = thetas[c, d]
            e0 += X[r0, d] * t
            e1 += X[r1, d] * t
            e2 += X[r2, d] * t
            e3 += X[r3, d] * t
        out[k], out[k + 1], out[k + 2], out[k + 3] = e0, e1, e2, e3
        k += 4
    while k < n:
        r = at[k]
        e = 0.0
        for d in range(D):
            e += X[r, d] * thetas[c, d]
        out[k] = e
        k += 1


@numba.njit(**JIT)
def replica_z_propose(
    buf: np.ndarray,
    ids: np.ndarray,
    starts: np.ndarray,
    D: int,
    thetas: np.ndarray,
    keys: np.ndarray,
    log_q: float,
    p_ids: np.ndarray,
    p_seg: np.ndarray,
    p_at: np.ndarray,
    rows_buf: np.ndarray,
    kind: int,
    par: np.ndarray,
    b_vals: np.ndarray,
    gone: np.ndarray,
    cand: np.ndarray,
    cand_seg: np.ndarray,
    cand_at: np.ndarray,
    cand_u: np.ndarray,
    cand_vals: np.ndarray,
    queries: np.ndarray,
) -> bool:
    """The first half of every chain's implicit z-update on the driver's replica, in one
    call: what :func:`eval_segments`, :func:`~flymc_dist.streams.uniforms_at_many`,
    :func:`dark_rows` and :func:`apply` compute of it, with the same operations in the
    same order (the same bits).

    Chain c's bright rows are ``buf[starts[c]:starts[c+1]]`` (global ids ``ids``, sorted
    within the chain); its dark→bright proposals are the global rows
    ``p_ids[p_seg[c]:p_seg[c+1]]`` (sorted), row ``p_at[j]`` of ``rows_buf``; ``keys[c]``
    its ``Z_DECIDE`` stream at this step. Writes each bright row's ``log L~`` at
    ``thetas[c]`` (``b_vals``) and whether it goes dark (``gone``: ``log(1-u) < log q −
    log L~``); the dark proposals (``cand``, chain after chain: ``cand_seg``), where each
    sits in ``rows_buf`` (``cand_at``), its uniform (``cand_u``) and its ``log L~``
    (``cand_vals``), and each chain's likelihood queries (its bright rows and dark
    proposals, ``queries``). Returns whether any value is NaN (a broken bound, or a non-finite θ:
    the caller's guard, :func:`flymc_dist.terms.check_bounds_held`, tells which).
    """
    nan = False
    m = 0
    cand_seg[0] = 0
    own = np.arange(ids.size)
    etas = np.empty(max(ids.size, p_ids.size))
    for c in range(starts.size - 1):
        key = keys[c]
        s0, s1 = starts[c], starts[c + 1]
        _linear_predictors(buf, own[s0:], s1 - s0, thetas, c, D, etas)
        for j in range(s0, s1):
            v = _log_bright(kind, par, etas[j - s0], buf[j, D], buf[j, D + 1], buf[j, D + 2])
            b_vals[j] = v
            nan = nan or math.isnan(v)
            gone[j] = math.log1p(-uniform_at(key, ids[j])) < log_q - v
        bright = ids[s0:s1]
        m0 = m
        for i in range(p_seg[c], p_seg[c + 1]):
            r = p_ids[i]
            k = np.searchsorted(bright, r)
            if k < bright.size and bright[k] == r:
                continue
            cand[m] = r
            cand_at[m] = p_at[i]
            m += 1
        _linear_predictors(rows_buf, cand_at[m0:], m - m0, thetas, c, D, etas)
        for i in range(m0, m):
            a = cand_at[i]
            v = _log_bright(
                kind, par, etas[i - m0], rows_buf[a, D], rows_buf[a, D + 1], rows_buf[a, D + 2]
            )
            nan = nan or math.isnan(v)
            cand_u[i] = uniform_at(key, cand[i])
            cand_vals[i] = v
        cand_seg[c + 1] = m
        queries[c] = s1 - s0 + m - m0
    return nan


@numba.njit(**JIT)
def replica_z_apply(
    buf: np.ndarray,
    ids: np.ndarray,
    starts: np.ndarray,
    gone: np.ndarray,
    cand: np.ndarray,
    cand_seg: np.ndarray,
    cand_at: np.ndarray,
    acc: np.ndarray,
    rows_buf: np.ndarray,
    new_buf: np.ndarray,
    new_ids: np.ndarray,
    new_src: np.ndarray,
    new_starts: np.ndarray,
) -> int:
    """The second half (:func:`replica_z_propose`): with ``acc``, which dark proposals
    are accepted (the caller's :func:`flymc_dist.brightness.brighten`), write every
    chain's new bright rows, sorted by global id, chain after chain: their ids, their
    buffer rows (copied from ``buf`` or ``rows_buf``) and where each came from
    (``new_src``: ``j`` for row ``j`` of ``buf``, ``len(buf) + a`` for row ``a`` of
    ``rows_buf``), the chains' segments in ``new_starts``.

    Returns the number of rows written, or -1 when no chain's bright set changed (then
    nothing is written)."""
    changed = False
    for j in range(gone.size):
        changed = changed or gone[j]
    for j in range(acc.size):
        changed = changed or acc[j]
    if not changed:
        return -1
    M = ids.size
    W = buf.shape[1]
    o = 0
    new_starts[0] = 0
    for c in range(starts.size - 1):
        j, s1 = starts[c], starts[c + 1]
        a, a1 = cand_seg[c], cand_seg[c + 1]
        while True:
            while j < s1 and gone[j]:
                j += 1
            while a < a1 and not acc[a]:
                a += 1
            if j < s1 and (a >= a1 or ids[j] < cand[a]):
                new_ids[o] = ids[j]
                new_src[o] = j
                for d in range(W):
                    new_buf[o, d] = buf[j, d]
                j += 1
            elif a < a1:
                r = cand_at[a]
                new_ids[o] = cand[a]
                new_src[o] = M + r
                for d in range(W):
                    new_buf[o, d] = rows_buf[r, d]
                a += 1
            else:
                break
            o += 1
        new_starts[c + 1] = o
    return o


@numba.njit(**JIT)
def gather_rows(a: np.ndarray, b: np.ndarray, src: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = a[src[i]]`` where ``src[i] < len(a)``, else ``b[src[i] − len(a)]``:
    rows of ``a`` and ``b`` joined, without joining them (``a``, ``b``, ``out`` 2-D)."""
    M = a.shape[0]
    for i in range(src.size):
        j = src[i]
        if j < M:
            for d in range(out.shape[1]):
                out[i, d] = a[j, d]
        else:
            for d in range(out.shape[1]):
                out[i, d] = b[j - M, d]


@numba.njit(**JIT)
def merge_pairs(
    segs: np.ndarray,
    ids: np.ndarray,
    at: np.ndarray,
    id_off: np.ndarray,
    row_off: np.ndarray,
    out_ids: np.ndarray,
    out_at: np.ndarray,
    out_seg: np.ndarray,
) -> None:
    """Several shards' proposals merged pair by pair: pair ``p``'s ids of shard ``h``
    (``ids[id_off[h] + segs[h, p] : id_off[h] + segs[h, p + 1]]``, each at ``at`` in its
    shard's rows) for ``h = 0, 1, …`` in turn, into ``out_ids`` and ``out_seg``, each
    at ``at + row_off[h]`` (``out_at``) in the shards' rows joined."""
    H, n1 = segs.shape
    w = 0
    out_seg[0] = 0
    for p in range(n1 - 1):
        for h in range(H):
            for j in range(id_off[h] + segs[h, p], id_off[h] + segs[h, p + 1]):
                out_ids[w] = ids[j]
                out_at[w] = at[j] + row_off[h]
                w += 1
        out_seg[p + 1] = w


def typed_list(arrays: list[np.ndarray]) -> List:
    """The arrays as a numba typed list (what the kernels take for per-shard buffers)."""
    out = List()
    for a in arrays:
        out.append(a)
    return out
