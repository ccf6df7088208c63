"""The typed options of ``fd.sample`` (#31): the algorithm, placement and kernel objects,
their checks, the command-line flags generated from them; the keyword style before 0.1.0
is a TypeError."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import numpy as np
import pytest

import flymc_dist as fd
from flymc_dist.call import RUN_DEFAULTS
from flymc_dist.cli.flags import flag_of, kernel_option_names
from flymc_dist.cli.parser import build_parser
from flymc_dist.kernels import KERNELS

#: arguments of fd.sample with no flag of their own, and why
API_ONLY = {
    "model": "--model and its --classes/--nu/--scale/--prior flags build it",
    "data": "the STORE argument",
    "client": "--scheduler, --scheduler-file, --synchronous or the embedded cluster",
    "placement": "its fields are flags (--n-shards, --out-of-core, …)",
    "init": "the start is the MAP on the command line; an array has no command-line form",
    "trace_storage_options": "--storage-option KEY=VALUE",
    "progress": "--no-progress",
    "overwrite_trace": "--overwrite",
    "num_warmup": "--warmup",
    "num_samples": "--samples",
}


def _data(n: int = 1500, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.c_[np.ones(n), rng.normal(size=(n, 2))]
    y = (rng.random(n) < 1 / (1 + np.exp(-X @ np.array([0.3, 1.0, -0.5])))).astype(float)
    return X, y


def _help() -> str:
    sub = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    return sub.format_help()


def test_every_option_of_the_api_has_a_flag():
    """Each field of FlyMC, Austerity and Placement, each kernel option and each keyword of
    fd.sample is a ``flymc run`` flag, or on the commented API-only list."""
    text = _help()
    names = [f.name for c in (fd.FlyMC, fd.Austerity, fd.Placement) for f in dataclasses.fields(c)]
    names += list(kernel_option_names())
    names += [k for k in RUN_DEFAULTS if k not in API_ONLY]
    names += ["algorithm", "kernel"]
    missing = [n for n in names if f"{flag_of(n)} " not in text and f"{flag_of(n)}," not in text]
    assert missing == []
    params = set(inspect.signature(fd.sample).parameters)
    assert params <= set(RUN_DEFAULTS) | {"model", "data", "algorithm", "kernel"}
    assert set(API_ONLY) <= params
    for name, p in inspect.signature(fd.sample).parameters.items():  # one set of defaults
        if name in RUN_DEFAULTS:
            assert p.default == RUN_DEFAULTS[name], name


def test_help_lists_every_option_with_its_default():
    doc = fd.sample.__doc__
    assert "fd.NUTS(target_accept=0.8, max_tree_depth=10, metric='dense'" in doc
    assert "fd.RWMH(target_accept=0.234, step_size=None)" in doc
    for cls in (fd.FlyMC, fd.Austerity, fd.Placement):
        for f in dataclasses.fields(cls):
            assert f"``{f.name}`` (default ``{f.default!r}``)" in doc
    text = " ".join(_help().split())
    assert "(default 268435456)" in text  # replica_budget
    assert "hmc/nuts: default 0.8" in text  # target_accept, per kernel
    assert "nuts: default 10" in text  # max_tree_depth


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: fd.FlyMC(q_db=2.0), r"q_db must be 'auto' or a number in \(0, 1\]"),
        (lambda: fd.FlyMC(bounds="tight"), "bounds must be 'map' or 'untuned'"),
        (lambda: fd.FlyMC(exact_rows="all"), "exact_rows must be 'auto' or None"),
        (lambda: fd.Austerity(batch_size=0), "batch_size must be an integer >= 1"),
        (lambda: fd.Austerity(control_variates="yes"), "control_variates must be True or"),
        (lambda: fd.Placement(n_shards=2, rows_per_shard=10), "n_shards or rows_per_shard"),
        (lambda: fd.Placement(timeout=-1), "timeout must be a number of seconds > 0"),
        (lambda: fd.NUTS(max_tree_depth=0), "max_tree_depth must be an integer"),
    ],
)
def test_a_bad_option_is_refused_when_its_object_is_made(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "old",
    [
        {"n_shards": 2},
        {"q_db": 0.05},
        {"bright_replica": False},
        {"eps": 0.05},
        {"kernel_options": {"target_accept": 0.9}},
    ],
    ids=lambda old: next(iter(old)),
)
def test_an_earlier_releases_keyword_is_a_plain_type_error_naming_it(old):
    """The keyword style before 0.1.0 (``q_db=``, ``n_shards=``, ``kernel_options=`` as
    keywords of fd.sample) is gone: Python's own TypeError, naming the keyword, before
    anything runs."""
    X, y = _data()
    (name,) = old
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{name}'"):
        fd.sample(fd.LogisticRegression(), (X, y), client="synchronous", **old)


def test_a_wrong_kernel_is_refused():
    X, y = _data()
    with pytest.raises(TypeError, match="kernel must be a kernel object"):
        fd.sample(fd.LogisticRegression(), (X, y), kernel=3, client="synchronous")


def test_metric_from_defaults_to_the_algorithms_and_the_given_object_is_not_changed():
    """NUTS's metric_from left at None is "differences" under FlyMC and "draws" under
    regular MCMC, on a copy: the user's kernel object is not modified."""
    from flymc_dist.call import make_call

    kernel = fd.NUTS()
    run = dict(RUN_DEFAULTS)
    X, y = _data(200)
    fly = make_call(fd.LogisticRegression(), (X, y), "flymc", kernel, dict(run))
    reg = make_call(fd.LogisticRegression(), (X, y), "regular", kernel, dict(run))
    assert (fly.kernel.metric_from, reg.kernel.metric_from) == ("differences", "draws")
    assert kernel.metric_from is None and fly.kernel_options == {}


def test_every_kernel_option_is_an_attribute_of_its_kernel():
    """Kernel.settings() reads each constructor option back (what traces record)."""
    for cls in KERNELS.values():
        k = cls()
        assert set(k.settings()) == set(inspect.signature(cls).parameters)
        assert k.changed() == {}


@pytest.mark.slow
def test_the_cli_builds_the_objects_from_its_flags(tmp_path, capsys):
    """``flymc run`` with generated flags: a FlyMC, a placement and a NUTS option reach the
    run (recorded in the trace), and a flag of another algorithm or kernel is refused (by
    the same entry point called in this process: each process start imports the package)."""
    X, y = _data(800)
    store = str(tmp_path / "d.zarr")
    fd.from_numpy(X, y, store, chunk_rows=200)
    base = [
        sys.executable,
        "-m",
        "flymc_dist.cli",
        "run",
        store,
        "--model",
        "logistic",
        "--synchronous",
        "--warmup",
        "20",
        "--samples",
        "20",
        "--chains",
        "2",
        "--no-progress",
    ]
    ok = subprocess.run(
        [
            *base,
            "--trace",
            str(tmp_path / "t.zarr"),
            "--q-db",
            "0.05",
            "--n-shards",
            "2",
            "--max-tree-depth",
            "5",
            "--bright-replica",
            "false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    from flymc_dist.trace import Trace

    attrs = Trace.open(str(tmp_path / "t.zarr"), read_only=True).attrs
    assert attrs["options"]["q_db"] == 0.05
    assert attrs["options"]["kernel_options"] == {"max_tree_depth": 5}
    assert attrs["options"]["bright_replica"] is False
    assert attrs["n_shards"] == 2
    from flymc_dist.cli import main

    capsys.readouterr()
    for name, flags, said in (
        ("u", ["--eps", "0.1"], "--eps applies only to --algorithm austerity"),
        ("v", ["--width", "1"], "--width is not an option of kernel 'nuts'"),
        ("w", ["--q-db", "3"], "q-db must be 'auto' or a number in (0, 1]"),
    ):
        trace = tmp_path / f"{name}.zarr"
        assert main([*base[3:], "--trace", str(trace), *flags]) == 2
        assert said in capsys.readouterr().err
        assert not trace.exists()
