"""``flymc bench scaleout``'s table, and the driver-side pieces it times."""

from __future__ import annotations

import numpy as np
import pytest

from flymc_dist.bench.scaleout import format_scaleout, run_scaleout
from flymc_dist.streams import Z_DECIDE, stream_key, stream_keys


def _run(**kw: object) -> dict:
    base = {
        "workers": 2, "delay_ms": 0.0, "read_ahead": 16, "channel": "socket",
        "ms_per_it": 1.2, "cpu_ms_per_it": 1.0, "theta_ms_per_it": 0.8, "z_ms_per_it": 0.3,
        "per_theta": 1.5, "theta_compute_ms_per_it": 0.6, "per_theta_compute": 2.0,
        "requests_per_100_it_per_host": 6.5, "n_bright": 2.8, "rhat": 1.004, "min_ess": 1677.0,
    }  # fmt: skip
    return {**base, **kw}


def test_table_shows_the_theta_kernels_compute_and_the_ratio_to_it() -> None:
    d = {
        "rows": 400_000, "features": 20, "kernel": "nuts", "chains": 4, "num_warmup": 200,
        "num_samples": 1000, "load": 3.2, "cpus": 2,
        "runs": [_run(), _run(workers=16, ms_per_it=1.5, theta_compute_ms_per_it=None,
                              per_theta_compute=None)],
    }  # fmt: skip
    text = format_scaleout(d)
    header = text.splitlines()[1]
    assert "θc ms/it" in header and "ms/θc" in header
    first = text.splitlines()[2].split()
    assert "0.600" in first and "2.00" in first
    # a run without the compiled kernel's figure shows a dash there
    assert text.splitlines()[3].split()[8:10] == ["-", "-"]
    assert "W=16 delay 0.0 ms read_ahead 16: 1.25x" in text


def test_no_worker_count_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one worker count"):
        run_scaleout(workers=None)


def test_stream_keys_are_stream_key_of_each_chain() -> None:
    for seed in (0, 7, 2**64 - 1, -3):
        for generation, step in ((0, 0), (2, 15), (1, 2**40)):
            got = stream_keys(seed, generation, 5, step, Z_DECIDE)
            want = [stream_key(seed, generation, c, step, Z_DECIDE) for c in range(5)]
            assert got.dtype == np.uint64 and got.tolist() == want
    with pytest.raises(ValueError, match="step must be >= 0"):
        stream_keys(0, 0, 2, -1, Z_DECIDE)
