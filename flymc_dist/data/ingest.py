"""Ingest: data from where users keep it into a validated data set.

- :func:`ingest`: a ``.npy``, ``.npz``, ``.csv`` or Parquet file (or a directory of Parquet
  files, or an fsspec URL of either);
- :func:`from_parquet`: Parquet files, directories, URLs;
- Dask collections and foreign zarr arrays: :mod:`flymc_dist.dask_data` (the data layer
  itself imports no Dask).

Nothing is held whole: ``.csv`` is streamed in blocks (pyarrow's streaming reader),
``.npy`` and Parquet are read by row ranges, Dask collections by blocks; the peak memory
is a few blocks of ~8 MiB whatever the number of rows (and, for Parquet, what pyarrow
holds of each column: about a data page and a dictionary page). A first pass reads what the
design needs of every row (the target's range when ``task`` is inferred, the levels of
the ``categorical`` columns, the moments of the columns to ``standardize``); the second
converts, validates and writes, block by block. With a Dask ``client`` (Parquet, ``.npy``,
Dask and zarr sources) each worker converts and writes its own row ranges, whole chunks of
the layout :func:`~flymc_dist.data.from_numpy` writes. Writing is atomic as in
:func:`~flymc_dist.data.from_numpy`: an invalid value anywhere leaves nothing written.
"""

from __future__ import annotations

import codecs
import csv
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flymc_dist._paths import is_url, local_path
from flymc_dist.data.design import ColumnStats, Design
from flymc_dist.data.store import DEFAULT_CHUNK_BYTES, Dataset, check_dtype
from flymc_dist.data.write import (
    check_chunk_rows,
    from_numpy,
    from_pieces,
    resolve_task,
)

__all__ = [
    "block_rows",
    "check_categorical",
    "check_unique",
    "from_parquet",
    "ingest",
    "resolve_target",
    "task_of",
]

#: Bytes of the float64 rows of one block read, converted and written at a time (and of
#: one piece a worker writes): a few zarr chunks.
_BLOCK_BYTES = DEFAULT_CHUNK_BYTES
#: Bytes of text pyarrow's streaming CSV reader parses at a time.
_CSV_BLOCK_BYTES = 16 * 2**20
_PARQUET_EXT = (".parquet", ".pq", ".parq")
#: How a Parquet file is opened for streaming: column chunks read through a 64 KiB buffer
#: without pre-buffering, so a process holds about a data page (and a dictionary page) per
#: column, not a row group (measured at 56 columns: ~140 MB of pyarrow's pool whether a
#: row group holds 2.5·10⁵ or 10⁶ rows; pre-buffered, it holds the whole row group).
_PARQUET_OPEN = {"buffer_size": 2**16, "pre_buffer": False}


# --------------------------------------------------------------------------- tables


def check_unique(columns: Sequence[str], where: str) -> None:
    seen: set[str] = set()
    dup = [c for c in columns if c in seen or seen.add(c)]  # type: ignore[func-returns-value]
    if dup:
        raise ValueError(
            f"{where}: column name(s) {sorted(set(dup))} appear more than once; give every "
            "column its own name"
        )


class _CsvTable:
    """A ``.csv`` file read in blocks by pyarrow's streaming reader (sequential only)."""

    random_access = False

    def __init__(self, src: str, header: bool | None) -> None:
        self.src = src
        with open(src, "rb") as fh:
            raw = fh.readline()
        if raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]
        elif raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            raise ValueError(f"{src!r} is UTF-16 text: re-encode it as UTF-8")
        text = _decode(raw, src, 1)
        fields = next(csv.reader([text]), None)
        if fields is None or not "".join(fields).strip():
            raise ValueError(f"{src!r} is empty (expected a header row or data)")
        first = [h.strip() for h in fields]
        if len(first) < 2:
            raise ValueError(f"{src!r}: needs at least 2 columns (features + target)")
        numeric = all(_is_float(c) for c in first)
        if header is None and numeric and first == [str(i) for i in range(len(first))]:
            raise ValueError(
                f"{src!r}: its first line, {','.join(first)}, may be a header (the column "
                "labels pandas writes for unnamed columns) or a row of data: say which, with "
                "header=True or header=False (flymc ingest --header or --no-header)"
            )
        if header is False and not numeric:
            bad = next(c for c in first if not _is_float(c))
            raise ValueError(
                f"{src!r} line 1: non-numeric value {bad!r}, and header=False says it is data"
            )
        self.header = bool(header or (header is None and not numeric))
        self.named = self.header
        self.columns = first if self.header else [str(i) for i in range(len(first))]
        if self.header:
            check_unique(self.columns, f"{src!r} header")
        self.n_rows: int | None = None

    def where(self, row: int) -> str:
        return f"{self.src!r} data row {row}"

    def _text_blocks(self) -> Iterator[tuple[int, bytes]]:
        """The file after its header in blocks of whole lines, each with the number of its
        first line (pyarrow's own streaming reader was measured to grow with the file)."""
        with open(self.src, "rb") as fh:
            head = fh.read(len(codecs.BOM_UTF8))
            if head != codecs.BOM_UTF8:
                fh.seek(0)
            lineno = 1
            if self.header:
                fh.readline()
                lineno = 2
            rest = b""
            while True:
                buf = fh.read(_CSV_BLOCK_BYTES)
                if not buf:
                    if rest.strip():
                        yield lineno, rest + b"\n"
                    return
                data = rest + buf
                cut = data.rfind(b"\n")
                if cut < 0:
                    rest = data
                    continue
                block, rest = data[: cut + 1], data[cut + 1 :]
                yield lineno, block
                lineno += block.count(b"\n")

    def blocks(
        self, columns: Sequence[str], categorical: Sequence[str] = ()
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        read = pcsv.ReadOptions(
            block_size=2 * _CSV_BLOCK_BYTES, column_names=self.columns, use_threads=False
        )
        types = {c: pa.string() if c in categorical else pa.float64() for c in columns}
        convert = pcsv.ConvertOptions(column_types=types, include_columns=list(columns))
        offset = 0
        for lineno, text in self._text_blocks():
            try:
                table = pcsv.read_csv(
                    pa.BufferReader(text), read_options=read, convert_options=convert
                )
            except pa.ArrowInvalid as e:
                self._diagnose(text, lineno, columns, categorical)
                last = lineno + text.count(b"\n") - 1
                raise ValueError(
                    f"{self.src!r} lines {lineno}-{last}: cannot read them as CSV: {e}"
                ) from None
            if table.num_rows == 0:
                continue
            yield offset, {c: table.column(c) for c in columns}
            offset += table.num_rows
        if offset == 0:
            raise ValueError(f"{self.src!r} is empty (no rows of data)")

    def _diagnose(
        self, text: bytes, first: int, columns: Sequence[str], categorical: Sequence[str]
    ) -> None:
        """Find the first line of a block pyarrow could not read and raise naming it (line
        by line, only after pyarrow failed)."""
        index = {c: i for i, c in enumerate(self.columns)}
        for lineno, raw in enumerate(text.splitlines(), start=first):
            line = _decode(raw, self.src, lineno)
            row = next(csv.reader([line]), [])
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(self.columns):
                raise ValueError(
                    f"{self.src!r} line {lineno}: {len(row)} fields, "
                    f"{'the header' if self.header else 'line 1'} has {len(self.columns)}"
                )
            for c in columns:
                v = row[index[c]]
                if c not in categorical and not _is_float(v):
                    hint = " (name the column in categorical=[...] to one-hot encode it)"
                    raise ValueError(
                        f"{self.src!r} line {lineno}, column {c!r}: non-numeric value {v!r}"
                        + (hint if v.strip() else "")
                    )


def _decode(raw: bytes, src: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{src!r} line {lineno} is not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
            f"{e.start + 1}): re-encode the file as UTF-8 (it may be Latin-1)"
        ) from None


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


class _NpyTable:
    """A 2-D ``.npy`` array read by row ranges (no memory map kept: a block is read and
    released)."""

    random_access = True
    named = False

    def __init__(self, src: str) -> None:
        self.src = src
        try:
            with open(src, "rb") as fh:
                version = np.lib.format.read_magic(fh)
                header = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, fortran, dtype = header(fh)
                self._offset = fh.tell()
        except ValueError as e:
            raise ValueError(f"cannot read {src!r} as a numeric .npy array: {e}") from e
        if dtype.hasobject or dtype.kind not in "biuf":
            raise ValueError(f"cannot read {src!r} as a numeric .npy array: dtype {dtype}")
        if len(shape) != 2:
            raise ValueError(f"{src!r}: expected a 2-D array (features + target), got {shape}")
        if shape[1] < 2:
            raise ValueError(f"{src!r}: needs at least 2 columns (features + target), got {shape}")
        self.shape, self.dtype, self.fortran = tuple(shape), dtype, fortran
        self.n_rows: int | None = int(shape[0])
        self.columns = [str(i) for i in range(shape[1])]

    def where(self, row: int) -> str:
        return f"{self.src!r} row {row}"

    def read(self, start: int, stop: int, columns: Sequence[str]) -> dict[str, np.ndarray]:
        d = self.shape[1]
        if self.fortran:  # column-major: a row range is scattered; read through a map
            A = np.load(self.src, mmap_mode="r", allow_pickle=False)
            block = np.array(A[start:stop])
            del A
        else:
            with open(self.src, "rb") as fh:
                fh.seek(self._offset + start * d * self.dtype.itemsize)
                block = np.fromfile(fh, dtype=self.dtype, count=(stop - start) * d)
            block = block.reshape(stop - start, d)
        return {c: block[:, int(c)] for c in columns}

    def read_blocks(
        self, start: int, stop: int, columns: Sequence[str]
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Rows ``start:stop`` in blocks: ``(first row, columns)``."""
        step = block_rows(self.shape[1])
        for s in range(start, stop, step):
            yield s, self.read(s, min(s + step, stop), columns)

    def blocks(
        self, columns: Sequence[str], categorical: Sequence[str] = ()
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        return self.read_blocks(0, self.shape[0], columns)

    def piece_starts(self, chunk_rows: int) -> list[int]:
        """Where the pieces written in parallel start (multiples of ``chunk_rows``)."""
        per = max(chunk_rows, (block_rows(self.shape[1]) // chunk_rows) * chunk_rows)
        return list(range(0, self.shape[0], per))


class _ParquetTable:
    """Parquet files (a file, a directory of them, or fsspec URLs of either), read by row
    ranges (whole row groups, sliced)."""

    random_access = True
    named = True

    def __init__(self, src: str | Sequence[str], storage_options: dict[str, Any] | None) -> None:
        import fsspec
        import pyarrow.parquet as pq

        self.storage_options = dict(storage_options or {})
        sources = [src] if isinstance(src, str | os.PathLike) else list(src)
        if not sources:
            raise ValueError("no Parquet files given")
        files: list[str] = []
        for s in sources:
            s = os.fspath(s)
            fs, root = fsspec.core.url_to_fs(s, **self.storage_options)
            if not fs.exists(root):
                raise FileNotFoundError(f"Parquet source {s!r} not found")
            if fs.isdir(root):
                found = sorted(
                    f
                    for f in fs.find(root)
                    if not any(p.startswith(("_", ".")) for p in f[len(root) :].split("/"))
                )
                if not found:
                    raise ValueError(f"{s!r} is a directory without data files")
                files += [_url_of(s, root, f) for f in found]
            else:
                files.append(s)
        self.files = files
        self.rows: list[int] = []
        self.groups: list[list[int]] = []
        self.columns: list[str] = []
        for f in files:
            try:
                with self._open(f) as fh:
                    meta = pq.ParquetFile(fh).metadata
            except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
                raise ValueError(f"cannot read {f!r} as Parquet: {type(e).__name__}: {e}") from e
            names = list(meta.schema.to_arrow_schema().names)
            if not self.columns:
                self.columns = names
                check_unique(names, f"{f!r}")
            elif names != self.columns:
                raise ValueError(
                    f"{f!r} has columns {names}, but {files[0]!r} has {self.columns}: every "
                    "file must have the same columns in the same order"
                )
            self.groups.append([meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
            self.rows.append(int(meta.num_rows))
        self.starts = np.concatenate([[0], np.cumsum(self.rows)]).astype(np.int64)
        self.n_rows: int | None = int(self.starts[-1])

    def _open(self, f: str) -> Any:
        """File ``f``, opened for reading: a local one by pyarrow itself (its reads release
        the GIL and cross no Python), a URL through fsspec."""
        if not is_url(f):
            import pyarrow as pa

            return pa.OSFile(str(local_path(f)), "rb")
        import fsspec

        return fsspec.open(f, "rb", **self.storage_options).open()

    def where(self, row: int) -> str:
        i = int(np.searchsorted(self.starts, row, side="right")) - 1
        return f"{self.files[i]!r} row {row - int(self.starts[i])}"

    def read_blocks(
        self, start: int, stop: int, columns: Sequence[str]
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Rows ``start:stop`` in blocks: ``(first row, columns)``. Only the row groups
        that hold these rows are decoded, a batch at a time, and no row group twice."""
        import pyarrow.parquet as pq

        step = block_rows(len(self.columns))
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for i in range(max(first, 0), len(self.files)):
            f0 = int(self.starts[i])
            if f0 >= stop:
                break
            lo, hi = max(start - f0, 0), min(stop - f0, self.rows[i])
            if lo >= hi:
                continue
            g_starts = np.concatenate([[0], np.cumsum(self.groups[i])])
            g_lo = int(np.searchsorted(g_starts, lo, side="right")) - 1
            g_hi = int(np.searchsorted(g_starts, hi, side="left"))
            at = int(g_starts[g_lo])  # file row of the next batch's first row
            with self._open(self.files[i]) as fh:
                # column chunks read through a small buffer, not whole: a process holds
                # a few batches, not a row group (1 Mi rows by pyarrow's default)
                pf = pq.ParquetFile(fh, **_PARQUET_OPEN)
                # decoded in this thread: pyarrow's pool threads would each keep memory
                # (~30 MB more at 56 columns) and compete with the other workers for cores
                batches = pf.iter_batches(
                    batch_size=step,
                    row_groups=list(range(g_lo, g_hi)),
                    columns=list(columns),
                    use_threads=False,
                )
                for batch in batches:
                    b0, at = at, at + batch.num_rows
                    if at <= lo:
                        continue
                    s0, s1 = max(lo, b0), min(hi, at)
                    part = batch.slice(s0 - b0, s1 - s0)
                    yield f0 + s0, {c: part.column(c) for c in columns}
                    if at >= hi:
                        break

    def blocks(
        self, columns: Sequence[str], categorical: Sequence[str] = ()
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        return self.read_blocks(0, int(self.n_rows or 0), columns)

    def piece_starts(self, chunk_rows: int) -> list[int]:
        """Where the pieces written in parallel start: at each row group, rounded up to a
        multiple of ``chunk_rows`` (so a piece decodes at most a chunk of rows it does not
        write), groups smaller than a block of rows merged with the next."""
        starts = [0]
        least = block_rows(len(self.columns))
        for f0, sizes in zip(self.starts[:-1], self.groups, strict=True):
            for g0 in np.concatenate([[0], np.cumsum(sizes)[:-1]]) + int(f0):
                s = -(-int(g0) // chunk_rows) * chunk_rows
                if s - starts[-1] >= least and s < int(self.n_rows or 0):
                    starts.append(s)
        return starts


def _url_of(src: str, root: str, found: str) -> str:
    """The address of ``found`` (a path within ``src``'s file system) in ``src``'s form."""
    if not is_url(src):
        return found
    protocol = src.split("://", 1)[0]
    return f"{protocol}://{found}"


def block_rows(n_columns: int) -> int:
    return max(1, _BLOCK_BYTES // (8 * max(n_columns, 1)))


# --------------------------------------------------------------------------- converting


class _Convert:
    """Rows ``start:stop`` of a table through a design: ``(X, y)`` (picklable: it is sent
    to the workers that write)."""

    def __init__(
        self, table: Any, design: Design, columns: Sequence[str], task: str, n_classes: Any
    ) -> None:
        self.table, self.design, self.columns = table, design, list(columns)
        self.task, self.n_classes = task, n_classes

    def __call__(
        self, start: int, stop: int, payload: Any
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if payload is not None:
            yield self.block(start, payload)
        else:
            for off, cols in self.table.read_blocks(start, stop, self.columns):
                yield self.block(off, cols)

    def block(self, start: int, cols: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(X, y)`` of the rows from ``start`` given as columns, labels checked."""
        where = self.table.where
        X, y = self.design.X(cols, where, start), self.design.y(cols, where, start)
        if self.task != "real":
            k = 2 if self.task == "binary" else int(self.n_classes)
            bad = (y != np.round(y)) | (y < 0) | (y > k - 1)
            if bad.any():
                r = int(np.argmax(bad))
                raise ValueError(
                    f"{where(start + r)}, column {self.design.target!r}: label {y[r].item()!r} "
                    f"is not in 0..{k - 1} (task {self.task!r})"
                )
        return X, y


def resolve_target(columns: Sequence[str], target: Any, named: bool, src: str) -> str:
    if target is None:
        return columns[-1]
    if named:
        if str(target) not in columns:
            raise ValueError(f"target column {target!r} not in the columns {list(columns)}")
        return str(target)
    if isinstance(target, bool):
        raise ValueError(f"target must be a column index, got {target!r}")
    try:
        t = int(str(target))
    except ValueError:
        raise ValueError(
            f"{src} has no header row (its first line is numbers), so target must be a "
            f"column index, not {target!r}"
        ) from None
    if not -len(columns) <= t < len(columns):
        raise ValueError(f"target column {t} out of range for {len(columns)} columns")
    return columns[t % len(columns)]


def check_categorical(
    categorical: Sequence[str] | None, columns: Sequence[str], target: str
) -> list[str]:
    if categorical is None:
        return []
    if isinstance(categorical, str):
        raise ValueError("categorical must be a list of column names, not a single string")
    cats = [str(c) for c in categorical]
    unknown = [c for c in cats if c not in columns]
    if unknown:
        raise ValueError(f"categorical column(s) {unknown} not in the columns {list(columns)}")
    if target in cats:
        raise ValueError(f"the target column {target!r} cannot be categorical")
    check_unique(cats, "categorical")
    return cats


def task_of(task: str | None, n_classes: int | None, stats: ColumnStats | None) -> Any:
    if task is None and stats is not None:
        task, k = stats.task()
        n_classes = k if n_classes is None else n_classes
    if task == "multiclass" and n_classes is None and stats is not None:
        n_classes = int(stats.y_max) + 1 if np.isfinite(stats.y_max) else 0
    return resolve_task(task, n_classes, None)


def _ingest_table(
    table: Any,
    path: str | os.PathLike[str],
    *,
    target: Any,
    categorical: Sequence[str] | None,
    standardize: bool,
    task: str | None,
    n_classes: int | None,
    chunk_rows: int | None,
    overwrite: bool,
    storage_options: dict[str, Any] | None,
    dtype: Any,
    client: Any,
    src: str,
) -> Dataset:
    """The two passes over a table (:func:`ingest`'s module docstring)."""
    if not isinstance(standardize, bool):
        raise ValueError(f"standardize must be True or False, got {standardize!r}")
    tgt = resolve_target(table.columns, target, table.named, src)
    cats = check_categorical(categorical, table.columns, tgt)
    features = [c for c in table.columns if c != tgt]
    numeric = [c for c in features if c not in cats] if standardize else []
    stats: ColumnStats | None = None
    if (
        task is None
        or (task == "multiclass" and n_classes is None)
        or cats
        or standardize
        or table.n_rows is None
    ):
        stats = ColumnStats()
        needed = list(dict.fromkeys([tgt, *cats, *numeric]))
        for off, cols in table.blocks(needed, cats):
            stats.update(cols, tgt, cats, numeric, table.where, off)
    n_rows = table.n_rows if table.n_rows is not None else stats.n_rows  # type: ignore[union-attr]
    if not n_rows:
        raise ValueError(f"{src} is empty (no rows of data)")
    design = (
        Design.build(features, tgt, stats, cats, standardize)
        if stats is not None
        else Design(tuple(features), tgt)
    )
    task, n_classes = task_of(task, n_classes, stats)
    x_dtype = check_dtype(dtype)
    d = design.n_features
    chunk_rows = check_chunk_rows(chunk_rows, n_rows, d, x_dtype.itemsize)
    names = design.feature_names if table.named else None
    attrs = {"design": design.to_attrs()} if design.transformed else None
    used = [*features, tgt]
    convert = _Convert(table, design, used, task, n_classes)
    if client is not None and table.random_access:
        starts = [*table.piece_starts(chunk_rows), n_rows]
        pieces: Any = ((starts[i], starts[i + 1], None) for i in range(len(starts) - 1))
    else:
        client = None  # a text file is read in order, here; so is any table without a client
        pieces = ((off, off + _n_of(cols), cols) for off, cols in table.blocks(used, cats))
    return from_pieces(
        pieces,
        convert,
        path,
        n_rows,
        d,
        task=task,
        n_classes=n_classes,
        chunk_rows=chunk_rows,
        feature_names=names,
        attrs=attrs,
        overwrite=overwrite,
        storage_options=storage_options,
        dtype=x_dtype,
        client=client,
    )


def _n_of(cols: dict[str, Any]) -> int:
    return len(next(iter(cols.values())))


# --------------------------------------------------------------------------- .npz


def _ingest_npz(src: str, target: Any) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
    if target is not None:
        raise ValueError("target is not used for .npz files (they must hold keys 'X' and 'y')")
    try:
        with np.load(src, allow_pickle=False) as f:
            missing = [k for k in ("X", "y") if k not in f.files]
            if missing:
                raise ValueError(
                    f"{src!r} must contain arrays 'X' and 'y'; missing {missing} (has {f.files})"
                )
            X, y = _npz_array(f, src, "X"), _npz_array(f, src, "y")
            names = (
                [str(v) for v in _npz_array(f, src, "feature_names")]
                if "feature_names" in f.files
                else None
            )
    except (OSError, EOFError) as e:
        raise ValueError(f"cannot read {src!r} as a .npz archive: {e}") from e
    return X, y, names


def _npz_array(f: Any, src: str, key: str) -> np.ndarray:
    """Array ``key`` of the open .npz ``f``; an array numpy cannot load without pickle
    (object dtype: Python objects, never read here) is refused naming the file and the
    array."""
    try:
        return f[key]
    except ValueError as e:
        raise ValueError(
            f"{src!r}: array {key!r} cannot be read without unpickling Python objects "
            f"(object dtype; {e}): save it as a numeric array (or, for names, strings)"
        ) from None


# --------------------------------------------------------------------------- public


def ingest(
    src: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    target: int | str | None = None,
    categorical: Sequence[str] | None = None,
    standardize: bool = False,
    task: str | None = None,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    n_classes: int | None = None,
    storage_options: dict[str, Any] | None = None,
    source_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
    header: bool | None = None,
    client: Any = None,
) -> Dataset:
    """Convert a ``.npy``, ``.npz``, ``.csv`` or Parquet file into a flymc_dist store.

    Parameters
    ----------
    src : str or os.PathLike
        Source file, by extension:

        * ``.npy`` — a 2-D numeric array; its last column is y unless ``target`` gives
          another column index (negative indices allowed). Read by row ranges.
        * ``.npz`` — arrays ``X`` and ``y`` (and optionally ``feature_names``); read whole.
        * ``.csv`` — comma separated UTF-8 (a byte-order mark is skipped), with a header
          row; ``target`` is the name of the y column (default: the last column); all
          other columns are features, named after the header (names must be unique).
          Values must parse as numbers, except in ``categorical`` columns. A first line of
          numbers only is not a header but the first row of data: the features are then
          unnamed and ``target`` is a column index; ``0,1,…,k−1`` (what pandas writes for
          unnamed columns) is refused as ambiguous unless ``header`` says which it is.
          Streamed in blocks.
        * ``.parquet`` / ``.pq`` or a directory — see :func:`from_parquet`.
    path : str or os.PathLike
        Destination (see :func:`~flymc_dist.data.from_numpy`).
    target : int or str, optional
        The y column (see above).
    categorical : sequence of str, optional
        Columns to one-hot encode (``.csv`` with a header, Parquet): the first level in
        sorted order is the reference and is dropped, the others become features named
        ``col[LEVEL]``. Recorded in the store, so prediction encodes new rows the same way.
    standardize : bool, default False
        Centre and scale every non-constant numeric feature (population standard
        deviation); recorded in the store, as ``categorical``.
    task, n_classes, chunk_rows, overwrite, dtype
        As in :func:`~flymc_dist.data.from_numpy`.
    storage_options : dict, optional
        fsspec options for a URL ``path``.
    source_options : dict, optional
        fsspec options for a Parquet URL ``src``.
    header : bool, optional
        ``.csv`` only: whether the first line is a header (True) or data (False); by
        default, a header unless it is numbers only (see above).
    client : distributed.Client, optional
        ``.npy`` and Parquet: each of its workers converts and writes its own row ranges.

    Returns
    -------
    Dataset

    Raises
    ------
    FileNotFoundError
        ``src`` does not exist.
    ValueError
        Unknown extension, unreadable or malformed content (naming the file, line or row,
        and column), or any :func:`~flymc_dist.data.from_numpy` validation error. Nothing
        is written.
    """
    src = os.fspath(src)
    check_dtype(dtype)  # before reading a large file
    ext = Path(src.rstrip("/")).suffix.lower()
    if is_url(src) or ext in _PARQUET_EXT or os.path.isdir(src):
        if header is not None:
            raise ValueError("header applies to a .csv file only")
        return from_parquet(
            src,
            path,
            target=target,
            categorical=categorical,
            standardize=standardize,
            task=task,
            n_classes=n_classes,
            chunk_rows=chunk_rows,
            overwrite=overwrite,
            storage_options=storage_options,
            source_options=source_options,
            dtype=dtype,
            client=client,
        )
    if not os.path.isfile(src):
        raise FileNotFoundError(f"source file {src!r} not found")
    if header is not None and (not isinstance(header, bool) or ext != ".csv"):
        raise ValueError(f"header applies to a .csv file only, as True or False, got {header!r}")
    common = {
        "target": target,
        "categorical": categorical,
        "standardize": standardize,
        "task": task,
        "n_classes": n_classes,
        "chunk_rows": chunk_rows,
        "overwrite": overwrite,
        "storage_options": storage_options,
        "dtype": dtype,
        "client": client,
        "src": repr(src),
    }
    if ext == ".npy":
        if target is not None and (
            isinstance(target, bool) or not isinstance(target, int | np.integer)
        ):
            raise ValueError(f"target for a .npy file must be a column index, got {target!r}")
        return _ingest_table(_NpyTable(src), path, **common)
    if ext == ".csv":
        return _ingest_table(_CsvTable(src, header), path, **common)
    if ext == ".npz":
        if categorical or standardize:
            raise ValueError("categorical and standardize apply to .csv, .npy and Parquet")
        X, y, names = _ingest_npz(src, target)
        return from_numpy(
            X,
            y,
            path,
            chunk_rows=chunk_rows,
            overwrite=overwrite,
            task=task,
            n_classes=n_classes,
            feature_names=names,
            storage_options=storage_options,
            dtype=dtype,
        )
    raise ValueError(
        f"cannot ingest {src!r}: unknown extension {ext!r} (.npy, .npz, .csv, .parquet)"
    )


def from_parquet(
    src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    path: str | os.PathLike[str],
    *,
    target: str | None = None,
    categorical: Sequence[str] | None = None,
    standardize: bool = False,
    task: str | None = None,
    n_classes: int | None = None,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    source_options: dict[str, Any] | None = None,
    dtype: str | np.dtype = "float64",
    client: Any = None,
) -> Dataset:
    """Write Parquet data as a flymc_dist store, without holding it in memory.

    Parameters
    ----------
    src : str, os.PathLike or sequence of them
        A Parquet file, a directory of them (files whose names start with ``_`` or ``.``
        are skipped; the others are read in sorted order), an fsspec URL of either
        (``s3://bucket/flights/``), or a list of these. Every file must have the same
        columns.
    path : str or os.PathLike
        Destination (see :func:`~flymc_dist.data.from_numpy`).
    target : str, optional
        The y column (default: the last column). Every other column is a feature.
    categorical, standardize
        As in :func:`ingest`. A column that is not numeric must be named in
        ``categorical``.
    task, n_classes, chunk_rows, overwrite, storage_options, dtype
        As in :func:`~flymc_dist.data.from_numpy`.
    source_options : dict, optional
        fsspec options for ``src``.
    client : distributed.Client, optional
        Each of its workers reads, converts, validates and writes its own row ranges
        (whole chunks); without one, this process does, a block at a time.

    Returns
    -------
    Dataset

    Raises
    ------
    ValueError
        A bad value (non-numeric, missing or non-finite; a label outside the task's),
        named by file, row within the file, and column; nothing is written.
    """
    table = _ParquetTable(
        src if not isinstance(src, os.PathLike) else os.fspath(src), source_options
    )
    return _ingest_table(
        table,
        path,
        target=target,
        categorical=categorical,
        standardize=standardize,
        task=task,
        n_classes=n_classes,
        chunk_rows=chunk_rows,
        overwrite=overwrite,
        storage_options=storage_options,
        dtype=dtype,
        client=client,
        src=repr(src),
    )
