"""The driver's replica of the bright rows (replica mode), checked deterministically.

* After every round the replica holds exactly each chain's bright rows on the shards
  (ids, features, targets and tight points), for every model and z-update, also after
  a redraw of z (the shards then send whole sets).
* Its sums and gradients equal the shards' own evaluation of the same rows.
* One round trip per iteration for every kernel; the mode is chosen by
  ``bright_replica`` ("auto": multi-evaluation kernels within the memory budget) and
  reported in ``res.info``.

The statistical proof that replica mode targets the exact posterior is in
``test_exactness.py`` (its combinations run in both modes).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import flymc_dist as fd
from flymc_dist.driver import Driver
from flymc_dist.kernels import get_kernel
from flymc_dist.layout import shard_layout
from flymc_dist.options import READ_AHEAD
from flymc_dist.protocol import (
    ReplicaReply,
    ReplicaRound,
    Reply,
    Request,
    Round,
    ShardConfig,
    pack_reply,
    pack_round,
    unpack_reply,
    unpack_round,
)
from flymc_dist.transport.inprocess import InProcessTransport


def _data(model_name: str, n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.c_[np.ones(n), rng.standard_normal((n, 2))]
    if model_name == "logistic":
        y = (rng.random(n) < 1 / (1 + np.exp(-X @ [0.2, 1.0, -0.7]))).astype(int)
    elif model_name == "softmax":
        W = np.array([[0.0, 1.0, 0.0], [0.3, -1.0, 0.5], [-0.2, 0.0, -1.0]])
        logits = X @ W.T
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        y = np.array([rng.choice(3, p=pi) for pi in p])
    else:
        y = X @ [0.5, -1.0, 2.0] + rng.standard_t(4, n)
    return X, y


MODELS = {
    "logistic": lambda: fd.LogisticRegression(),
    "softmax": lambda: fd.SoftmaxRegression(n_classes=3),
    "robust": lambda: fd.RobustRegression(prior="laplace"),
}


def _driver(
    model_name: str,
    z_update: str,
    bounds: str = "map",
    kernel: str = "slice",
    read_ahead: int = 0,
) -> tuple[Driver, InProcessTransport]:
    """A replica-mode driver; by default with a round to the shards every iteration
    (``read_ahead=0``: the shards update z, which these tests compare the replica with)."""
    X, y = _data(model_name)
    model = MODELS[model_name]()
    specs, mem, n_rows, n_features, *_ = shard_layout((X, y), fd.Placement(n_shards=3))
    kern = get_kernel(kernel)
    config = ShardConfig(
        model=model,
        algorithm="flymc",
        chains=3,
        seed=5,
        n_rows=n_rows,
        z_update=z_update,
        resample_fraction=0.3,
        track_grad=kern.needs_grad,
    )
    transport = InProcessTransport(specs, config, mem)
    driver = Driver(
        model,
        transport,
        kern,
        n_features=n_features,
        algorithm=fd.FlyMC(bounds=bounds, q_db=0.05, bright_replica=True, read_ahead=read_ahead),
        chains=3,
        seed=5,
        n_rows=n_rows,
    )
    return driver, transport


def _shard_bright(transport: InProcessTransport, chain: int) -> np.ndarray:
    """Global ids of one chain's bright rows over all shards."""
    out = []
    for spec in transport.specs:
        shard = transport.host.shards[spec.shard_id]
        out.append(shard.chains[chain].bright.members + spec.start)
    return np.concatenate(out)


def _check_mirror(driver: Driver, transport: InProcessTransport, X, y) -> None:
    shard = transport.host.shards[0]
    for c in range(driver.chains):
        rows = driver.replica._rows[c]
        np.testing.assert_array_equal(rows.ids, _shard_bright(transport, c))
        np.testing.assert_array_equal(rows.X, X[rows.ids])
        np.testing.assert_array_equal(rows.y, y[rows.ids])
        # tight points: the shards' own (shard 0 holds rows 0..n0)
        on0 = rows.ids < shard.n
        np.testing.assert_array_equal(rows.xi[on0], shard.rows.xi[rows.ids[on0]])


@pytest.mark.parametrize("z_update", ["implicit", "explicit"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_replica_mirrors_the_shards_z(model_name, z_update):
    X, y = _data(model_name)
    driver, transport = _driver(model_name, z_update, bounds="untuned")
    driver.setup()
    assert driver.replica is not None
    moved = 0
    before = None
    for _ in range(25):
        driver.step()
        _check_mirror(driver, transport, X, y)
        now = [driver.replica._rows[c].ids.copy() for c in range(driver.chains)]
        if before is not None:
            moved += sum(not np.array_equal(a, b) for a, b in zip(before, now, strict=True))
        before = now
    assert moved > 0  # z did change along the way: the deltas were exercised
    # a redraw of z on the shards (as on resume or recovery): whole sets are sent again
    transport.call("set_positions", driver.positions, 7)
    driver.step()
    _check_mirror(driver, transport, X, y)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_replica_sums_equal_shard_evaluation(model_name):
    """The replica's sums and gradients at arbitrary points equal the shards' own, in
    shard mode, on the same bright rows."""
    driver, transport = _driver(model_name, "implicit", bounds="untuned")
    driver.setup()
    for _ in range(5):
        driver.step()
    rng = np.random.default_rng(1)
    pts = [
        driver.positions[c] + 0.1 * rng.standard_normal((2, driver.P)) for c in range(driver.chains)
    ]
    local = driver.replica.evaluate(pts, [True] * driver.chains)
    # the same rows evaluated by the shards themselves (shard mode, gradients kept)
    for sh in transport.host.shards.values():
        sh.replica, sh.track_grad = False, True
    for c in range(driver.chains):
        want = np.zeros(2)
        grad = np.zeros((2, driver.P))
        for spec in transport.specs:
            sh = transport.host.shards[spec.shard_id]
            rows = sh.chains[c].bright.members
            if rows.size:
                v, d, Xr = sh._bright_eval(pts[c], rows, True)
                want += v.sum(axis=1)
                grad += driver.model.grad_theta(d, Xr)
        np.testing.assert_allclose(local[c][0], want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(local[c][1], grad, rtol=1e-10, atol=1e-10)
        assert local[c][2] == 2 * driver.replica._rows[c].ids.size


@pytest.mark.parametrize("kernel", ["rwmh", "mala", "slice", "hmc", "nuts"])
def test_one_round_trip_per_iteration_in_replica_mode(kernel):
    X, y = _data("logistic")

    def run(replica: bool) -> fd.Result:
        return fd.sample(
            fd.LogisticRegression(),
            (X, y),
            kernel=kernel,
            num_warmup=20,
            num_samples=30,
            chains=2,
            client="synchronous",
            placement=fd.Placement(n_shards=3),
            algorithm=fd.FlyMC(bright_replica=replica),
            progress=False,
        )

    res = run(True)
    assert res.info["bright_replica"] is True
    # z is updated on the driver, its proposals read ahead: one request per READ_AHEAD
    # iterations (the first block's is asked for in set-up)
    trips = np.concatenate([res.warmup_stats["round_trips"][0], res.stats["round_trips"][0]])
    assert trips.max() == 1 and trips.sum() == math.ceil(50 / READ_AHEAD)
    shard_mode = run(False)
    assert shard_mode.info["bright_replica"] is False
    if kernel != "rwmh":  # several evaluations per iteration: several round trips
        assert shard_mode.stats["round_trips"].mean() > 1.5


def test_auto_mode_follows_kernel_and_budget():
    X, y = _data("logistic")
    kw = dict(num_warmup=5, num_samples=5, chains=2, client="synchronous", progress=False)
    m = fd.LogisticRegression()
    assert fd.sample(m, (X, y), kernel="slice", **kw).info["bright_replica"] is True
    # every kernel, RWMH too: the replica sums in global row order, so draws do not
    # depend on the layout
    assert fd.sample(m, (X, y), kernel="rwmh", **kw).info["bright_replica"] is True
    assert (
        fd.sample(m, (X, y), fd.FlyMC(replica_budget=0), "slice", **kw).info["bright_replica"]
        is False
    )
    assert (
        fd.sample(m, (X, y), algorithm="regular", kernel="slice", **kw).info["bright_replica"]
        is False
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"bright_replica": "yes"},
        {"bright_replica": 1},
        {"replica_budget": -1},
        {"replica_budget": "1GB"},
    ],
)
def test_replica_options_are_validated(bad):
    X, y = _data("logistic")
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        fd.sample(fd.LogisticRegression(), (X, y), fd.FlyMC(**bad), client="synchronous")


def test_replica_round_is_idempotent_in_seq():
    """A replayed round (fault recovery) returns the cached reply, not a second update."""
    driver, transport = _driver("logistic", "implicit", bounds="untuned")
    driver.setup()
    first = transport.round(ReplicaRound(99, driver.positions), driver.positions)
    again = transport.round(ReplicaRound(99, driver.positions), driver.positions)
    for a, b in zip(first, again, strict=True):
        assert a is b
    # the message types are not interchangeable: replica shards refuse a sums round
    reqs = [Request(driver.positions[c : c + 1], False, False) for c in range(driver.chains)]
    plain = Round(100, np.full(driver.chains, -1), True, reqs)
    with pytest.raises(ValueError, match="Round for shards in replica mode"):
        transport.round(plain, driver.positions)


def test_typed_replies_pack_and_unpack_exactly():
    """Both reply types, with optional fields present or absent, come back from the wire
    as the same type with the same arrays (dtype, shape, values) and the same Nones."""
    rng = np.random.default_rng(3)
    C, P, k = 3, 4, 2
    plain = Reply(
        rng.normal(size=C),
        rng.normal(size=(C, k)),
        np.arange(C, dtype=np.int64),
        np.arange(C, dtype=np.int64) * 7,
        None,
        rng.normal(size=(C, k, P)),
    )
    seg = np.array([0, 1, 1, 3], dtype=np.int64)
    replica = ReplicaReply(
        np.arange(C, dtype=np.int64),
        np.ones(C, dtype=np.int64),
        np.array([True, False, True]),
        np.array([5, 9, 11], dtype=np.int64),
        seg,
        np.array([1, 2, 30], dtype=np.int64),
        seg,
        rng.normal(size=(3, P)),
        rng.normal(size=3),
        rng.normal(size=3),
    )
    # a shard's reply: the sums of each node of the fixed block tree (a leading axis)
    nodes = Reply(
        rng.normal(size=(2, C)),
        rng.normal(size=(2, C, k)),
        np.arange(C, dtype=np.int64),
        np.arange(C, dtype=np.int64),
        rng.normal(size=(2, C, P)),
        None,
        np.array([[0, 3, 8], [2, 1, 8]], dtype=np.int64),
    )
    sent = {4: plain, 0: replica, 7: plain._replace(points_grad=None), 9: nodes}
    back = unpack_reply(pack_reply(sent))
    assert list(back) == [4, 0, 7, 9]
    for got, want in zip(back.values(), sent.values(), strict=True):
        assert type(got) is type(want)
        for name, a, b in zip(want._fields, got, want, strict=True):
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape, name
                np.testing.assert_array_equal(a, b, err_msg=name)


def test_typed_rounds_pack_and_unpack_exactly():
    """Both round messages come back from the wire as the same type with the same values;
    a replica round carries only its sequence number and the chains' positions."""
    rng = np.random.default_rng(4)
    reqs = [
        Request(rng.normal(size=(2, 3)), True, False),
        None,
        Request(rng.normal(size=(1, 3)), False, True),
    ]
    msg = Round(7, np.array([1, -1, 0]), True, reqs)
    back = unpack_round(pack_round(msg))
    assert type(back) is Round and back.seq == 7 and back.update_z is True
    np.testing.assert_array_equal(back.commits, msg.commits)
    assert back.requests[1] is None
    for got, want in zip(back.requests[::2], reqs[::2], strict=True):
        np.testing.assert_array_equal(got.points, want.points)
        assert (got.grad, got.current_grad) == (want.grad, want.current_grad)
    thetas = rng.normal(size=(3, 3))
    back = unpack_round(pack_round(ReplicaRound(8, thetas)))
    assert type(back) is ReplicaRound and back.seq == 8 and back._fields == ("seq", "thetas")
    np.testing.assert_array_equal(back.thetas, thetas)


def _replica_of(model, n_rows: int, rows: list[tuple], compiled: bool = True):
    """A driver's replica of one shard of ``n_rows`` rows, holding chain c's bright rows
    ``rows[c] = (ids (sorted), X, y, xi)``: built as a driver builds it, from a shard's
    first reply (every chain's whole bright set). ``compiled=False``: without the model's
    compiled form (the numpy reference of :mod:`flymc_dist.terms`)."""
    from flymc_dist.replica import BrightReplica

    C = len(rows)
    replica = BrightReplica(model, C, [(0, n_rows)])
    if not compiled:
        replica._compiled = None
    sizes = [np.size(r[0]) for r in rows]
    replica.apply(
        [
            ReplicaReply(
                n_bright=np.array(sizes, dtype=np.int64),
                queries=np.zeros(C, dtype=np.int64),
                full=np.ones(C, dtype=bool),
                gone_ids=np.empty(0, dtype=np.int64),
                gone_seg=np.zeros(C + 1, dtype=np.int64),
                new_ids=np.concatenate([np.asarray(r[0], dtype=np.int64) for r in rows]),
                new_seg=np.cumsum([0, *sizes]).astype(np.int64),
                new_X=np.concatenate([np.asarray(r[1], dtype=float) for r in rows]),
                new_y=np.concatenate([r[2] for r in rows]),
                new_xi=np.concatenate([r[3] for r in rows]),
            )
        ]
    )
    return replica


def _conditional(model, rows_X, rows_y, rows_xi, stats, ids):
    """The FlyMC conditional log p(θ | z) of one chain whose bright rows are given, with
    its gradient, the way the driver evaluates it on its replica."""
    rep = _replica_of(model, 10**9, [(ids, rows_X, rows_y, rows_xi)])

    def f(theta: np.ndarray) -> tuple[float, np.ndarray]:
        t = theta[None]
        sums, grads, _ = rep.evaluate([t], [True])[0]
        val = model.log_prior(t)[0] + stats.value(t)[0] + sums[0]
        grad = model.log_prior_grad(t)[0] + stats.grad(t)[0] + grads[0]
        return float(val), grad

    return f


@pytest.mark.parametrize("near_tight", [False, True])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_conditional_gradient_matches_finite_differences(model_name, near_tight):
    """∇ of (log prior + collapsed bound + Σ_bright log L~) against central differences,
    at random points, and with bright rows near their tight point (MAP-tuned bounds a
    small step away from the tuning point: 1e-6 < δ < 1e-2, where log L~ ≈ log δ is
    steep). Rows with δ below 1e-6 are left out: there δ = ℓ − β itself carries a relative
    rounding error of 1e-16/δ, which central differences amplify, while the analytic
    gradient ((ℓ' − β')/(1 − e^−δ), no cancellation) stays accurate."""
    X, y = _data(model_name, n=200, seed=3)
    model = MODELS[model_name]()
    P = model.n_params(X.shape[1])
    rng = np.random.default_rng(7)
    theta_hat = 0.5 * rng.standard_normal(P)
    xi = model.tuned_xi(model.linear_predictor(theta_hat[None], X)[0], y)
    stats = model.suffstats(X, y, xi)
    scale = 0.1 if near_tight else 0.7
    for _ in range(3):
        theta = theta_hat + scale * rng.standard_normal(P)
        eta = model.linear_predictor(theta[None], X)
        delta = (model.loglik(eta, y) - model.logbound(eta, y, xi))[0]
        ok = (delta > 1e-6) & (delta < 1e-2) if near_tight else delta > 1e-6
        ids = np.flatnonzero(ok)[:40]
        assert ids.size >= 3, np.sort(delta)[:10]
        f = _conditional(model, X[ids], y[ids], xi[ids], stats, ids)
        val, grad = f(theta)
        assert np.isfinite(val) and np.all(np.isfinite(grad))
        h = 1e-7 if near_tight else 1e-6
        fd_grad = np.array(
            [(f(theta + h * e)[0] - f(theta - h * e)[0]) / (2 * h) for e in np.eye(P)]
        )
        np.testing.assert_allclose(grad, fd_grad, rtol=1e-5, atol=1e-5 * np.abs(grad).max())


@pytest.mark.parametrize("model_name", ["logistic", "robust"])
def test_compiled_replica_equals_numpy_reference(model_name):
    """The compiled evaluation of the replica (models with a compiled log L~) against the
    numpy reference of :mod:`flymc_dist.terms`, rows near and far from tight. Far
    from tight, δ = ℓ − β is a difference of terms of size ~s² computed in another order
    (the one formula against loglik − logbound): agreement to 1e-9 relative, not ulps.
    Near tight, the slope (ℓ' − β')/(1 − e^−δ) inherits δ's relative rounding error
    ε|ℓ|/δ in both forms: gradients agree to 1e-6."""
    X, y = _data(model_name, n=200, seed=4)
    model = MODELS[model_name]()
    P = model.n_params(X.shape[1])
    rng = np.random.default_rng(2)
    theta_hat = rng.standard_normal(P)
    xi = model.tuned_xi(model.linear_predictor(theta_hat[None], X)[0], y)
    rows = [(ids, X[ids], y[ids], xi[ids]) for ids in (np.arange(0, 200, 2), np.arange(1, 200, 7))]
    fast = _replica_of(model, 200, rows)
    slow = _replica_of(model, 200, rows, compiled=False)
    assert fast._compiled is not None and slow._compiled is None
    pts = [theta_hat + s * rng.standard_normal((3, P)) for s in (0.05, 1.0)]
    for g in ([True, False], [False, True]):
        a, b = fast.evaluate(pts, g), slow.evaluate(pts, g)
        for (sa, ga, qa), (sb, gb, qb) in zip(a, b, strict=True):
            np.testing.assert_allclose(sa, sb, rtol=1e-9)
            assert qa == qb
            if ga is not None or gb is not None:
                np.testing.assert_allclose(ga, gb, rtol=1e-6, atol=1e-12)


def _fused_case(model_name: str, prior: str, seed: int = 6):
    """A replica of one chain's bright rows (tight points near a random θ̂), a collapsed
    bound of them, and an evaluator of the same conditional for the generator kernel."""
    from flymc_dist.kernels.base import EvalResponse

    X, y = _data(model_name, n=300, seed=seed)
    model = (fd.LogisticRegression if model_name == "logistic" else fd.RobustRegression)(
        prior=prior
    )
    P = model.n_params(X.shape[1])
    rng = np.random.default_rng(seed)
    theta_hat = 0.5 * rng.standard_normal(P)
    xi = model.tuned_xi(model.linear_predictor(theta_hat[None], X)[0], y)
    bound = model.suffstats(X, y, xi)
    ids = np.sort(rng.choice(300, 25, replace=False))
    replica = _replica_of(model, 300, [(ids, X[ids], y[ids], xi[ids])])

    def evaluator(position):
        def evaluate(request, first):
            pts = np.concatenate([position[None], request.points])
            val = model.log_prior(pts) + bound.value(pts)
            grad = model.log_prior_grad(pts) + bound.grad(pts)
            ((sums, grads, _),) = replica.evaluate([pts], [True])
            val, grad = val + sums, grad + grads
            return EvalResponse(val[0], grad[0], val[1:], grad[1:])

        return evaluate

    return replica, bound, evaluator, theta_hat, model


@pytest.mark.parametrize("metric", ["dense", "diag"])
@pytest.mark.parametrize(
    "model_name,prior", [("logistic", "normal"), ("robust", "laplace"), ("logistic", "flat")]
)
def test_fused_nuts_is_the_generator_step(model_name, prior, metric):
    """NUTS's compiled transition on the replica (:meth:`NUTS.fused_steps`) against its
    generator step evaluated on the same conditional, from the same random stream, over
    150 steps along a chain: the same random numbers drawn, the same tree (leapfrog
    steps, depth, divergence), the same new position and log target up to rounding
    (sums in another order, reassociated by the compiler; rows at their tight point, where
    log L~ = log(expm1(δ)) turns an error ε in δ into ε/δ, are among the bright ones, so
    positions agree to 1e-7 relative, log targets and energies (hundreds) to 1e-6, and the
    acceptance statistic, a mean of exp(H₀ − H) over leaves whose energies carry those
    errors, to 2e-3; not to ulps).
    Negative control: the compiled step on a target with another bound (its linear term
    moved) must disagree."""
    from flymc_dist.kernels.base import EvalRequest, run_step
    from flymc_dist.kernels.hamiltonian import hamiltonian_params
    from flymc_dist.kernels.nuts import NUTS

    replica, bound, evaluator, position, model = _fused_case(model_name, prior)
    P = position.size
    cov = np.linalg.inv(-2.0 * bound.A + np.eye(P))
    kernel = NUTS(metric=metric, max_tree_depth=6)
    params = hamiltonian_params(0.15, cov if metric == "dense" else np.diag(cov))
    assert kernel.fuses(params) and not kernel.fuses(params._replace(find_step_size=True))
    target = replica.fused_targets(bound)
    wrong = replica.fused_targets(bound._replace(b=bound.b + 0.5))
    assert target.n_rows.tolist() == [25]
    moved = differ = 0
    for i in range(150):
        rng_g, rng_f = np.random.default_rng(i), np.random.default_rng(i)
        new_g, info_g = run_step(kernel.step(rng_g, position, params), evaluator(position))
        (new_f,), (info_f,), (logp_f,) = kernel.fused_steps(
            [rng_f], position[None], [params], target
        )
        # the same random numbers were drawn
        assert rng_f.bit_generator.state == rng_g.bit_generator.state
        np.testing.assert_allclose(new_f, new_g, rtol=1e-7, atol=1e-9)
        assert (info_f.n_leapfrog, info_f.tree_depth, info_f.divergent, info_f.index) == (
            info_g.n_leapfrog,
            info_g.tree_depth,
            info_g.divergent,
            info_g.index,
        )
        assert info_f.n_evals == 1 + info_f.n_leapfrog
        np.testing.assert_allclose(info_f.accept_prob, info_g.accept_prob, rtol=0, atol=2e-3)
        np.testing.assert_allclose(info_f.energy, info_g.energy, rtol=1e-6, atol=1e-6)
        expected = evaluator(new_g)(EvalRequest(np.empty((0, P)), False, True), True).logp_current
        np.testing.assert_allclose(logp_f, expected, rtol=1e-6, atol=1e-6)
        (new_w,), _, _ = kernel.fused_steps(
            [np.random.default_rng(i)], position[None], [params], wrong
        )
        differ += not np.allclose(new_w, new_g, rtol=1e-5, atol=1e-7)
        moved += info_g.accepted
        position = new_g
    assert moved >= 100, moved
    assert differ >= 100, differ


@pytest.mark.parametrize("precondition", [True, False])
@pytest.mark.parametrize(
    "model_name,prior", [("logistic", "normal"), ("robust", "laplace"), ("logistic", "flat")]
)
def test_fused_rwmh_is_the_generator_step(model_name, prior, precondition):
    """Random-walk MH's compiled transition on the replica (:meth:`RandomWalkMH.fused_steps`)
    against its generator step evaluated on the same conditional, from the same random
    stream, over 300 steps along a chain: the same random numbers drawn, the same
    decisions, the same new position up to rounding (``L z`` in another order), the log
    target and the acceptance probability to 1e-6 (the target's sums in another order,
    with rows at their tight points among the bright ones: see the NUTS test above).
    With and without a preconditioner. Negative control: the compiled step on a target
    with another bound (its linear term moved) must give other acceptance probabilities."""
    from flymc_dist.kernels.base import EvalRequest, run_step
    from flymc_dist.kernels.rwmh import RandomWalkMH

    replica, bound, evaluator, position, model = _fused_case(model_name, prior)
    P = position.size
    cov = np.linalg.inv(-2.0 * bound.A + np.eye(P))
    kernel = RandomWalkMH()
    params = kernel.init_params(P, np.linalg.cholesky(cov) if precondition else None)
    params = params._replace(step_size=params.step_size * (1.0 if precondition else 0.1))
    assert kernel.fuses(params)
    target = replica.fused_targets(bound)
    wrong = replica.fused_targets(bound._replace(b=bound.b + 0.5))
    moved = differ = 0
    for i in range(300):
        rng_g, rng_f = np.random.default_rng(i), np.random.default_rng(i)
        new_g, info_g = run_step(kernel.step(rng_g, position, params), evaluator(position))
        (new_f,), (info_f,), (logp_f,) = kernel.fused_steps(
            [rng_f], position[None], [params], target
        )
        assert rng_f.bit_generator.state == rng_g.bit_generator.state
        np.testing.assert_allclose(new_f, new_g, rtol=1e-12, atol=1e-14)
        assert (info_f.accepted, info_f.index) == (info_g.accepted, info_g.index)
        assert info_f.n_evals == 2
        np.testing.assert_allclose(info_f.accept_prob, info_g.accept_prob, rtol=1e-5, atol=0)
        expected = evaluator(new_g)(EvalRequest(np.empty((0, P)), False, False), True).logp_current
        np.testing.assert_allclose(logp_f, expected, rtol=1e-8, atol=1e-6)
        _, (info_w,), _ = kernel.fused_steps(
            [np.random.default_rng(i)], position[None], [params], wrong
        )
        differ += not np.isclose(info_w.accept_prob, info_g.accept_prob, rtol=1e-3, atol=0)
        moved += info_g.accepted
        position = new_g
    assert 30 <= moved <= 270, moved
    assert differ >= 100, differ


def test_a_changed_rwmh_runs_as_written():
    """A subclass of random-walk MH that changes its step does not fuse (its own step
    runs, as the kernel protocol's negative controls need)."""
    from flymc_dist.kernels.rwmh import RandomWalkMH

    class Changed(RandomWalkMH):
        def _log_ratio(self, logp_new: float, logp_current: float) -> float:
            return 0.0

    params = RandomWalkMH().init_params(3)
    assert RandomWalkMH().fuses(params) and not Changed().fuses(params)
