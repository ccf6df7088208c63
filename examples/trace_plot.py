"""The README's ArviZ trace plot: a CSV file with a header, to named parameters in ArviZ.

A synthetic dose-response study (logistic regression, 20,000 patients) is written as a
CSV file, ingested as ``flymc ingest`` does (the header names the columns), sampled
with FlyMC's NUTS in this process, and drawn with ``az.plot_trace``::

    python examples/trace_plot.py [OUT.png]      # default: examples/trace_plot.png

Needs arviz (``pip install ".[arviz]"``), which brings matplotlib. The tests run
:func:`main` (smaller) so that the picture in the README stays what the code draws.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

import flymc_dist as fd
from flymc_dist.data import ingest

COLUMNS = ["bias", "age", "dose", "weight"]
TRUE = np.array([-0.5, 0.8, 1.5, -0.6])


def write_csv(path: Path, rows: int, seed: int = 0) -> None:
    """The study as CSV: a header, then one patient per line (the outcome last)."""
    rng = np.random.default_rng(seed)
    X = np.column_stack([np.ones(rows), rng.standard_normal((rows, 3))])
    y = (rng.random(rows) < 1.0 / (1.0 + np.exp(-X @ TRUE))).astype(int)
    lines = [",".join([*COLUMNS, "outcome"])]
    lines += [",".join([*(f"{v:.5f}" for v in X[i]), str(y[i])]) for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")


def main(out: Path, rows: int = 20_000, num_samples: int = 1000) -> fd.Result:
    """Write the CSV, ingest it, sample, and save the trace plot to ``out``."""
    with warnings.catch_warnings():  # arviz 0.2x announces its 1.0 rewrite on import
        warnings.simplefilter("ignore", FutureWarning)
        import arviz as az
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with tempfile.TemporaryDirectory() as tmp:
        csv = Path(tmp) / "study.csv"
        write_csv(csv, rows)
        ds = ingest(str(csv), str(Path(tmp) / "study.zarr"), target="outcome")
        res = fd.sample(
            fd.LogisticRegression(),
            ds,
            num_samples=num_samples,
            client="synchronous",
            progress=False,
        )
    print(res.summary())
    axes = az.plot_trace(res.to_arviz(), compact=False, figsize=(10, 8))
    fig = axes[0, 0].figure
    fig.tight_layout()
    fig.savefig(out, dpi=72)
    plt.close(fig)
    return res


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_suffix(".png"))
