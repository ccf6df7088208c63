"""A shard's rows lent to a driver on its machine: shared memory, read-only at the driver.

In replica mode the driver reads ahead the rows each chain's dark→bright proposals hit
(:mod:`flymc_dist.ahead`). A host on another machine gathers them and sends them; a
host on the driver's own machine need not: its in-memory rows live in shared memory
(:class:`Segment`, a Linux ``memfd``), and it hands the driver the file descriptors
once, over the round channel's local socket (``SCM_RIGHTS``: the kernel passes them
between the two processes, on a connection already authenticated under the run's key;
:mod:`flymc_dist.transport.channel`). The driver maps them read-only
(:class:`LentRows`) and draws the proposals and gathers their rows itself, with the
same functions on the same bytes as the host (:func:`flymc_dist.shard.state.propose`):
the same blocks, so the same draws, bit for bit — and no request, gather, reply or
copy per block on the host.

Safety: each segment is sealed against shrinking and growing before it is lent (a
mapping of a file that shrank would fault on the driver's next read), and the driver
refuses a descriptor that is not so sealed or is shorter than its description says.
The driver maps with ``PROT_READ``: it cannot change the host's rows. A segment's
memory lives until both the host has closed it and the driver has unmapped it
(:meth:`LentRows.close`, when the run ends or the host is lost).
"""

from __future__ import annotations

import mmap
import os
import sys
from typing import Any

import numpy as np

from flymc_dist.shard.rows import rows_and_constants, tail_bytes, xi_offset

try:
    import fcntl
except ImportError:  # not on this platform: nothing is lent
    fcntl = None  # type: ignore[assignment]

#: whether this platform can lend rows (Linux: ``memfd_create`` and file seals)
LENDING = (
    sys.platform.startswith("linux")
    and hasattr(os, "memfd_create")
    and fcntl is not None
    and hasattr(fcntl, "F_ADD_SEALS")
)
#: the seals a lent segment must carry: its size is fixed for good
SEALS = 0 if not LENDING else fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

__all__ = ["LENDING", "LentRows", "Segment", "segment_or_none"]


class Segment:
    """``nbytes`` of shared memory (a sealed ``memfd``), mapped read-write here.

    Parameters
    ----------
    nbytes
        Its size (at least one byte is made).
    """

    def __init__(self, nbytes: int) -> None:
        size = max(int(nbytes), 1)
        self.fd = os.memfd_create("flymc-lent-rows", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.nbytes = size

    def array(self, shape: tuple[int, ...], dtype: Any, offset: int = 0) -> np.ndarray:
        """A writable array of ``shape`` and ``dtype`` at ``offset`` bytes into the
        segment."""
        return _view(self.map, shape, dtype, offset)

    def close(self) -> None:
        """Close the descriptor (the memory stays while an array or a lent mapping
        holds it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def segment_or_none(nbytes: int) -> Segment | None:
    """A :class:`Segment` of ``nbytes``, or None where this platform cannot lend or the
    kernel refuses one (then the rows stay in private memory and are sent)."""
    if not LENDING:
        return None
    try:
        return Segment(nbytes)
    except OSError:
        return None


def _view(buf: mmap.mmap, shape: tuple[int, ...], dtype: Any, offset: int = 0) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` over ``buf`` from ``offset`` bytes (writable
    where ``buf`` is)."""
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(buf, dtype=np.dtype(dtype), count=count, offset=offset).reshape(shape)


def _mapped(fd: int, nbytes: int) -> mmap.mmap:
    """``fd`` mapped read-only, after checking its seals and size (its pages are mapped
    as the driver first reads them: the page tables grow with the rows it reads, not
    with the shard)."""
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SEALS != SEALS:
        raise ValueError("a lent segment must be sealed against shrinking and growing")
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise ValueError(f"a lent segment of {size} bytes, its description says {nbytes}")
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


class LentRows:
    """A shard's in-memory rows as lent to the driver: read-only views of the host's
    ``XC`` (features, then row constants), ``y`` and ``xi`` (tight points), with the
    parameters its proposals are drawn with.

    Parameters
    ----------
    meta
        :meth:`~flymc_dist.shard.state.Shard.lend`'s description.
    fds
        Its two descriptors (the rows' buffer; targets and tight points). They are
        closed here, mapped or not.
    """

    def __init__(self, meta: dict[str, Any], fds: list[int]) -> None:
        try:
            if len(fds) != 2:
                raise ValueError(f"a lent shard comes with 2 descriptors, got {len(fds)}")
            n, width = int(meta["n"]), int(meta["width"])
            y_dtype = np.dtype(str(meta["y_dtype"]))
            self.shard_id = int(meta["shard_id"])
            self.start, self.n, self.n_total = int(meta["start"]), n, int(meta["n_total"])
            self.n_features = int(meta["n_features"])
            self.seed, self.chains = int(meta["seed"]), int(meta["chains"])
            self.q = float(meta["q"])
            self.stored = np.dtype(str(meta["stored"]))
            if not (
                n >= 0
                and 1 <= self.n_features <= width
                and y_dtype.kind in "biuf"
                and self.stored in (np.float32, np.float64)
                and 0 <= self.start <= self.start + n <= self.n_total
                and self.chains >= 1
                and 0.0 < self.q <= 1.0
            ):
                raise ValueError(f"a lent shard described as {meta!r}")
            self._maps = (_mapped(fds[0], n * width * 8), _mapped(fds[1], tail_bytes(n, y_dtype)))
        finally:
            for fd in fds:
                os.close(fd)
        self.XC = _view(self._maps[0], (n, width), np.float64)
        self.y = _view(self._maps[1], (n,), y_dtype)
        self.xi = _view(self._maps[1], (n,), np.float64, xi_offset(n, y_dtype))

    def rows_and_constants(
        self, rows: np.ndarray, dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """Shard-local ``rows`` as the host's read-ahead reply gives them
        (:func:`~flymc_dist.shard.rows.rows_and_constants`)."""
        return rows_and_constants(self.XC, self.n_features, self.y, self.xi, rows, dtype)

    def close(self) -> None:
        """Unmap the rows now (their views must not be used after)."""
        self.XC = self.y = self.xi = None  # type: ignore[assignment]
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view still held elsewhere: unmapped when it goes
                pass
        self._maps = ()
