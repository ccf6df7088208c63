"""The data layer: a validated, chunked zarr v3 layout for tall data sets.

It knows nothing of models or Dask. Its modules:

- :mod:`flymc_dist.data.store`: the on-disk layout (one zarr v3 group per data set) and
  reading it (:class:`Dataset`, :func:`open_dataset`, the shard layout
  :meth:`Dataset.shard_ranges`);
- :mod:`flymc_dist.data.write`: validation and atomic writing (:func:`from_numpy`,
  :func:`from_blocks`);
- :mod:`flymc_dist.data.ingest`: ``.npy`` / ``.npz`` / ``.csv`` / Parquet files into a
  store, streamed (:func:`ingest`, :func:`from_parquet`; Dask collections and foreign
  zarr arrays: :mod:`flymc_dist.dask_data`);
- :mod:`flymc_dist.data.design`: categorical and standardized columns (:class:`Design`);
- :mod:`flymc_dist.data.generate`: synthetic generators that write chunk by chunk
  (:func:`make_logistic`, :func:`make_softmax`, :func:`make_robust`, :func:`make_glm`,
  :func:`make_opv_like`);
- :mod:`flymc_dist.data.real`: the shipped real data sets (MNIST, QM9, flights), converted
  into stores.

The names below are re-exported here: ``flymc_dist.data.open_dataset`` and the like are the
public paths.
"""

from flymc_dist.data.generate import (
    make_glm,
    make_logistic,
    make_opv_like,
    make_robust,
    make_softmax,
)
from flymc_dist.data.ingest import from_parquet, ingest
from flymc_dist.data.store import (
    DEFAULT_CHUNK_BYTES,
    FORMAT,
    DataIntegrityError,
    Dataset,
    StoreReplacedError,
    StoreUnreachableError,
    default_chunk_rows,
    open_dataset,
)
from flymc_dist.data.write import TASKS, from_blocks, from_numpy

__all__ = [
    "FORMAT",
    "TASKS",
    "DEFAULT_CHUNK_BYTES",
    "DataIntegrityError",
    "Dataset",
    "StoreReplacedError",
    "StoreUnreachableError",
    "default_chunk_rows",
    "from_numpy",
    "from_blocks",
    "open_dataset",
    "ingest",
    "from_parquet",
    "make_glm",
    "make_logistic",
    "make_softmax",
    "make_robust",
    "make_opv_like",
]
