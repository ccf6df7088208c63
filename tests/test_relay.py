"""The relay tree of the shard-evaluated regime (``bright_replica=False``): the driver
sends each round to at most ``Placement.fanout`` hosts, which forward it down a tree of
hosts and answer with partial sums along the fixed block tree. Checked deterministically:
the merge of partial sums is the driver's own sum bit for bit, the tree's shape, the same
draws with and without the tree on 1, 2 and 4 workers, and the driver's messages per
round. (A host killed below a relay: test_cluster.py's ``test_worker_killed_mid_run``,
``rwmh-relayed``; a relayed frame's authentication: test_channel.py.)"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from scipy.special import expit
from synthetic import logistic_rows

import flymc_dist as fd
from flymc_dist.driver import Driver
from flymc_dist.protocol import (
    Reply,
    Request,
    Round,
    ShardConfig,
    ShardSpec,
    pack_round,
    partial_sum,
    unpack_reply,
)
from flymc_dist.reduce import BlockSums, fold_blocks, merge_nodes, tree_total, tree_total_arrays
from flymc_dist.transport.channel import ROUND, ROUND_TREE, ChannelClient, ChannelError, HostsLost
from flymc_dist.transport.dask import relay_tree
from flymc_dist.transport.host import ShardHost

STATS = ("n_bright", "likelihood_queries", "lp", "accepted")


def _cuts(rng: np.random.Generator, n_blocks: int) -> list[int]:
    k = int(rng.integers(0, min(n_blocks - 1, 9) + 1)) if n_blocks > 1 else 0
    inner = rng.choice(np.arange(1, n_blocks), size=k, replace=False) if k else []
    return [0, *sorted(int(c) for c in inner), n_blocks]


def test_partial_sums_merged_anywhere_are_the_drivers_sum_bit_for_bit():
    """Blocks of values over 10 orders of magnitude (so that the order of additions
    shows in the last bits), cut into random shards; the shards' nodes merged by the
    vectorised merge, directly or in random groups first (relays), or as replies through
    partial_sum: the very bits of the Python reference tree_total."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n_blocks, width = int(rng.integers(1, 90)), int(rng.integers(1, 4))
        vals = rng.normal(size=(n_blocks, width)) * 10.0 ** rng.integers(-5, 5, (n_blocks, 1))
        b = _cuts(rng, n_blocks)
        parts = [fold_blocks(vals[b[i] : b[i + 1]], b[i], n_blocks) for i in range(len(b) - 1)]
        ref = tree_total(
            [
                BlockSums(n_blocks, [(int(r[0]), int(r[1]), v) for r, v in zip(*p, strict=True)])
                for p in parts
            ]
        )
        assert np.array_equal(tree_total_arrays(parts), ref)
        order = rng.permutation(len(parts))  # relays need not hold neighbouring shards
        g = int(rng.integers(1, len(parts) + 1))
        groups = [
            merge_nodes(
                np.concatenate([parts[j][0] for j in order[i : i + g]]),
                np.concatenate([parts[j][1] for j in order[i : i + g]]),
            )
            for i in range(0, len(parts), g)
        ]
        assert np.array_equal(tree_total_arrays(groups), ref)
        one = np.ones(1, np.int64)
        replies = [Reply(s[:, :1], s[:, None, :], one, one, tree=t) for t, s in parts]
        total = partial_sum(replies)
        assert total.tree.shape[0] == 1 and np.array_equal(total.points[0, 0], ref)
        assert total.queries[0] == len(parts)


def test_a_block_given_twice_is_refused():
    t, s = fold_blocks(np.ones((4, 1)), 0, 8)
    with pytest.raises(ValueError, match="twice"):
        merge_nodes(np.concatenate([t, t]), np.concatenate([s, s]))


@pytest.mark.parametrize("hosts", [1, 2, 3, 4, 5, 16, 17, 64])
@pytest.mark.parametrize("fanout", [1, 2, 4])
def test_relay_tree_reaches_every_host_once_in_contiguous_subtrees(hosts, fanout):
    names = [f"h{i:02d}" for i in range(hosts)]
    top, children = relay_tree(names, fanout)
    assert len(top) <= fanout and all(len(c) <= fanout for c in children.values())
    seen: list[str] = []
    depth = 0

    def walk(h: str, d: int) -> list[str]:
        nonlocal depth
        depth = max(depth, d)
        seen.append(h)
        sub = [h]
        for c in children[h]:
            sub += walk(c, d + 1)
        return sub

    for h in top:
        sub = walk(h, 1)
        assert sub == names[names.index(h) : names.index(h) + len(sub)]  # consecutive
    assert sorted(seen) == names  # every host once
    if fanout > 1:
        assert depth <= math.ceil(math.log(hosts, fanout)) + 1


def _hosts(client: ChannelClient, n: int = 3, rows: int = 64) -> list[ShardHost]:
    """``n`` in-process shard hosts of one shard each, set up for shard-evaluated rounds
    and connected to ``client`` as ``w0``, ``w1``, …"""
    rng = np.random.default_rng(0)
    N = n * rows
    X = np.column_stack([np.ones(N), rng.normal(size=N)])
    y = (rng.random(N) < expit(X[:, 1])).astype(np.int64)
    config = ShardConfig(
        model=fd.LogisticRegression(),
        algorithm="flymc",
        chains=2,
        seed=0,
        n_rows=N,
        track_grad=True,
    )
    hosts = []
    for i in range(n):
        part = slice(i * rows, (i + 1) * rows)
        h = ShardHost([ShardSpec(i, "", i * rows, (i + 1) * rows)], config, {i: (X[part], y[part])})
        h.call("set_tight_points", (None,))
        h.call("set_positions", (np.zeros((2, 2)), 0))
        client.connect(f"w{i}", h.open_channel("127.0.0.1", client.secret)[0], client.secret)
        hosts.append(h)
    return hosts


def _rounds(seed: int = 1) -> list[Round]:
    rng = np.random.default_rng(seed)
    return [
        Round(
            s,
            np.array([0, -1]) if s > 1 else np.full(2, -1),
            True,
            [Request(rng.normal(size=(2, 2)), True, True)] * 2,
        )
        for s in range(1, 5)
    ]


def test_a_relayed_round_is_the_flat_one_bit_for_bit_and_a_lost_child_is_named():
    """In process, on real sockets: hosts w0 → (w1, w2) answer four rounds (z updated,
    gradients asked) relayed, with the sums of the same rounds sent to every host of an
    identical set; then w2 stops: the driver hears from w0 that w2 is lost."""
    flat_client, tree_client = ChannelClient(), ChannelClient()
    flat, tree = _hosts(flat_client), _hosts(tree_client)
    try:
        tree[0].set_children(
            [("w1", tree[1]._channel.address), ("w2", tree[2]._channel.address)], 5.0
        )
        for msg in _rounds():
            ok, bad = flat_client.fanout(ROUND, pack_round(msg), ["w0", "w1", "w2"], 60.0)
            assert not bad
            want = Driver._aggregate([r for k in sorted(ok) for r in unpack_reply(ok[k]).values()])
            ok, bad = tree_client.fanout(ROUND_TREE, pack_round(msg), ["w0"], 60.0)
            assert not bad
            got = Driver._aggregate(list(unpack_reply(ok["w0"]).values()))
            for a, b in zip(want, got, strict=True):
                assert (a is None and b is None) or np.array_equal(a, b)
        tree[2].close_channel()
        _, bad = tree_client.fanout(
            ROUND_TREE, pack_round(_rounds(2)[0]._replace(seq=9)), ["w0"], 5.0
        )
        assert isinstance(bad["w0"], HostsLost) and bad["w0"].workers == ["w2"]
    finally:
        for h in flat + tree:
            h.release()
        flat_client.close()
        tree_client.close()


def test_a_parent_authenticates_as_any_client_and_only_one_at_a_time():
    """A host's parent connects with the run's key under its own role: without the key it
    is refused; a second parent while one is connected is refused; the parent's release
    frees the place (its children do not outlive it)."""
    client = ChannelClient()
    hosts = _hosts(client, 2)
    try:
        hosts[0].set_children([("w1", hosts[1]._channel.address)], 60.0)
        ok, bad = client.fanout(ROUND_TREE, pack_round(_rounds()[0]), ["w0"], 60.0)
        assert ok and not bad
        server = hosts[1]._channel
        other = ChannelClient()
        with pytest.raises(ChannelError):
            other.connect("w1", server.address, b"x" * 32, timeout=2.0, role="parent")
        with pytest.raises(ChannelError):
            other.connect("w1", server.address, client.secret, timeout=2.0, role="parent")
        assert server.refused["handshake"] == 1 and server.refused["second parent"] == 1
        hosts[0].release()
        deadline = time.monotonic() + 5
        while True:  # the old parent's connection closes with it
            try:
                other.connect("w1", server.address, client.secret, timeout=2.0, role="parent")
                break
            except ChannelError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        other.close()
    finally:
        for h in hosts:
            h.release()
        client.close()


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    X, y = logistic_rows(3000, seed=8)
    return fd.from_numpy(X, y, str(tmp_path_factory.mktemp("relay") / "d.zarr"), chunk_rows=250)


def _run(data, client, fanout: int = 4, kernel: str = "nuts"):
    return fd.sample(
        fd.LogisticRegression(),
        data,
        fd.FlyMC(bright_replica=False),
        kernel,
        num_warmup=10,
        num_samples=15,
        chains=3,
        seed=5,
        client=client,
        placement=fd.Placement(fanout=fanout) if client != "synchronous" else None,
        progress=False,
    )


@pytest.fixture(scope="module")
def in_process(ds):
    """The in-process run every cluster run is compared with."""
    return _run(ds, "synchronous")


#: workers and the fanouts run on them; 2 workers (a chain of hosts and the default)
#: stay in the quick set, 1 and 4 workers (fanout 0, 1, 2 on 4) run with the slow tests
LAYOUTS = [
    pytest.param(1, (0, fd.Placement().fanout), id="1-worker", marks=pytest.mark.slow),
    pytest.param(2, (1, fd.Placement().fanout), id="2-workers"),
    pytest.param(4, (0, 1, 2), id="4-workers", marks=pytest.mark.slow),
]


@pytest.mark.cluster
@pytest.mark.parametrize(("workers", "fanouts"), LAYOUTS)
def test_draws_identical_with_and_without_the_tree(
    ds, in_process, local_clusters, workers, fanouts
):
    """Shard-evaluated NUTS (gradients in every round) in process and on 1, 2 and 4
    workers, the driver sending to every host (fanout 0) or down trees of fanout 1 (a
    chain of hosts), 2 and the default (on W <= 4 a tree of depth one: each host's
    shards summed there): the same draws, bright counts and queries; with
    W > fanout the driver sent rounds to the tree's top hosts only, one message each per
    round."""
    from distributed import Client

    ref = in_process
    with Client(local_clusters.get(workers), direct_to_workers=True) as client:
        for fanout in fanouts:
            res = _run(ds, client, fanout)
            assert res.info["n_workers"] == workers and res.info["channel"] == "socket"
            assert np.array_equal(res.samples, ref.samples), (workers, fanout)
            assert np.array_equal(res.warmup_samples, ref.warmup_samples)
            for k in STATS:
                assert np.array_equal(res.stats[k], ref.stats[k]), (workers, fanout, k)
            if fanout and workers > fanout:
                rounds = int(res.stats["round_trips"][0].sum())
                rounds += int(res.warmup_stats["round_trips"][0].sum())
                sent = res.info["host_messages"]
                top, _ = relay_tree(sorted(sent), fanout)
                assert rounds > 100
                # the top hosts: one message per round; every host: a few calls
                # besides (the tree's set-up, the run's closing reports), not rounds
                others = {w: n for w, n in sent.items() if w not in top}
                assert all(rounds <= sent[w] <= rounds + 4 for w in top), (rounds, sent)
                assert all(n <= 4 for n in others.values()), (rounds, sent)
                assert sum(sent.values()) <= fanout * rounds + 4 * workers
