"""A store that cannot be reached is not a damaged one (#28 item 7).

A connection refused, reset or timed out (the S3 endpoint down, the network gone) is told
apart from a store that answers with damage: :func:`unreachable` recognises it through
the exception's chain, :func:`retry` retries such failures a bounded number of times, and
:class:`StoreUnreachableError` is what a read or write raises once it gives up, naming the
store and the last failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["RETRIES", "RETRY_PAUSE", "StoreUnreachableError", "retry", "unreachable"]

#: Attempts at an operation on a store that cannot be reached, before giving up (the
#: fsspec client's own retries happen within each attempt).
RETRIES = 3
#: Seconds before the second attempt, doubled before each further one.
RETRY_PAUSE = 2.0

T = TypeVar("T")


class StoreUnreachableError(OSError):
    """A store (data set or trace) could not be reached: connection refused, reset or timed
    out. Nothing in it is known to be damaged."""


def _connection_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        import botocore.exceptions as boto

        types += [boto.ConnectionError, boto.HTTPClientError]
    except ImportError:
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError]
    except ImportError:
        pass
    try:
        from fsspec.exceptions import FSTimeoutError

        types += [FSTimeoutError]
    except ImportError:
        pass
    return tuple(types)


def unreachable(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a failure to reach a store:
    a connection refused, reset or closed, or a time-out."""
    types = _connection_types()
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (StoreUnreachableError, *types)):
            return True
        todo += [e.__cause__, e.__context__]
    return False


def describe(err: BaseException) -> str:
    """``"<type>: <message>"`` of the connection failure in ``err``'s chain (else of
    ``err``)."""
    types = _connection_types()
    e: BaseException | None = err
    while e is not None:
        if isinstance(e, types) and not isinstance(e, StoreUnreachableError):
            return f"{type(e).__name__}: {e}"
        e = e.__cause__ or e.__context__
    return f"{type(err).__name__}: {err}"


def retry(operation: Callable[[], T], what: str) -> T:
    """Run ``operation``, again after a pause if it fails to reach its store, at most
    :data:`RETRIES` times in all.

    Parameters
    ----------
    operation
        Idempotent: running it again after a failure must be harmless.
    what
        The store, as the error names it (e.g. ``"data set 's3://b/d.zarr'"``).

    Raises
    ------
    StoreUnreachableError
        After the last attempt failed to reach the store.
    """
    pause, attempt = RETRY_PAUSE, 1
    while True:
        try:
            return operation()
        except StoreUnreachableError:
            raise
        except Exception as err:
            if not unreachable(err):
                raise
            if attempt >= RETRIES:
                raise StoreUnreachableError(
                    f"{what} cannot be reached ({describe(err)}; {RETRIES} attempts): the "
                    "store is unreachable, not damaged"
                ) from err
        time.sleep(pause)
        pause, attempt = 2.0 * pause, attempt + 1
