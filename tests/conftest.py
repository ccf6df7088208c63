"""Test-session set-up: one BLAS thread per process (set before numpy is used).

The suite starts Dask worker processes beside the test process on 2 cores;
multithreaded BLAS in every process makes small matrix products 10–50× slower.
"""

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
