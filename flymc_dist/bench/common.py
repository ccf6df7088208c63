"""Helpers shared by the benchmarks (:mod:`flymc_dist.bench`)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from flymc_dist.data import Dataset, open_dataset

__all__ = ["reusable_store", "write_json"]


def _json_default(value: Any) -> Any:
    """numpy arrays and scalars as JSON; anything else as its ``str``."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return str(value)


def write_json(path: str, d: dict[str, Any]) -> None:
    """Write a benchmark's figures ``d`` to ``path`` whole or not at all (a temporary
    file beside it, then a rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(d, fh, indent=2, default=_json_default)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def reusable_store(path: str, rows: int, features: int, **attrs: Any) -> Dataset | None:
    """The store an earlier benchmark run left at ``path``, if it holds these data: its
    shape, and every ``attrs`` item — the store's own attributes (``generator``, ``seed``)
    or one of its properties (``dtype`` by name, ``chunk_rows``; None: any). None when
    there is none, when it cannot be opened (incomplete), or when it differs."""
    if not os.path.exists(path):
        return None
    try:
        ds = open_dataset(path)
    except (ValueError, OSError, KeyError):
        return None
    if ds.n_rows != rows or ds.n_features != features:
        return None
    have = {"dtype": ds.dtype.name, "chunk_rows": ds.chunk_rows}
    for key, want in attrs.items():
        got = have[key] if key in have else ds.attrs.get(key)
        if want is not None and got != want:
            return None
    return ds
