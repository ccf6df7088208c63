"""The package's structure, read from its source with :mod:`ast` (nothing is imported):

- no import circle among the modules of ``flymc_dist.shard`` (the shard's state never
  imports the round; the round is functions over a group of shards);
- no ``_private`` name of one module used by another: no ``from x import _y``, no
  ``module._y``, and no ``obj._y`` where ``_y`` is not defined in the same module (a
  module's own privates, on its own objects, are its business). Private *modules*
  (``flymc_dist._compiled``) are the package's, not one module's, and may be imported.

Each check is also run on small planted examples, so that a checker that cannot fail is
caught too.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from test_imports import find_cycle, import_graph, package_modules

import flymc_dist

PACKAGE = Path(flymc_dist.__file__).resolve().parent

#: Private names of the standard library or of a dependency used on purpose: name -> why.
#: (The check cannot tell whose ``obj._y`` it is; a name listed here is allowed anywhere.)
ALLOWED_FOREIGN: dict[str, str] = {
    "_replace": "NamedTuple's public API (leading underscore to avoid field clashes)",
    "_fields": "NamedTuple's public API",
    "_asdict": "NamedTuple's public API",
    "_make": "NamedTuple's public API",
    "_getframe": "sys._getframe: the caller's frame (the unguarded-script check)",
    "_call_s3": "s3fs's one call for a body and its ETag in one request",
    "_store": "zarr's WrapperStore keeps the store it wraps there",
}

#: Cross-module uses not yet removed, each with its owner's reason: ``"module: name"`` ->
#: why. An entry that no longer occurs is a failure too (the list must say what the
#: code does).
PENDING: dict[str, str] = {
    "flymc_dist._compiled_kernels: _bright_and_slope": "flymc_dist._compiled is being reworked",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# ------------------------------------------------------------------------- import cycles
def every_import(root: Path, name: str, within: str) -> dict[str, set[str]]:
    """``module -> modules under ``within`` it imports``, for the modules under ``within``
    of the package at ``root``: any import (module level, in a function or under
    ``TYPE_CHECKING``), read by :func:`test_imports.import_graph`."""
    graph, lazy = import_graph(root, name, type_checking=True)
    mods = {m for m in graph if m.startswith(within)}
    return {m: (graph[m] | {t for t, _ in lazy[m]}) & mods for m in mods}


def test_no_import_cycle_in_shard() -> None:
    """The worker side imports without a circle: state, then the round over it."""
    graph = every_import(PACKAGE, "flymc_dist", "flymc_dist.shard")
    assert len(graph) > 3
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_shard_does_not_import_transport() -> None:
    """The shards know nothing of the transport (the host is given its channel)."""
    graph, lazy = import_graph(PACKAGE, "flymc_dist", type_checking=True)
    bad = {
        m: sorted(
            t for t in graph[m] | {t for t, _ in lazy[m]} if t.startswith("flymc_dist.transport")
        )
        for m in graph
        if m.startswith("flymc_dist.shard")
    }
    assert {m: t for m, t in bad.items() if t} == {}


def test_cycle_checker_sees_a_planted_cycle(tmp_path: Path) -> None:
    root = tmp_path / "p"
    files = {
        "__init__.py": "",
        "a.py": "from p.b import f\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.c import g\n",
        "c.py": "def g():\n    import p.a\n",
        "d.py": "from p import a\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    cycle = find_cycle(every_import(root, "p", "p."))
    assert cycle is not None and set(cycle) == {"p.a", "p.b", "p.c"}


# ------------------------------------------------------------------------ private names
def _sources(root: Path, name: str) -> dict[str, str]:
    return {m: p.read_text() for m, p in package_modules(root, name).items()}


def _defined(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, assignments (names, and
    attributes of ``self``/``cls`` stored to: ``self._x = …``) and arguments."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {n for n in out if _private(n)}


def private_uses(modules: dict[str, str], package: str) -> list[str]:
    """Every use of another module's ``_private`` name in ``modules`` (name -> source):
    ``module:line: what``."""
    subpackages = {m.rsplit(".", 1)[-1] for m in modules}
    found = []
    for mod, text in sorted(modules.items()):
        tree = ast.parse(text)
        own = _defined(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    in_pkg = (node.module or "").startswith(package) or node.level
                    is_module = f"{node.module}.{a.name}" in modules
                    if in_pkg and _private(a.name) and not is_module:
                        found.append(f"{mod}:{node.lineno}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                name = node.attr
                if name in own or name in ALLOWED_FOREIGN or name in subpackages:
                    continue
                found.append(f"{mod}:{node.lineno}: .{name}")
    return found


def _key(use: str) -> str:
    """``"module: name"`` of a use reported by :func:`private_uses`."""
    return f"{use.split(':')[0]}: {use.rsplit(' ', 1)[-1].lstrip('.')}"


def test_no_private_name_crosses_modules() -> None:
    """Only public names cross modules: a module uses only its own ``_private`` names
    (but for the :data:`PENDING` ones, each of which must still occur)."""
    found = private_uses(_sources(PACKAGE, "flymc_dist"), "flymc_dist")
    assert [u for u in found if _key(u) not in PENDING] == []
    assert sorted(set(PENDING) - {_key(u) for u in found}) == []


def test_private_checker_sees_planted_uses() -> None:
    mods = {
        "p.a": textwrap.dedent(
            """
            class A:
                def __init__(self):
                    self._x = 1
                def f(self, other):
                    return self._x + other._x
            def _helper():
                return 0
            """
        ),
        "p.b": textwrap.dedent(
            """
            from p.a import _helper, A
            from p import _compiled
            def g(a: A):
                return a._x + _helper() + a.__class__.__name__.__len__()
            """
        ),
        "p._compiled": "X = 1\n",
    }
    assert private_uses(mods, "p") == ["p.b:2: from p.a import _helper", "p.b:5: ._x"]
