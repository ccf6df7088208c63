"""The stochastic-volatility sampler: identical draws in process and on a 2-worker
LocalCluster and whatever the number of shards; resume continues exactly; bad input."""

import numpy as np
import pytest

from flymc_dist.sv import (
    StochasticVolatility,
    load_trace,
    sample_sv,
    series_from_numpy,
    simulate_sv,
)

RUN = dict(num_warmup=3, num_samples=6, chains=2, seed=5)


@pytest.fixture(scope="module")
def panel(tmp_path_factory):
    x, _ = simulate_sv(96, 8, 0.95, 0.3, seed=2)
    return series_from_numpy(x, tmp_path_factory.mktemp("sv") / "p.zarr", chunk=16)


@pytest.fixture(scope="module")
def client(local_clusters):
    """A client of the session's shared 2-worker LocalCluster (its tests then run in the
    process group, beside the other cluster tests, not starting a cluster of their own)."""
    from distributed import Client

    with Client(local_clusters.get(2), direct_to_workers=True) as client:
        yield client


def _same(a, b) -> None:
    np.testing.assert_array_equal(a.phi, b.phi)
    np.testing.assert_array_equal(a.sigma, b.sigma)
    np.testing.assert_array_equal(a.states, b.states)
    np.testing.assert_array_equal(a.stats["series_read"], b.stats["series_read"])


@pytest.mark.slow
@pytest.mark.parametrize("update", ["exact", "subsampled"])
def test_layout_and_cluster_do_not_change_the_draws(panel, client, update) -> None:
    model = StochasticVolatility(update=update, particles=8, batch_size=10, trace_series=(0, 50))
    one = sample_sv(model, panel, client="synchronous", **RUN)
    three = sample_sv(model, panel, client="synchronous", n_shards=3, **RUN)
    _same(one, three)
    assert one.approximate == (update == "subsampled")
    dist = sample_sv(model, panel, client=client, **RUN)
    assert dist.info["n_shards"] == 2
    _same(one, dist)


def test_resume_is_identical(panel, tmp_path) -> None:
    model = StochasticVolatility(update="subsampled", particles=8, batch_size=10)
    whole = sample_sv(model, panel, client="synchronous", **RUN)
    tr = str(tmp_path / "t.zarr")
    run = {**RUN, "num_samples": 4}
    sample_sv(model, panel, client="synchronous", trace=tr, checkpoint_every=3, **run)
    rest = sample_sv(
        model,
        panel,
        client="synchronous",
        n_shards=2,
        trace=tr,
        resume=True,
        **{**run, "num_samples": 2},
    )
    kept = load_trace(tr)
    np.testing.assert_array_equal(kept["phi"], whole.phi)
    np.testing.assert_array_equal(kept["sigma"], whole.sigma)
    np.testing.assert_array_equal(kept["states"], whole.states)
    np.testing.assert_array_equal(rest.phi, whole.phi[:, 4:])
    with pytest.raises(ValueError, match="different run"):
        sample_sv(model, panel, client="synchronous", trace=tr, resume=True, **{**run, "seed": 6})
    with pytest.raises(FileExistsError):
        sample_sv(model, panel, client="synchronous", trace=tr, **run)


def test_bad_input(panel) -> None:
    with pytest.raises(ValueError, match="update"):
        StochasticVolatility(update="gibbs")
    with pytest.raises(ValueError, match="phi_prior"):
        StochasticVolatility(phi_prior=(0.5, 1.0))
    with pytest.raises(ValueError, match="trace_series"):
        sample_sv(StochasticVolatility(trace_series=(500,)), panel, client="synchronous")
    with pytest.raises(ValueError, match="num_samples"):
        sample_sv(StochasticVolatility(), panel, client="synchronous", num_samples=0)
    with pytest.raises(ValueError, match="init"):
        sample_sv(StochasticVolatility(), panel, client="synchronous", init=(1.0, 0.1))
    with pytest.raises(TypeError, match="StochasticVolatility"):
        sample_sv(object(), panel, client="synchronous")


def test_bench_sv_cli(tmp_path, capsys) -> None:
    import json

    from flymc_dist.cli import main

    argv = [
        "bench",
        "sv",
        "--parts",
        "informative",
        "--informative-series",
        "8",
        "--informative-length",
        "6",
        "--num-samples",
        "8",
        "--num-warmup",
        "2",
        "--chains",
        "2",
        "--particles",
        "4",
        "--workdir",
        str(tmp_path),
        "--json",
        str(tmp_path / "sv.json"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr()[0]
    assert "subsampled − exact" in out and "(approximate)" in out and "R-hat" in out
    gibbs = json.loads((tmp_path / "sv.json").read_text())["informative"]["gibbs"]
    # Fig. 9's histograms: 20 bins, holding every draw inside their range
    phi = np.asarray(gibbs["phi"]["histogram"])
    assert phi.shape == (20,) and phi.sum() <= 2 * 8


#: CI only: `bench sv` runs end to end in test_bench_sv_cli, the draws on workers in
#: test_layout_and_cluster_do_not_change_the_draws, and a decision's reads with control
#: variates in test_sv_control.py's test_control_variates_read_far_fewer_series
@pytest.mark.full_e2e
@pytest.mark.slow
def test_bench_sv_tall_cli(tmp_path, capsys) -> None:
    """The tall part end to end on a tiny panel: 1 and 2 workers, with and without
    control variates; with them a decision reads one batch (counts)."""
    import json

    from flymc_dist.cli import main

    argv = ["bench", "sv", "--parts", "tall", "--tall-series", "512", "--tall-warmup", "1"]
    argv += ["--tall-iterations", "2", "--batch-size", "16", "--workdir", str(tmp_path)]
    assert main([*argv, "--json", str(tmp_path / "sv.json")]) == 0
    out = capsys.readouterr()[0]
    assert "tall panel" in out and "control variates" in out
    (row,) = json.loads((tmp_path / "sv.json").read_text())["tall"]
    assert row["series_read_per_decision"] < row["plain_series_read_per_decision"]
    assert row["sweep_cpu_1w"] > 0 and row["sweep_cpu_2w"] > 0
