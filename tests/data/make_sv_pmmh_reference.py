"""Regenerate ``sv_pmmh_reference.npz``: the particle-marginal MH reference of
``tests/test_sv_reference.py`` (two chains of 4,000 draws of φ and σ after 500 adapting
the step, 300 particles, on the test's simulated panel), stored because it costs tens of
CPU seconds and never changes with the sampler it checks. ``test_the_stored_reference_
is_what_pmmh_gives`` re-runs the first draws of chain 0 and compares them bit for bit.

Generated with

    PYTHONPATH=. OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE=Haswell \\
        NPY_ENABLE_CPU_FEATURES=X86_V3 python tests/data/make_sv_pmmh_reference.py

(the CPU kernels pinned as ``tests/conftest.py`` pins them for the comparison).
"""

from __future__ import annotations

import pathlib

import numpy as np

from flymc_dist.sv import simulate_sv
from flymc_dist.sv.conditionals import Priors
from flymc_dist.sv.reference import pmmh

#: the panel (series, length, φ, σ, seed) and the chains' settings
PANEL = dict(n=6, T=50, phi=0.95, sigma=0.3, seed=11)
CHAINS = dict(n_iter=4000, particles=300, warmup=500)
SEEDS = (1, 2)


def panel() -> np.ndarray:
    """The test's simulated panel."""
    x, _ = simulate_sv(PANEL["n"], PANEL["T"], PANEL["phi"], PANEL["sigma"], seed=PANEL["seed"])
    return x


def main() -> None:
    x = panel()
    draws = [pmmh(x, Priors(), seed=s, **CHAINS) for s in SEEDS]
    out = pathlib.Path(__file__).with_name("sv_pmmh_reference.npz")
    np.savez_compressed(
        out,
        phi=np.stack([d[0] for d in draws]),
        sigma=np.stack([d[1] for d in draws]),
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
