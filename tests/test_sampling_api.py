"""Deterministic checks of ``fd.sample`` (no statistics): reproducibility, the shape of
``res.stats``, round trips per iteration, exact likelihood-query accounting, and argument
errors. All runs are tiny and in-process (``client="synchronous"``).

The query counts are derived by hand from the round-trip protocol (DESIGN.md §2 "Cost
accounting"; ``Shard.round`` and the z-updates of :mod:`flymc_dist.brightness`):

* regular: every evaluated point costs N queries (one full pass); RWMH and MALA evaluate
  one point per iteration (MALA's gradient at the current point is cached from the
  accepted/kept point), so ``likelihood_queries == N`` every iteration;
* FlyMC, one iteration of RWMH/MALA = z-update at the committed θ, then one point over the
  M_t rows bright after the update (``n_bright`` reports M_t):

  - explicit, ``resample_fraction = f``: ``sum_s ceil(f n_s)`` rows resampled, so
    ``queries_t = sum_s ceil(f n_s) + M_t``;
  - implicit with ``q_db = 1``: every one of the n_s rows proposes (Bernoulli(1)), the
    ones bright *before* the sweep skipped, so ``n_s - M_{t-1,s}`` dark rows evaluated
    and ``queries_t = N - M_{t-1} + M_t`` (t ≥ 1; M_{t-1} is the previous iteration's
    ``n_bright``, continuing across the warm-up/sampling boundary).

Independently of those formulas, :func:`test_query_counters_match_actual_evaluations`
counts every row evaluation the shards really perform (by wrapping the two evaluation
methods) and checks it against the counters for every algorithm and kernel.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from references import logistic_logpost, robust_logpost

import flymc_dist as fd
from flymc_dist.options import READ_AHEAD

STAT_KEYS = ("accepted", "n_bright", "likelihood_queries", "lp", "round_trips", "acceptance_rate")


def _logistic_data(n: int = 40, seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    X = np.column_stack([np.ones(n), x])
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-(0.3 + 1.2 * x)))).astype(np.int64)
    return X, y


def _run(data=None, model=None, **kw):
    args = dict(
        algorithm=fd.FlyMC(bounds="map", z_update="implicit"),
        kernel="rwmh",
        num_warmup=20,
        num_samples=30,
        chains=3,
        seed=7,
        client="synchronous",
        placement=fd.Placement(n_shards=2),
        progress=False,
    )
    args.update(kw)
    return fd.sample(model or fd.LogisticRegression(), data or _logistic_data(), **args)


def _alg(name: str, **flymc):
    """The algorithm called ``name``: FlyMC with the options ``flymc``, or regular MCMC
    (which has none)."""
    return fd.FlyMC(**flymc) if name == "flymc" else fd.Regular()


def _all_stats(res, key: str) -> np.ndarray:
    """Warm-up then sampling stats of one key: (chains, warmup + draws)."""
    return np.concatenate([res.warmup_stats[key], res.stats[key]], axis=1)


# ------------------------------------------------------------------------------ reproducibility
@pytest.mark.parametrize(
    "algorithm,kernel,z_update",
    [
        ("regular", "rwmh", "implicit"),
        ("regular", "slice", "implicit"),
        ("flymc", "rwmh", "implicit"),
        ("flymc", "mala", "explicit"),
        ("flymc", "slice", "implicit"),
    ],
)
def test_same_seed_identical_draws(algorithm, kernel, z_update):
    a = _run(algorithm=_alg(algorithm, z_update=z_update), kernel=kernel, seed=3)
    b = _run(algorithm=_alg(algorithm, z_update=z_update), kernel=kernel, seed=3)
    assert np.array_equal(a.samples, b.samples)
    assert np.array_equal(a.warmup_samples, b.warmup_samples)
    for k in a.stats:
        assert np.array_equal(a.stats[k], b.stats[k]), k


@pytest.mark.parametrize("algorithm", ["regular", "flymc"])
def test_different_seeds_different_draws(algorithm):
    a = _run(algorithm=algorithm, seed=3)
    b = _run(algorithm=algorithm, seed=4)
    assert not np.array_equal(a.samples, b.samples)
    # and the chains of one run differ from each other
    assert not np.array_equal(a.samples[0], a.samples[1])


# -------------------------------------------------------------------------------- stats shape
@pytest.mark.parametrize(
    "algorithm,kernel",
    [("regular", "rwmh"), ("flymc", "rwmh"), ("flymc", "mala"), ("flymc", "slice")],
)
def test_stats_keys_and_shapes(algorithm, kernel, small_run):
    """The session's small run (2 chains, 60 warm-up + 40 draws of 3 weights, 60 rows)."""
    res = small_run(algorithm, kernel)
    assert res.samples.shape == (2, 40, 3)
    assert res.warmup_samples.shape == (2, 60, 3)
    for k in STAT_KEYS:
        assert k in res.stats, k
        assert res.stats[k].shape == (2, 40), k
        assert res.warmup_stats[k].shape == (2, 60), k
    assert res.stats["accepted"].dtype == bool
    assert np.all(np.isfinite(res.stats["lp"]))
    assert np.all(res.stats["likelihood_queries"] >= 0)
    assert np.all((res.stats["n_bright"] >= 0) & (res.stats["n_bright"] <= 60))


def _read_ahead_trips(res) -> None:
    """The driver updating z itself (replica mode, implicit update, read-ahead): one
    request per READ_AHEAD iterations, none in between."""
    trips = _all_stats(res, "round_trips")
    assert trips.max() == 1
    assert np.all(trips.sum(axis=1) == math.ceil(trips.shape[1] / READ_AHEAD))


def test_rwmh_one_round_trip_per_iteration():
    """One round trip per iteration where the shards update z (regular MCMC, the explicit
    update, ``read_ahead=0``); one per READ_AHEAD iterations where the driver does."""
    for algorithm in ("regular", "flymc"):
        for z in ("implicit", "explicit"):
            res = _run(algorithm=_alg(algorithm, z_update=z))
            if algorithm == "flymc" and z == "implicit":
                _read_ahead_trips(res)
                res = _run(algorithm=_alg(algorithm, z_update=z, read_ahead=0))
            assert np.all(_all_stats(res, "round_trips") == 1), (algorithm, z)


def test_mala_two_round_trips_slice_at_least_one():
    """With the shards evaluating every point; on the driver's replica of the bright
    rows (the default for these kernels) every iteration is one round trip, or one per
    READ_AHEAD iterations with the driver's own z-update (the default)."""
    res = _run(kernel="mala", algorithm=fd.FlyMC(bright_replica=False))
    assert np.all(_all_stats(res, "round_trips") == 2)
    res = _run(kernel="slice", algorithm=fd.FlyMC(bright_replica=False))
    assert np.all(_all_stats(res, "round_trips") >= 1)
    for kernel in ("mala", "slice"):
        _read_ahead_trips(_run(kernel=kernel))
        no_ahead = _run(kernel=kernel, algorithm=fd.FlyMC(read_ahead=0))
        assert np.all(_all_stats(no_ahead, "round_trips") == 1)


def test_rejected_steps_keep_position_and_accepted_flags_agree(small_run):
    res = small_run("flymc", "rwmh")
    moved = np.any(np.diff(res.samples, axis=1) != 0, axis=2)
    assert np.array_equal(moved, res.stats["accepted"][:, 1:])


# ------------------------------------------------------------------------------ query counts
def test_regular_queries_are_n_per_evaluated_point():
    X, y = _logistic_data(n=13)
    N = X.shape[0]
    for kernel in ("rwmh", "mala"):
        res = _run((X, y), algorithm="regular", kernel=kernel)
        assert np.all(_all_stats(res, "likelihood_queries") == N), kernel
        assert np.all(_all_stats(res, "n_bright") == N)
        # set-up: one full pass per MAP-search evaluation, then one per chain to start
        passes = res.info["map_info"]["evaluations"]
        assert res.info["setup_queries"] % N == 0
        assert res.info["setup_queries"] >= (3 + passes) * N
    res = _run((X, y), algorithm="regular", kernel="slice")
    q = _all_stats(res, "likelihood_queries")
    assert np.all(q % N == 0) and np.all(q >= 2 * N)  # at least the two interval ends


def test_regular_log_joint_is_the_exact_log_posterior():
    """For regular MCMC ``log_joint`` is log prior + full log likelihood at the draw:
    checked against the independent reference formulas."""
    X, y = _logistic_data()
    res = _run(
        (X, y), model=fd.LogisticRegression(prior="normal", prior_scale=2.0), algorithm="regular"
    )
    lp = logistic_logpost(X, y, 2.0)
    flat = res.samples.reshape(-1, 2)
    np.testing.assert_allclose(res.stats["log_joint"].ravel(), lp(flat), rtol=1e-10, atol=1e-9)

    rng = np.random.default_rng(5)
    Xr = np.column_stack([np.ones(30), rng.normal(size=30)])
    yr = Xr @ [0.3, -0.7] + rng.standard_t(4, size=30)
    model = fd.RobustRegression(nu=4.0, scale=0.8, prior="laplace", prior_scale=1.5)
    res = _run((Xr, yr), model=model, algorithm="regular", kernel="slice")
    lp = robust_logpost(Xr, yr, 4.0, 0.8, 1.5)
    np.testing.assert_allclose(
        res.stats["log_joint"].ravel(), lp(res.samples.reshape(-1, 2)), rtol=1e-10, atol=1e-9
    )


@pytest.mark.parametrize("replica", [False, True])
@pytest.mark.parametrize("fraction", [1.0, 0.3])
@pytest.mark.parametrize("kernel", ["rwmh", "mala"])
def test_flymc_explicit_queries_exact(kernel, fraction, replica):
    """Shards evaluating the kernel's points: the resampled rows and the bright rows at
    the proposal (the current θ's values are cached from the committed proposal). On
    the driver's replica: the replica also evaluates its bright rows at the current θ
    once per iteration (values and gradient), so 2 M."""
    X, y = _logistic_data(n=23)  # shards of 12 and 11 rows
    res = _run(
        (X, y),
        kernel=kernel,
        algorithm=fd.FlyMC(z_update="explicit", resample_fraction=fraction, bright_replica=replica),
    )
    assert res.info["bright_replica"] is replica
    q = _all_stats(res, "likelihood_queries")
    m = _all_stats(res, "n_bright")
    # each row is resampled with probability `fraction` (its own Bernoulli draw, keyed
    # by the row): Binomial(23, fraction) rows per iteration, all 23 at fraction 1
    resampled = q - (2 if replica else 1) * m
    assert np.all((resampled >= 0) & (resampled <= 23))
    if fraction == 1.0:
        assert np.all(resampled == 23)
    else:
        sd = math.sqrt(23 * fraction * (1 - fraction) / resampled.size)
        assert abs(resampled.mean() - 23 * fraction) < 4 * sd, resampled.mean()
        assert resampled.std() > 0  # a random number of rows, not a fixed one
    # initial exact draw of z: every row once per chain
    # one full pass per chain to draw z exactly at the start, plus the MAP search's passes
    assert res.info["setup_queries"] >= 3 * 23 and res.info["setup_queries"] % 23 == 0


@pytest.mark.parametrize("bounds", ["map", "untuned"])
@pytest.mark.parametrize("kernel", ["rwmh", "mala"])
def test_flymc_implicit_q1_queries_exact(kernel, bounds):
    X, y = _logistic_data(n=23)
    N = X.shape[0]
    res = _run(
        (X, y),
        kernel=kernel,
        algorithm=fd.FlyMC(bounds=bounds, z_update="implicit", q_db=1.0, bright_replica=False),
    )
    q = _all_stats(res, "likelihood_queries")
    m = _all_stats(res, "n_bright")
    np.testing.assert_array_equal(q[:, 1:], N - m[:, :-1] + m[:, 1:])
    # the first iteration: N - M_init + M_0 with 0 <= M_init <= N
    assert np.all((q[:, 0] >= m[:, 0]) & (q[:, 0] <= N + m[:, 0]))
    assert m.any() and np.ptp(m) > 0  # M changes between iterations: the check is not vacuous


class CountingLogistic(fd.LogisticRegression):
    """Counts every per-datum likelihood evaluation, whoever makes it and however batched."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.evaluated = 0

    def loglik(self, eta, y):
        self.evaluated += int(np.prod(np.shape(eta)[:2]))
        return super().loglik(eta, y)

    def loglik_grad(self, eta, y):
        self.evaluated += int(np.prod(np.shape(eta)[:2]))
        return super().loglik_grad(eta, y)


@pytest.fixture()
def count_compiled(monkeypatch):
    """Make ``model.evaluated`` also count the rows the compiled kernels evaluate: the
    shards' (one datum at one θ per row; at placement every row at every chain's θ) and
    the driver replica's (every row of the chain's buffer at each point, also in the
    compiled NUTS and RWMH transitions, which count their evaluations themselves, and the
    bright rows and dark proposals of the z-update it runs itself with read-ahead);
    in-process runs only. The replica's iterations run one at a time (a block's in one
    compiled call cannot be counted from here; test_compiled_loop checks that its
    statistics, the queries included, are these bit for bit)."""
    from flymc_dist import _compiled, _compiled_kernels
    from flymc_dist.replica import BrightReplica

    def install(model: CountingLogistic) -> None:
        real = _compiled.eval_rows
        real_at = _compiled.eval_rows_at
        real_replica = _compiled.replica_eval
        real_chains = _compiled_kernels.nuts_chains
        real_rwmh = _compiled_kernels.rwmh_chains
        real_segments = _compiled.eval_segments
        real_propose = _compiled.replica_z_propose

        def counting(XC, D, rows, *args):
            model.evaluated += int(rows.size)
            return real(XC, D, rows, *args)

        def counting_at(XC, D, rows, thetas, *args):  # every row at every θ
            model.evaluated += int(rows.size * thetas.shape[0])
            return real_at(XC, D, rows, thetas, *args)

        def counting_replica(XC, starts, D, chain_of, *args):
            model.evaluated += int(sum(starts[c + 1] - starts[c] for c in chain_of))
            return real_replica(XC, starts, D, chain_of, *args)

        def counting_segments(XC, D, rows, *args):  # the driver's own z-update
            model.evaluated += int(rows.size)
            return real_segments(XC, D, rows, *args)

        def counting_propose(buf, ids, starts, *args):  # the replica's own z-update
            out = real_propose(buf, ids, starts, *args)
            cand_seg = args[13]  # every chain's bright rows, then the proposals evaluated
            model.evaluated += int(starts[-1] - starts[0] + cand_seg[-1])
            return out

        def counting_chains(*args):  # every chain's transition, in one call
            out = real_chains(*args)
            starts, ints = args[9], args[-1]
            model.evaluated += int((np.diff(starts) * ints[:, 2]).sum())
            return out

        def counting_rwmh(*args):  # random-walk MH's, the same way
            out = real_rwmh(*args)
            starts, ints = args[6], args[-1]
            model.evaluated += int((np.diff(starts) * ints[:, 2]).sum())
            return out

        monkeypatch.setattr(_compiled, "eval_rows", counting)
        monkeypatch.setattr(_compiled, "eval_rows_at", counting_at)
        monkeypatch.setattr(_compiled, "replica_eval", counting_replica)
        monkeypatch.setattr(_compiled_kernels, "nuts_chains", counting_chains)
        monkeypatch.setattr(_compiled_kernels, "rwmh_chains", counting_rwmh)
        monkeypatch.setattr(BrightReplica, "loops", lambda self: False)
        monkeypatch.setattr(_compiled, "eval_segments", counting_segments)
        monkeypatch.setattr(_compiled, "replica_z_propose", counting_propose)

    return install


@pytest.mark.parametrize(
    "algorithm,kernel,z_update",
    [
        ("regular", "rwmh", "implicit"),
        ("regular", "mala", "implicit"),
        ("regular", "slice", "implicit"),
        ("flymc", "rwmh", "implicit"),
        ("flymc", "mala", "implicit"),
        ("flymc", "slice", "implicit"),
        ("flymc", "rwmh", "explicit"),
        ("flymc", "slice", "explicit"),
        ("flymc", "nuts", "implicit"),
        ("flymc", "nuts", "explicit"),
    ],
)
@pytest.mark.parametrize("replica", [False, True])
def test_query_counters_match_actual_evaluations(
    algorithm, kernel, z_update, replica, count_compiled
):
    """Count every (datum, θ) likelihood evaluation at the model; the counters must agree,
    with the shards evaluating the kernel's points and on the driver's replica.

    A fixed start and identity preconditioner with untuned bounds: no MAP search.
    """
    model = CountingLogistic()
    count_compiled(model)
    res = _run(
        model=model,
        algorithm=_alg(
            algorithm, z_update=z_update, bounds="untuned", q_db=0.2, bright_replica=replica
        ),
        kernel=kernel,
        init=[0.2, 0.9],
        precondition="identity",
    )
    assert res.info["bright_replica"] is (replica and algorithm == "flymc")
    assert res.info["map"] is None
    counted = (
        res.info["setup_queries"]
        + res.warmup_stats["likelihood_queries"].sum()
        + res.stats["likelihood_queries"].sum()
    )
    assert counted == model.evaluated


@pytest.mark.parametrize("algorithm", ["regular", "flymc"])
def test_query_counters_include_the_map_search(algorithm, count_compiled):
    """With the MAP search (MAP bounds, MAP start, Laplace preconditioner) its full passes
    are set-up queries too: the counters still match every evaluation made."""
    model = CountingLogistic()
    count_compiled(model)
    res = _run(model=model, algorithm=_alg(algorithm, q_db=0.2), kernel="mala")
    assert res.info["map"] is not None and res.info["map_info"]["evaluations"] > 0
    counted = (
        res.info["setup_queries"]
        + res.warmup_stats["likelihood_queries"].sum()
        + res.stats["likelihood_queries"].sum()
    )
    assert counted == model.evaluated


# ------------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"algorithm": "gibbs"}, ValueError, "algorithm"),
        ({"algorithm": "FlyMC "}, ValueError, "algorithm"),
        ({"kernel": "hmc2"}, ValueError, "kernel"),
        (lambda: {"algorithm": fd.FlyMC(bounds="tight")}, ValueError, "bounds"),
        (lambda: {"algorithm": fd.FlyMC(z_update="gibbs")}, ValueError, "z_update"),
        (lambda: {"algorithm": fd.FlyMC(q_db=0.0)}, ValueError, "q_db"),
        (lambda: {"algorithm": fd.FlyMC(q_db=-0.1)}, ValueError, "q_db"),
        (lambda: {"algorithm": fd.FlyMC(q_db=1.5)}, ValueError, "q_db"),
        (lambda: {"algorithm": fd.FlyMC(resample_fraction=0.0)}, ValueError, "resample_fraction"),
        (lambda: {"algorithm": fd.FlyMC(resample_fraction=2.0)}, ValueError, "resample_fraction"),
        ({"step_size": 0.1}, TypeError, "step_size"),
        ({"qdb": 0.1}, TypeError, "qdb"),
        ({"num_samples": 0}, ValueError, "num_samples"),
        ({"chains": 0}, ValueError, "chains"),
        ({"num_warmup": -1}, ValueError, "num_warmup"),
        (lambda: {"kernel": fd.RWMH(no_such_option=1)}, TypeError, "no_such_option"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, exc, match):
    """A bad option is refused when its object is made, a bad keyword by the call."""
    with pytest.raises(exc, match=match):
        _run(**(kwargs() if callable(kwargs) else kwargs))


_X, _Y = _logistic_data()


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"seed": -1}, ValueError, r"seed must be an integer >= 0, not -1"),
        ({"seed": "abc"}, ValueError, r"seed must be an integer >= 0, not 'abc'"),
        ({"seed": None}, ValueError, r"seed must be an integer >= 0, not None"),
        ({"seed": 1.5}, ValueError, "seed"),
        ({"seed": True}, ValueError, "seed"),
        (
            lambda: {"placement": fd.Placement(timeout=0)},
            ValueError,
            r"timeout must be a number of seconds > 0, not 0",
        ),
        (lambda: {"placement": fd.Placement(timeout="10")}, ValueError, "timeout"),
        (lambda: {"placement": fd.Placement(timeout=float("inf"))}, ValueError, "timeout"),
        (
            {"data": _X},
            TypeError,
            r"data must be a Dataset, a store path or an \(X, y\) tuple, not "
            r"ndarray of shape \(40, 2\)$",
        ),
        ({"data": [_X, _Y]}, TypeError, "data must be"),
        ({"data": (_X, _Y, _Y)}, ValueError, r"\(X, y\), not a tuple of 3"),
        ({"data": (_X[:, :0], _Y)}, ValueError, "at least one column"),
        ({"data": (_X.astype(str), _Y)}, ValueError, "X must hold real numbers.*dtype <U"),
        ({"data": (_X, _Y.astype(str))}, ValueError, "y must hold real numbers"),
        (
            lambda: {"algorithm": fd.FlyMC(resample_fraction="x")},
            ValueError,
            r"resample_fraction must be a number in \(0, 1\]",
        ),
        (lambda: {"algorithm": fd.FlyMC(resample_fraction=True)}, ValueError, "resample_fraction"),
        (
            lambda: {"algorithm": fd.FlyMC(q_db=True)},
            ValueError,
            r"q_db must be 'auto' or a number in \(0, 1\], not True",
        ),
        (lambda: {"algorithm": fd.FlyMC(q_db="0.5")}, ValueError, "q_db"),
        ({"checkpoint_every": 0}, ValueError, "checkpoint_every must be an integer >= 1"),
        (
            lambda: {"placement": fd.Placement(n_workers=0)},
            ValueError,
            "n_workers must be None or an integer >= 1",
        ),
        (lambda: {"placement": fd.Placement(n_shards=0)}, ValueError, "n_shards"),
        (lambda: {"placement": fd.Placement(n_shards=True)}, ValueError, "n_shards"),
        (
            lambda: {"placement": fd.Placement(n_shards=2, rows_per_shard=10)},
            ValueError,
            "not both",
        ),
        ({"map_maxiter": -1}, ValueError, "map_maxiter"),
        ({"num_samples": True}, ValueError, "num_samples"),
        ({"init": "zero"}, ValueError, "init must be 'map' or an array"),
        (
            {"precondition": "diag"},
            ValueError,
            "precondition must be 'laplace' or 'bound' or 'identity'",
        ),
        ({"resume": True}, ValueError, "resume=True needs trace="),
        ({"resume": "yes", "trace": "t.zarr"}, ValueError, "resume must be True or False"),
        ({"progress": "yes"}, ValueError, "progress"),
        ({"trace": 3}, ValueError, "trace must be a path"),
    ],
)
def test_every_argument_is_checked_before_anything_starts(
    kwargs, exc, match, monkeypatch, tmp_path
):
    """One line naming the argument and what it takes, before a cluster (client=None) or a
    trace is started."""
    import distributed

    def no_cluster(*args, **kw):
        raise AssertionError("a LocalCluster was started before the arguments were checked")

    monkeypatch.setattr(distributed, "LocalCluster", no_cluster)
    monkeypatch.chdir(tmp_path)
    args = dict(
        algorithm="flymc",
        num_warmup=5,
        num_samples=5,
        chains=2,
        seed=0,
        client=None,
        progress=False,
    )
    with pytest.raises(exc, match=match) as info:
        args.update(kwargs() if callable(kwargs) else kwargs)
        data = args.pop("data", (_X, _Y))
        fd.sample(fd.LogisticRegression(), data, **args)
    assert "\n" not in str(info.value)
    assert os.listdir(tmp_path) == []


def test_q_db_one_is_allowed():
    res = _run(algorithm=fd.FlyMC(q_db=1.0), num_warmup=2, num_samples=3)
    assert res.samples.shape == (3, 3, 2)


def test_q_db_auto_has_no_floor_in_proportion_to_n():
    """ "auto" proposes about as many dark rows per iteration as there are bright ones,
    whatever N, and at least about one: on 400,000 rows, where MAP-tuned bounds leave a
    few rows bright, q·N is a few proposals (the old floor q >= 1e-5 made it 4, and 40
    at N = 4e6)."""
    n = 400_000
    res = _run(
        _logistic_data(n),
        num_warmup=0,
        num_samples=2,
        chains=2,
        placement=fd.Placement(n_shards=1),
    )
    q = res.info["q_db"]
    assert 1.0 / n <= q < 1e-5
    bright = float(res.stats["n_bright"].mean())
    assert q * n <= max(4.0 * bright, 4.0)
    # a small data set keeps the floor 1/N: one proposal per iteration at least
    small = _run(num_warmup=0, num_samples=2)
    assert small.info["q_db"] >= 1.0 / 40


def test_bad_model_and_data_raise():
    X, y = _logistic_data()
    with pytest.raises(TypeError, match="model"):
        fd.sample("logistic", (X, y), client="synchronous")
    with pytest.raises(ValueError):
        _run((X[:, :, None], y))
    with pytest.raises(ValueError):
        _run((X[:-1], y))
    Xn = X.copy()
    Xn[3, 1] = np.nan
    with pytest.raises(ValueError, match="finite"):
        _run((Xn, y))
    with pytest.raises(ValueError):  # real-valued targets for a binary model
        _run((X, y + 0.5))


def test_init_as_ndarray_accepted():
    res = _run(
        algorithm="regular",
        init=np.array([0.2, 0.9]),
        precondition="identity",
        num_warmup=0,
        num_samples=3,
    )
    assert res.samples.shape == (3, 3, 2)


def test_init_list_is_used_as_start():
    res = _run(
        algorithm="regular",
        init=[0.2, 0.9],
        precondition="identity",
        num_warmup=0,
        num_samples=1,
        chains=2,
    )
    assert res.info["map"] is None
    first = res.samples[:, 0]
    start = np.array([0.2, 0.9])
    # each chain either stayed at the start or moved from it
    stayed = ~res.stats["accepted"][:, 0]
    assert np.array_equal(first[stayed], np.broadcast_to(start, first[stayed].shape))


def test_in_memory_softmax_accepted():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(30, 1))
    y = np.arange(30) % 3
    res = _run((X, y), model=fd.SoftmaxRegression(n_classes=3), num_warmup=2, num_samples=3)
    assert res.samples.shape == (3, 3, 3, 1)


def test_timing_breakdown_adds_up():
    """``info["timing"]``: per post-warm-up iteration, step = round trip + driver, and the
    host served one round per RWMH iteration (the shards updating z: ``read_ahead=0``),
    each taking at most the round trip's time."""
    res = _run(num_warmup=10, num_samples=40, algorithm=fd.FlyMC(read_ahead=0))
    t = res.info["timing"]
    assert t["iterations"] == 40
    assert t["step"] > 0 and t["round_trip"] > 0 and t["driver"] > 0
    assert t["step"] == pytest.approx(t["round_trip"] + t["driver"])
    (host,) = t["hosts"]
    assert host["rounds"] == 40
    assert 0 < host["round_wall"] <= t["round_trip"] * 1.0001


def test_softmax_flat_prior_is_refused_before_anything_runs(tmp_path):
    """Softmax weights are identified only up to one vector added to every class: with a
    flat prior the posterior is improper, so sampling it is refused (nothing written)."""
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(60), rng.normal(size=60)])
    y = rng.integers(0, 3, size=60).astype(float)
    trace = tmp_path / "t.zarr"
    with pytest.raises(ValueError, match="improper posterior"):
        fd.sample(
            fd.SoftmaxRegression(3, prior="flat"),
            (X, y),
            client="synchronous",
            num_warmup=5,
            num_samples=5,
            chains=1,
            progress=False,
            trace=str(trace),
        )
    assert not trace.exists()
    res = fd.sample(
        fd.SoftmaxRegression(3, prior="normal"),
        (X, y),
        client="synchronous",
        num_warmup=5,
        num_samples=5,
        chains=1,
        progress=False,
    )
    assert res.samples.shape == (1, 5, 3, 2)


def test_precondition_bound_is_theta_given_every_datum_dark():
    """``precondition="bound"``: the metric seeded from the Gaussian of θ given that every
    datum is dark — the precision ``Σ_n 2|a_n| x_n x_nᵀ`` of the Jaakkola–Jordan bounds
    tight at the MAP plus the prior's, computed here from the data — and kept through
    warm-up with ``adapt_metric=False``; the starting points are the Laplace-jittered
    ones of the default. Regular MCMC has no bounds: refused before anything runs."""
    from flymc_dist.models.families import jaakkola_jordan_coefficients

    X, y = _logistic_data(200)
    laplace = _run((X, y), kernel="nuts", num_warmup=0, num_samples=1)
    for kernel in (fd.NUTS(adapt_metric=False), fd.HMC(adapt_metric=False)):
        res = _run(
            (X, y),
            kernel=kernel,
            num_warmup=60,
            num_samples=2,
            precondition="bound",
        )
        a, _ = jaakkola_jordan_coefficients(X @ res.info["map"])
        precision = (X.T * (-2.0 * a)) @ X + fd.LogisticRegression().prior_precision(2)
        for p in res.info["kernel_params"]:
            np.testing.assert_allclose(p["inv_metric"], np.linalg.inv(precision), rtol=1e-8)
        assert not np.allclose(
            laplace.info["kernel_params"][0]["inv_metric"], np.linalg.inv(precision), rtol=1e-3
        )
    with pytest.raises(ValueError, match="precondition='bound' needs FlyMC"):
        _run((X, y), algorithm="regular", kernel="nuts", precondition="bound")


def test_q_db_auto_is_four_proposals_per_bright_row_for_hamiltonian_kernels():
    """HMC and NUTS cross θ's conditional given z every step: q_db="auto" is four times
    RWMH's from the same first z (same seed, same starting points). Ten features, so that
    several rows are bright (with less than one, the floor of one proposal binds)."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(2000, 9))
    X = np.column_stack([np.ones(2000), x])
    y = (rng.random(2000) < 1.0 / (1.0 + np.exp(-(0.3 + x @ np.full(9, 0.8))))).astype(np.int64)
    rwmh = _run((X, y), num_warmup=0, num_samples=1)
    assert rwmh.info["q_db"] * 2000 > 2  # above the floor
    for kernel in ("nuts", "hmc"):
        res = _run((X, y), kernel=kernel, num_warmup=0, num_samples=1)
        assert res.info["q_db"] == pytest.approx(4.0 * rwmh.info["q_db"], rel=1e-12)


def test_an_unknown_option_is_refused_naming_it():
    """An option that is not one (a typo, one removed, or an option of the algorithm,
    kernel or placement objects given as a keyword) is refused before anything runs:
    Python's TypeError naming it."""
    for name in ("hot_rowz", "speculate", "q_db", "n_shards"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            _run(**{name: 0.01})


@pytest.mark.parametrize(
    "algorithm,expected", [("flymc", "nuts"), ("regular", "nuts"), ("austerity", "rwmh")]
)
def test_default_kernel_is_nuts_except_for_austerity(algorithm, expected):
    """With no kernel named, FlyMC and regular MCMC run NUTS (the kernel that converges on
    real posteriors) and austerity its only kernel, RWMH."""
    args = dict(
        algorithm=algorithm, num_warmup=10, num_samples=5, chains=2, seed=1,
        client="synchronous", progress=False,
    )  # fmt: skip
    res = fd.sample(fd.LogisticRegression(), _logistic_data(), **args)
    assert res.info["kernel"] == expected
    assert res.info["kernel_repr"].startswith({"nuts": "NUTS(", "rwmh": "RandomWalkMH("}[expected])


def _separable(n: int = 200, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Logistic data whose classes a line separates (y = 1 exactly where x > 0.1)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    return np.column_stack([np.ones(n), x]), (x > 0.1).astype(np.int64)


@pytest.mark.parametrize(
    "algorithm, kw",
    [
        ("flymc", {}),
        ("regular", {"kernel": "nuts"}),
        ("austerity", {"kernel": "rwmh"}),
        # no MAP needed by the settings: the search runs all the same to check
        (fd.FlyMC(bounds="untuned"), {"init": [0.0, 0.0], "precondition": "identity"}),
    ],
)
def test_flat_prior_on_separable_data_is_refused(algorithm, kw):
    """Logistic regression with a flat prior on separable data has an improper posterior
    (the likelihood keeps growing along the separating direction): refused in one line
    naming the cause, as softmax with a flat prior is, instead of draws of 1e6-1e26."""
    with pytest.raises(ValueError, match="improper posterior") as info:
        _run(_separable(), fd.LogisticRegression(prior="flat"), algorithm=algorithm, **kw)
    msg = str(info.value)
    assert "\n" not in msg and "separa" in msg and "prior='normal'" in msg


def test_flat_prior_is_refused_along_a_direction_the_data_do_not_inform():
    """Two equal columns and a flat prior: the likelihood is constant along their
    difference, so the posterior is improper too."""
    X, y = _logistic_data(n=200)
    X = np.column_stack([X, X[:, 1]])
    with pytest.raises(ValueError, match="improper posterior"):
        _run((X, y), fd.LogisticRegression(prior="flat"))


def test_flat_prior_on_overlapping_classes_is_sampled():
    """The check has no false alarm: overlapping classes (a finite MLE) sample as before,
    with the flat prior or a proper one, small or large coefficients."""
    res = _run(_logistic_data(n=200), fd.LogisticRegression(prior="flat"))
    assert np.all(np.isfinite(res.samples)) and np.abs(res.samples).max() < 10
    rng = np.random.default_rng(5)
    x = rng.normal(size=400)
    y = (rng.random(400) < 1 / (1 + np.exp(-(0.01 + 0.01 * x)))).astype(np.int64)
    _run((np.column_stack([np.ones(400), x]), y), fd.LogisticRegression(prior="flat"))
    y = (rng.random(400) < 1 / (1 + np.exp(-8 * x))).astype(np.int64)  # nearly separable
    if (y[x > 0] == 0).any() or (y[x < 0] == 1).any():
        _run((np.column_stack([np.ones(400), x]), y), fd.LogisticRegression(prior="flat"))
    _run(_separable(), fd.LogisticRegression(prior="normal"))
