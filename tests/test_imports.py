"""The package's own imports: no cycles between its modules, and no imports of its own
modules inside functions except the few listed (and explained) in :data:`ALLOWED_LAZY`.

Both checks read the source with :mod:`ast` (nothing is imported). Each check is also run
on small planted examples, so that a checker that cannot fail is caught too.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import flymc_dist

PACKAGE = Path(flymc_dist.__file__).resolve().parent

#: Function-level imports of the package's own modules that are deliberate:
#: ``(importing module, imported module) -> why``. Every other one is a failure, and an
#: entry that no longer occurs is one too (the list must say what the code does).
ALLOWED_LAZY: dict[tuple[str, str], str] = {
    # numba costs ~0.5 s to import (plus compilation on first use); only shards and the
    # replica compute with it, so `import flymc_dist` and the CLI do not pay for it.
    ("flymc_dist.replica", "flymc_dist._compiled"): "numba, heavy: only where it computes",
    ("flymc_dist.shard.state", "flymc_dist._compiled"): "numba, heavy: only where it computes",
    ("flymc_dist.replica", "flymc_dist._compiled_kernels"): "numba, heavy: only where it computes",
    ("flymc_dist.replica", "flymc_dist._compiled_loop"): "numba, heavy: only where it computes",
    ("flymc_dist.ahead", "flymc_dist._compiled"): "numba, heavy: only where it computes",
}


# ----------------------------------------------------------------------------- the checker
def package_modules(root: Path, name: str) -> dict[str, Path]:
    """Every module of the package at ``root`` (named ``name``): dotted name -> file."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([name, *parts])] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool, known: set) -> set:
    """The package modules an import statement names (submodules where a name is one)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    base = node.module or ""
    if node.level:  # relative: from the module's package, up level - 1 more
        pkg = module.split(".") if is_pkg else module.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    out = set()
    for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in known:
            out.add(sub)
        elif base in known:
            out.add(base)
    return out


def _with_packages(found: set[str], module: str, known: set[str]) -> set[str]:
    """``found`` and the sub-packages an import of each runs first (their ``__init__``).

    Importing ``pkg.sub.mod`` runs ``pkg/sub/__init__.py`` before ``mod``: an edge to
    ``pkg.sub`` too, so a cycle through a sub-package's re-exports is seen. Packages that
    contain ``module`` are left out: they are already being imported when it runs.
    """
    own = module.split(".")
    out = set(found)
    for target in found:
        parts = target.split(".")
        for i in range(1, len(parts)):
            if own[:i] != parts[:i] and ".".join(parts[:i]) in known:
                out.add(".".join(parts[:i]))
    return out


def module_imports(
    path: Path, module: str, known: set[str], type_checking: bool = False
) -> tuple[set[str], list[tuple[str, int]]]:
    """``(module-level imports, function-level imports as (module, line))`` of one file,
    restricted to the package's modules ``known``. Imports under ``if TYPE_CHECKING:``
    never run and are left out (counted as module-level with ``type_checking``: the
    structure's stricter rule); class bodies run at import time and count as module-level.
    An import of a sub-package's module counts as one of the sub-package as well
    (:func:`_with_packages`).
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    top: set[str] = set()
    lazy: list[tuple[str, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found = _with_packages(_targets(child, module, is_pkg, known), module, known)
                if in_function:
                    lazy.extend((m, child.lineno) for m in sorted(found))
                else:
                    top.update(found)
                continue
            inner = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            visit(child, inner)

    visit(tree, False)
    top.discard(module)
    return top, lazy


def import_graph(
    root: Path, name: str, type_checking: bool = False
) -> tuple[dict[str, set[str]], dict[str, list]]:
    """The module-level import graph of a package and its function-level imports
    (``type_checking``: see :func:`module_imports`)."""
    mods = package_modules(root, name)
    known = set(mods)
    graph, lazy = {}, {}
    for mod, path in mods.items():
        graph[mod], lazy[mod] = module_imports(path, mod, known, type_checking)
    return graph, lazy


@functools.cache
def package_graph() -> tuple[dict[str, set[str]], dict[str, list]]:
    """:func:`import_graph` of flymc_dist, parsed once for the module's tests (each parse
    reads every file of the package: seconds); read it, never change it."""
    return import_graph(PACKAGE, "flymc_dist")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its nodes in order, the first repeated at the end), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path = [start]
        colour[start] = GREY
        while stack:
            node, todo = stack[-1]
            if not todo:
                colour[node] = BLACK
                stack.pop()
                path.pop()
                continue
            nxt = todo.pop(0)
            state = colour.get(nxt, BLACK)  # a target outside the graph closes no cycle
            if state == GREY:
                return path[path.index(nxt) :] + [nxt]
            if state == WHITE:
                colour[nxt] = GREY
                path.append(nxt)
                stack.append((nxt, sorted(graph.get(nxt, ()))))
    return None


def unlisted_lazy(lazy: dict[str, list], allowed: dict) -> list[str]:
    """Function-level imports not in ``allowed``, as ``'module:line imports target'``."""
    return [
        f"{mod}:{line} imports {target}"
        for mod, found in sorted(lazy.items())
        for target, line in found
        if (mod, target) not in allowed
    ]


# ------------------------------------------------------------------------------ the package
def test_no_import_cycles_in_the_package() -> None:
    graph, _ = package_graph()
    assert len(graph) > 30 and "flymc_dist.api" in graph  # it saw the package
    assert "flymc_dist.austerity.sampler" in graph["flymc_dist.api"]  # and its imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_function_level_imports_only_where_listed() -> None:
    _, lazy = package_graph()
    bad = unlisted_lazy(lazy, ALLOWED_LAZY)
    assert not bad, "function-level imports of the package's own modules:\n" + "\n".join(bad)
    present = {(mod, target) for mod, found in lazy.items() for target, _ in found}
    stale = sorted(set(ALLOWED_LAZY) - present)
    assert not stale, f"ALLOWED_LAZY lists imports that no longer exist: {stale}"


def reachable(graph: dict[str, set[str]], lazy: dict[str, list], start: str) -> set[str]:
    """Every package module importing ``start`` can run, at module level or in a function."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen or m not in graph:
            continue
        seen.add(m)
        todo += sorted(graph[m]) + [t for t, _ in lazy.get(m, [])]
    return seen


def imports_outside(path: Path) -> set[str]:
    """The top-level names of every package an ``import`` in ``path`` names (any level)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


WORKER_SIDE = ("flymc_dist.shard", "flymc_dist.transport", "flymc_dist.austerity")


@pytest.mark.parametrize("module", ["flymc_dist.driver", "flymc_dist.replica", "flymc_dist.run"])
def test_the_driver_side_imports_no_worker_module(module: str) -> None:
    """The driver's chains, its replica and the runner reach no shard, transport or
    austerity module, and nothing that imports Dask (``flymc_dist/__init__`` aside, which
    imports everything)."""
    graph, lazy = package_graph()
    reached = reachable(graph, lazy, module) - {"flymc_dist"}
    assert "flymc_dist.models" in reached  # it saw the imports
    worker = sorted(m for m in reached if m.startswith(WORKER_SIDE))
    assert not worker, f"{module} imports {worker}"
    mods = package_modules(PACKAGE, "flymc_dist")
    dask = sorted(m for m in reached if imports_outside(mods[m]) & {"distributed", "dask"})
    assert not dask, f"{module} imports Dask through {dask}"


#: heavy libraries the package imports where used, not with it: every Dask worker imports
#: flymc_dist, and their ~45 MB (scipy.stats with scipy.optimize) counted against a worker's
#: memory limit while only the driver's set-up and the SV sampler's φ draw use them
NOT_AT_IMPORT = ("scipy.stats", "scipy.optimize")


def test_importing_the_package_loads_no_heavy_library_it_only_uses_in_places() -> None:
    code = (
        "import sys, flymc_dist, flymc_dist.shard.state, flymc_dist.transport.host;"
        f"print(sorted(m for m in {NOT_AT_IMPORT!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=PACKAGE.parent,
    )
    assert out.stdout.strip() == "[]", f"import flymc_dist loads {out.stdout.strip()}"


def test_the_shard_and_austerity_do_not_import_each_other() -> None:
    """Austerity marks its own shard operations (protocol.shard_operation): the FlyMC shard
    names none of them, and austerity's shard side needs nothing of the shard's."""
    graph, lazy = package_graph()
    assert not any(
        m.startswith("flymc_dist.austerity") for m in reachable(graph, lazy, "flymc_dist.shard")
    )
    assert not any(
        m.startswith("flymc_dist.shard")
        for m in reachable(graph, lazy, "flymc_dist.austerity.shard")
    )
    # the walk sees what is there: the Dask transport reaches the shards (through its host)
    assert "flymc_dist.shard.state" in reachable(graph, lazy, "flymc_dist.transport.dask")


# ------------------------------------------------------------------- the checker can fail
@pytest.mark.parametrize(
    "graph,cyclic",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}, False),  # a diamond
        ({"a": {"b"}, "b": {"a"}}, True),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, True),
        ({"a": {"a"}}, True),
        ({"a": {"outside"}}, False),
    ],
)
def test_find_cycle_on_planted_graphs(graph: dict, cyclic: bool) -> None:
    cycle = find_cycle(graph)
    assert (cycle is not None) is cyclic
    if cycle:
        assert cycle[0] == cycle[-1]
        assert all(b in graph[a] for a, b in zip(cycle, cycle[1:], strict=False))


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


def test_planted_package_cycle_and_lazy_imports_are_found(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": "from pkg.a import f\n",
            "a.py": "from pkg import b\n\ndef f():\n    from pkg.c import g\n    return g\n",
            "b.py": "from typing import TYPE_CHECKING\n"
            "from .sub import leaf\n"
            "if TYPE_CHECKING:\n    from pkg.a import f\n",
            "c.py": "import pkg.sub.leaf\n\ndef g():\n    pass\n",
            "sub/__init__.py": "",
            "sub/leaf.py": "class K:\n    from pkg import a\n",
        },
    )
    graph, lazy = import_graph(root, "pkg")
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.leaf"}  # relative; TYPE_CHECKING left out
    assert graph["pkg.c"] == {"pkg.sub", "pkg.sub.leaf"}  # pkg/sub/__init__.py runs first
    assert graph["pkg.sub.leaf"] == {"pkg.a"}  # a class body runs at import time
    assert lazy["pkg.a"] == [("pkg.c", 4)]
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"pkg.a", "pkg.b", "pkg.sub.leaf"}
    assert unlisted_lazy(lazy, {}) == ["pkg.a:4 imports pkg.c"]
    assert unlisted_lazy(lazy, {("pkg.a", "pkg.c"): "why"}) == []


@pytest.mark.parametrize("reexport", [True, False])
def test_planted_cycle_through_a_sub_package_init_is_found(tmp_path: Path, reexport: bool) -> None:
    """shard -> transport.channel runs transport/__init__.py first: re-exporting a module
    that imports the shard there is a cycle; an ``__init__`` that imports nothing is not."""
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "shard.py": "from pkg.transport.channel import C\n",
            "transport/__init__.py": (
                "from pkg.transport.inprocess import T\n" if reexport else '"""doc"""\n'
            ),
            "transport/inprocess.py": (
                "from pkg.shard import S\nfrom pkg.transport import channel\n"
            ),
            "transport/channel.py": "C = 1\n",
        },
    )
    graph, _ = import_graph(root, "pkg")
    assert graph["pkg.shard"] == {"pkg.transport", "pkg.transport.channel"}
    # a package's own modules get no edge to it (it is already being imported)
    assert graph["pkg.transport.inprocess"] == {"pkg.shard", "pkg.transport.channel"}
    cycle = find_cycle(graph)
    if reexport:
        assert cycle is not None
        assert set(cycle) == {"pkg.shard", "pkg.transport", "pkg.transport.inprocess"}
    else:
        assert cycle is None
