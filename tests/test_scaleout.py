"""Replica mode without a round per iteration (:mod:`flymc_dist.ahead`), checked
deterministically: the driver's z-update gives the shards' draws bit for bit, in process
and on 1, 2 and 4 workers; over 1,000 iterations each host is sent one request per
``read_ahead`` iterations and a few more; a host whose replies come 50 ms late changes
no draw. The shard-evaluated regime (``bright_replica=False``) stays layout-free beside
it. (Exactness is the shards' z-update's, shown statistically in test_exactness.py;
fault recovery in this mode: test_cluster.py's ``test_worker_killed_mid_run``.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
from draws import same_draws
from scipy.special import expit

import flymc_dist as fd
from flymc_dist.ahead import BLOCK_BYTES, REPLY_BYTES, Block, fitting_depth
from flymc_dist.bench.delay import delayed_channels
from flymc_dist.options import READ_AHEAD


def _data(n: int = 4000, seed: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.c_[np.ones(n), rng.normal(size=(n, 2))]
    y = (rng.random(n) < expit(X @ np.array([0.3, -1.0, 0.7]))).astype(np.int64)
    return X, y


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    X, y = _data()
    return fd.from_numpy(X, y, str(tmp_path_factory.mktemp("so") / "d.zarr"), chunk_rows=250)


def _run(
    data,
    client,
    *,
    warmup: int = 60,
    draws: int = 90,
    kernel: str = "nuts",
    channel: str = "auto",
    **fly,
):
    return fd.sample(
        fd.LogisticRegression(),
        data,
        fd.FlyMC(**fly),
        kernel,
        num_warmup=warmup,
        num_samples=draws,
        chains=3,
        seed=5,
        client=client,
        placement=fd.Placement(channel=channel),
        progress=False,
    )


@pytest.mark.parametrize(
    "fly",
    [{}, {"bounds": "untuned", "bright_replica": True}, {"q_db": 0.05}],
    ids=["map", "untuned-many-bright", "many-proposals"],
)
@pytest.mark.parametrize("kernel", ["nuts", "slice"])
def test_driver_z_update_is_the_shards(kernel, fly):
    """In process, 1 and 3 shards: the driver's z-update (read ahead by 4 and by the
    default) against the shards' per-iteration round (``read_ahead=0``): the same draws,
    bright counts and queries; and far fewer round trips."""
    data = _data(1500)
    ref = _run(data, "synchronous", kernel=kernel, read_ahead=0, **fly)
    assert ref.info["read_ahead"] == 0 and ref.info["bright_replica"]
    assert ref.stats["n_bright"].mean() > (10 if "bounds" in fly else 0)
    for depth, shards in ((4, 1), (READ_AHEAD, 3)):
        res = fd.sample(
            fd.LogisticRegression(),
            data,
            fd.FlyMC(read_ahead=depth, **fly),
            kernel,
            num_warmup=60,
            num_samples=90,
            chains=3,
            seed=5,
            client="synchronous",
            placement=fd.Placement(n_shards=shards),
            progress=False,
        )
        assert res.info["read_ahead"] == depth
        same_draws(ref, res)
        trips = res.stats["round_trips"][0].sum() + res.warmup_stats["round_trips"][0].sum()
        assert trips == math.ceil(150 / depth)  # the first block's asked for in set-up


def test_a_bad_read_ahead_is_refused():
    with pytest.raises(ValueError, match="read_ahead"):
        fd.FlyMC(read_ahead=-1)


@pytest.mark.slow
@pytest.mark.cluster
def test_draws_identical_on_1_2_4_workers(ds, local_clusters):
    """The default (replica mode, z on the driver) in process and on 1, 2 and 4 workers
    (one shard each): the same draws; and the shard-evaluated regime
    (``bright_replica=False``) in process and on 2 workers: its own same draws."""
    from distributed import Client

    ref = _run(ds, "synchronous")
    assert ref.info["read_ahead"] == READ_AHEAD
    # the shards' own sums are added shard by shard: the layout's two shards in process
    plain = fd.sample(
        fd.LogisticRegression(),
        ds,
        fd.FlyMC(bright_replica=False),
        "nuts",
        num_warmup=60,
        num_samples=90,
        chains=3,
        seed=5,
        client="synchronous",
        placement=fd.Placement(n_shards=2),
        progress=False,
    )
    for workers in (1, 2, 4):
        with Client(local_clusters.get(workers), direct_to_workers=True) as client:
            res = _run(ds, client)
            # read_ahead iterations per host in each request
            assert res.info["n_shards"] == workers
            assert res.info["read_ahead"] == READ_AHEAD * workers
            same_draws(ref, res)
            if workers == 2:
                same_draws(plain, _run(ds, client, bright_replica=False))


def test_the_steps_per_request_fit_every_host():
    """A read-ahead request asks for as many steps as keep every host's cost within
    REPLY_BYTES, summing the shards a host holds (as after a recovery put two on one),
    and all of them within BLOCK_BYTES; none where one step is over (the shards then
    update z, a round per iteration)."""
    step = REPLY_BYTES // 10  # a whole byte count: 10 steps fit, 11 do not
    assert fitting_depth(16, [step, step], [[0], [1]]) == 10
    assert fitting_depth(8, [step, step], [[0], [1]]) == 8
    assert fitting_depth(16, [step, step], [[0, 1]]) == 5
    assert fitting_depth(16, [step, 2 * REPLY_BYTES], [[0], [1]]) == 0
    # many hosts, each reply small: the driver's whole block stays within BLOCK_BYTES
    small = BLOCK_BYTES // 400  # 16 hosts' steps: 25 fit in BLOCK_BYTES, 26 do not
    assert fitting_depth(128, [small] * 16, [[i] for i in range(16)]) == 25
    assert fitting_depth(128, [small] * 16, [[i] for i in range(16)]) < REPLY_BYTES // small


@pytest.mark.cluster
def test_large_proposals_are_read_ahead_in_fewer_steps_or_by_rounds(
    ds, local_clusters, monkeypatch
):
    """On 2 workers at q 0.05 (48 kB of proposals a step and shard, counted with their
    copies: 8 (4·3 + 3 + 5) bytes × 3 chains × 0.05 × 2,000 rows), the steps per request
    follow REPLY_BYTES — 2 steps under 100 kB, rounds under 40 kB — and the draws are
    the default's. A reply longer than the channel's frames is an error naming its
    size, at once: before, the driver took the host for lost, recreated its shards and
    asked again, five times (a 10⁶ × 10 run at q 0.05 on two workers, its 79-126 MB
    replies against 64 MiB frames, ended so with no worker lost)."""
    from distributed import Client

    with Client(local_clusters.get(2), direct_to_workers=True) as client:
        ref = _run(ds, client, q_db=0.05)
        assert ref.info["read_ahead"] == 2 * READ_AHEAD  # read_ahead iterations per host
        for cap, depth in ((100_000, 2), (40_000, 0)):
            monkeypatch.setattr("flymc_dist.ahead.REPLY_BYTES", cap)
            res = _run(ds, client, q_db=0.05)
            assert res.info["read_ahead"] == depth
            same_draws(ref, res)
        monkeypatch.setattr("flymc_dist.ahead.REPLY_BYTES", REPLY_BYTES)
        monkeypatch.setattr("flymc_dist.transport.channel.MAX_FRAME", 100_000)
        with pytest.raises(ValueError, match=r"replied with [\d,]+ bytes, more than") as e:
            _run(ds, client, q_db=0.05, channel="tcp")  # asked (a local host lends)
        assert "\n" not in str(e.value)


@pytest.mark.cluster
def test_hot_path_sends_each_host_one_request_per_read_ahead(ds, local_clusters):
    """1,000 iterations on 2 workers asked for their proposals (on TCP, as hosts on
    other machines are: local ones lend their rows instead, test_lend.py): each host is
    sent at most ⌈1000/T⌉ requests and a few more (the timing reads of the run's end),
    counted where the transport sends (``host_messages``); the per-iteration round
    trips add up to one per T."""
    from distributed import Client

    with Client(local_clusters.get(2), direct_to_workers=True) as client:
        res = _run(ds, client, warmup=200, draws=800, channel="tcp")
    assert res.info["channel"] == "socket" and res.info["lending_hosts"] == 0
    sent = res.info["host_messages"]
    assert len(sent) == 2
    assert res.info["read_ahead"] == 2 * READ_AHEAD  # read_ahead iterations per host
    bound = math.ceil(1000 / res.info["read_ahead"])
    assert all(bound <= n <= bound + 4 for n in sent.values()), sent
    trips = res.stats["round_trips"][0].sum() + res.warmup_stats["round_trips"][0].sum()
    assert trips == bound


@pytest.mark.cluster
def test_a_slow_host_changes_no_draw(ds, local_clusters):
    """The first host's replies delayed by 50 ms (a delaying proxy before its round
    channel): the same draws as without."""
    from distributed import Client

    with Client(local_clusters.get(2), direct_to_workers=True) as client:
        ref = _run(ds, client)
        with delayed_channels(lambda i: 0.05 if i == 0 else 0.0) as proxies:
            res = _run(ds, client)
        assert len(proxies) == 2 and res.info["channel"] == "socket"
    same_draws(ref, res)


#: the read-ahead block's own constructor (before any test records it)
_BLOCK_INIT = Block.__init__

#: read-ahead iterations per host for the block tests: several blocks in a short run
AHEAD = 32


def _blocks_built(monkeypatch, fail_at: int | None = None) -> list[tuple[int, str]]:
    """Record each read-ahead block built (its first step, the thread's name); the one
    whose first step is ``fail_at`` raises instead."""
    import threading

    from flymc_dist import ahead

    built: list[tuple[int, str]] = []
    init = _BLOCK_INIT

    def recording(self, first, parts, n_pairs, replica):
        built.append((first, threading.current_thread().name))
        if first == fail_at:
            raise ValueError(f"no block at {first}")
        init(self, first, parts, n_pairs, replica)

    monkeypatch.setattr(ahead.Block, "__init__", recording)
    return built


#: seconds every host's replies come late where the driver is to ask first, and the
#: driver waits before each block where the answers are to come first: far more than a
#: block's iterations or a host's answer take on a loaded machine (at 0.05 s, the driver
#: under load was once the later one)
LATE = 0.3


@pytest.mark.cluster
@pytest.mark.parametrize("first", ["answers", "driver"])
def test_a_block_is_built_by_whoever_comes_first(first, ds, local_clusters, monkeypatch):
    """On the round channel a read-ahead block is built off the driver's thread when the
    hosts' answers come before the driver asks for them (here the driver sleeps LATE
    seconds before each block), and by the driver itself when it asks first (here every
    host's replies come LATE seconds late); the same draws as in process either way."""
    import threading
    import time

    from distributed import Client

    from flymc_dist.ahead import ReadAhead

    # three blocks in the run's 150 iterations: AHEAD iterations per host (2 hosts) a block
    ref = _run(ds, "synchronous", read_ahead=AHEAD)
    built = _blocks_built(monkeypatch)
    if first == "answers":
        take = ReadAhead.block

        def late(self, positions):
            if self.held is None or self.step >= self.held.first + self.depth:
                time.sleep(LATE)  # a new block is taken: its answers are in by now
            return take(self, positions)

        monkeypatch.setattr(ReadAhead, "block", late)
    with (
        Client(local_clusters.get(2), direct_to_workers=True) as client,
        delayed_channels(lambda i: LATE if first == "driver" else 0.0),
    ):
        res = _run(ds, client, read_ahead=AHEAD)
    assert res.info["channel"] == "socket"
    T, its = res.info["read_ahead"], 60 + 90  # _run's warm-up and draws
    taken = [t for f, t in built if f < its]  # the blocks the run took
    assert sorted(f for f, _ in built if f < its) == [0, T, 2 * T]
    main = threading.main_thread().name
    assert all((t == main) == (first == "driver") for t in taken), built
    same_draws(ref, res)


@pytest.mark.cluster
def test_a_block_that_cannot_be_built_fails_the_run_that_needs_it(ds, local_clusters, monkeypatch):
    """A block's error (wherever it is built) is raised where the driver takes the block;
    the requests read ahead past a run's end are dropped, their blocks built or not as
    their answers come (and then their errors dropped too), and the run ends as it
    would."""
    from distributed import Client

    with Client(local_clusters.get(2), direct_to_workers=True) as client:
        T = _run(ds, client, warmup=5, draws=5, read_ahead=AHEAD).info["read_ahead"]
        _blocks_built(monkeypatch, fail_at=T)
        with pytest.raises(ValueError, match=f"no block at {T}"):
            _run(ds, client, warmup=T - 10, draws=20, read_ahead=AHEAD)
        _blocks_built(monkeypatch, fail_at=3 * T)  # in flight at the end: dropped
        res = _run(ds, client, warmup=T, draws=T, read_ahead=AHEAD)
    assert res.samples.shape == (3, T, 3)


def _driver(kernel: str, budget: float = 2**30):
    """A replica-mode driver on 3 in-process shards, z on the driver, untuned bounds
    (tens of bright rows per chain)."""
    from flymc_dist.driver import Driver
    from flymc_dist.kernels import get_kernel
    from flymc_dist.layout import shard_layout
    from flymc_dist.protocol import ShardConfig
    from flymc_dist.transport.inprocess import InProcessTransport

    X, y = _data(1500)
    model = fd.LogisticRegression()
    specs, mem, n_rows, n_features, *_ = shard_layout((X, y), fd.Placement(n_shards=3))
    kern = get_kernel(kernel)
    config = ShardConfig(
        model=model, algorithm="flymc", chains=3, seed=5, n_rows=n_rows,
        track_grad=kern.needs_grad,
    )  # fmt: skip
    transport = InProcessTransport(specs, config, mem)
    algorithm = fd.FlyMC(bounds="untuned", q_db=0.05, replica_budget=budget)
    driver = Driver(
        model, transport, kern, n_features=n_features, algorithm=algorithm, chains=3,
        seed=5, n_rows=n_rows,
    )  # fmt: skip
    driver.setup()
    return driver, transport


def _shards_z(transport) -> list[np.ndarray]:
    """Each chain's bright rows on the shards, global ids."""
    hosts = transport.host.shards
    return [
        np.concatenate(
            [hosts[s.shard_id].chains[c].bright.members + s.start for s in transport.specs]
        )
        for c in range(3)
    ]


@pytest.mark.parametrize("kernel", ["slice", "nuts"])
def test_replica_over_budget_hands_z_back_to_the_shards(kernel, caplog):
    """``bright_replica="auto"``, the replica outgrowing its budget mid-run: the shards
    take the driver's z and go on where its z-updates would have — the next z-update on
    the shards gives the bright sets the driver's own would have, exactly."""
    stay, _ = _driver(kernel)
    move, transport = _driver(kernel)
    assert stay.ahead is not None and move.ahead is not None
    for _ in range(5):
        stay.step()
        move.step()
    np.testing.assert_array_equal(stay.positions, move.positions)
    move.replica_budget = 0.0  # the next step outgrows it
    stay.step()
    move.step()
    assert move.ahead is None and move.replica is None
    assert "outgrew replica_budget" in caplog.text
    for a, b in zip(stay.replica.bright_ids(), _shards_z(transport), strict=True):
        np.testing.assert_array_equal(a, b)  # handed back as the driver held it
    np.testing.assert_array_equal(stay.positions, move.positions)
    stay.step()
    st = move.step()  # a shard-evaluated round: z updated there, at the same positions
    assert st["round_trips"][0] >= 1
    for a, b in zip(stay.replica.bright_ids(), _shards_z(transport), strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(move.positions))
    for _ in range(5):
        move.step()


@pytest.mark.slow
def test_out_of_core_shards_serve_the_read_ahead(ds):
    """Out of core (the proposed rows read from the row file by position): the driver's
    z-update gives the draws of the shards' own out-of-core update."""

    def run(depth: int):
        return fd.sample(
            fd.LogisticRegression(),
            ds,
            fd.FlyMC(read_ahead=depth, q_db=0.05),
            "nuts",
            num_warmup=40,
            num_samples=60,
            chains=3,
            seed=5,
            client="synchronous",
            placement=fd.Placement(n_shards=2, out_of_core=True),
            progress=False,
        )

    ref, res = run(0), run(8)
    assert res.info["out_of_core"] == [True, True] and res.info["rows_read"] > 0
    same_draws(ref, res)


def test_a_block_merges_the_shards_proposals_pair_by_pair():
    """:class:`~flymc_dist.ahead.Block` from three shards' answers (one with no row): each
    pair's ids shard after shard, at their rows in the joined rows — against the same
    merge written plainly; and parts out of row order take the general path (a stable
    sort by pair, rows by id) to the same rows, with their constants, for every id."""
    from flymc_dist.ahead import Block
    from flymc_dist.protocol import Proposals
    from flymc_dist.replica import BrightReplica

    rng = np.random.default_rng(3)
    n_pairs, D = 12, 3
    parts = []
    for lo, hi, rate in ((0, 500, 2.0), (500, 900, 0.0), (900, 2000, 3.0)):
        per_pair = [np.sort(rng.choice(np.arange(lo, hi), rng.poisson(rate), replace=False))
                    for _ in range(n_pairs)]  # fmt: skip
        ids = np.concatenate(per_pair).astype(np.int64)
        seg = np.r_[0, np.cumsum([a.size for a in per_pair])].astype(np.int64)
        rows, at = np.unique(ids, return_inverse=True)
        X = rng.normal(size=(rows.size, D))
        y, xi = (rows % 2).astype(float), 0.1 * X[:, 0]
        consts = fd.LogisticRegression().row_constants(y, xi)
        parts.append(Proposals(ids, seg, rows, at, X, y, xi, consts))
    replica = BrightReplica(fd.LogisticRegression(), 3, [(0, 500), (500, 900), (900, 2000)])
    block = Block(5, parts, n_pairs, replica)
    X_all = np.concatenate([p.X for p in parts])
    rows_all = np.concatenate([p.rows for p in parts])
    for p in range(n_pairs):
        want = np.concatenate([q.ids[q.seg[p] : q.seg[p + 1]] for q in parts])
        got = block.ids[block.seg[p] : block.seg[p + 1]]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(rows_all[block.at[block.seg[p] : block.seg[p + 1]]], want)
    np.testing.assert_array_equal(block.rows[0][:, :D], X_all)  # the features, then consts
    np.testing.assert_array_equal(block.rows[0][:, D:], np.concatenate([q.consts for q in parts]))
    assert block.first == 5 and block.seg[-1] == sum(q.ids.size for q in parts) > 0
    # out of row order: the general path, every id at its own row
    other = Block(5, parts[::-1], n_pairs, replica)
    assert other.seg.tolist() == block.seg.tolist()
    np.testing.assert_array_equal(np.sort(other.ids), np.sort(block.ids))
    for b in (block, other):
        X = b.rows[0][:, :D]
        for k, i in enumerate(b.ids):
            q = next(q for q in parts if i in q.rows)
            j = np.searchsorted(q.rows, i)
            np.testing.assert_array_equal(X[b.at[k]], q.X[j])
            np.testing.assert_array_equal(b.rows[0][b.at[k], D:], q.consts[j])


@pytest.mark.parametrize("kernel", ["nuts", "rwmh"])
def test_float32_rows_travel_as_float32_with_the_same_draws(kernel, tmp_path, monkeypatch):
    """A float32 store's proposed rows reach the driver as float32 (exact, half the
    bytes), a float64 store's as float64; the draws are the shards' own update's
    (``read_ahead=0``) and those of a float64 store holding the same values, bit for
    bit."""
    from flymc_dist import ahead

    X, y = _data(1500)
    X = X.astype(np.float32).astype(np.float64)  # values a float32 store holds exactly
    f32 = fd.from_numpy(X, y, str(tmp_path / "f32.zarr"), chunk_rows=250, dtype="float32")
    f64 = fd.from_numpy(X, y, str(tmp_path / "f64.zarr"), chunk_rows=250)
    seen: list = []
    init = ahead.Block.__init__

    def recording(self, first, parts, n_pairs, replica):
        seen.extend(p.X.dtype for p in parts)
        init(self, first, parts, n_pairs, replica)

    monkeypatch.setattr(ahead.Block, "__init__", recording)
    ref = _run(f32, "synchronous", kernel=kernel, read_ahead=0)
    assert not seen  # no read-ahead: the shards update z
    res = _run(f32, "synchronous", kernel=kernel)
    assert seen and set(seen) == {np.dtype(np.float32)}
    same_draws(ref, res)
    seen.clear()
    same_draws(ref, _run(f64, "synchronous", kernel=kernel))
    assert seen and set(seen) == {np.dtype(np.float64)}
