"""Where a store lives — data set or trace: an fsspec URL, or a local path.

One definition for every caller: a *URL* is a string holding ``"://"`` whose protocol is
not ``file``; everything else, ``file://`` URLs included, is a local path
(:func:`local_path` strips the ``file://``). So a ``file://`` store is written, locked,
checked and removed as the local directory it is (renames, inodes, ``rmtree``), never
through fsspec, and ``storage_options`` apply to URLs only.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["FILE_PREFIX", "is_url", "local_path"]

#: the prefix of a local path written as a URL
FILE_PREFIX = "file://"


def is_url(path: object) -> bool:
    """Whether ``path`` is an fsspec URL (``s3://…``, ``memory://…``; not ``file://…``)."""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    return isinstance(text, str) and "://" in text and not text.startswith(FILE_PREFIX)


def local_path(path: str | os.PathLike[str]) -> Path:
    """The local path of ``path`` (not a URL: see :func:`is_url`), ``file://`` stripped."""
    text = os.fspath(path)
    return Path(text[len(FILE_PREFIX) :] if text.startswith(FILE_PREFIX) else text)
