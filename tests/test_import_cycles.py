"""No import cycle between files (issue 40), read from the source.

tests/test_layers.py keeps the packages in layers, but a cycle inside one package passes it:
daemon/registry.py once imported daemon/serve.py inside a function, which imported
daemon/models.py, which imported the registry. Here every module of ours is a node and every
import statement an edge: at module level, inside functions and methods (deferred imports still
bind the two files together, and run on some path), and under `if TYPE_CHECKING:` (a type-only
import still makes the lower module know the higher one; none exists today). A module's implicit
import of its own package's __init__ is not an edge: that is how Python loads any submodule, and a
package whose __init__ re-exports its modules would otherwise always be on a cycle.

`from pkg import name` is an edge to pkg.name where that is a module of ours, else to pkg."""
from __future__ import annotations

import ast

from test_layers import from_base, modules, probe_module

# Edges a cycle may use, by name, each with its reason: a registration pattern (a registry that
# imports its members on first use, while each member imports the registry to register itself).
ALLOWED: dict[tuple[str, str], str] = {
    # ops.py imports the Triton kernels once, on a CUDA machine, and triton_ops.py registers each
    # with ops on import (its docstring): ops never names a Triton kernel itself.
    ("ridge.kernels.ops", "ridge.kernels.triton_ops"): "triton_ops registers its kernels with ops",
}


def edges_of(name: str) -> dict[str, int]:
    """The modules of ours that `name` imports -> the line of the first such import."""
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: dict[str, int] = {}
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        found = []
        if isinstance(n, ast.Import):
            found = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = from_base(n, package)
            found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules() else base for a in n.names]
        for target in found:
            # `import ridge.engine.config` binds ridge.engine.config; a name we do not hold is not ours
            if target in modules() and target != name:
                out.setdefault(target, n.lineno)
    return out


def graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, the allowed edges left out."""
    return {m: {t: line for t, line in edges_of(m).items() if (m, t) not in ALLOWED} for m in modules()}


def cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle, as a path that returns to its start, for each strongly connected component of
    more than one module (Tarjan's algorithm, iterative: the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    return [_path_in(g, set(c)) for c in sorted(components)]


def _path_in(g: dict[str, dict[str, int]], comp: set[str]) -> list[str]:
    """The shortest cycle through the component's first module (breadth first, inside it)."""
    start = min(comp)
    came: dict[str, str] = {}
    todo = [start]
    while todo:
        nxt = []
        for v in todo:
            for w in sorted(g[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w in comp and w not in came:
                    came[w] = v
                    nxt.append(w)
        todo = nxt
    raise AssertionError(f"no cycle through {start}")


def describe(g: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {g[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_import_cycle_between_files():
    g = graph()
    found = cycles(g)
    assert not found, "import cycles between files (break them, or allow an edge by name in ALLOWED):\n" + \
        "\n".join(describe(g, c) for c in found)


def test_every_allowed_edge_is_still_an_import():
    stale = [edge for edge in ALLOWED if edge[0] not in modules() or edge[1] not in edges_of(edge[0])]
    assert not stale, f"allowed but no longer imported: {stale}"


def test_the_scan_sees_a_cycle_closed_inside_a_function(tmp_path):
    """The scan itself, on the shape issue 40 found: a module-level import one way and a deferred
    one back, relative and absolute, with `from . import` naming a module."""
    first = tmp_path / "first"
    first.mkdir()
    src_a = "from . import _probe_b\n"
    src_b = "def f():\n    from ridge.daemon._probe_a import x\n    return x\n"
    with probe_module(first, "ridge.daemon._probe_a", src_a), \
            probe_module(tmp_path, "ridge.daemon._probe_b", src_b):
        g = graph()
        assert g["ridge.daemon._probe_a"] == {"ridge.daemon._probe_b": 1}
        assert g["ridge.daemon._probe_b"] == {"ridge.daemon._probe_a": 2}
        assert ["ridge.daemon._probe_a", "ridge.daemon._probe_b", "ridge.daemon._probe_a"] in cycles(g)
