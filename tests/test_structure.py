"""The package's import structure: the driver side imports no worker module, and the
FlyMC shard and an add-on sampler's shard side do not import each other.

Read from the sources (every ``import`` a module can run, at its top or inside a
function, except those under ``if TYPE_CHECKING:``), because importing a submodule
runs ``flymc_dist/__init__.py``, which imports everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _path(module: str) -> Path | None:
    p = ROOT.joinpath(*module.split("."))
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _imports(module: str) -> set[str]:
    tree = ast.parse(_path(module).read_text(encoding="utf-8"))
    skip = _type_checking_nodes(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def reachable(start: str) -> set[str]:
    """Every module ``start`` imports, directly or not: the package's own (with the
    ``__init__`` of each subpackage on the way, but not ``flymc_dist/__init__``) and the
    top-level names of the others."""
    seen: set[str] = set()
    todo = [start]
    outside: set[str] = set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for name in _imports(m):
            if not name.startswith("flymc_dist."):
                outside.add(name.split(".")[0])
                continue
            if _path(name) is None:  # a name imported from a module
                continue
            parts = name.split(".")
            todo += [".".join(parts[:k]) for k in range(2, len(parts) + 1)]
    return seen | outside


def test_the_walk_sees_imports() -> None:
    """The walk finds what is there (so the checks below can fail)."""
    assert {"flymc_dist.shard.host", "distributed"} <= reachable("flymc_dist.transport.dask")
    assert "flymc_dist.shard.shard" in reachable("flymc_dist.shard")


@pytest.mark.parametrize("module", ["flymc_dist.driver", "flymc_dist.replica", "flymc_dist.run"])
def test_the_driver_side_imports_no_worker_module(module: str) -> None:
    reached = reachable(module)
    worker = sorted(
        m
        for m in reached
        if m.startswith(("flymc_dist.shard", "flymc_dist.transport", "flymc_dist.austerity"))
        or m in ("distributed", "dask")
    )
    assert worker == [], f"{module} imports {worker}"


def test_the_shard_and_austerity_do_not_import_each_other() -> None:
    assert not any(m.startswith("flymc_dist.austerity") for m in reachable("flymc_dist.shard"))
    assert not any(
        m.startswith("flymc_dist.shard") for m in reachable("flymc_dist.austerity.shard")
    )
