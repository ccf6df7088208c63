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

from test_imports import package_modules

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
    "flymc_dist._compiled_nuts: _JIT": "flymc_dist._compiled is being reworked (hot path)",
    "flymc_dist._compiled_nuts: _bright_and_slope": "flymc_dist._compiled is being reworked",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# ------------------------------------------------------------------------- import cycles
def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """``module -> modules of ``modules`` it imports`` (any import: module level, in a
    function or under ``TYPE_CHECKING``), from the sources ``modules`` (name -> text)."""
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for mod, text in modules.items():
        is_pkg = False
        edges: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in known}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".")[: len(mod.split(".")) - node.level + int(is_pkg)]
                    base = ".".join(pkg + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in known:
                        edges.add(sub)
                    elif base in known:
                        edges.add(base)
        graph[mod] = edges - {mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _sources(root: Path, name: str) -> dict[str, str]:
    return {m: p.read_text() for m, p in package_modules(root, name).items()}


def test_no_import_cycle_in_shard() -> None:
    """The worker side imports without a circle: state, then the round over it."""
    mods = {
        m: t for m, t in _sources(PACKAGE, "flymc_dist").items() if m.startswith("flymc_dist.shard")
    }
    assert cycles(import_graph(mods)) == []


def test_shard_does_not_import_transport() -> None:
    """The shards know nothing of the transport (the host is given its channel)."""
    mods = _sources(PACKAGE, "flymc_dist")
    graph = import_graph(mods)
    bad = {
        m: sorted(t for t in targets if t.startswith("flymc_dist.transport"))
        for m, targets in graph.items()
        if m.startswith("flymc_dist.shard")
    }
    assert {m: t for m, t in bad.items() if t} == {}


def test_cycle_checker_sees_a_planted_cycle() -> None:
    mods = {
        "p.a": "from p.b import f\n",
        "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.c import g\n",
        "p.c": "import p.a\n",
        "p.d": "from p import a\n",
    }
    assert cycles(import_graph(mods)) == [["p.a", "p.b", "p.c"]]


# ------------------------------------------------------------------------ private names
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
