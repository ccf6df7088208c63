"""Whole θ-kernel transitions compiled (numba) on FlyMC's conditional over the replica:
NUTS and random-walk Metropolis–Hastings.

In replica mode (:mod:`flymc_dist.replica`) the θ-kernel runs on the driver, and with
MAP-tuned bounds a chain has tens of bright rows: a leapfrog step is a few thousand
flops, and the generator-based :class:`~flymc_dist.kernels.nuts.NUTS` spends most of
its time in the interpreter (a request, a response and a phase point per leapfrog
step). :func:`nuts_transition` is the same transition as one compiled call: the same
algorithm (multinomial NUTS, Stan's three generalised U-turn checks per merge,
divergences, biased progressive sampling at the top), drawing the same random numbers
from the chain's own stream in the same order, on the target

    log p(θ) + θᵀAθ + bᵀθ + c + Σ_bright log L~_n(θ)

(prior, collapsed bound, the chain's bright rows in the replica's buffer, summed in
the replica's order). Its results equal the generator's up to rounding (sums and
mat-vecs in another order); a test steps both from the same stream.
:func:`rwmh_transition` is :class:`~flymc_dist.kernels.rwmh.RandomWalkMH`'s step in the
same way: the same normals and exponential from the chain's stream, the same proposal
and decision, on the same target.

The sums are compiled with ``fastmath={"reassoc", "contract"}`` (no other fast-math
flag: infinities and NaN keep their meaning): the compiler may reorder them into several
vector accumulators and fuse multiply-adds, which took a transition on MNIST 7 vs 9's
conditional (58.7 bright rows, 51 weights, 17.9 evaluations) from 353-394 to 220-223 µs
on this project's 2-core machine. The arithmetic is still a fixed function of the inputs
on a given machine, so draws stay the same in-process and on any number of workers (the
driver runs it); the generated code, and so the last bits, can differ between CPUs.

Why the target is written in here rather than passed as a function: see
:mod:`flymc_dist._compiled` (a kernel receiving a jitted function is not cached across
processes). The kernel side stays pure: :meth:`~flymc_dist.kernels.nuts.NUTS.fused_steps`
only asks its target for a NUTS transition with its own settings.
"""

from __future__ import annotations

import ctypes
import math

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from flymc_dist._compiled import JIT, _bright_and_slope

#: the flags of the compiled transition: see the module docstring
_FAST = {**JIT, "fastmath": {"reassoc", "contract"}}

#: prior kinds of :func:`nuts_transition`
PRIOR_KINDS = {"flat": 0, "normal": 1, "laplace": 2}


def generator_pointers(rng: np.random.Generator) -> np.ndarray:
    """The addresses a compiled function draws from ``rng`` through
    (:func:`_generator_at`): its bit generator's state and its ``next_uint64``,
    ``next_uint32`` and ``next_double`` functions (numpy's ``BitGenerator.ctypes``).

    Handing numba the Generator itself costs ~27 µs a call on this project's 2-core
    machine (the dispatcher types it, then unboxes it through five ctypes look-ups),
    against ~2 µs for this array: most of a NUTS transition's overhead on a chain with
    a few bright rows. The draws are the same: the same state advanced by the same
    functions. The caller keeps ``rng`` alive while the addresses are used."""
    c = rng.bit_generator.ctypes
    return np.array(
        [
            c.state_address,
            c.state.value,
            ctypes.cast(c.next_uint64, ctypes.c_void_p).value,
            ctypes.cast(c.next_uint32, ctypes.c_void_p).value,
            ctypes.cast(c.next_double, ctypes.c_void_p).value,
            c.bit_generator.value,
        ],
        dtype=np.uint64,
    )


@intrinsic
def _generator_at(typingctx: object, pointers: types.Type) -> tuple:
    """A numba Generator drawing through :func:`generator_pointers`' addresses: the
    struct numba's own unboxing of a Generator builds (``numba.np.random.generator_core``:
    the bit generator's state and function addresses), without its Python object (no
    parent, no meminfo: nothing here boxes it or counts references to it)."""
    gen = types.NumPyRandomGeneratorType("generator")
    bit = types.NumPyRandomBitGeneratorType("bit_generator")
    fields = ("state_address", "state", "fnptr_next_uint64", "fnptr_next_uint32")
    fields += ("fnptr_next_double", "bit_generator")

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202 - numba's signature
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        models = context.data_model_manager
        # both structs zeroed (no parent, no meminfo), then the addresses put in
        inner = cgutils.get_null_value(context.get_value_type(bit))
        for i, name in enumerate(fields):
            value = builder.load(cgutils.gep(builder, arr.data, i))
            inner = builder.insert_value(inner, value, models[bit].get_field_position(name))
        out = cgutils.get_null_value(context.get_value_type(gen))
        return builder.insert_value(out, inner, models[gen].get_field_position("bit_generator"))

    return gen(pointers), codegen


@numba.njit(**_FAST)
def _target(
    theta: np.ndarray,
    grad: np.ndarray,
    XC: np.ndarray,
    r0: int,
    r1: int,
    kind: int,
    par: np.ndarray,
    S: np.ndarray,
    b: np.ndarray,
    c: float,
    prior_kind: int,
    prior_inv: float,
    prior_const: float,
) -> float:
    """Log target at ``theta``, its gradient into ``grad``: bright rows ``XC[r0:r1]``
    (features, then the row constants), the collapsed bound ``θᵀAθ + bᵀθ + c`` given by
    ``S = A + Aᵀ``, ``b`` and ``c``, and the prior."""
    P = theta.shape[0]
    for d in range(P):
        grad[d] = 0.0
    bright = 0.0
    for r in range(r0, r1):
        eta = 0.0
        for d in range(P):
            eta += XC[r, d] * theta[d]
        v, w = _bright_and_slope(kind, par, eta, XC[r, P], XC[r, P + 1], XC[r, P + 2])
        bright += v
        for d in range(P):
            grad[d] += w * XC[r, d]
    # the bound, with S = A + Aᵀ: θᵀAθ = ½ θᵀSθ, gradient Sθ + b
    quad = 0.0
    for i in range(P):
        row = 0.0
        for j in range(P):
            row += S[i, j] * theta[j]
        quad += (0.5 * row + b[i]) * theta[i]
        grad[i] += row + b[i]
    prior = 0.0
    if prior_kind == 1:
        for d in range(P):
            prior += theta[d] * theta[d]
            grad[d] -= prior_inv * theta[d]
        prior *= -0.5 * prior_inv
    elif prior_kind == 2:
        for d in range(P):
            prior += abs(theta[d])
            if theta[d] > 0.0:
                grad[d] -= prior_inv
            elif theta[d] < 0.0:
                grad[d] += prior_inv
        prior *= -prior_inv
    return prior + P * prior_const + quad + c + bright


@numba.njit(**JIT)
def _product(M: np.ndarray, x: np.ndarray, diag: bool) -> np.ndarray:
    """``M x`` for a dense ``M``, or ``M[0] * x`` for a diagonal one stored as a row."""
    P = x.shape[0]
    out = np.empty(P)
    if diag:
        for i in range(P):
            out[i] = M[0, i] * x[i]
    else:
        for i in range(P):
            s = 0.0
            for j in range(P):
                s += M[i, j] * x[j]
            out[i] = s
    return out


@numba.njit(**JIT)
def _dot(a: np.ndarray, b: np.ndarray) -> float:
    s = 0.0
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@numba.njit(**JIT)
def _log_add_exp(a: float, b: float) -> float:
    """:func:`flymc_dist.kernels.hamiltonian.log_add_exp`, compiled."""
    if a < b:
        a, b = b, a
    if b == -math.inf:
        return a
    return a + math.log1p(math.exp(b - a))


@numba.njit(**_FAST)
def _leapfrog(state, eps, inv, diag, stats, XC, r0, r1, kind, par, S, b, c, pk, pinv, pconst):
    """One leapfrog step from the phase point ``state`` = (θ, p, M⁻¹p, ∇, log p, H); one
    evaluation of the target, counted in ``stats[3]``."""
    theta, momentum, _, grad, _, _ = state
    half = 0.5 * eps
    p = grad * half
    p += momentum
    x = _product(inv, p, diag)
    x *= eps
    x += theta
    g = np.empty(x.shape[0])
    stats[3] += 1.0
    logp = _target(x, g, XC, r0, r1, kind, par, S, b, c, pk, pinv, pconst)
    if not -math.inf < logp < math.inf:
        if logp == -math.inf:
            return (x, p, p, g, logp, math.inf)
        raise FloatingPointError("log density is NaN or +inf at a leapfrog point")
    p += half * g
    v = _product(inv, p, diag)
    energy = 0.5 * _dot(p, v) - logp
    if not energy < math.inf:
        for d in range(g.shape[0]):
            if math.isnan(g[d]):
                raise FloatingPointError("gradient is NaN at a leapfrog point of positive density")
        energy = math.inf
    return (x, p, v, g, logp, energy)


@numba.njit(**JIT)
def _merged_rho(outer_a, inner_a, rho_a, inner_b, outer_b, rho_b, single):
    """Stan's three U-turn checks of two adjacent trajectories merged (the two across the
    junction skipped when both halves are single points): ``(ok, ρ)``."""
    rho = rho_a + rho_b
    if not (_dot(outer_a[2], rho) > 0.0 and _dot(outer_b[2], rho) > 0.0):
        return False, rho
    if not single:
        ext = rho_a + inner_b[1]
        if not (_dot(outer_a[2], ext) > 0.0 and _dot(inner_b[2], ext) > 0.0):
            return False, rho
        ext = rho_b + inner_a[1]
        if not (_dot(inner_a[2], ext) > 0.0 and _dot(outer_b[2], ext) > 0.0):
            return False, rho
    return True, rho


@numba.njit(**_FAST)
def _build(
    rng, start, depth, eps, h0, threshold, stats, inv, diag,
    XC, r0, r1, kind, par, S, b, c, pk, pinv, pconst,
):  # fmt: skip
    """A subtree of ``2^depth`` leapfrog steps from ``start``:
    ``(valid, first, last, proposal, log weight, ρ)``. ``stats`` accumulates the
    leapfrog steps, the acceptance statistic and whether a leaf diverged."""
    if depth == 0:
        new = _leapfrog(
            start, eps, inv, diag, stats, XC, r0, r1, kind, par, S, b, c, pk, pinv, pconst
        )
        stats[0] += 1.0
        log_weight = h0 - new[5]
        stats[1] += 1.0 if log_weight >= 0.0 else math.exp(log_weight)
        if not -log_weight <= threshold:
            stats[2] = 1.0
            return False, new, new, new, log_weight, new[1]
        return True, new, new, new, log_weight, new[1]
    ok, i_first, i_last, i_prop, i_lw, i_rho = _build(
        rng, start, depth - 1, eps, h0, threshold, stats, inv, diag,
        XC, r0, r1, kind, par, S, b, c, pk, pinv, pconst,
    )  # fmt: skip
    if not ok:
        return False, i_first, i_last, i_prop, i_lw, i_rho
    ok, f_first, f_last, f_prop, f_lw, f_rho = _build(
        rng, i_last, depth - 1, eps, h0, threshold, stats, inv, diag,
        XC, r0, r1, kind, par, S, b, c, pk, pinv, pconst,
    )  # fmt: skip
    if not ok:
        return False, f_first, f_last, f_prop, f_lw, f_rho
    log_weight = _log_add_exp(i_lw, f_lw)
    # uniform progressive sampling: the final half with probability w_final / w_subtree
    delta = f_lw - log_weight
    proposal = f_prop if delta >= 0.0 or rng.random() < math.exp(delta) else i_prop
    ok, rho = _merged_rho(i_first, i_last, i_rho, f_first, f_last, f_rho, depth == 1)
    return ok, i_first, f_last, proposal, log_weight, rho


@numba.njit(**_FAST)
def nuts_transition(
    rng_at: np.ndarray,
    theta0: np.ndarray,
    eps: float,
    inv: np.ndarray,
    factor: np.ndarray,
    diag: bool,
    max_depth: int,
    threshold: float,
    XC: np.ndarray,
    r0: int,
    r1: int,
    kind: int,
    par: np.ndarray,
    S: np.ndarray,
    b: np.ndarray,
    c: float,
    prior_kind: int,
    prior_inv: float,
    prior_const: float,
    out: np.ndarray,
) -> tuple[bool, float, float, float, int, int, int, bool]:
    """One NUTS transition from ``theta0``, as
    :meth:`~flymc_dist.kernels.nuts.NUTS.step` makes it (same random numbers, same
    order), on the target of :func:`_target`, drawing from the Generator at ``rng_at``
    (:func:`generator_pointers`).

    ``inv`` and ``factor`` are the inverse metric and the momentum factor, ``(P, P)``,
    or ``(1, P)`` with ``diag``. The new position is written into ``out``.

    Returns
    -------
    moved, log_target, energy, accept_prob, n_leapfrog, n_evals, tree_depth, divergent
        At the new position; ``accept_prob`` is Stan's acceptance statistic, ``n_evals``
        the evaluations of the target (the current position's and one per leapfrog step).
    """
    rng = _generator_at(rng_at)
    P = theta0.shape[0]
    g0 = np.empty(P)
    logp0 = _target(theta0, g0, XC, r0, r1, kind, par, S, b, c, prior_kind, prior_inv, prior_const)
    if not -math.inf < logp0 < math.inf:
        raise FloatingPointError("log density at the current position is not finite")
    for d in range(P):
        if not math.isfinite(g0[d]):
            raise FloatingPointError("gradient at the current position is not finite")
    momentum = _product(factor, rng.standard_normal(P), diag)
    v0 = _product(inv, momentum, diag)
    z0 = (theta0, momentum, v0, g0, logp0, 0.5 * _dot(momentum, v0) - logp0)
    h0 = z0[5]
    left = z0
    right = z0
    sample = z0
    moved = False
    rho = momentum
    log_weight = 0.0
    depth = np.int64(0)  # not the literal 0: numba would compile _build for it too
    stats = np.zeros(4)  # leapfrog steps, Σ acceptance statistic, divergent, evaluations
    stats[3] = 1.0  # at theta0
    while depth < max_depth:
        forward = rng.random() > 0.5
        ok, first, last, proposal, tree_lw, tree_rho = _build(
            rng, right if forward else left, depth, eps if forward else -eps, h0, threshold,
            stats, inv, diag, XC, r0, r1, kind, par, S, b, c, prior_kind, prior_inv,
            prior_const,
        )  # fmt: skip
        if not ok:
            break
        # biased progressive sampling: the new subtree w.p. min(1, w_new / w_old)
        delta = tree_lw - log_weight
        if delta >= 0.0 or rng.random() < math.exp(delta):
            sample = proposal
            moved = True
        log_weight = _log_add_exp(log_weight, tree_lw)
        if forward:
            ok, rho = _merged_rho(left, right, rho, first, last, tree_rho, depth == 0)
            right = last
        else:
            ok, rho = _merged_rho(right, left, rho, first, last, tree_rho, depth == 0)
            left = last
        depth += 1
        if not ok:
            break
    for d in range(P):  # not out[:] = …: its shape check compiles numba's string formatting
        out[d] = sample[0][d]
    return (
        moved,
        sample[4],
        sample[5],
        stats[1] / stats[0],
        int(stats[0]),
        int(stats[3]),
        depth,
        stats[2] > 0.0,
    )


@numba.njit(**_FAST)
def nuts_chains(
    rng_at: np.ndarray,
    thetas: np.ndarray,
    eps: np.ndarray,
    inv: np.ndarray,
    factor: np.ndarray,
    diag: bool,
    max_depth: int,
    threshold: float,
    XC: np.ndarray,
    starts: np.ndarray,
    kind: int,
    par: np.ndarray,
    S: np.ndarray,
    b: np.ndarray,
    c: float,
    prior_kind: int,
    prior_inv: float,
    prior_const: float,
    out: np.ndarray,
    floats: np.ndarray,
    ints: np.ndarray,
) -> None:
    """One :func:`nuts_transition` of every chain, chain after chain, in one call: chain
    ``i`` from ``thetas[i]`` with step size ``eps[i]``, metric ``inv[i]`` and ``factor[i]``,
    its Generator at ``rng_at[i]``, on its rows ``XC[starts[i]:starts[i+1]]``; the
    target's other terms are shared. The same calls as one per chain (the same random
    numbers, the same arithmetic).

    Writes each chain's new position into ``out[i]``, its ``(log_target, energy,
    accept_prob)`` into ``floats[i]`` and its ``(moved, n_leapfrog, n_evals, tree_depth,
    divergent)`` into the first five columns of ``ints[i]``.
    """
    for i in range(thetas.shape[0]):
        res = nuts_transition(
            rng_at[i], thetas[i], eps[i], inv[i], factor[i], diag, max_depth, threshold, XC,
            starts[i], starts[i + 1], kind, par, S, b, c, prior_kind, prior_inv, prior_const,
            out[i],
        )  # fmt: skip
        floats[i, 0] = res[1]
        floats[i, 1] = res[2]
        floats[i, 2] = res[3]
        ints[i, 0] = res[0]
        ints[i, 1] = res[4]
        ints[i, 2] = res[5]
        ints[i, 3] = res[6]
        ints[i, 4] = res[7]


@numba.njit(**_FAST)
def rwmh_transition(
    rng_at: np.ndarray,
    theta0: np.ndarray,
    eps: float,
    factor: np.ndarray,
    diag: bool,
    XC: np.ndarray,
    r0: int,
    r1: int,
    kind: int,
    par: np.ndarray,
    S: np.ndarray,
    b: np.ndarray,
    c: float,
    prior_kind: int,
    prior_inv: float,
    prior_const: float,
    out: np.ndarray,
) -> tuple[bool, float, float]:
    """One random-walk MH transition from ``theta0``, as
    :meth:`~flymc_dist.kernels.rwmh.RandomWalkMH.step` makes it: ``P`` standard normals
    ``z`` and one standard exponential ``−log u`` from the Generator at ``rng_at``, the
    proposal ``θ′ = θ + ε L z`` (``factor`` is ``L``, ``(P, P)``, or its diagonal ``(1,
    P)`` with ``diag``), accepted iff ``log u < log p(θ′) − log p(θ)``, both on the target
    of :func:`_target` (evaluated here, the current one too: z may have changed it). The
    new position is written into ``out``.

    Returns
    -------
    moved, log_target, accept_prob
        Whether it moved, the log target at the new position and ``min(1, p(θ′)/p(θ))``.

    Raises
    ------
    FloatingPointError
        A NaN or +inf log target (at the current position or the proposal; −inf is a
        point of zero density, never accepted).
    """
    rng = _generator_at(rng_at)
    P = theta0.shape[0]
    g = np.empty(P)
    logp0 = _target(theta0, g, XC, r0, r1, kind, par, S, b, c, prior_kind, prior_inv, prior_const)
    if not logp0 < math.inf:
        raise FloatingPointError("log density at the current position is NaN or +inf")
    x = _product(factor, rng.standard_normal(P), diag)
    neg_log_u = rng.standard_exponential()
    for d in range(P):
        x[d] = x[d] * eps + theta0[d]
    logp = _target(x, g, XC, r0, r1, kind, par, S, b, c, prior_kind, prior_inv, prior_const)
    if math.isnan(logp) or logp == math.inf:
        raise FloatingPointError("log density at the proposal is NaN or +inf")
    log_ratio = logp - logp0
    moved = log_ratio > -neg_log_u
    if log_ratio >= 0.0:
        accept_prob = 1.0
    elif log_ratio < 0.0:
        accept_prob = math.exp(log_ratio)
    else:  # NaN: −inf − −inf
        accept_prob = 0.0
    src = x if moved else theta0
    for d in range(P):
        out[d] = src[d]
    return moved, logp if moved else logp0, accept_prob


@numba.njit(**_FAST)
def rwmh_chains(
    rng_at: np.ndarray,
    thetas: np.ndarray,
    eps: np.ndarray,
    factor: np.ndarray,
    diag: bool,
    XC: np.ndarray,
    starts: np.ndarray,
    kind: int,
    par: np.ndarray,
    S: np.ndarray,
    b: np.ndarray,
    c: float,
    prior_kind: int,
    prior_inv: float,
    prior_const: float,
    out: np.ndarray,
    floats: np.ndarray,
    ints: np.ndarray,
) -> None:
    """One :func:`rwmh_transition` of every chain, chain after chain, written as
    :func:`nuts_chains` writes its transitions: ``floats[i]`` the log target, NaN (no
    energy) and the acceptance probability, ``ints[i]`` moved, 0 (no leapfrog step), 2
    evaluations, 0 (no tree) and 0 (never divergent)."""
    for i in range(thetas.shape[0]):
        res = rwmh_transition(
            rng_at[i], thetas[i], eps[i], factor[i], diag, XC, starts[i], starts[i + 1], kind,
            par, S, b, c, prior_kind, prior_inv, prior_const, out[i],
        )  # fmt: skip
        floats[i, 0] = res[1]
        floats[i, 1] = math.nan
        floats[i, 2] = res[2]
        ints[i, 0] = res[0]
        ints[i, 1] = 0
        ints[i, 2] = 2
        ints[i, 3] = 0
        ints[i, 4] = 0
