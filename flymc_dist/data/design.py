"""From a table's columns to the rows of a data set: :class:`Design`.

A design names the target column and the feature columns in their order, one-hot
encodes the categorical ones (the first level, in sorted order, is the reference and is
dropped; the others become columns named ``col[LEVEL]``) and, with ``standardize``,
centres and scales every non-constant numeric column. It is recorded in the store (the
``"design"`` attribute) so that new rows are transformed the same way at prediction.

:class:`ColumnStats` is the one pass over the columns a design needs first (the target's
range, the categorical levels, the numeric columns' means and standard deviations).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ColumnStats", "Design", "column_values"]


def column_values(col: Any) -> np.ndarray:
    """A column (numpy array, pandas Series, pyarrow Array or ChunkedArray) as numpy; a
    missing value of a numeric column is NaN, of another column None."""
    if hasattr(col, "to_numpy") and not isinstance(col, np.ndarray):
        mod = type(col).__module__
        if mod.startswith("pyarrow"):
            import pyarrow as pa

            if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
                if col.null_count:
                    import pyarrow.compute as pc

                    col = pc.fill_null(col.cast(pa.float64()), float("nan"))
                return _arrow_numeric(col)
            if pa.types.is_boolean(col.type) and not col.null_count:
                return np.asarray(col.to_numpy(zero_copy_only=False))
            if pa.types.is_dictionary(col.type):
                col = col.cast(col.type.value_type)
            return np.asarray(col.to_numpy(zero_copy_only=False), dtype=object)
        values = col.to_numpy()
        if values.dtype.kind in "biuf":
            return values
        return np.asarray(values, dtype=object)
    return np.asarray(col)


def _arrow_numeric(col: Any) -> np.ndarray:
    """A pyarrow integer or floating column without nulls (an Array or a ChunkedArray) as
    numpy, read from its values buffer (in place for an Array or a single chunk).

    Not through ``to_numpy``: pyarrow imports pandas there (~1 s in a fresh worker).
    """
    dtype = np.dtype(col.type.to_pandas_dtype())
    if hasattr(col, "num_chunks"):
        if col.num_chunks == 1:
            return _arrow_numeric(col.chunk(0))
        return np.concatenate([np.empty(0, dtype), *(_arrow_numeric(c) for c in col.chunks)])
    if not len(col):
        return np.empty(0, dtype)
    return np.frombuffer(
        col.buffers()[1], dtype=dtype, count=len(col), offset=col.offset * dtype.itemsize
    )


def _is_numeric(values: np.ndarray) -> bool:
    return values.dtype.kind in "biuf"


def _level_strings(values: np.ndarray) -> np.ndarray:
    """The levels of a categorical column's values, as strings (None stays None)."""
    if _is_numeric(values):
        if values.dtype.kind == "f" and np.all(values == np.round(values)):
            values = values.astype(np.int64)  # 2.0 and 2 are one level, "2"
        return values.astype(str).astype(object)
    return np.array([v if v is None else str(v) for v in values], dtype=object)


@dataclass
class ColumnStats:
    """What a :class:`Design` needs from every row, accumulated block by block.

    Attributes
    ----------
    n_rows : int
        Rows seen.
    y_min, y_max : float
        The target's range.
    y_integer : bool
        Whether every target value is an integer.
    levels : dict of str to set of str
        Each categorical column's levels.
    mean, m2 : dict of str to float
        Each numeric column's running mean and sum of squared deviations (with
        ``standardize``; Chan et al.'s pairwise update).
    """

    n_rows: int = 0
    y_min: float = np.inf
    y_max: float = -np.inf
    y_integer: bool = True
    levels: dict[str, set[str]] = field(default_factory=dict)
    mean: dict[str, float] = field(default_factory=dict)
    m2: dict[str, float] = field(default_factory=dict)

    def update(
        self,
        cols: Mapping[str, Any],
        target: str | None,
        categorical: Sequence[str],
        numeric: Sequence[str],
        where: Any = None,
        offset: int = 0,
    ) -> None:
        """Add a block of rows (``cols``: name -> values)."""
        n = None
        if target is not None:
            y = column_values(cols[target])
            n = y.shape[0]
            if y.size and _is_numeric(y):
                y = y.astype(np.float64, copy=False)
                finite = np.isfinite(y)
                if finite.any():
                    self.y_min = min(self.y_min, float(y[finite].min()))
                    self.y_max = max(self.y_max, float(y[finite].max()))
                    self.y_integer &= bool(np.all(y[finite] == np.round(y[finite])))
        for c in categorical:
            v = _level_strings(column_values(cols[c]))
            n = v.shape[0]
            missing = np.flatnonzero(v == None)  # noqa: E711 - elementwise
            if missing.size:
                raise ValueError(
                    f"{_where(where, offset + int(missing[0]))}, column {c!r}: a missing value "
                    "in a categorical column"
                )
            self.levels.setdefault(c, set()).update(np.unique(v.astype(str)).tolist())
        for c in numeric:
            v = column_values(cols[c]).astype(np.float64, copy=False)
            n = v.shape[0]
            if not v.size:
                continue
            m_b = float(v.mean())
            m2_b = float(((v - m_b) ** 2).sum())
            n_a = self.n_rows
            n_b = v.shape[0]
            m_a = self.mean.get(c, 0.0)
            delta = m_b - m_a
            tot = n_a + n_b
            self.mean[c] = m_a + delta * n_b / tot
            self.m2[c] = self.m2.get(c, 0.0) + m2_b + delta * delta * n_a * n_b / tot
        if n is not None:
            self.n_rows += int(n)

    def merge(self, other: ColumnStats) -> ColumnStats:
        """The statistics of both blocks' rows (this one's first)."""
        out = ColumnStats(
            n_rows=self.n_rows + other.n_rows,
            y_min=min(self.y_min, other.y_min),
            y_max=max(self.y_max, other.y_max),
            y_integer=self.y_integer and other.y_integer,
        )
        for c in set(self.levels) | set(other.levels):
            out.levels[c] = self.levels.get(c, set()) | other.levels.get(c, set())
        for c in set(self.mean) | set(other.mean):
            n_a, n_b = self.n_rows, other.n_rows
            m_a, m_b = self.mean.get(c, 0.0), other.mean.get(c, 0.0)
            if n_a == 0 or n_b == 0:
                out.mean[c] = m_a if n_b == 0 else m_b
                out.m2[c] = self.m2.get(c, 0.0) + other.m2.get(c, 0.0)
                continue
            delta = m_b - m_a
            out.mean[c] = m_a + delta * n_b / (n_a + n_b)
            out.m2[c] = (
                self.m2.get(c, 0.0) + other.m2.get(c, 0.0) + delta * delta * n_a * n_b / (n_a + n_b)
            )
        return out

    def task(self) -> tuple[str, int | None]:
        """The task the target's values say (as :func:`flymc_dist.data.from_numpy` infers
        it: integers in {0, 1} binary, other integers >= 0 multiclass, else real)."""
        if self.y_integer and self.n_rows and np.isfinite(self.y_min):
            if self.y_min >= 0 and self.y_max <= 1:
                return "binary", 2
            if self.y_min >= 0:
                return "multiclass", int(self.y_max) + 1
        return "real", None


def _finite(v: np.ndarray, column: str, what: str, where: Any, offset: int) -> np.ndarray:
    """Column ``v`` as float64, its first non-finite or missing entry refused naming the
    row (``where``, ``offset``), the column and ``what`` it holds."""
    v = v.astype(np.float64, copy=False)
    bad = ~np.isfinite(v)
    if bad.any():
        r = int(np.argmax(bad))
        raise ValueError(
            f"{_where(where, offset + r)}, column {column!r}: non-finite or missing {what} "
            f"({float(v[r])!r})"
        )
    return v


#: rows of X assembled at a time by :func:`_rows_of` (a tile of ~1 MB at 57 features)
_TILE_ROWS = 2048


def _rows_of(parts: list[np.ndarray], n: int) -> np.ndarray:
    """C-order float64 ``X`` (n, Σk) of column groups ``parts`` (each (k, n)), side by side.

    A tile of rows at a time: the tile's columns copied as rows of a small (features,
    tile) buffer, which stays in cache, then transposed into ``X``. Measured at 18,396 rows
    of 56 columns: ~4 ms a block, against ~11-38 ms for a (features, rows) copy of the
    block and one transposing copy (two block-sized allocations, the transpose striding
    through memory), and ~8 ms for writing ``X`` a column at a time.
    """
    d = sum(p.shape[0] for p in parts)
    X = np.empty((n, d), dtype=np.float64)
    tile = np.empty((d, min(_TILE_ROWS, n)), dtype=np.float64)
    for r in range(0, n, _TILE_ROWS):
        e = min(r + _TILE_ROWS, n)
        j = 0
        for p in parts:
            tile[j : j + p.shape[0], : e - r] = p[:, r:e]
            j += p.shape[0]
        X[r:e] = tile[:, : e - r].T
    return X


def _where(where: Any, row: int) -> str:
    """``"file.parquet row 12"``: ``where`` is a callable from a row of the block's source
    to such a phrase, or a name."""
    if callable(where):
        return where(row)
    return f"{where} row {row}" if where else f"row {row}"


@dataclass(frozen=True)
class Design:
    """How a table's columns become ``(X, y)``.

    Attributes
    ----------
    columns : tuple of str
        The feature columns, in the order their features take in ``X``.
    target : str or None
        The target column (None: there is none, as for new rows at prediction).
    categorical : dict of str to tuple of str
        Each categorical column's levels, sorted; the first is the reference (dropped).
    center, scale : tuple of float or None
        With ``standardize``: what each feature of ``X`` has subtracted and is divided by
        (0 and 1 for one-hot features and constant columns).
    """

    columns: tuple[str, ...]
    target: str | None
    categorical: dict[str, tuple[str, ...]] = field(default_factory=dict)
    center: tuple[float, ...] | None = None
    scale: tuple[float, ...] | None = None

    @classmethod
    def build(
        cls,
        columns: Sequence[str],
        target: str | None,
        stats: ColumnStats,
        categorical: Sequence[str],
        standardize: bool,
    ) -> Design:
        """A design from the statistics of every row."""
        cats: dict[str, tuple[str, ...]] = {}
        for c in categorical:
            levels = tuple(sorted(stats.levels.get(c, set())))
            if len(levels) < 2:
                raise ValueError(
                    f"categorical column {c!r} has {len(levels)} level(s) "
                    f"{list(levels)}: a one-hot encoding needs at least 2"
                )
            cats[c] = levels
        design = cls(tuple(columns), target, cats)
        if not standardize:
            return design
        center: list[float] = []
        scale: list[float] = []
        n = max(stats.n_rows, 1)
        for c in columns:
            if c in cats:
                center += [0.0] * (len(cats[c]) - 1)
                scale += [1.0] * (len(cats[c]) - 1)
                continue
            sd = float(np.sqrt(stats.m2.get(c, 0.0) / n))
            if sd > 0 and np.isfinite(sd):
                center.append(float(stats.mean[c]))
                scale.append(sd)
            else:  # a constant column (an intercept, say) is left as it is
                center.append(0.0)
                scale.append(1.0)
        return cls(tuple(columns), target, cats, tuple(center), tuple(scale))

    @property
    def transformed(self) -> bool:
        """Whether ``X`` is not simply the feature columns (one-hot or standardized)."""
        return bool(self.categorical) or self.center is not None

    @property
    def feature_names(self) -> list[str]:
        """The names of the columns of ``X``: a categorical column ``c`` gives
        ``c[LEVEL]`` for each level but the reference."""
        names: list[str] = []
        for c in self.columns:
            if c in self.categorical:
                names += [f"{c}[{lv}]" for lv in self.categorical[c][1:]]
            else:
                names.append(c)
        return names

    @property
    def n_features(self) -> int:
        """Columns of ``X``."""
        return len(self.feature_names)

    def to_attrs(self) -> dict[str, Any]:
        """The design as a JSON-able dict (the store's ``"design"`` attribute)."""
        return {
            "columns": list(self.columns),
            "target": self.target,
            "categorical": {c: list(v) for c, v in self.categorical.items()},
            "center": None if self.center is None else list(self.center),
            "scale": None if self.scale is None else list(self.scale),
        }

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> Design:
        """The design recorded by :meth:`to_attrs`."""
        center, scale = attrs.get("center"), attrs.get("scale")
        return cls(
            tuple(str(c) for c in attrs["columns"]),
            attrs.get("target"),
            {str(c): tuple(str(v) for v in lv) for c, lv in attrs["categorical"].items()},
            None if center is None else tuple(float(v) for v in center),
            None if scale is None else tuple(float(v) for v in scale),
        )

    def X(self, cols: Mapping[str, Any], where: Any = None, offset: int = 0) -> np.ndarray:
        """``X`` (float64, C order) of a block of rows (``cols``: name -> values).

        Raises
        ------
        ValueError
            A feature column is missing or not numeric (and not categorical); a value is
            not finite; a categorical level was not seen when the data set was written
            (naming it). ``where`` and ``offset`` name the rows (see :func:`_where`).
        """
        missing = [c for c in self.columns if c not in cols]
        if missing:
            raise ValueError(f"the rows lack the feature column(s) {missing}")
        parts: list[np.ndarray] = []
        n: int | None = None
        for c in self.columns:
            v = column_values(cols[c])
            if v.ndim != 1:
                raise ValueError(f"column {c!r} must be 1-D, got shape {v.shape}")
            if n is None:
                n = v.shape[0]
            if c in self.categorical:
                parts.append(self._one_hot(c, v, where, offset).T)
                continue
            if not _is_numeric(v):
                raise ValueError(
                    f"column {c!r} is not numeric (dtype {v.dtype}); name it in "
                    "categorical=[...] to one-hot encode it"
                )
            parts.append(_finite(v, c, "value", where, offset)[None, :])
        X = _rows_of(parts, n or 0)
        if self.center is not None:
            X -= np.asarray(self.center)
            X /= np.asarray(self.scale)
        return X

    def _one_hot(self, c: str, v: np.ndarray, where: Any, offset: int) -> np.ndarray:
        levels = np.asarray(self.categorical[c], dtype=object).astype(str)
        s = _level_strings(v)
        missing = np.flatnonzero(s == None)  # noqa: E711 - elementwise
        if missing.size:
            r = int(missing[0])
            raise ValueError(
                f"{_where(where, offset + r)}, column {c!r}: a missing value in a "
                "categorical column"
            )
        s = s.astype(str)
        idx = np.searchsorted(levels, s)
        idx_c = np.minimum(idx, levels.size - 1)
        unseen = levels[idx_c] != s
        if unseen.any():
            r = int(np.argmax(unseen))
            raise ValueError(
                f"{_where(where, offset + r)}, column {c!r}: level {str(s[r])!r} was not seen when "
                f"the data set was written (its levels: {list(self.categorical[c])})"
            )
        out = np.zeros((s.size, levels.size - 1), dtype=np.float64)
        rows = np.flatnonzero(idx_c > 0)
        out[rows, idx_c[rows] - 1] = 1.0
        return out

    def y(self, cols: Mapping[str, Any], where: Any = None, offset: int = 0) -> np.ndarray:
        """The target of a block of rows, float64 (NaN refused naming the row)."""
        if self.target is None or self.target not in cols:
            raise ValueError(f"the rows lack the target column {self.target!r}")
        v = column_values(cols[self.target])
        if not _is_numeric(v):
            raise ValueError(f"the target column {self.target!r} is not numeric ({v.dtype})")
        return _finite(v, self.target, "target", where, offset)
