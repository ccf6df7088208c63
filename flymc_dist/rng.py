"""Random streams: every random number of a run comes from one keyed stream.

Randomness is keyed by ``SeedSequence(seed, spawn_key=(role, shard or chain, …,
generation))``, never by worker, so the same seed gives the same draws in-process and on
any number of workers. The *generation* of the shards' z streams is one counter that
resume and fault recovery advance together (kept in every checkpoint): no two segments
of a run, nor a recovery, ever draw from the same z stream.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: spawn-key roles: randomness is keyed by (seed, role, shard, chain, generation), never by worker
ROLE_Z = 1
ROLE_AUSTERITY = 2
ROLE_KERNEL = 3
ROLE_INIT = 4


def stream(seed: int, *key: int) -> np.random.Generator:
    """The random stream for ``SeedSequence(seed, spawn_key=key)``."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=tuple(int(k) for k in key)))


def rng_state_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """A bit generator's state as JSON (its integers as strings: they exceed 2**53)."""

    def conv(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        if isinstance(x, int) and not isinstance(x, bool):
            return str(x)
        return x

    return conv(state)


def rng_state_from_json(state: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`rng_state_to_json`."""

    def conv(x: Any, key: str = "") -> Any:
        if isinstance(x, dict):
            return {k: conv(v, k) for k, v in x.items()}
        if isinstance(x, str) and key != "bit_generator":
            return int(x)
        return x

    return conv(state)
