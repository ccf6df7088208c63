"""What a default ``pytest`` run leaves out, recorded while the session collects.

``tests/conftest.py`` stores, for every session, the items a default run keeps and those
it leaves to ``--full-grid`` (the tests marked with one of its ``CI_ONLY_MARKERS``),
whether or not this session runs with ``--full-grid``; tests/test_tiers.py checks that
what is left out is covered by what is kept.
"""

from __future__ import annotations

import pytest

#: the session's ``(kept, left_out)`` records (:func:`record_of`), in ``config.stash``
RECORDS = pytest.StashKey[tuple[list[dict], list[dict]]]()


def record_of(item: pytest.Item) -> dict:
    """``{"nodeid", "function", "id", "markers"}`` of a collected test: its node id, its
    test function's node id (``file::[Class::]name``), its parameter id (``""`` if none)
    and the names of its markers."""
    callspec = getattr(item, "callspec", None)
    return {
        "nodeid": item.nodeid,
        "function": item.nodeid.split("[")[0],
        "id": callspec.id if callspec is not None else "",
        "markers": sorted({m.name for m in item.iter_markers()}),
    }
